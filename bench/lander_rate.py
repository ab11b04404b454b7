"""The lander's rate (MQTT -> landing files) beside the gateway's forwarded rate, against a real Mosquitto on
127.0.0.1 standing in for the cloud broker, with one ``fleet-pipeline land`` subscribed to ``fleet/+/+``:

- ``lander``: N QoS 1 envelopes published straight to Mosquitto by one paho client as fast as it goes; messages/s
  published and landed (fsynced, renamed, acknowledged);
- ``gateway``: N QoS 1 envelopes published to an ``edge-gateway`` whose upstream link forwards ``sensors/#`` to
  Mosquitto (``fleet/{gateway_id}/{suffix}``, live, so ``drain_rate`` does not pace them); messages/s forwarded
  (seen on Mosquitto by a plain subscriber) and landed by the same lander. The lander keeps up when the two end
  within a roll (``--idle``, 1 s) of each other. A backlog after an outage drains at ``drain_rate`` (200 msgs/s
  by default), well under either.

    .venv/bin/python bench/lander_rate.py [MESSAGES] [--json FILE]   # default 20000; needs Debian's mosquitto

Prints one JSON line per phase and a summary table. Part of ``make bench``. Not a test; stops the broker, the
gateway and the lander it started. Figures: docs/benchmarks.md, "Fleet pipeline throughput".
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import paho.mqtt.client as mqtt  # noqa: E402
from helpers import BrokerProcess  # noqa: E402
from pipeline_fixtures import LanderProcess, Mosquitto  # noqa: E402
from upstream_peers import SysWatcher  # noqa: E402

GATEWAY_ID = "gw-bench"
DRAIN_RATE = 200  # the gateway's default drain_rate (docs/upstream.md)


def _envelope(seq: int) -> str:
    return json.dumps({"v": 1, "gateway_id": GATEWAY_ID, "device": f"d{seq % 4}", "boot": 1, "seq": seq,
                       "sensor_time": None, "gateway_time": "2024-05-01T00:00:00.000Z",
                       "values": {"t": {"value": 1.0, "unit": "C"}}})  # fmt: skip


def _client(port: int, client_id: str, inflight: int = 1000) -> mqtt.Client:
    """A paho MQTT 5 publisher, connected (CONNACK received)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(inflight)
    connected = threading.Event()
    client.on_connect = lambda *a: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(30), f"no CONNACK from 127.0.0.1:{port}"
    return client


def _landed(landing: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in landing.rglob("*.jsonl"))


def _publish(client: mqtt.Client, topic: str, n: int, first_seq: int) -> float:
    """Publish n QoS 1 envelopes as fast as paho goes; returns the seconds until the last PUBACK."""
    t0 = time.monotonic()
    infos = [client.publish(topic.format(i % 4), _envelope(first_seq + i), qos=1) for i in range(n)]
    for info in infos:
        info.wait_for_publish(120)
    return time.monotonic() - t0


def _wait_landed(landing: Path, count: int, t0: float, timeout: float = 300.0) -> tuple[int, float]:
    while (got := _landed(landing)) < count and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return got, time.monotonic() - t0


class Counter:
    """A plain QoS 0 subscriber on Mosquitto: when the n-th forwarded message arrived."""

    def __init__(self, port: int, topic: str) -> None:
        self.count = 0
        self.last_at = 0.0
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rate-counter", protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(topic, 0)
        assert done.wait(10), "no SUBACK"

    def _on_message(self, *args: Any) -> None:
        with self.lock:
            self.count += 1
            self.last_at = time.monotonic()

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("messages", nargs="?", type=int, default=20_000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    n = args.messages
    work = Path(tempfile.mkdtemp(prefix="lander-rate-"))
    landing = work / "landing"
    broker = Mosquitto(work).start()
    lander = LanderProcess(broker.port, landing, "rate-lander", "--topic", "fleet/+/+").start()
    gateway: BrokerProcess | None = None
    clients: list[Any] = []
    results: list[dict[str, Any]] = []
    try:
        # phase 1: publisher -> Mosquitto -> lander
        pub = _client(broker.port, "rate-pub")
        clients.append(pub)
        t0 = time.monotonic()
        published = _publish(pub, f"fleet/{GATEWAY_ID}/d{{}}", n, 0)
        count, done = _wait_landed(landing, n, t0)
        results.append({"phase": "lander", "messages": n, "landed": count, "publish_s": round(published, 2),
                        "landed_s": round(done, 2), "publish_per_s": round(n / published),
                        "landed_per_s": round(count / done)})  # fmt: skip

        # phase 2: publisher -> edge-gateway -> upstream link -> Mosquitto -> lander
        config = f"""
[broker]
gateway_id = "{GATEWAY_ID}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{broker.port}"
drain_rate = {DRAIN_RATE}
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{gateway_id}}/{{suffix}}"
qos = 1
"""
        (work / "gateway").mkdir()
        gateway = BrokerProcess(config, workdir=str(work / "gateway")).start()
        counter = Counter(broker.port, f"fleet/{GATEWAY_ID}/+")
        clients.append(counter)
        gpub = _client(gateway.port, "rate-gw-pub", 100)
        clients.append(gpub)
        watcher = SysWatcher(gateway.port, "cloud", "rate-sys")
        try:
            assert watcher.wait("state", "connected"), gateway.log()  # the link is up: these messages go live
        finally:
            watcher.close()
        t0 = time.monotonic()
        published = _publish(gpub, "sensors/d{}", n, n)
        count, done = _wait_landed(landing, 2 * n, t0)
        while counter.count < n and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        forwarded_s = counter.last_at - t0
        results.append({"phase": "gateway", "messages": n, "forwarded": counter.count, "landed": count - n,
                        "publish_s": round(published, 2), "forwarded_s": round(forwarded_s, 2),
                        "landed_s": round(done, 2), "publish_per_s": round(n / published),
                        "forwarded_per_s": round(counter.count / forwarded_s),
                        "landed_per_s": round((count - n) / done), "drain_rate": DRAIN_RATE})  # fmt: skip
        load = Path("/proc/loadavg").read_text().split()[:3]
        for r in results:
            r["loadavg"] = load
            print(json.dumps(r))
        g = results[1]
        print(f"\n# lander vs gateway ({n:,} QoS 1 messages each, load {' '.join(load)})")
        print("| path | published msgs/s | forwarded msgs/s | landed msgs/s |")
        print("|---|---|---|---|")
        print(f"| publisher -> Mosquitto -> lander | {results[0]['publish_per_s']:,} | - | "
              f"{results[0]['landed_per_s']:,} |")
        print(f"| publisher -> edge-gateway (live) -> Mosquitto -> lander | {g['publish_per_s']:,} | "
              f"{g['forwarded_per_s']:,} | {g['landed_per_s']:,} |")
        print(f"| edge-gateway backlog after an outage (drain_rate) | - | {DRAIN_RATE:,} | - |")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        return 0 if results[0]["landed"] == n and g["landed"] == n and g["forwarded"] >= n else 1
    finally:
        for c in clients:
            if isinstance(c, Counter):
                c.close()
            else:
                c.loop_stop()
                c.disconnect()
        if gateway is not None:
            gateway.stop()
        lander.stop()
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
