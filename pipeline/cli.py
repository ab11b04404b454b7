"""The ``fleet-pipeline`` command (also ``python -m pipeline``).

Only ``land`` runs without pyspark; ``run``, ``stream`` and ``report`` import it when called.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from gateway.values import parse_duration, parse_size
from pipeline import __version__
from pipeline.util import parse_date, parse_instant

DESCRIPTION = f"""\
fleet-pipeline {__version__}: the fleet data pipeline (lander + PySpark jobs + report).

  fleet-pipeline land --host cloud.example --topic 'fleet/+/+'    land the cloud broker's readings as JSON lines
  fleet-pipeline run all --from 2024-05-01 --to 2024-05-07        rebuild every table for those dates (UTC)
  fleet-pipeline stream                                            Structured Streaming over the landing area
  fleet-pipeline report --from 2024-05-01 --to 2024-05-07          the fleet health report (HTML)

Spark: embedded local[*] on 127.0.0.1 by default; under spark-submit the cluster's settings win
(spark-submit pipeline/submit.py run all --from ... --to ...).
"""


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _confs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--conf expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _option(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a :mod:`gateway.values` parser: a bad value is reported as
    ``argument --NAME: 'VALUE': must be <what is allowed>`` (exit 2), not a traceback."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add_duration(p: argparse.ArgumentParser, name: str, default: str, help_text: str | None = None) -> None:
    """An option in seconds, given as ``30s``, ``5m``, ``250ms``... (see :func:`gateway.values.parse_duration`)."""
    p.add_argument(name, type=_option(parse_duration), default=default, help=help_text)


def _add_paths(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--landing",
        default=os.environ.get("FLEET_LANDING", "var/pipeline/landing"),
        help="landing area (local path or a Hadoop URI; default %(default)s, env FLEET_LANDING)",
    )
    p.add_argument(
        "--tables",
        default=os.environ.get("FLEET_TABLES", "var/pipeline/tables"),
        help="where the Parquet tables live (default %(default)s, env FLEET_TABLES)",
    )
    p.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting (repeatable); wins over the built-in defaults",
    )


def _add_range(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="first", required=True, type=parse_date, help="first date, YYYY-MM-DD (UTC)")
    p.add_argument("--to", dest="last", required=True, type=parse_date, help="last date, inclusive")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-pipeline", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"fleet-pipeline {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    land = sub.add_parser("land", help="subscribe to the cloud broker and land messages as JSON lines")
    land.add_argument("--landing", default=os.environ.get("FLEET_LANDING", "var/pipeline/landing"))
    land.add_argument("--host", default="127.0.0.1")
    land.add_argument("--port", type=int, default=1883)
    land.add_argument(
        "--topic",
        action="append",
        dest="topics",
        metavar="FILTER",
        help="topic filter, repeatable (default sensors/+/+); $share/<group>/... spreads the load over several landers",
    )
    land.add_argument("--client-id", default="fleet-lander", help="also names the session the broker keeps")
    land.add_argument("--mqtt-version", choices=["5", "3.1.1"], default="5")
    _add_duration(land, "--session-expiry", "7d", "MQTT 5 Session Expiry Interval (default %(default)s)")
    land.add_argument("--keepalive", type=int, default=30)
    land.add_argument(
        "--roll-size",
        type=_option(parse_size),
        default="64MB",
        help="roll when this many bytes are pending (%(default)s; MiB)",
    )
    _add_duration(land, "--roll-interval", "60s", "...or the oldest pending message is this old")
    _add_duration(land, "--idle", "1s", "...or the broker has been quiet this long")
    land.add_argument(
        "--max-pending",
        type=int,
        default=1000,
        help="...or this many messages await their PUBACK (sent as MQTT 5 Receive Maximum)",
    )
    land.add_argument(
        "--payload-as-string",
        action="store_true",
        help="landing format 1: every payload as a JSON string (default: a JSON object payload is embedded as the "
        "object, byte for byte, so Spark parses each line once; docs/pipeline.md)",
    )
    land.add_argument("--username")
    land.add_argument("--tls", action="store_true", help="TLS to the broker (system CAs unless --cafile)")
    land.add_argument("--cafile")

    run = sub.add_parser("run", help="rebuild tables for a date range")
    run.add_argument("stage", choices=["clean", "dedup", "windows", "completeness", "latency", "all"])
    _add_range(run)
    _add_paths(run)
    _add_duration(run, "--lateness", "2d", "landing dates read past --to (default %(default)s)")
    # --lookback (completeness read this much before --from) is gone: the seq_runs table carries what came before.
    run.add_argument("--lookback", type=_option(parse_duration), help=argparse.SUPPRESS)
    _add_duration(run, "--max-clock-skew", "5m", "clamp sensor clocks further off than this")
    _add_duration(run, "--grace", "1h", "completeness: a period is closed this long after its end")
    run.add_argument("--as-of", type=parse_instant, help="'now' for closed periods (RFC 3339; default: now)")

    stream = sub.add_parser("stream", help="Structured Streaming over the landing area")
    _add_paths(stream)
    stream.add_argument("--checkpoint", default="var/pipeline/checkpoints")
    stream.add_argument("--watermark", default="10 minutes", help="event-time watermark delay (%(default)s)")
    _add_duration(stream, "--max-clock-skew", "5m")
    stream.add_argument("--trigger", choices=["available_now", "processing_time"], default="available_now")
    stream.add_argument("--interval", default="1 minute", help="processing_time trigger interval")
    stream.add_argument("--max-files-per-trigger", type=int)

    report = sub.add_parser("report", help="write the fleet health report (HTML)")
    _add_range(report)
    _add_paths(report)
    report.add_argument("--out", default="fleet-report.html")
    report.add_argument("--series", help="GATEWAY/DEVICE/QUANTITY to plot (default: the one with most data)")
    return parser


def _spark(args: argparse.Namespace) -> Any:
    from pipeline.spark import get_spark

    return get_spark(f"fleet-pipeline {args.command}", _confs(args.conf))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    if args.command == "land":
        from pipeline.lander import LanderConfig, run_lander

        cfg = LanderConfig(
            landing=args.landing,
            host=args.host,
            port=args.port,
            topics=args.topics or ["sensors/+/+"],
            client_id=args.client_id,
            mqtt_version=5 if args.mqtt_version == "5" else 4,
            session_expiry=args.session_expiry,
            keepalive=args.keepalive,
            roll_bytes=args.roll_size,
            roll_seconds=args.roll_interval,
            idle_seconds=args.idle,
            max_pending=args.max_pending,
            payload_as_string=args.payload_as_string,
            username=args.username,
            password=os.environ.get("FLEET_MQTT_PASSWORD"),
            tls=args.tls,
            cafile=args.cafile,
        )
        return run_lander(cfg)
    if args.command == "run":
        from pipeline import jobs

        if args.lookback is not None:
            logging.getLogger("pipeline.cli").warning(
                "--lookback is ignored: rebuilds read what came before the range from the seq_runs table"
            )
        job_cfg = jobs.JobConfig(
            landing=args.landing,
            tables=args.tables,
            lateness=args.lateness,
            max_clock_skew=args.max_clock_skew,
            grace=args.grace,
            as_of=args.as_of,
        )
        spark = _spark(args)
        stats = jobs.run(spark, job_cfg, args.stage, args.first, args.last)
        conf = spark.sparkContext.getConf()
        settings = {k: conf.get(k, None) for k in ("spark.master", "spark.sql.shuffle.partitions")}
        print(
            json.dumps({"stage": args.stage, "from": str(args.first), "to": str(args.last), **stats, "spark": settings})
        )
        return 0
    if args.command == "stream":
        from pipeline.streaming import run_stream

        spark = _spark(args)
        run_stream(
            spark,
            args.landing,
            args.tables,
            args.checkpoint,
            args.watermark,
            args.max_clock_skew,
            args.trigger,
            args.interval,
            args.max_files_per_trigger,
        )
        return 0
    if args.command == "report":
        from pipeline.report import write_report

        spark = _spark(args)
        path = write_report(
            spark, args.tables, args.first, args.last, args.out, args.series, generated=dt.datetime.now(dt.UTC)
        )
        print(path)
        return 0
    return 2
