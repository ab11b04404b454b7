"""MQTT 5.0 properties (MQTT 5.0 §2.2.2): identifiers, types, per-packet allow-lists, encode and decode.

Properties travel as a plain ``dict[int, value]`` keyed by :class:`PropertyId`. Value shapes:

- byte / Two Byte / Four Byte / Variable Byte Integer properties: ``int``
- UTF-8 string properties: ``str``; Binary Data: ``bytes``
- ``USER_PROPERTY``: ``list[tuple[str, str]]`` in order (it may appear many times, MQTT 5.0 §3.1.2.11.8)
- ``SUBSCRIPTION_IDENTIFIER``: ``list[int]`` (many in PUBLISH, at most one in SUBSCRIBE)
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Final

from gateway.mqtt.errors import MalformedPacket, ProtocolError
from gateway.mqtt.primitives import (
    decode_binary,
    decode_string,
    decode_u16,
    decode_u32,
    decode_vbi,
    encode_binary,
    encode_string,
    encode_u16,
    encode_u32,
    encode_vbi,
)

Properties = dict[int, Any]

#: The properties of a packet that has none: one shared object, to be read and never mutated (copy first).
NO_PROPERTIES: Final[Properties] = {}


class PropertyId(IntEnum):
    """Property identifiers (MQTT 5.0 §2.2.2.2, Table 2-4)."""

    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


P: Final = PropertyId

_BYTE: Final = 0
_U16: Final = 1
_U32: Final = 2
_VBI: Final = 3
_STR: Final = 4
_BIN: Final = 5
_PAIR: Final = 6

#: Data type of each property (MQTT 5.0 §2.2.2.2).
PROPERTY_TYPES: Final[dict[int, int]] = {
    P.PAYLOAD_FORMAT_INDICATOR: _BYTE,
    P.MESSAGE_EXPIRY_INTERVAL: _U32,
    P.CONTENT_TYPE: _STR,
    P.RESPONSE_TOPIC: _STR,
    P.CORRELATION_DATA: _BIN,
    P.SUBSCRIPTION_IDENTIFIER: _VBI,
    P.SESSION_EXPIRY_INTERVAL: _U32,
    P.ASSIGNED_CLIENT_IDENTIFIER: _STR,
    P.SERVER_KEEP_ALIVE: _U16,
    P.AUTHENTICATION_METHOD: _STR,
    P.AUTHENTICATION_DATA: _BIN,
    P.REQUEST_PROBLEM_INFORMATION: _BYTE,
    P.WILL_DELAY_INTERVAL: _U32,
    P.REQUEST_RESPONSE_INFORMATION: _BYTE,
    P.RESPONSE_INFORMATION: _STR,
    P.SERVER_REFERENCE: _STR,
    P.REASON_STRING: _STR,
    P.RECEIVE_MAXIMUM: _U16,
    P.TOPIC_ALIAS_MAXIMUM: _U16,
    P.TOPIC_ALIAS: _U16,
    P.MAXIMUM_QOS: _BYTE,
    P.RETAIN_AVAILABLE: _BYTE,
    P.USER_PROPERTY: _PAIR,
    P.MAXIMUM_PACKET_SIZE: _U32,
    P.WILDCARD_SUBSCRIPTION_AVAILABLE: _BYTE,
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: _BYTE,
    P.SHARED_SUBSCRIPTION_AVAILABLE: _BYTE,
}

#: Pseudo packet type for the Will Properties inside a CONNECT payload (MQTT 5.0 §3.1.3.2).
WILL: Final = 0

_ACKS = {P.REASON_STRING, P.USER_PROPERTY}
_MESSAGE = {
    P.PAYLOAD_FORMAT_INDICATOR,
    P.MESSAGE_EXPIRY_INTERVAL,
    P.CONTENT_TYPE,
    P.RESPONSE_TOPIC,
    P.CORRELATION_DATA,
    P.USER_PROPERTY,
}

#: Which properties each packet type may carry, keyed by packet type (1..15; ``WILL`` = 0).
ALLOWED: Final[dict[int, frozenset[int]]] = {
    WILL: frozenset(_MESSAGE | {P.WILL_DELAY_INTERVAL}),
    1: frozenset(
        {
            P.SESSION_EXPIRY_INTERVAL,
            P.AUTHENTICATION_METHOD,
            P.AUTHENTICATION_DATA,
            P.REQUEST_PROBLEM_INFORMATION,
            P.REQUEST_RESPONSE_INFORMATION,
            P.RECEIVE_MAXIMUM,
            P.TOPIC_ALIAS_MAXIMUM,
            P.USER_PROPERTY,
            P.MAXIMUM_PACKET_SIZE,
        }
    ),
    2: frozenset(
        {
            P.SESSION_EXPIRY_INTERVAL,
            P.ASSIGNED_CLIENT_IDENTIFIER,
            P.SERVER_KEEP_ALIVE,
            P.AUTHENTICATION_METHOD,
            P.AUTHENTICATION_DATA,
            P.RESPONSE_INFORMATION,
            P.SERVER_REFERENCE,
            P.REASON_STRING,
            P.RECEIVE_MAXIMUM,
            P.TOPIC_ALIAS_MAXIMUM,
            P.MAXIMUM_QOS,
            P.RETAIN_AVAILABLE,
            P.USER_PROPERTY,
            P.MAXIMUM_PACKET_SIZE,
            P.WILDCARD_SUBSCRIPTION_AVAILABLE,
            P.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
            P.SHARED_SUBSCRIPTION_AVAILABLE,
        }
    ),
    3: frozenset(_MESSAGE | {P.TOPIC_ALIAS, P.SUBSCRIPTION_IDENTIFIER}),
    4: frozenset(_ACKS),
    5: frozenset(_ACKS),
    6: frozenset(_ACKS),
    7: frozenset(_ACKS),
    8: frozenset({P.SUBSCRIPTION_IDENTIFIER, P.USER_PROPERTY}),
    9: frozenset(_ACKS),
    10: frozenset({P.USER_PROPERTY}),
    11: frozenset(_ACKS),
    14: frozenset({P.SESSION_EXPIRY_INTERVAL, P.SERVER_REFERENCE, P.REASON_STRING, P.USER_PROPERTY}),
    15: frozenset({P.AUTHENTICATION_METHOD, P.AUTHENTICATION_DATA, P.REASON_STRING, P.USER_PROPERTY}),
}

# Byte properties whose only legal values are 0 and 1 (a Protocol Error otherwise).
_BOOLEAN: Final = frozenset(
    {
        P.PAYLOAD_FORMAT_INDICATOR,
        P.REQUEST_PROBLEM_INFORMATION,
        P.REQUEST_RESPONSE_INFORMATION,
        P.MAXIMUM_QOS,
        P.RETAIN_AVAILABLE,
        P.WILDCARD_SUBSCRIPTION_AVAILABLE,
        P.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
        P.SHARED_SUBSCRIPTION_AVAILABLE,
    }
)
_NONZERO: Final = frozenset({P.RECEIVE_MAXIMUM, P.MAXIMUM_PACKET_SIZE, P.SUBSCRIPTION_IDENTIFIER, P.TOPIC_ALIAS})


def decode_properties(buf: bytes, pos: int, packet_type: int) -> tuple[Properties, int]:
    """Decode a Property Length and the properties after it.

    Args:
        buf: the packet body; pos: where the Property Length starts.
        packet_type: the control packet type (1..15), or :data:`WILL` for Will Properties.

    Returns:
        ``(properties, new_pos)``.

    Raises:
        MalformedPacket: an identifier not valid for this packet type or a value of the wrong type
            (MQTT 5.0 §2.2.2.2), lengths that do not add up.
        ProtocolError: a property other than User Property (or Subscription Identifier in PUBLISH) included
            more than once, or a value outside its range (e.g. Receive Maximum 0, MQTT 5.0 §3.1.2.11.3; Payload
            Format Indicator not 0/1).
    """
    length, pos = decode_vbi(buf, pos)
    end = pos + length
    if end > len(buf):
        raise MalformedPacket("Property Length runs past the end of the packet")
    if not length:
        return NO_PROPERTIES, pos
    props: Properties = {}
    allowed = ALLOWED[packet_type]
    view = buf[:end]
    while pos < end:
        ident, pos = decode_vbi(view, pos)
        if ident not in allowed:
            name = PropertyId(ident).name if ident in PROPERTY_TYPES else f"0x{ident:02X}"
            raise MalformedPacket(f"property {name} is not allowed in this packet (MQTT 5.0 §2.2.2.2)")
        kind = PROPERTY_TYPES[ident]
        value: Any
        if kind == _BYTE:
            if pos >= end:
                raise MalformedPacket("property value runs past the Property Length")
            value = view[pos]
            pos += 1
        elif kind == _U32:
            value, pos = decode_u32(view, pos)
        elif kind == _U16:
            value, pos = decode_u16(view, pos)
        elif kind == _STR:
            value, pos = decode_string(view, pos)
        elif kind == _BIN:
            value, pos = decode_binary(view, pos)
        elif kind == _VBI:
            value, pos = decode_vbi(view, pos)
        else:  # _PAIR
            key, pos = decode_string(view, pos)
            val, pos = decode_string(view, pos)
            props.setdefault(ident, []).append((key, val))
            continue
        if ident == P.SUBSCRIPTION_IDENTIFIER:
            if value == 0:
                raise ProtocolError("Subscription Identifier 0 is a Protocol Error (MQTT 5.0 §3.8.2.1.2)")
            ids = props.setdefault(ident, [])
            if ids and packet_type != 3:
                raise ProtocolError("Subscription Identifier included more than once")
            ids.append(value)
            continue
        if ident in props:
            raise ProtocolError(f"property {PropertyId(ident).name} included more than once")
        if ident in _BOOLEAN and value > 1:
            raise ProtocolError(f"property {PropertyId(ident).name} must be 0 or 1, got {value}")
        if ident in _NONZERO and value == 0:
            raise ProtocolError(f"property {PropertyId(ident).name} must not be 0")
        props[ident] = value
    return props, pos


def encode_properties(props: Properties | None) -> bytes:
    """Encode properties with their Property Length prefix (MQTT 5.0 §2.2.2.1).

    Raises:
        ValueError: a value out of range for its type.
    """
    if not props:
        return b"\x00"
    out = bytearray()
    for ident, value in props.items():
        kind = PROPERTY_TYPES[ident]
        if kind == _PAIR:
            for key, val in value:
                out.append(ident)
                out += encode_string(key)
                out += encode_string(val)
            continue
        if ident == P.SUBSCRIPTION_IDENTIFIER:
            for sid in value:
                out.append(ident)
                out += encode_vbi(sid)
            continue
        out.append(ident)
        if kind == _BYTE:
            out.append(value)
        elif kind == _U32:
            out += encode_u32(value)
        elif kind == _U16:
            out += encode_u16(value)
        elif kind == _STR:
            out += encode_string(value)
        elif kind == _BIN:
            out += encode_binary(value)
        else:
            out += encode_vbi(value)
    return encode_vbi(len(out)) + bytes(out)
