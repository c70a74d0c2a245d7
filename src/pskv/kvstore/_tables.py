"""The table keys of a local store: ``kv.init(key, TableSpec(...))`` and what follows.

A table key (docs/embeddings.md) holds a :class:`pskv.table.DynamicTable` instead of an
array; ``Tables`` routes a store's calls on such keys to it, and :class:`TableMethods` adds
the table-only calls (``lookup``, ``table_stats``) to the store. The store's lock is held
by the caller. Invariant: a key is either a table key or an array key, never both.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import (KeyAlreadyInitializedError, KeyNotInitializedError, ShapeMismatchError,
                      TableIdError, UnsupportedError, ValueTypeError)
from ..nd.sparse import RowSparseNDArray
from ..table._checks import check_ids
from ..table._stream import read_changes
from ..table import DynamicTable, TableSpec
from .._types import Key
from ._args import as_numpy, check_key
from ._table_rules import restore_local, table_copy
from ._keys import KeyTable
from ._rowcache import check_cache
from ._table_stream import StreamMethods
from ._snapshot import Reader, ShardCopy
from ._table_budget import check_table_init
from .._ps.config import max_key_bytes

__all__ = ["TableMethods", "Tables", "rsp_outs"]


class Tables:
    """key -> DynamicTable, for one store."""

    def __init__(self, store_type: str) -> None:
        self.store_type = store_type
        self.tables: dict[Key, DynamicTable] = {}
        #: key -> (rows, max_pushes, max_seconds) given to ``set_table_cache`` (C1)
        self.cache_limits: dict[Key, tuple[int, int | None, float | None]] = {}

    def __bool__(self) -> bool:
        return bool(self.tables)

    def owns(self, key: Any) -> bool:
        """Whether ``key`` (or a key of the list ``key``) is a table key."""
        if not self.tables:
            return False
        if isinstance(key, (list, tuple)):
            return any(self.owns(k) for k in key)
        try:
            return key in self.tables
        except TypeError:
            return False

    def get(self, key: Any, action: str) -> DynamicTable:
        """The table of ``key``, or KeyNotInitializedError / UnsupportedError for lists."""
        if isinstance(key, (list, tuple)):
            raise UnsupportedError(
                f"cannot {action} keys {list(key)!r} in one call: table keys go one per "
                "call. Call it for each table key.", key=list(key), store_type=self.store_type)
        table = self.tables.get(key)
        if table is None:
            raise KeyNotInitializedError(
                f"cannot {action} key {key!r}: it is not a table key of this "
                f"{self.store_type!r} store. Call kv.init({key!r}, TableSpec(...)) first.",
                key=key, store_type=self.store_type)
        return table

    def init(self, key: Any, spec: TableSpec, keys: KeyTable) -> None:
        """Declare table ``key`` (one per call)."""
        k = check_key(key)
        keys.check_kind([k])
        if k in self.tables or k in keys.records:
            raise KeyAlreadyInitializedError(
                f"key {k!r} is initialized twice. Each key takes one init (a TableSpec or an "
                "array).", key=k, store_type=self.store_type)
        self.tables[k] = self._table(spec, k)
        if keys.kind is None:
            keys.kind = type(k)

    def _table(self, spec: TableSpec, key: Key) -> DynamicTable:
        """The table of a new key ``key``: its whole memory is this process's, so it is
        checked against ``PSKV_MAX_KEY_BYTES`` first (a LimitError, not a MemoryError)."""
        check_table_init(spec, 1, key, max_key_bytes(os.environ),
                         f"this {self.store_type!r} store")
        return DynamicTable(spec, name=key)

    def taken(self, key: Any) -> None:
        """Raise KeyAlreadyInitializedError if ``key`` (or one of a list) is a table key."""
        if self.owns(key):
            raise KeyAlreadyInitializedError(
                f"key {key!r} is a table key already; it cannot also hold an array. Use "
                "another key.", key=key, store_type=self.store_type)

    def push(self, key: Any, value: Any, updater: Any) -> None:
        """One push of ``value`` (``(ids, grads)``, a RowSparseNDArray whose indices are
        IDs, or a list of them, one per device) through the store's optimizer; then a
        bounded sweep."""
        table = self.get(key, "push to table")
        ids, grads = _pairs(key, value)
        opt = None
        if updater is not None and table.spec.optimizer is None:
            opt = getattr(updater, "optimizer", None)
            if opt is None or not hasattr(updater, "states"):
                raise UnsupportedError(
                    f"table key {key!r} cannot be updated by a custom updater "
                    "(set_updater); tables run the optimizer given to kv.set_optimizer, or "
                    "assign without one.", key=key, store_type=self.store_type)
        table.push(ids, grads, optimizer=opt, key=key)
        table.sweep(table.spec.sweep_rows)

    def row_sparse_pull(self, key: Any, out: Any, row_ids: Any) -> None:
        """Training lookup of ``row_ids`` into row_sparse ``out`` (a list: one each)."""
        table = self.get(key, "row_sparse_pull from table")
        outs, rows = rsp_outs(key, table, out, row_ids)
        ids = [np.unique(check_ids(key, as_numpy(r), "row_sparse_pull")) for r in rows]
        for o, r in zip(outs, ids):
            values, _found = table.lookup(r, train=True)
            o._data = values.astype(o.dtype, copy=False)
            o._indices = r
            o._full_shape = (max(o.shape[0], 1), table.spec.dim)

    def lookup(self, key: Any, ids: Any, train: bool) -> tuple[np.ndarray, np.ndarray]:
        """``(values, found)`` of ``ids`` in table ``key`` (R5, R6)."""
        return self.get(key, "lookup").lookup(ids, train=train)

    def stats(self, key: Any) -> dict[str, int]:
        """The counters of table ``key`` (R14)."""
        return self.get(key, "read the stats of").stats()

    def explain(self, key: Any, ident: int) -> dict[str, Any]:
        """What table ``key`` knows of ID ``ident`` (``DynamicTable.explain``)."""
        return {**self.get(key, "explain an ID of").explain(ident), "shard": 0}

    def hot(self, key: Any, k: int) -> list[tuple[int, int]]:
        """Table ``key``'s ``k`` most looked-up IDs (H1-H3)."""
        return self.get(key, "read the hot IDs of").hot.top(k)

    def num_shards(self, key: Any) -> int:
        """How many shards table ``key`` is cut into (1: a local store)."""
        self.get(key, "subscribe to")
        return 1

    def versions(self, key: Any) -> list[int]:
        """Each shard's version of table ``key`` (E1)."""
        return [self.get(key, "read the versions of").version]

    def fetch(self, key: Any, raw: bool, max_rows: int) -> Any:
        """``fetch(shard, since, lineage, cursor, upto)``: a page of table ``key``'s
        change stream (``Subscription``); a local store reads its table, under ``lock``."""
        self.get(key, "subscribe to")
        return lambda shard, since, lineage, cursor, upto: read_changes(
            self.get(key, "subscribe to"), since, lineage, cursor=cursor, upto=upto,
            max_rows=max_rows, raw=raw, key=key)

    def set_cache(self, key: Any, rows: Any, max_pushes: Any, max_seconds: Any,
                  dense: Any) -> tuple[int, int | None, float | None]:
        """Check and record ``kv.set_table_cache`` (C1); a local store holds its rows
        already, so nothing else changes. Returns the checked limits."""
        try:
            is_dense = not isinstance(key, (list, tuple)) and key in dense
        except TypeError:
            is_dense = False
        if is_dense:
            raise UnsupportedError(
                f"cannot cache rows of key {key!r}: it holds an array, not a table. A row "
                "cache is for table keys (kv.init(key, TableSpec(...))).", key=key,
                store_type=self.store_type)
        self.get(key, "cache rows of")
        checked = check_cache(key, rows, max_pushes, max_seconds, self.store_type)
        if checked[0]:
            self.cache_limits[key] = checked
        else:
            self.cache_limits.pop(key, None)
        return checked

    def cache_stats(self, key: Any) -> dict[str, int]:
        """The row cache's counters of table ``key``: all 0 on a store that holds its rows
        (``capacity``: the rows asked for)."""
        self.get(key, "read the cache stats of")
        rows = self.cache_limits.get(key, (0, None, None))[0]
        return {"capacity": rows, "rows": 0, "hits": 0, "misses": 0, "expired": 0,
                "admitted": 0, "evicted": 0, "invalidated": 0}

    def refuse(self, key: Any, action: str) -> None:
        """Raise for an array call (pull, pushpull, broadcast) on a table key."""
        raise UnsupportedError(
            f"cannot {action} table key {key!r}: a table has no dense value. Use "
            "kv.row_sparse_pull(key, out, row_ids=ids) or kv.lookup(key, ids).",
            key=key, store_type=self.store_type)

    def save_into(self, copy: ShardCopy) -> None:
        """Add every table (its rows by ID, docs/embeddings.md D7) to checkpoint ``copy``."""
        for key, table in self.tables.items():
            fields, arrays = table_copy(table)
            copy.entries.append({"key": key, "id": key, **fields, "round": table.step,
                                 "applied": []})
            copy.arrays.append(arrays)

    def read(self, reader: Reader) -> dict[Key, DynamicTable]:
        """Every table rebuilt from checkpoint ``reader`` (saved by any number of servers),
        to :meth:`install` once everything else loaded; CheckpointError, changing nothing,
        if a key is not a table of the same dim and dtype there."""
        return {key: restore_local(table, key, reader.key_meta(key), reader)
                for key, table in self.tables.items()}

    def install(self, made: dict[Key, DynamicTable]) -> None:
        """Hold the tables :meth:`read` made."""
        self.tables.update(made)


def _pairs(key: Any, value: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, grads)`` of a table push value, device values concatenated."""
    parts = value if isinstance(value, list) else [value]
    ids, grads = [], []
    for v in parts:
        if isinstance(v, RowSparseNDArray):
            ids.append(v._indices)
            grads.append(v._data)
        elif isinstance(v, tuple) and len(v) == 2:
            ids.append(_array(key, v[0], "IDs"))
            grads.append(_array(key, v[1], "gradients"))
        else:
            raise ValueTypeError(
                f"push to table key {key!r} got a {type(v).__name__}; push (ids, grads) or a "
                "RowSparseNDArray whose indices are the IDs (or a list of them).", key=key)
    if len(parts) == 1:
        return np.asarray(ids[0]), np.asarray(grads[0])
    try:
        return np.concatenate([np.ravel(i) for i in ids]), np.concatenate(grads)
    except ValueError as err:
        raise ShapeMismatchError(f"push to table key {key!r}: the device values do not fit "
                                 f"together ({err}).", key=key) from err


def _array(key: Any, obj: Any, what: str) -> np.ndarray:
    """``obj`` as a NumPy array; ragged nested lists raise the table's error."""
    try:
        return as_numpy(obj)
    except ValueError as err:
        cls = TableIdError if what == "IDs" else ShapeMismatchError
        raise cls(f"push to table key {key!r}: the {what} are ragged ({err}). Pass one "
                  "array of IDs and one (len(ids), dim) array of gradients.", key=key) from err


class TableMethods(StreamMethods):
    """The table-only calls of a store that holds table keys (mixed into LocalKVStore and
    DistKVStore, whose ``_tables`` sends them to the servers)."""

    _tables: Tables
    _lock: Any
    _keys: KeyTable

    def _table_begin(self) -> None:
        """What every table call checks first (the store is open)."""
        self._keys.check_open()

    def _before_lookup(self) -> None:
        """What a store does before it sends a lookup (a dist store's staleness bound)."""

    def _store_optimizer(self) -> Any:
        """The optimizer ``set_optimizer`` gave this store (None: none)."""
        return None

    def _row_optimizer(self, key: Key) -> Any:
        """The optimizer a push of gradients to table ``key`` runs: the table's own
        (``TableSpec.optimizer``), else the store's; None: a push assigns (R12)."""
        with self._lock:
            table = self._tables.get(key, "train")
            return table.spec.optimizer or self._store_optimizer()

    def lookup(self, key: Key, ids: Any, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Read the rows of raw IDs from table key ``key``.

        Parameters
        ----------
        key : int or str
            A key initialized with a :class:`pskv.table.TableSpec`.
        ids : array_like of int
            Any shape; any int64 values.
        train : bool, default True
            A training lookup may insert rows (per the table's admission) and marks them
            used; ``train=False`` (evaluation) changes nothing.

        Returns
        -------
        values : numpy.ndarray, shape ``ids.shape + (dim,)``
        found : numpy.ndarray of bool, shape ``ids.shape``
            True where a stored row was read, False where the unknown-ID value was.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec, Constant
        >>> kv = mx.kv.create('local')
        >>> kv.init('emb', TableSpec(dim=2, init=Constant(1.0)))
        >>> kv.lookup('emb', np.array([5, 6]), train=False)[1].tolist()
        [False, False]
        """
        with self._lock:
            self._table_begin()
            self._before_lookup()
            return self._tables.lookup(key, ids, train)

    def set_table_cache(self, key: Key, rows: int, *, max_pushes: int | None = 1,
                        max_seconds: float | None = None) -> None:
        """Keep up to ``rows`` hot rows of table key ``key`` on this worker, each served
        by a lookup while it is at most ``max_pushes`` of this worker's push calls of the
        key and ``max_seconds`` seconds old (docs/embeddings.md, "The hot-row cache",
        C1-C7).

        A worker's own choice, not collective: workers may cache differently. A dist
        store serves held rows without asking the servers; ``max_pushes=0`` serves a row
        only until this worker's next push of the key (in ``dist_sync``, results equal
        the uncached ones); the bound in force is the smaller of ``max_pushes`` and the
        ``set_staleness`` bound. A ``local`` store holds every row already: it checks and
        records the call, and nothing else changes (a script moves to ``dist_async``
        unchanged). Calling it again replaces the cache (emptied); ``rows=0`` turns it
        off.

        Parameters
        ----------
        key : int or str
            A table key (``kv.init(key, TableSpec(...))`` first).
        rows : int
            Rows held at most; 0: no cache.
        max_pushes : int or None, default 1, keyword-only
            ``K``: push calls of ``key`` by this worker since a row's lookup was sent,
            at most; None: no push bound (then ``max_seconds`` is needed).
        max_seconds : float or None, keyword-only
            ``T``: seconds since a row's lookup was sent, at most; None: no time bound.

        Raises
        ------
        ConfigError
            A bad ``rows``, ``max_pushes`` or ``max_seconds``, or no bound at all.
        KeyNotInitializedError
            ``key`` is not a table key of this store (not initialized yet).
        UnsupportedError
            ``key`` holds an array, or is a list of keys.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec
        >>> kv = mx.kv.create('local')
        >>> kv.init('emb', TableSpec(dim=2))
        >>> kv.set_table_cache('emb', 100, max_pushes=2)
        >>> kv.table_cache_stats('emb')['capacity']
        100
        """
        with self._lock:
            self._table_begin()
            self._tables.set_cache(key, rows, max_pushes, max_seconds, self._keys.records)

    def table_cache_stats(self, key: Key) -> dict[str, int]:
        """The hot-row cache counters of table key ``key`` on this worker: capacity, rows
        (held), hits and misses (looked-up IDs served by the cache, or asked of the
        servers), expired (held but too old: asked again), admitted, evicted,
        invalidated. All 0 but ``capacity`` on a ``local`` store.

        Examples
        --------
        >>> import pskv as mx
        >>> from pskv.table import TableSpec
        >>> kv = mx.kv.create('local')
        >>> kv.init(0, TableSpec(dim=2))
        >>> kv.table_cache_stats(0)['hits']
        0
        """
        with self._lock:
            self._table_begin()
            return self._tables.cache_stats(key)

    def table_stats(self, key: Key) -> dict[str, int]:
        """The counters of table key ``key``: rows, step, lookups, misses, inserts,
        refusals, evictions (evicted_ttl, evicted_capacity), dropped_pushes, pushed_rows.
        A dist store sums them over the servers (``step``: the same on every server).

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec
        >>> kv = mx.kv.create('local')
        >>> kv.init(0, TableSpec(dim=2))
        >>> _ = kv.lookup(0, np.array([1, 2, 2]))
        >>> s = kv.table_stats(0); s['rows'], s['lookups'], s['misses']
        (2, 3, 3)
        """
        with self._lock:
            self._table_begin()
            return self._tables.stats(key)


def rsp_outs(key: Any, table: DynamicTable, out: Any,
             row_ids: Any) -> tuple[list[Any], list[Any]]:
    """A table's ``row_sparse_pull`` arguments as (outs, one row_ids each), checked: one
    row_ids per out (or one for all), row_sparse outs of the table's width."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    rows = list(row_ids) if isinstance(row_ids, (list, tuple)) else [row_ids] * len(outs)
    if len(rows) != len(outs) or not outs:
        raise ShapeMismatchError(
            f"row_sparse_pull of table {key!r} got {len(rows)} row_ids for {len(outs)} "
            "outs. Pass one row_ids per out, or one for all.", key=key)
    for o in outs:
        if not isinstance(o, RowSparseNDArray) or o.shape[1:] != (table.spec.dim,):
            raise ValueTypeError(
                f"row_sparse_pull of table {key!r} needs row_sparse outs of shape "
                f"(any, {table.spec.dim}), got {type(o).__name__} "
                f"{getattr(o, 'shape', '')}. Use mx.nd.sparse.zeros('row_sparse', "
                f"(1, {table.spec.dim})).", key=key)
    return outs, rows
