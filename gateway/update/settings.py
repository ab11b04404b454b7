"""The ``[update]`` table of gateway.toml: where and when ``edge-gateway update pull`` fetches A/B root updates.

The broker ignores it at run time; ``edge-gateway check-config`` validates it (every mistake named with its key,
value and what is allowed) and builds its TLS context once, so an unreadable CA file or a client key that does not
match its certificate is reported there rather than at 02:00 on a gateway. Keys (README "Pull updates")::

    [update]
    manifest_url = "https://updates.example.net/edge-gateway/stable.json"  # absent: pull off
    ca_file = "/etc/edge-gateway/update-ca.crt"    # default: the system's CA store
    client_cert = "/etc/edge-gateway/update.crt"   # optional mutual TLS (with client_key)
    client_key = "/etc/edge-gateway/update.key"
    check_interval = "6h"                          # how often the timer runs (for the timer; see README)
    maintenance_window = "02:00-04:00"             # local time, may cross midnight; absent: any time
    download_dir = "/var/lib/edge-gateway/update/download"
    max_bundle_size = "1GB"
    reserve = "64MB"                               # free space kept beyond the store's own room
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.update.plan import Window
from gateway.values import ValueSpec, check_value

__all__ = ["STATE_DIR", "UPDATE_KEYS", "UpdateSettings", "UpdateTlsError", "client_context", "describe", "load_update"]

STATE_DIR = "/var/lib/edge-gateway/update"
UPDATE_KEYS = ("manifest_url", "ca_file", "client_cert", "client_key", "check_interval", "maintenance_window",
               "download_dir", "max_bundle_size", "reserve")
_CHECK_INTERVAL: ValueSpec = ("duration", 60, 30 * 86400, 'a duration 1m..30d such as "6h"')
_MAX_BUNDLE_SIZE: ValueSpec = ("size", 1024**2, 2**40, 'a size of at least 1MB such as "1GB"')
_RESERVE: ValueSpec = ("size", 0, 2**40, 'a size such as "64MB" (free space kept beyond the store\'s room)')
#: The timer's RandomizedDelaySec= (systemd/edge-gateway-update.timer) is 30 min: a shorter window could be missed
#: by a run the random delay puts past its end.
MIN_WINDOW_MINUTES = 60


class UpdateTlsError(ValueError):
    """A TLS file of ``[update]`` that cannot be used: ``key``, ``path`` and ``reason``."""

    def __init__(self, key: str, path: str, reason: str) -> None:
        self.key, self.path, self.reason = key, path, reason
        super().__init__(f"update.{key} = {path!r}: {reason}")


@dataclass(frozen=True, slots=True)
class UpdateSettings:
    """``[update]``; ``manifest_url`` ``None`` means pull is off."""

    manifest_url: str | None = None
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    check_interval: float = 6 * 3600.0
    maintenance_window: Window | None = None
    download_dir: str | None = None  # None: download/ in the state directory (/var/lib/edge-gateway/update)
    max_bundle_size: int = 1024**3
    reserve: int = 64 * 1024**2

    @property
    def enabled(self) -> bool:
        return self.manifest_url is not None


def client_context(settings: UpdateSettings) -> ssl.SSLContext:
    """The HTTPS client context: certificates verified against ``ca_file`` (else the system's store), the host
    name checked, TLS 1.2 at least, and the client certificate when one is configured.

    Raises:
        UpdateTlsError: a file that cannot be read or used, naming its key.
    """
    if settings.ca_file is None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # only the configured CA: the system's CAs are not trusted
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.ca_file is not None:
        _readable("ca_file", settings.ca_file)
        try:
            ctx.load_verify_locations(cafile=settings.ca_file)
        except ssl.SSLError as exc:
            raise UpdateTlsError("ca_file", settings.ca_file, f"not PEM CA certificates ({_reason(exc)})") from None
    if settings.client_cert is not None:
        _readable("client_cert", settings.client_cert)
        if settings.client_key is not None:
            _readable("client_key", settings.client_key)
        try:
            ctx.load_cert_chain(settings.client_cert, settings.client_key, password=_no_passphrase)
        except _EncryptedKey:
            key = "client_key" if settings.client_key is not None else "client_cert"
            raise UpdateTlsError(key, getattr(settings, key), "the key is encrypted; the pull runs unattended and "
                                                              "needs it without a passphrase") from None
        except ssl.SSLError as exc:
            reason = _reason(exc)
            if "KEY_VALUES_MISMATCH" in reason.upper():
                raise UpdateTlsError("client_key", str(settings.client_key),
                                     f"does not match client_cert {settings.client_cert!r}") from None
            raise UpdateTlsError("client_cert", settings.client_cert,
                                 f"not a PEM certificate and key ({reason})") from None
    return ctx


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def _reason(exc: ssl.SSLError) -> str:
    return getattr(exc, "reason", None) or exc.strerror or str(exc)


def _readable(key: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UpdateTlsError(key, path, f"cannot read: {exc.strerror or exc}") from None


def load_update(table: Any, errors: list[str]) -> UpdateSettings:
    """``[update]`` as :class:`UpdateSettings` (the defaults when the table is absent). Each mistake appends one
    line ``update.key = value: must be ...`` to ``errors``."""
    if table is None:
        return UpdateSettings()
    if not isinstance(table, dict):
        errors.append('update: must be a table ([update] with manifest_url = "https://...")')
        return UpdateSettings()
    before = len(errors)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in UPDATE_KEYS:
            errors.append(f"update.{key}: unknown key; allowed: {', '.join(sorted(UPDATE_KEYS))}")
        elif key == "manifest_url":
            parts = urlsplit(value) if isinstance(value, str) else None
            if parts is None or parts.scheme != "https" or not parts.hostname or any(c.isspace() for c in value):
                errors.append(f"update.manifest_url = {value!r}: must be an https:// URL such as "
                              '"https://updates.example.net/edge-gateway/stable.json" (plain HTTP is not allowed)')
            else:
                values[key] = value
        elif key in ("ca_file", "client_cert", "client_key"):
            if not isinstance(value, str) or not value:
                errors.append(f"update.{key} = {value!r}: must be the path of a PEM file")
            else:
                values[key] = value
        elif key == "download_dir":
            if not isinstance(value, str) or not os.path.isabs(value):
                errors.append(f"update.download_dir = {value!r}: must be an absolute directory path on the data "
                              f"partition such as \"{STATE_DIR}/download\"")
            else:
                values[key] = value
        elif key == "maintenance_window":
            try:
                window = Window.parse(value)
            except ValueError as exc:
                errors.append(f"update.maintenance_window = {value!r}: {exc}")
                continue
            if window.minutes < MIN_WINDOW_MINUTES:
                errors.append(f"update.maintenance_window = {value!r}: must be open at least 1 hour (the timer "
                              "starts up to 30 min late on purpose, to spread a fleet's downloads)")
            else:
                values[key] = window
        else:
            spec = {"check_interval": _CHECK_INTERVAL, "max_bundle_size": _MAX_BUNDLE_SIZE, "reserve": _RESERVE}[key]
            parsed = check_value("update", key, value, errors, spec)
            if parsed is not None:
                values[key] = parsed
    if "client_key" in table and "client_cert" not in table:
        errors.append("update.client_cert: missing; client_key needs its certificate (client_cert)")
    if len(errors) > before:
        return UpdateSettings()
    settings = UpdateSettings(**values)
    if settings.ca_file or settings.client_cert:
        try:
            client_context(settings)
        except UpdateTlsError as exc:
            errors.append(str(exc))
            return UpdateSettings()
    return settings


def describe(settings: UpdateSettings) -> str:
    """One line for ``check-config``."""
    if not settings.enabled:
        return "update: pull off (no [update] manifest_url)"
    window = f"in the window {settings.maintenance_window}" if settings.maintenance_window else "at any time"
    tls = f"CA {settings.ca_file}" if settings.ca_file else "the system's CAs"
    if settings.client_cert:
        tls += f", client certificate {settings.client_cert}"
    return (f"update: pull {settings.manifest_url} ({tls}), install and reboot {window}, bundles up to "
            f"{settings.max_bundle_size} bytes in {settings.download_dir or STATE_DIR + '/download'}")
