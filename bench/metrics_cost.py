"""What one Prometheus scrape costs edge-gateway, measured directly rather than as a throughput
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
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import MetricsGateway

from gateway.mqtt.packets import MQTT_5, Connect, Publish, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P


def _clients(port: int, n: int, queued: int) -> list[socket.socket]:
    """``n`` MQTT 5 clients on plain sockets (CONNECT with a Session Expiry Interval, SUBSCRIBE at QoS 1 to a topic
    of their own; replies read and ignored); half of them close, leaving persistent offline sessions, and one
    publisher gives each of those ``queued`` QoS 1 messages. Returns the sockets still open."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(Connect(f"cost-{i}", MQTT_5, True, 600, properties={P.SESSION_EXPIRY_INTERVAL: 3600}).encode(MQTT_5)
                  + Subscribe(1, [Subscription(f"cost/{i}", 1)]).encode(MQTT_5))
        socks.append(s)
    for s in socks:  # CONNACK + SUBACK
        s.settimeout(10)
        got = b""
        while len(got) < 2 or len(got) < _length(got):
            got += s.recv(65536)
    for s in socks[0::2]:
        s.close()
    pub = socket.create_connection(("127.0.0.1", port))
    pub.settimeout(10)
    pub.sendall(Connect("cost-pub", MQTT_5, True, 600).encode(MQTT_5))
    connack = pub.recv(2)
    _read(pub, connack[1])
    pid = 0
    for i in range(0, n, 2):  # one topic's messages at a time, then their PUBACKs (4 bytes each): within the window
        batch = b""
        for _ in range(queued):
            pid = pid % 65535 + 1
            batch += Publish(f"cost/{i}", b"x" * 64, 1, False, False, pid).encode(MQTT_5)
        pub.sendall(batch)
        _read(pub, 4 * queued)
    time.sleep(0.5)
    return [*socks[1::2], pub]


def _read(s: socket.socket, n: int) -> None:
    """Read and drop exactly ``n`` bytes."""
    while n:
        got = s.recv(n)
        if not got:
            raise ConnectionError("the broker closed the connection")
        n -= len(got)


def _length(data: bytes) -> int:
    """Bytes of the CONNACK (4 + properties) and SUBACK at the start of ``data``: enough to know both arrived."""
    first = 2 + data[1]
    return first + 2 + (data[first + 1] if len(data) > first + 1 else 255)


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
        text = urllib.request.urlopen(url, timeout=10).read()
        size = len(text)
        wanted = (b"edge_gateway_sessions{", b"edge_gateway_messages_queued ", b"edge_gateway_connections ")
        shown = [line.decode() for line in text.splitlines() if line.startswith(wanted)]
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
              f"queued each); scrape {size:,} bytes: {', '.join(shown)}")
        print(f"{args.scrapes} scrapes in {wall:.2f} s: broker CPU {busy:.2f} s, idle baseline {idle:.2f} s "
              f"-> {per * 1e3:.2f} ms per scrape")
        print(f"a scrape every 1 s: {per:.2%} of a core; every 15 s: {per / 15:.3%}")
        for c in live:
            c.close()
    finally:
        b.stop()
        b.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
