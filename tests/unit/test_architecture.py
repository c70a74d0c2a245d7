"""The layering docs/architecture.md describes: who may import whom, and no import cycles.

Read from the source with ``ast`` (nothing is imported): every ``import`` of a pskv module,
at module level or inside a function, is an edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "pskv").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The pskv modules ``name`` imports (anywhere in it)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES and m != name and m != "pskv"}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere_in_pskv() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, cycles


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer,forbidden", [
    ("pskv.errors", ("pskv.",)),
    ("pskv._types", ("pskv.",)),
    ("pskv._ps", ("pskv.kvstore", "pskv.nd", "pskv.optimizer", "pskv.compression",
                  "pskv.server", "pskv.testing", "pskv._cluster")),
    ("pskv.kvstore", ("pskv.testing", "pskv._cluster", "pskv.launch", "pskv.torch")),
    ("pskv.table", ("pskv.kvstore", "pskv._ps", "pskv.server", "pskv.testing", "pskv._cluster",
                    "pskv.launch", "pskv.torch", "pskv.examples")),
])
def test_layers_import_only_below(layer: str, forbidden: tuple[str, ...]) -> None:
    for name, deps in GRAPH.items():
        if name == layer or name.startswith(layer + "."):
            bad = sorted(d for d in deps if d.startswith(forbidden)
                         and not d.startswith(layer) and d not in ("pskv.errors", "pskv._types"))
            assert not bad, f"{name} imports {bad}"


def test_engine_has_no_sockets_and_no_threads() -> None:
    tree = ast.parse(MODULES["pskv.kvstore._engine"].read_text())
    names = {a.name.split(".")[0] for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom))
             for a in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert not names & {"socket", "threading", "zmq", "select", "asyncio"}, names
    assert not {d for d in GRAPH["pskv.kvstore._engine"] if d.startswith("pskv._ps")}


def test_local_and_dist_stores_are_siblings() -> None:
    assert "pskv.kvstore.local" not in GRAPH["pskv.kvstore.dist"]
    assert "pskv.kvstore.dist" not in GRAPH["pskv.kvstore.local"]
    assert not GRAPH["pskv.kvstore.base"] & {"pskv.kvstore.local", "pskv.kvstore.dist",
                                              "pskv.kvstore._create"}
