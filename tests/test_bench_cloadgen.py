"""The C load generator of the benchmarks (bench/cloadgen; docs/benchmarks.md, "The C load generator"), built by
its Makefile rule and run against a real edge-gateway and a real Mosquitto on ephemeral loopback ports.

The idle opener: every connection it reports is one the broker saw (``$SYS/broker/clients/connected``, and
Mosquitto's log of each CONNECT), it holds them until its stdin closes. The subscribers (``cloadgen sub``): with a
real publisher (paho) they count every message once and flag duplicates, late and malformed payloads, retained
ones without RETAIN; they frame a stream cut anywhere. Both refuse any host but 127.0.0.1. Behaviour only, never
speed.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from auth_helpers import MosquittoBroker
from helpers import BrokerProcess, RawClient, wait_until

from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Publish, Suback, Subscribe, Subscription

ROOT = Path(__file__).resolve().parent.parent
CONNECTIONS = 300
CONNECTED_TOPIC = "$SYS/broker/clients/connected"


@pytest.fixture(scope="module")
def cloadgen() -> str:
    """The generator built by `make cloadgen` (what `make bench` builds), as the benchmarks run it."""
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.skip("gcc or make is missing (make compiler installs gcc)")
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "cloadgen"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = ROOT / "bench" / "cloadgen" / "cloadgen"
    assert exe.is_file()
    return str(exe)


@pytest.fixture()
def gateway(tmp_path: Path) -> Iterator[BrokerProcess]:
    proc = BrokerProcess('[broker]\nsys_interval = "1s"\n[listeners.external]\nbind = "127.0.0.1:0"\n',
                         workdir=str(tmp_path)).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def mosquitto(tmp_path: Path) -> Iterator[MosquittoBroker]:
    with MosquittoBroker(tmp_path, "allow_anonymous true\nsys_interval 1") as broker:
        yield broker


class SysWatcher:
    """A client subscribed to ``$SYS/broker/clients/connected``: the broker's own count of connected clients
    (this client included), updated every sys_interval."""

    def __init__(self, port: int) -> None:
        self.client = RawClient(port)
        self.client.connect("cloadgen-sys-watcher")
        self.client.send(Subscribe(1, [Subscription(CONNECTED_TOPIC, 0)]))
        self.granted: list[int] | None = None
        self.value = -1

    def wait_for(self, count: int, timeout: float = 20.0) -> None:
        def seen() -> bool:
            for packet in self.client.recv_all(0.3):
                if isinstance(packet, Suback):
                    self.granted = list(packet.reason_codes)
                elif isinstance(packet, Publish) and packet.topic == CONNECTED_TOPIC:
                    self.value = int(packet.payload)
            return self.granted == [0] and self.value == count

        wait_until(seen, timeout, what=lambda: f"{CONNECTED_TOPIC} == {count} (last seen {self.value})")

    def close(self) -> None:
        self.client.close()


def _start(exe: str, port: int, prefix: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """cloadgen idle with CONNECTIONS connections, at most 32 handshakes at a time; its first report."""
    proc = subprocess.Popen([exe, "idle", "--host", "127.0.0.1", "--port", str(port), "--connections",
                             str(CONNECTIONS), "--concurrency", "32", "--keep-alive", "60", "--username", "bench",
                             "--client-id-prefix", prefix, "--timeout", "60"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"cloadgen gave no report: {proc.communicate()[1]}")
    return proc, json.loads(line)


def _release(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close its stdin: it resets every connection, reports and exits 0."""
    out, err = proc.communicate(input="", timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[0])


def _check_first_report(report: dict[str, Any]) -> None:
    assert (report["connected"], report["failed"], report["timed_out"]) == (CONNECTIONS, 0, 0), report
    assert report["elapsed"] > 0 and report["cpu_s"] >= 0, report
    assert report["first_error"] == ""


def _connect_hold_release(exe: str, port: int, prefix: str, while_held: Callable[[], None] = lambda: None) -> None:
    """cloadgen opens CONNECTIONS connections with ``prefix`` client ids; the broker's own count sees all of them (and
    the watcher); ``while_held`` checks more while they are held; released, every one closed and the broker's count
    back to the watcher alone."""
    watcher = SysWatcher(port)
    proc = None
    try:
        watcher.wait_for(1)
        proc, report = _start(exe, port, prefix)
        _check_first_report(report)
        watcher.wait_for(CONNECTIONS + 1)  # the broker's count: all of them, and the watcher
        while_held()
        assert proc.poll() is None  # held until stdin closes
        assert _release(proc) == {"closed": CONNECTIONS, "dropped": 0}
        watcher.wait_for(1)  # the broker saw them all go
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        watcher.close()


def test_cloadgen_connects_and_holds_every_connection_on_edge_gateway(cloadgen: str, gateway: BrokerProcess) -> None:
    _connect_hold_release(cloadgen, gateway.port, "cl-eg-")


def test_cloadgen_connects_and_holds_every_connection_on_mosquitto(cloadgen: str, mosquitto: MosquittoBroker) -> None:
    def all_logged() -> None:
        # Mosquitto logs every CONNECT it accepted: 3.1.1 (p2), Clean Session 1, Keep Alive 60, the user name
        seen = re.compile(r"New client connected from 127\.0\.0\.1:\d+ as cl-mq-(\d+) \(p2, c1, k60, u'bench'\)")
        ids = {int(m.group(1)) for line in list(mosquitto.lines) if (m := seen.search(line))}
        assert ids == set(range(CONNECTIONS)), mosquitto.log()[-2000:]

    _connect_hold_release(cloadgen, mosquitto.port, "cl-mq-", all_logged)


@pytest.mark.parametrize("host", ["192.0.2.1", "localhost", "::1", "127.0.0.2", "0.0.0.0"])
def test_cloadgen_refuses_any_host_but_loopback(cloadgen: str, host: str) -> None:
    proc = subprocess.run([cloadgen, "idle", "--host", host, "--port", "1883", "--connections", "1"],
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"refusing host {host}: only 127.0.0.1 (loopback) is allowed" in proc.stderr


def test_self_check_runs_the_c_generator_through_the_harness_against_the_c_sink(cloadgen: str) -> None:
    """``loadgen.py --self-check --only connect_c``: bench/run.py's path (the worker checks that the port is its
    harness's child's, starts the program, releases it) against the C sink, which answered every CONNECT."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loadgen.py"), "--self-check", "--json", "--no-pin",
                           "--connections", "200", "--only", "connect_c"],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert set(res) == {"connect_c"}
    r = res["connect_c"]
    assert (r["connected"], r["failed"], r["sink_connacks"]) == (200, 0, 200), r
    assert r["rate"] > 0 and r["generator_cpu"] >= 0


# ---------------------------------------------------------------------------------------------------------------
# cloadgen sub: the fan-out and retained rows' subscribers (bench/cloadgen/sub.c)

PER_PUB = 150  # messages from each of two publisher ids
SUBSCRIBERS = 5


def _payload(pub: int, seq: int) -> bytes:
    """bench/loadgen.py's payload: publisher id, sequence number, send time, padding to 64 bytes."""
    return struct.pack(">HIQ", pub, seq, 0).ljust(64, b".")


def _publish(port: int, messages: list[tuple[str, bytes, bool]]) -> None:
    """paho (MQTT 3.1.1) publishes ``(topic, payload, retain)`` in order at QoS 1 and waits for every PUBACK."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="csub-publisher", protocol=mqtt.MQTTv311)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1, retain=retain) for topic, payload, retain in messages]
        for info in infos:
            info.wait_for_publish(timeout=15)
            assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def _sub(exe: str, port: int, *options: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """cloadgen sub with SUBSCRIBERS subscribers (user name bench); its ready line."""
    proc = subprocess.Popen([exe, "sub", "--host", "127.0.0.1", "--port", str(port), "--subscribers",
                             str(SUBSCRIBERS), "--username", "bench", "--timeout", "30", *options],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(f"cloadgen sub was not ready: {proc.communicate()[1]}")
    return proc, json.loads(line)


def _report(proc: subprocess.Popen[str], *lines: str, subscribers: int = SUBSCRIBERS) -> dict[str, Any]:
    """Writes the control lines, then waits for the report (stdin stays open until it came: its end would stop
    the run); the program exits 0."""
    assert proc.stdin is not None and proc.stdout is not None
    for line in lines:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    out = proc.stdout.readline()
    rest, err = proc.communicate(timeout=15)
    assert proc.returncode == 0 and rest == "", err
    report: dict[str, Any] = json.loads(out)
    assert report["generator"] == "cloadgen" and len(report["subscribers"]) == subscribers
    return report


def _sequence_stream() -> list[tuple[str, bytes, bool]]:
    """Publishers 0 and 1, PER_PUB messages each, interleaved; among them a duplicate (publisher 0, seq 5 again),
    a payload of 10 bytes, a publisher id the subscribers were not told of (7), and one 200 bytes long; publisher 1's
    seq 100 held back to the very end (new, but below what publisher 1 reached: out of order)."""
    msgs = [(f"bench/csub/p{p}", _payload(p, s), False) for s in range(PER_PUB) for p in (0, 1) if (p, s) != (1, 100)]
    msgs.insert(40, ("bench/csub/p0", _payload(0, 5), False))
    msgs.insert(80, ("bench/csub/p0", b"short", False))
    msgs.insert(120, ("bench/csub/p7", _payload(7, 1), False))
    msgs.insert(160, ("bench/csub/p0", _payload(0, 6) + bytes(136), False))
    msgs.append(("bench/csub/p1", _payload(1, 100), False))
    return msgs


@pytest.mark.parametrize("broker", ["edge-gateway", "mosquitto"])
def test_csub_counts_every_message_and_flags_dups_order_and_bad_payloads(cloadgen: str, broker: str,
                                                                         tmp_path: Path) -> None:
    """Five C subscribers on a real broker, a real publisher (paho): each counts every distinct message of both
    publishers exactly once and flags the duplicate, the late one and the three malformed payloads; it stops
    once each has the expected count (the line "expect N" on stdin), DISCONNECTs and exits 0."""
    with _broker(broker, tmp_path) as port:
        proc, ready = _sub(cloadgen, port, "--topic-filter", "bench/csub/#", "--pubs", "2", "--per-pub", "64",
                           "--client-id-prefix", "csub-", "--idle", "5")
        try:
            assert ready == {"ready": SUBSCRIBERS, "subscribers": SUBSCRIBERS}
            msgs = _sequence_stream()
            _publish(port, msgs)
            report = _report(proc, f"expect {2 * PER_PUB}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert report["expect"] == 2 * PER_PUB
    assert [s["client_id"] for s in report["subscribers"]] == [f"csub-{i}" for i in range(SUBSCRIBERS)]
    for s in report["subscribers"]:
        assert (s["received"], s["unique"], s["unique_per_pub"]) == (len(msgs), 2 * PER_PUB, [PER_PUB, PER_PUB]), s
        assert (s["dups"], s["out_of_order"], s["bad"]) == (1, 1, 3), s
        assert (s["not_retained"], s["suback"], s["closed_by_broker"]) == (len(msgs), True, False), s
        assert report["t_connect_ns"] <= s["first_ns"] <= s["last_ns"], s


def test_csub_retained_at_once_checks_retain_and_sequence(cloadgen: str, gateway: BrokerProcess) -> None:
    """--at-once --retained on edge-gateway: the subscribers connect, then on "go" each sends CONNECT and
    SUBSCRIBE `#` in one write; each gets every retained message once with RETAIN set; a retained copy of seq 5
    on another topic is a duplicate and a payload of 3 bytes is bad. --expect is one more than there are, so it
    is never reached, and --expect alone does not stop for want of data (a slow broker is waited for): the run
    ends at its --timeout, long after --idle."""
    n = 200
    _publish(gateway.port, [(f"bench/ret/{i}", _payload(0, i), True) for i in range(n)]
             + [("bench/ret/copy", _payload(0, 5), True), ("bench/ret/short", b"abc", True)])
    proc, ready = _sub(cloadgen, gateway.port, "--topic-filter", "#", "--at-once", "--retained", "--expect",
                       str(n + 1), "--client-id-prefix", "cret-", "--idle", "0.2", "--timeout", "3")
    try:
        assert ready == {"ready": SUBSCRIBERS, "subscribers": SUBSCRIBERS}
        report = _report(proc, "go")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for s in report["subscribers"]:
        assert (s["received"], s["unique"], s["dups"], s["bad"], s["not_retained"]) == (n + 2, n, 1, 1, 0), s
        assert (s["suback"], s["closed_by_broker"], s["out_of_order"]) == (True, False, 0), s
    assert report["t_connect_ns"] <= report["t_start_ns"] <= min(s["first_ns"] for s in report["subscribers"])
    assert report["elapsed"] >= 2.5  # the deadline ended it, not --idle


def test_csub_through_the_harness_finds_the_sinks_injected_faults(cloadgen: str) -> None:
    """``loadgen.py --self-check --faults --only subscribe_qos0_c,subscribe_fanout_c``: bench/run.py's path
    (run_subscribers_c in a worker, the control lines, merge_subscribers) against the sink's stream, which drops
    publisher 0's seq 10, sends seq 20 twice and seq 31 before 30 in the one-subscriber check."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loadgen.py"), "--self-check", "--json", "--no-pin",
                           "--seconds", "0.3", "--faults", "--only", "subscribe_qos0_c,subscribe_fanout_c"],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    r = res["subscribe_qos0_c"]
    assert r["subscribers"] == 1 and r["received"] == r["expected_each"] + 1, r
    assert (r["unique"], r["lost"], r["dups"], r["out_of_order"], r["bad"]) == (r["expected_each"], 1, 1, 1, 0), r
    f = res["subscribe_fanout_c"]
    assert f["subscribers"] == 50 and f["received"] == f["unique"] == 50 * f["expected_each"], f
    assert (f["lost"], f["dups"], f["out_of_order"], f["bad"]) == (0, 0, 0, 0), f
    assert r["generator_cpu"] >= 0 and f["generator_cpu"] >= 0


def test_csub_frames_packets_cut_anywhere(cloadgen: str) -> None:
    """A scripted server on 127.0.0.1 writes the PUBLISH stream in pieces of 1 to 7 bytes (so packets and their
    Remaining Length are cut between reads) with a 5,000-byte PUBLISH in the middle (longer than what is carried
    over between reads: dropped, counted bad): every other message is counted once. One more is expected than
    is sent: the run ends --idle seconds after the last data, the line "expect N" having said the publishers are
    done."""
    rng = random.Random(7)
    packets = [Publish(f"bench/cut/{'x' * (i % 150)}", _payload(0, i), 0).encode(4) for i in range(120)]
    packets.insert(60, Publish("bench/cut/long", bytes(5000), 0).encode(4))
    stream = b"".join(packets)
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        proc = subprocess.Popen([cloadgen, "sub", "--port", str(ls.getsockname()[1]), "--subscribers", "1",
                                 "--topic-filter", "bench/cut/#", "--idle", "1", "--timeout", "30"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = ls.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(10)
                assert conn.recv(1024)[:1] == b"\x10"  # CONNECT
                conn.sendall(b"\x20\x02\x00\x00")
                assert conn.recv(1024)[:1] == b"\x82"  # SUBSCRIBE, Packet Identifier 1
                conn.sendall(b"\x90\x03\x00\x01\x00")
                assert proc.stdout is not None and json.loads(proc.stdout.readline())["ready"] == 1
                pos = 0
                while pos < len(stream):
                    step = rng.randint(1, 7) if pos < len(stream) // 2 else rng.randint(1, 700)
                    conn.sendall(stream[pos:pos + step])
                    pos += step
                    time.sleep(0.0003)
                report = _report(proc, "expect 121", subscribers=1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    s = report["subscribers"][0]
    assert (s["received"], s["unique"], s["dups"], s["out_of_order"], s["bad"]) == (121, 120, 0, 0, 1), s


@pytest.mark.parametrize("host", ["192.0.2.1", "localhost", "::1"])
def test_csub_refuses_any_host_but_loopback(cloadgen: str, host: str) -> None:
    proc = subprocess.run([cloadgen, "sub", "--host", host, "--port", "1883", "--subscribers", "1",
                           "--topic-filter", "#"], capture_output=True, text=True, timeout=10)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert f"refusing host {host}: only 127.0.0.1 (loopback) is allowed" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# cloadgen pub and the acknowledging subscriber: the QoS 1 and QoS 2 rows' clients (bench/cloadgen/pub.c, sub.c)


def _bits(hex_bits: str) -> list[int]:
    """The sequence numbers set in a C generator's bit-packed bitmap (bit s & 7 of byte s >> 3)."""
    data = bytes.fromhex(hex_bits)
    return [i for i in range(len(data) * 8) if data[i >> 3] >> (i & 7) & 1]


@pytest.mark.parametrize("qos", [1, 2])
@pytest.mark.parametrize("broker", ["edge-gateway", "mosquitto"])
def test_cpub_and_csub_count_every_acknowledged_message_once(cloadgen: str, broker: str, qos: int,
                                                              tmp_path: Path) -> None:
    """Two C publishers (8 in flight each, 0.5 s) and one C subscriber at QoS 1 or 2 on a real broker: every message
    a publisher saw acknowledged (PUBACK, or PUBCOMP after its PUBREC and PUBREL) reached the subscriber exactly once
    and in order, which acknowledged each (else the broker's window would stall the run); the bitmaps, the
    latencies and the counts agree."""
    # Mosquitto drops what is queued past max_queued_messages (1000 by default) for a subscriber slower than the
    # publishers: the benchmarks set it as here
    with _broker(broker, tmp_path, "max_queued_messages 1000000\n") as port:
        sub = subprocess.Popen([cloadgen, "sub", "--port", str(port), "--subscribers", "1", "--topic-filter",
                                "bench/cq/#", "--qos", str(qos), "--pubs", "2", "--per-pub", "64", "--latency",
                                "--bitmaps", "--idle", "5", "--timeout", "30"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pub = subprocess.Popen([cloadgen, "pub", "--port", str(port), "--publishers", "2", "--topic-prefix",
                                "bench/cq/p", "--qos", str(qos), "--window", "8", "--duration", "0.5",
                                "--client-id-prefix", "cpub-", "--timeout", "30"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert sub.stdout is not None and json.loads(sub.stdout.readline())["ready"] == 1, sub.stderr
            assert pub.stdout is not None and json.loads(pub.stdout.readline()) == {"ready": 2}
            out, err = pub.communicate(input="go\n", timeout=30)
            assert pub.returncode == 0, err
            pubs = json.loads(out)["publishers"]
            total = sum(p["sent"] for p in pubs)
            report = _report(sub, f"expect {total}", subscribers=1)
        finally:
            for proc in (sub, pub):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert [p["pub"] for p in pubs] == [0, 1]
    for p in pubs:
        assert p["error"] is None and p["sent"] > 8 and p["acked"] == p["sent"], p
        assert _bits(p["acked_bitmap"]) == list(range(p["sent"]))
        assert report["t_connect_ns"] < p["t_start_ns"] <= p["t_end_ns"]
    s = report["subscribers"][0]
    assert (s["received"], s["unique"], s["dups"], s["out_of_order"], s["bad"]) == (total, total, 0, 0, 0), s
    assert s["unique_per_pub"] == [p["sent"] for p in pubs]
    assert [_bits(b) for b in s["bitmaps"]] == [list(range(p["sent"])) for p in pubs]
    assert len(s["latency_ns"]) == total and all(0 <= x < 30e9 for x in s["latency_ns"])
    assert s["suback"] is True and s["closed_by_broker"] is False


def test_csub_answers_qos1_qos2_and_pubrel_and_counts_dup_flags(cloadgen: str) -> None:
    """A scripted server delivers QoS 1 and QoS 2 PUBLISHes (one with DUP set, re-sending a message already
    delivered) and a PUBREL: the subscriber answers PUBACK, PUBREC and PUBCOMP with their Packet Identifiers, in
    one write per read, and counts the DUP flag and the duplicate."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        proc = subprocess.Popen([cloadgen, "sub", "--port", str(ls.getsockname()[1]), "--subscribers", "1",
                                 "--topic-filter", "bench/acks/#", "--qos", "2", "--idle", "0.5", "--timeout", "30"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = ls.accept()
            with conn:
                conn.settimeout(10)
                assert conn.recv(1024)[:1] == b"\x10"  # CONNECT
                conn.sendall(b"\x20\x02\x00\x00")
                assert conn.recv(1024)[-1:] == b"\x02"  # SUBSCRIBE at Requested QoS 2
                conn.sendall(b"\x90\x03\x00\x01\x02")
                assert proc.stdout is not None and json.loads(proc.stdout.readline())["ready"] == 1
                first = Publish("bench/acks/a", _payload(0, 0), 1, packet_id=0x0102).encode(4)
                second = Publish("bench/acks/a", _payload(0, 1), 2, packet_id=0x0304).encode(4)
                again = Publish("bench/acks/a", _payload(0, 1), 2, packet_id=0x0304, dup=True).encode(4)
                conn.sendall(first + second + again + b"\x62\x02\x03\x04")  # ... and PUBREL 0x0304
                want = b"\x40\x02\x01\x02" + b"\x50\x02\x03\x04" * 2 + b"\x70\x02\x03\x04"
                got = b""
                while len(got) < len(want):
                    got += conn.recv(1024)
                assert got == want
                report = _report(proc, "expect 3", subscribers=1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    s = report["subscribers"][0]
    assert (s["received"], s["unique"], s["dups"], s["dup_flag"], s["bad"]) == (3, 2, 1, 1, 0), s


def test_cpub_answers_pubrec_with_pubrel_and_reports_a_broker_that_closes(cloadgen: str) -> None:
    """A scripted server answers the first QoS 2 PUBLISH of the window with PUBREC and then PUBCOMP, then closes:
    the publisher sent PUBREL for the PUBREC, counts that one message acknowledged and reports the close."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        proc = subprocess.Popen([cloadgen, "pub", "--port", str(ls.getsockname()[1]), "--publishers", "1",
                                 "--topic-prefix", "bench/rel/p", "--qos", "2", "--window", "4", "--duration", "5",
                                 "--timeout", "30"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = ls.accept()
            with conn:
                conn.settimeout(10)
                assert conn.recv(1024)[:1] == b"\x10"
                conn.sendall(b"\x20\x02\x00\x00")
                assert proc.stdout is not None and json.loads(proc.stdout.readline()) == {"ready": 1}
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                reader = PacketReader(version=4)
                publishes: list[Publish] = []
                while len(publishes) < 4:
                    publishes += [p for p in reader.feed(conn.recv(4096)) if isinstance(p, Publish)]
                assert [p.packet_id for p in publishes] == [1, 2, 3, 4] and {p.qos for p in publishes} == {2}
                assert [struct.unpack(">HI", p.payload[:6]) for p in publishes] == [(0, s) for s in range(4)]
                conn.sendall(b"\x50\x02\x00\x01")  # PUBREC 1
                assert conn.recv(4) == b"\x62\x02\x00\x01"  # PUBREL 1 (fixed header flags 0010)
                conn.sendall(b"\x70\x02\x00\x01")  # PUBCOMP 1: the window has room for message 4
                fifth = b""
                while not fifth.startswith(b"\x34"):
                    fifth = conn.recv(4096)
            out, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    (p,) = json.loads(out)["publishers"]
    assert (p["sent"], p["acked"], p["error"]) == (5, 1, "connection closed by the broker"), p
    assert _bits(p["acked_bitmap"]) == [0]


@pytest.mark.parametrize("mode", ["sub", "pub"])
def test_cloadgen_acknowledging_modes_refuse_a_qos_they_do_not_speak(cloadgen: str, mode: str) -> None:
    options = ["--subscribers", "1", "--topic-filter", "#", "--qos", "3"] if mode == "sub" else [
        "--publishers", "1", "--topic-prefix", "t", "--qos", "0"]
    proc = subprocess.run([cloadgen, mode, "--port", "1883", *options], capture_output=True, text=True, timeout=10)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "qos" in proc.stderr


def test_bench_acknowledged_rows_run_on_the_c_clients(tmp_path: Path) -> None:
    """``bench/run.py --quick --only qos1,qos2,offline --ack-generator c``: the harness's own path (its
    edge-gateway, the C subscriber and publishers in its workers, their reports merged and checked for losses and
    duplicates) fills the QoS rows with every completed message delivered once, and the offline row's C publishers
    stop at their fixed backlog, every message of which the drain delivers."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing (make compiler installs gcc)")
    out = tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--only", "qos1,qos2,offline",
                           "--brokers", "edge-gateway", "--no-selfcheck", "--ack-generator", "c", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "QoS 1, QoS 2 and offline publishers' clients: C (bench/cloadgen sub, pub)" in text
    for row in ("qos1", "qos2"):
        line = next(x for x in text.splitlines() if x.startswith(f"run 1 {row} edge-gateway:"))
        checks = re.search(r"\{'sent': (\d+), '(?:acked|completed)': (\d+), .*'dups': (\d+)", line)
        assert checks, line
        sent, acked, dups = map(int, checks.groups())
        assert sent > 0 and acked == sent and dups == 0, line
        assert re.search(r": rate=[1-9]", line) and "lost=0.00" in line, line
    qos2 = next(x for x in text.splitlines() if x.startswith("run 1 qos2 edge-gateway:"))
    assert re.search(r"'completed': (\d+), 'delivered': \1,", qos2) and "'dup_flag': 0" in qos2, qos2
    offline = next(x for x in text.splitlines() if x.startswith("run 1 offline edge-gateway:"))
    assert "{'acked': 20000, 'delivered': 20000, 'dups': 0, 'session_present': True" in offline, offline
    assert "lost=0.00, ooo=0.00" in offline, offline


@contextlib.contextmanager
def _broker(kind: str, tmp_path: Path, mosquitto_conf: str = "") -> Iterator[int]:
    """A real edge-gateway or Mosquitto (with ``mosquitto_conf`` added to its configuration) on an ephemeral
    loopback port; yields the port."""
    if kind == "mosquitto":
        with MosquittoBroker(tmp_path, "allow_anonymous true\n" + mosquitto_conf) as mosq:
            yield mosq.port
        return
    proc = BrokerProcess('[listeners.external]\nbind = "127.0.0.1:0"\n', workdir=str(tmp_path)).start()
    try:
        yield proc.port
    finally:
        assert proc.stop() == 0, proc.log()
