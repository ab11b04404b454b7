"""What the cloud's answers do to the outbox, in process (gateway/upstream/outbox.py, gateway/upstream/verdicts.py;
docs/upstream.md "When the cloud says no"): the exact PUBLISH size compared with the Maximum Packet Size, the poison
guard that sets aside a message the cloud closes the link on, and PUBACK Reason Codes sorted into final and "retry
later". A fake clock (floats passed as ``now``) and the dict of outbox rows from tests/test_upstream_outbox.py."""

from __future__ import annotations

import dataclasses

import pytest
from test_upstream_outbox import T0, Peer, Rows, config, msg, nums, offer_all

from gateway.mqtt.packets import MQTT_3_1_1, MQTT_5, Publish
from gateway.mqtt.properties import PropertyId as P
from gateway.upstream.outbox import Outbox, PeerLimits, Send
from gateway.upstream.verdicts import NOT_A_MESSAGE, RETRY_LATER, PoisonGuard

LONG_GW = "gw-" + "cabinet-north-substation-feeder-07-riverside-plant-0001"  # 58 characters


def encoded(send: Send, version: int) -> bytes:
    """The PUBLISH for ``send`` as our own codec writes it (Packet Identifier 1)."""
    return Publish(send.topic, send.payload, send.qos, send.retain, False, 1 if send.qos else None,
                   dict(send.properties)).encode(version)


@pytest.mark.parametrize("protocol", [5, 4])
def test_send_size_is_the_encoded_publish(protocol: int) -> None:
    """Send.size is the byte count of the whole PUBLISH as sent (MQTT 5.0 §3.2.2.3.6 "the total number of bytes"):
    fixed header with a 1-4 byte Remaining Length, topic, Packet Identifier, every forwarded property (the
    publisher's User Properties, Content Type, Response Topic, Correlation Data, Payload Format Indicator, the
    remaining Message Expiry Interval, our msg_id), payload; MQTT 3.1.1 carries no properties."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(protocol=protocol, gateway_id=LONG_GW, max_inflight=100), rows)
    ob.link_up(PeerLimits(), T0)
    props = {
        P.USER_PROPERTY: [("site", "x" * 200), ("ünit", "°C")],
        P.CONTENT_TYPE: "application/json",
        P.RESPONSE_TOPIC: "reply/here",
        P.CORRELATION_DATA: b"\x00\x01",
        P.PAYLOAD_FORMAT_INDICATOR: 1,
    }
    for size in (0, 60, 61, 120, 16_300, 16_400, 131_000, 2_097_100):
        for qos in (0, 1, 2):
            message = dataclasses.replace(msg("sensors/größe", b"p" * size, qos), properties=props,
                                          expires_at=T0 + 50)
            assert ob.offer(message, T0)
            plain = msg("sensors/t", b"q" * size, qos)
            assert ob.offer(plain, T0)
    sends = peer.pump(ob, T0)
    assert len(sends) == 48
    for send in sends:
        assert send.size == len(encoded(send, MQTT_5 if protocol == 5 else MQTT_3_1_1))
        if protocol == 5 and send.qos:  # QoS 0 is not stored here (store_qos0 = false): no msg_id
            assert send.properties[P.USER_PROPERTY][-1] == ("msg_id", send.msg_id)
    with_props = [s for s in sends if s.topic.endswith("größe")]
    assert {s.properties.get(P.MESSAGE_EXPIRY_INTERVAL) for s in with_props} == ({50} if protocol == 5 else {None})


def test_only_what_is_over_the_maximum_packet_size_is_dropped() -> None:
    """A PUBLISH of exactly the cloud's Maximum Packet Size goes; one byte more is dropped as packet_too_large,
    whatever part of it (payload, topic, User Property, the msg_id of a long gateway_id) makes the difference."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(protocol=5, gateway_id=LONG_GW), rows)
    limit = 131_072
    ob.link_up(PeerLimits(maximum_packet_size=limit), T0)
    # a probe to learn the size of everything but the payload for this topic and these properties
    probe = dataclasses.replace(msg("sensors/x", b"", 1), properties={P.USER_PROPERTY: [("k", "v" * 200)]})
    assert ob.offer(probe, T0)
    (send,) = peer.pump(ob, T0)
    peer.ack(ob, T0)
    fits = limit - send.size - 1  # the Remaining Length takes 3 bytes instead of 2 past 16,383
    for payload_size in (fits, fits + 1):
        m = dataclasses.replace(msg("sensors/x", b"p" * payload_size, 1), properties=probe.properties)
        assert ob.offer(m, T0)
    sends = peer.pump(ob, T0)
    assert [s.size for s in sends] == [limit]
    assert ob.dropped == {"packet_too_large": 1}


def test_link_max_packet_size_for_3_1_1_and_the_smaller_of_two() -> None:
    """MQTT 3.1.1 announces no Maximum Packet Size: the link's max_packet_size is the limit; on MQTT 5 the smaller
    of it and the cloud's announced one applies."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(protocol=4, max_packet_size=100), rows)
    ob.link_up(PeerLimits(), T0)
    # 3.1.1 QoS 1 PUBLISH: 1 + 1 + 2 + len("fleet/sensors/t") + 2 + payload = 21 + payload bytes
    offer_all(ob, "sensors/t", [b"a" * 79, b"b" * 80], T0)
    assert [s.size for s in peer.pump(ob, T0)] == [100]
    assert ob.dropped == {"packet_too_large": 1}
    ob5 = Outbox(config(protocol=5, max_packet_size=1000), Rows())
    ob5.link_up(PeerLimits(maximum_packet_size=500), T0)
    assert ob5.max_packet == 500
    ob5.link_up(PeerLimits(maximum_packet_size=5000), T0)
    assert ob5.max_packet == 1000
    ob5.link_up(PeerLimits(), T0)
    assert ob5.max_packet == 1000


def test_poison_message_set_aside_after_closes_in_a_row_and_the_rest_flows() -> None:
    """The cloud closes the connection right after a message every time it is sent: after the first close the
    messages that were in flight go one at a time; the one that was alone in flight at poison_closes closes in a row
    is dropped as poison (its row deleted); the others are all sent, in order, and the window opens again."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(poison_closes=3, poison_window=5.0, max_inflight=10), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/bad", [b"poison"], T0)
    offer_all(ob, "sensors/ok", nums("ok", 19), T0)
    t = T0
    assert len(peer.pump(ob, t)) == 10  # the whole window goes
    ob.link_down(t + 0.2, by_message=True)
    for _ in range(3):
        t += 2
        ob.link_up(PeerLimits(), t)
        peer.unacked.clear()
        (send,) = peer.pump(ob, t)  # one at a time: the oldest suspect
        assert send.payload == b"poison" and ob.dropped == {}
        ob.link_down(t + 0.1, by_message=True)
    assert ob.dropped == {"poison": 1}
    assert b"poison" not in rows.payloads() and len(rows.payloads()) == 19
    t += 2
    ob.link_up(PeerLimits(), t)
    peer.unacked.clear()
    sent, batches = [], []
    while len(sent) < 19:
        batch = peer.pump(ob, t)
        assert batch, "the rest must flow"
        sent += [s.payload for s in batch]
        batches.append(len(batch))
        peer.ack(ob, t)
    assert sent == nums("ok", 19)
    assert batches == [1] * 9 + [10]  # ok0..ok8 were in flight beside it: one at a time, then the whole window
    assert rows.payloads() == []


@pytest.mark.parametrize("case", ["gateway_closed", "late_close", "exonerated_then_ack"])
def test_poison_needs_quick_closes_by_the_cloud_in_a_row(case: str) -> None:
    """No message is set aside for a close the gateway made (ack_timeout, stopping), a close long after the send,
    or closes that were not in a row (an acknowledgement or a clean connection in between)."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(poison_closes=2, poison_window=5.0), rows)
    offer_all(ob, "sensors/s", nums("s", 2), T0)
    t = T0
    for i in range(6):
        ob.link_up(PeerLimits(), t)
        peer.unacked.clear()
        peer.pump(ob, t)
        if case == "gateway_closed":
            ob.link_down(t + 0.1, by_message=False)
        elif case == "late_close":
            ob.link_down(t + 6, by_message=True)
        else:
            ob.link_down(t + 0.1, by_message=i % 2 == 0)
        t += 10
    assert ob.dropped == {} and rows.payloads() == nums("s", 2)


def test_poison_guard_alone() -> None:
    """PoisonGuard: several in flight -> suspects, no strike; alone in flight -> a strike; the third in a row
    names the key; a key that left (acknowledged) is no longer a suspect; 0 closes turns it off."""
    guard = PoisonGuard(3, 1.0)
    assert guard.closed([(1, 0.0), (2, 0.5)], 1.0, True) is None and guard.careful
    assert guard.closed([(1, 10.0)], 10.2, True) is None
    assert guard.closed([(1, 20.0)], 20.2, True) is None
    assert guard.closed([(1, 30.0)], 30.2, True) == 1
    assert guard.suspects == {2}
    guard.left(2)
    assert not guard.careful
    off = PoisonGuard(0, 1.0)
    assert all(off.closed([(7, 0.0)], 0.1, True) is None for _ in range(5)) and not off.careful


def test_quota_exceeded_waits_pauses_and_retries_in_order() -> None:
    """PUBACK 0x97 Quota exceeded is "retry later": the message goes back to the head of the backlog with its
    msg_id, every send pauses for backoff_initial (doubling per refusal, back to the start after a success), and
    then it goes again, in order; nothing is dropped, however often."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(backoff_initial=1.0, backoff_max=4.0, max_inflight=1), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/q", nums("q", 3), T0)
    (first,) = peer.pump(ob, T0)
    t = T0
    for pause in (1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0):
        peer.ack(ob, t, code=0x97)
        assert peer.pump(ob, t) == [] and ob.wake_at == pytest.approx(t + pause)
        assert peer.pump(ob, t + pause - 0.01) == []
        t += pause
        (again,) = peer.pump(ob, t)
        assert (again.payload, again.msg_id) == (first.payload, first.msg_id)
    peer.ack(ob, t)  # accepted at last
    assert [s.payload for s in peer.pump(ob, t)] == [b"q1"]
    peer.ack(ob, t, code=0x97)
    assert peer.pump(ob, t) == [] and ob.wake_at == pytest.approx(t + 1.0)  # the backoff starts again
    t += 1.0
    got = []
    while batch := peer.pump(ob, t):
        got += [s.payload for s in batch]
        peer.ack(ob, t)
    assert got == [b"q1", b"q2"] and ob.dropped == {} and rows.payloads() == []
    assert ob.counters["retries"] == 9 and ob.counters["forwarded"] == 3


def test_unspecified_error_retried_a_bounded_number_of_times_other_refusals_final() -> None:
    """PUBACK 0x80 Unspecified error is retried max_retries times, then the message is dropped as rejected; 0x87
    Not authorized, 0x90 Topic Name invalid and 0x99 Payload format invalid are final at once."""
    rows, peer = Rows(), Peer()
    ob = Outbox(config(backoff_initial=0.5, backoff_max=0.5, max_retries=2, max_inflight=1), rows)
    ob.link_up(PeerLimits(), T0)
    offer_all(ob, "sensors/u", [b"u"], T0)
    t = T0
    for _ in range(3):
        t += 1
        (send,) = peer.pump(ob, t)
        assert send.payload == b"u"
        peer.ack(ob, t, code=0x80)
    assert ob.dropped == {"rejected": 1} and ob.counters["retries"] == 2
    for code in (0x87, 0x90, 0x99):
        offer_all(ob, "sensors/u", [bytes([code])], t)
        t += 1
        peer.pump(ob, t)
        peer.ack(ob, t, code=code)
    assert ob.dropped == {"rejected": 4} and ob.counters["retries"] == 2 and rows.payloads() == []
    assert set(RETRY_LATER) == {0x80, 0x97} and 0x95 not in NOT_A_MESSAGE and 0x8E in NOT_A_MESSAGE
