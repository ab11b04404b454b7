"""Crash tests of the durability contract (docs/architecture.md, "The durability contract"): the broker runs as a real
subprocess on a real LMDB store and is killed with SIGKILL at random points under load, then restarted on the same
store.

Every message whose PUBACK (QoS 1) or PUBREC (QoS 2) the publisher received must reach each persistent
subscriber at least once, exactly once for QoS 2 end to end, in publish order per publisher.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
from helpers import BrokerProcess, RawClient

from gateway.mqtt.packets import PubAck, PubComp, Publish, PubRec, PubRel, Subscribe, Subscription

SEI = {0x11: 3600}  # Session Expiry Interval for the 5.0 clients


@dataclass
class Publisher:
    """A persistent-session publisher that resumes its QoS 1/2 flows after the broker restarts."""

    name: str
    qos: int
    version: int
    window: int = 16
    next_seq: int = 0
    next_pid: int = 1
    unacked: dict[int, int] = field(default_factory=dict)  # pid -> seq, PUBLISH sent, no PUBACK/PUBREC yet
    await_comp: dict[int, int] = field(default_factory=dict)  # pid -> seq, PUBREC received, PUBREL sent
    acked: list[int] = field(default_factory=list)
    client: RawClient | None = None

    def topic(self) -> str:
        return f"crash/{self.name}"

    def connect(self, port: int) -> None:
        self.client = RawClient(port, version=self.version, timeout=5)
        self.client.connect(self.name, clean_start=False, properties=dict(SEI) if self.version == 5 else {})
        # Resume: re-send unacknowledged PUBLISH with DUP=1, and PUBREL for PUBREC received [MQTT-4.4.0-1].
        for pid, seq in self.unacked.items():
            self.client.send(Publish(self.topic(), f"{self.name}:{seq}".encode(), self.qos, False, True, pid))
        for pid in self.await_comp:
            self.client.send(PubRel(pid))

    def pump(self) -> None:
        assert self.client is not None
        while len(self.unacked) + len(self.await_comp) < self.window:
            pid = self.next_pid
            self.next_pid = pid % 65535 + 1
            seq = self.next_seq
            self.next_seq += 1
            self.unacked[pid] = seq
            self.client.send(Publish(self.topic(), f"{self.name}:{seq}".encode(), self.qos, packet_id=pid))

    def handle(self, packet: object) -> None:
        assert self.client is not None
        if isinstance(packet, PubAck):
            seq = self.unacked.pop(packet.packet_id, None)
            if seq is not None:
                self.acked.append(seq)
        elif isinstance(packet, PubRec):
            seq = self.unacked.pop(packet.packet_id, None)
            if seq is not None:
                self.acked.append(seq)
                self.await_comp[packet.packet_id] = seq
            self.client.send(PubRel(packet.packet_id))
        elif isinstance(packet, PubComp):
            self.await_comp.pop(packet.packet_id, None)


@dataclass
class Subscriber:
    """A persistent-session subscriber that acknowledges like a correct MQTT receiver (MQTT 5.0 §4.3)."""

    name: str
    version: int
    qos: int
    ack_every: int = 1  # slow subscriber: handle one packet per `ack_every` polls
    received: list[tuple[str, int]] = field(default_factory=list)
    pending_rel: set[int] = field(default_factory=set)
    duplicates_dropped: int = 0
    client: RawClient | None = None
    polls: int = 0

    def connect(self, port: int, first: bool = False) -> bool:
        self.client = RawClient(port, version=self.version, timeout=5)
        clean = first and self.version == 5  # 3.1.1 needs Clean Session = 0 to be persistent
        ack = self.client.connect(self.name, clean_start=clean, properties=dict(SEI) if self.version == 5 else {})
        if first:
            self.client.send(Subscribe(1, [Subscription("crash/#", self.qos)]))
            self.client.recv()
        return ack.session_present

    def handle(self, packet: object) -> None:
        assert self.client is not None
        if isinstance(packet, Publish):
            name, seq = packet.payload.decode().split(":")
            if packet.qos == 2:
                if packet.packet_id in self.pending_rel:
                    self.duplicates_dropped += 1  # a re-sent PUBLISH for an identifier awaiting PUBREL
                else:
                    self.received.append((name, int(seq)))
                    self.pending_rel.add(packet.packet_id)  # type: ignore[arg-type]
                self.client.send(PubRec(packet.packet_id))  # type: ignore[arg-type]
            else:
                self.received.append((name, int(seq)))
                if packet.qos == 1:
                    self.client.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
        elif isinstance(packet, PubRel):
            self.pending_rel.discard(packet.packet_id)
            self.client.send(PubComp(packet.packet_id))


def _poll(client: RawClient, handle: object, limit: int = 1000) -> None:
    for _ in range(limit):
        try:
            packet = client.recv(0.001)
        except TimeoutError:
            return
        handle(packet)  # type: ignore[operator]


CONFIG = """
[broker]
sys_interval = 0
[listeners.external]
bind = "127.0.0.1:0"
max_inflight = 4
max_mqueue_len = 0
"""


def _run_crash_scenario(workdir: str, subscribers_online: bool, seed: int, kills: int = 3) -> dict[str, object]:
    rng = random.Random(seed)
    publishers = [Publisher("p311q1", 1, 4), Publisher("p5q1", 1, 5), Publisher("p311q2", 2, 4),
                  Publisher("p5q2", 2, 5)]
    slow = 3 if subscribers_online else 1
    subscribers = [Subscriber("s311q2", 4, 2, slow), Subscriber("s5q2", 5, 2, slow), Subscriber("s5q1", 5, 1, slow)]
    broker = BrokerProcess(CONFIG, workdir=workdir).start()
    try:
        for sub in subscribers:
            sub.connect(broker.port, first=True)
            if not subscribers_online:
                assert sub.client is not None
                sub.client.close()
        for round_no in range(kills + 1):
            for pub in publishers:
                pub.connect(broker.port)
            if subscribers_online and round_no:
                for sub in subscribers:
                    assert sub.connect(broker.port), "a resumed persistent session has Session Present = 1"
            final = round_no == kills
            killer = None
            if not final:
                killer = threading.Timer(rng.uniform(0.3, 1.2), broker.kill)
                killer.start()
            deadline = time.monotonic() + (0.8 if final else 5.0)
            try:
                while time.monotonic() < deadline:
                    for pub in publishers:
                        if not final:
                            pub.pump()
                        assert pub.client is not None
                        _poll(pub.client, pub.handle)
                    if subscribers_online:
                        for sub in subscribers:
                            sub.polls += 1
                            if sub.polls % sub.ack_every == 0:
                                assert sub.client is not None
                                _poll(sub.client, sub.handle, limit=1)
                    if final and not any(p.unacked or p.await_comp for p in publishers):
                        break
            except (ConnectionError, OSError):
                pass  # the broker was killed mid-flow
            if killer is not None:
                killer.join()
                broker.kill()
                for client in [p.client for p in publishers] + [s.client for s in subscribers]:
                    if client is not None:
                        client.close()
                broker = BrokerProcess(CONFIG, workdir=workdir).start()
        # All publisher flows completed on the last broker; now the subscribers drain.
        assert not any(p.unacked or p.await_comp for p in publishers), [(p.name, p.unacked, p.await_comp)
                                                                          for p in publishers]
        for sub in subscribers:
            if not subscribers_online:
                assert sub.connect(broker.port), "a resumed persistent session has Session Present = 1"
            assert sub.client is not None
            quiet_until = time.monotonic() + 2.0
            while time.monotonic() < quiet_until:
                try:
                    sub.handle(sub.client.recv(0.2))
                    quiet_until = time.monotonic() + 1.0
                except TimeoutError:
                    pass
            sub.client.close()
        for pub in publishers:
            assert pub.client is not None
            pub.client.close()
        assert broker.stop() == 0, broker.log()
    finally:
        broker.kill()
    report: dict[str, object] = {}
    for sub in subscribers:
        for pub in publishers:
            got = [seq for name, seq in sub.received if name == pub.name]
            acked = set(pub.acked)
            missing = sorted(acked - set(got))
            duplicates = len(got) - len(set(got))
            firsts: list[int] = []
            seen: set[int] = set()
            for seq in got:
                if seq not in seen:
                    seen.add(seq)
                    firsts.append(seq)
            report[f"{pub.name}->{sub.name}"] = {"acked": len(acked), "delivered": len(got),
                                                 "duplicates": duplicates, "missing": len(missing)}
            assert not missing, f"{pub.name}->{sub.name}: acknowledged but never delivered: {missing[:20]}"
            assert firsts == sorted(firsts), f"{pub.name}->{sub.name}: out of publish order"
            if pub.qos == 2 and sub.qos == 2:
                assert duplicates == 0, f"{pub.name}->{sub.name}: QoS 2 delivered more than once"
    return report


@pytest.mark.slow
@pytest.mark.parametrize("subscribers_online", [False, True], ids=["offline-subscribers", "slow-online-subscribers"])
def test_acknowledged_messages_survive_sigkill(tmp_path: object, subscribers_online: bool) -> None:
    """SIGKILL at random points under load; every acknowledged message is delivered after restart, QoS 2
    exactly once, in order per publisher (docs/architecture.md, "The durability contract")."""
    seed = int(os.environ.get("CRASH_SEED", random.randrange(1 << 30)))
    print(f"crash seed {seed}")
    report = _run_crash_scenario(str(tmp_path), subscribers_online, seed)
    for key, row in report.items():
        print(key, row)
    assert all(row["acked"] > 0 for row in report.values())  # type: ignore[index]
