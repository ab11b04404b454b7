"""Test helpers: run the real broker as a subprocess on an ephemeral loopback port, and a raw MQTT client
that speaks bytes over a real socket (for malformed input and exact packet checks)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Connack, Connect, Packet

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on (\S+):(\d+) \(listener '([^']+)'")


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str | Callable[[], str] = "condition",
    interval: float = 0.02,
) -> Any:
    """Poll ``predicate`` until it returns something truthy and return that; AssertionError naming ``what`` (or
    what ``what()`` says then, e.g. with a log) after ``timeout`` seconds. For waiting on an event (a message
    arrived, a counter updated, a line logged) in place of a fixed sleep; ``predicate`` may itself raise
    AssertionError to fail early."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what if isinstance(what, str) else what()}")
        time.sleep(interval)


#: Every broker a test started, in order: a failing test's report shows the logs of those it started (conftest).
STARTED: list[BrokerProcess] = []


class BrokerProcess:
    """``edge-gateway serve`` in a subprocess. ``ports`` maps listener name -> bound port."""

    def __init__(self, config: str | None = None, workdir: str | None = None, env: dict[str, str] | None = None):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="edge-gw-"))
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = self.workdir / "gateway.toml"
            self.config_path.write_text(config)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc: subprocess.Popen[str] | None = None
        self.ports: dict[str, int] = {}
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The first listener's port."""
        return next(iter(self.ports.values()))

    def start(self, timeout: float = 15.0) -> BrokerProcess:
        cmd = [sys.executable, "-m", "gateway", "serve"]
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        STARTED.append(self)
        self.ports = {}
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                m = _LISTEN.search(line)
                if m:
                    self.ports[m.group(3)] = int(m.group(2))
                if "edge-gateway ready" in line:
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=pump, daemon=True)
        self._reader.start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("broker did not start:\n" + "\n".join(self.lines))
        return self

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        if self._reader is not None:
            self._reader.join(2)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL (a crash) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()


class RawClient:
    """A blocking MQTT client over a real TCP socket that sends raw bytes or packets and decodes replies with
    the project's codec (replies are also checked byte-for-byte where tests need it)."""

    def __init__(self, port: int, host: str = "127.0.0.1", version: int = 4, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = PacketReader(version=version)
        self.version = version
        self.timeout = timeout
        self._pending: list[Packet] = []
        self.raw_received = bytearray()

    def send(self, data: bytes | Any) -> None:
        if not isinstance(data, bytes | bytearray):
            data = data.encode(self.version)
        self.sock.sendall(data)

    def connect(self, client_id: str = "", clean_start: bool = True, keep_alive: int = 60, **kw: Any) -> Connack:
        self.send(Connect(client_id, self.version, clean_start, keep_alive, **kw).encode(self.version))
        packet = self.recv()
        assert isinstance(packet, Connack), packet
        return packet

    def recv(self, timeout: float | None = None) -> Packet:
        """The next packet; raises TimeoutError when none arrives, ConnectionError when the server closed."""
        if self._pending:
            return self._pending.pop(0)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no packet from the broker")
                if not sel.select(left):
                    continue
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("broker closed the connection")
                self.raw_received += data
                self._pending.extend(self.reader.feed(data))
                if self._pending:
                    return self._pending.pop(0)
        finally:
            sel.close()

    def recv_all(self, timeout: float = 0.5) -> list[Packet]:
        """Every packet that arrives within ``timeout`` seconds."""
        packets = []
        try:
            while True:
                packets.append(self.recv(timeout))
        except (TimeoutError, ConnectionError):
            pass
        return packets

    def closed_by_server(self, timeout: float = 3.0) -> bool:
        """True when the server closes the connection within ``timeout`` (packets before it are kept)."""
        deadline = time.monotonic() + timeout
        kept, self._pending = self._pending, []
        try:
            while time.monotonic() < deadline:
                try:
                    kept.append(self.recv(deadline - time.monotonic()))
                except ConnectionError:
                    return True
                except TimeoutError:
                    return False
                except OSError:
                    return True
            return False
        finally:
            self._pending = kept + self._pending

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
