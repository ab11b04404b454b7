"""One client's bad or careless input never harms another client's messages and never exhausts the gateway
(docs/reliability.md, "Limits" and "Memory bounds"). Each test runs a hostile or careless client beside a
well-behaved pair (tests/bystanders.py) that must lose nothing, against a real broker process, and checks the limit
with its field-standard name and reason code.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt
import pytest
from bystanders import QoS1Pair
from helpers import BrokerProcess, RawClient

from gateway.mqtt.packets import Connack, Disconnect, PubAck, Publish, PubRel, Suback, Subscribe, Subscription, Will

MakeBroker = Callable[[str], BrokerProcess]


def rss_mib(broker: BrokerProcess) -> float:
    """The broker process's resident set size, MiB (/proc/PID/status VmRSS)."""
    assert broker.proc is not None
    with open(f"/proc/{broker.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def sys_value(port: int, name: str, timeout: float = 5.0, until: Callable[[int], bool] | None = None) -> int | None:
    """The value of ``$SYS/broker/<name>``, or ``None`` when the broker publishes none within ``timeout`` seconds.

    Without ``until``: the first value received (the retained one). With ``until``: the first value for which it
    holds, reading the broker's updates (every ``sys_interval``) until then; the last value seen when it never
    does, so that the assertion that follows shows it."""
    watcher = RawClient(port, version=5)
    last: int | None = None
    try:
        watcher.connect("")
        watcher.send(Subscribe(1, [Subscription(f"$SYS/broker/{name}", 0)]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                packet = watcher.recv(deadline - time.monotonic())
            except TimeoutError:
                return last
            if isinstance(packet, Publish):
                last = int(packet.payload)
                if until is None or until(last):
                    return last
        return last
    finally:
        watcher.close()


def stuck_subscriber(port: int, client_id: str, topic: str, qos: int, version: int = 5,
                     properties: dict[int, int] | None = None) -> RawClient:
    """A subscriber that subscribes and then never reads its socket again."""
    client = RawClient(port, version=version)
    client.connect(client_id, clean_start=not properties, properties=properties or {})
    client.send(Subscribe(1, [Subscription(topic, qos)]))
    assert isinstance(client.recv(), Suback)
    return client


CONFIG = """
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
"""


# ---------------------------------------------------------------------------------------------- memory per connection


def test_stuck_qos0_subscriber_of_large_messages_keeps_rss_bounded(make_broker: MakeBroker, uid: str) -> None:
    """A subscriber that stops reading while 900 kB QoS 0 messages are published to it once took the broker from
    29 MB to over 3 GB in 10 s. Past ``high_watermark`` (1 MiB) QoS 0 to it is dropped and counted, so
    the broker's RSS stays within that bound plus a constant, and the bystanders lose nothing."""
    broker = make_broker(CONFIG)
    pair = QoS1Pair(broker.port, uid).start()
    slow = stuck_subscriber(broker.port, f"{uid}-slow", "flood/#", 0)
    before = rss_mib(broker)
    publisher = RawClient(broker.port, version=5)
    publisher.connect(f"{uid}-flood")
    data = Publish("flood/big", b"x" * 900_000).encode(5)
    peak = before
    deadline = time.monotonic() + 6
    sent = 0
    while time.monotonic() < deadline:
        publisher.send(data)
        sent += 1
        if sent % 50 == 0:
            peak = max(peak, rss_mib(broker))
    peak = max(peak, rss_mib(broker))
    assert sent > 500, "the publisher was held back; the flood did not happen"
    assert peak - before < 100, f"RSS grew from {before:.0f} to {peak:.0f} MiB with one stuck subscriber"
    dropped = sys_value(broker.port, "messages/dropped/high_watermark_qos0", until=lambda n: n > 0)
    assert dropped is not None and dropped > 0
    pair.finish()
    publisher.close()
    slow.close()


def test_stuck_qos1_subscriber_is_bounded_by_its_queue_and_closed_after_send_timeout(
        make_broker: MakeBroker, uid: str) -> None:
    """QoS 1 messages for a connected subscriber that stopped reading wait in its Message Queue
    under ``max_mqueue_bytes`` (oldest dropped first); after ``send_timeout`` without its socket draining it is
    closed (EMQX's ``send_timeout``), its persistent session keeps the queue, and it gets the newest messages when
    it comes back."""
    broker = make_broker(CONFIG + 'send_timeout = "2s"\nmax_mqueue_bytes = "4MB"\n')
    pair = QoS1Pair(broker.port, uid).start()
    slow = stuck_subscriber(broker.port, f"{uid}-slow", "flood1/#", 1, properties={0x11: 600})
    before = rss_mib(broker)
    publisher = RawClient(broker.port, version=5)
    publisher.connect(f"{uid}-flood")
    payload = b"y" * 500_000
    count = 100  # 50 MB, far past 4 MB of queue, the Inflight Window (32 x 500 kB) and the socket buffers
    for i in range(count):
        publisher.send(Publish("flood1/a", i.to_bytes(4, "big") + payload, 1, packet_id=i % 65535 + 1))
        ack = publisher.recv(10)
        assert isinstance(ack, PubAck) and ack.reason_code < 0x80
    assert rss_mib(broker) - before < 60
    # The stuck subscriber is closed within send_timeout plus a tick (reading now would un-stick it). What the
    # kernel still holds for it drains slowly, so the broker's count and log tell, and coming back is no takeover.
    deadline = time.monotonic() + 8
    while not sys_value(broker.port, "refused/send_timeout") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (sys_value(broker.port, "refused/send_timeout") or 0) >= 1
    assert any("send_timeout" in line and f"{uid}-slow" in line for line in broker.lines)
    slow.close()
    back = RawClient(broker.port, version=5)
    assert back.connect(f"{uid}-slow", clean_start=False, properties={0x11: 600}).session_present
    numbers = []
    while True:
        try:
            packet = back.recv(2)
        except TimeoutError:
            break
        if isinstance(packet, Publish):
            numbers.append(int.from_bytes(packet.payload[:4], "big"))
            back.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
    assert numbers, "the persistent session lost its queue"
    assert numbers[-1] == count - 1
    assert numbers == sorted(numbers)
    assert len(numbers) <= 32 + 4 * 1024 * 1024 // len(payload) + 1  # the Inflight Window, then the queue quota
    assert not any("takes over" in line and f"{uid}-slow" in line for line in broker.lines)
    pair.finish()
    back.close()
    publisher.close()


def test_half_sent_connects_do_not_grow_memory(make_broker: MakeBroker, uid: str) -> None:
    """Bounded memory before CONNECT. 200 connections that each announce a 1 MB CONNECT and send part of
    it hold at most their partial packets; the broker's RSS does not grow past that, and bystanders lose nothing."""
    broker = make_broker(CONFIG)
    pair = QoS1Pair(broker.port, uid).start()
    before = rss_mib(broker)
    # A CONNECT fixed header announcing 1,000,000 bytes, then the start of a variable header and 16 KiB of it.
    head = bytes((0x10,)) + bytes((0xC0, 0x84, 0x3D)) + b"\x00\x04MQTT\x04\x02\x00\x3c"
    sockets = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", broker.port))
        sock.sendall(head + b"z" * 16384)
        sockets.append(sock)
    time.sleep(1)
    grown = rss_mib(broker) - before
    assert grown < 200 * 16384 * 3 / 2**20 + 16, f"RSS grew by {grown:.1f} MiB for 200 half-sent CONNECTs"
    pair.finish()
    for sock in sockets:
        sock.close()


# ---------------------------------------------------------------------------------------------- caps


@pytest.mark.parametrize("version", [4, 5])
def test_mqtt_3_1_3_8_client_identifier_past_max_clientid_len_refused(broker: BrokerProcess, uid: str,
                                                                       version: int) -> None:
    """``max_clientid_len`` (default 256 UTF-8 bytes) refuses a longer Client Identifier with
    CONNACK 0x85 Client Identifier not valid (3.1.1: return code 0x02) and closes [MQTT-3.1.3-8]; 256 bytes are
    accepted, and a 100-character identifier of 3-byte characters (300 bytes) is refused."""
    pair = QoS1Pair(broker.port, uid).start()
    for client_id, accepted in (("a" * 256, True), ("a" * 257, False), ("€" * 100, False), ("b" * 60_000, False)):
        client = RawClient(broker.port, version=version)
        connack = client.connect(client_id, clean_start=False, properties={0x11: 60} if version == 5 else {})
        if accepted:
            assert connack.reason_code == 0
        else:
            assert connack.reason_code == (0x85 if version == 5 else 0x02)
            assert client.closed_by_server()
        client.close()
    pair.finish()


@pytest.mark.parametrize("version", [4, 5])
def test_max_sessions_refuses_a_new_persistent_session_with_quota_exceeded(make_broker: MakeBroker, uid: str,
                                                                           version: int) -> None:
    """``max_sessions`` caps the persistent sessions held broker-wide; one more gets CONNACK 0x97
    Quota exceeded (3.1.1: 0x03 Server unavailable). Clean sessions, resuming an existing session and sessions of
    other clients are not affected, and a slot freed by a Clean Start is available again."""
    broker = make_broker(CONFIG.replace("[listeners", "max_sessions = 6\n[listeners", 1))
    pair = QoS1Pair(broker.port, uid).start()  # holds 2 persistent sessions (Clean Session 0)
    props = {0x11: 600} if version == 5 else {}
    for i in range(4):
        client = RawClient(broker.port, version=version)
        assert client.connect(f"{uid}-p{i}", clean_start=False, properties=props).reason_code == 0
        client.close()
    extra = RawClient(broker.port, version=version)
    assert extra.connect(f"{uid}-extra", clean_start=False, properties=props).reason_code == (
        0x97 if version == 5 else 0x03)
    assert extra.closed_by_server()
    extra.close()
    clean = RawClient(broker.port, version=version)
    assert clean.connect(f"{uid}-clean", clean_start=True).reason_code == 0
    clean.close()
    again = RawClient(broker.port, version=version)
    connack = again.connect(f"{uid}-p0", clean_start=False, properties=props)
    assert connack.reason_code == 0 and connack.session_present
    again.send(Disconnect(0, {0x11: 0}) if version == 5 else Disconnect())
    again.close()
    # p0 ends (3.1.1: a Clean Session 1 connection discards it): a new persistent session fits again.
    if version == 4:
        ender = RawClient(broker.port, version=4)
        assert ender.connect(f"{uid}-p0", clean_start=True).reason_code == 0
        ender.close()
    deadline = time.monotonic() + 5
    while True:
        late = RawClient(broker.port, version=version)
        code = late.connect(f"{uid}-late", clean_start=False, properties=props).reason_code
        late.close()
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0
    pair.finish()


@pytest.mark.parametrize("version", [4, 5])
def test_max_subscriptions_refuses_further_topic_filters_with_quota_exceeded(make_broker: MakeBroker, uid: str,
                                                                             version: int) -> None:
    """``max_subscriptions`` Topic Filters per client; further ones get SUBACK 0x97 Quota
    exceeded (3.1.1: 0x80 Failure) while those held keep working and can be subscribed again."""
    broker = make_broker(CONFIG + "max_subscriptions = 10\n")
    pair = QoS1Pair(broker.port, uid).start()
    client = RawClient(broker.port, version=version)
    client.connect(f"{uid}-many")
    client.send(Subscribe(1, [Subscription(f"many/{i}", 1) for i in range(12)]))
    suback = client.recv()
    assert isinstance(suback, Suback)
    refused = 0x97 if version == 5 else 0x80
    assert list(suback.reason_codes) == [1] * 10 + [refused] * 2
    client.send(Subscribe(2, [Subscription("many/3", 0), Subscription("many/12", 0)]))
    suback = client.recv()
    assert isinstance(suback, Suback) and list(suback.reason_codes) == [0, refused]
    publisher = RawClient(broker.port, version=version)
    publisher.connect(f"{uid}-publisher")
    publisher.send(Publish("many/9", b"held", 0))
    packet = client.recv()
    assert isinstance(packet, Publish) and packet.payload == b"held"
    pair.finish()
    client.close()
    publisher.close()


def test_max_topic_levels_refuses_deep_filters_names_and_will_topics(broker: BrokerProcess, uid: str) -> None:
    """``max_topic_levels`` (EMQX's, default 128): a deeper Topic Filter gets SUBACK 0x8F, a
    deeper QoS 1 Topic Name PUBACK 0x90, a deeper Will Topic CONNACK 0x90; 128 levels are fine."""
    pair = QoS1Pair(broker.port, uid).start()
    deep = "/".join(["l"] * 129)
    ok = "/".join(["l"] * 128)
    client = RawClient(broker.port, version=5)
    client.connect(f"{uid}-deep")
    client.send(Subscribe(1, [Subscription(deep, 1), Subscription(ok, 1)]))
    suback = client.recv()
    assert isinstance(suback, Suback) and list(suback.reason_codes) == [0x8F, 1]
    client.send(Publish(deep, b"x", 1, packet_id=7))
    ack = client.recv()
    assert isinstance(ack, PubAck) and ack.packet_id == 7 and ack.reason_code == 0x90
    client.send(Publish(ok, b"fine", 1, packet_id=8))
    got = {type(p).__name__: p for p in (client.recv(), client.recv())}
    assert got["Publish"].payload == b"fine" and got["PubAck"].reason_code == 0
    willer = RawClient(broker.port, version=5)
    assert willer.connect(f"{uid}-will", will=Will(deep, b"w", 0, False)).reason_code == 0x90
    assert willer.closed_by_server()
    willer.close()
    pair.finish()
    client.close()


# ---------------------------------------------------------------------------------------------- logs and DISCONNECT


def test_protocol_error_log_lines_are_rate_limited_per_client_and_reason(make_broker: MakeBroker, uid: str) -> None:
    """A client sending garbage in a loop writes at most one log line per minute per reason;
    the lines it would have written are counted (``$SYS/broker/log/suppressed``)."""
    broker = make_broker(CONFIG)
    pair = QoS1Pair(broker.port, uid).start()
    for _ in range(60):
        client = RawClient(broker.port, version=5)
        # A CONNECT with a reserved flag set: a Malformed Packet.
        client.send(bytes((0x10, 13)) + b"\x00\x04MQTT\x05\x01\x00\x3c\x00\x00\x00")
        client.closed_by_server()
        client.close()
    # Once the broker counts 59 suppressed lines it has handled all 60 connections: then exactly one was logged.
    suppressed = sys_value(broker.port, "log/suppressed", until=lambda n: n >= 59)
    assert suppressed is not None and suppressed >= 59
    lines = [line for line in broker.lines if "closing with reason code" in line]
    assert len(lines) == 1, lines
    pair.finish()


def test_mqtt_3_3_4_9_disconnect_0x93_is_read_by_a_client_still_writing(make_broker: MakeBroker, uid: str) -> None:
    """As in the Paho interoperability test ``test_flow_control2``: a client that exceeds the broker's
    Receive Maximum gets DISCONNECT 0x93 Receive Maximum exceeded [MQTT-3.3.4-9]; the broker closes its side after
    the DISCONNECT but keeps reading a while, so the client, still writing PUBRELs, does not get a broken pipe or
    a reset before it reads the reason code."""
    broker = make_broker(CONFIG + "max_awaiting_rel = 5\n")
    pair = QoS1Pair(broker.port, uid, version=mqtt.MQTTv5, max_inflight=4).start()
    client = RawClient(broker.port, version=5)
    connack = client.connect(f"{uid}-greedy")
    assert isinstance(connack, Connack) and connack.properties.get(0x21) == 5
    burst = b"".join(Publish("greedy/t", b"q2", 2, packet_id=i).encode(5) for i in range(1, 12))
    client.sock.sendall(burst)
    # Keep writing (PUBRELs for identifiers it thinks are pending) while the broker refuses, as a client's
    # writer thread does before its reader sees the DISCONNECT.
    deadline = time.monotonic() + 0.5
    write_error = None
    try:
        while time.monotonic() < deadline:
            client.sock.sendall(b"".join(PubRel(i).encode(5) for i in range(100, 400)))
            time.sleep(0.01)
    except OSError as exc:
        write_error = exc
    assert write_error is None, f"the broker reset the connection under a writing client: {write_error!r}"
    packets = []
    try:
        while True:
            packets.append(client.recv(3))
    except (TimeoutError, ConnectionError):
        pass
    disconnects = [p for p in packets if isinstance(p, Disconnect)]
    assert disconnects and disconnects[0].reason_code == 0x93, packets
    client.close()
    pair.finish()


def test_a_3_1_1_burst_past_max_awaiting_rel_is_flow_controlled_not_disconnected(make_broker: MakeBroker,
                                                                                 uid: str) -> None:
    """A 3.1.1 client (no Receive Maximum to follow, as paho re-sending its whole backlog after a reconnect) writes
    300 QoS 1 PUBLISHes at once to a persistent subscriber's topic, with ``max_awaiting_rel`` 10: the broker stops
    reading while 10 await their commit and goes on as commits acknowledge them. All 300 are acknowledged in order
    on the same connection and delivered; the pauses are counted in ``$SYS/broker/refused/max_awaiting_rel``; a
    QoS1Pair beside it loses nothing."""
    broker = make_broker(CONFIG + "max_awaiting_rel = 10\n")
    pair = QoS1Pair(broker.port, uid, max_inflight=8).start()
    sub = RawClient(broker.port)
    assert sub.connect(f"{uid}-keeper", clean_start=False).reason_code == 0
    sub.send(Subscribe(1, [Subscription(f"{uid}/burst", 1)]))
    assert isinstance(sub.recv(), Suback)
    sub.close()
    client = RawClient(broker.port)
    assert client.connect(f"{uid}-burst").reason_code == 0
    client.sock.sendall(b"".join(Publish(f"{uid}/burst", b"%d" % i, 1, packet_id=i).encode(4)
                                 for i in range(1, 301)))
    acks = [client.recv(10) for _ in range(300)]
    assert [(type(a), a.packet_id) for a in acks] == [(PubAck, i) for i in range(1, 301)]
    assert not client.closed_by_server(0.2)
    client.close()
    paused = sys_value(broker.port, "refused/max_awaiting_rel", until=lambda n: n > 0)
    assert paused is not None and paused > 0
    sub = RawClient(broker.port)
    assert sub.connect(f"{uid}-keeper", clean_start=False).session_present
    got = []
    for _ in range(300):
        packet = sub.recv(10)
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        got.append(int(packet.payload))
        sub.send(PubAck(packet.packet_id))
    assert got == list(range(1, 301))
    sub.close()
    pair.finish()


def rss_anon_mib(broker: BrokerProcess) -> float:
    """The broker's anonymous resident memory, MiB (RssAnon: without LMDB's file-backed map)."""
    assert broker.proc is not None
    with open(f"/proc/{broker.proc.pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_abandoned_persistent_sessions_keep_their_queues_in_the_store(make_broker: MakeBroker, uid: str) -> None:
    """Found by `make soak`: persistent sessions that subscribe and go away for good must not hold what
    is queued for them in memory. An offline session keeps at most 16 entries in memory (``OFFLINE_MEM_LEN``) and
    the rest wait only in the store, also after a restart; a session that comes back gets its whole queue, in order.
    Before, every offline queue was held whole: 2,000 such sessions with 1,000 messages each took 515 MiB."""
    broker = make_broker(CONFIG)
    sessions, count = 300, 400
    for i in range(sessions):
        client = RawClient(broker.port, version=4)
        client.connect(f"{uid}-gone{i}", clean_start=False)
        client.send(Subscribe(1, [Subscription(f"{uid}/fleet", 1)]))
        assert isinstance(client.recv(), Suback)
        client.send(Disconnect())
        client.close()
    pair = QoS1Pair(broker.port, uid).start()
    before = rss_anon_mib(broker)
    publisher = RawClient(broker.port, version=4)
    publisher.connect(f"{uid}-fleetpub")
    for i in range(count):
        publisher.send(Publish(f"{uid}/fleet", b"%06d" % i + b"r" * 94, 1, packet_id=i % 65535 + 1))
        assert isinstance(publisher.recv(30), PubAck)
    publisher.close()
    pair.finish()
    grown = rss_anon_mib(broker) - before
    # Whole queues in memory: 300 x 400 entries at ~260 bytes each, about 30 MiB.
    assert grown < 12, f"anonymous memory grew by {grown:.1f} MiB for {sessions * count} queued messages"
    assert broker.stop() == 0
    broker.start()
    assert rss_anon_mib(broker) < before + 12
    back = RawClient(broker.port, version=4)
    assert back.connect(f"{uid}-gone7", clean_start=False).session_present
    numbers = []
    while len(numbers) < count:
        packet = back.recv(10)
        if isinstance(packet, Publish):
            numbers.append(int(packet.payload[:6]))
            back.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
    assert numbers == list(range(count))
    back.close()
