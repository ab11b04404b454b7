"""MQTT over WebSockets (MQTT 5.0 §6, MQTT 3.1.1 §6; issue 18): a thin adapter between a TCP or TLS connection and
the same :class:`~gateway.server.protocol.MQTTProtocol` that plain listeners use, with the WebSocket protocol
(RFC 6455) done by ``wsproto`` (sans-I/O).

- The HTTP upgrade is accepted on the listener's ``path`` only (``"/mqtt"`` by default; the query string is
  ignored); any other path is answered ``404 Not Found``, a request that is not a WebSocket upgrade ``400``. Of the
  subprotocols a client offers, the first of ``mqtt`` (MQTT 3.1.1 and 5.0) and ``mqttv3.1`` (older clients) is
  selected; a client offering neither, or none, is accepted without one (as EMQX's default
  ``fail_if_no_subprotocol = false``).
- Once upgraded, the payload of binary frames is handed to the broker as a byte stream: a frame may hold part of an
  MQTT packet or several, and the broker's codec reassembles them exactly as from TCP. Everything the broker
  writes goes out as one binary frame per write (one per connection per flush: :meth:`BrokerIO.flush`).
  A text frame closes the connection (MQTT-6.0.0-1); pings are answered; a Close frame is answered and the
  connection closed.
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
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from gateway.auth.tls import peer_common_name
from gateway.broker.limits import ZoneLimits
from gateway.server.protocol import BrokerIO, MQTTProtocol

log = logging.getLogger("gateway.server")

#: The WebSocket subprotocols selected, in the order of preference when a client offers several (MQTT 5.0 §6.0:
#: "mqtt"; MQTT 3.1 clients such as older Paho JavaScript ask for "mqttv3.1").
SUBPROTOCOLS = ("mqtt", "mqttv3.1")
#: RFC 6455 §7.4.1: 1000 normal closure, 1003 unsupported data (a text frame), 1002 protocol error.
CLOSE_NORMAL, CLOSE_UNSUPPORTED_DATA = 1000, 1003


def select_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer for the client's ``Sec-WebSocket-Protocol`` list: the first it offers of
    :data:`SUBPROTOCOLS` (case as offered), or None (the upgrade is accepted without one)."""
    for name in offered:
        if name.lower() in SUBPROTOCOLS:
            return name
    return None


class WebSocketTransport:
    """An asyncio-transport-shaped view of an upgraded WebSocket connection, for :class:`MQTTProtocol` and
    :class:`BrokerIO`: :meth:`write` sends the bytes as one binary frame, :meth:`write_eof` sends a Close frame
    and then a FIN; the rest (pausing, buffer limits, ``get_extra_info``) is the TCP/TLS transport's own."""

    __slots__ = ("raw", "ws")

    def __init__(self, raw: Any, ws: WSConnection) -> None:
        self.raw = raw
        self.ws = ws

    def write(self, data: bytes) -> None:
        if self.ws.state is ConnectionState.OPEN and not self.raw.is_closing():
            self.raw.write(self.ws.send(BytesMessage(data=data)))

    def _send_close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        if self.ws.state is ConnectionState.OPEN and not self.raw.is_closing():
            self.raw.write(self.ws.send(CloseConnection(code=code, reason=reason)))

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
        limits: the listener's zone limits (``connect_timeout``, seconds, bounds the upgrade too).
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
        self.ws = WSConnection(ConnectionType.SERVER)
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
        if ws.state is ConnectionState.CLOSED or raw is None:
            return  # lingering after the close: discard
        try:
            ws.receive_data(data)
            self._handle_events()
        except RemoteProtocolError as exc:  # a bad HTTP upgrade request
            self._reject(
                exc.event_hint if isinstance(exc.event_hint, RejectConnection) else RejectConnection(),
                f"bad WebSocket upgrade: {exc}",
            )
        except LocalProtocolError:
            raw.close()

    def _handle_events(self) -> None:
        ws, raw = self.ws, self.raw
        chunks: list[bytes] = []
        more = True
        while more:  # an accepted upgrade may leave frames that came with the request: look again
            more = False
            for event in ws.events():
                if isinstance(event, BytesMessage):
                    chunks.append(event.data)
                elif isinstance(event, Request):
                    more = self._upgrade(event)
                elif isinstance(event, Ping):
                    raw.write(ws.send(event.response()))
                elif isinstance(event, TextMessage):
                    # MQTT-6.0.0-1: packets come in binary frames; any other data frame closes the connection
                    self._deliver(chunks)
                    log.info(
                        "%s (listener %r): a WebSocket text frame (MQTT-6.0.0-1: binary frames only); closed",
                        self.peer,
                        self.listener,
                    )
                    raw.write(ws.send(CloseConnection(code=CLOSE_UNSUPPORTED_DATA, reason="binary frames only")))
                    raw.close()
                    return
                elif isinstance(event, CloseConnection):
                    self._deliver(chunks)
                    if ws.state is ConnectionState.REMOTE_CLOSING:
                        raw.write(ws.send(event.response()))
                    raw.close()
                    return
        self._deliver(chunks)

    def _deliver(self, chunks: list[bytes]) -> None:
        if chunks and self.mqtt is not None:
            self.mqtt.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            chunks.clear()
            # Write what this read produced now rather than at the end of the loop turn: decoding frames costs far
            # more per packet than MQTT alone, and uvloop reads up to 32 times per socket in one turn, so a turn
            # can take seconds; subscribers would get nothing meanwhile, and their write buffers would not report
            # congestion (high_watermark) in time to hold publishers back.
            self.io.flush()

    def _upgrade(self, request: Request) -> bool:
        """Accept the upgrade on the listener's path (a new :class:`MQTTProtocol` takes the connection) or answer
        404. Returns True when accepted."""
        path = request.target.split("?", 1)[0]
        if path != self.path:
            self._reject(
                RejectConnection(
                    status_code=404, has_body=True, headers=[(b"content-type", b"text/plain; charset=utf-8")]
                ),
                f"no WebSocket endpoint at {path!r} (this listener's path is {self.path!r})",
                body=True,
            )
            return False
        raw = self.raw
        raw.write(self.ws.send(AcceptConnection(subprotocol=select_subprotocol(request.subprotocols))))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.wst = WebSocketTransport(raw, self.ws)
        mqtt = self.mqtt = MQTTProtocol(self.io, self.limits, self.listener)
        mqtt.connection_made(self.wst)
        conn = mqtt.conn
        if conn is not None:
            assert self.accepted_at is not None
            conn.opened_at = self.accepted_at  # CONNECT's deadline counts from the accept, upgrade included
            conn.cert_cn = peer_common_name(raw.get_extra_info("peercert"))  # wss with a client certificate
        return True

    def _reject(self, event: RejectConnection, why: str, body: bool = False) -> None:
        raw = self.raw
        log.debug("%s (listener %r): %s; answered %d", self.peer, self.listener, why, event.status_code)
        if body and not event.has_body:
            event = RejectConnection(status_code=event.status_code, headers=event.headers, has_body=True)
        try:
            raw.write(self.ws.send(event))
            if event.has_body:
                raw.write(self.ws.send(RejectData(data=(why + "\n").encode())))
        except LocalProtocolError:
            pass
        if raw.can_write_eof():
            raw.write_eof()  # the response is read before the close
            self.io.loop.call_later(1.0, raw.close)
        else:
            raw.close()

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
