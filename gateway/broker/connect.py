"""CONNECT (MQTT 5.0 §3.1, §3.2; MQTT 3.1.1 §3.1): checks and refusals, session take-over [MQTT-3.1.4-2],
Clean Start [MQTT-3.1.2-4], resuming a persistent session (MQTT 5.0 §4.1), the negotiated limits (Keep Alive, Receive
Maximum capping the Inflight Window, Maximum Packet Size, Topic Aliases), the CONNACK, and the re-send of the
Inflight Window with DUP=1 [MQTT-4.4.0-1]."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Final

from gateway.broker.access_decisions import authenticate, client_rules, listener_access, redecide
from gateway.broker.connection_states import AWAITING_CONNECT, CONNECTED, HELD
from gateway.broker.deadlines import next_check
from gateway.broker.inflight import pump, resend
from gateway.broker.limits import ZoneLimits, topic_limit_error
from gateway.broker.message import is_utf8
from gateway.broker.output import send, send_raw
from gateway.broker.ratelog import peer_host
from gateway.broker.reasons import connack_refusal_packet, disconnect
from gateway.broker.session_lifecycle import close, end_session, expire_session
from gateway.broker.session_state import NEVER, NO_QUEUE, Connection, Session
from gateway.broker.state import BrokerState
from gateway.mqtt.errors import ProtocolError
from gateway.mqtt.packets import CONNACK, MQTT_3_1, MQTT_5, Connack, Connect
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC
from gateway.mqtt.topics import require_topic, topic_name_error

log: Final = logging.getLogger("gateway.broker")


#: The CONNACK of an accepted 3.1/3.1.1 CONNECT by Session Present: return code 0 (MQTT 3.1.1 §3.2), 4 bytes.
_CONNACK_3: Final = (b"\x20\x02\x00\x00", b"\x20\x02\x01\x00")


def refuse(core: BrokerState, conn: Connection, reason: RC, message: str, now: float) -> None:
    """Refuse the CONNECT: CONNACK with ``reason`` (or its 3.1.1 return code; none: just close), then close."""
    core.stats.connect_refused[reason.name.lower()] += 1
    core.rlog.warning(
        now,
        peer_host(conn.peer),
        "refused_" + reason.name,
        "%s: CONNECT refused (0x%02X %s): %s",
        conn.peer,
        reason,
        reason.name,
        message,
    )
    connack = connack_refusal_packet(conn.version, reason, message)
    if connack is not None:
        send(core, conn, connack)
    close(core, conn, now, publish_will=False, reason=f"CONNECT refused: {message}")


def _client_id_refusal(p: Connect, client_id: str, max_len: int) -> str | None:
    """Why the Client Identifier is refused (0x85 / return code 2), or ``None``."""
    if not client_id:
        if p.protocol_level == MQTT_3_1:
            # MQTT 3.1 §3.1: a Client Identifier is 1 to 23 characters; none is ever assigned by the server.
            return "MQTT 3.1 needs a Client Identifier of 1 to 23 characters (3.1.1 MQTT-3.1.3-9)"
        if p.protocol_level != MQTT_5 and not p.clean_start:
            # [MQTT-3.1.3-8]: a zero-byte ClientId needs CleanSession = 1.
            return "an empty Client Identifier requires Clean Session = 1 [MQTT-3.1.3-8]"
        return None
    if len(client_id) > max_len or (4 * len(client_id) > max_len and len(client_id.encode("utf-8")) > max_len):
        return f"Client Identifier longer than max_clientid_len = {max_len} bytes"
    return None


def _will_refusal(core: BrokerState, p: Connect, limits: ZoneLimits) -> tuple[RC, str] | None:
    """Why the Will Message is refused: (5.0 reason code, text), or ``None``."""
    will = p.will
    if will is None:
        return None
    v5 = p.protocol_level == MQTT_5
    try:
        require_topic(will.topic, "Will Topic")
        if v5 and P.RESPONSE_TOPIC in will.properties:
            require_topic(will.properties[P.RESPONSE_TOPIC], "Will Response Topic")
    except ProtocolError as exc:  # [MQTT-4.7.3-1]: 5.0 CONNACK 0x82; 3.1.1 has no return code: closed
        return exc.reason_code, str(exc)
    error = topic_name_error(will.topic)
    if not error and (limited := topic_limit_error(will.topic, limits)):
        core.stats.refused[limited[0]] += 1
        error = limited[1]
    if error:
        return RC.TOPIC_NAME_INVALID, f"Will Topic {will.topic[:200]!r}: {error}"
    if v5 and will.properties.get(P.PAYLOAD_FORMAT_INDICATOR) == 1 and not is_utf8(will.payload):
        return RC.PAYLOAD_FORMAT_INVALID, "Will Payload is not UTF-8 (MQTT 5.0 §3.1.3.2.3)"
    if v5 and will.retain and not core.settings.retain_available:
        return RC.RETAIN_NOT_SUPPORTED, "Will Retain 1, but retained messages are not supported [MQTT-3.2.2-13]"
    return None


def _take_over(core: BrokerState, conn: Connection, session: Session, now: float) -> None:
    """Session take-over [MQTT-3.1.4-2]: the old connection is closed (5.0: DISCONNECT 0x8E [MQTT-3.1.4-3])."""
    old = session.conn
    assert old is not None
    log.info("%s: client %r takes over the session from %s", conn.peer, session.client_id, old.peer)
    packet = disconnect(old.version, RC.SESSION_TAKEN_OVER)
    if packet is not None:
        send(core, old, packet)
    close(core, old, now, publish_will=True, reason="session taken over")


def hold(core: BrokerState, conn: Connection, p: Connect, now: float) -> bool:
    """Hold the CONNECT ``p`` when its address is throttled after failed attempts: the connection
    waits in state :data:`HELD` until ``held_until``, when :meth:`Broker.tick` hands it to :func:`on_connect`
    (with the packets that arrived meanwhile). Held before it is checked, whatever its password, so its answer
    cannot be timed. True when held."""
    throttle = core.settings.throttle
    if throttle is None or not len(throttle):
        return False  # no failed attempt remembered: nothing to look up
    delay = throttle.delay(peer_host(conn.peer), now)
    if delay <= 0:
        return False
    core.stats.refused["auth_throttled"] += 1
    conn.move_to(HELD)
    conn.hold(p, now + delay)
    core.held.add(conn)
    return True


def _authorise(core: BrokerState, conn: Connection, p: Connect, client_id: str, now: float) -> tuple[Any, Any]:
    """Authenticate the CONNECT and check its Will Topic against the ACL (:mod:`gateway.broker.access_decisions`):
    ``(user name, ACL rules)``, or the connection refused (0x86 / 0x87; 3.1.1: 4 / 5) and closed
    [MQTT-3.1.4-2]. A refused authentication counts against the address (the failure throttle)."""
    access = listener_access(core, conn.listener)
    user, denied, why = authenticate(access, p.username, p.password, conn.cert_cn)
    throttle = core.settings.throttle
    if denied is not None:
        if throttle is not None:
            throttle.failure(peer_host(conn.peer), now)
        core.stats.refused["auth_" + denied.name.lower()] += 1
        refuse(core, conn, denied, why, now)
        return None, None
    if user is not None and throttle is not None:
        throttle.success(peer_host(conn.peer))
    rules = client_rules(access, user, client_id)
    will = p.will
    if will is not None and rules is not None and not rules.may_publish(will.topic):
        # Refused rather than dropped later: the client learns now that its Will would never be published.
        core.stats.refused["will_not_authorized"] += 1
        refuse(core, conn, RC.NOT_AUTHORIZED, f"Will Topic {will.topic[:200]!r}: not allowed by the acl_file", now)
    return user, rules


def on_connect(core: BrokerState, conn: Connection, p: Connect, now: float) -> None:
    """CONNECT ``p`` on ``conn`` (state ``AWAITING_CONNECT``), at ``now`` (wall-clock seconds): accept it or refuse it.
    Statements: MQTT 5.0's numbering.

    Output: a CONNACK on ``conn``'s output (its action). Accepted: ``conn`` is ``CONNECTED`` to its
    session (new, resumed or taken over), Session Present set accordingly [MQTT-3.2.2-2] [MQTT-3.2.2-3], the
    negotiated limits on ``conn`` (Receive Maximum caps the Inflight Window, Maximum Packet Size, Topic Alias
    Maximum, Server Keep Alive), and unacknowledged PUBLISH (DUP=1) and PUBREL re-sent in order [MQTT-4.4.0-1].
    Refused: a CONNACK with a Reason Code >= 0x80 (3.1.1: return code 1-5) and ``conn`` closed after it
    [MQTT-3.2.2-5]; no session is touched.

    In order: enhanced authentication (not supported: 0x8C), the Client Identifier (empty with Clean Start 0 in
    3.1.1 [MQTT-3.1.3-8], too long: ``max_clientid_len``; an empty one is assigned [MQTT-3.1.3-6]), the Will
    (QoS, topic, ACL), authentication (:func:`~gateway.broker.access_decisions.authenticate`; a throttled address
    is held first, :func:`hold`), ``max_connections`` and ``max_sessions`` (0x97), session ownership on take-over
    (0x87). Then the existing session with that Client Identifier: its connection is closed (take-over
    [MQTT-3.1.4-3]; 5.0: DISCONNECT 0x8E), Clean Start discards it [MQTT-3.1.2-4], an expired one is gone
    [MQTT-4.1.0-2], a pending delayed Will is cancelled [MQTT-3.1.3-9]. Errors: none raised; a malformed CONNECT
    was refused by the codec before this.

    The steps, each a function: :func:`_identify` (authentication method, Client Identifier, Will), authentication
    (:func:`_authorise`), :func:`_session_expiry`, :func:`_admit` (limits, session ownership), session take-over
    and Will handling (:func:`_take_session`), :func:`_attach`, :func:`_negotiate`, :func:`_connack`, then the
    re-send of the window.
    """
    v5 = p.protocol_level == MQTT_5
    conn.version = MQTT_5 if v5 else 4
    limits = conn.limits
    props = p.properties
    if v5:
        # Also bounds a refusal CONNACK's Reason String [MQTT-3.2.2-19].
        conn.max_packet_size = props.get(P.MAXIMUM_PACKET_SIZE)
    identified = _identify(core, conn, p, now)
    if identified is None:
        return  # refused
    client_id, assigned = identified
    user, rules = _authorise(core, conn, p, client_id, now)
    if conn.state != AWAITING_CONNECT:
        return  # refused
    requested, granted = _session_expiry(p, limits, v5)
    session = core.sessions.get(client_id)
    if not _admit(core, conn, session, granted, user, now):
        return  # refused
    session, session_present = _take_session(core, conn, p, client_id, session, now)
    session.username, session.listener, session.acl = user, conn.listener, rules
    conn.username = user
    redecide(core, session)  # a resumed session's subscriptions, under this connection's rules
    _attach(core, conn, session, granted, now)
    conn.will = p.will
    server_keep_alive = _negotiate(conn, p, v5)
    # The CONNECT timeout no longer applies: next come Keep Alive and identifiers of a resumed session awaiting PUBREL.
    core.deadlines.refile(conn, next_check(conn, now))
    if log.isEnabledFor(logging.DEBUG):  # one call on the CONNECT path instead of two and the arguments
        log.debug(
            "%s: %r connected (v%d, clean_start=%s, keep_alive=%d, session_present=%s)",
            conn.peer,
            client_id,
            p.protocol_level,
            p.clean_start,
            conn.keep_alive,
            session_present,
        )
    _connack(core, conn, p, session_present, assigned, server_keep_alive, requested, granted)
    # Resume: re-send unacknowledged PUBLISH with DUP=1 and PUBREL, in order [MQTT-4.4.0-1].
    resend(core, session, conn, now)
    pump(core, session, now)


def _identify(core: BrokerState, conn: Connection, p: Connect, now: float) -> tuple[str, str | None] | None:
    """The checks before authentication: enhanced authentication (not supported: 0x8C), the Client Identifier
    (:func:`_client_id_refusal`; an empty one is assigned [MQTT-3.1.3-6]) and the Will (:func:`_will_refusal`).
    Returns ``(client id, the id assigned or None)``, or None when the CONNECT was refused."""
    if P.AUTHENTICATION_METHOD in p.properties:
        refuse(core, conn, RC.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported", now)
        return None
    limits = conn.limits
    client_id = p.client_id
    bad_id = _client_id_refusal(p, client_id, limits.max_clientid_len)
    if bad_id is not None:
        refuse(core, conn, RC.CLIENT_IDENTIFIER_NOT_VALID, bad_id, now)
        return None
    assigned = None
    if not client_id:
        client_id = "auto-" + secrets.token_hex(8)
        if p.protocol_level == MQTT_5:
            assigned = client_id  # told in the CONNACK [MQTT-3.2.2-16]
    bad_will = _will_refusal(core, p, limits)
    if bad_will is not None:
        refuse(core, conn, bad_will[0], bad_will[1], now)
        return None
    return client_id, assigned


def _session_expiry(p: Connect, limits: ZoneLimits, v5: bool) -> tuple[float, float]:
    """``(requested, granted)`` Session Expiry Interval, seconds: 5.0 from the CONNECT, capped by
    ``session_expiry_interval``; 3.1.1 from Clean Session (0: ends with the connection; 1: the zone's interval)."""
    requested: float
    if v5:
        requested = p.properties.get(P.SESSION_EXPIRY_INTERVAL, 0)
    else:
        requested = 0.0 if p.clean_start else float(NEVER)  # a float either way (mypyc stores a double)
    granted = requested
    max_expiry = limits.session_expiry_interval
    if requested and requested > max_expiry and max_expiry >= 0:
        granted = max_expiry
    if not v5 and granted == NEVER:
        granted = max_expiry
    return requested, granted


def _admit(core: BrokerState, conn: Connection, session: Session | None, granted: float, user: Any,
           now: float) -> bool:
    """The limits a CONNECT may hit once authenticated: ``max_connections`` of the listener and ``max_sessions``
    (0x97), and the ownership of an existing session (0x87). False when refused."""
    limits = conn.limits
    max_conns = limits.max_connections
    if max_conns and core.listener_clients[conn.listener] >= max_conns and (
        session is None or session.conn is None or session.conn.listener != conn.listener
    ):
        # A take-over on the same listener frees a slot as it takes one; connections awaiting CONNECT are
        # bounded by connect_timeout instead.
        core.stats.refused["max_connections"] += 1
        refuse(core, conn, RC.QUOTA_EXCEEDED, f"max_connections = {max_conns} reached on listener "
               f"{conn.listener!r}", now)
        return False
    max_sessions = core.settings.max_sessions
    if session is None and granted and max_sessions and core.persistent_count >= max_sessions:
        # A new persistent session past the cap; resuming or taking over an existing one is always allowed,
        # and nothing of any other client is touched.
        core.stats.refused["max_sessions"] += 1
        refuse(core, conn, RC.QUOTA_EXCEEDED, f"max_sessions = {max_sessions} persistent sessions reached", now)
        return False
    if (
        session is not None
        and session.username is not None
        and session.username != user
        and not (session.conn is None and session.expires_at is not None and now >= session.expires_at)
    ):
        # Only its own user may take over or resume an authenticated user's session (stricter than
        # Mosquitto, which lets any client take over any Client Identifier): 0x87 / 3.1.1 return code 5.
        core.stats.refused["takeover_not_authorized"] += 1
        refuse(core, conn, RC.NOT_AUTHORIZED, "the Client Identifier belongs to another user's session", now)
        return False
    return True


def _take_session(core: BrokerState, conn: Connection, p: Connect, client_id: str, session: Session | None,
                  now: float) -> tuple[Session, bool]:
    """The session the accepted CONNECT gets, and Session Present: the existing one's connection is closed
    (take-over, :func:`_take_over`), an expired one is gone [MQTT-4.1.0-2], Clean Start discards it
    [MQTT-3.1.2-4]; a resumed one leaves the offline set and its pending delayed Will is cancelled
    [MQTT-3.1.3-9]; else a new session."""
    if session is not None and session.conn is not None:
        _take_over(core, conn, session, now)
        session = core.sessions.get(client_id)
    if session is not None and session.conn is None and session.expires_at is not None and now >= session.expires_at:
        # Expired since the last tick: the Session State is gone [MQTT-4.1.0-2] (5.0).
        expire_session(core, session, now)
        session = None
    if session is not None and p.clean_start:
        # Clean Start discards the existing session [MQTT-3.1.2-4].
        end_session(core, session, now)
        session = None
    if session is None:
        session = core.sessions[client_id] = Session(client_id, conn.limits)
        return session, False
    core.offline.discard(session)
    session.expires_at = None
    if session.will_at is not None:
        # A new connection before the Will Delay Interval passed: no Will [MQTT-3.1.3-9].
        session.will = None
        session.will_at = None
        core.wills.discard(session)
    return session, True


def _negotiate(conn: Connection, p: Connect, v5: bool) -> int | None:
    """The connection's negotiated limits: Keep Alive (5.0: the Server Keep Alive when ``max_keepalive`` is lower
    or the client asked for none), the Inflight Window capped by Receive Maximum, the client's Maximum Packet
    Size and Topic Alias Maximum, Request Problem Information. Returns the Server Keep Alive to announce, or
    None."""
    limits = conn.limits
    keep_alive = p.keep_alive
    server_keep_alive = None
    if v5 and limits.max_keepalive and (keep_alive == 0 or keep_alive > limits.max_keepalive):
        keep_alive = server_keep_alive = limits.max_keepalive
    conn.keep_alive = keep_alive
    if v5:
        props = p.properties
        conn.window = limits.window(props.get(P.RECEIVE_MAXIMUM, 65535))
        conn.max_packet_size = props.get(P.MAXIMUM_PACKET_SIZE)
        conn.topic_alias_max = props.get(P.TOPIC_ALIAS_MAXIMUM, 0)
        conn.request_problem_info = props.get(P.REQUEST_PROBLEM_INFORMATION, 1) == 1
    else:
        conn.window = limits.window(None)
    return server_keep_alive


def _connack(core: BrokerState, conn: Connection, p: Connect, session_present: bool, assigned: str | None,
             server_keep_alive: int | None, requested: float, granted: float) -> None:
    """The CONNACK accepting ``p``; 5.0 with the properties that differ from the client's request or the
    protocol's defaults (MQTT 5.0 §3.2.2.3)."""
    if p.protocol_level != MQTT_5:
        # MQTT 3.1 has no Session Present flag: the first CONNACK byte is reserved, 0 (the session is resumed).
        send_raw(core, conn, _CONNACK_3[session_present and p.protocol_level != MQTT_3_1])
        core.stats.sent[CONNACK] += 1
        return
    limits = conn.limits
    ack_props: dict[int, Any] = {}
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
    if not core.settings.retain_available:
        ack_props[P.RETAIN_AVAILABLE] = 0
    send(core, conn, Connack(session_present, 0, ack_props))


def _attach(core: BrokerState, conn: Connection, session: Session, expiry_interval: float, now: float) -> None:
    """Bind ``session`` to ``conn`` with the granted Session Expiry Interval; a session that becomes persistent is
    recorded in the store (and its queue may page), one that stops being persistent leaves it."""
    limits = conn.limits
    # Session.persistent, read without its property (the CONNECT path; MQTT 5.0 §3.1.2.11.2: an interval > 0).
    was_persistent = session.expiry_interval > 0
    persistent = expiry_interval > 0
    session.expiry_interval = expiry_interval
    core.persistent_count += persistent - was_persistent
    session.protocol_level = conn.version
    mqueue = session.mqueue
    receiving = mqueue is not NO_QUEUE  # else it has never subscribed: no queue to bound or page yet
    if session.limits is not limits:
        session.limits = limits
        if receiving:
            mqueue.max_len = limits.max_mqueue_len
            mqueue.max_bytes = limits.max_mqueue_bytes
    if persistent:
        core.store.session_saved(session)
        if receiving and mqueue.pager is None:
            paging = core.store.pager(session.client_id)
            if paging is not None:
                mqueue.enable_paging(*paging)
        elif receiving:
            mqueue.hold_in_memory(True)  # back online: drain in large batches again
    elif was_persistent:
        if receiving:
            mqueue.page_in_all()  # its store rows go now; the queue lives on in memory
        core.store.session_deleted(session.client_id)
    conn.session = session
    conn.client_id = session.client_id
    session.conn = conn
    conn.move_to(CONNECTED)
    core.stats.clients_connected += 1
    core.listener_clients[conn.listener] += 1
    core.stats.clients_maximum = max(core.stats.clients_maximum, core.stats.clients_connected)
