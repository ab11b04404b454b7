#!/usr/bin/env python3
"""The appliance's wheels for one target architecture and Python, made on the controller (site.yml runs this).

Input: the wheel directory the first play of site.yml built for the controller (``pip wheel edge-gateway[fast]``:
edge-gateway, its dependencies and the extra wheels). Output: a directory the target installs from without any
package index, and ``target.json`` in it saying how:

- pure-Python wheels (``*-none-any``: aiomqtt, pymodbus, sdnotify built here from its sdist, ...) are copied as
  they are: they run on every architecture;
- edge-gateway itself is a binary wheel when the controller compiled its MQTT codec and broker core (mypyc,
  setup.py): a target of the controller's architecture and Python gets it as it is. Any other gets the controller's
  wheel with the compiled modules of an edge-gateway wheel built on the target's machine and Python, when the wheel
  directory holds one (image/build.sh builds it under qemu-user for ``make image ARCH=arm64``) and it was compiled
  from the same sources as the controller's .py files; otherwise the controller's wheel without its compiled modules,
  whose .py files are the same code (gateway/native.py runs them; ``edge-gateway version --verbose`` says
  ``core: pure Python``). It is never looked up on PyPI, where the name is not ours;
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

RECIPE = 3  # bump when the rules below change: cached outputs are then rebuilt
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


def _machines(wheel: Path) -> set[str]:
    """The machines a wheel's platform tags name (``linux_aarch64`` -> aarch64); empty for a pure wheel."""
    _, _, _, tags = parse_wheel_filename(wheel.name)
    return {machine for t in tags if t.platform != "any" for machine in MACHINES.values()
            if t.platform.endswith("_" + machine)}  # fmt: skip


def _built_for(wheel: Path, machine: str, python: str) -> bool:
    """Whether a binary wheel is for ``machine`` and CPython ``python`` (3.11: cp311)."""
    _, _, _, tags = parse_wheel_filename(wheel.name)
    cp = "cp" + python.replace(".", "")
    return any(t.interpreter == cp and t.platform.endswith("_" + machine) for t in tags)


def _own_wheels(sources: list[Path], machine: str, controller_machine: str) -> tuple[Path, list[Path]]:
    """The controller's edge-gateway wheel and the wheels of edge-gateway built for ``machine`` on such a machine.

    Other edge-gateway wheels (built for a third machine, or an older build of the controller's under another tag)
    are left out. Of several for the controller the newest file is its."""
    ours = [w for w in sources if parse_wheel_filename(w.name)[0] == "edge-gateway"]
    controller = [w for w in ours if not _machines(w) or controller_machine in _machines(w)]
    if not controller:
        raise SystemExit("target_wheels.py: no edge-gateway wheel of the controller's among "
                         + ", ".join(w.name for w in ours))  # fmt: skip
    return max(controller, key=lambda w: w.stat().st_mtime), [w for w in ours if machine in _machines(w)]


def _unpack(wheel: Path, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "wheel", "unpack", "--dest", str(dest), str(wheel)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    (unpacked,) = dest.iterdir()
    return unpacked


def _pack(unpacked: Path, tags: list[str], purelib: bool, dest: Path) -> Path:
    """``wheel pack`` of ``unpacked`` with its WHEEL file's tags replaced (the same input gives the same bytes)."""
    (meta,) = unpacked.glob("*.dist-info/WHEEL")
    lines = [
        ln for ln in meta.read_text().splitlines() if ln.strip() and not ln.startswith(("Tag:", "Root-Is-Purelib:"))
    ]
    lines += [f"Root-Is-Purelib: {str(purelib).lower()}", *(f"Tag: {t}" for t in tags)]
    meta.write_text("\n".join(lines) + "\n")
    out = unpacked.parent / "out"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(out), str(unpacked)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})  # fmt: skip
    (built,) = out.iterdir()
    return Path(shutil.move(built, dest / built.name))


def _compiled_files(unpacked: Path) -> list[Path]:
    return sorted([*unpacked.rglob("*.so"), *unpacked.rglob("*.pyd"), *unpacked.rglob("_core__mypyc.sources")])


def _with_target_core(wheel: Path, target_built: Path, dest: Path) -> Path | str:
    """The controller's ``wheel`` with the compiled modules of ``target_built`` (edge-gateway compiled on the
    target's machine) in place of its own, tagged as ``target_built`` is; or why that wheel cannot give them.

    Only the compiled modules come from ``target_built``: everything else, the .py files included, is the
    controller's, so a target-built wheel stays usable while the codec and the core it was compiled from are
    unchanged (gateway/_core__mypyc.sources, which gateway/native.py checks at import, must match the controller's
    .py files, and list the same modules as the controller's own record when it has one)."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        ours = _unpack(wheel, Path(tmp) / "ours")
        theirs = _unpack(target_built, Path(tmp) / "theirs")
        record = theirs / "gateway" / "_core__mypyc.sources"
        if not record.exists():
            return f"{target_built.name} has no compiled modules"
        compiled_from = dict(line.split() for line in record.read_text().splitlines() if line.strip())
        for relative, digest in sorted(compiled_from.items()):
            source = ours / "gateway" / relative
            if not source.exists() or _sha256(source) != digest:
                return f"{target_built.name} was compiled from another gateway/{relative}"
        own_record = ours / "gateway" / "_core__mypyc.sources"
        if own_record.exists():
            own = {line.split()[0] for line in own_record.read_text().splitlines() if line.strip()}
            if own != set(compiled_from):
                return f"{target_built.name} compiled other modules than the controller's build"
        for path in _compiled_files(ours):
            path.unlink()
        for path in _compiled_files(theirs):
            inside = ours / path.relative_to(theirs)
            inside.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, inside)
        (meta,) = theirs.glob("*.dist-info/WHEEL")
        tags = [ln.split(":", 1)[1].strip() for ln in meta.read_text().splitlines() if ln.startswith("Tag:")]
        return _pack(ours, tags, purelib=False, dest=dest)


def _without_extension(wheel: Path, dest: Path) -> Path:
    """A py3-none-any copy of ``wheel`` without its compiled modules (``wheel unpack`` / ``wheel pack``)."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        unpacked = _unpack(wheel, Path(tmp) / "unpacked")
        for so in [*unpacked.rglob("*.so"), *unpacked.rglob("*.pyd")]:
            so.unlink()
        return _pack(unpacked, ["py3-none-any"], purelib=True, dest=dest)


def build(wheels: Path, out: Path, debian_arch: str, python: str, glibc: str, controller: tuple[str, str]) -> dict:
    """Fill ``out`` for the target; returns the manifest written as out/target.json."""
    machine = MACHINES.get(debian_arch)
    if machine is None:
        raise SystemExit(f"target_wheels.py: Debian architecture {debian_arch!r} is not known; "
                         f"known: {', '.join(sorted(MACHINES))}")  # fmt: skip
    sources = sorted(wheels.glob("*.whl"))
    if not any(parse_wheel_filename(w.name)[0] == "edge-gateway" for w in sources):
        raise SystemExit(f"target_wheels.py: no edge-gateway wheel in {wheels}")
    controller_machine = MACHINES.get(controller[0], controller[0])
    same = controller_machine == machine and controller[1] == python
    own, built_here = _own_wheels(sources, machine, controller_machine)
    target_built = [w for w in built_here if _built_for(w, machine, python)]
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
            if name == "edge-gateway" and wheel != own:
                continue  # built for the target (taken below from it) or for a third machine
            if name == "edge-gateway" and not same:
                why = "no edge-gateway wheel built for it"
                for candidate in target_built:
                    result = _with_target_core(wheel, candidate, tmp)
                    if isinstance(result, Path):
                        manifest["substitutes"][name] = (f"{result.name} (the controller's wheel with the compiled "
                                                         f"MQTT codec and broker core of {candidate.name}, built on "
                                                         f"{machine})")  # fmt: skip
                        manifest["core"] = f"compiled for {machine}"
                        break
                    why = result
                else:
                    manifest["core"] = f"pure Python: {why}"
                    if _is_pure(wheel):
                        shutil.copy2(wheel, tmp / wheel.name)
                    else:
                        built = _without_extension(wheel, tmp)
                        manifest["substitutes"][name] = (f"{built.name} (its MQTT codec and broker core as Python: "
                                                         f"compiled for {controller[0]}; {why})")  # fmt: skip
                continue
            if _is_pure(wheel) or same:
                shutil.copy2(wheel, tmp / wheel.name)
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
