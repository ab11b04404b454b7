"""MQTT over WebSockets: a real broker process with a ``protocol = "websockets"`` listener (``ws``), a
``wss`` one (TLS keys, certificates from tests/pki.py) and a plain TCP listener (``tcp``), LMDB store.

- paho-mqtt with ``transport="websockets"``: QoS 1 both ways (MQTT 3.1.1 and 5.0), mixed with TCP clients; a
  persistent session resumed over WebSockets after a broker restart (its queued messages come from the store);
  ``wss`` with and without a client certificate (``use_identity_as_username``).
- A raw client (a TCP socket and wsproto's client side, an implementation independent of the listener's
  ``websockets``): the HTTP upgrade (subprotocol selected, 404 on another path, 400 for a plain GET or a bad
  request, permessage-deflate declined), packets split across frames and several packets in one frame
  (MQTT-6.0.0-2), a text frame closes the connection (MQTT-6.0.0-1), pings answered and the close handshake, a
  frame too long or unmasked closes with 1009 / 1002, Receive Maximum holds over WebSockets, ``connect_timeout``
  bounds the upgrade and the CONNECT.
"""

from __future__ import annotations

import gc
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from bystanders import QoS1Pair
from helpers import BrokerProcess, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from pki import Issued, make_pki
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import (
    Connack,
    Connect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from gateway.mqtt.properties import PropertyId as P

CONNECT_TIMEOUT = 2.0  # seconds: the WebSocket listeners' connect_timeout


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    return make_pki(tmp_path_factory.mktemp("pki"))


ACL = """user alice
topic readwrite ws/alice/#
"""


def broker_config(pki: dict[str, Issued], workdir: Path) -> str:
    """The listeners (tcp, ws, ws_slow, ws_auth, wss, wss_cert); writes ws_auth's password file (alice/alice-pw, by
    Debian's ``mosquitto_passwd``) and ACL file into ``workdir``."""
    exe = shutil.which("mosquitto_passwd")
    if exe is None:
        pytest.skip("mosquitto_passwd is not installed (make deps installs the mosquitto package)")
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "passwd").exists():
        subprocess.run(
            [exe, "-c", "-b", str(workdir / "passwd"), "alice", "alice-pw"], check=True, timeout=30, capture_output=True
        )
    (workdir / "acl").write_text(ACL)
    server = pki["server"]
    return f"""
[store]
path = "store"
[listeners.tcp]
bind = "127.0.0.1:0"
[listeners.ws]
bind = "127.0.0.1:0"
protocol = "websockets"
connect_timeout = "{CONNECT_TIMEOUT}s"
[listeners.ws_slow]
bind = "127.0.0.1:0"
protocol = "websockets"
send_timeout = "2s"
max_mqueue_bytes = "4MB"
[listeners.ws_auth]
bind = "127.0.0.1:0"
protocol = "websockets"
allow_anonymous = false
password_file = "{workdir / "passwd"}"
acl_file = "{workdir / "acl"}"
[listeners.wss]
bind = "127.0.0.1:0"
protocol = "websockets"
path = "/mqtt"
certfile = "{server.cert}"
keyfile = "{server.key}"
cafile = "{pki["ca"].cert}"
use_identity_as_username = false
[listeners.wss_cert]
bind = "127.0.0.1:0"
protocol = "websockets"
certfile = "{server.cert}"
keyfile = "{server.key}"
cafile = "{pki["ca"].cert}"
require_certificate = true
use_identity_as_username = true
"""


@pytest.fixture(scope="module")
def ws_broker(pki: dict[str, Issued], tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir = tmp_path_factory.mktemp("ws")
    proc = BrokerProcess(broker_config(pki, workdir), workdir=str(workdir)).start()
    assert set(proc.ports) == {"tcp", "ws", "ws_slow", "ws_auth", "wss", "wss_cert"}, proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


# ---------------------------------------------------------------------------------------------- clients


def paho(client_id: str, transport: str = "websockets", version: Any = mqtt.MQTTv311, **kw: Any) -> mqtt.Client:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=version, transport=transport, **kw)
    if transport == "websockets":
        client.ws_set_options(path="/mqtt")
    return client


class Collector:
    """A paho subscriber that keeps the payloads it receives."""

    def __init__(self, client: mqtt.Client, topic: str, qos: int = 1) -> None:
        self.client = client
        self.got: list[bytes] = []
        self.flags: list[Any] = []
        self.subscribed = threading.Event()
        client.on_connect = lambda c, u, flags, rc, props=None: (self.flags.append(flags), c.subscribe(topic, qos))
        client.on_subscribe = lambda *a: self.subscribed.set()
        client.on_message = lambda c, u, msg: self.got.append(msg.payload)


def publish_all(client: mqtt.Client, topic: str, payloads: list[bytes], qos: int = 1) -> None:
    infos = [client.publish(topic, p, qos=qos) for p in payloads]
    for info in infos:
        info.wait_for_publish(10)
        assert info.is_published()  # PUBACK received


class RawWsClient:
    """A WebSocket client over a real TCP socket, driven by wsproto's client side: it sends MQTT packets in frames
    exactly as told (split or packed) and decodes what comes back with the project's codec."""

    def __init__(self, port: int, path: str = "/mqtt", subprotocols: list[str] | None = None, version: int = 5) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.reader = PacketReader(version=version)
        self.pending: list[Packet] = []
        self.events: list[Any] = []
        self.sock.sendall(
            self.ws.send(
                Request(
                    host="127.0.0.1", target=path, subprotocols=subprotocols if subprotocols is not None else ["mqtt"]
                )
            )
        )
        self.handshake = self._next_event(lambda e: isinstance(e, AcceptConnection | RejectConnection))

    def _read(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return True
        self.ws.receive_data(data or None)
        for event in self.ws.events():
            if isinstance(event, BytesMessage):
                self.pending.extend(self.reader.feed(event.data))
            else:
                self.events.append(event)
        return bool(data)

    def _next_event(self, match: Any, timeout: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events:
                if match(event):
                    self.events.remove(event)
                    return event
            if not self._read(deadline - time.monotonic()):
                break
        for event in self.events:
            if match(event):
                return event
        raise TimeoutError(f"no such event; have {self.events}")

    def send_frames(self, *frames: bytes) -> None:
        """Each argument is the payload of one binary frame."""
        self.sock.sendall(b"".join(self.ws.send(BytesMessage(data=f)) for f in frames))

    def recv(self, timeout: float = 5.0) -> Packet:
        deadline = time.monotonic() + timeout
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no packet")
            if not self._read(left):
                raise ConnectionError("closed by the broker")
        return self.pending.pop(0)

    def closed(self, timeout: float = 5.0) -> bool:
        """True when the broker closes the connection within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not self._read(deadline - time.monotonic()):
                    return True
        except (ConnectionError, OSError):
            return True
        return False

    def close(self) -> None:
        self.sock.close()


def raw_upgrade(
    port: int, path: str = "/mqtt", protocols: str | None = "mqtt", upgrade: bool = True, extra: str = ""
) -> str:
    """Send a hand-written HTTP/1.1 request (``extra``: more header lines, each ending in CRLF); return the response
    head (status line and headers)."""
    head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if upgrade:
        head += "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        head += "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    if protocols is not None:
        head += f"Sec-WebSocket-Protocol: {protocols}\r\n"
    return raw_request(port, head + extra + "\r\n")


def raw_request(port: int, text: str) -> str:
    """Send ``text`` as it is; return the response head (up to the blank line, or all that came before the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(text.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n\r\n", 1)[0].decode("latin-1")


def header(response: str, name: str) -> str | None:
    for line in response.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


# ---------------------------------------------------------------------------------------------- paho


@pytest.mark.parametrize("version", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v311", "v5"])
def test_paho_over_websockets_exchanges_qos1_with_tcp_clients(ws_broker: BrokerProcess, version: Any) -> None:
    """A WebSocket publisher and a TCP subscriber, then the other way round: QoS 1, in order, nothing lost."""
    topic = f"ws/{uuid.uuid4().hex}"
    ws_sub = paho(f"wsub-{uuid.uuid4().hex[:8]}", version=version)
    tcp_sub = paho(f"tsub-{uuid.uuid4().hex[:8]}", transport="tcp", version=version)
    ws_pub = paho(f"wpub-{uuid.uuid4().hex[:8]}", version=version)
    tcp_pub = paho(f"tpub-{uuid.uuid4().hex[:8]}", transport="tcp", version=version)
    subs = [Collector(ws_sub, topic + "/to-ws"), Collector(tcp_sub, topic + "/to-tcp")]
    clients = [(ws_sub, "ws"), (tcp_sub, "tcp"), (ws_pub, "ws"), (tcp_pub, "tcp")]
    for client, listener in clients:
        client.connect("127.0.0.1", ws_broker.ports[listener], keepalive=30)
        client.loop_start()
    try:
        for sub in subs:
            assert sub.subscribed.wait(10), ws_broker.log()
        payloads = [f"m{i}".encode() * (1 + i * 40) for i in range(60)]  # up to ~10 KB: several TCP segments
        publish_all(ws_pub, topic + "/to-tcp", payloads)
        publish_all(tcp_pub, topic + "/to-ws", payloads)
        wait_until(lambda: len(subs[0].got) >= 60 and len(subs[1].got) >= 60, what=ws_broker.log)
        assert subs[0].got == payloads
        assert subs[1].got == payloads
    finally:
        for client, _ in clients:
            client.disconnect()
            client.loop_stop()


def test_persistent_session_resumed_over_websockets_after_a_restart(pki: dict[str, Issued], tmp_path: Path) -> None:
    """MQTT 5 session (expiry 1 h) subscribed over WebSockets, offline while 30 QoS 1 messages arrive, the broker
    restarted (LMDB store): the client reconnects over WebSockets with Clean Start 0, gets Session Present 1 and
    all 30 messages in order."""
    proc = BrokerProcess(broker_config(pki, tmp_path), workdir=str(tmp_path)).start()
    cid = f"persist-{uuid.uuid4().hex[:8]}"
    topic = f"ws/persist/{uuid.uuid4().hex}"
    props = mqtt.Properties(mqtt.PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    try:
        sub = paho(cid, version=mqtt.MQTTv5)
        col = Collector(sub, topic)
        sub.connect("127.0.0.1", proc.ports["ws"], keepalive=30, clean_start=True, properties=props)
        sub.loop_start()
        assert col.subscribed.wait(10), proc.log()
        sub.disconnect()
        sub.loop_stop()
        pub = paho(f"pub-{uuid.uuid4().hex[:8]}", transport="tcp", version=mqtt.MQTTv5)
        pub.connect("127.0.0.1", proc.ports["tcp"], keepalive=30)
        pub.loop_start()
        payloads = [f"queued-{i}".encode() for i in range(30)]
        publish_all(pub, topic, payloads)
        pub.disconnect()
        pub.loop_stop()
        assert proc.stop() == 0, proc.log()
        proc = BrokerProcess(broker_config(pki, tmp_path), workdir=str(tmp_path)).start()
        again = paho(cid, version=mqtt.MQTTv5)
        col = Collector(again, topic)
        again.connect("127.0.0.1", proc.ports["ws"], keepalive=30, clean_start=False, properties=props)
        again.loop_start()
        wait_until(lambda: len(col.got) >= 30, what=proc.log)
        assert col.flags[0].session_present
        assert col.got == payloads
        again.disconnect()
        again.loop_stop()
    finally:
        assert proc.stop() == 0, proc.log()


def test_wss_with_and_without_a_client_certificate(ws_broker: BrokerProcess, pki: dict[str, Issued]) -> None:
    """wss (the TLS keys on a websockets listener): QoS 1 round trip with paho; on the ``require_certificate`` +
    ``use_identity_as_username`` listener the client certificate's CN is the user name (the broker logs it) and a
    client without a certificate is refused in the handshake."""
    topic = f"wss/{uuid.uuid4().hex}"
    sub = paho(f"wss-sub-{uuid.uuid4().hex[:8]}")
    sub.tls_set(ca_certs=str(pki["ca"].cert))
    col = Collector(sub, topic)
    pub = paho(f"wss-pub-{uuid.uuid4().hex[:8]}", version=mqtt.MQTTv5)
    pub.tls_set(ca_certs=str(pki["ca"].cert), certfile=str(pki["client"].cert), keyfile=str(pki["client"].key))
    sub.connect("localhost", ws_broker.ports["wss"], keepalive=30)
    pub.connect("localhost", ws_broker.ports["wss_cert"], keepalive=30)
    for client in (sub, pub):
        client.loop_start()
    try:
        assert col.subscribed.wait(10), ws_broker.log()
        payloads = [f"secure-{i}".encode() for i in range(20)]
        publish_all(pub, topic, payloads)
        wait_until(lambda: len(col.got) >= 20, what=ws_broker.log)
        assert col.got == payloads
    finally:
        for client in (sub, pub):
            client.disconnect()
            client.loop_stop()
    # without a client certificate the wss_cert listener refuses the TLS handshake
    context = ssl.create_default_context(cafile=str(pki["ca"].cert))
    with socket.create_connection(("127.0.0.1", ws_broker.ports["wss_cert"]), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = tls.recv(100)  # TLS 1.3: the refusal comes after the client's Finished
        except (ssl.SSLError, OSError):
            answer = b""
    assert answer == b"", answer  # an alert or a close, never an HTTP answer


# paho-mqtt 2.2 does not close its socket when the WebSocket handshake fails (WebsocketConnectionError)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_paho_client_on_another_path_is_refused(ws_broker: BrokerProcess) -> None:
    """paho asking for /other gets no connection (the broker answers 404)."""
    client = paho(f"lost-{uuid.uuid4().hex[:8]}")
    client.ws_set_options(path="/other")
    with pytest.raises((mqtt.WebsocketConnectionError, OSError)):
        client.connect("127.0.0.1", ws_broker.ports["ws"], keepalive=30)
    del client
    gc.collect()  # paho's leaked socket is reported here, where the mark above ignores it


# ---------------------------------------------------------------------------------------------- the upgrade


@pytest.mark.parametrize(
    ("offered", "selected"),
    [
        ("mqtt", "mqtt"),
        ("mqttv3.1", "mqttv3.1"),
        ("chat, mqtt", "mqtt"),
        ("mqttv3.1, mqtt", "mqttv3.1"),
        ("chat", None),
        (None, None),
    ],
)
def test_mqtt_6_0_0_4_subprotocol_selected_in_the_upgrade(
    ws_broker: BrokerProcess, offered: str | None, selected: str | None
) -> None:
    """A hand-written upgrade: 101 Switching Protocols, and Sec-WebSocket-Protocol is the first offered of "mqtt"
    and "mqttv3.1" (none when neither is offered: the upgrade is still accepted, as EMQX does by default)."""
    response = raw_upgrade(ws_broker.ports["ws"], protocols=offered)
    assert response.startswith("HTTP/1.1 101 "), response
    assert header(response, "Sec-WebSocket-Accept") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455 §1.3's example
    assert header(response, "Sec-WebSocket-Protocol") == selected


def test_other_paths_are_answered_404_and_a_plain_get_400(ws_broker: BrokerProcess) -> None:
    response = raw_upgrade(ws_broker.ports["ws"], path="/other")
    assert response.startswith("HTTP/1.1 404 "), response
    response = raw_upgrade(ws_broker.ports["ws"], path="/mqtt/x?y=1")
    assert response.startswith("HTTP/1.1 404 "), response
    assert raw_upgrade(ws_broker.ports["ws"], path="/mqtt?token=1").startswith("HTTP/1.1 101 ")  # query ignored
    assert raw_upgrade(ws_broker.ports["ws"], upgrade=False).startswith("HTTP/1.1 400 ")
    client = RawWsClient(ws_broker.ports["ws"], path="/nope")
    assert isinstance(client.handshake, RejectConnection) and client.handshake.status_code == 404
    body = client._next_event(lambda e: isinstance(e, RejectData))
    assert b"/nope" in body.data
    client.close()
    # not HTTP at all, and an upgrade whose key is not 16 bytes of base64: 400 with the reason
    assert raw_request(ws_broker.ports["ws"], "hello there\r\n\r\n").startswith("HTTP/1.1 400 ")
    bad_key = raw_request(
        ws_broker.ports["ws"],
        "GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: short\r\n\r\n",
    )
    assert bad_key.startswith("HTTP/1.1 400 "), bad_key


def test_permessage_deflate_offered_by_a_browser_is_declined(ws_broker: BrokerProcess) -> None:
    """Browsers offer permessage-deflate in every upgrade; the listener accepts the upgrade without it (no
    Sec-WebSocket-Extensions in the answer), so every frame stays uncompressed."""
    response = raw_upgrade(
        ws_broker.ports["ws"], extra="Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n"
    )
    assert response.startswith("HTTP/1.1 101 "), response
    assert header(response, "Sec-WebSocket-Extensions") is None, response


# ---------------------------------------------------------------------------------------------- frames


def test_mqtt_6_0_0_2_packets_split_across_frames_and_packed_in_one(ws_broker: BrokerProcess) -> None:
    """CONNECT in three frames cut mid-header and mid-string; then SUBSCRIBE + PUBLISH + PINGREQ in one frame, and
    a PUBLISH whose second half shares a frame with a PINGREQ: every packet is handled as from TCP."""
    client = RawWsClient(ws_broker.ports["ws"])
    assert isinstance(client.handshake, AcceptConnection) and client.handshake.subprotocol == "mqtt"
    connect = Connect(f"raw-{uuid.uuid4().hex[:8]}", 5, True, 30).encode(5)
    client.send_frames(connect[:1], connect[1:9], connect[9:])
    connack = client.recv()
    assert isinstance(connack, Connack) and connack.reason_code == 0
    topic = f"ws/raw/{uuid.uuid4().hex}"
    subscribe = Subscribe(1, [Subscription(topic, 1)]).encode(5)
    publish = Publish(topic, b"packed", qos=1, packet_id=2).encode(5)
    client.send_frames(subscribe + publish + PingReq().encode(5))
    got = [client.recv() for _ in range(4)]
    kinds = [type(p) for p in got]
    assert Suback in kinds and PubAck in kinds and PingResp in kinds, got
    delivered = [p for p in got if isinstance(p, Publish)]
    assert delivered and delivered[0].payload == b"packed"
    client.send_frames(PubAck(delivered[0].packet_id).encode(5))
    big = Publish(topic, b"x" * 3000 + b"end", qos=1, packet_id=3).encode(5)
    client.send_frames(big[:1500], big[1500:] + PingReq().encode(5))
    got = [client.recv() for _ in range(3)]
    assert {type(p) for p in got} == {PubAck, PingResp, Publish}, got
    assert next(p for p in got if isinstance(p, Publish)).payload.endswith(b"end")
    client.close()


def test_mqtt_6_0_0_1_a_text_frame_closes_the_connection(ws_broker: BrokerProcess) -> None:
    client = RawWsClient(ws_broker.ports["ws"], version=4)
    client.send_frames(Connect(f"text-{uuid.uuid4().hex[:8]}", 4, True, 30).encode(4))
    assert isinstance(client.recv(), Connack)
    client.sock.sendall(client.ws.send(TextMessage(data="not binary")))
    close = client._next_event(lambda e: isinstance(e, CloseConnection))
    assert close.code == 1003
    assert client.closed()
    client.close()
    assert "MQTT-6.0.0-1" in wait_until(lambda: ws_broker.log() if "text frame" in ws_broker.log() else "")


def test_a_ping_is_answered_and_a_close_is_answered_then_the_connection_closes(ws_broker: BrokerProcess) -> None:
    """RFC 6455 §5.5.2-3 and §5.5.1: a Ping gets a Pong with its payload, between MQTT packets; the client's Close
    (1000) is echoed and the broker closes the TCP connection."""
    client = RawWsClient(ws_broker.ports["ws"], version=4)
    client.send_frames(Connect(f"ping-{uuid.uuid4().hex[:8]}", 4, True, 30).encode(4))
    assert isinstance(client.recv(), Connack)
    client.sock.sendall(client.ws.send(Ping(payload=b"are you there")))
    pong = client._next_event(lambda e: isinstance(e, Pong))
    assert pong.payload == b"are you there"
    client.send_frames(PingReq().encode(4))
    assert isinstance(client.recv(), PingResp)  # MQTT goes on after the WebSocket ping
    client.sock.sendall(client.ws.send(CloseConnection(code=1000, reason="bye")))
    close = client._next_event(lambda e: isinstance(e, CloseConnection))
    assert close.code == 1000
    assert client.closed()
    client.close()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        # a binary frame announcing 1 MiB + 1 bytes (the listener's max_packet_size is 1 MiB): 1009 Message Too Big,
        # before its payload arrives
        (b"\x82\xff" + (1024 * 1024 + 1).to_bytes(8, "big") + b"\x01\x02\x03\x04", 1009),
        (b"\x82\x02ab", 1002),  # not masked (RFC 6455 §5.1): 1002 Protocol Error
    ],
    ids=["too-long", "unmasked"],
)
def test_a_frame_the_listener_refuses_closes_the_connection(ws_broker: BrokerProcess, frame: bytes, code: int) -> None:
    """A frame longer than the listener's ``max_packet_size`` (the library holds a whole frame before handing it
    over, so this bounds a connection's memory), or an unmasked one, closes the connection with the WebSocket close
    code that says why; the broker logs it."""
    client = RawWsClient(ws_broker.ports["ws"], version=4)
    client.send_frames(Connect(f"refused-{uuid.uuid4().hex[:8]}", 4, True, 30).encode(4))
    assert isinstance(client.recv(), Connack)
    client.sock.sendall(frame)
    close = client._next_event(lambda e: isinstance(e, CloseConnection))
    assert close.code == code
    assert client.closed()
    client.close()
    wait_until(lambda: "WebSocket error" in ws_broker.log(), what=ws_broker.log)


def test_receive_maximum_holds_over_websockets(ws_broker: BrokerProcess) -> None:
    """A raw MQTT 5 subscriber with Receive Maximum 2: of 6 QoS 1 messages it gets 2 until it acknowledges."""
    client = RawWsClient(ws_broker.ports["ws"])
    client.send_frames(Connect(f"rm-{uuid.uuid4().hex[:8]}", 5, True, 30, properties={P.RECEIVE_MAXIMUM: 2}).encode(5))
    assert isinstance(client.recv(), Connack)
    topic = f"ws/rm/{uuid.uuid4().hex}"
    client.send_frames(Subscribe(1, [Subscription(topic, 1)]).encode(5))
    assert isinstance(client.recv(), Suback)
    pub = paho(f"rm-pub-{uuid.uuid4().hex[:8]}", transport="tcp")
    pub.connect("127.0.0.1", ws_broker.ports["tcp"], keepalive=30)
    pub.loop_start()
    try:
        publish_all(pub, topic, [f"{i}".encode() for i in range(6)])
        first = [client.recv(), client.recv()]
        assert [p.payload for p in first] == [b"0", b"1"]  # type: ignore[attr-defined]
        with pytest.raises(TimeoutError):
            client.recv(timeout=1.0)
        client.send_frames(b"".join(PubAck(p.packet_id).encode(5) for p in first))  # type: ignore[attr-defined]
        rest = [client.recv(), client.recv()]
        assert [p.payload for p in rest] == [b"2", b"3"]  # type: ignore[attr-defined]
    finally:
        pub.disconnect()
        pub.loop_stop()
        client.close()


def test_connect_timeout_bounds_the_upgrade_and_the_connect(ws_broker: BrokerProcess) -> None:
    """A client that sends nothing, and one that upgrades but never sends CONNECT, are closed after
    ``connect_timeout`` (2 s, plus the broker's one-second tick)."""
    silent = socket.create_connection(("127.0.0.1", ws_broker.ports["ws"]), timeout=10)
    upgraded = RawWsClient(ws_broker.ports["ws"])
    start = time.monotonic()
    try:
        assert silent.recv(100) == b""
        assert upgraded.closed(timeout=10)
        assert time.monotonic() - start >= CONNECT_TIMEOUT - 0.5
    finally:
        silent.close()
        upgraded.close()


def test_websocket_clients_are_counted_like_tcp_clients_in_the_metrics(tmp_path: Path) -> None:
    """WebSocket clients go through the same connection code as TCP ones, so Prometheus counts them the
    same: ``edge_gateway_clients_connected{listener="ws"}`` and ``edge_gateway_connections_total``."""
    from test_metrics import metrics_port, scrape, value

    config = '[store]\nbackend = "memory"\n[metrics]\nbind = "127.0.0.1:0"\n[listeners.tcp]\nbind = "127.0.0.1:0"\n'
    config += '[listeners.ws]\nbind = "127.0.0.1:0"\nprotocol = "websockets"\n'
    proc = BrokerProcess(config, workdir=str(tmp_path)).start()
    clients = []
    try:
        port = metrics_port(proc)
        before = value(scrape(port), "edge_gateway_connections_total")
        for transport, listener in (("websockets", "ws"), ("websockets", "ws"), ("tcp", "tcp")):
            client = paho(f"counted-{uuid.uuid4().hex[:8]}", transport=transport)
            connected = threading.Event()
            client.on_connect = lambda *a, ev=connected: ev.set()
            client.connect("127.0.0.1", proc.ports[listener], keepalive=30)
            client.loop_start()
            assert connected.wait(10), proc.log()
            clients.append(client)
        samples = scrape(port)
        assert value(samples, "edge_gateway_clients_connected", listener="ws") == 2
        assert value(samples, "edge_gateway_clients_connected", listener="tcp") == 1
        assert value(samples, "edge_gateway_connections_total") - before == 3
    finally:
        for client in clients:
            client.disconnect()
            client.loop_stop()
        assert proc.stop() == 0, proc.log()


def test_a_websocket_subscriber_that_stops_reading_is_closed_after_send_timeout(ws_broker: BrokerProcess) -> None:
    """Flow control goes through the WebSocket layer: a subscriber on ``ws_slow`` (send_timeout 2 s,
    max_mqueue_bytes 4 MB) that stops reading while 50 MB of QoS 1 messages are published to it is closed after
    send_timeout (logged with its client id), the publisher is never held back for long, and a QoS 1 pair on the
    TCP listener loses nothing."""
    uid = uuid.uuid4().hex[:8]
    pair = QoS1Pair(ws_broker.ports["tcp"], f"bystander-{uid}").start()
    slow = RawWsClient(ws_broker.ports["ws_slow"], version=5)
    slow.send_frames(Connect(f"slow-{uid}", 5, True, 60).encode(5))
    assert isinstance(slow.recv(), Connack)
    slow.send_frames(Subscribe(1, [Subscription(f"flood/{uid}/#", 1)]).encode(5))
    assert isinstance(slow.recv(), Suback)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read again
    pub = paho(f"flood-{uid}", transport="tcp", version=mqtt.MQTTv5)
    pub.connect("127.0.0.1", ws_broker.ports["tcp"], keepalive=30)
    pub.loop_start()
    try:
        publish_all(pub, f"flood/{uid}/a", [i.to_bytes(4, "big") + b"y" * 500_000 for i in range(100)])
        wait_until(
            lambda: any("send_timeout" in line and f"slow-{uid}" in line for line in ws_broker.lines),
            timeout=15,
            what=ws_broker.log,
        )
        pair.finish()
    finally:
        pub.disconnect()
        pub.loop_stop()
        slow.close()


def test_password_file_and_acl_apply_over_websockets(ws_broker: BrokerProcess) -> None:
    """``ws_auth`` (allow_anonymous false, a mosquitto_passwd file, an ACL): a wrong password and no user name are
    refused in CONNACK (0x86 / 0x87); alice gets in, her PUBLISH to her own topic is delivered and acknowledged,
    one outside her ACL gets PUBACK 0x87 Not authorized and is not delivered."""
    port = ws_broker.ports["ws_auth"]
    for user, password, code in (("alice", "wrong", 0x86), (None, None, 0x87)):
        raw = RawWsClient(port)
        raw.send_frames(
            Connect(
                f"auth-{uuid.uuid4().hex[:8]}",
                5,
                True,
                30,
                username=user,
                password=password.encode() if password else None,
            ).encode(5)
        )
        connack = raw.recv()
        assert isinstance(connack, Connack) and connack.reason_code == code, connack
        assert raw.closed()
        raw.close()
    uid = uuid.uuid4().hex[:8]
    watcher = paho(f"watch-{uid}", transport="tcp")
    col = Collector(watcher, "#", qos=1)
    watcher.connect("127.0.0.1", ws_broker.ports["tcp"], keepalive=30)
    watcher.loop_start()
    alice = RawWsClient(port)
    try:
        assert col.subscribed.wait(10)
        alice.send_frames(Connect(f"alice-{uid}", 5, True, 30, username="alice", password=b"alice-pw").encode(5))
        connack = alice.recv()
        assert isinstance(connack, Connack) and connack.reason_code == 0, connack
        alice.send_frames(
            Publish(f"ws/alice/{uid}", b"mine", 1, packet_id=1).encode(5),
            Publish(f"other/{uid}", b"not mine", 1, packet_id=2).encode(5),
        )
        acks = {p.packet_id: p.reason_code for p in (alice.recv(), alice.recv()) if isinstance(p, PubAck)}
        assert acks == {1: 0, 2: 0x87}, acks
        wait_until(lambda: b"mine" in col.got, what=ws_broker.log)
        time.sleep(0.3)
        assert b"not mine" not in col.got
    finally:
        watcher.disconnect()
        watcher.loop_stop()
        alice.close()
