"""Upstream outbox bounds: bounds and TTL drop exactly what the policy says and count it, and the local broker
keeps serving throughout (docs/upstream.md, "Bounds and drops": the outbox is bounded by count, bytes and age, and
every drop is counted by reason). One gateway, three links to a stand-in cloud that is down at first, each with
one bound."""

from __future__ import annotations

from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess
from upstream_peers import CloudSubscriber, LocalClient, Mosquitto, SysWatcher, free_port, wait_until

GW = "gw-b"


@pytest.fixture
def setup(make_broker, uid: str) -> Iterator[tuple[BrokerProcess, Mosquitto]]:
    cloud = Mosquitto(port=free_port()).start()
    # The observer's persistent session exists before the links first connect, so nothing is published to a
    # Mosquitto without a subscriber for it; then the cloud goes down and the links start disconnected.
    CloudSubscriber(cloud.port, ["up/#"], f"cloud-{uid}", qos=1).start().close()
    cloud.stop()
    links = ""
    for name, bound in (
        ("count", "max_messages = 5\nstore_qos0 = true"),
        ("bytes", "max_bytes = 200"),
        ("ttl", 'message_ttl = "3s"'),
    ):
        links += f"""
[[upstream]]
name = "{name}"
url = "mqtt://127.0.0.1:{cloud.port}"
backoff_initial = "50ms"
backoff_max = "200ms"
{bound}
[[upstream.forward]]
local = "{name}/#"
remote = "up/{{topic}}"
qos = 1
"""
    gw: BrokerProcess = make_broker(f"""
[broker]
sys_interval = "1s"
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
{links}""")
    yield gw, cloud
    cloud.cleanup()


def test_outbox_bounds_and_ttl_drop_by_policy_and_count(setup: tuple[BrokerProcess, Mosquitto], uid: str) -> None:
    """max_messages drops QoS 0 first, then the oldest; max_bytes drops the oldest; message_ttl drops what waited too
    long; each drop is counted by reason on $SYS with a warning; the local broker delivers and acknowledges every
    publish meanwhile; when the cloud comes back exactly the survivors arrive, in order."""
    gw, cloud = setup
    watches = {name: SysWatcher(gw.port, name, f"sys-{name}-{uid}") for name in ("count", "bytes", "ttl")}
    local = LocalClient(gw.port, f"local-{uid}", mqtt.MQTTv311)
    pub = LocalClient(gw.port, f"pub-{uid}", mqtt.MQTTv311)
    sub: CloudSubscriber | None = None
    try:
        local.subscribe("+/#", 1)
        for w in watches.values():
            assert wait_until(lambda w=w: w.get("state") in ("connecting", "backing-off")), gw.log()
        # count: 3 QoS 1, a QoS 0 (stored: store_qos0), 2 QoS 1 -> over 5: the QoS 0 goes first; one more QoS 1
        # -> the oldest (m0) goes.
        for topic, payload, qos in (
            ("count/t", b"m0", 1),
            ("count/t", b"m1", 1),
            ("count/t", b"m2", 1),
            ("count/t", b"z0", 0),
            ("count/t", b"m3", 1),
            ("count/t", b"m4", 1),
            ("count/t", b"m5", 1),
        ):
            info = pub.publish(topic, payload, qos)
            info.wait_for_publish(10)
        # bytes: 50 bytes each (40 payload + the remote topic "up/bytes/t"): 4 fit in 200, 2 more push out 2.
        for i in range(6):
            pub.publish("bytes/t", f"b{i}".encode().ljust(40, b"."), 1).wait_for_publish(10)
        # ttl: 3 messages that will wait longer than message_ttl.
        for i in range(3):
            pub.publish("ttl/t", f"old{i}".encode(), 1).wait_for_publish(10)
        assert watches["count"].wait("dropped/max_messages", "2"), watches["count"].values
        assert watches["count"].wait("backlog/messages", "5")
        assert watches["bytes"].wait("dropped/max_bytes", "2"), watches["bytes"].values
        assert watches["bytes"].wait("backlog/messages", "4")
        assert watches["bytes"].get("backlog/bytes") == str(4 * (40 + len("up/bytes/t")))
        assert watches["ttl"].wait("dropped/message_ttl", "3", timeout=30), watches["ttl"].values
        assert watches["ttl"].wait("backlog/messages", "0")
        assert wait_until(lambda: any("max_messages" in w for w in watches["count"].warnings))
        assert wait_until(lambda: any("max_bytes" in w for w in watches["bytes"].warnings))
        assert wait_until(lambda: any("message_ttl" in w for w in watches["ttl"].warnings))
        # The local broker kept serving: every message reached the local subscriber.
        assert wait_until(
            lambda: (
                len(local.payloads("count/t")) == 7
                and len(local.payloads("bytes/t")) == 6
                and len(local.payloads("ttl/t")) == 3
            )
        )
        cloud.start()
        for w in watches.values():
            assert w.wait("state", "connected"), gw.log()
        pub.publish("ttl/t", b"new0", 1).wait_for_publish(10)
        for w in watches.values():
            assert w.wait("backlog/messages", "0"), w.values
        sub = CloudSubscriber(cloud.port, ["up/#"], f"cloud-{uid}", qos=1).start()  # the session resumes
        assert wait_until(
            lambda: len(sub.on("up/count/t")) == 5 and len(sub.on("up/bytes/t")) == 4 and len(sub.on("up/ttl/t")) == 1
        ), cloud.log()
        assert [m.payload for m in sub.on("up/count/t")] == [b"m1", b"m2", b"m3", b"m4", b"m5"]
        assert [m.payload[:2] for m in sub.on("up/bytes/t")] == [b"b2", b"b3", b"b4", b"b5"]
        assert [m.payload for m in sub.on("up/ttl/t")] == [b"new0"]
        for name, reason, n in (("count", "max_messages", 2), ("bytes", "max_bytes", 2), ("ttl", "message_ttl", 3)):
            assert watches[name].wait("backlog/messages", "0")
            assert watches[name].get("dropped") == str(n)
            assert watches[name].get(f"dropped/{reason}") == str(n)
        assert watches["count"].wait("forwarded/messages", "5")
        assert watches["bytes"].wait("forwarded/messages", "4")
        assert watches["ttl"].wait("forwarded/messages", "1")
    finally:
        for w in watches.values():
            w.close()
        local.close()
        pub.close()
        if sub is not None:
            sub.close()
