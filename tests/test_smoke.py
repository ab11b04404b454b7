"""End-to-end smoke tests with the Debian mosquitto clients against the real broker process."""

from __future__ import annotations

import subprocess

from helpers import BrokerProcess


def mosquitto_pub(port: int, topic: str, message: str, *options: str) -> None:
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-t", topic, "-m", message, *options],
                   check=True, timeout=10)


def test_mosquitto_pub_sub_round_trip(broker: BrokerProcess, uid: str) -> None:
    # A retained message the subscriber gets right after its SUBACK: once it is printed, the subscription is in
    # place and the publishes below reach it.
    mosquitto_pub(broker.port, f"{uid}/ready", "ready", "-r", "-q", "1")
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", f"{uid}/#", "-v", "-C", "4",
         "-W", "10", "-q", "2"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert sub.stdout is not None
        assert sub.stdout.readline() == f"{uid}/ready ready\n"  # -W 10: mosquitto_sub gives up after 10 s
        for qos, version in ((0, "mqttv311"), (1, "mqttv311"), (2, "mqttv5")):
            mosquitto_pub(broker.port, f"{uid}/q{qos}", f"hello {qos}", "-q", str(qos), "-V", version)
        out, _ = sub.communicate(timeout=15)
    finally:
        sub.kill()
        mosquitto_pub(broker.port, f"{uid}/ready", "", "-r", "-q", "1")
    assert out.splitlines() == [f"{uid}/q0 hello 0", f"{uid}/q1 hello 1", f"{uid}/q2 hello 2"]
