"""Mosquitto's password file: read, verify, write (``mosquitto_passwd(1)``, ``mosquitto.conf(5)`` ``password_file``).

One entry a line, ``username:hash``, the hash in one of the two formats Mosquitto 2.0 reads (its
``src/password_mosq.c``, ``pw__hash``):

- ``$7$<iterations>$<salt b64>$<hash b64>``: PBKDF2-HMAC-SHA512 of the UTF-8 password with the raw salt,
  ``iterations`` rounds, 64 bytes out. ``mosquitto_passwd`` (the default, ``-H sha512-pbkdf2``) writes a 12-byte
  salt and 101 iterations (``PW_DEFAULT_ITERATIONS`` in Mosquitto 2.0).
- ``$6$<salt b64>$<hash b64>``: SHA-512 of the password followed by the raw salt (``-H sha512``, the format of
  Mosquitto 1.6 and earlier).

Base64 is the standard alphabet with padding. Lines that are blank or start with ``#`` are kept as they are and
ignored. Unlike Mosquitto, which skips or drops what it cannot read, any other malformed line is an error naming the
file, the line and the reason: a password file is security configuration, and a typo must not lock a user out (or in)
silently.

Verification hashes with :mod:`hashlib` and compares with :func:`hmac.compare_digest`; an unknown user is checked
against a dummy hash of the file's usual cost, so that an unknown name and a wrong password take the same time.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass

from gateway.auth.textfile import FileLineError, read_text

#: PBKDF2 rounds ``mosquitto_passwd`` of Mosquitto 2.0 writes (``PW_DEFAULT_ITERATIONS``, ``password_mosq.h``).
DEFAULT_ITERATIONS = 101
#: Salt length in bytes that ``mosquitto_passwd`` writes (``SALT_LEN``, ``password_mosq.h``).
SALT_LEN = 12
#: SHA-512 output, bytes: the length of both hash kinds.
HASH_LEN = 64
#: Upper bound on ``$7$`` iterations we accept from a file: a hostile or mistyped count must not stall CONNECTs.
MAX_ITERATIONS = 10_000_000


class PasswordFileError(FileLineError):
    """A password file that cannot be read or parsed; ``str()`` is ``"<path>:<line>: <reason>"``."""


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{what} is not valid base64 ({exc})") from None


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _password_bytes(password: str | bytes) -> bytes:
    return password.encode("utf-8") if isinstance(password, str) else bytes(password)


@dataclass(frozen=True)
class PasswordHash:
    """One hashed password: ``kind`` 7 (PBKDF2-SHA512, ``iterations`` rounds) or 6 (salted SHA-512, iterations 0)."""

    kind: int
    iterations: int
    salt: bytes
    digest: bytes

    @classmethod
    def parse(cls, text: str) -> PasswordHash:
        """Read ``$7$...`` or ``$6$...``; :class:`ValueError` says what is wrong."""
        parts = text.split("$")
        if len(parts) < 2 or parts[0] != "":
            raise ValueError(
                "the password is not hashed (expected $7$... or $6$...; "
                "hash it with 'edge-gateway passwd' or 'mosquitto_passwd -U')"
            )
        if parts[1] == "7":
            if len(parts) != 5:
                raise ValueError("a $7$ hash has four fields: $7$<iterations>$<salt>$<hash>")
            if not parts[2].isdigit() or not 1 <= int(parts[2]) <= MAX_ITERATIONS:
                raise ValueError(f"$7$ iterations {parts[2]!r} is not a whole number from 1 to {MAX_ITERATIONS}")
            iterations = int(parts[2])
            salt, digest = parts[3], parts[4]
        elif parts[1] == "6":
            if len(parts) != 4:
                raise ValueError("a $6$ hash has three fields: $6$<salt>$<hash>")
            iterations = 0
            salt, digest = parts[2], parts[3]
        else:
            raise ValueError(f"unknown hash type ${parts[1]}$ (Mosquitto 2.0 writes $7$, 1.6 and earlier $6$)")
        salt_bytes = _b64decode(salt, "the salt")
        digest_bytes = _b64decode(digest, "the hash")
        if not salt_bytes:
            raise ValueError("the salt is empty")
        if len(digest_bytes) != HASH_LEN:
            raise ValueError(f"the hash is {len(digest_bytes)} bytes, SHA-512 gives {HASH_LEN}")
        return cls(int(parts[1]), iterations, salt_bytes, digest_bytes)

    @classmethod
    def create(
        cls, password: str | bytes, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
    ) -> PasswordHash:
        """A new ``$7$`` hash of ``password`` with a fresh random 12-byte salt (or ``salt``)."""
        salt = secrets.token_bytes(SALT_LEN) if salt is None else salt
        digest = hashlib.pbkdf2_hmac("sha512", _password_bytes(password), salt, iterations, HASH_LEN)
        return cls(7, iterations, salt, digest)

    def compute(self, password: str | bytes) -> bytes:
        """The digest ``password`` gives with this entry's kind, salt and iterations."""
        pw = _password_bytes(password)
        if self.kind == 7:
            return hashlib.pbkdf2_hmac("sha512", pw, self.salt, self.iterations, HASH_LEN)
        return hashlib.sha512(pw + self.salt).digest()

    def verify(self, password: str | bytes) -> bool:
        """Whether ``password`` gives this digest (constant-time compare)."""
        return hmac.compare_digest(self.compute(password), self.digest)

    def encode(self) -> str:
        """The text after ``username:`` in the file."""
        if self.kind == 7:
            return f"$7${self.iterations}${_b64encode(self.salt)}${_b64encode(self.digest)}"
        return f"$6${_b64encode(self.salt)}${_b64encode(self.digest)}"


def _check_username(username: str) -> str | None:
    if not username:
        return "the user name is empty"
    if ":" in username:
        return "a user name must not contain ':' (mosquitto_passwd(1))"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in username):
        return "a user name must not contain control characters"
    if username != username.strip():
        return "a user name must not start or end with white space"
    return None


class PasswordFile:
    """The entries of one password file, in file order, with its comments and blank lines kept for rewriting."""

    def __init__(self, path: str = "<memory>") -> None:
        self.path = path
        #: file lines in order: (username, None) for an entry, (None, raw text) for a comment or blank line
        self._lines: list[tuple[str | None, str | None]] = []
        self._entries: dict[str, PasswordHash] = {}
        self._dummy: PasswordHash | None = None

    # -- reading -------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PasswordFile:
        """Read and parse ``path``; :class:`PasswordFileError` names the file, the line and the reason."""
        name, text = read_text(path, PasswordFileError)
        return cls.parse(text, name)

    @classmethod
    def parse(cls, text: str, path: str = "<memory>") -> PasswordFile:
        """Parse the text of a password file (``path`` only names it in errors)."""
        pf = cls(path)
        seen: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                pf._lines.append((None, raw))
                continue
            username, sep, hashed = line.partition(":")
            username, hashed = username.strip(), hashed.strip()
            if not sep:
                raise PasswordFileError(path, number, "expected 'username:hash' (no ':' in the line)")
            error = _check_username(username) if username else "the user name before ':' is empty"
            if error:
                raise PasswordFileError(path, number, error)
            if username in seen:
                raise PasswordFileError(path, number, f"user {username!r} is already on line {seen[username]}")
            try:
                entry = PasswordHash.parse(hashed)
            except ValueError as exc:
                raise PasswordFileError(path, number, f"user {username!r}: {exc}") from None
            seen[username] = number
            pf._entries[username] = entry
            pf._lines.append((username, None))
        return pf

    # -- queries -------------------------------------------------------------------------------------------------
    def __contains__(self, username: object) -> bool:
        return username in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def usernames(self) -> list[str]:
        """User names in file order."""
        return [u for u, _ in self._lines if u is not None]

    def get(self, username: str) -> PasswordHash | None:
        """The hash of ``username``, or ``None``."""
        return self._entries.get(username)

    def empty_password_entries(self) -> list[tuple[int, str]]:
        """``(line number, user name)`` of each entry whose hash is that of the empty password, in file order: an
        entry that only a zero-length password would match, which :meth:`verify` refuses, so that user cannot log
        in (``mosquitto_passwd`` and older tools could write one). Costs one hash per entry, as many as logging
        every user in once; for ``check-config``, not for the broker's start."""
        found = []
        for number, (username, _raw) in enumerate(self._lines, 1):
            if username is not None and self._entries[username].verify(b""):
                found.append((number, username))
        return found

    def _dummy_hash(self) -> PasswordHash:
        """A hash of the file's most common kind and iteration count, checked for unknown users."""
        if self._dummy is None:
            common = collections.Counter((e.kind, e.iterations) for e in self._entries.values()).most_common(1)
            kind, iterations = common[0][0] if common else (7, DEFAULT_ITERATIONS)
            salt = secrets.token_bytes(SALT_LEN)
            self._dummy = PasswordHash(kind, iterations, salt, secrets.token_bytes(HASH_LEN))
        return self._dummy

    def verify(self, username: str | None, password: str | bytes | None) -> bool:
        """Whether ``username`` is in the file and ``password`` is its password.

        A missing user name or password, a zero-length password (absent, as Mosquitto reads it: an entry hashed
        from the empty password matches nothing), or an unknown user, is checked against a dummy hash of the
        file's usual cost and returns ``False``: the time taken does not tell which of them was wrong. The MQTT
        password is binary data (MQTT 5.0 §3.1.3.6); a ``str`` is taken as UTF-8.
        """
        entry = self._entries.get(username) if username is not None else None
        if entry is None or not password:
            self._dummy_hash().verify(password or b"")
            return False
        return entry.verify(password)

    # -- changes -------------------------------------------------------------------------------------------------
    def set(self, username: str, password: str | bytes, iterations: int = DEFAULT_ITERATIONS) -> bool:
        """Add ``username`` or replace its password with a new ``$7$`` hash; ``True`` when it was added.

        :class:`ValueError` for a user name ``mosquitto_passwd`` would refuse or an empty password.
        """
        if not _password_bytes(password):
            raise ValueError("the password is empty")
        return self.set_hash(username, PasswordHash.create(password, iterations))

    def set_hash(self, username: str, entry: PasswordHash) -> bool:
        """Add ``username`` with ``entry`` or replace its hash; ``True`` when it was added."""
        error = _check_username(username)
        if error:
            raise ValueError(error)
        added = username not in self._entries
        self._entries[username] = entry
        if added:
            self._lines.append((username, None))
        self._dummy = None
        return added

    def delete(self, username: str) -> bool:
        """Remove ``username``; ``False`` when it was not there."""
        if username not in self._entries:
            return False
        del self._entries[username]
        self._lines = [(u, raw) for u, raw in self._lines if u != username]
        self._dummy = None
        return True

    def dumps(self) -> str:
        """The file's text: entries as ``username:hash``, comments and blank lines as they were."""
        out = [f"{u}:{self._entries[u].encode()}" if u is not None else (raw or "") for u, raw in self._lines]
        return "".join(line + "\n" for line in out)

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write atomically to ``path`` (default: where it was read from).

        The new file is written beside the old one, flushed to disk and renamed over it, so a reader (the broker
        on SIGHUP) sees the old file or the new, never a part. A new file gets mode 0600; a replaced file keeps
        its owner and group (when we may set them) and its mode less any bits for others and group write
        (so at most 0640, the mode a broker's group may read).
        """
        target = os.fspath(path) if path is not None else self.path
        directory = os.path.dirname(os.path.abspath(target))
        mode, owner = 0o600, None
        try:
            st = os.stat(target)
            mode, owner = stat.S_IMODE(st.st_mode) & 0o640, (st.st_uid, st.st_gid)
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(prefix=".passwd-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(f.fileno(), mode | 0o600)
                if owner is not None and owner != (os.geteuid(), os.getegid()):
                    try:
                        os.fchown(f.fileno(), *owner)
                    except PermissionError:
                        pass
                f.write(self.dumps())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.path = target
