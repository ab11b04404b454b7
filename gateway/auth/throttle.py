"""Slowing down repeated authentication failures from one address, sans-I/O: ``now`` is passed in.

The broker asks :meth:`FailureThrottle.delay` when a CONNECT arrives and waits that long before checking it (or
answering it), reports each refused CONNECT with :meth:`FailureThrottle.failure` and each accepted one with
:meth:`FailureThrottle.success`. Nothing here sleeps or counts connections; the glue does that. The first
``free_failures`` failures cost nothing, so that a user who mistypes once is not punished; after that each failure
doubles the delay from ``base_delay`` up to ``max_delay``. An address that stays quiet for ``forget_after`` seconds
starts again from zero. At most ``max_addresses`` addresses are remembered (least recently failed dropped first), so
a flood of spoofed sources cannot grow memory without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Record:
    failures: int
    last: float


class FailureThrottle:
    """Per-address exponential back-off after failed CONNECTs.

    Args:
        free_failures: failures that add no delay.
        base_delay: delay after the first failure past ``free_failures``, seconds.
        max_delay: the longest delay, seconds.
        forget_after: seconds without a failure after which an address starts from zero.
        max_addresses: addresses remembered at once.
    """

    def __init__(
        self,
        free_failures: int = 3,
        base_delay: float = 1.0,
        max_delay: float = 30.0,
        forget_after: float = 600.0,
        max_addresses: int = 10_000,
    ) -> None:
        if free_failures < 0 or base_delay < 0 or max_delay < base_delay or forget_after <= 0 or max_addresses < 1:
            raise ValueError(
                "FailureThrottle: need free_failures >= 0, 0 <= base_delay <= max_delay, "
                "forget_after > 0 and max_addresses >= 1"
            )
        self.free_failures = free_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_addresses = max_addresses
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def _current(self, address: str, now: float) -> _Record | None:
        record = self._records.get(address)
        if record is not None and now - record.last >= self.forget_after:
            del self._records[address]
            return None
        return record

    def failures(self, address: str, now: float) -> int:
        """Failures remembered for ``address`` at ``now``."""
        record = self._current(address, now)
        return record.failures if record else 0

    def delay(self, address: str, now: float) -> float:
        """Seconds to hold a CONNECT from ``address`` before handling it (0.0 when it is not throttled)."""
        excess = self.failures(address, now) - self.free_failures
        if excess <= 0:
            return 0.0
        return min(self.max_delay, self.base_delay * 2.0 ** min(excess - 1, 62))

    def failure(self, address: str, now: float) -> float:
        """Count a refused CONNECT from ``address``; returns the delay the next one will get, seconds."""
        record = self._current(address, now)
        if record is None:
            record = self._records[address] = _Record(0, now)
            while len(self._records) > self.max_addresses:
                self._records.popitem(last=False)
        record.failures += 1
        record.last = now
        self._records.move_to_end(address)
        return self.delay(address, now)

    def success(self, address: str) -> None:
        """Forget the failures of ``address`` after an accepted CONNECT."""
        self._records.pop(address, None)
