"""Prometheus metrics: ``[metrics] bind`` serves ``/metrics`` (prometheus-client); the values are the
broker's own counters read at scrape time. Real broker processes, real paho clients, a real HTTP scrape over
127.0.0.1 parsed with prometheus-client's parser; every expected value follows from the traffic the test made."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__, native

_METRICS = re.compile(r"metrics: Prometheus /metrics on http://(\S+):(\d+)/metrics")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_port(broker: BrokerProcess) -> int:
    """The metrics endpoint's port, from the broker's log line (bind asked for port 0)."""
    for line in broker.lines:
        m = _METRICS.search(line)
        if m:
            return int(m.group(2))
    raise AssertionError("no metrics line in the log:\n" + broker.log())


def scrape(port: int) -> Samples:
    """GET /metrics and parse it with prometheus-client's parser: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; KeyError naming what is missing."""
    key = (name, tuple(sorted(labels.items())))
    if key not in samples:
        raise KeyError(f"{name}{labels} not in the scrape")
    return samples[key]


class Client:
    """A paho-mqtt 5 client on a loop thread; ``received`` collects payloads."""

    def __init__(self, port: int, client_id: str, clean_start: bool = True, expiry: int = 0) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.received: list[bytes] = []
        self.connack: Any = None
        self.client.on_message = lambda c, u, msg: self.received.append(msg.payload)
        self.client.on_connect = lambda c, u, flags, rc, props: setattr(self, "connack", rc)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = expiry
        self.client.connect("127.0.0.1", port, keepalive=30, clean_start=clean_start, properties=props)
        self.client.loop_start()
        wait_until(lambda: self.connack is not None, 10, f"CONNACK for {client_id}")

    def subscribe(self, topic: str, qos: int) -> None:
        done: list[int] = []
        self.client.on_subscribe = lambda c, u, mid, rcs, props: done.append(mid)
        self.client.subscribe(topic, qos)
        wait_until(lambda: done, 10, f"SUBACK for {topic}")

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        info = self.client.publish(topic, payload, qos)
        if qos:
            info.wait_for_publish(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


CONFIG = """
[broker]
sys_interval = "0"
[listeners.external]
bind = "127.0.0.1:0"
max_mqueue_len = 5
[listeners.tight]
bind = "127.0.0.1:0"
max_connections = 1
[metrics]
bind = "127.0.0.1:0"
"""


@pytest.fixture(scope="module")
def mbroker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A broker with an LMDB store, a second listener for one client only, and metrics on an ephemeral port."""
    proc = BrokerProcess(CONFIG, workdir=str(tmp_path_factory.mktemp("metrics"))).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_metrics_count_publishes_by_qos_and_packet_type(mbroker: BrokerProcess, uid: str) -> None:
    """N QoS 1 and M QoS 0 PUBLISH from a paho client to a persistent QoS 1 subscriber: received_total{qos} grows
    by exactly N and M, PUBACKs sent by N, PUBLISH sent by N + M, and the QoS 1 work was committed and fsynced."""
    port = metrics_port(mbroker)
    sub = Client(mbroker.ports["external"], f"{uid}-sub", expiry=300)  # persistent: its QoS 1 work is stored
    sub.subscribe(f"{uid}/#", 1)
    pub = Client(mbroker.ports["external"], f"{uid}-pub")
    before = scrape(port)
    n, m = 25, 10
    for i in range(n):
        pub.publish(f"{uid}/q1", b"one %d" % i, 1)
    for i in range(m):
        pub.publish(f"{uid}/q0", b"zero %d" % i, 0)
    wait_until(lambda: len(sub.received) == n + m, 10, "every message at the subscriber")
    after = scrape(port)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("edge_gateway_messages_received_total", qos="1") == n
    assert grew("edge_gateway_messages_received_total", qos="0") == m
    assert grew("edge_gateway_messages_received_total", qos="2") == 0
    assert grew("edge_gateway_packets_received_total", type="publish") == n + m
    assert grew("edge_gateway_packets_sent_total", type="publish") == n + m
    assert grew("edge_gateway_messages_sent_total", qos="1") == n  # min(1, 1)
    assert grew("edge_gateway_messages_sent_total", qos="0") == m
    # PUBACKs: n to the publisher; the subscriber's n PUBACKs came in
    assert grew("edge_gateway_packets_sent_total", type="puback") == n
    wait_until(lambda: value(scrape(port), "edge_gateway_packets_received_total", type="puback")
               - value(before, "edge_gateway_packets_received_total", type="puback") == n, 5,
               "the subscriber's PUBACKs")
    assert value(after, "edge_gateway_clients_connected", listener="external") >= 2
    assert value(after, "edge_gateway_sessions", state="online") >= 2
    assert value(after, "edge_gateway_connections_total") >= 2
    # QoS 1 is acknowledged only once durable: commits happened, each timed into the fsync histogram
    commits = grew("edge_gateway_store_commits_total")
    assert commits >= 1
    timed = grew("edge_gateway_store_fsync_duration_seconds_count")
    assert 1 <= timed <= commits
    assert value(after, "edge_gateway_store_fsync_duration_seconds_bucket", le="+Inf") == \
        value(after, "edge_gateway_store_fsync_duration_seconds_count")
    assert grew("edge_gateway_store_fsync_duration_seconds_sum") > 0
    assert value(after, "edge_gateway_store_used_bytes") > 0
    assert value(after, "edge_gateway_store_size_bytes") >= value(after, "edge_gateway_store_used_bytes")
    assert grew("edge_gateway_disk_written_bytes_total") > 0  # the fsynced pages reached the disk
    assert value(after, "process_resident_memory_bytes") > 0
    sub.close()
    pub.close()


def test_metrics_build_info_says_how_the_codec_runs(mbroker: BrokerProcess) -> None:
    """``edge_gateway_build_info`` carries the version and whether the MQTT codec runs compiled (gateway/native.py):
    the broker runs from this install with this environment, so as this process does."""
    core = native.select()
    samples = scrape(metrics_port(mbroker))
    labels = {"version": __version__, "core": "compiled" if core.compiled else "pure", "core_reason": core.reason}
    assert value(samples, "edge_gateway_build_info", **labels) == 1.0


def test_metrics_count_refused_connect_by_reason(mbroker: BrokerProcess, uid: str) -> None:
    """A CONNECT past ``max_connections`` (CONNACK 0x97 Quota exceeded) counts once, by reason and by limit."""
    port = metrics_port(mbroker)
    before = scrape(port)
    assert value(before, "edge_gateway_clients_connected", listener="tight") == 0  # listed before its first client
    first = Client(mbroker.ports["tight"], f"{uid}-first")
    assert first.connack == 0
    second = Client(mbroker.ports["tight"], f"{uid}-second")
    assert second.connack == 0x97
    after = scrape(port)
    reason = ("edge_gateway_connections_refused_total", (("reason", "quota_exceeded"),))
    limit = ("edge_gateway_refused_total", (("limit", "max_connections"),))
    assert after[reason] - before.get(reason, 0) == 1
    assert after[limit] - before.get(limit, 0) == 1
    assert value(after, "edge_gateway_clients_connected", listener="tight") == 1
    second.client.loop_stop()
    first.close()


def test_metrics_count_queue_full_drops_and_offline_queue(mbroker: BrokerProcess, uid: str) -> None:
    """An offline persistent session with ``max_mqueue_len = 5`` gets 8 QoS 1 messages: 5 queued (the longest
    queue is 5), 3 dropped as ``mqueue_full``; a QoS 0 message nobody subscribed to counts as ``no_subscribers``."""
    port = metrics_port(mbroker)
    sub = Client(mbroker.ports["external"], f"{uid}-away", clean_start=True, expiry=300)
    sub.subscribe(f"{uid}/offline/#", 1)
    sub.close()
    wait_until(lambda: value(scrape(port), "edge_gateway_sessions", state="offline") >= 1, 5, "the session offline")
    before = scrape(port)
    pub = Client(mbroker.ports["external"], f"{uid}-pub")
    for i in range(8):
        pub.publish(f"{uid}/offline/x", b"m%d" % i, 1)
    pub.publish(f"{uid}/nobody/listens", b"lost", 0)
    wait_until(lambda: value(scrape(port), "edge_gateway_messages_dropped_total", reason="no_subscribers")
               - value(before, "edge_gateway_messages_dropped_total", reason="no_subscribers") == 1, 5,
               "the no_subscribers drop")
    after = scrape(port)
    assert value(after, "edge_gateway_messages_dropped_total", reason="mqueue_full") \
        - value(before, "edge_gateway_messages_dropped_total", reason="mqueue_full") == 3
    assert value(after, "edge_gateway_messages_queued") - value(before, "edge_gateway_messages_queued") == 5
    assert value(after, "edge_gateway_messages_queued_max_per_client") == 5
    assert value(after, "edge_gateway_messages_queued_bytes") >= 5 * 2
    assert value(after, "edge_gateway_sessions_persistent") >= 1
    pub.close()


def test_metrics_bad_bind_names_key_value_and_what_is_allowed(tmp_path: Any) -> None:
    """``check-config`` refuses a bad ``[metrics] bind`` (and a Unix socket path, which Prometheus cannot scrape)
    naming the key, the value and what is allowed; a good one is reported."""
    cases = {
        '"localhost"': "metrics.bind = 'localhost': must be a TCP \"host:port\"",
        '"/run/m.sock"': "metrics.bind = '/run/m.sock': must be a TCP \"host:port\"",
        '"127.0.0.1:70000"': "metrics.bind = '127.0.0.1:70000': must be a TCP \"host:port\"",
    }
    for bind, error in cases.items():
        path = tmp_path / "gw.toml"
        path.write_text(f"[metrics]\nbind = {bind}\n")
        result = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 1
        assert error in result.stderr, result.stderr
    path.write_text('[metrics]\nbind = "127.0.0.1:9883"\n')
    result = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "metrics: Prometheus /metrics on 127.0.0.1:9883" in result.stdout


def test_metrics_port_in_use_fails_start_with_exit_1(mbroker: BrokerProcess, tmp_path: Any) -> None:
    """A metrics bind that cannot listen (the port is taken) stops the start, exit 1, naming the address."""
    taken = metrics_port(mbroker)
    config = f'[listeners.external]\nbind = "127.0.0.1:0"\n[store]\nbackend = "memory"\n' \
             f'[metrics]\nbind = "127.0.0.1:{taken}"\n'
    path = tmp_path / "gw.toml"
    path.write_text(config)
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], capture_output=True,
                            text=True, timeout=30, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{taken} ([metrics] bind)" in result.stderr


def test_metrics_upstream_link_with_real_mosquitto(tmp_path: Any, uid: str) -> None:
    """One ``[[upstream]]`` to a real Mosquitto: state and up, QoS 1 sent/acked/forwarded with round trips; while
    Mosquitto is down the backlog (messages, bytes, oldest age) grows, ``max_messages`` drops the oldest and QoS 0
    is dropped as ``qos0_link_down``; after its restart the backlog drains and the reconnect is counted."""
    from upstream_peers import Mosquitto

    cloud = Mosquitto().start()
    config = f"""
[broker]
sys_interval = "0"
[listeners.external]
bind = "127.0.0.1:0"
[metrics]
bind = "127.0.0.1:0"
[[upstream]]
name = "cloud"
url = "mqtt://127.0.0.1:{cloud.port}"
backoff_initial = "50ms"
backoff_max = "300ms"
max_messages = 5
[[upstream.forward]]
local = "{uid}/#"
remote = "{{topic}}"
qos = 1
"""
    gw = BrokerProcess(config, workdir=str(tmp_path)).start()
    pub: Client | None = None
    try:
        port = metrics_port(gw)

        def link(name: str, **labels: str) -> float:
            return value(scrape(port), name, upstream="cloud", **labels)

        wait_until(lambda: link("edge_gateway_upstream_up") == 1, 10, "the link up")
        assert link("edge_gateway_upstream_state", state="connected") == 1
        assert link("edge_gateway_upstream_state", state="backing-off") == 0
        pub = Client(gw.port, f"{uid}-pub")
        n = 10
        for i in range(n):
            pub.publish(f"{uid}/up", b"%04d" % i, 1)
        wait_until(lambda: link("edge_gateway_upstream_messages_acked_total") == n, 10, "n PUBACKs from Mosquitto")
        s = scrape(port)
        assert value(s, "edge_gateway_upstream_messages_sent_total", upstream="cloud") == n
        assert value(s, "edge_gateway_upstream_messages_forwarded_total", upstream="cloud") == n
        assert value(s, "edge_gateway_upstream_round_trip_seconds_count", upstream="cloud") == n
        assert value(s, "edge_gateway_upstream_round_trip_seconds_sum", upstream="cloud") > 0
        assert value(s, "edge_gateway_upstream_last_round_trip_seconds", upstream="cloud") > 0
        assert value(s, "edge_gateway_upstream_backlog_messages", upstream="cloud") == 0
        assert value(s, "edge_gateway_upstream_connects_total", upstream="cloud") == 1
        assert value(s, "edge_gateway_upstream_reconnects_total", upstream="cloud") == 0

        cloud.stop()
        wait_until(lambda: link("edge_gateway_upstream_up") == 0, 10, "the link down")
        topic = f"{uid}/down"
        for i in range(7):
            pub.publish(topic, b"%04d" % i, 1)
        pub.publish(topic, b"qos0", 0)
        wait_until(lambda: link("edge_gateway_upstream_messages_dropped_total", reason="qos0_link_down") == 1, 5,
                   "the QoS 0 drop")
        s = scrape(port)
        assert value(s, "edge_gateway_upstream_backlog_messages", upstream="cloud") == 5
        assert value(s, "edge_gateway_upstream_backlog_bytes", upstream="cloud") == 5 * (4 + len(topic))
        assert value(s, "edge_gateway_upstream_messages_dropped_total", upstream="cloud", reason="max_messages") == 2
        assert value(s, "edge_gateway_upstream_state", upstream="cloud", state="connected") == 0
        wait_until(lambda: link("edge_gateway_upstream_backlog_oldest_age_seconds") > 0.2, 5, "the backlog ages")

        cloud.start()
        wait_until(lambda: link("edge_gateway_upstream_backlog_messages") == 0, 15, "the backlog drained")
        s = scrape(port)
        assert value(s, "edge_gateway_upstream_messages_forwarded_total", upstream="cloud") == n + 5
        assert value(s, "edge_gateway_upstream_reconnects_total", upstream="cloud") == 1
        assert value(s, "edge_gateway_upstream_backlog_oldest_age_seconds", upstream="cloud") == 0
    finally:
        if pub is not None:
            pub.close()
        assert gw.stop() == 0, gw.log()
        cloud.cleanup()


def test_metrics_report_the_last_update_outcome(tmp_path: Any) -> None:
    """The image's health check writes the last A/B update outcome (image/rauc/health.sh's KEY=value file); the
    metrics show it as edge_gateway_update_info{outcome, slot, version, previous} and its time, read at each scrape
    (a rollback written while the broker runs shows on the next scrape); no file, no update metrics."""
    status = tmp_path / "update-last"
    gw = BrokerProcess(CONFIG, workdir=str(tmp_path), env={"EDGE_GATEWAY_UPDATE_STATUS": str(status)}).start()
    try:
        port = metrics_port(gw)
        assert not any(name.startswith("edge_gateway_update") for name, _ in scrape(port))
        status.write_text("OUTCOME=updated\nSLOT=B\nVERSION=2026.11.27-b\nPREVIOUS=2026.11.20-a\n"
                          "AT=2026-11-27T08:00:00Z\nDETAIL=healthy: marked good\n")
        samples = scrape(port)
        assert value(samples, "edge_gateway_update_info", outcome="updated", slot="B", version="2026.11.27-b",
                     previous="2026.11.20-a") == 1
        assert value(samples, "edge_gateway_update_timestamp_seconds") == 1_795_766_400
        status.write_text("OUTCOME=rolled_back\nSLOT=B\nVERSION=2026.11.27-b\nPREVIOUS=2026.11.28-c\n"
                          "AT=2026-11-28T09:30:00Z\n")
        assert value(scrape(port), "edge_gateway_update_info", outcome="rolled_back", slot="B",
                     version="2026.11.27-b", previous="2026.11.28-c") == 1
    finally:
        assert gw.stop() == 0, gw.log()
