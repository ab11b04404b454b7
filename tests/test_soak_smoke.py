"""Smoke test of the soak harness (bench/soak.py, `make soak`): a 30-second run with one kill -9.

It checks the harness, not the broker's memory (the RSS bound is lifted here; the soak itself enforces it): the
broker is killed once and restarted, both normal pairs (3.1.1 and 5.0) get messages acknowledged and every
acknowledged one delivered, the hostile scenarios ran and their answers were counted, the summary is printed, the
broker stops with 0 on SIGTERM, and the temporary directory is gone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_soak_half_minute_with_one_kill(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.5", "--kill-every", "15", "--pairs", "2",
         "--lanes", "2", "--scenario-seconds", "5", "--seed", "5", "--drain", "30", "--max-rss-mib", "8192",
         "--json", str(out)],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "## Soak summary" in proc.stdout and "- PASS:" in proc.stdout
    s = json.loads(out.read_text())
    assert (s["broker"]["kills"], s["broker"]["restarts"]) == (1, 1)
    assert s["broker"]["exit_status"] == 0
    assert s["broker"]["rss_samples"] >= 20
    assert [p["protocol"] for p in s["pairs"]] == ["3.1.1", "5.0"]
    for pair in s["pairs"]:
        assert pair["acked"] > 100, pair
        assert pair["lost"] == 0, pair
        assert pair["pub_connects"] == 2 and pair["sub_connects"] == 2, pair
    assert sum(s["hostile"]["runs"].values()) >= 4
    assert s["log"]["specials"]["Traceback"] == 0
    workdir = re.search(r"work directory (\S+);", proc.stderr)
    assert workdir is not None and not Path(workdir.group(1)).exists()
