"""A :class:`~gateway.broker.broker.Broker` for tests that drive the core in process: every input's actions
(:class:`~gateway.broker.actions.Action`) are kept as the I/O layer would buffer them, per connection, until the
test reads them (:attr:`RecordingBroker.written`), and the closes and pauses they asked for are remembered."""

from __future__ import annotations

from typing import Any

from gateway.broker.actions import Action
from gateway.broker.broker import Broker
from gateway.broker.session_state import Connection


class RecordingBroker(Broker):
    """A broker whose inputs also keep their actions (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Packets the actions asked to write, per connection, not yet read by the test.
        self.written: dict[Connection, list[bytes]] = {}
        #: Every action, in order (the last ones first to look at for a close or a pause).
        self.actions: list[Action] = []

    def _keep(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            if action.data:
                self.written.setdefault(action.conn, []).extend(action.data)
        self.actions.extend(actions)
        del self.actions[:-1000]
        return actions

    def take(self, conn: Connection) -> bytes:
        """What was written to ``conn`` since the last call."""
        return b"".join(self.written.pop(conn, ()))

    def receive(self, conn: Connection, data: bytes, now: float) -> list[Action]:
        return self._keep(super().receive(conn, data, now))

    def resume(self, conn: Connection, now: float) -> list[Action]:
        return self._keep(super().resume(conn, now))

    def pause_over(self, conn: Connection, now: float) -> list[Action]:
        return self._keep(super().pause_over(conn, now))

    def release(self, conn: Connection, now: float) -> list[Action]:
        return self._keep(super().release(conn, now))

    def connection_lost(self, conn: Connection, now: float) -> list[Action]:
        return self._keep(super().connection_lost(conn, now))

    def resume_writing(self, conn: Connection, now: float) -> list[Action]:
        return self._keep(super().resume_writing(conn, now))

    def tick(self, now: float) -> list[Action]:
        return self._keep(super().tick(now))

    def committed(self, barrier: int, now: float) -> list[Action]:
        return self._keep(super().committed(barrier, now))

    def failed(self, barrier: int, full: bool, now: float) -> list[Action]:
        return self._keep(super().failed(barrier, full, now))

    def publish_local(self, *args: Any, **kwargs: Any) -> list[Action]:
        return self._keep(super().publish_local(*args, **kwargs))

    def shutdown(self, now: float) -> list[Action]:
        return self._keep(super().shutdown(now))

    def store_change_failed(self, client_ids: set[str], now: float) -> list[Action]:
        return self._keep(super().store_change_failed(client_ids, now))
