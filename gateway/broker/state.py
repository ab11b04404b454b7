"""The broker's state that every packet handler reads: sessions, connections, the subscription tree, retained
messages, the store, counters. One object (:class:`BrokerState`), passed as ``core`` to the handler modules
(connect, inbound, qos2, router, delivery, inflight, subscribe, sessions, timers), which are functions over it;
:class:`~gateway.broker.broker.Broker` is this state plus the entry points the I/O layer calls."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final

from gateway.broker.deadlines import DeadlineIndex
from gateway.broker.limits import BrokerSettings
from gateway.broker.message import Message
from gateway.broker.native_classes import mypyc_attr
from gateway.broker.ratelog import RateLimitedLog
from gateway.broker.retained_store import RetainedMessages
from gateway.broker.session_state import Connection, Session
from gateway.broker.store_port import MemoryStore, SessionStore
from gateway.broker.subscription_tree import SubscriptionTree

log: Final = logging.getLogger("gateway.broker")


class Stats:
    """Broker counters (``$SYS/broker/...`` and the Prometheus collector, gateway/server/metrics.py): control
    packets in/out by packet type, PUBLISH in/out by QoS, drops by reason, connections. Each is one attribute or
    list-item increment in code that already runs; sums are taken when read."""

    __slots__ = (
        "bytes_received",
        "clients_connected",
        "clients_maximum",
        "connect_refused",
        "connections_total",
        "dropped",
        "publish_received",
        "received",
        "received_qos",
        "refused",
        "sent",
        "sent_qos",
    )

    def __init__(self) -> None:
        #: Control packets received, by packet type (index 1..15, MQTT 5.0 §2.1.2), PUBLISH included.
        self.received = [0] * 16
        #: Control packets sent but PUBLISH, by packet type (PUBLISH is in ``sent_qos``).
        self.sent = [0] * 16
        self.publish_received = 0
        #: PUBLISH packets accepted for handling, by QoS 0..2 (``publish_received`` is their sum).
        self.received_qos = [0, 0, 0]
        #: PUBLISH packets sent, by QoS 0..2.
        self.sent_qos = [0, 0, 0]
        self.bytes_received = 0
        self.clients_connected = 0
        self.clients_maximum = 0
        self.connections_total = 0
        self.dropped: Counter[str] = Counter()
        #: Requests refused by a limit, by limit name (``$SYS/broker/refused/<name>``): CONNECTs past
        #: ``max_sessions``, Topic Filters past ``max_subscriptions``, connections closed by ``send_timeout``.
        self.refused: Counter[str] = Counter()
        #: CONNECTs refused, by the CONNACK Reason Code's name in lower case (``not_authorized``,
        #: ``quota_exceeded``, ``unsupported_protocol_version``, ...; 3.1.1 refusals by the 5.0 name).
        self.connect_refused: Counter[str] = Counter()

    @property
    def messages_received(self) -> int:
        """Control packets received (all types)."""
        return sum(self.received)

    @property
    def messages_sent(self) -> int:
        """Control packets sent (all types, PUBLISH included)."""
        return sum(self.sent) + sum(self.sent_qos)

    @property
    def publish_sent(self) -> int:
        """PUBLISH packets sent."""
        return sum(self.sent_qos)


# Its subclass Broker may be subclassed in Python (gateway/broker/broker.py), which mypyc allows only when every base
# class allows it too.
@mypyc_attr(allow_interpreted_subclasses=True)
class BrokerState:
    """Everything the broker knows, and nothing it does.

    Args:
        settings: broker-wide settings and per-zone limits.
        store: where persistent sessions and retained messages are recorded (default: memory only).
        now: wall-clock seconds at start.
    """

    def __init__(self, settings: BrokerSettings | None, store: SessionStore | None, now: float) -> None:
        self.settings = settings or BrokerSettings()
        self.store: SessionStore = store or MemoryStore()
        self.sessions: dict[str, Session] = {}
        #: Open connections (a dict as an ordered set: about a third of a set's memory per entry at thousands).
        self.connections: dict[Connection, None] = {}
        #: The open connections by the second of their next deadline check (the tick looks at these only).
        self.deadlines = DeadlineIndex()
        self.tree = SubscriptionTree()
        self.retained = RetainedMessages()
        #: Connections with output or a close for the I/O layer since the input began (handed out as its actions).
        self.dirty: set[Connection] = set()
        self.stats = Stats()
        self.started_at = now
        self.next_mid = 1
        #: Persistent sessions without a connection (session expiry, the sweep of expired queued messages).
        self.offline: set[Session] = set()
        #: Sessions with a delayed Will Message pending.
        self.wills: set[Session] = set()
        #: Online sessions whose consumer acknowledges but falls behind: the I/O layer pauses reading from
        #: publishers while this is non-empty (flow control, so backlogs and latency stay bounded).
        self.congested: set[Session] = set()
        #: Called with every Application Message a client (or its Will) published, before the publisher's
        #: acknowledgement is registered, so durable work they record joins the same commit (the upstream
        #: bridge's outbox, gateway/upstream/). Not called for messages without a sender ($SYS).
        #: Upstream hooks: each sees every client-originated message and returns True when it took it.
        self.forwarders: list[Callable[[Message, float], bool]] = []
        #: Protocol errors, refusals and limits hit are logged at most once a minute per client and reason.
        self.rlog = RateLimitedLog(log)
        #: Sessions with a Session Expiry Interval > 0 held, online and offline (``max_sessions``).
        self.persistent_count = 0
        #: Connected clients per listener name (``max_connections``).
        self.listener_clients: Counter[str] = Counter()
        self.next_sys = now
        self.next_sweep = now
        #: Some listener has an ``acl_file``: routing checks ``read`` for subscriptions decided PARTIAL
        #: (:mod:`gateway.broker.access_decisions`); False costs routing nothing.
        self.read_checks = any(a.acl is not None for a in self.settings.access.values())
        #: Connections whose CONNECT is held by the failure throttle (``Connection.held_until``).
        self.held: set[Connection] = set()
        #: One str per topic name shared by queued messages (memory).
        self.topics: dict[str, str] = {}
        #: The encoded PUBLISH variants of the message last sent (output.write_publish).
        self.enc_mid = 0
        self.enc_cache: dict[tuple[int, int, bool], tuple[bytes, bytes]] = {}
        #: Acknowledgements waiting for their commit barrier, in barrier order (:mod:`gateway.broker.barriers`):
        #: ``(barrier, owns changes, Ack, connection, a, b)``.
        self.held_acks: deque[tuple[int, bool, int, Connection, Any, Any]] = deque()
        #: The id of the next commit barrier.
        self.next_barrier = 1
        #: A barrier of the input being handled owns changes: the later ones of the same input do too.
        self.input_owns = False

    def new_mid(self) -> int:
        """The next broker-unique message id (increasing in arrival order: the store's key)."""
        mid = self.next_mid
        self.next_mid = mid + 1
        return mid
