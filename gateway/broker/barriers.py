"""Commit barriers: the acknowledgements that wait until the work they answer is durable, held in the core.

A QoS 1 PUBLISH is acknowledged, a QoS 2 PUBLISH PUBRECed, a SUBSCRIBE SUBACKed ... only once everything it
caused is committed (docs/architecture.md, "The durability contract"). The handler that would send such an
acknowledgement calls :func:`hold` instead: the store puts a barrier with a new id after every change recorded so
far (:meth:`~gateway.broker.store_port.SessionStore.barrier`) and the acknowledgement is kept here, in
``BrokerState.held_acks``, as a record under that id. When the store reports the barrier back, the core emits what was
held (``Broker.committed``, ``Broker.failed``: :mod:`gateway.broker.commits`). No callable crosses the store port.

The rule for a failed commit: each held record either owns changes in it or waits only for the order of
acknowledgements. A record owns changes when the store recorded any between the previous barrier and its own
(the store's answer, :data:`~gateway.broker.store_port.OWN`) or when an earlier barrier of the same input did
(a handler that records, holds, then holds again: a PUBLISH whose routing held a QoS 2 send to a persistent
subscriber before its own PUBACK). A record that owns changes gets its refusal; **a barrier with no change of its
own is acknowledged in order after the failed barrier's refusals**, so another client's failed commit never
refuses a client whose work needed nothing stored.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from gateway.broker.session_state import Connection
from gateway.broker.state import BrokerState
from gateway.broker.store_port import DURABLE, OWN


class Ack(IntEnum):
    """What a held record emits once its barrier is reported (``a`` and ``b``: the record's two values)."""

    #: PUBACK of a QoS 1 PUBLISH (``a``: the PUBLISH, ``b``: its Reason Code); failed: 0x97/0x80 or a disconnect.
    PUBACK = 0
    #: PUBREC of a new QoS 2 PUBLISH (``a``: the PUBLISH, ``b``: its awaiting-PUBREL entry); failed: the identifier
    #: is released and the PUBLISH refused as for PUBACK.
    PUBREC = 1
    #: PUBREC again for a re-sent QoS 2 PUBLISH (``a``: its Packet Identifier); it depends on the first one's record,
    #: so it always counts as owning changes: failed, nothing is sent (the client sends it again).
    PUBREC_AGAIN = 2
    #: PUBCOMP (``a``: the Packet Identifier, ``b``: the Reason Code); failed: nothing.
    PUBCOMP = 3
    #: PUBREL once the subscriber's PUBREC is recorded (``a``: the Packet Identifier); failed: nothing.
    PUBREL = 4
    #: SUBACK and then the retained messages (``a``: the SUBACK, ``b``: the subscriptions that get them); failed:
    #: nothing.
    SUBACK = 5
    #: UNSUBACK (``a``: the packet); failed: nothing.
    UNSUBACK = 6
    #: A PUBLISH to a persistent session held until its Packet Identifier is recorded (``a``: the session, ``b``:
    #: the delivery); sent whatever the outcome.
    SEND = 7
    #: A QoS 0 PUBLISH queued behind a held send (``a``: the session, ``b``: the delivery); sent whatever the outcome.
    SEND_QOS0 = 8


# The kinds as module constants: an IntEnum member read as ``Ack.PUBACK`` costs ten times a global's load in
# CPython 3.11, and the durable publish path reads one per message twice.
(ACK_PUBACK, ACK_PUBREC, ACK_PUBREC_AGAIN, ACK_PUBCOMP, ACK_PUBREL, ACK_SUBACK, ACK_UNSUBACK, ACK_SEND,
 ACK_SEND_QOS0) = Ack


def hold(core: BrokerState, ack: Ack, conn: Connection, a: Any, b: Any = None, own: bool = False) -> bool:
    """Put a commit barrier after everything recorded so far and keep ``ack`` (an ``ACK_*`` kind, for ``conn``,
    with ``a`` and ``b``) under it. Returns True instead when nothing waits (the store answered
    :data:`~gateway.broker.store_port.DURABLE` and nothing is held): the caller emits the acknowledgement at once.
    ``own``: the record owns changes whatever the store answers (``ACK_PUBREC_AGAIN``)."""
    barrier = core.next_barrier
    answer = core.store.barrier(barrier)
    if answer == DURABLE and not core.held_acks:
        return True
    core.next_barrier = barrier + 1
    if answer == OWN or own or core.input_owns:
        core.input_owns = own = True
    core.held_acks.append((barrier, own, ack, conn, a, b))
    return False
