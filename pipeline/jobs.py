"""The batch jobs (PySpark DataFrame API, UTC everywhere).

    landing (JSON lines, by arrival date)
      -> clean       every valid copy, by event date; malformed lines -> quarantine (by arrival date) with a reason
      -> readings    dedup on (gateway_id, device, boot, seq), the earliest arrival kept, copies counted
      -> seq_runs    per device, boot and day, the runs of consecutive seq: what rebuilds of other days read
      -> windows     per device and quantity, 1-minute event-time windows: count, min, max, mean
      -> completeness  per device, boot and hour: expected vs received from seq, missing ranges, reboots
      -> latency     per gateway and day: percentiles of sensor -> gateway -> landing

Every table is Parquet partitioned by ``date`` and rebuilt for a date range: a run for ``--from A --to B`` replaces
exactly the partitions A..B, from the landing files of arrival dates A-1 .. B+lateness, so re-running folds in data
that arrived late and running twice gives the same tables.

The transformations (``parse_landing``, ``clean``, ``dedup``, ``windows``, ``completeness``, ``latency``) take and
return DataFrames and run no action, so ``pipeline.streaming`` reuses them.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from pipeline import tables as tbl
from pipeline.schema import ENVELOPE, KEY, LANDING

log = logging.getLogger("pipeline.jobs")

STAGES = ("clean", "dedup", "windows", "completeness", "latency")
RFC3339 = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$"
QUANTITY_NAME = r"^[a-z][a-z0-9_]*$"


@dataclass
class JobConfig:
    landing: str = "var/pipeline/landing"
    tables: str = "var/pipeline/tables"
    lateness: float = 2 * 86400.0  # landing dates read past the range: how late data may arrive and still count
    max_clock_skew: float = 300.0  # |sensor_time - gateway_time| above this: the sensor clock is clamped
    grace: float = 3600.0  # a completeness period is closed once its end is this far behind as_of
    as_of: dt.datetime | None = None  # "now" for closed periods (default: the wall clock at the run)
    conf: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# transformations


def _micros(col: Column) -> Column:
    return F.unix_micros(col)


def _seconds_between(later: Column, earlier: Column) -> Column:
    return (_micros(later) - _micros(earlier)) / F.lit(1_000_000.0)


def _timestamp(text: Column) -> Column:
    """RFC 3339 (UTC ``Z`` or an offset; at most microseconds) -> timestamp; anything else -> null."""
    return F.when(text.rlike(RFC3339), F.try_to_timestamp(text))


def parse_landing(lines: DataFrame) -> DataFrame:
    """Landing lines as text (``value``, ``source_file``; the streaming file source) -> one row per line with the
    envelope fields parsed and ``reasons``: every check the line fails (empty for a valid reading)."""
    landed = F.from_json(F.col("value"), LANDING, {"mode": "PERMISSIVE"})
    df = lines.select(landed.alias("l"), "value", "source_file").select(
        F.col("l.topic").alias("topic"),
        F.try_to_timestamp(F.col("l.arrival")).alias("arrival_time"),
        F.col("l.msg_id").alias("msg_id"),
        F.col("l.payload").alias("payload"),
        F.col("l.payload_b64").alias("payload_b64"),
        "value",
        "source_file",
    )
    return _parse_envelope(df)


def parse_landed(landed: DataFrame) -> DataFrame:
    """Landing lines read by Spark's JSON source (:func:`pipeline.tables.read_landing`: the ``LANDING`` fields,
    ``_corrupt_record``, ``source_file``) -> as :func:`parse_landing`. The JSON source parses each line straight
    from the file's bytes (one pass less than text + ``from_json``); a line that is not a JSON object keeps its
    text in ``_corrupt_record``, and one without ``topic`` or ``arrival`` is re-serialised for the quarantine."""
    arrival_time = F.try_to_timestamp(F.col("arrival"))
    bad_line = F.col("topic").isNull() | arrival_time.isNull()
    rebuilt = F.to_json(F.struct(*[F.col(f.name) for f in LANDING.fields]))
    df = landed.select(
        "topic",
        arrival_time.alias("arrival_time"),
        "msg_id",
        "payload",
        "payload_b64",
        F.when(bad_line, F.coalesce(F.col("_corrupt_record"), rebuilt)).alias("value"),
        "source_file",
    )
    return _parse_envelope(df)


def _parse_envelope(df: DataFrame) -> DataFrame:
    """Rows with ``topic``, ``arrival_time``, ``msg_id``, ``payload``, ``payload_b64``, ``value`` (the raw line),
    ``source_file`` -> the envelope parsed from ``payload`` and ``reasons``."""
    envelope = F.from_json(F.col("payload"), ENVELOPE, {"mode": "PERMISSIVE", "allowNonNumericNumbers": "false"})
    df = df.withColumn("e", envelope)
    e = F.col("e")

    def field_reason(name: str) -> Column:
        raw = F.get_json_object(F.col("payload"), f"$.{name}")
        return F.when(e[name].isNull(), F.when(raw.isNull(), F.lit(f"missing:{name}")).otherwise(f"bad_type:{name}"))

    gateway_time = _timestamp(e["gateway_time"])
    sensor_time = _timestamp(e["sensor_time"])
    levels = F.split(F.col("topic"), "/")
    n = F.size(levels)
    topic_ok = (n >= 3) & (F.element_at(levels, -2) == e["gateway_id"]) & (F.element_at(levels, -1) == e["device"])
    entries = F.map_entries(e["values"])
    bad_values = F.transform(
        F.filter(entries, lambda x: x["value"]["value"].isNull() | x["value"]["unit"].isNull()),
        lambda x: F.concat(F.lit("bad_value:"), x["key"]),
    )
    bad_names = F.transform(
        F.filter(entries, lambda x: ~x["key"].rlike(QUANTITY_NAME)), lambda x: F.concat(F.lit("bad_name:"), x["key"])
    )
    checks = [field_reason(name) for name in ("v", "gateway_id", "device", "boot", "seq", "gateway_time", "values")]
    checks += [
        F.when(
            e["sensor_time"].isNull() & ~F.array_contains(F.json_object_keys(F.col("payload")), "sensor_time"),
            F.lit("missing:sensor_time"),
        ),
        F.when(e["v"] != 1, F.lit("unsupported_version")),
        F.when(e["boot"] < 0, F.lit("negative:boot")),
        F.when(e["seq"] < 0, F.lit("negative:seq")),
        F.when(e["gateway_time"].isNotNull() & gateway_time.isNull(), F.lit("bad_time:gateway_time")),
        F.when(e["sensor_time"].isNotNull() & sensor_time.isNull(), F.lit("bad_time:sensor_time")),
        F.when(F.size(e["values"]) == 0, F.lit("no_values")),
        F.when(e["gateway_id"].isNotNull() & e["device"].isNotNull() & ~topic_ok, F.lit("topic_mismatch")),
    ]
    reasons = F.concat(
        F.filter(F.array(*checks), lambda x: x.isNotNull()),
        F.coalesce(bad_names, F.array()),
        F.coalesce(bad_values, F.array()),
    )
    not_object = e["v"].isNull() & F.json_object_keys(F.col("payload")).isNull()
    reasons = (
        F.when(F.col("topic").isNull() | F.col("arrival_time").isNull(), F.array(F.lit("bad_landing_line")))
        .when(F.col("payload").isNull(), F.array(F.lit("not_utf8")))
        .when(not_object, F.array(F.lit("not_json_object")))
        .otherwise(reasons)
    )
    return df.select(
        "topic",
        "arrival_time",
        "msg_id",
        "payload",
        "payload_b64",
        "value",
        "source_file",
        e["gateway_id"].alias("gateway_id"),
        e["device"].alias("device"),
        e["boot"].alias("boot"),
        e["seq"].alias("seq"),
        sensor_time.alias("sensor_time"),
        gateway_time.alias("gateway_time"),
        e["values"].alias("values"),
        reasons.alias("reasons"),
    )


def clean(parsed: DataFrame, max_clock_skew: float) -> tuple[DataFrame, DataFrame]:
    """(valid readings with their event time, quarantined lines with the reason)."""
    skew = F.abs(_seconds_between(F.col("sensor_time"), F.col("gateway_time")))
    clamped = F.col("sensor_time").isNotNull() & (skew > F.lit(float(max_clock_skew)))
    valid = (
        parsed.where(F.size("reasons") == 0)
        .select(
            *KEY,
            "sensor_time",
            "gateway_time",
            F.when(F.col("sensor_time").isNull() | clamped, F.col("gateway_time"))
            .otherwise(F.col("sensor_time"))
            .alias("event_time"),
            clamped.alias("clock_clamped"),
            "values",
            "arrival_time",
            "topic",
            "msg_id",
        )
        .withColumn("date", F.to_date("event_time"))
    )
    landing_date = F.coalesce(
        F.to_date("arrival_time"),
        F.to_date(F.regexp_extract(F.col("source_file"), r"date=(\d{4}-\d{2}-\d{2})", 1)),
    )
    quarantine = parsed.where(F.size("reasons") > 0).select(
        "arrival_time",
        "topic",
        "msg_id",
        F.when(F.array_contains("reasons", "bad_landing_line"), F.col("value"))
        .otherwise(F.col("payload"))
        .alias("payload"),
        "payload_b64",
        F.array_join("reasons", ",").alias("reason"),
        "source_file",
        landing_date.alias("date"),
    )
    return valid, quarantine


def dedup(clean_rows: DataFrame) -> DataFrame:
    """One row per reading key: the earliest arrival (ties broken by topic, msg_id), with ``copies``."""
    w = Window.partitionBy(*KEY).orderBy(
        F.col("arrival_time").asc(), F.col("topic").asc(), F.col("msg_id").asc_nulls_last()
    )
    counted = clean_rows.withColumn("rank", F.row_number().over(w)).withColumn(
        "copies", F.count(F.lit(1)).over(Window.partitionBy(*KEY))
    )
    return counted.where(F.col("rank") == 1).drop("rank")


def windows(readings: DataFrame, duration: str = "1 minute") -> DataFrame:
    """Per (gateway, device, quantity, unit) and event-time window: count, min, max, mean."""
    exploded = readings.select("gateway_id", "device", "event_time", F.explode("values").alias("quantity", "v")).select(
        "gateway_id", "device", "event_time", "quantity", F.col("v.unit").alias("unit"), F.col("v.value").alias("value")
    )
    agg = exploded.groupBy("gateway_id", "device", "quantity", "unit", F.window("event_time", duration).alias("w")).agg(
        F.count(F.lit(1)).alias("count"),
        F.min("value").alias("min"),
        F.max("value").alias("max"),
        F.avg("value").alias("mean"),
    )
    return agg.select(
        "gateway_id",
        "device",
        "quantity",
        "unit",
        F.col("w.start").alias("window_start"),
        F.col("w.end").alias("window_end"),
        "count",
        "min",
        "max",
        "mean",
        F.to_date(F.col("w.start")).alias("date"),
    )


def seq_runs(readings: DataFrame) -> DataFrame:
    """Per (gateway, device, boot, date): each run of consecutive ``seq`` present (``first``..``last``).

    The state completeness reads from outside a rebuilt range: a few rows per device and day, one more per gap."""
    day = Window.partitionBy("gateway_id", "device", "boot", "date").orderBy("seq")
    r = readings.select("gateway_id", "device", "boot", "seq", "date").withColumn(
        "run", F.col("seq") - F.row_number().over(day)
    )
    return r.groupBy("gateway_id", "device", "boot", "date", "run").agg(
        F.min("seq").alias("first"), F.max("seq").alias("last")
    ).select("gateway_id", "device", "boot", "first", "last", "date")


def completeness(
    readings: DataFrame, as_of: dt.datetime, grace: float, period: str = "hour", history: DataFrame | None = None
) -> DataFrame:
    """Per (gateway, device, boot, period): readings received vs expected from ``seq``.

    Within a boot, a jump from seq a to seq b > a+1 is the missing range a+1..b-1, counted in the period of the
    reading that reveals it (b). A boot with an earlier boot of the same device in the data is a reboot: seq
    restarted at 0, so a first reading with seq s > 0 reveals the missing range 0..s-1. Readings lost after a
    boot's last received one cannot be seen from seq. ``closed`` says the period ended at least ``grace`` before
    ``as_of``; an open period may still gain late readings.

    ``history`` (``seq_runs`` rows of every date outside ``readings``' range, however far back or ahead) stands in
    for the readings not passed: the last seq of each run is the only one that can precede a reading of the range,
    and its boot tells which boot came first. With it, a range gives the rows a run over all the data gives."""
    device = Window.partitionBy("gateway_id", "device")
    boot = Window.partitionBy("gateway_id", "device", "boot").orderBy("seq")
    r = readings.select("gateway_id", "device", "boot", "seq", "event_time", F.lit(False).alias("state"))
    if history is not None:
        # stand-ins: one row per run outside the range, at its last seq (no event time; dropped after the windows)
        r = r.unionByName(
            history.select(
                "gateway_id",
                "device",
                "boot",
                F.col("last").alias("seq"),
                F.lit(None).cast("timestamp").alias("event_time"),
                F.lit(True).alias("state"),
            )
        )
    r = r.withColumn("first_boot", F.min("boot").over(device)).withColumn("prev", F.lag("seq").over(boot))
    r = r.where(~F.col("state"))
    reboot_start = F.col("prev").isNull() & (F.col("boot") > F.col("first_boot"))
    gap_first = F.when(reboot_start & (F.col("seq") > 0), F.lit(0).cast("long")).when(
        F.col("seq") - F.col("prev") > 1, F.col("prev") + 1
    )
    r = r.select(
        "gateway_id",
        "device",
        "boot",
        "seq",
        F.date_trunc(period, "event_time").alias("period_start"),
        reboot_start.alias("reboot_start"),
        gap_first.alias("gap_first"),
        (F.col("seq") - 1).alias("gap_last"),
    )
    agg = r.groupBy("gateway_id", "device", "boot", "period_start").agg(
        F.min("seq").alias("first_seq"),
        F.max("seq").alias("last_seq"),
        F.count(F.lit(1)).alias("received"),
        F.sum(F.coalesce(F.col("gap_last") - F.col("gap_first") + 1, F.lit(0))).alias("missing"),
        F.array_sort(
            F.collect_list(
                F.when(
                    F.col("gap_first").isNotNull(),
                    F.struct(F.col("gap_first").alias("first"), F.col("gap_last").alias("last")),
                )
            )
        ).alias("missing_ranges"),
        F.max("reboot_start").alias("reboot"),
    )
    period_end = F.col("period_start") + F.expr(f"INTERVAL 1 {period.upper()}")
    aware = as_of if as_of.tzinfo else as_of.replace(tzinfo=dt.UTC)
    as_of_micros = (aware - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
    return agg.select(
        "gateway_id",
        "device",
        "boot",
        "period_start",
        period_end.alias("period_end"),
        "first_seq",
        "last_seq",
        "received",
        "missing",
        (F.col("received") + F.col("missing")).alias("expected"),
        (F.col("received") / (F.col("received") + F.col("missing"))).alias("completeness"),
        "missing_ranges",
        "reboot",
        (_micros(period_end) + F.lit(int(grace * 1_000_000)) <= F.lit(as_of_micros)).alias("closed"),
        F.to_date("period_start").alias("date"),
    )


def latency(readings: DataFrame) -> DataFrame:
    """Per (gateway, event date, stage) latency percentiles in seconds. Stages: ``sensor_to_gateway`` and
    ``end_to_end`` (sensor -> landing) from readings with a trusted sensor clock (not clamped, not null), and
    ``gateway_to_landing`` from every reading (first arrival: store-and-forward delay shows here)."""
    trusted = F.col("sensor_time").isNotNull() & ~F.col("clock_clamped")
    stages = F.array(
        F.struct(
            F.lit("sensor_to_gateway").alias("stage"),
            F.when(trusted, _seconds_between(F.col("gateway_time"), F.col("sensor_time"))).alias("s"),
        ),
        F.struct(
            F.lit("gateway_to_landing").alias("stage"),
            _seconds_between(F.col("arrival_time"), F.col("gateway_time")).alias("s"),
        ),
        F.struct(
            F.lit("end_to_end").alias("stage"),
            F.when(trusted, _seconds_between(F.col("arrival_time"), F.col("sensor_time"))).alias("s"),
        ),
    )
    long = (
        readings.select("gateway_id", "date", F.explode(stages).alias("x"))
        .select("gateway_id", "date", F.col("x.stage").alias("stage"), F.col("x.s").alias("s"))
        .where(F.col("s").isNotNull())
    )
    agg = long.groupBy("gateway_id", "date", "stage").agg(
        F.count(F.lit(1)).alias("count"),
        F.percentile(F.col("s"), [0.5, 0.9, 0.99]).alias("p"),
        F.max("s").alias("max"),
    )
    return agg.select(
        "gateway_id",
        "stage",
        "count",
        F.col("p")[0].alias("p50"),
        F.col("p")[1].alias("p90"),
        F.col("p")[2].alias("p99"),
        "max",
        "date",
    )


# ---------------------------------------------------------------------------------------------------------------
# jobs: read the inputs of a date range, write the outputs of that range


def _days(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]


def _in_range(first: dt.date, last: dt.date) -> Column:
    return F.col("date").between(F.lit(first), F.lit(last))


def run_clean(spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date) -> None:
    """landing (arrival dates first-1 .. last+lateness) -> ``clean`` and ``quarantine`` for first..last."""
    landing_days = _days(first - dt.timedelta(days=1), last + dt.timedelta(days=max(0, int(-(-cfg.lateness // 86400)))))
    parsed = parse_landed(tbl.read_landing(spark, cfg.landing, landing_days))
    # parsed once, written twice (clean, quarantine): cache it without the raw text the valid rows no longer need
    bad = F.size("reasons") > 0
    parsed = (parsed.withColumn("payload", F.when(bad, F.col("payload")))
              .withColumn("value", F.when(bad, F.col("value"))).persist())
    try:
        valid, quarantine = clean(parsed, cfg.max_clock_skew)
        days = _days(first, last)
        tbl.replace_partitions(spark, valid.where(_in_range(first, last)), cfg.tables, "clean", days)
        tbl.replace_partitions(spark, quarantine.where(_in_range(first, last)), cfg.tables, "quarantine", days)
    finally:
        parsed.unpersist()


def run_dedup(spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date) -> None:
    """``clean`` -> ``readings`` and ``seq_runs`` (the state later rebuilds of other dates read) for first..last."""
    rows = tbl.read_table(spark, cfg.tables, "clean", first, last)
    tbl.replace_partitions(spark, dedup(rows), cfg.tables, "readings", _days(first, last))
    readings = tbl.read_table(spark, cfg.tables, "readings", first, last)
    tbl.replace_partitions(spark, seq_runs(readings), cfg.tables, "seq_runs", _days(first, last))


def run_windows(spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date) -> None:
    """``readings`` -> ``windows`` for first..last."""
    rows = tbl.read_table(spark, cfg.tables, "readings", first, last)
    tbl.replace_partitions(
        spark, windows(rows).where(_in_range(first, last)), cfg.tables, "windows", _days(first, last)
    )


def run_completeness(spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date) -> None:
    """``readings`` of first..last and ``seq_runs`` of every other date -> ``completeness`` for first..last."""
    rows = tbl.read_table(spark, cfg.tables, "readings", first, last)
    history = tbl.read_table_outside(spark, cfg.tables, "seq_runs", first, last)
    as_of = cfg.as_of or dt.datetime.now(dt.UTC)
    table = completeness(rows, as_of, cfg.grace, history=history)
    tbl.replace_partitions(spark, table, cfg.tables, "completeness", _days(first, last))


def run_latency(spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date) -> None:
    """``readings`` -> ``latency`` for first..last."""
    rows = tbl.read_table(spark, cfg.tables, "readings", first, last)
    tbl.replace_partitions(spark, latency(rows), cfg.tables, "latency", _days(first, last))


def _stat_columns() -> dict[str, list[tuple[str, str, Column]]]:
    """What each stage reports of the tables it wrote: (table, name, aggregate). Built when called: a Column needs
    the running SparkContext."""
    one = F.count(F.lit(1))
    return {
        "clean": [("clean", "clean", one), ("quarantine", "quarantine", one)],
        "dedup": [("readings", "readings", one), ("readings", "duplicates", F.sum(F.col("copies") - 1))],
        "windows": [("windows", "windows", one)],
        "completeness": [
            ("completeness", "completeness", one),
            ("completeness", "missing", F.sum("missing")),
            ("completeness", "reboots", F.sum(F.col("reboot").cast("long"))),
        ],
        "latency": [("latency", "latency", one)],
    }


def stats(spark: SparkSession, cfg: JobConfig, stages: list[str], first: dt.date, last: dt.date) -> dict[str, int]:
    """Row counts (and sums) of what ``stages`` wrote for first..last, in one Spark job: one aggregate per table,
    unioned (Parquet footers answer plain counts)."""
    wanted = _stat_columns()
    frames = []
    for table in dict.fromkeys(t for s in stages for t, _, _ in wanted[s]):
        aggs = [agg.cast("long").alias(name) for s in stages for t, name, agg in wanted[s] if t == table]
        row = tbl.read_table(spark, cfg.tables, table, first, last).agg(*aggs)
        frames.append(row.select(F.explode(F.map_from_arrays(F.array(*[F.lit(c) for c in row.columns]),
                                                             F.array(*row.columns)))))  # fmt: skip
    out: dict[str, int] = {}
    for frame in frames[1:]:
        frames[0] = frames[0].unionByName(frame)
    for r in frames[0].collect() if frames else []:
        out[r["key"]] = int(r["value"] or 0)
    return {name: out[name] for s in stages for _, name, _ in wanted[s]}


RUNNERS: dict[str, Callable[[SparkSession, JobConfig, dt.date, dt.date], None]] = {
    "clean": run_clean,
    "dedup": run_dedup,
    "windows": run_windows,
    "completeness": run_completeness,
    "latency": run_latency,
}


def run(spark: SparkSession, cfg: JobConfig, stage: str, first: dt.date, last: dt.date) -> dict[str, int]:
    """Run one stage, or ``all`` of them in order, in this one SparkSession; returns row counts of what was
    written (one Spark job for all of them, after the writes)."""
    if last < first:
        raise ValueError(f"--to {last} is before --from {first}")
    names = list(STAGES) if stage == "all" else [stage]
    for name in names:
        if name not in RUNNERS:
            raise ValueError(f"unknown stage {name!r} (one of {', '.join(STAGES)}, all)")
        RUNNERS[name](spark, cfg, first, last)
        log.info("%s %s..%s written", name, first, last)
    result = stats(spark, cfg, names, first, last)
    log.info("%s %s..%s: %s", stage, first, last, result)
    return result
