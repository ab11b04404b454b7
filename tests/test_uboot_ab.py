"""The arm64 image's A/B boot selection (image/rauc/boot.cmd, README "Updating gateways in the field") run by the real
U-Boot: Debian's u-boot-qemu (qemu_arm64) as the firmware of qemu's virt board, a small disk laid out as the image
(MBR, boot partition FAT with boot.scr and boot-state.env, root slots A and B, data), and in each slot a "kernel"
of four instructions that powers the machine off (PSCI SYSTEM_OFF): a boot that reaches it ran that slot's kernel.
Which slot booted is read from U-Boot's console; what the script counted is read back from boot-state.env, checked
as RAUC's uboot backend reads it through fw_printenv (a CRC32 over the rest of the 16 KiB, then name=value strings).

Each qemu run is one boot (-no-reboot: the script's reset after a slot that did not boot ends the run too), about
10 s under TCG. The whole image booted through this script is `make image-test ARCH=arm64`."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from helpers import ROOT

UBOOT = Path("/usr/lib/u-boot/qemu_arm64/u-boot.bin")
SCRIPT = ROOT / "image" / "rauc" / "boot.cmd"
ENV_SIZE = 0x4000
TOOLS = ("qemu-system-aarch64", "mkimage", "mkenvimage", "mkfs.vfat", "mcopy", "mkfs.ext4", "sfdisk")

pytestmark = [
    pytest.mark.skipif(not UBOOT.is_file() or any(shutil.which(t) is None for t in TOOLS),
                       reason="u-boot-qemu, u-boot-tools, qemu-system-arm, dosfstools, mtools: make deps"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

#: MiB: where the partitions start and how big they are (small: U-Boot only reads the slots' /vmlinuz)
BOOT_AT, BOOT_MB, SLOT_MB, DATA_MB = 1, 34, 8, 8


def _kernel() -> bytes:
    """An arm64 Linux Image (the 64-byte header booti checks: branch, text_offset, image_size, flags, "ARM\\x64")
    whose code calls PSCI SYSTEM_OFF through HVC, which qemu's virt board implements: the machine powers off."""
    code = struct.pack("<4I", 0xD2800100,  # movz x0, #0x0008
                       0xF2B08000,  # movk x0, #0x8400, lsl #16: x0 = 0x84000008, PSCI SYSTEM_OFF
                       0xD4000002,  # hvc #0
                       0x14000000)  # b . (never reached)
    header = struct.pack("<II QQQ QQQ I I", 0x14000010,  # b +64: over the header to the code
                         0, 0, 0x10000, 0xA, 0, 0, 0, 0x644D5241, 0)
    assert len(header) == 64
    return header + code


def _env(values: dict[str, str]) -> bytes:
    data = b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()) + b"\0"
    data = data.ljust(ENV_SIZE - 4, b"\0")
    return struct.pack("<I", zlib.crc32(data)) + data


def _read_env(raw: bytes) -> dict[str, str]:
    assert len(raw) == ENV_SIZE
    (crc,) = struct.unpack("<I", raw[:4])
    assert crc == zlib.crc32(raw[4:]), "boot-state.env has a bad CRC: fw_printenv would not read it"
    pairs = [p.decode() for p in raw[4:].split(b"\0") if p]
    return dict(p.split("=", 1) for p in pairs)


class Board:
    """The small disk and one U-Boot boot of it at a time."""

    def __init__(self, tmp: Path, slots: tuple[str, ...] = ("A", "B")) -> None:
        self.tmp = tmp
        self.disk = tmp / "disk.img"
        self.boot_offset = BOOT_AT << 20
        subprocess.run(["mkimage", "-A", "arm64", "-O", "linux", "-T", "script", "-C", "none", "-n", "test",
                        "-d", str(SCRIPT), str(tmp / "boot.scr")], check=True, capture_output=True)
        boot = tmp / "boot.vfat"
        subprocess.run(["mkfs.vfat", "-F", "32", "-n", "EG-BOOT", "-C", str(boot), str(BOOT_MB * 1024)], check=True,
                       capture_output=True)
        subprocess.run(["mcopy", "-i", str(boot), str(tmp / "boot.scr"), "::/"], check=True)
        total = BOOT_AT + BOOT_MB + 2 * SLOT_MB + DATA_MB + 1
        with self.disk.open("wb") as f:
            f.truncate(total << 20)
        table = "label: dos\nlabel-id: 0x45474757\nunit: sectors\n"
        start = BOOT_AT
        for size, kind in ((BOOT_MB, "c, bootable"), (SLOT_MB, "83"), (SLOT_MB, "83"), (DATA_MB, "83")):
            table += f"start={start * 2048}, size={size * 2048}, type={kind}\n"
            start += size
        subprocess.run(["sfdisk", "--quiet", str(self.disk)], input=table, text=True, check=True)
        self._put(boot, BOOT_AT)
        for n, slot in enumerate(("A", "B")):
            tree = tmp / f"slot-{slot}"
            (tree / "boot").mkdir(parents=True)
            if slot in slots:  # a slot as the image has it: /vmlinuz and /initrd.img are links into /boot
                (tree / "boot" / "vmlinuz-test").write_bytes(_kernel())
                (tree / "boot" / "initrd.img-test").write_bytes(b"initrd")
                (tree / "vmlinuz").symlink_to("boot/vmlinuz-test")
                (tree / "initrd.img").symlink_to("boot/initrd.img-test")
            image = tmp / f"slot-{slot}.ext4"
            subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "eg-root", "-d", str(tree), str(image), f"{SLOT_MB}M"],
                           check=True)
            self._put(image, BOOT_AT + BOOT_MB + n * SLOT_MB)
        self.boots = 0

    def _put(self, image: Path, at_mb: int) -> None:
        subprocess.run(["dd", f"if={image}", f"of={self.disk}", "bs=1M", f"seek={at_mb}", "conv=notrunc",
                        "status=none"], check=True)

    def write_state(self, raw: bytes) -> None:
        local = self.tmp / "boot-state.env"
        local.write_bytes(raw)
        subprocess.run(["mcopy", "-o", "-i", f"{self.disk}@@{self.boot_offset}", str(local), "::/boot-state.env"],
                       check=True)

    def state(self) -> dict[str, str]:
        local = self.tmp / "boot-state.out"
        subprocess.run(["mcopy", "-o", "-n", "-i", f"{self.disk}@@{self.boot_offset}", "::/boot-state.env",
                        str(local)], check=True)
        return _read_env(local.read_bytes())

    def boot(self) -> tuple[str, str]:
        """One power-on: (the slot U-Boot booted, "kernel" when it ran that slot's kernel or "reset"), and the log."""
        self.boots += 1
        serial = self.tmp / f"serial-{self.boots}.log"
        proc = subprocess.run(["timeout", "--signal=KILL", "120", "qemu-system-aarch64", "-machine", "virt",
                               "-cpu", "cortex-a53", "-m", "512", "-bios", str(UBOOT), "-no-reboot",
                               "-display", "none", "-monitor", "none", "-serial", f"file:{serial}", "-nic", "none",
                               "-drive", f"file={self.disk},format=raw,if=none,id=hd0",
                               "-device", "virtio-blk-pci,drive=hd0"], capture_output=True, text=True)
        log = serial.read_text(errors="replace")
        assert proc.returncode == 0, f"qemu: {proc.returncode} {proc.stderr}\n{log[-3000:]}"
        slots = [line.split()[3] for line in log.splitlines() if line.startswith("edge-gateway: booting slot")]
        assert len(slots) == 1, log[-3000:]
        ran = "kernel" if "Starting kernel" in log and "resetting" not in log else "reset"
        return f"{slots[0]} {ran}", log


def test_a_new_slot_gets_three_boots_then_the_old_one_boots_again(tmp_path: Path) -> None:
    """The image's state (slot A, B empty), then what `rauc install` into B leaves (B first, 3 boots): B boots three
    times without being marked good, counting 2, 1, 0; the fourth boot is A's. `rauc status mark-good` (3 again)
    would have kept B."""
    board = Board(tmp_path)
    board.write_state(_env({"BOOT_ORDER": "A B", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "0"}))
    booted, log = board.boot()
    assert booted == "A kernel", log[-3000:]
    assert "root=PARTUUID=45474757-02 ro rootwait panic=10 rauc.slot=A" in log
    assert board.state() == {"BOOT_ORDER": "A B", "BOOT_A_LEFT": "2", "BOOT_B_LEFT": "0"}

    board.write_state(_env({"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "3"}))  # after rauc install
    for left in ("2", "1", "0"):
        booted, log = board.boot()
        assert booted == "B kernel", log[-3000:]
        assert "root=PARTUUID=45474757-03 ro rootwait panic=10 rauc.slot=B" in log
        assert board.state() == {"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": left}
    booted, log = board.boot()
    assert booted == "A kernel", log[-3000:]
    assert board.state() == {"BOOT_ORDER": "B A", "BOOT_A_LEFT": "2", "BOOT_B_LEFT": "0"}


def test_a_slot_marked_bad_is_skipped_and_none_left_boots_the_first(tmp_path: Path) -> None:
    """`rauc status mark-bad` (0 boots left) sends the next boot to the other slot at once; with no slot left both
    get 3 again and the first of BOOT_ORDER boots (better a system than none)."""
    board = Board(tmp_path)
    board.write_state(_env({"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "0"}))
    assert board.boot()[0] == "A kernel"
    assert board.state() == {"BOOT_ORDER": "B A", "BOOT_A_LEFT": "2", "BOOT_B_LEFT": "0"}
    board.write_state(_env({"BOOT_ORDER": "B A", "BOOT_A_LEFT": "0", "BOOT_B_LEFT": "0"}))
    booted, log = board.boot()
    assert booted == "B kernel", log[-3000:]
    assert "no slot with boots left" in log
    assert board.state() == {"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "2"}


def test_an_empty_slot_is_marked_bad_and_a_bad_state_file_starts_from_slot_a(tmp_path: Path) -> None:
    """A slot without a kernel (empty, or cut off in the middle of its install) gets 0 boots and the board resets,
    so the next boot is the other slot's; a boot-state.env with a bad CRC (a power cut during its write) is not
    trusted: BOOT_ORDER=A B with 3 boots each, written back whole."""
    board = Board(tmp_path, slots=("A",))
    board.write_state(_env({"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "3"}))
    booted, log = board.boot()
    assert booted == "B reset", log[-3000:]
    assert "slot B did not boot" in log
    assert board.state() == {"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "0"}
    assert board.boot()[0] == "A kernel"

    torn = bytearray(_env({"BOOT_ORDER": "B A", "BOOT_A_LEFT": "3", "BOOT_B_LEFT": "0"}))
    torn[10] ^= 0xFF
    board.write_state(bytes(torn))
    booted, log = board.boot()
    assert booted == "A kernel", log[-3000:]
    assert "no valid boot-state.env" in log
    assert board.state() == {"BOOT_ORDER": "A B", "BOOT_A_LEFT": "2", "BOOT_B_LEFT": "3"}
