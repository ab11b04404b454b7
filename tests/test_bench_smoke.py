"""Smoke test of the benchmark load generator (bench/loadgen.py; docs/benchmarks.md, "The load generator
(bench/loadgen.py) and its ceiling").

Its self-check runs publishers and subscribers against the built-in do-nothing sink on 127.0.0.1 for well under a
second per check; these tests assert that it counted and verified every message exactly (sequence numbers, no loss,
no duplicates, order) and that it refuses a port no broker of its own listens on. They never look at speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402

SUBSCRIBE_CHECKS = ("subscribe_qos0", "subscribe_qos1", "subscribe_fanout")


def _self_check(*args: str) -> dict[str, Any]:
    """Run ``loadgen.py --self-check`` in a subprocess (it forks its workers) and return its JSON report."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "loadgen.py"),
            "--self-check",
            "--json",
            "--no-pin",
            "--seconds",
            "0.3",
            "--connections",
            "200",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_self_check_counts_and_verifies_every_message() -> None:
    """Against the sink, every message published is received by the sink, every QoS 1 one acknowledged once,
    and every streamed message is received once, in sequence, with nothing lost or duplicated."""
    res = _self_check()
    assert set(res) == {"publish_qos0", "publish_qos1", *SUBSCRIBE_CHECKS, "connect"}

    pub0 = res["publish_qos0"]
    assert pub0["sent"] > 0
    assert pub0["sink_received"] == pub0["sent"]
    assert pub0["errors"] == []

    pub1 = res["publish_qos1"]
    assert pub1["sent"] > 0
    assert pub1["acked"] == pub1["sent"] == pub1["sink_received"]
    assert pub1["acked_distinct_ok"] is True
    assert pub1["errors"] == []

    for name in SUBSCRIBE_CHECKS:
        r = res[name]
        expected = r["expected_each"] * r["subscribers"]
        assert r["expected_each"] > 0, name
        assert (r["received"], r["unique"]) == (expected, expected), name
        assert (r["lost"], r["dups"], r["out_of_order"], r["bad"]) == (0, 0, 0, 0), name
    assert res["subscribe_fanout"]["subscribers"] == 50
    assert res["subscribe_qos1"]["acks_at_sink"] == res["subscribe_qos1"]["received"]
    assert res["subscribe_qos0"]["acks_at_sink"] == 0

    assert (res["connect"]["connected"], res["connect"]["failed"]) == (200, 0)


def test_self_check_detects_one_loss_one_duplicate_one_reorder() -> None:
    """With --faults the sink drops seq 10, sends seq 20 twice and seq 31 before 30 (publisher 0): the checker
    must report exactly one of each and still count every other message."""
    res = _self_check("--faults", "--only", "subscribe_qos0,subscribe_qos1")
    for name in ("subscribe_qos0", "subscribe_qos1"):
        r = res[name]
        streamed = r["expected_each"] + 1  # every message but the dropped one, plus the duplicate
        assert r["received"] == streamed, name
        assert r["unique"] == r["expected_each"], name
        assert (r["lost"], r["dups"], r["out_of_order"], r["bad"]) == (1, 1, 1, 0), name
    assert res["subscribe_qos1"]["acks_at_sink"] == res["subscribe_qos1"]["received"]


def test_target_check_refuses_ports_the_harness_did_not_start() -> None:
    """A worker refuses a port unless the harness's own child process listens on it (bench safety rule)."""
    me = os.getpid()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(loadgen.TargetError, match="is not a child of the harness"):
            loadgen.check_target(loadgen.Target(port, me, me, "self"))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(loadgen.TargetError, match="is not listened on by"):
                loadgen.check_target(loadgen.Target(port, child.pid, me, "child"))
            s.close()
            with pytest.raises(loadgen.TargetError, match="nothing listens on"):
                loadgen.check_target(loadgen.Target(port, child.pid, me, "child"))
        finally:
            child.kill()
            child.wait()


def test_durable_cpu_profile_runs_and_queues_every_message() -> None:
    """bench/durable_cpu.py (the in-process CPU split of a durable QoS 1 publish and its drain) runs on a real LMDB
    store: every message it publishes is queued for the offline subscriber, with group commits (more than one
    message each); the drain delivers every one of them and leaves no queue or message row."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "durable_cpu.py"), "--messages", "640",
                           "--in-flight", "64", "--drain"], capture_output=True, text=True, timeout=120, check=True)
    first = proc.stdout.splitlines()[0]
    count, rest = first.split(" durable QoS 1 messages, ")
    commits = int(rest.split(" commits")[0])
    assert int(count) == 640
    assert first.endswith(", 640 queued"), first
    assert 0 < commits < 640
    assert "loop thread CPU" in proc.stdout and "writer CPU" in proc.stdout
    drained = [line for line in proc.stdout.splitlines() if line.startswith("drain: ")]
    assert len(drained) == 1 and drained[0].startswith("drain: 640 of 640 queued messages delivered, 0 rows left, ")


def test_instructions_counts_every_path_in_both_brokers_under_callgrind(tmp_path: Path) -> None:
    """bench/instructions.py runs Mosquitto and edge-gateway under callgrind and fills every step: the connect steps
    with every connection accepted, the publish steps with every publish acknowledged, the drain steps with every
    message delivered (it stops with an error otherwise); the second step of each path runs more instructions than
    the first, and the table gives each path's instructions per operation for both brokers and their ratio.
    ``--keep`` leaves each broker's dumps (warm-up and six steps) and edge-gateway's config, with the stretched
    ``lazy_commit`` given by ``--lazy-commit``."""
    import instructions

    if instructions.cloadgen_binary() is None:
        pytest.skip("bench/cloadgen is not built (make cloadgen)")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "instructions.py"), "--connections", "40",
                           "--messages", "150", "--lazy-commit", "0.3", "--keep", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for kind in ("mosquitto", "edge-gateway"):
        dumps = sorted(p.name for p in (tmp_path / kind).glob("callgrind.out.*"))
        assert dumps == [f"callgrind.out.{i}" for i in range(1, 8)], dumps
    assert 'lazy_commit = "300ms"' in (tmp_path / "edge-gateway" / "broker" / "gateway.toml").read_text()
    for kind in ("mosquitto", "edge-gateway"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"# {kind} ("))
        steps = {k: int(v.replace(",", "")) for k, v in
                 (m.rsplit(" ", 1) for m in line.split("): ", 1)[1].split(", "))}
        assert list(steps) == ["connect 40", "connect 80", "publish 150", "drain 150", "publish 300", "drain 300"]
        for path, n in (("connect", 40), ("publish", 150), ("drain", 150)):
            assert steps[f"{path} {2 * n}"] > steps[f"{path} {n}"] > 0, line
    rows = [x for x in proc.stdout.splitlines() if x.startswith("| a ")]
    assert len(rows) == 3, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        mosquitto, egw = (float(c.replace(",", "")) for c in cells[1:3])
        # the ratio is of the unrounded figures, the cells are rounded to whole instructions
        assert mosquitto > 0 and egw > 0 and abs(float(cells[3].rstrip("x")) - egw / mosquitto) < 0.01, row


def test_durable_commits_reports_the_stores_own_commit_counters() -> None:
    """bench/durable_commits.py publishes durable QoS 1 messages into an offline session with the C publishers and
    reports, from edge-gateway's own /metrics, its group commits and the time spent in LMDB's commit: every message
    acknowledged (it stops with an error otherwise), at least one commit, no more messages a commit than were in
    flight, and a share of the run in the commit between 0 and 1."""
    import durable_commits

    if durable_commits.cloadgen_binary() is None:
        pytest.skip("bench/cloadgen is not built (make cloadgen)")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "durable_commits.py"), "--messages", "2000",
                           "--runs", "1", "--window", "8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("# run 1: "))
    figures = {label: float(value.rstrip("%").replace(",", "")) for label, value in
               (f.rsplit(" ", 1) for f in line.removeprefix("# run 1: ").split(", "))}
    assert figures["acked msgs/s"] > 0 and figures["commits/s"] > 0, line
    assert 1 <= figures["msgs/commit"] <= durable_commits.PUBLISHERS * 8, line
    assert 0 < figures["share of the run in txn.commit"] <= 100 and figures["ms in txn.commit a commit"] > 0, line
    assert len([x for x in proc.stdout.splitlines() if x.startswith("|")]) == 2 + len(durable_commits.COLUMNS)


def test_instructions_per_operation_is_the_difference_of_two_steps() -> None:
    import instructions

    assert instructions.per_operation(1_000_000, 3_000_000, 100, 200) == 20_000.0
    with pytest.raises(ValueError, match="different numbers"):
        instructions.per_operation(1, 2, 100, 100)


def test_ws_fanin_counts_frame_payloads_however_the_stream_is_cut() -> None:
    """bench/ws_fanin.py's subscriber counts deliveries by the payload bytes of the broker's frames: frames of 7-bit,
    16-bit and 64-bit lengths (as wsproto's server side writes them), the stream cut into pieces of 1, 2, 3, 7 and
    1000 bytes and at random."""
    import random

    from ws_fanin import FrameCounter
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, Request

    server, client = WSConnection(ConnectionType.SERVER), WSConnection(ConnectionType.CLIENT)
    server.receive_data(client.send(Request(host="x", target="/mqtt")))
    list(server.events())
    server.send(AcceptConnection())
    sizes = [1, 83, 125, 126, 127, 65535, 65536, 70000, 3]
    stream = b"".join(server.send(BytesMessage(data=bytes(n))) for n in sizes)
    rng = random.Random(1)
    for cut in (1, 2, 3, 7, 1000, None):
        counter, pos = FrameCounter(), 0
        while pos < len(stream):
            step = cut or rng.randint(1, 5000)
            counter.feed(stream[pos : pos + step])
            pos += step
        assert counter.payload == sum(sizes), cut


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_flow_cpu_delivers_every_message_end_to_end(qos: int) -> None:
    """bench/flow_cpu.py (broker CPU per message of a QoS 0, 1 or 2 flow, in process) completes every flow: the
    script itself fails when fewer PUBLISHes went out to the subscriber than were published."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "flow_cpu.py"), "--qos", str(qos), "--messages", "640"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"QoS {qos} end to end: ") and line.endswith(" us of broker CPU per message (in process, "
                                                                         "clients left out)"), line
    assert float(line.split(": ")[1].split(" us")[0]) > 0
