"""The service: serial ports in, MQTT out, commands back (docs/message-format.md, PROTOCOL.md).

Topics (``<gw>`` is ``bridge.gateway_id``):

* ``sensors/<gw>/<device>``: one reading envelope per frame (QoS of the port, default 1).
* ``cmd/<gw>/<device>/<command>``: commands in (subscribed QoS 1, No Local); replies go to the MQTT 5 Response
  Topic of the command when it has one, else to ``cmd/<gw>/<device>/reply``, with its Correlation Data.
* ``bridge/<gw>/events``: ``reboot``, ``gap``, ``seq_regression``, ``port_up``, ``port_down``; Modbus ports:
  ``modbus_fault``, ``missed_polls``, ``device_offline``, ``device_online`` (QoS 1).
* ``bridge/<gw>/stats``: counters (retained, every ``stats_interval`` while they change).
* ``bridge/<gw>/status``: ``online`` / ``offline`` (retained; ``offline`` is also the Will).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import aiomqtt
import sdnotify

from firmware_bridge import modbus
from firmware_bridge.config import BridgeConfig, PortConfig
from firmware_bridge.frames import (
    COMMAND_RE,
    Command,
    Event,
    Fix,
    Ignored,
    Reading,
    Rejected,
    Reply,
    command_frame,
    format_time,
)
from firmware_bridge.modbus_bus import ModbusBus, Write
from firmware_bridge.publisher import Outgoing, Publisher
from firmware_bridge.serial_io import SerialLink

if TYPE_CHECKING:
    from firmware_bridge.sparkplug_link import SparkplugLink

log = logging.getLogger("firmware_bridge")
ENVELOPE_VERSION = 1
MAX_ARGS_BYTES = 256
LOG_EVERY = 10.0  # seconds between two log lines about the same port and rejection reason


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(slots=True)
class DeviceState:
    port: str
    boot: int | None = None
    seq: int | None = None
    readings: int = 0
    gaps: int = 0
    lost: int = 0
    reboots: int = 0
    duplicates: int = 0
    regressions: int = 0
    last_at: float | None = None  # monotonic seconds of the last reading (the metrics' last reading age)


@dataclass(slots=True)
class PortStats:
    frames: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    ignored: Counter[str] = field(default_factory=Counter)
    last_log: dict[str, float] = field(default_factory=dict)
    suppressed: Counter[str] = field(default_factory=Counter)


Answer = Callable[[int | None, dict[str, Any]], None]  # (the command's id on the line or None, the reply body)


@dataclass(slots=True)
class PendingCommand:
    device: str
    command: str
    reply_topic: str
    correlation: bytes | None
    answer: Answer | None = None
    timer: asyncio.TimerHandle | None = None


class Bridge:
    """One firmware-bridge: its serial links, its MQTT publisher and the state between them."""

    def __init__(self, cfg: BridgeConfig) -> None:
        self.cfg = cfg
        self.gw = cfg.gateway_id
        self.started = time.time()
        self.nmea_boot = int(self.started)  # NMEA sources have no boot counter: the bridge's start time stands in
        self.publisher = Publisher(
            cfg.mqtt, status_topic=self.topic_status, on_connect=self._on_connect, on_message=self._on_message
        )
        self.modbus_boot = int(self.started)  # Modbus devices have no boot counter either
        self.links: list[SerialLink | ModbusBus] = [
            ModbusBus(p, self._on_modbus_reading, self._on_modbus_event, self._on_port_state)
            if p.protocol == "modbus-rtu"
            else SerialLink(p, self._on_event, self._on_port_state)
            for p in cfg.ports
        ]
        self.port_stats = {p.path: PortStats() for p in cfg.ports}
        self.devices: dict[str, DeviceState] = {}
        self.device_link: dict[str, SerialLink | ModbusBus] = {}
        for link in self.links:
            if isinstance(link, ModbusBus):
                for name in link.devices:
                    self.device_link[name] = link
            elif link.cfg.device is not None:
                self.device_link[link.cfg.device] = link
        self.pending: dict[tuple[str, int], PendingCommand] = {}
        self.commands = Counter[str]()
        self._cmd_ids = itertools.count(1)
        self._stats_dirty = True
        self.sparkplug: SparkplugLink | None = None
        if cfg.sparkplug is not None:
            from firmware_bridge.sparkplug_link import SparkplugLink

            self.sparkplug = SparkplugLink(cfg, self.run_command)
        self._notifier = sdnotify.SystemdNotifier()
        self._ready = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- topics --------------------------------------------------------------------------------------------------

    @property
    def topic_status(self) -> str:
        return f"bridge/{self.gw}/status"

    @property
    def topic_events(self) -> str:
        return f"bridge/{self.gw}/events"

    @property
    def topic_stats(self) -> str:
        return f"bridge/{self.gw}/stats"

    def topic_reading(self, device: str) -> str:
        return f"sensors/{self.gw}/{device}"

    def topic_cmd_filter(self, device: str) -> str:
        return f"cmd/{self.gw}/{device}/#"

    # -- run -----------------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set: read the ports, publish, relay commands. Then drain briefly and disconnect."""
        for device in self.device_link:
            await self.publisher.subscribe(self.topic_cmd_filter(device))
        pub_task = asyncio.ensure_future(self.publisher.run())
        spb_task = asyncio.ensure_future(self.sparkplug.publisher.run()) if self.sparkplug is not None else None
        link_tasks = [asyncio.ensure_future(link.run()) for link in self.links]
        stats_task = asyncio.ensure_future(self._stats_loop())
        watchdog_task = asyncio.ensure_future(self._watchdog_loop())
        self._notifier.notify(f"STATUS=connecting to {self.cfg.mqtt.broker}; {len(self.links)} port(s)")
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopper, pub_task}, return_when=asyncio.FIRST_COMPLETED)
        log.info("stopping")
        self._notifier.notify("STOPPING=1")
        for link in self.links:
            link.close()
        await asyncio.gather(*link_tasks, return_exceptions=True)
        for pending in self.pending.values():
            if pending.timer is not None:
                pending.timer.cancel()
        stats_task.cancel()
        watchdog_task.cancel()
        await asyncio.gather(stats_task, watchdog_task, return_exceptions=True)
        self._write_stats_file()
        self.publisher.stop(drain=2.0)
        if self.sparkplug is not None and spb_task is not None:
            self.sparkplug.stop()
            await asyncio.gather(spb_task, return_exceptions=True)
        await asyncio.gather(pub_task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = len(self.publisher.buffer)
        if left:
            log.warning("%d buffered message(s) not published before exit", left)
        stopper.cancel()
        log.info("stopped: %d published", self.publisher.published)

    async def _watchdog_loop(self) -> None:
        """WATCHDOG=1 every half ``WATCHDOG_USEC`` while the event loop turns (systemd ``WatchdogSec=``): a hung
        loop stops the pings and systemd restarts the service. Nothing when not under a watchdog."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
            return
        interval = int(usec) / 2e6
        while True:
            self._notifier.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_connect(self) -> None:
        if not self._ready:
            self._ready = True
            self._notifier.notify("READY=1")
            log.info("firmware-bridge ready: gateway %s, %d port(s)", self.gw, len(self.links))
        self._notifier.notify(f"STATUS=connected to {self.cfg.mqtt.broker}; {len(self.links)} port(s)")
        self._stats_dirty = True

    # -- serial side ---------------------------------------------------------------------------------------------

    def _on_port_state(self, link: SerialLink | ModbusBus, state: str, detail: str) -> None:
        event = "port_up" if state == "open" else "port_down"
        payload: dict[str, Any] = {"v": ENVELOPE_VERSION, "gateway_id": self.gw, "event": event, "port": link.cfg.path}
        if detail:
            payload["reason"] = detail
        payload["gateway_time"] = self._now()
        self.publisher.enqueue(Outgoing(self.topic_events, _json(payload), qos=1))
        self._stats_dirty = True
        if state != "open" and self.sparkplug is not None:
            self.sparkplug.port_closed(link.cfg.path)

    def _on_event(self, link: SerialLink, event: Event) -> None:
        stats = self.port_stats[link.cfg.path]
        self._stats_dirty = True
        if isinstance(event, Reading):
            stats.frames += 1
            self._on_reading(link, event)
        elif isinstance(event, Fix):
            stats.frames += 1
            self._on_fix(link, event)
        elif isinstance(event, Reply):
            stats.frames += 1
            self._on_reply(link, event)
        elif isinstance(event, Ignored):
            stats.ignored[event.sentence] += 1
        elif isinstance(event, Command):
            self._reject(link, Rejected("bad_field", "a board sent a command frame", b""))
        elif isinstance(event, Rejected):
            self._reject(link, event)

    def _reject(self, link: SerialLink, event: Rejected) -> None:
        stats = self.port_stats[link.cfg.path]
        stats.rejected[event.reason] += 1
        now = time.monotonic()
        if now - stats.last_log.get(event.reason, -LOG_EVERY) >= LOG_EVERY:
            more = stats.suppressed.pop(event.reason, 0)
            log.warning(
                "port %s: %s (%s)%s; sample %r",
                link.cfg.path,
                event.reason,
                event.detail,
                f" [+{more} more since the last report]" if more else "",
                event.sample,
            )
            stats.last_log[event.reason] = now
        else:
            stats.suppressed[event.reason] += 1

    def _now(self) -> str:
        return format_time(datetime.now(UTC))

    def _envelope(
        self,
        device: str,
        boot: int,
        seq: int,
        sensor_time: str | None,
        values: dict[str, tuple[float | int, str]],
        text: dict[str, str] | None = None,
    ) -> bytes:
        envelope: dict[str, Any] = {
            "v": ENVELOPE_VERSION,
            "gateway_id": self.gw,
            "device": device,
            "boot": boot,
            "seq": seq,
            "sensor_time": sensor_time,
            "gateway_time": self._now(),
            "values": {name: {"value": value, "unit": unit} for name, (value, unit) in values.items()},
        }
        if text:
            envelope["text"] = text  # string registers (Modbus); values stay numbers only
        return _json(envelope)

    def _event(self, kind: str, device: str, **fields: Any) -> None:
        payload = {
            "v": ENVELOPE_VERSION,
            "gateway_id": self.gw,
            "event": kind,
            "device": device,
            **fields,
            "gateway_time": self._now(),
        }
        self.publisher.enqueue(Outgoing(self.topic_events, _json(payload), qos=1))

    def _device(self, device: str, link: SerialLink | ModbusBus) -> DeviceState:
        state = self.devices.get(device)
        if state is None:
            state = self.devices[device] = DeviceState(port=link.cfg.path)
            log.info("device %s seen on %s", device, link.cfg.path)
        state.port = link.cfg.path
        if self.device_link.get(device) is not link:
            self.device_link[device] = link
            self._spawn(self.publisher.subscribe(self.topic_cmd_filter(device)))
        return state

    def _on_reading(self, link: SerialLink, r: Reading) -> None:
        if link.cfg.device is not None and r.device != link.cfg.device:
            self._reject(
                link,
                Rejected(
                    "wrong_device", f"frame from {r.device!r}, port expects {link.cfg.device!r}", r.device.encode()
                ),
            )
            return
        st = self._device(r.device, link)
        if st.boot is not None and st.seq is not None:
            if r.boot != st.boot:
                st.reboots += 1
                log.info(
                    "device %s rebooted: boot %d -> %d (last seq %d, now seq %d)",
                    r.device,
                    st.boot,
                    r.boot,
                    st.seq,
                    r.seq,
                )
                self._event("reboot", r.device, from_boot=st.boot, to_boot=r.boot, last_seq=st.seq, seq=r.seq)
            elif r.seq == st.seq:
                st.duplicates += 1
                return
            elif r.seq < st.seq:
                st.regressions += 1
                log.warning(
                    "device %s: seq went back from %d to %d within boot %d without a new boot; dropped "
                    "(firmware must increment boot on every start)",
                    r.device,
                    st.seq,
                    r.seq,
                    r.boot,
                )
                self._event("seq_regression", r.device, boot=r.boot, last_seq=st.seq, seq=r.seq)
                return
            elif r.seq > st.seq + 1:
                missing = r.seq - st.seq - 1
                st.gaps += 1
                st.lost += missing
                log.warning(
                    "device %s: %d reading(s) lost in boot %d (seq %d..%d)",
                    r.device,
                    missing,
                    r.boot,
                    st.seq + 1,
                    r.seq - 1,
                )
                self._event("gap", r.device, boot=r.boot, from_seq=st.seq + 1, to_seq=r.seq - 1, missing=missing)
        st.boot, st.seq = r.boot, r.seq
        st.readings += 1
        st.last_at = time.monotonic()
        self._publish_reading(link.cfg, r.device, r.boot, r.seq, r.sensor_time, r.values)

    def _on_fix(self, link: SerialLink, fix: Fix) -> None:
        device = link.cfg.device or "gps"
        st = self._device(device, link)
        seq = 0 if st.seq is None else st.seq + 1
        st.boot, st.seq = self.nmea_boot, seq
        st.readings += 1
        st.last_at = time.monotonic()
        self._publish_reading(link.cfg, device, self.nmea_boot, seq, fix.sensor_time, fix.values)

    def _on_modbus_reading(
        self, bus: ModbusBus, device: str, values: dict[str, tuple[float | int, str]], text: dict[str, str]
    ) -> None:
        """One successful poll of a Modbus group: one reading, ``boot`` the bridge's start, ``seq`` counted here."""
        self.port_stats[bus.cfg.path].frames += 1
        self._stats_dirty = True
        st = self._device(device, bus)
        seq = 0 if st.seq is None else st.seq + 1
        st.boot, st.seq = self.modbus_boot, seq
        st.readings += 1
        st.last_at = time.monotonic()
        self._publish_reading(bus.cfg, device, self.modbus_boot, seq, None, values, text)

    def _on_modbus_event(self, kind: str, device: str, fields: dict[str, Any]) -> None:
        self._stats_dirty = True
        self._event(kind, device, **fields)
        if kind == "device_offline" and self.sparkplug is not None:
            self.sparkplug.device_offline(device)

    def _publish_reading(
        self,
        port: PortConfig,
        device: str,
        boot: int,
        seq: int,
        sensor_time: str | None,
        values: dict[str, tuple[float | int, str]],
        text: dict[str, str] | None = None,
    ) -> None:
        dropped = self.publisher.enqueue(
            Outgoing(self.topic_reading(device), self._envelope(device, boot, seq, sensor_time, values, text), port.qos)
        )
        if self.sparkplug is not None:
            self.sparkplug.reading(device, port.path, values, text)
        if dropped is not None:
            total = sum(self.publisher.buffer.dropped.values())
            if total == 1 or total % 100 == 0:
                log.warning(
                    "buffer full (%d): dropped a QoS %d message on %s (%d dropped so far)",
                    self.publisher.buffer.capacity,
                    dropped.qos,
                    dropped.topic,
                    total,
                )

    # -- commands ------------------------------------------------------------------------------------------------

    async def _on_message(self, message: aiomqtt.Message) -> None:
        parts = str(message.topic).split("/")
        if len(parts) != 4 or parts[0] != "cmd" or parts[1] != self.gw or parts[3] == "reply":
            return
        device, name = parts[2], parts[3]
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None)
        if not response_topic or "+" in response_topic or "#" in response_topic or "\0" in response_topic:
            response_topic = f"cmd/{self.gw}/{device}/reply"
        pending = PendingCommand(device, name, response_topic, getattr(props, "CorrelationData", None))

        def answer(cmd_id: int | None, body: dict[str, Any]) -> None:
            self._reply(pending, cmd_id, body)

        self.commands["received"] += 1
        self._stats_dirty = True
        if not COMMAND_RE.match(name):
            self._refuse_command(device, name, answer, "bad_request", f"command names match {COMMAND_RE.pattern}")
            return
        raw = message.payload
        if isinstance(raw, str):
            raw = raw.encode()
        args: Any = {}
        if raw:
            try:
                args = json.loads(raw) if isinstance(raw, bytes | bytearray) else None
            except ValueError:
                args = None
            if not isinstance(args, dict) or len(_json(args)) > MAX_ARGS_BYTES:
                self._refuse_command(
                    device,
                    name,
                    answer,
                    "bad_request",
                    f"the payload must be empty or a JSON object of at most {MAX_ARGS_BYTES} bytes",
                )
                return
        self.run_command(device, name, args, answer)

    def run_command(self, device: str, name: str, args: dict[str, Any], answer: Answer) -> None:
        """Carry out command ``name`` with ``args`` on ``device``: a line to its board (the reply or a timeout
        answers), or a Modbus ``write``. ``answer(cmd_id, body)`` is called exactly once, ``body`` as in the reply
        envelope (``ok``, ``data``, ``error``, ``detail``). Both MQTT commands and Sparkplug DCMDs come here."""
        link = self.device_link.get(device)
        if isinstance(link, ModbusBus):
            self._modbus_command(link, device, name, args, answer)
            return
        if link is None or not link.is_open:
            self._refuse_command(device, name, answer, "device_offline", "no open port for this device")
            return
        cmd_id = next(self._cmd_ids)
        line = command_frame(device, name, cmd_id, args)
        if len(line) - 1 > link.cfg.max_line:
            self._refuse_command(
                device, name, answer, "bad_request", "the command line would be longer than the port's max_line", cmd_id
            )
            return
        if not link.write(line):
            self._refuse_command(device, name, answer, "device_offline", "the port closed", cmd_id)
            return
        self.commands["sent"] += 1
        pending = PendingCommand(device, name, "", None, answer)
        pending.timer = asyncio.get_running_loop().call_later(
            self.cfg.command_timeout, self._command_timeout, device, cmd_id
        )
        self.pending[(device, cmd_id)] = pending
        log.info("command %s #%d -> %s (%s)", name, cmd_id, device, link.cfg.path)

    def _modbus_command(self, bus: ModbusBus, device: str, name: str, args: dict[str, Any], answer: Answer) -> None:
        """``write`` to a Modbus device: ``{"name": ..., "value": ...}`` or ``{"function": ..., "address": ...,
        "value": ...}`` (raw: a coil state or the register words); only ``writable = true`` registers."""

        def refuse(error: str, detail: str) -> None:
            self._refuse_command(device, name, answer, error, detail)

        if name != "write":
            refuse("unknown_command", "Modbus devices take the command 'write' only")
            return
        dev = bus.devices[device].device
        raw_form = "name" not in args
        reg: modbus.Register | None
        if not raw_form:
            reg = dev.register(args["name"]) if isinstance(args["name"], str) else None
            where = f"register {args['name']!r}"
        else:
            if "address" not in args:
                refuse("bad_request", 'give "name" and "value", or "function", "address" and "value"')
                return
            try:
                function = args.get("function")
                if function is not None and function not in modbus.FUNCTIONS:
                    raise ValueError(f"function must be one of {', '.join(modbus.FUNCTIONS)}")
                function, address = modbus.parse_address(args["address"], function)
            except ValueError as exc:
                refuse("bad_request", f"address {args['address']!r}: {exc}")
                return
            reg = dev.register_at(function, address)
            where = f"{function} {address}"
        if reg is None:
            refuse("unknown_register", f"{where} is not in this device's configuration")
            return
        if not reg.writable:
            refuse("not_writable", f"{where} ({reg.name}) is not writable = true in the configuration")
            return
        if "value" not in args:
            refuse("bad_request", '"value" is missing')
            return
        value = args["value"]
        try:
            if raw_form and not reg.is_bit:
                words = value if isinstance(value, list) else [value]
                if len(words) != reg.count or not all(
                    isinstance(w, int) and not isinstance(w, bool) and 0 <= w <= 0xFFFF for w in words
                ):
                    raise ValueError(f"raw: {reg.count} register value(s) 0..65535")
                raw: list[int] | bool = list(words)
            else:
                raw = modbus.encode(reg, value)
        except ValueError as exc:
            refuse("bad_value", f"{reg.name} ({reg.type}): {exc}")
            return
        cmd_id = next(self._cmd_ids)
        self.commands["sent"] += 1

        def done(body: dict[str, Any]) -> None:
            self.commands["replied" if body.get("ok") else str(body.get("error"))] += 1
            self._stats_dirty = True
            answer(cmd_id, body)

        log.info("command write #%d -> %s: %s = %r", cmd_id, device, reg.name, value)
        bus.submit(Write(dev, reg, raw, done))

    def _reply(self, pending: PendingCommand, cmd_id: int | None, body: dict[str, Any]) -> None:
        payload = {
            "v": ENVELOPE_VERSION,
            "gateway_id": self.gw,
            "device": pending.device,
            "id": cmd_id,
            "command": pending.command,
            **body,
            "gateway_time": self._now(),
        }
        self.publisher.enqueue(Outgoing(pending.reply_topic, _json(payload), qos=1, correlation=pending.correlation))
        self._stats_dirty = True

    def _refuse_command(
        self, device: str, name: str, answer: Answer, error: str, detail: str, cmd_id: int | None = None
    ) -> None:
        self.commands[error] += 1
        log.info("command %s for %s refused: %s (%s)", name, device, error, detail)
        answer(cmd_id, {"ok": False, "error": error, "detail": detail})

    def _command_timeout(self, device: str, cmd_id: int) -> None:
        pending = self.pending.pop((device, cmd_id), None)
        if pending is None or pending.answer is None:
            return
        self.commands["timeout"] += 1
        self._stats_dirty = True
        log.warning(
            "command %s #%d to %s: no reply within %gs", pending.command, cmd_id, device, self.cfg.command_timeout
        )
        pending.answer(
            cmd_id,
            {
                "ok": False,
                "error": "timeout",
                "detail": f"no reply from the board within {self.cfg.command_timeout:g}s",
            },
        )

    def _on_reply(self, link: SerialLink, reply: Reply) -> None:
        pending = self.pending.pop((reply.device, reply.id), None)
        if pending is None or pending.answer is None:
            self._reject(
                link, Rejected("unexpected_reply", f"reply to unknown command #{reply.id} from {reply.device!r}", b"")
            )
            return
        if pending.timer is not None:
            pending.timer.cancel()
        self.commands["replied"] += 1
        body: dict[str, Any] = {"ok": reply.ok, "boot": reply.boot}
        if reply.data is not None:
            body["data"] = reply.data
        if reply.error is not None:
            body["error"] = reply.error
        pending.answer(reply.id, body)

    # -- stats ---------------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Every counter, as published on ``bridge/<gw>/stats``."""
        buf = self.publisher.buffer
        return {
            "v": ENVELOPE_VERSION,
            "gateway_id": self.gw,
            "gateway_time": self._now(),
            "uptime_s": round(time.time() - self.started, 3),
            "mqtt": {
                "connected": self.publisher.connected.is_set(),
                "connects": self.publisher.connects,
                "published": self.publisher.published,
                "buffered": len(buf),
                "buffer_capacity": buf.capacity,
                "dropped_qos0": buf.dropped[0],
                "dropped_qos1": buf.dropped[1] + buf.dropped[2],
            },
            "ports": {link.cfg.path: self._port_stats(link) for link in self.links},
            "devices": {
                name: {
                    "port": st.port,
                    "boot": st.boot,
                    "seq": st.seq,
                    "readings": st.readings,
                    "gaps": st.gaps,
                    "lost": st.lost,
                    "reboots": st.reboots,
                    "duplicates": st.duplicates,
                    "seq_regressions": st.regressions,
                }
                for name, st in sorted(self.devices.items())
            },
            "modbus": {
                name: st for bus in self.links if isinstance(bus, ModbusBus) for name, st in bus.device_stats().items()
            },
            "commands": dict(sorted(self.commands.items())),
            **({"sparkplug": self.sparkplug.stats()} if self.sparkplug is not None else {}),
        }

    def _port_stats(self, link: SerialLink | ModbusBus) -> dict[str, Any]:
        stats = {
            "state": link.state,
            "protocol": link.cfg.protocol,
            "opens": link.opens,
            "errors": link.errors,
            "bytes_in": link.bytes_in,
            "frames": self.port_stats[link.cfg.path].frames,
            "rejected": dict(sorted(self.port_stats[link.cfg.path].rejected.items())),
            "ignored": dict(sorted(self.port_stats[link.cfg.path].ignored.items())),
        }
        if isinstance(link, ModbusBus):
            stats.update(bytes_out=link.bytes_out, requests=link.requests, responses=link.responses)
        return stats

    def _write_stats_file(self) -> None:
        if not self.cfg.stats_file:
            return
        tmp = f"{self.cfg.stats_file}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_json(self.stats()))
            os.replace(tmp, self.cfg.stats_file)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.cfg.stats_file, exc)

    async def _stats_loop(self) -> None:
        if self.cfg.stats_interval <= 0:
            return
        last_mqtt: tuple[Any, ...] = ()
        while True:
            await asyncio.sleep(self.cfg.stats_interval)
            pub = self.publisher
            mqtt_state: tuple[Any, ...] = (pub.connected.is_set(), pub.connects, pub.published, len(pub.buffer))
            if self.sparkplug is not None:
                spb = self.sparkplug.publisher
                mqtt_state += (spb.connected.is_set(), spb.published, len(spb.buffer))
            if mqtt_state != last_mqtt:
                last_mqtt = mqtt_state
                self._stats_dirty = True
            if not self._stats_dirty:
                continue
            self._stats_dirty = False  # before the snapshot: a change while publishing marks it dirty again
            self._write_stats_file()
            if not await self.publisher.publish_live(self.topic_stats, _json(self.stats()), retain=True):
                self._stats_dirty = True


async def serve(cfg: BridgeConfig, stop: asyncio.Event | None = None) -> None:
    """Run a bridge until SIGTERM/SIGINT (or ``stop``)."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    bridge = Bridge(cfg)
    log.info(
        "firmware-bridge starting: gateway %s, broker %s, %d port(s)", cfg.gateway_id, cfg.mqtt.broker, len(cfg.ports)
    )
    metrics = None
    if cfg.metrics_bind is not None:  # imported only when configured
        from firmware_bridge.metrics import BridgeCollector
        from gateway.metrics_endpoint import MetricsServer

        metrics = MetricsServer(cfg.metrics_bind, BridgeCollector(bridge, loop))
        try:
            where = metrics.start()
        except OSError as exc:
            log.error("cannot listen on %s ([metrics] bind): %s", cfg.metrics_bind, exc.strerror or exc)
            raise SystemExit(1) from None
        log.info("metrics: Prometheus /metrics on http://%s/metrics", where)
    try:
        await bridge.run(stop)
    finally:
        if metrics is not None:
            metrics.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
