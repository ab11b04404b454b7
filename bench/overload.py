"""Overload: a publisher far faster than its subscriber. The broker's memory must stay bounded by the configured
queue limits, not grow with the backlog. Runs edge-gateway (max_mqueue_len 1000, durable store) and
Mosquitto (max_queued_messages 1000) side by side, each pinned to core 0, and reports each broker's peak RSS while
a QoS 0 and a QoS 1 publisher send 200 000 x 1 KiB messages to a subscriber that reads nothing for 10 s.

    .venv/bin/python bench/overload.py [MESSAGES [SECONDS]]     (defaults: 200000 messages, 10 s)

Binds and connects only to 127.0.0.1, on ports of brokers the script started; stops by itself.
"""

from __future__ import annotations

import os
import shutil
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

from gateway.mqtt.packets import Connect, Publish, Subscribe, Subscription  # noqa: E402

MESSAGES = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
PAYLOAD = b"x" * 1024
STALL = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def client(port: int, cid: str, clean: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(Connect(cid, 4, clean, 60).encode(4))
    s.recv(4)
    return s


def publisher(port: int, qos: int, stop: threading.Event) -> None:
    s = client(port, f"overload-pub{qos}")
    s.setblocking(True)
    pid = 1
    batch = []
    for _ in range(MESSAGES // 2):
        batch.append(Publish("overload/t", PAYLOAD, qos, packet_id=pid if qos else None).encode(4))
        pid = pid % 65535 + 1
        if len(batch) == 200:
            try:
                s.sendall(b"".join(batch))
            except OSError:
                break
            batch = []
            if qos:
                s.setblocking(False)
                try:
                    while s.recv(1 << 20):
                        pass
                except (BlockingIOError, OSError):
                    pass
                s.setblocking(True)
        if stop.is_set():
            break
    s.close()


def run(port: int, proc_pid: int) -> tuple[int, int]:
    sub = client(port, "overload-sub")
    sub.sendall(Subscribe(1, [Subscription("overload/#", 1)]).encode(4))
    time.sleep(0.3)  # SUBACK; from now on the subscriber reads nothing
    base = rss_kib(proc_pid)
    stop = threading.Event()
    pubs = [threading.Thread(target=publisher, args=(port, q, stop)) for q in (0, 1)]
    for t in pubs:
        t.start()
    peak = base
    t0 = time.monotonic()
    while time.monotonic() - t0 < STALL:
        peak = max(peak, rss_kib(proc_pid))
        time.sleep(0.05)
    stop.set()
    sub.close()
    for t in pubs:
        t.join(10)
    return base, peak


def start_edge(work: Path) -> tuple[subprocess.Popen[str], int]:
    """edge-gateway with its defaults but for a 1000-message queue, pinned to core 0; returns (process, port)."""
    (work / "gateway.toml").write_text('[broker]\nsys_interval = 0\n[listeners.external]\nbind = "127.0.0.1:0"\n'
                                       "max_mqueue_len = 1000\n")
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", "gateway.toml"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, cwd=work, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    port = read_gateway_port(proc)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    return proc, port


def start_mosquitto(work: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Mosquitto with a 1000-message queue (in memory), pinned to core 0; returns (process, port)."""
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 1000\n"
                    "max_inflight_messages 32\npersistence false\n")
    cmd = ["mosquitto", "-c", str(conf)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mosquitto did not start")


def main() -> int:
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    try:
        for name, start in (("edge-gateway", start_edge), ("mosquitto", start_mosquitto)):
            proc, port = start(work)
            try:
                rows.append((name, *run(port, proc.pid)))
            finally:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"overload: QoS 0 + QoS 1 publishers, {MESSAGES} x 1 KiB, a subscriber reading nothing for {STALL:.0f} s, "
          "queue limit 1000 messages")
    print(f"{'broker':<14} {'RSS before MiB':>15} {'peak RSS MiB':>13} {'growth MiB':>11}")
    for name, base, peak in rows:
        print(f"{name:<14} {base / 1024:>15.1f} {peak / 1024:>13.1f} {(peak - base) / 1024:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
