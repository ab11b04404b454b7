"""Malformed and forbidden input: the codec must refuse it with the right error class and reason code.

Error classes (gateway.mqtt.errors) and the MQTT 5.0 reason code each carries (MQTT 5.0 §4.13, §2.4):
MalformedPacket 0x81, ProtocolError 0x82, UnsupportedProtocolVersion 0x84, PacketTooLarge 0x95, and a plain
MQTTError with Topic Name invalid 0x90 for wildcards in a PUBLISH Topic Name.

Tests named ``test_mqtt_x_y_z_n_...`` check that normative statement (MQTT 5.0 ids unless the name says ``v311``).
Every packet here is fed through :class:`PacketReader` as it would arrive from the network, unless the test is
about a single data-type decoder.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.mqtt.errors import MalformedPacket, MQTTError, PacketTooLarge, ProtocolError, UnsupportedProtocolVersion
from gateway.mqtt.framing import ABSOLUTE_MAX_PACKET_SIZE, PacketReader
from gateway.mqtt.packets import (
    PUBREL,
    SUBSCRIBE,
    UNSUBSCRIBE,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
    decode_packet,
)
from gateway.mqtt.primitives import check_string, decode_binary, decode_string, decode_u16, decode_u32, decode_vbi
from gateway.mqtt.properties import PropertyId, decode_properties
from gateway.mqtt.reason_codes import ReasonCode

P = PropertyId
V31 = 3
V311 = 4
V5 = 5
BOTH = pytest.mark.parametrize("version", [V311, V5])

MALFORMED = ReasonCode.MALFORMED_PACKET
PROTOCOL = ReasonCode.PROTOCOL_ERROR


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def frame(first: int, body: bytes) -> bytes:
    """A packet with the given first byte and body; the Remaining Length is computed here, independently."""
    n = len(body)
    length = bytearray()
    while True:
        byte, n = n % 128, n // 128
        length.append(byte | (0x80 if n else 0))
        if not n:
            return bytes((first, *length)) + body


def string(raw: bytes) -> bytes:
    """A UTF-8 Encoded String field around arbitrary (possibly invalid) bytes."""
    return len(raw).to_bytes(2, "big") + raw


def feed(data: bytes, version: int = V5, max_packet_size: int = ABSOLUTE_MAX_PACKET_SIZE) -> list[Packet]:
    return list(PacketReader(max_packet_size, version).feed(data))


def rejects(data: bytes, version: int, error: type[MQTTError], code: int) -> MQTTError:
    """Feed ``data`` and require exactly ``error`` with reason ``code``."""
    with pytest.raises(MQTTError) as info:
        feed(data, version)
    assert type(info.value) is error, repr(info.value)
    assert info.value.reason_code == code
    return info.value


def malformed(data: bytes, version: int = V5) -> None:
    rejects(data, version, MalformedPacket, MALFORMED)


def protocol_error(data: bytes, version: int = V5) -> None:
    rejects(data, version, ProtocolError, PROTOCOL)


def publish_v5(props: bytes, topic: bytes = b"\x00\x01t") -> bytes:
    """A QoS 0 5.0 PUBLISH whose property block (Property Length included) is ``props``."""
    return frame(0x30, topic + props + b"payload")


def props(*fields: bytes) -> bytes:
    body = b"".join(fields)
    assert len(body) < 128
    return bytes((len(body),)) + body


# ------------------------------------------------------------------------------------------------ error classes


def test_error_classes_carry_their_reason_codes() -> None:
    assert MalformedPacket("x").reason_code == 0x81
    assert ProtocolError("x").reason_code == 0x82
    assert PacketTooLarge("x").reason_code == 0x95
    error = UnsupportedProtocolVersion("x", 7)
    assert (error.reason_code, error.level) == (0x84, 7)
    assert all(issubclass(c, MQTTError) for c in (MalformedPacket, ProtocolError, PacketTooLarge))
    assert issubclass(UnsupportedProtocolVersion, MQTTError)


# ------------------------------------------------------------------------------------------------ Variable Byte Integer


@pytest.mark.parametrize("data", ["80 80 80 80 01", "ff ff ff ff 7f", "ff ff ff ff ff"])
def test_mqtt_1_5_5_1_vbi_of_five_bytes_is_malformed(data: str) -> None:
    """A VBI is at most four bytes (MQTT 5.0 §1.5.5; no value needs a fifth byte [MQTT-1.5.5-1])."""
    with pytest.raises(MalformedPacket):
        decode_vbi(h(data), 0)


@BOTH
def test_remaining_length_of_five_bytes_is_malformed(version: int) -> None:
    malformed(h("30 ff ff ff ff 7f"), version)
    malformed(h("c0 80 80 80 80 00"), version)


def test_remaining_length_of_five_bytes_is_malformed_when_fed_byte_by_byte() -> None:
    reader = PacketReader(version=V5)
    for byte in h("30 80 80 80"):
        assert list(reader.feed(bytes((byte,)))) == []
    with pytest.raises(MalformedPacket):
        list(reader.feed(b"\x80"))


def test_property_length_of_five_bytes_is_malformed() -> None:
    malformed(frame(0x30, b"\x00\x01t" + h("80 80 80 80 01")))


def test_property_identifier_and_subscription_identifier_vbi_of_five_bytes_are_malformed() -> None:
    malformed(publish_v5(props(h("80 80 80 80 01"))))
    malformed(publish_v5(props(h("0b ff ff ff ff 01"))))


@pytest.mark.parametrize("data", ["", "80", "ff ff", "80 80 80"])
def test_vbi_running_past_the_end_is_malformed(data: str) -> None:
    with pytest.raises(MalformedPacket):
        decode_vbi(h(data), 0)


# ------------------------------------------------------------------------------------------------ UTF-8 strings

INVALID_UTF8 = {
    "lone-continuation": "80",
    "bad-continuation": "c3 28",
    "ff-byte": "ff",
    "overlong-slash": "c0 af",
    "overlong-3-byte": "e0 80 af",
    "five-byte-form": "f8 88 80 80 80",
    "beyond-u10ffff": "f4 90 80 80",
    "truncated-sequence": "e2 82",
    "surrogate-d800": "ed a0 80",
    "surrogate-dfff": "ed bf bf",
    "surrogate-pair-cesu8": "ed a0 bd ed b2 a9",
}


@pytest.mark.parametrize("raw", list(INVALID_UTF8.values()), ids=list(INVALID_UTF8))
def test_mqtt_1_5_4_1_ill_formed_utf8_is_malformed(raw: str) -> None:
    """MQTT-1.5.4-1: well-formed UTF-8 only."""
    with pytest.raises(MalformedPacket):
        decode_string(string(b"a" + h(raw) + b"b"), 0)


def test_mqtt_1_5_4_1_utf8_encoded_surrogate_is_malformed() -> None:
    """MQTT-1.5.4-1: code points U+D800..U+DFFF must not be encoded, e.g. ED A0 80 (U+D800)."""
    with pytest.raises(MalformedPacket):
        decode_string(h("0003 eda080"), 0)
    malformed(frame(0x30, h("0003 eda080") + b"\x00"))
    malformed(frame(0x30, h("0003 eda080")), V311)


def test_mqtt_1_5_4_1_check_string_refuses_surrogates() -> None:
    """check_string() applies the same content rules to a Python str, which can hold lone surrogates."""
    with pytest.raises(MalformedPacket):
        check_string("a\ud800b")
    with pytest.raises(MalformedPacket):
        check_string("\udfff")
    check_string("ok \U0001f600 \ufeff")  # astral characters and U+FEFF are fine


def test_mqtt_1_5_4_2_string_with_null_is_malformed() -> None:
    """MQTT-1.5.4-2: U+0000 must not appear in a UTF-8 Encoded String."""
    with pytest.raises(MalformedPacket):
        decode_string(h("0003 610062"), 0)
    with pytest.raises(MalformedPacket):
        decode_string(h("0001 00"), 0)
    with pytest.raises(MalformedPacket):
        check_string("a\x00")
    malformed(frame(0x30, h("0003 610062") + b"\x00"))


@pytest.mark.parametrize("raw", ["00", "ed a0 80", "c0 af"])
def test_mqtt_1_5_3_1_and_1_5_3_2_v311_bad_strings_are_malformed(raw: str) -> None:
    """3.1.1 MQTT-1.5.3-1 (ill-formed UTF-8, surrogates) and MQTT-1.5.3-2 (U+0000): close the connection."""
    malformed(frame(0x30, string(b"t" + h(raw)) + b"payload"), V311)
    connect = h("0004 4d515454 04 02 003c") + string(b"id" + h(raw))
    malformed(frame(0x10, connect), V311)


BAD_STRINGS = ["00", "ed a0 80", "c3 28"]


_HEAD5 = h("0004 4d515454 05")

#: Every place a UTF-8 Encoded String sits, as a function from the string field to a whole 5.0 packet.
STRING_FIELDS: dict[str, Callable[[bytes], bytes]] = {
    "connect-client-id": lambda f: frame(0x10, _HEAD5 + h("02 0000 00") + f),
    "connect-username": lambda f: frame(0x10, _HEAD5 + h("82 0000 00 0000") + f),
    "will-topic": lambda f: frame(0x10, _HEAD5 + h("06 0000 00 0000 00") + f + h("0000")),
    "publish-topic": lambda f: frame(0x30, f + b"\x00"),
    "subscribe-filter": lambda f: frame(0x82, h("0001 00") + f + b"\x00"),
    "unsubscribe-filter": lambda f: frame(0xA2, h("0001 00") + f),
    "content-type": lambda f: publish_v5(props(b"\x03" + f)),
    "response-topic": lambda f: publish_v5(props(b"\x08" + f)),
    "reason-string": lambda f: frame(0x40, h("0001 00") + props(b"\x1f" + f)),
    "auth-method": lambda f: frame(0xF0, h("18") + props(b"\x15" + f)),
}


@pytest.mark.parametrize("field", list(STRING_FIELDS))
@pytest.mark.parametrize("raw", BAD_STRINGS)
def test_mqtt_1_5_4_1_bad_strings_refused_in_every_string_field(raw: str, field: str) -> None:
    """MQTT-1.5.4-1 / MQTT-1.5.4-2 apply to every UTF-8 Encoded String field, not only to Topic Names."""
    build = STRING_FIELDS[field]
    assert len(feed(build(string(b"x")))) == 1  # the same packet with a good string decodes
    malformed(build(string(b"x" + h(raw))))


@pytest.mark.parametrize("raw", BAD_STRINGS)
def test_mqtt_1_5_7_1_both_strings_of_a_user_property_are_checked(raw: str) -> None:
    """MQTT-1.5.7-1: both strings of a UTF-8 String Pair follow the UTF-8 Encoded String rules."""
    bad = string(b"x" + h(raw))
    malformed(publish_v5(props(b"\x26" + bad + string(b"v"))))
    malformed(publish_v5(props(b"\x26" + string(b"k") + bad)))


@pytest.mark.parametrize("data", ["", "00", "0002 61", "ffff 61"])
def test_string_length_past_the_end_is_malformed(data: str) -> None:
    with pytest.raises(MalformedPacket):
        decode_string(h(data), 0)


@pytest.mark.parametrize("data", ["", "00", "0003 6161", "ffff"])
def test_binary_length_past_the_end_is_malformed(data: str) -> None:
    with pytest.raises(MalformedPacket):
        decode_binary(h(data), 0)


def test_integers_past_the_end_are_malformed() -> None:
    with pytest.raises(MalformedPacket):
        decode_u16(b"\x01", 0)
    with pytest.raises(MalformedPacket):
        decode_u16(b"\x01\x02", 1)
    with pytest.raises(MalformedPacket):
        decode_u32(b"\x01\x02\x03", 0)


# ------------------------------------------------------------------------------------------------ fixed header

#: A valid body for each packet type except PUBLISH, with the flags nibble it must carry.
VALID_BODIES: dict[int, tuple[int, bytes, bytes]] = {
    # type: (required flags, 3.1.1 body, 5.0 body)
    1: (0, h("0004 4d515454 04 02 0000 0001 63"), h("0004 4d515454 05 02 0000 00 0001 63")),
    2: (0, h("00 00"), h("00 00 00")),
    4: (0, h("0001"), h("0001")),
    5: (0, h("0001"), h("0001")),
    6: (2, h("0001"), h("0001")),
    7: (0, h("0001"), h("0001")),
    8: (2, h("0001 0001 61 00"), h("0001 00 0001 61 00")),
    9: (0, h("0001 00"), h("0001 00 00")),
    10: (2, h("0001 0001 61"), h("0001 00 0001 61")),
    11: (0, h("0001"), h("0001 00 00")),
    12: (0, b"", b""),
    13: (0, b"", b""),
    14: (0, b"", b""),
    15: (0, b"", b""),
}


@pytest.mark.parametrize("ptype", sorted(VALID_BODIES))
def test_valid_bodies_decode_with_the_required_flags(ptype: int) -> None:
    """Sanity check for the next test: these bodies are fine when the flags are right."""
    flags, body311, body5 = VALID_BODIES[ptype]
    assert len(feed(frame(ptype << 4 | flags, body5), V5)) == 1
    if ptype != 15:
        assert len(feed(frame(ptype << 4 | flags, body311), V311)) == 1


@pytest.mark.parametrize("ptype", sorted(VALID_BODIES))
def test_mqtt_2_1_3_1_reserved_flags_malformed(ptype: int) -> None:
    """MQTT-2.1.3-1 (3.1.1: MQTT-2.2.2-1, MQTT-2.2.2-2): any other flags nibble is a Malformed Packet."""
    required, body311, body5 = VALID_BODIES[ptype]
    for flags in range(16):
        if flags == required:
            continue
        malformed(frame(ptype << 4 | flags, body5), V5)
        malformed(frame(ptype << 4 | flags, body311), V311)


@pytest.mark.parametrize("ptype", sorted(set(VALID_BODIES) - {15}))
def test_mqtt_3_1_dup_on_resent_pubrel_subscribe_unsubscribe_decodes_at_level_3_only(ptype: int) -> None:
    """MQTT 3.1 §2.1: DUP is set when a PUBREL, SUBSCRIBE or UNSUBSCRIBE is re-sent, so at Protocol Level 3 these
    three also decode with DUP + QoS 1 (0b1010), to the same packet as without DUP. 3.1 fixes their QoS at 1 and
    calls the other types' flags "not used" (its senders leave them 0): every other nibble is as malformed at level
    3 as at 3.1.1. At 3.1.1 and 5.0 [MQTT-2.1.3-1] refuses 0b1010 too."""
    required, body311, body5 = VALID_BODIES[ptype]
    plain = feed(frame(ptype << 4 | required, body311), V311)
    for flags in range(16):
        if flags == required:
            continue
        data = frame(ptype << 4 | flags, body311)
        if ptype in (PUBREL, SUBSCRIBE, UNSUBSCRIBE) and flags == 0x0A:
            assert feed(data, V31) == plain
            malformed(data, V311)
            malformed(frame(ptype << 4 | flags, body5), V5)
        else:
            malformed(data, V31)


@BOTH
def test_mqtt_3_8_1_1_subscribe_with_flags_0_is_malformed(version: int) -> None:
    malformed(frame(0x80, VALID_BODIES[8][1 if version == V311 else 2]), version)


@BOTH
def test_mqtt_3_6_1_1_pubrel_with_flags_0_is_malformed(version: int) -> None:
    malformed(h("60 02 0001"), version)


@BOTH
def test_mqtt_3_10_1_1_unsubscribe_with_flags_0_is_malformed(version: int) -> None:
    malformed(frame(0xA0, VALID_BODIES[10][1 if version == V311 else 2]), version)


@BOTH
def test_pingreq_with_flags_1_is_malformed(version: int) -> None:
    malformed(h("c1 00"), version)


@BOTH
def test_mqtt_3_14_1_1_disconnect_reserved_bits_are_malformed(version: int) -> None:
    malformed(h("e1 00"), version)
    malformed(h("e8 00"), version)


def test_mqtt_3_15_1_1_auth_reserved_bits_are_malformed() -> None:
    malformed(h("f1 00"))


@BOTH
def test_reserved_packet_type_0_is_malformed(version: int) -> None:
    malformed(h("00 00"), version)
    malformed(h("0f 00"), version)


def test_auth_does_not_exist_in_3_1_1() -> None:
    """MQTT 3.1.1 §2.2.1: type 15 is reserved."""
    malformed(h("f0 00"), V311)


@BOTH
@pytest.mark.parametrize("ptype", [12, 13])
def test_ping_with_a_body_is_malformed(version: int, ptype: int) -> None:
    malformed(frame(ptype << 4, b"\x00"), version)


# ------------------------------------------------------------------------------------------------ PUBLISH


@BOTH
@pytest.mark.parametrize("first", [0x36, 0x37, 0x3E, 0x3F])
def test_mqtt_3_3_1_4_publish_qos3_is_malformed(version: int, first: int) -> None:
    """MQTT-3.3.1-4: a PUBLISH must not have both QoS bits set to 1."""
    body = h("0001 74 0001") + (b"\x00" if version == V5 else b"")
    malformed(frame(first, body), version)


@BOTH
def test_mqtt_3_3_1_2_dup_with_qos0_is_malformed(version: int) -> None:
    """MQTT-3.3.1-2: DUP must be 0 for all QoS 0 messages."""
    malformed(frame(0x38, h("0001 74") + (b"\x00" if version == V5 else b"")), version)


@BOTH
@pytest.mark.parametrize("topic", ["+", "#", "a/+", "a/#", "sport+", "a/#/b", "+/x"])
def test_mqtt_3_3_2_2_publish_topic_with_wildcard_is_topic_name_invalid(version: int, topic: str) -> None:
    """MQTT-3.3.2-2 (and MQTT-4.7.0-1): no wildcard characters in a PUBLISH Topic Name; reason code 0x90."""
    body = string(topic.encode()) + (b"\x00" if version == V5 else b"") + b"x"
    error = rejects(frame(0x30, body), version, MQTTError, ReasonCode.TOPIC_NAME_INVALID)
    assert error.reason_code == 0x90


def test_mqtt_4_7_3_1_v311_publish_with_empty_topic_is_refused() -> None:
    """3.1.1 MQTT-4.7.3-1: a Topic Name is at least one character (5.0 allows it with a Topic Alias)."""
    protocol_error(frame(0x30, h("0000") + b"x"), V311)


@BOTH
@pytest.mark.parametrize("kind", ["subscribe-only", "subscribe-second", "unsubscribe-only", "unsubscribe-second"])
def test_mqtt_4_7_3_1_empty_topic_filter_is_a_protocol_error(version: int, kind: str) -> None:
    """MQTT-4.7.3-1 (both specs): an empty Topic Filter in a SUBSCRIBE or UNSUBSCRIBE, alone or after a valid
    one, makes the whole packet a Protocol Error (0x82) in the codec; no per-filter reason code is given."""
    props = b"\x00" if version == V5 else b""
    packets = {
        "subscribe-only": frame(0x82, h("0001") + props + string(b"") + b"\x01"),
        "subscribe-second": frame(0x82, h("0001") + props + string(b"a") + b"\x01" + string(b"") + b"\x01"),
        "unsubscribe-only": frame(0xA2, h("0001") + props + string(b"")),
        "unsubscribe-second": frame(0xA2, h("0001") + props + string(b"a") + string(b"")),
    }
    error = rejects(packets[kind], version, ProtocolError, PROTOCOL)
    assert "MQTT-4.7.3-1" in str(error)


@pytest.mark.parametrize(("flags", "payload"), [(0x02, h("0000")), (0x02, b""), (0x00, b"")])
def test_mqtt_3_1_3_8_v31_connect_payload_ending_before_client_id_decodes_as_empty(flags: int, payload: bytes) -> None:
    """MQTT 3.1 §3.1: a 3.1 CONNECT (MQIsdp, level 3) whose payload ends where the Client Identifier should be is
    decoded with an empty Client Identifier, which the broker refuses with return code 0x02 (3.1 has no
    server-assigned identifier); in 3.1.1 the same truncation is a Malformed Packet."""
    (packet,) = feed(frame(0x10, b"\x00\x06MQIsdp\x03" + bytes((flags,)) + h("003c") + payload), V311)
    assert packet == Connect("", 3, bool(flags & 0x02), 60)
    malformed(frame(0x10, b"\x00\x04MQTT\x04\x02\x00\x3c"), V311)


@BOTH
@pytest.mark.parametrize("first", [0x32, 0x34])
def test_mqtt_2_2_1_3_publish_packet_identifier_0_is_malformed(version: int, first: int) -> None:
    """MQTT-2.2.1-3 (3.1.1: MQTT-2.3.1-1): QoS > 0 PUBLISH needs a non-zero Packet Identifier."""
    malformed(frame(first, h("0001 74 0000") + (b"\x00" if version == V5 else b"")), version)


@BOTH
def test_publish_truncated_is_malformed(version: int) -> None:
    malformed(frame(0x30, h("0005 7474")), version)  # Topic Name runs past the end
    malformed(frame(0x32, h("0001 74 00")), version)  # half a Packet Identifier
    malformed(frame(0x30, b""), version)


def test_v5_publish_without_property_length_is_malformed() -> None:
    malformed(frame(0x30, h("0001 74")))
    malformed(frame(0x32, h("0001 74 0001")))


# ------------------------------------------------------------------------------------------------ properties


@pytest.mark.parametrize(
    "fields",
    [
        [b"\x03" + string(b"a"), b"\x03" + string(b"b")],  # Content Type twice
        [h("02 00000001"), h("02 00000002")],  # Message Expiry Interval twice
        [h("01 00"), h("01 01")],  # Payload Format Indicator twice
        [h("23 0001"), h("23 0001")],  # Topic Alias twice
        [b"\x08" + string(b"r"), b"\x09" + string(b"c"), b"\x08" + string(b"r")],  # Response Topic twice
    ],
)
def test_duplicate_property_is_protocol_error(fields: list[bytes]) -> None:
    """MQTT 5.0 §2.2.2.2: including a property more than once (other than those allowed to repeat)."""
    protocol_error(publish_v5(props(*fields)))


def test_duplicate_properties_in_other_packets_are_protocol_errors() -> None:
    connect = h("0004 4d515454 05 02 0000") + props(h("11 00000001"), h("11 00000002")) + h("0000")
    protocol_error(frame(0x10, connect))
    protocol_error(frame(0x40, h("0001 00") + props(b"\x1f" + string(b"a"), b"\x1f" + string(b"b"))))
    protocol_error(frame(0x82, h("0001") + props(h("0b 01"), h("0b 02")) + h("0001 61 00")))
    protocol_error(frame(0x20, h("00 00") + props(h("24 00"), h("24 01"))))


def test_repeatable_properties_are_accepted() -> None:
    """User Property may repeat anywhere; Subscription Identifier may repeat in PUBLISH (MQTT 5.0 §3.3.2.3.8)."""
    pairs = b"\x26" + string(b"k") + string(b"1"), b"\x26" + string(b"k") + string(b"2")
    (packet,) = feed(publish_v5(props(*pairs, h("0b 01"), h("0b 02"))))
    assert isinstance(packet, Publish)
    assert packet.properties == {P.USER_PROPERTY: [("k", "1"), ("k", "2")], P.SUBSCRIPTION_IDENTIFIER: [1, 2]}


@pytest.mark.parametrize(
    ("first", "body"),
    [
        (0x40, h("0001 00") + props(h("23 0001"))),  # Topic Alias in PUBACK
        (0x30, h("0001 74") + props(h("11 00000001"))),  # Session Expiry Interval in PUBLISH
        (0x30, h("0001 74") + props(h("18 00000001"))),  # Will Delay Interval outside the Will Properties
        (0xE0, h("00") + props(h("21 0001"))),  # Receive Maximum in DISCONNECT
        (0xF0, h("18") + props(h("11 00000001"))),  # Session Expiry Interval in AUTH
        (0x82, h("0001") + props(b"\x1f" + string(b"r")) + h("0001 61 00")),  # Reason String in SUBSCRIBE
        (0xA2, h("0001") + props(h("0b 01")) + h("0001 61")),  # Subscription Identifier in UNSUBSCRIBE
        (0x30, h("0001 74") + props(h("00"))),  # identifier 0 does not exist
        (0x30, h("0001 74") + props(h("05 00"))),  # identifier 5 does not exist
        (0x30, h("0001 74") + props(h("7f 00"))),  # identifier 0x7F does not exist
        (0x30, h("0001 74") + props(h("80 01 00"))),  # identifier 128 (two-byte VBI) does not exist
    ],
)
def test_property_not_allowed_in_the_packet_is_malformed(first: int, body: bytes) -> None:
    """MQTT 5.0 §2.2.2.2: a property identifier not valid for the packet type is a Malformed Packet."""
    malformed(frame(first, body))


def test_will_properties_have_their_own_allow_list() -> None:
    head = h("0004 4d515454 05 06 0000 00 0001 63")
    tail = h("0001 77 0000")
    assert len(feed(frame(0x10, head + props(h("18 00000005")) + tail))) == 1
    malformed(frame(0x10, head + props(h("11 00000005")) + tail))  # Session Expiry is not a Will property
    malformed(frame(0x10, head + props(h("23 0001")) + tail))


@pytest.mark.parametrize(
    ("first", "body"),
    [
        (0x30, h("0001 74") + props(h("01 02"))),  # Payload Format Indicator 2
        (0x30, h("0001 74") + props(h("23 0000"))),  # Topic Alias 0 [MQTT-3.3.2-8]
        (0x30, h("0001 74") + props(h("0b 00"))),  # Subscription Identifier 0
        (0x82, h("0001") + props(h("0b 00")) + h("0001 61 00")),  # Subscription Identifier 0
        (0x10, h("0004 4d515454 05 02 0000") + props(h("21 0000")) + h("0000")),  # Receive Maximum 0
        (0x10, h("0004 4d515454 05 02 0000") + props(h("27 00000000")) + h("0000")),  # Maximum Packet Size 0
        (0x10, h("0004 4d515454 05 02 0000") + props(h("17 02")) + h("0000")),  # Request Problem Information 2
        (0x10, h("0004 4d515454 05 02 0000") + props(h("19 05")) + h("0000")),  # Request Response Information 5
        (0x20, h("00 00") + props(h("24 02"))),  # Maximum QoS 2
        (0x20, h("00 00") + props(h("25 02"))),  # Retain Available 2
    ],
)
def test_property_value_out_of_range_is_protocol_error(first: int, body: bytes) -> None:
    protocol_error(frame(first, body))


def test_mqtt_3_3_2_8_topic_alias_0_is_protocol_error() -> None:
    """MQTT-3.3.2-8: a PUBLISH must not carry Topic Alias 0 (a Protocol Error for the receiver)."""
    protocol_error(publish_v5(props(h("23 0000"))))


@pytest.mark.parametrize(
    "block",
    [
        "05 02 0000",  # Property Length 5, only 3 bytes of property follow (then the payload)
        "02 02 0000 0001",  # Message Expiry (4 bytes) does not fit in a Property Length of 2
        "01 01",  # a Byte property with no value inside the Property Length
        "04 03 0005 61",  # a string longer than the Property Length
        "03 26 0001",  # a User Property cut after its key length
        "02 0b 80",  # Subscription Identifier VBI cut by the Property Length
    ],
)
def test_property_lengths_that_do_not_add_up_are_malformed(block: str) -> None:
    # No payload after the block, so nothing past the Property Length can be read instead.
    malformed(frame(0x30, h("0001 74") + h(block)))


def test_property_length_past_the_end_of_the_packet_is_malformed() -> None:
    malformed(frame(0x40, h("0001 00 09 1f 0002 6f6b")))
    with pytest.raises(MalformedPacket):
        decode_properties(h("05 01 01"), 0, 3)


# ------------------------------------------------------------------------------------------------ lengths


@BOTH
def test_trailing_bytes_are_malformed(version: int) -> None:
    extra = b"\x00"
    five = version == V5
    cases = [
        frame(0x10, VALID_BODIES[1][2 if five else 1] + extra),  # CONNECT
        frame(0x20, VALID_BODIES[2][2 if five else 1] + extra),  # CONNACK
        frame(0xC0, extra),
        frame(0xD0, extra),
    ]
    if version == V311:
        cases += [
            frame(0x40, h("0001") + extra),  # 3.1.1 PUBACK is exactly 2 bytes
            frame(0x62, h("0001") + extra),
            frame(0xB0, h("0001") + extra),  # 3.1.1 UNSUBACK
            frame(0xE0, extra),  # 3.1.1 DISCONNECT has no body
        ]
    else:
        cases += [
            frame(0x40, h("0001 00 00") + extra),
            frame(0xE0, h("00 00") + extra),
            frame(0xF0, h("18 00") + extra),
        ]
    for data in cases:
        malformed(data, version)


@BOTH
def test_truncated_packet_bodies_are_malformed(version: int) -> None:
    cases = [
        frame(0x40, h("00")),  # half a Packet Identifier
        frame(0x40, b""),
        frame(0x20, h("00")),  # CONNACK needs 2 bytes
        frame(0x82, h("0001") + (b"\x00" if version == V5 else b"") + h("0001 61")),  # filter without options
        frame(0xA2, h("0001") + (b"\x00" if version == V5 else b"") + h("0003 61")),  # filter runs past the end
        frame(0x90, h("00")),
    ]
    for data in cases:
        malformed(data, version)


@BOTH
@pytest.mark.parametrize(
    ("first", "body"),
    [(0x40, "0000"), (0x50, "0000"), (0x62, "0000"), (0x70, "0000"), (0x82, "0000 0001 61 00"), (0xA2, "0000 0001 61")],
)
def test_mqtt_2_2_1_3_packet_identifier_0_is_malformed(version: int, first: int, body: str) -> None:
    """MQTT-2.2.1-3 (3.1.1: MQTT-2.3.1-1): Packet Identifiers are non-zero."""
    data = h(body)
    if version == V5 and first in (0x82, 0xA2):
        data = data[:2] + b"\x00" + data[2:]
    malformed(frame(first, data), version)


# ---------------------------------------------------------------------------------------------- acks, DISCONNECT, AUTH


@pytest.mark.parametrize("first", [0x40, 0x50, 0x62, 0x70])
def test_v5_ack_with_unknown_reason_code_is_malformed(first: int) -> None:
    malformed(frame(first, h("0001 05")))
    malformed(frame(first, h("0001 ff 00")))


def test_v5_disconnect_and_auth_with_unknown_reason_code_are_malformed() -> None:
    malformed(h("e0 01 03"))
    malformed(h("e0 02 ff 00"))
    malformed(h("f0 02 06 00"))


def test_mqtt_3_2_2_1_connack_reserved_flag_bits_are_malformed() -> None:
    """MQTT-3.2.2-1: Connect Acknowledge Flags bits 7-1 are reserved and 0."""
    malformed(h("20 03 02 00 00"))
    malformed(h("20 02 80 00"), V311)


# --------------------------------------------------------------------------------------------- SUBSCRIBE / UNSUBSCRIBE


def test_mqtt_3_8_3_2_v5_subscribe_without_filters_is_protocol_error() -> None:
    """MQTT 5.0 [MQTT-3.8.3-2]: at least one Topic Filter; none is a Protocol Error (§3.8.3)."""
    protocol_error(frame(0x82, h("0001 00")))


def test_mqtt_3_8_3_3_v311_subscribe_without_filters_is_malformed() -> None:
    """MQTT 3.1.1 [MQTT-3.8.3-3]: a SUBSCRIBE with no payload is a protocol violation."""
    malformed(frame(0x82, h("0001")), V311)


def test_mqtt_3_10_3_2_v5_unsubscribe_without_filters_is_protocol_error() -> None:
    protocol_error(frame(0xA2, h("0001 00")))


def test_mqtt_3_10_3_2_v311_unsubscribe_without_filters_is_malformed() -> None:
    malformed(frame(0xA2, h("0001")), V311)


@BOTH
def test_subscribe_requested_qos_3_is_malformed(version: int) -> None:
    """MQTT 5.0 §3.8.3.1: QoS 3 is a Malformed Packet (3.1.1: [MQTT-3.8.3-4])."""
    props_len = b"\x00" if version == V5 else b""
    malformed(frame(0x82, h("0001") + props_len + h("0001 61 03")), version)


@pytest.mark.parametrize("options", [0x40, 0x80, 0xC0, 0xC1])
def test_mqtt_3_8_3_5_v5_subscription_options_reserved_bits_are_malformed(options: int) -> None:
    malformed(frame(0x82, h("0001 00 0001 61") + bytes((options,))))


@pytest.mark.parametrize("options", [0x04, 0x10, 0x80, 0xFD])
def test_mqtt_3_8_3_4_v311_requested_qos_reserved_bits_are_malformed(options: int) -> None:
    """3.1.1 MQTT-3.8.3-4: the upper 6 bits of the Requested QoS byte are reserved."""
    malformed(frame(0x82, h("0001 0001 61") + bytes((options,))), V311)


def test_v5_retain_handling_3_is_protocol_error() -> None:
    """MQTT 5.0 §3.8.3.1: it is a Protocol Error to send a Retain Handling value of 3."""
    protocol_error(frame(0x82, h("0001 00 0001 61 30")))


def test_v5_second_filter_is_checked_too() -> None:
    protocol_error(frame(0x82, h("0001 00 0001 61 00 0001 62 31")))


# ------------------------------------------------------------------------------------------------ CONNECT

CONNECT5 = h("0004 4d515454 05")
CONNECT311 = h("0004 4d515454 04")


@BOTH
def test_mqtt_3_1_2_3_connect_reserved_flag_is_malformed(version: int) -> None:
    """MQTT-3.1.2-3: the Server checks the CONNECT reserved flag is 0 (5.0: Malformed Packet)."""
    head = CONNECT5 if version == V5 else CONNECT311
    props_len = b"\x00" if version == V5 else b""
    malformed(frame(0x10, head + h("03 0000") + props_len + h("0001 63")), version)


@BOTH
def test_mqtt_3_1_2_12_will_qos_3_is_malformed(version: int) -> None:
    """MQTT 5.0 MQTT-3.1.2-12 (3.1.1: MQTT-3.1.2-14): Will QoS 3 is a Malformed Packet."""
    head = CONNECT5 if version == V5 else CONNECT311
    p = b"\x00" if version == V5 else b""
    malformed(frame(0x10, head + h("1e 0000") + p + h("0001 63") + p + h("0001 77 0000")), version)


@BOTH
@pytest.mark.parametrize("flags", [0x0A, 0x12, 0x22, 0x32])
def test_mqtt_3_1_2_11_and_13_will_qos_or_retain_without_will_flag_is_malformed(version: int, flags: int) -> None:
    """MQTT 5.0 MQTT-3.1.2-11 / MQTT-3.1.2-13 (3.1.1: MQTT-3.1.2-13 / MQTT-3.1.2-15)."""
    head = CONNECT5 if version == V5 else CONNECT311
    p = b"\x00" if version == V5 else b""
    malformed(frame(0x10, head + bytes((flags,)) + h("0000") + p + h("0001 63")), version)


def test_mqtt_3_1_2_22_v311_password_without_username_is_malformed() -> None:
    """3.1.1 MQTT-3.1.2-22: if the User Name Flag is 0, the Password Flag must be 0."""
    malformed(frame(0x10, CONNECT311 + h("42 0000 0001 63 0001 70")), V311)
    (packet,) = feed(frame(0x10, CONNECT5 + h("42 0000 00 0001 63 0001 70")))  # allowed in 5.0
    assert isinstance(packet, Connect)
    assert (packet.username, packet.password) == (None, b"p")


@pytest.mark.parametrize("name", [b"MQTX", b"mqtt", b"MQ", b"", b"MQTTT", "MQTT\u00e9".encode()])
def test_mqtt_3_1_2_1_unknown_protocol_name_is_unsupported(name: bytes) -> None:
    """MQTT-3.1.2-1: the Protocol Name must be 'MQTT' (or 'MQIsdp' for 3.1); 0x84 with no level."""
    error = rejects(frame(0x10, string(name) + h("04 02 0000 0001 63")), V311, UnsupportedProtocolVersion, 0x84)
    assert isinstance(error, UnsupportedProtocolVersion)
    assert error.level is None


@pytest.mark.parametrize(("name", "level"), [(b"MQTT", 3), (b"MQTT", 6), (b"MQTT", 0), (b"MQTT", 0x84), (b"MQIsdp", 4)])
def test_mqtt_3_1_2_2_unsupported_protocol_level(name: bytes, level: int) -> None:
    """MQTT-3.1.2-2: an unsupported Protocol Level is refused with 0x84 (3.1.1: CONNACK 0x01) and the level."""
    body = string(name) + bytes((level,)) + h("02 0000 00 0001 63")
    error = rejects(frame(0x10, body), V5, UnsupportedProtocolVersion, 0x84)
    assert isinstance(error, UnsupportedProtocolVersion)
    assert error.level == level


@pytest.mark.parametrize(
    "body",
    [
        "0004 4d515454",  # ends before the Protocol Level
        "0004 4d515454 04",  # ends before the Connect Flags
        "0004 4d515454 04 02 00",  # half a Keep Alive
        "0004 4d515454 04 02 0000",  # no Client Identifier
        "0004 4d515454 04 06 0000 0001 63",  # Will Flag but no Will Topic
        "0004 4d515454 04 06 0000 0001 63 0001 77",  # Will Topic but no Will Payload
        "0004 4d515454 04 82 0000 0001 63",  # User Name Flag but no User Name
        "0004 4d515454 04 c2 0000 0001 63 0001 75",  # Password Flag but no Password
        "0004 4d515454 04 c2 0000 0001 63 0001 75 0005 70",  # Password runs past the end
    ],
)
def test_connect_fields_that_do_not_add_up_are_malformed(body: str) -> None:
    malformed(frame(0x10, h(body)), V311)


def test_v5_connect_property_length_past_the_end_is_malformed() -> None:
    malformed(frame(0x10, CONNECT5 + h("02 0000 09 11 0000")))


# ------------------------------------------------------------------------------------------------ Maximum Packet Size


def test_maximum_packet_size_enforced_on_declared_length_before_body_arrives() -> None:
    """MQTT 5.0 §3.2.2.3.6 / [MQTT-3.2.2-15]: the size check uses the Remaining Length alone.

    Only the fixed header of a 256 MiB packet is fed: the reader raises at once, holding nothing but that header.
    """
    reader = PacketReader(max_packet_size=1024, version=V5)
    with pytest.raises(PacketTooLarge) as info:
        list(reader.feed(h("30 ff ff ff 7f")))
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE == 0x95
    assert reader.buffered <= 5


def test_maximum_packet_size_header_arriving_in_pieces() -> None:
    reader = PacketReader(max_packet_size=100, version=V5)
    assert list(reader.feed(b"\x30")) == []
    assert list(reader.feed(b"\x80")) == []
    assert reader.buffered == 2
    with pytest.raises(PacketTooLarge):
        list(reader.feed(b"\x01"))  # 1 + 2 + 128 bytes > 100


@pytest.mark.parametrize("remaining", [10, 126, 127, 128, 200, 16383, 16384])
def test_maximum_packet_size_counts_the_whole_packet(remaining: int) -> None:
    """The Maximum Packet Size is the total packet size: fixed header + Remaining Length (MQTT 5.0 §2.1.4)."""
    wire = Publish("t", b"\x01" * (remaining - 3)).encode(V311)
    assert len(feed(wire, V311, max_packet_size=len(wire))) == 1
    with pytest.raises(PacketTooLarge):
        feed(wire, V311, max_packet_size=len(wire) - 1)
    reader = PacketReader(max_packet_size=len(wire) - 1, version=V311)
    with pytest.raises(PacketTooLarge):
        list(reader.feed(wire[: len(wire) - remaining]))  # the fixed header alone is enough to refuse it


def test_largest_remaining_length_waits_for_its_body_under_the_default_limit() -> None:
    reader = PacketReader(version=V5)
    assert list(reader.feed(h("30 ff ff ff 7f 00 01 74"))) == []
    assert reader.buffered == 8


def test_good_packets_before_a_bad_one_are_yielded_first() -> None:
    reader = PacketReader(version=V5)
    packets = reader.feed(h("c0 00") + h("d0 00") + h("36 00"))
    assert next(packets) == PingReq()
    assert next(packets) == PingResp()
    with pytest.raises(MalformedPacket):
        next(packets)


# ------------------------------------------------------------------------------------------------ fuzzing

SAMPLES: list[tuple[int, Packet]] = [
    (V5, Connect("cid", V5, True, 30, "u", b"pw", Will("w/t", b"bye", 1, True, {P.WILL_DELAY_INTERVAL: 3}))),
    (V311, Connect("cid", V311, False, 30, "u", b"pw", Will("w/t", b"bye", 2))),
    (V5, Connack(True, 0, {P.MAXIMUM_QOS: 1, P.ASSIGNED_CLIENT_IDENTIFIER: "x", P.USER_PROPERTY: [("a", "b")]})),
    (V5, Publish("a/b", b"data", 1, True, True, 9, {P.SUBSCRIPTION_IDENTIFIER: [5, 300], P.CONTENT_TYPE: "t"})),
    (V311, Publish("a/b", b"data", 2, packet_id=9)),
    (V5, PubAck(3, 0x10, {P.REASON_STRING: "r"})),
    (V5, PubRec(3, 0x80)),
    (V5, PubRel(3, 0x92, {P.USER_PROPERTY: [("k", "v")]})),
    (V311, PubComp(3)),
    (V5, Subscribe(4, [Subscription("a/+", 1, True, False, 2), Subscription("#")], {P.SUBSCRIPTION_IDENTIFIER: [7]})),
    (V311, Subscribe(4, [Subscription("a/+", 1), Subscription("#", 2)])),
    (V5, Suback(4, [0, 0x80, 0xA2], {P.REASON_STRING: "no"})),
    (V5, Unsubscribe(5, ["a/+", "b"], {P.USER_PROPERTY: [("k", "v")]})),
    (V5, Unsuback(5, [0, 0x11])),
    (V5, Disconnect(0x8E, {P.SERVER_REFERENCE: "elsewhere"})),
    (V5, Auth(0x18, {P.AUTHENTICATION_METHOD: "m", P.AUTHENTICATION_DATA: b"\x00\x01"})),
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=64), version=st.sampled_from([V311, V5]))
def test_random_bytes_raise_only_mqtt_errors(data: bytes, version: int) -> None:
    """Whatever arrives, the reader yields packets or raises an MQTTError: never IndexError, ValueError, ..."""
    reader = PacketReader(max_packet_size=1 << 16, version=version)
    try:
        for packet in reader.feed(data):
            assert packet.TYPE in range(1, 16)
    except MQTTError as exc:
        assert exc.reason_code >= 0x80


@settings(max_examples=400, deadline=None)
@given(first=st.integers(0, 255), body=st.binary(max_size=48), version=st.sampled_from([3, V311, V5]))
def test_decode_packet_on_random_bodies_raises_only_mqtt_errors(first: int, body: bytes, version: int) -> None:
    try:
        packet = decode_packet(first, body, version)
    except MQTTError as exc:
        assert exc.reason_code >= 0x80
    else:
        assert first >> 4 == packet.TYPE


@settings(max_examples=400, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from("rid")), max_size=4),
)
def test_mutated_packets_raise_only_mqtt_errors(sample: tuple[int, Packet], edits: list[tuple[int, int, str]]) -> None:
    """Replace, insert or delete a few bytes of valid packets: decode or MQTTError, nothing else."""
    version, packet = sample
    wire = bytearray(packet.encode(version))
    for where, value, op in edits:
        i = where % (len(wire) + 1)
        if op == "i":
            wire.insert(i, value)
        elif i < len(wire):
            if op == "r":
                wire[i] = value
            else:
                del wire[i]
    reader = PacketReader(max_packet_size=1 << 16, version=version)
    try:
        for decoded in reader.feed(bytes(wire)):
            assert decoded.encode(version)[0] >> 4 == decoded.TYPE
    except MQTTError as exc:
        assert exc.reason_code >= 0x80
