"""The Deadline Index: each open connection filed under the whole second of its next deadline check, so that the
once-a-second :meth:`~gateway.broker.broker.Broker.tick` looks only at the connections with a deadline due
instead of every connection (:mod:`gateway.broker.timers`).

A deadline check of a connection runs the same tests as before (CONNECT timeout, Keep Alive [MQTT-3.1.2-24] 3.1.1 /
[MQTT-3.1.2-22] 5.0, ``send_timeout``, ``retry_interval``, ``await_rel_timeout``) at the first tick at or after the
earliest of its deadlines, then files the connection again under its next one (:func:`next_check`). Deadlines that
only move later (a packet received resets the Keep Alive) are re-read when their check comes; the ones that move
earlier call :meth:`DeadlineIndex.schedule` (a CONNECT accepted, a socket paused, a QoS 2 PUBLISH awaiting its
PUBREL). With 20,000 connections at Keep Alive 60, a tick then checks about 220 connections a second instead of
20,000 (7.5 ms of loop time a second at 10,000: the stall every connection's packets waited behind).

Pure: the time is passed in (wall-clock seconds); no clock, no I/O.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

from gateway.broker.connection_states import AWAITING_CONNECT, CONNECTED
from gateway.broker.session_state import Connection
from gateway.mqtt.packets import MQTT_5


class DeadlineIndex:
    """Open connections by the whole second (``math.floor`` of wall-clock seconds) of their next deadline check.

    Memory: one dict entry per scheduled connection (each connection is in at most one bucket, named by
    ``Connection.check_key``), and one bucket and one heap entry per distinct second scheduled (at most the
    longest deadline ahead: 1.5 x 65,535 s of Keep Alive); closed connections are taken out (:meth:`unschedule`),
    so the index never holds more connections than are open."""

    __slots__ = ("_buckets", "_keys")

    def __init__(self) -> None:
        # A second's bucket: that second as one int object, which every connection in it shares as its
        # ``check_key`` (a second past 2**30 is an int object of 32 bytes), and its connections, a dict used as an
        # ordered set: at thousands of entries a dict takes about a third of a set's memory (24 bytes an entry plus
        # a small index, against a set's 16-byte slots kept under 60% full). Plain dicts and a tuple: compiled, a
        # dict subclass's item access would go through Python-level slot lookups, several times the cost.
        self._buckets: dict[int, tuple[int, dict[Connection, None]]] = {}
        self._keys: list[int] = []  # a heap of the buckets' seconds

    def __len__(self) -> int:
        """Connections scheduled."""
        return sum(len(conns) for _key, conns in self._buckets.values())

    def schedule(self, conn: Connection, at: float) -> None:
        """Check ``conn`` at the first tick at or after ``at`` (seconds) unless it is already due no later."""
        key = math.floor(at)
        current = conn.check_key
        if current is not None:
            if current <= key:
                return
            self.unschedule(conn)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = (key, {})
            heappush(self._keys, key)
        bucket[1][conn] = None
        conn.check_key = bucket[0]

    def refile(self, conn: Connection, at: float | None) -> None:
        """File ``conn`` under ``at`` (seconds; ``None``: no deadline) whatever it was filed under before: its
        deadlines changed (a CONNECT accepted, an accept time given, a check done)."""
        self.unschedule(conn)
        if at is not None:
            self.schedule(conn, at)

    def unschedule(self, conn: Connection) -> None:
        """Take ``conn`` out (it closed)."""
        key = conn.check_key
        if key is None:
            return
        conn.check_key = None
        bucket = self._buckets.get(key)
        if bucket is not None:
            conns = bucket[1]
            if conn in conns:  # an emptied bucket stays until its second: one heap entry per second
                del conns[conn]

    def due(self, now: float) -> list[Connection]:
        """Take out and return every connection filed under a second ``<= now``. The caller checks each and files
        it again (:func:`next_check`)."""
        out: list[Connection] = []
        keys, buckets = self._keys, self._buckets
        while keys and keys[0] <= now:
            bucket = buckets.pop(heappop(keys), None)
            if bucket is not None:
                conns = bucket[1]
                for conn in conns:
                    conn.check_key = None
                out.extend(conns)
        return out


def next_check(conn: Connection, now: float) -> float | None:
    """When ``conn``'s next deadline check is due (wall-clock seconds), or ``None`` when it has no deadline (no
    Keep Alive, nothing paused or awaiting a PUBREL). A 3.1.1 connection with ``retry_interval`` set is checked
    at every tick, as its unacknowledged messages come and go."""
    limits = conn.limits
    state = conn.state
    if state == AWAITING_CONNECT:
        return conn.opened_at + limits.connect_timeout
    if state != CONNECTED:
        return None
    at = math.inf
    if conn.keep_alive:
        at = max(conn.last_rx, conn.paused_until) + 1.5 * conn.keep_alive
    if conn.paused and limits.send_timeout:
        at = min(at, conn.paused_at + limits.send_timeout)
    session = conn.session
    if session is not None:
        if limits.retry_interval and conn.version != MQTT_5:
            return now
        timeout = session.limits.await_rel_timeout
        if timeout and session.awaiting_rel:
            at = min(at, min(received for _m, received in session.awaiting_rel.values()) + timeout)
    return None if at == math.inf else at
