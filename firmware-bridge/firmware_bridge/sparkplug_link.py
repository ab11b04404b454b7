"""The Sparkplug B output of the bridge: glue between the bridge's events, :class:`firmware_bridge.sparkplug.EdgeNode`
and the Edge Node's own MQTT connection.

The Edge Node has a connection of its own (a second :class:`firmware_bridge.publisher.Publisher`), because its Will
must be the NDEATH and its session must be clean (Sparkplug 3.0 [tck-id-principles-persistence-clean-session-50]),
while the envelope's connection keeps its persistent session and its ``offline`` status Will. Both go to the same
gateway broker, so Sparkplug messages are stored and forwarded upstream like every other message.

What goes in (from :class:`firmware_bridge.bridge.Bridge`): readings, devices going offline (a port closed, a Modbus
device that stopped answering), and the NCMD/DCMD/STATE messages of the connection. What comes out: the messages the
Edge Node returns, published in order, and DCMD writes carried out through ``Bridge.run_command`` (the path of the
``cmd/...`` commands): ``write`` for a Modbus register, the configured board command for a serial device.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiomqtt

from firmware_bridge import modbus
from firmware_bridge.config import BridgeConfig, SparkplugCommand
from firmware_bridge.publisher import Outgoing, Publisher
from firmware_bridge.sparkplug import EdgeNode, MetricSpec, Output, Publish, Reconnect, Refused, WriteMetric
from firmware_bridge.sparkplug_payload import DataType, Value

log = logging.getLogger("firmware_bridge.sparkplug")
RunCommand = Callable[[str, str, dict[str, Any], Callable[[int | None, dict[str, Any]], None]], None]

# Modbus register type -> Sparkplug datatype, when no scale or offset makes the value a decimal
REGISTER_DATATYPES = {
    "bool": DataType.Boolean, "int16": DataType.Int16, "uint16": DataType.UInt16, "int32": DataType.Int32,
    "uint32": DataType.UInt32, "int64": DataType.Int64, "uint64": DataType.UInt64, "float32": DataType.Float,
    "float64": DataType.Double, "string": DataType.String,
}  # fmt: skip


def register_metric(reg: modbus.Register) -> MetricSpec:
    """The metric of a Modbus register: its type's datatype, Double once ``scale``/``offset`` apply (the published
    value is raw x scale + offset), its unit, writable as configured."""
    datatype = REGISTER_DATATYPES[reg.type]
    if (reg.scale != 1 or reg.offset != 0) and reg.type not in ("bool", "string"):
        datatype = DataType.Double
    return MetricSpec(reg.name, datatype, reg.unit, reg.writable)


def now_ms() -> int:
    """Milliseconds since the Unix epoch (UTC), Sparkplug's timestamps."""
    return time.time_ns() // 1_000_000


class SparkplugLink:
    """The Edge Node of one bridge: its session (:class:`EdgeNode`), its MQTT connection, its DCMD writes.

    Args:
        cfg: the bridge's configuration (``cfg.sparkplug`` is set).
        run_command: ``Bridge.run_command``: ``(device, command, args, answer)``.
        clock: milliseconds since the Unix epoch (tests pass their own).
    """

    def __init__(self, cfg: BridgeConfig, run_command: RunCommand, clock: Callable[[], int] = now_ms) -> None:
        assert cfg.sparkplug is not None
        self.cfg = cfg.sparkplug
        self.run_command = run_command
        self.clock = clock
        self.node = EdgeNode(self.cfg.group_id, self.cfg.edge_node_id, self.cfg.primary_host_id, self.cfg.qos)
        self.ports = {p.path: p for p in cfg.ports}
        self.device_port: dict[str, str] = {}  # device -> port path (configured, or where it was seen)
        self.modbus_devices: set[str] = set()
        for port in cfg.ports:
            if port.modbus is not None:
                for dev in port.modbus.devices:
                    self.device_port[dev.name] = port.path
                    self.modbus_devices.add(dev.name)
                    if self.cfg.selects(dev.name, port.path):
                        self.node.declare(dev.name, [register_metric(r) for g in dev.groups for r in g.registers])
            elif port.device is not None:
                self.device_port[port.device] = port.path
        self.commands: dict[tuple[str, str], SparkplugCommand] = {(c.device, c.metric): c for c in self.cfg.commands}
        for c in self.cfg.commands:
            datatype = DataType.Double if c.arg is not None else DataType.Boolean
            self.node.declare(c.device, [MetricSpec(c.metric, datatype, "", True, momentary=c.arg is None)])
        self.writes = Counter[str]()
        mqtt_cfg = replace(cfg.mqtt, client_id=self.cfg.client_id)
        self.publisher = Publisher(
            mqtt_cfg,
            on_connect=self._on_connect,
            on_message=self._on_message,
            will=self._will,
            on_disconnect=self.node.disconnected,
            clean_start=True,
            content_type=None,
        )
        for topic_filter in self.node.subscriptions:
            self.publisher.subscriptions.add(topic_filter)

    # -- the connection ------------------------------------------------------------------------------------------------

    def _will(self) -> Outgoing:
        will = self.node.connecting(self.clock())
        log.info("Sparkplug Edge Node %s/%s: connecting with bdSeq %d", self.cfg.group_id, self.cfg.edge_node_id,
                 self.node.bd_seq)  # fmt: skip
        return Outgoing(will.topic, will.payload, will.qos, will.retain)

    async def _on_connect(self) -> None:
        outputs = self.node.connected(self.clock())
        if not outputs and self.cfg.primary_host_id is not None:
            log.info("Sparkplug: waiting for the Primary Host Application %s to be online", self.cfg.primary_host_id)
        self._carry_out(outputs)

    async def _on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        self._carry_out(self.node.message(str(message.topic), bytes(payload), self.clock()))

    def stop(self) -> None:
        """An intentional disconnect: the NDEATH first, then the publisher drains and disconnects."""
        self._carry_out(self.node.stopping())
        self.publisher.stop(drain=2.0)

    # -- from the bridge -------------------------------------------------------------------------------------------

    def selects(self, device: str) -> bool:
        return self.cfg.selects(device, self.device_port.get(device, ""))

    def reading(self, device: str, port: str, values: dict[str, tuple[float | int, str]],
                text: dict[str, str] | None = None) -> None:  # fmt: skip
        """A reading the bridge published as an envelope (Modbus scaling already applied)."""
        self.device_port.setdefault(device, port)
        if not self.selects(device):
            return
        merged: dict[str, Value] = {name: value for name, (value, _) in values.items()}
        units = {name: unit for name, (_, unit) in values.items()}
        merged.update(text or {})
        self._carry_out(self.node.values(device, merged, units, self.clock()))

    def device_offline(self, device: str) -> None:
        """``device`` stopped answering: DDEATH."""
        if self.selects(device):
            self._carry_out(self.node.device_offline(device, self.clock()))

    def port_closed(self, path: str) -> None:
        """Every device on the port at ``path`` is offline."""
        for device, port in list(self.device_port.items()):
            if port == path:
                self.device_offline(device)

    def stats(self) -> dict[str, Any]:
        """The Edge Node's counters for ``bridge/<gw>/stats``."""
        return {
            "group_id": self.cfg.group_id,
            "edge_node_id": self.cfg.edge_node_id,
            "connected": self.publisher.connected.is_set(),
            "in_session": self.node.in_session,
            "bdSeq": self.node.bd_seq,
            "published": self.publisher.published,
            "buffered": len(self.publisher.buffer),
            "refused": dict(sorted(self.node.refused.items())),
            "writes": dict(sorted(self.writes.items())),
        }

    # -- outputs -----------------------------------------------------------------------------------------------------

    def _carry_out(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Publish):
                self.publisher.enqueue(Outgoing(out.topic, out.payload, out.qos, out.retain))
            elif isinstance(out, WriteMetric):
                self._write(out)
            elif isinstance(out, Refused):
                where = f"device {out.device}" if out.device is not None else "the Edge Node"
                log.warning("Sparkplug: command for %s, metric %s refused: %s (%s)", where, out.metric, out.reason,
                            out.detail)  # fmt: skip
            elif isinstance(out, Reconnect):
                log.warning("Sparkplug: ending the session: %s", out.reason)
                self.publisher.restart(out.reason)

    def _write(self, w: WriteMetric) -> None:
        if w.device in self.modbus_devices:
            command, args = "write", {"name": w.metric, "value": w.value}
        else:
            spec = self.commands[(w.device, w.metric)]
            command, args = spec.command, ({spec.arg: w.value} if spec.arg is not None else {})

        def answer(cmd_id: int | None, body: dict[str, Any]) -> None:
            if not body.get("ok"):
                self.writes[str(body.get("error"))] += 1
                log.warning("Sparkplug: DCMD %s/%s = %r failed: %s (%s)", w.device, w.metric, w.value,
                            body.get("error"), body.get("detail", ""))  # fmt: skip
                return
            self.writes["ok"] += 1
            data = body.get("data")
            value = data["value"] if w.device in self.modbus_devices and isinstance(data, dict) else w.value
            self._carry_out(self.node.written(w.device, w.metric, value, self.clock()))

        log.info("Sparkplug: DCMD %s/%s = %r -> %s", w.device, w.metric, w.value, command)
        self.run_command(w.device, command, args, answer)
