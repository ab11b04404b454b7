"""The ``edge-gateway`` command line: help, ``check-config``, ``serve`` exit codes and signals, ``version``.

The configuration is one TOML file, and `edge-gateway check-config FILE` validates it without starting (README,
"Configuration"); on SIGTERM the broker sends STOPPING=1, then drains and closes the store. Exit codes
(``serve --help``): 0 clean stop, 1 a listener could not bind, 78 the configuration is invalid. MQTT 5.0 §3.14.4: a
Server shutting down may send DISCONNECT with Reason Code 0x8B (Server shutting down) before it closes the Network
Connection.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers import BrokerProcess, RawClient

from gateway import __version__, native
from gateway.mqtt.packets import Disconnect

EDGE_GATEWAY = Path(sys.executable).parent / "edge-gateway"

GOOD = """
[broker]
sys_interval = "30s"
log_level = "warning"

[listeners.external]
bind = "127.0.0.1:1883"
max_inflight = 16
max_mqueue_len = 500
mqueue_store_qos0 = false
retry_interval = "30s"
session_expiry_interval = "2h"
message_expiry_interval = "5m"
await_rel_timeout = "7d"

[listeners.internal]
bind = "127.0.0.1:1884"
"""

BAD = """
[broker]
sys_interval = "1s"

[listeners.a]
bind = "localhost"
max_infligth = 5
max_inflight = -1

[listeners.b]
bind = "127.0.0.1:0"
max_inflight = 70000
session_expiry_interval = "5 minutes"
"""

_ALLOWED_LISTENER_KEYS = (
    "acl_file, allow_anonymous, await_rel_timeout, bind, cafile, capath, certfile, ciphers, connect_timeout, "
    "high_watermark, keyfile, "
    "max_awaiting_rel, max_clientid_len, max_connections, max_inflight, max_keepalive, max_mqueue_bytes, "
    "max_mqueue_len, max_packet_size, max_publish_rate, max_subscriptions, max_topic_length, max_topic_levels, "
    "message_expiry_interval, mqueue_store_qos0, password_file, path, protocol, "
    "require_certificate, retry_interval, send_timeout, session_expiry_interval, tls_version, topic_alias_maximum, "
    "use_identity_as_username, zone"
)

BAD_ERRORS = [
    "listeners.a.bind = 'localhost': must be \"host:port\" (port 0..65535) or a Unix socket path",
    f"listeners.a.max_infligth: unknown key; allowed: {_ALLOWED_LISTENER_KEYS}",
    "listeners.a.max_inflight = -1: must be an integer 0..65535 (0 = no limit)",
    "listeners.b.max_inflight = 70000: must be an integer 0..65535 (0 = no limit)",
    "listeners.b.session_expiry_interval = '5 minutes': must be a duration such as \"2h\" (0 = end on disconnect)",
]


def run(args: list[str], cwd: Path, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gateway ARGS`` in ``cwd`` and capture its output."""
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_edge_gateway_help_explains_usage(tmp_path: Path) -> None:
    """The `edge-gateway` console script explains its commands, a quick start and a try-it example."""
    assert EDGE_GATEWAY.exists()
    result = subprocess.run([str(EDGE_GATEWAY), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert result.stderr == ""
    out = result.stdout
    assert out.startswith("usage: edge-gateway ")
    for phrase in (f"edge-gateway {__version__}: an MQTT 3.1.1 + 5.0 broker", "serve", "run the broker",
                   "check-config", "validate a config file without starting", "version", "print the version",
                   "edge-gateway serve --config gw.toml", "edge-gateway check-config gw.toml",
                   "mosquitto_sub -h 127.0.0.1", "mosquitto_pub -h 127.0.0.1"):
        assert phrase in out, phrase
    # No subcommand: the same help on stdout and exit status 2.
    bare = run([], tmp_path)
    assert bare.returncode == 2
    assert bare.stdout == out


def test_serve_help_documents_config_signals_and_exit_codes(tmp_path: Path) -> None:
    """`serve --help` names the config file, the EMQX zone limits with their defaults, the
    SIGTERM behaviour (DISCONNECT 0x8B) and the exit codes."""
    result = subprocess.run([str(EDGE_GATEWAY), "serve", "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0
    out = result.stdout
    assert out.startswith("usage: edge-gateway serve ")
    for phrase in ("--config", "--log-level", "/etc/edge-gateway/gateway.toml", "[listeners.external]",
                   "max_inflight = 32", "Receive Maximum caps it", "max_mqueue_len = 1000", "QoS 0 first",
                   "mqueue_store_qos0 = true", 'session_expiry_interval = "2h"', 'message_expiry_interval = "5m"',
                   "max_inflight 128, max_mqueue_len 10000", "SIGTERM", "DISCONNECT 0x8B",
                   "0 clean stop", "1 a listener could not bind", "78 the configuration is invalid"):
        assert phrase in out, phrase


def test_check_config_good_file_exits_0_and_summarises_listeners(tmp_path: Path) -> None:
    """`edge-gateway check-config FILE` validates without starting; durations accept "30s", "5m", "2h", "7d"; a
    listener named "internal" gets the internal zone's defaults (EMQX's: ``max_inflight`` 128, ``max_mqueue_len``
    10000)."""
    path = tmp_path / "good.toml"
    path.write_text(GOOD)
    result = run(["check-config", str(path)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "listener external: bind 127.0.0.1:1883, max_inflight 16, max_mqueue_len 500",
        "listener external: anonymous allowed (default: loopback or Unix socket bind)",
        "listener internal: bind 127.0.0.1:1884, max_inflight 128, max_mqueue_len 10000",
        "listener internal: anonymous allowed (default: loopback or Unix socket bind)",
        f"{path}: OK",
    ]
    assert list(tmp_path.iterdir()) == [path]  # nothing started, no store created


def test_check_config_bad_file_exits_1_and_names_every_bad_key(tmp_path: Path) -> None:
    """config.py: every mistake is reported, each naming the key, the value and what is allowed: an unknown key,
    max_inflight = -1 and 70000 (allowed: 0..65535, 0 = no limit), a bad duration, a bad bind."""
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    result = run(["check-config", str(path)], tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"{path}: {line}" for line in BAD_ERRORS] + [f"{path}: 5 error(s)"]


@pytest.mark.parametrize(("text", "error"), [
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_inflight = \"32\"\n",
     "listeners.x.max_inflight = '32': must be an integer 0..65535 (0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmqueue_store_qos0 = 1\n",
     "listeners.x.mqueue_store_qos0 = 1: must be true or false"),
    ("[listeners.x]\nbind = \"127.0.0.1:70000\"\n",
     "listeners.x.bind = '127.0.0.1:70000': must be \"host:port\" (port 0..65535) or a Unix socket path"),
    ("[listeners.x]\nmax_inflight = 1\n", "listeners.x.bind: missing; give \"host:port\" or a Unix socket path"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nzone = \"dmz\"\n",
     "listeners.x.zone = 'dmz': must be one of external, internal"),
    ("[brokr]\n", "brokr: unknown section; allowed: broker, listeners, metrics, store, update, upstream"),
    ("[broker]\nlog_level = \"verbose\"\n", "broker.log_level = 'verbose': must be one of debug, info, warning, error"),
    ("[store]\nlazy_commit = \"2s\"\n",
     "store.lazy_commit = '2s': must be a duration 0..1s such as \"5ms\" (0 = at the end of the loop turn)"),
    ("[store]\nmqueue_mem_len = -1\n",
     "store.mqueue_mem_len = -1: must be an integer >= 0 (queued messages of a persistent session kept in memory; "
     "the rest wait only in the store; 0 = all in memory)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nhigh_watermark = \"1KB\"\n",
     "listeners.x.high_watermark = '1KB': must be a size of at least 4KB such as \"1MB\""),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nsend_timeout = \"soon\"\n",
     "listeners.x.send_timeout = 'soon': must be a duration such as \"15s\" (0 = never)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_clientid_len = 5\n",
     "listeners.x.max_clientid_len = 5: must be an integer 23..65535 (UTF-8 bytes)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_subscriptions = -1\n",
     "listeners.x.max_subscriptions = -1: must be an integer >= 0 (0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_topic_levels = 70000\n",
     "listeners.x.max_topic_levels = 70000: must be an integer 0..65535 (0 = no limit)"),
    ("[broker]\nmax_sessions = \"many\"\n", "broker.max_sessions = 'many': must be an integer >= 0 (0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_connections = -5\n",
     "listeners.x.max_connections = -5: must be an integer >= 0 (connected clients on this listener; 0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_topic_length = 65536\n",
     "listeners.x.max_topic_length = 65536: must be an integer 0..65535 (UTF-8 bytes; 0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nmax_publish_rate = \"100/s\"\n",
     "listeners.x.max_publish_rate = '100/s': must be a number >= 0 (PUBLISH packets per second per connection; "
     "0 = no limit)"),
    ("[broker]\nmax_retained_messages = 1.5\n",
     "broker.max_retained_messages = 1.5: must be an integer >= 0 (0 = no limit)"),
    ("[broker]\nmax_retained_bytes = \"lots\"\n",
     "broker.max_retained_bytes = 'lots': must be a size such as \"64MB\" (0 = no limit)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nprotocol = \"ws\"\n",
     "listeners.x.protocol = 'ws': must be one of 'mqtt', 'websockets' (\"websockets\": MQTT over WebSockets, wss "
     "with the TLS keys)"),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\nprotocol = \"websockets\"\npath = \"mqtt\"\n",
     "listeners.x.path = 'mqtt': must be an HTTP path starting with \"/\" (no spaces, \"?\" or \"#\"), such as "
     "\"/mqtt\""),
    ("[listeners.x]\nbind = \"127.0.0.1:0\"\npath = \"/mqtt\"\n",
     "listeners.x.path = '/mqtt': only a protocol = \"websockets\" listener has a path (this one is protocol = "
     "'mqtt')"),
    ("[listeners.x\n", None),
])
def test_check_config_each_mistake_is_explained(tmp_path: Path, text: str, error: str | None) -> None:
    """config.py: one line per mistake naming the key, the value and what is allowed; a file that is not TOML
    is reported as such."""
    path = tmp_path / "one.toml"
    path.write_text(text)
    result = run(["check-config", str(path)], tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[-1] == f"{path}: 1 error(s)"
    if error is None:
        assert len(lines) == 2 and lines[0].startswith(f"{path}: not valid TOML: ")
    else:
        assert lines == [f"{path}: {error}", f"{path}: 1 error(s)"]


def test_check_config_missing_file_exits_1(tmp_path: Path) -> None:
    """config.py: a file that cannot be read is one clear error, not a Traceback."""
    path = tmp_path / "nope.toml"
    result = run(["check-config", str(path)], tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"{path}: cannot read the file: No such file or directory",
                                          f"{path}: 1 error(s)"]


def test_serve_bad_config_exits_78_one_line_per_error(tmp_path: Path) -> None:
    """cli.py / `serve --help`: "78 the configuration is invalid" (EX_CONFIG, so systemd does not restart it):
    one line per error and no Traceback; nothing is started."""
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    result = run(["serve", "--config", str(path)], tmp_path)
    assert result.returncode == 78
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"edge-gateway: {path}: {line}" for line in BAD_ERRORS]
    assert list(tmp_path.iterdir()) == [path]


def test_serve_port_in_use_exits_1_with_one_clear_line(tmp_path: Path) -> None:
    """`serve --help`: "1 a listener could not bind" - one clear line naming the address, the listener and the
    cause, and no Traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "inuse.toml"
        path.write_text(f'[listeners.external]\nbind = "127.0.0.1:{port}"\n')
        result = run(["serve", "--config", str(path)], tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("edge-gateway: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"edge-gateway: cannot listen on 127.0.0.1:{port} (listener 'external'): ")
    assert errors[0].endswith("address already in use")
    assert "ERROR" not in result.stderr


@pytest.fixture
def paho_v5() -> Iterator[Callable[[int], tuple[mqtt.Client, list[int], threading.Event]]]:
    """``paho_v5(port)``: a connected paho MQTT 5 client recording its disconnect reason codes."""
    clients: list[mqtt.Client] = []

    def make(port: int) -> tuple[mqtt.Client, list[int], threading.Event]:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sigterm-{time.monotonic_ns()}",
                             protocol=mqtt.MQTTv5)
        connected, gone = threading.Event(), threading.Event()
        reasons: list[int] = []

        def on_connect(c: mqtt.Client, u: object, flags: object, rc: mqtt.ReasonCode, props: object) -> None:
            connected.set()

        def on_disconnect(c: mqtt.Client, u: object, flags: object, rc: mqtt.ReasonCode, props: object) -> None:
            reasons.append(rc.value)
            gone.set()

        client.on_connect = on_connect
        client.on_disconnect = on_disconnect
        client.connect("127.0.0.1", port)
        client.loop_start()
        clients.append(client)
        assert connected.wait(5)
        return client, reasons, gone

    yield make
    for client in clients:
        client.disconnect()
        client.loop_stop()


def test_sigterm_exits_0_after_disconnect_0x8b_to_mqtt5_clients(make_broker: Callable[..., BrokerProcess],
                                                                 paho_v5: Callable[..., tuple[mqtt.Client, list[int],
                                                                                              threading.Event]],
                                                                 uid: str) -> None:
    """`serve --help`: "SIGTERM/SIGINT stop accepting, send DISCONNECT 0x8B to MQTT 5 clients and exit
    0"; MQTT 5.0 §3.14.2.1: 0x8B Server shutting down. The DISCONNECT is the first and last packet the 5.0 client
    sees; a 3.1.1 client (which has no DISCONNECT from the Server) just sees the connection closed."""
    proc = make_broker('[listeners.external]\nbind = "127.0.0.1:0"\n')
    v5 = RawClient(proc.port, version=5)
    v311 = RawClient(proc.port, version=4)
    try:
        assert v5.connect(f"{uid}-v5").reason_code == 0
        assert v311.connect(f"{uid}-v311").reason_code == 0
        _client, reasons, gone = paho_v5(proc.port)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        assert v5.recv(timeout=5) == Disconnect(0x8B)
        assert v5.closed_by_server(5)
        assert v311.closed_by_server(5)
        assert v311.recv_all(0.1) == []
        assert gone.wait(5)
        assert reasons[0] == 0x8B
        assert proc.stop() == 0
    finally:
        v5.close()
        v311.close()
    log = proc.log()
    assert "shutting down" in log and "stopped" in log
    assert "Traceback" not in log


def test_sigint_also_exits_0(make_broker: Callable[..., BrokerProcess], uid: str) -> None:
    """`serve --help`: "SIGTERM/SIGINT stop accepting ... and exit 0" (Ctrl-C in a terminal)."""
    proc = make_broker('[listeners.external]\nbind = "127.0.0.1:0"\n')
    client = RawClient(proc.port, version=5)
    try:
        assert client.connect(f"{uid}-v5").reason_code == 0
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGINT)
        assert client.recv(timeout=5) == Disconnect(0x8B)
        assert proc.proc.wait(10) == 0
    finally:
        client.close()
    assert "Traceback" not in proc.log()


def test_python_m_gateway_version(tmp_path: Path) -> None:
    """cli.py: `python -m gateway version` (and `--version`) print the version and exit 0."""
    for args in (["version"], ["--version"]):
        result = run(args, tmp_path)
        assert result.returncode == 0
        assert result.stdout == f"edge-gateway {__version__}\n"
        assert result.stderr == ""


def test_version_verbose_says_how_the_mqtt_codec_runs(tmp_path: Path) -> None:
    """`edge-gateway version --verbose` (and `-v`): the version line as `version` prints it, then how the MQTT codec
    runs (gateway/native.py): in this environment as in this process (`make test` runs with --core compiled), and
    with ``EDGE_GATEWAY_PURE=1`` the .py files whatever the install holds."""
    cases = ((dict(os.environ), native.select().describe()),
             (os.environ | {native.PURE_ENV: "1"}, "pure Python (EDGE_GATEWAY_PURE=1)"))  # fmt: skip
    for env, core in cases:
        for flag in ("--verbose", "-v"):
            result = subprocess.run([str(EDGE_GATEWAY), "version", flag], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=30)
            assert result.returncode == 0, result.stderr
            assert result.stdout == f"edge-gateway {__version__}\ncore: {core}\n"
            assert result.stderr == ""


def test_serve_keeps_the_other_commands_and_websockets_out_of_the_broker(tmp_path: Path) -> None:
    """`edge-gateway serve` (how systemd starts the broker) parses with serve's parser alone and imports the
    WebSockets codec only for a websockets listener: the settings, passwd and update commands' modules and the codec
    (about 2.7 MiB of RSS together) are not in a broker's memory; `edge-gateway --help` still lists every command."""
    bad = tmp_path / "gw.toml"
    bad.write_text('[broker]\nlog_level = "loud"\n')
    probe = (
        "import sys; from gateway import cli\n"
        f"code = cli.main(['serve', '--config', {str(bad)!r}])\n"
        "print(code, 'gateway.server.runner' in sys.modules, sorted(m for m in sys.modules if m.startswith(("
        "'gateway.update.pull', 'gateway.update.fetch', 'gateway.board_settings', 'gateway.auth.passwd_cli', "
        "'gateway.server.websocket', 'websockets'))))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[-2] == "78 True []", proc.stdout + proc.stderr
    assert "log_level" in proc.stderr
    listing = subprocess.run([sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True, timeout=60)
    for command in ("serve", "check-config", "store", "passwd", "settings", "update", "version"):
        assert re.search(rf"^    {command}\b", listing.stdout, re.MULTILINE), listing.stdout


def test_store_lazy_commit_is_read_into_the_store_settings() -> None:
    """config.py: ``[store] lazy_commit`` (a duration, 0..1 s) becomes the store's ``lazy_commit`` in seconds, the
    settings object the runner opens the store with; without it the store's default, 5 ms, holds."""
    from gateway.server.config import load_config

    assert load_config({"store": {"lazy_commit": "250ms"}}).store.lazy_commit == 0.25
    assert load_config({"store": {"lazy_commit": 0}}).store.lazy_commit == 0.0
    assert load_config({}).store.lazy_commit == 0.005
