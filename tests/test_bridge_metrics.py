"""firmware-bridge Prometheus metrics: ``[metrics] bind`` in bridge.toml serves ``/metrics``. A simulated
board on a real pseudo-terminal, the bridge as a real subprocess, the real broker; scraped over HTTP on 127.0.0.1
and parsed with prometheus-client's parser."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_helpers import BridgeProcess
from firmware_bridge.simulator import SensorBoard, load_b01_series
from helpers import BrokerProcess, wait_until
from test_metrics import Samples, scrape, value

GW = "gw-metrics"
_METRICS = re.compile(r"metrics: Prometheus /metrics on http://(\S+):(\d+)/metrics")


def _port(bridge: BridgeProcess) -> int:
    for line in bridge.lines:
        m = _METRICS.search(line)
        if m:
            return int(m.group(2))
    raise AssertionError("no metrics line in the bridge's log:\n" + bridge.log())


def test_bridge_metrics_frames_port_buffer_and_device_age(make_broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Frames counted by protocol and outcome (3 ok, 1 bad_crc, 1 too_long, 1 garbage); an unplug and replug
    counts one reopen; with the broker gone, the 2 readings read meanwhile wait in the buffer; the device's last
    reading age grows while it is silent."""
    broker: BrokerProcess = make_broker('[listeners.internal]\nbind = "127.0.0.1:0"\n')
    board = SensorBoard("buoy-m", link=tmp_path / "tty-m", series=load_b01_series())
    board.plug()
    config = f"""
[bridge]
gateway_id = "{GW}"
stats_interval = "0"
[mqtt]
broker = "127.0.0.1:{broker.port}"
reconnect_min = "0.05s"
reconnect_max = "0.2s"
[metrics]
bind = "127.0.0.1:0"
[[ports]]
path = "{board.link}"
device = "buoy-m"
reopen_max = "0.2s"
"""
    bridge = BridgeProcess(config, workdir=tmp_path).start()
    path = str(board.link)
    try:
        port = _port(bridge)

        def frames(s: Samples, outcome: str) -> float:
            return value(s, "firmware_bridge_frames_total", port=path, protocol="line-json", outcome=outcome)

        s = scrape(port)
        assert frames(s, "ok") == 0 and frames(s, "bad_crc") == 0  # every outcome is there from the start
        assert value(s, "firmware_bridge_port_up", port=path, protocol="line-json") == 1
        board.send_reading()
        board.send_bad_crc()
        board.send_too_long()
        board.send_garbage()
        board.send_reading()
        board.send_reading()
        wait_until(lambda: frames(scrape(port), "ok") == 3, 10, "3 frames")
        s = scrape(port)
        assert frames(s, "bad_crc") == 1
        assert frames(s, "too_long") == 1
        assert frames(s, "garbage") == 1
        assert value(s, "firmware_bridge_device_readings_total", device="buoy-m", port=path) == 3
        assert value(s, "firmware_bridge_device_lost_readings_total", device="buoy-m", port=path) == 1
        age = value(s, "firmware_bridge_device_last_reading_age_seconds", device="buoy-m", port=path)
        assert 0 <= age < 5
        assert value(s, "firmware_bridge_port_opens_total", port=path) == 1
        assert value(s, "firmware_bridge_port_reopens_total", port=path) == 0

        board.unplug()
        wait_until(lambda: value(scrape(port), "firmware_bridge_port_up", port=path, protocol="line-json") == 0, 10,
                   "the port down")
        board.plug()
        wait_until(lambda: value(scrape(port), "firmware_bridge_port_up", port=path, protocol="line-json") == 1, 10,
                   "the port up again")
        s = scrape(port)
        assert value(s, "firmware_bridge_port_reopens_total", port=path) == 1
        assert value(s, "firmware_bridge_port_opens_total", port=path) == 2
        wait_until(lambda: value(scrape(port), "firmware_bridge_buffered_readings") == 0, 10, "the events published")
        assert value(scrape(port), "firmware_bridge_mqtt_connected") == 1

        broker.stop()
        wait_until(lambda: value(scrape(port), "firmware_bridge_mqtt_connected") == 0, 10, "the broker gone")
        board.send_reading()
        board.send_reading()
        wait_until(lambda: frames(scrape(port), "ok") == 5, 10, "5 frames")
        s = scrape(port)
        assert value(s, "firmware_bridge_buffered_readings") == 2
        assert value(s, "firmware_bridge_buffer_dropped_total", qos="1") == 0
        before = value(s, "firmware_bridge_device_last_reading_age_seconds", device="buoy-m", port=path)
        time.sleep(0.3)
        after = value(scrape(port), "firmware_bridge_device_last_reading_age_seconds", device="buoy-m", port=path)
        assert after >= before + 0.25
    finally:
        code = bridge.stop()
        board.close()
    assert code == 0, bridge.log()


@pytest.mark.parametrize(("bind", "error"), [
    ('"localhost"', "metrics.bind = 'localhost': must be a TCP \"host:port\""),
    ('"./m.sock"', "metrics.bind = './m.sock': must be a TCP \"host:port\""),
])
def test_bridge_metrics_bad_bind_is_named(tmp_path: Path, bind: str, error: str) -> None:
    """``firmware-bridge check-config`` names a bad ``[metrics] bind``, its value and what is allowed (exit 78)."""
    path = tmp_path / "bridge.toml"
    path.write_text(f"[metrics]\nbind = {bind}\n")
    result = subprocess.run([sys.executable, "-m", "firmware_bridge", "check-config", str(path)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 78
    assert error in result.stderr, result.stderr
