"""Reading the LMDB store back on start: one loader per table, and the transaction that removes what expired while
the broker was down (the record formats are in :mod:`gateway.store.records`).

The loaders run in this order in one read transaction, sharing a :class:`Loading`: sessions first (the other
tables' rows are matched to their session by the key part, :func:`~gateway.store.records.split_key`), then
subscriptions, queue, inbound, retained and outbox rows, each counting the message references it finds; last the
message rows nothing references (orphans). What expired, or belongs to nothing, is collected in
:class:`Expired` and removed afterwards by :func:`remove_expired` (one write transaction), unless the store is
only looked at (``store stats|inspect``).

Progress: every table is read through :meth:`Loading.rows`, which counts rows and bytes in a :class:`LoadProgress`
and calls ``Loading.on_progress`` with it every :data:`PROGRESS_EVERY` rows and at the end of each table. The
callback belongs to the I/O side (it reads the clock, logs, tells systemd, draws a bar): this module never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Message
from gateway.broker.queue_pager import QueuePager
from gateway.broker.session_state import Session, awaiting_rel_for_write
from gateway.broker.store_port import LoadedState, OutboxRecord
from gateway.store import records as rec
from gateway.store.tables import Tables

#: Rows read between two calls of ``Loading.on_progress``.
PROGRESS_EVERY = 1024
#: The tables in the order they are read (``LoadProgress.table``).
TABLE_ORDER = ("sessions", "subs", "queue", "inbound", "retained", "outbox", "messages")


@dataclass(slots=True)
class LoadProgress:
    """How far a load has come: rows and bytes read so far, per table, against each table's entry count.

    Attributes:
        totals: rows in each table (LMDB's entry count at the start), by table name (:data:`TABLE_ORDER`).
        read: rows read so far, by table name.
        bytes_read: bytes of keys and values read so far, all tables.
        table: the table being read ("" before the first, "done" after the last).
    """

    totals: dict[str, int] = field(default_factory=dict)
    read: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    table: str = ""

    @property
    def rows_total(self) -> int:
        """Rows in all tables."""
        return sum(self.totals.values())

    @property
    def rows_read(self) -> int:
        """Rows read so far, all tables."""
        return sum(self.read.values())

    @property
    def sessions(self) -> tuple[int, int]:
        """``(read, total)`` session rows (live and expired)."""
        return self.read.get("sessions", 0), self.totals.get("sessions", 0)

    @property
    def queued(self) -> tuple[int, int]:
        """``(read, total)`` queue rows (queued and in-flight messages)."""
        return self.read.get("queue", 0), self.totals.get("queue", 0)


@dataclass(slots=True)
class Expired:
    """What loading found expired or unreferenced, to remove (:func:`remove_expired`).

    Attributes:
        sessions: client ids of expired sessions (their subscriptions go with them; their queue and inbound rows,
            having no session to attach to, are in ``queue`` and ``inbound``).
        queue: keys of queue rows of no live session, expired, or whose message is missing.
        inbound: keys of inbound rows of no live session or whose message is missing.
        retained: keys of retained rows whose message is missing or expired.
        outbox: keys of outbox rows whose message is missing.
        messages: keys of message rows nothing references.
    """

    sessions: list[str] = field(default_factory=list)
    queue: list[bytes] = field(default_factory=list)
    inbound: list[bytes] = field(default_factory=list)
    retained: list[bytes] = field(default_factory=list)
    outbox: list[bytes] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)

    @property
    def messages_count(self) -> int:
        """Expired messages as reported on start: queue rows and retained messages removed."""
        return len(self.queue) + len(self.retained)


@dataclass(slots=True)
class Loading:
    """The state the loaders share while the store is read back (one read transaction).

    Attributes:
        txn: the read transaction.
        tables: the store's tables.
        now: the wall-clock time, seconds since the epoch (expiry is decided against it).
        mem_len: queued messages of a restored session kept in memory (it is offline until it reconnects:
            ``StoreSettings.mqueue_mem_len``, at most ``mqueue.OFFLINE_MEM_LEN``; 0: all).
        online_mem_len: the same once the session is online again (``StoreSettings.mqueue_mem_len``).
        state: what the broker gets back (retained messages are added to it; sessions, from ``sessions``, by
            :meth:`loaded`).
        sessions: live sessions by client id.
        by_part: live sessions by their key (the key part of their other rows).
        refs: references found to each message row, by mid (queue rows carrying their message count none).
        expired: what to remove afterwards.
        progress: rows and bytes read so far (:meth:`rows` counts them).
        on_progress: called with ``progress`` every :data:`PROGRESS_EVERY` rows and after each table (and once
            when the totals are known, :meth:`start`); None: nobody watches.
    """

    txn: Any
    tables: Tables
    now: float
    mem_len: int
    online_mem_len: int
    state: LoadedState = field(default_factory=LoadedState)
    sessions: dict[str, Session] = field(default_factory=dict)
    by_part: dict[bytes, Session] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)
    expired: Expired = field(default_factory=Expired)
    progress: LoadProgress = field(default_factory=LoadProgress)
    on_progress: Callable[[LoadProgress], None] | None = None
    _cache: dict[int, Message | None] = field(default_factory=dict)

    def start(self) -> None:
        """Count each table's rows (LMDB keeps the count: no scan) and report the starting point."""
        tables = self.tables
        for name in TABLE_ORDER:
            self.progress.totals[name] = self.txn.stat(getattr(tables, name))["entries"]
            self.progress.read[name] = 0
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def rows(self, name: str) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(key, value)`` of the table ``name`` (:data:`TABLE_ORDER`) in key order, counted in
        ``progress`` (rows, and bytes of keys and values), reported to ``on_progress`` as it goes."""
        progress, report = self.progress, self.on_progress
        progress.table = name
        read = progress.read.get(name, 0)
        size = 0
        for key, value in self.txn.cursor(db=getattr(self.tables, name)):
            yield key, value
            read += 1
            size += len(key) + len(value)
            if read % PROGRESS_EVERY == 0:
                progress.read[name] = read
                progress.bytes_read += size
                size = 0
                if report is not None:
                    report(progress)
        progress.read[name] = read
        progress.bytes_read += size
        if report is not None:
            report(progress)

    def finish(self) -> None:
        """Every table is read: mark the progress done and report it."""
        self.progress.table = "done"
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def message(self, mid: int) -> Message | None:
        """The message row ``mid`` decoded (once), or None when it is missing."""
        cache = self._cache
        if mid not in cache:
            raw = self.txn.get(rec.u64(mid), db=self.tables.messages)
            cache[mid] = rec.decode_message(mid, bytes(raw)) if raw is not None else None
        return cache[mid]

    def ref(self, mid: int) -> None:
        """Count one reference to the message row ``mid``."""
        self.refs[mid] = self.refs.get(mid, 0) + 1

    def loaded(self) -> LoadedState:
        """``state`` with the live sessions in it."""
        self.state.sessions = list(self.sessions.values())
        return self.state


def load_sessions(ld: Loading, hashed_keys: bool, limits_for: Callable[[], ZoneLimits],
                  pager_for: Callable[[str], QueuePager], long_names: dict[bytes, str]) -> None:
    """Sessions: live ones into ``ld.sessions`` and ``ld.by_part`` (their Message Queue paging through
    ``pager_for(client id)``), expired ones into ``ld.expired``. ``hashed_keys``: the store is of format 3 (keys
    may hold hashed names, whose client ids are remembered in ``long_names``)."""
    for key, value in ld.rows("sessions"):
        key = bytes(key)
        cid, data = rec.session_id(key, bytes(value), hashed_keys)
        session = Session(cid, limits_for())
        rec.decode_session_into(session, data)
        if session.expires_at is not None and ld.now >= session.expires_at:
            ld.expired.sessions.append(cid)
            continue
        ld.sessions[cid] = session
        ld.by_part[key] = session
        if rec.is_hashed(key) and hashed_keys:
            long_names[key] = cid
        session.start_receiving(pager_for(cid), ld.online_mem_len).hold_in_memory(False)


def load_subscriptions(ld: Loading) -> None:
    """Subscriptions into their sessions; those of sessions not loaded are left (removed with their session)."""
    for key, value in ld.rows("subs"):
        part, rest = rec.split_key(bytes(key))
        session = ld.by_part.get(part)
        if session is not None:
            value = bytes(value)
            record = rec.decode_subscription(session.client_id, rec.subscription_key(rest, value), value)
            session.subscriptions[record.key] = record  # type: ignore[index]  # loaded: start_receiving was called


def load_queue(ld: Loading) -> None:
    """Queue rows: inflight ones into their session's Inflight Window, the rest into its Message Queue; beyond
    ``ld.mem_len`` entries in memory a row is only accounted (paged) and stays in the store. Rows of no live
    session, expired, or whose message is missing go to ``ld.expired``.

    The paged rows are most of a large store (an offline session keeps ``mqueue.OFFLINE_MEM_LEN`` in memory): for
    them only the row's fixed head is unpacked (mid, QoS, Packet Identifier, expiry), the payload length is read
    from the message record without decoding it (a referenced message row's once per mid), and no Delivery is
    made: with full decoding, 10^6 queued messages in 1,000 sessions took 3.8 s of CPU to load, most of it here.
    Rows are read straight from a cursor (not :meth:`Loading.rows`) and counted the same way."""
    txn, messages, now, mem_len = ld.txn, ld.tables.messages, ld.now, ld.mem_len
    expired = ld.expired.queue
    by_part, refs = ld.by_part, ld.refs
    head_unpack, head_size = rec.DELIVERY_HEAD.unpack_from, rec.DELIVERY_HEAD.size
    seq_unpack, payload_length_at, u64 = rec.U64.unpack_from, rec.payload_length_at, rec.u64
    sizes: dict[int, int] = {}  # payload length of a referenced message row, by mid (-1: missing)
    progress, report = ld.progress, ld.on_progress
    progress.table = "queue"
    read = progress.read.get("queue", 0)
    size = 0
    prefix = b"\x00"  # no key starts with it: the first row looks its session up
    plen = 1
    session: Session | None = None
    for key, value in txn.cursor(db=ld.tables.queue):
        read += 1
        size += len(key) + len(value)
        if not read % PROGRESS_EVERY:
            progress.read["queue"] = read
            progress.bytes_read += size
            size = 0
            if report is not None:
                report(progress)
        if not key.startswith(prefix):
            # Rows are in key order, so a session's rows come together: one look-up per session.
            part = key[:key.index(0)]
            prefix = part + b"\x00"
            plen = len(prefix)
            session = by_part.get(part)
        if session is None:
            expired.append(key)
            continue
        mqueue = session.mqueue
        mid, qos, _, packet_id, _, expires_at, n_ids = head_unpack(value)
        if not packet_id and (mqueue.paged or (mem_len and len(mqueue) >= mem_len)):
            # Beyond the in-memory part of the queue: account it, leave it in the store.
            if expires_at != -1.0 and now >= expires_at:
                expired.append(key)
                continue
            pos = head_size + 4 * n_ids
            if len(value) > pos:  # the row carries its message
                length = payload_length_at(value, pos)
            else:
                length = sizes.get(mid, -2)
                if length == -2:
                    raw = txn.get(u64(mid), db=messages)
                    length = sizes[mid] = rec.payload_length(raw) if raw is not None else -1
                if length < 0:
                    expired.append(key)
                    continue
                refs[mid] = refs.get(mid, 0) + 1
            mqueue.add_paged(seq_unpack(key, plen)[0], qos, length)
            continue
        _queue_row_in_memory(ld, session, key, plen, value)
    progress.read["queue"] = read
    progress.bytes_read += size
    if report is not None:
        report(progress)


def _queue_row_in_memory(ld: Loading, session: Session, key: bytes, plen: int, value: bytes) -> None:
    """One queue row decoded into ``session``'s Inflight Window (a Packet Identifier) or Message Queue head."""
    mid, delivery = rec.decode_delivery(value)
    inline = rec.inline_message(value)  # stored in this row: not a reference to a message row
    msg = ld.message(mid) if inline is None else rec.decode_message(mid, inline)
    if msg is None or (delivery.expires_at is not None and ld.now >= delivery.expires_at and not delivery.packet_id):
        ld.expired.queue.append(key)
        return
    delivery.message = msg
    delivery.seq = rec.from_u64(key, plen)
    if inline is None:
        ld.ref(mid)
    if delivery.packet_id:
        session.inflight[delivery.packet_id] = delivery  # type: ignore[index]
        session.next_packet_id = delivery.packet_id % 65535 + 1
    else:
        session.mqueue.push(delivery)


def load_inbound(ld: Loading) -> None:
    """Inbound QoS 2 rows (awaiting PUBREL) into their sessions; rows of no live session or whose message is
    missing go to ``ld.expired``."""
    for key, value in ld.rows("inbound"):
        part, rest = rec.split_key(bytes(key))
        session = ld.by_part.get(part)
        mid, received_at = rec.decode_inbound(bytes(value))
        msg = ld.message(mid)
        if session is None or msg is None:
            ld.expired.inbound.append(bytes(key))
            continue
        awaiting_rel_for_write(session)[int.from_bytes(rest, "big")] = (msg, received_at)
        ld.ref(mid)


def load_retained(ld: Loading) -> None:
    """Retained messages into ``ld.state.retained``; missing or expired ones go to ``ld.expired``."""
    for key, value in ld.rows("retained"):
        mid = rec.from_u64(bytes(value))
        msg = ld.message(mid)
        if msg is None or msg.expired(ld.now):
            ld.expired.retained.append(bytes(key))
            continue
        ld.state.retained.append(msg)
        ld.ref(mid)


def load_outbox(ld: Loading) -> dict[bytes, list[OutboxRecord]]:
    """Upstream outbox rows, by the link's key part (``records.name_key``), in order; rows whose message is
    missing go to ``ld.expired``."""
    outbox: dict[bytes, list[OutboxRecord]] = {}
    for key, value in ld.rows("outbox"):
        link, rest = rec.split_key(bytes(key))
        mid, qos, topic = rec.decode_outbox(bytes(value))
        msg = ld.message(mid)
        if msg is None:
            ld.expired.outbox.append(bytes(key))
            continue
        outbox.setdefault(link, []).append(OutboxRecord(rec.from_u64(rest), msg, qos, topic))
        ld.ref(mid)
    return outbox


def load_orphan_messages(ld: Loading) -> int:
    """Message rows that no row loaded before references go to ``ld.expired``; returns the highest mid of any
    message row (0: none)."""
    refs = ld.refs
    ld.expired.messages = [bytes(k) for k, _ in ld.rows("messages") if rec.from_u64(bytes(k)) not in refs]
    cursor = ld.txn.cursor(db=ld.tables.messages)
    return rec.from_u64(bytes(cursor.key())) if cursor.last() else 0


def remove_expired(env: lmdb.Environment, tables: Tables, expired: Expired) -> None:
    """Remove in one write transaction what loading found expired or unreferenced (``expired``), and mark the store
    as of the current format (``records.FORMAT_VERSION``). Raises ``lmdb.Error`` as LMDB does (a full disk too)."""
    with env.begin(write=True) as txn:
        txn.put(b"format", str(rec.FORMAT_VERSION).encode(), db=tables.meta)
        for cid in expired.sessions:
            # Their queue and inbound rows are in the lists below (no session to attach them to).
            txn.delete(rec.name_key(cid), db=tables.sessions)
            cursor = txn.cursor(db=tables.subs)
            prefix = rec.client_prefix(cid)
            if cursor.set_range(prefix):
                while cursor.key().startswith(prefix) and cursor.delete():
                    pass
            cursor.close()
        for keys, db in ((expired.queue, tables.queue), (expired.inbound, tables.inbound),
                         (expired.retained, tables.retained), (expired.outbox, tables.outbox),
                         (expired.messages, tables.messages)):
            for key in keys:
                txn.delete(key, db=db)
