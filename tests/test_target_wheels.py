"""ansible/target_wheels.py's choice of edge-gateway's wheel for a target: the controller's as it is for its own
machine, with the compiled modules of a wheel built on the target's machine when one matches its sources, else
without compiled modules (docs/compiled.md "Images and other architectures").

The wheels are real wheels made with ``wheel pack`` from small trees shaped like edge-gateway's (a .py file, the
compiled module's stub, the shared library and the record of the sources it was compiled from); no package index is
used: the controller's wheel directory holds no binary dependency.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "ansible" / "target_wheels.py"
PACKETS = "PACKETS = 1\n"


def _wheel(dest: Path, tag: str, packets: str = PACKETS, machine: str | None = None) -> Path:
    """An edge-gateway 0.1.0 wheel tagged ``tag``: gateway/mqtt/packets.py, and when ``machine`` is given a stub
    and a shared library whose bytes name that machine, with the record of the sources they were compiled from."""
    tree = dest / f"tree-{tag}-{hashlib.sha256(packets.encode()).hexdigest()[:6]}" / "edge_gateway-0.1.0"
    (tree / "gateway" / "mqtt").mkdir(parents=True)
    (tree / "gateway" / "__init__.py").write_text('__version__ = "0.1.0"\n')
    (tree / "gateway" / "mqtt" / "packets.py").write_text(packets)
    if machine is not None:
        suffix = f".cpython-311-{machine}-linux-gnu.so"
        (tree / "gateway" / "mqtt" / f"packets{suffix}").write_bytes(b"stub " + machine.encode())
        (tree / "gateway" / f"_core__mypyc{suffix}").write_bytes(b"lib " + machine.encode())
        digest = hashlib.sha256(packets.encode()).hexdigest()
        (tree / "gateway" / "_core__mypyc.sources").write_text(f"mqtt/packets.py {digest}\n")
    info = tree / "edge_gateway-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: edge-gateway\nVersion: 0.1.0\n")
    purelib = str(machine is None).lower()
    (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(dest), str(tree)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})  # fmt: skip
    return dest / f"edge_gateway-0.1.0-{tag}.whl"


def _run(wheels: Path, out: Path, debian_arch: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--wheels", str(wheels), "--out", str(out),
                           "--debian-arch", debian_arch, "--python", "3.11", "--glibc", "2.36",
                           "--controller", "x86_64", "3.11"], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _edge_gateway(out: Path) -> Path:
    (wheel,) = out.glob("edge_gateway-*.whl")
    return wheel


def _files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def test_the_controllers_machine_gets_its_wheel_and_not_the_targets(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    own = _wheel(wheels, "cp311-cp311-linux_x86_64", machine="x86_64")
    _wheel(wheels, "cp311-cp311-linux_aarch64", machine="aarch64")
    _run(wheels, tmp_path / "out", "amd64")
    assert _edge_gateway(tmp_path / "out").read_bytes() == own.read_bytes()


def test_a_target_built_wheel_gives_its_compiled_modules_to_the_controllers_wheel(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    own = _wheel(wheels, "cp311-cp311-linux_x86_64", machine="x86_64")
    _wheel(wheels, "cp311-cp311-linux_aarch64", machine="aarch64")
    manifest = _run(wheels, tmp_path / "out", "arm64")
    wheel = _edge_gateway(tmp_path / "out")
    assert wheel.name == "edge_gateway-0.1.0-cp311-cp311-linux_aarch64.whl"
    assert manifest["core"] == "compiled for aarch64"
    files = _files(wheel)
    compiled = sorted(name for name in files if name.endswith(".so"))
    assert compiled == ["gateway/_core__mypyc.cpython-311-aarch64-linux-gnu.so",
                        "gateway/mqtt/packets.cpython-311-aarch64-linux-gnu.so"]  # fmt: skip
    assert files["gateway/mqtt/packets.cpython-311-aarch64-linux-gnu.so"] == b"stub aarch64"
    assert files["gateway/mqtt/packets.py"] == _files(own)["gateway/mqtt/packets.py"]
    wheel_meta = files["edge_gateway-0.1.0.dist-info/WHEEL"].decode()
    assert "Tag: cp311-cp311-linux_aarch64" in wheel_meta and "Root-Is-Purelib: false" in wheel_meta
    # The same inputs give the same bytes (a second provisioning run reports changed=0).
    _run(wheels, tmp_path / "again", "arm64")
    assert _edge_gateway(tmp_path / "again").read_bytes() == wheel.read_bytes()


def test_a_target_built_wheel_of_other_sources_is_not_used(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "cp311-cp311-linux_x86_64", packets="PACKETS = 2\n", machine="x86_64")
    _wheel(wheels, "cp311-cp311-linux_aarch64", machine="aarch64")
    manifest = _run(wheels, tmp_path / "out", "arm64")
    wheel = _edge_gateway(tmp_path / "out")
    assert wheel.name == "edge_gateway-0.1.0-py3-none-any.whl"
    assert not [name for name in _files(wheel) if name.endswith(".so")]
    assert _files(wheel)["gateway/mqtt/packets.py"] == b"PACKETS = 2\n"
    assert manifest["core"].startswith("pure Python: ")
    assert "compiled from another gateway/mqtt/packets.py" in manifest["core"]


def test_without_a_target_built_wheel_the_compiled_modules_are_left_out(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "cp311-cp311-linux_x86_64", machine="x86_64")
    manifest = _run(wheels, tmp_path / "out", "arm64")
    wheel = _edge_gateway(tmp_path / "out")
    assert wheel.name == "edge_gateway-0.1.0-py3-none-any.whl"
    assert not [name for name in _files(wheel) if name.endswith(".so")]
    assert manifest["core"] == "pure Python: no edge-gateway wheel built for it"


def test_a_pure_controller_wheel_takes_the_targets_compiled_modules_too(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "py3-none-any")
    _wheel(wheels, "cp311-cp311-linux_aarch64", machine="aarch64")
    manifest = _run(wheels, tmp_path / "out", "arm64")
    assert _edge_gateway(tmp_path / "out").name == "edge_gateway-0.1.0-cp311-cp311-linux_aarch64.whl"
    assert manifest["core"] == "compiled for aarch64"
