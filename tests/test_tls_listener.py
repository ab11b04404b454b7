"""TLS listeners ("TLS"): a real broker process with a server-only TLS listener, a ``require_certificate``
listener and a plaintext loopback listener, certificates made by tests/pki.py.

- paho-mqtt (``tls_set``) and ``mosquitto_pub``/``mosquitto_sub`` (``--cafile``, ``--cert``/``--key``) exchange QoS 1
  messages over TLS, on uvloop and on asyncio's loop.
- Hostile clients on the TLS ports: a plaintext MQTT client, an expired, an untrusted and a missing client
  certificate, a client that never starts the handshake and one that stops halfway: each is closed (the silent ones
  after ``connect_timeout``) with one log line per cause (a repeat within a minute is suppressed), while a
  :class:`QoS1Pair` on the plaintext listener loses nothing and good TLS clients still get in.
- ``connect_timeout`` is one budget for handshake + CONNECT.
- SIGHUP rotates the certificate: established TLS clients stay, new ones see the new certificate; a broken key
  file is logged and the previous certificate stays in use.
- In process, with real sockets: the verified client certificate's CN reaches the broker's ``Connection.cert_cn``,
  and a CONNECT sent in the same TCP segment as the client's Finished is not lost.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from bystanders import QoS1Pair
from cryptography.hazmat.primitives import serialization
from helpers import BrokerProcess, wait_until
from paho.mqtt.enums import CallbackAPIVersion
from pki import Issued, issue, make_pki

from gateway.auth.tls import TlsSettings, build_server_context
from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.store_port import MemoryStore
from gateway.server.protocol import BrokerIO
from gateway.server.tls_accept import TlsListener

CONNECT_TIMEOUT = 2.0  # seconds, the TLS listeners' connect_timeout
#: MQTT 3.1.1 CONNECT, Clean Session, Keep Alive 60 s, Client Identifier "abcd"
CONNECT = b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04abcd"
CONNACK_OK = b"\x20\x02\x00\x00"

try:
    import uvloop  # noqa: F401

    LOOPS = ["uvloop", "asyncio"]
except ImportError:  # pragma: no cover - the "fast" extra is not installed
    LOOPS = ["asyncio"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def broker_config(pki: dict[str, Issued], event_loop: str) -> str:
    """Plaintext loopback listener ``plain``, server-only TLS ``tls``, client-certificate TLS ``mtls`` and
    client-certificate WebSocket-over-TLS ``mwss``."""
    server = pki["server"]
    return f"""
[broker]
event_loop = "{event_loop}"
[store]
backend = "memory"
[listeners.plain]
bind = "127.0.0.1:0"
[listeners.tls]
bind = "127.0.0.1:0"
certfile = "{server.cert}"
keyfile = "{server.key}"
connect_timeout = "{CONNECT_TIMEOUT}s"
[listeners.mtls]
bind = "127.0.0.1:0"
certfile = "{server.cert}"
keyfile = "{server.key}"
cafile = "{pki["ca"].cert}"
require_certificate = true
use_identity_as_username = true
connect_timeout = "{CONNECT_TIMEOUT}s"
[listeners.mwss]
bind = "127.0.0.1:0"
protocol = "websockets"
certfile = "{server.cert}"
keyfile = "{server.key}"
cafile = "{pki["ca"].cert}"
require_certificate = true
connect_timeout = "{CONNECT_TIMEOUT}s"
"""


@pytest.fixture(scope="module", params=LOOPS)
def tls_broker(
    request: pytest.FixtureRequest, pki: dict[str, Issued], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(broker_config(pki, request.param), workdir=str(tmp_path_factory.mktemp("tls"))).start()
    assert set(proc.ports) == {"plain", "tls", "mtls", "mwss"}, proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()


def paho_client(pki: dict[str, Issued], client_id: str, cert: Issued | None, version: Any) -> mqtt.Client:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=version)
    client.tls_set(
        ca_certs=str(pki["ca"].cert),
        certfile=str(cert.cert) if cert else None,
        keyfile=str(cert.key) if cert else None,
    )
    return client


@pytest.mark.parametrize("listener", ["tls", "mtls"])
def test_paho_publishes_and_subscribes_qos1_over_tls(
    tls_broker: BrokerProcess, pki: dict[str, Issued], listener: str
) -> None:
    port = tls_broker.ports[listener]
    cert = pki["client"] if listener == "mtls" else None
    topic = f"tls/{uuid.uuid4().hex}"
    got: list[bytes] = []
    subscribed = threading.Event()
    sub = paho_client(pki, f"sub-{uuid.uuid4().hex[:8]}", cert, mqtt.MQTTv311)
    sub.on_connect = lambda c, *a: c.subscribe(topic, qos=1)
    sub.on_subscribe = lambda *a: subscribed.set()
    sub.on_message = lambda c, u, msg: got.append(msg.payload)
    sub.connect("127.0.0.1", port, keepalive=30)
    sub.loop_start()
    pub = paho_client(pki, f"pub-{uuid.uuid4().hex[:8]}", cert, mqtt.MQTTv5)
    pub.connect("127.0.0.1", port, keepalive=30)
    pub.loop_start()
    try:
        assert subscribed.wait(10), tls_broker.log()
        infos = [pub.publish(topic, str(i).encode(), qos=1) for i in range(100)]
        for info in infos:
            info.wait_for_publish(10)
            assert info.is_published()  # PUBACK received
        deadline = time.monotonic() + 10
        while len(got) < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == [str(i).encode() for i in range(100)]
    finally:
        for client in (pub, sub):
            client.disconnect()
            client.loop_stop()


def _mosquitto(tool: str, port: int, pki: dict[str, Issued], cert: Issued | None, *args: str) -> list[str]:
    cmd = [tool, "-h", "127.0.0.1", "-p", str(port), "--cafile", str(pki["ca"].cert)]
    if cert is not None:
        cmd += ["--cert", str(cert.cert), "--key", str(cert.key)]
    return cmd + list(args)


@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="mosquitto-clients is not installed")
@pytest.mark.parametrize("listener", ["tls", "mtls"])
def test_mosquitto_pub_and_sub_over_tls(tls_broker: BrokerProcess, pki: dict[str, Issued], listener: str) -> None:
    port = tls_broker.ports[listener]
    cert = pki["client"] if listener == "mtls" else None
    topic = f"tls/{uuid.uuid4().hex}"
    sub_args = ["-i", f"tls-sub-{uuid.uuid4().hex[:8]}", "-c", "-t", topic, "-q", "1"]
    # a persistent session subscribes and leaves (-E: exit once subscribed), the messages wait for it
    subscribe = subprocess.run(
        _mosquitto("mosquitto_sub", port, pki, cert, *sub_args, "-E"), capture_output=True, text=True, timeout=15
    )
    assert subscribe.returncode == 0, subscribe.stdout + subscribe.stderr
    for text in ("hello", "world"):
        pub = subprocess.run(
            _mosquitto("mosquitto_pub", port, pki, cert, "-t", topic, "-q", "1", "-m", text, "-d"),
            capture_output=True, text=True, timeout=15,
        )
        assert pub.returncode == 0, pub.stdout + pub.stderr
        assert "received PUBACK" in pub.stdout, pub.stdout
    sub = subprocess.run(
        _mosquitto("mosquitto_sub", port, pki, cert, *sub_args, "-C", "2", "-W", "10"),
        capture_output=True, text=True, timeout=15,
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    assert sub.stdout.splitlines() == ["hello", "world"], sub.stdout
    if listener == "mtls":  # no client certificate: refused by the handshake
        refused = subprocess.run(
            _mosquitto("mosquitto_pub", port, pki, None, "-t", topic, "-q", "1", "-m", "x"),
            capture_output=True, text=True, timeout=15,
        )
        assert refused.returncode != 0, refused


# --- hostile clients --------------------------------------------------------------------------------------------


def _closed_without_reply(sock: socket.socket | ssl.SSLSocket, timeout: float = 10.0) -> float:
    """Seconds until the broker closes ``sock`` (EOF, reset or a TLS alert); fails if it sends MQTT bytes or
    keeps the connection open past ``timeout``."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        data = sock.recv(100)
    except (ssl.SSLError, ConnectionError):
        return time.monotonic() - t0
    except TimeoutError:
        raise AssertionError(f"the broker kept the connection open for {timeout} s") from None
    assert data == b"", f"the broker answered {data!r}"
    return time.monotonic() - t0


def plaintext_connect(port: int) -> float:
    """A plaintext MQTT CONNECT on the TLS port."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(CONNECT)
        return _closed_without_reply(sock)


def tls_attempt(port: int, pki: dict[str, Issued], cert: Issued | None) -> str:
    """A TLS client that presents ``cert``, then sends CONNECT: ``"CONNACK"`` or why it was refused."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                # TLS 1.3: the server checks the client certificate after the client's Finished; the alert comes
                # with the first read
                tls.sendall(CONNECT)
                data = tls.recv(4)
                return "CONNACK" if data == CONNACK_OK else f"closed ({data!r})"
        except (ssl.SSLError, ConnectionError) as exc:
            return f"refused: {exc}"


def silent(port: int) -> float:
    """Connects and never starts the handshake: seconds until closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        return _closed_without_reply(sock)


def half_handshake(port: int) -> float:
    """Sends the first 20 bytes of a real ClientHello and stops: seconds until closed."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
    assert hello[:1] == b"\x16" and len(hello) > 20
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(hello[:20])
        return _closed_without_reply(sock)


def handshake_late_then_silent(port: int, pki: dict[str, Issued], delay: float) -> float:
    """TCP connect, wait ``delay`` s, finish the handshake, never send CONNECT: seconds from the TCP connect until
    the broker closes (the handshake counts against connect_timeout)."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        time.sleep(delay)
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            _closed_without_reply(tls)
            return time.monotonic() - t0


class Background:
    """Run ``fn`` in a thread; :meth:`result` returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 20.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "still running"
        if self._error is not None:
            raise self._error
        return self._value


def _failures(proc: BrokerProcess) -> list[str]:
    return [line for line in proc.lines if "TLS handshake failed" in line]


@pytest.mark.parametrize("event_loop", LOOPS)
def test_hostile_tls_clients_are_closed_with_one_log_line_each_and_bystanders_lose_nothing(
    pki: dict[str, Issued], tmp_path: Path, event_loop: str
) -> None:
    proc = BrokerProcess(broker_config(pki, event_loop), workdir=str(tmp_path)).start()
    try:
        tls_port, mtls_port = proc.ports["tls"], proc.ports["mtls"]
        pair = QoS1Pair(proc.ports["plain"], f"tls-bystander-{event_loop}", count=300, interval=0.01).start()
        # the slow ones run meanwhile
        silent_run = Background(lambda: silent(tls_port))
        half_run = Background(lambda: half_handshake(mtls_port))
        late_run = Background(lambda: handshake_late_then_silent(tls_port, pki, 1.5))

        assert plaintext_connect(tls_port) < 2.0
        assert plaintext_connect(tls_port) < 2.0  # the same cause again within a minute: no second line
        assert tls_attempt(mtls_port, pki, pki["expired"]) != "CONNACK"
        assert tls_attempt(mtls_port, pki, pki["untrusted"]) != "CONNACK"
        assert tls_attempt(mtls_port, pki, None) != "CONNACK"
        # good clients still get in, on both TLS listeners
        assert tls_attempt(mtls_port, pki, pki["client"]) == "CONNACK"
        assert tls_attempt(tls_port, pki, None) == "CONNACK"

        silent_s = silent_run.result()
        half_s = half_run.result()
        assert CONNECT_TIMEOUT - 0.2 <= silent_s <= CONNECT_TIMEOUT + 1.0, silent_s
        assert CONNECT_TIMEOUT - 0.2 <= half_s <= CONNECT_TIMEOUT + 1.0, half_s
        # closed by the CONNECT deadline counted from the TCP accept (one-second ticker): 2..3 s, not 1.5 + 2..3
        late_s = late_run.result()
        assert CONNECT_TIMEOUT - 0.2 <= late_s < 1.5 + CONNECT_TIMEOUT - 0.1, late_s
        pair.finish()

        time.sleep(0.3)
        lines = _failures(proc)
        causes = {
            "plaintext": "WRONG_VERSION_NUMBER; a plaintext client on a TLS port?",
            "expired": "client certificate refused: certificate has expired",
            "untrusted": "client certificate refused: unable to get local issuer certificate",
            "no certificate": "PEER_DID_NOT_RETURN_A_CERTIFICATE",
            "timeout": f"not finished within connect_timeout ({CONNECT_TIMEOUT:g} s)",
        }
        for what, text in causes.items():
            matching = [line for line in lines if text in line]
            assert len(matching) == 1, (what, lines)
        assert len(lines) == len(causes), lines  # silent and halfway: one cause, one line; plaintext twice: one
        assert all("(listener 'tls')" in line or "(listener 'mtls')" in line for line in lines), lines
        assert all(line.rstrip().endswith("closed") for line in lines), lines
    finally:
        assert proc.stop() == 0, proc.log()


# --- TLS alerts: a refused client certificate is told why (RFC 8446 §6.2, RFC 5246 §7.2) ---------------------

#: The alert OpenSSL sends for each refusal, as the client's ``ssl.SSLError.reason`` names it, by TLS version:
#: certificate_expired (45), unknown_ca (48), and for no certificate handshake_failure (40) in TLS 1.2,
#: certificate_required (116) in TLS 1.3.
REFUSAL_ALERTS = {
    ("expired", "TLSv1_2"): "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    ("expired", "TLSv1_3"): "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    ("untrusted", "TLSv1_2"): "TLSV1_ALERT_UNKNOWN_CA",
    ("untrusted", "TLSv1_3"): "TLSV1_ALERT_UNKNOWN_CA",
    ("none", "TLSv1_2"): "SSLV3_ALERT_HANDSHAKE_FAILURE",
    ("none", "TLSv1_3"): "TLSV13_ALERT_CERTIFICATE_REQUIRED",
}
#: What the client sends once its side of the handshake is done, by listener: MQTT CONNECT, or the WebSocket upgrade.
FIRST_BYTES = {
    "mtls": CONNECT,
    "mwss": b"GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Protocol: mqtt\r\n\r\n",
}


def refusal_seen_by_client(port: int, pki: dict[str, Issued], cert: Issued | None, version: ssl.TLSVersion,
                           first: bytes) -> ssl.SSLError:
    """A TLS client (the ``ssl`` module, only ``version``) that presents ``cert`` and, once its side of the
    handshake is done, sends ``first`` and reads: the :class:`ssl.SSLError` it gets. TLS 1.2 fails in the
    handshake; in TLS 1.3 the server checks the client certificate after the client's Finished, so the alert is
    read with the first record. Fails if the client gets anything else (data, a bare EOF, a reset)."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    ctx.minimum_version = ctx.maximum_version = version
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(first)
                data = tls.recv(100)
        except ssl.SSLError as exc:
            return exc
    raise AssertionError(f"no TLS alert: the client read {data!r}")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
@pytest.mark.parametrize("listener", ["mtls", "mwss"])
def test_rfc8446_6_2_refused_client_certificate_gets_the_alert_naming_why(
    tls_broker: BrokerProcess, pki: dict[str, Issued], listener: str, version: ssl.TLSVersion
) -> None:
    """RFC 8446 §6.2 / RFC 5246 §7.2: the side that detects an error sends the alert before it closes. An expired
    client certificate, one from an unknown CA and none at all on a ``require_certificate`` listener (MQTT and
    WebSocket-over-TLS, on each event loop) each reach the client as the alert that names the cause, in TLS 1.2
    and 1.3; a good certificate still gets in."""
    port = tls_broker.ports[listener]
    for cause in ("expired", "untrusted", "none"):
        exc = refusal_seen_by_client(port, pki, None if cause == "none" else pki[cause], version,
                                     FIRST_BYTES[listener])
        assert exc.reason == REFUSAL_ALERTS[cause, version.name], (cause, exc)
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    ctx.minimum_version = ctx.maximum_version = version
    ctx.load_cert_chain(str(pki["client"].cert), str(pki["client"].key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(FIRST_BYTES[listener])
        reply = tls.recv(100)
    assert reply == CONNACK_OK if listener == "mtls" else reply.startswith(b"HTTP/1.1 101 "), reply


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
@pytest.mark.parametrize("flag", ["-tls1_2", "-tls1_3"])
def test_rfc8446_6_2_openssl_s_client_reports_the_alert_of_a_refused_certificate(
    tls_broker: BrokerProcess, pki: dict[str, Issued], flag: str
) -> None:
    """The same with OpenSSL's ``s_client`` (``-ign_eof``: it keeps reading after its empty input, so that in
    TLS 1.3 it reads the alert that follows its Finished): it reports the alert by name and number."""
    expected = {"-tls1_2": ("sslv3 alert handshake failure", 40), "-tls1_3": ("tlsv13 alert certificate required", 116)}
    for cert, (name, number) in ((pki["expired"], ("sslv3 alert certificate expired", 45)), (None, expected[flag])):
        cmd = ["openssl", "s_client", "-connect", f"127.0.0.1:{tls_broker.ports['mtls']}", flag, "-ign_eof",
               "-CAfile", str(pki["ca"].cert)]
        if cert is not None:
            cmd += ["-cert", str(cert.cert), "-key", str(cert.key)]
        result = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=15)
        assert f"{name}:" in result.stderr and f"SSL alert number {number}" in result.stderr, result.stderr


# --- SIGHUP: certificate rotation without dropping connections -------------------------------------------------


def _connect_packet(client_id: str) -> bytes:
    """An MQTT 3.1.1 CONNECT, Clean Session, Keep Alive 60 s, with ``client_id``."""
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def tls_session(port: int, pki: dict[str, Issued], client_id: str) -> tuple[ssl.SSLSocket, bytes]:
    """A TLS client (the standard ``ssl`` module, verifying against the test CA) that has sent CONNECT and got
    CONNACK 0: the open socket and the server certificate it was shown (DER)."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname="localhost")
    tls.sendall(_connect_packet(client_id))
    assert tls.recv(4) == CONNACK_OK
    der = tls.getpeercert(binary_form=True)
    assert der is not None
    return tls, der


def _ping(tls: ssl.SSLSocket) -> bytes:
    """PINGREQ on an established connection: PINGRESP (``b"\\xd0\\x00"``) when it is still served."""
    tls.sendall(b"\xc0\x00")
    return tls.recv(2)


def _serial(der: bytes) -> int:
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_sighup_reloads_the_certificate_keeps_connections_and_keeps_the_old_one_on_a_broken_key(
    pki: dict[str, Issued], tmp_path: Path
) -> None:
    """SIGHUP reloads the certificates without dropping connections (README, "Security"): a client connected with the
    old certificate stays connected across SIGHUP; after the certificate and key files are replaced and SIGHUP sent, new
    connections are shown the new certificate (its serial and DER, read by the client with ``ssl``); a broken key file
    and SIGHUP: the file and the reason are logged, the previous certificate stays in use, and the broker goes on
    serving (established TLS clients and new ones, and a QoS 1 pair on the plaintext listener)."""
    live = tmp_path / "live"
    live.mkdir()
    certfile, keyfile = live / "server.crt", live / "server.key"
    shutil.copy(pki["server"].cert, certfile)
    shutil.copy(pki["server"].key, keyfile)
    config = f"""
[store]
backend = "memory"
[listeners.plain]
bind = "127.0.0.1:0"
[listeners.tls]
bind = "127.0.0.1:0"
certfile = "{certfile}"
keyfile = "{keyfile}"
"""
    proc = BrokerProcess(config, workdir=str(tmp_path)).start()
    assert proc.proc is not None
    try:
        port = proc.ports["tls"]
        pair = QoS1Pair(proc.ports["plain"], "tls-sighup-bystander", count=300, interval=0.01).start()
        old_client, old_der = tls_session(port, pki, "old-cert")
        assert _serial(old_der) == pki["server"].obj.serial_number

        # a renewed certificate with a new key, put in place (each file replaced whole), then SIGHUP
        renewed = issue(tmp_path, "renewed", "localhost", pki["ca"], server=True)
        assert renewed.obj.serial_number != pki["server"].obj.serial_number
        for src, dst in ((renewed.cert, certfile), (renewed.key, keyfile)):
            shutil.copy(src, dst.with_suffix(".new"))
            os.replace(dst.with_suffix(".new"), dst)
        mark = len(proc.lines)
        proc.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: any("reload: listener 'tls': TLS certificate and key reloaded" in line
                               for line in proc.lines[mark:]), what=proc.log)
        assert _ping(old_client) == b"\xd0\x00"  # the old connection goes on, on its old session keys
        new_client, new_der = tls_session(port, pki, "new-cert")
        assert _serial(new_der) == renewed.obj.serial_number
        assert new_der == renewed.obj.public_bytes(serialization.Encoding.DER)

        # a broken key file: logged with the file and the reason, the renewed certificate stays in use
        keyfile.write_text("-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n")
        mark = len(proc.lines)
        proc.proc.send_signal(signal.SIGHUP)
        expected = f"reload: listener 'tls': keyfile = '{keyfile}': not a PEM private key"
        wait_until(lambda: any(expected in line for line in proc.lines[mark:]), what=proc.log)
        failed = next(line for line in proc.lines[mark:] if expected in line)
        assert failed.rstrip().endswith("keeping the previous TLS certificate and key"), failed
        assert not any("TLS certificate and key reloaded" in line for line in proc.lines[mark:])
        after_client, after_der = tls_session(port, pki, "after-broken")
        after_client.close()
        assert after_der == new_der
        assert _ping(old_client) == b"\xd0\x00" and _ping(new_client) == b"\xd0\x00"
        old_client.close()
        new_client.close()
        pair.finish()
        assert proc.proc.poll() is None
    finally:
        assert proc.stop() == 0, proc.log()


# --- in process: the CN on the Connection, CONNECT in the segment of the client's Finished ----------------------


def _finished_and_connect_in_one_segment(
    port: int, pki: dict[str, Issued], cert: Issued
) -> tuple[bytes, socket.socket]:
    """A TLS 1.3 client over memory BIOs: its Finished and an MQTT CONNECT leave in one ``sendall``, so the server
    decrypts the CONNECT in the same read that completes its handshake. Returns the first decrypted reply and the
    socket, still open (the caller closes it)."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    ctx.load_cert_chain(str(cert.cert), str(cert.key))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            if outgoing.pending:
                sock.sendall(outgoing.read())
            incoming.write(sock.recv(65536))
    obj.write(CONNECT)
    sock.sendall(outgoing.read())  # Finished + CONNECT
    while True:
        try:
            return obj.read(4), sock
        except ssl.SSLWantReadError:
            chunk = sock.recv(65536)
            if not chunk:
                return b"", sock
            incoming.write(chunk)


def _new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


@pytest.mark.parametrize("loop_name", LOOPS)
def test_the_verified_cn_reaches_the_connection_and_early_connect_is_kept(
    pki: dict[str, Issued], loop_name: str
) -> None:
    settings = TlsSettings(
        certfile=str(pki["server"].cert),
        keyfile=str(pki["server"].key),
        cafile=str(pki["ca"].cert),
        require_certificate=True,
        use_identity_as_username=True,
    )

    async def main() -> tuple[bytes, list[str | None]]:
        loop = asyncio.get_running_loop()
        broker = Broker(BrokerSettings(), MemoryStore(), now=time.time())
        io = BrokerIO(broker, loop)
        tls = TlsListener(io, build_server_context(settings), "mtls", ZoneLimits(connect_timeout=5.0))
        port = (await tls.start("127.0.0.1", 0))[0].getsockname()[1]
        try:
            reply, sock = await loop.run_in_executor(
                None, _finished_and_connect_in_one_segment, port, pki, pki["client"]
            )
            cns = [conn.cert_cn for conn in broker.connections]  # the client is still connected
            sock.close()
        finally:
            tls.close()
            await tls.wait_closed()
            for transport in list(io.transports.values()):
                transport.abort()
            await asyncio.sleep(0.05)
        return reply, cns

    loop = _new_loop(loop_name)
    try:
        reply, cns = loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()
    assert reply == CONNACK_OK
    assert cns == ["sensor-17"]  # the first CN of the subject (the certificate has a second one)


# --- configuration: validated at load and by check-config -------------------------------------------------------


def check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True, text=True, timeout=30
    )


def test_check_config_accepts_a_tls_listener(pki: dict[str, Issued], tmp_path: Path) -> None:
    result = check_config(tmp_path, broker_config(pki, "auto"))
    assert result.returncode == 0, result.stderr
    assert "listener plain: bind 127.0.0.1:0, max_inflight 32, max_mqueue_len 1000\n" in result.stdout
    assert "listener tls: bind 127.0.0.1:0, max_inflight 32, max_mqueue_len 1000, TLS (tlsv1.2 minimum)\n" in (
        result.stdout
    )
    assert "listener mtls: bind 127.0.0.1:0, max_inflight 32, max_mqueue_len 1000, TLS (tlsv1.2 minimum, client " \
        "certificates required)\n" in result.stdout


def test_check_config_names_every_tls_mistake(pki: dict[str, Issued], tmp_path: Path) -> None:
    server, ca = pki["server"], pki["ca"]
    missing = tmp_path / "missing.crt"
    good = f'certfile = "{server.cert}"\nkeyfile = "{server.key}"\n'
    text = f"""
[listeners.nofile]
bind = "127.0.0.1:0"
certfile = "{missing}"
keyfile = "{server.key}"
[listeners.mismatch]
bind = "127.0.0.1:0"
certfile = "{server.cert}"
keyfile = "{pki["client"].key}"
[listeners.version]
bind = "127.0.0.1:0"
{good}tls_version = "tlsv1.0"
[listeners.types]
bind = "127.0.0.1:0"
{good}require_certificate = "yes"
cafile = 7
[listeners.nocert]
bind = "127.0.0.1:0"
cafile = "{ca.cert}"
[listeners.unix]
bind = "{tmp_path}/mqtt.sock"
{good}
[listeners.ciphers]
bind = "127.0.0.1:0"
{good}ciphers = "NO-SUCH-CIPHER"
[listeners.needca]
bind = "127.0.0.1:0"
{good}require_certificate = true
[listeners.identity]
bind = "127.0.0.1:0"
{good}use_identity_as_username = true
"""
    result = check_config(tmp_path, text)
    assert result.returncode == 1
    src = str(tmp_path / "gateway.toml")
    expected = [
        f"listeners.nofile.certfile = '{missing}': cannot read: No such file or directory",
        f"listeners.mismatch.keyfile = '{pki['client'].key}': does not match certfile '{server.cert}'",
        "listeners.version.tls_version = 'tlsv1.0': must be one of tlsv1.1, tlsv1.2, tlsv1.3 (the minimum)",
        "listeners.types.require_certificate = 'yes': must be true or false",
        "listeners.types.cafile = 7: must be a file path",
        "listeners.nocert.certfile: missing; a TLS listener needs certfile and keyfile (set because of cafile)",
        "listeners.nocert.keyfile: missing; a TLS listener needs certfile and keyfile (set because of cafile)",
        f"listeners.unix.certfile = '{server.cert}': TLS is not available on a Unix socket listener "
        f"(bind = '{tmp_path}/mqtt.sock'); use a TCP bind or drop the TLS keys",
        "listeners.needca.require_certificate = true: needs cafile or capath to verify client certificates with",
        "listeners.identity.use_identity_as_username = true: needs require_certificate = true (mosquitto.conf(5))",
    ]
    lines = result.stderr.splitlines()
    for line in expected:
        assert f"{src}: {line}" in lines, (line, lines)
    ciphers = [line for line in lines if line.startswith(f"{src}: listeners.ciphers.ciphers = 'NO-SUCH-CIPHER': ")]
    assert len(ciphers) == 1 and "selects no cipher" in ciphers[0], lines
    assert lines[-1] == f"{src}: {len(expected) + 1} error(s)", lines
