"""Unit tests of the Message Queue drop policy (gateway/broker/mqueue.py) against a reference model.

The policy (docs/architecture.md, "Session semantics"; EMQX's "Inflight and Queue"): when the Message Queue has
reached ``max_mqueue_len``, a new message is still queued and the oldest one is dropped, a QoS 0 message first if
the queue holds any. ``max_mqueue_len`` 0 means no limit. The ``seed_000`` ... ``seed_004`` prefixes of test names
name the group of session semantics a test checks, as in tests/test_core.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.broker.message import Delivery, Message
from gateway.broker.mqueue import MessageQueue

_mids = itertools.count(1)


def make_delivery(qos: int, tag: int | None = None) -> Delivery:
    """A Delivery of a fresh message at ``qos``; its ``seq`` holds ``tag`` (the model's identity)."""
    mid = next(_mids)
    message = Message(mid, "t/x", b"p%d" % mid, qos, False, {}, 0.0)
    return Delivery(message, qos, seq=mid if tag is None else tag)


@dataclass
class Model:
    """The reference: a plain list of (tag, qos), oldest first."""

    max_len: int
    items: list[tuple[int, int]]

    def push(self, tag: int, qos: int) -> tuple[int, int] | None:
        victim = None
        if self.max_len and len(self.items) >= self.max_len:
            index = next((i for i, (_t, q) in enumerate(self.items) if q == 0), 0)
            victim = self.items.pop(index)
        self.items.append((tag, qos))
        return victim

    def pop(self) -> tuple[int, int]:
        return self.items.pop(0)

    def push_front(self, tag: int, qos: int) -> None:
        self.items.insert(0, (tag, qos))


def snapshot(queue: MessageQueue) -> list[tuple[int, int]]:
    """The live entries of ``queue`` as (tag, qos), oldest first."""
    return [(d.seq, d.qos) for d in queue]


# One operation: ("push", qos) | ("pop", None) | ("push_front", qos) | ("peek", None); pushes weighted up.
_op = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("push"), st.integers(0, 2)),
    st.tuples(st.just("pop"), st.none()),
    st.tuples(st.just("push_front"), st.integers(0, 2)),
    st.tuples(st.just("peek"), st.none()),
)


@settings(max_examples=400, deadline=None)
@given(max_len=st.integers(0, 6), ops=st.lists(_op, max_size=80))
def test_seed_000_002_drop_policy_matches_reference_model(max_len: int, ops: list[tuple[str, int | None]]) -> None:
    """The queue never exceeds max_mqueue_len (0 = no limit); when full the new message is still queued and the
    oldest is dropped, a QoS 0 message first if the queue holds any; survivors keep FIFO order; push returns
    exactly the dropped entry."""
    queue = MessageQueue(max_len)
    model = Model(max_len, [])
    tags = itertools.count(1)
    fronted = False  # push_front re-queues without a drop, so it may exceed max_len
    for name, qos in ops:
        if name == "push":
            assert qos is not None
            tag = next(tags)
            delivery = make_delivery(qos, tag)
            expected = model.push(tag, qos)
            before = len(queue)
            victim = queue.push(delivery)
            if max_len:
                assert len(queue) <= max(max_len, before)
            if expected is None:
                assert victim is None
            else:
                assert victim is not None
                assert (victim.seq, victim.qos) == expected
                assert victim.dropped is True
                assert victim is not delivery
        elif name == "push_front":
            # A message taken back out of the window is re-queued at the head, without a drop.
            assert qos is not None
            fronted = True
            tag = next(tags)
            model.push_front(tag, qos)
            queue.push_front(make_delivery(qos, tag))
        elif name == "pop":
            if model.items:
                entry = queue.pop()
                assert (entry.seq, entry.qos) == model.pop()
            else:
                with pytest.raises(IndexError):
                    queue.pop()
        else:
            head = queue.peek()
            if model.items:
                assert head is not None
                assert (head.seq, head.qos) == model.items[0]
            else:
                assert head is None
        assert snapshot(queue) == model.items
        assert len(queue) == len(model.items)
        assert bool(queue) == bool(model.items)
        if max_len and not fronted:
            assert len(queue) <= max_len


@settings(max_examples=300, deadline=None)
@given(
    max_len=st.integers(0, 6),
    before=st.lists(st.integers(0, 2), max_size=20),
    remove_qos=st.sets(st.integers(0, 2)),
    after=st.lists(st.integers(0, 2), max_size=20),
)
def test_seed_000_remove_if_then_drop_policy_still_holds(max_len: int, before: list[int], remove_qos: set[int],
                                                         after: list[int]) -> None:
    """Expired offline messages leave the queue, with the drop policy in force: ``remove_if`` drops exactly the
    matching live entries in order, and the drop policy (QoS 0 first, else the oldest) still holds afterwards."""
    queue = MessageQueue(max_len)
    model = Model(max_len, [])
    tags = itertools.count(1)
    for qos in before:
        tag = next(tags)
        model.push(tag, qos)
        queue.push(make_delivery(qos, tag))
    removed = queue.remove_if(lambda d: d.qos in remove_qos)
    expected_removed = [item for item in model.items if item[1] in remove_qos]
    assert [(d.seq, d.qos) for d in removed] == expected_removed
    assert all(d.dropped for d in removed)
    model.items = [item for item in model.items if item[1] not in remove_qos]
    assert snapshot(queue) == model.items
    assert len(queue) == len(model.items)
    for qos in after:
        tag = next(tags)
        expected = model.push(tag, qos)
        victim = queue.push(make_delivery(qos, tag))
        assert (None if victim is None else (victim.seq, victim.qos)) == expected
        assert snapshot(queue) == model.items
    drained = []
    while queue:
        entry = queue.pop()
        drained.append((entry.seq, entry.qos))
    assert drained == model.items
    assert queue.peek() is None
    assert len(queue) == 0


def test_seed_002_full_queue_drops_oldest_qos0_first() -> None:
    """A full queue drops a QoS 0 message first if it holds any - with max_mqueue_len 3 holding QoS 1, QoS 0,
    QoS 2, a new QoS 1 evicts the QoS 0 one, the next the oldest QoS 1."""
    queue = MessageQueue(3)
    a, b, c = make_delivery(1), make_delivery(0), make_delivery(2)
    for d in (a, b, c):
        assert queue.push(d) is None
    d = make_delivery(1)
    assert queue.push(d) is b
    assert list(queue) == [a, c, d]
    e = make_delivery(0)
    assert queue.push(e) is a
    assert list(queue) == [c, d, e]
    f = make_delivery(2)
    assert queue.push(f) is e
    assert list(queue) == [c, d, f]
    assert queue.peek() is c
    assert [queue.pop(), queue.pop(), queue.pop()] == [c, d, f]
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_seed_000_max_mqueue_len_0_means_no_limit() -> None:
    """``max_mqueue_len`` is the Message Queue's length limit, and 0 means no limit."""
    queue = MessageQueue(0)
    entries = [make_delivery(i % 3) for i in range(5000)]
    for d in entries:
        assert queue.push(d) is None
    assert len(queue) == 5000
    assert list(queue) == entries


def test_seed_000_peek_skips_dropped_head() -> None:
    """After the oldest QoS 0 entry at the head is dropped, peek and pop see the next live entry."""
    queue = MessageQueue(2)
    q0, q1 = make_delivery(0), make_delivery(1)
    queue.push(q0)
    queue.push(q1)
    q2 = make_delivery(2)
    assert queue.push(q2) is q0
    assert queue.peek() is q1
    assert queue.pop() is q1
    assert queue.peek() is q2
    assert len(queue) == 1


def test_dropped_entries_do_not_accumulate_in_a_queue_that_is_never_popped() -> None:
    """A client that stopped reading never pops its queue, while the drop policy keeps dropping the oldest QoS 0
    entry. Dropped entries are removed lazily, so without compaction the FIFO kept every dropped entry and its
    payload: 3 GB of RSS in 10 s for 900 kB messages. The entries held stay within a constant of ``max_len``, and
    the live ones are still the newest, in order."""
    queue = MessageQueue(max_len=10)
    pushed = [make_delivery(0) for _ in range(10_000)]
    for delivery in pushed:
        queue.push(delivery)
    held = len(queue._items) + len(queue._qos0)  # type: ignore[arg-type]
    assert held <= 2 * (10 + 64 + 1)
    assert len(queue) == 10
    assert [queue.pop().seq for _ in range(10)] == [d.seq for d in pushed[-10:]]
