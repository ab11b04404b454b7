"""Signed update bundles on the build machine (image/rauc/bundle.sh, image/rauc/keys.sh; README "Updating gateways
in the field"): a real RAUC (Debian's rauc) makes and checks them, from a small real ext4 root made here. What a
gateway does with them (install, boot, health check, rollback) is `make image-update-test`, under qemu."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

BUNDLE = ROOT / "image" / "rauc" / "bundle.sh"

pytestmark = pytest.mark.skipif(shutil.which("rauc") is None or shutil.which("mksquashfs") is None,
                                reason="rauc and squashfs-tools are installed by make deps")


def _root(tmp: Path) -> Path:
    tree = tmp / "tree"
    (tree / "etc").mkdir(parents=True, exist_ok=True)
    (tree / "etc" / "edge-gateway-release").write_text("VERSION=test\nARCH=amd64\n")
    (tree / "etc" / "noise").write_bytes(os.urandom(64 * 1024))  # RAUC wants a squashfs of more than one block
    image = tmp / "root.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(image), "8M"], check=True)
    return image


def _bundle(tmp: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUNDLE), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "IMAGE_OUT": str(out), **(env or {})})


def _info(bundle: Path, keyring: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rauc", "info", f"--keyring={keyring}", "--output-format=shell", str(bundle)],
                          capture_output=True, text=True, timeout=120)


def test_bundle_signed_with_the_development_key_says_so_and_verifies(tmp_path: Path) -> None:
    """Without IMAGE_SIGNING_CERT/KEY a development key pair is made once and used, with a warning; the bundle
    verifies against it and carries the compatible string and the version given."""
    out = tmp_path / "out"
    out.mkdir()
    made = _bundle(tmp_path, out, "--root", str(_root(tmp_path)), "--version", "2026.11.27-t1",
                   "--out", str(tmp_path / "t1.raucb"))
    assert made.returncode == 0, made.stderr
    assert "WARNING: update bundles are signed with the DEVELOPMENT key" in made.stderr
    assert made.stdout.strip() == str(tmp_path / "t1.raucb")
    key = out / "keys" / "development.key.pem"
    assert key.is_file() and (key.parent.stat().st_mode & 0o077) == 0
    info = _info(tmp_path / "t1.raucb", out / "keys" / "development.cert.pem")
    assert info.returncode == 0, info.stderr
    assert "RAUC_MF_COMPATIBLE='edge-gateway-amd64'" in info.stdout
    assert "RAUC_MF_VERSION='2026.11.27-t1'" in info.stdout
    assert "Verified inline signature by 'O = edge-gateway development" in info.stderr
    again = _bundle(tmp_path, out, "--root", str(_root(tmp_path)), "--version", "x", "--out",
                    str(tmp_path / "t2.raucb"))
    assert again.returncode == 0 and key.read_bytes() == (out / "keys" / "development.key.pem").read_bytes()


def test_bundle_refused_by_another_keyring_and_when_truncated(tmp_path: Path) -> None:
    """A gateway whose keyring holds another certificate refuses the bundle (signature), and so does every gateway
    a truncated bundle; the operator's key (IMAGE_SIGNING_CERT/KEY) signs without the warning."""
    out = tmp_path / "out"
    out.mkdir()
    own = tmp_path / "own"
    own.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "30", "-subj", "/O=fleet operator", "-keyout", str(own / "key.pem"),
                    "-out", str(own / "cert.pem")], check=True, capture_output=True)
    made = _bundle(tmp_path, out, "--root", str(_root(tmp_path)), "--version", "1", "--out",
                   str(tmp_path / "own.raucb"),
                   env={"IMAGE_SIGNING_CERT": str(own / "cert.pem"), "IMAGE_SIGNING_KEY": str(own / "key.pem")})
    assert made.returncode == 0, made.stderr
    assert "DEVELOPMENT" not in made.stderr and not (out / "keys").exists()
    assert _info(tmp_path / "own.raucb", own / "cert.pem").returncode == 0
    dev = _bundle(tmp_path, out, "--root", str(_root(tmp_path)), "--version", "1", "--out", str(tmp_path / "d.raucb"))
    assert dev.returncode == 0, dev.stderr
    refused = _info(tmp_path / "own.raucb", out / "keys" / "development.cert.pem")
    assert refused.returncode != 0 and "signature" in refused.stderr.lower(), refused.stderr
    data = (tmp_path / "own.raucb").read_bytes()
    (tmp_path / "cut.raucb").write_bytes(data[: len(data) // 2])
    cut = _info(tmp_path / "cut.raucb", own / "cert.pem")
    assert cut.returncode != 0, cut.stdout


def test_bundle_errors_name_what_is_missing(tmp_path: Path) -> None:
    """No root image, or only half of the operator's key pair: a clear error, no bundle."""
    out = tmp_path / "out"
    out.mkdir()
    missing = _bundle(tmp_path, out, "--root", str(tmp_path / "nothing.ext4"), "--version", "1")
    assert missing.returncode != 0 and "nothing.ext4 is missing: make image" in missing.stderr
    half = _bundle(tmp_path, out, "--root", str(_root(tmp_path)), "--version", "1",
                   env={"IMAGE_SIGNING_CERT": "/nonexistent.pem"})
    assert half.returncode != 0 and "IMAGE_SIGNING_CERT and IMAGE_SIGNING_KEY go together" in half.stderr
    assert not list(tmp_path.glob("**/*.raucb"))
