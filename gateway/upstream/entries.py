"""What the upstream outbox holds and what crosses its edge (sans-I/O, like :mod:`gateway.upstream.outbox`).

- :class:`Entry`: one message on its way up, with its state and lane.
- :class:`OutboxStore`: the store port the outbox writes its rows through.
- Inputs and outputs of :class:`~gateway.upstream.outbox.Outbox`: :class:`PeerLimits` (what the cloud's CONNACK
  announced) in; :class:`Send` (one PUBLISH, built by :func:`publish_of` with its exact size) and
  :class:`TearDown` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.broker.store_port import OutboxRecord
from gateway.mqtt.packets import publish_size
from gateway.mqtt.properties import Properties, encode_properties
from gateway.mqtt.properties import PropertyId as P

if TYPE_CHECKING:
    from gateway.broker.message import Message

#: Entry states: waiting in a lane; handed out by next_send, not yet sent; awaiting PUBACK/PUBCOMP; gone.
QUEUED, SENDING, INFLIGHT, DONE = 0, 1, 2, 3
#: Which lane a queued entry is in (0: none, e.g. taken).
BACKLOG, LIVE = 1, 2

#: The publisher's MQTT 5 properties that travel up with the message (MQTT 5.0 §3.3.2.3); Message Expiry Interval
#: is sent as what remains of it, and the ``msg_id`` User Property is added (docs/message-format.md).
FORWARDED_PROPERTIES = (P.PAYLOAD_FORMAT_INDICATOR, P.CONTENT_TYPE, P.RESPONSE_TOPIC, P.CORRELATION_DATA)


class OutboxStore(Protocol):
    """The part of the broker's ``SessionStore`` (gateway/broker/store_port.py) the outbox uses. Every method records a
    change for the next commit; none waits for the disk."""

    def outbox_seq(self) -> int:
        """A new sequence number: increasing, never reused after a restart."""
        ...

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        """A row joined ``link``'s outbox."""
        ...

    def outbox_deleted(self, link: str, seq: int) -> None:
        """A row left ``link``'s outbox."""
        ...

    def outbox_loaded(self, link: str) -> list[OutboxRecord]:
        """The rows stored for ``link``, oldest first."""
        ...


@dataclass(slots=True, frozen=True)
class PeerLimits:
    """What the cloud broker's CONNACK announced (MQTT 5.0 §3.2.2.3; MQTT 3.1.1 announces none of them).

    Attributes:
        receive_maximum: QoS 1/2 PUBLISH packets it accepts unacknowledged [MQTT-3.3.4-7], or None (65535).
        maximum_qos: the highest QoS it accepts (a higher one is sent at this QoS).
        retain_available: False: the RETAIN flag is sent as 0.
        maximum_packet_size: bytes, 0 = no limit; a PUBLISH whose encoded size is over it is dropped as
            ``packet_too_large`` (the smaller of this and the link's ``max_packet_size`` applies).
    """

    receive_maximum: int | None = None
    maximum_qos: int = 2
    retain_available: bool = True
    maximum_packet_size: int = 0


class Entry:
    """One message on its way up: an outbox row, or a QoS 0 message kept in memory only."""

    __slots__ = (
        "durable",
        "key",
        "message",
        "paced",
        "packet_id",
        "qos",
        "retries",
        "sent_at",
        "seq",
        "size",
        "state",
        "topic",
        "where",
    )

    def __init__(self, key: int, seq: int, message: Message, qos: int, topic: str, durable: bool) -> None:
        self.key = key  # entries' dict key: the store sequence (durable) or a negative local counter
        self.seq = seq  # store sequence: the msg_id; 0 for QoS 0 not stored (no msg_id)
        self.message = message
        self.qos = qos  # the QoS it is forwarded at (min(published QoS, rule QoS))
        self.topic = topic  # remote topic
        self.durable = durable
        self.size = len(message.payload) + len(topic.encode("utf-8"))  # bytes counted against max_bytes
        self.state = QUEUED
        self.where = 0
        self.paced = False  # backlog entries that wait for drain tokens
        self.sent_at = 0.0  # elapsed seconds (the outbox's monotonic time) of the last send
        self.packet_id = 0
        self.retries = 0  # "retry later" refusals so far (verdicts.RETRY_LATER)


@dataclass(slots=True)
class Send:
    """Output: send one PUBLISH upstream, then report :meth:`Outbox.sent` (or :meth:`Outbox.send_failed`).

    Attributes:
        entry: the outbox entry (pass the Send back as is).
        topic: the remote topic.
        payload: bytes, as published locally.
        qos: the QoS to send at (min(entry QoS, the cloud's Maximum QoS)).
        retain: the RETAIN flag (False when the cloud has no Retain Available).
        msg_id: the ``msg_id`` User Property, ``<gateway_id>:<store sequence>`` (MQTT 5 links, stored entries),
            the same on every re-send; None otherwise (docs/message-format.md).
        expiry: the remaining Message Expiry Interval in seconds (at least 1), or None (MQTT 5.0 §3.3.2.3.3).
        properties: the PUBLISH properties to send (MQTT 5 links; empty for 3.1.1): the publisher's
            :data:`FORWARDED_PROPERTIES` and User Properties, ``msg_id`` last among them, and ``expiry``.
        size: bytes of the whole PUBLISH as sent (fixed header, topic, Packet Identifier, properties, payload; no
            Topic Alias), what the cloud compares with its Maximum Packet Size (MQTT 5.0 §3.2.2.3.6).
    """

    entry: Entry
    topic: str
    payload: bytes
    qos: int
    retain: bool
    msg_id: str | None
    expiry: int | None
    properties: Properties
    size: int


@dataclass(slots=True, frozen=True)
class TearDown:
    """Output of :meth:`Outbox.tick`: close the connection and reconnect.

    Attributes:
        reason: ``ack_timeout`` (connected, QoS 1/2 in flight, no acknowledgement for ``ack_timeout``).
        silent_for: seconds without an acknowledgement.
        inflight: messages in flight.
    """

    reason: str
    silent_for: float
    inflight: int


def publish_of(entry: Entry, now: float, v5: bool, gateway_id: str, max_qos: int, retain_available: bool) -> Send:
    """The PUBLISH for ``entry`` as the link will send it, with its exact size in bytes (:attr:`Send.size`).

    Args:
        entry: the outbox entry.
        now: wall-clock seconds (the remaining Message Expiry Interval is counted from it).
        v5: an MQTT 5 link (properties and the ``msg_id`` User Property; MQTT 3.1.1 carries neither).
        gateway_id: the ``msg_id`` prefix.
        max_qos: the cloud's Maximum QoS (the QoS sent is the lower of it and the entry's).
        retain_available: the cloud's Retain Available (False sends RETAIN as 0).
    """
    message = entry.message
    qos = min(entry.qos, max_qos)
    expires_at = message.expires_at
    expiry = None if expires_at is None else max(1, math.ceil(expires_at - now))
    msg_id = f"{gateway_id}:{entry.seq}" if v5 and entry.seq else None
    props: Properties = {}
    if v5:
        src = message.properties
        if src:
            for pid in FORWARDED_PROPERTIES:
                if pid in src:
                    props[pid] = src[pid]
        if expiry is not None:
            props[P.MESSAGE_EXPIRY_INTERVAL] = expiry
        users = src.get(P.USER_PROPERTY) if src else None
        if msg_id is not None:
            users = [*users, ("msg_id", msg_id)] if users else [("msg_id", msg_id)]
        if users:
            props[P.USER_PROPERTY] = users
    topic = entry.topic
    size = publish_size(len(topic.encode("utf-8")), len(message.payload), qos,
                        len(encode_properties(props)) if v5 else 0)
    return Send(entry, topic, message.payload, qos, message.retain and retain_available, msg_id, expiry, props, size)
