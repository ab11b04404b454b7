"""Limits in process (sans-I/O, fake clock): ``max_connections``, ``max_topic_length``,
``max_publish_rate``, ``max_retained_messages`` and ``max_retained_bytes``. Each refusal is for the client that
passed the limit only, with the reason code of docs/reliability.md's Limits table, and is counted in
``Stats.refused`` / ``Stats.dropped`` (``$SYS/broker/refused/<limit>``, ``messages/dropped/<limit>``). The same
limits against a real broker process with real clients are in tests/test_hostile.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from recording_broker import RecordingBroker
from test_core import Client

from gateway.broker.connection_states import CLOSED, CONNECTED
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.store_port import MemoryStore
from gateway.mqtt.packets import (
    PingReq,
    PingResp,
    PubAck,
    Publish,
    PubRec,
    Suback,
    Subscribe,
    Subscription,
    Will,
)
from gateway.mqtt.reason_codes import ReasonCode as RC
from gateway.server.config import load_config


def broker_with(**settings: int) -> RecordingBroker:
    return RecordingBroker(BrokerSettings(sys_interval=0, **settings), MemoryStore(), now=0.0)


# ---------------------------------------------------------------------------------------------- configuration


def test_config_reads_the_limits_and_the_defaults_are_safe() -> None:
    """The five keys are read from their tables; the defaults are the ones docs/reliability.md states."""
    cfg = load_config({
        "broker": {"max_retained_messages": 7, "max_retained_bytes": "2MB"},
        "listeners": {"external": {"bind": "127.0.0.1:0", "max_connections": 3, "max_topic_length": 100,
                                   "max_publish_rate": 2.5}},
    })
    limits = cfg.listeners[0].limits
    assert (limits.max_connections, limits.max_topic_length, limits.max_publish_rate) == (3, 100, 2.5)
    assert (cfg.broker.max_retained_messages, cfg.broker.max_retained_bytes) == (7, 2 * 2**20)
    default = ZoneLimits()
    assert (default.max_connections, default.max_topic_length, default.max_publish_rate) == (10_000, 1024, 0)
    assert (BrokerSettings().max_retained_messages, BrokerSettings().max_retained_bytes) == (10_000, 64 * 2**20)


# ---------------------------------------------------------------------------------------------- max_connections


@pytest.mark.parametrize("version", [4, 5])
def test_max_connections_refuses_the_next_connect_with_quota_exceeded(version: int) -> None:
    """Past ``max_connections`` connected clients on a listener the CONNECT gets CONNACK 0x97 (3.1.1: 0x03 Server
    unavailable) and the connection is closed; the connected clients, another listener and a take-over on the
    same listener are unaffected, and a slot freed by a disconnect is available again."""
    broker = broker_with()
    limits = ZoneLimits(max_connections=2)
    a, b = Client(broker, version, limits), Client(broker, version, limits)
    assert a.connect("a").reason_code == 0 and b.connect("b").reason_code == 0
    extra = Client(broker, version, limits)
    refused = extra.connect("c")
    assert refused.reason_code == (RC.QUOTA_EXCEEDED if version == 5 else 3)
    assert extra.conn.state == CLOSED and extra.conn.close_after_flush
    assert broker.stats.refused["max_connections"] == 1
    assert a.conn.state == CONNECTED and b.conn.state == CONNECTED
    # A take-over of "b" on the same listener is not a new connection.
    again = Client(broker, version, limits)
    assert again.connect("b").reason_code == 0
    assert b.conn.state == CLOSED and again.conn.state == CONNECTED
    # Another listener counts its own clients.
    other = Client(broker, version, limits)
    other.conn.listener = "internal"
    assert other.connect("d").reason_code == 0
    # A disconnect frees a slot.
    a.disconnect()
    assert Client(broker, version, limits).connect("e").reason_code == 0
    assert broker.listener_clients["external"] == 2 and broker.stats.refused["max_connections"] == 1


# ---------------------------------------------------------------------------------------------- max_topic_length


def test_max_topic_length_refuses_publish_subscribe_and_will_in_utf8_bytes() -> None:
    """A Topic Name or Filter over ``max_topic_length`` UTF-8 bytes is refused as ``max_topic_levels`` refuses
    (the same check): SUBSCRIBE 0x8F (3.1.1: 0x80), QoS 1/2 PUBLISH PUBACK/PUBREC 0x90 (3.1.1: acknowledged and
    dropped), QoS 0 dropped, a Will Topic CONNACK 0x90. Length counts bytes: 341 three-byte characters (1,023
    bytes) pass a limit of 1,024 and 342 (1,026) do not."""
    broker = broker_with()
    limits = ZoneLimits(max_topic_length=1024)
    ok, long = "€" * 341, "€" * 342
    sub = Client(broker, 5, limits)
    sub.connect("sub")
    assert sub.subscribe(ok, 1) == [1]
    assert sub.subscribe(long, 1, packet_id=2) == [RC.TOPIC_FILTER_INVALID]
    sub.send(Subscribe(3, [Subscription("a/" + "b" * 1100 + "/#", 1)]))
    assert sub.read() == [Suback(3, [RC.TOPIC_FILTER_INVALID])]
    assert broker.stats.refused["max_topic_length"] == 2
    pub = Client(broker, 5, limits)
    pub.connect("pub")
    pub.send(Publish(long, b"x", 1, packet_id=1))
    pub.send(Publish(long, b"x", 2, packet_id=2))
    pub.send(Publish(long, b"x", 0))
    assert pub.read() == [PubAck(1, RC.TOPIC_NAME_INVALID), PubRec(2, RC.TOPIC_NAME_INVALID)]
    assert broker.stats.dropped["max_topic_length"] == 3
    pub.send(Publish(ok, b"fine", 1, packet_id=3))
    assert pub.read() == [PubAck(3, 0)]
    assert [p.payload for p in sub.publishes()] == [b"fine"]
    old = Client(broker, 4, limits)
    old.connect("old")
    old.send(Publish(long, b"x", 1, packet_id=4))
    assert old.read() == [PubAck(4, 0)]  # 3.1.1 cannot refuse: acknowledged, dropped, counted
    assert broker.stats.dropped["max_topic_length"] == 4
    assert old.subscribe(long, 0) == [0x80]
    willing = Client(broker, 5, limits)
    assert willing.connect("w", will=Will(long, b"bye")).reason_code == RC.TOPIC_NAME_INVALID
    assert broker.stats.refused["max_topic_length"] == 4
    assert sub.conn.state == CONNECTED and pub.conn.state == CONNECTED and old.conn.state == CONNECTED


def test_max_topic_length_zero_is_off() -> None:
    broker = broker_with()
    limits = ZoneLimits(max_topic_length=0, max_topic_levels=0)
    sub = Client(broker, 5, limits)
    sub.connect("sub")
    topic = "t/" * 20_000
    assert sub.subscribe(topic, 0) == [0]


# ---------------------------------------------------------------------------------------------- max_publish_rate


def test_max_publish_rate_pauses_reading_until_the_next_token_and_never_disconnects() -> None:
    """``max_publish_rate`` = 10/s, a bucket of one second's worth: of 25 PUBLISHes read at once the first 10 are
    handled; the 11th waits for its token (``paused_until`` = 0.1 s: the I/O layer stops reading until then and
    calls ``receive(conn, b"", now)``), with the bytes after it kept in order. Driven as the I/O layer drives it,
    the 25th is handled at 1.5 s: 10 a second. Each pause is counted; the client is never disconnected, and Keep
    Alive counts from the end of a pause; bytes read during a pause wait behind the PUBLISH that waits."""
    broker = broker_with()
    limits = ZoneLimits(max_publish_rate=10)
    sub = Client(broker, 5, limits)
    sub.connect("sub")
    sub.subscribe("t", 0)
    pub = Client(broker, 5, limits)
    pub.connect("pub", keep_alive=1)
    pub.send_bytes(b"".join(Publish("t", str(i).encode()).encode(5) for i in range(25)), now=0.0)
    assert [p.payload for p in sub.publishes()] == [str(i).encode() for i in range(10)]
    assert pub.conn.paused_until == pytest.approx(0.1) and broker.stats.refused["max_publish_rate"] == 1
    pub.send_bytes(PingReq().encode(5), now=0.05)  # read during the pause (TLS may hand over buffered bytes)
    assert pub.read() == [] and len(sub.publishes()) == 0
    now = 0.0
    for _ in range(100):  # the I/O layer: resume reading at paused_until
        if pub.conn.deferred is None:
            break
        now = pub.conn.paused_until
        pub.send_bytes(b"", now=now)
        broker.tick(now)
    assert now == pytest.approx(1.5)
    assert [p.payload for p in sub.publishes()] == [str(i).encode() for i in range(10, 25)]
    assert pub.read() == [PingResp()]  # after the PUBLISHes it followed
    assert broker.stats.refused["max_publish_rate"] == 15
    assert pub.conn.state == CONNECTED and sub.conn.paused_until == 0.0
    pub.send(Publish("t", b"late"), now=1.6)  # one token since 1.5 s
    assert pub.conn.deferred is None and [p.payload for p in sub.publishes()] == [b"late"]


def test_max_publish_rate_below_one_still_lets_one_message_through() -> None:
    broker = broker_with()
    pub = Client(broker, 4, ZoneLimits(max_publish_rate=0.5))
    pub.connect("pub")
    pub.send(Publish("t", b"1"), now=0.0)
    assert pub.conn.deferred is None
    pub.send(Publish("t", b"2"), now=0.0)
    assert pub.conn.deferred is not None and pub.conn.paused_until == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------- retained limits


def test_max_retained_messages_refuses_a_new_topic_and_always_allows_replace_and_clear() -> None:
    """``max_retained_messages`` = 2 (``$SYS`` not counted): a third retained topic is refused with PUBACK 0x97
    for 5.0 QoS 1 (not delivered); QoS 0 and 3.1.1 QoS 1 are delivered with RETAIN 0 but not retained;
    replacing a retained message and clearing one always work, and a cleared slot is free again."""
    broker = broker_with(max_retained_messages=2)
    broker.publish_sys(0.0)  # retained $SYS values do not count
    sub = Client(broker, 5)
    sub.connect("sub")
    sub.subscribe("r/#", 1)
    pub = Client(broker, 5)
    pub.connect("pub")
    for i, topic in enumerate(("r/1", "r/2"), 1):
        pub.send(Publish(topic, b"v", 1, retain=True, packet_id=i))
    pub.send(Publish("r/3", b"v", 1, retain=True, packet_id=3))
    assert [p.reason_code for p in pub.read()] == [0, 0, RC.QUOTA_EXCEEDED]
    assert [p.topic for p in sub.publishes()] == ["r/1", "r/2"]
    assert broker.stats.dropped["max_retained_messages"] == 1
    pub.send(Publish("r/3", b"q0", 0, retain=True))
    delivered = sub.publishes()
    assert [(p.topic, p.retain) for p in delivered] == [("r/3", False)]
    assert broker.retained.get("r/3") is None and broker.stats.refused["max_retained_messages"] == 1
    old = Client(broker, 4)
    old.connect("old")
    old.send(Publish("r/4", b"v", 1, retain=True, packet_id=9))
    assert old.read() == [PubAck(9, 0)]
    assert [p.topic for p in sub.publishes()] == ["r/4"]
    assert broker.retained.get("r/4") is None and broker.stats.refused["max_retained_messages"] == 2
    pub.send(Publish("r/1", b"replaced", 1, retain=True, packet_id=4))
    pub.send(Publish("r/2", b"", 1, retain=True, packet_id=5))
    assert [p.reason_code for p in pub.read()] == [0, 0]
    assert broker.retained.get("r/1").payload == b"replaced"  # type: ignore[union-attr]
    pub.send(Publish("r/3", b"now", 1, retain=True, packet_id=6))
    assert pub.read() == [PubAck(6, 0)]
    assert broker.retained.count == 2 and sub.conn.state == CONNECTED


def test_max_retained_bytes_counts_payload_and_topic_and_limits_wills_too() -> None:
    """``max_retained_bytes`` counts payload plus UTF-8 topic bytes; a growth past it is refused (5.0 QoS 2:
    PUBREC 0x97) while a shrinking replacement passes; a retained Will past it is published but not retained."""
    broker = broker_with(max_retained_bytes=100)
    pub = Client(broker, 5)
    pub.connect("pub")
    pub.send(Publish("b/1", b"x" * 57, 1, retain=True, packet_id=1))  # 3 + 57 = 60 bytes
    pub.send(Publish("b/2", b"x" * 40, 2, retain=True, packet_id=2))  # 60 + 43 > 100
    assert [type(p).__name__ for p in pub.read()] == ["PubAck", "PubRec"]
    assert broker.retained.count == 1 and broker.retained.size == 60
    assert broker.stats.dropped["max_retained_bytes"] == 1
    pub.send(Publish("b/2", b"x" * 37, 1, retain=True, packet_id=3))  # exactly 100
    pub.send(Publish("b/1", b"x" * 10, 1, retain=True, packet_id=4))  # shrinks
    assert [p.reason_code for p in pub.read()] == [0x10, 0x10]  # accepted; nobody subscribed
    assert broker.retained.size == 53
    willing = Client(broker, 5)
    willing.connect("w", will=Will("b/will", b"x" * 60, retain=True))
    broker.connection_lost(willing.conn, 1.0)  # gone without DISCONNECT: the Will is published
    assert broker.retained.get("b/will") is None and broker.stats.refused["max_retained_bytes"] == 1


def test_retained_limits_zero_are_off() -> None:
    broker = broker_with(max_retained_messages=0, max_retained_bytes=0)
    pub = Client(broker, 5, replace(ZoneLimits(), max_awaiting_rel=65535))
    pub.connect("pub")
    for i in range(1, 200):
        pub.send(Publish(f"z/{i}", b"x" * 1000, 1, retain=True, packet_id=i))
    assert all(isinstance(p, PubAck) and p.reason_code == 0x10 for p in pub.read())
    assert broker.retained.count == 199
