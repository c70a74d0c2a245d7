"""Reusable KVStore semantics checks and NumPy oracles (like trio's ``check_*_stream``).

:func:`check_kvstore_semantics` runs a library of scenarios against any module that
offers MXNet 1.9.1's KVStore API (``mx.kv.create``, ``mx.nd``, ``mx.cpu``): pskv, real
MXNet, or a third implementation. Every scenario uses only the behaviour pskv and MXNet
share (outs are always given to ``pull``, values are NDArrays, keys are plain int or str),
and compares what the store returns with :class:`NumpyKVModel`, a dict of NumPy arrays.

:class:`InprocCluster` (loaded on first use) runs a whole dist cluster as threads of this
process, on ZeroMQ inproc endpoints: no ports, no processes.

This module imports only NumPy and the standard library at module level, never pskv, so
the MXNet differential tests load it *by path* in the MXNet interpreter (which has no
pskv installed)::

    spec = importlib.util.spec_from_file_location("pskv_testing", path_to_this_file)
    testing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(testing)
    testing.check_kvstore_semantics(mxnet)

Examples
--------
>>> import pskv as mx
>>> from pskv.testing import check_kvstore_semantics
>>> names = check_kvstore_semantics(mx, 'local')
>>> 'aggregate_devices' in names
True
"""
from __future__ import annotations

# Over 500 lines because it is the public test kit: the in-process cluster, the local
# launcher harness and the MXNet-compatibility checks users run, each documented where
# it is (a comment: the docstring is the reference page's).

import json
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

if TYPE_CHECKING:
    from ._cluster import InprocCluster

__all__ = [
    "CHECKS",
    "InprocCluster",
    "NumpyKVModel",
    "UPDATERS",
    "check_kvstore_semantics",
    "launch_reports",
    "numpy_updater",
]

SHAPE = (2, 3)


# ---- NumPy oracles ---------------------------------------------------------------------
def numpy_updater(name: str) -> Callable[[Any, np.ndarray, np.ndarray], None]:
    """The NumPy twin of the store updater ``UPDATERS[name]``.

    Parameters
    ----------
    name : str
        ``'assign'`` (stored := input), ``'add2'`` (stored += input * 2) or
        ``'sub_half'`` (stored -= input / 2).

    Returns
    -------
    callable
        ``fn(key, input, stored)`` mutating the NumPy array ``stored`` in place.
    """
    def assign(key: Any, inp: np.ndarray, stored: np.ndarray) -> None:
        stored[...] = inp

    def add2(key: Any, inp: np.ndarray, stored: np.ndarray) -> None:
        stored += inp * 2

    def sub_half(key: Any, inp: np.ndarray, stored: np.ndarray) -> None:
        stored -= inp / 2

    table = {"assign": assign, "add2": add2, "sub_half": sub_half}
    return table[name]


def _kv_assign(key: Any, inp: Any, stored: Any) -> None:
    stored[:] = inp


def _kv_add2(key: Any, inp: Any, stored: Any) -> None:
    stored += inp * 2


def _kv_sub_half(key: Any, inp: Any, stored: Any) -> None:
    stored -= inp / 2


#: store updaters ``fn(key, input, stored)`` written with NDArray operators only, so they run
#: on pskv and on MXNet; :func:`numpy_updater` gives each one's NumPy twin
UPDATERS: dict[str, Callable[[Any, Any, Any], None]] = {
    "assign": _kv_assign, "add2": _kv_add2, "sub_half": _kv_sub_half}


class NumpyKVModel:
    """A dict-of-NumPy model of a local KVStore: the oracle the checks compare with.

    Push sums the values given for a key (duplicates in a key list included), then applies
    the updater (default: assign); pull returns a copy of the stored value.

    Parameters
    ----------
    updater : callable, optional
        ``fn(key, input, stored)`` on NumPy arrays; see :func:`numpy_updater`.

    Examples
    --------
    >>> import numpy as np
    >>> m = NumpyKVModel()
    >>> m.init(3, np.zeros(2, np.float32))
    >>> m.push([3, 3], [np.ones(2), [np.ones(2), np.ones(2)]])
    >>> m.pull(3)
    array([3., 3.], dtype=float32)
    """

    def __init__(self, updater: Callable[[Any, np.ndarray, np.ndarray], None] | None = None
                 ) -> None:
        self.store: dict[Any, np.ndarray] = {}
        self.updater = updater

    def init(self, key: Any, value: Any) -> None:
        """Store a copy of ``value`` (or of each value, for a key list)."""
        for k, vals in self._pairs(key, value):
            self.store[k] = np.array(vals[0], copy=True)

    def push(self, key: Any, value: Any) -> None:
        """Sum the values per key (left to right, in the key's dtype) and update."""
        merged: dict[Any, np.ndarray] = {}
        for k, vals in self._pairs(key, value):
            for v in vals:
                v = np.asarray(v)
                if k in merged:
                    merged[k] = (merged[k] + v).astype(self.store[k].dtype)
                else:
                    merged[k] = v.astype(self.store[k].dtype)
        for k, m in merged.items():
            if self.updater is None:
                self.store[k][...] = m
            else:
                self.updater(k, m, self.store[k])

    def pull(self, key: Any) -> Any:
        """A copy of the stored value (a list for a key list)."""
        if isinstance(key, (list, tuple)):
            return [self.store[k].copy() for k in key]
        return self.store[key].copy()

    def pushpull(self, key: Any, value: Any) -> Any:
        """Push, then pull."""
        self.push(key, value)
        return self.pull(key)

    def snapshot(self) -> dict[Any, np.ndarray]:
        """A deep copy of every stored value."""
        return {k: v.copy() for k, v in self.store.items()}

    @staticmethod
    def _pairs(key: Any, value: Any) -> list[tuple[Any, list[Any]]]:
        if isinstance(key, (list, tuple)):
            return [(k, list(v) if isinstance(v, (list, tuple)) else [v])
                    for k, v in zip(key, value)]
        return [(key, list(value) if isinstance(value, (list, tuple)) else [value])]


# ---- helpers ---------------------------------------------------------------------------
def _np(a: Any) -> np.ndarray:
    return a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a)


def _eq(got: Any, want: Any, what: str) -> None:
    np.testing.assert_allclose(_np(got), np.asarray(want), rtol=1e-6, atol=1e-6,
                               err_msg=what)


def _pulled(mx: Any, kv: Any, key: Any, shape: tuple[int, ...] = SHAPE,
            dtype: str = "float32") -> np.ndarray:
    out = mx.nd.zeros(shape, dtype=dtype)
    kv.pull(key, out=out)
    return _np(out)


def _raises(fn: Callable[[], Any], what: str) -> BaseException:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - MXNet raises MXNetError, pskv KVStoreError
        return err
    raise AssertionError(f"{what}: expected an error, none was raised")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---- the checks ------------------------------------------------------------------------
def check_single_key(mx: Any, store_type: str) -> None:
    """init, pull, push, pull of one int key (the KVStore tutorial)."""
    kv = mx.kv.create(store_type)
    kv.init(3, mx.nd.ones(SHAPE) * 2)
    _eq(_pulled(mx, kv, 3), np.full(SHAPE, 2), "after init")
    kv.push(3, mx.nd.ones(SHAPE) * 8)
    _eq(_pulled(mx, kv, 3), np.full(SHAPE, 8), "after push")


def check_aggregate_devices(mx: Any, store_type: str) -> None:
    """A list of values for one key (one per device) is summed; pulls fill every out."""
    kv = mx.kv.create(store_type)
    rng = _rng(1)
    model = NumpyKVModel()
    init = rng.standard_normal(SHAPE).astype(np.float32)
    kv.init(3, mx.nd.array(init))
    model.init(3, init)
    vals = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(4)]
    kv.push(3, [mx.nd.array(v, mx.cpu(i)) for i, v in enumerate(vals)])
    model.push(3, vals)
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(4)]
    kv.pull(3, out=outs)
    for i, o in enumerate(outs):
        _eq(o, model.pull(3), f"out {i}")
        assert o.context == mx.cpu(i), f"out {i} moved to {o.context}"


def check_key_list(mx: Any, store_type: str) -> None:
    """Lists of keys take a list of arrays or a list of lists of arrays."""
    kv = mx.kv.create(store_type)
    keys = [5, 7, 9]
    model = NumpyKVModel()
    kv.init(keys, [mx.nd.ones(SHAPE)] * 3)
    model.init(keys, [np.ones(SHAPE, np.float32)] * 3)
    kv.push(keys, [mx.nd.ones(SHAPE) * (i + 1) for i in range(3)])
    model.push(keys, [np.ones(SHAPE) * (i + 1) for i in range(3)])
    outs = [mx.nd.zeros(SHAPE) for _ in keys]
    kv.pull(keys, out=outs)
    for k, o in zip(keys, outs):
        _eq(o, model.pull(k), f"key {k}")
    vals = [[mx.nd.ones(SHAPE, mx.cpu(d)) * (i + d) for d in range(2)]
            for i in range(3)]
    kv.push(keys, vals)
    model.push(keys, [[np.ones(SHAPE) * (i + d) for d in range(2)] for i in range(3)])
    outs2 = [[mx.nd.zeros(SHAPE, mx.cpu(d)) for d in range(2)] for _ in keys]
    kv.pull(keys, out=outs2)
    for k, group in zip(keys, outs2):
        for o in group:
            _eq(o, model.pull(k), f"key {k}, list of lists")


def check_str_keys(mx: Any, store_type: str) -> None:
    """str keys work like int keys, singly and in lists."""
    kv = mx.kv.create(store_type)
    keys = ["b", "a", "weight_0"]
    kv.init(keys, [mx.nd.ones(SHAPE) * i for i in range(3)])
    kv.push("a", [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2])
    outs = [mx.nd.zeros(SHAPE) for _ in keys]
    kv.pull(keys, out=outs)
    for o, want in zip(outs, [0.0, 3.0, 2.0]):
        _eq(o, np.full(SHAPE, want), "str keys")


def check_updater(mx: Any, store_type: str) -> None:
    """A custom updater sees the summed push and mutates the stored value in place."""
    for name in ("add2", "sub_half", "assign"):
        kv = mx.kv.create(store_type)
        model = NumpyKVModel(numpy_updater(name))
        rng = _rng(2)
        init = rng.standard_normal(SHAPE).astype(np.float32)
        kv.init([4, 6], [mx.nd.array(init), mx.nd.array(init * 3)])
        model.init([4, 6], [init, init * 3])
        kv._set_updater(UPDATERS[name])
        for step in range(3):
            vals = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)]
            kv.push(4, [mx.nd.array(v) for v in vals])
            model.push(4, vals)
            kv.push([6, 4], [mx.nd.array(vals[0]), mx.nd.array(vals[1])])
            model.push([6, 4], vals)
            _eq(_pulled(mx, kv, 4), model.pull(4), f"{name} step {step} key 4")
            _eq(_pulled(mx, kv, 6), model.pull(6), f"{name} step {step} key 6")


def check_updater_calls(mx: Any, store_type: str) -> None:
    """The updater is called once per distinct key of a push, and never on pull."""
    kv = mx.kv.create(store_type)
    seen: list[int] = []

    def count(key: Any, inp: Any, stored: Any) -> None:
        seen.append(int(key))
        stored += inp

    kv.init([1, 2], [mx.nd.zeros(SHAPE)] * 2)
    kv._set_updater(count)
    kv.push([1, 2, 1], [mx.nd.ones(SHAPE)] * 3)
    _pulled(mx, kv, 1)
    assert sorted(seen) == [1, 2], f"updater calls {seen}"
    _eq(_pulled(mx, kv, 1), np.full(SHAPE, 2), "duplicate key summed")


def check_duplicate_keys(mx: Any, store_type: str) -> None:
    """Duplicate keys in one list are summed on push and each filled on pull."""
    kv = mx.kv.create(store_type)
    kv.init([1, 2], [mx.nd.zeros(SHAPE)] * 2)
    kv.push([1, 2, 1], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2, mx.nd.ones(SHAPE) * 5])
    outs = [mx.nd.zeros(SHAPE) for _ in range(3)]
    kv.pull([1, 2, 1], out=outs)
    for o, want in zip(outs, [6.0, 2.0, 6.0]):
        _eq(o, np.full(SHAPE, want), "duplicate keys")


def check_pushpull(mx: Any, store_type: str) -> None:
    """pushpull with out fills out; without out, it writes the result into the values."""
    kv = mx.kv.create(store_type)
    kv.init(2, mx.nd.zeros(SHAPE))
    outs = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE, mx.cpu(1))]
    kv.pushpull(2, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 3], out=outs)
    for o in outs:
        _eq(o, np.full(SHAPE, 4), "pushpull out")
    # a fresh key: after an ASSIGN push of several values MXNet's stored value aliases
    # its merge buffer (kvstore_local.h PushImpl `local = merged`), so a later updater
    # would see the new sum as the stored value; pskv keeps its own copy
    kv2 = mx.kv.create(store_type)
    kv2.init(2, mx.nd.ones(SHAPE) * 4)
    kv2._set_updater(UPDATERS["add2"])
    vals = [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)]
    kv2.pushpull(2, vals)
    for v in vals:
        _eq(v, np.full(SHAPE, 8), "pushpull into value")
    kv2.init([7, 8], [mx.nd.ones(SHAPE)] * 2)
    o7, o8 = mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE)
    kv2.pushpull([7, 8], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2], out=[o7, o8])
    _eq(o7, np.full(SHAPE, 3), "pushpull key list 7")
    _eq(o8, np.full(SHAPE, 5), "pushpull key list 8")


def check_broadcast(mx: Any, store_type: str) -> None:
    """broadcast initializes the key and pulls it into every out."""
    kv = mx.kv.create(store_type)
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(3)]
    kv.broadcast("w", mx.nd.ones(SHAPE) * 7, out=outs)
    for o in outs:
        _eq(o, np.full(SHAPE, 7), "broadcast out")
    _eq(_pulled(mx, kv, "w"), np.full(SHAPE, 7), "broadcast stored")
    kv.push("w", mx.nd.ones(SHAPE))
    _eq(_pulled(mx, kv, "w"), np.full(SHAPE, 1), "push after broadcast")


def check_dtype_cast(mx: Any, store_type: str) -> None:
    """A float64 value pushed into a float32 key is cast; float64 keys keep float64."""
    kv = mx.kv.create(store_type)
    kv.init(0, mx.nd.zeros(SHAPE))
    kv.push(0, mx.nd.array(np.full(SHAPE, 1.5), dtype="float64"))
    _eq(_pulled(mx, kv, 0), np.full(SHAPE, 1.5), "float64 into float32")
    kv.init(1, mx.nd.zeros(SHAPE, dtype="float64"))
    kv.push(1, mx.nd.array(np.full(SHAPE, 1 / 3), dtype="float64"))
    got = _pulled(mx, kv, 1, dtype="float64")
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.full(SHAPE, 1 / 3))


def check_row_sparse(mx: Any, store_type: str) -> None:
    """row_sparse_pull returns exactly the requested rows (unsorted, repeated, 2-D, float)."""
    shape = (6, 2)
    table = np.arange(12, dtype=np.float32).reshape(shape)
    kv = mx.kv.create(store_type)
    kv.init("e", mx.nd.array(table).tostype("row_sparse"))
    cases = {"unsorted_repeated": ([4, 1, 4], "int64"), "float": ([5, 0], "float32"),
             "2d": ([[4, 1], [0, 4]], "int64")}
    for name, (rows, dtype) in cases.items():
        out = mx.nd.sparse.zeros("row_sparse", shape)
        kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array(rows, dtype=dtype))
        want = np.unique(np.asarray(rows).ravel())
        np.testing.assert_array_equal(_np(out.indices), want, err_msg=name)
        _eq(out.data, table[want], name)
    outs = [mx.nd.sparse.zeros("row_sparse", shape, mx.cpu(i)) for i in range(2)]
    kv.row_sparse_pull("e", out=outs, row_ids=mx.nd.array([5, 2], dtype="int64"))
    for o in outs:
        np.testing.assert_array_equal(_np(o.indices), [2, 5])
        _eq(o.data, table[[2, 5]], "one row_ids, two outs")
    outs = [mx.nd.sparse.zeros("row_sparse", shape, mx.cpu(i)) for i in range(2)]
    kv.row_sparse_pull("e", out=outs, row_ids=[mx.nd.array([5, 2], dtype="int64"),
                                               mx.nd.array([0], dtype="int64")])
    np.testing.assert_array_equal(_np(outs[1].indices), [0])
    _eq(outs[1].data, table[[0]], "second row_ids")
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([], dtype="int64"))
    assert _np(out.indices).size == 0, "empty row_ids"


def check_row_sparse_push(mx: Any, store_type: str) -> None:
    """Pushing row_sparse values: ASSIGN replaces the table; an updater adds rows."""
    shape = (6, 2)
    table = np.arange(12, dtype=np.float32).reshape(shape)
    grad = mx.nd.sparse.row_sparse_array((np.ones((2, 2), np.float32), [1, 3]), shape=shape)
    want_grad = np.zeros(shape, np.float32)
    want_grad[[1, 3]] = 2
    every = mx.nd.array(np.arange(6), dtype="int64")
    for updater in (None, "add2"):
        kv = mx.kv.create(store_type)
        kv.init("e", mx.nd.array(table).tostype("row_sparse"))
        if updater is not None:
            kv._set_updater(UPDATERS[updater])
        kv.push("e", [grad, grad])
        out = mx.nd.sparse.zeros("row_sparse", shape)
        kv.row_sparse_pull("e", out=out, row_ids=every)
        want = want_grad if updater is None else table + want_grad * 2
        _eq(out.tostype("default"), want, f"row_sparse push, updater {updater}")


def check_errors(mx: Any, store_type: str) -> None:
    """Misuse both libraries reject: pull/push of an unknown key, a second init."""
    kv = mx.kv.create(store_type)
    kv.init(3, mx.nd.ones(SHAPE))
    _raises(lambda: kv.pull(9, out=mx.nd.zeros(SHAPE)), "pull of a never-initialized key")
    _raises(lambda: kv.push(9, mx.nd.zeros(SHAPE)), "push to a never-initialized key")
    _raises(lambda: kv.init(3, mx.nd.ones(SHAPE)), "second init")
    _raises(lambda: kv.pull(3, out=mx.nd.zeros((3, 3))), "pull into the wrong shape")
    _raises(lambda: kv.init("a", mx.nd.ones(SHAPE)), "str key in an int store")
    _raises(lambda: kv.is_capable("no-such-capability"), "unknown capability")
    _eq(_pulled(mx, kv, 3), np.ones(SHAPE), "the store still works")


def check_properties(mx: Any, store_type: str) -> None:
    """type, rank, num_workers and the optimizer capability of a single-process store."""
    kv = mx.kv.create(store_type)
    assert kv.type == store_type.lower(), kv.type
    assert kv.rank == 0 and kv.num_workers == 1
    assert kv.is_capable("optimizer") is True


def check_optimizer(mx: Any, store_type: str) -> None:
    """set_optimizer(SGD) updates on push: w -= lr * (rescale * g + wd * w)."""
    kv = mx.kv.create(store_type)
    init = np.linspace(-1, 1, 6, dtype=np.float32).reshape(SHAPE)
    kv.init(0, mx.nd.array(init))
    kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1, wd=0.01))
    w: np.ndarray = init.copy()
    for step in range(3):
        g = np.full(SHAPE, 0.5 * (step + 1), np.float32)
        kv.push(0, [mx.nd.array(g), mx.nd.array(g)])
        w = w - np.float32(0.1) * (2 * g + np.float32(0.01) * w)
    np.testing.assert_allclose(_pulled(mx, kv, 0), w, rtol=1e-5, atol=1e-6)


#: every check, by name, in the order :func:`check_kvstore_semantics` runs them
CHECKS: dict[str, Callable[[Any, str], None]] = {
    "single_key": check_single_key,
    "aggregate_devices": check_aggregate_devices,
    "key_list": check_key_list,
    "str_keys": check_str_keys,
    "updater": check_updater,
    "updater_calls": check_updater_calls,
    "duplicate_keys": check_duplicate_keys,
    "pushpull": check_pushpull,
    "broadcast": check_broadcast,
    "dtype_cast": check_dtype_cast,
    "row_sparse": check_row_sparse,
    "row_sparse_push": check_row_sparse_push,
    "errors": check_errors,
    "properties": check_properties,
    "optimizer": check_optimizer,
}


def check_kvstore_semantics(mx: Any, store_type: str = "local",
                            checks: Iterable[str] | None = None) -> list[str]:
    """Run the KVStore semantics checks against the module ``mx``.

    Parameters
    ----------
    mx : module
        ``pskv`` or ``mxnet`` (anything with ``kv.create``, ``nd``, ``cpu`` and, for the
        ``'optimizer'`` check, ``optimizer.create``).
    store_type : str, default 'local'
        The store type each check creates (``'local'`` or ``'device'``).
    checks : iterable of str, optional
        Names from :data:`CHECKS` to run; default all.

    Returns
    -------
    list of str
        The names of the checks that ran (and passed).

    Raises
    ------
    AssertionError
        From the first check that fails, naming it.

    Examples
    --------
    >>> import pskv as mx
    >>> check_kvstore_semantics(mx, 'device', checks=['single_key', 'broadcast'])
    ['single_key', 'broadcast']
    """
    names = list(CHECKS) if checks is None else list(checks)
    for name in names:
        if name not in CHECKS:
            raise KeyError(f"unknown check {name!r}. Known: {', '.join(CHECKS)}.")
    for name in names:
        try:
            CHECKS[name](mx, store_type)
        except AssertionError as err:
            raise AssertionError(f"check {name!r} failed on {getattr(mx, '__name__', mx)} "
                                 f"{store_type!r}: {err}") from err
    return names


def launch_reports(output: str) -> list[tuple[str, dict[str, Any]]]:
    """The JSON objects a launched job printed, with the label of the process that printed
    each: a line ``[worker 1] {"rank": 1, ...}`` of pskv-launch's output gives
    ``("worker 1", {"rank": 1, ...})``; other lines are skipped.

    Examples
    --------
    >>> launch_reports('[worker 0] {"ok": true}\\n[server 0] ready\\n')
    [('worker 0', {'ok': True})]
    """
    out = []
    for line in output.splitlines():
        label, sep, rest = line.partition("] ")
        if sep and label.startswith("[") and rest.startswith("{"):
            out.append((label[1:], json.loads(rest)))
    return out


def __getattr__(name: str) -> Any:
    # the cluster helper imports pskv (and pyzmq): only when asked for, so that this module
    # still loads by path in an interpreter without pskv (the MXNet differential tests)
    if name == "InprocCluster":
        from ._cluster import InprocCluster
        return InprocCluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
