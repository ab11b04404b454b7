"""The lander's rate (MQTT -> landing files): N QoS 1 envelopes published by one paho client as fast as it goes to a
real Mosquitto on 127.0.0.1, one ``fleet-pipeline land`` subscribed; prints messages/s published and landed
(fsynced, renamed, acknowledged) as JSON.

    .venv/bin/python bench/lander_rate.py [MESSAGES]      # default 20000; needs Debian's mosquitto

Not a test; stops the broker and the lander it started. Figures: docs/benchmarks.md, "Fleet pipeline throughput".
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import paho.mqtt.client as mqtt  # noqa: E402
from pipeline_fixtures import LanderProcess, Mosquitto  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    work = Path(tempfile.mkdtemp(prefix="lander-rate-"))
    broker = Mosquitto(work).start()
    lander = LanderProcess(broker.port, work / "landing", "rate-lander", "--topic", "fleet/+/+").start()
    payload = json.dumps({"v": 1, "gateway_id": "gw-1", "device": "d", "boot": 1, "seq": 0, "sensor_time": None,
                          "gateway_time": "2024-05-01T00:00:00.000Z", "values": {"t": {"value": 1.0, "unit": "C"}}})
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="rate-pub", protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(1000)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    try:
        t0 = time.monotonic()
        infos = [client.publish(f"fleet/gw-1/d{i % 4}", payload, qos=1) for i in range(n)]
        for info in infos:
            info.wait_for_publish(60)
        published = time.monotonic() - t0

        def landed() -> int:
            return sum(p.read_bytes().count(b"\n") for p in (work / "landing").rglob("*.jsonl"))

        while landed() < n and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        done, count = time.monotonic() - t0, landed()
        print(json.dumps({"messages": n, "landed": count, "publish_s": round(published, 2),
                          "landed_s": round(done, 2), "publish_per_s": round(n / published),
                          "landed_per_s": round(count / done),
                          "loadavg": Path("/proc/loadavg").read_text().split()[:3]}))  # fmt: skip
        return 0 if count == n else 1
    finally:
        client.loop_stop()
        client.disconnect()
        lander.stop()
        broker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
