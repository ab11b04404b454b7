"""The Sparkplug B Edge Node's session rules, in process (firmware_bridge/sparkplug.py is sans-I/O): events and a
fake clock in, output records out. Each test is named after the Eclipse Sparkplug 3.0 statement it checks.

The payloads are decoded here with pysparkplug (its own generated code of sparkplug_b.proto and its own datatype
codecs), not with the bridge's encoder, so an encoding mistake on either side shows up as a mismatch.
"""

from __future__ import annotations

import json
from typing import Any

import pysparkplug as psp
import pytest
from firmware_bridge.config import ConfigError, load_config
from firmware_bridge.sparkplug import (
    EdgeNode,
    MetricSpec,
    Publish,
    Reconnect,
    Refused,
    WriteMetric,
)
from firmware_bridge.sparkplug_link import register_metric
from firmware_bridge.sparkplug_payload import DataType, Metric, Payload, encode
from pysparkplug import _protobuf as psp_protobuf

PB = psp_protobuf.Payload  # pysparkplug's generated message class, for fields its Metric leaves out
T0 = 1_714_564_800_000  # 2024-05-01T12:00:00Z in milliseconds


def _node(**kw: Any) -> EdgeNode:
    return EdgeNode("plant-1", "gw-1", **kw)


def _session(node: EdgeNode, now: int = T0) -> tuple[Publish, list[Any]]:
    will = node.connecting(now)
    return will, node.connected(now + 1)


def _pubs(outputs: list[Any]) -> list[Publish]:
    return [o for o in outputs if isinstance(o, Publish)]


def _decode(pub: Publish, birth: psp.NBirth | psp.DBirth | None = None) -> Any:
    kind = pub.topic.split("/")[2]
    cls = {"NBIRTH": psp.NBirth, "DBIRTH": psp.DBirth, "DDATA": psp.DData, "NDEATH": psp.NDeath,
           "DDEATH": psp.DDeath}[kind]  # fmt: skip
    return cls.decode(pub.payload, birth=birth) if kind == "DDATA" else cls.decode(pub.payload)


def _metrics(payload: Any) -> dict[str, Any]:
    return {m.name: m for m in payload.metrics}


def test_tck_id_topic_structure_and_device_id_only_on_device_message_types() -> None:
    """[tck-id-topic-structure], [tck-id-topic-structure-namespace-device-id-associated-message-types] and
    [...-non-associated-message-types]: spBv1.0/group_id/TYPE/edge_node_id[/device_id]."""
    node = _node()
    will, births = _session(node)
    out = node.values("buoy-b01", {"t": 4.9}, {"t": "degC"}, T0 + 2)
    assert will.topic == "spBv1.0/plant-1/NDEATH/gw-1"
    assert [p.topic for p in births + out] == ["spBv1.0/plant-1/NBIRTH/gw-1", "spBv1.0/plant-1/DBIRTH/gw-1/buoy-b01"]
    assert node.subscriptions == ["spBv1.0/plant-1/NCMD/gw-1", "spBv1.0/plant-1/DCMD/gw-1/+"]


def test_tck_id_payloads_ndeath_will_message_and_nbirth_bdseq_matching() -> None:
    """[tck-id-payloads-ndeath-will-message-qos] 1, [...-retain] false, [tck-id-payloads-ndeath-seq] no seq,
    [tck-id-topics-ndeath-payload] only bdSeq; [tck-id-topics-nbirth-bdseq-matching]: the NBIRTH's bdSeq is the
    Will's; [tck-id-topics-nbirth-bdseq-increment]: 0 first, +1 per CONNECT, 255 -> 0."""
    node = _node()
    seen = []
    for i in range(258):
        will, births = _session(node, T0 + i)
        assert (will.qos, will.retain) == (1, False)
        raw = PB.FromString(will.payload)
        assert [m.name for m in raw.metrics] == ["bdSeq"]
        assert not raw.HasField("seq")
        bd_seq = psp.NDeath.decode(will.payload).bd_seq_metric
        assert bd_seq.datatype is psp.DataType.INT64
        nbirth = psp.NBirth.decode(births[0].payload)
        assert _metrics(nbirth)["bdSeq"].value == bd_seq.value
        seen.append(bd_seq.value)
        node.disconnected()
    assert seen[:3] == [0, 1, 2]
    assert seen[255:] == [255, 0, 1]


def test_tck_id_topics_nbirth_seq_num_and_rebirth_metric() -> None:
    """[tck-id-topics-nbirth-seq-num] seq 0; [tck-id-topics-nbirth-rebirth-metric] 'Node Control/Rebirth' Boolean
    false, [tck-id-operational-behavior-data-commands-rebirth-name-aliases] without an alias;
    [tck-id-topics-nbirth-timestamp] a timestamp in ms; [tck-id-topics-nbirth-mqtt] QoS as configured, not retained."""
    node = _node(qos=0)
    _, births = _session(node)
    nbirth = psp.NBirth.decode(births[0].payload)
    assert nbirth.seq == 0
    assert nbirth.timestamp == T0 + 1
    rebirth = _metrics(nbirth)["Node Control/Rebirth"]
    assert (rebirth.datatype, rebirth.value, rebirth.alias) == (psp.DataType.BOOLEAN, False, None)
    assert (births[0].qos, births[0].retain) == (0, False)


def test_tck_id_payloads_sequence_num_incrementing_wraps_255_to_0() -> None:
    """[tck-id-payloads-sequence-num-incrementing] / [tck-id-topics-ddata-seq-num]: every message after the NBIRTH
    carries the previous seq + 1, 255 wrapping to 0, across DBIRTH, DDATA and DDEATH of all devices."""
    node = _node()
    _, births = _session(node)
    seqs = [psp.NBirth.decode(births[0].payload).seq]
    for i in range(300):
        device = "a" if i % 2 else "b"
        for pub in _pubs(node.values(device, {"x": i}, {}, T0 + 10 + i)):
            seqs.append(PB.FromString(pub.payload).seq)
    for pub in _pubs(node.device_offline("a", T0 + 999)):
        seqs.append(psp.DDeath.decode(pub.payload).seq)
    assert len(seqs) == 302
    assert seqs == [i % 256 for i in range(302)]


def test_tck_id_topics_dbirth_before_ddata_with_every_metric() -> None:
    """[tck-id-topics-dbirth-metric-reqs] / [tck-id-topics-dbirth-metrics]: a device's DBIRTH comes before any
    DDATA of it, with every metric: name, alias, datatype, current value (is_null until read,
    [tck-id-operational-behavior-data-publish-dbirth-values]), units as the engUnit property."""
    node = _node()
    specs = [register_metric_spec for register_metric_spec in (
        MetricSpec("voltage", DataType.Float, "V"), MetricSpec("demand_period", DataType.Float, "min", True))]
    node.declare("meter-1", specs)
    _session(node)
    out = _pubs(node.values("meter-1", {"voltage": 230.1}, {"voltage": "V"}, T0 + 5))
    assert [p.topic.split("/")[2] for p in out] == ["DBIRTH"]
    dbirth = psp.DBirth.decode(out[0].payload)
    metrics = _metrics(dbirth)
    assert metrics["voltage"].datatype is psp.DataType.FLOAT
    assert metrics["voltage"].value == pytest.approx(230.1, rel=1e-7)
    assert metrics["demand_period"].is_null
    assert {m.alias for m in dbirth.metrics} == {1, 2}
    raw = PB.FromString(out[0].payload)  # pysparkplug's Metric leaves properties out
    props = {m.name: dict(zip(m.properties.keys, (v.string_value or v.boolean_value for v in m.properties.values)))
             for m in raw.metrics}  # fmt: skip
    assert props["voltage"] == {"engUnit": "V", "readOnly": True}
    assert props["demand_period"] == {"engUnit": "min", "readOnly": False}


def test_tck_id_topics_ddata_payload_report_by_exception_by_alias() -> None:
    """[tck-id-topics-ddata-payload]: DDATA carries only what changed since the DBIRTH or last DDATA;
    [tck-id-payloads-alias-data-cmd-requirement]: by alias, without the name; nothing when nothing changed."""
    node = _node()
    _session(node)
    dbirth = psp.DBirth.decode(_pubs(node.values("m", {"a": 1, "b": 2.5}, {}, T0 + 5))[0].payload)
    assert _pubs(node.values("m", {"a": 1, "b": 2.5}, {}, T0 + 6)) == []
    out = _pubs(node.values("m", {"a": 1, "b": 3.5}, {}, T0 + 7))
    raw = PB.FromString(out[0].payload)
    assert [(m.HasField("name"), m.HasField("datatype")) for m in raw.metrics] == [(False, False)]
    ddata = psp.DData.decode(out[0].payload, birth=dbirth)
    assert [(m.name, m.value, m.timestamp) for m in ddata.metrics] == [("b", 3.5, T0 + 7)]


def test_tck_id_payloads_alias_uniqueness_and_aliases_stable_across_rebirth() -> None:
    """[tck-id-payloads-alias-uniqueness]: aliases are unique across the Edge Node's metrics; they stay the same
    within a session and across rebirths, so a host's alias map never goes stale."""
    node = _node()
    _session(node)
    first = {}
    for dev in ("a", "b"):
        birth = psp.DBirth.decode(_pubs(node.values(dev, {"x": 1, "y": 2}, {}, T0))[0].payload)
        first.update({(dev, m.name): m.alias for m in birth.metrics})
    assert len(set(first.values())) == 4
    ncmd = encode(Payload(T0, [Metric("Node Control/Rebirth", None, DataType.Boolean, True)]))
    out = _pubs(node.message("spBv1.0/plant-1/NCMD/gw-1", ncmd, T0 + 50))
    again = {}
    for pub in out[1:]:
        dev = pub.topic.split("/")[-1]
        again.update({(dev, m.name): m.alias for m in psp.DBirth.decode(pub.payload).metrics})
    assert again == first


def test_tck_id_operational_behavior_data_commands_rebirth_action() -> None:
    """[tck-id-operational-behavior-data-commands-rebirth-action-2]: a Rebirth request gets NBIRTH and every
    DBIRTH; the seq starts again at 0 ([tck-id-topics-nbirth-seq-num]); [...-rebirth-action-3]: the same bdSeq."""
    node = _node()
    will, _ = _session(node)
    node.values("a", {"x": 1}, {}, T0)
    node.values("b", {"x": 1}, {}, T0)
    node.values("a", {"x": 2}, {}, T0)
    ncmd = encode(Payload(T0, [Metric("Node Control/Rebirth", None, DataType.Boolean, True)]))
    out = _pubs(node.message("spBv1.0/plant-1/NCMD/gw-1", ncmd, T0 + 50))
    assert [p.topic.split("/")[2] for p in out] == ["NBIRTH", "DBIRTH", "DBIRTH"]
    assert [_decode(p).seq for p in out] == [0, 1, 2]
    bd_seq = psp.NDeath.decode(will.payload).bd_seq_metric.value
    assert _metrics(psp.NBirth.decode(out[0].payload))["bdSeq"].value == bd_seq
    after = _pubs(node.values("a", {"x": 3}, {}, T0 + 60))
    assert [(p.topic.split("/")[2], PB.FromString(p.payload).seq) for p in after] == [("DDATA", 3)]


def test_tck_id_operational_behavior_device_ddeath_and_dbirth_on_return() -> None:
    """[tck-id-operational-behavior-device-ddeath]: DDEATH when a device is lost; DBIRTH (not DDATA) when it reports
    again; no DDEATH for a device that was not born."""
    node = _node()
    _session(node)
    node.values("a", {"x": 1}, {}, T0)
    death = _pubs(node.device_offline("a", T0 + 1))
    assert [p.topic for p in death] == ["spBv1.0/plant-1/DDEATH/gw-1/a"]
    assert psp.DDeath.decode(death[0].payload).seq == 2
    assert node.device_offline("a", T0 + 2) == []
    assert node.device_offline("never-seen", T0 + 2) == []
    back = _pubs(node.values("a", {"x": 1}, {}, T0 + 3))
    assert [p.topic.split("/")[2] for p in back] == ["DBIRTH"]


def test_a_new_quantity_or_a_decimal_in_an_integer_metric_births_the_device_again() -> None:
    """[tck-id-operational-behavior-data-publish-dbirth]: the DBIRTH includes every metric the device will send; a
    board that starts sending a new quantity, or a fractional value where it sent whole numbers (Int64), is born
    again with the new set before the value is sent."""
    node = _node()
    _session(node)
    node.values("a", {"n": 3}, {}, T0)
    out = _pubs(node.values("a", {"n": 3.5}, {}, T0 + 1))
    assert [p.topic.split("/")[2] for p in out] == ["DBIRTH"]
    assert _metrics(psp.DBirth.decode(out[0].payload))["n"].datatype is psp.DataType.DOUBLE
    out = _pubs(node.values("a", {"n": 4, "m": 1}, {}, T0 + 2))
    assert [p.topic.split("/")[2] for p in out] == ["DBIRTH"]
    assert set(_metrics(psp.DBirth.decode(out[0].payload))) == {"n", "m"}


def _dcmd(node: EdgeNode, device: str, metrics: list[Metric]) -> list[Any]:
    return node.message(f"spBv1.0/plant-1/DCMD/gw-1/{device}", encode(Payload(T0, metrics)), T0 + 100)


def test_tck_id_operational_behavior_data_commands_dcmd_writes_only_writable_metrics() -> None:
    """[tck-id-operational-behavior-data-commands-dcmd-metric-name] / [...-dcmd-metric-value]: a DCMD by name or by
    alias with a compatible value becomes a write; an unknown or read-only metric, a value that does not fit the
    datatype, an unknown device are refused and counted, nothing is written."""
    node = _node()
    node.declare("meter-1", [MetricSpec("voltage", DataType.Float, "V"),
                             MetricSpec("demand_period", DataType.Float, "min", True)])  # fmt: skip
    _session(node)
    node.values("meter-1", {"voltage": 230.0, "demand_period": 60.0}, {}, T0)
    assert _dcmd(node, "meter-1", [Metric("demand_period", None, DataType.Float, 30.0)]) == [
        WriteMetric("meter-1", "demand_period", 30.0)
    ]
    assert _dcmd(node, "meter-1", [Metric(None, 2, DataType.Double, 15.0, send_datatype=False)]) == [
        WriteMetric("meter-1", "demand_period", 15.0)
    ]
    refused = _dcmd(node, "meter-1", [Metric("voltage", None, DataType.Float, 1.0),
                                      Metric("nope", None, DataType.Float, 1.0),
                                      Metric("demand_period", None, DataType.String, "soon")])  # fmt: skip
    assert [(r.metric, r.reason) for r in refused if isinstance(r, Refused)] == [
        ("voltage", "read_only"), ("nope", "unknown_metric"), ("demand_period", "bad_value")
    ]
    assert len(refused) == 3
    assert _dcmd(node, "ghost", [Metric("x", None, DataType.Float, 1.0)])[0].reason == "unknown_device"
    assert node.message("spBv1.0/plant-1/DCMD/gw-1/meter-1", b"\xff\xff", T0)[0].reason == "bad_payload"
    assert node.refused == {"read_only": 1, "unknown_metric": 1, "bad_value": 1, "unknown_device": 1, "bad_payload": 1}
    # the write done: the value read back goes out in a DDATA at once, even when it did not change
    out = _pubs(node.written("meter-1", "demand_period", 60.0, T0 + 200))
    assert [p.topic.split("/")[2] for p in out] == ["DDATA"]


def test_momentary_board_command_metric_runs_on_true_and_stays_false() -> None:
    """A board command without an argument is a Boolean metric like Node Control/Rebirth: true runs it, its value
    in the DBIRTH stays false, false is no command."""
    node = _node()
    node.declare("buoy", [MetricSpec("Device Control/Reboot", DataType.Boolean, "", True, momentary=True)])
    _session(node)
    birth = psp.DBirth.decode(_pubs(node.values("buoy", {"t": 1.0}, {}, T0))[0].payload)
    assert _metrics(birth)["Device Control/Reboot"].value is False
    reboot = [Metric("Device Control/Reboot", None, DataType.Boolean, True)]
    assert _dcmd(node, "buoy", reboot) == [WriteMetric("buoy", "Device Control/Reboot", True)]
    assert _dcmd(node, "buoy", [Metric("Device Control/Reboot", None, DataType.Boolean, False)]) == []


def _state(node: EdgeNode, online: bool, timestamp: int, host: str = "scada") -> list[Any]:
    body = json.dumps({"online": online, "timestamp": timestamp}).encode()
    return node.message(f"spBv1.0/STATE/{host}", body, T0 + 500)


def test_tck_id_message_flow_edge_node_birth_publish_phid_wait() -> None:
    """[tck-id-message-flow-edge-node-birth-publish-phid-wait] no births before the Primary Host is online;
    [...-phid-wait-id] another host's STATE does not count; [...-phid-wait-online] online must be true;
    [...-phid-wait-timestamp] an older STATE is ignored; [...-phid-offline] a newer offline ends the session with
    an NDEATH and a new CONNECT; a newer online births again."""
    node = _node(primary_host_id="scada")
    assert "spBv1.0/STATE/scada" in node.subscriptions
    _, births = _session(node)
    assert births == []
    assert node.values("a", {"x": 1}, {}, T0) == []
    assert _state(node, True, 100, host="other") == []
    assert _state(node, False, 100) == []
    out = _pubs(_state(node, True, 100))
    assert [p.topic.split("/")[2] for p in out] == ["NBIRTH", "DBIRTH"]
    assert _state(node, False, 99) == []  # older: another session of the host
    ended = _state(node, False, 100)
    assert [type(o) for o in ended] == [Publish, Reconnect]
    assert ended[0].topic == "spBv1.0/plant-1/NDEATH/gw-1"
    node.disconnected()
    _, births = _session(node)
    assert births == []  # still offline
    again = _pubs(_state(node, True, 200))
    assert [p.topic.split("/")[2] for p in again] == ["NBIRTH", "DBIRTH"]
    rebirth = _pubs(_state(node, True, 300))  # the host restarted without us seeing it go
    assert [p.topic.split("/")[2] for p in rebirth] == ["NBIRTH", "DBIRTH"]


def test_nothing_is_published_outside_a_session_and_births_carry_the_latest_values() -> None:
    """Readings while disconnected publish nothing; the births after the next CONNECT carry the latest values
    (so a reconnect never replays stale aliases or values)."""
    node = _node()
    _session(node)
    node.values("a", {"x": 1}, {}, T0)
    node.disconnected()
    assert node.values("a", {"x": 7}, {}, T0 + 1) == []
    _, births = _session(node, T0 + 2)
    assert _metrics(psp.DBirth.decode(births[1].payload))["x"].value == 7
    assert node.stopping()[0].topic == "spBv1.0/plant-1/NDEATH/gw-1"


def test_register_datatypes_and_scaling() -> None:
    """Modbus register types map to Sparkplug datatypes; scale/offset make the value a Double."""
    from firmware_bridge import modbus

    def reg(type_: str, **kw: Any) -> modbus.Register:
        return modbus.Register("r", "holding", 0, type_, modbus.register_count(type_, kw.pop("count", None)), **kw)

    assert register_metric(reg("int16")).datatype is DataType.Int16
    assert register_metric(reg("uint32")).datatype is DataType.UInt32
    assert register_metric(reg("float32")).datatype is DataType.Float
    assert register_metric(reg("float64")).datatype is DataType.Double
    assert register_metric(reg("uint64")).datatype is DataType.UInt64
    assert register_metric(reg("string", count=2)).datatype is DataType.String
    assert register_metric(reg("int16", scale=0.1)).datatype is DataType.Double
    coil = modbus.Register("c", "coil", 0, "bool", 1, writable=True)
    assert (register_metric(coil).datatype, register_metric(coil).writable) == (DataType.Boolean, True)


def test_negative_integers_cross_check_with_pysparkplug() -> None:
    """Int16/Int32 travel in the uint32 field as two's complement of their width; pysparkplug reads them back."""
    metrics = [Metric("a", 1, DataType.Int16, -2), Metric("b", 2, DataType.Int32, -100000),
               Metric("c", 3, DataType.Int64, -5), Metric("d", 4, DataType.UInt64, 2**40 + 7)]  # fmt: skip
    payload = encode(Payload(T0, metrics, 0))
    assert [m.value for m in psp.NBirth.decode(payload).metrics] == [-2, -100000, -5, 2**40 + 7]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("", "sparkplug.group_id: required"),
        ('group_id = "a/b"', "sparkplug.group_id = 'a/b': must be 1..64 characters without +, /, #"),
        ('group_id = "g"\nedge_node_id = "n+"', "sparkplug.edge_node_id = 'n+'"),
        ('group_id = "g"\nqos = 2', "sparkplug.qos = 2: must be an integer 0..1"),
        ('group_id = "g"\ndevices = "buoy"', "sparkplug.devices = 'buoy': must be an array"),
        ('group_id = "g"\ncolour = 1', "sparkplug.colour: unknown key"),
        ('group_id = "g"\n[[sparkplug.commands]]\ndevice = "b"\nmetric = "m"\ncommand = "Bad"',
         "sparkplug.commands[0].command = 'Bad'"),
    ],
)
def test_config_mistakes_are_named(table: str, message: str) -> None:
    import tomllib

    with pytest.raises(ConfigError) as err:
        load_config(tomllib.loads(f"[bridge]\ngateway_id = 'gw-1'\n[sparkplug]\n{table}\n"))
    assert any(message in line for line in err.value.errors), err.value.errors


def test_config_defaults() -> None:
    cfg = load_config({"bridge": {"gateway_id": "gw-9"}, "sparkplug": {"group_id": "plant-1"}})
    assert cfg.sparkplug is not None
    assert (cfg.sparkplug.edge_node_id, cfg.sparkplug.primary_host_id, cfg.sparkplug.qos) == ("gw-9", None, 1)
    assert cfg.sparkplug.client_id == "firmware-bridge-gw-9-sparkplug"
    assert cfg.sparkplug.selects("anything", "/dev/x")
    assert load_config({}).sparkplug is None
