"""Rebuilding a date range gives the rows a full run gives, for every table, whatever the silences:
a device silent for 3 days (and one that reboots while silent) rebuilt day by day, and random silences, reboots,
duplicates and late arrivals checked against the full run and, for completeness, against a model in plain Python."""

from __future__ import annotations

import datetime as dt
import random
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pipeline_fixtures import envelope, spark, ts, write_landing
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from pipeline import jobs
from pipeline import tables as tbl
from pipeline.schema import TABLES

__all__ = ["spark"]

UTC = dt.UTC
Record = tuple[str, bytes, dt.datetime, str | None]
SENSOR_BEHIND = dt.timedelta(seconds=0.3)  # the sensor clock: its time is the event time


@dataclass
class Reading:
    """One reading a device produced: delivered (possibly several copies, possibly late) or lost."""

    gateway: str
    device: str
    boot: int
    seq: int
    at: dt.datetime  # gateway time (the event time is the sensor's, SENSOR_BEHIND earlier)
    delivered: bool


def _records(readings: list[Reading], rng: random.Random, late: bool = True) -> list[Record]:
    """Landing records of the delivered readings: 0.5-5 s after the gateway time, 5% twice (QoS 1 redelivery),
    with ``late`` 3% a day later (a backlog after an outage: within the default --lateness of 2 days)."""
    out: list[Record] = []
    for r in readings:
        if not r.delivered:
            continue
        payload = envelope(r.gateway, r.device, r.boot, r.seq, r.at, r.at - SENSOR_BEHIND,
                           {"sea_surface_temperature": (10.0 + r.seq % 7, "degC")})  # fmt: skip
        delay = dt.timedelta(seconds=rng.uniform(0.5, 5.0))
        if late and rng.random() < 0.03:
            delay += dt.timedelta(days=1)
        copies = 2 if rng.random() < 0.05 else 1
        for c in range(copies):
            arrival = r.at + delay + dt.timedelta(seconds=30 * c)
            out.append((f"fleet/{r.gateway}/{r.device}", payload, arrival, f"{r.gateway}:{r.boot}:{r.seq}"))
    return out


def _device(gateway: str, device: str, start: dt.datetime, end: dt.datetime, period: dt.timedelta,
            silences: list[tuple[dt.datetime, dt.datetime]], reboots: list[dt.datetime], boot: int = 1,
            lost: float = 0.0, rng: random.Random | None = None) -> list[Reading]:  # fmt: skip
    """A device reading every ``period`` from ``start`` to ``end``; nothing delivered during ``silences`` (seq goes
    on: the readings are lost), a new boot with seq from 0 at each of ``reboots``, ``lost`` a random share lost."""
    out, seq, t, pending = [], 0, start, sorted(reboots)
    while t < end:
        while pending and pending[0] <= t:
            pending.pop(0)
            boot, seq = boot + 1, 0
        silent = any(a <= t < b for a, b in silences)
        delivered = not silent and not (rng is not None and rng.random() < lost)
        out.append(Reading(gateway, device, boot, seq, t, delivered))
        seq += 1
        t += period
    return out


def _days(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]


def _cfg(root: Path, tables: str, as_of: dt.datetime) -> jobs.JobConfig:
    return jobs.JobConfig(landing=str(root / "landing"), tables=str(root / tables), as_of=as_of)


def _assert_same_tables(spark: Any, root: Path, got: str, want: str, first: dt.date, last: dt.date) -> None:
    """Every table of ``got`` equals ``want``'s over first..last, row by row."""
    for name in TABLES:
        a = tbl.read_table(spark, str(root / got), name, first, last)
        b = tbl.read_table(spark, str(root / want), name, first, last)
        try:
            assertDataFrameEqual(a, b)
        except AssertionError as exc:
            raise AssertionError(f"table {name}: {got} differs from {want}\n{exc}") from None


def _completeness(spark: Any, root: Path, tables: str, first: dt.date, last: dt.date) -> list[tuple[Any, ...]]:
    """(gateway, device, boot, hour start in Unix seconds, received, missing, missing ranges, reboot), sorted."""
    table = tbl.read_table(spark, str(root / tables), "completeness", first, last)
    rows = table.withColumn("period_start", F.unix_seconds("period_start")).collect()
    return sorted((r["gateway_id"], r["device"], r["boot"], r["period_start"], r["received"], r["missing"],
                   [(m["first"], m["last"]) for m in r["missing_ranges"]], r["reboot"]) for r in rows)  # fmt: skip


FIRST, LAST = dt.date(2024, 6, 1), dt.date(2024, 6, 6)
AS_OF = ts("2024-06-10T00:00:00")


@pytest.mark.timeout(300)
def test_a_device_silent_for_three_days_keeps_its_gap_in_single_day_rebuilds(spark: Any, tmp_path: Path) -> None:
    """gw-s/quiet is silent from 06-01 18:00 to 06-04 18:00 (3 days; seq goes on) and is back on 06-04;
    gw-s/reboot is silent as long and comes back on a new boot, its first readings lost. Day-by-day runs (the
    cron case: `run all --from D --to D` for each day, in order) give every table exactly the rows of one `run all`
    over the six days. With the old fixed 1-day lookback
    the gap and the reboot on 06-04 were lost."""
    rng = random.Random(19)
    start, end, period = ts("2024-06-01T00:01:00"), ts("2024-06-07T00:00:00"), dt.timedelta(minutes=20)
    silence = [(ts("2024-06-01T18:00:00"), ts("2024-06-04T18:00:00"))]
    readings = (
        _device("gw-s", "quiet", start, end, period, silence, [])
        + _device("gw-s", "reboot", start, end, period, silence, [ts("2024-06-03T00:00:00")])
        + _device("gw-t", "steady", start, end, period, [], [], lost=0.02, rng=rng)
    )
    write_landing(tmp_path / "landing", _records(readings, rng, late=False))
    jobs.run(spark, _cfg(tmp_path, "full", AS_OF), "all", FIRST, LAST)
    for day in _days(FIRST, LAST):
        jobs.run(spark, _cfg(tmp_path, "daily", AS_OF), "all", day, day)
    _assert_same_tables(spark, tmp_path, "daily", "full", FIRST, LAST)

    back = int(ts("2024-06-04T18:00:00").timestamp())
    got = [r for r in _completeness(spark, tmp_path, "daily", FIRST, LAST) if r[0] == "gw-s" and r[3] == back]
    # quiet: seq n at 06-01 00:01 + 20 min * n; 54 (18:01) .. 269 lost, 270 (06-04 18:01) the first back
    # reboot: boot 2 started 06-03 00:01 at seq 0 and is first heard at seq 126 (06-04 18:01): a reboot, 0..125 lost
    assert got == [
        ("gw-s", "quiet", 1, back, 3, 216, [(54, 269)], False),
        ("gw-s", "reboot", 2, back, 3, 126, [(0, 125)], True),
    ]


def _model(readings: list[Reading]) -> list[tuple[Any, ...]]:
    """Completeness of a full run, computed in plain Python from what was delivered (docs/pipeline.md): within a
    boot a jump a -> b > a+1 reveals a+1..b-1 in b's hour; a boot after the device's first one is a reboot, its
    first reading s > 0 revealing 0..s-1."""
    got = [r for r in readings if r.delivered]
    first_boot: dict[tuple[str, str], int] = {}
    for r in got:
        key = (r.gateway, r.device)
        first_boot[key] = min(first_boot.get(key, r.boot), r.boot)
    by_boot: dict[tuple[str, str, int], list[Reading]] = defaultdict(list)
    for r in got:
        by_boot[(r.gateway, r.device, r.boot)].append(r)
    hours: dict[tuple[Any, ...], dict[str, Any]] = {}
    for (g, d, b), rs in by_boot.items():
        prev = None
        for r in sorted(rs, key=lambda x: x.seq):
            event = r.at - SENSOR_BEHIND
            hour = int(event.replace(minute=0, second=0, microsecond=0).timestamp())
            h = hours.setdefault((g, d, b, hour), {"received": 0, "ranges": [], "reboot": False})
            h["received"] += 1
            if prev is None and b > first_boot[(g, d)]:
                h["reboot"] = True
                if r.seq > 0:
                    h["ranges"].append((0, r.seq - 1))
            elif prev is not None and r.seq - prev > 1:
                h["ranges"].append((prev + 1, r.seq - 1))
            prev = r.seq
    return sorted((g, d, b, hour, h["received"], sum(y - x + 1 for x, y in h["ranges"]), sorted(h["ranges"]),
                   h["reboot"]) for (g, d, b, hour), h in hours.items())  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1])
def test_rebuilds_match_the_full_run_over_random_silences_and_reboots(spark: Any, tmp_path: Path, seed: int) -> None:
    """Property-style, each device one random example (more seeds: add them above): 24 devices, each with 0-3
    silences of 1 hour to 3.5 days, 0-3 reboots (some while silent), 2% random losses, 5% duplicates and 3% landing
    a day late, over four days. The full run's completeness equals the plain-Python model; then single-day rebuilds
    of every day, in random order, leave every table as the full run wrote it."""
    rng = random.Random(seed)
    first, last = dt.date(2024, 6, 1), dt.date(2024, 6, 4)
    start, end = ts("2024-06-01T00:00:00"), ts("2024-06-05T00:00:00")
    span = (end - start).total_seconds()
    readings: list[Reading] = []
    for i in range(24):
        silences = []
        for _ in range(rng.randrange(4)):
            a = start + dt.timedelta(seconds=rng.uniform(0, span))
            silences.append((a, a + dt.timedelta(hours=rng.uniform(1, 84))))
        reboots = [start + dt.timedelta(seconds=rng.uniform(0, span)) for _ in range(rng.randrange(4))]
        period = dt.timedelta(minutes=rng.choice([10, 15, 30]))
        offset = dt.timedelta(seconds=rng.uniform(0, 600))
        readings += _device(f"gw-{i % 4}", f"dev-{i}", start + offset, end, period, silences, reboots,
                            boot=rng.randrange(1, 5), lost=0.02, rng=rng)  # fmt: skip
    write_landing(tmp_path / "landing", _records(readings, rng))
    # the model counts readings of the four days only: the run's range
    in_range = [r for r in readings if first <= (r.at - SENSOR_BEHIND).date() <= last]
    assert in_range == readings

    jobs.run(spark, _cfg(tmp_path, "full", AS_OF), "all", first, last)
    assert _completeness(spark, tmp_path, "full", first, last) == _model(readings)
    shutil.copytree(tmp_path / "full", tmp_path / "rebuilt")
    days = _days(first, last)
    rng.shuffle(days)
    for day in days:
        jobs.run(spark, _cfg(tmp_path, "rebuilt", AS_OF), "all", day, day)
    _assert_same_tables(spark, tmp_path, "rebuilt", "full", first, last)
