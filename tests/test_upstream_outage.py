"""Upstream bridge outages (docs/upstream.md): the stand-in cloud (a real Mosquitto) is stopped and restarted while
local publishers keep going, with and without a gateway SIGKILL during the outage. Every acknowledged QoS 1/2 message
arrives after recovery, in order per topic; duplicates carry the same msg_id; QoS 0 is dropped while the link is down
(store_qos0 = false) and counted; the counters match."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from helpers import BrokerProcess
from upstream_peers import (
    CloudSubscriber,
    LocalClient,
    Mosquitto,
    Publisher,
    Received,
    SysWatcher,
    first_copies,
    wait_until,
)

GW = "gw-out"


def _config(cloud_port: int) -> str:
    return f"""
[broker]
sys_interval = "1s"
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{cloud_port}"
backoff_initial = "50ms"
backoff_max = "300ms"
connect_timeout = "3s"
drain_rate = 2000
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{suffix}}"
qos = 2
"""


@pytest.fixture
def cloud() -> Iterator[Mosquitto]:
    peer = Mosquitto().start()
    yield peer
    peer.cleanup()


def _check_topic(received: list[Received], acked: list[int], exact: bool) -> None:
    """In order per topic after duplicates are removed; every acknowledged message there (exactly those when
    ``exact``); each message has one msg_id and no two messages share one."""
    order, ids = first_copies(received)
    assert order == sorted(order), f"out of order: {order}"
    missing = sorted(set(acked) - set(order))
    assert not missing, f"acknowledged but never arrived: {missing}"
    if exact:
        assert order == acked
    assert all(len(s) == 1 and None not in s for s in ids.values()), ids
    all_ids = [next(iter(s)) for s in ids.values()]
    assert len(set(all_ids)) == len(all_ids)


def _all_arrived(received: Callable[[str], list[Received]], uid: str, acked: dict[str, list[int]]) -> bool:
    return all(set(ids) <= {int(m.payload) for m in received(f"fleet/{uid}/{t}")} for t, ids in acked.items())


def _missing(
    received: Callable[[str], list[Received]],
    uid: str,
    acked: dict[str, list[int]],
    watch: SysWatcher,
    gw: BrokerProcess,
    cloud: Mosquitto,
) -> str:
    """What did not arrive, and the logs (the assertion message)."""
    lines = [
        f"{t}: missing {sorted(set(ids) - {int(m.payload) for m in received(f'fleet/{uid}/{t}')})}"
        for t, ids in acked.items()
    ]
    lines.append(f"c: {[m.payload for m in received(f'fleet/{uid}/c')]}")
    return "\n".join([*lines, str(watch.values), gw.log(), cloud.log()[-3000:]])


def _check_backoff(log: str, initial: float, cap: float) -> None:
    """Exponential backoff with jitter and a cap: attempt n waits min(cap, initial * 2^(n-1)) times a factor in [0.5, 1]
    (docs/upstream.md, "Reconnect and liveness"), as logged."""
    delays = [(float(d), int(n)) for d, n in re.findall(r"reconnecting in ([\d.]+) s \(attempt (\d+)\)", log)]
    assert len(delays) >= 2, log
    for delay, attempt in delays:
        base = min(cap, initial * 2 ** (attempt - 1))
        assert 0.5 * base - 0.01 <= delay <= base + 0.01, (delay, attempt)
    assert any(n >= 4 for _, n in delays)  # grew to the cap while the cloud was down


def test_outage_every_acknowledged_message_arrives_in_order(make_broker, cloud: Mosquitto, uid: str) -> None:
    """When the upstream Mosquitto is stopped for a while and restarted while publishers keep going, every
    acknowledged QoS 1/2 message arrives after recovery, in order per topic; duplicates, if any, carry the same id;
    QoS 0 behaves as configured; the counters match what happened.

    The observing cloud subscriber (a persistent session) stays away from the restart until the gateway has
    drained: Mosquitto 2.0 itself may interleave a resuming session's queued messages with new ones, which would
    be Mosquitto's reordering, not the bridge's."""
    gw: BrokerProcess = make_broker(_config(cloud.port))
    sub = CloudSubscriber(cloud.port, ["fleet/#"], f"cloud-{uid}", qos=1).start()
    sub2: CloudSubscriber | None = None
    watch = SysWatcher(gw.port, "cloud", f"sys-{uid}")
    q0 = LocalClient(gw.port, f"q0-{uid}")
    a, b, c = f"sensors/{uid}/a", f"sensors/{uid}/b", f"sensors/{uid}/c"
    pub = Publisher(gw.port, f"pub-{uid}", [(a, 1), (b, 2)])
    try:
        assert watch.wait("state", "connected"), gw.log()
        for i in range(3):  # QoS 0 while the link is up: forwarded live
            q0.publish(c, str(i).encode(), 0)
        assert wait_until(lambda: len(sub.on(f"fleet/{uid}/c")) == 3), cloud.log()
        pub.start()
        assert wait_until(lambda: len(pub.acked()) >= 40)
        sub.close()  # from here on Mosquitto queues for the observer (QoS 1/2)
        cloud.stop()  # the cloud goes away while the publisher keeps going
        assert watch.wait_state_not("connected"), gw.log()
        for i in range(3, 7):  # QoS 0 while the link is down: dropped (store_qos0 = false) and counted
            q0.publish(c, str(i).encode(), 0).wait_for_publish(10)
        down_acked = len(pub.acked())
        assert wait_until(lambda: len(pub.acked()) >= down_acked + 40)
        assert wait_until(lambda: int(watch.get("backlog/messages") or 0) >= 20), watch.values
        assert wait_until(lambda: "(attempt 4)" in gw.log()), gw.log()  # backed off a few times
        cloud.start()
        assert watch.wait("state", "connected"), gw.log()
        assert wait_until(lambda: len(pub.acked()) >= down_acked + 60)
        pub.finish()
        acked = {"a": pub.acked(a), "b": pub.acked(b)}
        assert len(acked["a"]) + len(acked["b"]) == len(pub.sent)  # the local broker acknowledged everything
        assert watch.wait("backlog/messages", "0"), watch.values
        sub2 = CloudSubscriber(cloud.port, ["fleet/#"], f"cloud-{uid}", qos=1).start()  # the same session resumes
        for i in range(7, 9):  # QoS 0 after recovery: forwarded again
            q0.publish(c, str(i).encode(), 0)

        def received(topic: str) -> list[Received]:
            return sub.on(topic) + sub2.on(topic)  # type: ignore[union-attr]

        assert wait_until(lambda: _all_arrived(received, uid, acked) and len(received(f"fleet/{uid}/c")) == 5, 30), (
            _missing(received, uid, acked, watch, gw, cloud)
        )
        _check_topic(received(f"fleet/{uid}/a"), acked["a"], exact=True)
        _check_topic(received(f"fleet/{uid}/b"), acked["b"], exact=True)
        assert [int(m.payload) for m in received(f"fleet/{uid}/c")] == [0, 1, 2, 7, 8]
        assert {m.qos for m in received(f"fleet/{uid}/a") + received(f"fleet/{uid}/b")} == {1}  # observer at QoS 1
        # Counters: every QoS 1/2 message acknowledged upstream once, the 5 QoS 0 sent, the 4 dropped.
        assert watch.wait("forwarded/messages", str(len(pub.sent))), watch.values
        assert watch.wait("forwarded/qos0", "5"), watch.values
        assert watch.get("dropped/qos0_link_down") == "4"
        assert watch.get("dropped") == "4"
        assert int(watch.get("connects") or 0) >= 2
        assert {"connected", "backing-off", "connecting"} <= set(watch.states)
        _check_backoff(gw.log(), initial=0.05, cap=0.3)
    finally:
        pub.finish(wait_acks=False)
        q0.close()
        watch.close()
        sub.close()
        if sub2 is not None:
            sub2.close()


def test_outage_plus_gateway_sigkill_loses_no_acknowledged_message(make_broker, cloud: Mosquitto, uid: str) -> None:
    """An outage plus a gateway SIGKILL and restart during the outage: the same guarantees (docs/upstream.md: the
    outbox row is committed with the publisher's acknowledgement, so kill -9 loses nothing acknowledged). The
    observer resumes its session after the drain, as in the test above."""
    gw: BrokerProcess = make_broker(_config(cloud.port))
    sub = CloudSubscriber(cloud.port, ["fleet/#"], f"cloud-{uid}", qos=1).start()
    sub2: CloudSubscriber | None = None
    a, b = f"sensors/{uid}/a", f"sensors/{uid}/b"
    watch = SysWatcher(gw.port, "cloud", f"sys-{uid}")
    pub = Publisher(gw.port, f"pub-{uid}", [(a, 1), (b, 2)])
    pub2: Publisher | None = None
    watch2: SysWatcher | None = None
    try:
        assert watch.wait("state", "connected"), gw.log()
        pub.start()
        assert wait_until(lambda: len(pub.acked()) >= 30)
        sub.close()
        cloud.stop()
        assert watch.wait_state_not("connected"), gw.log()
        down_acked = len(pub.acked())
        assert wait_until(lambda: len(pub.acked()) >= down_acked + 40)
        watch.close()
        gw.kill()  # SIGKILL while the publisher keeps going and the cloud is down
        pub.finish(wait_acks=False)
        acked = {"a": pub.acked(a), "b": pub.acked(b)}
        gw.start()  # same store directory, a new port
        watch2 = SysWatcher(gw.port, "cloud", f"sys2-{uid}")
        assert wait_until(lambda: watch2.get("state") in ("connecting", "backing-off")), gw.log()
        assert wait_until(lambda: watch2.get("backlog/messages") is not None)
        restored = int(watch2.get("backlog/messages") or 0)
        assert restored >= len(acked["a"]) + len(acked["b"]) - down_acked  # what was acknowledged while down
        last = max(i for _, i, _ in pub.sent)
        pub2 = Publisher(gw.port, f"pub2-{uid}", [(a, 1), (b, 2)], start_index=last + 1)
        pub2.start()
        assert wait_until(lambda: len(pub2.acked()) >= 10)
        cloud.start()
        assert watch2.wait("state", "connected"), gw.log()
        pub2.finish()
        acked["a"] += pub2.acked(a)
        acked["b"] += pub2.acked(b)
        assert watch2.wait("backlog/messages", "0"), watch2.values
        sub2 = CloudSubscriber(cloud.port, ["fleet/#"], f"cloud-{uid}", qos=1).start()

        def received(topic: str) -> list[Received]:
            return sub.on(topic) + sub2.on(topic)  # type: ignore[union-attr]

        assert wait_until(lambda: _all_arrived(received, uid, acked), 30), _missing(
            received, uid, acked, watch2, gw, cloud
        )
        _check_topic(received(f"fleet/{uid}/a"), acked["a"], exact=False)
        _check_topic(received(f"fleet/{uid}/b"), acked["b"], exact=False)
        # The restarted gateway forwarded exactly what it restored plus what arrived after the restart.
        assert watch2.wait("forwarded/messages", str(restored + len(pub2.sent))), watch2.values
        assert watch2.get("dropped") == "0"
    finally:
        pub.finish(wait_acks=False)
        if pub2 is not None:
            pub2.finish(wait_acks=False)
        if watch2 is not None:
            watch2.close()
        sub.close()
        if sub2 is not None:
            sub2.close()
