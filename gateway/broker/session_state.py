"""Sessions and connections: the per-client state of MQTT 5.0 §4.1 (Session State) and the per-connection
protocol state (Keep Alive, Topic Aliases, limits negotiated in CONNECT/CONNACK).

A :class:`Session` outlives its :class:`Connection` when it is persistent (Clean Session = 0 / Session Expiry
Interval > 0); it holds the Inflight Window (in memory), the Message Queue, inbound QoS 2 state and the
subscriptions (docs/architecture.md, "Session semantics").
"""

from __future__ import annotations

from collections import deque
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from gateway.broker.connection_states import ALLOWED, AWAITING_CONNECT, ConnState, IllegalTransition
from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.mqueue import MessageQueue
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Will

if TYPE_CHECKING:
    from gateway.broker.queue_pager import QueuePager

#: Session Expiry Interval meaning "never expires" (MQTT 5.0 §3.1.2.11.2).
NEVER: Final = 0xFFFFFFFF

#: Shared read-only stand-ins for per-session and per-connection containers that most clients never use (an idle
#: connection must stay small): replaced by a real set/dict on the first write (see the ``*_for_write``
#: helpers below, and :meth:`Session.start_receiving`).
NO_KEYS: Final[frozenset[str]] = frozenset()
NO_ENTRIES: Final[MappingProxyType[Any, Any]] = MappingProxyType({})
#: ``Connection.pending_acks`` when there are none: shared and never written (a run is replaced, not appended to).
NO_ACKS: Final[list[int]] = []


class _NoQueue(MessageQueue):
    """The Message Queue of a session that has never subscribed: always empty, shared, and refusing entries (a
    session that can receive gets its own queue first, :meth:`Session.start_receiving`)."""

    __slots__ = ()

    def push(self, delivery: Delivery) -> Delivery | None:
        raise _no_queue()

    def push_front(self, delivery: Delivery) -> None:
        raise _no_queue()

    def add_paged(self, seq: int, qos: int, size: int) -> None:
        raise _no_queue()

    def enable_paging(self, pager: QueuePager, mem_len: int) -> None:
        raise _no_queue()


def _no_queue() -> TypeError:
    return TypeError("a session without subscriptions has no Message Queue: Session.start_receiving() first")


#: The shared Message Queue of every session that has never subscribed (or been loaded from the store).
NO_QUEUE: Final[MessageQueue] = _NoQueue(0, 0)



class Session:
    """The Server's Session State for one Client Identifier (MQTT 5.0 §4.1).

    Attributes:
        expiry_interval: Session Expiry Interval, seconds (:data:`NEVER` = forever, 0 = ends with the connection).
        subscriptions: Topic Filter (shared ones as ``$share/group/filter``) -> its record.
        inflight: Inflight Window, Packet Identifier -> Delivery, in send order (in memory; rebuilt from the
            store on start).
        mqueue: the Message Queue.
        awaiting_rel: inbound QoS 2 messages received and PUBRECed, awaiting PUBREL (MQTT 5.0 §4.3.3), with arrival
            times for ``await_rel_timeout``.
        expires_at: wall-clock seconds when an offline session ends, else ``None``.
        will_at: wall-clock seconds when a delayed Will Message is due, else ``None``.
        username: the verified user name of the client that owns the session (``None``: anonymous); another
            user may not take the session over. Kept in the store.
        listener: the name of the listener its client last connected on (whose ``acl_file`` applies).
        unsent: deliveries of the Inflight Window not yet re-sent on the current connection, oldest first: a
            session resumed with a Receive Maximum smaller than what it has in flight gets the rest as slots free
            [MQTT-3.3.4-9].
        acl: its ACL rules (``gateway.broker.access_decisions.ClientRules``), ``None`` without an ``acl_file``.
        partial: keys of its subscriptions decided PARTIAL (checked per message,
            :mod:`gateway.broker.access_decisions`).

    Until its first subscription a session's ``subscriptions``, ``inflight`` and ``mqueue`` are the shared empty
    read-only stand-ins :data:`NO_ENTRIES` and :data:`NO_QUEUE` (written only after :meth:`start_receiving`), and
    ``awaiting_rel`` is :data:`NO_ENTRIES` until its first QoS 2 PUBLISH (:func:`awaiting_rel_for_write`): about
    370 bytes less for a client that only publishes. Reading them needs no care.
    """

    __slots__ = (
        "acl",
        "awaiting_rel",
        "client_id",
        "conn",
        "expires_at",
        "expiry_interval",
        "held_sends",
        "inflight",
        "limits",
        "listener",
        "mqueue",
        "next_packet_id",
        "partial",
        "protocol_level",
        "subscriptions",
        "unsent",
        "username",
        "will",
        "will_at",
    )

    def __init__(self, client_id: str, limits: ZoneLimits, expiry_interval: float = 0) -> None:
        self.client_id = client_id
        self.limits = limits
        self.expiry_interval = expiry_interval
        # Until the first subscription: shared empty read-only stand-ins (start_receiving makes the real ones).
        self.subscriptions: dict[str, SubscriptionRecord] | MappingProxyType[str, SubscriptionRecord] = NO_ENTRIES
        self.inflight: dict[int, Delivery] | MappingProxyType[int, Delivery] = NO_ENTRIES
        self.mqueue = NO_QUEUE
        # A dict once a QoS 2 PUBLISH arrives (awaiting_rel_for_write).
        self.awaiting_rel: dict[int, tuple[Message, float]] | MappingProxyType[int, tuple[Message, float]] = NO_ENTRIES
        self.next_packet_id = 1
        self.held_sends = 0  # PUBLISHes waiting for a commit before they go out (QoS 2, and FIFO behind it)
        # In the window, not yet re-sent on this connection (Receive Maximum); a deque only while it holds any
        # (an empty deque costs ~760 bytes, on every session).
        self.unsent: deque[Delivery] | tuple[()] = ()
        self.conn: Connection | None = None
        self.expires_at: float | None = None
        self.will: Will | None = None
        self.will_at: float | None = None
        self.protocol_level = 4
        self.username: str | None = None
        self.listener = ""
        self.acl: Any = None
        self.partial: set[str] | frozenset[str] = NO_KEYS  # a set once a subscription is decided PARTIAL

    def start_receiving(self, pager: QueuePager | None = None, mem_len: int = 0) -> MessageQueue:
        """Give the session what receiving messages takes, once: its own subscriptions dict, Inflight Window and
        Message Queue (bounded by its limits' ``max_mqueue_len`` and ``max_mqueue_bytes``; paged through
        ``pager`` beyond ``mem_len`` entries in memory when given). Until then, which for a client that only
        publishes is for good, the session shares empty read-only stand-ins (:data:`NO_ENTRIES`,
        :data:`NO_QUEUE`): nothing can be delivered to a session without a subscription. Returns the queue."""
        if self.mqueue is NO_QUEUE:
            self.subscriptions = {}
            self.inflight = {}
            self.mqueue = MessageQueue(self.limits.max_mqueue_len, self.limits.max_mqueue_bytes)
            if pager is not None:
                self.mqueue.enable_paging(pager, mem_len)
        return self.mqueue

    @property
    def persistent(self) -> bool:
        """True when the session outlives its Network Connection."""
        return self.expiry_interval > 0

    def allocate_packet_id(self) -> int:
        """A Packet Identifier not in use by this session's Inflight Window [MQTT-2.2.1-2].

        Raises:
            RuntimeError: all 65535 identifiers are in use (cannot happen with a window <= 65535).
        """
        inflight = self.inflight
        pid = self.next_packet_id
        for _ in range(65535):
            nxt = pid + 1 if pid < 65535 else 1
            if pid not in inflight:
                self.next_packet_id = nxt
                return pid
            pid = nxt
        raise RuntimeError("no free Packet Identifier")

    def __repr__(self) -> str:
        return f"<Session {self.client_id!r} inflight={len(self.inflight)} queued={len(self.mqueue)}>"


class Connection:
    """One Network Connection's protocol state. The I/O layer drains ``out`` (and keeps the transport itself).

    Attributes:
        state: a :class:`~gateway.broker.connection_states.ConnState`; changed only by :meth:`move_to`.
        out: encoded packets not yet handed to the I/O layer, in order (each input hands them out in its
            :class:`~gateway.broker.actions.Action`; written only by :mod:`gateway.broker.output`).
        closing: ``KEEP_OPEN``, or how the core closed it (``CLOSE``: after ``out``; ``ABORT``: at once), and
            ``close_reason`` why (:mod:`gateway.broker.actions`); set only by ``session_lifecycle.close``.
        version: Protocol Level (3, 4 or 5) once CONNECT arrived.
        keep_alive: seconds; the connection is closed after 1.5x without a packet [MQTT-3.1.2-22 (5.0)].
        window: Inflight Window length for this connection (max_inflight capped by Receive Maximum).
        max_packet_size: the client's Maximum Packet Size, bytes (5.0), or ``None``.
        topic_alias_max: the client's Topic Alias Maximum (outbound aliases we may use).
        aliases_in / aliases_out: Topic Alias mappings of this connection (MQTT 5.0 §3.3.2.3.4).
        inbound_pending: QoS 1/2 PUBLISHes received and not yet acknowledged (Receive Maximum accounting).
        paused: the socket's write buffer is above its high-water mark (``high_watermark``): QoS 0 messages to
            it are dropped, QoS 1/2 wait in the Message Queue.
        paused_at: when ``paused`` last became true, wall-clock seconds (for ``send_timeout``).
        pending: :meth:`Broker.receive` left part of its bytes (the rest of a long run of PUBACKs,
            ``pending_acks``, and what followed it, ``pending_data``): its action says ``more``, and the I/O layer
            calls :meth:`Broker.resume` until this is False.
        cert_cn: the CN of the client certificate verified on a TLS listener (``use_identity_as_username``), or
            ``None``; given by the I/O layer with :meth:`Broker.accepted_at` before any byte is received.
        username: the verified user name once CONNECT is accepted (``None``: anonymous).
        held / held_until: packets received while the CONNECT (the first of them) is held by the failure
            throttle, and when it is released (wall-clock seconds; state ``HELD``).
        tokens / tokens_at: the ``max_publish_rate`` token bucket (tokens, and when it was last filled).
        deferred / deferred_data: the PUBLISH waiting for a token, and bytes read meanwhile (``max_publish_rate``).
        paused_until: wall-clock seconds until which the I/O layer must not read from this connection
            (``max_publish_rate``); the Keep Alive check counts from then.
        check_key: the whole second under which the Deadline Index files this connection's next deadline check,
            or ``None`` (:mod:`gateway.broker.deadlines`).
    """

    __slots__ = (
        "aliases_in",
        "aliases_out",
        "cert_cn",
        "check_key",
        "client_id",
        "close_reason",
        "closing",
        "deferred",
        "deferred_data",
        "held",
        "held_until",
        "inbound_pending",
        "keep_alive",
        "last_ack_at",
        "last_rx",
        "limits",
        "listener",
        "max_packet_size",
        "opened_at",
        "out",
        "paused",
        "paused_at",
        "paused_until",
        "peer",
        "pending",
        "pending_acks",
        "pending_data",
        "reader",
        "request_problem_info",
        "session",
        "state",
        "tokens",
        "tokens_at",
        "topic_alias_max",
        "username",
        "version",
        "will",
        "window",
    )

    def __init__(self, limits: ZoneLimits, listener: str, peer: str, now: float) -> None:
        self.limits = limits
        self.listener = listener
        self.peer = peer
        self.reader = PacketReader(limits.max_packet_size)
        self.out: list[bytes] = []
        self.closing = 0  # KEEP_OPEN (gateway.broker.actions)
        self.close_reason = ""
        self.state: ConnState = AWAITING_CONNECT
        self.version = 4
        self.client_id = ""
        self.session: Session | None = None
        self.keep_alive = 0
        self.opened_at = now
        self.last_rx = now
        self.last_ack_at = now
        self.window = limits.window(None)
        self.max_packet_size: int | None = None
        self.topic_alias_max = 0
        self.aliases_in: dict[int, str] | MappingProxyType[int, str] = NO_ENTRIES  # a dict once one is set
        self.aliases_out: dict[str, int] | MappingProxyType[str, int] = NO_ENTRIES
        self.inbound_pending = 0
        self.paused = False
        self.paused_at = 0.0
        self.will: Will | None = None
        self.request_problem_info = True
        self.pending = False
        self.pending_acks = NO_ACKS
        self.pending_data = b""
        self.cert_cn: str | None = None  # a verified client certificate's CN, set by the TLS glue
        self.username: str | None = None
        self.held: list[Any] | tuple[()] = ()  # a list while the CONNECT is held (connect.hold)
        self.held_until = 0.0
        self.tokens = max(limits.max_publish_rate, 1.0)  # a full bucket (max_publish_rate, inbound.py)
        self.tokens_at = now
        self.paused_until = 0.0
        self.deferred: Any = None
        self.deferred_data = b""
        self.check_key: int | None = None

    @property
    def close_after_flush(self) -> bool:
        """The core closed this connection (its last packets are written first, unless it aborts)."""
        return self.closing != 0

    @property
    def abort(self) -> bool:
        """The core closed this connection without writing what is left (stuck past ``send_timeout``)."""
        return self.closing == 2

    def take_will(self) -> Will | None:
        """The Will Message the connection still carries, which it no longer does after this call: the session
        ending decides whether it is published [MQTT-3.1.2-8] or discarded [MQTT-3.1.2-10]."""
        will, self.will = self.will, None
        return will

    def hold(self, packet: Any, until: float) -> None:
        """Hold the CONNECT ``packet`` until ``until`` (wall-clock seconds): the failure throttle's delay."""
        self.held = [packet]
        self.held_until = until

    def hold_behind(self, packet: Any) -> None:
        """Keep ``packet``, received while the CONNECT is held, to be handled after it (state ``HELD``)."""
        held = self.held
        assert isinstance(held, list), "no CONNECT is held"
        held.append(packet)

    def take_held(self) -> list[Any]:
        """The held CONNECT and the packets that arrived behind it, in order; nothing is held after this call."""
        packets, self.held = list(self.held), ()
        return packets

    def defer(self, packet: Any) -> None:
        """Keep the PUBLISH ``packet`` until a ``max_publish_rate`` token frees it."""
        self.deferred = packet

    def take_deferred(self) -> tuple[Any, bytes]:
        """The deferred PUBLISH and the bytes read after it; nothing is deferred after this call."""
        packet, data = self.deferred, self.deferred_data
        self.deferred, self.deferred_data = None, b""
        return packet, data

    def keep_reading_later(self, data: bytes) -> None:
        """Keep ``data``, read while a PUBLISH is deferred, for when its token comes."""
        self.deferred_data = data

    def move_to(self, state: ConnState) -> None:
        """Change :attr:`state` to ``state``; :class:`~gateway.broker.connection_states.IllegalTransition` when
        :data:`~gateway.broker.connection_states.ALLOWED` does not list the change (a bug in the core)."""
        if state not in ALLOWED[self.state]:
            raise IllegalTransition(self.state, state)
        self.state = state

    def __repr__(self) -> str:
        return f"<Connection {self.client_id!r} from {self.peer} v{self.version}>"


def partial_for_write(session: Session) -> set[str]:
    """``session.partial`` as a set that may be changed (made on first use)."""
    partial = session.partial
    if isinstance(partial, frozenset):
        partial = session.partial = set()
    return partial


def awaiting_rel_for_write(session: Session) -> dict[int, tuple[Message, float]]:
    """``session.awaiting_rel`` as a dict that may be changed (made on first use)."""
    awaiting = session.awaiting_rel
    if type(awaiting) is not dict:
        awaiting = session.awaiting_rel = {}
    return awaiting


def aliases_in_for_write(conn: Connection) -> dict[int, str]:
    """``conn.aliases_in`` as a dict that may be changed (made on first use)."""
    aliases = conn.aliases_in
    if type(aliases) is not dict:
        aliases = conn.aliases_in = {}
    return aliases


def aliases_out_for_write(conn: Connection) -> dict[str, int]:
    """``conn.aliases_out`` as a dict that may be changed (made on first use)."""
    aliases = conn.aliases_out
    if type(aliases) is not dict:
        aliases = conn.aliases_out = {}
    return aliases
