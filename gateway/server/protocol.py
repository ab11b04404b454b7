"""The asyncio adapter between sockets and the sans-I/O :class:`~gateway.broker.broker.Broker`.

Each connection's bytes go to the broker as they arrive; every input of the broker returns its actions
(:class:`~gateway.broker.actions.Action`, one per connection concerned), and :meth:`BrokerIO.perform` carries them
out: packets are buffered per connection and written once per loop turn (one ``transport.write`` with all of that
turn's packets), closes happen after the last bytes (a FIN, then a linger) or at once (an abort), and reading
pauses until a time (``max_publish_rate``, then :meth:`Broker.pause_over`) or while the core holds a publisher
back (a congested consumer, :meth:`Broker.holds_back`). An action with ``more`` set (a long run of PUBACKs,
handled in parts) has its packets written at once and :meth:`Broker.resume` called, within the same
``data_received``. The broker never sees a transport: :attr:`BrokerIO.transports` maps each of its
:class:`~gateway.broker.session_state.Connection` objects to one; this module never writes the core's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.broker.actions import ABORT, UNTIL_RELEASED, Action
from gateway.broker.broker import Broker
from gateway.broker.limits import ZoneLimits
from gateway.broker.native_classes import mypyc_attr
from gateway.broker.session_state import Connection

log = logging.getLogger("gateway.server")

#: Seconds a connection the broker closed keeps reading (and discarding) after its last packet and a FIN went out,
#: so the client reads the DISCONNECT or CONNACK that says why instead of a reset caused by unread data.
CLOSE_LINGER = 1.0

#: Packets buffered for one connection after which they are written at once instead of at the end of the loop
#: turn (once per connection and turn otherwise, so that acknowledgements and fan-in deliveries share a write).
WRITE_NOW_PACKETS = 256


class BrokerIO:
    """Owns the broker's I/O side: performing the actions the broker returns (buffered writes flushed once per
    loop turn, closes, paused reading) and the one-second ticker."""

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker = broker
        self.loop = loop
        self._flush_scheduled = False
        self._ticker: asyncio.Task[None] | None = None
        #: Packets to write at the end of this loop turn, per connection, in order.
        self.buffers: dict[Connection, list[bytes]] = {}
        #: Connections to close at the end of this loop turn: ``CLOSE`` (after their packets) or ``ABORT``.
        self.closing: dict[Connection, int] = {}
        self.throttled: set[Connection] = set()  # publishers paused while the core holds them back
        #: Connections whose reading is paused until a wall-clock time (``max_publish_rate``).
        self.rate_paused: dict[Connection, float] = {}
        #: The transport of each open connection of the broker (the core never holds one); empty once every
        #: connection has closed.
        self.transports: dict[Connection, Any] = {}
        self.last_tick = time.monotonic()

    def perform(self, actions: list[Action], reading: Connection | None = None) -> bool:
        """Carry out ``actions``; True when the action for ``reading`` (the connection just read) says ``more``:
        its packets were written now and the caller calls :meth:`Broker.resume`."""
        more = False
        buffers = self.buffers
        for action in actions:
            conn = action.conn
            data = action.data
            if data:
                buf = buffers.get(conn)
                if buf is None:
                    buf = buffers[conn] = data
                else:
                    buf.extend(data)
                if conn is reading and len(buf) >= WRITE_NOW_PACKETS:
                    # Many packets for this connection (a SUBSCRIBE that matched many retained messages): written
                    # now, so the client reads them while the broker handles the other connections of this turn.
                    self.write_now(conn)
            if action.close:
                self.closing[conn] = action.close
                if action.reason:
                    log.debug("%s: closing (%s)", conn.peer, action.reason)
            if action.pause_until:
                self._pause(conn, action.pause_until)
            if action.more and conn is reading:
                # A long run of PUBACKs: what its first parts let into the window goes out now, so the client
                # works on it while the broker handles the rest.
                self.write_now(conn)
                more = True
        if actions:
            self.schedule_flush()
        return more

    def _pause(self, conn: Connection, until: float) -> None:
        transport = self.transports.get(conn)
        if transport is None or transport.is_closing():
            return
        if until == UNTIL_RELEASED:
            # Flow control: stop reading this publisher until the congested consumers catch up.
            if conn not in self.throttled:
                transport.pause_reading()
                self.throttled.add(conn)
            return
        # max_publish_rate: the core says until when (sans-I/O); one timer per pause.
        if conn not in self.rate_paused:
            transport.pause_reading()
            self.loop.call_later(max(0.0, until - time.time()), self._rate_pause_over, conn)
        self.rate_paused[conn] = until

    def _rate_pause_over(self, conn: Connection) -> None:
        """A ``max_publish_rate`` pause passed: the broker goes on with what waited (:meth:`Broker.pause_over`),
        and reading resumes unless it is paused again or the core holds the publisher back
        (:meth:`release_throttled` resumes it then)."""
        until = self.rate_paused.get(conn)
        transport = self.transports.get(conn)
        if until is None or transport is None or transport.is_closing():
            self.rate_paused.pop(conn, None)
            return
        now = time.time()
        if until > now:
            self.loop.call_later(until - now, self._rate_pause_over, conn)
            return
        del self.rate_paused[conn]
        try:
            if self.perform(self.broker.pause_over(conn, now), conn):
                while self.perform(self.broker.resume(conn, now), conn):
                    pass
        except Exception:
            log.exception("internal error while handling %s; closing that connection", conn)
            transport.close()
            return
        if conn in self.rate_paused or transport.is_closing():
            return  # paused again, or closed
        if conn not in self.throttled:
            transport.resume_reading()

    def write_now(self, conn: Connection) -> None:
        """Write ``conn``'s buffered packets at once; the end-of-turn flush still closes the connection if the
        broker asked."""
        out = self.buffers.pop(conn, None)
        transport = self.transports.get(conn)
        if out and transport is not None and not transport.is_closing() and self.closing.get(conn) != ABORT:
            transport.write(b"".join(out) if len(out) > 1 else out[0])

    def schedule_flush(self) -> None:
        """Ask for one :meth:`flush` at the end of this loop turn."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write every buffered connection's packets in one call each; close those the broker closed."""
        self._flush_scheduled = False
        transports = self.transports
        buffers = self.buffers
        closing = self.closing
        if buffers:
            self.buffers = {}
            for conn, out in buffers.items():
                transport = transports.get(conn)
                if transport is None or transport.is_closing() or closing.get(conn) == ABORT:
                    continue  # an abort writes nothing more: stuck (send_timeout)
                transport.write(b"".join(out) if len(out) > 1 else out[0])
        if closing:
            self.closing = {}
            for conn, how in closing.items():
                transport = transports.get(conn)
                if transport is None or transport.is_closing():
                    continue
                if how == ABORT:
                    transport.abort()
                else:
                    self.close_gracefully(transport)
        if self.throttled:
            self.release_throttled()

    def close_gracefully(self, transport: Any) -> None:
        """Send what is buffered and a FIN, keep reading (the broker ignores a closed connection's bytes) until the
        client closes or :data:`CLOSE_LINGER` passes, then close. Closing at once with unread bytes in the socket
        makes the kernel send a reset that can destroy the DISCONNECT before the client reads it."""
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except (OSError, RuntimeError):
                transport.close()
                return
            self.loop.call_later(CLOSE_LINGER, _close_lingering, transport)
        else:
            transport.close()

    def release_throttled(self) -> None:
        """Resume reading from publishers paused :data:`UNTIL_RELEASED` once the core no longer holds them back
        (:meth:`Broker.holds_back`: a commit made room under ``max_awaiting_rel``; no consumer is congested, or the
        paused connection is itself a congested consumer: its acknowledgements must get through), after what
        waited in the core (:meth:`Broker.release`)."""
        broker = self.broker
        for conn in list(self.throttled):
            if broker.holds_back(conn):
                continue
            self.throttled.discard(conn)
            transport = self.transports.get(conn)
            if transport is None or transport.is_closing():
                continue
            try:
                # A PUBLISH that waited for room under max_awaiting_rel goes first, then the bytes after it.
                now = time.time()
                if self.perform(broker.release(conn, now), conn):
                    while self.perform(broker.resume(conn, now), conn):
                        pass
            except Exception:
                log.exception("internal error while handling %s; closing that connection", conn)
                transport.close()
                continue
            if conn not in self.throttled and conn not in self.rate_paused and not transport.is_closing():
                transport.resume_reading()

    def start_ticker(self, interval: float = 1.0) -> None:
        """Start the one task that runs all broker deadlines (Keep Alive, expiry, retries, $SYS)."""
        self._ticker = self.loop.create_task(self._tick_forever(interval), name="broker-ticker")

    async def _tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.last_tick = time.monotonic()
            try:
                self.perform(self.broker.tick(time.time()))
            except Exception:  # a bug in one deadline must not stop the others
                log.exception("broker tick failed")
            self.flush()

    async def stop_ticker(self) -> None:
        """Cancel the ticker and wait for it."""
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None


def _close_lingering(transport: Any) -> None:
    if transport.is_closing():
        return  # the client closed its side first
    if transport.get_write_buffer_size():
        transport.abort()  # still flushing to a client that does not read: give up
    else:
        transport.close()


# Compiled with the core; the TLS listener's protocol (tls_accept.TlsMQTTProtocol) subclasses it in Python.
@mypyc_attr(allow_interpreted_subclasses=True)
class MQTTProtocol(asyncio.Protocol):
    """One client connection on one listener."""

    __slots__ = ("conn", "io", "limits", "listener", "transport")

    def __init__(self, io: BrokerIO, limits: ZoneLimits, listener: str) -> None:
        self.io = io
        self.limits = limits
        self.listener = listener
        self.conn: Connection | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple):
            peer = f"{peername[0]}:{peername[1]}"
        else:
            peer = f"unix:{self.listener}"
        # TCP_NODELAY: asyncio (3.7+) and uvloop set it on every TCP transport they create, tls_accept on its own.
        self.conn = self.io.broker.open(self.limits, self.listener, peer, time.time())
        self.transport = transport
        self.io.transports[self.conn] = transport
        high = self.limits.high_watermark
        transport.set_write_buffer_limits(high=high, low=high // 4)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            return
        io = self.io
        broker = io.broker
        now = time.time()
        try:
            if io.perform(broker.receive(conn, data, now), conn):
                while io.perform(broker.resume(conn, now), conn):
                    pass
        except Exception:
            # A bug must cost one connection, never the broker.
            log.exception("internal error while handling %s; closing that connection", conn)
            if self.transport is not None:
                self.transport.close()
        io.schedule_flush()  # also when nothing was written: a congestion that ended releases paused publishers

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.io.broker.pause_writing(self.conn, time.time())

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.io.perform(self.io.broker.resume_writing(self.conn, time.time()))
            self.io.schedule_flush()

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is None:
            return
        io = self.io
        io.throttled.discard(conn)
        io.rate_paused.pop(conn, None)
        io.transports.pop(conn, None)
        try:
            io.perform(io.broker.connection_lost(conn, time.time()))
        except Exception:
            log.exception("internal error while closing %s", conn)
        self.transport = None
        io.schedule_flush()
