"""The package's import graph has no cycle, and phases import downward only.

The graph is built from the source with `ast` (every `import` / `from ... import`, function-level
ones included, since a lazy import closes a ring as surely as a top-level one), so the test needs
nothing beyond the standard library and runs without importing specops.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Phase modules: each may import the shared layer (target, features, text, measures, campaign,
# config, checks, drafter.model/checkpoint...) but never another phase's module.
PHASES = {
    "generate": "specops.generate",
    "build": "specops.build",
    "extract": "specops.extract",
    "train": "specops.drafter.train",
    "export": "specops.drafter.export",
    "eval": "specops.evaluate",
}
# Who may import a phase: the orchestration layer above all phases.
# report_cli is the CLI's printing half (the verdict line of `run` comes from evaluate.report).
ORCHESTRATION = {"specops.cli", "specops.report_cli", "specops.pipeline", "specops.__main__", "specops.runctl",
                 "specops.status", "specops.serve"}


def module_names(src: Path) -> dict[str, Path]:
    out = {}
    for p in src.rglob("*.py"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(src: Path, package: str = "specops") -> dict[str, set[str]]:
    """{module: modules of `package` it imports}, resolving relative imports; `from X import name`
    counts as importing X.name where that is a module, else X."""
    mods = {m: p for m, p in module_names(src).items() if m == package or m.startswith(package + ".")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a non-module attribute: its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            nxt = next(children, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def phase_of(mod: str) -> str | None:
    for phase, prefix in PHASES.items():
        if mod == prefix or mod.startswith(prefix + "."):
            return phase
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(SRC)
    assert len(graph) > 30 and "specops.target" in graph and "specops.features" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_phases_import_downward_only():
    graph = import_graph(SRC)
    sideways = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps
        if phase_of(d) and phase_of(m) != phase_of(d) and m not in ORCHESTRATION
    )
    assert not sideways, "a phase (or a shared module) imports another phase:\n" + "\n".join(sideways)


def test_a_planted_cycle_is_found(tmp_path):
    """The same checks on a copy of the tree with one lazy import planted: target -> extract."""
    src = tmp_path / "src"
    shutil.copytree(SRC / "specops", src / "specops")
    conv = src / "specops" / "target" / "conventions.py"
    conv.write_text(conv.read_text() + "\n\ndef _planted():\n    from ..extract import run_extract\n\n    return run_extract\n")
    graph = import_graph(src)
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert "specops.target.conventions" in cycle and "specops.extract" in cycle
    with pytest.raises(AssertionError):
        assert find_cycle(graph) is None


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
