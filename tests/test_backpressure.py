"""A subscriber that stops reading cannot grow the broker without bound: once its socket write buffer holds
``high_watermark`` bytes, QoS 0 messages to it are dropped and counted, and QoS 1/2 messages wait in its Message Queue,
which is bounded by ``max_mqueue_len`` and ``max_mqueue_bytes`` and drops the oldest QoS 0 first (docs/architecture.md,
"Session semantics")."""

from __future__ import annotations

from helpers import BrokerProcess, RawClient, wait_until

from gateway.mqtt.packets import PingReq, PingResp, PubAck, Publish, Suback, Subscribe, Subscription

CONFIG = """
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
max_mqueue_len = 100
"""


def _sys_value(port: int, name: str) -> int:
    """The retained value of ``$SYS/broker/<name>``; 0 while it has none (a drop counter is first published after
    its first drop). The SUBACK comes once the subscription is in place and the retained message right behind it;
    a PINGRESP after that proves there was none."""
    watcher = RawClient(port, version=5)
    try:
        watcher.connect("watcher")
        watcher.send(Subscribe(1, [Subscription(f"$SYS/broker/{name}", 0)]))
        suback = watcher.recv()
        assert isinstance(suback, Suback), suback
        watcher.send(PingReq())
        value = 0
        while not isinstance(packet := watcher.recv(), PingResp):
            if isinstance(packet, Publish):
                value = int(packet.payload)
        return value
    finally:
        watcher.close()


def _wait_sys(port: int, name: str, expected: int, timeout: float = 5.0) -> None:
    """Wait until ``$SYS/broker/<name>`` (published every sys_interval) reaches ``expected``; fail at once past it."""

    def reached() -> bool:
        value = _sys_value(port, name)
        assert value <= expected, f"$SYS/broker/{name} = {value}, more than {expected}"
        return value == expected

    wait_until(reached, timeout, f"$SYS/broker/{name} == {expected}", interval=0.1)


def test_slow_qos0_subscriber_past_high_watermark_gets_qos0_dropped(make_broker) -> None:  # type: ignore[no-untyped-def]
    """QoS 0 is at most once: to a subscriber whose socket write buffer is past ``high_watermark`` it is dropped
    and counted (``messages/dropped/high_watermark_qos0``), so memory stays bounded; what was written before is
    still delivered, and every message is either delivered or counted."""
    broker: BrokerProcess = make_broker(CONFIG)
    slow = RawClient(broker.port, version=5)
    slow.connect("slow")
    slow.send(Subscribe(1, [Subscription("flood/#", 0)]))
    slow.recv()
    publisher = RawClient(broker.port, version=5)
    publisher.connect("fast")
    payload = b"x" * 1024
    total = 20000  # ~20 MB, far more than socket buffers hold
    batch = b"".join(Publish("flood/a", payload).encode(5) for _ in range(100))
    for _ in range(total // 100):
        publisher.send(batch)
    # The broker still answers while the subscriber is stuck, and counts the drops.
    wait_until(lambda: _sys_value(broker.port, "messages/dropped/high_watermark_qos0") > 0, 10,
               "$SYS/broker/messages/dropped/high_watermark_qos0 > 0", interval=0.1)
    # Now the subscriber reads what the broker still holds for it: socket buffers plus at most 100 queued.
    received = 0
    try:
        while True:
            packet = slow.recv(1.0)
            if isinstance(packet, Publish):
                received += 1
    except TimeoutError:
        pass
    assert 0 < received < total
    # Every message was delivered or counted: the counter (published every sys_interval) reaches the rest.
    _wait_sys(broker.port, "messages/dropped/high_watermark_qos0", total - received)
    publisher.close()
    slow.close()


def test_per_client_byte_quota_drops_oldest_of_an_offline_queue(make_broker) -> None:  # type: ignore[no-untyped-def]
    """Per-client quotas keep one slow client from filling the store: ``max_mqueue_bytes`` bounds the
    payload bytes one session's queue holds; over it the oldest message goes, as with ``max_mqueue_len``."""
    broker: BrokerProcess = make_broker("""
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
max_mqueue_bytes = "10KB"
""")
    sub = RawClient(broker.port, version=5)
    sub.connect("quota-sub", properties={0x11: 600})
    sub.send(Subscribe(1, [Subscription("quota/#", 1)]))
    sub.recv()
    sub.close()
    publisher = RawClient(broker.port, version=5)
    publisher.connect("quota-pub")
    for i in range(50):
        publisher.send(Publish("quota/a", i.to_bytes(2, "big") + b"x" * 1022, 1, packet_id=i + 1))
    acks = [publisher.recv() for _ in range(50)]
    assert len(acks) == 50
    sub = RawClient(broker.port, version=5)
    assert sub.connect("quota-sub", clean_start=False, properties={0x11: 600}).session_present
    got = []
    try:
        while True:
            packet = sub.recv(1.0)
            if isinstance(packet, Publish):
                got.append(int.from_bytes(packet.payload[:2], "big"))
                sub.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
    except TimeoutError:
        pass
    assert got == list(range(40, 50))  # 10 KB = the newest ten 1 KB messages, in order
    _wait_sys(broker.port, "messages/dropped/mqueue_quota", 40)
    publisher.close()
    sub.close()
