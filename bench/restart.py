"""Restart to READY with a large offline backlog: time from exec to ``READY=1`` on a notification socket
we own, and from a returning client's CONNECT to its first queued PUBLISH, for Mosquitto (``persistence true``) and
edge-gateway (LMDB store), side by side.

The backlog is built through each broker the same way: ``--sessions`` persistent sessions (Clean Session = 0, QoS 1)
subscribed to one topic, left offline, then ``--messages`` QoS 1 messages published to it, so every session queues
every message (default 1,000 x 1,000 = 10^6 queued messages). The broker is stopped with SIGTERM (Mosquitto writes
its persistence file then; edge-gateway has committed every acknowledged message already) and started ``--runs``
times on the same files. On each start, one session (another each run) reconnects with Clean Session = 0 and the
time to its first PUBLISH is taken; it is then closed without acknowledging anything, so the backlog stays.

Both brokers get ``NOTIFY_SOCKET`` (a datagram socket in the run's temp dir): edge-gateway sends ``READY=1`` once
its store is loaded and its listeners are bound; Debian's Mosquitto is built with systemd support and sends it too.
A broker that sends no READY=1 is timed to its first successful CONNACK instead (and says so).

    python bench/restart.py [--sessions 1000] [--messages 1000] [--runs 3] [--brokers mosquitto,edge-gateway]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import Broker, versions
from loadgen import (
    VERSION,
    Target,
    mqtt_connect,
    prepare_persistent_subscriber,
    raise_nofile,
)

from gateway.mqtt.packets import PubAck, Publish

TOPIC = "bench/restart/all"


class NotifySocket:
    """A datagram socket standing in for systemd's: records when each line first arrived (monotonic seconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)  # Mosquitto drops root before it sends
        self.sock.settimeout(0.2)
        self.lines: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            for line in data.decode(errors="replace").splitlines():
                self.lines.append((now, line))

    def ready_after(self, t0: float) -> float | None:
        for at, line in list(self.lines):
            if at >= t0 and line == "READY=1":
                return at - t0
        return None

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


def publish_qos1(target: Target, n: int, window: int = 32) -> float:
    """Publish ``n`` QoS 1 messages (64-byte payload) to :data:`TOPIC` with ``window`` unacknowledged; returns
    seconds until the last PUBACK."""
    sock, reader, pending, _ = mqtt_connect(target, "restart-pub", clean=True)
    payload = b"x" * 64
    t0 = time.monotonic()
    sent = acked = 0
    try:
        while acked < n:
            while sent < n and sent - acked < window:
                sent += 1
                sock.sendall(Publish(TOPIC, payload, 1, packet_id=sent % 65535 + 1).encode(VERSION))
            for p in pending:
                if isinstance(p, PubAck):
                    acked += 1
            pending.clear()
            if acked < n:
                data = sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("broker closed the publisher")
                pending.extend(reader.feed(data))
    finally:
        sock.close()
    return time.monotonic() - t0


def first_delivery(target: Target, client_id: str) -> tuple[float, float]:
    """Reconnect ``client_id`` (Clean Session = 0); returns (seconds from CONNECT sent to CONNACK, to the first
    PUBLISH). Nothing is acknowledged."""
    t0 = time.monotonic()
    sock, reader, pending, present = mqtt_connect(target, client_id, clean=False, timeout=30)
    t_ack = time.monotonic() - t0
    try:
        if not present:
            raise RuntimeError(f"{target.name}: session {client_id} not present after restart")
        while not any(isinstance(p, Publish) for p in pending):
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed before the first PUBLISH")
            pending.extend(reader.feed(data))
        return t_ack, time.monotonic() - t0
    finally:
        sock.close()


def wait_connack(target: Target, t0: float, timeout: float = 120.0) -> float:
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        try:
            sock, _, _, _ = mqtt_connect(target, "restart-probe", clean=True, timeout=5)
            sock.close()
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.01)
    raise RuntimeError("no CONNACK")


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_kind(kind: str, args: argparse.Namespace, tmp: Path, notify: NotifySocket) -> dict[str, Any]:
    workdir = tmp / kind
    broker = Broker(kind, workdir, persistence=True, nofile=20000)
    out: dict[str, Any] = {"broker": kind, "sessions": args.sessions, "messages": args.messages,
                           "queued": args.sessions * args.messages, "runs": []}
    try:
        target = broker.start(timeout=60)
        t0 = time.monotonic()
        for i in range(args.sessions):
            prepare_persistent_subscriber(target, f"restart-{i}", TOPIC, 1)
        out["prepare_s"] = round(time.monotonic() - t0, 2)
        out["publish_s"] = round(publish_qos1(target, args.messages), 2)
        t0 = time.monotonic()
        broker.stop(timeout=600)
        out["stop_s"] = round(time.monotonic() - t0, 2)
        out["files_bytes"] = store_bytes(workdir)
        for run in range(args.runs):
            t0 = time.monotonic()
            target = broker.start(timeout=600)
            listening = time.monotonic() - t0
            ready = None
            deadline = time.monotonic() + 5
            while ready is None and time.monotonic() < deadline:
                ready = notify.ready_after(t0)
                if ready is None:
                    time.sleep(0.01)
            connack = None
            if ready is None:
                connack = wait_connack(target, t0)
            rss = broker.rss_kib()
            cpu = broker.cpu_seconds()
            t_ack, t_first = first_delivery(target, f"restart-{run}")
            out["runs"].append({
                "ready_s": round(ready, 3) if ready is not None else None,
                "listening_s": round(listening, 3),
                "first_connack_s": round(connack, 3) if connack is not None else None,
                "reconnect_connack_ms": round(t_ack * 1000, 1),
                "first_delivery_ms": round(t_first * 1000, 1),
                "rss_kib_at_ready": rss,
                "cpu_s_to_ready": round(cpu, 2),
            })
            print(json.dumps({"broker": kind, "run": run, **out["runs"][-1]}), flush=True)
            broker.stop(timeout=600)
        out["warnings"] = broker.warnings()
    finally:
        if args.keep:
            broker.stop(timeout=600)
        else:
            broker.cleanup()
    return out


def profile_load(path: Path) -> int:
    """cProfile of ``LmdbStore.load`` (what the broker does before READY=1) on the store at ``path``."""
    import cProfile
    import pstats

    from gateway.store.lmdb_store import LmdbStore
    from gateway.store.settings import StoreSettings

    store = LmdbStore(StoreSettings(path=str(path)))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    state = store._take_lock(), store._open_env(), store._read_all(time.time(), cleanup=False)
    prof.disable()
    elapsed = time.perf_counter() - t0
    sessions = state[2].sessions
    print(f"load: {elapsed:.2f} s, {len(sessions)} sessions, {sum(len(s.mqueue) for s in sessions):,} queued")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000, help="offline persistent sessions (default 1000)")
    ap.add_argument("--messages", type=int, default=1000, help="QoS 1 messages each session queues (default 1000)")
    ap.add_argument("--runs", type=int, default=3, help="restarts per broker (default 3)")
    ap.add_argument("--brokers", default="mosquitto,edge-gateway")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--keep", help="build the stores in this directory and leave them there (for profiling the "
                    "load: python bench/restart.py --profile DIR/edge-gateway/store)")
    ap.add_argument("--profile", metavar="STORE", help="only cProfile edge-gateway's store load of STORE (a copy is "
                    "not made: the load removes nothing, cleanup off) and print the top functions")
    args = ap.parse_args()
    if args.profile:
        return profile_load(Path(args.profile))
    raise_nofile(20000)
    print(f"# uptime: {os.getloadavg()} (load average; 2 cores shared with other work)", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp_name:
        tmp = Path(args.keep or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o755)
        notify = NotifySocket(tmp / "notify.sock")
        os.environ["NOTIFY_SOCKET"] = str(notify.path)
        try:
            for kind in args.brokers.split(","):
                results.append(run_kind(kind, args, tmp, notify))
        finally:
            os.environ.pop("NOTIFY_SOCKET", None)
            notify.close()
    vers = versions()
    print(f"\nRestart with {args.sessions * args.messages:,} queued messages in {args.sessions:,} offline sessions "
          f"({args.runs} restarts each, median [min-max])")
    print("| broker | version | READY=1 s | listening s | first delivery after reconnect ms | RSS at READY MiB | "
          "files MiB | build: publish s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        ready = [x["ready_s"] if x["ready_s"] is not None else x["first_connack_s"] for x in r["runs"]]
        first = [x["first_delivery_ms"] for x in r["runs"]]
        rss = [x["rss_kib_at_ready"] / 1024 for x in r["runs"]]
        listening = [x["listening_s"] for x in r["runs"]]
        tag = "" if r["runs"] and r["runs"][0]["ready_s"] is not None else " (no READY=1: first CONNACK)"
        print(f"| {r['broker']} | {vers.get(r['broker'], '?')} | {median(ready):.2f} [{min(ready):.2f}-"
              f"{max(ready):.2f}]{tag} | {median(listening):.2f} | {median(first):.0f} [{min(first):.0f}-"
              f"{max(first):.0f}] | {median(rss):.0f} | {r['files_bytes'] / 2**20:.0f} | {r['publish_s']} |")
    print(f"# uptime after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
