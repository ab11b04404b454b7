"""The bridge's TOML configuration (``/etc/firmware-bridge/bridge.toml``): parse, validate, name every mistake.

::

    [bridge]
    gateway_id = "gw-0001"            # topics: sensors/<gateway_id>/<device>, cmd/<gateway_id>/<device>/...
    log_level = "info"
    stats_interval = "10s"            # bridge/<gateway_id>/stats (retained); 0 = off
    stats_file = ""                   # also write the stats as JSON to this file ("" = no file)
    command_timeout = "5s"            # a command without a reply from the board gets error "timeout"

    [mqtt]
    broker = "127.0.0.1:1884"         # the gateway's internal listener ("host:port" or a Unix socket path)
    client_id = ""                    # default: firmware-bridge-<gateway_id>
    keepalive = 30
    session_expiry = "1d"             # persistent session (MQTT 5 Session Expiry Interval)
    buffer = 10000                    # readings held while the broker is unreachable (QoS 0 dropped first)
    window = 32                       # QoS 1 publishes in flight at once
    reconnect_min = "0.2s"            # reconnect backoff (doubles, with jitter, up to reconnect_max)
    reconnect_max = "10s"

    [metrics]                         # Prometheus /metrics (firmware_bridge/metrics.py); off when absent
    bind = "127.0.0.1:9884"

    [sparkplug]                       # also a Sparkplug B Edge Node (firmware_bridge/sparkplug.py); off when absent
    group_id = "plant-1"              # spBv1.0/<group_id>/<message_type>/<edge_node_id>[/<device>]; required
    edge_node_id = ""                 # default: bridge.gateway_id
    devices = []                      # device ids or port paths that are Sparkplug Devices; [] = every device
    primary_host_id = ""              # wait for spBv1.0/STATE/<primary_host_id> online before the births; "" = none
    qos = 1                           # NBIRTH/DBIRTH/DDATA/DDEATH QoS: 1 (acknowledged, stored and forwarded) or 0
    client_id = ""                    # default: firmware-bridge-<gateway_id>-sparkplug (its own clean session)
    [[sparkplug.commands]]            # a board command as a writable metric: a DCMD on it sends the command
    device = "buoy-b01"
    metric = "interval_s"             # the metric name in the device's DBIRTH
    command = "set_interval"          # the command written to the board (PROTOCOL.md, "Commands and replies")
    arg = "seconds"                   # the DCMD's value goes in this argument (a Double metric); without arg the
                                      # metric is a Boolean and true sends the command with no arguments

    [[ports]]
    path = "/dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"
    baudrate = 115200
    bytesize = 8                      # 5..8
    parity = "none"                   # none, even, odd, mark, space
    stopbits = 1                      # 1, 1.5, 2
    rtscts = false
    protocol = "line-json"            # or "nmea"
    device = "buoy-b01"               # line-json: accept only this device id (optional); nmea: required
    qos = 1                           # QoS of this port's readings
    max_line = 512                    # longest accepted line (bytes, trailer included)
    reopen_max = "5s"                 # unplugged/failed port: retry opening with backoff up to this

    [[ports]]                         # an RS-485 bus of Modbus RTU devices (PROTOCOL.md, "Modbus RTU")
    path = "/dev/serial/by-id/usb-FTDI_..._if00-port0"
    protocol = "modbus-rtu"
    baudrate = 19200                  # Modbus defaults: 19200 bit/s, 8 data bits, even parity, 1 stop bit
    parity = "even"
    timeout = "0.5s"                  # response timeout; retries = 2; interframe = t3.5 from the baud rate
    [[ports.devices]]
    name = "meter-1"                  # device id: sensors/<gateway_id>/meter-1
    unit = 1                          # slave address 1..247
    [[ports.devices.groups]]
    interval = "10s"
    registers = [{ name = "voltage", address = "30001", type = "float32", unit = "V" }]
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firmware_bridge import modbus
from firmware_bridge.frames import COMMAND_RE, DEFAULT_MAX_LINE, DEVICE_RE, NMEA_MAX_LINE, QUANTITY_RE
from gateway.values import address_allowed, check_value, is_unix_path, parse_address

DEFAULT_CONFIG = "/etc/firmware-bridge/bridge.toml"
LOG_LEVELS = ("debug", "info", "warning", "error")
PROTOCOLS = ("line-json", "nmea", "modbus-rtu")
PARITIES = {"none": "N", "even": "E", "odd": "O", "mark": "M", "space": "S"}
GATEWAY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ConfigError(Exception):
    """Every configuration mistake, one line each."""

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"{source}: " + "; ".join(errors))


@dataclass(slots=True)
class PortConfig:
    path: str
    baudrate: int = 115200
    bytesize: int = 8
    parity: str = "N"
    stopbits: float = 1
    rtscts: bool = False
    protocol: str = "line-json"
    device: str | None = None
    qos: int = 1
    max_line: int = DEFAULT_MAX_LINE
    reopen_max: float = 5.0
    modbus: modbus.ModbusSettings | None = None  # protocol "modbus-rtu" only


@dataclass(slots=True)
class MqttConfig:
    broker: str = "127.0.0.1:1884"
    client_id: str = ""
    keepalive: int = 30
    session_expiry: float = 86400.0
    buffer: int = 10000
    window: int = 32
    reconnect_min: float = 0.2
    reconnect_max: float = 10.0

    @property
    def is_unix(self) -> bool:
        """True when ``broker`` is a Unix socket path."""
        return is_unix_path(self.broker)

    def host_port(self) -> tuple[str, int]:
        """``(host, port)`` of a TCP ``broker``; an IPv6 host in brackets is unwrapped."""
        address = parse_address(self.broker)
        return address.host, address.port


@dataclass(frozen=True, slots=True)
class SparkplugCommand:
    """``[[sparkplug.commands]]``: the writable metric ``metric`` of serial device ``device`` sends ``command``
    (with the written value as argument ``arg``, or with no arguments when ``arg`` is None)."""

    device: str
    metric: str
    command: str
    arg: str | None = None


@dataclass(slots=True)
class SparkplugConfig:
    """``[sparkplug]``: the Edge Node's identity, its Devices and its Primary Host Application."""

    group_id: str = ""
    edge_node_id: str = ""  # "" until loaded: then the gateway id unless given
    devices: list[str] = field(default_factory=list)  # device ids or port paths; empty = every device
    primary_host_id: str | None = None
    qos: int = 1
    client_id: str = ""
    commands: list[SparkplugCommand] = field(default_factory=list)

    def selects(self, device: str, port: str) -> bool:
        """Whether ``device`` (on the port with path ``port``) is a Sparkplug Device."""
        return not self.devices or device in self.devices or port in self.devices


@dataclass(slots=True)
class BridgeConfig:
    gateway_id: str = "gw-0001"
    log_level: str = "info"
    stats_interval: float = 10.0
    stats_file: str = ""
    command_timeout: float = 5.0
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    ports: list[PortConfig] = field(default_factory=list)
    source: str = "<defaults>"
    metrics_bind: str | None = None  # [metrics] bind: "host:port" of the Prometheus endpoint; None = off
    sparkplug: SparkplugConfig | None = None  # [sparkplug]: None = the envelope only


class _Checker:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def table(self, where: str, value: Any, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.errors.append(f"{where} must be a table")
            return {}
        for key in value:
            if key not in allowed:
                self.errors.append(f"{where}.{key}: unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def int_(self, where: str, value: Any, low: int, high: int) -> int | None:
        return check_value("", where, value, self.errors, ("int", low, high, f"an integer {low}..{high}"))

    def duration(self, where: str, value: Any, low: float, high: float) -> float | None:
        """Seconds (see :func:`gateway.values.parse_duration`) in ``low..high``."""
        allowed = f'a duration {low:g}..{high:g} s such as "5s"'
        return check_value("", where, value, self.errors, ("duration", low, high, allowed))

    def address(self, where: str, value: Any) -> str | None:
        """``"host:port"`` (port 1..65535) or a Unix socket path."""
        return check_value("", where, value, self.errors, ("address", 1, 65535, address_allowed(1)))

    def str_(
        self,
        where: str,
        value: Any,
        pattern: re.Pattern[str] | None = None,
        allowed: Any = None,
        empty_ok: bool = False,
    ) -> str | None:
        ok = isinstance(value, str) and (bool(value) or empty_ok)
        if ok and pattern is not None and value:
            ok = bool(pattern.match(value))
        if ok and allowed is not None:
            ok = value in allowed
        if not ok:
            hint = (
                f"one of {', '.join(allowed)}"
                if allowed is not None
                else (f"a string matching {pattern.pattern}" if pattern is not None else "a non-empty string")
            )
            self.errors.append(f"{where} = {value!r}: must be {hint}")
            return None
        return value

    def bool_(self, where: str, value: Any) -> bool | None:
        return check_value("", where, value, self.errors, ("bool", 0, 1, "true or false"))


_BRIDGE_KEYS = {"gateway_id", "log_level", "stats_interval", "stats_file", "command_timeout"}
_MQTT_KEYS = {
    "broker",
    "client_id",
    "keepalive",
    "session_expiry",
    "buffer",
    "window",
    "reconnect_min",
    "reconnect_max",
}
_PORT_KEYS = {
    "path",
    "baudrate",
    "bytesize",
    "parity",
    "stopbits",
    "rtscts",
    "protocol",
    "device",
    "qos",
    "max_line",
    "reopen_max",
}
_MODBUS_PORT_KEYS = (_PORT_KEYS - {"device", "max_line", "rtscts"}) | {
    "timeout",
    "retries",
    "interframe",
    "backoff_min",
    "backoff_max",
    "offline_after",
    "devices",
}
_MODBUS_DEVICE_KEYS = {"name", "unit", "byte_order", "word_order", "max_registers", "max_bits", "max_gap", "groups"}
_MODBUS_GROUP_KEYS = {"interval", "registers"}
_MODBUS_REGISTER_KEYS = {
    "name",
    "function",
    "address",
    "type",
    "count",
    "word_order",
    "byte_order",
    "scale",
    "offset",
    "unit",
    "writable",
}
MAX_UNIT_LEN = 16


def _number(c: _Checker, where: str, value: Any, nonzero: bool = False) -> float | None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value != value
        or value
        in (
            float("inf"),
            float("-inf"),
        )
    ):
        c.errors.append(f"{where} = {value!r}: must be a finite number")
        return None
    if nonzero and value == 0:
        c.errors.append(f"{where} = 0: must not be 0")
        return None
    return float(value)


def _modbus_register(
    c: _Checker, where: str, raw: Any, dev: modbus.ModbusDevice, orders: tuple[str, str]
) -> modbus.Register | None:
    r = c.table(where, raw, _MODBUS_REGISTER_KEYS)
    name = c.str_(f"{where}.name", r.get("name"), QUANTITY_RE)
    function = None
    if "function" in r:
        function = c.str_(f"{where}.function", r["function"], allowed=tuple(modbus.FUNCTIONS))
        if function is None:
            return None
    if "address" not in r:
        c.errors.append(f'{where}.address: required (0-based, or a string such as "30001")')
        return None
    try:
        function, address = modbus.parse_address(r["address"], function)
    except ValueError as exc:
        c.errors.append(f"{where}.address = {r['address']!r}: {exc}")
        return None
    is_bit = function in modbus.BIT_FUNCTIONS
    type_ = "bool" if is_bit else "uint16"
    if "type" in r:
        allowed = ("bool",) if is_bit else tuple(modbus.TYPES)
        type_ = c.str_(f"{where}.type", r["type"], allowed=allowed) or type_
    count = None
    if "count" in r:
        if type_ != "string":
            c.errors.append(f'{where}.count: only for type = "string" (the other types have a fixed size)')
        else:
            count = c.int_(f"{where}.count", r["count"], 1, modbus.MAX_READ_REGISTERS)
    elif type_ == "string":
        c.errors.append(f'{where}.count: required for type = "string" (registers, 2 characters each)')
        return None
    size = modbus.register_count(type_, count)
    if size == 0 or address + size - 1 > modbus.MAX_ADDRESS:
        c.errors.append(f"{where}: registers {address}..{address + size - 1} run past address 65535")
        return None
    word_order, byte_order = orders
    if "word_order" in r:
        word_order = c.str_(f"{where}.word_order", r["word_order"], allowed=modbus.ORDERS) or word_order
    if "byte_order" in r:
        byte_order = c.str_(f"{where}.byte_order", r["byte_order"], allowed=modbus.ORDERS) or byte_order
    scale = _number(c, f"{where}.scale", r["scale"], nonzero=True) if "scale" in r else 1.0
    offset = _number(c, f"{where}.offset", r["offset"]) if "offset" in r else 0.0
    if type_ == "string" and ("scale" in r or "offset" in r):
        c.errors.append(f"{where}: scale and offset do not apply to strings")
    unit = ""
    if "unit" in r:
        unit = c.str_(f"{where}.unit", r["unit"], empty_ok=True) or ""
        if len(unit) > MAX_UNIT_LEN:
            c.errors.append(f"{where}.unit = {unit!r}: at most {MAX_UNIT_LEN} characters")
    writable = bool(c.bool_(f"{where}.writable", r["writable"])) if "writable" in r else False
    if writable and function not in modbus.WRITABLE_FUNCTIONS:
        c.errors.append(f"{where}.writable: only coils and holding registers can be written, not {function}")
    if writable and size > modbus.MAX_WRITE_REGISTERS:
        c.errors.append(f"{where}.writable: at most {modbus.MAX_WRITE_REGISTERS} registers per write")
    limit = dev.max_bits if is_bit else dev.max_registers
    if size > limit:
        c.errors.append(f"{where}: {size} registers do not fit in one request (max_registers = {limit})")
    if name is None or scale is None or offset is None:
        return None
    return modbus.Register(name, function, address, type_, size, word_order, byte_order, scale, offset, unit, writable)


def _modbus_device(c: _Checker, where: str, raw: Any) -> modbus.ModbusDevice | None:
    d = c.table(where, raw, _MODBUS_DEVICE_KEYS)
    name = c.str_(f"{where}.name", d.get("name"), DEVICE_RE)
    unit = c.int_(f"{where}.unit", d.get("unit"), 1, modbus.MAX_UNIT)
    dev = modbus.ModbusDevice(name or "?", unit or 0)
    for key, low, high in (
        ("max_registers", 1, modbus.MAX_READ_REGISTERS),
        ("max_bits", 1, modbus.MAX_READ_BITS),
        ("max_gap", 0, modbus.MAX_READ_REGISTERS - 1),
    ):
        if key in d:
            v = c.int_(f"{where}.{key}", d[key], low, high)
            if v is not None:
                setattr(dev, key, v)
    orders = ["big", "big"]
    for i, key in enumerate(("word_order", "byte_order")):
        if key in d:
            orders[i] = c.str_(f"{where}.{key}", d[key], allowed=modbus.ORDERS) or "big"
    groups = d.get("groups")
    if not isinstance(groups, list) or not groups:
        c.errors.append(f"{where}.groups: required, an array of tables ([[ports.devices.groups]]): interval, registers")
        groups = []
    names: set[str] = set()
    for gi, graw in enumerate(groups):
        gwhere = f"{where}.groups[{gi}]"
        g = c.table(gwhere, graw, _MODBUS_GROUP_KEYS)
        interval = c.duration(f"{gwhere}.interval", g.get("interval"), 0.01, 86400)
        regs = g.get("registers")
        if not isinstance(regs, list) or not regs:
            c.errors.append(f"{gwhere}.registers: required, a non-empty array of tables")
            regs = []
        if len(regs) > modbus.MAX_READ_REGISTERS:
            c.errors.append(f"{gwhere}.registers: at most {modbus.MAX_READ_REGISTERS} per group")
        group = modbus.Group(interval or 1.0, [])
        for ri, rraw in enumerate(regs):
            reg = _modbus_register(c, f"{gwhere}.registers[{ri}]", rraw, dev, (orders[0], orders[1]))
            if reg is None:
                continue
            if reg.name in names:
                c.errors.append(f"{gwhere}.registers[{ri}].name = {reg.name!r}: used twice in device {dev.name!r}")
            names.add(reg.name)
            group.registers.append(reg)
        group.requests = modbus.plan(group.registers, dev.max_registers, dev.max_bits, dev.max_gap)
        dev.groups.append(group)
    if name is None or unit is None:
        return None
    return dev


def _modbus_port(c: _Checker, where: str, p: dict[str, Any], port: PortConfig) -> None:
    for key in sorted(set(p) - _MODBUS_PORT_KEYS - {"protocol"}):
        c.errors.append(f'{where}.{key}: not for protocol "modbus-rtu"')
    settings = port.modbus = modbus.ModbusSettings()
    for key, low, high in (("timeout", 0.01, 60), ("backoff_min", 0.01, 3600), ("backoff_max", 0.01, 86400)):
        if key in p:
            v = c.duration(f"{where}.{key}", p[key], low, high)
            if v is not None:
                setattr(settings, key, v)
    if "interframe" in p and p["interframe"] != "auto":
        settings.interframe = c.duration(f"{where}.interframe", p["interframe"], 0, 1)
    for key, low, high in (("retries", 0, 10), ("offline_after", 1, 1000)):
        if key in p:
            v = c.int_(f"{where}.{key}", p[key], low, high)
            if v is not None:
                setattr(settings, key, v)
    if settings.backoff_max < settings.backoff_min:
        c.errors.append(f"{where}.backoff_max must be >= backoff_min")
    devices = p.get("devices")
    if not isinstance(devices, list) or not devices:
        c.errors.append(f"{where}.devices: required, an array of tables ([[ports.devices]]) with name, unit, groups")
        devices = []
    units: set[int] = set()
    for di, draw in enumerate(devices):
        dev = _modbus_device(c, f"{where}.devices[{di}]", draw)
        if dev is None:
            continue
        if dev.unit in units:
            c.errors.append(f"{where}.devices[{di}].unit = {dev.unit}: two devices with one unit id on this bus")
        units.add(dev.unit)
        settings.devices.append(dev)


METRICS_BIND_ALLOWED = ('a TCP "host:port" such as "127.0.0.1:9884" or "[::1]:9884" (port 0..65535; 0 = any free '
                        "port), not a Unix socket path")


def _metrics_bind(c: _Checker, table: Any) -> str | None:
    """``[metrics] bind``: the TCP ``"host:port"`` of the Prometheus endpoint (firmware_bridge/metrics.py), or None
    (off) when the table or the key is absent."""
    if table is None:
        return None
    t = c.table("metrics", table, {"bind"})
    if "bind" not in t:
        return None
    bind = check_value("metrics", "bind", t["bind"], c.errors, ("address", 0, 65535, METRICS_BIND_ALLOWED))
    if bind is not None and is_unix_path(bind):
        c.errors.append(f"metrics.bind = {bind!r}: must be {METRICS_BIND_ALLOWED}")
        return None
    return bind


# Sparkplug 3.0 [tck-id-topic-structure-namespace-valid-group-id] (and -edge-node-id, -device-id): UTF-8 without
# the reserved characters + / #
SPARKPLUG_ID_RE = re.compile(r"^[^+/#\x00-\x1f]{1,64}$")
SPARKPLUG_ID_ALLOWED = "1..64 characters without +, /, # or control characters (Sparkplug 3.0, section 4.1.1)"
_SPARKPLUG_KEYS = {"group_id", "edge_node_id", "devices", "primary_host_id", "qos", "client_id", "commands"}
_SPARKPLUG_COMMAND_KEYS = {"device", "metric", "command", "arg"}


def _sparkplug(c: _Checker, table: Any, cfg: BridgeConfig) -> SparkplugConfig | None:
    """``[sparkplug]``, or None when the table is absent."""
    if table is None:
        return None
    t = c.table("sparkplug", table, _SPARKPLUG_KEYS)
    spb = SparkplugConfig()

    def ident(key: str, value: Any) -> str | None:
        if not isinstance(value, str) or not SPARKPLUG_ID_RE.match(value):
            c.errors.append(f"sparkplug.{key} = {value!r}: must be {SPARKPLUG_ID_ALLOWED}")
            return None
        return value

    if "group_id" not in t:
        c.errors.append(f"sparkplug.group_id: required ({SPARKPLUG_ID_ALLOWED}), e.g. \"plant-1\"")
    else:
        spb.group_id = ident("group_id", t["group_id"]) or ""
    if t.get("edge_node_id", "") != "":
        spb.edge_node_id = ident("edge_node_id", t["edge_node_id"]) or ""
    if t.get("primary_host_id", "") != "":
        spb.primary_host_id = ident("primary_host_id", t["primary_host_id"])
    if "qos" in t:
        qos = c.int_("sparkplug.qos", t["qos"], 0, 1)
        spb.qos = spb.qos if qos is None else qos
    if "client_id" in t:
        spb.client_id = c.str_("sparkplug.client_id", t["client_id"], empty_ok=True) or ""
    devices = t.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, str) and d for d in devices):
        c.errors.append(f"sparkplug.devices = {devices!r}: must be an array of device ids or port paths")
        devices = []
    spb.devices = list(devices)
    commands = t.get("commands", [])
    if not isinstance(commands, list):
        c.errors.append("sparkplug.commands must be an array of tables ([[sparkplug.commands]])")
        commands = []
    for i, raw in enumerate(commands):
        where = f"sparkplug.commands[{i}]"
        ct = c.table(where, raw, _SPARKPLUG_COMMAND_KEYS)
        device = c.str_(f"{where}.device", ct.get("device"), DEVICE_RE)
        metric = ident(f"commands[{i}].metric", ct.get("metric"))
        command = c.str_(f"{where}.command", ct.get("command"), COMMAND_RE)
        arg = c.str_(f"{where}.arg", ct["arg"], QUANTITY_RE) if "arg" in ct else None
        if device is not None and metric is not None and command is not None:
            spb.commands.append(SparkplugCommand(device, metric, command, arg))
    return spb


def _check_sparkplug_devices(c: _Checker, cfg: BridgeConfig) -> None:
    """Names in ``sparkplug.devices`` and ``sparkplug.commands`` must be configured ports or devices, and a board
    command must be for a serial (not Modbus) device."""
    spb = cfg.sparkplug
    if spb is None:
        return
    modbus_devices = {d.name for p in cfg.ports if p.modbus for d in p.modbus.devices}
    known = {p.path for p in cfg.ports} | {p.device for p in cfg.ports if p.device} | modbus_devices
    for name in spb.devices:
        if name not in known and DEVICE_RE.match(name) is None:
            c.errors.append(f"sparkplug.devices: {name!r} is neither a configured port path nor a device id")
    for i, cmd in enumerate(spb.commands):
        if cmd.device in modbus_devices:
            c.errors.append(
                f"sparkplug.commands[{i}].device = {cmd.device!r}: a Modbus device; its writable registers are "
                "writable metrics already"
            )


def load_config(data: dict[str, Any], source: str = "<config>") -> BridgeConfig:
    """Validate a parsed TOML document.

    Raises:
        ConfigError: naming every unknown key and bad value.
    """
    c = _Checker()
    cfg = BridgeConfig(source=source)
    for key in data:
        if key not in ("bridge", "mqtt", "ports", "metrics", "sparkplug"):
            c.errors.append(f"{key}: unknown table (allowed: bridge, metrics, mqtt, ports, sparkplug)")
    cfg.metrics_bind = _metrics_bind(c, data.get("metrics"))
    cfg.sparkplug = _sparkplug(c, data.get("sparkplug"), cfg)
    bridge = c.table("bridge", data.get("bridge", {}), _BRIDGE_KEYS)
    if "gateway_id" in bridge:
        cfg.gateway_id = c.str_("bridge.gateway_id", bridge["gateway_id"], GATEWAY_ID_RE) or cfg.gateway_id
    if "log_level" in bridge:
        cfg.log_level = c.str_("bridge.log_level", bridge["log_level"], allowed=LOG_LEVELS) or cfg.log_level
    if "stats_interval" in bridge:
        v = c.duration("bridge.stats_interval", bridge["stats_interval"], 0, 86400)
        cfg.stats_interval = cfg.stats_interval if v is None else v
    if "stats_file" in bridge:
        cfg.stats_file = c.str_("bridge.stats_file", bridge["stats_file"], empty_ok=True) or ""
    if "command_timeout" in bridge:
        v = c.duration("bridge.command_timeout", bridge["command_timeout"], 0.01, 3600)
        cfg.command_timeout = cfg.command_timeout if v is None else v

    mqtt = c.table("mqtt", data.get("mqtt", {}), _MQTT_KEYS)
    m = cfg.mqtt
    if "broker" in mqtt:
        m.broker = c.address("mqtt.broker", mqtt["broker"]) or m.broker
    if "client_id" in mqtt:
        m.client_id = c.str_("mqtt.client_id", mqtt["client_id"], empty_ok=True) or ""
    for key, low, high in (("keepalive", 0, 65535), ("buffer", 1, 10_000_000), ("window", 1, 1000)):
        if key in mqtt:
            v = c.int_(f"mqtt.{key}", mqtt[key], low, high)
            if v is not None:
                setattr(m, key, v)
    for key, shortest, longest in (
        ("session_expiry", 0, 0xFFFFFFFF),
        ("reconnect_min", 0.01, 3600),
        ("reconnect_max", 0.01, 3600),
    ):
        if key in mqtt:
            seconds = c.duration(f"mqtt.{key}", mqtt[key], shortest, longest)
            if seconds is not None:
                setattr(m, key, seconds)
    if m.reconnect_max < m.reconnect_min:
        c.errors.append("mqtt.reconnect_max must be >= mqtt.reconnect_min")

    ports = data.get("ports", [])
    if not isinstance(ports, list):
        c.errors.append("ports must be an array of tables ([[ports]])")
        ports = []
    seen: set[str] = set()
    for i, raw in enumerate(ports):
        where = f"ports[{i}]"
        p = c.table(where, raw, _PORT_KEYS | _MODBUS_PORT_KEYS)
        if p.get("protocol") != "modbus-rtu":
            for key in sorted(set(p) - _PORT_KEYS):
                allowed = ", ".join(sorted(_PORT_KEYS))
                c.errors.append(f'{where}.{key}: only for protocol "modbus-rtu" (allowed: {allowed})')
        path = c.str_(f"{where}.path", p.get("path"))
        if path is None:
            continue
        if path in seen:
            c.errors.append(f"{where}.path = {path!r}: listed twice")
        seen.add(path)
        port = PortConfig(path=path)
        if "protocol" in p:
            port.protocol = c.str_(f"{where}.protocol", p["protocol"], allowed=PROTOCOLS) or port.protocol
        port.max_line = NMEA_MAX_LINE if port.protocol == "nmea" else DEFAULT_MAX_LINE
        if port.protocol == "modbus-rtu":
            port.baudrate, port.parity = 19200, "E"  # Modbus over Serial Line V1.02, 2.5.1: 19200 bit/s, even parity
            _modbus_port(c, where, p, port)
        if "baudrate" in p:
            port.baudrate = c.int_(f"{where}.baudrate", p["baudrate"], 50, 4_000_000) or port.baudrate
        if "bytesize" in p:
            port.bytesize = c.int_(f"{where}.bytesize", p["bytesize"], 5, 8) or port.bytesize
        if "parity" in p:
            parity = c.str_(f"{where}.parity", p["parity"], allowed=tuple(PARITIES))
            port.parity = PARITIES[parity] if parity else port.parity
        if "stopbits" in p:
            if p["stopbits"] in (1, 1.5, 2) and not isinstance(p["stopbits"], bool):
                port.stopbits = p["stopbits"]
            else:
                c.errors.append(f"{where}.stopbits = {p['stopbits']!r}: must be 1, 1.5 or 2")
        if "rtscts" in p:
            port.rtscts = bool(c.bool_(f"{where}.rtscts", p["rtscts"]))
        if "device" in p and port.protocol != "modbus-rtu":
            port.device = c.str_(f"{where}.device", p["device"], DEVICE_RE)
        elif port.protocol == "nmea":
            c.errors.append(f'{where}.device: required for protocol "nmea" (NMEA sentences name no device)')
        if "qos" in p:
            qos = c.int_(f"{where}.qos", p["qos"], 0, 2)
            port.qos = port.qos if qos is None else qos
        if "max_line" in p and port.protocol != "modbus-rtu":
            port.max_line = c.int_(f"{where}.max_line", p["max_line"], 16, 65536) or port.max_line
        if "reopen_max" in p:
            v = c.duration(f"{where}.reopen_max", p["reopen_max"], 0.01, 3600)
            port.reopen_max = port.reopen_max if v is None else v
        cfg.ports.append(port)
    _unique_devices(c, cfg.ports)
    _check_sparkplug_devices(c, cfg)
    if c.errors:
        raise ConfigError(c.errors, source)
    if not m.client_id:
        m.client_id = f"firmware-bridge-{cfg.gateway_id}"
    if cfg.sparkplug is not None:
        cfg.sparkplug.edge_node_id = cfg.sparkplug.edge_node_id or cfg.gateway_id
        cfg.sparkplug.client_id = cfg.sparkplug.client_id or f"firmware-bridge-{cfg.gateway_id}-sparkplug"
    m.window = min(m.window, m.buffer)
    return cfg


def _unique_devices(c: _Checker, ports: list[PortConfig]) -> None:
    """A device id is a topic level: two ports (or two Modbus devices) must not claim the same one."""
    seen: dict[str, str] = {}
    for port in ports:
        names = [d.name for d in port.modbus.devices] if port.modbus else ([port.device] if port.device else [])
        for name in names:
            if name in seen:
                c.errors.append(f"device {name!r}: configured twice ({seen[name]} and {port.path})")
            seen[name] = port.path


def read_config(path: str | Path) -> BridgeConfig:
    """Read and validate a TOML file (ConfigError also for a missing file or bad TOML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], str(path)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"invalid TOML: {exc}"], str(path)) from None
    return load_config(data, str(path))
