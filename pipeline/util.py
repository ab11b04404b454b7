"""Small helpers shared by the lander and the jobs (stdlib only: no pyspark here)."""

from __future__ import annotations

import datetime as dt
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``30``, ``"30s"``, ``"5m"``, ``"2h"``, ``"7d"`` or ``"250ms"``."""
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 2h, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_size(text: str | int) -> int:
    """Bytes from ``1048576``, ``"64MB"`` or ``"64MiB"``."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 64MB)")
    return int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()]


def parse_date(text: str) -> dt.date:
    """A UTC calendar date ``YYYY-MM-DD``."""
    return dt.date.fromisoformat(text)


def parse_instant(text: str) -> dt.datetime:
    """An RFC 3339 instant (``Z`` or an offset; a naive one is taken as UTC), returned in UTC."""
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


def rfc3339(value: dt.datetime) -> str:
    """UTC, microseconds, ``Z``: the landing area's time format."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

