"""The compiled MQTT codec and broker core and their pure-Python fallback from the same install (gateway/native.py,
setup.py): ``EDGE_GATEWAY_PURE=1`` runs the .py files, the default runs mypyc's modules when the install has them,
and an edited .py file of either package is never shadowed by a module compiled from its older text."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from gateway import native

ROOT = Path(__file__).resolve().parent.parent
# Prints how the codec runs and the file each codec module was loaded from.
PROBE = """
import importlib, gateway.native as n
print(n.select().describe())
for m in n.COMPILED_MODULES:
    print(importlib.import_module(m).__file__)
"""


def _probe(env: dict[str, str], cwd: Path, pythonpath: Path | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in (native.PURE_ENV, "PYTHONPATH")} | env
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _compiled_install() -> None:
    if not native.select().compiled:
        pytest.skip(f"this install's codec is {native.select().describe()} (make test runs with --core compiled)")


def test_pure_env_runs_the_py_files_of_the_same_install(tmp_path: Path) -> None:
    """EDGE_GATEWAY_PURE=1: every compiled module of the codec and the core is loaded from its .py file, whatever
    the install holds."""
    core, *files = _probe({native.PURE_ENV: "1"}, tmp_path)
    assert core == "pure Python (EDGE_GATEWAY_PURE=1)"
    assert len(files) == len(native.COMPILED_MODULES)
    assert all(f.endswith(".py") for f in files), files
    assert any("/gateway/broker/" in f for f in files) and any("/gateway/mqtt/" in f for f in files), files


def test_every_module_of_both_packages_is_listed_but_the_three_that_stay_python() -> None:
    """gateway/native.py lists what setup.py compiles, every module of gateway/mqtt and gateway/broker but the
    three setup.py names, the store's three and the server's protocol adapter: a module compiled but not listed
    would run stale after an edit."""
    text = (ROOT / "setup.py").read_text()
    assert '_PLAIN = ("__init__.py", "native_classes.py", "timers.py")' in text
    listed = {m.replace(".", "/") + ".py" for m in native.COMPILED_MODULES}
    plain = {"gateway/mqtt/__init__.py", "gateway/broker/__init__.py", "gateway/broker/native_classes.py",
             "gateway/broker/timers.py"}
    on_disk = {str(p.relative_to(ROOT)) for d in ("mqtt", "broker") for p in (ROOT / "gateway" / d).glob("*.py")}
    others = {"gateway/store/records.py", "gateway/store/open_batch.py", "gateway/store/applier.py",
              "gateway/server/protocol.py"}
    assert listed == on_disk - plain | others
    assert all(f'"{path}",' in text for path in others)


def test_default_runs_the_compiled_modules_as_native_classes(tmp_path: Path) -> None:
    """Without the variable a compiled install loads mypyc's extension modules, and the hot classes are native:
    fixed attributes, typed fields checked on assignment."""
    _compiled_install()
    core, *files = _probe({}, tmp_path)
    assert core == "compiled (mypyc)"
    assert all(f.endswith(".so") for f in files), files
    from gateway.broker.limits import ZoneLimits
    from gateway.broker.session_state import Connection
    from gateway.mqtt.framing import PacketReader
    from gateway.mqtt.packets import Publish

    p = Publish("a/b", b"x", 1, packet_id=7)
    with pytest.raises(AttributeError):
        p.extra = 1  # type: ignore[attr-defined]  # the point: a native class has no room for it
    with pytest.raises(TypeError):
        p.qos = "1"  # type: ignore[assignment]  # the point: the field's type is checked at run time
    assert not hasattr(PacketReader(), "__dict__")
    conn = Connection(ZoneLimits(), "default", "127.0.0.1:1", 0.0)
    with pytest.raises(TypeError):
        conn.keep_alive = "60"  # type: ignore[assignment]  # the core's classes are native too
    assert not hasattr(conn, "__dict__")


def test_an_edited_source_runs_as_python_until_rebuilt(tmp_path: Path) -> None:
    """A copy of the compiled package runs compiled; once a .py file in it changes, the copy runs every codec module
    from its .py files and says which file changed (a checkout edited after `make venv`)."""
    _compiled_install()
    copy = tmp_path / "site"
    shutil.copytree(ROOT / "gateway", copy / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    core, *_ = _probe({}, tmp_path, pythonpath=copy)
    assert core == "compiled (mypyc)"
    with (copy / "gateway" / "mqtt" / "topics.py").open("a") as f:
        f.write("\n# edited\n")
    core, *files = _probe({}, tmp_path, pythonpath=copy)
    assert core == "pure Python (mqtt/topics.py changed since it was compiled: `make venv` rebuilds)"
    assert all(f.startswith(str(copy)) and f.endswith(".py") for f in files), files


def test_an_edited_core_module_runs_every_module_as_python(tmp_path: Path) -> None:
    """One shared library serves the codec and the core: an edited module of gateway/broker makes the codec's
    modules run from their .py files too, not only the edited one."""
    _compiled_install()
    copy = tmp_path / "site"
    shutil.copytree(ROOT / "gateway", copy / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "gateway" / "broker" / "inflight.py").open("a") as f:
        f.write("\n# edited\n")
    core, *files = _probe({}, tmp_path, pythonpath=copy)
    assert core == "pure Python (broker/inflight.py changed since it was compiled: `make venv` rebuilds)"
    assert all(f.startswith(str(copy)) and f.endswith(".py") for f in files), files


def _build_backend() -> ModuleType:
    path = ROOT / "build_backend" / "edge_gateway_build.py"
    spec = importlib.util.spec_from_file_location("edge_gateway_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_asks_for_mypy_only_when_compiling_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_backend/: mypy joins the build requirements with EDGE_GATEWAY_COMPILE=1 only (a build that cannot fetch
    it installs the pure-Python codec), not with EDGE_GATEWAY_BUILD_PURE=1 as well, and it is the mypy of the [test]
    extra, which `make lint` type-checks the codec with."""
    backend = _build_backend()
    for compile_, pure, expected in (("1", None, [backend.MYPY]), (None, None, []), ("1", "1", []), ("0", None, [])):
        for name, value in ((backend.COMPILE_ENV, compile_), ("EDGE_GATEWAY_BUILD_PURE", pure)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert backend._compile_requires() == expected, (compile_, pure)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r for r in extras["test"] if r.startswith("mypy")] == [backend.MYPY]


def test_a_build_of_the_same_sources_copies_the_compiled_modules_from_the_core_cache(tmp_path: Path) -> None:
    """setup.py keeps what it compiled in build/core-cache, keyed by the sources, mypy, Python and the C compiler:
    a wheel of a snapshot of this checkout with that cache (what image/build.sh provisions from) runs neither mypyc
    nor the compiler and holds the bytes `make venv` compiled, so the image's wheel is the venv's core."""
    _compiled_install()
    cache = ROOT / "build" / "core-cache"
    if not cache.is_dir() or not any(cache.iterdir()):
        pytest.skip("no build/core-cache: this install was compiled before setup.py kept one (`make venv`)")
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, src / name)
    shutil.copytree(cache, src / "build" / "core-cache")
    env = {k: v for k, v in os.environ.items() if k not in (native.PURE_ENV, "EDGE_GATEWAY_CORE_CACHE")}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path / "out"), str(src)],
        env={**env, "EDGE_GATEWAY_COMPILE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the compiled modules of these sources come from build/core-cache/" in proc.stderr, proc.stderr[-3000:]
    assert not (src / "build" / "mypyc").exists()  # mypyc did not run
    (wheel,) = (tmp_path / "out").glob("edge_gateway-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        built = {n: zf.read(n) for n in zf.namelist() if n.endswith(".so")}
    assert len(built) == len(native.COMPILED_MODULES) + 1  # the modules and their shared library
    assert built == {name: (ROOT / name).read_bytes() for name in built}  # what this install runs
