"""Applying a batch of the LMDB store's group commit to a write transaction, and the reference counts of the message
rows that several rows share (docs/architecture.md, "The durability contract").

A native class of its own, compiled by mypyc with the broker core (setup.py), because the writer thread applies
every stored delivery, send and acknowledgement here: a drained message is a queue row patched with its Packet
Identifier and deleted, a published one a queue row put. It holds no thread, event loop or environment: the writer
(:class:`~gateway.store.writer.LmdbWriter`) begins and commits the transaction, passes it in (``txn``, an
``lmdb.Transaction``) and rolls the counts back (:meth:`BatchApplier.rollback`) when it aborts one.

The operations are listed in :mod:`gateway.store.open_batch`; keys and values are :mod:`gateway.store.records`'s.
The queue table, which nearly every operation changes, is read and written through one cursor per transaction
(no table lookup and no keyword arguments per row).
"""

from __future__ import annotations

from typing import Any, Final

from gateway.broker.message import Message
from gateway.store import records as rec
from gateway.store.open_batch import (
    DEL,
    IN_DEL,
    IN_PUT,
    OB_DEL,
    OB_PUT,
    PUT,
    Q_DEL,
    Q_PUT,
    Q_SENT,
    RET_DEL,
    RET_PUT,
    SESS_DEL,
)

# Which tables the operations of a kind change (bits of BatchApplier.kinds): a session's removal empties its rows
# in four tables. The messages table has a bit of its own, set where a message row is written or deleted (most
# queue rows carry their message: deleting one leaves the messages table as it was).
_QUEUE_KINDS: Final = (1 << Q_PUT) | (1 << Q_DEL) | (1 << Q_SENT) | (1 << SESS_DEL)
_INBOUND_KINDS: Final = (1 << IN_PUT) | (1 << IN_DEL) | (1 << SESS_DEL)
_RETAINED_KINDS: Final = (1 << RET_PUT) | (1 << RET_DEL)
_OUTBOX_KINDS: Final = (1 << OB_PUT) | (1 << OB_DEL)
_SESSION_KINDS: Final = 1 << SESS_DEL
_MESSAGES_CHANGED: Final = 1 << 16  # above every operation kind (open_batch)


def drop_superseded(ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``ops`` without the queue-row patches (Q_SENT: a Packet Identifier recorded for a send) whose row the same
    transaction deletes anyway (the PUBACK came before the commit): the committed state is the same, with fewer
    writes."""
    deleted: set[bytes] = set()
    for op in ops:
        if op[0] == Q_DEL:
            deleted.add(op[1])
    if not deleted:
        return ops
    return [op for op in ops if op[0] != Q_SENT or op[1] not in deleted]


class BatchApplier:
    """Applies a batch's operations in order to a write transaction (:meth:`apply`) and keeps the reference counts
    of the message rows that more than one row references (``refs``).

    A message stored once lives in its only queue row (``records.inline_message``) or in a message row without a
    count; one referenced by several rows has a message row and a count here (rebuilt from the tables at start,
    :mod:`gateway.store.loading`). Every change of a count since :meth:`begin` is kept in ``undo`` so that an
    aborted transaction, or a nested one, rolls back with its counts (:meth:`rollback`).

    Args:
        tables: the store's :class:`~gateway.store.tables.Tables` (``lmdb._Database`` handles).

    Attributes:
        refs: mid -> references (at least 2), for message rows referenced more than once.
        top_mid: no message row has a higher mid: the queue rows of a newer message are gathered and written with
            one ``putmulti`` per table (:meth:`apply`). It stays raised when a transaction fails: a higher bound
            only sends more rows down the one-at-a-time path, which is right for any message.
        kinds: bit ``1 << kind`` for every kind of operation applied since :meth:`begin`, and
            ``_MESSAGES_CHANGED`` once a message row was written or deleted (:meth:`tables_changed`).
        puts: the ``(PUT|DEL, table)`` operations' tables since :meth:`begin` (sessions, subs; not meta, see
            :meth:`tables_changed`).
    """

    def __init__(self, tables: Any) -> None:
        self.meta: Any = tables.meta
        self.messages: Any = tables.messages
        self.sessions: Any = tables.sessions
        self.subs: Any = tables.subs
        self.queue: Any = tables.queue
        self.inbound: Any = tables.inbound
        self.retained: Any = tables.retained
        self.outbox: Any = tables.outbox
        self.refs: dict[int, int] = {}
        self.undo: list[tuple[int, int | None]] = []
        self.last_put_mid = 0  # the last message row put, with one reference (see ref)
        self.top_mid = 0
        self.kinds = 0
        self.puts: list[Any] = []

    def begin(self) -> None:
        """Start a transaction's attempt: no count changes to roll back, no tables changed yet."""
        self.undo = []
        self.last_put_mid = 0
        self.kinds = 0
        self.puts = []

    def tables_changed(self) -> list[Any]:
        """The tables whose pages the operations applied since :meth:`begin` may have changed (handles, each
        once). Never meta: it holds three rows of a few bytes (``format``, written when the store is made,
        ``next_mid`` and ``next_seq``), one page from the start, and rewriting them keeps it one page."""
        kinds = self.kinds
        out: list[Any] = []
        for db in self.puts:
            if db not in out:
                out.append(db)
        for bits, db in ((_QUEUE_KINDS, self.queue), (_INBOUND_KINDS, self.inbound),
                         (_RETAINED_KINDS, self.retained), (_OUTBOX_KINDS, self.outbox),
                         (_MESSAGES_CHANGED, self.messages), (_SESSION_KINDS, self.sessions),
                         (_SESSION_KINDS, self.subs)):
            if kinds & bits and db not in out:
                out.append(db)
        return out

    def apply(self, txn: Any, ops: list[tuple[Any, ...]]) -> None:
        """Apply ``ops`` in order to ``txn``. Queue rows of messages newer than any stored (``top_mid``) are
        gathered and written with one ``putmulti`` per table, before the next operation of any other kind: such a
        message has no row and no count yet; a repeat of the last one (fan-out to several sessions) counts a
        reference.

        Raises:
            lmdb.Error: what LMDB raised (the writer tells a change's own failure from the batch's).
        """
        queue = txn.cursor(self.queue)
        run: list[tuple[int, bytes, bytes, bytes]] = []  # queue rows of new messages: (mid, record, key, value)
        kinds = 0
        for op in ops:
            kind: int = op[0]
            kinds |= 1 << kind
            if kind == Q_PUT:
                message: Message = op[3]
                mid = message.mid
                if mid > self.top_mid or (run and mid == run[-1][0]):
                    run.append((mid, op[4], op[1], op[2]))
                    self.top_mid = mid
                    continue
                if run:
                    self.put_new(txn, queue, run)
                self.ref(txn, message)
                queue.put(op[1], op[2])
                continue
            if run:
                self.put_new(txn, queue, run)
            if kind == Q_DEL:
                value = queue.pop(op[1])
                if value is not None and not rec.carries_message(value):
                    self.unref(txn, rec.from_u64(value))
            elif kind == Q_SENT:
                key = op[1]
                value = queue.get(key)
                if value is not None:
                    queue.put(key, rec.patch_delivery(value, op[2], op[3]))
            elif kind == PUT:
                if op[1] is not self.meta:
                    self.puts.append(op[1])
                txn.put(op[2], op[3], db=op[1])
            elif kind == DEL:
                if op[1] is not self.meta:
                    self.puts.append(op[1])
                txn.delete(op[2], db=op[1])
            elif kind in (IN_PUT, RET_PUT):
                # A row that replaces another (same key) moves its reference to the new message.
                if kind == IN_PUT:
                    message = op[3]
                    value, db = op[2], self.inbound
                else:
                    message = op[2]
                    value, db = rec.u64(message.mid), self.retained
                old = txn.get(op[1], db=db)
                if old is not None:
                    self.unref(txn, rec.from_u64(bytes(old)))
                self.ref(txn, message)
                txn.put(op[1], value, db=db)
            elif kind in (IN_DEL, RET_DEL, OB_DEL):  # the row referenced a message row
                db = self.inbound if kind == IN_DEL else self.retained if kind == RET_DEL else self.outbox
                value = txn.pop(op[1], db=db)
                if value is not None:
                    self.unref(txn, rec.from_u64(value))
            elif kind == SESS_DEL:
                self.delete_session_rows(txn, op[1])
            elif kind == OB_PUT:
                self.ref(txn, op[3])
                txn.put(op[1], op[2], db=self.outbox)
        if run:
            self.put_new(txn, queue, run)
        self.kinds |= kinds

    def put_new(self, txn: Any, queue: Any, run: list[tuple[int, bytes, bytes, bytes]]) -> None:
        """Write a run of queue rows of new messages (a message's rows are consecutive) with one ``putmulti`` per
        table, through ``queue`` (a cursor of the queue table). A message with one row is stored in that row
        (records.inline_message); one with several gets a message row, referenced that many times."""
        messages: list[tuple[bytes, bytes]] = []
        rows: list[tuple[bytes, bytes]] = []
        refs = self.refs
        last = len(run) - 1
        shared = 0
        for i in range(len(run)):
            mid, record, key, value = run[i]
            if shared or (i < last and run[i + 1][0] == mid):
                if not shared:
                    messages.append((rec.u64(mid), record))
                shared += 1
                rows.append((key, value))
                if i == last or run[i + 1][0] != mid:
                    self.undo.append((mid, None))
                    refs[mid] = shared
                    shared = 0
            else:
                rows.append((key, value + record))
        if messages:
            self.kinds |= _MESSAGES_CHANGED
            txn.cursor(self.messages).putmulti(messages)
        queue.putmulti(rows)
        # ref's shortcut ("the last message row put has one reference") must not take an inline message for one
        # with a row: a later reference to it then writes its row.
        self.last_put_mid = 0
        run.clear()

    def ref(self, txn: Any, message: Message) -> None:
        """Count one more reference to ``message``'s row, writing the row when it has none."""
        mid = message.mid
        if mid > self.top_mid:
            self.top_mid = mid  # its row is written now: later queue rows of it must count a reference
        refs = self.refs
        count = refs.get(mid)
        if count is None:
            # One reference or none: the message row tells (a put that finds it reports False).
            if mid != self.last_put_mid and txn.put(rec.u64(mid), rec.encode_message(message), db=self.messages,
                                                    overwrite=False):
                self.kinds |= _MESSAGES_CHANGED
                self.last_put_mid = mid
                return
            count = 1
        self.undo.append((mid, refs.get(mid)))
        refs[mid] = count + 1

    def unref(self, txn: Any, mid: int) -> None:
        """Count one reference to message row ``mid`` less, deleting the row with its last."""
        refs = self.refs
        count = refs.get(mid)
        if count is None:
            self.kinds |= _MESSAGES_CHANGED
            txn.delete(rec.u64(mid), db=self.messages)
            if mid == self.last_put_mid:
                self.last_put_mid = 0
            return
        self.undo.append((mid, count))
        if count <= 2:
            del refs[mid]
        else:
            refs[mid] = count - 1

    def delete_session_rows(self, txn: Any, cid: str) -> None:
        """Delete client ``cid``'s session row and its subscription, queue and inbound rows."""
        txn.delete(rec.name_key(cid), db=self.sessions)
        prefix = rec.client_prefix(cid)
        for db in (self.subs, self.queue, self.inbound):
            cursor = txn.cursor(db)
            if not cursor.set_range(prefix):
                continue
            while cursor.key().startswith(prefix):
                if db is not self.subs:
                    value = bytes(cursor.value())
                    if db is not self.queue or not rec.carries_message(value):
                        self.unref(txn, rec.from_u64(value))
                if not cursor.delete():
                    break
            cursor.close()

    def rollback(self, mark: int = 0) -> None:
        """Undo the reference count changes recorded since ``undo[mark]`` (a transaction, or a nested one, was
        aborted)."""
        refs = self.refs
        undo = self.undo
        for i in range(len(undo) - 1, mark - 1, -1):
            mid, count = undo[i]
            if count is None:
                refs.pop(mid, None)
            else:
                refs[mid] = count
        del undo[mark:]
        self.last_put_mid = 0
