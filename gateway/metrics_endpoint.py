"""The ``/metrics`` endpoint the broker (gateway/server/metrics.py) and firmware-bridge (firmware_bridge/metrics.py)
share: prometheus-client's own ``start_http_server`` (a ``ThreadingWSGIServer`` in a daemon thread) over a registry
holding one custom collector and the process collector, and :func:`call_on_loop`, with which a collector running
in that thread takes its snapshot on the event loop that owns the state, where it is consistent."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.registry import Collector

from gateway.values import parse_address

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("gateway.metrics")

#: Seconds a scrape waits for the event loop's snapshot before it answers without it.
SNAPSHOT_TIMEOUT = 10.0

T = TypeVar("T")


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout: float = SNAPSHOT_TIMEOUT) -> T | None:
    """``fn()`` run on ``loop`` (directly when called there) and its result, waiting at most ``timeout`` seconds;
    ``None`` when the loop is closed or did not answer in time (logged). An exception of ``fn`` is raised here."""
    if loop.is_closed():
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return fn()
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the scraping thread
            future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
        return future.result(timeout)
    except RuntimeError:  # the loop closed meanwhile
        return None
    except concurrent.futures.TimeoutError:
        log.warning("metrics: the event loop did not answer within %.0f s; scrape without its metrics", timeout)
        return None


class MetricsServer:
    """``/metrics`` on ``bind`` (``host:port``): prometheus-client's HTTP server thread over a registry holding
    ``collector`` and the process collector.

    Raises:
        OSError: from :meth:`start`, when ``bind`` cannot be listened on.
        ValueError: from :meth:`start`, when ``bind`` is not a TCP ``host:port`` (gateway.values.parse_address).
    """

    def __init__(self, bind: str, collector: Collector) -> None:
        self.bind = bind
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Listen and serve in a daemon thread; returns where (``host:port``, the real port when 0 was asked)."""
        address = parse_address(self.bind)
        self._httpd, self._thread = start_http_server(address.port, address.host, self.registry)
        host, port = self._httpd.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host  # str for the AF_INET/AF_INET6 servers used here
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def stop(self) -> None:
        """Stop serving and close the socket (waits for the thread, at most 2 s)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(2.0)
        self._httpd = None
