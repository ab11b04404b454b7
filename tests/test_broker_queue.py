"""Inflight Window, Message Queue, re-delivery and offline messages against the real broker process
(docs/architecture.md, "Session semantics"). The ``seed_000`` ... ``seed_004`` prefixes of test names name the
group of session semantics a test checks, as in tests/test_core.py.

Every limit is per listener (zone), so one module-scoped broker carries one listener per configuration under test
(``max_inflight = 2``, ``max_mqueue_len = 3``, ``retry_interval = "1s"``, ...) instead of a broker per test.
The subscribers are RawClients, so each test decides exactly when (and whether) a PUBACK/PUBREC/PUBCOMP is sent.
A PINGREQ serves as a barrier: the broker handles a connection's packets in order, so every packet that an earlier
packet caused is sent before the PINGRESP, or (for a persistent session, after the store commit) shortly after it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import BrokerProcess, RawClient, wait_until

from gateway.mqtt.packets import (
    Connack,
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
)
from gateway.mqtt.properties import PropertyId as P

ZONES_CONFIG = """
[broker]
sys_interval = "1s"

[listeners.plain]
bind = "127.0.0.1:0"

[listeners.win2]
bind = "127.0.0.1:0"
max_inflight = 2

[listeners.q3]
bind = "127.0.0.1:0"
max_inflight = 1
max_mqueue_len = 3

[listeners.rm10]
bind = "127.0.0.1:0"
max_inflight = 10

[listeners.nolimit]
bind = "127.0.0.1:0"
max_inflight = 0

[listeners.retry]
bind = "127.0.0.1:0"
retry_interval = "1s"

[listeners.rel]
bind = "127.0.0.1:0"
await_rel_timeout = "1s"
max_awaiting_rel = 2

[listeners.msgexp]
bind = "127.0.0.1:0"
message_expiry_interval = "1s"

[listeners.noqos0]
bind = "127.0.0.1:0"
mqueue_store_qos0 = false
"""


@pytest.fixture(scope="module")
def zones(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker with a listener per zone configuration; ``zones.ports[name]``."""
    proc = BrokerProcess(ZONES_CONFIG, workdir=str(tmp_path_factory.mktemp("zones"))).start()
    assert set(proc.ports) == {"plain", "win2", "q3", "rm10", "nolimit", "retry", "rel", "msgexp", "noqos0"}
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


Opener = Callable[..., RawClient]

#: How long to keep listening after the expected packets: long enough for a store commit (a few ms).
SETTLE = 0.15


@pytest.fixture
def open_client() -> Iterator[Opener]:
    """``open_client(port, version=4)``: a RawClient closed at the end of the test."""
    clients: list[RawClient] = []

    def make(port: int, version: int = 4) -> RawClient:
        client = RawClient(port, version=version)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


# ------------------------------------------------------------------------------------------------ helpers


def session(open_client: Opener, port: int, client_id: str, version: int = 4, clean: bool = True,
            expiry: int | None = None, props: dict[int, Any] | None = None) -> tuple[RawClient, Connack]:
    """Connect ``client_id``; ``expiry`` is the 5.0 Session Expiry Interval; ``props`` more CONNECT properties."""
    client = open_client(port, version)
    properties: dict[int, Any] = {}
    if version == 5:
        if expiry is not None:
            properties[P.SESSION_EXPIRY_INTERVAL] = expiry
        properties.update(props or {})
    connack = client.connect(client_id, clean_start=clean, properties=properties)
    assert connack.reason_code == 0, connack
    return client, connack


def persistent(open_client: Opener, port: int, client_id: str, version: int,
               clean: bool = False) -> tuple[RawClient, Connack]:
    """A session that outlives its connection: Clean Session 0 (3.1.1) or Session Expiry Interval 300 (5.0);
    ``clean`` (5.0 only) sets Clean Start to begin a fresh one."""
    if version == 5:
        return session(open_client, port, client_id, 5, clean=clean, expiry=300)
    return session(open_client, port, client_id, 4, clean=False)


def subscribe(client: RawClient, *filters: tuple[str, int], packet_id: int = 1) -> None:
    """SUBSCRIBE and check that every filter is granted the requested QoS."""
    client.send(Subscribe(packet_id, [Subscription(f, q) for f, q in filters]))
    suback = client.recv()
    assert isinstance(suback, Suback), suback
    assert suback.packet_id == packet_id
    assert suback.reason_codes == [q for _f, q in filters]


def barrier(client: RawClient, n: int = 0, timeout: float = 5.0) -> list[Packet]:
    """Every packet the broker sent before it answered a PINGREQ sent now - waiting for at least ``n`` of them -
    and any that follow within :data:`SETTLE` (sends to persistent sessions may wait for a store commit)."""
    client.send(PingReq())
    packets: list[Packet] = []
    pong = False
    deadline = time.monotonic() + timeout
    while not pong or len(packets) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"expected {n} packets, got {packets}")
        packet = client.recv(left)
        if isinstance(packet, PingResp):
            pong = True
        else:
            packets.append(packet)
    packets.extend(client.recv_all(SETTLE))
    return packets


def disconnect(client: RawClient) -> None:
    """A normal DISCONNECT, then wait for the broker to close the connection."""
    client.send(Disconnect())
    assert client.closed_by_server()
    client.close()


def payloads(packets: list[Packet]) -> list[bytes]:
    """The payloads of the PUBLISH packets in ``packets`` (and check nothing else is there)."""
    assert all(isinstance(p, Publish) for p in packets), packets
    return [p.payload for p in packets]  # type: ignore[union-attr]


class Publisher:
    """A RawClient that publishes and completes each QoS 1/2 flow before returning."""

    def __init__(self, open_client: Opener, port: int, client_id: str, version: int = 4) -> None:
        self.client, _ = session(open_client, port, client_id, version)
        self._ids = itertools.count(1)

    def publish_numbered(self, topic: str, count: int) -> list[bytes]:
        """Publish ``count`` QoS 1 messages ``m00``, ``m01``, ... to ``topic``; return their payloads."""
        bodies = [b"m%02d" % i for i in range(count)]
        for body in bodies:
            self.publish(topic, body, 1)
        return bodies

    def publish(self, topic: str, payload: bytes, qos: int = 1, properties: dict[int, Any] | None = None) -> None:
        pid = next(self._ids) if qos else None
        self.client.send(Publish(topic, payload, qos, packet_id=pid, properties=properties or {}))
        if qos == 1:
            ack = self.client.recv()
            assert isinstance(ack, PubAck) and ack.packet_id == pid, ack
        elif qos == 2:
            rec = self.client.recv()
            assert isinstance(rec, PubRec) and rec.packet_id == pid, rec
            assert pid is not None
            self.client.send(PubRel(pid))
            comp = self.client.recv()
            assert isinstance(comp, PubComp) and comp.packet_id == pid, comp
        else:
            assert barrier(self.client) == []

    def publish_many(self, topic: str, bodies: list[bytes], qos: int = 1) -> None:
        """QoS 1 PUBLISHes pipelined in batches of 50 (below max_awaiting_rel), each batch fully PUBACKed."""
        assert qos == 1
        for start in range(0, len(bodies), 50):
            pids = []
            for body in bodies[start:start + 50]:
                pid = next(self._ids) % 65535 + 1
                pids.append(pid)
                self.client.send(Publish(topic, body, 1, packet_id=pid))
            acks = [self.client.recv() for _ in pids]
            assert [(type(a), a.packet_id) for a in acks] == [(PubAck, pid) for pid in pids]  # type: ignore[union-attr]


def sys_counter(open_client: Opener, port: int, name: str, uid: str) -> int:
    """The current value of ``$SYS/broker/messages/dropped/<name>`` (0 while it was never published)."""
    client, _ = session(open_client, port, f"{uid}-sys-{time.monotonic_ns()}")
    try:
        subscribe(client, (f"$SYS/broker/messages/dropped/{name}", 0))
        # The retained value, possibly followed by a fresher one from the next $SYS update.
        packets = barrier(client)
        if not packets:
            return 0
        assert all(isinstance(p, Publish) for p in packets), packets
        return int(packets[-1].payload)  # type: ignore[union-attr]
    finally:
        client.close()


def wait_counter(open_client: Opener, port: int, name: str, uid: str, expected: int, timeout: float = 6.0) -> None:
    """Poll ``$SYS/broker/messages/dropped/<name>`` (published every sys_interval = 1 s) until it is ``expected``."""

    def reached() -> bool:
        value = sys_counter(open_client, port, name, uid)
        assert value <= expected, f"$SYS/broker/messages/dropped/{name} = {value}, expected {expected}"
        return value == expected

    wait_until(reached, timeout, f"$SYS/broker/messages/dropped/{name} == {expected}", interval=0.2)


# ------------------------------------------------------------------------------------------------ Inflight Window


def test_seed_000_inflight_full_messages_queued_and_drained_fifo_on_ack(zones: BrokerProcess, open_client: Opener,
                                                                        uid: str) -> None:
    """Once the Inflight Window holds ``max_inflight`` unacknowledged messages, the broker sends no more to that
    client and keeps further messages in its Message Queue; each acknowledgement in the window lets the next queued
    message go out, in first-in, first-out order."""
    port = zones.ports["win2"]
    sub, _ = session(open_client, port, f"{uid}-sub")
    subscribe(sub, (f"{uid}/t", 1))
    pub = Publisher(open_client, port, f"{uid}-pub")
    bodies = [b"m%d" % i for i in range(6)]
    for body in bodies:
        pub.publish(f"{uid}/t", body, 1)

    window = barrier(sub, 2)
    assert payloads(window) == [b"m0", b"m1"]
    assert all(p.qos == 1 and p.dup is False for p in window)  # type: ignore[union-attr]
    unacked = [p.packet_id for p in window]  # type: ignore[union-attr]
    assert len(set(unacked)) == 2
    received = [b"m0", b"m1"]
    while unacked:
        sub.send(PubAck(unacked.pop(0)))
        more = barrier(sub, 1 if len(received) < 6 else 0)
        if len(received) < 6:
            assert payloads(more) == [bodies[len(received)]]
            assert more[0].qos == 1  # type: ignore[union-attr]
            unacked.append(more[0].packet_id)  # type: ignore[union-attr]
            received.append(more[0].payload)  # type: ignore[union-attr]
        else:
            assert more == []
    assert received == bodies


@pytest.mark.parametrize("version", [4, 5])
def test_seed_000_acknowledgements_in_one_write_refill_the_window_fifo(zones: BrokerProcess, open_client: Opener,
                                                                      uid: str, version: int) -> None:
    """Each acknowledgement in the Inflight Window lets the next message of the Message Queue go out, in
    first-in, first-out order. A persistent subscriber acknowledges its whole window of 10 in one write
    (as fast consumers do; the broker reads such runs of PUBACKs without a packet object each), with a PUBACK
    for an unknown Packet Identifier and, on 5.0, one carrying a Reason Code among them, and a PINGREQ behind:
    the next 10 follow in order, then the PINGRESP is answered. After a reconnect nothing is sent again
    (``test_store.py`` checks that the acknowledged rows left the store)."""
    port = zones.ports["rm10"]
    sub, _ = persistent(open_client, port, f"{uid}-sub", version, clean=True)
    subscribe(sub, (f"{uid}/t", 1))
    bodies = Publisher(open_client, port, f"{uid}-pub").publish_numbered(f"{uid}/t", 25)
    received = barrier(sub, 10)
    assert payloads(received) == bodies[:10]
    window = received
    while len(received) < 25:
        acks = [PubAck(p.packet_id).encode(version) for p in window]  # type: ignore[union-attr]
        acks.insert(3, PubAck(60000).encode(version))  # unknown: ignored
        if version == 5:
            acks[5] = PubAck(window[4].packet_id, 0x80).encode(5)  # type: ignore[union-attr]
        sub.send(b"".join(acks) + PingReq().encode(version))
        window = []
        while not isinstance(packet := sub.recv(), PingResp):
            window.append(packet)
        window += sub.recv_all(SETTLE)
        assert payloads(window) == bodies[len(received):len(received) + 10]
        received += window
    sub.send(b"".join(PubAck(p.packet_id).encode(version) for p in window))  # type: ignore[union-attr]
    assert barrier(sub) == []
    disconnect(sub)
    again, connack = persistent(open_client, port, f"{uid}-sub", version)
    assert connack.session_present
    assert barrier(again) == []


def test_seed_001_qos0_to_online_client_bypasses_full_window_and_queue(zones: BrokerProcess, open_client: Opener,
                                                                       uid: str) -> None:
    """While the Inflight Window is full, newly arrived QoS 1/2 messages wait in the Message Queue, but QoS 0
    messages to an online client are not affected: they are always forwarded at once."""
    port = zones.ports["win2"]
    sub, _ = session(open_client, port, f"{uid}-sub")
    subscribe(sub, (f"{uid}/t", 1))
    pub = Publisher(open_client, port, f"{uid}-pub")
    for body in (b"a1", b"a2", b"a3"):
        pub.publish(f"{uid}/t", body, 1)
    window = barrier(sub, 2)
    assert payloads(window) == [b"a1", b"a2"]  # a3 waits in the Message Queue
    pub.publish(f"{uid}/t", b"zero", 0)
    now = barrier(sub, 1)
    assert payloads(now) == [b"zero"]
    assert now[0].qos == 0 and now[0].packet_id is None  # type: ignore[union-attr]
    sub.send(PubAck(window[0].packet_id))  # type: ignore[union-attr]
    assert payloads(barrier(sub, 1)) == [b"a3"]


def test_seed_000_window_keeps_fifo_order_across_qos_for_persistent_session(zones: BrokerProcess,
                                                                            open_client: Opener, uid: str) -> None:
    """Messages enter the Inflight Window in first-in, first-out order, and are delivered in order per publisher and
    topic (docs/architecture.md, "The durability contract"). An online persistent session (whose QoS 2 sends wait for a
    store commit) receives QoS 2 and QoS 1 messages on one topic in publish order."""
    port = zones.ports["plain"]
    sub, _ = persistent(open_client, port, f"{uid}-sub", 5, clean=True)
    subscribe(sub, (f"{uid}/t", 2))
    pub = Publisher(open_client, port, f"{uid}-pub")
    sent = [(b"x", 2), (b"y", 1), (b"z", 2), (b"w", 1)]
    # Pipelined: each PUBREL and the next PUBLISH go out before the PUBCOMP comes back.
    acks: list[Packet] = []
    for pid, (body, qos) in enumerate(sent, start=1):
        pub.client.send(Publish(f"{uid}/t", body, qos, packet_id=pid))
        if qos == 2:
            while (packet := pub.client.recv()) != PubRec(pid):
                acks.append(packet)
            pub.client.send(PubRel(pid))
    acks += barrier(pub.client, 4 - len(acks))
    assert sorted((type(a).__name__, a.packet_id) for a in acks) == [  # type: ignore[union-attr]
        ("PubAck", 2), ("PubAck", 4), ("PubComp", 1), ("PubComp", 3)]
    got = barrier(sub, 4)
    assert [(p.payload, p.qos) for p in got] == sent  # type: ignore[union-attr]


def test_seed_000_receive_maximum_sets_the_window_for_mqtt5_clients(zones: BrokerProcess, open_client: Opener,
                                                                    uid: str) -> None:
    """An MQTT 5.0 client's Receive Maximum sets the length of its Inflight Window (capped by ``max_inflight``),
    while a client of an earlier protocol version gets ``max_inflight`` from the configuration [MQTT-3.3.4-9]: with
    max_inflight = 10, a 5.0 client with Receive Maximum 3 has at most 3 unacknowledged, one with 20 has 10, a 3.1.1
    client has 10."""
    port = zones.ports["rm10"]
    rm3, _ = session(open_client, port, f"{uid}-rm3", 5, props={P.RECEIVE_MAXIMUM: 3})
    rm20, _ = session(open_client, port, f"{uid}-rm20", 5, props={P.RECEIVE_MAXIMUM: 20})
    v311, _ = session(open_client, port, f"{uid}-v311", 4)
    for client in (rm3, rm20, v311):
        subscribe(client, (f"{uid}/t", 1))
    bodies = Publisher(open_client, port, f"{uid}-pub").publish_numbered(f"{uid}/t", 14)
    got3 = barrier(rm3, 3)
    assert payloads(got3) == bodies[:3]
    assert payloads(barrier(rm20, 10)) == bodies[:10]
    assert payloads(barrier(v311, 10)) == bodies[:10]
    rm3.send(PubAck(got3[1].packet_id))  # type: ignore[union-attr]
    assert payloads(barrier(rm3, 1)) == [bodies[3]]


def test_seed_000_max_inflight_0_means_no_limit(zones: BrokerProcess, open_client: Opener, uid: str) -> None:
    """``max_inflight`` is the Inflight Window's length limit, and 0 means no limit: 200 unacknowledged QoS 1
    messages all arrive, to a 3.1.1 client and to a 5.0 client without Receive Maximum."""
    port = zones.ports["nolimit"]
    v311, _ = session(open_client, port, f"{uid}-v311", 4)
    v5, _ = session(open_client, port, f"{uid}-v5", 5)
    for client in (v311, v5):
        subscribe(client, (f"{uid}/t", 1))
    pub = Publisher(open_client, port, f"{uid}-pub")
    bodies = [b"n%03d" % i for i in range(200)]
    pub.publish_many(f"{uid}/t", bodies)
    for client in (v311, v5):
        got = barrier(client, 200)
        assert payloads(got) == bodies
        assert len({p.packet_id for p in got}) == 200  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ Message Queue


@pytest.mark.parametrize("version", [4, 5])
def test_seed_002_full_queue_drops_oldest_qos0_first_and_counts_drops(zones: BrokerProcess, open_client: Opener,
                                                                      uid: str, version: int) -> None:
    """When the Message Queue is also full, a new message is still queued and the first one queued is dropped, a
    QoS 0 message first if the queue holds any; every drop is counted by reason
    ($SYS/broker/messages/dropped/mqueue_full_qos0 and .../mqueue_full)."""
    port = zones.ports["q3"]
    before_q0 = sys_counter(open_client, port, "mqueue_full_qos0", uid)
    before_q1 = sys_counter(open_client, port, "mqueue_full", uid)
    sub, _ = persistent(open_client, port, f"{uid}-sub", version, clean=True)
    subscribe(sub, (f"{uid}/t", 1))
    disconnect(sub)

    pub = Publisher(open_client, port, f"{uid}-pub")
    # max_mqueue_len = 3:  m1(1) -> [1]; m2(0) -> [1 2]; m3(1) -> [1 2 3]; m4(0) drops m2 -> [1 3 4];
    # m5(1) drops m4 -> [1 3 5]; m6(1) drops m1 (no QoS 0 left) -> [3 5 6]; m7(0) drops m3 -> [5 6 7].
    for i, qos in enumerate((1, 0, 1, 0, 1, 1, 0), start=1):
        pub.publish(f"{uid}/t", b"m%d" % i, qos)

    sub, connack = persistent(open_client, port, f"{uid}-sub", version)
    assert connack.session_present is True
    first = barrier(sub, 1)  # max_inflight = 1
    assert payloads(first) == [b"m5"]
    assert first[0].qos == 1  # type: ignore[union-attr]
    sub.send(PubAck(first[0].packet_id))  # type: ignore[union-attr]
    second = barrier(sub, 1)
    assert payloads(second) == [b"m6"]
    sub.send(PubAck(second[0].packet_id))  # type: ignore[union-attr]
    third = barrier(sub, 1)
    assert payloads(third) == [b"m7"]
    assert third[0].qos == 0  # type: ignore[union-attr]
    assert barrier(sub) == []
    wait_counter(open_client, port, "mqueue_full_qos0", uid, before_q0 + 2)
    wait_counter(open_client, port, "mqueue_full", uid, before_q1 + 2)


@pytest.mark.parametrize("store_qos0", [True, False])
def test_seed_000_qos0_queued_offline_only_with_mqueue_store_qos0(zones: BrokerProcess, open_client: Opener,
                                                                  uid: str, store_qos0: bool) -> None:
    """While a persistent session's client is offline, its Message Queue also keeps QoS 0 messages and sends them when
    the client is back; ``mqueue_store_qos0`` turns this on (the default) or off (listener "plain": default true;
    listener "noqos0": false)."""
    port = zones.ports["plain" if store_qos0 else "noqos0"]
    sub, _ = persistent(open_client, port, f"{uid}-sub", 4)
    subscribe(sub, (f"{uid}/t", 2))
    disconnect(sub)
    pub = Publisher(open_client, port, f"{uid}-pub")
    sent = [(b"a", 0), (b"b", 2), (b"c", 0), (b"d", 1), (b"e", 0)]
    for body, qos in sent:
        pub.publish(f"{uid}/t", body, qos)
    sub, connack = persistent(open_client, port, f"{uid}-sub", 4)
    assert connack.session_present is True
    expected = sent if store_qos0 else [(b"b", 2), (b"d", 1)]
    got = barrier(sub, len(expected))
    # FIFO on resume, QoS 0 entries included.
    assert [(p.payload, p.qos) for p in got] == expected  # type: ignore[union-attr]
    # Online, QoS 0 goes out at once whatever mqueue_store_qos0 says.
    pub.publish(f"{uid}/t", b"live", 0)
    assert payloads(barrier(sub, 1)) == [b"live"]


def test_seed_003_queued_messages_delivered_at_min_of_publish_and_subscription_qos(broker: BrokerProcess,
                                                                                  open_client: Opener,
                                                                                  uid: str) -> None:
    """The delivered QoS is min(publish QoS, subscription QoS) - also for messages queued for an
    offline session (MQTT 5.0 §3.8.4 / 3.1.1 §3.8.4)."""
    port = broker.port
    sub, _ = persistent(open_client, port, f"{uid}-sub", 4)
    subscribe(sub, (f"{uid}/s0", 0), (f"{uid}/s1", 1), (f"{uid}/s2", 2))
    disconnect(sub)
    pub = Publisher(open_client, port, f"{uid}-pub")
    expected = []
    for sub_qos in (0, 1, 2):
        for pub_qos in (0, 1, 2):
            body = b"s%dp%d" % (sub_qos, pub_qos)
            pub.publish(f"{uid}/s{sub_qos}", body, pub_qos)
            expected.append((f"{uid}/s{sub_qos}", body, min(sub_qos, pub_qos)))
    sub, connack = persistent(open_client, port, f"{uid}-sub", 4)
    assert connack.session_present is True
    got = barrier(sub, 9)
    assert [(p.topic, p.payload, p.qos) for p in got] == expected  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ re-delivery


@pytest.mark.parametrize("version", [4, 5])
def test_mqtt_4_4_0_1_unacked_publish_and_pubrel_resent_on_resume_with_original_ids(zones: BrokerProcess,
                                                                                   open_client: Opener, uid: str,
                                                                                   version: int) -> None:
    """[MQTT-4.4.0-1] (3.1.1 and 5.0): "When a Client reconnects with CleanSession set to 0 / Clean Start set to 0
    and a session is present, both the Client and Server MUST resend any unacknowledged PUBLISH packets (where
    QoS > 0) and PUBREL packets using their original Packet Identifiers"; [MQTT-3.3.1-1]: DUP is 1 on a re-delivery
    and 0 on the first attempt: unacknowledged messages are re-sent with DUP=1 on reconnect."""
    port = zones.ports["plain"]
    sub, _ = persistent(open_client, port, f"{uid}-sub", version)
    subscribe(sub, (f"{uid}/#", 2))
    pub = Publisher(open_client, port, f"{uid}-pub")
    for name, qos in (("a", 1), ("b", 2), ("c", 2), ("d", 1), ("e", 2)):
        pub.publish(f"{uid}/{name}", name.encode(), qos)
    first = barrier(sub, 5)
    assert payloads(first) == [b"a", b"b", b"c", b"d", b"e"]
    assert [(p.qos, p.dup) for p in first] == [(1, False), (2, False), (2, False), (1, False), (2, False)]  # type: ignore[union-attr]
    ids = {p.payload: p.packet_id for p in first}  # type: ignore[union-attr]
    sub.send(PubRec(ids[b"c"]))  # c: PUBREL pending
    sub.send(PubAck(ids[b"d"]))  # d: done
    sub.send(PubRec(ids[b"e"]))
    assert barrier(sub, 2) == [PubRel(ids[b"c"]), PubRel(ids[b"e"])]
    sub.send(PubComp(ids[b"e"]))  # e: done
    assert barrier(sub) == []
    sub.close()  # network failure, no DISCONNECT

    sub, connack = persistent(open_client, port, f"{uid}-sub", version)
    assert connack.session_present is True
    resent = barrier(sub, 3)
    assert len(resent) == 3, resent
    a, b, rel_c = resent
    assert isinstance(a, Publish) and isinstance(b, Publish)
    assert (a.topic, a.payload, a.qos, a.dup, a.packet_id) == (f"{uid}/a", b"a", 1, True, ids[b"a"])
    assert (b.topic, b.payload, b.qos, b.dup, b.packet_id) == (f"{uid}/b", b"b", 2, True, ids[b"b"])
    assert rel_c == PubRel(ids[b"c"])
    # Finish every flow; a second resume has nothing left to re-send.
    sub.send(PubAck(ids[b"a"]))
    sub.send(PubRec(ids[b"b"]))
    assert barrier(sub, 1) == [PubRel(ids[b"b"])]
    sub.send(PubComp(ids[b"b"]))
    sub.send(PubComp(ids[b"c"]))
    assert barrier(sub) == []
    sub.close()
    sub, connack = persistent(open_client, port, f"{uid}-sub", version)
    assert connack.session_present is True
    assert barrier(sub) == []


def test_seed_003_retry_interval_resends_to_mqtt311_but_never_within_an_mqtt5_connection(
        zones: BrokerProcess, open_client: Opener, uid: str) -> None:
    """A sender that gets no PUBACK for a PUBLISH within a while re-sends it with DUP=1 - for 3.1.1 with
    retry_interval = "1s", also the PUBREL of QoS 2; [MQTT-4.4.0-1] (5.0): re-sending on reconnect "is the only
    circumstance where a Client or Server is REQUIRED to resend messages", so the broker never re-sends to a 5.0
    client in the same connection (docs/architecture.md, "Session semantics")."""
    port = zones.ports["retry"]
    v311, _ = session(open_client, port, f"{uid}-v311", 4)
    v5, _ = session(open_client, port, f"{uid}-v5", 5)
    for client in (v311, v5):
        subscribe(client, (f"{uid}/#", 2))
    pub = Publisher(open_client, port, f"{uid}-pub")
    pub.publish(f"{uid}/one", b"one", 1)
    pub.publish(f"{uid}/two", b"two", 2)
    first311 = barrier(v311, 2)
    first5 = barrier(v5, 2)
    assert [(p.payload, p.dup) for p in first311] == [(b"one", False), (b"two", False)]  # type: ignore[union-attr]
    assert [(p.payload, p.dup) for p in first5] == [(b"one", False), (b"two", False)]  # type: ignore[union-attr]
    one, two = first311
    v311.send(PubRec(two.packet_id))  # type: ignore[union-attr]
    v5.send(PubRec(first5[1].packet_id))  # type: ignore[union-attr]
    assert barrier(v5, 1) == [PubRel(first5[1].packet_id)]  # type: ignore[union-attr]

    # The PUBREL answers the PUBREC at once. Then each delivery comes again at the first tick a second or more
    # after its own last send: "one" may come twice before the PUBREL comes again, and one tick may carry both.
    again: list[Packet] = []
    while again.count(PubRel(two.packet_id)) < 2 or not any(isinstance(p, Publish) for p in again):  # type: ignore[union-attr]
        assert len(again) < 6, again
        again.append(v311.recv(timeout=4.0))
    for packet in again:
        if isinstance(packet, Publish):
            assert (packet.payload, packet.qos, packet.dup, packet.packet_id) == (b"one", 1, True, one.packet_id)
        else:
            assert packet == PubRel(two.packet_id)  # type: ignore[union-attr]
    # The same tick would have re-sent to the 5.0 client: nothing came.
    assert barrier(v5) == []
    v311.send(PubAck(one.packet_id))  # type: ignore[union-attr]
    v311.send(PubComp(two.packet_id))  # type: ignore[union-attr]
    assert barrier(v311) == []


@pytest.mark.parametrize("version", [4, 5])
def test_seed_003_inbound_qos2_dropped_after_await_rel_timeout(zones: BrokerProcess, open_client: Opener, uid: str,
                                                               version: int) -> None:
    """``max_awaiting_rel`` (100) and ``await_rel_timeout`` (300 s) bound the inbound QoS 2 state
    (docs/architecture.md, "Session semantics"): with await_rel_timeout = "1s" a QoS 2 message left without PUBREL
    is dropped and never delivered; a later PUBREL still gets PUBCOMP (the receiver no longer holds that Packet
    Identifier, so it answers PUBCOMP however many PUBRELs come), in 5.0 with Reason Code 0x92 Packet Identifier
    not found (MQTT 5.0 §3.7.2.1)."""
    port = zones.ports["rel"]
    before = sys_counter(open_client, port, "await_rel_timeout", uid)
    sub, _ = session(open_client, port, f"{uid}-sub", 4)
    subscribe(sub, (f"{uid}/t", 2))
    pub, _ = session(open_client, port, f"{uid}-pub", version)
    pub.send(Publish(f"{uid}/t", b"late", 2, packet_id=7))
    assert pub.recv() == PubRec(7)
    wait_counter(open_client, port, "await_rel_timeout", uid, before + 1)
    pub.send(PubRel(7))
    assert pub.recv() == PubComp(7, 0x92 if version == 5 else 0)
    assert barrier(sub) == []
    assert barrier(pub) == []
    # The identifier is free again: a new QoS 2 message with it goes through.
    pub.send(Publish(f"{uid}/t", b"next", 2, packet_id=7))
    assert pub.recv() == PubRec(7)
    pub.send(PubRel(7))
    assert pub.recv() == PubComp(7)
    assert payloads(barrier(sub, 1)) == [b"next"]


def test_seed_003_max_awaiting_rel_bounds_inbound_qos2(zones: BrokerProcess, open_client: Opener, uid: str) -> None:
    """``max_awaiting_rel`` bounds the inbound QoS 2 state; it is the Receive Maximum the broker announces
    in CONNACK (MQTT 5.0 §3.2.2.3.3), and a client exceeding it is disconnected with 0x93 Receive Maximum exceeded
    (MQTT 5.0 §3.3.4)."""
    port = zones.ports["rel"]
    pub, connack = session(open_client, port, f"{uid}-pub", 5)
    assert connack.properties[P.RECEIVE_MAXIMUM] == 2
    for pid in (1, 2):
        pub.send(Publish(f"{uid}/t", b"x", 2, packet_id=pid))
        assert pub.recv() == PubRec(pid)
    pub.send(Publish(f"{uid}/t", b"x", 2, packet_id=3))
    packet = pub.recv()
    assert isinstance(packet, Disconnect) and packet.reason_code == 0x93, packet
    assert pub.closed_by_server()


# ------------------------------------------------------------------------------------------------ offline messages


@pytest.mark.parametrize("version", [4, 5])
def test_seed_004_persistent_session_keeps_subscriptions_and_queues_qos1_qos2(broker: BrokerProcess,
                                                                              open_client: Opener, uid: str,
                                                                              version: int) -> None:
    """When a session made with Clean Session = 0 / Clean Start = 0 disconnects, the broker keeps the QoS >= 1 messages
    for it as offline messages and delivers them when the client resumes the session; 3.1.1 [MQTT-3.1.2-4]
    [MQTT-3.1.2-5] [MQTT-3.2.2-2], 5.0 [MQTT-3.1.2-23] [MQTT-3.2.2-3]: Session Present 1."""
    port = broker.port
    sub, connack = persistent(open_client, port, f"{uid}-sub", version, clean=True)
    assert connack.session_present is False
    subscribe(sub, (f"{uid}/q1", 1), (f"{uid}/q2", 2))
    disconnect(sub)
    pub = Publisher(open_client, port, f"{uid}-pub")
    pub.publish(f"{uid}/q1", b"A", 1)
    pub.publish(f"{uid}/q2", b"B", 2)
    pub.publish(f"{uid}/q1", b"C", 2)
    sub, connack = persistent(open_client, port, f"{uid}-sub", version)
    assert connack.session_present is True
    got = barrier(sub, 3)
    assert [(p.topic, p.payload, p.qos) for p in got] == [  # type: ignore[union-attr]
        (f"{uid}/q1", b"A", 1), (f"{uid}/q2", b"B", 2), (f"{uid}/q1", b"C", 1)]
    sub.send(PubAck(got[0].packet_id))  # type: ignore[union-attr]
    sub.send(PubRec(got[1].packet_id))  # type: ignore[union-attr]
    sub.send(PubAck(got[2].packet_id))  # type: ignore[union-attr]
    assert barrier(sub, 1) == [PubRel(got[1].packet_id)]  # type: ignore[union-attr]
    sub.send(PubComp(got[1].packet_id))  # type: ignore[union-attr]
    # The subscriptions survived: no new SUBSCRIBE needed.
    pub.publish(f"{uid}/q2", b"D", 1)
    assert [(p.payload, p.qos) for p in barrier(sub, 1)] == [(b"D", 1)]  # type: ignore[union-attr]


@pytest.mark.parametrize("version", [4, 5])
def test_seed_004_clean_start_discards_session_and_offline_messages(broker: BrokerProcess, open_client: Opener,
                                                                    uid: str, version: int) -> None:
    """A new session made with Clean Session = 1 / Clean Start = 1 discards the stored offline messages; 3.1.1
    [MQTT-3.1.2-6], 5.0 [MQTT-3.1.2-4] [MQTT-3.2.2-2]: Session Present 0 and the old subscriptions are gone."""
    port = broker.port
    sub, _ = persistent(open_client, port, f"{uid}-sub", version, clean=True)
    subscribe(sub, (f"{uid}/t", 1))
    disconnect(sub)
    pub = Publisher(open_client, port, f"{uid}-pub")
    pub.publish(f"{uid}/t", b"old1", 1)
    pub.publish(f"{uid}/t", b"old2", 2)
    sub, connack = session(open_client, port, f"{uid}-sub", version, clean=True)
    assert connack.session_present is False
    assert barrier(sub) == []
    pub.publish(f"{uid}/t", b"new", 1)
    assert barrier(sub) == []


def test_mqtt_4_1_0_2_session_expiry_interval_ends_offline_session(broker: BrokerProcess, open_client: Opener,
                                                                   uid: str) -> None:
    """[MQTT-4.1.0-2] (5.0): "The Server MUST discard the Session State when the Network Connection is closed and
    the Session Expiry Interval has passed", so session expiry also clears its offline messages. Session Expiry
    Interval 1 s: after 1.5 s Session Present is 0 and nothing is delivered."""
    port = broker.port
    sub, _ = session(open_client, port, f"{uid}-sub", 5, clean=True, expiry=1)
    subscribe(sub, (f"{uid}/t", 1))
    disconnect(sub)
    pub = Publisher(open_client, port, f"{uid}-pub")
    pub.publish(f"{uid}/t", b"queued", 1)
    time.sleep(1.5)  # stays: the 1 s Session Expiry Interval must pass (the expiry is what is tested)
    sub, connack = session(open_client, port, f"{uid}-sub", 5, clean=False, expiry=1)
    assert connack.session_present is False
    assert barrier(sub) == []
    pub.publish(f"{uid}/t", b"after", 1)
    assert barrier(sub) == []


def test_seed_004_message_expiry_interval_drops_queued_messages_unless_own_expiry(zones: BrokerProcess,
                                                                                  open_client: Opener,
                                                                                  uid: str) -> None:
    """Queued offline messages not delivered within ``message_expiry_interval`` are dropped (0: they never
    expire); an MQTT 5 Message Expiry Interval on the message wins (docs/architecture.md, "Session semantics");
    [MQTT-3.3.2-5] (5.0) the expired copy is deleted, [MQTT-3.3.2-6] the forwarded interval is
    reduced by the time waited. Listener "msgexp" has message_expiry_interval = "1s", "plain" the default 5m."""
    short, plain = zones.ports["msgexp"], zones.ports["plain"]
    for port, name in ((short, "short"), (plain, "plain")):
        sub, _ = persistent(open_client, port, f"{uid}-{name}", 5)
        subscribe(sub, (f"{uid}/t", 1))
        disconnect(sub)
    pub = Publisher(open_client, plain, f"{uid}-pub", 5)
    pub.publish(f"{uid}/t", b"no-expiry", 1)
    pub.publish(f"{uid}/t", b"own-60s", 1, {P.MESSAGE_EXPIRY_INTERVAL: 60})
    pub.publish(f"{uid}/t", b"own-1s", 1, {P.MESSAGE_EXPIRY_INTERVAL: 1})
    time.sleep(1.5)  # stays: the 1 s expiry intervals must pass (the expiry is what is tested)
    got = {}
    for port, name in ((short, "short"), (plain, "plain")):
        sub, connack = persistent(open_client, port, f"{uid}-{name}", 5)
        assert connack.session_present is True
        got[name] = barrier(sub, 1 if name == "short" else 2)
    assert payloads(got["short"]) == [b"own-60s"]
    assert payloads(got["plain"]) == [b"no-expiry", b"own-60s"]
    assert P.MESSAGE_EXPIRY_INTERVAL not in got["plain"][0].properties  # type: ignore[union-attr]
    for packets in (got["short"], got["plain"][1:]):
        remaining = packets[0].properties[P.MESSAGE_EXPIRY_INTERVAL]  # type: ignore[union-attr]
        assert 57 <= remaining <= 59
