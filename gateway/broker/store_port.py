"""The store interface the broker needs for durable state, and the in-memory implementation.

The broker calls these hooks for persistent sessions only (Clean Session = 0 / Session Expiry Interval > 0)
and for retained messages; clean sessions never touch the store: their state ends with the connection or the
process anyway (docs/reliability.md). Nothing but data crosses this port: changes, and **commit barriers**. An
acknowledgement that must wait until the work it answers is durable (PUBACK, PUBREC, PUBCOMP, SUBACK, ...) stays
in the core, held under the id of a barrier (:mod:`gateway.broker.barriers`); :meth:`SessionStore.barrier` puts
that id after everything recorded so far. Whoever performs the changes later reports the barrier back to the
core as committed (``Broker.committed``) or failed (``Broker.failed``: the disk or ``store.max_size`` full, so
that a publisher is refused with 0x97 rather than left waiting); barriers are reported in order, and a report
covers every earlier barrier.

``gateway/store/`` implements this on LMDB; :class:`MemoryStore` keeps nothing, so every barrier is durable at
once; :class:`ChangeLog` is the sans-I/O form of the same interface: every change the core makes is an output
record (:class:`StoreChange`) in :attr:`ChangeLog.changes`, barriers included, held until whoever performs the
records says they are committed (:meth:`ChangeLog.commit`) or failed (:meth:`ChangeLog.fail`). The in-process
tests of the core read the records (tests/test_core.py); the LMDB store performs the same calls as LMDB operations
on its writer thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from gateway.broker.native_classes import mypyc_attr
from gateway.broker.queue_pager import QueuePager

__all__ = [
    "DURABLE",
    "ORDER",
    "OWN",
    "ChangeLog",
    "LoadedState",
    "MemoryStore",
    "OutboxRecord",
    "QueuePager",
    "SessionStore",
    "StoreChange",
]

#: :meth:`SessionStore.barrier`'s answers. DURABLE: nothing recorded waits and no earlier barrier is outstanding,
#: so what waits on this barrier may go at once (the core holds nothing). OWN: the barrier waits, and changes were
#: recorded since the previous barrier. ORDER: the barrier waits only for the order of acknowledgements (nothing
#: was recorded since the previous barrier).
DURABLE: Final = 0
OWN: Final = 1
ORDER: Final = 2

if TYPE_CHECKING:
    from gateway.broker.message import Delivery, Message
    from gateway.broker.session_state import Session
    from gateway.broker.subscription_tree import SubscriptionRecord


@dataclass(slots=True)
class LoadedState:
    """What a store hands back on start: persistent sessions (with subscriptions, queues, inflight and inbound
    QoS 2 state rebuilt) and retained messages."""

    sessions: list[Session] = field(default_factory=list)
    retained: list[Message] = field(default_factory=list)
    next_mid: int = 1


@dataclass(slots=True)
class OutboxRecord:
    """One upstream outbox entry (gateway/upstream/): a message waiting for the cloud broker's acknowledgement.

    Attributes:
        seq: the store sequence number: FIFO order within the link, and the ``msg_id`` sent upstream.
        message: the local message (payload stored once, referenced like queue entries).
        qos: the QoS it is forwarded at.
        topic: the remote topic it is forwarded to.
    """

    seq: int
    message: Message
    qos: int
    topic: str


class SessionStore(Protocol):
    """Durable state hooks. Every method records a change; nothing is durable until a commit."""

    def load(self, now: float) -> LoadedState:
        """Everything stored, with expired sessions and messages removed (``now``: wall-clock seconds)."""
        ...

    def session_saved(self, session: Session) -> None:
        """A persistent session was created or its expiry, will or flags changed."""
        ...

    def session_deleted(self, client_id: str) -> None:
        """A persistent session ended (expired, Clean Start, or became non-persistent): drop all its state."""
        ...

    def subscription_saved(self, client_id: str, record: SubscriptionRecord) -> None:
        """A subscription was added or replaced."""
        ...

    def subscription_deleted(self, client_id: str, key: str) -> None:
        """A subscription (``key`` as the client wrote the filter) was removed."""
        ...

    def delivery_saved(self, client_id: str, delivery: Delivery) -> None:
        """A delivery was queued, or its Packet Identifier or QoS 2 state changed."""
        ...

    def delivery_deleted(self, client_id: str, delivery: Delivery) -> None:
        """A delivery completed, expired or was dropped."""
        ...

    def deliveries_deleted(self, client_id: str, deliveries: list[Delivery]) -> None:
        """Several deliveries completed (a run of acknowledgements), in order: as :meth:`delivery_deleted` each."""
        ...

    def inbound_saved(self, client_id: str, packet_id: int, message: Message) -> None:
        """An inbound QoS 2 message now awaits its PUBREL."""
        ...

    def inbound_deleted(self, client_id: str, packet_id: int) -> None:
        """An inbound QoS 2 Packet Identifier was released."""
        ...

    def retained_saved(self, message: Message) -> None:
        """``message`` is now its topic's retained message."""
        ...

    def retained_deleted(self, topic: str) -> None:
        """The topic's retained message was cleared."""
        ...

    def barrier(self, barrier: int) -> int:
        """Commit barrier ``barrier`` (an id from the core, increasing) after everything recorded so far: once the
        commit holding those changes lands, report ``barrier`` back as committed, or as failed (with whether the
        store or its disk is full: MDB_MAP_FULL, ENOSPC, EDQUOT, answered 0x97; False for other write errors).
        A report covers every earlier barrier. Returns :data:`DURABLE` (nothing waits: not reported), :data:`OWN`
        or :data:`ORDER` (whether changes were recorded since the previous barrier)."""
        ...

    def pager(self, client_id: str) -> tuple[QueuePager, int] | None:
        """How ``client_id``'s Message Queue may page to the store: ``(pager, mem_len)`` (entries kept in
        memory, messages), or ``None`` when this store does not page."""
        ...

    def has_room(self, client_id: str | None) -> bool:
        """Whether new durable work for ``client_id`` (a publisher) may be accepted (store not full)."""
        ...

    def outbox_seq(self) -> int:
        """A new upstream outbox sequence number: increasing, and not reused after a restart."""
        ...

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        """An entry joined upstream ``link``'s outbox (committed with the publisher's acknowledgement)."""
        ...

    def outbox_deleted(self, link: str, seq: int) -> None:
        """An outbox entry left (acknowledged upstream, or dropped by a bound)."""
        ...

    def outbox_loaded(self, link: str) -> list[OutboxRecord]:
        """The entries of ``link`` read back on start, in FIFO order (handed out once)."""
        ...

    def close(self) -> None:
        """Commit what is pending and release the store."""
        ...


# Compiled, a native class; tests subclass it in Python (tests/fuzzing.py).
@mypyc_attr(allow_interpreted_subclasses=True)
class MemoryStore:
    """A :class:`SessionStore` that keeps nothing: sessions live only in the broker's memory."""

    def __init__(self) -> None:
        self._outbox_seq = 0

    def load(self, now: float) -> LoadedState:
        # Outbox sequence numbers start at the clock (microseconds), so msg_ids stay unique across restarts.
        self._outbox_seq = max(self._outbox_seq, int(now * 1_000_000))
        return LoadedState()

    def session_saved(self, session: Session) -> None:
        pass

    def session_deleted(self, client_id: str) -> None:
        pass

    def subscription_saved(self, client_id: str, record: SubscriptionRecord) -> None:
        pass

    def subscription_deleted(self, client_id: str, key: str) -> None:
        pass

    def delivery_saved(self, client_id: str, delivery: Delivery) -> None:
        pass

    def delivery_deleted(self, client_id: str, delivery: Delivery) -> None:
        pass

    def deliveries_deleted(self, client_id: str, deliveries: list[Delivery]) -> None:
        pass

    def inbound_saved(self, client_id: str, packet_id: int, message: Message) -> None:
        pass

    def inbound_deleted(self, client_id: str, packet_id: int) -> None:
        pass

    def retained_saved(self, message: Message) -> None:
        pass

    def retained_deleted(self, topic: str) -> None:
        pass

    def barrier(self, barrier: int) -> int:
        return DURABLE  # nothing to commit: never fails

    def pager(self, client_id: str) -> tuple[QueuePager, int] | None:
        return None

    def has_room(self, client_id: str | None) -> bool:
        return True

    def outbox_seq(self) -> int:
        self._outbox_seq += 1
        return self._outbox_seq

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        pass

    def outbox_deleted(self, link: str, seq: int) -> None:
        pass

    def outbox_loaded(self, link: str) -> list[OutboxRecord]:
        return []

    def close(self) -> None:
        pass


class StoreChange(NamedTuple):
    """One change the core asked the store to make durable: an output record of the core (:class:`ChangeLog`).

    Attributes:
        op: the :class:`SessionStore` method that recorded it (``"delivery_saved"``, ``"inbound_deleted"``, ...),
            or ``"durable"`` for a commit barrier: acknowledgements wait on it for every change recorded before it.
        client_id: the session (or upstream link) it belongs to; ``None`` for retained messages and barriers.
        key: what it is about: a Topic Filter, a Packet Identifier, a store sequence number, a topic, the barrier's
            id, or ``None``.
        value: the stored object (:class:`Session`, :class:`Delivery`, :class:`Message`, ...), or ``None``.
    """

    op: str
    client_id: str | None
    key: Any = None
    value: Any = None


class ChangeLog(MemoryStore):
    """A :class:`SessionStore` that performs nothing: each change is appended to :attr:`changes` as a
    :class:`StoreChange`, each commit barrier as a ``"durable"`` record, and the barriers are reported back only
    when :meth:`commit` says the changes recorded before them are durable, or :meth:`fail` that they cannot be
    (nothing is acknowledged before the work it caused is committed: docs/reliability.md).

    Queue rows get increasing store sequence numbers (``Delivery.seq``) as the LMDB store gives them; the Message
    Queue does not page (``pager`` is ``None``). ``room`` is what :meth:`has_room` answers (False: a full store).
    ``on_committed(barrier)`` and ``on_failed(barrier, full)`` receive the reports (the I/O layer's part: in the
    tests, ``Broker.committed`` and ``Broker.failed``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.changes: list[StoreChange] = []
        self.room = True
        self._seq = 0
        self._barriers: list[int] = []  # recorded and not yet reported
        self._changed = False  # a change was recorded since the last barrier
        self.on_committed: Callable[[int], Any] | None = None
        self.on_failed: Callable[[int, bool], Any] | None = None

    def take(self) -> list[StoreChange]:
        """The records made since the last call (their order is the order they must be performed in)."""
        changes, self.changes = self.changes, []
        return changes

    def commit(self) -> int:
        """Everything recorded so far is durable: report the last barrier (and with it every earlier one) as
        committed; returns how many barriers that covered."""
        barriers, self._barriers = self._barriers, []
        if barriers and self.on_committed is not None:
            self.on_committed(barriers[-1])
        return len(barriers)

    def fail(self, full: bool = True) -> int:
        """The records could not be committed (``full``: for lack of room, 0x97): report the last barrier as
        failed; returns how many barriers that covered."""
        barriers, self._barriers = self._barriers, []
        if barriers and self.on_failed is not None:
            self.on_failed(barriers[-1], full)
        return len(barriers)

    def _add(self, op: str, client_id: str | None, key: Any = None, value: Any = None) -> None:
        self.changes.append(StoreChange(op, client_id, key, value))
        self._changed = True

    def session_saved(self, session: Session) -> None:
        self._add("session_saved", session.client_id, None, session)

    def session_deleted(self, client_id: str) -> None:
        self._add("session_deleted", client_id)

    def subscription_saved(self, client_id: str, record: SubscriptionRecord) -> None:
        self._add("subscription_saved", client_id, record.key, record)

    def subscription_deleted(self, client_id: str, key: str) -> None:
        self._add("subscription_deleted", client_id, key)

    def delivery_saved(self, client_id: str, delivery: Delivery) -> None:
        if not delivery.seq:
            self._seq += 1
            delivery.seq = self._seq
        self._add("delivery_saved", client_id, delivery.seq, delivery)

    def delivery_deleted(self, client_id: str, delivery: Delivery) -> None:
        if delivery.seq:
            self._add("delivery_deleted", client_id, delivery.seq, delivery)

    def deliveries_deleted(self, client_id: str, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self.delivery_deleted(client_id, delivery)

    def inbound_saved(self, client_id: str, packet_id: int, message: Message) -> None:
        self._add("inbound_saved", client_id, packet_id, message)

    def inbound_deleted(self, client_id: str, packet_id: int) -> None:
        self._add("inbound_deleted", client_id, packet_id)

    def retained_saved(self, message: Message) -> None:
        self._add("retained_saved", None, message.topic, message)

    def retained_deleted(self, topic: str) -> None:
        self._add("retained_deleted", None, topic)

    def barrier(self, barrier: int) -> int:
        changed = self._changed
        self.changes.append(StoreChange("durable", None, barrier))
        self._barriers.append(barrier)
        self._changed = False
        return OWN if changed else ORDER

    def has_room(self, client_id: str | None) -> bool:
        return self.room

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        self._add("outbox_saved", link, record.seq, record)

    def outbox_deleted(self, link: str, seq: int) -> None:
        self._add("outbox_deleted", link, seq)
