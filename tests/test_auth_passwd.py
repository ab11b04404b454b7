"""gateway.auth.passwd and gateway.auth.throttle: Mosquitto's password file format, checked both ways
against Debian's ``mosquitto_passwd`` and a real ``mosquitto`` broker, and the CONNECT failure throttle."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from auth_helpers import MosquittoBroker, mosquitto_pub

from gateway.auth.passwd import DEFAULT_ITERATIONS, SALT_LEN, PasswordFile, PasswordFileError, PasswordHash
from gateway.auth.throttle import FailureThrottle

needs_mosquitto_passwd = pytest.mark.skipif(
    shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd is not installed (make deps installs it)"
)


def _mosquitto_passwd(*args: str) -> None:
    subprocess.run(["mosquitto_passwd", *args], check=True, capture_output=True, timeout=30)


@needs_mosquitto_passwd
def test_a_file_made_by_mosquitto_passwd_verifies(tmp_path: Path) -> None:
    """Debian's mosquitto_passwd writes $7$ (default) and $6$ (-H sha512) entries; each verifies, wrong passwords
    and unknown users do not."""
    path = tmp_path / "pw"
    _mosquitto_passwd("-c", "-b", str(path), "alice", "s3cret")
    _mosquitto_passwd("-b", str(path), "bob", "pä ss wörd:$x")
    _mosquitto_passwd("-H", "sha512", "-b", str(path), "carol", "old-style")
    pf = PasswordFile.load(path)
    assert pf.usernames() == ["alice", "bob", "carol"]
    alice, carol = pf.get("alice"), pf.get("carol")
    assert alice is not None and (alice.kind, alice.iterations, len(alice.salt)) == (7, DEFAULT_ITERATIONS, SALT_LEN)
    assert carol is not None and carol.kind == 6
    assert pf.verify("alice", "s3cret")
    assert pf.verify("bob", "pä ss wörd:$x".encode())
    assert pf.verify("carol", "old-style")
    assert not pf.verify("alice", "s3cret ")
    assert not pf.verify("alice", "old-style")
    assert not pf.verify("carol", "s3cret")
    assert not pf.verify("dave", "s3cret")
    assert not pf.verify(None, "s3cret")
    assert not pf.verify("alice", None)


@needs_mosquitto_passwd
def test_our_rewrite_of_a_mosquitto_passwd_file_keeps_the_other_entries_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    _mosquitto_passwd("-c", "-b", str(path), "alice", "a")
    _mosquitto_passwd("-b", str(path), "bob", "b")
    original = path.read_text().splitlines()
    pf = PasswordFile.load(path)
    pf.set("carol", "c")
    pf.save()
    lines = path.read_text().splitlines()
    assert lines[:2] == original
    assert lines[2].startswith("carol:$7$101$")


def test_a_file_we_write_is_accepted_by_a_real_mosquitto(tmp_path: Path) -> None:
    """mosquitto 2.0 with password_file and allow_anonymous false: our $7$ and $6$ entries log in with the right
    password (mosquitto_pub -u -P exits 0); a wrong password, an unknown user and no user are refused."""
    pf = PasswordFile.parse("# comments and blank lines, which Mosquitto skips too\n\n", str(tmp_path / "pw"))
    pf.set("alice", "s3cret")
    pf.set("bob", "pä ss wörd")
    pf.set("dave", "many rounds", iterations=5000)  # Mosquitto reads the count from the entry
    salt = os.urandom(SALT_LEN)
    old = PasswordHash(6, 0, salt, hashlib.sha512(b"legacy" + salt).digest())
    pf.set_hash("carol", old)
    pf.save()
    assert stat.S_IMODE(os.stat(tmp_path / "pw").st_mode) == 0o600
    assert PasswordFile.load(tmp_path / "pw").verify("carol", "legacy")
    extra = f"allow_anonymous false\npassword_file {tmp_path / 'pw'}\n"
    with MosquittoBroker(tmp_path, extra) as broker:
        for user, password in (
            ("alice", "s3cret"),
            ("bob", "pä ss wörd"),
            ("carol", "legacy"),
            ("dave", "many rounds"),
        ):
            result = mosquitto_pub(broker.port, user, password)
            assert result.returncode == 0, (user, result.stderr, broker.log())
        for user, password in (("alice", "wrong"), ("alice", "legacy"), ("dave", "many"), ("mallory", "s3cret")):
            result = mosquitto_pub(broker.port, user, password)
            assert result.returncode != 0, (user, password)
            assert "not authori" in result.stderr.lower(), result.stderr
        anonymous = subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", "t", "-m", "x"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert anonymous.returncode != 0


def test_the_hash_formats_round_trip_and_match_the_definitions() -> None:
    salt = bytes(range(12))
    h7 = PasswordHash.create("pw", iterations=5, salt=salt)
    assert h7.digest == hashlib.pbkdf2_hmac("sha512", b"pw", salt, 5, 64)
    assert h7.encode() == f"$7$5${base64.b64encode(salt).decode()}${base64.b64encode(h7.digest).decode()}"
    assert PasswordHash.parse(h7.encode()) == h7
    h6 = PasswordHash(6, 0, salt, hashlib.sha512(b"pw" + salt).digest())
    assert PasswordHash.parse(h6.encode()) == h6
    assert h6.verify("pw") and not h6.verify("pW")


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("alice:$7$101$AAAAAAAAAAAAAAAA$" + "A" * 86 + "==\nbob\n", 2, "no ':'"),
        ("# c\n\nalice:plaintext\n", 3, "not hashed"),
        ("alice:$5$abc$def\n", 1, "unknown hash type $5$"),
        ("alice:$7$x$AAAA$AAAA\n", 1, "iterations 'x'"),
        ("alice:$7$0$AAAA$AAAA\n", 1, "iterations '0'"),
        ("alice:$7$101$AAAA\n", 1, "four fields"),
        ("alice:$6$AAAA$AAAA$AAAA\n", 1, "three fields"),
        ("alice:$7$101$!!!!$AAAA\n", 1, "the salt is not valid base64"),
        ("alice:$7$101$AAAA$AAAA\n", 1, "the hash is 3 bytes, SHA-512 gives 64"),
        (":$7$101$AAAA$AAAA\n", 1, "user name before ':' is empty"),
        ("a:$6$AAAA$" + "A" * 86 + "==\na:$6$AAAA$" + "A" * 86 + "==\n", 2, "already on line 1"),
    ],
)
def test_parse_errors_name_the_file_the_line_and_the_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(PasswordFileError) as info:
        PasswordFile.parse(text, "/etc/pw")
    assert (info.value.path, info.value.line) == ("/etc/pw", line)
    assert reason in info.value.reason
    assert str(info.value).startswith(f"/etc/pw:{line}: ")


def test_unreadable_and_non_utf8_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(PasswordFileError, match=r"/missing: cannot read"):
        PasswordFile.load(tmp_path / "missing")
    (tmp_path / "latin1").write_bytes(b"# ok\n\xe9t\xe9:$6$x$y\n")
    with pytest.raises(PasswordFileError, match=r"latin1:2: not UTF-8"):
        PasswordFile.load(tmp_path / "latin1")


def test_set_delete_and_save_keep_comments_and_are_atomic(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    pf = PasswordFile(str(path))
    pf.set("alice", "a")
    pf.set("bob", "b")
    pf.save()
    text = "# operators\n\n" + path.read_text()
    path.write_text(text)
    os.chmod(path, 0o644)
    pf = PasswordFile.load(path)
    assert not pf.set("alice", "A")
    assert pf.delete("bob") and not pf.delete("bob")
    pf.save()
    lines = path.read_text().splitlines()
    assert lines[:2] == ["# operators", ""] and len(lines) == 3 and lines[2].startswith("alice:$7$")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # group read kept, world read removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pw"]
    assert PasswordFile.load(path).verify("alice", "A")
    with pytest.raises(ValueError, match="':'"):
        pf.set("a:b", "x")
    with pytest.raises(ValueError, match="empty"):
        pf.set("eve", "")


def test_a_zero_length_password_matches_no_entry_not_even_one_hashed_from_it() -> None:
    """A zero-length password counts as none, as Mosquitto reads it: :meth:`PasswordFile.verify` refuses it for
    every user, also for an entry that is the hash of the empty password (which ``mosquitto_passwd -b F U ""``
    writes); :meth:`PasswordFile.empty_password_entries` names such entries by line, and only them."""
    eve = PasswordHash.create("")
    assert eve.verify(b"")  # the entry really is the hash of the empty password
    pf = PasswordFile.parse(f"# operators\nalice:{PasswordHash.create('a').encode()}\neve:{eve.encode()}\n")
    assert not pf.verify("eve", b"") and not pf.verify("eve", "") and not pf.verify("alice", b"")
    assert pf.verify("alice", "a") and not pf.verify("eve", "a")
    assert pf.empty_password_entries() == [(3, "eve")]


def test_an_unknown_user_takes_as_long_as_a_wrong_password() -> None:
    """With a costly hash (200,000 PBKDF2 rounds, tens of ms) a failure for an unknown user takes the time of a
    wrong password: without the dummy hash it would return at once."""
    pf = PasswordFile.parse(f"alice:{PasswordHash.create('right', iterations=200_000).encode()}\n")

    def timed(user: str) -> float:
        start = time.perf_counter()
        assert not pf.verify(user, "wrong")
        return time.perf_counter() - start

    samples: dict[str | None, list[float]] = {"alice": [], "nobody": [], None: []}
    for _ in range(7):  # interleaved, and the minimum of each: robust to a busy machine
        for user, times in samples.items():
            times.append(timed(user))  # type: ignore[arg-type]
    wrong, unknown, no_user = (min(samples[u]) for u in ("alice", "nobody", None))
    assert wrong > 0.005
    assert 0.33 < unknown / wrong < 3.0, samples
    assert 0.33 < no_user / wrong < 3.0, samples


def test_throttle_is_free_at_first_then_doubles_up_to_the_cap() -> None:
    t = FailureThrottle(free_failures=2, base_delay=0.5, max_delay=4.0, forget_after=60.0)
    assert t.delay("10.0.0.1", 0.0) == 0.0
    delays = [t.failure("10.0.0.1", float(i)) for i in range(8)]
    assert delays == [0.0, 0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert t.delay("10.0.0.1", 8.0) == 4.0
    assert t.delay("10.0.0.2", 8.0) == 0.0  # another address is not affected


def test_throttle_forgets_after_a_quiet_period_and_on_success() -> None:
    t = FailureThrottle(free_failures=0, base_delay=1.0, max_delay=8.0, forget_after=60.0)
    t.failure("a", 0.0)
    t.failure("a", 30.0)
    assert t.delay("a", 89.0) == 2.0  # 59 s after the last failure
    assert t.delay("a", 90.0) == 0.0 and len(t) == 0
    t.failure("b", 0.0)
    t.success("b")
    assert t.delay("b", 1.0) == 0.0


def test_throttle_memory_is_bounded() -> None:
    t = FailureThrottle(free_failures=0, max_addresses=100)
    for i in range(1000):
        t.failure(f"10.0.{i // 256}.{i % 256}", float(i))
    assert len(t) == 100
    assert t.delay("10.0.3.231", 1000.0) > 0  # the most recent are kept
    assert t.delay("10.0.0.0", 1000.0) == 0.0
