"""Peers for the upstream bridge tests (tests/test_upstream_*.py): a real Mosquitto standing in for the cloud
broker (started on 127.0.0.1 with a free port, config in a temporary directory, stopped by PID), a paho MQTT 5
subscriber on it, a local publisher thread, a watcher of the link's ``$SYS`` values, and a fake "half-open"
cloud broker that answers CONNECT but never acknowledges a PUBLISH."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import MQTT_5, Connack, Connect, PingReq, PingResp, PubAck, Publish
from gateway.mqtt.properties import PropertyId as P

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class Mosquitto:
    """A real Mosquitto on 127.0.0.1:``port`` with persistence in a temporary directory (sessions and queued
    messages survive :meth:`stop` + :meth:`start`, like a cloud broker's restart)."""

    def __init__(self, port: int | None = None, extra: str = "") -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="upstream-mosquitto-"))
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self, timeout: float = 10.0) -> Mosquitto:
        conf = self.dir / "mosquitto.conf"
        user = "user root\n" if os.geteuid() == 0 else ""  # as root it would drop to "mosquitto" (no tmp access)
        conf.write_text(
            f"{user}listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {self.dir}/\nautosave_interval 0\n{self.extra}\n"
        )
        self._log = open(self.dir / "mosquitto.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("mosquitto did not start:\n" + self.log()) from None
                time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM by PID and wait (Mosquitto saves its sessions and queued messages first)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        path = self.dir / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Received:
    """One message the stand-in cloud delivered to the test subscriber."""

    topic: str
    payload: bytes
    qos: int
    msg_id: str | None
    user_properties: list[tuple[str, str]]
    at: float


class CloudSubscriber:
    """A paho MQTT 5 subscriber on the stand-in cloud with a persistent session (it keeps its subscription and
    gets what was queued for it across Mosquitto restarts); reconnects by itself. A subscriber that leaves and comes
    back as a new instance should subscribe at QoS 1: paho forgets a QoS 2 message between PUBREC and PUBREL."""

    def __init__(self, port: int, topics: list[str], client_id: str, qos: int = 2) -> None:
        self.port = port
        self.topics = topics
        self.qos = qos
        self.messages: list[Received] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id, protocol=mqtt.MQTTv5)
        self.client.reconnect_delay_set(0.05, 0.3)
        self.client.on_connect = self._on_connect
        self.subacks = 0
        self.closed = False
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        client.subscribe([(t, self.qos) for t in self.topics])

    def _on_subscribe(self, *args: Any) -> None:
        with self.lock:
            self.subacks += 1
        self.subscribed.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        users = list(getattr(msg.properties, "UserProperty", []) or [])
        msg_id = next((v for k, v in users if k == "msg_id"), None)
        with self.lock:
            self.messages.append(Received(msg.topic, msg.payload, msg.qos, msg_id, users, time.monotonic()))

    def start(self) -> CloudSubscriber:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", self.port, clean_start=False, properties=props)
        self.client.loop_start()
        assert self.subscribed.wait(10), "the cloud subscriber was not subscribed"
        return self

    def on(self, topic: str) -> list[Received]:
        with self.lock:
            return [m for m in self.messages if m.topic == topic]

    def close(self) -> None:
        """Disconnect (the session stays on the broker); idempotent."""
        if not self.closed:
            self.closed = True
            self.client.disconnect()
            self.client.loop_stop()


class LocalClient:
    """A paho client on the gateway (MQTT 5 or 3.1.1): publishes, collects what its subscriptions deliver."""

    def __init__(self, port: int, client_id: str, protocol: int = mqtt.MQTTv5) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id, protocol=protocol)
        self.client.max_inflight_messages_set(100)
        self.messages: list[mqtt.MQTTMessage] = []
        self.lock = threading.Lock()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append(msg)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(topic, qos)
        assert done.wait(10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic, payload, qos)

    def payloads(self, topic: str) -> list[bytes]:
        with self.lock:
            return [m.payload for m in self.messages if m.topic == topic]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Publisher(threading.Thread):
    """Keeps publishing ``<index>`` to each of ``topics`` (round robin, at its QoS) until :meth:`finish`.
    ``acked()`` lists the (topic, index) pairs the gateway acknowledged (PUBACK / PUBCOMP)."""

    def __init__(
        self, port: int, client_id: str, topics: list[tuple[str, int]], start_index: int = 0, interval: float = 0.005
    ) -> None:
        super().__init__(daemon=True)
        self.client = LocalClient(port, client_id, mqtt.MQTTv311)
        self.topics = topics
        self.index = start_index
        self.interval = interval
        self.sent: list[tuple[str, int, mqtt.MQTTMessageInfo]] = []
        self.lock = threading.Lock()
        self._stop_flag = threading.Event()
        self.closed = False

    def run(self) -> None:
        while not self._stop_flag.is_set():
            for topic, qos in self.topics:
                info = self.client.publish(topic, str(self.index).encode(), qos)
                with self.lock:
                    self.sent.append((topic, self.index, info))
                self.index += 1
            self._stop_flag.wait(self.interval)

    def acked(self, topic: str | None = None) -> list[int]:
        with self.lock:
            return [
                i
                for t, i, info in self.sent
                if info.rc == mqtt.MQTT_ERR_SUCCESS and info.is_published() and (topic is None or t == topic)
            ]

    def finish(self, wait_acks: bool = True) -> None:
        """Stop publishing; wait until everything sent is acknowledged (unless the gateway is gone). Idempotent."""
        if self.closed:
            return
        self._stop_flag.set()
        if self.ident is not None:
            self.join(10)
        try:
            if wait_acks:
                assert wait_until(
                    lambda: all(info.rc == mqtt.MQTT_ERR_SUCCESS and info.is_published() for _, _, info in self.sent),
                    20,
                ), "the gateway did not acknowledge every publish"
        finally:
            self.client.close()
            self.closed = True


class SysWatcher(LocalClient):
    """Follows ``$SYS/broker/connection/<name>/#`` on the gateway: the latest values and every state seen."""

    def __init__(self, port: int, name: str, client_id: str) -> None:
        self.name = name
        self.values: dict[str, str] = {}
        self.states: list[str] = []
        self.warnings: list[str] = []
        super().__init__(port, client_id)
        self.subscribe(f"$SYS/broker/connection/{name}/#", 0)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        key = msg.topic.split(f"$SYS/broker/connection/{self.name}/", 1)[1]
        value = msg.payload.decode()
        with self.lock:
            if key == "warning":
                self.warnings.append(value)
                return
            self.values[key] = value
            if key == "state":
                self.states.append(value)

    def get(self, key: str) -> str | None:
        with self.lock:
            return self.values.get(key)

    def wait(self, key: str, value: str, timeout: float = 20.0) -> bool:
        return wait_until(lambda: self.get(key) == value, timeout)

    def wait_state_not(self, state: str, timeout: float = 20.0) -> bool:
        return wait_until(lambda: self.get("state") not in (None, state), timeout)


class FakeUpstream:
    """A "half-open" cloud broker: accepts TCP, answers CONNECT with CONNACK (MQTT 5: Receive Maximum
    ``receive_maximum``) and PINGREQ with PINGRESP, records every PUBLISH per connection (with its arrival time)
    and never acknowledges one, until ``ack`` is set (then it sends PUBACK like a healthy broker). While ``refuse``
    is set it closes every connection at once (a cloud that is down). ``max_packet_size`` (MQTT 5) is announced in
    the CONNACK; ``sizes`` records the byte count of every PUBLISH as it came off the wire."""

    def __init__(
        self, receive_maximum: int, ack: bool = False, refuse: bool = False, max_packet_size: int = 0
    ) -> None:
        self.receive_maximum = receive_maximum
        self.max_packet_size = max_packet_size
        self.sizes: list[int] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.connections: list[list[tuple[float, Publish]]] = []
        self.client_ids: list[str] = []
        self.lock = threading.Lock()
        self.ack = ack
        self.refuse = refuse
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.refuse:
                conn.close()
                continue
            with self.lock:
                self.connections.append([])
                self.client_ids.append("")
                index = len(self.connections) - 1
                self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn, index), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, index: int) -> None:
        reader = PacketReader(version=MQTT_5)
        version = MQTT_5
        raw = bytearray()
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                raw += data
                with self.lock:
                    self.sizes += [size for first, size in _frames(raw) if first >> 4 == 3]
                for packet in reader.feed(data):
                    if isinstance(packet, Connect):
                        version = packet.protocol_level
                        with self.lock:
                            self.client_ids[index] = packet.client_id
                        props = {P.RECEIVE_MAXIMUM: self.receive_maximum} if version == MQTT_5 else {}
                        if self.max_packet_size and version == MQTT_5:
                            props[P.MAXIMUM_PACKET_SIZE] = self.max_packet_size
                        conn.sendall(Connack(False, 0, props).encode(version))
                    elif isinstance(packet, PingReq):
                        conn.sendall(PingResp().encode(version))
                    elif isinstance(packet, Publish):
                        with self.lock:
                            self.connections[index].append((time.monotonic(), packet))
                        if self.ack and packet.qos == 1:
                            conn.sendall(PubAck(packet.packet_id).encode(version))  # type: ignore[arg-type]
        except OSError:
            return
        finally:
            conn.close()

    def publishes(self, index: int) -> list[Publish]:
        with self.lock:
            return [p for _, p in self.connections[index]] if index < len(self.connections) else []

    def arrivals(self, client_id: str) -> list[tuple[float, Publish]]:
        """Every PUBLISH from ``client_id`` over all its connections, with arrival times."""
        with self.lock:
            return [x for i, conn in enumerate(self.connections) if self.client_ids[i] == client_id for x in conn]

    def count(self) -> int:
        with self.lock:
            return len(self.connections)

    def close(self) -> None:
        self._closing = True
        self.sock.close()
        with self.lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(5)
        self._acceptor.join(5)


def _frames(buf: bytearray) -> list[tuple[int, int]]:
    """Take the whole packets off the front of ``buf``: (first byte, bytes of the whole packet) each, counted from
    the fixed header's own Remaining Length (MQTT 5.0 §2.1.4), not by any decoder."""
    out = []
    while len(buf) >= 2:
        remaining, shift, pos = 0, 0, 1
        while pos < len(buf):
            byte = buf[pos]
            remaining |= (byte & 0x7F) << shift
            shift += 7
            pos += 1
            if not byte & 0x80:
                break
        else:
            return out
        if buf[pos - 1] & 0x80 or len(buf) < pos + remaining:
            return out
        out.append((buf[0], pos + remaining))
        del buf[: pos + remaining]
    return out


def msg_id_of(packet: Publish) -> str | None:
    """The ``msg_id`` User Property of a PUBLISH the fake upstream received."""
    return next((v for k, v in packet.properties.get(P.USER_PROPERTY, []) if k == "msg_id"), None)


def first_copies(received: list[Received]) -> tuple[list[int], dict[int, set[str | None]]]:
    """The indices in arrival order with duplicates removed (first copy kept), and every msg_id seen per index."""
    order: list[int] = []
    ids: dict[int, set[str | None]] = {}
    for m in received:
        index = int(m.payload)
        if index not in ids:
            order.append(index)
            ids[index] = set()
        ids[index].add(m.msg_id)
    return order, ids
