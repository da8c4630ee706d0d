"""The package map of docs/architecture.md holds: every import follows the allowed directions
written there, no two modules import each other in a cycle, and no module grows past 500 lines
(past 400 in rltool/engine, the package that changes most).

The allowed directions are read from the `imports` block of docs/architecture.md, so the page and
this test cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rltool"
MAX_LINES = 500
MAX_ENGINE_LINES = 400


def read_rules() -> tuple[dict[str, list[str]], set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```imports block"
    rules: dict[str, list[str]] = {}
    long_modules: set[str] = set()
    for line in block.group(1).splitlines():
        key, _, rest = line.partition(":")
        if key == "long modules":
            long_modules.update(rest.split())
        elif key.strip():
            rules[key.strip()] = rest.split()
    base = [k for k, v in rules.items() if "BASE" not in v and k.count(".") == 1
            and (PACKAGE / f"{k.split('.')[1]}.py").is_file()]
    for key, allowed in rules.items():
        if "BASE" in allowed:
            rules[key] = [a for a in allowed if a != "BASE"] + base
    return rules, long_modules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path], *, top_level_only: bool) -> set[str]:
    """rltool modules imported by `path` (absolute imports; `from pkg import mod` resolves to
    the module when `mod` is one)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "rltool")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "rltool":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found


def owner(module: str, rules: dict[str, list[str]]) -> str | None:
    """The most specific rule key naming `module` or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rules:
            return ".".join(parts[:n])
    return None


def allowed(target: str, entries: list[str]) -> bool:
    return any(target == e or target.startswith(e + ".") for e in entries)


def test_every_module_has_a_rule_and_imports_follow_it():
    rules, _ = read_rules()
    modules = all_modules()
    problems = []
    for name, path in sorted(modules.items()):
        if name == "rltool":
            continue
        key = owner(name, rules)
        if key is None:
            problems.append(f"{name}: no row in docs/architecture.md's imports block")
            continue
        for target in sorted(imports_of(path, modules, top_level_only=False)):
            if target == "rltool" or owner(target, rules) == key:
                continue
            if not allowed(target, rules[key]):
                problems.append(f"{name} imports {target}, which {key} may not import")
    assert not problems, "\n".join(problems)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    """Module-level imports form no cycle, and neither do packages counting every import."""
    rules, _ = read_rules()
    modules = all_modules()
    top = {name: imports_of(path, modules, top_level_only=True) - {"rltool", name}
           for name, path in modules.items()}
    assert find_cycle(top) is None, f"module import cycle: {' -> '.join(find_cycle(top))}"
    packages: dict[str, set[str]] = {}
    for name, path in modules.items():
        src = owner(name, rules)
        for target in imports_of(path, modules, top_level_only=False):
            dst = owner(target, rules)
            if src and dst and dst != src:
                packages.setdefault(src, set()).add(dst)
    cycle = find_cycle(packages)
    assert cycle is None, f"package import cycle: {' -> '.join(cycle)}"


def test_modules_stay_short():
    _, long_modules = read_rules()
    over = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and str(p.relative_to(ROOT)) not in long_modules]
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_engine_modules_stay_shorter():
    """The engine's scheduler, runner, model and routes are small collaborators: no module of
    rltool/engine passes MAX_ENGINE_LINES, and no exception is granted there."""
    over = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((PACKAGE / "engine").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_ENGINE_LINES]
    assert not over, f"engine modules over {MAX_ENGINE_LINES} lines: {over}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The rules are not vacuous: a delta module importing the trainer is reported."""
    rules, _ = read_rules()
    assert not allowed("rltool.train.stage", rules[owner("rltool.delta.publish", rules)])
    assert allowed("rltool.engine.api", rules["rltool.rollout"])
    assert not allowed("rltool.engine.app", rules["rltool.rollout"])
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
