"""gateway/values.py: the one reading of durations, sizes and addresses for the gateway, firmware-bridge and the
pipeline, and the one error line form ``where.key = value: must be <allowed>``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.values import (
    ADDRESS_ALLOWED,
    DURATION_ALLOWED,
    SIZE_ALLOWED,
    Address,
    address_allowed,
    check_value,
    parse_address,
    parse_duration,
    parse_size,
)

ROOT = Path(__file__).resolve().parent.parent


# --- durations (seconds) ---


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (30, 30.0),
        (2.5, 2.5),
        ("30", 30.0),
        ("30s", 30.0),
        ("250ms", 0.25),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("7d", 604800.0),
        (" 10 s ", 10.0),
        ("0", 0.0),
    ],
)
def test_parse_duration_accepts_seconds_and_units(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds
    assert isinstance(parse_duration(value), float)


# --- sizes (bytes, powers of 1024) ---


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("100B", 100),
        ("512KB", 512 * 1024),
        ("512KiB", 512 * 1024),
        ("64MB", 64 * 1024**2),
        ("64MiB", 64 * 1024**2),
        ("64mb", 64 * 1024**2),
        ("2GB", 2 * 1024**3),
        ("2GiB", 2 * 1024**3),
        ("1TB", 1024**4),
        (" 1 MB ", 1024**2),
    ],
)
def test_parse_size_counts_in_powers_of_1024(value: Any, size: int) -> None:
    """One meaning of "MB" everywhere: MiB, as Mosquitto and EMQX count (the pipeline used to read 10^6)."""
    assert parse_size(value) == size


# --- addresses ---


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("127.0.0.1:1883", Address("127.0.0.1", 1883)),
        ("0.0.0.0:0", Address("0.0.0.0", 0)),
        ("localhost:65535", Address("localhost", 65535)),
        ("[::1]:1883", Address("::1", 1883)),
        ("[fe80::1%eth0]:8883", Address("fe80::1%eth0", 8883)),
        ("/run/edge-gateway/mqtt.sock", Address(path="/run/edge-gateway/mqtt.sock")),
        ("./var/mqtt.sock", Address(path="./var/mqtt.sock")),
    ],
)
def test_parse_address_tcp_and_unix(value: str, address: Address) -> None:
    parsed = parse_address(value)
    assert parsed == address
    assert parsed.is_unix == value.startswith(("/", "./"))
    assert str(parsed) == value


_BAD_DURATIONS = [-1, -0.5, True, False, math.nan, math.inf, None, "", "5 minutes", "5S", "-5s", "1e3", "5w", "s", [1]]
_BAD_SIZES = [-1, True, 1.5, math.inf, None, "", "1.5MB", "64 megabytes", "64M", "MB", "-1KB"]
_BAD_ADDRESSES = [
    None,
    1883,
    "",
    "localhost",
    "localhost:",
    ":1883",
    "host:70000",
    "host:-1",
    "host:http",
    "host:١٢٣",  # Arabic-Indic digits: str.isdigit() says yes, a port number they are not
    "::1:1883",  # which colon ends the host? IPv6 goes in brackets
    "[]:1883",
    "[::1:1883",
    "my host:1883",
    "a/b:1883",
    "run/mqtt.sock",  # relative socket paths start with ./
]


@pytest.mark.parametrize(
    ("parse", "allowed", "value"),
    [(parse_duration, DURATION_ALLOWED, v) for v in _BAD_DURATIONS]
    + [(parse_size, SIZE_ALLOWED, v) for v in _BAD_SIZES]
    + [(parse_address, ADDRESS_ALLOWED, v) for v in _BAD_ADDRESSES],
)
def test_parsers_refuse_naming_value_and_allowed(parse: Any, allowed: str, value: Any) -> None:
    """Every parser's ValueError reads ``<value!r>: must be <what is allowed>``."""
    with pytest.raises(ValueError) as info:
        parse(value)
    assert str(info.value) == f"{value!r}: must be {allowed}"


def test_parse_address_min_port_for_clients() -> None:
    """A client connects to port 1..65535; a listener may bind 0 (an ephemeral port)."""
    assert parse_address("h:0") == Address("h", 0)
    with pytest.raises(ValueError) as info:
        parse_address("h:0", min_port=1)
    assert str(info.value) == "'h:0': must be \"host:port\" (port 1..65535) or a Unix socket path"
    assert address_allowed(1) == '"host:port" (port 1..65535) or a Unix socket path'


# --- check_value: one line per mistake, naming key, value and what is allowed ---


@pytest.mark.parametrize(
    ("spec", "value", "parsed"),
    [
        (("int", 0, 10, "an integer 0..10"), 10, 10),
        (("number", 0, 10, "a number 0..10"), 2, 2.0),
        (("number", 0, 10, "a number 0..10"), 2.5, 2.5),
        (("bool", 0, 1, "true or false"), False, False),
        (("duration", 0, 60, 'a duration such as "5s"'), "1m", 60.0),
        (("size", 0, 2**20, 'a size such as "1MB"'), "1MB", 2**20),
        (("address", 0, 65535, ADDRESS_ALLOWED), "[::1]:0", "[::1]:0"),
        (("address", 1, 65535, ADDRESS_ALLOWED), "/run/x.sock", "/run/x.sock"),
    ],
)
def test_check_value_returns_the_parsed_value(spec: Any, value: Any, parsed: Any) -> None:
    errors: list[str] = []
    assert check_value("t", "k", value, errors, spec) == parsed
    assert type(check_value("t", "k", value, errors, spec)) is type(parsed)
    assert errors == []


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        (("int", 0, 10, "an integer 0..10"), 11),  # out of range
        (("int", 0, 10, "an integer 0..10"), -1),
        (("int", 0, 10, "an integer 0..10"), "5"),  # wrong type
        (("int", 0, 10, "an integer 0..10"), True),  # a bool is no integer here
        (("int", 0, 10, "an integer 0..10"), 5.0),
        (("number", 0, 10, "a number 0..10"), math.nan),
        (("number", 0, 10, "a number 0..10"), "1"),
        (("bool", 0, 1, "true or false"), 1),
        (("duration", 1, 60, 'a duration 1..60s such as "5s"'), "0.5s"),  # below
        (("duration", 1, 60, 'a duration 1..60s such as "5s"'), "2m"),  # above
        (("duration", 1, 60, 'a duration 1..60s such as "5s"'), "soon"),  # not a duration
        (("size", 4096, 2**20, 'a size 4KB..1MB such as "64KB"'), "1KB"),
        (("size", 4096, 2**20, 'a size 4KB..1MB such as "64KB"'), "2MB"),
        (("size", 4096, 2**20, 'a size 4KB..1MB such as "64KB"'), "lots"),
        (("address", 1, 65535, address_allowed(1)), "h:0"),  # port below
        (("address", 0, 1024, '"host:port" (port 0..1024) or a Unix socket path'), "h:1883"),  # port above
        (("address", 0, 65535, ADDRESS_ALLOWED), 1883),
    ],
)
def test_check_value_error_line_names_key_value_and_allowed(spec: Any, value: Any) -> None:
    errors = ["an earlier mistake"]
    assert check_value("listeners.external", "k", value, errors, spec) is None
    assert errors == ["an earlier mistake", f"listeners.external.k = {value!r}: must be {spec[3]}"]


def test_check_value_without_a_table_names_the_key_alone() -> None:
    """firmware-bridge passes the whole dotted name as the key; a command line passes the option."""
    errors: list[str] = []
    check_value("", "--roll-size", "64XB", errors, ("size", 0, 2**40, 'a size such as "64MB"'))
    assert errors == ["--roll-size = '64XB': must be a size such as \"64MB\""]


def test_check_value_unknown_kind_is_a_programming_error() -> None:
    with pytest.raises(TypeError):
        check_value("t", "k", 1, [], ("colour", 0, 1, "red"))


# --- round trips ---

_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "": 1}
_UNIT_BYTES = {"": 1, "B": 1, "KB": 1024, "KiB": 1024, "MB": 1024**2, "MiB": 1024**2, "GB": 1024**3, "TiB": 1024**4}


@given(st.integers(min_value=0, max_value=10**9), st.sampled_from(sorted(_UNIT_SECONDS)))
def test_duration_round_trip(n: int, unit: str) -> None:
    assert parse_duration(f"{n}{unit}") == pytest.approx(n * _UNIT_SECONDS[unit])
    assert parse_duration(parse_duration(f"{n}{unit}")) == parse_duration(f"{n}{unit}")


@given(st.integers(min_value=0, max_value=2**40), st.sampled_from(sorted(_UNIT_BYTES)))
def test_size_round_trip(n: int, unit: str) -> None:
    assert parse_size(f"{n}{unit}") == n * _UNIT_BYTES[unit]
    assert parse_size(parse_size(f"{n}{unit}")) == parse_size(f"{n}{unit}")


_HOSTS = st.one_of(
    st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True),
    st.ip_addresses().map(str),
)


@given(_HOSTS, st.integers(min_value=0, max_value=65535))
def test_address_round_trip(host: str, port: int) -> None:
    """str(Address) writes what parse_address reads (IPv6 in brackets), and back to the same Address."""
    address = Address(host, port)
    assert parse_address(str(address)) == address


# --- the callers: gateway, firmware-bridge, pipeline ---


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_values_imports_nothing_else_from_gateway() -> None:
    """firmware-bridge and the pipeline may import gateway.values without loading the broker."""
    code = "import sys, gateway.values; print(sorted(m for m in sys.modules if m.startswith('gateway')))"
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['gateway', 'gateway.values']"


def test_upstream_config_does_not_import_server_config() -> None:
    """No import cycle server/config <-> upstream/config: upstream's config reads values from gateway.values."""
    code = "import sys, gateway.upstream.config; print('gateway.server.config' in sys.modules)"
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def _check_config(tmp_path: Path, module: str, text: str, returncode: int) -> str:
    """``python -m <module> check-config FILE`` on ``text``: its stderr, after checking the exit code."""
    path = tmp_path / "config.toml"
    path.write_text(text)
    result = _run("-m", module, "check-config", str(path))
    assert result.returncode == returncode, result
    return result.stderr


def test_gateway_check_config_names_bad_bind_and_size(tmp_path: Path) -> None:
    """edge-gateway check-config: a bind without brackets around IPv6 and an unknown size unit, one line each."""
    stderr = _check_config(
        tmp_path, "gateway", '[listeners.a]\nbind = "::1:1883"\nmax_mqueue_bytes = "64 megabytes"\n', 1
    )
    assert "listeners.a.bind = '::1:1883': must be \"host:port\" (port 0..65535) or a Unix socket path" in stderr
    assert "listeners.a.max_mqueue_bytes = '64 megabytes': must be a size such as \"64MB\" (0 = no limit)" in stderr


def test_bridge_broker_address_error_names_the_port_range(tmp_path: Path) -> None:
    """firmware-bridge connects, so port 0 is refused, and the line says which ports are allowed."""
    stderr = _check_config(
        tmp_path, "firmware_bridge", '[mqtt]\nbroker = "127.0.0.1:0"\n[[ports]]\npath = "/dev/null"\n', 78
    )
    assert "mqtt.broker = '127.0.0.1:0': must be \"host:port\" (port 1..65535) or a Unix socket path" in stderr


def test_pipeline_option_error_names_option_value_and_allowed() -> None:
    """fleet-pipeline land --roll-size 64XB: exit 2 with one line, not a traceback."""
    result = _run("-m", "pipeline", "land", "--roll-size", "64XB")
    assert result.returncode == 2
    assert f"argument --roll-size: '64XB': must be {SIZE_ALLOWED}" in result.stderr
    assert "Traceback" not in result.stderr
    result = _run("-m", "pipeline", "run", "all", "--from", "2024-05-01", "--to", "2024-05-01", "--grace", "1 hour")
    assert result.returncode == 2
    assert f"argument --grace: '1 hour': must be {DURATION_ALLOWED}" in result.stderr
