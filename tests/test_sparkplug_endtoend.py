"""firmware-bridge as a Sparkplug B Edge Node, end to end: the simulated buoy on a pseudo-terminal and a simulated
Eastron SDM120 on a Modbus RTU line -> firmware-bridge ([sparkplug]) -> the gateway broker -> the upstream link ->
a real Mosquitto standing in for the cloud, where a Sparkplug host application decodes everything with pysparkplug
(an implementation other than the bridge's protobuf code) and sends NCMD/DCMD back down. All real processes and
sockets on 127.0.0.1.

Checked: the host's view of every metric equals the simulators' values; a device unplugged gives DDEATH and a DBIRTH
on return; a Rebirth request is answered; a DCMD changes the meter's writable register (read-only is refused);
seq and bdSeq follow the specification; an upstream outage and a kill -9 of the gateway broker lose nothing the
broker acknowledged (every Sparkplug message a persistent local subscriber got also reached the cloud host), and
the Edge Node is born again with the next bdSeq after the broker comes back.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pysparkplug as psp
from bridge_helpers import BridgeProcess, Collector, free_port, wait_stats
from firmware_bridge import simulator
from firmware_bridge.modbus_sim import ModbusLine, f32, sdm120
from helpers import BrokerProcess, wait_until
from upstream_peers import CloudSubscriber, Mosquitto

GW = "gw-spb"
GROUP = "plant-1"
DATA_TYPES = ("NBIRTH", "DBIRTH", "DDATA", "DDEATH", "NDEATH")
METER = {0x0000: ("voltage", 230.25), 0x0006: ("current", 1.5), 0x0046: ("frequency", 50.0)}


def _gateway_config(port: int, cloud_port: int) -> str:
    forwards = "".join(
        f'[[upstream.forward]]\nlocal = "spBv1.0/{GROUP}/{kind}/{GW}/#"\nremote = "{{topic}}"\nqos = 1\n'
        for kind in DATA_TYPES
    )
    return f"""
[broker]
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:{port}"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{cloud_port}"
backoff_initial = "50ms"
backoff_max = "300ms"
{forwards}
[[upstream.subscribe]]
remote = "spBv1.0/{GROUP}/NCMD/{GW}"
[[upstream.subscribe]]
remote = "spBv1.0/{GROUP}/DCMD/{GW}/+"
"""


def _bridge_config(workdir: Path, port: int, buoy: Path, meter: Path) -> str:
    registers = ", ".join(
        f'{{ name = "{name}", address = "{30001 + address}", type = "float32", unit = "u" }}'
        for address, (name, _) in METER.items()
    )
    return f"""
[bridge]
gateway_id = "{GW}"
stats_interval = "0.1s"
stats_file = "{workdir}/stats.json"
[mqtt]
broker = "127.0.0.1:{port}"
client_id = "fw-spb-{port}"
reconnect_min = "0.05s"
reconnect_max = "0.3s"
[[ports]]
path = "{buoy}"
device = "buoy-b01"
reopen_max = "0.2s"
[[ports]]
path = "{meter}"
protocol = "modbus-rtu"
baudrate = 9600
parity = "none"
stopbits = 2
timeout = "0.2s"
reopen_max = "0.2s"
[[ports.devices]]
name = "meter-1"
unit = 1
[[ports.devices.groups]]
interval = "0.3s"
registers = [{registers}]
[[ports.devices.groups]]
interval = "0.5s"
registers = [{{ name = "demand_period", address = "40013", type = "float32", unit = "min", writable = true }}]
[sparkplug]
group_id = "{GROUP}"
[[sparkplug.commands]]
device = "buoy-b01"
metric = "interval_s"
command = "set_interval"
arg = "seconds"
"""


class Host:
    """The host application's view, rebuilt from what the cloud delivered (births give the aliases)."""

    def __init__(self, sub: CloudSubscriber) -> None:
        self.sub = sub

    def messages(self) -> list[tuple[str, str | None, Any]]:
        """(message type, device, decoded payload) in arrival order."""
        births: dict[str | None, psp.DBirth] = {}
        out: list[tuple[str, str | None, Any]] = []
        with self.sub.lock:
            received = list(self.sub.messages)
        for m in received:
            levels = m.topic.split("/")
            kind, device = levels[2], (levels[4] if len(levels) > 4 else None)
            if kind not in DATA_TYPES:
                continue  # the host's own NCMD/DCMD
            cls = {"NBIRTH": psp.NBirth, "DBIRTH": psp.DBirth, "DDATA": psp.DData, "DDEATH": psp.DDeath,
                   "NDEATH": psp.NDeath}[kind]  # fmt: skip
            payload = cls.decode(m.payload, birth=births.get(device)) if kind == "DDATA" else cls.decode(m.payload)
            if kind == "DBIRTH":
                births[device] = payload
            out.append((kind, device, payload))
        return out

    def view(self, device: str) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for kind, dev, payload in self.messages():
            if dev == device and kind in ("DBIRTH", "DDATA"):
                values.update({m.name: m.value for m in payload.metrics if not m.is_null})
        return values

    def count(self, kind: str, device: str | None = None) -> int:
        return sum(k == kind and d == device for k, d, _ in self.messages())

    def history(self, device: str, name: str) -> list[Any]:
        return [m.value for k, d, p in self.messages() if d == device and k in ("DBIRTH", "DDATA")
                for m in p.metrics if m.name == name]  # fmt: skip


def _command(port: int, topic: str, payload: bytes) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=0).wait_for_publish(5)  # NCMD/DCMD: QoS 0 ([tck-id-topics-ncmd-mqtt])
    finally:
        client.disconnect()
        client.loop_stop()


def _buoy(link: Path, boot: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "firmware_bridge", "simulate", "--link", str(link), "--rate", "10",
             "--boot", str(boot)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _dedup(values: list[float]) -> list[float]:
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_a_sparkplug_host_in_the_cloud_sees_reads_and_commands_the_gateway(tmp_path: Path) -> None:
    cloud = Mosquitto()
    port = free_port()
    (tmp_path / "gw").mkdir()
    gw = BrokerProcess(_gateway_config(port, cloud.port), workdir=str(tmp_path / "gw"))
    meter = sdm120(1)
    for address, (_, value) in METER.items():
        meter.put("input", address, f32(value))
    line = ModbusLine([meter], link=tmp_path / "ttyMETER", baudrate=9600)
    bridge = BridgeProcess(_bridge_config(tmp_path, port, tmp_path / "ttyBUOY", tmp_path / "ttyMETER"),
                           workdir=tmp_path)  # fmt: skip
    stats = tmp_path / "stats.json"
    buoy: subprocess.Popen[bytes] | None = None
    sub: CloudSubscriber | None = None
    local: Collector | None = None
    try:
        cloud.start()
        gw.start()
        line.start()
        buoy = _buoy(tmp_path / "ttyBUOY", 3, tmp_path / "sim.log")
        wait_until(lambda: (tmp_path / "ttyBUOY").is_symlink(), 15, "the buoy's pty")
        sub = CloudSubscriber(cloud.port, [f"spBv1.0/{GROUP}/#"], "scada-host", qos=1).start()
        host = Host(sub)
        local = Collector(port, [f"spBv1.0/{GROUP}/+/{GW}", f"spBv1.0/{GROUP}/+/{GW}/+"], "local-observer", True)
        bridge.start()
        # births, then data: the host's view equals the simulators' values
        wait_until(lambda: host.count("DBIRTH", "meter-1") and host.count("DDATA", "buoy-b01") >= 3, 30,
                   lambda: f"births and data at the host\n{bridge.log()}")  # fmt: skip
        kinds = [(k, d) for k, d, _ in host.messages()]
        assert kinds[0] == ("NBIRTH", None)
        assert kinds.index(("DBIRTH", "buoy-b01")) < kinds.index(("DDATA", "buoy-b01"))
        meter_view = host.view("meter-1")
        for _, (name, value) in METER.items():
            assert meter_view[name] == struct.unpack(">f", struct.pack(">f", value))[0], (name, meter_view)
        assert meter_view["demand_period"] == 60.0  # the SDM120's factory setting
        series = _dedup([v for _, v in simulator.load_b01_series()])
        seen = _dedup(host.history("buoy-b01", "sea_surface_temperature"))
        assert len(seen) >= 2
        assert any(series[i : i + len(seen)] == seen for i in range(len(series))), seen  # the series, in order
        seqs = [p.seq for k, _, p in host.messages() if k != "NDEATH"]
        assert seqs == [i % 256 for i in range(len(seqs))], seqs  # one session so far: 0, 1, 2, ...

        # the buoy unplugged: DDEATH; back: DBIRTH
        _stop(buoy)
        wait_until(lambda: host.count("DDEATH", "buoy-b01") == 1, 20, "DDEATH of the buoy")
        births = host.count("DBIRTH", "buoy-b01")
        buoy = _buoy(tmp_path / "ttyBUOY", 4, tmp_path / "sim.log")
        wait_until(lambda: host.count("DBIRTH", "buoy-b01") == births + 1, 20, "DBIRTH of the buoy again")

        # a Rebirth request from the host: NBIRTH (seq 0) and both DBIRTHs again
        nbirths = host.count("NBIRTH")
        now = psp.get_current_timestamp()
        request = psp.Metric(timestamp=now, name="Node Control/Rebirth", datatype=psp.DataType.BOOLEAN, value=True)
        rebirth = psp.NCmd(timestamp=now, metrics=(request,))
        _command(cloud.port, f"spBv1.0/{GROUP}/NCMD/{GW}", rebirth.encode(include_dtypes=True))
        wait_until(lambda: host.count("NBIRTH") == nbirths + 1, 20, "the NBIRTH answering the Rebirth request")
        wait_until(lambda: host.count("DBIRTH", "meter-1") >= 2, 20, "the meter's DBIRTH after the Rebirth")
        last_nbirth = [p for k, _, p in host.messages() if k == "NBIRTH"][-1]
        assert last_nbirth.seq == 0

        # DCMD: the meter's writable register changes; a read-only one is refused, nothing sent to the bus
        def dcmd(name: str, value: float) -> None:
            now = psp.get_current_timestamp()
            metric = psp.Metric(timestamp=now, name=name, datatype=psp.DataType.FLOAT, value=value)
            payload = psp.DCmd(timestamp=now, metrics=(metric,)).encode(include_dtypes=True)
            _command(cloud.port, f"spBv1.0/{GROUP}/DCMD/{GW}/meter-1", payload)

        dcmd("demand_period", 30.0)
        wait_until(lambda: meter.holding.get(12) == f32(30.0)[0] and meter.holding.get(13) == f32(30.0)[1], 20,
                   "the register written")  # fmt: skip
        wait_until(lambda: host.view("meter-1")["demand_period"] == 30.0, 20, "the written value at the host")
        writes = len(meter.writes)
        dcmd("voltage", 1.0)
        wait_stats(stats, lambda s: s["sparkplug"]["refused"].get("read_only") == 1, 20, "the refusal counted")
        assert len(meter.writes) == writes
        assert host.view("meter-1")["voltage"] != 1.0

        # an upstream outage, then kill -9 of the gateway broker: nothing acknowledged is lost
        bd_seq = [p for k, _, p in host.messages() if k == "NBIRTH"][-1].metrics
        bd_before = next(m.value for m in bd_seq if m.name == "bdSeq")
        before_outage = len(local.messages)
        cloud.stop()
        published = wait_stats(stats, lambda s: s["sparkplug"]["published"] > 0, 10)["sparkplug"]["published"]
        wait_stats(stats, lambda s: s["sparkplug"]["published"] >= published + 20, 30, "data during the outage")
        cloud.start()
        wait_stats(stats, lambda s: s["sparkplug"]["published"] >= published + 40, 30, "more data")
        gw.kill()
        gw.start()

        def reborn() -> bool:
            bd_seqs = [m.value for k, _, p in host.messages() if k == "NBIRTH" for m in p.metrics if m.name == "bdSeq"]
            return any(b != bd_before for b in bd_seqs)

        wait_until(reborn, 40, "the Edge Node born again with the next bdSeq after the restart")

        def lost() -> list[str]:
            assert sub is not None and local is not None
            with sub.lock:
                at_host = {(m.topic, bytes(m.payload)) for m in sub.messages}
            acked = [(m.topic, bytes(m.payload)) for m in list(local.messages) if m.topic.split("/")[2] in DATA_TYPES]
            return [topic for topic, payload in acked if (topic, payload) not in at_host]

        wait_until(lambda: not lost(), 40, lambda: f"{len(lost())} acknowledged message(s) never reached the host")
        assert len(local.messages) >= before_outage + 20  # what the bridge published during the outage is in there
        assert bridge.running
    finally:
        code = bridge.stop() if bridge.proc is not None else 0
        if buoy is not None:
            _stop(buoy)
        line.stop()
        for client in (local, sub):
            if client is not None:
                client.close()
        gw.stop()
        cloud.cleanup()
    assert code == 0, bridge.log()
    assert "Traceback" not in bridge.log(), bridge.log()
