"""Start, measure and stop the three brokers the benchmarks compare, each on 127.0.0.1 and a port the harness
chose (or, for edge-gateway, port 0 read back from its log), pinned to core 0 with ``taskset -c 0`` and given a
large RLIMIT_NOFILE with ``prlimit``.

- ``mosquitto``: the Debian package, generated config (``listener PORT 127.0.0.1``, ``allow_anonymous true``,
  ``max_inflight_messages 32``, ``max_queued_messages 1000000``, ``max_queued_bytes 0``; ``persistence`` per
  scenario with autosave_interval left at its default; ``set_tcp_nodelay`` left at its default, false).
- ``edge-gateway``: ``python -m gateway serve --config X`` from this checkout, LMDB store in the run's temp dir,
  ``max_inflight = 32``, ``max_mqueue_len = 1000000``, ``message_expiry_interval = 0``; its event loop is the
  default ("auto": uvloop when installed).
- ``amqtt``: bench/amqtt_broker.py in bench/.venv-amqtt.

Variants (``Security`` given to :class:`Broker`), the same for Mosquitto and edge-gateway: ``tls``: the listener
speaks TLS with one server certificate and key made at bench time (:func:`make_pki`; Mosquitto ``certfile`` /
``keyfile``, edge-gateway the same keys); ``acl``: ``allow_anonymous false``, a password file with the bench's user and
an ACL file of :data:`ACL_RULES` rules (:func:`write_auth_files`; both brokers read the same two files).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from loadgen import BROKER_CPU, HOST, Target, TargetError, check_target

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
AMQTT_PY = BENCH / ".venv-amqtt" / "bin" / "python"
KINDS = ("mosquitto", "edge-gateway", "amqtt")
MAX_INFLIGHT = 32
# Large enough that no scenario's backlog reaches it. (With 200000, Mosquitto 2.0.11 logged "Outgoing messages are
# being dropped" in the QoS 1 scenario with far fewer messages queued, and dropped thousands.)
MAX_QUEUED = 1_000_000
_EGW_LISTEN = re.compile(r"listening on 127\.0\.0\.1:(\d+) \(listener")
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: rules (topic and pattern lines) in the ACL file of the ``acl`` variant
ACL_RULES = 1000
BENCH_PASSWORD = "bench-secret"


@dataclass(frozen=True)
class Security:
    """A broker variant: TLS files (``certfile``, ``keyfile``, ``cafile`` the clients verify with) and/or the
    password and ACL files; ``None`` fields are off."""

    certfile: Path | None = None
    keyfile: Path | None = None
    cafile: Path | None = None
    password_file: Path | None = None
    acl_file: Path | None = None


def _give_to_mosquitto(*paths: Path) -> None:
    """Mosquitto, started as root, drops to its own user before it reads its certificate and files."""
    if os.geteuid() != 0:
        return
    for path in paths:
        try:
            shutil.chown(path, "mosquitto", "mosquitto")
        except (LookupError, OSError):
            pass


def make_pki(directory: Path) -> Security:
    """A CA and a server certificate for ``localhost`` / 127.0.0.1 (P-256, 30 days) with its key, made with
    ``cryptography`` in ``directory``: what both brokers' TLS listeners use in the ``tls`` variant."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
              ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), True)
        else:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("edge-gateway bench CA", ca_key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                             "edge-gateway bench CA")]), ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build("localhost", key, ca.subject, ca_key, False)
    paths = Security(directory / "server.crt", directory / "server.key", directory / "ca.crt")
    assert paths.certfile and paths.keyfile and paths.cafile
    paths.cafile.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    paths.keyfile.chmod(0o600)
    _give_to_mosquitto(paths.certfile, paths.keyfile, paths.cafile)
    return paths


def acl_text(user: str = "bench", rules: int = ACL_RULES) -> str:
    """An ACL file of ``rules`` rules in Mosquitto's format, shaped like a plant's: 10 ``pattern`` lines (every
    client), the bench user's 30 rules (site topics, a ``deny`` and, last, the grant of ``bench/#`` it publishes and
    subscribes under: the worst place for a broker that scans rules in order), and 96 other users with 10 each."""
    lines = [f"pattern readwrite devices/%u/line{i}/#" for i in range(10)]
    lines += [f"user {user}", *(f"topic read site/area{i}/+/status" for i in range(28)),
              "topic deny bench/secret/#", "topic readwrite bench/#"]
    others = (rules - 40) // 10
    for u in range(others):
        lines.append(f"user sensor-{u:03d}")
        lines += [f"topic write sensors/sensor-{u:03d}/m{j}" for j in range(9)]
        lines.append(f"topic read cmd/sensor-{u:03d}/#")
    text = "\n".join(lines) + "\n"
    assert sum(1 for ln in lines if ln.startswith(("topic ", "pattern "))) == rules
    return text


def write_auth_files(directory: Path) -> Security:
    """The ``acl`` variant's password file (user ``bench``, :data:`BENCH_PASSWORD`, ``$7$`` as mosquitto_passwd
    2.0 writes) and ACL file (:func:`acl_text`), in ``directory``."""
    sys.path.insert(0, str(ROOT))
    from gateway.auth.passwd import PasswordFile

    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    files = Security(password_file=directory / "passwd", acl_file=directory / "acl")
    assert files.password_file and files.acl_file
    passwords = PasswordFile(str(files.password_file))
    passwords.set("bench", BENCH_PASSWORD)
    passwords.save()
    files.acl_file.write_text(acl_text())
    files.password_file.chmod(0o600)
    files.acl_file.chmod(0o600)
    _give_to_mosquitto(files.password_file, files.acl_file)
    return files


class BrokerError(RuntimeError):
    """The broker did not start, or died."""


def read_gateway_port(proc: subprocess.Popen[str], timeout: float = 20.0) -> int:
    """Read a starting edge-gateway's stderr (text) line by line until it logs that it is ready; return the port
    it logged for its listener. Kills it and raises :class:`BrokerError` when it stops or says neither within
    ``timeout`` seconds."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    port = None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = _EGW_LISTEN.search(line)
        if m:
            port = int(m.group(1))
        if "edge-gateway ready" in line:
            break
    if port is None:
        proc.kill()
        raise BrokerError("edge-gateway did not start")
    return port


def free_port() -> int:
    """A port nothing listens on right now (the broker binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], nofile: int) -> list[str]:
    """``cmd`` under prlimit (RLIMIT_NOFILE) and taskset (core 0) when the machine has a second core."""
    prefix: list[str] = []
    if shutil.which("prlimit"):
        prefix += ["prlimit", f"--nofile={nofile}:{nofile}"]
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        prefix += ["taskset", "-c", str(BROKER_CPU)]
    return prefix + cmd


def versions() -> dict[str, str]:
    """Version strings of the three brokers."""
    out: dict[str, str] = {}
    try:
        text = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"mosquitto version (\S+)", text)
        out["mosquitto"] = m.group(1) if m else "?"
    except (OSError, subprocess.SubprocessError):
        out["mosquitto"] = "not installed"
    sys.path.insert(0, str(ROOT))
    from gateway import __version__

    loop = "asyncio"
    try:
        import uvloop  # the broker's event_loop "auto" picks it when installed

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    out["edge-gateway"] = f"{__version__} (git {rev or '?'}, {loop})"
    try:
        text = subprocess.run([str(AMQTT_PY), "-c", "import amqtt; print(amqtt.__version__)"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        out["amqtt"] = text or "?"
    except (OSError, subprocess.SubprocessError):
        out["amqtt"] = "not installed"
    out["python"] = sys.version.split()[0]
    return out


class Broker:
    """One broker process in its own work directory (store / persistence files, config, log)."""

    def __init__(self, kind: str, workdir: Path, persistence: bool = False, nofile: int = 20000,
                 security: Security | None = None, wrapper: tuple[str, ...] = (),
                 store_options: tuple[str, ...] = ()) -> None:
        """``wrapper``: a command the broker runs under (``valgrind --tool=callgrind ...``: bench/instructions.py),
        between the pinning and the broker's own command line. ``store_options``: edge-gateway's further
        ``[store]`` lines (``'lazy_commit = "250ms"'``)."""
        if kind not in KINDS:
            raise ValueError(kind)
        self.kind = kind
        self.wrapper = wrapper
        self.store_options = store_options
        self.security = security or Security()
        self.workdir = workdir
        self.persistence = persistence
        self.nofile = nofile
        self.proc: subprocess.Popen[bytes] | None = None
        self.target: Target | None = None
        self.log_path = workdir / f"{kind}.log"
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _command(self, port: int) -> list[str]:
        sec = self.security
        if self.kind == "mosquitto":
            conf = self.workdir / "mosquitto.conf"
            extra = ""
            if sec.certfile:
                extra += f"certfile {sec.certfile}\nkeyfile {sec.keyfile}\n"
            if sec.password_file:
                extra += f"password_file {sec.password_file}\nacl_file {sec.acl_file}\n"
            conf.write_text(
                f"listener {port} {HOST}\n"
                + extra
                + f"allow_anonymous {'false' if sec.password_file else 'true'}\n"
                f"persistence {'true' if self.persistence else 'false'}\n"
                f"persistence_location {self.workdir}/\n"
                f"max_inflight_messages {MAX_INFLIGHT}\n"
                f"max_queued_messages {MAX_QUEUED}\n"
                "max_queued_bytes 0\n"
                "log_dest stderr\n"
                "log_type error\n"
                "log_type warning\n"
                "log_type notice\n"  # for "Outgoing messages are being dropped for client ..."
                "connection_messages false\n"
                # under a wrapper that writes files later (callgrind's dumps), Mosquitto keeps the rights it
                # started with instead of dropping root for its own user
                + ("user root\n" if self.wrapper and os.geteuid() == 0 else "")
            )
            return ["mosquitto", "-c", str(conf)]
        if self.kind == "edge-gateway":
            conf = self.workdir / "gateway.toml"
            conf.write_text(
                "[broker]\n"
                "sys_interval = 0\n"
                'log_level = "warning"\n'
                "[store]\n"
                f'path = "{self.workdir / "store"}"\n'
                + "".join(f"{line}\n" for line in self.store_options)
                + "[listeners.external]\n"
                'bind = "127.0.0.1:0"\n'
                f"max_inflight = {MAX_INFLIGHT}\n"
                f"max_mqueue_len = {MAX_QUEUED}\n"
                # Like Mosquitto's max_queued_messages 1000000 (64-byte payloads: ~70 MB): a subscriber that falls
                # behind is queued for, not dropped at the 1 MiB default (README, high_watermark).
                'high_watermark = "64MB"\n'
                "message_expiry_interval = 0\n"
                + (f'certfile = "{sec.certfile}"\nkeyfile = "{sec.keyfile}"\n' if sec.certfile else "")
                + (f'allow_anonymous = false\npassword_file = "{sec.password_file}"\nacl_file = "{sec.acl_file}"\n'
                   if sec.password_file else "")
            )
            # info only for the lines the harness reads (bound port, ready, store commits); nothing per message
            return [sys.executable, "-m", "gateway", "serve", "--config", str(conf), "--log-level", "info"]
        if not AMQTT_PY.exists():
            raise BrokerError(f"amqtt venv missing ({AMQTT_PY}); run `make bench`")
        return [str(AMQTT_PY), str(BENCH / "amqtt_broker.py"), str(port)]

    def start(self, timeout: float = 30.0) -> Target:
        """Start (or restart, keeping the work directory) and wait until it listens."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.kind == "mosquitto" and os.geteuid() == 0:
            try:
                shutil.chown(self.workdir, "mosquitto")  # mosquitto drops root for this user
            except (LookupError, OSError):
                pass
        port = 0 if self.kind == "edge-gateway" else free_port()
        cmd = pinned([*self.wrapper, *self._command(port)], self.nofile)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.kind == "edge-gateway":
            env["PYTHONPATH"] = str(ROOT)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            offset = log.tell()
            self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=env)
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerError(f"{self.kind} exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            if self.kind == "edge-gateway":
                text = self.log_path.read_bytes()[offset:].decode(errors="replace")
                m = _EGW_LISTEN.search(text)
                if m and "edge-gateway ready" in text[m.end() :]:
                    port = int(m.group(1))
                else:
                    time.sleep(0.05)
                    continue
            target = Target(port, self.proc.pid, os.getpid(), self.kind,
                            cafile=str(self.security.cafile) if self.security.certfile else None,
                            password=BENCH_PASSWORD if self.security.password_file else None)
            try:
                check_target(target)
            except TargetError:
                time.sleep(0.05)
                continue
            self.target = target
            return target
        self.kill()
        raise BrokerError(f"{self.kind} did not listen within {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- measurements ----------------------------------------------------------------------------------------

    def rss_kib(self) -> int:
        """VmRSS from /proc/PID/status, KiB."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise BrokerError("no VmRSS")

    def cpu_seconds(self) -> float:
        """utime + stime from /proc/PID/stat (all threads), seconds."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            data = f.read()
        fields = data[data.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def warnings(self, limit: int = 8) -> list[str]:
        """Warning and error lines of the broker's log (at most ``limit``, with a count of the rest)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        hits = [ln for ln in lines
                if re.search(r"WARNING|ERROR|CRITICAL|Traceback|[Ww]arning:|[Ee]rror:|being dropped", ln)]
        if len(hits) > limit:
            hits = [*hits[:limit], f"... and {len(hits) - limit} more"]
        return hits

    def store_commits(self) -> int | None:
        """edge-gateway only: the commit count it logs when it stops."""
        m = re.findall(r"store closed: (\d+) commits", self.log_path.read_text(errors="replace"))
        return int(m[-1]) if m else None


#: The edge-gateway variant with Prometheus metrics on and scraped: ``--brokers edge-gateway+metrics``.
METRICS_KIND = "edge-gateway+metrics"
_EGW_METRICS = re.compile(r"metrics: Prometheus /metrics on http://127\.0\.0\.1:(\d+)/metrics")


class MetricsGateway(Broker):
    """edge-gateway as :class:`Broker` runs it, plus ``[metrics] bind = "127.0.0.1:0"`` (the port read back from its
    log) and a thread in the harness that GETs ``/metrics`` every ``interval`` seconds while the broker runs, as a
    Prometheus would (at 1 s, 15x its default rate): what metrics cost the broker shows against plain edge-gateway.

    Attributes:
        scrapes / scrape_errors: completed and failed scrapes; samples: lines in the last scrape; metrics_url: where.
    """

    def __init__(self, workdir: Path, persistence: bool = False, nofile: int = 20000, interval: float = 1.0) -> None:
        super().__init__("edge-gateway", workdir, persistence, nofile)
        self.interval = interval
        self.scrapes = 0
        self.scrape_errors = 0
        self.samples = 0
        self.metrics_url = ""
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def _command(self, port: int) -> list[str]:
        cmd = super()._command(port)
        conf = self.workdir / "gateway.toml"
        conf.write_text(conf.read_text() + '[metrics]\nbind = "127.0.0.1:0"\n')
        return cmd

    def start(self, timeout: float = 30.0) -> Target:
        target = super().start(timeout)
        ports = _EGW_METRICS.findall(self.log_path.read_text(errors="replace"))
        if not ports:
            self.kill()
            raise BrokerError(f"edge-gateway did not log its metrics port:\n{self.log_tail()}")
        url = self.metrics_url = f"http://127.0.0.1:{ports[-1]}/metrics"
        self._halt.clear()
        self._thread = threading.Thread(target=self._scrape_loop, args=(url,), daemon=True, name="scraper")
        self._thread.start()
        return target

    def _scrape_loop(self, url: str) -> None:
        while not self._halt.wait(self.interval):
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    self.samples = response.read().count(b"\n")
                self.scrapes += 1
            except OSError:
                self.scrape_errors += 1

    def stop(self, timeout: float = 15.0) -> int | None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(15)
            self._thread = None
        return super().stop(timeout)
