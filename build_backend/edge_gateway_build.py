"""edge-gateway's PEP 517 build backend: setuptools' own, with mypy added to the build requirements on request.

``EDGE_GATEWAY_COMPILE=1`` (``make venv`` and ansible/site.yml's wheel build set it) makes the frontend put mypy,
whose mypyc compiles gateway/mqtt and gateway/broker (setup.py), into the build environment. mypy is not in
``[build-system] requires`` because a build requirement that cannot be fetched (no network, a mirror without it)
fails the whole install, where setup.py can fall back to the pure-Python code when mypyc or a C compiler is
missing. Without the variable the build compiles only when mypyc is already there (``pip install
--no-build-isolation`` from an environment with mypy).
docs/compiled.md describes the build.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  # every hook not redefined below is setuptools' own

#: The mypy the compiled codec and core are built with: the same as the [test] extra's, which `make lint` runs.
MYPY = "mypy==2.4.1"
#: The environment variable that asks for the compiled codec ("1"); ``EDGE_GATEWAY_BUILD_PURE=1`` overrides it.
COMPILE_ENV = "EDGE_GATEWAY_COMPILE"


def _compile_requires() -> list[str]:
    if os.environ.get(COMPILE_ENV) == "1" and os.environ.get("EDGE_GATEWAY_BUILD_PURE") != "1":
        return [MYPY]
    return []


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    """setuptools' requirements for a wheel, and mypy when ``EDGE_GATEWAY_COMPILE=1``."""
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *_compile_requires()]


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    """setuptools' requirements for ``pip install -e``, and mypy when ``EDGE_GATEWAY_COMPILE=1``."""
    return [*_setuptools.get_requires_for_build_editable(config_settings), *_compile_requires()]
