"""The layering docs/architecture.md describes: who may import whom, and no import cycles.

Read from the source with ``ast`` (nothing is imported): every ``import`` of a pskv module,
at module level or inside a function, is an edge.
"""
from __future__ import annotations

import ast
import re
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
    "pskv": 4,   # the entry points: server, _cluster, testing, torch, launch, examples, tour, top,
                 # sinks, data
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
                           "pskv.server": {"pskv.kvstore.server._roles"}}) == []


def test_every_module_has_a_layer() -> None:
    """A new top-level module is placed in LAYERS (and in docs/architecture.md's table)."""
    top = {".".join(m.split(".")[:2]) for m in MODULES if m != "pskv"}
    entry = {"pskv.server", "pskv._cluster", "pskv.testing", "pskv.torch", "pskv.launch",
             "pskv.examples", "pskv.tour", "pskv.top", "pskv.stream", "pskv.sinks",
             "pskv.serving", "pskv.data"}
    unplaced = sorted(t for t in top if t not in LAYERS and t not in entry)
    assert not unplaced, f"place these in LAYERS and docs/architecture.md: {unplaced}"


# ---- wings: inside a layer, each package a wing; a wing imports only wings below it ---------
#: docs/architecture.md's wings of layers 2 and 3, bottom up: wing -> its tier. Module
#: prefixes (the longest wins); a module of the package not named here is its ground floor.
WINGS = {
    "pskv.kvstore": {"pskv.kvstore": 0,                  # the ground floor: vocabulary
                     "pskv.kvstore.engine": 1,
                     "pskv.kvstore.durable": 2,
                     "pskv.kvstore.server": 3, "pskv.kvstore.dist": 3,   # siblings
                     # the stores, then create(), on top
                     "pskv.kvstore.local": 4, "pskv.kvstore._create": 5},
    "pskv._ps": {"pskv._ps": 0,
                 "pskv._ps.collective": 1, "pskv._ps.observe": 1,         # siblings
                 "pskv._ps.scheduler": 2, "pskv._ps.worker": 2},          # the nodes
}
#: the package modules themselves sit on top (pskv.kvstore re-exports the stores)
WING_TOPS = {"pskv.kvstore": 6, "pskv._ps": 0}


def wing_of(module: str) -> tuple[str, int] | None:
    """(wing prefix, tier) of ``module``, or None outside the winged packages."""
    for package, wings in WINGS.items():
        if module == package:
            return package, WING_TOPS[package]
        if module.startswith(package + "."):
            best = max((w for w in wings if module == w or module.startswith(w + ".")), key=len)
            return best, wings[best]
    return None


def wing_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every edge from one wing to another that is not below it (siblings included)."""
    bad = []
    for name, deps in sorted(graph.items()):
        mine = wing_of(name)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = wing_of(dep)
            if theirs is None or theirs[0] == mine[0]:
                continue
            same_package = theirs[0].split(".")[:2] == mine[0].split(".")[:2]
            if same_package and theirs[1] >= mine[1]:
                bad.append((name, dep))
    return bad


def test_a_wing_imports_only_wings_below_it() -> None:
    bad = wing_violations(GRAPH)
    assert not bad, "imports against docs/architecture.md's wings: " + ", ".join(
        f"{a} imports {b} ({wing_of(a)} -> {wing_of(b)})" for a, b in bad)


def test_the_wing_check_finds_sideways_and_upward_imports() -> None:
    assert wing_violations({"pskv.kvstore.engine._core": {"pskv.kvstore.durable._shards"},
                            "pskv.kvstore.dist._store": {"pskv.kvstore.server._core"},
                            "pskv.kvstore._tables": {"pskv.kvstore.engine._tables"},
                            "pskv._ps.observe.metrics": {"pskv._ps.collective.core"},
                            "pskv._ps.serve": {"pskv._ps.worker"}}) == [
        ("pskv._ps.observe.metrics", "pskv._ps.collective.core"),
        ("pskv._ps.serve", "pskv._ps.worker"),
        ("pskv.kvstore._tables", "pskv.kvstore.engine._tables"),
        ("pskv.kvstore.dist._store", "pskv.kvstore.server._core"),
        ("pskv.kvstore.engine._core", "pskv.kvstore.durable._shards")]
    assert wing_violations({"pskv.kvstore.server._core": {"pskv.kvstore.durable._shards",
                                                          "pskv.kvstore.engine._core"},
                            "pskv.kvstore.local": {"pskv.kvstore.engine._core"},
                            "pskv._ps.worker": {"pskv._ps.observe.series"}}) == []


def test_every_kvstore_and_ps_module_has_a_wing() -> None:
    """A new folder in kvstore/ or _ps/ is placed in WINGS (and docs/architecture.md)."""
    for package in WINGS:
        depth = len(package.split(".")) + 1
        folders = {".".join(m.split(".")[:depth]) for m in MODULES
                   if m.startswith(package + ".") and len(m.split(".")) > depth}
        assert folders <= set(WINGS[package]), sorted(folders - set(WINGS[package]))


def _wing_members(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def _third_party(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    return {a.name.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
            for a in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}


IO = {"socket", "threading", "zmq", "select", "selectors", "asyncio", "subprocess"}


def test_the_engine_wing_has_no_sockets_and_no_threads() -> None:
    """docs/architecture.md: the engine imports neither sockets nor threads, and of _ps only
    ``bounds`` (the pure checks of an INIT's placements)."""
    for m in _wing_members("pskv.kvstore.engine"):
        assert not _third_party(m) & IO, (m, _third_party(m) & IO)
        assert {d for d in GRAPH[m] if d.startswith("pskv._ps")} <= {"pskv._ps.bounds"}, m


def test_the_ground_floor_reads_only_settings_and_formats_of_ps() -> None:
    """The ground floor of pskv.kvstore (what the engine and both stores share) opens no
    socket and starts no thread: of _ps it reads settings, key placement and the checks of
    the message format only."""
    allowed = {"pskv._ps.config", "pskv._ps.partition", "pskv._ps.bounds", "pskv._ps.message"}
    for m in MODULES:
        if wing_of(m) == ("pskv.kvstore", 0) and m != "pskv.kvstore":
            ps = {d for d in GRAPH[m] if d.startswith("pskv._ps")}
            assert ps <= allowed, (m, ps - allowed)
            assert not _third_party(m) & (IO - {"threading"}), m


def test_only_the_server_and_durable_wings_import_the_server_side_of_ps() -> None:
    """docs/architecture.md: the serving loop, the scheduler, the staleness gate, the backup
    ring and the re-send placement are imported by the server and durable wings only."""
    server_side = {"pskv._ps.serve", "pskv._ps.scheduler", "pskv._ps.staleness",
                   "pskv._ps.ring"}
    for m, deps in GRAPH.items():
        if deps & server_side and m.startswith("pskv.kvstore"):
            assert wing_of(m)[0] in {"pskv.kvstore.server", "pskv.kvstore.durable"}, (
                m, deps & server_side)


def test_only_the_dist_wing_imports_the_worker_side_of_ps() -> None:
    worker_side = {"pskv._ps.worker", "pskv._ps.collective.core", "pskv._ps.failover"}
    for m, deps in GRAPH.items():
        if deps & worker_side and m.startswith("pskv.kvstore"):
            assert wing_of(m)[0] == "pskv.kvstore.dist", (m, deps & worker_side)


def test_local_and_dist_stores_are_siblings() -> None:
    dist = set(_wing_members("pskv.kvstore.dist"))
    assert not any("pskv.kvstore.local" in GRAPH[m] for m in dist)
    assert not GRAPH["pskv.kvstore.local"] & dist
    assert not GRAPH["pskv.kvstore.base"] & ({"pskv.kvstore.local", "pskv.kvstore._create"}
                                              | dist)


def test_prometheus_client_is_imported_only_by_the_metrics_module_only_when_asked() -> None:
    """docs/architecture.md: ``prometheus_client`` is imported only inside functions, by
    the observe wing and by pskv-top's parser (a job without PSKV_METRICS_PORT never
    imports it)."""
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for node in tree.body
               if isinstance(node, (ast.Import, ast.ImportFrom))
               for a in (node.names if isinstance(node, ast.Import)
                         else [ast.alias(node.module or "")])}
        assert "prometheus_client" not in top, m
        if "prometheus_client" in _third_party(m):
            assert m.startswith("pskv._ps.observe.") or m == "pskv.top", m


def test_failover_reaches_the_network_only_through_links() -> None:
    """docs/architecture.md: ``Failover`` reaches the network only through the ``Links``
    protocol (so fake links drive it): it imports no transport and no socket (a lock is
    all it takes of threading)."""
    m = "pskv._ps.failover"
    assert not _third_party(m) & (IO - {"threading"})
    assert not GRAPH[m] & {"pskv._ps.transport", "pskv._ps.stream", "pskv._ps.zeromq",
                           "pskv._ps.postoffice", "pskv._ps.worker", "pskv._ps.sealed"}


def test_only_the_failover_and_the_server_read_membership_events() -> None:
    """docs/architecture.md: the Postoffice's events (``next_event()``) are read by the
    worker's ``Failover`` (and by ``KVWorker`` while it connects, which hands each to the
    Failover) and by the server's ``Takeovers`` (durable wing), by nothing else."""
    readers = sorted(m for m, path in MODULES.items() if "next_event(" in path.read_text()
                     and m != "pskv._ps.postoffice")
    assert readers == ["pskv._ps.failover", "pskv._ps.worker",
                       "pskv.kvstore.durable._takeover"], readers


def test_only_the_in_process_cluster_sets_the_inproc_transport() -> None:
    """docs/architecture.md: ``transport == 'inproc'`` is set only by the in-process
    cluster (``pskv._cluster``, which pskv.testing re-exports)."""
    setters = sorted(m for m, path in MODULES.items()
                     if re.search(r"transport\s*=\s*[\"']inproc", path.read_text()))
    assert setters == ["pskv._cluster"], setters


def test_shared_memory_reaches_another_process_only_by_descriptor_passing() -> None:
    """docs/architecture.md: a process's memory reaches another one way: a descriptor passed
    along a plain Unix-socket link (``StreamConn.keep_fds``, ``send(..., fds=)``); no module
    opens ``/proc/<pid>/fd`` (which needs the peer's pid, the same user and a visible /proc)
    and only the transport's stream and the collective's writer call ``sendmsg`` with
    descriptors (``shm.fd_message``)."""
    opens = sorted(m for m, path in MODULES.items()
                   if re.search(r"/proc/[{\w]", path.read_text().replace("/proc/self/", "")
                                .replace("/proc/sys/", "")))
    assert opens == [], opens
    passing = sorted(m for m, path in MODULES.items() if "fd_message(" in path.read_text()
                     and m != "pskv._ps.shm")
    assert passing == ["pskv._ps.collective.core", "pskv._ps.stream"], passing


def test_no_module_is_over_500_lines_without_a_reason_at_its_top() -> None:
    """Issue #30: a module over 500 lines says why at its top ("Over 500 lines because
    ..." in its docstring, or in a comment of its first 40 lines)."""
    unexplained = []
    for name, path in sorted(MODULES.items()):
        text = path.read_text()
        if text.count("\n") <= 500:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        head = "\n".join(text.splitlines()[:40])
        if "Over 500 lines because" not in doc and "# Over 500 lines because" not in head:
            unexplained.append(f"{name} ({text.count(chr(10))} lines)")
    assert not unexplained, ("say why at the top ('Over 500 lines because ...') or split: "
                             + ", ".join(unexplained))
