"""The TOML configuration (``/etc/edge-gateway/gateway.toml``): parse, validate, explain every mistake.

Layout (README.md, "Configuration")::

    [broker]
    sys_interval = "10s"        # $SYS update period; 0 = off
    log_level = "info"

    [listeners.external]        # a named zone; "external" and "internal" carry EMQX's defaults
    bind = "0.0.0.0:1883"       # "host:port", "[::1]:1883" or a Unix socket path ("/run/edge-gateway/mqtt.sock")
    max_inflight = 32
    max_mqueue_len = 1000

    [listeners.internal]
    bind = "127.0.0.1:1884"
    max_inflight = 128

    [listeners.tls]             # TLS keys as in mosquitto.conf(5); certfile + keyfile make a listener TLS
    bind = "0.0.0.0:8883"
    certfile = "/etc/edge-gateway/tls/server.crt"
    keyfile = "/etc/edge-gateway/tls/server.key"
    cafile = "/etc/edge-gateway/tls/ca.crt"
    require_certificate = true

    [listeners.ws]              # MQTT over WebSockets (mosquitto.conf(5) "protocol websockets"); TLS keys make it wss
    bind = "127.0.0.1:8080"
    protocol = "websockets"
    path = "/mqtt"              # the upgrade path; other paths get 404

    [metrics]                   # Prometheus /metrics (gateway/server/metrics.py); off when absent
    bind = "127.0.0.1:9883"

    [update]                    # the opt-in pull of A/B root updates (gateway/update/settings.py); the broker
    manifest_url = "https://updates.example.net/edge-gateway/stable.json"   # ignores it; absent: pull off

Durations, sizes and addresses are read by :mod:`gateway.values` (sizes in powers of 1024: "1MB" = 1 MiB).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.auth.tls import TLS_VERSIONS, TlsConfigError, TlsSettings, build_server_context
from gateway.broker.limits import ZONE_DEFAULTS, BrokerSettings, ZoneLimits
from gateway.server.auth_files import AUTH_KEYS, AuthConfig, load_auth
from gateway.store.lmdb_store import StoreSettings
from gateway.update.settings import UpdateSettings, load_update
from gateway.values import ADDRESS_ALLOWED, ValueSpec, check_value, is_unix_path, parse_address

if TYPE_CHECKING:
    from gateway.upstream.config import UpstreamConfig

DEFAULT_BIND = "127.0.0.1:1883"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(Exception):
    """One or more configuration mistakes; ``errors`` holds one line per mistake, each naming the key, the
    value and what is allowed."""

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"{source}: " + "; ".join(errors))


@dataclass(slots=True)
class ListenerConfig:
    """One listener: where it binds and the zone limits for its connections.

    Attributes:
        name: the table name under ``[listeners]``.
        bind: ``host:port`` (TCP) or an absolute path (Unix socket).
        tls: the TLS keys when the listener is TLS (``certfile`` and ``keyfile`` given), else ``None``.
        auth: ``allow_anonymous``, ``password_file``, ``acl_file`` and the files loaded (gateway/server/auth_files.py).
        protocol: ``"mqtt"`` (MQTT on TCP or TLS) or ``"websockets"`` (MQTT over WebSockets, mosquitto.conf(5)'s
            ``protocol websockets``; TLS keys make it ``wss``): gateway/server/websocket.py.
        path: the HTTP path WebSocket clients upgrade on (``"/mqtt"``); other paths are answered 404.
    """

    name: str
    bind: str
    limits: ZoneLimits
    tls: TlsSettings | None = None
    auth: AuthConfig = field(default_factory=lambda: AuthConfig(allow_anonymous=True))
    protocol: str = "mqtt"
    path: str = "/mqtt"

    @property
    def is_unix(self) -> bool:
        """True when ``bind`` is a Unix socket path."""
        return is_unix_path(self.bind)

    def host_port(self) -> tuple[str, int]:
        """``(host, port)`` of a TCP bind; IPv6 hosts in brackets are unwrapped."""
        address = parse_address(self.bind)
        return address.host, address.port


@dataclass(slots=True)
class GatewayConfig:
    """The whole configuration."""

    listeners: list[ListenerConfig] = field(default_factory=list)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    log_level: str = "info"
    event_loop: str = "auto"
    source: str = "<defaults>"
    store: StoreSettings = field(default_factory=StoreSettings)
    store_backend: str = "lmdb"
    gateway_id: str = ""  # [broker] gateway_id (default: the host name); {gateway_id} in [[upstream]] rules
    upstreams: list[UpstreamConfig] = field(default_factory=list)  # [[upstream]] (gateway/upstream/)
    metrics_bind: str | None = None  # [metrics] bind: "host:port" of the Prometheus endpoint; None = off
    # [update]: `edge-gateway update pull` (gateway/update/); the broker ignores it
    update: UpdateSettings = field(default_factory=UpdateSettings)


# key -> (kind, low, high, description of what is allowed)
_LIMIT_KEYS: dict[str, ValueSpec] = {
    "max_inflight": ("int", 0, 65535, "an integer 0..65535 (0 = no limit)"),
    "max_mqueue_len": ("int", 0, 2**31, "an integer >= 0 (0 = no limit)"),
    "max_mqueue_bytes": ("size", 0, 2**40, 'a size such as "64MB" (0 = no limit)'),
    "mqueue_store_qos0": ("bool", 0, 1, "true or false"),
    "retry_interval": ("duration", 0, 86400, 'a duration such as "30s" (0 = off)'),
    "max_awaiting_rel": ("int", 1, 65535, "an integer 1..65535"),
    "await_rel_timeout": ("duration", 0, 7 * 86400, 'a duration such as "300s" (0 = never)'),
    "max_keepalive": ("int", 0, 65535, "an integer 0..65535 seconds (0 = any)"),
    "session_expiry_interval": ("duration", 0, 0xFFFFFFFF, 'a duration such as "2h" (0 = end on disconnect)'),
    "message_expiry_interval": ("duration", 0, 0xFFFFFFFF, 'a duration such as "5m" (0 = never)'),
    "max_packet_size": ("size", 16, 268_435_460, 'a size 16 B..256 MB such as "1MB"'),
    "topic_alias_maximum": ("int", 0, 65535, "an integer 0..65535 (0 = no aliases)"),
    "connect_timeout": ("duration", 1, 3600, 'a duration such as "10s"'),
    "max_clientid_len": ("int", 23, 65535, "an integer 23..65535 (UTF-8 bytes)"),
    "max_subscriptions": ("int", 0, 2**31, "an integer >= 0 (0 = no limit)"),
    "max_topic_levels": ("int", 0, 65535, "an integer 0..65535 (0 = no limit)"),
    "high_watermark": ("size", 4096, 2**31, 'a size of at least 4KB such as "1MB"'),
    "send_timeout": ("duration", 0, 86400, 'a duration such as "15s" (0 = never)'),
    "max_connections": ("int", 0, 2**31, "an integer >= 0 (connected clients on this listener; 0 = no limit)"),
    "max_topic_length": ("int", 0, 65535, "an integer 0..65535 (UTF-8 bytes; 0 = no limit)"),
    "max_publish_rate": ("number", 0, 10**9, "a number >= 0 (PUBLISH packets per second per connection; 0 = no limit)"),
}
# TLS keys of a listener, Mosquitto's names (mosquitto.conf(5)); gateway/auth/tls.py says what each does
_TLS_PATH_KEYS = ("certfile", "keyfile", "cafile", "capath")
_TLS_BOOL_KEYS = ("require_certificate", "use_identity_as_username")
_TLS_KEYS = (*_TLS_PATH_KEYS, *_TLS_BOOL_KEYS, "tls_version", "ciphers")
_LISTENER_KEYS = {"bind", "zone", *_LIMIT_KEYS, *_TLS_KEYS}
# protocol = "mqtt" | "websockets" (mosquitto.conf(5) ``protocol``), path = "/mqtt" (the WebSocket upgrade path)
LISTENER_PROTOCOLS = ("mqtt", "websockets")
_LISTENER_KEYS.update(("protocol", "path"))
_BROKER_KEYS = {"sys_interval", "log_level", "retain_available", "event_loop", "gateway_id", "max_sessions",
                "max_retained_messages", "max_retained_bytes"}
_RETAINED_LIMITS: dict[str, ValueSpec] = {
    "max_retained_messages": ("int", 0, 2**31, "an integer >= 0 (0 = no limit)"),
    "max_retained_bytes": ("size", 0, 2**40, 'a size such as "64MB" (0 = no limit)'),
}
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
_TOP_KEYS = {"broker", "listeners", "store", "upstream"}
_TOP_KEYS.add("metrics")  # [metrics] bind (Prometheus, gateway/server/metrics.py)
_TOP_KEYS.add("update")  # [update]: the opt-in pull of A/B root updates (gateway/update/settings.py)
METRICS_BIND_ALLOWED = ('a TCP "host:port" such as "127.0.0.1:9883" or "[::1]:9883" (port 0..65535; 0 = any free '
                        "port), not a Unix socket path")
_METRICS_BIND: ValueSpec = ("address", 0, 65535, METRICS_BIND_ALLOWED)
_BIND: ValueSpec = ("address", 0, 65535, ADDRESS_ALLOWED)
_SYS_INTERVAL: ValueSpec = ("duration", 0, math.inf, 'a duration such as "10s" (0 = off)')
_STORE_MAX_SIZE: ValueSpec = ("size", 4 * 1024 * 1024, 2**62, 'a size of at least 4MB such as "1GB"')
_COMMIT_INTERVAL: ValueSpec = ("duration", 0, 1, 'a duration 0..1s such as "2ms"')
_LAZY_COMMIT: ValueSpec = ("duration", 0, 1, 'a duration 0..1s such as "5ms" (0 = at the end of the loop turn)')
_STORE_KEYS = {"backend", "path", "max_size", "commit_interval", "lazy_commit", "on_corrupt", "group_commit",
               "mqueue_mem_len"}


# allow_anonymous, password_file, acl_file (gateway/server/auth_files.py)
_LISTENER_KEYS.update(AUTH_KEYS)


def default_store_path() -> str:
    """``$STATE_DIRECTORY/store`` when systemd sets it (first entry), else ``./var``.

    A directory below the StateDirectory, so the store's lock file (kept beside the store, where a quarantine does
    not move it) is inside the one tree ``ProtectSystem=strict`` leaves writable."""
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return os.path.join(state.split(":")[0], "store")
    return "var"


def load_config(data: dict[str, Any], source: str = "<config>") -> GatewayConfig:
    """Validate a parsed TOML document and build a :class:`GatewayConfig`.

    Raises:
        ConfigError: listing every unknown key and bad value.
    """
    errors: list[str] = []
    for key in data:
        if key not in _TOP_KEYS:
            errors.append(f"{key}: unknown section; allowed: {', '.join(sorted(_TOP_KEYS))}")
    cfg = GatewayConfig(source=source)
    broker = data.get("broker", {})
    if not isinstance(broker, dict):
        errors.append("broker: must be a table")
        broker = {}
    for key, value in broker.items():
        if key not in _BROKER_KEYS:
            errors.append(f"broker.{key}: unknown key; allowed: {', '.join(sorted(_BROKER_KEYS))}")
        elif key == "sys_interval":
            interval = check_value("broker", key, value, errors, _SYS_INTERVAL)
            if interval is not None:
                cfg.broker.sys_interval = interval
        elif key == "log_level":
            if value not in LOG_LEVELS:
                errors.append(f"broker.log_level = {value!r}: must be one of {', '.join(LOG_LEVELS)}")
            else:
                cfg.log_level = value
        elif key == "event_loop":
            if value not in EVENT_LOOPS:
                errors.append(f"broker.event_loop = {value!r}: must be one of {', '.join(EVENT_LOOPS)} "
                              '("auto" uses uvloop when installed)')
            else:
                cfg.event_loop = value
        elif key == "retain_available":
            if not isinstance(value, bool):
                errors.append(f"broker.retain_available = {value!r}: must be true or false")
            else:
                cfg.broker.retain_available = value
        elif key in _RETAINED_LIMITS:
            parsed = check_value("broker", key, value, errors, _RETAINED_LIMITS[key])
            if parsed is not None:
                setattr(cfg.broker, key, parsed)
        elif key == "max_sessions":
            parsed = check_value("broker", key, value, errors, ("int", 0, 2**31, "an integer >= 0 (0 = no limit)"))
            if parsed is not None:
                cfg.broker.max_sessions = parsed
        elif key == "gateway_id":
            # imported here, not at the top, only because the gateway.upstream package loads aiomqtt, which a
            # configuration without [[upstream]] does not need; upstream.config imports nothing from this module
            from gateway.upstream.config import gateway_id_error

            why = gateway_id_error(value)
            if why:
                errors.append(f"broker.gateway_id = {value!r}: {why}")
            else:
                cfg.gateway_id = value
    _load_store(cfg, data.get("store", {}), errors)
    cfg.metrics_bind = load_metrics(data.get("metrics"), errors)
    cfg.update = load_update(data.get("update"), errors)
    if "upstream" in data:
        from gateway.upstream.config import default_gateway_id, parse_upstreams  # (see gateway_id above)

        cfg.upstreams = parse_upstreams(data["upstream"], cfg.gateway_id or default_gateway_id(), errors)
    listeners = data.get("listeners")
    if listeners is None:
        listeners = {"external": {"bind": DEFAULT_BIND}}
    if not isinstance(listeners, dict) or not listeners:
        errors.append("listeners: must hold at least one [listeners.<name>] table")
        listeners = {}
    for name, table in listeners.items():
        where = f"listeners.{name}"
        if not isinstance(table, dict):
            errors.append(f"{where}: must be a table")
            continue
        zone = table.get("zone", name if name in ZONE_DEFAULTS else "external")
        if zone not in ZONE_DEFAULTS:
            errors.append(f"{where}.zone = {zone!r}: must be one of {', '.join(ZONE_DEFAULTS)}")
            zone = "external"
        limits = replace(ZONE_DEFAULTS[zone])
        bind = None
        if "bind" not in table:
            errors.append(f'{where}.bind: missing; give "host:port" or a Unix socket path')
        for key, value in table.items():
            if key not in _LISTENER_KEYS:
                errors.append(f"{where}.{key}: unknown key; allowed: {', '.join(sorted(_LISTENER_KEYS))}")
            elif key == "bind":
                bind = check_value(where, key, value, errors, _BIND)
            elif key in ("zone", "protocol", "path", *_TLS_KEYS, *AUTH_KEYS):
                continue
            else:
                parsed = check_value(where, key, value, errors, _LIMIT_KEYS[key])
                if parsed is not None:
                    setattr(limits, key, parsed)
        tls = _load_tls(where, table, bind, errors)
        auth = load_auth(where, table, bind, errors)
        protocol, path = _load_protocol(where, table, errors)
        if bind is not None:
            cfg.listeners.append(ListenerConfig(name, bind, limits, tls, auth, protocol, path))
    cfg.broker.zones = {lc.name: lc.limits for lc in cfg.listeners}
    if errors:
        raise ConfigError(errors, source)
    return cfg


def load_metrics(table: Any, errors: list[str], where: str = "metrics") -> str | None:
    """``[metrics] bind`` (``where``): the TCP ``"host:port"`` of the Prometheus endpoint, or ``None`` when the table
    or the key is absent (metrics off). Each mistake appends ``where.key = 'value': what is allowed``."""
    if table is None:
        return None
    if not isinstance(table, dict):
        errors.append(f"{where}: must be a table with bind = \"host:port\"")
        return None
    for key in table:
        if key != "bind":
            errors.append(f"{where}.{key}: unknown key; allowed: bind")
    if "bind" not in table:
        return None
    bind = check_value(where, "bind", table["bind"], errors, _METRICS_BIND)
    if bind is not None and is_unix_path(bind):
        errors.append(f"{where}.bind = {bind!r}: must be {METRICS_BIND_ALLOWED}")
        return None
    return bind


def _load_protocol(where: str, table: dict[str, Any], errors: list[str]) -> tuple[str, str]:
    """``protocol`` and ``path`` of ``[listeners.<name>]`` (``where``): ``("mqtt", "/mqtt")`` when absent. Each
    mistake appends ``where.key = 'value': what is allowed``."""
    protocol = table.get("protocol", "mqtt")
    if protocol not in LISTENER_PROTOCOLS:
        errors.append(f"{where}.protocol = {protocol!r}: must be one of {', '.join(map(repr, LISTENER_PROTOCOLS))} "
                      '("websockets": MQTT over WebSockets, wss with the TLS keys)')
        protocol = "mqtt"
    path = table.get("path", "/mqtt")
    if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in " ?#") \
            or not path.isprintable():
        errors.append(f'{where}.path = {path!r}: must be an HTTP path starting with "/" (no spaces, "?" or "#"), '
                      'such as "/mqtt"')
        path = "/mqtt"
    elif "path" in table and protocol != "websockets":
        errors.append(f'{where}.path = {path!r}: only a protocol = "websockets" listener has a path (this one is '
                      f"protocol = {protocol!r})")
    return protocol, path


def _load_tls(where: str, table: dict[str, Any], bind: str | None, errors: list[str]) -> TlsSettings | None:
    """The TLS keys of ``[listeners.<name>]`` (``where``) as :class:`TlsSettings`, or ``None`` when there are none.

    Types first, then the context is built once (:func:`build_server_context`: files readable, PEM of the right
    kind, key matches certificate, cipher list selects something), so a file that would fail at start fails here
    and in ``edge-gateway check-config``. Each mistake appends ``where.key = 'value': reason``.
    """
    given = [key for key in _TLS_KEYS if key in table]
    if not given:
        return None
    before = len(errors)
    values: dict[str, Any] = {}
    for key in given:
        value = table[key]
        if key in _TLS_BOOL_KEYS:
            if not isinstance(value, bool):
                errors.append(f"{where}.{key} = {value!r}: must be true or false")
                continue
        elif key == "tls_version":
            if value not in TLS_VERSIONS:
                errors.append(f"{where}.{key} = {value!r}: must be one of {', '.join(TLS_VERSIONS)} (the minimum)")
                continue
        elif not isinstance(value, str) or not value:
            what = "an OpenSSL cipher list" if key == "ciphers" else "a file path" if key != "capath" else "a directory"
            errors.append(f"{where}.{key} = {value!r}: must be {what}")
            continue
        values[key] = value
    if bind is not None and is_unix_path(bind):
        errors.append(f"{where}.{given[0]} = {table[given[0]]!r}: TLS is not available on a Unix socket listener "
                      f"(bind = {bind!r}); use a TCP bind or drop the TLS keys")
    for key in ("certfile", "keyfile"):
        if key not in table:
            errors.append(f"{where}.{key}: missing; a TLS listener needs certfile and keyfile (set because of "
                          f"{', '.join(given)})")
    if len(errors) > before:
        return None
    settings = TlsSettings(**values)
    try:
        build_server_context(settings)
    except TlsConfigError as exc:
        value = exc.path if exc.path is not None else getattr(settings, exc.key)
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # TOML's spelling of a bool
        errors.append(f"{where}.{exc.key} = {shown}: {exc.reason}")
        return None
    return settings


def _load_store(cfg: GatewayConfig, table: Any, errors: list[str]) -> None:
    cfg.store.path = default_store_path()
    if not isinstance(table, dict):
        errors.append("store: must be a table")
        return
    for key, value in table.items():
        if key not in _STORE_KEYS:
            errors.append(f"store.{key}: unknown key; allowed: {', '.join(sorted(_STORE_KEYS))}")
        elif key == "backend":
            if value not in ("lmdb", "memory"):
                errors.append(f'store.backend = {value!r}: must be "lmdb" (durable) or "memory" (nothing survives '
                              "a restart)")
            else:
                cfg.store_backend = value
        elif key == "path":
            if not isinstance(value, str) or not value:
                errors.append(f"store.path = {value!r}: must be a directory path")
            else:
                cfg.store.path = value
        elif key == "max_size":
            size = check_value("store", key, value, errors, _STORE_MAX_SIZE)
            if size is not None:
                cfg.store.max_size = size
        elif key == "commit_interval":
            interval = check_value("store", key, value, errors, _COMMIT_INTERVAL)
            if interval is not None:
                cfg.store.commit_interval = interval
        elif key == "lazy_commit":
            interval = check_value("store", key, value, errors, _LAZY_COMMIT)
            if interval is not None:
                cfg.store.lazy_commit = interval
        elif key == "group_commit":
            if not isinstance(value, bool):
                errors.append(f"store.group_commit = {value!r}: must be true (default) or false (one fsync per "
                              "message, for benchmarks)")
            else:
                cfg.store.group_commit = value
        elif key == "mqueue_mem_len":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 2**31:
                errors.append(f"store.mqueue_mem_len = {value!r}: must be an integer >= 0 (queued messages of a "
                              "persistent session kept in memory; the rest wait only in the store; 0 = all in "
                              "memory)")
            else:
                cfg.store.mqueue_mem_len = value
        elif key == "on_corrupt":
            if value not in ("quarantine", "refuse"):
                errors.append(f'store.on_corrupt = {value!r}: must be "quarantine" or "refuse"')
            else:
                cfg.store.on_corrupt = value


def read_config(path: str | Path | None) -> GatewayConfig:
    """Read and validate the TOML file at ``path``; ``None`` gives the embedded default (one listener on
    127.0.0.1:1883 with the external zone's limits).

    Raises:
        ConfigError: the file is missing, unreadable, not TOML, or has bad keys or values.
    """
    if path is None:
        return load_config({}, "<defaults>")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror}"], str(p)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}"], str(p)) from None
    return load_config(data, str(p))


def limit_names() -> list[str]:
    """The per-listener limit keys, for ``--help``."""
    return [f.name for f in fields(ZoneLimits)]
