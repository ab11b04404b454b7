"""Where the CPU of a durable QoS 1 publish, and of draining the backlog, goes, in process.

    .venv/bin/python bench/durable_cpu.py [--messages 50000] [--in-flight 64] [--drain] [--profile]

The offline scenario of ``bench/run.py`` without sockets. A persistent subscriber is offline, and one publisher's
PUBLISH packets go into ``Broker.receive`` ``--in-flight`` at a time. Each batch runs until its PUBACKs are
produced, which means its store commit is done. The printout gives microseconds of CPU per message: for the loop
thread (decode, route, queue, record, acknowledge) and for the writer (everything else in the process: applying
the changes, and LMDB's commit with its two fdatasyncs). It splits the writer's part into applying and committing,
and gives the messages per commit.

``--drain`` then reconnects the subscriber (Inflight Window 32, as in ``bench/run.py``) and acknowledges, in one
run of PUBACKs per loop turn, whatever the broker wrote since the last turn, until the backlog is delivered: the
same split for reading the queue back, sending, and deleting. The subscriber's own work (parsing what the broker
wrote, making the PUBACKs) is timed apart and left out of the loop thread's figure.

Run it pinned (``taskset -c 0``) for steady figures. ``--profile`` adds a cProfile table of the loop thread (of the
drain with ``--drain``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.broker.actions import Action
from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Connect, PubAck, Publish, Subscribe, Subscription
from gateway.store.lmdb_store import LmdbStore, StoreSettings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--in-flight", type=int, default=64, help="PUBLISHes per batch (at most 100: max_awaiting_rel)")
    ap.add_argument("--drain", action="store_true", help="then drain the backlog with a reconnected subscriber")
    ap.add_argument("--profile", action="store_true", help="cProfile the loop thread (slows it down)")
    ap.add_argument("--lazy-commit", type=float, default=StoreSettings().lazy_commit,
                    help="seconds: the store's lazy_commit (default %(default)s, the store's own). Under valgrind, "
                         "stretch it as valgrind slows the process (0.25): a drain's commits then hold as many "
                         "acknowledgements, and as few Packet Identifier writes, as at full speed")
    args = ap.parse_args()
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as tmp:
        store = LmdbStore(StoreSettings(path=tmp, lazy_commit=args.lazy_commit))
        broker = Broker(BrokerSettings(sys_interval=0), store, now=time.time())
        waiters: list[asyncio.Future[None]] = []

        def batch_done() -> None:
            for f in waiters:
                if not f.done():
                    f.set_result(None)
            waiters.clear()

        store.attach(loop, batch_done)
        # The commit reports go back to the core, as the server's runner passes them (it emits the PUBACKs).
        store.on_committed = lambda barrier: broker.committed(barrier, time.time())
        store.on_failed = lambda barrier, full: broker.failed(barrier, full, time.time())
        limits = ZoneLimits(max_mqueue_len=0, message_expiry_interval=0)

        async def settle() -> None:
            while store.pending():
                done = loop.create_future()
                waiters.append(done)
                await done

        def send(conn: Any, *packets: Any) -> None:
            broker.receive(conn, b"".join(p.encode(4) for p in packets), time.time())
            loop.run_until_complete(settle())

        sub = broker.open(limits, "bench", "sub", time.time())
        send(sub, Connect(client_id="sub", clean_start=False, keep_alive=60), Subscribe(1, [Subscription("b/#", 1)]))
        broker.connection_lost(sub, time.time())
        pub = broker.open(limits, "bench", "pub", time.time())
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
        profile = cProfile.Profile() if args.profile and not args.drain else None
        wall0, loop0, cpu0 = time.perf_counter(), time.thread_time(), os.times()
        if profile is not None:
            profile.enable()
        for _ in range(rounds):
            broker.receive(pub, batch, time.time())
            loop.run_until_complete(settle())  # the PUBACKs: the actions of Broker.committed (not kept)
        if profile is not None:
            profile.disable()
        wall, loop_cpu, cpu1 = time.perf_counter() - wall0, time.thread_time() - loop0, os.times()
        n = rounds * args.in_flight
        process = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        commits = store.commits - commits0
        queued = len(broker.sessions["sub"].mqueue)
        published = dict(acc)
        drained = drain(broker, store, loop, limits, settle, acc, args.profile) if args.drain else None
        store.close()
    us = 1e6 / n
    print(f"{n} durable QoS 1 messages, {commits} commits ({n / max(1, commits):.0f} messages per commit), "
          f"{queued} queued")
    print(f"  wall            {wall * us:6.2f} us/msg")
    print(f"  loop thread CPU {loop_cpu * us:6.2f} us/msg")
    applying, committing = published["apply"], published["commit"] - published["apply"]
    print(f"  writer CPU      {(process - loop_cpu) * us:6.2f} us/msg: applying changes {applying * us:.2f}, "
          f"commit: LMDB, fsync, size check {committing * us:.2f} ({committing / max(1, commits) * 1e6:.0f} us "
          "per commit)")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    if drained is not None:
        print(drained)
    return 0


def drain(broker: Broker, store: LmdbStore, loop: asyncio.AbstractEventLoop, limits: ZoneLimits, settle: Any,
          acc: dict[str, float], profile_it: bool) -> str:
    """Reconnect the subscriber and acknowledge everything it gets until the queue is empty; the printout."""
    queued = len(broker.sessions["sub"].mqueue)
    sub = broker.open(limits, "bench", "sub", time.time())
    reader = PacketReader()
    got = 0
    client_cpu = 0.0
    acc["apply"] = acc["commit"] = 0.0
    commits0 = store.commits
    profile = cProfile.Profile() if profile_it else None
    wall0, loop0, cpu0 = time.perf_counter(), time.thread_time(), os.times()
    if profile is not None:
        profile.enable()
    sub_out: list[bytes] = []  # what the broker's actions wrote to the subscriber, as the I/O layer buffers it

    def keep(actions: list[Action]) -> None:
        for action in actions:
            if action.conn is sub:
                sub_out.extend(action.data)

    store.on_committed = lambda barrier: keep(broker.committed(barrier, time.time()))
    keep(broker.receive(sub, Connect(client_id="sub", clean_start=False, keep_alive=60).encode(4), time.time()))
    while True:
        t = time.thread_time()
        data = b"".join(sub_out)
        sub_out.clear()
        acks = [PubAck(p.packet_id).encode(4) for p in reader.feed(data) if isinstance(p, Publish)]
        client_cpu += time.thread_time() - t
        if not acks:
            loop.run_until_complete(settle())
            if not sub_out:
                break
            continue
        got += len(acks)
        now = time.time()
        actions = broker.receive(sub, b"".join(acks), now)
        keep(actions)
        while any(action.more for action in actions):  # a long PUBACK run, in parts (the server writes between)
            actions = broker.resume(sub, now)
            keep(actions)
        loop.run_until_complete(asyncio.sleep(0))  # a loop turn: flushes, lazy commits as on the server
    loop.run_until_complete(settle())
    if profile is not None:
        profile.disable()
    wall, loop_cpu, cpu1 = time.perf_counter() - wall0, time.thread_time() - loop0 - client_cpu, os.times()
    process = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) - client_cpu
    assert store.env is not None
    with store.env.begin() as txn:
        rows = txn.stat(store.tables.queue)["entries"] + txn.stat(store.tables.messages)["entries"]
    us = 1e6 / max(1, got)
    lines = [f"drain: {got} of {queued} queued messages delivered, {rows} rows left, "
             f"{store.commits - commits0} commits",
             f"  wall            {wall * us:6.2f} us/msg",
             f"  loop thread CPU {loop_cpu * us:6.2f} us/msg (the subscriber's {client_cpu * us:.2f} left out)",
             f"  writer CPU      {(process - loop_cpu) * us:6.2f} us/msg: applying changes {acc['apply'] * us:.2f}, "
             f"commit {(acc['commit'] - acc['apply']) * us:.2f}"]
    if profile is not None:
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(20)
        lines.append(stream.getvalue())
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
