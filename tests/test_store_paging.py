"""Message Queue paging (``[store] mqueue_mem_len``): a persistent session's queue keeps ``mqueue_mem_len`` entries
in memory and the rest only in the LMDB store, read back as it drains (gateway/broker/mqueue.py, LmdbPager).

Paging must not change what a subscriber gets. The Message Queue's rules (docs/architecture.md, "Session semantics")
still hold: FIFO order, ``max_mqueue_len`` with the oldest dropped and QoS 0 dropped first. A restart (SIGTERM or
SIGKILL) restores the same queue. The ``seed_000`` ... ``seed_004`` prefixes of test names name the group of session
semantics a test checks, as in tests/test_core.py.

- The queue is checked against the reference model of tests/test_mqueue.py on a real LmdbStore. Commits are left
  pending or let through at random points, so entries sit in all three parts of the queue: in memory, paged, and
  the uncommitted tail.
- The broker is checked end to end: a subprocess with ``mqueue_mem_len = 4``, with and without a restart between
  publishing and draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from bystanders import QoS1Pair
from helpers import BrokerProcess, RawClient
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mqueue import Model

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import NEVER, Session
from gateway.mqtt.packets import Disconnect, PingReq, PingResp, PubAck, Publish, Suback, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P
from gateway.store import records as rec
from gateway.store.applier import drop_superseded
from gateway.store.lmdb_store import LmdbStore, StoreSettings
from gateway.store.writer import _Q_DEL, _Q_SENT


def pages_bytes(store: LmdbStore) -> int:
    """Bytes of the pages of all the store's tables, as committed (what ``used_bytes`` must say)."""
    assert store.env is not None
    with store.env.begin() as txn:
        return sum(s["psize"] * (s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"])
                   for s in (txn.stat(db) for db in store.tables))


class PagedSession:
    """A persistent session's Message Queue on a real LmdbStore, used the way the broker uses it: every entry is
    recorded in the store before it is pushed, and popped or dropped entries are deleted from it."""

    def __init__(self, path: Path, max_len: int, mem_len: int, max_size: int = 1024**3) -> None:
        self.path = path
        self.mem_len = mem_len
        self.max_size = max_size
        self.loop = asyncio.new_event_loop()
        self.store = self._open(max_len)
        self.session = self.store_session(max_len)
        self.tags: dict[int, int] = {}  # store seq -> model tag
        self.lost: list[int] = []  # tags of entries dropped because their rows were not written

    def _open(self, max_len: int) -> LmdbStore:
        store = LmdbStore(
            StoreSettings(path=str(self.path), max_size=self.max_size, mqueue_mem_len=self.mem_len),
            lambda: ZoneLimits(max_mqueue_len=max_len),
        )
        self.loaded = store.load(time.time())
        store.attach(self.loop)
        store.on_queue_rows_lost = self._rows_lost  # as the broker's Broker.queue_rows_lost
        return store

    def _rows_lost(self, client_id: str, seqs: list[int]) -> None:
        """The store's report of queue rows a failed commit did not write: their entries leave the queue."""
        assert client_id == "sub"
        self.lost.extend(self.tags[d.seq] for d in self.session.mqueue.forget_unwritten(seqs))

    def store_session(self, max_len: int) -> Session:
        session = Session("sub", ZoneLimits(max_mqueue_len=max_len), expiry_interval=NEVER)
        self.store.session_saved(session)
        paging = self.store.pager("sub")
        assert paging is not None
        session.start_receiving(*paging)
        return session

    def push(self, tag: int, qos: int, payload: bytes | None = None) -> tuple[int, int] | None:
        message = Message(tag, "t", b"%d" % tag if payload is None else payload, qos, False, {}, 0.0)
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
        """(queue rows, message rows) in the store, committed; checks that the store's ``used_bytes`` is still the
        bytes of all its tables' pages (it stats only the tables a commit changed)."""
        assert self.store.env is not None
        assert self.store.used_bytes == pages_bytes(self.store)
        with self.store.env.begin() as txn:
            return (txn.stat(self.store.tables.queue)["entries"], txn.stat(self.store.tables.messages)["entries"])

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
    """The queue's order and drop policy with paging: whatever part of the queue an entry is in (memory, store only, or
    waiting for its commit), the queue keeps FIFO order and the drop policy (QoS 0 first, else the oldest), push reports
    exactly the dropped entry, and a reload from the store restores the same queue, to which ``after`` is then pushed
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
        other.start_receiving()
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


def test_used_bytes_stays_the_bytes_of_every_tables_pages(tmp_path: Path) -> None:
    """``used_bytes`` (what ``has_room`` compares with ``max_size``) is kept by stat-ing only the tables a commit
    changed: through queue rows with and without a message row, sent and deleted deliveries, retained and inbound
    rows, a session's removal and thousands of rows (table depths change), it stays the bytes of every table's
    pages."""
    paged = PagedSession(tmp_path / "store", 0, 10)
    store = paged.store
    try:
        assert store.used_bytes == pages_bytes(store)
        other = Session("sub2", ZoneLimits(max_mqueue_len=0), expiry_interval=NEVER)
        other.start_receiving()
        store.session_saved(other)
        for tag in range(1, 3001):
            message = Message(tag, f"t/{tag % 50}", b"x" * (tag % 700), 1, False, {}, 0.0)
            delivery = Delivery(message, 1)
            store.delivery_saved("sub", delivery)
            paged.tags[delivery.seq] = tag
            paged.session.mqueue.push(delivery)
            if tag % 3 == 0:  # a second reference: a message row
                store.delivery_saved("sub2", Delivery(message, 1))
            if tag % 10 == 0:
                store.retained_saved(message)
                store.inbound_saved("sub", tag % 100 + 1, message)
            if tag % 500 == 0:
                paged.commit()
                assert paged.rows()[0] > 0
        sent = []
        for pid in range(1, 1501):  # sent (the row patched with its Packet Identifier), deleted in a later commit
            delivery = paged.session.mqueue.pop()
            delivery.packet_id = pid
            store.delivery_saved("sub", delivery)
            sent.append(delivery)
        paged.commit()
        paged.rows()
        for delivery in sent:
            store.delivery_deleted("sub", delivery)
        paged.commit()
        paged.rows()
        for topic in range(25):
            store.retained_deleted(f"t/{topic}")
        store.session_deleted("sub2")
        paged.commit()
        paged.rows()
        while len(paged.session.mqueue):
            store.delivery_deleted("sub", paged.session.mqueue.pop())
        for pid in range(1, 101):
            store.inbound_deleted("sub", pid)
        for topic in range(25, 50):
            store.retained_deleted(f"t/{topic}")
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
    """The queue's order, drop policy and offline delivery end to end with ``mqueue_mem_len = 4`` and
    ``max_mqueue_len = 60``: 200 messages of QoS 0 and 1 for an offline 3.1.1 Clean Session 0 subscriber, most of them
    only in the store, then (after no restart, a SIGTERM or a SIGKILL of the broker once every publish was acknowledged)
    30 more and, with a restart, a second SIGKILL. On reconnect it receives exactly the reference model's survivors: the
    newest, QoS 0 dropped first, in publish order, Session Present 1."""
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
            (value,) = [bytes(v) for _k, v in txn.cursor(db=paged.store.tables.queue)]
        assert rec.decode_delivery(value)[1].packet_id == 2  # the send was patched into the row
    finally:
        paged.close()
    # Two batches joined in one transaction: the writer leaves out the first batch's record of a row that the
    # second batch deletes.
    sent = [(_Q_SENT, b"sub\x00" + rec.u64(seq), seq, 0) for seq in (1, 2)]
    deleted = [(_Q_DEL, b"sub\x00" + rec.u64(1))]
    assert drop_superseded([*sent, *deleted]) == [sent[1], deleted[0]]


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
            value = bytes(txn.get(key, db=paged.store.tables.queue))
            inline = rec.inline_message(value)
            assert inline is not None and txn.get(rec.u64(6), db=paged.store.tables.messages) is None
            txn.put(key, value[:-len(inline)], db=paged.store.tables.queue)
        drained = []
        while paged.session.mqueue:
            drained.append(paged.pop()[0])
        assert drained == [1, 2, 3, 4, 5, 7, 8, 9, 10]
        assert (len(paged.session.mqueue), paged.session.mqueue.bytes, paged.session.mqueue.paged) == (0, 0, 0)
        assert "paged entry" in caplog.text and "has no message in the store" in caplog.text
    finally:
        paged.close()


# ------------------------------------------------------------------------------------------------ failed commits


def test_rows_of_a_failed_commit_leave_the_queue_and_are_never_paged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No "Message Queue: N paged entries not found in the store" after a failed commit. A commit that fails (here: the
    store is full at ``max_size``) writes none of the queue rows in it, yet the next commit that succeeds moves
    ``committed_seq`` past them, and the queue used to page those entries out as rows the store does not have: they
    counted towards ``len`` and ``max_mqueue_len`` (the drop policy dropped real entries for them) until the drain found
    them missing and logged an error. Now the store reports the rows it could not write before any later commit lands,
    and their entries leave the queue (their publishers were not acknowledged). With entries in all three parts (in
    memory, paged, uncommitted tail) and QoS 0 and 1 mixed, the queue then matches the reference model without the
    failed entries (pushes report the same victims), after a reload too, drains in order to an empty store, and nothing
    is logged as missing."""
    max_len = 12
    paged = PagedSession(tmp_path / "store", max_len, 2, max_size=1024 * 1024)
    try:
        model = Model(max_len, [])
        queue = paged.session.mqueue
        for tag, qos in zip(range(1, 7), (1, 0, 1, 1, 0, 1), strict=True):
            assert paged.push(tag, qos) == model.push(tag, qos)
        paged.commit()
        queue.page_out()
        assert queue.paged == 4  # 1, 2 in memory; 3-6 in the store only
        # One batch that cannot be written: a message larger than the whole store, and two small ones after it.
        assert paged.push(7, 1, b"x" * (2 * 1024 * 1024)) is None
        assert paged.push(8, 0) is None
        assert paged.push(9, 1) is None
        paged.commit()
        assert "could not be written" in caplog.text
        assert (len(queue), queue.bytes) == (len(model.items), sum(len(b"%d" % t) for t, _q in model.items))
        # Later commits succeed; the entries pushed since are paged out past the failed rows' seqs.
        for tag, qos in zip(range(10, 18), (1, 1, 0, 1, 1, 1, 1, 1), strict=True):
            assert paged.push(tag, qos) == model.push(tag, qos)
            if tag % 2:
                paged.commit()
        paged.commit()
        queue.page_out()
        assert queue.paged > 0
        assert paged.snapshot() == model.items
        assert (len(queue), queue.bytes) == (len(model.items), sum(len(b"%d" % t) for t, _q in model.items))
        paged.reopen(max_len)
        assert paged.snapshot() == model.items
        drained = []
        while paged.session.mqueue:
            drained.append(paged.pop())
        assert drained == model.items
        paged.commit()
        assert paged.rows() == (0, 0)
        assert "not found in the store" not in caplog.text
        assert paged.lost == [7, 8, 9]
    finally:
        paged.close()


def test_paged_rows_missing_from_the_store_are_still_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real disagreement stays loud: paged rows that vanish from the store behind the queue's back (no failed
    commit reported them; here deleted directly in LMDB) are forgotten with an error naming how many, and the
    rest drains in order with the queue's counts at zero."""
    paged = PagedSession(tmp_path / "store", 0, 2)
    try:
        for tag in range(1, 11):
            paged.push(tag, 1)
        paged.commit()
        paged.session.mqueue.page_out()
        assert paged.session.mqueue.paged == 8
        assert paged.store.env is not None
        with paged.store.env.begin(write=True) as txn:
            for seq, tag in paged.tags.items():
                if tag in (9, 10):
                    assert txn.delete(rec.client_prefix("sub") + rec.u64(seq), db=paged.store.tables.queue)
        drained = []
        while paged.session.mqueue.peek() is not None:  # pop() would raise IndexError once only 9, 10 are left
            drained.append(paged.pop()[0])
        assert drained == list(range(1, 9))
        assert (len(paged.session.mqueue), paged.session.mqueue.bytes, paged.session.mqueue.paged) == (0, 0, 0)
        assert "Message Queue: 2 paged entries not found in the store" in caplog.text
    finally:
        paged.close()


FULL_CONFIG = """
[broker]
sys_interval = 1

[store]
mqueue_mem_len = 4
max_size = "4MB"
# Every acknowledged unit of work commits alone, so the commit that fails holds the flood's big message only and
# the bystander pair's messages commit on their own (a failed commit refuses every publisher in it, by design).
group_commit = false

[listeners.external]
bind = "127.0.0.1:0"

[listeners.flood]
bind = "127.0.0.1:0"
max_inflight = 5
max_mqueue_len = 29
max_packet_size = "8MB"
"""


def _publish_until_acked(port: int, client_id: str, topic: str, tags: range, timeout: float = 20.0) -> None:
    """Publish ``b"<tag>"`` at QoS 1 for each tag until the broker acknowledges it, reconnecting when it refuses
    (a 3.1.1 publisher is disconnected while the store is full)."""
    deadline = time.monotonic() + timeout
    pub: RawClient | None = None
    for tag in tags:
        while True:
            assert time.monotonic() < deadline, f"tag {tag} was never acknowledged"
            try:
                if pub is None:
                    pub = RawClient(port)
                    assert pub.connect(client_id).reason_code == 0
                pub.send(Publish(topic, b"%d" % tag, 1, packet_id=tag))
                ack = pub.recv(2.0)
                assert isinstance(ack, PubAck) and ack.packet_id == tag, ack
                break
            except (ConnectionError, TimeoutError, OSError):
                if pub is not None:
                    pub.close()
                pub = None
                time.sleep(0.2)
    assert pub is not None
    pub.send(Disconnect())
    pub.close()


def _sys_value(port: int, name: str, timeout: float = 5.0) -> str | None:
    """The retained ``$SYS/broker/<name>`` value, or None if the broker does not publish it within ``timeout``."""
    client = RawClient(port)
    try:
        assert client.connect("").reason_code == 0
        client.send(Subscribe(1, [Subscription(f"$SYS/broker/{name}", 0)]))
        _expect(client, Suback)
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            while time.monotonic() < deadline:
                packet = client.recv(max(0.01, deadline - time.monotonic()))
                if isinstance(packet, Publish):
                    return packet.payload.decode()
        return None
    finally:
        client.close()


def test_offline_flood_with_a_failed_commit_pages_only_stored_rows(tmp_path: Path) -> None:
    """A failed commit leaves no paged entry the store lacks, end to end: two offline 3.1.1 Clean Session 0 subscribers
    (``mqueue_mem_len = 4``, ``max_mqueue_len = 29``) get a flood of QoS 1 messages; one of them (4.5 MB) cannot be
    committed (the store is full at ``max_size``), so it is never acknowledged; the flood goes on once the store takes
    writes again. The failed message's queue entries leave both queues, counted in
    ``$SYS/broker/messages/dropped/store_write_failed``; they are not paged out as rows the store lacks ("Message
    Queue: N paged entries not found in the store") and do not count towards ``max_mqueue_len``: each subscriber then
    receives exactly the 29 acknowledged messages, in order, none dropped for room. A QoS1Pair exchanges messages beside
    it all and loses nothing."""
    broker = BrokerProcess(FULL_CONFIG, workdir=str(tmp_path)).start()
    try:
        port = broker.ports["flood"]
        for sub_id in ("pf-sub1", "pf-sub2"):
            sub = RawClient(port)
            assert sub.connect(sub_id, clean_start=False).reason_code == 0
            sub.send(Subscribe(1, [Subscription("pf/#", 1)]))
            _expect(sub, Suback)
            sub.close()
        pair = QoS1Pair(broker.ports["external"], "pagefail", count=300, interval=0.01).start()
        _publish_until_acked(port, "pf-pub", "pf/t", range(1, 13))
        pub = RawClient(port)
        assert pub.connect("pf-pub").reason_code == 0
        pub.send(Publish("pf/t", b"x" * (4_500_000), 1, packet_id=13))
        deadline = time.monotonic() + 10
        while "could not be written" not in broker.log():
            assert time.monotonic() < deadline, "the big message's commit did not fail"
            time.sleep(0.05)
        assert not [p for p in pub.recv_all(0.5) if isinstance(p, PubAck)]  # never acknowledged
        pub.close()
        _publish_until_acked(port, "pf-pub", "pf/t", range(14, 31))
        expected = [*range(1, 13), *range(14, 31)]
        for sub_id in ("pf-sub1", "pf-sub2"):
            sub = RawClient(port)
            assert sub.connect(sub_id, clean_start=False).session_present
            got = []
            with contextlib.suppress(TimeoutError):
                while True:
                    packet = sub.recv(3.0 if len(got) < len(expected) else 0.3)
                    assert isinstance(packet, Publish), packet
                    got.append(int(packet.payload))
                    assert packet.packet_id is not None
                    sub.send(PubAck(packet.packet_id))
            assert got == expected, broker.log()[-3000:]
            sub.send(Disconnect())
            sub.close()
        pair.finish()
        assert "not found in the store" not in broker.log()
        assert _sys_value(port, "messages/dropped/store_write_failed") == "2"
        assert _sys_value(port, "messages/dropped/mqueue_full", 1.5) is None
    finally:
        broker.stop()
