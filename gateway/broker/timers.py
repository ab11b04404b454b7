"""Deadlines, run by :meth:`Broker.tick` about once a second with the time given: CONNECT timeout, Keep Alive
(1.5x, [MQTT-3.1.2-24] 3.1.1 / [MQTT-3.1.2-22] 5.0), ``send_timeout``, the 3.1.1 ``retry_interval``,
``await_rel_timeout``, congestion that ends, delayed Wills, session expiry, and every few seconds the sweep of
expired offline messages and retained messages [MQTT-3.3.2-5]."""

from __future__ import annotations

import logging

from gateway.broker.actions import ABORT
from gateway.broker.connection_states import AWAITING_CONNECT, CLOSED, CONNECTED
from gateway.broker.deadlines import next_check
from gateway.broker.delivery import STALLED_AFTER, sweep_expired
from gateway.broker.inflight import resend
from gateway.broker.output import send
from gateway.broker.qos2 import expire_awaiting_rel
from gateway.broker.ratelog import peer_host
from gateway.broker.reasons import disconnect
from gateway.broker.router import sweep_retained
from gateway.broker.session_lifecycle import close, expire
from gateway.broker.session_state import Connection
from gateway.broker.state import BrokerState
from gateway.mqtt.packets import MQTT_5
from gateway.mqtt.reason_codes import ReasonCode as RC

log = logging.getLogger("gateway.broker")

#: Seconds between two sweeps of expired offline and retained messages.
SWEEP_INTERVAL = 5.0


def run(core: BrokerState, now: float) -> None:
    """Run every deadline that has passed: the connections the Deadline Index has due (not every connection:
    :mod:`gateway.broker.deadlines`), then congestion, Wills, session expiry and the periodic sweep."""
    deadlines = core.deadlines
    for conn in deadlines.due(now):
        check(core, conn, now)
        if conn.state != CLOSED:
            deadlines.refile(conn, next_check(conn, now))
    for session in list(core.congested):
        if session.conn is None or now - session.conn.last_ack_at >= STALLED_AFTER:
            # A consumer that stopped acknowledging does not hold publishers back: its queue fills and
            # drops by the Message Queue policy instead.
            core.congested.discard(session)
    expire(core, now)
    if now >= core.next_sweep:
        core.next_sweep = now + SWEEP_INTERVAL
        for session in core.offline:
            if session.mqueue:
                sweep_expired(core, session, now)
                expire_awaiting_rel(core, session, now)
        sweep_retained(core, now)


def check(core: BrokerState, conn: Connection, now: float) -> None:
    """One connection's deadlines: CONNECT timeout, ``send_timeout``, Keep Alive, the 3.1.1 ``retry_interval``
    and ``await_rel_timeout``; closes the connection when one has passed."""
    limits = conn.limits
    if conn.state == AWAITING_CONNECT:
        if now - conn.opened_at >= limits.connect_timeout:
            log.info("%s: no CONNECT within %.0f s; closing", conn.peer, limits.connect_timeout)
            close(core, conn, now, publish_will=False, reason="no CONNECT within connect_timeout")
        return
    if conn.state != CONNECTED:
        return
    if conn.paused and limits.send_timeout and now - conn.paused_at >= limits.send_timeout:
        # Its socket has not drained for send_timeout: a client that stopped reading. Closed without
        # writing more (nothing can be written); a persistent session keeps its queue.
        core.stats.refused["send_timeout"] += 1
        core.rlog.warning(
            now,
            peer_host(conn.peer),
            "send_timeout",
            "%s (%s): nothing written for send_timeout = %.0f s (the client does not read); closing",
            conn.peer,
            conn.client_id,
            limits.send_timeout,
        )
        close(core, conn, now, publish_will=True, reason="send_timeout: the client does not read", how=ABORT)
        return
    if conn.keep_alive and now - max(conn.last_rx, conn.paused_until) >= 1.5 * conn.keep_alive:
        # [MQTT-3.1.2-24] (3.1.1) / [MQTT-3.1.2-22] (5.0): one and a half times the Keep Alive.
        log.info("%s (%s): Keep Alive of %d s expired; closing", conn.peer, conn.client_id, conn.keep_alive)
        packet = disconnect(conn.version, RC.KEEP_ALIVE_TIMEOUT)
        if packet is not None:
            send(core, conn, packet)
        close(core, conn, now, publish_will=True, reason="Keep Alive expired")
        return
    session = conn.session
    if session is None:
        return
    if limits.retry_interval and conn.version != MQTT_5 and session.inflight:
        resend(core, session, conn, now, older_than=limits.retry_interval)
    expire_awaiting_rel(core, session, now)
