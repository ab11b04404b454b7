"""`make demo`, the cloud side: a second broker on 127.0.0.1:1884 standing in for the cloud (Mosquitto where it is
installed, else a second edge-gateway), the gateway's upstream link to it, and what arrives "in the cloud".

Usage: ``python demo/cloud.py -- COMMAND...`` runs COMMAND (the local demo: broker, simulated board,
firmware-bridge) with ``EDGE_GATEWAY_CONFIG`` pointing at var/demo/gateway.toml: the embedded default (127.0.0.1:1883,
store in ./var) plus ``gateway_id = "gw-demo"`` and an ``[[upstream]]`` forwarding ``sensors/#`` and
``bridge/#`` to the cloud and bringing ``cmd/gw-demo/#`` down. It prints the readings the cloud receives (with their
``msg_id``) and every change of the link state (``$SYS/broker/connection/cloud/...``).

``kill -USR1 <pid>`` (the pid is printed at start) takes the cloud down and brings it back: watch the link back
off, the backlog build up, and drain (paced) once the cloud is back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLOUD_PORT = 1884
GATEWAY_ID = "gw-demo"
DEMO = ROOT / "var" / "demo"

GATEWAY_TOML = f"""# written by demo/cloud.py: the embedded default plus an upstream link to the stand-in cloud
[broker]
gateway_id = "{GATEWAY_ID}"
sys_interval = "5s"
[store]
path = "var"
[listeners.external]
bind = "127.0.0.1:1883"

[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{CLOUD_PORT}"
drain_rate = 20                  # slow on purpose: watch a backlog drain after you stop and restart the cloud
backoff_max = "5s"
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{topic}}"
qos = 1
[[upstream.forward]]
local = "bridge/#"
remote = "fleet/{{topic}}"
qos = 1
[[upstream.subscribe]]
remote = "cmd/{{gateway_id}}/#"
local = "{{topic}}"
qos = 1
"""

CLOUD_TOML = f"""# written by demo/cloud.py: a second edge-gateway standing in for the cloud (no Mosquitto installed)
[store]
path = "cloud-store"
[listeners.external]
bind = "127.0.0.1:{CLOUD_PORT}"
"""


def _say(text: str) -> None:
    try:
        sys.stdout.write(text + "\n")  # one write: lines stay whole next to the local demo's output
        sys.stdout.flush()
    except OSError:
        pass


def start_cloud() -> tuple[subprocess.Popen[bytes], str]:
    """Mosquitto on 127.0.0.1:1884 if installed, else ``edge-gateway serve`` there."""
    mosquitto = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if mosquitto:
        conf = DEMO / "cloud-mosquitto.conf"
        user = "user root\n" if os.geteuid() == 0 else ""  # as root it would switch to "mosquitto" (no access here)
        conf.write_text(
            f"{user}listener {CLOUD_PORT} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {DEMO}/\n"
        )
        cmd, what = [mosquitto, "-c", str(conf)], "Mosquitto"
    else:
        conf = DEMO / "cloud.toml"
        conf.write_text(CLOUD_TOML)
        cmd, what = [str(BIN / "edge-gateway"), "serve", "--config", str(conf)], "a second edge-gateway"
    proc = subprocess.Popen(cmd, cwd=DEMO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, what


def _reading(msg: mqtt.MQTTMessage) -> str:
    users = dict(getattr(msg.properties, "UserProperty", []) or [])
    try:
        data = json.loads(msg.payload)
    except ValueError:
        return msg.payload.decode(errors="replace")
    if isinstance(data, dict) and "values" in data:
        values = "  ".join(f"{k} {v['value']} {v['unit']}" for k, v in data["values"].items())
        return f"boot {data.get('boot')} seq {data.get('seq'):<4} {values}  msg_id={users.get('msg_id')}"
    return f"{json.dumps(data)[:100]}  msg_id={users.get('msg_id')}"


def watch(cloud_what: str) -> list[mqtt.Client]:
    """A subscriber in the cloud (fleet/#, a persistent session: what arrives while it reconnects is kept for it)
    and one on the gateway ($SYS link state); both reconnect by themselves."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    cloud = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "demo-cloud-viewer", protocol=mqtt.MQTTv5)
    cloud.reconnect_delay_set(0.1, 1)
    cloud.on_connect = lambda c, *a: c.subscribe("fleet/#", 1)
    cloud.on_message = lambda c, u, m: _say(f"  [cloud] {m.topic}  {_reading(m)}")
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    cloud.connect_async("127.0.0.1", CLOUD_PORT, clean_start=False, properties=props)
    cloud.loop_start()
    link = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "demo-link-viewer", protocol=mqtt.MQTTv5)
    link.reconnect_delay_set(0.1, 1)
    link.on_connect = lambda c, *a: c.subscribe("$SYS/broker/connection/cloud/#", 0)
    shown = {"state", "backlog/messages", "dropped"}
    last: dict[str, str] = {}

    def on_link(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        key = m.topic.rsplit("cloud/", 1)[1]
        value = m.payload.decode()
        if (key in shown or key == "warning") and last.get(key) != value:
            last[key] = value
            _say(f"  [link]  {key} = {value}")

    link.on_message = on_link
    link.connect_async("127.0.0.1", 1883)
    link.loop_start()
    _say(
        f"the cloud: {cloud_what} on 127.0.0.1:{CLOUD_PORT}; readings arriving there are printed as [cloud], the "
        "upstream link state as [link]"
    )
    return [cloud, link]


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: demo/cloud.py -- COMMAND...", file=sys.stderr)
        return 2
    DEMO.mkdir(parents=True, exist_ok=True)
    (DEMO / "gateway.toml").write_text(GATEWAY_TOML)
    state = {"cloud": start_cloud()}
    cloud, what = state["cloud"]
    viewers: list[mqtt.Client] = []
    inner: subprocess.Popen[bytes] | None = None

    def toggle(signum: int, frame: Any) -> None:
        proc = state["cloud"][0]
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
            _say("  [demo]  the cloud is DOWN (kill -USR1 again to bring it back)")
        else:
            state["cloud"] = start_cloud()
            _say("  [demo]  the cloud is back")

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, toggle)
    try:
        time.sleep(0.3)
        if cloud.poll() is not None:
            print(f"the cloud broker did not start (is 127.0.0.1:{CLOUD_PORT} in use?)", file=sys.stderr)
            return 1
        _say(
            f"started the stand-in cloud ({what}); the gateway uses {DEMO / 'gateway.toml'}; "
            f"kill -USR1 {os.getpid()} takes the cloud down and back up"
        )
        viewers = watch(what)
        env = dict(os.environ, EDGE_GATEWAY_CONFIG=str(DEMO / "gateway.toml"))
        inner = subprocess.Popen(argv, cwd=ROOT, env=env)
        return inner.wait()
    except KeyboardInterrupt:
        if inner is not None:
            try:
                inner.wait(2)  # a Ctrl-C reaches it too; it stops its own children in order
            except subprocess.TimeoutExpired:
                inner.send_signal(signal.SIGINT)  # only this process was interrupted (kill -INT <pid>)
                try:
                    inner.wait(30)
                except subprocess.TimeoutExpired:
                    inner.terminate()
                    inner.wait()
        return 0
    finally:
        for v in viewers:
            v.loop_stop()
            v.disconnect()
        cloud = state["cloud"][0]
        if cloud.poll() is None:
            cloud.terminate()
            try:
                cloud.wait(10)
            except subprocess.TimeoutExpired:
                cloud.kill()
                cloud.wait()
        _say("  cloud stopped")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
