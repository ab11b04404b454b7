"""``[update]`` in gateway.toml through ``edge-gateway check-config``: every mistake one line naming the key, the
value and what is allowed; the TLS files are loaded as the pull would load them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pki import issue

URL = '"https://updates.example.net/eg/stable.json"'


def check(tmp_path: Path, update: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gw.toml"
    path.write_text("[update]\n" + update)
    return subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True,
                          text=True, timeout=30, cwd=tmp_path)


def test_good_update_table_is_summarised(tmp_path: Path) -> None:
    ca = issue(tmp_path, "ca", "Update CA")
    client = issue(tmp_path, "client", "gw-1", ca)
    result = check(tmp_path, f'manifest_url = {URL}\nca_file = "{ca.cert}"\nclient_cert = "{client.cert}"\n'
                             f'client_key = "{client.key}"\ncheck_interval = "6h"\n'
                             'maintenance_window = "23:30-01:30"\nmax_bundle_size = "512MB"\nreserve = "64MB"\n')
    assert result.returncode == 0, result.stderr
    assert (f"update: pull https://updates.example.net/eg/stable.json (CA {ca.cert}, client certificate "
            f"{client.cert}), install and reboot in the window 23:30-01:30, bundles up to 536870912 bytes in "
            "/var/lib/edge-gateway/update/download") in result.stdout


@pytest.mark.parametrize(("update", "error"), [
    ('manifest_url = "http://u.example/m.json"\n',
     "update.manifest_url = 'http://u.example/m.json': must be an https:// URL such as "
     '"https://updates.example.net/edge-gateway/stable.json" (plain HTTP is not allowed)'),
    (f"manifest_url = {URL}\nmaintenance_window = \"2am-4am\"\n",
     "update.maintenance_window = '2am-4am': must be two local times \"HH:MM-HH:MM\" such as \"02:00-04:00\" (it "
     'may cross midnight: "23:00-01:00"), start and end different'),
    (f"manifest_url = {URL}\nmaintenance_window = \"02:00-02:30\"\n",
     "update.maintenance_window = '02:00-02:30': must be open at least 1 hour (the timer starts up to 30 min late "
     "on purpose, to spread a fleet's downloads)"),
    (f"manifest_url = {URL}\ncheck_interval = \"10s\"\n",
     "update.check_interval = '10s': must be a duration 1m..30d such as \"6h\""),
    (f"manifest_url = {URL}\nmax_bundle_size = \"lots\"\n",
     "update.max_bundle_size = 'lots': must be a size of at least 1MB such as \"1GB\""),
    (f"manifest_url = {URL}\nreserve = -1\n",
     "update.reserve = -1: must be a size such as \"64MB\" (free space kept beyond the store's room)"),
    (f"manifest_url = {URL}\ndownload_dir = \"download\"\n",
     "update.download_dir = 'download': must be an absolute directory path on the data partition such as "
     '"/var/lib/edge-gateway/update/download"'),
    (f"manifest_url = {URL}\nca_file = \"/nonexistent/ca.crt\"\n",
     "update.ca_file = '/nonexistent/ca.crt': cannot read: No such file or directory"),
    (f"manifest_url = {URL}\nclient_key = \"/k.pem\"\n",
     "update.client_cert: missing; client_key needs its certificate (client_cert)"),
    (f"manifest_url = {URL}\nmanifest = 1\n",
     "update.manifest: unknown key; allowed: ca_file, check_interval, client_cert, client_key, download_dir, "
     "maintenance_window, manifest_url, max_bundle_size, reserve"),
])
def test_each_mistake_is_named(tmp_path: Path, update: str, error: str) -> None:
    result = check(tmp_path, update)
    assert result.returncode == 1
    path = tmp_path / "gw.toml"
    assert result.stderr.splitlines() == [f"{path}: {error}", f"{path}: 1 error(s)"]


def test_ca_file_that_is_not_pem_and_a_key_that_does_not_match(tmp_path: Path) -> None:
    ca = issue(tmp_path, "ca", "Update CA")
    client = issue(tmp_path, "client", "gw-1", ca)
    other = issue(tmp_path, "other", "gw-2", ca)
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate\n")
    result = check(tmp_path, f'manifest_url = {URL}\nca_file = "{junk}"\n')
    assert result.returncode == 1 and f"update.ca_file = '{junk}': not PEM CA certificates" in result.stderr
    result = check(tmp_path, f'manifest_url = {URL}\nclient_cert = "{client.cert}"\nclient_key = "{other.key}"\n')
    assert result.returncode == 1
    assert f"update.client_key = '{other.key}': does not match client_cert '{client.cert}'" in result.stderr
