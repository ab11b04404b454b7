"""The TLS side of a listener: an :class:`ssl.SSLContext` from Mosquitto's listener keys, and the client
certificate's Common Name for ``use_identity_as_username``.

The keys and their meaning follow ``mosquitto.conf(5)`` ("Certificate based SSL/TLS Support"):

- ``certfile``, ``keyfile``: the server certificate (PEM, the chain after it) and its private key (PEM,
  unencrypted: the broker starts unattended).
- ``cafile`` / ``capath``: the CA certificates (a PEM file / an OpenSSL hashed directory) that client certificates
  must chain to. Needed with ``require_certificate``.
- ``require_certificate``: a client must present a certificate that verifies, or the handshake fails. When false
  the server does not ask for one (OpenSSL ``SSL_VERIFY_NONE``, as Mosquitto).
- ``use_identity_as_username``: the CN of the verified client certificate is the user name; needs
  ``require_certificate``, as in Mosquitto.
- ``tls_version``: the *minimum* protocol version, ``tlsv1.3``, ``tlsv1.2`` (default) or ``tlsv1.1``.
- ``ciphers``: an OpenSSL cipher list for TLS 1.2 and below; default: the :mod:`ssl` module's.

Everything here is the standard library's :mod:`ssl`; the glue (gateway/server/tls_accept.py) hands the context to
``loop.connect_accepted_socket(ssl=...)`` and bounds the handshake by ``connect_timeout``. The context is a
:class:`ServerContext`, which keeps the TLS alert of a failed handshake for the glue to send (RFC 8446 §6.2,
RFC 5246 §7.2): both event loops' TLS transports drop it otherwise.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any

#: ``tls_version`` values (Mosquitto's spelling) and the minimum version each sets.
TLS_VERSIONS = {
    "tlsv1.1": ssl.TLSVersion.TLSv1_1,
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
}


class TlsConfigError(ValueError):
    """A TLS setting that cannot be used; names the key and, where there is one, the file."""

    def __init__(self, key: str, reason: str, path: str | None = None) -> None:
        self.key = key
        self.path = path
        self.reason = reason
        super().__init__(f"{key} = {path!r}: {reason}" if path is not None else f"{key}: {reason}")


@dataclass(frozen=True)
class TlsSettings:
    """The TLS keys of one listener (``[listeners.<name>]``), names and defaults as in ``mosquitto.conf(5)``."""

    certfile: str
    keyfile: str
    cafile: str | None = None
    capath: str | None = None
    require_certificate: bool = False
    use_identity_as_username: bool = False
    tls_version: str = "tlsv1.2"
    ciphers: str | None = None


class AlertKeepingSSLObject(ssl.SSLObject):
    """The :class:`ssl.SSLObject` of a :class:`ServerContext`: when its handshake fails, what OpenSSL wrote to the
    outgoing memory BIO in that step (the fatal alert: ``certificate_expired``, ``unknown_ca``,
    ``certificate_required``, ``handshake_failure``, ...) is taken out and put on the exception as ``unsent``
    (bytes; absent when OpenSSL wrote nothing).

    Why: asyncio's and uvloop's SSL protocols abort the transport when the handshake fails without writing that BIO
    out, so the client would see a bare EOF; RFC 8446 §6.2 and RFC 5246 §7.2 have the side that detects the error
    send the alert first. Only the failure path costs anything; a handshake that succeeds, and every record after
    it, is the base class's.
    """

    #: the outgoing BIO the object writes into (set by :meth:`ServerContext.wrap_bio`)
    outgoing: ssl.MemoryBIO | None = None

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            out = self.outgoing
            if out is not None and out.pending:
                exc.unsent = out.read()  # type: ignore[attr-defined]
            raise


class ServerContext(ssl.SSLContext):
    """A server-side :class:`ssl.SSLContext` whose memory-BIO objects (what the event loops' SSL protocols use) are
    :class:`AlertKeepingSSLObject`; sockets wrapped with it behave as with :class:`ssl.SSLContext`."""

    sslobject_class = AlertKeepingSSLObject

    def wrap_bio(  # type: ignore[override]
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        obj = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        if isinstance(obj, AlertKeepingSSLObject):
            obj.outgoing = outgoing
        return obj


def _ssl_reason(exc: ssl.SSLError) -> str:
    return getattr(exc, "reason", None) or exc.strerror or str(exc)


def _check_readable(key: str, path: str, directory: bool = False) -> None:
    if directory:
        if not os.path.isdir(path):
            raise TlsConfigError(key, "not a directory", path)
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsConfigError(key, f"cannot read: {exc.strerror or exc}", path) from None


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def build_server_context(settings: TlsSettings) -> ServerContext:
    """A server-side :class:`ServerContext` for a listener; :class:`TlsConfigError` names the key and file.

    Each file is checked on its own first (readable, PEM of the right kind), so that the error points at the file
    at fault rather than at "the certificate chain".
    """
    s = settings
    if s.tls_version not in TLS_VERSIONS:
        raise TlsConfigError("tls_version", f"{s.tls_version!r} is not one of {', '.join(TLS_VERSIONS)}")
    if s.use_identity_as_username and not s.require_certificate:
        raise TlsConfigError("use_identity_as_username", "needs require_certificate = true (mosquitto.conf(5))")
    if s.require_certificate and not (s.cafile or s.capath):
        raise TlsConfigError("require_certificate", "needs cafile or capath to verify client certificates with")
    ctx = ServerContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.minimum_version = TLS_VERSIONS[s.tls_version]
    except (ValueError, ssl.SSLError) as exc:
        raise TlsConfigError("tls_version", f"not available in this OpenSSL: {exc}") from None

    _check_readable("certfile", s.certfile)
    _check_readable("keyfile", s.keyfile)
    try:  # the certificate file parses as certificates on its own
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=s.certfile)
    except ssl.SSLError as exc:
        raise TlsConfigError("certfile", f"not a PEM certificate ({_ssl_reason(exc)})", s.certfile) from None
    try:
        ctx.load_cert_chain(s.certfile, s.keyfile, password=_no_passphrase)
    except _EncryptedKey:
        raise TlsConfigError(
            "keyfile", "the key is encrypted; the broker needs it without a passphrase", s.keyfile
        ) from None
    except ssl.SSLError as exc:
        reason = _ssl_reason(exc)
        if "KEY_VALUES_MISMATCH" in reason.upper():
            raise TlsConfigError("keyfile", f"does not match certfile {s.certfile!r}", s.keyfile) from None
        raise TlsConfigError("keyfile", f"not a PEM private key ({reason})", s.keyfile) from None

    if s.cafile:
        _check_readable("cafile", s.cafile)
        try:
            ctx.load_verify_locations(cafile=s.cafile)
        except ssl.SSLError as exc:
            raise TlsConfigError("cafile", f"not PEM CA certificates ({_ssl_reason(exc)})", s.cafile) from None
    if s.capath:
        _check_readable("capath", s.capath, directory=True)
        ctx.load_verify_locations(capath=s.capath)
    ctx.verify_mode = ssl.CERT_REQUIRED if s.require_certificate else ssl.CERT_NONE

    if s.ciphers:
        try:
            ctx.set_ciphers(s.ciphers)
        except ssl.SSLError as exc:
            raise TlsConfigError("ciphers", f"{s.ciphers!r} selects no cipher ({_ssl_reason(exc)})") from None
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


def peer_common_name(peercert: dict[str, Any] | None) -> str | None:
    """The first Common Name (CN) of a verified peer certificate's subject, or ``None``.

    ``peercert`` is :meth:`ssl.SSLSocket.getpeercert` (or asyncio's ``transport.get_extra_info("peercert")``),
    which is only filled in for a certificate that verified. Like Mosquitto (``X509_NAME_get_index_by_NID`` from
    the start) the first CN wins when a subject has several.
    """
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return str(value)
    return None
