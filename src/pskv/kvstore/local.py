"""LocalKVStore: the ``local`` and ``device`` stores (and MXNet's legacy aliases).

The store normalizes and validates a call (:mod:`._args`, :class:`._keys.KeyTable`), merges
the values given for each key (one per device), then hands the merged value to its
:class:`._engine.Engine`, which runs the updater (or assigns). A one-worker round closes on
every push, so the store calls ``Engine.apply`` directly. Invariants: ``_store[key]`` (the
engine's ``stored``) is an NDArray the store owns (a RowSparseNDArray holding every row for
row_sparse keys); every call validates all of its arguments before it changes any key, so a
call that raises changes nothing; ``_lock`` serializes calls.

Over 500 lines because LocalKVStore implements the whole typed API (docs/api.md) with the
fast paths of one key and one dense array beside the general path.
"""
from __future__ import annotations

import os
import threading
from typing import Any, overload

import numpy as np

from .. import compression
from .. import optimizer as opt
from ..errors import ConfigError, SparsePullIgnoredWarning, ValueTypeError, UnsupportedError
from ..nd._npz import BadArchive, open_regular
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ..table import TableSpec
from .._types import Array, Key, KeyArg, KeyList, OutArg, Updater, ValueArg
from ._args import as_numpy, dense_data, normalize, row_ids_by_key
from ._device_io import DeviceIO, has_device
from .engine._core import Engine
from ._keys import KeyTable
from ._snapshot import Reader, check_keys, write_manifest, write_shard
from ._staleness import check_bounds
from .._ps.config import staleness_bounds
from ._gradkeys import GradientKeys
from ._tables import TableMethods, Tables
from ._reduce import PARALLEL_MIN, DeviceMerge, Reducer
from .base import KVStoreBase, check_capability, check_optimizer

__all__ = ["LocalKVStore", "SparsePullIgnoredWarning"]


class LocalKVStore(TableMethods, KVStoreBase):
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
        self._keys = KeyTable(name)
        self._engine = Engine(num_workers=1)
        #: key -> stored NDArray (the engine's; the fast paths read it directly)
        self._store: dict[Key, NDArray] = self._engine.stored
        self._reducer = Reducer()     # PSKV_REDUCE_THREADS, read by the config module
        self._devices = DeviceMerge(self._reducer)
        #: CUDA values and outs: read into, and written from, pinned buffers (docs/gpu.md)
        self._device = DeviceIO(name)
        self._lock = threading.RLock()
        self._tables = Tables(name)          # table keys (docs/embeddings.md)
        #: DistributedOptimizers' gradient keys, which no updater may touch
        self._gradient_keys = GradientKeys(name, self._updates)
        #: the staleness bounds set (PSKV_STALENESS / PSKV_GLOBAL_STALENESS by default):
        #: kept, and always honoured, since every push here is applied before it returns
        self._bounds = staleness_bounds(os.environ, name)

    # ---- properties ----------------------------------------------------------------
    @property
    def type(self) -> str:
        """The store type, as given to ``create`` and lower-cased."""
        return self._type

    # ---- init ------------------------------------------------------------------------
    def init(self, key: KeyArg, value: ValueArg) -> None:
        """Initialize a single key-value pair or a sequence of them.

        Parameters
        ----------
        key : str, int, or sequence of str or int
            The keys; one kind per store.
        value : NDArray, numpy.ndarray, or list of them
            One value per key; the store keeps a copy.

        Raises
        ------
        KeyAlreadyInitializedError
            If a key was initialized before (MXNet raises MXNetError).
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
            self._keys.check_open()
            if isinstance(value, TableSpec):
                return self._tables.init(key, value, self._keys)
            self._tables.taken(key)
            keys, groups = normalize(key, value)
            if has_device(groups):
                return self._device.run(keys, groups, None, None, self._keys.records,
                                        lambda g, _: self._init_checked(keys, g, groups))
            self._init_checked(keys, groups, groups)

    def _init_checked(self, keys: list[Key], groups: list[list[Any]],
                      given: list[list[Any]]) -> None:
        self._keys.validate_init(keys, groups)
        for k, vals, orig in zip(keys, groups, given):
            self._init_one(k, vals[0], orig[0])

    def _init_one(self, key: Key, value: Any, given: Any = None) -> None:
        self._keys.add(self._keys.make(key, value, given))
        sparse = isinstance(value, RowSparseNDArray)
        data = value._dense() if isinstance(value, NDArray) else as_numpy(value)
        self._engine.init(key, data, sparse, ctx=value.context if isinstance(value, NDArray)
                          else None)

    # ---- push ------------------------------------------------------------------------
    def push(self, key: KeyArg, value: ValueArg, priority: int = 0) -> None:
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
            self._keys.check_open()
            if self._tables.owns(key):
                return self._tables.push(key, value, self._engine.updater)
            keys, groups = normalize(key, value)
            squeeze = self._devices.compressor is not None
            if has_device(groups):
                return self._device.run(keys, groups, None, None, self._keys.records,
                                        lambda g, _: self._push_checked(keys, g), squeeze)
            self._push_checked(keys, groups)

    def _push_checked(self, keys: list[Key], groups: list[list[Any]]) -> None:
        self._keys.validate_push(keys, groups, self._devices.compressor is not None)
        self._push_validated(keys, groups)

    def _fast_push(self, key: Any, value: Any) -> bool:
        """One key, one dense array of the stored shape and dtype, assign: copy it in.

        Everything the general path checks holds here by construction; anything else
        returns False and takes the general path.
        """
        if self._engine.updater is not None or self._devices.compressor is not None or self._keys.closed or \
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

    def _push_validated(self, keys: list[Key], groups: list[list[Any]]) -> None:
        if self._engine.updater is None:   # assign: the order of keys does not matter
            small = PARALLEL_MIN
            for k, vals in zip(keys, groups):
                stored = self._store[k]
                if len(vals) == 1 and self._devices.compressor is None and type(stored) is NDArray:
                    data = dense_data(vals[0])
                    if data is not None and data.size < small:
                        np.copyto(stored._data, data, casting="same_kind")
                        continue
                self._devices.assign(k, vals, stored)
            return
        # the updater runs in key order, as MXNet's sorted key groups do
        records = self._keys.records
        order = sorted(range(len(keys)), key=lambda i: records[keys[i]].ikey) \
            if len(keys) > 1 else (0,)
        for i in order:
            k, vals = keys[i], groups[i]
            self._engine.apply(k, self._devices.merged(k, vals, self._store[k]))

    # ---- pull ------------------------------------------------------------------------
    @overload
    def pull(self, key: Key, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> Array: ...

    @overload
    def pull(self, key: KeyList, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> list[Array]: ...

    @overload
    def pull(self, key: KeyArg, out: OutArg, priority: int = 0,
             ignore_sparse: bool = True) -> None: ...

    def pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
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
            if not self._keys.closed and (type(key) is int or type(key) is str):
                stored = self._store.get(key)
                data = dense_data(out)
                if data is not None and type(stored) is NDArray and data.flags.writeable \
                        and data.shape == stored._data.shape \
                        and data.dtype == stored._data.dtype:
                    self._reducer.copy_into(data, stored._data)    # the one-key fast path
                    return None
            self._keys.check_open()
            if self._tables.owns(key):
                self._tables.refuse(key, "pull")
            if out is None:
                return self._pull_new(key)
            keys, groups = normalize(key, out, "out")
            if has_device(groups):
                return self._device.run(None, None, keys, groups, self._keys.records,
                                        lambda _, o: self._pull_checked(keys, o, ignore_sparse))
            self._pull_checked(keys, groups, ignore_sparse)
            return None

    def _pull_checked(self, keys: list[Key], groups: list[list[Any]],
                      ignore_sparse: bool) -> None:
        self._keys.validate_pull(keys, groups)
        self._pull_validated(keys, groups, ignore_sparse)

    def _pull_validated(self, keys: list[Key], groups: list[list[Any]],
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
                        self._keys.warn_sparse(k)
                        continue
                    o._data = np.array(stored._dense(), dtype=o.dtype, copy=True)
                    o._indices = np.arange(stored.shape[0], dtype=np.int64)
                    continue
                dense.append(o._data if type(o) is NDArray else as_numpy(o))
            if dense:
                self._reducer.broadcast_into(dense, stored._dense())

    def _pull_new(self, key: Any) -> Any:
        many, records = self._keys.pull_new_keys(key)
        result = [self._keys.new_out(r, self._store[r.key]._dense().copy()) for r in records]
        return result if many else result[0]

    # ---- combined calls ----------------------------------------------------------------
    def pushpull(self, key: KeyArg, value: ValueArg, out: OutArg | None = None,
                 priority: int = 0) -> None:
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
            self._keys.check_open()
            if self._tables.owns(key):
                self._tables.refuse(key, "pushpull")
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, value if out is None else out, "out")
            if has_device(groups) or has_device(ogroups):
                return self._device.run(keys, groups, okeys, ogroups, self._keys.records,
                                        lambda g, o: self._pushpull_checked(keys, g, okeys, o),
                                        self._devices.compressor is not None)
            self._pushpull_checked(keys, groups, okeys, ogroups)

    def _pushpull_checked(self, keys: list[Key], groups: list[list[Any]], okeys: list[Key],
                          ogroups: list[list[Any]]) -> None:
        self._keys.validate_push(keys, groups, self._devices.compressor is not None)
        self._keys.validate_pull(okeys, ogroups)
        self._push_validated(keys, groups)
        self._pull_validated(okeys, ogroups, True)

    def broadcast(self, key: KeyArg, value: ValueArg, out: OutArg, priority: int = 0) -> None:
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
            self._keys.check_open()
            self._tables.taken(key)
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, out, "out")

            def checked(g: list[list[Any]], o: list[list[Any]]) -> None:
                self._keys.validate_broadcast(key, keys, g, okeys, o)
                for k, vals, orig in zip(keys, g, groups):
                    self._init_one(k, vals[0], orig[0])
                self._pull_validated(okeys, o, True)
            if has_device(groups) or has_device(ogroups):
                return self._device.run(keys, groups, okeys, ogroups, self._keys.records,
                                        checked)
            checked(groups, ogroups)

    def row_sparse_pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
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
            self._keys.check_open()
            if self._tables.owns(key):
                return self._tables.row_sparse_pull(key, out, row_ids)
            self._keys.need_rows(key, out, row_ids)
            keys, groups = normalize(key, out, "out")
            rows = row_ids_by_key(key, keys, groups, row_ids)
            self._keys.validate_row_sparse_pull(key, out, row_ids, keys, groups, rows)
            for k, outs in zip(keys, groups):
                table = self._store[k]._data
                for o, r in zip(outs, rows[k]):
                    o._data = table[r].astype(o.dtype, copy=False)  # fancy index: a copy
                    o._indices = r

    # ---- updaters and optimizers ---------------------------------------------------------
    def set_updater(self, updater: Updater) -> None:
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
            self._keys.check_open()
            self._gradient_keys.refuse_optimizer(
                "set_optimizer" if getattr(updater, "optimizer", None) is not None
                else "set_updater")
            self._engine.updater = updater

    _set_updater = set_updater

    def _store_optimizer(self) -> Any:
        return getattr(self._engine.updater, "optimizer", None)

    def _updates(self) -> str | None:
        """What updates pushed values (``"optimizer SGD"``), or None: pushes assign."""
        upd = self._engine.updater
        if upd is None:
            return None
        opt = getattr(upd, "optimizer", None)
        return "updater (set_updater)" if opt is None else "optimizer (kv.set_optimizer)"

    def set_optimizer(self, optimizer: Any) -> None:
        """Update stored values with ``optimizer`` on every push (``update_on_kvstore``).

        Raises
        ------
        ValueTypeError
            If ``optimizer`` is not a pskv Optimizer.
        ConfigError
            If a hyperparameter is not of its type (``SGD(learning_rate='abc')``), as in
            every store type, or a ``pskv.torch.DistributedOptimizer`` with
            ``update_on_kvstore=False`` holds gradient keys here; nothing changes. The
            object itself is run, as MXNet's local store does: a custom class with
            arguments of its own needs no spec here.

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
        check_optimizer(optimizer)      # its values; it runs here as given (need no spec)
        self.set_updater(opt.get_updater(optimizer))

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer states (and the optimizer, if ``dump_optimizer``) to ``fname``.

        The file holds NumPy arrays and JSON, never a pickle.
        """
        with self._lock:
            if self._tables:
                # a table's row states live with its rows, and the states file has no
                # place for them: saving without them would lose them silently
                raise UnsupportedError(
                    "save_optimizer_states cannot hold the row optimizer states of table "
                    f"keys ({', '.join(repr(k) for k in self._tables.tables)}). Use "
                    "kv.save_checkpoint, which saves every table with its rows' states.",
                    store_type=self._type)
            data = self._engine.states_updater("save").get_states(dump_optimizer)
            tmp = f"{fname}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states written by :meth:`save_optimizer_states`."""
        with self._lock:
            upd = self._engine.states_updater("load")
            try:
                with open_regular(fname) as f:    # a FIFO would block: refused
                    data = f.read()
            except (OSError, BadArchive) as err:
                raise ConfigError(f"cannot read optimizer states from {fname!r}: {err}. "
                                  "Check the path.") from err
            upd.set_states(data)

    # ---- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Write every stored value and optimizer state to the directory ``path``.

        The checkpoint is a manifest plus one shard of NumPy arrays and JSON (never a
        pickle); :meth:`load_checkpoint` of any store type reads it, a ``dist_*`` cluster
        of any size included (docs/durability.md).

        Parameters
        ----------
        path : str
            A directory (created if missing); a checkpoint already there is replaced.

        Examples
        --------
        >>> import tempfile, pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.init('w', mx.nd.ones((2,)))
        >>> d = tempfile.mkdtemp()
        >>> kv.save_checkpoint(d)
        >>> kv.push('w', mx.nd.zeros((2,)))
        >>> kv.load_checkpoint(d)
        >>> kv.pull('w').asnumpy()
        array([1., 1.], dtype=float32)
        """
        with self._lock:
            self._keys.check_open()
            copy = self._engine.snapshot()
            self._tables.save_into(copy)
            write_shard(copy, path, 0)
            write_manifest(path, 1, None, self._type)

    def load_checkpoint(self, path: str) -> None:
        """Set every key from the checkpoint in ``path`` (values and optimizer states).

        The store must hold exactly the checkpoint's keys, initialized with the same shapes
        and dtypes; an optimizer saved with the checkpoint replaces the store's (call
        ``set_optimizer`` before, not after, loading).

        Raises
        ------
        CheckpointError
            If ``path`` is not a complete checkpoint or holds other keys or shapes; the
            store is then unchanged.
        """
        with self._lock:
            self._keys.check_open()
            reader = Reader(path)
            try:
                check_keys(reader, list(self._engine.stored) + list(self._tables.tables), path)
                made = self._tables.read(reader)
                self._engine.restore(reader)
                self._tables.install(made)
            finally:
                reader.close()

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
        with self._lock:
            self._keys.check_open()
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
            self._devices.compressor = compression.create(compression_params)

    # ---- staleness -------------------------------------------------------------------
    def set_staleness(self, bound: int | None, *, global_bound: int | None = None) -> None:
        """Bound how stale the values read may be (docs/embeddings.md, "Bounded
        staleness").

        A local store applies every push before the call returns, so each read sees every
        earlier push: any bound holds, and this only checks and records it (a script moves
        to ``dist_async`` unchanged).

        Parameters
        ----------
        bound : int or None
            Push calls of this worker a read may run ahead of; 0 reads your own writes.
        global_bound : int or None, keyword-only
            Push calls the fastest worker may be ahead of the slowest one.

        Raises
        ------
        StalenessError
            If a bound is not a whole number of at least 0 (nothing is changed).

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.set_staleness(0, global_bound=2)
        """
        checked = check_bounds(bound, global_bound, self._type)
        with self._lock:
            self._keys.check_open()
            self._bounds = checked

    # ---- misc ------------------------------------------------------------------------
    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability``; ``'optimizer'`` is supported."""
        return check_capability(capability)

    def barrier(self) -> None:
        """Wait for all workers: a no-op in a single-process store."""
        self._keys.check_open()

    _barrier = barrier

    def close(self) -> None:
        """Release the store's threads; later calls raise. Closing twice is fine."""
        with self._lock:
            self._keys.closed = True
            self._reducer.close()
            self._device.close()

    def __repr__(self) -> str:
        return f"<LocalKVStore type={self._type!r} keys={len(self._store)}>"
