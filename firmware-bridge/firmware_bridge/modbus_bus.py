"""A Modbus RTU bus (RS-485, half duplex): pymodbus's serial RTU client, one request at a time, polls on schedule.

:class:`ModbusBus` owns one ``protocol = "modbus-rtu"`` port. It opens it with pymodbus's
``AsyncModbusSerialClient`` (RTU framer, pyserial underneath), and one task does everything that touches the line,
so requests never overlap: it waits the silent interval (t3.5, Modbus over Serial Line V1.02 section 2.5.1.1) after
every response or timeout, sends the next request and waits for its answer. Queued writes go first; then the poll
group whose time has come first (earliest deadline first, so a slow device delays the others but cannot starve
them). A poll that starts after its next tick has also passed skips those ticks and counts them as ``missed``.

Faults are counted per device and reason (``timeout``: no byte came back; ``crc_error``: bytes came back but no valid
frame; ``bad_response``: a valid frame of the wrong size; an exception response by its name, such as
``illegal_data_address`` or ``server_device_busy``; ``non_finite``: a NaN or infinite float, left out of the
reading). Timeouts, CRC errors and busy devices are retried ``retries`` times within the poll; a poll that still
fails defers the device (communication faults) or the group (exception responses) with a backoff that doubles from
``backoff_min`` to ``backoff_max``. After ``offline_after`` failed polls in a row a device is reported offline; its
next good response brings it back. The other devices keep their schedule throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import serial
from pymodbus.client import AsyncModbusSerialClient
from pymodbus.exceptions import ConnectionException, ModbusException, ModbusIOException
from pymodbus.framer import FramerType

from firmware_bridge import modbus
from firmware_bridge.config import PortConfig
from firmware_bridge.serial_io import PortLink

log = logging.getLogger("firmware_bridge.modbus")
COMM_FAULTS = ("timeout", "crc_error", "bad_response")
RETRIED = (*COMM_FAULTS, "server_device_busy", "acknowledge")
LOG_EVERY = 10.0  # seconds between two events/log lines about the same device and fault reason


class PortLost(Exception):
    """The serial port went away (unplugged, I/O error)."""


class Fault(Exception):
    """A request that failed after its retries: ``reason`` as counted, ``detail`` for people."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class DeviceStats:
    """Counters and state of one device on the bus (published in ``bridge/<gw>/stats`` under ``modbus``)."""

    device: modbus.ModbusDevice
    polls: int = 0
    readings: int = 0
    requests: int = 0
    retries: int = 0
    missed: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    online: bool | None = None  # None until the first poll
    failed_polls: int = 0  # in a row
    backoff: float = 0.0  # seconds; 0 while healthy
    retry_at: float = 0.0  # monotonic: no communication before this
    last_event: dict[str, float] = field(default_factory=dict)
    suppressed: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        return {
            "unit": self.device.unit,
            "state": "unknown" if self.online is None else ("online" if self.online else "offline"),
            "polls": self.polls,
            "readings": self.readings,
            "requests": self.requests,
            "retries": self.retries,
            "missed": self.missed,
            "faults": dict(sorted(self.faults.items())),
            "writes": dict(sorted(self.writes.items())),
        }


@dataclass(slots=True)
class Job:
    """One poll group of one device and when it is due (monotonic seconds)."""

    stats: DeviceStats
    group: modbus.Group
    due: float
    backoff: float = 0.0  # seconds, after exception responses


@dataclass(slots=True)
class Write:
    """A write command waiting for the bus: the registers (or coil state) to write to ``register``."""

    device: modbus.ModbusDevice
    register: modbus.Register
    raw: list[int] | bool
    done: Callable[[dict[str, Any]], None]  # called once with the reply body


class ModbusBus(PortLink):
    """One RS-485 bus: reopened forever until :meth:`close`, polled by one task.

    Args:
        cfg: the port (``cfg.modbus`` holds the devices).
        on_reading: ``(bus, device, values, text)`` after every successful poll; ``values`` maps names to
            ``(number, unit)``, ``text`` string registers to their text.
        on_event: ``(kind, device, fields)`` for ``modbus_fault``, ``device_offline`` and ``device_online``.
        on_state: ``(bus, "open" | "closed", detail)`` like :class:`firmware_bridge.serial_io.SerialLink`.
    """

    def __init__(
        self,
        cfg: PortConfig,
        on_reading: Callable[[ModbusBus, str, dict[str, tuple[float | int, str]], dict[str, str]], None],
        on_event: Callable[[str, str, dict[str, Any]], None],
        on_state: Callable[[ModbusBus, str, str], None] | None = None,
    ) -> None:
        assert cfg.modbus is not None
        self.cfg = cfg
        self.settings: modbus.ModbusSettings = cfg.modbus
        self.on_reading = on_reading
        self.on_event = on_event
        self.on_state = on_state
        self.devices = {d.name: DeviceStats(d) for d in self.settings.devices}
        self.silence = (
            self.settings.interframe if self.settings.interframe is not None else modbus.silent_interval(cfg.baudrate)
        )
        self.state = "closed"
        self.opens = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.requests = 0
        self.responses = 0
        self.writes: deque[Write] = deque()
        self._client: AsyncModbusSerialClient | None = None
        self._rx = bytearray()  # what came back since the last request was sent
        self._seen = b""  # pymodbus's receive buffer as last traced
        self._quiet_since = 0.0  # monotonic time of the end of the last frame on the line
        self._closing = False
        self._wake = asyncio.Event()

    # -- the outside -----------------------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._client is not None and self._client.connected

    def submit(self, write: Write) -> None:
        """Queue a write; it runs before the next poll. Replies ``device_offline`` at once when the port is closed."""
        if not self.is_open:
            write.done({"ok": False, "error": "device_offline", "detail": "the port is not open"})
            return
        self.writes.append(write)
        self._wake.set()

    def close(self) -> None:
        """Stop polling and close the port."""
        self._closing = True
        self._wake.set()

    def device_stats(self) -> dict[str, dict[str, Any]]:
        return {name: st.snapshot() for name, st in self.devices.items()}

    # -- open, reopen ------------------------------------------------------------------------------------------------

    def _trace_packet(self, sending: bool, data: bytes) -> bytes:
        """pymodbus's hook on every frame sent and every receive buffer: byte counts, and what came back for the
        timeout / CRC error distinction."""
        if sending:
            self.bytes_out += len(data)
            self._rx.clear()
            self._seen = b""
        else:  # pymodbus passes its whole receive buffer: the part not seen before is new
            new = data[len(self._seen) :] if data.startswith(self._seen) else data
            self._seen = data
            self.bytes_in += len(new)
            self._rx += new
        return data

    def _trace_connect(self, connected: bool) -> None:
        if not connected:
            self._wake.set()

    def _new_client(self) -> AsyncModbusSerialClient:
        return AsyncModbusSerialClient(
            self.cfg.path,
            framer=FramerType.RTU,
            baudrate=self.cfg.baudrate,
            bytesize=self.cfg.bytesize,
            parity=self.cfg.parity,
            stopbits=self.cfg.stopbits,  # type: ignore[arg-type]  # pyserial takes 1.5 too
            timeout=self.settings.timeout,
            retries=0,  # retries are ours: every attempt is counted by reason
            reconnect_delay=0,  # reopening is ours too (backoff up to reopen_max, like the other ports)
            name=self.cfg.path,
            trace_packet=self._trace_packet,
            trace_connect=self._trace_connect,
        )

    async def run(self) -> None:
        """Open, poll until the port is lost, back off, reopen; returns after :meth:`close`."""
        delay = 0.05
        failing = False
        while not self._closing:
            client = self._new_client()
            self._client = client
            opened = False
            with contextlib.suppress(OSError, serial.SerialException, ValueError):
                opened = await client.connect()
            if not opened or not client.connected:
                client.close()
                self._client = None
                if not failing:
                    self.errors += 1
                    log.warning("port %s unavailable; retrying (backoff up to %gs)", self.cfg.path, self.cfg.reopen_max)
                    failing = True
                await self._sleep(delay)
                delay = min(self.cfg.reopen_max, delay * 2) * random.uniform(0.8, 1.0)
                continue
            self.opens += 1
            failing, delay = False, 0.05
            log.info(
                "port %s open (modbus-rtu, %d baud, %d%s%g, t3.5 %.2f ms, %d device(s))",
                self.cfg.path,
                self.cfg.baudrate,
                self.cfg.bytesize,
                self.cfg.parity,
                self.cfg.stopbits,
                self.silence * 1000,
                len(self.devices),
            )
            self._set_state("open", "")
            reason = "stopped"
            try:
                await self._serve(client)
            except PortLost as exc:
                reason = str(exc) or "lost"
                self.errors += 1
                log.warning("port %s lost: %s; reopening", self.cfg.path, reason)
            finally:
                client.close()
                self._client = None
                while self.writes:
                    self.writes.popleft().done(
                        {"ok": False, "error": "device_offline", "detail": "the port closed before the write"}
                    )
            self._set_state("closed", reason)
            if not self._closing:
                await self._sleep(delay)
        if self.state != "closed":
            self._set_state("closed", "stopped")

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        if self._closing:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    # -- the schedule ------------------------------------------------------------------------------------------------

    async def _serve(self, client: AsyncModbusSerialClient) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        jobs = []
        for i, st in enumerate(self.devices.values()):
            for group in st.device.groups:
                jobs.append(Job(st, group, now + 0.01 * i))  # a little apart, so the first polls do not all queue up
        self._quiet_since = time.monotonic()
        while not self._closing:
            if not client.connected:
                raise PortLost("closed")
            if self.writes:
                await self._write(client, self.writes.popleft())
                continue
            job = min(jobs, key=lambda j: j.due)
            now = loop.time()
            if job.due > now:
                await self._sleep(job.due - now)
                continue
            interval = job.group.interval
            ticks = math.floor((now - job.due) / interval)  # ticks that passed while this poll waited for the bus
            if ticks:
                job.stats.missed += ticks
                self._event_limited(
                    job.stats, "missed", "missed_polls", {"missed": ticks, "interval_s": interval}, warn=True
                )
            tick = job.due + ticks * interval
            await self._poll(client, job)
            job.due = tick + interval
            after = loop.time()
            if job.stats.retry_at > after:  # the device is backing off: no ticks counted as missed meanwhile
                job.due = max(job.due, job.stats.retry_at)
            elif job.backoff and job.due < after + job.backoff:
                job.due = after + job.backoff

    async def _quiet(self) -> None:
        """Wait until the line has been silent for t3.5 since the end of the last frame."""
        wait = self._quiet_since + self.silence - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _request(
        self, client: AsyncModbusSerialClient, st: DeviceStats, what: str, call: Callable[[], Awaitable[Any]]
    ) -> Any:
        """One request with its retries; returns the response PDU or raises :class:`Fault` / :class:`PortLost`."""
        attempts = self.settings.retries + 1
        fault: Fault | None = None
        for attempt in range(attempts):
            if attempt:
                st.retries += 1
                if fault is not None and fault.reason in ("server_device_busy", "acknowledge"):
                    await asyncio.sleep(min(1.0, self.settings.timeout * attempt))
            await self._quiet()
            if not client.connected:
                raise PortLost("closed")
            self._rx.clear()
            self._seen = b""
            self.requests += 1
            st.requests += 1
            try:
                response = await call()
            except ConnectionException as exc:
                raise PortLost(str(exc).splitlines()[0][:200]) from None
            except ModbusIOException:
                if self._rx:
                    fault = Fault("crc_error", f"{what}: {len(self._rx)} byte(s) came back, no valid frame")
                else:
                    fault = Fault("timeout", f"{what}: no response within {self.settings.timeout:g}s")
            except (ModbusException, OSError, serial.SerialException) as exc:
                if not client.connected:
                    raise PortLost(str(exc)[:200]) from None
                fault = Fault("bad_response", f"{what}: {exc}")
            else:
                if response.isError():
                    code = getattr(response, "exception_code", 0)
                    fault = Fault(modbus.exception_reason(code), f"{what}: exception response {code}")
                else:
                    self.responses += 1
                    self._quiet_since = time.monotonic()
                    return response
            finally:
                self._quiet_since = time.monotonic()
            self._fault(st, fault)
            if fault.reason not in RETRIED:
                break
        assert fault is not None
        raise fault

    def _fault(self, st: DeviceStats, fault: Fault) -> None:
        st.faults[fault.reason] += 1
        self._event_limited(
            st, fault.reason, "modbus_fault", {"reason": fault.reason, "detail": fault.detail, "total": 0}
        )

    def _event_limited(self, st: DeviceStats, key: str, kind: str, fields: dict[str, Any], warn: bool = True) -> None:
        """An event and a log line, at most one per device and ``key`` every LOG_EVERY seconds (the rest counted)."""
        now = time.monotonic()
        if now - st.last_event.get(key, -LOG_EVERY) < LOG_EVERY:
            st.suppressed[key] += 1
            return
        st.last_event[key] = now
        more = st.suppressed.pop(key, 0)
        if "total" in fields:
            fields["total"] = st.faults[key]
        body = {"unit": st.device.unit, "port": self.cfg.path, **fields}
        if more:
            body["suppressed"] = more
        if warn:
            log.warning(
                "modbus %s (unit %d): %s %s%s",
                st.device.name,
                st.device.unit,
                kind,
                fields.get("detail", fields),
                f" [+{more} more since the last report]" if more else "",
            )
        self.on_event(kind, st.device.name, body)

    async def _read(self, client: AsyncModbusSerialClient, st: DeviceStats, req: modbus.Request) -> list[Any]:
        unit = st.device.unit
        what = f"read {req.function} {req.address}+{req.count}"
        calls = {
            "coil": client.read_coils,
            "discrete_input": client.read_discrete_inputs,
            "holding": client.read_holding_registers,
            "input": client.read_input_registers,
        }
        fn = calls[req.function]
        response = await self._request(client, st, what, lambda: fn(req.address, count=req.count, device_id=unit))
        data = response.bits if req.function in modbus.BIT_FUNCTIONS else response.registers
        if len(data) < req.count:
            fault = Fault("bad_response", f"{what}: {len(data)} value(s) came back")
            self._fault(st, fault)
            raise fault
        return list(data[: req.count])

    async def _poll(self, client: AsyncModbusSerialClient, job: Job) -> None:
        st = job.stats
        st.polls += 1
        values: dict[str, tuple[float | int, str]] = {}
        text: dict[str, str] = {}
        try:
            for req in job.group.requests:
                data = await self._read(client, st, req)
                for reg in req.registers:
                    value = modbus.decode(reg, data[reg.address - req.address : reg.end - req.address])
                    if isinstance(value, str):
                        text[reg.name] = value
                    elif isinstance(value, float) and not math.isfinite(value):
                        self._fault(st, Fault("non_finite", f"{reg.name} read {value}"))
                    else:
                        values[reg.name] = (value, reg.unit)
        except Fault as fault:
            self._poll_failed(st, job, fault)
            return
        self._poll_ok(st, job)
        st.readings += 1
        self.on_reading(self, st.device.name, values, text)

    def _poll_ok(self, st: DeviceStats, job: Job) -> None:
        job.backoff = 0.0
        st.failed_polls, st.backoff, st.retry_at = 0, 0.0, 0.0
        if st.online is not True:
            if st.online is False:
                log.info("modbus %s (unit %d) answers again", st.device.name, st.device.unit)
                self.on_event("device_online", st.device.name, {"unit": st.device.unit, "port": self.cfg.path})
            st.online = True

    def _poll_failed(self, st: DeviceStats, job: Job, fault: Fault) -> None:
        s = self.settings
        st.failed_polls += 1
        if fault.reason in COMM_FAULTS:
            st.backoff = min(s.backoff_max, st.backoff * 2 if st.backoff else s.backoff_min)
            st.retry_at = asyncio.get_running_loop().time() + st.backoff * random.uniform(0.9, 1.0)
        else:
            job.backoff = min(s.backoff_max, job.backoff * 2 if job.backoff else s.backoff_min)
        if st.failed_polls >= s.offline_after and st.online is not False:
            st.online = False
            log.warning(
                "modbus %s (unit %d) offline after %d failed polls (%s)",
                st.device.name,
                st.device.unit,
                st.failed_polls,
                fault.reason,
            )
            self.on_event(
                "device_offline",
                st.device.name,
                {
                    "unit": st.device.unit,
                    "port": self.cfg.path,
                    "reason": fault.reason,
                    "failed_polls": st.failed_polls,
                },
            )

    # -- writes ------------------------------------------------------------------------------------------------------

    async def _write(self, client: AsyncModbusSerialClient, w: Write) -> None:
        """Write, read back, compare; exactly one ``w.done`` call."""
        st = self.devices[w.device.name]
        reg, unit = w.register, w.device.unit
        try:
            if reg.function == "coil":
                state = bool(w.raw)
                await self._request(
                    client,
                    st,
                    f"write coil {reg.address}",
                    lambda: client.write_coil(reg.address, state, device_id=unit),
                )
                back = await self._read(client, st, modbus.Request("coil", reg.address, 1, (reg,)))
                ok = bool(back[0]) == state
            else:
                words = list(w.raw) if isinstance(w.raw, list) else [int(w.raw)]
                if len(words) == 1:
                    call = lambda: client.write_register(reg.address, words[0], device_id=unit)  # noqa: E731
                else:
                    call = lambda: client.write_registers(reg.address, words, device_id=unit)  # noqa: E731
                await self._request(client, st, f"write holding {reg.address}+{len(words)}", call)
                back = await self._read(client, st, modbus.Request("holding", reg.address, reg.count, (reg,)))
                ok = [int(v) for v in back] == words
        except PortLost:
            st.writes["device_offline"] += 1
            w.done({"ok": False, "error": "device_offline", "detail": "the port closed during the write"})
            raise
        except Fault as fault:
            st.writes[fault.reason] += 1
            w.done({"ok": False, "error": fault.reason, "detail": fault.detail})
            return
        value = modbus.decode(reg, back)
        raw = [1 if b else 0 for b in back] if reg.is_bit else [int(v) for v in back]
        data = {"name": reg.name, "value": value, "unit": reg.unit, "raw": raw}
        if ok:
            st.writes["ok"] += 1
            log.info("modbus %s (unit %d): wrote %s = %r", w.device.name, unit, reg.name, value)
            w.done({"ok": True, "data": data})
        else:
            st.writes["readback_mismatch"] += 1
            w.done(
                {
                    "ok": False,
                    "error": "readback_mismatch",
                    "detail": "the device reads back another value",
                    "data": data,
                }
            )
