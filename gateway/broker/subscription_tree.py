"""The subscription tree: a Topic Filter trie with shared subscriptions (the retained messages are in
:mod:`gateway.broker.retained_store`).

Matching follows MQTT 5.0 §4.7 (``+`` one level, ``#`` any number of trailing levels including the parent,
``$``-topics not matched by a leading wildcard [MQTT-4.7.2-1]); shared subscriptions follow §4.8.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class SubscriptionRecord:
    """One subscription of one session (MQTT 5.0 §3.8.3.1).

    Attributes:
        topic_filter: the filter as matched (without ``$share/<group>/``).
        share_group: the ShareName for a shared subscription, else ``None``.
        qos: maximum QoS granted; no_local, retain_as_published, retain_handling: the options.
        sub_id: Subscription Identifier (5.0), or ``None``.
    """

    client_id: str
    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    sub_id: int | None = None
    share_group: str | None = None

    @property
    def key(self) -> str:
        """The filter as the client wrote it (``$share/<group>/<filter>`` for shared ones)."""
        if self.share_group is None:
            return self.topic_filter
        return f"$share/{self.share_group}/{self.topic_filter}"


@dataclass(slots=True, eq=False)
class SharedGroup:
    """The members of one ``$share/<group>/<filter>``; messages go to one member each, round robin."""

    members: dict[str, SubscriptionRecord] = field(default_factory=dict)
    cursor: int = 0


class _Node:
    __slots__ = ("children", "shared", "subs")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.subs: dict[str, SubscriptionRecord] = {}
        self.shared: dict[str, SharedGroup] = {}


Match = tuple[list[SubscriptionRecord], list[SharedGroup]]


class SubscriptionTree:
    """All subscriptions of all sessions, indexed by Topic Filter level.

    ``match(topic)`` returns the ordinary subscriptions and the shared groups that match; results for exact
    topics are cached until the next subscribe/unsubscribe.
    """

    __slots__ = ("_cache", "_root", "count")

    def __init__(self) -> None:
        self._root = _Node()
        self._cache: dict[str, Match] = {}
        self.count = 0

    def add(self, record: SubscriptionRecord) -> bool:
        """Add or replace ``record``; return True when it replaced an existing subscription [MQTT-3.8.4-3]."""
        node = self._root
        for level in record.topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        self._cache.clear()
        if record.share_group is None:
            existed = record.client_id in node.subs
            node.subs[record.client_id] = record
        else:
            group = node.shared.get(record.share_group)
            if group is None:
                group = node.shared[record.share_group] = SharedGroup()
            existed = record.client_id in group.members
            group.members[record.client_id] = record
        if not existed:
            self.count += 1
        return existed

    def remove(self, client_id: str, topic_filter: str, share_group: str | None = None) -> bool:
        """Remove one subscription; return False when there was none."""
        path: list[tuple[_Node, str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if share_group is None:
            if node.subs.pop(client_id, None) is None:
                return False
        else:
            group = node.shared.get(share_group)
            if group is None or group.members.pop(client_id, None) is None:
                return False
            if not group.members:
                del node.shared[share_group]
        self.count -= 1
        self._cache.clear()
        # Prune empty nodes bottom-up.
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.subs or child.shared or child.children:
                break
            del parent.children[level]
        return True

    def match(self, topic: str) -> Match:
        """Subscriptions and shared groups whose filter matches ``topic`` (a Topic Name)."""
        cached = self._cache.get(topic)
        if cached is not None:
            return cached
        subs: list[SubscriptionRecord] = []
        groups: list[SharedGroup] = []
        levels = topic.split("/")
        dollar = topic.startswith("$")
        self._walk(self._root, levels, 0, subs, groups, dollar)
        result = (subs, groups)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[topic] = result
        return result

    def _walk(
        self,
        node: _Node,
        levels: list[str],
        i: int,
        subs: list[SubscriptionRecord],
        groups: list[SharedGroup],
        dollar: bool,
    ) -> None:
        children = node.children
        wild_ok = not (dollar and i == 0)
        if wild_ok:
            hash_node = children.get("#")
            if hash_node is not None:
                subs.extend(hash_node.subs.values())
                groups.extend(hash_node.shared.values())
        if i == len(levels):
            subs.extend(node.subs.values())
            groups.extend(node.shared.values())
            return
        child = children.get(levels[i])
        if child is not None:
            self._walk(child, levels, i + 1, subs, groups, dollar)
        if wild_ok:
            plus = children.get("+")
            if plus is not None:
                self._walk(plus, levels, i + 1, subs, groups, dollar)
