"""The fleet health report read by an operator: what is missing now and since when, outages per
gateway, how late data arrives (p50/p99/max), one device's readings with gaps left blank; one self-contained HTML
file, rendered in headless Chromium (Debian ``chromium``; ``make deps`` installs it) and saved as a screenshot under
build/screenshots/."""

from __future__ import annotations

import datetime as dt
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pipeline_fixtures import ROOT, spark, ts, write_landing
from test_pipeline_rebuilds import Reading, _device, _records

from pipeline import jobs
from pipeline.report import write_report

__all__ = ["spark"]

SCREENSHOTS = ROOT / "build" / "screenshots"


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (make deps installs it)")
    return exe


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 6000) -> Path:
    """Render ``html`` in headless Chromium (no network: the file must be self-contained) and save a PNG."""
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-background-networking", "--user-data-dir=" + str(png.parent / ".chromium-profile"),
         f"--window-size={width},{height}", f"--screenshot={png}", html.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and png.exists(), proc.stderr[-2000:]
    return png


def demo_landing(root: Path) -> None:
    """Three gateways over two days, a reading every 10 minutes: gw-north (a device silent for 9 hours, then
    another still silent at the end), gw-south (out for 6 hours: its backlog lands when it is back), gw-east
    (steady, 1% lost)."""
    rng = random.Random(7)
    start, end, period = ts("2024-07-01T00:02:00"), ts("2024-07-03T00:00:00"), dt.timedelta(minutes=10)
    out = ts("2024-07-02T03:00:00"), ts("2024-07-02T09:00:00")
    readings: list[Reading] = []
    readings += _device("gw-north", "buoy-1", start, end, period, [(ts("2024-07-01T08:00:00"),
                                                                    ts("2024-07-01T17:00:00"))], [])  # fmt: skip
    readings += _device("gw-north", "buoy-2", start, end, period, [(ts("2024-07-02T20:00:00"), end)], [])
    south = _device("gw-south", "ctd-1", start, end, period, [], [], lost=0.01, rng=rng)
    south += _device("gw-south", "ctd-2", start, end, period, [], [ts("2024-07-02T09:00:00")], lost=0.01, rng=rng)
    readings += _device("gw-east", "wave-1", start, end, period, [], [], lost=0.01, rng=rng)
    records = _records(readings, rng, late=False)
    # gw-south's uplink is out: its readings are stored and forwarded when it is back (late, not lost)
    for r in _records(south, rng, late=False):
        topic, payload, arrival, msg_id = r
        at = arrival - dt.timedelta(seconds=5)
        records.append((topic, payload, out[1] + dt.timedelta(seconds=rng.uniform(1, 120)) if out[0] <= at < out[1]
                        else arrival, msg_id))  # fmt: skip
    write_landing(root, records)


@pytest.mark.timeout(300)
def test_report_answers_the_operator_and_renders_in_chromium(spark: Any, tmp_path: Path) -> None:
    """The demo report: the sections in the operator's order, gw-north/buoy-2 missing since 07-02 19:52, gw-south's
    outage drawn, nothing loaded from the network, and Chromium renders it (a non-blank screenshot)."""
    demo_landing(tmp_path / "landing")
    first, last = dt.date(2024, 7, 1), dt.date(2024, 7, 2)
    cfg = jobs.JobConfig(landing=str(tmp_path / "landing"), tables=str(tmp_path / "tables"),
                         as_of=ts("2024-07-04T00:00:00"))  # fmt: skip
    jobs.run(spark, cfg, "all", first, last)
    html = tmp_path / "fleet.html"
    write_report(spark, cfg.tables, first, last, str(html), generated=ts("2024-07-04T00:00:00"))
    text = html.read_text()

    order = [text.index(h) for h in ("Missing data now", "Outages", "Completeness</h2>", "Latency</h2>",
                                     "Readings</h2>")]  # fmt: skip
    assert order == sorted(order)
    assert not re.search(r'(src|href)="(https?:)?//', text), "the report must not load anything from the network"
    alts = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', text)
    assert alts == ["silences per gateway", "completeness per gateway", "latency per stage and hour",
                    "reading series"]  # fmt: skip
    # what is missing now (the newest reading is 07-02 23:5x): buoy-2 since its last reading before 20:00
    assert re.search(r"<td>gw-north</td><td>buoy-2</td><td>2024-07-02 19:5\d</td><td>0[34]:\d\d</td>", text), text
    assert "<td>gw-north</td><td>1 of 2</td>" in text
    assert "UTC" in text

    png = screenshot(html, SCREENSHOTS / "report-demo-3-gateways.png")
    from matplotlib import image

    pixels = image.imread(str(png))
    assert pixels.shape[1] == 1280 and pixels.shape[0] > 2000
    assert len({tuple(p) for p in pixels[::37, ::23].reshape(-1, pixels.shape[2]).tolist()}) > 20  # not blank
