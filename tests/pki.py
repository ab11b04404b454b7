"""Certificates for the TLS tests, made with ``cryptography``: a test CA, a server certificate for
``localhost``/127.0.0.1, client certificates (good, expired, signed by another CA) and an encrypted server key.

Used by tests/test_auth_tls.py (the SSLContext over loopback sockets) and tests/test_tls_listener.py (a real broker's
TLS listener); :func:`make_pki` writes one set into a directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)


@dataclass
class Issued:
    """A certificate and its key: the PEM files ``cert`` and ``key``, and the objects."""

    cert: Path
    key: Path
    obj: x509.Certificate
    private: ec.EllipticCurvePrivateKey


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    )


def issue(
    directory: Path,
    name: str,
    cn: str,
    ca: Issued | None = None,
    server: bool = False,
    days: tuple[int, int] = (-1, 30),
    password: bytes | None = None,
    extra_cn: str | None = None,
) -> Issued:
    """A P-256 certificate for ``cn`` signed by ``ca`` (self-signed CA when ``ca`` is None), valid ``days`` around
    now, written as ``<name>.crt`` and ``<name>.key``."""
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if extra_cn:
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, extra_cn))
    subject = x509.Name(attrs)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.obj.subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW + datetime.timedelta(days=days[0]))
        .not_valid_after(NOW + datetime.timedelta(days=days[1]))
    )
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private.public_key()), critical=False
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
    builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    cert = builder.sign(ca.private if ca else key, hashes.SHA256())
    base = directory / name
    _write(base, cert, key, password)
    return Issued(base.with_suffix(".crt"), base.with_suffix(".key"), cert, key)


def make_pki(directory: Path) -> dict[str, Issued]:
    """One set in ``directory``: ``ca``; ``server`` (CN localhost, SAN localhost and 127.0.0.1); ``client`` (CN
    sensor-17, then a second CN second-cn); ``expired`` (ended a day ago); ``untrusted`` (signed by another CA);
    ``encrypted`` (a server key with the passphrase "pw")."""
    ca = issue(directory, "ca", "Test CA")
    other_ca = issue(directory, "other-ca", "Other CA")
    return {
        "ca": ca,
        "server": issue(directory, "server", "localhost", ca, server=True),
        "client": issue(directory, "client", "sensor-17", ca, extra_cn="second-cn"),
        "expired": issue(directory, "expired", "old-sensor", ca, days=(-30, -1)),
        "untrusted": issue(directory, "untrusted", "mallory", other_ca),
        "encrypted": issue(directory, "encrypted", "localhost", ca, server=True, password=b"pw"),
    }
