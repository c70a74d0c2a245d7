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
    # ``import pskv`` / ``from .. import create`` is an edge to the package itself (layer 4)
    return {m for m in found if m in MODULES and m != name}


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


#: docs/architecture.md's layers: module prefix -> layer (the longest prefix wins)
LAYERS = {
    "pskv.errors": 0, "pskv._types": 0,
    "pskv.context": 1, "pskv.nd": 1, "pskv.np": 1, "pskv.ndarray": 1, "pskv.base": 1,
    "pskv.compression": 1, "pskv._compression_params": 1, "pskv.optimizer": 1,
    "pskv.lr_scheduler": 1, "pskv.test_utils": 1, "pskv.table": 1,
    "pskv._ps": 2,
    "pskv.kvstore": 3,
    "pskv": 4,   # the entry points: server, _cluster, testing, torch, launch, examples, tour, top
}
#: layer -> the layers below it it may import (its own is always allowed); ``_ps`` is
#: layer 0 only: no store, no NDArray, no optimizer
MAY_IMPORT = {0: set(), 1: {0}, 2: {0}, 3: {0, 1, 2}, 4: {0, 1, 2, 3}}


def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest LAYERS prefix it has."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) edge of ``graph`` that goes to a layer it may not import."""
    bad = []
    for name, deps in sorted(graph.items()):
        mine = layer_of(name)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                bad.append((name, dep))
    return bad


def test_layers_import_only_below() -> None:
    bad = upward_imports(GRAPH)
    assert not bad, "imports against docs/architecture.md's layers: " + ", ".join(
        f"{a} imports {b} (layer {layer_of(a)} -> {layer_of(b)})" for a, b in bad)


def test_the_layer_check_finds_upward_imports() -> None:
    """What slipped through a per-layer deny list once: a store importing an entry point."""
    assert upward_imports({"pskv.kvstore._create": {"pskv.server"}}) == [
        ("pskv.kvstore._create", "pskv.server")]
    assert upward_imports({"pskv._ps.worker": {"pskv.nd.ndarray"}}) == [
        ("pskv._ps.worker", "pskv.nd.ndarray")]
    assert upward_imports({"pskv.kvstore.local": {"pskv"}}) == [("pskv.kvstore.local", "pskv")]
    assert upward_imports({"pskv.nd.ops": {"pskv.errors"},
                           "pskv.server": {"pskv.kvstore._roles"}}) == []


def test_every_module_has_a_layer() -> None:
    """A new top-level module is placed in LAYERS (and in docs/architecture.md's table)."""
    top = {".".join(m.split(".")[:2]) for m in MODULES if m != "pskv"}
    entry = {"pskv.server", "pskv._cluster", "pskv.testing", "pskv.torch", "pskv.launch",
             "pskv.examples", "pskv.tour", "pskv.top"}
    unplaced = sorted(t for t in top if t not in LAYERS and t not in entry)
    assert not unplaced, f"place these in LAYERS and docs/architecture.md: {unplaced}"


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
