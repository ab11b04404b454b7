"""Message rows and their references in the LMDB store (payloads are stored once and referenced by the rows that need
them: docs/architecture.md, "The durability contract"; README, "The store"), checked against a reference model on a real
LmdbStore and a real event loop.

The writer thread writes the queue rows of brand-new messages in bulk (one ``putmulti`` per database): a message
queued for one session only is stored in that queue row, one queued for several sessions in the same commit gets
one message row referenced that many times. Every other reference
(a retained message, an older message queued later, as when a retained message is delivered to a new
subscription) goes through the one-at-a-time path. Hypothesis mixes all of these with deletes, commits at random
points and reopenings of the store. After every commit the store must hold exactly one row for each message that
something still references, and none other; after a reopening, the same queues.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import NEVER, Session
from gateway.store import records as rec
from gateway.store.lmdb_store import LmdbStore, StoreSettings

SESSIONS = ("a", "b", "c")

_ops = st.one_of(
    st.tuples(st.just("publish"), st.sets(st.sampled_from(SESSIONS), min_size=1), st.booleans()),
    st.tuples(st.just("requeue"), st.sampled_from(SESSIONS), st.integers(0, 50)),
    st.tuples(st.just("ack"), st.sampled_from(SESSIONS), st.integers(0, 50)),
    st.tuples(st.just("clear_retained"), st.integers(0, 3)),
    st.tuples(st.just("commit")),
    st.tuples(st.just("reopen")),
)


class Store:
    """A real LmdbStore used as the broker uses it, with what the model says it must hold."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.store = self._open()
        for cid in SESSIONS:
            self.store.session_saved(Session(cid, ZoneLimits(), expiry_interval=NEVER))
        self.queues: dict[str, list[Delivery]] = {cid: [] for cid in SESSIONS}
        self.retained: dict[str, Message] = {}
        self.messages: list[Message] = []
        self.inline: set[int] = set()  # messages stored only in queue rows, as of the last check()

    def _open(self) -> LmdbStore:
        store = LmdbStore(StoreSettings(path=str(self.path), mqueue_mem_len=0), ZoneLimits)
        self.loaded = store.load(0.0)
        store.attach(self.loop)
        return store

    def publish(self, targets: set[str], retain: bool) -> None:
        mid = len(self.messages) + 1
        message = Message(mid, f"t/{mid % 4}", b"%d" % mid, 1, retain, {}, 0.0)
        self.messages.append(message)
        if retain:
            self.retained[message.topic] = message
            self.store.retained_saved(message)
        for cid in sorted(targets):
            self.queue(cid, message)

    def queue(self, cid: str, message: Message) -> None:
        delivery = Delivery(message, 1)
        self.store.delivery_saved(cid, delivery)
        self.queues[cid].append(delivery)

    def requeue(self, cid: str, pick: int) -> None:
        """An older message queued again (a retained message delivered to a new subscription)."""
        if self.messages:
            self.queue(cid, self.messages[pick % len(self.messages)])

    def ack(self, cid: str, pick: int) -> None:
        queue = self.queues[cid]
        if queue:
            self.store.delivery_deleted(cid, queue.pop(pick % len(queue)))

    def clear_retained(self, pick: int) -> None:
        topic = f"t/{pick}"
        if self.retained.pop(topic, None) is not None:
            self.store.retained_deleted(topic)

    def commit(self) -> None:
        async def settle() -> None:
            while self.store.pending():
                await asyncio.sleep(0.0005)

        self.loop.run_until_complete(settle())

    def reopen(self) -> None:
        self.commit()
        self.store.close()
        self.store = self._open()
        loaded = {s.client_id: s for s in self.loaded.sessions}
        for cid, queue in self.queues.items():
            # The reloaded entries replace the model's (same order, same messages), so later acks delete them.
            entries = list(loaded[cid].mqueue)
            assert [d.message.mid for d in entries] == [d.message.mid for d in queue]
            assert [d.message.payload for d in entries] == [d.message.payload for d in queue]
            self.queues[cid] = entries
        assert sorted(m.mid for m in self.loaded.retained) == sorted(m.mid for m in self.retained.values())

    def check(self) -> None:
        """The committed store holds the model's queues (in order) and retained messages. Each queue row carries
        its message or references a message row; message rows are exactly the messages referenced by rows that
        do not carry them, and the writer counts those references where there is more than one."""
        self.commit()
        assert self.store.env is not None
        tables = self.store.tables
        queues: dict[str, list[int]] = {cid: [] for cid in SESSIONS}
        referenced: Counter[int] = Counter()
        with self.store.env.begin() as txn:
            rows = {rec.from_u64(bytes(k)) for k, _ in txn.cursor(db=tables.messages)}
            for key, value in txn.cursor(db=tables.queue):
                cid, _ = rec.split_client_key(bytes(key))
                mid = rec.from_u64(bytes(value))
                queues[cid].append(mid)
                inline = rec.inline_message(bytes(value))
                if inline is None:
                    referenced[mid] += 1
                else:
                    assert rec.decode_message(mid, inline).payload == b"%d" % mid
            retained = {bytes(k).decode(): rec.from_u64(bytes(v)) for k, v in txn.cursor(db=tables.retained)}
        referenced.update(retained.values())
        assert queues == {cid: [d.message.mid for d in q] for cid, q in self.queues.items()}
        assert retained == {topic: m.mid for topic, m in self.retained.items()}
        assert rows == set(referenced)
        assert self.store._applier.refs == {mid: n for mid, n in referenced.items() if n > 1}
        self.inline = {mid for q in queues.values() for mid in q} - rows

    def close(self) -> None:
        self.commit()
        self.store.close()
        self.loop.close()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_ops, max_size=40))
def test_message_rows_match_their_references(ops: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Store(Path(tmp) / "store")
        try:
            for op in ops:
                getattr(model, str(op[0]))(*op[1:])
                if op[0] == "commit":
                    model.check()
            for cid in SESSIONS:
                while model.queues[cid]:
                    model.ack(cid, 0)
            for pick in range(4):
                model.clear_retained(pick)
            model.check()
            assert model.store._applier.refs == {}
        finally:
            model.close()


def test_a_message_for_one_session_is_stored_in_its_queue_row_and_shared_ones_once(tmp_path: Path) -> None:
    """Payloads stored once: message 1 queued for ``a`` only is stored in ``a``'s queue row (no
    message row); message 2 queued for ``a``, ``b`` and ``c`` in the same commit has one message row referenced
    three times; a retained message 3 also queued for ``a`` has one row referenced twice."""
    model = Store(tmp_path / "store")
    try:
        model.publish({"a"}, False)
        model.publish({"a", "b", "c"}, False)
        model.publish({"a"}, True)
        model.check()
        assert model.inline == {1}
        assert model.store._applier.refs == {2: 3, 3: 2}
    finally:
        model.close()


def test_an_older_message_queued_behind_new_ones_in_one_commit_keeps_its_row(tmp_path: Path) -> None:
    """Message 1 queued for ``a``, message 2 for ``a``, then message 1 again for ``b``, all in one commit: ``b``'s
    reference gets a message row, so ``a``'s acknowledgement leaves ``b`` its message, also after a reopening."""
    model = Store(tmp_path / "store")
    try:
        model.publish({"a"}, False)
        model.publish({"a"}, False)
        model.requeue("b", 0)
        model.check()
        model.ack("a", 0)
        model.check()
        model.reopen()
        assert [d.message.payload for d in model.queues["b"]] == [b"1"]
    finally:
        model.close()


def test_a_version_1_store_reads_the_same_and_is_marked_the_current_version(tmp_path: Path) -> None:
    """A store written before queue rows could carry their message (format 1: every queue row references a message
    row) loads with the same queue; acknowledging the entry removes its message row; the store is then marked
    with the current format (records.FORMAT_VERSION), which this code also reads."""
    path = tmp_path / "store"
    model = Store(path)
    model.close()
    store = LmdbStore(StoreSettings(path=str(path)), ZoneLimits)
    store.load(0.0)
    assert store.env is not None
    message = Message(7, "t/old", b"old", 1, False, {}, 0.0)
    with store.env.begin(write=True) as txn:
        meta, messages, queue_db = store.tables.meta, store.tables.messages, store.tables.queue
        txn.put(b"format", b"1", db=meta)
        txn.put(b"next_mid", b"8", db=meta)
        txn.put(rec.u64(7), rec.encode_message(message), db=messages)
        txn.put(rec.client_prefix("a") + rec.u64(1), rec.encode_delivery(Delivery(message, 1)), db=queue_db)
    store.close()

    model = Store(path)
    try:
        (queued,) = [list(s.mqueue) for s in model.loaded.sessions if s.client_id == "a"]
        assert [(d.message.topic, d.message.payload) for d in queued] == [("t/old", b"old")]
        assert model.store.env is not None
        with model.store.env.begin() as txn:
            assert txn.get(b"format", db=model.store.tables.meta) == str(rec.FORMAT_VERSION).encode()
        model.store.delivery_deleted("a", queued[0])
        model.commit()
        with model.store.env.begin() as txn:
            tables = model.store.tables
            assert txn.stat(tables.messages)["entries"] == 0 and txn.stat(tables.queue)["entries"] == 0
    finally:
        model.close()
