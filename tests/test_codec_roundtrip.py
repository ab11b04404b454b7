"""Hypothesis round-trips for the sans-I/O MQTT codec: encode -> PacketReader -> decode is the identity.

Every one of the 15 control packets is generated for MQTT 3.1.1 (Protocol Level 4) and MQTT 5.0 (Protocol Level 5)
(AUTH for 5.0 only). 3.1.1 packets carry only the fields 3.1.1 has: no properties, no reason codes on acks or
DISCONNECT, SUBACK return codes in {0x00, 0x01, 0x02, 0x80}. MQTT 5.0 properties are drawn per packet type from
the codec's allow-list (``ALLOWED``) with values in their legal ranges; strings are well-formed UTF-8 without
U+0000 and without surrogates (MQTT 5.0 §1.5.4).

The same byte streams are also fed to the reader split at random points to show that a partial frame never
raises, is held back, and yields exactly the same packets once the rest arrives.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.mqtt.errors import MalformedPacket
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import (
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
    encode_publish_parts,
)
from gateway.mqtt.primitives import (
    VBI_MAX,
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
from gateway.mqtt.properties import ALLOWED, PROPERTY_TYPES, WILL, Properties, PropertyId, decode_properties
from gateway.mqtt.properties import encode_properties as encode_props

P = PropertyId
V311 = 4
V5 = 5
VERSIONS = (V311, V5)

ROUNDTRIP = settings(max_examples=60, deadline=None)
STREAM = settings(max_examples=80, deadline=None)

# ------------------------------------------------------------------------------------------------ strategies

#: Data type of every property, written out from MQTT 5.0 §2.2.2.2 Table 2-4 (independent of the codec's table).
SPEC_TYPES: dict[int, str] = {
    P.PAYLOAD_FORMAT_INDICATOR: "byte",
    P.MESSAGE_EXPIRY_INTERVAL: "u32",
    P.CONTENT_TYPE: "str",
    P.RESPONSE_TOPIC: "str",
    P.CORRELATION_DATA: "bin",
    P.SUBSCRIPTION_IDENTIFIER: "vbi",
    P.SESSION_EXPIRY_INTERVAL: "u32",
    P.ASSIGNED_CLIENT_IDENTIFIER: "str",
    P.SERVER_KEEP_ALIVE: "u16",
    P.AUTHENTICATION_METHOD: "str",
    P.AUTHENTICATION_DATA: "bin",
    P.REQUEST_PROBLEM_INFORMATION: "byte",
    P.WILL_DELAY_INTERVAL: "u32",
    P.REQUEST_RESPONSE_INFORMATION: "byte",
    P.RESPONSE_INFORMATION: "str",
    P.SERVER_REFERENCE: "str",
    P.REASON_STRING: "str",
    P.RECEIVE_MAXIMUM: "u16",
    P.TOPIC_ALIAS_MAXIMUM: "u16",
    P.TOPIC_ALIAS: "u16",
    P.MAXIMUM_QOS: "byte",
    P.RETAIN_AVAILABLE: "byte",
    P.USER_PROPERTY: "pair",
    P.MAXIMUM_PACKET_SIZE: "u32",
    P.WILDCARD_SUBSCRIPTION_AVAILABLE: "byte",
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: "byte",
    P.SHARED_SUBSCRIPTION_AVAILABLE: "byte",
}

#: Properties whose value 0 is a Protocol Error (MQTT 5.0 §3.1.2.11.3, §3.1.2.11.4, §3.3.2.3.4, §3.3.2.3.8).
NONZERO = {P.RECEIVE_MAXIMUM, P.MAXIMUM_PACKET_SIZE, P.TOPIC_ALIAS, P.SUBSCRIPTION_IDENTIFIER}

#: MQTT 5.0 reason codes each packet may carry (§3.2.2.2, §3.4.2.1, §3.5.2.1, §3.6.2.1, §3.7.2.1, §3.9.3,
#: §3.11.3, §3.14.2.1, §3.15.2.1).
CONNACK_REASONS = [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97]
CONNACK_REASONS += [0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F]
PUBACK_REASONS = [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]
PUBREL_REASONS = [0x00, 0x92]
SUBACK_REASONS = [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]
UNSUBACK_REASONS = [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]
DISCONNECT_REASONS = [0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94]
DISCONNECT_REASONS += [0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2]
AUTH_REASONS = [0x00, 0x18, 0x19]
SUBACK_RETURN_CODES_311 = [0x00, 0x01, 0x02, 0x80]

#: Well-formed UTF-8 characters an MQTT string may hold: no surrogates [MQTT-1.5.4-1], no U+0000 [MQTT-1.5.4-2].
mqtt_chars = st.characters(codec="utf-8", exclude_characters="\x00")


def mqtt_text(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    """A UTF-8 Encoded String's content (MQTT 5.0 §1.5.4)."""
    return st.text(mqtt_chars, min_size=min_size, max_size=max_size)


#: A Topic Name: at least one character, no wildcards [MQTT-4.7.3-1] [MQTT-3.3.2-2].
topic_names = st.text(st.characters(codec="utf-8", exclude_characters="\x00+#"), min_size=1, max_size=12)
binary = st.binary(max_size=24)
packet_ids = st.integers(1, 0xFFFF)


def property_value(ident: int, packet_type: int) -> st.SearchStrategy[object]:
    """Values for property ``ident`` in ``packet_type`` that a receiver must accept."""
    kind = SPEC_TYPES[ident]
    low = 1 if ident in NONZERO else 0
    if kind == "byte":
        return st.integers(0, 1)  # every Byte property is a 0/1 flag (Maximum QoS: 0 or 1)
    if kind == "u16":
        return st.integers(low, 0xFFFF)
    if kind == "u32":
        return st.integers(low, 0xFFFF_FFFF)
    if kind == "vbi":  # Subscription Identifier: many in PUBLISH, at most one in SUBSCRIBE
        return st.lists(st.integers(1, VBI_MAX), min_size=1, max_size=3 if packet_type == 3 else 1)
    if kind == "str":
        return mqtt_text()
    if kind == "bin":
        return binary
    return st.lists(st.tuples(mqtt_text(), mqtt_text()), min_size=1, max_size=3)


def properties(packet_type: int) -> st.SearchStrategy[Properties]:
    """Any subset of the properties ``packet_type`` allows, each with a legal value."""
    return st.fixed_dictionaries({}, optional={i: property_value(i, packet_type) for i in ALLOWED[packet_type]})


def props_for(packet_type: int, version: int) -> st.SearchStrategy[Properties]:
    return properties(packet_type) if version == V5 else st.just({})


def reasons(codes: list[int], version: int) -> st.SearchStrategy[int]:
    return st.sampled_from(codes) if version == V5 else st.just(0)


@st.composite
def wills(draw: st.DrawFn, version: int) -> Will:
    return Will(
        topic=draw(topic_names),
        payload=draw(binary),
        qos=draw(st.integers(0, 2)),
        retain=draw(st.booleans()),
        properties=draw(props_for(WILL, version)),
    )


@st.composite
def connects(draw: st.DrawFn, version: int) -> Connect:
    username = draw(st.none() | mqtt_text())
    password = draw(st.none() | binary)
    if version != V5 and username is None:
        password = None  # 3.1.1: no Password without a User Name [MQTT-3.1.2-22]
    return Connect(
        client_id=draw(mqtt_text(max_size=23)),
        protocol_level=version,
        clean_start=draw(st.booleans()),
        keep_alive=draw(st.integers(0, 0xFFFF)),
        username=username,
        password=password,
        will=draw(st.none() | wills(version)),
        properties=draw(props_for(1, version)),
    )


@st.composite
def connacks(draw: st.DrawFn, version: int) -> Connack:
    code = draw(st.sampled_from(CONNACK_REASONS) if version == V5 else st.integers(0, 5))
    # Session Present must be 0 when the CONNACK refuses the connection [MQTT-3.2.2-6] (3.1.1: [MQTT-3.2.2-4]).
    present = draw(st.booleans()) if code == 0 else False
    return Connack(session_present=present, reason_code=code, properties=draw(props_for(2, version)))


@st.composite
def publishes(draw: st.DrawFn, version: int) -> Publish:
    qos = draw(st.integers(0, 2))
    return Publish(
        topic=draw(topic_names),
        payload=draw(st.binary(max_size=64)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if qos else False,  # DUP is 0 for QoS 0 [MQTT-3.3.1-2]
        packet_id=draw(packet_ids) if qos else None,  # no Packet Identifier for QoS 0 [MQTT-2.2.1-2]
        properties=draw(props_for(3, version)),
    )


def acks(cls: type[PubAck | PubRec | PubRel | PubComp], codes: list[int], version: int) -> st.SearchStrategy[Packet]:
    return st.builds(cls, packet_ids, reasons(codes, version), props_for(cls.TYPE, version))


@st.composite
def subscriptions(draw: st.DrawFn, version: int) -> Subscription:
    topic_filter = draw(mqtt_text(min_size=1))
    qos = draw(st.integers(0, 2))
    if version != V5:
        return Subscription(topic_filter, qos)
    return Subscription(topic_filter, qos, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2)))


def subscribes(version: int) -> st.SearchStrategy[Packet]:
    subs = st.lists(subscriptions(version), min_size=1, max_size=4)
    return st.builds(Subscribe, packet_ids, subs, props_for(8, version))


def subacks(version: int) -> st.SearchStrategy[Packet]:
    codes = st.lists(st.sampled_from(SUBACK_REASONS if version == V5 else SUBACK_RETURN_CODES_311), min_size=1)
    return st.builds(Suback, packet_ids, codes, props_for(9, version))


def unsubscribes(version: int) -> st.SearchStrategy[Packet]:
    filters = st.lists(mqtt_text(min_size=1), min_size=1, max_size=4)
    return st.builds(Unsubscribe, packet_ids, filters, props_for(10, version))


def unsubacks(version: int) -> st.SearchStrategy[Packet]:
    if version != V5:
        return st.builds(Unsuback, packet_ids)  # 3.1.1 UNSUBACK is just the Packet Identifier
    codes = st.lists(st.sampled_from(UNSUBACK_REASONS), min_size=1, max_size=6)
    return st.builds(Unsuback, packet_ids, codes, properties(11))


STRATEGIES: dict[str, Callable[[int], st.SearchStrategy[Packet]]] = {
    "CONNECT": connects,
    "CONNACK": connacks,
    "PUBLISH": publishes,
    "PUBACK": lambda v: acks(PubAck, PUBACK_REASONS, v),
    "PUBREC": lambda v: acks(PubRec, PUBACK_REASONS, v),
    "PUBREL": lambda v: acks(PubRel, PUBREL_REASONS, v),
    "PUBCOMP": lambda v: acks(PubComp, PUBREL_REASONS, v),
    "SUBSCRIBE": subscribes,
    "SUBACK": subacks,
    "UNSUBSCRIBE": unsubscribes,
    "UNSUBACK": unsubacks,
    "PINGREQ": lambda v: st.just(PingReq()),
    "PINGRESP": lambda v: st.just(PingResp()),
    "DISCONNECT": lambda v: st.builds(Disconnect, reasons(DISCONNECT_REASONS, v), props_for(14, v)),
    "AUTH": lambda v: st.builds(Auth, st.sampled_from(AUTH_REASONS), properties(15)),
}

CASES = [(name, v) for name in STRATEGIES for v in VERSIONS if not (name == "AUTH" and v == V311)]


def any_packet(version: int) -> st.SearchStrategy[Packet]:
    return st.one_of([STRATEGIES[name](version) for name, v in CASES if v == version])


def decode_all(data: bytes, version: int) -> list[Packet]:
    reader = PacketReader(version=version)
    packets = list(reader.feed(data))
    assert reader.buffered == 0
    return packets


# ------------------------------------------------------------------------------------------------ packets


def test_every_packet_type_and_level_is_covered() -> None:
    assert len(STRATEGIES) == 15
    assert len(CASES) == 29  # 15 packets on 5.0 + 14 on 3.1.1 (no AUTH)


@pytest.mark.parametrize(("name", "version"), CASES, ids=[f"{n}-v{v}" for n, v in CASES])
@ROUNDTRIP
@given(data=st.data())
def test_roundtrip_through_reader(name: str, version: int, data: st.DataObject) -> None:
    packet = data.draw(STRATEGIES[name](version), label="packet")
    wire = packet.encode(version)
    assert wire[0] >> 4 == packet.TYPE
    decoded = decode_all(wire, version)
    assert decoded == [packet]
    assert type(decoded[0]) is type(packet)
    assert decoded[0].encode(version) == wire


@pytest.mark.parametrize("version", VERSIONS)
@STREAM
@given(data=st.data())
def test_stream_split_at_random_points_yields_same_packets(version: int, data: st.DataObject) -> None:
    """A CONNECT first sets the reader's level; any chunking yields the same packets and never raises."""
    connect = data.draw(connects(version), label="connect")
    rest = data.draw(st.lists(any_packet(version), max_size=6), label="rest")
    packets: list[Packet] = [connect, *rest]
    frames = [p.encode(version) for p in packets]
    stream = b"".join(frames)
    boundaries = [0]
    for frame in frames:
        boundaries.append(boundaries[-1] + len(frame))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts"))
    cuts = [0, *cuts, len(stream)]

    reader = PacketReader()  # default level 3.1.1: the CONNECT must switch it
    out: list[Packet] = []
    for start, stop in itertools.pairwise(cuts):
        out.extend(reader.feed(stream[start:stop]))
        # Exactly the whole frames received so far were yielded; the rest waits in the buffer.
        complete = max(b for b in boundaries if b <= stop)
        assert len(out) == boundaries.index(complete)
        assert reader.buffered == stop - complete
    assert out == packets
    assert reader.version == version
    assert reader.buffered == 0


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_stream_fed_one_byte_at_a_time(version: int, data: st.DataObject) -> None:
    packets = data.draw(st.lists(any_packet(version), min_size=1, max_size=4))
    stream = b"".join(p.encode(version) for p in packets)
    reader = PacketReader(version=version)
    out: list[Packet] = []
    for i in range(len(stream)):
        out.extend(reader.feed(stream[i : i + 1]))
    assert out == packets
    assert reader.buffered == 0


@pytest.mark.parametrize("version", VERSIONS)
@STREAM
@given(data=st.data())
def test_leading_pubacks_then_feed_yield_the_same_packets(version: int, data: st.DataObject) -> None:
    """``leading_pubacks`` (the broker's path for a subscriber's acknowledgements) takes exactly the plain PUBACKs
    (Reason Code 0 left out, non-zero Packet Identifier) that start a chunk; ``feed`` of the rest yields the other
    packets. Together they see the same packets as ``feed`` alone, under any chunking; a buffered partial packet
    keeps its bytes from ``leading_pubacks``."""
    plain = st.builds(PubAck, st.integers(1, 65535))
    packets = data.draw(st.lists(st.one_of(plain, plain, any_packet(version)), max_size=10), label="packets")
    stream = b"".join(p.encode(version) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6), label="cuts"))
    reader = PacketReader(version=version)
    seen: list[Packet] = []
    for start, stop in itertools.pairwise([0, *cuts, len(stream)]):
        chunk = stream[start:stop]
        pids, used = reader.leading_pubacks(chunk)
        assert used == 4 * len(pids) and chunk[:used] == b"".join(PubAck(pid).encode(version) for pid in pids)
        seen.extend(PubAck(pid) for pid in pids)
        seen.extend(reader.feed(chunk[used:]))
    assert seen == packets
    assert reader.buffered == 0


def test_leading_pubacks_leave_a_partial_packets_bytes_alone() -> None:
    """Bytes that continue a buffered packet are its body, even when they look like PUBACKs."""
    publish = Publish("t", b"\x40\x02\x00\x05" * 2)
    wire = publish.encode(V311)
    reader = PacketReader(version=V311)
    assert not list(reader.feed(wire[:5]))
    assert reader.leading_pubacks(wire[5:]) == ([], 0)
    assert list(reader.feed(wire[5:])) == [publish]


def test_leading_pubacks_stop_at_packet_identifier_0() -> None:
    """MQTT-2.2.1-3: a PUBACK with Packet Identifier 0 ends the run; ``feed`` then rejects it as malformed."""
    reader = PacketReader(version=V311)
    data = b"\x40\x02\x00\x07" + b"\x40\x02\x00\x00" + b"\x40\x02\x00\x08"
    assert reader.leading_pubacks(data) == ([7], 4)
    with pytest.raises(MalformedPacket, match="Packet Identifier 0"):
        list(reader.feed(data[4:]))


def test_packets_not_consumed_stay_buffered() -> None:
    """Closing the feed() generator early keeps the unread packets for the next feed()."""
    first, second = Publish("a", b"1"), Publish("b", b"2", 1, packet_id=2)
    reader = PacketReader(version=V5)
    packets = reader.feed(first.encode(V5) + second.encode(V5) + b"\x30")
    assert next(packets) == first
    packets.close()
    assert reader.buffered == len(second.encode(V5)) + 1
    assert list(reader.feed(b"")) == [second]
    assert reader.buffered == 1  # the lone first byte of a third packet waits


@ROUNDTRIP
@given(connect=connects(3))
def test_roundtrip_mqtt_3_1_connect_sets_reader_to_level_3_in_the_3_1_1_format(connect: Connect) -> None:
    """MQTT 3.1 (MQIsdp, level 3) CONNECT round-trips; the reader then decodes at level 3, which is the 3.1.1 wire
    format (no properties, no reason codes) but for the fixed-header flags MQTT 3.1 allows."""
    wire = connect.encode()
    assert wire[2:10] == b"\x00\x06MQIsdp"
    reader = PacketReader(version=V5)
    assert list(reader.feed(wire)) == [connect]
    assert reader.version == 3
    later = [Publish("a/b", b"x", 1, False, False, 7), PubRel(7), Subscribe(8, [Subscription("a/#", 1)])]
    assert list(reader.feed(b"".join(p.encode(V311) for p in later))) == later


@pytest.mark.parametrize(("name", "version"), CASES, ids=[f"{n}-v{v}" for n, v in CASES])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_max_packet_size_equal_to_the_packet_is_accepted(name: str, version: int, data: st.DataObject) -> None:
    packet = data.draw(STRATEGIES[name](version))
    wire = packet.encode(version)
    reader = PacketReader(max_packet_size=len(wire), version=version)
    assert list(reader.feed(wire)) == [packet]


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_encode_publish_parts_matches_publish_encode(version: int, data: st.DataObject) -> None:
    """``head [+ packet id] + tail`` is the same packet Publish.encode() writes; OR-ing 0x08 into head sets DUP."""
    packet = data.draw(publishes(version))
    packet.payload = data.draw(st.sampled_from([packet.payload, b"\x5a" * 200, b"\x5a" * 16_400]))
    head, tail = encode_publish_parts(
        packet.topic, packet.payload, packet.qos, packet.retain, packet.properties, version
    )
    pid = packet.packet_id.to_bytes(2, "big") if packet.qos else b""  # type: ignore[union-attr]
    if packet.dup:
        head = bytes((head[0] | 0x08,)) + head[1:]
    wire = head + pid + tail
    assert wire == packet.encode(version)
    assert decode_all(wire, version) == [packet]


# ---------------------------------------------------------------------------------------------- 3.1.1 drops 5.0 fields


@settings(max_examples=40, deadline=None)
@given(packet=publishes(V5))
def test_v5_only_fields_are_dropped_when_encoding_3_1_1(packet: Publish) -> None:
    """Encoding for level 4 leaves out the properties; the 3.1.1 decode sees the same message."""
    decoded = decode_all(packet.encode(V311), V311)
    assert len(decoded) == 1
    got = decoded[0]
    assert isinstance(got, Publish)
    assert got.properties == {}
    assert (got.topic, got.payload, got.qos, got.retain, got.dup, got.packet_id) == (
        packet.topic,
        packet.payload,
        packet.qos,
        packet.retain,
        packet.dup,
        packet.packet_id,
    )


@settings(max_examples=40, deadline=None)
@given(packet=acks(PubAck, PUBACK_REASONS, V5))
def test_v5_ack_encoded_for_3_1_1_is_two_bytes_of_packet_id(packet: PubAck) -> None:
    wire = packet.encode(V311)
    assert wire == bytes((0x40, 2)) + packet.packet_id.to_bytes(2, "big")
    assert decode_all(wire, V311) == [PubAck(packet.packet_id)]


# ------------------------------------------------------------------------------------------------ data types


@settings(max_examples=300, deadline=None)
@given(value=st.integers(0, VBI_MAX))
def test_vbi_roundtrip(value: int) -> None:
    data = encode_vbi(value)
    assert decode_vbi(data + b"\xaa", 0) == (value, len(data))


@settings(max_examples=100, deadline=None)
@given(value=st.integers(0, 0xFFFF), prefix=st.binary(max_size=3))
def test_two_byte_integer_roundtrip(value: int, prefix: bytes) -> None:
    assert decode_u16(prefix + encode_u16(value), len(prefix)) == (value, len(prefix) + 2)


@settings(max_examples=100, deadline=None)
@given(value=st.integers(0, 0xFFFF_FFFF), prefix=st.binary(max_size=3))
def test_four_byte_integer_roundtrip(value: int, prefix: bytes) -> None:
    assert decode_u32(prefix + encode_u32(value), len(prefix)) == (value, len(prefix) + 4)


@settings(max_examples=200, deadline=None)
@given(value=mqtt_text(max_size=40))
def test_utf8_string_roundtrip(value: str) -> None:
    data = encode_string(value)
    assert len(data) == 2 + len(value.encode("utf-8"))
    assert decode_string(data + b"\xff", 0) == (value, len(data))


@settings(max_examples=100, deadline=None)
@given(value=st.binary(max_size=300))
def test_binary_data_roundtrip(value: bytes) -> None:
    data = encode_binary(value)
    assert decode_binary(data, 0) == (value, len(data))


PROPERTY_PACKETS = sorted(ALLOWED)


@pytest.mark.parametrize("packet_type", PROPERTY_PACKETS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_properties_roundtrip_for_each_packet_type(packet_type: int, data: st.DataObject) -> None:
    props = data.draw(properties(packet_type))
    wire = encode_props(props)
    decoded, end = decode_properties(wire + b"\x00\x01", 0, packet_type)
    assert end == len(wire)
    assert decoded == props


def test_property_table_matches_the_spec() -> None:
    """The codec's PROPERTY_TYPES partitions the identifiers exactly as MQTT 5.0 Table 2-4 does."""
    assert set(PROPERTY_TYPES) == set(SPEC_TYPES)
    by_kind: dict[str, set[int]] = {}
    for ident, kind in SPEC_TYPES.items():
        by_kind.setdefault(kind, set()).add(PROPERTY_TYPES[ident])
    assert all(len(codes) == 1 for codes in by_kind.values())
    assert len({next(iter(codes)) for codes in by_kind.values()}) == len(by_kind)
