"""CONNECT/CONNACK, sessions, takeover, Keep Alive, negotiated limits, Will Messages and DISCONNECT, checked
against the real broker process over real sockets.

Real clients (paho-mqtt with MQTT 3.1, 3.1.1 and 5.0, aiomqtt) cover takeover, Wills and Keep Alive; the
:class:`RawClient` covers exact bytes and inputs a library will not send. Test names carry the normative statement
they check (MQTT 5.0 ids unless the name says ``v311``; ids as listed in docs/conformance.md).
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiomqtt
import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, RawClient
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode

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
    Will,
)
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC

V31, V311, V5 = 3, 4, 5

# The limits of the ``tight`` broker below; the CONNACK must announce exactly these.
TIGHT_MAX_PACKET_SIZE = 1024
TIGHT_MAX_AWAITING_REL = 3
TIGHT_TOPIC_ALIAS_MAXIMUM = 2
TIGHT_MAX_KEEPALIVE = 1


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker with small per-listener limits, shared by the tests that need them (cheaper than one
    ``make_broker`` each). Its ``max_keepalive`` of 1 s means every connection to it must stay busy or be
    closed after 1.5 s: tests using it are short."""
    config = f"""
[broker]
sys_interval = 0
[listeners.external]
bind = "127.0.0.1:0"
connect_timeout = "1s"
max_keepalive = {TIGHT_MAX_KEEPALIVE}
max_packet_size = {TIGHT_MAX_PACKET_SIZE}
max_awaiting_rel = {TIGHT_MAX_AWAITING_REL}
topic_alias_maximum = {TIGHT_TOPIC_ALIAS_MAXIMUM}
"""
    proc = BrokerProcess(config, workdir=str(tmp_path_factory.mktemp("tight"))).start()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


# ------------------------------------------------------------------------------------------------ helpers


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


def closed(client: RawClient, timeout: float = 3.0) -> bool:
    """True when the server closes ``client``'s connection within ``timeout``; packets that arrive before the close
    stay readable with ``client.recv()``."""
    return client.closed_by_server(timeout)


def subscribe(client: RawClient, topic_filter: str, qos: int = 2, packet_id: int = 1, **props: Any) -> None:
    """SUBSCRIBE one filter and check the SUBACK grants ``qos``."""
    properties = {getattr(P, k): v for k, v in props.items()}
    client.send(Subscribe(packet_id, [Subscription(topic_filter, qos)], properties))
    ack = client.recv()
    assert ack == Suback(packet_id, [qos]), ack


def next_publish(client: RawClient, timeout: float = 5.0) -> Publish:
    packet = client.recv(timeout)
    assert isinstance(packet, Publish), packet
    return packet


def publish_marker(port: int, topic: str, payload: bytes = b"marker") -> None:
    """Publish a QoS 1 message from a fresh 3.1.1 connection and wait for its PUBACK. Anything the broker sent to
    a subscriber before this arrives there before the marker (per-connection order)."""
    client = RawClient(port, version=V311)
    try:
        client.connect()
        client.send(Publish(topic, payload, qos=1, packet_id=1))
        assert client.recv() == PubAck(1)
        client.send(Disconnect())
        assert closed(client)
    finally:
        client.close()


def expect_marker_next(client: RawClient, port: int, topic: str) -> None:
    """Publish a marker and check it is the very next packet ``client`` receives: nothing was sent before it."""
    publish_marker(port, topic)
    packet = next_publish(client)
    assert (packet.topic, packet.payload) == (topic, b"marker"), packet


def graceful_close(client: RawClient) -> None:
    client.send(Disconnect())
    assert closed(client)


def assert_nothing_delivered(client: RawClient) -> None:
    """Check nothing is queued for ``client``: a PINGREQ's PINGRESP is the next packet. Use after
    :func:`publish_marker`, whose PUBACK means the broker already routed the message."""
    client.send(PingReq())
    assert client.recv() == PingResp()


class Paho:
    """A paho-mqtt 2.x client on its network thread, with its callbacks turned into queues and events."""

    def __init__(self, port: int, client_id: str, protocol: int = mqtt.MQTTv311, clean: bool = True,
                 keepalive: int = 60, session_expiry: int | None = None,
                 will: tuple[str, bytes, int, bool] | None = None, will_delay: int | None = None) -> None:
        self.port = port
        self.protocol = protocol
        self.v5 = protocol == mqtt.MQTTv5
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                                  clean_session=None if self.v5 else clean, reconnect_on_failure=False)
        self.clean = clean
        self.keepalive = keepalive
        self.session_expiry = session_expiry
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.session_present: bool | None = None
        self.connack_properties: Any = None
        self.connect_rc: int | None = None
        self.disconnect_rc: int | None = None
        self.disconnect_from_server: bool | None = None
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.looping = False
        if will is not None:
            will_props = None
            if will_delay is not None:
                will_props = Properties(PacketTypes.WILLMESSAGE)
                will_props.WillDelayInterval = will_delay
            self.client.will_set(*will, properties=will_props)

    def _on_connect(self, _c: Any, _u: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self.session_present = flags.session_present
        self.connect_rc = reason_code.value
        self.connack_properties = properties
        self.connected.set()

    def _on_disconnect(self, _c: Any, _u: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self.disconnect_rc = reason_code.value
        self.disconnect_from_server = flags.is_disconnect_packet_from_server
        self.disconnected.set()

    def start(self) -> Paho:
        """Connect, start the network thread and wait for the CONNACK."""
        props = None
        kwargs: dict[str, Any] = {}
        if self.v5:
            kwargs["clean_start"] = self.clean
            if self.session_expiry is not None:
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = self.session_expiry
        self.client.connect("127.0.0.1", self.port, keepalive=self.keepalive, properties=props, **kwargs)
        self.client.loop_start()
        self.looping = True
        assert self.connected.wait(5), "no CONNACK"
        assert self.connect_rc == 0, self.connect_rc
        return self

    def subscribe(self, topic: str, qos: int = 2) -> None:
        granted = threading.Event()
        self.client.on_subscribe = lambda *_a: granted.set()
        self.client.subscribe(topic, qos)
        assert granted.wait(5), "no SUBACK"

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        info = self.client.publish(topic, payload, qos)
        info.wait_for_publish(5)
        assert info.is_published()

    def next_message(self, timeout: float = 5.0) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def drop(self) -> None:
        """Break the connection without a DISCONNECT (a network failure seen from the broker)."""
        sock = self.client.socket()
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        assert self.disconnected.wait(5)
        self.stop()

    def go_silent(self) -> None:
        """Stop the network thread: no more PINGREQs, nothing read."""
        self.stop()

    def drain_after_server_close(self) -> None:
        """Run the network loop by hand until paho notices the broker closed the connection."""
        deadline = time.monotonic() + 5
        while self.client.socket() is not None and time.monotonic() < deadline:
            self.client.loop(0.2)
        assert self.client.socket() is None
        assert self.disconnected.is_set()

    def disconnect(self, reason: int | None = None) -> None:
        """DISCONNECT (5.0: with ``reason``) and wait until the connection is closed."""
        code = PahoReasonCode(PacketTypes.DISCONNECT, identifier=reason) if reason is not None else None
        self.client.disconnect(reasoncode=code)
        assert self.disconnected.wait(5)
        self.stop()

    def stop(self) -> None:
        if self.looping:
            self.client.loop_stop()
            self.looping = False

    def close(self) -> None:
        if self.looping and self.client.is_connected():
            self.disconnect()
        self.stop()
        if self.client.socket() is not None:
            self.client.loop(0.1)
            self.client.disconnect()


@pytest.fixture
def paho() -> Iterator[Callable[..., Paho]]:
    """Make :class:`Paho` clients; all are disconnected and their threads stopped at teardown."""
    made: list[Paho] = []

    def make(*args: Any, **kwargs: Any) -> Paho:
        client = Paho(*args, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


# ------------------------------------------------------------------------------------------ Client Identifier


def test_v311_mqtt_3_1_3_6_empty_client_id_with_clean_session_gets_an_id(broker: BrokerProcess, raw: Any,
                                                                         uid: str) -> None:
    """3.1.1 MQTT-3.1.3-6: a zero-byte ClientId with CleanSession = 1 is accepted and given a unique ClientId:
    two such clients stay connected side by side (no takeover) and both work."""
    first, second = raw(broker.port), raw(broker.port)
    assert first.connect("", clean_start=True) == Connack(False, 0)
    assert second.connect("", clean_start=True) == Connack(False, 0)
    assert bytes(first.raw_received) == b"\x20\x02\x00\x00"
    subscribe(first, f"{uid}/t", qos=0)
    subscribe(second, f"{uid}/t", qos=0)
    publish_marker(broker.port, f"{uid}/t")
    assert next_publish(first).payload == b"marker"
    assert next_publish(second).payload == b"marker"


def test_v311_mqtt_3_1_3_8_empty_client_id_with_clean_session_0_connack_0x02(broker: BrokerProcess,
                                                                            raw: Any) -> None:
    """3.1.1 MQTT-3.1.3-8: a zero-byte ClientId with CleanSession = 0 gets CONNACK return code 0x02 (Identifier
    rejected), Session Present 0 [MQTT-3.2.2-4], and the connection is closed [MQTT-3.2.2-5]."""
    client = raw(broker.port)
    client.send(Connect("", V311, clean_start=False, keep_alive=60))
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x02"


def test_mqtt_3_2_2_16_empty_client_id_gets_assigned_client_identifier(broker: BrokerProcess, raw: Any) -> None:
    """MQTT-3.1.3-6 / MQTT-3.1.3-7 / MQTT-3.2.2-16: a zero-length ClientID gets a new, unique Assigned Client
    Identifier in the CONNACK, and the session is created under it: reconnecting with that id and Clean Start
    0 resumes it (Session Present 1)."""
    first, second = raw(broker.port, V5), raw(broker.port, V5)
    ack1 = first.connect("", properties={P.SESSION_EXPIRY_INTERVAL: 60})
    ack2 = second.connect("")
    assert ack1.reason_code == 0 and ack2.reason_code == 0
    assigned = ack1.properties[P.ASSIGNED_CLIENT_IDENTIFIER]
    other = ack2.properties[P.ASSIGNED_CLIENT_IDENTIFIER]
    assert isinstance(assigned, str) and assigned
    assert isinstance(other, str) and other
    assert assigned != other
    graceful_close(first)
    again = raw(broker.port, V5)
    ack = again.connect(assigned, clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 0})
    assert ack.session_present is True
    assert P.ASSIGNED_CLIENT_IDENTIFIER not in ack.properties
    graceful_close(again)


def test_mqtt_3_1_3_6_paho_v5_empty_client_id(broker: BrokerProcess, paho: Any, uid: str) -> None:
    """MQTT-3.1.3-7 with a real client: paho (MQTT 5.0, empty client id) gets the Assigned Client Identifier
    property and can publish and receive under it."""
    client = paho(broker.port, "", mqtt.MQTTv5).start()
    assigned = client.connack_properties.AssignedClientIdentifier
    assert isinstance(assigned, str) and assigned
    client.subscribe(f"{uid}/t", 1)
    client.publish(f"{uid}/t", b"hello", 1)
    msg = client.next_message()
    assert (msg.topic, msg.payload, msg.qos) == (f"{uid}/t", b"hello", 1)


def test_mqtt_3_1_3_5_client_id_of_23_alphanumerics_accepted(broker: BrokerProcess, raw: Any) -> None:
    """MQTT-3.1.3-5 (5.0 and 3.1.1): a 23-character ClientID of 0-9a-zA-Z is accepted as given (no Assigned
    Client Identifier)."""
    client_id = "aZ09" * 5 + "xyz"
    assert len(client_id) == 23
    v311 = raw(broker.port)
    assert v311.connect(client_id) == Connack(False, 0)
    graceful_close(v311)
    v5 = raw(broker.port, V5)
    ack = v5.connect(client_id)
    assert ack.reason_code == 0
    assert P.ASSIGNED_CLIENT_IDENTIFIER not in ack.properties
    graceful_close(v5)


# ------------------------------------------------------------------------------------------- Protocol level


def test_mqtt_3_1_protocol_level_3_mqisdp_accepted(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 3.1 (protocol name "MQIsdp", level 3) CONNECTs are accepted with the 3.1.1 CONNACK form, and the
    connection carries PUBLISH/SUBSCRIBE as 3.1.1 does."""
    client = raw(broker.port, V31)
    client.send(Connect(f"{uid}", V31, True, 60))
    assert client.recv() == Connack(False, 0)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x00"
    subscribe(client, f"{uid}/t", qos=1)
    client.send(Publish(f"{uid}/t", b"v3", qos=1, packet_id=7))
    packets = [client.recv(), client.recv()]
    assert PubAck(7) in packets
    (delivered,) = [p for p in packets if isinstance(p, Publish)]
    assert (delivered.topic, delivered.payload, delivered.qos) == (f"{uid}/t", b"v3", 1)


def test_mqtt_3_1_paho_mqttv31_client_round_trip(broker: BrokerProcess, paho: Any, uid: str) -> None:
    """A real MQTT 3.1 client (paho MQTTv31) connects, subscribes and receives its own message."""
    client = paho(broker.port, f"{uid}"[:23], mqtt.MQTTv31).start()
    client.subscribe(f"{uid}/t", 2)
    client.publish(f"{uid}/t", b"three-one", 2)
    msg = client.next_message()
    assert (msg.topic, msg.payload, msg.qos) == (f"{uid}/t", b"three-one", 2)


def test_mqtt_3_1_3_8_v31_paho_empty_client_id_rejected(broker: BrokerProcess, paho: Any) -> None:
    """MQTT 3.1 §3.1: a 3.1 Client Identifier is 1 to 23 characters and the server assigns none, so a real 3.1
    client (paho MQTTv31) that sends an empty one is refused with return code 0x02 (paho reports it as reason
    0x85 Client identifier not valid; 3.1.1 MQTT-3.1.3-9) and disconnected (MQTT-3.2.2-5). paho makes up an id
    for 3.1 itself, as the spec asks of a client, so the test clears it before connecting."""
    client = paho(broker.port, "", mqtt.MQTTv31)
    assert client.client._client_id  # paho's own 3.1 rule: it never sends an empty one
    client.client._client_id = b""
    client.client.connect("127.0.0.1", broker.port, keepalive=60)
    client.client.loop_start()
    client.looping = True
    assert client.connected.wait(5), "no CONNACK"
    assert (client.connect_rc, client.session_present) == (RC.CLIENT_IDENTIFIER_NOT_VALID, False)
    assert client.disconnected.wait(5), "the broker did not close the connection"


def test_mqtt_3_1_2_4_v31_paho_resumed_session_without_session_present(
    broker: BrokerProcess, paho: Any, uid: str
) -> None:
    """MQTT 3.1 §3.2: a 3.1 CONNACK has no Session Present flag (its first byte is reserved, 0), yet a Clean
    Session 0 reconnect resumes the session (3.1.1 MQTT-3.1.2-4): a real 3.1 client (paho MQTTv31) sees Session
    Present 0 both times and gets the QoS 1 message queued for it while it was away."""
    cid, topic = f"v31sp{time.monotonic_ns() % 10**12}", f"{uid}/t"
    first = paho(broker.port, cid, mqtt.MQTTv31, clean=False).start()
    assert first.session_present is False
    first.subscribe(topic, 1)
    first.disconnect()
    publish_marker(broker.port, topic)  # queued for the offline session
    again = paho(broker.port, cid, mqtt.MQTTv31, clean=False).start()
    assert again.session_present is False
    msg = again.next_message()
    assert (msg.topic, msg.payload, msg.qos) == (topic, b"marker", 1)
    again.disconnect()
    paho(broker.port, cid, mqtt.MQTTv31, clean=True).start().disconnect()  # Clean Session 1 discards the session


def test_v311_mqtt_3_1_2_2_unsupported_protocol_level_connack_0x01(broker: BrokerProcess, raw: Any) -> None:
    """3.1.1 MQTT-3.1.2-2: an unsupported Protocol Level (6) gets CONNACK return code 0x01 (3.1.1 form, no
    properties) and then the connection is closed."""
    client = raw(broker.port)
    client.send(b"\x10\x0c\x00\x04MQTT\x06\x02\x00\x3c\x00\x00")
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x01"


def test_mqtt_3_1_2_2_unsupported_protocol_version_5_form_connack_0x84(broker: BrokerProcess, raw: Any) -> None:
    """MQTT-3.1.2-2 (5.0): a level-5 CONNECT the server does not accept (here: level 5 under the 3.1 protocol
    name "MQIsdp") gets the 5.0 CONNACK 0x84 (Unsupported Protocol Version) with a Property Length, then
    close."""
    client = raw(broker.port, V5)
    client.send(b"\x10\x0f\x00\x06MQIsdp\x05\x02\x00\x3c\x00\x00\x00")
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x03\x00\x84\x00"


def test_v311_mqtt_3_1_2_1_unknown_protocol_name_closed_without_connack(broker: BrokerProcess, raw: Any) -> None:
    """3.1.1 MQTT-3.1.2-1 / 5.0 MQTT-3.1.2-1: a CONNECT whose protocol name is not MQTT is not processed: the
    connection is closed and nothing is sent."""
    client = raw(broker.port)
    client.send(b"\x10\x0c\x00\x04HTTP\x04\x02\x00\x3c\x00\x00")
    assert closed(client)
    assert bytes(client.raw_received) == b""


# ------------------------------------------------------------------------------------------- Session Present


def test_v311_mqtt_3_2_2_1_to_3_session_present(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """3.1.1 MQTT-3.2.2-1..3 with MQTT-3.1.2-4/6: CleanSession 1 -> Session Present 0; CleanSession 0 without
    stored state -> 0; with stored state -> 1 and the subscription still works; CleanSession 1 discards the
    session, so a later CleanSession 0 finds none (Session Present 0)."""
    cid, topic = uid, f"{uid}/t"

    def connect(clean: bool) -> tuple[RawClient, bytes]:
        client = raw(broker.port)
        client.connect(cid, clean_start=clean)
        return client, bytes(client.raw_received[:4])

    client, connack = connect(True)
    assert connack == b"\x20\x02\x00\x00"
    graceful_close(client)
    client, connack = connect(False)
    assert connack == b"\x20\x02\x00\x00"
    subscribe(client, topic, qos=1)
    graceful_close(client)
    publish_marker(broker.port, topic)  # queued for the offline session
    client, connack = connect(False)
    assert connack == b"\x20\x02\x01\x00"
    queued = next_publish(client)
    assert (queued.topic, queued.payload, queued.qos) == (topic, b"marker", 1)
    client.send(PubAck(queued.packet_id))  # type: ignore[arg-type]
    graceful_close(client)
    client, connack = connect(True)
    assert connack == b"\x20\x02\x00\x00"
    graceful_close(client)
    client, connack = connect(False)
    assert connack == b"\x20\x02\x00\x00"
    publish_marker(broker.port, topic)
    assert_nothing_delivered(client)  # the subscription went with the discarded session
    graceful_close(client)


def test_mqtt_3_2_2_2_and_3_session_present_paho_v5(broker: BrokerProcess, paho: Any, uid: str) -> None:
    """MQTT-3.2.2-2 / MQTT-3.2.2-3 / MQTT-3.1.2-4/5 with paho (5.0): Clean Start 0 + Session Expiry 60 resumes
    the session (Session Present 1, subscription kept, offline message delivered); Clean Start 1 discards it."""
    topic = f"{uid}/t"
    first = paho(broker.port, uid, mqtt.MQTTv5, clean=False, session_expiry=60).start()
    assert first.session_present is False
    first.subscribe(topic, 1)
    first.disconnect()
    publish_marker(broker.port, topic)
    resumed = paho(broker.port, uid, mqtt.MQTTv5, clean=False, session_expiry=60).start()
    assert resumed.session_present is True
    msg = resumed.next_message()
    assert (msg.topic, msg.payload, msg.qos) == (topic, b"marker", 1)
    resumed.disconnect()
    fresh = paho(broker.port, uid, mqtt.MQTTv5, clean=True, session_expiry=60).start()
    assert fresh.session_present is False
    fresh.disconnect()
    later = paho(broker.port, uid, mqtt.MQTTv5, clean=False, session_expiry=0).start()
    assert later.session_present is True  # the Clean Start 1 session (expiry 60) exists, but holds no subscription
    publish_marker(broker.port, topic)
    later.subscribe(f"{uid}/other", 0)  # its SUBACK comes after anything routed before it
    assert later.messages.empty()


# -------------------------------------------------------------------------------------------------- Takeover


def test_v311_mqtt_3_1_4_2_takeover_closes_existing_connection_paho(broker: BrokerProcess, paho: Any,
                                                                    uid: str) -> None:
    """3.1.1 MQTT-3.1.4-2: a second client with the same ClientId makes the broker close the existing one's
    connection; the new connection works."""
    old = paho(broker.port, uid, mqtt.MQTTv311).start()
    new = paho(broker.port, uid, mqtt.MQTTv311).start()
    assert old.disconnected.wait(5)
    assert old.disconnect_from_server is False  # 3.1.1 has no server DISCONNECT: the socket was closed
    assert not new.disconnected.is_set()
    new.subscribe(f"{uid}/t", 1)
    new.publish(f"{uid}/t", b"after takeover", 1)
    assert new.next_message().payload == b"after takeover"


def test_mqtt_3_1_4_3_takeover_sends_disconnect_0x8e_paho(broker: BrokerProcess, paho: Any, uid: str) -> None:
    """MQTT-3.1.4-3: the existing 5.0 client receives DISCONNECT 0x8E (Session taken over) and is closed."""
    old = paho(broker.port, uid, mqtt.MQTTv5).start()
    new = paho(broker.port, uid, mqtt.MQTTv5).start()
    assert old.disconnected.wait(5)
    assert old.disconnect_from_server is True
    assert old.disconnect_rc == RC.SESSION_TAKEN_OVER
    assert not new.disconnected.is_set()


def test_mqtt_3_1_4_3_takeover_disconnect_bytes(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.1.4-3 on the wire: the old connection gets exactly DISCONNECT 0x8E and then EOF, even when the
    new connection is 3.1.1 (the DISCONNECT follows the old connection's protocol version)."""
    old = raw(broker.port, V5)
    old.connect(uid)
    new = raw(broker.port, V311)
    assert new.connect(uid) == Connack(False, 0)
    assert closed(old)
    assert bytes(old.raw_received).endswith(b"\xe0\x01\x8e")
    new.send(PingReq())
    assert new.recv() == PingResp()


async def test_mqtt_3_1_4_3_takeover_aiomqtt_old_client_sees_0x8e_and_will(broker: BrokerProcess,
                                                                           uid: str) -> None:
    """MQTT-3.1.4-3 with aiomqtt: the taken-over client's message iterator ends with the server's DISCONNECT
    0x8E, and its Will (no Will Delay) is published because the connection did not end with DISCONNECT 0x00
    (MQTT-3.1.2-8)."""
    will = aiomqtt.Will(f"{uid}/will", b"gone", qos=1)
    async with aiomqtt.Client("127.0.0.1", broker.port, identifier=f"{uid}-watch",
                              protocol=aiomqtt.ProtocolVersion.V5) as watcher:
        await watcher.subscribe(f"{uid}/will", qos=1)
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier=uid, protocol=aiomqtt.ProtocolVersion.V5,
                                  will=will) as old:
            newcomer = RawClient(broker.port, version=V5)
            try:
                assert (await asyncio.to_thread(newcomer.connect, uid)).reason_code == 0
                with pytest.raises(aiomqtt.MqttError) as caught:
                    async with asyncio.timeout(5):
                        async for _message in old.messages:
                            pass
                cause = caught.value.__cause__
                assert isinstance(cause, aiomqtt.MqttCodeError)
                assert int(cause.rc.value) == RC.SESSION_TAKEN_OVER  # type: ignore[union-attr]
                async with asyncio.timeout(5):
                    message = await anext(watcher.messages)
                assert (str(message.topic), message.payload, message.qos) == (f"{uid}/will", b"gone", 1)
                await asyncio.to_thread(graceful_close, newcomer)
            finally:
                newcomer.close()


# ------------------------------------------------------------------------------------------------ Keep Alive


def wait_for_tick(watcher: RawClient) -> None:
    """Return right after the broker's one-second ticker ran: ``watcher`` must subscribe to $SYS/broker/uptime,
    which the module broker (sys_interval 1 s) publishes from its ticker, the same place Keep Alive is checked."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        packet = next_publish(watcher)
        if packet.topic == "$SYS/broker/uptime" and not packet.retain:
            return
    raise AssertionError("no $SYS update from the ticker")


def test_mqtt_3_1_2_22_keep_alive_one_and_a_half_times_disconnect_0x8d(broker: BrokerProcess, raw: Any,
                                                                       uid: str) -> None:
    """MQTT-3.1.2-22 (5.0): Keep Alive 1 s means the connection is closed after 1.5 s without a packet, not 1 s.
    The last packet (a PINGREQ, answered by PINGRESP per MQTT-3.12.4-1) is sent 0.6 s after a ticker run, so the
    ticker checks again 0.4 s, 1.4 s and 2.4 s later: the connection must survive the 1.4 s check and be closed
    at the 2.4 s one, with DISCONNECT 0x8D (Keep Alive timeout); then the Will is published."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=1, packet_id=1)
    subscribe(watcher, "$SYS/broker/uptime", qos=0, packet_id=2)
    wait_for_tick(watcher)
    client = raw(broker.port, V5)
    client.connect(uid, keep_alive=1, will=Will(f"{uid}/will", b"silent", 1))
    time.sleep(0.6)  # stays: puts the PINGREQ 0.6 s after a ticker run, the phase the checks below rely on
    client.send(PingReq())
    assert client.recv() == PingResp()
    silent_since = time.monotonic()
    assert not closed(client, 1.9)
    assert closed(client, 3)
    assert time.monotonic() - silent_since >= 1.9
    assert bytes(client.raw_received).endswith(b"\xe0\x01\x8d")
    assert client.recv() == Disconnect(RC.KEEP_ALIVE_TIMEOUT)
    will = next_publish(watcher)
    while will.topic.startswith("$SYS/"):
        will = next_publish(watcher)
    assert (will.topic, will.payload, will.qos) == (f"{uid}/will", b"silent", 1)


def test_v311_mqtt_3_1_2_24_silent_paho_client_closed_and_will_published(broker: BrokerProcess, raw: Any,
                                                                         paho: Any, uid: str) -> None:
    """3.1.1 MQTT-3.1.2-24 and MQTT-3.1.2-8: a paho 3.1.1 client with Keep Alive 1 s whose network loop stops
    (no PINGREQ) is disconnected by the broker, and its Will is published."""
    watcher = raw(broker.port)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=2)
    client = paho(broker.port, uid, mqtt.MQTTv311, keepalive=1, will=(f"{uid}/will", b"lost", 2, False)).start()
    client.go_silent()
    will = next_publish(watcher, timeout=8)
    assert (will.topic, will.payload, will.qos, will.retain) == (f"{uid}/will", b"lost", 2, False)
    client.drain_after_server_close()
    assert client.disconnect_from_server is False


def test_mqtt_3_1_2_22_silent_paho_v5_client_gets_disconnect_0x8d(broker: BrokerProcess, raw: Any, paho: Any,
                                                                  uid: str) -> None:
    """MQTT-3.1.2-22 with paho 5.0: the silent client reads a server DISCONNECT 0x8D (Keep Alive timeout) and its
    Will is published."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=0)
    client = paho(broker.port, uid, mqtt.MQTTv5, keepalive=1, will=(f"{uid}/will", b"v5 lost", 0, False)).start()
    client.go_silent()
    will = next_publish(watcher, timeout=8)
    assert (will.topic, will.payload) == (f"{uid}/will", b"v5 lost")
    client.drain_after_server_close()
    assert client.disconnect_from_server is True
    assert client.disconnect_rc == RC.KEEP_ALIVE_TIMEOUT


async def test_mqtt_3_1_2_22_aiomqtt_pinging_client_stays_connected(broker: BrokerProcess, uid: str) -> None:
    """MQTT-3.1.2-22 / MQTT-3.12.4-1 with aiomqtt: a client with Keep Alive 1 s that keeps sending PINGREQ is not
    disconnected after 1.5 s; 2.5 s later it still publishes and receives."""
    async with aiomqtt.Client("127.0.0.1", broker.port, identifier=uid, keepalive=1,
                              protocol=aiomqtt.ProtocolVersion.V5) as client:
        await client.subscribe(f"{uid}/t", qos=1)
        await asyncio.sleep(2.5)  # stays: time past the 1.5 s Keep Alive limit is what is tested (pings meanwhile)
        await client.publish(f"{uid}/t", b"still here", qos=1)
        async with asyncio.timeout(5):
            message = await anext(client.messages)
        assert (str(message.topic), message.payload) == (f"{uid}/t", b"still here")


def test_mqtt_3_2_2_22_server_keep_alive(tight: BrokerProcess, raw: Any, paho: Any, uid: str) -> None:
    """Server Keep Alive (MQTT 5.0 §3.2.2.3.14, MQTT-3.2.2-22): with max_keepalive = 1 a 5.0 client asking for
    60 s, or for 0 (none), gets Server Keep Alive 1 in the CONNACK; one asking for 1 gets no Server Keep Alive
    (its own value is used). 3.1.1 CONNACKs carry no properties. paho 5.0 sees the property too."""
    for asked, expected in ((60, TIGHT_MAX_KEEPALIVE), (0, TIGHT_MAX_KEEPALIVE), (1, None)):
        client = raw(tight.port, V5)
        ack = client.connect(f"{uid}-{asked}", keep_alive=asked)
        assert ack.properties.get(P.SERVER_KEEP_ALIVE) == expected, (asked, ack)
        graceful_close(client)
    v311 = raw(tight.port)
    v311.connect(f"{uid}-311", keep_alive=60)
    assert bytes(v311.raw_received) == b"\x20\x02\x00\x00"
    graceful_close(v311)
    client = paho(tight.port, f"{uid}-paho", mqtt.MQTTv5, keepalive=30).start()
    assert client.connack_properties.ServerKeepAlive == TIGHT_MAX_KEEPALIVE


def test_mqtt_3_2_2_22_server_keep_alive_is_enforced(tight: BrokerProcess, raw: Any, uid: str) -> None:
    """The Server Keep Alive replaces the client's value (MQTT 5.0 §3.2.2.3.14): a client that asked for Keep
    Alive 0 (none) but got Server Keep Alive 1 is closed with DISCONNECT 0x8D once silent for 1.5 s."""
    client = raw(tight.port, V5)
    ack = client.connect(uid, keep_alive=0)
    assert ack.properties[P.SERVER_KEEP_ALIVE] == 1
    assert closed(client, 5)
    assert client.recv() == Disconnect(RC.KEEP_ALIVE_TIMEOUT)


# ---------------------------------------------------------------------------------------------- Receive Maximum


def test_receive_maximum_announced_and_exceeded_disconnect_0x93(tight: BrokerProcess, raw: Any, uid: str) -> None:
    """Receive Maximum (MQTT 5.0 §3.2.2.3.3, §3.3.4, MQTT-3.3.4-7 binds the client): the broker announces
    max_awaiting_rel (3) in the CONNACK; QoS 2 PUBLISHes up to it are PUBRECed, a PUBREL/PUBCOMP frees a slot,
    and one more PUBLISH than the quota gets DISCONNECT 0x93 (Receive Maximum exceeded) and a close."""
    client = raw(tight.port, V5)
    ack = client.connect(uid)
    assert ack.properties[P.RECEIVE_MAXIMUM] == TIGHT_MAX_AWAITING_REL
    for pid in (1, 2, 3):
        client.send(Publish(f"{uid}/t", b"x", qos=2, packet_id=pid))
    assert [client.recv() for _ in range(3)] == [PubRec(1), PubRec(2), PubRec(3)]
    client.send(PubRel(1))
    assert client.recv() == PubComp(1)
    client.send(Publish(f"{uid}/t", b"x", qos=2, packet_id=4))
    assert client.recv() == PubRec(4)
    client.send(Publish(f"{uid}/t", b"x", qos=2, packet_id=5))
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.RECEIVE_MAXIMUM_EXCEEDED, packet
    assert closed(client)
    assert client.recv_all(0.1) == []


def test_receive_maximum_default_is_max_awaiting_rel(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """The default broker announces Receive Maximum 100 (EMQX's max_awaiting_rel default;
    docs/reliability.md, "Limits")."""
    client = raw(broker.port, V5)
    ack = client.connect(uid)
    assert ack.properties[P.RECEIVE_MAXIMUM] == 100
    assert ack.properties[P.MAXIMUM_PACKET_SIZE] == 1024 * 1024
    assert ack.properties[P.TOPIC_ALIAS_MAXIMUM] == 10
    graceful_close(client)


# ------------------------------------------------------------------------------------------ Maximum Packet Size


def test_mqtt_3_1_2_24_and_25_not_sending_packets_above_client_maximum_packet_size(broker: BrokerProcess,
                                                                                   raw: Any, uid: str) -> None:
    """MQTT-3.1.2-24 / MQTT-3.1.2-25: a subscriber announcing Maximum Packet Size 100 never receives a bigger
    packet - the broker discards that one message for it and carries on as if it was sent (the next message,
    QoS 1 too, follows) - while a subscriber without a limit receives both."""
    topic = f"{uid}/t"
    small = raw(broker.port, V5)
    small.connect(f"{uid}-small", properties={P.MAXIMUM_PACKET_SIZE: 100})
    subscribe(small, topic, qos=1)
    big = raw(broker.port, V5)
    big.connect(f"{uid}-big")
    subscribe(big, topic, qos=1)
    publisher = raw(broker.port, V5)
    publisher.connect(f"{uid}-pub")
    publisher.send(Publish(topic, b"L" * 200, qos=1, packet_id=1))
    publisher.send(Publish(topic, b"small", qos=1, packet_id=2))
    assert [publisher.recv(), publisher.recv()] == [PubAck(1), PubAck(2)]
    got_big = [next_publish(big), next_publish(big)]
    assert [p.payload for p in got_big] == [b"L" * 200, b"small"]
    only = next_publish(small)
    assert (only.payload, only.qos) == (b"small", 1)
    assert len(only.encode(V5)) <= 100
    assert_nothing_delivered(small)


def test_packet_above_broker_maximum_packet_size_disconnect_0x95(tight: BrokerProcess, raw: Any,
                                                                  uid: str) -> None:
    """Maximum Packet Size (MQTT 5.0 §3.1.2.11.4, §4.13; MQTT-3.2.2-15 binds the client): the CONNACK announces
    max_packet_size (1024); a PUBLISH of exactly 1024 bytes is accepted, one of 1025 bytes gets DISCONNECT 0x95
    (Packet too large) and a close, while another client on the broker is unaffected."""
    bystander = raw(tight.port, V5)
    bystander.connect(f"{uid}-by")
    client = raw(tight.port, V5)
    ack = client.connect(uid)
    assert ack.properties[P.MAXIMUM_PACKET_SIZE] == TIGHT_MAX_PACKET_SIZE
    topic = f"{uid}/t"
    fits = Publish(topic, b"", qos=1, packet_id=1)
    fits.payload = b"p" * (TIGHT_MAX_PACKET_SIZE - len(fits.encode(V5)))
    fits.payload = fits.payload[: len(fits.payload) - (len(fits.encode(V5)) - TIGHT_MAX_PACKET_SIZE)]  # VBI grew
    assert len(fits.encode(V5)) == TIGHT_MAX_PACKET_SIZE
    client.send(fits)
    assert client.recv() == PubAck(1, RC.NO_MATCHING_SUBSCRIBERS)
    too_big = Publish(topic, fits.payload + b"p", qos=1, packet_id=2)
    assert len(too_big.encode(V5)) == TIGHT_MAX_PACKET_SIZE + 1
    client.send(too_big)
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.PACKET_TOO_LARGE, packet
    assert closed(client)
    bystander.send(PingReq())
    assert bystander.recv() == PingResp()


def test_v311_packet_above_broker_maximum_packet_size_closes(tight: BrokerProcess, raw: Any, uid: str) -> None:
    """The broker's max_packet_size also applies to 3.1.1 clients, which are simply disconnected (MQTT-4.8.0-1)."""
    client = raw(tight.port)
    client.connect(uid)
    client.send(Publish(f"{uid}/t", b"p" * TIGHT_MAX_PACKET_SIZE, qos=0))
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x00"


# ------------------------------------------------------------------------------------------------ Topic Alias


def test_mqtt_3_3_2_12_inbound_topic_alias_set_and_use(tight: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.3.2-12: the broker accepts Topic Aliases 1..Topic Alias Maximum (2, as announced in the CONNACK):
    a PUBLISH with a topic and an alias sets the mapping, one with an empty topic uses it, and an alias can be
    remapped. Subscribers get the full Topic Name and no Topic Alias (they announced none, MQTT-3.1.2-27)."""
    sub = raw(tight.port, V5)
    sub.connect(f"{uid}-sub")
    subscribe(sub, f"{uid}/#", qos=0)
    client = raw(tight.port, V5)
    ack = client.connect(uid)
    assert ack.properties[P.TOPIC_ALIAS_MAXIMUM] == TIGHT_TOPIC_ALIAS_MAXIMUM
    client.send(Publish(f"{uid}/a", b"1", properties={P.TOPIC_ALIAS: 2}))
    client.send(Publish("", b"2", properties={P.TOPIC_ALIAS: 2}))
    client.send(Publish(f"{uid}/b", b"3", properties={P.TOPIC_ALIAS: 2}))
    client.send(Publish("", b"4", properties={P.TOPIC_ALIAS: 2}))
    client.send(Publish(f"{uid}/c", b"5", properties={P.TOPIC_ALIAS: 1}))
    client.send(Publish("", b"6", properties={P.TOPIC_ALIAS: 1}))
    got = [next_publish(sub) for _ in range(6)]
    assert [(p.topic, p.payload) for p in got] == [
        (f"{uid}/a", b"1"), (f"{uid}/a", b"2"), (f"{uid}/b", b"3"), (f"{uid}/b", b"4"), (f"{uid}/c", b"5"),
        (f"{uid}/c", b"6"),
    ]
    assert all(P.TOPIC_ALIAS not in p.properties for p in got)


def test_topic_alias_above_maximum_disconnect_0x94(tight: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.3.4 (MQTT-3.3.2-9 binds the client): a Topic Alias above the announced maximum gets
    DISCONNECT 0x94 (Topic Alias invalid) and a close."""
    client = raw(tight.port, V5)
    client.connect(uid)
    client.send(Publish(f"{uid}/t", b"x", properties={P.TOPIC_ALIAS: TIGHT_TOPIC_ALIAS_MAXIMUM + 1}))
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.TOPIC_ALIAS_INVALID, packet
    assert closed(client)


def test_unknown_topic_alias_with_empty_topic_disconnect_0x82(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.3.2.3.4: a PUBLISH with an empty Topic Name and an alias that has no mapping yet is a Protocol
    Error: DISCONNECT 0x82 and close. Mappings do not carry over from an earlier connection (MQTT-3.3.2-7)."""
    first = raw(broker.port, V5)
    first.connect(uid)
    first.send(Publish(f"{uid}/t", b"x", properties={P.TOPIC_ALIAS: 1}))
    graceful_close(first)
    client = raw(broker.port, V5)
    client.connect(uid)
    client.send(Publish("", b"x", properties={P.TOPIC_ALIAS: 1}))
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.PROTOCOL_ERROR, packet
    assert closed(client)


def test_mqtt_3_1_2_26_outbound_topic_aliases_within_client_maximum(broker: BrokerProcess, raw: Any,
                                                                    uid: str) -> None:
    """MQTT-3.1.2-26 / MQTT-3.3.2-11: a 5.0 subscriber announcing Topic Alias Maximum 1 gets aliases: the first
    PUBLISH on a topic carries the Topic Name and alias 1, the second on the same topic an empty Topic Name and
    alias 1; a second topic gets no alias (the maximum is used up), never alias 2. A subscriber announcing none
    gets no Topic Alias at all (MQTT-3.1.2-27)."""
    aliased = raw(broker.port, V5)
    aliased.connect(f"{uid}-aliased", properties={P.TOPIC_ALIAS_MAXIMUM: 1})
    subscribe(aliased, f"{uid}/#", qos=1)
    plain = raw(broker.port, V5)
    plain.connect(f"{uid}-plain")
    subscribe(plain, f"{uid}/#", qos=1)
    publisher = raw(broker.port, V5)
    publisher.connect(f"{uid}-pub")
    for n, topic in enumerate([f"{uid}/a", f"{uid}/a", f"{uid}/b", f"{uid}/b", f"{uid}/a"], start=1):
        publisher.send(Publish(topic, str(n).encode(), qos=1, packet_id=n))
        assert publisher.recv() == PubAck(n)
    got = [next_publish(aliased) for _ in range(5)]
    assert [(p.topic, p.properties.get(P.TOPIC_ALIAS), p.payload) for p in got] == [
        (f"{uid}/a", 1, b"1"), ("", 1, b"2"), (f"{uid}/b", None, b"3"), (f"{uid}/b", None, b"4"), ("", 1, b"5"),
    ]
    got_plain = [next_publish(plain) for _ in range(5)]
    assert [(p.topic, p.payload) for p in got_plain] == [
        (f"{uid}/a", b"1"), (f"{uid}/a", b"2"), (f"{uid}/b", b"3"), (f"{uid}/b", b"4"), (f"{uid}/a", b"5"),
    ]
    assert all(P.TOPIC_ALIAS not in p.properties for p in got_plain)


# ---------------------------------------------------------------------------- CONNECT timeout, packet order


def test_connect_timeout_closes_a_silent_socket(tight: BrokerProcess, raw: Any) -> None:
    """connect_timeout = "1s" (MQTT 5.0 §4.1 non-normative: close a connection that sends no CONNECT in a
    reasonable time): a socket that sends nothing, and one that sends half a CONNECT, are closed, with nothing
    sent to them."""
    silent = raw(tight.port)
    partial = raw(tight.port)
    partial.send(Connect("half", V311, True, 60).encode(V311)[:5])
    assert not closed(silent, 0.5)
    assert closed(silent, 5)
    assert closed(partial, 5)
    assert bytes(silent.raw_received) == b"" and bytes(partial.raw_received) == b""


@pytest.mark.parametrize(
    "first",
    [PingReq(), Publish("t", b"x"), Subscribe(1, [Subscription("t", 0)]), Disconnect()],
    ids=["PINGREQ", "PUBLISH", "SUBSCRIBE", "DISCONNECT"],
)
@pytest.mark.parametrize("version", [V311, V5])
def test_mqtt_3_1_0_1_first_packet_not_connect_closes(broker: BrokerProcess, raw: Any, first: Packet,
                                                      version: int) -> None:
    """MQTT-3.1.0-1 (the first packet must be CONNECT) enforced by the server per MQTT-3.1.4-1 / MQTT-4.8.0-1:
    any other first packet closes the connection without a reply."""
    client = raw(broker.port, version)
    client.send(first.encode(version))
    assert closed(client)
    assert bytes(client.raw_received) == b""


def test_v311_mqtt_3_1_0_2_second_connect_closes(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """3.1.1 MQTT-3.1.0-2: a second CONNECT is a protocol violation: the connection is closed, no reply."""
    client = raw(broker.port)
    client.connect(uid)
    client.send(Connect(uid, V311, True, 60))
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x02\x00\x00"


def test_mqtt_3_1_0_2_second_connect_disconnect_0x82(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.1.0-2 (5.0): a second CONNECT is a Protocol Error: DISCONNECT 0x82, then close. It is not a
    normal disconnection, so the Will is published (MQTT-3.1.2-8)."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=0)
    client = raw(broker.port, V5)
    client.connect(uid, will=Will(f"{uid}/will", b"protocol error"))
    client.send(Connect(uid, V5, True, 60))
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.PROTOCOL_ERROR, packet
    assert closed(client)
    assert next_publish(watcher).payload == b"protocol error"


def test_mqtt_4_12_0_1_authentication_method_connack_0x8c(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-4.12.0-1: a CONNECT with an Authentication Method the server does not support gets CONNACK 0x8C (Bad
    authentication method) with Session Present 0, and the connection is closed (MQTT-3.2.2-6/7)."""
    client = raw(broker.port, V5)
    client.send(Connect(uid, V5, True, 60, properties={P.AUTHENTICATION_METHOD: "SCRAM-SHA-1"}))
    packet = client.recv()
    assert isinstance(packet, Connack), packet
    assert (packet.session_present, packet.reason_code) == (False, RC.BAD_AUTHENTICATION_METHOD)
    assert P.AUTHENTICATION_METHOD not in packet.properties  # MQTT-4.12.0-6
    assert closed(client)


# ----------------------------------------------------------------------------------------------------- Wills


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v311", "v5"])
def test_mqtt_3_1_2_8_will_published_when_socket_drops(broker: BrokerProcess, raw: Any, paho: Any, uid: str,
                                                       protocol: int) -> None:
    """MQTT-3.1.2-8 (3.1.1 and 5.0): the Will of a paho client whose connection breaks without DISCONNECT is
    published, with its payload and QoS (1), not retained (3.1.1 MQTT-3.1.2-16, 5.0 MQTT-3.1.2-14)."""
    watcher = raw(broker.port)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=2)
    client = paho(broker.port, uid, protocol, will=(f"{uid}/will", b"dropped", 1, False)).start()
    client.drop()
    will = next_publish(watcher)
    assert (will.topic, will.payload, will.qos, will.retain) == (f"{uid}/will", b"dropped", 1, False)
    expect_marker_next(watcher, broker.port, f"{uid}/will")  # published once


def test_mqtt_3_1_2_8_will_published_on_disconnect_0x04_paho(broker: BrokerProcess, raw: Any, paho: Any,
                                                            uid: str) -> None:
    """MQTT-3.1.2-8 / MQTT 5.0 §3.14.2.1: DISCONNECT with Reason Code 0x04 (Disconnect with Will Message) makes
    the broker publish the Will."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=1)
    client = paho(broker.port, uid, mqtt.MQTTv5, will=(f"{uid}/will", b"asked for", 1, False)).start()
    client.disconnect(reason=0x04)
    will = next_publish(watcher)
    assert (will.topic, will.payload, will.qos) == (f"{uid}/will", b"asked for", 1)


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v311", "v5"])
def test_mqtt_3_14_4_3_no_will_on_normal_disconnect(broker: BrokerProcess, raw: Any, paho: Any, uid: str,
                                                    protocol: int) -> None:
    """3.1.1 MQTT-3.1.2-10 / MQTT-3.14.4-3 and 5.0 MQTT-3.1.2-10 / MQTT-3.14.4-3: on a normal DISCONNECT (5.0:
    Reason Code 0x00) the Will is discarded, not published."""
    watcher = raw(broker.port)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=1)
    client = paho(broker.port, uid, protocol, will=(f"{uid}/will", b"must not appear", 1, True)).start()
    client.disconnect()
    expect_marker_next(watcher, broker.port, f"{uid}/will")


async def test_mqtt_3_14_4_3_no_will_on_normal_disconnect_aiomqtt(broker: BrokerProcess, uid: str) -> None:
    """MQTT-3.14.4-3 with aiomqtt (5.0): leaving the client's context sends DISCONNECT 0x00 and no Will is
    published; a Will-less marker published afterwards is the first thing the watcher gets."""
    async with aiomqtt.Client("127.0.0.1", broker.port, identifier=f"{uid}-watch",
                              protocol=aiomqtt.ProtocolVersion.V5) as watcher:
        await watcher.subscribe(f"{uid}/will", qos=1)
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier=uid, protocol=aiomqtt.ProtocolVersion.V5,
                                  will=aiomqtt.Will(f"{uid}/will", b"must not appear", qos=1)):
            pass
        await watcher.publish(f"{uid}/will", b"marker", qos=1)
        async with asyncio.timeout(5):
            message = await anext(watcher.messages)
        assert message.payload == b"marker"


@pytest.mark.parametrize(("version", "will_qos"), [(V311, 0), (V311, 2), (V5, 1), (V5, 2)])
def test_mqtt_3_1_2_15_will_retain_and_qos_honoured(broker: BrokerProcess, raw: Any, uid: str, version: int,
                                                    will_qos: int) -> None:
    """5.0 MQTT-3.1.2-15 / 3.1.1 MQTT-3.1.2-17: a Will with Will Retain 1 is published as a retained message at
    the Will QoS: a subscriber that joins afterwards receives it with RETAIN 1 and that QoS. A Will with Will
    Retain 0 (MQTT-3.1.2-14 / 3.1.1 MQTT-3.1.2-16) is delivered at its QoS but leaves nothing retained."""
    retained_topic, plain_topic = f"{uid}/will/retained", f"{uid}/will/plain"
    watcher = raw(broker.port, version)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will/#", qos=2)
    for topic, retain in ((retained_topic, True), (plain_topic, False)):
        client = raw(broker.port, version)
        client.connect(f"{uid}-{retain}", will=Will(topic, b"bye", will_qos, retain))
        client.close()  # network failure: the Will is published
    wills = sorted((next_publish(watcher), next_publish(watcher)), key=lambda p: p.topic)
    # To an existing subscription RETAIN is 0 (3.1.1 MQTT-3.3.1-9; 5.0 Retain As Published 0, MQTT-3.3.1-12).
    assert [(p.topic, p.payload, p.qos, p.retain) for p in wills] == [
        (plain_topic, b"bye", will_qos, False), (retained_topic, b"bye", will_qos, False),
    ]
    late = raw(broker.port, version)
    late.connect(f"{uid}-late")
    subscribe(late, retained_topic, qos=2, packet_id=1)
    will = next_publish(late)
    assert (will.topic, will.payload, will.qos, will.retain) == (retained_topic, b"bye", will_qos, True)
    late.send(Subscribe(2, [Subscription(plain_topic, 2)]))
    assert late.recv() == Suback(2, [2])
    assert_nothing_delivered(late)  # no retained message for the Will Retain 0 topic
    # Clear the retained Will so the module broker's retained store stays small.
    late.send(Publish(retained_topic, b"", retain=True))
    graceful_close(late)


def test_mqtt_3_1_3_10_will_properties_forwarded_in_order(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT-3.1.3-10 / MQTT-3.3.2-17/18: the Will's User Properties reach the subscriber unaltered and in order,
    with its Content Type, Response Topic, Correlation Data and Payload Format Indicator; the Will Delay Interval
    (a Will-only property) is not put into the PUBLISH."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=1)
    user = [("b", "1"), ("a", "2"), ("b", "3"), ("z", "")]
    will_props = {P.WILL_DELAY_INTERVAL: 0, P.USER_PROPERTY: user, P.CONTENT_TYPE: "text/plain",
                  P.RESPONSE_TOPIC: f"{uid}/reply", P.CORRELATION_DATA: b"\x00\x01", P.PAYLOAD_FORMAT_INDICATOR: 1}
    client = raw(broker.port, V5)
    client.connect(uid, will=Will(f"{uid}/will", "größe".encode(), 1, False, will_props))
    client.close()
    will = next_publish(watcher)
    assert will.payload == "größe".encode()
    assert will.properties == {P.USER_PROPERTY: user, P.CONTENT_TYPE: "text/plain",
                               P.RESPONSE_TOPIC: f"{uid}/reply", P.CORRELATION_DATA: b"\x00\x01",
                               P.PAYLOAD_FORMAT_INDICATOR: 1}


def test_mqtt_3_1_2_8_will_delay_interval_delays_the_will(broker: BrokerProcess, raw: Any, paho: Any,
                                                          uid: str) -> None:
    """MQTT-3.1.2-8 / MQTT 5.0 §3.1.3.2.2: with Will Delay Interval 2 s (and a session that outlives it) the Will
    is not published when the connection drops but about 2 s later."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=1)
    client = paho(broker.port, uid, mqtt.MQTTv5, session_expiry=60, will=(f"{uid}/will", b"late", 1, False),
                  will_delay=2).start()
    dropped_at = time.monotonic()
    client.drop()
    expect_marker_next(watcher, broker.port, f"{uid}/will")  # not published at once
    will = next_publish(watcher, timeout=6)
    assert time.monotonic() - dropped_at >= 1.5
    assert (will.topic, will.payload, will.qos) == (f"{uid}/will", b"late", 1)


def test_mqtt_3_1_3_9_no_will_when_client_reconnects_within_will_delay(broker: BrokerProcess, raw: Any,
                                                                       paho: Any, uid: str) -> None:
    """MQTT-3.1.3-9: a client that reconnects before its Will Delay Interval passed has no Will published. A second
    client dropped just after it with the same delay is the clock: when its Will arrives, the first one's would
    have been due in the same tick, yet nothing else arrives before a marker."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/#", qos=1)
    back = paho(broker.port, f"{uid}-back", mqtt.MQTTv5, session_expiry=60, clean=False,
                will=(f"{uid}/will-back", b"must not appear", 1, False), will_delay=1).start()
    clock = paho(broker.port, f"{uid}-clock", mqtt.MQTTv5, session_expiry=60,
                 will=(f"{uid}/will-clock", b"tick", 1, False), will_delay=1).start()
    back.drop()
    clock.drop()
    again = paho(broker.port, f"{uid}-back", mqtt.MQTTv5, session_expiry=60, clean=False).start()
    assert again.session_present is True
    will = next_publish(watcher, timeout=6)
    assert (will.topic, will.payload) == (f"{uid}/will-clock", b"tick")
    expect_marker_next(watcher, broker.port, f"{uid}/marker")


def test_will_delay_longer_than_session_sends_will_when_session_ends(broker: BrokerProcess, raw: Any,
                                                                      uid: str) -> None:
    """MQTT 5.0 §3.1.3.2.2: the Will is published when the Will Delay Interval passes or the Session ends,
    whichever is first: with Session Expiry 0 the session ends with the connection, so the Will goes out at
    once despite a Will Delay of 60 s."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=0)
    client = raw(broker.port, V5)
    client.connect(uid, will=Will(f"{uid}/will", b"now", 0, False, {P.WILL_DELAY_INTERVAL: 60}))
    client.close()
    will = next_publish(watcher)
    assert (will.topic, will.payload) == (f"{uid}/will", b"now")


def test_mqtt_3_1_3_9_will_delay_longer_than_session_expiry(broker: BrokerProcess, raw: Any, uid: str) -> None:
    """MQTT 5.0 §3.1.3.2.2 with MQTT-3.1.3-9: Will Delay 60 s but Session Expiry 2 s - the Will is due when the
    session ends, 2 s after the drop, not at the drop: a client that reconnects within those 2 s has no Will
    published at all, while one that stays away has its Will published when its session expires."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/#", qos=0)
    expiry = {P.SESSION_EXPIRY_INTERVAL: 2}
    will_props = {P.WILL_DELAY_INTERVAL: 60}
    back, away = raw(broker.port, V5), raw(broker.port, V5)
    back.connect(f"{uid}-back", properties=expiry, will=Will(f"{uid}/will-back", b"must not appear", 0, False,
                                                              will_props))
    away.connect(f"{uid}-away", properties=expiry, will=Will(f"{uid}/will-away", b"session ended", 0, False,
                                                              will_props))
    back.close()
    away.close()
    dropped_at = time.monotonic()
    again = raw(broker.port, V5)
    assert again.connect(f"{uid}-back", clean_start=False, properties=expiry).session_present is True
    expect_marker_next(watcher, broker.port, f"{uid}/marker")  # neither Will went out at the drop
    will = next_publish(watcher, timeout=6)
    assert (will.topic, will.payload) == (f"{uid}/will-away", b"session ended")
    assert time.monotonic() - dropped_at >= 1.5
    expect_marker_next(watcher, broker.port, f"{uid}/marker")
    again.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}))
    assert closed(again)


# ------------------------------------------------------------------------------------- DISCONNECT properties


def test_disconnect_session_expiry_after_connect_zero_is_protocol_error(broker: BrokerProcess, raw: Any,
                                                                        uid: str) -> None:
    """MQTT 5.0 §3.14.2.2.2: a non-zero Session Expiry Interval in DISCONNECT after CONNECT had 0 is a Protocol
    Error: not a valid DISCONNECT, so the broker answers DISCONNECT 0x82 (carrying no Session Expiry Interval,
    MQTT-3.14.2-2), closes, publishes the Will, and keeps no session."""
    watcher = raw(broker.port, V5)
    watcher.connect(f"{uid}-watch")
    subscribe(watcher, f"{uid}/will", qos=0)
    client = raw(broker.port, V5)
    client.connect(uid, will=Will(f"{uid}/will", b"invalid disconnect"))
    client.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 300}))
    packet = client.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == RC.PROTOCOL_ERROR, packet
    assert P.SESSION_EXPIRY_INTERVAL not in packet.properties
    assert closed(client)
    assert next_publish(watcher).payload == b"invalid disconnect"
    again = raw(broker.port, V5)
    assert again.connect(uid, clean_start=False).session_present is False
    graceful_close(again)


@pytest.mark.parametrize(("at_disconnect", "present"), [(0, False), (120, True)])
def test_disconnect_session_expiry_interval_updates_the_session(broker: BrokerProcess, raw: Any, uid: str,
                                                                at_disconnect: int, present: bool) -> None:
    """MQTT 5.0 §3.14.2.2.2 / MQTT-3.1.2-23: a DISCONNECT Session Expiry Interval replaces the CONNECT one: 0 ends
    the session with the connection, 120 keeps it (Session Present on the next Clean Start 0)."""
    client = raw(broker.port, V5)
    client.connect(uid, properties={P.SESSION_EXPIRY_INTERVAL: 30})
    client.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: at_disconnect}))
    assert closed(client)
    assert client.recv_all(0.1) == []  # only the CONNACK: the server sent no DISCONNECT
    again = raw(broker.port, V5)
    assert again.connect(uid, clean_start=False).session_present is present
    again.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}))
    assert closed(again)


# ------------------------------------------------------------------------- limits on what the broker sends


def test_mqtt_3_2_2_19_refusal_connack_fits_client_maximum_packet_size(broker: BrokerProcess, raw: Any,
                                                                       uid: str) -> None:
    """MQTT-3.2.2-19: the broker must not add a Reason String that would make the CONNACK larger than the
    Client's Maximum Packet Size - also when it refuses the CONNECT (here: Authentication Method, 0x8C)."""
    client = raw(broker.port, V5)
    client.send(Connect(uid, V5, True, 60, properties={P.AUTHENTICATION_METHOD: "SCRAM-SHA-1",
                                                       P.MAXIMUM_PACKET_SIZE: 16}))
    assert closed(client)
    assert bytes(client.raw_received) == b"\x20\x03\x00\x8c\x00"


def test_mqtt_3_14_2_3_disconnect_reason_string_fits_client_maximum_packet_size(broker: BrokerProcess,
                                                                                raw: Any, uid: str) -> None:
    """MQTT-3.14.2-3: a server DISCONNECT drops its Reason String when it would exceed the Client's Maximum Packet
    Size: with a limit of 16 bytes the Malformed Packet DISCONNECT is exactly E0 01 81 (Reason Code only, the
    Property Length left out as MQTT 5.0 §3.14.2.2.1 allows)."""
    client = raw(broker.port, V5)
    connack_len = len(Connack(False, 0, client.connect(uid, properties={P.MAXIMUM_PACKET_SIZE: 16}).properties)
                      .encode(V5))
    client.send(b"\x00\x00")
    assert closed(client)
    assert bytes(client.raw_received[connack_len:]) == b"\xe0\x01\x81"


def test_mqtt_3_1_2_24_dropped_publish_does_not_register_an_outbound_topic_alias(broker: BrokerProcess,
                                                                                  raw: Any, uid: str) -> None:
    """MQTT-3.1.2-24/25 with MQTT-3.1.2-26: a PUBLISH discarded because it exceeds the client's Maximum Packet Size
    never reached the client, so it cannot have set up a Topic Alias: the next PUBLISH on that topic must carry
    the Topic Name (and may set the alias), never an empty Topic Name with an alias the client does not know."""
    topic = f"{uid}/t"
    client = raw(broker.port, V5)
    client.connect(f"{uid}-sub", properties={P.MAXIMUM_PACKET_SIZE: 200, P.TOPIC_ALIAS_MAXIMUM: 5})
    subscribe(client, topic, qos=0)
    publisher = raw(broker.port, V5)
    publisher.connect(f"{uid}-pub")
    publisher.send(Publish(topic, b"B" * 300))
    publisher.send(Publish(topic, b"small one"))
    publisher.send(Publish(topic, b"small two"))
    first, second = next_publish(client), next_publish(client)
    assert (first.topic, first.payload) == (topic, b"small one")
    alias = first.properties[P.TOPIC_ALIAS]
    assert 1 <= alias <= 5
    assert (second.topic, second.properties[P.TOPIC_ALIAS], second.payload) == ("", alias, b"small two")


def test_mqtt_3_3_2_7_outbound_topic_aliases_start_afresh_on_a_new_connection(broker: BrokerProcess, raw: Any,
                                                                              uid: str) -> None:
    """MQTT-3.3.2-7: Topic Alias mappings do not outlive the Network Connection: after the subscriber reconnects
    (resuming its session) the first PUBLISH on a topic carries the full Topic Name again."""
    topic = f"{uid}/t"
    props = {P.TOPIC_ALIAS_MAXIMUM: 3, P.SESSION_EXPIRY_INTERVAL: 60}
    client = raw(broker.port, V5)
    client.connect(uid, properties=props)
    subscribe(client, topic, qos=0)
    publish_marker(broker.port, topic)
    first = next_publish(client)
    assert (first.topic, first.properties[P.TOPIC_ALIAS]) == (topic, 1)
    graceful_close(client)
    again = raw(broker.port, V5)
    assert again.connect(uid, clean_start=False, properties=props).session_present is True
    publish_marker(broker.port, topic)
    renewed = next_publish(again)
    assert (renewed.topic, renewed.properties[P.TOPIC_ALIAS]) == (topic, 1)
    again.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}))
    assert closed(again)


def test_session_expiry_interval_capped_and_returned_in_connack(broker: BrokerProcess, raw: Any,
                                                                uid: str) -> None:
    """MQTT 5.0 §3.2.2.3.2: when the broker grants a Session Expiry Interval other than the one asked for (here
    the session_expiry_interval limit, 2 h, instead of "never"), the CONNACK carries the granted value; when it
    grants the request, the property is absent."""
    client = raw(broker.port, V5)
    ack = client.connect(uid, properties={P.SESSION_EXPIRY_INTERVAL: 0xFFFFFFFF})
    assert ack.properties[P.SESSION_EXPIRY_INTERVAL] == 7200
    client.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}))
    assert closed(client)
    client = raw(broker.port, V5)
    ack = client.connect(uid, properties={P.SESSION_EXPIRY_INTERVAL: 60})
    assert P.SESSION_EXPIRY_INTERVAL not in ack.properties
    client.send(Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 0}))
    assert closed(client)


def test_will_payload_not_matching_payload_format_indicator_connack_0x99(broker: BrokerProcess, raw: Any,
                                                                         uid: str) -> None:
    """MQTT 5.0 §3.1.3.2.3: a Will Payload Format Indicator of 1 with a Will Payload that is not UTF-8 may be
    refused with CONNACK 0x99 (Payload format invalid); the broker does, then closes."""
    client = raw(broker.port, V5)
    client.send(Connect(uid, V5, True, 60, will=Will(f"{uid}/w", b"\xff\xfe", 0, False,
                                                     {P.PAYLOAD_FORMAT_INDICATOR: 1})))
    assert closed(client)
    packet = client.recv()
    assert isinstance(packet, Connack), packet
    assert (packet.session_present, packet.reason_code) == (False, RC.PAYLOAD_FORMAT_INVALID)
