"""Message Queue paging (``[store] mqueue_mem_len``): a persistent session's queue keeps ``mqueue_mem_len`` entries
in memory and the rest only in the LMDB store, read back as it drains (gateway/broker/mqueue.py, LmdbPager).

Paging must not change what a subscriber gets. Seeds 000/002 still hold: FIFO order, ``max_mqueue_len`` with the
oldest dropped and QoS 0 dropped first. A restart (SIGTERM or SIGKILL) restores the same queue.

- The queue is checked against the reference model of tests/test_mqueue.py on a real LmdbStore. Commits are left
  pending or let through at random points, so entries sit in all three parts of the queue: in memory, paged, and
  the uncommitted tail.
- The broker is checked end to end: a subprocess with ``mqueue_mem_len = 4``, with and without a restart between
  publishing and draining.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from helpers import BrokerProcess, RawClient
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mqueue import Model

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session import NEVER, Session
from gateway.mqtt.packets import Disconnect, PingReq, PingResp, PubAck, Publish, Suback, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P
from gateway.store import records as rec
from gateway.store.lmdb_store import _Q_DEL, _Q_SENT, LmdbStore, StoreSettings, _drop_superseded


class PagedSession:
    """A persistent session's Message Queue on a real LmdbStore, used the way the broker uses it: every entry is
    recorded in the store before it is pushed, and popped or dropped entries are deleted from it."""

    def __init__(self, path: Path, max_len: int, mem_len: int) -> None:
        self.path = path
        self.mem_len = mem_len
        self.loop = asyncio.new_event_loop()
        self.store = self._open(max_len)
        self.session = self.store_session(max_len)
        self.tags: dict[int, int] = {}  # store seq -> model tag

    def _open(self, max_len: int) -> LmdbStore:
        store = LmdbStore(StoreSettings(path=str(self.path), mqueue_mem_len=self.mem_len),
                          lambda: ZoneLimits(max_mqueue_len=max_len))
        self.loaded = store.load(time.time())
        store.attach(self.loop)
        return store

    def store_session(self, max_len: int) -> Session:
        session = Session("sub", ZoneLimits(max_mqueue_len=max_len), expiry_interval=NEVER)
        self.store.session_saved(session)
        paging = self.store.pager("sub")
        assert paging is not None
        session.mqueue.enable_paging(*paging)
        return session

    def push(self, tag: int, qos: int) -> tuple[int, int] | None:
        message = Message(tag, "t", b"%d" % tag, qos, False, {}, 0.0)
        delivery = Delivery(message, qos)
        self.store.delivery_saved("sub", delivery)
        self.tags[delivery.seq] = tag
        victim = self.session.mqueue.push(delivery)
        if victim is None:
            return None
        assert victim.dropped
        self.store.delivery_deleted("sub", victim)
        return self.tags[victim.seq], victim.qos

    def pop(self) -> tuple[int, int]:
        entry = self.session.mqueue.pop()
        self.store.delivery_deleted("sub", entry)
        assert entry.message.payload == b"%d" % self.tags[entry.seq]
        return self.tags[entry.seq], entry.qos

    def snapshot(self) -> list[tuple[int, int]]:
        return [(self.tags[d.seq], d.qos) for d in self.session.mqueue]

    def commit(self) -> None:
        """Let the event loop run until everything recorded is committed."""

        async def settle() -> None:
            while self.store.pending():
                await asyncio.sleep(0.0005)

        self.loop.run_until_complete(settle())

    def reopen(self, max_len: int) -> None:
        """Close the store and load it again, as a broker restart does."""
        self.commit()
        self.store.close()
        self.store = self._open(max_len)
        (self.session,) = self.loaded.sessions

    def rows(self) -> tuple[int, int]:
        """(queue rows, message rows) in the store, committed."""
        assert self.store.env is not None
        with self.store.env.begin() as txn:
            return (txn.stat(self.store.dbs[4])["entries"], txn.stat(self.store.dbs[1])["entries"])

    def close(self) -> None:
        self.commit()
        self.store.close()
        self.loop.close()


_op = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("pop"), st.none()),
    st.tuples(st.just("peek"), st.none()),
    st.tuples(st.just("commit"), st.none()),
)


@settings(max_examples=400, deadline=None)
@given(max_len=st.integers(0, 8), mem_len=st.integers(1, 3), ops=st.lists(_op, max_size=60),
       restart=st.booleans(), after=st.lists(st.integers(0, 2), max_size=8))
def test_seed_000_002_paged_queue_matches_reference_model(max_len: int, mem_len: int,
                                                          ops: list[tuple[str, int | None]], restart: bool,
                                                          after: list[int]) -> None:
    """Seeds 000/002 with paging: whatever part of the queue an entry is in (memory, store only, or waiting for its
    commit), the queue keeps FIFO order and the drop policy (QoS 0 first, else the oldest), push reports exactly
    the dropped entry, and a reload from the store restores the same queue, to which ``after`` is then pushed
    (new store rows must not reuse a paged row's key). Once drained, no queue or message row is left in the store
    (reference counts hold)."""
    with tempfile.TemporaryDirectory() as tmp:
        paged = PagedSession(Path(tmp) / "store", max_len, mem_len)
        try:
            model = Model(max_len, [])
            tags = itertools.count(1)
            for name, qos in ops:
                if name == "push":
                    assert qos is not None
                    tag = next(tags)
                    assert paged.push(tag, qos) == model.push(tag, qos)
                elif name == "pop":
                    if model.items:
                        assert paged.pop() == model.pop()
                    else:
                        with pytest.raises(IndexError):
                            paged.session.mqueue.pop()
                elif name == "peek":
                    head = paged.session.mqueue.peek()
                    expected = model.items[0] if model.items else None
                    assert (None if head is None else (paged.tags[head.seq], head.qos)) == expected
                else:
                    paged.commit()
                assert paged.snapshot() == model.items
                assert len(paged.session.mqueue) == len(model.items)
                assert paged.session.mqueue.bytes == sum(len(b"%d" % t) for t, _q in model.items)
            paged.commit()
            queue = paged.session.mqueue
            assert len([d for d in queue._items if not d.dropped]) <= max(mem_len, 1) + 512
            if restart:
                paged.reopen(max_len)
                assert paged.snapshot() == model.items
                assert len(paged.session.mqueue) == len(model.items)
            for qos in after:
                tag = next(tags)
                assert paged.push(tag, qos) == model.push(tag, qos)
            paged.commit()
            assert paged.snapshot() == model.items
            drained = []
            while paged.session.mqueue:
                drained.append(paged.pop())
            assert drained == model.items
            paged.commit()
            assert paged.rows() == (0, 0)
        finally:
            paged.close()


def test_paged_backlog_stays_out_of_memory_and_drains_in_order(tmp_path: Path) -> None:
    """With ``mqueue_mem_len = 100``, 5000 committed entries leave at most 100 in memory (plus what waits for a
    commit); the rest are paged in, in order, as the queue drains; the store ends empty."""
    paged = PagedSession(tmp_path / "store", 0, 100)
    try:
        for tag in range(1, 5001):
            paged.push(tag, 1 if tag % 7 else 0)
            if tag % 250 == 0:
                paged.commit()
        paged.commit()
        queue = paged.session.mqueue
        queue.page_out()
        assert len(queue) == 5000
        assert queue.paged == 4900
        assert sum(1 for d in queue._items if not d.dropped) == 100
        assert [t for t, _q in (paged.pop() for _ in range(5000))] == list(range(1, 5001))
        paged.commit()
        assert paged.rows() == (0, 0)
    finally:
        paged.close()


def test_paged_rows_shared_by_two_sessions_keep_their_message(tmp_path: Path) -> None:
    """A message queued to two persistent sessions is stored once; its row stays while either queue still holds
    it, including when one of them is paged out (reference counts in the store)."""
    paged = PagedSession(tmp_path / "store", 0, 1)
    try:
        other = Session("sub2", ZoneLimits(max_mqueue_len=0), expiry_interval=NEVER)
        paged.store.session_saved(other)
        for tag in range(1, 4):
            message = Message(tag, "t", b"%d" % tag, 1, False, {}, 0.0)
            for cid in ("sub", "sub2"):
                delivery = Delivery(message, 1)
                paged.store.delivery_saved(cid, delivery)
                paged.tags[delivery.seq] = tag
                (paged.session.mqueue if cid == "sub" else other.mqueue).push(delivery)
        paged.commit()
        assert paged.rows() == (6, 3)
        assert [paged.pop()[0] for _ in range(3)] == [1, 2, 3]
        paged.commit()
        assert paged.rows() == (3, 3)
        for _ in range(3):
            paged.store.delivery_deleted("sub2", other.mqueue.pop())
        paged.commit()
        assert paged.rows() == (0, 0)
    finally:
        paged.close()


# ------------------------------------------------------------------------------------------------ end to end

CONFIG = """
[broker]
sys_interval = 0

[store]
mqueue_mem_len = 4

[listeners.external]
bind = "127.0.0.1:0"
max_inflight = 5
max_mqueue_len = 60
"""


@pytest.fixture
def paging_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    yield proc
    proc.stop()


def _expect(client: RawClient, packet_type: type) -> object:
    packet = client.recv()
    assert isinstance(packet, packet_type), packet
    return packet


def _offline_subscriber(broker: BrokerProcess, client_id: str, topic_filter: str) -> None:
    """A 3.1.1 Clean Session 0 session subscribed to ``topic_filter`` at QoS 1, then disconnected."""
    sub = RawClient(broker.port)
    assert sub.connect(client_id, clean_start=False).reason_code == 0
    sub.send(Subscribe(1, [Subscription(topic_filter, 1)]))
    _expect(sub, Suback)
    sub.close()


def _publish_qos1(broker: BrokerProcess, client_id: str, topic: str, tags: range) -> None:
    """Publish ``b"<tag>"`` at QoS 1 for each tag (Packet Identifier = tag), each acknowledged before the next."""
    pub = RawClient(broker.port)
    assert pub.connect(client_id).reason_code == 0
    for tag in tags:
        pub.send(Publish(topic, b"%d" % tag, 1, packet_id=tag))
        _expect(pub, PubAck)
    pub.send(Disconnect())
    pub.close()


@pytest.mark.parametrize("restart", ["none", "sigterm", "sigkill"])
def test_seed_000_002_offline_queue_paged_to_store_survives_restart(paging_broker: BrokerProcess,
                                                                    restart: str) -> None:
    """Seeds 000/002/004 end to end with ``mqueue_mem_len = 4`` and ``max_mqueue_len = 60``: 200 messages of QoS 0
    and 1 for an offline 3.1.1 Clean Session 0 subscriber, most of them only in the store, then (after no
    restart, a SIGTERM or a SIGKILL of the broker once every publish was acknowledged) 30 more and, with a
    restart, a second SIGKILL. On reconnect it receives exactly the reference model's survivors: the newest,
    QoS 0 dropped first, in publish order, Session Present 1."""
    broker = paging_broker
    _offline_subscriber(broker, "pg-sub", "pg/#")
    rng = random.Random(4)
    model = Model(60, [])
    pub = RawClient(broker.port)
    assert pub.connect("pg-pub").reason_code == 0
    for tag in range(1, 201):
        qos = rng.choice((0, 1, 1))
        model.push(tag, qos)
        pub.send(Publish("pg/t", b"%d" % tag, qos, packet_id=tag if qos else None))
        if qos:
            ack = _expect(pub, PubAck)
            assert ack.packet_id == tag  # type: ignore[attr-defined]
    pub.send(PingReq())
    _expect(pub, PingResp)
    pub.send(Disconnect())
    pub.close()
    if restart == "sigterm":
        assert broker.stop() == 0
        broker.start()
    elif restart == "sigkill":
        broker.kill()
        broker.start()
    # More after the restart: their store rows must not take the keys of rows paged in from before it.
    for tag in range(201, 231):
        model.push(tag, 1)
    _publish_qos1(broker, "pg-pub", "pg/t", range(201, 231))
    if restart != "none":
        broker.kill()  # and once more, so the drain reads what the store holds
        broker.start()
    sub = RawClient(broker.port)
    connack = sub.connect("pg-sub", clean_start=False)
    assert connack.session_present
    got: list[tuple[int, int]] = []
    while len(got) < len(model.items):
        packet = sub.recv(5.0)
        assert isinstance(packet, Publish), packet
        got.append((int(packet.payload), packet.qos))
        if packet.qos:
            assert packet.packet_id is not None
            sub.send(PubAck(packet.packet_id))
    assert got == model.items
    assert sub.recv_all(0.3) == []
    sub.close()


def test_store_rows_freed_after_paged_drain(paging_broker: BrokerProcess) -> None:
    """After a paged backlog is drained and acknowledged, the store holds no queue or message rows."""
    broker = paging_broker
    _offline_subscriber(broker, "pg-sub2", "pg2/#")
    _publish_qos1(broker, "pg-pub2", "pg2/t", range(1, 51))
    sub = RawClient(broker.port)
    assert sub.connect("pg-sub2", clean_start=False).session_present
    for tag in range(1, 51):
        packet = sub.recv(5.0)
        assert isinstance(packet, Publish) and packet.payload == b"%d" % tag, packet
        assert packet.packet_id is not None
        sub.send(PubAck(packet.packet_id))
    sub.send(PingReq())
    _expect(sub, PingResp)
    sub.send(Disconnect())
    sub.close()
    assert broker.stop() == 0
    env = lmdb.open(str(broker.workdir / "var"), readonly=True, lock=False, max_dbs=10)
    try:
        with env.begin() as txn:
            queue_rows = txn.stat(env.open_db(b"queue", txn=txn, create=False))["entries"]
            message_rows = txn.stat(env.open_db(b"messages", txn=txn, create=False))["entries"]
    finally:
        env.close()
    assert (queue_rows, message_rows) == (0, 0)


def test_packet_identifier_record_left_out_when_the_same_commit_deletes_the_row(tmp_path: Path) -> None:
    """Group commit: a send's Packet Identifier record whose row the same commit deletes (PUBACK before the
    commit) is not written, whether both were recorded in one batch or in two batches that share a
    transaction; the committed state is the same: the row and its message are gone, the other row has its
    Packet Identifier."""
    paged = PagedSession(tmp_path / "store", 0, 100)
    try:
        for tag in (1, 2):
            paged.push(tag, 1)
        paged.commit()
        first, second = paged.session.mqueue.pop(), paged.session.mqueue.pop()
        for delivery, pid in ((first, 1), (second, 2)):
            delivery.packet_id = pid
            paged.store.delivery_saved("sub", delivery)  # in flight: the record a send makes
        paged.store.delivery_deleted("sub", first)  # first acknowledged before anything was committed
        assert list(paged.store._sent) == [second.seq]
        paged.commit()
        assert paged.rows() == (1, 0)  # second's row, its message stored in it (records.inline_message)
        assert paged.store.env is not None
        with paged.store.env.begin() as txn:
            (value,) = [bytes(v) for _k, v in txn.cursor(db=paged.store.dbs[4])]
        assert rec.decode_delivery(value)[1].packet_id == 2  # the send was patched into the row
    finally:
        paged.close()
    # Two batches joined in one transaction: the writer leaves out the first batch's record of a row that the
    # second batch deletes.
    sent = [(_Q_SENT, b"sub\x00" + rec.u64(seq), seq, 0) for seq in (1, 2)]
    deleted = [(_Q_DEL, b"sub\x00" + rec.u64(1))]
    assert _drop_superseded([*sent, *deleted]) == [sent[1], deleted[0]]


def test_mqtt_3_1_2_11_paged_queue_kept_when_session_expiry_drops_to_0(paging_broker: BrokerProcess) -> None:
    """MQTT 5.0 §3.1.2.11: a session resumed with Clean Start 0 and Session Expiry Interval 0 keeps its state
    (Session Present 1) but no longer outlives the connection. Its store rows go, so a backlog that was paged to
    the store is read back into memory first: all 30 queued messages arrive, in order."""
    broker = paging_broker
    sub = RawClient(broker.port, version=5)
    assert sub.connect("pg-sub5", clean_start=True, properties={P.SESSION_EXPIRY_INTERVAL: 300}).reason_code == 0
    sub.send(Subscribe(1, [Subscription("pg5/#", 1)]))
    _expect(sub, Suback)
    sub.send(Disconnect())
    assert sub.closed_by_server()
    sub.close()
    _publish_qos1(broker, "pg-pub5", "pg5/t", range(1, 31))
    sub = RawClient(broker.port, version=5)
    connack = sub.connect("pg-sub5", clean_start=False)  # no Session Expiry Interval: 0
    assert connack.session_present
    got = []
    for _ in range(30):
        packet = sub.recv(5.0)
        assert isinstance(packet, Publish), packet
        got.append(int(packet.payload))
        assert packet.packet_id is not None
        sub.send(PubAck(packet.packet_id))
    assert got == list(range(1, 31))
    assert sub.recv_all(0.3) == []
    sub.close()


def test_paged_row_without_its_message_is_forgotten_and_the_rest_drains(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A damaged store (a paged queue row whose message is gone: here the record it carried is cut off, so it
    points at a message row that does not exist) costs that one entry, with an error logged; every other entry
    still drains in order and the queue's counts end at zero."""
    paged = PagedSession(tmp_path / "store", 0, 2)
    try:
        for tag in range(1, 11):
            paged.push(tag, 1)
        paged.commit()
        paged.session.mqueue.page_out()
        assert paged.session.mqueue.paged == 8
        assert paged.store.env is not None
        (seq,) = [seq for seq, tag in paged.tags.items() if tag == 6]
        key = rec.client_prefix("sub") + rec.u64(seq)
        with paged.store.env.begin(write=True) as txn:
            value = bytes(txn.get(key, db=paged.store.dbs[4]))
            inline = rec.inline_message(value)
            assert inline is not None and txn.get(rec.u64(6), db=paged.store.dbs[1]) is None
            txn.put(key, value[:-len(inline)], db=paged.store.dbs[4])
        drained = []
        while paged.session.mqueue:
            drained.append(paged.pop()[0])
        assert drained == [1, 2, 3, 4, 5, 7, 8, 9, 10]
        assert (len(paged.session.mqueue), paged.session.mqueue.bytes, paged.session.mqueue.paged) == (0, 0, 0)
        assert "paged entry" in caplog.text and "has no message in the store" in caplog.text
    finally:
        paged.close()
