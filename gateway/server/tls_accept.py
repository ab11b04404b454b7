"""Accepting TLS connections on a listener: an accept loop of its own and a server-side TLS handshake by
:meth:`asyncio.loop.connect_accepted_socket` (``ssl=``, ``ssl_handshake_timeout=`` the listener's
``connect_timeout``); a failed handshake closes that connection with one log line, rate-limited per peer host and
reason (the broker's :class:`~gateway.broker.ratelog.RateLimitedLog`: at most one line a minute), and the broker goes
on.

Why not ``loop.create_server(ssl=ctx)``: asyncio (3.11) and uvloop then run the handshake inside the transport,
log a failure only in debug mode and never tell anyone, so a plaintext client on the TLS port or a refused client
certificate would vanish without a trace. ``connect_accepted_socket`` is documented to return once the handshake
is done and raises its error otherwise, on both loops. (``loop.start_tls`` on a plain TCP transport is the other
documented way, but uvloop starts reading right after ``connection_made`` whatever the protocol paused, so a
ClientHello that arrives at once would reach the plain protocol instead of the TLS one.)

The SSL protocol calls :meth:`TlsMQTTProtocol.connection_made` when the handshake is done, before it delivers any
decrypted byte (a TLS 1.3 client may send CONNECT in the same segment as its Finished), so the verified client
certificate's CN is on the broker's ``Connection.cert_cn`` before CONNECT is handled.

A refused handshake tells the client why, as RFC 8446 §6.2 and RFC 5246 §7.2 want of the side that detects the
error: the TLS alert OpenSSL produced (``certificate_expired``, ``unknown_ca``, ``handshake_failure`` in TLS 1.2 or
``certificate_required`` in TLS 1.3 for a missing client certificate, ...) is written before the close, then a FIN.
Both loops' SSL protocols abort the transport on a failed handshake without writing it, so the context
(:class:`gateway.auth.tls.ServerContext`) hands it over on the exception, and the handshake keeps a second
descriptor of the connection (``socket.dup``) to write it on after the loop has let go of its own. A plaintext
client gets no alert (OpenSSL writes none for a record that is not TLS), a client that stalls none either.

One time budget per connection: the handshake may take at most ``connect_timeout`` seconds, and the broker's
CONNECT deadline counts from the TCP accept (``Connection.opened_at`` is the accept time), so handshake + CONNECT
take at most ``connect_timeout`` (plus the broker's one-second tick).

Plaintext listeners do not pass through this module: they keep ``loop.create_server`` and :class:`MQTTProtocol`
and pay nothing per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from gateway.auth.tls import peer_common_name
from gateway.broker.limits import ZoneLimits
from gateway.broker.ratelog import peer_host
from gateway.server.protocol import BrokerIO, MQTTProtocol

log = logging.getLogger("gateway.server")

#: accept() errors that mean "out of a resource for now" (asyncio's accept loop pauses on them too)
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: seconds the accept loop waits after such an error (asyncio's ``constants.ACCEPT_RETRY_DELAY``)
ACCEPT_RETRY_DELAY = 1.0


def handshake_failure(exc: BaseException) -> tuple[str, str]:
    """``(reason key, text)`` for a failed server-side handshake: the OpenSSL reason (``WRONG_VERSION_NUMBER`` for
    a plaintext client, ``CERTIFICATE_VERIFY_FAILED`` for a client certificate that does not verify, with
    OpenSSL's verify message such as "certificate has expired" in the key so each cause gets its line), a timeout,
    or the peer closing first."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or "certificate verify failed"
        return f"CERTIFICATE_VERIFY_FAILED: {why}", f"client certificate refused: {why}"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or type(exc).__name__
        # "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)" -> "wrong version number"
        text = str(exc.strerror or exc).rpartition("] ")[2].split(" (_ssl.c:")[0]
        hint = "; a plaintext client on a TLS port?" if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST") else ""
        return reason, f"{text} ({reason}{hint})"
    if isinstance(exc, TimeoutError) or (isinstance(exc, ConnectionAbortedError) and "longer" in str(exc)):
        return "handshake_timeout", "not finished within connect_timeout"
    if isinstance(exc, ConnectionError | EOFError):
        return "closed_in_handshake", f"the client closed the connection ({type(exc).__name__})"
    return type(exc).__name__, f"{type(exc).__name__}: {exc}"


def send_alert(sock: socket.socket, alert: bytes) -> None:
    """Write the TLS alert of a failed handshake (``alert``: the records OpenSSL produced, a few dozen bytes) on
    ``sock``, then a FIN, as the side that detects the error must before it closes (RFC 8446 §6.2, RFC 5246 §7.2).
    Best effort and never blocking: the socket is non-blocking, the alert fits its empty send buffer, and a peer
    that is already gone (``OSError``) is only left alone."""
    with contextlib.suppress(OSError):
        sock.send(alert)
        sock.shutdown(socket.SHUT_WR)


class TlsMQTTProtocol(MQTTProtocol):
    """:class:`MQTTProtocol` on a TLS connection: at ``connection_made`` (the handshake is done) it sets the
    broker's ``Connection.opened_at`` to the accept time and ``Connection.cert_cn`` to the verified client
    certificate's first CN (``None`` without one). Everything per message is :class:`MQTTProtocol`'s."""

    __slots__ = ("accepted_at",)

    def __init__(self, io: BrokerIO, limits: ZoneLimits, listener: str, accepted_at: float) -> None:
        super().__init__(io, limits, listener)
        self.accepted_at = accepted_at

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        conn = self.conn
        if conn is not None:
            self.io.broker.accepted_at(conn, self.accepted_at, peer_common_name(transport.get_extra_info("peercert")))


class TlsListener(asyncio.AbstractServer):
    """One TLS listener: its listening sockets, one accept loop per socket, and the handshakes in progress.

    Args:
        io: the broker's I/O side (its broker's ``rlog`` logs failures, so ``$SYS`` counts the suppressed lines).
        context: the server context from :func:`gateway.auth.tls.build_server_context`.
        name: the listener's name, for log lines.
        limits: the listener's zone limits; ``connect_timeout`` (seconds) bounds the handshake.
        protocol_factory: builds the protocol of a connection whose handshake is done, given its accept time
            (seconds since the epoch); None: a :class:`TlsMQTTProtocol` (``wss`` listeners give a
            :class:`~gateway.server.websocket.WebSocketProtocol`).
    """

    def __init__(self, io: BrokerIO, context: ssl.SSLContext, name: str, limits: ZoneLimits,
                 protocol_factory: Callable[[float], asyncio.BaseProtocol] | None = None) -> None:
        self.io = io
        self.protocol_factory = protocol_factory
        self.context = context
        self.name = name
        self.limits = limits
        self.sockets: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self.pending: set[asyncio.Task[None]] = set()  # handshakes in progress
        self.failed = 0  # handshakes that failed, all causes
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> list[socket.socket]:
        """Bind every address ``host`` resolves to (as ``loop.create_server``: ``SO_REUSEADDR``, IPv6 sockets
        v6-only), listen and start accepting; return the sockets.

        Raises:
            OSError: an address cannot be bound; nothing is left listening.
        """
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen: set[tuple[int, Any]] = set()
        try:
            for family, kind, proto, _name, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
        except OSError:
            for sock in self.sockets:
                sock.close()
            self.sockets.clear()
            raise
        for sock in self.sockets:
            task = loop.create_task(self._accept_forever(sock))
            # closed once the accept loop has ended (and the loop has stopped watching the descriptor)
            task.add_done_callback(lambda _task, sock=sock: sock.close())  # type: ignore[misc]
            self._accepting.append(task)
        return self.sockets

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(sock)
            except OSError as exc:
                # the peer gave up before accept (ECONNABORTED), or out of descriptors/buffers: wait a moment
                if exc.errno in _RESOURCE_ERRORS:
                    self.io.broker.rlog.error(time.time(), self.name, "accept_" + errno.errorcode.get(exc.errno, "?"),
                                              "listener %r: accept failed (%s); retrying in %.0f s", self.name,
                                              exc.strerror, ACCEPT_RETRY_DELAY)
                    await asyncio.sleep(ACCEPT_RETRY_DELAY)
                continue
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else f"?:{self.name}"
            task = loop.create_task(self._handshake(conn, peer, time.time()))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _handshake(self, sock: socket.socket, peer: str, accepted_at: float) -> None:
        loop = asyncio.get_running_loop()
        # A second descriptor of the connection: the loop closes its own as it aborts a failed handshake; this one
        # keeps the connection open until the TLS alert has been written on it. Out of descriptors, the handshake
        # goes on without it (a refusal is then a bare close, as before).
        spare: socket.socket | None
        try:
            spare = sock.dup()
        except OSError:
            spare = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # returns once the handshake is done (TlsMQTTProtocol.connection_made has run); on a failure the
            # loop closes the connection and raises here
            make = self.protocol_factory
            await loop.connect_accepted_socket(
                (lambda: TlsMQTTProtocol(self.io, self.limits, self.name, accepted_at)) if make is None
                else (lambda: make(accepted_at)),  # type: ignore[arg-type,return-value]
                sock,
                ssl=self.context,
                ssl_handshake_timeout=self.limits.connect_timeout,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # ssl.SSLError, ConnectionError, TimeoutError: that connection only
            self.failed += 1
            key, text = handshake_failure(exc)
            if key == "handshake_timeout":
                text += f" ({self.limits.connect_timeout:g} s)"
            self.io.broker.rlog.warning(
                time.time(), peer_host(peer), "tls_" + key, "%s (listener %r): TLS handshake failed: %s; closed",
                peer, self.name, text,
            )
            unsent = getattr(exc, "unsent", b"")
            if unsent and spare is not None:
                send_alert(spare, unsent)
        finally:
            if spare is not None:
                spare.close()  # a connection whose handshake is done is the transport's alone from here

    # asyncio.AbstractServer, for the runner's shutdown

    def close(self) -> None:
        """Stop accepting (the listening sockets close as their accept loops end) and abandon the handshakes in
        progress (their connections are closed by the loop)."""
        for task in (*self._accepting, *self.pending):
            task.cancel()

    async def wait_closed(self) -> None:
        """Wait until the accept loops and the abandoned handshakes have ended."""
        tasks = [*self._accepting, *self.pending]
        if tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the listener runs in (after :meth:`start`)."""
        if self._loop is None:
            raise RuntimeError("TlsListener.start() was not called")
        return self._loop

    def is_serving(self) -> bool:
        """True while accepting."""
        return any(not task.done() for task in self._accepting)
