"""The Message Queue of one session (seeds 000-002, DESIGN.md §3).

Messages wait here, FIFO, while the Inflight Window is full or the client is offline. ``max_len`` bounds it
(0 = no limit); when full, the new message is still queued and the oldest is dropped, a QoS 0 message first
if the queue holds any ("If there are QoS 0 messages in the queue, the QoS 0 messages will be discarded first",
seed 002). Dropping is O(1): QoS 0 entries are also indexed in their own FIFO and removed lazily.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from gateway.broker.message import Delivery


class MessageQueue:
    """A bounded FIFO of :class:`Delivery` with the EMQX drop policy.

    Attributes:
        max_len: length limit in messages; 0 = no limit.
        max_bytes: payload bytes the queue may hold (a per-client quota); 0 = no limit. Enforced by the owner
            through :meth:`over_quota` and :meth:`drop_oldest`, with the same policy.
        bytes: payload bytes of the entries held.
    """

    __slots__ = ("_items", "_len", "_qos0", "bytes", "max_bytes", "max_len")

    def __init__(self, max_len: int = 1000, max_bytes: int = 0) -> None:
        self.max_len = max_len
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[Delivery] = deque()
        self._qos0: deque[Delivery] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Delivery]:
        return (d for d in self._items if not d.dropped)

    def push(self, delivery: Delivery) -> Delivery | None:
        """Append ``delivery``; return the entry dropped to make room, or ``None``."""
        victim = None
        if self.max_len and self._len >= self.max_len:
            victim = self._drop_one()
        self._items.append(delivery)
        if delivery.qos == 0:
            self._qos0.append(delivery)
        self._len += 1
        self.bytes += len(delivery.message.payload)
        return victim

    def over_quota(self) -> bool:
        """True while the queue holds more than ``max_bytes`` payload bytes (and more than one entry)."""
        return bool(self.max_bytes) and self.bytes > self.max_bytes and self._len > 1

    def drop_oldest(self) -> Delivery:
        """Drop by the policy (oldest QoS 0, else oldest) and return the victim. Raises ``IndexError`` when
        empty."""
        return self._drop_one()

    def push_front(self, delivery: Delivery) -> None:
        """Put ``delivery`` back at the head (a message taken out of the window to be re-queued)."""
        self._items.appendleft(delivery)
        if delivery.qos == 0:
            self._qos0.appendleft(delivery)
        self._len += 1
        self.bytes += len(delivery.message.payload)

    def _drop_one(self) -> Delivery:
        qos0 = self._qos0
        while qos0:
            entry = qos0.popleft()
            if not entry.dropped:
                entry.dropped = True
                self._len -= 1
                self.bytes -= len(entry.message.payload)
                return entry
        entry = self.pop()
        entry.dropped = True
        return entry

    def pop(self) -> Delivery:
        """Remove and return the oldest entry. Raises ``IndexError`` when empty."""
        items = self._items
        while True:
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
        items = self._items
        while items and items[0].dropped:
            items.popleft()
        return items[0] if items else None

    def remove_if(self, predicate: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop every entry for which ``predicate(entry)`` is true (e.g. expired); return them in order."""
        removed = [d for d in self._items if not d.dropped and predicate(d)]
        for entry in removed:
            entry.dropped = True
            self._len -= 1
            self.bytes -= len(entry.message.payload)
        if removed:
            self._items = deque(d for d in self._items if not d.dropped)
            self._qos0 = deque(d for d in self._qos0 if not d.dropped)
        return removed

    def clear(self) -> None:
        """Drop everything."""
        self._items.clear()
        self._qos0.clear()
        self._len = 0
        self.bytes = 0
