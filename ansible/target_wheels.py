#!/usr/bin/env python3
"""The appliance's wheels for one target architecture and Python, made on the controller (site.yml runs this).

Input: the wheel directory the first play of site.yml built for the controller (``pip wheel edge-gateway[fast]``:
edge-gateway, its dependencies and the extra wheels). Output: a directory the target installs from without any
package index, and ``target.json`` in it saying how:

- pure-Python wheels (``*-none-any``: aiomqtt, pymodbus, sdnotify built here from its sdist, ...) are copied as
  they are: they run on every architecture;
- edge-gateway itself is a binary wheel when the controller compiled its MQTT codec (mypyc, setup.py): a target of
  the controller's architecture and Python gets it as it is; any other gets the same wheel without the compiled
  modules, whose .py files are the same code (gateway/native.py runs them; ``edge-gateway version --verbose`` says
  ``core: pure Python``): it is never looked up on PyPI, where the name is not ours;
- a binary wheel (lmdb, uvloop, crcmod-plus) is copied when the target has the controller's architecture and Python
  (the same-architecture path: nothing is downloaded), otherwise the same version is fetched for the target with
  ``pip download --no-deps --only-binary=:all: --platform manylinux_2_N_<machine>... --python-version X.Y``;
- when PyPI has no wheel of that version for the target (armhf: none of the three), a known substitute:
  ``lmdb`` -> Debian's ``python3-lmdb`` from the target's apt (the venv then sees the system site-packages),
  ``crcmod-plus`` -> the same wheel without its C extension (crcmod falls back to its own pure-Python CRC code:
  plenty for serial sensor frames), ``uvloop`` -> left out (it is the optional ``fast`` extra: the broker then runs
  on asyncio's own event loop, ``broker.event_loop = "auto"``). Any other binary wheel without one is an error.

The output is rebuilt only when its inputs change (the controller's wheels, the target, this script), and the same
inputs give the same bytes, so a second run of the playbook reports changed=0.

Usage: target_wheels.py --wheels DIR --out DIR --debian-arch arm64 --python 3.11 --glibc 2.36
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import parse_wheel_filename

RECIPE = 2  # bump when the rules below change: cached outputs are then rebuilt
# Debian architecture -> the machine in wheel platform tags (manylinux_2_17_aarch64, ...)
MACHINES = {"amd64": "x86_64", "arm64": "aarch64", "armhf": "armv7l", "i386": "i686", "ppc64el": "ppc64le",
            "s390x": "s390x"}  # fmt: skip
DEBIAN_PACKAGES = {"lmdb": "python3-lmdb"}  # a Debian package of the same distribution (same import and name)
PURE_FALLBACK = {"crcmod-plus"}  # has its own pure-Python fallback when the extension is missing
OPTIONAL = {"uvloop"}  # the `fast` extra only
MANYLINUX_OLDEST = 17  # manylinux2014 = manylinux_2_17


def _is_pure(wheel: Path) -> bool:
    _, _, _, tags = parse_wheel_filename(wheel.name)
    return all(t.abi == "none" and t.platform == "any" for t in tags)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _platforms(machine: str, glibc: str) -> list[str]:
    major, minor = (int(x) for x in glibc.split(".")[:2])
    if major != 2:
        raise SystemExit(f"target_wheels.py: glibc {glibc}: only glibc 2.x targets are known")
    tags = [f"manylinux_2_{n}_{machine}" for n in range(minor, MANYLINUX_OLDEST - 1, -1)]
    return [*tags, f"manylinux2014_{machine}"]


def _download(name: str, version: str, machine: str, python: str, glibc: str, dest: Path) -> Path | None:
    """The PyPI wheel of name==version for the target, or None when there is none."""
    pyver = python.replace(".", "")
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--dest", str(dest), "--python-version", python, "--implementation", "cp",
            "--abi", f"cp{pyver}", "--abi", "abi3", "--abi", "none"]  # fmt: skip
    for platform in _platforms(machine, glibc):
        argv += ["--platform", platform]
    before = set(dest.iterdir())
    proc = subprocess.run([*argv, f"{name}=={version}"], capture_output=True, text=True)
    if proc.returncode != 0:
        if "No matching distribution" in proc.stderr or "Could not find a version" in proc.stderr:
            return None
        raise SystemExit(f"target_wheels.py: pip download {name}=={version} for {machine} failed:\n{proc.stderr}")
    new = sorted(set(dest.iterdir()) - before)
    return new[0] if new else None


def _without_extension(wheel: Path, dest: Path) -> Path:
    """A py3-none-any copy of ``wheel`` without its compiled modules (``wheel unpack`` / ``wheel pack``)."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        subprocess.run([sys.executable, "-m", "wheel", "unpack", "--dest", tmp, str(wheel)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        (unpacked,) = Path(tmp).iterdir()
        for so in [*unpacked.rglob("*.so"), *unpacked.rglob("*.pyd")]:
            so.unlink()
        (meta,) = unpacked.glob("*.dist-info/WHEEL")
        lines = [
            ln for ln in meta.read_text().splitlines() if ln.strip() and not ln.startswith(("Tag:", "Root-Is-Purelib:"))
        ]
        meta.write_text("\n".join([*lines, "Root-Is-Purelib: true", "Tag: py3-none-any"]) + "\n")
        out = Path(tmp) / "out"
        out.mkdir()
        subprocess.run([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(out), str(unpacked)], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})  # fmt: skip
        (built,) = out.iterdir()
        return Path(shutil.move(built, dest / built.name))


def build(wheels: Path, out: Path, debian_arch: str, python: str, glibc: str, controller: tuple[str, str]) -> dict:
    """Fill ``out`` for the target; returns the manifest written as out/target.json."""
    machine = MACHINES.get(debian_arch)
    if machine is None:
        raise SystemExit(f"target_wheels.py: Debian architecture {debian_arch!r} is not known; "
                         f"known: {', '.join(sorted(MACHINES))}")  # fmt: skip
    sources = sorted(wheels.glob("*.whl"))
    if not any(parse_wheel_filename(w.name)[0] == "edge-gateway" for w in sources):
        raise SystemExit(f"target_wheels.py: no edge-gateway wheel in {wheels}")
    same = (MACHINES.get(controller[0]) == machine or controller[0] == machine) and controller[1] == python
    inputs = hashlib.sha256(json.dumps([RECIPE, debian_arch, python, glibc, same, Path(__file__).read_text(),
                                        [(w.name, _sha256(w)) for w in sources]]).encode()).hexdigest()  # fmt: skip
    manifest_path = out / "target.json"
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("inputs") == inputs:
            return old
    manifest: dict = {"debian_arch": debian_arch, "machine": machine, "python": python, "glibc": glibc,
                      "requirement": "edge-gateway[fast]", "debian_packages": [], "system_site_packages": False,
                      "substitutes": {}, "inputs": inputs}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for wheel in sources:
            name, version, _, _ = parse_wheel_filename(wheel.name)
            if _is_pure(wheel) or same:
                shutil.copy2(wheel, tmp / wheel.name)
                continue
            if name == "edge-gateway":
                built = _without_extension(wheel, tmp)
                manifest["substitutes"][name] = f"{built.name} (its MQTT codec as Python: compiled for {controller[0]})"
                continue
            if _download(name, str(version), machine, python, glibc, tmp) is not None:
                continue
            if name in DEBIAN_PACKAGES:
                manifest["debian_packages"].append(DEBIAN_PACKAGES[name])
                manifest["system_site_packages"] = True
                manifest["substitutes"][name] = f"Debian's {DEBIAN_PACKAGES[name]}"
            elif name in PURE_FALLBACK:
                built = _without_extension(wheel, tmp)
                manifest["substitutes"][name] = f"{built.name} (its pure-Python code, no C extension)"
            elif name in OPTIONAL:
                manifest["requirement"] = "edge-gateway"
                manifest["substitutes"][name] = "left out (optional: the fast extra)"
            else:
                raise SystemExit(
                    f"target_wheels.py: PyPI has no {name}=={version} wheel for {debian_arch} "
                    f"({machine}, Python {python}, glibc {glibc}) and no substitute is known"
                )
        (tmp / "target.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="the controller's wheels (site.yml's first play)")
    parser.add_argument("--out", type=Path, required=True, help="the target's wheel directory (rebuilt when stale)")
    parser.add_argument("--debian-arch", required=True, help="the target's `dpkg --print-architecture`: arm64, armhf")
    parser.add_argument("--python", required=True, help="the target's python3 major.minor: 3.11")
    parser.add_argument("--glibc", required=True, help="the target's C library version: 2.36 (bookworm)")
    parser.add_argument(
        "--controller",
        nargs=2,
        metavar=("MACHINE", "PYTHON"),
        default=[os.uname().machine, "{}.{}".format(*sys.version_info[:2])],
        help="the machine and Python the controller's wheels were built on (default: this one)",
    )
    args = parser.parse_args()
    manifest = build(args.wheels, args.out, args.debian_arch, args.python, args.glibc, tuple(args.controller))
    print(json.dumps({k: v for k, v in manifest.items() if k != "inputs"}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
