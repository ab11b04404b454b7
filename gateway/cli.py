"""The ``edge-gateway`` command (also ``python -m gateway``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import textwrap
from collections.abc import Callable

from gateway import __version__, native
from gateway.server.config import DEFAULT_BIND, ConfigError, GatewayConfig, read_config

EXIT_CONFIG = 78  # EX_CONFIG (sysexits.h): systemd units can refuse to restart on it
EXIT_BIND = 1
EXIT_STORE = 74  # EX_IOERR: the store cannot be opened (on_corrupt = "refuse") or is locked

DESCRIPTION = f"""\
edge-gateway {__version__}: an MQTT 3.1.1 + 5.0 broker for field gateways.

Quick start:
  edge-gateway serve                      serve on {DEFAULT_BIND} with the built-in defaults
  edge-gateway serve --config gw.toml     serve the listeners in gw.toml
  edge-gateway check-config gw.toml       validate a config file; every bad key is named
  edge-gateway passwd FILE USER           add a user to a Mosquitto password file (prompts)
  edge-gateway settings check FILE        check a board's settings file (edge-gateway-settings.toml)
  edge-gateway update pull --help         the opt-in pull of A/B root updates ([update] in gateway.toml)

Try it (with mosquitto-clients installed):
  mosquitto_sub -h 127.0.0.1 -t 'sensors/#' -v &
  mosquitto_pub -h 127.0.0.1 -t sensors/demo -m hello
"""

SERVE_EPILOG = """\
Config file (TOML), e.g. /etc/edge-gateway/gateway.toml:

  [broker]
  sys_interval = "10s"            # $SYS/broker/... updates; 0 = off
  log_level = "info"              # debug, info, warning, error

  [store]                         # LMDB: persistent sessions, queues, retained messages, upstream outbox
  path = "/var/lib/edge-gateway/store"  # default $STATE_DIRECTORY/store under systemd, else ./var
  max_size = "1GB"                # new QoS 1/2 work is refused before the store is full
  mqueue_mem_len = 1000           # queued messages of a persistent session kept in memory; the rest
                                  # wait only in the store and are read back as the queue drains

  [listeners.external]            # zone limits follow EMQX's names and defaults
  bind = "0.0.0.0:8883"           # "host:port" or a Unix socket path
  certfile = "/etc/edge-gateway/tls/server.crt"   # TLS (README "TLS")
  keyfile = "/etc/edge-gateway/tls/server.key"
  password_file = "/etc/edge-gateway/passwd"      # mosquitto_passwd / edge-gateway passwd; anonymous
                                  # clients are refused on a non-loopback bind (README "Security")
  max_inflight = 32               # Inflight Window; an MQTT 5 Receive Maximum caps it
  max_mqueue_len = 1000           # Message Queue; when full the oldest (QoS 0 first) is dropped
  mqueue_store_qos0 = true        # queue QoS 0 for offline persistent sessions
  session_expiry_interval = "2h"  # longest a session outlives its connection
  message_expiry_interval = "5m"  # how long a queued message waits; 0 = forever

  [listeners.internal]
  bind = "127.0.0.1:1884"         # internal zone defaults: max_inflight 128, max_mqueue_len 10000

  [metrics]                       # Prometheus /metrics (off when absent); loopback unless scraped remotely
  bind = "127.0.0.1:9883"

Signals: SIGTERM/SIGINT stop accepting, send DISCONNECT 0x8B to MQTT 5 clients and exit 0.
Exit codes: 0 clean stop, 1 a listener could not bind, 78 the configuration is invalid.
"""


def _setup_logging(level: str) -> None:
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"  # journald adds the time
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr, force=True)


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for (or "auto" and installed: the ``fast`` extra), else asyncio's."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            logging.getLogger("gateway").warning("broker.event_loop = \"uvloop\" but uvloop is not installed; "
                                                 "using asyncio's loop (pip install 'edge-gateway[fast]')")
        return None
    return uvloop.new_event_loop


def _read_config(path: str | None) -> GatewayConfig | None:
    """The configuration at ``path``, or None once every error in it is printed (the caller exits 78)."""
    try:
        return read_config(path)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"edge-gateway: {exc.source}: {line}", file=sys.stderr)
        return None


def _cmd_version(args: argparse.Namespace) -> int:
    """``edge-gateway VERSION`` alone on its line, as ``--version`` prints it; with ``--verbose`` a second line says
    how the MQTT codec and the broker core run: ``core: compiled (mypyc)`` or ``core: pure Python (<why>)``
    (gateway/native.py; ``EDGE_GATEWAY_PURE=1`` asks for the pure-Python one)."""
    print(f"edge-gateway {__version__}")
    if args.verbose:
        print(f"core: {native.select().describe()}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server.runner import BindError, serve
    from gateway.store.lmdb_store import StoreError

    config = _read_config(args.config)
    if config is None:
        return EXIT_CONFIG
    _setup_logging(args.log_level or config.log_level)
    try:
        with asyncio.Runner(loop_factory=_loop_factory(config.event_loop)) as runner:
            runner.run(serve(config))
    except BindError as exc:
        print(f"edge-gateway: {exc}", file=sys.stderr)
        return EXIT_BIND
    except StoreError as exc:
        print(f"edge-gateway: {exc}", file=sys.stderr)
        return EXIT_STORE
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = read_config(args.path)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"{exc.source}: {line}", file=sys.stderr)
        print(f"{exc.source}: {len(exc.errors)} error(s)", file=sys.stderr)
        return 1
    for lc in config.listeners:
        tls = ""
        if lc.tls is not None:
            tls = f", TLS ({lc.tls.tls_version} minimum{', client certificates required' * lc.tls.require_certificate})"
        if lc.protocol == "websockets":
            tls += f", MQTT over WebSockets{' (wss)' if lc.tls is not None else ''} on path {lc.path}"
        print(f"listener {lc.name}: bind {lc.bind}, max_inflight {lc.limits.max_inflight}, "
              f"max_mqueue_len {lc.limits.max_mqueue_len}{tls}")
        print(f"listener {lc.name}: {lc.auth.describe()}")
    for up in config.upstreams:
        print(f"upstream {up.name}: {up.url} as {up.client_id!r}, {len(up.forward)} forward and {len(up.subscribe)} "
              f"subscribe rule(s), order {up.order}")
    if config.metrics_bind is not None:
        print(f"metrics: Prometheus /metrics on {config.metrics_bind}")
    if config.update.enabled:
        from gateway.update.settings import describe

        print(describe(config.update))
    print(f"{config.source}: OK")
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    from gateway.store import tools
    from gateway.store.lmdb_store import StoreError

    config = _read_config(args.config)
    if config is None:
        return EXIT_CONFIG
    try:
        if args.action == "stats":
            return tools.stats(config.store, as_json=args.json)
        if args.action == "inspect":
            return tools.inspect(config.store)
        return tools.compact(config.store)
    except (StoreError, FileNotFoundError) as exc:
        print(f"edge-gateway store {args.action}: {exc}", file=sys.stderr)
        return 1


UPDATE_PULL_EPILOG = """\
What one run does (the timer edge-gateway-update.timer runs it; README "Pull updates"):
  1. fetches [update] manifest_url over HTTPS (verified against ca_file, else the system's CAs):
       {"version": "1.4.2", "compatible": "edge-gateway-arm64", "size": 187695104,
        "url": "edge-gateway-1.4.2-arm64.raucb", "sha256": "<64 hex digits>"}
     (url absolute or relative to the manifest, https only);
  2. does nothing when it is for another compatible, the installed version (VERSION= in the release file), an
     older one, or a version that rolled back here before (rejected-<version> in the state directory);
  3. refuses to download unless the download directory's free space covers the rest of the bundle, the store's
     room up to [store] max_size, and [update] reserve;
  4. downloads <sha256>.raucb.part (resuming with HTTP Range), checks the SHA-256, renames it <sha256>.raucb;
  5. inside [update] maintenance_window (local time; none: any time) runs the install command with the bundle,
     then the reboot command; outside it keeps the bundle and says when the window opens.

Config:
  [update]
  manifest_url = "https://updates.example.net/edge-gateway/stable.json"
  ca_file = "/etc/edge-gateway/update-ca.crt"    # default: the system's CAs
  maintenance_window = "02:00-04:00"             # may cross midnight

Exit codes:
{codes}
"""


def _update_pull_epilog() -> str:
    from gateway.update.pull import EXIT_CODES

    codes = "\n".join(textwrap.fill(text, 116, initial_indent=f"  {code:>2}  ", subsequent_indent=" " * 6)
                      for code, text in EXIT_CODES.items())
    return UPDATE_PULL_EPILOG.replace("{codes}", codes)


def _cmd_update_pull(args: argparse.Namespace) -> int:
    import datetime
    import shlex
    from pathlib import Path

    from gateway.update.pull import EXIT_CONFIG, PullRun, default_compatible, pull
    from gateway.update.settings import STATE_DIR

    _setup_logging("info")
    config = _read_config(args.config)
    if config is None:
        return EXIT_CONFIG
    if args.now is None:
        now = datetime.datetime.now()
    else:
        try:
            now = datetime.datetime.fromisoformat(args.now)
        except ValueError:
            print(f"edge-gateway update pull: --now {args.now!r}: must be a local time such as 2026-05-01T03:00",
                  file=sys.stderr)
            return 2
        if now.tzinfo is not None:
            now = now.astimezone().replace(tzinfo=None)
    run = PullRun(
        compatible=args.compatible or default_compatible(),
        store_dir=Path(args.store_dir or config.store.path),
        store_max_size=config.store.max_size,
        now=now,
        install_command=shlex.split(args.install_command),
        reboot_command=shlex.split(args.reboot_command),
        release_file=Path(args.release_file),
        state_dir=Path(args.state_dir or STATE_DIR),
    )
    return pull(config.update, run)


def _cmd_update_enabled(args: argparse.Namespace) -> int:
    # ExecCondition= of edge-gateway-update.service: 0 runs the pull, 1..254 skips it quietly, 255 fails the unit
    config = _read_config(args.config)
    if config is None:
        return 255
    if config.update.enabled:
        print(f"update pull is on: {config.update.manifest_url}")
        return 0
    print(f"update pull is off: {config.source} has no [update] manifest_url")
    return 1


def _cmd_update_room(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gateway.update.pull import EXIT_CONFIG, room_for

    config = _read_config(args.config)
    if config is None:
        return EXIT_CONFIG
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"edge-gateway update room: --dir {directory}: not a directory", file=sys.stderr)
        return 2
    fits, detail = room_for(args.bytes, directory, Path(config.store.path), config.store.max_size,
                            config.update.reserve)
    print(f"{'room' if fits else 'no room'}: {detail}")
    return 0 if fits else 1


def _add_update_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    default_config = os.environ.get("EDGE_GATEWAY_CONFIG") or "/etc/edge-gateway/gateway.toml"
    update = sub.add_parser("update", help="pull A/B root updates from an HTTPS manifest (opt-in)",
                            description="Pull A/B root updates (RAUC bundles) from the HTTPS manifest named by "
                                        "[update] manifest_url in gateway.toml. Off unless it is set.")
    actions = update.add_subparsers(dest="update_command", metavar="ACTION", required=True)
    pull = actions.add_parser("pull", help="fetch the manifest; download, verify, install and reboot",
                              description="One run of the update timer: fetch the manifest, download a newer "
                                          "bundle for this gateway,\nverify it, and install it and reboot inside "
                                          "the maintenance window.",
                              epilog=_update_pull_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    pull.add_argument("--config", "-c", metavar="PATH", default=default_config,
                      help=f"gateway.toml with [update] and [store] (default: {default_config})")
    pull.add_argument("--release-file", metavar="PATH", default="/etc/edge-gateway-release",
                      help="holds VERSION= of the running system (default: %(default)s)")
    pull.add_argument("--state-dir", metavar="DIR", default=None,
                      help="records (last, pending, rejected-<version>, lock) and, unless [update] download_dir "
                           "says otherwise, download/ (default: /var/lib/edge-gateway/update)")
    pull.add_argument("--store-dir", metavar="DIR", default=None,
                      help="the broker's LMDB store whose room is kept free (default: [store] path)")
    pull.add_argument("--compatible", metavar="STRING", default=None,
                      help="this gateway's RAUC compatible (default: [system] compatible of /etc/rauc/system.conf, "
                           "else edge-gateway-<Debian architecture>)")
    pull.add_argument("--now", metavar="TIME", default=None,
                      help="the local time for the maintenance window check, ISO 8601 such as 2026-05-01T03:00 "
                           "(default: now)")
    pull.add_argument("--install-command", metavar="CMD", default="rauc install",
                      help="run with the verified bundle's path appended (default: %(default)s)")
    pull.add_argument("--reboot-command", metavar="CMD", default="systemctl reboot",
                      help="run after a successful install (default: %(default)s)")
    pull.set_defaults(func=_cmd_update_pull)
    enabled = actions.add_parser("enabled", help="exit 0 when [update] manifest_url is set, 1 when not",
                                 description="Exit 0 when gateway.toml sets [update] manifest_url, 1 when it does "
                                             "not, 255 when the file is invalid (the update unit's ExecCondition=).")
    enabled.add_argument("--config", "-c", metavar="PATH", default=default_config,
                         help=f"gateway.toml (default: {default_config})")
    enabled.set_defaults(func=_cmd_update_enabled)
    room = actions.add_parser("room", help="exit 0 when BYTES more fit beside the store's room, 1 when not",
                              description="The free-space rule of `update pull`, for a bundle copied some other "
                                          "way (ansible/update.yml): exit 0 when BYTES more fit in DIR beside the "
                                          "room the store may still grow into ([store] max_size) and [update] "
                                          "reserve, 1 when they do not; the figures are printed either way.")
    room.add_argument("bytes", type=int, metavar="BYTES", help="the size to be written, bytes")
    room.add_argument("--dir", metavar="DIR", default="/var/lib/edge-gateway/update",
                      help="where it is written (default: %(default)s)")
    room.add_argument("--config", "-c", metavar="PATH", default=default_config,
                      help=f"gateway.toml with [store] and [update] (default: {default_config})")
    room.set_defaults(func=_cmd_update_room)


def build_parser(serve_only: bool = False) -> argparse.ArgumentParser:
    """The argument parser (subcommands ``serve``, ``check-config``, ``store``, ``passwd``, ``settings``, ``update``,
    ``version``; ``serve`` alone with ``serve_only``: the other commands' modules are then not imported)."""
    parser = argparse.ArgumentParser(prog="edge-gateway", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"edge-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the broker", description="Run the MQTT broker.",
                           epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", "-c", metavar="PATH", default=os.environ.get("EDGE_GATEWAY_CONFIG") or None,
                       help=f"TOML config file (default: $EDGE_GATEWAY_CONFIG if set, else serve on {DEFAULT_BIND})")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override broker.log_level")
    serve.set_defaults(func=_cmd_serve)
    if serve_only:
        return parser
    check = sub.add_parser("check-config", help="validate a config file without starting",
                           description="Validate a config file; print every bad key and value; exit 1 if any.")
    check.add_argument("path", metavar="PATH")
    check.set_defaults(func=_cmd_check_config)
    store = sub.add_parser("store", help="look into or compact the LMDB store (broker stopped)",
                           description="Inspect or compact the durable store. Run these while the broker is "
                                       "stopped: the store is locked by a running broker. On a terminal they show "
                                       "progress on stderr (rows, bytes, rate, time left); when stderr is not a "
                                       "terminal, or under systemd, only their output.")
    store.add_argument("action", choices=["stats", "inspect", "compact"],
                       help="stats: sizes, sessions, queue depths, oldest message age; inspect: every session "
                            "and retained topic; compact: copy into a fresh file and swap it in when complete")
    store.add_argument("--config", "-c", metavar="PATH", help="config file naming [store] path (default ./var)")
    store.add_argument("--json", action="store_true", help="stats as JSON")
    store.set_defaults(func=_cmd_store)
    from gateway.auth import passwd_cli
    from gateway.board_settings import cli as settings_cli

    passwd_cli.add_parser(sub)
    settings_cli.add_parser(sub)
    _add_update_parser(sub)
    version = sub.add_parser("version", help="print the version (--verbose: and whether the core runs compiled)")
    version.add_argument("--verbose", "-v", action="store_true",
                         help="a second line, 'core: compiled (mypyc)' or 'core: pure Python (<why>)'")
    version.set_defaults(func=_cmd_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    if argv is None:
        argv = sys.argv[1:]
    # The broker is started as `edge-gateway serve ...`: it parses with serve's parser alone, so the settings, passwd
    # and update commands' modules (about 2 MiB of RSS) stay out of a running broker's memory.
    parser = build_parser(serve_only=argv[:1] == ["serve"])
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
