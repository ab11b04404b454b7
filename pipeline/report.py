"""The fleet health report: one self-contained HTML file (plots as embedded PNGs) built from the tables."""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession, Window
from pyspark.sql import functions as F

from pipeline import jobs
from pipeline import tables as tbl

SILENCE = 600.0  # seconds without a reading before a device counts as silent (missing data)
# Okabe-Ito: a palette readable with every common colour-vision deficiency
OI = {"orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442", "blue": "#0072B2",
      "vermillion": "#D55E00", "purple": "#CC79A7", "black": "#000000", "grey": "#999999"}  # fmt: skip

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
    now: dt.datetime | None = None  # the newest event time in the range: "now" for what is missing
    silence: float = SILENCE
    devices: list[dict[str, Any]] = field(default_factory=list)  # per device: first, last, readings
    silences: list[dict[str, Any]] = field(default_factory=list)  # per device: start, end of each silence
    latency_hourly: list[dict[str, Any]] = field(default_factory=list)  # fleet-wide, per stage and hour


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
    for lat in latency:
        if lat["stage"] == "end_to_end":
            per_gw.setdefault(lat["gateway_id"], {"gateway_id": lat["gateway_id"]}).update(
                e2e_p50=lat["p50"], e2e_p99=lat["p99"]
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
    gw: str | None
    device: str | None
    quantity: str | None
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
    data = ReportData(first, last, gateways, hourly, latency, name, points, ranges, quarantine)
    _collect_silences(readings, data)
    for rows in (data.gateways, data.hourly, data.latency, data.series, data.missing_ranges, data.devices,
                 data.silences, data.latency_hourly):  # fmt: skip
        for row in rows:
            for k, v in row.items():
                if isinstance(v, dt.datetime):
                    row[k] = _utc(v)
    data.now = _utc(data.now) if data.now else None
    return data


def _utc(value: dt.datetime) -> dt.datetime:
    """A timestamp as PySpark collects it (naive, the Python process's local time) -> naive UTC."""
    if value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return dt.datetime.fromtimestamp(value.timestamp(), dt.UTC).replace(tzinfo=None)


def _collect_silences(readings: Any, data: ReportData) -> None:
    """Devices' first/last readings, their silences (no reading for more than ``SILENCE`` seconds, from the lag
    of ``event_time`` per device), and fleet-wide latency per stage and hour (exact percentiles)."""
    devices = readings.groupBy("gateway_id", "device").agg(
        F.min("event_time").alias("first"), F.max("event_time").alias("last"), F.count(F.lit(1)).alias("readings")
    )
    data.devices = [r.asDict() for r in devices.orderBy("gateway_id", "device").collect()]
    data.now = max((d["last"] for d in data.devices), default=None)  # made UTC with the rest by collect()
    w = Window.partitionBy("gateway_id", "device").orderBy("event_time")
    gaps = (
        readings.select("gateway_id", "device", "event_time")
        .withColumn("start", F.lag("event_time").over(w))
        .where(F.unix_micros("event_time") - F.unix_micros("start") > int(SILENCE * 1e6))
        .select("gateway_id", "device", "start", F.col("event_time").alias("end"))
        .limit(50_000)
    )
    data.silences = [r.asDict() for r in gaps.collect()]
    hourly = jobs.latency(readings.withColumn("gateway_id", F.lit("fleet")).withColumn(
        "date", F.date_trunc("hour", "event_time")))
    data.latency_hourly = [r.asDict() for r in hourly.orderBy("stage", "date").collect()]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


MAX_ROWS = 25  # gateways shown in a per-gateway plot: the worst ones when the fleet is larger


def _completeness_pct(g: dict[str, Any]) -> float:
    return 100.0 * g["received"] / g["expected"]


Interval = tuple[dt.datetime, dt.datetime]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The times in both sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def device_silences(data: ReportData) -> dict[tuple[str, str], list[Interval]]:
    """Per (gateway, device): its silences, sorted: the gaps between readings longer than ``data.silence``, from
    the range's start to a late first reading, and from its last reading to ``now`` (still missing)."""
    start = dt.datetime(data.first.year, data.first.month, data.first.day)
    out: dict[tuple[str, str], list[Interval]] = {(d["gateway_id"], d["device"]): [] for d in data.devices}
    limit = dt.timedelta(seconds=data.silence)
    for d in data.devices:
        if d["first"] - start > limit:
            out[(d["gateway_id"], d["device"])].append((start, d["first"]))
    for g in data.silences:
        out.setdefault((g["gateway_id"], g["device"]), []).append((g["start"], g["end"]))
    for d in data.devices:
        if data.now is not None and data.now - d["last"] > limit:
            out[(d["gateway_id"], d["device"])].append((d["last"], data.now))
    return {k: sorted(v) for k, v in out.items()}


def gateway_outages(silences: dict[tuple[str, str], list[Interval]]) -> dict[str, list[Interval]]:
    """Per gateway: when every one of its devices was silent at once (the gateway, or its uplink, was out)."""
    by_gw: dict[str, list[list[Interval]]] = {}
    for (gw, _), intervals in silences.items():
        by_gw.setdefault(gw, []).append(intervals)
    out = {}
    for gw, lists in by_gw.items():
        common = lists[0]
        for other in lists[1:]:
            common = _intersect(common, other)
        out[gw] = common
    return out


def _seconds(intervals: list[Interval]) -> float:
    return sum((b - a).total_seconds() for a, b in intervals)


def plots(data: ReportData) -> dict[str, str]:
    """name -> base64 PNG: the outage timeline, completeness per gateway, latency per stage and hour, one series."""
    from matplotlib import dates as mdates
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    out: dict[str, str] = {}
    silences = device_silences(data)
    outages = gateway_outages(silences)
    utc = "time (UTC)"

    # 1. outage timeline: one row per gateway with a silence, the most silent device-time first
    per_gw: dict[str, float] = {}
    for (gw, _), intervals in silences.items():
        per_gw[gw] = per_gw.get(gw, 0.0) + _seconds(intervals)
    rows = sorted((g for g, sec in per_gw.items() if sec > 0), key=lambda g: (-per_gw[g], g))
    fig = Figure(figsize=(10, 1.6 + 0.16 * max(1, len(rows))), layout="constrained")
    ax = fig.subplots()
    for y, gw in enumerate(rows):
        for (g, _), intervals in silences.items():
            if g == gw:
                ax.broken_barh([(mdates.date2num(a), mdates.date2num(b) - mdates.date2num(a)) for a, b in intervals],
                               (y - 0.35, 0.7), color=OI["orange"], alpha=0.45, linewidth=0)  # fmt: skip
        ax.broken_barh([(mdates.date2num(a), mdates.date2num(b) - mdates.date2num(a)) for a, b in outages.get(gw, [])],
                       (y - 0.35, 0.7), color=OI["vermillion"], linewidth=0)  # fmt: skip
    ax.set_yticks(range(len(rows)), rows, fontsize=6 if len(rows) > 40 else 8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(mdates.date2num(dt.datetime(data.first.year, data.first.month, data.first.day)),
                mdates.date2num(data.now or dt.datetime(data.last.year, data.last.month, data.last.day)))  # fmt: skip
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    ax.set_xlabel(utc)
    ax.legend(handles=[Patch(color=OI["vermillion"], label="gateway out (all its devices silent)"),
                       Patch(color=OI["orange"], alpha=0.45, label=f"a device silent > {data.silence / 60:.0f} min")],
              fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2)  # fmt: skip
    quiet = len({d["gateway_id"] for d in data.devices}) - len(rows)
    ax.set_title(f"Silences per gateway, most silent first ({len(rows)} with silences, {quiet} without)", fontsize=10,
                 loc="left")
    out["timeline"] = _png(fig)

    # 2. completeness per gateway (closed periods), the lowest first
    gws = sorted((g for g in data.gateways if g.get("expected")), key=lambda g: (_completeness_pct(g), g["gateway_id"]))
    shown = gws[:MAX_ROWS]
    fig = Figure(figsize=(10, 1.2 + 0.28 * max(1, len(shown))), layout="constrained")
    ax = fig.subplots()
    pct = [_completeness_pct(g) for g in shown]
    colors = [OI["blue"] if p >= 99.9 else OI["orange"] if p >= 99 else OI["vermillion"] for p in pct]
    ax.barh([g["gateway_id"] for g in shown], pct, color=colors)
    low = min(pct, default=100.0)
    left = 0.0 if low < 50 else max(0.0, low - (100 - low) * 0.5 - 0.5)
    for i, (share, gw_row) in enumerate(zip(pct, shown)):
        ax.text(left + (100 - left) * 0.01, i,
                f"{share:.2f}%   {gw_row['missing']} missing, {gw_row.get('reboots') or 0} reboots", va="center",
                fontsize=7, color="white" if share - left > (100 - left) * 0.5 else "black")  # fmt: skip
    ax.set_xlim(left, 100)
    ax.invert_yaxis()
    ax.set_xlabel("readings received / expected from seq, closed hours (%)")
    worst = f" (the {len(shown)} lowest of {len(gws)})" if len(gws) > len(shown) else ""
    ax.set_title(f"Completeness per gateway{worst}", fontsize=10)
    out["completeness"] = _png(fig)

    # 3. latency per stage and hour, fleet-wide: p50, p99 and max; gateway outages shaded, not averaged in
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    spans = [iv for ivs in outages.values() for iv in ivs]
    for ax, stage in zip(axes, STAGE_LABELS):
        rows_s = [r for r in data.latency_hourly if r["stage"] == stage]
        xs = [r["date"] for r in rows_s]
        lines = (("p50", OI["blue"], "-"), ("p99", OI["orange"], "-"), ("max", OI["vermillion"], "--"))
        for key, color, style in lines:
            ax.plot(xs, [max(r[key], 1e-3) for r in rows_s], style, color=color, label=key, linewidth=1.2,
                    marker="." if len(xs) < 30 else None)  # fmt: skip
        for a, b in spans:
            ax.axvspan(a, b, color=OI["grey"], alpha=0.25, linewidth=0)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{STAGE_LABELS[stage]}: per hour of event time, all gateways", fontsize=9, loc="left")
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(Patch(color=OI["grey"], alpha=0.25))
    labels.append("a gateway out")
    axes[0].legend(handles, labels, fontsize=7, ncol=4, loc="upper right")
    axes[-1].xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    axes[-1].set_xlabel(utc)
    out["latency"] = _png(fig)

    # 4. one device's readings: 1-minute mean and min..max, broken where no window exists (gaps stay gaps)
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.subplots()
    if data.series:
        xs, lo, hi, mean = [], [], [], []
        starts = [p["window_start"] for p in data.series]
        steps = sorted((b - a).total_seconds() for a, b in itertools.pairwise(starts))
        gap = max(120.0, 2.5 * steps[len(steps) // 2]) if steps else 120.0  # 2.5 x the usual step: a gap
        prev = None
        for p in data.series:
            if prev is not None and (p["window_start"] - prev).total_seconds() > gap:
                xs.append(prev + dt.timedelta(seconds=60))
                lo.append(float("nan"))
                hi.append(float("nan"))
                mean.append(float("nan"))
            xs.append(p["window_start"])
            lo.append(p["min"])
            hi.append(p["max"])
            mean.append(p["mean"])
            prev = p["window_start"]
        ax.fill_between(xs, lo, hi, color=OI["sky"], alpha=0.5, linewidth=0, label="min..max per minute")
        ax.plot(xs, mean, color=OI["blue"], linewidth=1, label="mean per minute")
        ax.set_ylabel(f"{data.series_name.rsplit('/', 1)[-1] if data.series_name else ''} ({data.series[0]['unit']})")
        ax.legend(fontsize=7)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    ax.set_xlabel(utc)
    ax.set_title(f"Readings of {data.series_name or 'no data'} (gaps left blank)", fontsize=10)
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


def _ago(now: dt.datetime | None, then: dt.datetime) -> str:
    """``now - then`` as ``3d 04:05`` (days, hours:minutes)."""
    if now is None:
        return "-"
    minutes = int((now - then).total_seconds() // 60)
    days, rest = divmod(minutes, 1440)
    return (f"{days}d " if days else "") + f"{rest // 60:02d}:{rest % 60:02d}"


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
    silences = device_silences(data)
    outages = gateway_outages(silences)
    missing = [d for d in data.devices if data.now is not None
               and (data.now - d["last"]).total_seconds() > data.silence]  # fmt: skip
    missing.sort(key=lambda d: (d["last"], d["gateway_id"], d["device"]))
    devices_of: dict[str, int] = {}
    for d in data.devices:
        devices_of[d["gateway_id"]] = devices_of.get(d["gateway_id"], 0) + 1
    gw_missing: dict[str, list[dict[str, Any]]] = {}
    for d in missing:
        gw_missing.setdefault(d["gateway_id"], []).append(d)
    missing_gw_rows = []
    for gw, ds in gw_missing.items():
        since = min(x["last"] for x in ds)
        out = "yes" if len(ds) == devices_of[gw] else "no"
        missing_gw_rows.append([gw, f"{len(ds)} of {devices_of[gw]}", since, _ago(data.now, since), out])
    missing_gw_rows.sort(key=lambda r: (r[2], r[0]))
    device_rows = [[d["gateway_id"], d["device"], d["last"], _ago(data.now, d["last"]), d["readings"]]
                   for d in missing[:200]]  # fmt: skip
    missing_html = (
        _table(["gateway", "devices missing", "since (UTC)", "for", "whole gateway out"], missing_gw_rows)
        + _table(["gateway", "device", "last reading (UTC)", "silent for", "readings in range"], device_rows)
        if missing
        else "<p><b>Nothing missing now:</b> every device sent a reading in the last "
        f"{data.silence / 60:.0f} minutes.</p>"
    )
    by = {(r["gateway_id"], r["stage"]): r for r in data.latency}
    slow = sorted({r["gateway_id"] for r in data.latency},
                  key=lambda g: -(by.get((g, "gateway_to_landing")) or {"max": 0})["max"])[:MAX_ROWS]  # fmt: skip
    latency_html = _table(
        ["gateway", *[f"{STAGE_LABELS[s]} {k} s" for s in STAGE_LABELS for k in ("p50", "p99", "max")], "outages"],
        [[g, *[(by.get((g, s)) or {}).get(k) for s in STAGE_LABELS for k in ("p50", "p99", "max")],
          len(outages.get(g, []))] for g in slow],
    )  # fmt: skip
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
<h2>Missing data now</h2>
<p>"Now" is the newest reading in the range, {_fmt(data.now)} UTC; a device is missing when it has sent nothing for
more than {data.silence / 60:.0f} minutes.</p>
{missing_html}
<h2>Outages</h2>
{img("timeline", "silences per gateway")}
<h2>Completeness</h2>
{img("completeness", "completeness per gateway")}
<h2>Latency</h2>
{img("latency", "latency per stage and hour")}
{latency_html}
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
