"""The QoS 2 receiver ("Method A" of MQTT 3.1.1 Figure 4.3; MQTT 5.0 §4.3.3 leaves the moment of onward delivery
to the receiver): the broker keeps an inbound QoS 2 message and its Packet Identifier, answers PUBREC once that is
durable, treats a repeat of the identifier as a duplicate (PUBREC again, no second copy), routes the message
onward on PUBREL, then forgets the identifier and sends PUBCOMP; a PUBREL for an identifier it does not know still
gets PUBCOMP (5.0: 0x92). ``max_awaiting_rel`` bounds the identifiers held (checked with Receive Maximum in
:mod:`gateway.broker.inbound`), ``await_rel_timeout`` their age.
"""

from __future__ import annotations

from gateway.broker.barriers import ACK_PUBCOMP, ACK_PUBREC, ACK_PUBREC_AGAIN, hold
from gateway.broker.connection_states import CONNECTED
from gateway.broker.message import Message, packet_id_of
from gateway.broker.output import PUBCOMP_BYTE, PUBREC_BYTE, send, send_ack
from gateway.broker.reasons import unknown_packet_id
from gateway.broker.router import publish
from gateway.broker.session_state import Connection, Session, awaiting_rel_for_write
from gateway.broker.state import BrokerState
from gateway.mqtt.packets import PubComp, Publish, PubRel


def received(core: BrokerState, conn: Connection, session: Session, p: Publish, message: Message, now: float) -> None:
    """Keep a new QoS 2 ``message`` (of PUBLISH ``p``) under its Packet Identifier until its PUBREL, and PUBREC it
    once that is durable (held as :attr:`~gateway.broker.barriers.ACK_PUBREC`: refused if the commit fails)."""
    pid = packet_id_of(p)
    awaiting = awaiting_rel_for_write(session)
    entry = awaiting[pid] = (message, now)
    timeout = session.limits.await_rel_timeout
    if timeout and len(awaiting) == 1:
        # The first one awaiting: its deadline is the session's earliest (the Deadline Index re-reads the rest).
        core.deadlines.schedule(conn, now + timeout)
    if session.persistent:
        core.store.inbound_saved(session.client_id, pid, message)
    if hold(core, ACK_PUBREC, conn, p, entry):
        pubrec(core, conn, pid)


def duplicate(core: BrokerState, conn: Connection, pid: int) -> None:
    """A re-sent QoS 2 PUBLISH for an identifier awaiting PUBREL: PUBREC again, no second copy (the receiver keeps
    the identifier until PUBREL, [MQTT-4.3.3-10] 5.0, [MQTT-4.3.3-2] 3.1.1). Held behind the first one's record,
    and withheld if that fails (the identifier is released then)."""
    core.stats.dropped["qos2_duplicate"] += 1
    if hold(core, ACK_PUBREC_AGAIN, conn, pid, own=True):
        pubrec(core, conn, pid)


def pubrec(core: BrokerState, conn: Connection, pid: int) -> None:
    if conn.state == CONNECTED:
        send_ack(core, conn, PUBREC_BYTE, pid)


def on_pubrel(core: BrokerState, conn: Connection, p: PubRel, now: float) -> None:
    """PUBREL ``p`` from ``conn``'s client for a QoS 2 message it sent: as :func:`pubrel` (the held message routed
    onward once, the identifier forgotten, PUBCOMP once durable [MQTT-4.3.3-11] [MQTT-4.3.3-12]; an unknown
    identifier still gets PUBCOMP, 5.0: 0x92)."""
    pubrel(core, conn, p.packet_id, now)


def on_pubrels(core: BrokerState, conn: Connection, pids: list[int], now: float) -> None:
    """A run of plain PUBRELs read in one go (``PacketReader.leading_acks``): each as :func:`on_pubrel`, in order."""
    for pid in pids:
        pubrel(core, conn, pid, now)
        if conn.state != CONNECTED:
            return


def pubrel(core: BrokerState, conn: Connection, pid: int, now: float) -> None:
    """PUBREL ``pid``: route the message held under it onward, forget the identifier, and PUBCOMP once what that
    recorded is durable (MQTT 5.0 §4.3.3)."""
    session = conn.session
    assert session is not None
    awaiting = session.awaiting_rel
    entry = awaiting.pop(pid, None) if isinstance(awaiting, dict) else None
    if entry is not None:
        if session.persistent:
            core.store.inbound_deleted(session.client_id, pid)
        if entry[0].expired(now):
            # Expired before onward delivery started: no copy for anyone [MQTT-3.3.2-5]; the flow still
            # completes with PUBCOMP 0x00 [MQTT-4.3.3-13].
            core.stats.dropped["expired"] += 1
        else:
            publish(core, entry[0], now)
        if hold(core, ACK_PUBCOMP, conn, pid, 0):
            pubcomp(core, conn, pid, 0)
        return
    # PUBCOMP also for an unknown identifier (a PUBREL re-sent after the PUBCOMP was lost), 5.0 with 0x92 (MQTT 5.0
    # §3.7.2.1).
    reason = unknown_packet_id(conn.version)
    if hold(core, ACK_PUBCOMP, conn, pid, reason):
        pubcomp(core, conn, pid, reason)


def pubcomp(core: BrokerState, conn: Connection, pid: int, reason: int) -> None:
    """PUBCOMP ``pid`` with ``reason`` (0: the plain 4 bytes)."""
    if conn.state != CONNECTED:
        return
    if reason:
        send(core, conn, PubComp(pid, reason))
    else:
        send_ack(core, conn, PUBCOMP_BYTE, pid)


def expire_awaiting_rel(core: BrokerState, session: Session, now: float) -> None:
    """Forget the identifiers whose PUBREL did not come within ``await_rel_timeout``."""
    timeout = session.limits.await_rel_timeout
    if not timeout or not session.awaiting_rel:
        return
    awaiting = awaiting_rel_for_write(session)
    for pid, (_message, received_at) in list(awaiting.items()):
        if now - received_at >= timeout:
            del awaiting[pid]
            core.stats.dropped["await_rel_timeout"] += 1
            if session.persistent:
                core.store.inbound_deleted(session.client_id, pid)
