"""Spark schemas of the landing lines, the reading envelope (docs/message-format.md) and the output tables."""

from __future__ import annotations

from pyspark.sql import types as T

# One landing line, as pipeline.lander writes it.
LANDING = T.StructType(
    [
        T.StructField("topic", T.StringType()),
        T.StructField("arrival", T.StringType()),
        T.StructField("msg_id", T.StringType()),
        T.StructField("qos", T.IntegerType()),
        T.StructField("retain", T.BooleanType()),
        T.StructField("payload", T.StringType()),
        T.StructField("payload_b64", T.StringType()),
    ]
)

VALUE = T.StructType(
    [
        T.StructField("value", T.DoubleType()),
        T.StructField("unit", T.StringType()),
    ]
)

# The reading envelope, version 1.
ENVELOPE = T.StructType(
    [
        T.StructField("v", T.LongType()),
        T.StructField("gateway_id", T.StringType()),
        T.StructField("device", T.StringType()),
        T.StructField("boot", T.LongType()),
        T.StructField("seq", T.LongType()),
        T.StructField("sensor_time", T.StringType()),
        T.StructField("gateway_time", T.StringType()),
        T.StructField("values", T.MapType(T.StringType(), VALUE)),
    ]
)
ENVELOPE_FIELDS = [f.name for f in ENVELOPE.fields]

# One landing line read with the payload as the envelope object itself (landing format 2: the lander embeds a JSON
# object payload as the object): Spark parses the line and the envelope in one pass. A format 1 line (payload as a
# string) does not match it and is read with LANDING instead.
LANDING_EMBEDDED = T.StructType(
    [T.StructField("payload", ENVELOPE) if f.name == "payload" else f for f in LANDING.fields]
)

KEY = ["gateway_id", "device", "boot", "seq"]

# clean: every valid copy, partitioned by event date.
CLEAN = T.StructType(
    [
        T.StructField("gateway_id", T.StringType()),
        T.StructField("device", T.StringType()),
        T.StructField("boot", T.LongType()),
        T.StructField("seq", T.LongType()),
        T.StructField("sensor_time", T.TimestampType()),
        T.StructField("gateway_time", T.TimestampType()),
        T.StructField("event_time", T.TimestampType()),
        T.StructField("clock_clamped", T.BooleanType()),
        T.StructField("values", T.MapType(T.StringType(), VALUE)),
        T.StructField("arrival_time", T.TimestampType()),
        T.StructField("topic", T.StringType()),
        T.StructField("msg_id", T.StringType()),
        T.StructField("date", T.DateType()),
    ]
)

# readings: one row per (gateway_id, device, boot, seq), the earliest arrival, with how many copies arrived.
READINGS = T.StructType(
    [
        *CLEAN.fields[:-1],
        T.StructField("copies", T.LongType()),
        T.StructField("date", T.DateType()),
    ]
)

QUARANTINE = T.StructType(
    [
        T.StructField("arrival_time", T.TimestampType()),
        T.StructField("topic", T.StringType()),
        T.StructField("msg_id", T.StringType()),
        T.StructField("payload", T.StringType()),
        T.StructField("payload_b64", T.StringType()),
        T.StructField("reason", T.StringType()),
        T.StructField("source_file", T.StringType()),
        T.StructField("date", T.DateType()),
    ]
)

WINDOWS = T.StructType(
    [
        T.StructField("gateway_id", T.StringType()),
        T.StructField("device", T.StringType()),
        T.StructField("quantity", T.StringType()),
        T.StructField("unit", T.StringType()),
        T.StructField("window_start", T.TimestampType()),
        T.StructField("window_end", T.TimestampType()),
        T.StructField("count", T.LongType()),
        T.StructField("min", T.DoubleType()),
        T.StructField("max", T.DoubleType()),
        T.StructField("mean", T.DoubleType()),
        T.StructField("date", T.DateType()),
    ]
)

RANGE = T.StructType([T.StructField("first", T.LongType()), T.StructField("last", T.LongType())])

COMPLETENESS = T.StructType(
    [
        T.StructField("gateway_id", T.StringType()),
        T.StructField("device", T.StringType()),
        T.StructField("boot", T.LongType()),
        T.StructField("period_start", T.TimestampType()),
        T.StructField("period_end", T.TimestampType()),
        T.StructField("first_seq", T.LongType()),
        T.StructField("last_seq", T.LongType()),
        T.StructField("received", T.LongType()),
        T.StructField("missing", T.LongType()),
        T.StructField("expected", T.LongType()),
        T.StructField("completeness", T.DoubleType()),
        T.StructField("missing_ranges", T.ArrayType(RANGE)),
        T.StructField("reboot", T.BooleanType()),
        T.StructField("closed", T.BooleanType()),
        T.StructField("date", T.DateType()),
    ]
)

LATENCY = T.StructType(
    [
        T.StructField("gateway_id", T.StringType()),
        T.StructField("stage", T.StringType()),
        T.StructField("count", T.LongType()),
        T.StructField("p50", T.DoubleType()),
        T.StructField("p90", T.DoubleType()),
        T.StructField("p99", T.DoubleType()),
        T.StructField("max", T.DoubleType()),
        T.StructField("date", T.DateType()),
    ]
)

# seq_runs: the state completeness needs from outside a rebuilt range. Per (gateway, device, boot, date), each run of
# consecutive seq present in readings (first..last): a few rows per device and day (one more per gap).
SEQ_RUNS = T.StructType(
    [
        T.StructField("gateway_id", T.StringType()),
        T.StructField("device", T.StringType()),
        T.StructField("boot", T.LongType()),
        T.StructField("first", T.LongType()),
        T.StructField("last", T.LongType()),
        T.StructField("date", T.DateType()),
    ]
)

TABLES = {
    "clean": CLEAN,
    "readings": READINGS,
    "seq_runs": SEQ_RUNS,
    "quarantine": QUARANTINE,
    "windows": WINDOWS,
    "completeness": COMPLETENESS,
    "latency": LATENCY,
}

# Columns with (nearly) one distinct value per row, written without a Parquet dictionary: a dictionary costs a hash
# lookup per value and is abandoned anyway once it outgrows its page, which for these it always does (profiled on
# 10^6 readings: the dictionary was 40% of the CPU of writing `clean`). The other columns (gateway, device, topic,
# quantity names and units...) keep theirs: few distinct values, smaller files.
_TIMES = ["sensor_time", "gateway_time", "event_time", "arrival_time"]
NO_DICTIONARY: dict[str, list[str]] = {
    "clean": ["seq", *_TIMES, "msg_id", "values.key_value.value.value"],
    "readings": ["seq", *_TIMES, "msg_id", "values.key_value.value.value"],
    "windows": ["window_start", "window_end", "min", "max", "mean"],
}
