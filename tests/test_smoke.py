"""End-to-end smoke tests with the Debian mosquitto clients against the real broker process."""

from __future__ import annotations

import subprocess
import time

from helpers import BrokerProcess


def test_mosquitto_pub_sub_round_trip(broker: BrokerProcess, uid: str) -> None:
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", f"{uid}/#", "-v", "-C", "3",
         "-W", "10", "-q", "2"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(0.5)
        for qos, version in ((0, "mqttv311"), (1, "mqttv311"), (2, "mqttv5")):
            subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", f"{uid}/q{qos}",
                            "-m", f"hello {qos}", "-q", str(qos), "-V", version], check=True, timeout=10)
        out, _ = sub.communicate(timeout=15)
    finally:
        sub.kill()
    assert out.splitlines() == [f"{uid}/q0 hello 0", f"{uid}/q1 hello 1", f"{uid}/q2 hello 2"]
