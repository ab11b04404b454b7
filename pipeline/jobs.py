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

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline import tables as tbl
from pipeline.schema import ENVELOPE, KEY, LANDING, LANDING_EMBEDDED

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


_JSON_OPTIONS = {"mode": "PERMISSIVE", "allowNonNumericNumbers": "false"}
_EMBEDDED_KEY = ',"payload":{'  # how the lander writes a format 2 line's payload: the last key, then the object


def _topic_ok(e: Column, topic: Column) -> Column:
    levels = F.split(topic, "/")
    return (F.size(levels) >= 3) & (F.element_at(levels, -2) == e["gateway_id"]) & (
        F.element_at(levels, -1) == e["device"]
    )


def _envelope_ok(e: Column, topic: Column, gateway_time: Column, sensor_time: Column) -> Column:
    """The envelope ``e`` (parsed with ``ENVELOPE``; its times as timestamps) has every field, sensor_time
    included, and passes every check: such a row's reasons are empty whichever way it was parsed. Null when unsure
    (treat as False)."""
    present = [e[f].isNotNull() for f in ("v", "gateway_id", "device", "boot", "seq")]
    entries = F.map_entries(e["values"])
    checks = [
        *present,
        e["v"] == 1,
        e["boot"] >= 0,
        e["seq"] >= 0,
        gateway_time.isNotNull(),
        sensor_time.isNotNull(),
        F.size(e["values"]) > 0,
        ~F.exists(entries, lambda x: x["value"]["value"].isNull() | x["value"]["unit"].isNull()),
        F.forall(entries, lambda x: x["key"].rlike(QUANTITY_NAME)),
        _topic_ok(e, topic),
    ]
    ok = checks[0]
    for check in checks[1:]:
        ok = ok & check
    return ok


def parse_landing(lines: DataFrame) -> DataFrame:
    """Landing lines as text (``value``, ``source_file``; :func:`pipeline.tables.read_landing` or the streaming
    file source) -> one row per non-blank line with the envelope fields parsed and ``reasons``: every check the
    line fails (empty for a valid reading).

    A line is parsed once with ``LANDING_EMBEDDED`` (the payload as the envelope object: landing format 2). When
    that gives every envelope field and every check passes (the common case) the row is done (``fast``). Any other
    line (format 1, whose payload is a JSON string; an envelope with a field missing, null or of the wrong type;
    sensor_time null, which must be told from absent; not a landing line at all) is parsed as format 1 was: the
    line with ``LANDING`` (an embedded object comes back as its JSON text), then the payload text with
    ``ENVELOPE``, and checked field by field. Both ways give the same row for the same message."""
    lines = lines.where(~F.col("value").rlike(r"^\s*$"))  # blank lines are skipped, as Spark's JSON source does
    # a format 1 line (no embedded object) skips this parse: it could not be fast
    embedded = F.when(
        F.col("value").contains(_EMBEDDED_KEY), F.from_json(F.col("value"), LANDING_EMBEDDED, _JSON_OPTIONS)
    )
    df = lines.select(embedded.alias("l"), "value", "source_file")
    line = F.col("l")
    df = df.select(
        "l",
        "value",
        "source_file",
        F.try_to_timestamp(line["arrival"]).alias("l_arrival"),
        _timestamp(line["payload"]["gateway_time"]).alias("l_gateway_time"),
        _timestamp(line["payload"]["sensor_time"]).alias("l_sensor_time"),
    )
    fast = F.coalesce(
        line["topic"].isNotNull()
        & F.col("l_arrival").isNotNull()
        & _envelope_ok(line["payload"], line["topic"], F.col("l_gateway_time"), F.col("l_sensor_time")),
        F.lit(False),
    )
    carried = ["l", "value", "source_file", "l_arrival", "l_gateway_time", "l_sensor_time"]
    df = df.select(*carried, fast.alias("fast"))
    # only where not fast: the line as format 1 (one more parse), then the payload text (one more)
    f1 = F.when(~F.col("fast"), F.from_json(F.col("value"), LANDING, {"mode": "PERMISSIVE"}))
    df = df.select(*carried, "fast", f1.alias("f1"))
    # a format 2 payload's exact text: the bytes between the lander's ',"payload":' and the line's final '}', when
    # they are exactly one JSON value (else Spark's compact rewrite of the object, from the LANDING parse)
    value, fast_c = F.col("value"), F.col("fast")
    at = F.instr(value, _EMBEDDED_KEY)
    start = at + F.lit(len(_EMBEDDED_KEY) - 1)
    cut = F.when(~fast_c & (at > 0) & value.endswith("}"), value.substr(start, F.length(value) - start))
    one_value = F.size(F.from_json(F.concat(F.lit("["), cut, F.lit("]")), T.ArrayType(T.StringType()))) == 1
    payload = F.when(~fast_c, F.when(F.coalesce(one_value, F.lit(False)), cut).otherwise(F.col("f1.payload")))
    df = df.select(
        F.when(fast_c, line["topic"]).otherwise(F.col("f1.topic")).alias("topic"),
        F.when(fast_c, F.col("l_arrival")).otherwise(F.try_to_timestamp(F.col("f1.arrival"))).alias("arrival_time"),
        F.when(fast_c, line["msg_id"]).otherwise(F.col("f1.msg_id")).alias("msg_id"),
        payload.alias("payload"),
        F.when(~fast_c, F.col("f1.payload_b64")).alias("payload_b64"),
        F.when(~fast_c, value).alias("value"),
        "source_file",
        fast_c.alias("fast"),
        F.when(fast_c, line["payload"]).alias("embedded"),
        F.when(fast_c, F.col("l_gateway_time")).alias("fast_gateway_time"),
        F.when(fast_c, F.col("l_sensor_time")).alias("fast_sensor_time"),
    )
    return _parse_envelope(df)


def _parse_envelope(df: DataFrame) -> DataFrame:
    """Rows with ``topic``, ``arrival_time``, ``msg_id``, ``payload`` (text), ``payload_b64``, ``value`` (the raw
    line), ``source_file``, ``fast`` and, where ``fast``, ``embedded`` (the envelope already parsed and checked),
    ``fast_gateway_time`` and ``fast_sensor_time`` (its times as timestamps) ->
    the envelope fields and ``reasons`` (empty where ``fast``; else from ``payload`` parsed with ``ENVELOPE``)."""
    envelope = F.when(
        F.col("fast"), F.col("embedded")
    ).otherwise(F.from_json(F.col("payload"), ENVELOPE, _JSON_OPTIONS))
    df = df.withColumn("e", envelope)
    e = F.col("e")

    def field_reason(name: str) -> Column:
        raw = F.get_json_object(F.col("payload"), f"$.{name}")
        return F.when(e[name].isNull(), F.when(raw.isNull(), F.lit(f"missing:{name}")).otherwise(f"bad_type:{name}"))

    gateway_time = F.when(F.col("fast"), F.col("fast_gateway_time")).otherwise(_timestamp(e["gateway_time"]))
    sensor_time = F.when(F.col("fast"), F.col("fast_sensor_time")).otherwise(_timestamp(e["sensor_time"]))
    topic_ok = _topic_ok(e, F.col("topic"))
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
        F.when(F.col("fast"), F.array().cast("array<string>"))
        .when(F.col("topic").isNull() | F.col("arrival_time").isNull(), F.array(F.lit("bad_landing_line")))
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
    parsed = parse_landing(tbl.read_landing(spark, cfg.landing, landing_days))
    # parsed once, written twice (clean, quarantine): cache it without what only quarantined rows need (the raw
    # text, the file name: building the cache encodes every value, and source_file was a fifth of that), on disk:
    # its blocks are already compact column batches, and in the driver's heap (local[*]) 10^7 rows of them made the
    # collector copy and mark ~1 GB over and over (46 s of pauses in a 2 GiB heap)
    bad = F.size("reasons") > 0
    parsed = parsed.withColumns({c: F.when(bad, F.col(c)) for c in ("payload", "value", "source_file")})
    parsed = parsed.persist(StorageLevel.DISK_ONLY)
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


def run(
    spark: SparkSession,
    cfg: JobConfig,
    stage: str,
    first: dt.date,
    last: dt.date,
    on_stage: Callable[[str], None] | None = None,
) -> dict[str, int]:
    """Run one stage, or ``all`` of them in order, in this one SparkSession; returns row counts of what was
    written (one Spark job for all of them, after the writes). ``on_stage(name)`` is called after each stage and
    after ``"stats"`` (the benchmark times them)."""
    if last < first:
        raise ValueError(f"--to {last} is before --from {first}")
    names = list(STAGES) if stage == "all" else [stage]
    for name in names:
        if name not in RUNNERS:
            raise ValueError(f"unknown stage {name!r} (one of {', '.join(STAGES)}, all)")
        RUNNERS[name](spark, cfg, first, last)
        log.info("%s %s..%s written", name, first, last)
        if on_stage:
            on_stage(name)
    result = stats(spark, cfg, names, first, last)
    if on_stage:
        on_stage("stats")
    log.info("%s %s..%s: %s", stage, first, last, result)
    return result


def run_all(
    spark: SparkSession, cfg: JobConfig, first: dt.date, last: dt.date, on_stage: Callable[[str], None] | None = None
) -> dict[str, int]:
    """``run(spark, cfg, "all", first, last, on_stage)``."""
    return run(spark, cfg, "all", first, last, on_stage)
