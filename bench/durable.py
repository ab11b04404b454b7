"""Durable QoS 1 throughput: publisher -> persistent offline subscriber, 64-byte payloads, LMDB with fsynced
commits. Runs the broker twice in the same run: group commit (the default) and one commit per message
(``[store] group_commit = false``), and reports messages/s and fsyncs (commits) for each.

    .venv/bin/python bench/durable.py [--messages 20000] [--publishers 4] [--window 32]

Binds and connects only to 127.0.0.1, on a port the script's own broker reported; stops by itself.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from brokers import read_gateway_port  # noqa: E402

from gateway.mqtt.framing import PacketReader  # noqa: E402
from gateway.mqtt.packets import Connect, PubAck, Publish, Subscribe, Subscription  # noqa: E402


def start_broker(workdir: Path, extra_store: str, cpu: int | None) -> tuple[subprocess.Popen[str], int]:
    (workdir / "gateway.toml").write_text(f"""
[broker]
sys_interval = 0
log_level = "warning"
[store]
{extra_store}
[listeners.external]
bind = "127.0.0.1:0"
max_mqueue_len = 0
""")
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", "gateway.toml", "--log-level", "info"]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd, cwd=workdir, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, read_gateway_port(proc)


def commits_at_exit(proc: subprocess.Popen[str]) -> int:
    """Stop the broker and read how many commits (fsynced transactions) its store made."""
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    _, out = proc.communicate(timeout=30)
    m = re.search(r"store closed: (\d+) commits", out)
    return int(m.group(1)) if m else -1


def connect(port: int, client_id: str, clean: bool) -> tuple[socket.socket, PacketReader, list[object]]:
    """Connect as an MQTT 5 client with a persistent session; returns the packets that followed the CONNACK."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = PacketReader(version=5)
    sock.sendall(Connect(client_id, 5, clean, 60, properties={0x11: 3600}).encode())
    packets: list[object] = []
    while not packets:
        packets = list(reader.feed(sock.recv(65536)))
    return sock, reader, packets[1:]


def publisher(port: int, name: str, count: int, window: int, result: dict[str, float]) -> None:
    sock, reader, _ = connect(port, name, True)
    payload = b"x" * 64
    packets = [Publish("bench/durable", payload, 1, packet_id=(i % 65535) + 1).encode(5) for i in range(window)]
    sent = acked = 0
    t0 = time.perf_counter()
    while acked < count:
        burst = []
        while sent < count and sent - acked < window:
            pid = (sent % 65535) + 1
            burst.append(Publish("bench/durable", payload, 1, packet_id=pid).encode(5) if sent >= window
                         else packets[sent])
            sent += 1
        if burst:
            sock.sendall(b"".join(burst))
        data = sock.recv(65536)
        if not data:
            raise RuntimeError("broker closed the connection")
        acked += sum(1 for p in reader.feed(data) if isinstance(p, PubAck))
    result[name] = time.perf_counter() - t0
    sock.close()


def drain(port: int, expected: int) -> int:
    sock, reader, first = connect(port, "bench-sub", False)
    got = 0
    sock.settimeout(10)
    try:
        pending = first
        while got < expected:
            if not pending:
                data = sock.recv(1 << 20)
                if not data:
                    break
                pending = list(reader.feed(data))
            acks = []
            for p in pending:
                if isinstance(p, Publish):
                    got += 1
                    acks.append(PubAck(p.packet_id).encode(5))  # type: ignore[arg-type]
            pending = []
            if acks:
                sock.sendall(b"".join(acks))
    except TimeoutError:
        pass
    sock.close()
    return got


def run(mode: str, messages: int, publishers: int, window: int) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-durable-{mode}-"))
    extra = "group_commit = false" if mode == "per-message" else ""
    proc, port = start_broker(workdir, extra, cpu=0)
    try:
        sock, _, _ = connect(port, "bench-sub", True)
        sock.sendall(Subscribe(1, [Subscription("bench/#", 1)]).encode(5))
        time.sleep(0.2)
        sock.close()
        per = messages // publishers
        times: dict[str, float] = {}
        threads = [threading.Thread(target=publisher, args=(port, f"pub{i}", per, window, times))
                   for i in range(publishers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        delivered = drain(port, per * publishers)
        commits = commits_at_exit(proc)
        return {"rate": per * publishers / elapsed, "elapsed": elapsed, "delivered": delivered,
                "sent": per * publishers, "commits": commits}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for mode in ("group-commit", "per-message"):
        rates = []
        lost = 0
        per_commit = []
        for _ in range(args.runs):
            r = run(mode, args.messages if mode == "group-commit" else max(2000, args.messages // 10),
                    args.publishers, args.window)
            rates.append(r["rate"])
            lost += int(r["sent"] - r["delivered"])
            per_commit.append(r["sent"] / max(1, r["commits"]))
        rates.sort()
        per_commit.sort()
        rows.append((mode, rates[len(rates) // 2], rates[0], rates[-1], lost, per_commit[len(per_commit) // 2]))
    print(f"durable QoS 1, {args.publishers} publishers x {args.window} in flight, 64 B, persistent offline "
          "subscriber, LMDB sync on")
    print(f"{'mode':<14} {'median msg/s':>12} {'min':>10} {'max':>10} {'lost':>6} {'msgs/commit':>12}")
    for mode, med, lo, hi, lost, mpc in rows:
        print(f"{mode:<14} {med:>12.0f} {lo:>10.0f} {hi:>10.0f} {lost:>6} {mpc:>12.1f}")
    print(f"group commit speed-up: {rows[0][1] / rows[1][1]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
