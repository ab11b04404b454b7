"""The update pull's systemd units (systemd/edge-gateway-update.service and .timer), checked as tests/
test_appliance.py checks the services: ``systemd-analyze verify`` prints nothing, ``systemd-analyze security
--offline`` rates the root service's exposure, and the directives README "Pull updates" promises are there. All in a
throwaway root; no systemd manager is started."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from pki import issue
from test_appliance import ROOT, VENV_BIN, _ansible_env, _unit_root, exposure, unit_values, verify

UNITS = ("edge-gateway-update.service", "edge-gateway-update.timer")
#: The same bound as the broker's and the bridge's units, although this one runs as root (measured: 1.8).
UPDATE_EXPOSURE = 2.0


def _units() -> dict[str, str]:
    return {n: (ROOT / "systemd" / n).read_text() for n in UNITS}


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unit_root(tmp_path_factory.mktemp("units"), _units())


@pytest.mark.parametrize("unit", UNITS)
def test_verify_prints_nothing(unit_root: Path, unit: str) -> None:
    proc = verify(unit_root, unit)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_security_exposure_of_the_root_service(unit_root: Path) -> None:
    level, proc = exposure(unit_root, "edge-gateway-update.service")
    assert level <= UPDATE_EXPOSURE, proc.stdout


def test_timer_runs_after_boot_then_periodically_spread_and_persistent() -> None:
    timer = unit_values("edge-gateway-update.timer")
    assert timer["OnBootSec"] == ["15min"] and timer["OnUnitActiveSec"] == ["6h"]
    assert timer["RandomizedDelaySec"] == ["30min"] and timer["Persistent"] == ["true"]
    assert timer["WantedBy"] == ["timers.target"]


def test_service_is_a_oneshot_that_runs_only_when_configured() -> None:
    svc = unit_values("edge-gateway-update.service")
    assert svc["Type"] == ["oneshot"] and svc["User"] == ["root"]
    assert svc["ExecCondition"] == [
        "/opt/edge-gateway/bin/edge-gateway update enabled --config /etc/edge-gateway/gateway.toml"]
    assert svc["ExecStart"] == [
        "/opt/edge-gateway/bin/edge-gateway update pull --config /etc/edge-gateway/gateway.toml"]
    assert svc["ProtectSystem"] == ["strict"] and svc["ReadWritePaths"] == ["-/var/lib/edge-gateway/update"]
    assert svc["CapabilityBoundingSet"] == ["CAP_DAC_READ_SEARCH CAP_SYS_BOOT"]
    assert "[Install]" not in (ROOT / "systemd" / "edge-gateway-update.service").read_text()  # the timer starts it


def test_role_files_are_the_units() -> None:
    """The role installs these files (symlinks into systemd/), so the two never drift."""
    for unit in UNITS:
        path = ROOT / "ansible" / "roles" / "edge_gateway" / "files" / unit
        assert path.is_symlink() and path.resolve() == (ROOT / "systemd" / unit).resolve()


def test_verify_catches_a_bad_timer_directive(tmp_path: Path) -> None:
    """The verify check can fail: a misspelt timer directive is printed."""
    units = _units()
    units["edge-gateway-update.timer"] = units["edge-gateway-update.timer"].replace("OnBootSec=", "OnBootSecs=")
    proc = verify(_unit_root(tmp_path, units), "edge-gateway-update.timer")
    assert "Unknown key 'OnBootSecs' in section [Timer], ignoring." in proc.stderr, proc.stdout + proc.stderr


RENDER = """
- name: Render the role's gateway.toml and the update timer's drop-in with the update variables
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "ROLE/templates/{{ item.src }}"
        dest: "{{ out_dir }}/{{ item.dest }}"
        mode: "0644"
      loop:
        - {src: gateway.toml.j2, dest: gateway.toml}
        - {src: edge-gateway-update-schedule.conf.j2, dest: schedule.conf}
"""


def test_role_renders_update_table_and_timer_schedule(tmp_path: Path) -> None:
    """edge_gateway_update_manifest_url (and the CA, interval and window) become a gateway.toml that passes
    check-config with its [update] line, and a timer drop-in that runs every interval and at the window's start,
    which systemd-analyze verify accepts."""
    role = ROOT / "ansible" / "roles" / "edge_gateway"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    ca = issue(tmp_path, "ca", "Update CA")
    out = tmp_path / "out"
    out.mkdir()
    extra = {**{k: v for k, v in defaults.items() if not k.startswith("edge_gateway_target")},
             "out_dir": str(out), "edge_gateway_id": "gw-1", "edge_gateway_external_bind": "",
             "edge_gateway_store_path": str(tmp_path / "store"),
             "edge_gateway_update_manifest_url": "https://updates.example.net/eg/stable.json",
             "edge_gateway_update_ca": ca.cert.read_text(), "edge_gateway_update_ca_file": str(ca.cert),
             "edge_gateway_update_check_interval": "1h", "edge_gateway_update_maintenance_window": "02:30-04:30"}
    (tmp_path / "vars.json").write_text(json.dumps(extra))
    playbook = tmp_path / "render.yml"
    playbook.write_text(RENDER.replace("ROLE", str(role)))
    proc = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-e", f"@{tmp_path / 'vars.json'}",
                           str(playbook)], cwd=ROOT / "ansible", env=_ansible_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    toml = tomllib.loads((out / "gateway.toml").read_text())
    assert toml["update"] == {"manifest_url": "https://updates.example.net/eg/stable.json", "ca_file": str(ca.cert),
                              "check_interval": "1h", "maintenance_window": "02:30-04:30"}
    check = subprocess.run([str(VENV_BIN / "edge-gateway"), "check-config", str(out / "gateway.toml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert "update: pull https://updates.example.net/eg/stable.json" in check.stdout
    schedule = (out / "schedule.conf").read_text()
    assert "\nOnUnitActiveSec=\nOnUnitActiveSec=1h\nOnCalendar=*-*-* 02:30:00\n" in schedule
    root = _unit_root(tmp_path / "units", _units())
    dropin = root / "etc" / "systemd" / "system" / "edge-gateway-update.timer.d"
    dropin.mkdir()
    (dropin / "schedule.conf").write_text(schedule)
    proc = verify(root, "edge-gateway-update.timer")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    # without a URL: no [update] table
    extra["edge_gateway_update_manifest_url"] = ""
    (tmp_path / "vars.json").write_text(json.dumps(extra))
    proc = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-e", f"@{tmp_path / 'vars.json'}",
                           str(playbook)], cwd=ROOT / "ansible", env=_ansible_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "update" not in tomllib.loads((out / "gateway.toml").read_text())
