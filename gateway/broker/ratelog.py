"""Rate-limited logging: at most one line per key (a client and a reason) per interval, with a count of the lines
suppressed meanwhile. Sans-I/O: the caller passes ``now``.

A client that sends garbage in a loop must not write a log line per connection: on a gateway's SD card with
journald that is flash wear and a full disk. Keys are the client's address (host, without the port,
so reconnecting does not reset the limit) and the reason.
"""

from __future__ import annotations

import logging
from typing import Any, Final

#: Seconds between two lines of one key.
INTERVAL: Final = 60.0
#: Keys remembered at most; past it keys whose interval has passed are forgotten, then all (bounded memory).
MAX_KEYS: Final = 10_000


def peer_host(peer: str) -> str:
    """The host part of a peer label ``"host:port"`` (``"unix:<listener>"`` stays as it is)."""
    if peer.startswith("unix:"):
        return peer
    return peer.rpartition(":")[0] or peer


class RateLimitedLog:
    """Log through ``logger`` at most once per ``interval`` seconds per key.

    Args:
        logger: where lines go.
        interval: seconds, per key.
        max_keys: keys remembered at most (bounded memory whatever the clients do).
    """

    __slots__ = ("_keys", "interval", "logger", "max_keys", "suppressed")

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL, max_keys: int = MAX_KEYS) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self._keys: dict[tuple[str, str], list[float]] = {}  # key -> [next allowed time, suppressed count]
        self.suppressed = 0  # lines suppressed in all, for $SYS

    def log(self, level: int, now: float, who: str, reason: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless a line of (``who``, ``reason``) was logged less than
        ``interval`` seconds ago; return whether it was logged. A logged line after suppressed ones says how many
        were suppressed."""
        if not self.logger.isEnabledFor(level):
            return False
        key = (who, reason)
        entry = self._keys.get(key)
        if entry is not None and now < entry[0]:
            entry[1] += 1
            self.suppressed += 1
            return False
        if entry is not None and entry[1]:
            msg += " (%d similar lines suppressed in the last %.0f s)"
            args = (*args, int(entry[1]), self.interval)
        if entry is None:
            if len(self._keys) >= self.max_keys:
                self._forget(now)
            self._keys[key] = [now + self.interval, 0]
        else:
            entry[0] = now + self.interval
            entry[1] = 0
        self.logger.log(level, msg, *args)
        return True

    def warning(self, now: float, who: str, reason: str, msg: str, *args: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, now, who, reason, msg, *args)

    def info(self, now: float, who: str, reason: str, msg: str, *args: Any) -> bool:
        """:meth:`log` at INFO."""
        return self.log(logging.INFO, now, who, reason, msg, *args)

    def error(self, now: float, who: str, reason: str, msg: str, *args: Any) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, now, who, reason, msg, *args)

    def _forget(self, now: float) -> None:
        keys = self._keys
        for key in [k for k, (due, _count) in keys.items() if due <= now]:
            del keys[key]
        if len(keys) >= self.max_keys:
            keys.clear()
