"""A connection's states and their one transition table (gateway/broker/connection_states.py): every change the
core makes goes through ``Connection.move_to``, which refuses what ``ALLOWED`` does not list; the states compare
as the ints the per-packet tests use."""

from __future__ import annotations

import pytest

from gateway.broker.connection_states import (
    ALLOWED,
    AWAITING_CONNECT,
    CLOSED,
    CONNECTED,
    HELD,
    ConnState,
    IllegalTransition,
)
from gateway.broker.limits import ZoneLimits
from gateway.broker.session_state import Connection


def _conn() -> Connection:
    return Connection(ZoneLimits(), "test", "127.0.0.1:1", 0.0)


def test_every_state_has_its_row_and_closed_is_final() -> None:
    assert set(ALLOWED) == set(ConnState)
    assert ALLOWED[CLOSED] == frozenset()
    assert all(CLOSED in ALLOWED[s] for s in ConnState if s != CLOSED)


@pytest.mark.parametrize("path", [(CONNECTED, CLOSED), (HELD, AWAITING_CONNECT, CONNECTED, CLOSED), (HELD, CLOSED),
                                  (CLOSED,)])
def test_allowed_paths(path: tuple[ConnState, ...]) -> None:
    conn = _conn()
    assert conn.state == AWAITING_CONNECT == 0
    for state in path:
        conn.move_to(state)
        assert conn.state is state


@pytest.mark.parametrize(("path", "bad"), [((CONNECTED,), AWAITING_CONNECT), ((CONNECTED,), HELD),
                                           ((CLOSED,), CONNECTED), ((CLOSED,), AWAITING_CONNECT),
                                           ((HELD,), CONNECTED), ((), AWAITING_CONNECT)])
def test_other_changes_are_refused_and_leave_the_state(path: tuple[ConnState, ...], bad: ConnState) -> None:
    conn = _conn()
    for state in path:
        conn.move_to(state)
    before = conn.state
    with pytest.raises(IllegalTransition, match=f"{before.name} cannot become {bad.name}"):
        conn.move_to(bad)
    assert conn.state is before
