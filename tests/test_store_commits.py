"""When the LMDB store commits (gateway/store/lmdb_store.py; docs/architecture.md, "The durability contract"), on
a real store and a real event loop.

Work a client waits for is committed at the end of the loop turn that recorded it. That covers a PUBACK, PUBREC,
PUBCOMP, SUBACK or UNSUBACK, and a QoS 2 send (all held under a commit barrier). Changes nobody waits for (deletes
after acknowledgements, Packet Identifier updates of QoS 1 sends) wait up to ``lazy_commit`` and share a commit.
If a waiter arrives in the meantime, the commit is brought forward. Commits write over space written ahead in
the data file where they can.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from held_acks import HeldAcks

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import NEVER, Session
from gateway.store.lmdb_store import LmdbStore, StoreSettings


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _open(path: Path, loop: asyncio.AbstractEventLoop, lazy_commit: float) -> LmdbStore:
    store = LmdbStore(StoreSettings(path=str(path), lazy_commit=lazy_commit), ZoneLimits)
    store.load(0.0)
    store.attach(loop)
    store.session_saved(Session("sub", ZoneLimits(), expiry_interval=NEVER))
    return store


def _turns(loop: asyncio.AbstractEventLoop, n: int = 20) -> None:
    """Let the loop run ``n`` turns (and the writer thread a moment each)."""
    for _ in range(n):
        loop.run_until_complete(asyncio.sleep(0.001))


def _until(loop: asyncio.AbstractEventLoop, done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Run the loop a turn at a time (the writer thread a moment each) until ``done()``, for at most ``timeout``
    seconds: a commit's fsync may take a while on a busy machine."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        _turns(loop, 1)


def _queue_rows(store: LmdbStore) -> int:
    assert store.env is not None
    with store.env.begin() as txn:
        return int(txn.stat(store.tables.queue)["entries"])


def test_changes_nobody_waits_for_share_a_later_commit(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """With ``lazy_commit`` 10 s, deletes that nobody waits for stay uncommitted across many loop turns (so they
    can share one commit); the first commit barrier commits them all, in one transaction, at the next turn."""
    store = _open(tmp_path / "store", loop, lazy_commit=10.0)
    try:
        deliveries = [Delivery(Message(i, "t", b"x", 1, False, {}, 0.0), 1) for i in range(1, 6)]
        for delivery in deliveries:
            store.delivery_saved("sub", delivery)
        held = HeldAcks(store)
        acked = held.events
        held.wait(1)  # a PUBACK waits: committed at once
        _until(loop, lambda: acked == [1])
        assert acked == [1] and _queue_rows(store) == 5
        commits = store.commits
        for delivery in deliveries[:3]:
            store.delivery_deleted("sub", delivery)  # acknowledged by the subscriber: nobody waits
            _turns(loop, 5)
        assert store.commits == commits and _queue_rows(store) == 5  # still waiting to share a commit
        held.wait(2)
        _until(loop, lambda: acked == [1, 2])
        assert acked == [1, 2]
        assert store.commits == commits + 1 and _queue_rows(store) == 2
    finally:
        store.close()


def test_lazy_changes_are_committed_within_lazy_commit(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """Without a waiter, a lazy change is still committed once ``lazy_commit`` passed; with ``lazy_commit`` 0
    every change is committed at the end of its loop turn."""
    for lazy in (0.02, 0.0):
        path = tmp_path / f"store-{lazy}"
        store = _open(path, loop, lazy_commit=lazy)
        try:
            delivery = Delivery(Message(1, "t", b"x", 1, False, {}, 0.0), 1)
            store.delivery_saved("sub", delivery)
            held = HeldAcks(store)
            done = held.events
            held.wait(1)
            _until(loop, lambda done=done: done == [1])  # type: ignore[misc]
            assert done == [1]
            store.delivery_deleted("sub", delivery)
            _until(loop, lambda store=store: not store.pending())  # type: ignore[misc]
            assert not store.pending()
            assert _queue_rows(store) == 0
        finally:
            store.close()


def test_close_commits_lazy_changes(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """A clean stop commits what was still waiting to share a commit: after reopening, the deletes are there."""
    store = _open(tmp_path / "store", loop, lazy_commit=10.0)
    delivery = Delivery(Message(1, "t", b"x", 1, False, {}, 0.0), 1)
    store.delivery_saved("sub", delivery)
    held = HeldAcks(store)
    done = held.events
    held.wait(1)
    _until(loop, lambda: done == [1])
    store.delivery_deleted("sub", delivery)
    _turns(loop, 3)
    assert _queue_rows(store) == 1
    store.close()
    reopened = LmdbStore(StoreSettings(path=str(tmp_path / "store")), ZoneLimits)
    try:
        reopened.load(0.0)
        assert _queue_rows(reopened) == 0
    finally:
        reopened.close()


def _save_and_commit(store: LmdbStore, loop: asyncio.AbstractEventLoop, count: int, size: int) -> None:
    for mid in range(1, count + 1):
        store.delivery_saved("sub", Delivery(Message(mid, "t", b"x" * size, 1, False, {}, 0.0), 1))
    held = HeldAcks(store)
    done = held.events
    held.wait(1)
    _until(loop, lambda: done == [1])
    assert done == [1]


def test_commits_write_over_space_written_ahead(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """After a commit the data file holds 2-4 MiB of written (allocated, not sparse) space past LMDB's last page
    and never more than the map, so the next commits overwrite blocks instead of extending the file. LMDB
    reopens the larger file with everything in it."""
    path = tmp_path / "store"
    store = _open(path, loop, lazy_commit=0.0)
    try:
        _save_and_commit(store, loop, 200, 1000)
        assert store.env is not None
        last_page_end = (store.env.info()["last_pgno"] + 1) * store.env.stat()["psize"]
        st = (path / "data.mdb").stat()
        assert last_page_end + 2 * 1024 * 1024 <= st.st_size <= min(last_page_end + 4 * 1024 * 1024, store.map_size)
        assert st.st_blocks * 512 >= st.st_size
    finally:
        store.close()
    reopened = LmdbStore(StoreSettings(path=str(path)), ZoneLimits)
    try:
        state = reopened.load(0.0)
        assert [len(s.mqueue) for s in state.sessions] == [200]
    finally:
        reopened.close()


def test_writing_ahead_gives_way_when_the_file_cannot_grow(tmp_path: Path) -> None:
    """When the space ahead cannot be written (here a 1 MiB file size limit, RLIMIT_FSIZE, in a child process; a
    full disk behaves alike), the store logs it once, gives the partial extension back and keeps committing;
    everything committed reloads."""
    path = tmp_path / "store"
    script = f"""
import asyncio, logging, resource, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_store_commits import _open, _save_and_commit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
logging.basicConfig(level=logging.WARNING)
loop = asyncio.new_event_loop()
from pathlib import Path
store = _open(Path({str(path)!r}), loop, lazy_commit=0.0)
for _ in range(3):
    _save_and_commit(store, loop, 20, 1000)
store.close()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "could not write" in line]
    assert len(warnings) == 1, result.stderr
    assert "data.mdb" in warnings[0] and "commits extend the file instead" in warnings[0]
    assert (path / "data.mdb").stat().st_size < 1 << 20
    reopened = LmdbStore(StoreSettings(path=str(path)), ZoneLimits)
    try:
        state = reopened.load(0.0)
        assert [len(s.mqueue) for s in state.sessions] == [60]  # three rounds of 20 queue rows
    finally:
        reopened.close()
