"""Compiles the MQTT codec (gateway/mqtt), the broker core (gateway/broker) and the LMDB store's row encodings
(gateway/store/records.py) to C extension modules with mypyc, from the same .py files.

pyproject.toml holds the project's metadata; this file only adds the extension modules. The compiled modules sit
next to their .py files (gateway/mqtt/packets.cpython-311-*.so, gateway/broker/broker.cpython-311-*.so) with one
shared library for all of them (gateway/_core__mypyc.*.so: the core calls the codec's native classes directly),
in a wheel and in place for ``pip install -e`` alike; gateway/native.py decides at import time which of the two
runs (``EDGE_GATEWAY_PURE=1``: the .py files). docs/compiled.md says more.

mypyc comes with mypy, which the build environment holds when ``EDGE_GATEWAY_COMPILE=1`` asks for it
(build_backend/edge_gateway_build.py) or, without build isolation, when the environment has it. Without mypy, without
a C compiler, or with ``EDGE_GATEWAY_BUILD_PURE=1`` the build warns why (pip shows it) and installs the
pure-Python package: nothing but speed depends on the compiled modules.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
#: The modules mypyc compiles. Three stay Python: the packages' __init__.py files (they choose between compiled and
#: .py modules, gateway/native.py), gateway/broker/native_classes.py (it picks mypyc_attr at run time, which compiled
#: code cannot) and gateway/broker/timers.py (a tick's deadlines, about once a second: the tests see which
#: connections a tick checks by replacing timers.check, which compiled callers would not look up).
#: The store's row encodings (records.py), open batch (open_batch.py) and batch applier (applier.py) join them: every
#: durable message is encoded and recorded there on the loop, applied to the write transaction on the writer thread,
#: and every paged-in one decoded; the rest of gateway/store drives LMDB, the event loop and the writer thread, and
#: stays Python. The protocol adapter between asyncio and the core (gateway/server/protocol.py) joins them as well:
#: every read, write and connection goes through it; the rest of gateway/server runs once per listener or tick.
#: gateway/native.py lists the same modules as COMPILED_MODULES.
_PLAIN = ("__init__.py", "native_classes.py", "timers.py")
COMPILED = [
    *(f"gateway/mqtt/{name}.py"
      for name in ("errors", "reason_codes", "primitives", "properties", "topics", "packets", "framing")),
    *sorted(f"gateway/broker/{p.name}" for p in (HERE / "gateway" / "broker").glob("*.py") if p.name not in _PLAIN),
    "gateway/store/records.py",
    "gateway/store/open_batch.py",
    "gateway/store/applier.py",
    "gateway/server/protocol.py",
]  # fmt: skip
#: The name of the shared library the modules' own extension stubs load: inside the gateway package, not at the top
#: level of site-packages.
GROUP = "gateway._core"


def _say(message: str) -> None:
    # A warning rather than a line on stderr: pip shows a build backend's warnings, and its output only with -v.
    warnings.warn(f"edge-gateway build: {message}", stacklevel=2)


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the pure-Python package when the C compiler is missing or fails.

    A failure leaves no compiled module behind (a stub without its shared library would not import), so the
    install is either all compiled or all pure.
    """

    def run(self) -> None:
        if not self.extensions:
            return
        if CACHE["hit"]:
            self._copy_from_cache(CACHE["hit"])
        else:
            try:
                super().run()
            except Exception as exc:  # CCompilerError, DistutilsPlatformError, OSError: no compiler, headers, ...
                _say(f"compiling gateway/mqtt, gateway/broker, the store's records.py, open_batch.py and "
                     f"applier.py and gateway/server/protocol.py failed ({type(exc).__name__}: {exc}); installing "
                     "the pure-Python code")
                self._remove_outputs()
                return
            if CACHE["key"]:
                self._save_to_cache(CACHE["key"])
        # What gateway/native.py compares with the .py files beside the modules: an edited source makes it run the
        # .py files until the next build instead of stale compiled code.
        record = Path(self.get_ext_fullpath(GROUP + "__mypyc")).with_name("_core__mypyc.sources")
        record.write_text("".join(f"{path.removeprefix('gateway/')} {digest}\n"  # mqtt/packets.py <sha256>
                                  for path, digest in sorted(SOURCES.items())))

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            _say(f"compiling {ext.name} failed ({type(exc).__name__}: {exc})")
            raise

    def _copy_from_cache(self, entry: Path) -> None:
        """The compiled modules of an earlier build of the same sources (:func:`_cached`), where a compile would
        write them."""
        for ext in self.extensions:
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry / ext.name, target)
            target.chmod(0o755)

    def _save_to_cache(self, key: str) -> None:
        """Keep what this build compiled under ``CACHE_DIR/key`` (written aside, then renamed: a concurrent build
        never reads half an entry), and only the ``CACHE_KEEP`` newest entries. A cache that cannot be written
        costs the next build a compile, nothing else."""
        entry = CACHE_DIR / key
        part = CACHE_DIR / f".{key}.{os.getpid()}"
        try:
            part.mkdir(parents=True)
            for ext in self.extensions:
                shutil.copyfile(self.get_ext_fullpath(ext.name), part / ext.name)
            (part / "extensions").write_text("".join(f"{ext.name}\n" for ext in self.extensions))
            part.rename(entry)
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
            return
        entries = sorted((p for p in CACHE_DIR.iterdir() if not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[CACHE_KEEP:]:
            shutil.rmtree(old, ignore_errors=True)

    def _remove_outputs(self) -> None:
        for ext in self.extensions:
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)  # in place for `pip install -e`
        Path(self.get_ext_fullpath(GROUP + "__mypyc")).with_name("_core__mypyc.sources").unlink(missing_ok=True)
        self.extensions = []


#: SHA-256 of each compiled source as mypyc read it, by path.
SOURCES: dict[str, str] = {}

#: Compiled modules kept by what decides their bytes (:func:`_cache_key`): building the same core again (the
#: image's wheel, built by each provisioning run after ``make venv`` compiled the same sources) copies them instead
#: of running mypyc and the C compiler again (about 90 s of CPU). The bytes do not depend on the project's directory
#: (the prefix maps in :func:`_extensions`), so a copy is what a compile would give. ``EDGE_GATEWAY_CORE_CACHE=0``
#: compiles regardless. image/build.sh copies it into the source snapshot it provisions from.
CACHE_DIR = HERE / "build" / "core-cache"
CACHE_KEEP = 3  # entries (about 4.5 MB each): a few source versions back
CACHE_RECIPE = "1"  # bump when the compile below changes in a way the key does not see
#: This build's key (``None``: no cache) and the entry it found (``None``: compile).
CACHE: dict[str, Any] = {"key": None, "hit": None}


def _cache_key(opt_level: str) -> str | None:
    """SHA-256 of the compiled sources, mypy (mypyc and its runtime), the Python (its version, ABI and flags), the
    machine and the C compiler (its ``--version``); ``None`` when the compiler cannot say."""
    import mypy.version

    cc = (sysconfig.get_config_var("CC") or "cc").split()
    try:
        compiler = subprocess.run([*cc[:1], "--version"], capture_output=True, text=True, check=True,
                                  timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = [CACHE_RECIPE, mypy.version.__version__, sys.version, platform.machine(), opt_level, compiler,
             *(str(sysconfig.get_config_var(name)) for name in ("EXT_SUFFIX", "CC", "CFLAGS", "LDSHARED")),
             *(f"{path} {digest}" for path, digest in sorted(SOURCES.items()))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _cached(key: str) -> list[Any] | None:
    """The extensions of cache entry ``key`` (names only: :meth:`OptionalBuildExt.run` copies their files), or
    ``None`` when there is no such entry."""
    names = CACHE_DIR / key / "extensions"
    if not names.is_file():
        return None
    CACHE["hit"] = CACHE_DIR / key
    return [Extension(name, sources=[]) for name in names.read_text().split()]


def _extensions() -> list[Any]:
    if os.environ.get("EDGE_GATEWAY_BUILD_PURE") == "1":
        _say("EDGE_GATEWAY_BUILD_PURE=1: installing the pure-Python code")
        return []
    try:
        from mypyc.build import include_dir, mypycify
    except ImportError as exc:
        _say(f"mypyc is not in this build environment ({exc}); installing the pure-Python code "
             "(EDGE_GATEWAY_COMPILE=1 has pip fetch mypy for the build: docs/compiled.md)")
        return []
    SOURCES.update({path: hashlib.sha256((HERE / path).read_bytes()).hexdigest() for path in COMPILED})
    opt_level = "3"
    if os.environ.get("EDGE_GATEWAY_CORE_CACHE") != "0":
        CACHE["key"] = _cache_key(opt_level)
        cached = _cached(CACHE["key"]) if CACHE["key"] else None
        if cached is not None:
            _say(f"the compiled modules of these sources come from {CACHE['hit'].relative_to(HERE)} (the same "
                 "sources, mypy, Python and C compiler; EDGE_GATEWAY_CORE_CACHE=0 compiles them again)")
            return cached
    cwd = os.getcwd()
    os.chdir(HERE)  # mypycify takes paths relative to the project and writes its C sources under build/
    try:
        extensions = list(mypycify(["--strict", *COMPILED], opt_level=opt_level, group_name=GROUP,
                                   target_dir="build/mypyc"))
    except SystemExit as exc:  # mypyc exits on a type error: the .py files are the source, so this is a bug
        raise SystemExit(f"edge-gateway build: mypyc refused the core ({exc.code}): see `make lint`") from None
    finally:
        os.chdir(cwd)
    # The same source gives the same bytes (ansible/site.yml's wheels; an unchanged board reports changed=0): the
    # debug information names the project's directory and mypyc's runtime in the build environment, which pip
    # makes anew under a random name for every build, so both are written as fixed names.
    prefix_maps = [f"-ffile-prefix-map={HERE}=.", f"-ffile-prefix-map={include_dir()}=mypyc/lib-rt"]
    for ext in extensions:
        ext.extra_compile_args = [*ext.extra_compile_args, *prefix_maps]
    return extensions


# Only the commands that build code need the C sources (pip's metadata hooks run this file too).
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
setup(
    ext_modules=_extensions() if _BUILDS & set(sys.argv[1:]) else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
