"""Helpers of the authentication and ACL tests: a real Debian ``mosquitto`` with a given password/ACL file on
127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MosquittoBroker:
    """``mosquitto -c`` with ``listener PORT 127.0.0.1`` and the extra lines given, its log kept in ``lines``."""

    def __init__(self, workdir: Path, extra: str) -> None:
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lines: list[str] = []

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(exe).exists():
            pytest.skip("mosquitto is not installed (make deps installs it)")
        for _ in range(5):
            self.port = free_port()
            conf = self.workdir / "mosquitto.conf"
            # user root: a root-started mosquitto would otherwise switch to user mosquitto, which cannot read the
            # 0600 files the tests write
            conf.write_text(
                f"listener {self.port} 127.0.0.1\nuser root\npersistence false\nlog_dest stderr\n"
                f"log_type all\nlog_timestamp false\n{self.extra}\n"
            )
            self.lines = []
            self.proc = subprocess.Popen(
                [exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        return self
                time.sleep(0.05)
            self.stop()
        raise RuntimeError("mosquitto did not start:\n" + "\n".join(self.lines))

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines)

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

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mosquitto_pub(
    port: int, username: str, password: str, topic: str = "t/x", timeout: float = 10.0
) -> subprocess.CompletedProcess[str]:
    """``mosquitto_pub -u -P`` (QoS 1, MQTT 3.1.1) to 127.0.0.1:``port``; the result, exit code and output."""
    return subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-u",
            username,
            "-P",
            password,
            "-t",
            topic,
            "-m",
            "hello",
            "-q",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
