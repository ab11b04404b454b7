"""The 15 MQTT control packets for protocol levels 3 (3.1), 4 (3.1.1) and 5 (5.0): classes, encode, decode.

Every packet class has ``encode(version) -> bytes`` (the whole packet, fixed header included) and is decoded by
:func:`decode_packet`. ``version`` is the Protocol Level: 3 and 4 encode the 3.1.1 wire format (reason codes and
properties are dropped), 5 the 5.0 one. Sources: MQTT 3.1.1 §2-3, MQTT 5.0 §2-3.
"""

from __future__ import annotations

from typing import ClassVar, Final, TypeVar

from gateway.mqtt.errors import MalformedPacket, MQTTError, ProtocolError, UnsupportedProtocolVersion
from gateway.mqtt.primitives import (
    decode_binary,
    decode_string,
    decode_u16,
    encode_binary,
    encode_string,
    encode_vbi,
    vbi_size,
)
from gateway.mqtt.properties import NO_PROPERTIES, WILL, Properties, decode_properties, encode_properties
from gateway.mqtt.reason_codes import ReasonCode
from gateway.mqtt.topics import require_topic

CONNECT: Final = 1
CONNACK: Final = 2
PUBLISH: Final = 3
PUBACK: Final = 4
PUBREC: Final = 5
PUBREL: Final = 6
PUBCOMP: Final = 7
SUBSCRIBE: Final = 8
SUBACK: Final = 9
UNSUBSCRIBE: Final = 10
UNSUBACK: Final = 11
PINGREQ: Final = 12
PINGRESP: Final = 13
DISCONNECT: Final = 14
AUTH: Final = 15

MQTT_3_1: Final = 3
MQTT_3_1_1: Final = 4
MQTT_5: Final = 5

PACKET_NAMES: Final = {
    1: "CONNECT",
    2: "CONNACK",
    3: "PUBLISH",
    4: "PUBACK",
    5: "PUBREC",
    6: "PUBREL",
    7: "PUBCOMP",
    8: "SUBSCRIBE",
    9: "SUBACK",
    10: "UNSUBSCRIBE",
    11: "UNSUBACK",
    12: "PINGREQ",
    13: "PINGRESP",
    14: "DISCONNECT",
    15: "AUTH",
}

#: Valid SUBACK return codes in MQTT 3.1.1 (§3.9.3): granted QoS 0-2 or 0x80 Failure.
SUBACK_FAILURE_311: Final = 0x80


def _frame(first_byte: int, body: bytes) -> bytes:
    n = len(body)
    if n < 128:
        return bytes((first_byte, n)) + body
    return bytes((first_byte,)) + encode_vbi(n) + body


def _id_and_properties(packet_id: int, properties: Properties, version: int) -> bytearray:
    """The variable header of SUBSCRIBE, SUBACK, UNSUBSCRIBE and UNSUBACK: the Packet Identifier, then (5.0 only)
    the properties."""
    body = bytearray(packet_id.to_bytes(2, "big"))
    if version == MQTT_5:
        body += encode_properties(properties)
    return body


class _Fields:
    """Equality and ``repr`` over the fields a class lists in ``_FIELDS``, as a dataclass has them.

    The packet classes are written out rather than made with ``@dataclass`` so that mypyc compiles them to native
    classes with a compiled ``__init__`` (its dataclass support leaves the generated ``__init__`` interpreted, and
    it counts a ``ClassVar`` such as ``TYPE`` as a field). Two objects are equal when they are of the same class and
    their fields are equal; like a dataclass with ``eq=True``, they are not hashable.
    """

    __slots__ = ()
    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self._FIELDS)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"{type(self).__qualname__}({fields})"


class Will(_Fields):
    """The Will Message carried in a CONNECT (MQTT 5.0 §3.1.2.5, §3.1.3.2-3.1.3.4)."""

    __slots__ = ("payload", "properties", "qos", "retain", "topic")
    _FIELDS: ClassVar[tuple[str, ...]] = ("topic", "payload", "qos", "retain", "properties")

    def __init__(
        self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False, properties: Properties | None = None
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties: Properties = {} if properties is None else properties


class Connect(_Fields):
    """CONNECT (MQTT 5.0 §3.1, MQTT 3.1.1 §3.1). ``protocol_level`` is 3, 4 or 5; ``keep_alive`` in seconds."""

    __slots__ = ("clean_start", "client_id", "keep_alive", "password", "properties", "protocol_level", "username",
                 "will")  # fmt: skip
    TYPE: ClassVar[int] = CONNECT
    _FIELDS: ClassVar[tuple[str, ...]] = ("client_id", "protocol_level", "clean_start", "keep_alive", "username",
                                          "password", "will", "properties")  # fmt: skip

    def __init__(
        self,
        client_id: str = "",
        protocol_level: int = MQTT_3_1_1,
        clean_start: bool = True,
        keep_alive: int = 0,
        username: str | None = None,
        password: bytes | None = None,
        will: Will | None = None,
        properties: Properties | None = None,
    ) -> None:
        self.client_id = client_id
        self.protocol_level = protocol_level
        self.clean_start = clean_start
        self.keep_alive = keep_alive
        self.username = username
        self.password = password
        self.will = will
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int | None = None) -> bytes:
        level = self.protocol_level if version is None else version
        name = b"\x00\x06MQIsdp" if level == MQTT_3_1 else b"\x00\x04MQTT"
        flags = 0
        if self.clean_start:
            flags |= 0x02
        will = self.will
        if will is not None:
            flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        if self.password is not None:
            flags |= 0x40
        if self.username is not None:
            flags |= 0x80
        body = bytearray(name)
        body += bytes((level, flags, self.keep_alive >> 8, self.keep_alive & 0xFF))
        if level == MQTT_5:
            body += encode_properties(self.properties)
        body += encode_string(self.client_id)
        if will is not None:
            if level == MQTT_5:
                body += encode_properties(will.properties)
            body += encode_string(will.topic)
            body += encode_binary(will.payload)
        if self.username is not None:
            body += encode_string(self.username)
        if self.password is not None:
            body += encode_binary(self.password)
        return _frame(0x10, bytes(body))


class Connack(_Fields):
    """CONNACK (MQTT 5.0 §3.2, MQTT 3.1.1 §3.2).

    ``reason_code`` is the 5.0 reason code; for 3.1.1 pass the 3.1.1 return code (0-5).
    """

    __slots__ = ("properties", "reason_code", "session_present")
    TYPE: ClassVar[int] = CONNACK
    _FIELDS: ClassVar[tuple[str, ...]] = ("session_present", "reason_code", "properties")

    def __init__(
        self, session_present: bool = False, reason_code: int = 0, properties: Properties | None = None
    ) -> None:
        self.session_present = session_present
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        body = bytes((1 if self.session_present else 0, self.reason_code))
        if version == MQTT_5:
            body += encode_properties(self.properties)
        return _frame(0x20, body)


class Publish(_Fields):
    """PUBLISH (MQTT 5.0 §3.3, MQTT 3.1.1 §3.3). ``packet_id`` is ``None`` for QoS 0."""

    __slots__ = ("dup", "packet_id", "payload", "properties", "qos", "retain", "topic")
    TYPE: ClassVar[int] = PUBLISH
    _FIELDS: ClassVar[tuple[str, ...]] = ("topic", "payload", "qos", "retain", "dup", "packet_id", "properties")

    def __init__(
        self,
        topic: str,
        payload: bytes = b"",
        qos: int = 0,
        retain: bool = False,
        dup: bool = False,
        packet_id: int | None = None,
        properties: Properties | None = None,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.dup = dup
        self.packet_id = packet_id
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        """The whole packet. Raises :class:`ValueError` for QoS 1 or 2 without a Packet Identifier."""
        first = 0x30 | (self.qos << 1) | (0x08 if self.dup else 0) | (1 if self.retain else 0)
        topic = self.topic.encode("utf-8")
        body = bytearray(len(topic).to_bytes(2, "big"))
        body += topic
        if self.qos:
            if self.packet_id is None:
                raise ValueError(f"a QoS {self.qos} PUBLISH needs a Packet Identifier (MQTT 5.0 §3.3.2.2)")
            body += self.packet_id.to_bytes(2, "big")
        if version == MQTT_5:
            body += encode_properties(self.properties)
        body += self.payload
        return _frame(first, bytes(body))


class _Ack(_Fields):
    """The shape shared by PUBACK, PUBREC, PUBREL and PUBCOMP (MQTT 5.0 §3.4-3.7)."""

    __slots__ = ("packet_id", "properties", "reason_code")
    TYPE: ClassVar[int] = 0
    FLAGS: ClassVar[int] = 0
    _FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "reason_code", "properties")

    def __init__(self, packet_id: int, reason_code: int = 0, properties: Properties | None = None) -> None:
        self.packet_id = packet_id
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        first = (self.TYPE << 4) | self.FLAGS
        pid = self.packet_id
        if version != MQTT_5 or (self.reason_code == 0 and not self.properties):
            return bytes((first, 2, pid >> 8, pid & 0xFF))
        if not self.properties:
            return bytes((first, 3, pid >> 8, pid & 0xFF, self.reason_code))
        body = bytes((pid >> 8, pid & 0xFF, self.reason_code)) + encode_properties(self.properties)
        return _frame(first, body)


class PubAck(_Ack):
    """PUBACK: the response to a QoS 1 PUBLISH (MQTT 5.0 §3.4)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PUBACK


class PubRec(_Ack):
    """PUBREC: QoS 2 delivery part 1 (MQTT 5.0 §3.5)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PUBREC


class PubRel(_Ack):
    """PUBREL: QoS 2 delivery part 2; fixed header flags 0b0010 (MQTT 5.0 §3.6)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PUBREL
    FLAGS: ClassVar[int] = 0x02


class PubComp(_Ack):
    """PUBCOMP: QoS 2 delivery part 3 (MQTT 5.0 §3.7)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PUBCOMP


class Subscription(_Fields):
    """One Topic Filter with its Subscription Options (MQTT 5.0 §3.8.3.1).

    ``retain_handling``: 0 send retained on subscribe, 1 only if the subscription is new, 2 never.
    """

    __slots__ = ("no_local", "qos", "retain_as_published", "retain_handling", "topic_filter")
    _FIELDS: ClassVar[tuple[str, ...]] = ("topic_filter", "qos", "no_local", "retain_as_published", "retain_handling")

    def __init__(
        self,
        topic_filter: str,
        qos: int = 0,
        no_local: bool = False,
        retain_as_published: bool = False,
        retain_handling: int = 0,
    ) -> None:
        self.topic_filter = topic_filter
        self.qos = qos
        self.no_local = no_local
        self.retain_as_published = retain_as_published
        self.retain_handling = retain_handling

    def options_byte(self, version: int) -> int:
        if version != MQTT_5:
            return self.qos
        return (
            self.qos
            | (0x04 if self.no_local else 0)
            | (0x08 if self.retain_as_published else 0)
            | (self.retain_handling << 4)
        )


class Subscribe(_Fields):
    """SUBSCRIBE (MQTT 5.0 §3.8, MQTT 3.1.1 §3.8); fixed header flags 0b0010."""

    __slots__ = ("packet_id", "properties", "subscriptions")
    TYPE: ClassVar[int] = SUBSCRIBE
    _FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "subscriptions", "properties")

    def __init__(
        self, packet_id: int, subscriptions: list[Subscription] | None = None, properties: Properties | None = None
    ) -> None:
        self.packet_id = packet_id
        self.subscriptions: list[Subscription] = [] if subscriptions is None else subscriptions
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        body = _id_and_properties(self.packet_id, self.properties, version)
        for sub in self.subscriptions:
            body += encode_string(sub.topic_filter)
            body.append(sub.options_byte(version))
        return _frame(0x82, bytes(body))


class _CodesAck(_Fields):
    """The shape shared by SUBACK and UNSUBACK: Packet Identifier, properties (5.0) and one Reason Code per Topic
    Filter."""

    __slots__ = ("packet_id", "properties", "reason_codes")
    TYPE: ClassVar[int] = 0
    _FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "reason_codes", "properties")

    def __init__(
        self, packet_id: int, reason_codes: list[int] | None = None, properties: Properties | None = None
    ) -> None:
        self.packet_id = packet_id
        self.reason_codes: list[int] = [] if reason_codes is None else reason_codes
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        body = _id_and_properties(self.packet_id, self.properties, version)
        body += bytes(self.reason_codes) if version == MQTT_5 else self._codes_311()
        return _frame(self.TYPE << 4, bytes(body))

    def _codes_311(self) -> bytes:
        """The codes in the 3.1.1 wire format."""
        return b""


class Suback(_CodesAck):
    """SUBACK (MQTT 5.0 §3.9, MQTT 3.1.1 §3.9): one reason code (3.1.1: return code) per Topic Filter."""

    __slots__ = ()
    TYPE: ClassVar[int] = SUBACK

    def _codes_311(self) -> bytes:
        return bytes(c if c < 0x80 else SUBACK_FAILURE_311 for c in self.reason_codes)


class Unsubscribe(_Fields):
    """UNSUBSCRIBE (MQTT 5.0 §3.10, MQTT 3.1.1 §3.10); fixed header flags 0b0010."""

    __slots__ = ("packet_id", "properties", "topic_filters")
    TYPE: ClassVar[int] = UNSUBSCRIBE
    _FIELDS: ClassVar[tuple[str, ...]] = ("packet_id", "topic_filters", "properties")

    def __init__(
        self, packet_id: int, topic_filters: list[str] | None = None, properties: Properties | None = None
    ) -> None:
        self.packet_id = packet_id
        self.topic_filters: list[str] = [] if topic_filters is None else topic_filters
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        body = _id_and_properties(self.packet_id, self.properties, version)
        for topic_filter in self.topic_filters:
            body += encode_string(topic_filter)
        return _frame(0xA2, bytes(body))


class Unsuback(_CodesAck):
    """UNSUBACK (MQTT 5.0 §3.11, MQTT 3.1.1 §3.11); reason codes exist in 5.0 only."""

    __slots__ = ()
    TYPE: ClassVar[int] = UNSUBACK


class PingReq(_Fields):
    """PINGREQ (MQTT 5.0 §3.12)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PINGREQ

    def encode(self, version: int = MQTT_5) -> bytes:
        return b"\xc0\x00"


class PingResp(_Fields):
    """PINGRESP (MQTT 5.0 §3.13)."""

    __slots__ = ()
    TYPE: ClassVar[int] = PINGRESP

    def encode(self, version: int = MQTT_5) -> bytes:
        return b"\xd0\x00"


class Disconnect(_Fields):
    """DISCONNECT (MQTT 5.0 §3.14, MQTT 3.1.1 §3.14); reason code and properties exist in 5.0 only."""

    __slots__ = ("properties", "reason_code")
    TYPE: ClassVar[int] = DISCONNECT
    _FIELDS: ClassVar[tuple[str, ...]] = ("reason_code", "properties")

    def __init__(self, reason_code: int = 0, properties: Properties | None = None) -> None:
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int) -> bytes:
        if version != MQTT_5 or (self.reason_code == 0 and not self.properties):
            return b"\xe0\x00"
        if not self.properties:
            return bytes((0xE0, 1, self.reason_code))
        return _frame(0xE0, bytes((self.reason_code,)) + encode_properties(self.properties))


class Auth(_Fields):
    """AUTH (MQTT 5.0 §3.15), 5.0 only."""

    __slots__ = ("properties", "reason_code")
    TYPE: ClassVar[int] = AUTH
    _FIELDS: ClassVar[tuple[str, ...]] = ("reason_code", "properties")

    def __init__(self, reason_code: int = 0, properties: Properties | None = None) -> None:
        self.reason_code = reason_code
        self.properties: Properties = {} if properties is None else properties

    def encode(self, version: int = MQTT_5) -> bytes:
        if self.reason_code == 0 and not self.properties:
            return b"\xf0\x00"
        return _frame(0xF0, bytes((self.reason_code,)) + encode_properties(self.properties))


Packet = (
    Connect
    | Connack
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)

# ---------------------------------------------------------------------------------------------- decoding

_AckT = TypeVar("_AckT", bound=_Ack)

#: Fixed header flag nibble each packet type must carry (MQTT 5.0 §2.1.3, [MQTT-2.1.3-1]); PUBLISH varies.
_REQUIRED_FLAGS: Final = {t: 0 for t in range(1, 16)}
_REQUIRED_FLAGS[PUBREL] = _REQUIRED_FLAGS[SUBSCRIBE] = _REQUIRED_FLAGS[UNSUBSCRIBE] = 0x02

#: MQTT 3.1 (Protocol Level 3), where [MQTT-2.1.3-1] does not apply yet: the flag nibble is DUP, QoS and RETAIN,
#: and DUP is set when a PUBREL, SUBSCRIBE or UNSUBSCRIBE is re-sent (MQTT 3.1 §2.1 "DUP"; a 3.1 client re-sends
#: PUBREL after a reconnect), so these three may also carry DUP + QoS 1 (0b1010). Their QoS stays 1 (3.1 §3.6,
#: §3.8, §3.10) and the other types' flags, which 3.1 calls "not used" and its senders leave 0, are checked as in
#: 3.1.1. Consulted only when a nibble differs from :data:`_REQUIRED_FLAGS`, so other levels pay nothing for it.
_MQTT_3_1_RETRY_FLAGS: Final = {PUBREL: 0x0A, SUBSCRIBE: 0x0A, UNSUBSCRIBE: 0x0A}

_VALID_REASONS: Final = frozenset(int(r) for r in ReasonCode)


def _check_end(pos: int, body: bytes) -> None:
    if pos != len(body):
        raise MalformedPacket(f"{len(body) - pos} unexpected bytes at the end of the packet")


def _decode_connect(body: bytes) -> Connect:
    try:
        name, pos = decode_string(body, 0)
    except MalformedPacket:
        raise UnsupportedProtocolVersion("CONNECT does not start with a Protocol Name", None) from None
    if pos >= len(body):
        raise MalformedPacket("CONNECT ends before the Protocol Level")
    level = body[pos]
    pos += 1
    if (name, level) not in (("MQTT", 4), ("MQTT", 5), ("MQIsdp", 3)):
        if name not in ("MQTT", "MQIsdp"):
            raise UnsupportedProtocolVersion(f"unknown Protocol Name {name!r} [MQTT-3.1.2-1]", None)
        raise UnsupportedProtocolVersion(
            f"unsupported Protocol Level {level} for {name!r} (this server speaks 3, 4 and 5) [MQTT-3.1.2-2]",
            level,
        )
    if pos + 3 > len(body):
        raise MalformedPacket("CONNECT ends inside the variable header")
    flags = body[pos]
    keep_alive = (body[pos + 1] << 8) | body[pos + 2]
    pos += 3
    if flags & 0x01:
        raise MalformedPacket("CONNECT flags reserved bit is not 0 [MQTT-3.1.2-3]")
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise MalformedPacket("Will QoS 3 [MQTT-3.1.2-14]")
    if not will_flag and (will_qos or will_retain):
        raise MalformedPacket("Will QoS/Retain set without the Will Flag [MQTT-3.1.2-13] [MQTT-3.1.2-15]")
    has_user = bool(flags & 0x80)
    has_password = bool(flags & 0x40)
    if level != MQTT_5 and has_password and not has_user:
        raise MalformedPacket("Password Flag set without User Name Flag [MQTT-3.1.2-22]")
    props: Properties = {}
    if level == MQTT_5:
        props, pos = decode_properties(body, pos, CONNECT)
    if level == MQTT_3_1 and pos == len(body):
        # MQTT 3.1 has no zero-length or server-assigned Client Identifier (1 to 23 characters): a payload that
        # ends where it should be is decoded as an empty one, which the broker refuses with CONNACK 0x02.
        return Connect("", level, bool(flags & 0x02), keep_alive)
    client_id, pos = decode_string(body, pos)
    will = None
    if will_flag:
        will_props: Properties = {}
        if level == MQTT_5:
            will_props, pos = decode_properties(body, pos, WILL)
        will_topic, pos = decode_string(body, pos)
        will_payload, pos = decode_binary(body, pos)
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    if has_user:
        username, pos = decode_string(body, pos)
    if has_password:
        password, pos = decode_binary(body, pos)
    _check_end(pos, body)
    return Connect(client_id, level, bool(flags & 0x02), keep_alive, username, password, will, props)


def _decode_connack(body: bytes, version: int) -> Connack:
    if len(body) < 2:
        raise MalformedPacket("CONNACK shorter than 2 bytes")
    if body[0] & 0xFE:
        raise MalformedPacket("CONNACK Acknowledge Flags reserved bits are not 0")
    props: Properties = {}
    pos = 2
    if version == MQTT_5:
        props, pos = decode_properties(body, pos, CONNACK)
    _check_end(pos, body)
    return Connack(bool(body[0] & 1), body[1], props)


def _decode_publish(flags: int, body: bytes, version: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3 [MQTT-3.3.1-4]")
    dup = bool(flags & 0x08)
    if dup and not qos:
        raise MalformedPacket("PUBLISH with DUP=1 and QoS 0 [MQTT-3.3.1-2]")
    topic, pos = decode_string(body, 0)
    if "+" in topic or "#" in topic:
        raise MQTTError(
            ReasonCode.TOPIC_NAME_INVALID, "PUBLISH Topic Name contains a wildcard character [MQTT-3.3.2-2]"
        )
    packet_id = None
    if qos:
        packet_id, pos = decode_u16(body, pos)
        if not packet_id:
            raise MalformedPacket("PUBLISH with Packet Identifier 0 [MQTT-2.2.1-3]")
    props = NO_PROPERTIES
    if version == MQTT_5:
        props, pos = decode_properties(body, pos, PUBLISH)
    elif not topic:
        require_topic(topic, "PUBLISH Topic Name")  # 5.0: the broker checks it once a Topic Alias is resolved
    return Publish(topic, body[pos:], qos, bool(flags & 1), dup, packet_id, props)


def _decode_ack(cls: type[_AckT], body: bytes, version: int) -> _AckT:
    packet_id, pos = decode_u16(body, 0)
    if not packet_id:
        raise MalformedPacket(f"{PACKET_NAMES[cls.TYPE]} with Packet Identifier 0 [MQTT-2.2.1-3]")
    if version != MQTT_5:
        _check_end(pos, body)
        return cls(packet_id)
    reason = 0
    props: Properties = {}
    if pos < len(body):
        reason = body[pos]
        pos += 1
        if reason not in _VALID_REASONS:
            raise MalformedPacket(f"{PACKET_NAMES[cls.TYPE]} with unknown Reason Code 0x{reason:02X}")
        if pos < len(body):
            props, pos = decode_properties(body, pos, cls.TYPE)
    _check_end(pos, body)
    return cls(packet_id, reason, props)


def _decode_id_and_properties(
    body: bytes, version: int, packet_type: int, nonzero_id: bool = False
) -> tuple[int, Properties, int]:
    """The variable header of SUBSCRIBE, SUBACK, UNSUBSCRIBE and UNSUBACK (see :func:`_id_and_properties`):
    ``(packet_id, properties, position after them)``; ``nonzero_id`` refuses Packet Identifier 0 [MQTT-2.2.1-3]."""
    packet_id, pos = decode_u16(body, 0)
    if nonzero_id and not packet_id:
        raise MalformedPacket(f"{PACKET_NAMES[packet_type]} with Packet Identifier 0 [MQTT-2.2.1-3]")
    props: Properties = {}
    if version == MQTT_5:
        props, pos = decode_properties(body, pos, packet_type)
    return packet_id, props, pos


def _decode_subscribe(body: bytes, version: int) -> Subscribe:
    packet_id, props, pos = _decode_id_and_properties(body, version, SUBSCRIBE, nonzero_id=True)
    subs: list[Subscription] = []
    end = len(body)
    while pos < end:
        topic_filter, pos = decode_string(body, pos)
        require_topic(topic_filter, "SUBSCRIBE Topic Filter")
        if pos >= end:
            raise MalformedPacket("SUBSCRIBE Topic Filter without Subscription Options")
        opts = body[pos]
        pos += 1
        qos = opts & 0x03
        if qos == 3:
            raise MalformedPacket("SUBSCRIBE with requested QoS 3 [MQTT-3-8.3-4]")
        if version == MQTT_5:
            if opts & 0xC0:
                raise MalformedPacket("SUBSCRIBE Subscription Options reserved bits are not 0 [MQTT-3.8.3-5]")
            retain_handling = (opts >> 4) & 0x03
            if retain_handling == 3:
                raise ProtocolError("SUBSCRIBE with Retain Handling 3 (MQTT 5.0 §3.8.3.1)")
            subs.append(Subscription(topic_filter, qos, bool(opts & 0x04), bool(opts & 0x08), retain_handling))
        else:
            if opts & 0xFC:
                raise MalformedPacket("SUBSCRIBE requested QoS byte reserved bits are not 0 [MQTT-3.8.3-4]")
            subs.append(Subscription(topic_filter, qos))
    if not subs:
        if version == MQTT_5:
            raise ProtocolError("SUBSCRIBE with no Topic Filter [MQTT-3.8.3-2]")
        raise MalformedPacket("SUBSCRIBE with no Topic Filter [MQTT-3.8.3-3]")
    return Subscribe(packet_id, subs, props)


def _decode_suback(body: bytes, version: int) -> Suback:
    packet_id, props, pos = _decode_id_and_properties(body, version, SUBACK)
    return Suback(packet_id, list(body[pos:]), props)


def _decode_unsubscribe(body: bytes, version: int) -> Unsubscribe:
    packet_id, props, pos = _decode_id_and_properties(body, version, UNSUBSCRIBE, nonzero_id=True)
    filters: list[str] = []
    while pos < len(body):
        topic_filter, pos = decode_string(body, pos)
        filters.append(require_topic(topic_filter, "UNSUBSCRIBE Topic Filter"))
    if not filters:
        if version == MQTT_5:
            raise ProtocolError("UNSUBSCRIBE with no Topic Filter [MQTT-3.10.3-2]")
        raise MalformedPacket("UNSUBSCRIBE with no Topic Filter [MQTT-3.10.3-2]")
    return Unsubscribe(packet_id, filters, props)


def _decode_unsuback(body: bytes, version: int) -> Unsuback:
    packet_id, props, pos = _decode_id_and_properties(body, version, UNSUBACK)
    if version != MQTT_5:
        _check_end(pos, body)
        return Unsuback(packet_id)
    return Unsuback(packet_id, list(body[pos:]), props)


def _decode_reason_and_props(body: bytes, packet_type: int) -> tuple[int, Properties]:
    if not body:
        return 0, {}
    reason = body[0]
    if reason not in _VALID_REASONS:
        raise MalformedPacket(f"{PACKET_NAMES[packet_type]} with unknown Reason Code 0x{reason:02X}")
    props: Properties = {}
    pos = 1
    if len(body) > 1:
        props, pos = decode_properties(body, 1, packet_type)
    _check_end(pos, body)
    return reason, props


def decode_packet(first_byte: int, body: bytes, version: int) -> Packet:
    """Decode one control packet from its first byte and its body (the bytes after the Remaining Length).

    Args:
        first_byte: packet type (high nibble) and flags (low nibble).
        body: exactly Remaining Length bytes.
        version: the connection's Protocol Level (3, 4 or 5); ignored for CONNECT, which carries its own.

    Raises:
        MalformedPacket: reserved type 0, wrong fixed header flags [MQTT-2.1.3-1] (level 3 also takes DUP on a
            re-sent PUBREL, SUBSCRIBE or UNSUBSCRIBE: MQTT 3.1 §2.1), lengths that do not add up, bad strings, bad
            properties.
        ProtocolError: well-formed but forbidden content (wildcards in a PUBLISH Topic Name, duplicate
            properties, AUTH on 3.1.1, ...).
        UnsupportedProtocolVersion: a CONNECT with an unknown Protocol Name or Level.
    """
    ptype = first_byte >> 4
    flags = first_byte & 0x0F
    if ptype == PUBLISH:
        return _decode_publish(flags, body, version)
    if ptype == 0:
        raise MalformedPacket("reserved control packet type 0 (MQTT 5.0 §2.1.2)")
    if flags != _REQUIRED_FLAGS[ptype] and (version != MQTT_3_1 or flags != _MQTT_3_1_RETRY_FLAGS.get(ptype)):
        rule = "MQTT 3.1 §2.1" if version == MQTT_3_1 else "[MQTT-2.1.3-1]"
        raise MalformedPacket(f"{PACKET_NAMES[ptype]} with invalid fixed header flags 0x{flags:X} {rule}")
    if ptype == PUBACK:
        return _decode_ack(PubAck, body, version)
    if ptype == PUBREC:
        return _decode_ack(PubRec, body, version)
    if ptype == PUBREL:
        return _decode_ack(PubRel, body, version)
    if ptype == PUBCOMP:
        return _decode_ack(PubComp, body, version)
    if ptype == CONNECT:
        return _decode_connect(body)
    if ptype == SUBSCRIBE:
        return _decode_subscribe(body, version)
    if ptype == UNSUBSCRIBE:
        return _decode_unsubscribe(body, version)
    if ptype in (PINGREQ, PINGRESP):
        if body:
            raise MalformedPacket(f"{PACKET_NAMES[ptype]} with a non-empty body")
        return PingReq() if ptype == PINGREQ else PingResp()
    if ptype == DISCONNECT:
        if version != MQTT_5:
            _check_end(0, body)
            return Disconnect()
        reason, props = _decode_reason_and_props(body, DISCONNECT)
        return Disconnect(reason, props)
    if ptype == AUTH:
        if version != MQTT_5:
            raise MalformedPacket("AUTH does not exist in MQTT 3.1.1 (type 15 is reserved)")
        reason, props = _decode_reason_and_props(body, AUTH)
        return Auth(reason, props)
    if ptype == CONNACK:
        return _decode_connack(body, version)
    if ptype == SUBACK:
        return _decode_suback(body, version)
    return _decode_unsuback(body, version)


def publish_size(topic_bytes: int, payload_bytes: int, qos: int, properties_bytes: int) -> int:
    """Bytes of a whole PUBLISH packet, fixed header included, without encoding it: what a receiver compares with
    its Maximum Packet Size (MQTT 5.0 §3.1.2.11.4, §3.2.2.3.6: "the total number of bytes in an MQTT Control
    Packet").

    Args:
        topic_bytes: the Topic Name's UTF-8 bytes (0 when a Topic Alias replaces it).
        payload_bytes: the payload's bytes.
        qos: 0 (no Packet Identifier), 1 or 2.
        properties_bytes: the encoded properties with their Property Length (``len(encode_properties(p))``; at
            least 1 for MQTT 5.0), or 0 for MQTT 3.1 / 3.1.1.
    """
    remaining = 2 + topic_bytes + (2 if qos else 0) + properties_bytes + payload_bytes
    return 1 + vbi_size(remaining) + remaining


def encode_publish_parts(
    topic: str, payload: bytes, qos: int, retain: bool, properties: Properties | None, version: int
) -> tuple[bytes, bytes]:
    """Encode a PUBLISH as ``(head, tail)`` so that ``head + packet_id + tail`` (QoS 1/2) or ``head + tail``
    (QoS 0) is the whole packet; the parts are reused across subscribers (one encode per variant).

    Set DUP by OR-ing 0x08 into ``head[0]``. MQTT 5.0 §3.3.
    """
    topic_b = topic.encode("utf-8")
    props = encode_properties(properties) if version == MQTT_5 else b""
    length = 2 + len(topic_b) + (2 if qos else 0) + len(props) + len(payload)
    first = 0x30 | (qos << 1) | (1 if retain else 0)
    if length < 128:
        head = bytes((first, length, len(topic_b) >> 8, len(topic_b) & 0xFF)) + topic_b
    else:
        head = bytes((first,)) + encode_vbi(length) + len(topic_b).to_bytes(2, "big") + topic_b
    return head, props + payload
