"""A message the cloud cannot take never stalls the link, and no message that fits is dropped (docs/upstream.md
"When the cloud says no"): real gateways forwarding to a real Mosquitto with the limits managed IoT clouds have
(``max_qos 1``, ``retain_available false``, ``max_packet_size 131072``, ``max_inflight_messages 10``), to a fake
cloud that measures every PUBLISH on the wire, and to our own broker with a full store (PUBACK 0x97)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import BrokerProcess, RawClient
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from test_metrics import metrics_port, scrape, value
from upstream_peers import CloudSubscriber, FakeUpstream, LocalClient, Mosquitto, SysWatcher, wait_until

from gateway.mqtt.packets import PubAck, Publish, Suback, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC

#: A host name as gateways get them: 58 characters.
LONG_GW = "gw-" + "cabinet-north-substation-feeder-07-riverside-plant-0001"
LIMIT = 131_072
CLOUD_LIMITS = f"max_qos 1\nretain_available false\nmax_packet_size {LIMIT}\nmax_inflight_messages 10\n"
SMALL = 19


def _link(name: str, port: int, remote: str, extra: str = "", backoff: tuple[str, str] = ("100ms", "500ms")) -> str:
    return f"""
[[upstream]]
name = "{name}"
url = "mqtt://127.0.0.1:{port}"
backoff_initial = "{backoff[0]}"
backoff_max = "{backoff[1]}"
{extra}
[[upstream.forward]]
local = "sensors/#"
remote = "{remote}"
qos = 1
"""


def _gateway(links: str, gateway_id: str = "gw-r") -> str:
    return f"""
[broker]
sys_interval = "1s"
gateway_id = "{gateway_id}"
[listeners.external]
bind = "127.0.0.1:0"
max_packet_size = "1MB"
[metrics]
bind = "127.0.0.1:0"
{links}"""


def _publish(client: LocalClient, topic: str, payload: bytes, user: tuple[str, str] | None = None) -> None:
    """One QoS 1 PUBLISH from an MQTT 5 client, waited for until the gateway acknowledged it."""
    props = None
    if user is not None:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [user]
    info = client.client.publish(topic, payload, 1, properties=props)
    info.wait_for_publish(20)
    assert info.is_published()


@pytest.fixture
def cloud() -> Iterator[Mosquitto]:
    peer = Mosquitto(extra=CLOUD_LIMITS).start()
    yield peer
    peer.cleanup()


def _stable(read: Callable[[], str | None], seconds: float) -> bool:
    """``read()`` gives the same value for ``seconds``."""
    first = read()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if read() != first:
            return False
        time.sleep(0.1)
    return True


def test_mqtt_3_2_2_15_exact_publish_size_against_the_bytes_on_the_wire(make_broker: Any, uid: str) -> None:
    """The cloud announces a Maximum Packet Size of 4096 bytes; the client "MUST NOT send packets exceeding Maximum
    Packet Size to the Server" [MQTT-3.2.2-15]. A sweep of payload sizes with a 200-byte User Property and the msg_id
    of a 58-character gateway_id: every PUBLISH that reached the cloud measured at most 4096 bytes off the wire, one
    measured exactly 4096 (nothing that fits was dropped), and exactly the larger ones were dropped as
    packet_too_large, without a reconnect."""
    limit = 4096
    fake = FakeUpstream(receive_maximum=100, ack=True, max_packet_size=limit)
    pub: LocalClient | None = None
    watch: SysWatcher | None = None
    try:
        gw: BrokerProcess = make_broker(_gateway(_link("cloud", fake.port, "fleet/{topic}"), LONG_GW))
        watch = SysWatcher(gw.port, "cloud", f"sys-{uid}")
        assert watch.wait("state", "connected"), gw.log()
        pub = LocalClient(gw.port, f"pub-{uid}")
        sizes = range(3680, 3800)  # the boundary lies inside (about 350 bytes of topic and properties)
        for n in sizes:
            _publish(pub, f"sensors/{uid}", b"p" * n, ("site", "s" * 200))
        assert watch.wait("backlog/messages", "0"), watch.values
        arrived = fake.arrivals(f"{LONG_GW}-cloud")
        on_wire = fake.sizes
        assert len(on_wire) == len(arrived) > 0
        assert max(on_wire) == limit and all(size <= limit for size in on_wire)
        largest_sent = max(len(p.payload) for _, p in arrived)
        assert sorted(len(p.payload) for _, p in arrived) == [n for n in sizes if n <= largest_sent]
        dropped = sum(1 for n in sizes if n > largest_sent)
        assert dropped > 0
        assert watch.wait("dropped/packet_too_large", str(dropped)), watch.values
        assert watch.get("connects") == "1" and fake.count() == 1
    finally:
        for c in (pub, watch):
            if c is not None:
                c.close()
        fake.close()


def test_oversize_message_dropped_once_the_rest_flows_and_what_fits_arrives(
    make_broker: Any, cloud: Mosquitto, uid: str
) -> None:
    """MQTT 5 links to a cloud with a 131,072-byte Maximum Packet Size. A 130,899-byte payload with a 200-byte User
    Property, then 19 small messages on other topics: the big one is dropped once as packet_too_large (it was
    acknowledged locally), the 19 all arrive, the link never reconnects. With a 58-character gateway_id a payload
    + topic at 131,008 bytes (where a fixed estimate said "fits") is over as sent and dropped the same way. A
    131,000-byte payload on a 9-byte topic fits as sent (about 131,040 bytes with the msg_id) and arrives."""
    sub = CloudSubscriber(cloud.port, ["#"], f"cloud-{uid}", qos=1).start()
    links = _link("short", cloud.port, "{topic}", 'protocol = "5"')
    links += _link("long", cloud.port, "long/{topic}", f'protocol = "5"\ngateway_id = "{LONG_GW}"')
    gw: BrokerProcess = make_broker(_gateway(links))
    watches = {name: SysWatcher(gw.port, name, f"sys-{name}-{uid}") for name in ("short", "long")}
    pub = LocalClient(gw.port, f"pub-{uid}")
    try:
        for w in watches.values():
            assert w.wait("state", "connected"), gw.log()
        _publish(pub, "sensors/x", b"b" * 130_899, ("note", "n" * 196))  # key + value: 200 bytes
        for i in range(SMALL):
            _publish(pub, f"sensors/{uid}/s{i}", f"small{i}".encode())
        _publish(pub, "sensors/y", b"y" * 131_000)
        _publish(pub, "sensors/z", b"z" * (131_008 - len("long/sensors/z")))
        smalls = [f"small{i}".encode() for i in range(SMALL)]

        def arrived(prefix: str) -> list[bytes]:
            with sub.lock:
                return [m.payload for m in sub.messages if m.topic.startswith(prefix)]

        assert wait_until(lambda: arrived(f"sensors/{uid}/") == smalls), cloud.log()
        assert wait_until(lambda: arrived(f"long/sensors/{uid}/") == smalls), cloud.log()
        assert wait_until(lambda: len(sub.on("sensors/y")) == 1), cloud.log()
        assert sub.on("sensors/y")[0].payload == b"y" * 131_000
        assert watches["short"].wait("dropped/packet_too_large", "1"), watches["short"].values
        assert watches["long"].wait("dropped/packet_too_large", "3"), watches["long"].values  # x, y and z
        for w in watches.values():
            assert w.wait("backlog/messages", "0"), w.values
            assert w.get("connects") == "1" and w.states.count("connected") == 1, w.states
            assert w.get("dropped") == w.get("dropped/packet_too_large")
        assert not sub.on("sensors/x") and not sub.on("long/sensors/x") and not sub.on("long/sensors/y")
        assert "due to oversize packet" not in cloud.log()
        assert "over the Maximum Packet Size of 131072; dropped" in gw.log()
    finally:
        for c in (pub, *watches.values(), sub):
            c.close()


def test_poison_message_set_aside_bystanders_arrive_link_settles_kill_9_in_the_loop(
    make_broker: Any, cloud: Mosquitto, uid: str
) -> None:
    """MQTT 3.1.1 links (the cloud announces no Maximum Packet Size there). With ``max_packet_size = "128KB"`` the
    oversize message is dropped before it is sent (packet_too_large, no reconnect). Without it the cloud closes the
    link each time the message is sent: the safety net sends the suspects one at a time and sets the message aside
    as ``poison`` after ``poison_closes`` closes in a row (counted once, logged with its topic and size); the 19
    bystanders on other topics all arrive and the link stops reconnecting. A kill -9 of the gateway in the middle
    of that loop loses none of the acknowledged bystanders: the restarted gateway goes through it again."""
    sub = CloudSubscriber(cloud.port, ["#"], f"cloud-{uid}", qos=1).start()
    links = _link("sized", cloud.port, "sized/{topic}", 'protocol = "3.1.1"\nmax_packet_size = "128KB"')
    # slower backoff and more closes than the defaults, so the kill -9 below lands inside the loop
    links += _link("blind", cloud.port, "blind/{topic}", 'protocol = "3.1.1"\npoison_closes = 5', ("400ms", "800ms"))
    config = _gateway(links)
    gw: BrokerProcess = make_broker(config)
    watches = {name: SysWatcher(gw.port, name, f"sys-{name}-{uid}") for name in ("sized", "blind")}
    pub = LocalClient(gw.port, f"pub-{uid}")
    restarted: BrokerProcess | None = None
    try:
        for w in watches.values():
            assert w.wait("state", "connected"), gw.log()
        _publish(pub, f"sensors/{uid}/big", b"B" * 131_100)
        for i in range(SMALL):
            _publish(pub, f"sensors/{uid}/s{i}", f"small{i}".encode())
        assert wait_until(lambda: int(watches["blind"].get("connects") or 0) >= 2), gw.log()  # in the stall loop
        assert watches["blind"].get("dropped/poison") is None
        gw.kill()
        assert "over the Maximum Packet Size of 131072; dropped" in gw.log()
        assert "upstream sized: lost" not in gw.log() and "was sent alone" not in gw.log()
        for c in (pub, *watches.values()):
            c.close()
        restarted = BrokerProcess(config, workdir=str(gw.workdir)).start()
        blind = SysWatcher(restarted.port, "blind", f"sys-blind2-{uid}")
        watches["blind"] = blind
        smalls = {f"small{i}".encode() for i in range(SMALL)}

        def bystanders() -> set[bytes]:
            with sub.lock:
                return {m.payload for m in sub.messages if m.topic.startswith(f"blind/sensors/{uid}/s")}

        assert wait_until(lambda: bystanders() == smalls, 60), restarted.log() + cloud.log()
        assert blind.wait("dropped/poison", "1", 30), (blind.values, gw.log())
        assert blind.wait("backlog/messages", "0"), blind.values
        assert _stable(lambda: blind.get("connects"), 3.0), "the link kept reconnecting"
        assert blind.get("dropped") == "1"
        assert not sub.on(f"blind/sensors/{uid}/big") and not sub.on(f"sized/sensors/{uid}/big")
        assert f"right after blind/sensors/{uid}/big (131100 bytes" in restarted.log()
        assert "due to oversize packet" in cloud.log()
        metrics = scrape(metrics_port(restarted))
        assert value(metrics, "edge_gateway_upstream_messages_dropped_total", upstream="blind", reason="poison") == 1
    finally:
        for c in (pub, *watches.values(), sub):
            c.close()
        if restarted is not None:
            restarted.stop()


def test_quota_exceeded_waits_and_delivers_once_the_cloud_has_room_kill_9_in_the_pause(
    make_broker: Any, uid: str
) -> None:
    """Our own broker as the cloud, with a full store: it answers the forwarded QoS 1 PUBLISHes with PUBACK 0x97
    Quota exceeded. The messages wait in the outbox (the drain paused, retried after a backoff: the retries count
    grows, nothing is dropped); a kill -9 of the gateway during the pause loses nothing; once a persistent session
    drains the cloud's store, all 20 arrive, in order."""
    cloud: BrokerProcess = make_broker("""
[store]
max_size = "8MB"
[listeners.external]
bind = "127.0.0.1:0"
max_mqueue_len = 0
max_mqueue_bytes = 0
""")
    hog = _session(cloud.port, f"hog-{uid}")
    hog.send(Subscribe(1, [Subscription("fill/#", 1)]))
    assert isinstance(hog.recv(), Suback)
    hog.close()
    filler = _session(cloud.port, f"filler-{uid}", expiry=0)
    for pid in range(1, 400):  # 64 KiB each: about 100 fill the 8 MB store
        filler.send(Publish("fill/x", b"f" * 65_536, 1, packet_id=pid))
        ack = filler.recv(10)
        assert isinstance(ack, PubAck) and ack.packet_id == pid, ack
        if ack.reason_code == RC.QUOTA_EXCEEDED:
            break
    else:
        pytest.fail("the cloud's store never filled")
    filled = pid - 1
    filler.close()
    reader = LocalClient(cloud.port, f"reader-{uid}")
    reader.subscribe("fleet/#", 1)
    config = _gateway(_link("cloud", cloud.port, "fleet/{topic}", backoff=("200ms", "1s")))
    gw: BrokerProcess = make_broker(config)
    watch = SysWatcher(gw.port, "cloud", f"sys-{uid}")
    pub = LocalClient(gw.port, f"pub-{uid}")
    restarted: BrokerProcess | None = None
    expected = [f"q{i}".encode() for i in range(20)]
    try:
        assert watch.wait("state", "connected"), gw.log()
        for payload in expected:
            _publish(pub, f"sensors/{uid}", payload)  # acknowledged by the gateway: must not be lost
        assert wait_until(lambda: int(watch.get("retries") or 0) >= 3), watch.values
        assert watch.get("dropped") == "0" and reader.payloads(f"fleet/sensors/{uid}") == []
        for c in (pub, watch):
            c.close()
        gw.kill()  # during the pause
        restarted = BrokerProcess(config, workdir=str(gw.workdir)).start()
        watch = SysWatcher(restarted.port, "cloud", f"sys2-{uid}")
        assert wait_until(lambda: int(watch.get("retries") or 0) >= 1), watch.values
        assert watch.get("backlog/messages") == "20"
        hog = _session(cloud.port, f"hog-{uid}", clean=False)  # drains the cloud's store
        for _ in range(filled):
            packet = hog.recv(10)
            assert isinstance(packet, Publish) and packet.topic == "fill/x", packet
            hog.send(PubAck(packet.packet_id))  # type: ignore[arg-type]
        assert wait_until(lambda: reader.payloads(f"fleet/sensors/{uid}") == expected, 30), (
            reader.payloads(f"fleet/sensors/{uid}"), watch.values)
        assert watch.wait("backlog/messages", "0") and watch.get("dropped") == "0"
        assert "refused for now by the cloud broker (reason 0x97" in restarted.log()
        assert value(scrape(metrics_port(restarted)), "edge_gateway_upstream_retries_total", upstream="cloud") >= 1
    finally:
        for c in (pub, watch, reader, hog):
            c.close()
        if restarted is not None:
            restarted.stop()


def _session(port: int, client_id: str, clean: bool = True, expiry: int = 3600) -> RawClient:
    """A raw MQTT 5 client on our own broker (the session outlives the connection for ``expiry`` seconds)."""
    client = RawClient(port, version=5, timeout=10.0)
    props = {P.SESSION_EXPIRY_INTERVAL: expiry} if expiry else {}
    connack = client.connect(client_id, clean_start=clean, properties=props)
    assert connack.reason_code == 0, connack
    return client


def test_refusal_settings_checked_by_key_value_and_allowed(tmp_path: Any) -> None:
    """check-config names each bad ``max_packet_size``, ``max_retries``, ``poison_closes`` and ``poison_window`` with
    its value and what is allowed, and takes good ones."""
    from test_upstream_forward import _check_config

    link = '[[upstream]]\nname = "cloud"\nurl = "mqtt://127.0.0.1:1"\n{}\n[[upstream.forward]]\nlocal = "s/#"\n'
    bad = _check_config(tmp_path, link.format(
        'max_packet_size = "12 parsecs"\nmax_retries = -1\npoison_closes = 1.5\npoison_window = "soon"'))
    assert bad.returncode == 1 and bad.stderr.rstrip().endswith("4 error(s)"), bad.stderr
    for expected in (
        "upstream.cloud.max_packet_size = '12 parsecs': must be a size in bytes such as \"128KB\" (0 = what the "
        "cloud announces)",
        "upstream.cloud.max_retries = -1: must be an integer 0..1000",
        "upstream.cloud.poison_closes = 1.5: must be an integer 0..1000 (0 = never set a message aside)",
        "upstream.cloud.poison_window = 'soon': must be a duration such as \"10s\"",
    ):
        assert expected in bad.stderr, bad.stderr
    good = _check_config(tmp_path, link.format(
        'protocol = "3.1.1"\nmax_packet_size = "128KB"\nmax_retries = 0\npoison_closes = 0\npoison_window = "2s"'))
    assert good.returncode == 0, good.stderr
