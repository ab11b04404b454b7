"""firmware-bridge end to end: simulated boards on real pseudo-terminals -> the bridge (a real subprocess) -> the
real broker -> real MQTT subscribers; commands back the other way.

One bridge serves the module, one board per test (each on its own pty, opened through a symlink as
``/dev/serial/by-id`` would be), so tests do not share sequence state.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from bridge_helpers import GARMIN_17N_LOG, BridgeProcess, Collector, free_port, wait_stats, wait_until
from firmware_bridge.frames import Command, FrameDecoder, Reading, crc16
from firmware_bridge.simulator import SensorBoard, load_b01_series
from helpers import BrokerProcess
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

GW = "gw-test"
TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
BOARDS = {  # name -> (device id, protocol)
    "main": ("buoy-b01", "line-json"),
    "faults": ("buoy-f", "line-json"),
    "plug": ("buoy-u", "line-json"),
    "reboot": ("buoy-r", "line-json"),
    "cmd": ("buoy-c", "line-json"),
    "gps": ("gps-1", "nmea"),
}


@dataclass
class Rig:
    broker: BrokerProcess
    bridge: BridgeProcess
    boards: dict[str, SensorBoard]
    sub: Collector
    stats_file: Path
    started: float

    def path(self, name: str) -> str:
        return str(self.boards[name].link)

    def stats(self, predicate: Callable[[dict[str, Any]], bool], what: str = "stats") -> dict[str, Any]:
        try:
            return wait_stats(self.stats_file, predicate, 10, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nbridge log:\n{self.bridge.log()}") from None


def _config(workdir: Path, broker_port: int, boards: dict[str, SensorBoard]) -> str:
    ports = ""
    for name, board in boards.items():
        protocol = BOARDS[name][1]
        ports += (
            f'[[ports]]\npath = "{board.link}"\nprotocol = "{protocol}"\ndevice = "{board.device}"\n'
            'reopen_max = "0.2s"\n'
        )
    # a configured board that is never plugged in: commands to it are refused as device_offline
    ports += f'[[ports]]\npath = "{workdir}/tty-absent"\ndevice = "buoy-x"\nreopen_max = "0.2s"\n'
    return f"""
[bridge]
gateway_id = "{GW}"
stats_interval = "0.05s"
stats_file = "{workdir}/stats.json"
command_timeout = "0.5s"

[mqtt]
broker = "127.0.0.1:{broker_port}"
client_id = "fw-bridge-{os.getpid()}"
reconnect_min = "0.05s"
reconnect_max = "0.5s"

{ports}"""


@pytest.fixture(scope="module")
def rig(broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    workdir = tmp_path_factory.mktemp("bridge")
    series = load_b01_series()
    boards = {
        name: SensorBoard(device, link=workdir / f"tty-{name}", series=series) for name, (device, _) in BOARDS.items()
    }
    for board in boards.values():
        board.plug()
    sub = Collector(broker.port, [f"sensors/{GW}/#", f"bridge/{GW}/events", f"cmd/{GW}/+/reply", "test-replies/#"])
    started = time.time()
    bridge = BridgeProcess(_config(workdir, broker.port, boards), workdir=workdir).start()
    try:
        stats_file = workdir / "stats.json"
        wait_stats(
            stats_file,
            lambda s: (
                all(p["state"] == "open" for path, p in s["ports"].items() if not path.endswith("absent"))
                and s["mqtt"]["connected"]
            ),
            10,
            "all ports open",
        )
        yield Rig(broker, bridge, boards, sub, stats_file, started)
    finally:
        sub.close()
        code = bridge.stop()
        for board in boards.values():
            board.close()
    assert code == 0, bridge.log()
    assert "Traceback" not in bridge.log(), bridge.log()


def _envelope(
    device: str, boot: int, seq: int, sensor_time: str | None, values: dict[str, Any], got: dict[str, Any]
) -> dict[str, Any]:
    return {
        "v": 1,
        "gateway_id": GW,
        "device": device,
        "boot": boot,
        "seq": seq,
        "sensor_time": sensor_time,
        "gateway_time": got["gateway_time"],
        "values": values,
    }


def test_frames_become_reading_envelopes_through_the_real_broker(rig: Rig) -> None:
    """Frames on a real pty -> MQTT messages received by a real subscriber through the real
    broker, each the docs/message-format.md envelope (the first five NERACOOS B01 rows), QoS 1, Payload Format
    Indicator 1 and Content Type application/json."""
    board = rig.boards["main"]
    assert [board.send_reading() for _ in range(5)] == [0, 1, 2, 3, 4]
    topic = f"sensors/{GW}/buoy-b01"
    got = rig.sub.wait_json(topic, 5)
    b01 = [
        ("2016-02-15T00:00:00.000Z", 4.929),
        ("2016-02-15T00:30:00.000Z", 4.887),
        ("2016-02-15T01:00:00.000Z", 4.821),
        ("2016-02-15T01:30:00.000Z", 4.837),
        ("2016-02-15T02:00:00.000Z", 4.83),
    ]
    assert load_b01_series()[:5] == b01
    for seq, (msg, (stamp, temp)) in enumerate(zip(got, b01)):
        assert msg == _envelope(
            "buoy-b01", 1, seq, stamp, {"sea_surface_temperature": {"value": temp, "unit": "degC"}}, msg
        )
        assert TIME_RE.match(msg["gateway_time"])
        received = datetime.strptime(msg["gateway_time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
        assert rig.started - 1 <= received <= time.time() + 1
    raw = rig.sub.on(topic)
    assert len(raw) == 5
    assert {m.qos for m in raw} == {1}
    assert {m.properties.PayloadFormatIndicator for m in raw} == {1}
    assert {m.properties.ContentType for m in raw} == {"application/json"}
    stats = rig.stats(lambda s: s["devices"]["buoy-b01"]["readings"] == 5)
    assert stats["devices"]["buoy-b01"] == {
        "port": rig.path("main"),
        "boot": 1,
        "seq": 4,
        "readings": 5,
        "gaps": 0,
        "lost": 0,
        "reboots": 0,
        "duplicates": 0,
        "seq_regressions": 0,
    }


def _framed(body: bytes) -> bytes:
    return body + b"*%04X\n" % crc16(body)


def test_faults_publish_nothing_wrong_and_the_bridge_keeps_running(rig: Rig) -> None:
    """Garbage, binary noise, a bad CRC, an over-long line, bad JSON and bad fields are each dropped and
    counted by reason (PROTOCOL.md "What happens to bad input"); only the valid frames are published, the frame
    lost to the bad CRC is reported as a gap, a duplicate is dropped, and the bridge keeps running."""
    board = rig.boards["faults"]
    board.send_reading()  # seq 0
    board.send_garbage()  # a line of binary noise and ANSI escapes
    board.send_reading()  # seq 1
    assert board.send_bad_crc() == 2  # seq 2 never arrives intact
    board.send_too_long()
    board.write(bytes(range(256)).replace(b"\n", b""))  # binary noise without a newline, right before seq 3
    board.send_reading()  # seq 3
    board.write(_framed(b'{"dev":"buoy-f","boot":1,"seq":99,"v":{}}'))  # CRC fine, no quantities
    board.write(_framed(b"{this is not json}"))
    _, frame = board.next_frame()  # seq 4 ...
    board.write(frame)
    board.write(frame)  # ... sent twice
    board.send_reading()  # seq 5: everything before it has been handled once it arrives
    topic = f"sensors/{GW}/buoy-f"
    got = rig.sub.wait_json(topic, 4)
    wait_until(lambda: rig.sub.json(topic)[-1]["seq"] == 5, 10, "seq 5")
    assert [(m["boot"], m["seq"]) for m in rig.sub.json(topic)] == [(1, 0), (1, 1), (1, 3), (1, 4), (1, 5)]
    got = rig.sub.json(topic)
    assert all(m["values"]["sea_surface_temperature"]["unit"] == "degC" for m in got)
    stats = rig.stats(lambda s: s["devices"]["buoy-f"]["readings"] == 5, "buoy-f stats")
    assert stats["ports"][rig.path("faults")]["rejected"] == {
        "bad_crc": 1,
        "bad_field": 1,
        "bad_json": 1,
        "garbage": 2,
        "too_long": 1,
    }
    assert stats["devices"]["buoy-f"] | {"port": None} == {
        "port": None,
        "boot": 1,
        "seq": 5,
        "readings": 5,
        "gaps": 1,
        "lost": 1,
        "reboots": 0,
        "duplicates": 1,
        "seq_regressions": 0,
    }
    gaps = [e for e in rig.sub.json(f"bridge/{GW}/events") if e.get("device") == "buoy-f"]
    assert [(e["event"], e["boot"], e["from_seq"], e["to_seq"], e["missing"]) for e in gaps] == [("gap", 1, 2, 2, 1)]
    assert rig.bridge.running
    # the log is rate-limited: one line for the first garbage line, the second is counted, not logged
    assert rig.bridge.count(f"port {rig.path('faults')}: garbage") == 1


def test_unplug_and_replug_recover_without_a_restart(rig: Rig) -> None:
    """Unplug (the pty closes and its by-id style symlink disappears) is logged once, the bridge retries
    with backoff, and resumes on the new pty when the device returns, without a restart and without a gap."""
    board = rig.boards["plug"]
    path = rig.path("plug")
    board.send_reading()
    board.send_reading()
    topic = f"sensors/{GW}/buoy-u"
    rig.sub.wait_json(topic, 2)
    board.unplug()
    rig.stats(lambda s: s["ports"][path]["state"] == "closed", "port closed")
    time.sleep(0.3)  # let the bridge fail to reopen the missing path a few times (it must not log each one)
    board.plug()
    assert os.readlink(path) == board.path
    rig.stats(lambda s: s["ports"][path]["state"] == "open" and s["ports"][path]["opens"] == 2, "port reopened")
    board.send_reading()
    board.send_reading()
    got = rig.sub.wait_json(topic, 4)
    assert [(m["boot"], m["seq"]) for m in got] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    events = [(e["event"], e.get("port")) for e in rig.sub.json(f"bridge/{GW}/events") if e.get("port") == path]
    assert events[-2:] == [("port_down", path), ("port_up", path)]
    assert rig.bridge.count(f"port {path} lost") == 1
    assert rig.bridge.count(f"port {path} unavailable") == 0  # the outage was already logged once
    assert rig.bridge.count(f"port {path} open") == 2
    assert rig.bridge.running


def test_reboot_with_seq_reset_is_reported_as_a_reboot_not_a_gap(rig: Rig) -> None:
    """docs/message-format.md: "a new boot is a reboot, not a gap". The board restarts (boot 1 -> 2, seq back to 0):
    every reading is published, one reboot event is published and no gap is counted."""
    board = rig.boards["reboot"]
    for _ in range(3):
        board.send_reading()
    board.reboot()
    board.send_reading()
    board.send_reading()
    topic = f"sensors/{GW}/buoy-r"
    got = rig.sub.wait_json(topic, 5)
    assert [(m["boot"], m["seq"]) for m in got] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    events = [e for e in rig.sub.json(f"bridge/{GW}/events") if e.get("device") == "buoy-r"]
    assert [(e["event"], e["from_boot"], e["to_boot"], e["last_seq"], e["seq"]) for e in events] == [
        ("reboot", 1, 2, 2, 0)
    ]
    stats = rig.stats(lambda s: s["devices"]["buoy-r"]["readings"] == 5)
    assert (
        stats["devices"]["buoy-r"]["reboots"],
        stats["devices"]["buoy-r"]["gaps"],
        stats["devices"]["buoy-r"]["lost"],
    ) == (1, 0, 0)
    assert "device buoy-r rebooted: boot 1 -> 2" in rig.bridge.log()


def test_nmea_sentences_from_a_real_receiver_log_are_published_as_fixes(rig: Rig) -> None:
    """NMEA 0183 from a real receiver's log (gpsd's garmin17n.log, Garmin 17N) over a pty: GGA and RMC
    become fix readings with the values gpsd decodes from the same log; the bridge numbers them (boot = its start
    time, seq from 0); the other sentences are counted as ignored."""
    board = rig.boards["gps"]
    board.write(GARMIN_17N_LOG.replace("\n", "\r\n").encode())
    got = rig.sub.wait_json(f"sensors/{GW}/gps-1", 4)
    boot = got[0]["boot"]
    assert int(rig.started) - 1 <= boot <= int(rig.started) + 5
    position = {"latitude": {"value": 52.219065, "unit": "deg"}, "longitude": {"value": 21.010851667, "unit": "deg"}}
    rmc = position | {
        "speed_over_ground": {"value": 0.0, "unit": "kn"},
        "course_over_ground": {"value": 226.0, "unit": "deg"},
    }
    gga = position | {
        "altitude": {"value": 137.2, "unit": "m"},
        "fix_quality": {"value": 2, "unit": "1"},
        "satellites": {"value": 10, "unit": "1"},
        "hdop": {"value": 0.9, "unit": "1"},
    }
    assert got == [
        _envelope("gps-1", boot, 0, "2005-03-16T09:38:02.000Z", rmc, got[0]),
        _envelope("gps-1", boot, 1, "2005-03-16T09:38:02.000Z", gga, got[1]),
        _envelope("gps-1", boot, 2, "2005-03-16T09:38:03.000Z", rmc, got[2]),
        _envelope("gps-1", boot, 3, "2005-03-16T09:38:03.000Z", gga, got[3]),
    ]
    stats = rig.stats(lambda s: s["ports"][rig.path("gps")]["frames"] == 4)
    port = stats["ports"][rig.path("gps")]
    assert port["rejected"] == {}
    assert port["ignored"] == {
        "GLL": 2,
        "GSA": 2,
        "GSV": 2,
        "PGRMB": 2,
        "PGRME": 2,
        "PGRMF": 2,
        "PGRMM": 2,
        "PGRMV": 2,
        "VTG": 2,
    }


def _command(
    port: int, topic: str, payload: bytes, response_topic: str | None = None, correlation: bytes | None = None
) -> None:
    """Publish one command with a real MQTT 5 client (QoS 1, waits for the PUBACK)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        info = client.publish(topic, payload, qos=1, properties=props)
        info.wait_for_publish(5)
        assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def test_command_reaches_the_board_and_its_reply_comes_back(rig: Rig) -> None:
    """Downlink: a command on cmd/<gw>/<device>/<command> is written to the board's port as the documented
    line (PROTOCOL.md "Commands and replies"); the board's reply is published to the command's MQTT 5 Response
    Topic with its Correlation Data, or to cmd/<gw>/<device>/reply (also for an MQTT 3.1.1 mosquitto_pub)."""
    board = rig.boards["cmd"]
    port = rig.broker.port
    _command(port, f"cmd/{GW}/buoy-c/ping", b"", "test-replies/ping", b"corr-\x00\x01")
    wait_until(lambda: len(board.commands) == 1, 10, "the command at the board")
    ping = board.commands[0]
    assert ping == Command("buoy-c", "ping", ping.id, {})
    [reply] = rig.sub.wait_json("test-replies/ping", 1)
    assert reply == {
        "v": 1,
        "gateway_id": GW,
        "device": "buoy-c",
        "id": ping.id,
        "command": "ping",
        "ok": True,
        "boot": 1,
        "data": {"pong": True},
        "gateway_time": reply["gateway_time"],
    }
    assert rig.sub.on("test-replies/ping")[0].properties.CorrelationData == b"corr-\x00\x01"

    _command(port, f"cmd/{GW}/buoy-c/set_interval", b'{"seconds": 60}')
    default = f"cmd/{GW}/buoy-c/reply"
    [reply] = rig.sub.wait_json(default, 1)
    assert board.commands[1] == Command("buoy-c", "set_interval", reply["id"], {"seconds": 60})
    assert (reply["ok"], reply["data"]) == (True, {"interval_s": 60.0})
    assert board.interval == 60.0

    subprocess.run(
        [
            "mosquitto_pub",
            "-V",
            "mqttv311",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-q",
            "1",
            "-t",
            f"cmd/{GW}/buoy-c/calibrate",
            "-m",
            "{}",
        ],
        check=True,
        timeout=10,
    )
    replies = rig.sub.wait_json(default, 2)
    assert (replies[1]["command"], replies[1]["ok"], replies[1]["error"]) == ("calibrate", False, "unknown_command")
    assert [c.cmd for c in board.commands] == ["ping", "set_interval", "calibrate"]
    assert rig.bridge.running


def test_bad_commands_are_refused_without_reaching_the_board(rig: Rig) -> None:
    """Downlink errors (docs/message-format.md, commands): a payload that is not a JSON object -> bad_request; a
    configured device whose port is not open -> device_offline; neither is written to any port."""
    board = rig.boards["cmd"]
    before = len(board.commands)
    _command(rig.broker.port, f"cmd/{GW}/buoy-c/ping", b"not json", "test-replies/bad")
    _command(rig.broker.port, f"cmd/{GW}/buoy-x/ping", b"{}", "test-replies/bad")
    got = rig.sub.wait_json("test-replies/bad", 2)
    assert [(r["device"], r["command"], r["ok"], r["error"], r["id"]) for r in got] == [
        ("buoy-c", "ping", False, "bad_request", None),
        ("buoy-x", "ping", False, "device_offline", None),
    ]
    assert len(board.commands) == before


def test_command_without_a_reply_times_out(rig: Rig) -> None:
    """PROTOCOL.md: a board must answer within command_timeout (0.5 s here); when it does not, the requester gets
    ok false, error "timeout", and a late reply is counted as unexpected_reply instead of being published."""
    board = rig.boards["cmd"]
    board.answer_commands = False
    try:
        _command(rig.broker.port, f"cmd/{GW}/buoy-c/info", b"", "test-replies/timeout")
        [reply] = rig.sub.wait_json("test-replies/timeout", 1)
        assert (reply["command"], reply["ok"], reply["error"]) == ("info", False, "timeout")
        cmd = board.commands[-1]
        assert (cmd.cmd, cmd.id) == ("info", reply["id"])
    finally:
        board.answer_commands = True
    board._answer(cmd)  # the late reply
    stats = rig.stats(lambda s: s["ports"][rig.path("cmd")]["rejected"].get("unexpected_reply") == 1)
    assert stats["commands"]["timeout"] == 1
    assert len(rig.sub.on("test-replies/timeout")) == 1


def test_sd_notify_ready_only_once_connected_and_sigterm_exits_cleanly(
    make_broker: Callable[[str], BrokerProcess], tmp_path: Path
) -> None:
    """sd_notify READY=1 once the broker connection is up (not before: the bridge starts while the
    broker is down), WATCHDOG=1 every half WATCHDOG_USEC while running (the unit's WatchdogSec=),
    STOPPING=1 and exit code 0 on SIGTERM."""
    sockdir = tempfile.mkdtemp(prefix="fwb-", dir="/tmp")
    notify_path = os.path.join(sockdir, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.setblocking(False)
    received: list[str] = []

    def drain() -> list[str]:
        while True:
            try:
                received.append(notify.recv(4096).decode())
            except BlockingIOError:
                return received

    port = free_port()
    board = SensorBoard("buoy-n", link=tmp_path / "tty-n")
    board.plug()
    bridge = BridgeProcess(
        f"""
[bridge]
gateway_id = "{GW}-n"
[mqtt]
broker = "127.0.0.1:{port}"
reconnect_min = "0.05s"
reconnect_max = "0.2s"
[[ports]]
path = "{board.link}"
""",
        workdir=tmp_path,
        env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"},
    )
    try:
        bridge.start(wait_for="unreachable")
        assert bridge.running
        assert not [m for m in drain() if "READY=1" in m]
        make_broker(f'[listeners.internal]\nbind = "127.0.0.1:{port}"\n')
        wait_until(lambda: [m for m in drain() if "READY=1" in m], 10, "READY=1")
        board.send_reading()
        wait_until(lambda: bridge.count("device buoy-n seen") == 1, 10, "the reading")
        wait_until(lambda: sum(m == "WATCHDOG=1" for m in drain()) >= 3, 5, "WATCHDOG=1 pings")
        assert bridge.stop() == 0
        wait_until(lambda: [m for m in drain() if "STOPPING=1" in m], 5, "STOPPING=1")
        assert [m for m in received if m == "READY=1"] == ["READY=1"]
        assert "stopped" in bridge.lines[-1]
    finally:
        bridge.kill()
        board.close()
        notify.close()
        os.unlink(notify_path)
        os.rmdir(sockdir)


def test_invalid_config_exits_78_naming_every_bad_key(tmp_path: Path) -> None:
    """`firmware-bridge run --config` refuses an invalid file with exit code 78 (EX_CONFIG, as edge-gateway) and
    one line per mistake; check-config accepts a valid one."""
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[bridge]\ngateway_id = "a/b"\nspeed = 1\n[mqtt]\nbroker = "nohost"\nbuffer = 0\n'
        '[[ports]]\npath = "/dev/ttyUSB0"\nprotocol = "nmea"\nparity = "maybe"\nqos = 3\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "firmware_bridge", "run", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 78
    for needle in (
        "bridge.gateway_id = 'a/b'",
        "bridge.speed: unknown key",
        "mqtt.broker = 'nohost'",
        "mqtt.buffer = 0",
        "ports[0].parity = 'maybe'",
        "ports[0].qos = 3",
        "ports[0].device: required",
    ):
        assert needle in result.stderr, (needle, result.stderr)
    good = tmp_path / "good.toml"
    good.write_text('[bridge]\ngateway_id = "gw-9"\n[[ports]]\npath = "/dev/serial/by-id/usb-x"\n')
    result = subprocess.run(
        [sys.executable, "-m", "firmware_bridge", "check-config", str(good)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert result.stdout == f"{good}: ok (gateway gw-9, broker 127.0.0.1:1884, 1 port(s))\n"


def test_simulate_command_plays_the_b01_series_on_a_pty(tmp_path: Path) -> None:
    """`firmware-bridge simulate` prints its pty path and plays the NERACOOS B01 series with seq/boot as firmware
    would; SIGTERM ends it with exit code 0."""
    link = tmp_path / "tty-sim"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "firmware_bridge",
            "simulate",
            "--link",
            str(link),
            "--rate",
            "50",
            "--boot",
            "7",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert re.match(r"^/dev/pts/\d+ \(link .+\)$", first), first
        assert os.readlink(link) == first.split()[0]
        fd = os.open(link, os.O_RDONLY | os.O_NOCTTY)
        try:
            decoder = FrameDecoder()
            readings: list[Reading] = []
            deadline = time.monotonic() + 10
            while len(readings) < 3 and time.monotonic() < deadline:
                readings += [e for e in decoder.feed(os.read(fd, 4096)) if isinstance(e, Reading)]
        finally:
            os.close(fd)
        series = load_b01_series()
        assert len(readings) >= 3
        for r in readings:
            stamp, temp = series[r.seq]
            assert r == Reading("buoy-b01", 7, r.seq, stamp, {"sea_surface_temperature": (temp, "degC")})
        assert [r.seq for r in readings] == list(range(readings[0].seq, readings[0].seq + len(readings)))
    finally:
        proc.terminate()
        code = proc.wait(10)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert code == 0
    assert not link.exists()


def test_sigterm_while_the_broker_is_down_exits_cleanly(tmp_path: Path) -> None:
    """A clean exit on SIGTERM, also when the broker cannot be reached: the port closes, the bridge says
    how many buffered readings it could not deliver, and exits 0."""
    board = SensorBoard("buoy-d", link=tmp_path / "tty-d")
    board.plug()
    bridge = BridgeProcess(
        f'[mqtt]\nbroker = "127.0.0.1:{free_port()}"\nreconnect_max = "0.2s"\n[[ports]]\npath = "{board.link}"\n',
        workdir=tmp_path,
    )
    try:
        bridge.start(wait_for="unreachable")
        wait_until(lambda: bridge.count(f"port {board.link} open") == 1, 10, "the port open")
        board.send_reading()
        # "seen" is logged while the first reading is handled, so it is buffered by then; a second reading could
        # still be on its way when SIGTERM arrives (a race this test had), so there is one.
        wait_until(lambda: bridge.count("device buoy-d seen") == 1, 10, "the reading")
        assert bridge.stop() == 0
    finally:
        bridge.kill()
        board.close()
    # port_up, the reading, port_down
    assert bridge.count("3 buffered message(s) not published before exit") == 1, bridge.log()
    assert "stopped: 0 published" in bridge.lines[-1]
