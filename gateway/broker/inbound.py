"""A client's PUBLISH (MQTT 5.0 §3.3): Topic Aliases, the checks that refuse it (Receive Maximum, payload format,
``$SYS``, ``max_topic_levels``, a full store), the Application Message made once, routed, and acknowledged once
everything it caused is durable (docs/architecture.md, "The durability contract"): PUBACK for QoS 1, PUBREC for
QoS 2 (:mod:`gateway.broker.qos2`).
"""

from __future__ import annotations

from typing import Any, Final

from gateway.broker.actions import UNTIL_RELEASED
from gateway.broker.barriers import ACK_PUBACK, hold
from gateway.broker.connection_states import CONNECTED
from gateway.broker.limits import topic_limit_error
from gateway.broker.message import Message, is_utf8, packet_id_of
from gateway.broker.output import PUBACK_BYTE, send, send_ack
from gateway.broker.qos2 import duplicate, received
from gateway.broker.ratelog import peer_host
from gateway.broker.reasons import PUBACK_NO_MATCHING, publish_refusal, store_refusal
from gateway.broker.router import publish
from gateway.broker.session_lifecycle import close
from gateway.broker.session_state import Connection, Session, aliases_in_for_write
from gateway.broker.state import BrokerState
from gateway.mqtt.errors import MQTTError, ProtocolError
from gateway.mqtt.packets import MQTT_5, PubAck, Publish, PubRec
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC
from gateway.mqtt.topics import require_topic, topic_name_error

# Properties a PUBLISH carries from the publisher to subscribers (MQTT 5.0 §3.3.2.3).
_STRIP_ON_RECEIVE: Final = (P.TOPIC_ALIAS, P.SUBSCRIPTION_IDENTIFIER)


def on_publish(core: BrokerState, conn: Connection, p: Publish, now: float) -> None:
    """PUBLISH ``p`` from ``conn``'s client (``CONNECTED``), at ``now`` (wall-clock seconds). Statements: MQTT 5.0's
    numbering.

    Checks, in order: 3.1.1's room under ``max_awaiting_rel`` while some QoS 1/2 PUBLISHes await their commit
    (none: the PUBLISH waits, :func:`wait_for_acknowledgements`), the ``max_publish_rate`` token (none left: the
    PUBLISH waits, ``conn.paused_until``), the Topic Alias (set or resolved, per connection; beyond the maximum
    [MQTT-3.3.2-9]: Protocol Error), no Subscription Identifier from a client [MQTT-3.3.4-6], the Topic Name
    [MQTT-3.3.2-1] [MQTT-4.7.3-1] and the Response Topic [MQTT-3.3.2-14], Receive Maximum (one QoS 1/2 PUBLISH
    too many: DISCONNECT 0x93 [MQTT-3.3.4-7]), ``$SYS`` and the write ACL (5.0 QoS 1/2: 0x87; else dropped),
    ``max_topic_levels`` / ``max_topic_length`` (0x90), store room for persistent work (0x97; 3.1.1: no
    acknowledgement, disconnect).
    The steps: :func:`spend_publish_token`, :func:`_topic_alias_and_properties` (5.0 with properties),
    :func:`_refused`, :func:`_retain` (RETAIN=1), then the Message routed and acknowledged per QoS.

    Output: the :class:`~gateway.broker.message.Message` routed (:func:`gateway.broker.router.publish`), for QoS 2
    kept under its Packet Identifier until PUBREL instead (:mod:`gateway.broker.qos2`); PUBACK / PUBREC (5.0:
    0x10 No matching subscribers when nobody took it) once what the message caused is durable (held under a
    commit barrier, :mod:`gateway.broker.barriers`), or 0x97 / a disconnect when that commit fails. Errors:
    :class:`~gateway.mqtt.errors.ProtocolError` (the caller closes the connection with its Reason Code).
    """
    session = conn.session
    assert session is not None
    limits = conn.limits
    qos = p.qos
    if (
        qos
        and conn.inbound_pending + len(session.awaiting_rel) >= limits.max_awaiting_rel
        and conn.inbound_pending
        and conn.version != MQTT_5
        and not (qos == 2 and p.packet_id in session.awaiting_rel)  # a repeat takes no room
    ):
        wait_for_acknowledgements(core, conn, p, now)
        return
    rate = limits.max_publish_rate
    if rate and not spend_publish_token(core, conn, p, rate, now):
        return  # waits for its token (conn.deferred)
    topic = p.topic
    props = p.properties
    v5 = conn.version == MQTT_5
    if v5 and props:
        topic, props = _topic_alias_and_properties(conn, topic, props)
    if not topic:
        require_topic(topic, "PUBLISH Topic Name (with no Topic Alias, MQTT-3.3.2-1)")
    pid = p.packet_id
    stats = core.stats
    stats.publish_received += 1
    stats.received_qos[qos] += 1

    if qos == 2 and pid in session.awaiting_rel:
        duplicate(core, conn, packet_id_of(p))
        return
    if qos and conn.inbound_pending + len(session.awaiting_rel) >= limits.max_awaiting_rel:
        raise MQTTError(
            RC.RECEIVE_MAXIMUM_EXCEEDED,
            f"more than Receive Maximum ({limits.max_awaiting_rel}) QoS 1/2 PUBLISH "
            "awaiting acknowledgement [MQTT-3.3.4-7]",
        )
    if _refused(core, conn, session, p, topic, v5, props):
        return
    retain = p.retain
    if retain:
        kept = _retain(core, conn, p, topic, v5, now)
        if kept is None:
            return  # refused
        retain = kept
    if qos and not core.store.has_room(conn.client_id):
        refuse_unstored(core, conn, p, True, now)
        return

    expires_at = None
    if v5:
        expiry = props.get(P.MESSAGE_EXPIRY_INTERVAL)
        if expiry is not None:
            expires_at = now + expiry
    interned = core.topics.get(topic)
    if interned is None:
        if len(core.topics) >= 10_000:
            core.topics.clear()
        interned = core.topics[topic] = topic
    message = Message(core.new_mid(), interned, p.payload, qos, retain, props, now, expires_at, conn.client_id)
    if qos == 0:
        publish(core, message, now)
    elif qos == 1:
        matched = publish(core, message, now)
        reason = 0 if matched else PUBACK_NO_MATCHING[conn.version]
        if hold(core, ACK_PUBACK, conn, p, reason):
            puback(core, conn, p, reason)  # nothing to wait for (a memory store)
        else:
            conn.inbound_pending += 1
    else:
        received(core, conn, session, p, message, now)


def wait_for_acknowledgements(core: BrokerState, conn: Connection, p: Publish, now: float) -> None:
    """A 3.1.1 client has ``max_awaiting_rel`` QoS 1/2 PUBLISHes unacknowledged, some of them only until their
    commit: ``p`` waits (``conn.deferred``, with the bytes after it) and reading from the connection stops
    (``conn.paused_until`` = :data:`~gateway.broker.actions.UNTIL_RELEASED`, Keep Alive suspended) until a commit
    acknowledges one (``Broker.holds_back``, ``Broker.release``). 3.1.1 has no Receive Maximum to exceed
    (MQTT 5.0 §3.3.4 is 5.0's), so this is flow control, as TCP's: never a disconnect, nothing lost. Each pause
    is counted (``$SYS/broker/refused/max_awaiting_rel``) and logged at most once a minute per address. With
    nothing left to commit and the QoS 2 ones alone at the limit, only the client's PUBRELs could free room: the
    PUBLISH is handled then, and the connection closed as a 5.0 client's is (0x93)."""
    core.stats.refused["max_awaiting_rel"] += 1
    core.rlog.info(now, peer_host(conn.peer), "max_awaiting_rel",
                   "%s (%s): max_awaiting_rel = %d QoS 1/2 PUBLISH awaiting acknowledgement; reading paused until "
                   "they are committed", conn.peer, conn.client_id, conn.limits.max_awaiting_rel)
    conn.paused_until = UNTIL_RELEASED
    conn.defer(p)


def _topic_alias_and_properties(conn: Connection, topic: str, props: dict[int, Any]) -> tuple[str, dict[int, Any]]:
    """A 5.0 PUBLISH's Topic Alias and properties: the alias set or resolved, per connection (beyond the Topic
    Alias Maximum [MQTT-3.3.2-9]: 0x94; used before it was set: Protocol Error), no Subscription Identifier from a
    client [MQTT-3.3.4-6], the Response Topic [MQTT-3.3.2-14]. Returns the Topic Name and the properties to carry
    on (without the alias)."""
    limits = conn.limits
    alias = props.get(P.TOPIC_ALIAS)
    if alias is not None:
        if alias > limits.topic_alias_maximum:
            raise MQTTError(
                RC.TOPIC_ALIAS_INVALID,
                f"Topic Alias {alias} above the Topic Alias Maximum {limits.topic_alias_maximum} [MQTT-3.3.2-9]",
            )
        if topic:
            aliases_in_for_write(conn)[alias] = topic
        else:
            known = conn.aliases_in.get(alias)
            if known is None:
                raise ProtocolError(f"Topic Alias {alias} used before it was set (MQTT 5.0 §3.3.2.3.4)")
            topic = known
    if P.SUBSCRIPTION_IDENTIFIER in props:
        raise ProtocolError("a PUBLISH from a Client must not carry a Subscription Identifier [MQTT-3.3.4-6]")
    if alias is not None:
        props = {k: v for k, v in props.items() if k not in _STRIP_ON_RECEIVE}
    response_topic = props.get(P.RESPONSE_TOPIC)
    # One pass: topic_name_error holds the MQTT-4.7.3-1 rule too (no second call per message).
    if response_topic is not None and (bad := topic_name_error(response_topic)):
        raise ProtocolError(f"Response Topic {response_topic!r}: {bad} [MQTT-3.3.2-14]")
    return topic, props


def _refused(
    core: BrokerState, conn: Connection, session: Session, p: Publish, topic: str, v5: bool, props: dict[int, Any]
) -> bool:
    """The checks that refuse one PUBLISH and keep the connection: the Payload Format Indicator (0x99), the write
    ACL and ``$SYS`` (5.0 QoS 1/2: 0x87; else dropped), ``max_topic_levels`` / ``max_topic_length`` (0x90). True
    when refused (:func:`reject`)."""
    if v5 and props.get(P.PAYLOAD_FORMAT_INDICATOR) == 1 and not is_utf8(p.payload):
        reject(core, conn, p, RC.PAYLOAD_FORMAT_INVALID, "payload is not UTF-8 as its Payload Format Indicator says")
        return True
    acl = session.acl
    if acl is not None and not acl.may_publish(topic):
        # 5.0: PUBACK/PUBREC 0x87, QoS 0 dropped silently; 3.1.1: dropped and acknowledged as accepted, as
        # Mosquitto does (reasons.publish_refusal) [MQTT-3.3.5-2].
        reject(core, conn, p, RC.NOT_AUTHORIZED, "not allowed by the acl_file", counter="acl_denied")
        return True
    if topic[0] == "$" and (topic == "$SYS" or topic.startswith("$SYS/")):
        reject(core, conn, p, RC.NOT_AUTHORIZED, "clients may not publish to $SYS topics")
        return True
    limits = conn.limits
    max_levels = limits.max_topic_levels
    max_len = limits.max_topic_length
    # Pre-filter so the common topic costs two comparisons; topic_limit_error decides (as for SUBSCRIBE, Wills).
    if (max_levels and topic.count("/") >= max_levels) or (max_len and 4 * len(topic) > max_len):
        limited = topic_limit_error(topic, limits)
        if limited is not None:
            reject(core, conn, p, RC.TOPIC_NAME_INVALID, limited[1], counter=limited[0])
            return True
    return False


def _retain(core: BrokerState, conn: Connection, p: Publish, topic: str, v5: bool, now: float) -> bool | None:
    """Whether a PUBLISH with RETAIN=1 is retained: Retain Available (else 0x9A, a Protocol Error of the client),
    ``max_retained_messages`` / ``max_retained_bytes``: past them a 5.0 QoS 1/2 PUBLISH is refused (0x97, None),
    any other is delivered but not retained (False)."""
    settings = core.settings
    if not settings.retain_available:
        raise MQTTError(RC.RETAIN_NOT_SUPPORTED, "retained messages are not supported (MQTT 5.0 §3.2.2.3.5)")
    limit = core.retained.refusal(topic, p.payload, settings.max_retained_messages, settings.max_retained_bytes)
    if limit is None:
        return True
    text = f"{limit} = {getattr(settings, limit)} reached"
    if p.qos and v5:
        reject(core, conn, p, RC.QUOTA_EXCEEDED, "retained message refused: " + text, counter=limit)
        return None
    # QoS 0 (and 3.1.1, which cannot refuse): delivered, not retained.
    core.stats.refused[limit] += 1
    core.rlog.warning(now, peer_host(conn.peer), limit, "%s (%s): PUBLISH to %r delivered but not retained: %s",
                      conn.peer, conn.client_id, topic[:200], text)
    return False


def spend_publish_token(core: BrokerState, conn: Connection, p: Publish, rate: float, now: float) -> bool:
    """``max_publish_rate``: take one token from ``conn``'s bucket (``rate`` tokens a second, holding at most one
    second's worth, at least 1); True when there was one. Without one, ``p`` waits: it becomes ``conn.deferred``
    and ``conn.paused_until`` is set to when the token is there; the broker keeps ``p`` and the bytes after it,
    and its action tells the I/O layer to stop reading from the connection until then (Mosquitto and EMQX
    throttle the same way, never disconnect). Each pause is counted (``$SYS/broker/refused/max_publish_rate``)
    and logged at most once a minute per address."""
    tokens = conn.tokens + (now - conn.tokens_at) * rate
    burst = rate if rate > 1.0 else 1.0
    if tokens > burst:
        tokens = burst
    conn.tokens_at = now
    if tokens > 0.999999:  # 1, give or take the rounding of (now - tokens_at) * rate
        conn.tokens = max(tokens - 1.0, 0.0)
        return True
    conn.tokens = tokens
    if conn.paused_until <= now:  # a new pause, not a resume that came a little early
        core.stats.refused["max_publish_rate"] += 1
        core.rlog.warning(now, peer_host(conn.peer), "max_publish_rate",
                          "%s (%s): more than max_publish_rate = %g PUBLISH/s; reading paused", conn.peer,
                          conn.client_id, rate)
    conn.paused_until = now + (1.0 - tokens) / rate
    conn.defer(p)
    return False


def refused(
    core: BrokerState, conn: Connection, p: Publish, entry: tuple[Message, float] | None, full: bool, now: float
) -> None:
    """The store could not commit what a QoS 1/2 PUBLISH caused (its barrier failed; ``full``: for lack of room):
    refuse it instead of leaving the publisher waiting (docs/architecture.md, "The durability contract"). The
    Receive Maximum count is given back, and a QoS 2 identifier (held as ``entry``) is released so that the
    client's retry is taken as new."""
    if p.qos == 1:
        conn.inbound_pending -= 1
    elif conn.session is not None:
        awaiting = conn.session.awaiting_rel
        pid = packet_id_of(p)
        if isinstance(awaiting, dict) and awaiting.get(pid) is entry:
            del awaiting[pid]
    refuse_unstored(core, conn, p, full, now)


def refuse_unstored(core: BrokerState, conn: Connection, p: Publish, full: bool, now: float) -> None:
    """Refuse a QoS 1/2 PUBLISH that cannot be made durable: MQTT 5 PUBACK/PUBREC 0x97 Quota
    exceeded when the store or its disk is full (else 0x80 Unspecified error, MQTT 5.0 §3.4.2.1); 3.1.1 has no
    way to refuse, so the publisher is not acknowledged and is disconnected. Counted per message in
    ``$SYS/broker/messages/dropped/store_full`` (``store_error``); logged at most once a minute per client
    address."""
    counter = "store_full" if full else "store_error"
    if conn.state != CONNECTED:
        core.stats.dropped[counter] += 1  # gone meanwhile: nothing to answer
        return
    reason = store_refusal(conn.version, full)
    if reason is not None:
        text = "the message store is full" if full else "the message could not be stored"
        reject(core, conn, p, reason, text, counter=counter)
        return
    core.stats.dropped[counter] += 1
    core.rlog.error(
        now,
        peer_host(conn.peer),
        counter + "_disconnect",
        "%s (%s): %s; QoS %d PUBLISH not acknowledged, disconnecting",
        conn.peer,
        conn.client_id,
        "store full" if full else "store write failed",
        p.qos,
    )
    close(core, conn, now, publish_will=False, reason="a QoS 1/2 PUBLISH could not be stored (3.1.1 cannot refuse)")


def reject(core: BrokerState, conn: Connection, p: Publish, reason: RC, text: str, counter: str | None = None) -> None:
    """Refuse one PUBLISH: counted, logged (rate-limited), PUBACK/PUBREC with ``reason`` (3.1.1: plain)."""
    counter = counter or reason.name.lower()
    core.stats.dropped[counter] += 1  # one refused message, one drop reason
    core.rlog.warning(
        conn.last_rx,
        peer_host(conn.peer),
        "publish_" + counter,
        "%s (%s): PUBLISH to %r refused: %s (0x%02X)",
        conn.peer,
        conn.client_id,
        p.topic[:200],
        text,
        reason,
    )
    if p.qos == 1:
        send(core, conn, PubAck(packet_id_of(p), publish_refusal(conn.version, reason)))
    elif p.qos == 2:
        send(core, conn, PubRec(packet_id_of(p), publish_refusal(conn.version, reason)))


def puback(core: BrokerState, conn: Connection, p: Publish, reason: int) -> None:
    """PUBACK a QoS 1 PUBLISH whose work is durable, with ``reason``; the common one (0, MQTT 5.0 §3.4.2.1: then the
    Reason Code may be left out) as its 4 bytes (:func:`~gateway.broker.output.send_ack`)."""
    if conn.state != CONNECTED:
        return
    if reason:
        send(core, conn, PubAck(packet_id_of(p), reason))
    else:
        send_ack(core, conn, PUBACK_BYTE, packet_id_of(p))


def puback_committed(core: BrokerState, conn: Connection, p: Publish, reason: int) -> None:
    """The barrier a QoS 1 PUBLISH's PUBACK was held under is committed: PUBACK it (:func:`puback`)."""
    conn.inbound_pending -= 1
    puback(core, conn, p, reason)
