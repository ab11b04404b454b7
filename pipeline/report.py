"""The fleet health report: one self-contained HTML file (plots as embedded PNGs) built from the tables."""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pipeline import jobs
from pipeline import tables as tbl

STAGE_LABELS = {
    "sensor_to_gateway": "sensor -> gateway",
    "gateway_to_landing": "gateway -> landing",
    "end_to_end": "sensor -> landing",
}


@dataclass
class ReportData:
    first: dt.date
    last: dt.date
    gateways: list[dict[str, Any]]  # per gateway: completeness, missing, reboots, readings, duplicates, ...
    hourly: list[dict[str, Any]]  # per gateway and closed hour: completeness
    latency: list[dict[str, Any]]  # per gateway and stage over the whole range
    series_name: str | None
    series: list[dict[str, Any]]  # 1-minute windows of one device and quantity
    missing_ranges: list[dict[str, Any]]
    quarantine: list[dict[str, Any]]  # per reason


def collect(spark: SparkSession, tables: str, first: dt.date, last: dt.date, series: str | None = None) -> ReportData:
    """Everything the report shows, as small lists of dicts (aggregated by Spark, collected to the driver)."""
    readings = tbl.read_table(spark, tables, "readings", first, last)
    comp = tbl.read_table(spark, tables, "completeness", first, last)
    closed = comp.where("closed")
    per_gw = {
        r["gateway_id"]: r.asDict()
        for r in readings.groupBy("gateway_id")
        .agg(
            F.count(F.lit(1)).alias("readings"),
            F.sum(F.col("copies") - 1).alias("duplicates"),
            F.countDistinct("device").alias("devices"),
            F.sum(F.col("clock_clamped").cast("int")).alias("clamped"),
        )
        .collect()
    }
    for r in (
        closed.groupBy("gateway_id")
        .agg(
            F.sum("received").alias("received"),
            F.sum("expected").alias("expected"),
            F.sum("missing").alias("missing"),
            F.sum(F.col("reboot").cast("int")).alias("reboots"),
        )
        .collect()
    ):
        per_gw.setdefault(r["gateway_id"], {"gateway_id": r["gateway_id"]}).update(r.asDict())
    # latency over the whole range (percentiles cannot be combined from daily ones)
    lat_rows = jobs.latency(readings.withColumn("date", F.lit(first))).collect()
    latency = [r.asDict() for r in sorted(lat_rows, key=lambda r: (r["gateway_id"], r["stage"]))]
    for r in latency:
        if r["stage"] == "end_to_end":
            per_gw.setdefault(r["gateway_id"], {"gateway_id": r["gateway_id"]}).update(
                e2e_p50=r["p50"], e2e_p99=r["p99"]
            )
    gateways = [per_gw[k] for k in sorted(per_gw)]
    hourly = [
        r.asDict()
        for r in closed.groupBy("gateway_id", "period_start")
        .agg((F.sum("received") / F.sum("expected")).alias("completeness"))
        .orderBy("gateway_id", "period_start")
        .collect()
    ]
    ranges = [
        r.asDict()
        for r in comp.where(F.size("missing_ranges") > 0)
        .select("gateway_id", "device", "boot", "period_start", F.explode("missing_ranges").alias("r"))
        .select(
            "gateway_id",
            "device",
            "boot",
            "period_start",
            "r.first",
            "r.last",
            (F.col("r.last") - F.col("r.first") + 1).alias("count"),
        )
        .orderBy(F.col("count").desc(), "gateway_id", "device", "boot", "first")
        .limit(20)
        .collect()
    ]
    quarantine = [
        r.asDict()
        for r in tbl.read_table(spark, tables, "quarantine", first, last)
        .groupBy("reason")
        .count()
        .orderBy(F.col("count").desc(), "reason")
        .limit(20)
        .collect()
    ]
    win = tbl.read_table(spark, tables, "windows", first, last)
    if series:
        gw, device, quantity = series.split("/", 2)
    else:
        # the series with most windows; among those the one that varies most (relative to its level)
        top = (
            win.groupBy("gateway_id", "device", "quantity")
            .agg(
                F.count(F.lit(1)).alias("n"),
                F.coalesce(F.stddev("mean") / F.abs(F.avg("mean")), F.lit(0.0)).alias("variation"),
            )
            .orderBy(F.col("n").desc(), F.col("variation").desc(), "gateway_id", "device", "quantity")
            .first()
        )
        gw, device, quantity = (top["gateway_id"], top["device"], top["quantity"]) if top else (None, None, None)
    points: list[dict[str, Any]] = []
    name = None
    if gw is not None:
        name = f"{gw}/{device}/{quantity}"
        points = [
            r.asDict()
            for r in win.where(
                (F.col("gateway_id") == gw) & (F.col("device") == device) & (F.col("quantity") == quantity)
            )
            .orderBy("window_start")
            .select("window_start", "min", "max", "mean", "unit", "count")
            .collect()
        ]
    return ReportData(first, last, gateways, hourly, latency, name, points, ranges, quarantine)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


MAX_ROWS = 25  # gateways shown in a per-gateway plot: the worst ones when the fleet is larger


def _completeness_pct(g: dict[str, Any]) -> float:
    return 100.0 * g["received"] / g["expected"]


def plots(data: ReportData) -> dict[str, str]:
    """name -> base64 PNG. Per-gateway plots show at most MAX_ROWS gateways, worst first."""
    from matplotlib.figure import Figure

    out: dict[str, str] = {}
    gws = sorted((g for g in data.gateways if g.get("expected")), key=lambda g: (_completeness_pct(g), g["gateway_id"]))
    shown = gws[:MAX_ROWS]
    fig = Figure(figsize=(8, 1.0 + 0.3 * max(1, len(shown))))
    ax = fig.subplots()
    pct = [_completeness_pct(g) for g in shown]
    colors = ["#2a9d8f" if p >= 99.9 else "#e9c46a" if p >= 99 else "#e76f51" for p in pct]
    ax.barh([g["gateway_id"] for g in shown], pct, color=colors)
    low = min(pct, default=100.0)
    left = 0.0 if low < 50 else max(0.0, low - (100 - low) * 0.5 - 0.5)
    for i, (p, g) in enumerate(zip(pct, shown)):
        ax.text(
            left + (100 - left) * 0.01,
            i,
            f"{p:.2f}%   {g['missing']} missing, {g.get('reboots') or 0} reboots",
            va="center",
            fontsize=7,
            color="white" if p - left > (100 - left) * 0.5 else "black",
        )
    ax.set_xlim(left, 100)
    ax.invert_yaxis()
    ax.set_xlabel("readings received / expected from seq, closed periods (%)")
    worst = f" (the {len(shown)} lowest of {len(gws)})" if len(gws) > len(shown) else ""
    ax.set_title(f"Completeness per gateway{worst}")
    out["completeness"] = _png(fig)

    # per gateway and hour, as a heat map (the worst gateways, same order as above)
    hours = sorted({h["period_start"] for h in data.hourly})
    names = [g["gateway_id"] for g in shown]
    grid = [[float("nan")] * len(hours) for _ in names]
    col = {h: i for i, h in enumerate(hours)}
    row = {n: i for i, n in enumerate(names)}
    for h in data.hourly:
        if h["gateway_id"] in row:
            grid[row[h["gateway_id"]]][col[h["period_start"]]] = 100.0 * h["completeness"]
    fig = Figure(figsize=(8, 1.2 + 0.25 * max(1, len(names))))
    ax = fig.subplots()
    if hours and names:
        values = [v for r in grid for v in r if v == v]
        vmin = min(min(values, default=100.0), 99.0)
        image = ax.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=vmin, vmax=100.0, interpolation="nearest")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        step = max(1, len(hours) // 12)
        ax.set_xticks(
            range(0, len(hours), step),
            [hours[i].strftime("%m-%d %H:00") for i in range(0, len(hours), step)],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        fig.colorbar(image, ax=ax, label="%", fraction=0.04)
    ax.set_title("Completeness per hour (closed hours)")
    out["completeness_hourly"] = _png(fig)

    # latency: p50 and p99 per stage, the gateways with the slowest p99 gateway -> landing first
    by = {(r["gateway_id"], r["stage"]): r for r in data.latency}
    lat_gws = sorted(
        {r["gateway_id"] for r in data.latency}, key=lambda g: -(by.get((g, "gateway_to_landing")) or {"p99": 0})["p99"]
    )[:MAX_ROWS]
    fig = Figure(figsize=(9, 1.4 + 0.3 * max(1, len(lat_gws))))
    axes = fig.subplots(1, 3, sharey=True)
    ys = list(range(len(lat_gws)))
    for ax, stage in zip(axes, STAGE_LABELS):
        p50 = [by[(g, stage)]["p50"] if (g, stage) in by else float("nan") for g in lat_gws]
        p99 = [by[(g, stage)]["p99"] if (g, stage) in by else float("nan") for g in lat_gws]
        ax.barh([y - 0.2 for y in ys], p50, height=0.4, color="#264653", label="p50")
        ax.barh([y + 0.2 for y in ys], p99, height=0.4, color="#e76f51", label="p99")
        ax.set_yticks(ys, lat_gws, fontsize=7)
        ax.set_title(STAGE_LABELS[stage], fontsize=9)
        ax.set_xlabel("seconds")
        positive = [v for v in p50 + p99 if v == v and v > 0]
        if positive and max(positive) / max(min(positive), 1e-9) > 100:
            ax.set_xscale("log")
    axes[0].invert_yaxis()
    axes[-1].legend(fontsize=7)
    n_lat = len({r["gateway_id"] for r in data.latency})
    fig.suptitle("Latency per gateway" + (f" (the {len(lat_gws)} slowest of {n_lat})" if n_lat > len(lat_gws) else ""))
    out["latency"] = _png(fig)

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    if data.series:
        xs = [p["window_start"] for p in data.series]
        ax.fill_between(
            xs,
            [p["min"] for p in data.series],
            [p["max"] for p in data.series],
            color="#a8dadc",
            label="min..max per minute",
        )
        ax.plot(xs, [p["mean"] for p in data.series], color="#1d3557", linewidth=1, label="mean per minute")
        ax.set_ylabel(data.series[0]["unit"])
        ax.legend(fontsize=7)
    ax.set_title(f"Readings: {data.series_name or 'no data'}")
    fig.autofmt_xdate()
    out["series"] = _png(fig)
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(data: ReportData, generated: dt.datetime | None = None) -> str:
    images = plots(data)

    def img(name: str, alt: str) -> str:
        return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{images[name]}">'

    total_readings = sum(g.get("readings") or 0 for g in data.gateways)
    total_expected = sum(g.get("expected") or 0 for g in data.gateways)
    total_received = sum(g.get("received") or 0 for g in data.gateways)
    overall = f"{100.0 * total_received / total_expected:.2f}%" if total_expected else "-"
    gw_rows = [
        [
            g["gateway_id"],
            g.get("devices"),
            g.get("readings"),
            g.get("duplicates"),
            f"{100.0 * g['received'] / g['expected']:.2f}%" if g.get("expected") else "-",
            g.get("missing"),
            g.get("reboots"),
            g.get("clamped"),
            g.get("e2e_p50"),
            g.get("e2e_p99"),
        ]
        for g in data.gateways
    ]
    gen = f" Generated {generated.strftime('%Y-%m-%d %H:%M UTC')}." if generated else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Fleet health {data.first} .. {data.last}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
th {{ background: #f0f0f0; }} td:first-child {{ text-align: left; }}
.kpi {{ display: inline-block; margin-right: 2em; }} .kpi b {{ font-size: 1.6em; display: block; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>Fleet health, {data.first} .. {data.last} (UTC)</h1>
<p>From the pipeline's tables.{gen} Completeness counts closed periods only.</p>
<div class="kpi"><b>{len(data.gateways)}</b>gateways</div>
<div class="kpi"><b>{total_readings}</b>readings</div>
<div class="kpi"><b>{overall}</b>complete</div>
<div class="kpi"><b>{sum(q["count"] for q in data.quarantine)}</b>quarantined</div>
<h2>Completeness</h2>
{img("completeness", "completeness per gateway")}
{img("completeness_hourly", "completeness per hour")}
<h2>Latency</h2>
{img("latency", "latency percentiles per gateway")}
<h2>Readings</h2>
{img("series", "reading series")}
<h2>Gateways</h2>
{
        _table(
            [
                "gateway",
                "devices",
                "readings",
                "duplicates removed",
                "complete",
                "missing",
                "reboots",
                "clamped clocks",
                "e2e p50 s",
                "e2e p99 s",
            ],
            gw_rows,
        )
    }
<h2>Largest gaps</h2>
{
        _table(
            ["gateway", "device", "boot", "hour", "first seq", "last seq", "readings"],
            [
                [r["gateway_id"], r["device"], r["boot"], r["period_start"], r["first"], r["last"], r["count"]]
                for r in data.missing_ranges
            ],
        )
        if data.missing_ranges
        else "<p>No gaps.</p>"
    }
<h2>Quarantine</h2>
{
        _table(["reason", "lines"], [[q["reason"], q["count"]] for q in data.quarantine])
        if data.quarantine
        else "<p>Nothing quarantined.</p>"
    }
</body></html>
"""


def write_report(
    spark: SparkSession,
    tables: str,
    first: dt.date,
    last: dt.date,
    out: str,
    series: str | None = None,
    generated: dt.datetime | None = None,
) -> str:
    data = collect(spark, tables, first, last, series)
    Path(out).write_text(render(data, generated), encoding="utf-8")
    return out
