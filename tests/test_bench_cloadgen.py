"""The C idle-connection load generator of the benchmarks (bench/cloadgen; docs/benchmarks.md, "The C load
generator"), built by its Makefile rule and run against a real edge-gateway and a real Mosquitto on ephemeral
loopback ports: every connection it reports is one the broker saw (``$SYS/broker/clients/connected``, and
Mosquitto's log of each CONNECT), it holds them until its stdin closes, and it refuses any host but 127.0.0.1.
Behaviour only, never speed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from auth_helpers import MosquittoBroker
from helpers import BrokerProcess, RawClient, wait_until

from gateway.mqtt.packets import Publish, Suback, Subscribe, Subscription

ROOT = Path(__file__).resolve().parent.parent
CONNECTIONS = 300
CONNECTED_TOPIC = "$SYS/broker/clients/connected"


@pytest.fixture(scope="module")
def cloadgen() -> str:
    """The generator built by `make cloadgen` (what `make bench` builds), as the benchmarks run it."""
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.skip("gcc or make is missing (make compiler installs gcc)")
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "cloadgen"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = ROOT / "bench" / "cloadgen" / "cloadgen"
    assert exe.is_file()
    return str(exe)


@pytest.fixture()
def gateway(tmp_path: Path) -> Iterator[BrokerProcess]:
    proc = BrokerProcess('[broker]\nsys_interval = "1s"\n[listeners.external]\nbind = "127.0.0.1:0"\n',
                         workdir=str(tmp_path)).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def mosquitto(tmp_path: Path) -> Iterator[MosquittoBroker]:
    with MosquittoBroker(tmp_path, "allow_anonymous true\nsys_interval 1") as broker:
        yield broker


class SysWatcher:
    """A client subscribed to ``$SYS/broker/clients/connected``: the broker's own count of connected clients
    (this client included), updated every sys_interval."""

    def __init__(self, port: int) -> None:
        self.client = RawClient(port)
        self.client.connect("cloadgen-sys-watcher")
        self.client.send(Subscribe(1, [Subscription(CONNECTED_TOPIC, 0)]))
        self.granted: list[int] | None = None
        self.value = -1

    def wait_for(self, count: int, timeout: float = 20.0) -> None:
        def seen() -> bool:
            for packet in self.client.recv_all(0.3):
                if isinstance(packet, Suback):
                    self.granted = list(packet.reason_codes)
                elif isinstance(packet, Publish) and packet.topic == CONNECTED_TOPIC:
                    self.value = int(packet.payload)
            return self.granted == [0] and self.value == count

        wait_until(seen, timeout, what=lambda: f"{CONNECTED_TOPIC} == {count} (last seen {self.value})")

    def close(self) -> None:
        self.client.close()


def _start(exe: str, port: int, prefix: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """cloadgen idle with CONNECTIONS connections, at most 32 handshakes at a time; its first report."""
    proc = subprocess.Popen([exe, "idle", "--host", "127.0.0.1", "--port", str(port), "--connections",
                             str(CONNECTIONS), "--concurrency", "32", "--keep-alive", "60", "--username", "bench",
                             "--client-id-prefix", prefix, "--timeout", "60"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"cloadgen gave no report: {proc.communicate()[1]}")
    return proc, json.loads(line)


def _release(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close its stdin: it resets every connection, reports and exits 0."""
    out, err = proc.communicate(input="", timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[0])


def _check_first_report(report: dict[str, Any]) -> None:
    assert (report["connected"], report["failed"], report["timed_out"]) == (CONNECTIONS, 0, 0), report
    assert report["elapsed"] > 0 and report["cpu_s"] >= 0, report
    assert report["first_error"] == ""


def _connect_hold_release(exe: str, port: int, prefix: str, while_held: Callable[[], None] = lambda: None) -> None:
    """cloadgen opens CONNECTIONS connections with ``prefix`` client ids; the broker's own count sees all of them (and
    the watcher); ``while_held`` checks more while they are held; released, every one closed and the broker's count
    back to the watcher alone."""
    watcher = SysWatcher(port)
    proc = None
    try:
        watcher.wait_for(1)
        proc, report = _start(exe, port, prefix)
        _check_first_report(report)
        watcher.wait_for(CONNECTIONS + 1)  # the broker's count: all of them, and the watcher
        while_held()
        assert proc.poll() is None  # held until stdin closes
        assert _release(proc) == {"closed": CONNECTIONS, "dropped": 0}
        watcher.wait_for(1)  # the broker saw them all go
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        watcher.close()


def test_cloadgen_connects_and_holds_every_connection_on_edge_gateway(cloadgen: str, gateway: BrokerProcess) -> None:
    _connect_hold_release(cloadgen, gateway.port, "cl-eg-")


def test_cloadgen_connects_and_holds_every_connection_on_mosquitto(cloadgen: str, mosquitto: MosquittoBroker) -> None:
    def all_logged() -> None:
        # Mosquitto logs every CONNECT it accepted: 3.1.1 (p2), Clean Session 1, Keep Alive 60, the user name
        seen = re.compile(r"New client connected from 127\.0\.0\.1:\d+ as cl-mq-(\d+) \(p2, c1, k60, u'bench'\)")
        ids = {int(m.group(1)) for line in list(mosquitto.lines) if (m := seen.search(line))}
        assert ids == set(range(CONNECTIONS)), mosquitto.log()[-2000:]

    _connect_hold_release(cloadgen, mosquitto.port, "cl-mq-", all_logged)


@pytest.mark.parametrize("host", ["192.0.2.1", "localhost", "::1", "127.0.0.2", "0.0.0.0"])
def test_cloadgen_refuses_any_host_but_loopback(cloadgen: str, host: str) -> None:
    proc = subprocess.run([cloadgen, "idle", "--host", host, "--port", "1883", "--connections", "1"],
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"refusing host {host}: only 127.0.0.1 (loopback) is allowed" in proc.stderr


def test_self_check_runs_the_c_generator_through_the_harness_against_the_c_sink(cloadgen: str) -> None:
    """``loadgen.py --self-check --only connect_c``: bench/run.py's path (the worker checks that the port is its
    harness's child's, starts the program, releases it) against the C sink, which answered every CONNECT."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loadgen.py"), "--self-check", "--json", "--no-pin",
                           "--connections", "200", "--only", "connect_c"],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert set(res) == {"connect_c"}
    r = res["connect_c"]
    assert (r["connected"], r["failed"], r["sink_connacks"]) == (200, 0, 200), r
    assert r["rate"] > 0 and r["generator_cpu"] >= 0
