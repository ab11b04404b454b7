"""SUBSCRIBE and UNSUBSCRIBE (MQTT 5.0 §3.8-3.11): Topic Filter checks, shared subscriptions (MQTT 5.0 §4.8.2),
``max_subscriptions`` and ``max_topic_levels``, the SUBACK once the subscriptions are durable, then the retained
messages per Retain Handling (never for shared ones, MQTT 5.0 §3.8.4)."""

from __future__ import annotations

from gateway.broker.access_decisions import decide, may_read
from gateway.broker.barriers import ACK_SUBACK, ACK_UNSUBACK, hold
from gateway.broker.connection_states import CONNECTED
from gateway.broker.delivery import deliver
from gateway.broker.limits import topic_limit_error
from gateway.broker.output import send
from gateway.broker.ratelog import peer_host
from gateway.broker.reasons import suback_failure
from gateway.broker.session_state import NO_QUEUE, Connection, Session, partial_for_write
from gateway.broker.state import BrokerState
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.errors import ProtocolError
from gateway.mqtt.packets import MQTT_5, Suback, Subscribe, Unsuback, Unsubscribe
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC
from gateway.mqtt.topics import parse_shared, topic_filter_error


def on_subscribe(core: BrokerState, conn: Connection, p: Subscribe, now: float) -> None:
    """SUBSCRIBE ``p`` from ``conn``'s client (``CONNECTED``), at ``now`` (wall-clock seconds). Statements: MQTT
    5.0's numbering.

    Each Topic Filter is checked (syntax, ``max_topic_levels``/``max_topic_length`` 0x8F, ``max_subscriptions``
    0x97, the read ACL decided once: NONE 0x87, ALL, or PARTIAL checked per message; shared subscriptions with
    No Local are a Protocol Error [MQTT-3.8.3-4]) and added or replaced [MQTT-3.8.4-3] with the Subscription
    Identifier of the packet [MQTT-3.8.2.1.2]. Output: a SUBACK with one code per filter in order [MQTT-3.8.4-6]
    once the subscriptions are durable (persistent session), then the retained messages each new subscription
    gets under its Retain Handling [MQTT-3.3.1-9] [MQTT-3.3.1-10] [MQTT-3.8.4-4].
    """
    session = conn.session
    assert session is not None
    # A Subscription Identifier (5.0) applies to every filter of this SUBSCRIBE [MQTT-3.8.2.1.2].
    ids = p.properties.get(P.SUBSCRIPTION_IDENTIFIER) if conn.version == MQTT_5 else None
    sub_id = ids[0] if ids else None
    codes: list[int] = []
    retained: list[SubscriptionRecord] = []
    limits = conn.limits
    for sub in p.subscriptions:
        shared = parse_shared(sub.topic_filter)
        if isinstance(shared, str):
            error: str | None = shared
            inner, group = sub.topic_filter, None
        elif shared is None:
            inner, group = sub.topic_filter, None
            error = topic_filter_error(inner)
        else:
            inner, group = shared.topic_filter, shared.group
            error = None
            if sub.no_local:
                raise ProtocolError("No Local on a Shared Subscription [MQTT-3.8.3-4]")
        if not error and (limited := topic_limit_error(inner, limits)):
            core.stats.refused[limited[0]] += 1
            error = limited[1]
        if error:
            core.rlog.info(
                now,
                peer_host(conn.peer),
                "subscribe_refused",
                "%s (%s): SUBSCRIBE %r refused: %s",
                conn.peer,
                conn.client_id,
                sub.topic_filter[:200],
                error,
            )
            codes.append(suback_failure(conn.version, RC.TOPIC_FILTER_INVALID))
            continue
        if (
            limits.max_subscriptions
            and len(session.subscriptions) >= limits.max_subscriptions
            and sub.topic_filter not in session.subscriptions
        ):
            core.stats.refused["max_subscriptions"] += 1
            core.rlog.warning(
                now,
                peer_host(conn.peer),
                "max_subscriptions",
                "%s (%s): SUBSCRIBE %r refused: max_subscriptions = %d reached (0x97)",
                conn.peer,
                conn.client_id,
                sub.topic_filter[:200],
                limits.max_subscriptions,
            )
            codes.append(suback_failure(conn.version, RC.QUOTA_EXCEEDED))
            continue
        # Decided once per subscription: NONE refused, ALL never checked again, PARTIAL per message.
        readable = decide(session.acl, inner)
        if readable == "none":
            core.stats.refused["acl_subscribe"] += 1
            core.rlog.info(now, peer_host(conn.peer), "subscribe_not_authorized",
                           "%s (%s): SUBSCRIBE %r refused: no topic it matches is readable (acl_file)", conn.peer,
                           conn.client_id, sub.topic_filter[:200])
            codes.append(suback_failure(conn.version, RC.NOT_AUTHORIZED))
            continue
        record = SubscriptionRecord(
            session.client_id, inner, sub.qos, sub.no_local, sub.retain_as_published, sub.retain_handling, sub_id, group
        )
        if session.mqueue is NO_QUEUE:
            _start_receiving(core, session)
        existed = core.tree.add(record)
        subscriptions = session.subscriptions
        assert isinstance(subscriptions, dict)  # made by Session.start_receiving
        subscriptions[record.key] = record
        if readable == "all":
            if record.key in session.partial:
                partial_for_write(session).discard(record.key)
        else:
            partial_for_write(session).add(record.key)
        if session.persistent:
            core.store.subscription_saved(session.client_id, record)
        codes.append(sub.qos)
        # Retained messages on subscribe per Retain Handling; never for shared ones (MQTT 5.0 §3.8.4).
        if group is None and (record.retain_handling == 0 or (record.retain_handling == 1 and not existed)):
            retained.append(record)
    suback = Suback(p.packet_id, codes)
    if hold(core, ACK_SUBACK, conn, suback, retained):
        subscribed(core, conn, suback, retained, now)


def subscribed(core: BrokerState, conn: Connection, suback: Suback, retained: list[SubscriptionRecord],
               now: float) -> None:
    """The subscriptions of a SUBSCRIBE are durable: ``suback``, then the retained messages matching each of the
    subscriptions in ``retained`` (those whose Retain Handling asks for them), if the client is still there."""
    session = conn.session
    if conn.state != CONNECTED or session is None:
        return
    send(core, conn, suback)
    for record in retained:
        for message in core.retained.matching(record.topic_filter):
            if message.expired(now) or not may_read(session, record.key, message.topic):
                continue  # retained messages obey read too
            # A retained message sent because of a new subscription has RETAIN=1 [MQTT-3.3.1-8].
            ids = [record.sub_id] if record.sub_id is not None else []
            deliver(core, session, message, min(message.qos, record.qos), True, ids, now)


def _start_receiving(core: BrokerState, session: Session) -> None:
    """A session's first subscription: its own subscriptions, Inflight Window and Message Queue, the queue paged
    through the store when the session is persistent (:meth:`Session.start_receiving`)."""
    paging = core.store.pager(session.client_id) if session.persistent else None
    if paging is None:
        session.start_receiving()
    else:
        session.start_receiving(*paging)


def _unsubscribe_filter_error(topic_filter: str) -> str | None:
    """Why ``topic_filter`` in an UNSUBSCRIBE is not a valid Topic Filter (MQTT 5.0 §4.7.1, §4.8.2: the rules a
    SUBSCRIBE's filter is refused by), or ``None``. The limits a SUBSCRIBE also applies (``max_topic_levels``,
    ``max_topic_length``) are left out: a subscription made before they were lowered can still be removed."""
    shared = parse_shared(topic_filter)
    if shared is None:
        return topic_filter_error(topic_filter)
    return shared if isinstance(shared, str) else None


def on_unsubscribe(core: BrokerState, conn: Connection, p: Unsubscribe, now: float) -> None:
    """UNSUBSCRIBE: per Topic Filter, in order, 0x00 Success (the subscription is deleted), 0x11 No subscription
    existed, or 0x8F Topic Filter invalid for a filter no SUBSCRIBE could have made (MQTT 5.0 §3.11.3, as SUBACK
    refuses it; the connection stays); one UNSUBACK once the deletions are durable [MQTT-3.10.4-4]. A 3.1.1
    UNSUBACK carries no codes (MQTT 3.1.1 §3.11), so there an invalid filter is only logged."""
    session = conn.session
    assert session is not None
    codes: list[int] = []
    subscriptions = session.subscriptions
    for topic_filter in p.topic_filters:
        record = subscriptions.get(topic_filter)
        if topic_filter in session.partial:
            partial_for_write(session).discard(topic_filter)
        if record is None:
            # Checked only when nothing matched: a filter that is subscribed was valid when it was made.
            error = _unsubscribe_filter_error(topic_filter)
            if error:
                core.rlog.info(now, peer_host(conn.peer), "unsubscribe_invalid",
                               "%s (%s): UNSUBSCRIBE %r: invalid Topic Filter (0x8F): %s", conn.peer,
                               conn.client_id, topic_filter[:200], error)
                codes.append(RC.TOPIC_FILTER_INVALID)
            else:
                codes.append(RC.NO_SUBSCRIPTION_EXISTED)
            continue
        assert isinstance(subscriptions, dict)  # it holds the record
        del subscriptions[topic_filter]
        core.tree.remove(session.client_id, record.topic_filter, record.share_group)
        if session.persistent:
            core.store.subscription_deleted(session.client_id, topic_filter)
        codes.append(RC.SUCCESS)
    unsuback = Unsuback(p.packet_id, codes)
    if hold(core, ACK_UNSUBACK, conn, unsuback):
        send(core, conn, unsuback)
