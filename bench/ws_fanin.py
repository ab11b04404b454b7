"""QoS 0 fan-in over WebSockets: edge-gateway's ``protocol = "websockets"`` listener beside Mosquitto's
``protocol websockets`` listener, in the same run on the same machine.

    .venv/bin/python bench/ws_fanin.py [--runs 3] [--count 50000] [--publishers 4]

As bench/run.py's ``fanin``, over WebSockets: 4 publishers send ``--count`` QoS 0 PUBLISH packets each (64-byte
payloads, MQTT 3.1.1, topic ``bench/pN``) as fast as the broker reads them, to 1 subscriber of ``bench/#``; the
figure is messages delivered per second from the start signal to the last delivery, median of ``--runs`` runs
(runs interleave the brokers, each run on a fresh broker), with min-max and the ratio to Mosquitto.

Brokers are pinned to core 0 and the load generator (4 publisher processes and the subscriber) to core 1, as in
bench/run.py. The load generator speaks WebSockets to both brokers the same way: wsproto does the upgrade (offering
the ``mqtt`` subprotocol); each publisher sends one masked binary frame per PUBLISH, as browser clients do
(mqtt.js, Paho JavaScript), built once by wsproto and re-sent; the subscriber reads the brokers' unmasked binary
frames with a small header parser and counts PUBLISH bytes (every PUBLISH here has the same size), so that its cost
per message stays low. Beside each figure: how busy the load generator's core was, and how much of it the load
generator's own processes used (CPU seconds per second of the run, from getrusage): when they use close to all of
it, the load generator, not the broker, was the bound (on a shared machine other processes also use that core).

Mosquitto 2.0.11 (Debian bookworm) exits with "Unable to start any listening sockets" when every listener is a
websockets one, so its configuration has a second, unused, plain TCP listener; and its websockets listener binds
``[::]`` (every interface) whatever host is given unless ``socket_domain ipv4`` is set (then 127.0.0.1).

edge-gateway's side is gateway/server/websocket.py: the ``websockets`` package's sans-I/O ``ServerProtocol`` (its
version is in the table). Writes the table to bench/results/websockets.md. (Not named websockets.py: bench/ is
first on sys.path of the scripts in it, and amqtt imports the ``websockets`` package.)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from brokers import MAX_INFLIGHT, MAX_QUEUED, Broker, BrokerError, free_port, versions  # noqa: E402
from loadgen import BROKER_CPU, HOST, LOADGEN_CPU, busy_fraction, core_times  # noqa: E402
from wsproto import ConnectionType, WSConnection  # noqa: E402
from wsproto.events import AcceptConnection, BytesMessage, RejectConnection, Request  # noqa: E402

from gateway.mqtt.packets import Connect, Disconnect, Publish, Subscribe, Subscription  # noqa: E402

PAYLOAD = bytes(range(64))
PATH = "/mqtt"
FRAMES_PER_CHUNK = 500


class WsBroker(Broker):
    """A broker of bench/brokers.py whose only client listener is a websockets one on ``path`` /mqtt.

    ``edge-gateway@DIR`` is edge-gateway run from another copy of the source tree (``DIR`` holds its ``gateway``
    package, e.g. a ``git worktree`` of another commit), to compare two versions side by side in one run."""

    def __init__(self, kind: str, workdir: Path) -> None:
        base, _, self.tree = kind.partition("@")
        if self.tree and base != "edge-gateway":
            raise BrokerError(f"{kind}: only edge-gateway runs from another tree (edge-gateway@DIR)")
        if self.tree and not (Path(self.tree) / "gateway" / "__main__.py").exists():
            raise BrokerError(f"{kind}: no gateway package in {self.tree}")
        super().__init__(base, workdir)

    def _command(self, port: int) -> list[str]:
        command = self._ws_command(port)
        # Broker.start sets PYTHONPATH to this tree for edge-gateway; env(1) execs, so the PID stays the broker's
        return ["env", f"PYTHONPATH={Path(self.tree).resolve()}", *command] if self.tree else command

    def _ws_command(self, port: int) -> list[str]:
        if self.kind == "mosquitto":
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(
                f"listener {free_port()} {HOST}\n"  # unused: Mosquitto 2.0.11 refuses to start with only websockets
                f"listener {port} {HOST}\n"
                "protocol websockets\n"
                "socket_domain ipv4\n"  # without it libwebsockets binds [::] (every interface), whatever the host
                "allow_anonymous true\n"
                "persistence false\n"
                f"max_inflight_messages {MAX_INFLIGHT}\n"
                f"max_queued_messages {MAX_QUEUED}\n"
                "max_queued_bytes 0\n"
                "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"
                "connection_messages false\n"
            )
            return ["mosquitto", "-c", str(conf)]
        if self.kind == "edge-gateway":
            conf = self.workdir / "gateway.toml"
            conf.write_text(
                '[broker]\nsys_interval = 0\nlog_level = "warning"\n'
                f'[store]\npath = "{self.workdir / "store"}"\n'
                '[listeners.ws]\nbind = "127.0.0.1:0"\nprotocol = "websockets"\n'
                f'path = "{PATH}"\nmax_inflight = {MAX_INFLIGHT}\nmax_mqueue_len = {MAX_QUEUED}\n'
                "message_expiry_interval = 0\n"
            )
            return [sys.executable, "-m", "gateway", "serve", "--config", str(conf), "--log-level", "info"]
        raise BrokerError(f"{self.kind}: no websockets configuration here")


# ------------------------------------------------------------------------------------------- load generator


def _pin() -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {LOADGEN_CPU})


def ws_connect(port: int, client_id: str) -> tuple[socket.socket, WSConnection, bytes]:
    """Upgrade to WebSocket (subprotocol mqtt) and send CONNECT; returns the socket, wsproto's connection and
    the bytes read after the upgrade."""
    sock = socket.create_connection((HOST, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host=f"{HOST}:{port}", target=PATH, subprotocols=["mqtt"])))
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed during the upgrade")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                sock.sendall(ws.send(BytesMessage(data=Connect(client_id, 4, True, 60).encode(4))))
                return sock, ws, b""
            if isinstance(event, RejectConnection):
                raise ConnectionError(f"upgrade refused: {event.status_code}")


class FrameCounter:
    """The payload bytes of a server's (unmasked) binary frames, from the raw stream; frame headers are parsed,
    payloads are only counted."""

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0  # payload bytes of the current frame still to come
        self.payload = 0  # payload bytes seen

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        if self.left:
            take = min(self.left, end)
            self.left -= take
            self.payload += take
            pos = take
        if pos == end:
            return
        buf = self.buf + data[pos:] if self.buf else data[pos:]
        pos, end = 0, len(buf)
        while pos < end:
            if end - pos < 2:
                break
            length = buf[pos + 1] & 0x7F
            head = 2
            if length == 126:
                if end - pos < 4:
                    break
                length = int.from_bytes(buf[pos + 2 : pos + 4], "big")
                head = 4
            elif length == 127:
                if end - pos < 10:
                    break
                length = int.from_bytes(buf[pos + 2 : pos + 10], "big")
                head = 10
            pos += head
            take = min(length, end - pos)
            self.payload += take
            self.left = length - take
            pos += take
        self.buf = buf[pos:] if pos < end else b""


def run_subscriber(port: int, expect: int, packet_size: int, ready: Any, result: Any) -> None:
    """Subscribe to bench/#; count deliveries until ``expect`` arrived or nothing came for 3 s."""
    _pin()
    sock, ws, _ = ws_connect(port, "ws-sub")
    counter = FrameCounter()
    sock.sendall(ws.send(BytesMessage(data=Subscribe(1, [Subscription("bench/#", 0)]).encode(4))))
    # CONNACK (4 bytes) and SUBACK (5 bytes) come first, each in its frame(s)
    while counter.payload < 9:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed before SUBACK")
        counter.feed(data)
    base = 9
    ready.set()
    sock.settimeout(3.0)
    last = time.monotonic()
    try:
        while (counter.payload - base) // packet_size < expect:
            data = sock.recv(1 << 20)
            if not data:
                break
            counter.feed(data)
            last = time.monotonic()
    except TimeoutError:
        pass
    result.put(((counter.payload - base) // packet_size, last))
    sock.close()


def run_publisher(port: int, index: int, count: int, ready: Any, go: Any) -> None:
    _pin()
    sock, ws, _ = ws_connect(port, f"ws-pub-{index}")
    packet = Publish(f"bench/p{index}", PAYLOAD, 0).encode(4)
    chunk = b"".join(ws.send(BytesMessage(data=packet)) for _ in range(FRAMES_PER_CHUNK))  # one frame per PUBLISH
    ready.set()
    go.wait()
    sent = 0
    while sent < count:
        n = min(FRAMES_PER_CHUNK, count - sent)
        sock.sendall(chunk if n == FRAMES_PER_CHUNK else b"".join(
            ws.send(BytesMessage(data=packet)) for _ in range(n)))
        sent += n
    sock.sendall(ws.send(BytesMessage(data=Disconnect().encode(4))))
    # Read to the end before closing: closing with unread bytes (the CONNACK) would send a reset, and the kernel
    # would throw away what the broker has not read yet.
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(30)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


def one_run(kind: str, workdir: Path, publishers: int, count: int) -> dict[str, float]:
    broker = WsBroker(kind, workdir)
    target = broker.start()
    ctx = mp.get_context("fork")
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load generator's processes, once joined
    packet_size = len(Publish("bench/p0", PAYLOAD, 0).encode(4))
    expect = publishers * count
    try:
        sub_ready, result, go = ctx.Event(), ctx.Queue(), ctx.Event()
        sub = ctx.Process(target=run_subscriber, args=(target.port, expect, packet_size, sub_ready, result))
        sub.start()
        if not sub_ready.wait(30):
            raise BrokerError(f"{kind}: the subscriber did not get its SUBACK\n{broker.log_tail()}")
        pubs, readies = [], []
        for i in range(publishers):
            ready = ctx.Event()
            proc = ctx.Process(target=run_publisher, args=(target.port, i, count, ready, go))
            proc.start()
            pubs.append(proc)
            readies.append(ready)
        for ready in readies:
            if not ready.wait(30):
                raise BrokerError(f"{kind}: a publisher did not connect\n{broker.log_tail()}")
        time.sleep(0.2)
        cpu0, cores0 = broker.cpu_seconds(), core_times()
        start = time.monotonic()
        go.set()
        delivered, last = result.get(timeout=600)
        cpu1, cores1 = broker.cpu_seconds(), core_times()
        for proc in [*pubs, sub]:
            proc.join(30)
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the broker is not reaped yet: not in it
        loadgen_cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
        elapsed = max(last - start, 1e-9)
        return {
            "rate": delivered / elapsed,
            "delivered": delivered,
            "lost": expect - delivered,
            "broker_us": (cpu1 - cpu0) / max(delivered, 1) * 1e6,
            "loadgen_busy": busy_fraction(cores0, cores1, LOADGEN_CPU),
            "loadgen_share": loadgen_cpu / elapsed,  # its CPU seconds (connects included) per second of the run
            "broker_busy": busy_fraction(cores0, cores1, BROKER_CPU),
        }
    finally:
        broker.stop()
        for line in broker.warnings():
            print(f"  {kind}: {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--count", type=int, default=50_000, help="messages per publisher (default 50000)")
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--brokers", default="mosquitto,edge-gateway",
                        help="comma-separated: mosquitto, edge-gateway, edge-gateway@DIR (edge-gateway from the source "
                        "tree in DIR, e.g. a git worktree of another commit); the first is the ratios' base when it "
                        "is mosquitto")
    parser.add_argument("--out", default=str(BENCH / "results" / "websockets.md"))
    args = parser.parse_args()
    kinds = args.brokers.split(",")
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ws-") as tmp:
        for run in range(args.runs):
            for kind in kinds:
                r = one_run(kind, Path(tmp) / f"{kinds.index(kind)}-{run}", args.publishers, args.count)
                results[kind].append(r)
                print(f"run {run + 1} {kind:13s} {r['rate']:9.0f} msgs/s delivered {r['delivered']:.0f} "
                      f"(lost {r['lost']:.0f}), broker {r['broker_us']:.1f} us/msg, busy: broker core "
                      f"{r['broker_busy']:.0%}, load generator core {r['loadgen_busy']:.0%} (its own processes "
                      f"{r['loadgen_share']:.0%})", flush=True)
    load_after = os.getloadavg()
    base = statistics.median(r["rate"] for r in results[kinds[0]]) if kinds[0] == "mosquitto" else None
    lines = [
        f"# QoS 0 fan-in over WebSockets ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"{args.publishers} publishers x {args.count} QoS 0 PUBLISH (64-byte payload, one WebSocket frame each) -> "
        f"1 subscriber of bench/#; median of {args.runs} runs (min-max); {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after.",
        "",
        "| broker | delivered msgs/s | vs Mosquitto | lost | broker CPU us/msg | broker core busy | "
        "load generator core busy (its own processes) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    vers = versions()
    try:  # edge-gateway's WebSocket layer (gateway/server/websocket.py)
        vers["edge-gateway"] = f"{vers.get('edge-gateway', '')} (websockets {importlib.metadata.version('websockets')})"
    except importlib.metadata.PackageNotFoundError:
        pass
    for kind in kinds:
        rs = results[kind]
        rates = [r["rate"] for r in rs]
        med = statistics.median(rates)
        ratio = f"{med / base:.2f}" if base else "-"
        lines.append(
            f"| {kind} {vers.get(kind, '')} | {med:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | {ratio} | "
            f"{statistics.median(r['lost'] for r in rs):.0f} | {statistics.median(r['broker_us'] for r in rs):.1f} | "
            f"{statistics.median(r['broker_busy'] for r in rs):.0%} | "
            f"{statistics.median(r['loadgen_busy'] for r in rs):.0%} "
            f"({statistics.median(r['loadgen_share'] for r in rs):.0%}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
