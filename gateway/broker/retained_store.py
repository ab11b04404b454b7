"""The retained message store (MQTT 5.0 §3.3.1.3): one message per topic, set, replaced, cleared by an empty
payload, and its ``max_retained_messages`` / ``max_retained_bytes`` accounting. Matching a new subscription's Topic
Filter against the retained topics follows MQTT 5.0 §4.7 as :mod:`gateway.broker.subscription_tree` does.
"""

from __future__ import annotations

from gateway.broker.message import Message
from gateway.mqtt.topics import topic_matches


def retained_size(topic: str, payload: bytes) -> int:
    """Bytes a retained message counts against ``max_retained_bytes``: payload plus UTF-8 topic."""
    return len(payload) + len(topic.encode())


class RetainedMessages:
    """The retained message per topic (MQTT 5.0 §3.3.1.3): set, replaced, cleared by an empty payload.

    Attributes:
        count / size: retained messages outside ``$SYS`` and their :func:`retained_size` total, bytes, for
            ``max_retained_messages`` / ``max_retained_bytes`` (the broker's own ``$SYS`` values are not limited).
        encoded: mid -> (Protocol Level, QoS, PUBLISH parts with RETAIN=1) of retained messages already sent once
            (``gateway.broker.output.write_publish``): a new subscriber to many retained topics gets bytes encoded
            for an earlier one. One variant per message; an entry leaves with its message (replaced, cleared,
            expired). About 200 bytes each (the payload is shared, not copied).
    """

    __slots__ = ("_by_topic", "_sorted", "count", "encoded", "size")

    def __init__(self) -> None:
        self._by_topic: dict[str, Message] = {}
        self._sorted: list[str] | None = None  # the topics in order, kept until one is added or removed
        self.encoded: dict[int, tuple[int, int, tuple[bytes, bytes]]] = {}
        self.count = 0
        self.size = 0

    def __len__(self) -> int:
        return len(self._by_topic)

    def _forget(self, old: Message | None) -> Message | None:
        if old is not None:
            if self.encoded:
                self.encoded.pop(old.mid, None)
            if not old.topic.startswith("$SYS/"):
                self.count -= 1
                self.size -= retained_size(old.topic, old.payload)
        return old

    def set(self, message: Message) -> Message | None:
        """Store ``message`` as the topic's retained message, or clear it when the payload is empty
        [MQTT-3.3.1-6] [MQTT-3.3.1-7]; return the message it replaced."""
        if not message.payload:
            return self.remove(message.topic)
        old = self._forget(self._by_topic.get(message.topic))
        if old is None:
            self._sorted = None
        self._by_topic[message.topic] = message
        if not message.topic.startswith("$SYS/"):
            self.count += 1
            self.size += retained_size(message.topic, message.payload)
        return old

    def refusal(self, topic: str, payload: bytes, max_messages: int, max_bytes: int) -> str | None:
        """The limit (``"max_retained_messages"`` or ``"max_retained_bytes"``; 0 = none) that retaining
        ``payload`` on ``topic`` would pass, or ``None``. Clearing (empty payload) never passes one; replacing
        counts the difference."""
        if not payload or (not max_messages and not max_bytes):
            return None
        old = self._by_topic.get(topic)
        if max_messages and old is None and self.count >= max_messages:
            return "max_retained_messages"
        if max_bytes:
            grown = self.size + retained_size(topic, payload)
            if old is not None:
                grown -= retained_size(old.topic, old.payload)
            if grown > max_bytes:
                return "max_retained_bytes"
        return None

    def get(self, topic: str) -> Message | None:
        """The retained message of ``topic``, or ``None``."""
        return self._by_topic.get(topic)

    def remove(self, topic: str) -> Message | None:
        """Forget the retained message of ``topic`` (expired); return it."""
        old = self._by_topic.pop(topic, None)
        if old is not None:
            self._sorted = None
        return self._forget(old)

    def matching(self, topic_filter: str) -> list[Message]:
        """Retained messages whose topic matches ``topic_filter``, in topic order."""
        by_topic = self._by_topic
        if "+" not in topic_filter and "#" not in topic_filter:
            msg = by_topic.get(topic_filter)
            return [msg] if msg is not None else []
        topics = self._sorted
        if topics is None:
            topics = self._sorted = sorted(by_topic)
        if topic_filter == "#":
            # Every topic but those starting with '$' [MQTT-4.7.2-1] (the common "all of it" subscription: no
            # per-topic matching).
            return [by_topic[t] for t in topics if t[:1] != "$"]
        if topic_filter.endswith("/#") and "+" not in topic_filter:
            # 'a/b/#': the parent 'a/b' and everything below it [MQTT-4.7.1-2]; a prefix test per topic.
            parent = topic_filter[:-2]
            below = topic_filter[:-1]
            return [by_topic[t] for t in topics if t.startswith(below) or t == parent]
        return [by_topic[t] for t in topics if topic_matches(topic_filter, t)]

    def all(self) -> list[Message]:
        """Every retained message."""
        return list(self._by_topic.values())
