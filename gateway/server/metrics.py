"""Prometheus metrics of the broker (``[metrics] bind = "127.0.0.1:9883"``, off when absent): ``/metrics`` in the
Prometheus text format, written by ``prometheus-client`` (no hand-written exposition).

Nothing is counted for Prometheus: the counters are the ones the broker, the store writer and the upstream outboxes
keep anyway (``$SYS/broker/...``: :class:`~gateway.broker.state.Stats`, ``LmdbWriter.commits`` and
``fsync_buckets``, ``Outbox.counters``), and :class:`BrokerCollector` reads them when Prometheus scrapes (a custom
collector), so the message path pays nothing for metrics.

Serving: prometheus-client's own ``start_http_server`` (a ``ThreadingWSGIServer`` in a daemon thread), so HTTP
parsing, encoding and slow scrapers never run on the event loop. The broker's state is only consistent on the loop,
so the collector asks the loop for a snapshot (:meth:`BrokerCollector.snapshot`, plain numbers, one pass over the
sessions) through ``call_soon_threadsafe`` and waits for it; the families are built in the HTTP thread. An ASGI
app would have needed an HTTP server on the loop (uvicorn, hypercorn), a dependency the gateway otherwise lacks.

Names follow the Prometheus conventions (``edge_gateway_`` prefix, ``_total`` counters, seconds and bytes). The
``process_*`` metrics (CPU seconds, resident memory, open files) come from prometheus-client's ProcessCollector.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from gateway import __version__, native
from gateway.metrics_endpoint import call_on_loop
from gateway.mqtt.packets import PACKET_NAMES
from gateway.store.writer import FSYNC_BUCKETS

if TYPE_CHECKING:

    from gateway.broker.broker import Broker
    from gateway.store.lmdb_store import LmdbStore
    from gateway.upstream import UpstreamBridge

log = logging.getLogger("gateway.server")

#: Drop reasons shown (as 0) before the first drop, so dashboards and alerts see the series from the start. Others
#: appear once counted (docs/reliability.md lists every limit and its counter).
DROP_REASONS = (
    "mqueue_full", "mqueue_full_qos0", "mqueue_quota", "mqueue_quota_qos0", "expired", "no_subscribers",
    "acl_denied", "qos0_offline", "high_watermark_qos0", "store_full", "store_full_qos0", "session_ended",
    "session_expired", "packet_too_large",
)
#: Upstream link states (gateway/upstream/link.py).
LINK_STATES = ("connecting", "connected", "backing-off", "stopped")

#: The last outcome of an A/B update, written by the image's health check (image/rauc/health.sh) as KEY=value lines:
#: OUTCOME (installed, updated, rolling_back, rolled_back), SLOT, VERSION, PREVIOUS, AT (RFC 3339 UTC), DETAIL.
#: EDGE_GATEWAY_UPDATE_STATUS names another file. Absent (no A/B image): no update metrics.
UPDATE_STATUS = "/var/lib/edge-gateway/update/last"


@dataclass(slots=True)
class Snapshot:
    """The numbers one scrape reports, taken on the event loop (plain values, safe to read in another thread)."""

    received: list[int]
    sent: list[int]
    received_qos: list[int]
    sent_qos: list[int]
    bytes_received: int
    connections_open: int
    connections_total: int
    clients_connected: int
    clients_maximum: int
    listener_clients: dict[str, int]
    connect_refused: dict[str, int]
    refused: dict[str, int]
    dropped: dict[str, int]
    log_suppressed: int
    sessions_online: int
    sessions_offline: int
    sessions_persistent: int
    inflight: int
    inflight_max: int
    queued: int
    queued_max: int
    queued_bytes: int
    subscriptions: int
    retained: int
    retained_bytes: int
    started_at: float
    store: dict[str, Any] | None = None
    links: list[dict[str, Any]] = field(default_factory=list)


class BrokerCollector(Collector):
    """A prometheus-client Collector over the broker's own counters (module docstring).

    Args:
        broker: the broker core.
        loop: the event loop that owns ``broker`` (snapshots are taken there).
        store: the LMDB store, or None (memory store: no store metrics).
        upstream: the upstream links, or None.
    """

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop, store: LmdbStore | None = None,
                 upstream: UpstreamBridge | None = None) -> None:
        self.broker = broker
        self.loop = loop
        self.store = store
        self.upstream = upstream

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the loop may not be running yet

    # ------------------------------------------------------------------------------------------ the snapshot

    def snapshot(self, now: float) -> Snapshot:
        """The broker's numbers now; call on the event loop (one pass over the sessions)."""
        b = self.broker
        s = b.stats
        inflight = inflight_max = queued = queued_max = queued_bytes = online = 0
        for session in b.sessions.values():
            n = len(session.inflight)
            inflight += n
            if n > inflight_max:
                inflight_max = n
            mq = session.mqueue
            n = len(mq)
            queued += n
            queued_bytes += mq.bytes
            if n > queued_max:
                queued_max = n
            if session.conn is not None:
                online += 1
        snap = Snapshot(
            received=list(s.received), sent=list(s.sent), received_qos=list(s.received_qos),
            sent_qos=list(s.sent_qos), bytes_received=s.bytes_received, connections_open=len(b.connections),
            connections_total=s.connections_total, clients_connected=s.clients_connected,
            clients_maximum=s.clients_maximum,
            listener_clients=dict.fromkeys(b.settings.zones, 0) | dict(b.listener_clients),
            connect_refused=dict(s.connect_refused), refused=dict(s.refused), dropped=dict(s.dropped),
            log_suppressed=b.rlog.suppressed, sessions_online=online, sessions_offline=len(b.sessions) - online,
            sessions_persistent=b.persistent_count, inflight=inflight, inflight_max=inflight_max, queued=queued,
            queued_max=queued_max, queued_bytes=queued_bytes, subscriptions=b.tree.count,
            retained=b.retained.count, retained_bytes=b.retained.size, started_at=b.started_at,
        )
        st = self.store
        if st is not None:
            snap.store = {
                "used": st.used_bytes, "map": st.map_size, "max": st.settings.max_size, "commits": st.commits,
                "changes": st.committed_ops, "errors": st.write_errors, "full": st.last_write_failed,
                "buckets": list(st.fsync_buckets), "fsync_sum": st.fsync_seconds, "path": st.path,
            }
        if self.upstream is not None:
            for link in self.upstream.links:
                ob = link.outbox
                head = next(iter(ob.entries.values()), None)  # arrival order: the head is the oldest
                snap.links.append({
                    "name": link.name, "state": link.state, "backlog": len(ob.entries), "bytes": ob.bytes,
                    "oldest_age": 0.0 if head is None else max(0.0, now - head.message.received_at),
                    "inflight": len(ob.inflight), "counters": dict(ob.counters), "dropped": dict(ob.dropped),
                    "received": link.received, "rtt_last": ob.rtt_last, "rtt_sum": ob.rtt_sum,
                    "rtt_count": ob.rtt_count,
                })
        return snap

    # ------------------------------------------------------------------------------------------ the families

    def collect(self) -> Iterator[Metric]:
        snap = call_on_loop(self.loop, lambda: self.snapshot(time.time()))
        if snap is None:
            return
        yield from _broker_families(snap)
        if snap.store is not None:
            yield from _store_families(snap.store)
        yield from _disk_families()
        yield from _update_families(os.environ.get("EDGE_GATEWAY_UPDATE_STATUS", UPDATE_STATUS))
        if self.upstream is not None:
            yield from _link_families(snap.links)


def _counter(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
             rows: Mapping[Any, float] | None = None) -> CounterMetricFamily:
    """A counter family; ``rows`` maps a label value (or tuple of values) to its value."""
    family = CounterMetricFamily(name, doc, value=value, labels=labels)
    for key, v in (rows or {}).items():
        family.add_metric(list(key) if isinstance(key, tuple) else [str(key)], v)
    return family


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None,
           rows: Mapping[Any, float] | None = None) -> GaugeMetricFamily:
    """A gauge family; ``rows`` maps a label value (or tuple of values) to its value."""
    family = GaugeMetricFamily(name, doc, value=value, labels=labels)
    for key, v in (rows or {}).items():
        family.add_metric(list(key) if isinstance(key, tuple) else [str(key)], v)
    return family


def _packet_name(ptype: int) -> str:
    return PACKET_NAMES[ptype].lower()


def _broker_families(s: Snapshot) -> Iterator[Metric]:
    p = "edge_gateway_"
    info = InfoMetricFamily(p + "build", "The gateway's version, and whether its MQTT codec and broker core run "
                            "compiled by mypyc (core=\"compiled\") or as Python source (core=\"pure\", core_reason "
                            "says why).")
    core = native.select()
    info.add_metric([], {"version": __version__, "core": "compiled" if core.compiled else "pure",
                         "core_reason": core.reason})
    yield info
    yield _gauge(p + "start_time_seconds", "When the broker started, Unix time in seconds.", s.started_at)
    # connections
    yield _gauge(p + "connections", "Network connections open (MQTT clients connected and those not yet "
                 "through CONNECT).", s.connections_open)
    yield _gauge(p + "clients_connected", "MQTT clients connected (CONNACK sent), by listener.", labels=["listener"],
                 rows=s.listener_clients)
    yield _gauge(p + "clients_connected_maximum", "The most MQTT clients connected at once since the start.",
                 s.clients_maximum)
    yield _counter(p + "connections_total", "Network connections accepted.", s.connections_total)
    yield _counter(p + "connections_refused_total", "CONNECTs refused, by the CONNACK reason (MQTT 5.0 reason code "
                   "name: not_authorized, bad_user_name_or_password, quota_exceeded, ...).", labels=["reason"],
                   rows=s.connect_refused)
    yield _counter(p + "refused_total", "Requests refused by a limit, by limit name (as $SYS/broker/refused/<name>): "
                   "max_connections, max_sessions, max_subscriptions, max_publish_rate, send_timeout, ...",
                   labels=["limit"], rows=s.refused)
    # packets and messages
    received = {_packet_name(t): n for t, n in enumerate(s.received) if t and (n or t in (1, 3, 4))}
    yield _counter(p + "packets_received_total", "MQTT control packets received, by packet type.", labels=["type"],
                   rows=received)
    sent = {_packet_name(t): n for t, n in enumerate(s.sent) if t and (n or t in (2, 4))}
    sent["publish"] = sum(s.sent_qos)
    yield _counter(p + "packets_sent_total", "MQTT control packets sent, by packet type.", labels=["type"], rows=sent)
    yield _counter(p + "messages_received_total", "PUBLISH packets received from clients and handled, by QoS.",
                   labels=["qos"], rows=dict(enumerate(s.received_qos)))
    yield _counter(p + "messages_sent_total", "PUBLISH packets sent to clients, by QoS (re-sends included).",
                   labels=["qos"], rows=dict(enumerate(s.sent_qos)))
    yield _counter(p + "received_bytes_total", "Bytes read from MQTT clients.", s.bytes_received)
    dropped = dict.fromkeys(DROP_REASONS, 0)
    dropped.update(s.dropped)
    yield _counter(p + "messages_dropped_total", "Messages dropped or refused, by reason (as "
                   "$SYS/broker/messages/dropped/<reason>; a _qos0 suffix: QoS 0 messages).", labels=["reason"],
                   rows=dropped)
    yield _counter(p + "sessions_expired_total", "Offline sessions ended by their Session Expiry Interval.",
                   s.dropped.get("session_expired", 0))
    yield _counter(p + "log_lines_suppressed_total", "Log lines suppressed by the once-a-minute rate limit.",
                   s.log_suppressed)
    # state
    yield _gauge(p + "sessions", "Sessions held, by state (online: a client is connected).", labels=["state"],
                 rows={"online": s.sessions_online, "offline": s.sessions_offline})
    yield _gauge(p + "sessions_persistent", "Sessions with a Session Expiry Interval > 0 (max_sessions counts these).",
                 s.sessions_persistent)
    yield _gauge(p + "messages_inflight", "QoS 1/2 messages sent and not yet acknowledged (Inflight Windows), all "
                 "sessions.", s.inflight)
    yield _gauge(p + "messages_inflight_max_per_client", "The largest Inflight Window now.", s.inflight_max)
    yield _gauge(p + "messages_queued", "Messages in Message Queues (paged-out ones included), all sessions.",
                 s.queued)
    yield _gauge(p + "messages_queued_max_per_client", "The longest Message Queue now, messages.", s.queued_max)
    yield _gauge(p + "messages_queued_bytes", "Payload bytes in Message Queues, all sessions.", s.queued_bytes)
    yield _gauge(p + "subscriptions", "Subscriptions held (shared ones included).", s.subscriptions)
    yield _gauge(p + "retained_messages", "Retained messages held ($SYS not counted).", s.retained)
    yield _gauge(p + "retained_bytes", "Bytes of the retained messages held (topic + payload).", s.retained_bytes)


def _store_families(st: dict[str, Any]) -> Iterator[Metric]:
    p = "edge_gateway_store_"
    try:
        size = (st["path"] / "data.mdb").stat().st_size
    except OSError:
        size = 0
    yield _gauge(p + "size_bytes", "Size of the LMDB data file (data.mdb), bytes.", size)
    yield _gauge(p + "used_bytes", "Bytes of LMDB pages in use by the tables (compared with max_size).", st["used"])
    yield _gauge(p + "map_size_bytes", "LMDB map size now (grows by doubling up to max_size), bytes.", st["map"])
    yield _gauge(p + "max_size_bytes", "[store] max_size, bytes.", st["max"])
    yield _gauge(p + "full", "1 while the last commit failed for lack of room (QoS 1/2 PUBLISH refused).",
                 1 if st["full"] else 0)
    yield _counter(p + "commits_total", "Store transactions committed (one per group commit).", st["commits"])
    yield _counter(p + "committed_changes_total", "Changes written by those commits.", st["changes"])
    yield _counter(p + "write_errors_total", "Commits that failed.", st["errors"])
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(FSYNC_BUCKETS, st["buckets"]):
        total += n
        buckets.append((repr(bound), total))
    total += st["buckets"][-1]
    buckets.append(("+Inf", total))
    h = HistogramMetricFamily(p + "fsync_duration_seconds", "Duration of each durable commit (LMDB txn.commit: the "
                              "page writes and the fdatasync of data and meta pages), seconds.",
                              buckets=buckets, sum_value=st["fsync_sum"])
    yield h


def _disk_families() -> Iterator[Metric]:
    """``/proc/self/io`` ``write_bytes``: what this process sent to storage (the store's pages and syncs; flash wear).
    Absent where the kernel has no I/O accounting."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
        written = int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return
    yield _counter("edge_gateway_disk_written_bytes_total", "Bytes this process caused to be written to storage "
                   "(Linux /proc/self/io write_bytes: the store's pages and syncs; what wears flash).", written)


def _update_families(path: str) -> Iterator[Metric]:
    """The last A/B update's outcome (:data:`UPDATE_STATUS`): ``edge_gateway_update_info`` with its outcome, slot and
    versions, and ``edge_gateway_update_timestamp_seconds`` (Unix time of the outcome). Nothing when the file is
    absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            fields = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    except (OSError, UnicodeDecodeError):
        return
    info = InfoMetricFamily("edge_gateway_update", "The last A/B update of this gateway's root (RAUC): outcome "
                            "(installed, updated, rolling_back, rolled_back), the slot booted, its version and the "
                            "one before.")
    info.add_metric([], {key.lower(): fields.get(key, "") for key in ("OUTCOME", "SLOT", "VERSION", "PREVIOUS")})
    yield info
    try:
        at = datetime.datetime.fromisoformat(fields.get("AT", "").replace("Z", "+00:00")).timestamp()
    except ValueError:
        return
    yield _gauge("edge_gateway_update_timestamp_seconds", "When the last A/B update outcome was recorded, Unix time "
                 "in seconds.", at)


def _link_families(links: list[dict[str, Any]]) -> Iterator[Metric]:
    p = "edge_gateway_upstream_"
    label = ["upstream"]

    def per_link(key: Callable[[dict[str, Any]], float]) -> dict[Any, float]:
        return {link["name"]: key(link) for link in links}

    state = GaugeMetricFamily(p + "state", "The link's state: 1 for the current one (connecting, connected, "
                              "backing-off, stopped).", labels=["upstream", "state"])
    for link in links:
        for name in LINK_STATES:
            state.add_metric([link["name"], name], 1 if link["state"] == name else 0)
    yield state
    yield _gauge(p + "up", "1 while the link is connected.", labels=label,
                 rows=per_link(lambda x: 1 if x["state"] == "connected" else 0))
    yield _gauge(p + "backlog_messages", "Messages in the outbox (waiting or in flight).", labels=label,
                 rows=per_link(lambda x: x["backlog"]))
    yield _gauge(p + "backlog_bytes", "Payload + remote topic bytes in the outbox.", labels=label,
                 rows=per_link(lambda x: x["bytes"]))
    yield _gauge(p + "backlog_oldest_age_seconds", "Age of the oldest message in the outbox (0 when empty), "
                 "seconds.", labels=label, rows=per_link(lambda x: x["oldest_age"]))
    yield _gauge(p + "inflight_messages", "QoS 1/2 messages sent upstream and not yet acknowledged.", labels=label,
                 rows=per_link(lambda x: x["inflight"]))
    yield _counter(p + "messages_sent_total", "PUBLISH packets sent upstream (re-sends included).", labels=label,
                   rows=per_link(lambda x: x["counters"].get("publish_sent", 0)))
    yield _counter(p + "messages_acked_total", "PUBACK/PUBCOMP received from the upstream broker.", labels=label,
                   rows=per_link(lambda x: x["rtt_count"]))
    yield _counter(p + "messages_forwarded_total", "Messages delivered upstream: QoS 1/2 acknowledged, QoS 0 sent.",
                   labels=label, rows=per_link(lambda x: x["counters"].get("forwarded", 0)
                                               + x["counters"].get("forwarded_qos0", 0)))
    dropped = CounterMetricFamily(p + "messages_dropped_total", "Messages the outbox dropped, by reason "
                                  "(docs/upstream.md \"Bounds and drops\").", labels=["upstream", "reason"])
    for link in links:
        for reason, n in sorted(link["dropped"].items()):
            dropped.add_metric([link["name"], reason], n)
    yield dropped
    yield _counter(p + "messages_received_total", "Messages brought down by subscribe rules.", labels=label,
                   rows=per_link(lambda x: x["received"]))
    yield _counter(p + "connects_total", "Connections established to the upstream broker.", labels=label,
                   rows=per_link(lambda x: x["counters"].get("connects", 0)))
    yield _counter(p + "reconnects_total", "Connections established after the first (reconnects).", labels=label,
                   rows=per_link(lambda x: max(0, x["counters"].get("connects", 0) - 1)))
    yield _counter(p + "ack_timeouts_total", "Links torn down because nothing was acknowledged for ack_timeout.",
                   labels=label, rows=per_link(lambda x: x["counters"].get("ack_timeouts", 0)))
    yield _counter(p + "retries_total", "PUBLISHes the upstream broker refused for now (PUBACK/PUBCOMP 0x97 Quota "
                   "exceeded, 0x80 Unspecified error), each sent again after a pause.", labels=label,
                   rows=per_link(lambda x: x["counters"].get("retries", 0)))
    rtt = SummaryMetricFamily(p + "round_trip_seconds", "Round trips: a QoS 1/2 PUBLISH sent to its PUBACK/PUBCOMP, "
                              "seconds.", labels=label)
    for link in links:
        rtt.add_metric([link["name"]], link["rtt_count"], link["rtt_sum"])
    yield rtt
    yield _gauge(p + "last_round_trip_seconds", "The last round trip (0 before the first), seconds.", labels=label,
                 rows=per_link(lambda x: x["rtt_last"] or 0.0))
