"""No import circle among the product's modules: every import counts, those inside functions
and under ``TYPE_CHECKING`` too (a deferred import still means two modules know each other, and
a change to one lands in both). import-linter checks the layers between packages; this checks
the modules within them, core's included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each folder of the repository and the name it installs under (setup.cfg's package_dir).
PACKAGES = {"oomguard": "oomguard", "engine": "oomguard.engine", "metrics": "oomguard.metrics",
            "probes": "oomguard.probes", "reports": "oomguard.reports"}


def _modules() -> dict[str, Path]:
    """Installed module name -> file, for every module of the product (packages excluded:
    an ``__init__`` re-exports, it is not a concept of its own)."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] != "__init__":
                out[".".join((name, *parts))] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``module`` imports anywhere in its file (a name imported from a
    package counts as its module where it is one)."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:  # oomguard.x.y.func -> oomguard.x.y
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Kosaraju: an order by finish
    time, then reachability in the reversed graph)."""
    order, seen = [], set()
    for start in graph:
        stack = [(start, iter(sorted(graph[start])))] if start not in seen else []
        seen.add(start)
        while stack:
            node, edges = stack[-1]
            nxt = next((n for n in edges if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    reverse: dict[str, set[str]] = {n: set() for n in graph}
    for node, targets in graph.items():
        for target in targets:
            reverse[target].add(node)
    groups, assigned = [], set()
    for node in reversed(order):
        if node in assigned:
            continue
        group, todo = [], [node]
        assigned.add(node)
        while todo:
            current = todo.pop()
            group.append(current)
            for prev in reverse[current] - assigned:
                assigned.add(prev)
                todo.append(prev)
        if len(group) > 1:
            groups.append(sorted(group))
    return groups


def test_the_circle_finder_finds_a_circle_and_only_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_product_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    assert "oomguard.engine.core.search.search" in modules  # the layout this maps
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    assert circles(graph) == []
