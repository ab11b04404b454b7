"""Reading the landing area and replacing date partitions of the Parquet tables, through Hadoop's FileSystem so
the same code works on a local disk, HDFS or an object store."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from pipeline.schema import NO_DICTIONARY, TABLES


def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath


def _child(spark: SparkSession, parent: Any, name: str) -> Any:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return jvm.org.apache.hadoop.fs.Path(parent, name)


def existing_date_dirs(spark: SparkSession, root: str, dates: list[dt.date]) -> list[str]:
    """``root/date=D`` for each D that exists."""
    fs, hroot = _fs(spark, root)
    found = []
    for d in dates:
        p = _child(spark, hroot, f"date={d.isoformat()}")
        if fs.exists(p):
            found.append(p.toString())
    return found


def read_landing(spark: SparkSession, landing: str, dates: list[dt.date]) -> DataFrame:
    """The landed lines of the given arrival dates as text: ``value`` (the line) and ``source_file``, for
    :func:`pipeline.jobs.parse_landing` (which parses a format 2 line once and keeps the text of any line it
    quarantines). Only visible ``*.jsonl`` files are read (the lander's hidden ``.part-...inprogress`` files
    never are)."""
    from pyspark.sql import functions as F

    paths = existing_date_dirs(spark, landing, dates)
    if not paths:
        schema = T.StructType([T.StructField("value", T.StringType()), T.StructField("source_file", T.StringType())])
        return spark.createDataFrame([], schema)
    lines = spark.read.option("recursiveFileLookup", "true").option("pathGlobFilter", "*.jsonl").text(paths)
    return lines.withColumn("source_file", F.col("_metadata.file_path"))


def table_path(tables: str, name: str) -> str:
    return tables.rstrip("/") + "/" + name


def read_table(spark: SparkSession, tables: str, name: str, first: dt.date, last: dt.date) -> DataFrame:
    """Rows of table ``name`` with ``first <= date <= last`` (an empty frame when there are none)."""
    from datetime import timedelta

    days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    root = table_path(tables, name)
    paths = existing_date_dirs(spark, root, days)
    schema = TABLES[name]
    if not paths:
        return spark.createDataFrame([], schema)
    df = spark.read.option("basePath", root).schema(schema).parquet(*paths)
    return df.select(*schema.fieldNames())


def read_table_outside(spark: SparkSession, tables: str, name: str, first: dt.date, last: dt.date) -> DataFrame:
    """Rows of table ``name`` of every date before ``first`` or after ``last`` (partition pruning on ``date``)."""
    from pyspark.sql import functions as F

    root = table_path(tables, name)
    fs, hroot = _fs(spark, root)
    schema = TABLES[name]
    if not fs.exists(hroot) or not any(s.getPath().getName().startswith("date=") for s in fs.listStatus(hroot)):
        return spark.createDataFrame([], schema)
    df = spark.read.schema(schema).parquet(root).select(*schema.fieldNames())
    return df.where(~F.col("date").between(F.lit(first), F.lit(last)))


def replace_partitions(spark: SparkSession, df: DataFrame, tables: str, name: str, dates: list[dt.date]) -> None:
    """Make table ``name``'s partitions for ``dates`` hold exactly ``df`` (whose ``date`` values must lie in
    ``dates``): written once to a hidden staging directory, then each date's directory is swapped in (and a date
    with no rows left loses its old directory). Readers never see a half-written partition."""
    root = table_path(tables, name)
    fs, hroot = _fs(spark, root)
    fs.mkdirs(hroot)
    staging_name = f"_staging-{uuid.uuid4().hex}"
    staging = _child(spark, hroot, staging_name)
    writer = df.select(*TABLES[name].fieldNames()).write.mode("overwrite").partitionBy("date")
    for column in NO_DICTIONARY.get(name, []):
        writer = writer.option(f"parquet.enable.dictionary#{column}", "false")
    writer.parquet(staging.toString())
    try:
        for d in dates:
            part = f"date={d.isoformat()}"
            target = _child(spark, hroot, part)
            source = _child(spark, staging, part)
            if fs.exists(target):
                fs.delete(target, True)
            if fs.exists(source) and not fs.rename(source, target):
                raise OSError(f"could not move {source.toString()} to {target.toString()}")
    finally:
        fs.delete(staging, True)
