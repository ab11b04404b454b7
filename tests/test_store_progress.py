"""Long store work shows progress, on a store of 6,000 sessions with 4 queued messages each built by the
test through the real LmdbStore (about 32,000 rows).

- ``edge-gateway store inspect`` and ``store compact`` under a pseudo-terminal (the ``pty`` module) draw a tqdm
  bar on stderr (rows done of all rows, bytes, rate, time left); with pipes, or under systemd (``INVOCATION_ID``
  set) even on a terminal, they draw none and their output is the same.
- The broker opening that store at start-up, with ``NOTIFY_SOCKET`` pointing at a datagram socket the test owns:
  ``STATUS=loading store: N of M sessions, K of L queued messages`` arrives at once and then as the load goes on,
  all before ``READY=1``, with N and K never going back; the log has the progress lines and a summary.
  ``EDGE_GATEWAY_PROGRESS_INTERVAL`` shortens the 2 s interval so that a load of under a second shows several.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import BrokerProcess
from test_systemd_notify import NotifySocket

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import NEVER, Session
from gateway.server.load_progress import LoadReporter, progress_interval
from gateway.store.lmdb_store import LmdbStore, StoreSettings
from gateway.store.loading import LoadProgress

SESSIONS = 6000
QUEUED = 4  # per session
CONFIG = """
[store]
path = "var"
[listeners.external]
bind = "127.0.0.1:0"
"""
STATUS = re.compile(r"STATUS=loading store: (\d+) of (\d+) sessions, (\d+) of (\d+) queued messages")
#: tqdm's bar: "reading store:  45%|####5     | 14.4k/32.0k [00:01<00:01, 9.61k rows/s, 1.2MB read, table queue]"
BAR = re.compile(r"(\d+)%\|.*\| *[\d.]+k?/[\d.]+k? \[[\d:]+<[\d:?]+, +[\d.?]+k? ?rows/s")


def build_store(path: Path, sessions: int = SESSIONS, queued: int = QUEUED) -> None:
    """``sessions`` persistent sessions (never expiring), each with ``queued`` QoS 1 messages of 100 bytes, written
    through the real store as the broker writes them."""
    loop = asyncio.new_event_loop()
    store = LmdbStore(StoreSettings(path=str(path), max_size=256 * 1024 * 1024))
    store.load(time.time())
    store.attach(loop)

    async def settle() -> None:
        while store.pending():
            await asyncio.sleep(0.001)

    mid = 0
    for i in range(sessions):
        session = Session(f"sensor-{i:06d}", ZoneLimits(), expiry_interval=NEVER)
        store.session_saved(session)
        for _ in range(queued):
            mid += 1
            message = Message(mid, f"plant/{i}/temp", b"x" * 100, 1, False, {}, 0.0)
            store.delivery_saved(session.client_id, Delivery(message, 1))
        if i % 500 == 499:
            loop.run_until_complete(settle())
    loop.run_until_complete(settle())
    store.close()
    loop.close()


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with gateway.toml and the store (``var``)."""
    workdir = tmp_path_factory.mktemp("bigstore")
    (workdir / "gateway.toml").write_text(CONFIG)
    build_store(workdir / "var")
    return workdir


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET")}
    env.update(extra, PYTHONUNBUFFERED="1", COLUMNS="120")
    return env


def run_in_pty(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120.0) -> tuple[int, str]:
    """Run ``python -m gateway ARGS`` with stdin, stdout and stderr on a new pseudo-terminal; return its exit
    code and everything it wrote there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            out += data
        code = proc.wait(max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, out.decode("utf-8", "replace")


def test_store_inspect_on_a_terminal_shows_a_progress_bar(big_store: Path) -> None:
    code, out = run_in_pty(["store", "inspect", "-c", "gateway.toml"], big_store, _env())
    assert code == 0, out
    bars = BAR.findall(out)
    assert bars, out[-2000:]
    assert "reading store" in out and "100%" in out, out[-2000:]
    assert "B read" in out  # bytes read, in the bar's postfix
    assert out.count("session 'sensor-") == SESSIONS
    assert "queued 4, in flight 0" in out


def test_store_inspect_without_a_terminal_or_under_systemd_shows_none(big_store: Path) -> None:
    piped = subprocess.run(
        [sys.executable, "-m", "gateway", "store", "inspect", "-c", "gateway.toml"],
        cwd=big_store,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == ""
    assert piped.stdout.count("session 'sensor-") == SESSIONS
    assert "reading store" not in piped.stdout and "\r" not in piped.stdout
    code, out = run_in_pty(["store", "inspect", "-c", "gateway.toml"], big_store, _env(INVOCATION_ID="0123abcd"))
    assert code == 0, out
    assert "reading store" not in out and not BAR.search(out), out[:2000]
    assert out.count("session 'sensor-") == SESSIONS


def test_store_compact_on_a_terminal_shows_a_progress_bar_and_keeps_every_row(tmp_path: Path) -> None:
    workdir = tmp_path / "compact"
    workdir.mkdir()
    (workdir / "gateway.toml").write_text(CONFIG)
    build_store(workdir / "var", sessions=2000)
    code, out = run_in_pty(["store", "compact", "-c", "gateway.toml"], workdir, _env())
    assert code == 0, out
    assert "compacting" in out and BAR.search(out), out[-2000:]
    assert "B copied" in out
    done = re.search(r"compacted var: \d+ -> \d+ bytes \((\d+) entries\)", out)
    assert done and int(done.group(1)) == 10003, out[-500:]  # 2,000 sessions + 8,000 queued + 3 meta rows
    piped = subprocess.run(
        [sys.executable, "-m", "gateway", "store", "stats", "-c", "gateway.toml"],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert re.search(r"sessions +2000\n", piped.stdout) and re.search(r"queued +8000 deliveries", piped.stdout)


def test_broker_start_reports_store_loading_progress_before_ready(tmp_path: Path) -> None:
    """STATUS= lines with loading progress arrive before READY=1: the first at once, more as the load goes on
    (interval shortened to 0.05 s), N and K never going back and the last saying every session and queued
    message was read; the log has progress lines and the summary. The test reads the socket while the broker
    starts (the kernel queues 10 datagrams at most; the broker drops STATUS= lines rather than wait)."""
    notify = NotifySocket()
    workdir = tmp_path / "broker"
    workdir.mkdir()
    build_store(workdir / "var")
    env = {"NOTIFY_SOCKET": notify.path, "EDGE_GATEWAY_PROGRESS_INTERVAL": "0.05"}
    proc = BrokerProcess(CONFIG, workdir=str(workdir), env=env)
    reading = threading.Event()

    def read_while_starting() -> None:
        while not reading.is_set():
            notify.poll(0.05)

    reader = threading.Thread(target=read_while_starting, daemon=True)
    reader.start()
    try:
        proc.start(timeout=60)
        reading.set()
        reader.join(5)
        texts = notify.wait_for(lambda t: "READY=1" in t, timeout=30)
        ready = texts.index("READY=1")
        loading = [tuple(map(int, m.groups())) for t in texts[:ready] if (m := STATUS.match(t))]
        assert len(loading) >= 3, texts[:ready]
        assert not [t for t in texts[ready:] if STATUS.match(t)], texts  # none after READY=1
        assert loading[0][1] == SESSIONS and loading[0][3] == SESSIONS * QUEUED
        assert loading[-1] == (SESSIONS, SESSIONS, SESSIONS * QUEUED, SESSIONS * QUEUED)
        for before, after in itertools.pairwise(loading):
            assert after[0] >= before[0] and after[2] >= before[2], loading
        assert any(0 < q < SESSIONS * QUEUED for _, _, q, _ in loading), loading  # seen part-way
        log = proc.log()
        assert re.search(r"store: loading: \d+ of 6000 sessions, \d+ of 24000 queued messages", log), log
        assert "store: loaded 6000 sessions and 24000 queued messages" in log, log
    finally:
        reading.set()
        code = proc.stop()
        notify.close()
    assert code == 0, proc.log()


def test_load_reporter_sends_the_first_status_at_once_then_one_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """In process, with a fake clock: the first report sends STATUS= at once and logs nothing; later reports send
    and log only once per interval; ``done`` logs the summary (only when progress was logged) and a last STATUS=."""
    now = [100.0]
    sent: list[str] = []
    reporter = LoadReporter(interval=2.0, clock=lambda: now[0], notify=sent.append)
    progress = LoadProgress(totals={"sessions": 10, "queue": 40}, read={"sessions": 0, "queue": 0})
    caplog.set_level("INFO", logger="gateway.server")
    reporter(progress)
    assert sent == ["STATUS=loading store: 0 of 10 sessions, 0 of 40 queued messages"]
    progress.read["sessions"] = 10
    now[0] += 1.0
    reporter(progress)  # within the interval: nothing
    assert len(sent) == 1 and not caplog.records
    progress.read["queue"] = 20
    progress.bytes_read = 3 * 1048576
    now[0] += 1.5
    reporter(progress)
    assert sent[-1] == "STATUS=loading store: 10 of 10 sessions, 20 of 40 queued messages"
    assert [r.getMessage() for r in caplog.records] == [
        "store: loading: 10 of 10 sessions, 20 of 40 queued messages; 30 of 50 rows (60%, 3.0 MiB) read in 2.5 s, "
        "12 rows/s"
    ]
    progress.read["queue"] = 40
    now[0] += 0.5
    reporter.done()
    assert sent[-1] == "STATUS=loading store: 10 of 10 sessions, 40 of 40 queued messages; opening the listeners"
    assert caplog.records[-1].getMessage() == (
        "store: loaded 10 sessions and 40 queued messages (50 rows, 3.0 MiB) in 3.0 s"
    )
    assert progress_interval({"EDGE_GATEWAY_PROGRESS_INTERVAL": "0.5"}) == 0.5
    assert progress_interval({"EDGE_GATEWAY_PROGRESS_INTERVAL": "soon"}) == progress_interval({}) == 2.0
