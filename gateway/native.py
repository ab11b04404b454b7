"""Which core runs: the modules of the MQTT codec (gateway/mqtt), the broker core (gateway/broker), the store's row
encodings (gateway/store/records.py and the two beside it) and the protocol adapter (gateway/server/protocol.py)
compiled by mypyc, or the same .py files interpreted.

setup.py compiles them next to their .py files (``packets.cpython-311-x86_64-linux-gnu.so`` beside
``packets.py``), with one shared library for all of them (``gateway/_core__mypyc``), and records the SHA-256 of each
source it compiled in ``gateway/_core__mypyc.sources``. Python's import system prefers an extension module to a .py
file of the same name, so the compiled code runs by default. :func:`select` (run once, when the ``gateway.mqtt``,
``gateway.broker``, ``gateway.store`` or ``gateway.server`` package is first imported) makes the .py files of every
compiled module run instead when

- ``EDGE_GATEWAY_PURE=1`` is set (the pure-Python core from the same install, e.g. to compare or to test it),
- there are no compiled modules (an install without a C compiler, or built with ``EDGE_GATEWAY_BUILD_PURE=1``),
- a compiled module's .py file differs from the source its module was compiled from (an edited checkout not yet
  rebuilt: ``make venv`` rebuilds), or the shared library does not load.

It is all or nothing: the compiled modules call each other's native classes and functions directly (one shared
library), so one edited module means the .py files for all of them.

:data:`CORE` says which one was chosen and why: ``edge-gateway version --verbose`` and the ``edge_gateway_build`` info
metric show it. docs/compiled.md describes the build.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: The environment variable that asks for the pure-Python core ("1").
PURE_ENV = "EDGE_GATEWAY_PURE"
#: The modules setup.py compiles (its COMPILED list, which says why three modules stay Python): every module of
#: gateway/mqtt and gateway/broker but the packages' __init__.py files, gateway/broker/native_classes.py and
#: gateway/broker/timers.py, gateway/store/records.py, open_batch.py and applier.py, and gateway/server/protocol.py.
COMPILED_MODULES = (
    *(f"gateway.mqtt.{name}"
      for name in ("errors", "reason_codes", "primitives", "properties", "topics", "packets", "framing")),
    *(f"gateway.broker.{name}"
      for name in ("access_decisions", "actions", "barriers", "broker", "commits", "connect", "connection_states",
                   "deadlines", "delivery", "inbound", "inflight", "limits", "message", "mqueue", "output", "qos2",
                   "queue_pager", "ratelog", "reasons", "retained_store", "router", "session_lifecycle",
                   "session_state", "state", "store_port", "subscribe", "subscription_tree")),
    "gateway.store.records",
    "gateway.store.open_batch",
    "gateway.store.applier",
    "gateway.server.protocol",
)  # fmt: skip
#: The shared library the compiled modules' stubs load, and the record of the sources it was compiled from (paths
#: relative to gateway/, e.g. ``mqtt/packets.py``).
SHARED_LIBRARY = "gateway._core__mypyc"
SOURCES_RECORD = "_core__mypyc.sources"

_GATEWAY_DIR = Path(__file__).resolve().parent


class Core:
    """The core in use: ``compiled`` is True for mypyc's modules; ``reason`` says why the .py files run otherwise."""

    __slots__ = ("compiled", "reason")

    def __init__(self, compiled: bool, reason: str) -> None:
        self.compiled = compiled
        self.reason = reason

    def describe(self) -> str:
        """One line for people: ``compiled (mypyc)`` or ``pure Python (<reason>)``."""
        return "compiled (mypyc)" if self.compiled else f"pure Python ({self.reason})"


#: Set by :func:`select`; ``None`` until then.
CORE: Core | None = None


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the .py file of each compiled module, ahead of the extension module beside it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(fullname))


def _relative(module: str) -> str:
    """``gateway.mqtt.packets`` -> ``mqtt/packets`` (the path under gateway/, without a suffix)."""
    return module.partition(".")[2].replace(".", "/")


def _source(module: str) -> Path:
    return _GATEWAY_DIR / (_relative(module) + ".py")


def _extension(relative: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _GATEWAY_DIR / (relative + suffix)
        if candidate.exists():
            return candidate
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _why_not_compiled() -> str | None:
    """Why the compiled modules cannot run, or ``None`` when they can."""
    if os.environ.get(PURE_ENV) == "1":
        return f"{PURE_ENV}=1"
    if _extension("_core__mypyc") is None:
        return "no compiled modules in this install"
    record = _GATEWAY_DIR / SOURCES_RECORD
    try:
        compiled_from = dict(line.split() for line in record.read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return f"no valid {SOURCES_RECORD} beside the compiled modules"
    for module in COMPILED_MODULES:
        relative = _relative(module)
        if _extension(relative) is None:
            return f"{relative}.py was not compiled"
        if compiled_from.get(relative + ".py") != _sha256(_source(module)):
            return f"{relative}.py changed since it was compiled: `make venv` rebuilds"
    try:
        importlib.import_module(SHARED_LIBRARY)
    except ImportError as exc:
        return f"the compiled modules do not load: {exc}"
    return None


_CHOOSING = Core(False, "being chosen")


def select() -> Core:
    """Choose the core before any compiled module of gateway/mqtt or gateway/broker is imported (idempotent);
    returns :data:`CORE`.

    gateway/mqtt/__init__.py and gateway/broker/__init__.py call it; so do the places that report the choice."""
    global CORE
    if CORE is not None:
        return CORE
    CORE = _CHOOSING
    loaded = [m for m in COMPILED_MODULES if m in sys.modules]
    if loaded:  # too late to choose: say what is there
        file = getattr(sys.modules[loaded[0]], "__file__", "") or ""
        compiled = not file.endswith(".py")
        CORE = Core(compiled, "" if compiled else "imported before gateway.native could choose")
        return CORE
    reason = _why_not_compiled()
    if reason is not None:
        sys.meta_path.insert(0, _SourceFinder())
    CORE = Core(reason is None, reason or "")
    return CORE
