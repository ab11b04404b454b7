"""The architecture holds (docs/architecture.md): ``lint-imports`` checks pyproject's
``[tool.importlinter]`` contracts: the layers mqtt <- broker <- store / upstream / auth / update <- server <- cli, no
``asyncio``, ``socket``, ``lmdb``, ``time``, ``selectors`` or ``ssl`` import under gateway/mqtt/ and gateway/broker/
(the core is sans-I/O and is given the time), and no import cycle among the modules of any package in gateway/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
