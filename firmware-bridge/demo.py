"""`make demo`: the broker, a simulated sensor board, a simulated Modbus energy meter and firmware-bridge, and the
readings as they arrive.

Runs, all on 127.0.0.1:
  edge-gateway serve                                   the broker on its embedded default (127.0.0.1:1883, ./var)
  firmware-bridge simulate --link var/demo/ttyBUOY0    a buoy replaying NERACOOS B01 sea-surface temperatures
  firmware-bridge simulate --modbus --link var/demo/ttyMETER0
                                                       an Eastron SDM120 meter (Modbus RTU, pymodbus's server)
  firmware-bridge run --config firmware-bridge/demo.toml
and prints what a subscriber to sensors/gw-demo/# and bridge/gw-demo/events receives. Ctrl-C stops everything
(the bridge first, so what it holds reaches the broker, then the boards, then the broker).

``--sparkplug`` (``make demo SPARKPLUG=1``) runs the bridge with a ``[sparkplug]`` table added to demo.toml (Group
``plant-demo``, Edge Node ``gw-demo``) and prints the Sparkplug B messages on spBv1.0/plant-demo/# decoded as well.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LINK = "var/demo/ttyBUOY0"
METER_LINK = "var/demo/ttyMETER0"
SHOW = (" WARNING ", " ERROR ", "ready", "listening on", " open (", "lost", "rebooted", "unreachable", "connected to")


def _spawn(name: str, args: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # Ctrl-C reaches this script only; it stops them in order

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if any(s in line for s in SHOW):
                _say(f"  [{name}] {line.rstrip()}")

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _wait_port(port: int, timeout: float) -> bool:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


SPARKPLUG_TABLE = """
[sparkplug]                       # added by demo.py --sparkplug
group_id = "plant-demo"
[[sparkplug.commands]]
device = "buoy-b01"
metric = "interval_s"
command = "set_interval"
arg = "seconds"
"""


def _on_message(client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
    if msg.topic.startswith("spBv1.0/"):
        from firmware_bridge.sparkplug_payload import decode

        try:
            payload = decode(msg.payload)
        except ValueError:
            _say(f"{msg.topic}  {msg.payload!r}")
            return
        metrics = "  ".join(f"{m.name or '#' + str(m.alias)}={m.value}" for m in payload.metrics)
        _say(f"{msg.topic}  seq {payload.seq}  {metrics}")
        return
    try:
        data = json.loads(msg.payload)
    except ValueError:
        _say(f"{msg.topic}  {msg.payload!r}")
        return
    if "values" in data:
        values = "  ".join(f"{k} {v['value']} {v['unit']}" for k, v in data["values"].items())
        _say(f"{msg.topic}  boot {data['boot']} seq {data['seq']:<4} {data['sensor_time']}  {values}")
    else:
        detail = {k: v for k, v in data.items() if k not in ("v", "gateway_id", "gateway_time")}
        _say(f"{msg.topic}  {json.dumps(detail)}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    (ROOT / "var" / "demo").mkdir(parents=True, exist_ok=True)
    config = "firmware-bridge/demo.toml"
    sparkplug = "--sparkplug" in sys.argv[1:]
    if sparkplug:
        config = "var/demo/bridge-sparkplug.toml"
        (ROOT / config).write_text((ROOT / "firmware-bridge/demo.toml").read_text() + SPARKPLUG_TABLE)
    procs: list[tuple[str, subprocess.Popen[str]]] = []
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    signal.signal(signal.SIGTERM, _interrupt)
    sub: mqtt.Client | None = None
    try:
        print("starting the broker (127.0.0.1:1883, store in ./var) ...", flush=True)
        procs.append(("broker", _spawn("broker", [str(BIN / "edge-gateway"), "serve"])))
        if not _wait_port(1883, 15):
            print("the broker did not start (is 127.0.0.1:1883 already in use?)", file=sys.stderr)
            return 1
        print(f"starting the simulated buoy on a pseudo-terminal ({LINK}) ...", flush=True)
        procs.append(
            (
                "board",
                _spawn(
                    "board",
                    [
                        str(BIN / "firmware-bridge"),
                        "simulate",
                        "--link",
                        LINK,
                        "--rate",
                        "2",
                        "--garbage",
                        "0.05",
                        "--bad-crc",
                        "0.03",
                        "--reboot-every",
                        "45",
                    ],
                ),
            )
        )
        print(f"starting the simulated Modbus RTU energy meter ({METER_LINK}) ...", flush=True)
        procs.append(
            (
                "meter",
                _spawn(
                    "meter",
                    [str(BIN / "firmware-bridge"), "simulate", "--modbus", "--link", METER_LINK, "--rate", "2"],
                ),
            )
        )
        deadline = time.monotonic() + 15
        while not all((ROOT / p).is_symlink() for p in (LINK, METER_LINK)) and time.monotonic() < deadline:
            time.sleep(0.05)
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        sub.on_message = _on_message
        sub.connect("127.0.0.1", 1883)
        topics = [("sensors/gw-demo/#", 1), ("bridge/gw-demo/events", 1)]
        sub.subscribe([*topics, ("spBv1.0/plant-demo/#", 0)] if sparkplug else topics)
        sub.loop_start()
        print(f"starting firmware-bridge ({config}) ...  Ctrl-C stops everything\n", flush=True)
        procs.append(("bridge", _spawn("bridge", [str(BIN / "firmware-bridge"), "run", "--config", config])))
        while all(p.poll() is None for _, p in procs):
            time.sleep(0.2)
        for name, p in procs:
            if p.poll() is not None:
                print(f"{name} exited with code {p.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for _, proc in reversed(procs):  # bridge, board, broker: stop them before anything can go wrong printing
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for name, proc in reversed(procs):
            _say(f"  {name} stopped (exit code {proc.returncode})")
        if sub is not None:
            sub.loop_stop()
            sub.disconnect()


def _say(text: str) -> None:
    try:
        print(text, flush=True)
    except OSError:  # stdout gone (a closed pipe): keep stopping the children
        pass


if __name__ == "__main__":
    sys.exit(main())
