"""Foreign-architecture Debian roots for the cross-architecture provisioning test (tests/test_cross_arch.py).

- ``binfmt_registered(["aarch64", "arm"])``: qemu-user's interpreters registered with binfmt_misc for the duration
  of a ``with`` block, under names of our own (``edge-gateway-test-<cpu>-<pid>``), with Debian's magic and mask
  (/usr/lib/binfmt.d/qemu-<cpu>.conf of ``qemu-user-static``) and the F flag (the kernel opens the interpreter at
  registration, so it works inside a chroot that does not hold it). binfmt_misc is mounted only in a private mount
  namespace held by a helper process (``unshare --mount``), never on the host's /proc/sys/fs/binfmt_misc; each
  entry is removed (``-1``) at the end. Since Linux 6.7 an instance's entries also vanish with its last mount, so
  even a killed test leaves nothing registered (unless something else holds binfmt_misc mounted).
- ``base_tarball("arm64")``: a Debian bookworm minbase root (mmdebstrap ``--arch``, from the host's apt mirror as
  ``make image`` uses: image/apt-sources.py), cached under build/cross/ keyed by its inputs.
- ``in_chroot(root, argv)``: a command inside a root under qemu-user with /proc and /dev mounted in a private mount
  namespace (the mounts vanish with the command).

Run as a script to build the base tarballs ahead: ``python tests/cross_arch.py arm64 armhf``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "cross"
SUITE = "bookworm"
# Debian architecture -> (qemu-user's CPU name, the machine of its wheels and of `uname -m` under qemu-user)
ARCHES = {"arm64": ("aarch64", "aarch64"), "armhf": ("arm", "armv7l")}
# What a freshly installed board has before the playbook runs: Ansible needs python3 (and python3-apt for its apt
# module); systemd and udev own the directories the roles write units and rules into.
PACKAGES = ["python3", "python3-apt", "systemd", "udev", "ca-certificates"]
BASE_RECIPE = 1  # bump when the mmdebstrap options below change
QEMU_PACKAGES = ["mmdebstrap", "arch-test", "qemu-user-static"]  # Debian packages the test needs on the host


def log(msg: str) -> None:
    print(f"[cross {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def binfmt_registered(cpus: Sequence[str]) -> Iterator[list[str]]:
    """Register qemu-user for ``cpus`` (qemu names: aarch64, arm) with binfmt_misc; yields the entry names.

    Raises RuntimeError when binfmt_misc cannot be mounted or an entry cannot be written."""
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         "mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc "
         "&& echo ready && exec cat >/dev/null"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdin is not None and holder.stdout is not None
    names: list[str] = []
    fs = Path(f"/proc/{holder.pid}/root/proc/sys/fs/binfmt_misc")
    try:
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError("cannot mount binfmt_misc in a private mount namespace")
        for cpu in cpus:
            conf = Path(f"/usr/lib/binfmt.d/qemu-{cpu}.conf").read_text().strip()
            _, _, kind, offset, magic, mask, interpreter, flags = conf.split(":")
            name = f"edge-gateway-test-{cpu}-{os.getpid()}"
            flags = flags if "F" in flags else flags + "F"
            (fs / "register").write_text(":".join(["", name, kind, offset, magic, mask, interpreter, flags]))
            names.append(name)
        yield names
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (fs / name).write_text("-1")
        holder.stdin.close()
        try:
            holder.wait(10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdout.close()


def registered_entries() -> list[str]:
    """The binfmt_misc entries registered now (read through a private mount: the host's stays as it is)."""
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         "mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; "
         "ls /proc/sys/fs/binfmt_misc"],
        capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return sorted(set(out) - {"register", "status"})


def apt_sources() -> str:
    """The deb822 sources of `make image`: the host's Debian mirror (image/apt-sources.py)."""
    return subprocess.run([sys.executable, str(ROOT / "image" / "apt-sources.py"), "--suite", SUITE],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def base_tarball(arch: str) -> Path:
    """build/cross/base-ARCH-KEY.tar: mmdebstrap's Debian root for ``arch`` (arm64, armhf); built when missing.

    Needs root, mmdebstrap, arch-test and qemu-user registered with binfmt_misc (``binfmt_registered``)."""
    sources = apt_sources()
    key = hashlib.sha256("\n".join([str(BASE_RECIPE), arch, *PACKAGES, sources]).encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / f"base-{arch}-{key}.tar"
    if tar.exists():
        log(f"base {arch}: cached {tar.name}")
        return tar
    for old in CACHE.glob(f"base-{arch}-*.tar"):
        old.unlink()
    part = tar.with_suffix(".part.tar")
    started = time.monotonic()
    # A mirror whose index of one suite does not match its Release file ("File has unexpected size": seen here for
    # bookworm-security armhf) fails apt-get update: then once more without that suite, said loudly.
    without_security = "\n\n".join(s for s in sources.split("\n\n") if "-security" not in s)
    for attempt, text in enumerate([sources, without_security], 1):
        (CACHE / f"{SUITE}-{arch}.sources").write_text(text)
        log(f"base {arch}: mmdebstrap {SUITE}/{arch} under qemu-user" + (" without -security" if attempt == 2 else ""))
        # --mode=root inside a private mount namespace: mmdebstrap's bind mounts vanish with it, even on failure.
        argv = ["unshare", "--mount", "--propagation", "private", "--",
                "mmdebstrap", "--mode=root", "--variant=minbase", f"--arch={arch}", "--include=" + ",".join(PACKAGES),
                "--aptopt=Acquire::Retries \"3\"",
                "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                SUITE, str(part), str(CACHE / f"{SUITE}-{arch}.sources")]  # fmt: skip
        if subprocess.run(argv, stdout=subprocess.DEVNULL).returncode == 0:
            break
        part.unlink(missing_ok=True)
        if attempt == 2 or text == without_security:
            raise RuntimeError(f"mmdebstrap {SUITE}/{arch} failed (its messages are above)")
        log(f"base {arch}: mmdebstrap failed with the host's sources; WARNING: trying without the -security suite")
    part.rename(tar)
    log(f"base {arch}: built in {time.monotonic() - started:.0f} s")
    return tar


def extract(tar: Path, root: Path) -> None:
    """Unpack a base tarball as root (owners, modes and device nodes kept)."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpf", str(tar), "-C", str(root)],
                   check=True)  # fmt: skip
    # apt and dpkg inside the root resolve the mirror's name like the host does.
    shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf")


def mounted(root: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run in a private mount namespace with /proc and /dev mounted under ``root``: the mounts vanish
    with it, whatever happens (for ansible-playbook and for commands inside the root)."""
    script = 'set -e; r="$1"; shift; mount -t proc proc "$r/proc"; mount --rbind /dev "$r/dev"; exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(root), *argv]


def in_chroot(root: Path, argv: Sequence[str]) -> list[str]:
    """The command line running ``argv`` inside ``root`` (under qemu-user for a foreign root)."""
    return mounted(root, ["chroot", str(root), "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8",
                          *argv])  # fmt: skip


if __name__ == "__main__":
    wanted = sys.argv[1:] or list(ARCHES)
    with binfmt_registered([ARCHES[a][0] for a in wanted]):
        for a in wanted:
            print(base_tarball(a))
