"""docs/conformance.md stays complete and truthful: every server-side statement of MQTT 5.0 (206) and MQTT 3.1.1 (108)
has a row, each row names tests that exist or gives a "none: " reason, and nothing is left as TODO."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "conformance.md"
TESTS = ROOT / "tests"
SECTIONS = {"MQTT 5.0": 206, "MQTT 3.1.1": 108}
REF = re.compile(r"\b(test_\w+\.py)::(\w+)")
STATEMENT_ID = re.compile(r"MQTT-\d+\.\d+\.\d+-\d+")


def rows() -> dict[str, list[tuple[str, str, str]]]:
    """(statement id, summary, test cell) for every table row, by section heading ("MQTT 5.0", "MQTT 3.1.1")."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    section: str | None = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip() if line[3:].strip() in SECTIONS else None
            continue
        if section is not None and line.startswith("| MQTT-"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            assert len(cells) == 3, f"row does not have 3 cells: {line}"
            found.setdefault(section, []).append((cells[0], cells[1], cells[2]))
    return found


@cache
def defined_tests(filename: str) -> frozenset[str]:
    """Names of the module-level (async) test functions defined in ``tests/<filename>``."""
    path = TESTS / filename
    if not path.is_file():
        return frozenset()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and node.name.startswith("test_"))


def test_both_sections_have_all_their_rows_with_unique_ids() -> None:
    """206 MQTT 5.0 and 108 MQTT 3.1.1 statements, each id once per section and well-formed."""
    found = rows()
    assert {name: len(found.get(name, [])) for name in SECTIONS} == SECTIONS
    for name in SECTIONS:
        ids = [statement for statement, _summary, _cell in found[name]]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        assert duplicates == [], f"{name}: duplicate ids {duplicates}"
        bad = [i for i in ids if not STATEMENT_ID.fullmatch(i)]
        assert bad == [], f"{name}: malformed ids {bad}"


def test_no_todo_left() -> None:
    """Nothing in the file is left to be recorded."""
    assert "TODO" not in DOC.read_text(encoding="utf-8")


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_row_has_tests_or_a_none_reason(section: str) -> None:
    """A Test cell lists references (`file.py::test_function`) or starts with "none: " and a reason."""
    bad = []
    for statement, summary, cell in rows()[section]:
        assert summary, statement
        if cell.startswith("none: "):
            if len(cell) < len("none: ") + 20:
                bad.append((statement, "reason too short", cell))
            continue
        parts = [p.strip() for p in cell.split("<br>")]
        if not parts or not all(REF.fullmatch(p.strip("`")) for p in parts):
            bad.append((statement, "neither references nor a none: reason", cell))
        elif len(set(parts)) != len(parts):
            bad.append((statement, "a test is listed twice", cell))
    assert bad == []


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_referenced_test_exists(section: str) -> None:
    """Each `file.py::test_function` (in a reference list or inside a "none: " reason) names a test function that
    is defined in that file; a parametrized test counts by its function name."""
    missing = []
    for statement, _summary, cell in rows()[section]:
        for filename, name in REF.findall(cell):
            if name not in defined_tests(filename):
                missing.append((statement, f"{filename}::{name}"))
    assert missing == []


def test_every_conformance_extra_test_is_referenced() -> None:
    """tests/test_conformance_extra.py exists for this file: each of its tests is cited by at least one row."""
    text = DOC.read_text(encoding="utf-8")
    cited = {name for filename, name in REF.findall(text) if filename == "test_conformance_extra.py"}
    assert sorted(defined_tests("test_conformance_extra.py") - cited) == []
