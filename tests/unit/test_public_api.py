"""The public API: ``pskv.__all__`` is sorted and complete, and every name the contract
(../shared/api.md) lists exists."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import pskv

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
    obj: object = pskv
    for part in dotted.split("."):
        obj = getattr(obj, part)
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


def test_contract_document_names_exist() -> None:
    """Every `pskv.X.Y` name written in ../shared/api.md resolves (when the file is there)."""
    doc = Path(__file__).resolve().parents[3] / "shared" / "api.md"
    if not doc.exists():
        pytest.skip("../shared/api.md is not beside the checkout (issue #2)")
    names = set(re.findall(r"`pskv\.([A-Za-z_][\w.]*)", doc.read_text()))
    assert names, "no pskv names found in api.md"
    for dotted in sorted(names):
        assert _resolve(dotted.rstrip(".")) is not None, dotted


def test_every_module_has_all_and_no_import_side_effects() -> None:
    src = Path(pskv.__file__).parent
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if name.endswith("__main__"):
            continue
        mod = importlib.import_module(name)
        assert hasattr(mod, "__all__"), f"{name} has no __all__"
        for public in mod.__all__:
            obj = getattr(mod, public)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"{name}.{public} has no docstring"
