"""``edge-gateway update pull`` against a real HTTPS server on 127.0.0.1 (``http.server`` + ``ssl``, certificates
from tests/pki.py) serving a manifest and a bundle (random bytes: RAUC needs the A/B slots only the qemu gateway
has, so the install and reboot commands here are scripts that record their arguments and copy the bundle).

Each test runs the real command in a subprocess with every path in its temp dir (release file, state dir, store,
download dir) and the time given with ``--now``; nothing but 127.0.0.1 is contacted (proxy variables removed).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pki import Issued, issue

BUNDLE = os.urandom(300_000)
SHA = hashlib.sha256(BUNDLE).hexdigest()
INSIDE = "2026-05-01T03:00"  # inside the window "02:00-04:00"
OUTSIDE = "2026-05-01T12:30"


@dataclass
class Site:
    """What the test server serves and what it saw."""

    files: dict[str, bytes] = field(default_factory=dict)
    cut_after: list[int] = field(default_factory=list)  # the n-th bundle response stops after this many bytes
    ignore_range: bool = False
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    bundle_responses: int = 0

    def bundle_requests(self) -> list[str | None]:
        return [rng for path, rng in self.requests if path.endswith(".raucb")]


class _Handler(http.server.BaseHTTPRequestHandler):
    site: Site

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        site = self.server.site  # type: ignore[attr-defined]
        site.requests.append((self.path, self.headers.get("Range")))
        body = site.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and not site.ignore_range and self.path.endswith(".raucb"):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.end_headers()
        payload = body[start:]
        if self.path.endswith(".raucb"):
            n = site.bundle_responses
            site.bundle_responses += 1
            if n < len(site.cut_after):
                payload = payload[: site.cut_after[n]]  # then the connection closes: an interrupted transfer
        self.wfile.write(payload)


class HttpsServer:
    def __init__(self, site: Site, cert: Issued, client_ca: Path | None = None) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.site = site  # type: ignore[attr-defined]
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert.cert, cert.key)
        if client_ca is not None:
            ctx.load_verify_locations(cafile=client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    d = tmp_path_factory.mktemp("pki")
    ca = issue(d, "ca", "Update CA")
    other = issue(d, "other-ca", "Other CA")
    return {"ca": ca, "other": other, "server": issue(d, "server", "localhost", ca, server=True),
            "client": issue(d, "client", "gw-0001", ca)}


@pytest.fixture
def site() -> Site:
    return Site()


@pytest.fixture
def server(site: Site, pki: dict[str, Issued]) -> Iterator[HttpsServer]:
    srv = HttpsServer(site, pki["server"])
    yield srv
    srv.close()


@dataclass
class Gateway:
    """One gateway's files in a temp dir, and how to run the pull on them."""

    root: Path
    ca: Path

    def __post_init__(self) -> None:
        (self.root / "etc").mkdir()
        (self.root / "store").mkdir()
        self.release.write_text('VERSION="1.4.2"\nARCH=amd64\n')
        for name in ("install", "reboot"):
            script = self.root / f"{name}.sh"
            # records its arguments; the install also keeps a copy of the bundle it was given
            copy = f'cp "$1" {self.root}/installed.raucb\n' if name == "install" else ""
            script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {self.root}/{name}.log\n{copy}')
            script.chmod(0o755)

    @property
    def release(self) -> Path:
        return self.root / "etc" / "edge-gateway-release"

    @property
    def state(self) -> Path:
        return self.root / "update"

    @property
    def download(self) -> Path:
        return self.state / "download"

    def config(self, manifest_url: str, **update: str) -> Path:
        store = update.pop("store_max_size", "16MB")  # small, so the space check passes in any temp dir
        lines = [f'manifest_url = "{manifest_url}"', f'ca_file = "{self.ca}"']
        lines += [f'{k} = "{v}"' for k, v in update.items()]
        path = self.root / "gateway.toml"
        path.write_text(f'[store]\npath = "{self.root / "store"}"\nmax_size = "{store}"\n\n[update]\n'
                        + "\n".join(lines) + "\n")
        return path

    def pull(self, manifest_url: str, now: str = INSIDE, **update: str) -> subprocess.CompletedProcess[str]:
        config = self.config(manifest_url, **update)
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        return subprocess.run(
            [sys.executable, "-m", "gateway", "update", "pull", "--config", str(config),
             "--release-file", str(self.release), "--state-dir", str(self.state),
             "--compatible", "edge-gateway-amd64", "--now", now,
             "--install-command", str(self.root / "install.sh"), "--reboot-command", str(self.root / "reboot.sh")],
            capture_output=True, text=True, timeout=60, env=env, cwd=self.root,
        )

    def log(self, name: str) -> list[str]:
        path = self.root / f"{name}.log"
        return path.read_text().splitlines() if path.exists() else []

    def downloads(self) -> list[str]:
        return sorted(p.name for p in self.download.iterdir()) if self.download.exists() else []


@pytest.fixture
def gw(tmp_path: Path, pki: dict[str, Issued]) -> Gateway:
    return Gateway(tmp_path, pki["ca"].cert)


def publish(site: Site, version: str = "1.5.0", compatible: str = "edge-gateway-amd64", url: str | None = None,
            sha256: str = SHA, size: int = len(BUNDLE), bundle: bytes = BUNDLE) -> str:
    """A manifest at /stable.json and the bundle beside it (a relative url); returns the manifest's path."""
    name = f"edge-gateway-{version}-amd64.raucb"
    site.files[f"/bundles/{name}"] = bundle
    site.files["/stable.json"] = json.dumps({"version": version, "compatible": compatible,
                                             "url": url or f"bundles/{name}", "sha256": sha256,
                                             "size": size}).encode()
    return "/stable.json"


def test_newer_version_is_downloaded_verified_installed_and_rebooted_in_the_window(
        gw: Gateway, site: Site, server: HttpsServer) -> None:
    """A pull update (README, "Pull updates"): a newer bundle for its compatible is downloaded, verified, installed and
    the gateway rebooted inside the maintenance window; the bundle file is removed afterwards and `pending` records the
    install."""
    result = gw.pull(server.url(publish(site)), maintenance_window="02:00-04:00")
    assert result.returncode == 0, result.stderr
    bundle = gw.download / f"{SHA}.raucb"
    assert gw.log("install") == [str(bundle)]
    assert (gw.root / "installed.raucb").read_bytes() == BUNDLE
    assert gw.log("reboot") == [""]
    assert gw.downloads() == []
    assert "VERSION=1.5.0\n" in (gw.state / "pending").read_text()
    assert site.bundle_requests() == [None]
    assert "version 1.5.0 downloaded and verified" in result.stderr
    assert "version 1.5.0 installed into the other slot; rebooting into it" in result.stderr


def test_outside_the_window_the_bundle_is_kept_and_installed_in_the_next_window(
        gw: Gateway, site: Site, server: HttpsServer) -> None:
    """Outside the window the verified bundle waits and the log says when the window opens; a run inside it
    installs that bundle without downloading it again."""
    url = server.url(publish(site))
    result = gw.pull(url, now=OUTSIDE, maintenance_window="02:00-04:00")
    assert result.returncode == 0, result.stderr
    assert gw.log("install") == [] and gw.log("reboot") == []
    assert gw.downloads() == [f"{SHA}.raucb"]
    assert "the maintenance window 02:00-04:00 opens at 2026-05-02 02:00 (in 13h 30m)" in result.stderr
    result = gw.pull(url, now="2026-05-02T02:10", maintenance_window="02:00-04:00")
    assert result.returncode == 0, result.stderr
    assert gw.log("install") == [str(gw.download / f"{SHA}.raucb")] and gw.log("reboot") == [""]
    assert site.bundle_requests() == [None]  # one download in all


def test_window_crossing_midnight(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """A window such as 23:00-01:00 holds 00:30 and not 01:00."""
    url = server.url(publish(site))
    assert gw.pull(url, now="2026-05-01T01:00", maintenance_window="23:00-01:00").returncode == 0
    assert gw.log("install") == []
    assert gw.pull(url, now="2026-05-02T00:30", maintenance_window="23:00-01:00").returncode == 0
    assert len(gw.log("install")) == 1


def test_sha256_mismatch_is_refused_and_the_file_removed(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """A bundle whose SHA-256 is not the manifest's is deleted and never installed (exit 4)."""
    bad = bytearray(BUNDLE)
    bad[1000] ^= 1
    result = gw.pull(server.url(publish(site, bundle=bytes(bad))))
    assert result.returncode == 4, result.stderr
    assert f"does not match the manifest's {SHA}; the file was deleted" in result.stderr
    assert gw.downloads() == [] and gw.log("install") == []


def test_interrupted_download_resumes_with_range(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """The server closes the first response after 100,000 bytes: the pull asks for the rest with Range
    (bytes=100000-), and the bundle it installs is the whole file."""
    site.cut_after = [100_000]
    result = gw.pull(server.url(publish(site)))
    assert result.returncode == 0, result.stderr
    assert site.bundle_requests() == [None, "bytes=100000-"]
    assert "interrupted at 100000 of 300000 bytes" in result.stderr
    assert (gw.root / "installed.raucb").read_bytes() == BUNDLE


def test_download_interrupted_in_every_attempt_is_resumed_by_the_next_run(
        gw: Gateway, site: Site, server: HttpsServer) -> None:
    """Three cut responses in one run: exit 1, the part kept; the next run resumes where it stopped."""
    site.cut_after = [50_000, 50_000, 50_000]
    url = server.url(publish(site))
    result = gw.pull(url)
    assert result.returncode == 1, result.stderr
    assert gw.downloads() == [f"{SHA}.raucb.part"]
    assert (gw.download / f"{SHA}.raucb.part").read_bytes() == BUNDLE[:150_000]
    assert "the next run resumes" in result.stderr
    result = gw.pull(url)
    assert result.returncode == 0, result.stderr
    assert site.bundle_requests() == [None, "bytes=50000-", "bytes=100000-", "bytes=150000-"]
    assert "resuming at byte 150000" in result.stderr
    assert (gw.root / "installed.raucb").read_bytes() == BUNDLE


def test_server_without_range_support_restarts_the_download(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """A server that answers a Range request with the whole file (200) makes the pull start again from 0."""
    site.cut_after = [100_000]
    site.ignore_range = True
    result = gw.pull(server.url(publish(site)))
    assert result.returncode == 0, result.stderr
    assert site.bundle_requests() == [None, "bytes=100000-"]
    assert "the server ignored Range (HTTP 200 to bytes=100000-): downloading from byte 0" in result.stderr
    assert (gw.root / "installed.raucb").read_bytes() == BUNDLE


def test_too_little_free_space_is_refused_before_downloading(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """The store's room counts: with [store] max_size larger than the temp dir's free space, nothing is
    downloaded (no bundle request reaches the server) and the refusal names the figures (exit 5)."""
    free = os.statvfs(gw.root).f_bavail * os.statvfs(gw.root).f_frsize
    max_size = f"{free // 1024**2 + 1024}MB"
    result = gw.pull(server.url(publish(site)), store_max_size=max_size)
    assert result.returncode == 5, result.stderr
    assert "not downloading version 1.5.0: too little free space" in result.stderr
    assert f"(max_size {free // 1024**2 * 1024**2 + 1024**3}, data.mdb holds 0)" in result.stderr
    assert site.bundle_requests() == [] and gw.downloads() == [] and gw.log("install") == []


def test_reserve_larger_than_free_space_is_refused(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """The same with [update] reserve alone larger than the free space (when the temp dir has < 1 TB free)."""
    st = os.statvfs(gw.root)
    free = st.f_bavail * st.f_frsize
    if free > 2**40 - 2**30:
        pytest.skip("more free space than [update] reserve may say")
    result = gw.pull(server.url(publish(site)), reserve=f"{free // 1024**2 + 100}MB")
    assert result.returncode == 5, result.stderr
    assert site.bundle_requests() == []


def test_wrong_ca_is_refused(gw: Gateway, site: Site, server: HttpsServer, pki: dict[str, Issued]) -> None:
    """A server whose certificate does not chain to [update] ca_file is not trusted (exit 1): nothing fetched
    beyond the handshake."""
    gw.ca = pki["other"].cert
    result = gw.pull(server.url(publish(site)))
    assert result.returncode == 1, result.stderr
    assert "the server's certificate did not verify: unable to get local issuer certificate" in result.stderr
    assert site.requests == []


def test_mutual_tls_with_a_client_certificate(gw: Gateway, site: Site, pki: dict[str, Issued]) -> None:
    """A server that requires client certificates serves a gateway with client_cert/client_key, and refuses
    one without (exit 1)."""
    srv = HttpsServer(site, pki["server"], client_ca=pki["ca"].cert)
    try:
        url = srv.url(publish(site))
        result = gw.pull(url)
        assert result.returncode == 1, result.stderr
        assert site.requests == []
        result = gw.pull(url, client_cert=str(pki["client"].cert), client_key=str(pki["client"].key))
        assert result.returncode == 0, result.stderr
        assert len(gw.log("install")) == 1
    finally:
        srv.close()


def test_other_compatible_is_ignored(gw: Gateway, site: Site, server: HttpsServer) -> None:
    result = gw.pull(server.url(publish(site, compatible="edge-gateway-arm64")))
    assert result.returncode == 0, result.stderr
    assert ("the manifest is for compatible 'edge-gateway-arm64', this gateway is 'edge-gateway-amd64': ignored"
            in result.stderr)
    assert site.bundle_requests() == [] and gw.log("install") == []


def test_same_version_is_nothing_to_do_and_old_downloads_are_removed(
        gw: Gateway, site: Site, server: HttpsServer) -> None:
    gw.download.mkdir(parents=True)
    (gw.download / f"{'0' * 64}.raucb.part").write_bytes(b"old")
    result = gw.pull(server.url(publish(site, version="1.4.2")))
    assert result.returncode == 0, result.stderr
    assert "version 1.4.2 is installed: nothing to do" in result.stderr
    assert site.bundle_requests() == [] and gw.log("install") == [] and gw.downloads() == []


def test_older_version_is_not_a_downgrade(gw: Gateway, site: Site, server: HttpsServer) -> None:
    result = gw.pull(server.url(publish(site, version="1.4.1")))
    assert result.returncode == 0, result.stderr
    assert "version 1.4.1 is older than the installed 1.4.2: not installed" in result.stderr
    assert gw.log("install") == []


def test_version_the_health_check_rolled_back_is_not_installed_again(
        gw: Gateway, site: Site, server: HttpsServer) -> None:
    """`last` with OUTCOME=rolled_back and PREVIOUS=1.5.0: 1.5.0 is recorded as rejected-1.5.0 and skipped, also
    after the health check rewrote `last`; 1.5.1 is installed."""
    gw.state.mkdir()
    (gw.state / "last").write_text("OUTCOME=rolled_back\nPREVIOUS=1.5.0\n")
    result = gw.pull(server.url(publish(site)))
    assert result.returncode == 0, result.stderr
    assert "version 1.5.0 rolled back on this gateway before: not installed again" in result.stderr
    assert (gw.state / "rejected-1.5.0").exists()
    (gw.state / "last").write_text("OUTCOME=good\n")
    assert gw.pull(server.url(publish(site))).returncode == 0
    assert gw.log("install") == [] and site.bundle_requests() == []
    assert gw.pull(server.url(publish(site, version="1.5.1"))).returncode == 0
    assert len(gw.log("install")) == 1


def test_install_that_did_not_stay_after_a_reboot_is_rejected(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """The pull's own record: `pending` says 1.5.0 was installed in another boot, yet 1.4.2 runs, so the new slot
    did not stay (whatever `last` says): 1.5.0 is rejected. In the same boot it only waits for the reboot."""
    gw.state.mkdir()
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (gw.state / "pending").write_text(f"VERSION=1.5.0\nBOOT_ID={boot_id}\n")
    url = server.url(publish(site))
    result = gw.pull(url, now=OUTSIDE, maintenance_window="02:00-04:00")
    assert result.returncode == 0, result.stderr
    assert "version 1.5.0 is installed and waits for a reboot" in result.stderr
    assert site.bundle_requests() == [] and gw.log("install") == []
    (gw.state / "pending").write_text("VERSION=1.5.0\nBOOT_ID=an-earlier-boot\n")
    result = gw.pull(url)
    assert result.returncode == 0, result.stderr
    assert (gw.state / "rejected-1.5.0").exists() and not (gw.state / "pending").exists()
    assert gw.log("install") == [] and site.bundle_requests() == []


def test_failed_install_keeps_the_bundle_and_exits_6(gw: Gateway, site: Site, server: HttpsServer) -> None:
    (gw.root / "install.sh").write_text("#!/bin/sh\necho 'rauc: signature invalid' >&2\nexit 1\n")
    result = gw.pull(server.url(publish(site)))
    assert result.returncode == 6, result.stderr
    assert "install: | rauc: signature invalid" in result.stderr
    assert gw.downloads() == [f"{SHA}.raucb"] and gw.log("reboot") == []
    assert not (gw.state / "pending").exists()


def test_server_sending_more_than_size_is_refused(gw: Gateway, site: Site, server: HttpsServer) -> None:
    """The manifest's size bounds the download: a server offering more bytes is refused, nothing is kept."""
    result = gw.pull(server.url(publish(site, size=len(BUNDLE) - 10)))
    assert result.returncode == 1, result.stderr
    assert f"the server offers {len(BUNDLE)} bytes, the manifest says {len(BUNDLE) - 10}: refused" in result.stderr
    assert gw.downloads() == []


def test_bundle_larger_than_max_bundle_size_is_refused(gw: Gateway, site: Site, server: HttpsServer) -> None:
    result = gw.pull(server.url(publish(site, size=2 * 1024**2)), max_bundle_size="1MB")
    assert result.returncode == 3, result.stderr
    assert "size = 2097152: more than [update] max_bundle_size (1048576 bytes)" in result.stderr
    assert site.bundle_requests() == []


def test_invalid_manifest_names_the_field(gw: Gateway, site: Site, server: HttpsServer) -> None:
    publish(site, url="http://127.0.0.1:1/x.raucb")
    result = gw.pull(server.url("/stable.json"))
    assert result.returncode == 3, result.stderr
    assert "url = 'http://127.0.0.1:1/x.raucb': must resolve to an https:// URL" in result.stderr


def test_http_error_exits_1(gw: Gateway, site: Site, server: HttpsServer) -> None:
    result = gw.pull(server.url("/missing.json"))
    assert result.returncode == 1, result.stderr
    assert "HTTP 404" in result.stderr


def test_enabled_is_the_units_condition(gw: Gateway, tmp_path: Path) -> None:
    """`update enabled`: 0 with manifest_url, 1 without, 255 for an invalid file (ExecCondition= fails then)."""
    def enabled(text: str) -> int:
        path = tmp_path / "c.toml"
        path.write_text(text)
        return subprocess.run([sys.executable, "-m", "gateway", "update", "enabled", "--config", str(path)],
                              capture_output=True, text=True, timeout=30).returncode

    assert enabled('[update]\nmanifest_url = "https://u.example/m.json"\n') == 0
    assert enabled('[update]\nmaintenance_window = "02:00-04:00"\n') == 1
    assert enabled("") == 1
    assert enabled('[update]\nmanifest_url = "http://u.example/m.json"\n') == 255


def test_room_is_the_pull_rule_for_a_copied_bundle(gw: Gateway, tmp_path: Path) -> None:
    """`update room BYTES` (what ansible/update.yml asks before it copies a bundle): the same rule as the pull,
    exit 0 when the bytes fit beside the store's room and the reserve, 1 with the figures when they do not."""
    free = os.statvfs(gw.root).f_bavail * os.statvfs(gw.root).f_frsize

    def room(size: int, max_size: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "room.toml"
        path.write_text(f'[store]\npath = "{gw.root / "store"}"\nmax_size = "{max_size}"\n\n'
                        '[update]\nreserve = "1MB"\n')
        return subprocess.run([sys.executable, "-m", "gateway", "update", "room", str(size), "--dir", str(gw.root),
                               "--config", str(path)], capture_output=True, text=True, timeout=30)

    fits = room(4096, "16MB")
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.startswith("room: 4096 bytes to write + 16777216 bytes the store may still grow into")
    # the store's room alone leaves no space for the bundle: refused, with the figures
    crowded = room(4096, f"{free // 1024**2 + 100}MB")
    assert crowded.returncode == 1, crowded.stderr
    assert crowded.stdout.startswith("no room: 4096 bytes to write") and f"free in {gw.root}" in crowded.stdout
    assert not gw.state.exists()  # asking writes nothing
