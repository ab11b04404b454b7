"""The broker core: one handler per control packet, routing, sessions, wills, timers. Sans-I/O.

The I/O layer calls :meth:`Broker.open` for a new Network Connection, :meth:`Broker.receive` with the bytes it
read, :meth:`Broker.connection_lost` when the peer went away and :meth:`Broker.tick` about once a second. The
broker appends encoded packets to ``Connection.out`` and records the connection in :attr:`Broker.dirty`; the I/O
layer writes each dirty connection's output in one call per loop turn and closes those with
``close_after_flush``. ``now`` is always wall-clock seconds (``time.time()``), so expiry survives restarts.

Sources: MQTT 3.1.1 and 5.0 (OASIS), seeds 000-004 (Inflight Window, Message Queue, QoS flows, offline
messages), DESIGN.md §3.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from gateway import __version__
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.message import AWAIT_COMP, Delivery, Message
from gateway.broker.ratelog import RateLimitedLog, peer_host
from gateway.broker.routing import RetainedMessages, SubscriptionRecord, SubscriptionTree
from gateway.broker.session import AWAITING_CONNECT, CLOSED, CONNECTED, NEVER, Connection, Session
from gateway.broker.store import MemoryStore, SessionStore
from gateway.mqtt.errors import MQTTError, ProtocolError, UnsupportedProtocolVersion
from gateway.mqtt.packets import (
    MQTT_3_1,
    MQTT_5,
    PACKET_NAMES,
    Auth,
    Connack,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
    encode_publish_parts,
)
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import CONNACK_311, ReasonCode
from gateway.mqtt.topics import parse_shared, require_topic, topic_filter_error, topic_name_error

log = logging.getLogger("gateway.broker")

RC = ReasonCode

#: Flow control: an online session is congested when its Message Queue holds at least this many messages (or
#: 2x its Inflight Window) while its client still acknowledges; publishers are paused until it drains to one
#: window. A client silent for STALLED_AFTER seconds is not waited for.
CONGESTION_MIN = 64
STALLED_AFTER = 1.0
#: Acknowledgements handled before the messages they let into the window are written out (see Broker.write_now).
ACK_RUN_PART = 8

#: "No Subscription Identifiers": one shared list, never mutated.
NO_IDS: list[int] = []

# Properties a PUBLISH carries from the publisher to subscribers (MQTT 5.0 §3.3.2.3).
_STRIP_ON_RECEIVE = (P.TOPIC_ALIAS, P.SUBSCRIPTION_IDENTIFIER)


class Stats:
    """Broker counters (``$SYS/broker/...``): messages in/out, drops by reason, connections."""

    __slots__ = (
        "bytes_received",
        "clients_connected",
        "clients_maximum",
        "connections_total",
        "dropped",
        "messages_received",
        "messages_sent",
        "publish_received",
        "publish_sent",
        "refused",
    )

    def __init__(self) -> None:
        self.messages_received = 0
        self.messages_sent = 0
        self.publish_received = 0
        self.publish_sent = 0
        self.bytes_received = 0
        self.clients_connected = 0
        self.clients_maximum = 0
        self.connections_total = 0
        self.dropped: Counter[str] = Counter()
        #: Requests refused by a limit, by limit name (``$SYS/broker/refused/<name>``): CONNECTs past
        #: ``max_sessions``, Topic Filters past ``max_subscriptions``, connections closed by ``send_timeout``.
        self.refused: Counter[str] = Counter()


class Broker:
    """An MQTT 3.1.1 + 5.0 broker as a state machine: bytes in, packets out, no I/O.

    Args:
        settings: broker-wide settings and per-zone limits.
        store: where persistent sessions and retained messages are recorded (default: memory only).
        now: wall-clock seconds at start.
    """

    def __init__(self, settings: BrokerSettings | None = None, store: SessionStore | None = None, now: float = 0.0):
        self.settings = settings or BrokerSettings()
        self.store: SessionStore = store or MemoryStore()
        self.sessions: dict[str, Session] = {}
        self.connections: set[Connection] = set()
        self.tree = SubscriptionTree()
        self.retained = RetainedMessages()
        self.dirty: set[Connection] = set()
        self.stats = Stats()
        self.started_at = now
        self._next_mid = 1
        self._offline: set[Session] = set()
        self._wills: set[Session] = set()
        #: Online sessions whose consumer acknowledges but falls behind: the I/O layer pauses reading from
        #: publishers while this is non-empty (flow control, so backlogs and latency stay bounded).
        self.congested: set[Session] = set()
        #: Called with every Application Message a client (or its Will) published, before the publisher's
        #: acknowledgement is registered, so durable work they record joins the same commit (the upstream
        #: bridge's outbox, gateway/upstream/). Not called for messages without a sender ($SYS).
        #: Upstream hooks: each sees every client-originated message and returns True when it took it.
        self.forwarders: list[Callable[[Message, float], bool]] = []
        #: Set by the I/O layer: write a connection's pending output now instead of at the end of the loop turn.
        #: Called between parts of a long run of acknowledgements, so the client works on the first messages
        #: that refilled its window while the broker prepares the rest.
        self.write_now: Callable[[Connection], None] | None = None
        self._next_sys = now
        self._next_sweep = now
        #: Protocol errors, refusals and limits hit are logged at most once a minute per client and reason.
        self.rlog = RateLimitedLog(log)
        #: Sessions with a Session Expiry Interval > 0 held, online and offline (``max_sessions``).
        self.persistent_count = 0
        self._enc_mid = 0
        self._topics: dict[str, str] = {}  # one str per topic name shared by queued messages (memory)
        self._enc_cache: dict[tuple[int, int, bool], tuple[bytes, bytes]] = {}
        self._handlers: dict[int, Callable[[Connection, Any, float], None]] = {
            3: self._on_publish,
            4: self._on_puback,
            5: self._on_pubrec,
            6: self._on_pubrel,
            7: self._on_pubcomp,
            8: self._on_subscribe,
            10: self._on_unsubscribe,
            12: self._on_pingreq,
            14: self._on_disconnect,
            15: self._on_auth,
        }
        self._restore(now)

    # ------------------------------------------------------------------------------------------ lifecycle

    def _restore(self, now: float) -> None:
        state = self.store.load(now)
        self._next_mid = max(self._next_mid, state.next_mid)
        for message in state.retained:
            self.retained.set(message)
        for session in state.sessions:
            self.sessions[session.client_id] = session
            self.persistent_count += session.persistent
            for record in session.subscriptions.values():
                self.tree.add(record)
            if session.expires_at is None and session.expiry_interval != NEVER:
                session.expires_at = now + session.expiry_interval
            self._offline.add(session)
            if session.will is not None and session.will_at is not None:
                self._wills.add(session)
        if state.sessions or state.retained:
            log.info(
                "restored %d persistent sessions and %d retained messages from the store",
                len(state.sessions),
                len(state.retained),
            )

    def open(self, limits: ZoneLimits, listener: str, peer: str, now: float) -> Connection:
        """Register a new Network Connection accepted on ``listener`` from ``peer``."""
        conn = Connection(limits, listener, peer, now)
        self.connections.add(conn)
        self.stats.connections_total += 1
        return conn

    def receive(self, conn: Connection, data: bytes, now: float) -> None:
        """Handle bytes read from ``conn``: decode whole packets and act on each, in order."""
        if conn.state == CLOSED:
            return
        conn.last_rx = now
        self.stats.bytes_received += len(data)
        if data and data[0] == 0x40 and conn.state == CONNECTED:
            pids, used = conn.reader.leading_pubacks(data)
            if pids:
                self._on_pubacks(conn, pids, now)
                if used == len(data) or conn.state == CLOSED:
                    return
                data = data[used:]
        try:
            for packet in conn.reader.feed(data):
                self.stats.messages_received += 1
                if conn.state == CONNECTED:
                    handler = self._handlers.get(packet.TYPE)
                    if handler is None:
                        if packet.TYPE == 1:
                            raise ProtocolError("a second CONNECT on the same connection [MQTT-3.1.0-2]")
                        raise ProtocolError(f"a client must not send {PACKET_NAMES[packet.TYPE]}")
                    handler(conn, packet, now)
                elif conn.state == AWAITING_CONNECT:
                    if not isinstance(packet, Connect):
                        self.rlog.info(now, peer_host(conn.peer), "not_connect",
                                       "%s: first packet is %s, not CONNECT; closing [MQTT-3.1.0-1]", conn.peer,
                                       PACKET_NAMES[packet.TYPE])
                        self._close(conn, now, publish_will=False)
                        return
                    self._on_connect(conn, packet, now)
                else:
                    return
        except UnsupportedProtocolVersion as exc:
            self._unsupported_version(conn, exc, now)
        except MQTTError as exc:
            self._protocol_error(conn, exc, now)

    def connection_lost(self, conn: Connection, now: float) -> None:
        """The Network Connection closed (by the peer, or after the broker asked)."""
        self.connections.discard(conn)
        self.dirty.discard(conn)
        if conn.state != CLOSED:
            conn.state = CLOSED
            self._detach(conn, now, publish_will=True)

    def pause_writing(self, conn: Connection, now: float) -> None:
        """The connection's socket write buffer passed ``high_watermark``: QoS 0 messages to it are dropped and
        QoS 1/2 wait in its Message Queue (bounded by ``max_mqueue_len`` and ``max_mqueue_bytes``) instead of the
        socket buffer, so a slow subscriber cannot grow the broker's memory without bound; if it stays so for
        ``send_timeout`` seconds the connection is closed (:meth:`tick`)."""
        conn.paused = True
        conn.paused_at = now

    def resume_writing(self, conn: Connection, now: float) -> None:
        """The socket drained below its low-water mark: send what waited."""
        conn.paused = False
        session = conn.session
        if session is not None and session.conn is conn:
            self._pump(session, now)

    def shutdown(self, now: float) -> None:
        """Server shutting down: DISCONNECT 0x8B to 5.0 clients, close every connection (MQTT 5.0 §3.14)."""
        for conn in list(self.connections):
            if conn.state == CONNECTED and conn.version == MQTT_5:
                self._send(conn, Disconnect(RC.SERVER_SHUTTING_DOWN))
            self._close(conn, now, publish_will=False)

    # ------------------------------------------------------------------------------------------- output

    def _send(self, conn: Connection, packet: Any) -> None:
        data = packet.encode(conn.version)
        limit = conn.max_packet_size
        if limit is not None and len(data) > limit:
            props = getattr(packet, "properties", None)
            if props:
                # Reason String and User Properties are dropped first [MQTT-3.1.2-25]..
                props.pop(P.REASON_STRING, None)
                props.pop(P.USER_PROPERTY, None)
                data = packet.encode(conn.version)
            if len(data) > limit:
                self.stats.dropped["packet_too_large"] += 1
                return
        conn.out.append(data)
        self.stats.messages_sent += 1
        self.dirty.add(conn)

    def _close(self, conn: Connection, now: float, publish_will: bool) -> None:
        """Close ``conn`` once its output is written; detach its session."""
        if conn.state == CLOSED:
            return
        conn.state = CLOSED
        conn.close_after_flush = True
        self.dirty.add(conn)
        self._detach(conn, now, publish_will)

    def _protocol_error(self, conn: Connection, exc: MQTTError, now: float) -> None:
        code = exc.reason_code
        self.rlog.warning(now, peer_host(conn.peer), code.name, "%s (%s): %s; closing with reason code 0x%02X %s",
                          conn.peer, conn.client_id or "-", exc, code, code.name)
        self.stats.dropped["protocol_error"] += 1
        if conn.version == MQTT_5:
            props = {P.REASON_STRING: str(exc)[:200]}
            if conn.state == CONNECTED:
                self._send(conn, Disconnect(code, props))
            elif conn.state == AWAITING_CONNECT and conn.reader.version == MQTT_5:
                self._send(conn, Connack(False, code, props))
        self._close(conn, now, publish_will=True)

    def _unsupported_version(self, conn: Connection, exc: UnsupportedProtocolVersion, now: float) -> None:
        self.rlog.warning(now, peer_host(conn.peer), "unsupported_version", "%s: %s", conn.peer, exc)
        if exc.level == MQTT_5:
            self._send_raw(conn, Connack(False, RC.UNSUPPORTED_PROTOCOL_VERSION).encode(MQTT_5))
        elif exc.level is not None:
            # The 3.1.1 CONNACK with return code 0x01 [MQTT-3.1.2-2].
            self._send_raw(conn, Connack(False, 0x01).encode(4))
        self._close(conn, now, publish_will=False)

    def _send_raw(self, conn: Connection, data: bytes) -> None:
        conn.out.append(data)
        self.dirty.add(conn)

    # ------------------------------------------------------------------------------------------ CONNECT

    def _refuse(self, conn: Connection, reason: RC, message: str, now: float) -> None:
        self.rlog.warning(now, peer_host(conn.peer), "refused_" + reason.name, "%s: CONNECT refused (0x%02X %s): %s",
                          conn.peer, reason, reason.name, message)
        if conn.version == MQTT_5:
            self._send(conn, Connack(False, reason, {P.REASON_STRING: message[:200]}))
        elif reason in CONNACK_311:
            self._send(conn, Connack(False, CONNACK_311[reason]))
        self._close(conn, now, publish_will=False)

    def _on_connect(self, conn: Connection, p: Connect, now: float) -> None:
        v5 = p.protocol_level == MQTT_5
        conn.version = MQTT_5 if v5 else 4
        limits = conn.limits
        props = p.properties
        if v5:
            # Also bounds a refusal CONNACK's Reason String [MQTT-3.2.2-19].
            conn.max_packet_size = props.get(P.MAXIMUM_PACKET_SIZE)
        if P.AUTHENTICATION_METHOD in props:
            self._refuse(conn, RC.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported", now)
            return
        client_id = p.client_id
        assigned = None
        if not client_id:
            if p.protocol_level == MQTT_3_1:
                # MQTT 3.1 §3.1: a Client Identifier is 1 to 23 characters; none is ever assigned by the server.
                reason = "MQTT 3.1 needs a Client Identifier of 1 to 23 characters (3.1.1 MQTT-3.1.3-9)"
                self._refuse(conn, RC.CLIENT_IDENTIFIER_NOT_VALID, reason, now)
                return
            if not v5 and not p.clean_start:
                # [MQTT-3.1.3-8]: a zero-byte ClientId needs CleanSession = 1.
                self._refuse(conn, RC.CLIENT_IDENTIFIER_NOT_VALID,
                             "an empty Client Identifier requires Clean Session = 1 [MQTT-3.1.3-8]", now)
                return
            client_id = "auto-" + secrets.token_hex(8)
            if v5:
                assigned = client_id
        elif len(client_id) > limits.max_clientid_len or (
                4 * len(client_id) > limits.max_clientid_len
                and len(client_id.encode("utf-8")) > limits.max_clientid_len):
            self._refuse(conn, RC.CLIENT_IDENTIFIER_NOT_VALID,
                         f"Client Identifier longer than max_clientid_len = {limits.max_clientid_len} bytes", now)
            return
        will = p.will
        if will is not None:
            try:
                require_topic(will.topic, "Will Topic")
                if v5 and P.RESPONSE_TOPIC in will.properties:
                    require_topic(will.properties[P.RESPONSE_TOPIC], "Will Response Topic")
            except ProtocolError as exc:  # [MQTT-4.7.3-1]: 5.0 CONNACK 0x82; 3.1.1 has no return code: closed
                self._refuse(conn, exc.reason_code, str(exc), now)
                return
            error = topic_name_error(will.topic) or _levels_error(will.topic, limits.max_topic_levels)
            if error:
                if v5:
                    self._refuse(conn, RC.TOPIC_NAME_INVALID, f"Will Topic: {error}", now)
                else:
                    log.warning("%s: invalid Will Topic %r: %s; closing", conn.peer, will.topic, error)
                    self._close(conn, now, publish_will=False)
                return
            if v5 and will.properties.get(P.PAYLOAD_FORMAT_INDICATOR) == 1 and not _is_utf8(will.payload):
                self._refuse(conn, RC.PAYLOAD_FORMAT_INVALID, "Will Payload is not UTF-8 (MQTT 5.0 §3.1.3.2.3)", now)
                return
            if v5 and will.retain and not self.settings.retain_available:
                self._refuse(conn, RC.RETAIN_NOT_SUPPORTED, "Will Retain 1, but retained messages are not "
                             "supported [MQTT-3.2.2-13]", now)
                return

        # Session Expiry Interval: 5.0 from the CONNECT (capped), 3.1.1 from Clean Session.
        requested: float
        if v5:
            requested = props.get(P.SESSION_EXPIRY_INTERVAL, 0)
        else:
            requested = 0 if p.clean_start else NEVER
        granted = requested
        max_expiry = limits.session_expiry_interval
        if requested and requested > max_expiry and max_expiry >= 0:
            granted = max_expiry
        if not v5 and granted == NEVER:
            granted = max_expiry

        session = self.sessions.get(client_id)
        max_sessions = self.settings.max_sessions
        if session is None and granted and max_sessions and self.persistent_count >= max_sessions:
            # A new persistent session past the cap; resuming or taking over an existing one is always allowed,
            # and nothing of any other client is touched (issue 13).
            self.stats.refused["max_sessions"] += 1
            self._refuse(conn, RC.QUOTA_EXCEEDED, f"max_sessions = {max_sessions} persistent sessions reached", now)
            return

        # Session takeover [MQTT-3.1.4-2] (5.0: DISCONNECT 0x8E [MQTT-3.1.4-3]).
        if session is not None and session.conn is not None:
            old = session.conn
            log.info("%s: client %r takes over the session from %s", conn.peer, client_id, old.peer)
            if old.version == MQTT_5:
                self._send(old, Disconnect(RC.SESSION_TAKEN_OVER))
            self._close(old, now, publish_will=True)
            session = self.sessions.get(client_id)
        if session is not None and session.conn is None and session.expires_at is not None \
                and now >= session.expires_at:
            # Expired since the last tick: the Session State is gone [MQTT-4.1.0-2] (5.0).
            log.info("session %r expired", client_id)
            self.stats.dropped["session_expired"] += 1
            self._end_session(session, now)
            session = None

        session_present = False
        if session is not None and p.clean_start:
            # Clean Start discards the existing session [MQTT-3.1.2-4].
            self._end_session(session, now)
            session = None
        if session is not None:
            session_present = True
            self._offline.discard(session)
            session.expires_at = None
            if session.will_at is not None:
                # A new connection before the Will Delay Interval passed: no Will [MQTT-3.1.3-9].
                session.will = None
                session.will_at = None
                self._wills.discard(session)
        else:
            session = Session(client_id, limits)
            self.sessions[client_id] = session
        was_persistent = session.persistent
        session.expiry_interval = granted
        self.persistent_count += session.persistent - was_persistent
        session.protocol_level = conn.version
        if session.limits is not limits:
            session.limits = limits
            session.mqueue.max_len = limits.max_mqueue_len
            session.mqueue.max_bytes = limits.max_mqueue_bytes
        if session.persistent:
            self.store.session_saved(session)
            if session.mqueue.pager is None:
                paging = self.store.pager(client_id)
                if paging is not None:
                    session.mqueue.enable_paging(*paging)
        elif was_persistent:
            session.mqueue.page_in_all()  # its store rows go now; the queue lives on in memory
            self.store.session_deleted(client_id)

        conn.session = session
        conn.client_id = client_id
        session.conn = conn
        conn.will = will
        conn.state = CONNECTED
        conn.connected_at = now
        keep_alive = p.keep_alive
        server_keep_alive = None
        if v5 and limits.max_keepalive and (keep_alive == 0 or keep_alive > limits.max_keepalive):
            keep_alive = server_keep_alive = limits.max_keepalive
        conn.keep_alive = keep_alive
        if v5:
            conn.window = limits.window(props.get(P.RECEIVE_MAXIMUM, 65535))
            conn.max_packet_size = props.get(P.MAXIMUM_PACKET_SIZE)
            conn.topic_alias_max = props.get(P.TOPIC_ALIAS_MAXIMUM, 0)
            conn.request_problem_info = props.get(P.REQUEST_PROBLEM_INFORMATION, 1) == 1
        else:
            conn.window = limits.window(None)
        self.stats.clients_connected += 1
        self.stats.clients_maximum = max(self.stats.clients_maximum, self.stats.clients_connected)

        ack_props: dict[int, Any] = {}
        if v5:
            if assigned is not None:
                ack_props[P.ASSIGNED_CLIENT_IDENTIFIER] = assigned
            if server_keep_alive is not None:
                ack_props[P.SERVER_KEEP_ALIVE] = server_keep_alive
            if granted != requested:
                ack_props[P.SESSION_EXPIRY_INTERVAL] = int(granted)
            if limits.max_awaiting_rel < 65535:
                ack_props[P.RECEIVE_MAXIMUM] = limits.max_awaiting_rel
            ack_props[P.MAXIMUM_PACKET_SIZE] = limits.max_packet_size
            if limits.topic_alias_maximum:
                ack_props[P.TOPIC_ALIAS_MAXIMUM] = limits.topic_alias_maximum
            if not self.settings.retain_available:
                ack_props[P.RETAIN_AVAILABLE] = 0
        log.debug("%s: %r connected (v%d, clean_start=%s, keep_alive=%d, session_present=%s)", conn.peer,
                  client_id, p.protocol_level, p.clean_start, keep_alive, session_present)
        # MQTT 3.1 has no Session Present flag: the first CONNACK byte is reserved, 0 (the session is resumed).
        self._send(conn, Connack(session_present and p.protocol_level != MQTT_3_1, 0, ack_props))

        # Resume: re-send unacknowledged PUBLISH with DUP=1 and PUBREL, in order [MQTT-4.4.0-1].
        for delivery in list(session.inflight.values()):
            if delivery.state == AWAIT_COMP:
                self._send(conn, PubRel(delivery.packet_id))
            else:
                delivery.sent_at = now
                if not self._write_publish(conn, delivery.message, delivery.qos, delivery.retain,
                                           delivery.packet_id, True, delivery.sub_ids, now):
                    self._finish(session, delivery)
        self._pump(session, now)

    # ------------------------------------------------------------------------------------------ PUBLISH in

    def _on_publish(self, conn: Connection, p: Publish, now: float) -> None:
        session = conn.session
        assert session is not None
        topic = p.topic
        props = p.properties
        v5 = conn.version == MQTT_5
        if v5 and props:
            alias = props.get(P.TOPIC_ALIAS)
            if alias is not None:
                if alias > conn.limits.topic_alias_maximum:
                    raise MQTTError(RC.TOPIC_ALIAS_INVALID,
                                    f"Topic Alias {alias} above the Topic Alias Maximum "
                                    f"{conn.limits.topic_alias_maximum} [MQTT-3.3.2-9]")
                if topic:
                    conn.aliases_in[alias] = topic
                else:
                    known = conn.aliases_in.get(alias)
                    if known is None:
                        raise ProtocolError(f"Topic Alias {alias} used before it was set (MQTT 5.0 §3.3.2.3.4)")
                    topic = known
            if P.SUBSCRIPTION_IDENTIFIER in props:
                raise ProtocolError("a PUBLISH from a Client must not carry a Subscription Identifier "
                                    "[MQTT-3.3.4-6]")
            if alias is not None:
                props = {k: v for k, v in props.items() if k not in _STRIP_ON_RECEIVE}
            response_topic = props.get(P.RESPONSE_TOPIC)
            # One pass, as before: topic_name_error holds the MQTT-4.7.3-1 rule too (no second call per message).
            if response_topic is not None and (bad := topic_name_error(response_topic)):
                raise ProtocolError(f"Response Topic {response_topic!r}: {bad} [MQTT-3.3.2-14]")
        if not topic:
            require_topic(topic, "PUBLISH Topic Name (with no Topic Alias, MQTT-3.3.2-1)")
        qos = p.qos
        pid = p.packet_id
        self.stats.publish_received += 1

        if qos == 2 and pid in session.awaiting_rel:
            # A re-sent QoS 2 PUBLISH for an identifier awaiting PUBREL: a duplicate (seed 003).
            self.stats.dropped["qos2_duplicate"] += 1
            self.store.when_durable(lambda: self._ack(conn, PubRec(pid)))  # type: ignore[arg-type]
            return
        if qos and conn.inbound_pending + len(session.awaiting_rel) >= conn.limits.max_awaiting_rel:
            raise MQTTError(RC.RECEIVE_MAXIMUM_EXCEEDED,
                            f"more than Receive Maximum ({conn.limits.max_awaiting_rel}) QoS 1/2 PUBLISH "
                            "awaiting acknowledgement [MQTT-3.3.4-7]")
        if v5 and props.get(P.PAYLOAD_FORMAT_INDICATOR) == 1 and not _is_utf8(p.payload):
            self._reject_publish(conn, p, RC.PAYLOAD_FORMAT_INVALID, "payload is not UTF-8 as its Payload "
                                 "Format Indicator says")
            return
        if topic == "$SYS" or topic.startswith("$SYS/"):
            self._reject_publish(conn, p, RC.NOT_AUTHORIZED, "clients may not publish to $SYS topics")
            return
        max_levels = conn.limits.max_topic_levels
        if max_levels and topic.count("/") >= max_levels:
            self._reject_publish(conn, p, RC.TOPIC_NAME_INVALID, str(_levels_error(topic, max_levels)),
                                 counter="max_topic_levels")
            return
        if p.retain and not self.settings.retain_available:
            raise MQTTError(RC.RETAIN_NOT_SUPPORTED, "retained messages are not supported (MQTT 5.0 §3.2.2.3.5)")
        if qos and not self.store.has_room(conn.client_id):
            self._refuse_unstored(conn, p, True, now)
            return

        expires_at = None
        if v5:
            expiry = props.get(P.MESSAGE_EXPIRY_INTERVAL)
            if expiry is not None:
                expires_at = now + expiry
        interned = self._topics.get(topic)
        if interned is None:
            if len(self._topics) >= 10_000:
                self._topics.clear()
            interned = self._topics[topic] = topic
        message = Message(self._mid(), interned, p.payload, qos, p.retain, props, now, expires_at, conn.client_id)
        if qos == 0:
            self._publish(message, now)
        elif qos == 1:
            matched = self._publish(message, now)
            conn.inbound_pending += 1
            reason = RC.NO_MATCHING_SUBSCRIBERS if v5 and not matched else 0
            self.store.when_durable(partial(self._puback, conn, pid, reason),
                                    partial(self._publish_failed, conn, p, now, None))
        else:
            entry = session.awaiting_rel[pid] = (message, now)  # type: ignore[index]
            if session.persistent:
                self.store.inbound_saved(session.client_id, pid, message)  # type: ignore[arg-type]
            self.store.when_durable(lambda: self._ack(conn, PubRec(pid)),  # type: ignore[arg-type]
                                    partial(self._publish_failed, conn, p, now, entry))

    def _publish_failed(self, conn: Connection, p: Publish, now: float, entry: tuple[Message, float] | None,
                        full: bool) -> None:
        """The store could not commit what a QoS 1/2 PUBLISH caused (``when_durable``'s ``on_failure``; ``full``:
        for lack of room): refuse it instead of leaving the publisher waiting (DESIGN.md §4). The Receive Maximum
        count is given back, and a QoS 2 identifier is released so that the client's retry is taken as new."""
        if p.qos == 1:
            conn.inbound_pending -= 1
        elif conn.session is not None and conn.session.awaiting_rel.get(p.packet_id) is entry:  # type: ignore[arg-type]
            del conn.session.awaiting_rel[p.packet_id]  # type: ignore[arg-type]
        self._refuse_unstored(conn, p, full, now)

    def _refuse_unstored(self, conn: Connection, p: Publish, full: bool, now: float) -> None:
        """Refuse a QoS 1/2 PUBLISH that cannot be made durable (DESIGN.md §4): MQTT 5 PUBACK/PUBREC 0x97 Quota
        exceeded when the store or its disk is full (else 0x80 Unspecified error, MQTT 5.0 §3.4.2.1); 3.1.1 has no
        way to refuse, so the publisher is not acknowledged and is disconnected. Counted per message in
        ``$SYS/broker/messages/dropped/store_full`` (``store_error``); logged at most once a minute per client
        address."""
        counter = "store_full" if full else "store_error"
        if conn.state != CONNECTED:
            self.stats.dropped[counter] += 1  # gone meanwhile: nothing to answer
        elif conn.version == MQTT_5:
            if full:
                self._reject_publish(conn, p, RC.QUOTA_EXCEEDED, "the message store is full", counter=counter)
            else:
                self._reject_publish(conn, p, RC.UNSPECIFIED_ERROR, "the message could not be stored",
                                     counter=counter)
        else:
            self.stats.dropped[counter] += 1
            self.rlog.error(now, peer_host(conn.peer), counter + "_disconnect",
                            "%s (%s): %s; QoS %d PUBLISH not acknowledged, disconnecting", conn.peer, conn.client_id,
                            "store full" if full else "store write failed", p.qos)
            self._close(conn, now, publish_will=False)

    def store_change_failed(self, client_ids: set[str], now: float) -> None:
        """The store left changes of these clients out of a commit because they failed on their own (the rest of
        the batch was committed; ``LmdbStore.on_change_failed``). Their connections are closed before that
        commit's acknowledgements run, so nothing of theirs that was not written is acknowledged (DESIGN.md §4):
        MQTT 5 DISCONNECT 0x80 Unspecified error with a Reason String (MQTT 5.0 §3.14.2.1), 3.1.1 just closed."""
        for client_id in client_ids:
            session = self.sessions.get(client_id)
            conn = session.conn if session is not None else None
            if conn is None or conn.state != CONNECTED:
                continue
            log.error("%s (%s): the store could not write a change of this client; closing its connection",
                      conn.peer, client_id[:200])
            if conn.version == MQTT_5:
                self._send(conn, Disconnect(RC.UNSPECIFIED_ERROR,
                                            {P.REASON_STRING: "the server could not store this client's state"}))
            self._close(conn, now, publish_will=True)

    def _reject_publish(self, conn: Connection, p: Publish, reason: RC, text: str, counter: str | None = None) -> None:
        counter = counter or reason.name.lower()
        self.stats.dropped[counter] += 1  # one refused message, one drop reason
        self.rlog.warning(conn.last_rx, peer_host(conn.peer), "publish_" + counter,
                          "%s (%s): PUBLISH to %r refused: %s (0x%02X)", conn.peer, conn.client_id, p.topic[:200],
                          text, reason)
        if p.qos == 1:
            self._send(conn, PubAck(p.packet_id, reason if conn.version == MQTT_5 else 0))  # type: ignore[arg-type]
        elif p.qos == 2:
            self._send(conn, PubRec(p.packet_id, reason if conn.version == MQTT_5 else 0))  # type: ignore[arg-type]

    def _puback(self, conn: Connection, pid: int, reason: int) -> None:
        """PUBACK a QoS 1 PUBLISH once its work is durable (DESIGN.md §4); the common one (reason 0, MQTT 5.0
        §3.4.2.1: then the Reason Code may be left out) is built here, without a packet object."""
        conn.inbound_pending -= 1
        if conn.state != CONNECTED:
            return
        if reason or (conn.max_packet_size is not None and conn.max_packet_size < 4):
            self._send(conn, PubAck(pid, reason))
            return
        conn.out.append(bytes((0x40, 2, pid >> 8, pid & 0xFF)))
        self.stats.messages_sent += 1
        self.dirty.add(conn)

    def _ack(self, conn: Connection, packet: PubAck | PubRec | PubComp) -> None:
        """Send an acknowledgement once its work is durable (DESIGN.md §4)."""
        if isinstance(packet, PubAck):
            conn.inbound_pending -= 1
        if conn.state == CONNECTED:
            self._send(conn, packet)

    def _on_pubrel(self, conn: Connection, p: PubRel, now: float) -> None:
        session = conn.session
        assert session is not None
        entry = session.awaiting_rel.pop(p.packet_id, None)
        reason = 0
        if entry is not None:
            if session.persistent:
                self.store.inbound_deleted(session.client_id, p.packet_id)
            if entry[0].expired(now):
                # Expired before onward delivery started: no copy for anyone [MQTT-3.3.2-5]; the flow still
                # completes with PUBCOMP 0x00 [MQTT-4.3.3-13].
                self.stats.dropped["expired"] += 1
            else:
                self._publish(entry[0], now)
        elif conn.version == MQTT_5:
            # PUBCOMP also for an unknown identifier (seed 003), 5.0 with 0x92 (MQTT 5.0 §3.7.2.1).
            reason = RC.PACKET_IDENTIFIER_NOT_FOUND
        self.store.when_durable(lambda: self._ack(conn, PubComp(p.packet_id, reason)))

    # ------------------------------------------------------------------------------------------ routing

    def _mid(self) -> int:
        mid = self._next_mid
        self._next_mid = mid + 1
        return mid

    def publish_local(self, topic: str, payload: bytes, qos: int, retain: bool, properties: Any, now: float,
                      sender: str | None = None, expires_at: float | None = None) -> Message:
        """Publish a message that did not arrive on a client connection (the upstream bridge's downlink and its
        ``$SYS`` values), routed like any PUBLISH; the I/O layer flushes afterwards. ``sender`` names the origin
        (``$upstream/<name>`` for the downlink, so the bridge never forwards it back up)."""
        message = Message(self._mid(), topic, payload, qos, retain, properties, now, expires_at, sender)
        self._publish(message, now)
        return message

    def _publish(self, message: Message, now: float) -> int:
        """Route ``message`` to every matching subscription and upstream forwarder; return how many took it."""
        count = 0
        if self.forwarders and message.sender is not None:
            for forward in self.forwarders:
                if forward(message, now):
                    count += 1
        if message.retain:
            self._retain(message)
        subs, groups = self.tree.match(message.topic)
        if not subs and not groups:
            return count
        sender = message.sender
        if len(subs) == 1 and not groups:
            rec = subs[0]
            if rec.no_local and rec.client_id == sender:
                return count
            session = self.sessions[rec.client_id]
            self._deliver(session, message, min(message.qos, rec.qos),
                          message.retain and rec.retain_as_published,
                          [rec.sub_id] if rec.sub_id is not None else NO_IDS, now)
            return count + 1
        # Overlapping subscriptions of one client: one copy at the highest QoS, carrying every matching
        # Subscription Identifier [MQTT-3.3.4-2] [MQTT-3.3.4-3].
        targets: dict[str, list[Any]] = {}
        for rec in subs:
            if rec.no_local and rec.client_id == sender:
                continue  # No Local [MQTT-3.8.3-3]
            target = targets.get(rec.client_id)
            if target is None:
                targets[rec.client_id] = [rec.qos, rec.retain_as_published,
                                          [rec.sub_id] if rec.sub_id is not None else []]
            else:
                if rec.qos > target[0]:
                    target[0] = rec.qos
                target[1] = target[1] or rec.retain_as_published
                if rec.sub_id is not None:
                    target[2].append(rec.sub_id)
        for client_id, (qos, rap, sub_ids) in targets.items():
            self._deliver(self.sessions[client_id], message, min(message.qos, qos), message.retain and rap,
                          sub_ids, now)
            count += 1
        for group in groups:
            rec = self._pick_shared(group)
            if rec is None:
                continue
            self._deliver(self.sessions[rec.client_id], message, min(message.qos, rec.qos), False,
                          [rec.sub_id] if rec.sub_id is not None else NO_IDS, now)
            count += 1
        return count

    def _pick_shared(self, group: Any) -> SubscriptionRecord | None:
        """Round robin over a shared group's members, online ones first (MQTT 5.0 §4.8.2)."""
        members = list(group.members.values())
        if not members:
            return None
        n = len(members)
        start = group.cursor % n
        for i in range(n):
            rec = members[(start + i) % n]
            session = self.sessions.get(rec.client_id)
            if session is not None and session.conn is not None:
                group.cursor = start + i + 1
                return rec
        group.cursor = start + 1
        return members[start]

    def _retain(self, message: Message) -> None:
        stored = self.settings.retain_available
        if not stored:
            return
        self.retained.set(message)
        if message.topic.startswith("$SYS/"):
            return
        if message.payload and (message.qos or self.store.has_room(None)):
            self.store.retained_saved(message)
        else:
            # Cleared, or a QoS 0 retained message while the store is full: it must not overflow the store (QoS 0
            # is never refused), so it is kept in memory only and the stale one on disk is removed (DESIGN.md §4).
            self.store.retained_deleted(message.topic)

    def _deliver(self, session: Session, message: Message, qos: int, retain: bool, sub_ids: list[int],
                 now: float) -> None:
        """Give ``message`` to ``session`` at ``qos``: out now, into the Inflight Window, or into the Message
        Queue (seed 000: QoS 0 to an online client bypasses both)."""
        conn = session.conn
        if conn is not None and qos == 0:
            if conn.paused:
                # Its socket holds high_watermark bytes already: QoS 0 is at most once (issue 13).
                self.stats.dropped["high_watermark_qos0"] += 1
            else:
                self._write_publish(conn, message, 0, retain, 0, False, sub_ids, now)
            return
        limits = session.limits
        if conn is None:
            if qos == 0 and not limits.mqueue_store_qos0:
                self.stats.dropped["qos0_offline"] += 1
                return
            expires_at = message.expires_at
            if expires_at is None and limits.message_expiry_interval:
                expires_at = now + limits.message_expiry_interval
        else:
            expires_at = message.expires_at
        delivery = Delivery(message, qos, retain, sub_ids, expires_at=expires_at)
        if conn is not None and qos and not conn.paused and not session.mqueue and len(session.inflight) < conn.window:
            self._send_new(session, conn, delivery, now)
            return
        self._enqueue(session, delivery)
        if conn is not None and len(session.mqueue) >= max(CONGESTION_MIN, 2 * conn.window) \
                and now - conn.last_ack_at < STALLED_AFTER:
            self.congested.add(session)

    def _enqueue(self, session: Session, delivery: Delivery) -> None:
        persistent = session.persistent
        if persistent and delivery.qos == 0 and not self.store.has_room(session.client_id):
            # QoS 0 is never refused to its publisher, so it must not fill a full store and make the writes
            # of acknowledged work fail (DESIGN.md §4): drop it for the offline session instead.
            self.stats.dropped["store_full_qos0"] += 1
            return
        mqueue = session.mqueue
        if persistent and (delivery.qos or session.limits.mqueue_store_qos0):
            self.store.delivery_saved(session.client_id, delivery)  # first: a stored entry may be paged out
        victim = mqueue.push(delivery)
        if victim is not None:
            self._queue_drop(session, victim, "mqueue_full", f"max_mqueue_len={mqueue.max_len}")
        while mqueue.over_quota():
            self._queue_drop(session, mqueue.drop_oldest(), "mqueue_quota", f"max_mqueue_bytes={mqueue.max_bytes}")

    def _queue_drop(self, session: Session, victim: Delivery, reason: str, limit: str) -> None:
        """Count, forget and (rate-limited) log a message the Message Queue dropped (seed 000)."""
        if victim.qos == 0:
            reason += "_qos0"
        count = self.stats.dropped[reason] = self.stats.dropped[reason] + 1
        if session.persistent:
            self.store.delivery_deleted(session.client_id, victim)
        if count in (1, 10, 100, 1000) or count % 10000 == 0:
            log.warning("Message Queue of %r full (%s): dropped the oldest %s message (%d so far)", session.client_id,
                        limit, "QoS 0" if victim.qos == 0 else f"QoS {victim.qos}", count)

    def queue_rows_lost(self, client_id: str, seqs: list[int]) -> None:
        """The store did not write these queue rows of ``client_id`` (their commit failed, or left them out;
        ``seqs`` are store sequence numbers; ``LmdbStore.on_queue_rows_lost``, issue 13 item 5). Their entries
        leave the Message Queue, counted as ``store_write_failed`` (``_qos0``) drops: their publishers are not
        acknowledged (DESIGN.md §4), and a queue that kept them would page them out as rows the store lacks."""
        session = self.sessions.get(client_id)
        if session is None:
            return
        for victim in session.mqueue.forget_unwritten(seqs):
            reason = "store_write_failed_qos0" if victim.qos == 0 else "store_write_failed"
            count = self.stats.dropped[reason] = self.stats.dropped[reason] + 1
            if count in (1, 10, 100, 1000) or count % 10000 == 0:
                log.warning(
                    "Message Queue of %r: dropped a QoS %d message whose store row could not be written (%d so far)",
                    client_id[:200],
                    victim.qos,
                    count,
                )

    def _send_new(self, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
        """Put ``delivery`` into the Inflight Window with a fresh Packet Identifier and send it.

        For a persistent session the Packet Identifier is recorded first; a QoS 2 PUBLISH goes out only once
        that is durable, so that after a crash the same identifier is re-sent and the receiver can recognise
        the duplicate (exactly once end to end, DESIGN.md §4)."""
        inflight = session.inflight
        pid = session.next_packet_id
        if pid in inflight:
            pid = session.allocate_packet_id()
        else:
            session.next_packet_id = pid % 65535 + 1  # allocate_packet_id's answer, without the call
        delivery.packet_id = pid
        delivery.sent_at = now
        inflight[pid] = delivery
        if session.persistent:
            self.store.delivery_saved(session.client_id, delivery)  # in flight, to re-send with DUP=1
            if delivery.qos == 2 or session.held_sends:
                # QoS 2 waits for that record; anything behind a held send waits too (FIFO, seed 000). A QoS 1
                # PUBLISH otherwise goes out at once: re-sent after a crash, it is a duplicate QoS 1 allows.
                session.held_sends += 1
                # Also sent when the commit fails (a full disk): the subscriber is served meanwhile; what is lost is
                # only that a crash before the next commit may re-send this QoS 2 PUBLISH under a new identifier.
                self.store.when_durable(lambda: self._send_durable(session, conn, delivery, now),
                                        lambda _full: self._send_durable(session, conn, delivery, now))
                return
        if not self._write_publish(conn, delivery.message, delivery.qos, delivery.retain, pid, False,
                                   delivery.sub_ids, now):
            self._finish(session, delivery)

    def _send_durable(self, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
        session.held_sends -= 1
        if conn.state != CONNECTED or session.inflight.get(delivery.packet_id) is not delivery:
            return
        if not self._write_publish(conn, delivery.message, delivery.qos, delivery.retain, delivery.packet_id,
                                   False, delivery.sub_ids, now):
            self._finish(session, delivery)

    def _send_held_qos0(self, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
        session.held_sends -= 1
        if conn.state == CONNECTED:
            self._write_publish(conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)

    def _pump(self, session: Session, now: float) -> None:
        """Move queued messages into the Inflight Window while it has room, FIFO (seed 000)."""
        conn = session.conn
        if conn is None:
            return
        mqueue = session.mqueue
        inflight = session.inflight
        window = conn.window
        persistent = session.persistent
        while mqueue and len(inflight) < window and not conn.paused:
            delivery = mqueue.pop()
            if delivery.expires_at is not None and now >= delivery.expires_at:
                self.stats.dropped["expired"] += 1
                if persistent:
                    self.store.delivery_deleted(session.client_id, delivery)
                continue
            if delivery.qos == 0:
                if persistent and session.held_sends:
                    # Behind a QoS 2 PUBLISH still waiting for its commit (FIFO, seed 000).
                    session.held_sends += 1
                    self.store.when_durable(lambda d=delivery: self._send_held_qos0(session, conn, d, now),
                                            lambda _full, d=delivery: self._send_held_qos0(session, conn, d, now))
                    self.store.delivery_deleted(session.client_id, delivery)
                elif persistent:
                    self._write_publish(conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)
                    self.store.delivery_deleted(session.client_id, delivery)
                else:
                    self._write_publish(conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)
                continue
            self._send_new(session, conn, delivery, now)
        if session in self.congested and len(mqueue) <= window:
            self.congested.discard(session)

    def _finish(self, session: Session, delivery: Delivery) -> None:
        """A delivery left the Inflight Window for good (acknowledged, refused or undeliverable)."""
        session.inflight.pop(delivery.packet_id, None)
        if session.persistent:
            self.store.delivery_deleted(session.client_id, delivery)

    def _write_publish(self, conn: Connection, message: Message, qos: int, retain: bool, pid: int, dup: bool,
                       sub_ids: list[int], now: float) -> bool:
        """Encode and queue a PUBLISH to ``conn``; False when it exceeds the client's Maximum Packet Size and
        was discarded instead [MQTT-3.1.2-25]."""
        version = conn.version
        props = message.properties
        topic = message.topic
        new_alias = 0
        if version == MQTT_5 and (sub_ids or message.expires_at is not None or conn.topic_alias_max):
            props = dict(props)
            if sub_ids:
                props[P.SUBSCRIPTION_IDENTIFIER] = sub_ids
            if message.expires_at is not None:
                # The remaining lifetime [MQTT-3.3.2-6].
                props[P.MESSAGE_EXPIRY_INTERVAL] = max(0, int(message.expires_at - now + 0.999))
            if conn.topic_alias_max:
                alias = conn.aliases_out.get(topic)
                if alias is not None:
                    props[P.TOPIC_ALIAS] = alias
                    topic = ""
                elif len(conn.aliases_out) < conn.topic_alias_max:
                    alias = new_alias = len(conn.aliases_out) + 1
                    props[P.TOPIC_ALIAS] = alias
            head, tail = encode_publish_parts(topic, message.payload, qos, retain, props, version)
        else:
            # The common variant: encoded once per (version, QoS, RETAIN) and reused for every subscriber.
            cache = self._enc_cache
            if self._enc_mid != message.mid:
                self._enc_mid = message.mid
                cache.clear()
                parts = None
            else:
                parts = cache.get((version, qos, retain))
            if parts is None:
                parts = cache[(version, qos, retain)] = encode_publish_parts(topic, message.payload, qos, retain,
                                                                             props, version)
            head, tail = parts
        if dup:
            head = bytes((head[0] | 0x08,)) + head[1:]
        limit = conn.max_packet_size
        if limit is not None and len(head) + len(tail) + (2 if qos else 0) > limit:
            self.stats.dropped["packet_too_large"] += 1
            return False
        if new_alias:
            # Only a PUBLISH actually sent sets up an alias on the client's side.
            conn.aliases_out[topic] = new_alias
        out = conn.out
        if qos:
            out.append(head + pid.to_bytes(2, "big"))
        else:
            out.append(head)
        out.append(tail)
        stats = self.stats
        stats.publish_sent += 1
        stats.messages_sent += 1
        self.dirty.add(conn)
        return True

    # ------------------------------------------------------------------------------------------ acks in

    def _on_puback(self, conn: Connection, p: PubAck, now: float) -> None:
        conn.last_ack_at = now
        session = conn.session
        assert session is not None
        delivery = session.inflight.get(p.packet_id)
        if delivery is None or delivery.qos != 1:
            log.debug("%s: PUBACK for unknown Packet Identifier %d", conn.client_id, p.packet_id)
            return
        self._finish(session, delivery)
        self._pump(session, now)

    def _on_pubacks(self, conn: Connection, pids: list[int], now: float) -> None:
        """A run of plain PUBACKs (Reason Code 0) read in one go: each ends its QoS 1 delivery as
        :meth:`_on_puback` does, then the window is refilled once (FIFO, seed 000)."""
        self.stats.messages_received += len(pids)
        conn.last_ack_at = now
        session = conn.session
        assert session is not None
        inflight = session.inflight
        persistent = session.persistent
        write_now = self.write_now
        for start in range(0, len(pids), ACK_RUN_PART):
            if start and write_now is not None and conn.out:
                write_now(conn)
            done: list[Delivery] = []
            for pid in pids[start:start + ACK_RUN_PART]:
                delivery = inflight.get(pid)
                if delivery is None or delivery.qos != 1:
                    log.debug("%s: PUBACK for unknown Packet Identifier %d", conn.client_id, pid)
                    continue
                del inflight[pid]
                done.append(delivery)
            if persistent and done:
                self.store.deliveries_deleted(session.client_id, done)
            self._pump(session, now)

    def _on_pubrec(self, conn: Connection, p: PubRec, now: float) -> None:
        conn.last_ack_at = now
        session = conn.session
        assert session is not None
        delivery = session.inflight.get(p.packet_id)
        if delivery is None or delivery.qos != 2:
            self._send(conn, PubRel(p.packet_id, RC.PACKET_IDENTIFIER_NOT_FOUND if conn.version == MQTT_5 else 0))
            return
        if p.reason_code >= 0x80:
            # The receiver refused the message: the flow ends here (MQTT 5.0 §4.3.3).
            self._finish(session, delivery)
            self._pump(session, now)
            return
        if delivery.state != AWAIT_COMP:
            delivery.state = AWAIT_COMP
            if session.persistent:
                # PUBREC received must be durable before PUBREL goes out: after a crash the broker then
                # re-sends PUBREL, never the PUBLISH (exactly once, MQTT 5.0 §4.3.3).
                self.store.delivery_saved(session.client_id, delivery)
                pid = p.packet_id
                self.store.when_durable(lambda: self._send(conn, PubRel(pid)) if conn.state == CONNECTED else None)
                return
        self._send(conn, PubRel(p.packet_id))

    def _on_pubcomp(self, conn: Connection, p: PubComp, now: float) -> None:
        conn.last_ack_at = now
        session = conn.session
        assert session is not None
        delivery = session.inflight.get(p.packet_id)
        if delivery is None or delivery.state != AWAIT_COMP:
            log.debug("%s: PUBCOMP for unknown Packet Identifier %d", conn.client_id, p.packet_id)
            return
        self._finish(session, delivery)
        self._pump(session, now)

    # ------------------------------------------------------------------------------------------ SUBSCRIBE

    def _on_subscribe(self, conn: Connection, p: Subscribe, now: float) -> None:
        session = conn.session
        assert session is not None
        v5 = conn.version == MQTT_5
        sub_id = None
        if v5:
            ids = p.properties.get(P.SUBSCRIPTION_IDENTIFIER)
            if ids:
                sub_id = ids[0]
        codes: list[int] = []
        retained: list[SubscriptionRecord] = []
        limits = conn.limits
        for sub in p.subscriptions:
            shared = parse_shared(sub.topic_filter)
            if isinstance(shared, str):
                error: str | None = shared
                inner, group = sub.topic_filter, None
            elif shared is None:
                inner, group = sub.topic_filter, None
                error = topic_filter_error(inner)
            else:
                inner, group = shared.topic_filter, shared.group
                error = None
                if sub.no_local:
                    raise ProtocolError("No Local on a Shared Subscription [MQTT-3.8.3-4]")
            if not error:
                error = _levels_error(inner, limits.max_topic_levels)
            if error:
                self.rlog.info(now, peer_host(conn.peer), "subscribe_refused", "%s (%s): SUBSCRIBE %r refused: %s",
                               conn.peer, conn.client_id, sub.topic_filter[:200], error)
                codes.append(RC.TOPIC_FILTER_INVALID if v5 else 0x80)
                continue
            if limits.max_subscriptions and len(session.subscriptions) >= limits.max_subscriptions \
                    and sub.topic_filter not in session.subscriptions:
                self.stats.refused["max_subscriptions"] += 1
                self.rlog.warning(now, peer_host(conn.peer), "max_subscriptions", "%s (%s): SUBSCRIBE %r refused: "
                                  "max_subscriptions = %d reached (0x97)", conn.peer, conn.client_id,
                                  sub.topic_filter[:200], limits.max_subscriptions)
                codes.append(RC.QUOTA_EXCEEDED if v5 else 0x80)
                continue
            record = SubscriptionRecord(session.client_id, inner, sub.qos, sub.no_local, sub.retain_as_published,
                                        sub.retain_handling, sub_id, group)
            existed = self.tree.add(record)
            session.subscriptions[record.key] = record
            if session.persistent:
                self.store.subscription_saved(session.client_id, record)
            codes.append(sub.qos)
            # Retained messages on subscribe per Retain Handling; never for shared ones (MQTT 5.0 §3.8.4).
            if group is None and (record.retain_handling == 0 or (record.retain_handling == 1 and not existed)):
                retained.append(record)
        pid = p.packet_id

        def done() -> None:
            if conn.state != CONNECTED:
                return
            self._send(conn, Suback(pid, codes))
            for record in retained:
                for message in self.retained.matching(record.topic_filter):
                    if message.expired(now):
                        continue
                    # A retained message sent because of a new subscription has RETAIN=1 [MQTT-3.3.1-8].
                    self._deliver(session, message, min(message.qos, record.qos), True,
                                  [record.sub_id] if record.sub_id is not None else [], now)

        self.store.when_durable(done)

    def _on_unsubscribe(self, conn: Connection, p: Unsubscribe, now: float) -> None:
        session = conn.session
        assert session is not None
        codes: list[int] = []
        for topic_filter in p.topic_filters:
            record = session.subscriptions.pop(topic_filter, None)
            if record is None:
                codes.append(RC.NO_SUBSCRIPTION_EXISTED)
                continue
            self.tree.remove(session.client_id, record.topic_filter, record.share_group)
            if session.persistent:
                self.store.subscription_deleted(session.client_id, topic_filter)
            codes.append(RC.SUCCESS)
        pid = p.packet_id
        self.store.when_durable(lambda: self._send(conn, Unsuback(pid, codes)) if conn.state == CONNECTED else None)

    # ------------------------------------------------------------------------------------------ misc packets

    def _on_pingreq(self, conn: Connection, p: PingReq, now: float) -> None:
        self._send(conn, PingResp())

    def _on_auth(self, conn: Connection, p: Auth, now: float) -> None:
        raise ProtocolError("AUTH without an Authentication Method in CONNECT (MQTT 5.0 §4.12)")

    def _on_disconnect(self, conn: Connection, p: Disconnect, now: float) -> None:
        session = conn.session
        assert session is not None
        publish_will = False
        if conn.version == MQTT_5:
            expiry = p.properties.get(P.SESSION_EXPIRY_INTERVAL)
            if expiry is not None:
                if session.expiry_interval == 0 and expiry != 0:
                    raise ProtocolError("DISCONNECT sets a Session Expiry Interval after CONNECT had 0 "
                                        "[MQTT-3.14.2-2]")
                was = session.persistent
                session.expiry_interval = min(expiry, conn.limits.session_expiry_interval)
                self.persistent_count += session.persistent - was
                if session.persistent:
                    self.store.session_saved(session)
                elif was:
                    self.store.session_deleted(session.client_id)
            publish_will = p.reason_code == RC.DISCONNECT_WITH_WILL_MESSAGE
        if not publish_will:
            conn.will = None  # a normal DISCONNECT discards the Will [MQTT-3.1.2-10] [MQTT-3.14.4-3]
        self._close(conn, now, publish_will=publish_will)

    # ------------------------------------------------------------------------------------------ sessions

    def _detach(self, conn: Connection, now: float, publish_will: bool) -> None:
        """The connection is gone: keep the session offline (persistent) or end it; handle the Will."""
        self.connections.discard(conn)
        session = conn.session
        will = conn.will
        conn.will = None
        if session is None or session.conn is not conn:
            return
        session.conn = None
        self.congested.discard(session)
        self.stats.clients_connected -= 1
        delay = 0
        if will is not None and publish_will and conn.version == MQTT_5:
            delay = will.properties.get(P.WILL_DELAY_INTERVAL, 0)
        if not session.persistent:
            if will is not None and publish_will:
                self._publish_will(will, session.client_id, now)
            self._end_session(session, now)
            return
        session.expires_at = None if session.expiry_interval == NEVER else now + session.expiry_interval
        self._offline.add(session)
        self.store.session_saved(session)  # the offline deadline survives a restart
        if will is not None and publish_will:
            if delay:
                # Due when the delay passes or the session ends, whichever is first (_end_session publishes it);
                # a reconnection before then cancels it [MQTT-3.1.3-9].
                session.will = will
                session.will_at = now + delay
                self._wills.add(session)
                self.store.session_saved(session)
            else:
                self._publish_will(will, session.client_id, now)

    def _publish_will(self, will: Any, client_id: str, now: float) -> None:
        """Publish a Will Message (MQTT 5.0 §3.1.2.5) as if the client had sent it."""
        props = {k: v for k, v in will.properties.items() if k != P.WILL_DELAY_INTERVAL}
        expires_at = None
        if P.MESSAGE_EXPIRY_INTERVAL in props:
            expires_at = now + props[P.MESSAGE_EXPIRY_INTERVAL]
        log.info("publishing the Will Message of %r to %r", client_id, will.topic)
        message = Message(self._mid(), will.topic, will.payload, will.qos, will.retain, props, now, expires_at,
                          client_id)
        self._publish(message, now)

    def _end_session(self, session: Session, now: float) -> None:
        """Discard a session and everything in it (Clean Start, expiry, or a clean session's disconnect)."""
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self.persistent_count -= session.persistent
        if session.will is not None:
            # The session ends before the Will Delay Interval passed: publish now (MQTT 5.0 §3.1.3.2.2).
            will = session.will
            session.will = None
            self._publish_will(will, session.client_id, now)
        self._wills.discard(session)
        self._offline.discard(session)
        for record in session.subscriptions.values():
            self.tree.remove(session.client_id, record.topic_filter, record.share_group)
        if session.persistent or session.expires_at is not None:
            self.store.session_deleted(session.client_id)
        dropped = len(session.mqueue) + len(session.inflight)
        if dropped:
            self.stats.dropped["session_ended"] += dropped

    # ------------------------------------------------------------------------------------------ timers

    def tick(self, now: float) -> None:
        """Run every deadline that has passed: CONNECT timeout, Keep Alive (1.5x), ``retry_interval``,
        ``await_rel_timeout``, delayed Wills, session and message expiry, ``$SYS`` updates."""
        for conn in list(self.connections):
            limits = conn.limits
            if conn.state == AWAITING_CONNECT:
                if now - conn.opened_at >= limits.connect_timeout:
                    log.info("%s: no CONNECT within %.0f s; closing", conn.peer, limits.connect_timeout)
                    self._close(conn, now, publish_will=False)
                continue
            if conn.state != CONNECTED:
                continue
            if conn.paused and limits.send_timeout and now - conn.paused_at >= limits.send_timeout:
                # Its socket has not drained for send_timeout: a client that stopped reading. Closed without
                # writing more (nothing can be written); a persistent session keeps its queue (issue 13).
                self.stats.refused["send_timeout"] += 1
                self.rlog.warning(now, peer_host(conn.peer), "send_timeout", "%s (%s): nothing written for "
                                  "send_timeout = %.0f s (the client does not read); closing", conn.peer,
                                  conn.client_id, limits.send_timeout)
                conn.abort = True
                self._close(conn, now, publish_will=True)
                continue
            if conn.keep_alive and now - conn.last_rx >= 1.5 * conn.keep_alive:
                # [MQTT-3.1.2-24] (3.1.1) / [MQTT-3.1.2-22] (5.0): one and a half times the Keep Alive.
                log.info("%s (%s): Keep Alive of %d s expired; closing", conn.peer, conn.client_id, conn.keep_alive)
                if conn.version == MQTT_5:
                    self._send(conn, Disconnect(RC.KEEP_ALIVE_TIMEOUT))
                self._close(conn, now, publish_will=True)
                continue
            session = conn.session
            if session is None:
                continue
            if limits.retry_interval and conn.version != MQTT_5 and session.inflight:
                for delivery in list(session.inflight.values()):
                    if now - delivery.sent_at >= limits.retry_interval:
                        delivery.sent_at = now
                        if delivery.state == AWAIT_COMP:
                            self._send(conn, PubRel(delivery.packet_id))
                        else:
                            self._write_publish(conn, delivery.message, delivery.qos, delivery.retain,
                                                delivery.packet_id, True, delivery.sub_ids, now)
            self._expire_awaiting_rel(session, now)
        for session in list(self.congested):
            if session.conn is None or now - session.conn.last_ack_at >= STALLED_AFTER:
                # A consumer that stopped acknowledging does not hold publishers back: its queue fills and
                # drops by the Message Queue policy instead (seed 000).
                self.congested.discard(session)
        for session in list(self._wills):
            if session.will_at is not None and now >= session.will_at:
                will = session.will
                session.will = None
                session.will_at = None
                self._wills.discard(session)
                if will is not None:
                    self._publish_will(will, session.client_id, now)
        for session in list(self._offline):
            if session.expires_at is not None and now >= session.expires_at:
                log.info("session %r expired", session.client_id)
                self.stats.dropped["session_expired"] += 1
                self._end_session(session, now)
        if now >= self._next_sweep:
            self._next_sweep = now + 5.0
            self._sweep_expired(now)
        if self.settings.sys_interval and now >= self._next_sys:
            self._next_sys = now + self.settings.sys_interval
            self.publish_sys(now)

    def _expire_awaiting_rel(self, session: Session, now: float) -> None:
        timeout = session.limits.await_rel_timeout
        if not timeout or not session.awaiting_rel:
            return
        for pid, (_message, received) in list(session.awaiting_rel.items()):
            if now - received >= timeout:
                del session.awaiting_rel[pid]
                self.stats.dropped["await_rel_timeout"] += 1
                if session.persistent:
                    self.store.inbound_deleted(session.client_id, pid)

    def _sweep_expired(self, now: float) -> None:
        """Drop expired messages from offline sessions' queues and expired retained messages."""
        for session in self._offline:
            if not session.mqueue:
                continue
            removed = session.mqueue.remove_if(lambda d: d.expires_at is not None and now >= d.expires_at)
            if removed:
                self.stats.dropped["expired"] += len(removed)
                if session.persistent:
                    for delivery in removed:
                        self.store.delivery_deleted(session.client_id, delivery)
            self._expire_awaiting_rel(session, now)
        for message in self.retained.all():
            if message.expired(now):
                self.retained.remove(message.topic)
                self.store.retained_deleted(message.topic)
                self.stats.dropped["retained_expired"] += 1

    # ------------------------------------------------------------------------------------------ $SYS

    def sys_values(self, now: float) -> dict[str, str]:
        """The ``$SYS/broker/...`` values (Mosquitto's names), as strings."""
        s = self.stats
        values = {
            "version": f"edge-gateway {__version__}",
            "uptime": f"{int(now - self.started_at)} seconds",
            "clients/connected": str(s.clients_connected),
            "clients/total": str(len(self.sessions)),
            "clients/maximum": str(s.clients_maximum),
            "messages/received": str(s.messages_received),
            "messages/sent": str(s.messages_sent),
            "publish/messages/received": str(s.publish_received),
            "publish/messages/sent": str(s.publish_sent),
            "publish/messages/dropped": str(sum(s.dropped.values())),
            "subscriptions/count": str(self.tree.count),
            "retained messages/count": str(len(self.retained)),
            "store/messages/count": str(sum(len(x.mqueue) + len(x.inflight) for x in self.sessions.values())),
        }
        for reason, count in sorted(s.dropped.items()):
            values[f"messages/dropped/{reason}"] = str(count)
        for reason, count in sorted(s.refused.items()):
            values[f"refused/{reason}"] = str(count)
        values["log/suppressed"] = str(self.rlog.suppressed)
        return values

    def publish_sys(self, now: float) -> None:
        """Publish the ``$SYS`` values as retained QoS 0 messages."""
        for name, value in self.sys_values(now).items():
            message = Message(self._mid(), f"$SYS/broker/{name}", value.encode(), 0, True, {}, now, None, None)
            self._publish(message, now)


def _levels_error(topic: str, max_levels: int) -> str | None:
    """Why ``topic`` (a Topic Name or Filter) has too many levels for ``max_topic_levels``, or ``None``."""
    if max_levels and topic.count("/") >= max_levels:
        return f"more than max_topic_levels = {max_levels} topic levels"
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
