"""Publishing to the gateway broker with aiomqtt: one persistent MQTT 5 session, a bounded in-order buffer.

Every outgoing message (readings, events, command replies) goes into :class:`OutBuffer` first and leaves it
only when the broker has acknowledged it (QoS 1/2) or it was written (QoS 0). While the broker is unreachable
the buffer holds up to ``mqtt.buffer`` messages; when it is full the oldest QoS 0 message is dropped first, and
only when none is left the oldest QoS 1/2 message. After a reconnect everything still in the buffer is
published again in its original order (a message whose PUBACK was lost may arrive twice: consumers deduplicate
on ``(gateway_id, device, boot, seq)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from firmware_bridge.config import MqttConfig
from gateway.aiomqtt_client import Client as MqttClient

log = logging.getLogger("firmware_bridge.mqtt")


@dataclass(slots=True)
class Outgoing:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    correlation: bytes | None = None


class OutBuffer:
    """A bounded FIFO of outgoing messages; the first ``sent`` entries are in flight (published, not yet
    acknowledged) and are never dropped."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: deque[Outgoing] = deque()
        self.sent = 0
        self.dropped = {0: 0, 1: 0, 2: 0}

    def __len__(self) -> int:
        return len(self.items)

    def append(self, msg: Outgoing) -> Outgoing | None:
        """Add ``msg``; returns the message dropped to make room (possibly ``msg`` itself), or None."""
        dropped: Outgoing | None = None
        if len(self.items) >= self.capacity:
            idx = self._oldest(lambda m: m.qos == 0)
            if idx is None and msg.qos == 0:
                dropped = msg
            else:
                if idx is None:
                    idx = self._oldest(lambda m: True)
                if idx is None:
                    dropped = msg
                else:
                    dropped = self.items[idx]
                    del self.items[idx]
            if dropped is not None:
                self.dropped[dropped.qos] += 1
            if dropped is msg:
                return msg
        self.items.append(msg)
        return dropped

    def _oldest(self, pred: Callable[[Outgoing], bool]) -> int | None:
        for idx in range(self.sent, len(self.items)):
            if pred(self.items[idx]):
                return idx
        return None

    def next_unsent(self) -> Outgoing | None:
        if self.sent >= len(self.items):
            return None
        msg = self.items[self.sent]
        self.sent += 1
        return msg

    def ack_head(self) -> Outgoing:
        self.sent -= 1
        return self.items.popleft()

    def rewind(self) -> None:
        """The connection is gone: everything in flight is sent again, in order, after the reconnect."""
        self.sent = 0


class _Client(MqttClient):
    """aiomqtt's client, except that a PUBACK with a failure reason code (e.g. 0x97 Quota exceeded when the
    broker's store is full) is not taken as delivery: the connection is dropped, the message stays in the buffer
    and is published again after the reconnect."""

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if reason_code is not None and getattr(reason_code, "is_failure", False):
            log.warning("broker refused a publish (%s); reconnecting to publish it again", reason_code)
            self._client.disconnect()
            return
        super()._on_publish(client, userdata, mid, reason_code, properties)


class Publisher:
    """Runs the MQTT connection: connect (persistent session), subscribe, publish the buffer, reconnect."""

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        status_topic: str | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        on_message: Callable[[aiomqtt.Message], Awaitable[None]] | None = None,
        will: Callable[[], Outgoing] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        clean_start: bool = False,
        content_type: str | None = "application/json",
    ) -> None:
        """``will``: called before every CONNECT for its Will (instead of the status topic's ``offline``);
        ``on_disconnect``: told when a connection ends; ``clean_start``: a new session on every CONNECT (Session
        Expiry Interval 0) instead of the persistent one; ``content_type``: the MQTT 5 Content Type of every
        publish (UTF-8 JSON: Payload Format Indicator 1), or None for binary payloads (no properties)."""
        self.cfg = cfg
        self.buffer = OutBuffer(cfg.buffer)
        # status_topic: retained "online" on every connect and "offline" before a clean disconnect (also the Will);
        # published directly, so they never take a buffered reading's place
        self.status_topic = status_topic
        self.on_connect = on_connect
        self.on_message = on_message
        self.will = will
        self.on_disconnect = on_disconnect
        self.clean_start = clean_start
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self.connects = 0
        self.published = 0
        self.subscriptions: set[str] = set()
        self._wakeup = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._stopping = False
        self._restart: str | None = None
        self._drain_deadline = math.inf
        self.content_type = content_type
        self._json_props: Properties | None = None
        if content_type is not None:
            self._json_props = Properties(PacketTypes.PUBLISH)
            self._json_props.PayloadFormatIndicator = 1
            self._json_props.ContentType = content_type

    # -- producer side -------------------------------------------------------------------------------------------

    def enqueue(self, msg: Outgoing) -> Outgoing | None:
        """Buffer ``msg`` for publishing; returns what had to be dropped (None normally)."""
        dropped = self.buffer.append(msg)
        self._wakeup.set()
        return dropped

    async def publish_live(self, topic: str, payload: bytes, retain: bool = False) -> bool:
        """QoS 0 now if connected, else nothing (for state snapshots such as stats)."""
        client = self.client
        if client is None or not self.connected.is_set():
            return False
        try:
            await client.publish(topic, payload, qos=0, retain=retain, properties=self._json_props, timeout=5)
        except aiomqtt.MqttError:
            return False
        return True

    async def subscribe(self, topic_filter: str) -> None:
        """Subscribe (QoS 1, No Local) now if connected, and again on every reconnect."""
        new = topic_filter not in self.subscriptions
        self.subscriptions.add(topic_filter)
        client = self.client
        if new and client is not None and self.connected.is_set():
            with contextlib.suppress(aiomqtt.MqttError):
                await client.subscribe(topic_filter, options=SubscribeOptions(qos=1, noLocal=True), timeout=10)

    def restart(self, reason: str) -> None:
        """End the current connection once what is buffered now has been published (a clean DISCONNECT), then
        connect again as after a lost connection."""
        self._restart = reason
        self._wakeup.set()

    def stop(self, drain: float = 2.0) -> None:
        """Finish: publish what is buffered for up to ``drain`` seconds, then disconnect."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        self._drain_deadline = loop.time() + drain
        self._wakeup.set()
        self._stop_event.set()

    # -- connection loop -----------------------------------------------------------------------------------------

    def _client(self) -> aiomqtt.Client:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0 if self.clean_start else int(self.cfg.session_expiry)
        will = None
        if self.will is not None:
            w = self.will()
            will = aiomqtt.Will(w.topic, w.payload, qos=w.qos, retain=w.retain)
        elif self.status_topic is not None:
            will = aiomqtt.Will(self.status_topic, b"offline", qos=1, retain=True)
        if self.cfg.is_unix:
            host, port, transport = self.cfg.broker, 0, "unix"
        else:
            (host, port), transport = self.cfg.host_port(), "tcp"
        return _Client(
            host,
            port,
            identifier=self.cfg.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=self.clean_start,
            keepalive=self.cfg.keepalive,
            properties=props,
            will=will,
            transport=transport,  # type: ignore[arg-type]
            timeout=10,
            max_inflight_messages=self.cfg.window,
            logger=logging.getLogger("firmware_bridge.paho"),
        )

    async def run(self) -> None:
        """Connect and publish until :meth:`stop` and the buffer is drained (or the drain time is up)."""
        delay = self.cfg.reconnect_min
        down_logged = False
        while True:
            if self._stopping:  # not connected when the stop came: nothing can be drained
                return
            client = self._client()
            try:
                async with client:
                    self.client = client
                    self.connects += 1
                    self.connected.set()
                    delay = self.cfg.reconnect_min
                    log.info(
                        "connected to %s as %s (%s session)%s",
                        self.cfg.broker,
                        self.cfg.client_id,
                        "clean" if self.clean_start else "persistent",
                        f"; {len(self.buffer)} buffered" if self.buffer.items else "",
                    )
                    down_logged = False
                    await self._connected(client)
                if self._stopping:
                    return
            except aiomqtt.MqttError as exc:
                if not down_logged:
                    log.warning(
                        "broker %s unreachable: %s; buffering (up to %d) and retrying",
                        self.cfg.broker,
                        exc,
                        self.cfg.buffer,
                    )
                    down_logged = True
            except Exception:  # a bug must not end the bridge: log it, reconnect, publish the buffer again
                log.exception("MQTT connection to %s failed unexpectedly; reconnecting", self.cfg.broker)
            finally:
                self.client = None
                self.connected.clear()
                self.buffer.rewind()
                if self.on_disconnect is not None:
                    self.on_disconnect()
            if self._restart is not None:
                log.info("reconnecting to %s: %s", self.cfg.broker, self._restart)
                self._restart = None
                delay = self.cfg.reconnect_min
            await self._sleep(delay * random.uniform(0.8, 1.0))
            delay = min(self.cfg.reconnect_max, delay * 2)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), seconds)

    async def _connected(self, client: aiomqtt.Client) -> None:
        for topic_filter in sorted(self.subscriptions):
            await client.subscribe(topic_filter, options=SubscribeOptions(qos=1, noLocal=True), timeout=10)
        if self.status_topic is not None:
            await client.publish(self.status_topic, b"online", qos=1, retain=True, timeout=10)
        if self.on_connect is not None:
            await self.on_connect()
        pump = asyncio.ensure_future(self._pump(client))
        listen = asyncio.ensure_future(self._listen(client))
        try:
            done, _ = await asyncio.wait({pump, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, listen):
                task.cancel()
            await asyncio.gather(pump, listen, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if self._stopping and self.status_topic is not None:
            await client.publish(self.status_topic, b"offline", qos=1, retain=True, timeout=2)

    async def _listen(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            if self.on_message is not None:
                try:
                    await self.on_message(message)
                except Exception:
                    log.exception("error handling a message on %s", message.topic)

    async def _pump(self, client: aiomqtt.Client) -> None:
        """Publish the buffer in order, up to ``window`` unacknowledged at once; returns when stopping and
        drained. Raises MqttError when the connection breaks."""
        loop = asyncio.get_running_loop()
        inflight: deque[asyncio.Future[None]] = deque()
        try:
            while True:
                while len(inflight) < self.cfg.window:
                    msg = self.buffer.next_unsent()
                    if msg is None:
                        break
                    props = self._json_props
                    if msg.correlation is not None and self.content_type is not None:
                        props = Properties(PacketTypes.PUBLISH)
                        props.PayloadFormatIndicator = 1
                        props.ContentType = self.content_type
                        props.CorrelationData = msg.correlation
                    inflight.append(
                        asyncio.ensure_future(
                            client.publish(
                                msg.topic,
                                msg.payload,
                                qos=msg.qos,
                                retain=msg.retain,
                                properties=props,
                                timeout=math.inf,
                            )
                        )
                    )
                if not inflight:
                    if self._stopping or self._restart is not None:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if self._stopping and loop.time() >= self._drain_deadline:
                    return
                head = inflight[0]
                self._wakeup.clear()
                waker = asyncio.ensure_future(self._wakeup.wait())
                try:
                    timeout = None if not self._stopping else max(0.0, self._drain_deadline - loop.time())
                    first: set[asyncio.Future[Any]] = {head, waker}
                    await asyncio.wait(first, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waker.cancel()
                while inflight and inflight[0].done():
                    inflight.popleft().result()  # raises MqttError if the publish failed
                    self.buffer.ack_head()
                    self.published += 1
        finally:
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
