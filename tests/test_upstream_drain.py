"""Backlog drain after an outage ("Backlog drain is paced (drain_rate messages/s and bytes/s) and shares
the link with live traffic, so fresh readings are not stuck behind hours of backlog; the order (backlog_first or
live_first) is configurable and documented", docs/upstream.md "Order and pacing"). The cloud is a fake broker that
refuses connections (down), then accepts and acknowledges, recording when each PUBLISH arrived."""

from __future__ import annotations

import paho.mqtt.client as mqtt
from helpers import BrokerProcess
from upstream_peers import FakeUpstream, LocalClient, SysWatcher, wait_until

GW = "gw-d"
BACKLOG = 60
RATE = 20  # messages per second; the first second's worth goes at once


def test_backlog_paced_live_first_and_backlog_first(make_broker, uid: str) -> None:
    """Two links drain 60 messages each at drain_rate 20/s. live_first: a reading published during the drain goes
    out ahead of the rest of the backlog. backlog_first: a reading on a topic without backlog goes out at once, a
    reading on the backlog's own topic waits behind it (per-topic order). Pacing: the backlog takes at least
    (60 - 20) / 20 s to leave."""
    fake = FakeUpstream(receive_maximum=100, ack=True, refuse=True)
    watches: dict[str, SysWatcher] = {}
    pub: LocalClient | None = None
    try:
        links = "".join(
            f"""
[[upstream]]
name = "{order}"
url = "mqtt://127.0.0.1:{fake.port}"
order = "{order}"
drain_rate = {RATE}
backoff_initial = "50ms"
backoff_max = "200ms"
[[upstream.forward]]
local = "{order}/#"
remote = "{{topic}}"
qos = 1
"""
            for order in ("live_first", "backlog_first")
        )
        gw: BrokerProcess = make_broker(f"""
[broker]
sys_interval = "1s"
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
{links}""")
        for order in ("live_first", "backlog_first"):
            watches[order] = SysWatcher(gw.port, order, f"sys-{order}-{uid}")
            assert wait_until(lambda o=order: watches[o].get("state") in ("connecting", "backing-off")), gw.log()
        pub = LocalClient(gw.port, f"pub-{uid}", mqtt.MQTTv311)
        for order in ("live_first", "backlog_first"):
            for i in range(BACKLOG):
                pub.publish(f"{order}/old", str(i).encode(), 1).wait_for_publish(10)
        fake.refuse = False  # the cloud is back
        for order in ("live_first", "backlog_first"):
            assert watches[order].wait("state", "connected"), gw.log()
        pub.publish("live_first/old", b"live", 1).wait_for_publish(10)
        pub.publish("backlog_first/fresh", b"fresh", 1).wait_for_publish(10)
        pub.publish("backlog_first/old", b"same-topic", 1).wait_for_publish(10)
        assert wait_until(
            lambda: (
                len(fake.arrivals(f"{GW}-live_first")) == BACKLOG + 1
                and len(fake.arrivals(f"{GW}-backlog_first")) == BACKLOG + 2
            ),
            30,
        ), gw.log()

        lf = [p.payload for _, p in fake.arrivals(f"{GW}-live_first")]
        assert [x for x in lf if x != b"live"] == [str(i).encode() for i in range(BACKLOG)]
        assert lf.index(b"live") < BACKLOG  # not behind the whole backlog

        bf = [p.payload for _, p in fake.arrivals(f"{GW}-backlog_first")]
        assert bf.index(b"fresh") < BACKLOG  # another topic is not held up by this one's backlog
        assert bf[-1] == b"same-topic"  # same topic: strictly after its backlog
        assert [x for x in bf if x not in (b"fresh", b"same-topic")] == [str(i).encode() for i in range(BACKLOG)]

        for client_id in (f"{GW}-live_first", f"{GW}-backlog_first"):
            times = [t for t, p in fake.arrivals(client_id) if p.payload.isdigit()]
            assert times[-1] - times[0] >= (BACKLOG - RATE - 1) / RATE  # paced
        for order in ("live_first", "backlog_first"):
            assert watches[order].wait("backlog/messages", "0")
    finally:
        for w in watches.values():
            w.close()
        if pub is not None:
            pub.close()
        fake.close()
