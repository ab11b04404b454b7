"""The LMDB implementation of the broker's :class:`~gateway.broker.store_port.SessionStore` (docs/architecture.md,
"The durability contract").

- One environment under ``[store] path``, named databases (see :mod:`gateway.store.records`).
- All writes on one writer thread. The event loop records changes into the open batch; the batch is handed to
  the writer at the end of the loop turn (or after ``commit_interval``); batches that queue up while the writer
  is busy share one transaction (group commit). LMDB's default ``sync``/``metasync`` stay on.
- Commit barriers (the core holds PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK under them) are reported back on the
  loop, in order, once the batch holding everything recorded before them is committed (``on_committed``).
  Changes nobody waits for wait up to ``lazy_commit`` (5 ms) to share a commit with later work.
- Payloads are stored once. A message that a single queue row references when it is first stored is stored in
  that row (one write and one delete instead of two each). Any other message has a ``messages`` row,
  reference-counted by queue, inbound, retained and outbox rows; the counts of messages referenced more than once
  live on the writer thread (a message row alone means one reference, so a backlog costs no memory per message)
  and are rebuilt on open. A message stored in its queue row and referenced again later (rare: the same message
  queued for another session in a later commit) gets a message row for the new references.
- Message Queues of persistent sessions page: beyond ``mqueue_mem_len`` entries in memory, queued messages stay only
  in the store and are read back on the loop (a read transaction) as the queue drains (:class:`LmdbPager`).
- The data file is written a few MiB ahead of LMDB's last page (zeros, within the map), so commits overwrite
  allocated blocks rather than extend the file (cheaper fdatasyncs on ext4).
- The map grows up to ``max_size``; new durable work is refused (``has_room`` is False) once the data reaches
  ``max_size`` minus a headroom, so deletes and already-acknowledged work always fit.
- Names in keys (client ids, Topic Filters, topics) longer than 160 bytes are hashed to a fixed 161-byte form
  (:func:`gateway.store.records.name_key`), so no key exceeds LMDB's maximum key size whatever clients send.
- A batch that cannot be committed because there is no room (MDB_MAP_FULL at ``max_size``, ENOSPC or EDQUOT) runs
  reports its last barrier as failed (``on_failed``: the broker answers 0x97 or disconnects)
  and refuses new work (``has_room``) until a write succeeds again; while nothing else commits, the writer probes
  with a tiny write every ``_PROBE_INTERVAL`` seconds once the file system has ``_PROBE_FREE`` bytes free. Other
  batch-wide errors (I/O) fail the batch the same way without reporting the store full.
- A change that fails on its own (any error but the above while it is applied, e.g. MDB_BAD_VALSIZE) does not
  fail the batch: the writer applies the batch again in nested transactions, halving the failing part until the
  failing changes are found, leaves them out, commits the rest, logs each at CRITICAL and reports the clients
  they belong to (``on_change_failed``) before the batch's barrier is reported.

Modules of the store (imports go down this list only):

- :mod:`gateway.store.lmdb_store` (this one): :class:`LmdbStore`: the typed operations that record changes on the
  loop, opening, loading, quarantine, the ``has_room`` quota, ``stats``;
- :mod:`gateway.store.batches`: :class:`~gateway.store.batches.CommitBatches` (the base of :class:`LmdbStore`): the
  open batch, the batches in flight and their commit barriers;
- :mod:`gateway.store.loading`: one loader per table, and the removal of what expired while the broker was down;
- :mod:`gateway.store.writer`: :class:`~gateway.store.writer.LmdbWriter` (the base of ``CommitBatches``): the
  environment, the writer thread, group commit, applying operations, reference counts, isolation of failing
  changes, full store or disk, writing ahead;
- :mod:`gateway.store.lmdb_pager`: :class:`~gateway.store.lmdb_pager.LmdbPager`, queue rows read back as a queue drains;
- :mod:`gateway.store.settings`, :mod:`gateway.store.tables` (the named databases), :mod:`gateway.store.records`
  (record formats and keys); :mod:`gateway.store.tools` (``edge-gateway store ...``) uses :class:`LmdbStore`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import time
import weakref
from collections.abc import Callable
from typing import Any

import lmdb

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.mqueue import OFFLINE_MEM_LEN
from gateway.broker.session_state import NEVER, Session
from gateway.broker.store_port import LoadedState, OutboxRecord
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.primitives import encode_string
from gateway.store import records as rec
from gateway.store.batches import CommitBatches
from gateway.store.lmdb_pager import LmdbPager
from gateway.store.loading import (
    Expired,
    Loading,
    LoadProgress,
    load_inbound,
    load_orphan_messages,
    load_outbox,
    load_queue,
    load_retained,
    load_sessions,
    load_subscriptions,
    remove_expired,
)
from gateway.store.settings import StoreSettings
from gateway.store.writer import (
    _DEL,
    _IN_DEL,
    _IN_PUT,
    _OB_DEL,
    _OB_PUT,
    _PUT,
    _RET_DEL,
    _RET_PUT,
    _SESS_DEL,
    _no_room,
)

log = logging.getLogger("gateway.store")

_HEADROOM_FRACTION = 0.05
_MIN_HEADROOM = 2 * 1024 * 1024


def _looks_damaged(exc: BaseException) -> bool:
    """Whether an error while opening or reading the store can come from damaged data (LMDB's own errors, records
    that do not decode, an unknown format), as opposed to a programming error (AttributeError, TypeError, ...)."""
    return isinstance(exc, lmdb.Error | struct.error | ValueError | IndexError | KeyError | OSError)


class StoreError(Exception):
    """The store cannot be used (corrupt and ``on_corrupt = "refuse"``, locked by another process, ...)."""


class LmdbStore(CommitBatches):
    """Durable sessions, queues, inbound QoS 2 state and retained messages in LMDB.

    Args:
        settings: the ``[store]`` settings.
        limits_for: the zone limits to give a restored session (by its protocol level; the listener it comes
            back on replaces them).
    """

    #: A stored delivery is new or was sent (``SessionStore.delivery_saved``; gateway/store/open_batch.py).
    delivery_saved: Callable[[str, Delivery], None]
    #: A stored delivery is gone (``SessionStore.delivery_deleted``).
    delivery_deleted: Callable[[str, Delivery], None]
    #: A run of stored deliveries is gone (``SessionStore.deliveries_deleted``).
    deliveries_deleted: Callable[[str, list[Delivery]], None]

    def __init__(self, settings: StoreSettings, limits_for: Callable[[], ZoneLimits] = ZoneLimits) -> None:
        super().__init__(settings)
        self.limits_for = limits_for
        #: Called on the loop with a client id and the seqs of its queue rows that a commit did not write (it
        #: failed, or left them out), before any later commit lands (``_rows_not_written``): the broker drops
        #: their Message Queue entries (``Broker.queue_rows_lost``), so that none is paged out as a missing row.
        self.on_queue_rows_lost: Callable[[str, list[int]], None] | None = None
        self._pagers: weakref.WeakValueDictionary[bytes, LmdbPager] = weakref.WeakValueDictionary()  # by prefix
        #: Called while :meth:`load` reads the store back, with how far it is (rows and bytes per table; see
        #: :class:`~gateway.store.loading.LoadProgress`): the runner logs it and tells systemd, the tools draw a bar.
        self.on_load_progress: Callable[[LoadProgress], None] | None = None
        self._hashed_keys = True  # False while reading a format 1/2 store as it is (tools)
        # The port's per-message queue operations are the open batch's own (compiled) methods, so the core calls
        # them without an interpreted frame between: SessionStore.delivery_saved, delivery_deleted,
        # deliveries_deleted.
        self.delivery_saved = self._open.delivery_saved
        self.delivery_deleted = self._open.delivery_deleted
        self.deliveries_deleted = self._open.deliveries_deleted
        self._outbox_loaded: dict[bytes, list[OutboxRecord]] = {}  # by the link's key part (records.name_key)
        self._lock_fd: int | None = None
        limit = settings.max_size
        self._room_below = limit - max(_MIN_HEADROOM, int(limit * _HEADROOM_FRACTION))  # has_room: used below this
        self.refused = 0
        self.quarantined: str | None = None
        self.closed = False

    # ------------------------------------------------------------------------------------------ opening

    def _take_lock(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent / f".{self.path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"store {self.path} is in use by another process") from None
        self._lock_fd = fd

    def load(self, now: float, cleanup: bool = True) -> LoadedState:
        """Open the environment and read everything back (expired sessions and messages removed and counted).

        A store that cannot be opened or read is moved aside to ``<path>.corrupt-<timestamp>`` and an empty one
        is started (``on_corrupt = "quarantine"``), or :class:`StoreError` is raised (``"refuse"``).
        """
        self._take_lock()
        try:
            self._open_env()
            state = self._read_all(now, cleanup)
        except Exception as exc:
            if isinstance(exc, StoreError):
                raise
            if _no_room(exc, self.path) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
                # A full disk is not a damaged store: moving it aside would lose what was acknowledged.
                raise StoreError(f"store {self.path} cannot be opened: no room on its disk ({exc})") from None
            if self.env is not None:
                with contextlib.suppress(Exception):
                    self.env.close()
                self.env = None
            if not _looks_damaged(exc):
                # A bug in this code (e.g. after an update), not a damaged file: moving the store aside would throw
                # away every session and acknowledged message (make soak saw it once). Leave it for a fixed version.
                raise StoreError(f"store {self.path} cannot be loaded because of an error in the broker, not in the "
                                 f"store ({type(exc).__name__}: {exc}); the store is left as it is") from exc
            if self.settings.on_corrupt == "refuse":
                raise StoreError(f"store {self.path} cannot be opened: {exc}; refusing to start "
                                 '(store.on_corrupt = "refuse")') from None
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            n = 1
            while target.exists():
                target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
                n += 1
            shutil.move(str(self.path), str(target))
            self.quarantined = str(target)
            log.critical("STORE CORRUPT: %s cannot be opened (%s); moved aside to %s and starting with an EMPTY "
                         "store", self.path, exc, target)
            self._open_env()
            state = self._read_all(now, cleanup)
        self._start_writer()
        return state

    def _read_all(self, now: float, cleanup: bool = True) -> LoadedState:
        """Read every table back (one loader per table, :mod:`gateway.store.loading`, in one read transaction) and,
        with ``cleanup``, remove what expired while the broker was down (:meth:`_remove_expired`). A format 1/2
        store is rewritten to format 3 first (with ``cleanup``; the tools read it as it is)."""
        assert self.env is not None
        tables = self.tables
        mem_len = self.settings.mqueue_mem_len
        with self.env.begin() as txn:
            version = txn.get(b"format", db=tables.meta)
        if version is not None and int(version) not in rec.FORMAT_VERSIONS:
            raise ValueError(f"unknown store format {version!r}")
        # Format 1 and 2 stores (or none marked) have names as they are in keys, which may be longer than
        # records.NAME_MAX: rewritten to format 3 on a broker's start, read as they are by the tools.
        self._hashed_keys = version is not None and int(version) >= 3
        if not self._hashed_keys and cleanup:
            self._upgrade_names()
            self._hashed_keys = True
        with self.env.begin() as txn:
            # Every restored session is offline until it reconnects: it keeps at most OFFLINE_MEM_LEN in memory.
            ld = Loading(txn, tables, now, min(mem_len, OFFLINE_MEM_LEN) if mem_len else 0, mem_len)
            ld.on_progress = self.on_load_progress
            ld.start()
            next_mid = txn.get(b"next_mid", db=tables.meta)
            next_seq = txn.get(b"next_seq", db=tables.meta)
            load_sessions(ld, self._hashed_keys, self.limits_for, self._new_pager, self._long_names)
            load_subscriptions(ld)
            load_queue(ld)
            load_inbound(ld)
            load_retained(ld)
            self._outbox_loaded = load_outbox(ld)
            top = load_orphan_messages(ld)
            ld.finish()
        self._applier.refs = {mid: count for mid, count in ld.refs.items() if count > 1}
        self._seq = int(next_seq) if next_seq is not None else 1
        self.committed_seq = self._seq - 1
        state = ld.loaded()
        state.next_mid = int(next_mid) if next_mid is not None else 1
        self._applier.top_mid = max(top, state.next_mid - 1)
        expired = ld.expired
        self.expired_on_load = len(expired.sessions), expired.messages_count
        if not cleanup:
            return state
        self._remove_expired(expired)
        self._update_used()
        return state

    def _remove_expired(self, expired: Expired) -> None:
        """Remove what expired while the broker was down, and what nothing references (``expired``, found by the
        loaders); a full disk leaves it for a later start (it is not loaded) and refuses new work (``has_room``)."""
        assert self.env is not None
        try:
            remove_expired(self.env, self.tables, expired)
        except lmdb.Error as exc:
            if not _no_room(exc, self.path):
                raise
            # A full disk at start: what expired stays until a later start (it is not loaded); nothing is lost.
            self.last_write_failed = True
            log.error("store: no room to remove what expired while the broker was down (%s); kept until a later "
                      "start, and new QoS 1/2 messages are refused until a write succeeds", exc)
        else:
            if expired.sessions or expired.queue or expired.retained:
                log.info("store: removed %d expired sessions and %d expired messages on start", len(expired.sessions),
                         expired.messages_count)

    def _upgrade_names(self) -> None:
        """Rewrite a format 1/2 store to format 3: every key whose name part is longer than ``records.NAME_MAX``
        gets that part in the hashed form (``records.name_key``), with the full name in the value where format 3
        keeps it (sessions, subscriptions). One write transaction; rows with short names stay as they are."""
        assert self.env is not None
        t = self.tables
        meta, sessions_db, subs_db, queue_db = t.meta, t.sessions, t.subs, t.queue
        inbound_db, retained_db, outbox_db = t.inbound, t.retained, t.outbox
        limit = rec.NAME_MAX
        moved = 0
        txn = self.env.begin(write=True)
        try:
            changes: list[tuple[Any, bytes, bytes, bytes]] = []  # (db, old key, new key, new value)
            for key, value in txn.cursor(db=sessions_db):
                if len(key) > limit:
                    cid = bytes(key).decode("utf-8")
                    changes.append((sessions_db, bytes(key), rec.name_key(cid), encode_string(cid) + bytes(value)))
            for key, value in txn.cursor(db=subs_db):
                part, rest = rec.split_key(bytes(key))
                if len(part) > limit or len(rest) > limit:
                    filter_part = rec.name_key(rest.decode("utf-8"))
                    value = bytes(value)
                    if rec.is_hashed(filter_part):
                        value += encode_string(rest.decode("utf-8"))
                    changes.append((subs_db, bytes(key), rec.client_prefix(part.decode("utf-8")) + filter_part,
                                    value))
            for db in (queue_db, inbound_db, outbox_db):
                for key, value in txn.cursor(db=db):
                    part, rest = rec.split_key(bytes(key))
                    if len(part) > limit:
                        changes.append((db, bytes(key), rec.client_prefix(part.decode("utf-8")) + rest, bytes(value)))
            for key, value in txn.cursor(db=retained_db):
                if len(key) > limit:
                    changes.append((retained_db, bytes(key), rec.name_key(bytes(key).decode("utf-8")), bytes(value)))
            for db, old, new, value in changes:
                txn.delete(old, db=db)
                txn.put(new, value, db=db)
                moved += 1
            txn.put(b"format", str(rec.FORMAT_VERSION).encode(), db=meta)
        except BaseException:
            txn.abort()
            raise
        try:
            txn.commit()
        except lmdb.Error as exc:
            if _no_room(exc, self.path):
                raise StoreError(f"store {self.path} needs to be rewritten to format {rec.FORMAT_VERSION} and there "
                                 f"is no room on its disk ({exc}); free some space and start again") from None
            raise
        if moved:
            log.info("store: %d rows with names longer than %d bytes rewritten to store format %d", moved, limit,
                     rec.FORMAT_VERSION)

    # ------------------------------------------------------------------------------------------ to the loop

    def _rows_not_written(self, keys: list[bytes]) -> None:
        """Loop: report queue rows that were not written (``keys``: client prefix + seq) to
        ``on_queue_rows_lost``, by client id. Only paging sessions are named (through their pager): another
        session holds all its entries in memory, where a missing row does no harm until a restart."""
        handler = self.on_queue_rows_lost
        if handler is None:
            return
        seqs_by_prefix: dict[bytes, list[int]] = {}
        for key in keys:
            seqs_by_prefix.setdefault(key[:-8], []).append(rec.from_u64(key, len(key) - 8))
        for prefix, seqs in seqs_by_prefix.items():
            pager = self._pagers.get(prefix)
            if pager is None:
                continue
            try:
                handler(pager.client_id, seqs)
            except Exception:
                log.exception("store: on_queue_rows_lost failed")

    # ------------------------------------------------------------------------------------------ SessionStore

    def note_mid(self, mid: int) -> None:
        """Remember the newest message id so ``next_mid`` survives restarts."""
        self._open.note_mid(mid)

    def session_saved(self, session: Session) -> None:
        key = self._prefix(session.client_id)[:-1]
        self._record((_PUT, self.tables.sessions, key, rec.session_row(session, key)))

    def session_deleted(self, client_id: str) -> None:
        self._record((_SESS_DEL, client_id))

    def subscription_saved(self, client_id: str, record: SubscriptionRecord) -> None:
        part = rec.name_key(record.key)
        self._record((_PUT, self.tables.subs, self._prefix(client_id) + part, rec.encode_subscription(record, part)))

    def subscription_deleted(self, client_id: str, key: str) -> None:
        self._record((_DEL, self.tables.subs, self._prefix(client_id) + rec.name_key(key)))

    def inbound_saved(self, client_id: str, packet_id: int, message: Message) -> None:
        self.note_mid(message.mid)
        key = self._prefix(client_id) + packet_id.to_bytes(2, "big")
        self._record((_IN_PUT, key, rec.encode_inbound(message.mid, message.received_at), message))

    def inbound_deleted(self, client_id: str, packet_id: int) -> None:
        self._record((_IN_DEL, self._prefix(client_id) + packet_id.to_bytes(2, "big")))

    def retained_saved(self, message: Message) -> None:
        self.note_mid(message.mid)
        self._record((_RET_PUT, rec.name_key(message.topic), message))

    def retained_deleted(self, topic: str) -> None:
        self._record((_RET_DEL, rec.name_key(topic)))

    def pager(self, client_id: str) -> tuple[LmdbPager, int] | None:
        mem_len = self.settings.mqueue_mem_len
        return (self._new_pager(client_id), mem_len) if mem_len > 0 else None

    def _new_pager(self, client_id: str) -> LmdbPager:
        """A pager of ``client_id``'s queue rows, indexed (weakly) by its key prefix for ``_rows_not_written``."""
        pager = LmdbPager(self, client_id)
        self._pagers[pager.prefix] = pager
        return pager

    def outbox_seq(self) -> int:
        seq = self._seq  # shared with queue rows; persisted as next_seq with every commit
        self._seq += 1
        return seq

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        self.note_mid(record.message.mid)
        key = self._prefix(link) + rec.u64(record.seq)
        self._record((_OB_PUT, key, rec.encode_outbox(record.message.mid, record.qos, record.topic), record.message))

    def outbox_deleted(self, link: str, seq: int) -> None:
        self._record((_OB_DEL, self._prefix(link) + rec.u64(seq)))

    def outbox_loaded(self, link: str) -> list[OutboxRecord]:
        return self._outbox_loaded.pop(rec.name_key(link), [])

    def has_room(self, client_id: str | None) -> bool:
        if self.used_bytes < self._room_below and not self.last_write_failed:
            return True
        limit = self.settings.max_size
        headroom = limit - self._room_below
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            if self.used_bytes < self._room_below:  # the last commit found no room: a full disk (or a huge batch)
                log.error("store full: the last commit found no room (%d of max_size %d bytes used); refusing new "
                          "QoS 1/2 messages until a write succeeds (%d refused)", self.used_bytes, limit, self.refused)
            else:
                log.error("store full: %d of %d bytes used (headroom %d); refusing new QoS 1/2 messages (%d refused)",
                          self.used_bytes, limit, headroom, self.refused)
        return False

    def close(self) -> None:
        """Commit what is pending, stop the writer, close the environment and release the lock."""
        if self.closed:
            return
        self.closed = True
        self._hand_over_last()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        if self.env is not None:
            self.env.close()
            self.env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------------------------------ tools

    def stats(self, now: float) -> dict[str, Any]:
        """Sizes, counts, queue depths and the oldest queued message's age (for ``edge-gateway store stats``)."""
        assert self.env is not None
        out: dict[str, Any] = {"path": str(self.path), "map_size": self.env.info()["map_size"],
                               "file_size": self._data_file_size(), "max_size": self.settings.max_size}
        depths: dict[str, int] = {}
        oldest = None
        with self.env.begin() as txn:
            used = 0
            for name, db in self.tables.items():
                s = txn.stat(db)
                out[f"{name}_entries"] = s["entries"]
                used += s["psize"] * (s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"])
            out["used_bytes"] = used
            names = {bytes(k): rec.session_id(bytes(k), bytes(v), self._hashed_keys)[0]
                     for k, v in txn.cursor(db=self.tables.sessions)}  # key part -> client id
            inline_count = 0
            for key, value in txn.cursor(db=self.tables.queue):
                part, _ = rec.split_key(bytes(key))
                cid = names.get(part) or part.decode("utf-8", "replace")
                depths[cid] = depths.get(cid, 0) + 1
                value = bytes(value)
                mid = rec.from_u64(value)
                raw = rec.inline_message(value)
                if raw is not None:
                    inline_count += 1
                else:
                    raw = txn.get(rec.u64(mid), db=self.tables.messages)
                if raw is not None:
                    received = rec.decode_message(mid, bytes(raw)).received_at
                    oldest = received if oldest is None else min(oldest, received)
            out["inline_messages"] = inline_count
        out["sessions"] = out["sessions_entries"]
        out["queue_depths"] = depths
        out["oldest_message_age"] = None if oldest is None else max(0.0, now - oldest)
        return out


def expires_label(session: Session) -> str:
    """Human text for a session's expiry."""
    if session.expiry_interval == NEVER:
        return "never"
    return f"{session.expiry_interval:.0f} s"
