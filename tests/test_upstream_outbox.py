"""The upstream outbox in process (gateway/upstream/outbox.py; docs/upstream.md, "The outbox"): a fake clock (plain
floats passed as ``now``), a dict standing in for the store's outbox rows, no sockets, no sleeps.

A "restart" is a new :class:`Outbox` over the same rows; the cloud is :class:`Peer`, which hands out Packet
Identifiers and acknowledges on request.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

from gateway.broker.message import Message
from gateway.broker.store_port import OutboxRecord
from gateway.upstream.config import ForwardRule, UpstreamConfig
from gateway.upstream.outbox import Outbox, PeerLimits, Send

GW = "gw-o"
T0 = 1_700_000_000.0  # wall-clock seconds
_mids = itertools.count(1)


class Rows:
    """The store's outbox rows (what survives a restart): seq -> record, per link."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, OutboxRecord]] = {}
        self.seq = 1000

    def outbox_seq(self) -> int:
        self.seq += 1
        return self.seq

    def outbox_saved(self, link: str, record: OutboxRecord) -> None:
        self.rows.setdefault(link, {})[record.seq] = record

    def outbox_deleted(self, link: str, seq: int) -> None:
        del self.rows[link][seq]

    def outbox_loaded(self, link: str) -> list[OutboxRecord]:
        return [self.rows[link][seq] for seq in sorted(self.rows.get(link, {}))]

    def payloads(self, link: str = "cloud") -> list[bytes]:
        return [r.message.payload for r in self.outbox_loaded(link)]


class Peer:
    """The cloud side of one connection: takes every Send the outbox allows now, gives Packet Identifiers."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.log: list[tuple[float, Send]] = []  # (when, what) over all connections
        self.unacked: list[int] = []

    def pump(self, ob: Outbox, now: float) -> list[Send]:
        sends = []
        while (send := ob.next_send(now)) is not None:
            packet_id = next(self.ids)
            ob.sent(send, packet_id, now)
            if send.qos:
                self.unacked.append(packet_id)
            self.log.append((now, send))
            sends.append(send)
        return sends

    def ack(self, ob: Outbox, now: float, n: int | None = None, code: int = 0) -> None:
        take = self.unacked[: len(self.unacked) if n is None else n]
        del self.unacked[: len(take)]
        for packet_id in take:
            assert ob.acked(packet_id, code, now)

    def payloads(self) -> list[bytes]:
        return [s.payload for _, s in self.log]


def config(**kw: Any) -> UpstreamConfig:
    kw.setdefault("forward", [ForwardRule("sensors/#", "fleet/{topic}", 2)])
    kw.setdefault("drain_rate", 0.0)
    kw.setdefault("gateway_id", GW)
    return UpstreamConfig("cloud", "mqtt://127.0.0.1", **kw)


def msg(topic: str, payload: bytes, qos: int = 1, at: float = T0, **kw: Any) -> Message:
    return Message(next(_mids), topic, payload, qos, False, {}, at, sender=kw.pop("sender", "pub"), **kw)


def offer_all(ob: Outbox, topic: str, payloads: list[bytes], now: float, qos: int = 1) -> None:
    for p in payloads:
        assert ob.offer(msg(topic, p, qos, now), now)


def nums(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(start, start + n)]


def test_order_per_topic_across_outage_and_restart_rows_reloaded() -> None:
    """Order per remote topic holds across an outage and a gateway restart: what was in flight when the link
    dropped, what was published while down, and what the restarted gateway reloaded from its rows go up oldest
    first, with the msg_ids they had; acknowledged rows are deleted."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    ob.load(T0)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/a", nums("a", 3), T0)
    offer_all(ob, "sensors/b", nums("b", 2), T0)
    first = peer.pump(ob, T0)
    ids = {s.payload: s.msg_id for s in first}
    peer.ack(ob, T0 + 0.1, n=1)  # a0 acknowledged, the rest in flight
    ob.link_down(T0 + 1)
    assert rows.payloads() == [b"a1", b"a2", b"b0", b"b1"]
    offer_all(ob, "sensors/a", nums("a", 2, start=3), T0 + 2)  # while down: backlog
    assert ob.next_send(T0 + 2) is None
    # kill -9: a new outbox over the same rows
    ob2 = Outbox(config(), rows)
    ob2.load(T0 + 10)
    assert len(ob2.entries) == 6 and ob2.bytes == sum(len(p) + len("fleet/sensors/a") for p in rows.payloads())
    offer_all(ob2, "sensors/a", [b"a5"], T0 + 11)
    ob2.link_up(PeerLimits(), T0 + 20)
    peer.unacked.clear()  # a new connection
    again = peer.pump(ob2, T0 + 20)
    assert [s.payload for s in again] == [b"a1", b"a2", b"b0", b"b1", b"a3", b"a4", b"a5"]
    assert all(ids[s.payload] == s.msg_id for s in again if s.payload in ids)  # same msg_id on the re-send
    by_topic = {t: [s.payload for s in again if s.topic == t] for t in ("fleet/sensors/a", "fleet/sensors/b")}
    assert by_topic == {"fleet/sensors/a": nums("a", 5, start=1), "fleet/sensors/b": [b"b0", b"b1"]}
    seqs = [int(s.msg_id.split(":")[1]) for s in again if s.msg_id]
    assert seqs == sorted(seqs) and len(set(seqs)) == 7  # msg_id increases in publish order, never reused
    peer.ack(ob2, T0 + 21)
    assert rows.payloads() == [] and not ob2.entries and ob2.bytes == 0
    assert ob2.counters["forwarded"] == 7


def test_resend_after_reconnect_same_msg_id_same_order() -> None:
    """A lost link puts everything unacknowledged back, in order; after the reconnect the same messages go again
    with the same msg_id (docs/upstream.md: duplicates carry the same id); publish/sent counts both copies."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/x", nums("m", 4), T0)
    before = peer.pump(ob, T0)
    assert len(ob.inflight) == 4
    ob.link_down(T0 + 1)
    assert not ob.inflight and len(ob.entries) == 4
    assert not ob.acked(1, 0, T0 + 1)  # a late PUBACK from the old connection changes nothing
    ob.link_up(PeerLimits(), T0 + 2)
    after = peer.pump(ob, T0 + 2)
    assert [(s.payload, s.msg_id) for s in after] == [(s.payload, s.msg_id) for s in before]
    assert all(s.msg_id and s.msg_id.startswith(f"{GW}:") for s in after)
    peer.unacked = peer.unacked[4:]  # the first connection's are gone
    peer.ack(ob, T0 + 3)
    assert ob.counters["forwarded"] == 4 and ob.counters["publish_sent"] == 8 and ob.counters["connects"] == 2
    assert ob.last_ack_at == T0 + 3


def test_window_full_then_freed_receive_maximum() -> None:
    """At most min(max_inflight, Receive Maximum) QoS 1/2 messages await acknowledgement [MQTT-3.3.4-7]; at zero
    quota no more are sent [MQTT-4.9.0-2]; each acknowledgement frees one slot, in order."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(max_inflight=5), rows)
    ob.link_up(PeerLimits(receive_maximum=3), T0)
    assert ob.window == 3
    offer_all(ob, "sensors/w", nums("w", 6), T0)
    assert [s.payload for s in peer.pump(ob, T0)] == [b"w0", b"w1", b"w2"]
    assert peer.pump(ob, T0 + 1) == []  # window full
    peer.ack(ob, T0 + 2, n=1)
    assert [s.payload for s in peer.pump(ob, T0 + 2)] == [b"w3"]
    peer.ack(ob, T0 + 3, n=3)
    assert [s.payload for s in peer.pump(ob, T0 + 3)] == [b"w4", b"w5"]
    ob.link_down(T0 + 4)
    ob.link_up(PeerLimits(receive_maximum=100), T0 + 5)
    assert ob.window == 5  # max_inflight caps a larger Receive Maximum


def _drain_times(ob: Outbox, peer: Peer, start: float, limit: int = 10_000) -> list[float]:
    """Pump from ``start``, acknowledging at once and jumping the fake clock to each ``wake_at``; the send times."""
    now = start
    for _ in range(limit):
        peer.pump(ob, now)
        peer.ack(ob, now)
        if ob.wake_at is None:
            break
        assert ob.wake_at > now
        now = ob.wake_at
    return [t for t, _ in peer.log]


@pytest.mark.parametrize(
    ("kw", "size", "per_second"),
    [
        ({"drain_rate": 10.0}, 20, 10),
        ({"drain_bytes": 1000}, 100, 10),
        ({"drain_rate": 4.0, "drain_bytes": 5000}, 50, 4),
    ],
)
def test_paced_drain_rate_over_fake_time(kw: dict[str, Any], size: int, per_second: int) -> None:
    """After a reconnect the backlog leaves at drain_rate messages / drain_bytes bytes per second (a token bucket
    with one second's burst, docs/upstream.md "Order and pacing"): 50 messages at 10/s take 4 s after the first
    second's 10, and no second carries more than a second's worth."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(**kw), rows)
    payload_len = size - len("fleet/sensors/p")
    offer_all(ob, "sensors/p", [b"x" * payload_len] * 50, T0)
    ob.link_up(PeerLimits(), T0 + 100)
    times = _drain_times(ob, peer, T0 + 100)
    assert len(times) == 50 and not ob.entries
    assert times[:per_second] == [T0 + 100] * per_second  # the burst
    assert times[-1] - times[0] == pytest.approx((50 - per_second) / per_second, abs=0.01)
    after_burst = times[per_second - 1 :]
    for i in range(len(after_burst) - per_second):  # after the burst, at most a second's worth per second
        assert after_burst[i + per_second] - after_burst[i] >= 1.0 - 1e-6


def test_pacing_survives_a_wall_clock_step_backwards() -> None:
    """``now`` is wall-clock time; a step backwards (NTP) counts as no time passing, so the drain carries on at its
    rate from the new time instead of stalling until the clock catches up."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(drain_rate=1.0), rows)
    offer_all(ob, "sensors/p", nums("p", 3), T0)
    ob.link_up(PeerLimits(), T0)
    assert len(peer.pump(ob, T0)) == 1
    peer.ack(ob, T0)
    assert peer.pump(ob, T0 - 3600) == []  # stepped back an hour: no tokens earned
    assert len(peer.pump(ob, T0 - 3600 + 1.0)) == 1  # one second later (on the new clock): one more


def test_live_first_live_message_goes_ahead_of_backlog() -> None:
    """order = "live_first": a message published while the link is up goes out at once, ahead of the paced
    backlog, even on the backlog's own topic."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(order="live_first", drain_rate=5.0), rows)
    offer_all(ob, "sensors/t", nums("old", 20), T0)
    ob.link_up(PeerLimits(), T0 + 1)
    assert len(peer.pump(ob, T0 + 1)) == 5  # the burst, then paced
    assert ob.wake_at is not None
    assert ob.offer(msg("sensors/t", b"live"), T0 + 1.01)
    assert [s.payload for s in peer.pump(ob, T0 + 1.01)] == [b"live"]
    times = _drain_times(ob, peer, T0 + 1.01)
    sent = peer.payloads()
    assert sent.index(b"live") == 5
    assert [p for p in sent if p != b"live"] == nums("old", 20)  # the backlog keeps its order
    assert times[-1] - times[0] >= (20 - 5) / 5 - 0.01


def test_backlog_first_other_topic_goes_at_once_same_topic_waits_behind_backlog() -> None:
    """order = "backlog_first": a live message for a topic without backlog goes out at once; one for the topic
    with backlog waits behind it (order per topic), unpaced once the older ones went."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(order="backlog_first", drain_rate=5.0), rows)
    offer_all(ob, "sensors/t", nums("old", 12), T0)
    ob.link_up(PeerLimits(), T0 + 1)
    peer.pump(ob, T0 + 1)
    assert ob.offer(msg("sensors/u", b"fresh"), T0 + 1.01)
    assert ob.offer(msg("sensors/t", b"same-topic"), T0 + 1.01)
    assert [s.payload for s in peer.pump(ob, T0 + 1.01)] == [b"fresh"]
    _drain_times(ob, peer, T0 + 1.01)
    sent = peer.payloads()
    assert sent[-1] == b"same-topic"
    assert [p for p in sent if p.startswith(b"old")] == nums("old", 12)


def test_qos0_dropped_while_down_unless_store_qos0() -> None:
    """QoS 0 is forwarded live; while the link is down it is dropped and counted (qos0_link_down), also when it was
    queued as the link dropped; with store_qos0 it waits in the outbox (a row, so it has a msg_id) and is sent at
    QoS 0 after the reconnect. Neither is announced as a bound's warning."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    assert not ob.offer(msg("sensors/q", b"down", 0), T0)
    assert ob.dropped == {"qos0_link_down": 1} and rows.payloads() == []
    ob.link_up(PeerLimits(), T0 + 1)
    assert ob.offer(msg("sensors/q", b"live", 0), T0 + 1)
    assert [(s.payload, s.qos, s.msg_id) for s in peer.pump(ob, T0 + 1)] == [(b"live", 0, None)]
    assert ob.counters["forwarded_qos0"] == 1 and not ob.entries
    assert ob.offer(msg("sensors/q", b"queued", 0), T0 + 2)
    ob.link_down(T0 + 2)  # before the pump ran
    assert ob.dropped == {"qos0_link_down": 2} and not ob.entries
    assert ob.warning(T0 + 3) is None

    kept = Outbox(config(store_qos0=True), rows)
    assert kept.offer(msg("sensors/q", b"stored", 0), T0)
    assert rows.payloads() == [b"stored"]
    kept.link_up(PeerLimits(), T0 + 1)
    (send,) = peer.pump(kept, T0 + 1)
    assert (send.payload, send.qos) == (b"stored", 0) and send.msg_id is not None
    assert rows.payloads() == [] and kept.counters["forwarded_qos0"] == 1 and not kept.dropped


def test_bounds_by_count_then_bytes_with_drop_reasons_and_warnings() -> None:
    """max_messages drops QoS 0 first, then the oldest; max_bytes drops the oldest (a message larger than the
    bound itself is refused); in-flight messages are never the victim; every drop is counted by reason and
    announced at most once a second; the rows go with them."""
    rows = Rows()
    ob = Outbox(config(max_messages=5, store_qos0=True), rows)
    for payload, qos in ((b"m0", 1), (b"m1", 1), (b"m2", 1), (b"z0", 0), (b"m3", 1), (b"m4", 1), (b"m5", 1)):
        assert ob.offer(msg("sensors/c", payload, qos), T0)
    assert rows.payloads() == [b"m1", b"m2", b"m3", b"m4", b"m5"]
    assert ob.dropped == {"max_messages": 2}
    assert ob.warn_due and ob.warning(T0) == "2 max_messages"
    assert ob.offer(msg("sensors/c", b"m6", 1), T0 + 0.5)
    assert ob.warning(T0 + 0.5) is None  # within the second
    assert ob.warning(T0 + 1) == "1 max_messages"

    topic_len = len("fleet/sensors/b")
    sized = Outbox(config(max_bytes=200), rows)
    for i in range(6):
        assert sized.offer(msg("sensors/b", f"b{i}".encode().ljust(50 - topic_len, b"."), 1), T0)
    assert len(sized.entries) == 4 and sized.bytes == 200
    assert [e.message.payload[:2] for e in sized.entries.values()] == [b"b2", b"b3", b"b4", b"b5"]
    assert not sized.offer(msg("sensors/b", b"y" * 300), T0)  # alone over max_bytes
    assert sized.dropped == {"max_bytes": 3}

    peer = Peer()
    busy = Outbox(config(max_messages=3), rows)
    busy.link_up(PeerLimits(receive_maximum=2), T0)
    offer_all(busy, "sensors/i", nums("i", 3), T0)
    peer.pump(busy, T0)  # i0, i1 in flight; i2 queued
    assert busy.offer(msg("sensors/i", b"i3"), T0)
    assert [e.message.payload for e in busy.entries.values()] == [b"i0", b"i1", b"i3"]  # i2 went, not i0/i1


def test_ttl_and_message_expiry_drop_by_age() -> None:
    """message_ttl drops what waited longer (oldest first, on a tick); a message past its own Message Expiry
    Interval is dropped as "expired"; what is sent carries the remaining interval (MQTT 5.0 §3.3.2.3.3)."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(message_ttl=3.0), rows)
    assert ob.offer(msg("sensors/t", b"exp", 1, T0, expires_at=T0 + 2), T0)
    offer_all(ob, "sensors/t", nums("old", 3), T0 + 0.5)
    assert ob.offer(msg("sensors/t", b"keep", 1, T0 + 2.5, expires_at=T0 + 100), T0 + 2.5)
    assert ob.offer(msg("sensors/t", b"exp2", 1, T0 + 2.6, expires_at=T0 + 3.2), T0 + 2.6)
    assert ob.tick(T0 + 2.1) is None
    assert ob.dropped == {"expired": 1}
    ob.tick(T0 + 3.5)
    assert ob.dropped == {"expired": 2, "message_ttl": 3}
    assert rows.payloads() == [b"keep"]
    ob.link_up(PeerLimits(), T0 + 4)
    (send,) = peer.pump(ob, T0 + 4)
    assert send.payload == b"keep" and send.expiry == 96  # ceil(T0 + 100 - (T0 + 4)) s
    assert ob.warning(T0 + 4) == "2 expired, 3 message_ttl"
    assert not ob.offer(msg("sensors/t", b"late", 1, T0, expires_at=T0 + 1), T0 + 5)  # expired on arrival


def test_rejected_by_the_cloud_is_dropped_not_retried() -> None:
    """A PUBACK/PUBCOMP reason code >= 0x80 (e.g. 0x87 Not authorized, MQTT 5.0 §3.4.2.1) drops the message as
    "rejected"; it is not sent again after a reconnect."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/r", [b"no", b"yes"], T0)
    peer.pump(ob, T0)
    peer.ack(ob, T0, n=1, code=0x87)
    peer.ack(ob, T0)
    assert ob.dropped == {"rejected": 1} and ob.counters["forwarded"] == 1 and rows.payloads() == []
    ob.link_down(T0 + 1)
    ob.link_up(PeerLimits(), T0 + 2)
    assert peer.pump(ob, T0 + 2) == []


def test_half_open_teardown_once_after_ack_timeout() -> None:
    """Connected, QoS 1 in flight and no acknowledgement for ack_timeout: tick returns a TearDown (once per
    connection; ack_timeouts counts it); an acknowledgement restarts the wait."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(ack_timeout=5.0), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/h", nums("h", 2), T0)
    peer.pump(ob, T0)
    assert ob.tick(T0 + 4.9) is None
    peer.ack(ob, T0 + 4.9, n=1)
    assert ob.tick(T0 + 9.8) is None
    teardown = ob.tick(T0 + 9.9)
    assert teardown is not None and teardown.reason == "ack_timeout" and teardown.inflight == 1
    assert teardown.silent_for == pytest.approx(5.0)
    assert ob.tick(T0 + 11) is None and ob.counters["ack_timeouts"] == 1
    ob.link_down(T0 + 12)
    assert ob.tick(T0 + 30) is None  # nothing in flight while down


def test_peer_limits_maximum_qos_retain_and_packet_size() -> None:
    """The cloud's Maximum QoS lowers the QoS sent, Retain Available = 0 clears RETAIN, and a message over its
    Maximum Packet Size is dropped as packet_too_large (MQTT 5.0 §3.2.2.3)."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    ob.link_up(PeerLimits(maximum_qos=1, retain_available=False, maximum_packet_size=200), T0)
    retained = dataclasses.replace(msg("sensors/l", b"r", 2), retain=True)
    assert ob.offer(retained, T0)
    assert ob.offer(msg("sensors/l", b"z" * 300, 1), T0)
    (send,) = peer.pump(ob, T0)
    assert (send.payload, send.qos, send.retain) == (b"r", 1, False)
    assert ob.dropped == {"packet_too_large": 1}


def test_send_failed_counts_as_link_down() -> None:
    """When the connection refuses a PUBLISH (socket gone) nothing more is handed out; the message stays, first
    in line for the next connection."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/f", nums("f", 3), T0)
    send = ob.next_send(T0)
    assert send is not None
    ob.send_failed(send, T0)
    assert ob.next_send(T0) is None and not ob.up
    ob.link_up(PeerLimits(), T0 + 1)
    assert [s.payload for s in peer.pump(ob, T0 + 1)] == nums("f", 3)
    assert ob.counters["publish_sent"] == 3


def test_rules_and_loops() -> None:
    """The first matching forward rule decides the remote topic and QoS (min(published, rule)); a message that
    came down from a cloud ($upstream/<name>) is never forwarded back up; no rule: not taken."""
    rows = Rows()
    cfg = config(forward=[ForwardRule("cmd/#", "{topic}", 1), ForwardRule("sensors/+/x", "f/{suffix}", 2)])
    ob = Outbox(cfg, rows)
    assert not ob.offer(msg("cmd/gw/reboot", b"c", 1, sender="$upstream/cloud"), T0)
    assert not ob.offer(msg("other/t", b"o", 1), T0)
    assert ob.offer(msg("cmd/gw/reply", b"c", 2), T0)
    assert ob.offer(msg("sensors/a/x", b"s", 2), T0)
    assert [(r.topic, r.qos) for r in rows.outbox_loaded("cloud")] == [("cmd/gw/reply", 1), ("f/a/x", 2)]
    parent = Outbox(config(forward=[ForwardRule("dev/#", "{topic}", 1)]), rows)
    assert parent.offer(msg("dev", b"p"), T0)  # "#" includes the parent level [MQTT-4.7.1-2]
    assert not parent.offer(msg("device/a", b"p"), T0)


@pytest.mark.parametrize("module", ["outbox.py", "verdicts.py"])
def test_outbox_module_does_no_io(module: str) -> None:
    """outbox.py (and verdicts.py, which it asks) is sans-I/O (docs/upstream.md, "How it is built"): no asyncio,
    aiomqtt, paho, socket, lmdb or time imports."""
    tree = ast.parse((Path(ROOT) / "gateway" / "upstream" / module).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "aiomqtt", "paho", "socket", "lmdb", "time", "selectors", "threading"}
