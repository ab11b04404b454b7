"""Provisioning across architectures: an arm64 and an armhf Debian bookworm root, each built by mmdebstrap
``--arch`` from the host's apt mirror and run under qemu-user (binfmt_misc entries registered for this test and
removed after it: tests/cross_arch.py), provisioned by ``ansible/site.yml`` from this amd64 controller through the
chroot connection, twice (the second run changes nothing). Inside each, under qemu-user: the venv's Python is the
target's, its compiled parts are the target's (arm64: the PyPI wheels for aarch64; armhf: Debian's python3-lmdb and
crcmod's pure-Python code, README "Provisioning"), ``edge-gateway --version`` and ``check-config`` of the installed
gateway.toml, and QoS 1 publish/subscribe through the broker on a loopback port with its LMDB store: a message
to an online subscriber and one queued for it while offline, delivered when it comes back.

Slow (mmdebstrap and every Ansible module under qemu-user): ``make test-cross`` (``CROSS_ARCH_TEST=1``); skipped
otherwise. Needs root; the Makefile installs mmdebstrap, arch-test and qemu-user-static (which registers nothing
while binfmt_misc is not mounted). Stage times: README "Provisioning"."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

if not os.environ.get("CROSS_ARCH_TEST"):
    pytest.skip("runs with `make test-cross` (CROSS_ARCH_TEST=1)", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("needs root (mmdebstrap --mode=root, chroot)", allow_module_level=True)

import paho.mqtt.client as mqtt
from cross_arch import ARCHES, CACHE, ROOT, base_tarball, binfmt_registered, extract, in_chroot, log, mounted
from cross_arch import registered_entries as binfmt_entries
from helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
VENV_BIN = Path(sys.executable).parent
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
_LISTEN = re.compile(r"listening on 127\.0\.0\.1:(\d+) \(listener 'cross'")
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def binfmt() -> Iterator[list[str]]:
    """qemu-user for aarch64 and arm registered with binfmt_misc for this module; afterwards none of our entries is
    left and the host's /proc/sys/fs/binfmt_misc is mounted (or not) as before."""
    was_mounted = os.path.ismount("/proc/sys/fs/binfmt_misc")
    with binfmt_registered([cpu for cpu, _ in ARCHES.values()]) as names:
        assert set(names) <= set(binfmt_entries())
        yield names
    assert not set(names) & set(binfmt_entries())
    assert os.path.ismount("/proc/sys/fs/binfmt_misc") == was_mounted
    print("stage times (s):", json.dumps({k: round(v) for k, v in TIMES.items()}), file=sys.stderr)


def _timed(stage: str, started: float) -> None:
    TIMES[stage] = time.monotonic() - started
    log(f"{stage}: {TIMES[stage]:.0f} s")


def _playbook(root: Path, arch: str, work: Path) -> subprocess.CompletedProcess[str]:
    inventory = work / "inventory.yml"
    inventory.write_text(json.dumps({"all": {
        # one wheel directory per board: `make test-cross` may run the two boards at once (pytest -k)
        "vars": {"appliance_wheel_dir": str(CACHE / arch / "wheels")},
        "children": {"gateways": {"hosts": {f"board-{arch}": {
            "ansible_connection": "community.general.chroot", "ansible_host": str(root),
            "gateway_id": f"gw-cross-{arch}",
            # no TLS listener: a test board has no certificate (the loopback listener stays)
            "edge_gateway_external_bind": "",
        }}}},
    }}))  # fmt: skip
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible" / "ansible.cfg"), ANSIBLE_HOME=str(work / "ah"),
               ANSIBLE_LOCAL_TEMP=str(work / "ah" / "tmp"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1")  # fmt: skip
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(ROOT / "ansible" / "site.yml")]
    # /proc and /dev in the root for apt and dpkg, in a private mount namespace: they vanish with the run.
    return subprocess.run(mounted(root, argv), cwd=ROOT / "ansible", env=env, capture_output=True, text=True)


@pytest.fixture(scope="module", params=list(ARCHES))
def board(request: pytest.FixtureRequest, binfmt: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[str, Path]]:  # fmt: skip
    """(Debian architecture, root): a foreign root provisioned by site.yml, twice."""
    arch: str = request.param
    started = time.monotonic()
    tar = base_tarball(arch)
    _timed(f"{arch} base tarball (mmdebstrap, or the cache)", started)
    work = tmp_path_factory.mktemp(f"cross-{arch}")
    root = work / "root"
    started = time.monotonic()
    extract(tar, root)
    _timed(f"{arch} extract", started)
    try:
        built: list[str] = []
        # CROSS_ARCH_ONCE=1: one provisioning run, no idempotence check (half the time, for a quick look)
        for run in (1,) if os.environ.get("CROSS_ARCH_ONCE") else (1, 2):
            started = time.monotonic()
            proc = _playbook(root, arch, work)
            _timed(f"{arch} provisioning run {run}", started)
            (work / f"provision-{run}.log").write_text(proc.stdout + proc.stderr)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
            recap = re.search(rf"^board-{arch}\s+: ok=\d+\s+changed=(\d+)", proc.stdout, re.M)
            assert recap, proc.stdout[-3000:]
            built.append(_wheel_digest(arch))
            if run == 2 and built[0] != built[1]:
                # The working tree changed while run 1 ran (a shared development tree): new code is a real change.
                log(f"{arch}: the edge-gateway wheel changed between the runs; idempotence not checked this time")
            elif run == 2:
                assert recap.group(1) == "0", f"the second run changed something: {_changed_tasks(proc.stdout)}"
        yield arch, root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _changed_tasks(out: str) -> list[str]:
    """The names of the tasks an ansible-playbook output reports as changed."""
    names, task = [], ""
    for line in out.splitlines():
        if line.startswith("TASK ["):
            task = line.split("[", 1)[1].rsplit("]", 1)[0]
        elif line.startswith("changed:"):
            names.append(task)
    return names


def _wheel_digest(arch: str) -> str:
    """sha256 of the edge-gateway wheel site.yml's first play built (the same source gives the same bytes)."""
    (wheel,) = (CACHE / arch / "wheels").glob("edge_gateway-*.whl")
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


def _run(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(in_chroot(root, argv), capture_output=True, text=True, timeout=600)


def test_venv_is_the_targets(board: tuple[str, Path]) -> None:
    """The venv runs the target's Python (under qemu-user) with compiled parts for the target's machine: the PyPI
    wheels on arm64 (lmdb, crcmod's extension, uvloop), Debian's python3-lmdb and crcmod's own pure-Python CRC on
    armhf (PyPI has no armv7l wheels of them), where uvloop is left out."""
    arch, root = board
    machine = ARCHES[arch][1]
    manifest = json.loads((root / "opt/edge-gateway/wheels/target.json").read_text())
    assert (manifest["debian_arch"], manifest["machine"]) == (arch, machine)
    probe = ("import importlib.util, json, platform, lmdb, crcmod.crcmod; print(json.dumps({'machine': "
             "platform.machine(), 'lmdb': lmdb.__file__, 'crc_ext': crcmod.crcmod._usingExtension, "
             "'uvloop': importlib.util.find_spec('uvloop') is not None}))")  # fmt: skip
    proc = _run(root, "/opt/edge-gateway/bin/python", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["machine"] == machine
    if arch == "arm64":
        assert got["lmdb"].startswith("/opt/edge-gateway/lib/python3"), got
        assert (got["crc_ext"], got["uvloop"]) == (True, True), got
        sos = list((root / "opt/edge-gateway/lib").rglob("*.so"))
        assert sos and all(so.read_bytes()[18:20] == b"\xb7\x00" for so in sos), sos  # ELF e_machine: EM_AARCH64
    else:
        assert got["lmdb"].startswith("/usr/lib/python3/dist-packages/lmdb"), got
        assert (got["crc_ext"], got["uvloop"]) == (False, False), got
        # other compiled dependencies PyPI has armv7l wheels of (websockets' speedups) are the target's: 32-bit ARM
        sos = list((root / "opt/edge-gateway/lib").rglob("*.so"))
        assert all(so.read_bytes()[4] == 1 and so.read_bytes()[18:20] == b"\x28\x00" for so in sos), sos  # EM_ARM
        assert manifest["debian_packages"] == ["python3-lmdb"]


def test_version_and_check_config(board: tuple[str, Path]) -> None:
    """`edge-gateway --version` and `check-config` of the gateway.toml the playbook installed, under qemu-user."""
    arch, root = board
    proc = _run(root, "/opt/edge-gateway/bin/edge-gateway", "--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"edge-gateway {VERSION}"), proc.stderr
    proc = _run(root, "/opt/edge-gateway/bin/edge-gateway", "check-config", "/etc/edge-gateway/gateway.toml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("/etc/edge-gateway/gateway.toml: OK"), proc.stdout
    assert f'gateway_id = "gw-cross-{arch}"' in (root / "etc/edge-gateway/gateway.toml").read_text()


def test_qos1_round_trip_through_the_broker(board: tuple[str, Path]) -> None:
    """The broker under qemu-user on 127.0.0.1 (ephemeral port) with its LMDB store in the root; paho-mqtt on the
    host: a persistent subscriber gets a QoS 1 message published while it is online and one published while it is
    away (queued in the store), each once, at QoS 1."""
    arch, root = board
    state = root / "var/tmp/cross-broker"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    (state / "gateway.toml").write_text(
        '[broker]\ngateway_id = "gw-cross"\n[store]\npath = "/var/tmp/cross-broker/store"\n'
        '[listeners.cross]\nbind = "127.0.0.1:0"\n')  # fmt: skip
    broker = subprocess.Popen(in_chroot(root, ["/opt/edge-gateway/bin/edge-gateway", "serve", "--config",
                                               "/var/tmp/cross-broker/gateway.toml"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[str] = []
    assert broker.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in broker.stderr), daemon=True)
    reader.start()
    try:
        port = int(wait_until(lambda: next((m.group(1) for ln in lines if (m := _LISTEN.search(ln))), None),
                              timeout=180, what=lambda: "the broker's listener:\n" + "\n".join(lines)))  # fmt: skip
        wait_until(lambda: any("edge-gateway ready" in ln for ln in lines), timeout=60, what="edge-gateway ready")
        got: list[tuple[str, bytes, int]] = []
        subacked = threading.Event()

        def subscriber() -> mqtt.Client:
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"cross-sub-{arch}", clean_session=False)
            c.on_message = lambda _c, _u, m: got.append((m.topic, m.payload, m.qos))
            c.on_subscribe = lambda *_: subacked.set()
            c.connect("127.0.0.1", port)
            c.loop_start()
            wait_until(c.is_connected, timeout=60, what="the subscriber's CONNACK")
            return c

        sub = subscriber()
        sub.subscribe(f"cross/{arch}/#", qos=1)
        wait_until(subacked.is_set, timeout=60, what="the SUBACK")
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"cross-pub-{arch}")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        wait_until(pub.is_connected, timeout=60, what="the publisher's CONNACK")

        def publish(payload: bytes) -> None:
            info = pub.publish(f"cross/{arch}/reading", payload, qos=1)
            info.wait_for_publish(timeout=60)
            assert info.is_published(), f"no PUBACK for {payload!r}"

        publish(b"online-1")
        wait_until(lambda: got, timeout=60, what="online-1 at the online subscriber")
        sub.disconnect()
        sub.loop_stop()
        publish(b"offline-2")
        sub = subscriber()
        wait_until(lambda: len(got) >= 2, timeout=60, what="offline-2, queued in the store while away")
        sub.disconnect()
        sub.loop_stop()
        pub.disconnect()
        pub.loop_stop()
        time.sleep(1)  # a duplicate would arrive in this time
        assert got == [(f"cross/{arch}/reading", b"online-1", 1), (f"cross/{arch}/reading", b"offline-2", 1)]
    finally:
        if broker.poll() is None:
            broker.send_signal(signal.SIGTERM)
        try:
            code = broker.wait(60)
        except subprocess.TimeoutExpired:
            broker.kill()
            code = broker.wait()
        reader.join(5)
        broker.stderr.close()
    assert code == 0, "\n".join(lines)
    assert (state / "store").exists()
