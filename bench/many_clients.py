"""Many clients: ``--publishers`` connected clients each publishing one QoS 1 message a second, beside
``--idle`` connected clients that send nothing, for Mosquitto and edge-gateway side by side. Reported: publish ->
deliver latency (p50/p99/max, from the send time in each payload to its arrival at a subscriber), the broker's RSS
with everyone connected and while publishing, its CPU, and the load generator's own CPU.

Connections: every worker binds its own loopback source address (127.0.0.2, 127.0.0.3, ...: all of 127/8 is
loopback) with ``IP_BIND_ADDRESS_NO_PORT``, so each address has the whole ephemeral port range (32768-60999 here:
28,232 ports) to the broker's one port; no sysctl is changed. RLIMIT_NOFILE is raised for this process (inherited
by its workers) and given to the broker with ``prlimit``. The idle clients connect with ``--idle-keep-alive``
(default 600 s: no PINGREQ falls due while they are held) at most ``--concurrency`` handshakes at a time per worker,
below both listen backlogs (Mosquitto 100, edge-gateway 1024).

Load generator: forked processes with plain non-blocking sockets, no per-message objects on the send side (a
PUBLISH is a pre-encoded prefix, the Packet Identifier and a 64-byte payload: publisher id, sequence, send time);
subscribers (``--subscribers``, each on ``many/<k>/+``, QoS 1) are bench/loadgen.py's checking subscribers with
latency samples, in ``--sub-workers`` processes. With 10 subscribers (1,000 msgs/s each) both brokers' Inflight
Window of 32 bounded each subscriber to 32 messages per round trip, and round trips of tens of ms on the loaded
machine made that the bound (seconds of queueing); 100 subscribers get 100 msgs/s each. The publishers of one
worker are spread evenly over each second.

    python bench/many_clients.py [--publishers 10000] [--idle 100000] [--seconds 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import Broker, versions
from loadgen import (
    HEADER,
    PAYLOAD_SIZE,
    USERNAME,
    VERSION,
    SubSpec,
    Target,
    Workers,
    latencies_ms,
    merge_subscribers,
    percentile,
    run_subscribers,
)

from gateway.mqtt.packets import Connack, Connect

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
PER_ADDRESS = 25_000  # connections per source address (the ephemeral range has 28,232 ports)
NOFILE = 400_000


def raise_nofile(n: int) -> int:
    """Raise this process's RLIMIT_NOFILE (soft and hard; raising the hard limit needs CAP_SYS_RESOURCE, up to
    fs.nr_open); without that capability, to the hard limit. Returns the soft limit now in force."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, max(n, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


#: File descriptors a broker needs besides its clients' (listener, store, log, epoll, eventfds, ...), a margin.
BROKER_FDS = 200


def _connect_from(port: int, source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    s.bind((source, 0))
    s.settimeout(15)
    s.connect(("127.0.0.1", port))
    return s


def open_connections(port: int, source: str, client_ids: list[str], keep_alive: int, concurrency: int,
                     deadline: float) -> tuple[list[socket.socket], int]:
    """MQTT connections for ``client_ids`` from ``source`` (at most ``concurrency`` waiting for CONNACK); returns the
    connected sockets (non-blocking) and the count that failed."""
    sel = selectors.DefaultSelector()
    held: list[socket.socket] = []
    connack = Connack(False, 0).encode(VERSION)
    started = pending = failed = 0
    n = len(client_ids)
    while len(held) + failed < n and time.monotonic() < deadline:
        while started < n and pending < concurrency:
            try:
                s = _connect_from(port, source)
                s.sendall(Connect(client_ids[started], VERSION, True, keep_alive, username=USERNAME).encode(VERSION))
            except OSError:
                failed += 1
                started += 1
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, [b""])
            started += 1
            pending += 1
        for key, _ in sel.select(0.5):
            s = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(64)
            except OSError:
                data = b""
            key.data[0] += data
            if not data or len(key.data[0]) >= 4:
                sel.unregister(s)
                pending -= 1
                if key.data[0][:4] == connack:
                    held.append(s)
                else:
                    failed += 1
                    s.close()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
        failed += 1
    sel.close()
    return held, failed


def _reset_all(socks: list[socket.socket]) -> None:
    linger = struct.pack("ii", 1, 0)
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        except OSError:
            pass
        s.close()


def run_idle_from(target: Target, source: str, first: int, n: int, keep_alive: int, concurrency: int,
                  ctl: Any, out: Any, name: str) -> None:
    """Hold ``n`` idle MQTT connections from ``source`` until ``ctl.release``; reports ``connected``."""
    t0 = time.monotonic()
    t = os.times()
    cpu0 = t.user + t.system
    held, failed = open_connections(target.port, source, [f"idle-{first + i}" for i in range(n)], keep_alive,
                                    concurrency, ctl.deadline)
    t = os.times()
    out.put(("connected", name, {"connected": len(held), "failed": failed, "elapsed": time.monotonic() - t0,
                                 "cpu_s": t.user + t.system - cpu0}))
    # Drain whatever arrives (nothing should) without holding a selector over every socket.
    ctl.release.wait(max(0.0, ctl.deadline - time.monotonic()))
    closed_by_broker = 0
    for s in held:
        try:
            if s.recv(64) == b"":
                closed_by_broker += 1
        except (BlockingIOError, OSError):
            pass
    _reset_all(held)
    out.put(("done", name, {"closed_by_broker": closed_by_broker}))


def run_publishers(target: Target, source: str, first: int, n: int, n_topics: int, ctl: Any, out: Any,
                   name: str) -> None:
    """``n`` publishers (publisher ids ``first``..) from ``source``, each sending one QoS 1 PUBLISH a second to
    ``many/<id % n_topics>/<id>`` from ``ctl.go`` until ``ctl.pubs_done``, spread evenly over the second; PUBACKs
    are read and counted."""
    held, failed = open_connections(target.port, source, [f"pub-{first + i}" for i in range(n)], 60, 32,
                                    ctl.deadline)
    if failed:
        raise RuntimeError(f"{failed} of {n} publishers could not connect")
    out.put(("ready", name, {"publishers": len(held)}))
    prefixes = []
    for i in range(n):
        topic = f"many/{(first + i) % n_topics}/{first + i}".encode()
        body_len = 2 + len(topic) + 2 + PAYLOAD_SIZE
        prefixes.append(bytes((0x32, body_len)) + len(topic).to_bytes(2, "big") + topic)
    pad = bytes(PAYLOAD_SIZE - HEADER.size)
    sel = selectors.DefaultSelector()
    for s in held:
        sel.register(s, selectors.EVENT_READ)
    seqs = [0] * n
    sent = acked = late = 0
    ctl.go.wait()
    t0 = time.monotonic()
    due_index = 0  # publishers sent in this second so far
    second = 0
    # Keep alive 60: the publishers send every second, so no PINGREQ is needed.
    while not ctl.pubs_done.is_set() and time.monotonic() < ctl.deadline:
        now = time.monotonic()
        elapsed = now - t0
        if int(elapsed) > second:
            late += n - due_index  # a worker that could not keep up
            second = int(elapsed)
            due_index = 0
        want = min(n, int((elapsed - second) * n) + 1)
        while due_index < want:
            i = due_index
            seq = seqs[i]
            seqs[i] = seq + 1
            pid = seq % 65535 + 1
            try:
                held[i].send(prefixes[i] + pid.to_bytes(2, "big") + HEADER.pack(first + i, seq, time.time_ns()) + pad)
                sent += 1
            except OSError:
                pass
            due_index += 1
        for key, _ in sel.select(0.002):
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except OSError:
                continue
            acked += len(data) // 4  # PUBACK (3.1.1) is 4 bytes
    time.sleep(0.5)
    for key, _ in sel.select(0.2):
        try:
            acked += len(key.fileobj.recv(65536)) // 4  # type: ignore[union-attr]
        except OSError:
            pass
    sel.close()
    _reset_all(held)
    out.put(("done", name, {"sent": sent, "acked": acked, "late": late}))


class ManyBroker(Broker):
    """:class:`Broker` with edge-gateway's per-listener ``max_connections`` (default 10,000) off, as Mosquitto's
    is by default (-1: no limit)."""

    def _command(self, port: int) -> list[str]:
        cmd = super()._command(port)
        if self.kind == "edge-gateway":
            conf = self.workdir / "gateway.toml"
            text = conf.read_text().replace("[listeners.external]\n", "[listeners.external]\nmax_connections = 0\n")
            conf.write_text(text)
        return cmd


def sources(k: int) -> str:
    return f"127.0.0.{2 + k}"


def run_once(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    broker = ManyBroker(kind, tmp / kind, persistence=False, nofile=args.nofile)
    target = broker.start(timeout=60)
    seconds_budget = 900.0
    w = Workers(seconds_budget)
    result: dict[str, Any] = {"broker": kind}
    try:
        rss0 = broker.rss_kib()
        n_src = 0
        idle_names = []
        per_worker = args.idle_per_worker
        left = args.idle
        first = 0
        t0 = time.monotonic()
        while left > 0:
            m = min(per_worker, left)
            # workers' shares of one address stay under PER_ADDRESS
            idle_names.append(w.spawn(run_idle_from, target, sources(n_src), first, m, args.idle_keep_alive,
                                      args.concurrency, w.ctl))
            n_src += 1
            first += m
            left -= m
        idle = w.collect("connected", idle_names, seconds_budget) if idle_names else {}
        result["idle_connected"] = sum(r["connected"] for r in idle.values())
        result["idle_failed"] = sum(r["failed"] for r in idle.values())
        result["idle_connect_s"] = round(time.monotonic() - t0, 1)
        result["idle_loadgen_cpu_s"] = round(sum(r["cpu_s"] for r in idle.values()), 1)
        time.sleep(1.0)
        rss_idle = broker.rss_kib()
        result["rss_idle_mib"] = round(rss_idle / 1024, 1)
        result["rss_per_idle_kib"] = round((rss_idle - rss0) / max(1, result["idle_connected"]), 2)
        specs = [SubSpec(f"many-sub-{k}", f"many/{k}/+", qos=1, pubs=args.publishers, per_pub=64)
                 for k in range(args.subscribers)]
        sub_names = [w.spawn(run_subscribers, target, specs[k::args.sub_workers], w.ctl, latency=True, idle=2.0)
                     for k in range(min(args.sub_workers, len(specs)))]
        pub_names = []
        per_pub_worker = -(-args.publishers // args.pub_workers)
        for k in range(args.pub_workers):
            lo = k * per_pub_worker
            n = min(per_pub_worker, args.publishers - lo)
            if n > 0:
                pub_names.append(w.spawn(run_publishers, target, sources(n_src), lo, n, args.subscribers, w.ctl))
                n_src += 1
        w.collect("ready", [*sub_names, *pub_names], 600)
        rss_connected = broker.rss_kib()
        cpu0 = broker.cpu_seconds()
        t_go = time.monotonic()
        w.ctl.go.set()
        time.sleep(args.seconds)
        rss_publishing = broker.rss_kib()
        cpu = broker.cpu_seconds() - cpu0
        w.ctl.pubs_done.set()
        wall = time.monotonic() - t_go
        pubs = w.collect("done", pub_names, 120)
        subs = w.collect("done", sub_names, 120)
        load = w.load([*sub_names, *pub_names])
        w.ctl.release.set()
        idle_done = w.collect("done", idle_names, 300) if idle_names else {}
        merged = merge_subscribers(subs)
        lat = latencies_ms(subs)
        sent = sum(r["sent"] for r in pubs.values())
        result.update({
            "publishers": args.publishers, "idle": args.idle, "seconds": round(wall, 1),
            "sent": sent, "acked": sum(r["acked"] for r in pubs.values()),
            "late": sum(r["late"] for r in pubs.values()),
            "delivered": merged["unique"], "dups": merged["dups"],
            "lost": sent - merged["unique"],
            "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
            "max_ms": round(lat[-1], 1) if lat else None,
            "rss_connected_mib": round(rss_connected / 1024, 1), "rss_publishing_mib": round(rss_publishing / 1024, 1),
            "broker_cpu_share": round(cpu / wall, 3), "broker_cpu_us_per_msg": round(cpu / max(1, sent) * 1e6, 1),
            "loadgen_cpu_share": round(load, 2),
            "idle_closed_by_broker": sum(r["closed_by_broker"] for r in idle_done.values()),
            "warnings": broker.warnings(4),
        })
    finally:
        w.close()
        broker.stop()
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            shutil.copy(broker.log_path, Path(args.keep_logs) / f"{kind}-{time.strftime('%H%M%S')}.log")
        broker.cleanup()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publishers", type=int, default=10_000)
    ap.add_argument("--idle", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=20.0, help="publishing time per run (default 20)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--subscribers", type=int, default=100,
                    help="subscribers, each on many/<k>/+ (default 100: 100 msgs/s each, so that the Inflight "
                    "Window of 32 is not what bounds a subscriber on a loaded machine)")
    ap.add_argument("--pub-workers", type=int, default=4, help="publisher processes (default 4)")
    ap.add_argument("--sub-workers", type=int, default=4,
                    help="subscriber processes (default 4: on a machine loaded 14 a process gets ~1/7 of a core, and "
                    "one subscriber process was the bound at 10,000 msgs/s)")
    ap.add_argument("--idle-per-worker", type=int, default=PER_ADDRESS)
    ap.add_argument("--idle-keep-alive", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=24, help="CONNECTs waiting for CONNACK per idle worker")
    ap.add_argument("--brokers", default="mosquitto,edge-gateway")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy each broker's log here before its directory goes")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.idle_per_worker > PER_ADDRESS:
        ap.error(f"--idle-per-worker at most {PER_ADDRESS} (one source address per worker)")
    got = raise_nofile(NOFILE)
    args.nofile = got
    print(f"# RLIMIT_NOFILE {got}; load average {os.getloadavg()} (2 cores shared with other work)", flush=True)
    room = got - args.publishers - args.subscribers - BROKER_FDS
    if args.idle > room:
        # Both brokers are one process each: every connection is one of its file descriptors.
        print(f"# RLIMIT_NOFILE cannot go above {got} here (raising the hard limit needs CAP_SYS_RESOURCE): "
              f"--idle {args.idle:,} lowered to {max(0, room):,} so that one broker process can hold every client",
              flush=True)
        args.idle = max(0, room)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-many-") as tmp_name:
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o755)
        for run in range(args.runs):
            for kind in args.brokers.split(","):
                r = run_once(kind, args, tmp)
                r["run"] = run
                print(json.dumps(r), flush=True)
                results.append(r)
    vers = versions()
    print(f"\nMany clients: {args.publishers:,} publishers x 1 QoS 1 msg/s + {args.idle:,} idle, "
          f"{args.subscribers} subscribers, {args.seconds:g} s ({args.runs} runs, median [min-max])")
    print("| broker | version | p50 ms | p99 ms | lost | RSS idle+pubs MiB | RSS/idle conn KiB | broker CPU | "
          "load gen CPU |")
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(rs: list[dict[str, Any]], key: str, fmt: str = "{:.1f}") -> str:
        v = sorted(r[key] for r in rs)
        return f"{fmt.format(v[len(v) // 2])} [{fmt.format(v[0])}-{fmt.format(v[-1])}]"

    for kind in args.brokers.split(","):
        rs = [r for r in results if r["broker"] == kind]
        print(f"| {kind} | {vers.get(kind, '?')} | {cell(rs, 'p50_ms')} | {cell(rs, 'p99_ms')} | "
              f"{sum(r['lost'] for r in rs)} | {cell(rs, 'rss_publishing_mib', '{:.0f}')} | "
              f"{cell(rs, 'rss_per_idle_kib', '{:.2f}')} | {cell(rs, 'broker_cpu_share', '{:.2f}')} | "
              f"{cell(rs, 'loadgen_cpu_share', '{:.2f}')} |")
    print(f"# load average after {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
