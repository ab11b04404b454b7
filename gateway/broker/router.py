"""The routing of one Application Message: upstream forwarders, the retained message, then every matching
subscription (MQTT 5.0 §4.7): one copy per client at the highest QoS of its overlapping subscriptions with all
their Subscription Identifiers [MQTT-3.3.4-2] [MQTT-3.3.4-3], No Local [MQTT-3.8.3-3], one member per shared
group, round robin, online members first (MQTT 5.0 §4.8.2). Delivered QoS = min(publish QoS, subscription QoS)
(MQTT 5.0 §3.8.4). The subscription tree and the retained store themselves are in
:mod:`gateway.broker.subscription_tree`.
"""

from __future__ import annotations

from typing import Any

from gateway.broker.access_decisions import may_read
from gateway.broker.delivery import deliver
from gateway.broker.message import NO_IDS, Message
from gateway.broker.state import BrokerState
from gateway.broker.subscription_tree import SharedGroup, SubscriptionRecord


def publish(core: BrokerState, message: Message, now: float) -> int:
    """Route ``message`` to every matching subscription and upstream forwarder; return how many took it."""
    count = 0
    if core.forwarders and message.sender is not None:
        for forward in core.forwarders:
            if forward(message, now):
                count += 1
    if message.retain:
        retain(core, message)
    subs, groups = core.tree.match(message.topic)
    if not subs and not groups:
        if not count and not message.retain and message.sender is not None:
            core.stats.dropped["no_subscribers"] += 1  # EMQX's messages.dropped.no_subscribers
        return count
    sessions = core.sessions
    # An acl_file exists: subscriptions decided PARTIAL check read (gateway/broker/access_decisions.py).
    if core.read_checks:
        if len(subs) == 1:  # the common case, without a new list: a set look-up when decided ALL
            rec = subs[0]
            session = sessions[rec.client_id]
            if rec.key in session.partial and not may_read(session, rec.key, message.topic):
                subs = []
        else:
            subs = [r for r in subs if may_read(sessions[r.client_id], r.key, message.topic)]
        if not subs and not groups:
            return count
    sender = message.sender
    if len(subs) == 1 and not groups:
        rec = subs[0]
        if rec.no_local and rec.client_id == sender:
            return count
        deliver(
            core,
            sessions[rec.client_id],
            message,
            min(message.qos, rec.qos),
            message.retain and rec.retain_as_published,
            [rec.sub_id] if rec.sub_id is not None else NO_IDS,
            now,
        )
        return count + 1
    # Overlapping subscriptions of one client: one copy at the highest QoS, carrying every matching
    # Subscription Identifier [MQTT-3.3.4-2] [MQTT-3.3.4-3].
    targets: dict[str, list[Any]] = {}
    for rec in subs:
        if rec.no_local and rec.client_id == sender:
            continue  # No Local [MQTT-3.8.3-3]
        target = targets.get(rec.client_id)
        if target is None:
            targets[rec.client_id] = [
                rec.qos,
                rec.retain_as_published,
                [rec.sub_id] if rec.sub_id is not None else [],
            ]
        else:
            if rec.qos > target[0]:
                target[0] = rec.qos
            target[1] = target[1] or rec.retain_as_published
            if rec.sub_id is not None:
                target[2].append(rec.sub_id)
    for client_id, (qos, rap, sub_ids) in targets.items():
        deliver(core, sessions[client_id], message, min(message.qos, qos), message.retain and rap, sub_ids, now)
        count += 1
    for group in groups:
        picked = _pick_shared(core, group)
        if picked is None or (
            core.read_checks and not may_read(sessions[picked.client_id], picked.key, message.topic)
        ):
            continue
        deliver(
            core,
            sessions[picked.client_id],
            message,
            min(message.qos, picked.qos),
            False,
            [picked.sub_id] if picked.sub_id is not None else NO_IDS,
            now,
        )
        count += 1
    return count


def _pick_shared(core: BrokerState, group: SharedGroup) -> SubscriptionRecord | None:
    """Round robin over a shared group's members, online ones first (MQTT 5.0 §4.8.2)."""
    members = list(group.members.values())
    if not members:
        return None
    n = len(members)
    start = group.cursor % n
    for i in range(n):
        rec = members[(start + i) % n]
        session = core.sessions.get(rec.client_id)
        if session is not None and session.conn is not None:
            group.cursor = start + i + 1
            return rec
    group.cursor = start + 1
    return members[start]


def retain(core: BrokerState, message: Message) -> None:
    """Make ``message`` its topic's retained message (an empty payload clears it, MQTT 5.0 §3.3.1.3)."""
    settings = core.settings
    if not settings.retain_available:
        return
    if message.payload and not message.topic.startswith("$SYS/"):
        # A client's PUBLISH was checked already (inbound.py refuses or un-retains it); Wills and the upstream
        # downlink are only not retained past the limit, and counted.
        limit = core.retained.refusal(message.topic, message.payload, settings.max_retained_messages,
                                      settings.max_retained_bytes)
        if limit is not None:
            core.stats.refused[limit] += 1
            return
    core.retained.set(message)
    if message.topic.startswith("$SYS/"):
        return
    if message.payload and (message.qos or core.store.has_room(None)):
        core.store.retained_saved(message)
    else:
        # Cleared, or a QoS 0 retained message while the store is full: it must not overflow the store (QoS 0
        # is never refused), so it is kept in memory only and the stale one on disk is removed (a restart must
        # not bring it back).
        core.store.retained_deleted(message.topic)


def sweep_retained(core: BrokerState, now: float) -> None:
    """Forget the retained messages whose Message Expiry Interval passed."""
    for message in core.retained.all():
        if message.expired(now):
            core.retained.remove(message.topic)
            core.store.retained_deleted(message.topic)
            core.stats.dropped["retained_expired"] += 1
