"""Progress while the broker reads a large store back at start-up: a log line every
:data:`LOG_INTERVAL` seconds and systemd's ``STATUS=loading store: N of M sessions, ...`` until ``READY=1``, so
``systemctl status edge-gateway`` and the journal are never silent during a long start.

The store's loaders (:mod:`gateway.store.loading`) count rows and call :meth:`LoadReporter.__call__` every
1024 rows; the clock is read here, on the I/O side. The first STATUS is sent at once (when the totals are known),
the next ones and the log lines every interval; a store that loads within one interval logs nothing extra.

STATUS= lines go out on a non-blocking socket: when the service manager does not read them fast enough they are
dropped rather than holding up the start.

``EDGE_GATEWAY_PROGRESS_INTERVAL`` (seconds) replaces the 2 s interval; tests set it short to see several
updates from a store that loads in under a second.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import sdnotify

from gateway.store.loading import LoadProgress

log = logging.getLogger("gateway.server")

#: Seconds between two progress lines (and STATUS updates) while the store loads.
LOG_INTERVAL = 2.0
INTERVAL_ENV = "EDGE_GATEWAY_PROGRESS_INTERVAL"


def _mib(n: int) -> str:
    return f"{n / 1048576:.1f} MiB"


def progress_interval(env: Mapping[str, str] = os.environ) -> float:
    """:data:`LOG_INTERVAL`, or ``EDGE_GATEWAY_PROGRESS_INTERVAL`` (seconds, >= 0) when set to a number."""
    try:
        value = float(env.get(INTERVAL_ENV, ""))
    except ValueError:
        return LOG_INTERVAL
    return value if value >= 0 else LOG_INTERVAL


def status_text(p: LoadProgress) -> str:
    """The ``STATUS=`` text: ``loading store: N of M sessions, K of L queued messages``."""
    (sessions, sessions_total), (queued, queued_total) = p.sessions, p.queued
    return f"loading store: {sessions} of {sessions_total} sessions, {queued} of {queued_total} queued messages"


class LoadReporter:
    """The store's ``on_load_progress`` callback during the broker's start.

    Args:
        interval: seconds between log lines and STATUS updates (:func:`progress_interval`).
        clock: monotonic seconds (``time.monotonic``).
        notify: sends one sd_notify line; None: ``sdnotify`` when ``NOTIFY_SOCKET`` is set, else nothing.
    """

    def __init__(
        self,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.interval = progress_interval() if interval is None else interval
        self.clock = clock
        self.started = clock()
        self._next = self.started + self.interval
        self._notifier: sdnotify.SystemdNotifier | None = None
        if notify is None and os.environ.get("NOTIFY_SOCKET"):
            self._notifier = sdnotify.SystemdNotifier()
            if self._notifier.socket is not None:
                # A manager that does not read (a full datagram queue: net.unix.max_dgram_qlen, 10 by default)
                # must cost a STATUS= line, never a start that hangs; sdnotify drops the error.
                self._notifier.socket.setblocking(False)
            notify = self._notifier.notify
        self.notify = notify
        self.lines = 0  # progress lines logged
        self.statuses = 0  # STATUS= lines sent
        self.last: LoadProgress | None = None

    def __call__(self, progress: LoadProgress) -> None:
        self.last = progress
        now = self.clock()
        if self.statuses == 0:
            self._status(progress)  # at once: systemctl status says what the service is doing from the start
            return
        if now < self._next:
            return
        self._next = now + self.interval
        self._status(progress)
        (sessions, sessions_total), (queued, queued_total) = progress.sessions, progress.queued
        rows, total = progress.rows_read, progress.rows_total
        rate = rows / max(now - self.started, 1e-9)
        log.info(
            "store: loading: %d of %d sessions, %d of %d queued messages; %d of %d rows (%.0f%%, %s) read in "
            "%.1f s, %.0f rows/s",
            sessions,
            sessions_total,
            queued,
            queued_total,
            rows,
            total,
            100.0 * rows / total if total else 100.0,
            _mib(progress.bytes_read),
            now - self.started,
            rate,
        )
        self.lines += 1

    def _status(self, progress: LoadProgress) -> None:
        if self.notify is not None:
            self.notify("STATUS=" + status_text(progress))
        self.statuses += 1

    def done(self) -> None:
        """The store is loaded: one summary line when progress was logged, and the notification socket closed
        (READY=1 and later STATUS= lines come from :class:`~gateway.server.notify.SystemdNotify`)."""
        p = self.last
        if p is not None and self.lines:
            log.info(
                "store: loaded %d sessions and %d queued messages (%d rows, %s) in %.1f s",
                p.sessions[0],
                p.queued[0],
                p.rows_read,
                _mib(p.bytes_read),
                self.clock() - self.started,
            )
        if p is not None and self.notify is not None:
            self.notify("STATUS=" + status_text(p) + "; opening the listeners")
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
            self._notifier.socket = None
