"""DynamicTable: one embedding table keyed by raw int64 IDs, with no sockets and no threads.

Its owner (a local store, later a server's engine) calls :meth:`DynamicTable.lookup`,
:meth:`~DynamicTable.push`, :meth:`~DynamicTable.assign` and a bounded
:meth:`~DynamicTable.sweep`; docs/embeddings.md is the specification (rules R1-R17).
Invariants: a live row has exactly one slot and one index entry; ``_live[slot]`` marks
them; slots ``>= _top`` were never used, freed slots wait in ``_free``; every method
checks all of its input before it changes anything.

Over 500 lines because DynamicTable is one class whose admission, eviction and row-
optimizer steps share the index and the row arrays (docs/embeddings.md R1-R14 in one
place).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import numpy as np

from ..errors import ShapeMismatchError, UnsupportedError
from ._halves import HALVES, narrow, widen
from ._hash import SALT_ADMIT, SALT_COUNT, SALT_INIT, salted, uniform01
from ._index import IdIndex
from ._rowopt import RowOptimizer, row_optimizer
from ._hot import HotIds
from ._stream import REASONS, TombLog, new_lineage
from ._checks import check_grads, check_ids
from .spec import (Capacity, Constant, CountAdmission, Normal, ProbabilityAdmission, ReadOnly,
                   RowMeta, TableSpec, Uniform, now)

__all__ = ["DynamicTable", "initial_values"]

#: the counters :meth:`DynamicTable.stats` reports besides ``rows`` and ``step`` (R14)
COUNTERS = ("lookups", "misses", "inserts", "refusals", "evicted_ttl", "evicted_capacity",
            "dropped_pushes", "pushed_rows", "evicted_score", "unknown_reads")
#: the most slots a table remembers the versions of (``changed_slots``): 8 MiB
MARKED_SLOTS = 1 << 20
#: how a row was born (``kv.explain``'s ``born_by``), by the code a row keeps
BIRTHS = ("pull", "push", "assign", "restore", "replicated", "checkpoint")


def initial_values(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The initial rows of ``ids`` (R2): a function of (seed, ID, column) only, in the
    table's compute dtype (``spec.state_dtype``): a half table's rounded to its storage
    dtype, then widened (R17), as a lookup reads them."""
    out = initial_stored(spec, ids)
    return widen(out, spec.dtype, spec.state_dtype) if spec.dtype in HALVES else out


def initial_stored(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The initial rows of ``ids`` as stored: computed in the compute dtype, then rounded
    to the storage dtype (nearest even) for a half table."""
    out = _initial(spec, ids)
    return narrow(out, spec.dtype) if spec.dtype in HALVES else out


def _initial(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    n, d = ids.shape[0], spec.dim
    init = spec.init
    if isinstance(init, Constant):
        return np.full((n, d), init.value, spec.state_dtype)
    if not isinstance(init, (Uniform, Normal)):
        return np.zeros((n, d), spec.state_dtype)
    cols = 2 * d if isinstance(init, Normal) else d
    base = salted(ids, spec.seed, SALT_INIT)
    with np.errstate(over="ignore"):
        ctr = np.arange(1, cols + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    u = uniform01(salted((base[:, None] ^ ctr[None, :]).view(np.int64).ravel())).reshape(n, cols)
    if isinstance(init, Uniform):
        out = init.low + (init.high - init.low) * u
    else:   # Box-Muller on two uniforms per element
        r = np.sqrt(-2.0 * np.log1p(-u[:, :d]))
        out = init.mean + init.std * r * np.cos(2.0 * np.pi * u[:, d:])
    return out.astype(spec.state_dtype)


#: lookups a table remembers (IDs and slots) for the push of the same IDs, and at most
#: how many IDs they hold together (:meth:`DynamicTable._known_slots`)
_RECENT_LOOKUPS = 8
_RECENT_IDS = 1 << 20

#: rows per ``np.add.reduceat`` call in :func:`_reduceat_rows` (a block that stays in cache)
_RUN_BLOCK_ROWS = 2048


def _reduceat_rows(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``np.add.reduceat(rows, starts, axis=0)`` (``starts`` sorted, ``starts[0] == 0``),
    the same bits, in blocks of about ``_RUN_BLOCK_ROWS`` rows cut at run starts: one call
    over a (n, d) array several times the cache's size is 3x slower here (8192 x 64
    float32: 3.6 ms against 1.2 ms) than calls over blocks."""
    n = rows.shape[0]
    if n <= 2 * _RUN_BLOCK_ROWS:
        return np.add.reduceat(rows, starts, axis=0)
    out = np.empty((starts.size,) + rows.shape[1:], rows.dtype)
    cuts = np.unique(np.append(np.searchsorted(starts, np.arange(0, n, _RUN_BLOCK_ROWS)),
                               starts.size))
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        lo = int(starts[a])
        hi = int(starts[b]) if b < starts.size else n
        np.add.reduceat(rows[lo:hi], starts[a:b] - lo, axis=0, out=out[a:b])
    return out


def _sum_runs(g: np.ndarray, order: np.ndarray, starts: np.ndarray,
              dtype: Any) -> np.ndarray:
    """The sum of each run of rows ``g[order]`` (runs start at ``starts``), each row cast
    to ``dtype`` first: the bits of ``np.add.reduceat(g[order].astype(dtype), starts)``.

    A run of one row is that row: only the rows of longer runs go through reduceat, whose
    cost is mostly per run (a Zipf batch of 4096 IDs has some 2000 runs, most of one row:
    0.55 ms as one reduceat, 0.29 ms so)."""
    n = order.size
    counts = np.diff(np.append(starts, n))
    multi = np.flatnonzero(counts > 1)
    out = np.asarray(g[order[starts]], dtype=dtype)
    if multi.size:
        mc = counts[multi]
        offs = np.cumsum(mc) - mc            # where each long run starts among their rows
        rows = np.repeat(starts[multi] - offs, mc) + np.arange(int(offs[-1] + mc[-1]))
        out[multi] = _reduceat_rows(np.asarray(g[order[rows]], dtype=dtype), offs)
    return out


class DynamicTable:
    """A growing embedding table: rows keyed by int64 IDs, admission, eviction, counters.

    Parameters
    ----------
    spec : TableSpec
        What the table is.
    name : str or int
        The table's name in error messages (the store's key).
    clock : callable, optional
        Seconds for TTL in seconds (default ``time.monotonic``); tests pass a fake one.

    Examples
    --------
    >>> import numpy as np
    >>> from pskv.table import DynamicTable, TableSpec, Constant
    >>> t = DynamicTable(TableSpec(dim=2, init=Constant(0.5)), name='emb')
    >>> values, found = t.lookup(np.array([7, -1, 7]))
    >>> values.tolist(), found.tolist(), len(t)
    ([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], [True, True, True], 2)
    >>> t.push(np.array([7, 7]), np.ones((2, 2), np.float32))     # no optimizer: assign
    >>> t.lookup(np.array([7]), train=False)[0].tolist()
    [[2.0, 2.0]]
    """

    def __init__(self, spec: TableSpec, name: Any = "table",
                 clock: Callable[[], float] = now) -> None:
        if not isinstance(spec, TableSpec):
            raise UnsupportedError(f"table {name!r} needs a pskv.table.TableSpec, got "
                                   f"{type(spec).__name__}.", key=name)
        self.spec, self.name, self._clock = spec, name, clock
        self.step = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        cap = max(int(spec.reserve_rows), 64)
        self._index = IdIndex(spec.reserve_rows)
        #: the rows in the storage dtype (R17: uint16 bit patterns for bfloat16)
        self._values = np.empty((cap, spec.dim), spec.storage)
        #: rows are stored narrower than computed (a float16 or bfloat16 table)
        self._half = spec.dtype in HALVES
        self._ids = np.empty(cap, np.int64)
        self._count = np.empty(cap, np.int64)
        self._last_step = np.empty(cap, np.int64)
        self._last_seconds = np.empty(cap, np.float64)
        self._live = np.zeros(cap, bool)
        self._top = 0
        self._free = np.empty(0, np.int64)
        self._cursor = 0
        self._rowopt: RowOptimizer | None = None
        #: (IDs, slots) of recent lookups, oldest first; emptied by every eviction
        self._recent: list[tuple[np.ndarray, np.ndarray]] = []
        self._states: list[np.ndarray] = []
        self._t: np.ndarray | None = None
        adm = spec.admission
        self._sightings = np.zeros(adm.counters, np.int32) \
            if isinstance(adm, CountAdmission) else None
        # the change stream (E1-E10, ``_stream``): the version of each slot's last change,
        # the table's version and history, the IDs it removed
        self._changed = np.zeros(cap, np.int64)
        #: each row's birth: the table step then, and how (an index of ``BIRTHS``)
        self._born_step = np.zeros(cap, np.int64)
        self._born_how = np.zeros(cap, np.uint8)
        #: how the rows the running operation inserts are born
        self._how = 0
        #: the IDs looked up most (H1-H3)
        self.hot = HotIds()
        self.version = 0
        self.lineage = new_lineage()
        self.tombs = TombLog()
        #: a change of the running operation is stamped ``version + 1``; the operation
        #: ends with :meth:`_commit` (one version per operation, E1)
        self._dirty = False
        #: the slots each recent version changed (``changed_slots``), and those of the
        #: running operation
        self._pending: list[np.ndarray] = []
        self._marks: deque[tuple[int, np.ndarray]] = deque()
        self._marked = 0
        self._marks_floor = 0
        #: why the slots :meth:`_evict` removes go (an index of ``REASONS``)
        self._why = 0
        #: who read this table's stream: reader -> (version read to, time.time() then)
        self.readers: dict[Any, tuple[int, float]] = {}

    # ---- sizes -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._index.size

    def __repr__(self) -> str:
        return f"<DynamicTable {self.name!r} rows={len(self)} dim={self.spec.dim}>"

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (their pages are committed as rows are used)."""
        return int(self._values.shape[0])

    def nbytes(self) -> dict[str, int]:
        """Bytes of the arrays in use: rows, optimizer states, IDs, metadata, index,
        admission counters, and the recent lookups kept for the pushes that follow."""
        top = self._top
        per = lambda a: int(a[:top].nbytes)  # noqa: E731
        return {"values": per(self._values), "states": sum(per(s) for s in self._states)
                + (per(self._t) if self._t is not None else 0), "ids": per(self._ids),
                "meta": per(self._count) + per(self._last_step) + per(self._last_seconds)
                + per(self._live) + per(self._changed) + per(self._born_step)
                + per(self._born_how) + self.hot.nbytes(), "index": self._index.nbytes,
                "admission": 0 if self._sightings is None else int(self._sightings.nbytes),
                "recent": sum(int(i.nbytes + s.nbytes) for i, s in self._recent)}

    # ---- storage dtype (R17) -----------------------------------------------------------
    def _read(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows in the compute dtype (exact)."""
        return widen(stored, self.spec.dtype, self.spec.state_dtype) if self._half else stored

    def _store(self, values: np.ndarray) -> np.ndarray:
        """Rows in the compute dtype as stored: rounded to nearest even for a half table."""
        return narrow(values, self.spec.dtype) if self._half else values

    def _from_saved(self, values: Any) -> np.ndarray:
        """Rows a state or a changes record holds, as stored: their bits as they are when
        they come in the storage dtype, else rounded to it."""
        v = np.asarray(values)
        return v if v.dtype == self.spec.storage else self._store(v)

    def ids(self) -> np.ndarray:
        """The IDs that have a row, sorted."""
        return np.sort(self._ids[np.flatnonzero(self._live[:self._top])])

    # ---- checks ------------------------------------------------------------------------
    def _check_ids(self, ids: Any, what: str) -> np.ndarray:
        return check_ids(self.name, ids, what)

    def _check_grads(self, ids: np.ndarray, grads: Any, what: str) -> np.ndarray:
        return check_grads(self.spec, self.name, ids, grads, what)

    # ---- lookups -----------------------------------------------------------------------
    def lookup(self, ids: Any, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Read the rows of ``ids`` (any shape): ``(values, found)``.

        A training lookup may insert rows (``birth='pull'``, R3, R9) and marks the rows
        used (R10); an eval lookup (``train=False``) changes nothing but counters (R5).
        ``values`` has shape ``ids.shape + (dim,)``; ``found`` is True where a stored row
        was read (R6), False where the unknown value was (R4).
        """
        arr = self._check_ids(ids, "lookup")
        flat = arr.ravel()
        slots = self._index.find(flat)
        found = slots >= 0
        nfound = int(np.count_nonzero(found))
        self.counters["lookups"] += flat.size
        self.counters["misses"] += flat.size - nfound
        if train and nfound < flat.size and self.spec.birth == "pull":
            miss = ~found
            born = self._admit(np.unique(flat[miss]))
            if born.size:
                self._insert(born)
                slots[miss] = self._index.find(flat[miss])
                found = slots >= 0
                nfound = int(np.count_nonzero(found))
        self.counters["unknown_reads"] += flat.size - nfound
        self.hot.add(flat)
        if nfound == flat.size:
            out = self._read(np.take(self._values, slots, axis=0))
        else:
            out = np.empty((flat.size, self.spec.dim), self.spec.state_dtype)
            hit = np.flatnonzero(found)
            out[hit] = self._read(self._values[slots[hit]])
            lost = np.flatnonzero(~found)
            out[lost] = self._unknown(flat[lost])
        if train and nfound:
            self._touch(slots[found] if nfound < flat.size else slots)
        self._remember(flat, slots)
        self._commit()
        return out.reshape(arr.shape + (self.spec.dim,)), found.reshape(arr.shape)

    def _remember(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Keep a copy of a lookup's IDs with their slots (-1: none) for a later push."""
        if not 0 < ids.size <= _RECENT_IDS:
            return
        self._recent.append((ids.copy(), slots))
        held = sum(r[0].size for r in self._recent)
        while len(self._recent) > _RECENT_LOOKUPS or held > _RECENT_IDS:
            held -= self._recent.pop(0)[0].size

    def _known_slots(self, ids: np.ndarray) -> np.ndarray | None:
        """The slots of ``ids`` as recent lookups found them, or None.

        A training step looks its IDs up and then pushes them: a local store pushes the
        IDs it looked up, a server's sync round pushes the concatenation of the workers'
        (each the IDs of one lookup). ``ids`` is matched as a sequence of remembered
        lookups (any such split gives the same slots: a slot is a function of the ID while
        no row is evicted, and every eviction forgets them all); -1 where a lookup found
        no row (the caller looks those up again: a row may have been born since)."""
        if not self._recent or not ids.size:
            return None
        got: list[np.ndarray] = []
        pos, n = 0, ids.size
        while pos < n:
            for rid, rslots in reversed(self._recent):
                m = rid.size
                if m <= n - pos and rid[0] == ids[pos] and np.array_equal(rid, ids[pos:pos + m]):
                    got.append(rslots)
                    pos += m
                    break
            else:
                return None
        return got[0] if len(got) == 1 else np.concatenate(got)

    def _unknown(self, ids: np.ndarray) -> np.ndarray:
        if self.spec.unknown == "zeros":
            return np.zeros((ids.size, self.spec.dim), self.spec.state_dtype)
        return initial_values(self.spec, ids)

    def _touch(self, slots: np.ndarray) -> None:
        self._count[slots] += 1
        self._last_step[slots] = self.step
        self._last_seconds[slots] = self._clock()

    # ---- admission and inserts -----------------------------------------------------------
    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """The unknown, unique ``ids`` admission lets in now (R9); counts refusals."""
        adm = self.spec.admission
        if isinstance(adm, ReadOnly):
            ok = np.zeros(ids.size, bool)
        elif isinstance(adm, CountAdmission):
            assert self._sightings is not None
            cells = (salted(ids, SALT_COUNT) % np.uint64(adm.counters)).astype(np.int64)
            np.add.at(self._sightings, cells, 1)
            np.minimum(self._sightings, np.int32(2**31 - 2), out=self._sightings)
            ok = self._sightings[cells] >= adm.min_count
        elif isinstance(adm, ProbabilityAdmission):
            words = (self.spec.seed, SALT_ADMIT, self.step) if adm.per_step else \
                (self.spec.seed, SALT_ADMIT)
            ok = uniform01(salted(ids, *words)) < adm.p
        else:
            return ids
        self.counters["refusals"] += int(ids.size - np.count_nonzero(ok))
        return ids[ok]

    def _insert(self, ids: np.ndarray, values: np.ndarray | None = None,
                stored: np.ndarray | None = None) -> np.ndarray:
        """Give each unique, absent ID a slot and its initial value (or ``values``, in the
        compute dtype, or ``stored``, in the storage dtype: taken bit for bit)."""
        n = ids.size
        slots = self._alloc(n)
        self._ids[slots] = ids
        self._values[slots] = stored if stored is not None else \
            initial_stored(self.spec, ids) if values is None else self._store(values)
        self._count[slots] = 0
        self._last_step[slots] = self.step
        self._last_seconds[slots] = self._clock()
        self._live[slots] = True
        self._born_step[slots] = self.step
        self._born_how[slots] = self._how
        self._mark(slots)
        for s in self._states:
            s[slots] = 0
        if self._t is not None:
            self._t[slots] = 0
        self._index.insert(ids, slots)
        self.counters["inserts"] += n
        return slots

    def _alloc(self, n: int) -> np.ndarray:
        reuse = self._free[-n:] if n else self._free[:0]
        self._free = self._free[:self._free.size - reuse.size]
        more = n - reuse.size
        if self._top + more > self.capacity_rows:
            self._grow(max(self._top + more, self.capacity_rows * 3 // 2))
        fresh = np.arange(self._top, self._top + more, dtype=np.int64)
        self._top += more
        return np.concatenate([reuse, fresh]) if reuse.size else fresh

    def _grow(self, cap: int) -> None:
        def bigger(a: np.ndarray) -> np.ndarray:
            b = np.empty((cap,) + a.shape[1:], a.dtype)
            b[:self._top] = a[:self._top]
            return b
        self._values, self._ids, self._count = (bigger(a) for a in
                                                (self._values, self._ids, self._count))
        self._last_step, self._last_seconds = bigger(self._last_step), bigger(self._last_seconds)
        self._changed = bigger(self._changed)
        self._born_step, self._born_how = bigger(self._born_step), bigger(self._born_how)
        live = np.zeros(cap, bool)
        live[:self._top] = self._live[:self._top]
        self._live = live
        self._states = [bigger(s) for s in self._states]
        if self._t is not None:
            self._t = bigger(self._t)

    # ---- pushes ------------------------------------------------------------------------
    def _bind(self, opt: Any, key: Any = None) -> RowOptimizer:
        """The row optimizer for ``opt`` (its wd read under ``key``); (re)creates zero
        states when the layout changes."""
        rowopt = row_optimizer(opt, self.spec.state_layout, self.spec.dim, self.name, key)
        if self._rowopt is None or self._rowopt.signature != rowopt.signature:
            cap = self.capacity_rows
            self._states = [np.zeros((cap, w), self.spec.state_dtype) for w in rowopt.widths]
            self._t = np.zeros(cap, np.int64) if rowopt.per_row_step else None
            self._rowopt = rowopt
        return rowopt

    def _combine(self, ids: np.ndarray, g: np.ndarray, known: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Unique sorted IDs and the gradients of each, summed or averaged (R7); with
        ``known`` (a slot per ID), the slot of each unique ID too."""
        order = np.argsort(ids, kind="stable")
        s = ids[order]
        ks = None if known is None else known[order]
        if s.size < 2 or bool(np.all(s[1:] != s[:-1])):
            return s, np.asarray(g[order], dtype=self.spec.state_dtype), ks
        starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
        summed = _sum_runs(g, order, starts, self.spec.state_dtype)
        if self.spec.duplicates == "mean":
            counts = np.diff(np.append(starts, s.size))
            summed /= counts[:, None].astype(self.spec.state_dtype)
        return s[starts], summed, None if ks is None else ks[starts]

    def push(self, ids: Any, grads: Any, optimizer: Any = None, key: Any = None) -> None:
        """Apply one push (one step, R11): gradients through ``optimizer``'s row update.

        Parameters
        ----------
        ids : array_like of int
            One ID per gradient row; repeats combine by ``duplicates`` (R7).
        grads : array_like, shape ``(len(ids), dim)``
        optimizer : pskv.optimizer.Optimizer, optional
            The store's optimizer (R12); the spec's own ``optimizer`` is used instead when
            it has one. None (and none in the spec): assign the (combined) values.
        key : str or int, optional
            The index the optimizer counts updates under (default: the table's name).
        """
        arr = self._check_ids(ids, "push")
        if arr.ndim != 1:
            arr = arr.ravel()
        g = self._check_grads(arr, grads, "push")
        key = self.name if key is None else key
        if self.spec.optimizer is not None:     # the table's own row optimizer wins (R12)
            optimizer = self.spec.optimizer
        rowopt = None
        if optimizer is not None:     # refused here (wd too) before anything changes
            rowopt = self._bind(optimizer, key)
        uniq, summed, slots = self._combine(arr, g, self._known_slots(arr))
        if slots is None:
            slots = self._index.find(uniq)
        else:                   # found by this step's lookups; find the rest
            again = np.flatnonzero(slots < 0)
            if again.size:
                slots[again] = self._index.find(uniq[again])
        absent = slots < 0
        self._how = BIRTHS.index("push")
        if absent.any():
            if rowopt is None:                       # assign: every pushed ID gets its row
                slots[absent] = self._insert(uniq[absent], summed[absent])
                self._how = 0
                self._touch(slots)
                self.counters["pushed_rows"] += uniq.size
                self.step += 1
                self._values[slots] = self._store(summed)
                self._mark(slots)
                self._commit()
                return
            if self.spec.birth == "push":
                born = self._admit(uniq[absent])
                if born.size:
                    self._insert(born)
                    slots[absent] = self._index.find(uniq[absent])
            absent = slots < 0
            self._how = 0
            self.counters["dropped_pushes"] += int(np.count_nonzero(absent))
            keep = np.flatnonzero(~absent)
            slots, summed = slots[keep], summed[keep]
        self._how = 0
        self.counters["pushed_rows"] += slots.size
        if slots.size:
            if rowopt is None:
                self._values[slots] = self._store(summed)
            else:   # a half table's rows widened, updated, rounded back (R17)
                w = self._read(self._values[slots])
                states = [s[slots] for s in self._states]
                t = None
                if self._t is not None:
                    t = self._t[slots] + 1
                rowopt.update(optimizer, key, w, states, summed, t)
                self._values[slots] = self._store(w)
                for s, st in zip(self._states, states):
                    s[slots] = st
                if t is not None:
                    self._t[slots] = t      # type: ignore[index]
            self._touch(slots)
            self._mark(slots)
        self.step += 1
        self._commit()

    def assign(self, ids: Any, values: Any) -> None:
        """Set the rows of ``ids`` to ``values``, inserting absent ones whatever admission
        says (R9's ``ReadOnly`` tables are filled this way); not a step."""
        arr = self._check_ids(ids, "assign").ravel()
        v = self._check_grads(arr, values, "assign")
        uniq, first = np.unique(arr[::-1], return_index=True)    # the last value of an ID
        rows = self._store(np.asarray(v[::-1][first], dtype=self.spec.state_dtype))
        slots = self._index.find(uniq)
        absent = slots < 0
        if absent.any():
            self._how = BIRTHS.index("assign")
            slots[absent] = self._insert(uniq[absent], stored=rows[absent])
            self._how = 0
        self._values[slots] = rows
        self._mark(slots)
        self._commit()

    # ---- eviction ----------------------------------------------------------------------
    def sweep(self, max_rows: int | None = None) -> int:
        """Evict per the spec's eviction policies, examining at most ``max_rows`` slots
        (None: all) from a rotating cursor (R10). Returns the rows evicted."""
        cap, ttl = self.spec.capacity, self.spec.ttl
        if (cap is None and ttl is None) or self._top == 0:
            self._commit()
            return 0
        top = self._top
        if max_rows is None or max_rows >= top:
            window = np.arange(top, dtype=np.int64)
            self._cursor = 0
        else:
            start = self._cursor % top
            window = (start + np.arange(max(int(max_rows), 0), dtype=np.int64)) % top
            self._cursor = (start + int(max_rows)) % top
        window = window[self._live[window]]
        old = np.zeros(window.size, bool)
        if ttl is not None and window.size:
            if ttl.steps is not None:
                old |= self.step - self._last_step[window] > ttl.steps
            if ttl.seconds is not None:
                old |= self._clock() - self._last_seconds[window] > ttl.seconds
        expired, window = window[old], window[~old]
        victims = window[:0]
        over = len(self) - expired.size - cap.max_rows if cap is not None else 0
        if cap is not None and over > 0 and window.size:
            # scored before anything is evicted: a custom score that raises changes nothing
            score = self._scores(cap, window)
            victims = window[np.argsort(score, kind="stable")[:min(over, window.size)]]
        self._why = REASONS.index("ttl")
        self._evict(expired)
        self._why = REASONS.index("capacity" if cap is None or cap.score is None else "score")
        self._evict(victims)
        self._why = 0
        self._commit()
        self.counters["evicted_ttl"] += expired.size
        self.counters["evicted_capacity"] += victims.size
        if cap is not None and cap.score is not None:
            self.counters["evicted_score"] += victims.size
        return int(expired.size + victims.size)

    def _scores(self, cap: Capacity, slots: np.ndarray) -> np.ndarray:
        if cap.policy == "lru":     # rank by step, then seconds (exact at any step count)
            rank = np.empty(slots.size, np.float64)
            rank[np.lexsort((self._last_seconds[slots], self._last_step[slots]))] = \
                np.arange(slots.size, dtype=np.float64)
            return rank
        if cap.policy == "lfu":
            return self._count[slots].astype(np.float64)
        assert cap.score is not None
        meta = RowMeta(self._ids[slots].copy(), self._count[slots].copy(),
                       self._last_step[slots].copy(), self._last_seconds[slots].copy())
        score = np.asarray(cap.score(meta), dtype=np.float64)
        if score.shape != slots.shape:
            raise ShapeMismatchError(
                f"the eviction score of table {self.name!r} returned shape {score.shape} "
                f"for {slots.size} rows. Return one number per row of the RowMeta.",
                key=self.name, shape=score.shape)
        return score

    def _evict(self, slots: np.ndarray) -> None:
        if slots.size:
            self._recent.clear()     # a freed slot may go to another ID
            self.tombs.add(self.version + 1, self._ids[slots], self._why)
            self._dirty = True
        self._index.delete(self._ids[slots])
        self._live[slots] = False
        self._free = np.concatenate([self._free, slots])

    # ---- the change stream (E1-E10) ------------------------------------------------------
    def _mark(self, slots: np.ndarray) -> None:
        """Stamp ``slots`` as changed by the running operation (version + 1)."""
        self._changed[slots] = self.version + 1
        self._pending.append(np.array(slots, np.int64, copy=True).ravel())
        self._dirty = True

    def _commit(self) -> None:
        """End an operation: its changes, if any, make the next version (E1)."""
        if self._dirty:
            self.version += 1
            self._dirty = False
            self._log_marks()

    def _log_marks(self) -> None:
        """Remember which slots the version just made changed (a read of the changes
        since a recent version looks at those slots only, not the whole table), bounded
        to :data:`MARKED_SLOTS` slots: older versions are read by a scan."""
        if not self._pending:
            return
        slots = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        self._pending = []
        self._marks.append((self.version, slots))
        self._marked += slots.size
        while self._marked > MARKED_SLOTS and self._marks:
            v, old = self._marks.popleft()
            self._marked -= old.size
            self._marks_floor = v

    def _forget_marks(self) -> None:
        """The slots of past versions are unknown from here (a restore, a whole copy)."""
        self._pending, self._marks, self._marked = [], deque(), 0
        self._marks_floor = self.version

    def changed_slots(self, since: int, cursor: int) -> np.ndarray | None:
        """The slots (sorted, from ``cursor``) that may have changed after ``since``, or
        None when the log does not reach back there (then scan)."""
        if since < self._marks_floor:
            return None
        got = [s for v, s in self._marks if v > since]
        if not got:
            return np.empty(0, np.int64)
        slots = np.unique(np.concatenate(got))
        return slots[slots >= cursor] if cursor else slots

    def explain(self, ident: int) -> dict[str, Any]:
        """What this table knows of ID ``ident`` (``kv.explain``; docs/embeddings.md
        "Seeing into a table"): whether it has a row, when and how the row was born and
        by which admission, its last update and use, and its last removal still held."""
        ident = int(self._check_ids(np.array([ident]), "explain")[0])
        slot = int(self._index.find(np.array([ident], np.int64))[0])
        adm = self.spec.admission
        out: dict[str, Any] = {"id": ident, "present": slot >= 0,
                               "admission": type(adm).__name__ if adm is not None else
                               "Always", "step": self.step, "version": self.version}
        if slot >= 0:
            out.update(born_step=int(self._born_step[slot]),
                       born_by=BIRTHS[int(self._born_how[slot])],
                       last_used_step=int(self._last_step[slot]),
                       seconds_since_use=float(self._clock() - self._last_seconds[slot]),
                       uses=int(self._count[slot]),
                       last_change_version=int(self._changed[slot]))
        elif isinstance(adm, CountAdmission) and self._sightings is not None:
            cell = int((salted(np.array([ident], np.int64), SALT_COUNT)
                        % np.uint64(adm.counters))[0])
            seen = int(self._sightings[cell])
            out.update(sightings=seen, min_count=int(adm.min_count),
                       needs=max(0, int(adm.min_count) - seen))
        gone = self.tombs.last(ident)
        out["evicted"] = None if gone is None else {"version": gone[0], "reason": gone[1]}
        return out

    def changes_since(self, since: int = -1, lineage: str | None = None, **kw: Any) -> Any:
        """One page of what changed since ``(lineage, since)`` (a
        :class:`pskv.table.ChangeBatch`, ``pskv.table._stream.read_changes``)."""
        from ._stream import read_changes
        return read_changes(self, since, lineage, **kw)

    def stream_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """What a backup's copy needs to go on with this stream (E8): each live row's
        stamp and the tombstones, as arrays, and the lineage, version and floor."""
        live = np.flatnonzero(self._live[:self._top])
        return ({"changed_ids": self._ids[live], "changed_at": self._changed[live],
                 **self.tombs.arrays()},
                {"lineage": self.lineage, "version": self.version,
                 "floor": self.tombs.floor})

    def go_on_from(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Take over the stream :meth:`stream_state` described (a backup's whole copy):
        the same lineage, version, stamps and tombstones (E8)."""
        self.lineage = str(meta["lineage"])
        self.version = int(meta["version"])
        self._forget_marks()
        self.tombs = TombLog.from_arrays(arrays, int(meta.get("floor", 0)))
        ids = np.asarray(arrays.get("changed_ids", np.empty(0, np.int64)), np.int64)
        at = np.asarray(arrays.get("changed_at", np.empty(0, np.int64)), np.int64)
        if ids.shape == at.shape and ids.size:
            slots = self._index.find(ids)
            ok = slots >= 0
            self._changed[slots[ok]] = at[ok]

    # ---- counters ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The counters (R14): rows, step, lookups, misses, inserts, refusals, evictions
        (``evicted_ttl`` + ``evicted_capacity``), dropped_pushes, pushed_rows, and
        ``bytes``: the table's arrays in use (:meth:`nbytes`, all parts together)."""
        out = {"rows": len(self), "step": self.step, **self.counters}
        out["evictions"] = out["evicted_ttl"] + out["evicted_capacity"]
        out["bytes"] = sum(self.nbytes().values())
        return out

    # ---- state (R16) -------------------------------------------------------------------
    # ---- changes: what a step changed, and its inverse (a backup's copy) ----------------
    def meta(self) -> dict[str, Any]:
        """The table's step, counters and row optimizer, as a changes record carries them."""
        ro = self._rowopt
        return {"step": self.step, "counters": dict(self.counters), "version": self.version,
                "rowopt": None if ro is None else {"kind": ro.kind, "widths": list(ro.widths),
                                                   "per_row_step": ro.per_row_step}}

    def changes(self, ids: np.ndarray, evicted: np.ndarray,
                evicted_why: np.ndarray | None = None) -> tuple[dict[str, np.ndarray],
                                                                dict[str, Any]]:
        """The changes record of a step that touched ``ids`` and evicted ``evicted``: each
        held row of ``ids`` whole (value, count, last step, age, optimizer states), the
        reason of each eviction (``evicted_why``, ``_stream.REASONS``) and
        :meth:`meta`; :meth:`apply_changes` of it on a copy makes the copy hold the same
        rows."""
        changed = np.unique(ids)
        slots = self._index.find(changed)
        changed, slots = changed[slots >= 0], slots[slots >= 0]
        arrays = {"ids": changed, "values": self._values[slots],
                  "count": self._count[slots], "last_step": self._last_step[slots],
                  "age_seconds": self._clock() - self._last_seconds[slots],
                  "evicted": evicted}
        arrays["born_step"], arrays["born_how"] = self._born_step[slots], self._born_how[slots]
        if evicted.size:
            arrays["evicted_why"] = np.full(evicted.size, REASONS.index("replicated"), np.uint8) \
                if evicted_why is None else np.asarray(evicted_why, np.uint8)
        for i, s in enumerate(self._states):
            arrays[f"state{i}"] = s[slots]
        if self._t is not None:
            arrays["adam_t"] = self._t[slots]
        return arrays, self.meta()

    def apply_changes(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Apply a changes record (:meth:`changes`, or IDs a training lookup gave birth to,
        ``born``): rows set whole, evicted IDs gone, born rows at their initial values,
        then the step, the counters and the row optimizer's state layout."""
        ids = np.asarray(arrays.get("ids", np.empty(0, np.int64)), np.int64)
        n, dim = ids.size, self.spec.dim
        if n and np.asarray(arrays["values"]).shape != (n, dim):
            raise ShapeMismatchError(f"a replicated round of table {self.name!r} does not "
                                     f"fit dim {dim}", key=self.name)
        ro = meta.get("rowopt")
        if ro is not None:
            rowopt = RowOptimizer(str(ro["kind"]), tuple(int(w) for w in ro["widths"]),
                                  bool(ro["per_row_step"]))
            if self._rowopt is None or self._rowopt.signature != rowopt.signature:
                cap = self.capacity_rows
                self._states = [np.zeros((cap, w), self.spec.state_dtype) for w in rowopt.widths]
                self._t = np.zeros(cap, np.int64) if rowopt.per_row_step else None
                self._rowopt = rowopt
        # stamped with the primary's version, so the stream goes on where it was (E8)
        target = int(meta.get("version", self.version + 1))
        self.version = min(self.version, target - 1)
        born = np.asarray(arrays.get("born", np.empty(0, np.int64)), np.int64)
        if born.size:               # rows a training lookup inserted: their initial values
            lost = np.unique(born)
            lost = lost[self._index.find(lost) < 0]
            if lost.size:
                self._how = BIRTHS.index("pull")
                self._insert(lost)
        evicted = np.asarray(arrays.get("evicted", np.empty(0, np.int64)), np.int64)
        if evicted.size:
            slots = self._index.find(evicted)
            why = np.asarray(arrays.get("evicted_why", np.full(evicted.size, 3, np.uint8)))
            if why.shape != evicted.shape:
                why = np.full(evicted.size, REASONS.index("replicated"), np.uint8)
            keep = slots >= 0
            if keep.any():
                self._recent.clear()
                self.tombs.add(target, evicted[keep], why[keep])
                self._dirty = True
                self._index.delete(evicted[keep])
                self._live[slots[keep]] = False
                self._free = np.concatenate([self._free, slots[keep]])
        if n:
            slots = self._index.find(ids)
            absent = slots < 0
            if absent.any():
                self._how = BIRTHS.index("replicated")
                slots[absent] = self._insert(ids[absent])
                self._how = 0
            self._values[slots] = self._from_saved(arrays["values"])   # the same bits
            born_step, born_how = arrays.get("born_step"), arrays.get("born_how")
            if born_step is not None and np.shape(born_step) == (n,) and \
                    np.shape(born_how) == (n,):
                self._born_step[slots] = born_step
                self._born_how[slots] = np.minimum(np.asarray(born_how), len(BIRTHS) - 1)
            self._count[slots] = arrays["count"]
            self._last_step[slots] = arrays["last_step"]
            self._last_seconds[slots] = self._clock() - np.asarray(arrays["age_seconds"])
            for i, s in enumerate(self._states):
                s[slots] = arrays[f"state{i}"]
            if self._t is not None and "adam_t" in arrays:
                self._t[slots] = arrays["adam_t"]
            self._mark(slots)
        self._dirty = False
        self.version = max(self.version, target)
        self._log_marks()
        self.step = int(meta.get("step", self.step))
        for k, v in (meta.get("counters") or {}).items():
            if k in self.counters:
                self.counters[k] = int(v)

    def restore_rows(self, ids: np.ndarray) -> None:
        """Re-create the rows of ``ids`` this table lacks, at their initial values (a
        function of seed and ID, R2): rows a worker's pushes sent again need (D9)."""
        wanted = np.unique(np.asarray(ids, np.int64))
        lost = wanted[self._index.find(wanted) < 0]
        if lost.size:
            self._how = BIRTHS.index("restore")
            self._insert(lost)
            self._how = 0
        self._commit()

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The whole table as plain NumPy arrays and JSON-able metadata (a copy)."""
        from ._state import snapshot
        return snapshot(self)

    @classmethod
    def from_state(cls, spec: TableSpec, arrays: dict[str, np.ndarray],
                   meta: dict[str, Any], name: Any = "table", clock: Callable[[], float] = now,
                   shard: tuple[int, int] | None = None) -> DynamicTable:
        """Rebuild a table from :meth:`state`; ``shard=(i, n)`` keeps the IDs that
        :func:`~pskv.table.shard_of` gives to server ``i`` of ``n`` (R13)."""
        from ._state import restore
        return restore(cls, spec, arrays, meta, name, clock, shard)
