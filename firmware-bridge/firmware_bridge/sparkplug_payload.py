"""Sparkplug B payloads: the Protocol Buffers schema of Eclipse Sparkplug 3.0 (section 6.4, ``sparkplug_b.proto``),
encoded and decoded with Google's ``protobuf`` runtime.

Only the messages the Edge Node uses are declared (``Payload``, ``Payload.Metric``, ``Payload.PropertySet``,
``Payload.PropertyValue``), with the field numbers and types of the specification's schema, so the bytes are the
schema's; fields left out here (templates, data sets, metadata, extensions) are skipped when a host sends them.
The schema lives in a private descriptor pool under its own file name, so it never collides with another copy of
``sparkplug_b.proto`` (a host library's) loaded into the same process.

Datatypes (section 6.4.16): Int8/16/32 and UInt8/16/32 travel in ``int_value`` (uint32), Int64/UInt64 in
``long_value`` (uint64); a negative integer is sent as its two's complement in the datatype's own width (Int16 -2 =
0xFFFE), and read back the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


class DataType(IntEnum):
    """Sparkplug B datatypes (section 6.4.16, ``enum DataType``)."""

    Unknown = 0
    Int8 = 1
    Int16 = 2
    Int32 = 3
    Int64 = 4
    UInt8 = 5
    UInt16 = 6
    UInt32 = 7
    UInt64 = 8
    Float = 9
    Double = 10
    Boolean = 11
    String = 12
    DateTime = 13
    Text = 14


_INT_BITS = {
    DataType.Int8: 8, DataType.Int16: 16, DataType.Int32: 32, DataType.Int64: 64,
    DataType.UInt8: 8, DataType.UInt16: 16, DataType.UInt32: 32, DataType.UInt64: 64,
}  # fmt: skip
_SIGNED = (DataType.Int8, DataType.Int16, DataType.Int32, DataType.Int64)
_VALUE_FIELD = {
    **{t: "int_value" for t in (DataType.Int8, DataType.Int16, DataType.Int32, DataType.UInt8, DataType.UInt16,
                                DataType.UInt32)},
    DataType.Int64: "long_value", DataType.UInt64: "long_value", DataType.DateTime: "long_value",
    DataType.Float: "float_value", DataType.Double: "double_value", DataType.Boolean: "boolean_value",
    DataType.String: "string_value", DataType.Text: "string_value",
}  # fmt: skip

Value = int | float | bool | str


def _schema() -> descriptor_pb2.FileDescriptorProto:
    """The specification's messages (field name, number, type, label) as a FileDescriptorProto."""
    F = descriptor_pb2.FieldDescriptorProto
    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    fdp = descriptor_pb2.FileDescriptorProto(
        name="firmware_bridge/sparkplug_b.proto", package="org.eclipse.tahu.protobuf", syntax="proto2"
    )
    payload = fdp.message_type.add(name="Payload")
    prefix = ".org.eclipse.tahu.protobuf.Payload."

    def add(msg: Any, name: str, number: int, type_: int, label: int = opt, ref: str = "", oneof: int = -1) -> None:
        f = msg.field.add(name=name, number=number, type=type_, label=label)
        if ref:
            f.type_name = prefix + ref
        if oneof >= 0:
            f.oneof_index = oneof

    value = payload.nested_type.add(name="PropertyValue")
    add(value, "type", 1, F.TYPE_UINT32)
    add(value, "is_null", 2, F.TYPE_BOOL)
    value.oneof_decl.add(name="value")
    for name, number, type_ in (("int_value", 3, F.TYPE_UINT32), ("long_value", 4, F.TYPE_UINT64),
                                ("float_value", 5, F.TYPE_FLOAT), ("double_value", 6, F.TYPE_DOUBLE),
                                ("boolean_value", 7, F.TYPE_BOOL), ("string_value", 8, F.TYPE_STRING)):  # fmt: skip
        add(value, name, number, type_, oneof=0)
    props = payload.nested_type.add(name="PropertySet")
    add(props, "keys", 1, F.TYPE_STRING, rep)
    add(props, "values", 2, F.TYPE_MESSAGE, rep, "PropertyValue")
    metric = payload.nested_type.add(name="Metric")
    for name, number, type_ in (("name", 1, F.TYPE_STRING), ("alias", 2, F.TYPE_UINT64),
                                ("timestamp", 3, F.TYPE_UINT64), ("datatype", 4, F.TYPE_UINT32),
                                ("is_historical", 5, F.TYPE_BOOL), ("is_transient", 6, F.TYPE_BOOL),
                                ("is_null", 7, F.TYPE_BOOL)):  # fmt: skip
        add(metric, name, number, type_)
    add(metric, "properties", 9, F.TYPE_MESSAGE, ref="PropertySet")
    metric.oneof_decl.add(name="value")
    for name, number, type_ in (("int_value", 10, F.TYPE_UINT32), ("long_value", 11, F.TYPE_UINT64),
                                ("float_value", 12, F.TYPE_FLOAT), ("double_value", 13, F.TYPE_DOUBLE),
                                ("boolean_value", 14, F.TYPE_BOOL), ("string_value", 15, F.TYPE_STRING),
                                ("bytes_value", 16, F.TYPE_BYTES)):  # fmt: skip
        add(metric, name, number, type_, oneof=0)
    add(payload, "timestamp", 1, F.TYPE_UINT64)
    add(payload, "metrics", 2, F.TYPE_MESSAGE, rep, "Metric")
    add(payload, "seq", 3, F.TYPE_UINT64)
    add(payload, "uuid", 4, F.TYPE_STRING)
    add(payload, "body", 5, F.TYPE_BYTES)
    return fdp


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_schema())
PayloadMessage: Any = message_factory.GetMessageClass(_pool.FindMessageTypeByName("org.eclipse.tahu.protobuf.Payload"))


@dataclass(slots=True)
class Metric:
    """One metric of a payload (section 6.4.7).

    Attributes:
        name: the metric name (births, commands by name); None when only the alias is sent (DATA).
        alias: the metric's alias (unsigned 64-bit), or None.
        datatype: a :class:`DataType`; None when the payload leaves it out (DATA, commands).
        value: the value, or None with ``is_null`` true.
        timestamp: when the value was acquired, milliseconds since the Unix epoch (UTC), or None.
        properties: property name -> (DataType, value); the bridge sends ``engUnit`` and ``readOnly``.
    """

    name: str | None = None
    alias: int | None = None
    datatype: DataType | None = None
    value: Value | None = None
    timestamp: int | None = None
    is_null: bool = False
    properties: dict[str, tuple[DataType, Value]] = field(default_factory=dict)
    send_datatype: bool = True  # False: the datatype only picks the value's field (DATA messages leave it out)


@dataclass(slots=True)
class Payload:
    """A Sparkplug B payload: ``timestamp`` (milliseconds, UTC), ``seq`` (0..255, None in NDEATH and commands)."""

    timestamp: int | None
    metrics: list[Metric]
    seq: int | None = None


def to_wire(datatype: DataType, value: Value) -> Value:
    """``value`` as the protobuf field of ``datatype`` holds it (two's complement for negative integers).

    Raises:
        ValueError: the value does not fit the datatype.
    """
    if datatype in _INT_BITS:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ValueError(f"{datatype.name} takes whole numbers, got {value!r}")
        bits, v = _INT_BITS[datatype], int(value)
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if datatype in _SIGNED else (0, 2**bits - 1)
        if not low <= v <= high:
            raise ValueError(f"{v} does not fit {datatype.name} ({low}..{high})")
        return v + 2**bits if v < 0 else v
    if datatype in (DataType.Float, DataType.Double):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{datatype.name} takes finite numbers, got {value!r}")
        return float(value)
    if datatype is DataType.Boolean:
        if not isinstance(value, bool | int) or value not in (0, 1):
            raise ValueError(f"Boolean takes true or false, got {value!r}")
        return bool(value)
    if datatype in (DataType.String, DataType.Text):
        if not isinstance(value, str):
            raise ValueError(f"{datatype.name} takes text, got {value!r}")
        return value
    raise ValueError(f"datatype {datatype.name} is not supported here")


def from_wire(datatype: DataType, raw: Value) -> Value:
    """The value of a protobuf field read as ``datatype`` (the inverse of :func:`to_wire`)."""
    if datatype in _SIGNED and isinstance(raw, int):
        bits = _INT_BITS[datatype]
        raw &= 2**bits - 1
        return raw - 2**bits if raw >= 2 ** (bits - 1) else raw
    if datatype in _INT_BITS and isinstance(raw, int):
        return raw & (2 ** _INT_BITS[datatype] - 1)
    return raw


def _set_value(target: Any, datatype: DataType, value: Value) -> None:
    setattr(target, _VALUE_FIELD[datatype], to_wire(datatype, value))


def encode(payload: Payload) -> bytes:
    """The protobuf bytes of ``payload``. Raises ValueError when a value does not fit its datatype."""
    msg = PayloadMessage()
    if payload.timestamp is not None:
        msg.timestamp = payload.timestamp
    if payload.seq is not None:
        msg.seq = payload.seq
    for m in payload.metrics:
        pm = msg.metrics.add()
        if m.name is not None:
            pm.name = m.name
        if m.alias is not None:
            pm.alias = m.alias
        if m.timestamp is not None:
            pm.timestamp = m.timestamp
        if m.datatype is not None and m.send_datatype:
            pm.datatype = int(m.datatype)
        for key, (ptype, pvalue) in m.properties.items():
            pm.properties.keys.append(key)
            pv = pm.properties.values.add(type=int(ptype))
            _set_value(pv, ptype, pvalue)
        if m.is_null or m.value is None:
            pm.is_null = True
        elif m.datatype is not None:
            _set_value(pm, m.datatype, m.value)
    return bytes(msg.SerializeToString())


def decode(data: bytes) -> Payload:
    """A payload from its protobuf bytes. A metric without a datatype keeps its raw field value (the receiver maps
    it through the alias's datatype with :func:`from_wire`).

    Raises:
        ValueError: the bytes are not a Sparkplug B payload.
    """
    msg = PayloadMessage()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError (and, with some backends, others)
        raise ValueError(f"not a Sparkplug B payload: {exc}") from None
    metrics = []
    for pm in msg.metrics:
        datatype = None
        if pm.HasField("datatype"):
            try:
                datatype = DataType(pm.datatype)
            except ValueError:
                datatype = DataType.Unknown
        which = pm.WhichOneof("value")
        raw = getattr(pm, which) if which is not None else None
        value = from_wire(datatype, raw) if datatype is not None and raw is not None else raw
        props = {
            k: (DataType(v.type), getattr(v, v.WhichOneof("value")))
            for k, v in zip(pm.properties.keys, pm.properties.values)
            if v.WhichOneof("value") is not None and v.type in DataType._value2member_map_
        }
        metrics.append(
            Metric(
                name=pm.name if pm.HasField("name") else None,
                alias=pm.alias if pm.HasField("alias") else None,
                datatype=datatype,
                value=value,
                timestamp=pm.timestamp if pm.HasField("timestamp") else None,
                is_null=pm.is_null,
                properties=props,
            )
        )
    return Payload(
        msg.timestamp if msg.HasField("timestamp") else None, metrics, msg.seq if msg.HasField("seq") else None
    )
