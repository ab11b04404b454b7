"""Per-listener (zone) limits and broker-wide settings, with EMQX's names and defaults.

Durations are seconds (``float``/``int``); sizes are bytes; lengths are messages. The defaults per zone
are docs/architecture.md's "Session semantics" (``max_inflight`` 32 external / 128 internal, ``max_mqueue_len``
1000 / 10000, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(slots=True)
class ZoneLimits:
    """Limits one listener (zone) applies to each of its client connections.

    Attributes:
        max_inflight: Inflight Window length, messages; 0 = no limit (then 65535, the MQTT maximum);
            an MQTT 5 client's Receive Maximum caps it.
        max_mqueue_len: Message Queue length, messages; 0 = no limit. When full the oldest message is
            dropped, a QoS 0 one first (the new one is still queued).
        max_mqueue_bytes: per-client quota on the payload bytes its Message Queue holds; 0 = no limit. Over it
            the oldest message is dropped by the same policy, so one slow client cannot fill the store.
        mqueue_store_qos0: queue QoS 0 messages for an offline persistent session (default true).
        retry_interval: seconds after which an unacknowledged PUBLISH is re-sent with DUP=1 to a 3.1.1
            client in the same connection; 0 = only on reconnect. Never used for 5.0 [MQTT-4.4.0-1].
        max_awaiting_rel: inbound QoS 2 messages awaiting PUBREL per client; also the Receive Maximum the
            broker announces to 5.0 clients (MQTT 5.0 §3.2.2.3.3); excess -> DISCONNECT 0x93.
        await_rel_timeout: seconds an inbound QoS 2 message may wait for its PUBREL before it is dropped.
        max_keepalive: largest Keep Alive, seconds, honoured for 5.0 clients (Server Keep Alive); 0 = any.
        session_expiry_interval: longest Session Expiry Interval, seconds, granted to a 5.0 client, and the
            expiry of a 3.1.1 Clean Session = 0 session; 0 = sessions end on disconnect.
        message_expiry_interval: seconds a queued message waits for an offline client when the publisher gave
            no Message Expiry Interval; 0 = never expires (an MQTT 5 Message Expiry Interval wins).
        max_packet_size: largest packet accepted from a client, bytes (MQTT 5.0 Maximum Packet Size).
        topic_alias_maximum: Topic Alias Maximum announced to 5.0 clients (inbound aliases); 0 = none.
        connect_timeout: seconds a new connection may take to send its CONNECT.
        max_clientid_len: longest Client Identifier accepted, in UTF-8 bytes; longer ones get CONNACK 0x85
            (3.1.1: return code 0x02) [MQTT-3.1.3-8]. 256 by default: MQTT only requires 23 [MQTT-3.1.3-5],
            cloud IoT services stop at 128 (AWS IoT Core, Azure IoT Hub), and every byte of it is kept per
            session, in memory and in the store's keys.
        max_subscriptions: Topic Filters one client may hold at once; more get SUBACK 0x97 Quota exceeded
            (3.1.1: 0x80); 0 = no limit (EMQX's ``max_subscriptions``).
        max_topic_levels: most levels in a Topic Name or Topic Filter (EMQX's ``max_topic_levels``, default 128);
            a deeper SUBSCRIBE gets 0x8F Topic Filter invalid (3.1.1: 0x80), a deeper PUBLISH 0x90 Topic Name
            invalid (QoS 0 and 3.1.1: dropped, counted), a deeper Will Topic CONNACK 0x90; 0 = no limit.
        high_watermark: bytes a connection's socket write buffer may hold before the connection counts as
            busy (EMQX's ``high_watermark``): QoS 0 messages to it are then dropped and counted
            (``dropped/high_watermark_qos0``), QoS 1/2 wait in its Message Queue under ``max_mqueue_len`` and
            ``max_mqueue_bytes``. Memory for one connected client is thus bounded by this plus one loop turn's
            output plus ``max_mqueue_bytes``.
        send_timeout: seconds a busy connection may go without its socket draining below the low-water mark
            (a quarter of ``high_watermark``) before it is closed (EMQX's ``send_timeout``); 0 = never.
        max_connections: connected clients on this listener at once (Mosquitto's and EMQX's
            ``max_connections``); one more CONNECT gets CONNACK 0x97 Quota exceeded (3.1.1: 0x03 Server
            unavailable) and is closed; a take-over on the same listener is always allowed; 0 = no limit.
            Connections still awaiting CONNECT are bounded by ``connect_timeout`` instead.
        max_topic_length: longest Topic Name or Topic Filter, UTF-8 bytes (the protocol allows 65535); refused
            as ``max_topic_levels`` is; 0 = no limit. Every queued message holds its topic, so this bounds a
            Message Queue's topic bytes too.
        max_publish_rate: PUBLISH packets a second one connection may send, a token bucket holding one second's
            worth (burst); past it the broker stops reading from that connection for as long as the debt takes
            to pay back (Mosquitto's and EMQX's way: throttle, never disconnect); 0 = no limit.
    """

    max_inflight: int = 32
    max_mqueue_len: int = 1000
    max_mqueue_bytes: int = 64 * 1024 * 1024
    mqueue_store_qos0: bool = True
    retry_interval: float = 0.0
    max_awaiting_rel: int = 100
    await_rel_timeout: float = 300.0
    max_keepalive: int = 0
    session_expiry_interval: float = 7200.0
    message_expiry_interval: float = 300.0
    max_packet_size: int = 1024 * 1024
    topic_alias_maximum: int = 10
    connect_timeout: float = 10.0
    max_clientid_len: int = 256
    max_subscriptions: int = 1000
    max_topic_levels: int = 128
    high_watermark: int = 1024 * 1024
    send_timeout: float = 15.0
    max_connections: int = 10_000
    max_topic_length: int = 1024
    max_publish_rate: float = 0.0

    def window(self, receive_maximum: int | None) -> int:
        """The Inflight Window length for a client: ``max_inflight`` capped by its Receive Maximum (MQTT 5.0
        §3.1.2.11.3)."""
        limit = self.max_inflight or 65535
        if receive_maximum is not None and receive_maximum < limit:
            return receive_maximum
        return limit


def topic_limit_error(topic: str, limits: ZoneLimits) -> tuple[str, str] | None:
    """Which limit ``topic`` (a Topic Name or Filter) is past, ``max_topic_levels`` or ``max_topic_length``,
    and why: ``(limit name, text)``, or ``None``. The one check for PUBLISH, SUBSCRIBE and the Will Topic."""
    max_levels = limits.max_topic_levels
    if max_levels and topic.count("/") >= max_levels:
        return "max_topic_levels", f"more than max_topic_levels = {max_levels} topic levels"
    max_len = limits.max_topic_length
    # Characters first: a str of n characters is n to 4n UTF-8 bytes, so most topics need no encoding.
    if max_len and (len(topic) > max_len or (4 * len(topic) > max_len and len(topic.encode()) > max_len)):
        return "max_topic_length", f"longer than max_topic_length = {max_len} bytes"
    return None


#: EMQX's defaults for the two zones: the external listener faces untrusted apps, the internal
#: one (loopback, firmware-bridge) carries the gateway's own bulk traffic.
EXTERNAL = ZoneLimits()
INTERNAL = replace(EXTERNAL, max_inflight=128, max_mqueue_len=10000)

ZONE_DEFAULTS: dict[str, ZoneLimits] = {"external": EXTERNAL, "internal": INTERNAL}


@dataclass(slots=True)
class BrokerSettings:
    """Broker-wide settings.

    Attributes:
        sys_interval: seconds between ``$SYS/broker/...`` updates; 0 = never.
        retain_available: whether retained messages are supported (MQTT 5.0 §3.2.2.3.5).
        max_sessions: sessions with a Session Expiry Interval > 0 (3.1.1: Clean Session 0) the broker holds at
            once, online and offline; a CONNECT that would create one more gets CONNACK 0x97 Quota exceeded
            (3.1.1: 0x03 Server unavailable); resuming an existing session is always allowed; 0 = no limit.
        max_retained_messages: retained messages held (``$SYS`` not counted); a new retained topic past it is
            refused: MQTT 5 QoS 1/2 PUBACK/PUBREC 0x97, QoS 0 and 3.1.1 delivered but not retained. Replacing or
            clearing a retained message always works when it does not grow past a limit; 0 = no limit.
        max_retained_bytes: payload plus UTF-8 topic bytes of all retained messages (held in memory and in the
            store), same refusal; 0 = no limit.
    """

    sys_interval: float = 10.0
    retain_available: bool = True
    max_sessions: int = 10_000
    max_retained_messages: int = 10_000
    max_retained_bytes: int = 64 * 1024 * 1024
    zones: dict[str, ZoneLimits] = field(default_factory=lambda: dict(ZONE_DEFAULTS))
    #: per listener name: who may connect and what they may do (``gateway.broker.access_decisions.ListenerAccess``,
    #: built by the server layer from ``allow_anonymous``, ``password_file``, ``acl_file``; none: anyone, anything)
    access: dict[str, Any] = field(default_factory=dict)
    #: back-off after failed CONNECTs per address (``gateway.broker.access_decisions.Throttle``), or ``None``
    throttle: Any = None
