"""Byte-exact vectors for the MQTT codec, hand-computed from the specs, plus paho-mqtt as an independent oracle.

The hex strings below were worked out by hand from MQTT 3.1.1 §2-3 and MQTT 5.0 §2-3 (fixed header, Remaining
Length, variable header, properties, payload). paho-mqtt's own encoders (its ``Properties.pack()``, its
``VariableByteIntegers`` and its client's private ``_send_*`` packet builders, captured before they reach a
socket) serve as a second, independent implementation. No network connection is opened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import paho.mqtt.client as paho_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.properties import VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

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
    decode_packet,
)
from gateway.mqtt.primitives import VBI_MAX, decode_string, decode_vbi, encode_vbi
from gateway.mqtt.properties import ALLOWED, PROPERTY_TYPES, WILL, Properties, PropertyId, decode_properties
from gateway.mqtt.properties import encode_properties as encode_props

P = PropertyId
V311 = 4
V5 = 5


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def decode_one(data: bytes, version: int) -> Packet:
    reader = PacketReader(version=version)
    packets = list(reader.feed(data))
    assert reader.buffered == 0
    assert len(packets) == 1
    return packets[0]


# ------------------------------------------------------------------------------------------------ hand-computed vectors

#: (id, protocol level, packet, its exact encoding). Each is checked in both directions.
VECTORS: list[tuple[str, int, Packet, str]] = [
    # CONNECT: 00 04 "MQTT", level, flags, keep alive; [5.0: properties]; client id; will; user name; password.
    ("connect-311-client-id", V311, Connect("abc", V311, True, 60), "10 0f 0004 4d515454 04 02 003c 0003 616263"),
    ("connect-5-client-id", V5, Connect("abc", V5, True, 60), "10 10 0004 4d515454 05 02 003c 00 0003 616263"),
    (
        "connect-311-will-user-password",
        V311,
        Connect("c", V311, False, 0, "u", b"p", Will("w", b"x", 1, True)),
        # flags: user 0x80 | password 0x40 | will retain 0x20 | will QoS 1 0x08 | will 0x04 = 0xEC
        "10 19 0004 4d515454 04 ec 0000 0001 63 0001 77 0001 78 0001 75 0001 70",
    ),
    (
        "connect-5-properties",
        V5,
        Connect("", V5, True, 0, properties={P.SESSION_EXPIRY_INTERVAL: 30, P.RECEIVE_MAXIMUM: 10}),
        "10 15 0004 4d515454 05 02 0000 08 11 0000001e 21 000a 0000",
    ),
    (
        "connect-5-will-properties",
        V5,
        Connect("c", V5, True, 10, will=Will("t", b"", 0, False, {P.WILL_DELAY_INTERVAL: 5})),
        "10 19 0004 4d515454 05 06 000a 00 0001 63 05 18 00000005 0001 74 0000",
    ),
    ("connect-31-mqisdp", 3, Connect("abc", 3, True, 60), "10 11 0006 4d5149736470 03 02 003c 0003 616263"),
    # CONNACK
    ("connack-311-session-present", V311, Connack(True, 0), "20 02 01 00"),
    ("connack-311-refused-5", V311, Connack(False, 5), "20 02 00 05"),
    ("connack-5", V5, Connack(False, 0), "20 03 00 00 00"),
    ("connack-5-not-authorized", V5, Connack(False, 0x87), "20 03 00 87 00"),
    (
        "connack-5-properties",
        V5,
        Connack(False, 0, {P.ASSIGNED_CLIENT_IDENTIFIER: "id", P.MAXIMUM_QOS: 1, P.TOPIC_ALIAS_MAXIMUM: 16}),
        "20 0d 00 00 0a 12 0002 6964 24 01 22 0010",
    ),
    # PUBLISH: flags DUP(8) QoS(6) RETAIN(1); topic; packet id if QoS > 0; [5.0: properties]; payload.
    ("publish-311-qos1", V311, Publish("a/b", b"hi", 1, packet_id=10), "32 09 0003 612f62 000a 6869"),
    ("publish-5-qos1", V5, Publish("a/b", b"hi", 1, packet_id=10), "32 0a 0003 612f62 000a 00 6869"),
    ("publish-311-qos0-retain-empty", V311, Publish("t", b"", 0, True), "31 03 0001 74"),
    ("publish-311-qos2-dup", V311, Publish("t", b"", 2, dup=True, packet_id=1), "3c 05 0001 74 0001"),
    (
        "publish-5-properties",
        V5,
        Publish("t", b"!", 0, properties={P.TOPIC_ALIAS: 5, P.SUBSCRIPTION_IDENTIFIER: [1, 300]}),
        "30 0d 0001 74 08 23 0005 0b 01 0b ac02 21",
    ),
    # PUBACK / PUBREC / PUBREL / PUBCOMP, with the 5.0 short forms (MQTT 5.0 §3.4.2.1).
    ("puback-311", V311, PubAck(1), "40 02 0001"),
    ("puback-5-success-short", V5, PubAck(1), "40 02 0001"),
    ("puback-5-reason-only", V5, PubAck(1, 0x10), "40 03 0001 10"),
    ("puback-5-reason-string", V5, PubAck(1, 0, {P.REASON_STRING: "ok"}), "40 09 0001 00 05 1f 0002 6f6b"),
    ("pubrec-311", V311, PubRec(0x1234), "50 02 1234"),
    ("pubrec-5-error", V5, PubRec(7, 0x80), "50 03 0007 80"),
    ("pubrel-311", V311, PubRel(1), "62 02 0001"),
    ("pubrel-5-not-found", V5, PubRel(1, 0x92), "62 03 0001 92"),
    ("pubcomp-311", V311, PubComp(0xFFFF), "70 02 ffff"),
    # SUBSCRIBE: fixed header flags 0b0010 -> first byte 0x82.
    ("subscribe-311", V311, Subscribe(1, [Subscription("a/b", 1)]), "82 08 0001 0003 612f62 01"),
    (
        "subscribe-311-two",
        V311,
        Subscribe(2, [Subscription("a", 0), Subscription("#", 2)]),
        "82 0a 0002 0001 61 00 0001 23 02",
    ),
    # options: QoS 1 | No Local 0x04 | Retain As Published 0x08 | Retain Handling 2 << 4 = 0x2D
    ("subscribe-5-options", V5, Subscribe(1, [Subscription("a/b", 1, True, True, 2)]), "82 09 0001 00 0003 612f62 2d"),
    (
        "subscribe-5-subscription-identifier",
        V5,
        Subscribe(1, [Subscription("a/b")], {P.SUBSCRIPTION_IDENTIFIER: [300]}),
        "82 0c 0001 03 0b ac02 0003 612f62 00",
    ),
    ("suback-311", V311, Suback(1, [0, 1, 2, 0x80]), "90 06 0001 00010280"),
    ("suback-5", V5, Suback(1, [0, 1, 2, 0x80, 0xA2]), "90 08 0001 00 00010280a2"),
    ("unsubscribe-311", V311, Unsubscribe(2, ["a"]), "a2 05 0002 0001 61"),
    ("unsubscribe-5", V5, Unsubscribe(2, ["a", "b/c"]), "a2 0b 0002 00 0001 61 0003 622f63"),
    ("unsuback-311", V311, Unsuback(2), "b0 02 0002"),
    ("unsuback-5", V5, Unsuback(2, [0x00, 0x11]), "b0 05 0002 00 0011"),
    ("pingreq-311", V311, PingReq(), "c0 00"),
    ("pingreq-5", V5, PingReq(), "c0 00"),
    ("pingresp", V311, PingResp(), "d0 00"),
    # DISCONNECT: e0 00 when the reason is Normal disconnection with no properties (MQTT 5.0 §3.14.2.1).
    ("disconnect-311", V311, Disconnect(), "e0 00"),
    ("disconnect-5-short", V5, Disconnect(), "e0 00"),
    ("disconnect-5-with-will", V5, Disconnect(0x04), "e0 01 04"),
    ("disconnect-5-properties", V5, Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}), "e0 07 00 05 11 00000000"),
    ("auth-5-short", V5, Auth(), "f0 00"),
    (
        "auth-5-continue",
        V5,
        Auth(0x18, {P.AUTHENTICATION_METHOD: "SCRAM"}),
        "f0 0a 18 08 15 0005 53435241 4d",
    ),
]


@pytest.mark.parametrize(("version", "packet", "wire"), [v[1:] for v in VECTORS], ids=[v[0] for v in VECTORS])
def test_vector_encode(version: int, packet: Packet, wire: str) -> None:
    assert packet.encode(version).hex(" ") == h(wire).hex(" ")


@pytest.mark.parametrize(("version", "packet", "wire"), [v[1:] for v in VECTORS], ids=[v[0] for v in VECTORS])
def test_vector_decode(version: int, packet: Packet, wire: str) -> None:
    assert decode_one(h(wire), version) == packet


#: Encodings a receiver must accept although our encoder picks a shorter form (MQTT 5.0 §3.4.2.1, §3.14.2.1).
DECODE_ONLY: list[tuple[str, int, str, Packet]] = [
    ("puback-5-long-success", V5, "40 04 0001 00 00", PubAck(1)),
    ("puback-5-reason-empty-props", V5, "40 04 0001 10 00", PubAck(1, 0x10)),
    ("pubrel-5-long-success", V5, "62 04 0001 00 00", PubRel(1)),
    ("disconnect-5-reason-only", V5, "e0 01 00", Disconnect()),
    ("disconnect-5-empty-props", V5, "e0 02 00 00", Disconnect()),
    ("disconnect-5-server-shutting-down", V5, "e0 02 8b 00", Disconnect(0x8B)),
    ("auth-5-empty-props", V5, "f0 02 18 00", Auth(0x18)),
    ("connect-5-password-without-user", V5, "10 12 0004 4d515454 05 42 0000 00 0000 0003 707764", None),
]


@pytest.mark.parametrize(("version", "wire", "packet"), [v[1:] for v in DECODE_ONLY], ids=[v[0] for v in DECODE_ONLY])
def test_vector_decode_only(version: int, wire: str, packet: Packet | None) -> None:
    if packet is None:  # 5.0 allows a Password without a User Name (MQTT 5.0 §3.1.2.9)
        packet = Connect("", V5, True, 0, None, b"pwd")
    assert decode_one(h(wire), version) == packet


def test_remaining_length_128_is_80_01() -> None:
    packet = Publish("t", b"x" * 125)  # 2 + 1 + 125 = 128 bytes after the fixed header
    wire = packet.encode(V311)
    assert wire[:6] == h("30 80 01 0001 74")
    assert len(wire) == 3 + 128
    assert decode_one(wire, V311) == packet


@pytest.mark.parametrize(
    ("remaining", "header"),
    [(127, "30 7f"), (128, "30 8001"), (16383, "30 ff7f"), (16384, "30 808001")],
)
def test_remaining_length_boundaries_in_a_publish(remaining: int, header: str) -> None:
    packet = Publish("t", b"\xa5" * (remaining - 3))
    wire = packet.encode(V311)
    assert wire.startswith(h(header) + h("0001 74"))
    assert len(wire) == len(h(header)) + remaining
    assert decode_one(wire, V311) == packet


VBI_VECTORS = [
    (0, "00"),
    (127, "7f"),
    (128, "80 01"),
    (16383, "ff 7f"),
    (16384, "80 80 01"),
    (2097151, "ff ff 7f"),
    (2097152, "80 80 80 01"),
    (268435455, "ff ff ff 7f"),
]


@pytest.mark.parametrize(("value", "wire"), VBI_VECTORS)
def test_vbi_boundaries(value: int, wire: str) -> None:
    """MQTT 5.0 §1.5.5 Table 1-1 boundaries, both ways."""
    assert encode_vbi(value) == h(wire)
    assert decode_vbi(h(wire), 0) == (value, len(h(wire)))


@pytest.mark.parametrize("value", [-1, VBI_MAX + 1, 2**32])
def test_vbi_out_of_range_refused_by_encoder(value: int) -> None:
    with pytest.raises(ValueError):
        encode_vbi(value)


@settings(max_examples=200, deadline=None)
@given(value=st.integers(0, VBI_MAX))
def test_mqtt_1_5_5_1_vbi_encoded_with_minimum_number_of_bytes(value: int) -> None:
    """MQTT-1.5.5-1: the encoded value uses the minimum number of bytes necessary."""
    minimum = 1 + sum(value >= limit for limit in (128, 16384, 2097152))
    assert len(encode_vbi(value)) == minimum


@pytest.mark.parametrize(("payload", "length_bytes"), [(0, 1), (124, 1), (125, 2), (16380, 2), (16381, 3)])
def test_mqtt_1_5_5_1_remaining_length_uses_minimum_bytes(payload: int, length_bytes: int) -> None:
    """MQTT-1.5.5-1 for the Remaining Length the encoder writes (body = 3 + payload bytes)."""
    wire = Publish("t", b"p" * payload).encode(V311)
    assert len(wire) == 1 + length_bytes + 3 + payload
    assert wire[length_bytes] < 0x80  # the last Remaining Length byte has no continuation bit
    assert all(b & 0x80 for b in wire[1:length_bytes])


def test_property_vector_publish() -> None:
    props: Properties = {
        P.PAYLOAD_FORMAT_INDICATOR: 1,
        P.MESSAGE_EXPIRY_INTERVAL: 3600,
        P.CONTENT_TYPE: "a",
        P.USER_PROPERTY: [("k", "v"), ("k", "w")],
        P.SUBSCRIPTION_IDENTIFIER: [1, 128],
    }
    wire = h("1e 01 01 02 00000e10 03 0001 61 26 0001 6b 0001 76 26 0001 6b 0001 77 0b 01 0b 8001")
    assert encode_props(props) == wire
    assert decode_properties(wire, 0, 3) == (props, len(wire))


def test_mqtt_2_2_2_1_no_properties_means_property_length_zero() -> None:
    """MQTT-2.2.2-1: with no properties, a Property Length of zero is included."""
    assert encode_props({}) == b"\x00"
    assert encode_props(None) == b"\x00"
    assert Connack().encode(V5)[-1] == 0
    assert Subscribe(1, [Subscription("a")]).encode(V5)[4] == 0
    assert Unsuback(1, [0]).encode(V5)[4] == 0
    assert Publish("t", b"").encode(V5)[-1] == 0


def test_mqtt_2_2_1_2_qos0_publish_carries_no_packet_identifier() -> None:
    """MQTT-2.2.1-2 (3.1.1: MQTT-2.3.1-5): a QoS 0 PUBLISH has no Packet Identifier."""
    assert Publish("t", b"", 0, packet_id=7).encode(V311) == h("30 03 0001 74")
    assert decode_one(h("30 03 0001 74"), V311) == Publish("t")


def test_mqtt_3_9_3_2_v311_suback_uses_only_0_1_2_and_0x80() -> None:
    """3.1.1 MQTT-3.9.3-2: 5.0 failure reason codes (0x83, 0x87, 0xA2, ...) go out as 0x80 Failure on 3.1.1."""
    packet = Suback(1, [0x00, 0x87, 0x02, 0xA2, 0x01, 0x9E])
    assert packet.encode(V311) == h("90 08 0001 00 80 02 80 01 80")
    assert packet.encode(V5) == h("90 09 0001 00 00 87 02 a2 01 9e")


def test_mqtt_1_5_4_3_bom_is_not_stripped() -> None:
    """MQTT-1.5.4-3 (3.1.1: MQTT-1.5.3-3): 0xEF 0xBB 0xBF is U+FEFF and is neither skipped nor stripped."""
    assert decode_string(h("0003 efbbbf"), 0) == ("\ufeff", 5)
    packet = decode_one(h("30 06 0004 61efbbbf"), V311)
    assert isinstance(packet, Publish)
    assert packet.topic == "a\ufeff"


def test_utf8_string_vector_from_the_spec() -> None:
    """MQTT 5.0 §1.5.4 Figure 1-1: 'A\U0002a6d4' is 00 05 41 F0 AA 9B 94."""
    assert decode_string(h("0005 41 f0aa9b94"), 0) == ("A\U0002a6d4", 7)


def test_fixed_header_flags_of_encoded_packets() -> None:
    """MQTT-2.1.3-1 (3.1.1: MQTT-2.2.2-1): PUBREL, SUBSCRIBE, UNSUBSCRIBE carry 0b0010, all others 0."""
    for version in (V311, V5):
        assert PubRel(1).encode(version)[0] == 0x62
        assert Subscribe(1, [Subscription("a")]).encode(version)[0] == 0x82
        assert Unsubscribe(1, ["a"]).encode(version)[0] == 0xA2
        for packet in (Connect(), Connack(), PubAck(1), PubRec(1), PubComp(1), Suback(1, [0]), Unsuback(1)):
            assert packet.encode(version)[0] & 0x0F == 0
        assert Disconnect().encode(version)[0] == 0xE0
    assert Auth(0x19).encode(V5)[0] == 0xF0


# ------------------------------------------------------------------------------------------------ paho-mqtt oracle

_PAHO_NAMES: dict[int, str] = {ident: name.replace(" ", "") for name, ident in PahoProperties(1).names.items()}


def paho_packet_type(packet_type: int) -> int:
    return PacketTypes.WILLMESSAGE if packet_type == WILL else packet_type


def to_paho(props: Properties, packet_type: int) -> PahoProperties:
    out = PahoProperties(paho_packet_type(packet_type))
    for ident, value in props.items():
        setattr(out, _PAHO_NAMES[ident], value)
    return out


def from_paho(props: PahoProperties) -> Properties:
    out: Properties = {}
    for ident, name in _PAHO_NAMES.items():
        if hasattr(props, name):
            value = getattr(props, name)
            out[ident] = bytes(value) if isinstance(value, bytes | bytearray) else value
    return out


def test_allow_lists_match_paho() -> None:
    """Which property each packet may carry (MQTT 5.0 §2.2.2.2 Table 2-4), cross-checked with paho's table."""
    table = PahoProperties(1).properties
    for packet_type in range(1, 16):
        expected = {ident for ident, (_, packets) in table.items() if packet_type in packets}
        assert set(ALLOWED.get(packet_type, ())) == expected, packet_type
    expected_will = {ident for ident, (_, packets) in table.items() if PacketTypes.WILLMESSAGE in packets}
    assert set(ALLOWED[WILL]) == expected_will
    assert set(PROPERTY_TYPES) == set(table)


def test_property_types_match_paho() -> None:
    table = PahoProperties(1).properties
    groups: dict[int, set[int]] = {}
    for ident, (paho_kind, _) in table.items():
        groups.setdefault(paho_kind, set()).add(PROPERTY_TYPES[ident])
    assert all(len(kinds) == 1 for kinds in groups.values())
    assert len(groups) == 7


# Text paho can read back: paho rejects U+FEFF, which MQTT-1.5.4-3 says must be kept, so leave it out here.
paho_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00\ufeff"), max_size=10)


def oracle_value(ident: int, packet_type: int) -> st.SearchStrategy[Any]:
    kind = PROPERTY_TYPES[ident]
    if ident == P.USER_PROPERTY:
        return st.lists(st.tuples(paho_text, paho_text), min_size=1, max_size=3)
    if ident == P.SUBSCRIPTION_IDENTIFIER:
        return st.lists(st.integers(1, VBI_MAX), min_size=1, max_size=3 if packet_type == 3 else 1)
    if ident in (P.RECEIVE_MAXIMUM, P.TOPIC_ALIAS):
        return st.integers(1, 0xFFFF)
    if ident == P.MAXIMUM_PACKET_SIZE:
        return st.integers(1, VBI_MAX)  # paho refuses larger values
    by_kind = {
        PROPERTY_TYPES[P.PAYLOAD_FORMAT_INDICATOR]: st.integers(0, 1),
        PROPERTY_TYPES[P.SERVER_KEEP_ALIVE]: st.integers(0, 0xFFFF),
        PROPERTY_TYPES[P.MESSAGE_EXPIRY_INTERVAL]: st.integers(0, 0xFFFF_FFFF),
        PROPERTY_TYPES[P.CONTENT_TYPE]: paho_text,
        PROPERTY_TYPES[P.CORRELATION_DATA]: st.binary(max_size=16),
    }
    return by_kind[kind]


def oracle_properties(packet_type: int) -> st.SearchStrategy[Properties]:
    """Properties for ``packet_type`` in identifier order, the order paho's ``pack()`` writes them in."""
    optional = {ident: oracle_value(ident, packet_type) for ident in ALLOWED[packet_type]}
    return st.fixed_dictionaries({}, optional=optional).map(lambda d: dict(sorted(d.items())))


@pytest.mark.parametrize("packet_type", sorted(ALLOWED))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_properties_agree_with_paho(packet_type: int, data: st.DataObject) -> None:
    """Ours and paho's encoders write the same bytes; each decodes the other's."""
    props = data.draw(oracle_properties(packet_type))
    paho = to_paho(props, packet_type)
    ours = encode_props(props)
    assert ours == paho.pack()
    assert decode_properties(paho.pack(), 0, packet_type) == (props, len(ours))
    back, used = PahoProperties(paho_packet_type(packet_type)).unpack(ours)
    assert used == len(ours)
    assert from_paho(back) == props


@settings(max_examples=200, deadline=None)
@given(value=st.integers(0, VBI_MAX))
def test_vbi_agrees_with_paho(value: int) -> None:
    ours = encode_vbi(value)
    assert ours == VariableByteIntegers.encode(value)
    packed = paho_client.Client._pack_remaining_length(None, bytearray(), value)  # type: ignore[arg-type]
    assert bytes(packed) == ours
    assert VariableByteIntegers.decode(ours) == decode_vbi(ours, 0)


class PahoCapture:
    """A paho Client that is never connected: its ``_send_*`` builders hand their bytes to us instead."""

    def __init__(self, version: int, client_id: str = "paho", clean: bool = True) -> None:
        protocol = paho_client.MQTTv5 if version == V5 else paho_client.MQTTv311
        kwargs: dict[str, Any] = {} if version == V5 else {"clean_session": clean}
        self.client = paho_client.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol, **kwargs)
        if version == V5:
            self.client._clean_start = clean
        self.packets: list[bytes] = []
        self.client._packet_queue = self._queue  # type: ignore[method-assign]
        self.client._sock = object()  # type: ignore[assignment]  # _send_publish refuses to run without a socket

    def _queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int, info: Any = None) -> int:
        self.packets.append(bytes(packet))
        return 0


@contextmanager
def paho(version: int, client_id: str = "paho", clean: bool = True) -> Iterator[PahoCapture]:
    capture = PahoCapture(version, client_id, clean)
    try:
        yield capture
    finally:
        capture.client._sock = None


topics = st.text(st.characters(codec="utf-8", exclude_characters="\x00+#"), min_size=1, max_size=10)


@pytest.mark.parametrize("version", [V311, V5])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_paho_publish_decodes_and_matches_bytes(version: int, data: st.DataObject) -> None:
    qos = data.draw(st.integers(0, 2))
    packet = Publish(
        topic=data.draw(topics),
        payload=data.draw(st.binary(max_size=300)),
        qos=qos,
        retain=data.draw(st.booleans()),
        dup=data.draw(st.booleans()) if qos else False,
        packet_id=data.draw(st.integers(1, 0xFFFF)) if qos else None,
        properties=data.draw(oracle_properties(3)) if version == V5 else {},
    )
    with paho(version) as cap:
        props = to_paho(packet.properties, 3) if packet.properties else None
        pid = packet.packet_id or 0
        cap.client._send_publish(
            pid, packet.topic.encode(), packet.payload, qos, packet.retain, packet.dup, None, props
        )
    (wire,) = cap.packets
    assert decode_one(wire, version) == packet
    assert packet.encode(version) == wire


@pytest.mark.parametrize("version", [V311, V5])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_paho_connect_decodes_and_matches_bytes(version: int, data: st.DataObject) -> None:
    client_id = data.draw(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=23))
    clean = data.draw(st.booleans())
    keep_alive = data.draw(st.integers(0, 0xFFFF))
    username = data.draw(st.none() | paho_text)
    password = data.draw(st.none() | st.binary(max_size=10)) if username is not None else None
    will = None
    if data.draw(st.booleans()):
        will_props = data.draw(oracle_properties(WILL)) if version == V5 else {}
        will = Will(data.draw(topics), data.draw(st.binary(max_size=20)), data.draw(st.integers(0, 2)))
        will.retain = data.draw(st.booleans())
        will.properties = will_props
    props = data.draw(oracle_properties(1)) if version == V5 else {}
    expected = Connect(client_id, version, clean, keep_alive, username, password, will, props)

    with paho(version, client_id, clean) as cap:
        if username is not None:
            cap.client.username_pw_set(username, password)  # type: ignore[arg-type]
        if will is not None:
            will_p = to_paho(will.properties, WILL) if will.properties else None
            cap.client.will_set(will.topic, will.payload, will.qos, will.retain, will_p)
        if props:
            cap.client._connect_properties = to_paho(props, 1)
        cap.client._send_connect(keep_alive)
    (wire,) = cap.packets
    assert decode_one(wire, V311) == expected  # the CONNECT carries its own level
    assert expected.encode() == wire


@pytest.mark.parametrize("version", [V311, V5])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_paho_subscribe_and_unsubscribe_decode_and_match_bytes(version: int, data: st.DataObject) -> None:
    filters = data.draw(
        st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1), min_size=1, max_size=4)
    )
    subs = []
    for topic_filter in filters:
        qos = data.draw(st.integers(0, 2))
        if version == V5:
            no_local, rap, rh = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.integers(0, 2))
            subs.append(Subscription(topic_filter, qos, no_local, rap, rh))
        else:
            subs.append(Subscription(topic_filter, qos))
    with paho(version) as cap:
        if version == V5:
            opts = [SubscribeOptions(s.qos, s.no_local, s.retain_as_published, s.retain_handling) for s in subs]
            topic_opts: list[tuple[bytes, Any]] = [(s.topic_filter.encode(), o) for s, o in zip(subs, opts)]
        else:
            topic_opts = [(s.topic_filter.encode(), s.qos) for s in subs]
        _, sub_id = cap.client._send_subscribe(False, topic_opts)
        _, unsub_id = cap.client._send_unsubscribe(False, [f.encode() for f in filters])
    sub_wire, unsub_wire = cap.packets
    subscribe = Subscribe(sub_id, subs)
    unsubscribe = Unsubscribe(unsub_id, filters)
    assert decode_one(sub_wire, version) == subscribe
    assert subscribe.encode(version) == sub_wire
    assert decode_one(unsub_wire, version) == unsubscribe
    assert unsubscribe.encode(version) == unsub_wire


@pytest.mark.parametrize("version", [V311, V5])
def test_paho_small_packets_decode_and_match_bytes(version: int) -> None:
    with paho(version) as cap:
        cap.client._send_command_with_mid(0x40, 5, False)
        cap.client._send_pubrec(6)
        cap.client._send_pubrel(7)
        cap.client._send_command_with_mid(0x70, 8, False)
        cap.client._send_pingreq()
        cap.client._send_pingresp()
        cap.client._send_disconnect()
    expected = [PubAck(5), PubRec(6), PubRel(7), PubComp(8), PingReq(), PingResp(), Disconnect()]
    assert [decode_one(w, version) for w in cap.packets] == expected
    assert [p.encode(version) for p in expected] == cap.packets


@pytest.mark.parametrize("reason", [0x04, 0x80, 0x8B, 0x8E, 0x9C])
def test_paho_disconnect_with_reason_code(reason: int) -> None:
    with paho(V5) as cap:
        props = PahoProperties(PacketTypes.DISCONNECT)
        props.ReasonString = "bye"
        cap.client._send_disconnect(PahoReasonCode(PacketTypes.DISCONNECT, identifier=reason))
        cap.client._send_disconnect(PahoReasonCode(PacketTypes.DISCONNECT, identifier=reason), props)
    short, full = cap.packets
    assert decode_one(short, V5) == Disconnect(reason)
    assert Disconnect(reason).encode(V5) == short
    assert decode_one(full, V5) == Disconnect(reason, {P.REASON_STRING: "bye"})
    assert Disconnect(reason, {P.REASON_STRING: "bye"}).encode(V5) == full


def test_decode_packet_directly_matches_reader() -> None:
    """decode_packet() is the reader's body decoder: same result on the same bytes."""
    wire = h("32 0a 0003 612f62 000a 00 6869")
    assert decode_packet(wire[0], wire[2:], V5) == decode_one(wire, V5)
