"""Broker CPU per message of a QoS 0, 1 or 2 flow end to end, in process (no sockets): the sans-I/O core alone.

    .venv/bin/python bench/flow_cpu.py [--qos 2] [--messages 64000] [--in-flight 32] [--profile]

One publisher and one subscriber, clean sessions, the memory store (as the ``fanin`` (one publisher), ``qos1``
and ``qos2`` scenarios of ``bench/run.py``). The publisher's PUBLISH packets go into ``Broker.receive``
``--in-flight`` at a time, and both clients answer everything the broker wrote in one read each (PUBREL for each
PUBREC; PUBACK, or PUBREC then PUBCOMP, for each delivery; nothing for QoS 0), until the flows of the batch are
complete. The clients' own work (decoding what the broker wrote,
encoding their answers) is timed apart and left out. CPU time of the process (``time.process_time``), so the
figure means the same on a loaded machine, give or take cache effects; run it pinned (``taskset -c 1``) and
interleave runs of two trees (``PYTHONPATH=OTHER_TREE``) to compare code. For a figure that does not move with
the machine's load, count instructions instead: ``valgrind --tool=callgrind --callgrind-out-file=/dev/null`` over
two ``--messages`` counts, the difference divided by the difference of messages (start-up cancels; clients
included), as docs/benchmarks.md's "No regression" of 2026-11-27 does.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: another tree can be measured

from gateway.broker.actions import Action
from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.store_port import MemoryStore
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Connect, PubAck, PubComp, Publish, PubRec, PubRel, Subscribe, Subscription


def run(qos: int, messages: int, in_flight: int, profile: bool) -> float:
    """Broker CPU microseconds per message for ``messages`` QoS ``qos`` messages end to end."""
    broker = Broker(BrokerSettings(sys_interval=0), MemoryStore(), now=time.time())
    limits = ZoneLimits(max_connections=0)
    sub = broker.open(limits, "bench", "sub", 0.0)
    broker.receive(sub, Connect(client_id="sub").encode(4) + Subscribe(1, [Subscription("t/#", qos)]).encode(4), 0.0)
    pub = broker.open(limits, "bench", "pub", 0.0)
    broker.receive(pub, Connect(client_id="pub").encode(4), 0.0)
    pub_out: list[bytes] = []  # what the broker's actions wrote to each client, as the I/O layer buffers it
    sub_out: list[bytes] = []

    def keep(actions: list[Action]) -> None:
        for action in actions:
            (pub_out if action.conn is pub else sub_out).extend(action.data)

    sub_reader, pub_reader = PacketReader(), PacketReader()
    rounds = messages // in_flight
    batches = [b"".join(Publish("t/a", b"x" * 64, qos, packet_id=(r * in_flight + i) % 65000 + 1 if qos else None)
                        .encode(4) for i in range(in_flight)) for r in range(rounds)]
    clients = 0.0
    profiler = cProfile.Profile() if profile else None
    start = time.process_time()
    if profiler is not None:
        profiler.enable()
    for batch in batches:
        keep(broker.receive(pub, batch, 0.0))
        while True:
            t = time.process_time()
            to_pub, to_sub = b"".join(pub_out), b"".join(sub_out)
            pub_out.clear()
            sub_out.clear()
            from_pub = b"".join(PubRel(p.packet_id).encode(4) for p in pub_reader.feed(to_pub) if isinstance(p, PubRec))
            answers = []
            for p in sub_reader.feed(to_sub):
                if isinstance(p, Publish) and qos:  # QoS 0: nothing to answer
                    answers.append((PubAck(p.packet_id) if qos == 1 else PubRec(p.packet_id)).encode(4))
                elif isinstance(p, PubRel):
                    answers.append(PubComp(p.packet_id).encode(4))
            from_sub = b"".join(answers)
            clients += time.process_time() - t
            if not from_pub and not from_sub:
                break
            if from_pub:
                keep(broker.receive(pub, from_pub, 0.0))
            if from_sub:
                actions = broker.receive(sub, from_sub, 0.0)
                keep(actions)
                while any(action.more for action in actions):  # a long run of PUBACKs, handled in parts
                    actions = broker.resume(sub, 0.0)
                    keep(actions)
    if profiler is not None:
        profiler.disable()
    total = time.process_time() - start - clients
    n = rounds * in_flight
    assert broker.stats.publish_sent >= n, "not every message was delivered"
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    return total / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qos", type=int, choices=(0, 1, 2), default=2)
    ap.add_argument("--messages", type=int, default=64_000)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="cProfile the broker (slows it down; clients included)")
    args = ap.parse_args()
    us = run(args.qos, args.messages, args.in_flight, args.profile)
    print(f"QoS {args.qos} end to end: {us:.2f} us of broker CPU per message (in process, clients left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
