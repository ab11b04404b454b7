"""Prometheus metrics of the bridge (``[metrics] bind = "127.0.0.1:9884"`` in bridge.toml, off when absent):
``/metrics`` in the Prometheus text format, written by ``prometheus-client``.

As in the gateway (gateway/server/metrics.py), nothing is counted for Prometheus: :class:`BridgeCollector` reads
the counters the bridge keeps for ``bridge/<gw>/stats`` (:meth:`Bridge.stats`) when Prometheus scrapes. The
endpoint is prometheus-client's ``start_http_server`` thread; the snapshot is taken on the bridge's event loop
(``call_soon_threadsafe``), where its state is consistent, and the families are built in the HTTP thread.

Frames by protocol and outcome: ``ok`` for every frame that became a reading, fix or reply (a Modbus poll that
answered), else the reason the bridge counts it under (``bad_crc``, ``bad_json``, ``bad_field``, ``too_long``,
``garbage``, ``bad_checksum``, ``bad_sentence``, ``wrong_device``; Modbus: ``timeout``, ``bad_crc``, exception
codes, ...).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from firmware_bridge.frames import BAD_CHECKSUM, BAD_CRC, BAD_FIELD, BAD_JSON, BAD_SENTENCE, GARBAGE, TOO_LONG
from gateway.metrics_endpoint import call_on_loop

if TYPE_CHECKING:

    from firmware_bridge.bridge import Bridge

log = logging.getLogger("firmware_bridge")

#: Outcomes shown (as 0) per port before the first one happens, by protocol.
OUTCOMES = {
    "line-json": ("ok", BAD_CRC, BAD_JSON, BAD_FIELD, TOO_LONG, GARBAGE),
    "nmea": ("ok", BAD_CHECKSUM, BAD_SENTENCE, TOO_LONG, GARBAGE),
    "modbus-rtu": ("ok",),
}


class BridgeCollector(Collector):
    """A prometheus-client Collector over :meth:`Bridge.stats` and the devices' last reading times."""

    def __init__(self, bridge: Bridge, loop: asyncio.AbstractEventLoop) -> None:
        self.bridge = bridge
        self.loop = loop

    def describe(self) -> list[Metric]:
        return []

    def snapshot(self) -> tuple[dict[str, Any], dict[str, float | None]]:
        """``(Bridge.stats(), {device: seconds since its last reading, None before the first})``; on the loop."""
        now = time.monotonic()
        ages = {name: None if st.last_at is None else now - st.last_at for name, st in self.bridge.devices.items()}
        return self.bridge.stats(), ages

    def collect(self) -> Iterator[Metric]:
        snap = call_on_loop(self.loop, self.snapshot)
        if snap is None:
            return
        stats, ages = snap
        p = "firmware_bridge_"
        ports: dict[str, Any] = stats["ports"]
        devices: dict[str, Any] = stats["devices"]
        modbus: dict[str, Any] = stats["modbus"]
        frames = CounterMetricFamily(p + "frames_total", "Frames read from the serial ports, by port, protocol and "
                                     "outcome (ok, or the reason it was rejected: bad_crc, bad_json, too_long, ...).",
                                     labels=["port", "protocol", "outcome"])
        for path, st in ports.items():
            outcomes: dict[str, int] = dict.fromkeys(OUTCOMES.get(st["protocol"], ("ok",)), 0)
            outcomes["ok"] = st["frames"]
            for reason, n in st["rejected"].items():
                outcomes[reason] = outcomes.get(reason, 0) + n
            if st["protocol"] == "modbus-rtu":
                for name, dev in modbus.items():
                    if devices.get(name, {}).get("port", path) == path:
                        for reason, n in dev["faults"].items():
                            outcomes[reason] = outcomes.get(reason, 0) + n
            for outcome, n in outcomes.items():
                frames.add_metric([path, st["protocol"], outcome], n)
        yield frames
        ignored = CounterMetricFamily(p + "sentences_ignored_total", "NMEA sentences of kinds the bridge does not "
                                      "use, by port and sentence.", labels=["port", "sentence"])
        for path, st in ports.items():
            for sentence, n in st["ignored"].items():
                ignored.add_metric([path, sentence], n)
        yield ignored
        up = GaugeMetricFamily(p + "port_up", "1 while the serial port is open.", labels=["port", "protocol"])
        opens = CounterMetricFamily(p + "port_opens_total", "Times the port was opened.", labels=["port"])
        reopens = CounterMetricFamily(p + "port_reopens_total", "Times the port was opened again after the first "
                                      "(unplugged, failed, ...).", labels=["port"])
        errors = CounterMetricFamily(p + "port_errors_total", "Errors that closed the port.", labels=["port"])
        received = CounterMetricFamily(p + "port_received_bytes_total", "Bytes read from the port.", labels=["port"])
        for path, st in ports.items():
            up.add_metric([path, st["protocol"]], 1 if st["state"] == "open" else 0)
            opens.add_metric([path], st["opens"])
            reopens.add_metric([path], max(0, st["opens"] - 1))
            errors.add_metric([path], st["errors"])
            received.add_metric([path], st["bytes_in"])
        yield from (up, opens, reopens, errors, received)
        m = stats["mqtt"]
        yield GaugeMetricFamily(p + "mqtt_connected", "1 while connected to the broker.", 1 if m["connected"] else 0)
        yield CounterMetricFamily(p + "mqtt_connects_total", "Connections made to the broker.", m["connects"])
        yield CounterMetricFamily(p + "mqtt_published_total", "Messages the broker acknowledged (QoS 1) or took "
                                  "(QoS 0).", m["published"])
        yield GaugeMetricFamily(p + "buffered_readings", "Messages waiting in the bridge's buffer for the broker.",
                                m["buffered"])
        yield GaugeMetricFamily(p + "buffer_capacity", "[mqtt] buffer: messages the buffer holds at most.",
                                m["buffer_capacity"])
        dropped = CounterMetricFamily(p + "buffer_dropped_total", "Messages the full buffer dropped, by QoS class.",
                                      labels=["qos"])
        dropped.add_metric(["0"], m["dropped_qos0"])
        dropped.add_metric(["1"], m["dropped_qos1"])
        yield dropped
        labels = ["device", "port"]
        readings = CounterMetricFamily(p + "device_readings_total", "Readings published, by device.", labels=labels)
        lost = CounterMetricFamily(p + "device_lost_readings_total", "Readings missing from the sequence numbers.",
                                   labels=labels)
        reboots = CounterMetricFamily(p + "device_reboots_total", "Device restarts seen (boot counter changed).",
                                      labels=labels)
        age = GaugeMetricFamily(p + "device_last_reading_age_seconds", "Seconds since the device's last reading.",
                                labels=labels)
        for name, dev in devices.items():
            row = [name, dev["port"]]
            readings.add_metric(row, dev["readings"])
            lost.add_metric(row, dev["lost"])
            reboots.add_metric(row, dev["reboots"])
            seconds = ages.get(name)
            if seconds is not None:
                age.add_metric(row, seconds)
        yield from (readings, lost, reboots, age)
