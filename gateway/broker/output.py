"""Packets onto a connection's output: encode, respect the client's Maximum Packet Size, queue the bytes on
``Connection.out`` and mark the connection dirty; at the end of each input the output is handed out as the
input's actions (:func:`hand_out`), which the I/O layer performs. A PUBLISH is encoded once per (Protocol Level,
QoS, RETAIN) variant and reused for every subscriber."""

from __future__ import annotations

from typing import Any, Final

from gateway.broker.actions import NO_ACTIONS, Action
from gateway.broker.message import Message
from gateway.broker.session_state import Connection, aliases_out_for_write
from gateway.broker.state import BrokerState
from gateway.mqtt.packets import MQTT_5, encode_publish_parts
from gateway.mqtt.properties import PropertyId as P


def hand_out(core: BrokerState) -> list[Action]:
    """The actions of the input just handled: each connection with packets to write or a close, its packets
    handed over (the connection gets a new list)."""
    dirty = core.dirty
    if not dirty:
        return NO_ACTIONS
    new = tuple.__new__
    actions = []
    for conn in dirty:
        out = conn.out
        if out:
            conn.out = []
        actions.append(new(Action, (conn, out, conn.closing, conn.close_reason, 0.0, False)))
    dirty.clear()
    return actions


def send(core: BrokerState, conn: Connection, packet: Any) -> None:
    """Queue ``packet`` for ``conn``; dropped (counted) if over the client's Maximum Packet Size even without its
    Reason String and User Properties [MQTT-3.1.2-25]."""
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
            core.stats.dropped["packet_too_large"] += 1
            return
    conn.out.append(data)
    core.stats.sent[packet.TYPE] += 1
    core.dirty.add(conn)


#: The first byte of each acknowledgement of a PUBLISH flow (MQTT 5.0 §3.4-3.7; PUBREL's flags are 0010).
PUBACK_BYTE: Final = 0x40
PUBREC_BYTE: Final = 0x50
PUBREL_BYTE: Final = 0x62
PUBCOMP_BYTE: Final = 0x70


def send_ack(core: BrokerState, conn: Connection, first: int, pid: int) -> None:
    """Queue a plain PUBACK, PUBREC, PUBREL or PUBCOMP (``first``: its first byte, ``*_BYTE``) for Packet Identifier
    ``pid``: 4 bytes, Reason Code 0 left out as MQTT 5.0 §3.4.2.1 allows (3.1.1 has none), no packet object.
    Dropped (counted) if the client's Maximum Packet Size is below 4 bytes [MQTT-3.1.2-25]."""
    limit = conn.max_packet_size
    if limit is not None and limit < 4:
        core.stats.dropped["packet_too_large"] += 1
        return
    conn.out.append(bytes((first, 2, pid >> 8, pid & 0xFF)))
    core.stats.sent[first >> 4] += 1
    core.dirty.add(conn)


def send_raw(core: BrokerState, conn: Connection, data: bytes) -> None:
    """Queue bytes already encoded (a CONNACK before the Protocol Level is known)."""
    conn.out.append(data)
    core.dirty.add(conn)


def write_publish(
    core: BrokerState,
    conn: Connection,
    message: Message,
    qos: int,
    retain: bool,
    pid: int,
    dup: bool,
    sub_ids: list[int],
    now: float,
) -> bool:
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
        parts = None
        if retain:
            # Retained messages go to new subscribers one message after another: each is encoded once and kept
            # while it is the retained one (RetainedMessages.encoded), not once per subscriber.
            hit = core.retained.encoded.get(message.mid)
            if hit is not None and hit[0] == version and hit[1] == qos:
                parts = hit[2]
        if parts is None:
            cache = core.enc_cache
            if core.enc_mid != message.mid:
                core.enc_mid = message.mid
                cache.clear()
            else:
                parts = cache.get((version, qos, retain))
            if parts is None:
                parts = cache[(version, qos, retain)] = encode_publish_parts(
                    topic, message.payload, qos, retain, props, version
                )
                if retain and core.retained.get(topic) is message:
                    core.retained.encoded[message.mid] = (version, qos, parts)
        head, tail = parts
    if dup:
        head = bytes((head[0] | 0x08,)) + head[1:]
    limit = conn.max_packet_size
    if limit is not None and len(head) + len(tail) + (2 if qos else 0) > limit:
        core.stats.dropped["packet_too_large"] += 1
        return False
    if new_alias:
        # Only a PUBLISH actually sent sets up an alias on the client's side.
        aliases_out_for_write(conn)[topic] = new_alias
    out = conn.out
    if qos:
        out.append(head + pid.to_bytes(2, "big"))
    else:
        out.append(head)
    out.append(tail)
    core.stats.sent_qos[qos] += 1
    core.dirty.add(conn)
    return True
