"""The fleet pipeline's lander against a real Mosquitto on 127.0.0.1: raw messages landed as JSON lines
partitioned by date and gateway, acknowledged only after fsync + rename (manual acks), nothing lost when the
lander is SIGKILLed mid-stream; then the cloud side end to end (Mosquitto -> lander -> Spark)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from bridge_helpers import BridgeProcess, read_stats
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pipeline_fixtures import (
    LanderProcess,
    Mosquitto,
    envelope,
    landed_lines,
    mosquitto,
    payload_of,
    spark,
    wait_for,
)
from upstream_peers import LocalClient
from upstream_peers import Mosquitto as CloudBroker

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
    """Each message becomes one JSON line (topic, arrival UTC, msg_id User Property or null, payload as received:
    a JSON object embedded as the object (landing format 2), base64 when not UTF-8) in
    <landing>/date=<arrival date>/gateway=<from the topic>/part-*.jsonl; SIGTERM lands
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
        {"topic": "fleet/gw-1/buoy", "msg_id": "gw-1:1", "qos": 1, "retain": False, "payload": {"v": 1}},
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


def check_cloud_side(spark: Any, landing: Path, tables: Path, day: dt.date, devices: dict[tuple[str, str], int | range],
                     expected_duplicates: int | None, last: dt.date | None = None) -> dict[str, int]:  # fmt: skip
    """What the pipeline's end-to-end test asserts once data has landed: `run all` for ``day`` (to ``last``, for a run
    that crossed midnight UTC); no reading of ``devices`` ((gateway, device) -> readings sent, seq 0..n-1 in one
    boot, or the range of seqs sent when the first ones never reached the gateway) is missing, the completeness
    table shows no gap, and the dedup count equals ``expected_duplicates`` (the duplicates the bridge reported
    plus the redeliveries the landing shows), when given."""
    from pyspark.sql import functions as F

    from pipeline import jobs
    from pipeline import tables as tbl

    last = last or day
    cfg = jobs.JobConfig(landing=str(landing), tables=str(tables), as_of=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    stats = jobs.run(spark, cfg, "all", day, last)
    readings = tbl.read_table(spark, str(tables), "readings", day, last)
    per_device = readings.groupBy("gateway_id", "device").agg(F.count("seq").alias("n"), F.min("seq").alias("lo"),
                                                              F.max("seq").alias("hi"))  # fmt: skip
    got = {(r["gateway_id"], r["device"]): (r["n"], r["lo"], r["hi"]) for r in per_device.collect()}
    want = {k: seqs if isinstance(seqs, range) else range(seqs) for k, seqs in devices.items()}
    assert got == {k: (len(r), r[0], r[-1]) for k, r in want.items()}
    comp = tbl.read_table(spark, str(tables), "completeness", day, last)
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


E2E_GW = "gw-e2e"
E2E_DEVICE = "buoy-b01"
E2E_LINK = "cloud"
E2E_LANDER = "lander-e2e"


def _e2e_gateway_config(store: Path, cloud_port: int) -> str:
    """The edge gateway: LMDB store, one [[upstream]] to the cloud forwarding sensors/# as fleet/<gw>/<device>."""
    return f"""
[broker]
gateway_id = "{E2E_GW}"
sys_interval = "0.5s"
[store]
backend = "lmdb"
path = "{store}"
[listeners.external]
bind = "127.0.0.1:0"
[[upstream]]
name = "{E2E_LINK}"
url = "mqtt://127.0.0.1:{cloud_port}"
backoff_initial = "50ms"
backoff_max = "300ms"
connect_timeout = "3s"
drain_rate = 2000
[[upstream.forward]]
local = "sensors/#"
remote = "fleet/{{suffix}}"
qos = 1
"""


def _e2e_bridge_config(gateway_port: int, tty: Path, stats_file: Path) -> str:
    """firmware-bridge on the simulator's pty, publishing QoS 1 readings to the gateway."""
    return f"""
[bridge]
gateway_id = "{E2E_GW}"
stats_interval = "0.2s"
stats_file = "{stats_file}"
[mqtt]
broker = "127.0.0.1:{gateway_port}"
reconnect_min = "0.05s"
reconnect_max = "0.5s"
[[ports]]
path = "{tty}"
device = "{E2E_DEVICE}"
qos = 1
reopen_max = "0.02s"
"""


def _stop_pid(proc: subprocess.Popen[bytes] | None) -> int | None:
    """SIGTERM by PID and wait (SIGKILL after 10 s); the exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        return proc.wait()


def _sys(observer: LocalClient, key: str) -> str | None:
    """The latest ``$SYS/broker/connection/cloud/<key>`` value the observer received."""
    topic = f"$SYS/broker/connection/{E2E_LINK}/{key}"
    with observer.lock:
        values = [m.payload.decode() for m in observer.messages if m.topic == topic]
    return values[-1] if values else None


def _timeline(observer: LocalClient) -> list[tuple[str, int | str]]:
    """The link's state changes and the readings' seqs, in the order the gateway sent them to the observer."""
    state = f"$SYS/broker/connection/{E2E_LINK}/state"
    with observer.lock:
        messages = list(observer.messages)
    out: list[tuple[str, int | str]] = []
    for m in messages:
        if m.topic == state:
            out.append(("state", m.payload.decode()))
        elif m.topic.startswith(f"sensors/{E2E_GW}/"):
            out.append(("seq", int(json.loads(m.payload)["seq"])))
    return out


def _sync(observer: LocalClient, n: int) -> None:
    """Round trip a marker through the gateway: every ``$SYS`` value published before it has been received too (a
    ``$SYS`` batch is queued to the observer at once, so a batch seen in part is then seen whole)."""
    observer.publish("e2e/marker", str(n).encode(), 0)
    wait_for(lambda: str(n).encode() in observer.payloads("e2e/marker"), 10, "the marker back from the gateway")


def test_end_to_end_simulator_bridge_upstream_outage_lander_spark(spark: Any, make_broker: Any, tmp_path: Path) -> None:
    """The fleet data path end to end, every hop a real process on 127.0.0.1: `firmware-bridge simulate` replays the
    NERACOOS buoy B01 series on a real pty at 100 readings/s -> firmware-bridge (QoS 1) -> the edge gateway (LMDB store)
    -> its upstream bridge -> Mosquitto, the cloud -> the lander (`fleet-pipeline land`) -> Spark (`run all`). In the
    middle the cloud is stopped (SIGTERM by PID) while the board keeps sending, then restarted on the same port.

    The outage really happened: the link's ``$SYS`` state goes connected -> backing-off/connecting -> connected
    (2 connects), the outbox held the readings meanwhile, and the readings that reached the gateway while the link
    was down (between those state changes in the gateway's own stream to one observer) were all landed.

    No gap for QoS 1 data: every reading firmware-bridge published (its stats: ``readings``, last ``seq``, no
    ``gaps``/``lost``) is in Spark's readings table once, and the completeness table shows nothing missing. The
    first frames the board wrote before the bridge had the pty open are flushed by the open (pyserial discards
    the input queue) and never enter the QoS 1 chain: the series starts at the first seq the bridge published, and
    the completeness job (by design) does not count a first boot's seqs before its first reading as missing.

    The dedup count is exact. Where copies come from:

    - firmware-bridge's own ``duplicates`` counter is frames repeated on the serial line, dropped before MQTT: 0
      here and never in the landing; the gateway's outbox got each reading once (``forwarded/messages`` equals the
      readings published).
    - the upstream bridge reports its re-sends as ``publish/sent - forwarded/messages`` (PUBLISH packets sent
      beyond one acknowledgement per message). A re-send is a duplicate in the cloud only when the cloud had taken
      the first copy (its PUBACK was lost); a PUBLISH still unread in Mosquitto's socket when it stopped is resent
      but not duplicated. The cloud's own log says which: ``Received PUBLISH from <gateway>`` lines minus the
      readings are the copies it took twice (bounded by the re-sends).
    - the lander acknowledges only after its roll, so the messages in flight to it when the cloud stopped were
      landed (on the lost connection) and are sent again to its resumed persistent session: Mosquitto's
      ``Sending PUBLISH to <lander> (d1`` lines. The cloud is stopped while the lander holds >= 20 messages not
      yet rolled, so these are never zero; on loopback they are usually all the duplicates of the run (the
      upstream's re-sends are 0 or a PUBLISH Mosquitto never read).

    So the duplicates the dedup job removes = (copies the cloud took from the upstream bridge beyond one per reading)
    + (DUP redeliveries to the lander); every copy of a reading carries the same msg_id. The cloud keeps sessions
    across its restart (persistence, as a real cloud broker): an in-memory Mosquitto would lose the lander's
    session and what it had acknowledged to the gateway but not yet delivered, a gap made by the test's broker."""
    rate, count = 100, 1500
    landing, tables, store = tmp_path / "landing", tmp_path / "tables", tmp_path / "store"
    tty, stats_file = tmp_path / "ttyBUOY", tmp_path / "bridge-stats.json"
    cloud = CloudBroker(extra="log_type all\nlog_timestamp false").start()
    lander: LanderProcess | None = None
    bridge: BridgeProcess | None = None
    sim: subprocess.Popen[bytes] | None = None
    observer: LocalClient | None = None
    try:
        lander = LanderProcess(cloud.port, landing, E2E_LANDER, "--topic", "fleet/+/+", "--idle", "0.2s",
                               "--roll-interval", "0.5s", "--max-pending", "200").start()  # fmt: skip
        gw = make_broker(_e2e_gateway_config(store, cloud.port))
        obs = observer = LocalClient(gw.port, "observer-e2e")
        obs.subscribe(f"$SYS/broker/connection/{E2E_LINK}/#", 0)
        obs.subscribe(f"sensors/{E2E_GW}/+", 0)  # QoS 0 like $SYS: one stream, in the gateway's order
        obs.subscribe("e2e/marker", 0)
        wait_for(lambda: _sys(obs, "state") == "connected", 15, "the upstream link up")
        bridge = BridgeProcess(_e2e_bridge_config(gw.port, tty, stats_file), workdir=tmp_path).start()
        with open(tmp_path / "simulator.log", "wb") as sim_log:
            sim = subprocess.Popen(
                [sys.executable, "-m", "firmware_bridge", "simulate", "--link", str(tty), "--device", E2E_DEVICE,
                 "--rate", str(rate), "--count", str(count), "--boot", "3", "--log-level", "warning"],
                stdout=sim_log, stderr=subprocess.STDOUT,
            )  # fmt: skip

        # -- the outage, mid-stream --
        wait_for(lambda: len(landed_lines(landing)) >= 200, 30, "readings landed before the outage")
        # stop while the lander holds >= 20 messages it has not rolled yet, so not acknowledged (a roll is due
        # only when the oldest is 0.5 s old, ~50 messages): the cloud keeps them for the lander's session
        wait_for(lambda: lander.log().count("received fleet/") - len(landed_lines(landing)) >= 20, 10,
                 "20 messages awaiting the lander's roll")  # fmt: skip
        cloud.stop()
        wait_for(lambda: _sys(obs, "state") not in (None, "connected"), 10, "the link to go down")
        wait_for(lambda: int(_sys(obs, "backlog/messages") or 0) >= 300, 30, "300 readings in the outbox")
        forwarded_during_outage = int(_sys(obs, "forwarded/messages") or 0)
        cloud.start()  # same port, sessions restored from its persistence file
        wait_for(lambda: _sys(obs, "state") == "connected", 15, "the link to come back")
        assert sim.wait(60) == 0

        # -- drained: the board is done, firmware-bridge published everything, the outbox is empty --
        def bridge_done() -> bool:
            stats = read_stats(stats_file)
            return bool(stats and stats["mqtt"]["buffered"] == 0 and stats["devices"][E2E_DEVICE]["seq"] == count - 1)

        wait_for(bridge_done, 20, "firmware-bridge to publish the last reading")
        dev = (read_stats(stats_file) or {})["devices"][E2E_DEVICE]
        assert (dev["boot"], dev["gaps"], dev["lost"], dev["duplicates"], dev["seq_regressions"]) == (3, 0, 0, 0, 0)
        n = dev["readings"]
        sent = range(count - n, count)  # what entered the QoS 1 chain: seq first..count-1, no gap (gaps == 0)
        assert n >= count - 50  # at most the frames written before the bridge opened the pty were flushed
        wait_for(lambda: _sys(obs, "forwarded/messages") == str(n) and _sys(obs, "backlog/messages") == "0", 30,
                 "the upstream outbox to drain")  # fmt: skip
        _sync(obs, 1)
        wait_for(lambda: len({r["msg_id"] for r in landed_lines(landing)}) == n, 30, "every reading landed")
        assert lander.stop() == 0, lander.log()
        assert bridge.stop() == 0, bridge.log()

        # -- the outage happened, and what was published during it arrived --
        timeline = _timeline(obs)
        timeline = timeline[timeline.index(("state", "connected")) :]  # from the first connection on
        states = [v for kind, v in timeline if kind == "state"]
        assert states[-1] == "connected" and states.count("connected") == 2 and "backing-off" in states
        down = next(i for i, (kind, v) in enumerate(timeline) if kind == "state" and v != "connected")
        up = next(i for i, (kind, v) in enumerate(timeline) if i > down and kind == "state" and v == "connected")
        during = [v for kind, v in timeline[down:up] if kind == "seq"]
        assert len(during) >= 250  # the outbox held >= 300, a few of them in flight when the link dropped
        assert (_sys(obs, "connects"), _sys(obs, "dropped"), _sys(obs, "inflight")) == ("2", "0", "0")
        assert forwarded_during_outage + len(during) <= n
        lines = landed_lines(landing)
        landed = {payload_of(r)["seq"] for r in lines}
        assert set(during) <= landed and landed == set(sent)
        assert f"connection to 127.0.0.1:{cloud.port} lost" in lander.log()  # the lander saw the outage too ...
        assert lander.log().count("lander ready") == 2  # ... and resumed its session

        # -- where the duplicates come from --
        msg_ids: dict[int, set[str]] = {}
        for r in lines:
            msg_ids.setdefault(payload_of(r)["seq"], set()).add(r["msg_id"])
        assert all(len(ids) == 1 for ids in msg_ids.values())  # every copy of a reading has its one msg_id
        assert len({next(iter(ids)) for ids in msg_ids.values()}) == n
        resent = int(_sys(obs, "publish/sent") or 0) - int(_sys(obs, "forwarded/messages") or 0)
        cloud_log = cloud.log()
        taken = len(re.findall(rf"Received PUBLISH from {E2E_GW}-{E2E_LINK} \(d\d, q1, r0, m\d+, 'fleet/", cloud_log))
        upstream_duplicates = taken - n
        assert 0 <= upstream_duplicates <= resent
        redelivered = len(re.findall(rf"Sending PUBLISH to {E2E_LANDER} \(d1, q1, r0, m\d+, 'fleet/", cloud_log))
        assert redelivered > 0  # the cloud stopped while the lander had unacknowledged messages
        assert len(lines) == n + upstream_duplicates + redelivered
        days = sorted({dt.date.fromisoformat(payload_of(r)["gateway_time"][:10]) for r in lines})
        check_cloud_side(spark, landing, tables, days[0], {(E2E_GW, E2E_DEVICE): sent},
                         expected_duplicates=upstream_duplicates + redelivered, last=days[-1])  # fmt: skip
    finally:
        _stop_pid(sim)
        if bridge is not None:
            bridge.kill()
        if observer is not None:
            observer.close()
        if lander is not None:
            lander.kill()
        cloud.cleanup()
