"""Mosquitto's ``acl_file``: who may publish to, receive from and subscribe to which topics.

The file format is Mosquitto 2.0's (``mosquitto.conf(5)``, ``acl_file``; parser ``aclfile__parse`` in its
``src/security_default.c``)::

    # lines before any "user" line apply to anonymous clients
    topic read public/#
    user alice
    topic readwrite plant/alice/#
    topic deny plant/alice/secret
    pattern readwrite devices/%c/#      # %c: the client identifier, %u: the user name
    pattern read users/%u/inbox

- ``topic [read|write|readwrite|deny] FILTER``: a rule of the anonymous block (before any ``user`` line) or of the
  user named by the last ``user`` line; no access word means ``readwrite``; FILTER is the rest of the line, so it
  may hold spaces when the access word is given. ``write`` governs PUBLISH (and Will messages), ``read`` delivery.
- ``pattern [read|write|readwrite|deny] FILTER``: applies to every client wherever the line stands, with ``%c``
  and ``%u`` replaced by the client identifier and the user name (a pattern with ``%u`` does not apply to an
  anonymous client). As in Mosquitto, a client whose identifier or user name holds ``+`` or ``#`` gets no access from
  patterns (a Client Identifier of ``#`` would otherwise turn ``devices/%c/#`` into ``devices/#/#``).
- ``user NAME``: NAME is the rest of the line; a ``user`` line may repeat, its rules add up.
- Blank lines and lines whose first non-blank character is ``#`` are comments.

Semantics: a topic is allowed for an access when a rule granting it matches and no ``deny`` rule of the client
matches. ``deny`` wins over any grant: Mosquitto handles the deny rules first within its user rules and within its
patterns, but still lets a user rule grant what a ``pattern deny`` would refuse (it consults patterns only when the
user rules decide nothing); here a ``pattern deny`` refuses that too. That is the one deliberate difference, and
the stricter reading. Topics are matched as in MQTT 5.0 §4.7 (:func:`gateway.mqtt.topics.topic_matches`, which
the tests hold :class:`FilterIndex` to): a rule starting with a wildcard does not match a topic starting with
``$`` [MQTT-4.7.2-1], as in Mosquitto.

Cost: :meth:`ClientAcl.may_publish` and :meth:`ClientAcl.may_receive` answer from a per-topic cache, else walk a
level index of the client's rules (:class:`FilterIndex`), so a file of thousands of rules costs a PUBLISH a dict
look-up or a few level steps, not a scan.

Subscriptions (beyond Mosquitto 2.0, which grants every SUBSCRIBE when an ``acl_file`` is set and filters on
delivery): :meth:`ClientAcl.subscribe` classifies a Topic Filter as :attr:`Readable.NONE` (no topic it matches is
readable: refuse it, SUBACK 0x87 / 3.1.1 0x80), :attr:`Readable.ALL` (every topic it matches is readable: grant,
no check on delivery) or :attr:`Readable.PARTIAL` (grant and check each message with
:meth:`ClientAcl.may_receive`). The answer is exact for one grant against one deny and errs toward PARTIAL when
only several rules together cover the filter, which is safe: PARTIAL still filters every message.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.auth.textfile import FileLineError, read_text
from gateway.mqtt.topics import topic_filter_error

#: Access bits of a rule (``deny`` is 0, as ``MOSQ_ACL_NONE`` in Mosquitto).
READ = 1
WRITE = 2
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": 0}
_SUBSTITUTION = re.compile(r"%[cu]")
#: Topics whose publish/receive answer one :class:`ClientAcl` remembers (per direction) before starting afresh.
CACHE_TOPICS = 1024


class AclFileError(FileLineError):
    """An ACL file that cannot be read or parsed; ``str()`` is ``"<path>:<line>: <reason>"``."""


class Readable(enum.Enum):
    """How much of what a Topic Filter matches a client may receive."""

    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"


@dataclass(frozen=True)
class Rule:
    """One ``topic`` or ``pattern`` line: ``access`` is a set of :data:`READ`/:data:`WRITE` bits, 0 for deny."""

    access: int
    topic: str
    pattern: bool
    line: int


# -- relations between Topic Filters (MQTT 5.0 §4.7) -------------------------------------------------------------


def _wild_start(levels: list[str]) -> bool:
    return levels[0] in ("+", "#")


def filter_intersection(a: str, b: str) -> str | None:
    """The Topic Filter matching exactly the topics both ``a`` and ``b`` match, or ``None`` if there are none.

    The intersection of two MQTT Topic Filters is always one filter (or empty): level by level a literal meets an
    equal literal or ``+``, ``+`` meets anything, and ``#`` takes the other side's remaining levels (it also matches
    its parent level, so ``a/#`` and ``a`` meet in ``a``). A filter starting with a wildcard matches no topic that
    starts with ``$`` [MQTT-4.7.2-1].
    """
    x, y = a.split("/"), b.split("/")
    out: list[str] = []
    for i in range(max(len(x), len(y))):
        xl = x[i] if i < len(x) else None
        yl = y[i] if i < len(y) else None
        if xl == "#":
            out += y[i:]
            break
        if yl == "#":
            out += x[i:]
            break
        if xl is None or yl is None:
            return None
        if xl == "+":
            out.append(yl)
        elif yl == "+" or xl == yl:
            out.append(xl)
        else:
            return None
    if out[0].startswith("$") and (_wild_start(x) or _wild_start(y)):
        return None
    if out == [""]:  # only the empty topic, which is no topic [MQTT-4.7.3-1]
        return None
    return "/".join(out)


def filter_covers(outer: str, inner: str) -> bool:
    """Whether every topic ``inner`` matches is matched by ``outer`` (both valid Topic Filters)."""
    d, x = outer.split("/"), inner.split("/")
    if _wild_start(d) and x[0].startswith("$"):
        return False
    for i, dl in enumerate(d):
        if dl == "#":
            return True
        if i >= len(x):
            return False
        xl = x[i]
        if xl == "#":
            # inner matches x[:i] and everything below it. Only "#" (above) covers that, or "+/#" when the parent
            # x[:i] is no topic: at the root, or when it would be the empty topic "" [MQTT-4.7.3-1]
            return d[i:] == ["+", "#"] and (i == 0 or (i == 1 and x[0] == ""))
        if dl != "+" and dl != xl:
            return False
    return len(x) == len(d)


def filters_intersect(a: str, b: str) -> bool:
    """Whether some topic matches both ``a`` and ``b``."""
    return filter_intersection(a, b) is not None


#: The key that marks the end of a filter in a :class:`FilterIndex` node: no level can hold a "/".
_END = "/"


class FilterIndex:
    """A set of Topic Filters indexed level by level: whether any of them matches a topic, in time that grows with
    the topic's levels rather than with the number of filters. Same answers as ``topic_matches`` on each
    filter (MQTT 5.0 §4.7, including [MQTT-4.7.2-1] for ``$`` topics)."""

    __slots__ = ("_root",)

    def __init__(self, filters: list[str]) -> None:
        self._root: dict[str, dict[str, Any]] = {}
        for topic_filter in filters:
            node = self._root
            for level in topic_filter.split("/"):
                node = node.setdefault(level, {})
            node[_END] = {}

    def any_match(self, topic: str) -> bool:
        """Whether some filter of the set matches the Topic Name ``topic``."""
        levels = topic.split("/")
        n = len(levels)
        wild_root = not topic.startswith("$")
        stack = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            wild = wild_root or i > 0
            if wild and "#" in node:
                return True
            if i == n:
                if _END in node:
                    return True
                continue
            child = node.get(levels[i])
            if child is not None:
                stack.append((child, i + 1))
            if wild:
                plus = node.get("+")
                if plus is not None:
                    stack.append((plus, i + 1))
        return False


# -- the rules of one client -------------------------------------------------------------------------------------


@dataclass
class ClientAcl:
    """The rules that apply to one connected client, resolved once at CONNECT (patterns substituted).

    ``read`` and ``write`` hold the granting filters, ``deny`` the denying ones. The methods are what the broker
    calls: :meth:`may_publish` per PUBLISH (and for the Will at CONNECT), :meth:`may_receive` per message on a
    PARTIAL subscription (and for retained messages sent on SUBSCRIBE), :meth:`subscribe` once per Topic Filter.
    """

    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    deny: list[str] = field(default_factory=list)
    #: no ACL file: every topic allowed (:data:`ALLOW_ALL`)
    allow_all: bool = False
    _write_cache: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)
    _read_cache: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)
    _index: dict[str, FilterIndex] = field(default_factory=dict, repr=False, compare=False)

    def _allowed(self, kind: str, cache: dict[str, bool], topic: str) -> bool:
        if self.allow_all:
            return True
        if not self._index:
            self._index.update(read=FilterIndex(self.read), write=FilterIndex(self.write), deny=FilterIndex(self.deny))
        if len(cache) >= CACHE_TOPICS:
            cache.clear()
        allowed = cache[topic] = not self._index["deny"].any_match(topic) and self._index[kind].any_match(topic)
        return allowed

    def may_publish(self, topic: str) -> bool:
        """Whether the client may PUBLISH to ``topic`` (a ``write`` grant matches, no ``deny`` does).

        The answer is cached per topic (up to :data:`CACHE_TOPICS`), so a client publishing to the same topics
        pays one dict look-up per PUBLISH however many rules it has. The rule lists must not change afterwards:
        a reloaded ACL file makes new :class:`ClientAcl` objects.
        """
        cached = self._write_cache.get(topic)
        return cached if cached is not None else self._allowed("write", self._write_cache, topic)

    def may_receive(self, topic: str) -> bool:
        """Whether a message on ``topic`` may be delivered to the client (a ``read`` grant, no ``deny``); cached
        per topic as :meth:`may_publish`."""
        cached = self._read_cache.get(topic)
        return cached if cached is not None else self._allowed("read", self._read_cache, topic)

    def subscribe(self, topic_filter: str) -> Readable:
        """How much of what ``topic_filter`` matches the client may receive.

        For a Shared Subscription pass the filter after ``$share/<ShareName>/`` (MQTT 5.0 §4.8.2).
        """
        if self.allow_all:
            return Readable.ALL
        if any(filter_covers(g, topic_filter) for g in self.read) and not any(
            filters_intersect(d, topic_filter) for d in self.deny
        ):
            return Readable.ALL
        for g in self.read:
            part = filter_intersection(topic_filter, g)
            if part is not None and not any(filter_covers(d, part) for d in self.deny):
                return Readable.PARTIAL
        return Readable.NONE


#: The rules of a client when there is no ACL file: everything allowed.
ALLOW_ALL = ClientAcl(allow_all=True)


# -- the file ------------------------------------------------------------------------------------------------------


def _dangerous(name: str | None) -> bool:
    return name is not None and ("+" in name or "#" in name)


class Acl:
    """A parsed ACL file: rules of the anonymous block, of each user, and the patterns, in file order."""

    def __init__(self, path: str = "<memory>") -> None:
        self.path = path
        self.anonymous: list[Rule] = []
        self.users: dict[str, list[Rule]] = {}
        self.patterns: list[Rule] = []

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Acl:
        """Read and parse ``path``; :class:`AclFileError` names the file, the line and the reason."""
        name, text = read_text(path, AclFileError)
        return cls.parse(text, name)

    @classmethod
    def parse(cls, text: str, path: str = "<memory>") -> Acl:
        """Parse the text of an ACL file (``path`` only names it in errors)."""
        acl = cls(path)
        block = acl.anonymous
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, rest = (*line.split(None, 1), "")[:2]
            if keyword == "user":
                if not rest:
                    raise AclFileError(path, number, "'user' needs a user name")
                block = acl.users.setdefault(rest, [])
                continue
            if keyword not in ("topic", "pattern"):
                raise AclFileError(path, number, f"unknown keyword {keyword!r} (expected topic, pattern or user)")
            if not rest:
                raise AclFileError(path, number, f"'{keyword}' needs a topic filter")
            first, topic = (*rest.split(None, 1), "")[:2]
            if topic:
                if first not in _ACCESS:
                    raise AclFileError(path, number, f"access {first!r} is not one of read, write, readwrite, deny")
                access = _ACCESS[first]
            else:
                topic, access = first, READ | WRITE
            error = topic_filter_error(topic)
            if error:
                raise AclFileError(path, number, f"topic filter {topic!r}: {error}")
            rule = Rule(access, topic, keyword == "pattern", number)
            (acl.patterns if rule.pattern else block).append(rule)
        return acl

    def for_client(self, username: str | None, client_id: str) -> ClientAcl:
        """The rules of a client with ``username`` (``None``: anonymous) and ``client_id``, patterns substituted."""
        result = ClientAcl()
        rules = self.anonymous if username is None else self.users.get(username, [])
        grants_from_patterns = not (_dangerous(username) or _dangerous(client_id))
        values = {"%c": client_id, "%u": username or ""}
        for rule in [*rules, *self.patterns]:
            topic = rule.topic
            if rule.pattern:
                if username is None and "%u" in topic:
                    continue
                if rule.access and not grants_from_patterns:
                    continue
                topic = _SUBSTITUTION.sub(lambda m: values[m.group(0)], topic)
            if rule.access == 0:
                result.deny.append(topic)
            if rule.access & READ:
                result.read.append(topic)
            if rule.access & WRITE:
                result.write.append(topic)
        return result

    def may_publish(self, username: str | None, client_id: str, topic: str) -> bool:
        """Whether the client may publish to ``topic`` (resolves the client's rules each call: see for_client)."""
        return self.for_client(username, client_id).may_publish(topic)

    def may_receive(self, username: str | None, client_id: str, topic: str) -> bool:
        """Whether a message on ``topic`` may be delivered to the client."""
        return self.for_client(username, client_id).may_receive(topic)

    def subscribe(self, username: str | None, client_id: str, topic_filter: str) -> Readable:
        """NONE, PARTIAL or ALL for a SUBSCRIBE Topic Filter of the client (see :meth:`ClientAcl.subscribe`)."""
        return self.for_client(username, client_id).subscribe(topic_filter)
