"""Server-side normative statements of MQTT 5.0 and 3.1.1 that no other test file checks, against the real broker
process over real sockets (docs/conformance.md points here for them).

Each test is named after the statement it checks (MQTT 5.0 ids unless the name says ``v311``; the same id can mean
different things in the two specs) and quotes it in its docstring. The raw client is used where exact bytes,
unusual flags or malformed input are needed.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import BrokerProcess, RawClient

from gateway.mqtt.packets import (
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
)
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC

V31, V311, V5 = 3, 4, 5
BOTH = pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
_short_ids = itertools.count()

# The ``limited`` broker: no retained messages, Client Identifiers of at most 23 characters.
LIMITED_CONFIG = """
[broker]
sys_interval = 0
retain_available = false
[listeners.external]
bind = "127.0.0.1:0"
max_clientid_len = 23
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker with ``retain_available = false`` and ``max_clientid_len = 23``, for the refusal tests."""
    proc = BrokerProcess(LIMITED_CONFIG, workdir=str(tmp_path_factory.mktemp("limited"))).start()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


@pytest.fixture
def raw() -> Iterator[Callable[..., RawClient]]:
    """``raw(port, version)``: a RawClient (not yet connected) that is closed at teardown."""
    opened: list[RawClient] = []

    def make(port: int, version: int = V5) -> RawClient:
        client = RawClient(port, version=version)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


Raw = Callable[..., RawClient]


# ------------------------------------------------------------------------------------------------ helpers


def short_id() -> str:
    """A unique Client Identifier of at most 23 characters (for the ``limited`` broker)."""
    return f"c{os.getpid() % 100000}x{next(_short_ids)}"


def connected(raw: Raw, port: int, client_id: str, version: int = V5, clean: bool = True,
              **props: Any) -> RawClient:
    """A RawClient connected as ``client_id`` (``props``: 5.0 CONNECT properties by PropertyId name)."""
    client = raw(port, version)
    properties = {getattr(P, k): v for k, v in props.items()} if version == V5 else {}
    ack = client.connect(client_id, clean_start=clean, properties=properties)
    assert ack.reason_code == 0, ack
    return client


def closed(client: RawClient, timeout: float = 3.0) -> bool:
    """True when the server closes ``client``'s connection within ``timeout``; packets that arrive before the close
    stay readable with ``client.recv()``."""
    return client.closed_by_server(timeout)


def subscribe(client: RawClient, *subs: Subscription, packet_id: int = 1, codes: list[int] | None = None) -> None:
    """SUBSCRIBE and check the SUBACK: its Packet Identifier and ``codes`` (default: each requested QoS)."""
    client.send(Subscribe(packet_id, list(subs)))
    ack = client.recv()
    assert isinstance(ack, Suback), ack
    assert ack.packet_id == packet_id
    assert ack.reason_codes == (codes if codes is not None else [s.qos for s in subs]), ack


def next_publish(client: RawClient, timeout: float = 5.0) -> Publish:
    packet = client.recv(timeout)
    assert isinstance(packet, Publish), packet
    return packet


def publish_qos1(client: RawClient, topic: str, payload: bytes, packet_id: int, **props: Any) -> int:
    """A QoS 1 PUBLISH; returns the PUBACK Reason Code (after checking its Packet Identifier)."""
    client.send(Publish(topic, payload, 1, packet_id=packet_id,
                        properties={getattr(P, k): v for k, v in props.items()}))
    ack = client.recv()
    assert isinstance(ack, PubAck) and ack.packet_id == packet_id, ack
    return ack.reason_code


def publish_qos2(client: RawClient, topic: str, payload: bytes, packet_id: int, **props: Any) -> None:
    """A complete QoS 2 flow from the client: PUBLISH, PUBREC 0x00, PUBREL, PUBCOMP 0x00."""
    client.send(Publish(topic, payload, 2, packet_id=packet_id,
                        properties={getattr(P, k): v for k, v in props.items()}))
    assert client.recv() == PubRec(packet_id)
    client.send(PubRel(packet_id))
    assert client.recv() == PubComp(packet_id)


def barrier(client: RawClient) -> list[Packet]:
    """Every packet the broker sends ``client`` before it answers a PINGREQ sent now (the broker handles one
    connection's packets in order), plus any that follow within 0.15 s (sends that wait for a store commit)."""
    client.send(PingReq())
    packets: list[Packet] = []
    while True:
        packet = client.recv()
        if isinstance(packet, PingResp):
            break
        packets.append(packet)
    return packets + client.recv_all(0.15)


def marker(raw: Raw, port: int, topic: str, version: int = V311) -> None:
    """Publish a QoS 1 marker from a fresh connection and wait for its PUBACK: whatever the broker sent to a
    subscriber before, it sent before the marker."""
    client = connected(raw, port, f"m-{short_id()}", version)
    assert publish_qos1(client, topic, b"marker", 1) in (0, RC.NO_MATCHING_SUBSCRIBERS)
    client.send(Disconnect())
    assert closed(client)


def expect_marker_next(client: RawClient, raw: Raw, port: int, topic: str) -> None:
    """The marker published now is the very next packet ``client`` gets: nothing else was sent to it before."""
    marker(raw, port, topic)
    packet = next_publish(client)
    assert (packet.topic, packet.payload) == (topic, b"marker"), packet
    if packet.qos == 1:
        client.send(PubAck(packet.packet_id))  # type: ignore[arg-type]


def rejected_with(client: RawClient, data: bytes, version: int, code: int) -> None:
    """Send ``data`` on a connected client: 5.0 gets exactly one DISCONNECT ``code`` and the close; 3.1.1 just
    the close."""
    already = len(client.raw_received)
    client.send(data)
    assert closed(client)
    after = client.recv_all(0.05)
    if version == V5:
        assert len(after) == 1 and isinstance(after[0], Disconnect), after
        assert after[0].reason_code == code, hex(after[0].reason_code)
    else:
        assert after == [] and len(client.raw_received) == already


def end_session(client: RawClient, version: int) -> None:
    """Close ``client`` normally and make its session end with it (5.0: Session Expiry Interval 0)."""
    client.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}) if version == V5 else Disconnect())
    assert closed(client)


def mqtt_str(data: bytes) -> bytes:
    """A length-prefixed string field holding exactly ``data`` (possibly invalid UTF-8 on purpose)."""
    return len(data).to_bytes(2, "big") + data


def raw_publish(topic: bytes, props: bytes) -> bytes:
    """A 5.0 QoS 0 PUBLISH with raw Topic Name bytes and a raw property block (Property Length excluded)."""
    body = mqtt_str(topic) + bytes((len(props),)) + props + b"payload"
    assert len(body) < 128
    return bytes((0x30, len(body))) + body


# ------------------------------------------------------------------------------------------ data representation


@BOTH
def test_mqtt_1_5_4_3_bom_kept_in_topic_names(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-1.5.4-3 (3.1.1 MQTT-1.5.3-3): "A UTF-8 encoded sequence 0xEF 0xBB 0xBF is always interpreted as
    U+FEFF ("ZERO WIDTH NO-BREAK SPACE") wherever it appears in a string and MUST NOT be skipped over or stripped
    off by a packet receiver". A Topic Name ending in U+FEFF only matches the filter with U+FEFF and reaches the
    subscriber with those three bytes; the same name without it only matches the filter without it."""
    plain, bom = f"{uid}/a", f"{uid}/a\ufeff"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(plain, 1), Subscription(bom, 1))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    assert publish_qos1(pub, bom, b"with", 1) == 0
    assert publish_qos1(pub, plain, b"without", 2) == 0
    got = [next_publish(sub), next_publish(sub)]
    assert [(p.topic, p.payload) for p in got] == [(bom, b"with"), (plain, b"without")]
    assert f"{uid}/a".encode() + b"\xef\xbb\xbf" in bytes(sub.raw_received)
    for p in got:
        sub.send(PubAck(p.packet_id))  # type: ignore[arg-type]
    assert barrier(sub) == []  # one copy each: neither name matched the other filter


@pytest.mark.parametrize("pair", [(b"k\x00", b"v"), (b"k", b"\xc3\x28"), (b"\xed\xa0\x80", b"v")],
                         ids=["null-in-key", "bad-utf8-value", "surrogate-key"])
def test_mqtt_1_5_7_1_user_property_strings_are_checked(broker: BrokerProcess, raw: Raw, uid: str,
                                                        pair: tuple[bytes, bytes]) -> None:
    """MQTT-1.5.7-1: "Both strings [of a UTF-8 String Pair] MUST comply with the requirements for UTF-8 Encoded
    Strings": a User Property whose name or value is not a valid UTF-8 Encoded String makes the PUBLISH a Malformed
    Packet: DISCONNECT 0x81 and close (MQTT-4.13.1-1)."""
    client = connected(raw, broker.port, uid)
    key, value = pair
    rejected_with(client, raw_publish(f"{uid}/t".encode(), b"\x26" + mqtt_str(key) + mqtt_str(value)), V5,
                  RC.MALFORMED_PACKET)


# ------------------------------------------------------------------------------------------ PUBLISH on the wire


@BOTH
def test_mqtt_2_2_1_2_qos0_delivery_exact_bytes(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-2.2.1-2 (3.1.1 MQTT-2.3.1-5): "A PUBLISH packet MUST NOT contain a Packet Identifier if its QoS value
    is set to 0"; MQTT-3.3.1-2 / MQTT-4.3.1-1: DUP 0 for QoS 0; MQTT-2.2.2-1: "If there are no properties, this MUST
    be indicated by including a Property Length of zero". A QoS 1 message published with DUP 1 and delivered to a
    QoS 0 subscription arrives as exactly 30 <len> <topic> [00] <payload>."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(topic, 0))
    before = len(sub.raw_received)
    pub = connected(raw, broker.port, f"{uid}-p", version)
    pub.send(Publish(topic, b"zero", 1, dup=True, packet_id=9))
    assert pub.recv() == PubAck(9)
    assert next_publish(sub) == Publish(topic, b"zero", 0)
    body = mqtt_str(topic.encode()) + (b"\x00" if version == V5 else b"") + b"zero"
    assert bytes(sub.raw_received[before:]) == bytes((0x30, len(body))) + body


@BOTH
def test_mqtt_3_3_1_3_incoming_dup_not_propagated(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-3.3.1-3 (5.0: "The DUP flag in the outgoing PUBLISH packet is set independently to the incoming PUBLISH
    packet, its value MUST be determined solely by whether the outgoing PUBLISH packet is a retransmission"; 3.1.1:
    "The value of the DUP flag from an incoming PUBLISH packet is not propagated"): QoS 1 and QoS 2 PUBLISHes that
    arrive with DUP 1 (first attempts as far as the broker knows) go out to the subscriber with DUP 0."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    pub.send(Publish(topic, b"one", 1, dup=True, packet_id=1))
    assert pub.recv() == PubAck(1)
    pub.send(Publish(topic, b"two", 2, dup=True, packet_id=2))
    assert pub.recv() == PubRec(2)
    pub.send(PubRel(2))
    assert pub.recv() == PubComp(2)
    one, two = next_publish(sub), next_publish(sub)
    assert [(p.payload, p.qos, p.dup) for p in (one, two)] == [(b"one", 1, False), (b"two", 2, False)]
    sub.send(PubAck(one.packet_id))  # type: ignore[arg-type]
    sub.send(PubRec(two.packet_id))  # type: ignore[arg-type]
    assert sub.recv() == PubRel(two.packet_id)  # type: ignore[arg-type]
    sub.send(PubComp(two.packet_id))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ CONNECT / CONNACK


def test_mqtt_3_1_2_25_discarded_publish_completes_its_flow(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-3.1.2-25: "Where a Packet is too large to send, the Server MUST discard it without sending it and then
    behave as if it had completed sending that Application Message". With Receive Maximum 1 and Maximum Packet Size
    100, a discarded QoS 1 message does not occupy the Inflight Window (the next message goes out without any
    PUBACK) and is not re-sent when the session resumes; only the unacknowledged small one is (MQTT-4.4.0-1)."""
    topic = f"{uid}/t"
    props = {"MAXIMUM_PACKET_SIZE": 100, "RECEIVE_MAXIMUM": 1, "SESSION_EXPIRY_INTERVAL": 60}
    sub = connected(raw, broker.port, f"{uid}-s", **props)
    subscribe(sub, Subscription(topic, 1))
    pub = connected(raw, broker.port, f"{uid}-p")
    assert publish_qos1(pub, topic, b"B" * 200, 1) == 0
    assert publish_qos1(pub, topic, b"small", 2) == 0
    small = next_publish(sub)
    assert (small.payload, small.qos, small.dup) == (b"small", 1, False)
    sub.close()  # no PUBACK, no DISCONNECT
    again = connected(raw, broker.port, f"{uid}-s", clean=False, **props)
    resent = barrier(again)
    assert len(resent) == 1, resent
    assert isinstance(resent[0], Publish)
    assert (resent[0].payload, resent[0].dup, resent[0].packet_id) == (b"small", True, small.packet_id)
    again.send(PubAck(small.packet_id))  # type: ignore[arg-type]
    assert barrier(again) == []
    end_session(again, V5)


@pytest.mark.parametrize("request_response_information", [0, 1])
def test_mqtt_3_1_2_28_no_response_information(broker: BrokerProcess, raw: Raw, uid: str,
                                               request_response_information: int) -> None:
    """MQTT-3.1.2-28: "A value of 0 [Request Response Information] indicates that the Server MUST NOT return
    Response Information" (the broker never returns any, so also not for 1); MQTT-4.12.0-6: "If the Client does not
    include an Authentication Method in the CONNECT, the Server MUST NOT send an AUTH packet, and it MUST NOT send
    an Authentication Method in the CONNACK packet". The CONNACK carries exactly the broker's limits."""
    client = raw(broker.port, V5)
    ack = client.connect(uid, properties={P.REQUEST_RESPONSE_INFORMATION: request_response_information})
    assert (ack.session_present, ack.reason_code) == (False, 0)
    assert ack.properties == {P.RECEIVE_MAXIMUM: 100, P.MAXIMUM_PACKET_SIZE: 1024 * 1024,
                              P.TOPIC_ALIAS_MAXIMUM: 10}
    assert barrier(client) == []  # and no AUTH follows
    end_session(client, V5)


def test_mqtt_3_1_2_29_request_problem_information_0(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-3.1.2-29: "If the value of Request Problem Information is 0, the Server MAY return a Reason String or
    User Properties on a CONNACK or DISCONNECT packet, but MUST NOT send a Reason String or User Properties on any
    packet other than PUBLISH, CONNACK, or DISCONNECT". Refusals in PUBACK (0x87, 0x99), PUBREC (0x87), SUBACK
    (0x8F), UNSUBACK (0x11), PUBCOMP (0x92) and PUBREL (0x92) carry no properties."""
    client = connected(raw, broker.port, uid, REQUEST_PROBLEM_INFORMATION=0)
    client.send(Publish(f"$SYS/{uid}", b"x", 1, packet_id=1))
    client.send(Publish(f"{uid}/t", b"\xff", 1, packet_id=2, properties={P.PAYLOAD_FORMAT_INDICATOR: 1}))
    client.send(Publish(f"$SYS/{uid}", b"x", 2, packet_id=3))
    client.send(Subscribe(4, [Subscription(f"{uid}/a/#/b", 0)]))
    client.send(Unsubscribe(5, [f"{uid}/never"]))
    client.send(PubRel(6))
    client.send(PubRec(7))
    got = barrier(client)
    assert got == [PubAck(1, RC.NOT_AUTHORIZED), PubAck(2, RC.PAYLOAD_FORMAT_INVALID), PubRec(3, RC.NOT_AUTHORIZED),
                   Suback(4, [RC.TOPIC_FILTER_INVALID]), Unsuback(5, [RC.NO_SUBSCRIPTION_EXISTED]),
                   PubComp(6, RC.PACKET_IDENTIFIER_NOT_FOUND), PubRel(7, RC.PACKET_IDENTIFIER_NOT_FOUND)]
    assert all(p.properties == {} for p in got)  # type: ignore[attr-defined]


@BOTH
def test_mqtt_3_1_3_8_client_id_rejected(limited: BrokerProcess, raw: Raw, version: int) -> None:
    """MQTT-3.1.3-8: "If the Server rejects the ClientID it MAY respond to the CONNECT packet with a CONNACK using
    Reason Code 0x85 (Client Identifier not valid) ... and then it MUST close the Network Connection" (3.1.1
    MQTT-3.1.3-9: "it MUST respond to the CONNECT Packet with a CONNACK return code 0x02 (Identifier rejected) and
    then close the Network Connection"). With max_clientid_len = 23 a 24-character ClientID is rejected; a
    23-character one is accepted (MQTT-3.1.3-5)."""
    client = raw(limited.port, version)
    client.send(Connect("a" * 24, version, True, 60))
    assert closed(client)
    expected = b"\x20\x02\x00\x02" if version == V311 else None
    if expected is not None:
        assert bytes(client.raw_received) == expected
    else:
        (packet,) = client.recv_all(0.05)
        assert isinstance(packet, Connack), packet
        assert (packet.session_present, packet.reason_code) == (False, RC.CLIENT_IDENTIFIER_NOT_VALID)
    ok = raw(limited.port, version)
    assert ok.connect(("b" * 22 + str(version))[:23]).reason_code == 0
    ok.send(Disconnect())
    assert closed(ok)


def test_mqtt_3_2_2_13_will_retain_refused_without_retain_support(limited: BrokerProcess, raw: Raw) -> None:
    """MQTT-3.2.2-13: "If a Server receives a CONNECT packet containing a Will Message with the Will Retain set to 1,
    and it does not support retained messages, the Server MUST reject the connection request. It SHOULD send
    CONNACK with Reason Code 0x9A (Retain not supported) and then it MUST close the Network Connection". With
    retain_available = false the CONNACK announces Retain Available 0; a Will with Will Retain 1 gets CONNACK 0x9A
    and the close, one with Will Retain 0 is accepted (and a PUBLISH with RETAIN 1 gets DISCONNECT 0x9A, MQTT 5.0
    §3.3.1.3)."""
    ok = raw(limited.port, V5)
    ack = ok.connect(short_id(), will=Will("w/plain", b"x", 1, False))
    assert ack.reason_code == 0
    assert ack.properties[P.RETAIN_AVAILABLE] == 0
    rejected_with(ok, Publish("r/t", b"x", 1, retain=True, packet_id=1).encode(V5), V5, RC.RETAIN_NOT_SUPPORTED)
    refused = raw(limited.port, V5)
    refused.send(Connect(short_id(), V5, True, 60, will=Will("w/retained", b"x", 1, True)))
    assert closed(refused)
    (packet,) = refused.recv_all(0.05)
    assert isinstance(packet, Connack), packet
    assert (packet.session_present, packet.reason_code) == (False, RC.RETAIN_NOT_SUPPORTED)


@BOTH
def test_mqtt_3_2_2_6_refused_connect_has_session_present_0(broker: BrokerProcess, raw: Raw, uid: str,
                                                            version: int) -> None:
    """MQTT-3.2.2-6 (3.1.1 MQTT-3.2.2-4): "If a Server sends a CONNACK packet containing a non-zero Reason Code it
    MUST set Session Present to 0" - also when a session exists for that ClientID and Clean Start is 0. 5.0: a
    CONNECT with an Authentication Method gets exactly 20 03 00 8C 00 (Maximum Packet Size 16 leaves no room for a
    Reason String); 3.1.1: Protocol Level 6 gets exactly 20 02 00 01. The session was there: the next normal CONNECT
    resumes it."""
    client = connected(raw, broker.port, uid, version, clean=version == V5, SESSION_EXPIRY_INTERVAL=60)
    client.send(Disconnect())
    assert closed(client)
    refused = raw(broker.port, version)
    if version == V5:
        refused.send(Connect(uid, V5, False, 60, properties={P.AUTHENTICATION_METHOD: "SCRAM-SHA-1",
                                                             P.MAXIMUM_PACKET_SIZE: 16}))
        expected = b"\x20\x03\x00\x8c\x00"
    else:
        refused.send(b"\x10" + bytes((10 + 2 + len(uid),)) + b"\x00\x04MQTT\x06\x00\x00\x3c" + mqtt_str(uid.encode()))
        expected = b"\x20\x02\x00\x01"
    assert closed(refused)
    assert bytes(refused.raw_received) == expected
    again = raw(broker.port, version)
    ack = again.connect(uid, clean_start=False)
    assert (ack.session_present, ack.reason_code) == (True, 0)
    end_session(again, version)
    if version == V311:  # Clean Session 1 discards the session left by Clean Session 0
        connected(raw, broker.port, uid, V311).send(Disconnect())


@BOTH
def test_mqtt_3_2_0_1_connack_first_and_only_once(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-3.2.0-1 (5.0: "The Server MUST send a CONNACK with a 0x00 (Success) Reason Code before sending any
    Packet other than AUTH"; 3.1.1: "The first packet sent from the Server to the Client MUST be a CONNACK Packet"),
    MQTT-3.2.0-2: "The Server MUST NOT send more than one CONNACK in a Network Connection", and MQTT-3.2.2-1
    (reserved Connect Acknowledge Flags bits 0). A resuming client sends CONNECT, PINGREQ and SUBSCRIBE in one write
    while two messages wait in its session: the first bytes are the CONNACK, flags exactly 0x01 (Session Present),
    then the rest, and no second CONNACK."""
    topic = f"{uid}/t"
    client = connected(raw, broker.port, uid, version, SESSION_EXPIRY_INTERVAL=60)
    if version == V311:
        client.close()
        client = connected(raw, broker.port, uid, V311, clean=False)
    subscribe(client, Subscription(topic, 1))
    client.send(Disconnect())
    assert closed(client)
    pub = connected(raw, broker.port, f"{uid}-p", version)
    assert publish_qos1(pub, topic, b"q1", 1) == 0
    assert publish_qos1(pub, topic, b"q2", 2) == 0
    again = raw(broker.port, version)
    props = {P.SESSION_EXPIRY_INTERVAL: 60} if version == V5 else {}
    again.send(Connect(uid, version, False, 60, properties=props).encode(version) + PingReq().encode(version)
               + Subscribe(3, [Subscription(f"{uid}/other", 0)]).encode(version))
    got: list[Packet] = []
    deadline = time.monotonic() + 5
    while len(got) < 5 and time.monotonic() < deadline:
        got.append(again.recv())
    got += again.recv_all(0.2)
    assert isinstance(got[0], Connack) and got[0].session_present is True and got[0].reason_code == 0, got
    data = bytes(again.raw_received)
    assert data[0] == 0x20 and data[2:4] == b"\x01\x00"
    assert sum(isinstance(p, Connack) for p in got) == 1
    publishes = [p for p in got if isinstance(p, Publish)]
    assert [p.payload for p in publishes] == [b"q1", b"q2"]
    assert PingResp() in got and Suback(3, [0]) in got and len(got) == 5
    for p in publishes:
        again.send(PubAck(p.packet_id))  # type: ignore[arg-type]
    end_session(again, version)
    if version == V311:
        connected(raw, broker.port, uid, V311).send(Disconnect())


# ------------------------------------------------------------------------------------------ PUBLISH properties


def test_mqtt_3_3_2_8_topic_alias_0_is_refused(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-3.3.2-8: "A sender MUST NOT send a PUBLISH packet containing a Topic Alias which has the value 0". As
    receiver the broker treats it as a Protocol Error: DISCONNECT 0x82 and close. (As sender it numbers aliases
    from 1: test_broker_connect.py::test_mqtt_3_1_2_26_outbound_topic_aliases_within_client_maximum.)"""
    client = connected(raw, broker.port, uid)
    rejected_with(client, raw_publish(f"{uid}/t".encode(), b"\x23\x00\x00"), V5, RC.PROTOCOL_ERROR)


@pytest.mark.parametrize("prop", [0x08, 0x03], ids=["response-topic", "content-type"])
@pytest.mark.parametrize("value", [b"r\xc3\x28", b"r\x00", b"\xed\xa0\x80"], ids=["bad-utf8", "null", "surrogate"])
def test_mqtt_3_3_2_13_and_3_3_2_19_response_topic_and_content_type_are_utf8(broker: BrokerProcess, raw: Raw,
                                                                             uid: str, prop: int,
                                                                             value: bytes) -> None:
    """MQTT-3.3.2-13: "The Response Topic MUST be a UTF-8 Encoded String"; MQTT-3.3.2-19: "The Content Type MUST be
    a UTF-8 Encoded String". A PUBLISH whose Response Topic or Content Type is not one is a Malformed Packet:
    DISCONNECT 0x81 and close."""
    client = connected(raw, broker.port, uid)
    rejected_with(client, raw_publish(f"{uid}/t".encode(), bytes((prop,)) + mqtt_str(value)), V5,
                  RC.MALFORMED_PACKET)


@pytest.mark.parametrize("response_topic", ["r/+/x", "r/#", "+"])
def test_mqtt_3_3_2_14_response_topic_with_wildcard_is_refused(broker: BrokerProcess, raw: Raw, uid: str,
                                                               response_topic: str) -> None:
    """MQTT-3.3.2-14: "The Response Topic MUST NOT contain wildcard characters". A PUBLISH with one is a Protocol
    Error: DISCONNECT 0x82, close, and the message is not delivered."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s")
    subscribe(sub, Subscription(topic, 1))
    client = connected(raw, broker.port, uid)
    data = Publish(topic, b"x", 1, packet_id=1, properties={P.RESPONSE_TOPIC: response_topic}).encode(V5)
    rejected_with(client, data, V5, RC.PROTOCOL_ERROR)
    expect_marker_next(sub, raw, broker.port, topic)


# ------------------------------------------------------------------------------------------ flow control


def test_mqtt_3_3_4_10_other_packets_flow_when_receive_maximum_reached(broker: BrokerProcess, raw: Raw,
                                                                       uid: str) -> None:
    """MQTT-3.3.4-10: "The Server MUST NOT delay the sending of any packets other than PUBLISH packets due to having
    sent Receive Maximum PUBLISH packets without receiving acknowledgements for them"; MQTT-4.9.0-2: with a send
    quota of zero no more QoS > 0 PUBLISH is sent; MQTT-4.9.0-3: other packets are still processed. A client with
    Receive Maximum 1 holding one unacknowledged message gets PINGRESP, SUBACK, UNSUBACK, PUBACK and the QoS 2
    acknowledgements at once, and the next queued message only after its PUBACK."""
    topic = f"{uid}/t"
    client = connected(raw, broker.port, uid, RECEIVE_MAXIMUM=1)
    subscribe(client, Subscription(topic, 1))
    pub = connected(raw, broker.port, f"{uid}-p")
    for n in (1, 2, 3):
        assert publish_qos1(pub, topic, b"m%d" % n, n) == 0
    first = next_publish(client)
    assert first.payload == b"m1"
    client.send(PingReq())
    assert client.recv() == PingResp()
    client.send(Subscribe(2, [Subscription(f"{uid}/other", 1)]))
    assert client.recv() == Suback(2, [1])
    client.send(Unsubscribe(3, [f"{uid}/other"]))
    assert client.recv() == Unsuback(3, [0])
    assert publish_qos1(client, f"{uid}/elsewhere", b"x", 4) == RC.NO_MATCHING_SUBSCRIBERS
    client.send(Publish(f"{uid}/elsewhere", b"y", 2, packet_id=5))
    assert client.recv() == PubRec(5)  # a QoS 2 message is routed only on PUBREL, so no 0x10 here
    client.send(PubRel(5))
    assert client.recv() == PubComp(5)
    assert barrier(client) == []  # still no second PUBLISH: the send quota is zero
    client.send(PubAck(first.packet_id))  # type: ignore[arg-type]
    second = next_publish(client)
    assert second.payload == b"m2"
    client.send(PubAck(second.packet_id))  # type: ignore[arg-type]
    assert next_publish(client).payload == b"m3"


@BOTH
def test_mqtt_3_6_2_1_pubrel_for_unknown_pubrec(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-3.6.2-1: "The Client or Server sending the PUBREL packet MUST use one of the PUBREL Reason Codes": a
    PUBREC for a Packet Identifier the broker has not sent is answered with PUBREL 0x92 (Packet Identifier not
    found); 3.1.1 PUBREL has no Reason Code. The connection stays usable."""
    client = connected(raw, broker.port, uid, version)
    client.send(PubRec(321))
    assert client.recv() == PubRel(321, RC.PACKET_IDENTIFIER_NOT_FOUND if version == V5 else 0)
    expected = b"\x62\x03\x01\x41\x92" if version == V5 else b"\x62\x02\x01\x41"
    assert bytes(client.raw_received).endswith(expected)
    client.send(PingReq())
    assert client.recv() == PingResp()


# ------------------------------------------------------------------------------------------ UNSUBSCRIBE


@BOTH
def test_mqtt_3_10_4_1_unsubscribe_compares_filters_character_by_character(broker: BrokerProcess, raw: Raw,
                                                                           uid: str, version: int) -> None:
    """MQTT-3.10.4-1: "The Topic Filters (whether they contain wildcards or not) supplied in an UNSUBSCRIBE packet
    MUST be compared character-by-character with the current set of Topic Filters held by the Server for the
    Client. If any filter matches exactly then its owning Subscription MUST be deleted"; MQTT-3.10.4-5 and
    MQTT-3.10.4-6 (3.1.1: one UNSUBACK with the Packet Identifier for a multi-filter UNSUBSCRIBE, also when nothing
    was deleted). Unsubscribing ``a/#``, ``a/b`` and ``+/+`` leaves ``a/+`` in place; unsubscribing ``a/+`` ends it."""
    topic = f"{uid}/a/b"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(f"{uid}/a/+", 1))
    sub.send(Unsubscribe(7, [f"{uid}/a/#", topic, f"{uid}/+/+"]))
    none_existed = [RC.NO_SUBSCRIPTION_EXISTED] * 3 if version == V5 else []
    assert sub.recv() == Unsuback(7, none_existed)
    pub = connected(raw, broker.port, f"{uid}-p", version)
    assert publish_qos1(pub, topic, b"still", 1) == 0
    msg = next_publish(sub)
    assert (msg.topic, msg.payload) == (topic, b"still")
    sub.send(PubAck(msg.packet_id))  # type: ignore[arg-type]
    sub.send(Unsubscribe(8, [f"{uid}/none", f"{uid}/a/+"]))
    assert sub.recv() == Unsuback(8, [RC.NO_SUBSCRIPTION_EXISTED, RC.SUCCESS] if version == V5 else [])
    assert publish_qos1(pub, topic, b"gone", 2) == (RC.NO_MATCHING_SUBSCRIBERS if version == V5 else 0)
    assert barrier(sub) == []


@BOTH
def test_mqtt_3_10_4_3_started_deliveries_completed_after_unsubscribe(broker: BrokerProcess, raw: Raw, uid: str,
                                                                     version: int) -> None:
    """MQTT-3.10.4-3 (3.1.1 the same id): after an UNSUBSCRIBE the Server "MUST complete the delivery of any QoS 1
    or QoS 2 messages which match the Topic Filters and it has started to send to the Client". A QoS 2 and a QoS 1
    message in flight when the UNSUBACK comes still finish: PUBREC gets PUBREL with the same identifier (not 0x92),
    PUBCOMP and PUBACK are accepted; no new message follows."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    publish_qos2(pub, topic, b"two", 1)
    assert publish_qos1(pub, topic, b"one", 2) == 0
    two, one = next_publish(sub), next_publish(sub)
    assert [(p.payload, p.qos) for p in (two, one)] == [(b"two", 2), (b"one", 1)]
    sub.send(Unsubscribe(2, [topic]))
    assert sub.recv() == Unsuback(2, [RC.SUCCESS] if version == V5 else [])
    sub.send(PubRec(two.packet_id))  # type: ignore[arg-type]
    assert sub.recv() == PubRel(two.packet_id)  # type: ignore[arg-type]
    sub.send(PubComp(two.packet_id))  # type: ignore[arg-type]
    sub.send(PubAck(one.packet_id))  # type: ignore[arg-type]
    assert publish_qos1(pub, topic, b"after", 3) == (RC.NO_MATCHING_SUBSCRIBERS if version == V5 else 0)
    assert barrier(sub) == []


# ------------------------------------------------------------------------------------------ sessions


def test_mqtt_4_1_0_1_session_state_kept_while_connected(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-4.1.0-1 (5.0): "The Client and Server MUST NOT discard the Session State while the Network Connection
    is open"; 3.1.1 MQTT-4.1.0-2: "A Session MUST last at least as long it has an active Network Connection". A 5.0
    session with Session Expiry Interval 1 s and a 3.1.1 Clean Session 1 session are still subscribed 2.2 s later
    (two ticks past that interval), and the 5.0 one resumes (Session Present 1) right after a DISCONNECT."""
    topic = f"{uid}/t"
    v5 = connected(raw, broker.port, f"{uid}-5", SESSION_EXPIRY_INTERVAL=1)
    v311 = connected(raw, broker.port, f"{uid}-4", V311)
    for client in (v5, v311):
        subscribe(client, Subscription(topic, 1))
    time.sleep(2.2)  # stays: two ticks past the 1 s Session Expiry Interval while connected is what is tested
    pub = connected(raw, broker.port, f"{uid}-p")
    assert publish_qos1(pub, topic, b"later", 1) == 0
    for client in (v5, v311):
        msg = next_publish(client)
        assert msg.payload == b"later"
        client.send(PubAck(msg.packet_id))  # type: ignore[arg-type]
    v5.send(Disconnect())
    assert closed(v5)
    again = raw(broker.port, V5)
    assert again.connect(f"{uid}-5", clean_start=False,
                         properties={P.SESSION_EXPIRY_INTERVAL: 0}).session_present is True
    end_session(again, V5)


@BOTH
def test_mqtt_4_3_2_5_packet_id_reused_after_puback_is_a_new_message(broker: BrokerProcess, raw: Raw, uid: str,
                                                                     version: int) -> None:
    """MQTT-4.3.2-5 (5.0): "After it has sent a PUBACK packet the receiver MUST treat any incoming PUBLISH packet
    that contains the same Packet Identifier as being a new Application Message, irrespective of the setting of
    its DUP flag"; 3.1.1 MQTT-4.3.2-2 (same rule for the QoS 1 receiver). Two PUBLISHes with Packet Identifier 5,
    the second with DUP 1, are both acknowledged and both delivered."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(topic, 1))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    assert publish_qos1(pub, topic, b"first", 5) == 0
    pub.send(Publish(topic, b"second", 1, dup=True, packet_id=5))
    assert pub.recv() == PubAck(5)
    got = [next_publish(sub), next_publish(sub)]
    assert [p.payload for p in got] == [b"first", b"second"]


def test_mqtt_4_3_3_1_qos2_packet_identifiers_unused_while_in_flight(broker: BrokerProcess, raw: Raw,
                                                                     uid: str) -> None:
    """MQTT-4.3.3-1: the QoS 2 sender "MUST assign an unused Packet Identifier each time it has a new Application
    Message to send"; MQTT-2.2.1-4: "Each time a Server sends a new PUBLISH (with QoS > 0) MQTT Control Packet it
    MUST assign it a non zero Packet Identifier that is currently unused"; MQTT-4.3.3-2: QoS 2, DUP 0. Five QoS 2
    messages in flight (two of them at PUBREL) carry five different non-zero identifiers, and a sixth sent while
    they are in flight gets yet another one."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s")
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    for n in range(1, 6):
        publish_qos2(pub, topic, b"m%d" % n, n)
    got = [next_publish(sub) for _ in range(5)]
    assert [(p.payload, p.qos, p.dup) for p in got] == [(b"m%d" % n, 2, False) for n in range(1, 6)]
    ids = [p.packet_id for p in got]
    assert len(set(ids)) == 5 and all(ids)
    for p in got[:2]:
        sub.send(PubRec(p.packet_id))  # type: ignore[arg-type]
        assert sub.recv() == PubRel(p.packet_id)  # type: ignore[arg-type]
    publish_qos2(pub, topic, b"m6", 6)
    sixth = next_publish(sub)
    assert sixth.payload == b"m6" and sixth.packet_id not in ids and sixth.packet_id
    for p in got[:2]:
        sub.send(PubComp(p.packet_id))  # type: ignore[arg-type]


def test_mqtt_4_3_3_7_no_message_expiry_once_qos2_publish_sent(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-4.3.3-7: the QoS 2 sender "MUST NOT apply Message expiry if a PUBLISH packet has been sent". A QoS 2
    message with Message Expiry Interval 1 s, sent to a subscriber that neither acknowledged it nor stayed
    connected, is re-sent (DUP 1, same identifier) when the session resumes 1.3 s later, and its flow completes."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s", SESSION_EXPIRY_INTERVAL=60)
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    sent_at = time.monotonic()
    publish_qos2(pub, topic, b"short-lived", 1, MESSAGE_EXPIRY_INTERVAL=1)
    first = next_publish(sub)
    assert (first.payload, first.qos, first.dup) == (b"short-lived", 2, False)
    sub.close()
    time.sleep(max(0.0, sent_at + 1.3 - time.monotonic()))  # stays: the 1 s expiry must pass (it is tested)
    again = connected(raw, broker.port, f"{uid}-s", clean=False, SESSION_EXPIRY_INTERVAL=60)
    resent = next_publish(again)
    assert (resent.payload, resent.qos, resent.dup, resent.packet_id) == (b"short-lived", 2, True, first.packet_id)
    again.send(PubRec(first.packet_id))  # type: ignore[arg-type]
    assert again.recv() == PubRel(first.packet_id)  # type: ignore[arg-type]
    again.send(PubComp(first.packet_id))  # type: ignore[arg-type]
    assert barrier(again) == []
    end_session(again, V5)


def test_mqtt_4_3_3_9_packet_id_after_refused_pubrec_is_a_new_message(broker: BrokerProcess, raw: Raw,
                                                                      uid: str) -> None:
    """MQTT-4.3.3-9: the QoS 2 receiver, "If it has sent a PUBREC with a Reason Code of 0x80 or greater, ... MUST
    treat any subsequent PUBLISH packet that contains that Packet Identifier as being a new Application Message".
    A PUBLISH refused with PUBREC 0x99 (Payload format invalid) is not delivered; the next PUBLISH with the same
    identifier gets PUBREC 0x00, PUBCOMP 0x00, and is delivered."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s")
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    pub.send(Publish(topic, b"\xff bad", 2, packet_id=4, properties={P.PAYLOAD_FORMAT_INDICATOR: 1}))
    assert pub.recv() == PubRec(4, RC.PAYLOAD_FORMAT_INVALID)
    publish_qos2(pub, topic, b"good", 4, PAYLOAD_FORMAT_INDICATOR=1)
    msg = next_publish(sub)
    assert msg.payload == b"good"
    sub.send(PubRec(msg.packet_id))  # type: ignore[arg-type]
    assert sub.recv() == PubRel(msg.packet_id)  # type: ignore[arg-type]
    sub.send(PubComp(msg.packet_id))  # type: ignore[arg-type]
    assert barrier(sub) == []


def test_mqtt_4_3_3_13_qos2_flow_completed_after_expiry(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-4.3.3-13: the QoS 2 receiver "MUST continue the QoS 2 acknowledgement sequence even if it has applied
    message expiry"; MQTT-3.3.2-5: "If the Message Expiry Interval has passed and the Server has not managed to
    start onward delivery to a matching subscriber, then it MUST delete the copy of the message for that
    subscriber". A QoS 2 message with Message Expiry Interval 1 s whose PUBREL comes 1.3 s after the PUBLISH gets
    PUBCOMP 0x00, and the broker (which delivers onward on PUBREL) does not deliver it."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s")
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    sent_at = time.monotonic()
    pub.send(Publish(topic, b"expired", 2, packet_id=3, properties={P.MESSAGE_EXPIRY_INTERVAL: 1}))
    assert pub.recv() == PubRec(3)
    time.sleep(max(0.0, sent_at + 1.3 - time.monotonic()))  # stays: the 1 s expiry must pass (it is tested)
    pub.send(PubRel(3))
    assert pub.recv() == PubComp(3)
    expect_marker_next(sub, raw, broker.port, topic)


def test_mqtt_4_4_0_2_refused_deliveries_not_retransmitted(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-4.4.0-2: "If PUBACK or PUBREC is received containing a Reason Code of 0x80 or greater the corresponding
    PUBLISH packet is treated as acknowledged, and MUST NOT be retransmitted". A subscriber answers a QoS 1 message
    with PUBACK 0x80 and a QoS 2 one with PUBREC 0x80: no PUBREL follows, nothing is re-sent when its session
    resumes, and the Inflight Window is free (Receive Maximum 2, the next message goes out)."""
    topic = f"{uid}/t"
    props = {"SESSION_EXPIRY_INTERVAL": 60, "RECEIVE_MAXIMUM": 2}
    sub = connected(raw, broker.port, f"{uid}-s", **props)
    subscribe(sub, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    assert publish_qos1(pub, topic, b"one", 1) == 0
    publish_qos2(pub, topic, b"two", 2)
    one, two = next_publish(sub), next_publish(sub)
    sub.send(PubAck(one.packet_id, RC.UNSPECIFIED_ERROR))  # type: ignore[arg-type]
    sub.send(PubRec(two.packet_id, RC.UNSPECIFIED_ERROR))  # type: ignore[arg-type]
    assert barrier(sub) == []  # no PUBREL
    sub.close()
    again = connected(raw, broker.port, f"{uid}-s", clean=False, **props)
    assert barrier(again) == []  # nothing re-sent
    assert publish_qos1(pub, topic, b"three", 3) == 0
    assert publish_qos1(pub, topic, b"four", 4) == 0
    got = [next_publish(again), next_publish(again)]
    assert [(p.payload, p.dup) for p in got] == [(b"three", False), (b"four", False)]
    for p in got:
        again.send(PubAck(p.packet_id))  # type: ignore[arg-type]
    end_session(again, V5)


# ------------------------------------------------------------------------------------------ topics


ALL_LEVELS = pytest.mark.parametrize("version", [V31, V311, V5], ids=["v31", "v311", "v5"])

#: A SUBSCRIBE / UNSUBSCRIBE whose only Topic Filter is empty, by kind and wire format (3.1 is 3.1.1's).
EMPTY_FILTER_PACKETS: dict[str, dict[int, bytes]] = {
    "subscribe": {V5: b"\x82\x06\x00\x01\x00\x00\x00\x01", V311: b"\x82\x05\x00\x01\x00\x00\x01"},
    "unsubscribe": {V5: b"\xa2\x05\x00\x01\x00\x00\x00", V311: b"\xa2\x04\x00\x01\x00\x00"},
}


def persistent(raw: Raw, port: int, client_id: str, version: int) -> RawClient:
    """``client_id`` connected with a session that outlives the connection (Clean Session / Clean Start 0; 5.0: a
    Session Expiry Interval of 60 s)."""
    if version == V5:
        return connected(raw, port, client_id, version, clean=False, SESSION_EXPIRY_INTERVAL=60)
    return connected(raw, port, client_id, version, clean=False)


def check_empty_filter_refused(broker: BrokerProcess, raw: Raw, uid: str, version: int, kind: str, where: str) -> None:
    """Send a SUBSCRIBE or UNSUBSCRIBE with an empty Topic Filter (alone as exact bytes, or after a valid filter)
    on a session subscribed to ``<uid>/kept``: 5.0 DISCONNECT 0x82, 3.1.1 and 3.1 a plain close, no SUBACK or
    UNSUBACK; the packet is refused whole, so the session's subscriptions are what they were before it."""
    kept, cid = f"{uid}/kept", short_id()
    client = persistent(raw, broker.port, cid, version)
    subscribe(client, Subscription(kept, 1))
    if where == "only":
        data = EMPTY_FILTER_PACKETS[kind][V5 if version == V5 else V311]
    elif kind == "subscribe":
        data = Subscribe(2, [Subscription(f"{uid}/new", 1), Subscription("", 1)]).encode(version)
    else:
        data = Unsubscribe(2, [kept, ""]).encode(version)
    rejected_with(client, data, version, RC.PROTOCOL_ERROR)
    again = persistent(raw, broker.port, cid, version)
    marker(raw, broker.port, f"{uid}/new")  # not subscribed by the refused SUBSCRIBE
    expect_marker_next(again, raw, broker.port, kept)  # not unsubscribed by the refused UNSUBSCRIBE
    if version == V5:
        end_session(again, V5)
    else:
        again.close()
        connected(raw, broker.port, cid, version).send(Disconnect())  # Clean Session 1 discards the session


@ALL_LEVELS
@pytest.mark.parametrize("where", ["only", "after-valid"])
def test_mqtt_4_7_3_1_empty_topic_filter_in_unsubscribe_ends_connection(
    broker: BrokerProcess, raw: Raw, uid: str, version: int, where: str
) -> None:
    """MQTT-4.7.3-1 (both specs): "All Topic Names and Topic Filters MUST be at least one character long". An
    UNSUBSCRIBE whose Topic Filter is empty (``a2 05 00 01 00 00 00`` in 5.0, ``a2 04 00 01 00 00`` in 3.1.1 and
    3.1), alone or after a valid one, gets no UNSUBACK: 5.0 DISCONNECT 0x82 (Protocol Error, MQTT-4.13.1-1) and
    the close; 3.1.1 and 3.1 the close with nothing sent (MQTT-4.8.0-1 of 3.1.1). Nothing of the packet is
    processed: the valid filter before the empty one stays subscribed."""
    check_empty_filter_refused(broker, raw, uid, version, "unsubscribe", where)


@ALL_LEVELS
@pytest.mark.parametrize("where", ["only", "after-valid"])
def test_mqtt_4_7_3_1_empty_topic_filter_in_subscribe_ends_connection(
    broker: BrokerProcess, raw: Raw, uid: str, version: int, where: str
) -> None:
    """MQTT-4.7.3-1 (both specs): a SUBSCRIBE whose Topic Filter is empty (``82 06 00 01 00 00 00 01`` in 5.0,
    ``82 05 00 01 00 00 01`` in 3.1.1 and 3.1), alone or after a valid one, gets no SUBACK: 5.0 DISCONNECT 0x82
    and the close, 3.1.1 and 3.1 the close with nothing sent, as for UNSUBSCRIBE (a SUBACK failure code is for a
    well-formed filter the server does not accept). The valid filter before the empty one is not subscribed."""
    check_empty_filter_refused(broker, raw, uid, version, "subscribe", where)


@ALL_LEVELS
@pytest.mark.parametrize("qos", [0, 1])
def test_mqtt_4_7_3_1_empty_topic_name_in_publish_ends_connection(
    broker: BrokerProcess, raw: Raw, uid: str, version: int, qos: int
) -> None:
    """MQTT-4.7.3-1 (both specs): a PUBLISH with an empty Topic Name (5.0: and no Topic Alias, MQTT 5.0 §3.3.2.1)
    gets DISCONNECT 0x82 and the close in 5.0, the close with nothing sent in 3.1.1 and 3.1; a QoS 1 one gets no
    PUBACK. Exact bytes: ``30 03 00 00 00`` / ``32 05 00 00 00 01 00`` (5.0), ``30 02 00 00`` / ``32 04 00 00 00
    01`` (3.1.1, 3.1)."""
    data = {
        (V5, 0): b"\x30\x03\x00\x00\x00",
        (V5, 1): b"\x32\x05\x00\x00\x00\x01\x00",
        (V311, 0): b"\x30\x02\x00\x00",
        (V311, 1): b"\x32\x04\x00\x00\x00\x01",
    }[(V5 if version == V5 else V311, qos)]
    rejected_with(connected(raw, broker.port, short_id(), version), data, version, RC.PROTOCOL_ERROR)


def test_mqtt_4_7_3_1_empty_response_topic_in_publish_ends_connection(
    broker: BrokerProcess, raw: Raw, uid: str
) -> None:
    """MQTT-4.7.3-1 for the Response Topic, a Topic Name (MQTT 5.0 §3.3.2.3.5): a PUBLISH whose Response Topic is
    empty gets DISCONNECT 0x82 and the close, and is not delivered."""
    topic = f"{uid}/t"
    sub = connected(raw, broker.port, f"{uid}-s")
    subscribe(sub, Subscription(topic, 1))
    client = connected(raw, broker.port, uid)
    data = Publish(topic, b"x", 1, packet_id=1, properties={P.RESPONSE_TOPIC: ""}).encode(V5)
    rejected_with(client, data, V5, RC.PROTOCOL_ERROR)
    expect_marker_next(sub, raw, broker.port, topic)


@ALL_LEVELS
def test_mqtt_4_7_3_1_empty_will_topic_refused(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-4.7.3-1 (both specs) for the Will Topic: a CONNECT whose Will Topic is empty is refused: 5.0 CONNACK
    0x82 (Protocol Error), Session Present 0, then the close (MQTT-3.2.2-7); 3.1.1 and 3.1 have no fitting
    return code, so the connection is closed with nothing sent (MQTT-3.2.2-6 of 3.1.1). A PUBLISH written right
    behind the CONNECT is not processed."""
    watcher = connected(raw, broker.port, f"{uid}-w", V311)
    subscribe(watcher, Subscription(f"{uid}/t", 0))
    client = raw(broker.port, version)
    client.send(
        Connect(short_id(), version, True, 60, will=Will("", b"x")).encode(version)
        + Publish(f"{uid}/t", b"ignored").encode(version)
    )
    assert closed(client)
    if version == V5:
        (packet,) = client.recv_all(0.05)
        assert isinstance(packet, Connack), packet
        assert (packet.session_present, packet.reason_code) == (False, RC.PROTOCOL_ERROR), packet
    else:
        assert bytes(client.raw_received) == b""
    assert barrier(watcher) == []


def test_mqtt_4_7_3_1_empty_will_response_topic_refused(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-4.7.3-1 for the Response Topic in the Will Properties (a Topic Name, MQTT 5.0 §3.1.3.2.5): a CONNECT
    whose Will Response Topic is empty gets CONNACK 0x82, Session Present 0, and the close."""
    client = raw(broker.port, V5)
    client.send(Connect(short_id(), V5, True, 60, will=Will(f"{uid}/w", b"x", properties={P.RESPONSE_TOPIC: ""})))
    assert closed(client)
    (packet,) = client.recv_all(0.05)
    assert isinstance(packet, Connack), packet
    assert (packet.session_present, packet.reason_code) == (False, RC.PROTOCOL_ERROR), packet


@BOTH
def test_mqtt_4_7_3_3_longest_topic_name_and_filter(make_broker: Callable[[str], BrokerProcess], raw: Raw, uid: str,
                                                    version: int) -> None:
    """MQTT-4.7.3-3: "Topic Names and Topic Filters are UTF-8 Encoded Strings; they MUST NOT encode to more than
    65,535 bytes". A Topic Name and Topic Filter of exactly 65,535 bytes (with multi-byte characters) are accepted,
    matched and delivered unchanged on a listener whose ``max_topic_length`` allows them (the default, 1,024 bytes,
    refuses them on purpose: docs/reliability.md, Limits; tests/test_limits.py)."""
    broker = make_broker('[listeners.external]\nbind = "127.0.0.1:0"\nmax_topic_length = 65535\n')
    head = f"{uid}/é/"
    topic = head + "x" * (65535 - len(head.encode()))
    assert len(topic.encode()) == 65535
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(topic, 1))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    assert publish_qos1(pub, topic, b"long", 1) == 0
    msg = next_publish(sub)
    assert (msg.topic, msg.payload) == (topic, b"long")


@BOTH
def test_mqtt_4_7_3_4_no_normalisation_over_the_wire(broker: BrokerProcess, raw: Raw, uid: str, version: int) -> None:
    """MQTT-4.7.3-4: "When it performs subscription matching the Server MUST NOT perform any normalization of Topic
    Names or Topic Filters, or any modification or substitution of unrecognized characters". A filter with "é"
    (U+00E9) does not match the same word with "e" + U+0301, and ``A/+`` does not match ``a/x``; exact names do."""
    sub = connected(raw, broker.port, f"{uid}-s", version)
    subscribe(sub, Subscription(f"{uid}/caf\u00e9/+", 1), Subscription(f"{uid}/A/+", 1))
    pub = connected(raw, broker.port, f"{uid}-p", version)
    for n, topic in enumerate([f"{uid}/cafe\u0301/x", f"{uid}/a/x", f"{uid}/caf\u00e9/x", f"{uid}/A/x"], start=1):
        publish_qos1(pub, topic, b"%d" % n, n)
    got = [next_publish(sub), next_publish(sub)]
    assert [(p.topic, p.payload) for p in got] == [(f"{uid}/caf\u00e9/x", b"3"), (f"{uid}/A/x", b"4")]
    for p in got:
        sub.send(PubAck(p.packet_id))  # type: ignore[arg-type]
    assert barrier(sub) == []


# ------------------------------------------------------------------------------------------ shared subscriptions


def receiver(members: list[RawClient], timeout: float = 5.0) -> tuple[int, Publish]:
    """Which of ``members`` received the next PUBLISH, and the packet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, member in enumerate(members):
            try:
                packet = member.recv(0.02)
            except TimeoutError:
                continue
            assert isinstance(packet, Publish), packet
            return i, packet
    raise AssertionError("no member received the message")


def shared_group(raw: Raw, port: int, uid: str, qos: tuple[int, int] = (2, 2),
                 **props: Any) -> tuple[RawClient, RawClient]:
    """Two 5.0 members ``a`` and ``b`` of ``$share/g/<uid>/t`` (``props`` for ``a``); ``b`` also subscribes
    ``<uid>/marker``."""
    members = []
    for name, q, p in (("a", qos[0], props), ("b", qos[1], {})):
        member = connected(raw, port, f"{uid}-{name}", **p)
        subs = [Subscription(f"$share/g/{uid}/t", q)] + ([Subscription(f"{uid}/marker", 1)] if name == "b" else [])
        subscribe(member, *subs)
        members.append(member)
    return members[0], members[1]


def first_to_a(raw: Raw, port: int, uid: str, a: RawClient, b: RawClient, qos: int,
               publisher: str = "p") -> Publish:
    """Publish to the shared topic until member ``a`` receives a message (round robin), completing ``b``'s."""
    pub = connected(raw, port, f"{uid}-{publisher}")
    for n in range(1, 5):
        if qos == 2:
            publish_qos2(pub, f"{uid}/t", b"s%d" % n, n)
        else:
            assert publish_qos1(pub, f"{uid}/t", b"s%d" % n, n) == 0
        who, packet = receiver([a, b])
        assert packet.qos == qos
        if who == 0:
            return packet
        if qos == 2:
            b.send(PubRec(packet.packet_id))  # type: ignore[arg-type]
            assert b.recv() == PubRel(packet.packet_id)  # type: ignore[arg-type]
            b.send(PubComp(packet.packet_id))  # type: ignore[arg-type]
        else:
            b.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
    raise AssertionError("member a never chosen")


def test_mqtt_4_8_2_3_shared_subscription_respects_each_granted_qos(broker: BrokerProcess, raw: Raw,
                                                                    uid: str) -> None:
    """MQTT-4.8.2-3: "The Server MUST respect the granted QoS for the Clients subscription". Members of one Shared
    Subscription granted QoS 0 and QoS 2 each receive the QoS 2 messages at their own granted QoS; every message
    goes to exactly one of them."""
    a, b = shared_group(raw, broker.port, uid, qos=(0, 2))
    pub = connected(raw, broker.port, f"{uid}-p")
    for n in range(1, 7):
        publish_qos2(pub, f"{uid}/t", b"%d" % n, n)
    got: dict[int, list[Publish]] = {0: [], 1: []}
    for _ in range(6):
        who, packet = receiver([a, b])
        got[who].append(packet)
        if packet.qos == 2:
            b.send(PubRec(packet.packet_id))  # type: ignore[arg-type]
    assert got[0] and got[1]
    assert {p.qos for p in got[0]} == {0} and {p.qos for p in got[1]} == {2}
    assert sorted(int(p.payload) for p in got[0] + got[1]) == [1, 2, 3, 4, 5, 6]


def test_mqtt_4_8_2_4_shared_qos2_delivery_completed_on_reconnect(broker: BrokerProcess, raw: Raw,
                                                                  uid: str) -> None:
    """MQTT-4.8.2-4: "If the Server is in the process of sending a QoS 2 message to its chosen subscribing Client
    and the connection to the Client breaks before delivery is complete, the Server MUST complete the delivery of
    the message to that Client when it reconnects". The chosen member drops without PUBREC; on reconnect it gets
    the PUBLISH again (DUP 1, same identifier) and the flow completes; the other member never gets it."""
    a, b = shared_group(raw, broker.port, uid, SESSION_EXPIRY_INTERVAL=60)
    msg = first_to_a(raw, broker.port, uid, a, b, qos=2)
    a.close()
    expect_marker_next(b, raw, broker.port, f"{uid}/marker")
    again = connected(raw, broker.port, f"{uid}-a", clean=False, SESSION_EXPIRY_INTERVAL=60)
    resent = next_publish(again)
    assert (resent.payload, resent.qos, resent.dup, resent.packet_id) == (msg.payload, 2, True, msg.packet_id)
    again.send(PubRec(msg.packet_id))  # type: ignore[arg-type]
    assert again.recv() == PubRel(msg.packet_id)  # type: ignore[arg-type]
    again.send(PubComp(msg.packet_id))  # type: ignore[arg-type]
    assert barrier(again) == []
    end_session(again, V5)


def test_mqtt_4_8_2_5_shared_qos2_not_redistributed_when_session_ends(broker: BrokerProcess, raw: Raw,
                                                                      uid: str) -> None:
    """MQTT-4.8.2-5: "If the Client's Session terminates before the Client reconnects, the Server MUST NOT send the
    Application Message to any other subscribed Client". The chosen member ends its session (DISCONNECT with
    Session Expiry Interval 0) with the QoS 2 message unacknowledged; the other member never gets it."""
    a, b = shared_group(raw, broker.port, uid, SESSION_EXPIRY_INTERVAL=60)
    first_to_a(raw, broker.port, uid, a, b, qos=2)
    end_session(a, V5)
    expect_marker_next(b, raw, broker.port, f"{uid}/marker")
    assert barrier(b) == []


def test_mqtt_4_8_2_6_shared_message_refused_by_member_is_discarded(broker: BrokerProcess, raw: Raw,
                                                                    uid: str) -> None:
    """MQTT-4.8.2-6: "If a Client responds with a PUBACK or PUBREC containing a Reason Code of 0x80 or greater to a
    PUBLISH packet from the Server, the Server MUST discard the Application Message and not attempt to send it to
    any other Subscriber". A QoS 1 message refused with PUBACK 0x80 and a QoS 2 one refused with PUBREC 0x80 reach
    neither the other member nor, after a reconnect, the refusing one."""
    a, b = shared_group(raw, broker.port, uid, SESSION_EXPIRY_INTERVAL=60)
    q1 = first_to_a(raw, broker.port, uid, a, b, qos=1, publisher="p1")
    a.send(PubAck(q1.packet_id, RC.UNSPECIFIED_ERROR))  # type: ignore[arg-type]
    q2 = first_to_a(raw, broker.port, uid, a, b, qos=2, publisher="p2")
    a.send(PubRec(q2.packet_id, RC.UNSPECIFIED_ERROR))  # type: ignore[arg-type]
    assert barrier(a) == []  # no PUBREL for the refused one
    expect_marker_next(b, raw, broker.port, f"{uid}/marker")
    a.close()
    a = connected(raw, broker.port, f"{uid}-a", clean=False, SESSION_EXPIRY_INTERVAL=60)
    assert barrier(a) == []
    expect_marker_next(b, raw, broker.port, f"{uid}/marker")
    end_session(a, V5)


# ------------------------------------------------------------------------------------------ MQTT 3.1
# MQTT 3.1 (Protocol Name "MQIsdp", level 3) is served as 3.1.1 except where 3.1 differs; its spec has no numbered
# statements, so these tests carry the id of the 3.1.1 statement they stand beside (``v31`` in the name).

#: A 3.1 CONNECT variable header (Keep Alive 60) before its Connect Flags: ``00 06 MQIsdp 03``.
V31_NAME_AND_LEVEL = b"\x00\x06MQIsdp\x03"


@pytest.mark.parametrize(
    ("flags", "payload"),
    [(0x02, b"\x00\x00"), (0x02, b""), (0x00, b"")],
    ids=["zero-length-clean-session-1", "payload-ends-clean-session-1", "payload-ends-clean-session-0"],
)
def test_mqtt_3_1_3_8_v31_empty_client_id_rejected(
    broker: BrokerProcess, raw: Raw, uid: str, flags: int, payload: bytes
) -> None:
    """MQTT 3.1 §3.1 (CONNECT payload): "The Client Identifier (Client ID) is between 1 and 23 characters long";
    a 3.1 server assigns none (3.1.1 MQTT-3.1.3-6 came later). A 3.1 CONNECT with a zero-length Client
    Identifier, or whose payload ends where the Client Identifier should be, gets exactly ``20 02 00 02`` (return
    code 0x02 Identifier rejected, 3.1.1 MQTT-3.1.3-8 / MQTT-3.1.3-9; Session Present 0, MQTT-3.2.2-4) and the
    connection is closed (MQTT-3.2.2-5); a PUBLISH written right behind it is not processed."""
    watcher = connected(raw, broker.port, f"{uid}-w", V311)
    subscribe(watcher, Subscription(f"{uid}/t", 0))
    body = V31_NAME_AND_LEVEL + bytes((flags,)) + b"\x00\x3c" + payload
    client = raw(broker.port, V31)
    client.send(bytes((0x10, len(body))) + body + Publish(f"{uid}/t", b"ignored").encode(V31))
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x02"
    assert barrier(watcher) == []


def test_mqtt_3_1_2_4_v31_resumed_session_connack_has_no_session_present(
    broker: BrokerProcess, raw: Raw, uid: str
) -> None:
    """MQTT 3.1 §3.2 (CONNACK): the first byte of the variable header is reserved ("not used") and 0; the Session
    Present flag is 3.1.1's (MQTT-3.2.2-2). A 3.1 client that reconnects with Clean Session 0 to its stored
    session gets exactly ``20 02 00 00``, and the session is still resumed (3.1.1 MQTT-3.1.2-4): the outbound
    QoS 2 flow it left after PUBREC gets its PUBREL again (MQTT-4.4.0-1) and completes, and the subscription still
    delivers."""
    cid, topic = short_id(), f"{uid}/t"
    client = raw(broker.port, V31)
    assert client.connect(cid, clean_start=False) == Connack(False, 0)
    subscribe(client, Subscription(topic, 2))
    pub = connected(raw, broker.port, f"{uid}-p", V311)
    publish_qos2(pub, topic, b"one", 1)
    first = next_publish(client)
    assert (first.payload, first.qos) == (b"one", 2)
    client.send(PubRec(first.packet_id))  # type: ignore[arg-type]
    assert client.recv() == PubRel(first.packet_id)  # type: ignore[arg-type]
    client.close()  # network failure before PUBCOMP: the flow stays in flight in the session
    again = raw(broker.port, V31)
    assert again.connect(cid, clean_start=False) == Connack(False, 0)
    assert bytes(again.raw_received[:4]) == b"\x20\x02\x00\x00"
    assert again.recv() == PubRel(first.packet_id)  # type: ignore[arg-type]
    again.send(PubComp(first.packet_id))  # type: ignore[arg-type]
    publish_qos2(pub, topic, b"two", 2)
    second = next_publish(again)
    assert (second.payload, second.qos, second.dup) == (b"two", 2, False)
    again.send(PubRec(second.packet_id))  # type: ignore[arg-type]
    assert again.recv() == PubRel(second.packet_id)  # type: ignore[arg-type]
    again.send(PubComp(second.packet_id))  # type: ignore[arg-type]
    assert barrier(again) == []
    again.close()
    connected(raw, broker.port, cid, V31).send(Disconnect())  # Clean Session 1 discards the session


# ------------------------------------------------------------------------------------------ MQTT 3.1.1 only


def test_v311_mqtt_3_1_2_7_retained_messages_outlive_the_session(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """3.1.1 MQTT-3.1.2-7: "Retained messages do not form part of the Session state in the Server, they MUST NOT be
    deleted when the Session ends". Retained messages published by a Clean Session 1 client and by a Clean Session
    0 client whose session is then discarded are still sent to a new subscriber."""
    clean = connected(raw, broker.port, f"{uid}-c", V311)
    clean.send(Publish(f"{uid}/clean", b"r1", 1, retain=True, packet_id=2))
    assert clean.recv() == PubAck(2)
    clean.send(Disconnect())
    assert closed(clean)
    kept = connected(raw, broker.port, f"{uid}-k", V311, clean=False)
    kept.send(Publish(f"{uid}/kept", b"r2", 0, retain=True))
    kept.send(Disconnect())
    assert closed(kept)
    connected(raw, broker.port, f"{uid}-k", V311).send(Disconnect())  # Clean Session 1 discards that session
    sub = connected(raw, broker.port, f"{uid}-s", V311)
    subscribe(sub, Subscription(f"{uid}/+", 0))
    got = sorted((next_publish(sub), next_publish(sub)), key=lambda p: p.topic)
    assert [(p.topic, p.payload, p.retain) for p in got] == [(f"{uid}/clean", b"r1", True),
                                                             (f"{uid}/kept", b"r2", True)]
    for topic in (f"{uid}/clean", f"{uid}/kept"):
        sub.send(Publish(topic, b"", retain=True))
    assert [p.payload for p in (next_publish(sub), next_publish(sub))] == [b"", b""]


def test_v311_mqtt_3_1_2_12_no_will_flag_no_will_published(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """3.1.1 MQTT-3.1.2-12: "If the Will Flag is set to 0, ... a Will Message MUST NOT be published when this Network
    Connection ends". A Clean Session 0 client connects with a Will and leaves with DISCONNECT (Will discarded),
    then reconnects without a Will and drops its connection: nothing is published on the old Will Topic."""
    watcher = connected(raw, broker.port, f"{uid}-w", V311)
    subscribe(watcher, Subscription(f"{uid}/will", 1))
    client = raw(broker.port, V311)
    assert client.connect(uid, clean_start=False, will=Will(f"{uid}/will", b"bye", 1, False)).reason_code == 0
    client.send(Disconnect())
    assert closed(client)
    again = connected(raw, broker.port, uid, V311, clean=False)
    again.close()  # network failure, no DISCONNECT
    expect_marker_next(watcher, raw, broker.port, f"{uid}/will")
    connected(raw, broker.port, uid, V311).send(Disconnect())  # discard the session


def test_mqtt_3_15_1_1_auth_with_reserved_flags_is_malformed(broker: BrokerProcess, raw: Raw, uid: str) -> None:
    """MQTT-3.15.1-1: "Bits 3,2,1 and 0 of the Fixed Header of the AUTH packet are reserved and MUST all be set to
    0. The Client or Server MUST treat any other value as malformed and close the Network Connection": AUTH with
    flags 0001 gets DISCONNECT 0x81 (not the 0x82 a well-formed AUTH gets) and the close."""
    client = connected(raw, broker.port, uid)
    rejected_with(client, b"\xf1\x00", V5, RC.MALFORMED_PACKET)
