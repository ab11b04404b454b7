"""The Inflight Window: QoS 1/2 messages sent to a client and not yet acknowledged (docs/architecture.md,
"Session semantics").

Its length is ``Connection.window``: ``max_inflight`` capped by an MQTT 5 client's Receive Maximum
(:meth:`~gateway.broker.limits.ZoneLimits.window`). A message enters with a fresh Packet Identifier
[MQTT-2.2.1-2]; PUBACK (QoS 1) or PUBREC/PUBREL/PUBCOMP (QoS 2) end it, and every freed slot takes the next
message from the Message Queue in FIFO order (:func:`pump`). What is unacknowledged is re-sent with DUP=1 on
reconnect (MQTT 5: only then [MQTT-4.4.0-1]) and, for 3.1.1, after ``retry_interval`` (:func:`resend`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Final

from gateway.broker.barriers import ACK_PUBREL, ACK_SEND, ACK_SEND_QOS0, hold
from gateway.broker.connection_states import CONNECTED
from gateway.broker.message import AWAIT_COMP, Delivery
from gateway.broker.output import PUBREL_BYTE, send, send_ack, write_publish
from gateway.broker.reasons import unknown_packet_id
from gateway.broker.session_state import Connection, Session
from gateway.broker.state import BrokerState
from gateway.mqtt.packets import PACKET_NAMES, PUBACK, PubAck, PubComp, PubRec, PubRel

log: Final = logging.getLogger("gateway.broker")

#: Acknowledgements of one run handled before the messages they let into the window are written out: a long
#: run of PUBACKs is handled in parts of this many, and the I/O layer writes between parts (Broker.resume), so
#: the client works on the first messages that refilled its window while the broker prepares the rest.
ACK_RUN_PART: Final = 8


def send_new(core: BrokerState, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
    """Put ``delivery`` into the Inflight Window with a fresh Packet Identifier and send it.

    For a persistent session the Packet Identifier is recorded first; a QoS 2 PUBLISH goes out only once
    that is durable, so that after a crash the same identifier is re-sent and the receiver can recognise
    the duplicate (exactly once end to end)."""
    inflight = session.inflight
    pid = session.next_packet_id
    if pid in inflight:
        pid = session.allocate_packet_id()
    else:
        session.next_packet_id = pid % 65535 + 1  # allocate_packet_id's answer, without the call
    delivery.packet_id = pid
    delivery.sent_at = now
    assert isinstance(inflight, dict)  # a session that is sent to can receive (Session.start_receiving)
    inflight[pid] = delivery
    if session.persistent:
        core.store.delivery_saved(session.client_id, delivery)  # in flight, to re-send with DUP=1
        # QoS 2 waits for that record; anything behind a held send waits too (the window delivers in order). A
        # QoS 1 PUBLISH otherwise goes out at once: re-sent after a crash, it is a duplicate QoS 1 allows. Also sent
        # when the commit fails (a full disk): the subscriber is served meanwhile; what is lost is only that a
        # crash before the next commit may re-send this QoS 2 PUBLISH under a new identifier.
        if (delivery.qos == 2 or session.held_sends) and not hold(core, ACK_SEND, conn, session, delivery):
            session.held_sends += 1
            return
    if not write_publish(
        core, conn, delivery.message, delivery.qos, delivery.retain, pid, False, delivery.sub_ids, now
    ):
        finish(core, session, delivery)


def send_held(core: BrokerState, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
    """A PUBLISH held until its Packet Identifier was recorded (:func:`send_new`): send it now, if it is still in
    the window of this connection."""
    session.held_sends -= 1
    if conn.state != CONNECTED or session.inflight.get(delivery.packet_id) is not delivery:
        return
    if not write_publish(
        core, conn, delivery.message, delivery.qos, delivery.retain, delivery.packet_id, False, delivery.sub_ids, now
    ):
        finish(core, session, delivery)


def send_held_qos0(core: BrokerState, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
    """A QoS 0 PUBLISH queued behind a held send (:func:`pump`): send it now."""
    session.held_sends -= 1
    if conn.state == CONNECTED:
        write_publish(core, conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)


def pump(core: BrokerState, session: Session, now: float) -> None:
    """Move queued messages into the Inflight Window while it has room, FIFO. Deliveries of the
    window not yet re-sent on this connection (:attr:`Session.unsent`) go first, so that no more than the
    window's length is ever unacknowledged on the connection [MQTT-3.3.4-9]."""
    conn = session.conn
    if conn is None:
        return
    if session.unsent:
        _resend_unsent(core, session, conn, now)
    mqueue = session.mqueue
    inflight = session.inflight
    window = conn.window
    persistent = session.persistent
    store = core.store
    while mqueue and len(inflight) < window and not conn.paused:
        delivery = mqueue.pop()
        if delivery.expires_at is not None and now >= delivery.expires_at:
            core.stats.dropped["expired"] += 1
            if persistent:
                store.delivery_deleted(session.client_id, delivery)
            continue
        if delivery.qos == 0:
            if persistent and session.held_sends:
                # Behind a QoS 2 PUBLISH still waiting for its commit (the window delivers in order).
                if hold(core, ACK_SEND_QOS0, conn, session, delivery):
                    write_publish(core, conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)
                else:
                    session.held_sends += 1
                store.delivery_deleted(session.client_id, delivery)
            elif persistent:
                write_publish(core, conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)
                store.delivery_deleted(session.client_id, delivery)
            else:
                write_publish(core, conn, delivery.message, 0, delivery.retain, 0, False, delivery.sub_ids, now)
            continue
        send_new(core, session, conn, delivery, now)
    if session in core.congested and len(mqueue) <= window:
        core.congested.discard(session)


def finish(core: BrokerState, session: Session, delivery: Delivery) -> None:
    """A delivery left the Inflight Window for good (acknowledged, refused or undeliverable)."""
    inflight = session.inflight
    assert isinstance(inflight, dict)  # it held the delivery
    inflight.pop(delivery.packet_id, None)
    if session.persistent:
        core.store.delivery_deleted(session.client_id, delivery)


def resend(core: BrokerState, session: Session, conn: Connection, now: float, older_than: float = 0.0) -> None:
    """Re-send, in order, what the window holds: PUBLISH with DUP=1, or PUBREL for a QoS 2 message whose PUBREC
    arrived. A PUBLISH over the client's Maximum Packet Size leaves the window.

    On reconnect (``older_than`` 0) [MQTT-4.4.0-1]: at most ``conn.window`` deliveries, oldest first; when the
    resumed client's Receive Maximum is smaller than what is in flight, the rest wait in :attr:`Session.unsent`
    and go out, with their Packet Identifiers, as acknowledgements free slots (:func:`pump`) [MQTT-3.3.4-9].
    For 3.1.1 after ``retry_interval`` seconds: what was sent at least ``older_than`` seconds ago."""
    if not older_than:
        session.unsent = ()
        window = conn.window
        for delivery in list(session.inflight.values()):
            if window > 0:
                window -= 1
                _resend_one(core, session, conn, delivery, now)
            else:
                if not session.unsent:
                    session.unsent = deque()
                session.unsent.append(delivery)
        return
    held = {id(d) for d in session.unsent}
    for delivery in list(session.inflight.values()):
        if now - delivery.sent_at < older_than or id(delivery) in held:
            continue
        _resend_one(core, session, conn, delivery, now)


def _resend_one(core: BrokerState, session: Session, conn: Connection, delivery: Delivery, now: float) -> None:
    delivery.sent_at = now
    if delivery.state == AWAIT_COMP:
        send_ack(core, conn, PUBREL_BYTE, delivery.packet_id)
    elif not write_publish(
        core, conn, delivery.message, delivery.qos, delivery.retain, delivery.packet_id, True, delivery.sub_ids, now
    ):
        finish(core, session, delivery)


def _resend_unsent(core: BrokerState, session: Session, conn: Connection, now: float) -> None:
    """Re-send waiting deliveries of the window while fewer than ``conn.window`` are unacknowledged on ``conn``.
    One the client acknowledged meanwhile (it had it from the previous connection) is passed over."""
    inflight = session.inflight
    unsent = session.unsent
    assert isinstance(unsent, deque)  # pump calls this only while it holds any
    live = [d for d in unsent if inflight.get(d.packet_id) is d]
    if len(live) != len(unsent):
        unsent.clear()
        unsent.extend(live)
    while unsent and len(inflight) - len(unsent) < conn.window:
        _resend_one(core, session, conn, unsent.popleft(), now)
    if not unsent and session.unsent is unsent:
        session.unsent = ()


# ------------------------------------------------------------------------------------------ acknowledgements


def on_completion(core: BrokerState, conn: Connection, p: PubAck | PubComp, now: float) -> None:
    """PUBACK ends a QoS 1 delivery, PUBCOMP a QoS 2 delivery whose PUBREC arrived; the freed slot is refilled."""
    conn.last_ack_at = now
    session = conn.session
    assert session is not None
    delivery = session.inflight.get(p.packet_id)
    if delivery is None or (delivery.qos != 1 if p.TYPE == PUBACK else delivery.state != AWAIT_COMP):
        log.debug("%s: %s for unknown Packet Identifier %d", conn.client_id, PACKET_NAMES[p.TYPE], p.packet_id)
        return
    finish(core, session, delivery)
    pump(core, session, now)


def on_pubacks(core: BrokerState, conn: Connection, pids: list[int], now: float) -> None:
    """A part of a run of plain PUBACKs (Reason Code 0) read in one go (at most :data:`ACK_RUN_PART`): each
    ends its QoS 1 delivery as :func:`on_completion` does, then the window is refilled once (FIFO)."""
    conn.last_ack_at = now
    session = conn.session
    assert session is not None
    inflight = session.inflight
    done: list[Delivery] = []
    for pid in pids:
        delivery = inflight.get(pid)
        if delivery is None or delivery.qos != 1:
            log.debug("%s: PUBACK for unknown Packet Identifier %d", conn.client_id, pid)
            continue
        assert isinstance(inflight, dict)  # it holds a delivery: not the empty stand-in
        del inflight[pid]
        done.append(delivery)
    if session.persistent and done:
        core.store.deliveries_deleted(session.client_id, done)
    pump(core, session, now)


def on_pubcomps(core: BrokerState, conn: Connection, pids: list[int], now: float) -> None:
    """A run of plain PUBCOMPs read in one go (``PacketReader.leading_acks``): each ends its QoS 2 delivery as
    :func:`on_completion` does, then the window is refilled once (FIFO)."""
    conn.last_ack_at = now
    session = conn.session
    assert session is not None
    inflight = session.inflight
    for pid in pids:
        delivery = inflight.get(pid)
        if delivery is None or delivery.state != AWAIT_COMP:
            log.debug("%s: PUBCOMP for unknown Packet Identifier %d", conn.client_id, pid)
            continue
        finish(core, session, delivery)
    pump(core, session, now)


def on_pubrec(core: BrokerState, conn: Connection, p: PubRec, now: float) -> None:
    """PUBREC ``p`` for a QoS 2 message this broker sent on ``conn``: as :func:`pubrec` (PUBREL once durable
    [MQTT-4.3.3-4], the flow's end on a refusal >= 0x80, PUBREL 0x92 for an unknown identifier, 5.0)."""
    pubrec(core, conn, p.packet_id, p.reason_code, now)


def on_pubrecs(core: BrokerState, conn: Connection, pids: list[int], now: float) -> None:
    """A run of plain PUBRECs (Reason Code 0) read in one go (``PacketReader.leading_acks``): each as
    :func:`on_pubrec`, in order."""
    for pid in pids:
        pubrec(core, conn, pid, 0, now)


def pubrec(core: BrokerState, conn: Connection, pid: int, reason: int, now: float) -> None:
    """PUBREC ``pid`` with ``reason`` for a QoS 2 delivery: PUBREL (once the PUBREC is durable, for a persistent
    session), or the end of the flow when the receiver refused (``reason`` >= 0x80); an unknown identifier gets
    PUBREL 0x92 (5.0) (MQTT 5.0 §4.3.3)."""
    conn.last_ack_at = now
    session = conn.session
    assert session is not None
    delivery = session.inflight.get(pid)
    if delivery is None or delivery.qos != 2:
        send(core, conn, PubRel(pid, unknown_packet_id(conn.version)))
        return
    if reason >= 0x80:
        # The receiver refused the message: the flow ends here (MQTT 5.0 §4.3.3).
        finish(core, session, delivery)
        pump(core, session, now)
        return
    # The PUBREL that answers goes out now: a 3.1.1 ``retry_interval`` counts from this send, not the PUBLISH's.
    delivery.sent_at = now
    if delivery.state != AWAIT_COMP:
        delivery.state = AWAIT_COMP
        if session.persistent:
            # PUBREC received must be durable before PUBREL goes out: after a crash the broker then
            # re-sends PUBREL, never the PUBLISH (exactly once, MQTT 5.0 §4.3.3).
            core.store.delivery_saved(session.client_id, delivery)
            if not hold(core, ACK_PUBREL, conn, pid):
                return
    send_ack(core, conn, PUBREL_BYTE, pid)
