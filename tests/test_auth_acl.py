"""gateway.auth.acl: Mosquitto's acl_file, checked against a transliteration of Mosquitto 2.0's
``mosquitto_acl_check_default`` (hypothesis), brute force over a topic universe for the filter relations and the
SUBSCRIBE decision, and a real ``mosquitto`` with the same acl_file for which messages get through."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from auth_helpers import MosquittoBroker
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.auth.acl import (
    ALLOW_ALL,
    CACHE_TOPICS,
    READ,
    WRITE,
    Acl,
    AclFileError,
    FilterIndex,
    Readable,
    filter_covers,
    filter_intersection,
)
from gateway.auth.passwd import PasswordFile
from gateway.mqtt.topics import topic_matches

# -- the file format -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("topic read a\nuser\n", 2, "'user' needs a user name"),
        ("topic\n", 1, "'topic' needs a topic filter"),
        ("# c\npattern readonly a/%c\n", 2, "access 'readonly' is not one of"),
        ("topic read a/#/b\n", 1, "topic filter 'a/#/b': '#' must be the last"),
        ("topic read a+\n", 1, "'+' must occupy an entire level"),
        ("\n\nsubscribe a\n", 3, "unknown keyword 'subscribe'"),
    ],
)
def test_parse_errors_name_the_file_the_line_and_the_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(AclFileError) as info:
        Acl.parse(text, "/etc/acl")
    assert (info.value.path, info.value.line) == ("/etc/acl", line)
    assert reason in info.value.reason, info.value.reason
    assert str(info.value).startswith(f"/etc/acl:{line}: ")


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(AclFileError, match="/nope: cannot read"):
        Acl.load(tmp_path / "nope")


def test_blocks_access_words_and_topics_with_spaces() -> None:
    acl = Acl.parse(
        "# anonymous\n  # indented comment\ntopic public/#\ntopic read  with space/x \n"
        "user alice\ntopic write a/#\npattern read p/%u\nuser bob\ntopic deny a/b\nuser alice\ntopic read r\n"
    )
    assert [(r.access, r.topic) for r in acl.anonymous] == [(READ | WRITE, "public/#"), (READ, "with space/x")]
    assert [(r.access, r.topic) for r in acl.users["alice"]] == [(WRITE, "a/#"), (READ, "r")]
    assert [(r.access, r.topic) for r in acl.users["bob"]] == [(0, "a/b")]
    assert [(r.access, r.topic, r.line) for r in acl.patterns] == [(READ, "p/%u", 7)]


def test_semantics_of_blocks_patterns_and_deny() -> None:
    acl = Acl.parse(
        "topic read public/#\n"
        "pattern readwrite devices/%c/#\n"  # a pattern before any user line applies to everyone
        "user alice\n"
        "topic readwrite plant/alice/#\n"
        "topic deny plant/alice/secret\n"
        "pattern read users/%u/inbox\n"
        "pattern deny devices/%c/locked\n"
        "pattern deny plant/%u/private\n"
    )
    assert acl.may_receive(None, "anon", "public/news") and not acl.may_publish(None, "anon", "public/news")
    assert not acl.may_receive("alice", "c", "public/news")  # user rules replace the anonymous block
    assert acl.may_publish(None, "anon", "devices/anon/t")  # patterns apply to anonymous clients too
    assert not acl.may_receive(None, "anon", "users//inbox")  # ... but not those with %u
    assert acl.may_receive("alice", "c1", "users/alice/inbox") and not acl.may_receive("bob", "c1", "users/alice/inbox")
    assert acl.may_publish("alice", "c1", "plant/alice/t") and not acl.may_publish("alice", "c1", "plant/alice/secret")
    assert not acl.may_receive("alice", "c1", "devices/c1/locked") and acl.may_receive("alice", "c1", "devices/c1/x")
    # deny wins across user rules and patterns (Mosquitto lets the user grant win here: the documented difference)
    assert not acl.may_receive("alice", "c1", "plant/alice/private")
    # a Client Identifier or user name with + or # gets nothing from patterns (Mosquitto 2.0 does the same)
    assert not acl.may_publish(None, "#", "devices/x/t") and not acl.may_publish(None, "a+b", "devices/a+b/t")
    assert acl.may_receive(None, "#", "public/x")
    # $ topics: a rule starting with a wildcard does not match them [MQTT-4.7.2-1]
    wide = Acl.parse("topic read #\ntopic read +/x\ntopic read $ctl/#\n")
    assert not wide.may_receive(None, "c", "$SYS/x") and not wide.may_receive(None, "c", "$a/x")
    assert wide.may_receive(None, "c", "$ctl/a")


def test_subscribe_decisions() -> None:
    acl = Acl.parse(
        "user alice\n"
        "topic readwrite plant/alice/#\n"
        "topic deny plant/alice/secret\n"
        "topic write cmd/#\n"
        "pattern read devices/%c/#\n"
        "topic read $ctl/#\n"
    )
    alice = acl.for_client("alice", "d1")
    expected = {
        "plant/alice/#": Readable.PARTIAL,  # readable in part: the secret is filtered on delivery
        "plant/alice/+": Readable.PARTIAL,
        "plant/alice/temp": Readable.ALL,
        "plant/alice/temp/#": Readable.ALL,
        "plant/alice/secret": Readable.NONE,
        "plant/+/secret": Readable.NONE,
        "plant/#": Readable.PARTIAL,
        "#": Readable.PARTIAL,
        "+/+/temp": Readable.PARTIAL,
        "cmd/#": Readable.NONE,  # write only
        "other/#": Readable.NONE,
        "devices/d1/#": Readable.ALL,
        "devices/d2/#": Readable.NONE,
        "$ctl/x": Readable.ALL,
        "$SYS/#": Readable.NONE,
    }
    assert {f: alice.subscribe(f) for f in expected} == expected
    assert ALLOW_ALL.subscribe("#") is Readable.ALL and ALLOW_ALL.may_publish("$x") and ALLOW_ALL.may_receive("a")


# -- properties ------------------------------------------------------------------------------------------------------

TOPIC_LEVELS = ["a", "b", "c", "$s", ""]
FILTER_LEVELS = ["a", "b", "$s", "", "+"]
UNIVERSE = [
    "/".join(levels) for n in range(1, 5) for levels in itertools.product(TOPIC_LEVELS, repeat=n) if levels != ("",)
]


@st.composite
def filters(draw: st.DrawFn, levels: list[str] = FILTER_LEVELS) -> str:
    body = draw(st.lists(st.sampled_from(levels), min_size=0, max_size=3))
    if body == [""] or not body or draw(st.booleans()):
        body.append("#")  # a filter is not empty [MQTT-4.7.3-1]
    return "/".join(body)


@settings(max_examples=400, deadline=None)
@given(filters(), filters())
@example("/#", "+")  # meet only in the empty topic, which is none
def test_filter_intersection_is_exactly_the_common_topics(a: str, b: str) -> None:
    both = {t for t in UNIVERSE if topic_matches(a, t) and topic_matches(b, t)}
    meet = filter_intersection(a, b)
    assert meet != "", (a, b)  # "" would be no filter
    if meet is None:
        assert not both, (a, b, sorted(both)[:5])
    else:
        assert {t for t in UNIVERSE if topic_matches(meet, t)} == both, (a, b, meet)


@settings(max_examples=400, deadline=None)
@given(filters(), filters())
@example("/+/#", "/#")  # "/#" matches no "" (no topic), so "/+/#" covers it
@example("+/#", "#")
def test_filter_covers_is_exactly_inclusion(outer: str, inner: str) -> None:
    included = all(topic_matches(outer, t) for t in UNIVERSE if topic_matches(inner, t))
    assert filter_covers(outer, inner) == included, (outer, inner)


@settings(max_examples=300, deadline=None)
@given(st.lists(filters(), max_size=6))
def test_filter_index_answers_as_topic_matches(filter_list: list[str]) -> None:
    index = FilterIndex(filter_list)
    for topic in UNIVERSE:
        assert index.any_match(topic) == any(topic_matches(f, topic) for f in filter_list), (filter_list, topic)


def test_answers_are_cached_per_topic_and_the_cache_is_bounded() -> None:
    client = Acl.parse("topic readwrite a/#\ntopic deny a/x\n").for_client(None, "c")
    for i in range(3 * CACHE_TOPICS):
        assert client.may_publish(f"a/{i}") and client.may_publish(f"a/{i}")
        assert client.may_receive(f"a/{i}")
    assert not client.may_publish("a/x") and not client.may_publish("a/x") and not client.may_receive("b")
    assert len(client._write_cache) <= CACHE_TOPICS and len(client._read_cache) <= CACHE_TOPICS


ACL_LEVELS = ["a", "b", "$s", "+", "%c", "%u"]
USERS = [None, "alice", "bob"]
CLIENT_IDS = ["a", "b", "x+y"]


@st.composite
def acl_texts(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["topic", "topic", "pattern", "user"]))
        if kind == "user":
            lines.append(f"user {draw(st.sampled_from(['alice', 'bob']))}")
            continue
        access = draw(st.sampled_from(["", "read ", "write ", "readwrite ", "deny "]))
        lines.append(f"{kind} {access}{draw(filters(ACL_LEVELS))}")
    return "\n".join(lines) + "\n"


def mosquitto_2_0_check(acl: Acl, username: str | None, client_id: str, topic: str, access: int) -> bool:
    """Mosquitto 2.0's ``mosquitto_acl_check_default`` (src/security_default.c), transliterated: the client's user
    rules with deny rules first, the first that matches decides; then (unless the user name or Client Identifier
    holds + or #) the patterns, deny patterns first, substituted textually."""
    user_rules = acl.anonymous if username is None else acl.users.get(username, [])
    for rule in sorted(user_rules, key=lambda r: r.access != 0):
        if topic[0] == "$" and rule.topic[0] != "$":
            continue
        if topic_matches(rule.topic, topic):
            if rule.access == 0:
                return False
            if access & rule.access:
                return True
    if acl.patterns and any(n is not None and ("+" in n or "#" in n) for n in (username, client_id)):
        return False
    for rule in sorted(acl.patterns, key=lambda r: r.access != 0):
        if "%u" in rule.topic and username is None:
            continue
        local = rule.topic.replace("%c", client_id).replace("%u", username or "")
        if topic_matches(local, topic):
            if rule.access == 0:
                return False
            if access & rule.access:
                return True
    return False


@settings(max_examples=300, deadline=None)
@given(acl_texts(), st.sampled_from(USERS), st.sampled_from(CLIENT_IDS), st.sampled_from([READ, WRITE]))
def test_publish_and_receive_agree_with_mosquitto_but_for_pattern_deny(
    text: str, username: str | None, client_id: str, access: int
) -> None:
    """Ours and Mosquitto 2.0's decision agree for every topic, except where a user rule grants and a ``pattern
    deny`` matches: there Mosquitto grants and we refuse (deny wins)."""
    acl = Acl.parse(text)
    client = acl.for_client(username, client_id)
    pattern_denies = [
        r.topic.replace("%c", client_id).replace("%u", username or "")
        for r in acl.patterns
        if r.access == 0 and not (username is None and "%u" in r.topic)
    ]
    for topic in UNIVERSE:
        ours = client.may_receive(topic) if access == READ else client.may_publish(topic)
        theirs = mosquitto_2_0_check(acl, username, client_id, topic, access)
        if ours != theirs:
            assert theirs and not ours, (text, username, client_id, topic)
            assert any(topic_matches(d, topic) for d in pattern_denies), (text, username, client_id, topic)


@settings(max_examples=300, deadline=None)
@given(acl_texts(), st.sampled_from(USERS), st.sampled_from(CLIENT_IDS), filters())
def test_subscribe_decision_is_sound(text: str, username: str | None, client_id: str, topic_filter: str) -> None:
    """ALL: every topic of the universe the filter matches is readable; NONE: none is. (PARTIAL is always safe.)"""
    client = Acl.parse(text).for_client(username, client_id)
    readable = [client.may_receive(t) for t in UNIVERSE if topic_matches(topic_filter, t)]
    decision = client.subscribe(topic_filter)
    if decision is Readable.ALL:
        assert all(readable), (text, topic_filter)
    elif decision is Readable.NONE:
        assert not any(readable), (text, topic_filter)


# -- a real mosquitto with the same acl_file -------------------------------------------------------------------------

LIVE_ACL = """\
# anonymous clients
topic read public/#
topic write anon/in
topic readwrite sync/#

user admin
topic readwrite #
topic readwrite $ctl/#

user alice
topic readwrite sync/#
topic readwrite plant/alice/#
topic deny plant/alice/secret
topic read plant/shared/+
topic write cmd/#
topic deny cmd/forbidden/#
topic read $ctl/#

user bob
topic readwrite sync/#
topic read plant/#
topic deny plant/+/secret

user carol
topic readwrite sync/#

pattern readwrite devices/%c/#
pattern read users/%u/inbox
pattern write users/%u/outbox
pattern deny devices/%c/locked
pattern deny plant/%u/private
"""

LIVE_TOPICS = [
    "public/news",
    "anon/in",
    "plant/alice/temp",
    "plant/alice/secret",
    "plant/alice/private",
    "plant/shared/x",
    "plant/shared/x/y",
    "plant/bob/secret",
    "plant/bob/temp",
    "cmd/go",
    "cmd/forbidden/now",
    "devices/d-alice/t",
    "devices/d-alice/locked",
    "devices/d-bob/t",
    "users/carol/inbox",
    "users/alice/inbox",
    "users/alice/outbox",
    "users/bob/inbox",
    "$ctl/a",
]

#: (user, Client Identifier) of the clients compared; carol's identifier holds '+', which voids patterns
SUBJECTS = [(None, "d-anon"), ("alice", "d-alice"), ("bob", "d-bob"), ("carol", "car+ol")]

#: where Mosquitto 2.0 grants and we refuse: a user rule grants, a pattern deny matches (module docstring)
DIVERGENT = {("alice", "plant/alice/private")}


class Collector:
    """A paho client (MQTT 3.1.1) that records the topics it receives and waits for a sentinel topic."""

    def __init__(self, port: int, client_id: str, username: str | None) -> None:
        self.topics: list[str] = []
        self.cond = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        if username is not None:
            self.client.username_pw_set(username, "pw-" + username)
        self.client.on_message = self._on_message
        connected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: connected.set() if not rc.is_failure else None
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert connected.wait(10), f"{username} could not connect"

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self.cond:
            self.topics.append(msg.topic)
            self.cond.notify_all()

    def subscribe(self, *filters: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe([(f, 1) for f in filters])
        assert done.wait(10)

    def publish(self, topic: str) -> None:
        self.client.publish(topic, b"x", qos=1).wait_for_publish(10)

    def wait_for(self, topic: str, timeout: float = 10.0) -> list[str]:
        with self.cond:
            assert self.cond.wait_for(lambda: topic in self.topics, timeout), (topic, self.topics)
            return [t for t in self.topics if t != topic]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_real_mosquitto_with_the_same_acl_file_lets_the_same_messages_through(tmp_path: Path) -> None:
    """Each subject subscribes to # and $ctl/# (Mosquitto grants every SUBSCRIBE and filters on delivery) while
    admin publishes every topic; then each subject publishes every topic while admin listens. What arrives is what
    may_receive / may_publish allow, but for the one documented difference (DIVERGENT)."""
    acl_path = tmp_path / "acl"
    acl_path.write_text(LIVE_ACL)
    acl = Acl.load(acl_path)
    pf = PasswordFile(str(tmp_path / "pw"))
    for user in ("admin", "alice", "bob", "carol"):
        pf.set(user, "pw-" + user)
    pf.save()
    extra = f"allow_anonymous true\npassword_file {tmp_path / 'pw'}\nacl_file {acl_path}\n"
    with MosquittoBroker(tmp_path, extra) as broker:
        admin = Collector(broker.port, "admin", "admin")
        admin.subscribe("#", "$ctl/#")
        try:
            for username, client_id in SUBJECTS:
                who = username or "anonymous"
                subject = Collector(broker.port, client_id, username)
                try:
                    subject.subscribe("#", "$ctl/#")
                    for topic in LIVE_TOPICS:
                        admin.publish(topic)
                    admin.publish(f"sync/{who}/read")
                    received = set(subject.wait_for(f"sync/{who}/read"))
                    expected = {t for t in LIVE_TOPICS if acl.may_receive(username, client_id, t)}
                    divergent = {t for u, t in DIVERGENT if u == username}
                    assert received - divergent == expected - divergent, (who, broker.log()[-3000:])
                    assert divergent <= received and not divergent & expected, who

                    admin.topics.clear()
                    for topic in LIVE_TOPICS:
                        subject.publish(topic)
                    subject.publish(f"sync/{who}/write")
                    written = set(admin.wait_for(f"sync/{who}/write"))
                    expected = {t for t in LIVE_TOPICS if acl.may_publish(username, client_id, t)}
                    assert written - divergent == expected - divergent, who
                    assert divergent <= written and not divergent & expected, who
                    admin.topics.clear()
                finally:
                    subject.close()
        finally:
            admin.close()
