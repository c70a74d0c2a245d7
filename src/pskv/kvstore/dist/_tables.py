"""The table keys of a dist store: the worker side of docs/embeddings.md on the servers.

A table key lives on every server, each holding the rows of the IDs that
:func:`pskv.table.shard_of` routes to it (R13: a hash, never ranges). A push ``(ids,
grads)`` is checked whole here (R15), split by that hash (the gradient rows with their IDs)
and sent to every server as a push of kind ``t`` (an empty one where no ID goes, so that a
``dist_sync`` round, which needs every worker's push, closes on every server, and every
server counts the same steps, R11); a lookup asks only the servers that own some of its
IDs and puts their rows back in the caller's order; ``table_stats`` sums the servers'
counters (``step``: the largest, the same everywhere). The store holds its lock around
these calls and releases it while waiting (``wait_all``).

Invariant: the same API and the same errors as the local store (``_tables``): a worker keeps
a :class:`._tables.Tables` of :class:`.._table_rules.TableKey` (spec and name, never a
row), checked by the functions a DynamicTable runs (``pskv.table._checks``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...errors import ClusterError, KVStoreError, UnsupportedError
from ...table import TableSpec, shard_of
from ...table._checks import check_grads, check_ids
from ...table._stream import ChangeBatch, new_lineage
from ..._ps.message import Command, error_body, error_from_body
from ..._ps.ops import Op, command
from ..._ps.worker import KVWorker
from ..._types import Key
from ..._ps.partition import ps_key
from .._args import as_numpy, check_key
from .._rowcache import RowCache
from .._table_rules import TableKey, check_optimizer
from .._tables import Tables, _pairs, rsp_outs
from ._agree import check_agreement, init_spec

__all__ = ["DistTables", "init_table"]


class DistTables(Tables):
    """Table keys of one DistKVStore, and the messages of their calls.

    Parameters
    ----------
    store_type : str
    kv : KVWorker
    num_servers : int
    wait_all : callable
        ``wait_all(tss, what)``: the replies, waited for without the store's lock.
    staleness : callable
        ``staleness()``: the per-worker staleness bound set (None: none), which caps a
        row cache's ``max_pushes`` (C4).
    num_workers : int
        Workers in the job (bound 0 in dist_async asks the servers' steps when > 1).
    """

    def __init__(self, store_type: str, kv: KVWorker, num_servers: int,
                 wait_all: Callable[[list[int], str], list[Any]],
                 staleness: Callable[[], int | None] = lambda: None,
                 num_workers: int = 1) -> None:
        super().__init__(store_type)
        self._kv, self._n, self._wait_all = kv, num_servers, wait_all
        self._staleness = staleness
        self._sync = "async" not in store_type
        self._workers = num_workers
        #: True while this worker is in ``kv.join``: its caches are not used (in
        #: dist_sync the others' rounds close without its pushes meanwhile)
        self.joining = False
        #: key -> its hot-row cache (kv.set_table_cache; docs/embeddings.md C1-C7)
        self.caches: dict[Key, RowCache] = {}
        #: key -> its ps_key (the same on every server)
        self.pskeys: dict[Key, int] = {}
        #: the optimizer this worker gave ``set_optimizer`` (a table init checks it)
        self.optimizer: Any = None
        #: (IDs, split) of the last ``_split``: a push of the IDs just looked up reuses it
        self._last_split: tuple[np.ndarray, list[np.ndarray]] | None = None

    def _table(self, spec: TableSpec, key: Key) -> TableKey:  # type: ignore[override]
        """What this worker holds of table ``key``: its spec (the rows live on the
        servers, each checking its shard against PSKV_MAX_KEY_BYTES); its calls' arguments
        are checked with the table's own check functions."""
        if not isinstance(spec, TableSpec):
            raise UnsupportedError(f"table {key!r} needs a pskv.table.TableSpec, got "
                                   f"{type(spec).__name__}.", key=key)
        return TableKey(spec, key)

    def send_init(self, key: Key, pk: int, spec: TableSpec) -> None:
        """Init table ``key`` on every server (worker 0 does, after the workers agreed)."""
        dim = spec.dim
        tss = [self._kv.request(s, Command.INIT, [pk], {"entries": [{
            "key": key, "shape": [0, dim], "stype": "table", "table": spec.to_json(),
            "shard": [s, self._n], "lineage": new_lineage()}]},
            [np.zeros((0, dim), spec.state_dtype)])
            for s in range(self._n)]
        self._wait_all(tss, "the servers to take init")

    def _split(self, ids: np.ndarray) -> list[np.ndarray]:
        """For each server, the positions in ``ids`` of the IDs it owns (in order).

        The split of the last call is kept with a copy of its IDs: a training step looks
        up a batch and then pushes the gradients of the same IDs, and the push finds its
        split by comparing the IDs (one pass) instead of hashing them again."""
        if self._n == 1:
            return [np.arange(ids.size)]
        last = self._last_split
        if last is not None and last[0].shape == ids.shape and np.array_equal(last[0], ids):
            return last[1]
        owner = shard_of(ids, self._n)
        if self._n <= 16:       # one pass per server beats a sort of the owners
            where = [np.flatnonzero(owner == s) for s in range(self._n)]
        else:
            order = np.argsort(owner, kind="stable")
            bounds = np.searchsorted(owner[order], np.arange(self._n + 1))
            where = [order[bounds[s]:bounds[s + 1]] for s in range(self._n)]
        self._last_split = (ids.copy(), where)
        return where

    def push(self, key: Any, value: Any, updater: Any = None) -> None:
        """One push ``(ids, grads)`` (or a RowSparseNDArray of IDs, or a list: one per
        device) of table ``key``: checked whole, then one message per server."""
        table = self.get(key, "push to table")
        ids, grads = _pairs(key, value)
        flat = check_ids(key, ids, "push").ravel()
        g = check_grads(table.spec, key, flat, grads, "push")
        g = np.ascontiguousarray(g, dtype=table.spec.state_dtype)    # the compute dtype
        pk = self.pskeys[key]
        for s, where in enumerate(self._split(flat)):
            part = (flat, g) if self._n == 1 else (flat[where], g[where])
            self._kv.push(s, Command.PUSH, [pk], {"kinds": "t"}, list(part))
        cache = self.caches.get(key)
        if cache is not None:       # every held row is one push call older (C3)
            cache.pushed()

    def set_cache(self, key: Any, rows: Any, max_pushes: Any, max_seconds: Any,
                  dense: Any) -> tuple[int, int | None, float | None]:
        """``kv.set_table_cache``: checked (C1), then a new, empty cache (or none)."""
        n, k, t = super().set_cache(key, rows, max_pushes, max_seconds, dense)
        self.caches.pop(key, None)
        if n:
            spec = self.tables[key].spec
            self.caches[key] = RowCache(n, spec.dim, spec.state_dtype, k, t)   # widened rows
        return n, k, t

    def cache_stats(self, key: Any) -> dict[str, int]:
        """The counters of this worker's cache of table ``key`` (all 0: none)."""
        base = super().cache_stats(key)
        cache = self.caches.get(key)
        return base if cache is None else cache.stats()

    def clear_caches(self) -> None:
        """Drop every cached row (a checkpoint was loaded, C7)."""
        for cache in self.caches.values():
            cache.clear()

    def lookup(self, key: Any, ids: Any, train: bool) -> tuple[np.ndarray, np.ndarray]:
        """``(values, found)`` of ``ids`` (any shape): rows the hot-row cache may serve
        (C2), the others from the servers that own them."""
        table = self.get(key, "lookup")
        arr = check_ids(key, ids, "lookup")
        flat = np.ascontiguousarray(arr.ravel())
        cache = self.caches.get(key)
        if cache is None or self.joining:
            values, found = self._fetch(key, table.spec, flat, train)
        else:
            values, found = self._cached(key, table.spec, cache, flat, train)
        dim = table.spec.dim
        return values.reshape(arr.shape + (dim,)), found.reshape(arr.shape)

    def _cached(self, key: Any, spec: TableSpec, cache: RowCache, flat: np.ndarray,
                train: bool) -> tuple[np.ndarray, np.ndarray]:
        """A lookup through ``cache``: the rows it may serve (C2, C3), the others asked
        of the servers and offered to it (C6). Bound 0 in ``dist_async`` with several
        workers: every server's table step is asked before the rows on each link, and a
        held row is served only if its owner's step is the one it was fetched at (else
        asked again)."""
        k = cache.bound(self._staleness())
        exact = k == 0 and not self._sync and self._workers > 1
        hit, slots = cache.get(flat, self._staleness())
        values = np.empty((flat.size, spec.dim), spec.state_dtype)
        found = np.ones(flat.size, bool)
        # read what is held now: the store lock is let go while the servers answer, and
        # another thread's lookup may reuse a slot meanwhile
        cache.fill(values, hit, slots)
        held = cache.versions_of(slots, hit) if exact else None
        steps_ts = self._ask_steps(key) if exact else []
        stamp = cache.stamp()
        miss = np.flatnonzero(~hit)
        if miss.size:
            asked = flat[miss]
            got, got_found = self._fetch(key, spec, asked, train)
            values[miss], found[miss] = got, got_found
        if held is not None:
            steps = self._steps(key, steps_ts)
            owner_steps = steps[shard_of(flat, self._n)] if self._n > 1 else \
                np.full(flat.size, steps[0])
            again = cache.current(hit, held, owner_steps)
            if again.size:      # pushed since they were fetched: asked again
                got2, found2 = self._fetch(key, spec, flat[again], train)
                values[again], found[again] = got2, found2
                cache.offer(flat[again], got2, found2, stamp, owner_steps[again])
            if miss.size:
                cache.offer(asked, got, got_found, stamp, owner_steps[miss])
        elif miss.size:
            cache.offer(asked, got, got_found, stamp)
        return values, found

    def _ask_steps(self, key: Any) -> list[int]:
        """Ask every server its step of table ``key`` (sent before the lookup that
        follows on the same link, so it is at most the step the lookup reads at)."""
        body = command(Op.TABLE_STATS, key=self.pskeys[key])
        return [self._kv.request(s, Command.COMMAND, body=body) for s in range(self._n)]

    def _steps(self, key: Any, tss: list[int]) -> np.ndarray:
        """The replies of :meth:`_ask_steps`: each server's step."""
        out = np.empty(self._n, np.int64)
        for s, (meta, _a) in enumerate(self._wait_all(tss, f"the steps of table {key!r}")):
            got = meta.body.get("stats") if isinstance(meta.body, dict) else None
            if not isinstance(got, dict) or not isinstance(got.get("step"), int):
                raise ClusterError(f"server {s} sent no step of table {key!r} (reported by "
                                   f"server {s})", key=key)
            out[s] = got["step"]
        return out

    def _fetch(self, key: Any, spec: TableSpec, flat: np.ndarray,
               train: bool) -> tuple[np.ndarray, np.ndarray]:
        """``(values, found)`` of the 1-d IDs ``flat`` from the servers that own them."""
        dim, dtype = spec.dim, spec.state_dtype   # rows travel widened (R17)
        values = np.empty((flat.size, dim), dtype)
        found = np.zeros(flat.size, bool)
        body = command(Op.LOOKUP, key=self.pskeys[key], train=bool(train))
        asks = [(s, where) for s, where in enumerate(self._split(flat)) if where.size]
        one = self._n == 1          # its reply is read straight into values and found
        tss = [self._kv.request(s, Command.COMMAND, body=body,
                                arrays=[flat if one else flat[where]],
                                into=[values, found] if one else None)
               for s, where in asks]
        replies = self._wait_all(tss, f"a lookup of table {key!r}")
        for (s, where), (_meta, got) in zip(asks, replies):
            if len(got) != 2 or got[0].shape != (where.size, dim) or got[1].shape != where.shape:
                raise ClusterError(f"server {s} answered a lookup of table {key!r} with "
                                   f"{[a.shape for a in got]} for {where.size} IDs (reported "
                                   f"by server {s})", key=key)
            if one:
                if got[0] is not values:        # a transport that could not read in place
                    values[...] = got[0]
                if got[1] is not found:
                    found[...] = got[1]
                continue
            values[where] = got[0]
            found[where] = got[1]
        return values, found

    def stats(self, key: Any) -> dict[str, int]:
        """The counters of table ``key``, summed over the servers (``step``: the largest)."""
        self.get(key, "read the stats of")
        body = command(Op.TABLE_STATS, key=self.pskeys[key])
        tss = [self._kv.request(s, Command.COMMAND, body=body) for s in range(self._n)]
        total: dict[str, int] = {}
        for s, (meta, _a) in enumerate(self._wait_all(tss, f"the stats of table {key!r}")):
            got = meta.body.get("stats") if isinstance(meta.body, dict) else None
            if not isinstance(got, dict):
                raise ClusterError(f"server {s} sent no stats of table {key!r} (reported by "
                                   f"server {s})", key=key)
            for k, v in got.items():
                if k == "version":          # per shard: table_versions
                    continue
                total[k] = max(total.get(k, 0), int(v)) if k == "step" else \
                    total.get(k, 0) + int(v)
        return total

    def explain(self, key: Any, ident: int) -> dict[str, Any]:
        """What the server owning ID ``ident`` (R13) knows of it (``Op.EXPLAIN``)."""
        self.get(key, "explain an ID of")
        s = int(shard_of(np.array([ident], np.int64), self._n)[0])
        ts = self._kv.request(s, Command.COMMAND,
                              body=command(Op.EXPLAIN, key=self.pskeys[key], id=ident))
        (meta, _a), = self._wait_all([ts], f"an explanation of table {key!r}")
        got = meta.body.get("explain") if isinstance(meta.body, dict) else None
        if not isinstance(got, dict):
            raise ClusterError(f"server {s} sent no explanation of table {key!r} (reported "
                               f"by server {s})", key=key)
        return got

    def hot(self, key: Any, k: int) -> list[tuple[int, int]]:
        """Every server's ``k`` hottest IDs of table ``key``, merged (``Op.HOT_IDS``)."""
        self.get(key, "read the hot IDs of")
        body = command(Op.HOT_IDS, key=self.pskeys[key], k=k)
        tss = [self._kv.request(s, Command.COMMAND, body=body) for s in range(self._n)]
        got: list[tuple[int, int]] = []
        for s, (meta, _a) in enumerate(self._wait_all(tss, f"the hot IDs of table {key!r}")):
            hot = meta.body.get("hot") if isinstance(meta.body, dict) else None
            if not isinstance(hot, list) or not all(
                    isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
                    for p in hot):
                raise ClusterError(f"server {s} sent no hot IDs of table {key!r} (reported "
                                   f"by server {s})", key=key)
            got.extend((int(i), int(c)) for i, c in hot)
        return sorted(got, key=lambda p: (-p[1], p[0]))[:k]

    def num_shards(self, key: Any) -> int:
        """How many shards table ``key`` is cut into: one per server (R13)."""
        self.get(key, "subscribe to")
        return self._n

    def versions(self, key: Any) -> list[int]:
        """Each server's version of table ``key`` (E1)."""
        self.get(key, "read the versions of")
        body = command(Op.TABLE_STATS, key=self.pskeys[key])
        tss = [self._kv.request(s, Command.COMMAND, body=body) for s in range(self._n)]
        out = []
        for s, (meta, _a) in enumerate(self._wait_all(tss, f"the versions of table {key!r}")):
            got = meta.body.get("stats") if isinstance(meta.body, dict) else None
            if not isinstance(got, dict) or type(got.get("version")) is not int:
                raise ClusterError(f"server {s} sent no version of table {key!r} (reported "
                                   f"by server {s})", key=key)
            out.append(got["version"])
        return out

    def fetch(self, key: Any, raw: bool, max_rows: int) -> Any:
        """``fetch(shard, since, lineage, cursor, upto)``: a page of table ``key``'s change
        stream from the server serving ``shard`` (``Op.CHANGES``; ``Subscription``)."""
        spec = self.get(key, "subscribe to").spec
        return lambda shard, since, lineage, cursor, upto: ask_changes(
            self._kv, self._wait_all, key, self.pskeys[key], spec, shard, self._n, since,
            lineage, cursor, upto, max_rows, raw)

    def row_sparse_pull(self, key: Any, out: Any, row_ids: Any) -> None:
        """Training lookup of ``row_ids`` into row_sparse ``out`` (a list: one each)."""
        table = self.get(key, "row_sparse_pull from table")
        outs, rows = rsp_outs(key, table, out, row_ids)
        ids = [np.unique(check_ids(key, as_numpy(r), "row_sparse_pull")) for r in rows]
        for o, r in zip(outs, ids):
            values, _found = self.lookup(key, r, True)
            o._data = values.astype(o.dtype, copy=False)
            o._indices = r
            o._full_shape = (max(o.shape[0], 1), table.spec.dim)


def ask_changes(kv: Any, wait_all: Any, key: Any, pskey: int, spec: TableSpec | None,
                shard: int, n: int, since: int, lineage: str | None, cursor: int,
                upto: int | None, max_rows: int, raw: bool, dim: int | None = None,
                dtype: Any = None) -> ChangeBatch:
    """One page of shard ``shard``'s change stream of table ``key`` through ``kv`` (a
    KVWorker, or a reader's link), its answer checked (``Op.CHANGES``) against ``spec``
    (a reader that knows none: ``dim`` and ``dtype`` if given, else the reply's own)."""
    body = command(Op.CHANGES, key=pskey, since=int(since), lineage=lineage,
                   cursor=int(cursor), upto=upto, max_rows=int(max_rows), raw=bool(raw))
    ts = kv.request(shard, Command.COMMAND, body=body)
    (meta, got), = wait_all([ts], f"the changes of table {key!r}")
    b = meta.body if isinstance(meta.body, dict) else {}
    if spec is not None:
        dim, dtype = spec.dim, spec.storage if raw else np.float32
    if dim is None:
        dim = b.get("dim")
    if dtype is None:
        dtype = b.get("dtype") if raw else np.float32
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        dtype = None
    ok = type(dim) is int and dim > 0 and dtype is not None and \
        dtype.name in ("float32", "float16", "uint16") and len(got) == 4 and isinstance(b.get("lineage"), str) and \
        type(b.get("version")) is int and isinstance(b.get("reset"), bool) and \
        (b.get("cursor") is None or type(b.get("cursor")) is int)
    if ok:
        removed, reasons, ids, rows = got
        ok = removed.ndim == 1 and removed.dtype == np.int64 and \
            reasons.shape == removed.shape and ids.ndim == 1 and ids.dtype == np.int64 and \
            rows.shape == (ids.size, dim) and rows.dtype == dtype
    if not ok:
        raise ClusterError(f"server {shard} answered a read of table {key!r}'s changes "
                           f"with {b!r} and {[(a.shape, a.dtype.str) for a in got]} (reported "
                           f"by server {shard})", key=key)
    return ChangeBatch(key=key, shard=shard, num_shards=n, lineage=b["lineage"],
                       version=b["version"], reset=b["reset"], removed=removed,
                       ids=ids, rows=rows, reasons=reasons.astype(np.uint8, copy=False),
                       cursor=b["cursor"])


def init_table(store: Any, key: Any, spec: TableSpec) -> None:
    """``kv.init(key, TableSpec)`` of dist store ``store``: collective; every worker's spec
    must agree (compared as JSON at a barrier), worker 0 inits the key on every server."""
    with store._collective_lock, store._lock:
        store._begin()
        mine: list[Any] = []
        error: KVStoreError | None = None
        added = False
        try:
            k = check_key(key)
            mine = [[ps_key(k), k, "table", spec.to_json()]]
            init_spec(k, np.zeros(0), store._by_pskey)      # a ps_key clash raises
            store._tables.init(k, spec, store._keys)   # checks; then holds a checker
            added = True
            if store._tables.optimizer is not None:   # one it cannot run: refused now
                check_optimizer(spec, k, store._tables.optimizer)
        except KVStoreError as err:
            error = err
        why = None if error is None else f"{type(error).__name__}: {error}"
        try:
            payloads = {} if store._po.rejoin else \
                store._collective("init", {"specs": mine, "error": why})
            if error is not None:
                raise error
            if not store._po.rejoin:
                check_agreement(payloads, mine, store.rank)
                failed = None
                if store.rank == 0:
                    try:
                        store._tables.send_init(k, mine[0][0], spec)
                    except KVStoreError as err:        # every worker raises it, alike
                        failed = error_body(err)
                done = store._collective("init (values sent)", {"error": failed})
                if (done.get("0") or {}).get("error"):
                    raise error_from_body(done["0"]["error"], "worker 0")
        except KVStoreError:
            if added:
                store._tables.tables.pop(k, None)
            raise
        store._tables.pskeys[k] = mine[0][0]
        store._by_pskey[mine[0][0]] = k
