"""The store's reports of commit barriers, as inputs of the core: what was held under them is emitted.

:func:`committed` (the barrier and every earlier one are durable) emits each held acknowledgement in barrier order;
:func:`failed` (the commit holding them failed; ``full``: for lack of room) emits, in the same order, the refusal
of each record that owns changes and the acknowledgement of each that does not (the rule of
:mod:`gateway.broker.barriers`). What each :class:`~gateway.broker.barriers.Ack` emits lives with the handler that
held it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from gateway.broker.barriers import (
    ACK_PUBACK,
    ACK_PUBCOMP,
    ACK_PUBREC,
    ACK_PUBREC_AGAIN,
    ACK_PUBREL,
    ACK_SEND,
    ACK_SEND_QOS0,
    ACK_SUBACK,
    ACK_UNSUBACK,
    Ack,
)
from gateway.broker.connection_states import CONNECTED
from gateway.broker.inbound import puback_committed, refused
from gateway.broker.inflight import send_held, send_held_qos0
from gateway.broker.output import PUBREL_BYTE, send, send_ack
from gateway.broker.qos2 import pubcomp, pubrec
from gateway.broker.session_state import Connection
from gateway.broker.state import BrokerState
from gateway.broker.subscribe import subscribed

log: Final = logging.getLogger("gateway.broker")


def committed(core: BrokerState, barrier: int, now: float) -> None:
    """Barrier ``barrier`` (and every earlier one) is committed: emit what was held under them, in order."""
    held = core.held_acks
    core.input_owns = False
    while held and held[0][0] <= barrier:
        _, _, ack, conn, a, b = held.popleft()
        try:
            if ack == ACK_PUBACK:  # the common one (a durable QoS 1 PUBLISH), without the dispatch
                puback_committed(core, conn, a, b)
            else:
                _emit(core, ack, conn, a, b, now)
        except Exception:  # one record's bug must not keep the later ones held
            log.exception("emitting %s held under barrier %d failed", Ack(ack).name, barrier)


def failed(core: BrokerState, barrier: int, full: bool, now: float) -> None:
    """The commit holding barrier ``barrier`` (and every earlier one not yet reported) failed (``full``: for lack
    of room): in barrier order, refuse what owns changes in it and acknowledge what does not."""
    held = core.held_acks
    core.input_owns = False
    while held and held[0][0] <= barrier:
        _, own, ack, conn, a, b = held.popleft()
        try:
            if own:
                _refuse(core, ack, conn, a, b, full, now)
            else:
                _emit(core, ack, conn, a, b, now)
        except Exception:
            log.exception("emitting %s held under failed barrier %d failed", Ack(ack).name, barrier)


def _emit(core: BrokerState, ack: int, conn: Connection, a: Any, b: Any, now: float) -> None:
    """What a held record emits once its work is durable (or it owns nothing of a failed commit)."""
    if ack == ACK_PUBACK:
        puback_committed(core, conn, a, b)
    elif ack == ACK_SEND:
        send_held(core, a, conn, b, now)
    elif ack == ACK_PUBREC:
        pubrec(core, conn, a.packet_id)
    elif ack == ACK_PUBREC_AGAIN:
        pubrec(core, conn, a)
    elif ack == ACK_PUBCOMP:
        pubcomp(core, conn, a, b)
    elif ack == ACK_PUBREL:
        if conn.state == CONNECTED:
            send_ack(core, conn, PUBREL_BYTE, a)
    elif ack == ACK_SUBACK:
        subscribed(core, conn, a, b, now)
    elif ack == ACK_UNSUBACK:
        if conn.state == CONNECTED:
            send(core, conn, a)
    elif ack == ACK_SEND_QOS0:
        send_held_qos0(core, a, conn, b, now)


def _refuse(core: BrokerState, ack: int, conn: Connection, a: Any, b: Any, full: bool, now: float) -> None:
    """What a held record that owns changes of a failed commit emits: the PUBLISH refused, or its send made anyway
    (the subscriber is served; only a crash before the next commit could re-send it under a new identifier), or
    nothing (the client repeats the packet)."""
    if ack == ACK_PUBACK:
        refused(core, conn, a, None, full, now)
    elif ack == ACK_PUBREC:
        refused(core, conn, a, b, full, now)
    elif ack == ACK_SEND:
        send_held(core, a, conn, b, now)
    elif ack == ACK_SEND_QOS0:
        send_held_qos0(core, a, conn, b, now)
