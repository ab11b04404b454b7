"""Malformed and forbidden input against the real broker process: the offending connection is closed - an MQTT 5.0
client first gets a DISCONNECT with the right Reason Code (0x81 Malformed Packet, 0x82 Protocol Error, ...), a 3.1.1
client is simply disconnected - and the broker keeps serving everyone else (MQTT 5.0 MQTT-4.13.1-1, §4.13;
MQTT 3.1.1 MQTT-4.8.0-1). Random garbage on many connections never crashes it.

Test names carry the normative statement they check (MQTT 5.0 ids unless the name says ``v311``; ids as listed in
docs/conformance.md). Each parametrized case runs on both protocol levels where the packet exists in both.
"""

from __future__ import annotations

import queue
import random
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, RawClient

from gateway.mqtt.packets import (
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    Publish,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)
from gateway.mqtt.primitives import encode_vbi
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC

V311, V5 = 4, 5
MALFORMED, PROTOCOL, TOPIC_NAME_INVALID = RC.MALFORMED_PACKET, RC.PROTOCOL_ERROR, RC.TOPIC_NAME_INVALID
CONNACK_311_OK = b"\x20\x02\x00\x00"


def frame(first: int, body: bytes) -> bytes:
    """A packet with the given first byte and body; the Remaining Length is computed here."""
    return bytes((first,)) + encode_vbi(len(body)) + body


def mqtt_str(data: bytes) -> bytes:
    """A length-prefixed string field holding exactly ``data`` (which may be invalid UTF-8 on purpose)."""
    return len(data).to_bytes(2, "big") + data


def publish(topic: bytes, version: int, qos: int = 0, flags: int | None = None, packet_id: int = 1,
            props: bytes = b"\x00", payload: bytes = b"x") -> bytes:
    """A PUBLISH whose Topic Name is the raw bytes ``topic``; ``props`` is the 5.0 property block."""
    body = mqtt_str(topic)
    if qos:
        body += packet_id.to_bytes(2, "big")
    if version == V5:
        body += props
    return frame(0x30 | (qos << 1) if flags is None else flags, body + payload)


def by_version(v311: bytes, v5: bytes) -> dict[int, bytes]:
    return {V311: v311, V5: v5}


def closed(client: RawClient, timeout: float = 3.0) -> bool:
    """True when the server closes ``client``'s connection within ``timeout``; packets that arrive before the close
    stay readable with ``client.recv()``."""
    return client.closed_by_server(timeout)


@pytest.fixture
def raw() -> Iterator[Callable[..., RawClient]]:
    """Open :class:`RawClient` connections; all are closed at teardown."""
    opened: list[RawClient] = []

    def make(port: int, version: int = V311) -> RawClient:
        client = RawClient(port, version=version)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def check_rejected(port: int, raw: Callable[..., RawClient], version: int, data: bytes, code: int | None,
                   uid: str) -> None:
    """Connect at ``version``, send ``data`` and check the broker's answer: for 5.0 exactly one DISCONNECT with
    Reason Code ``code``, then the close; for 3.1.1 the close with nothing after the CONNACK. A bystander
    connection opened before must still be served afterwards."""
    bystander = raw(port, V5)
    bystander.connect(f"{uid}-bystander")
    client = raw(port, version)
    client.connect(uid)
    connack_bytes = bytes(client.raw_received)
    client.send(data)
    assert closed(client), "the broker did not close the connection"
    after = client.recv_all(0.05)
    if version == V5:
        assert len(after) == 1, after
        packet = after[0]
        assert isinstance(packet, Disconnect), packet
        assert packet.reason_code == code, (hex(packet.reason_code), packet.properties.get(P.REASON_STRING))
        assert P.SESSION_EXPIRY_INTERVAL not in packet.properties  # MQTT-3.14.2-2
    else:
        assert after == []
        assert bytes(client.raw_received) == connack_bytes == CONNACK_311_OK
    bystander.send(PingReq())
    assert bystander.recv() == PingResp()


BOTH = pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])


# ------------------------------------------------------------------------------------------ encoding errors


@BOTH
def test_mqtt_1_5_5_1_remaining_length_longer_than_4_bytes(broker: BrokerProcess, raw: Any, uid: str,
                                                            version: int) -> None:
    """MQTT 5.0 §1.5.5 / §2.1.4 (a Variable Byte Integer has at most 4 bytes) and MQTT-4.13.1-1: a fifth Remaining
    Length byte is a Malformed Packet (0x81); 3.1.1 §2.2.3: the connection is closed."""
    check_rejected(broker.port, raw, version, b"\x30\xff\xff\xff\xff\x7f", MALFORMED, uid)


@BOTH
@pytest.mark.parametrize("topic", [b"a/\xc3\x28", b"a/\xed\xa0\x80", b"\xff\xfe"], ids=["bad-2-byte", "surrogate",
                                                                                       "ff-fe"])
def test_mqtt_1_5_4_1_ill_formed_utf8_topic(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                            topic: bytes) -> None:
    """MQTT-1.5.4-1 (3.1.1 MQTT-1.5.3-1): a Topic Name that is not well-formed UTF-8 - including an encoded
    surrogate U+D800 - is a Malformed Packet: DISCONNECT 0x81 (5.0), close (3.1.1)."""
    check_rejected(broker.port, raw, version, publish(topic, version), MALFORMED, uid)


@BOTH
def test_mqtt_1_5_4_2_null_character_in_topic(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT-1.5.4-2 / MQTT-4.7.3-2 (3.1.1 MQTT-1.5.3-2): U+0000 in a Topic Name: DISCONNECT 0x81 / close."""
    check_rejected(broker.port, raw, version, publish(b"a/\x00/b", version), MALFORMED, uid)


@BOTH
def test_mqtt_1_5_4_2_null_character_in_topic_filter(broker: BrokerProcess, raw: Any, uid: str,
                                                     version: int) -> None:
    """MQTT-1.5.4-2 in a SUBSCRIBE Topic Filter (3.1.1 MQTT-1.5.3-2): DISCONNECT 0x81 / close."""
    props = b"\x00" if version == V5 else b""
    data = frame(0x82, b"\x00\x01" + props + mqtt_str(b"a/\x00") + b"\x00")
    check_rejected(broker.port, raw, version, data, MALFORMED, uid)


# ------------------------------------------------------------------------------------------ fixed header


RESERVED_FLAGS = {
    "PUBACK-0x41": by_version(b"\x41\x02\x00\x01", b"\x41\x02\x00\x01"),
    "PUBREL-0x60": by_version(b"\x60\x02\x00\x01", b"\x60\x02\x00\x01"),  # MQTT-3.6.1-1
    "SUBSCRIBE-0x80": by_version(frame(0x80, b"\x00\x01" + mqtt_str(b"t") + b"\x00"),
                                 frame(0x80, b"\x00\x01\x00" + mqtt_str(b"t") + b"\x00")),  # MQTT-3.8.1-1
    "UNSUBSCRIBE-0xA0": by_version(frame(0xA0, b"\x00\x01" + mqtt_str(b"t")),
                                   frame(0xA0, b"\x00\x01\x00" + mqtt_str(b"t"))),  # MQTT-3.10.1-1
    "PINGREQ-0xC1": by_version(b"\xc1\x00", b"\xc1\x00"),
    "DISCONNECT-0xE1": by_version(b"\xe1\x00", b"\xe1\x00"),  # MQTT-3.14.1-1
}


@BOTH
@pytest.mark.parametrize("case", RESERVED_FLAGS)
def test_mqtt_2_1_3_1_reserved_fixed_header_flags(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                                  case: str) -> None:
    """MQTT-2.1.3-1 / MQTT-3.6.1-1 / MQTT-3.8.1-1 / MQTT-3.10.1-1 / MQTT-3.14.1-1 (3.1.1 MQTT-2.2.2-2): wrong
    reserved flag bits in the fixed header are a Malformed Packet: DISCONNECT 0x81 / close."""
    check_rejected(broker.port, raw, version, RESERVED_FLAGS[case][version], MALFORMED, uid)


@BOTH
def test_reserved_packet_type_0(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT 5.0 §2.1.2 (3.1.1 §2.2.1): control packet type 0 is reserved (forbidden): DISCONNECT 0x81 / close."""
    check_rejected(broker.port, raw, version, b"\x00\x00", MALFORMED, uid)


@BOTH
def test_mqtt_3_3_1_4_publish_with_qos_3(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT-3.3.1-4 (3.1.1 MQTT-3.3.1-4: the receiver closes): a PUBLISH with both QoS bits set: DISCONNECT 0x81 /
    close."""
    check_rejected(broker.port, raw, version, publish(b"t", version, qos=1, flags=0x36), MALFORMED, uid)


@BOTH
def test_mqtt_3_3_1_2_publish_dup_with_qos_0(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT-3.3.1-2: DUP must be 0 for QoS 0: a QoS 0 PUBLISH with DUP 1 is malformed: DISCONNECT 0x81 / close."""
    check_rejected(broker.port, raw, version, publish(b"t", version, flags=0x38), MALFORMED, uid)


# ------------------------------------------------------------------------------------------ PUBLISH content


@BOTH
@pytest.mark.parametrize("topic", [b"a/+/b", b"a/#", b"#"])
def test_mqtt_3_3_2_2_publish_topic_with_wildcard(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                                  topic: bytes) -> None:
    """MQTT-3.3.2-2 / MQTT-4.7.0-1 (3.1.1 MQTT-3.3.2-2 / MQTT-4.7.1-1): wildcards in a PUBLISH Topic Name: 5.0
    DISCONNECT 0x90 (Topic Name invalid), 3.1.1 close."""
    check_rejected(broker.port, raw, version, publish(topic, version), TOPIC_NAME_INVALID, uid)


@BOTH
def test_publish_empty_topic_without_alias(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT 5.0 §3.3.2.1 (an empty Topic Name with no Topic Alias is a Protocol Error, 0x82); 3.1.1 MQTT-4.7.3-1
    (a Topic Name has at least one character): close."""
    check_rejected(broker.port, raw, version, publish(b"", version), PROTOCOL, uid)


def test_mqtt_3_3_4_6_publish_with_subscription_identifier(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.3.4-6: a PUBLISH from a Client must not carry a Subscription Identifier: DISCONNECT 0x82."""
    check_rejected(broker.port, raw, V5, publish(b"t", V5, props=b"\x02\x0b\x05"), PROTOCOL, uid)


@BOTH
@pytest.mark.parametrize(
    "case",
    [
        "publish-qos1", "publish-qos2", "subscribe", "unsubscribe", "puback", "pubrec", "pubrel", "pubcomp",
    ],
)
def test_mqtt_2_2_1_3_packet_identifier_0(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                          case: str) -> None:
    """MQTT-2.2.1-3 / MQTT-2.2.1-5 (3.1.1 MQTT-2.3.1-1): Packet Identifiers are non-zero: a packet carrying
    Packet Identifier 0 is malformed: DISCONNECT 0x81 / close."""
    props = b"\x00" if version == V5 else b""
    data = {
        "publish-qos1": publish(b"t", version, qos=1, packet_id=0),
        "publish-qos2": publish(b"t", version, qos=2, packet_id=0),
        "subscribe": frame(0x82, b"\x00\x00" + props + mqtt_str(b"t") + b"\x00"),
        "unsubscribe": frame(0xA2, b"\x00\x00" + props + mqtt_str(b"t")),
        "puback": b"\x40\x02\x00\x00",
        "pubrec": b"\x50\x02\x00\x00",
        "pubrel": b"\x62\x02\x00\x00",
        "pubcomp": b"\x70\x02\x00\x00",
    }[case]
    check_rejected(broker.port, raw, version, data, MALFORMED, uid)


# ------------------------------------------------------------------------------------- SUBSCRIBE / UNSUBSCRIBE


@BOTH
def test_mqtt_3_8_3_2_subscribe_with_no_topic_filter(broker: BrokerProcess, raw: Any, uid: str,
                                                     version: int) -> None:
    """MQTT-3.8.3-2 (5.0: a SUBSCRIBE with no payload is a Protocol Error, DISCONNECT 0x82); 3.1.1 MQTT-3.8.3-3:
    a protocol violation, close."""
    data = by_version(frame(0x82, b"\x00\x01"), frame(0x82, b"\x00\x01\x00"))[version]
    check_rejected(broker.port, raw, version, data, PROTOCOL, uid)


@BOTH
def test_mqtt_3_10_3_2_unsubscribe_with_no_topic_filter(broker: BrokerProcess, raw: Any, uid: str,
                                                        version: int) -> None:
    """MQTT-3.10.3-2: an UNSUBSCRIBE must hold at least one Topic Filter: 5.0 DISCONNECT 0x82, 3.1.1 close."""
    data = by_version(frame(0xA2, b"\x00\x01"), frame(0xA2, b"\x00\x01\x00"))[version]
    check_rejected(broker.port, raw, version, data, PROTOCOL, uid)


@BOTH
def test_mqtt_3_8_3_5_subscribe_options_reserved_bits(broker: BrokerProcess, raw: Any, uid: str,
                                                      version: int) -> None:
    """MQTT-3.8.3-5 (3.1.1 MQTT-3.8.3-4): non-zero reserved bits in the Subscription Options (5.0: bits 6-7; 3.1.1:
    bits 2-7 of the QoS byte) are malformed: DISCONNECT 0x81 / close."""
    data = by_version(frame(0x82, b"\x00\x01" + mqtt_str(b"t") + b"\x04"),
                      frame(0x82, b"\x00\x01\x00" + mqtt_str(b"t") + b"\x40"))[version]
    check_rejected(broker.port, raw, version, data, MALFORMED, uid)


@BOTH
def test_v311_mqtt_3_8_3_4_subscribe_requested_qos_3(broker: BrokerProcess, raw: Any, uid: str,
                                                     version: int) -> None:
    """3.1.1 MQTT-3.8.3-4 / 5.0 §3.8.3.1: a Requested QoS of 3 is malformed: DISCONNECT 0x81 / close."""
    props = b"\x00" if version == V5 else b""
    check_rejected(broker.port, raw, version, frame(0x82, b"\x00\x01" + props + mqtt_str(b"t") + b"\x03"),
                   MALFORMED, uid)


def test_subscribe_retain_handling_3(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.8.3.1: Retain Handling 3 is a Protocol Error: DISCONNECT 0x82."""
    check_rejected(broker.port, raw, V5, frame(0x82, b"\x00\x01\x00" + mqtt_str(b"t") + b"\x30"), PROTOCOL, uid)


def test_mqtt_3_8_3_4_no_local_on_shared_subscription(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.8.3-4 (5.0): No Local 1 on a Shared Subscription is a Protocol Error: DISCONNECT 0x82."""
    check_rejected(broker.port, raw, V5, frame(0x82, b"\x00\x01\x00" + mqtt_str(b"$share/g/t") + b"\x04"),
                   PROTOCOL, uid)


# ------------------------------------------------------------------------------------------ properties


@pytest.mark.parametrize(
    "data",
    [
        publish(b"t", V5, props=b"\x0a\x02\x00\x00\x00\x05\x02\x00\x00\x00\x06"),  # Message Expiry Interval x2
        publish(b"t", V5, props=b"\x04\x01\x00\x01\x01"),  # Payload Format Indicator x2
        frame(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02" + mqtt_str(b"t") + b"\x00"),  # Subscription Identifier x2
        frame(0xE0, b"\x00\x0a\x11\x00\x00\x00\x00\x11\x00\x00\x00\x00"),  # DISCONNECT Session Expiry x2
    ],
    ids=["publish-message-expiry", "publish-payload-format", "subscribe-subscription-id", "disconnect-expiry"],
)
def test_duplicate_property_is_protocol_error(broker: BrokerProcess, raw: Any, uid: str, data: bytes) -> None:
    """MQTT 5.0 §2.2.2.2: including a property other than User Property (and Subscription Identifier in PUBLISH)
    more than once is a Protocol Error: DISCONNECT 0x82."""
    check_rejected(broker.port, raw, V5, data, PROTOCOL, uid)


@pytest.mark.parametrize(
    "data",
    [
        publish(b"t", V5, props=b"\x05\x11\x00\x00\x00\x3c"),  # Session Expiry Interval in PUBLISH
        frame(0x82, b"\x00\x01\x03\x23\x00\x01" + mqtt_str(b"t") + b"\x00"),  # Topic Alias in SUBSCRIBE
        b"\x40\x07\x00\x01\x00\x03\x23\x00\x01",  # Topic Alias in PUBACK
        frame(0xE0, b"\x00\x03\x21\x00\x05"),  # Receive Maximum in DISCONNECT
        publish(b"t", V5, props=b"\x02\x7f\x00"),  # identifier 0x7F does not exist
    ],
    ids=["publish-session-expiry", "subscribe-topic-alias", "puback-topic-alias", "disconnect-receive-maximum",
         "unknown-identifier"],
)
def test_property_not_allowed_in_packet_is_malformed(broker: BrokerProcess, raw: Any, uid: str,
                                                     data: bytes) -> None:
    """MQTT 5.0 §2.2.2.2 / MQTT-4.13.1-1: a property identifier not valid for the packet type is a Malformed
    Packet: DISCONNECT 0x81."""
    check_rejected(broker.port, raw, V5, data, MALFORMED, uid)


# ------------------------------------------------------------------------------------------ lengths


TRAILING = {
    "pingreq": by_version(b"\xc0\x01\x00", b"\xc0\x01\x00"),
    "puback": by_version(b"\x40\x03\x00\x01\x00", b"\x40\x05\x00\x01\x00\x00\xff"),
    "disconnect": by_version(b"\xe0\x01\x00", b"\xe0\x03\x00\x00\xff"),
    "subscribe-cut": by_version(frame(0x82, b"\x00\x01" + mqtt_str(b"t")),
                                frame(0x82, b"\x00\x01\x00" + mqtt_str(b"t"))),  # no options byte
    "string-past-end": by_version(frame(0x30, b"\x00\x09abc"), frame(0x30, b"\x00\x09abc")),
}


@BOTH
@pytest.mark.parametrize("case", TRAILING)
def test_mqtt_4_13_1_1_lengths_that_do_not_add_up(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                                  case: str) -> None:
    """MQTT-4.13.1-1 (3.1.1 MQTT-4.8.0-1): bytes left over after the last field, or a field running past the
    Remaining Length, make a Malformed Packet: DISCONNECT 0x81 / close."""
    check_rejected(broker.port, raw, version, TRAILING[case][version], MALFORMED, uid)


# ------------------------------------------------------------------------------------------ wrong packets


@BOTH
def test_auth_without_authentication_method(broker: BrokerProcess, raw: Any, uid: str, version: int) -> None:
    """MQTT 5.0 §4.12 / §3.15: AUTH from a client whose CONNECT had no Authentication Method is a Protocol Error
    (DISCONNECT 0x82); in 3.1.1 packet type 15 is reserved (close)."""
    code = PROTOCOL if version == V5 else MALFORMED
    check_rejected(broker.port, raw, version, b"\xf0\x00", code, uid)


SERVER_ONLY = {
    "CONNACK": by_version(b"\x20\x02\x00\x00", b"\x20\x03\x00\x00\x00"),
    "SUBACK": by_version(b"\x90\x03\x00\x01\x00", b"\x90\x04\x00\x01\x00\x00"),
    "UNSUBACK": by_version(b"\xb0\x02\x00\x01", b"\xb0\x04\x00\x01\x00\x00"),
    "PINGRESP": by_version(b"\xd0\x00", b"\xd0\x00"),
}


@BOTH
@pytest.mark.parametrize("case", SERVER_ONLY)
def test_client_sending_server_only_packet(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                           case: str) -> None:
    """MQTT 5.0 §4.13 (0x82 "an unexpected or out of order packet") / 3.1.1 MQTT-4.8.0-1: a client sending a
    packet only a server sends (CONNACK, SUBACK, UNSUBACK, PINGRESP) is disconnected: DISCONNECT 0x82 / close."""
    check_rejected(broker.port, raw, version, SERVER_ONLY[case][version], PROTOCOL, uid)


# ------------------------------------------------------------------------------------------ CONNECT errors


CONNECT_V311 = b"\x00\x04MQTT\x04"
CONNECT_V5 = b"\x00\x04MQTT\x05"

BAD_CONNECTS = {
    "reserved-flag": by_version(frame(0x10, CONNECT_V311 + b"\x03\x00\x3c" + mqtt_str(b"c")),
                                frame(0x10, CONNECT_V5 + b"\x03\x00\x3c\x00" + mqtt_str(b"c"))),  # MQTT-3.1.2-3
    "will-qos-3": by_version(frame(0x10, CONNECT_V311 + b"\x1e\x00\x3c" + mqtt_str(b"c") + mqtt_str(b"w")
                                   + mqtt_str(b"m")),
                             frame(0x10, CONNECT_V5 + b"\x1e\x00\x3c\x00" + mqtt_str(b"c") + b"\x00" + mqtt_str(b"w")
                                   + mqtt_str(b"m"))),
    "client-id-not-utf8": by_version(frame(0x10, CONNECT_V311 + b"\x02\x00\x3c" + mqtt_str(b"\xc3\x28")),
                                     frame(0x10, CONNECT_V5 + b"\x02\x00\x3c\x00" + mqtt_str(b"\xc3\x28"))),
    "trailing-bytes": by_version(frame(0x10, CONNECT_V311 + b"\x02\x00\x3c" + mqtt_str(b"c") + b"\x00"),
                                 frame(0x10, CONNECT_V5 + b"\x02\x00\x3c\x00" + mqtt_str(b"c") + b"\x00")),
    "will-retain-without-will": by_version(frame(0x10, CONNECT_V311 + b"\x22\x00\x3c" + mqtt_str(b"c")),
                                           frame(0x10, CONNECT_V5 + b"\x22\x00\x3c\x00" + mqtt_str(b"c"))),
}


@BOTH
@pytest.mark.parametrize("case", BAD_CONNECTS)
def test_mqtt_3_1_4_1_malformed_connect_closes_without_connack(broker: BrokerProcess, raw: Any, version: int,
                                                               case: str) -> None:
    """MQTT-3.1.4-1 / MQTT-3.1.2-3 (3.1.1 MQTT-3.1.4-1 / MQTT-3.1.2-3): a CONNECT that does not conform (reserved
    flag set, Will QoS 3, ill-formed Client Identifier, trailing bytes, Will Retain without Will Flag) closes the
    connection; the broker sends nothing, not even a CONNACK."""
    bystander = raw(broker.port, V5)
    bystander.connect()
    client = raw(broker.port, version)
    client.send(BAD_CONNECTS[case][version])
    assert closed(client)
    assert bytes(client.raw_received) == b""
    bystander.send(PingReq())
    assert bystander.recv() == PingResp()


def test_invalid_will_topic_connack_0x90(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.1.3.3 / MQTT-3.2.2-7: a Will Topic with a wildcard is refused with CONNACK 0x90 (Topic Name
    invalid), Session Present 0, then close; a 3.1.1 client is closed without CONNACK (3.1.1 has no fitting
    return code, MQTT-3.2.2-6 of 3.1.1)."""
    v5 = raw(broker.port, V5)
    v5.send(Connect(uid, V5, True, 60, will=Will(f"{uid}/+/w", b"x")))
    assert closed(v5)
    (packet,) = v5.recv_all(0.05)
    assert (packet.TYPE, packet.session_present, packet.reason_code) == (2, False, TOPIC_NAME_INVALID)
    v311 = raw(broker.port, V311)
    v311.send(Connect(uid, V311, True, 60, will=Will(f"{uid}/#", b"x")))
    assert closed(v311)
    assert bytes(v311.raw_received) == b""


@pytest.mark.parametrize(("version", "connect", "reply"), [
    (V5, Connect("x", V5, True, 60, properties={P.AUTHENTICATION_METHOD: "SCRAM-SHA-1"}), 0x8C),
    (V311, Connect("", V311, False, 60), 0x02),
], ids=["v5-bad-auth-method", "v311-identifier-rejected"])
def test_mqtt_3_1_4_6_no_processing_after_rejected_connect(broker: BrokerProcess, raw: Any, uid: str,
                                                           version: int, connect: Connect, reply: int) -> None:
    """MQTT-3.1.4-6 (3.1.1 MQTT-3.1.4-5): after rejecting a CONNECT the broker processes nothing more from that
    connection: a PUBLISH sent right behind the refused CONNECT (same write) never reaches a subscriber."""
    watcher = raw(broker.port, V311)
    watcher.connect(f"{uid}-watch")
    watcher.send(Subscribe(1, [Subscription(f"{uid}/t", 0)]))
    watcher.recv()
    client = raw(broker.port, version)
    client.send(connect.encode(version) + Publish(f"{uid}/t", b"ignored").encode(version))
    assert closed(client)
    (packet,) = client.recv_all(0.05)
    assert (packet.TYPE, packet.reason_code) == (2, reply)
    publisher = raw(broker.port, V311)
    publisher.connect(f"{uid}-pub")
    publisher.send(Publish(f"{uid}/t", b"marker"))
    packet = watcher.recv()
    assert isinstance(packet, Publish) and packet.payload == b"marker", packet


def test_protocol_error_publishes_the_will(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.1.2.5 (MQTT-3.1.2-8): a connection the server closes because of a Malformed Packet did not end
    with DISCONNECT 0x00, so its Will is published."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    watcher.send(Subscribe(1, [Subscription(f"{uid}/will", 1)]))
    watcher.recv()
    client = raw(broker.port, V5)
    client.connect(uid, will=Will(f"{uid}/will", b"malformed", 1))
    client.send(b"\x00\x00")
    assert closed(client)
    packet = watcher.recv()
    assert isinstance(packet, Publish), packet
    assert (packet.topic, packet.payload, packet.qos) == (f"{uid}/will", b"malformed", 1)


# ------------------------------------------------------------------------------------------ random garbage


def _valid_packets(rng: random.Random, version: int) -> list[bytes]:
    """A few well-formed packets to mutate."""
    topic = f"fuzz/{rng.randrange(1000)}"
    pid = rng.randrange(1, 65536)
    return [
        Publish(topic, rng.randbytes(rng.randrange(0, 40)), qos=rng.randrange(3), packet_id=pid).encode(version),
        Subscribe(pid, [Subscription("fuzz/#", rng.randrange(3))]).encode(version),
        Unsubscribe(pid, ["fuzz/#"]).encode(version),
        b"\xc0\x00",
        bytes((0x40 | rng.choice((0x00, 0x10, 0x20, 0x30)), 2)) + pid.to_bytes(2, "big"),
    ]


def _garbage(rng: random.Random) -> list[bytes]:
    """One connection's worth of hostile input, as the chunks to write."""
    kind = rng.randrange(5)
    version = rng.choice((V311, V5))
    connect = Connect(f"fuzz-{rng.randrange(10**9)}", version, True, 0,
                      will=Will("fuzz/will", b"w") if rng.random() < 0.3 else None).encode(version)
    if kind == 0:  # pure noise, no CONNECT
        return [rng.randbytes(rng.randrange(1, 300))]
    if kind == 1:  # a CONNECT, then noise
        return [connect, rng.randbytes(rng.randrange(1, 300))]
    if kind == 2:  # a CONNECT, then packets with a correct length and a random body, mostly with valid flags
        out = [connect]
        for _ in range(rng.randrange(1, 6)):
            ptype = rng.randrange(1, 16)
            flags = rng.randrange(6) if ptype == 3 else 2 if ptype in (6, 8, 10) else 0
            first = (ptype << 4) | flags if rng.random() < 0.8 else rng.randrange(256)
            out.append(frame(first, rng.randbytes(rng.randrange(0, 60))))
        return out
    # a CONNECT (maybe mutated), then valid packets with a few bytes flipped
    data = bytearray(connect + b"".join(_valid_packets(rng, version)))
    start = 0 if kind == 3 else len(connect)
    for _ in range(rng.randrange(1, 4)):
        data[rng.randrange(start, len(data))] = rng.randrange(256)
    if kind == 4:  # and trickle it in small pieces (incremental framing)
        pieces, pos = [], 0
        while pos < len(data):
            step = rng.randrange(1, 8)
            pieces.append(bytes(data[pos:pos + step]))
            pos += step
        return pieces
    return [bytes(data)]


def test_random_garbage_never_crashes_the_broker(broker: BrokerProcess, uid: str) -> None:
    """MQTT-4.13.1-1 / 3.1.1 MQTT-4.8.0-1, robustness: 300 connections (seeded, reproducible) send noise, random
    packets and bit-flipped valid packets, with and without a CONNECT first, whole or trickled. Each costs at most
    its own connection: the broker process stays up, logs no internal error, and afterwards real paho clients
    (5.0 and 3.1.1) connect and round-trip a QoS 1 message."""
    rng = random.Random(0x6A7E)
    for _batch in range(6):
        socks: list[socket.socket] = []
        try:
            for _ in range(50):
                sock = socket.create_connection(("127.0.0.1", broker.port), timeout=5)
                socks.append(sock)
                for chunk in _garbage(rng):
                    try:
                        sock.sendall(chunk)
                    except OSError:  # the broker already closed it
                        break
            for sock in socks:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            _drain_until_closed(socks, timeout=10)
        finally:
            for sock in socks:
                sock.close()
    assert broker.proc is not None and broker.proc.poll() is None
    log = broker.log()
    assert "Traceback" not in log and "internal error" not in log and "tick failed" not in log, log[-5000:]
    for protocol in (mqtt.MQTTv5, mqtt.MQTTv311):
        _paho_round_trip(broker.port, f"{uid}-{protocol}", protocol)


def _drain_until_closed(socks: list[socket.socket], timeout: float) -> None:
    """Read every socket until the broker closes it (it must: each sent EOF or garbage)."""
    sel = selectors.DefaultSelector()
    try:
        for sock in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        open_count = len(socks)
        deadline = time.monotonic() + timeout
        while open_count and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(sock)
                    open_count -= 1
        assert open_count == 0, f"{open_count} garbage connections were never closed by the broker"
    finally:
        sel.close()


def _paho_round_trip(port: int, client_id: str, protocol: int) -> None:
    """Connect a paho client, subscribe, publish QoS 1 to itself, receive it, disconnect."""
    received: queue.Queue[Any] = queue.Queue()
    events: dict[str, queue.Queue[Any]] = {name: queue.Queue() for name in ("connect", "subscribe", "disconnect")}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                         reconnect_on_failure=False)
    client.on_connect = lambda _c, _u, _f, rc, _p: events["connect"].put(rc.value)
    client.on_subscribe = lambda _c, _u, _m, codes, _p: events["subscribe"].put([c.value for c in codes])
    client.on_disconnect = lambda _c, _u, _f, rc, _p: events["disconnect"].put(rc.value)
    client.on_message = lambda _c, _u, msg: received.put(msg)
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        assert events["connect"].get(timeout=5) == 0
        client.subscribe(f"{client_id}/t", 1)
        assert events["subscribe"].get(timeout=5) == [1]
        info = client.publish(f"{client_id}/t", b"after the storm", 1)
        info.wait_for_publish(5)
        msg = received.get(timeout=5)
        assert (msg.topic, msg.payload, msg.qos) == (f"{client_id}/t", b"after the storm", 1)
    finally:
        client.disconnect()
        events["disconnect"].get(timeout=5)
        client.loop_stop()
