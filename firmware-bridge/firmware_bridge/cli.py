"""The ``firmware-bridge`` command (also ``python -m firmware_bridge``)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading

from firmware_bridge import __version__
from firmware_bridge.config import DEFAULT_CONFIG, ConfigError, read_config

EXIT_CONFIG = 78  # EX_CONFIG, as edge-gateway: systemd units can refuse to restart on it

DESCRIPTION = f"""\
firmware-bridge {__version__}: sensor boards on serial ports -> MQTT (the edge-gateway broker), commands back.

  firmware-bridge run [--config PATH]      bridge the ports listed in PATH (default {DEFAULT_CONFIG})
  firmware-bridge check-config PATH        validate a config file; every bad key is named
  firmware-bridge simulate [--link PATH]   a fake sensor board on a pseudo-terminal (prints its path)
  firmware-bridge simulate --modbus        a simulated Modbus RTU energy meter (Eastron SDM120 map) instead

Wire format: firmware-bridge/PROTOCOL.md. Published messages: docs/message-format.md.
"""

RUN_EPILOG = """\
Config file (TOML):

  [bridge]
  gateway_id = "gw-0001"            # sensors/<gateway_id>/<device>, cmd/<gateway_id>/<device>/<command>
  stats_interval = "10s"            # bridge/<gateway_id>/stats (retained)

  [mqtt]
  broker = "127.0.0.1:1884"         # the gateway's internal listener
  buffer = 10000                    # readings held while the broker is down (QoS 0 dropped first)

  [metrics]                         # Prometheus /metrics (off when absent): frames, ports, buffer, devices
  bind = "127.0.0.1:9884"

  [sparkplug]                       # also a Sparkplug B Edge Node (off when absent; README "Sparkplug B")
  group_id = "plant-1"              # spBv1.0/plant-1/NBIRTH/<gateway_id>, .../DDATA/<gateway_id>/<device>
  primary_host_id = ""              # wait for spBv1.0/STATE/<id> online before the births

  [[ports]]
  path = "/dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"
  baudrate = 115200
  protocol = "line-json"            # or "nmea" (then device = "..." is required)
  qos = 1

  [[ports]]                         # Modbus RTU on RS-485 (firmware-bridge/PROTOCOL.md, "Modbus RTU")
  path = "/dev/serial/by-id/usb-FTDI_..._if00-port0"
  protocol = "modbus-rtu"
  baudrate = 9600
  parity = "even"
  [[ports.devices]]
  name = "meter-1"                  # sensors/<gateway_id>/meter-1
  unit = 1
  [[ports.devices.groups]]
  interval = "10s"
  registers = [{ name = "voltage", address = "30001", type = "float32", unit = "V" }]

Signals: SIGTERM/SIGINT stop: the ports close, what is buffered gets 2 s to reach the broker, exit 0.
SIGUSR1 writes every thread's stack to the log (for a bridge that seems stuck).
Exit codes: 0 clean stop, 78 the configuration is invalid.
"""


def _setup_logging(level: str) -> None:
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr, force=True)
    logging.getLogger("firmware_bridge.paho").setLevel(logging.WARNING)
    # pymodbus logs every timeout as an ERROR with a dump of the line; the bridge counts and reports faults itself
    logging.getLogger("pymodbus").setLevel(logging.DEBUG if level == "debug" else logging.CRITICAL)


def _cmd_run(args: argparse.Namespace) -> int:
    from firmware_bridge.bridge import serve

    try:
        cfg = read_config(args.config)
    except ConfigError as exc:
        print(f"firmware-bridge: invalid configuration {exc.source}:", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return EXIT_CONFIG
    _setup_logging(args.log_level or cfg.log_level)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack on stderr
    asyncio.run(serve(cfg))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        cfg = read_config(args.path)
    except ConfigError as exc:
        print(f"{exc.source}: invalid", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{args.path}: ok (gateway {cfg.gateway_id}, broker {cfg.mqtt.broker}, {len(cfg.ports)} port(s))")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from firmware_bridge import simulator

    _setup_logging(args.log_level or "info")
    if args.modbus:
        from firmware_bridge import modbus_sim

        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        return modbus_sim.run_demo(args.link, args.unit, 1.0 / args.rate, stop)
    try:
        simulator.load_b01_series()
    except RuntimeError as exc:
        print(f"firmware-bridge simulate: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    faults = {"garbage": args.garbage, "bad_crc": args.bad_crc, "too_long": args.too_long}
    return simulator.run(
        args.device,
        args.link,
        args.rate,
        args.boot,
        args.start,
        args.count,
        faults,
        args.unplug_every,
        args.reboot_every,
        args.seed,
        stop,
    )


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError("a number of readings per second, 0 < rate <= 1000")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("a probability 0..1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="firmware-bridge", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"firmware-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="bridge the configured serial ports to MQTT",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML file (default {DEFAULT_CONFIG})")
    run.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="override bridge.log_level")
    run.set_defaults(func=_cmd_run)
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("path")
    check.set_defaults(func=_cmd_check)
    sim = sub.add_parser("simulate", help="a fake sensor board on a pseudo-terminal (NERACOOS buoy B01 data)")
    sim.add_argument("--link", help="keep this symlink pointing at the pty (like /dev/serial/by-id/...)")
    sim.add_argument("--device", default="buoy-b01", help="device id (default buoy-b01)")
    sim.add_argument("--rate", type=_positive, default=1.0, help="readings per second (default 1)")
    sim.add_argument("--boot", type=int, default=1, help="boot counter of the first boot (default 1)")
    sim.add_argument("--start", type=int, default=0, help="first row of the series (default 0)")
    sim.add_argument("--count", type=int, default=0, help="stop after this many readings (default: never)")
    sim.add_argument("--garbage", type=_probability, default=0.0, help="probability of binary noise per reading")
    sim.add_argument("--bad-crc", type=_probability, default=0.0, help="probability of a CRC error per reading")
    sim.add_argument("--too-long", type=_probability, default=0.0, help="probability of an over-long line")
    sim.add_argument("--unplug-every", type=float, default=0.0, help="unplug for 2 s every N seconds")
    sim.add_argument("--reboot-every", type=float, default=0.0, help="reboot (boot+1, seq 0) every N seconds")
    sim.add_argument("--seed", type=int, help="random seed for the faults")
    sim.add_argument(
        "--modbus",
        action="store_true",
        help="a Modbus RTU slave instead: an Eastron SDM120 energy meter (its published register map, simulated "
        "values; 2400 bit/s, no parity); --rate is how often its values change",
    )
    sim.add_argument("--unit", type=int, default=1, choices=range(1, 248), metavar="1..247", help="its unit id")
    sim.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    sim.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
