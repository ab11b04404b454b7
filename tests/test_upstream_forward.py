"""Upstream bridge, steady state (docs/upstream.md): forwarding to a real Mosquitto standing in for the cloud, exactly
once and in order; the msg_id User Property (docs/message-format.md); MQTT 3.1.1 upstreams; the downlink; loop
prevention; link state on $SYS; the [[upstream]] config checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers import ROOT, BrokerProcess
from upstream_peers import CloudSubscriber, LocalClient, Mosquitto, SysWatcher, free_port, wait_until

GW = "gw-t1"


@pytest.fixture(scope="module")
def cloud() -> Iterator[Mosquitto]:
    peer = Mosquitto().start()
    yield peer
    peer.cleanup()


@pytest.fixture(scope="module")
def gateway(cloud: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    config = f"""
[broker]
sys_interval = "1s"
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"

[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{cloud.port}"
backoff_initial = "50ms"
backoff_max = "300ms"
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{gateway_id}}/{{suffix}}"
qos = 2
[[upstream.forward]]
local = "cmd/#"
remote = "{{topic}}"
qos = 1
[[upstream.subscribe]]
remote = "cmd/{{gateway_id}}/#"
local = "{{topic}}"
qos = 1

[[upstream]]
name = "legacy"
url = "mqtt://127.0.0.1:{cloud.port}"
protocol = "3.1.1"
backoff_initial = "50ms"
backoff_max = "300ms"
[[upstream.forward]]
local = "legacy/#"
remote = "old/{{topic}}"
qos = 1
"""
    proc = BrokerProcess(config, workdir=str(tmp_path_factory.mktemp("upstream-gw"))).start()
    watchers = [SysWatcher(proc.port, name, f"sys-{name}") for name in ("cloud", "legacy")]
    try:
        for w in watchers:
            assert w.wait("state", "connected"), proc.log()
    finally:
        for w in watchers:
            w.close()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


def test_steady_state_qos1_arrives_upstream_in_order_exactly_once(
    gateway: BrokerProcess, cloud: Mosquitto, uid: str
) -> None:
    """Readings published locally at QoS 1 arrive upstream in order, each exactly once, with a distinct msg_id
    "<gateway_id>:<seq>" (docs/message-format.md "Upstream additions"); the counters agree."""
    sub = CloudSubscriber(cloud.port, [f"fleet/{GW}/#"], f"cloud-{uid}").start()
    pub = LocalClient(gateway.port, f"pub-{uid}", mqtt.MQTTv311)
    watch = SysWatcher(gateway.port, "cloud", f"sys-{uid}")
    try:
        start = int(watch.get("forwarded/messages") or 0)
        infos = [pub.publish(f"sensors/{GW}/{uid}", str(i).encode(), 1) for i in range(50)]
        assert wait_until(lambda: all(i.is_published() for i in infos))
        pub.publish(f"sensors/{GW}/{uid}-end", b"0", 1).wait_for_publish(10)
        topic = f"fleet/{GW}/{GW}/{uid}"
        assert wait_until(lambda: len(sub.on(f"{topic}-end")) == 1), cloud.log()
        received = sub.on(topic)
        assert [int(m.payload) for m in received] == list(range(50))
        assert [m.qos for m in received] == [1] * 50
        ids = [m.msg_id for m in received]
        assert all(i is not None and i.startswith(f"{GW}:") for i in ids)
        seqs = [int(i.split(":")[1]) for i in ids]  # type: ignore[union-attr]
        assert seqs == sorted(seqs) and len(set(seqs)) == 50
        assert watch.wait("forwarded/messages", str(start + 51))
        assert watch.wait("backlog/messages", "0")
        assert watch.get("state") == "connected"
        assert watch.get("last_ack") not in (None, "never")
    finally:
        watch.close()
        pub.close()
        sub.close()


def test_qos2_forwarded_at_qos2_and_properties_kept(gateway: BrokerProcess, cloud: Mosquitto, uid: str) -> None:
    """docs/upstream.md: QoS 2 goes through the outbox and leaves it on PUBCOMP; docs/message-format.md: the payload is
    forwarded byte for byte and the publisher's User Properties stay, with msg_id added (MQTT 5 upstream)."""
    sub = CloudSubscriber(cloud.port, [f"fleet/{GW}/#"], f"cloud-{uid}").start()
    pub = LocalClient(gateway.port, f"pub-{uid}")
    try:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("unit", "degC")]
        props.ContentType = "application/json"
        payload = b'{"v": 1, "seq": 7, "x": "\xc3\xa9"}'
        pub.client.publish(f"sensors/{GW}/{uid}", payload, 2, properties=props).wait_for_publish(10)
        topic = f"fleet/{GW}/{GW}/{uid}"
        assert wait_until(lambda: len(sub.on(topic)) == 1), cloud.log()
        (m,) = sub.on(topic)
        assert m.payload == payload
        assert m.qos == 2
        assert m.user_properties[0] == ("unit", "degC")
        assert m.user_properties[1][0] == "msg_id" and m.msg_id is not None and m.msg_id.startswith(f"{GW}:")
    finally:
        pub.close()
        sub.close()


def test_mqtt311_upstream_has_no_msg_id(gateway: BrokerProcess, cloud: Mosquitto, uid: str) -> None:
    """A stable id is carried as an MQTT 5 User Property; MQTT 3.1.1 has no properties, so a 3.1.1 link forwards
    in order without one (docs/upstream.md)."""
    sub = CloudSubscriber(cloud.port, ["old/#"], f"cloud-{uid}").start()
    pub = LocalClient(gateway.port, f"pub-{uid}", mqtt.MQTTv311)
    try:
        for i in range(5):
            pub.publish(f"legacy/{uid}", str(i).encode(), 1).wait_for_publish(10)
        assert wait_until(lambda: len(sub.on(f"old/legacy/{uid}")) == 5), cloud.log()
        received = sub.on(f"old/legacy/{uid}")
        assert [int(m.payload) for m in received] == [0, 1, 2, 3, 4]
        assert [m.msg_id for m in received] == [None] * 5
        assert [m.user_properties for m in received] == [[]] * 5
    finally:
        pub.close()
        sub.close()


def test_downlink_command_reaches_local_topic_and_is_not_forwarded_back(
    gateway: BrokerProcess, cloud: Mosquitto, uid: str
) -> None:
    """Downlink commands from the cloud reach the local topic (subscribe rule "cmd/{gateway_id}/#"), and a message that
    came down from the cloud is not forwarded back up (docs/upstream.md, "Downlink and loops") although a forward rule
    ("cmd/#") matches it: the cloud sees the command once, while a local publish on cmd/ is forwarded."""
    sub = CloudSubscriber(cloud.port, ["cmd/#"], f"cloud-{uid}").start()
    local = LocalClient(gateway.port, f"board-{uid}")
    watch = SysWatcher(gateway.port, "cloud", f"sys-{uid}")
    cloud_pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, f"ops-{uid}", protocol=mqtt.MQTTv5)
    try:
        received_before = int(watch.get("received/messages") or 0)
        local.subscribe(f"cmd/{GW}/{uid}/#", 1)
        cloud_pub.connect("127.0.0.1", cloud.port)
        cloud_pub.loop_start()
        cloud_pub.publish(f"cmd/{GW}/{uid}/reboot", b'{"id": 1}', 1).wait_for_publish(10)
        assert wait_until(lambda: local.payloads(f"cmd/{GW}/{uid}/reboot") == [b'{"id": 1}'])
        # A marker published locally goes up through the same link after the command came down.
        local.publish(f"cmd/{GW}/{uid}/reply", b"ok", 1).wait_for_publish(10)
        assert wait_until(lambda: len(sub.on(f"cmd/{GW}/{uid}/reply")) == 1), cloud.log()
        assert [m.payload for m in sub.on(f"cmd/{GW}/{uid}/reboot")] == [b'{"id": 1}']  # once: no loop
        assert watch.wait("received/messages", str(received_before + 1))
    finally:
        cloud_pub.disconnect()
        cloud_pub.loop_stop()
        watch.close()
        local.close()
        sub.close()


def test_link_state_published_on_sys_connection_topic(gateway: BrokerProcess) -> None:
    """Link state is published on $SYS/broker/connection/<name>/state like Mosquitto's bridge notifications
    (docs/upstream.md), with the backlog depth, oldest age and last ack time next to it (retained)."""
    watch = SysWatcher(gateway.port, "legacy", "sys-state-check")
    try:
        assert watch.wait("state", "connected")
        assert watch.wait("backlog/messages", "0")
        assert watch.get("backlog/oldest_age") == "none"
        assert watch.get("inflight") == "0"
        assert watch.get("connects") == "1"
    finally:
        watch.close()


def _check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gw.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_upstream_config_errors_name_key_value_and_allowed(tmp_path: Path) -> None:
    """`edge-gateway check-config` names every bad key with what is allowed (docs/upstream.md, "Configuration"), applied
    to [[upstream]]: check-config fails with one line per mistake."""
    result = _check_config(
        tmp_path,
        """
[broker]
gateway_id = "gw/1"
[[upstream]]
name = "cloud"
url = "http://example.com"
protocol = "4"
order = "newest"
drain_rate = -1
max_inflight = 0
colour = "red"
[[upstream.forward]]
local = "sensors/#/x"
remote = "fleet/{gateway_id}"
[[upstream.forward]]
local = "a/#"
remote = "fleet/{device}"
qos = 3
[[upstream.subscribe]]
remote = "cmd/{topic}"
""",
    )
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert err.rstrip().endswith("11 error(s)"), err
    for expected in (
        "broker.gateway_id = 'gw/1': must be a non-empty string without '/', '+', '#' or ':'",
        "upstream.cloud.url = 'http://example.com': must be mqtt://host[:port] or mqtts://host[:port]",
        'upstream.cloud.protocol = \'4\': must be "5" or "3.1.1"',
        "upstream.cloud.order = 'newest': must be one of backlog_first, live_first",
        "upstream.cloud.drain_rate = -1: must be messages per second >= 0 (0 = unpaced)",
        "upstream.cloud.max_inflight = 0: must be an integer 1..65535",
        "upstream.cloud.colour: unknown key; allowed:",
        "upstream.cloud.forward[0].local = 'sensors/#/x': must be a local topic filter",
        "upstream.cloud.forward[1].qos = 3: must be 0, 1 or 2",
        "upstream.cloud.forward[1].remote = 'fleet/{device}': must be a remote topic template",
        "upstream.cloud.subscribe[0].remote = 'cmd/{topic}': only {gateway_id} may appear in a remote filter",
    ):
        assert expected in err, err


def test_upstream_config_accepted(tmp_path: Path) -> None:
    """A valid [[upstream]] passes check-config (the section used to be refused as unknown)."""
    result = _check_config(
        tmp_path,
        """
[broker]
gateway_id = "gw-0001"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:1"
order = "live_first"
drain_rate = 50
drain_bytes = "64KB"
message_ttl = "1d"
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{gateway_id}/{suffix}"
qos = 1
""",
    )
    assert result.returncode == 0, result.stderr
    expected = (
        "upstream cloud: mqtt://127.0.0.1:1 as 'gw-0001-cloud', 1 forward and 0 subscribe rule(s), order live_first"
    )
    assert expected in result.stdout


def _pki(directory: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        extra = ["-extfile", "san.ext"] if name == "server" else []
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            *extra,
        )
    return {n: str(directory / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_mqtts_upstream_with_client_certificate(make_broker, tmp_path: Path, uid: str) -> None:
    """The link's URL is mqtt:// or mqtts://, with CA and client certificates (docs/upstream.md, "Configuration"): an
    mqtts:// link verifies the cloud broker against ca_file and presents cert_file/key_file to a Mosquitto listener that
    requires a client certificate; the readings arrive."""
    pki = _pki(tmp_path)
    tls_port = free_port()
    cloud = Mosquitto(
        extra=f"listener {tls_port} 127.0.0.1\ncafile {pki['ca.pem']}\ncertfile {pki['server.pem']}\n"
        f"keyfile {pki['server.key']}\nrequire_certificate true\n"
    ).start()
    sub: CloudSubscriber | None = None
    pub: LocalClient | None = None
    try:
        sub = CloudSubscriber(cloud.port, ["tls/#"], f"cloud-{uid}").start()  # on the plain listener
        gw: BrokerProcess = make_broker(f"""
[broker]
gateway_id = "{GW}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "secure"
url = "mqtts://127.0.0.1:{tls_port}"
ca_file = "{pki["ca.pem"]}"
cert_file = "{pki["client.pem"]}"
key_file = "{pki["client.key"]}"
[[upstream.forward]]
local = "sensors/#"
remote = "tls/{{topic}}"
""")
        pub = LocalClient(gw.port, f"pub-{uid}", mqtt.MQTTv311)
        for i in range(3):
            pub.publish(f"sensors/{uid}", str(i).encode(), 1).wait_for_publish(10)
        cloud_sub = sub
        assert wait_until(lambda: len(cloud_sub.on(f"tls/sensors/{uid}")) == 3), (gw.log(), cloud.log())
        assert [m.payload for m in cloud_sub.on(f"tls/sensors/{uid}")] == [b"0", b"1", b"2"]
        assert f"connected to 127.0.0.1:{tls_port}" in gw.log()
    finally:
        if pub is not None:
            pub.close()
        if sub is not None:
            sub.close()
        cloud.cleanup()
