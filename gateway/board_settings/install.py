"""Install per-board settings on the data partition; the thin I/O layer around :mod:`gateway.board_settings.model`.

The settings directory (``/var/lib/edge-gateway/settings`` on a gateway, README "Per-board settings")::

    current -> gen-20261127T101500Z-3f2a     the applied generation (one symlink, replaced by rename)
    previous -> gen-...                      the one before (the services read it until they restart)
    gen-20261127T101500Z-3f2a/
        gateway.toml          root:edge-gateway 0640     merged over /etc/edge-gateway/gateway.toml
        bridge.toml           root:firmware-bridge 0640  merged over /etc/firmware-bridge/bridge.toml
        files/                root:edge-gateway 0750     [files], each root:edge-gateway 0640
        authorized_keys       root 0644                  [access] ssh_authorized_keys (absent: no SSH server)
        edge-gateway.env      root 0644                  EDGE_GATEWAY_CONFIG=.../gateway.toml (the unit's
        firmware-bridge.env   root 0644                  FIRMWARE_BRIDGE_CONFIG=.../bridge.toml  EnvironmentFile=)
        settings.toml         root 0600                  the settings file as applied (re-merged after an update)
        applied.json          root 0644                  where it came from, when, and the digests

A new generation is written beside ``current`` under its final name, so the paths checked are the paths the services
read; it is checked with the loaders ``edge-gateway check-config`` and ``firmware-bridge check-config`` run, and only
then does ``current`` move to it. A rejected or interrupted one is deleted; ``current`` never points at a
generation that was not checked whole.
"""

from __future__ import annotations

import contextlib
import datetime
import grp
import json
import os
import pwd
import re
import secrets as random_names
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.board_settings.model import (
    PLACEHOLDER,
    SettingsError,
    digest,
    dump_toml,
    plan,
    read_settings,
    redact,
    settings_digest,
)

GATEWAY_ENV = "EDGE_GATEWAY_CONFIG"
BRIDGE_ENV = "FIRMWARE_BRIDGE_CONFIG"
#: The data partition's mount point is the broker's StateDirectory=: systemd gives it this mode at each start
#: (edge-gateway.service StateDirectoryMode=), and apply gives it the same before the broker ever starts.
STATE_DIR_MODE = 0o751


@dataclass(frozen=True, slots=True)
class Owners:
    """Who may read what: the broker's and the bridge's group ids, and the broker's user, which owns the data
    partition's top directory (its StateDirectory=)."""

    broker_uid: int
    broker_gid: int
    bridge_gid: int

    @classmethod
    def of(cls, broker_user: str, bridge_user: str) -> Owners:
        """The owners for two system users.

        Raises:
            SettingsError: a user that does not exist."""
        try:
            broker = pwd.getpwnam(broker_user)
        except KeyError:
            raise SettingsError([f"--broker-user {broker_user}: no such user"]) from None
        try:
            bridge = pwd.getpwnam(bridge_user)
        except KeyError:
            raise SettingsError([f"--bridge-user {bridge_user}: no such user"]) from None
        return cls(broker.pw_uid, broker.pw_gid, bridge.pw_gid)


@dataclass(slots=True)
class Outcome:
    """What one run did. ``status``: ``"applied"``, ``"unchanged"`` (the same settings over the same image
    configuration are already current), ``"nothing"`` (no settings to apply) or ``"rejected"`` (``errors`` says
    why; nothing changed)."""

    status: str
    errors: list[str] = field(default_factory=list)
    generation: Path | None = None
    summary: str = ""


def read_base(path: Path, errors: list[str]) -> dict[str, Any] | None:
    """The image's configuration file at ``path`` as data; ``None`` when it does not exist."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        errors.append(f"{path}: the image's configuration cannot be read: {exc}")
        return None


def apply(text: str, source: str, etc_dir: Path, settings_dir: Path, owners: Owners | None) -> Outcome:
    """Apply the settings file ``text`` (read from ``source``, for messages) over the image's configuration in
    ``etc_dir``: a new generation in ``settings_dir``, checked, then made ``current``. ``owners=None`` leaves
    ownership to the caller's user (``settings check``).

    Raises:
        OSError: the settings directory cannot be written (the previous settings stay).
    """
    try:
        settings, mistakes = read_settings(text)
    except SettingsError as exc:
        return Outcome("rejected", exc.errors)
    errors: list[str] = []
    gateway_base = read_base(etc_dir / "edge-gateway" / "gateway.toml", errors) or {}
    bridge_base = read_base(etc_dir / "firmware-bridge" / "bridge.toml", errors)
    if errors:
        return Outcome("rejected", errors)
    base = digest(gateway_base, bridge_base)
    wanted = settings_digest(settings)
    current = _applied(settings_dir / "current")
    if current.get("settings_digest") == wanted and current.get("base_digest") == base:
        return Outcome("unchanged", generation=(settings_dir / "current").resolve())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    created_dir = not settings_dir.exists()
    # 0755 whatever the umask (the unit runs with UMask=0077): the services' users pass through to their files
    settings_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    if created_dir:
        os.chmod(settings_dir, 0o755)
    generation = settings_dir / f"gen-{stamp}-{random_names.token_hex(2)}"
    generation.mkdir(mode=0o755)
    os.chmod(generation, 0o755)
    try:
        made, more = plan(settings, gateway_base, bridge_base, str(generation / "files"))
        _write_generation(generation, made, text, owners, {
            "source": source, "applied_at": stamp, "settings_digest": wanted, "base_digest": base})
        problems = mistakes + more + _check(generation)
        if problems:
            raise _Rejected(problems)
    except _Rejected as exc:
        _discard(generation, settings_dir if created_dir else None)
        return Outcome("rejected", [redact(line, settings.secrets()) for line in exc.errors])
    except BaseException:
        _discard(generation, settings_dir if created_dir else None)
        raise
    if owners is not None:
        claim_state_dir(settings_dir.parent, owners)
    _make_current(settings_dir, generation)
    parts = ["gateway.toml"] + ["bridge.toml"] * (made.bridge is not None)
    if made.files:
        parts.append(f"[files] {', '.join(made.files)}")
    keys = len(settings.ssh_authorized_keys)
    parts.append(f"SSH: {keys} operator key(s)" if keys else "no SSH server")
    return Outcome("applied", generation=generation, summary="; ".join(parts))


def reapply(etc_dir: Path, settings_dir: Path, owners: Owners | None) -> Outcome:
    """Merge the current settings again when the image's configuration changed under them (a new root after an
    update): ``"nothing"`` when there are no settings or nothing changed; a failure keeps the current generation."""
    current = settings_dir / "current"
    try:
        text = (current / "settings.toml").read_text(encoding="utf-8")
    except FileNotFoundError:
        return Outcome("nothing")
    outcome = apply(text, str(current / "settings.toml"), etc_dir, settings_dir, owners)
    if outcome.status == "unchanged":
        outcome.status = "nothing"
    return outcome


def claim_state_dir(path: Path, owners: Owners) -> None:
    """Give the data partition's top directory the broker's user, group and mode, as the broker's StateDirectory=
    would at its start. systemd changes the owner of everything below a StateDirectory= whose top it finds owned
    by someone else (systemd.exec(5)); owned right, it leaves the tree alone, and with it the settings' owners."""
    st = path.stat()
    if (st.st_uid, st.st_gid) != (owners.broker_uid, owners.broker_gid):
        os.chown(path, owners.broker_uid, owners.broker_gid)
        os.chmod(path, STATE_DIR_MODE)


class _Rejected(Exception):
    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))


def _applied(current: Path) -> dict[str, Any]:
    try:
        return json.loads((current / "applied.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_generation(generation: Path, made: Any, text: str, owners: Owners | None,
                      applied: dict[str, Any]) -> None:
    broker = owners.broker_gid if owners else os.getgid()
    bridge = owners.bridge_gid if owners else os.getgid()
    files = generation / "files"
    files.mkdir(mode=0o700)
    os.chown(files, os.getuid(), broker)
    os.chmod(files, 0o750)
    for name, content in made.files.items():
        _write(files / name, content, broker, 0o640)
    header = ("# Written by `edge-gateway settings apply`: the board's settings merged over the image's\n"
              "# {} (README \"Per-board settings\"). Change the settings, not this file.\n")
    _write(generation / "gateway.toml", header.format("/etc/edge-gateway/gateway.toml") + dump_toml(made.gateway),
           broker, 0o640)
    env = {GATEWAY_ENV: generation / "gateway.toml"}
    if made.bridge is not None:
        _write(generation / "bridge.toml",
               header.format("/etc/firmware-bridge/bridge.toml") + dump_toml(made.bridge), bridge, 0o640)
        env[BRIDGE_ENV] = generation / "bridge.toml"
    if made.authorized_keys is not None:
        _write(generation / "authorized_keys", made.authorized_keys, os.getgid(), 0o644)
    units = {GATEWAY_ENV: "edge-gateway", BRIDGE_ENV: "firmware-bridge"}
    for name, path in env.items():
        _write(generation / f"{units[name]}.env", f"# {units[name]}.service's configuration (edge-gateway "
                                                  f'settings apply)\n{name}="{path}"\n', os.getgid(), 0o644)
    _write(generation / "settings.toml", text, os.getgid(), 0o600)
    _write(generation / "applied.json", json.dumps(applied, indent=2) + "\n", os.getgid(), 0o644)
    _fsync_dir(files)
    _fsync_dir(generation)


def _write(path: Path, content: str, gid: int, mode: int) -> None:
    """A new file of this process's user, its group and mode set before any byte is in it (a secret is never
    readable by others), synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, os.getuid(), gid)
        os.fchmod(fd, mode)
        os.write(fd, content.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


_KEY_FIRST = re.compile(r"^[A-Za-z_][\w-]*(\[\d+\])?[.\[ =:]")


def _check(generation: Path) -> list[str]:
    """Every mistake of the merged files, from the loaders `edge-gateway check-config` and `firmware-bridge
    check-config` run (they also read the TLS, password and ACL files), with the keys named as in the settings file
    (``gateway.listeners.external.bind``) and the generation's files directory shown as ``{settings}``."""
    # imported here: firmware_bridge is the appliance's other program (the same distribution); the broker itself
    # never imports it
    from firmware_bridge.config import ConfigError as BridgeConfigError
    from firmware_bridge.config import read_config as read_bridge_config

    from gateway.server.config import ConfigError, read_config

    problems: list[str] = []
    try:
        read_config(generation / "gateway.toml")
    except ConfigError as exc:
        problems.extend(_named("gateway", line) for line in exc.errors)
    if (generation / "bridge.toml").exists():
        try:
            read_bridge_config(generation / "bridge.toml")
        except BridgeConfigError as exc:
            problems.extend(_named("bridge", line) for line in exc.errors)
    files_dir = str(generation / "files")
    return [line.replace(files_dir, PLACEHOLDER) for line in problems]


def _named(section: str, line: str) -> str:
    return f"{section}.{line}" if _KEY_FIRST.match(line) else f"{section}: {line}"


def _discard(generation: Path, created_settings_dir: Path | None) -> None:
    shutil.rmtree(generation, ignore_errors=True)
    if created_settings_dir is not None:
        with contextlib.suppress(OSError):
            created_settings_dir.rmdir()


def _make_current(settings_dir: Path, generation: Path) -> None:
    """``current`` -> ``generation`` by one rename (atomic), ``previous`` -> the one before; older generations and
    leftovers of an interrupted run are deleted."""
    current = settings_dir / "current"
    before = os.readlink(current) if current.is_symlink() else None
    _replace_link(settings_dir, "current", generation.name)
    if before is not None and before != generation.name:
        _replace_link(settings_dir, "previous", before)
    keep = {generation.name, before}
    for entry in settings_dir.iterdir():
        if entry.name.startswith("gen-") and entry.name not in keep and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    _fsync_dir(settings_dir)


def _replace_link(directory: Path, name: str, target: str) -> None:
    tmp = directory / f".{name}.new"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, directory / name)
    _fsync_dir(directory)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (vfat on old kernels) refuse fsync on a directory; the rename is still done
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ the settings file


def rejected_names(path: Path) -> tuple[Path, Path]:
    """Where a rejected settings file goes and where its errors are written, beside it:
    ``edge-gateway-settings.toml`` -> ``edge-gateway-settings.toml.rejected``, ``edge-gateway-settings.errors.txt``."""
    return path.with_name(path.name + ".rejected"), path.with_name(f"{path.stem}.errors.txt")


def settle_file(path: Path, outcome: Outcome, remount: bool) -> list[str]:
    """After a run: remove an applied (or unchanged) settings file, with a stale ``.rejected`` and errors file
    beside it; rename a rejected one to ``.rejected`` and write its errors beside it. ``remount``: the directory is
    a read-only mount (the boot partition), made writable only for this and read-only again. Returns what was done,
    one line each."""
    rejected, errors_file = rejected_names(path)
    done: list[str] = []
    with _writable(path.parent, remount):
        if outcome.status == "rejected":
            os.replace(path, rejected)
            fd = os.open(errors_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(f"{path.name} was rejected; the gateway kept its previous settings.\n"
                          "Fix these, rename the file back to its name and boot again (README \"Per-board "
                          "settings\"):\n\n")
                out.writelines(f"{line}\n" for line in outcome.errors)
                out.flush()
                os.fsync(out.fileno())
            done.append(f"renamed to {rejected.name}; the errors are in {errors_file.name}")
        else:
            path.unlink()
            for stale in (rejected, errors_file):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            done.append(f"removed {path}")
        _fsync_dir(path.parent)
    return done


@contextlib.contextmanager
def _writable(directory: Path, remount: bool) -> Iterator[None]:
    if not remount or not os.statvfs(directory).f_flag & os.ST_RDONLY:
        yield
        return
    subprocess.run(["mount", "-o", "remount,rw", str(directory)], check=True, capture_output=True, text=True)
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=False, capture_output=True)


# ------------------------------------------------------------------------------------------ SSH host keys

HOST_KEY_TYPES = ("ed25519", "ecdsa")


def ensure_host_keys(directory: Path) -> list[Path]:
    """SSH host keys in ``directory`` (root 0700; ``ssh_host_ed25519_key``, ``ssh_host_ecdsa_key`` and their
    ``.pub``), generated with ``ssh-keygen`` where missing and never replaced: a board keeps its host keys for as
    long as its data partition. A key is made under a temporary name and renamed, so a power cut leaves a whole key
    or none. Returns the keys made.

    Raises:
        subprocess.CalledProcessError: ssh-keygen failed.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    made: list[Path] = []
    for kind in HOST_KEY_TYPES:
        key = directory / f"ssh_host_{kind}_key"
        public = directory / f"ssh_host_{kind}_key.pub"
        if key.exists() and public.exists():
            continue
        tmp = directory / f".ssh_host_{kind}_key.new"
        for leftover in (tmp, tmp.with_name(tmp.name + ".pub")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "edge-gateway host key", "-f", str(tmp)],
                       check=True, capture_output=True, text=True)
        for made_file in (tmp, tmp.with_name(tmp.name + ".pub")):
            fd = os.open(made_file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp.with_name(tmp.name + ".pub"), public)
        os.replace(tmp, key)
        made.append(key)
    _fsync_dir(directory)
    return made


def group_name(gid: int) -> str:
    """A group's name for messages (its number when it has none)."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
