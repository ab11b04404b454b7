"""Sessions outliving connections (MQTT 5.0 §4.1; offline messages: docs/architecture.md, "Session semantics"):
closing a connection, keeping its session offline (persistent) or ending it (clean), Will Messages (delayed or
not), and session expiry.

A persistent session (3.1.1 Clean Session 0, 5.0 Session Expiry Interval > 0) keeps its subscriptions, Message
Queue and Inflight Window while its client is away, for at most its Session Expiry Interval; Clean Start, expiry
or a clean session's disconnect discard it and everything in it.
"""

from __future__ import annotations

import logging
from typing import Final

from gateway.broker.actions import CLOSE
from gateway.broker.connection_states import CLOSED
from gateway.broker.message import Message
from gateway.broker.router import publish
from gateway.broker.session_state import NEVER, Connection, Session
from gateway.broker.state import BrokerState
from gateway.mqtt.packets import MQTT_5, Will
from gateway.mqtt.properties import PropertyId as P

log: Final = logging.getLogger("gateway.broker")


def close(core: BrokerState, conn: Connection, now: float, publish_will: bool, reason: str = "closed by the broker",
          how: int = CLOSE) -> None:
    """Close ``conn`` (``how``: :data:`~gateway.broker.actions.CLOSE` once its output is written, or ``ABORT`` at
    once; ``reason`` for the I/O layer's log); detach its session."""
    if conn.state == CLOSED:
        return
    conn.move_to(CLOSED)
    conn.closing = how
    conn.close_reason = reason
    core.dirty.add(conn)
    detach(core, conn, now, publish_will)


def detach(core: BrokerState, conn: Connection, now: float, publish_will: bool) -> None:
    """The connection is gone: keep the session offline (persistent) or end it; handle the Will."""
    core.connections.pop(conn, None)
    core.deadlines.unschedule(conn)
    session = conn.session
    will = conn.take_will()
    if session is None or session.conn is not conn:
        return
    session.conn = None
    core.congested.discard(session)
    core.stats.clients_connected -= 1
    core.listener_clients[conn.listener] -= 1
    delay = 0
    if will is not None and publish_will and conn.version == MQTT_5:
        delay = will.properties.get(P.WILL_DELAY_INTERVAL, 0)
    if not session.persistent:
        if will is not None and publish_will:
            publish_will_message(core, will, session.client_id, now)
        end_session(core, session, now)
        return
    session.expires_at = None if session.expiry_interval == NEVER else now + session.expiry_interval
    core.offline.add(session)
    session.mqueue.hold_in_memory(False)  # what arrives while it is away waits in the store, not in memory
    core.store.session_saved(session)  # the offline deadline survives a restart
    if will is not None and publish_will:
        if delay:
            # Due when the delay passes or the session ends, whichever is first (end_session publishes it);
            # a reconnection before then cancels it [MQTT-3.1.3-9].
            session.will = will
            session.will_at = now + delay
            core.wills.add(session)
            core.store.session_saved(session)
        else:
            publish_will_message(core, will, session.client_id, now)


def publish_will_message(core: BrokerState, will: Will, client_id: str, now: float) -> None:
    """Publish a Will Message (MQTT 5.0 §3.1.2.5) as if the client had sent it."""
    props = {k: v for k, v in will.properties.items() if k != P.WILL_DELAY_INTERVAL}
    expires_at = None
    if P.MESSAGE_EXPIRY_INTERVAL in props:
        expires_at = now + props[P.MESSAGE_EXPIRY_INTERVAL]
    log.info("publishing the Will Message of %r to %r", client_id, will.topic)
    message = Message(
        core.new_mid(), will.topic, will.payload, will.qos, will.retain, props, now, expires_at, client_id
    )
    publish(core, message, now)


def end_session(core: BrokerState, session: Session, now: float) -> None:
    """Discard a session and everything in it (Clean Start, expiry, or a clean session's disconnect)."""
    if core.sessions.get(session.client_id) is session:
        del core.sessions[session.client_id]
        core.persistent_count -= session.persistent
    if session.will is not None:
        # The session ends before the Will Delay Interval passed: publish now (MQTT 5.0 §3.1.3.2.2).
        will = session.will
        session.will = None
        publish_will_message(core, will, session.client_id, now)
    core.wills.discard(session)
    core.offline.discard(session)
    for record in session.subscriptions.values():
        core.tree.remove(session.client_id, record.topic_filter, record.share_group)
    if session.persistent or session.expires_at is not None:
        core.store.session_deleted(session.client_id)
    dropped = len(session.mqueue) + len(session.inflight)
    if dropped:
        core.stats.dropped["session_ended"] += dropped


def expire(core: BrokerState, now: float) -> None:
    """Publish the delayed Wills that are due and end the offline sessions whose Session Expiry Interval passed
    (their offline messages go with them [MQTT-4.1.0-2])."""
    for session in list(core.wills):
        if session.will_at is not None and now >= session.will_at:
            will = session.will
            session.will = None
            session.will_at = None
            core.wills.discard(session)
            if will is not None:
                publish_will_message(core, will, session.client_id, now)
    for session in list(core.offline):
        if session.expires_at is not None and now >= session.expires_at:
            expire_session(core, session, now)


def expire_session(core: BrokerState, session: Session, now: float) -> None:
    """An offline session's Session Expiry Interval passed: its state is gone [MQTT-4.1.0-2]."""
    log.info("session %r expired", session.client_id)
    core.stats.dropped["session_expired"] += 1
    end_session(core, session, now)
