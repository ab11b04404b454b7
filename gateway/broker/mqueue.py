"""The Message Queue of one session (docs/architecture.md, "Session semantics"), with paging to the store.

Messages wait here, FIFO, while the Inflight Window is full or the client is offline. ``max_len`` bounds it
(0 = no limit); when full, the new message is still queued and the oldest is dropped, a QoS 0 message first
if the queue holds any (EMQX's policy: QoS 0 messages are discarded first, they were never promised
delivery). Dropping is O(1): QoS 0 entries are also indexed in their own FIFO and removed lazily.

Paging (persistent sessions on a store that offers a :class:`~gateway.broker.queue_pager.QueuePager`): a queue already
holding ``mem_len`` entries in memory keeps further entries only in the store once their rows are committed, and
reads them back in batches as it drains. In FIFO order the queue is then three parts::

    head (in memory)  |  paged (in the store only: a count, a byte total, QoS 0 seqs)  |  tail (in memory)

The tail holds entries whose rows are not committed yet (they move into the paged part as commits land) and
entries that are not stored at all. Memory per paged entry is nothing, or 2 small ints for QoS 0.

The paged part holds only rows the store has: an entry is paged out once the pager's ``committed_seq`` reaches its
seq, and the store reports the queue rows of a commit that fails (or that a commit leaves out) before any later
commit moves ``committed_seq`` past them; :meth:`MessageQueue.forget_unwritten` drops those entries first (the
broker counts them as ``store_write_failed``). A paged entry the drain does not find is therefore a real
disagreement (a damaged store), logged as an error.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Final

from gateway.broker.message import Delivery, Message

if TYPE_CHECKING:
    from gateway.broker.queue_pager import QueuePager

log: Final = logging.getLogger("gateway.broker")

#: Entries an offline persistent session keeps in memory at most (the rest wait only in the store): abandoned
#: sessions must not hold their queues in memory (2,000 offline sessions with 1,000 messages each took
#: 515 MiB of anonymous memory when every queue was held whole). A session that comes back gets ``mem_len_online``.
OFFLINE_MEM_LEN: Final = 16

#: The message of a stand-in Delivery for a paged QoS 0 entry dropped without reading it back.
_PAGED_OUT: Final = Message(0, "", b"", 0, False, {}, 0.0)
#: Stands for an empty deque until the first entry (a deque costs ~760 bytes; most sessions never queue).
_NONE: Final[tuple[()]] = ()
_NO_SEQS: Final[frozenset[int]] = frozenset()


class MessageQueue:
    """A bounded FIFO of :class:`Delivery` with the EMQX drop policy, optionally paged to the store.

    Attributes:
        max_len: length limit in messages; 0 = no limit.
        max_bytes: payload bytes the queue may hold (a per-client quota); 0 = no limit. Enforced by the owner
            through :meth:`over_quota` and :meth:`drop_oldest`, with the same policy.
        bytes: payload bytes of the entries held (paged ones included).
        pager: reads paged entries back from the store, or ``None`` (no paging).
        mem_len: entries kept in memory before paging starts, messages (with a pager).
        paged: entries held only in the store.
    """

    __slots__ = ("_dead", "_gone", "_items", "_len", "_page_hi", "_page_lo", "_page_out_every", "_paged_bytes",
                 "_paged_qos0", "_qos0", "_tail", "_tail_qos0", "bytes", "max_bytes", "max_len", "mem_len",
                 "mem_len_online", "paged", "pager")

    def __init__(self, max_len: int = 1000, max_bytes: int = 0) -> None:
        self.max_len = max_len
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[Delivery] | tuple[()] = _NONE
        self._qos0: deque[Delivery] | tuple[()] = _NONE
        self._len = 0
        self._dead = 0  # dropped entries still in the deques (removed lazily; compacted past a bound)
        self.pager: QueuePager | None = None
        self.mem_len = 0
        self.mem_len_online = 0  # mem_len while the session is online (the store's mqueue_mem_len)
        self._page_out_every = 1
        self.paged = 0
        self._paged_bytes = 0
        self._paged_qos0: deque[tuple[int, int]] | tuple[()] = _NONE  # (seq, payload bytes) of paged QoS 0
        self._page_lo = 0  # paged entries have lo < seq <= hi
        self._page_hi = 0
        self._gone: set[int] | frozenset[int] = _NO_SEQS  # dropped paged seqs whose delete may not be committed
        self._tail: deque[Delivery] | tuple[()] = _NONE
        self._tail_qos0: deque[Delivery] | tuple[()] = _NONE

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Delivery]:
        """Every live entry in order; the paged part is read back from the store (for tools and tests)."""
        yield from (d for d in self._items if not d.dropped)
        if self.paged and self.pager is not None:
            rows = self.pager.read(self._page_lo, self._page_hi, self.paged + len(self._gone))
            yield from (d for d in rows if d.seq not in self._gone and not d.dropped)
        yield from (d for d in self._tail if not d.dropped)

    def enable_paging(self, pager: QueuePager, mem_len: int) -> None:
        """Page entries beyond ``mem_len`` in memory through ``pager`` (``mem_len`` 0: no paging)."""
        if mem_len > 0:
            self.pager = pager
            self.mem_len = self.mem_len_online = mem_len
            self._page_out_every = min(32, mem_len)
            if type(self._tail) is tuple:
                self._tail, self._tail_qos0, self._paged_qos0 = deque(), deque(), deque()

    def hold_in_memory(self, online: bool) -> None:
        """Keep up to ``mem_len_online`` entries in memory while the session is online, at most
        :data:`OFFLINE_MEM_LEN` while it is offline (entries already in memory stay until popped; later ones page
        once committed). No effect without paging."""
        if self.pager is None:
            return
        limit = self.mem_len_online if online else min(self.mem_len_online, OFFLINE_MEM_LEN)
        self.mem_len = limit
        self._page_out_every = min(32, limit)

    def push(self, delivery: Delivery) -> Delivery | None:
        """Append ``delivery``; return the entry dropped to make room, or ``None``.

        With paging on, a stored entry (``seq`` set) joins the tail once the in-memory head holds ``mem_len``
        entries, and leaves memory when its row is committed."""
        victim = None
        if self.max_len and self._len >= self.max_len:
            victim = self._drop_one()
        tail = self._tail
        if tail or self.paged or (self.pager is not None and delivery.seq
                                  and len(self._items) >= self.mem_len):
            tail_qos0 = self._tail_qos0
            # Only a paging queue gets here (its tail holds entries, or entries are paged, or it has a pager):
            # enable_paging gave it the tail's deques.
            assert isinstance(tail, deque) and isinstance(tail_qos0, deque)
            tail.append(delivery)
            if delivery.qos == 0:
                tail_qos0.append(delivery)
            self._len += 1
            self.bytes += len(delivery.message.payload)
            if len(tail) >= self._page_out_every:
                self.page_out()  # commits land a batch at a time: looking on every push costs more than it frees
            return victim
        self._head().append(delivery)
        if delivery.qos == 0:
            self._head_qos0().append(delivery)
        self._len += 1
        self.bytes += len(delivery.message.payload)
        return victim

    # The head's deques, made on first use (a shared empty tuple stands for each until then).

    def _head(self) -> deque[Delivery]:
        items = self._items
        if isinstance(items, tuple):
            items = self._items = deque()
        return items

    def _head_qos0(self) -> deque[Delivery]:
        qos0 = self._qos0
        if isinstance(qos0, tuple):
            qos0 = self._qos0 = deque()
        return qos0

    def _mark_gone(self, seq: int) -> None:
        gone = self._gone
        if isinstance(gone, frozenset):
            gone = self._gone = set()
        gone.add(seq)

    def _paged_qos0_index(self) -> deque[tuple[int, int]]:
        # The paged part exists only once enable_paging has made its deques (the store calls it before add_paged).
        paged_qos0 = self._paged_qos0
        assert isinstance(paged_qos0, deque), "Message Queue: paging is not enabled"
        return paged_qos0

    def page_out(self) -> None:
        """Move tail entries whose store rows are committed into the paged part (in order; an entry that is
        not stored, or not committed yet, stops it)."""
        pager = self.pager
        tail = self._tail
        if pager is None or not tail:
            return
        committed = pager.committed_seq()
        while tail:
            entry = tail[0]
            if entry.dropped:
                tail.popleft()
                if entry.seq:
                    self._mark_gone(entry.seq)  # its row may outlive it until the delete commits
                continue
            seq = entry.seq
            if not seq or seq > committed:
                break
            tail.popleft()
            size = len(entry.message.payload)
            if not self.paged:
                self._page_lo = seq - 1
            self.paged += 1
            self._paged_bytes += size
            self._page_hi = seq
            if entry.qos == 0:
                tail_qos0 = self._tail_qos0
                while tail_qos0 and (tail_qos0[0].dropped or tail_qos0[0] is entry):
                    tail_qos0.popleft()
                self._paged_qos0_index().append((seq, size))

    def add_paged(self, seq: int, qos: int, size: int) -> None:
        """Account a stored entry that stays in the store (queue rows read back on start, in seq order);
        ``size`` is its payload length in bytes."""
        if not self.paged:
            self._page_lo = seq - 1
        self.paged += 1
        self._paged_bytes += size
        self._page_hi = seq
        self._len += 1
        self.bytes += size
        if qos == 0:
            self._paged_qos0_index().append((seq, size))

    def page_in_all(self) -> None:
        """Read every paged entry back into memory and stop paging (before the store rows go away: a session
        that stops being persistent keeps its queue in memory only)."""
        while self.paged:
            if not self._read_paged(max(self.paged, 1)):
                break
        if self._tail:
            self._items = deque((*self._items, *self._tail))
            self._qos0 = deque((*self._qos0, *self._tail_qos0))
        self._tail = self._tail_qos0 = self._paged_qos0 = _NONE
        self.pager = None

    def over_quota(self) -> bool:
        """True while the queue holds more than ``max_bytes`` payload bytes (and more than one entry)."""
        return bool(self.max_bytes) and self.bytes > self.max_bytes and self._len > 1

    def drop_oldest(self) -> Delivery:
        """Drop by the policy (oldest QoS 0, else oldest) and return the victim. Raises ``IndexError`` when
        empty."""
        return self._drop_one()

    def push_front(self, delivery: Delivery) -> None:
        """Put ``delivery`` back at the head (a message taken out of the window to be re-queued)."""
        self._head().appendleft(delivery)
        if delivery.qos == 0:
            self._head_qos0().appendleft(delivery)
        self._len += 1
        self.bytes += len(delivery.message.payload)

    def _drop_one(self) -> Delivery:
        # The oldest QoS 0 entry: head first, then the paged part, then the tail (FIFO order of the three).
        for qos0 in (self._qos0, None, self._tail_qos0):
            if qos0 is None:
                if self._paged_qos0:
                    seq, size = self._paged_qos0.popleft()
                    self._mark_gone(seq)
                    self.paged -= 1
                    self._paged_bytes -= size
                    self._len -= 1
                    self.bytes -= size
                    return Delivery(_PAGED_OUT, 0, seq=seq, dropped=True)
                continue
            while qos0:
                entry = qos0.popleft()
                if not entry.dropped:
                    entry.dropped = True
                    self._len -= 1
                    self.bytes -= len(entry.message.payload)
                    self._dead += 1
                    if self._dead > self._len + 64:
                        # Dropped entries stay in the FIFO until popped; a queue that is never popped (a client
                        # that stopped reading) must not hold them, and their payloads, without bound.
                        self._compact()
                    return entry
        entry = self.pop()
        entry.dropped = True
        return entry

    def _read_paged(self, limit: int) -> int:
        """Append up to ``limit`` paged entries to the head; returns how many rows were read."""
        assert self.pager is not None
        rows = self.pager.read(self._page_lo, self._page_hi, limit)
        gone = self._gone
        taken = taken_bytes = 0
        if rows:
            items = self._head()
            for entry in rows:
                seq = entry.seq
                if isinstance(gone, set) and seq in gone:  # the shared empty frozenset holds none
                    gone.discard(seq)
                    continue
                if entry.dropped:
                    # Its message row is missing (a damaged store): forgotten; its bytes leave with the range.
                    log.error("Message Queue: paged entry %d has no message in the store; forgotten", seq)
                    self.paged -= 1
                    self._len -= 1
                    continue
                items.append(entry)
                if entry.qos == 0:
                    self._head_qos0().append(entry)
                taken += 1
                taken_bytes += len(entry.message.payload)
            self._page_lo = rows[-1].seq
        self.paged -= taken
        self._paged_bytes -= taken_bytes
        paged_qos0 = self._paged_qos0
        while paged_qos0 and paged_qos0[0][0] <= self._page_lo:
            paged_qos0.popleft()
        if (not rows or self._page_lo >= self._page_hi) and (self.paged or self._paged_bytes):
            # The range is read through but entries are left: their rows are not in the store although they were
            # committed (rows of failed commits are reported and never paged, forget_unwritten), or their messages
            # were missing. A damaged store or a bug: loud.
            if self.paged:
                log.error("Message Queue: %d paged entries not found in the store; forgotten", self.paged)
            self._len -= self.paged
            self.bytes -= self._paged_bytes
            if paged_qos0:
                paged_qos0.clear()
            self.paged = 0
            self._paged_bytes = 0
        if gone:
            self._gone = {s for s in gone if s > self._page_lo}
        return len(rows)

    def _fill(self) -> None:
        """The head is empty: read the next batch of paged entries, or make the tail the head."""
        batch = max(1, min(512, self.mem_len // 2))
        while self.paged and not self._items:
            if not self._read_paged(batch):
                break
        if not self._items and not self.paged and self._tail:
            self._items, self._tail = self._tail, deque()
            self._qos0, self._tail_qos0 = self._tail_qos0, deque()
            self._gone = _NO_SEQS  # a later paged range starts above every seq seen so far

    def pop(self) -> Delivery:
        """Remove and return the oldest entry. Raises ``IndexError`` when empty."""
        while True:
            items = self._items
            if not items:
                self._fill()
                items = self._items
                if not items:
                    raise IndexError("pop from an empty Message Queue")
            entry = items.popleft()
            if not entry.dropped:
                self._len -= 1
                self.bytes -= len(entry.message.payload)
                if entry.qos == 0:
                    # Its index entry (if still there) is at the head of _qos0.
                    qos0 = self._qos0
                    while qos0 and (qos0[0] is entry or qos0[0].dropped):
                        qos0.popleft()
                return entry

    def peek(self) -> Delivery | None:
        """The oldest entry without removing it, or ``None``."""
        while True:
            items = self._items
            while items and items[0].dropped:
                items.popleft()
            if items:
                return items[0]
            if not self._len:
                return None
            self._fill()
            if not self._items:
                return None

    def remove_if(self, predicate: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop every in-memory entry for which ``predicate(entry)`` is true (e.g. expired); return them in order.
        Paged entries are not read back for this: the broker checks them as they are paged in."""
        removed = [d for part in (self._items, self._tail) for d in part if not d.dropped and predicate(d)]
        for entry in removed:
            entry.dropped = True
            self._len -= 1
            self.bytes -= len(entry.message.payload)
        if removed:
            self._compact()
        return removed

    def forget_unwritten(self, seqs: Collection[int]) -> list[Delivery]:
        """Drop the entries whose store rows were never written (``seqs``: store sequence numbers of the queue rows
        of a commit that failed, or that the commit left out, as the store reports them); return them in order.

        The store reports them before any later commit lands, so they are all still in memory (head or tail):
        :meth:`page_out` only moves entries at or below the pager's ``committed_seq``, which has not moved past
        them yet but will with the next commit that succeeds. Kept, such an entry would be paged out as a row the
        store does not have: counted in ``len`` and towards ``max_len`` until the drain finds it missing."""
        wanted = set(seqs)
        if self.paged and any(self._page_lo < seq <= self._page_hi for seq in wanted):
            log.error("Message Queue: unwritten store rows were reported after they were paged out: a bug")
        return self.remove_if(lambda d: d.seq in wanted)

    def _compact(self) -> None:
        """Remove dropped entries from the in-memory deques (O(entries held))."""
        for entry in self._tail:
            if entry.dropped and entry.seq:
                self._mark_gone(entry.seq)  # later tail entries may be paged past its row
        if self._items:
            self._items = deque(d for d in self._items if not d.dropped)
            self._qos0 = deque(d for d in self._qos0 if not d.dropped)
        if self._tail:
            self._tail = deque(d for d in self._tail if not d.dropped)
            self._tail_qos0 = deque(d for d in self._tail_qos0 if not d.dropped)
        self._dead = 0

    def clear(self) -> None:
        """Drop everything (the store rows are the owner's to delete)."""
        self._items = self._qos0 = _NONE
        self._dead = 0
        for part in (self._tail, self._tail_qos0, self._paged_qos0):
            if part:
                part.clear()
        self._gone = _NO_SEQS
        self.paged = 0
        self._paged_bytes = 0
        self._len = 0
        self.bytes = 0
