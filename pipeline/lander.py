"""The lander: cloud broker -> immutable landing area of JSON lines (no pyspark here).

Spark has no maintained MQTT source, so this small process holds a persistent QoS 1 session on the cloud broker
and lands every message as one JSON line (landing format 2)::

    {"topic":"fleet/gw-0001/buoy-b01","arrival":"2024-05-01T12:00:01.123456Z","msg_id":"gw-0001:17",
     "qos":1,"retain":false,"payload":{"v":1,"gateway_id":"gw-0001",...}}

``payload`` is the message text exactly as received: embedded byte for byte as the JSON object it is (so Spark's
JSON reader parses the line and the envelope in one pass), or, when the text is not one JSON object on one line,
as a JSON string (landing format 1 wrote every payload as a string; the jobs read both). ``payload_b64`` instead,
with ``payload`` null, when it is not UTF-8. ``payload`` is always the last key. ``msg_id`` is the upstream
bridge's MQTT 5 User Property or null.

Layout: ``<landing>/date=YYYY-MM-DD/gateway=<gateway_id>/part-<first arrival>-<lander>-<random>.jsonl``, by the
arrival date (UTC) and the gateway id taken from the topic (``<prefix>/<gateway_id>/<device>``; ``unknown`` when
the topic has fewer than three levels). Lines go to hidden temporary files (``.part-...jsonl.inprogress``, which
Spark never reads); a *roll* (enough bytes, the oldest line old enough, as many messages unacknowledged as the
broker may send, or the broker quiet for a moment) fsyncs them, renames them to their final names, fsyncs the
directories, and only then sends the PUBACKs, in the order the messages arrived (MQTT-4.6.0-2). A crash before a
roll loses nothing: the broker still holds the unacknowledged messages and sends them again to the resumed session.
Landing is therefore at-least-once; the jobs deduplicate.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import random
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeline.lander")

TEMP_SUFFIX = ".inprogress"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _escape(value: str) -> str:
    """A path-safe partition value (other bytes percent-encoded, as Spark escapes partition values)."""
    return _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode()), value) or "unknown"


def gateway_of(topic: str) -> str:
    """The gateway id of a forwarded reading's topic ``<prefix...>/<gateway_id>/<device>``."""
    levels = topic.split("/")
    return levels[-2] if len(levels) >= 3 and levels[-2] else "unknown"


class EmbeddedJSON(str):
    """A payload text that is one JSON object: :func:`encode_line` writes it into the line as it is, not quoted."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python's json accepts them, JSON and Spark do not


def is_json_object(text: str) -> bool:
    """``text`` is exactly one strict JSON object (RFC 8259: no NaN/Infinity) on one line (no CR or LF outside its
    strings, so the landing line stays one line)."""
    if not text.lstrip().startswith("{") or "\n" in text or "\r" in text:
        return False
    try:
        return isinstance(json.loads(text, parse_constant=_reject_constant), dict)
    except (ValueError, RecursionError):
        return False


def landing_record(
    topic: str,
    payload: bytes,
    arrival: dt.datetime,
    msg_id: str | None,
    qos: int,
    retain: bool,
    embed_objects: bool = True,
) -> dict[str, Any]:
    """One landing line (before :func:`encode_line`). ``payload``: an :class:`EmbeddedJSON` when the text is a
    JSON object and ``embed_objects`` (landing format 2), else the text as a string (format 1), or None with
    ``payload_b64`` when the bytes are not UTF-8."""
    record: dict[str, Any] = {
        "topic": topic,
        "arrival": arrival.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "msg_id": msg_id,
        "qos": qos,
        "retain": retain,
    }
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        record["payload"] = None
        record["payload_b64"] = base64.b64encode(payload).decode("ascii")
        return record
    record["payload"] = EmbeddedJSON(text) if embed_objects and is_json_object(text) else text
    return record


def encode_line(record: dict[str, Any]) -> bytes:
    """The landing line of ``record`` (compact JSON, UTF-8, LF-terminated; ``payload`` last, embedded unquoted
    when it is an :class:`EmbeddedJSON`)."""
    payload = record.get("payload")
    if not isinstance(payload, EmbeddedJSON):
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    rest = {k: v for k, v in record.items() if k != "payload"}
    head = json.dumps(rest, ensure_ascii=False, separators=(",", ":"))
    return (head[:-1] + ',"payload":' + str(payload) + "}\n").encode("utf-8")


@dataclass
class _OpenFile:
    temp: Path
    final: Path
    handle: Any


class LandingWriter:
    """Appends lines to one hidden temporary file per (date, gateway) partition; ``roll`` makes them durable and
    visible. Not thread-safe: the lander calls it from its event loop only."""

    def __init__(self, root: str | os.PathLike[str], writer_id: str) -> None:
        self.root = Path(root)
        self.writer_id = _escape(writer_id)
        self._open: dict[tuple[str, str], _OpenFile] = {}
        self._new_dirs: set[Path] = set()
        self.pending_bytes = 0
        self.pending_lines = 0
        self.first_pending_at: float | None = None
        self.files_rolled = 0
        self.lines_rolled = 0

    def remove_stale_temp_files(self) -> int:
        """Delete this writer's temporary files left by a crash (their messages were never acknowledged, so the
        broker sends them again). Another lander's files (another client id) are left alone."""
        removed = 0
        if not self.root.is_dir():
            return 0
        for path in self.root.glob(f"date=*/gateway=*/.part-*-{self.writer_id}-*.jsonl{TEMP_SUFFIX}"):
            path.unlink()
            removed += 1
        return removed

    def append(self, record: dict[str, Any], gateway: str, arrival: dt.datetime) -> None:
        date = arrival.astimezone(dt.UTC).strftime("%Y-%m-%d")
        key = (date, gateway)
        entry = self._open.get(key)
        if entry is None:
            directory = self.root / f"date={date}" / f"gateway={_escape(gateway)}"
            if not directory.is_dir():
                for parent in (self.root, directory.parent, directory):
                    if not parent.is_dir():
                        parent.mkdir(parents=True, exist_ok=True)
                        self._new_dirs.add(parent)
            name = f"part-{arrival.strftime('%Y%m%dT%H%M%S%fZ')}-{self.writer_id}-{uuid.uuid4().hex[:12]}.jsonl"
            temp = directory / f".{name}{TEMP_SUFFIX}"
            entry = _OpenFile(temp, directory / name, open(temp, "xb"))  # noqa: SIM115 (closed by roll)
            self._open[key] = entry
        line = encode_line(record)
        entry.handle.write(line)
        self.pending_bytes += len(line)
        self.pending_lines += 1
        if self.first_pending_at is None:
            self.first_pending_at = time.monotonic()

    def roll(self) -> list[Path]:
        """fsync every open file, rename it to its visible name and fsync the directories; returns the new files."""
        landed: list[Path] = []
        dirs: set[Path] = set()
        for entry in self._open.values():
            entry.handle.flush()
            os.fsync(entry.handle.fileno())
            entry.handle.close()
            os.rename(entry.temp, entry.final)
            dirs.add(entry.final.parent)
            landed.append(entry.final)
        # a new directory's own entry lives in its parent: fsync the parents of new directories as well
        for new in self._new_dirs:
            dirs.add(new.parent)
        for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.files_rolled += len(landed)
        self.lines_rolled += self.pending_lines
        self._open.clear()
        self._new_dirs.clear()
        self.pending_bytes = 0
        self.pending_lines = 0
        self.first_pending_at = None
        return landed

    def close(self) -> None:
        """Roll whatever is pending (used on shutdown and when the connection is lost)."""
        if self._open:
            self.roll()


@dataclass
class LanderConfig:
    landing: str = "var/pipeline/landing"
    host: str = "127.0.0.1"
    port: int = 1883
    topics: list[str] = field(default_factory=lambda: ["sensors/+/+"])
    client_id: str = "fleet-lander"
    mqtt_version: int = 5  # 5 or 4 (3.1.1)
    session_expiry: float = 7 * 86400.0  # MQTT 5: how long the broker keeps the session while the lander is down
    keepalive: int = 30
    roll_bytes: int = 64 * 1024 * 1024
    roll_seconds: float = 60.0  # the oldest unlanded message waits at most this long
    idle_seconds: float = 1.0  # roll when the broker has sent nothing for this long (caught up, or window full)
    max_pending: int = 1000  # roll when this many messages await their PUBACK; MQTT 5 Receive Maximum
    payload_as_string: bool = False  # landing format 1: every payload as a JSON string (the jobs parse it twice)
    username: str | None = None
    password: str | None = None
    tls: bool = False
    cafile: str | None = None
    reconnect_min: float = 0.5
    reconnect_max: float = 30.0


class Lander:
    """Runs the subscriber: ``await Lander(config).run(stop_event)``."""

    def __init__(self, config: LanderConfig) -> None:
        self.config = config
        self.writer = LandingWriter(config.landing, config.client_id)
        self._pending: list[tuple[int, int]] = []  # (packet id, qos) in arrival order, acknowledged after a roll
        self._last_message_at = time.monotonic()
        self.received = 0

    # -- MQTT -------------------------------------------------------------------------------------------------------

    def _client(self) -> Any:
        import aiomqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        c = self.config
        kwargs: dict[str, Any] = {}
        if c.mqtt_version == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = int(c.session_expiry)
            props.ReceiveMaximum = max(1, min(c.max_pending, 65535))
            kwargs.update(protocol=aiomqtt.ProtocolVersion.V5, clean_start=False, properties=props)
        else:
            kwargs.update(protocol=aiomqtt.ProtocolVersion.V311, clean_session=False)
        if c.tls:
            kwargs["tls_params"] = aiomqtt.TLSParameters(ca_certs=c.cafile)
        client = aiomqtt.Client(
            c.host,
            c.port,
            identifier=c.client_id,
            keepalive=c.keepalive,
            username=c.username,
            password=c.password,
            **kwargs,
        )
        # aiomqtt 2.x has no manual acknowledgement of its own yet (empicano/aiomqtt#345): switch it on in the
        # paho client underneath, whose ack(mid, qos) sends the PUBACK (paho-mqtt >= 2.0).
        client._client.manual_ack_set(True)
        return client

    def _on_message(self, message: Any) -> None:
        arrival = dt.datetime.now(dt.UTC)
        topic = str(message.topic)
        msg_id = None
        props = message.properties
        for name, value in getattr(props, "UserProperty", None) or []:
            if name == "msg_id":
                msg_id = value
                break
        payload = message.payload if isinstance(message.payload, bytes) else str(message.payload).encode()
        record = landing_record(
            topic, payload, arrival, msg_id, message.qos, bool(message.retain), not self.config.payload_as_string
        )
        self.writer.append(record, gateway_of(topic), arrival)
        self.received += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("received %s mid %d qos %d", topic, message.mid, message.qos)
        if message.qos > 0:
            self._pending.append((message.mid, message.qos))
        self._last_message_at = time.monotonic()

    def _roll_and_ack(self, paho: Any | None) -> None:
        files = self.writer.roll()
        if paho is not None:
            for mid, qos in self._pending:
                paho.ack(mid, qos)
        if files:
            log.debug("landed %d files, acknowledged %d messages", len(files), len(self._pending))
        self._pending.clear()

    def _due(self) -> bool:
        w, c = self.writer, self.config
        if w.pending_lines == 0:
            return False
        if w.pending_bytes >= c.roll_bytes or len(self._pending) >= c.max_pending:
            return True
        now = time.monotonic()
        assert w.first_pending_at is not None
        return now - w.first_pending_at >= c.roll_seconds or now - self._last_message_at >= c.idle_seconds

    async def _consume(self, client: Any, stop: asyncio.Event) -> bool:
        """Land messages until the connection fails (raises) or ``stop`` is set (returns True)."""
        paho = client._client

        async def receive() -> None:
            async for message in client.messages:
                self._on_message(message)
                if self._due():
                    self._roll_and_ack(paho)

        async def tick() -> None:
            period = max(0.01, min(0.1, self.config.idle_seconds / 2))
            while True:
                await asyncio.sleep(period)
                if self._due():
                    self._roll_and_ack(paho)

        tasks = {asyncio.create_task(receive()), asyncio.create_task(tick()), asyncio.create_task(stop.wait())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        # stopping: land and acknowledge what we hold while still connected
        self._roll_and_ack(paho)
        return True

    async def run(self, stop: asyncio.Event | None = None) -> None:
        import aiomqtt

        stop = stop or asyncio.Event()
        c = self.config
        Path(c.landing).mkdir(parents=True, exist_ok=True)
        stale = self.writer.remove_stale_temp_files()
        if stale:
            log.info("removed %d unacknowledged temporary files from an earlier run", stale)
        delay = c.reconnect_min
        while not stop.is_set():
            try:
                async with self._client() as client:
                    for topic in c.topics:
                        await client.subscribe(topic, qos=1)
                    log.info("lander ready: %s:%d topics %s -> %s", c.host, c.port, " ".join(c.topics), c.landing)
                    delay = c.reconnect_min
                    if await self._consume(client, stop):
                        break
            except aiomqtt.MqttError as exc:
                # The files hold what arrived; land them, but the packet ids died with the connection: the broker
                # sends those messages again (duplicates are removed downstream).
                self.writer.close()
                self._pending.clear()
                log.warning("connection to %s:%d lost (%s); retrying in %.1fs", c.host, c.port, exc, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay * random.uniform(0.8, 1.2))
                delay = min(c.reconnect_max, delay * 2)
        self.writer.close()
        log.info("lander stopped: %d messages received, %d files landed", self.received, self.writer.files_rolled)


def run_lander(config: LanderConfig) -> int:
    """Run until SIGTERM/SIGINT; everything received is landed and acknowledged before exit."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Lander(config).run(stop)

    asyncio.run(main())
    return 0
