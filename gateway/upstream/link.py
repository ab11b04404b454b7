"""One upstream link: a durable outbox, an aiomqtt connection to the cloud broker, the downlink.

Life of a forwarded message (DESIGN.md §5, docs/upstream.md):

1. :meth:`UpstreamLink.forward` runs inside :meth:`Broker._publish` (``Broker.forwarders``), before the local
   publisher's PUBACK/PUBCOMP is registered: a QoS 1/2 message (or QoS 0 with ``store_qos0``) is recorded in the
   store's outbox then, so the outbox row is committed with the acknowledgement.
2. The pump sends it when the link is up, within the inflight window (``max_inflight``, lowered to the cloud
   broker's Receive Maximum); the backlog that built up while the link was down is paced (``drain_rate``).
3. The row leaves the outbox only when the cloud acknowledges (PUBACK for QoS 1, PUBCOMP for QoS 2). A lost link
   puts everything unacknowledged back in the backlog, in order, sent again after the reconnect with the same
   ``msg_id`` User Property (MQTT 5) so consumers can drop the duplicates.

Order per remote topic: entries are kept in arrival order (store sequence). ``backlog_first`` sends a topic's
new messages only after that topic's backlog (other topics are not held up); ``live_first`` sends new messages
at once and drains the backlog behind them (per-topic order then holds within each of the two streams only).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.broker.store import OutboxRecord
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.topics import topic_matches
from gateway.upstream.config import UpstreamConfig, fill

if TYPE_CHECKING:
    from gateway.broker.broker import Broker
    from gateway.broker.message import Message

log = logging.getLogger("gateway.upstream")

#: Message.sender of everything the downlink publishes locally: never forwarded back up (loops).
SENDER_PREFIX = "$upstream/"

CONNECTING, CONNECTED, BACKING_OFF, STOPPED = "connecting", "connected", "backing-off", "stopped"
_QUEUED, _INFLIGHT, _DONE = 0, 1, 2
_BACKLOG, _LIVE = 1, 2


class Entry:
    """One message on its way up (an outbox row, or a QoS 0 message kept in memory only)."""

    __slots__ = ("durable", "key", "message", "paced", "qos", "sent_at", "seq", "size", "state", "topic", "where")

    def __init__(self, key: int, seq: int, message: Message, qos: int, topic: str, durable: bool) -> None:
        self.key = key  # dict key: the store sequence (durable) or a negative local counter
        self.seq = seq  # store sequence: the msg_id; 0 for QoS 0 not stored (no msg_id)
        self.message = message
        self.qos = qos
        self.topic = topic
        self.durable = durable
        self.size = len(message.payload) + len(topic.encode("utf-8"))
        self.state = _QUEUED
        self.where = 0
        self.paced = False
        self.sent_at = 0.0


class _Client(aiomqtt.Client):
    """aiomqtt's client plus what the bridge needs and aiomqtt does not expose: the CONNACK properties (Receive
    Maximum, Maximum QoS, ...) and a non-blocking publish that returns a future resolved with the reason code of
    the PUBACK/PUBCOMP (aiomqtt's ``publish`` waits, and discards the reason code)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connack_properties: Any = None
        self.acks: dict[int, asyncio.Future[int]] = {}

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
        self.connack_properties = properties
        super()._on_connect(client, userdata, flags, reason_code, properties)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
        if not self._connected.done():  # closed before CONNACK: fail now, not after the connect timeout
            self._connected.set_exception(aiomqtt.MqttError(f"connection closed before CONNACK ({reason_code})"))
        super()._on_disconnect(client, userdata, flags, reason_code, properties)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        fut = self.acks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(int(getattr(reason_code, "value", 0) or 0))
        super()._on_publish(client, userdata, mid, reason_code, properties)

    def send(self, topic: str, payload: bytes, qos: int, retain: bool, properties: Any) -> asyncio.Future[int] | None:
        """Hand one PUBLISH to paho; for QoS 1/2 return the future of its acknowledgement."""
        info = self._client.publish(topic, payload, qos, retain, properties)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        if qos == 0:
            return None
        fut: asyncio.Future[int] = self._loop.create_future()
        self.acks[info.mid] = fut
        return fut

    def abandon(self) -> None:
        """Cancel the futures of acknowledgements that will never come (the connection is gone)."""
        for fut in self.acks.values():
            fut.cancel()
        self.acks.clear()


class _TearDown(Exception):
    """The link is torn down on purpose (half-open, or stopping)."""


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class UpstreamLink:
    """One ``[[upstream]]``: outbox, connection, pump, downlink, ``$SYS`` values.

    Args:
        cfg: the link's configuration.
        broker: the local broker (its store holds the outbox; the downlink publishes into it).
        flush: asks the I/O layer to write what the broker queued (after a downlink or ``$SYS`` publish).
    """

    def __init__(self, cfg: UpstreamConfig, broker: Broker, flush: Callable[[], None]) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.broker = broker
        self.store = broker.store
        self.flush = flush
        self.sender_id = SENDER_PREFIX + cfg.name
        self.entries: dict[int, Entry] = {}
        self.backlog: deque[Entry] = deque()
        self.live: deque[Entry] = deque()
        self.qos0: deque[Entry] = deque()
        self.backlog_topics: Counter[str] = Counter()
        self.inflight: dict[int, Entry] = {}
        self.bytes = 0
        self.state = STOPPED
        self.window = cfg.max_inflight
        self.max_qos = 2
        self.retain_available = True
        self.max_packet = 0
        self.client: _Client | None = None
        self.gen = 0
        self.counters: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.last_ack_at: float | None = None
        self._last_ack_mono = time.monotonic()
        self._connected_mono = 0.0
        self._local_key = 0
        self._tokens = (0.0, 0.0)
        self._tokens_at = time.monotonic()
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
        self._warn_pending: Counter[str] = Counter()
        self._warn_next = 0.0
        self._attempt = 0

    # ------------------------------------------------------------------------------------------ lifecycle

    def load(self, now: float) -> None:
        """Take the outbox rows stored for this link (before any client can publish), apply TTL and bounds."""
        for record in self.store.outbox_loaded(self.name):
            entry = Entry(record.seq, record.seq, record.message, record.qos, record.topic, True)
            self.entries[entry.key] = entry
            self.bytes += entry.size
            if entry.qos == 0:
                self.qos0.append(entry)
            self._to_backlog(entry)
        if self.entries:
            log.info(
                "upstream %s: %d messages (%d bytes) in the outbox from before the restart",
                self.name,
                len(self.entries),
                self.bytes,
            )
        self._expire(now)
        self._enforce_bounds()

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
        self._set_state(STOPPED, time.time())

    # ------------------------------------------------------------------------------------------ outbox

    def forward(self, message: Message, now: float) -> bool:
        """``Broker.forwarders`` hook: record ``message`` for the cloud if a forward rule matches; True when it was
        taken (so an MQTT 5 publisher is not told "no matching subscribers")."""
        sender = message.sender
        if sender is not None and sender.startswith(SENDER_PREFIX):
            return False  # came down from a cloud: never back up
        topic = message.topic
        for rule in self.cfg.forward:
            if topic_matches(rule.local, topic):
                break
        else:
            return False
        qos = min(message.qos, rule.qos)
        if message.expired(now):
            return False
        remote = rule.remote_topic(topic, self.cfg.gateway_id)
        durable = qos > 0 or self.cfg.store_qos0
        if not durable and self.state != CONNECTED:
            self._count_drop("qos0_link_down", 1)
            return False
        size = len(message.payload) + len(remote.encode("utf-8"))
        if not self._make_room(size, qos):
            return False
        if durable:
            seq = self.store.outbox_seq()
            self.store.outbox_saved(self.name, OutboxRecord(seq, message, qos, remote))
            entry = Entry(seq, seq, message, qos, remote, True)
        else:
            self._local_key -= 1
            entry = Entry(self._local_key, 0, message, qos, remote, False)
        self.entries[entry.key] = entry
        self.bytes += entry.size
        if qos == 0:
            self.qos0.append(entry)
        if self.state == CONNECTED and (self.cfg.order == "live_first" or not self.backlog_topics[remote]):
            entry.where = _LIVE
            self.live.append(entry)
        else:
            self._to_backlog(entry, paced=self.state != CONNECTED)
        self._schedule_pump()
        return True

    def _to_backlog(self, entry: Entry, paced: bool = True) -> None:
        entry.where = _BACKLOG
        entry.paced = paced
        self.backlog.append(entry)
        self.backlog_topics[entry.topic] += 1

    def _remove(self, entry: Entry) -> None:
        """``entry`` leaves the outbox (acknowledged, sent at QoS 0, or dropped)."""
        if entry.state == _QUEUED and entry.where == _BACKLOG:
            self._backlog_left(entry)
        entry.state = _DONE
        if self.entries.pop(entry.key, None) is not None:
            self.bytes -= entry.size
            if entry.durable:
                self.store.outbox_deleted(self.name, entry.seq)

    def _backlog_left(self, entry: Entry) -> None:
        n = self.backlog_topics[entry.topic] - 1
        if n > 0:
            self.backlog_topics[entry.topic] = n
        else:
            del self.backlog_topics[entry.topic]

    def _drop(self, entry: Entry, reason: str) -> None:
        self._remove(entry)
        self._count_drop(reason, 1)

    def _count_drop(self, reason: str, n: int) -> None:
        self.dropped[reason] += n
        if reason != "qos0_link_down":  # QoS 0 while down is the configured behaviour, not a bound
            self._warn_pending[reason] += n
            self._warn(time.time())

    def _make_room(self, size: int, qos: int) -> bool:
        """Apply ``max_messages``/``max_bytes`` before a new entry of ``size`` bytes joins: drop QoS 0 first, then
        the oldest (never one in flight). False when the new entry itself is the one to drop."""
        cfg = self.cfg
        if cfg.max_bytes and size > cfg.max_bytes:
            self._count_drop("max_bytes", 1)
            return False
        while True:
            if cfg.max_messages and len(self.entries) + 1 > cfg.max_messages:
                reason = "max_messages"
            elif cfg.max_bytes and self.bytes + size > cfg.max_bytes:
                reason = "max_bytes"
            else:
                return True
            victim = self._oldest_qos0()
            if victim is None and qos == 0:
                self._count_drop(reason, 1)  # the new QoS 0 message goes first
                return False
            if victim is None:
                victim = self._oldest_queued()
            if victim is None:
                self._count_drop(reason, 1)
                return False
            self._drop(victim, reason)

    def _enforce_bounds(self) -> None:
        cfg = self.cfg
        while (cfg.max_messages and len(self.entries) > cfg.max_messages) or (
            cfg.max_bytes and self.bytes > cfg.max_bytes
        ):
            reason = "max_messages" if cfg.max_messages and len(self.entries) > cfg.max_messages else "max_bytes"
            victim = self._oldest_qos0() or self._oldest_queued()
            if victim is None:
                return
            self._drop(victim, reason)

    def _oldest_qos0(self) -> Entry | None:
        q = self.qos0  # every QoS 0 entry, oldest first (lazily cleaned)
        while q:
            if q[0].state == _QUEUED:
                return q[0]
            q.popleft()
        return None

    def _oldest_queued(self) -> Entry | None:
        for entry in self.entries.values():
            if entry.state == _QUEUED:
                return entry
        return None

    def _ttl_expired(self, entry: Entry, now: float) -> str | None:
        ttl = self.cfg.message_ttl
        if ttl and now - entry.message.received_at >= ttl:
            return "message_ttl"
        if entry.message.expired(now):
            return "expired"
        return None

    def _expire(self, now: float) -> None:
        """Drop what waited longer than ``message_ttl`` (or past its own Message Expiry), oldest first."""
        victims = []
        for entry in self.entries.values():
            if entry.state != _QUEUED:
                continue
            reason = self._ttl_expired(entry, now)
            if reason is not None:
                victims.append((entry, reason))
            elif (
                self.cfg.message_ttl
                and now - entry.message.received_at < self.cfg.message_ttl
                and entry.message.expires_at is None
            ):
                break  # arrival order: the rest is younger
        for entry, reason in victims:
            self._drop(entry, reason)

    # ------------------------------------------------------------------------------------------ pump

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self.state == CONNECTED and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Send what may go now: within the inflight window, backlog paced, in the configured order."""
        self._pump_scheduled = False
        if self.state != CONNECTED or self.client is None:
            return
        now = time.time()
        first, second = (self.live, self.backlog) if self.cfg.order == "live_first" else (self.backlog, self.live)
        try:
            while True:
                entry = self._take(first, now) or self._take(second, now)
                if entry is None:
                    return
                self._send(entry, now)
        except Exception as exc:  # paho refused (the socket is gone): the connection task notices and rebuilds
            log.warning("upstream %s: send failed (%s); reconnecting", self.name, exc)
            self._tear_down(f"send failed: {exc}")

    def _take(self, queue: deque[Entry], now: float) -> Entry | None:
        while queue:
            entry = queue[0]
            if entry.state != _QUEUED:
                queue.popleft()
                continue
            reason = self._ttl_expired(entry, now)
            if reason is not None:
                queue.popleft()
                self._drop(entry, reason)
                continue
            if entry.qos and len(self.inflight) >= self.window:
                return None
            if entry.paced and not self._take_tokens(entry.size):
                return None
            queue.popleft()
            if entry.where == _BACKLOG:
                self._backlog_left(entry)
            entry.where = 0
            return entry
        return None

    def _take_tokens(self, size: int) -> bool:
        rate, brate = self.cfg.drain_rate, self.cfg.drain_bytes
        if not rate and not brate:
            return True
        mono = time.monotonic()
        elapsed = mono - self._tokens_at
        self._tokens_at = mono
        msgs, nbytes = self._tokens
        cap_b = max(brate, size)
        msgs = min(max(rate, 1.0), msgs + elapsed * rate) if rate else 1.0
        nbytes = min(cap_b, nbytes + elapsed * brate) if brate else float(size)
        if msgs >= 1.0 and nbytes >= size:
            self._tokens = (msgs - 1.0 if rate else 0.0, nbytes - size if brate else 0.0)
            return True
        self._tokens = (msgs, nbytes)
        wait = max((1.0 - msgs) / rate if rate else 0.0, (size - nbytes) / brate if brate else 0.0)
        if self._loop is not None and self._wake is None:
            self._wake = self._loop.call_later(max(wait, 0.001), self._woken)
        return False

    def _woken(self) -> None:
        self._wake = None
        self._schedule_pump()

    def _properties(self, entry: Entry, now: float) -> Any:
        """The MQTT 5 PUBLISH properties sent upstream: the publisher's (Payload Format Indicator, Content Type,
        Response Topic, Correlation Data, User Properties, remaining Message Expiry) plus ``msg_id``."""
        props = PahoProperties(PacketTypes.PUBLISH)
        src = entry.message.properties
        users = list(src.get(P.USER_PROPERTY, ())) if src else []
        if entry.seq:
            users.append(("msg_id", f"{self.cfg.gateway_id}:{entry.seq}"))
        if users:
            props.UserProperty = users
        if src:
            if P.PAYLOAD_FORMAT_INDICATOR in src:
                props.PayloadFormatIndicator = src[P.PAYLOAD_FORMAT_INDICATOR]
            if P.CONTENT_TYPE in src:
                props.ContentType = src[P.CONTENT_TYPE]
            if P.RESPONSE_TOPIC in src:
                props.ResponseTopic = src[P.RESPONSE_TOPIC]
            if P.CORRELATION_DATA in src:
                props.CorrelationData = src[P.CORRELATION_DATA]
        if entry.message.expires_at is not None:
            props.MessageExpiryInterval = max(1, math.ceil(entry.message.expires_at - now))
        return props

    def _send(self, entry: Entry, now: float) -> None:
        client = self.client
        assert client is not None
        qos = min(entry.qos, self.max_qos)
        props = self._properties(entry, now) if self.cfg.protocol == 5 else None
        if self.max_packet and entry.size + 64 > self.max_packet:
            self._drop(entry, "packet_too_large")
            return
        retain = entry.message.retain and self.retain_available
        entry.state = _INFLIGHT if qos else _QUEUED
        try:
            fut = client.send(entry.topic, entry.message.payload, qos, retain, props)
        except Exception:
            entry.state = _QUEUED
            raise
        self.counters["publish_sent"] += 1
        if fut is None:
            self.counters["forwarded_qos0" if entry.qos == 0 else "forwarded"] += 1
            self._remove(entry)
            return
        entry.sent_at = time.monotonic()
        self.inflight[entry.key] = entry
        gen = self.gen
        fut.add_done_callback(lambda f, e=entry, g=gen: self._acked(e, g, f))

    def _acked(self, entry: Entry, gen: int, fut: asyncio.Future[int]) -> None:
        if fut.cancelled() or gen != self.gen:
            return
        self.inflight.pop(entry.key, None)
        if entry.state != _INFLIGHT:
            return
        now = time.time()
        self.last_ack_at = now
        self._last_ack_mono = time.monotonic()
        self._attempt = 0  # the link works: the next reconnect starts from backoff_initial
        code = fut.result()
        if code >= 0x80:
            log.warning(
                "upstream %s: %s refused by the cloud broker (reason 0x%02X); dropped", self.name, entry.topic, code
            )
            self._drop(entry, "rejected")
        else:
            self.counters["forwarded"] += 1
            self._remove(entry)
        self._schedule_pump()

    # ------------------------------------------------------------------------------------------ connection

    def _make_client(self) -> _Client:
        cfg = self.cfg
        tls = None
        if cfg.tls:
            tls = aiomqtt.TLSParameters(ca_certs=cfg.ca_file, certfile=cfg.cert_file, keyfile=cfg.key_file)
        return _Client(
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
        assert self._stop_event is not None
        while not self._stopping:
            self._set_state(CONNECTING, time.time())
            client = self._make_client()
            up_since = 0.0
            try:
                async with client:
                    up_since = time.monotonic()
                    await self._serve(client)
            except asyncio.CancelledError:
                self._disconnected(client)
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
                self._disconnected(client)
            if self._stopping:
                return
            if up_since and time.monotonic() - up_since >= 30.0:
                self._attempt = 0
            delay = min(self.cfg.backoff_max, self.cfg.backoff_initial * 2 ** min(self._attempt, 30))
            delay *= random.uniform(0.5, 1.0)  # jitter: gateways that lost the same cloud do not come back at once
            self._attempt += 1
            self._set_state(BACKING_OFF, time.time())
            log.info("upstream %s: reconnecting in %.2f s (attempt %d)", self.name, delay, self._attempt)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), delay)

    async def _serve(self, client: _Client) -> None:
        props = client.connack_properties
        self.window = self.cfg.max_inflight
        self.max_qos, self.retain_available, self.max_packet = 2, True, 0
        if props is not None and self.cfg.protocol == 5:
            receive_max = getattr(props, "ReceiveMaximum", None)
            if receive_max:
                self.window = min(self.window, int(receive_max))
            max_qos = getattr(props, "MaximumQoS", None)
            if max_qos is not None:
                self.max_qos = int(max_qos)
            retain = getattr(props, "RetainAvailable", None)
            if retain is not None:
                self.retain_available = bool(retain)
            self.max_packet = int(getattr(props, "MaximumPacketSize", 0) or 0)
        self.gen += 1
        self.client = client
        self._kill = asyncio.Event()
        self._kill_reason = ""
        if self._stopping:
            raise _TearDown("stopping")
        self._connected_mono = self._last_ack_mono = time.monotonic()
        self._tokens = (max(self.cfg.drain_rate, 1.0), float(self.cfg.drain_bytes))
        self._tokens_at = time.monotonic()
        self.counters["connects"] += 1
        self._set_state(CONNECTED, time.time())
        log.info(
            "upstream %s: connected to %s:%d as %r (MQTT %s, inflight window %d, backlog %d)",
            self.name,
            self.cfg.host,
            self.cfg.port,
            self.cfg.client_id,
            "5" if self.cfg.protocol == 5 else "3.1.1",
            self.window,
            len(self.entries),
        )
        self._schedule_pump()
        downlink = asyncio.ensure_future(self._downlink(client))
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

    async def _downlink(self, client: _Client) -> None:
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
        now = time.time()
        local = rule.local_topic(topic, self.cfg.gateway_id)
        props: dict[int, Any] = {}
        expires_at = None
        src = msg.properties
        if src is not None:
            for attr, pid in (
                ("PayloadFormatIndicator", P.PAYLOAD_FORMAT_INDICATOR),
                ("ContentType", P.CONTENT_TYPE),
                ("ResponseTopic", P.RESPONSE_TOPIC),
                ("CorrelationData", P.CORRELATION_DATA),
            ):
                value = getattr(src, attr, None)
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
        self.counters["received"] += 1
        self.broker.publish_local(
            local,
            bytes(payload),
            min(msg.qos, rule.qos),
            bool(msg.retain),
            props,
            now,
            sender=self.sender_id,
            expires_at=expires_at,
        )
        self.flush()

    def _tear_down(self, reason: str) -> None:
        """Close the current connection (if any); the connection task then backs off and reconnects."""
        if self._kill is not None and not self._kill.is_set():
            self._kill_reason = reason
            self._kill.set()

    def _disconnected(self, client: _Client) -> None:
        """The connection is gone: everything unacknowledged goes back to the backlog, in order."""
        if self.client is not client:
            return
        self.client = None
        self.gen += 1
        client.abandon()
        self.inflight.clear()
        self.backlog.clear()
        self.live.clear()
        self.backlog_topics.clear()
        lost_qos0 = 0
        for entry in list(self.entries.values()):
            entry.state = _QUEUED
            entry.where = 0
            if entry.durable:
                self._to_backlog(entry)
            else:
                self._remove(entry)
                lost_qos0 += 1
        self.qos0 = deque(e for e in self.entries.values() if e.qos == 0)
        if lost_qos0:
            self._count_drop("qos0_link_down", lost_qos0)

    # ------------------------------------------------------------------------------------------ timers, $SYS

    async def _tick_forever(self) -> None:
        interval = min(1.0, self.cfg.ack_timeout / 4)
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                self.tick(time.time())
            except Exception:
                log.exception("upstream %s: tick failed", self.name)

    def tick(self, now: float) -> None:
        """Drop expired entries, detect a half-open link, publish warnings and ``$SYS`` values."""
        self._expire(now)
        if self.state == CONNECTED and self.inflight:
            mono = time.monotonic()
            oldest = min(e.sent_at for e in self.inflight.values())
            since = max(oldest, self._last_ack_mono)
            if mono - since >= self.cfg.ack_timeout:
                self.counters["ack_timeouts"] += 1
                log.warning(
                    "upstream %s: connected but no acknowledgement for %.1f s with %d in flight; tearing "
                    "the link down (half-open?)",
                    self.name,
                    mono - since,
                    len(self.inflight),
                )
                self._tear_down("ack_timeout")
        self._warn(now)
        interval = self.broker.settings.sys_interval
        if interval and now >= self._next_sys:
            self._next_sys = now + interval
            self.publish_sys(now)
        self._schedule_pump()

    def _warn(self, now: float) -> None:
        """Publish what the bounds dropped on ``$SYS/broker/connection/<name>/warning`` (at most once a second)."""
        if not self._warn_pending or now < self._warn_next or self._loop is None:
            return
        self._warn_next = now + 1.0
        text = ", ".join(f"{n} {reason}" for reason, n in sorted(self._warn_pending.items()))
        self._warn_pending.clear()
        log.warning(
            "upstream %s: outbox dropped %s (backlog %d messages, %d bytes)",
            self.name,
            text,
            len(self.entries),
            self.bytes,
        )
        self.broker.publish_local(
            f"$SYS/broker/connection/{self.name}/warning", f"dropped {text}".encode(), 0, False, {}, now
        )
        self.flush()

    def sys_values(self, now: float) -> dict[str, str]:
        """The link's ``$SYS/broker/connection/<name>/...`` values."""
        head = next(iter(self.entries.values()), None)  # FIFO: the head is the oldest
        oldest = None if head is None else head.message.received_at
        values = {
            "state": self.state,
            "backlog/messages": str(len(self.entries)),
            "backlog/bytes": str(self.bytes),
            "backlog/oldest_age": "none" if oldest is None else f"{max(0.0, now - oldest):.1f}",
            "inflight": str(len(self.inflight)),
            "last_ack": "never" if self.last_ack_at is None else _iso(self.last_ack_at),
            "forwarded/messages": str(self.counters["forwarded"]),
            "forwarded/qos0": str(self.counters["forwarded_qos0"]),
            "publish/sent": str(self.counters["publish_sent"]),
            "received/messages": str(self.counters["received"]),
            "connects": str(self.counters["connects"]),
            "ack_timeouts": str(self.counters["ack_timeouts"]),
            "dropped": str(sum(self.dropped.values())),
        }
        for reason, n in sorted(self.dropped.items()):
            values[f"dropped/{reason}"] = str(n)
        return values

    def publish_sys(self, now: float, only: tuple[str, ...] | None = None) -> None:
        """Publish the values that changed since the last time, retained, QoS 0."""
        sent = self._sys_sent
        changed = False
        for key, value in self.sys_values(now).items():
            if (only is not None and key not in only) or sent.get(key) == value:
                continue
            sent[key] = value
            self.broker.publish_local(f"$SYS/broker/connection/{self.name}/{key}", value.encode(), 0, True, {}, now)
            changed = True
        if changed:
            self.flush()

    def _set_state(self, state: str, now: float) -> None:
        if state == self.state:
            return
        self.state = state
        if self._loop is not None:
            self.publish_sys(now, ("state",) if state != CONNECTED else None)
