"""Simulated Modbus RTU slaves on a real pseudo-terminal pair: pymodbus's serial server answering real RTU frames.

::

    firmware-bridge (pyserial) -> pty B slave (the "bus" path, e.g. var/demo/ttyRS485) -> pty B master
        <- relay thread (records every frame, injects faults) ->
    pty A master -> pty A slave <- pymodbus ModbusSerialServer (RTU framer, one SimDevice per unit id)

A pty has one path only (its slave side), so the server and the bridge each get a pty of their own and a relay
thread copies bytes between the two masters, like the two ends of an RS-485 cable. The relay splits the byte stream
into RTU frames (by the lengths the Modbus Application Protocol V1.1b3 gives each function) so it can:

* record each request and response with its time (``line.frames``), to check that requests never overlap;
* drop requests to unit ids nobody serves, or to units made ``silent`` (a device that stopped answering);
* corrupt the next response(s) of a unit (one bit flipped: the CRC no longer matches).

Exception responses come from the server itself: an address outside a device's map answers 02 (Illegal Data
Address), ``busy`` makes a unit answer 06 (Server Device Busy), a request over a device's ``max_registers`` answers
03 (Illegal Data Value).

:func:`sdm120` builds the register map of an Eastron SDM120-Modbus single-phase energy meter from its published
protocol document ("SDM120 Modbus Protocol", Eastron Electronic Co., Ltd.; input registers 30001.. as IEEE 754
float32, high word first): the values are simulated, the addresses, types and units are the meter's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import select
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firmware_bridge.ptys import open_raw_pty, point_link

log = logging.getLogger("firmware_bridge.modbus_sim")

# Eastron SDM120-Modbus, input registers (function 04), float32 high word first: 0-based address -> (name, unit).
# Source: Eastron "SDM120 Modbus Protocol" (input register table: 30001 Voltage ... 30345 Total reactive energy).
SDM120_INPUT = {
    0x0000: ("voltage", "V"),
    0x0006: ("current", "A"),
    0x000C: ("active_power", "W"),
    0x0012: ("apparent_power", "VA"),
    0x0018: ("reactive_power", "var"),
    0x001E: ("power_factor", "1"),
    0x0024: ("phase_angle", "deg"),
    0x0046: ("frequency", "Hz"),
    0x0048: ("import_active_energy", "kWh"),
    0x004A: ("export_active_energy", "kWh"),
    0x004C: ("import_reactive_energy", "kvarh"),
    0x004E: ("export_reactive_energy", "kvarh"),
    0x0054: ("total_system_power_demand", "W"),
    0x0056: ("maximum_total_system_power_demand", "W"),
    0x0058: ("import_system_power_demand", "W"),
    0x005A: ("maximum_import_system_power_demand", "W"),
    0x005C: ("export_system_power_demand", "W"),
    0x005E: ("maximum_export_system_power_demand", "W"),
    0x0102: ("current_demand", "A"),
    0x0108: ("maximum_current_demand", "A"),
    0x0156: ("total_active_energy", "kWh"),
    0x0158: ("total_reactive_energy", "kvarh"),
}
# Holding registers (functions 03 / 16), float32: 40013 demand period (minutes: 0, 5, 8, 10, 15, 20, 30, 60),
# 40019 network parity/stop, 40021 meter id (Modbus address 1..247), 40029 baud rate code.
SDM120_HOLDING = {
    0x000C: ("demand_period", "min"),
    0x0012: ("network_parity_stop", "1"),
    0x0014: ("meter_id", "1"),
    0x001C: ("baud_rate", "1"),
}
SDM120_MAX_REGISTERS = 80  # Eastron meters answer at most 40 float parameters (80 registers) per request


def f32(value: float) -> list[int]:
    """float32 as two registers, high word first (the SDM120's order)."""
    raw = struct.pack(">f", value)
    return [int.from_bytes(raw[0:2], "big"), int.from_bytes(raw[2:4], "big")]


@dataclass
class Slave:
    """One simulated device: its unit id and its four tables (0-based address -> register word or bit).

    Addresses not in a table answer exception 02. ``max_registers`` limits one read request (exception 03 beyond).
    """

    unit: int
    coils: dict[int, bool] = field(default_factory=dict)
    discrete: dict[int, bool] = field(default_factory=dict)
    holding: dict[int, int] = field(default_factory=dict)
    input: dict[int, int] = field(default_factory=dict)
    max_registers: int = 125
    busy: int = 0  # answer the next N requests with exception 06
    writes: list[tuple[int, int, list[int] | list[bool]]] = field(default_factory=list)  # (function, address, values)

    def put(self, table: str, address: int, words: list[int]) -> None:
        """Set consecutive registers (thread-safe enough: the server reads them on its next request)."""
        target = self.holding if table == "holding" else self.input
        for i, word in enumerate(words):
            target[address + i] = word & 0xFFFF


def sdm120(unit: int = 1) -> Slave:
    """An Eastron SDM120-Modbus at ``unit`` (factory default 1) with the registers its protocol document lists; the
    addresses between them are not simulated (a read through them answers exception 02)."""
    slave = Slave(unit, max_registers=SDM120_MAX_REGISTERS)
    for address in SDM120_INPUT:
        slave.put("input", address, f32(0.0))
    slave.put("holding", 0x000C, f32(60.0))
    slave.put("holding", 0x0012, f32(0.0))
    slave.put("holding", 0x0014, f32(float(unit)))
    slave.put("holding", 0x001C, f32(0.0))  # 0 = 2400 bit/s, the factory setting
    return slave


def sdm120_update(slave: Slave, t: float, energy: dict[str, float]) -> None:
    """Plausible live values at time ``t`` (seconds): a 230 V supply and a load that changes slowly; energy
    integrates the power (``energy`` keeps the running totals in kWh)."""
    voltage = 230.0 + 2.5 * math.sin(t / 37.0)
    current = 4.0 + 3.0 * math.sin(t / 11.0) ** 2
    pf = 0.95
    power = voltage * current * pf
    apparent = voltage * current
    reactive = math.sqrt(max(0.0, apparent**2 - power**2))
    last = energy.get("t", t)
    energy["import"] = energy.get("import", 1234.5) + power * (t - last) / 3.6e6
    energy["reactive"] = energy.get("reactive", 210.25) + reactive * (t - last) / 3.6e6
    energy["t"] = t
    for address, value in (
        (0x0000, voltage),
        (0x0006, current),
        (0x000C, power),
        (0x0012, apparent),
        (0x0018, reactive),
        (0x001E, pf),
        (0x0024, math.degrees(math.acos(pf))),
        (0x0046, 50.0 + 0.02 * math.sin(t / 5.0)),
        (0x0048, energy["import"]),
        (0x004C, energy["reactive"]),
        (0x0156, energy["import"]),
        (0x0158, energy["reactive"]),
    ):
        slave.put("input", address, f32(value))


# -- the line ----------------------------------------------------------------------------------------------------


def frame_length(buf: bytes | bytearray, request: bool) -> int | None:
    """Length of the RTU frame at the start of ``buf`` (None: not enough bytes yet; 0: unknown function).

    Sizes from the Modbus Application Protocol V1.1b3: requests of functions 1-6 are 8 bytes (unit, function,
    4 bytes, CRC); 15/16 carry a byte count at offset 6. Responses of 1-4 carry a byte count at offset 2; 5, 6, 15
    and 16 echo 8 bytes; an exception response (function | 0x80) is 5.
    """
    if len(buf) < 2:
        return None
    fn = buf[1]
    if request:
        if 1 <= fn <= 6:
            return 8
        if fn in (15, 16):
            return None if len(buf) < 7 else 9 + buf[6]
        return 0
    if fn & 0x80:
        return 5
    if 1 <= fn <= 4:
        return None if len(buf) < 3 else 5 + buf[2]
    if fn in (5, 6, 15, 16):
        return 8
    return 0


@dataclass
class Frame:
    t: float  # time.monotonic() when the relay had the whole frame
    request: bool
    data: bytes
    dropped: bool = False  # a request nobody answers
    corrupted: bool = False  # a response sent on with a flipped bit


class _Pty:
    def __init__(self) -> None:
        self.master, self.slave, self.path = open_raw_pty()

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


class ModbusLine:
    """The simulated bus: pymodbus's server behind a relay, the bridge's end at :attr:`path` (or ``link``).

    Args:
        slaves: the devices on the bus.
        link: optional symlink kept pointing at the bridge's pty (like ``/dev/serial/by-id/...``).
        baudrate, parity: what the server's port is opened with. A pty carries bytes at any speed, but Linux
            refuses even parity on one (EINVAL), so simulated lines run without parity.
    """

    def __init__(
        self, slaves: list[Slave], link: str | os.PathLike[str] | None = None, baudrate: int = 19200, parity: str = "N"
    ) -> None:
        self.slaves = {s.unit: s for s in slaves}
        self.link = Path(link) if link is not None else None
        self.baudrate = baudrate
        self.parity = parity
        self.silent: set[int] = set()
        self.corrupt: Counter[int] = Counter()
        self.frames: list[Frame] = []
        self.lock = threading.Lock()
        self.path = ""
        self._bridge: _Pty | None = None
        self._server: _Pty | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server_stop: asyncio.Event | None = None

    # -- start, stop -------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Open both ptys, start the server and the relay; returns the bridge's path."""
        self._bridge, self._server = _Pty(), _Pty()
        self.path = self._bridge.path
        if self.link is not None:
            point_link(self.link, self.path)
        for target, name in ((self._serve, "modbus-server"), (self._relay, "modbus-relay")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if not self._ready.wait(10) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the simulated Modbus server did not start: {self._error}")
        return self.path

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._loop is not None and self._server_stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._server_stop.set)
        for thread in self._threads:
            thread.join(5)
        if self.link is not None:
            with contextlib.suppress(FileNotFoundError):
                self.link.unlink()
        for pty in (self._bridge, self._server):
            if pty is not None:
                pty.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> ModbusLine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the tests look at --------------------------------------------------------------------------------

    def requests(self, unit: int | None = None) -> list[Frame]:
        with self.lock:
            return [f for f in self.frames if f.request and (unit is None or f.data[0] == unit)]

    def responses(self, unit: int | None = None) -> list[Frame]:
        with self.lock:
            return [f for f in self.frames if not f.request and (unit is None or f.data[0] == unit)]

    # -- the server --------------------------------------------------------------------------------------------

    async def _action(
        self,
        slave: Slave,
        function_code: int,
        start_address: int,
        address: int,
        count: int,
        registers: list[int],
        set_values: list[int] | list[bool] | None,
    ) -> Any:
        from pymodbus.constants import ExcCodes

        if slave.busy > 0:
            slave.busy -= 1
            return ExcCodes.DEVICE_BUSY
        if function_code in (3, 4) and count > slave.max_registers:
            return ExcCodes.ILLEGAL_VALUE
        if set_values is not None:
            slave.writes.append((function_code, address, list(set_values)))
            if function_code in (6, 16):
                slave.put("holding", address, [int(v) for v in set_values])
            elif function_code in (5, 15):
                for i, v in enumerate(set_values):
                    slave.coils[address + i] = bool(v)
            return None
        if function_code in (3, 4):  # the tables may have changed since the last request: copy them in
            table = slave.holding if function_code == 3 else slave.input
            for i in range(count):
                if address + i in table:
                    registers[address + i - start_address] = table[address + i]
        return None

    def _device(self, slave: Slave) -> Any:
        from functools import partial

        from pymodbus.simulator import DataType, SimData, SimDevice

        def blocks(table: dict[int, Any], datatype: DataType) -> list[Any]:
            out: list[Any] = []
            run: list[Any] = []
            start = None
            for address in sorted(table):
                if start is not None and address == start + len(run):
                    run.append(table[address])
                    continue
                if run:
                    out.append(SimData(start, values=run, datatype=datatype))  # type: ignore[arg-type]
                start, run = address, [table[address]]
            if run:
                out.append(SimData(start, values=run, datatype=datatype))  # type: ignore[arg-type]
            if not out:  # pymodbus needs one block per table: a single unused entry far away
                out.append(SimData(65535, values=[False] if datatype == DataType.BITS else [0], datatype=datatype))
            return out

        return SimDevice(
            slave.unit,
            simdata=(
                blocks(slave.coils, DataType.BITS),
                blocks(slave.discrete, DataType.BITS),
                blocks(slave.holding, DataType.REGISTERS),
                blocks(slave.input, DataType.REGISTERS),
            ),
            action=partial(self._action, slave),
        )

    def _serve(self) -> None:
        from pymodbus.framer import FramerType
        from pymodbus.server import ModbusSerialServer

        logging.getLogger("pymodbus").setLevel(logging.CRITICAL)
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def main() -> None:
            assert self._server is not None
            self._server_stop = asyncio.Event()
            server = ModbusSerialServer(
                [self._device(s) for s in self.slaves.values()],
                framer=FramerType.RTU,
                port=self._server.path,
                baudrate=self.baudrate,
                parity=self.parity,
            )
            await server.serve_forever(background=True)
            self._ready.set()
            await self._server_stop.wait()
            await server.shutdown()

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    # -- the relay ---------------------------------------------------------------------------------------------

    def _relay(self) -> None:
        assert self._bridge is not None and self._server is not None
        bridge, server = self._bridge.master, self._server.master
        pending = {bridge: bytearray(), server: bytearray()}
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([bridge, server, self._wake_r], [], [], 0.5)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, 4096)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.EIO:  # the other side is not open right now
                        continue
                    return
                buf = pending[fd]
                buf += data
                request = fd == bridge
                while True:
                    size = frame_length(buf, request)
                    if size is None:
                        break
                    if size == 0 or size > 256:  # not a frame we know: pass the bytes on as they are
                        size = len(buf)
                    frame = bytes(buf[:size])
                    del buf[:size]
                    self._forward(frame, request, server if request else bridge)
                    if not buf:
                        break

    def _forward(self, frame: bytes, request: bool, to: int) -> None:
        unit = frame[0]
        record = Frame(time.monotonic(), request, frame)
        if request and (unit in self.silent or unit not in self.slaves):
            record.dropped = True  # nobody answers: the device is silent (or absent)
        elif not request and self.corrupt[unit] > 0:
            self.corrupt[unit] -= 1
            frame = frame[:-1] + bytes([frame[-1] ^ 0x01])  # one bit of the CRC flipped
            record.corrupted = True
        with self.lock:
            self.frames.append(record)
        if request and record.dropped:
            return
        with contextlib.suppress(OSError):
            os.write(to, frame)


def run_demo(link: str | None, unit: int, interval: float, stop: threading.Event) -> int:
    """``firmware-bridge simulate --modbus``: an SDM120 energy meter at ``unit``, its values updated every
    ``interval`` seconds, until ``stop``; prints the pty path."""
    slave = sdm120(unit)
    energy: dict[str, float] = {}
    sdm120_update(slave, time.monotonic(), energy)
    line = ModbusLine([slave], link=link, baudrate=2400, parity="N")
    path = line.start()
    print(f"{path}" + (f" (link {link})" if link else ""), flush=True)
    log.info("Eastron SDM120 (simulated values) at unit %d on %s (Modbus RTU)", unit, path)
    try:
        while not stop.wait(interval):
            sdm120_update(slave, time.monotonic(), energy)
    finally:
        line.stop()
    return 0
