"""Load generator for the side-by-side benchmarks (bench/run.py), and its self-check against a do-nothing sink.

Every packet is encoded and parsed with the project's codec (``gateway.mqtt``): a PUBLISH is encoded once as a
template with :class:`~gateway.mqtt.packets.Publish`, copied into large batches and patched in place (publisher id,
sequence number, send time, Packet Identifier); received bytes go through
:class:`~gateway.mqtt.framing.PacketReader`. Publishers and subscribers run in separate processes
(multiprocessing, fork) so none waits on another's GIL.

Payload (64 bytes): ``>HIQ`` publisher id, sequence number, ``time.time_ns()`` when the batch was written, then
padding. Subscribers check every message: count, per-publisher sequence (losses, duplicates, order) and
end-to-end latency.

Safety: everything binds and connects to 127.0.0.1 only. A worker refuses a :class:`Target` unless the port is
listened on by the target's process and that process is a child of the harness that started it
(:func:`check_target`); workers stop by themselves at their deadline.

Self-check (the load generator's ceiling; the sink runs on core 0, the load generator on core 1)::

    .venv/bin/python bench/loadgen.py --self-check [--seconds 2] [--json] [--faults] [--no-pin]
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing as mp
import os
import queue
import selectors
import socket
import ssl
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.mqtt.framing import PacketReader  # noqa: E402
from gateway.mqtt.packets import (  # noqa: E402
    Connack,
    Connect,
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Suback,
    Subscribe,
    Subscription,
    decode_packet,
)

HOST = "127.0.0.1"  # the only address this module ever binds or connects to
VERSION = 4  # MQTT 3.1.1 everywhere: the three brokers all speak it
PAYLOAD_SIZE = 64
HEADER = struct.Struct(">HIQ")  # publisher id, sequence number, send time (ns)
PID_HEADER = struct.Struct(">HHIQ")  # Packet Identifier directly followed by the payload header (QoS 1, 3.1.1)
BATCH = 512  # QoS 0 messages per write (about 42 KB)
DISCONNECT = Disconnect().encode(VERSION)
ACKS = [PubAck(i).encode(VERSION) if i else b"" for i in range(65536)]  # pre-encoded PUBACK per Packet Identifier


def _acks(packet: type[Any]) -> list[bytes]:
    """One QoS 2 acknowledgement per Packet Identifier: encoded once by the codec, its identifier patched."""
    head = packet(1).encode(VERSION)[:-2]
    return [head + i.to_bytes(2, "big") if i else b"" for i in range(65536)]


RECS, RELS, COMPS = _acks(PubRec), _acks(PubRel), _acks(PubComp)  # QoS 2 flow (MQTT 3.1.1 §4.3.3)
USERNAME = "bench"  # amqtt keeps a Clean Session = 0 session only for a client that is not anonymous
# A QoS 0 subscriber whose read returned less than COALESCE_BELOW bytes sleeps COALESCE_SLEEP seconds before the next
# read, so that a broker writing one packet per send() does not make the load generator pay a wake-up and a read
# per packet (QoS 1 subscribers never wait: their PUBACKs pace the broker).
COALESCE_BELOW = 16384
COALESCE_SLEEP = 0.002
LOADGEN_CPU = 1
BROKER_CPU = 0


class TargetError(RuntimeError):
    """The port is not one the harness started a broker (or sink) on."""


@dataclass(frozen=True)
class Target:
    """A broker the harness started: ``pid`` listens on ``127.0.0.1:port`` and is a child of ``owner``."""

    port: int
    pid: int
    owner: int
    name: str = "broker"
    cafile: str | None = None  # TLS: connect with TLS, verifying the broker's certificate (for "localhost") with it
    password: str | None = None  # sent with USERNAME in every CONNECT (a broker with a password file)


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (from /proc/PID/stat); -1 when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return -1
    return int(data[data.rindex(")") + 2 :].split()[1])


def _listen_inodes(port: int) -> set[str]:
    want = f"0100007F:{port:04X}"
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[1] == want and parts[3] == "0A":  # 0A = LISTEN
                inodes.add(parts[9])
    return inodes


def check_target(target: Target) -> None:
    """Refuse any port the harness did not start a broker on.

    Raises:
        TargetError: nothing listens on 127.0.0.1:port, the listening socket is not held by ``target.pid``, or
            ``target.pid`` is not a child of ``target.owner``.
    """
    if not 0 < target.port < 65536:
        raise TargetError(f"bad port {target.port}")
    if parent_pid(target.pid) != target.owner:
        raise TargetError(f"process {target.pid} ({target.name}) is not a child of the harness {target.owner}")
    inodes = _listen_inodes(target.port)
    if not inodes:
        raise TargetError(f"nothing listens on {HOST}:{target.port}")
    try:
        fds = os.listdir(f"/proc/{target.pid}/fd")
    except OSError as exc:
        raise TargetError(f"cannot read the sockets of process {target.pid}: {exc}") from None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{target.pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return
    raise TargetError(f"{HOST}:{target.port} is not listened on by {target.name} (pid {target.pid})")


def payload_template() -> bytes:
    return HEADER.pack(0, 0, 0).ljust(PAYLOAD_SIZE, b".")


class Template:
    """One PUBLISH encoded by the codec, copied into batches and patched in place."""

    def __init__(self, topic: str, qos: int) -> None:
        packet = Publish(topic, payload_template(), qos, packet_id=1 if qos else None).encode(VERSION)
        self.packet = packet
        self.size = len(packet)
        self.qos = qos
        self.payload_off = self.size - PAYLOAD_SIZE
        self.pid_off = self.payload_off - 2
        self._buf = bytearray(packet * BATCH)
        # The offsets must hold: decode a patched copy with the codec.
        probe = bytearray(packet)
        self._patch(probe, 0, 7, 12345, 1, 99)
        p = next(PacketReader(version=VERSION).feed(bytes(probe)))
        assert isinstance(p, Publish) and HEADER.unpack_from(p.payload) == (7, 12345, 99), p
        assert not qos or p.packet_id == 12345 % 65535 + 1

    def _patch(self, buf: bytearray, index: int, pub: int, seq: int, n: int, ts: int) -> None:
        size = self.size
        if self.qos:
            pack, off = PID_HEADER.pack_into, self.pid_off + index * size
            for s in range(seq, seq + n):
                pack(buf, off, s % 65535 + 1, pub, s, ts)
                off += size
        else:
            pack, off = HEADER.pack_into, self.payload_off + index * size
            for s in range(seq, seq + n):
                pack(buf, off, pub, s, ts)
                off += size

    def batch(self, pub: int, seq: int, n: int, ts: int) -> memoryview:
        """``n`` packets for publisher ``pub`` with sequence numbers ``seq..seq+n-1`` (n <= BATCH); the buffer is
        reused by the next call."""
        buf = self._buf
        self._patch(buf, 0, pub, seq, n, ts)
        return memoryview(buf)[: n * self.size]

    def stream(self, pubs: int, per_pub: int, ts: int = 0, order: list[tuple[int, int]] | None = None) -> bytes:
        """A pre-encoded stream: ``per_pub`` messages from each of ``pubs`` publishers, interleaved round-robin
        (or exactly ``order``, a list of (publisher, seq))."""
        if order is None:
            order = [(p, s) for s in range(per_pub) for p in range(pubs)]
        buf = bytearray(self.packet * len(order))
        size = self.size
        if self.qos:
            pack, off = PID_HEADER.pack_into, self.pid_off
            for i, (p, s) in enumerate(order):
                pack(buf, off + i * size, (i % 65535) + 1, p, s, ts)
        else:
            pack, off = HEADER.pack_into, self.payload_off
            for i, (p, s) in enumerate(order):
                pack(buf, off + i * size, p, s, ts)
        return bytes(buf)


# ---------------------------------------------------------------------------------------------------------------
# blocking MQTT helpers


#: what a read that timed out raises: BlockingIOError (SO_RCVTIMEO), TimeoutError (a TLS socket's timeout)
WOULD_BLOCK = (BlockingIOError, TimeoutError)


def _recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose recv gives up after ``seconds`` (BlockingIOError): one syscall per read instead
    of poll + recv. A TLS socket gets a Python timeout instead (TimeoutError): its read would retry through
    SO_RCVTIMEO's EAGAIN and never return."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


_TLS_CONTEXTS: dict[str, ssl.SSLContext] = {}


def _socket(target: Target, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((HOST, target.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if target.cafile:
        ctx = _TLS_CONTEXTS.get(target.cafile)
        if ctx is None:
            ctx = _TLS_CONTEXTS[target.cafile] = ssl.create_default_context(cafile=target.cafile)
        try:
            sock = ctx.wrap_socket(sock, server_hostname="localhost")
        except BaseException:
            sock.close()
            raise
    return sock


def mqtt_connect(target: Target, client_id: str, clean: bool = True, keep_alive: int = 60,
                 timeout: float = 10.0) -> tuple[socket.socket, PacketReader, list[Any], bool]:
    """CONNECT and wait for a successful CONNACK; returns the socket, its reader, the packets that arrived after
    the CONNACK, and Session Present."""
    sock = _socket(target, timeout)
    try:
        password = target.password.encode() if target.password is not None else None
        sock.sendall(Connect(client_id, VERSION, clean, keep_alive, username=USERNAME, password=password)
                     .encode(VERSION))
        reader = PacketReader(version=VERSION)
        pending: list[Any] = []
        while not pending:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"{target.name} closed the connection before CONNACK")
            pending.extend(reader.feed(data))
        connack = pending.pop(0)
        if not isinstance(connack, Connack) or connack.reason_code != 0:
            raise ConnectionError(f"{target.name} refused CONNECT: {connack!r}")
    except BaseException:
        sock.close()
        raise
    return sock, reader, pending, connack.session_present


def mqtt_subscribe(sock: socket.socket, reader: PacketReader, pending: list[Any], topic_filter: str,
                   qos: int) -> int:
    """SUBSCRIBE and wait for the SUBACK; returns the granted QoS. Packets other than the SUBACK stay in
    ``pending``."""
    sock.sendall(Subscribe(1, [Subscription(topic_filter, qos)]).encode(VERSION))
    while True:
        for i, p in enumerate(pending):
            if isinstance(p, Suback):
                del pending[i]
                return p.reason_codes[0]
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("connection closed before SUBACK")
        pending.extend(reader.feed(data))


def close_gracefully(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Send DISCONNECT, half-close and wait until the peer closes (so everything sent before was read).
    Returns True when the peer closed within ``timeout``."""
    try:
        sock.settimeout(timeout)
        sock.sendall(DISCONNECT)
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.recv(1 << 16):
                return True
    except OSError:
        return True
    finally:
        sock.close()
    return False


def prepare_persistent_subscriber(target: Target, client_id: str, topic_filter: str, qos: int = 1) -> None:
    """Create a persistent session (Clean Session = 0) subscribed to ``topic_filter`` and leave it offline; returns
    once the broker closed the connection after our DISCONNECT, so the session is known offline."""
    check_target(target)
    sock, reader, pending, _ = mqtt_connect(target, client_id, clean=False)
    mqtt_subscribe(sock, reader, pending, topic_filter, qos)
    if not close_gracefully(sock):
        raise RuntimeError(f"{target.name} did not close the subscriber after DISCONNECT")


# ---------------------------------------------------------------------------------------------------------------
# workers (each runs in its own process and reports on the queue as (kind, name, payload))


@dataclass
class Control:
    """Shared between the harness and its workers."""

    go: Any
    pubs_done: Any
    release: Any
    expect: Any  # messages each subscriber must get (-1 = not known yet)
    deadline: float  # time.monotonic() after which every worker stops


@dataclass
class SubSpec:
    """One subscriber connection. ``topic_filter`` None resumes a persistent session without subscribing."""

    client_id: str
    topic_filter: str | None
    qos: int = 0
    clean: bool = True
    pubs: int = 1  # publisher ids 0..pubs-1
    per_pub: int = 1024  # initial bitmap size per publisher


@dataclass
class _SubState:
    spec: SubSpec
    sock: socket.socket
    reader: PacketReader
    seen: list[bytearray]
    last: list[int]
    received: int = 0
    uniq: int = 0
    dups: int = 0
    ooo: int = 0
    bad: int = 0
    dup_flag: int = 0
    first_ns: int = 0
    last_ns: int = 0
    session_present: bool = False
    closed: bool = False
    lat: array.array = field(default_factory=lambda: array.array("q"))


def _process(st: _SubState, packets: Any, now_ns: int, latency: bool) -> bytes:
    """Check every PUBLISH in ``packets``; returns the PUBACKs to send."""
    seen, last, lat = st.seen, st.last, st.lat
    npubs = len(seen)
    unpack = HEADER.unpack_from
    acks = []
    received = uniq = dups = ooo = bad = dupf = 0
    for p in packets:
        if p.TYPE != 3:
            if p.TYPE == 6:  # PUBREL of a QoS 2 delivery: PUBCOMP (the message was counted at its PUBLISH)
                acks.append(COMPS[p.packet_id])
            continue
        received += 1
        if p.qos:
            acks.append(ACKS[p.packet_id] if p.qos == 1 else RECS[p.packet_id])
            if p.dup:
                dupf += 1
        payload = p.payload
        if len(payload) != PAYLOAD_SIZE:
            bad += 1
            continue
        pub, seq, ts = unpack(payload)
        if pub >= npubs:
            bad += 1
            continue
        bm = seen[pub]
        if seq >= len(bm):
            bm.extend(bytes(seq + 1 - len(bm) + 65536))
        if bm[seq]:
            dups += 1
            continue
        bm[seq] = 1
        uniq += 1
        if seq < last[pub]:
            ooo += 1
        else:
            last[pub] = seq
        if latency:
            lat.append(now_ns - ts)
    if received:
        if not st.first_ns:
            st.first_ns = now_ns
        st.last_ns = time.time_ns()  # after checking them: a big read takes a while to go through
        st.received += received
        st.uniq += uniq
        st.dups += dups
        st.ooo += ooo
        st.bad += bad
        st.dup_flag += dupf
    return b"".join(acks) if acks else b""


def _receive_one(st: _SubState, ctl: Control, latency: bool, idle: float) -> None:
    """One subscriber: blocking reads with a short timeout (one syscall per read)."""
    sock = st.sock
    tls = isinstance(sock, ssl.SSLSocket)
    _recv_timeout(sock, 0.05)
    last_data = time.monotonic()
    while True:
        now = time.monotonic()
        if now > ctl.deadline:
            break
        expect = ctl.expect.value
        if expect >= 0 and st.uniq >= expect:
            break
        if ctl.pubs_done.is_set() and now - last_data > idle:
            break
        try:
            data = sock.recv(1 << 20)
        except WOULD_BLOCK:
            continue
        except OSError:
            data = b""
        if not data:
            st.closed = True
            break
        last_data = time.monotonic()
        acks = _process(st, st.reader.feed(data), time.time_ns(), latency)
        if acks:
            sock.sendall(acks)
        elif len(data) < COALESCE_BELOW and not tls:  # a TLS read returns one record (<= 16 KiB) at most
            time.sleep(COALESCE_SLEEP)


def _receive_many(states: list[_SubState], ctl: Control, latency: bool, idle: float) -> None:
    """Several subscribers in one process, multiplexed with a selector."""
    sel = selectors.DefaultSelector()
    for st in states:
        sel.register(st.sock, selectors.EVENT_READ, st)
    last_data = time.monotonic()
    open_count = len(states)
    qos0 = all(st.spec.qos == 0 for st in states)
    while open_count:
        now = time.monotonic()
        if now > ctl.deadline:
            break
        expect = ctl.expect.value
        if expect >= 0 and all(st.uniq >= expect for st in states):
            break
        if ctl.pubs_done.is_set() and now - last_data > idle:
            break
        events = sel.select(0.05)
        if not events:
            continue
        now_ns = time.time_ns()
        last_data = time.monotonic()
        largest = 0
        for key, _ in events:
            st = key.data
            try:
                data = st.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                st.closed = True
                sel.unregister(st.sock)
                open_count -= 1
                continue
            largest = max(largest, len(data))
            acks = _process(st, st.reader.feed(data), now_ns, latency)
            if acks:
                st.sock.sendall(acks)
        if qos0 and largest < COALESCE_BELOW:
            time.sleep(COALESCE_SLEEP)
    sel.close()


def run_subscribers(target: Target, specs: list[SubSpec], ctl: Control, out: Any, name: str, latency: bool = False,
                    bitmaps: bool = False, idle: float = 1.0) -> None:
    """Connect and subscribe every spec, report ``ready``, then receive and check until each subscriber got
    ``ctl.expect`` distinct messages, or the publishers are done and nothing arrived for ``idle`` seconds, or the
    deadline. Reports ``done`` with per-subscriber tallies."""
    check_target(target)
    states: list[_SubState] = []
    t_connect = time.time_ns()
    for spec in specs:
        sock, reader, pending, present = mqtt_connect(target, spec.client_id, spec.clean)
        st = _SubState(spec, sock, reader, [bytearray(spec.per_pub) for _ in range(spec.pubs)], [-1] * spec.pubs,
                       session_present=present)
        if spec.topic_filter is not None:
            mqtt_subscribe(sock, reader, pending, spec.topic_filter, spec.qos)
        if pending:  # a resumed session may start delivering right after CONNACK
            acks = _process(st, pending, time.time_ns(), latency)
            if acks:
                sock.sendall(acks)
        sock.settimeout(None)
        states.append(st)
    out.put(("ready", name, {"subscribers": len(states)}))
    if len(states) == 1:
        _receive_one(states[0], ctl, latency, idle)
    else:
        _receive_many(states, ctl, latency, idle)
    for st in states:
        if not st.closed:
            try:
                st.sock.sendall(DISCONNECT)
            except OSError:
                pass
        st.sock.close()
    subs = []
    for st in states:
        sub: dict[str, Any] = {
            "client_id": st.spec.client_id, "received": st.received, "unique": st.uniq, "dups": st.dups,
            "out_of_order": st.ooo, "bad": st.bad, "dup_flag": st.dup_flag, "first_ns": st.first_ns,
            "last_ns": st.last_ns, "closed_by_broker": st.closed, "session_present": st.session_present,
            "unique_per_pub": [bm.count(1) for bm in st.seen],
        }
        if bitmaps:
            sub["bitmaps"] = [bytes(bm) for bm in st.seen]
        if latency:
            sub["latency_ns"] = st.lat.tobytes()
        subs.append(sub)
    out.put(("done", name, {"t_connect_ns": t_connect, "subscribers": subs}))


def run_publisher_qos0(target: Target, pub: int, topic: str, count: int, ctl: Control, out: Any, name: str,
                       duration: float = 0.0, rate: float = 0.0) -> None:
    """Publish ``count`` QoS 0 messages (or for ``duration`` seconds) in batches of BATCH, optionally paced at
    ``rate`` messages/s, then DISCONNECT and wait until the broker closed (it read everything)."""
    check_target(target)
    sock, _, _, _ = mqtt_connect(target, f"bench-pub{pub}-{os.getpid()}")
    tmpl = Template(topic, 0)
    out.put(("ready", name, {}))
    if not ctl.go.wait(max(0.0, ctl.deadline - time.monotonic())):
        sock.close()
        out.put(("done", name, {"sent": 0, "error": "never started"}))
        return
    sock.settimeout(max(1.0, ctl.deadline - time.monotonic()))
    t0 = time.time_ns()
    start = time.monotonic()
    stop_at = min(ctl.deadline, start + duration) if duration else ctl.deadline
    sent = 0
    error = None
    try:
        while sent < count:
            n = min(BATCH, count - sent)
            sock.sendall(tmpl.batch(pub, sent, n, time.time_ns()))
            sent += n
            now = time.monotonic()
            if now >= stop_at:
                break
            if rate:
                ahead = sent / rate - (now - start)
                if ahead > 0:
                    time.sleep(ahead)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    t1 = time.time_ns()
    closed = close_gracefully(sock, max(1.0, min(30.0, ctl.deadline - time.monotonic())))
    out.put(("done", name, {"pub": pub, "sent": sent, "t_start_ns": t0, "t_end_ns": t1, "t_closed_ns": time.time_ns(),
                            "closed_by_broker": closed, "error": error}))


def run_publisher_qos1(target: Target, pub: int, topic: str, count: int, ctl: Control, out: Any, name: str,
                       window: int = 32, duration: float = 0.0, client_id: str | None = None, qos: int = 1) -> None:
    """Publish QoS 1 with at most ``window`` unacknowledged, until ``count`` are acknowledged or ``duration`` is over
    (then wait for the outstanding PUBACKs), or the connection drops (a killed broker). Reports what was acked.

    ``qos=2``: the same with QoS 2; a PUBREC is answered with PUBREL, and a message counts as acknowledged (and
    leaves the window) at its PUBCOMP."""
    check_target(target)
    sock, reader, _, _ = mqtt_connect(target, client_id or f"bench-pub{pub}-{os.getpid()}")
    tmpl = Template(topic, qos)
    done_type = PubAck if qos == 1 else PubComp
    out.put(("ready", name, {}))
    if not ctl.go.wait(max(0.0, ctl.deadline - time.monotonic())):
        sock.close()
        out.put(("done", name, {"sent": 0, "acked": 0, "error": "never started"}))
        return
    t0 = time.time_ns()
    start = time.monotonic()
    stop_at = min(ctl.deadline, start + duration) if duration else ctl.deadline
    acked_bm = bytearray(min(count, 1 << 16))
    inflight = [0] * 65536
    sent = nacked = 0
    error = None
    _recv_timeout(sock, 0.5)
    last_ack = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            sending = sent < count and now < stop_at
            if sending:
                n = min(window - (sent - nacked), count - sent, BATCH)
                if n > 0:
                    if len(acked_bm) < sent + n:
                        acked_bm.extend(bytes(1 << 16))
                    for s in range(sent, sent + n):
                        inflight[s % 65535 + 1] = s
                    sock.sendall(tmpl.batch(pub, sent, n, time.time_ns()))
                    sent += n
            elif nacked >= sent:
                break
            if now > ctl.deadline + 10 or (not sending and now - last_ack > 10):
                error = f"{sent - nacked} PUBACKs missing"
                break
            try:
                data = sock.recv(1 << 16)
            except WOULD_BLOCK:
                continue
            if not data:
                error = "connection closed by the broker"
                break
            rels = []
            for p in reader.feed(data):
                if isinstance(p, done_type):
                    s = inflight[p.packet_id]
                    if not acked_bm[s]:
                        acked_bm[s] = 1
                        nacked += 1
                        last_ack = time.monotonic()
                elif isinstance(p, PubRec):
                    rels.append(RELS[p.packet_id])
            if rels:
                sock.sendall(b"".join(rels))
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    t1 = time.time_ns()
    if error is None:
        if not isinstance(sock, ssl.SSLSocket):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        close_gracefully(sock, 5.0)
    else:
        sock.close()
    out.put(("done", name, {"pub": pub, "sent": sent, "acked": nacked, "acked_bitmap": bytes(acked_bm[:sent]),
                            "t_start_ns": t0, "t_end_ns": t1, "error": error}))


def publish_retained(target: Target, prefix: str, n: int, window: int = 32, timeout: float = 60.0) -> None:
    """Publish ``n`` retained QoS 1 messages, one per topic ``{prefix}{i}`` (payload header: publisher 0, sequence
    ``i``), at most ``window`` unacknowledged; returns once every PUBACK arrived and the broker closed after our
    DISCONNECT (so every message is retained)."""
    check_target(target)
    sock, reader, _, _ = mqtt_connect(target, f"bench-retain-{os.getpid()}", timeout=timeout)
    packets = [Publish(f"{prefix}{i}", HEADER.pack(0, i, 0).ljust(PAYLOAD_SIZE, b"."), 1, retain=True,
                       packet_id=i % 65535 + 1).encode(VERSION) for i in range(n)]
    sent = acked = 0
    deadline = time.monotonic() + timeout
    while acked < n:
        if time.monotonic() > deadline:
            sock.close()
            raise TimeoutError(f"{acked} of {n} retained messages acknowledged in {timeout:.0f} s")
        k = min(window - (sent - acked), n - sent)
        if k > 0:
            sock.sendall(b"".join(packets[sent:sent + k]))
            sent += k
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError(f"{target.name} closed the connection while retained messages were published")
        acked += sum(1 for p in reader.feed(data) if isinstance(p, PubAck))
    if not close_gracefully(sock):
        raise RuntimeError(f"{target.name} did not close after DISCONNECT")


def run_retained_subscribers(target: Target, n_subs: int, topic_filter: str, expect: int, ctl: Control, out: Any,
                             name: str) -> None:
    """``n_subs`` clients connect at once (every socket connected first, then each sends CONNECT and SUBSCRIBE
    ``topic_filter`` QoS 0 in one write, all before any answer is read) and receive the retained messages; each
    PUBLISH is decoded and checked (RETAIN set, sequence number in the payload: losses and duplicates per
    subscriber). Reports ``ready`` once connected, then ``done`` when every subscriber has ``expect`` distinct
    messages, or the deadline."""
    check_target(target)
    socks = []
    for _ in range(n_subs):
        sock = _socket(target)
        socks.append(sock)
    out.put(("ready", name, {"subscribers": n_subs}))
    if not ctl.go.wait(max(0.0, ctl.deadline - time.monotonic())):
        for sock in socks:
            sock.close()
        out.put(("done", name, {"error": "never started"}))
        return
    sel = selectors.DefaultSelector()
    states = []
    t0 = time.time_ns()
    for i, sock in enumerate(socks):
        sock.sendall(Connect(f"bench-ret-{os.getpid()}-{i}", VERSION, True, 60, username=USERNAME).encode(VERSION)
                     + Subscribe(1, [Subscription(topic_filter, 0)]).encode(VERSION))
    for sock in socks:
        sock.setblocking(False)
        st = {"reader": PacketReader(version=VERSION), "seen": bytearray(expect), "uniq": 0, "dups": 0, "bad": 0,
              "not_retained": 0, "suback": False, "last_ns": 0}
        states.append(st)
        sel.register(sock, selectors.EVENT_READ, st)
    unpack = HEADER.unpack_from
    complete = 0
    closed = 0
    while complete + closed < n_subs and time.monotonic() < ctl.deadline:
        for key, _ in sel.select(0.2):
            st = key.data
            try:
                data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
                continue
            seen = st["seen"]
            uniq = st["uniq"]
            for p in st["reader"].feed(data):
                if p.TYPE != 3:
                    st["suback"] = st["suback"] or isinstance(p, Suback)
                    continue
                if not p.retain:
                    st["not_retained"] += 1
                if len(p.payload) != PAYLOAD_SIZE:
                    st["bad"] += 1
                    continue
                _, seq, _ = unpack(p.payload)
                if seq >= expect:
                    st["bad"] += 1
                elif seen[seq]:
                    st["dups"] += 1
                else:
                    seen[seq] = 1
                    uniq += 1
            if uniq != st["uniq"]:
                st["last_ns"] = time.time_ns()
                if uniq >= expect > st["uniq"]:
                    complete += 1
                st["uniq"] = uniq
    sel.close()
    for sock in socks:
        try:
            sock.setblocking(True)
            sock.sendall(DISCONNECT)
        except OSError:
            pass
        sock.close()
    out.put(("done", name, {"t_start_ns": t0, "last_ns": max(st["last_ns"] for st in states),
                            "unique": sum(st["uniq"] for st in states), "dups": sum(st["dups"] for st in states),
                            "bad": sum(st["bad"] for st in states), "complete": complete, "closed": closed,
                            "not_retained": sum(st["not_retained"] for st in states),
                            "subacks": sum(st["suback"] for st in states)}))


def run_idle(target: Target, n: int, ctl: Control, out: Any, name: str, keep_alive: int = 60,
             concurrency: int = 64) -> None:
    """Open ``n`` MQTT connections (at most ``concurrency`` handshakes at a time), report the time until the last
    CONNACK, hold them until ``ctl.release``, then reset them all (no TIME_WAIT left behind)."""
    check_target(target)
    sel = selectors.DefaultSelector()
    held: list[socket.socket] = []
    pending = 0
    started = connected = failed = 0
    prefix = f"idle-{os.getpid()}-"
    connack = Connack(False, 0).encode(VERSION)
    connects = [Connect(f"{prefix}{i}", VERSION, True, keep_alive, username=USERNAME).encode(VERSION) for i in range(n)]
    t = os.times()
    cpu0 = t.user + t.system
    t0 = time.monotonic()
    while connected + failed < n and time.monotonic() < ctl.deadline:
        while started < n and pending < concurrency:
            # A loopback connect completes at once while the listen queue has room, and at most `concurrency`
            # (below any listen backlog) wait for their CONNACK: connect and send CONNECT before registering.
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect((HOST, target.port))
                s.sendall(connects[started])
            except OSError:
                s.close()
                failed += 1
                started += 1
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, [started, b""])
            started += 1
            pending += 1
        for key, _ in sel.select(0.5):
            s = key.fileobj
            state = key.data
            try:
                data = s.recv(64)
            except OSError:
                data = b""
            state[1] += data
            if not data or len(state[1]) >= 4:
                sel.unregister(s)
                pending -= 1
                if state[1][:4] == connack:
                    connected += 1
                    held.append(s)
                else:
                    failed += 1
                    s.close()
    elapsed = time.monotonic() - t0
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
    t = os.times()
    out.put(("connected", name, {"connected": connected, "failed": failed, "elapsed": elapsed,
                                 "cpu_s": t.user + t.system - cpu0}))
    ctl.release.wait(max(0.0, ctl.deadline - time.monotonic()))
    linger = struct.pack("ii", 1, 0)
    for s in held:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        except OSError:
            pass
        s.close()
    out.put(("done", name, {"closed": len(held)}))


# The same opener in C (bench/cloadgen/cloadgen.c, built by `make cloadgen`): this Python one is the limit of
# Mosquitto's connect rate on one core (docs/benchmarks.md, "The C load generator").
CLOADGEN = Path(__file__).resolve().parent / "cloadgen" / "cloadgen"


def cloadgen_binary() -> str | None:
    """The C idle-connection generator's path when it is built, else None."""
    return str(CLOADGEN) if os.access(CLOADGEN, os.X_OK) else None


def run_idle_c(target: Target, n: int, ctl: Control, out: Any, name: str, keep_alive: int = 60,
               concurrency: int = 64) -> None:
    """:func:`run_idle` done by the C generator: the same CONNECT (3.1.1, Clean Session 1, user name
    :data:`USERNAME`), the same limit of ``concurrency`` handshakes at a time, the same ``connected`` report
    (``cpu_s`` is the C process's own CPU over ``elapsed``). This worker checks the target, starts the program
    (it inherits this process's core), waits for ``ctl.release`` and closes its stdin, which resets every
    connection.

    Raises:
        TargetError: as :func:`check_target`.
        RuntimeError: the program is not built, or exited without its report.
    """
    check_target(target)
    exe = cloadgen_binary()
    if exe is None:
        raise RuntimeError(f"{CLOADGEN} is not built (make cloadgen)")
    timeout = max(1.0, ctl.deadline - time.monotonic())
    cmd = [exe, "idle", "--host", HOST, "--port", str(target.port), "--connections", str(n), "--concurrency",
           str(concurrency), "--keep-alive", str(keep_alive), "--username", USERNAME, "--client-id-prefix",
           f"idle-{os.getpid()}-", "--timeout", f"{timeout:.1f}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"cloadgen exited with {proc.returncode} before its report: {err.strip()}")
        r = json.loads(line)
        out.put(("connected", name, r))
        ctl.release.wait(max(0.0, ctl.deadline - time.monotonic()))
        rest, err = proc.communicate(input="", timeout=30)  # stdin closed: the program resets its connections
        done = json.loads(rest.splitlines()[0]) if rest.strip() else {}
        if proc.returncode != 0 or not done:
            raise RuntimeError(f"cloadgen exited with {proc.returncode}: {err.strip()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.put(("done", name, done))


def _cloadgen_command(target: Target, ctl: Control, mode: str) -> list[str]:
    """``cloadgen MODE`` (``sub`` or ``pub``) on the target, user name :data:`USERNAME`, stopping by itself at the
    harness's deadline: the start of its command line.

    Raises:
        TargetError: as :func:`check_target`.
        RuntimeError: the program is not built, or the target needs TLS or a password (the C clients have
            neither: the rows they serve run on a plain listener).
    """
    check_target(target)
    exe = cloadgen_binary()
    if exe is None:
        raise RuntimeError(f"{CLOADGEN} is not built (make cloadgen)")
    if target.cafile or target.password is not None:
        raise RuntimeError("the C clients speak plain MQTT without a password: use the Python ones")
    timeout = max(1.0, ctl.deadline - time.monotonic())
    return [exe, mode, "--host", HOST, "--port", str(target.port), "--username", USERNAME, "--timeout",
            f"{timeout:.1f}"]


def _start_csub(target: Target, n: int, topic_filter: str, ctl: Control, *options: str) -> tuple[
        subprocess.Popen[str], dict[str, Any]]:
    """``cloadgen sub`` (bench/cloadgen/sub.c) with ``n`` subscribers to ``topic_filter`` on the target, user name
    :data:`USERNAME`, stopping by itself at the harness's deadline; returns the process and its ``ready`` line.

    Raises:
        TargetError: as :func:`check_target`.
        RuntimeError: the program is not built, the target needs TLS or a password (the C subscribers have
            neither: the rows they serve run on a plain listener), or it exited before ``ready``.
    """
    cmd = [*_cloadgen_command(target, ctl, "sub"), "--subscribers", str(n), "--topic-filter", topic_filter, *options]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"cloadgen sub exited with {proc.returncode} before ready: {err.strip()}")
    return proc, json.loads(line)


def _finish_csub(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The report ``cloadgen sub`` prints when it stops (it stops by itself by the deadline); then its stdin is
    closed and it exits.

    Raises:
        RuntimeError: it exited without its report, or not with status 0.
    """
    assert proc.stdout is not None
    line = proc.stdout.readline()
    _, err = proc.communicate(timeout=10)  # stdin closed: it exits
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"cloadgen sub exited with {proc.returncode}: {err.strip()}")
    report: dict[str, Any] = json.loads(line)
    return report


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    """A control line to ``cloadgen sub`` ("go", "expect N")."""
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def bits_to_bytes(hex_bits: str) -> bytes:
    """A C generator's bit-packed bitmap (bit ``s & 7`` of byte ``s >> 3`` for sequence number ``s``, in hex) as
    the Python workers keep theirs: one byte, 0 or 1, per sequence number."""
    return bytes((byte >> bit) & 1 for byte in bytes.fromhex(hex_bits) for bit in range(8))


def run_subscribers_c(target: Target, n: int, topic_filter: str, ctl: Control, out: Any, name: str, pubs: int = 1,
                      per_pub: int = 1024, client_id_prefix: str = "bench-sub-c", idle: float = 1.0, qos: int = 0,
                      latency: bool = False, bitmaps: bool = False) -> None:
    """:func:`run_subscribers` for ``n`` subscribers done by the C generator (``cloadgen sub``, one process,
    one thread): the same CONNECT (3.1.1, Clean Session 1, user name :data:`USERNAME`) and SUBSCRIBE at ``qos``,
    the same acknowledgements (PUBACK; PUBREC, and PUBCOMP per PUBREL), the same checks of every payload (per
    publisher ``0..pubs-1``: distinct, duplicates, out of order, bad), the same stop (``ctl.expect`` distinct each,
    or ``idle`` seconds without data once ``ctl.pubs_done``, or the deadline) and the same ``done`` report (with
    ``latency_ns`` and ``bitmaps`` when asked), which :func:`merge_subscribers` and :func:`latencies_ms` read.
    Client Identifiers are ``{client_id_prefix}{i}``. At QoS 0 it reads as :func:`_receive_many` does, waiting
    COALESCE_SLEEP after small reads; at QoS 1 and 2 every read is answered at once, as :func:`_receive_one` does.

    The program's own CPU from ``ready`` to its end (getrusage) is the report's ``generator_cpu_s``; the worker
    adds it to its own in :meth:`Workers.load` (the program inherits the worker's core).

    Raises:
        TargetError, RuntimeError: as :func:`_start_csub` and :func:`_finish_csub`.
    """
    options = ["--qos", str(qos), "--pubs", str(pubs), "--per-pub", str(per_pub), "--client-id-prefix",
               client_id_prefix, "--idle", str(idle), "--coalesce-us", str(0 if qos else int(COALESCE_SLEEP * 1e6))]
    proc, _ = _start_csub(target, n, topic_filter, ctl, *options, *(["--latency"] if latency else []),
                          *(["--bitmaps"] if bitmaps else []))
    try:
        out.put(("ready", name, {"subscribers": n, "generator": "cloadgen"}))
        if ctl.pubs_done.wait(max(0.0, ctl.deadline - time.monotonic())):
            _tell(proc, f"expect {ctl.expect.value}")
        r = _finish_csub(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for sub in r["subscribers"]:
        if "latency_ns" in sub:
            sub["latency_ns"] = array.array("q", sub["latency_ns"]).tobytes()
        if "bitmaps" in sub:
            sub["bitmaps"] = [bits_to_bytes(b) for b in sub["bitmaps"]]
    out.put(("done", name, {"t_connect_ns": r["t_connect_ns"], "subscribers": r["subscribers"],
                            "generator_cpu_s": r["cpu_s"], "generator_elapsed": r["elapsed"]}))


def run_publishers_c(target: Target, n: int, topic_prefix: str, ctl: Control, out: Any, name: str, window: int = 32,
                     duration: float = 4.0, qos: int = 1, count: int = 0) -> None:
    """:func:`run_publisher_qos1` for ``n`` publishers done by the C generator (``cloadgen pub``, one process, one
    thread; bench/cloadgen/pub.c): publisher ``i`` publishes to ``{topic_prefix}{i}`` at ``qos`` (1 or 2) with at
    most ``window`` unacknowledged for ``duration`` seconds from ``ctl.go`` (or until each sent ``count``, when
    given), the same payloads (publisher id, sequence number, send time) and Packet Identifiers. Reports ``ready``
    once every CONNACK is in, then one ``done`` with ``publishers``: each one's report as
    :func:`run_publisher_qos1` gives it (``acked_bitmap`` one byte per sequence number), and the program's CPU
    from ``go`` as ``generator_cpu_s``.

    Raises:
        TargetError: as :func:`check_target`.
        RuntimeError: the program is not built, the target needs TLS or a password, or it exited without its
            report.
    """
    cmd = [*_cloadgen_command(target, ctl, "pub"), "--publishers", str(n), "--topic-prefix", topic_prefix, "--qos",
           str(qos), "--window", str(window), "--duration", str(duration), "--client-id-prefix",
           f"bench-pub-c{os.getpid()}-", *(["--count", str(count)] if count else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if not proc.stdout.readline():
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"cloadgen pub exited with {proc.returncode} before ready: {err.strip()}")
        out.put(("ready", name, {"publishers": n, "generator": "cloadgen"}))
        if ctl.go.wait(max(0.0, ctl.deadline - time.monotonic())):
            _tell(proc, "go")
        line = proc.stdout.readline()
        _, err = proc.communicate(timeout=10)
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"cloadgen pub exited with {proc.returncode}: {err.strip()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = json.loads(line)
    for pub in r["publishers"]:
        pub["acked_bitmap"] = bits_to_bytes(pub["acked_bitmap"])[: pub["sent"]]
    out.put(("done", name, {"publishers": r["publishers"], "generator_cpu_s": r["cpu_s"],
                            "generator_elapsed": r["elapsed"]}))


def run_retained_subscribers_c(target: Target, n_subs: int, topic_filter: str, expect: int, ctl: Control, out: Any,
                               name: str) -> None:
    """:func:`run_retained_subscribers` done by the C generator (``cloadgen sub --at-once --retained``): every
    socket connected first, ``ready``; on ``ctl.go`` each sends CONNECT and SUBSCRIBE ``topic_filter`` QoS 0 in one
    write, all before any answer is read; every PUBLISH checked as there (RETAIN set, the payload's sequence number
    below ``expect``: distinct, duplicates, bad). The same ``done`` report, with the program's CPU from ``ready`` as
    ``generator_cpu_s`` (added to the worker's in :meth:`Workers.load`).

    Raises:
        TargetError, RuntimeError: as :func:`_start_csub` and :func:`_finish_csub`.
    """
    proc, _ = _start_csub(target, n_subs, topic_filter, ctl, "--at-once", "--retained", "--expect", str(expect),
                          "--client-id-prefix", f"bench-ret-c{os.getpid()}-")
    try:
        out.put(("ready", name, {"subscribers": n_subs, "generator": "cloadgen"}))
        if not ctl.go.wait(max(0.0, ctl.deadline - time.monotonic())):
            proc.kill()
            proc.wait()
            out.put(("done", name, {"error": "never started"}))
            return
        _tell(proc, "go")
        r = _finish_csub(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    subs = r["subscribers"]
    out.put(("done", name, {"t_start_ns": r["t_start_ns"], "last_ns": max(s["last_ns"] for s in subs),
                            "unique": sum(s["unique"] for s in subs), "dups": sum(s["dups"] for s in subs),
                            "bad": sum(s["bad"] for s in subs),
                            "complete": sum(1 for s in subs if s["unique"] >= expect),
                            "closed": sum(1 for s in subs if s["closed_by_broker"]),
                            "not_retained": sum(s["not_retained"] for s in subs),
                            "subacks": sum(1 for s in subs if s["suback"]),
                            "generator_cpu_s": r["cpu_s"], "generator_elapsed": r["elapsed"]}))


# ---------------------------------------------------------------------------------------------------------------
# the do-nothing sink (and source)


@dataclass
class StreamSpec:
    """What the sink streams to each connection that subscribes: ``pubs`` x ``per_pub`` pre-encoded PUBLISH
    packets of QoS ``qos``. ``faults`` injects one loss, one duplicate and one swap (for the self-test)."""

    pubs: int
    per_pub: int
    qos: int = 0
    faults: bool = False
    start_after: int = 1  # stream only once this many connections have subscribed (all start together)


def _stream_order(spec: StreamSpec) -> list[tuple[int, int]]:
    order = [(p, s) for s in range(spec.per_pub) for p in range(spec.pubs)]
    if spec.faults:
        # publisher 0: seq 10 lost, seq 20 twice, seq 31 before seq 30
        i10 = order.index((0, 10))
        del order[i10]
        i20 = order.index((0, 20))
        order.insert(i20 + 1, (0, 20))
        i30, i31 = order.index((0, 30)), order.index((0, 31))
        order[i30], order[i31] = order[i31], order[i30]
    return order


class _SinkConn:
    __slots__ = ("acks", "buf", "closing", "out", "publishes", "sock", "stream_pos", "streaming")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.out = bytearray()
        self.publishes = 0
        self.acks = 0
        self.streaming = False
        self.stream_pos = 0
        self.closing = False


def run_sink(port_pipe: Any, stream: StreamSpec | None, stop: Any, out: Any, cpu: int | None,
             deadline: float) -> None:
    """A do-nothing MQTT server on 127.0.0.1:0: CONNACK for CONNECT, SUBACK for SUBSCRIBE (then, with
    ``stream``, it streams the pre-encoded PUBLISH packets), PUBACK for QoS 1 PUBLISH, PINGRESP for PINGREQ;
    everything else is counted and discarded. Reports totals when ``stop`` is set."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((HOST, 0))
    lsock.listen(4096)
    lsock.setblocking(False)
    data = b""
    if stream is not None:
        data = Template("bench/src", stream.qos).stream(stream.pubs, stream.per_pub, order=_stream_order(stream))
    view = memoryview(data)
    port_pipe.send(lsock.getsockname()[1])
    connack = Connack(False, 0).encode(VERSION)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ, None)
    conns: list[_SinkConn] = []
    totals = {"connections": 0, "publishes": 0, "acks": 0, "streamed": 0}

    subscribed: list[_SinkConn] = []
    go = stream is None or stream.start_after <= 1
    if go:
        totals["stream_start_ns"] = time.time_ns()

    def want(c: _SinkConn) -> int:
        w = c.out or (go and c.streaming and c.stream_pos < len(data))
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if w else 0)

    while not stop.is_set() and time.monotonic() < deadline:
        for key, ev in sel.select(0.05):
            if key.data is None:
                while True:
                    try:
                        s, _ = lsock.accept()
                    except BlockingIOError:
                        break
                    s.setblocking(False)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    c = _SinkConn(s)
                    conns.append(c)
                    totals["connections"] += 1
                    sel.register(s, selectors.EVENT_READ, c)
                continue
            c = key.data
            if ev & selectors.EVENT_READ:
                try:
                    chunk = c.sock.recv(1 << 20)
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(c.sock)
                    c.sock.close()
                    conns.remove(c)
                    totals["publishes"] += c.publishes
                    totals["acks"] += c.acks
                    continue
                buf = c.buf + chunk if c.buf else chunk
                pos, end = 0, len(buf)
                while pos + 2 <= end:
                    first = buf[pos]
                    length = buf[pos + 1]
                    hdr = 2
                    if length >= 128:
                        length &= 0x7F
                        shift = 7
                        complete = False
                        while pos + hdr < end and hdr <= 4:
                            b = buf[pos + hdr]
                            hdr += 1
                            length |= (b & 0x7F) << shift
                            shift += 7
                            if b < 128:
                                complete = True
                                break
                        if not complete:
                            break
                    stop_at = pos + hdr + length
                    if stop_at > end:
                        break
                    kind = first >> 4
                    if kind == 3:
                        c.publishes += 1
                        if first & 0x06:
                            tlen = (buf[pos + hdr] << 8) | buf[pos + hdr + 1]
                            i = pos + hdr + 2 + tlen
                            c.out += b"\x40\x02" + buf[i : i + 2]
                    elif kind == 4:
                        c.acks += 1
                    elif kind == 1:
                        c.out += connack
                    elif kind == 8:
                        sub = decode_packet(first, bytes(buf[pos + hdr : stop_at]), VERSION)
                        c.out += Suback(sub.packet_id, [s.qos for s in sub.subscriptions]).encode(VERSION)  # type: ignore[union-attr]
                        if stream is not None:
                            c.streaming = True
                            subscribed.append(c)
                    elif kind == 12:
                        c.out += b"\xd0\x00"
                    elif kind == 14:
                        c.closing = True
                    pos = stop_at
                c.buf = buf[pos:] if pos < end else b""
            if ev & selectors.EVENT_WRITE or c.out:
                try:
                    if c.out:
                        n = c.sock.send(c.out)
                        del c.out[:n]
                    if not c.out and go and c.streaming and c.stream_pos < len(data):
                        n = c.sock.send(view[c.stream_pos : c.stream_pos + (1 << 20)])
                        c.stream_pos += n
                except BlockingIOError:
                    pass
                except OSError:
                    pass
            if c.closing and not c.out:
                sel.unregister(c.sock)
                c.sock.close()
                conns.remove(c)
                totals["publishes"] += c.publishes
                totals["acks"] += c.acks
                continue
            if not go and stream is not None and len(subscribed) >= stream.start_after:
                go = True
                totals["stream_start_ns"] = time.time_ns()
                for other in subscribed:
                    if other is not c and other in conns:
                        sel.modify(other.sock, want(other), other)
            sel.modify(c.sock, want(c), c)
    for c in conns:
        totals["publishes"] += c.publishes
        totals["acks"] += c.acks
        c.sock.close()
    totals["streamed"] = len(data)
    lsock.close()
    sel.close()
    out.put(("sink", "sink", totals))


# ---------------------------------------------------------------------------------------------------------------
# orchestration


class Workers:
    """Spawns worker processes (fork) and collects their reports; every worker stops by ``deadline``."""

    def __init__(self, seconds: float) -> None:
        self.ctx = mp.get_context("fork")
        self.queue: Any = self.ctx.Queue()
        self.ctl = Control(self.ctx.Event(), self.ctx.Event(), self.ctx.Event(), self.ctx.Value("q", -1, lock=False),
                           time.monotonic() + seconds)
        self.procs: list[Any] = []
        self.reports: dict[str, dict[str, Any]] = {}
        self._stash: list[tuple[str, str, Any]] = []

    def spawn(self, fn: Callable[..., None], *args: Any, **kw: Any) -> str:
        name = f"{fn.__name__}-{len(self.procs)}"
        proc = self.ctx.Process(target=_guard, args=(fn, args, kw, self.queue, name), name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        return name

    def collect(self, kind: str, names: list[str], timeout: float) -> dict[str, Any]:
        """Wait for one ``kind`` report from each of ``names``; raises on a worker error or the timeout."""
        got: dict[str, Any] = {}
        for item in list(self._stash):
            if item[0] == kind and item[1] in names:
                got[item[1]] = item[2]
                self._stash.remove(item)
        deadline = time.monotonic() + timeout
        while len(got) < len(names):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind!r} report from {sorted(set(names) - set(got))} in {timeout:.0f} s")
            try:
                item = self.queue.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [p.name for p in self.procs if p.name in names and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"worker(s) {dead} died") from None
                continue
            if item[0] == "error":
                raise RuntimeError(f"worker {item[1]} failed:\n{item[2]}")
            if item[0] == kind and item[1] in names:
                got[item[1]] = item[2]
            else:
                self._stash.append(item)
        return got

    def load(self, names: list[str] | None = None, timeout: float = 5.0) -> float:
        """The load generator's own CPU use as a fraction of one core: the CPU seconds every worker process used
        after it reported ``ready`` (with the CPU of a C generator it ran, from the program's own report), divided
        by the wall time from the first ``ready`` to the last end (workers share one core, so near 1.0 means the
        load generator may be the bottleneck)."""
        reports = self.collect("cpu", names or [p.name for p in self.procs], timeout)
        start = min(r["start"] for r in reports.values())
        end = max(r["end"] for r in reports.values())
        return sum(r["cpu_s"] for r in reports.values()) / max(1e-9, end - start)

    def close(self) -> None:
        self.ctl.release.set()
        self.ctl.pubs_done.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(2)
        self.queue.close()
        self.queue.join_thread()


class _Out:
    """The report queue as a worker sees it: notes the process CPU time when the worker reports ``ready`` (or
    ``connected``), so that :meth:`Workers.load` counts only the measured part."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.cpu_ready = 0.0
        self.sys_ready = 0.0
        self.t_ready = time.monotonic()
        self.generator_cpu = 0.0  # a C generator's own CPU after ready (its report's generator_cpu_s)

    def put(self, item: tuple[str, str, Any]) -> None:
        if item[0] == "ready":
            t = os.times()
            self.cpu_ready = t.user + t.system
            self.sys_ready = t.system
            self.t_ready = time.monotonic()
        elif item[0] == "done" and isinstance(item[2], dict):
            self.generator_cpu += float(item[2].get("generator_cpu_s", 0.0))
        self.queue.put(item)


def _guard(fn: Callable[..., None], args: tuple[Any, ...], kw: dict[str, Any], out: Any, name: str) -> None:
    proxy = _Out(out)
    try:
        fn(*args, out=proxy, name=name, **kw)
    except BaseException:
        out.put(("error", name, traceback.format_exc()))
        return
    t = os.times()
    out.put(("cpu", name, {"cpu_s": t.user + t.system - proxy.cpu_ready + proxy.generator_cpu,
                           "sys_s": t.system - proxy.sys_ready, "generator_cpu_s": proxy.generator_cpu,
                           "start": proxy.t_ready, "end": time.monotonic()}))


class Sink:
    """The do-nothing sink in its own process (pinned to ``cpu``); ``target`` is safe to hand to workers."""

    def __init__(self, stream: StreamSpec | None = None, cpu: int | None = None, seconds: float = 120.0) -> None:
        ctx = mp.get_context("fork")
        self.queue: Any = ctx.Queue()
        self.stop_event = ctx.Event()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_sink, args=(child, stream, self.stop_event, self.queue, cpu,
                                                       time.monotonic() + seconds), daemon=True, name="sink")
        self.proc.start()
        if not parent.poll(10):
            self.proc.terminate()
            raise RuntimeError("sink did not start")
        port = parent.recv()
        parent.close()
        self.target = Target(port, self.proc.pid, os.getpid(), "sink")

    def stop(self) -> dict[str, int]:
        self.stop_event.set()
        try:
            totals = self.queue.get(timeout=10)[2]
        except queue.Empty:
            totals = {}
        self.proc.join(5)
        self.queue.close()
        self.queue.join_thread()
        return totals


class CSink:
    """The C do-nothing sink (``cloadgen sink``) on ``cpu``: CONNACK for every CONNECT, nothing else. Its ceiling
    is the C generator's: a Python sink would be the limit instead. ``target`` is safe to hand to workers."""

    def __init__(self, cpu: int | None = None) -> None:
        exe = cloadgen_binary()
        if exe is None:
            raise RuntimeError(f"{CLOADGEN} is not built (make cloadgen)")
        cmd = [exe, "sink"] + (["--cpu", str(cpu)] if cpu is not None and cpu < (os.cpu_count() or 1) else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the C sink did not start: {self.proc.communicate()[1].strip()}")
        self.target = Target(json.loads(line)["port"], self.proc.pid, os.getpid(), "cloadgen sink")

    def stop(self) -> dict[str, int]:
        try:
            rest, _ = self.proc.communicate(input="", timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return {}
        return json.loads(rest.splitlines()[0]) if rest.strip() else {}


def merge_subscribers(reports: dict[str, Any]) -> dict[str, Any]:
    """Add up the per-subscriber tallies of every subscriber worker."""
    subs = [s for r in reports.values() for s in r["subscribers"]]
    total = {k: sum(s[k] for s in subs) for k in ("received", "unique", "dups", "out_of_order", "bad", "dup_flag")}
    firsts = [s["first_ns"] for s in subs if s["first_ns"]]
    total["first_ns"] = min(firsts) if firsts else 0
    total["last_ns"] = max((s["last_ns"] for s in subs), default=0)
    total["subscribers"] = subs
    total["t_connect_ns"] = min(r["t_connect_ns"] for r in reports.values())
    return total


def latencies_ms(reports: dict[str, Any]) -> list[float]:
    """Every latency sample of every subscriber, sorted, in milliseconds."""
    lat = array.array("q")
    for r in reports.values():
        for s in r["subscribers"]:
            if "latency_ns" in s:
                lat.frombytes(s["latency_ns"])
    return sorted(x / 1e6 for x in lat)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


# ---------------------------------------------------------------------------------------------------------------
# self-check: the load generator against the sink


def _pin(cpu: int | None) -> None:
    if cpu is not None and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def _check_publish(qos: int, seconds: float, pin: bool, publishers: int = 4) -> dict[str, Any]:
    sink = Sink(cpu=BROKER_CPU if pin else None, seconds=seconds + 60)
    w = Workers(seconds + 30)
    try:
        names = []
        for i in range(publishers):
            if qos:
                names.append(w.spawn(run_publisher_qos1, sink.target, i, f"bench/self/p{i}", 1 << 30, w.ctl,
                                     window=32, duration=seconds))
            else:
                names.append(w.spawn(run_publisher_qos0, sink.target, i, f"bench/self/p{i}", 1 << 30, w.ctl,
                                     duration=seconds))
        w.collect("ready", names, 20)
        w.ctl.go.set()
        done = w.collect("done", names, seconds + 30)
    finally:
        w.close()
        totals = sink.stop()
    errors = [d["error"] for d in done.values() if d.get("error")]
    t0 = min(d["t_start_ns"] for d in done.values())
    t1 = max(d["t_end_ns"] for d in done.values())
    sent = sum(d["sent"] for d in done.values())
    res: dict[str, Any] = {"sent": sent, "sink_received": totals.get("publishes", -1), "errors": errors,
                           "rate": sent / max(1e-9, (t1 - t0) / 1e9)}
    if qos:
        acked = sum(d["acked"] for d in done.values())
        res["acked"] = acked
        res["acked_distinct_ok"] = all(d["acked_bitmap"].count(1) == d["acked"] for d in done.values())
        res["rate"] = acked / max(1e-9, (t1 - t0) / 1e9)
    return res


def _check_subscribe(qos: int, pubs: int, per_pub: int, subscribers: int, pin: bool, faults: bool,
                     seconds: float, c_generator: bool = False) -> dict[str, Any]:
    """Subscribers against the sink's fixed stream: Python ones in up to 5 worker processes, or with
    ``c_generator`` (QoS 0 only) all of them in one ``cloadgen sub`` (:func:`run_subscribers_c`)."""
    sink = Sink(StreamSpec(pubs, per_pub, qos, faults, start_after=subscribers), cpu=BROKER_CPU if pin else None,
                seconds=seconds + 60)
    w = Workers(seconds + 30)
    try:
        names = []
        if c_generator:
            names.append(w.spawn(run_subscribers_c, sink.target, subscribers, "bench/#", w.ctl, pubs=pubs,
                                 per_pub=per_pub, client_id_prefix="self-sub-c", idle=0.5))
        else:
            groups = min(subscribers, 5)
            for g in range(groups):
                specs = [SubSpec(f"self-sub{i}", "bench/#", qos, pubs=pubs, per_pub=per_pub)
                         for i in range(g, subscribers, groups)]
                names.append(w.spawn(run_subscribers, sink.target, specs, w.ctl, latency=False, idle=0.5))
        expected = pubs * per_pub - (1 if faults else 0)
        w.ctl.expect.value = expected
        w.ctl.pubs_done.set()  # the stream is fixed: stop after 0.5 s without data
        w.collect("ready", names, 20)
        done = w.collect("done", names, seconds + 30)
    finally:
        w.close()
        totals = sink.stop()
    m = merge_subscribers(done)
    # from the moment the sink started streaming (not the first read: data may wait in the socket buffers)
    elapsed = max(1e-9, (m["last_ns"] - totals.get("stream_start_ns", m["first_ns"])) / 1e9)
    lost = sum(pubs * per_pub - sum(s["unique_per_pub"]) for s in m["subscribers"])
    res = {"subscribers": subscribers, "expected_each": expected, "received": m["received"], "unique": m["unique"],
           "lost": lost, "dups": m["dups"], "out_of_order": m["out_of_order"], "bad": m["bad"],
           "acks_at_sink": totals.get("acks", -1), "rate": m["received"] / elapsed}
    if c_generator:
        r = next(iter(done.values()))
        res["generator_cpu"] = round(r["generator_cpu_s"] / max(1e-9, r["generator_elapsed"]), 3)
    return res


def _check_connect(n: int, pin: bool, c_generator: bool = False) -> dict[str, Any]:
    """The idle opener against a do-nothing sink: :func:`run_idle` against the Python sink, or with
    ``c_generator`` :func:`run_idle_c` against the C sink (a Python sink would bound the C generator)."""
    cpu = BROKER_CPU if pin else None
    sink: Sink | CSink = CSink(cpu=cpu) if c_generator else Sink(cpu=cpu)
    w = Workers(60)
    try:
        before = core_times()
        name = w.spawn(run_idle_c if c_generator else run_idle, sink.target, n, w.ctl)
        r = w.collect("connected", [name], 60)[name]
        after = core_times()
        w.ctl.release.set()
        w.collect("done", [name], 30)
    finally:
        w.close()
        totals = sink.stop()
    res = {"connected": r["connected"], "failed": r["failed"], "rate": r["connected"] / max(1e-9, r["elapsed"])}
    if c_generator:
        # which side was the limit: the generator's own CPU over its run, and both cores' busy share (the
        # kernel's handshake work is split between them)
        res.update({"generator_cpu": r["cpu_s"] / max(1e-9, r["elapsed"]), "sink_connacks": totals.get("connacks", -1),
                    "core_busy": {c: round(busy_fraction(before, after, c), 3) for c in sorted(after)}})
    return res


def self_check(seconds: float = 2.0, pin: bool = True, faults: bool = False, connections: int = 2000,
               only: set[str] | None = None, c_generator: bool = False,
               c_subscribers: bool = False) -> dict[str, Any]:
    """Measure the load generator's ceiling against the do-nothing sink and verify its counting.

    Publisher checks run for ``seconds``; subscriber checks get a fixed stream sized to take about that long at
    300k messages/s. Returns a dict of checks, each with ``rate`` (messages/s, or connections/s). ``connect_c``
    (the C generator against the C sink) runs with ``c_generator`` or when ``only`` names it;
    ``subscribe_fanout_c`` (the C subscribers, ``cloadgen sub``, against the sink's stream) with ``c_subscribers``
    or when named, ``subscribe_qos0_c`` (one C subscriber, four publishers' stream) only when named.
    """
    if pin:
        _pin(LOADGEN_CPU)
    per = max(2000, int(300_000 * seconds))
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "publish_qos0": lambda: _check_publish(0, seconds, pin),
        "publish_qos1": lambda: _check_publish(1, seconds, pin),
        "subscribe_qos0": lambda: _check_subscribe(0, 4, per // 4, 1, pin, faults, seconds),
        "subscribe_qos1": lambda: _check_subscribe(1, 4, per // 8, 1, pin, faults, seconds),
        "subscribe_fanout": lambda: _check_subscribe(0, 1, max(200, per // 50), 50, pin, False, seconds),
        "subscribe_qos0_c": lambda: _check_subscribe(0, 4, per // 4, 1, pin, faults, seconds, c_generator=True),
        "subscribe_fanout_c": lambda: _check_subscribe(0, 1, max(200, per // 50), 50, pin, False, seconds,
                                                       c_generator=True),
        "connect": lambda: _check_connect(connections, pin),
        "connect_c": lambda: _check_connect(connections, pin, c_generator=True),
    }
    default = {name for name in checks if not name.endswith("_c")}
    if c_generator:
        default.add("connect_c")
    if c_subscribers:
        default.add("subscribe_fanout_c")
    return {name: fn() for name, fn in checks.items() if name in (only if only is not None else default)}


def core_times() -> dict[int, tuple[int, int]]:
    """Per core (busy, total) jiffies from /proc/stat; busy excludes idle and iowait."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                parts = line.split()
                vals = [int(v) for v in parts[1:]]
                total = sum(vals[:8])
                out[int(parts[0][3:])] = (total - vals[3] - vals[4], total)
    return out


def busy_fraction(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpu: int) -> float:
    """How busy core ``cpu`` was between two :func:`core_times` snapshots (0..1)."""
    if cpu not in before or cpu not in after:
        return float("nan")
    busy = after[cpu][0] - before[cpu][0]
    total = after[cpu][1] - before[cpu][1]
    return busy / total if total > 0 else float("nan")


def raise_nofile(want: int = 20000) -> int:
    """Raise RLIMIT_NOFILE's soft limit (children inherit it); returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-check", action="store_true", required=True,
                    help="measure the ceiling against the built-in sink (the only mode: brokers are driven by run.py)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--faults", action="store_true", help="the sink injects one loss, duplicate and reorder")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the sink to core 0 and the load to core 1")
    ap.add_argument("--only", help="comma-separated checks to run; connect_c (the C idle generator, bench/cloadgen, "
                    "against the C sink), subscribe_qos0_c and subscribe_fanout_c (the C subscribers, cloadgen sub, "
                    "against the sink) run only when named")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    raise_nofile(args.connections + 1000)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    res = self_check(args.seconds, pin, args.faults, args.connections,
                     set(args.only.split(",")) if args.only else None)
    if args.json:
        print(json.dumps(res))
    else:
        for name, r in res.items():
            rest = ", ".join(f"{k}={v}" for k, v in r.items() if k != "rate")
            print(f"{name:<18} {r['rate']:>12,.0f}/s  {rest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
