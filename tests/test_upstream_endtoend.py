"""The main job end to end: a simulated buoy on a pseudo-terminal -> firmware-bridge -> the gateway ->
the upstream link -> a real Mosquitto standing in for the cloud; and a command from the cloud -> the gateway ->
firmware-bridge -> the board, whose reply goes back up. All real subprocesses on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as mqtt
from helpers import BrokerProcess
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from upstream_peers import CloudSubscriber, Mosquitto, wait_until

GW = "gw-e2e"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_readings_reach_the_cloud_and_cloud_commands_reach_the_board(make_broker, tmp_path: Path, uid: str) -> None:
    """docs/message-format.md: readings on sensors/<gateway_id>/<device> arrive in the cloud byte for byte with a
    msg_id; downlink commands from the cloud reach the local topic (and, through firmware-bridge, the simulated
    board, docs/upstream.md): a ping from the cloud is answered by the board and the reply comes back to the cloud."""
    cloud = Mosquitto().start()
    procs: list[subprocess.Popen[bytes]] = []
    sub: CloudSubscriber | None = None
    ops: mqtt.Client | None = None
    try:
        gw: BrokerProcess = make_broker(f"""
[broker]
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{cloud.port}"
backoff_initial = "50ms"
backoff_max = "300ms"
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{topic}}"
[[upstream.forward]]
local = "cmd/{GW}/+/reply"
remote = "{{topic}}"
[[upstream.subscribe]]
remote = "cmd/{{gateway_id}}/#"
""")
        sub = cloud_sub = CloudSubscriber(cloud.port, ["fleet/#", f"cmd/{GW}/+/reply"], f"cloud-{uid}").start()
        tty = tmp_path / "ttyBUOY"
        log = open(tmp_path / "sim.log", "wb")  # noqa: SIM115 (closed below)
        try:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "firmware_bridge", "simulate", "--link", str(tty), "--rate", "20"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        finally:
            log.close()
        assert wait_until(tty.is_symlink, 15)
        (tmp_path / "bridge.toml").write_text(f"""
[bridge]
gateway_id = "{GW}"
[mqtt]
broker = "127.0.0.1:{gw.port}"
client_id = "fw-{uid}"
reconnect_min = "0.05s"
reconnect_max = "0.5s"
[[ports]]
path = "{tty}"
device = "buoy-b01"
reopen_max = "0.2s"
""")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "firmware_bridge", "run", "--config", str(tmp_path / "bridge.toml")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        topic = f"fleet/sensors/{GW}/buoy-b01"
        assert wait_until(lambda: len(cloud_sub.on(topic)) >= 5, 30), (gw.log(), cloud.log())
        readings = [json.loads(m.payload) for m in cloud_sub.on(topic)]
        assert {r["gateway_id"] for r in readings} == {GW}
        assert {r["device"] for r in readings} == {"buoy-b01"}
        seqs = [(r["boot"], r["seq"]) for r in readings]
        assert seqs == sorted(seqs)
        assert "sea_surface_temperature" in readings[0]["values"]
        assert all(m.msg_id and m.msg_id.startswith(f"{GW}:") for m in cloud_sub.on(topic))

        ops = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, f"ops-{uid}", protocol=mqtt.MQTTv5)
        ops.connect("127.0.0.1", cloud.port)
        ops.loop_start()
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = b"req-1"
        ops.publish(f"cmd/{GW}/buoy-b01/ping", b"{}", 1, properties=props).wait_for_publish(10)
        reply_topic = f"cmd/{GW}/buoy-b01/reply"
        assert wait_until(lambda: len(cloud_sub.on(reply_topic)) == 1, 30), gw.log()
        reply = json.loads(cloud_sub.on(reply_topic)[0].payload)
        assert reply["ok"] is True
        assert reply["data"] == {"pong": True}
        assert reply["device"] == "buoy-b01"
    finally:
        if ops is not None:
            ops.disconnect()
            ops.loop_stop()
        for proc in reversed(procs):
            _stop(proc)
        if sub is not None:
            sub.close()
        cloud.cleanup()
