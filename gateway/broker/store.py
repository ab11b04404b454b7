"""The store interface the broker needs for durable state, and the in-memory implementation.

The broker calls these hooks for persistent sessions only (Clean Session = 0 / Session Expiry Interval > 0)
and for retained messages; clean sessions never touch the store (DESIGN.md §4). Acknowledgements of work that
must be durable (PUBACK, PUBREC, SUBACK) are sent from :meth:`SessionStore.when_durable` callbacks, which run in
the order they were registered once everything recorded before them is committed; when that commit fails (the
disk or ``store.max_size`` is full), their ``on_failure`` callbacks run instead, so that a publisher is refused
(0x97) rather than left waiting (DESIGN.md §4).

``gateway/store/`` implements this on LMDB; :class:`MemoryStore` keeps nothing and runs callbacks at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.broker.pager import QueuePager

__all__ = ["LoadedState", "MemoryStore", "OutboxRecord", "QueuePager", "SessionStore"]

if TYPE_CHECKING:
    from gateway.broker.message import Delivery, Message
    from gateway.broker.routing import SubscriptionRecord
    from gateway.broker.session import Session


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

    def when_durable(self, callback: Callable[[], None], on_failure: Callable[[bool], None] | None = None) -> None:
        """Run ``callback`` once everything recorded so far is committed (FIFO with other callbacks). When the
        commit holding it fails, run ``on_failure`` instead (if given; FIFO too) with True when the store or its
        disk is full (MDB_MAP_FULL, ENOSPC, EDQUOT; DESIGN.md §4: answer 0x97) and False for other write errors;
        nothing of that commit may be acknowledged."""
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

    def when_durable(self, callback: Callable[[], None], on_failure: Callable[[bool], None] | None = None) -> None:
        callback()  # nothing to commit: never fails

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
