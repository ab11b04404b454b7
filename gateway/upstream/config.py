"""``[[upstream]]`` entries: which cloud broker, which local topics go up, which cloud topics come down.

::

    [broker]
    gateway_id = "gw-0001"              # {gateway_id} in templates and the msg_id prefix (default: host name)

    [[upstream]]
    name = "cloud"                      # $SYS/broker/connection/cloud/...; outbox rows are kept per name
    url = "mqtts://mqtt.example.com"    # mqtt:// (default port 1883) or mqtts:// (8883)
    client_id = "{gateway_id}-cloud"    # default "<gateway_id>-<name>"
    username = "gw-0001"
    password = "secret"
    ca_file = "/etc/edge-gateway/ca.pem"        # mqtts: the CA to trust (default: the system's)
    cert_file = "/etc/edge-gateway/gw.pem"      # client certificate and key (mutual TLS)
    key_file = "/etc/edge-gateway/gw.key"
    protocol = "5"                      # "5" (msg_id User Property) or "3.1.1"
    keep_alive = "60s"
    store_qos0 = false                  # keep QoS 0 in the outbox while the link is down (else dropped, counted)
    order = "backlog_first"             # or "live_first" (see docs/upstream.md)
    drain_rate = 200                    # backlog messages per second after a reconnect; 0 = unpaced
    drain_bytes = "256KB"               # backlog bytes per second; 0 = unpaced
    max_inflight = 32                   # QoS 1/2 awaiting PUBACK/PUBCOMP; the cloud's Receive Maximum lowers it
    max_messages = 100000               # outbox bounds; when hit: drop QoS 0 first, then the oldest
    max_bytes = "64MB"
    message_ttl = "7d"                  # drop what waited longer; 0 = never
    ack_timeout = "30s"                 # connected but no acknowledgement this long: tear down and reconnect
    connect_timeout = "10s"
    backoff_initial = "1s"              # reconnect delay doubles from here (with jitter) ...
    backoff_max = "2m"                  # ... up to this
    max_packet_size = 0                 # PUBLISH bytes the cloud takes (0: what its CONNACK says; MQTT 3.1.1: none)
    max_retries = 3                     # re-sends of a message refused with 0x80 Unspecified error, then dropped
    poison_closes = 3                   # closes by the cloud right after one message, in a row, that set it aside
    poison_window = "10s"               # ... "right after": within this long of its send

    [[upstream.forward]]                # local topic filter -> remote topic template
    local = "sensors/#"
    remote = "fleet/{topic}"            # {topic}, {suffix} (levels from the first wildcard on), {gateway_id}
    qos = 1                             # forwarded at min(published QoS, this)

    [[upstream.subscribe]]              # remote topic filter -> local topic template
    remote = "cmd/{gateway_id}/#"
    local = "{topic}"
    qos = 1
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.mqtt.topics import topic_filter_error, topic_name_error
from gateway.values import ValueSpec, check_value

ORDERS = ("backlog_first", "live_first")
PROTOCOLS = {"5": 5, "5.0": 5, "3.1.1": 4}
_PLACEHOLDERS = ("{gateway_id}", "{topic}", "{suffix}")


def fill(template: str, gateway_id: str, topic: str = "", suffix: str = "") -> str:
    """Substitute ``{gateway_id}``, ``{topic}`` and ``{suffix}`` (plain replacement, no other braces)."""
    return template.replace("{gateway_id}", gateway_id).replace("{topic}", topic).replace("{suffix}", suffix)


def suffix_of(topic_filter: str, topic: str) -> str:
    """The levels of ``topic`` from the filter's first wildcard level on (``sensors/#`` + ``sensors/a/b`` ->
    ``a/b``); empty when the filter has no wildcard."""
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if level in ("+", "#"):
            return "/".join(topic.split("/")[i:])
    return ""


def literal_prefix(topic_filter: str) -> str:
    """The filter's levels before its first wildcard, joined (``sensors/+/x`` -> ``sensors``, ``#`` -> ``""``):
    every topic the filter matches starts with it (MQTT 5.0 §4.7.1)."""
    levels = []
    for level in topic_filter.split("/"):
        if level in ("+", "#"):
            break
        levels.append(level)
    return "/".join(levels)


@dataclass(slots=True)
class ForwardRule:
    """Local topic filter -> remote topic template, at most ``qos``."""

    local: str
    remote: str
    qos: int

    def remote_topic(self, topic: str, gateway_id: str) -> str:
        return fill(self.remote, gateway_id, topic, suffix_of(self.local, topic))


@dataclass(slots=True)
class SubscribeRule:
    """Remote topic filter (``{gateway_id}`` filled in) -> local topic template, at most ``qos``."""

    remote: str
    local: str
    qos: int

    def local_topic(self, topic: str, gateway_id: str) -> str:
        return fill(self.local, gateway_id, topic, suffix_of(self.remote, topic))


@dataclass(slots=True)
class UpstreamConfig:
    """One ``[[upstream]]`` entry (see the module docstring for the keys and defaults)."""

    name: str
    url: str
    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    gateway_id: str = ""
    client_id: str = ""
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    protocol: int = 5
    keep_alive: int = 60
    forward: list[ForwardRule] = field(default_factory=list)
    subscribe: list[SubscribeRule] = field(default_factory=list)
    store_qos0: bool = False
    order: str = "backlog_first"
    drain_rate: float = 200.0
    drain_bytes: int = 0
    max_inflight: int = 32
    max_messages: int = 100_000
    max_bytes: int = 64 * 1024 * 1024
    message_ttl: float = 7 * 86400.0
    ack_timeout: float = 30.0
    connect_timeout: float = 10.0
    backoff_initial: float = 1.0
    backoff_max: float = 120.0
    max_packet_size: int = 0
    max_retries: int = 3
    poison_closes: int = 3
    poison_window: float = 10.0


# key -> (kind, low, high, what is allowed)
_NUMERIC: dict[str, ValueSpec] = {
    "keep_alive": ("duration", 0, 65535, 'a duration 0..65535s such as "60s" (0 = off)'),
    "drain_rate": ("number", 0, 1e9, "messages per second >= 0 (0 = unpaced)"),
    "drain_bytes": ("size", 0, 2**40, 'bytes per second such as "256KB" (0 = unpaced)'),
    "max_inflight": ("int", 1, 65535, "an integer 1..65535"),
    "max_messages": ("int", 0, 2**40, "an integer >= 0 (0 = no limit)"),
    "max_bytes": ("size", 0, 2**50, 'a size such as "64MB" (0 = no limit)'),
    "message_ttl": ("duration", 0, 10 * 365 * 86400, 'a duration such as "7d" (0 = never)'),
    "ack_timeout": ("duration", 0.05, 86400, 'a duration such as "30s"'),
    "connect_timeout": ("duration", 0.05, 3600, 'a duration such as "10s"'),
    "backoff_initial": ("duration", 0.01, 86400, 'a duration such as "1s"'),
    "backoff_max": ("duration", 0.01, 86400, 'a duration such as "2m"'),
    "max_packet_size": ("size", 0, 268_435_460, 'a size in bytes such as "128KB" (0 = what the cloud announces)'),
    "max_retries": ("int", 0, 1000, "an integer 0..1000"),
    "poison_closes": ("int", 0, 1000, "an integer 0..1000 (0 = never set a message aside)"),
    "poison_window": ("duration", 0.05, 3600, 'a duration such as "10s"'),
}
_STRINGS = ("client_id", "username", "password", "gateway_id")
_FILES = ("ca_file", "cert_file", "key_file")
UPSTREAM_KEYS = {
    "name",
    "url",
    "protocol",
    "store_qos0",
    "order",
    "forward",
    "subscribe",
    *_NUMERIC,
    *_STRINGS,
    *_FILES,
}
_FORWARD_KEYS = {"local", "remote", "qos"}
_SUBSCRIBE_KEYS = {"remote", "local", "qos"}


def default_gateway_id() -> str:
    """The host name (first label), when ``gateway_id`` is not configured."""
    return socket.gethostname().split(".")[0] or "gateway"


def gateway_id_error(value: Any) -> str | None:
    """Why ``value`` cannot be a gateway id (it becomes a topic level and the msg_id prefix)."""
    if not isinstance(value, str) or not value or any(c in value for c in "/+#\x00:"):
        return "must be a non-empty string without '/', '+', '#' or ':'"
    return None




def _qos(where: str, value: Any, errors: list[str]) -> int:
    if isinstance(value, bool) or value not in (0, 1, 2):
        errors.append(f"{where}.qos = {value!r}: must be 0, 1 or 2")
        return 0
    return int(value)


def _template_error(template: str, wildcards: bool) -> str | None:
    probe = fill(template, "gw", "a/b", "b")
    if "{" in probe or "}" in probe:
        return f"unknown placeholder; allowed: {', '.join(_PLACEHOLDERS)}"
    return topic_filter_error(probe) if wildcards else topic_name_error(probe)


def _rules(where: str, kind: str, value: Any, errors: list[str]) -> list[Any]:
    allowed = _FORWARD_KEYS if kind == "forward" else _SUBSCRIBE_KEYS
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        errors.append(f"{where}.{kind}: must be a list of tables ([[upstream.{kind}]])")
        return []
    out: list[Any] = []
    for i, rule in enumerate(value):
        at = f"{where}.{kind}[{i}]"
        if not isinstance(rule, dict):
            errors.append(f"{at}: must be a table with {', '.join(sorted(allowed))}")
            continue
        for key in rule:
            if key not in allowed:
                errors.append(f"{at}.{key}: unknown key; allowed: {', '.join(sorted(allowed))}")
        qos = _qos(at, rule.get("qos", 1), errors)
        if kind == "forward":
            local, remote = rule.get("local"), rule.get("remote", "{topic}")
            if not isinstance(local, str) or topic_filter_error(local):
                why = topic_filter_error(local) if isinstance(local, str) else "missing"
                errors.append(f'{at}.local = {local!r}: must be a local topic filter such as "sensors/#" ({why})')
                continue
            if not isinstance(remote, str) or _template_error(remote, wildcards=False):
                why = _template_error(remote, False) if isinstance(remote, str) else "not a string"
                errors.append(
                    f"{at}.remote = {remote!r}: must be a remote topic template without wildcards such "
                    f'as "fleet/{{gateway_id}}/{{suffix}}" ({why})'
                )
                continue
            out.append(ForwardRule(local, remote, qos))
        else:
            remote, local = rule.get("remote"), rule.get("local", "{topic}")
            if not isinstance(remote, str) or _template_error(remote, wildcards=True):
                why = _template_error(remote, True) if isinstance(remote, str) else "missing"
                errors.append(
                    f'{at}.remote = {remote!r}: must be a remote topic filter such as "cmd/{{gateway_id}}/#" ({why})'
                )
                continue
            if "{topic}" in remote or "{suffix}" in remote:
                errors.append(f"{at}.remote = {remote!r}: only {{gateway_id}} may appear in a remote filter")
                continue
            if not isinstance(local, str) or _template_error(local, wildcards=False):
                why = _template_error(local, False) if isinstance(local, str) else "not a string"
                errors.append(
                    f"{at}.local = {local!r}: must be a local topic template without wildcards such as "
                    f'"{{topic}}" ({why})'
                )
                continue
            out.append(SubscribeRule(remote, local, qos))
    return out


def parse_upstreams(value: Any, gateway_id: str, errors: list[str]) -> list[UpstreamConfig]:
    """Validate the ``[[upstream]]`` array; every mistake is appended to ``errors`` naming the key, the value
    and what is allowed."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        errors.append("upstream: must be an array of tables ([[upstream]])")
        return []
    out: list[UpstreamConfig] = []
    names: set[str] = set()
    for i, table in enumerate(value):
        where = f"upstream[{i}]"
        if not isinstance(table, dict):
            errors.append(f"{where}: must be a table")
            continue
        name = table.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "/+#\x00"):
            errors.append(
                f"{where}.name = {name!r}: must be a non-empty string without '/', '+' or '#' "
                "(it names $SYS/broker/connection/<name>/...)"
            )
            continue
        if name in names:
            errors.append(f"{where}.name = {name!r}: used by another [[upstream]]; names must be unique")
            continue
        names.add(name)
        where = f"upstream.{name}"
        cfg = UpstreamConfig(name, "", gateway_id=gateway_id)
        for key in table:
            if key not in UPSTREAM_KEYS:
                errors.append(f"{where}.{key}: unknown key; allowed: {', '.join(sorted(UPSTREAM_KEYS))}")
        url = table.get("url")
        parts = urlsplit(url) if isinstance(url, str) else None
        try:
            port = parts.port if parts is not None else None
        except ValueError:
            port = -1
        if (
            parts is None
            or parts.scheme not in ("mqtt", "mqtts")
            or not parts.hostname
            or port == -1
            or parts.path not in ("", "/")
            or parts.query
        ):
            errors.append(f"{where}.url = {url!r}: must be mqtt://host[:port] or mqtts://host[:port]")
        else:
            cfg.url = url  # type: ignore[assignment]
            cfg.tls = parts.scheme == "mqtts"
            cfg.host = parts.hostname
            cfg.port = port or (8883 if cfg.tls else 1883)
            if parts.username:
                cfg.username = parts.username
                cfg.password = parts.password
        for key in _STRINGS:
            if key in table:
                v = table[key]
                if not isinstance(v, str) or (key in ("client_id",) and not v):
                    errors.append(
                        f"{where}.{key} = {v!r}: must be a{' non-empty' if key == 'client_id' else ''} string"
                    )
                elif key == "gateway_id" and gateway_id_error(v):
                    errors.append(f"{where}.gateway_id = {v!r}: {gateway_id_error(v)}")
                else:
                    setattr(cfg, key, v)
        cfg.client_id = (
            fill(table["client_id"], cfg.gateway_id)
            if isinstance(table.get("client_id"), str) and table["client_id"]
            else f"{cfg.gateway_id}-{name}"
        )
        for key in _FILES:
            if key in table:
                v = table[key]
                if not isinstance(v, str) or not Path(v).is_file():
                    errors.append(f"{where}.{key} = {v!r}: must be the path of a readable PEM file")
                else:
                    setattr(cfg, key, v)
        if ("cert_file" in table) != ("key_file" in table):
            missing = "key_file" if "cert_file" in table else "cert_file"
            errors.append(f"{where}.{missing}: missing; a client certificate needs both cert_file and key_file")
        if any(k in table for k in _FILES) and not cfg.tls and parts is not None and parts.scheme == "mqtt":
            errors.append(f"{where}.url = {url!r}: certificates are configured, so the url must be mqtts://")
        if "protocol" in table:
            proto = str(table["protocol"]) if not isinstance(table["protocol"], bool) else ""
            if proto not in PROTOCOLS:
                errors.append(f'{where}.protocol = {table["protocol"]!r}: must be "5" or "3.1.1"')
            else:
                cfg.protocol = PROTOCOLS[proto]
        if "store_qos0" in table:
            if not isinstance(table["store_qos0"], bool):
                errors.append(f"{where}.store_qos0 = {table['store_qos0']!r}: must be true or false")
            else:
                cfg.store_qos0 = table["store_qos0"]
        if "order" in table:
            if table["order"] not in ORDERS:
                errors.append(f"{where}.order = {table['order']!r}: must be one of {', '.join(ORDERS)}")
            else:
                cfg.order = table["order"]
        for key in _NUMERIC:
            if key in table:
                parsed = check_value(where, key, table[key], errors, _NUMERIC[key])
                if parsed is not None:
                    setattr(cfg, key, int(parsed) if key == "keep_alive" else parsed)
        if cfg.backoff_max < cfg.backoff_initial:
            errors.append(
                f"{where}.backoff_max = {table.get('backoff_max')!r}: must be >= backoff_initial "
                f"({cfg.backoff_initial:g}s)"
            )
        cfg.forward = _rules(where, "forward", table.get("forward", []), errors)
        cfg.subscribe = _rules(where, "subscribe", table.get("subscribe", []), errors)
        if not cfg.forward and not cfg.subscribe and "forward" not in table and "subscribe" not in table:
            errors.append(f"{where}: needs at least one [[upstream.forward]] or [[upstream.subscribe]] rule")
        out.append(cfg)
    return out
