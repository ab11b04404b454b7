"""``edge-gateway passwd``, run as a real process: -c, -b, --password-stdin, the interactive prompt on a
pseudo-terminal, -D, errors and exit codes; the file it writes is what Mosquitto and mosquitto_passwd read."""

from __future__ import annotations

import os
import pty
import select
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from auth_helpers import MosquittoBroker, mosquitto_pub

from gateway.auth.passwd import PasswordFile

CMD = [sys.executable, "-m", "gateway", "passwd"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMD, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_create_add_update_delete(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    r = run("-c", "-b", str(path), "alice", "a-pw")
    assert r.returncode == 0, r.stderr
    assert "added user 'alice'" in r.stdout
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().startswith("alice:$7$101$")

    r = run("--password-stdin", str(path), "bob", stdin="b pw with spaces\nignored second line\n")
    assert r.returncode == 0, r.stderr
    r = run("-b", str(path), "alice", "new-pw")
    assert r.returncode == 0 and "updated user 'alice'" in r.stdout
    pf = PasswordFile.load(path)
    assert pf.usernames() == ["alice", "bob"]
    assert pf.verify("alice", "new-pw") and not pf.verify("alice", "a-pw")
    assert pf.verify("bob", "b pw with spaces")

    r = run("-D", str(path), "alice")
    assert r.returncode == 0 and "deleted user 'alice'" in r.stdout
    assert PasswordFile.load(path).usernames() == ["bob"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]  # no temporary file left behind


def test_errors_and_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    r = run("-b", str(path), "alice", "x")
    assert r.returncode == 1 and "does not exist (use -c to create it)" in r.stderr
    assert run("-c", "-b", str(path), "alice", "x").returncode == 0
    r = run("-D", str(path), "nobody")
    assert r.returncode == 1 and "'nobody' is not in" in r.stderr
    r = run("-b", str(path), "a:b", "x")
    assert r.returncode == 1 and "':'" in r.stderr
    r = run("--password-stdin", str(path), "carol", stdin="\n")
    assert r.returncode == 1 and "the password is empty" in r.stderr
    r = run(str(path), "carol")  # stdin is not a terminal
    assert r.returncode == 1 and "--password-stdin" in r.stderr
    assert run("-D", "-b", str(path), "alice", "x").returncode == 2
    assert run("-b", str(path), "alice").returncode == 2
    assert run(str(path), "alice", "pw").returncode == 2
    before = path.read_text()
    path.write_text(before + "broken line\n")
    r = run("-b", str(path), "dave", "x")
    assert r.returncode == 1 and f"{path}:2: expected 'username:hash'" in r.stderr
    assert PasswordFile.parse(before).usernames() == ["alice"]


def _pty_run(args: list[str], answers: list[str], timeout: float = 20.0) -> tuple[int, str]:
    """Run ``args`` on a new pseudo-terminal (its controlling terminal, as getpass needs), typing each answer after
    each "password:" prompt; returns the exit status and everything printed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.execv(args[0], args)
    output = b""
    pending = list(answers)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 1024)
                except OSError:
                    break
                if not chunk:
                    break
                output += chunk
                if pending and output.lower().count(b"password:") > len(answers) - len(pending):
                    os.write(fd, pending.pop(0).encode() + b"\r")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


def test_interactive_prompt_asks_twice_without_echo(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    code, out = _pty_run([*CMD, "-c", str(path), "alice"], ["typed secret", "typed secret"])
    assert code == 0, out
    assert "Password:" in out and "Reenter password:" in out and "typed secret" not in out
    assert PasswordFile.load(path).verify("alice", "typed secret")
    code, out = _pty_run([*CMD, str(path), "alice"], ["one", "two"])
    assert code == 1 and "do not match" in out
    assert PasswordFile.load(path).verify("alice", "typed secret")


def test_passwd_refuses_an_empty_password_from_every_source(tmp_path: Path) -> None:
    """A zero-length password is refused at CONNECT (it counts as none), so ``passwd`` refuses to set one, from
    ``-b``, ``--password-stdin`` and the prompt alike: exit status 1, "the password is empty", and the file is not
    created (``-c``) or not changed."""
    path = tmp_path / "passwd"
    r = run("-c", "-b", str(path), "alice", "")
    assert r.returncode == 1 and "the password is empty" in r.stderr and not path.exists()
    assert run("-c", "-b", str(path), "alice", "a-pw").returncode == 0
    before = path.read_bytes()
    r = run("-b", str(path), "alice", "")
    assert r.returncode == 1 and "the password is empty" in r.stderr
    r = run("--password-stdin", str(path), "bob", stdin="\n")
    assert r.returncode == 1 and "the password is empty" in r.stderr
    code, out = _pty_run([*CMD, str(path), "alice"], ["", ""])
    assert code == 1 and "the password is empty" in out, out
    assert path.read_bytes() == before
    assert PasswordFile.load(path).verify("alice", "a-pw")


@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd is not installed")
def test_mosquitto_passwd_and_mosquitto_read_what_it_writes(tmp_path: Path) -> None:
    """mosquitto_passwd edits our file (adds a user), we edit it again, and a real mosquitto logs both users in."""
    path = tmp_path / "passwd"
    assert run("-c", "-b", str(path), "alice", "a-pw").returncode == 0
    subprocess.run(["mosquitto_passwd", "-b", str(path), "bob", "b-pw"], check=True, capture_output=True, timeout=30)
    assert run("--password-stdin", str(path), "carol", stdin="c-pw\n").returncode == 0
    with MosquittoBroker(tmp_path, f"allow_anonymous false\npassword_file {path}\n") as broker:
        for user in ("alice", "bob", "carol"):
            assert mosquitto_pub(broker.port, user, user[0] + "-pw").returncode == 0, (user, broker.log())
        assert mosquitto_pub(broker.port, "alice", "b-pw").returncode != 0


def test_help_teaches(tmp_path: Path) -> None:
    r = subprocess.run([*CMD, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for phrase in ("--password-stdin", "-D /etc/edge-gateway/passwd bob", "mosquitto_passwd", "0600", "atomically"):
        assert phrase in r.stdout, phrase
    top = subprocess.run([sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True, timeout=30)
    assert "edge-gateway passwd FILE USER" in top.stdout and "passwd" in top.stdout
