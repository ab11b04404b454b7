"""Topic Names and Topic Filters (MQTT 5.0 §4.7, MQTT 3.1.1 §4.7): validation, matching, shared subscriptions."""

from __future__ import annotations

from typing import Final, NamedTuple

from gateway.mqtt.errors import ProtocolError

#: Why an empty Topic Name or Topic Filter is refused; the one wording of [MQTT-4.7.3-1] in the code base.
EMPTY_TOPIC: Final = "must be at least one character long [MQTT-4.7.3-1]"


def require_topic(topic: str, what: str) -> str:
    """Return ``topic`` if it is at least one character long; otherwise raise :class:`ProtocolError`.

    [MQTT-4.7.3-1]: "All Topic Names and Topic Filters MUST be at least one character long". This is the check
    of that rule for the topic strings read off the wire (PUBLISH Topic Name, SUBSCRIBE and UNSUBSCRIBE Topic
    Filters, Will Topic, Will Response Topic): the codec or the broker calls it and the connection ends, MQTT 5
    with DISCONNECT (or CONNACK) 0x82 Protocol Error, 3.1.1 by closing it (3.1.1 MQTT-4.8.0-1). On the PUBLISH
    hot path callers test ``not topic`` first and call it only to raise; a PUBLISH Response Topic is checked by
    :func:`topic_name_error` (same rule, same words), in the one pass the broker already makes over it.

    Args:
        topic: the decoded string.
        what: what it is, for the error message (``"UNSUBSCRIBE Topic Filter"``).
    """
    if not topic:
        raise ProtocolError(f"{what} is empty: Topic Names and Topic Filters {EMPTY_TOPIC}")
    return topic


def topic_name_error(topic: str) -> str | None:
    """Why ``topic`` is not a valid Topic Name to publish to, or ``None`` when it is.

    A Topic Name is at least one character [MQTT-4.7.3-1] and holds no wildcard [MQTT-3.3.2-2].
    """
    if not topic:
        return "a Topic Name " + EMPTY_TOPIC
    if "+" in topic or "#" in topic:
        return "a Topic Name must not contain wildcard characters [MQTT-3.3.2-2]"
    return None


def topic_filter_error(topic_filter: str) -> str | None:
    """Why ``topic_filter`` is not a valid Topic Filter, or ``None`` when it is.

    ``#`` must be alone in the last level [MQTT-4.7.1-2]; ``+`` must fill a whole level [MQTT-4.7.1-3];
    a filter is at least one character [MQTT-4.7.3-1].
    """
    if not topic_filter:
        return "a Topic Filter " + EMPTY_TOPIC
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            return "'#' must be the last character and alone in its level [MQTT-4.7.1-2]"
        if "+" in level and level != "+":
            return "'+' must occupy an entire level of the filter [MQTT-4.7.1-3]"
    return None


class SharedFilter(NamedTuple):
    """A parsed ``$share/<ShareName>/<filter>`` (MQTT 5.0 §4.8.2)."""

    group: str
    topic_filter: str


def parse_shared(topic_filter: str) -> SharedFilter | str | None:
    """Split a Shared Subscription filter.

    Returns:
        ``None`` for an ordinary filter, a :class:`SharedFilter`, or an error string when it starts with
        ``$share/`` but breaks [MQTT-4.8.2-1] (ShareName at least one character, no ``/``, ``+`` or ``#``)
        or [MQTT-4.8.2-2] (a filter must follow).
    """
    if not topic_filter.startswith("$share/"):
        return None
    rest = topic_filter[7:]
    group, sep, inner = rest.partition("/")
    if not group or "+" in group or "#" in group:
        return "ShareName must be at least one character and hold no '/', '+' or '#' [MQTT-4.8.2-1]"
    if not sep or not inner:
        return "a Shared Subscription needs a Topic Filter after the ShareName [MQTT-4.8.2-2]"
    error = topic_filter_error(inner)
    if error:
        return error
    return SharedFilter(group, inner)


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter`` (MQTT 5.0 §4.7).

    Topics starting with ``$`` are not matched by a filter that starts with a wildcard [MQTT-4.7.2-1].
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)
