"""Benchmarks side by side: edge-gateway and amqtt against Mosquitto, in the same run on the same machine.

    .venv/bin/python bench/run.py [--runs 3] [--quick] [--only fanin,qos1,...] [--brokers mosquitto,edge-gateway]

Each broker is pinned to core 0 (``taskset -c 0``), the load generator (this process and its workers) to core 1.
Every cell runs ``--runs`` times on a fresh broker (runs interleave the brokers) and reports the median with
min-max; every figure is also given as a ratio to Mosquitto's median. The load generator's ceiling, measured
first against a do-nothing sink, is given beside each figure. Prints one table and writes it, with the
machine and versions, to bench/results/latest.md.

Scenarios (64-byte payloads, MQTT 3.1.1):
  fanin    QoS 0, 4 publishers -> 1 wildcard subscriber, a bounded count as fast as possible: delivered msgs/s,
           losses
  qos1     QoS 1 end to end, 4 publishers x 32 in flight, clean sessions, for a bounded time: msgs/s, p50/p99
           latency
  fanout   QoS 0, 1 publisher -> 50 subscribers, a bounded count: deliveries/s; the subscribers are the C ones
           (bench/cloadgen's sub mode) when it is built, else bench/loadgen.py's (--msg-generator)
  idle     5000 idle connections (keep alive 60): connect rate, broker RSS and CPU per connection; opened by the C
           generator bench/cloadgen when it is built (make cloadgen), else by bench/loadgen.py's Python one
  offline  100 000 QoS 1 messages to a persistent offline subscriber (edge-gateway: durable LMDB with fsync group
           commits; Mosquitto: persistence false; amqtt: memory), then the drain on reconnect
  qos2     QoS 2 end to end, exactly once, 4 publishers x 32 in flight, clean sessions: msgs/s, PUBCOMPs/s,
           p50/p99 latency, duplicates, losses
  retained 10 000 retained topics, then 100 clients connect at once and subscribe to #: retained deliveries/s;
           subscribers as for fanout
  kill     durable QoS 1, SIGKILL mid-run: acknowledged messages lost after restart (Mosquitto: persistence true,
           default autosave_interval)
  fanin_tls, qos1_tls   fanin and qos1 over TLS: both brokers' listeners with the same server certificate and key,
           made at bench time (P-256, TLS 1.3 with the ssl module's defaults); the clients verify it
  fanin_acl             fanin with allow_anonymous false, a password file and an ACL file of 1,000 rules (the same
           files for both brokers; the bench user's grant is its last rule); compare with fanin (within 10%)
--brokers mosquitto,edge-gateway,edge-gateway+metrics runs edge-gateway a second time with Prometheus metrics on,
scraped every second (within 3% of edge-gateway).
Broker CPU per message comes from /proc/PID/stat (utime + stime) before/after.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import brokers as bench_brokers  # noqa: E402 (the metrics variant)
from brokers import (  # noqa: E402
    ACL_RULES,
    CLK_TCK,
    KINDS,
    MAX_INFLIGHT,
    MAX_QUEUED,
    Broker,
    BrokerError,
    Security,
    make_pki,
    versions,
    write_auth_files,
)
from loadgen import (  # noqa: E402
    BROKER_CPU,
    LOADGEN_CPU,
    SubSpec,
    Workers,
    busy_fraction,
    cloadgen_binary,
    core_times,
    latencies_ms,
    merge_subscribers,
    percentile,
    prepare_persistent_subscriber,
    publish_retained,
    raise_nofile,
    run_idle,
    run_idle_c,
    run_publisher_qos0,
    run_publisher_qos1,
    run_publishers_c,
    run_retained_subscribers,
    run_retained_subscribers_c,
    run_subscribers,
    run_subscribers_c,
    self_check,
)

RESULTS = BENCH / "results"
LOADGEN_BUSY_LIMIT = 0.9  # flag a figure whose load generator used more of its core than this (and the broker less)
FOREIGN_LIMIT = 0.1  # other processes using more of the broker's core than this make a run noisy


class NotApplicable(Exception):
    """The broker cannot run this scenario (the reason goes in the table)."""


@dataclass
class Params:
    runs: int = 3
    fanin_per_pub: int = 50_000
    qos1_seconds: float = 4.0
    fanout_msgs: int = 10_000
    fanout_subs: int = 50
    idle_conns: int = 5000
    offline_msgs: int = 100_000
    qos2_seconds: float = 4.0
    retained_topics: int = 10_000
    retained_subs: int = 100
    kill_after: float = 2.0
    amqtt_cap: float = 45.0  # seconds a single amqtt cell may take
    selfcheck_seconds: float = 1.5
    idle_generator: str = "auto"  # "c" (bench/cloadgen), "python" (loadgen.run_idle), "auto": C when it is built
    # the fan-out and retained rows' subscribers: "c" (cloadgen sub), "python" (loadgen.run_subscribers,
    # run_retained_subscribers), "auto": C when it is built
    msg_generator: str = "auto"
    # the QoS 1 and QoS 2 rows' clients and the offline row's publishers: "python" (loadgen.run_subscribers,
    # run_publisher_qos1) or "c" (cloadgen sub and pub)
    ack_generator: str = "python"


QUICK = Params(runs=1, fanin_per_pub=10_000, qos1_seconds=1.5, fanout_msgs=2_000, idle_conns=5000,
               offline_msgs=20_000, qos2_seconds=1.5, retained_topics=2_000, retained_subs=20, kill_after=1.0,
               amqtt_cap=20.0, selfcheck_seconds=0.7, msg_generator="python")


@dataclass(frozen=True)
class Metric:
    key: str
    scenario: str
    label: str
    fmt: str  # "rate", "ms", "us", "kib", "mib", "count"
    better: str  # "up", "down" or "" (a count that must be 0: no ratio)
    ceiling: str | None = None  # self-check figure that bounds it


METRICS = [
    Metric("fanin.rate", "fan-in QoS 0 (4 pub -> 1 sub)", "delivered msgs/s", "rate", "up", "fanin"),
    Metric("fanin.lost", "fan-in QoS 0 (4 pub -> 1 sub)", "lost messages", "count", ""),
    Metric("fanin.cpu", "fan-in QoS 0 (4 pub -> 1 sub)", "broker CPU us/msg", "us", "down"),
    Metric("qos1.rate", "QoS 1 end to end (4 pub x 32 in flight)", "msgs/s", "rate", "up", "qos1"),
    Metric("qos1.acked", "QoS 1 end to end (4 pub x 32 in flight)", "publisher PUBACKs/s", "rate", "up", "qos1_pub"),
    Metric("qos1.p50", "QoS 1 end to end (4 pub x 32 in flight)", "p50 latency ms", "ms", "down"),
    Metric("qos1.p99", "QoS 1 end to end (4 pub x 32 in flight)", "p99 latency ms", "ms", "down"),
    Metric("qos1.lost", "QoS 1 end to end (4 pub x 32 in flight)", "acked but lost", "count", ""),
    Metric("qos1.cpu", "QoS 1 end to end (4 pub x 32 in flight)", "broker CPU us/msg", "us", "down"),
    Metric("qos2.rate", "QoS 2 end to end (4 pub x 32 in flight)", "msgs/s", "rate", "up"),
    Metric("qos2.acked", "QoS 2 end to end (4 pub x 32 in flight)", "publisher PUBCOMPs/s", "rate", "up"),
    Metric("qos2.p50", "QoS 2 end to end (4 pub x 32 in flight)", "p50 latency ms", "ms", "down"),
    Metric("qos2.p99", "QoS 2 end to end (4 pub x 32 in flight)", "p99 latency ms", "ms", "down"),
    Metric("qos2.dups", "QoS 2 end to end (4 pub x 32 in flight)", "duplicates", "count", ""),
    Metric("qos2.lost", "QoS 2 end to end (4 pub x 32 in flight)", "completed but lost", "count", ""),
    Metric("qos2.cpu", "QoS 2 end to end (4 pub x 32 in flight)", "broker CPU us/msg", "us", "down"),
    Metric("fanout.rate", "fan-out QoS 0 (1 pub -> 50 sub)", "deliveries/s", "rate", "up", "fanout"),
    Metric("fanout.lost", "fan-out QoS 0 (1 pub -> 50 sub)", "lost deliveries", "count", ""),
    Metric("fanout.cpu", "fan-out QoS 0 (1 pub -> 50 sub)", "broker CPU us/delivery", "us", "down"),
    Metric("idle.rate", "idle connections (keep alive 60)", "connects/s", "rate", "up", "connect"),
    Metric("idle.rss", "idle connections (keep alive 60)", "RSS KiB/connection", "kib", "down"),
    # the broker's own cost of a connection, whichever side bounds the rate (the load core pays the kernel's
    # loopback handshake: docs/benchmarks.md, "The C load generator")
    Metric("idle.cpu", "idle connections (keep alive 60)", "broker CPU us/connection (CONNECT to CONNACK)", "us",
           "down"),
    Metric("offline.pub", "offline QoS 1 backlog", "publish msgs/s", "rate", "up", "offline_pub"),
    Metric("offline.rss", "offline QoS 1 backlog", "broker RSS MiB, backlog queued", "mib", "down"),
    Metric("offline.drain", "offline QoS 1 backlog", "drain msgs/s on reconnect", "rate", "up", "offline_drain"),
    Metric("offline.lost", "offline QoS 1 backlog", "lost (acked, not drained)", "count", ""),
    Metric("offline.ooo", "offline QoS 1 backlog", "out of order in drain", "count", ""),
    Metric("offline.cpu", "offline QoS 1 backlog", "broker CPU us/msg (publish+drain)", "us", "down"),
    Metric("offline.fsync", "offline QoS 1 backlog", "fdatasync p50 ms of the run's disk (probe)", "ms", ""),
    Metric("offline.pubcpu", "offline QoS 1 backlog", "broker CPU us/msg, publish", "us", "down"),
    Metric("offline.draincpu", "offline QoS 1 backlog", "broker CPU us/msg, drain", "us", "down"),
    Metric("retained.rate", "retained (10k topics, 100 `#` subscribers at once)", "retained deliveries/s", "rate",
           "up"),
    Metric("retained.lost", "retained (10k topics, 100 `#` subscribers at once)", "lost deliveries", "count", ""),
    Metric("retained.cpu", "retained (10k topics, 100 `#` subscribers at once)", "broker CPU us/delivery", "us",
           "down"),
    Metric("kill.acked", "durable QoS 1, SIGKILL mid-run", "messages acked before kill", "count", ""),
    Metric("kill.lost", "durable QoS 1, SIGKILL mid-run", "acked messages lost", "count", ""),
]

#: scenarios run on a secured broker: name -> (the scenario it repeats, the Security variant, table label)
VARIANTS = {
    "fanin_tls": ("fanin", "tls", "fan-in QoS 0 over TLS"),
    "fanin_acl": ("fanin", "acl", f"fan-in QoS 0 with an acl_file of {ACL_RULES:,} rules"),
    "qos1_tls": ("qos1", "tls", "QoS 1 end to end over TLS"),
}


def _variant_metrics() -> list[Metric]:
    """METRICS with each variant's rows right after its base scenario's (the loadgen's plaintext ceiling is no
    bound for a TLS row, so those have none)."""
    out: list[Metric] = []
    for m in METRICS:
        out.append(m)
    for name, (base, kind, label) in VARIANTS.items():
        rows = [Metric(f"{name}.{m.key.split('.', 1)[1]}", label, m.label, m.fmt, m.better,
                       None if kind == "tls" else m.ceiling) for m in METRICS if m.key.split(".")[0] == base]
        last = max(i for i, m in enumerate(out) if m.key.split(".")[0] in (base, *[
            v for v, (b, _, _) in VARIANTS.items() if b == base]))
        out[last + 1:last + 1] = rows
    return out


METRICS = _variant_metrics()


def _lost(acked: bytes, delivered: bytes) -> int:
    """Messages marked in ``acked`` but not in ``delivered`` (both 0/1 bytes per sequence number)."""
    n = 0
    dl = len(delivered)
    for i, a in enumerate(acked):
        if a and (i >= dl or not delivered[i]):
            n += 1
    return n


class Meter:
    """Broker CPU (utime + stime) and how busy the load generator's core was, from a start point."""

    def __init__(self, b: Broker) -> None:
        self.b = b
        self.cpu = b.cpu_seconds()
        self.cores = core_times()
        self.t0 = time.monotonic()

    def cpu_us(self, messages: int) -> float:
        """Broker CPU microseconds per message since the start."""
        return (self.b.cpu_seconds() - self.cpu) / max(1, messages) * 1e6

    def foreign(self) -> float:
        """Fraction of core 0 used by something other than the broker since the start (other processes on the
        machine; the kernel's loopback work for the broker's sends counts as the broker's)."""
        now = core_times()
        if BROKER_CPU not in now:
            return float("nan")
        busy = (now[BROKER_CPU][0] - self.cores[BROKER_CPU][0]) / CLK_TCK
        total = (now[BROKER_CPU][1] - self.cores[BROKER_CPU][1]) / CLK_TCK
        return max(0.0, busy - (self.b.cpu_seconds() - self.cpu)) / total if total > 0 else float("nan")

    def broker_busy(self) -> float:
        """The broker's CPU time since the start as a fraction of the wall time (it is pinned to one core)."""
        wall = time.monotonic() - self.t0
        return (self.b.cpu_seconds() - self.cpu) / wall if wall > 0 else float("nan")

    def core_busy(self) -> float:
        """Fraction of the time since the start that the load generator's core was busy (any process, and the
        kernel's loopback work)."""
        return busy_fraction(self.cores, core_times(), LOADGEN_CPU)


# ---------------------------------------------------------------------------------------------------------------
# scenarios: each gets a started broker and returns its metrics


def scenario_fanin(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    assert b.target is not None
    t = b.target
    w = Workers(budget)
    try:
        sub = w.spawn(run_subscribers, t, [SubSpec("bench-fanin-sub", "bench/fanin/#", 0, pubs=4,
                                                   per_pub=p.fanin_per_pub)], w.ctl, idle=1.0)
        w.collect("ready", [sub], 20)
        pubs = [w.spawn(run_publisher_qos0, t, i, f"bench/fanin/p{i}", p.fanin_per_pub, w.ctl) for i in range(4)]
        w.collect("ready", pubs, 20)
        meter = Meter(b)
        w.ctl.go.set()
        done = w.collect("done", pubs, budget)
        sent = sum(d["sent"] for d in done.values())
        w.ctl.expect.value = sent
        w.ctl.pubs_done.set()
        m = merge_subscribers(w.collect("done", [sub], budget))
        cpu = meter.cpu_us(m["unique"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        info["bound"] = {"fanin.rate": (max(w.load(), info["core1_busy"]), meter.broker_busy())}
    finally:
        w.close()
    t0 = min(d["t_start_ns"] for d in done.values())
    info["checks"] = {"sent": sent, "dups": m["dups"], "out_of_order": m["out_of_order"], "bad": m["bad"]}
    if m["unique"] < sent and time.monotonic() > w.ctl.deadline:
        raise TimeoutError(f"only {m['unique']} of {sent} delivered within {budget:.0f} s")
    return {"fanin.rate": m["unique"] / max(1e-9, (m["last_ns"] - t0) / 1e9), "fanin.lost": sent - m["unique"],
            "fanin.cpu": cpu}


def _acked_clients(w: Workers, t: Any, p: Params, qos: int, seconds: float) -> tuple[str, list[str]]:
    """The QoS 1 and QoS 2 rows' clients, subscribed and connected: one subscriber to ``bench/q{qos}/#`` at
    ``qos`` (latency and bitmaps kept) and 4 publishers x 32 in flight to ``bench/q{qos}/p{i}`` for ``seconds``,
    from bench/loadgen.py (five processes) or bench/cloadgen (``p.ack_generator``: one process each)."""
    root = f"bench/q{qos}"
    if ack_generator(p) == "c":
        sub = w.spawn(run_subscribers_c, t, 1, f"{root}/#", w.ctl, pubs=4, per_pub=1 << 16,
                      client_id_prefix=f"bench-q{qos}-sub", idle=2.0, qos=qos, latency=True, bitmaps=True)
        w.collect("ready", [sub], 20)
        pubs = [w.spawn(run_publishers_c, t, 4, f"{root}/p", w.ctl, window=32, duration=seconds, qos=qos)]
    else:
        sub = w.spawn(run_subscribers, t, [SubSpec(f"bench-q{qos}-sub", f"{root}/#", qos, pubs=4, per_pub=1 << 16)],
                      w.ctl, latency=True, bitmaps=True, idle=2.0)
        w.collect("ready", [sub], 20)
        pubs = [w.spawn(run_publisher_qos1, t, i, f"{root}/p{i}", 1 << 30, w.ctl, window=32, duration=seconds,
                        qos=qos) for i in range(4)]
    w.collect("ready", pubs, 20)
    return sub, pubs


def _per_publisher(done: dict[str, Any]) -> dict[str, Any]:
    """The publishers' ``done`` reports, one per publisher (the C generator's one report holds all four)."""
    flat: dict[str, Any] = {}
    for name, d in done.items():
        for i, one in enumerate(d["publishers"]) if "publishers" in d else [(0, d)]:
            flat[f"{name}-{i}"] = one
    return flat


def scenario_qos1(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    assert b.target is not None
    t = b.target
    w = Workers(budget)
    try:
        sub, pubs = _acked_clients(w, t, p, 1, p.qos1_seconds)
        meter = Meter(b)
        w.ctl.go.set()
        done = _per_publisher(w.collect("done", pubs, budget))
        sent = sum(d["sent"] for d in done.values())
        w.ctl.expect.value = sent
        w.ctl.pubs_done.set()
        subs = w.collect("done", [sub], budget)
        m = merge_subscribers(subs)
        cpu = meter.cpu_us(m["unique"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        load = (max(w.load(), info["core1_busy"]), meter.broker_busy())
        info["bound"] = {"qos1.rate": load, "qos1.acked": load}
    finally:
        w.close()
    errors = [d["error"] for d in done.values() if d["error"]]
    if errors:
        raise RuntimeError(f"publisher errors: {errors}")
    bitmaps = m["subscribers"][0]["bitmaps"]
    by_pub = {d["pub"]: d for d in done.values()}
    lost = sum(_lost(by_pub[i]["acked_bitmap"], bitmaps[i]) for i in range(4))
    lat = latencies_ms(subs)
    t0 = min(d["t_start_ns"] for d in done.values())
    info["checks"] = {"sent": sent, "acked": sum(d["acked"] for d in done.values()), "dups": m["dups"],
                      "out_of_order": m["out_of_order"], "bad": m["bad"]}
    t1 = max(d["t_end_ns"] for d in done.values())
    acked = sum(d["acked"] for d in done.values())
    return {"qos1.rate": m["unique"] / max(1e-9, (m["last_ns"] - t0) / 1e9),
            "qos1.acked": acked / max(1e-9, (t1 - t0) / 1e9), "qos1.p50": percentile(lat, 50),
            "qos1.p99": percentile(lat, 99), "qos1.lost": lost, "qos1.cpu": cpu}


def scenario_qos2(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    """QoS 2 end to end, exactly once: 4 publishers x 32 in flight (a message leaves the window at its PUBCOMP)
    -> 1 QoS 2 subscriber (PUBREC per PUBLISH, PUBCOMP per PUBREL), clean sessions; every delivery checked for
    duplicates (the payload's sequence number, per publisher) and completed publishes for losses."""
    assert b.target is not None
    t = b.target
    w = Workers(budget)
    try:
        sub, pubs = _acked_clients(w, t, p, 2, p.qos2_seconds)
        meter = Meter(b)
        w.ctl.go.set()
        done = _per_publisher(w.collect("done", pubs, budget))
        sent = sum(d["sent"] for d in done.values())
        w.ctl.expect.value = sent
        w.ctl.pubs_done.set()
        subs = w.collect("done", [sub], budget)
        m = merge_subscribers(subs)
        cpu = meter.cpu_us(m["unique"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        load = (max(w.load(), info["core1_busy"]), meter.broker_busy())
        info["bound"] = {"qos2.rate": load, "qos2.acked": load}
    finally:
        w.close()
    errors = [d["error"] for d in done.values() if d["error"]]
    if errors:
        raise RuntimeError(f"publisher errors: {errors}")
    bitmaps = m["subscribers"][0]["bitmaps"]
    by_pub = {d["pub"]: d for d in done.values()}
    lost = sum(_lost(by_pub[i]["acked_bitmap"], bitmaps[i]) for i in range(4))
    lat = latencies_ms(subs)
    t0 = min(d["t_start_ns"] for d in done.values())
    t1 = max(d["t_end_ns"] for d in done.values())
    acked = sum(d["acked"] for d in done.values())
    info["checks"] = {"sent": sent, "completed": acked, "delivered": m["unique"], "dups": m["dups"],
                      "out_of_order": m["out_of_order"], "bad": m["bad"], "dup_flag": m["dup_flag"]}
    return {"qos2.rate": m["unique"] / max(1e-9, (m["last_ns"] - t0) / 1e9),
            "qos2.acked": acked / max(1e-9, (t1 - t0) / 1e9), "qos2.p50": percentile(lat, 50),
            "qos2.p99": percentile(lat, 99), "qos2.dups": m["dups"], "qos2.lost": lost, "qos2.cpu": cpu}


def scenario_retained(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    """10,000 retained messages on 10,000 topics (published QoS 1, acknowledged, before the clock starts), then
    100 clients connect at once and subscribe to ``#`` (QoS 0): retained deliveries/s from the first CONNECT to
    the last delivery, every delivery checked (RETAIN set, each subscriber gets each message once)."""
    assert b.target is not None
    t = b.target
    n, subs = p.retained_topics, p.retained_subs
    publish_retained(t, "bench/ret/", n)
    time.sleep(0.2)
    w = Workers(budget)
    c_subs = msg_generator(p) == "c"
    try:
        # the C subscribers run in the worker's child process, on its core; their CPU enters w.load (loadgen._Out)
        name = w.spawn(run_retained_subscribers_c if c_subs else run_retained_subscribers, t, subs, "#", n, w.ctl)
        w.collect("ready", [name], 20)
        meter = Meter(b)
        w.ctl.go.set()
        r = w.collect("done", [name], budget)[name]
        cpu = meter.cpu_us(r["unique"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        own = w.load([name])  # the subscribers' processes (the C program's CPU included) over their span
        info["bound"] = {"retained.rate": (max(own, info["core1_busy"]), meter.broker_busy())}
    finally:
        w.close()
    if r.get("error"):
        raise RuntimeError(r["error"])
    info["checks"] = {"expected": n * subs, "delivered": r["unique"], "dups": r["dups"], "bad": r["bad"],
                      "not_retained": r["not_retained"], "subacks": r["subacks"], "closed": r["closed"],
                      "generator": "C" if c_subs else "Python", "generator_load": round(own, 3)}
    if c_subs:  # the C subscribers' own CPU, and per delivery beside the broker's (retained.cpu)
        info["checks"]["generator_busy"] = round(r["generator_cpu_s"] / max(1e-9, r["generator_elapsed"]), 3)
        info["checks"]["generator_us_per_delivery"] = round(r["generator_cpu_s"] / max(1, r["unique"]) * 1e6, 3)
    return {"retained.rate": r["unique"] / max(1e-9, (r["last_ns"] - r["t_start_ns"]) / 1e9),
            "retained.lost": n * subs - r["unique"], "retained.cpu": cpu}


def scenario_fanout(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    assert b.target is not None
    t = b.target
    w = Workers(budget)
    c_subs = msg_generator(p) == "c"
    try:
        names = []
        if c_subs:  # every subscriber in one C process (its CPU enters w.load: loadgen._Out)
            names.append(w.spawn(run_subscribers_c, t, p.fanout_subs, "bench/fanout/#", w.ctl, pubs=1,
                                 per_pub=p.fanout_msgs, client_id_prefix="bench-fo-sub", idle=1.0))
        else:
            groups = 5
            for g in range(groups):
                specs = [SubSpec(f"bench-fo-sub{i}", "bench/fanout/#", 0, pubs=1, per_pub=p.fanout_msgs)
                         for i in range(g, p.fanout_subs, groups)]
                names.append(w.spawn(run_subscribers, t, specs, w.ctl, idle=1.0))
        w.collect("ready", names, 30)
        pub = w.spawn(run_publisher_qos0, t, 0, "bench/fanout/p0", p.fanout_msgs, w.ctl)
        w.collect("ready", [pub], 20)
        meter = Meter(b)
        w.ctl.go.set()
        done = w.collect("done", [pub], budget)[pub]
        w.ctl.expect.value = done["sent"]
        w.ctl.pubs_done.set()
        subs_done = w.collect("done", names, budget)
        m = merge_subscribers(subs_done)
        cpu = meter.cpu_us(m["unique"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        own = w.load()  # the load generator's processes (the C program's CPU included) over their span
        info["bound"] = {"fanout.rate": (max(own, info["core1_busy"]), meter.broker_busy())}
    finally:
        w.close()
    expected = done["sent"] * p.fanout_subs
    info["checks"] = {"sent": done["sent"], "expected": expected, "dups": m["dups"],
                      "out_of_order": m["out_of_order"], "bad": m["bad"], "generator": "C" if c_subs else "Python",
                      "generator_load": round(own, 3)}
    if c_subs:  # the C subscribers' own CPU per delivery, beside the broker's (fanout.cpu)
        gen_cpu = sum(r.get("generator_cpu_s", 0.0) for r in subs_done.values())
        info["checks"]["generator_us_per_delivery"] = round(gen_cpu / max(1, m["unique"]) * 1e6, 3)
    if m["unique"] < expected and time.monotonic() > w.ctl.deadline:
        raise TimeoutError(f"only {m['unique']} of {expected} deliveries within {budget:.0f} s")
    return {"fanout.rate": m["unique"] / max(1e-9, (m["last_ns"] - done["t_start_ns"]) / 1e9),
            "fanout.lost": expected - m["unique"], "fanout.cpu": cpu}


def idle_generator(p: Params) -> str:
    """"c" or "python": which opener the idle scenario uses (``p.idle_generator``; "auto" is C when it is built).

    Raises:
        RuntimeError: "c" was asked for and bench/cloadgen is not built.
    """
    if p.idle_generator == "python" or (p.idle_generator == "auto" and cloadgen_binary() is None):
        return "python"
    if cloadgen_binary() is None:
        raise RuntimeError("bench/cloadgen/cloadgen is not built (make cloadgen)")
    return "c"


def ack_generator(p: Params) -> str:
    """"c" or "python": whose clients the QoS 1 and QoS 2 rows, and whose publishers the offline row, use
    (``p.ack_generator``).

    Raises:
        RuntimeError: "c" was asked for and bench/cloadgen is not built.
    """
    if p.ack_generator == "c" and cloadgen_binary() is None:
        raise RuntimeError("bench/cloadgen/cloadgen is not built (make cloadgen)")
    return p.ack_generator


def msg_generator(p: Params) -> str:
    """"c" or "python": whose subscribers the fan-out and retained rows use (``p.msg_generator``; "auto" is C
    when bench/cloadgen is built).

    Raises:
        RuntimeError: "c" was asked for and bench/cloadgen is not built.
    """
    if p.msg_generator == "python" or (p.msg_generator == "auto" and cloadgen_binary() is None):
        return "python"
    if cloadgen_binary() is None:
        raise RuntimeError("bench/cloadgen/cloadgen is not built (make cloadgen)")
    return "c"


def scenario_idle(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    assert b.target is not None
    w = Workers(budget)
    opener = run_idle_c if idle_generator(p) == "c" else run_idle
    try:
        time.sleep(0.3)
        rss0 = b.rss_kib()
        meter = Meter(b)
        # the C generator runs in a worker's child process: it inherits the worker's core like the Python workers,
        # and its report's cpu_s is its own CPU over its elapsed time, as run_idle's is
        name = w.spawn(opener, b.target, p.idle_conns, w.ctl, keep_alive=60, concurrency=64)
        r = w.collect("connected", [name], budget)[name]
        cpu_us = meter.cpu_us(r["connected"])
        info["core1_busy"] = meter.core_busy()
        info["core0_foreign"] = meter.foreign()
        info["bound"] = {"idle.rate": (max(r["cpu_s"] / max(1e-9, r["elapsed"]), info["core1_busy"]),
                                       meter.broker_busy())}
        time.sleep(1.0)  # let the broker settle with every connection open and idle
        if not b.alive():
            raise BrokerError(f"{b.kind} died with {r['connected']} connections open")
        rss1 = b.rss_kib()
        w.ctl.release.set()
        w.collect("done", [name], 30)
    finally:
        w.close()
    info["checks"] = {"connected": r["connected"], "failed": r["failed"], "rss_before_kib": rss0,
                      "rss_after_kib": rss1, "generator": "C" if opener is run_idle_c else "Python",
                      "generator_busy": round(r["cpu_s"] / max(1e-9, r["elapsed"]), 3)}
    if r["connected"] < p.idle_conns:
        raise RuntimeError(f"only {r['connected']} of {p.idle_conns} connections accepted ({r['failed']} failed)")
    return {"idle.rate": r["connected"] / max(1e-9, r["elapsed"]), "idle.rss": (rss1 - rss0) / r["connected"],
            "idle.cpu": cpu_us}


def fsync_probe(directory: Path, n: int = 30) -> float:
    """The median wall time of ``n`` 4 KiB overwrites each followed by ``fdatasync`` in ``directory``, ms: how fast
    the disk under the store commits now (the durable publish waits for two per commit, LMDB's data and meta
    pages); the machine is shared, so it is measured in every offline cell."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, bytes(1 << 16))
        os.fdatasync(fd)
        times = []
        for i in range(n):
            os.pwrite(fd, os.urandom(4096), (i % 16) * 4096)
            t = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1e3


def scenario_offline(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    assert b.target is not None
    fsync_ms = fsync_probe(b.workdir)
    t = b.target
    n = p.offline_msgs
    per = n // 4
    prepare_persistent_subscriber(t, "bench-off-sub", "bench/off/#", 1)
    time.sleep(0.2)
    rss0 = b.rss_kib()
    w = Workers(budget)
    try:
        if ack_generator(p) == "c":
            pubs = [w.spawn(run_publishers_c, t, 4, "bench/off/p", w.ctl, window=32, duration=budget, count=per)]
        else:
            pubs = [w.spawn(run_publisher_qos1, t, i, f"bench/off/p{i}", per, w.ctl, window=32) for i in range(4)]
        w.collect("ready", pubs, 20)
        meter = Meter(b)
        w.ctl.go.set()
        done = _per_publisher(w.collect("done", pubs, budget))
        errors = [d["error"] for d in done.values() if d["error"]]
        if errors:
            raise RuntimeError(f"publisher errors: {errors}")
        acked = sum(d["acked"] for d in done.values())
        t0 = min(d["t_start_ns"] for d in done.values())
        t1 = max(d["t_end_ns"] for d in done.values())
        pub_busy = meter.core_busy()
        pub_foreign = meter.foreign()
        pub_broker = meter.broker_busy()
        pub_cpu = meter.cpu_us(acked)
        time.sleep(0.5)
        rss1 = b.rss_kib()
        meter_drain = Meter(b)
        w.ctl.pubs_done.set()
        w.ctl.expect.value = acked
        sub = w.spawn(run_subscribers, t, [SubSpec("bench-off-sub", None, 1, clean=False, pubs=4, per_pub=per)],
                      w.ctl, bitmaps=True, idle=3.0)
        w.collect("ready", [sub], 20)
        m = merge_subscribers(w.collect("done", [sub], budget))
        cpu = meter.cpu_us(n)
        drain_cpu = meter_drain.cpu_us(m["unique"])
        info["core1_busy"] = max(pub_busy, meter_drain.core_busy())
        info["core0_foreign"] = max(pub_foreign, meter_drain.foreign())
        info["bound"] = {"offline.pub": (max(w.load(pubs), pub_busy), pub_broker),
                         "offline.drain": (max(w.load([sub]), meter_drain.core_busy()), meter_drain.broker_busy())}
    finally:
        w.close()
    s = m["subscribers"][0]
    by_pub = {d["pub"]: d for d in done.values()}
    lost = sum(_lost(by_pub[i]["acked_bitmap"], s["bitmaps"][i]) for i in range(4))
    info["checks"] = {"acked": acked, "delivered": m["unique"], "dups": m["dups"], "session_present":
                      s["session_present"], "rss_before_kib": rss0, "rss_queued_kib": rss1, "dup_flag": m["dup_flag"]}
    if not s["session_present"]:
        info["checks"]["note"] = "session not present on reconnect"
    if acked < n:
        raise RuntimeError(f"only {acked} of {n} publishes acknowledged")
    return {"offline.pub": acked / max(1e-9, (t1 - t0) / 1e9), "offline.rss": rss1 / 1024,
            "offline.drain": m["unique"] / max(1e-9, (m["last_ns"] - m["t_connect_ns"]) / 1e9),
            "offline.lost": lost, "offline.ooo": m["out_of_order"], "offline.cpu": cpu, "offline.pubcpu": pub_cpu,
            "offline.draincpu": drain_cpu, "offline.fsync": fsync_ms}


def scenario_kill(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
    if b.kind == "amqtt":
        raise NotApplicable("amqtt keeps queued messages in memory only (its SessionDBPlugin stores sessions and "
                            "retained messages, not queued ones)")
    assert b.target is not None
    t = b.target
    prepare_persistent_subscriber(t, "bench-kill-sub", "bench/kill/#", 1)
    w = Workers(budget)
    try:
        pubs = [w.spawn(run_publisher_qos1, t, i, f"bench/kill/p{i}", 1 << 30, w.ctl, window=32,
                        duration=p.kill_after + 20) for i in range(4)]
        w.collect("ready", pubs, 20)
        w.ctl.go.set()
        time.sleep(p.kill_after)
        b.kill()
        done = w.collect("done", pubs, 30)
        acked = sum(d["acked"] for d in done.values())
        b.start()
        w.ctl.pubs_done.set()
        sub = w.spawn(run_subscribers, b.target, [SubSpec("bench-kill-sub", None, 1, clean=False, pubs=4,
                                                          per_pub=1 << 16)], w.ctl, bitmaps=True, idle=2.0)
        w.collect("ready", [sub], 30)
        m = merge_subscribers(w.collect("done", [sub], budget))
    finally:
        w.close()
    s = m["subscribers"][0]
    by_pub = {d["pub"]: d for d in done.values()}
    lost = sum(_lost(by_pub[i]["acked_bitmap"], s["bitmaps"][i]) for i in range(4))
    info["checks"] = {"acked": acked, "sent": sum(d["sent"] for d in done.values()), "delivered": m["unique"],
                      "session_present": s["session_present"], "dups": m["dups"], "out_of_order": m["out_of_order"]}
    return {"kill.acked": acked, "kill.lost": lost}


SCENARIOS: dict[str, tuple[Callable[[Broker, Params, float, dict[str, Any]], dict[str, float]], bool, float]] = {
    # name: (function, broker persistence, budget in seconds)
    "fanin": (scenario_fanin, False, 60.0),
    "fanin_tls": (scenario_fanin, False, 60.0),
    "fanin_acl": (scenario_fanin, False, 60.0),
    "qos1": (scenario_qos1, False, 40.0),
    "qos1_tls": (scenario_qos1, False, 40.0),
    "qos2": (scenario_qos2, False, 40.0),
    "fanout": (scenario_fanout, False, 60.0),
    "idle": (scenario_idle, False, 90.0),
    "offline": (scenario_offline, False, 150.0),
    "retained": (scenario_retained, False, 90.0),
    "kill": (scenario_kill, True, 90.0),
}


# ---------------------------------------------------------------------------------------------------------------
# reporting


def fmt(value: float, kind: str) -> str:
    if value != value:  # NaN
        return "-"
    if kind == "rate":
        if value >= 1e6:
            return f"{value / 1e6:.2f}M"
        if value >= 1e4:
            return f"{value / 1e3:.0f}k"
        if value >= 1e3:
            return f"{value / 1e3:.1f}k"
        return f"{value:.0f}"
    if kind in ("ms", "us", "kib", "mib"):
        if value >= 100:
            return f"{value:.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return f"{value:.0f}"


def ratio(r: float) -> str:
    if r >= 100:
        return f"{r:.0f}x"
    if r >= 10:
        return f"{r:.1f}x"
    return f"{r:.2f}x"


def summarize(values: list[float], kind: str) -> str:
    med = statistics.median(values)
    if len(values) == 1 or min(values) == max(values):
        return fmt(med, kind)
    return f"{fmt(med, kind)} ({fmt(min(values), kind)}-{fmt(max(values), kind)})"


def ceilings(sc: dict[str, Any], fanout_subs: int) -> dict[str, float]:
    """Per-scenario ceilings of the load generator: publisher and subscriber share core 1, so a scenario's
    ceiling is 1 / (1/publish + 1/subscribe) in its own unit. The connect and fan-out ceilings are the C
    generator's (``connect_c``, ``subscribe_fanout_c``) when the self-check measured them."""

    def both(a: float, b: float) -> float:
        return 1 / (1 / a + 1 / b)

    def rate(check: str) -> float:
        return float(sc[check]["rate"]) if check in sc else float("nan")  # not measured: "-" in the table

    return {
        "fanin": both(rate("publish_qos0"), rate("subscribe_qos0")),
        "qos1": both(rate("publish_qos1"), rate("subscribe_qos1")),
        "qos1_pub": rate("publish_qos1"),
        "fanout": both(rate("publish_qos0") * fanout_subs,
                       rate("subscribe_fanout_c" if "subscribe_fanout_c" in sc else "subscribe_fanout")),
        "connect": rate("connect_c" if "connect_c" in sc else "connect"),
        "offline_pub": rate("publish_qos1"),
        "offline_drain": rate("subscribe_qos1"),
    }


#: the self-checks whose ceilings a scenario's rows show (--only runs just these)
SELF_CHECKS = {
    "fanin": {"publish_qos0", "subscribe_qos0"},
    "fanin_acl": {"publish_qos0", "subscribe_qos0"},
    "qos1": {"publish_qos1", "subscribe_qos1"},
    "fanout": {"publish_qos0", "subscribe_fanout"},
    "idle": {"connect"},
    "offline": {"publish_qos1", "subscribe_qos1"},
}


def build_table(results: dict[str, dict[str, list[float]]], notes: dict[tuple[str, str], str],
                ceil: dict[str, float] | None, brokers: list[str], scenarios: list[str],
                runs: int, busy: dict[tuple[str, str], list[tuple[float, float]]]) -> tuple[str, list[str]]:
    """The markdown table and its footnotes."""
    header = ["scenario", "metric"]
    for k in brokers:
        header.append(k)
        if k != "mosquitto" and "mosquitto" in brokers:
            header.append(f"{k} / mosq")
    header.append("loadgen ceiling")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    foot: list[str] = []
    bound = False
    last_scenario = None
    for m in METRICS:
        sname = m.key.split(".")[0]
        if sname not in scenarios:
            continue
        arrow = {"up": " (higher is better)", "down": " (lower is better)", "": ""}[m.better]
        row = [m.scenario if m.scenario != last_scenario else "", m.label + arrow]
        last_scenario = m.scenario
        mosq = results.get("mosquitto", {}).get(m.key)
        for k in brokers:
            vals = results.get(k, {}).get(m.key)
            note = notes.get((k, sname))
            if vals:
                cell = summarize(vals, m.fmt)
                if any(lg >= LOADGEN_BUSY_LIMIT and br < LOADGEN_BUSY_LIMIT for lg, br in busy.get((k, m.key), [])):
                    cell += " \u2020"
                    bound = True
                if len(vals) < runs:
                    cell += f" (n={len(vals)})"
            else:
                cell = "n/a" if note else "-"
                if note:
                    ref = f"[{len(foot) + 1}]" if note not in foot else f"[{foot.index(note) + 1}]"
                    if note not in foot:
                        foot.append(note)
                    cell += f" {ref}"
            row.append(cell)
            if k != "mosquitto" and "mosquitto" in brokers:
                if vals and mosq and m.better and statistics.median(mosq) > 0:
                    row.append(ratio(statistics.median(vals) / statistics.median(mosq)))
                else:
                    row.append("-")
        row.append(fmt(ceil[m.ceiling], m.fmt) if ceil and m.ceiling else "")
        lines.append("| " + " | ".join(row) + " |")
    notes_out = [f"[{i + 1}] {n}" for i, n in enumerate(foot)]
    if bound:
        limit = f"{LOADGEN_BUSY_LIMIT:.0%}"
        notes_out.append(f"\u2020 in at least one run the load generator's core was {limit} or more busy (its "
                         f"processes, or the kernel's loopback work on that core) while the broker used less than "
                         f"{limit} of its own core: the figure may be bounded by the load side, not the broker.")
    return "\n".join(lines), notes_out


def machine_info() -> dict[str, str]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": model, "kernel": platform.release()}


# ---------------------------------------------------------------------------------------------------------------


def gateway_code_hash() -> str:
    """A short hash of gateway/**/*.py as the broker will load it (the code may change while a run goes on)."""
    h = hashlib.sha1()
    for path in sorted((BENCH.parent / "gateway").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:8]


def run_cell(kind: str, scenario: str, p: Params, tmp: Path, run: int,
             security: dict[str, Security] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    fn, persistence, budget = SCENARIOS[scenario]
    if kind == "amqtt":
        budget = min(budget, p.amqtt_cap)
    info: dict[str, Any] = {}
    variant = VARIANTS.get(scenario)
    if variant is not None:
        if kind == "amqtt":
            raise NotApplicable("not measured (the TLS and ACL rows compare edge-gateway with Mosquitto)")
        if security is None or variant[1] not in security:
            raise NotApplicable(f"no {variant[1]} files")
        inner = fn

        def fn(b: Broker, p: Params, budget: float, info: dict[str, Any]) -> dict[str, float]:
            # the base scenario's keys ("fanin.rate") renamed to this row's ("fanin_tls.rate")
            res = inner(b, p, budget, info)
            info["bound"] = {f"{scenario}.{k.split('.', 1)[1]}": v for k, v in info.get("bound", {}).items()}
            return {f"{scenario}.{k.split('.', 1)[1]}": v for k, v in res.items()}

    if kind == bench_brokers.METRICS_KIND:  # edge-gateway with /metrics on, scraped every second
        b: Broker = bench_brokers.MetricsGateway(tmp / f"{scenario}-{kind}-{run}", persistence=persistence,
                                   nofile=p.idle_conns + 5000)
    else:
        b = Broker(kind, tmp / f"{scenario}-{kind}-{run}", persistence=persistence, nofile=p.idle_conns + 5000,
                   security=security[variant[1]] if variant is not None and security is not None else None)
    if kind.startswith("edge-gateway"):
        info["code"] = gateway_code_hash()
    try:
        if scenario == "kill" and kind == "amqtt":
            return fn(b, p, budget, info), info
        b.start()
        info["rss_start_kib"] = b.rss_kib()
        res = fn(b, p, budget, info)
        if not b.alive():
            raise BrokerError(f"{kind} exited during the scenario (code {b.proc.returncode if b.proc else '?'})")
        return res, info
    except Exception as exc:
        info["log_tail"] = b.log_tail()
        exc.info = info  # type: ignore[attr-defined]
        raise
    finally:
        code = b.stop()
        info["exit_code"] = code
        if isinstance(b, bench_brokers.MetricsGateway):
            info["checks"] = {**info.get("checks", {}), "scrapes": b.scrapes, "scrape_errors": b.scrape_errors,
                              "scraped_lines": b.samples}
        info["warnings"] = b.warnings()
        b.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, help="runs per cell (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="one short run of everything")
    ap.add_argument("--only", help=f"comma-separated scenarios ({','.join(SCENARIOS)})")
    ap.add_argument("--brokers", default=",".join(KINDS),
                    help="comma-separated brokers; edge-gateway+metrics: edge-gateway with Prometheus metrics on, "
                    "scraped every second")
    ap.add_argument("--no-selfcheck", action="store_true", help="skip the load generator's ceiling")
    ap.add_argument("--idle-generator", choices=("auto", "c", "python"), default="auto",
                    help="the idle scenario's opener: the C one (bench/cloadgen, make cloadgen), the Python one "
                    "(bench/loadgen.py), or auto: C when it is built")
    ap.add_argument("--msg-generator", choices=("auto", "c", "python"),
                    help="the fan-out and retained rows' subscribers: the C ones (bench/cloadgen sub, make cloadgen), "
                    "the Python ones (bench/loadgen.py), or auto: C when it is built (default; --quick: python)")
    ap.add_argument("--ack-generator", choices=("python", "c"), default="python",
                    help="the QoS 1 and QoS 2 rows' subscriber and publishers and the offline row's publishers: the "
                    "Python ones (bench/loadgen.py, default) or the C ones (bench/cloadgen sub and pub, make cloadgen)")
    ap.add_argument("--out", default=str(RESULTS / "latest.md"))
    args = ap.parse_args()
    p = QUICK if args.quick else Params()
    if args.runs:
        p.runs = args.runs
    p.idle_generator = args.idle_generator
    p.ack_generator = args.ack_generator
    if args.msg_generator:
        p.msg_generator = args.msg_generator
    scenarios = args.only.split(",") if args.only else list(SCENARIOS)
    brokers = [k for k in (*KINDS, bench_brokers.METRICS_KIND) if k in args.brokers.split(",")]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
    nofile = raise_nofile(p.idle_conns + 5000)
    if nofile < p.idle_conns + 100:
        print(f"RLIMIT_NOFILE is {nofile}: the idle scenario needs more", file=sys.stderr)
    two_cores = (os.cpu_count() or 1) >= 2
    if two_cores:
        os.sched_setaffinity(0, {LOADGEN_CPU})
    started = time.monotonic()
    vers = versions()
    mach = machine_info()
    print(f"# machine: {mach['nproc']} x {mach['cpu']}; broker on core 0, load generator on core 1"
          if two_cores else "# one core only: no pinning", file=sys.stderr)
    print(f"# versions: {vers}", file=sys.stderr)
    before = core_times()
    time.sleep(1.0)
    idle_load = {c: busy_fraction(before, core_times(), c) for c in before}
    print(f"# load before the run: {', '.join(f'core {c} {v:.0%}' for c, v in idle_load.items())}", file=sys.stderr)
    ceil = None
    sc: dict[str, Any] = {}
    if not args.no_selfcheck:
        print("# load generator self-check against the do-nothing sink ...", file=sys.stderr)
        c_idle = "idle" in scenarios and idle_generator(p) == "c"
        if "idle" in scenarios:
            print(f"# idle connections opened by the {'C (bench/cloadgen)' if c_idle else 'Python'} generator",
                  file=sys.stderr)
        c_msg = msg_generator(p) == "c"
        if {"fanout", "retained"} & set(scenarios):
            print(f"# fan-out and retained subscribers: {'C (bench/cloadgen sub)' if c_msg else 'Python'}",
                  file=sys.stderr)
        c_fanout = "fanout" in scenarios and c_msg
        only = None  # every check
        if args.only:
            only = set().union(*(SELF_CHECKS.get(s, set()) for s in scenarios))
            if c_idle:
                only.add("connect_c")
            if c_fanout:  # the fan-out row's ceiling is the C subscribers' (ceilings())
                only.add("subscribe_fanout_c")
                if "fanin" not in scenarios and "fanin_acl" not in scenarios:
                    only.discard("subscribe_fanout")
        sc = self_check(p.selfcheck_seconds, pin=two_cores, connections=min(p.idle_conns, 2000), only=only,
                        c_generator=c_idle, c_subscribers=c_fanout)
        ceil = ceilings(sc, p.fanout_subs)
        for name, r in sc.items():
            print(f"#   {name:<18} {r['rate']:>12,.0f}/s", file=sys.stderr)
        bad = [n for n, r in sc.items() if r.get("lost") or r.get("dups") or r.get("out_of_order") or r.get("errors")
               or ("sink_received" in r and r["sink_received"] != r["sent"])]
        if bad:
            print(f"# SELF-CHECK FAILED: {bad}: {sc}", file=sys.stderr)
            return 1
    results: dict[str, dict[str, list[float]]] = {k: {} for k in brokers}
    notes: dict[tuple[str, str], str] = {}
    busy: dict[tuple[str, str], list[tuple[float, float]]] = {}
    noisy: list[str] = []
    code_versions: dict[str, list[str]] = {}
    problems: list[str] = []
    checks: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    tmp.chmod(0o755)  # Mosquitto, started as root, drops to its own user and must reach its work directory
    security: dict[str, Security] = {}
    if any(s in VARIANTS for s in scenarios):  # one certificate and one set of files for every broker and run
        security = {"tls": make_pki(tmp / "pki"), "acl": write_auth_files(tmp / "auth")}
    try:
        for run in range(p.runs):
            for scenario in scenarios:
                for kind in brokers:
                    if kind == "amqtt" and (kind, scenario) in notes:
                        continue  # amqtt failed or ran out of time once: do not spend more time on it
                    t0 = time.monotonic()
                    try:
                        res, info = run_cell(kind, scenario, p, tmp, run, security)
                    except NotApplicable as exc:
                        notes[(kind, scenario)] = f"{kind}, {scenario}: {exc}"
                        print(f"# run {run + 1} {scenario:<8} {kind:<13} n/a: {exc}", file=sys.stderr)
                        continue
                    except Exception as exc:
                        info = getattr(exc, "info", {})
                        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        notes[(kind, scenario)] = f"{kind}, {scenario}: {reason}"
                        print(f"# run {run + 1} {scenario:<8} {kind:<13} FAILED: {reason}", file=sys.stderr)
                        if kind != "amqtt":
                            problems.append(f"{kind} {scenario} run {run + 1}: {reason}\n"
                                            f"{traceback.format_exc()}\n{info.get('log_tail', '')}")
                        continue
                    for key, value in res.items():
                        results[kind].setdefault(key, []).append(float(value))
                    if "code" in info:
                        code_versions.setdefault(info["code"], []).append(f"run {run + 1} {scenario}")
                    for key, pair in info.get("bound", {}).items():
                        busy.setdefault((kind, key), []).append(pair)
                    shown = ", ".join(f"{k.split('.')[1]}={v:,.2f}" for k, v in res.items())
                    lg = ", ".join(f"{k}: load side {a:.0%} broker {b:.0%} of a core"
                                   for k, (a, b) in info.get("bound", {}).items())
                    if "core1_busy" in info:
                        lg += f"; core 1 {info['core1_busy']:.0%} busy, others on core 0 {info['core0_foreign']:.0%}"
                    if info.get("core0_foreign", 0) > FOREIGN_LIMIT:
                        noisy.append(f"run {run + 1} {scenario} {kind}: {info['core0_foreign']:.0%}")
                    print(f"# run {run + 1} {scenario:<8} {kind:<13} {time.monotonic() - t0:5.1f} s  {shown}  {lg}  "
                          f"{info.get('checks', '')}", file=sys.stderr)
                    checks.append(f"run {run + 1} {scenario} {kind}: {shown}; {lg}; {info.get('checks', '')}"
                                  + (f"; broker log: {info['warnings']}" if info.get("warnings") else ""))
                    if kind.startswith("edge-gateway"):
                        bad = {k: v for k, v in res.items() if k.endswith((".lost", ".ooo")) and v}
                        extra = {k: v for k, v in info.get("checks", {}).items()
                                 if k in ("dups", "out_of_order", "bad") and v}
                        if bad or extra or info.get("exit_code") not in (0, None):
                            problems.append(f"edge-gateway {scenario} run {run + 1}: {bad} {extra} exit code "
                                            f"{info.get('exit_code')} checks {info.get('checks')} broker log: "
                                            f"{info.get('warnings')}")
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    table, foot = build_table(results, notes, ceil, brokers, scenarios, p.runs, busy)
    if len(code_versions) > 1:
        foot.append(f"edge-gateway's code (gateway/*.py) changed during this run: {len(code_versions)} versions, "
                    + "; ".join(f"{h}: {', '.join(cells)}" for h, cells in code_versions.items()))
    for base, name, what in (("fanin", "fanin_tls", "over TLS"), ("qos1", "qos1_tls", "over TLS"),
                             ("fanin", "fanin_acl", f"with an acl_file of {ACL_RULES:,} rules")):
        for k in brokers:
            a, b = results.get(k, {}).get(f"{base}.rate"), results.get(k, {}).get(f"{name}.rate")
            if a and b:
                foot.append(f"{k}: {base} {what} / {base} = {statistics.median(b) / statistics.median(a):.2f} "
                            f"(medians, same run)")
    if noisy:
        foot.append(f"other processes used more than {FOREIGN_LIMIT:.0%} of the broker's core during "
                    f"{len(noisy)} run(s) (the machine was shared): {'; '.join(noisy)}")
    print(table)
    for line in foot:
        print(line)
    if problems:
        print("\nPROBLEMS (edge-gateway / Mosquitto):", file=sys.stderr)
        for pr in problems:
            print(pr, file=sys.stderr)
    write_report(Path(args.out), table, foot, p, vers, mach, sc, elapsed, problems, two_cores, checks)
    print(f"\n# {elapsed:.0f} s; written to {args.out}", file=sys.stderr)
    return 0


def write_report(path: Path, table: str, foot: list[str], p: Params, vers: dict[str, str], mach: dict[str, str],
                 sc: dict[str, Any], elapsed: float, problems: list[str], pinned: bool, checks: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"# Benchmarks: edge-gateway and amqtt against Mosquitto ({now})", ""]
    out += [table, ""]
    out += [f"- {line}" for line in foot]
    out += [
        "",
        "Cells: median (min-max) over the runs; `x / mosq` = median / Mosquitto's median (for latency, CPU and "
        "RSS lower is better). 64-byte payloads, MQTT 3.1.1.",
        "",
        "## Setup",
        "",
        f"- machine: {mach['nproc']} cores, {mach['cpu']}, Linux {mach['kernel']}",
        ("- brokers pinned to core 0 (`taskset -c 0`), the load generator (harness and worker processes) to core 1"
         if pinned else "- single core: no pinning"),
        f"- versions: mosquitto {vers['mosquitto']}, edge-gateway {vers['edge-gateway']} (Python {vers['python']}), "
        f"amqtt {vers['amqtt']}",
        f"- runs per cell: {p.runs}; total time {elapsed:.0f} s",
        f"- limits: max_inflight {MAX_INFLIGHT} (Mosquitto max_inflight_messages), queue {MAX_QUEUED} messages "
        "(Mosquitto max_queued_messages, edge-gateway max_mqueue_len); amqtt has no such settings",
        f"- fan-in: 4 x {p.fanin_per_pub} messages; QoS 1: {p.qos1_seconds} s; fan-out: {p.fanout_msgs} messages "
        f"x {p.fanout_subs} subscribers; idle: {p.idle_conns} connections (opener: {p.idle_generator}, "
        f"{'bench/cloadgen built' if cloadgen_binary() else 'bench/cloadgen not built'}); "
        f"fan-out and retained subscribers: {'C (bench/cloadgen sub)' if msg_generator(p) == 'c' else 'Python'} "
        f"(--msg-generator {p.msg_generator}); "
        f"QoS 1, QoS 2 and offline publishers' clients: "
        f"{'C (bench/cloadgen sub, pub)' if p.ack_generator == 'c' else 'Python'} "
        f"(--ack-generator {p.ack_generator}); "
        f"offline: {p.offline_msgs} messages; "
        f"kill: SIGKILL {p.kill_after} s after the publishers start",
        "",
    ]
    if sc:
        out += ["## Load generator ceiling (against the do-nothing sink on core 0)", "",
                "| check | rate/s | verified |", "|---|---|---|"]
        for name, r in sc.items():
            rest = ", ".join(f"{k}={v}" for k, v in r.items() if k != "rate")
            out.append(f"| {name} | {r['rate']:,.0f} | {rest} |")
        out.append("")
    if problems:
        out += ["## Problems", "", "```", *problems, "```", ""]
    out += ["## Per-run checks", "", "```", *checks, "```", ""]
    path.write_text("\n".join(out))


if __name__ == "__main__":
    raise SystemExit(main())
