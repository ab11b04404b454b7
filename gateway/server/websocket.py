"""MQTT over WebSockets (MQTT 5.0 §6, MQTT 3.1.1 §6): a thin adapter between a TCP or TLS connection and
the same :class:`~gateway.server.protocol.MQTTProtocol` that plain listeners use, with the WebSocket protocol
(RFC 6455) done by the ``websockets`` package's sans-I/O :class:`~websockets.server.ServerProtocol` (its C
extension unmasks frames; docs/benchmarks.md has the figures that chose it over wsproto).

- The HTTP upgrade is accepted on the listener's ``path`` only (``"/mqtt"`` by default; the query string is
  ignored); any other path is answered ``404 Not Found``, a request that is not a WebSocket upgrade (or that
  cannot be parsed) ``400 Bad Request``, with the reason as the body. Of the subprotocols a client offers, the
  first of ``mqtt`` (MQTT 3.1.1 and 5.0) and ``mqttv3.1`` (older clients) is selected; a client offering neither,
  or none, is accepted without one (as EMQX's default ``fail_if_no_subprotocol = false``). No extension is
  negotiated: permessage-deflate, which browsers offer, is declined (MQTT packets are small, and compressing
  costs CPU per frame and a compression context per connection).
- Once upgraded, the payload of binary frames is handed to the broker as a byte stream: a frame may hold part of an
  MQTT packet or several, and the broker's codec reassembles them exactly as from TCP; a fragmented message's
  continuation frames are part of the stream. All the frames of one read go to the broker in one call. A frame
  longer than the listener's ``max_packet_size`` (bytes) closes the connection with 1009 (Message Too Big): the
  library holds a whole frame before handing it over, so this bounds a connection's memory as the codec does on
  TCP. Everything the broker writes goes out as one binary frame per write (one per connection per flush:
  :meth:`BrokerIO.flush`).
- A text frame closes the connection with 1003 (MQTT-6.0.0-1); a frame the library finds invalid (not masked, bad
  opcode, ...) with 1002; pings are answered (by the library); a Close frame is answered and the connection
  closed. The broker sends no WebSocket pings of its own: MQTT's keep alive (PINGREQ) covers idle connections.
- Every broker feature works the same, because the broker sees an :class:`MQTTProtocol` like any other: sessions,
  Receive Maximum, the store, authentication and ACLs (``use_identity_as_username`` from a ``wss`` client
  certificate), limits, flow control (``high_watermark``, ``send_timeout``, pausing publishers), and the
  connection counts. The listener's ``connect_timeout`` (seconds) bounds the upgrade and the CONNECT together:
  the broker's CONNECT deadline counts from the TCP accept (or the start of the TLS handshake, for ``wss``).
  One difference: what a WebSocket read produced is written at the end of that read (:meth:`BrokerIO.flush`),
  not once per loop turn, because frame decoding makes a loop turn long.

``wss`` is a websockets listener with TLS keys: :class:`~gateway.server.tls_accept.TlsListener` does the handshake
and then builds a :class:`WebSocketProtocol` instead of a ``TlsMQTTProtocol``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from websockets.frames import BINARY, CONT, TEXT, Frame
from websockets.http11 import Request
from websockets.protocol import CLOSED, CONNECTING, OPEN
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from gateway.auth.tls import peer_common_name
from gateway.broker.limits import ZoneLimits
from gateway.server.protocol import BrokerIO, MQTTProtocol

log = logging.getLogger("gateway.server")
#: The library's own per-connection lines ("connection open", "connection closed") name no peer and no client;
#: ours do. Its warnings and errors still come through.
library_log = logging.getLogger("gateway.server.websocket")
library_log.setLevel(logging.WARNING)

#: The WebSocket subprotocols selected, in the order of preference when a client offers several (MQTT 5.0 §6.0:
#: "mqtt"; MQTT 3.1 clients such as older Paho JavaScript ask for "mqttv3.1").
SUBPROTOCOLS = ("mqtt", "mqttv3.1")
#: RFC 6455 §7.4.1: 1000 normal closure, 1003 unsupported data (a text frame).
CLOSE_NORMAL, CLOSE_UNSUPPORTED_DATA = 1000, 1003
#: Seconds a rejected upgrade's connection stays open after the response and a FIN, so the client reads the answer.
REJECT_LINGER = 1.0


def select_subprotocol(offered: Sequence[str]) -> str | None:
    """The subprotocol to answer for the client's ``Sec-WebSocket-Protocol`` list: the first it offers of
    :data:`SUBPROTOCOLS` (case as offered), or None (the upgrade is accepted without one)."""
    for name in offered:
        if name.lower() in SUBPROTOCOLS:
            return name
    return None


def _select(_protocol: ServerProtocol, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    chosen = select_subprotocol(offered)
    return None if chosen is None else Subprotocol(chosen)


class WebSocketTransport:
    """An asyncio-transport-shaped view of an upgraded WebSocket connection, for :class:`MQTTProtocol` and
    :class:`BrokerIO`: :meth:`write` sends the bytes as one binary frame, :meth:`write_eof` sends a Close frame
    and then a FIN; the rest (pausing, buffer limits, ``get_extra_info``) is the TCP/TLS transport's own."""

    __slots__ = ("raw", "ws")

    def __init__(self, raw: Any, ws: ServerProtocol) -> None:
        self.raw = raw
        self.ws = ws

    def write(self, data: bytes) -> None:
        ws = self.ws
        if ws.state is OPEN and not self.raw.is_closing():
            ws.send_binary(data)
            for chunk in ws.data_to_send():
                self.raw.write(chunk)

    def _send_close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        ws = self.ws
        if ws.state is OPEN and not self.raw.is_closing():
            ws.send_close(code, reason)
            for chunk in ws.data_to_send():
                self.raw.write(chunk)

    def is_closing(self) -> bool:
        return bool(self.raw.is_closing())

    def close(self) -> None:
        self._send_close()
        self.raw.close()

    def abort(self) -> None:
        self.raw.abort()

    def can_write_eof(self) -> bool:
        return bool(self.raw.can_write_eof())

    def write_eof(self) -> None:
        self._send_close()
        self.raw.write_eof()

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return bool(self.raw.is_reading())

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high=high, low=low)

    def get_write_buffer_size(self) -> int:
        return int(self.raw.get_write_buffer_size())

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)


class WebSocketProtocol(asyncio.Protocol):
    """One connection on a ``protocol = "websockets"`` listener: the HTTP upgrade, then an :class:`MQTTProtocol`
    (``mqtt``) fed with the payload of binary frames.

    Args:
        io: the broker's I/O side.
        limits: the listener's zone limits (``connect_timeout``, seconds, bounds the upgrade too;
            ``max_packet_size``, bytes, bounds a frame).
        listener: the listener's name.
        path: the upgrade path (``ListenerConfig.path``).
        accepted_at: when the TCP connection was accepted (seconds since the epoch; for ``wss`` the TLS handshake
            ran since); None: now.
    """

    __slots__ = ("_timer", "accepted_at", "io", "limits", "listener", "mqtt", "path", "peer", "raw", "ws", "wst")

    def __init__(
        self, io: BrokerIO, limits: ZoneLimits, listener: str, path: str = "/mqtt", accepted_at: float | None = None
    ) -> None:
        self.io = io
        self.limits = limits
        self.listener = listener
        self.path = path
        self.accepted_at = accepted_at
        # max_size: no bound on a (fragmented) message, which is only part of the byte stream; each frame at most
        # max_packet_size. No extensions: permessage-deflate is declined. No origins check (any page may connect).
        self.ws = ServerProtocol(
            select_subprotocol=_select,
            max_size=(None, limits.max_packet_size),
            logger=library_log,
        )
        self.raw: Any = None
        self.wst: WebSocketTransport | None = None
        self.mqtt: MQTTProtocol | None = None
        self.peer = "?"
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.raw = transport
        if self.accepted_at is None:
            self.accepted_at = time.time()
        peername = transport.get_extra_info("peername")
        self.peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else f"unix:{self.listener}"
        # The upgrade and CONNECT share connect_timeout; the broker's own deadline takes over after the upgrade.
        self._timer = self.io.loop.call_later(self.limits.connect_timeout, self._upgrade_timeout)

    def _upgrade_timeout(self) -> None:
        self._timer = None
        if self.mqtt is None and self.raw is not None and not self.raw.is_closing():
            log.info(
                "%s (listener %r): no WebSocket upgrade within connect_timeout (%g s); closed",
                self.peer,
                self.listener,
                self.limits.connect_timeout,
            )
            self.raw.abort()

    def data_received(self, data: bytes) -> None:
        ws, raw = self.ws, self.raw
        if raw is None or ws.state is CLOSED:
            return  # lingering after the close: discard
        ws.receive_data(data)
        events = ws.events_received()
        chunks: list[bytes] = []
        for event in events:
            if type(event) is Frame:
                opcode = event.opcode
                if opcode is BINARY or opcode is CONT:
                    chunks.append(bytes(event.data))  # bytes already: the same object, no copy
                elif opcode is TEXT:
                    # MQTT-6.0.0-1: packets come in binary frames; any other data frame closes the connection
                    self._deliver(chunks)
                    log.info(
                        "%s (listener %r): a WebSocket text frame (MQTT-6.0.0-1: binary frames only); closed",
                        self.peer,
                        self.listener,
                    )
                    if ws.state is OPEN:
                        ws.fail(CLOSE_UNSUPPORTED_DATA, "binary frames only")
                    self._write_out(linger=False)
                    return
                # PING (the library queued the PONG), PONG: nothing to do; CLOSE: the library queued the answer
                # and a FIN, and ignores what follows (handled below)
            elif isinstance(event, Request) and not self._upgrade(event):
                return
        if chunks:
            self._deliver(chunks)
        if ws.writes:  # a PONG, the answer to a Close, a Close for a bad frame, or a refused upgrade
            if ws.parser_exc is not None and ws.state is not CONNECTING and self.mqtt is not None:
                log.info("%s (listener %r): WebSocket error: %s; closed", self.peer, self.listener, ws.parser_exc)
            self._write_out(linger=ws.state is CONNECTING)

    def _write_out(self, linger: bool) -> None:
        """Write what the library queued; its FIN (``b""``) ends the connection: a half-close that keeps reading for
        :data:`REJECT_LINGER` seconds when ``linger`` (a refused upgrade's answer is read), else a close."""
        raw, ws = self.raw, self.ws
        out = ws.data_to_send()
        if ws.state is CONNECTING and ws.handshake_exc is not None and not any(out):
            # an unparseable request: the library just ends the connection; answer 400 with its reason
            response = ws.reject(400, f"bad WebSocket upgrade request: {_reason(ws.handshake_exc)}\n")
            raw.write(response.serialize())
            log.debug(
                "%s (listener %r): bad WebSocket upgrade request (%s); answered 400",
                self.peer,
                self.listener,
                _reason(ws.handshake_exc),
            )
        for chunk in out:
            if chunk:
                raw.write(chunk)
                continue
            if linger and raw.can_write_eof():
                raw.write_eof()  # the response is read before the close
                self.io.loop.call_later(REJECT_LINGER, raw.close)
            else:
                raw.close()
            return

    def _deliver(self, chunks: list[bytes]) -> None:
        if chunks and self.mqtt is not None:
            self.mqtt.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            chunks.clear()
            # Write what this read produced now rather than at the end of the loop turn: decoding frames costs more
            # per packet than MQTT alone, and uvloop reads up to 32 times per socket in one turn, so a turn can take
            # long; subscribers would get nothing meanwhile, and their write buffers would not report congestion
            # (high_watermark) in time to hold publishers back.
            self.io.flush()

    def _upgrade(self, request: Request) -> bool:
        """Accept the upgrade on the listener's path (a new :class:`MQTTProtocol` takes the connection) or answer
        404 (another path) or 400 (not a valid WebSocket upgrade). Returns True when accepted."""
        ws = self.ws
        path = request.path.split("?", 1)[0]
        if path != self.path:
            why = f"no WebSocket endpoint at {path!r} (this listener's path is {self.path!r})"
            ws.send_response(ws.reject(404, why + "\n"))
            log.debug("%s (listener %r): %s; answered 404", self.peer, self.listener, why)
            self._write_out(linger=True)
            return False
        response = ws.accept(request)
        if response.status_code != 101:
            # not an upgrade (a plain GET), a bad key or version, another method: 400 with the library's reason
            why = _reason(ws.handshake_exc)
            ws.send_response(ws.reject(400, f"bad WebSocket upgrade request: {why}\n"))
            log.debug(
                "%s (listener %r): bad WebSocket upgrade request (%s); answered 400", self.peer, self.listener, why
            )
            self._write_out(linger=True)
            return False
        ws.send_response(response)
        raw = self.raw
        for chunk in ws.data_to_send():
            raw.write(chunk)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.wst = WebSocketTransport(raw, ws)
        mqtt = self.mqtt = MQTTProtocol(self.io, self.limits, self.listener)
        mqtt.connection_made(self.wst)
        conn = mqtt.conn
        if conn is not None:
            assert self.accepted_at is not None
            # CONNECT's deadline counts from the accept; wss with a client certificate: its CN.
            self.io.broker.accepted_at(conn, self.accepted_at, peer_common_name(raw.get_extra_info("peercert")))
        return True

    def pause_writing(self) -> None:
        if self.mqtt is not None:
            self.mqtt.pause_writing()

    def resume_writing(self) -> None:
        if self.mqtt is not None:
            self.mqtt.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.mqtt is not None:
            self.mqtt.connection_lost(exc)
        self.raw = None


def _reason(exc: BaseException | None) -> str:
    """The library's explanation of a failed handshake, causes included."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "; ".join(p for p in parts if p) or "invalid request"
