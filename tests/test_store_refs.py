"""Message rows and their references in the LMDB store (DESIGN.md §4: "Payloads are stored once and referenced by
queue entries"), checked against a reference model on a real LmdbStore and a real event loop.

The writer thread writes the queue rows of brand-new messages in bulk (one ``putmulti`` per database) and counts
a repeat of the last one as another reference (one message queued for several sessions). Every other reference
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
from gateway.broker.session import NEVER, Session
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
        """Committed store == model: one message row per referenced message, and queue rows per session."""
        self.commit()
        referenced = Counter(d.message.mid for queue in self.queues.values() for d in queue)
        referenced.update(m.mid for m in self.retained.values())
        assert self.store.env is not None
        with self.store.env.begin() as txn:
            rows = {int.from_bytes(bytes(k), "big") for k, _ in txn.cursor(db=self.store.dbs[1])}
            queue_rows = txn.stat(self.store.dbs[4])["entries"]
        assert rows == set(referenced)
        assert queue_rows == sum(len(q) for q in self.queues.values())
        # The writer's counts of messages referenced more than once match the model's.
        assert self.store._refs == {mid: n for mid, n in referenced.items() if n > 1}

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
            assert model.store._refs == {}
        finally:
            model.close()


def test_an_older_message_queued_behind_new_ones_in_one_commit_keeps_its_row(tmp_path: Path) -> None:
    """Message 1 queued for ``a``, message 2 for ``a``, then message 1 again for ``b``, all in one commit: message
    1 has two references, so ``a``'s acknowledgement must leave its row for ``b``."""
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
