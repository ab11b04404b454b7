"""firmware-bridge, Modbus RTU ports.

The decoding, request planning and config checks first (no I/O); then end to end: pymodbus's serial server with
several unit ids on one end of a real pseudo-terminal pair (firmware_bridge.modbus_sim.ModbusLine), the bridge as a
real subprocess on the other end, the real broker, a real MQTT subscriber. Every frame on the simulated bus is real
RTU (pymodbus's framer on both sides, CRC-16 included) and passes through a relay that records it, so the tests can
check what went over the line as well as what came out on MQTT.

The register words in ``TYPES_HOLDING`` are written out by hand (IEEE 754 and two's complement), not produced by the
code under test, so a wrong word or byte order fails.

The Eastron SDM120 map is the meter's published one ("SDM120 Modbus Protocol", Eastron Electronic Co., Ltd.: input
registers 30001 Voltage, 30007 Current, 30013 Active power, ... 30343 Total active energy, IEEE 754 float32, high word
first; holding register 40013 Demand period).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from bridge_helpers import BridgeProcess, Collector, wait_stats, wait_until
from firmware_bridge import modbus
from firmware_bridge.config import ConfigError, load_config
from firmware_bridge.modbus_sim import SDM120_INPUT, ModbusLine, Slave, f32, sdm120
from helpers import BrokerProcess
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

GW = "gw-modbus"
BAUD = 9600  # t3.5 = 3.5 * 11 / 9600 s = 4.01 ms
TIMEOUT = 0.2

# -- sans-I/O ---------------------------------------------------------------------------------------------------


def _reg(type_: str, word: str = "big", byte: str = "big", **kw: Any) -> modbus.Register:
    count = kw.pop("count", None)
    return modbus.Register(
        "x", kw.pop("function", "holding"), 0, type_, modbus.register_count(type_, count), word, byte, **kw
    )


# (type, word order, byte order, registers on the wire, value): IEEE 754 / two's complement by hand
VECTORS = [
    ("int16", "big", "big", [0xFFFE], -2),
    ("uint16", "big", "big", [0xFDE8], 65000),
    ("uint16", "big", "little", [0xE8FD], 65000),
    ("int32", "big", "big", [0xFFFE, 0x7960], -100000),
    ("int32", "little", "big", [0x7960, 0xFFFE], -100000),
    ("uint32", "big", "little", [0xD0B2, 0x005E], 3000000000),
    ("float32", "big", "big", [0x4366, 0x199A], 230.1),
    ("float32", "little", "big", [0x199A, 0x4366], 230.1),
    ("float32", "big", "little", [0x6643, 0x9A19], 230.1),
    ("float32", "little", "little", [0x9A19, 0x6643], 230.1),
    ("int64", "big", "big", [0xFFFF, 0xFFFF, 0xFFFF, 0xFFFB], -5),
    ("uint64", "little", "big", [0x0007, 0x0000, 0x0100, 0x0000], 2**40 + 7),
    ("float64", "big", "big", [0xBFF8, 0x0000, 0x0000, 0x0000], -1.5),
    ("float64", "little", "little", [0x0000, 0x0000, 0x0000, 0xF8BF], -1.5),
    ("bool", "big", "big", [0x0005], 1),
    ("bool", "big", "big", [0x0000], 0),
]


@pytest.mark.parametrize(("type_", "word", "byte", "words", "value"), VECTORS)
def test_decode_and_encode_every_type_and_order(type_: str, word: str, byte: str, words: list[int], value: Any) -> None:
    reg = _reg(type_, word, byte)
    assert modbus.decode(reg, words) == value
    if not (type_ == "bool" and words == [0x0005]):  # any non-zero register reads true; true writes 1
        assert modbus.encode(reg, value) == words


def test_strings_scale_offset_and_bits() -> None:
    text = _reg("string", count=4)
    assert modbus.decode(text, [0x5344, 0x4D31, 0x3230, 0x0000]) == "SDM120"
    assert modbus.encode(text, "SDM120") == [0x5344, 0x4D31, 0x3230, 0x0000]
    assert modbus.decode(_reg("string", byte="little", count=2), [0x4453, 0x004D]) == "SDM"
    with pytest.raises(ValueError, match="at most 8 bytes"):
        modbus.encode(text, "too long a name")
    scaled = _reg("int16", scale=0.1, offset=-40.0)
    assert modbus.decode(scaled, [250]) == -15.0  # 250 * 0.1 - 40, not -14.999999999999998
    assert modbus.encode(scaled, -15.0) == [250]
    with pytest.raises(ValueError, match="whole number"):
        modbus.encode(scaled, -15.03)
    with pytest.raises(ValueError, match="range"):
        modbus.encode(_reg("uint16"), 70000)
    coil = _reg("bool", function="coil")
    assert modbus.decode(coil, [True]) == 1
    assert modbus.encode(coil, 0) is False
    assert math.isnan(modbus.decode(_reg("float32"), [0x7FC0, 0x0000]))  # type: ignore[arg-type]


def test_addresses_zero_based_and_reference_notation() -> None:
    assert modbus.parse_address(0, "input") == ("input", 0)
    assert modbus.parse_address("30001", None) == ("input", 0)
    assert modbus.parse_address("40013", "holding") == ("holding", 12)
    assert modbus.parse_address("00001", None) == ("coil", 0)
    assert modbus.parse_address("10002", None) == ("discrete_input", 1)
    assert modbus.parse_address("365536", None) == ("input", 65535)
    assert modbus.parse_address("0x0156", "input") == ("input", 0x156)
    for bad, function in (("30001", "holding"), ("20001", None), ("30000", None), (7, None), (70000, "coil")):
        with pytest.raises(ValueError):
            modbus.parse_address(bad, function)


def test_requests_planned_within_the_limits() -> None:
    def regs(function: str, spans: list[tuple[int, int]]) -> list[modbus.Register]:
        return [modbus.Register(f"r{a}", function, a, "string" if n > 4 else "uint16", n) for a, n in spans]

    # contiguous and overlapping registers share a request; a hole splits unless max_gap covers it
    plan = modbus.plan(regs("input", [(0, 2), (2, 2), (3, 1), (10, 2)]))
    assert [(r.address, r.count) for r in plan] == [(0, 4), (10, 2)]
    plan = modbus.plan(regs("input", [(0, 2), (2, 2), (10, 2)]), max_gap=6)
    assert [(r.address, r.count) for r in plan] == [(0, 12)]
    # 125 registers per read request (Application Protocol V1.1b3, 6.3/6.4), or fewer when the device says so
    many = regs("holding", [(a, 1) for a in range(300)])
    assert [(r.address, r.count) for r in modbus.plan(many)] == [(0, 125), (125, 125), (250, 50)]
    assert [r.count for r in modbus.plan(many, max_registers=80)] == [80, 80, 80, 60]
    bits = [modbus.Register(f"c{a}", "coil", a, "bool", 1) for a in range(2500)]
    assert [(r.address, r.count) for r in modbus.plan(bits)] == [(0, 2000), (2000, 500)]
    # functions never mix
    mixed = regs("input", [(0, 1)]) + regs("holding", [(1, 1)])
    assert [(r.function, r.address) for r in modbus.plan(mixed)] == [("holding", 1), ("input", 0)]


def test_silent_interval_from_the_baud_rate() -> None:
    """Modbus over Serial Line V1.02, 2.5.1.1: 3.5 characters of 11 bits; 1.750 ms above 19200 bit/s."""
    assert modbus.silent_interval(9600) == pytest.approx(0.0040104, abs=1e-6)
    assert modbus.silent_interval(19200) == pytest.approx(0.0020052, abs=1e-6)
    assert modbus.silent_interval(115200) == 0.00175


def _port(extra: str = "", device: str = "") -> dict[str, Any]:
    import tomllib

    text = f"""
[[ports]]
path = "/dev/ttyUSB0"
protocol = "modbus-rtu"
{extra}
[[ports.devices]]
name = "meter-1"
unit = 1
{device}
[[ports.devices.groups]]
interval = "5s"
registers = [
  {{ name = "voltage", address = "30001", type = "float32", unit = "V" }},
  {{ name = "setpoint", address = "40011", type = "int16", scale = 0.1, unit = "degC", writable = true }},
]
"""
    return tomllib.loads(text)


def test_config_modbus_port() -> None:
    cfg = load_config(_port('timeout = "0.3s"\nretries = 1'))
    port = cfg.ports[0]
    assert (port.baudrate, port.parity, port.stopbits) == (19200, "E", 1)  # the Modbus serial line defaults
    assert port.modbus is not None and port.modbus.timeout == 0.3 and port.modbus.retries == 1
    dev = port.modbus.devices[0]
    assert (dev.name, dev.unit) == ("meter-1", 1)
    volt, setpoint = dev.groups[0].registers
    assert (volt.function, volt.address, volt.count, volt.unit) == ("input", 0, 2, "V")
    assert (setpoint.function, setpoint.address, setpoint.writable, setpoint.scale) == ("holding", 10, True, 0.1)
    assert [(r.function, r.address, r.count) for r in dev.groups[0].requests] == [("holding", 10, 1), ("input", 0, 2)]


@pytest.mark.parametrize(
    ("extra", "device", "message"),
    [
        ("", "max_registers = 200", "max_registers = 200: must be an integer 1..125"),
        ('device = "x"', "", "ports[0].device: not for protocol"),
        ("retries = -1", "", "retries = -1"),
        ("", "unit = 0", None),  # a duplicate key: TOML itself refuses it
        ("", 'word_order = "middle"', "word_order = 'middle': must be one of big, little"),
    ],
)
def test_config_modbus_mistakes_are_named(extra: str, device: str, message: str | None) -> None:
    if message is None:
        import tomllib

        with pytest.raises(tomllib.TOMLDecodeError):
            _port(extra, device)
        return
    with pytest.raises(ConfigError) as info:
        load_config(_port(extra, device))
    assert any(message in e for e in info.value.errors), info.value.errors


def test_config_register_mistakes_are_named() -> None:
    data = _port()
    regs = data["ports"][0]["devices"][0]["groups"][0]["registers"]
    regs += [
        {"name": "a", "address": "30003", "writable": True},
        {"name": "b", "function": "holding", "address": 1, "type": "string"},
        {"name": "c", "function": "coil", "address": 0, "type": "float32"},
        {"name": "voltage", "address": "30005", "type": "float32"},
        {"name": "Bad Name", "address": "30007"},
        {"name": "d", "address": 3},
    ]
    data["ports"][0]["devices"].append({"name": "meter-2", "unit": 1, "groups": [{"interval": "1s", "registers": []}]})
    with pytest.raises(ConfigError) as info:
        load_config(data)
    text = "\n".join(info.value.errors)
    for needle in (
        "registers[2].writable: only coils and holding registers can be written, not input",
        'registers[3].count: required for type = "string"',
        "registers[4].type = 'float32': must be one of bool",
        "registers[5].name = 'voltage': used twice",
        "registers[6].name = 'Bad Name'",
        "registers[7].address = 3: a 0-based address needs function",
        "devices[1].unit = 1: two devices with one unit id on this bus",
        "devices[1].groups[0].registers: required",
    ):
        assert needle in text, text


def test_protocol_md_full_example_is_valid_and_planned_as_documented() -> None:
    """firmware-bridge/PROTOCOL.md's full example (an Eastron SDM120 and a PLC on one bus) is a valid config, and its
    groups take the number of requests the text says."""
    import re
    import tomllib

    text = (Path(__file__).resolve().parent.parent / "firmware-bridge" / "PROTOCOL.md").read_text()
    section = text[text.index("## Modbus RTU") :]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block is not None
    cfg = load_config(tomllib.loads(block.group(1)))
    port = cfg.ports[0]
    assert port.modbus is not None and (port.baudrate, port.parity, port.stopbits) == (2400, "N", 1)
    meter, plc = port.modbus.devices
    assert [(r.function, r.address, r.count) for r in meter.groups[0].requests] == [
        ("input", 0, 2),
        ("input", 6, 2),
        ("input", 12, 2),
        ("input", 30, 2),
        ("input", 70, 6),
    ]
    assert meter.register("demand_period") == modbus.Register(
        "demand_period", "holding", 12, "float32", 2, unit="min", writable=True
    )
    assert [(r.function, r.address, r.count) for r in plc.groups[0].requests] == [
        ("coil", 0, 1),
        ("discrete_input", 0, 1),
        ("holding", 0, 5),
        ("holding", 10, 4),
    ]
    assert plc.register("flow_total").word_order == "little"  # type: ignore[union-attr]


# -- end to end -------------------------------------------------------------------------------------------------

# unit 2: every data type and order, at known holding register addresses (words by hand, as in VECTORS)
TYPES_HOLDING = {
    0: [0xFFFE],  # int16 -2
    1: [0xFDE8],  # uint16 65000
    2: [0xFFFE, 0x7960],  # int32 -100000, big/big
    4: [0x7960, 0xFFFE],  # int32 -100000, little word order
    6: [0xD0B2, 0x005E],  # uint32 3000000000, little byte order
    8: [0x4366, 0x199A],  # float32 230.1 ABCD
    10: [0x199A, 0x4366],  # CDAB
    12: [0x6643, 0x9A19],  # BADC
    14: [0x9A19, 0x6643],  # DCBA
    16: [0xFFFF, 0xFFFF, 0xFFFF, 0xFFFB],  # int64 -5
    20: [0x0007, 0x0000, 0x0100, 0x0000],  # uint64 2**40 + 7, little word order
    24: [0x0000, 0x0000, 0x0000, 0xF8BF],  # float64 -1.5, little/little
    28: [0x5344, 0x4D31, 0x3230, 0x0000],  # string "SDM120"
    32: [0x0005],  # bool from a register
    33: [0x00FA],  # int16 250 * 0.1 - 40 = -15
    40: [0x41A0, 0x0000],  # float32 20.0, writable
    42: [0x0064],  # uint16 100 * 0.5 = 50, writable
}
TYPES_EXPECTED = {
    "t_int16": -2,
    "t_uint16": 65000,
    "t_int32": -100000,
    "t_int32_cdab": -100000,
    "t_uint32_badc": 3000000000,
    "t_float32_abcd": 230.1,
    "t_float32_cdab": 230.1,
    "t_float32_badc": 230.1,
    "t_float32_dcba": 230.1,
    "t_int64": -5,
    "t_uint64_cdab": 2**40 + 7,
    "t_float64_dcba": -1.5,
    "t_bool_register": 1,
    "temperature": -15.0,
    "setpoint": 20.0,
    "limit": 50.0,
    "relay": 1,
    "pump": 0,
    "door_open": 0,
    "alarm": 1,
    "level": 1234,
}


def _types_slave() -> Slave:
    slave = Slave(2, coils={0: True, 1: False}, discrete={0: False, 1: True}, input={0: 1234, 1: 0x7FC0, 2: 0})
    for address, words in TYPES_HOLDING.items():
        slave.put("holding", address, words)
    return slave


def _types_device() -> str:
    regs = [
        ("t_int16", 0, "int16", ""),
        ("t_uint16", 1, "uint16", ""),
        ("t_int32", 2, "int32", ""),
        ("t_int32_cdab", 4, "int32", 'word_order = "little", '),
        ("t_uint32_badc", 6, "uint32", 'byte_order = "little", '),
        ("t_float32_abcd", 8, "float32", ""),
        ("t_float32_cdab", 10, "float32", 'word_order = "little", '),
        ("t_float32_badc", 12, "float32", 'byte_order = "little", '),
        ("t_float32_dcba", 14, "float32", 'word_order = "little", byte_order = "little", '),
        ("t_int64", 16, "int64", ""),
        ("t_uint64_cdab", 20, "uint64", 'word_order = "little", '),
        ("t_float64_dcba", 24, "float64", 'word_order = "little", byte_order = "little", '),
        ("model", 28, "string", "count = 4, "),
        ("t_bool_register", 32, "bool", ""),
        ("temperature", 33, "int16", 'scale = 0.1, offset = -40, unit = "degC", '),
        ("setpoint", 40, "float32", 'unit = "degC", writable = true, '),
        ("limit", 42, "uint16", 'scale = 0.5, unit = "l/min", writable = true, '),
    ]
    lines = [f'  {{ {x}name = "{n}", function = "holding", address = {a}, type = "{t}" }},' for n, a, t, x in regs]
    lines += [
        '  { name = "relay", address = "00001", writable = true },',
        '  { name = "pump", address = "00002" },',
        '  { name = "door_open", address = "10001" },',
        '  { name = "alarm", address = "10002" },',
        '  { name = "level", address = "30001", unit = "mm" },',
        '  { name = "broken_sensor", address = "30002", type = "float32", unit = "degC" },',
    ]
    body = "\n".join(lines)
    return f"""
[[ports.devices]]
name = "types-2"
unit = 2
[[ports.devices.groups]]
interval = "0.25s"
registers = [
{body}
]
"""


def _sdm_device() -> str:
    regs = "\n".join(
        f'  {{ name = "{name}", address = "{30001 + address}", type = "float32", unit = "{unit}" }},'
        for address, (name, unit) in sorted(SDM120_INPUT.items())
    )
    return f"""
[[ports.devices]]
name = "sdm120-1"
unit = 1
max_registers = 80                # Eastron: at most 40 float parameters per request
[[ports.devices.groups]]
interval = "0.5s"
registers = [
{regs}
]
[[ports.devices.groups]]
interval = "2s"
registers = [{{ name = "demand_period", address = "40013", type = "float32", unit = "min", writable = true }}]
"""


def _config(workdir: Path, broker_port: int, link: Path) -> str:
    return f"""
[bridge]
gateway_id = "{GW}"
stats_interval = "0.05s"
stats_file = "{workdir}/stats.json"

[mqtt]
broker = "127.0.0.1:{broker_port}"
client_id = "fw-bridge-modbus-{os.getpid()}"
reconnect_min = "0.05s"
reconnect_max = "0.5s"

[[ports]]
path = "{link}"
protocol = "modbus-rtu"
baudrate = {BAUD}
parity = "none"                   # Linux refuses even parity on a pty (EINVAL)
stopbits = 2                      # Modbus over Serial Line 2.5.1: no parity, two stop bits
timeout = "{TIMEOUT}s"
retries = 1
backoff_min = "0.3s"
backoff_max = "0.6s"
offline_after = 2
reopen_max = "0.2s"
{_sdm_device()}
{_types_device()}
[[ports.devices]]
name = "flaky-3"
unit = 3
[[ports.devices.groups]]
interval = "0.1s"
registers = [{{ name = "count", function = "holding", address = 0 }}]
[[ports.devices.groups]]
interval = "0.3s"
registers = [{{ name = "unmapped", function = "holding", address = 100 }}]

[[ports.devices]]
name = "absent-4"                 # configured, never answers (nobody has unit 4 on the bus)
unit = 4
[[ports.devices.groups]]
interval = "0.3s"
registers = [{{ name = "x", function = "holding", address = 0 }}]
"""


@dataclass
class Rig:
    broker: BrokerProcess
    bridge: BridgeProcess
    line: ModbusLine
    slaves: dict[int, Slave]
    sub: Collector
    stats_file: Path

    def stats(self, predicate: Any, what: str = "stats", timeout: float = 10) -> dict[str, Any]:
        try:
            return wait_stats(self.stats_file, predicate, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nbridge log:\n{self.bridge.log()}") from None

    def readings(self, device: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
        return self.sub.wait_json(f"sensors/{GW}/{device}", count, timeout)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.sub.json(f"bridge/{GW}/events") if e["event"] == kind]


@pytest.fixture(scope="module")
def rig(broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    workdir = tmp_path_factory.mktemp("modbus")
    meter = sdm120(1)
    for i, address in enumerate(sorted(SDM120_INPUT)):
        meter.put("input", address, f32(100.0 + i + 0.25))  # each value distinct and exact in float32
    slaves = {1: meter, 2: _types_slave(), 3: Slave(3, holding={0: 7})}
    line = ModbusLine(list(slaves.values()), link=workdir / "ttyRS485", baudrate=BAUD)
    line.start()
    sub = Collector(broker.port, [f"sensors/{GW}/#", f"bridge/{GW}/events", f"cmd/{GW}/+/reply", "test-replies/#"])
    bridge = BridgeProcess(_config(workdir, broker.port, workdir / "ttyRS485"), workdir=workdir).start()
    try:
        stats_file = workdir / "stats.json"
        wait_stats(
            stats_file,
            lambda s: all(p["state"] == "open" for p in s["ports"].values()) and s["mqtt"]["connected"],
            10,
            "the bus open",
        )
        yield Rig(broker, bridge, line, slaves, sub, stats_file)
    finally:
        sub.close()
        code = bridge.stop()
        line.stop()
    assert code == 0, bridge.log()
    assert "Traceback" not in bridge.log(), bridge.log()


def test_every_type_and_order_decodes_to_its_value(rig: Rig) -> None:
    """Real RTU frames from pymodbus's server: the reading of unit 2 in the envelope of docs/message-format.md,
    every data type and order decoded, coils and discrete inputs as 1/0, the string beside the values, and the NaN
    float left out (counted as non_finite)."""
    got = rig.readings("types-2", 2)[-1]
    assert set(got) == {"v", "gateway_id", "device", "boot", "seq", "sensor_time", "gateway_time", "values", "text"}
    assert (got["gateway_id"], got["device"], got["sensor_time"]) == (GW, "types-2", None)
    assert got["seq"] >= 1 and got["boot"] > 1_600_000_000
    values = {name: v["value"] for name, v in got["values"].items()}
    assert values == TYPES_EXPECTED
    assert got["values"]["temperature"]["unit"] == "degC" and got["values"]["level"]["unit"] == "mm"
    assert got["text"] == {"model": "SDM120"}
    stats = rig.stats(lambda s: s["modbus"]["types-2"]["faults"].get("non_finite", 0) >= 1, "non_finite counted")
    assert stats["modbus"]["types-2"]["state"] == "online"


def test_requests_of_a_poll_are_the_planned_ones(rig: Rig) -> None:
    """Contiguous registers are read together: unit 2's poll is 5 requests (holding 0..34 and 40..43 split by the
    hole, coils 0..1, discrete inputs 0..1, input registers 0..2), seen on the wire by the relay."""
    rig.readings("types-2", 3)
    frames = [f.data for f in rig.line.requests(2)]
    kinds = {(d[1], int.from_bytes(d[2:4], "big"), int.from_bytes(d[4:6], "big")) for d in frames if d[1] <= 4}
    assert kinds >= {(3, 0, 34), (3, 40, 3), (1, 0, 2), (2, 0, 2), (4, 0, 3)}, kinds
    assert not any(k[0] == 3 and k[1] not in (0, 40) for k in kinds)


def test_eastron_sdm120_published_map(rig: Rig) -> None:
    """The SDM120's documented input registers (float32, high word first) described by the config format: each
    value lands under its name and unit; contiguous parameters (30071..30079, 30085..30095, 30343..30346) share a
    request and none goes over the meter's 80-register limit."""
    got = rig.readings("sdm120-1", 1)[-1]
    expected = {
        name: (100.0 + i + 0.25, unit) for i, (name, unit) in enumerate(v for _, v in sorted(SDM120_INPUT.items()))
    }
    assert {k: (v["value"], v["unit"]) for k, v in got["values"].items()} == expected
    reads = {
        (int.from_bytes(d[2:4], "big"), int.from_bytes(d[4:6], "big"))
        for d in (f.data for f in rig.line.requests(1))
        if d[1] == 4
    }
    assert (0x46, 10) in reads and (0x54, 12) in reads and (0x156, 4) in reads and (0x0000, 2) in reads, reads
    assert all(count <= 80 for _, count in reads)
    demand = rig.readings("sdm120-1", 2)
    assert any(
        r["values"].get("demand_period") == {"value": 60.0, "unit": "min"}
        for r in rig.sub.json(f"sensors/{GW}/sdm120-1")
    ), demand


def _command(port: int, topic: str, payload: dict[str, Any], response_topic: str | None = None) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
            props.CorrelationData = b"c1"
        info = client.publish(topic, json.dumps(payload).encode(), qos=1, properties=props)
        info.wait_for_publish(5)
        assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def _reply(rig: Rig, topic: str, count: int) -> dict[str, Any]:
    return rig.sub.wait_json(topic, count)[count - 1]


def test_writes_land_read_back_and_reply(rig: Rig) -> None:
    """cmd/<gw>/<device>/write: by name (engineering value through scale and type) or raw (function/address and
    register words); the write goes over the bus (06 / 16 / 05), is read back and answered; only writable
    registers."""
    port, types = rig.broker.port, rig.slaves[2]
    reply = f"cmd/{GW}/types-2/reply"
    _command(port, f"cmd/{GW}/types-2/write", {"name": "setpoint", "value": 21.5}, "test-replies/w1")
    got = _reply(rig, "test-replies/w1", 1)
    assert got["ok"] is True, got
    assert got["data"] == {"name": "setpoint", "value": 21.5, "unit": "degC", "raw": [0x41AC, 0x0000]}
    assert (16, 40, [0x41AC, 0x0000]) in types.writes
    assert rig.sub.on("test-replies/w1")[0].properties.CorrelationData == b"c1"

    _command(port, f"cmd/{GW}/types-2/write", {"address": "40043", "value": 90})
    got = _reply(rig, reply, 1)
    assert (got["ok"], got["data"]["value"], got["data"]["raw"]) == (True, 45.0, [90]), got
    assert (6, 42, [90]) in types.writes

    _command(port, f"cmd/{GW}/types-2/write", {"name": "relay", "value": False})
    got = _reply(rig, reply, 2)
    assert (got["ok"], got["data"]["value"]) == (True, 0), got
    assert types.coils[0] is False

    for n, (payload, error) in enumerate(
        [
            ({"name": "t_int16", "value": 1}, "not_writable"),
            ({"name": "nope", "value": 1}, "unknown_register"),
            ({"name": "limit", "value": 1e9}, "bad_value"),
            ({"name": "limit"}, "bad_request"),
        ],
        start=3,
    ):
        _command(port, f"cmd/{GW}/types-2/write", payload)
        got = _reply(rig, reply, n)
        assert (got["ok"], got["error"]) == (False, error), got
    _command(port, f"cmd/{GW}/types-2/ping", {})
    assert _reply(rig, reply, 7)["error"] == "unknown_command"
    # the next poll publishes the written values
    wait_until(
        lambda: any(
            r["values"]["setpoint"]["value"] == 21.5 and r["values"]["limit"]["value"] == 45.0
            for r in rig.sub.json(f"sensors/{GW}/types-2")
        ),
        10,
        "a reading with the written values",
    )


def test_faults_counted_published_and_survived(rig: Rig) -> None:
    """Corrupted responses (CRC), a busy device (exception 06), an unmapped address (exception 02) and a device that
    never answers (timeouts, then offline) are counted per device and reason, published as events, and the other
    devices keep publishing meanwhile."""
    flaky = rig.slaves[3]
    rig.readings("flaky-3", 1)
    rig.line.corrupt[3] += 3
    rig.stats(lambda s: s["modbus"]["flaky-3"]["faults"].get("crc_error", 0) >= 3, "CRC errors counted")
    flaky.busy += 2  # after the corrupted ones, so that no busy answer is corrupted too
    stats = rig.stats(
        lambda s: (
            s["modbus"]["flaky-3"]["faults"].get("server_device_busy", 0) >= 2
            and s["modbus"]["flaky-3"]["faults"].get("illegal_data_address", 0) >= 1
            and s["modbus"]["absent-4"]["faults"].get("timeout", 0) >= 2
            and s["modbus"]["absent-4"]["state"] == "offline"
        ),
        "faults counted",
    )
    assert stats["modbus"]["flaky-3"]["retries"] >= 3
    before = len(rig.sub.json(f"sensors/{GW}/flaky-3"))
    rig.readings("flaky-3", before + 3)  # survived: flaky-3 publishes again
    reasons = {(e["device"], e["reason"]) for e in rig.events("modbus_fault")}
    assert {("flaky-3", "crc_error"), ("flaky-3", "server_device_busy"), ("flaky-3", "illegal_data_address")} <= reasons
    assert ("absent-4", "timeout") in reasons
    offline = [e for e in rig.events("device_offline") if e["device"] == "absent-4"]
    assert offline and offline[0]["unit"] == 4 and offline[0]["reason"] == "timeout"
    assert {e["reason"] for e in rig.events("modbus_fault") if e["device"] == "types-2"} == {"non_finite"}
    # no corrupted frame was taken for a reading: every published count is the real value
    assert {r["values"]["count"]["value"] for r in rig.sub.json(f"sensors/{GW}/flaky-3")} == {7}


def test_the_bus_is_never_driven_by_two_requests_at_once(rig: Rig) -> None:
    """Half duplex: after every request the bridge waits for its response (or the timeout) and then t3.5 of silence
    before the next request; never two requests in a row while one is still answered."""
    rig.readings("types-2", 4)
    with rig.line.lock:
        frames = list(rig.line.frames)
    t35 = modbus.silent_interval(BAUD)
    checked = 0
    for prev, frame in itertools.pairwise(frames):
        if not frame.request:
            assert not prev.request or prev.data[0] == frame.data[0], "a response to another unit's request"
            continue
        if prev.request:  # the previous request was dropped (silent unit): the bridge waited its timeout
            # (the relay stamps a request when its thread gets to read it, possibly some ms after the bridge sent
            # it: half the timeout is the bound; a request sent while another is pending would come at once)
            assert frame.t - prev.t >= TIMEOUT * 0.5, (prev, frame)
        else:  # causal: the bridge had the response only after the relay passed it on, then kept t3.5 of silence
            assert frame.t - prev.t >= t35, (prev, frame)
        checked += 1
    assert checked > 50


def test_missed_intervals_are_counted(rig: Rig) -> None:
    """flaky-3 polls every 0.1 s while absent-4's timeouts hold the bus for 0.2 s at a time: the ticks that could
    not start on time are counted, not silently lost."""
    stats = rig.stats(lambda s: s["modbus"]["flaky-3"]["missed"] >= 1, "missed ticks counted", timeout=15)
    assert stats["modbus"]["flaky-3"]["missed"] >= 1


def test_stats_carry_the_bus_counters(rig: Rig) -> None:
    """bridge/<gw>/stats: the bus under its configured path with its request/response and byte counters."""
    stats = rig.stats(lambda s: s["modbus"]["types-2"]["readings"] >= 2, "readings")
    port = stats["ports"][str(rig.line.link)]
    assert port["protocol"] == "modbus-rtu" and port["requests"] >= port["responses"] > 0
    assert port["bytes_in"] > 0 and port["bytes_out"] > 0
