"""Instructions a connection, a durable publish and a drained message cost each broker, counted by valgrind's
callgrind in the running broker processes, Mosquitto and edge-gateway side by side.

    .venv/bin/python bench/instructions.py [--connections 1000] [--messages 4000] [--brokers mosquitto,edge-gateway]

What the rate rows of docs/benchmarks.md cannot tell apart: how much of a missed row is the machine, the clients or
the kernel, and how much is the broker's own work. Each broker runs under ``valgrind --tool=callgrind`` (pinned like
bench/run.py's brokers; Mosquitto in memory, edge-gateway with its LMDB store, an fdatasync per commit, as in the
durable rows) and does, in this order:

- **a connection**: bench/cloadgen's idle opener makes N, then 2N connections (3.1.1, Keep Alive 60, 64 handshakes
  at a time) and resets them: open, CONNECT, CONNACK, close;
- **a durable publish**: a persistent session (``mosquitto_sub -c``, QoS 1, then offline) and ``cloadgen pub``
  publishing M QoS 1 messages into it (window 32; each acknowledged once the broker holds it: for edge-gateway,
  once it is committed);
- **a drained message**: the session comes back (``mosquitto_sub -c``), receives all M, QoS 1, in order, and goes;
  then the same with 2M. Each drain starts from the queue its publish filled, so what a broker does per queued
  message when the session comes back is part of the drain's cost.

After each step ``callgrind_control --dump`` writes the instructions the broker process (every thread) ran since
the last dump, once its CPU has gone quiet. A path's cost is the difference of its two steps over the difference
of their counts, so what a step costs once (a client's connection, the start of a drain) cancels. The counts are
instructions, not seconds: they do not move with the machine's load or its fast and slow states, and the kernel's
work (the TCP stack, fdatasync) is not in them. Takes about a minute with the defaults.

edge-gateway runs with ``[store] lazy_commit`` at 250 ms (``--lazy-commit``) instead of 5 ms: changes nobody waits
for (a row deleted after its PUBACK, a send's Packet Identifier) wait that long for a commit, and valgrind slows
the broker 50-100 times. At 5 ms a drain's sends would mostly be committed before their PUBACKs come, which at full
speed happens to about 4% of them (docs/benchmarks.md), and the drain would count a write per message that the
broker at speed does not make.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import Broker, BrokerError
from loadgen import HOST, USERNAME, cloadgen_binary

#: the paths measured, in the order they run: (key, what one of them is)
PATHS = (("connect", "a connection (open, CONNECT, CONNACK, reset)"),
         ("publish", "a durable QoS 1 publish into an offline session"),
         ("drain", "a drained message (QoS 1, in order)"))
#: seconds: edge-gateway's ``[store] lazy_commit`` under valgrind (module docstring)
LAZY_COMMIT = 0.25
SESSION = "instructions-drain"
TOPIC_PREFIX = "instructions/"
_TOTALS = re.compile(r"^totals: (\d+)", re.MULTILINE)


class MeasureError(RuntimeError):
    """A step did not do what it was asked (fewer connections, acknowledgements or deliveries than asked)."""


@dataclass
class Counts:
    """One broker's instructions per step (``step -> instructions``) and per path (``path -> per operation``)."""

    kind: str
    steps: dict[str, int] = field(default_factory=dict)
    per_op: dict[str, float] = field(default_factory=dict)


def per_operation(first: int, second: int, n_first: int, n_second: int) -> float:
    """Instructions per operation from two steps of ``n_first`` and ``n_second`` operations that ran ``first`` and
    ``second`` instructions: their difference over the difference of their counts (a step's fixed cost cancels).

    Raises:
        ValueError: the two steps have the same number of operations.
    """
    if n_second == n_first:
        raise ValueError("the two steps need different numbers of operations")
    return (second - first) / (n_second - n_first)


def read_totals(path: Path) -> int:
    """The ``totals:`` line of a callgrind output file: instructions since the previous dump.

    Raises:
        MeasureError: the file has no such line.
    """
    m = _TOTALS.search(path.read_text(errors="replace"))
    if m is None:
        raise MeasureError(f"{path} has no totals line")
    return int(m.group(1))


class Measured:
    """A broker under callgrind in ``workdir``, its dumps read back step by step."""

    def __init__(self, kind: str, workdir: Path, lazy_commit: float = LAZY_COMMIT) -> None:
        self.out = workdir / "callgrind.out"
        self.broker = Broker(kind, workdir / "broker", persistence=kind == "edge-gateway",
                             wrapper=("valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}"),
                             store_options=(f'lazy_commit = "{lazy_commit * 1000:g}ms"',)
                             if kind == "edge-gateway" else ())
        self.dumps = 0

    def start(self) -> int:
        target = self.broker.start(timeout=240.0)  # the interpreter's start runs 50-100 times slower under valgrind
        return target.port

    def quiet(self, timeout: float = 300.0) -> None:
        """Wait until the broker's CPU time stops growing (under 2% of a core over half a second): every reset,
        commit and acknowledgement of the step is done before its dump."""
        deadline = time.monotonic() + timeout
        last = self.broker.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.broker.cpu_seconds()
            if now - last < 0.01:
                return
            last = now
        raise MeasureError(f"{self.broker.kind} did not go quiet within {timeout:.0f} s")

    def dump(self, label: str) -> int:
        """Instructions since the previous dump (callgrind_control numbers the files .1, .2, ...)."""
        assert self.broker.proc is not None
        self.quiet()
        subprocess.run(["callgrind_control", "--dump=" + label, str(self.broker.proc.pid)], check=True,
                       capture_output=True, timeout=120)
        self.dumps += 1
        path = Path(f"{self.out}.{self.dumps}")
        deadline = time.monotonic() + 60
        while not (path.exists() and _TOTALS.search(path.read_text(errors="replace"))):
            if time.monotonic() > deadline:
                raise MeasureError(f"callgrind wrote no {path}")
            time.sleep(0.1)
        return read_totals(path)

    def stop(self) -> None:
        self.broker.stop(timeout=120.0)


def _run(cmd: list[str], stdin: str, timeout: float) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, 27):  # 27: mosquitto_sub -W's timeout
        raise MeasureError(f"{cmd[0]} {cmd[1]} exited with {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def connect(exe: str, port: int, n: int) -> None:
    """``n`` connections opened, then reset (the opener's stdin closes at once after its report)."""
    out = _run([exe, "idle", "--host", HOST, "--port", str(port), "--connections", str(n), "--concurrency", "64",
                "--keep-alive", "60", "--username", USERNAME, "--client-id-prefix", "instructions-",
                "--timeout", "600"], "", 660)
    r = json.loads(out.splitlines()[0])
    if r["connected"] != n:
        raise MeasureError(f"{r['connected']} of {n} connections accepted ({r['failed']} failed)")


def subscribe(port: int) -> None:
    """The persistent session (Clean Session 0, QoS 1), left offline."""
    _run(["mosquitto_sub", "-h", HOST, "-p", str(port), "-c", "-i", SESSION, "-q", "1", "-t", TOPIC_PREFIX + "#",
          "-E"], "", 120)


def publish(exe: str, port: int, m: int) -> None:
    """``m`` QoS 1 messages from one publisher (window 32), every one acknowledged."""
    out = _run([exe, "pub", "--host", HOST, "--port", str(port), "--publishers", "1", "--topic-prefix",
                TOPIC_PREFIX, "--qos", "1", "--window", "32", "--count", str(m), "--duration", "600",
                "--timeout", "600", "--username", USERNAME], "go\n", 660)
    report = json.loads(out.splitlines()[-1])
    acked = sum(p["acked"] for p in report["publishers"])
    if acked != m:
        raise MeasureError(f"{acked} of {m} publishes acknowledged")


def drain(port: int, m: int) -> None:
    """The session back: ``m`` messages received, then it goes (its session and the rest stay)."""
    out = _run(["mosquitto_sub", "-h", HOST, "-p", str(port), "-c", "-i", SESSION, "-q", "1", "-t",
                TOPIC_PREFIX + "#", "-C", str(m), "-F", "%t"], "", 660)
    got = len(out.splitlines())
    if got != m:
        raise MeasureError(f"{got} of {m} queued messages delivered")


def measure(kind: str, workdir: Path, connections: int, messages: int, lazy_commit: float = LAZY_COMMIT) -> Counts:
    """One broker's :class:`Counts` for the three paths (module docstring).

    Raises:
        MeasureError, BrokerError: a step failed or the broker did not start or stop.
    """
    exe = cloadgen_binary()
    if exe is None:
        raise MeasureError("bench/cloadgen/cloadgen is not built (make cloadgen)")
    counts = Counts(kind)
    m = Measured(kind, workdir, lazy_commit)
    port = m.start()
    try:
        connect(exe, port, 64)  # the first connection's lazy imports and allocations, outside every step
        subscribe(port)
        m.dump("warm-up")
        for n in (connections, 2 * connections):
            connect(exe, port, n)
            counts.steps[f"connect {n}"] = m.dump(f"connect-{n}")
        for n in (messages, 2 * messages):  # each drain empties the queue its publish filled
            publish(exe, port, n)
            counts.steps[f"publish {n}"] = m.dump(f"publish-{n}")
            drain(port, n)
            counts.steps[f"drain {n}"] = m.dump(f"drain-{n}")
    finally:
        m.stop()
    for path, size in (("connect", connections), ("publish", messages), ("drain", messages)):
        counts.per_op[path] = per_operation(counts.steps[f"{path} {size}"], counts.steps[f"{path} {2 * size}"],
                                            size, 2 * size)
    return counts


def table(results: list[Counts]) -> str:
    """A Markdown table: a row per path, a column per broker, and edge-gateway's ratio to Mosquitto when both
    ran."""
    kinds = [r.kind for r in results]
    both = "mosquitto" in kinds and "edge-gateway" in kinds
    head = "| path (instructions in the broker process) | " + " | ".join(kinds) + (" | ratio |" if both else " |")
    lines = [head, "|---" * (len(kinds) + 1 + both) + "|"]
    by_kind = {r.kind: r for r in results}
    for path, what in PATHS:
        cells = [f"{by_kind[k].per_op[path]:,.0f}" for k in kinds]
        ratio = (f" | {by_kind['edge-gateway'].per_op[path] / by_kind['mosquitto'].per_op[path]:.2f}x"
                 if both else "")
        lines.append(f"| {what} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Needs valgrind (callgrind_control), mosquitto, mosquitto_sub and "
                                        "bench/cloadgen (make cloadgen).")
    ap.add_argument("--connections", type=int, default=1000, help="N: the connect steps make N, then 2N")
    ap.add_argument("--messages", type=int, default=4000,
                    help="M: the publish steps send M, then 2M; the drain steps receive M, then 2M")
    ap.add_argument("--brokers", default="mosquitto,edge-gateway", help="comma-separated: mosquitto, edge-gateway")
    ap.add_argument("--lazy-commit", type=float, default=LAZY_COMMIT,
                    help="seconds: edge-gateway's [store] lazy_commit under valgrind (default %(default)s: its "
                         "5 ms default stretched as valgrind slows the broker, so that the drain's commits hold "
                         "as many acknowledgements as at full speed)")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep the brokers' work directories in DIR, with callgrind's dumps (KIND/callgrind.out.N, "
                         "one per step, in the order of the printed steps) for callgrind_annotate")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.brokers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("mosquitto", "edge-gateway")]
    if bad or not kinds:
        ap.error(f"--brokers: {','.join(bad) or 'none'}: allowed are mosquitto, edge-gateway")
    if args.connections < 1 or args.messages < 1:
        ap.error("--connections and --messages must be at least 1")
    if not 0 <= args.lazy_commit <= 1:
        ap.error(f"--lazy-commit {args.lazy_commit:g}: must be 0..1 seconds (the [store] key's range)")
    for tool in ("valgrind", "callgrind_control", "mosquitto_sub") + (("mosquitto",) if "mosquitto" in kinds else ()):
        if shutil.which(tool) is None:
            print(f"instructions: {tool} is not installed", file=sys.stderr)
            return 2
    results = []
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(args.keep)) if args.keep is not None else \
            tempfile.TemporaryDirectory(prefix="instructions-") as tmp:
        for kind in kinds:
            started = time.monotonic()
            try:
                results.append(measure(kind, Path(tmp) / kind, args.connections, args.messages, args.lazy_commit))
            except (MeasureError, BrokerError, subprocess.TimeoutExpired) as exc:
                print(f"instructions: {kind}: {exc}", file=sys.stderr)
                return 1
            steps = ", ".join(f"{k} {v:,}" for k, v in results[-1].steps.items())
            print(f"# {kind} ({time.monotonic() - started:.0f} s): {steps}", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
