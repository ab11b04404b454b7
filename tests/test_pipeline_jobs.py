"""The fleet pipeline's Spark jobs on a landing area with known duplicates, reorderings, gaps, reboots, clock
errors and malformed lines (the envelope of docs/message-format.md): exact tables, idempotent rebuilds,
late data folded in, the streaming mode's watermark, the report, and spark-submit settings winning."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pipeline_fixtures import ROOT, envelope, landed_lines, spark, ts, write_landing
from pyspark.sql import Row
from pyspark.testing import assertDataFrameEqual

from pipeline import jobs
from pipeline import tables as tbl
from pipeline.schema import TABLES

__all__ = ["spark"]

DAY = dt.date(2024, 5, 1)
AS_OF = ts("2024-05-01T14:30:00")  # 12:00 periods closed (end 13:00 + 1 h grace), 13:00 periods still open
SST = "sea_surface_temperature"


def _gw_a() -> list[tuple[str, bytes, dt.datetime, str | None]]:
    """gw-a/buoy-1. Boot 3: seq 0..9, gateway time 12:00:01 + 10 s * seq, sensor clock 0.25 s behind, value
    10 + seq; seq 4, 7, 8 lost; seq 2 delivered twice and seq 5 three times (QoS 1 redelivery, same msg_id);
    seq 3 lands after seq 6 (reordered, 40 s). Boot 4 (a reboot): seq 0 lost, seq 1 and 2, whose sensor clock
    says 1970 (clamped to the gateway time)."""
    out = []
    topic = "fleet/gw-a/buoy-1"
    for seq in (0, 1, 2, 3, 5, 6, 9):
        g = ts("2024-05-01T12:00:01") + dt.timedelta(seconds=10 * seq)
        payload = envelope("gw-a", "buoy-1", 3, seq, g, g - dt.timedelta(seconds=0.25), {SST: (10.0 + seq, "degC")})
        arrivals = {2: [1, 30], 5: [1, 20, 25], 3: [40]}.get(seq, [1])
        out += [(topic, payload, g + dt.timedelta(seconds=a), f"gw-a:{seq}") for a in arrivals]
    g1, g2 = ts("2024-05-01T12:03:01"), ts("2024-05-01T12:03:11")
    out.append(
        (
            topic,
            envelope(
                "gw-a",
                "buoy-1",
                4,
                1,
                g1,
                g1 - dt.timedelta(seconds=0.25),
                {SST: (20.0, "degC"), "wave_height": (1.5, "m")},
            ),
            g1 + dt.timedelta(seconds=1),
            None,
        )
    )
    out.append((topic, envelope("gw-a", "buoy-1", 4, 2, g2, ts("1970-01-01T00:00:00"), {SST: (21.0, "degC")}),
                g2 + dt.timedelta(seconds=1), None))  # fmt: skip
    return out


def _gw_b() -> list[tuple[str, bytes, dt.datetime, str | None]]:
    """gw-b/ctd-7, boot 0, a board without a clock (sensor_time null): seq 0..3 at 12:00:05 + 10 s * seq (seq 1
    twice), seq 3's clock 2 h ahead (clamped); seq 6 at 13:01:05 (4 and 5 lost). Values 4.1 + 0.1 * seq S/m."""
    out = []
    topic = "fleet/gw-b/ctd-7"
    for seq in (0, 1, 2, 3, 6):
        g = ts("2024-05-01T12:00:05") + dt.timedelta(seconds=10 * seq) + dt.timedelta(hours=1 if seq == 6 else 0)
        sensor = g + dt.timedelta(hours=2) if seq == 3 else None
        payload = envelope("gw-b", "ctd-7", 0, seq, g, sensor, {"conductivity": (round(4.1 + 0.1 * seq, 1), "S/m")})
        for a in [0.5, 9.0] if seq == 1 else [0.5]:
            out.append((topic, payload, g + dt.timedelta(seconds=a), None))
    return out


MALFORMED: list[tuple[str, bytes, str]] = [
    ("fleet/gw-a/buoy-1", b"not json", "not_json_object"),
    ("fleet/gw-a/buoy-1", b"\xff\xfe", "not_utf8"),
    ("fleet/gw-a/buoy-1", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}', "missing:seq"),
    ("fleet/gw-a/buoy-1", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":"7","sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}', "bad_type:seq"),
    ("fleet/gw-a/buoy-1", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":70,"sensor_time":null,'
     b'"gateway_time":"yesterday","values":{"sst":{"value":1,"unit":"degC"}}}', "bad_time:gateway_time"),
    ("fleet/gw-a/buoy-1", b'{"v":2,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":71,"sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}', "unsupported_version"),
    ("fleet/gw-a/buoy-2", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":72,"sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}', "topic_mismatch"),
    ("fleet/gw-a/buoy-1", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":73,"sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":"warm","unit":"degC"}}}', "bad_value:sst"),
    ("fleet/gw-a/buoy-1", b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":-1,"sensor_time":null,'
     b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}', "negative:seq"),
]  # fmt: skip


def _build_landing(root: Path) -> None:
    records = _gw_a() + _gw_b()
    arrival = ts("2024-05-01T12:06:00")
    records += [(topic, payload, arrival, None) for topic, payload, _ in MALFORMED]
    write_landing(root, records)
    # a line that is not the lander's JSON at all (e.g. written by hand) is quarantined, never dropped
    (root / "date=2024-05-01" / "gateway=gw-a" / "part-manual.jsonl").write_text("this is not a landing line\n")
    # a hidden temporary file of a lander that crashed before its roll is never read
    (root / "date=2024-05-01" / "gateway=gw-a" / ".part-x-t-1.jsonl.inprogress").write_text(
        json.dumps({"topic": "fleet/gw-a/buoy-1", "arrival": "2024-05-01T12:00:00Z", "payload": "x"}) + "\n"
    )


def _cfg(root: Path) -> jobs.JobConfig:
    return jobs.JobConfig(landing=str(root / "landing"), tables=str(root / "tables"), as_of=AS_OF)


def _table(spark: Any, root: Path, name: str, first: dt.date = DAY, last: dt.date = DAY) -> Any:
    return tbl.read_table(spark, str(root / "tables"), name, first, last)


@pytest.fixture(scope="module")
def built(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """The landing area above, and ``run all`` over 2024-05-01."""
    root = tmp_path_factory.mktemp("pipeline")
    _build_landing(root / "landing")
    stats = jobs.run(spark, _cfg(root), "all", DAY, DAY)
    return root, stats


def _copy(built: tuple[Path, dict[str, int]], tmp_path: Path) -> Path:
    shutil.copytree(built[0] / "landing", tmp_path / "landing")
    shutil.copytree(built[0] / "tables", tmp_path / "tables")
    return tmp_path


def test_run_all_reports_row_counts(built: tuple[Path, dict[str, int]]) -> None:
    """`run all` returns the rows written: 18 valid copies, 10 quarantined lines, 14 readings after removing 4
    duplicates, and the missing/reboot totals of the completeness table."""
    assert built[1] == {
        "clean": 18, "quarantine": 10, "readings": 14, "duplicates": 4, "windows": 6, "completeness": 4,
        "missing": 6, "reboots": 1, "latency": 4,
    }  # fmt: skip


def test_clean_quarantines_every_malformed_line_with_its_reason(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """clean: malformed input is never dropped silently; each line is kept with the reason it failed."""
    got = _table(spark, built[0], "quarantine").select("topic", "payload", "payload_b64", "reason", "date")
    expected = [Row(topic=t, payload=None if r == "not_utf8" else p.decode(), payload_b64="//4=" if r == "not_utf8"
                    else None, reason=r, date=DAY) for t, p, r in MALFORMED]  # fmt: skip
    expected.append(Row(topic=None, payload="this is not a landing line", payload_b64=None,
                        reason="bad_landing_line", date=DAY))  # fmt: skip
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def test_clean_clamps_wild_sensor_clocks_to_gateway_time(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """clean: a sensor clock more than max_clock_skew (5 min) off is replaced by the gateway time and flagged;
    a board without a clock (null) uses the gateway time unflagged."""
    got = (_table(spark, built[0], "readings").where("clock_clamped or sensor_time is null")
           .select("gateway_id", "seq", "sensor_time", "gateway_time", "event_time", "clock_clamped"))  # fmt: skip
    b = ts("2024-05-01T12:00:05")
    expected = [
        Row(
            gateway_id="gw-a",
            seq=2,
            sensor_time=ts("1970-01-01T00:00:00"),
            gateway_time=ts("2024-05-01T12:03:11"),
            event_time=ts("2024-05-01T12:03:11"),
            clock_clamped=True,
        )
    ]
    for seq in (0, 1, 2, 6):
        g = b + dt.timedelta(seconds=10 * seq, hours=1 if seq == 6 else 0)
        expected.append(
            Row(gateway_id="gw-b", seq=seq, sensor_time=None, gateway_time=g, event_time=g, clock_clamped=False)
        )
    g3 = b + dt.timedelta(seconds=30)
    expected.append(
        Row(
            gateway_id="gw-b",
            seq=3,
            sensor_time=g3 + dt.timedelta(hours=2),
            gateway_time=g3,
            event_time=g3,
            clock_clamped=True,
        )
    )
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def test_dedup_keeps_the_earliest_arrival_of_each_reading(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """dedup on (gateway_id, device, boot, seq): one row per reading, the earliest arrival, copies counted."""
    got = _table(spark, built[0], "readings").select("gateway_id", "device", "boot", "seq", "arrival_time", "copies")
    expected = []
    for seq in (0, 1, 2, 3, 5, 6, 9):
        g = ts("2024-05-01T12:00:01") + dt.timedelta(seconds=10 * seq)
        expected.append(Row(gateway_id="gw-a", device="buoy-1", boot=3, seq=seq,
                            arrival_time=g + dt.timedelta(seconds=40 if seq == 3 else 1),
                            copies={2: 2, 5: 3}.get(seq, 1)))  # fmt: skip
    expected.append(
        Row(gateway_id="gw-a", device="buoy-1", boot=4, seq=1, arrival_time=ts("2024-05-01T12:03:02"), copies=1)
    )
    expected.append(
        Row(gateway_id="gw-a", device="buoy-1", boot=4, seq=2, arrival_time=ts("2024-05-01T12:03:12"), copies=1)
    )
    for seq in (0, 1, 2, 3, 6):
        g = ts("2024-05-01T12:00:05") + dt.timedelta(seconds=10 * seq, hours=1 if seq == 6 else 0)
        expected.append(
            Row(
                gateway_id="gw-b",
                device="ctd-7",
                boot=0,
                seq=seq,
                arrival_time=g + dt.timedelta(seconds=0.5),
                copies=2 if seq == 1 else 1,
            )
        )
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def test_windows_per_device_and_quantity_per_minute(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """windows: 1-minute event-time windows with count, min, max, mean per quantity (duplicates counted once)."""
    got = _table(spark, built[0], "windows").drop("date")

    def w(gw: str, dev: str, q: str, unit: str, start: str, n: int, lo: float, hi: float, mean: float) -> Row:
        s = ts(start)
        return Row(gateway_id=gw, device=dev, quantity=q, unit=unit, window_start=s,
                   window_end=s + dt.timedelta(minutes=1), count=n, min=lo, max=hi, mean=mean)  # fmt: skip

    expected = [
        w("gw-a", "buoy-1", SST, "degC", "2024-05-01T12:00:00", 5, 10.0, 15.0, 12.2),  # seq 0,1,2,3,5
        w("gw-a", "buoy-1", SST, "degC", "2024-05-01T12:01:00", 2, 16.0, 19.0, 17.5),  # seq 6, 9
        w("gw-a", "buoy-1", SST, "degC", "2024-05-01T12:03:00", 2, 20.0, 21.0, 20.5),  # boot 4
        w("gw-a", "buoy-1", "wave_height", "m", "2024-05-01T12:03:00", 1, 1.5, 1.5, 1.5),
        w("gw-b", "ctd-7", "conductivity", "S/m", "2024-05-01T12:00:00", 4, 4.1, 4.4, 4.25),
        w("gw-b", "ctd-7", "conductivity", "S/m", "2024-05-01T13:01:00", 1, 4.7, 4.7, 4.7),
    ]
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def _comp(
    gw: str,
    dev: str,
    boot: int,
    hour: str,
    first: int,
    last: int,
    received: int,
    ranges: list[tuple[int, int]],
    reboot: bool,
    closed: bool,
) -> Row:
    start = ts(hour)
    missing = sum(b - a + 1 for a, b in ranges)
    return Row(gateway_id=gw, device=dev, boot=boot, period_start=start, period_end=start + dt.timedelta(hours=1),
               first_seq=first, last_seq=last, received=received, missing=missing, expected=received + missing,
               completeness=received / (received + missing), missing_ranges=[Row(first=a, last=b) for a, b in ranges],
               reboot=reboot, closed=closed, date=DAY)  # fmt: skip


def test_completeness_from_seq_per_boot_with_reboots(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """completeness: expected vs received from seq within each boot; a new boot is a reboot (seq restarts at 0)
    and not a gap; a period is closed once its end is `grace` behind as_of (docs/message-format.md)."""
    got = _table(spark, built[0], "completeness")
    expected = [
        _comp("gw-a", "buoy-1", 3, "2024-05-01T12:00:00", 0, 9, 7, [(4, 4), (7, 8)], False, True),
        _comp("gw-a", "buoy-1", 4, "2024-05-01T12:00:00", 1, 2, 2, [(0, 0)], True, True),
        _comp("gw-b", "ctd-7", 0, "2024-05-01T12:00:00", 0, 3, 4, [], False, True),
        _comp("gw-b", "ctd-7", 0, "2024-05-01T13:00:00", 6, 6, 1, [(4, 5)], False, False),
    ]
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def test_latency_percentiles_per_gateway(spark: Any, built: tuple[Path, dict[str, int]]) -> None:
    """latency: exact percentiles (linear interpolation) per gateway of sensor -> gateway, gateway -> landing (first
    arrival) and sensor -> landing; clamped and missing sensor clocks are left out of the sensor stages."""
    got = _table(spark, built[0], "latency")
    # gw-a gateway -> landing: eight readings 1 s, seq 3 40 s; sensor -> landing: seven 1.25 s and 40.25 s
    expected = [
        Row(gateway_id="gw-a", stage="sensor_to_gateway", count=8, p50=0.25, p90=0.25, p99=0.25, max=0.25, date=DAY),
        Row(gateway_id="gw-a", stage="gateway_to_landing", count=9, p50=1.0, p90=1 + 0.2 * 39, p99=1 + 0.92 * 39,
            max=40.0, date=DAY),
        Row(gateway_id="gw-a", stage="end_to_end", count=8, p50=1.25, p90=1.25 + 0.3 * 39, p99=1.25 + 0.93 * 39,
            max=40.25, date=DAY),
        Row(gateway_id="gw-b", stage="gateway_to_landing", count=5, p50=0.5, p90=0.5, p99=0.5, max=0.5, date=DAY),
    ]  # fmt: skip
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))


def _snapshot(spark: Any, root: Path, first: dt.date, last: dt.date) -> dict[str, list[Row]]:
    # quarantine's source_file names the landing file by its full path: this copy's differs from the original's
    return {name: _table(spark, root, name, first, last).drop("source_file").collect() for name in TABLES}


def test_rerun_is_idempotent_and_folds_late_data_in(
    spark: Any, built: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    """Tables are rebuilt for a date range: running again changes nothing; after a late arrival (gw-a's lost seq 4
    landing the next day, after an outage) a re-run folds it in and the gap closes."""
    root = _copy(built, tmp_path)
    before = _snapshot(spark, root, DAY, DAY)
    jobs.run(spark, _cfg(root), "all", DAY, DAY)
    again = _snapshot(spark, root, DAY, DAY)
    for name in TABLES:
        assertDataFrameEqual(again[name], before[name])
    g = ts("2024-05-01T12:00:41")
    late = envelope("gw-a", "buoy-1", 3, 4, g, g - dt.timedelta(seconds=0.25), {SST: (14.0, "degC")})
    write_landing(root / "landing", [("fleet/gw-a/buoy-1", late, ts("2024-05-02T03:00:00"), "gw-a:4")], "late")
    stats = jobs.run(spark, _cfg(root), "all", DAY, DAY)
    assert (stats["readings"], stats["missing"], stats["quarantine"]) == (15, 5, 10)
    got = _table(spark, root, "completeness").where("gateway_id = 'gw-a' and boot = 3")
    expected = [_comp("gw-a", "buoy-1", 3, "2024-05-01T12:00:00", 0, 9, 8, [(7, 8)], False, True)]
    assertDataFrameEqual(got, spark.createDataFrame(expected, got.schema))
    row = _table(spark, root, "latency").where("gateway_id = 'gw-a' and stage = 'gateway_to_landing'").first()
    assert (row["count"], row["max"]) == (10, (ts("2024-05-02T03:00:00") - g).total_seconds())
    # nothing of 2024-05-02 was written: only the requested range is rebuilt
    assert sorted(p.name for p in (root / "tables" / "readings").iterdir()) == ["date=2024-05-01"]


def test_streaming_mode_dedups_within_watermark_and_drops_late_data(
    spark: Any, built: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    """Streaming (file source, watermark, dropDuplicatesWithinWatermark, availableNow): duplicates removed, windows
    emitted once the watermark (1 minute behind the latest event, 13:01:05) passed their end; a reading landing
    later with an event time behind the watermark is dropped (the trade-off: the batch run still counts it)."""
    from pipeline.streaming import run_stream

    landing, out, ck = tmp_path / "landing", str(tmp_path / "tables"), str(tmp_path / "checkpoints")
    shutil.copytree(built[0] / "landing", landing)
    run_stream(spark, str(landing), out, ck, watermark="1 minute", max_clock_skew=300.0)
    stream = spark.read.schema(TABLES["clean"]).parquet(out + "/stream_readings")
    assertDataFrameEqual(
        stream.select("gateway_id", "device", "boot", "seq"),
        _table(spark, built[0], "readings").select("gateway_id", "device", "boot", "seq"),
    )
    windows = spark.read.schema(TABLES["windows"]).parquet(out + "/stream_windows")
    assertDataFrameEqual(windows, _table(spark, built[0], "windows").where("window_start < '2024-05-01 13:00:00'"))
    g = ts("2024-05-01T12:00:41")
    late = envelope("gw-a", "buoy-1", 3, 4, g, g - dt.timedelta(seconds=0.25), {SST: (14.0, "degC")})
    dup = envelope("gw-b", "ctd-7", 0, 6, ts("2024-05-01T13:01:05"), None, {"conductivity": (4.7, "S/m")})
    write_landing(landing, [("fleet/gw-a/buoy-1", late, ts("2024-05-01T13:05:00"), "gw-a:4"),
                            ("fleet/gw-b/ctd-7", dup, ts("2024-05-01T13:05:00"), None)], "late")  # fmt: skip
    run_stream(spark, str(landing), out, ck, watermark="1 minute", max_clock_skew=300.0)
    stream = spark.read.schema(TABLES["clean"]).parquet(out + "/stream_readings")
    assert stream.count() == 14  # the late seq 4 is behind the watermark, the duplicate of seq 6 is recognised
    quarantine = spark.read.schema(TABLES["quarantine"]).parquet(out + "/stream_quarantine")
    assert sorted(r["reason"] for r in quarantine.collect()) == sorted(
        [r for _, _, r in MALFORMED] + ["bad_landing_line"]
    )


def test_report_is_html_with_embedded_plots(spark: Any, built: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    """The fleet health report: one HTML file with four PNG plots (silences per gateway, completeness per gateway,
    latency per stage and hour, a reading series) and the closed-period completeness 13/17 readings; nothing is
    missing at the newest reading (gw-b's 13:01:05: gw-a's last, 12:03:11, is an hour older: it is missing)."""
    from pipeline.report import write_report

    out = tmp_path / "report.html"
    write_report(spark, str(built[0] / "tables"), DAY, DAY, str(out), generated=ts("2024-05-02T00:00:00"))
    text = out.read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', text)
    assert [alt for alt, _ in images] == ["silences per gateway", "completeness per gateway",
                                          "latency per stage and hour", "reading series"]  # fmt: skip
    for _, data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<b>76.47%</b>complete" in text
    assert "<b>10</b>quarantined" in text
    assert "Generated 2024-05-02 00:00 UTC." in text
    assert "<td>gw-a</td><td>buoy-1</td><td>2024-05-01 12:03</td><td>00:57</td><td>9</td>" in text
    assert "<td>gw-a</td><td>1</td><td>9</td><td>3</td><td>69.23%</td><td>4</td><td>1</td><td>1</td>" in text


def test_spark_submit_settings_win_over_the_defaults(built: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    """The same job under spark-submit (as on a cluster): the launcher's master and --conf win over the built-in
    small-machine defaults (which would be local[*] and 4 shuffle partitions)."""
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        pytest.skip("spark-submit is not in the venv")
    import pyspark

    env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}  # fmt: skip
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    proc = subprocess.run(
        [str(submit), "--master", "local[1]", "--conf", "spark.sql.shuffle.partitions=3",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         "--conf", "spark.ui.enabled=false", str(ROOT / "pipeline" / "submit.py"), "--log-level", "warning",
         "run", "clean", "--from", "2024-05-01", "--to", "2024-05-01",
         "--landing", str(built[0] / "landing"), "--tables", str(tmp_path / "tables")],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"stage": "clean", "from": "2024-05-01", "to": "2024-05-01", "clean": 18, "quarantine": 10,
                      "spark": {"spark.master": "local[1]", "spark.sql.shuffle.partitions": "3"}}  # fmt: skip


def test_gateway_and_lander_never_import_pyspark() -> None:
    """pyspark is an optional extra: the gateway's modules and the lander import without it being loaded."""
    code = (
        "import importlib, pkgutil, sys, gateway\n"
        "for m in pkgutil.walk_packages(gateway.__path__, 'gateway.'):\n"
        "    if m.name.endswith('__main__'): continue\n"
        "    try: importlib.import_module(m.name)\n"
        "    except ImportError as e: print('skipped', m.name, e)\n"
        "import pipeline.cli, pipeline.lander\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pyspark', 'py4j')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_landing_writer_hides_unrolled_lines(tmp_path: Path) -> None:
    """The landing area is immutable and never half-written: lines are invisible until roll() renames the hidden
    temporary file, and a crashed writer's temporary files are removed on restart."""
    from pipeline.lander import LandingWriter, landing_record

    writer = LandingWriter(tmp_path, "lander-1")
    at = ts("2024-05-01T23:59:59.5")
    writer.append(landing_record("fleet/gw-a/buoy-1", b"{}", at, "gw-a:1", 1, False), "gw-a", at)
    assert landed_lines(tmp_path) == []
    hidden = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert len(hidden) == 1 and hidden[0].startswith(".part-20240501T235959500000Z-lander-1-"), hidden
    assert hidden[0].endswith(".jsonl.inprogress")
    files = writer.roll()
    assert [f.relative_to(tmp_path).parent.as_posix() for f in files] == ["date=2024-05-01/gateway=gw-a"]
    assert landed_lines(tmp_path) == [{"topic": "fleet/gw-a/buoy-1", "arrival": "2024-05-01T23:59:59.500000Z",
                                       "msg_id": "gw-a:1", "qos": 1, "retain": False, "payload": {}}]  # fmt: skip
    writer.append(landing_record("fleet/gw-a/buoy-1", b"{}", at, None, 1, False), "gw-a", at)
    writer._open.popitem()[1].handle.close()  # a crash: the file stays hidden
    assert LandingWriter(tmp_path, "other").remove_stale_temp_files() == 0
    assert LandingWriter(tmp_path, "lander-1").remove_stale_temp_files() == 1
    assert list(tmp_path.rglob("*.inprogress")) == []


def test_landing_format_2_embeds_a_json_object_payload_byte_for_byte(tmp_path: Path) -> None:
    """Landing format 2: a payload that is one strict JSON object on one line is written into the line as the object
    itself, byte for byte, as the last key; anything else (not an object, NaN, a line break, not UTF-8) stays a
    JSON string (or base64), as in format 1, which ``embed_objects=False`` still writes."""
    from pipeline.lander import encode_line, landing_record

    at = ts("2024-05-01T12:00:00")
    head = '{"topic":"fleet/gw-a/b","arrival":"2024-05-01T12:00:00.000000Z","msg_id":null,"qos":1,"retain":false'

    def line(payload: bytes, embed: bool = True) -> str:
        return encode_line(landing_record("fleet/gw-a/b", payload, at, None, 1, False, embed)).decode()

    spaced = b'{ "v": 1,  "x": 1.50, "s": "\\u00e9\\n", "n": null }'
    assert line(spaced) == head + ',"payload":' + spaced.decode() + "}\n"
    assert json.loads(line(spaced))["payload"] == json.loads(spaced)
    assert line(spaced, embed=False) == head + ',"payload":' + json.dumps(spaced.decode(), ensure_ascii=False) + "}\n"
    for text in [b"[1, 2]", b'"x"', b"12", b"not json", b'{"v": NaN}', b'{"v":\n1}', b'{"v": 1} {"v": 2}', b""]:
        assert json.loads(line(text))["payload"] == text.decode(), text
    assert json.loads(line(b"\xff{}"))["payload_b64"] == "/3t9"


def test_landing_format_1_and_2_give_the_same_tables(spark: Any, tmp_path: Path) -> None:
    """The same messages landed as format 1 (every payload a JSON string: landing areas from before) and as format 2
    (JSON object payloads embedded) give identical rows in every table, whichever way each line is parsed (once,
    when the envelope is complete and valid; else field by field as before); the quarantine keeps a format 2
    payload's exact text (spacing included)."""
    arrival = ts("2024-05-01T12:06:00")
    odd = [  # spaced (not Spark's compact rewrite), sensor_time absent, a null field, a bad name, duplicate keys
        b'{ "v": 1, "gateway_id": "gw-a", "device": "buoy-1", "boot": 3, "seq": -5, "sensor_time": null,'
        b' "gateway_time": "2024-05-01T12:05:00.000Z", "values": {"sst": {"value": 1.0e0, "unit": "degC"}} }',
        b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":80,'
        b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}',
        b'{"v":1,"gateway_id":null,"device":"buoy-1","boot":3,"seq":81,"sensor_time":null,'
        b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"sst":{"value":1,"unit":"degC"}}}',
        b'{"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":82,"sensor_time":"2024-05-01T12:04:59.000Z",'
        b'"gateway_time":"2024-05-01T12:05:00.000Z","values":{"Sea Temp":{"value":1,"unit":"degC"}}}',
        b'{"v":1,"v":1,"gateway_id":"gw-a","device":"buoy-1","boot":3,"seq":83,"sensor_time":null,'
        b'"gateway_time":"2024-05-01T12:05:01.000Z","values":{"sst":{"value":2,"unit":"degC"}}}',
    ]
    records = _gw_a() + _gw_b() + [(t, p, arrival, None) for t, p, _ in MALFORMED]
    records += [("fleet/gw-a/buoy-1", p, arrival, f"gw-a:{i}") for i, p in enumerate(odd)]
    snapshots = []
    for embed in (False, True):
        root = tmp_path / f"embed-{embed}"
        write_landing(root / "landing", records, embed=embed)
        stats = jobs.run(spark, _cfg(root), "all", DAY, DAY)
        assert (stats["clean"], stats["quarantine"]) == (19, 13)
        snapshots.append(_snapshot(spark, root, DAY, DAY))
    for name in TABLES:
        assertDataFrameEqual(snapshots[1][name], snapshots[0][name])
    quarantined = {r["payload"] for r in snapshots[1]["quarantine"]}
    assert {odd[0].decode(), odd[1].decode(), odd[2].decode(), odd[3].decode()} <= quarantined
    reasons = {r["payload"]: r["reason"] for r in snapshots[1]["quarantine"]}
    assert [reasons[p.decode()] for p in odd[:4]] == [
        "negative:seq", "missing:sensor_time", "missing:gateway_id", "bad_name:Sea Temp"
    ]  # fmt: skip
