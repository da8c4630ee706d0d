"""benchmarks/results/ holds exactly what the docs cite, each file named NAME-YYYY-MM-DD-DEVICE.EXT.

A citation is a path `benchmarks/results/PATTERN` in docs/*.md or README.md, or a bare file name of
the results form in backticks (a sentence that already named the folder). PATTERN is shell-style:
`{a,b}` alternatives are expanded and each alternative is matched with fnmatch (`*`, `?`).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# DEVICE: cpuN (N cores), or a GPU model with an optional xN for N cards (h100, h200, h100x8).
NAME_FORM = re.compile(
    r"(?P<name>[a-z0-9][a-z0-9_.-]*?)-(?P<date>\d{4}-\d{2}-\d{2})"
    r"-(?P<device>cpu\d+|[a-z]+\d+(?:x\d+)?)\.(?:json|txt)"
)
PATH_CITATION = re.compile(r"benchmarks/results/([\w.{},*?-]*)")
BARE_CITATION = re.compile(r"`([\w.{},*?-]*-\d{4}-\d{2}-\d{2}-[\w.{},*?-]*)`")


def _docs() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _expand(pattern: str) -> list[str]:
    """`a{b,c}d{e,f}` -> abde, abdf, acde, acdf (no nesting, as in the docs)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [x for alt in match.group(1).split(",") for x in _expand(head + alt + tail)]


def _citations() -> list[tuple[str, str]]:
    """(where, pattern) for every citation; where is doc:line."""
    found = []
    for doc in _docs():
        rel = doc.relative_to(ROOT).as_posix()
        for lineno, line in enumerate(doc.read_text().splitlines(), start=1):
            patterns = [m.group(1) for m in PATH_CITATION.finditer(line)]
            patterns += [m.group(1) for m in BARE_CITATION.finditer(line)]
            for pattern in patterns:
                pattern = pattern.rstrip(".,")  # sentence punctuation after a citation
                if pattern:  # `benchmarks/results/` alone names the folder, not a file
                    found.append((f"{rel}:{lineno}", pattern))
    return found


def _result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def test_every_result_file_is_named_name_date_device():
    bad = []
    for name in _result_files():
        match = NAME_FORM.fullmatch(name)
        if match is None:
            bad.append(name)
            continue
        try:
            dt.date.fromisoformat(match["date"])
        except ValueError:
            bad.append(name)
    assert not bad, (
        "benchmarks/results/ files not named NAME-YYYY-MM-DD-DEVICE.{json,txt} "
        f"(DEVICE such as cpu2, h100, h200, h100x8; no subfolders): {bad}"
    )


def test_every_citation_matches_a_result_file():
    files = _result_files()
    dangling = []
    for where, pattern in _citations():
        if pattern.count("{") != pattern.count("}"):
            dangling.append(f"{where}: {pattern} (unclosed brace: keep a pattern on one line)")
            continue
        for alternative in _expand(pattern):
            if not fnmatch.filter(files, alternative):
                dangling.append(f"{where}: {alternative}")
    assert not dangling, "docs cite benchmark results that do not exist:\n" + "\n".join(dangling)


def test_every_result_file_is_cited_by_a_doc():
    citations = _citations()
    assert len(citations) >= 50  # the extraction itself still finds the docs' citations
    files = _result_files()
    cited: set[str] = set()
    for _, pattern in citations:
        for alternative in _expand(pattern):
            cited.update(fnmatch.filter(files, alternative))
    uncited = [name for name in files if name not in cited]
    assert not uncited, (
        "benchmarks/results/ files no doc cites (cite each from the figure it backs in "
        f"docs/*.md or README.md, or delete it): {uncited}"
    )
