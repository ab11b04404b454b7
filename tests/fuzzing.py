"""The fuzz target over the codec and the broker's packet handling, in process (sans-I/O): hostile clients must
not crash or wedge the broker (docs/reliability.md).

:func:`run_input` turns one input (bytes from a fuzzing engine: atheris/libFuzzer in ``make fuzz``, hypothesis in
tests/test_fuzz.py) into a bounded script against a fresh :class:`~gateway.broker.broker.Broker` with tight limits:
hostile connections of every protocol level (3, 4, 5) send valid packets of every type built from the input,
the same packets mutated (bits flipped, bytes overwritten, inserted, cut, a Remaining Length replaced), random
bytes, oversized Remaining Lengths, any of these split at arbitrary points; the clock moves (``tick``), sockets
close and stall (``connection_lost``, ``pause_writing``). A well-behaved pair (a persistent QoS 1 subscriber and a
publisher, MQTT 5) exchanges numbered messages before and after.

After every step :func:`check` asserts the invariants; after the script, that the pair lost nothing. A failure is
an exception (``AssertionError`` for a broken invariant, anything else escaped ``receive``/``tick``), which the
engine reports with the input that caused it.

Invariants (sources: MQTT 5.0 §4.9 flow control; docs/architecture.md, "Session semantics" and "The durability
contract"):

- nothing raises out of ``open``, ``receive``, ``resume``, ``tick``, ``connection_lost``;
- everything the broker writes to a connected client decodes as packets of its protocol level, and a
  connection written a DISCONNECT is closed;
- counters are never negative; ``clients_connected`` and ``listener_clients`` equal the connected sessions;
  ``persistent_count`` equals the persistent sessions; the subscription tree holds exactly the sessions'
  subscriptions;
- each Message Queue's length and byte count equal its contents, within ``max_mqueue_len``; each Inflight Window
  holds at most the connection's window; inbound QoS 2 awaiting PUBREL plus unacknowledged QoS 1 stay within
  ``max_awaiting_rel`` and are never negative;
- retained counts and bytes equal the retained messages and stay within the broker's limits;
- the store's rows (:class:`RowStore`, the SessionStore interface kept as rows in memory) match the broker:
  one session row per persistent session, its subscriptions, its QoS 2 messages awaiting PUBREL, and the
  retained messages outside ``$SYS``.

With ``store_dir`` (:func:`run_input`; tests/test_fuzz.py, ``make fuzz FUZZ_STORE=lmdb``) the broker runs on the real
:class:`~gateway.store.lmdb_store.LmdbStore` in a directory below it instead (committing synchronously, as with no event
loop; ``mqueue_mem_len`` 2, so persistent queues page to LMDB and back): the same invariants, with the store's rows
read from the LMDB tables key by key (sessions, subscriptions, inbound QoS 2, retained) and each Message Queue
iterated through its pager (the paged part is read back from LMDB); and at the end the store is closed and opened
again by a second broker (a restart), which must restore the same persistent sessions with the same
subscriptions, QoS 2 messages awaiting PUBREL and queued messages, and the same retained messages.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import Any

from recording_broker import RecordingBroker

from gateway.broker.broker import Broker
from gateway.broker.connection_states import CLOSED, CONNECTED
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.retained_store import retained_size
from gateway.broker.session_state import Connection, Session
from gateway.broker.store_port import MemoryStore, SessionStore
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.errors import MQTTError
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import (
    MQTT_5,
    Auth,
    Connack,
    Connect,
    Disconnect,
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
from gateway.store import records as rec
from gateway.store.lmdb_store import LmdbStore
from gateway.store.settings import StoreSettings

#: Steps of one script at most, and hostile connections open at once at most (bounded work per input).
MAX_STEPS = 48
MAX_CONNS = 4

TOPICS = ["a", "a/b", "a/b/c", "by/t", "$SYS/x", "+/b", "a/#", "#", "$share/g/a/#", "é/ü", "", "a//b", "x" * 70,
          "l/" * 6, "a/+/c", "$share/g", "a/\x00"]
CLIENT_IDS = ["c0", "c1", "c2", "", "c0"]
PAYLOADS = [b"", b"p", b"x" * 300, "ü".encode(), b"\xff\xfe"]


class RowStore(MemoryStore):
    """The broker's SessionStore interface keeping its rows in memory, as LmdbStore keeps them in tables
    (sessions, subscriptions, inbound QoS 2, retained), so the fuzzer can check them against the broker's state.
    Commits are immediate, as MemoryStore's."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: set[str] = set()
        self.subs: dict[str, set[str]] = {}
        self.inbound: dict[str, set[int]] = {}
        self.retained: set[str] = set()
        self.deliveries: dict[str, set[int]] = {}

    def session_saved(self, session: Session) -> None:
        self.sessions.add(session.client_id)

    def session_deleted(self, client_id: str) -> None:
        self.sessions.discard(client_id)
        self.subs.pop(client_id, None)
        self.inbound.pop(client_id, None)
        self.deliveries.pop(client_id, None)

    def subscription_saved(self, client_id: str, record: SubscriptionRecord) -> None:
        self.subs.setdefault(client_id, set()).add(record.key)

    def subscription_deleted(self, client_id: str, key: str) -> None:
        self.subs.get(client_id, set()).discard(key)

    def delivery_saved(self, client_id: str, delivery: Delivery) -> None:
        self.deliveries.setdefault(client_id, set()).add(delivery.seq)

    def delivery_deleted(self, client_id: str, delivery: Delivery) -> None:
        self.deliveries.get(client_id, set()).discard(delivery.seq)

    def deliveries_deleted(self, client_id: str, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self.delivery_deleted(client_id, delivery)

    def inbound_saved(self, client_id: str, packet_id: int, message: Message) -> None:
        self.inbound.setdefault(client_id, set()).add(packet_id)

    def inbound_deleted(self, client_id: str, packet_id: int) -> None:
        self.inbound.get(client_id, set()).discard(packet_id)

    def retained_saved(self, message: Message) -> None:
        self.retained.add(message.topic)

    def retained_deleted(self, topic: str) -> None:
        self.retained.discard(topic)


class Choices:
    """Decisions read from the input, byte by byte; past its end every decision is 0 (so every input is a
    finite, valid script)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def more(self) -> bool:
        return self.pos < len(self.data)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def pick(self, n: int) -> int:
        """0..n-1."""
        if n <= 256:
            return self.byte() % n
        return (self.byte() << 8 | self.byte()) % n

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += len(chunk)
        return chunk

    def of(self, items: list[Any]) -> Any:
        return items[self.pick(len(items))]


def _props(c: Choices, kind: str) -> dict[int, Any]:
    """A few MQTT 5 properties for a packet of ``kind``, valid and not."""
    props: dict[int, Any] = {}
    for _ in range(c.pick(3)):
        which = c.pick(12)
        if which == 0:
            props[P.TOPIC_ALIAS] = c.pick(12)
        elif which == 1:
            props[P.MESSAGE_EXPIRY_INTERVAL] = c.pick(400)
        elif which == 2:
            props[P.PAYLOAD_FORMAT_INDICATOR] = c.pick(2)
        elif which == 3:
            props[P.RESPONSE_TOPIC] = c.of(TOPICS)
        elif which == 4:
            props[P.SESSION_EXPIRY_INTERVAL] = c.of([0, 1, 60, 0xFFFFFFFF])
        elif which == 5:
            props[P.RECEIVE_MAXIMUM] = 1 + c.pick(4)
        elif which == 6:
            props[P.MAXIMUM_PACKET_SIZE] = c.of([20, 64, 1000, 100_000])
        elif which == 7:
            props[P.TOPIC_ALIAS_MAXIMUM] = c.pick(5)
        elif which == 8 and kind == "subscribe":
            props[P.SUBSCRIPTION_IDENTIFIER] = [1 + c.pick(5)]
        elif which == 9:
            props[P.USER_PROPERTY] = [("k", "v" * c.pick(4))]
        elif which == 10:
            props[P.WILL_DELAY_INTERVAL] = c.pick(30)
        elif which == 11:
            props[P.REASON_STRING] = "r"
    return props


def valid_packet(c: Choices, version: int) -> bytes:
    """A packet of any type a client (or, wrongly, a server) sends, at ``version``, from the input."""
    kind = c.pick(16)
    pid = 1 + c.pick(8)
    v5 = version == MQTT_5
    props = _props(c, "subscribe" if kind == 2 else "") if v5 and c.pick(2) else {}
    try:
        if kind == 0:
            will = None
            if c.pick(3) == 0:
                will = Will(c.of(TOPICS), c.of(PAYLOADS), c.pick(3), bool(c.pick(2)), props if v5 else {})
            packet: Any = Connect(c.of(CLIENT_IDS), version, bool(c.pick(2)), c.of([0, 1, 5, 60]),
                                  c.of([None, "u"]), c.of([None, b"pw"]), will, props)
            return packet.encode(version)
        if kind in (1, 8, 9):
            qos = c.pick(3)
            return Publish(c.of(TOPICS), c.of(PAYLOADS), qos, bool(c.pick(2)), bool(c.pick(2)),
                           pid if qos else None, props).encode(version)
        if kind == 2:
            subs = [Subscription(c.of(TOPICS), c.pick(3), bool(c.pick(2)), bool(c.pick(2)), c.pick(3))
                    for _ in range(1 + c.pick(3))]
            return Subscribe(pid, subs, props).encode(version)
        if kind == 3:
            return Unsubscribe(pid, [c.of(TOPICS) for _ in range(1 + c.pick(2))], props).encode(version)
        ack = (PubAck, PubRec, PubRel, PubComp)[kind - 4] if 4 <= kind <= 7 else None
        if ack is not None:
            return ack(pid, c.of([0, 0x10, 0x80, 0x92]) if v5 else 0).encode(version)
        if kind == 10:
            return PingReq().encode(version)
        if kind == 11:
            return Disconnect(c.of([0, 4, 0x80]) if v5 else 0, props).encode(version)
        if kind == 12:
            return Auth(c.of([0, 0x18]), props).encode(MQTT_5)
        if kind == 13:
            return Connack(bool(c.pick(2)), 0).encode(version)
        if kind == 14:
            return Suback(pid, [0]).encode(version) if c.pick(2) else Unsuback(pid, [0]).encode(version)
        return PingResp().encode(version)
    except (ValueError, OverflowError, struct.error, MQTTError):
        return b"\xc0\x00"  # a combination the encoder refuses: a PINGREQ instead


def mutate(c: Choices, data: bytes) -> bytes:
    """``data`` changed by a few edits chosen by the input."""
    buf = bytearray(data)
    for _ in range(1 + c.pick(4)):
        op = c.pick(7)
        at = c.pick(len(buf) + 1) if buf else 0
        if op == 0 and buf:
            buf[at % len(buf)] ^= 1 << c.pick(8)
        elif op == 1 and buf:
            buf[at % len(buf)] = c.byte()
        elif op == 2:
            buf[at:at] = c.take(1 + c.pick(8))
        elif op == 3:
            del buf[at:at + 1 + c.pick(8)]
        elif op == 4:
            buf = buf[:at]
        elif op == 5 and len(buf) > 1:
            # a Remaining Length of 1-4 bytes, possibly overlong or past the real body
            length = c.of([0, 1, 127, 128, 16383, 16384, 2_097_151, 268_435_455])
            encoded = bytearray()
            while True:
                byte, length = length % 128, length // 128
                encoded.append(byte | (0x80 if length else 0))
                if not length:
                    break
            if c.pick(4) == 0:
                encoded = bytearray(b"\xff\xff\xff\xff\x7f")  # five bytes: malformed
            end = 2
            while end < len(buf) and end < 5 and buf[end - 1] & 0x80:
                end += 1
            buf[1:end] = encoded
        elif op == 6:
            buf[0:1] = bytes((c.byte(),))
    return bytes(buf)


class Harness:
    """One script: a fresh broker, the pair, the hostile connections, the clock."""

    def __init__(self, c: Choices, store_path: str | None = None) -> None:
        self.c = c
        self.now = 1000.0
        self.store: SessionStore
        if store_path is None:
            self.store = RowStore()
        else:
            self.store = LmdbStore(StoreSettings(path=store_path, max_size=16 * 1024 * 1024, mqueue_mem_len=2,
                                                 lazy_commit=0.0), ZoneLimits)
        self.settings = BrokerSettings(sys_interval=0 if c.pick(2) else 30.0, max_sessions=6,
                                       max_retained_messages=4, max_retained_bytes=1200)
        self.broker = RecordingBroker(self.settings, self.store, now=self.now)
        self.limits = ZoneLimits(max_inflight=2, max_mqueue_len=4, max_mqueue_bytes=2000, max_awaiting_rel=3,
                                 await_rel_timeout=60, topic_alias_maximum=4, max_topic_levels=4,
                                 max_topic_length=64, max_subscriptions=3, max_packet_size=4096,
                                 max_connections=5, connect_timeout=5, retry_interval=float(c.pick(2) * 10),
                                 max_publish_rate=float(c.of([0, 0, 2, 50])), high_watermark=4096,
                                 send_timeout=30, session_expiry_interval=300, message_expiry_interval=100)
        self.bystander_limits = ZoneLimits(max_connections=5)
        self.readers: dict[Connection, PacketReader] = {}
        self.versions: dict[Connection, int] = {}
        self.hostile: list[Connection] = []
        self.received: list[Any] = []  # packets written to hostile connections, for acknowledgements
        self.sub = self.open(self.bystander_limits, "pair")
        self.pub = self.open(self.bystander_limits, "pair")
        self.pair_got: set[bytes] = set()
        self.pair_sent: list[bytes] = []

    # -------------------------------------------------------------------------------- driving the broker

    def open(self, limits: ZoneLimits, listener: str) -> Connection:
        conn = self.broker.open(limits, listener, f"10.0.0.{len(self.readers)}:1", self.now)
        self.readers[conn] = PacketReader(version=4)
        return conn

    def send(self, conn: Connection, data: bytes) -> None:
        broker = self.broker
        broker.receive(conn, data, self.now)
        for _ in range(100_000):  # the I/O layer's loop over a long run of PUBACKs
            if not conn.pending:
                break
            broker.resume(conn, self.now)
        assert not conn.pending, "resume() never finished"

    def drain(self) -> None:
        """Read what the broker wrote, as clients would; the pair acknowledges and records what it got."""
        for conn in list(self.readers):
            data = self.broker.take(conn)
            if not data:
                continue
            if conn.session is None and conn.state != CONNECTED and conn not in self.versions:
                continue  # answers before a CONNECT was accepted are encoded at the level the client asked for
            reader = self.readers[conn]
            reader.version = conn.version
            packets = list(reader.feed(data))
            for i, packet in enumerate(packets):
                if isinstance(packet, Disconnect):
                    assert conn.state == CLOSED, f"DISCONNECT 0x{packet.reason_code:02X} written to an open connection"
                    assert i == len(packets) - 1, "packets written after a DISCONNECT"
            self.versions[conn] = conn.version
            if conn is self.sub:
                for packet in packets:
                    if isinstance(packet, Publish):
                        self.pair_got.add(packet.payload)
                        if packet.qos == 1:
                            self.send(conn, PubAck(packet.packet_id).encode(5))  # type: ignore[arg-type]
            elif conn is not self.pub:
                self.received.extend(packets[-8:])
                del self.received[:-16]

    def pair_start(self) -> None:
        sub, pub = self.sub, self.pub
        self.send(sub, Connect("pair-sub", MQTT_5, False, 0, properties={P.SESSION_EXPIRY_INTERVAL: 600}).encode(5))
        self.send(sub, Subscribe(1, [Subscription("by/t", 1)]).encode(5))
        self.send(pub, Connect("pair-pub", MQTT_5, True, 0).encode(5))
        self.readers[sub].version = self.readers[pub].version = MQTT_5
        self.drain()
        self.pair_publish()

    def pair_publish(self) -> None:
        if self.pub.state != CONNECTED:
            return
        number = str(len(self.pair_sent)).encode()
        self.pair_sent.append(number)
        self.send(self.pub, Publish("by/t", number, 1, packet_id=1 + len(self.pair_sent) % 60000).encode(5))
        self.drain()

    def step(self) -> None:
        c, broker = self.c, self.broker
        for gone in [conn for conn in self.hostile if conn.state == CLOSED]:
            broker.connection_lost(gone, self.now)  # as the I/O layer does once the socket closed
            self.hostile.remove(gone)
        op = c.pick(16)
        if op <= 1 or not self.hostile:
            if len(self.hostile) < MAX_CONNS:
                conn = self.open(self.limits, "external")
                self.hostile.append(conn)
                if c.pick(4):  # mostly a valid CONNECT first, so the script gets past it
                    version = c.of([3, 4, 5, 5])
                    props = {P.SESSION_EXPIRY_INTERVAL: c.of([0, 30, 600])} if version == MQTT_5 else {}
                    if version == MQTT_5 and c.pick(2):
                        props[P.RECEIVE_MAXIMUM] = 1 + c.pick(3)
                    will = None
                    if c.pick(4) == 0:
                        will = Will("w/" + c.of(TOPICS[:3]), b"will", c.pick(3), bool(c.pick(2)))
                    self.send(conn, Connect(c.of(CLIENT_IDS[:3]), version, bool(c.pick(2)), c.of([0, 5, 60]),
                                            will=will, properties=props).encode(version))
            return
        conn = c.of(self.hostile)
        version = conn.version if conn.state == CONNECTED else c.of([3, 4, 5, 5])
        if op <= 6:
            data = valid_packet(c, version)
        elif op == 7:
            data = mutate(c, valid_packet(c, version))
        elif op == 8:
            data = c.take(c.pick(64))
        elif op == 9:
            data = bytes((c.byte(),)) + c.of([b"\xff\xff\xff\x7f", b"\x80\x80\x80\x01", b"\xff\xff\xff\xff\x01"])
            data += c.take(c.pick(32))
        elif op == 10:
            data = b"".join(valid_packet(c, version) for _ in range(2 + c.pick(6)))
        elif op == 11:
            self.now += c.of([0.001, 1, 5, 31, 61, 301, 700])
            broker.tick(self.now)
            return
        elif op == 12:
            broker.connection_lost(conn, self.now)
            self.hostile.remove(conn)
            return
        elif op == 13:
            if c.pick(2):
                broker.pause_writing(conn, self.now)
            else:
                broker.resume_writing(conn, self.now)
            return
        else:
            data = self._acknowledge(c, version)
        if op != 7 and c.pick(3) == 0 and len(data) > 1:
            cut = 1 + c.pick(len(data) - 1)
            self.send(conn, data[:cut])
            data = data[cut:]
        self.send(conn, data)

    def _acknowledge(self, c: Choices, version: int) -> bytes:
        """Acknowledge a PUBLISH or PUBREC a hostile connection received (or one it did not)."""
        for packet in reversed(self.received):
            if isinstance(packet, Publish) and packet.qos and c.pick(2):
                cls = PubAck if packet.qos == 1 else PubRec
                return cls(packet.packet_id).encode(version)  # type: ignore[arg-type]
            if isinstance(packet, PubRec) and c.pick(2):
                return PubRel(packet.packet_id).encode(version)
        return PubComp(1 + c.pick(4)).encode(version)

    def run(self) -> None:
        self.pair_start()
        check(self)
        for _ in range(MAX_STEPS):
            if not self.c.more():
                break
            self.step()
            self.drain()
            check(self)
            if self.c.pick(8) == 0:
                self.pair_publish()
        self.pair_publish()
        self.now += 1
        self.broker.tick(self.now)
        self.drain()
        check(self)
        if self.sub.state == CONNECTED and self.pub.state == CONNECTED:
            lost = [n for n in self.pair_sent if n not in self.pair_got]
            assert not lost, f"the well-behaved pair lost {lost}"
        if isinstance(self.store, LmdbStore):
            check_restart(self)


def _lmdb_keys(store: LmdbStore) -> dict[str, set[bytes]]:
    """The keys of the session, subscription, inbound QoS 2 and retained tables, as committed."""
    assert store.env is not None
    out: dict[str, set[bytes]] = {}
    with store.env.begin() as txn:
        for name in ("sessions", "subs", "inbound", "retained"):
            out[name] = {bytes(k) for k in txn.cursor(getattr(store.tables, name)).iternext(values=False)}
    return out


def _expected_keys(broker: Broker) -> dict[str, set[bytes]]:
    """The keys those tables must hold for the broker's state (gateway/store/records.py's key layout)."""
    out: dict[str, set[bytes]] = {"sessions": set(), "subs": set(), "inbound": set(), "retained": set()}
    for client_id, session in broker.sessions.items():
        if not session.persistent:
            continue
        prefix = rec.client_prefix(client_id)
        out["sessions"].add(prefix[:-1])
        out["subs"].update(prefix + rec.name_key(key) for key in session.subscriptions)
        out["inbound"].update(prefix + pid.to_bytes(2, "big") for pid in session.awaiting_rel)
    out["retained"] = {rec.name_key(m.topic) for m in broker.retained.all() if not m.topic.startswith("$SYS/")}
    return out


def _persistent_state(broker: Broker) -> dict[str, Any]:
    """What a restart must bring back: per persistent session its subscriptions, inbound QoS 2 Packet Identifiers
    and queued messages (topic, payload, QoS, in order); the retained messages outside ``$SYS``."""
    sessions = {
        cid: (sorted(s.subscriptions), sorted(s.awaiting_rel),
              [(d.message.topic, d.message.payload, d.qos) for d in s.mqueue])
        for cid, s in broker.sessions.items() if s.persistent
    }
    retained = sorted((m.topic, m.payload) for m in broker.retained.all() if not m.topic.startswith("$SYS/"))
    return {"sessions": sessions, "retained": retained}


def check_restart(h: Harness) -> None:
    """Close the LMDB store and open it again under a new broker (a restart at the same time): the persistent
    sessions, their subscriptions, inbound QoS 2 and queued messages, and the retained messages come back."""
    store = h.store
    assert isinstance(store, LmdbStore)
    before = _persistent_state(h.broker)
    for session in h.broker.sessions.values():  # their in-flight messages are queued again on a restart
        if session.persistent and session.inflight:
            return  # (the order then differs; the row checks above already covered them)
    store.close()
    again = LmdbStore(StoreSettings(path=str(store.path), max_size=store.settings.max_size, mqueue_mem_len=2,
                                    lazy_commit=0.0), ZoneLimits)
    try:
        restored = Broker(h.settings, again, now=h.now)
        after = _persistent_state(restored)
        assert after == before, (before, after)
    finally:
        again.close()


def check(h: Harness) -> None:
    """Every invariant of the module docstring, on the harness's broker now."""
    broker, store = h.broker, h.store
    stats = broker.stats
    for name in ("messages_received", "messages_sent", "publish_received", "publish_sent", "bytes_received",
                 "clients_connected", "clients_maximum", "connections_total"):
        assert getattr(stats, name) >= 0, name
    assert all(v >= 0 for v in stats.dropped.values()), stats.dropped
    assert all(v >= 0 for v in stats.refused.values()), stats.refused
    connected = [s for s in broker.sessions.values() if s.conn is not None]
    assert stats.clients_connected == len(connected), (stats.clients_connected, len(connected))
    assert sum(broker.listener_clients.values()) == len(connected)
    assert all(v >= 0 for v in broker.listener_clients.values())
    for listener, count in broker.listener_clients.items():
        limits = h.limits if listener == "external" else h.bystander_limits
        assert count <= limits.max_connections, (listener, count)
    assert broker.persistent_count == sum(s.persistent for s in broker.sessions.values())
    assert broker.tree.count == sum(len(s.subscriptions) for s in broker.sessions.values())
    for conn in broker.connections:
        assert conn.state != CLOSED
    for client_id, session in broker.sessions.items():
        assert session.client_id == client_id
        conn = session.conn
        if conn is not None:
            assert conn.session is session and conn.state == CONNECTED
            # Unacknowledged on this connection: the window less what waits to be re-sent [MQTT-3.3.4-9].
            waiting = {id(d) for d in session.unsent}
            sent = sum(id(d) not in waiting for d in session.inflight.values())
            assert sent <= conn.window, (sent, len(session.inflight), conn.window)
            assert conn.inbound_pending >= 0
            assert conn.inbound_pending + len(session.awaiting_rel) <= conn.limits.max_awaiting_rel
        assert len(session.inflight) <= 65535
        mq = session.mqueue
        live = list(mq)
        assert len(mq) == len(live), (len(mq), len(live))
        assert mq.bytes == sum(len(d.message.payload) for d in live), (mq.bytes, len(live))
        if mq.max_len:
            assert len(mq) <= mq.max_len
        assert not any(d.dropped for d in live)
        if session.persistent and isinstance(store, RowStore):
            assert client_id in store.sessions, f"no session row for {client_id!r}"
            assert store.subs.get(client_id, set()) == set(session.subscriptions), client_id
            assert store.inbound.get(client_id, set()) == set(session.awaiting_rel), client_id
    retained = broker.retained
    mine = [m for m in retained.all() if not m.topic.startswith("$SYS/")]
    assert retained.count == len(mine) and retained.size == sum(retained_size(m.topic, m.payload) for m in mine)
    assert retained.count <= h.settings.max_retained_messages and retained.size <= h.settings.max_retained_bytes
    if isinstance(store, RowStore):
        for client_id in store.sessions:
            session = broker.sessions.get(client_id)
            assert session is not None and session.persistent, f"a session row of {client_id!r} outlives it"
        assert store.retained == {m.topic for m in mine}, (store.retained, [m.topic for m in mine])
    elif isinstance(store, LmdbStore):
        assert _lmdb_keys(store) == _expected_keys(broker)


def run_input(data: bytes, store_dir: str | None = None) -> None:
    """Run one input (see the module docstring); raise on a broken invariant or an escaped exception.

    ``store_dir``: run on a real :class:`LmdbStore` in ``<store_dir>/store`` (made empty first and removed after;
    the store's lock file stays in ``store_dir``, which the caller removes).
    """
    if store_dir is None:
        Harness(Choices(data)).run()
        return
    store_path = os.path.join(store_dir, "store")
    shutil.rmtree(store_path, ignore_errors=True)
    os.makedirs(store_path)
    h = Harness(Choices(data), store_path)
    try:
        h.run()
    finally:
        if isinstance(h.store, LmdbStore):
            h.store.close()
        shutil.rmtree(store_path, ignore_errors=True)
