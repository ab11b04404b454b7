"""Modbus RTU, the sans-I/O part: register maps, data types, word and byte order, request planning, timing.

The framing (slave address, PDU, CRC-16) is pymodbus's (``modbus_bus``); this module only decides *what* to ask for
and turns the 16-bit registers and bits that come back into values, and values into registers for writes.

Sources:

* Modbus Application Protocol Specification V1.1b3 (modbus.org, 2012): the four data tables (coils, discrete inputs,
  holding registers, input registers), 0-based protocol addresses 0..65535, and the quantity limits per request
  (read coils / discrete inputs 1..2000 bits, read holding / input registers 1..125 registers, write multiple
  registers 1..123 registers; sections 6.1-6.4, 6.12). Registers travel big-endian (high byte first, section 4.2).
* Modbus over Serial Line Specification and Implementation Guide V1.02 (modbus.org, 2006), section 2.5.1.1: RTU
  frames are separated by a silent interval of at least 3.5 character times; above 19200 bit/s fixed values are
  recommended (1.750 ms for t3.5). A character is 11 bits (start, 8 data, parity or a second stop bit, stop).

Addresses: ``address`` in the config is the 0-based protocol address (what goes on the wire). The "reference"
notation of many device manuals is accepted as a string: ``"30001"`` is input register 0, ``"40001"`` holding register
0, ``"10001"`` discrete input 0, ``"00001"`` coil 0 (six digits, ``"300001"``..``"365536"``, for addresses above
9998). ``"0x0048"`` is a 0-based address in hexadecimal, as manuals print them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

# function name -> (read function code, write function codes); section 6 of the Application Protocol specification
FUNCTIONS = {"coil": 1, "discrete_input": 2, "holding": 3, "input": 4}
BIT_FUNCTIONS = ("coil", "discrete_input")
WRITABLE_FUNCTIONS = ("coil", "holding")
REFERENCE_PREFIX = {"0": "coil", "1": "discrete_input", "3": "input", "4": "holding"}
MAX_READ_BITS = 2000  # read coils / read discrete inputs: quantity 1..2000 (0x7D0)
MAX_READ_REGISTERS = 125  # read holding / input registers: quantity 1..125 (0x7D)
MAX_WRITE_REGISTERS = 123  # write multiple registers: quantity 1..123 (0x7B)
MAX_ADDRESS = 0xFFFF
MAX_UNIT = 247  # slave addresses 1..247 (Modbus over Serial Line V1.02, section 2.2); 0 is broadcast

# data type -> (struct format, registers it occupies); "bool" and "string" are special
TYPES: dict[str, tuple[str, int]] = {
    "bool": ("", 1),
    "int16": ("h", 1),
    "uint16": ("H", 1),
    "int32": ("i", 2),
    "uint32": ("I", 2),
    "float32": ("f", 2),
    "int64": ("q", 4),
    "uint64": ("Q", 4),
    "float64": ("d", 4),
    "string": ("", 0),
}
ORDERS = ("big", "little")

# exception codes (Application Protocol V1.1b3, section 7) -> the reason counted and published
EXCEPTIONS = {
    1: "illegal_function",
    2: "illegal_data_address",
    3: "illegal_data_value",
    4: "server_device_failure",
    5: "acknowledge",
    6: "server_device_busy",
    7: "negative_acknowledge",
    8: "memory_parity_error",
    10: "gateway_path_unavailable",
    11: "gateway_target_failed_to_respond",
}


def exception_reason(code: int) -> str:
    """The snake_case name of a Modbus exception code (``exception_<n>`` for codes the specification does not
    name)."""
    return EXCEPTIONS.get(code, f"exception_{code}")


def silent_interval(baudrate: int) -> float:
    """t3.5 in seconds: 3.5 characters of 11 bits at ``baudrate`` bit/s, or the fixed 1.750 ms above 19200 bit/s
    (Modbus over Serial Line V1.02, section 2.5.1.1)."""
    if baudrate > 19200:
        return 0.00175
    return 3.5 * 11 / baudrate


@dataclass(slots=True, frozen=True)
class Register:
    """One configured value of a device: where it lives, how to decode it, what it is called."""

    name: str
    function: str  # coil, discrete_input, holding, input
    address: int  # 0-based protocol address of the first register (or bit)
    type: str = "uint16"
    count: int = 1  # registers (bits for coils and discrete inputs) it occupies
    word_order: str = "big"  # big: most significant register first ("ABCD"); little: least significant first
    byte_order: str = "big"  # big: high byte first inside each register (the Modbus rule); little: swapped
    scale: float = 1.0
    offset: float = 0.0
    unit: str = ""
    writable: bool = False

    @property
    def end(self) -> int:
        """One past the last address it occupies."""
        return self.address + self.count

    @property
    def is_bit(self) -> bool:
        return self.function in BIT_FUNCTIONS


@dataclass(slots=True)
class Group:
    """Registers polled together every ``interval`` seconds; each poll publishes one reading."""

    interval: float
    registers: list[Register]
    requests: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class ModbusDevice:
    """A slave on the bus: its unit id (slave address), its device id on MQTT and its register groups."""

    name: str
    unit: int
    groups: list[Group] = field(default_factory=list)
    max_registers: int = MAX_READ_REGISTERS  # some devices accept fewer per request than the specification allows
    max_bits: int = MAX_READ_BITS
    max_gap: int = 0  # unconfigured registers (or bits) a request may read through to join two blocks

    def register(self, name: str) -> Register | None:
        for group in self.groups:
            for reg in group.registers:
                if reg.name == name:
                    return reg
        return None

    def register_at(self, function: str, address: int) -> Register | None:
        for group in self.groups:
            for reg in group.registers:
                if reg.function == function and reg.address == address:
                    return reg
        return None


@dataclass(slots=True)
class ModbusSettings:
    """The Modbus part of a ``protocol = "modbus-rtu"`` port."""

    timeout: float = 0.5  # seconds to wait for a response
    retries: int = 2  # further attempts after a timeout, CRC error or busy device, within one poll
    interframe: float | None = None  # seconds of silence between frames; None: t3.5 from the baud rate
    backoff_min: float = 1.0  # seconds: first delay before polling a failing device (or group) again
    backoff_max: float = 60.0  # seconds: the delay doubles up to this
    offline_after: int = 3  # failed polls in a row before a device is reported offline
    devices: list[ModbusDevice] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Request:
    """One read request: ``count`` registers (or bits) of ``function`` from ``address``."""

    function: str
    address: int
    count: int
    registers: tuple[Register, ...]


def parse_address(value: Any, function: str | None) -> tuple[str, int]:
    """``(function, 0-based address)`` from a config ``address`` (int, ``"0x.."`` or reference notation).

    Raises:
        ValueError: naming what is wrong.
    """
    if isinstance(value, bool):
        raise ValueError('must be an integer 0..65535 or a string such as "30001" or "0x0048"')
    if isinstance(value, int):
        if not 0 <= value <= MAX_ADDRESS:
            raise ValueError("must be 0..65535 (0-based)")
        if function is None:
            raise ValueError("a 0-based address needs function = coil, discrete_input, holding or input")
        return function, value
    if not isinstance(value, str):
        raise ValueError('must be an integer 0..65535 or a string such as "30001" or "0x0048"')
    if value.lower().startswith("0x"):
        try:
            address = int(value, 16)
        except ValueError:
            raise ValueError("is not a hexadecimal number") from None
        return parse_address(address, function)
    if not value.isdigit() or len(value) not in (5, 6) or value[0] not in REFERENCE_PREFIX:
        raise ValueError(
            "reference notation is 5 or 6 digits starting with 0 (coil), 1 (discrete input), 3 (input register) or "
            '4 (holding register), such as "30001" (= input register 0)'
        )
    implied = REFERENCE_PREFIX[value[0]]
    number = int(value[1:])
    if number < 1 or number - 1 > MAX_ADDRESS or (len(value) == 5 and number > 9999):
        raise ValueError("the register number after the first digit must be 1..9999 (5 digits) or 1..65536 (6)")
    if function is not None and function != implied:
        raise ValueError(f"{value!r} is a {implied} address, but function = {function!r}")
    return implied, number - 1


def register_count(type_: str, count: int | None) -> int:
    """How many registers (or bits) a value of ``type_`` occupies (``count`` for strings)."""
    if type_ == "string":
        return count or 0
    return TYPES[type_][1]


# -- decoding ------------------------------------------------------------------------------------------------------


def _to_bytes(reg: Register, words: list[int]) -> bytes:
    """The value's bytes most significant first, from registers in the device's word and byte order."""
    if reg.word_order == "little" and reg.type != "string":
        words = list(reversed(words))
    data = b"".join(w.to_bytes(2, "big") for w in words)
    if reg.byte_order == "little":
        data = b"".join(data[i + 1 : i + 2] + data[i : i + 1] for i in range(0, len(data), 2))
    return data


def _from_bytes(reg: Register, data: bytes) -> list[int]:
    """The inverse of :func:`_to_bytes`."""
    if reg.byte_order == "little":
        data = b"".join(data[i + 1 : i + 2] + data[i : i + 1] for i in range(0, len(data), 2))
    words = [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]
    if reg.word_order == "little" and reg.type != "string":
        words.reverse()
    return words


def _shortest_float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (230.1, not 230.10000610351562)."""
    if not math.isfinite(value):
        return value
    packed = struct.pack(">f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack(">f", candidate) == packed:
            return candidate
    return value


def decode_raw(reg: Register, data: list[int] | list[bool]) -> int | float | str:
    """The raw value of ``reg`` from its registers (or bits), before scale and offset.

    ``bool`` is 1 or 0 (a register is true when non-zero); strings are decoded as ASCII/UTF-8 with trailing NUL
    bytes and spaces removed (``byte_order`` applies, ``word_order`` does not: characters are in register order).
    """
    if reg.is_bit:
        return 1 if data[0] else 0
    words = [int(w) for w in data[: reg.count]]
    if reg.type == "bool":
        return 1 if words[0] else 0
    raw = _to_bytes(reg, words)
    if reg.type == "string":
        return raw.rstrip(b"\x00 ").decode("utf-8", errors="replace")
    value = struct.unpack(">" + TYPES[reg.type][0], raw)[0]
    if reg.type == "float32":
        return _shortest_float32(value)
    return value


def decode(reg: Register, data: list[int] | list[bool]) -> int | float | str:
    """The published value: raw * scale + offset (rounded to 12 significant digits when scaled; integers stay
    integers when scale is 1 and offset 0)."""
    raw = decode_raw(reg, data)
    if isinstance(raw, str) or (reg.scale == 1 and reg.offset == 0):
        return raw
    value = raw * reg.scale + reg.offset
    return float(f"{value:.12g}") if math.isfinite(value) else value


def encode(reg: Register, value: Any) -> list[int] | bool:
    """Registers (or the coil state) that make ``reg`` read ``value`` (the inverse of :func:`decode`).

    Raises:
        ValueError: a value of the wrong kind or out of the type's range.
    """
    if reg.is_bit or reg.type == "bool":
        if value in (True, 1):
            state = True
        elif value in (False, 0):
            state = False
        else:
            raise ValueError("must be true, false, 1 or 0")
        return state if reg.is_bit else [1 if state else 0]
    if reg.type == "string":
        if not isinstance(value, str):
            raise ValueError("must be a string")
        data = value.encode("utf-8")
        if len(data) > reg.count * 2:
            raise ValueError(f"at most {reg.count * 2} bytes")
        return _from_bytes(reg, data.ljust(reg.count * 2, b"\x00"))
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError("must be a finite number")
    raw: float = (value - reg.offset) / reg.scale
    fmt = TYPES[reg.type][0]
    if fmt in "fd":
        if fmt == "f" and abs(raw) > 3.4028234663852886e38:
            raise ValueError("out of the float32 range")
        return _from_bytes(reg, struct.pack(">" + fmt, raw))
    rounded = round(raw)
    if abs(rounded - raw) > 1e-9 * max(1.0, abs(raw)):
        steps = f"scale {reg.scale:g}, offset {reg.offset:g}"
        raise ValueError(f"{value} is not a whole number of {reg.type} steps ({steps})")
    try:
        return _from_bytes(reg, struct.pack(">" + fmt, rounded))
    except struct.error:
        raise ValueError(f"out of the {reg.type} range") from None


# -- planning ------------------------------------------------------------------------------------------------------


def plan(registers: list[Register], max_registers: int = 125, max_bits: int = 2000, max_gap: int = 0) -> list[Request]:
    """The fewest read requests that cover ``registers``: per function, in address order, contiguous (or overlapping)
    registers share a request as long as it stays within ``max_registers`` registers (``max_bits`` bits for coils
    and discrete inputs) and no hole is longer than ``max_gap``."""
    requests: list[Request] = []
    for function in FUNCTIONS:
        regs = sorted((r for r in registers if r.function == function), key=lambda r: (r.address, r.end))
        limit = max_bits if function in BIT_FUNCTIONS else max_registers
        start = end = -1
        members: list[Register] = []
        for reg in regs:
            if members and reg.address <= end + max_gap and max(end, reg.end) - start <= limit:
                end = max(end, reg.end)
                members.append(reg)
                continue
            if members:
                requests.append(Request(function, start, end - start, tuple(members)))
            start, end, members = reg.address, reg.end, [reg]
        if members:
            requests.append(Request(function, start, end - start, tuple(members)))
    return requests


def split_response(request: Request, data: list[int] | list[bool]) -> dict[str, list[int] | list[bool]]:
    """Each register's slice of a response to ``request``."""
    return {reg.name: data[reg.address - request.address : reg.end - request.address] for reg in request.registers}
