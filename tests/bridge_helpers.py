"""Helpers for the firmware-bridge tests: the bridge as a real subprocess, a real MQTT subscriber that records
what arrives, and small polling utilities (no fixed sleeps)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from helpers import wait_until
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

# A real receiver's log: gpsd's regression capture test/daemon/garmin17n.log (Garmin 17N, submitted by Wojciech
# Kazubski, 2005-03-12; "Copyright 2010 by the GPSD project, BSD terms apply"), both seconds of it, verbatim.
# gpsd's expected decoding of it (garmin17n.log.chk) gives lat 52.219065000, lon 21.010851667, alt 137.2,
# hdop 0.90, 10 satellites used, time 2005-03-16T09:38:02.000Z.
GARMIN_17N_LOG = """\
$GPRMC,093802,A,5213.1439,N,02100.6511,E,000.0,226.0,160305,004.2,E,D*15
$GPGGA,093802,5213.1439,N,02100.6511,E,2,10,0.9,137.2,M,36.2,M,,*43
$GPGSA,A,3,03,06,15,16,18,19,21,22,,27,29,,1.6,0.9,1.3*34
$GPGSV,3,2,12,18,50,135,50,19,15,291,46,21,59,069,51,22,30,169,49*75
$PGRME,1.7,M,2.4,M,3.0,M*2D
$GPGLL,5213.1439,N,02100.6511,E,093802,A,D*48
$GPVTG,226,T,222,M,000.0,N,0000.0,K,D*12
$PGRMV,0.0,0.0,0.0*5C
$PGRMF,290,293895,160305,093802,13,5213.1439,N,02100.6511,E,A,2,0,226,2,1*11
$PGRMB,0.0,200,,,,K,,W,W*31
$PGRMM,WGS 84*06
$GPRMC,093803,A,5213.1439,N,02100.6511,E,000.0,226.0,160305,004.2,E,D*14
$GPGGA,093803,5213.1439,N,02100.6511,E,2,10,0.9,137.2,M,36.2,M,,*42
$GPGSA,A,3,03,06,15,16,18,19,21,22,,27,29,,1.6,0.9,1.3*34
$GPGSV,3,3,12,26,14,065,48,27,08,336,38,29,14,048,44,44,18,130,41*78
$PGRME,1.7,M,2.4,M,3.0,M*2D
$GPGLL,5213.1439,N,02100.6511,E,093803,A,D*49
$GPVTG,226,T,222,M,000.0,N,0000.0,K,D*12
$PGRMV,0.0,0.0,0.0*5C
$PGRMF,290,293896,160305,093803,13,5213.1439,N,02100.6511,E,A,2,0,226,2,1*13
$PGRMB,0.0,200,,,,K,,W,W*31
$PGRMM,WGS 84*06
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for brokers that must come back on the same port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BridgeProcess:
    """``firmware-bridge run --config`` in a subprocess, logging to a pipe that a thread collects."""

    def __init__(
        self, config: str, workdir: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fw-bridge-"))
        self.config_path = self.workdir / "bridge.toml"
        self.config_path.write_text(config)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None

    def start(self, wait_for: str | None = "firmware-bridge ready", timeout: float = 15.0) -> BridgeProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "firmware_bridge", "run", "--config", str(self.config_path)],
            cwd=self.workdir,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))

        self._reader = threading.Thread(target=pump, daemon=True)
        self._reader.start()
        if wait_for is not None:
            try:
                wait_until(
                    lambda: any(wait_for in line for line in self.lines) or self.proc.poll() is not None,
                    timeout,
                    f"{wait_for!r} in the bridge's log",
                )
            except AssertionError:
                self.kill()
                raise
            if self.proc.poll() is not None:
                self._cleanup()
                raise RuntimeError("bridge exited:\n" + self.log())
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return "\n".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._cleanup()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._reader is not None:
            self._reader.join(2)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


class Collector:
    """A real MQTT 5 subscriber (paho) that records every message; optionally a persistent session that
    reconnects by itself."""

    def __init__(self, port: int, filters: Iterable[str], client_id: str = "", persistent: bool = False) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self._lock = threading.Lock()
        self.filters = list(filters)
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.client.reconnect_delay_set(0.05, 0.3)
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        props = None
        if persistent:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 600
        self.client.connect("127.0.0.1", port, keepalive=30, clean_start=not persistent, properties=props)
        self.client.loop_start()
        if not self.subscribed.wait(10):
            self.close()
            raise RuntimeError("subscriber did not get its SUBACK")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if not reason.is_failure:
            client.subscribe([(f, SubscribeOptions(qos=1)) for f in self.filters])

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(msg)

    def on(self, topic: str) -> list[mqtt.MQTTMessage]:
        with self._lock:
            return [m for m in self.messages if m.topic == topic]

    def json(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(m.payload) for m in self.on(topic)]

    def wait_json(self, topic: str, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """At least ``count`` JSON messages on ``topic``."""
        wait_until(
            lambda: len(self.on(topic)) >= count, timeout, f"{count} message(s) on {topic} (have {len(self.on(topic))})"
        )
        return self.json(topic)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def read_stats(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def wait_stats(
    path: str | os.PathLike[str],
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float = 10.0,
    what: str = "stats",
) -> dict[str, Any]:
    """Poll the bridge's stats file until ``predicate(stats)`` holds."""
    last: list[dict[str, Any] | None] = [None]

    def check() -> dict[str, Any] | None:
        stats = read_stats(path)
        last[0] = stats
        try:
            return stats if stats is not None and predicate(stats) else None
        except (KeyError, TypeError):
            return None

    try:
        return wait_until(check, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last stats: {json.dumps(last[0])}") from None
