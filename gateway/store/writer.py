"""The writer of the LMDB store: one thread that commits the batches the event loop hands over
(docs/architecture.md, "The durability contract").

:class:`LmdbWriter` is the writing half of :class:`~gateway.store.lmdb_store.LmdbStore` (its base class; the typed
operations that record changes on the loop, loading and the tools are in :mod:`gateway.store.lmdb_store`):

- the environment and its tables, and the map's growth up to ``max_size``;
- the writer thread and its queue of batches: batches that queue up while the writer is busy share one
  transaction (group commit), fsynced by LMDB's default ``sync``/``metasync``;
- applying the operations through :class:`~gateway.store.applier.BatchApplier` (``_applier``, compiled with the
  core): a batch's changes in order, queue rows of new messages with one ``putmulti`` per table, and the reference
  counts of message rows referenced more than once (kept on this thread, rolled back with an aborted transaction);
- isolating a change that fails alone (nested transactions), a full store or disk (``last_write_failed``, and a
  probe write every ``_PROBE_INTERVAL`` seconds while nothing else commits), and writing the data file ahead
  (``_preallocate``).

The results go back to the loop through two methods implemented above it: ``_committed`` (a commit landed or
failed; :class:`~gateway.store.batches.CommitBatches`) and ``_rows_not_written`` (queue rows a commit did not
write; :class:`~gateway.store.lmdb_store.LmdbStore`).

An operation is a tuple whose first item is its kind (``_PUT`` ... ``_Q_SENT`` below), recorded by the store's
typed operations and applied here.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import lmdb

from gateway.store import records as rec
from gateway.store.applier import BatchApplier, drop_superseded
from gateway.store.open_batch import DEL as _DEL
from gateway.store.open_batch import IN_DEL as _IN_DEL
from gateway.store.open_batch import IN_PUT as _IN_PUT
from gateway.store.open_batch import OB_DEL as _OB_DEL
from gateway.store.open_batch import OB_PUT as _OB_PUT
from gateway.store.open_batch import PUT as _PUT
from gateway.store.open_batch import Q_DEL as _Q_DEL
from gateway.store.open_batch import Q_PUT as _Q_PUT
from gateway.store.open_batch import Q_SENT as _Q_SENT
from gateway.store.open_batch import RET_DEL as _RET_DEL
from gateway.store.open_batch import RET_PUT as _RET_PUT
from gateway.store.open_batch import SESS_DEL as _SESS_DEL
from gateway.store.settings import StoreSettings
from gateway.store.tables import DB_NAMES, Tables

log = logging.getLogger("gateway.store")

_INITIAL_MAP = 32 * 1024 * 1024  # bytes: the map of a new store (it doubles as needed up to max_size)
_AHEAD = 4 * 1024 * 1024  # bytes of written space kept past LMDB's last page (see LmdbWriter._preallocate)
_ZEROS = bytes(1024 * 1024)

# The operations a batch holds, applied in order by BatchApplier.apply, are listed in gateway/store/open_batch.py.
#: The table each operation but _PUT, _DEL and _SESS_DEL changes (those carry their table, or several).
_OP_TABLES = {_Q_PUT: "queue", _Q_DEL: "queue", _Q_SENT: "queue", _IN_PUT: "inbound", _IN_DEL: "inbound",
              _RET_PUT: "retained", _RET_DEL: "retained", _OB_PUT: "outbox", _OB_DEL: "outbox"}

_PROBE_INTERVAL = 1.0  # seconds between writes that test whether a full store or disk takes writes again
_PROBE_FREE = 1024 * 1024  # bytes free on the file system before such a probe is tried
_FAIL_LOG_INTERVAL = 60.0  # seconds between two log lines of failed commits (a full disk fails every commit)
# Errors that fail a whole batch: the store or the disk is full, or the environment or the disk is in trouble.
# Any other error while a change is applied belongs to that change (see LmdbWriter._apply_isolated).
_BATCH_ERRORS: tuple[type[BaseException], ...] = (
    lmdb.MapFullError, lmdb.DiskError, lmdb.PanicError, lmdb.TxnFullError, lmdb.ReadonlyError, lmdb.MemoryError,
    lmdb.MapResizedError, lmdb.BadTxnError, lmdb.ReadersFullError, OSError, MemoryError,
)
#: Upper bounds (seconds) of the commit latency histogram (``fsync_buckets``): LMDB's ``txn.commit()``, which writes
#: the dirty pages and fdatasyncs the data and the meta page; the Prometheus collector reads the counts at scrape time.
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_QUOTA_TEXT = os.strerror(errno.EDQUOT)
_EIO_TEXT = os.strerror(errno.EIO)


def _bytes_of(txn: lmdb.Transaction, db: Any) -> int:
    """Bytes of the pages of table ``db`` as ``txn`` sees it."""
    stat = txn.stat(db)
    return stat["psize"] * (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"])


def _per_change(exc: BaseException) -> bool:
    """True when ``exc``, raised while a change was applied, is that change's own failure (MDB_BAD_VALSIZE and the
    like), not the batch's (no room, I/O). A bare ``lmdb.Error`` carries an errno (LMDB has no class for it): I/O."""
    return isinstance(exc, Exception) and not isinstance(exc, _BATCH_ERRORS) and type(exc) is not lmdb.Error


def _describe(op: tuple[Any, ...], tables: Tables) -> str:
    """A change for a log line: its table and key (the first 200 bytes)."""
    kind = op[0]
    if kind in (_PUT, _DEL):
        db, key = tables.name_of(op[1]), op[2]
    elif kind == _SESS_DEL:
        return f"removal of session {op[1][:200]!r}"
    else:
        db, key = _OP_TABLES[kind], op[1]
    shown = bytes(key[:200]) if isinstance(key, bytes | bytearray | memoryview) else key
    return f"{'delete from' if kind in (_DEL, _Q_DEL, _IN_DEL, _RET_DEL, _OB_DEL) else 'write to'} {db}, key of " \
        f"{len(key)} bytes {shown!r}"


def _no_room(exc: BaseException, path: Path | None = None) -> bool:
    """True when a failed commit means the store or the disk is full: MDB_MAP_FULL, ENOSPC or EDQUOT. LMDB
    reports a write cut short by a full disk as EIO, so an I/O error while the file system of ``path`` has less than
    ``_PROBE_FREE`` bytes free counts as a full disk too."""
    if isinstance(exc, lmdb.MapFullError | lmdb.DiskError):
        return True
    if not isinstance(exc, lmdb.Error):
        return False
    text = str(exc)
    return _QUOTA_TEXT in text or (path is not None and _EIO_TEXT in text and _disk_free(path) < _PROBE_FREE)


def _disk_free(path: Path) -> int:
    """Bytes free for unprivileged writers on the file system of ``path`` (``_PROBE_FREE`` when unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return _PROBE_FREE
    return st.f_bavail * st.f_frsize


class LmdbWriter:
    """The environment, its tables and the writer thread of an LMDB store (see the module's docstring).

    Args:
        settings: the ``[store]`` settings (``path``, ``max_size``, ``group_commit`` are read here).
    """

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self.path = Path(settings.path)
        self.env: lmdb.Environment | None = None
        self.tables: Tables  # set when the environment is opened (_open_env)
        #: The event loop that gets the results (``_committed``); None: commits run in the caller (tools, tests).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.map_lock = threading.Lock()  # no read transaction may be open while the writer resizes the map
        self._queue: queue.Queue[Any] = queue.Queue()  # batches: (ops, next_mid, next_seq); None stops the writer
        self._writer: threading.Thread | None = None
        self._skipped: list[tuple[tuple[Any, ...], BaseException]] = []  # changes the last commit left out
        self._applier: BatchApplier  # set with the tables (_open_env)
        #: bytes of pages by table handle, as of the last commit (``used_bytes`` is their sum; _update_used)
        self._table_bytes: dict[Any, int] = {}
        self.used_bytes = 0
        self.map_size = 0
        self._file_end = 0  # bytes: the data file's size as last written or seen (_preallocate)
        self._page_size = 0  # bytes: LMDB's page size
        self.commits = 0
        self.committed_ops = 0
        #: Commits by latency: ``fsync_buckets[i]`` counts those of at most ``FSYNC_BUCKETS[i]`` seconds (and above
        #: the one before); the last item counts the slower ones. ``fsync_seconds`` is their sum (seconds).
        self.fsync_buckets = [0] * (len(FSYNC_BUCKETS) + 1)
        self.fsync_seconds = 0.0
        self.last_commit_at = time.monotonic()
        self.write_errors = 0
        self.failed_changes = 0  # changes left out of a commit because they failed alone
        self.last_write_failed = False  # the last commit failed for lack of room (cleared by the next that succeeds)
        self.last_failure_full = False  # whether the last failed commit failed for lack of room
        self._fail_log_at = 0.0  # monotonic time before which failed commits are counted, not logged
        self._fail_log_suppressed = 0

    def _open_env(self) -> None:
        """Open the environment under ``path`` (map: the data file's size, at least ``_INITIAL_MAP`` bytes within
        ``max_size``; LMDB's default ``sync``/``metasync``) and its tables."""
        self.path.mkdir(parents=True, exist_ok=True)
        map_size = max(min(self.settings.max_size, _INITIAL_MAP), self._data_file_size())
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=len(DB_NAMES) + 1, subdir=True,
                             sync=True, metasync=True, lock=True, readahead=False)
        self.map_size = map_size
        self.tables = Tables.open(self.env)
        self._applier = BatchApplier(self.tables)
        self._file_end = self._data_file_size()
        self._page_size = self.env.stat()["psize"]
        self._update_used()

    def _data_file_size(self) -> int:
        """Bytes in ``data.mdb`` (0 when there is none)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def _update_used(self) -> None:
        """``used_bytes``: the pages of every table (``has_room`` compares it with ``max_size``)."""
        assert self.env is not None
        with self.env.begin() as txn:
            self._table_bytes = {db: _bytes_of(txn, db) for db in self.tables}
        self.used_bytes = sum(self._table_bytes.values())

    def _sizes(self, txn: Any) -> dict[Any, int]:
        """Bytes of pages of the tables the applied operations changed, as ``txn`` leaves them (the others keep
        theirs): after a commit, ``used_bytes`` stays exact with a few ``stat`` calls instead of one per table."""
        return {db: _bytes_of(txn, db) for db in self._applier.tables_changed()}

    def _start_writer(self) -> None:
        """Start the writer thread (:meth:`_write_loop`)."""
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        """The writer thread: take a batch, and every batch queued behind it (group commit), commit them as one
        transaction with ``next_mid``/``next_seq``, report to the loop; while the store is full and nothing comes,
        probe every ``_PROBE_INTERVAL`` seconds. Ends at ``None``."""
        q = self._queue
        while True:
            if self.last_write_failed and self.loop is not None:
                # Full: if nothing else commits, a tiny write tells when there is room again (has_room).
                try:
                    item = q.get(timeout=_PROBE_INTERVAL)
                except queue.Empty:
                    self._probe()
                    continue
            else:
                item = q.get()
            if item is None:
                return
            batches = [item]
            while self.settings.group_commit:
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    q.put(None)
                    break
                batches.append(more)
            ops = [op for batch in batches for op in batch[0]]
            if len(batches) > 1:
                ops = drop_superseded(ops)  # within one batch, a deleted delivery's send was never recorded
            meta = self.tables.meta
            ops.append((_PUT, meta, b"next_mid", str(batches[-1][1]).encode()))
            ops.append((_PUT, meta, b"next_seq", str(batches[-1][2]).encode()))
            ok = self._commit(ops)
            self._report_unwritten(ops if not ok else [op for op, _exc in self._skipped])
            owners = self._take_skipped()
            self.commits += 1
            self.committed_ops += len(ops)
            self.last_commit_at = time.monotonic()
            loop = self.loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._committed, len(batches), ok, self.last_failure_full, owners)

    def _commit(self, ops: list[tuple[Any, ...]]) -> bool:
        """Apply ``ops`` in one transaction (growing the map as needed); False when they could not be written.

        A change that fails alone (:func:`_per_change`) does not fail the others: the batch is applied again by
        :meth:`_apply_isolated`, which leaves out the failing changes (kept in ``_skipped`` for
        :meth:`_take_skipped`). No room (MDB_MAP_FULL at ``max_size``, ENOSPC, EDQUOT) sets ``last_write_failed``
        (``has_room`` is False) until a commit succeeds; other batch errors do not."""
        assert self.env is not None
        isolate = False
        while True:
            self._applier.begin()  # reference counts from here on roll back with this attempt's transaction
            self._skipped = []
            applying = True
            try:
                txn = self.env.begin(write=True)
                try:
                    if isolate:
                        self._apply_isolated(txn, ops)
                    else:
                        self._apply(txn, ops)
                    applying = False
                    sizes = self._sizes(txn)
                except BaseException:
                    txn.abort()
                    raise
                started = time.perf_counter()
                txn.commit()
                took = time.perf_counter() - started
                self.fsync_buckets[bisect.bisect_left(FSYNC_BUCKETS, took)] += 1
                self.fsync_seconds += took
                break
            except lmdb.MapFullError:
                self._applier.rollback()
                if self.map_size >= self.settings.max_size:
                    self._write_failed(f"store full at max_size={self.settings.max_size} bytes", len(ops), True)
                    return False
                new_size = min(self.settings.max_size, self.map_size * 2)
                with self.map_lock:
                    self.env.set_mapsize(new_size)
                self.map_size = new_size
                self._file_end = self._data_file_size()
                log.info("store: map grown to %d bytes", new_size)
            except Exception as exc:
                self._applier.rollback()
                if applying and not isolate and _per_change(exc):
                    isolate = True  # one change failed: find it, commit the rest
                    continue
                full = _no_room(exc, self.path)
                self._write_failed(f"store {'full' if full else 'write failed'} ({exc})", len(ops), full)
                return False
        if self.last_write_failed:
            log.warning("store: a commit succeeded again after the store was full")
        self.last_write_failed = False
        self._table_bytes.update(sizes)
        self.used_bytes = sum(self._table_bytes.values())  # exact: has_room compares it with max_size
        self._preallocate()
        return True

    def _write_failed(self, what: str, count: int, full: bool) -> None:
        """Count and log (the first at once, then at most one line per ``_FAIL_LOG_INTERVAL`` with the number of
        failures in between) a batch of ``count`` changes that could not be written."""
        self.write_errors += 1
        self.last_failure_full = full
        if full:
            self.last_write_failed = True
        now = time.monotonic()
        if now < self._fail_log_at:
            self._fail_log_suppressed += 1
            return
        suppressed, self._fail_log_suppressed = self._fail_log_suppressed, 0
        self._fail_log_at = now + _FAIL_LOG_INTERVAL
        more = f" ({suppressed} more failed commits in the last {_FAIL_LOG_INTERVAL:.0f} s)" if suppressed else ""
        log.critical("%s: a batch of %d changes could not be written; its QoS 1/2 publishers are refused (MQTT 5: "
                     "0x%02X; 3.1.1: disconnected), nothing of it is acknowledged%s", what, count,
                     0x97 if full else 0x80, more)

    def _probe(self) -> None:
        """While the store is full (``last_write_failed``) and nothing else commits: once the file system has
        ``_PROBE_FREE`` bytes free, commit one tiny write; when it succeeds, new work is taken again."""
        if _disk_free(self.path) < _PROBE_FREE:
            return
        if self._commit([(_PUT, self.tables.meta, b"format", str(rec.FORMAT_VERSION).encode())]):
            log.warning("store: writes succeed again (%d bytes used of max_size %d); taking QoS 1/2 messages again",
                        self.used_bytes, self.settings.max_size)

    def _apply(self, txn: Any, ops: list[tuple[Any, ...]]) -> None:
        """Apply ``ops`` to ``txn`` (:meth:`BatchApplier.apply`; once per transaction, nested or not, so
        ``bench/durable_cpu.py`` times the applying apart from LMDB's commit here)."""
        self._applier.apply(txn, ops)

    def _apply_isolated(self, txn: Any, ops: list[tuple[Any, ...]]) -> None:
        """Apply ``ops`` in nested transactions of ``txn`` so that changes failing alone are left out: a part
        that fails is split in halves, down to the single change, which is recorded in ``_skipped`` (about
        2 log2(n) nested transactions for each failing change). Reference counts changed by an aborted part are
        rolled back with it; errors that are not a change's own (:func:`_per_change`) propagate."""
        assert self.env is not None
        skipped = self._skipped
        stack: list[list[tuple[Any, ...]]] = [ops]
        while stack:
            part = stack.pop()
            mark = len(self._applier.undo)
            child = self.env.begin(write=True, parent=txn)
            try:
                self._apply(child, part)
            except Exception as exc:
                child.abort()
                self._applier.rollback(mark)
                if not _per_change(exc):
                    raise
                if len(part) == 1:
                    skipped.append((part[0], exc))
                else:
                    half = len(part) // 2
                    stack.append(part[half:])  # popped second: the halves are applied in order
                    stack.append(part[:half])
                continue
            child.commit()
        self.failed_changes += len(skipped)
        for op, error in skipped:
            log.critical("store: a change was left out of a commit, the rest of its batch committed: %s (%s: %s)",
                         _describe(op, self.tables), type(error).__name__, error)

    def _take_skipped(self) -> tuple[set[bytes], set[str]] | None:
        """The owners of the changes the last commit left out, or None: key parts of their client ids (resolved on
        the loop, :meth:`_owner_ids`) and client ids (publishers of the messages those changes stored)."""
        skipped, self._skipped = self._skipped, []
        if not skipped:
            return None
        parts: set[bytes] = set()
        names: set[str] = set()
        sessions_db, subs_db = self.tables.sessions, self.tables.subs
        for op, _exc in skipped:
            kind = op[0]
            if kind in (_PUT, _DEL):
                if op[1] is sessions_db:
                    parts.add(op[2])
                elif op[1] is subs_db:
                    parts.add(rec.split_key(op[2])[0])
            elif kind in (_Q_PUT, _Q_DEL, _Q_SENT, _IN_PUT, _IN_DEL):
                parts.add(rec.split_key(op[1])[0])
            elif kind == _SESS_DEL:
                names.add(op[1])
            if kind in (_Q_PUT, _IN_PUT, _RET_PUT, _OB_PUT):
                sender = op[3].sender if kind != _RET_PUT else op[2].sender
                if sender is not None:
                    names.add(sender)  # its PUBACK/PUBREC waits for this change
        return parts, names

    def _report_unwritten(self, ops: list[tuple[Any, ...]]) -> None:
        """Writer thread: hand the keys of the queue rows among ``ops`` (changes a commit did not write) to the loop,
        ahead of that commit's ``_committed``: callbacks run in order, so the report lands before
        ``committed_seq`` moves past those rows. Without a loop (the tools, which commit in the caller) nothing is
        reported."""
        keys = [op[1] for op in ops if op[0] == _Q_PUT]
        loop = self.loop
        if keys and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._rows_not_written, keys)

    def _preallocate(self) -> None:
        """Keep about ``_AHEAD`` bytes of written zeros past LMDB's last page, up to the map size, so that commits
        write over allocated blocks instead of extending the file. On ext4 an fdatasync that extends a file also
        commits the journal: measured here, a commit of 64 queued messages took ~20% less time and CPU on a file
        written ahead (``bench/durable_cpu.py``). Runs on the writer thread between transactions and only writes
        past the file's end, where LMDB has written nothing. A full disk is not an error here: the extension is
        given back and LMDB's own writes report it."""
        assert self.env is not None
        if self._file_end >= self.map_size:
            return  # written up to the map's end, or given up until the map grows
        end = (self.env.info()["last_pgno"] + 1) * self._page_size
        if end + _AHEAD // 2 <= self._file_end:
            return
        target = min(self.map_size, max(end, self._file_end) + _AHEAD)
        fd = os.open(self.path / "data.mdb", os.O_WRONLY)
        try:
            size = pos = os.fstat(fd).st_size
            try:
                while pos < target:
                    pos += os.pwrite(fd, _ZEROS[:target - pos], pos)
                self._file_end = max(target, size)
            except OSError as exc:
                os.ftruncate(fd, size)
                self._file_end = self.map_size  # not again until the map grows
                log.warning("store: could not write %d bytes ahead in %s (%s); commits extend the file instead",
                            target - size, self.path / "data.mdb", exc)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ to the loop

    def _committed(self, count: int, ok: bool = True, full: bool = True,
                   owners: tuple[set[bytes], set[str]] | None = None) -> None:
        """Loop: ``count`` batches were committed (``ok``) or not (``full``: for lack of room); ``owners``: those
        of the changes left out (:meth:`_take_skipped`). Implemented by the store."""
        raise NotImplementedError

    def _rows_not_written(self, keys: list[bytes]) -> None:
        """Loop: the queue rows ``keys`` were not written (:meth:`_report_unwritten`). Implemented by the store."""
        raise NotImplementedError
