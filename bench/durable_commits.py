"""The durable QoS 1 publish, commit by commit: how many messages share an LMDB commit and how long the commit takes.

    .venv/bin/python bench/durable_commits.py [--messages 100000] [--runs 3] [--window 32] [--store-dir DIR]

The offline row of bench/run.py for edge-gateway alone: a persistent QoS 1 session left offline, then 4 publishers
(``cloadgen pub``, bench/cloadgen) each with ``--window`` QoS 1 PUBLISHes unacknowledged, ``--messages`` in all.
edge-gateway runs with Prometheus metrics on, read only before and after the publishing, and the report is the
store's own counters over the run: group commits (``edge_gateway_store_commits_total``), the time the store writer
spent in LMDB's ``txn.commit()`` (``edge_gateway_store_fsync_duration_seconds``: the dirty pages written, the data
file's fdatasync and the meta page's synchronous write), and from them messages per commit, milliseconds per commit
and the share of the run the writer spent committing. Beside them: acknowledged messages/s, the broker's CPU per
message (/proc, utime + stime) and the disk's fdatasync latency (bench/run.py's probe, in the same directory).

``--store-dir`` puts the broker's working directory, its LMDB store with it, on another file system: on ``/dev/shm``
(tmpfs: every sync returns at once, and nothing survives a power cut) the rate shows what the same code does when
the disk costs nothing. The broker is pinned to core 0 and the publishers to core 1, as in bench/run.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import MetricsGateway
from loadgen import Workers, cloadgen_binary, prepare_persistent_subscriber, run_publishers_c
from run import Meter, _per_publisher, fsync_probe

PUBLISHERS = 4
#: The store's samples read from /metrics (``edge_gateway_store_`` + these).
SAMPLES = ("commits_total", "fsync_duration_seconds_sum")


def store_counters(url: str) -> dict[str, float]:
    """The store's :data:`SAMPLES` from edge-gateway's /metrics at ``url``.

    Raises:
        RuntimeError: a sample is missing (metrics off, or an older broker).
    """
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("edge_gateway_store_")
            if name in SAMPLES:
                found[name] = sample.value
    missing = [s for s in SAMPLES if s not in found]
    if missing:
        raise RuntimeError(f"/metrics has no edge_gateway_store_{missing[0]}")
    return found


def one_run(store_dir: str | None, messages: int, window: int) -> dict[str, float]:
    """One broker, one publishing of ``messages`` (``window`` in flight per publisher); the figures of the module's
    docstring.

    Raises:
        RuntimeError: a publisher failed or fewer than ``messages`` were acknowledged.
    """
    per = messages // PUBLISHERS
    with tempfile.TemporaryDirectory(prefix="durable-commits-", dir=store_dir) as d:
        broker = MetricsGateway(Path(d), interval=86400.0)  # no scrapes during the run
        target = broker.start()
        try:
            fsync_ms = fsync_probe(Path(d))
            prepare_persistent_subscriber(target, "bench-commits-sub", "bench/commits/#", 1)
            time.sleep(0.2)
            before = store_counters(broker.metrics_url)
            w = Workers(60.0)
            try:
                pubs = [w.spawn(run_publishers_c, target, PUBLISHERS, "bench/commits/p", w.ctl, window=window,
                                duration=60.0, count=per)]
                w.collect("ready", pubs, 20)
                meter = Meter(broker)
                w.ctl.go.set()
                done = _per_publisher(w.collect("done", pubs, 60.0))
            finally:
                w.close()
            cpu_us = meter.cpu_us(per * PUBLISHERS)
            after = store_counters(broker.metrics_url)
        finally:
            broker.stop()
    errors = [d["error"] for d in done.values() if d.get("error")]
    acked = sum(d["acked"] for d in done.values())
    if errors or acked < per * PUBLISHERS:
        raise RuntimeError(f"{acked} of {per * PUBLISHERS} acknowledged; errors: {errors}")
    seconds = (max(d["t_end_ns"] for d in done.values()) - min(d["t_start_ns"] for d in done.values())) / 1e9
    commits = after["commits_total"] - before["commits_total"]
    in_commit = after["fsync_duration_seconds_sum"] - before["fsync_duration_seconds_sum"]
    return {"acked": acked, "rate": acked / seconds, "commits_per_s": commits / seconds,
            "per_commit": acked / max(1.0, commits), "commit_ms": in_commit / max(1.0, commits) * 1e3,
            "commit_share": in_commit / seconds, "cpu_us": cpu_us, "fsync_ms": fsync_ms}


COLUMNS = (("rate", "acked msgs/s", "{:,.0f}"), ("commits_per_s", "commits/s", "{:,.0f}"),
           ("per_commit", "msgs/commit", "{:.1f}"), ("commit_ms", "ms in txn.commit a commit", "{:.3f}"),
           ("commit_share", "share of the run in txn.commit", "{:.0%}"), ("cpu_us", "broker CPU us/msg", "{:.2f}"),
           ("fsync_ms", "fdatasync probe ms", "{:.2f}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000, help="QoS 1 messages per run, all publishers (100,000)")
    ap.add_argument("--runs", type=int, default=3, help="runs, each on a fresh broker and store (3)")
    ap.add_argument("--window", type=int, default=32, help="unacknowledged PUBLISHes per publisher (32, as the row)")
    ap.add_argument("--store-dir", help="the file system for the broker's directory and store (default: TMPDIR)")
    args = ap.parse_args()
    if cloadgen_binary() is None:
        print("bench/cloadgen is not built: run `make cloadgen` first", file=sys.stderr)
        return 2
    runs = []
    for i in range(args.runs):
        r = one_run(args.store_dir, args.messages, args.window)
        runs.append(r)
        print(f"# run {i + 1}: " + ", ".join(f"{label} {fmt.format(r[key])}" for key, label, fmt in COLUMNS))
    where = args.store_dir or tempfile.gettempdir()
    print(f"\n{args.messages:,} durable QoS 1 messages, {PUBLISHERS} publishers x {args.window} in flight, store "
          f"under {where}; median of {len(runs)} runs (min-max)\n")
    print("| measure | median | min-max |\n|---|---|---|")
    for key, label, fmt in COLUMNS:
        values = [r[key] for r in runs]
        low, high = fmt.format(min(values)), fmt.format(max(values))
        print(f"| {label} | {fmt.format(statistics.median(values))} | {low}-{high} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
