"""One message to one session (docs/architecture.md, "Session semantics"): out at once, into the Inflight Window,
or into the Message Queue; the queue's drop policy as the broker counts and logs it; offline messages and their
expiry.

QoS 0 to an online client bypasses window and queue (nothing to acknowledge, nothing to keep), unless its socket
is past ``high_watermark`` (then it is dropped). For an offline persistent session QoS 1/2 (and QoS 0 with
``mqueue_store_qos0``) wait in the Message Queue until it resumes, at most ``message_expiry_interval`` unless the
message carries its own Message Expiry Interval [MQTT-3.3.2-5].
"""

from __future__ import annotations

import logging
from typing import Final

from gateway.broker.inflight import send_new
from gateway.broker.message import Delivery, Message
from gateway.broker.output import write_publish
from gateway.broker.session_state import Session
from gateway.broker.state import BrokerState

log: Final = logging.getLogger("gateway.broker")

#: Flow control: an online session is congested when its Message Queue holds at least this many messages (or
#: 2x its Inflight Window) while its client still acknowledges; publishers are paused until it drains to one
#: window. A client silent for STALLED_AFTER seconds is not waited for.
CONGESTION_MIN: Final = 64
STALLED_AFTER: Final = 1.0


def deliver(
    core: BrokerState, session: Session, message: Message, qos: int, retain: bool, sub_ids: list[int], now: float
) -> None:
    """Give ``message`` to ``session`` at ``qos``: out now, into the Inflight Window, or into the Message
    Queue (QoS 0 to an online client bypasses both)."""
    conn = session.conn
    if conn is not None and qos == 0:
        if conn.paused:
            # Its socket holds high_watermark bytes already: QoS 0 is at most once.
            core.stats.dropped["high_watermark_qos0"] += 1
        else:
            write_publish(core, conn, message, 0, retain, 0, False, sub_ids, now)
        return
    limits = session.limits
    if conn is None:
        if qos == 0 and not limits.mqueue_store_qos0:
            core.stats.dropped["qos0_offline"] += 1
            return
        expires_at = message.expires_at
        if expires_at is None and limits.message_expiry_interval:
            expires_at = now + limits.message_expiry_interval
    else:
        expires_at = message.expires_at
    delivery = Delivery(message, qos, retain, sub_ids, expires_at=expires_at)
    if conn is not None and qos and not conn.paused and not session.mqueue and len(session.inflight) < conn.window:
        send_new(core, session, conn, delivery, now)
        return
    enqueue(core, session, delivery, now)
    if (
        conn is not None
        and len(session.mqueue) >= max(CONGESTION_MIN, 2 * conn.window)
        and now - conn.last_ack_at < STALLED_AFTER
    ):
        core.congested.add(session)


def enqueue(core: BrokerState, session: Session, delivery: Delivery, now: float) -> None:
    """Queue ``delivery`` (recorded in the store for a persistent session) and apply the drop policy."""
    persistent = session.persistent
    if persistent and delivery.qos == 0 and not core.store.has_room(session.client_id):
        # QoS 0 is never refused to its publisher, so it must not fill a full store and make the writes
        # of acknowledged work fail: drop it for the offline session instead.
        core.stats.dropped["store_full_qos0"] += 1
        return
    mqueue = session.mqueue
    if persistent and (delivery.qos or session.limits.mqueue_store_qos0):
        core.store.delivery_saved(session.client_id, delivery)  # first: a stored entry may be paged out
    victim = mqueue.push(delivery)
    if victim is not None:
        _queue_drop(core, session, victim, "mqueue_full", f"max_mqueue_len={mqueue.max_len}", now)
    while mqueue.over_quota():
        _queue_drop(core, session, mqueue.drop_oldest(), "mqueue_quota", f"max_mqueue_bytes={mqueue.max_bytes}", now)


def _queue_drop(core: BrokerState, session: Session, victim: Delivery, reason: str, limit: str, now: float) -> None:
    """Count, forget and log (at most once a minute per client and reason) a message the Message Queue dropped
    (every drop is counted by reason)."""
    if victim.qos == 0:
        reason += "_qos0"
    count = core.stats.dropped[reason] = core.stats.dropped[reason] + 1
    if session.persistent:
        core.store.delivery_deleted(session.client_id, victim)
    core.rlog.warning(
        now,
        session.client_id,
        reason,
        "Message Queue of %r full (%s): dropped the oldest %s message (%d so far, all clients)",
        session.client_id[:200],
        limit,
        "QoS 0" if victim.qos == 0 else f"QoS {victim.qos}",
        count,
    )


def queue_rows_lost(core: BrokerState, client_id: str, seqs: list[int]) -> None:
    """The store did not write these queue rows of ``client_id`` (their commit failed, or left them out;
    ``seqs`` are store sequence numbers; ``LmdbStore.on_queue_rows_lost``). Their entries
    leave the Message Queue, counted as ``store_write_failed`` (``_qos0``) drops: their publishers are not
    acknowledged (nothing unstored is), and a queue that kept them would page them out as rows the store lacks."""
    session = core.sessions.get(client_id)
    if session is None:
        return
    for victim in session.mqueue.forget_unwritten(seqs):
        reason = "store_write_failed_qos0" if victim.qos == 0 else "store_write_failed"
        count = core.stats.dropped[reason] = core.stats.dropped[reason] + 1
        if count in (1, 10, 100, 1000) or count % 10000 == 0:
            log.warning(
                "Message Queue of %r: dropped a QoS %d message whose store row could not be written (%d so far)",
                client_id[:200],
                victim.qos,
                count,
            )


def sweep_expired(core: BrokerState, session: Session, now: float) -> None:
    """Drop the expired messages from an offline session's Message Queue [MQTT-3.3.2-5]."""
    removed = session.mqueue.remove_if(lambda d: d.expires_at is not None and now >= d.expires_at)
    if removed:
        core.stats.dropped["expired"] += len(removed)
        if session.persistent:
            for delivery in removed:
                core.store.delivery_deleted(session.client_id, delivery)
