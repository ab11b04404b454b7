"""Per-board settings (README "Per-board settings"): one image for every board, what differs per board from
``edge-gateway-settings.toml`` on the boot partition (or from Ansible), checked, installed on the data partition,
removed from the boot partition.

- The file's own logic in process (gateway/board_settings/model.py): shape checks, merge, ``{settings}/NAME``,
  the TOML writer, redaction.
- The real ``edge-gateway settings`` command on temporary directories standing in for the boot partition, the
  image's /etc (rendered by the roles from the image inventory, as the image gets them) and the data partition: a
  valid file is applied and removed; a broken one is reported, renamed ``.rejected`` with its errors beside it and
  changes nothing; the same file again changes nothing; a changed image configuration is merged again; the SSH
  host keys are made once. The services' own ``check-config`` accepts what was installed.
- The role's Ansible path (board_settings.yml through the local connection, on temporary directories).
Nothing outside the test's temporary directories is read for writing or changed; no systemd, no real /boot or /etc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pki import issue
from test_appliance import RENDER_PLAYBOOK, _ansible_env

from gateway.board_settings.model import (
    SettingsError,
    dump_toml,
    merge,
    parse_settings,
    plan,
    read_settings,
    redact,
    ssh_public_key_error,
)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EDGE_GATEWAY = BIN / "edge-gateway"
FIRMWARE_BRIDGE = BIN / "firmware-bridge"
ME = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
UPSTREAM_PASSWORD = "upstream-s3cret-pw-7f1c"
#: a real ed25519 public key (its blob names its type), as ssh-keygen writes it
OPERATOR_KEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOXC2CrPLTuCUNBobciriLbbKlsqmTHRu1jxOW2EPib/ op@laptop")


# ------------------------------------------------------------------------------------------ the file, in process


def test_tables_merge_key_by_key_and_arrays_replace_the_images() -> None:
    base = {"broker": {"gateway_id": "gw-image", "sys_interval": "10s"}, "listeners": {"internal": {"bind": "a"}},
            "upstream": [{"name": "image-cloud"}, {"name": "second"}]}
    over = {"broker": {"gateway_id": "gw-7"}, "listeners": {"external": {"bind": "b"}},
            "upstream": [{"name": "cloud"}]}
    merged = merge(base, over)
    assert merged == {"broker": {"gateway_id": "gw-7", "sys_interval": "10s"},
                      "listeners": {"internal": {"bind": "a"}, "external": {"bind": "b"}},
                      "upstream": [{"name": "cloud"}]}
    assert base["broker"]["gateway_id"] == "gw-image" and len(base["upstream"]) == 2  # the inputs stay as they were


def test_gateway_id_sets_both_programs_and_a_second_different_one_is_named() -> None:
    settings = parse_settings('gateway_id = "gw-7"\n')
    assert settings.gateway == {"broker": {"gateway_id": "gw-7"}}
    assert settings.bridge == {"bridge": {"gateway_id": "gw-7"}}
    with pytest.raises(SettingsError) as err:
        parse_settings('gateway_id = "gw-7"\n[bridge.bridge]\ngateway_id = "gw-8"\n')
    assert err.value.errors == ["bridge.bridge.gateway_id = 'gw-8': differs from gateway_id = 'gw-7'; give it once, "
                                "at the top"]


def test_every_mistake_of_shape_is_named_with_its_value_and_what_is_allowed() -> None:
    text = """
gatway_id = "typo"
bridge = 3
[files]
"../etc/shadow" = "x"
empty = ""
[access]
ssh_authorized_keys = ["ssh-dss AAAAB3NzaC1kc3MAAACBAP op", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 op", "not-base64!"]
user = "root"
"""
    settings, errors = read_settings(text)
    assert errors[0] == "gatway_id: unknown key; allowed: access, bridge, files, gateway, gateway_id"
    assert errors[1] == "bridge = 3: must be a table ([bridge])"
    assert errors[2].startswith('files."../etc/shadow": a file name must be 1-64 letters, digits')
    assert errors[3] == "files.empty: must be the file's text, a non-empty string (e.g. '''...''')"
    assert errors[4] == "access.user: unknown key; allowed: ssh_authorized_keys"
    assert errors[5].startswith("access.ssh_authorized_keys[0] = 'ssh-dss AAAAB3NzaC1kc3MAAACBAP op': must be one "
                                "line 'TYPE BASE64 [COMMENT]' as in a .pub file, TYPE one of ssh-ed25519")
    assert "is not a ssh-ed25519 key (truncated or mangled?)" in errors[6]
    assert errors[7].startswith("access.ssh_authorized_keys[2] = 'not-base64!': must be one line")
    assert len(errors) == 8
    assert settings.files == {} and settings.ssh_authorized_keys == ()  # what was wrong is left out
    assert ssh_public_key_error(OPERATOR_KEY) is None
    with pytest.raises(SettingsError, match="not valid TOML"):
        parse_settings("[gateway\n")


def test_settings_placeholder_names_a_file_of_files_and_only_the_broker_gets_them() -> None:
    settings = parse_settings("""
[gateway.listeners.external]
certfile = "{settings}/server.crt"
keyfile = "{settings}/server.key"
cafile = "/etc/ssl/ca.crt"
[[gateway.upstream]]
forward = [{remote = "fleet/{topic}"}]
[bridge.bridge]
stats_file = "{settings}/stats.json"
[files]
"server.crt" = "CERT"
""")
    made, errors = plan(settings, {"listeners": {"internal": {"bind": "127.0.0.1:1884"}}}, None, "/data/gen-1/files")
    external = made.gateway["listeners"]["external"]
    assert external["certfile"] == "/data/gen-1/files/server.crt" and external["cafile"] == "/etc/ssl/ca.crt"
    assert made.gateway["upstream"][0]["forward"][0]["remote"] == "fleet/{topic}"  # other placeholders are left
    assert made.files == {"server.crt": "CERT\n"}
    assert errors == [
        "gateway.listeners.external.keyfile = '{settings}/server.key': must be \"{settings}/NAME\" with NAME a file "
        "of [files] (server.crt)",
        "bridge.bridge.stats_file = '{settings}/stats.json': {settings} is for [gateway] only: the files of [files] "
        "are readable by the broker's user, not by firmware-bridge",
    ]
    assert made.bridge == {"bridge": {"stats_file": "{settings}/stats.json"}}


_keys = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
_scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False),
                     st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_keys, inner, max_size=3)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=5))
def test_toml_writer_reads_back_equal(data: dict[str, Any]) -> None:
    """The standard library reads TOML but does not write it; what dump_toml writes reads back the same (tables,
    arrays of tables inside arrays of tables, inline tables in arrays, any key, control characters, floats)."""
    assert tomllib.loads(dump_toml(data)) == data


def test_toml_writer_keeps_the_bridge_docstrings_nesting() -> None:
    data = tomllib.loads("""
[bridge]
gateway_id = "gw"
[[ports]]
path = "/dev/ttyUSB0"
[[ports.devices]]
name = "meter-1"
[[ports.devices.groups]]
interval = "10s"
registers = [{ name = "voltage", address = "30001" }]
[[ports]]
path = "/dev/ttyUSB1"
""")
    text = dump_toml(data)
    assert tomllib.loads(text) == data
    assert "[[ports.devices.groups]]" in text and "\n[ports]" not in text


def test_redaction_hides_passwords_url_passwords_and_file_lines() -> None:
    settings = parse_settings(f"""
[[gateway.upstream]]
password = "{UPSTREAM_PASSWORD}"
url = "mqtts://gw:url-pw-99@cloud.example:8883"
[gateway.listeners.external]
password_file = "{{settings}}/passwd"
[files]
passwd = "hmi-01:$7$101$c2FsdHNhbHQ=$aGFzaGhhc2g="
""")
    secrets = settings.secrets()
    line = (f"gateway.upstream[0].password = '{UPSTREAM_PASSWORD}' url-pw-99 "
            "hmi-01:$7$101$c2FsdHNhbHQ=$aGFzaGhhc2g= {settings}/passwd")
    assert redact(line, secrets) == "gateway.upstream[0].password = '<secret>' <secret> <secret> {settings}/passwd"


# ------------------------------------------------------------------------------------------ the real command


@pytest.fixture(scope="module")
def image_etc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's /etc/edge-gateway/gateway.toml and /etc/firmware-bridge/bridge.toml, rendered by the roles' templates
    from the image inventory (what `make image` bakes)."""
    tmp = tmp_path_factory.mktemp("image-etc")
    defaults: dict[str, object] = {}
    for role in ("edge_gateway", "firmware_bridge"):
        defaults.update(yaml.safe_load((ROOT / "ansible" / "roles" / role / "defaults" / "main.yml").read_text()))
    defaults.pop("edge_gateway_external_bind")  # the image inventory sets it
    out = tmp / "out"
    (out / "image").mkdir(parents=True)
    defaults.update(out_dir=str(out), ansible_connection="local", edge_gateway_prefix=str(ROOT / ".venv"))
    (tmp / "vars.json").write_text(json.dumps(defaults))
    (tmp / "render.yml").write_text(RENDER_PLAYBOOK.replace("ROLES", str(ROOT / "ansible" / "roles")))
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "inventory/image", "-e", f"image_root={tmp}",
         "-e", f"@{tmp / 'vars.json'}", str(tmp / "render.yml")],
        cwd=ROOT / "ansible", env=_ansible_env(tmp), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    etc = tmp / "etc"
    (etc / "edge-gateway").mkdir(parents=True)
    (etc / "firmware-bridge").mkdir()
    shutil.copy(out / "image" / "gateway.toml", etc / "edge-gateway" / "gateway.toml")
    shutil.copy(out / "image" / "bridge.toml", etc / "firmware-bridge" / "bridge.toml")
    assert tomllib.loads((etc / "edge-gateway" / "gateway.toml").read_text())["broker"]["gateway_id"] == "gw-image"
    return etc


class Board:
    """Temporary stand-ins for a board's boot partition, the image's /etc and the data partition."""

    def __init__(self, tmp: Path, image_etc: Path) -> None:
        self.tmp = tmp
        self.boot = tmp / "boot"
        self.boot.mkdir()
        self.etc = tmp / "etc"
        shutil.copytree(image_etc, self.etc)
        self.data = tmp / "data"
        self.data.mkdir()
        self.settings_dir = self.data / "settings"
        self.file = self.boot / "edge-gateway-settings.toml"

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(EDGE_GATEWAY), "settings", *args],
            input=stdin, capture_output=True, text=True, timeout=60,
            umask=0o077,  # as edge-gateway-settings.service runs it (UMask=0077)
        )

    def apply(self, *extra: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run("apply", *extra, "--boot-dir", str(self.boot), "--etc-dir", str(self.etc),
                        "--settings-dir", str(self.settings_dir), "--broker-user", ME, "--bridge-user", ME,
                        stdin=stdin)

    def env(self, unit: str) -> dict[str, str]:
        text = (self.settings_dir / "current" / f"{unit}.env").read_text()
        return {k: v.strip('"') for k, v in (line.split("=", 1) for line in text.splitlines()
                                             if line and not line.startswith("#"))}

    def snapshot(self) -> dict[str, tuple[int, str]]:
        """Every path under the data partition with its mode and content (or link target)."""
        seen: dict[str, tuple[int, str]] = {}
        for path in sorted(self.data.rglob("*")):
            st_ = path.lstat()
            if stat.S_ISLNK(st_.st_mode):
                what = "-> " + os.readlink(path)
            elif stat.S_ISDIR(st_.st_mode):
                what = "dir"
            else:
                what = path.read_text()
            seen[str(path.relative_to(self.data))] = (st_.st_mode, what)
        return seen


@pytest.fixture
def board(tmp_path: Path, image_etc: Path) -> Board:
    return Board(tmp_path, image_etc)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A board's TLS files and a Mosquitto password file, as text."""
    tmp = tmp_path_factory.mktemp("pki")
    ca = issue(tmp, "ca", "Fleet CA")
    issue(tmp, "server", "localhost", ca, server=True)
    made = subprocess.run([str(EDGE_GATEWAY), "passwd", "-c", "-b", str(tmp / "passwd"), "hmi-01", "hmi-pw"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return {name: (tmp / name).read_text() for name in ("ca.crt", "server.crt", "server.key", "passwd")}


def settings_text(pki: dict[str, str], gateway_id: str = "gw-harbour-07", **replace: str) -> str:
    """The README's example settings file for one board (with this test's certificates)."""
    text = f'''gateway_id = "{gateway_id}"

[gateway.listeners.external]
bind = "0.0.0.0:8883"
certfile = "{{settings}}/server.crt"
keyfile = "{{settings}}/server.key"
cafile = "{{settings}}/ca.crt"
require_certificate = true
password_file = "{{settings}}/passwd"
acl_file = "{{settings}}/acl"

[[gateway.upstream]]
name = "cloud"
url = "mqtts://mqtt.example.net:8883"
username = "{gateway_id}"
password = "{UPSTREAM_PASSWORD}"
[[gateway.upstream.forward]]
local = "sensors/#"
remote = "fleet/{{topic}}"
qos = 1

[[bridge.ports]]
path = "/dev/sensors/buoy-b01"
protocol = "line-json"
device = "buoy-b01"
[[bridge.ports]]
path = "/dev/ttyUSB0"
protocol = "modbus-rtu"
baudrate = 9600
parity = "even"
[[bridge.ports.devices]]
name = "meter-1"
unit = 1
[[bridge.ports.devices.groups]]
interval = "10s"
registers = [{{ name = "voltage", address = "30001", type = "float32", unit = "V" }}]

[files]
"server.crt" = \'\'\'
{pki["server.crt"]}\'\'\'
"server.key" = \'\'\'
{pki["server.key"]}\'\'\'
"ca.crt" = \'\'\'
{pki["ca.crt"]}\'\'\'
passwd = \'\'\'
{pki["passwd"]}\'\'\'
acl = \'\'\'
user hmi-01
topic read sensors/#
\'\'\'

[access]
ssh_authorized_keys = ["{OPERATOR_KEY}"]
'''
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def _key_lines(pem: str) -> list[str]:
    return [line for line in pem.splitlines() if line and not line.startswith("-----")]


def test_valid_settings_file_is_applied_and_removed_from_the_boot_partition(board: Board,
                                                                              pki: dict[str, str]) -> None:
    """A valid file is applied: merged over the image's configuration, its files installed readable only by the
    broker's group, the units' environment files pointing at the result, which the services' own check-config
    accepts; the file is gone from the boot partition."""
    board.file.write_text(settings_text(pki))
    proc = board.apply()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"settings: applied .*edge-gateway-settings\.toml: gateway\.toml; bridge\.toml; \[files\] "
                     r"server\.crt, server\.key, ca\.crt, passwd, acl; SSH: 1 operator key\(s\); now .*/gen-",
                     proc.stdout)
    assert f"settings: removed {board.file}" in proc.stdout
    assert not board.file.exists() and list(board.boot.iterdir()) == []
    generation = (board.settings_dir / "current").resolve()
    assert generation.parent == board.settings_dir and generation.name.startswith("gen-")

    gateway_toml = Path(board.env("edge-gateway")["EDGE_GATEWAY_CONFIG"])
    bridge_toml = Path(board.env("firmware-bridge")["FIRMWARE_BRIDGE_CONFIG"])
    assert (gateway_toml, bridge_toml) == (generation / "gateway.toml", generation / "bridge.toml")
    gw = tomllib.loads(gateway_toml.read_text())
    assert gw["broker"]["gateway_id"] == "gw-harbour-07"
    assert gw["store"] == {"path": "/var/lib/edge-gateway/store", "max_size": "1GB"}  # from the image
    assert gw["listeners"]["internal"] == {"bind": "127.0.0.1:1884"}  # from the image
    assert gw["listeners"]["external"]["keyfile"] == f"{generation}/files/server.key"
    assert gw["upstream"][0]["password"] == UPSTREAM_PASSWORD
    bridge = tomllib.loads(bridge_toml.read_text())
    assert bridge["bridge"]["gateway_id"] == "gw-harbour-07" and bridge["mqtt"]["broker"] == "127.0.0.1:1884"
    assert [p["path"] for p in bridge["ports"]] == ["/dev/sensors/buoy-b01", "/dev/ttyUSB0"]  # replaced the image's
    for name in ("server.crt", "server.key", "ca.crt", "passwd"):
        assert (generation / "files" / name).read_text() == pki[name]

    def mode(path: Path) -> str:
        return oct(path.lstat().st_mode & 0o777)

    assert (mode(board.settings_dir), mode(generation)) == ("0o755", "0o755")  # the services' users pass through
    assert mode(generation / "files") == "0o750"
    assert {mode(p) for p in (generation / "files").iterdir()} == {"0o640"}
    assert (mode(gateway_toml), mode(bridge_toml), mode(generation / "settings.toml")) == ("0o640", "0o640", "0o600")
    assert mode(generation / "authorized_keys") == "0o644"
    assert (generation / "authorized_keys").read_text() == OPERATOR_KEY + "\n"
    assert {oct(p.stat().st_mode & 0o007) for p in generation.rglob("*") if p.suffix != ".env"
            and p.name not in ("authorized_keys", "applied.json", "files")} == {"0o0"}  # nothing for others

    checked = subprocess.run([str(EDGE_GATEWAY), "check-config", str(gateway_toml)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stderr
    assert re.search(r"listener external: bind 0\.0\.0\.0:8883, .*TLS \(tlsv1\.2 minimum, client certificates "
                     r"required\)", checked.stdout), checked.stdout
    assert f"password_file {generation}/files/passwd (1 users), acl_file" in checked.stdout
    assert "upstream cloud: mqtts://mqtt.example.net:8883 as 'gw-harbour-07-cloud', 1 forward" in checked.stdout
    bridge_checked = subprocess.run([str(FIRMWARE_BRIDGE), "check-config", str(bridge_toml)], capture_output=True,
                                    text=True, timeout=60)
    assert bridge_checked.returncode == 0, bridge_checked.stderr
    assert "gateway gw-harbour-07, broker 127.0.0.1:1884, 2 port(s)" in bridge_checked.stdout

    out = proc.stdout + proc.stderr
    assert UPSTREAM_PASSWORD not in out and not any(line in out for line in _key_lines(pki["server.key"]))


def test_broken_settings_file_is_reported_and_changes_nothing(board: Board, pki: dict[str, str]) -> None:
    """A broken file is reported, every mistake naming the key, the value and what is allowed (never a secret), on
    stderr and in the errors file beside it; it is renamed .rejected, and the applied settings stay as they were."""
    board.file.write_text(settings_text(pki, gateway_id="gw-harbour-07"))
    assert board.apply().returncode == 0
    before = board.snapshot()
    broken = settings_text(
        pki,
        gateway_id="gw-harbour-07",
        **{
            'bind = "0.0.0.0:8883"': 'bind = "0.0.0.0:88830"',
            'keyfile = "{settings}/server.key"': 'keyfile = "{settings}/ca.crt"',
            'acl_file = "{settings}/acl"': 'acl_file = "{settings}/acls"',
            'baudrate = 9600': 'baudrate = 12',
            "password = ": "pasword = ",
            OPERATOR_KEY: OPERATOR_KEY.replace("AAAAC3", "AAAAC4"),
        },
    )
    board.file.write_text(broken)
    proc = board.apply()
    assert proc.returncode == 78, proc.stdout + proc.stderr
    errors = [line.removeprefix("edge-gateway settings:   ") for line in proc.stderr.splitlines()
              if line.startswith("edge-gateway settings:   ")]
    expected = [
        "access.ssh_authorized_keys[0] = ",
        "gateway.listeners.external.acl_file = '{settings}/acls': must be \"{settings}/NAME\" with NAME a file of "
        "[files] (server.crt, server.key, ca.crt, passwd, acl)",
        "gateway.upstream.cloud.pasword: unknown key; allowed: ack_timeout,",
        "gateway.listeners.external.bind = '0.0.0.0:88830': must be \"host:port\" (port 0..65535) or a Unix socket "
        "path",
        "gateway.listeners.external.keyfile = '{settings}/ca.crt': not a PEM private key",
        "gateway.listeners.external.acl_file: {settings}/acls: cannot read: No such file or directory",
        "bridge.ports[1].baudrate = 12: must be an integer 50..4000000",
    ]
    assert len(errors) == len(expected), proc.stderr
    for line, start in zip(errors, expected, strict=True):
        assert line.startswith(start), (line, start)
    assert re.search(r"REJECTED .*edge-gateway-settings\.toml: 7 mistake\(s\); the gateway keeps its previous "
                     r"settings", proc.stderr)
    assert "renamed to edge-gateway-settings.toml.rejected; the errors are in edge-gateway-settings.errors.txt" in (
        proc.stderr)
    assert board.snapshot() == before  # nothing changed in the settings directory
    assert not board.file.exists()
    assert (board.boot / "edge-gateway-settings.toml.rejected").read_text() == broken
    errors_txt = (board.boot / "edge-gateway-settings.errors.txt").read_text()
    assert errors_txt.startswith("edge-gateway-settings.toml was rejected; the gateway kept its previous settings.")
    assert all(line in errors_txt for line in errors)
    for text in (proc.stdout + proc.stderr, errors_txt):
        assert UPSTREAM_PASSWORD not in text
        assert "hmi-01:$7$" not in text and not any(line in text for line in _key_lines(pki["server.key"]))

    # fixed and renamed back, it applies and the stale rejection goes with it
    board.file.write_text(settings_text(pki, gateway_id="gw-harbour-08"))
    fixed = board.apply()
    assert fixed.returncode == 0, fixed.stderr
    assert list(board.boot.iterdir()) == []


def test_not_toml_is_rejected_with_where(board: Board) -> None:
    board.file.write_text('gateway_id = "gw-1\n')
    proc = board.apply()
    assert proc.returncode == 78
    assert "not valid TOML: " in proc.stderr and "(at line 1, column" in proc.stderr
    assert not board.settings_dir.exists()  # nothing made, not even the directory
    assert (board.boot / "edge-gateway-settings.toml.rejected").exists()


def test_the_same_file_again_changes_nothing_and_a_new_one_replaces_the_old(board: Board,
                                                                           pki: dict[str, str]) -> None:
    text = settings_text(pki)
    assert board.apply("-", stdin=text).returncode == 0
    first = (board.settings_dir / "current").resolve()
    again = board.apply("-", stdin=text)
    assert again.returncode == 0 and "settings: unchanged: <stdin> is what is applied" in again.stdout
    assert (board.settings_dir / "current").resolve() == first
    assert [p.name for p in board.settings_dir.iterdir() if p.name.startswith("gen-")] == [first.name]
    for gateway_id in ("gw-harbour-08", "gw-harbour-09"):
        proc = board.apply("-", stdin=settings_text(pki, gateway_id=gateway_id))
        assert proc.returncode == 0, proc.stderr
    current = (board.settings_dir / "current").resolve()
    previous = (board.settings_dir / "previous").resolve()
    assert tomllib.loads((current / "gateway.toml").read_text())["broker"]["gateway_id"] == "gw-harbour-09"
    assert tomllib.loads((previous / "gateway.toml").read_text())["broker"]["gateway_id"] == "gw-harbour-08"
    assert sorted(p.name for p in board.settings_dir.iterdir()) == sorted(
        ["current", "previous", current.name, previous.name])  # the first generation is gone


def test_applied_settings_are_merged_again_over_a_changed_image_configuration(board: Board,
                                                                             pki: dict[str, str]) -> None:
    """A new root (an update) may bring a changed gateway.toml: at the next boot, with no file on the boot
    partition, the applied settings are merged again over it; with nothing changed nothing happens."""
    board.file.write_text(settings_text(pki))
    assert board.apply().returncode == 0
    nothing = board.apply()
    assert nothing.returncode == 0 and "nothing to apply" in nothing.stdout
    image_toml = board.etc / "edge-gateway" / "gateway.toml"
    image_toml.write_text(image_toml.read_text().replace('sys_interval = "10s"', 'sys_interval = "30s"'))
    proc = board.apply()
    assert proc.returncode == 0, proc.stderr
    assert "applied the applied settings merged again over the image's new configuration" in proc.stdout
    gw = tomllib.loads(Path(board.env("edge-gateway")["EDGE_GATEWAY_CONFIG"]).read_text())
    assert (gw["broker"]["sys_interval"], gw["broker"]["gateway_id"]) == ("30s", "gw-harbour-07")
    # a new image whose configuration the settings do not fit keeps the settings that work
    before = board.snapshot()
    image_toml.write_text(image_toml.read_text() + '\n[listeners.external]\ntls_version = "tlsv9"\n')
    bad = board.apply()
    assert bad.returncode == 78
    assert "gateway.listeners.external.tls_version = 'tlsv9': must be one of" in bad.stderr
    assert board.snapshot() == before


def test_check_reports_and_changes_nothing(board: Board, pki: dict[str, str]) -> None:
    path = board.tmp / "harbour-07.toml"
    path.write_text(settings_text(pki))
    ok = board.run("check", str(path), "--etc-dir", str(board.etc))
    assert ok.returncode == 0, ok.stderr
    assert f"{path}: OK (gateway.toml; bridge.toml; [files] server.crt" in ok.stdout
    path.write_text(settings_text(pki, **{'baudrate = 9600': 'baudrate = "fast"'}))
    bad = board.run("check", str(path), "--etc-dir", str(board.etc))
    assert bad.returncode == 78 and "bridge.ports[1].baudrate = 'fast': must be an integer 50..4000000" in bad.stderr
    assert path.exists() and not board.settings_dir.exists()


def test_ssh_host_keys_are_made_once(tmp_path: Path) -> None:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen (openssh-client) is not installed")
    keys = tmp_path / "ssh"
    first = subprocess.run([str(EDGE_GATEWAY), "settings", "host-keys", "--dir", str(keys)], capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "made ssh_host_ed25519_key, ssh_host_ecdsa_key" in first.stdout
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["ssh_host_ecdsa_key", "ssh_host_ecdsa_key.pub", "ssh_host_ed25519_key",
                     "ssh_host_ed25519_key.pub"]
    assert oct(keys.stat().st_mode & 0o777) == "0o700"
    assert oct((keys / "ssh_host_ed25519_key").stat().st_mode & 0o777) == "0o600"
    fingerprint = subprocess.run(["ssh-keygen", "-lf", str(keys / "ssh_host_ed25519_key.pub")],
                                 capture_output=True, text=True, check=True).stdout
    second = subprocess.run([str(EDGE_GATEWAY), "settings", "host-keys", "--dir", str(keys)], capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 0 and "kept" in second.stdout
    assert subprocess.run(["ssh-keygen", "-lf", str(keys / "ssh_host_ed25519_key.pub")],
                          capture_output=True, text=True, check=True).stdout == fingerprint


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_data_partition_top_is_given_to_the_broker_before_it_ever_starts(board: Board, pki: dict[str, str]) -> None:
    """systemd changes the owner of everything below a StateDirectory= whose top it finds owned by someone else
    (which would hand the bridge's and sshd's files to the broker): apply gives the top the broker's user first,
    mode 0751 as the unit's StateDirectoryMode=."""
    os.chown(board.data, 65534, 65534)
    board.file.write_text(settings_text(pki))
    assert board.apply().returncode == 0
    st_ = board.data.stat()
    assert (st_.st_uid, st_.st_gid, oct(st_.st_mode & 0o777)) == (0, 0, "0o751")  # the broker's user is root here


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="mount namespaces need root")
def test_read_only_boot_partition_is_writable_only_for_the_removal(board: Board, pki: dict[str, str]) -> None:
    """--remount-boot: on a read-only mount (a tmpfs in a private mount namespace, standing in for the FAT boot
    partition) the file is removed, and the mount is read-only again afterwards."""
    script = board.tmp / "remount.sh"
    script.write_text(f"""set -e
mount -t tmpfs -o size=4m tmpfs {board.boot}
cp {board.tmp}/settings.toml {board.boot}/edge-gateway-settings.toml
mount -o remount,ro {board.boot}
! touch {board.boot}/x 2>/dev/null
{EDGE_GATEWAY} settings apply --remount-boot --boot-dir {board.boot} --etc-dir {board.etc} \\
    --settings-dir {board.settings_dir} --broker-user {ME} --bridge-user {ME}
echo "options: $(findmnt -no OPTIONS {board.boot})"
echo "left: $(ls -A {board.boot})"
""")
    (board.tmp / "settings.toml").write_text(settings_text(pki))
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", str(script)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^options: ro,", proc.stdout, re.MULTILINE), proc.stdout
    assert "left: \n" in proc.stdout
    assert (board.settings_dir / "current" / "gateway.toml").exists()


# ------------------------------------------------------------------------------------------ from Ansible


def test_role_applies_a_settings_file_from_ansible(tmp_path: Path, image_etc: Path, pki: dict[str, str]) -> None:
    """board-settings.yml's tasks (role edge_gateway, board_settings.yml) through the local connection on temporary
    directories: a file from an ansible-vault applied (changed), the same again changed=0, a broken one stops the
    play with its mistakes and no secret, and nothing changes."""
    board = Board(tmp_path, image_etc)
    env = _ansible_env(tmp_path)
    vault_password = tmp_path / "vault-pass"
    vault_password.write_text("board-vault-pw\n")
    settings_file = tmp_path / "harbour-07.toml"
    settings_file.write_text(settings_text(pki))
    enc = subprocess.run([str(BIN / "ansible-vault"), "encrypt", "--vault-password-file", str(vault_password),
                          str(settings_file)], env=env, capture_output=True, text=True, timeout=60)
    assert enc.returncode == 0 and settings_file.read_text().startswith("$ANSIBLE_VAULT;"), enc.stderr
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gateways": {"hosts": {"harbour-07": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}}}))
    extra = {"edge_gateway_settings_file": str(settings_file), "edge_gateway_prefix": str(ROOT / ".venv"),
             "edge_gateway_settings_etc_dir": str(board.etc), "edge_gateway_settings_dir": str(board.settings_dir),
             "edge_gateway_user": ME, "edge_gateway_bridge_user": ME, "ansible_become": False,
             "edge_gateway_settings_live": False}  # never restart anything on this machine
    (tmp_path / "extra.json").write_text(json.dumps(extra))

    def play() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", str(inventory), "-e", f"@{tmp_path / 'extra.json'}",
             "--vault-password-file", str(vault_password), "board-settings.yml"],
            cwd=ROOT / "ansible", env=env, capture_output=True, text=True, timeout=180,
        )

    first = play()
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"harbour-07 +: ok=\d+ +changed=1 ", first.stdout), first.stdout
    gw = tomllib.loads(Path(board.env("edge-gateway")["EDGE_GATEWAY_CONFIG"]).read_text())
    assert gw["broker"]["gateway_id"] == "gw-harbour-07"
    second = play()
    assert second.returncode == 0 and re.search(r"harbour-07 +: ok=\d+ +changed=0 ", second.stdout), second.stdout
    before = board.snapshot()
    settings_file.write_text(settings_text(pki, **{'baudrate = 9600': 'baudrate = 12'}))
    broken = play()
    assert broken.returncode != 0
    assert "bridge.ports[1].baudrate = 12: must be an integer 50..4000000" in broken.stdout
    assert UPSTREAM_PASSWORD not in broken.stdout + broken.stderr
    assert board.snapshot() == before
