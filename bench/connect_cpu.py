"""Broker CPU of a connection's life in the core, in process (no sockets): open, CONNECT, CONNACK, DISCONNECT, closed.

    .venv/bin/python bench/connect_cpu.py [--connections 9000] [--level 4]

The core's share of docs/benchmarks.md's connects/s row: ``Broker.open``, a CONNECT (clean session, Keep Alive 60)
through ``Broker.receive`` up to its CONNACK in the returned action, then a DISCONNECT and ``Broker.connection_lost``,
one connection after another, the memory store. The rest of a real connection's cost (accept, the transport, the
socket calls) is the event loop's. For a figure that does not move with the machine's load, count instructions:
``valgrind --tool=callgrind --callgrind-out-file=/dev/null`` over two ``--connections`` counts, the difference
divided by the difference of connections (start-up cancels), as docs/benchmarks.md's "No regression" does;
``PYTHONPATH=OTHER_TREE`` measures another tree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: another tree can be measured

from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.store_port import MemoryStore
from gateway.mqtt.packets import Connect, Disconnect


def run(connections: int, level: int) -> float:
    """Broker CPU microseconds per connection for ``connections`` connections at protocol ``level`` (4 or 5)."""
    broker = Broker(BrokerSettings(sys_interval=0), MemoryStore(), now=time.time())
    limits = ZoneLimits(max_connections=0)
    packets = [Connect(client_id=f"c{i}", keep_alive=60).encode(level) + Disconnect().encode(level)
               for i in range(connections)]
    start = time.process_time()
    for i, data in enumerate(packets):
        now = float(i) / 1000.0
        conn = broker.open(limits, "bench", "peer", now)
        assert broker.receive(conn, data, now)[0].data, "no CONNACK"
        broker.connection_lost(conn, now)
    return (time.process_time() - start) / connections * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=9_000)
    ap.add_argument("--level", type=int, choices=(4, 5), default=4, help="protocol level: 4 = 3.1.1, 5 = 5.0")
    args = ap.parse_args()
    us = run(args.connections, args.level)
    print(f"connect + CONNACK + disconnect: {us:.2f} us of broker CPU per connection (in process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
