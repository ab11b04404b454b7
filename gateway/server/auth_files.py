"""The authentication keys of a listener: read and check ``allow_anonymous``, ``password_file`` and ``acl_file``,
load the files, and hand the broker core its :class:`~gateway.broker.access_decisions.ListenerAccess` objects; reload
the files on SIGHUP.

Keys (``[listeners.<name>]``, Mosquitto's names and meaning, ``mosquitto.conf(5)``):

- ``allow_anonymous``: clients without a verified user name may connect. Default ``true`` on a listener bound to a
  loopback address (127.0.0.0/8, ``::1``, ``localhost``) or a Unix socket, ``false`` elsewhere (``0.0.0.0``, a LAN
  address). Mosquitto 2.0 defaults to ``false`` on every configured listener; ``allow_anonymous = false`` on a
  loopback listener gives its behaviour.
- ``password_file``: Mosquitto's password file (``mosquitto_passwd(1)``; :mod:`gateway.auth.passwd`).
- ``acl_file``: Mosquitto's ACL file (:mod:`gateway.auth.acl`).
- ``use_identity_as_username`` (a TLS key, :mod:`gateway.auth.tls`): the verified client certificate's CN is the
  user name; not together with ``password_file`` (Mosquitto would ignore the password file then).

The files are read when the configuration is loaded, so ``edge-gateway check-config`` and a start both report a
missing file or a bad line as ``listeners.<name>.<key>: <file>:<line>: <reason>``.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from gateway.auth.acl import Acl, AclFileError
from gateway.auth.passwd import PasswordFile, PasswordFileError
from gateway.broker.access_decisions import ListenerAccess
from gateway.values import is_unix_path, parse_address

log = logging.getLogger("gateway.server")

#: The authentication keys of a listener (``use_identity_as_username`` is read with the TLS keys).
AUTH_KEYS = ("allow_anonymous", "password_file", "acl_file")


@dataclass(slots=True)
class AuthConfig:
    """A listener's authentication settings and the files as loaded.

    Attributes:
        allow_anonymous: as configured, or the default for the bind address.
        anonymous_default: ``allow_anonymous`` was not given (the bind address decided).
        password_file / acl_file: the paths, or ``None``.
        use_identity_as_username: the TLS key of that name.
        passwords / acl: the parsed files (``None`` without them).
    """

    allow_anonymous: bool
    anonymous_default: bool = True
    password_file: str | None = None
    acl_file: str | None = None
    use_identity_as_username: bool = False
    passwords: PasswordFile | None = None
    acl: Acl | None = None

    def access(self) -> ListenerAccess:
        """What the broker core gets for this listener."""
        return ListenerAccess(self.allow_anonymous, self.passwords, self.acl, self.use_identity_as_username)

    def describe(self) -> str:
        """One line for ``check-config``: who may connect, which files, and a WARNING for a setting that lets
        nobody in: no ``password_file`` where anonymous clients are refused, or a password file entry hashed from
        the empty password (:meth:`PasswordFile.empty_password_entries`)."""
        why = " (default: loopback or Unix socket bind)" if self.allow_anonymous else " (default: bind is not loopback)"
        parts = [("anonymous allowed" if self.allow_anonymous else "anonymous refused")
                 + (why if self.anonymous_default else "")]
        if self.passwords is not None:
            parts.append(f"password_file {self.password_file} ({len(self.passwords)} users)")
            parts.extend(f"WARNING: {self.password_file}:{line}: user {user!r} has the hash of an empty password, "
                         "which is refused (a zero-length Password counts as none), so this user cannot connect; "
                         "set a password with 'edge-gateway passwd'"
                         for line, user in self.passwords.empty_password_entries())
        if self.use_identity_as_username:
            parts.append("certificate CN as user name")
        if self.acl is not None:
            rules = len(self.acl.anonymous) + len(self.acl.patterns) + sum(map(len, self.acl.users.values()))
            parts.append(f"acl_file {self.acl_file} ({rules} rules)")
        if not self.allow_anonymous and self.passwords is None and not self.use_identity_as_username:
            parts.append("WARNING: no password_file: no client can connect")
        return ", ".join(parts)


def is_loopback_bind(bind: str) -> bool:
    """Whether ``bind`` is a Unix socket or a loopback address (127.0.0.0/8, ``::1``, ``localhost``)."""
    if is_unix_path(bind):
        return True
    host = parse_address(bind).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def load_files(auth: AuthConfig) -> tuple[PasswordFile | None, Acl | None]:
    """Read the listener's password and ACL files.

    Raises:
        PasswordFileError, AclFileError: naming the file, the line and the reason.
    """
    passwords = PasswordFile.load(auth.password_file) if auth.password_file is not None else None
    acl = Acl.load(auth.acl_file) if auth.acl_file is not None else None
    return passwords, acl


def load_auth(where: str, table: dict[str, Any], bind: str | None, errors: list[str]) -> AuthConfig:
    """The authentication keys of ``[listeners.<name>]`` (``where``), their files loaded; each mistake appends
    ``where.key = value: reason`` (a file's own errors: ``where.key: file:line: reason``) to ``errors``."""
    auth = AuthConfig(allow_anonymous=bind is None or is_loopback_bind(bind))
    value = table.get("allow_anonymous")
    if value is not None:
        if isinstance(value, bool):
            auth.allow_anonymous, auth.anonymous_default = value, False
        else:
            errors.append(f"{where}.allow_anonymous = {value!r}: must be true or false")
    for key in ("password_file", "acl_file"):
        path = table.get(key)
        if path is None:
            continue
        if not isinstance(path, str) or not path:
            errors.append(f"{where}.{key} = {path!r}: must be a file path")
        else:
            setattr(auth, key, path)
    auth.use_identity_as_username = table.get("use_identity_as_username") is True
    if auth.use_identity_as_username and auth.password_file is not None:
        errors.append(f"{where}.use_identity_as_username = true: not together with password_file (the certificate's "
                      "CN or the password file names the user; Mosquitto would ignore the password file)")
    try:
        auth.passwords = PasswordFile.load(auth.password_file) if auth.password_file is not None else None
    except PasswordFileError as exc:
        errors.append(f"{where}.password_file: {exc}")
    try:
        auth.acl = Acl.load(auth.acl_file) if auth.acl_file is not None else None
    except AclFileError as exc:
        errors.append(f"{where}.acl_file: {exc}")
    return auth


def reload_access(auths: dict[str, AuthConfig]) -> dict[str, ListenerAccess] | None:
    """Read every listener's files again (SIGHUP). All or nothing: on any error each is logged (file, line,
    reason), the old rules stay, and ``None`` is returned; else the new objects are kept in ``auths`` and the
    broker's rules returned."""
    loaded: dict[str, tuple[PasswordFile | None, Acl | None]] = {}
    failed = False
    for name, auth in auths.items():
        try:
            loaded[name] = load_files(auth)
        except (PasswordFileError, AclFileError) as exc:
            failed = True
            log.error("reload: listener %r: %s; keeping the previous password and ACL rules", name, exc)
    if failed:
        return None
    for name, (passwords, acl) in loaded.items():
        auths[name].passwords, auths[name].acl = passwords, acl
    return {name: auth.access() for name, auth in auths.items()}
