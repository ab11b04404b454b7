"""``edge-gateway update pull``: one run of the update timer (README "Pull updates").

1. Records first: a version the health check rolled back (``last``: ``OUTCOME=rolled_back``,
   ``PREVIOUS=<version>``), or one this pull installed that a later boot does not run (``pending``), is written
   as ``rejected-<version>`` in the state directory and never installed again.
2. The manifest over HTTPS; :func:`gateway.update.plan.decide` says whether to install it.
3. Free space before any download: ``statvfs`` of the download directory must leave, after the rest of the
   bundle, the store's room to ``[store] max_size`` plus ``[update] reserve`` (:func:`plan.space_needed`).
4. The bundle into ``<sha256>.raucb.part`` (Range resume), its SHA-256 checked, renamed to ``<sha256>.raucb``.
5. Inside the maintenance window only: the install command (``rauc install BUNDLE``), then ``pending`` is
   written, the bundle removed and the reboot command run. Outside it the verified bundle waits.

Every step logs one line saying what it did and why; the exit code says how it ended (:data:`EXIT_CODES`).
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import platform
import subprocess
from collections.abc import Iterator, Sequence
from configparser import ConfigParser
from configparser import Error as ConfigParserError
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.update.fetch import FetchError, download, fetch_manifest, file_sha256, make_opener
from gateway.update.plan import (
    Action,
    Manifest,
    ManifestError,
    Pending,
    decide,
    parse_key_values,
    parse_manifest,
    pending_outcome,
    rolled_back_version,
    space_needed,
)
from gateway.update.settings import STATE_DIR, UpdateSettings, UpdateTlsError, client_context

__all__ = ["EXIT_CODES", "PullRun", "default_compatible", "pull"]

log = logging.getLogger("gateway.update")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_MANIFEST = 3
EXIT_CHECKSUM = 4
EXIT_SPACE = 5
EXIT_INSTALL = 6
EXIT_REBOOT = 7
EXIT_BUSY = 8
EXIT_CONFIG = 78
#: For ``--help`` and the README.
EXIT_CODES = {
    EXIT_OK: "nothing to do (up to date, another compatible, older or rejected version, pull off), the bundle is "
             "ready and waits for the maintenance window, or it was installed and the reboot started",
    EXIT_FAILED: "the server could not be reached or verified (TLS), answered an HTTP error, or the download was "
                 "interrupted (the part is kept; the next run resumes)",
    EXIT_MANIFEST: "the manifest is invalid (the line names the field) or larger than max_bundle_size",
    EXIT_CHECKSUM: "the bundle's SHA-256 did not match the manifest: the file was deleted",
    EXIT_SPACE: "too little free space for the bundle beside the store's room and the reserve: nothing downloaded",
    EXIT_INSTALL: "the install command failed (its output is logged; the bundle is kept for the next run)",
    EXIT_REBOOT: "installed, but the reboot command failed (the next run in the window reboots)",
    EXIT_BUSY: "another pull is running",
    EXIT_CONFIG: "the configuration is invalid",
}

RELEASE_FILE = "/etc/edge-gateway-release"
RAUC_SYSTEM_CONF = "/etc/rauc/system.conf"
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_TIMEOUT = 60.0  # seconds without a byte before a request is given up (and resumed)
_DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "armhf", "armv6l": "armhf"}


@dataclass(slots=True)
class PullRun:
    """Everything one run needs besides ``[update]``: paths (other ones in tests), this gateway's identity, the
    store whose room is kept free, the time and the commands."""

    compatible: str
    store_dir: Path
    store_max_size: int
    now: datetime.datetime  # local wall-clock time, naive
    install_command: Sequence[str] = ("rauc", "install")
    reboot_command: Sequence[str] = ("systemctl", "reboot")
    release_file: Path = Path(RELEASE_FILE)
    state_dir: Path = Path(STATE_DIR)
    boot_id_file: Path = Path(BOOT_ID_FILE)


def default_compatible(system_conf: str = RAUC_SYSTEM_CONF) -> str:
    """RAUC's own ``[system] compatible`` (it refuses a bundle for another), else ``edge-gateway-<Debian arch>``."""
    parser = ConfigParser(interpolation=None)
    try:
        parser.read(system_conf, encoding="utf-8")
        value = parser.get("system", "compatible", fallback="").strip()
    except ConfigParserError:
        value = ""
    if value:
        return value
    machine = platform.machine()
    return f"edge-gateway-{_DEBIAN_ARCH.get(machine, machine)}"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def _write_atomically(path: Path, text: str) -> None:
    """A record that is either the old or the new one after a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _locked(state_dir: Path) -> Iterator[bool]:
    """An exclusive lock on ``state_dir/lock`` (the timer's run and one by hand never overlap); False when held."""
    with (state_dir / "lock").open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _rejected(state_dir: Path) -> frozenset[str]:
    return frozenset(p.name.removeprefix("rejected-") for p in state_dir.glob("rejected-*") if p.is_file())


def _reject(state_dir: Path, version: str, why: str) -> None:
    path = state_dir / f"rejected-{version}"
    if not path.exists():
        _write_atomically(path, why + "\n")
        log.warning("version %s is rejected from now on: %s", version, why)


def _records(run: PullRun, installed: str | None, boot_id: str) -> Pending | None:
    """Turns the health check's ``last`` and the pull's ``pending`` into ``rejected-<version>`` records; returns
    the install still waiting for its reboot in this boot, if any."""
    last = _read_text(run.state_dir / "last")
    if last is not None:
        failed = rolled_back_version(last)
        if failed is not None:
            _reject(run.state_dir, failed, f"the health check rolled it back ({run.state_dir / 'last'})")
    pending_path = run.state_dir / "pending"
    text = _read_text(pending_path)
    pending = Pending.load(text) if text is not None else None
    if pending is None:
        pending_path.unlink(missing_ok=True)
        return None
    outcome = pending_outcome(pending, installed, boot_id)
    if outcome == "awaiting_reboot":
        return pending
    if outcome == "booted":
        log.info("version %s, installed by an earlier pull, is running", pending.version)
    else:
        _reject(run.state_dir, pending.version, f"installed by a pull, but a later boot runs {installed or 'unknown'}"
                                                " (the new slot did not stay)")
    pending_path.unlink()
    _fsync_dir(run.state_dir)
    return None


def _clean_downloads(download_dir: Path, keep: str | None) -> None:
    """Removes the bundles and parts of other releases (``keep``: the current bundle's SHA-256)."""
    for path in download_dir.glob("*.raucb*"):
        if keep is not None and path.name in (f"{keep}.raucb", f"{keep}.raucb.part"):
            continue
        if path.name.endswith((".raucb", ".raucb.part")):
            path.unlink(missing_ok=True)
            log.info("removed %s (not the current release)", path)


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _device(path: Path) -> int:
    """The file system of ``path``, or of its nearest existing parent (a store not created yet)."""
    for candidate in (path, *path.parents):
        try:
            return candidate.stat().st_dev
        except FileNotFoundError:
            continue
    return -1


def room_for(size: int, directory: Path, store_dir: Path, store_max_size: int, reserve: int) -> tuple[bool, str]:
    """Whether ``size`` more bytes may be written into ``directory`` (the free-space rule,
    :func:`plan.space_needed`): what is free to an unprivileged writer (the broker) must cover them, the room the
    broker's store at ``store_dir`` may still grow into up to ``store_max_size`` bytes when it shares the file
    system, and ``reserve`` bytes. Returns (fits, the figures as one sentence for the log)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    store_allocated = _allocated(store_dir / "data.mdb")
    shares = _device(store_dir) == _device(directory)
    needed = space_needed(size, store_max_size, store_allocated, reserve, shares)
    store_room = max(0, store_max_size - store_allocated) if shares else 0
    detail = (f"{size} bytes to write + {store_room} bytes the store may still grow into "
              f"(max_size {store_max_size}, data.mdb holds {store_allocated}"
              f"{'' if shares else '; on another file system, not counted'}) + reserve {reserve} = "
              f"{needed} bytes needed, {free} free in {directory}")
    return free >= needed, detail


def _space_ok(settings_reserve: int, run: PullRun, download_dir: Path, manifest: Manifest, have: int) -> bool:
    fits, detail = room_for(manifest.size - have, download_dir, run.store_dir, run.store_max_size, settings_reserve)
    if not fits:
        log.error("not downloading version %s: too little free space: %s", manifest.version, detail)
        return False
    log.info("free space: %s", detail)
    return True


def _run_command(argv: Sequence[str], what: str) -> bool:
    log.info("%s: %s", what, " ".join(argv))
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError as exc:
        log.error("%s failed: cannot run %s: %s", what, argv[0], exc.strerror or exc)
        return False
    for line in (proc.stdout + proc.stderr).splitlines()[-20:]:
        log.info("%s: | %s", what, line)
    if proc.returncode != 0:
        log.error("%s failed: %s exited %d", what, argv[0], proc.returncode)
        return False
    return True


def _window_text(settings: UpdateSettings, now: datetime.datetime) -> str | None:
    """None inside the window (or without one), else when it opens."""
    window = settings.maintenance_window
    if window is None or window.contains(now):
        return None
    opening = window.next_opening(now)
    minutes = int((opening - now).total_seconds() // 60)
    return (f"the maintenance window {window} opens at {opening:%Y-%m-%d %H:%M} (in {minutes // 60}h "
            f"{minutes % 60:02d}m)")


def pull(settings: UpdateSettings, run: PullRun) -> int:
    """One run; returns the exit code (:data:`EXIT_CODES`)."""
    if not settings.enabled:
        log.info("pull is off: gateway.toml has no [update] manifest_url")
        return EXIT_OK
    assert settings.manifest_url is not None
    download_dir = Path(settings.download_dir) if settings.download_dir else run.state_dir / "download"
    run.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    download_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(run.state_dir) as mine:
        if not mine:
            log.error("another pull is running (%s is locked)", run.state_dir / "lock")
            return EXIT_BUSY
        return _pull(settings, run, settings.manifest_url, download_dir)


def _pull(settings: UpdateSettings, run: PullRun, manifest_url: str, download_dir: Path) -> int:
    release = _read_text(run.release_file)
    installed = (parse_key_values(release).get("VERSION") or None) if release is not None else None
    if installed is None:
        log.warning("no VERSION= in %s: the installed version is unknown", run.release_file)
    boot_id = (_read_text(run.boot_id_file) or "").strip()
    waiting = _records(run, installed, boot_id)

    try:
        opener = make_opener(client_context(settings))
    except UpdateTlsError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    try:
        body = fetch_manifest(opener, manifest_url, _TIMEOUT)
        manifest = parse_manifest(body, manifest_url, settings.max_bundle_size)
    except FetchError as exc:
        log.error("manifest: %s", exc)
        return EXIT_FAILED
    except ManifestError as exc:
        log.error("manifest %s: %s", manifest_url, exc)
        return EXIT_MANIFEST
    decision = decide(manifest, run.compatible, installed, _rejected(run.state_dir))
    log.info("manifest %s: %s", manifest_url, decision.reason)
    if decision.action is not Action.INSTALL:
        _clean_downloads(download_dir, None)
        return EXIT_OK

    if waiting is not None and waiting.version == manifest.version:
        # installed in this boot already; only the reboot is missing (it failed, or was outside the window)
        later = _window_text(settings, run.now)
        if later is not None:
            log.info("version %s is installed and waits for a reboot: %s", manifest.version, later)
            return EXIT_OK
        return EXIT_OK if _run_command(run.reboot_command, "reboot") else EXIT_REBOOT

    _clean_downloads(download_dir, manifest.sha256)
    bundle = download_dir / manifest.bundle_name
    part = download_dir / f"{manifest.bundle_name}.part"
    fresh = False
    if not bundle.exists():
        have = part.stat().st_size if part.exists() else 0
        if not _space_ok(settings.reserve, run, download_dir, manifest, min(have, manifest.size)):
            return EXIT_SPACE
        log.info("downloading version %s (%d bytes) from %s to %s%s", manifest.version, manifest.size, manifest.url,
                 part, f", resuming at byte {have}" if 0 < have < manifest.size else "")
        try:
            download(opener, manifest.url, part, manifest.size, _TIMEOUT)
        except FetchError as exc:
            log.error("bundle: %s", exc)
            return EXIT_FAILED
        fresh = True
        if not _verified(part, manifest):
            return EXIT_CHECKSUM
        os.replace(part, bundle)
        _fsync_dir(download_dir)
        log.info("version %s downloaded and verified: %s", manifest.version, bundle)

    later = _window_text(settings, run.now)
    if later is not None:
        log.info("version %s is ready in %s; it is installed and the gateway rebooted in the window: %s",
                 manifest.version, bundle, later)
        return EXIT_OK
    # a bundle from an earlier run is checked again: the data partition is not the root's read-only file system
    if not fresh and not _verified(bundle, manifest):
        return EXIT_CHECKSUM
    if not _run_command([*run.install_command, str(bundle)], "install"):
        return EXIT_INSTALL
    _write_atomically(run.state_dir / "pending", Pending(manifest.version, boot_id).dump())
    bundle.unlink()
    log.info("version %s installed into the other slot; rebooting into it", manifest.version)
    return EXIT_OK if _run_command(run.reboot_command, "reboot") else EXIT_REBOOT


def _verified(path: Path, manifest: Manifest) -> bool:
    size = path.stat().st_size
    digest = file_sha256(path) if size == manifest.size else None
    if digest == manifest.sha256:
        return True
    path.unlink()
    log.error("bundle %s: %s; the file was deleted", path,
              f"SHA-256 {digest} does not match the manifest's {manifest.sha256}" if digest is not None
              else f"{size} bytes, the manifest says {manifest.size}")
    return False
