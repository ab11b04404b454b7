"""Where the CPU of a durable QoS 1 publish goes: the event-loop thread vs the LMDB writer thread, in process.

    .venv/bin/python bench/durable_cpu.py [--messages 50000] [--in-flight 64] [--profile]

The offline scenario of ``bench/run.py`` without sockets. A persistent subscriber is offline, and one publisher's
PUBLISH packets go into ``Broker.receive`` ``--in-flight`` at a time. Each batch runs until its PUBACKs are
produced, which means its store commit is done. The printout gives microseconds of CPU per message: for the loop
thread (decode, route, queue, record, acknowledge) and for the writer (everything else in the process: applying
the changes, and LMDB's commit with its two fdatasyncs). It splits the writer's part into applying and committing,
and gives the messages per commit. Run it pinned (``taskset -c 0``) for steady figures.
``--profile`` adds a cProfile table of the loop thread.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.mqtt.packets import Connect, Publish, Subscribe, Subscription
from gateway.store.lmdb_store import LmdbStore, StoreSettings


class NullTransport:
    """Takes what the broker writes and drops it."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--in-flight", type=int, default=64, help="PUBLISHes per batch (at most 100: max_awaiting_rel)")
    ap.add_argument("--profile", action="store_true", help="cProfile the loop thread (slows it down)")
    args = ap.parse_args()
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as tmp:
        store = LmdbStore(StoreSettings(path=tmp))
        broker = Broker(BrokerSettings(sys_interval=0), store, now=time.time())
        store.attach(loop)
        limits = ZoneLimits(max_mqueue_len=0, message_expiry_interval=0)

        async def settle() -> None:
            while store.pending():
                done = loop.create_future()
                store.when_durable(lambda f=done: f.done() or f.set_result(None))
                await done

        def send(conn: Any, *packets: Any) -> None:
            broker.receive(conn, b"".join(p.encode(4) for p in packets), time.time())
            loop.run_until_complete(settle())

        sub = broker.open(limits, "bench", "sub", time.time())
        sub.transport = NullTransport()
        send(sub, Connect(client_id="sub", clean_start=False, keep_alive=60), Subscribe(1, [Subscription("b/#", 1)]))
        broker.connection_lost(sub, time.time())
        pub = broker.open(limits, "bench", "pub", time.time())
        pub.transport = NullTransport()
        send(pub, Connect(client_id="pub", keep_alive=60))
        batch = b"".join(Publish("b/off/p1", b"x" * 64, 1, packet_id=i + 1).encode(4) for i in range(args.in_flight))
        rounds = args.messages // args.in_flight
        acc = {"apply": 0.0, "commit": 0.0}
        apply, commit = store._apply, store._commit

        def timed_apply(txn: Any, ops: Any) -> None:
            t = time.thread_time()
            apply(txn, ops)
            acc["apply"] += time.thread_time() - t

        def timed_commit(ops: Any) -> bool:
            t = time.thread_time()
            ok = commit(ops)
            acc["commit"] += time.thread_time() - t
            return ok

        store._apply, store._commit = timed_apply, timed_commit  # type: ignore[method-assign]
        commits0 = store.commits
        profile = cProfile.Profile() if args.profile else None
        wall0, loop0, cpu0 = time.perf_counter(), time.thread_time(), os.times()
        if profile is not None:
            profile.enable()
        for _ in range(rounds):
            broker.receive(pub, batch, time.time())
            loop.run_until_complete(settle())
            pub.out.clear()
            broker.dirty.clear()
        if profile is not None:
            profile.disable()
        wall, loop_cpu, cpu1 = time.perf_counter() - wall0, time.thread_time() - loop0, os.times()
        n = rounds * args.in_flight
        process = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        commits = store.commits - commits0
        queued = len(broker.sessions["sub"].mqueue)
        store.close()
    us = 1e6 / n
    print(f"{n} durable QoS 1 messages, {commits} commits ({n / max(1, commits):.0f} messages per commit), "
          f"{queued} queued")
    print(f"  wall            {wall * us:6.2f} us/msg")
    print(f"  loop thread CPU {loop_cpu * us:6.2f} us/msg")
    print(f"  writer CPU      {(process - loop_cpu) * us:6.2f} us/msg: applying changes {acc['apply'] * us:.2f}, "
          f"commit: LMDB, fsync, size check {(acc['commit'] - acc['apply']) * us:.2f} "
          f"({(acc['commit'] - acc['apply']) / max(1, commits) * 1e6:.0f} us per commit)")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
