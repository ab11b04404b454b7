"""A "half-open" upstream (one that accepts the connection and never acknowledges, simulated with a small fake
server) is detected and the link rebuilt, and the inflight window honouring the cloud broker's Receive Maximum
(MQTT 5.0 §3.3.4: the Client "MUST NOT send more than Receive Maximum QoS 1 and QoS 2 PUBLISH packets for which it
has not received PUBACK, PUBCOMP, or PUBREC" [MQTT-3.3.4-7]; §4.9: at send quota zero no more QoS > 0 PUBLISH
[MQTT-4.9.0-2])."""

from __future__ import annotations

import paho.mqtt.client as mqtt
from helpers import BrokerProcess
from upstream_peers import FakeUpstream, LocalClient, SysWatcher, msg_id_of, wait_until

GW = "gw-h"


def test_mqtt_4_9_0_2_half_open_upstream_detected_rebuilt_receive_maximum_honoured(make_broker, uid: str) -> None:
    """The fake cloud broker answers CONNECT (Receive Maximum 3) and PINGREQ but never acknowledges a PUBLISH: the
    link sends exactly 3 of 5 QoS 1 messages [MQTT-3.3.4-7] [MQTT-4.9.0-2], gives up after ack_timeout while
    "connected", and reconnects, re-sending the same 3 with the same msg_ids. Once the peer acknowledges again,
    all 5 leave the outbox in order."""
    fake = FakeUpstream(receive_maximum=3)
    watch: SysWatcher | None = None
    pub: LocalClient | None = None
    try:
        gw: BrokerProcess = make_broker(f"""
[broker]
sys_interval = "1s"
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "halfopen"
url = "mqtt://127.0.0.1:{fake.port}"
ack_timeout = "1s"
backoff_initial = "50ms"
backoff_max = "200ms"
[[upstream.forward]]
local = "sensors/#"
remote = "{{topic}}"
qos = 1
""")
        watch = SysWatcher(gw.port, "halfopen", f"sys-{uid}")
        assert watch.wait("state", "connected"), gw.log()
        pub = LocalClient(gw.port, f"pub-{uid}", mqtt.MQTTv311)
        for i in range(5):
            pub.publish(f"sensors/{uid}", str(i).encode(), 1).wait_for_publish(10)
        assert wait_until(lambda: fake.count() >= 2, 30), gw.log()  # torn down and rebuilt
        first = fake.publishes(0)
        assert [p.payload for p in first] == [b"0", b"1", b"2"]  # the window: Receive Maximum 3
        ids = [msg_id_of(p) for p in first]
        assert all(i is not None and i.startswith(f"{GW}:") for i in ids)
        assert wait_until(lambda: len(fake.publishes(1)) == 3)
        assert [msg_id_of(p) for p in fake.publishes(1)] == ids  # the same messages again, same msg_ids
        assert wait_until(lambda: int(watch.get("ack_timeouts") or 0) >= 1), watch.values
        assert "ack_timeout" in gw.log() or "no acknowledgement" in gw.log()
        assert watch.get("backlog/messages") == "5"
        assert watch.get("last_ack") == "never"
        fake.ack = True  # the next connection is healthy
        assert watch.wait("forwarded/messages", "5", timeout=30), (watch.values, gw.log())
        assert watch.wait("backlog/messages", "0")
        last = fake.publishes(fake.count() - 1)
        assert [p.payload for p in last][-5:] == [b"0", b"1", b"2", b"3", b"4"]
        assert [msg_id_of(p) for p in last][-5:][:3] == ids
        assert watch.get("last_ack") != "never"
    finally:
        if pub is not None:
            pub.close()
        if watch is not None:
            watch.close()
        fake.close()
