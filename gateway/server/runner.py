"""Run the broker: bind the listeners, notify systemd, serve until SIGTERM/SIGINT, shut down cleanly.

Shutdown: stop accepting, DISCONNECT every 5.0 client with 0x8B (Server shutting down), write what is pending,
close the store, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from gateway.auth.throttle import FailureThrottle
from gateway.auth.tls import TlsConfigError, build_server_context
from gateway.broker.broker import Broker
from gateway.broker.limits import ZoneLimits
from gateway.broker.store_port import MemoryStore, SessionStore
from gateway.server.auth_files import reload_access
from gateway.server.config import GatewayConfig
from gateway.server.load_progress import LoadReporter
from gateway.server.notify import SystemdNotify, install_debug_hang
from gateway.server.protocol import BrokerIO, MQTTProtocol
from gateway.server.tls_accept import TlsListener
from gateway.store.lmdb_store import LmdbStore

if TYPE_CHECKING:
    from gateway.server.websocket import WebSocketProtocol
    from gateway.upstream import UpstreamBridge

log = logging.getLogger("gateway.server")


class BindError(Exception):
    """A listener could not bind (address in use, permission denied, ...)."""


def reload_security(config: GatewayConfig, broker: Broker, tls_listeners: dict[str, TlsListener]) -> None:
    """SIGHUP: read the password and ACL files and the TLS certificates and keys again, without dropping any
    connection (mosquitto.conf(5): Mosquitto reloads the same on SIGHUP). Password and ACL files are all or
    nothing: a file that fails to parse is logged (file, line, reason) and every listener keeps its previous rules.
    A TLS listener whose files fail keeps its previous context; new handshakes use the new one, established TLS
    connections go on with theirs. Connected clients get their ACL rules resolved again from the new files."""
    log.info("SIGHUP: reloading password files, ACL files and TLS certificates")
    access = reload_access({lc.name: lc.auth for lc in config.listeners})
    if access is not None:
        broker.reload_access(access, time.time())
    for lc in config.listeners:
        tls = tls_listeners.get(lc.name)
        if tls is None or lc.tls is None:
            continue
        try:
            tls.context = build_server_context(lc.tls)
        except TlsConfigError as exc:
            log.error("reload: listener %r: %s; keeping the previous TLS certificate and key", lc.name, exc)
        else:
            log.info("reload: listener %r: TLS certificate and key reloaded", lc.name)


def _start_metrics(config: GatewayConfig, broker: Broker, loop: asyncio.AbstractEventLoop, lmdb_store: Any,
                   upstream: Any, servers: list[Any], store: SessionStore) -> Any:
    """``[metrics] bind``: start the Prometheus endpoint (gateway/server/metrics.py; imported only when configured),
    or None when off.

    Raises:
        BindError: it cannot listen there; the listeners are closed and the store too.
    """
    if config.metrics_bind is None:
        return None
    from gateway.metrics_endpoint import MetricsServer
    from gateway.server.metrics import BrokerCollector

    metrics = MetricsServer(config.metrics_bind, BrokerCollector(broker, loop, lmdb_store, upstream))
    try:
        where = metrics.start()
    except OSError as exc:
        for server in servers:
            server.close()
        store.close()
        reason = exc.strerror or str(exc)
        raise BindError(f"cannot listen on {config.metrics_bind} ([metrics] bind): {reason}") from None
    log.info("metrics: Prometheus /metrics on http://%s/metrics", where)
    return metrics


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives.

    Raises:
        BindError: a listener could not bind; nothing is left listening.
    """
    loop = asyncio.get_running_loop()
    store: SessionStore
    if config.store_backend == "lmdb":
        first = config.listeners[0].limits if config.listeners else ZoneLimits()
        lmdb_store = LmdbStore(config.store, lambda: first)
        store = lmdb_store
        log.info("store: LMDB at %s (max_size %d bytes, commit_interval %.3f s, lazy_commit %.3f s)",
                 os.path.abspath(config.store.path), config.store.max_size, config.store.commit_interval,
                 config.store.lazy_commit)
    else:
        lmdb_store = None
        store = MemoryStore()
        log.warning("store: memory only; persistent sessions and retained messages do not survive a restart")
    # Who may connect and what they may do, per listener (the files were read with the configuration)
    config.broker.access = {lc.name: lc.auth.access() for lc in config.listeners}
    config.broker.throttle = FailureThrottle()
    for lc in config.listeners:
        if not lc.auth.allow_anonymous and lc.auth.passwords is None and not lc.auth.use_identity_as_username:
            log.warning("listener %r: allow_anonymous is false and there is no password_file: no client can connect",
                        lc.name)
    loading = LoadReporter()  # log lines and STATUS= while a large store loads (gateway/server/load_progress.py)
    if lmdb_store is not None:
        lmdb_store.on_load_progress = loading
    try:
        broker = Broker(config.broker, store, now=time.time())
    finally:
        loading.done()
    io = BrokerIO(broker, loop)
    if lmdb_store is not None:
        lmdb_store.attach(loop, io.schedule_flush)
        lmdb_store.on_queue_rows_lost = broker.queue_rows_lost  # entries whose rows a commit did not write

        def change_failed(client_ids: set[str]) -> None:
            io.perform(broker.store_change_failed(client_ids, time.time()))  # before that commit's barrier

        # The commit reports, as inputs of the core: it emits the acknowledgements held under the barriers.
        def committed(barrier: int) -> None:
            io.perform(broker.committed(barrier, time.time()))

        def failed(barrier: int, full: bool) -> None:
            io.perform(broker.failed(barrier, full, time.time()))

        lmdb_store.on_change_failed = change_failed
        lmdb_store.on_committed = committed
        lmdb_store.on_failed = failed
    upstream: UpstreamBridge | None = None
    if config.upstreams:
        # Imported only when configured: aiomqtt and paho cost ~2 MiB of RSS on a broker without uplinks.
        from gateway.upstream import UpstreamBridge

        upstream = UpstreamBridge(config.upstreams, broker, io.perform)
        upstream.attach(time.time())  # outbox loaded and forwarders hooked in before any client can publish
    servers: list[asyncio.AbstractServer] = []
    server: asyncio.AbstractServer
    tls_listeners: dict[str, TlsListener] = {}
    if any(listener.protocol == "websockets" for listener in config.listeners):
        # Imported only when configured: the WebSockets codec costs about 0.7 MiB of RSS on a broker without.
        from gateway.server.websocket import WebSocketProtocol
    try:
        for listener in config.listeners:
            def factory(lc=listener) -> MQTTProtocol | WebSocketProtocol:  # type: ignore[no-untyped-def]
                if lc.protocol == "websockets":  # MQTT over WebSockets: an MQTTProtocol behind the upgrade
                    return WebSocketProtocol(io, lc.limits, lc.name, lc.path)
                return MQTTProtocol(io, lc.limits, lc.name)

            try:
                if listener.is_unix:
                    with contextlib.suppress(FileNotFoundError):
                        if os.path.exists(listener.bind) and not os.path.isfile(listener.bind):
                            os.unlink(listener.bind)
                    server = await loop.create_unix_server(factory, listener.bind)
                    where = listener.bind
                else:
                    host, port = listener.host_port()
                    if listener.tls is not None:  # its own accept loop and handshake (gateway/server/tls_accept.py)
                        wss = None
                        if listener.protocol == "websockets":
                            def wss(accepted_at: float, lc=listener) -> WebSocketProtocol:  # type: ignore[no-untyped-def]
                                return WebSocketProtocol(io, lc.limits, lc.name, lc.path, accepted_at)
                        # Not abstract in use: it serves from start(); the runner calls neither start_serving
                        # nor serve_forever, which it leaves abstract (asyncio.AbstractServer's raise as well)
                        tls = TlsListener(io, build_server_context(listener.tls), listener.name,  # type: ignore[abstract]
                                          listener.limits, wss)
                        tls_listeners[listener.name] = tls
                        sockets: Any = await tls.start(host, port)
                        server = tls
                    else:
                        server = await loop.create_server(factory, host, port, reuse_address=True, backlog=1024)
                        sockets = server.sockets
                    addr = sockets[0].getsockname()
                    where = f"{addr[0]}:{addr[1]}" if ":" not in addr[0] else f"[{addr[0]}]:{addr[1]}"
            except OSError as exc:
                reason = exc.strerror or str(exc).rsplit(": ", 1)[-1]
                raise BindError(f"cannot listen on {listener.bind} (listener {listener.name!r}): {reason}") from None
            except TlsConfigError as exc:  # a file changed since the configuration was checked
                raise BindError(f"cannot listen on {listener.bind} (listener {listener.name!r}): {exc}") from None
            servers.append(server)
            log.info("listening on %s (listener %r, max_inflight=%d, max_mqueue_len=%d%s%s)", where, listener.name,
                     listener.limits.max_inflight, listener.limits.max_mqueue_len,
                     ", TLS" if listener.tls is not None else "",
                     f", WebSockets on {listener.path}" if listener.protocol == "websockets" else "")
    except BindError:
        for server in servers:
            server.close()
        store.close()
        raise
    metrics = _start_metrics(config, broker, loop, lmdb_store, upstream, servers, store)

    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, reload_security, config, broker, tls_listeners)
    io.start_ticker()
    if upstream is not None:
        upstream.start()
    install_debug_hang(loop, lmdb_store)
    notify = SystemdNotify(broker, io, lmdb_store, len(servers), upstream)
    notify.ready()  # READY=1, then STATUS= and WATCHDOG=1 pings while healthy (gateway/server/notify.py)
    log.info("edge-gateway ready")
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        notify.stopping()
        await notify.close()
        for server in servers:
            server.close()
        await io.stop_ticker()
        if upstream is not None:
            await upstream.stop()
        io.perform(broker.shutdown(time.time()))
        io.flush()
        # Let the transports write their last bytes (DISCONNECT 0x8B) before the loop ends.
        deadline = time.monotonic() + 2.0
        while io.transports and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)
        if metrics is not None:
            metrics.stop()
        broker.store.close()
        if lmdb_store is not None:
            log.info("store closed: %d commits of %d changes", lmdb_store.commits, lmdb_store.committed_ops)
        for server in servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        log.info("stopped")
