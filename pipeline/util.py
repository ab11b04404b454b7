"""Small helpers shared by the lander and the jobs (stdlib only: no pyspark here).

Durations and sizes are read by :mod:`gateway.values`, as the gateway reads them ("64MB" = 64 MiB).
"""

from __future__ import annotations

import datetime as dt


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

