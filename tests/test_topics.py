"""Topic Names, Topic Filters, Shared Subscriptions and matching (MQTT 5.0 §4.7-4.8, MQTT 3.1.1 §4.7).

Ids are MQTT 5.0 unless marked ``v311``. The same rules carry different ids in the two specs: '#' is
MQTT-4.7.1-1 in 5.0 and MQTT-4.7.1-2 in 3.1.1; '+' is MQTT-4.7.1-2 in 5.0 and MQTT-4.7.1-3 in 3.1.1.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.mqtt.errors import ProtocolError
from gateway.mqtt.reason_codes import ReasonCode
from gateway.mqtt.topics import (
    SharedFilter,
    parse_shared,
    require_topic,
    topic_filter_error,
    topic_matches,
    topic_name_error,
)

# ------------------------------------------------------------------------------------------------ Topic Names


@pytest.mark.parametrize(
    "topic", ["a", "a/b", "/", "//", "a//b", "/finance", "sport/", "$SYS/x", " ", "\u00e9/\U0001f600"]
)
def test_valid_topic_names(topic: str) -> None:
    assert topic_name_error(topic) is None


def test_mqtt_4_7_3_1_empty_topic_name_is_invalid() -> None:
    """MQTT-4.7.3-1: Topic Names and Topic Filters are at least one character long."""
    error = topic_name_error("")
    assert isinstance(error, str)
    assert "MQTT-4.7.3-1" in error
    assert isinstance(topic_filter_error(""), str)


@pytest.mark.parametrize("topic", ["a", "/", " ", "+", "#", "$share/g/a"])
def test_mqtt_4_7_3_1_require_topic_refuses_only_the_empty_string(topic: str) -> None:
    """MQTT-4.7.3-1: :func:`require_topic`, the check every topic string read off the wire goes through, returns
    any non-empty string unchanged (other rules are checked elsewhere) and raises a Protocol Error (0x82) naming
    the field for an empty one."""
    assert require_topic(topic, "Will Topic") is topic
    with pytest.raises(ProtocolError) as info:
        require_topic("", "Will Topic")
    assert info.value.reason_code == ReasonCode.PROTOCOL_ERROR
    assert "Will Topic" in str(info.value) and "MQTT-4.7.3-1" in str(info.value)


@pytest.mark.parametrize("topic", ["+", "#", "a/+", "a/#", "sport+", "a#b", "+/x", "a/b/c#"])
def test_mqtt_3_3_2_2_topic_name_with_wildcard_is_invalid(topic: str) -> None:
    """MQTT-3.3.2-2 and MQTT-4.7.0-1 (v311: MQTT-4.7.1-1): no wildcard characters in a Topic Name."""
    error = topic_name_error(topic)
    assert isinstance(error, str)
    assert "wildcard" in error


# ------------------------------------------------------------------------------------------------ Topic Filters

VALID_FILTERS = [
    "#",
    "+",
    "+/+",
    "/+",
    "+/",
    "sport/#",
    "sport/tennis/#",
    "sport/tennis/player1/#",
    "+/tennis/#",
    "sport/+/player1",
    "sport/tennis/+",
    "/",
    "a//b",
    "a/+/+/b",
    "$SYS/#",
    "$SYS/monitor/+",
    "/#",
    "\u00e9/+",
]


@pytest.mark.parametrize("topic_filter", VALID_FILTERS)
def test_valid_topic_filters(topic_filter: str) -> None:
    assert topic_filter_error(topic_filter) is None


@pytest.mark.parametrize(
    "topic_filter", ["sport/tennis#", "sport/#/ranking", "#/a", "a#", "##", "#/", "a/#/#", "a/b#/c"]
)
def test_mqtt_4_7_1_1_hash_must_be_last_and_alone_in_its_level(topic_filter: str) -> None:
    """MQTT-4.7.1-1 (v311: MQTT-4.7.1-2): '#' on its own or after '/', and the last character of the filter."""
    error = topic_filter_error(topic_filter)
    assert isinstance(error, str)
    assert "'#'" in error


@pytest.mark.parametrize("topic_filter", ["sport+", "+a", "a/+b", "a/b+/c", "++", "+/a+"])
def test_mqtt_4_7_1_2_plus_must_occupy_an_entire_level(topic_filter: str) -> None:
    """MQTT-4.7.1-2 (v311: MQTT-4.7.1-3): '+' occupies an entire level of the filter."""
    error = topic_filter_error(topic_filter)
    assert isinstance(error, str)
    assert "'+'" in error


def reference_filter_error(topic_filter: str) -> bool:
    """True when ``topic_filter`` is invalid, straight from the two wildcard rules."""
    if not topic_filter:
        return True
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return True
        if "+" in level and level != "+":
            return True
    return False


filter_text = st.text(st.sampled_from("ab/+#$"), max_size=8)


@settings(max_examples=300, deadline=None)
@given(topic_filter=filter_text)
def test_topic_filter_error_agrees_with_reference(topic_filter: str) -> None:
    assert (topic_filter_error(topic_filter) is not None) == reference_filter_error(topic_filter)


@settings(max_examples=300, deadline=None)
@given(topic=filter_text)
def test_topic_name_error_agrees_with_reference(topic: str) -> None:
    invalid = not topic or "+" in topic or "#" in topic
    assert (topic_name_error(topic) is not None) == invalid


# ------------------------------------------------------------------------------------------------ Shared Subscriptions


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("$share/g/a/b", SharedFilter("g", "a/b")),
        ("$share/group1/#", SharedFilter("group1", "#")),
        ("$share/g/+", SharedFilter("g", "+")),
        ("$share/g/+/x/#", SharedFilter("g", "+/x/#")),
        ("$share/g//", SharedFilter("g", "/")),
        ("$share/$g/$SYS/x", SharedFilter("$g", "$SYS/x")),
    ],
)
def test_parse_shared_valid(topic_filter: str, expected: SharedFilter) -> None:
    result = parse_shared(topic_filter)
    assert result == expected
    assert isinstance(result, SharedFilter)
    assert (result.group, result.topic_filter) == tuple(expected)


@pytest.mark.parametrize("topic_filter", ["a/b", "#", "$share", "$sharex/g/a", "$SHARE/g/a", "share/g/a", "$SYS/#"])
def test_parse_shared_ordinary_filters_return_none(topic_filter: str) -> None:
    assert parse_shared(topic_filter) is None


@pytest.mark.parametrize("topic_filter", ["$share//a", "$share/g+/a", "$share/+/a", "$share/g#/a", "$share/#/a"])
def test_mqtt_4_8_2_1_share_name_must_be_non_empty_without_wildcards(topic_filter: str) -> None:
    """MQTT-4.8.2-1 / MQTT-4.8.2-2: ShareName at least one character, no '/', '+' or '#'."""
    result = parse_shared(topic_filter)
    assert isinstance(result, str)
    assert "ShareName" in result


@pytest.mark.parametrize("topic_filter", ["$share/", "$share/g", "$share/g/"])
def test_mqtt_4_8_2_2_share_name_must_be_followed_by_a_filter(topic_filter: str) -> None:
    """MQTT-4.8.2-2: the ShareName is followed by '/' and a Topic Filter."""
    result = parse_shared(topic_filter)
    assert isinstance(result, str)
    assert result  # an error message, not a parse


@pytest.mark.parametrize("topic_filter", ["$share/g/a#", "$share/g/#/a", "$share/g/a+"])
def test_shared_filter_inner_filter_is_validated(topic_filter: str) -> None:
    result = parse_shared(topic_filter)
    assert isinstance(result, str)
    assert "MQTT-4.7.1" in result


# ------------------------------------------------------------------------------------------------ matching

MATCHES = [
    # MQTT 5.0 §4.7.1.2: '#' matches the parent level and any number of child levels.
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("sport/#", "sport/", True),
    ("sport/tennis/#", "sport", False),
    ("sport/tennis/#", "sports/tennis", False),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("#", "a", True),
    # §4.7.1.3: '+' matches exactly one level, which may be empty.
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+", "a", True),
    ("+", "/finance", False),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+/tennis/#", "sport/tennis/player1", True),
    ("+/tennis/#", "sport/tennis", True),
    # Empty levels are levels: a//b has three.
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    ("a/b", "a//b", False),
    ("+/+/+", "a//b", True),
    ("+/+", "a//b", False),
    ("a/#", "a//b", True),
    ("/", "/", True),
    ("+/+", "/", True),
    ("+", "/", False),
    # Exact levels: no prefix matching, no normalisation [MQTT-4.7.3-4].
    ("a/b", "a/b", True),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("ACCOUNTS", "Accounts", False),
    ("a ", "a", False),
    ("caf\u00e9", "cafe\u0301", False),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), MATCHES)
def test_topic_matches_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("#", "$SYS/monitor/Clients", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("+", "$SYS", False),
        ("+/#", "$SYS/x", False),
        ("$SYS/#", "$SYS/monitor/Clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("$SYS", "$SYS", True),
        ("$SYS/#", "$SYS", True),
        ("a/+", "a/$b", True),  # only a leading '$' on the Topic Name is special
        ("#", "a/$", True),
    ],
)
def test_mqtt_4_7_2_1_dollar_topics_not_matched_by_leading_wildcards(
    topic_filter: str, topic: str, expected: bool
) -> None:
    """MQTT-4.7.2-1: filters starting with '#' or '+' do not match Topic Names beginning with '$'."""
    assert topic_matches(topic_filter, topic) is expected


def test_mqtt_4_7_3_4_no_normalisation_when_matching() -> None:
    """MQTT-4.7.3-4: no normalisation or substitution of characters when matching."""
    assert not topic_matches("caf\u00e9/+", "cafe\u0301/x")
    assert not topic_matches("A/+", "a/x")
    assert topic_matches("\u00e9/\U0001f600", "\u00e9/\U0001f600")


def reference_match(topic_filter: str, topic: str) -> bool:
    """A regular-expression model of MQTT 5.0 §4.7 matching, written independently of the codec."""
    if topic.startswith("$") and topic_filter[0] in "+#":
        return False
    levels = topic_filter.split("/")
    if levels == ["#"]:
        return True
    tail = ""
    if levels[-1] == "#":
        levels = levels[:-1]
        tail = "(?:/.*)?"  # the parent level itself, or any number of child levels
    pattern = "/".join("[^/]*" if level == "+" else re.escape(level) for level in levels) + tail
    return re.fullmatch(pattern, topic, re.DOTALL) is not None


FILTER_LEVELS = ["a", "b", "", "$", "$a", "+", "a.b", "\u00e9"]
TOPIC_LEVELS = ["a", "b", "", "$", "$a", "a.b", "\u00e9", "x"]


@st.composite
def valid_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from(FILTER_LEVELS), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    topic_filter = "/".join(levels)
    return topic_filter or "+"


topic_levels = st.sampled_from(TOPIC_LEVELS)
free_topics = st.lists(topic_levels, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def filter_and_topic(draw: st.DrawFn) -> tuple[str, str]:
    topic_filter = draw(valid_filters())
    if draw(st.booleans()):
        return topic_filter, draw(free_topics)
    # Build a topic from the filter so that matches are common: fill '+' and '#', maybe perturb one level.
    levels: list[str] = []
    for level in topic_filter.split("/"):
        if level == "+":
            levels.append(draw(topic_levels))
        elif level == "#":
            levels.extend(draw(st.lists(topic_levels, max_size=3)))
        else:
            levels.append(level)
    if levels and draw(st.booleans()):
        levels[draw(st.integers(0, len(levels) - 1))] = draw(topic_levels)
    topic = "/".join(levels)
    return topic_filter, topic or "a"


@settings(max_examples=500, deadline=None)
@given(case=filter_and_topic())
def test_topic_matches_agrees_with_regex_reference(case: tuple[str, str]) -> None:
    topic_filter, topic = case
    assert topic_filter_error(topic_filter) is None
    assert topic_name_error(topic) is None
    assert topic_matches(topic_filter, topic) is reference_match(topic_filter, topic)


def test_reference_itself_on_the_spec_examples() -> None:
    """The reference model must agree with the hand-written table, or the property test proves nothing."""
    for topic_filter, topic, expected in MATCHES:
        assert reference_match(topic_filter, topic) is expected, (topic_filter, topic)
    assert reference_match("#", "$SYS/x") is False
    assert reference_match("$SYS/#", "$SYS") is True


topic_set = st.lists(st.text(st.sampled_from("ab/$"), min_size=1, max_size=6), max_size=30)


@settings(max_examples=300, deadline=None)
@given(topics=topic_set, topic_filter=filter_text, changes=topic_set)
def test_mqtt_4_7_retained_matching_agrees_with_topic_matches(
    topics: list[str], topic_filter: str, changes: list[str]
) -> None:
    """RetainedMessages.matching (fast paths for '#' and 'a/b/#', a cached topic order) gives exactly the retained
    messages topic_matches accepts, in topic order, also after topics are added, replaced and cleared."""
    from gateway.broker.message import Message
    from gateway.broker.retained_store import RetainedMessages

    if topic_filter_error(topic_filter) is not None:
        return
    retained = RetainedMessages()
    live: set[str] = set()
    for i, topic in enumerate(topics + changes):
        cleared = i >= len(topics) and i % 2 == 0  # half the changes clear their topic (empty payload)
        retained.set(Message(i + 1, topic, b"" if cleared else b"x", 0, True, {}, 0.0))
        if cleared:
            live.discard(topic)
        else:
            live.add(topic)
        if i == len(topics) - 1 or i == len(topics + changes) - 1:
            got = [m.topic for m in retained.matching(topic_filter)]
            assert got == [t for t in sorted(live) if topic_matches(topic_filter, t)]
