"""The core's side of commit barriers, for tests of a store alone: each barrier's acknowledgement waits in
:class:`HeldAcks` until the store reports the barrier back, as :mod:`gateway.broker.barriers` keeps them.

``wait(store, acknowledged, refused=None)`` puts a barrier after what the store recorded and keeps two events:
``acknowledged`` joins :attr:`HeldAcks.events` once the barrier is committed (or failed without changes of its own:
the core's rule), ``(refused, full)`` once it failed with changes of its own (nothing, when ``refused`` is None).
As in the core, a barrier after one with changes of its own in the same input owns changes too;
:meth:`HeldAcks.new_input` starts another input (another client's packet, a later loop turn).
"""

from __future__ import annotations

from typing import Any

from gateway.broker.store_port import DURABLE, OWN


class HeldAcks:
    """Barriers put into one store, and the events their reports cause (see the module's docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.events: list[Any] = []
        self.next = 1
        self.held: list[tuple[int, bool, Any, Any]] = []
        self.input_owns = False
        store.on_committed = self.committed
        store.on_failed = self.failed

    def wait(self, acknowledged: Any, refused: Any = None) -> None:
        barrier = self.next
        self.next += 1
        answer = self.store.barrier(barrier)
        if answer == DURABLE and not self.held:
            self.events.append(acknowledged)
        else:
            own = self.input_owns = answer == OWN or self.input_owns
            self.held.append((barrier, own, acknowledged, refused))

    def new_input(self) -> None:
        self.input_owns = False

    def committed(self, barrier: int) -> None:
        while self.held and self.held[0][0] <= barrier:
            self.events.append(self.held.pop(0)[2])

    def failed(self, barrier: int, full: bool) -> None:
        while self.held and self.held[0][0] <= barrier:
            _, own, acknowledged, refused = self.held.pop(0)
            if not own:
                self.events.append(acknowledged)
            elif refused is not None:
                self.events.append((refused, full))
