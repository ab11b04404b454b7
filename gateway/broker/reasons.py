"""The one place that turns an outcome into what each protocol level can say about it.

MQTT 5.0 has a Reason Code for every refusal (MQTT 5.0 §2.4); MQTT 3.1.1 has CONNACK return codes 1-5, SUBACK
0x80, and nothing else: a refused PUBLISH is acknowledged as if accepted or the connection is closed, and the
server never sends DISCONNECT. Each function takes the connection's Protocol Level (3, 4 or 5) and the 5.0 code,
and answers with the code to send at that level, or ``None``: close the connection without a packet.

The per-message ones (PUBACK, PUBREC of an accepted PUBLISH) are tables indexed by the level, not functions, so
the hot path costs no extra call.
"""

from __future__ import annotations

from typing import Final

from gateway.mqtt.packets import MQTT_5, SUBACK_FAILURE_311, Connack, Disconnect
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import CONNACK_311, ReasonCode

RC: Final = ReasonCode

#: The PUBACK Reason Code of an accepted QoS 1 PUBLISH that no subscription matched, by Protocol Level (5.0:
#: 0x10 No matching subscribers, MQTT 5.0 §3.4.2.1; 3.1.1: plain PUBACK).
PUBACK_NO_MATCHING: Final[dict[int, int]] = {3: 0, 4: 0, MQTT_5: RC.NO_MATCHING_SUBSCRIBERS}

#: Reason Strings are cut to this many characters (they are diagnostics, and count against Maximum Packet Size).
REASON_STRING_MAX: Final = 200


def connack_refusal(version: int, reason: ReasonCode) -> int | None:
    """The CONNACK code that refuses a CONNECT for ``reason`` at ``version``: the 5.0 reason code, the 3.1.1
    return code it maps to (MQTT 3.1.1 §3.2.2.3), or ``None`` when 3.1.1 has none: close without CONNACK
    [MQTT-3.2.2-5]."""
    if version == MQTT_5:
        return reason
    code = CONNACK_311.get(reason)
    return None if code is None else int(code)


def connack_refusal_packet(version: int, reason: ReasonCode, text: str) -> Connack | None:
    """The CONNACK that refuses a CONNECT (5.0 with ``text`` as its Reason String), or ``None``: just close."""
    code = connack_refusal(version, reason)
    if code is None:
        return None
    if version == MQTT_5:
        return Connack(False, code, {P.REASON_STRING: text[:REASON_STRING_MAX]})
    return Connack(False, code)


def unsupported_version_connack(level: int | None) -> tuple[int, Connack] | None:
    """The CONNACK for a CONNECT of an unsupported Protocol Level, and the level to encode it at: 5.0 0x84, the
    3.1.1 return code 0x01 [MQTT-3.1.2-2] otherwise; ``None`` when the level is unknown (not MQTT at all)."""
    if level == MQTT_5:
        return MQTT_5, Connack(False, RC.UNSUPPORTED_PROTOCOL_VERSION)
    if level is not None:
        return 4, Connack(False, 0x01)
    return None


def disconnect(version: int, reason: ReasonCode, text: str | None = None) -> Disconnect | None:
    """The DISCONNECT the server sends before it closes a connection for ``reason`` (5.0 only: a 3.1.1 server
    never sends DISCONNECT, it closes), with ``text`` as the Reason String if given."""
    if version != MQTT_5:
        return None
    if text is None:
        return Disconnect(reason)
    return Disconnect(reason, {P.REASON_STRING: text[:REASON_STRING_MAX]})


def publish_refusal(version: int, reason: ReasonCode) -> int:
    """The PUBACK/PUBREC Reason Code refusing a QoS 1/2 PUBLISH: ``reason`` in 5.0; 3.1.1 has no way to refuse,
    so the message is dropped and acknowledged (0)."""
    return reason if version == MQTT_5 else 0


def store_refusal(version: int, full: bool) -> ReasonCode | None:
    """How a QoS 1/2 PUBLISH the store could not take is refused (nothing is acknowledged that
    is not stored): 5.0 PUBACK/PUBREC 0x97 Quota
    exceeded when the store or disk is full, else 0x80 Unspecified error; ``None`` for 3.1.1, which cannot
    refuse: the publisher is not acknowledged and is disconnected."""
    if version != MQTT_5:
        return None
    return RC.QUOTA_EXCEEDED if full else RC.UNSPECIFIED_ERROR


def suback_failure(version: int, reason: ReasonCode) -> int:
    """The SUBACK code refusing one Topic Filter: ``reason`` in 5.0, 0x80 in 3.1.1."""
    return reason if version == MQTT_5 else SUBACK_FAILURE_311


def unknown_packet_id(version: int) -> int:
    """The PUBREL/PUBCOMP Reason Code answering a PUBREC/PUBREL for a Packet Identifier the server does not know
    (a PUBREL re-sent after the PUBCOMP was lost still gets PUBCOMP): 5.0 0x92 (MQTT 5.0 §3.6.2.1, §3.7.2.1),
    3.1.1 plain."""
    return RC.PACKET_IDENTIFIER_NOT_FOUND if version == MQTT_5 else 0
