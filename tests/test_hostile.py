"""Hostile clients: live tests against a real broker process on 127.0.0.1, each beside a well-behaved
QoS 1 pair (tests/bystanders.py) that must lose nothing. The same limits in process: tests/test_limits.py; the
fuzzer: tests/test_fuzz.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from bystanders import QoS1Pair
from helpers import BrokerProcess, RawClient
from test_isolation import sys_value

from gateway.mqtt.packets import PubComp, PubRel

MakeBroker = Callable[[str], BrokerProcess]

CONFIG = """
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
"""


def test_2000_half_open_connections_are_closed_by_connect_timeout(make_broker: MakeBroker, uid: str) -> None:
    """2,000 connections that send nothing, or half a CONNECT (slowloris), are all closed by ``connect_timeout``
    (2 s here) while the pair exchanges its messages; none is refused for it, the bystanders lose nothing."""
    broker = make_broker(CONFIG + 'connect_timeout = "2s"\n')
    pair = QoS1Pair(broker.port, uid, count=300, interval=0.01).start()
    half_connect = bytes((0x10, 40)) + b"\x00\x04MQTT\x04\x02\x00\x3c"  # announces 40 bytes, sends 12
    sockets: list[socket.socket] = []
    try:
        for i in range(2000):
            sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
            if i % 2:
                sock.sendall(half_connect)
            sockets.append(sock)
        opened = time.monotonic()
        open_left = len(sockets)
        deadline = opened + 15
        while open_left and time.monotonic() < deadline:
            time.sleep(0.5)
            open_left = 0
            for sock in sockets:
                sock.setblocking(False)
                try:
                    data = sock.recv(16)
                    if data:
                        open_left += 1  # the broker wrote something: not expected, counted as open
                except BlockingIOError:
                    open_left += 1
                except OSError:
                    pass
        assert open_left == 0, f"{open_left} of 2000 half-open connections still open after connect_timeout"
        assert time.monotonic() - opened >= 1.0  # closed by the timeout, not at once
        pair.finish()
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("version", [4, 5])
def test_connection_flood_past_max_connections(make_broker: MakeBroker, uid: str, version: int) -> None:
    """``max_connections`` = 20 on the listener, the pair holding 2: 60 more clients connect; 18 are accepted,
    the other 42 get CONNACK 0x97 (3.1.1: 0x03) and are closed, counted on ``$SYS/broker/refused/max_connections``;
    the pair loses nothing, and once the flood leaves a new client gets in."""
    broker = make_broker(CONFIG + "max_connections = 20\n")
    pair = QoS1Pair(broker.port, uid, count=200).start()
    clients: list[RawClient] = []
    accepted = refused = 0
    for i in range(60):
        client = RawClient(broker.port, version=version)
        code = client.connect(f"{uid}-flood-{i}").reason_code
        if code == 0:
            accepted += 1
            clients.append(client)
        else:
            assert code == (0x97 if version == 5 else 0x03)
            assert client.closed_by_server()
            refused += 1
            client.close()
    assert (accepted, refused) == (18, 42)
    pair.finish()
    watcher_count = sys_value(broker.port, "refused/max_connections", until=lambda n: n >= 42)  # room for it now
    assert watcher_count == 42
    for client in clients:
        client.close()
    deadline = time.monotonic() + 5
    while True:  # the closes reach the broker within a loop turn or two
        late = RawClient(broker.port, version=version)
        code = late.connect(f"{uid}-late").reason_code
        late.close()
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0, "no room again after the flood left"


def test_random_bytes_on_many_connections(make_broker: MakeBroker, uid: str) -> None:
    """300 connections send random bytes (a third after a valid CONNECT with Keep Alive 2 s); each is closed by the
    broker: at once for a malformed packet, by ``connect_timeout`` (2 s) or Keep Alive (1.5 x 2 s) when the bytes
    end inside a packet; the broker stays up, logs no traceback, and the pair loses nothing."""
    import random

    broker = make_broker(CONFIG + 'connect_timeout = "2s"\n')
    pair = QoS1Pair(broker.port, uid, count=300, interval=0.01).start()
    rng = random.Random(15)
    sockets = []
    connect = RawClient  # a valid CONNECT first on a third of them
    for i in range(300):
        if i % 3 == 0:
            client = connect(broker.port, version=4 + i % 2)
            client.connect(f"{uid}-g{i}", keep_alive=2)  # closed by Keep Alive (3 s) if the bytes are a partial packet
            sock = client.sock
        else:
            sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        try:
            sock.sendall(rng.randbytes(rng.randrange(1, 2000)))
        except OSError:
            pass  # already closed by the broker
        sockets.append(sock)
    deadline = time.monotonic() + 15
    open_left = len(sockets)
    while open_left and time.monotonic() < deadline:
        time.sleep(0.5)
        open_left = 0
        for sock in sockets:
            sock.setblocking(False)
            try:
                while sock.recv(65536):
                    pass
            except BlockingIOError:
                open_left += 1
            except OSError:
                pass
    assert open_left == 0, f"{open_left} of 300 garbage connections still open"
    pair.finish()
    for sock in sockets:
        sock.close()
    assert broker.proc is not None and broker.proc.poll() is None
    assert not any("Traceback" in line for line in broker.lines)


def test_qos2_flood_without_pubrel_is_bounded(make_broker: MakeBroker, uid: str) -> None:
    """A 5.0 client sends QoS 2 PUBLISHes and never PUBREL: it gets PUBREC for ``max_awaiting_rel`` (10) of them,
    the next one exceeds the Receive Maximum the broker announced: DISCONNECT 0x93 and the close. Its persistent
    session's messages awaiting PUBREL are dropped after ``await_rel_timeout`` (2 s). The pair loses nothing."""
    from gateway.mqtt.packets import Disconnect, Publish, PubRec

    broker = make_broker(CONFIG + 'max_awaiting_rel = 10\nawait_rel_timeout = "2s"\n')
    pair = QoS1Pair(broker.port, uid, count=200, max_inflight=10).start()
    flood = RawClient(broker.port, version=5)
    assert flood.connect(f"{uid}-q2", clean_start=False, properties={0x11: 600}).reason_code == 0
    for pid in range(1, 11):
        flood.send(Publish(f"{uid}/q2", b"x" * 100, 2, packet_id=pid))
    recs = flood.recv_all(1.0)  # each PUBREC once the message is committed
    assert len(recs) == 10 and all(isinstance(p, PubRec) and p.reason_code < 0x80 for p in recs), recs
    flood.send(Publish(f"{uid}/q2", b"x" * 100, 2, packet_id=11))  # one more than the Receive Maximum announced
    answers = flood.recv_all(1.0)
    assert isinstance(answers[-1], Disconnect) and answers[-1].reason_code == 0x93, answers
    assert flood.closed_by_server()
    flood.close()
    back = RawClient(broker.port, version=5)
    time.sleep(3.5)  # await_rel_timeout (2 s) plus the one-second ticker and the 5-second sweep of offline sessions
    assert back.connect(f"{uid}-q2", clean_start=False, properties={0x11: 600}).session_present
    back.send(PubRel(1))
    assert any(isinstance(p, PubComp) for p in back.recv_all(1.0))  # unknown by now: PUBCOMP (0x92 in 5.0)
    back.close()
    pair.finish()


def test_hash_subscriber_with_receive_maximum_1_that_never_acknowledges(make_broker: MakeBroker, uid: str) -> None:
    """A 5.0 subscriber to ``#`` with Receive Maximum 1 that never acknowledges gets exactly one QoS 1 PUBLISH in
    flight; everything else waits in its Message Queue (``max_mqueue_len`` 50 here, oldest dropped), so it holds
    nobody back: the pair (whose messages it also matches) loses nothing and the broker's memory stays bounded."""
    from gateway.mqtt.packets import Publish, Subscribe, Subscription

    broker = make_broker(CONFIG + "max_mqueue_len = 50\n")
    greedy = RawClient(broker.port, version=5)
    assert greedy.connect(f"{uid}-greedy", properties={0x21: 1}).reason_code == 0
    greedy.send(Subscribe(1, [Subscription("#", 1)]))
    pair = QoS1Pair(broker.port, uid, count=400, interval=0.002).start()
    pair.finish()
    publishes = [p for p in greedy.recv_all(1.0) if isinstance(p, Publish) and p.qos == 1]
    assert len(publishes) == 1, f"{len(publishes)} QoS 1 PUBLISH in flight with Receive Maximum 1"
    dropped = sys_value(broker.port, "publish/messages/dropped")
    assert dropped is not None and dropped > 0
    greedy.close()


def test_publish_rate_limit_pauses_reading_and_never_disconnects(make_broker: MakeBroker, uid: str) -> None:
    """``max_publish_rate`` = 100/s: a client writes 400 QoS 0 PUBLISHes at once (debt 300 tokens, so reading
    pauses for about 3 s) with Keep Alive 2 s. Every message arrives, the last not before about 2.5 s, the client
    is not disconnected (its PINGREQ sent during the pause is answered after it), the pause is counted on
    ``$SYS/broker/refused/max_publish_rate``, and the pair, on the same listener, is not slowed past its budget."""
    from gateway.mqtt.packets import PingReq, PingResp, Publish, Subscribe, Subscription

    broker = make_broker(CONFIG + "max_publish_rate = 100\n")
    pair = QoS1Pair(broker.port, uid, count=100, interval=0.01).start()
    sub = RawClient(broker.port, version=5)
    sub.connect(f"{uid}-rs")
    sub.send(Subscribe(1, [Subscription(f"{uid}/rate", 0)]))
    sub.recv()
    flood = RawClient(broker.port, version=5)
    flood.connect(f"{uid}-rate", keep_alive=2)
    started = time.monotonic()
    flood.send(b"".join(Publish(f"{uid}/rate", b"%d" % i).encode(5) for i in range(400)))
    time.sleep(0.5)
    flood.send(PingReq())
    got: list[bytes] = []
    last = started
    deadline = started + 15
    while len(got) < 400 and time.monotonic() < deadline:
        try:
            packet = sub.recv(deadline - time.monotonic())
        except TimeoutError:
            break
        if isinstance(packet, Publish):
            got.append(packet.payload)
            last = time.monotonic()
    assert got == [b"%d" % i for i in range(400)]
    assert last - started >= 2.5, f"400 messages at 100/s arrived in {last - started:.1f} s"
    assert isinstance(flood.recv(5), PingResp)
    assert not flood.closed_by_server(0.5)
    assert (sys_value(broker.port, "refused/max_publish_rate") or 0) >= 1
    pair.finish()
    flood.close()
    sub.close()


def test_topic_length_and_retained_limits_with_a_real_broker(make_broker: MakeBroker, uid: str) -> None:
    """``max_topic_length`` = 100 and ``max_retained_messages`` = 3 on a real broker: a 5.0 client's PUBLISH to a
    101-byte topic gets PUBACK 0x90, its SUBSCRIBE to a 101-byte filter SUBACK 0x8F, its fourth retained topic
    PUBACK 0x97 while replacing one of the three works; the refusals are on ``$SYS``; the pair loses nothing."""
    from gateway.mqtt.packets import PubAck, Publish, Suback, Subscribe, Subscription

    broker = make_broker(CONFIG.replace("[listeners", "max_retained_messages = 3\n[listeners", 1)
                         + "max_topic_length = 100\n")
    pair = QoS1Pair(broker.port, uid, count=100).start()
    client = RawClient(broker.port, version=5)
    client.connect(f"{uid}-lim")
    long_topic = f"{uid}/".ljust(101, "x")
    client.send(Publish(long_topic, b"x", 1, packet_id=1))
    assert client.recv() == PubAck(1, 0x90)
    client.send(Subscribe(2, [Subscription(long_topic, 1)]))
    assert client.recv() == Suback(2, [0x8F])
    for pid in range(3, 6):
        client.send(Publish(f"{uid}/r/{pid}", b"v", 1, retain=True, packet_id=pid))
        assert client.recv().reason_code < 0x80  # type: ignore[union-attr]
    client.send(Publish(f"{uid}/r/6", b"v", 1, retain=True, packet_id=6))
    assert client.recv() == PubAck(6, 0x97)
    client.send(Publish(f"{uid}/r/3", b"new", 1, retain=True, packet_id=7))
    assert client.recv().reason_code < 0x80  # type: ignore[union-attr]
    assert sys_value(broker.port, "messages/dropped/max_topic_length", until=lambda n: n >= 1) == 1
    assert sys_value(broker.port, "refused/max_topic_length", until=lambda n: n >= 1) == 1
    assert sys_value(broker.port, "messages/dropped/max_retained_messages", until=lambda n: n >= 1) == 1
    pair.finish()
    client.close()
