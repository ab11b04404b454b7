#!/usr/bin/env python3
"""Boot the gateway image under qemu (TCG) with the in-image probe, then cut its power (`make image-test`).

1. Boot 1: the probe (image/probe/probe.sh) checks the running appliance and reports over the serial console: the
   broker is active after READY=1, a QoS 1 round trip, firmware-bridge reading a pty simulator, a hung broker killed
   by the watchdog and restarted, the bridge surviving that. Every check must print PASS. It also reports which MQTT
   codec and broker core the install runs (``edge-gateway version --verbose``), which must be the compiled one when
   the edge-gateway wheel the image was provisioned from holds compiled modules (the amd64 controller's wheel; for
   arm64 the one image/build.sh compiles under qemu-user), and the .py files when it holds none.
2. Power cuts (``--power-cuts N``, 3 in ``make image-test``): the probe then serves the broker's loopback listener
   on the guest's 0.0.0.0:1885, which qemu's user network forwards from 127.0.0.1:PORT on this host only
   (``hostfwd``; ``restrict=on``: the guest reaches nothing else). A client here subscribes once to
   ``powercut/#`` with QoS 1 and clean_session=0 (MQTT 3.1.1 persistent session) and disconnects; a publisher
   sends numbered QoS 1 messages, and once a random number of them has been acknowledged qemu is killed with
   SIGKILL while up to 20 more are in flight. The VM boots again from the same disk; the probe reports that the
   broker is active and whether its store opened cleanly or was quarantined ("STORE clean|quarantined"); the
   subscriber reconnects and every message the publisher saw acknowledged (PUBACK) must arrive. The next cut
   happens during that boot, and so on: N cuts take N + 1 boots.

The disk is a copy of the image (removed afterwards unless ``--keep-disk``), opened by qemu with
``cache=writeback``: the guest sees a volatile write cache, so its kernel sends flushes, and qemu turns each into an
fdatasync of the file. That the flushes reach the file is checked, not assumed: qemu runs under
``strace -e trace=fdatasync,fsync`` (seccomp-filtered: nothing else stops), which counts the syncs of the disk file
per boot, and the probe reports the guest's own count of flush requests (/sys/block/DISK/stat). What a SIGKILL of
qemu loses is what the guest had not yet written to its virtual disk (its page cache, the writes in flight): a power
cut of a board whose storage honours flushes. It does not model storage that loses writes it acknowledged as
flushed (README "Power cuts").

Both architectures boot the way a board does, through the image's own boot loader, which picks the root slot and
loads that slot's kernel: amd64 OVMF (EFI firmware, Debian's ``ovmf``) running GRUB from the image's EFI system
partition (image/rauc/grub.cfg); arm64 on ``virt`` U-Boot (Debian's ``u-boot-qemu``, qemu_arm64's u-boot.bin as
``-bios``: the board's firmware) running the boot script on the image's boot partition (image/rauc/boot.cmd). The
probe's parameters travel in qemu's fw_cfg entry ``opt/edge_gateway/probe`` (the boot loader owns the kernel command
line). ``--machine raspi3b`` (arm64) starts the Raspberry Pi's U-Boot from the boot partition with ``-kernel`` (qemu
has no Pi firmware; it hands U-Boot the Pi 3 device tree and the parameters in its /chosen/bootargs, as the Pi
firmware does with cmdline.txt); there is no fw_cfg there.

Each qemu run has a hard timeout (``timeout --signal=KILL``) beside this script's own deadlines; qemu is killed by
its PID (``-pidfile``). For arm64 (``virt`` or ``raspi3b``) every time limit is multiplied by ``ARM64_SCALE`` (3;
``IMAGE_TEST_SCALE=``), the probe's too (``edge_gateway.probe_scale=`` on the kernel command line): the same checks
with more time for a slower emulation. Exit status 0 when every check passed.

Usage: vm_test.py --arch amd64 [--power-cuts 3] [--seed N] [--out build/appliance]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("broker-active", "pubsub-roundtrip", "bridge-reading", "watchdog-restart", "pubsub-after-restart",
          "bridge-survived-restart")
PROBE = re.compile(r"edge-gateway-probe: (.*)")
INFLIGHT = 20
TOPIC = "powercut"
#: Debian's OVMF (package ovmf): the firmware code (read-only) and the template of its variable store
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
#: Debian's u-boot-qemu: U-Boot for qemu's arm64 virt board, the firmware the arm64 image boots through
UBOOT_QEMU = Path("/usr/lib/u-boot/qemu_arm64/u-boot.bin")
#: arm64 under TCG (an aarch64 guest translated on an x86 host) is slower than the amd64 guest: time limits x3
#: (IMAGE_TEST_SCALE= overrides it)
ARM64_SCALE = int(os.environ.get("IMAGE_TEST_SCALE", 3))


def log(msg: str) -> None:
    print(f"image-test: {msg}", flush=True)


@dataclass
class Arch:
    """How qemu boots one architecture's image: the emulator and machine, the console and the files."""

    qemu: list[str]
    console: str
    disk: str
    #: raspi3b: the boot partition's U-Boot and Pi 3 device tree (extract_boot_files)
    kernel: str = ""
    dtb: str = ""
    #: boots through EFI firmware (OVMF) and the image's own boot loader, not -kernel
    efi: bool = False
    #: boots through this firmware (-bios: U-Boot) and the image's own boot script, not -kernel
    bios: str = ""
    #: the Raspberry Pi machines: the disk is an SD card (size a power of 2), the console the second UART
    raspi: bool = False
    #: how much slower than amd64 on q35 this machine runs under TCG: every time limit of this script and of the
    #: probe (``edge_gateway.probe_scale=``) is multiplied by it; the checks stay the same
    scale: int = 1


def arch_config(arch: str, machine: str, out: Path) -> Arch:
    """The qemu command line and the disk image of ``arch`` (amd64, arm64) on ``machine`` (q35; virt or raspi3b)."""
    disk = str(out / f"edge-gateway-{arch}.img")
    if arch == "amd64" and machine in ("", "q35"):
        return Arch(["qemu-system-x86_64", "-machine", "q35", "-cpu", "max", "-smp", "2", "-m", "1024"], "ttyS0",
                    disk, efi=True)
    if arch == "arm64" and machine in ("", "virt"):
        return Arch(["qemu-system-aarch64", "-machine", "virt", "-cpu", "cortex-a53", "-smp", "2", "-m", "1024"],
                    "ttyAMA0", disk, bios=str(UBOOT_QEMU), scale=ARM64_SCALE)
    if arch == "arm64" and machine == "raspi3b":
        # 4 Cortex-A53 and 1 GiB are fixed by the machine; the Pi 3's console is the mini UART (ttyS1, qemu's second
        # serial port), the PL011 (ttyAMA0) belongs to Bluetooth in the upstream device tree.
        return Arch(["qemu-system-aarch64", "-machine", "raspi3b", "-m", "1024"], "ttyS1,115200", disk,
                    raspi=True, scale=ARM64_SCALE)
    raise SystemExit(f"vm_test.py: --arch {arch!r} --machine {machine!r}: amd64 (q35), arm64 (virt or raspi3b)")


def extract_boot_files(arch: Arch, dest: Path) -> None:
    """Copy the Raspberry Pi's U-Boot (u-boot.bin) and the Pi 3 device tree (bcm2837-rpi-3-b.dtb) out of the image's
    boot partition (partition 1, FAT) with mtools, for ``-kernel`` and ``-dtb``. Sets ``arch.kernel``, ``arch.dtb``."""
    table = json.loads(subprocess.run(["sfdisk", "--json", arch.disk], capture_output=True, text=True,
                                      check=True).stdout)["partitiontable"]
    sector = int(table.get("sectorsize", 512))
    image = f"{arch.disk}@@{int(table['partitions'][0]['start']) * sector}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("u-boot.bin", "bcm2837-rpi-3-b.dtb"):
        subprocess.run(["mcopy", "-o", "-n", "-i", image, f"::/{name}", str(dest / name)], check=True)
    arch.kernel, arch.dtb = str(dest / "u-boot.bin"), str(dest / "bcm2837-rpi-3-b.dtb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Vm:
    """One qemu run: started, its serial log followed line by line, stopped by PID."""

    arch: Arch
    disk: Path
    serial: Path
    trace: Path
    cmdline: str
    limit: float
    port: int = 0
    snapshot: bool = False
    #: more disks, read-only (the update test's stick)
    drives: list[Path] = field(default_factory=list)
    #: this host's 127.0.0.1 port forwarded to the guest's SSH server (22), 0 = none
    ssh_port: int = 0
    #: a reboot of the guest starts qemu again on the same disk, ports and serial log, as a board's reset does
    #: (a playbook's reboot waits for the same machine); else a reboot ends the run. qemu itself always runs with
    #: ``-no-reboot``: OVMF and GRUB after qemu's warm reset under TCG were seen to spin before loading a kernel.
    #: U-Boot's ``reset`` (the arm64 boot script's, after a slot that did not boot) is such a reboot too.
    reboot: bool = False
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0
    started: float = 0.0
    #: how many times the guest rebooted and qemu was started again (``reboot``)
    restarts: int = 0
    probe: list[str] = field(default_factory=list)
    _pos: int = 0
    _buf: str = ""
    _boot_at: int = 0  # the serial log's size when the current qemu started
    _stopping: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _supervisor: threading.Thread | None = None

    def start(self) -> None:
        """Start qemu on a fresh serial log; with ``reboot``, a thread starts it again after each guest reboot."""
        for path in (self.serial, self.trace):
            path.unlink(missing_ok=True)
        self.started = time.monotonic()
        self._launch()
        if self.reboot:
            self._supervisor = threading.Thread(target=self._supervise, name="qemu-reboots", daemon=True)
            self._supervisor.start()

    def _launch(self) -> None:
        """One qemu process, appending to the serial log; its PID from ``-pidfile``."""
        self._boot_at = self.serial.stat().st_size if self.serial.exists() else 0
        self.pid = 0
        pidfile = self.serial.with_suffix(".pid")
        pidfile.unlink(missing_ok=True)
        drive = f"file={self.disk},format=raw,cache=writeback,aio=threads"
        if self.snapshot:
            drive += ",snapshot=on"
        disk = ["-drive", f"{drive},if=none,id=hd0", "-device", "virtio-blk-pci,drive=hd0"]
        serial = ["-chardev", f"file,id=serial0,path={self.serial},append=on", "-serial", "chardev:serial0"]
        if self.arch.raspi:
            disk = ["-drive", f"{drive},if=sd", "-dtb", self.arch.dtb]
            serial = ["-serial", "null", *serial]
        for n, extra in enumerate(self.drives, start=1):
            disk += ["-drive", f"file={extra},format=raw,readonly=on,if=none,id=hd{n}",
                     "-device", f"virtio-blk-pci,drive=hd{n}"]
        net = ["-nic", "none"]
        if self.port:
            # romfile=: no network boot ROM, so the firmware goes straight to the disk
            ssh = f",hostfwd=tcp:127.0.0.1:{self.ssh_port}-:22" if self.ssh_port else ""
            net = ["-netdev", f"user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:{self.port}-:1885{ssh}",
                   "-device", "virtio-net-pci,netdev=net0,romfile="]
        if self.arch.efi or self.arch.bios:
            boot = ["-bios", self.arch.bios] if self.arch.bios else []
            if self.cmdline:  # (qemu refuses an empty fw_cfg string; no entry: the probe stays inert)
                boot += ["-fw_cfg", f"name=opt/edge_gateway/probe,string={self.cmdline}"]
        else:  # raspi3b: the Pi's U-Boot as the "kernel", the parameters in the device tree's /chosen/bootargs
            boot = ["-kernel", self.arch.kernel, "-append", f"console={self.arch.console} {self.cmdline}"]
        if self.arch.efi:
            # the EFI variable store beside the disk (copied from OVMF's template once; the boot entries OVMF makes)
            nvram = self.disk.with_name(self.disk.name + ".efivars")
            if not nvram.exists():
                shutil.copyfile(OVMF_VARS, nvram)
            boot += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                     "-drive", f"if=pflash,format=raw,unit=1,file={nvram}"]
        # strace counts the fdatasync/fsync calls qemu makes on the disk file: the guest's flushes reaching it
        # (--seccomp-bpf: only those system calls stop qemu).
        left = max(int(self.limit - (time.monotonic() - self.started)), 1)
        cmd = ["timeout", "--signal=KILL", str(left),
               "strace", "-f", "--seccomp-bpf", "-qq", "-y", "-e", "trace=fdatasync,fsync", "-o", str(self.trace),
               *self.arch.qemu, "-accel", os.environ.get("IMAGE_TEST_ACCEL", "tcg"),
               "-no-reboot", "-display", "none", "-monitor", "none", *serial,
               "-pidfile", str(pidfile),
               *boot, *disk, *net]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        end = time.monotonic() + 30
        while not self.pid:
            try:
                self.pid = int(pidfile.read_text().strip() or 0)
            except (FileNotFoundError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"qemu exited with {self.proc.returncode} before it started")
            if time.monotonic() > end:
                self._kill_group()
                raise RuntimeError("qemu wrote no pidfile within 30 s")
            time.sleep(0.1)
        pidfile.unlink(missing_ok=True)

    def _powered_off(self) -> bool:
        """The current qemu's guest powered off (the kernel's last console line), rather than rebooted."""
        try:
            with self.serial.open("rb") as f:
                f.seek(self._boot_at)
                return b"reboot: Power down" in f.read()
        except FileNotFoundError:
            return False

    def _supervise(self) -> None:
        """Start qemu again after each guest reboot, until a poweroff, a :meth:`kill` or the time limit."""
        while True:
            proc = self.proc
            assert proc is not None
            code = proc.wait()
            with self._lock:
                if self._stopping or code != 0 or self._powered_off():
                    return  # killed, timed out (timeout's SIGKILL) or powered off: the run is over
                self.restarts += 1
                log(f"the guest rebooted: qemu starts again on the same disk and ports (boot {self.restarts + 1})")
                try:
                    self._launch()
                except RuntimeError as exc:
                    log(f"qemu did not start again: {exc}")
                    return

    def running(self) -> bool:
        """qemu runs, or is being started again after a guest reboot."""
        if self._supervisor is not None and self._supervisor.is_alive():
            return True
        return self.proc is not None and self.proc.poll() is None

    def lines(self) -> list[str]:
        """The probe's new lines in the serial log (also kept in ``self.probe``)."""
        try:
            with self.serial.open("rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        self._buf += data.decode("utf-8", "replace").replace("\r", "")
        *complete, self._buf = self._buf.split("\n")
        new = [m.group(1) for line in complete if (m := PROBE.search(line))]
        self.probe += new
        return new

    def wait_for(self, prefix: str, seconds: float) -> str:
        """Wait for a probe line starting with ``prefix``; print the probe's lines as they come."""
        end = time.monotonic() + seconds
        while True:
            for line in self.lines():
                print(f"  edge-gateway-probe: {line}", flush=True)
                if line.startswith(prefix):
                    return line
            if self.proc is not None and not self.running():
                raise RuntimeError(f"qemu exited with {self.proc.returncode} before the probe printed {prefix!r}")
            if time.monotonic() > end:
                raise RuntimeError(f"no {prefix!r} from the probe within {seconds:.0f} s")
            time.sleep(0.25)

    def wait_exit(self, seconds: float) -> int:
        """Wait for the run to end by itself (a poweroff; with ``reboot``, not a reboot); SIGKILL after
        ``seconds``. qemu's exit status."""
        assert self.proc is not None
        if self._supervisor is not None:
            self._supervisor.join(seconds)
            if self._supervisor.is_alive():
                self.kill()
            assert self.proc is not None
            return self.proc.wait(30)
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(30)

    def _kill_group(self) -> None:
        """SIGKILL ``timeout``'s process group (it makes one: strace and qemu are in it), for a qemu whose PID was
        never read; the processes are waited for."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def kill(self) -> None:
        """SIGKILL qemu (by its PID): the power cut. A guest reboot in progress is not started again."""
        with self._lock:
            self._stopping = True
            if self.pid and self.proc is not None and self.proc.poll() is None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(30)
            self._kill_group()
        if self._supervisor is not None:
            self._supervisor.join(60)

    def flushes(self) -> int:
        """fdatasync/fsync calls qemu made on the disk file during this run (strace), -1 without a trace."""
        if not self.trace.exists():
            return -1
        name = f"<{self.disk.resolve()}>".encode()
        with self.trace.open("rb") as f:
            return sum(1 for line in f if name in line and re.search(rb"\bf(data)?sync\(", line))


def connect(port: int, client_id: str, clean: bool, seconds: float,
            on_message: mqtt.CallbackOnMessage | None = None) -> mqtt.Client:
    """An MQTT 3.1.1 client connected to the VM's broker through the hostfwd port (retried until ``seconds``)."""
    end = time.monotonic() + seconds
    last = ""
    while time.monotonic() < end:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                             clean_session=clean)
        client.max_inflight_messages_set(INFLIGHT)
        connected = threading.Event()
        result: list[str] = []

        def on_connect(c: mqtt.Client, u: object, flags: object, rc: mqtt.ReasonCode, p: object,
                       result: list[str] = result, connected: threading.Event = connected) -> None:
            result.append(str(rc))
            if not rc.is_failure:
                connected.set()

        client.on_connect = on_connect
        if on_message is not None:
            client.on_message = on_message
        try:
            client.connect("127.0.0.1", port, keepalive=60)
        except OSError as exc:
            last = str(exc)
            time.sleep(1)
            continue
        client.loop_start()
        if connected.wait(5):
            return client
        last = f"no CONNACK ({result})"
        client.loop_stop()
        client.disconnect()
        time.sleep(1)
    raise RuntimeError(f"{client_id} could not connect to 127.0.0.1:{port} within {seconds:.0f} s: {last}")


def subscribe_offline(port: int, scale: int) -> None:
    """The persistent session: subscribe powercut/# with QoS 1 and go away (clean_session=0 keeps it)."""
    client = connect(port, "powercut-sub", clean=False, seconds=60 * scale)
    done = threading.Event()
    client.on_subscribe = lambda *a: done.set()
    client.subscribe(f"{TOPIC}/#", qos=1)
    if not done.wait(30 * scale):
        raise RuntimeError("no SUBACK for powercut/#")
    client.disconnect()
    client.loop_stop()


@dataclass
class Cut:
    """One power cut: what the publisher sent and saw acknowledged, and what the subscriber got afterwards."""

    cycle: int
    sent: int = 0
    acked: set[int] = field(default_factory=set)
    delivered: Counter[int] = field(default_factory=Counter)
    store: str = ""
    flushes_before: int = 0
    boot_s: float = 0.0

    @property
    def lost(self) -> list[int]:
        return sorted(self.acked - self.delivered.keys())


def publish_and_cut(vm: Vm, port: int, cut: Cut, kill_after: int) -> None:
    """Publish numbered QoS 1 messages; SIGKILL qemu once ``kill_after`` are acknowledged (more in flight)."""
    client = connect(port, "powercut-pub", clean=True, seconds=60 * vm.arch.scale)
    pending: list[tuple[int, mqtt.MQTTMessageInfo]] = []
    seq = 0
    killed_at = 0.0
    try:
        while True:
            for s, info in pending:
                if info.is_published():
                    cut.acked.add(s)
            pending = [(s, info) for s, info in pending if s not in cut.acked]
            if not killed_at and len(cut.acked) >= kill_after:
                vm.kill()  # the power cut, with up to INFLIGHT messages in flight
                killed_at = time.monotonic()
            if killed_at:
                if not client.is_connected() or time.monotonic() - killed_at > 10:
                    break
                time.sleep(0.05)
                continue
            if len(pending) >= INFLIGHT:
                time.sleep(0.002)
                continue
            if vm.proc is not None and vm.proc.poll() is not None:
                raise RuntimeError(f"qemu exited with {vm.proc.returncode} while the publisher was sending")
            seq += 1
            pending.append((seq, client.publish(f"{TOPIC}/{cut.cycle}", f"{cut.cycle}:{seq}", qos=1)))
    finally:
        # A PUBACK read from the socket before the connection closed counts: the broker sent it before the cut.
        for s, info in pending:
            if info.is_published():
                cut.acked.add(s)
        client.loop_stop()
        client.disconnect()
    cut.sent = seq


def drain(port: int, cut: Cut, seconds: float, scale: int) -> None:
    """Reconnect the persistent session and collect this cut's messages until every acknowledged one is there
    (then 2 s more for stragglers) or ``seconds`` pass."""
    lock = threading.Lock()

    def on_message(c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
        cycle, _, seq = msg.payload.decode().partition(":")
        if int(cycle) == cut.cycle:
            with lock:
                cut.delivered[int(seq)] += 1

    client = connect(port, "powercut-sub", clean=False, seconds=60 * scale, on_message=on_message)
    end = time.monotonic() + seconds
    complete_at = 0.0
    while time.monotonic() < end:
        with lock:
            complete = not (cut.acked - cut.delivered.keys())
        if complete and not complete_at:
            complete_at = time.monotonic()
        if complete_at and time.monotonic() - complete_at > 2:
            break
        time.sleep(0.2)
    client.disconnect()
    client.loop_stop()


def expected_core(out: Path, arch: str) -> str | None:
    """What ``edge-gateway version --verbose`` must say in the image, from the edge-gateway wheel its provisioning
    installed (ansible/target_wheels.py's output for the image's root, wheels-ARCH-ARCH-pyX.Y): ``compiled`` when
    that wheel holds compiled modules, ``pure Python`` when it does not, None when there is no such wheel here."""
    wheels = sorted(out.glob(f"wheels-{arch}-{arch}-py*/edge_gateway-*.whl"))
    if len(wheels) != 1:
        return None
    with zipfile.ZipFile(wheels[0]) as wheel:
        compiled = any(name.startswith("gateway/_core__mypyc.") and name.endswith(".so") for name in wheel.namelist())
    return "compiled" if compiled else "pure Python"


def boot_checks(vm: Vm, failures: list[str], core: str | None) -> None:
    """Every check of the full probe printed PASS, none FAIL; the core runs as the image's wheel says it can."""
    for check in CHECKS:
        if not any(line.startswith(f"PASS {check}") for line in vm.probe):
            failures.append(f"missing PASS {check}")
    failures += [line for line in vm.probe if line.startswith("FAIL")]
    roots = [line for line in vm.probe if line.startswith("ROOT ")]
    if not roots or not re.search(r"\s(ro),", roots[0]):
        failures.append(f"the root file system is not mounted read-only: {roots[:1]}")
    cores = [line.removeprefix("CORE ") for line in vm.probe if line.startswith("CORE")]
    log(f"the image's MQTT codec and broker core: {cores[0] if cores else 'no CORE line'}"
        + (f" (its edge-gateway wheel: {core})" if core else ""))
    if core is not None and not (cores and cores[0].startswith(core)):
        failures.append(f"the core runs {cores[:1] or 'unreported'}, where the image's edge-gateway wheel is {core}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=os.environ.get("IMAGE_ARCH", "amd64"), help="amd64 or arm64")
    parser.add_argument("--machine", default="", help="qemu machine: q35 (amd64), virt (arm64, default) or raspi3b "
                        "(arm64: the probe's checks only, no network for the power cuts)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("IMAGE_OUT", ROOT / "build" / "appliance")))
    parser.add_argument("--power-cuts", type=int, default=3, help="SIGKILLs of qemu mid-stream (0: the probe only)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill points (default: random, printed)")
    parser.add_argument("--boot-timeout", type=float, default=float(os.environ.get("IMAGE_TEST_TIMEOUT", 0)),
                        help="hard limit of one qemu run, seconds (default 600, times 3 for arm64)")
    parser.add_argument("--keep-disk", action="store_true", help="keep the power-cut disk copy")
    args = parser.parse_args()
    arch = arch_config(args.arch, args.machine, args.out)
    args.boot_timeout = args.boot_timeout or 600.0 * arch.scale
    if arch.raspi and args.power_cuts:
        raise SystemExit("image-test: --machine raspi3b has no network for the power-cut client: --power-cuts 0")
    if not Path(arch.disk).is_file():
        raise SystemExit(f"image-test: {arch.disk} is missing: make image ARCH={args.arch}")
    for tool in (arch.qemu[0], "sfdisk", "mcopy"):
        if shutil.which(tool) is None:
            raise SystemExit(f"image-test: {tool} is missing: make image-deps")
    if arch.efi and not OVMF_CODE.is_file():
        raise SystemExit(f"image-test: {OVMF_CODE} is missing: make image-deps (ovmf)")
    if arch.bios and not Path(arch.bios).is_file():
        raise SystemExit(f"image-test: {arch.bios} is missing: make image-deps (u-boot-qemu)")
    if arch.raspi:
        extract_boot_files(arch, args.out / f"boot-{args.arch}")
    if arch.raspi:
        # qemu's SD card must be a power of 2 in size: a sparse copy, grown to the next one (the partitions stay).
        sd = args.out / f"sd-{args.arch}.img"
        subprocess.run(["cp", "--sparse=always", "--reflink=auto", arch.disk, str(sd)], check=True)
        os.truncate(sd, 1 << (sd.stat().st_size - 1).bit_length())
        arch.disk = str(sd)
    if arch.efi:
        log(f"{Path(arch.disk).name} boots through OVMF and its own GRUB")
    elif arch.bios:
        log(f"{Path(arch.disk).name} boots through U-Boot ({arch.bios}) and its own boot script")
    else:
        log(f"{Path(arch.disk).name} boots through its Raspberry Pi U-Boot: {arch.kernel}, {arch.dtb}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    tag = f"-{args.arch}" + (f"-{args.machine}" if args.machine else "")
    serial = args.out / f"serial{tag}.log"
    for stale in args.out.glob(f"serial{tag}-boot*.log"):  # the later boots' logs of an earlier run
        stale.unlink()
    failures: list[str] = []
    cuts: list[Cut] = []
    disk = Path(arch.disk)
    work = args.out / f"powercut{tag}.img"
    probe = "systemd.wants=edge-gateway-probe.service edge_gateway.probe=1"
    if arch.scale != 1:
        probe += f" edge_gateway.probe_scale={arch.scale}"
    start = time.monotonic()
    vm: Vm | None = None
    try:
        if args.power_cuts:
            log(f"power-cut disk: a copy of {disk.name} as {work.name} (cache=writeback); seed {seed}")
            subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(disk), str(work)], check=True)
            disk = work
        port = free_port() if args.power_cuts else 0
        vm = Vm(arch, disk, serial, serial.with_suffix(".trace"),
                probe + (" edge_gateway.powercut=first" if args.power_cuts else ""), args.boot_timeout, port,
                snapshot=not args.power_cuts)
        log(f"boot 1: {' '.join(arch.qemu)} -accel {os.environ.get('IMAGE_TEST_ACCEL', 'tcg')}, probe checks; "
            f"time limits x{arch.scale} (boot {args.boot_timeout:.0f} s)")
        vm.start()
        vm.wait_for("DONE", args.boot_timeout)
        boot_checks(vm, failures, expected_core(args.out, args.arch))
        if not args.power_cuts:
            rc = vm.wait_exit(120 * arch.scale)
            if rc != 0 and not arch.raspi:  # raspi3b: qemu has no power-off for the kernel to use; it is killed
                failures.append(f"qemu exited with {rc} (it should power off by itself)")
        else:
            vm.wait_for("SERVING", 120 * arch.scale)
            subscribe_offline(port, arch.scale)
            log("powercut-sub subscribed to powercut/# (QoS 1, clean_session=0) and disconnected")
        for n in range(1, args.power_cuts + 1):
            cut = Cut(n)
            cuts.append(cut)
            kill_after = rng.randint(50, 400)
            publish_and_cut(vm, port, cut, kill_after)
            cut.flushes_before = vm.flushes()
            log(f"power cut {n}/{args.power_cuts}: SIGKILL of qemu after {kill_after} acknowledged: {cut.sent} "
                f"published, {len(cut.acked)} acknowledged; qemu flushed the disk file {cut.flushes_before} times "
                f"that boot")
            if cut.flushes_before <= 0:
                failures.append(f"cut {n}: qemu submitted no flush to the disk file (the guest's flushes do not "
                                f"reach it: {cut.flushes_before})")
            port = free_port()
            boot_log = serial.with_name(f"serial{tag}-boot{n + 1}.log")
            vm = Vm(arch, disk, boot_log, boot_log.with_suffix(".trace"),
                    probe + " edge_gateway.powercut=again", args.boot_timeout, port)
            vm.start()
            vm.wait_for("SERVING", args.boot_timeout)
            cut.boot_s = time.monotonic() - vm.started
            failures += [f"cut {n}: {line}" for line in vm.probe if line.startswith("FAIL")]
            stores = [line for line in vm.probe if line.startswith("STORE")]
            cut.store = stores[0] if stores else "no STORE line"
            if not stores:
                failures.append(f"cut {n}: the probe reported no STORE line")
            if not any(line.startswith("PASS broker-active") for line in vm.probe):
                failures.append(f"cut {n}: the broker is not active after the reboot")
            drain(port, cut, 90 * arch.scale, arch.scale)
            dups = sum(c - 1 for c in cut.delivered.values())
            extra = len(cut.delivered.keys() - cut.acked)
            log(f"power cut {n}/{args.power_cuts}: rebooted in {cut.boot_s:.0f} s, {cut.store.split(':')[0]}; "
                f"{len(cut.delivered)} delivered ({len(cut.acked) - len(cut.lost)} of {len(cut.acked)} "
                f"acknowledged, {extra} published but unacknowledged, {dups} duplicates); lost: {len(cut.lost)}")
            if cut.lost:
                failures.append(f"cut {n}: {len(cut.lost)} acknowledged messages lost: {cut.lost[:20]}")
    except RuntimeError as exc:
        failures.append(str(exc))
    finally:
        if vm is not None:
            vm.kill()
        if args.power_cuts and not args.keep_disk and not failures:
            work.unlink(missing_ok=True)
            Path(str(work) + ".efivars").unlink(missing_ok=True)
        if arch.raspi:
            Path(arch.disk).unlink(missing_ok=True)
        for path in args.out.glob(f"serial{tag}*.trace"):
            path.unlink(missing_ok=True)
    elapsed = time.monotonic() - start
    boot = next((line for line in (vm.probe if vm else []) if line.startswith("START")), "")
    log(f"qemu -accel {os.environ.get('IMAGE_TEST_ACCEL', 'tcg')} ran {elapsed:.0f} s; serial logs: {serial} ... "
        f"({boot})")
    if cuts:
        total_acked = sum(len(c.acked) for c in cuts)
        total_lost = sum(len(c.lost) for c in cuts)
        clean = sum(c.store.startswith("STORE clean") for c in cuts)
        log(f"power cuts: {len(cuts)} of {args.power_cuts}, {total_acked} acknowledged, {total_lost} lost, store "
            f"clean after {clean}, quarantined after {len(cuts) - clean}; seed {seed}")
    for failure in failures:
        log(f"FAIL {failure}")
    if failures:
        if args.power_cuts:
            log(f"the disk is kept for a look: {work}")
        return 1
    cut_s = f"{len(cuts)} power cut{'' if len(cuts) == 1 else 's'}"
    log(f"{len(CHECKS)} passed, 0 failed" + (f"; {cut_s}, nothing acknowledged lost" if cuts else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
