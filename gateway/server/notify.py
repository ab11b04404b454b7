"""The daemon side of systemd's notification protocol (sd_notify, through ``sdnotify``):
READY=1 once listening, WATCHDOG=1 while healthy, STATUS=, STOPPING=1.

- ``READY=1`` once the listeners are bound and the store is open (the runner calls :meth:`SystemdNotify.ready`).
- ``STATUS=`` a one-line summary (clients, queued messages, store use, each upstream link's state and outbox
  depth), refreshed while serving and sent when it changes.
- ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` (set by systemd from the unit's ``WatchdogSec=``), sent from a task on
  the event loop and only while the loop turns (the broker's one-second ticker has run recently) and the store
  writer commits (:meth:`LmdbStore.healthy`). A stuck loop or writer stops the pings, and systemd kills and
  restarts the service.
- ``STOPPING=1`` on SIGTERM, before the runner drains and closes the store (systemd bounds that by
  ``TimeoutStopSec=``).

Outside systemd (no ``NOTIFY_SOCKET``) all of this costs nothing.

Debug-only hang trigger, for the watchdog tests (never set it in production): with the environment variable
``EDGE_GATEWAY_DEBUG_HANG=loop:SECONDS`` a SIGUSR2 blocks the event loop for that long (``time.sleep`` on the loop);
with ``store:SECONDS`` it holds the LMDB write lock that long from another thread, so the store writer stalls on
its next commit. Without the variable SIGUSR2 is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import sdnotify

from gateway.broker.broker import Broker
from gateway.server.protocol import BrokerIO
from gateway.store.lmdb_store import LmdbStore

if TYPE_CHECKING:
    from gateway.upstream import UpstreamBridge

log = logging.getLogger("gateway.server")

#: STATUS= is recomputed this often (or every watchdog period when that is shorter).
STATUS_INTERVAL = 5.0
#: The broker ticker runs every second; this much silence means the loop is not turning.
TICKER_STALE_AFTER = 5.0
DEBUG_HANG_ENV = "EDGE_GATEWAY_DEBUG_HANG"


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """The watchdog timeout in seconds that systemd asked for (``WATCHDOG_USEC``), or None when the watchdog
    is off or meant for another process (``WATCHDOG_PID``), as ``sd_watchdog_enabled(3)`` decides."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} GiB"


class SystemdNotify:
    """READY / STATUS / WATCHDOG / STOPPING for one running broker.

    Args:
        broker: the broker (for the summary).
        io: its I/O side (``last_tick`` tells whether the loop turns).
        store: the LMDB store, or None for the memory store.
        listeners: how many listeners are bound.
        upstream: the upstream links (their state and outbox depth go into STATUS=).
    """

    def __init__(
        self,
        broker: Broker,
        io: BrokerIO,
        store: LmdbStore | None,
        listeners: int,
        upstream: UpstreamBridge | None = None,
    ) -> None:
        self.broker = broker
        self.upstream = upstream
        self.io = io
        self.store = store
        self.listeners = listeners
        # sdnotify leaves a socket unclosed when NOTIFY_SOCKET is unset: only make one under systemd.
        self.notifier = sdnotify.SystemdNotifier() if os.environ.get("NOTIFY_SOCKET") else None
        self.watchdog = watchdog_interval()
        self.pings = 0
        self._status = ""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def enabled(self) -> bool:
        """True when there is a notification socket to talk to."""
        return self.notifier is not None and self.notifier.socket is not None

    def send(self, state: str) -> None:
        if self.notifier is not None and self.notifier.socket is not None:
            self.notifier.notify(state)

    def summary(self) -> str:
        """The one-line STATUS text."""
        broker = self.broker
        queued = sum(len(s.mqueue) + len(s.inflight) for s in broker.sessions.values())
        if self.store is not None:
            store = f"store {_size(self.store.used_bytes)} of {_size(self.store.settings.max_size)} used"
            if not self.store.healthy(self.watchdog or 30.0):
                store += " (writer stalled)"
        else:
            store = "store in memory"
        links = "".join(
            f"; upstream {link.name} {link.state}, outbox {len(link.entries)}"
            for link in (self.upstream.links if self.upstream is not None else ())
        )
        return (
            f"{broker.stats.clients_connected} clients, {queued} queued, {store}; {self.listeners} listener(s){links}"
        )

    def healthy(self) -> bool:
        """The loop turns (this runs on it and the ticker ran lately) and the store writer commits."""
        if time.monotonic() - self.io.last_tick > TICKER_STALE_AFTER:
            return False
        return self.store is None or self.store.healthy(self.watchdog or 30.0)

    def ready(self) -> None:
        """Tell systemd the listeners are bound and the store is open; start STATUS updates and watchdog pings."""
        self.send("READY=1")
        self._update_status()
        if self.enabled:
            if self.watchdog is not None:
                log.info(
                    "systemd watchdog: %.1f s; pinging every %.1f s while the loop and store are healthy",
                    self.watchdog,
                    self.watchdog / 2,
                )
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sd-notify")

    def _update_status(self) -> None:
        status = self.summary()
        if status != self._status:
            self._status = status
            self.send(f"STATUS={status}")

    async def _run(self) -> None:
        period = STATUS_INTERVAL if self.watchdog is None else min(STATUS_INTERVAL, self.watchdog / 2)
        next_status = time.monotonic() + STATUS_INTERVAL
        was_healthy = True
        while True:
            if self.watchdog is not None:
                ok = self.healthy()
                if ok:
                    self.send("WATCHDOG=1")
                    self.pings += 1
                elif was_healthy:
                    log.error(
                        "systemd watchdog: not pinging (loop ticker %.1f s ago, store writer %s)",
                        time.monotonic() - self.io.last_tick,
                        "n/a" if self.store is None else ("ok" if self.store.healthy(self.watchdog) else "stalled"),
                    )
                was_healthy = ok
            now = time.monotonic()
            if now >= next_status or self.watchdog is not None:
                self._update_status()
                next_status = now + STATUS_INTERVAL
            await asyncio.sleep(period)

    def stopping(self) -> None:
        """SIGTERM arrived: say so before draining (no more watchdog pings after this)."""
        if self._stopping:
            return
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        self.send("STOPPING=1")
        self.send("STATUS=stopping: disconnecting clients, writing what is pending, closing the store")

    async def close(self) -> None:
        """Wait for the notify task and close the socket."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.notifier is not None and self.notifier.socket is not None:
            self.notifier.socket.close()
            self.notifier.socket = None


def install_debug_hang(
    loop: asyncio.AbstractEventLoop, store: LmdbStore | None, env: Mapping[str, str] = os.environ
) -> bool:
    """SIGUSR2 hangs the loop or the store writer when ``EDGE_GATEWAY_DEBUG_HANG`` asks for it (tests only).

    Returns:
        True when the trigger is installed.
    """
    spec = env.get(DEBUG_HANG_ENV, "")
    if not spec:
        return False
    what, _, seconds = spec.partition(":")
    try:
        duration = float(seconds)
    except ValueError:
        duration = -1.0
    if what not in ("loop", "store") or duration <= 0 or (what == "store" and store is None):
        log.error(
            "%s=%r ignored: use loop:SECONDS or store:SECONDS (store needs the LMDB backend)", DEBUG_HANG_ENV, spec
        )
        return False

    def hang_store() -> None:
        assert store is not None and store.env is not None
        with store.env.begin(write=True):
            log.warning("debug: store write lock held")
            time.sleep(duration)

    def trigger() -> None:
        log.warning(
            "debug: hanging the %s for %.1f s (%s)",
            "event loop" if what == "loop" else "store writer",
            duration,
            DEBUG_HANG_ENV,
        )
        if what == "loop":
            time.sleep(duration)
            log.warning("debug: event loop resumed")
        else:
            threading.Thread(target=hang_store, name="debug-store-hang", daemon=True).start()

    loop.add_signal_handler(signal.SIGUSR2, trigger)
    log.warning(
        "debug: SIGUSR2 hangs the %s for %.1f s (%s is set; never in production)", what, duration, DEBUG_HANG_ENV
    )
    return True
