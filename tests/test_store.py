"""The LMDB store behind persistent sessions (README, "The store"; docs/architecture.md, "The durability contract"),
tested on real broker subprocesses and real LMDB files.

- Restart restores everything: persistent sessions (3.1.1 Clean Session 0, 5.0 Session Expiry Interval > 0) with
  their subscriptions and options, queued messages in order, retained messages, and QoS 2 flows half-way through in
  both directions. The restart is a SIGTERM or a SIGKILL (both variants of one module-scoped scenario).
- A full store (``max_size = "4MB"``) refuses new QoS 1/2 work (0x97 / disconnect) but keeps serving and never loses
  what it already acknowledged.
- Session and message expiry count while the broker is down.
- A corrupt store is quarantined (or the broker refuses to start with ``on_corrupt = "refuse"``).
- ``edge-gateway store stats|inspect|compact``.

A QoS 1/2 acknowledgement is sent only once everything the message caused is committed, and the store reports
the commit barriers they wait on in order: so once a client has its PUBACK/PUBREC/PUBCOMP/SUBACK, everything recorded
before it survives a SIGKILL. The tests wait for those acknowledgements before restarting.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, RawClient

from gateway.mqtt.packets import (
    Connack,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Suback,
    Subscribe,
    Subscription,
)
from gateway.mqtt.properties import PropertyId as P

CONFIG = """
[broker]
sys_interval = 0

[store]
commit_interval = "2ms"

[listeners.external]
bind = "127.0.0.1:0"
"""

SEI = 3600  # Session Expiry Interval of the 5.0 persistent sessions
QUIET = 0.4  # how long "nothing more arrives" is listened for


# ------------------------------------------------------------------------------------------------ helpers


class Clients:
    """Opens RawClients and closes every one of them at the end."""

    def __init__(self) -> None:
        self.opened: list[RawClient] = []

    def connect(self, port: int, client_id: str, version: int = 5, clean: bool = False,
                expiry: int | None = SEI) -> tuple[RawClient, Connack]:
        """CONNECT ``client_id``. 5.0: Clean Start ``clean`` and Session Expiry Interval ``expiry`` (None = absent);
        3.1.1: Clean Session ``clean`` (``expiry`` unused)."""
        client = RawClient(port, version=version)
        self.opened.append(client)
        props: dict[int, Any] = {}
        if version == 5 and expiry is not None:
            props[P.SESSION_EXPIRY_INTERVAL] = expiry
        connack = client.connect(client_id, clean_start=clean, properties=props)
        assert connack.reason_code == 0, connack
        return client, connack

    def close_all(self) -> None:
        for client in self.opened:
            client.close()
        self.opened.clear()


@pytest.fixture
def clients() -> Iterator[Clients]:
    """RawClients closed at the end of the test."""
    pool = Clients()
    yield pool
    pool.close_all()


def subscribe(client: RawClient, packet_id: int, subs: list[Subscription], sub_id: int | None = None) -> None:
    """SUBSCRIBE (with an optional Subscription Identifier) and check every filter is granted its QoS."""
    props = {P.SUBSCRIPTION_IDENTIFIER: [sub_id]} if sub_id is not None else {}
    client.send(Subscribe(packet_id, subs, props))
    suback = client.recv()
    assert isinstance(suback, Suback) and suback.packet_id == packet_id, suback
    assert suback.reason_codes == [s.qos for s in subs], suback


def disconnect(client: RawClient) -> None:
    """A normal DISCONNECT; wait until the broker has closed the connection (so it has detached the session)."""
    client.send(Disconnect())
    assert client.closed_by_server()
    client.close()


_pids = itertools.count(1)


def publish(client: RawClient, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
            props: dict[int, Any] | None = None, expect: int = 0) -> int:
    """Publish and complete the QoS 1/2 flow; the PUBACK/PUBREC reason code must be ``expect``. Returns the
    Packet Identifier used."""
    pid = next(_pids) % 65535 + 1
    client.send(Publish(topic, payload, qos, retain, packet_id=pid if qos else None, properties=props or {}))
    if qos == 1:
        ack = client.recv()
        assert isinstance(ack, PubAck) and ack.packet_id == pid and ack.reason_code == expect, ack
    elif qos == 2:
        rec = client.recv()
        assert isinstance(rec, PubRec) and rec.packet_id == pid and rec.reason_code == expect, rec
        client.send(PubRel(pid))
        comp = client.recv()
        assert isinstance(comp, PubComp) and comp.packet_id == pid and comp.reason_code == 0, comp
    else:
        client.send(PingReq())
        assert isinstance(client.recv(), PingResp)
    return pid


def drain(client: RawClient, quiet: float = QUIET) -> list[Publish]:
    """Receive PUBLISH packets until none arrives for ``quiet`` seconds, acknowledging each like a correct receiver
    (PUBACK; PUBREC then PUBCOMP on PUBREL). Anything but PUBLISH/PUBREL fails the test."""
    got: list[Publish] = []
    while True:
        try:
            packet = client.recv(quiet)
        except TimeoutError:
            return got
        if isinstance(packet, Publish):
            got.append(packet)
            if packet.qos == 1:
                client.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
            elif packet.qos == 2:
                client.send(PubRec(packet.packet_id))  # type: ignore[arg-type]
        elif isinstance(packet, PubRel):
            client.send(PubComp(packet.packet_id))
        else:
            raise AssertionError(f"unexpected {packet}")


def quiet(client: RawClient, seconds: float = QUIET) -> list[Packet]:
    """Every packet that arrives within ``seconds`` (nothing is acknowledged)."""
    return client.recv_all(seconds)


def store_cli(workdir: Path, action: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``edge-gateway store ACTION --config gateway.toml`` run in the broker's working directory."""
    return subprocess.run([sys.executable, "-m", "gateway", "store", action, "--config", "gateway.toml", *extra],
                          cwd=workdir, capture_output=True, text=True, timeout=60)


def store_stats(workdir: Path) -> dict[str, Any]:
    """``store stats --json`` as a dict."""
    result = store_cli(workdir, "stats", "--json")
    assert result.returncode == 0, result.stderr
    stats: dict[str, Any] = json.loads(result.stdout)
    return stats


def log_lines(broker: BrokerProcess, text: str, timeout: float = 5.0) -> list[str]:
    """The broker's log lines containing ``text``, waiting until there is one (stderr is read by a thread)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in list(broker.lines) if text in line]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def sleep_until(deadline: float) -> None:
    """Wait until wall-clock ``deadline`` (expiry deadlines are wall-clock seconds)."""
    while time.time() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.time())))


# ------------------------------------------------------------------------------------------------ restart


class Scenario:
    """State built before the restart, and the restarted broker."""

    def __init__(self, mode: str, workdir: Path) -> None:
        self.mode = mode
        self.workdir = workdir
        self.broker: BrokerProcess | None = None
        self.exit_code: int | None = None
        self.pids: dict[str, int] = {}

    @property
    def port(self) -> int:
        assert self.broker is not None
        return self.broker.port


def _before_restart(port: int, pool: Clients, sc: Scenario) -> None:
    """Persistent sessions with subscriptions and queues, retained messages, and QoS 1/2 flows left half-way."""
    # A 3.1.1 Clean Session 0 subscriber, offline.
    s311, ack = pool.connect(port, "s311", version=4, clean=False)
    assert ack.session_present is False
    subscribe(s311, 1, [Subscription("q311/#", 1)])
    disconnect(s311)
    # A 5.0 subscriber with subscription options and Subscription Identifiers, offline.
    s5, ack = pool.connect(port, "s5", clean=True)
    subscribe(s5, 1, [Subscription("opt/nl", 1, no_local=True)], sub_id=7)
    subscribe(s5, 2, [Subscription("opt/rap", 2, retain_as_published=True)], sub_id=9)
    subscribe(s5, 3, [Subscription("opt/norap", 2)])
    disconnect(s5)
    # Subscribers for the inbound QoS 2 flows (offline) and the outbound ones (online, mid-flow).
    iqsub, _ = pool.connect(port, "iqsub", clean=True)
    subscribe(iqsub, 1, [Subscription("inq/#", 2)])
    disconnect(iqsub)
    outs = {}
    for cid, version in (("oq5", 5), ("oq311", 4)):
        client, _ = pool.connect(port, cid, version=version, clean=version == 5)
        subscribe(client, 1, [Subscription("outq/#", 2), Subscription(f"outq-{cid}/#", 2)])
        outs[cid] = client
    oq1, _ = pool.connect(port, "oq1", clean=True)
    subscribe(oq1, 1, [Subscription("outq1/#", 1)])

    pub, _ = pool.connect(port, "pub", clean=True, expiry=None)
    for i in range(5):
        publish(pub, "q311/a", f"m{i}".encode(), qos=1)
    publish(pub, "q311/a", b"m5", qos=2)  # delivered at QoS 1 (the subscription's)
    publish(pub, "opt/rap", b"r-rap", qos=2, retain=True)
    publish(pub, "opt/norap", b"r-norap", qos=1, retain=True)
    publish(pub, "ret/x", b"kept", qos=1, retain=True, expect=0x10)

    # Inbound QoS 2: PUBLISH answered by PUBREC, PUBREL not sent yet.
    for cid, version, pid in (("iq5", 5, 10), ("iq311", 4, 11)):
        client, _ = pool.connect(port, cid, version=version, clean=version == 5)
        client.send(Publish(f"inq/{cid}", f"once-{cid}".encode(), 2, packet_id=pid))
        rec = client.recv()
        assert isinstance(rec, PubRec) and rec.packet_id == pid and rec.reason_code == 0, rec

    # Outbound QoS 2: PUBLISH received, PUBREC sent, PUBREL received; PUBCOMP not sent yet.
    publish(pub, "outq/x", b"out-once", qos=2)
    for cid, client in outs.items():
        packet = client.recv()
        assert isinstance(packet, Publish) and packet.qos == 2 and packet.payload == b"out-once", packet
        assert packet.packet_id is not None
        client.send(PubRec(packet.packet_id))
        rel = client.recv()
        assert isinstance(rel, PubRel) and rel.packet_id == packet.packet_id, rel
        sc.pids[cid] = packet.packet_id
    # Outbound QoS 1: PUBLISH received, PUBACK not sent.
    publish(pub, "outq1/x", b"unacked", qos=1)
    packet = oq1.recv()
    assert isinstance(packet, Publish) and packet.qos == 1 and packet.dup is False, packet
    assert packet.packet_id is not None
    sc.pids["oq1"] = packet.packet_id
    # Barrier: this PUBACK is sent only after everything recorded before it is committed (FIFO callbacks).
    publish(pub, "barrier", b"", qos=1, expect=0x10)


@pytest.fixture(scope="module", params=["sigterm", "sigkill"])
def restarted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """Build sessions, queues, retained messages and half-done QoS 2 flows, restart the broker on the same store
    (SIGTERM or SIGKILL), and hand the restarted broker to the tests."""
    sc = Scenario(request.param, tmp_path_factory.mktemp(f"restart-{request.param}"))
    first = BrokerProcess(CONFIG, workdir=str(sc.workdir)).start()
    pool = Clients()
    try:
        _before_restart(first.port, pool, sc)
        if sc.mode == "sigterm":
            sc.exit_code = first.stop()
        else:
            first.kill()
            assert first.proc is not None
            sc.exit_code = first.proc.returncode
    finally:
        first.kill()
        pool.close_all()
    sc.broker = BrokerProcess(CONFIG, workdir=str(sc.workdir)).start()
    yield sc
    code = sc.broker.stop()
    assert code == 0, sc.broker.log()


def test_shutdown_exit_code_and_restored_state_logged(restarted: Scenario) -> None:
    """SIGTERM with queued persistent messages is a clean stop (exit 0); the restarted broker logs
    that it restored the sessions and retained messages. (SIGKILL: the process died of signal 9.)"""
    assert restarted.exit_code == (0 if restarted.mode == "sigterm" else -9)
    assert restarted.broker is not None
    # s311, s5, iqsub, oq5, oq311, oq1, iq5, iq311; retained: opt/rap, opt/norap, ret/x.
    assert log_lines(restarted.broker, "restored 8 persistent sessions and 3 retained messages from the store"), \
        restarted.broker.log()


def test_mqtt_3_1_2_5_311_clean_session_0_queue_survives_restart_in_order(restarted: Scenario,
                                                                           clients: Clients) -> None:
    """3.1.1 MQTT-3.1.2-5 (QoS 1/2 messages stored for a disconnected Clean Session 0 session) and MQTT-3.2.2-2
    (Session Present 1) across a restart; MQTT-4.6.0-6 order kept; the subscription made before the restart
    still matches messages published after it."""
    s311, ack = clients.connect(restarted.port, "s311", version=4, clean=False)
    assert ack.session_present is True
    got = drain(s311)
    assert [(p.topic, p.payload, p.qos, p.dup) for p in got] == \
        [("q311/a", f"m{i}".encode(), 1, False) for i in range(6)]
    pub, _ = clients.connect(restarted.port, "pub-311", version=4, clean=True)
    publish(pub, "q311/after", b"after-restart", qos=1)
    got = drain(s311)
    assert [(p.topic, p.payload, p.qos) for p in got] == [("q311/after", b"after-restart", 1)]


def test_mqtt_3_1_2_5_v5_session_and_subscription_options_survive_restart(restarted: Scenario,
                                                                          clients: Clients) -> None:
    """MQTT-3.1.2-5 (Clean Start 0 resumes the Session), MQTT-3.2.2-3 (Session Present 1) after a restart, with the
    subscription options intact: QoS (MQTT-3.8.4-8 delivered QoS = min), No Local (MQTT-3.8.3-3), Retain As
    Published (MQTT-3.3.1-12/-13) and Subscription Identifiers (MQTT-3.3.4-3)."""
    s5, ack = clients.connect(restarted.port, "s5")
    assert ack.session_present is True
    queued = drain(s5)
    assert [(p.topic, p.payload, p.qos, p.retain, p.properties.get(P.SUBSCRIPTION_IDENTIFIER)) for p in queued] == [
        ("opt/rap", b"r-rap", 2, True, [9]),
        ("opt/norap", b"r-norap", 1, False, None),
    ]
    # No Local: its own message is not sent back; another client's is, at the subscription's QoS 1.
    publish(s5, "opt/nl", b"own", qos=1, expect=0x10)  # routed to nobody
    other, _ = clients.connect(restarted.port, "s5-other", clean=True, expiry=None)
    publish(other, "opt/nl", b"other", qos=2)
    publish(other, "opt/rap", b"rap-new", qos=1, retain=True)
    publish(other, "opt/norap", b"norap-new", qos=1, retain=True)
    got = drain(s5)
    assert [(p.topic, p.payload, p.qos, p.retain, p.properties.get(P.SUBSCRIPTION_IDENTIFIER)) for p in got] == [
        ("opt/nl", b"other", 1, False, [7]),
        ("opt/rap", b"rap-new", 1, True, [9]),
        ("opt/norap", b"norap-new", 1, False, None),
    ]


def test_mqtt_3_3_1_5_retained_message_survives_restart(restarted: Scenario, clients: Clients) -> None:
    """5.0 MQTT-3.3.1-5 (a retained message is stored for future subscribers) and MQTT-3.3.1-9 (sent on subscribe
    with Retain Handling 0, RETAIN 1 per MQTT 5.0 §3.3.1.3), also across a restart."""
    sub, _ = clients.connect(restarted.port, "ret-sub", clean=True, expiry=None)
    subscribe(sub, 1, [Subscription("ret/#", 1)])
    got = drain(sub)
    assert [(p.topic, p.payload, p.qos, p.retain) for p in got] == [("ret/x", b"kept", 1, True)]


@pytest.mark.parametrize("cid,version,pid", [("iq5", 5, 10), ("iq311", 4, 11)], ids=["v5", "v311"])
def test_mqtt_4_3_3_10_inbound_qos2_awaiting_pubrel_survives_restart(restarted: Scenario, clients: Clients,
                                                                     cid: str, version: int, pid: int) -> None:
    """5.0 MQTT-4.3.3-10/-11 (3.1.1 MQTT-4.3.3-2) across a restart: the broker PUBRECed a QoS 2 PUBLISH, restarted;
    the publisher resumes its session (Session Present 1), a re-sent PUBLISH with that Packet Identifier is answered
    with PUBREC and not delivered again, PUBREL gets PUBCOMP 0x00, and the subscriber gets the message exactly once."""
    sub, ack = clients.connect(restarted.port, "iqsub")
    assert ack.session_present is True
    pub, ack = clients.connect(restarted.port, cid, version=version)
    assert ack.session_present is True
    pub.send(Publish(f"inq/{cid}", f"once-{cid}".encode(), 2, dup=True, packet_id=pid))
    rec = pub.recv()
    assert isinstance(rec, PubRec) and rec.packet_id == pid and rec.reason_code == 0, rec
    pub.send(PubRel(pid))
    comp = pub.recv()
    assert isinstance(comp, PubComp) and comp.packet_id == pid and comp.reason_code == 0, comp
    got = drain(sub)
    assert [(p.topic, p.payload, p.qos) for p in got] == [(f"inq/{cid}", f"once-{cid}".encode(), 2)]


@pytest.mark.parametrize("cid,version", [("oq5", 5), ("oq311", 4)], ids=["v5", "v311"])
def test_mqtt_4_4_0_1_outbound_pubrel_resent_after_restart(restarted: Scenario, clients: Clients, cid: str,
                                                           version: int) -> None:
    """MQTT-4.4.0-1 (resend unacknowledged PUBREL with the original identifier) and 5.0 MQTT-4.3.3-6 / 3.1.1
    MQTT-4.3.3-1 (never re-send the PUBLISH after PUBREL) across a restart: the subscriber had PUBRECed and got
    PUBREL; on resume the broker re-sends PUBREL, not the PUBLISH."""
    client, ack = clients.connect(restarted.port, cid, version=version)
    assert ack.session_present is True
    pid = restarted.pids[cid]
    packets = quiet(client)
    assert packets == [PubRel(pid)], packets
    client.send(PubComp(pid))
    assert quiet(client) == []
    # The session goes on: a new message is a new flow (DUP 0).
    pub, _ = clients.connect(restarted.port, f"{cid}-pub", clean=True, expiry=None)
    publish(pub, f"outq-{cid}/y", b"next", qos=2)
    got = drain(client)
    assert [(p.topic, p.payload, p.qos, p.dup) for p in got] == [(f"outq-{cid}/y", b"next", 2, False)]


def test_mqtt_4_4_0_1_unacknowledged_qos1_resent_with_dup_after_restart(restarted: Scenario,
                                                                        clients: Clients) -> None:
    """MQTT-4.4.0-1 and MQTT-3.3.1-1 (DUP 1 on a re-delivery) across a restart: a QoS 1 PUBLISH sent but never
    PUBACKed is re-sent with its original Packet Identifier and DUP 1, once."""
    client, ack = clients.connect(restarted.port, "oq1")
    assert ack.session_present is True
    got = drain(client)
    assert [(p.topic, p.payload, p.qos, p.dup, p.packet_id) for p in got] == \
        [("outq1/x", b"unacked", 1, True, restarted.pids["oq1"])]


# ------------------------------------------------------------------------------------------------ store full


FULL_CONFIG = """
[broker]
sys_interval = "1s"

[store]
max_size = "4MB"

[listeners.external]
bind = "127.0.0.1:0"
"""

BIG = 256 * 1024


class PahoClient:
    """A paho-mqtt 2.x client on its network thread, collecting messages."""

    def __init__(self, port: int, client_id: str, protocol: Any = mqtt.MQTTv5) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self.connected = threading.Event()
        self.subacks: set[int] = set()
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        self.client.on_connect = lambda _c, _u, _f, rc, _p=None: self.connected.set() if rc == 0 else None
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda _c, _u, mid, _codes, _p: self.subacks.add(mid)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.connected.wait(5), "paho did not connect"

    def subscribe(self, topic: str, qos: int = 0) -> None:
        """SUBSCRIBE and wait for the SUBACK."""
        _rc, mid = self.client.subscribe(topic, qos)
        deadline = time.monotonic() + 5
        while mid not in self.subacks:
            assert time.monotonic() < deadline, f"no SUBACK for {topic}"
            time.sleep(0.01)

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append(msg)

    def wait_for(self, predicate: Callable[[list[mqtt.MQTTMessage]], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(list(self.messages)):
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def sys_value(paho: PahoClient, name: str, expected: str, timeout: float = 5.0) -> str | None:
    """Wait until ``$SYS/broker/<name>`` reads ``expected``; return the last value seen."""
    topic = f"$SYS/broker/{name}"
    last: list[str | None] = [None]

    def check(msgs: list[mqtt.MQTTMessage]) -> bool:
        for m in msgs:
            if m.topic == topic:
                last[0] = m.payload.decode()
        return last[0] == expected

    paho.wait_for(check, timeout)
    return last[0]


def test_store_full_refuses_new_work_keeps_serving_and_loses_nothing(tmp_path: Path, clients: Clients) -> None:
    """The store quota: with ``max_size = "4MB"`` and a persistent offline subscriber, large QoS 1 messages
    are accepted until the store is full; then a 5.0 publisher gets PUBACK 0x97 Quota exceeded (MQTT 5.0 §3.4.2.1)
    and PUBREC 0x97, a 3.1.1 QoS 1 publisher is disconnected without a PUBACK; QoS 0 for the offline session is
    dropped and a retained QoS 0 message is kept in memory only (neither may overflow the store). The broker logs
    "store full", counts it in $SYS, keeps serving, and every acknowledged message is delivered when the subscriber
    drains; after that, space is reused."""
    broker = BrokerProcess(FULL_CONFIG, workdir=str(tmp_path)).start()
    watchers: list[PahoClient] = []
    try:
        port = broker.port
        sub, _ = clients.connect(port, "full-sub", clean=True)
        subscribe(sub, 1, [Subscription("big/#", 1)])
        disconnect(sub)
        pub5, _ = clients.connect(port, "full-pub5", clean=True, expiry=None)
        acked: list[int] = []
        for i in range(1, 40):
            pid = i
            pub5.send(Publish("big/x", bytes([i]) * BIG, 1, packet_id=pid))
            ack = pub5.recv()
            assert isinstance(ack, PubAck) and ack.packet_id == pid, ack
            if ack.reason_code:
                assert ack.reason_code == 0x97, ack
                break
            acked.append(i)
        else:
            raise AssertionError("a 4MB store never refused 39 x 256 KB")
        assert 4 <= len(acked) <= 14, acked  # 4 MB minus the 2 MB headroom, in 256 KB messages
        assert len(log_lines(broker, "ERROR gateway.store: store full: ")) == 1, broker.log()
        # QoS 2 is refused the same way, at PUBREC.
        pub5.send(Publish("big/x", b"q2" * 1000, 2, packet_id=100))
        rec = pub5.recv()
        assert isinstance(rec, PubRec) and rec.packet_id == 100 and rec.reason_code == 0x97, rec
        # QoS 0 to the offline persistent session: published, but not stored.
        for _ in range(12):
            publish(pub5, "big/x", b"\x00" * BIG, qos=0)
        # Retained QoS 0 while full: retained (in memory, MQTT-3.3.1-5), but it must not overflow the store either.
        for i in range(12):
            publish(pub5, f"bigret/{i}", bytes([i]) * BIG, qos=0, retain=True)
        ret_sub, _ = clients.connect(port, "full-ret-sub", clean=True, expiry=None)
        subscribe(ret_sub, 1, [Subscription("bigret/11", 0)])
        assert [(p.topic, p.payload, p.retain) for p in drain(ret_sub)] == [("bigret/11", b"\x0b" * BIG, True)]
        # 3.1.1: no PUBACK, the connection is closed.
        p311, _ = clients.connect(port, "full-pub311", version=4, clean=True)
        p311.send(Publish("big/x", b"y" * BIG, 1, packet_id=1))
        assert p311.closed_by_server()
        assert bytes(p311.raw_received) == b"\x20\x02\x00\x00"  # the CONNACK and nothing else
        assert log_lines(broker, "(full-pub311): store full; QoS 1 PUBLISH not acknowledged, disconnecting"), \
            broker.log()
        # Still serving: a new client connects, QoS 0 flows between online clients.
        live = PahoClient(port, "full-live")
        watchers.append(live)
        live.subscribe("live/#")
        live.subscribe("$SYS/broker/messages/dropped/#")
        live.subscribe("$SYS/broker/publish/messages/dropped")
        publish(pub5, "live/t", b"still-serving", qos=0)
        assert live.wait_for(lambda ms: any(m.topic == "live/t" and m.payload == b"still-serving" for m in ms))
        assert sys_value(live, "messages/dropped/store_full", "3") == "3"
        assert sys_value(live, "messages/dropped/store_full_qos0", "12") == "12"
        # One drop per refused message (not also counted as "quota_exceeded").
        assert sys_value(live, "publish/messages/dropped", "15") == "15"
        # Drain: every acknowledged message, in order, nothing else.
        sub, ack = clients.connect(port, "full-sub")
        assert ack.session_present is True
        got = drain(sub, quiet=1.0)
        assert [(p.payload[0], len(p.payload), p.qos) for p in got] == [(i, BIG, 1) for i in acked]
        disconnect(sub)
        # Space is reusable: as many messages fit again.
        for i in range(len(acked)):
            publish(pub5, "big/y", bytes([i]) * BIG, qos=1)
    finally:
        for watcher in watchers:
            watcher.close()
        code = broker.stop()
    assert code == 0, broker.log()


# ------------------------------------------------------------------------------------------------ expiry


def test_mqtt_4_1_0_2_session_and_message_expiry_count_while_stopped(tmp_path: Path, clients: Clients) -> None:
    """5.0 MQTT-4.1.0-2 (Session State discarded once the Session Expiry Interval passed), MQTT-3.2.2-3 (Session
    Present 0 then) and MQTT-3.3.2-5 (an expired queued message is not delivered) when the time passes while the
    broker is stopped; an expired retained message is gone too; ``store stats`` shows the session count drop."""
    # Expiry intervals of 6-7 s: the broker's stop and `store stats` (a new process) must come before them, also on a
    # loaded machine (2 s was too short for a run beside other test files).
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        port = broker.port
        short, _ = clients.connect(port, "exp-short", clean=True, expiry=7)
        subscribe(short, 1, [Subscription("exp/#", 1)])
        keep, _ = clients.connect(port, "exp-keep", clean=True)
        subscribe(keep, 1, [Subscription("mexp/#", 1)])
        disconnect(keep)
        disconnect(short)
        gone_at = time.time() + 7.0
        pub, _ = clients.connect(port, "exp-pub", clean=True, expiry=None)
        publish(pub, "exp/a", b"for-short", qos=1)
        first_expiry = time.time() + 6.0
        publish(pub, "mexp/short", b"expires", qos=1, props={P.MESSAGE_EXPIRY_INTERVAL: 6})
        publish(pub, "mexp/long", b"stays", qos=1)
        publish(pub, "rexp/short", b"r-expires", qos=1, retain=True, props={P.MESSAGE_EXPIRY_INTERVAL: 6},
                expect=0x10)
        publish(pub, "rexp/long", b"r-stays", qos=1, retain=True, expect=0x10)
        msg_gone_at = time.time() + 6.0
    finally:
        code = broker.stop()
    assert code == 0, broker.log()
    before = store_stats(tmp_path)
    assert time.time() < first_expiry, "too slow: stats ran after the Message Expiry Interval had passed"
    assert (before["sessions"], before["queue_entries"], before["retained_entries"]) == (2, 3, 2)
    sleep_until(max(gone_at, msg_gone_at) + 0.3)
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        port = broker.port
        assert log_lines(broker, "store: removed 1 expired sessions and 3 expired messages on start"), broker.log()
        short, ack = clients.connect(port, "exp-short", clean=False, expiry=0)
        assert ack.session_present is False
        assert quiet(short) == []
        pub, _ = clients.connect(port, "exp-pub", clean=True, expiry=None)
        publish(pub, "exp/b", b"nobody", qos=1, expect=0x10)  # the old subscription is gone: No matching subscribers
        keep, ack = clients.connect(port, "exp-keep")
        assert ack.session_present is True
        got = drain(keep)
        assert [(p.topic, p.payload) for p in got] == [("mexp/long", b"stays")]
        sub, _ = clients.connect(port, "exp-ret", clean=True, expiry=None)
        subscribe(sub, 1, [Subscription("rexp/#", 1)])
        got = drain(sub)
        assert [(p.topic, p.payload, p.retain) for p in got] == [("rexp/long", b"r-stays", True)]
        clients.close_all()
    finally:
        code = broker.stop()
    assert code == 0, broker.log()
    after = store_stats(tmp_path)
    assert (after["sessions"], after["queue_entries"], after["retained_entries"]) == (1, 0, 1)


# ------------------------------------------------------------------------------------------------ corruption


def _make_store_with_session(workdir: Path, config: str, clients: Clients) -> None:
    broker = BrokerProcess(config, workdir=str(workdir)).start()
    try:
        client, _ = clients.connect(broker.port, "corrupt-me", clean=True)
        subscribe(client, 1, [Subscription("c/#", 1)])
        disconnect(client)
    finally:
        code = broker.stop()
    assert code == 0, broker.log()


def _corrupt(data_file: Path) -> bytes:
    """Overwrite the first 16 KB (both meta pages and more) with random bytes; return them."""
    garbage = random.Random(20240611).randbytes(16 * 1024)
    with data_file.open("r+b") as f:
        f.write(garbage)
    return garbage


def test_corrupt_store_is_quarantined_and_broker_starts_empty(tmp_path: Path, clients: Clients) -> None:
    """A store that cannot be opened is moved aside to ``<path>.corrupt-<timestamp>``, logged loudly
    (naming that directory), and the broker starts with an empty store and serves."""
    _make_store_with_session(tmp_path, CONFIG, clients)
    garbage = _corrupt(tmp_path / "var" / "data.mdb")
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        moved = sorted(tmp_path.glob("var.corrupt-*"))
        assert len(moved) == 1, moved
        assert (moved[0] / "data.mdb").read_bytes()[:16 * 1024] == garbage
        loud = log_lines(broker, "STORE CORRUPT")
        assert len(loud) == 1, broker.log()
        assert "CRITICAL" in loud[0] and f"moved aside to {moved[0].name}" in loud[0], loud
        assert (tmp_path / "var" / "data.mdb").exists()
        client, ack = clients.connect(broker.port, "corrupt-me")
        assert ack.session_present is False
        subscribe(client, 1, [Subscription("c/#", 1)])
        pub, _ = clients.connect(broker.port, "corrupt-pub", clean=True, expiry=None)
        publish(pub, "c/x", b"works", qos=1)
        assert [(p.topic, p.payload) for p in drain(client)] == [("c/x", b"works")]
    finally:
        clients.close_all()
        code = broker.stop()
    assert code == 0, broker.log()


REFUSE_CONFIG = """
[broker]
sys_interval = 0

[store]
on_corrupt = "refuse"

[listeners.external]
bind = "127.0.0.1:0"
"""


def test_corrupt_store_with_on_corrupt_refuse_exits_74(tmp_path: Path, clients: Clients) -> None:
    """``store.on_corrupt = "refuse"``: a corrupt store makes ``serve`` exit 74 (EX_IOERR) with one
    clear line and no traceback, and leaves the store where it is."""
    _make_store_with_session(tmp_path, REFUSE_CONFIG, clients)
    garbage = _corrupt(tmp_path / "var" / "data.mdb")
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", "gateway.toml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 74, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "cannot be opened" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("edge-gateway: store var cannot be opened: ")
    assert lines[0].endswith('refusing to start (store.on_corrupt = "refuse")')
    assert list(tmp_path.glob("var.corrupt-*")) == []
    assert (tmp_path / "var" / "data.mdb").read_bytes()[:16 * 1024] == garbage


# ------------------------------------------------------------------------------------------------ tools


def test_acknowledgements_in_one_write_leave_no_rows(tmp_path: Path, clients: Clients) -> None:
    """A delivery's queue row and its message row go once the delivery is acknowledged. A persistent
    subscriber acknowledges whole windows in one write each (the broker reads such runs of PUBACKs in one go);
    after a clean stop the store holds its session and subscription but no queue or message rows."""
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        sub, _ = clients.connect(broker.port, "runs")
        subscribe(sub, 1, [Subscription("runs/t", 1)])
        disconnect(sub)
        pub, _ = clients.connect(broker.port, "runs-pub", clean=True, expiry=None)
        for i in range(50):
            publish(pub, "runs/t", b"%d" % i)
        sub, connack = clients.connect(broker.port, "runs")
        assert connack.session_present
        got: list[bytes] = []
        while len(got) < 50:
            window = [sub.recv()]
            window += sub.recv_all(QUIET)
            assert all(isinstance(p, Publish) and p.qos == 1 for p in window), window
            got += [p.payload for p in window]  # type: ignore[union-attr]
            sub.send(b"".join(PubAck(p.packet_id).encode(5) for p in window))  # type: ignore[union-attr]
        assert got == [b"%d" % i for i in range(50)]
        sub.send(PingReq())
        assert isinstance(sub.recv(), PingResp)
        clients.close_all()
    finally:
        code = broker.stop()
    assert code == 0, broker.log()
    stats = store_stats(tmp_path)
    assert (stats["sessions"], stats["subs_entries"], stats["queue_entries"], stats["messages_entries"]) == \
        (1, 1, 0, 0), stats


def test_store_stats_inspect_compact(tmp_path: Path, clients: Clients) -> None:
    """``edge-gateway store stats|inspect|compact`` (README, "The store") on a stopped broker's store with sessions
    and queued messages: the right counts, the sessions and subscriptions by name, a compaction after which every
    queued message is still delivered; compact while the broker runs is refused (exit 1, the store is locked)."""
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        port = broker.port
        c5, _ = clients.connect(port, "cli5", clean=True)
        subscribe(c5, 1, [Subscription("cli/#", 1)], sub_id=5)
        disconnect(c5)
        c311, _ = clients.connect(port, "cli311", version=4, clean=False)
        subscribe(c311, 1, [Subscription("cli/+/x", 2)])
        disconnect(c311)
        for i in range(4):
            result = subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-q", "1",
                                     "-t", "cli/a/x", "-m", f"x{i}"], capture_output=True, text=True, timeout=10)
            assert result.returncode == 0, result.stderr
        pub, _ = clients.connect(port, "cli-pub", clean=True, expiry=None)
        publish(pub, "cli/b", b"b0", qos=1)
        publish(pub, "cliret/t", b"retained", qos=1, retain=True, expect=0x10)
        locked = store_cli(tmp_path, "compact")
        assert locked.returncode == 1, locked.stderr
        assert locked.stderr.strip() == "edge-gateway store compact: store var is in use by another process"
        clients.close_all()
    finally:
        code = broker.stop()
    assert code == 0, broker.log()

    stats = store_cli(tmp_path, "stats")
    assert stats.returncode == 0, stats.stderr
    lines = stats.stdout.splitlines()
    assert "sessions         2" in lines
    assert "queued           9 deliveries" in lines
    assert "retained         1" in lines
    # The 4 cli/a/x payloads (queued for both sessions) and the retained one are stored once each and referenced;
    # cli/b, queued for cli5 alone, is stored in its queue row.
    assert "messages         5 stored payloads shared by reference, 1 stored in their queue row" in lines
    assert "  queue 'cli5': 5" in lines and "  queue 'cli311': 4" in lines

    inspect = store_cli(tmp_path, "inspect")
    assert inspect.returncode == 0, inspect.stderr
    text = inspect.stdout
    assert "session 'cli311': MQTT level 4" in text
    assert f"session 'cli5': MQTT level 5, expiry {SEI} s" in text
    assert "  subscription 'cli/#' qos=1 no_local=False rap=False rh=0 id=5" in text
    assert "  subscription 'cli/+/x' qos=2 no_local=False rap=False rh=0 id=None" in text
    assert text.count("  queued 5, in flight 0, inbound QoS 2 0") == 1
    assert text.count("  queued 4, in flight 0, inbound QoS 2 0") == 1
    assert "retained 'cliret/t': 8 bytes, QoS 1" in text

    compact = store_cli(tmp_path, "compact")
    assert compact.returncode == 0, compact.stderr
    assert "compacted var: " in compact.stderr and "(" in compact.stderr
    assert not (tmp_path / "var.old").exists() and not (tmp_path / "var.compact-tmp").exists()
    again = store_stats(tmp_path)
    assert (again["sessions"], again["queue_entries"], again["messages_entries"], again["inline_messages"],
            again["retained_entries"]) == (2, 9, 5, 1, 1)

    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    try:
        port = broker.port
        c5, ack = clients.connect(port, "cli5")
        assert ack.session_present is True
        got = drain(c5)
        assert [(p.topic, p.payload, p.properties.get(P.SUBSCRIPTION_IDENTIFIER)) for p in got] == \
            [("cli/a/x", f"x{i}".encode(), [5]) for i in range(4)] + [("cli/b", b"b0", [5])]
        c311, ack = clients.connect(port, "cli311", version=4)
        assert ack.session_present is True
        got = drain(c311)
        assert [(p.topic, p.payload, p.qos) for p in got] == [("cli/a/x", f"x{i}".encode(), 1) for i in range(4)]
        clients.close_all()
    finally:
        code = broker.stop()
    assert code == 0, broker.log()
