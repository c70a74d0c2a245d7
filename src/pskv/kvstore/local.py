"""LocalKVStore: the ``local`` and ``device`` stores (and MXNet's legacy aliases).

Invariants: ``_store[key]`` is an NDArray the store owns (a RowSparseNDArray holding every
row for row_sparse keys); every call validates all of its arguments before it changes any
key, so a call that raises changes nothing; ``_lock`` serializes calls.
"""
from __future__ import annotations

import builtins
import os
import threading
import warnings
from types import TracebackType
from typing import Any, Callable

import numpy as np

from ..errors import (ConfigError, KeyNotInitializedError, KeyTypeError, ShapeMismatchError,
                      UnsupportedError, ValueTypeError)
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ._args import as_numpy, dense_data, normalize, row_ids_by_key, tensor_maker
from ._reduce import PARALLEL_MIN, Reducer, sum_row_sparse
from .base import KVStoreBase

__all__ = ["LocalKVStore", "SparsePullIgnoredWarning"]


class SparsePullIgnoredWarning(UserWarning):
    """A plain ``pull`` skipped a row_sparse ``out``, as MXNet does; use row_sparse_pull."""


def _same_kind(src: np.dtype[Any], dst: np.dtype[Any]) -> bool:
    return src == dst or bool(np.can_cast(src, dst, casting="same_kind"))


class LocalKVStore(KVStoreBase):
    """A single-process key-value store: ``local``, ``device`` and MXNet's aliases.

    Push sums the values given for a key (one per device), then applies the updater
    (default: assign) to the stored value; pull copies the stored value into every out.
    Create it with :func:`pskv.kv.create`.

    Examples
    --------
    >>> import pskv as mx
    >>> kv = mx.kv.create('local')
    >>> kv.init(3, mx.nd.ones((2, 3)) * 2)
    >>> kv.push(3, [mx.nd.ones((2, 3), mx.gpu(i)) for i in range(4)])
    >>> kv.pull(3).asnumpy()
    array([[4., 4., 4.],
           [4., 4., 4.]], dtype=float32)
    """

    def __init__(self, name: str = "local") -> None:
        self._type = name
        self._store: dict[int | str, NDArray] = {}
        self._ikey: dict[int | str, int] = {}     # init order: MXNet's int id for str keys
        self._proto: dict[int | str, Any] = {}    # what pull(out=None) returns a copy of
        self._kind: type | None = None
        self._updater: Callable[[Any, Any, Any], None] | None = None
        self._gc: Any = None
        self._residual: dict[tuple[int | str, int], np.ndarray] = {}
        self._merge: dict[int | str, np.ndarray] = {}
        self._warned: set[int | str] = set()
        self._reducer = Reducer(int(os.environ.get("PSKV_REDUCE_THREADS", "0")) or None)
        self._lock = threading.RLock()
        self._closed = False

    # ---- properties ----------------------------------------------------------------
    @property
    def type(self) -> str:
        """The store type, as given to ``create`` and lower-cased."""
        return self._type

    # ---- validation ----------------------------------------------------------------
    def _begin(self, pulling: bool = False) -> None:
        """Checks at the start of every call (a dist store adds the cluster's)."""
        self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise UnsupportedError(f"this {self._type!r} store was closed. Create a new one "
                                   "with pskv.kv.create().", store_type=self._type)

    def _check_kind(self, keys: list[int | str]) -> None:
        kind = self._kind or type(keys[0])
        for k in keys:
            if type(k) is not kind:
                raise KeyTypeError(
                    f"key {k!r} is a {type(k).__name__} but this store uses {kind.__name__} "
                    "keys. Use one kind of key per store.", key=k, store_type=self._type)

    def _stored(self, key: int | str, action: str) -> NDArray:
        stored = self._store.get(key)
        if stored is None:
            raise KeyNotInitializedError(
                f"cannot {action} key {key!r} in this {self._type!r} store: it was never "
                f"initialized. Call kv.init({key!r}, value) first.", key=key,
                store_type=self._type)
        return stored

    def _check_array(self, key: int | str, arr: Any, stored: Any, action: str,
                     into: bool = False) -> None:
        """``arr`` fits ``stored`` (anything with shape and dtype): same shape, and a
        same_kind cast into it (``into``: out of it)."""
        data = getattr(arr, "_data", None)
        if type(data) is np.ndarray and type(arr) is not RowSparseNDArray and \
                data.shape == stored.shape and data.dtype == stored.dtype:
            return                        # the common case, decided without NumPy calls
        shape = tuple(arr.shape)
        if shape != stored.shape:
            raise ShapeMismatchError(
                f"{action} key {key!r} got shape {shape}, but key {key!r} was initialized "
                f"with shape {stored.shape}. {action.capitalize()} {stored.shape} arrays, or "
                "init a new key.", key=key, shape=shape, store_type=self._type)
        dtype = arr.dtype if isinstance(arr, (NDArray, np.ndarray)) else as_numpy(arr).dtype
        src, dst = (stored.dtype, np.dtype(dtype)) if into else (np.dtype(dtype), stored.dtype)
        if not _same_kind(src, dst):
            from ..torch import _dtype_hint     # the fix differs for torch tensors
            raise ShapeMismatchError(
                f"{action} key {key!r} got dtype {dtype}, but key {key!r} holds {stored.dtype} "
                f"and {src} cannot be cast to {dst} safely (NumPy 'same_kind'). "
                f"{_dtype_hint(arr, stored.dtype, into)}", key=key, shape=shape,
                store_type=self._type)

    # ---- init ------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Initialize a single key-value pair or a sequence of them.

        Parameters
        ----------
        key : str, int, or sequence of str or int
            The keys; one kind per store.
        value : NDArray, numpy.ndarray, or list of them
            One value per key; the store keeps a copy.

        Raises
        ------
        KeyNotInitializedError
            If a key was initialized before (MXNet replaces or aborts).
        KeyTypeError, ValueTypeError, ShapeMismatchError
            For keys or values of the wrong kind.

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init(['5', '7'], [mx.nd.ones((2, 3))] * 2)
        >>> float(kv.pull('7').asnumpy().sum())
        6.0
        """
        with self._lock:
            self._check_open()
            keys, groups = normalize(key, value)
            self._validate_init(keys, groups)
            for k, vals in zip(keys, groups):
                self._init_one(k, vals[0])

    def _validate_init(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        self._check_kind(keys)
        for k, vals in zip(keys, groups):
            if k in self._store or len(vals) != 1:
                raise KeyNotInitializedError(
                    f"key {k!r} is initialized twice. Each key takes one init (or broadcast); "
                    "push to change its value.", key=k, store_type=self._type)

    def _init_one(self, key: int | str, value: Any) -> None:
        if self._kind is None:
            self._kind = type(key)
        if isinstance(value, RowSparseNDArray):
            table = np.array(value._dense(), copy=True)
            stored: NDArray = RowSparseNDArray._all_rows(table, value.context)
            self._proto[key] = value
        else:
            data = np.array(as_numpy(value), copy=True)
            ctx = value.context if isinstance(value, NDArray) else None
            stored = NDArray(data, ctx)
            self._proto[key] = type(value) if isinstance(value, NDArray) else \
                tensor_maker(value) or np.ndarray
        self._store[key] = stored
        self._ikey[key] = len(self._ikey)

    # ---- push ------------------------------------------------------------------------
    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push a single value or a sequence of values into the store.

        Values given for the same key (a list of arrays, one per device, or a key repeated
        in a key list) are summed; then the updater combines the sum with the stored value
        (the default updater assigns it).

        Parameters
        ----------
        key : str, int, or sequence of str or int
        value : NDArray, numpy.ndarray, list of them, or list of lists of them
        priority : int, default 0
            Accepted for compatibility; a local store runs every call at once.

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init(3, mx.nd.zeros((2, 3)))
        >>> kv.push(3, [mx.nd.ones((2, 3), mx.cpu(i)) for i in range(3)])
        >>> kv.pull(3).asnumpy()[0]
        array([3., 3., 3.], dtype=float32)
        """
        with self._lock:
            if self._fast_push(key, value):
                return
            self._begin()
            keys, groups = normalize(key, value)
            self._validate_push(keys, groups)
            self._push_validated(keys, groups)

    def _fast_push(self, key: Any, value: Any) -> bool:
        """One key, one dense array of the stored shape and dtype, assign: copy it in.

        Everything the general path checks holds here by construction; anything else
        returns False and takes the general path.
        """
        if self._updater is not None or self._gc is not None or self._closed or \
                (type(key) is not int and type(key) is not str):
            return False
        stored = self._store.get(key)
        if type(stored) is not NDArray:
            return False
        data = dense_data(value)
        if data is None or data.shape != stored._data.shape or data.dtype != stored._data.dtype:
            return False
        self._reducer.copy_into(stored._data, data)
        return True

    def _validate_push(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        self._check_kind(keys)
        for k, vals in zip(keys, groups):
            stored = self._stored(k, "push to")
            for v in vals:
                self._check_array(k, v, stored, "push to")
                if self._gc is not None and isinstance(v, RowSparseNDArray):
                    raise UnsupportedError(
                        f"push to key {k!r}: gradient compression works on dense arrays only, "
                        "got a row_sparse array. Push it dense, or create a store without "
                        "compression.", key=k, store_type=self._type)

    def _push_validated(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        if self._updater is None:        # assign: the order of keys does not matter
            small = PARALLEL_MIN
            for k, vals in zip(keys, groups):
                stored = self._store[k]
                if len(vals) == 1 and self._gc is None and type(stored) is NDArray:
                    data = dense_data(vals[0])
                    if data is not None and data.size < small:
                        np.copyto(stored._data, data, casting="same_kind")
                        continue
                self._assign(k, vals, stored)
            return
        # the updater runs in key order, as MXNet's sorted key groups do
        order = sorted(range(len(keys)), key=lambda i: self._ikey[keys[i]]) \
            if len(keys) > 1 else (0,)
        for i in order:
            k, vals = keys[i], groups[i]
            stored = self._store[k]
            self._updater(k, self._merged(k, vals, stored), stored)

    def _dense_values(self, key: int | str, vals: list[Any]) -> list[np.ndarray]:
        arrays = [v._dense() if isinstance(v, NDArray) else as_numpy(v) for v in vals]
        if self._gc is None:
            return arrays
        # quantize each device's value with its own residual, then dequantize
        # (MXNet comm.h CommDevice::ReduceCompressed)
        out = []
        for i, a in enumerate(arrays):
            res = self._residual.get((key, i))
            if res is None:
                res = self._residual[(key, i)] = np.zeros(a.shape, np.float32)
            out.append(self._gc.roundtrip(np.asarray(a, np.float32), res))
        return out

    def _assign(self, key: int | str, vals: list[Any], stored: NDArray) -> None:
        if all(isinstance(v, RowSparseNDArray) for v in vals) and self._gc is None:
            merged = sum_row_sparse(vals)
            table = stored._data
            table[...] = 0
            table[merged._indices] = merged._data
            return
        self._reducer.sum_into(stored._data, self._dense_values(key, vals))

    def _merged(self, key: int | str, vals: list[Any], stored: NDArray) -> NDArray:
        """The sum of ``vals`` as an NDArray the updater may read but not keep."""
        if all(isinstance(v, RowSparseNDArray) for v in vals) and self._gc is None:
            merged = sum_row_sparse(vals)
            merged._data.flags.writeable = False
            return merged
        arrays = self._dense_values(key, vals)
        if len(arrays) == 1 and arrays[0].dtype == stored.dtype:
            view = arrays[0].view()  # no copy: MXNet hands a single value through too
            view.flags.writeable = False
            return NDArray(view, stored.context)
        buf = self._merge.get(key)
        if buf is None:
            buf = self._merge[key] = np.empty(stored.shape, stored.dtype)
        buf.flags.writeable = True
        self._reducer.sum_into(buf, arrays)
        buf.flags.writeable = False
        return NDArray(buf, stored.context)

    # ---- pull ------------------------------------------------------------------------
    def pull(self, key: Any, out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> Any:
        """Pull a single value or a sequence of values from the store.

        Parameters
        ----------
        key : str, int, or sequence of str or int
        out : NDArray, numpy.ndarray, list of them, or list of lists of them, optional
            Each out receives the stored value. With ``out=None`` pskv returns new arrays
            (MXNet raises).
        priority : int, default 0
            Accepted for compatibility.
        ignore_sparse : bool, default True
            Skip row_sparse outs (with a one-time warning per key), as MXNet does: use
            :meth:`row_sparse_pull` for them.

        Returns
        -------
        None, or with ``out=None`` the pulled array (a list for a list of keys).
        """
        with self._lock:
            if not self._closed and (type(key) is int or type(key) is str):
                stored = self._store.get(key)
                data = dense_data(out)
                if data is not None and type(stored) is NDArray and data.flags.writeable \
                        and data.shape == stored._data.shape \
                        and data.dtype == stored._data.dtype:
                    self._reducer.copy_into(data, stored._data)    # the one-key fast path
                    return None
            self._begin(pulling=True)
            if out is None:
                return self._pull_new(key)
            keys, groups = normalize(key, out, "out")
            self._validate_pull(keys, groups)
            self._pull_validated(keys, groups, ignore_sparse)
            return None

    def _validate_pull(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        self._check_kind(keys)
        for k, outs in zip(keys, groups):
            stored = self._stored(k, "pull")
            for o in outs:
                self._check_array(k, o, stored, "pull", into=True)
                if isinstance(o, np.ndarray) and not o.flags.writeable:
                    raise ValueTypeError(f"pull key {k!r}: the out array is read-only. Pass "
                                         "a writable array.", key=k, store_type=self._type)

    def _pull_validated(self, keys: list[int | str], groups: list[list[Any]],
                        ignore_sparse: bool) -> None:
        for k, outs in zip(keys, groups):
            stored = self._store[k]
            if len(outs) == 1 and type(stored) is NDArray:
                data = dense_data(outs[0])
                if data is not None and data.size < PARALLEL_MIN:
                    np.copyto(data, stored._data, casting="same_kind")
                    continue
            dense = []
            for o in outs:
                if isinstance(o, RowSparseNDArray):
                    if ignore_sparse:
                        self._warn_sparse(k)
                        continue
                    o._data = np.array(stored._dense(), dtype=o.dtype, copy=True)
                    o._indices = np.arange(stored.shape[0], dtype=np.int64)
                    continue
                dense.append(o._data if type(o) is NDArray else as_numpy(o))
            if dense:
                self._reducer.broadcast_into(dense, stored._dense())

    def _warn_sparse(self, key: int | str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"pull of key {key!r} into a row_sparse out was ignored, as MXNet does. "
                "Use kv.row_sparse_pull(key, out, row_ids=...) for row_sparse arrays.",
                SparsePullIgnoredWarning, stacklevel=3)

    def _pull_new(self, key: Any) -> Any:
        keys = key if isinstance(key, (list, tuple)) else [key]
        from ._args import check_key
        ks = [check_key(k) for k in keys]
        self._check_kind(ks)
        stored = [self._stored(k, "pull") for k in ks]
        result = [self._copy_out(k, s) for k, s in zip(ks, stored)]
        return result if isinstance(key, (list, tuple)) else result[0]

    def _copy_out(self, key: int | str, stored: NDArray) -> Any:
        proto = self._proto[key]
        if proto is np.ndarray:
            return stored._dense().copy()
        if isinstance(proto, RowSparseNDArray):
            return stored.copy()
        if not isinstance(proto, type):   # torch.from_numpy: _args.tensor_maker
            return proto(stored._dense().copy())
        out: Any = object.__new__(proto)
        out._data = stored._dense().copy()
        out._ctx = stored.context
        return out

    # ---- combined calls ----------------------------------------------------------------
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Push ``value``, then pull the result into ``out`` (into ``value`` if None).

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init('g', mx.nd.zeros((2,)))
        >>> a = mx.nd.ones((2,))
        >>> kv.pushpull('g', [a, a * 2])
        >>> a.asnumpy()
        array([3., 3.], dtype=float32)
        """
        with self._lock:
            self._check_open()
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, value if out is None else out, "out")
            self._validate_push(keys, groups)
            self._validate_pull(okeys, ogroups)
            self._push_validated(keys, groups)
            self._pull_validated(okeys, ogroups, True)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialize ``key`` with ``value`` and pull it into ``out``.

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> a = mx.nd.zeros((2, 3))
        >>> kv.broadcast('3', mx.nd.ones((2, 3)) * 2, out=a)
        >>> a.asnumpy()[0]
        array([2., 2., 2.], dtype=float32)
        """
        with self._lock:
            self._check_open()
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, out, "out")
            self._validate_init(keys, groups)
            if okeys != keys:
                raise ShapeMismatchError(f"broadcast got keys {okeys!r} for out but "
                                         f"{keys!r} for value. Pass the same keys.", key=key)
            for k, vals, outs in zip(keys, groups, ogroups):
                ref = vals[0] if isinstance(vals[0], NDArray) else as_numpy(vals[0])
                for o in outs:
                    self._check_array(k, o, ref, "broadcast", into=True)
            for k, vals in zip(keys, groups):
                self._init_one(k, vals[0])
            self._pull_validated(okeys, ogroups, True)

    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Pull the rows ``row_ids`` of a row_sparse key into row_sparse ``out``.

        Parameters
        ----------
        key : str, int, or sequence of str or int
        out : RowSparseNDArray or list of them
            Each out ends up holding exactly the requested rows (sorted, unique).
        priority : int, default 0
        row_ids : NDArray or numpy array, or a list of them
            One per out, or one for every out. May be unsorted, repeated, 2-D,
            float-typed or empty.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init('emb', mx.nd.array(np.arange(12).reshape(6, 2)).tostype('row_sparse'))
        >>> out = mx.nd.sparse.zeros('row_sparse', (6, 2))
        >>> kv.row_sparse_pull('emb', out=out, row_ids=mx.nd.array([4, 1, 4]))
        >>> out.indices.asnumpy().tolist(), out.data.asnumpy().tolist()
        ([1, 4], [[2.0, 3.0], [8.0, 9.0]])
        """
        with self._lock:
            self._check_open()
            if out is None or row_ids is None:
                raise ValueTypeError("row_sparse_pull needs both out= and row_ids=. Pass a "
                                     "row_sparse out and the rows to pull.", key=key)
            keys, groups = normalize(key, out, "out")
            rows = row_ids_by_key(key, keys, groups, row_ids)
            self._check_kind(keys)
            for k, outs in zip(keys, groups):
                stored = self._stored(k, "row_sparse_pull")
                if not isinstance(stored, RowSparseNDArray):
                    raise UnsupportedError(
                        f"row_sparse_pull of key {k!r}: the key holds a dense array of shape "
                        f"{stored.shape}. Init it with a row_sparse value, or use pull().",
                        key=k, shape=stored.shape, store_type=self._type)
                for o, r in zip(outs, rows[k]):
                    if not isinstance(o, RowSparseNDArray):
                        raise ValueTypeError(
                            f"row_sparse_pull of key {k!r} needs row_sparse outs, got a "
                            f"{type(o).__name__}. Create them with mx.nd.sparse.zeros("
                            f"'row_sparse', {stored.shape}).", key=k, store_type=self._type)
                    self._check_array(k, o, stored, "row_sparse_pull", into=True)
                    if r.size and (r[0] < 0 or r[-1] >= stored.shape[0]):
                        raise ShapeMismatchError(
                            f"row_sparse_pull of key {k!r}: row ids must lie in [0, "
                            f"{stored.shape[0]}), got {r[0] if r[0] < 0 else r[-1]}.",
                            key=k, shape=stored.shape, store_type=self._type)
            for k, outs in zip(keys, groups):
                table = self._store[k]._data
                for o, r in zip(outs, rows[k]):
                    o._data = table[r].astype(o.dtype, copy=False)  # fancy index: a copy
                    o._indices = r

    # ---- updaters and optimizers ---------------------------------------------------------
    def set_updater(self, updater: Callable[[Any, Any, Any], None]) -> None:
        """Set the push updater ``updater(key, input, stored)``, which mutates ``stored``.

        ``input`` is the sum of the pushed values (read-only); str keys reach the updater
        as str.

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init(3, mx.nd.ones((2, 3)))
        >>> def update(key, input, stored):
        ...     stored += input * 2
        >>> kv.set_updater(update)
        >>> kv.push(3, mx.nd.ones((2, 3)))
        >>> kv.pull(3).asnumpy()[0]
        array([3., 3., 3.], dtype=float32)
        """
        if not callable(updater):
            raise ValueTypeError(f"updater must be callable as updater(key, input, stored), "
                                 f"got {type(updater).__name__}.")
        with self._lock:
            self._check_open()
            self._updater = updater

    _set_updater = set_updater

    def set_optimizer(self, optimizer: Any) -> None:
        """Update stored values with ``optimizer`` on every push (``update_on_kvstore``).

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create()
        >>> kv.init(3, mx.nd.zeros((2, 2)))
        >>> kv.set_optimizer(mx.optimizer.SGD())
        >>> kv.push(3, mx.nd.ones((2, 2)))
        >>> kv.pull(3).asnumpy()
        array([[-0.01, -0.01],
               [-0.01, -0.01]], dtype=float32)
        """
        from .. import optimizer as opt
        if not isinstance(optimizer, opt.Optimizer):
            raise ValueTypeError(
                f"set_optimizer() takes a pskv.optimizer.Optimizer, got "
                f"{type(optimizer).__name__}. Create one with mx.optimizer.create('sgd', ...).")
        self.set_updater(opt.get_updater(optimizer))

    def _states_updater(self, action: str) -> Any:
        upd = self._updater
        if upd is None or not hasattr(upd, "get_states"):
            raise UnsupportedError(
                f"cannot {action} optimizer states: this store has no optimizer. Call "
                "kv.set_optimizer(...) first.", store_type=self._type)
        return upd

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer states (and the optimizer, if ``dump_optimizer``) to ``fname``.

        The file holds NumPy arrays and JSON, never a pickle.
        """
        with self._lock:
            data = self._states_updater("save").get_states(dump_optimizer)
            tmp = f"{fname}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states written by :meth:`save_optimizer_states`."""
        with self._lock:
            upd = self._states_updater("load")
            try:
                with open(fname, "rb") as f:
                    data = f.read()
            except OSError as err:
                raise ConfigError(f"cannot read optimizer states from {fname!r}: {err}. "
                                  "Check the path.") from err
            upd.set_states(data)

    # ---- compression ---------------------------------------------------------------------
    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress gradients with MXNet's 2bit (or the 2.0 line's 1bit) quantization.

        Each device's value is quantized with its own error-feedback residual, then
        dequantized and summed, as MXNet's ``device`` store does. Only store types with
        ``'device'`` in their name compress; set it before the first ``init``.

        Parameters
        ----------
        compression_params : dict
            ``{'type': '2bit', 'threshold': 0.5}`` or ``{'type': '1bit', ...}``.
        """
        from .. import compression
        with self._lock:
            self._check_open()
            if "device" not in self._type:
                raise UnsupportedError(
                    f"gradient compression is not supported for a {self._type!r} store. "
                    "Create the store with mx.kv.create('device') (or a dist_* type).",
                    store_type=self._type)
            if self._store:
                raise UnsupportedError(
                    "set_gradient_compression must be called before the first init; "
                    f"{len(self._store)} keys are initialized already. Create a new store.",
                    store_type=self._type)
            self._gc = compression.create(compression_params)

    # ---- misc ------------------------------------------------------------------------
    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability``; ``'optimizer'`` is supported."""
        if isinstance(capability, str) and capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ConfigError(f"unknown capability {capability!r}. Known: "
                          f"{KVStoreBase.OPTIMIZER!r}.")

    def barrier(self) -> None:
        """Wait for all workers: a no-op in a single-process store."""
        self._check_open()

    _barrier = barrier

    def close(self) -> None:
        """Release the store's threads; later calls raise. Closing twice is fine."""
        with self._lock:
            self._closed = True
            self._reducer.close()

    def __enter__(self) -> LocalKVStore:
        return self

    def __exit__(self, exc_type: builtins.type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LocalKVStore type={self._type!r} keys={len(self._store)}>"
