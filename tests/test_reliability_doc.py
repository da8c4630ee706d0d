"""docs/reliability.md points every guarantee at a test: each test it names must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_named_in_reliability_md_exists():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = set(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))
        defined[path.relative_to(ROOT).as_posix()] = names
    all_names = set().union(*defined.values())
    # `tests/a.py::test_x, ::test_y`: a bare `::name` belongs to the file named last.
    current, pairs = None, []
    for file, name in re.findall(r"(tests/[\w/]+\.py)?::(test_\w+)", doc):
        current = file or current
        pairs.append((current, name))
    assert len(pairs) >= 30
    missing = [f"{f}::{n}" for f, n in pairs if n not in defined.get(f, set())]
    missing += [n for n in re.findall(r"`(test_\w+)`", doc) if n not in all_names]
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
