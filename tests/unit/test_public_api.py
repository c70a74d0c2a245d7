"""The public API: ``pskv.__all__`` is sorted and complete, every name the contract
(docs/api.md) lists exists, ``help(pskv.kv.create)`` lists every store type, the version is
the installed one, and the API reference (docs/reference) covers every public module."""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pydoc
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import pskv
from pskv.kvstore._registry import DIST_TYPES, LOCAL_TYPES

REPO = Path(__file__).resolve().parents[2]
API_DOC = REPO / "docs" / "api.md"
REFERENCE = REPO / "docs" / "reference"
# names api.md promises, spelled as a user reaches them
API_NAMES = [
    "create", "kv.create", "kvstore.create", "KVStore", "KVStoreBase", "KVStoreBase.register",
    "cpu", "gpu", "Context", "current_context",
    "nd.NDArray", "nd.array", "nd.ones", "nd.zeros", "nd.empty", "nd.full", "nd.waitall",
    "nd.sparse.RowSparseNDArray", "nd.sparse.row_sparse_array", "nd.sparse.zeros",
    "np.ones", "np.zeros", "np.array", "np.full", "np.empty",
    "optimizer.Optimizer", "optimizer.create", "optimizer.register", "optimizer.get_updater",
    "optimizer.SGD", "optimizer.NAG", "optimizer.Adam", "optimizer.AdaGrad",
    "optimizer.RMSProp", "optimizer.AdaDelta", "optimizer.Signum", "optimizer.SignSGD",
    "optimizer.FTRL", "optimizer.Test",
    "lr_scheduler.FactorScheduler", "lr_scheduler.MultiFactorScheduler",
    "lr_scheduler.PolyScheduler", "lr_scheduler.CosineScheduler",
    "KVStoreError", "KeyNotInitializedError", "KeyTypeError", "ShapeMismatchError",
    "UnsupportedError", "ConfigError", "ClusterError", "ClusterTimeoutError",
]
STORE_METHODS = [
    "init", "push", "pull", "pushpull", "broadcast", "row_sparse_pull", "set_updater",
    "_set_updater", "set_optimizer", "save_optimizer_states", "load_optimizer_states",
    "set_gradient_compression", "type", "rank", "num_workers", "barrier", "_barrier",
    "is_capable", "close", "__enter__", "__exit__",
]
NDARRAY_METHODS = [
    "asnumpy", "asscalar", "astype", "copy", "copyto", "as_in_context", "context", "ctx",
    "shape", "dtype", "size", "stype", "tostype", "reshape", "wait_to_read", "__iadd__",
    "__getitem__", "__setitem__", "__deepcopy__",
]


def _resolve(dotted: str) -> object:
    """``pskv.<dotted>``, importing submodules ``import pskv`` does not (pskv.launch)."""
    obj: object = pskv
    path = "pskv"
    for part in dotted.split("."):
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj


def test_all_is_sorted_and_complete() -> None:
    assert pskv.__all__ == sorted(pskv.__all__)
    # submodules appear as attributes once imported; the API lists the ones users reach
    public = {n for n, v in vars(pskv).items()
              if not n.startswith("_") and not inspect.ismodule(v) and n != "annotations"}
    missing = public - set(pskv.__all__)
    assert not missing, f"public names not in __all__: {sorted(missing)}"
    for name in pskv.__all__:
        assert hasattr(pskv, name), name


@pytest.mark.parametrize("dotted", API_NAMES)
def test_contract_names_exist(dotted: str) -> None:
    assert _resolve(dotted) is not None


@pytest.mark.parametrize("name", STORE_METHODS)
def test_store_methods(name: str) -> None:
    assert hasattr(pskv.kv.create("local"), name)


@pytest.mark.parametrize("name", NDARRAY_METHODS)
def test_ndarray_methods(name: str) -> None:
    assert hasattr(pskv.nd.ones((1,)), name)


def _contract_names() -> set[str]:
    """Every `pskv.X.Y` name docs/api.md promises (its "Not yet provided" part excluded)."""
    text = API_DOC.read_text().split("## Not yet provided")[0]
    return {n.rstrip(".") for n in re.findall(r"`pskv\.([A-Za-z_][\w.]*)", text)}


def test_contract_document_names_exist() -> None:
    """Every `pskv.X.Y` name written in docs/api.md resolves."""
    names = _contract_names()
    assert len(names) > 40, f"too few pskv names found in {API_DOC}: {sorted(names)}"
    for dotted in sorted(names):
        assert _resolve(dotted) is not None, dotted


def test_contract_document_covers_the_names_tested_here() -> None:
    """The names this file checks are the ones docs/api.md promises, not a private list."""
    names = _contract_names()
    missing = [n for n in API_NAMES if n not in names]
    assert not missing, f"docs/api.md does not mention: {missing}"


def test_contract_document_lists_every_top_level_name() -> None:
    names = _contract_names()
    missing = [n for n in pskv.__all__ if n not in names
               and not inspect.ismodule(getattr(pskv, n))]
    assert not missing, f"pskv.__all__ names docs/api.md does not mention: {missing}"


# ---- help(pskv.kv.create) lists every store type --------------------------------------------
def _create_doc_sections() -> dict[str, list[str]]:
    """The store types each part of create's docstring lists: ``* ``'name'``: ...`` lines."""
    doc = inspect.getdoc(pskv.kv.create) or ""
    local_part, _, dist_part = doc.partition("On a parameter server")
    pattern = r"^\s*\* ``'([a-z_]+)'``:"
    return {"local": re.findall(pattern, local_part, flags=re.M),
            "dist": re.findall(pattern, dist_part, flags=re.M)}


def test_create_docstring_lists_every_store_type_once() -> None:
    listed = _create_doc_sections()
    assert sorted(listed["local"]) == sorted(LOCAL_TYPES), listed["local"]
    assert sorted(listed["dist"]) == sorted(DIST_TYPES), listed["dist"]


def test_help_of_create_shows_the_store_types() -> None:
    text = pydoc.render_doc(pskv.kv.create, renderer=pydoc.plaintext)
    for name in LOCAL_TYPES + DIST_TYPES:
        assert f"``'{name}'``:" in text, name
    assert "KVStoreBase.register" in text


@pytest.mark.parametrize("name", LOCAL_TYPES)
def test_local_types_in_create_docstring_make_local_stores(name: str) -> None:
    with pskv.kv.create(name) as kv:
        assert isinstance(kv, pskv.kv.LocalKVStore)
        assert kv.type == name


def test_unknown_type_error_lists_the_documented_types() -> None:
    with pytest.raises(pskv.ConfigError) as err:
        pskv.kv.create("no_such_store")
    for name in LOCAL_TYPES + DIST_TYPES:
        assert name in str(err.value), name


# ---- the version --------------------------------------------------------------------------
def test_version_is_the_installed_metadata() -> None:
    try:
        installed = importlib.metadata.version("pskv")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pskv is not installed, so there is no metadata to compare with: "
                    "run pip install -e . first")
    assert re.fullmatch(r"\d+\.\d+\.\d+([.+-]?\w+)*", pskv.__version__), pskv.__version__
    assert pskv.__version__ == installed


def test_version_is_defined_once() -> None:
    """pyproject.toml takes the version from pskv.__version__, it does not repeat it."""
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \[.*"version".*\]', text, flags=re.M), text
    assert re.search(r'^version = \{ ?attr = "pskv.__version__" ?\}', text, flags=re.M), text
    assert not re.search(r'^version = "', text, flags=re.M)


# ---- the API reference ----------------------------------------------------------------------
PUBLIC_MODULES = ["pskv", "pskv.kv", "pskv.nd", "pskv.nd.sparse", "pskv.np", "pskv.context",
                  "pskv.optimizer", "pskv.lr_scheduler", "pskv.compression", "pskv.errors", "pskv.table",
                  "pskv.launch", "pskv.server", "pskv.sinks", "pskv.torch", "pskv.testing", "pskv.top", "pskv.stream", "pskv.serving", "pskv.data",
                  "pskv.examples.train", "pskv.examples.train_torch",
                  "pskv.examples.sparse_logreg", "pskv.examples.train_ctr", "pskv.tour"]


def test_reference_documents_every_public_module() -> None:
    """Every public module has a page in docs/reference, and its page has every name."""
    text = "\n".join(p.read_text() for p in sorted(REFERENCE.glob("*.rst")))
    documented = set(re.findall(r"^\.\. (?:auto|py:)module:: ([\w.]+)", text, flags=re.M))
    # pskv.kv is documented under the name users write; its module is pskv.kvstore
    assert documented >= set(PUBLIC_MODULES) - {"pskv.kv"}, set(PUBLIC_MODULES) - documented
    assert "pskv.kv" in documented
    kv_page = (REFERENCE / "kvstore.rst").read_text()
    for name in pskv.kv.__all__:
        assert re.search(rf"^\.\. (auto\w+|py:data):: (pskv\.kv\.)?{name}$", kv_page,
                         flags=re.M), f"docs/reference/kvstore.rst does not document {name}"


#: the optional dependencies a pskv module may import at module level
OPTIONAL_DEPENDENCIES = frozenset({"torch"})


def _optional(load: Callable[[], Any]) -> Any:
    """``load()``, or None when it needs an optional dependency that is not installed
    (pskv.torch._embedding and pskv.torch's lazy names without torch); the checks below
    run in full wherever it is installed."""
    try:
        return load()
    except ModuleNotFoundError as err:
        if err.name in OPTIONAL_DEPENDENCIES:
            return None
        raise


def test_every_module_has_all_and_no_import_side_effects() -> None:
    src = Path(pskv.__file__).parent
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if name.endswith("__main__"):
            continue
        mod = _optional(lambda: importlib.import_module(name))
        if mod is None:
            continue
        assert hasattr(mod, "__all__"), f"{name} has no __all__"
        for public in mod.__all__:
            obj = _optional(lambda: getattr(mod, public))
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"{name}.{public} has no docstring"


def test_reference_builds_without_warnings(tmp_path: Path) -> None:
    """What CI does: Sphinx with -W over docs/reference (a child python)."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed: pip install -e '.[docs]'")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(REFERENCE), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "html" / "kvstore.html").exists()


# ---- the public surface, pinned -------------------------------------------------------------
#: modules with a public name that have no reference page of their own, and why each stays
#: public; every other module is private by name (a leading underscore)
NOT_API_PAGES = {
    "pskv.base": "MXNet's module name (from mxnet.base import MXNetError)",
    "pskv.ndarray": "MXNet's module name (import mxnet.ndarray as nd)",
    "pskv.test_utils": "MXNet's module name (mxnet.test_utils)",
    "pskv.examples": "the examples, each run as python -m pskv.examples.NAME",
    "pskv.examples.custom_store": "an example (python -m)",
    "pskv.examples.dist_sync_sgd": "an example (python -m)",
    "pskv.examples.quickstart_local": "an example (python -m)",
    "pskv.examples.train_ctr_torch": "an example (python -m): train_ctr in PyTorch",
    "pskv.kvstore.base": "the store classes' modules, as MXNet's mxnet.kvstore.base",
    "pskv.kvstore.dist": "the dist store's class, re-exported by pskv.kv",
    "pskv.kvstore.durable": "a wing of pskv.kvstore (docs/architecture.md): private modules",
    "pskv.kvstore.engine": "a wing of pskv.kvstore (docs/architecture.md): private modules",
    "pskv.kvstore.server": "a wing of pskv.kvstore (docs/architecture.md): private modules",
    "pskv.kvstore.local": "the local store's class, re-exported by pskv.kv",
    "pskv.nd.creation": "part of pskv.nd (MXNet's mxnet.ndarray has submodules too)",
    "pskv.nd.ndarray": "MXNet's mxnet.ndarray.ndarray",
    "pskv.nd.ops": "part of pskv.nd",
    "pskv.nd.random": "MXNet's mxnet.ndarray.random",
    "pskv.optimizer.adadelta": "one optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.adagrad": "one optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.adam": "one optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.base": "the Optimizer base and registry, re-exported by pskv.optimizer",
    "pskv.optimizer.ftrl": "one optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.rmsprop": "one optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.sgd": "one optimizer family, re-exported by pskv.optimizer",
    "pskv.optimizer.test": "MXNet's Test optimizer, re-exported by pskv.optimizer",
    "pskv.optimizer.updater": "the updater and its states format, as mxnet.optimizer",
    "pskv.table.dynamic": "DynamicTable, re-exported by pskv.table",
    "pskv.table.spec": "the table spec and policies, re-exported by pskv.table",
}
#: each public module's __all__, one "module name" per line: a change to the public surface
#: is a change to this file, made on purpose (the test prints the lines to put in it)
SURFACE_FILE = Path(__file__).with_name("public_surface.txt")


def _public_modules() -> list[str]:
    import pkgutil
    names = ["pskv"] + [m.name for m in pkgutil.walk_packages(pskv.__path__, "pskv.")
                        if not any(p.startswith("_") for p in m.name.split(".")[1:])]
    return sorted(names)


#: programs, not API: run as ``python -m``, their names are not pinned (issue #30)
UNPINNED = ("pskv.examples",)


def _surface() -> list[str]:
    return sorted(f"{name} {public}" for name in _public_modules()
                  if not name.startswith(UNPINNED)
                  for public in importlib.import_module(name).__all__)


def test_every_public_module_is_api_or_says_why_not() -> None:
    """A module is API (a reference page), or in NOT_API_PAGES with a reason, or private
    by name: nothing is public by accident."""
    api = {"pskv.kvstore" if m == "pskv.kv" else m for m in PUBLIC_MODULES}
    unexplained = sorted(set(_public_modules()) - api - set(NOT_API_PAGES))
    assert not unexplained, ("make these private (a leading underscore) or explain them in "
                             f"NOT_API_PAGES: {unexplained}")
    stale = sorted(set(NOT_API_PAGES) - set(_public_modules()))
    assert not stale, f"NOT_API_PAGES names modules that are gone: {stale}"


def test_what_a_package_reexports_has_one_home() -> None:
    """The public names of a package's implementation modules are the package's: each is
    the same object there (so users and docs name one place)."""
    for name, why in NOT_API_PAGES.items():
        if "re-exported by" not in why:
            continue
        home = why.rsplit("re-exported by ", 1)[1].split()[0]
        package = importlib.import_module("pskv.kvstore" if home == "pskv.kv" else home)
        mod = importlib.import_module(name)
        for public in mod.__all__:
            assert getattr(package, public, None) is getattr(mod, public), (
                f"{name}.{public} is not re-exported by {package.__name__}")


def test_the_public_surface_is_pinned() -> None:
    got = _surface()
    want = SURFACE_FILE.read_text().split("\n")
    want = [line for line in want if line and not line.startswith("#")]
    added, removed = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not added and not removed, (
        f"the public surface changed: added {added}, removed {removed}. If on purpose, "
        f"update {SURFACE_FILE.name} (and docs/api.md)")

