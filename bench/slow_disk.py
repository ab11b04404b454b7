"""Durable QoS 1 publish on a slow disk: group commit's rate and broker CPU per message when every
fsync takes 5 ms longer.

The direct way is a file system throttled with ``dm-delay``. This machine's kernel has no device-mapper
(``dmsetup targets``: "/dev/mapper/control: open failed: No such device"; no ``device-mapper`` in /proc/misc and
no modules to load), so the latency is added where the broker waits for it instead: a small LD_PRELOAD library
(built here with ``cc``) makes ``fsync``, ``fdatasync``, ``msync(MS_SYNC)`` and writes to a descriptor opened with
``O_DSYNC``/``O_SYNC`` sleep ``FSYNC_DELAY_US`` after the real call, in the broker process only. LMDB's commit
waits for two synchronous steps (fdatasync of the data pages, then the meta page written through its ``O_DSYNC``
descriptor), so a commit waits >= 2 x the delay, as it would on a device whose flushes take that long; the
broker's loop keeps running meanwhile (the writer is its own thread), which is what group commit relies on. What it
does not model: a slow device's lower write bandwidth (the data per commit here is tens of KiB) and the page
cache's writeback.

The scenario is ``bench/durable.py``'s: ``--publishers`` publishers with ``--window`` QoS 1 messages in flight each
to one persistent offline subscriber (64-byte payloads, acknowledged after the commit), then the backlog drained
and counted. Reported per delay: messages/s, messages per commit, broker CPU microseconds per message, lost.

    python bench/slow_disk.py [--delays-ms 0,5] [--messages 30000] [--publishers 16] [--window 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from durable import commits_at_exit, connect, drain, publisher, start_broker

from gateway.mqtt.packets import Subscribe, Subscription

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/mman.h>
#include <time.h>
static long delay_ns = -1;
static void slow(void) {
    if (delay_ns < 0) { const char *s = getenv("FSYNC_DELAY_US"); delay_ns = s ? atol(s) * 1000L : 5000000L; }
    if (delay_ns > 0) { struct timespec ts = {delay_ns / 1000000000L, delay_ns % 1000000000L}; nanosleep(&ts, 0); }
}
int fsync(int fd) { static int (*real)(int); if (!real) real = dlsym(RTLD_NEXT, "fsync");
    int r = real(fd); slow(); return r; }
int fdatasync(int fd) { static int (*real)(int); if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    int r = real(fd); slow(); return r; }
int msync(void *a, size_t n, int f) { static int (*real)(void *, size_t, int);
    if (!real) real = dlsym(RTLD_NEXT, "msync"); int r = real(a, n, f); if (f & MS_SYNC) slow(); return r; }
/* LMDB writes its meta page through a second descriptor opened with O_DSYNC: a synchronous write, not fdatasync. */
static int dsync(int fd) { int fl = fcntl(fd, F_GETFL); return fl != -1 && (fl & (O_DSYNC | O_SYNC)); }
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) {
    static ssize_t (*real)(int, const void *, size_t, off_t); if (!real) real = dlsym(RTLD_NEXT, "pwrite");
    ssize_t r = real(fd, b, n, o); if (dsync(fd)) slow(); return r; }
ssize_t pwrite64(int fd, const void *b, size_t n, off64_t o) {
    static ssize_t (*real)(int, const void *, size_t, off64_t); if (!real) real = dlsym(RTLD_NEXT, "pwrite64");
    ssize_t r = real(fd, b, n, o); if (dsync(fd)) slow(); return r; }
ssize_t write(int fd, const void *b, size_t n) {
    static ssize_t (*real)(int, const void *, size_t); if (!real) real = dlsym(RTLD_NEXT, "write");
    ssize_t r = real(fd, b, n); if (dsync(fd)) slow(); return r; }
"""

CLK_TCK = os.sysconf("SC_CLK_TCK")


def build_shim(directory: Path) -> Path:
    src = directory / "slowsync.c"
    lib = directory / "slowsync.so"
    src.write_text(SHIM_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def run_once(lib: Path, delay_us: int, messages: int, publishers: int, window: int) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-slowdisk-"))
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "FSYNC_DELAY_US")}
    os.environ["LD_PRELOAD"] = str(lib)
    os.environ["FSYNC_DELAY_US"] = str(delay_us)
    try:
        proc, port = start_broker(workdir, "", cpu=0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        sock, _, _ = connect(port, "bench-sub", True)
        sock.sendall(Subscribe(1, [Subscription("bench/#", 1)]).encode(5))
        time.sleep(0.2)
        sock.close()
        per = messages // publishers
        times: dict[str, float] = {}
        threads = [threading.Thread(target=publisher, args=(port, f"pub{i}", per, window, times))
                   for i in range(publishers)]
        cpu0 = cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(proc.pid) - cpu0
        sent = per * publishers
        delivered = drain(port, sent)
        commits = commits_at_exit(proc)
        return {"delay_ms": delay_us / 1000, "rate": sent / elapsed, "sent": sent, "lost": sent - delivered,
                "commits": commits, "per_commit": sent / max(1, commits), "cpu_us_per_msg": cpu / sent * 1e6}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays-ms", default="0,5", help="added latency per fsync, ms, comma-separated (default 0,5)")
    ap.add_argument("--messages", type=int, default=30000)
    ap.add_argument("--publishers", type=int, default=16)
    ap.add_argument("--window", type=int, default=32, help="QoS 1 messages in flight per publisher")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    print(f"# load average {os.getloadavg()} (2 cores shared with other work; the publishers share core 1+)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-slowdisk-lib-") as tmp:
        lib = build_shim(Path(tmp))
        for delay in (float(x) for x in args.delays_ms.split(",")):
            for _ in range(args.runs):
                r = run_once(lib, int(delay * 1000), args.messages, args.publishers, args.window)
                print(json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
                results.append(r)
    print(f"\nDurable QoS 1 publish, {args.publishers} publishers x {args.window} in flight, 64 B, offline "
          f"persistent subscriber, fsync latency added with LD_PRELOAD ({args.runs} runs, median [min-max])")
    print("| added fsync latency | msgs/s | msgs per commit | broker CPU us/msg | lost |")
    print("|---|---|---|---|---|")
    for delay in sorted({r["delay_ms"] for r in results}):
        rs = [r for r in results if r["delay_ms"] == delay]
        rates = sorted(r["rate"] for r in rs)
        pc = sorted(r["per_commit"] for r in rs)
        cpu = sorted(r["cpu_us_per_msg"] for r in rs)
        print(f"| {delay:g} ms | {rates[len(rates) // 2]:,.0f} [{rates[0]:,.0f}-{rates[-1]:,.0f}] | "
              f"{pc[len(pc) // 2]:.0f} | {cpu[len(cpu) // 2]:.1f} | {sum(int(r['lost']) for r in rs)} |")
    print(f"# load average after {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
