"""The seams of docs/design.md#following-a-call, checked on the source: the facade makes
one call of its runtime (it imports one runtime module), nothing reaches through the
session into its parts, and no private name of ours crosses a package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "roundpipe"
SESSION_PARTS = (
    "store",
    "ledger",
    "optimizer",
    "versions",
    "workers",
    "inputs",
    "pool",
    "backward_steps",
    "driver",
)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the roundpipe modules ``path`` imports (from-imports resolved)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            names.add(".".join([*base, *(node.module or "").split(".")]).rstrip("."))
    return names


def test_the_facade_imports_one_runtime_module():
    runtime = {m for m in _imported_modules(PACKAGE / "model/__init__.py") if ".runtime" in m}
    assert runtime == {"roundpipe.runtime.calls"}


def test_nothing_reaches_through_the_session_into_its_parts():
    pattern = re.compile(rf"\bsession\.({'|'.join(SESSION_PARTS)})\.")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in _sources()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_no_private_name_of_ours_is_imported_across_packages():
    found = []
    for path in _sources():
        here = path.relative_to(PACKAGE.parent).with_suffix("").parts[:2]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
            base = package[: len(package) - node.level + 1]
            target = (*base, *(node.module or "").split("."))
            for alias in node.names:
                if alias.name.startswith("_") and target[:2] != here:
                    found.append(f"{path.relative_to(PACKAGE)} imports {alias.name}")
    assert found == []


def test_no_model_part_is_reached_by_a_private_attribute_from_outside_model():
    pattern = re.compile(r"\._(session|node|layers|cursor|seeds|forward|begin|start_call)\b")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in _sources()
        if path.parent.name != "runtime"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and "self._layers = layers" not in line
    ]
    assert found == []
