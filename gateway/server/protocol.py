"""The asyncio adapter between sockets and the sans-I/O :class:`~gateway.broker.broker.Broker`.

Each connection's bytes go to the broker as they arrive; everything the broker wants written is sent once per
loop turn per connection (one ``transport.write`` with all of that turn's packets), and connections the broker
closed are closed after their last bytes. The broker never sees a transport: :attr:`BrokerIO.transports` maps
each of its :class:`~gateway.broker.session_state.Connection` objects to one. When the broker leaves part of a read
pending (``Connection.pending``: a long run of PUBACKs, handled in parts), the connection's output is written at
once and :meth:`Broker.resume` called, within the same ``data_received``, until nothing is pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.broker.broker import Broker
from gateway.broker.limits import ZoneLimits
from gateway.broker.session_state import Connection

log = logging.getLogger("gateway.server")

#: Seconds a connection the broker closed keeps reading (and discarding) after its last packet and a FIN went out,
#: so the client reads the DISCONNECT or CONNACK that says why instead of a reset caused by unread data.
CLOSE_LINGER = 1.0

#: Packets queued for the connection just read after which they are written at once instead of at the end of the
#: loop turn (once per connection and turn otherwise, so that acknowledgements and fan-in deliveries share a write).
WRITE_NOW_PACKETS = 256


class BrokerIO:
    """Owns the broker's I/O side: the flush scheduled once per loop turn and the one-second ticker."""

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker = broker
        self.loop = loop
        self._flush_scheduled = False
        self._ticker: asyncio.Task[None] | None = None
        self.throttled: set[MQTTProtocol] = set()  # publishers paused while a consumer is congested
        self.rate_paused: set[MQTTProtocol] = set()  # reading paused until Connection.paused_until (max_publish_rate)
        #: The transport of each open connection of the broker (the core never holds one); empty once every
        #: connection has closed.
        self.transports: dict[Connection, Any] = {}
        self.last_tick = time.monotonic()

    def write_now(self, conn: Connection) -> None:
        """Write ``conn``'s pending packets at once (between the parts of a long run of PUBACKs); the end-of-turn
        flush still closes the connection if the broker asked."""
        transport = self.transports.get(conn)
        out = conn.out
        if out and transport is not None and not transport.is_closing():
            transport.write(b"".join(out) if len(out) > 1 else out[0])
            out.clear()

    def schedule_flush(self) -> None:
        """Ask for one :meth:`flush` at the end of this loop turn."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write every dirty connection's pending packets in one call; close those the broker closed."""
        self._flush_scheduled = False
        dirty = self.broker.dirty
        if not dirty:
            return
        conns = list(dirty)
        dirty.clear()
        transports = self.transports
        for conn in conns:
            transport = transports.get(conn)
            out = conn.out
            if transport is None or transport.is_closing():
                out.clear()
                continue
            if conn.abort:
                out.clear()
                transport.abort()  # stuck: nothing more can be written (send_timeout)
                continue
            if out:
                transport.write(b"".join(out) if len(out) > 1 else out[0])
                out.clear()
            if conn.close_after_flush:
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
        """Resume reading from paused publishers once no consumer is congested, and at once from any paused
        connection that is itself a congested consumer (its acknowledgements must get through)."""
        congested = self.broker.congested
        for proto in list(self.throttled):
            conn = proto.conn
            if not congested or conn is None or conn.session in congested:
                self.throttled.discard(proto)
                if proto.transport is not None and proto not in self.rate_paused:
                    proto.transport.resume_reading()

    def start_ticker(self, interval: float = 1.0) -> None:
        """Start the one task that runs all broker deadlines (Keep Alive, expiry, retries, $SYS)."""
        self._ticker = self.loop.create_task(self._tick_forever(interval), name="broker-ticker")

    async def _tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.last_tick = time.monotonic()
            try:
                self.broker.tick(time.time())
            except Exception:  # a bug in one deadline must not stop the others
                log.exception("broker tick failed")
            self.flush()
            if self.throttled:
                self.release_throttled()

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
        broker, transport = io.broker, self.transport
        published = broker.stats.publish_received
        now = time.time()
        try:
            broker.receive(conn, data, now)
            while conn.pending:
                # A long run of PUBACKs: what its first parts let into the window goes out now, so the client
                # works on it while the broker handles the rest.
                io.write_now(conn)
                broker.resume(conn, now)
            if len(conn.out) >= WRITE_NOW_PACKETS:
                # Many packets for this connection (a SUBSCRIBE that matched many retained messages): written now,
                # so the client reads them while the broker handles the other connections of this loop turn.
                io.write_now(conn)
        except Exception:
            # A bug must cost one connection, never the broker.
            log.exception("internal error while handling %s; closing that connection", conn)
            conn.pending = False
            transport.close()
        congested = broker.congested
        if congested and broker.stats.publish_received != published and conn.session not in congested \
                and transport is not None and not transport.is_closing():
            # Flow control: stop reading this publisher until the congested consumers catch up.
            transport.pause_reading()
            io.throttled.add(self)
        if conn.paused_until > now and self not in io.rate_paused and transport is not None \
                and not transport.is_closing():
            # max_publish_rate: the core says until when (sans-I/O); one timer per pause.
            transport.pause_reading()
            io.rate_paused.add(self)
            io.loop.call_later(conn.paused_until - now, self._rate_pause_over)
        io.schedule_flush()

    def _rate_pause_over(self) -> None:
        """The ``max_publish_rate`` pause passed: read again (unless the debt grew meanwhile, or a congested
        consumer still holds this publisher back: :meth:`BrokerIO.release_throttled` resumes it then)."""
        io, conn, transport = self.io, self.conn, self.transport
        if conn is None or transport is None or transport.is_closing():
            io.rate_paused.discard(self)
            return
        delay = conn.paused_until - time.time()
        if delay > 0:
            io.loop.call_later(delay, self._rate_pause_over)
            return
        io.rate_paused.discard(self)
        self.data_received(b"")  # the PUBLISH that waited and the bytes read after it (Broker.receive)
        if self in io.rate_paused or self.transport is None or self.transport.is_closing():
            return  # paused again, or closed
        if self not in io.throttled:
            transport.resume_reading()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.io.broker.pause_writing(self.conn, time.time())

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.io.broker.resume_writing(self.conn, time.time())
            self.io.schedule_flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.io.throttled.discard(self)
        self.io.rate_paused.discard(self)
        conn = self.conn
        if conn is None:
            return
        try:
            self.io.broker.connection_lost(conn, time.time())
        except Exception:
            log.exception("internal error while closing %s", conn)
        self.io.transports.pop(conn, None)
        self.transport = None
        self.io.schedule_flush()
