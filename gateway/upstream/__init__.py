"""Upstream store-and-forward to cloud MQTT brokers (docs/upstream.md).

:class:`UpstreamBridge` owns one :class:`~gateway.upstream.link.UpstreamLink` per ``[[upstream]]`` entry; the
runner attaches it to the broker before the listeners open and stops it before the store closes. Each link is the
aiomqtt glue around a sans-I/O :class:`~gateway.upstream.outbox.Outbox` (order, window, paced drain, live lane,
re-send, bounds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.upstream.config import UpstreamConfig
from gateway.upstream.link import SENDER_PREFIX, UpstreamLink

if TYPE_CHECKING:
    from gateway.broker.actions import Action
    from gateway.broker.broker import Broker

__all__ = ["SENDER_PREFIX", "UpstreamBridge", "UpstreamConfig", "UpstreamLink"]


class UpstreamBridge:
    """All upstream links of one broker."""

    def __init__(self, configs: list[UpstreamConfig], broker: Broker, perform: Callable[[list[Action]], Any]) -> None:
        self.broker = broker
        self.links = [UpstreamLink(cfg, broker, perform) for cfg in configs]

    def attach(self, now: float) -> None:
        """Load each link's outbox and hook it into the broker's routing (before any client can publish)."""
        for link in self.links:
            link.load(now)
            self.broker.forwarders.append(link.forward)

    def start(self) -> None:
        """Start connecting (call from the broker's event loop)."""
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        """Disconnect every link; unacknowledged outbox rows stay for the next start."""
        await asyncio.gather(*(link.stop() for link in self.links))
        for link in self.links:
            if link.forward in self.broker.forwarders:
                self.broker.forwarders.remove(link.forward)
