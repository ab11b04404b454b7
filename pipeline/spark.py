"""The SparkSession: small-machine defaults that yield to whatever ``spark-submit`` (or spark-defaults.conf,
or ``PYSPARK_SUBMIT_ARGS``) already set."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

# Only applied when the master is local (embedded ``local[*]``): a workstation or a CI box.
LOCAL_DEFAULTS: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.adaptive.enabled": "true",
    "spark.log.level": "WARN",
    "spark.ui.showConsoleProgress": "false",
}
# Always: the pipeline's tables are in UTC whatever the machine's time zone is.
FORCED: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
}
DEFAULT_MASTER = "local[*]"
LOCAL_DRIVER_MEMORY = "2g"
# The embedded JVM runs every task itself: the throughput collector, not G1 (whose concurrent marking and refinement
# threads and write barriers cost ~15% of a batch run's CPU here; bench/pipeline_throughput.py --profile).
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:+UseParallelGC"


def local_submit_args(conf: Mapping[str, str] | None = None, java_options: str = "") -> str:
    """``PYSPARK_SUBMIT_ARGS`` for the JVM that pyspark starts itself: what spark-submit would be given (the
    driver's heap and JVM options are fixed when it starts). ``java_options`` are added to the defaults, which
    ``spark.driver.extraJavaOptions`` in ``conf`` replaces."""
    conf = conf or {}
    memory = conf.get("spark.driver.memory", LOCAL_DRIVER_MEMORY)
    options = " ".join(filter(None, [conf.get("spark.driver.extraJavaOptions", LOCAL_DRIVER_JAVA_OPTIONS),
                                     java_options]))
    return f"--driver-memory {memory} --driver-java-options {shlex.quote(options)} pyspark-shell"


def effective_settings(existing: Mapping[str, str], overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings to add on top of ``existing`` (what the launcher set): our defaults only where nothing is set,
    the local defaults only for a local master, explicit ``overrides`` (``--conf``) and ``FORCED`` always."""
    overrides = dict(overrides or {})
    merged: dict[str, str] = {}
    master = overrides.get("spark.master") or existing.get("spark.master") or DEFAULT_MASTER
    if "spark.master" not in existing:
        merged["spark.master"] = master
    if master.startswith("local"):
        for key, value in LOCAL_DEFAULTS.items():
            if key not in existing:
                merged[key] = value
    merged.update(overrides)
    merged.update(FORCED)
    return merged


def get_spark(app_name: str = "fleet-pipeline", conf: Mapping[str, str] | None = None) -> Any:
    """The active session, or a new one built from the launcher's settings plus ours."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        for key, value in {**dict(conf or {}), **FORCED}.items():
            if active.conf.isModifiable(key):  # runtime SQL settings; the rest is fixed once the context runs
                active.conf.set(key, value)
        return active
    launched_by_submit = bool(os.environ.get("PYSPARK_GATEWAY_PORT"))
    if not launched_by_submit:
        # The JVM that pyspark starts itself: keep it on loopback (its block manager and UI too) unless told otherwise.
        master = (conf or {}).get("spark.master", DEFAULT_MASTER)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # the driver's heap is fixed when the JVM starts: pass it the way spark-submit would
            if "PYSPARK_SUBMIT_ARGS" not in os.environ:
                os.environ["PYSPARK_SUBMIT_ARGS"] = local_submit_args(conf)
    # Starts (or, under spark-submit, connects to) the JVM, so that SparkConf() sees the launcher's settings.
    SparkContext._ensure_initialized()
    spark_conf = SparkConf()
    existing = {k: v for k, v in spark_conf.getAll()}
    if not launched_by_submit:
        existing.pop("spark.ui.showConsoleProgress", None)  # set by pyspark's own shell launcher, not by the user
    for key, value in effective_settings(existing, conf).items():
        spark_conf.set(key, value)
    if "spark.app.name" not in existing:
        spark_conf.setAppName(app_name)
    spark = SparkSession.builder.config(conf=spark_conf).getOrCreate()
    level = spark_conf.get("spark.log.level", None)
    if level:
        spark.sparkContext.setLogLevel(level)
    return spark
