"""Publish/subscribe behaviour of the real broker process over real sockets.

Covers SUBSCRIBE/UNSUBSCRIBE and topic matching, MQTT 5.0 subscription options, shared subscriptions, PUBLISH at
QoS 0/1/2 in both directions (paho-mqtt 3.1.1 and 5.0, aiomqtt, mosquitto_pub/mosquitto_sub and the raw client), the
QoS 2 flows (docs/architecture.md, "Session semantics"), retained messages, message properties and expiry, and ``$SYS``.

Statement ids are those of the OASIS texts (see docs/conformance.md); the same id can mean different things in
3.1.1 and 5.0, so test names carry ``v311``/``v5`` where it matters.
"""

from __future__ import annotations

import asyncio
import math
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import aiomqtt
import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, RawClient
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from gateway import __version__
from gateway.mqtt.packets import (
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
)
from gateway.mqtt.properties import PropertyId as P

PacketT = TypeVar("PacketT")

V31 = 3
V311 = 4
V5 = 5
VERSIONS = pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])


# ---------------------------------------------------------------------------------------------- raw client helpers


class Peer:
    """A :class:`RawClient` plus the protocol chores the tests repeat: SUBSCRIBE/UNSUBSCRIBE round trips,
    complete QoS 1/2 publish flows, and collecting PUBLISH packets while acknowledging them."""

    def __init__(self, client: RawClient) -> None:
        self.client = client
        self.version = client.version
        self.stash: list[Packet] = []
        self._next_pid = 1

    def pid(self) -> int:
        """A fresh Packet Identifier for a packet this client sends."""
        pid = self._next_pid
        self._next_pid = pid % 65535 + 1
        return pid

    def send(self, packet: Any) -> None:
        self.client.send(packet)

    def _next(self, deadline: float) -> Packet:
        if self.stash:
            return self.stash.pop(0)
        return self.client.recv(max(0.0, deadline - time.monotonic()))

    def expect(self, cls: type[PacketT], timeout: float = 5.0) -> PacketT:
        """The next packet of type ``cls``; packets of other types met on the way are kept for later."""
        for i, packet in enumerate(self.stash):
            if isinstance(packet, cls):
                return self.stash.pop(i)  # type: ignore[return-value]
        deadline = time.monotonic() + timeout
        while True:
            packet = self.client.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(packet, cls):
                return packet
            if isinstance(packet, Disconnect):
                raise AssertionError(f"broker sent {packet!r} while {cls.__name__} was expected")
            self.stash.append(packet)

    def subscribe(self, *subs: Subscription | str, sub_id: int | None = None, pid: int | None = None) -> list[int]:
        """SUBSCRIBE (plain strings mean QoS 2) and return the SUBACK codes; checks the Packet Identifier."""
        pid = pid or self.pid()
        entries = [Subscription(s, 2) if isinstance(s, str) else s for s in subs]
        props = {P.SUBSCRIPTION_IDENTIFIER: [sub_id]} if sub_id is not None else {}
        self.send(Subscribe(pid, entries, props))
        ack = self.expect(Suback)
        assert ack.packet_id == pid
        return ack.reason_codes

    def unsubscribe(self, *filters: str) -> list[int]:
        """UNSUBSCRIBE and return the UNSUBACK reason codes (empty for 3.1.1); checks the Packet Identifier."""
        pid = self.pid()
        self.send(Unsubscribe(pid, list(filters)))
        ack = self.expect(Unsuback)
        assert ack.packet_id == pid
        return ack.reason_codes

    def publish(self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False,
                props: dict[int, Any] | None = None) -> int:
        """PUBLISH and finish its flow; return the PUBACK/PUBREC reason code (0 for QoS 0)."""
        pid = self.pid() if qos else None
        self.send(Publish(topic, payload, qos, retain, False, pid, props or {}))
        if qos == 1:
            ack = self.expect(PubAck)
            assert ack.packet_id == pid
            return ack.reason_code
        if qos == 2:
            rec = self.expect(PubRec)
            assert rec.packet_id == pid
            if rec.reason_code < 0x80:
                self.send(PubRel(pid))  # type: ignore[arg-type]
                comp = self.expect(PubComp)
                assert (comp.packet_id, comp.reason_code) == (pid, 0)
            return rec.reason_code
        return 0

    def acknowledge(self, packet: Publish) -> None:
        if packet.qos == 1:
            self.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
        elif packet.qos == 2:
            self.send(PubRec(packet.packet_id))  # type: ignore[arg-type]

    def publishes(self, n: int, timeout: float = 5.0, ack: bool = True) -> list[Publish]:
        """The next ``n`` PUBLISH packets, acknowledged (PUBACK / PUBREC, PUBCOMP for each PUBREL)."""
        got: list[Publish] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            packet = self._next(deadline)
            if isinstance(packet, Publish):
                got.append(packet)
                if ack:
                    self.acknowledge(packet)
            elif isinstance(packet, PubRel) and ack:
                self.send(PubComp(packet.packet_id))
            else:
                raise AssertionError(f"unexpected {packet!r} while waiting for PUBLISH")
        return got

    def until(self, topic: str, timeout: float = 5.0) -> list[Publish]:
        """Every PUBLISH up to and excluding the first one on ``topic`` (a marker published last)."""
        got: list[Publish] = []
        deadline = time.monotonic() + timeout
        while True:
            [packet] = self.publishes(1, max(0.0, deadline - time.monotonic()))
            if packet.topic == topic:
                return got
            got.append(packet)

    def disconnect(self) -> None:
        """A normal DISCONNECT; returns once the broker closed the connection (the session is detached)."""
        self.send(Disconnect())
        assert self.client.closed_by_server()

    def quiet(self, timeout: float = 0.3) -> list[Packet]:
        """Every packet arriving within ``timeout`` (used where no marker can prove an absence)."""
        packets = self.stash + self.client.recv_all(timeout)
        self.stash = []
        return packets


Open = Callable[..., Peer]


@pytest.fixture
def raw(broker: BrokerProcess) -> Iterator[Open]:
    """Open connected raw clients on the module broker (or ``port=``); all are closed at the end."""
    opened: list[RawClient] = []

    def open_(client_id: str, version: int = V5, clean_start: bool = True, port: int | None = None,
              **kw: Any) -> Peer:
        client = RawClient(port or broker.port, version=version)
        opened.append(client)
        ack = client.connect(client_id, clean_start=clean_start, **kw)
        assert ack.reason_code == 0, ack
        return Peer(client)

    yield open_
    for client in opened:
        client.close()


def topics(packets: list[Publish]) -> list[str]:
    return [p.topic for p in packets]


# ---------------------------------------------------------------------------------------------- paho helpers


class PahoClient:
    """A paho-mqtt 2.x client on a background loop that queues what it receives."""

    def __init__(self, port: int, client_id: str, protocol: mqtt.MQTTProtocolVersion) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.acks: dict[int, list[int]] = {}
        self._acked = threading.Condition()
        self._connected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.client.on_subscribe = self._on_ack
        self.client.on_unsubscribe = self._on_ack
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        assert self._connected.wait(5), "paho did not connect"

    def _on_connect(self, _c: Any, _u: Any, _flags: Any, reason_code: Any, _props: Any) -> None:
        assert reason_code.value == 0
        self._connected.set()

    def _on_ack(self, _c: Any, _u: Any, mid: int, codes: Any, _props: Any) -> None:
        with self._acked:
            self.acks[mid] = [c.value for c in codes]
            self._acked.notify_all()

    def _wait_ack(self, mid: int | None) -> list[int]:
        assert mid is not None
        with self._acked:
            assert self._acked.wait_for(lambda: mid in self.acks, 5), "no SUBACK/UNSUBACK"
            return self.acks.pop(mid)

    def subscribe(self, topic: str, qos: int = 0, **kw: Any) -> list[int]:
        _, mid = self.client.subscribe(topic, qos, **kw)
        return self._wait_ack(mid)

    def unsubscribe(self, topic: str) -> list[int]:
        _, mid = self.client.unsubscribe(topic)
        return self._wait_ack(mid)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                properties: PahoProperties | None = None) -> None:
        info = self.client.publish(topic, payload, qos, retain, properties)
        info.wait_for_publish(5)
        assert info.is_published()

    def get(self, timeout: float = 5.0) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def paho(broker: BrokerProcess) -> Iterator[Callable[[str, mqtt.MQTTProtocolVersion], PahoClient]]:
    """Open paho clients on the module broker; all are disconnected and their loops stopped at the end."""
    opened: list[PahoClient] = []

    def open_(client_id: str, protocol: mqtt.MQTTProtocolVersion) -> PahoClient:
        client = PahoClient(broker.port, client_id, protocol)
        opened.append(client)
        return client

    yield open_
    for client in opened:
        client.close()


PAHO_VERSIONS = pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v311", "v5"])


# ---------------------------------------------------------------------------------------------- topic matching


@VERSIONS
def test_topic_wildcards_plus_and_hash_match_levels(raw: Open, uid: str, version: int) -> None:
    """MQTT 5.0 / 3.1.1 §4.7.1.2-4.7.1.3: ``#`` matches the parent and any number of child levels
    (``sport/#`` matches ``sport``), ``+`` matches exactly one level, including an empty one."""
    end = f"{uid}/end"
    hash_sub = raw(f"{uid}-h", version)
    plus_sub = raw(f"{uid}-p", version)
    one_sub = raw(f"{uid}-o", version)
    assert hash_sub.subscribe(f"{uid}/sport/#", end) == [2, 2]
    assert plus_sub.subscribe(f"{uid}/+/player1", end) == [2, 2]
    assert one_sub.subscribe(f"{uid}/+", end) == [2, 2]
    pub = raw(f"{uid}-pub", version)
    sent = ["sport", "sport/tennis/player1", "sport/player1", "finance", "/player1", "finance/player1/x",
            "sportive"]
    for name in sent:
        pub.publish(f"{uid}/{name}")
    pub.publish(end)
    assert topics(hash_sub.until(end)) == [f"{uid}/{t}" for t in ("sport", "sport/tennis/player1", "sport/player1")]
    assert topics(plus_sub.until(end)) == [f"{uid}/{t}" for t in ("sport/player1", "/player1")]
    # ``{uid}/+`` also matches the marker itself: one copy only, the overlap is delivered once.
    assert topics(one_sub.until(end)) == [f"{uid}/{t}" for t in ("sport", "finance", "sportive")]
    assert one_sub.quiet(0.2) == []


@VERSIONS
def test_mqtt_4_7_2_1_dollar_topics_not_matched_by_leading_wildcards(raw: Open, uid: str, version: int) -> None:
    """[MQTT-4.7.2-1]: filters starting with ``#`` or ``+`` do not match Topic Names beginning with ``$``
    ($SYS/broker/uptime from the broker, ``$custom/...`` from a client); ``$SYS/#`` and ``$custom/#`` do."""
    custom = f"$custom/{uid}/x"
    marker = f"{uid}/marker"
    wild = raw(f"{uid}-wild", version)
    assert wild.subscribe("#", f"+/{uid}/x", "+/broker/uptime") == [2, 2, 2]
    dollar = raw(f"{uid}-dollar", version)
    assert dollar.subscribe("$SYS/#", "$custom/#") == [2, 2]
    pub = raw(f"{uid}-pub", version)
    assert pub.publish(custom, b"c", qos=1) == 0
    pub.publish(marker, b"m", qos=1)

    # The $-subscriber gets the client's $custom message and, within a $SYS period, a live (RETAIN=0) uptime.
    got: list[Publish] = []
    deadline = time.monotonic() + 5
    while not any(p.topic == "$SYS/broker/uptime" and not p.retain for p in got):
        got += dollar.publishes(1, max(0.0, deadline - time.monotonic()))
    assert custom in topics(got)
    assert all(t.startswith("$") for t in topics(got))

    # A live $SYS update went out after both subscribed; the wildcard subscriber saw only the marker.
    pub.publish(marker, b"m2", qos=1)
    seen = wild.publishes(2)
    assert [(p.topic, p.payload) for p in seen] == [(marker, b"m"), (marker, b"m2")]


# ---------------------------------------------------------------------------------------------- SUBACK / UNSUBACK


def test_mqtt_3_8_4_6_v5_suback_one_reason_code_per_filter_0x8f_for_invalid(raw: Open, uid: str) -> None:
    """[MQTT-3.8.4-1] [MQTT-3.8.4-2] [MQTT-3.8.4-5] [MQTT-3.8.4-6] [MQTT-3.8.4-7] [MQTT-3.9.3-1]
    [MQTT-3.9.3-2] (5.0): one SUBACK with the SUBSCRIBE's Packet Identifier and one reason code per filter in
    order: the granted QoS, or 0x8F Topic Filter invalid for ``a/#/b`` and ``a+``; valid filters take effect."""
    sub = raw(f"{uid}-s")
    codes = sub.subscribe(Subscription(f"{uid}/a", 2), Subscription(f"{uid}/a/#/b", 1), Subscription(f"{uid}/b", 0),
                          Subscription(f"{uid}/c", 1), Subscription(f"{uid}/a+", 0), pid=0x4242)
    assert codes == [0x02, 0x8F, 0x00, 0x01, 0x8F]
    pub = raw(f"{uid}-p")
    pub.publish(f"{uid}/c", b"x", qos=2)
    [msg] = sub.publishes(1)
    assert (msg.topic, msg.qos, msg.payload) == (f"{uid}/c", 1, b"x")


def test_mqtt_3_8_4_5_v311_suback_one_return_code_per_filter_0x80_for_invalid(raw: Open, uid: str) -> None:
    """[MQTT-3.8.4-1] [MQTT-3.8.4-2] [MQTT-3.8.4-4] [MQTT-3.8.4-5] [MQTT-3.9.3-1] [MQTT-3.9.3-2] (3.1.1): one
    SUBACK with the same Packet Identifier, one return code per filter in order (granted QoS or 0x80 Failure)."""
    sub = raw(f"{uid}-s", V311)
    codes = sub.subscribe(Subscription(f"{uid}/a", 2), Subscription(f"{uid}/a/#/b", 1), Subscription(f"{uid}/b", 0),
                          Subscription(f"{uid}/c", 1), Subscription(f"{uid}/a+", 0), pid=0xBEEF)
    assert codes == [0x02, 0x80, 0x00, 0x01, 0x80]
    pub = raw(f"{uid}-p", V311)
    pub.publish(f"{uid}/b", b"y", qos=1)
    [msg] = sub.publishes(1)
    assert (msg.topic, msg.qos, msg.payload) == (f"{uid}/b", 0, b"y")


@VERSIONS
def test_mqtt_3_8_4_3_subscribe_again_replaces_subscription(raw: Open, uid: str, version: int) -> None:
    """[MQTT-3.8.4-3]: a SUBSCRIBE with the filter of an existing subscription replaces it (new QoS, one copy
    per message); the retained message is sent again (3.1.1 [MQTT-3.8.4-3], 5.0 [MQTT-3.8.4-4])."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p", version)
    pub.publish(topic, b"r", qos=1, retain=True)
    sub = raw(f"{uid}-s", version)
    assert sub.subscribe(Subscription(topic, 0)) == [0]
    [retained] = sub.publishes(1)
    assert (retained.payload, retained.retain, retained.qos) == (b"r", True, 0)
    pub.publish(topic, b"one", qos=2)
    [msg] = sub.publishes(1)
    assert (msg.payload, msg.qos) == (b"one", 0)

    assert sub.subscribe(Subscription(topic, 2)) == [2]
    [retained] = sub.publishes(1)
    assert (retained.payload, retained.retain, retained.qos) == (b"r", True, 1)
    pub.publish(topic, b"two", qos=2)
    pub.publish(topic, b"three", qos=1)
    got = sub.publishes(2)
    assert [(p.payload, p.qos, p.retain) for p in got] == [(b"two", 2, False), (b"three", 1, False)]
    pub.publish(topic, b"", qos=1, retain=True)  # clear the retained message
    [cleared] = sub.publishes(1)
    assert cleared.payload == b""


def test_mqtt_3_8_4_3_v5_replacing_subscription_replaces_its_identifier(raw: Open, uid: str) -> None:
    """[MQTT-3.8.4-3] (5.0): the replacing SUBSCRIBE's Subscription Identifier (or its absence) replaces the
    old one (MQTT 5.0 §3.8.2.1.2); one copy per message."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s")
    pub = raw(f"{uid}-p")
    assert sub.subscribe(Subscription(topic, 1), sub_id=5) == [1]
    pub.publish(topic, b"a", qos=1)
    assert sub.subscribe(Subscription(topic, 1), sub_id=6) == [1]
    pub.publish(topic, b"b", qos=1)
    assert sub.subscribe(Subscription(topic, 1)) == [1]
    pub.publish(topic, b"c", qos=1)
    got = sub.publishes(3)
    assert [(p.payload, p.properties.get(P.SUBSCRIPTION_IDENTIFIER)) for p in got] == [
        (b"a", [5]), (b"b", [6]), (b"c", None)]
    assert sub.quiet(0.2) == []


def test_mqtt_3_10_4_4_v311_unsuback_same_packet_id_and_messages_stop(raw: Open, uid: str) -> None:
    """[MQTT-3.10.4-1] [MQTT-3.10.4-2] [MQTT-3.10.4-4] [MQTT-3.10.4-5] (3.1.1): UNSUBACK carries the
    UNSUBSCRIBE's Packet Identifier, also when nothing matched; afterwards no more messages for that filter."""
    sub = raw(f"{uid}-s", V311)
    marker = f"{uid}/marker"
    assert sub.subscribe(f"{uid}/a", marker) == [2, 2]
    pub = raw(f"{uid}-p", V311)
    pub.publish(f"{uid}/a", b"before", qos=1)
    [msg] = sub.publishes(1)
    assert msg.payload == b"before"
    assert sub.unsubscribe(f"{uid}/a") == []
    assert sub.unsubscribe(f"{uid}/never-subscribed") == []
    pub.publish(f"{uid}/a", b"after", qos=1)
    pub.publish(marker, b"m", qos=1)
    assert sub.until(marker) == []


def test_mqtt_3_11_3_1_v5_unsuback_reason_codes_0x00_and_0x11(raw: Open, uid: str) -> None:
    """[MQTT-3.10.4-2] [MQTT-3.10.4-5] [MQTT-3.10.4-6] [MQTT-3.11.3-1] [MQTT-3.11.3-2] (5.0): one UNSUBACK with
    the Packet Identifier and, in order, 0x00 Success or 0x11 No subscription existed; the messages stop."""
    sub = raw(f"{uid}-s")
    marker = f"{uid}/marker"
    assert sub.subscribe(f"{uid}/a", f"{uid}/b/+", marker) == [2, 2, 2]
    assert sub.unsubscribe(f"{uid}/b/+", f"{uid}/nothing", f"{uid}/a", f"{uid}/b/#") == [0x00, 0x11, 0x00, 0x11]
    assert sub.unsubscribe(f"{uid}/a") == [0x11]
    pub = raw(f"{uid}-p")
    # Nobody else subscribes to these topics: 0x10 No matching subscribers proves the subscriptions are gone.
    assert pub.publish(f"{uid}/a", b"x", qos=1) == 0x10
    assert pub.publish(f"{uid}/b/c", b"x", qos=1) == 0x10
    pub.publish(marker, b"m", qos=1)
    assert sub.until(marker) == []


@VERSIONS
def test_mqtt_3_11_3_2_unsuback_0x8f_for_an_invalid_topic_filter_and_the_connection_stays(raw: Open, uid: str,
                                                                                          version: int) -> None:
    """[MQTT-3.11.3-2] (5.0) and MQTT 5.0 §3.11.3: an UNSUBSCRIBE Topic Filter no SUBSCRIBE could have made
    ('#' not last or not alone [MQTT-4.7.1-2], '+' sharing a level [MQTT-4.7.1-3], a broken Shared Subscription
    [MQTT-4.8.2-1] [MQTT-4.8.2-2]) gets 0x8F Topic Filter invalid, as SUBACK does, beside 0x00 and 0x11 for the
    valid ones, in order; nothing is deleted by it and the connection stays. 3.1.1 (MQTT-3.10.4-4, MQTT-3.10.4-5):
    the UNSUBACK, which has no codes, and the connection stays too."""
    sub = raw(f"{uid}-s", version)
    marker = f"{uid}/marker"
    assert sub.subscribe(f"{uid}/a", marker) == [2, 2]
    filters = ["#/test/topic", f"{uid}/a", f"{uid}/b+", "$share//x", "$share/g/#/x", "$share/g", f"{uid}/nothing"]
    expected = [0x8F, 0x00, 0x8F, 0x8F, 0x8F, 0x8F, 0x11] if version == V5 else []
    assert sub.unsubscribe(*filters) == expected
    pub = raw(f"{uid}-p", version)
    pub.publish(f"{uid}/a", b"gone", qos=1)
    pub.publish(marker, b"m", qos=1)
    assert sub.until(marker) == []  # the valid filter was unsubscribed; the connection is still served
    assert sub.unsubscribe(marker) == ([0x00] if version == V5 else [])


@PAHO_VERSIONS
def test_mqtt_3_10_4_2_paho_no_messages_after_unsubscribe(paho: Callable[..., PahoClient], uid: str,
                                                          protocol: mqtt.MQTTProtocolVersion) -> None:
    """[MQTT-3.10.4-2]: after UNSUBSCRIBE (paho-mqtt) no new messages are delivered for that filter."""
    sub = paho(f"{uid}-s", protocol)
    pub = paho(f"{uid}-p", protocol)
    assert sub.subscribe(f"{uid}/t", 1) == [1]
    assert sub.subscribe(f"{uid}/marker", 1) == [1]
    pub.publish(f"{uid}/t", b"before", 1)
    assert sub.get().payload == b"before"
    expected_unsuback = [] if protocol == mqtt.MQTTv311 else [0]
    assert sub.unsubscribe(f"{uid}/t") == expected_unsuback
    pub.publish(f"{uid}/t", b"after", 1)
    pub.publish(f"{uid}/marker", b"m", 1)
    msg = sub.get()
    assert (msg.topic, msg.payload) == (f"{uid}/marker", b"m")


# ---------------------------------------------------------------------------------------------- subscription options


def test_mqtt_3_8_3_3_no_local_not_forwarded_to_publisher(raw: Open, uid: str) -> None:
    """[MQTT-3.8.3-3] (5.0): with No Local = 1 the client's own messages are not forwarded to it; messages of
    other clients are, and a client without No Local gets its own."""
    topic = f"{uid}/t"
    local = raw(f"{uid}-nl")
    assert local.subscribe(Subscription(topic, 1, no_local=True)) == [1]
    echo = raw(f"{uid}-echo")
    assert echo.subscribe(Subscription(topic, 1)) == [1]
    other = raw(f"{uid}-other")
    local.publish(topic, b"own", qos=1)
    echo.publish(topic, b"echo-own", qos=1)
    other.publish(topic, b"other", qos=1)
    assert [p.payload for p in local.publishes(2)] == [b"echo-own", b"other"]
    assert [p.payload for p in echo.publishes(3)] == [b"own", b"echo-own", b"other"]
    # Nothing more: the "own" message would have arrived before "echo-own".
    assert local.quiet(0.2) == []
    # Also when the No Local subscription is the topic's only one.
    alone, marker = f"{uid}/alone", f"{uid}/marker"
    assert local.subscribe(Subscription(alone, 1, no_local=True), Subscription(marker, 0)) == [1, 0]
    local.publish(alone, b"own-alone", qos=1)
    other.publish(marker, b"m")
    assert local.until(marker) == []
    other.publish(alone, b"other-alone", qos=1)
    [msg] = local.publishes(1)
    assert msg.payload == b"other-alone"


def test_mqtt_3_3_1_12_and_3_3_1_13_retain_as_published(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-12] [MQTT-3.3.1-13] (5.0): Retain As Published 0 clears RETAIN on forwarded messages,
    Retain As Published 1 keeps it as published."""
    topic = f"{uid}/t"
    rap0 = raw(f"{uid}-rap0")
    rap1 = raw(f"{uid}-rap1")
    assert rap0.subscribe(Subscription(topic, 1, retain_as_published=False)) == [1]
    assert rap1.subscribe(Subscription(topic, 1, retain_as_published=True)) == [1]
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"kept", qos=1, retain=True)
    pub.publish(topic, b"plain", qos=1, retain=False)
    assert [(p.payload, p.retain) for p in rap0.publishes(2)] == [(b"kept", False), (b"plain", False)]
    assert [(p.payload, p.retain) for p in rap1.publishes(2)] == [(b"kept", True), (b"plain", False)]
    pub.publish(topic, b"", qos=1, retain=True)


def test_mqtt_3_3_1_9_retain_handling_0_sends_retained_on_every_subscribe(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-9] [MQTT-3.8.4-4] (5.0): Retain Handling 0 sends the matching retained messages at every
    SUBSCRIBE, new or replacing, with RETAIN = 1."""
    pub = raw(f"{uid}-p")
    pub.publish(f"{uid}/a", b"ra", qos=1, retain=True)
    pub.publish(f"{uid}/b", b"rb", qos=1, retain=True)
    sub = raw(f"{uid}-s")
    for _ in range(2):
        assert sub.subscribe(Subscription(f"{uid}/+", 1, retain_handling=0)) == [1]
        got = sub.publishes(2)
        assert sorted((p.topic, p.payload, p.retain) for p in got) == [(f"{uid}/a", b"ra", True),
                                                                      (f"{uid}/b", b"rb", True)]


def test_mqtt_3_3_1_10_retain_handling_1_only_for_new_subscription(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-10] (5.0): Retain Handling 1 sends retained messages only when the subscription did not
    already exist."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"r", qos=1, retain=True)
    sub = raw(f"{uid}-s")
    assert sub.subscribe(marker) == [2]
    assert sub.subscribe(Subscription(topic, 1, retain_handling=1)) == [1]
    [first] = sub.publishes(1)
    assert (first.topic, first.payload, first.retain) == (topic, b"r", True)
    assert sub.subscribe(Subscription(topic, 1, retain_handling=1)) == [1]
    pub.publish(marker, b"m")
    assert sub.until(marker) == []


def test_mqtt_3_3_1_11_retain_handling_2_never_sends_retained(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-11] (5.0): Retain Handling 2 sends no retained messages at SUBSCRIBE; live ones still flow."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"r", qos=1, retain=True)
    sub = raw(f"{uid}-s")
    assert sub.subscribe(Subscription(marker, 0), Subscription(topic, 1, retain_handling=2)) == [0, 1]
    pub.publish(marker, b"m")
    assert sub.until(marker) == []
    pub.publish(topic, b"live", qos=1)
    [msg] = sub.publishes(1)
    assert (msg.payload, msg.retain) == (b"live", False)


def test_mqtt_3_3_4_3_and_3_3_4_4_overlapping_subscriptions_one_copy_with_both_identifiers(raw: Open,
                                                                                         uid: str) -> None:
    """[MQTT-3.3.4-2] [MQTT-3.3.4-3] [MQTT-3.3.4-4] (5.0): with overlapping subscriptions with identifiers 7 and
    9 the client gets one copy at the highest QoS carrying both identifiers; a subscription without one adds
    none, and a single match carries its own identifier (also on retained messages sent at SUBSCRIBE)."""
    sub = raw(f"{uid}-s")
    assert sub.subscribe(Subscription(f"{uid}/a/+", 0), sub_id=7) == [0]
    assert sub.subscribe(Subscription(f"{uid}/a/#", 2), sub_id=9) == [2]
    assert sub.subscribe(Subscription(f"{uid}/+/b", 1)) == [1]
    pub = raw(f"{uid}-p")
    pub.publish(f"{uid}/a/b", b"both", qos=2)
    pub.publish(f"{uid}/a/b/c", b"deep", qos=2)
    pub.publish(f"{uid}/x/b", b"none", qos=2)
    both, deep, none = sub.publishes(3)
    assert (both.topic, both.qos) == (f"{uid}/a/b", 2)
    assert sorted(both.properties[P.SUBSCRIPTION_IDENTIFIER]) == [7, 9]
    assert (deep.topic, deep.qos, deep.properties[P.SUBSCRIPTION_IDENTIFIER]) == (f"{uid}/a/b/c", 2, [9])
    assert (none.topic, none.qos) == (f"{uid}/x/b", 1)
    assert P.SUBSCRIPTION_IDENTIFIER not in none.properties

    pub.publish(f"{uid}/r/q", b"ret", qos=1, retain=True)
    assert sub.subscribe(Subscription(f"{uid}/r/+", 1), sub_id=268435455) == [1]
    [retained] = sub.publishes(1)
    assert (retained.payload, retained.retain) == (b"ret", True)
    assert retained.properties[P.SUBSCRIPTION_IDENTIFIER] == [268435455]
    pub.publish(f"{uid}/r/q", b"", qos=1, retain=True)


def test_mqtt_3_3_4_5_separate_copies_carry_their_own_identifier(raw: Open, uid: str) -> None:
    """[MQTT-3.3.4-5] (5.0): when a message goes to a client as separate copies (here a normal and a shared
    subscription of the same client), each copy carries the identifier of its own subscription."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s")
    assert sub.subscribe(Subscription(topic, 1), sub_id=3) == [1]
    assert sub.subscribe(Subscription(f"$share/g/{topic}", 1), sub_id=4) == [1]
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"x", qos=1)
    got = sub.publishes(2)
    assert sorted(p.properties[P.SUBSCRIPTION_IDENTIFIER] for p in got) == [[3], [4]]
    assert [p.payload for p in got] == [b"x", b"x"]


def test_mqtt_3_3_5_1_v311_overlapping_subscriptions_deliver_once_at_max_qos(raw: Open, uid: str) -> None:
    """[MQTT-3.3.5-1] (3.1.1): overlapping subscriptions deliver the message once, at the highest granted QoS
    of the matching subscriptions (then capped by the published QoS)."""
    sub = raw(f"{uid}-s", V311)
    marker = f"{uid}/marker"
    assert sub.subscribe(Subscription(f"{uid}/a/#", 0), Subscription(f"{uid}/a/+", 2),
                         Subscription(f"{uid}/+/b", 1), Subscription(marker, 0)) == [0, 2, 1, 0]
    pub = raw(f"{uid}-p", V311)
    pub.publish(f"{uid}/a/b", b"q2", qos=2)
    pub.publish(f"{uid}/a/b", b"q1", qos=1)
    pub.publish(f"{uid}/a/c/d", b"deep", qos=2)
    pub.publish(marker, b"m")
    got = sub.until(marker)
    assert [(p.payload, p.qos) for p in got] == [(b"q2", 2), (b"q1", 1), (b"deep", 0)]


def test_mqtt_3_3_4_2_v5_overlapping_subscriptions_deliver_once_at_max_qos(raw: Open, uid: str) -> None:
    """[MQTT-3.3.4-2] (5.0): overlapping subscriptions of one client deliver one copy at the maximum QoS."""
    sub = raw(f"{uid}-s")
    marker = f"{uid}/marker"
    assert sub.subscribe(Subscription(f"{uid}/#", 1), Subscription(f"{uid}/a", 0), Subscription(marker, 0)) == [
        1, 0, 0]
    pub = raw(f"{uid}-p")
    pub.publish(f"{uid}/a", b"x", qos=2)
    pub.publish(marker, b"m")
    got = sub.until(marker)
    assert [(p.payload, p.qos) for p in got] == [(b"x", 1)]


# ---------------------------------------------------------------------------------------------- shared subscriptions


def test_mqtt_4_8_2_shared_subscription_distributes_each_message_to_one_member(raw: Open, uid: str) -> None:
    """MQTT 5.0 §4.8.2: each message matching ``$share/<group>/<filter>`` goes to exactly one member of the
    group (both members get some of 20), while a normal subscriber of the filter gets all of them. The
    members are a 5.0 and a 3.1.1 client."""
    topic = f"{uid}/t"
    members = [raw(f"{uid}-m5", V5), raw(f"{uid}-m4", V311)]
    for member in members:
        assert member.subscribe(Subscription(f"$share/grp/{uid}/+", 1)) == [1]
    normal = raw(f"{uid}-normal")
    assert normal.subscribe(Subscription(f"{uid}/+", 1)) == [1]
    pub = raw(f"{uid}-p")
    for i in range(20):
        assert pub.publish(topic, str(i).encode(), qos=1) == 0

    assert [p.payload for p in normal.publishes(20)] == [str(i).encode() for i in range(20)]
    received: list[list[bytes]] = [[], []]
    deadline = time.monotonic() + 5
    while sum(map(len, received)) < 20 and time.monotonic() < deadline:
        for member, got in zip(members, received, strict=True):
            try:
                got += [p.payload for p in member.publishes(1, timeout=0.05)]
            except TimeoutError:
                pass
    late = [p for m in members for p in m.quiet(0.2) if isinstance(p, Publish)]
    assert late == []
    assert sorted(received[0] + received[1], key=int) == [str(i).encode() for i in range(20)]
    assert received[0] and received[1]

    # A member that unsubscribes leaves the group: the other one gets everything.
    assert members[0].unsubscribe(f"$share/grp/{uid}/+") == [0x00]
    for i in range(4):
        pub.publish(topic, b"after %d" % i, qos=1)
    assert [p.payload for p in members[1].publishes(4)] == [b"after %d" % i for i in range(4)]
    assert [p.payload for p in normal.publishes(4)] == [b"after %d" % i for i in range(4)]
    assert members[0].quiet(0.2) == []


def test_mqtt_4_8_2_shared_subscription_gets_no_retained_messages(raw: Open, uid: str) -> None:
    """MQTT 5.0 §3.3.1.3/§4.8.2: retained messages are sent to new non-shared subscriptions only, so a shared
    SUBSCRIBE gets none while a normal SUBSCRIBE of the same filter does."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"r", qos=1, retain=True)
    member = raw(f"{uid}-m")
    assert member.subscribe(Subscription(marker, 0), Subscription(f"$share/g/{topic}", 1)) == [0, 1]
    pub.publish(marker, b"m")
    assert member.until(marker) == []
    normal = raw(f"{uid}-n")
    assert normal.subscribe(Subscription(topic, 1)) == [1]
    [retained] = normal.publishes(1)
    assert (retained.payload, retained.retain) == (b"r", True)
    pub.publish(topic, b"", qos=1, retain=True)


@pytest.mark.parametrize(("version", "failure"), [(V311, 0x80), (V5, 0x8F)], ids=["v311", "v5"])
def test_mqtt_4_8_2_1_and_4_8_2_2_invalid_share_names_refused(raw: Open, uid: str, version: int,
                                                              failure: int) -> None:
    """[MQTT-4.8.2-1] [MQTT-4.8.2-2] (5.0): a ShareName must be at least one character, hold no ``+``/``#``
    and be followed by ``/`` and a Topic Filter; otherwise the filter is refused (0x8F, 3.1.1: 0x80) while the
    valid filters of the same SUBSCRIBE are granted."""
    sub = raw(f"{uid}-s", version)
    codes = sub.subscribe(
        Subscription("$share/a+b/x", 1),
        Subscription("$share//x", 1),
        Subscription("$share/g", 1),
        Subscription("$share/g/", 1),
        Subscription("$share/a#b/x", 1),
        Subscription(f"$share/ok/{uid}/x", 1),
        Subscription("$share/g/a/#/b", 1),
    )
    assert codes == [failure, failure, failure, failure, failure, 1, failure]


def test_mqtt_3_8_3_4_no_local_on_shared_subscription_is_protocol_error(raw: Open, uid: str) -> None:
    """[MQTT-3.8.3-4] (5.0): No Local = 1 on a Shared Subscription is a Protocol Error: the broker sends
    DISCONNECT 0x82 and closes the connection (MQTT 5.0 §4.13)."""
    sub = raw(f"{uid}-s")
    sub.send(Subscribe(1, [Subscription(f"$share/g/{uid}/t", 1, no_local=True)]))
    packet = sub.client.recv()
    assert isinstance(packet, Disconnect)
    assert packet.reason_code == 0x82
    assert sub.client.closed_by_server()


# ---------------------------------------------------------------------------------------------- PUBLISH QoS 0/1/2


@PAHO_VERSIONS
def test_paho_publish_and_receive_qos_0_1_2(paho: Callable[..., PahoClient], uid: str,
                                            protocol: mqtt.MQTTProtocolVersion) -> None:
    """paho-mqtt (3.1.1 and 5.0) publishes at QoS 0, 1 and 2 (each flow completes) and receives each at the
    published QoS through a QoS 2 subscription (MQTT 5.0 §4.3)."""
    sub = paho(f"{uid}-s", protocol)
    pub = paho(f"{uid}-p", protocol)
    assert sub.subscribe(f"{uid}/#", 2) == [2]
    for qos in (0, 1, 2):
        pub.publish(f"{uid}/q{qos}", f"paho {qos}".encode(), qos)
    got = [sub.get() for _ in range(3)]
    assert [(m.topic, m.payload, m.qos, m.retain) for m in got] == [
        (f"{uid}/q{q}", f"paho {q}".encode(), q, False) for q in (0, 1, 2)
    ]


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5], ids=["v311", "v5"])
async def test_aiomqtt_publish_and_receive_qos_0_1_2(broker: BrokerProcess, uid: str,
                                                     protocol: aiomqtt.ProtocolVersion) -> None:
    """aiomqtt (3.1.1 and 5.0) publishes at QoS 0, 1 and 2 and receives each at the published QoS through a
    QoS 2 subscription (MQTT 5.0 §4.3)."""
    async with (
        aiomqtt.Client("127.0.0.1", broker.port, identifier=f"{uid}-s", protocol=protocol) as sub,
        aiomqtt.Client("127.0.0.1", broker.port, identifier=f"{uid}-p", protocol=protocol) as pub,
    ):
        granted = await sub.subscribe(f"{uid}/#", qos=2)
        assert [getattr(g, "value", g) for g in granted] == [2]
        for qos in (0, 1, 2):
            await pub.publish(f"{uid}/q{qos}", f"aio {qos}".encode(), qos=qos)
        got = []
        async with asyncio.timeout(5):
            async for message in sub.messages:
                got.append((str(message.topic), message.payload, message.qos, message.retain))
                if len(got) == 3:
                    break
    assert got == [(f"{uid}/q{q}", f"aio {q}".encode(), q, False) for q in (0, 1, 2)]


class MosquittoSub:
    """``mosquitto_sub -d`` in the background (line-buffered through ``stdbuf`` so that its "received SUBACK"
    shows before exit); its stdout lines are read on a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(["stdbuf", "-oL", "mosquitto_sub", "-d", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if predicate(line):
                return line

    def close(self) -> int:
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(2)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_pub_and_sub_qos_0_1_2(broker: BrokerProcess, uid: str, version: str) -> None:
    """mosquitto_pub publishes at QoS 0, 1 and 2 and mosquitto_sub (QoS 2 subscription) receives each at the
    published QoS, RETAIN 0 (MQTT 5.0 §4.3), for 3.1.1 and 5.0."""
    port = str(broker.port)
    sub = MosquittoSub(["-h", "127.0.0.1", "-p", port, "-V", version, "-q", "2", "-t", f"{uid}/#", "-C", "3",
                        "-W", "10", "-F", "MSG %t|%q|%r|%p"])
    try:
        sub.wait_for(lambda line: "received SUBACK" in line)
        for qos in (0, 1, 2):
            subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-V", version, "-q", str(qos),
                            "-t", f"{uid}/q{qos}", "-m", f"mosq {qos}"], check=True, timeout=10)
        got = [sub.wait_for(lambda line: line.startswith("MSG ")) for _ in range(3)]
    finally:
        code = sub.close()
    assert got == [f"MSG {uid}/q{q}|{q}|0|mosq {q}" for q in (0, 1, 2)]
    assert code == 0


@pytest.mark.parametrize(("pub_qos", "sub_qos"), [(p, s) for p in (0, 1, 2) for s in (0, 1, 2)])
def test_mqtt_3_8_4_8_v5_delivered_qos_is_min_of_publish_and_subscription(raw: Open, uid: str, pub_qos: int,
                                                                        sub_qos: int) -> None:
    """[MQTT-3.8.4-8] (5.0): delivered QoS = min(publish QoS, subscription QoS)."""
    sub = raw(f"{uid}-s")
    assert sub.subscribe(Subscription(f"{uid}/t", sub_qos)) == [sub_qos]
    pub = raw(f"{uid}-p")
    assert pub.publish(f"{uid}/t", b"x", qos=pub_qos) == 0
    [msg] = sub.publishes(1)
    assert (msg.qos, msg.dup, msg.payload) == (min(pub_qos, sub_qos), False, b"x")
    assert (msg.packet_id is None) == (msg.qos == 0)


@pytest.mark.parametrize(("pub_qos", "sub_qos"), [(p, s) for p in (0, 1, 2) for s in (0, 1, 2)])
def test_mqtt_3_8_4_6_v311_delivered_qos_is_min_of_publish_and_subscription(raw: Open, uid: str, pub_qos: int,
                                                                          sub_qos: int) -> None:
    """[MQTT-3.8.4-6] (3.1.1): delivered QoS = min(publish QoS, subscription QoS)."""
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(Subscription(f"{uid}/t", sub_qos)) == [sub_qos]
    pub = raw(f"{uid}-p", V311)
    pub.publish(f"{uid}/t", b"x", qos=pub_qos)
    [msg] = sub.publishes(1)
    assert (msg.qos, msg.dup, msg.payload) == (min(pub_qos, sub_qos), False, b"x")
    assert (msg.packet_id is None) == (msg.qos == 0)


def _qos2_receiver_flow(raw: Open, uid: str, version: int) -> None:
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    sub = raw(f"{uid}-s", version)
    assert sub.subscribe(topic, marker) == [2, 2]
    pub = raw(f"{uid}-p", version)
    pub.send(Publish(topic, b"once", 2, False, False, 10))
    assert pub.expect(PubRec, timeout=2) == PubRec(10)  # PUBREC at once
    # A re-sent PUBLISH (DUP=1) with the pending identifier: PUBREC again, and a duplicate that is discarded, not a new
    # message. Its payload differs only so that the test can tell which copy was kept.
    pub.send(Publish(topic, b"re-sent", 2, False, True, 10))
    assert pub.expect(PubRec, timeout=2) == PubRec(10)
    # Nothing is delivered before PUBREL (the marker, QoS 0 from another client, overtakes nothing).
    raw(f"{uid}-m", version).publish(marker, b"m1")
    assert sub.until(marker) == []
    pub.send(PubRel(10))
    assert pub.expect(PubComp) == PubComp(10)
    [msg] = sub.publishes(1)
    assert (msg.topic, msg.payload, msg.qos) == (topic, b"once", 2)
    raw(f"{uid}-m2", version).publish(marker, b"m2")
    assert sub.until(marker) == []  # delivered exactly once
    # After PUBCOMP the identifier starts a new message.
    pub.send(Publish(topic, b"again", 2, False, False, 10))
    assert pub.expect(PubRec) == PubRec(10)
    pub.send(PubRel(10))
    assert pub.expect(PubComp) == PubComp(10)
    [msg] = sub.publishes(1)
    assert msg.payload == b"again"


def test_mqtt_4_3_3_10_v5_qos2_receiver_dedups_and_delivers_on_pubrel(raw: Open, uid: str) -> None:
    """[MQTT-4.3.3-8] [MQTT-4.3.3-10] [MQTT-4.3.3-11] [MQTT-4.3.3-12] (5.0): as QoS 2 receiver the
    broker answers PUBREC at once, treats a DUP re-send of the pending identifier as a duplicate, delivers only
    on PUBREL, answers PUBCOMP, and then treats the identifier as new. The repeat is discarded: the first
    copy is the one delivered."""
    _qos2_receiver_flow(raw, uid, V5)


def test_mqtt_4_3_3_2_v311_qos2_receiver_dedups_and_delivers_on_pubrel(raw: Open, uid: str) -> None:
    """[MQTT-4.3.3-2] (3.1.1): the QoS 2 receiver flow of the 5.0 test above, on 3.1.1."""
    _qos2_receiver_flow(raw, uid, V311)


@pytest.mark.parametrize("version", [V31, V311, V5], ids=["v31", "v311", "v5"])
def test_mqtt_3_1_pubrel_with_dup_after_reconnect_completes_the_qos2_flow(raw: Open, uid: str, version: int) -> None:
    """MQTT 3.1 §2.1 (DUP is set when a PUBREL is re-sent) and §3.6, beside 3.1.1 MQTT-3.6.1-1 / MQTT-4.3.3-2 and
    5.0 [MQTT-3.6.1-1] / [MQTT-4.3.3-11]: a persistent publisher loses its connection after PUBREC, reconnects,
    re-sends the PUBLISH with DUP (PUBREC again) and sends PUBREL (PUBCOMP); it loses that connection too, as if
    PUBCOMP had not arrived, reconnects and re-sends PUBREL: a 3.1 client with DUP (0x6A), a 3.1.1 or 5.0 client
    as 0x62, the only PUBREL they have [MQTT-2.1.3-1]. Each gets PUBCOMP (5.0: 0x92, the identifier was
    released), so the flow finishes, and the subscriber gets the message exactly once. At 3.1.1 and 5.0 a PUBREL
    with DUP is still a Malformed Packet (5.0 DISCONNECT 0x81, then the close)."""
    topic, marker = f"{uid}/t", f"{uid}/marker"
    cid = f"pubrel{version}-{time.monotonic_ns() % 10**12}"  # MQTT 3.1: at most 23 characters
    session: dict[str, Any] = {"properties": {P.SESSION_EXPIRY_INTERVAL: 300}} if version == V5 else {}
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(topic, marker) == [2, 2]

    pub = raw(cid, version, clean_start=False, **session)
    pub.send(Publish(topic, b"once", 2, False, False, 1))
    assert pub.expect(PubRec) == PubRec(1)
    pub.client.close()  # the connection is lost after PUBREC
    pub = raw(cid, version, clean_start=False, **session)
    pub.send(Publish(topic, b"once", 2, False, True, 1))  # the PUBLISH again, DUP=1
    assert pub.expect(PubRec) == PubRec(1)
    pub.send(PubRel(1))
    assert pub.expect(PubComp) == PubComp(1)
    pub.client.close()  # ... and again after PUBCOMP, which the client counts as lost
    pub = raw(cid, version, clean_start=False, **session)
    resent = b"\x6a" if version == V31 else b"\x62"
    pub.send(resent + b"\x02\x00\x01")  # PUBREL, Packet Identifier 1, re-sent
    assert pub.expect(PubComp) == PubComp(1, 0x92 if version == V5 else 0)

    [msg] = sub.publishes(1)
    assert (msg.topic, msg.payload) == (topic, b"once")
    raw(f"{uid}-m", V311).publish(marker, b"m")
    assert sub.until(marker) == []  # delivered exactly once

    if version == V31:
        pub.send(PingReq())
        assert pub.expect(PingResp) == PingResp()  # the connection goes on
    else:
        pub.send(b"\x6a\x02\x00\x01")
        assert pub.client.closed_by_server()
        after = pub.client.recv_all(0.05)
        codes = [p.reason_code for p in after if isinstance(p, Disconnect)]
        assert (codes, len(after)) == (([0x81], 1) if version == V5 else ([], 0)), after
    raw(cid, version).disconnect()  # Clean Session / Clean Start 1: the session is discarded


def test_mqtt_3_1_subscribe_and_unsubscribe_resent_with_dup_are_answered(raw: Open, uid: str) -> None:
    """MQTT 3.1 §2.1 (DUP is set when a SUBSCRIBE or UNSUBSCRIBE is re-sent), §3.8, §3.10: a 3.1 client's
    SUBSCRIBE (0x8A) and UNSUBSCRIBE (0xAA) with DUP get their SUBACK and UNSUBACK, and the subscription works in
    between; a flag 3.1 calls "not used" is still checked: a PUBACK with DUP (0x48) closes the connection."""
    topic = f"{uid}/t"
    c = raw(f"dup31-{time.monotonic_ns() % 10**12}", V31)
    body = Subscribe(7, [Subscription(topic, 1)]).encode(V31)
    c.send(b"\x8a" + body[1:])
    assert c.expect(Suback) == Suback(7, [1])
    raw(f"{uid}-p", V311).publish(topic, b"hello", qos=1)
    [msg] = c.publishes(1)
    assert (msg.topic, msg.payload, msg.qos) == (topic, b"hello", 1)
    body = Unsubscribe(8, [topic]).encode(V31)
    c.send(b"\xaa" + body[1:])
    assert c.expect(Unsuback) == Unsuback(8)
    c.send(b"\x48\x02\x00\x09")
    assert c.client.closed_by_server()


@pytest.mark.parametrize(("version", "reason"), [(V311, 0), (V5, 0x92)], ids=["v311", "v5"])
def test_pubrel_for_unknown_packet_id_still_gets_pubcomp(raw: Open, uid: str, version: int, reason: int) -> None:
    """MQTT 5.0 §3.7.2.1 and docs/architecture.md, "Session semantics": a PUBREL for an identifier the broker does not
    hold still gets a PUBCOMP (5.0 with 0x92 Packet Identifier not found); the connection stays usable."""
    c = raw(f"{uid}-c", version)
    c.send(PubRel(777))
    assert c.expect(PubComp) == PubComp(777, reason)
    # Also a second PUBREL after a completed flow.
    assert c.publish(f"{uid}/t", b"x", qos=2) in (0, 0x10)
    c.send(PubRel(1))
    assert c.expect(PubComp) == PubComp(1, reason)
    c.send(Publish(f"{uid}/t", b"y", 1, False, False, 5))
    assert c.expect(PubAck).packet_id == 5


def test_mqtt_4_3_3_4_and_4_3_3_5_broker_as_qos2_sender(raw: Open, uid: str) -> None:
    """[MQTT-4.3.3-1] [MQTT-4.3.3-2] [MQTT-4.3.3-3] [MQTT-4.3.3-4] [MQTT-4.3.3-5] (5.0): as QoS 2 sender the
    broker sends PUBLISH QoS 2 DUP 0, sends PUBREL (same identifier) only after the subscriber's PUBREC, and
    holds the message unacknowledged until PUBCOMP: with Receive Maximum 1 the next message waits for it."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s", properties={P.RECEIVE_MAXIMUM: 1})
    assert sub.subscribe(topic) == [2]
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"first", qos=2)
    pub.publish(topic, b"second", qos=2)
    first = sub.expect(Publish)
    assert (first.payload, first.qos, first.dup) == (b"first", 2, False)
    pid = first.packet_id
    assert pid is not None
    assert sub.quiet(0.3) == []  # no PUBREL without PUBREC, and the window is full
    sub.send(PubRec(pid))
    assert sub.expect(PubRel) == PubRel(pid)
    assert sub.quiet(0.3) == []  # still in flight until PUBCOMP
    sub.send(PubComp(pid))
    second = sub.expect(Publish)
    assert (second.payload, second.qos, second.dup) == (b"second", 2, False)
    assert second.packet_id is not None
    sub.send(PubRec(second.packet_id))  # type: ignore[arg-type]
    assert sub.expect(PubRel) == PubRel(second.packet_id)  # type: ignore[arg-type]
    sub.send(PubComp(second.packet_id))  # type: ignore[arg-type]


def test_mqtt_4_3_3_1_v311_broker_as_qos2_sender(raw: Open, uid: str) -> None:
    """[MQTT-4.3.3-1] (3.1.1): the broker sends PUBLISH QoS 2 DUP 0, PUBREL after PUBREC with the same Packet
    Identifier, and no PUBREL before it."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(topic) == [2]
    raw(f"{uid}-p", V311).publish(topic, b"x", qos=2)
    msg = sub.expect(Publish)
    assert (msg.payload, msg.qos, msg.dup) == (b"x", 2, False)
    assert sub.quiet(0.2) == []
    sub.send(PubRec(msg.packet_id))  # type: ignore[arg-type]
    assert sub.expect(PubRel) == PubRel(msg.packet_id)  # type: ignore[arg-type]
    sub.send(PubComp(msg.packet_id))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- retained messages


def test_mqtt_3_3_1_5_v5_retained_message_stored_and_replaced(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-5] (5.0): a retained PUBLISH replaces any retained message of the topic and is stored for
    future subscribers."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"v1", qos=1, retain=True)
    pub.publish(topic, b"v2", qos=2, retain=True)
    sub = raw(f"{uid}-s")
    assert sub.subscribe(topic) == [2]
    [msg] = sub.publishes(1)
    assert (msg.payload, msg.qos, msg.retain) == (b"v2", 2, True)
    pub.publish(topic, b"", qos=1, retain=True)
    [cleared] = sub.publishes(1)
    assert cleared.payload == b""


def test_mqtt_3_3_1_6_and_3_3_1_7_v5_empty_retained_payload_clears(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-6] [MQTT-3.3.1-7] (5.0): a retained PUBLISH with an empty payload removes the retained
    message and is not stored itself; existing subscribers still receive it."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"v1", qos=1, retain=True)
    live = raw(f"{uid}-live")
    assert live.subscribe(Subscription(topic, 1, retain_handling=2)) == [1]
    pub.publish(topic, b"", qos=1, retain=True)
    [cleared] = live.publishes(1)
    assert (cleared.payload, cleared.retain) == (b"", False)
    sub = raw(f"{uid}-s")
    assert sub.subscribe(marker, topic) == [2, 2]
    pub.publish(marker, b"m")
    assert sub.until(marker) == []


def test_mqtt_3_3_1_8_v5_non_retained_publish_leaves_retained_message(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-8] (5.0): a PUBLISH with RETAIN 0 is not stored and does not replace or remove the retained
    message (not even with an empty payload)."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"kept", qos=1, retain=True)
    pub.publish(topic, b"not retained", qos=1)
    pub.publish(topic, b"", qos=1)
    sub = raw(f"{uid}-s")
    assert sub.subscribe(topic) == [2]
    [msg] = sub.publishes(1)
    assert (msg.payload, msg.retain) == (b"kept", True)
    pub.publish(topic, b"", qos=1, retain=True)


def test_mqtt_3_3_1_5_and_3_3_1_6_v311_retained_stored_and_sent_to_new_subscription(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-5] [MQTT-3.3.1-6] [MQTT-3.3.1-8] (3.1.1): a retained message is stored with its QoS and sent
    to each new matching subscription with RETAIN = 1."""
    pub = raw(f"{uid}-p", V311)
    pub.publish(f"{uid}/a", b"ra", qos=2, retain=True)
    pub.publish(f"{uid}/b", b"rb", qos=1, retain=True)
    for i in range(2):
        sub = raw(f"{uid}-s{i}", V311)
        assert sub.subscribe(f"{uid}/#") == [2]
        got = sorted(sub.publishes(2), key=lambda p: p.topic)
        assert [(p.topic, p.payload, p.qos, p.retain) for p in got] == [
            (f"{uid}/a", b"ra", 2, True), (f"{uid}/b", b"rb", 1, True)]
    pub.publish(f"{uid}/a", b"", retain=True)
    pub.publish(f"{uid}/b", b"", retain=True)


def test_mqtt_3_3_1_7_v311_retained_qos0_replaces_previous(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-7] (3.1.1): a retained QoS 0 message discards the message previously retained for the
    topic; the new one is delivered at QoS 0."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p", V311)
    pub.publish(topic, b"old", qos=2, retain=True)
    pub.publish(topic, b"new", qos=0, retain=True)
    sub = raw(f"{uid}-s", V311)
    marker = f"{uid}/marker"
    assert sub.subscribe(topic, marker) == [2, 2]
    pub.publish(marker, b"m")
    got = sub.until(marker)
    assert [(p.payload, p.qos, p.retain) for p in got] == [(b"new", 0, True)]
    pub.publish(topic, b"", retain=True)


def test_mqtt_3_3_1_9_v311_established_subscription_gets_retain_0(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-9] (3.1.1): a message forwarded to an established subscription has RETAIN = 0, whatever
    the publisher set."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(topic) == [2]
    pub = raw(f"{uid}-p", V311)
    pub.publish(topic, b"r", qos=1, retain=True)
    pub.publish(topic, b"n", qos=1)
    assert [(p.payload, p.retain) for p in sub.publishes(2)] == [(b"r", False), (b"n", False)]
    pub.publish(topic, b"", retain=True)


def test_mqtt_3_3_1_10_and_3_3_1_11_v311_empty_retained_delivered_and_removes(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-10] [MQTT-3.3.1-11] (3.1.1): a retained PUBLISH with a zero-byte payload is delivered
    normally to current subscribers, removes the retained message and is not stored itself."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p", V311)
    pub.publish(topic, b"v1", qos=1, retain=True)
    live = raw(f"{uid}-live", V311)
    assert live.subscribe(topic) == [2]
    [retained] = live.publishes(1)
    assert retained.payload == b"v1"
    pub.publish(topic, b"", qos=1, retain=True)
    [cleared] = live.publishes(1)
    assert (cleared.topic, cleared.payload, cleared.qos, cleared.retain) == (topic, b"", 1, False)
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(topic, marker) == [2, 2]
    pub.publish(marker, b"m")
    assert sub.until(marker) == []


def test_mqtt_3_3_1_12_v311_non_retained_publish_leaves_retained_message(raw: Open, uid: str) -> None:
    """[MQTT-3.3.1-12] (3.1.1): a PUBLISH with RETAIN 0 neither stores nor removes/replaces a retained message."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p", V311)
    pub.publish(topic, b"kept", qos=1, retain=True)
    pub.publish(topic, b"", qos=1)
    pub.publish(topic, b"other", qos=1)
    sub = raw(f"{uid}-s", V311)
    assert sub.subscribe(topic) == [2]
    [msg] = sub.publishes(1)
    assert (msg.payload, msg.retain) == (b"kept", True)
    pub.publish(topic, b"", retain=True)


@VERSIONS
def test_mqtt_3_8_4_8_retained_message_delivered_at_min_qos(raw: Open, uid: str, version: int) -> None:
    """[MQTT-3.8.4-8] (5.0) / [MQTT-3.8.4-6] (3.1.1): a retained QoS 2 message is downgraded to the
    subscription's QoS when sent at SUBSCRIBE."""
    topic = f"{uid}/t"
    pub = raw(f"{uid}-p", version)
    pub.publish(topic, b"r", qos=2, retain=True)
    for sub_qos in (0, 1, 2):
        sub = raw(f"{uid}-s{sub_qos}", version)
        assert sub.subscribe(Subscription(topic, sub_qos)) == [sub_qos]
        [msg] = sub.publishes(1)
        assert (msg.payload, msg.qos, msg.retain) == (b"r", sub_qos, True)
    pub.publish(topic, b"", retain=True)


# ---------------------------------------------------------------------------------------------- message properties


def test_mqtt_3_3_2_5_retained_message_not_sent_after_expiry(raw: Open, uid: str) -> None:
    """[MQTT-3.3.2-5] (5.0): a retained message whose 1 s Message Expiry Interval has passed is no longer sent
    to new subscribers; before that it is, with the remaining interval."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    pub = raw(f"{uid}-p")
    published = time.monotonic()
    pub.publish(topic, b"short", qos=1, retain=True, props={P.MESSAGE_EXPIRY_INTERVAL: 1})
    early = raw(f"{uid}-early")
    assert early.subscribe(topic) == [2]
    [msg] = early.publishes(1)
    assert (msg.payload, msg.retain, msg.properties[P.MESSAGE_EXPIRY_INTERVAL]) == (b"short", True, 1)
    time.sleep(max(0.0, published + 1.2 - time.monotonic()))  # stays: the 1 s expiry must pass (it is tested)
    late = raw(f"{uid}-late")
    assert late.subscribe(topic, marker) == [2, 2]
    pub.publish(marker, b"m")
    assert late.until(marker) == []


def test_mqtt_3_3_2_5_queued_message_dropped_after_expiry(raw: Open, uid: str) -> None:
    """[MQTT-3.3.2-5] (5.0): a message queued for an offline persistent session whose 1 s Message Expiry
    Interval passes before delivery is not delivered; one without expiry is."""
    topic = f"{uid}/t"
    cid = f"{uid}-s"
    sub = raw(cid, clean_start=True, properties={P.SESSION_EXPIRY_INTERVAL: 60})
    assert sub.subscribe(Subscription(topic, 1)) == [1]
    sub.disconnect()
    pub = raw(f"{uid}-p")
    published = time.monotonic()
    # QoS 1 PUBACK 0x00 (not 0x10): the offline session's subscription matched.
    assert pub.publish(topic, b"expires", qos=1, props={P.MESSAGE_EXPIRY_INTERVAL: 1}) == 0
    assert pub.publish(topic, b"stays", qos=1) == 0
    time.sleep(max(0.0, published + 1.2 - time.monotonic()))  # stays: the 1 s expiry must pass (it is tested)
    again = raw(cid, clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 0})
    [msg] = again.publishes(1)
    assert msg.payload == b"stays"
    assert P.MESSAGE_EXPIRY_INTERVAL not in msg.properties
    assert again.quiet(0.2) == []


def test_mqtt_3_3_2_6_message_expiry_interval_decremented_by_time_held(raw: Open, uid: str) -> None:
    """[MQTT-3.3.2-6] (5.0): the forwarded Message Expiry Interval is the received value minus the time the
    message waited in the broker: ~2 s in an offline session's queue turn 10 into 8; a live one keeps 10."""
    topic = f"{uid}/t"
    cid = f"{uid}-s"
    sub = raw(cid, properties={P.SESSION_EXPIRY_INTERVAL: 60})
    assert sub.subscribe(Subscription(topic, 1)) == [1]
    pub = raw(f"{uid}-p")
    pub.publish(topic, b"live", qos=1, props={P.MESSAGE_EXPIRY_INTERVAL: 10})
    [live] = sub.publishes(1)
    assert (live.payload, live.properties[P.MESSAGE_EXPIRY_INTERVAL]) == (b"live", 10)
    sub.disconnect()

    before = time.monotonic()
    pub.publish(topic, b"held", qos=1, props={P.MESSAGE_EXPIRY_INTERVAL: 10})
    acked = time.monotonic()
    time.sleep(max(0.0, acked + 2.0 - time.monotonic()))  # stays: the time held is what the interval must lose
    reconnect = time.monotonic()
    again = raw(cid, clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 0})
    [held] = again.publishes(1)
    received = time.monotonic()
    assert held.payload == b"held"
    held_min, held_max = reconnect - acked, received - before
    assert 10 - math.ceil(held_max) <= held.properties[P.MESSAGE_EXPIRY_INTERVAL] <= 10 - math.floor(held_min)
    assert held.properties[P.MESSAGE_EXPIRY_INTERVAL] <= 8


@VERSIONS
def test_mqtt_3_3_2_4_and_3_3_2_15_to_20_publish_properties_forwarded_unaltered(raw: Open, uid: str,
                                                                               version: int) -> None:
    """[MQTT-3.3.2-4] [MQTT-3.3.2-15] [MQTT-3.3.2-16] [MQTT-3.3.2-17] [MQTT-3.3.2-18] [MQTT-3.3.2-20] (5.0):
    Payload Format Indicator, Response Topic, Correlation Data, User Properties (order and repeats kept) and
    Content Type reach a 5.0 subscriber unaltered; a 3.1.1 subscriber gets the same topic and payload."""
    topic = f"{uid}/t"
    sub = raw(f"{uid}-s", version)
    assert sub.subscribe(topic) == [2]
    props = {
        P.PAYLOAD_FORMAT_INDICATOR: 1,
        P.RESPONSE_TOPIC: f"{uid}/reply/ü",
        P.CORRELATION_DATA: b"\x00\xffcorr\x01",
        P.USER_PROPERTY: [("z", "1"), ("a", "2"), ("z", "3"), ("ключ", "значение"), ("", "")],
        P.CONTENT_TYPE: "application/json; charset=utf-8",
    }
    pub = raw(f"{uid}-p")
    for qos in (0, 1, 2):
        pub.publish(topic, b'{"q": %d}' % qos, qos=qos, props=props)
    got = sub.publishes(3)
    assert [(p.topic, p.payload, p.qos) for p in got] == [(topic, b'{"q": %d}' % q, q) for q in (0, 1, 2)]
    expected = props if version == V5 else {}
    assert [p.properties for p in got] == [expected] * 3


def test_paho_v5_properties_forwarded_unaltered(paho: Callable[..., PahoClient], uid: str) -> None:
    """[MQTT-3.3.2-15] [MQTT-3.3.2-16] [MQTT-3.3.2-17] [MQTT-3.3.2-18] [MQTT-3.3.2-20] (5.0) with paho-mqtt on
    both ends."""
    sub = paho(f"{uid}-s", mqtt.MQTTv5)
    pub = paho(f"{uid}-p", mqtt.MQTTv5)
    assert sub.subscribe(f"{uid}/t", 1) == [1]
    props = PahoProperties(PacketTypes.PUBLISH)
    props.ResponseTopic = f"{uid}/reply"
    props.CorrelationData = b"\x01\x02"
    props.UserProperty = [("b", "1"), ("a", "2"), ("b", "0")]
    props.ContentType = "text/plain"
    props.PayloadFormatIndicator = 1
    pub.publish(f"{uid}/t", b"hello", 1, properties=props)
    msg = sub.get()
    assert msg.payload == b"hello"
    assert msg.properties.ResponseTopic == f"{uid}/reply"
    assert msg.properties.CorrelationData == b"\x01\x02"
    assert msg.properties.UserProperty == [("b", "1"), ("a", "2"), ("b", "0")]
    assert msg.properties.ContentType == "text/plain"
    assert msg.properties.PayloadFormatIndicator == 1


def test_payload_format_indicator_with_invalid_utf8_gets_puback_0x99(raw: Open, uid: str) -> None:
    """MQTT 5.0 §3.3.2.3.2 and §3.4.2.1: a PUBLISH whose Payload Format Indicator is 1 but whose payload is not
    UTF-8 is refused with PUBACK 0x99 Payload format invalid (PUBREC 0x99 at QoS 2) and not delivered."""
    topic = f"{uid}/t"
    marker = f"{uid}/marker"
    sub = raw(f"{uid}-s")
    assert sub.subscribe(topic, marker) == [2, 2]
    pub = raw(f"{uid}-p")
    bad = {P.PAYLOAD_FORMAT_INDICATOR: 1}
    assert pub.publish(topic, b"\xff\xfe bad", qos=1, props=bad) == 0x99
    assert pub.publish(topic, b"\xc3\x28", qos=2, props=bad) == 0x99
    pub.publish(topic, b"\xed\xa0\x80", qos=0, props=bad)  # an encoded surrogate is not valid UTF-8 either
    assert pub.publish(topic, "grüße".encode(), qos=1, props=bad) == 0
    pub.publish(marker, b"m")
    assert [p.payload for p in sub.until(marker)] == ["grüße".encode()]


def test_puback_0x10_no_matching_subscribers(raw: Open, uid: str) -> None:
    """MQTT 5.0 §3.4.2.1: PUBACK 0x10 No matching subscribers when nobody subscribes to the topic, 0x00 when
    somebody does."""
    pub = raw(f"{uid}-p")
    assert pub.publish(f"{uid}/nobody", b"x", qos=1) == 0x10
    sub = raw(f"{uid}-s")
    assert sub.subscribe(f"{uid}/somebody") == [2]
    assert pub.publish(f"{uid}/somebody", b"x", qos=1) == 0x00
    [msg] = sub.publishes(1)
    assert msg.payload == b"x"


# ---------------------------------------------------------------------------------------------- $SYS


def _sys_cycle(c: Peer) -> dict[str, str]:
    """The values of one live (RETAIN 0) ``$SYS/broker/...`` publication round, keyed by name."""
    values: dict[str, str] = {}
    deadline = time.monotonic() + 5
    started = False
    while True:
        [p] = c.publishes(1, max(0.0, deadline - time.monotonic()))
        if p.retain:
            continue
        name = p.topic.removeprefix("$SYS/broker/")
        if name == "version":  # the first value of each round
            if started:
                c.stash.insert(0, p)  # it opens the next round
                return values
            started = True
        if started:
            values[name] = p.payload.decode()


def test_sys_topics_published_with_sensible_values(raw: Open, uid: str) -> None:
    """Mosquitto's $SYS names: $SYS/broker/version, uptime, clients/connected, messages/received and
    messages/sent are published every sys_interval (1 s here) with sensible, growing values."""
    c = raw(f"{uid}-sys")
    assert c.subscribe(Subscription("$SYS/broker/#", 0)) == [0]
    first = _sys_cycle(c)
    second = _sys_cycle(c)
    for values in (first, second):
        assert values["version"] == f"edge-gateway {__version__}"
        assert re.fullmatch(r"\d+ seconds", values["uptime"])
        assert int(values["clients/connected"]) >= 1
        assert int(values["messages/received"]) >= 2  # at least our CONNECT and SUBSCRIBE
        assert int(values["messages/sent"]) >= 2
    assert int(second["uptime"].split()[0]) > int(first["uptime"].split()[0])
    # Between the rounds the broker sent us the whole first round.
    assert int(second["messages/sent"]) - int(first["messages/sent"]) >= len(first)
    pinged = int(second["messages/received"])
    c.publish(f"{uid}/x", b"x", qos=1)
    c.stash.clear()  # what arrived before the PUBACK was published before our PUBLISH was counted
    third = _sys_cycle(c)
    assert int(third["messages/received"]) >= pinged + 1


@pytest.mark.parametrize(("version", "reason"), [(V311, 0), (V5, 0x87)], ids=["v311", "v5"])
def test_mqtt_3_3_5_2_publish_to_sys_refused_and_not_delivered(raw: Open, uid: str, version: int,
                                                              reason: int) -> None:
    """A client may not publish to $SYS: 5.0 gets PUBACK/PUBREC 0x87 Not authorized; 3.1.1 gets a normal
    acknowledgement [MQTT-3.3.5-2 (3.1.1)]; no subscriber receives it and nothing is retained."""
    sys_topic = f"$SYS/broker/{uid}"
    marker = f"{uid}/marker"
    sub = raw(f"{uid}-s", version)
    assert sub.subscribe(Subscription(sys_topic, 2), Subscription(marker, 2)) == [2, 2]
    pub = raw(f"{uid}-p", version)
    assert pub.publish(sys_topic, b"fake", qos=1, retain=True) == reason
    assert pub.publish(sys_topic, b"fake", qos=2) == reason
    pub.publish(sys_topic, b"fake", qos=0, retain=True)
    pub.publish(marker, b"m", qos=1)
    assert sub.until(marker) == []
    late = raw(f"{uid}-late", version)
    assert late.subscribe(sys_topic, marker) == [2, 2]
    pub.publish(marker, b"m2", qos=1)
    assert late.until(marker) == []
