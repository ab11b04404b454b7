"""Configuration values shared by edge-gateway, firmware-bridge and the fleet pipeline: durations, sizes, addresses.

Standard library only and no imports from the rest of ``gateway``, so ``firmware_bridge`` and ``pipeline`` use it
without loading the broker.

- Durations are seconds: a number >= 0, or a number with a unit ``ms``, ``s``, ``m``, ``h``, ``d``
  (``"250ms"``, ``"30s"``, ``"1.5h"``, ``"7d"``).
- Sizes are bytes, in powers of 1024 like Mosquitto's and EMQX's sizes: ``"KB"`` = ``"KiB"`` = 1024,
  ``"MB"`` = ``"MiB"`` = 1024**2, ``"GB"``, ``"TB"`` likewise; a whole number, the unit in any case.
- Addresses are ``"host:port"`` (an IPv6 host in brackets: ``"[::1]:1883"``) or a Unix socket path
  (starting with ``/`` or ``./``).

:func:`check_value` validates one key of a configuration table and appends one line per mistake,
``where.key = value: must be <what is allowed>``, so that a file's every mistake is reported at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADDRESS_ALLOWED",
    "DURATION_ALLOWED",
    "SIZE_ALLOWED",
    "Address",
    "ValueSpec",
    "address_allowed",
    "check_value",
    "is_unix_path",
    "parse_address",
    "parse_duration",
    "parse_size",
]

DURATION_ALLOWED = 'seconds >= 0, or a number with a unit ms, s, m, h or d such as "30s"'
SIZE_ALLOWED = 'bytes >= 0, or a whole number with a unit B, KB, MB, GB or TB (powers of 1024) such as "64MB"'
ADDRESS_ALLOWED = '"host:port" (port 0..65535) or a Unix socket path'

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


def parse_duration(value: Any) -> float:
    """Seconds from a number >= 0 or a string such as ``"250ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"7d"``
    (a bare number in a string is seconds too).

    Raises:
        ValueError: a negative or non-finite number, a bool, or anything else; the message names the value and
            what is allowed.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value >= 0 and math.isfinite(value):
            return float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    raise ValueError(f"{value!r}: must be {DURATION_ALLOWED}")


def parse_size(value: Any) -> int:
    """Bytes from an integer >= 0 or a string such as ``"512KB"``, ``"64MB"``, ``"1GiB"``: ``KB``/``KiB`` = 1024,
    ``MB``/``MiB`` = 1024**2, ``GB``/``GiB`` = 1024**3, ``TB``/``TiB`` = 1024**4 (as Mosquitto and EMQX count).

    Raises:
        ValueError: a negative integer, a bool, a float, or anything else; the message names the value and what
            is allowed.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            unit = (m.group(2) or "B").upper().replace("I", "")
            return int(m.group(1)) * _SIZE_UNITS[unit]
    raise ValueError(f"{value!r}: must be {SIZE_ALLOWED}")


@dataclass(frozen=True, slots=True)
class Address:
    """Where to listen or connect: a TCP ``host`` and ``port`` (an IPv6 host without brackets), or a Unix
    socket ``path`` (then ``host`` is empty and ``port`` 0)."""

    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def is_unix(self) -> bool:
        """True for a Unix socket path."""
        return bool(self.path)

    def __str__(self) -> str:
        if self.path:
            return self.path
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def is_unix_path(value: str) -> bool:
    """True when ``value`` names a Unix socket: it starts with ``/`` or ``./``."""
    return value.startswith("/") or value.startswith("./")


def parse_address(value: Any, min_port: int = 0) -> Address:
    """An :class:`Address` from ``"host:port"``, ``"[::1]:1883"`` or a Unix socket path (``/`` or ``./`` first).

    Args:
        min_port: the lowest port allowed (0 lets a listener take an ephemeral port; a client wants 1).

    Raises:
        ValueError: not a string, empty, no port, a port outside ``min_port``..65535, a host with white space or
            ``/``, or an IPv6 host without brackets; the message names the value and what is allowed.
    """
    if isinstance(value, str) and value:
        if is_unix_path(value):
            return Address(path=value)
        host, sep, port = value.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if bracketed:
            host = host[1:-1]
        bad_host = (
            not host
            or any(c in "[]/" or c.isspace() for c in host)
            or (":" in host and not bracketed)  # "::1:1883": which colon ends the host?
        )
        if sep and not bad_host and port.isascii() and port.isdigit() and min_port <= int(port) <= 65535:
            return Address(host, int(port))
    raise ValueError(f"{value!r}: must be {address_allowed(min_port)}")


def address_allowed(min_port: int = 0) -> str:
    """What :func:`parse_address` accepts, for error messages."""
    return ADDRESS_ALLOWED.replace("port 0..", f"port {min_port}..")


# kind, low, high, what is allowed. Kinds: "int", "number" (int or float), "bool", "duration" (seconds),
# "size" (bytes), "address" (low..high is the port range; the parsed value is the string as given).
ValueSpec = tuple[str, float, float, str]


def check_value(where: str, key: str, value: Any, errors: list[str], spec: ValueSpec) -> Any:
    """The parsed value of ``where.key``: an int, a float (number, duration: seconds), a bool, an int (size:
    bytes) or the address string; or ``None`` after appending one line to ``errors``:
    ``where.key = <value>: must be <allowed>``.

    Args:
        where: the table (``"listeners.external"``); empty when ``key`` is the whole name (``"--roll-size"``).
        spec: ``(kind, low, high, allowed)``; the parsed value must lie in ``low..high`` (for an address: its
            port, unless it is a Unix socket path). ``allowed`` is the text after "must be".
    """
    kind, low, high, allowed = spec
    try:
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind == "address":
            address = parse_address(value, int(low))
            if not address.is_unix and address.port > high:
                raise ValueError
            return value
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
            parsed: Any = value
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError
            parsed = float(value)
        elif kind == "duration":
            parsed = parse_duration(value)
        elif kind == "size":
            parsed = parse_size(value)
        else:
            raise TypeError(f"check_value: unknown kind {kind!r}")
        if not low <= parsed <= high:
            raise ValueError
    except ValueError:
        name = f"{where}.{key}" if where else key
        errors.append(f"{name} = {value!r}: must be {allowed}")
        return None
    return parsed
