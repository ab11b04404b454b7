"""One upstream link: the aiomqtt glue around the sans-I/O :class:`~gateway.upstream.outbox.Outbox`.

The outbox decides (order per remote topic, windows, paced drain, live lane, re-send, bounds, counters); this
module connects to the cloud broker with backoff and jitter, subscribes for the downlink, feeds the outbox its
events and performs what it returns, publishes the link's ``$SYS`` values, and reads the clock (:func:`_now`, the
one place).

Life of a forwarded message (docs/upstream.md):

1. :meth:`UpstreamLink.forward` runs inside ``gateway.broker.router.publish`` (``Broker.forwarders``), before the local
   publisher's PUBACK/PUBCOMP is registered: :meth:`Outbox.offer` records a QoS 1/2 message (or QoS 0 with
   ``store_qos0``) in the store's outbox then, so the outbox row is committed with the acknowledgement.
2. :meth:`UpstreamLink._pump` hands each :meth:`Outbox.next_send` to paho while the link is up, and reports the
   Packet Identifier paho gave it (:meth:`Outbox.sent`).
3. paho's ``on_publish`` (PUBACK for QoS 1, PUBCOMP for QoS 2) becomes :meth:`Outbox.acked`, which deletes the
   row. A lost link is :meth:`Outbox.link_down`: everything unacknowledged goes back to the backlog, in order, and
   is sent again after the reconnect with the same ``msg_id`` User Property (MQTT 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.aiomqtt_client import Client as MqttClient
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.topics import topic_matches
from gateway.upstream.config import UpstreamConfig, fill
from gateway.upstream.entries import FORWARDED_PROPERTIES, Entry, PeerLimits, Send
from gateway.upstream.outbox import SENDER_PREFIX, Outbox
from gateway.upstream.verdicts import NOT_A_MESSAGE

if TYPE_CHECKING:
    from gateway.broker.actions import Action
    from gateway.broker.broker import Broker
    from gateway.broker.message import Message

__all__ = ["SENDER_PREFIX", "UpstreamLink"]

log = logging.getLogger("gateway.upstream")

CONNECTING, CONNECTED, BACKING_OFF, STOPPED = "connecting", "connected", "backing-off", "stopped"

#: paho's attribute names of the message properties that cross the link both ways (``FORWARDED_PROPERTIES``, the
#: Message Expiry Interval and User Properties).
_PAHO_NAMES: dict[int, str] = {
    P.PAYLOAD_FORMAT_INDICATOR: "PayloadFormatIndicator",
    P.CONTENT_TYPE: "ContentType",
    P.RESPONSE_TOPIC: "ResponseTopic",
    P.CORRELATION_DATA: "CorrelationData",
    P.MESSAGE_EXPIRY_INTERVAL: "MessageExpiryInterval",
    P.USER_PROPERTY: "UserProperty",
}

#: A connection that lasted this long (seconds) resets the backoff to ``backoff_initial``.
_STABLE_AFTER = 30.0


def _now() -> float:
    """The link's one clock read: wall-clock seconds, the clock of the broker's ``now`` and of
    ``Message.received_at``. Every outbox event gets its time from here."""
    return time.time()


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _TearDown(Exception):
    """The link is torn down on purpose (half-open, or stopping)."""


class _Connection:
    """One connection attempt: an aiomqtt client plus the three things the bridge needs that aiomqtt's API does not
    give, taken from paho's public API:

    - the CONNACK properties (Receive Maximum, Maximum QoS, Retain Available, Maximum Packet Size; aiomqtt drops
      them), from paho's ``on_connect`` callback;
    - a publish that does not wait (aiomqtt's ``publish`` awaits the acknowledgement and times out after
      ``timeout``, so a window of 32 would need 32 tasks, and a half-open peer would raise instead of being left
      to ``ack_timeout``): ``paho.Client.publish``, which returns the Packet Identifier;
    - the reason code of each PUBACK/PUBCOMP (aiomqtt discards it; the ``rejected`` drop and "retry later" need
      it), from paho's ``on_publish`` callback;
    - the Reason Code of a DISCONNECT the cloud sends (whether a close may be a message's fault), from paho's
      ``on_disconnect`` callback;

    and one behaviour: a peer that closes the connection before CONNACK fails the attempt at once (paho's
    ``on_disconnect``) instead of after ``connect_timeout`` (aiomqtt ignores a disconnect before CONNACK; without
    this a cloud that refuses connections costs ``connect_timeout`` per attempt, not the backoff delay).

    The callbacks are chained in front of aiomqtt's own (which still run); nothing of aiomqtt or paho is
    overridden. The one private name used is ``aiomqtt.Client._client``, the paho client aiomqtt wraps, for which
    aiomqtt 2.x has no public accessor.
    """

    def __init__(self, client: aiomqtt.Client, on_ack: Callable[[_Connection, int, int], None]) -> None:
        self.client = client
        self.paho: paho.Client = client._client  # see the class docstring
        self.connack_seen = False
        self.connack_properties: Any = None
        self.disconnect_reason: int | None = None  # the Reason Code of a DISCONNECT the cloud sent, if it sent one
        self.closed_early: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_ack = on_ack
        # paho's callback attributes are typed for either of its callback API versions; aiomqtt's are VERSION2.
        self._aiomqtt_on_connect: Callable[..., Any] | None = self.paho.on_connect
        self._aiomqtt_on_disconnect: Callable[..., Any] | None = self.paho.on_disconnect
        self._aiomqtt_on_publish: Callable[..., Any] | None = self.paho.on_publish
        self.paho.on_connect = self._on_connect
        self.paho.on_disconnect = self._on_disconnect
        self.paho.on_publish = self._on_publish

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
        self.connack_seen = True
        self.connack_properties = properties
        if self._aiomqtt_on_connect is not None:
            self._aiomqtt_on_connect(client, userdata, flags, reason_code, properties)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
        if not self.connack_seen and not self.closed_early.done():
            self.closed_early.set_result(None)
        if getattr(flags, "is_disconnect_packet_from_server", False):
            self.disconnect_reason = int(getattr(reason_code, "value", 0) or 0)
        if self._aiomqtt_on_disconnect is not None:
            self._aiomqtt_on_disconnect(client, userdata, flags, reason_code, properties)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if self._aiomqtt_on_publish is not None:
            self._aiomqtt_on_publish(client, userdata, mid, reason_code, properties)
        self._on_ack(self, mid, int(getattr(reason_code, "value", 0) or 0))

    async def open(self) -> None:
        """Connect (aiomqtt's ``__aenter__``: TCP, TLS, CONNECT, CONNACK within ``connect_timeout``); raise
        ``aiomqtt.MqttError`` as soon as the peer closes before CONNACK."""
        enter = asyncio.ensure_future(self.client.__aenter__())
        first: set[asyncio.Future[Any]] = {enter, self.closed_early}
        try:
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            enter.cancel()
            raise
        if not enter.done():
            enter.cancel()
            with contextlib.suppress(BaseException):
                await enter
            raise aiomqtt.MqttError("connection closed before CONNACK")
        enter.result()

    async def close(self) -> None:
        """Disconnect (aiomqtt's ``__aexit__``)."""
        await self.client.__aexit__(None, None, None)

    def publish(self, send: Send, properties: Any) -> int:
        """Hand one PUBLISH to paho; its Packet Identifier (paho's ``mid``)."""
        info = self.paho.publish(send.topic, send.payload, send.qos, send.retain, properties)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        return info.mid

    def limits(self, protocol: int) -> PeerLimits:
        """The cloud broker's CONNACK limits (MQTT 5.0 §3.2.2.3; none for MQTT 3.1.1)."""
        props = self.connack_properties
        if props is None or protocol != 5:
            return PeerLimits()
        receive_max = getattr(props, "ReceiveMaximum", None)
        max_qos = getattr(props, "MaximumQoS", None)
        retain = getattr(props, "RetainAvailable", None)
        return PeerLimits(
            int(receive_max) if receive_max else None,
            2 if max_qos is None else int(max_qos),
            True if retain is None else bool(retain),
            int(getattr(props, "MaximumPacketSize", 0) or 0),
        )


class UpstreamLink:
    """One ``[[upstream]]``: the outbox, the connection, the pump, the downlink, the ``$SYS`` values.

    Args:
        cfg: the link's configuration.
        broker: the local broker (its store holds the outbox; the downlink publishes into it).
        perform: hands the I/O layer the broker's actions of a downlink or ``$SYS`` publish (``BrokerIO.perform``).
    """

    def __init__(self, cfg: UpstreamConfig, broker: Broker, perform: Callable[[list[Action]], Any]) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.broker = broker
        self.perform = perform
        self.sender_id = SENDER_PREFIX + cfg.name
        self.outbox = Outbox(cfg, broker.store)
        self.state = STOPPED
        self.received = 0  # messages brought down by subscribe rules
        self._conn: _Connection | None = None
        self._pump_scheduled = False
        self._wake: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._kill: asyncio.Event | None = None
        self._kill_reason = ""
        self._sys_sent: dict[str, str] = {}
        self._next_sys = 0.0
        self._attempt = 0

    @property
    def entries(self) -> dict[int, Entry]:
        """The outbox's entries (gateway/server/notify.py reports their number)."""
        return self.outbox.entries

    # ------------------------------------------------------------------------------------------ lifecycle

    def load(self, now: float) -> None:
        """Take the outbox rows stored for this link (before any client can publish), apply TTL and bounds."""
        self.outbox.load(now)
        if self.outbox.entries:
            log.info(
                "upstream %s: %d messages (%d bytes) in the outbox from before the restart",
                self.name,
                len(self.outbox.entries),
                self.outbox.bytes,
            )

    def start(self) -> None:
        """Start connecting (and the timers); call from the broker's event loop."""
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name=f"upstream-{self.name}")
        self._ticker = self._loop.create_task(self._tick_forever(), name=f"upstream-{self.name}-tick")

    async def stop(self) -> None:
        """Disconnect and stop; unacknowledged outbox rows stay for the next start."""
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        self._tear_down("stopping")
        for task in (self._task, self._ticker):
            if task is None:
                continue
            try:
                await asyncio.wait_for(task, self.cfg.connect_timeout + 2)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            except Exception:
                log.exception("upstream %s: error while stopping", self.name)
        if self._wake is not None:
            self._wake.cancel()
        self._set_state(STOPPED, _now())

    # ------------------------------------------------------------------------------------------ outbox events

    def forward(self, message: Message, now: float) -> bool:
        """``Broker.forwarders`` hook: :meth:`Outbox.offer`; True when the outbox took ``message``."""
        outbox = self.outbox
        taken = outbox.offer(message, now)
        if outbox.warn_due:
            self._warn(now)
        if taken and outbox.up and not self._pump_scheduled and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)
        return taken

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self.outbox.up and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Send what the outbox says may go now; set the pacing timer when it says to wait."""
        self._pump_scheduled = False
        conn = self._conn
        if conn is None:
            return
        outbox = self.outbox
        now = _now()
        v5 = self.cfg.protocol == 5
        while (send := outbox.next_send(now)) is not None:
            try:
                packet_id = conn.publish(send, self._properties(send) if v5 else None)
            except Exception as exc:  # paho refused (the socket is gone): the connection task notices and rebuilds
                outbox.send_failed(send, now)
                log.warning("upstream %s: send failed (%s); reconnecting", self.name, exc)
                self._tear_down(f"send failed: {exc}")
                break
            outbox.sent(send, packet_id, now)
        if outbox.warn_due:
            self._warn(now)
        if outbox.wake_at is not None and self._wake is None and self._loop is not None:
            self._wake = self._loop.call_later(max(outbox.wake_at - now, 0.001), self._woken)

    def _woken(self) -> None:
        self._wake = None
        self._schedule_pump()

    @staticmethod
    def _properties(send: Send) -> Any:
        """:attr:`Send.properties` as paho's: exactly what the outbox sized."""
        props = PahoProperties(PacketTypes.PUBLISH)
        for pid, value in send.properties.items():
            setattr(props, _PAHO_NAMES[pid], value)
        return props

    def _on_ack(self, conn: _Connection, packet_id: int, reason_code: int) -> None:
        """paho's ``on_publish`` for the current connection: :meth:`Outbox.acked`."""
        if conn is not self._conn:
            return  # a late callback of a connection already given up
        now = _now()
        if self.outbox.acked(packet_id, reason_code, now):
            self._attempt = 0  # the link works: the next reconnect starts from backoff_initial
            if self.outbox.warn_due:
                self._warn(now)
            self._schedule_pump()

    # ------------------------------------------------------------------------------------------ connection

    def _make_client(self) -> aiomqtt.Client:
        cfg = self.cfg
        tls = None
        if cfg.tls:
            tls = aiomqtt.TLSParameters(ca_certs=cfg.ca_file, certfile=cfg.cert_file, keyfile=cfg.key_file)
        return MqttClient(
            cfg.host,
            cfg.port,
            username=cfg.username,
            password=cfg.password,
            identifier=cfg.client_id,
            protocol=aiomqtt.ProtocolVersion.V5 if cfg.protocol == 5 else aiomqtt.ProtocolVersion.V311,
            keepalive=cfg.keep_alive,
            timeout=cfg.connect_timeout,
            tls_params=tls,
            max_inflight_messages=cfg.max_inflight,
            logger=logging.getLogger("gateway.upstream.mqtt"),
        )

    async def _run(self) -> None:
        """Connect, serve, and after a failure back off: ``min(backoff_max, backoff_initial * 2^attempt)`` times a
        random factor in [0.5, 1] (docs/upstream.md "Reconnect and liveness")."""
        assert self._stop_event is not None
        while not self._stopping:
            self._set_state(CONNECTING, _now())
            conn = _Connection(self._make_client(), self._on_ack)
            up_since = 0.0
            try:
                await conn.open()
                try:
                    up_since = _now()
                    await self._serve(conn)
                finally:
                    await conn.close()
            except asyncio.CancelledError:
                self._disconnected(conn)
                raise
            except (aiomqtt.MqttError, OSError, _TearDown) as exc:
                if not self._stopping:
                    log.warning(
                        "upstream %s: %s %s:%d: %s",
                        self.name,
                        "lost" if up_since else "cannot connect to",
                        self.cfg.host,
                        self.cfg.port,
                        exc or type(exc).__name__,
                    )
            except Exception:
                log.exception("upstream %s: connection failed", self.name)
            finally:
                self._disconnected(conn)
            if self._stopping:
                return
            if up_since and _now() - up_since >= _STABLE_AFTER:
                self._attempt = 0
            delay = min(self.cfg.backoff_max, self.cfg.backoff_initial * 2 ** min(self._attempt, 30))
            delay *= random.uniform(0.5, 1.0)  # jitter: gateways that lost the same cloud do not come back at once
            self._attempt += 1
            self._set_state(BACKING_OFF, _now())
            log.info("upstream %s: reconnecting in %.2f s (attempt %d)", self.name, delay, self._attempt)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), delay)

    async def _serve(self, conn: _Connection) -> None:
        """The connection is up: tell the outbox, pump, run the downlink until the connection ends or is torn
        down."""
        self._conn = conn
        self._kill = asyncio.Event()
        self._kill_reason = ""
        if self._stopping:
            raise _TearDown("stopping")
        now = _now()
        self.outbox.link_up(conn.limits(self.cfg.protocol), now)
        self._set_state(CONNECTED, now)
        log.info(
            "upstream %s: connected to %s:%d as %r (MQTT %s, inflight window %d, backlog %d)",
            self.name,
            self.cfg.host,
            self.cfg.port,
            self.cfg.client_id,
            "5" if self.cfg.protocol == 5 else "3.1.1",
            self.outbox.window,
            len(self.outbox.entries),
        )
        self._schedule_pump()
        downlink = asyncio.ensure_future(self._downlink(conn.client))
        killed = asyncio.ensure_future(self._kill.wait())
        try:
            await asyncio.wait({downlink, killed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (downlink, killed):
                task.cancel()
            with contextlib.suppress(BaseException):
                await killed
        if downlink.done() and not downlink.cancelled() and downlink.exception() is not None:
            raise downlink.exception()  # type: ignore[misc]
        with contextlib.suppress(BaseException):
            await downlink
        raise _TearDown(self._kill_reason or "closed")

    async def _downlink(self, client: aiomqtt.Client) -> None:
        for rule in self.cfg.subscribe:
            remote = fill(rule.remote, self.cfg.gateway_id)
            if self.cfg.protocol == 5:
                await client.subscribe(remote, options=SubscribeOptions(qos=rule.qos, noLocal=True))
            else:
                await client.subscribe(remote, rule.qos)
        async for msg in client.messages:
            self._deliver_down(msg)

    def _deliver_down(self, msg: aiomqtt.Message) -> None:
        topic = msg.topic.value
        for rule in self.cfg.subscribe:
            remote = fill(rule.remote, self.cfg.gateway_id)
            if topic_matches(remote, topic):
                break
        else:
            return
        now = _now()
        local = rule.local_topic(topic, self.cfg.gateway_id)
        props: dict[int, Any] = {}
        expires_at = None
        src = msg.properties
        if src is not None:
            for pid in FORWARDED_PROPERTIES:
                value = getattr(src, _PAHO_NAMES[pid], None)
                if value is not None:
                    props[pid] = value
            users = getattr(src, "UserProperty", None)
            if users:
                props[P.USER_PROPERTY] = [(str(k), str(v)) for k, v in users]
            expiry = getattr(src, "MessageExpiryInterval", None)
            if expiry:
                props[P.MESSAGE_EXPIRY_INTERVAL] = int(expiry)
                expires_at = now + int(expiry)
        payload = msg.payload if isinstance(msg.payload, bytes) else str(msg.payload or "").encode()
        self.received += 1
        self.perform(self.broker.publish_local(
            local,
            bytes(payload),
            min(msg.qos, rule.qos),
            bool(msg.retain),
            props,
            now,
            sender=self.sender_id,
            expires_at=expires_at,
        ))

    def _tear_down(self, reason: str) -> None:
        """Close the current connection (if any); the connection task then backs off and reconnects."""
        if self._kill is not None and not self._kill.is_set():
            self._kill_reason = reason
            self._kill.set()

    def _disconnected(self, conn: _Connection) -> None:
        """The connection is gone: :meth:`Outbox.link_down` (its late callbacks are ignored from here on), saying
        whether the cloud closed it for a reason that may be a message's fault (not torn down by the gateway, and
        no DISCONNECT Reason Code in :data:`~gateway.upstream.verdicts.NOT_A_MESSAGE`)."""
        if self._conn is not conn:
            return
        self._conn = None
        by_cloud = not self._kill_reason and not self._stopping
        self.outbox.link_down(_now(), by_cloud and conn.disconnect_reason not in NOT_A_MESSAGE)

    # ------------------------------------------------------------------------------------------ timers, $SYS

    async def _tick_forever(self) -> None:
        interval = min(1.0, self.cfg.ack_timeout / 4)
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                self.tick(_now())
            except Exception:
                log.exception("upstream %s: tick failed", self.name)

    def tick(self, now: float) -> None:
        """:meth:`Outbox.tick` (expiry, half-open detection), then warnings and ``$SYS`` values."""
        teardown = self.outbox.tick(now)
        if teardown is not None:
            log.warning(
                "upstream %s: connected but no acknowledgement for %.1f s with %d in flight; tearing "
                "the link down (half-open?)",
                self.name,
                teardown.silent_for,
                teardown.inflight,
            )
            self._tear_down(teardown.reason)
        self._warn(now)
        interval = self.broker.settings.sys_interval
        if interval and now >= self._next_sys:
            self._next_sys = now + interval
            self.publish_sys(now)
        self._schedule_pump()

    def _warn(self, now: float) -> None:
        """Publish what the bounds dropped on ``$SYS/broker/connection/<name>/warning`` (at most once a second;
        not before :meth:`start`)."""
        if self._loop is None:
            return
        text = self.outbox.warning(now)
        if text is None:
            return
        log.warning(
            "upstream %s: outbox dropped %s (backlog %d messages, %d bytes)",
            self.name,
            text,
            len(self.outbox.entries),
            self.outbox.bytes,
        )
        self.perform(self.broker.publish_local(
            f"$SYS/broker/connection/{self.name}/warning", f"dropped {text}".encode(), 0, False, {}, now
        ))

    def sys_values(self, now: float) -> dict[str, str]:
        """The link's ``$SYS/broker/connection/<name>/...`` values."""
        outbox = self.outbox
        counters = outbox.counters
        head = next(iter(outbox.entries.values()), None)  # arrival order: the head is the oldest
        oldest = None if head is None else head.message.received_at
        values = {
            "state": self.state,
            "backlog/messages": str(len(outbox.entries)),
            "backlog/bytes": str(outbox.bytes),
            "backlog/oldest_age": "none" if oldest is None else f"{max(0.0, now - oldest):.1f}",
            "inflight": str(len(outbox.inflight)),
            "last_ack": "never" if outbox.last_ack_at is None else _iso(outbox.last_ack_at),
            "forwarded/messages": str(counters["forwarded"]),
            "forwarded/qos0": str(counters["forwarded_qos0"]),
            "publish/sent": str(counters["publish_sent"]),
            "received/messages": str(self.received),
            "connects": str(counters["connects"]),
            "ack_timeouts": str(counters["ack_timeouts"]),
            "retries": str(counters["retries"]),
            "dropped": str(sum(outbox.dropped.values())),
        }
        for reason, n in sorted(outbox.dropped.items()):
            values[f"dropped/{reason}"] = str(n)
        return values

    def publish_sys(self, now: float, only: tuple[str, ...] | None = None) -> None:
        """Publish the values that changed since the last time, retained, QoS 0."""
        sent = self._sys_sent
        for key, value in self.sys_values(now).items():
            if (only is not None and key not in only) or sent.get(key) == value:
                continue
            sent[key] = value
            self.perform(self.broker.publish_local(f"$SYS/broker/connection/{self.name}/{key}", value.encode(), 0,
                                                   True, {}, now))

    def _set_state(self, state: str, now: float) -> None:
        if state == self.state:
            return
        self.state = state
        if self._loop is not None:
            self.publish_sys(now, ("state",) if state != CONNECTED else None)
