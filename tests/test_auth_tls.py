"""gateway.auth.tls: the listener's SSLContext, checked with real TLS handshakes over loopback sockets
with certificates made here by ``cryptography``: with and without a client certificate, an expired or untrusted
one refused, a plaintext client refused, the minimum version and the cipher list applied, the CN extracted.
The certificates come from tests/pki.py."""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from pki import Issued, make_pki

from gateway.auth.tls import TlsConfigError, TlsSettings, build_server_context, peer_common_name


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class ServerResult:
    error: BaseException | None = None
    peercert: dict[str, Any] | None = None
    version: str | None = None
    cipher: str | None = None


def handshake(
    ctx: ssl.SSLContext,
    pki: dict[str, Issued],
    client_cert: Issued | None = None,
    plaintext: bytes | None = None,
    client_max: ssl.TLSVersion | None = None,
) -> tuple[ServerResult, BaseException | None]:
    """One connection over 127.0.0.1: the server side wraps with ``ctx``; the client verifies the server against
    the test CA, presents ``client_cert`` if given, or sends ``plaintext`` instead of a ClientHello. Returns what
    the server saw and the client's error (None when it read the server's b"ok")."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    result = ServerResult()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                result.peercert = tls.getpeercert()
                result.version = tls.version()
                result.cipher = (tls.cipher() or ("",))[0]
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            result.error = exc
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_error: BaseException | None = None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            if plaintext is not None:
                raw.sendall(plaintext)
                if raw.recv(100) in (b"",):
                    raise ConnectionError("closed by the server")
            else:
                cctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
                if client_max is not None:
                    cctx.maximum_version = client_max
                if client_cert is not None:
                    cctx.load_cert_chain(str(client_cert.cert), str(client_cert.key))
                with cctx.wrap_socket(raw, server_hostname="localhost") as tls:
                    data = tls.recv(2)
                    if data != b"ok":
                        raise ConnectionError(f"read {data!r}")
    except (ssl.SSLError, OSError) as exc:
        client_error = exc
    thread.join(10)
    listener.close()
    return result, client_error


def settings_for(pki: dict[str, Issued], **kw: Any) -> TlsSettings:
    return TlsSettings(certfile=str(pki["server"].cert), keyfile=str(pki["server"].key), **kw)


def test_server_only_tls_by_default_minimum_1_2(pki: dict[str, Issued]) -> None:
    ctx = build_server_context(settings_for(pki))
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2 and ctx.verify_mode == ssl.CERT_NONE
    server, client = handshake(ctx, pki)
    assert client is None and server.error is None
    assert server.version in ("TLSv1.2", "TLSv1.3")
    assert peer_common_name(server.peercert) is None  # no client certificate asked for


def test_a_verified_client_certificate_gives_its_first_cn(pki: dict[str, Issued]) -> None:
    ctx = build_server_context(
        settings_for(pki, cafile=str(pki["ca"].cert), require_certificate=True, use_identity_as_username=True)
    )
    server, client = handshake(ctx, pki, client_cert=pki["client"])
    assert client is None and server.error is None
    assert peer_common_name(server.peercert) == "sensor-17"


@pytest.mark.parametrize(
    ("which", "server_says"),
    [(None, "CERTIFICATE"), ("expired", "CERTIFICATE_VERIFY_FAILED"), ("untrusted", "CERTIFICATE_VERIFY_FAILED")],
)
def test_missing_expired_and_untrusted_client_certificates_are_refused(
    pki: dict[str, Issued], which: str | None, server_says: str
) -> None:
    ctx = build_server_context(settings_for(pki, cafile=str(pki["ca"].cert), require_certificate=True))
    server, client = handshake(ctx, pki, client_cert=pki[which] if which else None)
    assert isinstance(server.error, ssl.SSLError), server
    assert server_says in str(server.error), server.error
    if which == "expired":
        assert "expired" in str(server.error)
    assert client is not None  # the client sees the alert (in TLS 1.3, on its first read)
    # and the same context goes on serving a good client
    server, client = handshake(ctx, pki, client_cert=pki["client"])
    assert client is None and server.error is None


def test_capath_works_like_cafile(pki: dict[str, Issued], tmp_path: Path) -> None:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command (c_rehash's subject hash) is not installed")
    ca_dir = tmp_path / "capath"
    ca_dir.mkdir()
    (ca_dir / "ca.pem").write_bytes(pki["ca"].cert.read_bytes())
    subject_hash = subprocess.run(
        ["openssl", "x509", "-noout", "-subject_hash", "-in", str(ca_dir / "ca.pem")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (ca_dir / f"{subject_hash}.0").symlink_to("ca.pem")
    ctx = build_server_context(settings_for(pki, capath=str(ca_dir), require_certificate=True))
    assert handshake(ctx, pki, client_cert=pki["client"])[0].error is None
    assert handshake(ctx, pki, client_cert=pki["untrusted"])[0].error is not None


def test_a_plaintext_mqtt_client_on_the_tls_port_is_refused(pki: dict[str, Issued]) -> None:
    ctx = build_server_context(settings_for(pki))
    connect = b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04abcd"
    server, client = handshake(ctx, pki, plaintext=connect)
    assert isinstance(server.error, ssl.SSLError), server
    assert client is not None


def test_tls_version_is_a_minimum(pki: dict[str, Issued]) -> None:
    ctx = build_server_context(settings_for(pki, tls_version="tlsv1.3"))
    assert handshake(ctx, pki)[0].version == "TLSv1.3"
    server, client = handshake(ctx, pki, client_max=ssl.TLSVersion.TLSv1_2)
    assert server.error is not None and client is not None
    ctx12 = build_server_context(settings_for(pki))
    assert handshake(ctx12, pki, client_max=ssl.TLSVersion.TLSv1_2)[0].version == "TLSv1.2"


def test_ciphers_apply_to_tls_1_2(pki: dict[str, Issued]) -> None:
    ctx = build_server_context(settings_for(pki, ciphers="ECDHE-ECDSA-AES128-GCM-SHA256"))
    server, client = handshake(ctx, pki, client_max=ssl.TLSVersion.TLSv1_2)
    assert client is None and server.cipher == "ECDHE-ECDSA-AES128-GCM-SHA256"


def test_peer_common_name_edge_cases() -> None:
    assert peer_common_name(None) is None and peer_common_name({}) is None
    cert = {"subject": ((("organizationName", "Acme"),), (("commonName", "a"),), (("commonName", "b"),))}
    assert peer_common_name(cert) == "a"
    assert peer_common_name({"subject": ((("organizationName", "Acme"),),)}) is None


def test_errors_name_the_key_and_the_file(pki: dict[str, Issued], tmp_path: Path) -> None:
    base = settings_for(pki)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases: list[tuple[TlsSettings, str, str | None, str]] = [
        (replace(base, certfile=str(tmp_path / "none.crt")), "certfile", str(tmp_path / "none.crt"), "cannot read"),
        (replace(base, certfile=str(garbage)), "certfile", str(garbage), "not a PEM certificate"),
        (replace(base, keyfile=str(tmp_path / "none.key")), "keyfile", str(tmp_path / "none.key"), "cannot read"),
        (replace(base, keyfile=str(garbage)), "keyfile", str(garbage), "not a PEM private key"),
        (replace(base, keyfile=str(pki["client"].key)), "keyfile", str(pki["client"].key), "does not match certfile"),
        (
            replace(base, certfile=str(pki["encrypted"].cert), keyfile=str(pki["encrypted"].key)),
            "keyfile",
            str(pki["encrypted"].key),
            "encrypted",
        ),
        (replace(base, cafile=str(garbage)), "cafile", str(garbage), "not PEM CA certificates"),
        (replace(base, capath=str(garbage)), "capath", str(garbage), "not a directory"),
        (replace(base, tls_version="tlsv1.0"), "tls_version", None, "is not one of"),
        (replace(base, ciphers="NO-SUCH-CIPHER"), "ciphers", None, "selects no cipher"),
        (replace(base, require_certificate=True), "require_certificate", None, "needs cafile or capath"),
        (replace(base, use_identity_as_username=True), "use_identity_as_username", None, "require_certificate"),
    ]
    for settings, key, path, reason in cases:
        with pytest.raises(TlsConfigError) as info:
            build_server_context(settings)
        assert (info.value.key, info.value.path) == (key, path), (info.value, settings)
        assert reason in info.value.reason, info.value
        assert str(info.value).startswith(key)
