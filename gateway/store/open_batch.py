"""The open batch of the LMDB store's group commit: the changes recorded on the loop since the last hand-over to the
writer thread, and the queue rows' store sequence numbers (docs/architecture.md, "The durability contract").

A native class of its own, compiled by mypyc with the broker core (setup.py), because the core records every stored
delivery, send and acknowledgement here: the store's per-message operations (:meth:`OpenBatch.delivery_saved`,
:meth:`~OpenBatch.delivery_deleted`, :meth:`~OpenBatch.deliveries_deleted`) are this class's methods, bound to the
store (:class:`~gateway.store.lmdb_store.LmdbStore`), so the compiled core calls compiled code. It holds no LMDB,
thread or event loop: when a change opens a batch it calls ``schedule`` (the store's, which hands the batch over at
the end of the loop turn).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Final

from gateway.broker.message import Delivery
from gateway.broker.store_port import DURABLE, ORDER, OWN
from gateway.store import records as rec

# Operations, recorded by the store's typed operations on the loop, applied in order by the writer thread
# (gateway/store/applier.py, BatchApplier.apply):
#   (PUT, table, key, value), (DEL, table, key)             sessions, subs, meta
#   (Q_PUT, key, delivery record, Message, message record)  a new queue row (takes a reference to its message)
#   (Q_DEL, key), (Q_SENT, key, packet_id, state)           a queue row deleted, or patched after a send
#   (IN_PUT, key, inbound record, Message), (IN_DEL, key)   inbound QoS 2 rows
#   (RET_PUT, key, Message), (RET_DEL, key)                 retained messages
#   (OB_PUT, key, outbox record, Message), (OB_DEL, key)    upstream outbox rows (gateway/upstream/)
#   (SESS_DEL, client id)                                   a session with its subscription, queue, inbound rows
PUT: Final = 0
DEL: Final = 1
Q_PUT: Final = 2
Q_DEL: Final = 3
IN_PUT: Final = 4
IN_DEL: Final = 5
RET_PUT: Final = 6
RET_DEL: Final = 7
SESS_DEL: Final = 8
OB_PUT: Final = 9
OB_DEL: Final = 10
Q_SENT: Final = 11  # the row's Packet Identifier and state, patched in place (records.patch_delivery)


class OpenBatch:
    """The operations recorded since the last hand-over, in order (``ops``), the sends not yet recorded (``sent``)
    and the counters the next commit persists (``seq``, ``next_mid_hint``).

    Also the commit barriers: the open batch's last (``barrier_id``) and the last of each batch handed over and not
    yet committed (``inflight``), which :meth:`barrier` places.

    Args:
        schedule: called when a change is recorded and ``submit_scheduled`` is False (the store's ``_schedule``,
            which sets it).
        bring_forward: called when a barrier joins the open batch and ``eager`` is True (the store's
            ``_bring_forward``: hand the batch over now, or at the end of this loop turn instead of later).
    """

    def __init__(self, schedule: Callable[[], None], bring_forward: Callable[[], None]) -> None:
        self.schedule = schedule
        self.bring_forward = bring_forward
        self.barrier_id = 0  # the open batch's last commit barrier (0: none)
        self.inflight: deque[int] = deque()  # the last barrier of each batch in flight (0: none)
        #: A barrier must call bring_forward: no group commit, or a lazy commit is pending (the store keeps it set).
        self.eager = False
        self.ops: list[tuple[Any, ...]] = []
        #: Sends of stored deliveries whose row is not patched yet, by seq: (client id, delivery). Turned into
        #: Q_SENT operations when the batch is handed over; a delivery deleted before that needs none.
        self.sent: dict[int, tuple[str, Delivery]] = {}
        #: A change was recorded since the last commit barrier (the barrier's answer: OWN or ORDER).
        self.changed = False
        self.submit_scheduled = False
        self.seq = 1  # the next queue (or outbox) row's store sequence number
        self.next_mid_hint = 1
        self.prefixes: dict[str, bytes] = {}  # client id -> its key prefix
        self.long_names: dict[bytes, str] = {}  # hashed key part -> the client id it stands for
        self.enc: tuple[int, bytes] = (0, b"")  # the last message record encoded on the loop, by mid

    def prefix(self, client_id: str) -> bytes:
        """The key prefix of ``client_id``'s rows (``records.client_prefix``), cached (at most 10,000 client ids);
        a hashed one is remembered with its client id (to name the owner of a change that fails)."""
        prefix = self.prefixes.get(client_id)
        if prefix is None:
            if len(self.prefixes) >= 10_000:
                self.prefixes.clear()
            prefix = rec.client_prefix(client_id)
            self.prefixes[client_id] = prefix
            if len(prefix) > rec.NAME_MAX + 1:
                if len(self.long_names) >= 10_000:
                    self.long_names.clear()
                self.long_names[prefix[:-1]] = client_id
        return prefix

    def record(self, op: tuple[Any, ...]) -> None:
        """Append one operation to the open batch."""
        self.ops.append(op)
        self.changed = True
        if not self.submit_scheduled:
            self.schedule()

    def note_mid(self, mid: int) -> None:
        """Remember the newest message id so that the next mid survives restarts."""
        if mid >= self.next_mid_hint:
            self.next_mid_hint = mid + 1

    def delivery_saved(self, client_id: str, delivery: Delivery) -> None:
        """A stored delivery is new (a queue row, with a new seq written into ``delivery.seq``) or was sent (its
        row's Packet Identifier and state change): the store port's ``SessionStore.delivery_saved``."""
        seq = delivery.seq
        if seq:
            # The row exists (or is recorded before this): only its Packet Identifier and state change, recorded
            # when the batch is handed over, unless the delivery is deleted first (acknowledged at once).
            self.sent[seq] = (client_id, delivery)
            self.changed = True
        else:
            seq = self.seq
            delivery.seq = seq
            self.seq = seq + 1
            message = delivery.message  # a new row takes a reference to its message
            mid = message.mid
            if mid >= self.next_mid_hint:
                self.next_mid_hint = mid + 1
            enc = self.enc
            if enc[0] != mid:
                # Encoded here, not on the writer thread: a commit is the publishers' critical path.
                enc = self.enc = (mid, rec.encode_message(message))
            self.ops.append((Q_PUT, self.prefix(client_id) + rec.u64(seq), rec.encode_delivery(delivery), message,
                             enc[1]))
            self.changed = True
        if not self.submit_scheduled:
            self.schedule()

    def delivery_deleted(self, client_id: str, delivery: Delivery) -> None:
        """A stored delivery is gone (acknowledged, expired, dropped): its queue row is deleted."""
        seq = delivery.seq
        if seq:
            if self.sent:
                self.sent.pop(seq, None)
            self.record((Q_DEL, self.prefix(client_id) + rec.u64(seq)))

    def deliveries_deleted(self, client_id: str, deliveries: list[Delivery]) -> None:
        """:meth:`delivery_deleted` for each of ``deliveries`` (one run of acknowledgements)."""
        prefix = self.prefix(client_id)
        sent = self.sent
        ops = self.ops
        for delivery in deliveries:
            seq = delivery.seq
            if seq:
                if sent:
                    sent.pop(seq, None)
                ops.append((Q_DEL, prefix + rec.u64(seq)))
                self.changed = True
        if not self.submit_scheduled:
            self.schedule()

    def barrier(self, barrier: int) -> int:
        """Commit barrier ``barrier`` after everything recorded so far (the port's ``SessionStore.barrier``): it
        joins the open batch, or with nothing open the last batch in flight (to keep the order), and is reported
        when that batch lands. Returns DURABLE (nothing open or in flight: not reported), OWN or ORDER (changes
        recorded since the previous barrier or not)."""
        changed = self.changed
        if changed or self.ops or self.sent:
            self.changed = False
            self.barrier_id = barrier
            if self.eager:
                self.bring_forward()
            return OWN if changed else ORDER
        if self.barrier_id:
            self.barrier_id = barrier  # cannot happen: an open barrier has open changes
            return ORDER
        if self.inflight:
            self.inflight[-1] = barrier  # reported with the batch being written, after its own barrier
            return ORDER
        return DURABLE
