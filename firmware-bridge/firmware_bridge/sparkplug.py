"""A Sparkplug B Edge Node (Eclipse Sparkplug 3.0), sans-I/O: events and ``now`` in, output records out.

:class:`EdgeNode` owns the Edge Node's session rules; it never touches a socket, a clock or a callback. The glue
(``firmware_bridge/sparkplug_link.py``) feeds it and carries out what it returns:

inputs
    :meth:`EdgeNode.connecting` (before every MQTT CONNECT: the Will), :meth:`EdgeNode.connected` (CONNACK and the
    subscriptions of :attr:`EdgeNode.subscriptions` done), :meth:`EdgeNode.disconnected`, :meth:`EdgeNode.values`
    (a device's reading), :meth:`EdgeNode.device_offline`, :meth:`EdgeNode.message` (NCMD, DCMD, STATE),
    :meth:`EdgeNode.written` (a DCMD's write was carried out), :meth:`EdgeNode.stopping`.
outputs
    :class:`Publish` (topic, payload bytes, qos, retain), :class:`WriteMetric` (a DCMD to carry out through the
    bridge's command path), :class:`Refused` (a command that is not carried out: log it and count it),
    :class:`Reconnect` (end this MQTT session and start a new one).

The rules, with the specification's statements:

* Topics ``spBv1.0/<group_id>/<message_type>/<edge_node_id>[/<device_id>]`` ([tck-id-topic-structure]).
* The Will is the NDEATH with the single metric ``bdSeq`` (Int64), QoS 1, not retained, no ``seq``
  ([tck-id-payloads-ndeath-will-message], [tck-id-payloads-ndeath-will-message-qos],
  [tck-id-payloads-ndeath-will-message-retain], [tck-id-payloads-ndeath-seq]); ``bdSeq`` starts at 0 and goes up
  by one on every CONNECT, 255 wrapping to 0 ([tck-id-topics-nbirth-bdseq-increment],
  [tck-id-message-flow-edge-node-birth-publish-will-message-payload-bdSeq]).
* NBIRTH: ``seq`` 0, ``bdSeq`` equal to the Will's, ``Node Control/Rebirth`` Boolean false without an alias
  ([tck-id-topics-nbirth-seq-num], [tck-id-topics-nbirth-bdseq-matching], [tck-id-topics-nbirth-rebirth-metric],
  [tck-id-operational-behavior-data-commands-rebirth-name-aliases]).
* DBIRTH of a device before any DDATA of it, with every metric it will send: name, alias, datatype, current value
  (``is_null`` while unknown), ``engUnit`` and ``readOnly`` properties ([tck-id-topics-dbirth-metric-reqs],
  [tck-id-operational-behavior-data-publish-dbirth-values]). Aliases are unique across the Edge Node
  ([tck-id-payloads-alias-uniqueness]) and never change while the bridge runs; a device whose metric set or a
  datatype changes (a board that starts sending a new quantity) is born again with the new set.
* DDATA: only the metrics whose value changed since the last DBIRTH or DDATA (report by exception,
  [tck-id-topics-ddata-payload]), by alias only ([tck-id-payloads-alias-data-cmd-requirement]); nothing when
  nothing changed.
* ``seq`` 0..255 across NBIRTH, DBIRTH, DDATA and DDEATH, 255 wrapping to 0
  ([tck-id-payloads-sequence-num-incrementing]); every payload carries a timestamp in milliseconds since the Unix
  epoch, UTC ([tck-id-payloads-timestamp-in-UTC]).
* DDEATH when a device goes offline ([tck-id-operational-behavior-device-ddeath]); DBIRTH at its next reading.
* NCMD ``Node Control/Rebirth`` true: NBIRTH (``seq`` 0, the same ``bdSeq``) and every DBIRTH again
  ([tck-id-operational-behavior-data-commands-rebirth-action-2], [...-rebirth-action-3]).
* With a Primary Host Application: no births before its ``spBv1.0/STATE/<host_id>`` says ``online`` true with a
  timestamp not older than the last one seen ([tck-id-message-flow-edge-node-birth-publish-phid-wait],
  [...-phid-wait-id], [...-phid-wait-online], [...-phid-wait-timestamp]); an ``online`` false that is not older
  ends the session: NDEATH, then a new CONNECT ([tck-id-message-flow-edge-node-birth-publish-phid-offline]); an
  ``online`` true newer than the last one while in session births again, so a host that restarted gets them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from firmware_bridge.sparkplug_payload import DataType, Metric, Payload, Value, decode, encode, from_wire, to_wire

NAMESPACE = "spBv1.0"
REBIRTH = "Node Control/Rebirth"
BDSEQ = "bdSeq"
_UNSENT = object()
_FLOATS = (DataType.Float, DataType.Double, DataType.Boolean)  # a metric value never published in this session


@dataclass(frozen=True, slots=True)
class Publish:
    """A message to publish: ``payload`` bytes on ``topic``."""

    topic: str
    payload: bytes
    qos: int
    retain: bool = False


@dataclass(frozen=True, slots=True)
class WriteMetric:
    """A DCMD to carry out: write ``value`` (in the metric's datatype and units) to ``metric`` of ``device``."""

    device: str
    metric: str
    value: Value


@dataclass(frozen=True, slots=True)
class Refused:
    """A command not carried out. ``reason``: ``unknown_metric``, ``read_only``, ``bad_value``, ``bad_payload``,
    ``unknown_device`` or ``not_in_session``; ``device`` is None for NCMD."""

    device: str | None
    metric: str | None
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class Reconnect:
    """End this MQTT session (the NDEATH has been returned before it) and connect again."""

    reason: str


Output = Publish | WriteMetric | Refused | Reconnect


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric known before its first value: a Modbus register or a board command.

    Attributes:
        name: the metric name; datatype: its :class:`DataType`; unit: the ``engUnit`` property ("" = none).
        writable: a DCMD may write it. momentary: a Boolean command metric whose published value stays false
            (like ``Node Control/Rebirth``): true runs the command.
    """

    name: str
    datatype: DataType
    unit: str = ""
    writable: bool = False
    momentary: bool = False


@dataclass(slots=True)
class _Metric:
    spec: MetricSpec
    alias: int
    value: Value | None = None
    timestamp: int | None = None
    sent: object = _UNSENT


@dataclass(slots=True)
class _Device:
    metrics: dict[str, _Metric] = field(default_factory=dict)
    online: bool = False  # has reported since it was last offline
    born: bool = False  # its DBIRTH went out in this session
    stale: bool = False  # its metric set changed since its DBIRTH


def datatype_of(value: Value) -> DataType:
    """The datatype a reading's value is born with: Boolean, Int64 (whole numbers), Double, String."""
    if isinstance(value, bool):
        return DataType.Boolean
    if isinstance(value, int):
        return DataType.Int64
    if isinstance(value, float):
        return DataType.Double
    return DataType.String


def _fits(datatype: DataType, value: Value) -> bool:
    try:
        to_wire(datatype, value)
    except ValueError:
        return False
    return True


class EdgeNode:
    """One Edge Node's Sparkplug session (see the module docstring for the rules and their sources).

    Args:
        group_id, edge_node_id: the topic's Group ID and Edge Node ID (checked by the configuration).
        primary_host_id: the Primary Host Application to wait for, or None.
        qos: the MQTT QoS of NBIRTH, DBIRTH, DDATA and DDEATH (the Will and NDEATH are always QoS 1).
    """

    def __init__(self, group_id: str, edge_node_id: str, primary_host_id: str | None = None, qos: int = 0) -> None:
        self.group_id = group_id
        self.edge_node_id = edge_node_id
        self.primary_host_id = primary_host_id
        self.qos = qos
        self.bd_seq = -1  # the first CONNECT makes it 0
        self.seq = 0  # the next message's seq
        self.connected_now = False
        self.in_session = False  # births sent and not ended since
        self.host_online = primary_host_id is None
        self.host_timestamp: int | None = None
        self.devices: dict[str, _Device] = {}
        self.refused = Counter[str]()
        self._aliases = 0
        self._will_timestamp = 0

    # -- topics ----------------------------------------------------------------------------------------------------

    def topic(self, message_type: str, device: str | None = None) -> str:
        """``spBv1.0/<group_id>/<message_type>/<edge_node_id>[/<device>]``."""
        base = f"{NAMESPACE}/{self.group_id}/{message_type}/{self.edge_node_id}"
        return base if device is None else f"{base}/{device}"

    @property
    def subscriptions(self) -> list[str]:
        """Topic filters to subscribe (QoS 1) before :meth:`connected`: NCMD
        ([tck-id-message-flow-edge-node-ncmd-subscribe]), DCMD of every device, the Primary Host's STATE."""
        filters = [self.topic("NCMD"), self.topic("DCMD", "+")]
        if self.primary_host_id is not None:
            filters.append(f"{NAMESPACE}/STATE/{self.primary_host_id}")
        return filters

    # -- devices ---------------------------------------------------------------------------------------------------

    def declare(self, device: str, specs: list[MetricSpec]) -> None:
        """Metrics ``device`` has before its first reading (Modbus registers, board commands); its DBIRTH carries
        them, ``is_null`` until read."""
        dev = self.devices.setdefault(device, _Device())
        for spec in specs:
            self._metric(dev, spec)

    def _metric(self, dev: _Device, spec: MetricSpec) -> _Metric:
        metric = dev.metrics.get(spec.name)
        if metric is None:
            self._aliases += 1
            metric = dev.metrics[spec.name] = _Metric(spec, self._aliases)
            dev.stale = True
        elif metric.spec != spec:
            metric.spec = spec
            dev.stale = True
        return metric

    # -- session ---------------------------------------------------------------------------------------------------

    def connecting(self, now: int) -> Publish:
        """The Will of the next CONNECT (``now``: milliseconds since the Unix epoch): NDEATH with the next bdSeq."""
        self.bd_seq = (self.bd_seq + 1) % 256
        self._will_timestamp = now
        return self._ndeath()

    def _ndeath(self) -> Publish:
        metric = Metric(name=BDSEQ, datatype=DataType.Int64, value=self.bd_seq)
        return Publish(self.topic("NDEATH"), encode(Payload(self._will_timestamp, [metric])), qos=1)

    def connected(self, now: int) -> list[Output]:
        """The MQTT session is up and subscribed: the births, unless a Primary Host has not said it is online."""
        self.connected_now = True
        return self._births(now) if self.host_online else []

    def disconnected(self) -> None:
        """The MQTT connection is gone: the session ended (the broker publishes the Will)."""
        self.connected_now = False
        self.in_session = False
        for dev in self.devices.values():
            dev.born = False

    def stopping(self) -> list[Output]:
        """An intentional disconnect follows: the NDEATH to publish before it
        ([tck-id-operational-behavior-edge-node-intentional-disconnect-ndeath])."""
        if not self.connected_now:
            return []
        self.in_session = False
        return [self._ndeath()]

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq = (seq + 1) % 256
        return seq

    def _births(self, now: int) -> list[Output]:
        self.in_session = True
        self.seq = 0
        node = [
            Metric(name=BDSEQ, datatype=DataType.Int64, value=self.bd_seq, timestamp=now),
            Metric(name=REBIRTH, datatype=DataType.Boolean, value=False, timestamp=now),
        ]
        out: list[Output] = [Publish(self.topic("NBIRTH"), encode(Payload(now, node, self._next_seq())), self.qos)]
        for name, dev in self.devices.items():
            dev.born = False
            if dev.online:
                out.append(self._dbirth(name, dev, now))
        return out

    def _dbirth(self, name: str, dev: _Device, now: int) -> Publish:
        metrics = []
        for m in dev.metrics.values():
            props: dict[str, tuple[DataType, Value]] = {}
            if m.spec.unit:
                props["engUnit"] = (DataType.String, m.spec.unit)
            props["readOnly"] = (DataType.Boolean, not m.spec.writable)
            value = False if m.spec.momentary else m.value
            metrics.append(
                Metric(m.spec.name, m.alias, m.spec.datatype, value, m.timestamp or now, value is None, props)
            )
            m.sent = value
        dev.born, dev.stale = True, False
        return Publish(self.topic("DBIRTH", name), encode(Payload(now, metrics, self._next_seq())), self.qos)

    # -- readings --------------------------------------------------------------------------------------------------

    def values(self, device: str, values: dict[str, Value], units: dict[str, str], now: int) -> list[Output]:
        """A reading of ``device`` taken at ``now`` (ms): name -> value (numbers, booleans, text), units by name.
        A DBIRTH when the device is not born in this session (or its metric set changed), else a DDATA of what
        changed; nothing outside a session (the births carry the latest values)."""
        dev = self.devices.setdefault(device, _Device())
        for name, value in values.items():
            metric = dev.metrics.get(name)
            if metric is None or not _fits(metric.spec.datatype, value):
                datatype = datatype_of(value)
                if metric is not None and datatype is DataType.Int64 and metric.spec.datatype is DataType.Double:
                    datatype = DataType.Double  # a whole number of a Double metric stays Double
                spec = metric.spec if metric is not None else MetricSpec(name, datatype, units.get(name, ""))
                metric = self._metric(dev, MetricSpec(name, datatype, spec.unit, spec.writable, spec.momentary))
            metric.value, metric.timestamp = value, now
        dev.online = True
        if not self.in_session:
            return []
        if not dev.born or dev.stale:
            return [self._dbirth(device, dev, now)]
        return self._ddata(device, dev, now, ())

    def _ddata(self, device: str, dev: _Device, now: int, force: tuple[str, ...]) -> list[Output]:
        changed = [
            # by alias only; the datatype is left out too ([tck-id-payloads-metric-datatype-not-req])
            Metric(alias=m.alias, value=m.value, timestamp=m.timestamp, datatype=m.spec.datatype, send_datatype=False)
            for m in dev.metrics.values()
            if m.value is not None and not m.spec.momentary and (m.sent != m.value or m.spec.name in force)
        ]
        if not changed:
            return []
        for m in dev.metrics.values():
            if m.value is not None and not m.spec.momentary:
                m.sent = m.value
        return [Publish(self.topic("DDATA", device), encode(Payload(now, changed, self._next_seq())), self.qos)]

    def device_offline(self, device: str, now: int) -> list[Output]:
        """``device`` stopped answering (or its port closed): a DDEATH when it was born in this session."""
        dev = self.devices.get(device)
        if dev is None or not dev.online:
            return []
        dev.online = False
        if not dev.born or not self.in_session:
            dev.born = False
            return []
        dev.born = False
        return [Publish(self.topic("DDEATH", device), encode(Payload(now, [], self._next_seq())), self.qos)]

    def written(self, device: str, metric: str, value: Value, now: int) -> list[Output]:
        """A DCMD write of ``device``'s ``metric`` was carried out and ``value`` is what the device holds now: it
        goes out in a DDATA at once (even if unchanged, so the host sees its write confirmed)."""
        dev = self.devices.get(device)
        m = dev.metrics.get(metric) if dev is not None else None
        if dev is None or m is None or m.spec.momentary:
            return []
        m.value, m.timestamp = value, now
        if not self.in_session or not dev.born:
            return []
        return self._ddata(device, dev, now, (metric,))

    # -- commands and host state -----------------------------------------------------------------------------------

    def message(self, topic: str, payload: bytes, now: int) -> list[Output]:
        """An NCMD, DCMD or STATE message that arrived on the subscriptions."""
        levels = topic.split("/")
        if len(levels) == 3 and levels[:2] == [NAMESPACE, "STATE"]:
            return self._state(levels[2], payload, now)
        if len(levels) == 4 and levels[2] == "NCMD" and topic == self.topic("NCMD"):
            return self._ncmd(payload, now)
        if len(levels) == 5 and levels[2] == "DCMD" and "/".join(levels[:4]) == self.topic("DCMD"):
            return self._dcmd(levels[4], payload)
        return []

    def _refuse(self, device: str | None, metric: str | None, reason: str, detail: str) -> Refused:
        self.refused[reason] += 1
        return Refused(device, metric, reason, detail)

    def _ncmd(self, data: bytes, now: int) -> list[Output]:
        try:
            payload = decode(data)
        except ValueError as exc:
            return [self._refuse(None, None, "bad_payload", str(exc))]
        out: list[Output] = []
        for m in payload.metrics:
            if m.name == REBIRTH:
                if m.value is not True:
                    out.append(self._refuse(None, m.name, "bad_value", "a Rebirth request carries true"))
                elif not self.connected_now or not self.host_online:
                    out.append(self._refuse(None, m.name, "not_in_session", "no session to rebirth"))
                else:
                    out.extend(self._births(now))  # stops DATA at once: the births come first in the queue
            else:
                out.append(self._refuse(None, m.name or f"alias {m.alias}", "unknown_metric", "not a node metric"))
        return out

    def _dcmd(self, device: str, data: bytes) -> list[Output]:
        dev = self.devices.get(device)
        if dev is None:
            return [self._refuse(device, None, "unknown_device", "not a device of this Edge Node")]
        try:
            payload = decode(data)
        except ValueError as exc:
            return [self._refuse(device, None, "bad_payload", str(exc))]
        by_alias: dict[int | None, _Metric] = {m.alias: m for m in dev.metrics.values()}
        out: list[Output] = []
        for cm in payload.metrics:
            m = dev.metrics.get(cm.name) if cm.name is not None else by_alias.get(cm.alias)
            label = cm.name or f"alias {cm.alias}"
            if m is None:
                out.append(self._refuse(device, label, "unknown_metric", "not in the device's DBIRTH"))
                continue
            if not m.spec.writable:
                out.append(self._refuse(device, m.spec.name, "read_only", "the metric is not writable"))
                continue
            value = cm.value
            if cm.datatype is None and isinstance(value, int) and not isinstance(value, bool):
                value = from_wire(m.spec.datatype, value)  # alias-only metric: the raw field, read as born
            if isinstance(value, float) and value.is_integer() and m.spec.datatype not in _FLOATS:
                value = int(value)  # a host that sends 60.0 to an integer metric means 60
            if value is None or cm.is_null or not _fits(m.spec.datatype, value):
                out.append(self._refuse(device, m.spec.name, "bad_value", f"{value!r} for {m.spec.datatype.name}"))
                continue
            if m.spec.momentary and value is not True:
                continue  # false is the resting value of a command metric: nothing to do
            out.append(WriteMetric(device, m.spec.name, value))
        return out

    def _state(self, host_id: str, data: bytes, now: int) -> list[Output]:
        if host_id != self.primary_host_id:
            return []
        try:
            state = json.loads(data)
            online, timestamp = state["online"], state["timestamp"]
            if not isinstance(online, bool) or isinstance(timestamp, bool) or not isinstance(timestamp, int):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            self.refused["bad_state"] += 1
            return []
        if self.host_timestamp is not None and timestamp < self.host_timestamp:
            # an older session of the host ([tck-id-operational-behavior-edge-node-termination-host-offline-timestamp])
            return []
        newer = self.host_timestamp is None or timestamp > self.host_timestamp
        self.host_timestamp = timestamp
        if online:
            was = self.host_online
            self.host_online = True
            if self.connected_now and (not was or not self.in_session or newer):
                return self._births(now)
            return []
        self.host_online = False
        if self.in_session:
            out: list[Output] = [*self.stopping(), Reconnect("the Primary Host Application is offline")]
            return out
        return []
