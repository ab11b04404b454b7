"""Soak test: a long run of well-behaved and hostile clients against one edge-gateway that is killed with
SIGKILL every few minutes and restarted on the same store. It checks the two promises that matter on a gateway:

- every QoS 1 message the broker acknowledged (PUBACK) to a well-behaved publisher reaches its persistent subscriber,
  across every crash (duplicates are allowed and counted: QoS 1 is at-least-once);
- the broker's memory stays bounded (VmRSS sampled every second) while other clients misbehave.

What runs (everything on 127.0.0.1, every loop bounded in count and time, everything stops by itself):

- the broker: ``python -m gateway serve`` on a generated config (``[listeners.external]`` with
  ``bind = "127.0.0.1:0"``, a temporary store, every other setting the shipped default), its port read from its log
  (bench/brokers.py ``read_gateway_port``); killed with SIGKILL every ``--kill-every`` seconds and restarted on the
  same store (the port changes: every client follows it);
- normal clients (this process): ``--pairs`` publisher/subscriber pairs of paho-mqtt clients, alternately MQTT 3.1.1
  and 5.0, QoS 1, the subscriber a persistent session (Clean Session 0 / Session Expiry Interval 3600 s). Each
  publisher sends numbered messages at ``--rate`` per second with at most ``--window`` unacknowledged; after a
  broker restart it reconnects and publishes again every message not yet acknowledged;
- hostile and careless clients (a child process, ``--lanes`` threads each cycling through the scenarios below for
  ``--scenario-seconds`` each): long Client Identifiers (600, 5,000, 60,000 bytes), long Topic Filters (5,000 and
  60,000 bytes, 2,000 levels), retained messages on long topics, subscribers to ``#`` and flood topics at QoS 0 and 1
  that stop reading their socket while 100-900 kB messages are published to them, random bytes and truncated or
  malformed packets, QoS 0 and QoS 1 floods of small messages and an oversized PUBLISH, persistent sessions made and
  abandoned, connection churn with Wills, one client subscribing to 2,000 filters.

After ``--minutes`` the hostile clients stop, no more kills happen, the publishers stop taking new numbers, and the
drain (at most ``--drain`` seconds) waits until every acknowledged message has arrived. The broker is then stopped
with SIGTERM and a summary is printed (and written to ``--out`` as Markdown).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import paho.mqtt.client as mqtt  # noqa: E402
from brokers import BrokerError, read_gateway_port  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from gateway.mqtt.errors import MQTTError  # noqa: E402
from gateway.mqtt.framing import PacketReader  # noqa: E402
from gateway.mqtt.packets import (  # noqa: E402
    Connack,
    Connect,
    Disconnect,
    Packet,
    PubAck,
    Publish,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from gateway.mqtt.reason_codes import ConnackReturnCode311, ReasonCode  # noqa: E402

HOST = "127.0.0.1"  # the only address this script binds or connects to
SESSION_EXPIRY = 0x11  # MQTT 5 property identifier
MIB = 1024 * 1024
LOG_LEVEL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Full)\b")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ================================================================================================= broker and log


class BrokerLog:
    """Every line the broker writes to stderr: copied to a file, counted by level, a few lines of interest counted
    on their own, and WARNING-or-worse lines counted by shape (numbers, addresses and long names blanked out)."""

    SPECIALS: dict[str, re.Pattern[str]] = {
        "paged entries not found": re.compile(r"paged entr(y|ies) .*not found|paged entry \d+ has no message"),
        "store write failed": re.compile(r"store write failed"),
        "store full": re.compile(r"store full"),
        "STORE CORRUPT (quarantine)": re.compile(r"STORE CORRUPT"),
        "Traceback": re.compile(r"^Traceback "),
        "Message Queue drops of normal subscribers": re.compile(r"Message Queue of 'soak-sub-\d+' full"),
    }
    RESTORED = re.compile(r"restored (\d+) persistent sessions and (\d+) retained")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 (closed in close())
        self._lock = threading.Lock()
        self.levels: Counter[str] = Counter()
        self.specials: Counter[str] = Counter()
        self.shapes: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.restored: list[tuple[int, int]] = []  # (sessions, retained messages) at each start

    @staticmethod
    def shape(line: str) -> str:
        text = line[24:] if LOG_LEVEL.match(line) else line
        text = re.sub(r"\S{40,}", "<long>", text)
        text = re.sub(r"'[^']*'", "'…'", text)
        text = re.sub(r"\d+", "N", text)
        return text[:160]

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        with self._lock:
            self._file.write(line + "\n")
            m = LOG_LEVEL.match(line)
            level = m.group(1) if m else "other"
            self.levels[level] += 1
            r = self.RESTORED.search(line) if level == "INFO" else None
            if r:
                self.restored.append((int(r.group(1)), int(r.group(2))))
            for name, pattern in self.SPECIALS.items():
                if pattern.search(line):
                    self.specials[name] += 1
            exception = level == "other" and EXCEPTION_LINE.match(line) is not None  # a traceback's last line
            if level in ("WARNING", "ERROR", "CRITICAL") or exception:
                s = self.shape(line)
                self.shapes[s] += 1
                if s not in self.examples:
                    self.examples[s] = line[:400]

    def mark(self, text: str) -> None:
        with self._lock:
            self._file.write(f"--- soak: {text}\n")
            self._file.flush()

    def tail(self, n: int = 30) -> str:
        with self._lock:
            self._file.flush()
        try:
            return "\n".join(self.path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Tee:
    """A starting broker's stderr for :func:`brokers.read_gateway_port`: every line it reads is also logged."""

    def __init__(self, stream: TextIO, sink: Callable[[str], None]) -> None:
        self._stream = stream
        self._sink = sink

    def readline(self) -> str:
        line = self._stream.readline()
        if line:
            self._sink(line)
        return line


class _Starting:
    """The two things ``read_gateway_port`` uses of a Popen, with stderr teed into the broker log."""

    def __init__(self, proc: subprocess.Popen[str], sink: Callable[[str], None]) -> None:
        assert proc.stderr is not None
        self.stderr = _Tee(proc.stderr, sink)
        self.kill = proc.kill


@dataclass
class Restart:
    at: float  # seconds since the run started, when the broker went down
    reason: str  # "kill -9", "RSS guard", "exited by itself (rc N)"
    ready_after: float | None = None  # seconds from going down to "edge-gateway ready"
    rss_before_kib: int = 0


class Supervisor:
    """Starts the broker, samples its RSS every second, kills it on schedule and restarts it on the same store.

    ``port`` (and the shared ``port_value`` the hostile process reads) is 0 while the broker is down."""

    def __init__(self, workdir: Path, config: Path, blog: BrokerLog, port_value: Any, rss_guard_kib: int,
                 t0: float, broker_root: Path = ROOT) -> None:
        self.workdir = workdir
        self.broker_root = broker_root
        self.config = config
        self.blog = blog
        self.port_value = port_value
        self.rss_guard_kib = rss_guard_kib
        self.t0 = t0
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.starts = 0
        self.restarts: list[Restart] = []
        self.rss: list[tuple[float, int]] = []  # (seconds since t0, VmRSS KiB)
        self.rss_anon_max = 0  # RssAnon KiB: VmRSS less file-backed pages (LMDB's map, which the kernel can reclaim)
        self.fatal: str | None = None
        self.final_exit: int | None = None
        self._pump: threading.Thread | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- process ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the broker and wait for its port; three tries, then ``fatal``."""
        for attempt in range(3):
            cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(self.config)]
            env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(self.broker_root))
            env.pop("JOURNAL_STREAM", None)  # keep the timestamped log format
            self.blog.mark(f"start {self.starts} (attempt {attempt + 1}) at {self.now():.1f} s")
            # its own process group: a Ctrl-C in the terminal reaches the harness, which then stops the broker
            proc = subprocess.Popen(cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, errors="replace", env=env, process_group=0)
            try:
                port = read_gateway_port(_Starting(proc, self.blog.feed), timeout=60.0)  # type: ignore[arg-type]
            except BrokerError:
                proc.wait()
                self._drain_stderr(proc)
                log(f"broker did not start (rc {proc.returncode}); log tail:\n{self.blog.tail(15)}")
                time.sleep(1)
                continue
            self.proc = proc
            self._pump = threading.Thread(target=self._drain_stderr, args=(proc,), daemon=True)
            self._pump.start()
            self.starts += 1
            with self._lock:
                self.port = port
                self.port_value.value = port
            return
        self.fatal = "the broker could not be started three times in a row"
        raise BrokerError(self.fatal)

    def _drain_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        try:
            for line in proc.stderr:
                self.blog.feed(line)
        except (OSError, ValueError):
            pass

    def _down(self) -> None:
        with self._lock:
            self.port = 0
            self.port_value.value = 0

    def _reap(self) -> None:
        assert self.proc is not None
        self.proc.wait()
        if self._pump is not None:
            self._pump.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def kill_and_restart(self, reason: str) -> None:
        assert self.proc is not None
        rss = self.rss_kib() or 0
        self._down()
        down_at = self.now()
        self.proc.kill()  # SIGKILL to this PID only
        self._reap()
        self.blog.mark(f"{reason} at {down_at:.1f} s")
        r = Restart(down_at, reason, rss_before_kib=rss)
        self.restarts.append(r)
        self.start()
        r.ready_after = self.now() - down_at

    def rss_kib(self) -> int | None:
        """VmRSS of the running broker, KiB (None while it is down); also updates ``rss_anon_max``."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        rss = None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
                    elif line.startswith("RssAnon:"):
                        self.rss_anon_max = max(self.rss_anon_max, int(line.split()[1]))
        except OSError:
            return None
        return rss

    # -- the schedule ----------------------------------------------------------------------------------------

    def run(self, load_start: float, load_end: float, kill_every: float) -> None:
        """Sample every second until :meth:`stop`; kill -9 at ``load_start + k * kill_every`` before ``load_end``."""
        self._thread = threading.Thread(target=self._loop, args=(load_start, load_end, kill_every), daemon=True)
        self._thread.start()

    def _loop(self, load_start: float, load_end: float, kill_every: float) -> None:
        next_kill = load_start + kill_every if kill_every > 0 else float("inf")
        tick = self.now()
        try:
            while not self._stop.is_set():
                tick += 1.0
                self._stop.wait(max(0.0, tick - self.now()))
                if self._stop.is_set():
                    break
                assert self.proc is not None
                if self.proc.poll() is not None:
                    rc = self.proc.returncode
                    self._down()
                    down_at = self.now()
                    self._reap()
                    log(f"the broker exited by itself (rc {rc}) at {down_at:.0f} s; log tail:\n{self.blog.tail(10)}")
                    r = Restart(down_at, f"exited by itself (rc {rc})")
                    self.restarts.append(r)
                    self.start()
                    r.ready_after = self.now() - down_at
                    tick = self.now()
                    continue
                rss = self.rss_kib()
                if rss is not None:
                    self.rss.append((self.now(), rss))
                    if rss > self.rss_guard_kib:
                        log(f"broker RSS {rss // 1024} MiB over the guard ({self.rss_guard_kib // 1024} MiB): "
                            "killing it as an OOM killer would")
                        self.kill_and_restart("RSS guard")
                        tick = self.now()
                        continue
                now = self.now()
                if now >= next_kill and now < load_end:
                    self.kill_and_restart("kill -9")
                    log(f"kill -9 #{self.kills()} at {now:.0f} s; back on port {self.port} after "
                        f"{self.restarts[-1].ready_after:.1f} s")
                    next_kill += kill_every
                    tick = self.now()
        except BrokerError:
            log(f"fatal: {self.fatal}")
        except Exception as exc:  # a harness bug must not leave the broker running unseen
            self.fatal = f"supervisor error: {exc!r}"
            log(self.fatal)

    def kills(self) -> int:
        return sum(1 for r in self.restarts if r.reason == "kill -9")

    def wait_port(self, stop: threading.Event, timeout: float = 60.0) -> int:
        """The broker's current port, waiting while it restarts; 0 on timeout or stop."""
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline and self.fatal is None:
            port = self.port
            if port:
                return port
            time.sleep(0.05)
        return 0

    def stop(self) -> None:
        """Stop the schedule, then the broker with SIGTERM (SIGKILL after 30 s); keep its exit status."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)
        if self.proc is None:
            return
        self._down()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                log("the broker did not stop within 30 s of SIGTERM; SIGKILL")
                self.proc.kill()
        self._reap()
        self.final_exit = self.proc.returncode


# ================================================================================================= normal clients


@dataclass
class PairStats:
    index: int
    protocol: str
    published: int = 0  # PUBLISH packets sent, re-sends included
    numbers: int = 0  # distinct message numbers taken
    acked: set[int] = field(default_factory=set)
    refused: Counter[str] = field(default_factory=Counter)  # PUBACK reason codes >= 0x80, by name
    ack_codes: Counter[str] = field(default_factory=Counter)  # PUBACK reason codes < 0x80 (5.0), by name
    republished: int = 0
    received: set[int] = field(default_factory=set)
    duplicates: int = 0
    pub_connects: list[float] = field(default_factory=list)  # seconds since t0 of each CONNACK
    sub_connects: list[float] = field(default_factory=list)
    connect_refused: Counter[str] = field(default_factory=Counter)  # CONNACK / SUBACK failure codes
    connect_failed: int = 0  # connection attempts that got no successful CONNACK (refused, closed, timed out)


class NormalPair:
    """A publisher and a persistent subscriber exchanging numbered QoS 1 messages on ``soak/normal/<index>``.

    Each client runs in its own thread with paho's manual loop (``client.loop()``), a new paho client per
    connection (the port changes on every restart). A message number counts as acknowledged when its PUBACK
    (reason code < 0x80) arrives; numbers in flight when a connection ends are published again on the next."""

    def __init__(self, index: int, sup: Supervisor, rate: float, window: int, payload_size: int) -> None:
        self.index = index
        self.sup = sup
        self.v5 = index % 2 == 1
        self.protocol = mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311
        self.topic = f"soak/normal/{index}"
        self.rate = rate
        self.window = window
        self.pad = b"." * max(0, payload_size - 16)
        self.stats = PairStats(index, "5.0" if self.v5 else "3.1.1")
        self.lock = threading.Lock()
        self.pending: deque[int] = deque()  # numbers to publish again
        self.stop_new = threading.Event()  # load phase over: no new numbers
        self.stop_all = threading.Event()  # drain over: disconnect
        self.subscribed = threading.Event()
        self.pub_done = threading.Event()  # stop_new and nothing left unacknowledged
        self._threads: list[threading.Thread] = []

    # -- plumbing --------------------------------------------------------------------------------------------

    def _client(self, client_id: str) -> mqtt.Client:
        kw: dict[str, Any] = {"protocol": self.protocol, "reconnect_on_failure": False}
        if not self.v5:
            kw["clean_session"] = client_id.startswith("soak-pub")
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, **kw)
        c.connect_timeout = 5.0
        c.max_inflight_messages_set(self.window)
        return c

    def _connect(self, c: mqtt.Client, port: int, persistent: bool, connected: threading.Event,
                 record: list[float]) -> bool:
        """Connect and wait for a successful CONNACK; False on any failure (the caller retries)."""
        kw: dict[str, Any] = {}
        if self.v5:
            props = Properties(PacketTypes.CONNECT)
            if persistent:
                props.SessionExpiryInterval = 3600
            kw = {"clean_start": not persistent, "properties": props}
        try:
            c.connect(HOST, port, keepalive=15, **kw)
        except OSError:
            with self.lock:
                self.stats.connect_failed += 1
            return False
        deadline = time.monotonic() + 10
        while not connected.is_set() and time.monotonic() < deadline:
            if c.loop(0.05) != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return False
        if connected.is_set():
            record.append(self.sup.now())
            return True
        with self.lock:
            self.stats.connect_failed += 1
        return False

    @staticmethod
    def _close(c: mqtt.Client) -> None:
        try:
            c.disconnect()
            c.loop(0.05)
        except (OSError, ValueError):
            pass
        sock = c.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _on_connect(self, connected: threading.Event) -> Callable[..., None]:
        def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            if getattr(reason, "is_failure", False):
                with self.lock:
                    self.stats.connect_refused[str(reason)] += 1
            else:
                connected.set()
        return on_connect

    # -- subscriber ------------------------------------------------------------------------------------------

    def _subscriber(self) -> None:
        while not self.stop_all.is_set():
            port = self.sup.wait_port(self.stop_all)
            if not port:
                time.sleep(0.1)
                continue
            c = self._client(f"soak-sub-{self.index}")
            connected = threading.Event()
            c.on_connect = self._on_connect(connected)
            c.on_message = self._on_message
            c.on_subscribe = self._on_subscribe
            if self._connect(c, port, True, connected, self.stats.sub_connects):
                c.subscribe(self.topic, qos=1)
                while not self.stop_all.is_set():
                    if c.loop(0.1) != MQTTErrorCode.MQTT_ERR_SUCCESS:
                        break
            self._close(c)
            if not self.stop_all.is_set():
                time.sleep(0.1)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        if all(not getattr(rc, "is_failure", False) for rc in codes):
            self.subscribed.set()
        else:
            with self.lock:
                self.stats.connect_refused[f"SUBACK {codes}"] += 1

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            number = int(msg.payload.split(b":", 2)[1])
        except (IndexError, ValueError):
            return
        with self.lock:
            if number in self.stats.received:
                self.stats.duplicates += 1
            else:
                self.stats.received.add(number)

    # -- publisher -------------------------------------------------------------------------------------------

    def _publisher(self) -> None:
        while not self.stop_all.is_set():
            with self.lock:
                if self.stop_new.is_set() and not self.pending:
                    break
            port = self.sup.wait_port(self.stop_all)
            if not port:
                time.sleep(0.1)
                continue
            c = self._client(f"soak-pub-{self.index}")
            connected = threading.Event()
            inflight: dict[int, int] = {}  # mid -> number, this connection

            def on_publish(client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any,
                           inflight: dict[int, int] = inflight) -> None:
                number = inflight.pop(mid, None)
                if number is None:
                    return
                with self.lock:
                    if getattr(reason, "is_failure", False):
                        self.stats.refused[getattr(reason, "getName", lambda: str(reason))()] += 1
                        self.pending.append(number)  # try again later
                    else:
                        self.stats.acked.add(number)
                        if self.v5 and getattr(reason, "value", 0):
                            self.stats.ack_codes[reason.getName()] += 1

            c.on_connect = self._on_connect(connected)
            c.on_publish = on_publish
            if self._connect(c, port, False, connected, self.stats.pub_connects):
                self._publish_loop(c, inflight)
            self._close(c)
            with self.lock:
                if inflight:
                    self.stats.republished += len(inflight)
                    self.pending.extend(sorted(inflight.values()))
                    inflight.clear()
            if not self.stop_all.is_set():
                time.sleep(0.1)
        self.pub_done.set()

    def _publish_loop(self, c: mqtt.Client, inflight: dict[int, int]) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self.stop_all.is_set():
            now = time.monotonic()
            if now >= next_at and len(inflight) < self.window:
                with self.lock:
                    if self.pending:
                        number = self.pending.popleft()
                    elif self.stop_new.is_set():
                        number = -1
                    else:
                        number = self.stats.numbers
                        self.stats.numbers += 1
                if number >= 0:
                    payload = f"{self.index}:{number}:".encode() + self.pad
                    info = c.publish(self.topic, payload, qos=1)
                    inflight[info.mid] = number  # on_publish runs only inside c.loop(), in this thread
                    with self.lock:
                        self.stats.published += 1
                    if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                        return
                    next_at = max(next_at + interval, now - 1.0)  # no burst after a stall of over a second
                elif not inflight:
                    return  # load over, nothing left to acknowledge
            wait = max(0.0, min(0.05, next_at - time.monotonic()))
            if c.loop(wait) != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        t = threading.Thread(target=self._subscriber, name=f"sub-{self.index}", daemon=True)
        t.start()
        self._threads.append(t)

    def start_publishing(self) -> None:
        t = threading.Thread(target=self._publisher, name=f"pub-{self.index}", daemon=True)
        t.start()
        self._threads.append(t)

    def complete(self) -> bool:
        with self.lock:
            return self.pub_done.is_set() and self.stats.acked <= self.stats.received

    def close(self) -> None:
        self.stop_new.set()
        self.stop_all.set()
        for t in self._threads:
            t.join(15)


# ================================================================================================= hostile clients


class Raw:
    """A blocking raw MQTT connection (the project's codec) for clients that misbehave."""

    def __init__(self, port: int, version: int = 4, timeout: float = 5.0, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect((HOST, port))
        except OSError:
            self.sock.close()
            raise
        self.version = version
        self.reader = PacketReader(version=version)
        self.pending: deque[Packet] = deque()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> Packet | None:
        """The next packet, None on timeout; raises ConnectionError when the broker closed the connection."""
        if self.pending:
            return self.pending.popleft()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return None
            if not data:
                raise ConnectionError("closed by the broker")
            self.pending.extend(self.reader.feed(data))
            if self.pending:
                return self.pending.popleft()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connack_label(version: int, code: int) -> str:
    if version == 5:
        try:
            return f"CONNACK 0x{code:02X} {ReasonCode(code).name}"
        except ValueError:
            return f"CONNACK 0x{code:02X}"
    try:
        return f"CONNACK rc {code} {ConnackReturnCode311(code).name}"
    except ValueError:
        return f"CONNACK rc {code}"


def code_label(packet: str, version: int, code: int) -> str:
    if version != 5 and packet == "PUBACK":
        return "PUBACK (3.1.1)"
    if packet == "SUBACK" and code < 0x80:
        return f"SUBACK granted QoS {code}"
    if packet == "SUBACK" and version != 5:
        return f"SUBACK 0x{code:02X} Failure (3.1.1)"
    try:
        return f"{packet} 0x{code:02X} {ReasonCode(code).name}"
    except ValueError:
        return f"{packet} 0x{code:02X}"


def packet_label(p: Packet | None, version: int) -> str:
    if p is None:
        return "no reply (timeout)"
    if isinstance(p, Connack):
        return connack_label(version, p.reason_code)
    if isinstance(p, Disconnect):
        return code_label("DISCONNECT", 5, p.reason_code)
    if isinstance(p, PubAck):
        return code_label("PUBACK", version, p.reason_code)
    if isinstance(p, Suback):
        return ", ".join(sorted({code_label("SUBACK", version, c) for c in p.reason_codes}))
    return type(p).__name__.upper()


class Hostile:
    """The hostile process's shared state: the broker's port, the stop flag, outcome counters."""

    def __init__(self, port_value: Any, stop: Any, scenario_seconds: float) -> None:
        self.port_value = port_value
        self.stop = stop
        self.scenario_seconds = scenario_seconds
        self.lock = threading.Lock()
        self.outcomes: dict[str, Counter[str]] = collections.defaultdict(Counter)
        self.runs: Counter[str] = Counter()
        self.abandoned = 0  # sequence for never-reused persistent Client Identifiers
        self.big = random.Random(0).randbytes(900_000)

    def port(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            port = int(self.port_value.value)
            if port:
                return port
            time.sleep(0.05)
        return 0

    def count(self, scenario: str, outcome: str, n: int = 1) -> None:
        with self.lock:
            self.outcomes[scenario][outcome] += n

    def over(self, deadline: float) -> bool:
        return self.stop.is_set() or time.monotonic() >= deadline

    # -- helpers ---------------------------------------------------------------------------------------------

    def connect(self, sc: str, what: str, client_id: str, version: int, clean: bool = True,
                expiry: int | None = None, will: Will | None = None, rcvbuf: int | None = None) -> Raw | None:
        """Open a connection and CONNECT; count the outcome as ``"<what>: <CONNACK ...>"``; None unless accepted."""
        port = self.port()
        if not port:
            return None
        try:
            raw = Raw(port, version, rcvbuf=rcvbuf)
        except OSError:
            self.count(sc, "TCP connect failed (broker restarting)")
            return None
        props = {SESSION_EXPIRY: expiry} if (version == 5 and expiry) else {}
        try:
            raw.send(Connect(client_id, version, clean, 30, will=will, properties=props).encode(version))
            p = raw.recv(10)
        except ConnectionError:
            self.count(sc, f"{what}: closed by the broker before CONNACK")
            raw.close()
            return None
        except (OSError, MQTTError) as exc:
            self.count(sc, f"{what}: {type(exc).__name__} before CONNACK")
            raw.close()
            return None
        label = packet_label(p, version)
        self.count(sc, f"{what}: {label}")
        if isinstance(p, Connack) and p.reason_code == 0:
            return raw
        raw.close()
        return None

    def request(self, sc: str, what: str, raw: Raw, data: bytes, expect: type | tuple[type, ...],
                timeout: float = 10.0) -> Packet | None:
        """Send one packet and count the label of the reply of type ``expect`` (a DISCONNECT, the connection's end
        or a timeout instead); PUBLISH packets that arrive meanwhile (messages to this client) are skipped."""
        deadline = time.monotonic() + timeout
        wanted = (*(expect if isinstance(expect, tuple) else (expect,)), Disconnect)
        try:
            raw.send(data)
            while True:
                p = raw.recv(max(0.0, deadline - time.monotonic()))
                if p is None or isinstance(p, wanted):
                    break
        except ConnectionError:
            self.count(sc, f"{what}: closed by the broker")
            return None
        except (OSError, MQTTError) as exc:
            self.count(sc, f"{what}: {type(exc).__name__}")
            return None
        self.count(sc, f"{what}: {packet_label(p, raw.version)}")
        return p

    def bye(self, raw: Raw, graceful: bool = True) -> None:
        if graceful:
            try:
                raw.send(Disconnect().encode(raw.version))
            except OSError:
                pass
        raw.close()

    def flood_qos1(self, sc: str, raw: Raw, topic: str, sizes: Callable[[], int], count: int, window: int,
                   deadline: float) -> None:
        """``count`` QoS 1 PUBLISH with at most ``window`` unacknowledged; PUBACK codes counted."""
        pid, outstanding, sent = 0, 0, 0
        try:
            while sent < count and not self.over(deadline):
                while outstanding < window and sent < count:
                    pid = pid % 65535 + 1
                    size = sizes()
                    raw.send(Publish(topic, self.big[:size], 1, packet_id=pid).encode(raw.version))
                    outstanding += 1
                    sent += 1
                p = raw.recv(10)
                if p is None:
                    self.count(sc, "QoS 1 flood: no PUBACK within 10 s")
                    return
                if isinstance(p, PubAck):
                    outstanding -= 1
                    if p.reason_code >= 0x80:
                        self.count(sc, code_label("QoS 1 flood PUBACK", 5, p.reason_code))
                else:
                    self.count(sc, f"QoS 1 flood: {packet_label(p, raw.version)}")
            while outstanding and not self.over(deadline):
                p = raw.recv(10)
                if not isinstance(p, PubAck):
                    break
                outstanding -= 1
        except (OSError, MQTTError) as exc:
            self.count(sc, f"QoS 1 flood: connection closed ({type(exc).__name__})")
        finally:
            self.count(sc, "QoS 1 flood: messages sent", sent)

    def flood_qos0(self, sc: str, raw: Raw, topic: str, sizes: Callable[[], int], count: int, batch: int,
                   deadline: float) -> None:
        sent, nbytes = 0, 0
        try:
            while sent < count and not self.over(deadline):
                parts = []
                for _ in range(min(batch, count - sent)):
                    size = sizes()
                    parts.append(Publish(topic, self.big[:size], 0).encode(raw.version))
                    nbytes += size
                raw.sock.settimeout(10)
                raw.send(b"".join(parts))
                sent += len(parts)
        except TimeoutError:
            self.count(sc, "QoS 0 flood: broker stopped reading for 10 s")
        except OSError as exc:
            self.count(sc, f"QoS 0 flood: connection closed ({type(exc).__name__})")
        finally:
            self.count(sc, "QoS 0 flood: messages sent", sent)
            self.count(sc, "QoS 0 flood: MiB sent", nbytes // MIB)


# -- scenarios: each runs until its deadline (or the stop flag), every loop also bounded by count -----------------


def sc_long_client_ids(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Persistent sessions with Client Identifiers of 600, 5,000 and 60,000 bytes, each connecting three times
    (LMDB keys stop at 511 bytes: such a name once failed every client's group commit), publishing QoS 1 and
    subscribing."""
    for _round in range(3):
        for length in (600, 5000, 60000):
            for version in (4, 5):
                if h.over(deadline):
                    return
                cid = f"soak-h-lid-{version}-".ljust(length, "x")
                raw = h.connect(sc, f"{length} B id, v{version}", cid, version, clean=False, expiry=600)
                if raw is None:
                    continue
                h.request(sc, f"{length} B id PUBLISH", raw,
                          Publish("soak/hostile/lid", b"x" * 100, 1, packet_id=1).encode(version), PubAck)
                h.request(sc, f"{length} B id SUBSCRIBE", raw,
                          Subscribe(1, [Subscription("soak/hostile/lid/#", 1)]).encode(version), Suback)
                h.bye(raw)


def sc_long_topic_filters(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Topic Filters of 5,000 and 60,000 bytes and of 2,000 levels, in a persistent session."""
    version = rng.choice((4, 5))
    raw = h.connect(sc, f"connect v{version}", f"soak-h-ltf-{lane}", version, clean=False, expiry=600)
    if raw is None:
        return
    filters = {
        "5000 B filter": "soak/hostile/ltf/" + "f" * 4983,
        "5000 B filter #2": "soak/hostile/ltf/" + "g" * 4981 + "/#",
        "60000 B filter": "soak/hostile/ltf/" + "h" * 59983,
        "2000-level filter": "soak/" + "a/" * 2000 + "#",
    }
    for pid, (what, flt) in enumerate(filters.items(), start=1):
        if h.over(deadline):
            break
        sub = Subscribe(pid, [Subscription(flt, 1)]).encode(version)
        if h.request(sc, f"SUBSCRIBE {what}", raw, sub, Suback) is None:
            return
    h.request(sc, "PUBLISH to the 5000 B filter's topic", raw,
              Publish(filters["5000 B filter"], b"y" * 100, 1, packet_id=9).encode(version), PubAck)
    if rng.random() < 0.5:
        h.request(sc, "UNSUBSCRIBE all", raw, Unsubscribe(10, list(filters.values())).encode(version), Unsuback)
    h.bye(raw, graceful=rng.random() < 0.5)


def sc_long_retained(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Retained QoS 1 messages on topics of 600, 5,000 and 60,000 bytes and on 20 short topics (100 kB each);
    half of the time cleared again. A fixed set of topics, so the retained set stays bounded."""
    version = rng.choice((4, 5))
    raw = h.connect(sc, f"connect v{version}", f"soak-h-ret-{lane}", version)
    if raw is None:
        return
    clear = rng.random() < 0.5
    topics = [(f"{n} B topic", f"soak/retained/{lane}/".ljust(n, "r"), 1000) for n in (600, 5000, 60000)]
    topics += [("short topic, 100 kB", f"soak/retained/{lane}/short/{k}", 100_000) for k in range(20)]
    for pid, (what, topic, size) in enumerate(topics, start=1):
        if h.over(deadline):
            break
        payload = b"" if clear else h.big[:size]
        p = h.request(sc, f"retained PUBLISH {what}{' (clear)' if clear else ''}", raw,
                      Publish(topic, payload, 1, retain=True, packet_id=pid).encode(version), PubAck)
        if p is None:
            return
    h.bye(raw)


def _stuck(h: Hostile, sc: str, topic: str, qos: int, client_id: str, version: int, clean: bool = True,
           expiry: int | None = None) -> Raw | None:
    """A subscriber that subscribes and then never reads its socket again (4 kB receive buffer)."""
    raw = h.connect(sc, f"stuck subscriber v{version} {'clean' if clean else 'persistent'}", client_id, version,
                    clean=clean, expiry=expiry, rcvbuf=4096)
    if raw is None:
        return None
    if h.request(sc, f"stuck SUBSCRIBE {topic} QoS {qos}", raw,
                 Subscribe(1, [Subscription(topic, qos)]).encode(version), Suback) is None:
        return None
    return raw


STUCK_HOLD = 20.0  # seconds a stuck subscriber stays stuck after its flood: past the default send_timeout (15 s)


def _hold_and_check(h: Hostile, sc: str, stuck: list[Raw | None], hold: float) -> None:
    """Keep the stuck subscribers stuck ``hold`` more seconds (less if the run stops), then read each for up to 2 s
    to see whether the broker closed it meanwhile (``send_timeout``) or still has data for it."""
    started = time.monotonic()
    while not h.over(started + hold):
        time.sleep(0.1)
    held = time.monotonic() - started
    for raw in stuck:
        if raw is None:
            continue
        got, end = 0, time.monotonic() + 2
        outcome = "still open, still sending after 2 s of reading"
        try:
            raw.sock.settimeout(0.5)
            while time.monotonic() < end and got < 64 * MIB:
                data = raw.sock.recv(1 << 20)
                if not data:
                    outcome = "closed by the broker"
                    break
                got += len(data)
        except TimeoutError:
            outcome = "still open, its buffered data read within 2 s" if got else "still open, nothing buffered"
        except OSError as exc:
            outcome = f"closed by the broker ({type(exc).__name__})"
        h.count(sc, f"stuck subscriber {held:.0f} s after the flood: {outcome}")


def sc_stuck_qos0(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Two subscribers (``#`` and ``soak/flood/#``, QoS 0) stop reading while up to 150 QoS 0 messages of
    100-900 kB are published, and stay stuck :data:`STUCK_HOLD` seconds more."""
    stuck = [_stuck(h, sc, "#", 0, f"soak-h-stuck0a-{lane}", 5),
             _stuck(h, sc, "soak/flood/#", 0, f"soak-h-stuck0b-{lane}", 4)]
    try:
        pub = h.connect(sc, "flood publisher v4", f"soak-h-flood0-{lane}", 4)
        if pub is not None:
            h.flood_qos0(sc, pub, f"soak/flood/big/{lane}", lambda: rng.randint(100_000, 900_000), 150, 1,
                         deadline)
            h.bye(pub)
        _hold_and_check(h, sc, stuck, STUCK_HOLD)
    finally:
        for raw in stuck:
            if raw is not None:
                raw.close()


def sc_stuck_qos1(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """A persistent (5.0, Session Expiry 300 s) and a clean subscriber at QoS 1 stop reading while 100 QoS 1
    messages of 100-900 kB are published, and stay stuck :data:`STUCK_HOLD` seconds more."""
    stuck = [_stuck(h, sc, "soak/flood/#", 1, f"soak-h-stuck1a-{lane}", 5, clean=False, expiry=300),
             _stuck(h, sc, "#", 1, f"soak-h-stuck1b-{lane}", 4)]
    try:
        version = rng.choice((4, 5))
        pub = h.connect(sc, f"flood publisher v{version}", f"soak-h-flood1-{lane}", version)
        if pub is not None:
            h.flood_qos1(sc, pub, f"soak/flood/big1/{lane}", lambda: rng.randint(100_000, 900_000), 100, 10,
                         deadline)
            h.bye(pub)
        _hold_and_check(h, sc, stuck, STUCK_HOLD)
    finally:
        for raw in stuck:
            if raw is not None:
                raw.close()


def sc_small_floods(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """20,000 QoS 0 and 3,000 QoS 1 messages of 100 B, then one PUBLISH over max_packet_size (1.5 MB)."""
    version = rng.choice((4, 5))
    raw = h.connect(sc, f"connect v{version}", f"soak-h-small-{lane}", version)
    if raw is None:
        return
    h.flood_qos0(sc, raw, f"soak/flood/small/{lane}", lambda: 100, 20_000, 500, deadline)
    h.flood_qos1(sc, raw, f"soak/flood/small1/{lane}", lambda: 100, 3_000, 50, deadline)
    h.bye(raw)
    raw = h.connect(sc, f"connect v{version}", f"soak-h-big-{lane}", version)
    if raw is None:
        return
    h.request(sc, "1.5 MB PUBLISH", raw, Publish("soak/flood/huge", bytes(1_500_000), 0).encode(version), ())
    raw.close()


def sc_garbage(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Up to 300 connections sending random bytes, truncated or malformed packets, or half of a 1 MB CONNECT."""
    good = Connect("soak-h-garbage", 4, True, 30).encode(4)
    kinds: dict[str, Callable[[], bytes]] = {
        "random bytes": lambda: rng.randbytes(rng.randint(1, 4096)),
        "truncated CONNECT": lambda: good[: rng.randint(1, len(good) - 1)],
        "bad Remaining Length": lambda: b"\x10\xff\xff\xff\xff\x7f",
        "PUBLISH before CONNECT": lambda: Publish("soak/x", b"x", 0).encode(4),
        "protocol level 7": lambda: good.replace(b"MQTT\x04", b"MQTT\x07"),
        "half of a 1 MB CONNECT": lambda: b"\x10\x80\x80\x40" + rng.randbytes(8192),
        "CONNECT then random bytes": lambda: good + rng.randbytes(rng.randint(1, 512)),
        "CONNECT twice": lambda: good + good,
    }
    names = list(kinds)
    for _ in range(300):
        if h.over(deadline):
            return
        port = h.port()
        if not port:
            return
        kind = rng.choice(names)
        try:
            raw = Raw(port, 4, timeout=2)
        except OSError:
            h.count(sc, "TCP connect failed (broker restarting)")
            continue
        try:
            raw.send(kinds[kind]())
            if kind == "half of a 1 MB CONNECT":
                time.sleep(0.3)
            replies = []
            for _i in range(3):
                p = raw.recv(1.0)
                if p is None:
                    replies.append("no reply within 1 s")
                    break
                replies.append(packet_label(p, 4))
            h.count(sc, f"{kind}: {' + '.join(replies)}")
        except ConnectionError:
            h.count(sc, f"{kind}: closed by the broker")
        except (OSError, MQTTError) as exc:
            h.count(sc, f"{kind}: {type(exc).__name__}")
        finally:
            raw.close()
        time.sleep(rng.uniform(0.005, 0.02))


def sc_abandon_sessions(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """100 new persistent sessions (never reused Client Identifiers, about 10 per second) that subscribe and go away,
    a third of them on 10 topics that then get 20 small QoS 1 messages each: sessions accumulate until they expire
    (Session Expiry 60 s, 10 min or 2 h; 3.1.1 sessions get the listener's 2 h)."""
    for _ in range(100):
        if h.over(deadline):
            break
        with h.lock:
            h.abandoned += 1
            k = h.abandoned
        version = rng.choice((4, 5))
        expiry = rng.choice((60, 600, 7200))
        raw = h.connect(sc, f"persistent session v{version}", f"soak-h-ab-{lane}-{k}", version, clean=False,
                        expiry=expiry)
        if raw is None:
            continue
        topic = f"soak/abandon/{k % 10}" if k % 3 == 0 else f"soak/abandon/quiet/{k}"
        h.request(sc, "SUBSCRIBE", raw, Subscribe(1, [Subscription(topic, 1)]).encode(version), Suback)
        h.bye(raw, graceful=rng.random() < 0.5)
        h.stop.wait(rng.uniform(0.05, 0.15))  # about 10 s for the 100: a steady trickle, not a burst
    pub = h.connect(sc, "publisher v4", f"soak-h-abpub-{lane}", 4)
    if pub is not None:
        for k in range(10):
            h.flood_qos1(sc, pub, f"soak/abandon/{k}", lambda: 100, 20, 20, deadline)
            if h.over(deadline):
                break
        h.bye(pub)


def sc_churn(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """Up to 400 short connections: clean sessions, some with a QoS 1 Will, some dropped without DISCONNECT, some
    TCP connections that never send CONNECT."""
    for k in range(400):
        if h.over(deadline):
            return
        version = rng.choice((4, 5))
        r = rng.random()
        if r < 0.1:
            port = h.port()
            if not port:
                return
            try:
                raw = Raw(port, version, timeout=1)
                time.sleep(0.05)
                raw.close()
                h.count(sc, "TCP only, no CONNECT")
            except OSError:
                h.count(sc, "TCP connect failed (broker restarting)")
            continue
        will = Will(f"soak/will/{lane}/{k}", b"gone", 1) if r < 0.3 else None
        raw = h.connect(sc, f"v{version}{' with Will' if will else ''}", f"soak-h-churn-{lane}-{k % 50}", version,
                        will=will)
        if raw is not None:
            h.bye(raw, graceful=rng.random() < 0.7)


def sc_many_subscriptions(h: Hostile, sc: str, rng: random.Random, deadline: float, lane: int) -> None:
    """One persistent session subscribing to 2,000 distinct filters, 100 per SUBSCRIBE."""
    version = rng.choice((4, 5))
    raw = h.connect(sc, f"connect v{version}", f"soak-h-subs-{lane}", version, clean=False, expiry=300)
    if raw is None:
        return
    for batch in range(20):
        if h.over(deadline):
            break
        subs = [Subscription(f"soak/many/{lane}/{batch}/{k}/+", 1) for k in range(100)]
        if h.request(sc, "SUBSCRIBE x100", raw, Subscribe(batch + 1, subs).encode(version), Suback) is None:
            return
    h.bye(raw)


#: short name -> (title in the summary, function)
SCENARIOS: dict[str, tuple[str, Callable[[Hostile, str, random.Random, float, int], None]]] = {
    "long_ids": ("long client ids", sc_long_client_ids),
    "long_filters": ("long topic filters", sc_long_topic_filters),
    "long_retained": ("long retained topics", sc_long_retained),
    "stuck_qos0": ("stuck QoS 0 subscribers + big QoS 0 flood", sc_stuck_qos0),
    "stuck_qos1": ("stuck QoS 1 subscribers + big QoS 1 flood", sc_stuck_qos1),
    "small_floods": ("small floods + oversized PUBLISH", sc_small_floods),
    "garbage": ("garbage", sc_garbage),
    "abandon": ("abandoned persistent sessions", sc_abandon_sessions),
    "churn": ("connection churn", sc_churn),
    "many_subs": ("2000 subscriptions", sc_many_subscriptions),
}


def hostile_main(port_value: Any, stop: Any, seed: int, lanes: int, scenario_seconds: float, result: Any,
                 names: list[str]) -> None:
    """The hostile process: ``lanes`` threads, each cycling through the scenarios ``names`` in its own shuffled
    order until ``stop`` is set; then the counters go back through ``result``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    h = Hostile(port_value, stop, scenario_seconds)

    def lane_main(lane: int) -> None:
        rng = random.Random(seed * 1000 + lane)
        order = list(names)
        while not stop.is_set():
            rng.shuffle(order)
            for name in order:
                if stop.is_set():
                    break
                if not h.port():
                    continue
                title, scenario = SCENARIOS[name]
                with h.lock:
                    h.runs[title] += 1
                try:
                    scenario(h, title, rng, time.monotonic() + scenario_seconds, lane)
                except Exception as exc:  # count it; the lane goes on
                    h.count(title, f"harness error: {exc!r}"[:200])
                stop.wait(rng.uniform(0.2, 1.0))

    threads = [threading.Thread(target=lane_main, args=(k,), daemon=True) for k in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with h.lock:
        result.put({"runs": dict(h.runs), "outcomes": {k: dict(v) for k, v in h.outcomes.items()}})


# ================================================================================================= the run


def store_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


def write_config(workdir: Path, overrides: list[str], broker_root: Path) -> Path:
    """The broker's config: shipped defaults, but for the bind (127.0.0.1, port 0), the temporary store and any
    ``--listener-set KEY=VALUE``; checked with ``edge-gateway check-config``."""
    lines = [
        "[store]",
        f'path = "{workdir / "store"}"',
        "[listeners.external]",
        'bind = "127.0.0.1:0"',
        *overrides,
    ]
    path = workdir / "gateway.toml"
    path.write_text("\n".join(lines) + "\n")
    check = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                           text=True, cwd=workdir, env=dict(os.environ, PYTHONPATH=str(broker_root)), timeout=60)
    if check.returncode != 0:
        raise SystemExit(f"soak: the generated config is invalid:\n{path.read_text()}\n{check.stdout}{check.stderr}")
    return path


def git_rev() -> str:
    """The working tree's ``git describe --always --dirty``."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def export_commit(rev: str, dest: Path) -> str:
    """``git archive REV`` unpacked into ``dest`` (the broker then runs from there, untouched by edits made to the
    working tree during the run); returns the commit's short hash."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True,
                           text=True, timeout=30, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", short], capture_output=True,
                             timeout=120, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # our own repository's archive
    return short


def fmt_mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.0f} MiB"


def summarize(args: argparse.Namespace, sup: Supervisor, pairs: list[NormalPair], blog: BrokerLog,
              hostile: dict[str, Any], timing: dict[str, float], store_size: int) -> dict[str, Any]:
    end = timing["end"]
    rss_all = [k for _, k in sup.rss]
    rss_last10 = [k for t, k in sup.rss if t >= end - 600]
    kills = [r for r in sup.restarts if r.reason == "kill -9"]
    ready = [r.ready_after for r in sup.restarts if r.ready_after is not None]
    back = []
    for r in sup.restarts:
        firsts = []
        for p in pairs:
            for connects in (p.stats.pub_connects, p.stats.sub_connects):
                after = [t for t in connects if t > r.at]
                if after:
                    firsts.append(after[0] - r.at)
        if firsts:
            back.append(max(firsts))
    rows = []
    for p in pairs:
        s = p.stats
        with p.lock:
            lost = sorted(s.acked - s.received)
            rows.append({
                "pair": s.index, "protocol": s.protocol, "numbers": s.numbers, "published": s.published,
                "acked": len(s.acked), "refused": dict(s.refused), "ack_codes": dict(s.ack_codes),
                "republished": s.republished, "delivered": len(s.received), "duplicates": s.duplicates,
                "lost": len(lost), "lost_first": lost[:20], "never_acked": s.numbers - len(s.acked),
                "pub_connects": len(s.pub_connects), "sub_connects": len(s.sub_connects),
                "connect_refused": dict(s.connect_refused), "connect_failed": s.connect_failed,
            })
    max_rss = max(rss_all) if rss_all else None
    lost_total = sum(r["lost"] for r in rows)
    failures = []
    if lost_total:
        failures.append(f"{lost_total} acknowledged messages of normal clients never arrived")
    if sup.rss_anon_max > args.max_rss_mib * 1024:
        # The bound is on the broker's own memory: VmRSS also counts LMDB's file-backed map, page cache that
        # grows with the store (up to store.max_size) and that the kernel reclaims under pressure.
        failures.append(f"broker anonymous RSS reached {sup.rss_anon_max / 1024:.0f} MiB "
                        f"(bound {args.max_rss_mib} MiB)")
    if sup.fatal:
        failures.append(sup.fatal)
    if timing.get("interrupted"):
        failures.append(f"interrupted after {timing['end']:.0f} s (SIGINT or SIGTERM): the figures cover part of a run")
    if not any(r["acked"] for r in rows):
        failures.append("no normal message was acknowledged at all")
    attention = []
    for name in ("paged entries not found", "store write failed", "STORE CORRUPT (quarantine)", "Traceback"):
        if blog.specials[name]:
            attention.append(f"{blog.specials[name]} log lines '{name}'")
    if blog.levels["CRITICAL"]:
        attention.append(f"{blog.levels['CRITICAL']} CRITICAL log lines")
    crashed = [r for r in sup.restarts if r.reason.startswith("exited")]
    if crashed:
        attention.append(f"the broker exited by itself {len(crashed)} times")
    if sup.final_exit not in (0, None):
        attention.append(f"exit status {sup.final_exit} on SIGTERM at the end")
    return {
        "run": {
            "minutes": args.minutes, "kill_every": args.kill_every, "seed": args.seed, "pairs": args.pairs,
            "rate": args.rate, "lanes": args.lanes, "scenario_seconds": args.scenario_seconds,
            "scenarios": args.scenarios,
            "git": getattr(args, "broker_rev", "?"), "python": sys.version.split()[0], "started": timing["started"],
            "load_seconds": round(timing["load"], 1), "drain_seconds": round(timing["drain"], 1),
            "listener_set": args.listener_set,
        },
        "pairs": rows,
        "broker": {
            "kills": len(kills), "restarts": len(sup.restarts),
            "restart_reasons": dict(Counter(r.reason for r in sup.restarts)),
            "ready_after_s": [round(x, 2) for x in ready],
            "clients_back_after_s": [round(x, 2) for x in back],
            "rss_max_kib": max_rss, "rss_anon_max_kib": sup.rss_anon_max,
            "rss_max_last10_kib": max(rss_last10) if rss_last10 else None,
            "rss_end_kib": rss_all[-1] if rss_all else None,
            "rss_before_kills_kib": [r.rss_before_kib for r in kills],
            "rss_samples": len(rss_all), "exit_status": sup.final_exit, "store_bytes_end": store_size,
            "restored_sessions_retained": blog.restored,
        },
        "log": {"levels": dict(blog.levels), "specials": {k: blog.specials[k] for k in BrokerLog.SPECIALS},
                "top": [(n, s, blog.examples[s]) for s, n in blog.shapes.most_common(12)]},
        "hostile": hostile,
        "failures": failures,
        "attention": attention,
    }


def _span(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{min(xs):.1f} / {sum(xs) / len(xs):.1f} / {max(xs):.1f}"


def render(s: dict[str, Any], max_rss_mib: int) -> str:
    run, b, lg = s["run"], s["broker"], s["log"]
    out = [
        "## Soak summary",
        "",
        f"{run['minutes']:g} min of load, kill -9 every {run['kill_every']:g} s, seed {run['seed']}, "
        f"{run['pairs']} normal pairs at {run['rate']:g} msg/s each, {run['lanes']} hostile lanes; "
        f"edge-gateway {run['git']}, Python {run['python']}, started {run['started']}; "
        f"load {run['load_seconds']:.0f} s, drain {run['drain_seconds']:.0f} s"
        + (f"; listener settings {', '.join(run['listener_set'])}" if run["listener_set"] else "")
        + (f"; scenarios {', '.join(run['scenarios'])}" if len(run["scenarios"]) < len(SCENARIOS) else "") + ".",
        "",
        "### Normal clients (QoS 1, persistent subscribers)",
        "",
        "| pair | MQTT | numbers | PUBLISH sent | acked | refused | re-sent | delivered | duplicates | lost "
        "| never acked | connects pub/sub | failed connects |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in s["pairs"]:
        refused = ", ".join(f"{k} {v}" for k, v in r["refused"].items()) or "0"
        out.append(f"| {r['pair']} | {r['protocol']} | {r['numbers']} | {r['published']} | {r['acked']} | {refused} "
                   f"| {r['republished']} | {r['delivered']} | {r['duplicates']} | **{r['lost']}** "
                   f"| {r['never_acked']} | {r['pub_connects']} / {r['sub_connects']} | {r['connect_failed']} |")
    tot = {k: sum(r[k] for r in s["pairs"]) for k in ("numbers", "published", "acked", "republished", "delivered",
                                                        "duplicates", "lost", "never_acked")}
    out.append(f"| all | | {tot['numbers']} | {tot['published']} | {tot['acked']} | | {tot['republished']} "
               f"| {tot['delivered']} | {tot['duplicates']} | **{tot['lost']}** | {tot['never_acked']} | | |")
    for r in s["pairs"]:
        if r["lost"]:
            out.append(f"\nPair {r['pair']} lost numbers (first 20): {r['lost_first']}")
        if r["connect_refused"] or r["ack_codes"]:
            out.append(f"\nPair {r['pair']}: refusals {r['connect_refused']}, PUBACK codes {r['ack_codes']}")
    out += [
        "",
        "### Broker",
        "",
        "| measure | value |",
        "|---|---|",
        f"| kill -9 / restarts | {b['kills']} / {b['restarts']} ({', '.join(f'{k} {v}' for k, v in b['restart_reasons'].items()) or 'none'}) |",  # noqa: E501
        f"| kill to ready, s (min / mean / max) | {_span(b['ready_after_s'])} |",
        f"| kill to every normal client reconnected, s (min / mean / max) | {_span(b['clients_back_after_s'])} |",
        f"| RSS max | {fmt_mib(b['rss_max_kib'])} |",
        f"| of which anonymous at most (RssAnon, bound {max_rss_mib} MiB; the rest is mostly LMDB's file-backed "
        f"map) | {fmt_mib(b['rss_anon_max_kib'])} |",
        f"| RSS max over the last 10 minutes | {fmt_mib(b['rss_max_last10_kib'])} |",
        f"| RSS at the end | {fmt_mib(b['rss_end_kib'])} |",
        f"| RSS just before each kill | {', '.join(fmt_mib(k) for k in b['rss_before_kills_kib']) or 'n/a'} |",
        f"| sessions / retained messages restored at each restart | "
        f"{', '.join(f'{a} / {r}' for a, r in b['restored_sessions_retained']) or 'n/a'} |",
        f"| store on disk at the end | {b['store_bytes_end'] / MIB:.1f} MiB |",
        f"| exit status on SIGTERM at the end | {b['exit_status']} |",
        "",
        "### Broker log",
        "",
        "| lines | count |",
        "|---|---:|",
    ]
    for level in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "other"):
        if level in lg["levels"] or level in ("CRITICAL", "ERROR", "WARNING"):
            out.append(f"| {level} | {lg['levels'].get(level, 0)} |")
    for name, n in lg["specials"].items():
        out.append(f"| \"{name}\" | {n} |")
    if lg["top"]:
        out += ["", "Most frequent WARNING-or-worse lines (numbers as N, long names as `<long>`):", "",
                "| count | line |", "|---:|---|"]
        for n, shape, _example in lg["top"]:
            out.append(f"| {n} | `{shape.replace('|', '/')}` |")
    out += ["", "### Hostile clients: what the broker answered", "",
            "| scenario (runs) | outcome | count |", "|---|---|---:|"]
    runs = s["hostile"].get("runs", {})
    for sc, outcomes in sorted(s["hostile"].get("outcomes", {}).items()):
        first = True
        for outcome, n in sorted(outcomes.items()):
            label = f"{sc} ({runs.get(sc, '?')})" if first else ""
            out.append(f"| {label} | {outcome.replace('|', '/')} | {n} |")
            first = False
    if not s["hostile"]:
        out.append("| (none: --lanes 0) | | |" if run["lanes"] == 0 else "| (no result from the hostile process) | | |")
    out += ["", "### Verdict", ""]
    if s["failures"]:
        out += [f"- FAIL: {f}" for f in s["failures"]]
    else:
        out.append("- PASS: every acknowledged message of the normal clients arrived; RSS stayed within the bound.")
    out += [f"- attention: {a}" for a in s["attention"]]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/soak.py",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
Reading the summary:
  Normal clients: "acked" counts message numbers whose PUBACK arrived (reason code < 0x80); "delivered" counts
  distinct numbers the subscriber got; "lost" = acked but never delivered (must be 0); "duplicates" are extra
  copies (allowed: QoS 1, and expected after a kill); "never acked" numbers were still unacknowledged when the run
  ended (not a loss: their publisher never heard back); "re-sent" are PUBLISHes repeated after a reconnect.
  Broker: RSS is VmRSS of the broker process, sampled every second; the max over the last 10 minutes shows
  whether memory keeps growing once the run is warm. "paged entries not found", "store write failed" and
  CRITICAL lines should be 0. Hostile clients: every answer (CONNACK/SUBACK/PUBACK/DISCONNECT reason codes,
  closes, timeouts) counted per scenario.

Exit status: 0 all held; 1 an acknowledged normal message was lost, RSS went over --max-rss-mib, or the broker
could not be (re)started; 2 bad arguments. Everything runs on 127.0.0.1 in a temporary directory, removed at the end.

Examples:
  make soak                                              # 30 minutes, kill -9 every 180 s
  make soak SOAK_ARGS="--minutes 3 --kill-every 60"      # a short run
  .venv/bin/python bench/soak.py --minutes 10 --seed 7 --out soak.md --keep-log broker.log
  .venv/bin/python bench/soak.py --listener-set 'max_mqueue_len = 5000'   # any key check-config accepts
""")
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the load phase (default 30)")
    ap.add_argument("--kill-every", type=float, default=180.0,
                    help="seconds between two kill -9 of the broker during the load phase; 0 = never (default 180)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the hostile clients' choices (default: random, printed in the summary)")
    ap.add_argument("--out", type=Path, default=None, help="also write the summary (Markdown) to this file")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure as JSON to this file")
    ap.add_argument("--max-rss-mib", type=int, default=512,
                    help="fail when the broker's anonymous RSS (RssAnon: its own memory, without LMDB's "
                         "file-backed map) ever exceeds this many MiB (default 512)")
    ap.add_argument("--rss-guard-mib", type=int, default=None,
                    help="kill -9 the broker (as an OOM killer would) when its RSS exceeds this; counted apart "
                         "from the scheduled kills (default 4 x --max-rss-mib)")
    ap.add_argument("--pairs", type=int, default=4, help="normal publisher/subscriber pairs, alternately MQTT "
                                                         "3.1.1 and 5.0 (default 4)")
    ap.add_argument("--rate", type=float, default=50.0, help="messages per second per normal publisher (default 50)")
    ap.add_argument("--window", type=int, default=10,
                    help="most unacknowledged messages per normal publisher (default 10)")
    ap.add_argument("--lanes", type=int, default=3, help="hostile scenarios running at once (default 3)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), metavar="NAME,...",
                    help="the hostile scenarios to cycle through (default all: " + ", ".join(SCENARIOS) + ")")
    ap.add_argument("--scenario-seconds", type=float, default=20.0,
                    help="longest a hostile scenario runs before the lane moves on (default 20; stuck subscribers "
                         f"then stay stuck {STUCK_HOLD:.0f} s more)")
    ap.add_argument("--drain", type=float, default=120.0,
                    help="longest wait after the load for acknowledged messages to arrive, s (default 120)")
    ap.add_argument("--listener-set", action="append", default=[], metavar="'KEY = VALUE'",
                    help="a TOML line added to [listeners.external] (repeatable); default: shipped defaults")
    ap.add_argument("--commit", default=None, metavar="REV",
                    help="run the broker from `git archive REV` (e.g. HEAD) unpacked in the temporary directory, so "
                         "that edits to the working tree during the run do not reach the restarted broker "
                         "(default: the working tree as it is at each start)")
    ap.add_argument("--keep-log", type=Path, default=None, help="copy the broker's whole log to this file")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.pairs < 1 or args.rate <= 0 or args.window < 1 or args.lanes < 0:
        ap.error("--minutes, --pairs, --rate, --window must be positive and --lanes >= 0")
    args.scenarios = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 1_000_000)
    if args.rss_guard_mib is None:
        args.rss_guard_mib = 4 * args.max_rss_mib
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the run like Ctrl-C: everything started is stopped, the summary printed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M")
    workdir = Path(tempfile.mkdtemp(prefix="edge-gw-soak-"))
    blog = BrokerLog(workdir / "broker.log")
    ctx = mp.get_context("spawn")
    port_value = ctx.Value("i", 0, lock=False)
    hostile_stop = ctx.Event()
    hostile_result = ctx.Queue()
    hostile_proc: Any = None
    hostile: dict[str, Any] = {}
    pairs: list[NormalPair] = []
    sup: Supervisor | None = None
    timing = {"started": started, "load": 0.0, "drain": 0.0, "end": 0.0}
    store_size = 0
    try:
        broker_root = ROOT
        args.broker_rev = git_rev()
        if args.commit:
            args.broker_rev = export_commit(args.commit, workdir / "src")
            broker_root = workdir / "src"
        config = write_config(workdir, args.listener_set, broker_root)
        sup = Supervisor(workdir, config, blog, port_value, args.rss_guard_mib * 1024, t0, broker_root)
        log(f"seed {args.seed}; work directory {workdir}; {args.minutes:g} min of load, kill -9 every "
            f"{args.kill_every:g} s")
        sup.start()
        log(f"broker up on 127.0.0.1:{sup.port}")
        pairs = [NormalPair(i, sup, args.rate, args.window, 100) for i in range(args.pairs)]
        for p in pairs:
            p.start()
        for p in pairs:
            if not p.subscribed.wait(30):
                raise BrokerError(f"normal subscriber {p.index} could not subscribe within 30 s")
        load_start = sup.now()
        load_end = load_start + args.minutes * 60
        for p in pairs:
            p.start_publishing()
        if args.lanes:
            hostile_proc = ctx.Process(target=hostile_main, name="soak-hostile", daemon=True,
                                       args=(port_value, hostile_stop, args.seed, args.lanes, args.scenario_seconds,
                                             hostile_result, args.scenarios))
            hostile_proc.start()
        sup.run(load_start, load_end, args.kill_every)
        next_report = load_start + 30
        while sup.now() < load_end and sup.fatal is None:
            time.sleep(min(1.0, max(0.0, load_end - sup.now())))
            if sup.now() >= next_report:
                next_report += 30
                acked = sum(len(p.stats.acked) for p in pairs)
                got = sum(len(p.stats.received) for p in pairs)
                rss = sup.rss[-1][1] if sup.rss else 0
                log(f"{sup.now() - load_start:.0f} s: acked {acked}, delivered {got}, kills {sup.kills()}, "
                    f"RSS {rss // 1024} MiB, log W/E/C {blog.levels['WARNING']}/{blog.levels['ERROR']}/"
                    f"{blog.levels['CRITICAL']}")
        timing["load"] = sup.now() - load_start
        log("load over: stopping the hostile clients; draining")
        hostile_stop.set()
        for p in pairs:
            p.stop_new.set()
        if hostile_proc is not None:
            try:
                hostile = hostile_result.get(timeout=60)
            except Exception:  # queue.Empty or a broken pipe: report without it
                log("no result from the hostile process")
            hostile_proc.join(10)
        drain_start = sup.now()
        drain_end = drain_start + args.drain
        while sup.now() < drain_end and not all(p.complete() for p in pairs) and sup.fatal is None:
            time.sleep(0.2)
        timing["drain"] = sup.now() - drain_start
        timing["end"] = sup.now()
        log(f"drain {'complete' if all(p.complete() for p in pairs) else 'timed out'} after "
            f"{timing['drain']:.1f} s")
    except KeyboardInterrupt:
        log("interrupted: stopping everything")
        timing["end"] = time.monotonic() - t0
        timing["interrupted"] = 1.0
    except BrokerError as exc:
        log(f"fatal: {exc}")
        if sup is not None and sup.fatal is None:
            sup.fatal = str(exc)
        timing["end"] = time.monotonic() - t0
    finally:
        hostile_stop.set()
        for p in pairs:
            p.close()
        if sup is not None:
            sup.stop()
        if hostile_proc is not None and hostile_proc.is_alive():
            hostile_proc.join(5)
            if hostile_proc.is_alive():
                hostile_proc.kill()  # by PID: the child we started
                hostile_proc.join(5)
        store_size = store_bytes(workdir / "store")
        blog.close()
        if args.keep_log is not None:
            shutil.copyfile(blog.path, args.keep_log)
        shutil.rmtree(workdir, ignore_errors=True)
    assert sup is not None
    summary = summarize(args, sup, pairs, blog, hostile, timing, store_size)
    text = render(summary, args.max_rss_mib)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
