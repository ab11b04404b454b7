"""The broker core in process: no sockets, no sleeps, time given as ``now`` (a fake clock).

Each test drives :class:`~gateway.broker.broker.Broker` the way the I/O layer does (``open``, ``receive``,
``tick``, ``connection_lost``) and decodes what the returned actions wrote (kept per connection by
``tests/recording_broker.py``) with the client side's :class:`~gateway.mqtt.framing.PacketReader`. Tests are
named after the normative statement they check, or carry the prefix of the group of session semantics they check
(docs/architecture.md, "Session semantics"): ``seed000`` to ``seed002`` the Inflight Window and the Message Queue
(with its drop policy and ``mqueue_store_qos0``), ``seed003`` the QoS 1/2 flows and the delivered QoS,
``seed004`` offline messages and their expiry.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from recording_broker import RecordingBroker

from gateway.broker.actions import UNTIL_RELEASED
from gateway.broker.broker import Broker
from gateway.broker.connection_states import CLOSED, CONNECTED
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.session_state import NO_ENTRIES, NO_QUEUE
from gateway.broker.store_port import ChangeLog, MemoryStore, StoreChange
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import (
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
from gateway.mqtt.reason_codes import ReasonCode as RC


def make_broker(now: float = 0.0) -> RecordingBroker:
    return RecordingBroker(BrokerSettings(sys_interval=0), MemoryStore(), now=now)


class Client:
    """One client connection driven by hand: packets in, decoded packets out."""

    _peers = 0

    def __init__(self, broker: RecordingBroker, version: int = 4, limits: ZoneLimits | None = None, now: float = 0.0):
        Client._peers += 1
        self.broker = broker
        self.version = version
        self.conn = broker.open(limits or ZoneLimits(), "external", f"peer:{Client._peers}", now)
        self.reader = PacketReader(version=version)
        self.unread: list[Any] = []

    def send(self, packet: Any, now: float = 0.0) -> None:
        self.send_bytes(packet.encode(self.version), now)

    def send_bytes(self, data: bytes, now: float = 0.0) -> None:
        self.broker.receive(self.conn, data, now)
        resume = getattr(self.broker, "resume", None)
        while resume is not None and self.conn.pending:  # a long PUBACK run handled in parts
            resume(self.conn, now)

    def read(self) -> list[Any]:
        """Every packet the broker wrote to this connection since the last read."""
        data = self.broker.take(self.conn)
        packets = self.unread + list(self.reader.feed(data))
        self.unread = []
        return packets

    def connect(self, client_id: str, now: float = 0.0, **kwargs: Any) -> Connack:
        self.send(Connect(client_id, protocol_level=self.version, **kwargs), now)
        packets = self.read()
        assert isinstance(packets[0], Connack), packets
        self.unread = packets[1:]  # what a resumed session re-sends after the CONNACK
        return packets[0]

    def subscribe(self, topic_filter: str, qos: int, now: float = 0.0, packet_id: int = 1) -> list[int]:
        self.send(Subscribe(packet_id, [Subscription(topic_filter, qos)]), now)
        suback = self.read()[0]
        assert isinstance(suback, Suback)
        return suback.reason_codes

    def publishes(self) -> list[Publish]:
        packets = self.read()
        assert all(isinstance(p, Publish) for p in packets), packets
        return packets

    def disconnect(self, now: float = 0.0) -> None:
        self.send(Disconnect(), now)
        self.broker.connection_lost(self.conn, now)


def pair(limits: ZoneLimits | None = None, sub_qos: int = 1, version: int = 4) -> tuple[Broker, Client, Client]:
    """A broker, a subscriber on ``t`` at ``sub_qos`` and a publisher."""
    broker = make_broker()
    sub = Client(broker, version, limits)
    sub.connect("sub")
    assert sub.subscribe("t", sub_qos) == [sub_qos]
    pub = Client(broker, version, limits)
    pub.connect("pub")
    return broker, sub, pub


def publish_many(pub: Client, payloads: list[bytes], qos: int = 1, first_pid: int = 1) -> None:
    for i, payload in enumerate(payloads):
        pub.send(Publish("t", payload, qos=qos, packet_id=first_pid + i if qos else None))
    pub.read()  # PUBACKs


def offline_subscriber(broker: Broker, limits: ZoneLimits, qos: int = 1) -> Client:
    """A persistent session (Clean Session 0) subscribed to ``t`` at ``qos``, now disconnected."""
    sub = Client(broker, 4, limits)
    sub.connect("sub", clean_start=False)
    sub.subscribe("t", qos)
    sub.disconnect()
    return sub


# --------------------------------------------------------------------------- Inflight Window


def test_seed000_inflight_window_full_then_freed_fifo_from_the_message_queue() -> None:
    broker, sub, pub = pair(ZoneLimits(max_inflight=2))
    publish_many(pub, [b"m1", b"m2", b"m3", b"m4", b"m5"])
    first = sub.publishes()
    assert [p.payload for p in first] == [b"m1", b"m2"]  # the window is full; m3..m5 wait in the queue
    session = broker.sessions["sub"]
    assert len(session.inflight) == 2 and len(session.mqueue) == 3
    sub.send(PubAck(first[0].packet_id))
    assert [p.payload for p in sub.publishes()] == [b"m3"]  # one slot freed, one message in, FIFO
    sub.send_bytes(PubAck(first[1].packet_id).encode(4) + PubAck(3).encode(4))
    assert [p.payload for p in sub.publishes()] == [b"m4", b"m5"]
    assert not session.mqueue


def test_seed000_a_long_run_of_pubacks_refills_the_window_in_order() -> None:
    broker, sub, pub = pair(ZoneLimits(max_inflight=32, max_mqueue_len=0))
    publish_many(pub, [b"%d" % i for i in range(100)])
    got = sub.publishes()
    assert len(got) == 32
    while got:  # acknowledge every window in one run of PUBACKs, as a fast subscriber does
        sub.send_bytes(b"".join(PubAck(p.packet_id).encode(4) for p in got))
        new = sub.publishes()
        assert not new or int(new[0].payload) == int(got[-1].payload) + 1
        got = new
    assert not broker.sessions["sub"].inflight and not broker.sessions["sub"].mqueue


def test_seed001_qos0_bypasses_a_full_inflight_window() -> None:
    _broker, sub, pub = pair(ZoneLimits(max_inflight=1))
    publish_many(pub, [b"q1-a", b"q1-b"])
    assert [p.payload for p in sub.publishes()] == [b"q1-a"]  # q1-b waits in the queue
    pub.send(Publish("t", b"q0", qos=0))
    assert [(p.payload, p.qos) for p in sub.publishes()] == [(b"q0", 0)]  # out at once, past the queue


@pytest.mark.parametrize(("max_inflight", "receive_maximum", "window"), [(32, 3, 3), (4, 100, 4)])
def test_seed000_inflight_window_is_max_inflight_capped_by_receive_maximum(
    max_inflight: int, receive_maximum: int, window: int
) -> None:
    """A 5.0 client's Receive Maximum caps ``max_inflight``, and ``max_inflight`` caps a larger one."""
    broker = make_broker()
    sub = Client(broker, 5, ZoneLimits(max_inflight=max_inflight))
    sub.connect("sub", properties={P.RECEIVE_MAXIMUM: receive_maximum})
    sub.subscribe("t", 1)
    pub = Client(broker, 5)
    pub.connect("pub")
    publish_many(pub, [b"%d" % i for i in range(10)])
    assert len(sub.publishes()) == window
    assert broker.sessions["sub"].conn.window == window  # type: ignore[union-attr]


def test_mqtt_4_4_0_1_unacknowledged_publish_resent_with_dup_on_reconnect() -> None:
    broker = make_broker()
    limits = ZoneLimits(max_inflight=2)
    sub = Client(broker, 4, limits)
    sub.connect("sub", clean_start=False)
    sub.subscribe("t", 1)
    pub = Client(broker, 4)
    pub.connect("pub")
    publish_many(pub, [b"a", b"b", b"c"])
    sent = sub.publishes()
    assert [(p.payload, p.dup) for p in sent] == [(b"a", False), (b"b", False)]
    broker.connection_lost(sub.conn, 1.0)
    again = Client(broker, 4, limits, now=2.0)
    assert again.connect("sub", 2.0, clean_start=False).session_present
    resent = again.publishes()
    assert [(p.payload, p.dup, p.packet_id) for p in resent] == [
        (b"a", True, sent[0].packet_id),
        (b"b", True, sent[1].packet_id),
    ]
    again.send(PubAck(sent[0].packet_id), 2.0)
    assert [(p.payload, p.dup) for p in again.publishes()] == [(b"c", False)]


def test_mqtt_3_3_4_9_resume_with_smaller_receive_maximum_resends_one_at_a_time_keeping_identifiers() -> None:
    """A 3.1.1 session with three QoS 2 messages in flight (the first PUBRECed) resumed by 5.0 with Receive
    Maximum 1: PUBREL for the first, then each PUBLISH with DUP=1 and its old Packet Identifier only after the one
    before completes [MQTT-3.3.4-9]; a PUBACK-free slot then takes the queue's next message, FIFO."""
    broker = make_broker()
    limits = ZoneLimits(max_inflight=3)
    sub = Client(broker, 4, limits)
    sub.connect("sub", clean_start=False)
    sub.subscribe("t", 2)
    pub = Client(broker, 4)
    pub.connect("pub")
    for i, payload in enumerate([b"a", b"b", b"c", b"d"]):
        pub.send(Publish("t", payload, qos=2, packet_id=i + 1))
        pub.send(PubRel(i + 1))
    sent = sub.publishes()
    assert [p.payload for p in sent] == [b"a", b"b", b"c"]
    sub.send(PubRec(sent[0].packet_id))
    assert [type(p) for p in sub.read()] == [PubRel]
    broker.connection_lost(sub.conn, 1.0)
    back = Client(broker, 5, limits, now=2.0)
    back.connect("sub", 2.0, clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60, P.RECEIVE_MAXIMUM: 1})
    assert [(type(p), p.packet_id) for p in back.read()] == [(PubRel, sent[0].packet_id)]
    done = sent[0].packet_id
    for old in sent[1:]:
        back.send(PubComp(done), 2.0)
        (again,) = back.read()
        assert (again.payload, again.dup, again.packet_id) == (old.payload, True, old.packet_id)
        back.send(PubRec(old.packet_id), 2.0)
        assert [type(p) for p in back.read()] == [PubRel]
        done = old.packet_id
    back.send(PubComp(done), 2.0)
    (last,) = back.read()
    assert (last.payload, last.dup, last.qos) == (b"d", False, 2)


# --------------------------------------------------------------------------- Message Queue


def test_seed002_full_message_queue_drops_qos0_first() -> None:
    broker = make_broker()
    limits = ZoneLimits(max_mqueue_len=3)
    sub = offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    pub.send(Publish("t", b"a", qos=1, packet_id=1))
    pub.send(Publish("t", b"b", qos=0))
    pub.send(Publish("t", b"c", qos=1, packet_id=2))
    pub.send(Publish("t", b"d", qos=1, packet_id=3))  # full: the new one is queued, the QoS 0 one dropped
    assert broker.stats.dropped["mqueue_full_qos0"] == 1
    pub.send(Publish("t", b"e", qos=1, packet_id=4))  # full again, no QoS 0 left: the oldest goes
    assert broker.stats.dropped["mqueue_full"] == 1
    again = Client(broker, 4, limits)
    again.connect("sub", clean_start=False)
    assert [p.payload for p in again.publishes()] == [b"c", b"d", b"e"]
    assert sub.conn.state == CLOSED


def test_seed000_mqueue_store_qos0_false_drops_qos0_for_offline_sessions() -> None:
    broker = make_broker()
    limits = ZoneLimits(mqueue_store_qos0=False)
    offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    pub.send(Publish("t", b"q0", qos=0))
    pub.send(Publish("t", b"q1", qos=1, packet_id=1))
    assert broker.stats.dropped["qos0_offline"] == 1
    again = Client(broker, 4, limits)
    again.connect("sub", clean_start=False)
    assert [p.payload for p in again.publishes()] == [b"q1"]


def test_max_mqueue_bytes_drops_the_oldest_qos0_first() -> None:
    broker = make_broker()
    limits = ZoneLimits(max_mqueue_bytes=10)
    offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    pub.send(Publish("t", b"1111", qos=1, packet_id=1))
    pub.send(Publish("t", b"2222", qos=0))
    pub.send(Publish("t", b"3333", qos=1, packet_id=2))  # 12 bytes > 10: the QoS 0 one goes
    assert broker.stats.dropped["mqueue_quota_qos0"] == 1
    pub.send(Publish("t", b"4444", qos=1, packet_id=3))  # 12 again: the oldest goes
    assert broker.stats.dropped["mqueue_quota"] == 1
    assert broker.sessions["sub"].mqueue.bytes == 8
    again = Client(broker, 4, limits)
    again.connect("sub", clean_start=False)
    assert [p.payload for p in again.publishes()] == [b"3333", b"4444"]


# --------------------------------------------------------------------------- QoS flows


def test_seed003_qos2_duplicate_publish_before_pubrel_delivered_once() -> None:
    broker, sub, pub = pair(sub_qos=2)
    pub.send(Publish("t", b"once", qos=2, packet_id=7))
    assert pub.read() == [PubRec(7)]  # PUBREC at once, the identifier kept
    assert sub.read() == []  # stored, not delivered before PUBREL
    pub.send(Publish("t", b"once", qos=2, dup=True, packet_id=7))
    assert pub.read() == [PubRec(7)]  # a repeat of that identifier: a duplicate, acknowledged again
    assert broker.stats.dropped["qos2_duplicate"] == 1
    pub.send(PubRel(7))
    assert pub.read() == [PubComp(7)]
    assert [(p.payload, p.qos) for p in sub.publishes()] == [(b"once", 2)]
    pub.send(PubRel(7))  # a repeated PUBREL after the identifier was forgotten: PUBCOMP again, no copy
    assert pub.read() == [PubComp(7)]
    assert sub.read() == []


def test_seed000_a_session_that_never_subscribed_holds_no_queue_window_or_subscriptions_of_its_own() -> None:
    """A client that only publishes (most sensors) shares empty read-only stand-ins for the subscriptions, the
    Inflight Window, the Message Queue and the QoS 2 identifiers awaiting PUBREL (an idle connection stays
    small); its QoS 1/2 flows, an UNSUBSCRIBE of nothing and a resumed persistent session work as ever, and its
    first SUBSCRIBE gives it its own."""
    broker = make_broker()
    pub = Client(broker, 5)
    pub.connect("pub", clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60})
    session = broker.sessions["pub"]
    assert session.mqueue is NO_QUEUE and len(session.mqueue) == 0
    assert session.inflight is NO_ENTRIES and session.subscriptions is NO_ENTRIES
    assert session.awaiting_rel is NO_ENTRIES
    pub.send(Unsubscribe(1, ["never/subscribed"]))
    assert pub.read() == [Unsuback(1, [RC.NO_SUBSCRIPTION_EXISTED])]
    pub.send(Publish("t", b"1", qos=1, packet_id=2))
    pub.send(Publish("t", b"2", qos=2, packet_id=3))
    assert pub.read() == [PubAck(2, RC.NO_MATCHING_SUBSCRIBERS), PubRec(3)]  # QoS 2 is routed on PUBREL
    assert session.awaiting_rel is not NO_ENTRIES and list(session.awaiting_rel) == [3]  # its own, once used
    pub.send(PubRel(3))
    assert pub.read() == [PubComp(3)] and not session.awaiting_rel
    pub.disconnect(1.0)
    again = Client(broker, 5)
    assert again.connect("pub", 2.0, clean_start=False).session_present  # resumed: nothing to re-send
    assert again.read() == [] and broker.sessions["pub"].mqueue is NO_QUEUE
    assert again.subscribe("t", 1, 2.0) == [1]
    assert session.mqueue is not NO_QUEUE and isinstance(session.inflight, dict)
    assert list(session.subscriptions) == ["t"]
    other = Client(broker, 5)
    other.connect("other")
    other.send(Publish("t", b"3", qos=1, packet_id=1))
    assert [p.payload for p in again.publishes()] == [b"3"]
    assert NO_QUEUE.max_len == 0 and len(NO_QUEUE) == 0 and len(NO_ENTRIES) == 0  # the stand-ins stayed empty


def test_an_idle_connection_costs_the_core_under_1_kib() -> None:
    """The core's objects for one idle connection (Connection, Session, its entries in the broker's tables and
    the Deadline Index, the Client Identifier), counted by tracemalloc over 3,000 connections: < 1,024 bytes
    (1,415 bytes before the shared stand-ins of a session that never subscribed, and the dicts instead
    of sets for the connections and the Deadline Index's seconds)."""
    import gc
    import tracemalloc

    broker = Broker(BrokerSettings(sys_interval=0), MemoryStore(), now=0.0)  # its actions are dropped, not kept
    limits = ZoneLimits()
    packets = [Connect(f"idle-{i:06d}", keep_alive=60).encode(4) for i in range(3000)]
    peers = [f"127.0.0.1:{20000 + i}" for i in range(3000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        conns = []
        for i in range(3000):
            conn = broker.open(limits, "external", peers[i], 0.5)
            broker.receive(conn, packets[i], 0.5)  # the CONNACK's action is handed out, and dropped
            conns.append(conn)
        gc.collect()
        per_connection = (tracemalloc.get_traced_memory()[0] - before - sys.getsizeof(conns)) / 3000
    finally:
        tracemalloc.stop()
    assert all(c.state == CONNECTED for c in conns)
    assert per_connection < 1024, per_connection


def test_seed003_pubrel_for_an_unknown_identifier_still_gets_pubcomp() -> None:
    broker = make_broker()
    c311 = Client(broker, 4)
    c311.connect("a")
    c311.send(PubRel(42))
    assert c311.read() == [PubComp(42)]
    c5 = Client(broker, 5)
    c5.connect("b")
    c5.send(PubRel(42))
    assert c5.read() == [PubComp(42, RC.PACKET_IDENTIFIER_NOT_FOUND)]  # MQTT 5.0 §3.7.2.1


def test_seed003_subscriber_side_qos2_flow_publish_pubrec_pubrel_pubcomp() -> None:
    broker, sub, pub = pair(sub_qos=2)
    pub.send(Publish("t", b"x", qos=2, packet_id=1))
    pub.send(PubRel(1))
    pub.read()
    (p,) = sub.publishes()
    sub.send(PubRec(p.packet_id))
    assert sub.read() == [PubRel(p.packet_id)]
    assert broker.sessions["sub"].inflight  # awaiting PUBCOMP
    sub.send(PubComp(p.packet_id))
    assert not broker.sessions["sub"].inflight


def test_seed003_retry_interval_counts_a_pubrel_from_its_own_send() -> None:
    """3.1.1 with ``retry_interval`` 1 s: an unacknowledged PUBLISH comes again with DUP=1 a second after its last
    send, and the PUBREL that answered a PUBREC a second after that PUBREL went out, not after its PUBLISH did
    (docs/architecture.md, "Session semantics"). PUBRECs read one at a time and as a run count alike."""
    broker, sub, pub = pair(ZoneLimits(retry_interval=1.0), sub_qos=2)
    for pid, payload in enumerate((b"one", b"two", b"three"), start=1):
        pub.send(Publish("t", payload, qos=2, packet_id=pid))
        pub.send(PubRel(pid))
    one, two, three = sub.publishes()
    sub.send(PubRec(two.packet_id), now=0.9)
    sub.send_bytes(PubRec(three.packet_id).encode(4) + PubRec(99).encode(4), now=0.9)
    assert sub.read() == [PubRel(two.packet_id), PubRel(three.packet_id), PubRel(99)]
    broker.tick(1.5)
    assert sub.read() == [Publish("t", b"one", qos=2, dup=True, packet_id=one.packet_id)]
    broker.tick(1.95)
    assert sub.read() == [PubRel(two.packet_id), PubRel(three.packet_id)]
    broker.tick(2.5)
    assert sub.read() == [Publish("t", b"one", qos=2, dup=True, packet_id=one.packet_id)]


@pytest.mark.parametrize("version", [4, 5])
def test_seed003_qos2_flows_acknowledged_in_runs_of_one_read_each(version: int) -> None:
    """Runs of PUBRELs, PUBRECs and PUBCOMPs arriving in one read (the broker reads them without a packet object
    each): every message delivered once, every flow completed in order, the window refilled FIFO from the queue; an
    unknown identifier inside a run still gets its PUBCOMP / PUBREL (5.0: 0x92), and bytes after a run are handled
    after it."""
    broker, sub, pub = pair(ZoneLimits(max_inflight=4, max_mqueue_len=0), sub_qos=2, version=version)
    pids = list(range(1, 11))
    pub.send_bytes(b"".join(Publish("t", b"%d" % pid, qos=2, packet_id=pid).encode(version) for pid in pids))
    assert pub.read() == [PubRec(pid) for pid in pids]
    unknown = 0x92 if version == 5 else 0
    pub.send_bytes(b"".join(PubRel(pid).encode(version) for pid in [*pids[:5], 77, *pids[5:]])
                   + PingReq().encode(version))
    assert pub.read() == [*(PubComp(pid) for pid in pids[:5]), PubComp(77, unknown),
                          *(PubComp(pid) for pid in pids[5:]), PingResp()]
    got: list[bytes] = []
    for _ in range(3):
        window = sub.publishes()
        assert 0 < len(window) <= 4
        got += [p.payload for p in window]
        sub.send_bytes(b"".join(PubRec(p.packet_id).encode(version) for p in window) + PubRec(999).encode(version))
        assert sub.read() == [*(PubRel(p.packet_id) for p in window), PubRel(999, unknown)]
        sub.send_bytes(b"".join(PubComp(p.packet_id).encode(version) for p in window))
    assert got == [b"%d" % pid for pid in pids]  # once each, in order
    assert sub.read() == [] and not broker.sessions["sub"].inflight
    assert broker.stats.received[6] == 11 and broker.stats.received[5] == 13 and broker.stats.received[7] == 10


def test_mqtt_2_2_1_3_a_pubrel_with_packet_identifier_0_in_a_run_closes_the_connection() -> None:
    _broker, _sub, pub = pair(sub_qos=2, version=5)
    pub.send(Publish("t", b"x", qos=2, packet_id=1))
    pub.read()
    pub.send_bytes(PubRel(1).encode(5) + bytes((0x62, 2, 0, 0)))
    packets = pub.read()
    assert packets[0] == PubComp(1)
    assert isinstance(packets[1], Disconnect) and packets[1].reason_code == RC.MALFORMED_PACKET
    assert pub.conn.state == CLOSED


def test_seed003_await_rel_timeout_forgets_the_identifier() -> None:
    broker, _sub, pub = pair(ZoneLimits(await_rel_timeout=300.0), sub_qos=2)
    pub.send(Publish("t", b"x", qos=2, packet_id=9), 0.0)
    pub.read()
    broker.tick(299.0)
    assert 9 in broker.sessions["pub"].awaiting_rel
    pub.send(PingReq(), 299.0)  # keeps the connection alive; it has no Keep Alive anyway
    broker.tick(300.0)
    assert 9 not in broker.sessions["pub"].awaiting_rel
    assert broker.stats.dropped["await_rel_timeout"] == 1


def test_mqtt_3_3_4_7_more_than_receive_maximum_qos2_awaiting_pubrel_is_0x93() -> None:
    broker = make_broker()
    pub = Client(broker, 5, ZoneLimits(max_awaiting_rel=2))
    assert pub.connect("pub").properties[P.RECEIVE_MAXIMUM] == 2
    for pid in (1, 2, 3):
        pub.send(Publish("t", b"x", qos=2, packet_id=pid))
    packets = pub.read()
    assert packets[:2] == [PubRec(1), PubRec(2)]
    assert isinstance(packets[2], Disconnect) and packets[2].reason_code == RC.RECEIVE_MAXIMUM_EXCEEDED
    assert pub.conn.state == CLOSED


def test_a_3_1_1_publisher_at_max_awaiting_rel_waits_for_its_commits_and_is_never_disconnected() -> None:
    """3.1.1 has no Receive Maximum for a client to exceed (MQTT 5.0 §3.3.4 is 5.0's): a 3.1.1 client sends 6 QoS 1
    PUBLISHes and a PINGREQ in one read with ``max_awaiting_rel`` 3. Three await their commit; the 4th waits with
    the bytes after it, and the action pauses reading :data:`UNTIL_RELEASED` (Keep Alive suspended meanwhile).
    The commit acknowledges the first 3, :meth:`Broker.holds_back` says no more, :meth:`Broker.release` goes on
    with the 4th to 6th and the PINGREQ; the next commit acknowledges them. All 6 in order, one pause counted, no
    disconnect; Keep Alive counts again from the end of the pause."""
    broker, store = changelog_broker()
    subscribed(broker, store, "sub", persistent=True).disconnect()
    store.take()
    pub = Client(broker, 4, ZoneLimits(max_awaiting_rel=3))
    pub.connect("pub", keep_alive=10)
    pub.send_bytes(b"".join(Publish("t", b"%d" % i, qos=1, packet_id=i).encode(4) for i in range(1, 7))
                   + PingReq().encode(4), now=1.0)
    assert pub.read() == [] and pub.conn.inbound_pending == 3
    assert broker.actions[-1].conn is pub.conn and broker.actions[-1].pause_until == UNTIL_RELEASED
    assert broker.holds_back(pub.conn)
    broker.tick(100.0)  # long past 1.5 x Keep Alive, but the broker was not reading
    assert pub.conn.state == CONNECTED and broker.holds_back(pub.conn)
    store.commit()
    assert [(type(p), p.packet_id) for p in pub.read()] == [(PubAck, 1), (PubAck, 2), (PubAck, 3)]
    assert not broker.holds_back(pub.conn)
    broker.release(pub.conn, 100.0)
    assert pub.read() == [PingResp()] and pub.conn.inbound_pending == 3  # the PUBACKs wait for the next commit
    store.commit()
    assert [(type(p), p.packet_id) for p in pub.read()] == [(PubAck, 4), (PubAck, 5), (PubAck, 6)]
    assert broker.stats.refused["max_awaiting_rel"] == 1 and broker.release(pub.conn, 100.0) == []
    broker.tick(114.0)
    assert pub.conn.state == CONNECTED
    broker.tick(116.0)  # 1.5 x 10 s after the pause ended
    assert pub.conn.state == CLOSED


def test_a_3_1_1_client_at_max_awaiting_rel_with_only_qos2_awaiting_pubrel_is_closed() -> None:
    """With nothing awaiting a commit, only the client's PUBRELs could make room, and they come after the PUBLISH
    it sent: waiting would never end, so the connection is closed (3.1.1 has no DISCONNECT from the server)."""
    broker = make_broker()
    pub = Client(broker, 4, ZoneLimits(max_awaiting_rel=2))
    pub.connect("pub")
    for pid in (1, 2, 3):
        pub.send(Publish("t", b"x", qos=2, packet_id=pid))
    assert pub.read() == [PubRec(1), PubRec(2)]
    assert pub.conn.state == CLOSED


def test_seed003_qos_downgrade_is_min_of_publish_and_subscribe() -> None:
    for sub_qos in (0, 1, 2):
        for pub_qos in (0, 1, 2):
            _broker, sub, pub = pair(sub_qos=sub_qos)
            pub.send(Publish("t", b"x", qos=pub_qos, packet_id=1 if pub_qos else None))
            if pub_qos == 2:
                pub.send(PubRel(1))
            (p,) = sub.publishes()
            assert p.qos == min(pub_qos, sub_qos), (pub_qos, sub_qos)


def test_mqtt_3_3_4_2_overlapping_subscriptions_one_copy_at_the_highest_qos() -> None:
    broker = make_broker()
    sub = Client(broker, 5)
    sub.connect("sub")
    sub.send(Subscribe(1, [Subscription("t/#", 0)], {P.SUBSCRIPTION_IDENTIFIER: [1]}))
    sub.send(Subscribe(2, [Subscription("t/+", 1)], {P.SUBSCRIPTION_IDENTIFIER: [2]}))
    sub.read()
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("t/a", b"x", qos=1, packet_id=1))
    (p,) = sub.publishes()
    assert p.qos == 1
    assert sorted(p.properties[P.SUBSCRIPTION_IDENTIFIER]) == [1, 2]


def test_mqtt_4_8_2_shared_subscription_round_robin() -> None:
    broker = make_broker()
    members = []
    for name in ("m1", "m2"):
        c = Client(broker)
        c.connect(name)
        c.subscribe("$share/g/t", 0)
        members.append(c)
    pub = Client(broker)
    pub.connect("pub")
    for i in range(4):
        pub.send(Publish("t", b"%d" % i))
    assert [len(c.publishes()) for c in members] == [2, 2]


# --------------------------------------------------------------------------- offline messages


def test_seed004_offline_messages_delivered_on_resume() -> None:
    broker = make_broker()
    limits = ZoneLimits()
    offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    publish_many(pub, [b"a", b"b"])
    pub.send(Publish("t", b"c", qos=0))
    again = Client(broker, 4, limits, now=10.0)
    assert again.connect("sub", 10.0, clean_start=False).session_present
    assert [(p.payload, p.qos) for p in again.publishes()] == [(b"a", 1), (b"b", 1), (b"c", 0)]


def test_seed004_clean_start_discards_the_session_and_its_offline_messages() -> None:
    broker = make_broker()
    limits = ZoneLimits()
    offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    publish_many(pub, [b"a", b"b"])
    again = Client(broker, 4, limits)
    assert not again.connect("sub", clean_start=True).session_present  # [MQTT-3.1.2-4]
    assert again.read() == []
    assert broker.stats.dropped["session_ended"] == 2
    pub.send(Publish("t", b"later", qos=1, packet_id=9))
    assert again.read() == []  # its subscriptions went with the session


def test_seed004_message_expiry_interval_drops_queued_messages_on_the_fake_clock() -> None:
    broker = make_broker()
    limits = ZoneLimits(message_expiry_interval=300.0)
    offline_subscriber(broker, limits)
    pub = Client(broker)
    pub.connect("pub")
    pub.send(Publish("t", b"old", qos=1, packet_id=1), 0.0)
    pub.send(Publish("t", b"new", qos=1, packet_id=2), 100.0)
    broker.tick(350.0)  # the periodic sweep drops what expired offline
    assert broker.stats.dropped["expired"] == 1
    again = Client(broker, 4, limits, now=351.0)
    again.connect("sub", 351.0, clean_start=False)
    assert [p.payload for p in again.publishes()] == [b"new"]


def test_seed004_publishers_message_expiry_interval_wins_and_the_rest_is_sent_mqtt_3_3_2_6() -> None:
    broker = make_broker()
    limits = ZoneLimits(message_expiry_interval=300.0)
    sub = Client(broker, 5, limits)
    sub.connect("sub", properties={P.SESSION_EXPIRY_INTERVAL: 3600})
    sub.subscribe("t", 1)
    sub.disconnect()
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("t", b"short", qos=1, packet_id=1, properties={P.MESSAGE_EXPIRY_INTERVAL: 10}), 0.0)
    pub.send(Publish("t", b"long", qos=1, packet_id=2, properties={P.MESSAGE_EXPIRY_INTERVAL: 1000}), 0.0)
    again = Client(broker, 5, limits, now=30.0)
    again.connect("sub", 30.0, clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 3600})
    (p,) = again.publishes()  # "short" expired at 10 s although message_expiry_interval is 300 s
    assert p.payload == b"long" and p.properties[P.MESSAGE_EXPIRY_INTERVAL] == 970


def test_seed004_session_expiry_interval_ends_the_session_on_the_fake_clock() -> None:
    broker = make_broker()
    sub = Client(broker, 5)
    sub.connect("sub", properties={P.SESSION_EXPIRY_INTERVAL: 60})
    sub.subscribe("t", 1)
    sub.disconnect(0.0)
    broker.tick(59.0)
    assert "sub" in broker.sessions
    broker.tick(60.0)
    assert "sub" not in broker.sessions
    assert broker.stats.dropped["session_expired"] == 1
    again = Client(broker, 5, now=61.0)
    assert not again.connect("sub", 61.0, clean_start=False).session_present


def test_session_expiry_granted_is_capped_by_session_expiry_interval() -> None:
    broker = make_broker()
    c = Client(broker, 5, ZoneLimits(session_expiry_interval=7200.0))
    ack = c.connect("c", properties={P.SESSION_EXPIRY_INTERVAL: 99999})
    assert ack.properties[P.SESSION_EXPIRY_INTERVAL] == 7200


# --------------------------------------------------------------------------- Keep Alive, take-over, Will


def test_mqtt_3_1_2_24_keep_alive_closes_after_one_and_a_half_times() -> None:
    broker = make_broker()
    c = Client(broker, 4)
    c.connect("c", 0.0, keep_alive=10)
    c.send(PingReq(), 5.0)
    assert c.read() == [PingResp()]
    broker.tick(19.9)  # 14.9 s since the last packet
    assert c.conn.state == CONNECTED
    broker.tick(20.0)  # 15 s = 1.5 x 10 s
    assert c.conn.state == CLOSED and c.conn.close_after_flush
    assert c.read() == []  # 3.1.1 has no DISCONNECT from the server


def test_mqtt_3_1_2_22_keep_alive_timeout_is_disconnect_0x8d_in_5_0() -> None:
    broker = make_broker()
    c = Client(broker, 5)
    c.connect("c", 0.0, keep_alive=4)
    broker.tick(6.0)
    assert [p.reason_code for p in c.read()] == [RC.KEEP_ALIVE_TIMEOUT]
    assert c.conn.state == CLOSED


def test_mqtt_3_1_2_24_a_tick_checks_only_the_connections_whose_deadline_is_due(monkeypatch: Any) -> None:
    """The Deadline Index (gateway/broker/deadlines.py): a tick looks at the connections with a deadline due, not
    at every connection, and a packet received moves a Keep Alive deadline later."""
    from gateway.broker import timers

    checked: list[Any] = []
    real_check = timers.check
    monkeypatch.setattr(timers, "check", lambda core, conn, now: (checked.append(conn), real_check(core, conn, now)))
    broker = make_broker()
    idle = []
    for i in range(1000):
        c = Client(broker, 4)
        c.connect(f"idle{i}", 0.0, keep_alive=60)
        idle.append(c)
    short = Client(broker, 4)
    short.connect("short", 0.0, keep_alive=2)
    never = Client(broker, 4)
    never.connect("never", 0.0, keep_alive=0)  # no Keep Alive: no deadline at all
    assert len(broker.deadlines) == 1001
    for now in (1.0, 2.0, 2.9):
        broker.tick(now)
    assert checked == [] and short.conn.state == CONNECTED  # its deadline is 1.5 x 2 s = 3 s
    broker.tick(3.0)
    assert checked == [short.conn] and short.conn.state == CLOSED
    idle[0].send(PingReq(), 50.0)
    checked.clear()
    broker.tick(90.0)  # 1.5 x 60 s: every idle connection but the one that sent a packet at 50 s
    assert len(checked) == 1000 and idle[0].conn.state == CONNECTED
    assert sum(c.conn.state == CLOSED for c in idle) == 999 and never.conn.state == CONNECTED
    checked.clear()
    broker.tick(139.9)
    assert checked == [] and idle[0].conn.state == CONNECTED
    broker.tick(140.0)
    assert checked == [idle[0].conn] and idle[0].conn.state == CLOSED
    assert len(broker.deadlines) == 0  # closed connections leave the index


def test_send_timeout_is_due_before_a_later_keep_alive_deadline() -> None:
    """A socket paused at 5 s with ``send_timeout`` 15 s is closed at 20 s, although its Keep Alive deadline
    (90 s) was filed first (the Deadline Index files it earlier when the socket pauses)."""
    broker = make_broker()
    c = Client(broker, 4, ZoneLimits(send_timeout=15.0))
    c.connect("c", 0.0, keep_alive=60)
    broker.pause_writing(c.conn, 5.0)
    broker.tick(19.9)
    assert c.conn.state == CONNECTED
    broker.tick(20.0)
    assert c.conn.state == CLOSED and c.conn.abort
    assert broker.stats.refused["send_timeout"] == 1


def test_connect_timeout_no_longer_applies_once_connected_without_keep_alive() -> None:
    broker = make_broker()
    waiting = Client(broker, 4, ZoneLimits(connect_timeout=10.0))
    c = Client(broker, 4, ZoneLimits(connect_timeout=10.0))
    assert len(broker.deadlines) == 2  # both filed under their CONNECT timeout
    c.connect("c", 1.0, keep_alive=0)
    assert len(broker.deadlines) == 1
    broker.tick(10.0)
    assert waiting.conn.state == CLOSED and c.conn.state == CONNECTED
    assert len(broker.deadlines) == 0


def test_mqtt_3_1_4_3_session_take_over_disconnects_the_old_connection_0x8e() -> None:
    broker = make_broker()
    old = Client(broker, 5)
    old.connect("c", properties={P.SESSION_EXPIRY_INTERVAL: 60})
    new = Client(broker, 5)
    assert new.connect("c", clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60}).session_present
    assert [p.reason_code for p in old.read()] == [RC.SESSION_TAKEN_OVER]
    assert old.conn.state == CLOSED and new.conn.state == CONNECTED


def test_mqtt_3_1_2_8_will_published_when_the_connection_is_lost() -> None:
    broker = make_broker()
    sub = Client(broker)
    sub.connect("sub")
    sub.subscribe("will/#", 0)
    c = Client(broker)
    c.connect("c", will=Will("will/c", b"gone"))
    broker.connection_lost(c.conn, 1.0)
    assert [p.payload for p in sub.publishes()] == [b"gone"]


def test_mqtt_3_14_4_3_normal_disconnect_discards_the_will() -> None:
    broker = make_broker()
    sub = Client(broker)
    sub.connect("sub")
    sub.subscribe("will/#", 0)
    c = Client(broker)
    c.connect("c", will=Will("will/c", b"gone"))
    c.disconnect()
    assert sub.read() == []


# --------------------------------------------------------------------------- 5.0 -> 3.1.1 refusals


def test_mqtt_3_2_2_refusal_reason_codes_downgrade_to_3_1_1_return_codes() -> None:
    cases = [
        # (limits, broker settings, CONNECT kwargs, 5.0 reason code, 3.1.1 return code)
        (ZoneLimits(max_clientid_len=4), {}, {"client_id": "too-long"}, RC.CLIENT_IDENTIFIER_NOT_VALID, 2),
        (ZoneLimits(), {"max_sessions": 1}, {"client_id": "second", "clean_start": False}, RC.QUOTA_EXCEEDED, 3),
    ]
    for limits, settings, kwargs, v5_code, v311_code in cases:
        for version, expected in ((5, v5_code), (4, v311_code)):
            broker = RecordingBroker(BrokerSettings(sys_interval=0, **settings), MemoryStore(), now=0.0)
            first = Client(broker, version, limits)
            first.connect(
                "first", clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60} if version == 5 else {}
            )
            c = Client(broker, version, limits)
            if version == 5 and not kwargs.get("clean_start", True):
                kwargs = {**kwargs, "properties": {P.SESSION_EXPIRY_INTERVAL: 60}}
            c.send(Connect(protocol_level=version, **kwargs))
            (ack,) = c.read()
            assert isinstance(ack, Connack) and ack.reason_code == expected, (version, kwargs)
            assert c.conn.state == CLOSED


def test_mqtt_3_1_2_2_unsupported_protocol_level_is_connack_0x01_or_0x84() -> None:
    broker = make_broker()
    c = Client(broker, 4)
    c.send_bytes(Connect("c", protocol_level=4).encode(4).replace(b"MQTT\x04", b"MQTT\x07"))
    (ack,) = c.read()
    assert ack.reason_code == 0x01 and c.conn.state == CLOSED


def test_mqtt_3_1_2_13_bad_authentication_method_5_0_only() -> None:
    broker = make_broker()
    c = Client(broker, 5)
    c.send(Connect("c", protocol_level=5, properties={P.AUTHENTICATION_METHOD: "SCRAM"}))
    (ack,) = c.read()
    assert ack.reason_code == RC.BAD_AUTHENTICATION_METHOD and c.conn.state == CLOSED


def test_will_topic_invalid_is_connack_0x90_in_5_0_and_a_close_in_3_1_1() -> None:
    for version in (5, 4):
        broker = make_broker()
        c = Client(broker, version, ZoneLimits(max_topic_levels=2))
        c.send(Connect("c", protocol_level=version, will=Will("a/b/c", b"x")))
        packets = c.read()
        assert [p.reason_code for p in packets] == ([RC.TOPIC_NAME_INVALID] if version == 5 else [])
        assert c.conn.state == CLOSED


def test_suback_failure_0x8f_in_5_0_is_0x80_in_3_1_1() -> None:
    for version, expected in ((5, RC.TOPIC_FILTER_INVALID), (4, 0x80)):
        broker = make_broker()
        c = Client(broker, version, ZoneLimits(max_topic_levels=2))
        c.connect("c")
        assert c.subscribe("a/b/c", 1) == [expected]


def test_max_subscriptions_suback_0x97_in_5_0_is_0x80_in_3_1_1() -> None:
    for version, expected in ((5, RC.QUOTA_EXCEEDED), (4, 0x80)):
        broker = make_broker()
        c = Client(broker, version, ZoneLimits(max_subscriptions=1))
        c.connect("c")
        assert c.subscribe("a", 1) == [1]
        assert c.subscribe("b", 1, packet_id=2) == [expected]


def test_refused_publish_puback_reason_in_5_0_plain_puback_in_3_1_1() -> None:
    for version, expected in ((5, RC.NOT_AUTHORIZED), (4, 0)):
        broker = make_broker()
        c = Client(broker, version)
        c.connect("c")
        c.send(Publish("$SYS/x", b"x", qos=1, packet_id=5))
        assert c.read() == [PubAck(5, expected)]
        assert broker.stats.dropped["not_authorized"] == 1


def test_puback_0x10_no_matching_subscribers_in_5_0_only() -> None:
    for version, expected in ((5, RC.NO_MATCHING_SUBSCRIBERS), (4, 0)):
        broker = make_broker()
        c = Client(broker, version)
        c.connect("c")
        c.send(Publish("nobody", b"x", qos=1, packet_id=5))
        assert c.read() == [PubAck(5, expected)]


def test_protocol_error_is_disconnect_with_reason_in_5_0_and_a_close_in_3_1_1() -> None:
    for version in (5, 4):
        broker = make_broker()
        c = Client(broker, version)
        c.connect("c")
        c.send(Connect("c", protocol_level=version))  # a second CONNECT [MQTT-3.1.0-2]
        packets = c.read()
        assert [p.reason_code for p in packets] == ([RC.PROTOCOL_ERROR] if version == 5 else [])
        assert c.conn.state == CLOSED


def test_mqtt_3_1_0_1_first_packet_not_connect_closes() -> None:
    broker = make_broker()
    c = Client(broker)
    c.send(PingReq())
    assert c.read() == [] and c.conn.state == CLOSED


def test_connect_timeout_on_the_fake_clock() -> None:
    broker = make_broker()
    c = Client(broker, 4, ZoneLimits(connect_timeout=10.0))
    broker.tick(9.9)
    assert c.conn.state != CLOSED
    broker.tick(10.0)
    assert c.conn.state == CLOSED


def test_seed000_a_long_puback_run_is_left_pending_so_the_io_layer_writes_between_parts() -> None:
    broker, sub, pub = pair(ZoneLimits(max_inflight=32, max_mqueue_len=0))
    publish_many(pub, [b"%d" % i for i in range(64)])
    got = sub.publishes()
    broker.receive(sub.conn, b"".join(PubAck(p.packet_id).encode(4) for p in got) + PingReq().encode(4), 1.0)
    assert sub.conn.pending  # the first part handled; its refills are in its action, ready to be written
    first = sub.read()
    assert [p.payload for p in first] == [b"32", b"33", b"34", b"35", b"36", b"37", b"38", b"39"]
    while sub.conn.pending:
        broker.resume(sub.conn, 1.0)
    rest = sub.read()
    assert [p.payload for p in rest[:-1]] == [b"%d" % i for i in range(40, 64)]
    assert rest[-1] == PingResp()  # the bytes after the run are handled after its last part, in order


# --------------------------------------------------------------------------- retained messages to new subscribers


def test_mqtt_3_3_1_retained_messages_to_new_subscribers_are_the_current_ones_in_every_variant() -> None:
    """Retained messages are encoded once per message for new subscribers (RetainedMessages.encoded): every new
    subscriber still gets the current retained message of each topic with RETAIN=1 [MQTT-3.3.1-8] at its own
    Protocol Level and granted QoS [MQTT-3.3.1-6] [MQTT-3.3.1-9], after topics are replaced and cleared
    [MQTT-3.3.1-7], and no encoding of a replaced message is kept."""
    broker = make_broker()
    pub = Client(broker)
    pub.connect("pub")
    for i in range(5):
        pub.send(Publish(f"r/{i}", f"one-{i}".encode(), qos=1, retain=True, packet_id=i + 1))
    pub.read()

    def new_subscriber(name: str, version: int, qos: int) -> dict[str, tuple[bytes, int, bool]]:
        sub = Client(broker, version)
        sub.connect(name)
        sub.send(Subscribe(1, [Subscription("r/#", qos)]))
        packets = sub.read()
        assert isinstance(packets[0], Suback)
        return {p.topic: (p.payload, p.qos, p.retain) for p in packets[1:]}

    want = {f"r/{i}": (f"one-{i}".encode(), 1, True) for i in range(5)}
    assert new_subscriber("a", 4, 1) == want
    assert new_subscriber("b", 5, 1) == want  # the other Protocol Level: its own encoding
    assert new_subscriber("c", 4, 0) == {t: (v[0], 0, True) for t, v in want.items()}  # downgraded to QoS 0
    pub.send(Publish("r/1", b"two-1", qos=1, retain=True, packet_id=10))  # replaced
    pub.send(Publish("r/2", b"", qos=1, retain=True, packet_id=11))  # cleared
    pub.read()
    want["r/1"] = (b"two-1", 1, True)
    del want["r/2"]
    assert new_subscriber("d", 4, 1) == want
    assert new_subscriber("e", 4, 1) == want
    live = {broker.retained.get(topic).mid for topic in want}  # type: ignore[union-attr]
    assert set(broker.retained.encoded) <= live


# -------------------------------------------- store changes as output (docs/architecture.md, "The durability contract")


def changelog_broker(now: float = 0.0) -> tuple[RecordingBroker, ChangeLog]:
    """A broker on a :class:`ChangeLog`, whose commit reports go back to the broker as the I/O layer passes them."""
    store = ChangeLog()
    broker = RecordingBroker(BrokerSettings(sys_interval=0), store, now=now)
    store.on_committed = lambda barrier: broker.committed(barrier, now)
    store.on_failed = lambda barrier, full: broker.failed(barrier, full, now)
    return broker, store


def ops(changes: list[StoreChange]) -> list[tuple[str, str | None]]:
    return [(c.op, c.client_id) for c in changes]


def subscribed(broker: Broker, store: ChangeLog, client_id: str, persistent: bool) -> Client:
    """A client subscribed to ``t`` at QoS 1, its SUBACK committed and read; the records taken."""
    client = Client(broker, 4)
    client.connect(client_id, clean_start=not persistent)
    client.send(Subscribe(1, [Subscription("t", 1)]))
    store.commit()
    assert [type(p) for p in client.read()] == [Suback]
    store.take()
    return client


def test_design_4_puback_is_output_only_after_the_queue_row_it_caused_is_committed() -> None:
    broker, store = changelog_broker()
    sub = Client(broker, 4, ZoneLimits())
    sub.connect("sub", clean_start=False)
    sub.send(Subscribe(1, [Subscription("t", 1)]))
    assert sub.read() == []  # the SUBACK waits for the subscription row
    assert ops(store.take()) == [("session_saved", "sub"), ("subscription_saved", "sub"), ("durable", None)]
    assert store.commit() == 1
    assert [type(p) for p in sub.read()] == [Suback]
    sub.disconnect()
    store.take()
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("t", b"kept", qos=1, packet_id=7))
    changes = store.take()
    assert ops(changes) == [("delivery_saved", "sub"), ("durable", None)]
    assert changes[0].value.message.payload == b"kept" and changes[0].key == 1  # the queue row, store seq 1
    assert pub.read() == []  # not acknowledged before the row is durable
    assert store.commit() == 1
    assert [(type(p), p.packet_id, p.reason_code) for p in pub.read()] == [(PubAck, 7, 0)]


def test_design_4_a_failed_commit_refuses_the_publish_0x97_in_5_0_and_disconnects_in_3_1_1() -> None:
    broker, store = changelog_broker()
    subscribed(broker, store, "sub", persistent=True).disconnect()
    pub5 = Client(broker, 5)
    pub5.connect("pub5")
    pub5.send(Publish("t", b"x", qos=1, packet_id=3))
    pub4 = Client(broker, 4)
    pub4.connect("pub4")
    pub4.send(Publish("t", b"y", qos=1, packet_id=4))
    assert store.fail(full=True) == 2
    assert [(type(p), p.packet_id, p.reason_code) for p in pub5.read()] == [(PubAck, 3, RC.QUOTA_EXCEEDED)]
    assert pub4.read() == [] and pub4.conn.state == CLOSED  # 3.1.1 cannot refuse: no PUBACK, closed
    assert broker.stats.dropped["store_full"] == 2


def test_a_barrier_with_no_change_of_its_own_is_acknowledged_in_order_after_the_failed_barriers_refusals() -> None:
    """Commit barriers (gateway/broker/barriers.py): a QoS 1 PUBLISH to a persistent subscriber records a queue row
    (its barrier owns changes); one to a topic nobody stores records nothing (its barrier waits only for the order
    of acknowledgements). When the commit fails, the first is refused (0x97) and the second acknowledged right
    after it, in order; in one input, a barrier after one with changes of its own owns changes too (refused)."""
    broker, store = changelog_broker()
    subscribed(broker, store, "sub", persistent=True).disconnect()
    store.take()
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("t", b"stored", qos=1, packet_id=1))
    pub.send(Publish("nobody/listens", b"not stored", qos=1, packet_id=2))  # a later read: another input
    both = Client(broker, 5)
    both.connect("both")
    both.send_bytes(Publish("t", b"stored", qos=1, packet_id=3).encode(5)
                    + Publish("nobody/listens", b"not stored", qos=1, packet_id=4).encode(5))  # one input
    assert ops(store.take()) == [("delivery_saved", "sub"), ("durable", None), ("durable", None),
                                 ("delivery_saved", "sub"), ("durable", None), ("durable", None)]
    assert pub.read() == [] and both.read() == []
    assert store.fail(full=True) == 4
    refused_then_acknowledged = [(1, RC.QUOTA_EXCEEDED), (2, RC.NO_MATCHING_SUBSCRIBERS)]
    assert [(p.packet_id, p.reason_code) for p in pub.read()] == refused_then_acknowledged
    assert [(p.packet_id, p.reason_code) for p in both.read()] == [(3, RC.QUOTA_EXCEEDED), (4, RC.QUOTA_EXCEEDED)]
    assert broker.stats.dropped["store_full"] == 3 and not broker.held_acks
    pub.send(Publish("nobody/listens", b"now", qos=1, packet_id=5))
    assert store.commit() == 1
    assert [(p.packet_id, p.reason_code) for p in pub.read()] == [(5, RC.NO_MATCHING_SUBSCRIBERS)]


def test_design_4_a_full_store_refuses_new_work_at_once_and_keeps_qos0_flowing() -> None:
    broker, store = changelog_broker()
    sub = subscribed(broker, store, "sub", persistent=False)
    store.room = False
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("t", b"q1", qos=1, packet_id=1))
    assert [(type(p), p.reason_code) for p in pub.read()] == [(PubAck, RC.QUOTA_EXCEEDED)]
    pub.send(Publish("t", b"q0", qos=0))
    assert [p.payload for p in sub.publishes()] == [b"q0"]
    assert store.take() == []  # nothing was recorded for the refused message


def test_design_4_qos2_pubrec_after_the_awaiting_pubrel_state_is_committed_and_pubcomp_after_its_release() -> None:
    broker, store = changelog_broker()
    pub = Client(broker, 5)
    pub.connect("pub", clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60})
    store.take()
    pub.send(Publish("t", b"once", qos=2, packet_id=11))
    assert ops(store.take()) == [("inbound_saved", "pub"), ("durable", None)]
    assert pub.read() == []
    store.commit()
    assert [(type(p), p.packet_id) for p in pub.read()] == [(PubRec, 11)]
    pub.send(PubRel(11))
    changes = store.take()
    assert ops(changes) == [("inbound_deleted", "pub"), ("durable", None)] and changes[0].key == 11
    assert pub.read() == []
    store.commit()
    assert [(type(p), p.packet_id) for p in pub.read()] == [(PubComp, 11)]


def test_design_4_a_delivered_then_acknowledged_message_leaves_the_store() -> None:
    broker, store = changelog_broker()
    sub = subscribed(broker, store, "sub", persistent=True)
    pub = Client(broker, 4)
    pub.connect("pub")
    store.take()
    pub.send(Publish("t", b"m", qos=1, packet_id=1))
    saved = store.take()
    assert ops(saved) == [("delivery_saved", "sub"), ("durable", None)]
    store.commit()
    (delivered,) = sub.publishes()
    sub.send(PubAck(delivered.packet_id))
    deleted = store.take()
    assert ops(deleted) == [("delivery_deleted", "sub")] and deleted[0].key == saved[0].key
