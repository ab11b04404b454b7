"""The states of a Network Connection in the core, and the transitions allowed between them (one table).

A connection starts in :data:`AWAITING_CONNECT`: the first packet must be CONNECT [MQTT-3.1.0-1]. A CONNECT that
is accepted makes it :data:`CONNECTED` (CONNACK sent, the session attached); one that the failure throttle delays
makes it :data:`HELD` until ``Connection.held_until`` (then it is handled as if it had just arrived, so the
connection is :data:`AWAITING_CONNECT` again); a second CONNECT is a Protocol Error [MQTT-3.1.0-2]. Any state but
:data:`CLOSED` can end in :data:`CLOSED` (DISCONNECT, a protocol error, a refusal, Keep Alive, take-over, the socket
lost, shutdown), and nothing leaves :data:`CLOSED`: its session is detached once, its Will published at most once.

The states are an :class:`enum.IntEnum`, so the per-packet tests (``conn.state == CONNECTED``) compare ints; a
change of state goes through :meth:`Connection.move_to <gateway.broker.session_state.Connection.move_to>`, which
checks it against :data:`ALLOWED` (a few times per connection, never per packet).
"""

from __future__ import annotations

import enum
from typing import Final

from gateway.broker.native_classes import mypyc_attr


class ConnState(enum.IntEnum):
    """The state of one Network Connection (see the module's docstring)."""

    AWAITING_CONNECT = 0
    CONNECTED = 1
    CLOSED = 2
    #: CONNECT received and held by the failure throttle until ``Connection.held_until`` (CONNECT back-off)
    HELD = 3


AWAITING_CONNECT = ConnState.AWAITING_CONNECT
CONNECTED = ConnState.CONNECTED
CLOSED = ConnState.CLOSED
HELD = ConnState.HELD

#: The states each state may move to; every other change is a bug in the core (:class:`IllegalTransition`).
ALLOWED: Final[dict[ConnState, frozenset[ConnState]]] = {
    AWAITING_CONNECT: frozenset({CONNECTED, HELD, CLOSED}),
    HELD: frozenset({AWAITING_CONNECT, CLOSED}),
    CONNECTED: frozenset({CLOSED}),
    CLOSED: frozenset(),
}


# A native class cannot inherit from RuntimeError (mypyc compiles only Exception's own subclasses natively): a
# Python class, as raising it is rare (a bug).
@mypyc_attr(native_class=False)
class IllegalTransition(RuntimeError):
    """A change of a connection's state that :data:`ALLOWED` does not list (a programming error in the core)."""

    def __init__(self, old: ConnState, new: ConnState) -> None:
        super().__init__(f"connection state {old.name} cannot become {new.name}")
        self.old = old
        self.new = new
