"""Structured Streaming mode: the landing area as a file source, cleaned and deduplicated continuously.

Three queries share the cleaning of ``pipeline.jobs`` and each has its own checkpoint under ``checkpoint``:

- ``stream_readings``: valid readings, ``withWatermark("event_time", watermark)`` then
  ``dropDuplicatesWithinWatermark(gateway_id, device, boot, seq)``, appended as Parquet by event date;
- ``stream_windows``: the same readings in 1-minute event-time windows (count, min, max, mean), a window being
  appended once the watermark has passed its end;
- ``stream_quarantine``: malformed lines with their reason.

The watermark trade-off: the watermark trails the largest event time seen by ``watermark``. A reading whose event
time is already behind the watermark when it arrives (a gateway's backlog after an outage longer than
``watermark``) is dropped by the deduplication and the windows, and a duplicate arriving more than ``watermark``
after its first copy is no longer recognised. A longer watermark keeps more state and delays every window by as
much. So the stream is for fresh numbers; the batch jobs (``fleet-pipeline run``), which re-read the immutable
landing area, stay the source of truth and fold late data in.

``trigger="available_now"`` processes everything landed so far (in several micro-batches) and stops: run it from
cron, or use ``trigger="processing_time"`` with an interval to keep it running.
"""

from __future__ import annotations

import logging
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline import jobs
from pipeline.schema import KEY

log = logging.getLogger("pipeline.streaming")


def landing_stream(spark: SparkSession, landing: str, max_files_per_trigger: int | None = None) -> DataFrame:
    reader = (
        spark.readStream.schema(T.StructType([T.StructField("value", T.StringType())]))
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.jsonl")
    )
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    return reader.text(landing).withColumn("source_file", F.col("_metadata.file_path"))


def streaming_frames(
    spark: SparkSession, landing: str, watermark: str, max_clock_skew: float, max_files_per_trigger: int | None = None
) -> dict[str, DataFrame]:
    parsed = jobs.parse_landing(landing_stream(spark, landing, max_files_per_trigger))
    valid, quarantine = jobs.clean(parsed, max_clock_skew)
    readings = valid.withWatermark("event_time", watermark).dropDuplicatesWithinWatermark(KEY)
    win = jobs.windows(readings)
    return {
        "stream_readings": readings,
        "stream_windows": win,
        "stream_quarantine": quarantine,
    }


def run_stream(
    spark: SparkSession,
    landing: str,
    tables: str,
    checkpoint: str,
    watermark: str = "10 minutes",
    max_clock_skew: float = 300.0,
    trigger: str = "available_now",
    interval: str = "1 minute",
    max_files_per_trigger: int | None = None,
    wait: bool = True,
) -> list[Any]:
    """Start the three queries; with ``wait`` (and ``available_now``) block until they have caught up."""
    queries = []
    for name, frame in streaming_frames(spark, landing, watermark, max_clock_skew, max_files_per_trigger).items():
        writer = (
            frame.writeStream.format("parquet")
            .outputMode("append")
            .partitionBy("date")
            .option("path", tables.rstrip("/") + "/" + name)
            .option("checkpointLocation", checkpoint.rstrip("/") + "/" + name)
            .queryName(name)
        )
        writer = (
            writer.trigger(availableNow=True) if trigger == "available_now" else writer.trigger(processingTime=interval)
        )
        queries.append(writer.start())
    if wait and trigger != "available_now":
        spark.streams.awaitAnyTermination()
    elif wait:
        for q in queries:
            q.awaitTermination()
            log.info("%s: %s", q.name, q.lastProgress and q.lastProgress.get("numInputRows"))
    return queries
