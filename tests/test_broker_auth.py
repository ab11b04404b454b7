"""Authentication, topic ACLs and session ownership against the real broker process, with real clients:
paho-mqtt, ``mosquitto_pub``/``mosquitto_sub -u -P``, a password file made by Debian's ``mosquitto_passwd``, and a
raw-socket client for exact CONNACK/PUBACK/SUBACK codes. Each hostile case runs beside a
:class:`bystanders.QoS1Pair` (on the broker's anonymous loopback listener) that must lose nothing.

The broker under test has two listeners on 127.0.0.1: ``secure`` (``allow_anonymous = false``, a password file and
an ACL file) and ``internal`` (the loopback default: anonymous allowed, no ACL). Only loopback addresses may be used
in tests, so the non-loopback default is checked through ``edge-gateway check-config``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from auth_helpers import MosquittoBroker
from bystanders import QoS1Pair
from helpers import BrokerProcess, RawClient, wait_until
from paho.mqtt.enums import CallbackAPIVersion

from gateway.auth.passwd import PasswordFile
from gateway.mqtt.packets import (
    Connack,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from gateway.mqtt.packets import Will as WillMessage

ACL = """\
# anonymous clients (none can connect on the secure listener)
topic read public/#

user alice
topic readwrite plant/alice/#
topic deny plant/alice/secret
topic read public/#

user bob
topic readwrite plant/bob/#
topic write public/#
"""

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


def _passwd(path: Path, user: str, password: str, create: bool = False) -> None:
    """Add ``user`` to ``path`` with Debian's ``mosquitto_passwd -b`` (``-c`` creates the file)."""
    exe = shutil.which("mosquitto_passwd")
    if exe is None:
        pytest.skip("mosquitto_passwd is not installed (make deps installs the mosquitto package)")
    args = [exe, *(["-c"] if create else []), "-b", str(path), user, password]
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _config(workdir: Path) -> str:
    return f"""
[broker]
sys_interval = 0

[listeners.secure]
bind = "127.0.0.1:0"
allow_anonymous = false
password_file = "{workdir / 'passwd'}"
acl_file = "{workdir / 'acl'}"

[listeners.internal]
bind = "127.0.0.1:0"
"""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """The broker with alice/alice-pw and bob/bob-pw in a mosquitto_passwd file and :data:`ACL`."""
    _passwd(tmp_path / "passwd", "alice", "alice-pw", create=True)
    _passwd(tmp_path / "passwd", "bob", "bob-pw")
    (tmp_path / "acl").write_text(ACL)
    proc = BrokerProcess(_config(tmp_path), workdir=str(tmp_path)).start()
    try:
        yield proc
    finally:
        proc.stop()


def _client(broker: BrokerProcess, version: int, user: str | None = None, client_id: str = "",
            listener: str = "secure", **kw: Any) -> tuple[RawClient, Connack]:
    """A raw client connected (or refused) on ``listener`` as ``user`` (password ``<user>-pw``)."""
    raw = RawClient(broker.ports[listener], version=version)
    if user is not None:
        kw.setdefault("username", user)
        kw.setdefault("password", f"{user}-pw".encode())
    return raw, raw.connect(client_id, **kw)


def _refused(raw: RawClient, connack: Connack, version: int, code5: int, code311: int) -> None:
    """CONNACK refused with ``code5`` (5.0) or ``code311`` (3.1.1), Session Present 0 [MQTT-3.2.2-6], then the
    connection closed [MQTT-3.1.4-2] [MQTT-3.2.2-7]."""
    assert connack.reason_code == (code5 if version == 5 else code311), connack
    assert not connack.session_present
    assert raw.closed_by_server(), "the broker must close a refused connection"
    raw.close()


def _bystanders(broker: BrokerProcess, name: str) -> QoS1Pair:
    return QoS1Pair(broker.ports["internal"], name, count=150).start()


def _alive(raw: RawClient) -> bool:
    raw.send(PingReq())
    return isinstance(raw.recv(), PingResp)


# ---------------------------------------------------------------------------------------------- CONNECT


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_1_4_2_bad_password_unknown_user_and_anonymous_are_refused(broker: BrokerProcess, version: int) -> None:
    """MQTT-3.1.4-2 / MQTT-3.2.2-7: a CONNECT that fails authentication gets CONNACK 0x86 Bad User Name or Password
    (3.1.1: return code 4) for a wrong password or an unknown user, 0x87 Not authorized (3.1.1: 5) for an anonymous
    client on a listener with ``allow_anonymous = false``, and the connection is closed; alice with her password is
    accepted. A pair of QoS 1 clients beside it loses nothing."""
    pair = _bystanders(broker, f"auth-refused-v{version}")
    raw, ack = _client(broker, version, "alice", "a1", password=b"wrong")
    _refused(raw, ack, version, 0x86, 4)
    raw, ack = _client(broker, version, "mallory", "m1")
    _refused(raw, ack, version, 0x86, 4)
    raw, ack = _client(broker, version, None, "anon")
    _refused(raw, ack, version, 0x87, 5)
    raw, ack = _client(broker, version, "alice", "a1")
    assert ack.reason_code == 0
    assert _alive(raw)
    raw.close()
    pair.finish()
    assert "CONNECT refused (0x86 BAD_USER_NAME_OR_PASSWORD)" in broker.log()


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_1_4_2_zero_length_password_counts_as_none_and_is_refused(tmp_path: Path, version: int) -> None:
    """MQTT-3.1.4-2 / MQTT-3.2.2-7 with a zero-length Password: it counts as no Password, as in Mosquitto, so it
    is refused with CONNACK 0x86 (3.1.1: return code 4) and the close, also for a user whose entry
    (``mosquitto_passwd -b FILE eve ""``) is the hash of the empty password; eve with no Password at all likewise,
    while alice with hers gets in. A real Mosquitto (2.0) refuses eve's empty Password too. A pair of QoS 1 clients
    beside it loses nothing."""
    _passwd(tmp_path / "passwd", "alice", "alice-pw", create=True)
    _passwd(tmp_path / "passwd", "eve", "")
    assert PasswordFile.load(tmp_path / "passwd").empty_password_entries() == [(2, "eve")]
    (tmp_path / "acl").write_text(ACL)
    proc = BrokerProcess(_config(tmp_path), workdir=str(tmp_path)).start()
    try:
        pair = _bystanders(proc, f"auth-empty-v{version}")
        for user, password in (("eve", b""), ("alice", b""), ("eve", None)):
            raw, ack = _client(proc, version, user, f"empty-{user}", password=password)
            _refused(raw, ack, version, 0x86, 4)
        raw, ack = _client(proc, version, "alice", "empty-alice")
        assert ack.reason_code == 0 and _alive(raw)
        raw.close()
        pair.finish()
    finally:
        assert proc.stop() == 0, proc.log()
    with MosquittoBroker(tmp_path, f"allow_anonymous false\npassword_file {tmp_path / 'passwd'}\n") as mosquitto:
        raw = RawClient(mosquitto.port, version=version)
        assert raw.connect("empty-eve", username="eve", password=b"").reason_code != 0, mosquitto.log()
        raw.close()


def test_paho_and_mosquitto_clients_with_user_name_and_password(broker: BrokerProcess, tmp_path: Path) -> None:
    """paho-mqtt (5.0) and ``mosquitto_sub``/``mosquitto_pub -u -P`` (3.1.1) authenticate against the
    ``mosquitto_passwd`` file and exchange a QoS 1 message; ``mosquitto_pub`` with a wrong password is refused."""
    port = broker.ports["secure"]
    got: list[bytes] = []
    subscribed = threading.Event()
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="paho-alice", protocol=mqtt.MQTTv5)
    sub.username_pw_set("alice", "alice-pw")
    sub.on_connect = lambda c, *a: c.subscribe("public/#", qos=1)
    sub.on_subscribe = lambda *a: subscribed.set()
    sub.on_message = lambda c, u, m: got.append(m.payload)
    sub.connect("127.0.0.1", port)
    sub.loop_start()
    try:
        assert subscribed.wait(10)
        pub = subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-u", "bob", "-P", "bob-pw",
                              "-t", "public/news", "-m", "from-bob", "-q", "1"], capture_output=True, text=True,
                             timeout=20)
        assert pub.returncode == 0, pub.stderr
        wait_until(lambda: got == [b"from-bob"], what=lambda: f"paho got {got}")
        bad = subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-u", "bob", "-P", "nope",
                              "-t", "public/news", "-m", "x", "-q", "1"], capture_output=True, text=True, timeout=20)
        assert bad.returncode != 0
        assert "not authorised" in (bad.stderr + bad.stdout).lower() or "refused" in bad.stderr.lower(), bad.stderr
        out = subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-u", "alice", "-P", "alice-pw",
                              "-t", "plant/alice/#", "-C", "1", "-W", "10", "-v", "-q", "1", "-i", "sub-alice",
                              "--retained-only"], capture_output=True, text=True, timeout=20)
        assert "not authorised" not in out.stderr.lower(), out.stderr
    finally:
        sub.disconnect()
        sub.loop_stop()


def test_repeated_failures_from_one_address_are_slowed(broker: BrokerProcess) -> None:
    """After 3 failed CONNECTs from 127.0.0.1 the next CONNECT (even with the right password) is held about a second
    before it is answered (FailureThrottle: 1 s, doubling; README, "Security"); other connected clients are not."""
    pair = _bystanders(broker, "throttle")
    for _ in range(4):
        raw, ack = _client(broker, 4, "alice", "t", password=b"wrong")
        _refused(raw, ack, 4, 0x86, 4)
    started = time.monotonic()
    raw, ack = _client(broker, 4, "alice", "t")
    held = time.monotonic() - started
    assert ack.reason_code == 0
    assert held >= 0.9, f"answered after {held:.2f} s"
    raw.close()
    started = time.monotonic()
    raw, ack = _client(broker, 4, "alice", "t")  # the success forgot the failures
    assert ack.reason_code == 0 and time.monotonic() - started < 0.9
    raw.close()
    pair.finish()


# ---------------------------------------------------------------------------------------------- ACLs


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_3_5_2_publish_without_write_is_refused_and_not_delivered(broker: BrokerProcess, version: int) -> None:
    """MQTT-3.3.5-2 (3.1.1) / MQTT 5.0 §3.4.2.1: alice may not write ``plant/bob/x``: 5.0 PUBACK 0x87, 3.1.1 a plain
    PUBACK, QoS 0 dropped silently; a subscriber to ``plant/#`` (on the listener without ACL) receives none of it;
    her own topic goes through."""
    pair = _bystanders(broker, f"acl-pub-v{version}")
    bob, _ = _client(broker, version, None, "watcher", listener="internal")
    bob.send(Subscribe(1, [Subscription("plant/#", 1)]))
    assert isinstance(bob.recv(), Suback)
    alice, _ = _client(broker, version, "alice", "alice")
    alice.send(Publish("plant/bob/x", b"forged", 1, packet_id=7))
    ack = alice.recv()
    assert isinstance(ack, PubAck) and ack.packet_id == 7
    assert ack.reason_code == (0x87 if version == 5 else 0)
    alice.send(Publish("plant/bob/x", b"forged-qos0", 0))
    alice.send(Publish("plant/alice/ok", b"mine", 1, packet_id=8))
    assert alice.recv().packet_id == 8  # type: ignore[attr-defined]
    got = [p for p in bob.recv_all(1.0) if isinstance(p, Publish)]
    assert [(p.topic, p.payload) for p in got] == [("plant/alice/ok", b"mine")]
    assert _alive(alice)
    for c in (alice, bob):
        c.close()
    pair.finish()


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_9_3_subscribe_decided_once_none_refused_partial_filtered(broker: BrokerProcess, version: int) -> None:
    """SUBACK per filter [MQTT-3.9.3-1]: a filter alice can read nothing of is refused (5.0 0x87, 3.1.1 0x80);
    ``plant/alice/#`` (readable but for ``plant/alice/secret``) is granted and filtered per message, live and
    retained [MQTT-3.3.1-9]; ``public/#`` (all readable) is granted."""
    pair = _bystanders(broker, f"acl-sub-v{version}")
    feeder, _ = _client(broker, version, None, "feeder", listener="internal")  # no ACL on the internal listener
    for topic in ("plant/alice/secret", "plant/alice/ok"):
        feeder.send(Publish(topic, b"retained " + topic.encode(), 1, retain=True, packet_id=1))
        assert isinstance(feeder.recv(), PubAck)
    alice, _ = _client(broker, version, "alice", "alice")
    alice.send(Subscribe(2, [Subscription("plant/bob/#", 1), Subscription("plant/alice/#", 1),
                             Subscription("public/#", 0)]))
    suback = alice.recv()
    assert isinstance(suback, Suback)
    assert suback.reason_codes == [0x87 if version == 5 else 0x80, 1, 0]
    retained = [p for p in alice.recv_all(1.0) if isinstance(p, Publish)]
    assert [p.topic for p in retained] == ["plant/alice/ok"]
    for topic in ("plant/alice/secret", "plant/bob/x", "plant/alice/ok", "public/a"):
        feeder.send(Publish(topic, b"live", 0))
    live = [p.topic for p in alice.recv_all(1.0) if isinstance(p, Publish)]
    assert live == ["plant/alice/ok", "public/a"]
    for c in (alice, feeder):
        c.close()
    pair.finish()


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_1_2_will_on_a_topic_without_write_is_refused_at_connect(broker: BrokerProcess, version: int) -> None:
    """A Will Message on a topic the client may not write is refused at CONNECT (5.0 CONNACK 0x87, 3.1.1 return
    code 5) rather than dropped when it would be published [MQTT-3.1.4-2]; a Will on her own topic is accepted."""
    pair = _bystanders(broker, f"acl-will-v{version}")
    raw, ack = _client(broker, version, "alice", "w1", will=WillMessage("plant/bob/will", b"x", 1, False))
    _refused(raw, ack, version, 0x87, 5)
    raw, ack = _client(broker, version, "alice", "w1", will=WillMessage("plant/alice/will", b"x", 1, False))
    assert ack.reason_code == 0
    raw.close()
    pair.finish()


# ---------------------------------------------------------------------------------------------- take-over


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt_3_1_4_2_takeover_by_another_user_or_anonymous_is_refused(broker: BrokerProcess, version: int) -> None:
    """MQTT-3.1.4-2 allows take-over [MQTT-3.1.4-3]; this broker restricts it (README.md, Security): only the same
    user may take over an authenticated user's Client Identifier. bob (and an anonymous client on the other
    listener) get CONNACK 0x87 (3.1.1: 5) and alice's connection stays; alice herself takes over (5.0: the old one
    gets DISCONNECT 0x8E)."""
    pair = _bystanders(broker, f"takeover-v{version}")
    alice, ack = _client(broker, version, "alice", "device-1")
    assert ack.reason_code == 0
    raw, ack = _client(broker, version, "bob", "device-1")
    _refused(raw, ack, version, 0x87, 5)
    raw, ack = _client(broker, version, None, "device-1", listener="internal")
    _refused(raw, ack, version, 0x87, 5)
    assert _alive(alice)
    again, ack = _client(broker, version, "alice", "device-1")
    assert ack.reason_code == 0
    if version == 5:
        assert isinstance(alice.recv(), Disconnect)
    assert alice.closed_by_server()
    alice.close()
    assert _alive(again)
    again.close()
    pair.finish()


def test_session_owner_survives_a_restart(tmp_path: Path) -> None:
    """The session's user name is kept in the store: after a restart bob still cannot resume alice's persistent
    session (CONNACK 0x87), and alice resumes it with Session Present 1 [MQTT-3.2.2-3]."""
    _passwd(tmp_path / "passwd", "alice", "alice-pw", create=True)
    _passwd(tmp_path / "passwd", "bob", "bob-pw")
    (tmp_path / "acl").write_text(ACL)
    proc = BrokerProcess(_config(tmp_path), workdir=str(tmp_path)).start()
    try:
        raw, ack = _client(proc, 5, "alice", "dev-p", clean_start=False, properties={0x11: 3600})
        assert ack.reason_code == 0
        raw.send(Subscribe(1, [Subscription("plant/alice/#", 1)]))
        assert isinstance(raw.recv(), Suback)
        raw.close()
    finally:
        assert proc.stop() == 0
    proc = BrokerProcess(_config(tmp_path), workdir=str(tmp_path)).start()
    try:
        pair = _bystanders(proc, "takeover-restart")
        raw, ack = _client(proc, 5, "bob", "dev-p", clean_start=False)
        _refused(raw, ack, 5, 0x87, 5)
        raw, ack = _client(proc, 4, "bob", "dev-p", clean_start=True)
        _refused(raw, ack, 4, 0x87, 5)
        raw, ack = _client(proc, 5, "alice", "dev-p", clean_start=False, properties={0x11: 3600})
        assert ack.reason_code == 0 and ack.session_present
        raw.close()
        pair.finish()
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------- SIGHUP


def test_sighup_reloads_passwords_and_acls_and_keeps_old_rules_on_a_broken_file(broker: BrokerProcess) -> None:
    """SIGHUP reloads the password and ACL files without dropping connections: a user added with
    ``mosquitto_passwd`` can connect; a connected client's PARTIAL subscription is decided again under a changed
    ACL; a broken ACL file is logged with file, line and reason and the previous rules stay."""
    assert broker.proc is not None
    workdir = broker.workdir
    pair = _bystanders(broker, "sighup")
    raw, ack = _client(broker, 4, "carol", "c1")
    _refused(raw, ack, 4, 0x86, 4)
    feeder, _ = _client(broker, 4, None, "feeder", listener="internal")
    alice, _ = _client(broker, 4, "alice", "alice")
    alice.send(Subscribe(1, [Subscription("plant/alice/#", 0)]))
    assert isinstance(alice.recv(), Suback)

    _passwd(workdir / "passwd", "carol", "carol-pw")
    (workdir / "acl").write_text(ACL.replace("topic deny plant/alice/secret", "topic deny plant/alice/ok"))
    lines = len(broker.lines)
    broker.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: any("access rules reloaded" in line for line in broker.lines[lines:]), what=broker.log)
    raw, ack = _client(broker, 4, "carol", "c1")
    assert ack.reason_code == 0
    raw.close()
    for topic in ("plant/alice/ok", "plant/alice/secret"):
        feeder.send(Publish(topic, b"x", 0))
    assert [p.topic for p in alice.recv_all(1.0) if isinstance(p, Publish)] == ["plant/alice/secret"]

    (workdir / "acl").write_text(ACL + "topc read oops\n")
    lines = len(broker.lines)
    broker.proc.send_signal(signal.SIGHUP)
    acl_path = workdir / "acl"
    expected = f"{acl_path}:{ACL.count(chr(10)) + 1}: unknown keyword 'topc'"
    wait_until(lambda: any(expected in line for line in broker.lines[lines:]), what=broker.log)
    assert any("keeping the previous" in line for line in broker.lines[lines:])
    raw, ack = _client(broker, 4, "carol", "c1")  # still in force
    assert ack.reason_code == 0
    raw.close()
    for topic in ("plant/alice/ok", "plant/alice/secret"):
        feeder.send(Publish(topic, b"y", 0))
    assert [p.topic for p in alice.recv_all(1.0) if isinstance(p, Publish)] == ["plant/alice/secret"]
    assert _alive(alice) and _alive(feeder)
    for c in (alice, feeder):
        c.close()
    pair.finish()


# ---------------------------------------------------------------------------------------------- configuration


def _check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gw.toml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                          text=True, timeout=30)


def test_check_config_warns_of_a_password_entry_only_an_empty_password_matches(tmp_path: Path) -> None:
    """``check-config`` names the file, the line and the user of an entry hashed from the empty password (which
    ``mosquitto_passwd -b FILE USER ""`` writes): a zero-length Password is refused, so that user cannot connect.
    Entries with a password are not named; the configuration is still valid (exit 0)."""
    path = tmp_path / "passwd"
    _passwd(path, "alice", "alice-pw", create=True)
    _passwd(path, "eve", "")
    path.write_text("# operators\n" + path.read_text())
    result = _check_config(tmp_path, f"""
[listeners.x]
bind = "127.0.0.1:1883"
password_file = "{path}"
""")
    assert result.returncode == 0, result.stderr
    warning = (f"WARNING: {path}:3: user 'eve' has the hash of an empty password, which is refused (a zero-length "
               "Password counts as none), so this user cannot connect; set a password with 'edge-gateway passwd'")
    assert f"password_file {path} (2 users), {warning}" in result.stdout, result.stdout
    assert result.stdout.count("WARNING") == 1, result.stdout


def test_allow_anonymous_defaults_by_bind_address_and_files_are_checked(tmp_path: Path) -> None:
    """``allow_anonymous`` defaults to false on a listener bound to a non-loopback address and to true on loopback
    (127.0.0.0/8 included) and Unix sockets; ``check-config`` says so, and names the file, line and reason of a bad
    password or ACL file."""
    result = _check_config(tmp_path, """
[listeners.lan]
bind = "0.0.0.0:1883"
[listeners.v6]
bind = "[::]:1885"
[listeners.lo]
bind = "127.0.0.2:1884"
[listeners.sock]
bind = "/run/edge-gateway/mqtt.sock"
[listeners.strict]
bind = "127.0.0.1:1886"
allow_anonymous = false
""")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "listener lan: anonymous refused (default: bind is not loopback)" in out
    assert "listener v6: anonymous refused (default: bind is not loopback)" in out
    assert "listener lo: anonymous allowed (default: loopback or Unix socket bind)" in out
    assert "listener sock: anonymous allowed (default: loopback or Unix socket bind)" in out
    assert "listener strict: anonymous refused, WARNING: no password_file: no client can connect" in out

    (tmp_path / "acl").write_text("user alice\ntopic sideways plant/#\n")
    (tmp_path / "passwd").write_text("alice:$7$101$bad\n")
    result = _check_config(tmp_path, f"""
[listeners.x]
bind = "127.0.0.1:1883"
allow_anonymous = "no"
password_file = "{tmp_path / 'passwd'}"
acl_file = "{tmp_path / 'acl'}"
""")
    assert result.returncode == 1
    err = result.stderr
    assert "listeners.x.allow_anonymous = 'no': must be true or false" in err
    assert f"listeners.x.acl_file: {tmp_path / 'acl'}:2: access 'sideways' is not one of" in err
    assert f"listeners.x.password_file: {tmp_path / 'passwd'}:1: " in err
