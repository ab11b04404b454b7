"""Fixtures and helpers of the fleet pipeline tests (imported by tests/test_pipeline_*.py; not a conftest, so the
shared tests/conftest.py stays untouched): one SparkSession for the whole run, a real Mosquitto on loopback,
the lander as a real subprocess, and builders for reading envelopes and landing files."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
UTC = dt.UTC


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession (2 cores, 2 shuffle partitions, UI off, 127.0.0.1) for every pipeline test."""
    pytest.importorskip("pyspark")
    from pipeline.spark import get_spark

    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.fail("Spark needs Java 17: apt-get install openjdk-17-jre-headless")

    session = get_spark(
        "fleet-pipeline-tests",
        {
            "spark.master": "local[2]",
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.ui.enabled": "false",
        },
    )
    yield session
    session.stop()


def ts(text: str) -> dt.datetime:
    """``"2024-05-01T12:00:01.25"`` -> an aware UTC datetime."""
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def rfc3339_ms(value: dt.datetime) -> str:
    """The envelope's time format: UTC, milliseconds, ``Z``."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def envelope(
    gateway: str,
    device: str,
    boot: int,
    seq: int,
    gateway_time: dt.datetime,
    sensor_time: dt.datetime | None,
    values: dict[str, tuple[float, str]],
) -> bytes:
    """A reading envelope exactly as docs/message-format.md describes it."""
    return json.dumps(
        {
            "v": 1,
            "gateway_id": gateway,
            "device": device,
            "boot": boot,
            "seq": seq,
            "sensor_time": rfc3339_ms(sensor_time) if sensor_time is not None else None,
            "gateway_time": rfc3339_ms(gateway_time),
            "values": {k: {"value": v, "unit": u} for k, (v, u) in values.items()},
        }
    ).encode()


def write_landing(
    root: Path, records: list[tuple[str, bytes, dt.datetime, str | None]], writer_id: str = "t", embed: bool = True
) -> None:
    """Land (topic, payload, arrival, msg_id) records with the lander's own writer, then roll (one file per
    arrival date and gateway). ``embed`` False: landing format 1 (every payload as a JSON string)."""
    from pipeline.lander import LandingWriter, gateway_of, landing_record

    writer = LandingWriter(root, writer_id)
    for topic, payload, arrival, msg_id in records:
        writer.append(landing_record(topic, payload, arrival, msg_id, 1, False, embed), gateway_of(topic), arrival)
    writer.roll()


def landed_lines(root: Path) -> list[dict[str, Any]]:
    """Every line of every visible landing file."""
    paths = sorted(root.glob("date=*/gateway=*/*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def payload_of(line: dict[str, Any]) -> Any:
    """A landing line's payload as JSON: embedded as the object (format 2) or a JSON string (format 1)."""
    payload = line["payload"]
    return json.loads(payload) if isinstance(payload, str) else payload


# -- Mosquitto and the lander as real processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Mosquitto:
    """Debian's mosquitto on 127.0.0.1 (a free port), logging everything to a pipe we keep."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lines: list[str] = []

    def start(self, timeout: float = 10.0, same_port: bool = False) -> Mosquitto:
        """Start on a free port, or again on the previous one (``same_port``, e.g. after an outage)."""
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.path.exists(exe):
            pytest.skip("mosquitto is not installed (make deps installs it)")
        for _ in range(5):
            if not same_port or not self.port:
                self.port = free_port()
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(
                f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "max_queued_messages 100000\nmax_inflight_messages 0\nlog_dest stderr\nlog_type all\n"
                "log_timestamp false\n"
            )
            self.lines = []
            self.proc = subprocess.Popen(
                [exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            ready = threading.Event()
            threading.Thread(target=self._pump, args=(self.proc, ready), daemon=True).start()
            ready.wait(timeout)
            if self.proc.poll() is None and self._listening():
                return self
            self.stop()
        raise RuntimeError("mosquitto did not start:\n" + "\n".join(self.lines))

    def _pump(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "Opening ipv4 listen socket" in line or ("mosquitto version" in line and "running" in line):
                ready.set()
        ready.set()

    def _listening(self) -> bool:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return True
            time.sleep(0.05)
        return False

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(1 for line in list(self.lines) if rx.search(line))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """A real Mosquitto standing in for the cloud broker (one per test module)."""
    broker = Mosquitto(tmp_path_factory.mktemp("mosquitto")).start()
    yield broker
    broker.stop()


class LanderProcess:
    """``python -m pipeline land`` as a subprocess; ``kill()`` is SIGKILL, ``stop()`` SIGTERM."""

    def __init__(self, port: int, landing: Path, client_id: str, *extra: str) -> None:
        self.cmd = [
            sys.executable, "-m", "pipeline", "--log-level", "debug", "land",
            "--host", "127.0.0.1", "--port", str(port), "--landing", str(landing), "--client-id", client_id,
            *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self, timeout: float = 20.0) -> LanderProcess:
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if "lander ready" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.kill()
            raise RuntimeError("lander did not start:\n" + self.log())
        return self

    def log(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
