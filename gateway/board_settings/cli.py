"""``edge-gateway settings``: apply a board's settings file, check one, make the SSH host keys."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from gateway.board_settings.install import (
    Outcome,
    Owners,
    apply,
    ensure_host_keys,
    reapply,
    rejected_names,
    settle_file,
)
from gateway.board_settings.model import SETTINGS_FILE, SettingsError

EXIT_REJECTED = 78  # EX_CONFIG, as a bad gateway.toml
TAG = "edge-gateway settings"

DESCRIPTION = f"""\
Per-board settings (README "Per-board settings"): one image serves every board; what differs per board (gateway
id, upstream URL and credentials, TLS certificate and key, password and ACL files, serial ports, Modbus devices,
an operator's SSH key) comes from {SETTINGS_FILE}, dropped on the boot partition before the first boot
(or delivered by Ansible later).

  edge-gateway settings check FILE        check a settings file (on a laptop too); changes nothing
  edge-gateway settings apply             at boot (edge-gateway-settings.service): apply
                                          /boot/firmware/{SETTINGS_FILE} if it is there
  edge-gateway settings apply FILE        apply FILE (then it is removed); - reads the file from stdin
  edge-gateway settings host-keys         the SSH server's host keys, made once on the data partition

The file, in short:

  gateway_id = "gw-harbour-07"            # both programs' gateway id
  [gateway.listeners.external]            # merged over the image's /etc/edge-gateway/gateway.toml
  bind = "0.0.0.0:8883"
  certfile = "{{settings}}/server.crt"      # {{settings}}/NAME: the file NAME of [files]
  keyfile = "{{settings}}/server.key"
  password_file = "{{settings}}/passwd"
  [[gateway.upstream]]                    # arrays replace the image's
  name = "cloud"
  url = "mqtts://mqtt.example.net:8883"
  [[bridge.ports]]                        # merged over the image's /etc/firmware-bridge/bridge.toml
  path = "/dev/ttyUSB0"
  [files]
  "server.crt" = '''-----BEGIN CERTIFICATE-----
  ...'''
  [access]
  ssh_authorized_keys = ["ssh-ed25519 AAAA... op@laptop"]   # SSH for the account "operator", keys only
"""

APPLY_EPILOG = f"""\
What apply does: the file is merged over the image's gateway.toml and bridge.toml; the result and the [files] are
written to a new directory in the settings directory and checked with what `edge-gateway check-config` and
`firmware-bridge check-config` check (TLS files, password and ACL files too). Only when all is right does
SETTINGS_DIR/current point at it, and the services read it at their next start (edge-gateway.env and
firmware-bridge.env there name the configuration files). Then the file is removed.

A file with mistakes changes nothing: every mistake is printed (key, value, what is allowed; never a secret), the
file is renamed {SETTINGS_FILE}.rejected and the mistakes are written beside it in
{rejected_names(Path(SETTINGS_FILE))[1].name}; the exit code is {EXIT_REJECTED}.

With no file, apply merges the current settings again if the image's configuration changed (a new root after an
update); when that fails the current settings stay.

Exit codes: 0 applied, unchanged or nothing to do; {EXIT_REJECTED} rejected; 1 the settings directory or the file
could not be written.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``settings`` on the ``edge-gateway`` subcommand parser."""
    p = sub.add_parser("settings", help="apply or check a board's settings file (boot partition, Ansible)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ap = actions.add_parser("apply", help="apply the boot partition's settings file (or FILE)",
                            description="Apply a board's settings file.", epilog=APPLY_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", metavar="FILE", nargs="?",
                    help=f"the settings file (removed once applied); - for stdin; default: BOOT_DIR/{SETTINGS_FILE}")
    ap.add_argument("--boot-dir", type=Path, default=Path("/boot/firmware"),
                    help="the boot partition (default /boot/firmware)")
    _common(ap)
    ap.add_argument("--settings-dir", type=Path, default=Path("/var/lib/edge-gateway/settings"),
                    help="where applied settings live, on the data partition (default /var/lib/edge-gateway/settings)")
    ap.add_argument("--broker-user", default="edge-gateway",
                    help="the broker's user: its group reads gateway.toml and [files] (default edge-gateway)")
    ap.add_argument("--bridge-user", default="firmware-bridge",
                    help="firmware-bridge's user: its group reads bridge.toml (default firmware-bridge)")
    ap.add_argument("--remount-boot", action="store_true",
                    help="the file's directory is a read-only mount: remount it read-write only to remove or "
                         "rename the file, then read-only again (the unit does this for /boot/firmware)")
    ap.set_defaults(func=_cmd_apply)
    ck = actions.add_parser("check", help="check a settings file; changes nothing",
                            description="Check a settings file as apply would (merged over ETC_DIR's configuration, "
                                        "the [files] written to a temporary directory and read by the "
                                        "check-config code); nothing is installed.")
    ck.add_argument("file", metavar="FILE", help="the settings file; - for stdin")
    _common(ck)
    ck.set_defaults(func=_cmd_check)
    hk = actions.add_parser("host-keys", help="make the SSH host keys once (the SSH server's ExecStartPre=)",
                            description="Generate the SSH server's host keys (ed25519, ecdsa) with ssh-keygen "
                                        "where they are missing; existing keys are kept.")
    hk.add_argument("--dir", type=Path, default=Path("/var/lib/edge-gateway/ssh"),
                    help="where the keys live (default /var/lib/edge-gateway/ssh, on the data partition)")
    hk.set_defaults(func=_cmd_host_keys)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etc-dir", type=Path, default=Path("/etc"),
                   help="holds the image's edge-gateway/gateway.toml and firmware-bridge/bridge.toml (default /etc)")


def _say(line: str, err: bool = False) -> None:
    # the unit sends both streams to the journal and the console; the tag names us on the console
    print(f"{TAG}: {line}", file=sys.stderr if err else sys.stdout, flush=True)


def _report(outcome: Outcome, source: str) -> int:
    if outcome.status == "rejected":
        _say(f"REJECTED {source}: {len(outcome.errors)} mistake(s); the gateway keeps its previous settings", True)
        for line in outcome.errors:
            _say(f"  {line}", True)
        return EXIT_REJECTED
    if outcome.status == "applied":
        _say(f"applied {source}: {outcome.summary}; now {outcome.generation} (the services use it from their "
             "next start)")
    elif outcome.status == "unchanged":
        _say(f"unchanged: {source} is what is applied ({outcome.generation})")
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    try:
        owners = Owners.of(args.broker_user, args.bridge_user)
    except SettingsError as exc:
        _say(exc.errors[0], True)
        return 1
    path = None if args.file == "-" else Path(args.file) if args.file else args.boot_dir / SETTINGS_FILE
    try:
        if path is None:
            return _report(apply(sys.stdin.read(), "<stdin>", args.etc_dir, args.settings_dir, owners), "<stdin>")
        if args.file is None and not path.exists():
            outcome = reapply(args.etc_dir, args.settings_dir, owners)
            if outcome.status == "nothing":
                _say(f"nothing to apply: no {path}, and the applied settings match the image's configuration")
                return 0
            return _report(outcome, "the applied settings merged again over the image's new configuration")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            outcome = Outcome("rejected", ["the file is not UTF-8 text (save it as UTF-8)"])
        else:
            outcome = apply(text, str(path), args.etc_dir, args.settings_dir, owners)
        code = _report(outcome, str(path))
        for line in settle_file(path, outcome, args.remount_boot):
            _say(line, outcome.status == "rejected")
        return code
    except (OSError, subprocess.CalledProcessError) as exc:
        _say(f"cannot apply {path or '<stdin>'}: {_why(exc)}; the previous settings stay", True)
        return 1


def _cmd_check(args: argparse.Namespace) -> int:
    source = "<stdin>" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _say(f"cannot read {source}: {_why(exc)}", True)
        return 1
    with tempfile.TemporaryDirectory(prefix="edge-gateway-settings-check-") as tmp:
        outcome = apply(text, source, args.etc_dir, Path(tmp) / "settings", None)
    if outcome.status == "rejected":
        return _report(outcome, source)
    _say(f"{source}: OK ({outcome.summary})")
    return 0


def _cmd_host_keys(args: argparse.Namespace) -> int:
    try:
        made = ensure_host_keys(args.dir)
    except (OSError, subprocess.CalledProcessError) as exc:
        _say(f"cannot make the SSH host keys in {args.dir}: {_why(exc)}", True)
        return 1
    _say(f"made {', '.join(p.name for p in made)} in {args.dir}" if made else f"host keys in {args.dir}: kept")
    return 0


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{' '.join(map(str, exc.cmd))} exited {exc.returncode}: {(exc.stderr or '').strip()}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}{f' ({exc.filename})' if exc.filename else ''}"
    return str(exc)
