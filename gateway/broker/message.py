"""Application Messages and their per-subscriber deliveries.

A :class:`Message` is stored once; every :class:`Delivery` (queue entry or Inflight Window slot) references it
(payloads are stored once and referenced, in memory as in the store).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.mqtt.packets import Publish
from gateway.mqtt.properties import Properties

#: "No Subscription Identifiers": one shared list, never mutated.
NO_IDS: Final[list[int]] = []

#: A Delivery waits for PUBACK (QoS 1) or PUBREC (QoS 2).
AWAIT_ACK: Final = 0
#: A QoS 2 Delivery whose PUBREC arrived: PUBREL sent, PUBCOMP awaited (MQTT 5.0 §4.3.3).
AWAIT_COMP: Final = 1


# Message and Delivery have their __init__ written out: compiled by mypyc, a dataclass keeps its generated __init__
# interpreted, and one of each is made per message (a Delivery took twice as long to make compiled as interpreted).
# Message stays a dataclass otherwise (dataclasses.replace copies one with changes); Delivery is a plain class with
# the repr a dataclass would give it.


@dataclass(init=False, slots=True, eq=False)
class Message:
    """One Application Message as the broker received it.

    Attributes:
        mid: broker-unique id, increasing in arrival order (store key).
        topic, payload (bytes), qos (0-2), retain: as published.
        properties: the PUBLISH properties to pass through (Topic Alias and Subscription Identifier removed;
            Message Expiry Interval recomputed when sent, MQTT 5.0 §3.3.2.3.3).
        expires_at: wall-clock seconds after which the message is not delivered, or ``None`` (publisher's
            Message Expiry Interval).
        received_at: wall-clock seconds of arrival.
        sender: the publishing Client Identifier (for No Local), or ``None`` for the broker itself.
    """

    mid: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties
    received_at: float
    expires_at: float | None
    sender: str | None

    def __init__(
        self,
        mid: int,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        properties: Properties,
        received_at: float,
        expires_at: float | None = None,
        sender: str | None = None,
    ) -> None:
        self.mid = mid
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = properties
        self.received_at = received_at
        self.expires_at = expires_at
        self.sender = sender

    def expired(self, now: float) -> bool:
        """True once ``now`` (wall-clock seconds) is past the message's expiry."""
        return self.expires_at is not None and now >= self.expires_at


class Delivery:
    """One message on its way to one session: a Message Queue entry, then an Inflight Window slot.

    Attributes:
        qos: delivered QoS = min(publish QoS, subscription QoS) (MQTT 5.0 §3.8.4).
        retain: the RETAIN flag to send (Retain As Published, MQTT 5.0 §3.3.1.3).
        sub_ids: Subscription Identifiers of the matching subscriptions [MQTT-3.3.4-3].
        packet_id: assigned when the delivery enters the Inflight Window.
        state: :data:`AWAIT_ACK` or :data:`AWAIT_COMP`.
        sent_at: wall-clock seconds of the last send (for ``retry_interval``).
        expires_at: the message's own expiry or the queue's ``message_expiry_interval`` deadline.
        dropped: set when the Message Queue dropped it (lazy removal).
    """

    __slots__ = ("dropped", "expires_at", "message", "packet_id", "qos", "retain", "sent_at", "seq", "state", "sub_ids")

    def __init__(
        self,
        message: Message,
        qos: int,
        retain: bool = False,
        sub_ids: list[int] | None = None,  # the broker passes a shared empty list when none
        packet_id: int = 0,
        state: int = AWAIT_ACK,
        sent_at: float = 0.0,
        expires_at: float | None = None,
        dropped: bool = False,
        seq: int = 0,
    ) -> None:
        self.message = message
        self.qos = qos
        self.retain = retain
        self.sub_ids: list[int] = [] if sub_ids is None else sub_ids
        self.packet_id = packet_id
        self.state = state
        self.sent_at = sent_at
        self.expires_at = expires_at
        self.dropped = dropped
        self.seq = seq

    def __repr__(self) -> str:
        return (
            f"Delivery(message={self.message!r}, qos={self.qos!r}, retain={self.retain!r}, sub_ids={self.sub_ids!r}, "
            f"packet_id={self.packet_id!r}, state={self.state!r}, sent_at={self.sent_at!r}, "
            f"expires_at={self.expires_at!r}, dropped={self.dropped!r}, seq={self.seq!r})"
        )


def packet_id_of(p: Publish) -> int:
    """The Packet Identifier of a QoS 1 or 2 PUBLISH ``p``, which always has one: the codec refuses such a PUBLISH
    without it [MQTT-2.2.1-3]."""
    pid = p.packet_id
    assert pid is not None, "a QoS 1/2 PUBLISH without a Packet Identifier"
    return pid


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8, as a Payload Format Indicator of 1 says (MQTT 5.0 §3.3.2.3.2)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
