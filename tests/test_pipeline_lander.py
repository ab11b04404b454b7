"""The fleet pipeline's lander against a real Mosquitto on 127.0.0.1 (issue 8): raw messages landed as JSON lines
partitioned by date and gateway, acknowledged only after fsync + rename (manual acks), nothing lost when the
lander is SIGKILLed mid-stream; then the cloud side end to end (Mosquitto -> lander -> Spark)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pipeline_fixtures import LanderProcess, Mosquitto, envelope, landed_lines, mosquitto, spark, wait_for

__all__ = ["mosquitto", "spark"]


def _publisher(port: int, client_id: str, version: int = mqtt.MQTTv5) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=version)
    client.max_inflight_messages_set(100)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def _close(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def _publish(client: mqtt.Client, topic: str, payload: bytes, msg_id: str | None = None) -> mqtt.MQTTMessageInfo:
    props = None
    if msg_id is not None:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("msg_id", msg_id)]
    return client.publish(topic, payload, qos=1, properties=props)


def _ids(landing: Path) -> list[str]:
    return [line["msg_id"] for line in landed_lines(landing)]


def test_lander_writes_raw_messages_as_json_lines_by_date_and_gateway(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """Each message becomes one JSON line (topic, arrival UTC, msg_id User Property or null, payload as received,
    base64 when not UTF-8) in <landing>/date=<arrival date>/gateway=<from the topic>/part-*.jsonl; SIGTERM lands
    what is pending, acknowledges it and exits 0, leaving no hidden temporary file."""
    landing = tmp_path / "landing"
    cid = "lander-format"
    lander = LanderProcess(mosquitto.port, landing, cid, "--topic", "fleet/+/+", "--idle", "60s").start()
    pub = _publisher(mosquitto.port, "pub-format")
    before = dt.datetime.now(dt.UTC)
    try:
        _publish(pub, "fleet/gw-1/buoy", b'{"v": 1}', "gw-1:1").wait_for_publish(5)
        _publish(pub, "fleet/gw-2/ctd", b"\xff\x00binary").wait_for_publish(5)
        _publish(pub, "elsewhere/gw-3/x", b"not subscribed").wait_for_publish(5)
    finally:
        _close(pub)
    wait_for(lambda: lander.log().count("received fleet/") == 2, 10, "the lander to receive both messages")
    assert landed_lines(landing) == []  # held in the hidden temporary files until a roll
    assert lander.stop() == 0, lander.log()
    after = dt.datetime.now(dt.UTC)
    assert mosquitto.count(rf"Received PUBACK from {cid} ") == 2
    files = sorted(p.relative_to(landing).parent.as_posix() for p in landing.rglob("*") if p.is_file())
    days = {before.strftime("%Y-%m-%d"), after.strftime("%Y-%m-%d")}
    assert files in [[f"date={d}/gateway=gw-1", f"date={d}/gateway=gw-2"] for d in days]
    lines = sorted(landed_lines(landing), key=lambda r: r["topic"])
    arrivals = [dt.datetime.fromisoformat(r.pop("arrival").replace("Z", "+00:00")) for r in lines]
    assert all(before <= a <= after for a in arrivals)
    assert lines == [
        {"topic": "fleet/gw-1/buoy", "msg_id": "gw-1:1", "qos": 1, "retain": False, "payload": '{"v": 1}'},
        {"topic": "fleet/gw-2/ctd", "msg_id": None, "qos": 1, "retain": False, "payload": None,
         "payload_b64": "/wBiaW5hcnk="},
    ]  # fmt: skip


def test_lander_acknowledges_only_after_the_file_is_renamed(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """Manual acks: a lander holding received messages in its hidden temporary file has sent no PUBACK (seen in
    Mosquitto's own log); killed with SIGKILL before its roll, nothing is visible, and the restarted lander
    (same persistent session) gets every message again from the broker and lands it (MQTT-4.6.0-2 order)."""
    landing = tmp_path / "landing"
    cid = "lander-ackorder"
    slow = ("--topic", "ack/+/+", "--idle", "60s", "--roll-interval", "60s", "--max-pending", "1000")
    lander = LanderProcess(mosquitto.port, landing, cid, *slow).start()
    pub = _publisher(mosquitto.port, "pub-ackorder")
    try:
        for i in range(50):
            _publish(pub, "ack/gw-9/dev", b"%d" % i, f"gw-9:{i}")
        wait_for(lambda: mosquitto.count(rf"Sending PUBLISH to {cid} ") == 50, 10, "50 PUBLISH sent to the lander")
        time.sleep(0.3)  # the PUBACKs would have come back by now if the lander sent any
        assert mosquitto.count(rf"Received PUBACK from {cid} ") == 0
        assert landed_lines(landing) == []
        lander.kill()
        assert len(list(landing.rglob("*.inprogress"))) == 1
        lander = LanderProcess(mosquitto.port, landing, cid, "--topic", "ack/+/+", "--idle", "0.2s").start()
        wait_for(lambda: len(landed_lines(landing)) >= 50, 15, "all 50 messages landed after the restart")
        wait_for(lambda: mosquitto.count(rf"Received PUBACK from {cid} ") == 50, 10, "50 PUBACKs")
    finally:
        _close(pub)
    assert lander.stop() == 0, lander.log()
    assert _ids(landing) == [f"gw-9:{i}" for i in range(50)]
    assert list(landing.rglob("*.inprogress")) == []  # the crashed run's temporary file was removed


def test_lander_sigkill_mid_stream_loses_no_qos1_message(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """A lander killed with SIGKILL while 3000 QoS 1 messages stream in, then restarted: every message is in the
    landing area at least once (duplicates allowed: the jobs remove them)."""
    landing = tmp_path / "landing"
    cid = "lander-kill"
    args = ("--topic", "kill/+/+", "--idle", "0.2s", "--roll-interval", "0.5s", "--max-pending", "200")
    lander = LanderProcess(mosquitto.port, landing, cid, *args).start()
    pub = _publisher(mosquitto.port, "pub-kill")
    total = 3000
    done = threading.Event()

    def publish_all() -> None:
        for i in range(total):
            _publish(pub, f"kill/gw-{i % 3}/dev", b"%d" % i, f"k:{i}")
            if i % 10 == 0:
                time.sleep(0.01)  # a paced stream (~3 s), so that the kill lands in the middle of it
        done.set()

    thread = threading.Thread(target=publish_all)
    thread.start()
    try:
        wait_for(lambda: len(_ids(landing)) >= 300, 30, "some messages landed")
        lander.kill()
        landed_at_kill = len(set(_ids(landing)))
        lander = LanderProcess(mosquitto.port, landing, cid, *args).start()
        thread.join(60)
        assert done.is_set()
        wait_for(lambda: len(set(_ids(landing))) == total, 60, "every message landed")
    finally:
        thread.join(60)
        _close(pub)
    assert lander.stop() == 0, lander.log()
    assert landed_at_kill < total  # the kill really was mid-stream
    ids = _ids(landing)
    assert set(ids) == {f"k:{i}" for i in range(total)}
    assert len(ids) >= total


def test_lander_mqtt311_persistent_session_lands_what_arrived_while_it_was_down(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """MQTT 3.1.1 (Clean Session 0): messages published while the lander is stopped are queued by the broker for
    its session and landed when it comes back; a 3.1.1 publisher carries no msg_id."""
    landing = tmp_path / "landing"
    args = ("--topic", "v311/+/+", "--mqtt-version", "3.1.1", "--idle", "0.2s")
    lander = LanderProcess(mosquitto.port, landing, "lander-311", *args).start()
    assert lander.stop() == 0, lander.log()
    pub = _publisher(mosquitto.port, "pub-311", mqtt.MQTTv311)
    try:
        for i in range(5):
            _publish(pub, "v311/gw-3/dev", b"%d" % i).wait_for_publish(5)
    finally:
        _close(pub)
    lander = LanderProcess(mosquitto.port, landing, "lander-311", *args).start()
    wait_for(lambda: len(landed_lines(landing)) == 5, 15, "5 queued messages landed")
    assert lander.stop() == 0, lander.log()
    assert [(r["payload"], r["msg_id"]) for r in landed_lines(landing)] == [(str(i), None) for i in range(5)]


def test_lander_reconnects_and_resubscribes_after_a_broker_restart(tmp_path: Path) -> None:
    """The cloud broker restarts (an in-memory Mosquitto: the session is gone): the lander reconnects with backoff,
    subscribes again and lands what is published afterwards; what it had landed before stays."""
    (tmp_path / "cloud").mkdir()
    broker = Mosquitto(tmp_path / "cloud").start()
    landing = tmp_path / "landing"
    lander = LanderProcess(broker.port, landing, "lander-restart", "--topic", "re/+/+", "--idle", "0.1s").start()
    try:
        pub = _publisher(broker.port, "pub-before")
        _publish(pub, "re/gw-5/dev", b"before", "gw-5:1").wait_for_publish(5)
        _close(pub)
        wait_for(lambda: _ids(landing) == ["gw-5:1"], 10, "the first message landed")
        broker.stop()
        wait_for(lambda: "connection to 127.0.0.1" in lander.log(), 10, "the lander to notice the broker is gone")
        broker.start(same_port=True)
        wait_for(lambda: lander.log().count("lander ready") == 2, 20, "the lander to reconnect and resubscribe")
        pub = _publisher(broker.port, "pub-after")
        _publish(pub, "re/gw-5/dev", b"after", "gw-5:2").wait_for_publish(5)
        _close(pub)
        wait_for(lambda: sorted(_ids(landing)) == ["gw-5:1", "gw-5:2"], 10, "the second message landed")
        assert lander.stop() == 0, lander.log()
    finally:
        lander.kill()
        broker.stop()


# -- the cloud side end to end ------------------------------------------------------------------------------------


def check_cloud_side(spark: Any, landing: Path, tables: Path, day: dt.date, devices: dict[tuple[str, str], int],
                     expected_duplicates: int | None) -> dict[str, int]:  # fmt: skip
    """What issue 8's end-to-end test asserts once data has landed: `run all` for ``day``; no reading of
    ``devices`` ((gateway, device) -> readings sent, seq 0..n-1 in one boot) is missing, the completeness table
    shows no gap, and the dedup count equals ``expected_duplicates`` (the duplicates the bridge reported plus
    the redeliveries the landing shows), when given."""
    from pyspark.sql import functions as F

    from pipeline import jobs
    from pipeline import tables as tbl

    cfg = jobs.JobConfig(landing=str(landing), tables=str(tables), as_of=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    stats = jobs.run(spark, cfg, "all", day, day)
    readings = tbl.read_table(spark, str(tables), "readings", day, day)
    per_device = readings.groupBy("gateway_id", "device").agg(F.count("seq").alias("n"), F.min("seq").alias("lo"),
                                                              F.max("seq").alias("hi"))  # fmt: skip
    got = {(r["gateway_id"], r["device"]): (r["n"], r["lo"], r["hi"]) for r in per_device.collect()}
    assert got == {k: (n, 0, n - 1) for k, n in devices.items()}
    comp = tbl.read_table(spark, str(tables), "completeness", day, day)
    assert comp.where("missing > 0").count() == 0
    assert stats["missing"] == 0 and stats["quarantine"] == 0
    if expected_duplicates is not None:
        assert stats["duplicates"] == expected_duplicates
    return stats


def test_cloud_side_publisher_lander_crash_spark_no_gap_and_exact_dedup(
    spark: Any, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Mosquitto -> lander -> Spark with what an upstream bridge sends: envelopes from two gateways at QoS 1, 40
    republished as after a reconnect (same msg_id), the lander SIGKILLed in the middle. Completeness shows no gap
    and the dedup count equals the duplicates in the landing area (the 40 plus the crash's redeliveries)."""
    landing, tables = tmp_path / "landing", tmp_path / "tables"
    cid = "lander-e2e"
    args = ("--topic", "fleet/+/+", "--idle", "0.2s", "--roll-interval", "0.5s", "--max-pending", "100")
    lander = LanderProcess(mosquitto.port, landing, cid, *args).start()
    pub = _publisher(mosquitto.port, "upstream-standin")
    start = dt.datetime.now(dt.UTC).replace(hour=0, minute=10, second=0, microsecond=0)  # all on one date
    per_device = 400
    devices = {("gw-1", "buoy-b01"): per_device, ("gw-2", "buoy-b02"): per_device}
    try:
        for seq in range(per_device):
            for gw, dev in devices:
                g = start + dt.timedelta(seconds=seq)
                payload = envelope(gw, dev, 1, seq, g, g - dt.timedelta(milliseconds=300),
                                   {"sea_surface_temperature": (12.0 + seq / 100, "degC")})  # fmt: skip
                _publish(pub, f"fleet/{gw}/{dev}", payload, f"{gw}:{seq}")
                if seq % 20 == 0 and gw == "gw-1":  # republished after a "reconnect"
                    _publish(pub, f"fleet/{gw}/{dev}", payload, f"{gw}:{seq}")
            if seq == per_device // 2:
                wait_for(lambda: len(landed_lines(landing)) >= 100, 20, "half landed")
                lander.kill()
                lander = LanderProcess(mosquitto.port, landing, cid, *args).start()
        total = 2 * per_device
        wait_for(lambda: len({r["msg_id"] for r in landed_lines(landing)}) == total, 30, "everything landed")
    finally:
        _close(pub)
    assert lander.stop() == 0, lander.log()
    lines = landed_lines(landing)
    assert len(lines) - total >= 20  # the 20 republished ones at least
    check_cloud_side(spark, landing, tables, start.date(), devices, expected_duplicates=len(lines) - total)


@pytest.mark.skip(
    reason="needs the sensor simulator and firmware-bridge (issue 5) and the gateway's upstream bridge (issue 6), "
    "built in parallel; completes with check_cloud_side() once they exist"
)
def test_end_to_end_simulator_bridge_upstream_outage_lander_spark() -> None:
    """Issue 8's end to end: the simulator replays the buoy series through firmware-bridge -> broker -> upstream ->
    Mosquitto -> lander -> Spark with an upstream outage in the middle; the completeness table shows no gap for
    QoS 1 data and the dedup count equals the duplicates the bridge reported.

    To complete: start the gateway broker with an [[upstream]] to `mosquitto.port` forwarding sensors/# to
    fleet/<gateway_id>/<device>, firmware-bridge on the simulator's pty, and a LanderProcess on fleet/+/+; stop the
    Mosquitto in the middle and restart it on the same port; when the simulator is done and the upstream backlog is
    drained, call check_cloud_side(spark, landing, tables, day, {(gateway_id, device): frames sent},
    expected_duplicates=<bridge-reported duplicates> + <lander redeliveries>)."""
    raise AssertionError("skipped")
