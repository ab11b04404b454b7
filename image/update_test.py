#!/usr/bin/env python3
"""Update the gateway image in the field, under qemu, through its real boot loader (`make image-update-test
[ARCH=arm64]`).

The image boots as a board does, its boot loader choosing the root slot by RAUC's boot counting: amd64 OVMF, then
GRUB from its EFI system partition (image/rauc/grub.cfg); arm64 U-Boot (qemu_arm64 from u-boot-qemu as the virt
board's firmware), then the boot script on its boot partition (image/rauc/boot.cmd). RAUC installs signed bundles
from a "USB stick" (a second disk, labelled EG-STICK); edge-gateway-health.service commits a new slot or rolls it
back. The probe (image/probe/probe.sh, in its served mode) takes commands over the broker itself (probe/command,
through qemu's hostfwd on this host's 127.0.0.1 only) and reports on the serial console. A qemu run ends at a
poweroff or a power cut (SIGKILL); when the guest reboots, qemu is started again on the same disk, ports and serial
log, as a board's reset does (ansible's reboot waits for the same machine), and the boot loader's state on the boot
partition (grubenv, boot-state.env) carries the A/B choice over them. On arm64 (TCG, about 3 times slower) every
time limit is 3 times longer (vm_test.py's ARM64_SCALE).

0. The disk is 2 GiB larger than the image, as a card is: the first boot grows the data partition into it. Per-board
   settings: before the first boot a valid ``edge-gateway-settings.toml`` (a gateway id, a message expiry longer than
   the test, an operator's SSH key) is put on the boot partition; the first boot applies it and removes it; the
   operator logs in with the key over SSH (through a second hostfwd) and is refused a password login.
1. v1 (slot A): a persistent session's QoS 1 messages are acknowledged. ansible/update.yml pushes v2 (as an
   operator's laptop does, over SSH with that key): room checked, bundle copied, ``rauc install``, reboot, wait for
   the health check; v2 boots from slot B, is marked good and reports ``updated`` (v1 -> v2); every acknowledged
   message is delivered. Power off; a broken settings file on the boot partition.
2. v2 again: the broken settings are renamed ``.rejected`` with their errors beside them, and the gateway keeps the
   settings it had. Refused from the "USB stick", with nothing changed: a bundle signed by another key, one for
   another architecture, a truncated one. More messages.
3. ansible/update.yml pushes v3, whose broker cannot start, to a rollout of two gateways one at a time: v3 is
   installed and booted, the health check marks it bad and reboots, the boot loader falls back to slot B, v2 reports
   ``rolled_back`` (v3 -> v2); the playbook fails that gateway and never touches the second one; nothing
   acknowledged is lost.
4. A power cut (SIGKILL of qemu) in the middle of ``rauc install`` from the stick: the next boot is slot B, v2,
   healthy, nothing lost.

v2 and v3 are the image's own root with a changed /etc/edge-gateway-release (and, for v3, no broker program),
edited with debugfs on a copy, and signed by image/rauc/bundle.sh with the image's key. Exit status 0 when every
step held; each step's time is printed.

Usage: update_test.py [--arch amd64|arm64] [--out build/appliance] [--keep-disk]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
from vm_test import ROOT, Vm, arch_config, connect, free_port, log

TOPIC = "update"
#: bytes the test's disk is larger than the image: the card the data partition grows into at the first boot
GROW = 2 << 30


class Session:
    """The persistent session (clean_session=0) subscribed to update/#, and a publisher: what was acknowledged
    before and during the updates must all be delivered after them."""

    def __init__(self, scale: int = 1) -> None:
        #: time limits are multiplied by it (the slower emulation of arm64)
        self.scale = scale
        self.acked: set[int] = set()
        self.delivered: Counter[int] = Counter()
        self.seq = 0
        self.lock = threading.Lock()

    def subscribe(self, port: int) -> None:
        client = connect(port, "update-sub", clean=False, seconds=120 * self.scale)
        done = threading.Event()
        client.on_subscribe = lambda *a: done.set()
        client.subscribe(f"{TOPIC}/#", qos=1)
        if not done.wait(60 * self.scale):
            raise RuntimeError("no SUBACK for update/#")
        client.disconnect()
        client.loop_stop()

    def publish(self, port: int, n: int) -> None:
        """``n`` numbered QoS 1 messages, each waited for until acknowledged."""
        client = connect(port, "update-pub", clean=True, seconds=120 * self.scale)
        try:
            infos = []
            for _ in range(n):
                self.seq += 1
                infos.append((self.seq, client.publish(f"{TOPIC}/t", str(self.seq), qos=1)))
            for seq, info in infos:
                info.wait_for_publish(60 * self.scale)
                if info.is_published():
                    self.acked.add(seq)
        finally:
            client.disconnect()
            client.loop_stop()

    def drain(self, port: int, seconds: float = 120) -> list[int]:
        """Reconnect the session and collect until every acknowledged message is there; the missing ones."""

        def on_message(c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
            with self.lock:
                self.delivered[int(msg.payload)] += 1

        client = connect(port, "update-sub", clean=False, seconds=120 * self.scale, on_message=on_message)
        end = time.monotonic() + seconds * self.scale
        while time.monotonic() < end:
            with self.lock:
                if not self.acked - self.delivered.keys():
                    break
            time.sleep(0.2)
        time.sleep(1)
        client.disconnect()
        client.loop_stop()
        with self.lock:
            return sorted(self.acked - self.delivered.keys())


def command(vm: Vm, text: str) -> None:
    """One command to the probe (QoS 1 on probe/command through the forwarded port)."""
    client = connect(vm.port, "update-test-cmd", clean=True, seconds=60 * vm.arch.scale)
    try:
        client.publish("probe/command", text, qos=1).wait_for_publish(30)
    finally:
        client.disconnect()
        client.loop_stop()


def ask(vm: Vm, text: str, answer: str, seconds: float) -> str:
    """Send ``text`` and wait for the probe line starting with ``answer``; ``slot`` is repeated until the probe's
    subscription is there (it is idempotent), other commands are sent once after that. ``seconds`` is multiplied by
    the machine's time scale."""
    seconds *= vm.arch.scale
    if text == "slot":
        end = time.monotonic() + seconds
        while True:
            command(vm, text)
            try:
                return vm.wait_for(answer, 5)
            except RuntimeError:
                if time.monotonic() > end:
                    raise
    command(vm, text)
    return vm.wait_for(answer, seconds)


def debugfs(image: Path, *requests: str) -> None:
    """Edit an ext4 image without mounting it."""
    for request in requests:
        proc = subprocess.run(["debugfs", "-w", "-R", request, str(image)], capture_output=True, text=True)
        if proc.returncode != 0 or "rror" in proc.stderr:
            raise RuntimeError(f"debugfs {request!r} on {image}: {proc.stderr.strip()}")


def make_root(base: Path, dest: Path, version: str, broken: bool, arch: str) -> None:
    """A copy of the image's root with VERSION=``version`` (and without the broker program when ``broken``)."""
    subprocess.run(["cp", "--sparse=always", str(base), str(dest)], check=True)
    release = dest.with_suffix(".release")
    release.write_text(f"VERSION={version}\nARCH={arch}\n")
    debugfs(dest, "rm /etc/edge-gateway-release", f"write {release} /etc/edge-gateway-release")
    if broken:
        debugfs(dest, "rm /opt/edge-gateway/bin/edge-gateway")


def bundle(out: Path, root: Path, version: str, dest: Path, compatible: str,
           env: dict[str, str] | None = None) -> None:
    subprocess.run([str(ROOT / "image" / "rauc" / "bundle.sh"), "--root", str(root), "--version", version,
                    "--compatible", compatible, "--out", str(dest)], check=True, env={**os.environ, **(env or {}),
                                                                                      "IMAGE_OUT": str(out)},
                   stdout=subprocess.DEVNULL)


def make_stick(out: Path, work: Path, v1: str, arch: str) -> tuple[Path, dict[str, str]]:
    """The bundles on a stick image; their versions by file name. ``other.raucb`` is for the other architecture."""
    stick_dir = work / "stick"
    shutil.rmtree(stick_dir, ignore_errors=True)
    stick_dir.mkdir(parents=True)
    base = out / f"edge-gateway-{arch}-root.ext4"
    compatible = f"edge-gateway-{arch}"
    versions = {"v2.raucb": f"{v1}+v2", "v3.raucb": f"{v1}+v3-broken"}
    for name, broken in (("v2.raucb", False), ("v3.raucb", True)):
        root = work / f"{name}.ext4"
        make_root(base, root, versions[name], broken, arch)
        bundle(out, root, versions[name], stick_dir / name, compatible)
        root.unlink()
    # The refusals need no real root: a small file system, signed with another key or for another architecture.
    small = work / "small.ext4"
    (work / "small").mkdir(exist_ok=True)
    (work / "small" / "noise").write_bytes(os.urandom(64 * 1024))  # RAUC wants a squashfs of more than one block
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(work / "small"), str(small), "8M"], check=True)
    other = work / "other-key"
    other.mkdir(exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "30", "-subj", "/O=not the fleet's key", "-keyout", str(other / "key.pem"),
                    "-out", str(other / "cert.pem")], check=True, capture_output=True)
    bundle(out, small, "9.9.9", stick_dir / "other-key.raucb", compatible,
           env={"IMAGE_SIGNING_CERT": str(other / "cert.pem"), "IMAGE_SIGNING_KEY": str(other / "key.pem")})
    other_arch = "amd64" if arch == "arm64" else "arm64"
    bundle(out, small, "9.9.9", stick_dir / "other.raucb", f"edge-gateway-{other_arch}")
    full = (stick_dir / "v2.raucb").read_bytes()
    (stick_dir / "truncated.raucb").write_bytes(full[: len(full) // 2])
    for name in ("v2.raucb", "v3.raucb"):  # the playbook's copies, named as `make bundle` names them
        shutil.copyfile(stick_dir / name, work / f"edge-gateway-{versions[name]}-{arch}.raucb")
    stick = work / "stick.img"
    size = sum(f.stat().st_size for f in stick_dir.iterdir()) // (1 << 20) + 64
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "EG-STICK", "-d", str(stick_dir), str(stick), f"{size}M"],
                   check=True)
    shutil.rmtree(stick_dir)
    return stick, versions


def put_on_boot_partition(disk: Path, name: str, text: str) -> None:
    """Write a file at the root of the image's boot partition (partition 1, FAT) with mtools, as an operator's
    laptop does on the card."""
    table = json.loads(subprocess.run(["sfdisk", "--json", str(disk)], capture_output=True, text=True,
                                      check=True).stdout)["partitiontable"]
    offset = int(table["partitions"][0]["start"]) * int(table.get("sectorsize", 512))
    local = disk.with_name(name)
    local.write_text(text)
    subprocess.run(["mcopy", "-o", "-i", f"{disk}@@{offset}", str(local), f"::/{name}"], check=True)
    local.unlink()


def ssh(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    """OpenSSH's client to the guest through the forwarded port (a new host key each image: not remembered)."""
    options = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "ConnectTimeout=20"]
    return subprocess.run(["ssh", "-p", str(port), *options, *args], capture_output=True, text=True, timeout=120)


def playbook(work: Path, ssh_port: int, key: Path, bundle: Path, more_hosts: tuple[str, ...], scale: int = 1) -> \
        subprocess.CompletedProcess[str]:
    """ansible/update.yml from this host, as an operator's laptop runs it: the VM as gateway gw-field-07 (over the
    forwarded SSH port, the operator account and its key), then ``more_hosts``, one gateway a batch. A further host
    is 127.0.0.1 on a port nobody listens on: a rollout that reached it would fail there as unreachable. ``scale``
    multiplies the playbook's wait for a reboot (``update_boot_timeout``, 1500 s) as it does the test's limits."""
    hosts: dict[str, dict[str, object]] = {"gw-field-07": {"ansible_host": "127.0.0.1", "ansible_port": ssh_port}}
    for name in more_hosts:
        hosts[name] = {"ansible_host": "127.0.0.1", "ansible_port": free_port()}
    inventory = work / "inventory.yml"  # (JSON is YAML)
    inventory.write_text(json.dumps({"all": {"children": {"gateways": {"hosts": hosts, "vars": {
        "ansible_user": "operator", "ansible_ssh_private_key_file": str(key),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}}}}}))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible" / "ansible.cfg"),
           "ANSIBLE_HOME": str(work / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp"),
           "ANSIBLE_NOCOLOR": "1"}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
            str(ROOT / "ansible" / "update.yml"), "-e", f"update_bundle={bundle}", "-e", "update_batch=1",
            "-e", f"update_boot_timeout={1500 * scale}"]
    log(f"ansible-playbook update.yml, bundle {bundle.name}, gateways {', '.join(hosts)}")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=5400 * scale)
    for line in proc.stdout.splitlines():
        if line.startswith(("TASK", "PLAY", "fatal", "failed", "gw-")) or line.lstrip().startswith("msg:") \
                or "changed:" in line[:12]:
            print(f"  ansible: {line}", flush=True)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=os.environ.get("IMAGE_ARCH", "amd64"), help="amd64 or arm64")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("IMAGE_OUT", ROOT / "build" / "appliance")))
    parser.add_argument("--boot-timeout", type=float, default=0.0, help="hard limit of one qemu run, seconds "
                        "(default 1800, times 3 for arm64: a served boot waits for the health check, an install "
                        "writes 2 GiB under TCG)")
    parser.add_argument("--keep-disk", action="store_true")
    args = parser.parse_args()
    out: Path = args.out
    arch = arch_config(args.arch, "", out)
    args.boot_timeout = args.boot_timeout or 1800.0 * arch.scale
    for tool in (arch.qemu[0], "rauc", "mksquashfs", "debugfs", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise SystemExit(f"image-update-test: {tool} is missing: make image-deps")
    if not Path(arch.disk).is_file():
        raise SystemExit(f"image-update-test: {arch.disk} is missing: make image ARCH={args.arch}")
    v1 = (out / f"edge-gateway-{args.arch}.version").read_text().strip()
    work = out / "update-test"
    work.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    times: list[tuple[str, float]] = []
    t0 = time.monotonic()
    stick, versions = make_stick(out, work, v1, args.arch)
    times.append(("bundles and stick", time.monotonic() - t0))
    disk = work / "disk.img"
    subprocess.run(["cp", "--sparse=always", arch.disk, str(disk)], check=True)
    # a card larger than the image: the first boot grows the data partition into the rest
    image_bytes = disk.stat().st_size
    os.truncate(disk, image_bytes + GROW)
    Path(str(disk) + ".efivars").unlink(missing_ok=True)
    session = Session(arch.scale)
    served = "edge_gateway.probe=1 edge_gateway.powercut=again"
    if arch.scale != 1:  # the probe's own time limits, as vm_test.py passes them
        served += f" edge_gateway.probe_scale={arch.scale}"
    key = work / "operator_ed25519"
    key.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "operator@update-test", "-f", str(key)],
                   check=True)
    # message_expiry_interval: the broker's default (5 min) drops a message that waits longer for its offline
    # subscriber, and an update that rolls back takes longer than that under TCG; the session here must keep them.
    put_on_boot_partition(disk, "edge-gateway-settings.toml",
                          f'gateway_id = "gw-field-07"\n\n'
                          f'[gateway.listeners.internal]\nmessage_expiry_interval = "2h"\n\n'
                          f'[access]\nssh_authorized_keys = ["{key.with_suffix(".pub").read_text().strip()}"]\n')
    vm: Vm | None = None
    boot_n = 0

    def boot(params: str, port: bool = True, reboot: bool = False) -> Vm:
        """One qemu run; ``reboot``: qemu starts again after each guest reboot (a playbook waits for the same
        machine)."""
        nonlocal boot_n
        boot_n += 1
        serial = work / f"serial-boot{boot_n}.log"
        machine = Vm(arch, disk, serial, serial.with_suffix(".trace"), params,
                     args.boot_timeout * (3 if reboot else 1), free_port() if port else 0, drives=[stick],
                     ssh_port=free_port() if port else 0, reboot=reboot)
        machine.start()
        return machine

    def push(vm: Vm, name: str, *more_hosts: str) -> subprocess.CompletedProcess[str]:
        """ansible/update.yml with the bundle ``name`` to the VM (and ``more_hosts``, later in the rollout)."""
        return playbook(work, vm.ssh_port, key, work / f"edge-gateway-{versions[name]}-{args.arch}.raucb",
                        more_hosts, arch.scale)

    def expect(line: str, *parts: str) -> None:
        for part in parts:
            if part not in line:
                failures.append(f"expected {part!r} in {line!r}")

    def step(name: str, start: float) -> None:
        times.append((name, time.monotonic() - start))
        log(f"step {name}: {times[-1][1]:.0f} s")

    try:
        # 1. v1 on slot A: messages; pushed to v2 by ansible/update.yml (copy, install, reboot, wait for good)
        start = time.monotonic()
        vm = boot(served, reboot=True)
        vm.wait_for("SERVING", args.boot_timeout)
        grown = re.search(r"edge-gateway-grow-data: /var/lib/edge-gateway now has (\S+)",
                          vm.serial.read_text(errors="replace"))
        if grown is None:
            failures.append("the data partition did not grow into the larger disk at the first boot")
        log(f"data partition grown at the first boot: {grown.group(1) if grown else 'no'}")
        session.subscribe(vm.port)
        session.publish(vm.port, 50)
        expect(ask(vm, "slot", "SLOT", 120), "booted=A", f"version={v1}")
        expect(ask(vm, "settings", "SETTINGS", 60), "gateway_id=gw-field-07", "boot=[]", "unit=success",
               "ssh=active")
        login = ssh(vm.ssh_port, "-i", str(key), "operator@127.0.0.1", "cat /etc/edge-gateway-release")
        if login.returncode != 0 or f"VERSION={v1}" not in login.stdout:
            failures.append(f"ssh with the operator's key: {login.returncode} {login.stdout!r} {login.stderr[-300:]!r}")
        refused = ssh(vm.ssh_port, "-o", "PubkeyAuthentication=no", "-o", "PreferredAuthentications=password",
                      "operator@127.0.0.1", "true")
        if refused.returncode == 0 or "Permission denied" not in refused.stderr:
            failures.append(f"a password login was not refused: {refused.returncode} {refused.stderr[-300:]!r}")
        log(f"settings applied: gateway_id gw-field-07, operator SSH with the key: {login.returncode == 0}, "
            f"password refused: {refused.returncode != 0}")
        session.publish(vm.port, 50)
        step("v1: settings applied, 100 messages", start)
        start = time.monotonic()
        pushed = push(vm, "v2.raucb")
        if pushed.returncode != 0 or "ok=" not in pushed.stdout or "failed=0" not in pushed.stdout:
            failures.append(f"ansible/update.yml to v2 failed ({pushed.returncode}): {pushed.stdout[-1500:]}")
        vm.wait_for("SERVING", args.boot_timeout)  # the probe of the boot the playbook's reboot started
        expect(ask(vm, "slot", "SLOT", 120), "booted=B", f"version={versions['v2.raucb']}", "primary=B")
        expect(ask(vm, "health", "HEALTH", 900), "OUTCOME=updated", f"VERSION={versions['v2.raucb']}",
               f"PREVIOUS={v1}")
        lost = session.drain(vm.port)
        if lost:
            failures.append(f"after the update to v2: {len(lost)} acknowledged messages lost: {lost[:20]}")
        log(f"v2: {len(session.acked)} acknowledged before the update, all delivered: {not lost}")
        command(vm, "poweroff")
        vm.wait_exit(300 * arch.scale)
        put_on_boot_partition(disk, "edge-gateway-settings.toml",
                              'gateway_id = "gw/broken"\n[gateway.broker]\nmax_sessions = "lots"\n')
        step("push v1 -> v2 (ansible/update.yml)", start)

        # 2. v2 on slot B with a broken settings file; refusals; a rollout of v3 that stops at its first batch
        start = time.monotonic()
        vm = boot(served, reboot=True)
        vm.wait_for("SERVING", args.boot_timeout)
        expect(ask(vm, "slot", "SLOT", 120), "booted=B", f"version={versions['v2.raucb']}")
        expect(ask(vm, "settings", "SETTINGS", 60), "gateway_id=gw-field-07",
               "boot=[edge-gateway-settings.errors.txt edge-gateway-settings.toml.rejected ]", "unit=exit-code")
        for bad, why in (("other-key.raucb", "signature"), ("other.raucb", "ompatible"),
                         ("truncated.raucb", "")):
            line = ask(vm, f"install {bad}", "REFUSED", 300)
            expect(line, bad, why)
        expect(ask(vm, "slot", "SLOT", 60), "booted=B", "primary=B")
        session.publish(vm.port, 50)
        step("v2: broken settings kept out, 3 bundles refused", start)

        # 3. v3, whose broker cannot start: installed, rebooted into, marked bad; the boot loader falls back to v2; the
        #    playbook fails that batch and the next gateway of the rollout is never touched
        start = time.monotonic()
        pushed = push(vm, "v3.raucb", "gw-next")
        if pushed.returncode == 0 or "did not stay" not in pushed.stdout:
            failures.append(f"the rollout of v3 did not fail on the first gateway ({pushed.returncode}): "
                            f"{pushed.stdout[-1500:]}")
        if "gw-next" in pushed.stdout:
            failures.append(f"the rollout went on to the next batch after a failed one: {pushed.stdout[-1500:]}")
        text = vm.serial.read_text(errors="replace")
        if "rolling_back" not in text:
            failures.append("v3: no rolling_back from edge-gateway-health")
        vm.wait_for("SERVING", args.boot_timeout)
        expect(ask(vm, "slot", "SLOT", 120), "booted=B", f"version={versions['v2.raucb']}")
        expect(ask(vm, "health", "HEALTH", 900), "OUTCOME=rolled_back", f"VERSION={versions['v2.raucb']}",
               f"PREVIOUS={versions['v3.raucb']}")
        lost = session.drain(vm.port)
        if lost:
            failures.append(f"after the rollback: {len(lost)} acknowledged messages lost: {lost[:20]}")
        log(f"v3 rolled back to v2, rollout stopped at its first batch; {len(session.acked)} acknowledged, "
            f"all delivered: {not lost}")
        step("push v2 -> broken v3: rolled back, rollout stopped", start)

        # 4. a power cut in the middle of rauc install: the old slot boots, healthy
        start = time.monotonic()
        command(vm, "install v2.raucb")
        time.sleep(20)
        vm.kill()
        vm = boot(served)
        vm.wait_for("SERVING", args.boot_timeout)
        expect(ask(vm, "slot", "SLOT", 120), "booted=B", f"version={versions['v2.raucb']}")
        expect(ask(vm, "health", "HEALTH", 900), "HEALTH success",
               f"VERSION={versions['v2.raucb']}")
        lost = session.drain(vm.port)
        if lost:
            failures.append(f"after the power cut: {len(lost)} acknowledged messages lost: {lost[:20]}")
        step("power cut during install: old slot", start)
    except RuntimeError as exc:
        failures.append(str(exc))
    finally:
        if vm is not None:
            vm.kill()
        for path in work.glob("*.trace"):
            path.unlink(missing_ok=True)
        if not failures and not args.keep_disk:
            for path in (disk, Path(str(disk) + ".efivars"), stick, *work.glob("edge-gateway-*.raucb")):
                path.unlink(missing_ok=True)
    for name, seconds in times:
        log(f"time {name}: {seconds:.0f} s")
    log(f"messages: {len(session.acked)} acknowledged, {len(session.delivered)} delivered, "
        f"{sum(c - 1 for c in session.delivered.values())} duplicates")
    for failure in failures:
        log(f"FAIL {failure}")
    if failures:
        log(f"serial logs and the disk are kept in {work}")
        return 1
    log("update test passed: data partition grown, v1 -> v2 pushed and updated, 3 bundles refused, v3 rolled back "
        "to v2 and its rollout stopped, power cut during install kept v2; nothing acknowledged lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
