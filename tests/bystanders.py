"""A well-behaved pair of clients that must lose nothing while a hostile or careless client misbehaves beside them.

Every isolation test ("Isolation and bounds by default") runs one :class:`QoS1Pair` next to the client
under test: a real paho-mqtt publisher sends numbered QoS 1 messages while a real paho-mqtt subscriber with a
persistent session (Clean Session 0) receives them; :meth:`QoS1Pair.finish` checks that every message the broker
acknowledged (PUBACK) reached the subscriber.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


class QoS1Pair:
    """A publisher and a persistent subscriber exchanging numbered QoS 1 messages on ``bystander/<name>``.

    Args:
        port: the broker's loopback port.
        name: unique per test (client ids ``<name>-pub`` / ``<name>-sub``).
        count: messages to publish.
        interval: seconds between publishes (spreads the exchange over the hostile client's activity).
        version: paho protocol (``mqtt.MQTTv311`` or ``mqtt.MQTTv5``).
        max_inflight: QoS 1 messages the publisher leaves unacknowledged at most (paho does not follow the
            broker's Receive Maximum by itself: keep this at or below ``max_awaiting_rel``).
    """

    def __init__(
        self,
        port: int,
        name: str,
        count: int = 200,
        interval: float = 0.005,
        version: Any = mqtt.MQTTv311,
        max_inflight: int = 20,
    ) -> None:
        self.port = port
        self.name = name
        self.count = count
        self.interval = interval
        self.topic = f"bystander/{name}"
        self.received: set[int] = set()
        self.acked: set[int] = set()
        self.refused: list[tuple[int, Any]] = []
        #: What happened to the two connections, for the failure message: ("pub"/"sub", "connect"/"disconnect",
        #: reason, seconds since start).
        self.events: list[tuple[str, str, str, float]] = []
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._subscribed = threading.Event()
        self._v5 = version == mqtt.MQTTv5
        kw: dict[str, Any] = {"protocol": version}
        if not self._v5:
            kw["clean_session"] = False
        self.sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{name}-sub", **kw)
        self.sub.on_message = self._on_message
        self.sub.on_connect = self._on_sub_connect
        self.sub.on_subscribe = lambda *a: self._subscribed.set()
        self.pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{name}-pub", **kw)
        self.pub.max_inflight_messages_set(max_inflight)
        self.pub.on_publish = self._on_publish
        self.pub.on_connect = lambda c, u, f, reason, p: self._event("pub", "connect", reason)
        for who, client in (("pub", self.pub), ("sub", self.sub)):
            client.on_disconnect = lambda c, u, f, reason, p, who=who: self._event(who, "disconnect", reason)

    def _event(self, who: str, what: str, reason: Any) -> None:
        with self._lock:
            self.events.append((who, what, str(reason), round(time.monotonic() - self._t0, 2)))

    def _on_sub_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._event("sub", "connect", reason)
        client.subscribe(self.topic, qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.add(int(msg.payload))

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        number = self._mids.get(mid)
        if number is None:
            return
        with self._lock:
            if reason is not None and getattr(reason, "is_failure", False):
                self.refused.append((number, reason))
            else:
                self.acked.add(number)

    def start(self) -> QoS1Pair:
        """Connect both, subscribe, and start publishing in a background thread."""
        self._mids: dict[int, int] = {}
        if self._v5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
            self.sub.connect("127.0.0.1", self.port, keepalive=30, clean_start=False, properties=props)
        else:
            self.sub.connect("127.0.0.1", self.port, keepalive=30)
        self.sub.loop_start()
        if not self._subscribed.wait(10):
            raise AssertionError(f"{self.name}: the bystander subscriber could not subscribe")
        self.pub.connect("127.0.0.1", self.port, keepalive=30)
        self.pub.loop_start()
        self._thread = threading.Thread(target=self._publish_all, daemon=True)
        self._thread.start()
        return self

    def _publish_all(self) -> None:
        for number in range(self.count):
            info = self.pub.publish(self.topic, str(number).encode(), qos=1)
            self._mids[info.mid] = number
            time.sleep(self.interval)

    def finish(self, timeout: float = 30.0) -> None:
        """Wait until every message is acknowledged and every acknowledged message arrived; raise
        AssertionError naming what was lost otherwise."""
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.acked) + len(self.refused) >= self.count and self.acked <= self.received:
                    break
            time.sleep(0.05)
        for client in (self.pub, self.sub):
            client.disconnect()
            client.loop_stop()
        with self._lock:
            lost = sorted(self.acked - self.received)
            unacked = self.count - len(self.acked)
            events = f"; connections: {self.events[:20]}"
        assert not lost, f"{self.name}: {len(lost)} acknowledged messages never arrived: {lost[:20]}{events}"
        assert not self.refused, f"{self.name}: the broker refused bystander messages: {self.refused[:5]}{events}"
        assert unacked == 0, f"{self.name}: {unacked} of {self.count} messages were never acknowledged{events}"
