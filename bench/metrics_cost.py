"""What one Prometheus scrape costs edge-gateway (issue 18), measured directly rather than as a throughput
difference: broker CPU seconds (utime + stime of all its threads, /proc/PID/stat) per scrape of ``/metrics``,
with ``--clients`` connected clients, each with a subscription and ``--queued`` QoS 1 messages queued for half of
them (the collector takes one pass over the sessions on the event loop per scrape).

    .venv/bin/python bench/metrics_cost.py [--clients 1000] [--queued 10] [--scrapes 300]

Prints the broker's CPU per scrape (ms) with the idle baseline (the same wall time without scrapes) subtracted,
the size of a scrape, and what a scrape every second and every 15 s (Prometheus' default) costs as a fraction of
one core. The broker runs as bench/brokers.py starts it (pinned to core 0 when there are two).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import MetricsGateway


def _clients(port: int, n: int, queued: int) -> list[mqtt.Client]:
    """``n`` MQTT 5 clients, each subscribed at QoS 1 to its own topic; half disconnect with a persistent session
    and get ``queued`` QoS 1 messages each (offline queues for the collector to walk)."""
    clients = []
    for i in range(n):
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"cost-{i}", protocol=mqtt.MQTTv5)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", port, keepalive=600, properties=props)
        c.loop_start()
        c.subscribe(f"cost/{i}", 1)
        clients.append(c)
    time.sleep(1.0)
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="cost-pub", protocol=mqtt.MQTTv5)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    for i in range(0, n, 2):
        clients[i].disconnect()
        clients[i].loop_stop()
    time.sleep(0.5)
    for i in range(0, n, 2):
        for _ in range(queued):
            pub.publish(f"cost/{i}", b"x" * 64, 1).wait_for_publish(10)
    return [*clients[1::2], pub]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--queued", type=int, default=10)
    ap.add_argument("--scrapes", type=int, default=300)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="metrics-cost-"))
    b = MetricsGateway(tmp / "gw", interval=3600.0)  # its own scraper stays quiet: this script scrapes
    try:
        target = b.start()
        url = b.metrics_url
        live = _clients(target.port, args.clients, args.queued)
        time.sleep(1.0)
        size = len(urllib.request.urlopen(url, timeout=10).read())
        # baseline: the same wall time, no scrapes
        t0, c0 = time.monotonic(), b.cpu_seconds()
        for _ in range(args.scrapes):
            urllib.request.urlopen(url, timeout=10).read()
        wall = time.monotonic() - t0
        busy = b.cpu_seconds() - c0
        c1 = b.cpu_seconds()
        time.sleep(wall)
        idle = b.cpu_seconds() - c1
        per = (busy - idle) / args.scrapes
        print(f"clients {args.clients} ({args.clients // 2} online, {args.clients // 2} offline with {args.queued} "
              f"queued each); scrape {size:,} bytes")
        print(f"{args.scrapes} scrapes in {wall:.2f} s: broker CPU {busy:.2f} s, idle baseline {idle:.2f} s "
              f"-> {per * 1e3:.2f} ms per scrape")
        print(f"a scrape every 1 s: {per:.2%} of a core; every 15 s: {per / 15:.3%}")
        for c in live:
            c.disconnect()
            c.loop_stop()
    finally:
        b.stop()
        b.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
