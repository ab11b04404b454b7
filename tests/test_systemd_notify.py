"""The broker's side of systemd's notification protocol, against a fake ``NOTIFY_SOCKET`` (README section
"The appliance: systemd services, Ansible provisioning, the gateway image").

Each test binds a unix datagram socket in a temporary directory, starts the real broker subprocess with
``NOTIFY_SOCKET`` pointing at it (and ``WATCHDOG_USEC`` as systemd would set it from ``WatchdogSec=``), and reads the
datagrams the broker sends: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1. The hang tests use the debug-only trigger
``EDGE_GATEWAY_DEBUG_HANG`` (gateway/server/notify.py): SIGUSR2 blocks the event loop, or holds the LMDB write lock so
the store writer cannot commit.
"""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import BrokerProcess, RawClient, wait_until

from gateway.mqtt.packets import PubAck, Publish, Suback, Subscribe, Subscription

WATCHDOG_USEC = 400_000  # pings every 0.2 s; the store writer counts as stalled after 0.4 s
CONFIG = """
[broker]
sys_interval = 0
[listeners.external]
bind = "127.0.0.1:0"
"""
STATUS_RE = re.compile(
    r"STATUS=(\d+) clients, (\d+) queued, store \d+\.\d KiB of 1\.0 GiB used( \(writer stalled\))?; "
    r"1 listener\(s\)"
)


class NotifySocket:
    """A fake systemd notification socket: every datagram with the monotonic time it was read."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sdnotify-"))  # short: AF_UNIX paths are limited to 107 bytes
        self.path = str(self.dir / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, str]] = []

    def poll(self, timeout: float) -> None:
        """Read what arrives within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(min(left, 0.05))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float = 10.0) -> list[str]:
        """Read until ``predicate(all messages so far)`` holds; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not predicate(self.texts()):
            assert time.monotonic() < deadline, f"timed out; got {self.texts()}"
            self.poll(0.05)
        return self.texts()

    def texts(self) -> list[str]:
        return [text for _, text in self.messages]

    def ping_times(self, after: float = 0.0) -> list[float]:
        return [t for t, text in self.messages if text == "WATCHDOG=1" and t >= after]

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    ns = NotifySocket()
    yield ns
    ns.close()


@pytest.fixture
def notified_broker(
    notify_socket: NotifySocket, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., BrokerProcess]]:
    """Start a broker that talks to ``notify_socket``; extra environment variables as keyword arguments."""
    started: list[BrokerProcess] = []

    def start(**env: str) -> BrokerProcess:
        env = {"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": str(WATCHDOG_USEC), **env}
        proc = BrokerProcess(CONFIG, workdir=str(tmp_path_factory.mktemp("notify")), env=env).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def after_loading(texts: list[str]) -> list[str]:
    """``texts`` without the ``STATUS=loading store: ...`` lines sent while the store loads, before READY=1
    (tests/test_store_progress.py checks those)."""
    return [t for t in texts if not t.startswith("STATUS=loading store: ")]


def pings(texts: list[str]) -> int:
    return texts.count("WATCHDOG=1")


def statuses(texts: list[str]) -> list[tuple[int, int, bool]]:
    """(clients, queued, writer stalled) of every STATUS= summary, in order."""
    out = []
    for text in texts:
        m = STATUS_RE.fullmatch(text)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), m.group(3) is not None))
    return out


def largest_gap(times: list[float]) -> tuple[float, int]:
    """The longest time between consecutive pings and how many pings came after it."""
    gaps = [(b - a, len(times) - i - 1) for i, (a, b) in enumerate(itertools.pairwise(times))]
    return max(gaps) if gaps else (0.0, 0)


def wait_log(proc: BrokerProcess, text: str, timeout: float = 10.0) -> None:
    wait_until(lambda: text in proc.log(), timeout, lambda: f"{text!r} in the log:\n{proc.log()}")


def test_sd_notify_ready_status_watchdog_stopping_sequence(
    notify_socket: NotifySocket, notified_broker: Callable[..., BrokerProcess], uid: str
) -> None:
    """READY=1 first, once the listener is bound and the store open; then STATUS= (clients,
    queued, store use) refreshed as it changes and WATCHDOG=1 every half WATCHDOG_USEC; on SIGTERM STOPPING=1, no
    ping after it, then the store is closed and the exit code is 0."""
    proc = notified_broker()
    texts = after_loading(notify_socket.wait_for(lambda t: pings(t) >= 3))
    assert texts[0] == "READY=1"
    assert statuses(texts[1:2]) == [(0, 0, False)], texts[1]
    assert (Path(proc.workdir) / "var" / "data.mdb").is_file()  # the store was open before READY
    assert set(texts[2:]) == {"WATCHDOG=1"}

    # A persistent subscriber: 1 client while connected, then its 3 offline messages are queued.
    sub = RawClient(proc.port, version=5)
    try:
        sub.connect(f"{uid}-sub", clean_start=False, properties={0x11: 3600})  # Session Expiry Interval
        sub.send(Subscribe(1, [Subscription(f"{uid}/t", qos=1)]))
        assert isinstance(sub.recv(), Suback)
        notify_socket.wait_for(lambda t: (1, 0, False) in statuses(t))
    finally:
        sub.close()
    notify_socket.wait_for(lambda t: statuses(t)[-1] == (0, 0, False))
    for n in range(3):
        subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(proc.port), "-q", "1", "-t", f"{uid}/t", "-m", str(n)],
            check=True,
            timeout=10,
        )
    notify_socket.wait_for(lambda t: statuses(t)[-1] == (0, 3, False))

    before = len(notify_socket.messages)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(10) == 0
    notify_socket.poll(0.3)
    tail = notify_socket.texts()[before:]
    stop_at = tail.index("STOPPING=1")
    assert tail[stop_at:] == [
        "STOPPING=1",
        "STATUS=stopping: disconnecting clients, writing what is pending, closing the store",
    ]
    assert set(tail[:stop_at]) <= {"WATCHDOG=1"}
    proc.stop()
    assert "store closed" in proc.log()


def test_sd_notify_watchdog_pings_stop_while_event_loop_hangs(
    notify_socket: NotifySocket, notified_broker: Callable[..., BrokerProcess]
) -> None:
    """WATCHDOG=1 only while the event loop turns. SIGUSR2 with EDGE_GATEWAY_DEBUG_HANG=loop:2 blocks the loop for 2 s:
    no ping in that time (systemd would kill the service), and pings resume once the loop turns again."""
    proc = notified_broker(EDGE_GATEWAY_DEBUG_HANG="loop:2")
    notify_socket.wait_for(lambda t: pings(t) >= 2)
    hang_from = time.monotonic()
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGUSR2)
    wait_log(proc, "debug: event loop resumed")
    notify_socket.wait_for(lambda t: len(notify_socket.ping_times(hang_from)) >= 4)
    gap, after = largest_gap(notify_socket.ping_times(hang_from - 0.5))
    assert gap >= 1.5, notify_socket.messages
    assert after >= 2


def test_sd_notify_watchdog_pings_stop_while_store_writer_is_stuck(
    notify_socket: NotifySocket, notified_broker: Callable[..., BrokerProcess], uid: str
) -> None:
    """WATCHDOG=1 only while the store writer commits. SIGUSR2 with EDGE_GATEWAY_DEBUG_HANG=store:2.5 holds the LMDB
    write lock: a QoS 1 retained PUBLISH is not acknowledged, STATUS says the writer is stalled and the pings stop; when
    the lock is released the PUBACK arrives and pings resume."""
    proc = notified_broker(EDGE_GATEWAY_DEBUG_HANG="store:2.5")
    notify_socket.wait_for(lambda t: pings(t) >= 2)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGUSR2)
    wait_log(proc, "debug: store write lock held")
    hang_from = time.monotonic()
    pub = RawClient(proc.port, version=5, timeout=10)
    try:
        pub.connect(f"{uid}-pub")
        pub.send(Publish(f"{uid}/retained", b"kept", qos=1, retain=True, packet_id=7))
        with pytest.raises(TimeoutError):
            pub.recv(timeout=1.0)  # not durable yet: no PUBACK (docs/architecture.md, "The durability contract")
        notify_socket.wait_for(lambda t: (1, 0, True) in statuses(t))
        ack = pub.recv(timeout=5.0)
        assert isinstance(ack, PubAck) and ack.packet_id == 7
        acked_at = time.monotonic()
    finally:
        pub.close()
    notify_socket.wait_for(lambda t: len(notify_socket.ping_times(acked_at)) >= 2 and not statuses(t)[-1][2])
    gap, after = largest_gap(notify_socket.ping_times(hang_from - 0.5))
    assert gap >= 1.2, notify_socket.messages
    assert after >= 2


def test_sd_notify_no_watchdog_pings_for_another_pid(
    notify_socket: NotifySocket, notified_broker: Callable[..., BrokerProcess]
) -> None:
    """sd_watchdog_enabled(3): WATCHDOG_USEC is for the process named by WATCHDOG_PID; a broker with another PID
    sends READY=1 and STATUS= but no WATCHDOG=1."""
    notified_broker(WATCHDOG_PID="1")
    notify_socket.wait_for(lambda t: len(after_loading(t)) >= 2)
    notify_socket.poll(1.0)  # five ping periods
    texts = after_loading(notify_socket.texts())
    assert texts[0] == "READY=1"
    assert statuses(texts[1:2]) == [(0, 0, False)]
    assert "WATCHDOG=1" not in texts


def test_sd_notify_status_reports_upstream_link_state(
    notify_socket: NotifySocket, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """STATUS= names each upstream link's state and outbox depth: a link to a loopback port nobody listens
    on is reported backing off with an empty outbox."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    config = (
        CONFIG
        + f"""
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{closed_port}"
backoff_initial = "5s"
[[upstream.forward]]
local = "sensors/#"
"""
    )
    proc = BrokerProcess(
        config,
        workdir=str(tmp_path_factory.mktemp("notify-up")),
        env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)},
    ).start()
    try:
        texts = notify_socket.wait_for(lambda t: any(x.endswith("; upstream cloud backing-off, outbox 0") for x in t))
        status = next(x for x in texts if x.endswith("backing-off, outbox 0"))
        assert re.fullmatch(
            r"STATUS=0 clients, 0 queued, store \d+\.\d KiB of 1\.0 GiB used; 1 listener\(s\); "
            r"upstream cloud backing-off, outbox 0",
            status,
        ), status
    finally:
        assert proc.stop() == 0, proc.log()
