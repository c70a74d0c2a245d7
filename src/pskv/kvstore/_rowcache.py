"""The worker-side hot-row cache of a table key (docs/embeddings.md, "The hot-row cache").

A :class:`RowCache` holds at most ``rows`` rows of one table, each with the number of this
worker's push calls of the key (``pushes``) and the time when its lookup was sent: a lookup
serves a held row only while it is at most ``K`` push calls and ``T`` seconds old (rules
C1-C7). Which rows it holds: the most frequently looked-up ones (TinyLFU's idea): a small
count sketch (two hashed counter arrays, the smaller count read, halved now and then so old
traffic fades) counts each ID once per lookup call; a row the servers found is taken into a
free slot, or in place of the held row with the lowest count if its own count is higher.
Everything is vectorised NumPy over a batch (an :class:`pskv.table._index.IdIndex` maps ID
to slot); no Python loop per ID. No sockets, no threads: the store calls it under its lock.

Invariants: every held ID is unique and ``index.find(ids[s]) == s`` for each held slot
``s``; a held row is one a lookup of this worker found (never an unknown-ID value: R4's
sightings and births stay on the servers); ``born[s]`` is at most the push count when its
lookup was sent, so a row's age is never under-counted.
"""
from __future__ import annotations

import operator
import time
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from ..table._hash import salted
from ..table._index import IdIndex

__all__ = ["RowCache", "check_cache"]

#: the sketch's two hashes (any constants; independent of the table's own salts)
_SALT_A, _SALT_B = 0x5EED_0C01, 0x5EED_0C02
#: sketch cells per cached row (a power of two, at least 1024, is allocated)
_CELLS_PER_ROW = 8


def _whole(value: Any, what: str, key: Any, store_type: str, none: bool) -> int | None:
    if value is None and none:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ConfigError(
            f"set_table_cache of table {key!r} on this {store_type!r} store: {what} must be a "
            f"whole number{' or None' if none else ''}, got {type(value).__name__} "
            f"{value!r}. Pass an int, e.g. kv.set_table_cache({key!r}, 1000, max_pushes=1).",
            key=key, store_type=store_type) from None
    if n < 0:
        raise ConfigError(
            f"set_table_cache of table {key!r} on this {store_type!r} store: {what} must be "
            f"at least 0, got {n}. Pass 0 rows to turn the cache off.", key=key,
            store_type=store_type)
    return n


def check_cache(key: Any, rows: Any, max_pushes: Any, max_seconds: Any,
                store_type: str) -> tuple[int, int | None, float | None]:
    """``(rows, max_pushes, max_seconds)`` checked (C1), or ConfigError naming the bad one."""
    n = _whole(rows, "rows", key, store_type, none=False)
    k = _whole(max_pushes, "max_pushes", key, store_type, none=True)
    t: float | None = None
    if max_seconds is not None:
        ok = isinstance(max_seconds, (int, float, np.integer, np.floating)) and \
            not isinstance(max_seconds, bool)
        t = float(max_seconds) if ok else float("nan")
        if not t >= 0 or t == float("inf"):
            raise ConfigError(
                f"set_table_cache of table {key!r} on this {store_type!r} store: max_seconds "
                f"must be a finite number of seconds at least 0 or None, got "
                f"{type(max_seconds).__name__} {max_seconds!r}.", key=key,
                store_type=store_type)
    if n and k is None and t is None:
        raise ConfigError(
            f"set_table_cache of table {key!r} on this {store_type!r} store: a cache needs a "
            "bound, or it would serve its rows forever; pass max_pushes (e.g. 1) or "
            "max_seconds.", key=key, store_type=store_type)
    assert n is not None
    return n, k, t


class _Sketch:
    """Approximate lookup counts of IDs: two hashed counter arrays, the smaller read."""

    def __init__(self, rows: int) -> None:
        cells = 1024
        while cells < _CELLS_PER_ROW * rows:
            cells *= 2
        self.mask = np.uint64(cells - 1)
        self.a = np.zeros(cells, np.int64)
        self.b = np.zeros(cells, np.int64)
        #: counts added since the last halving; at ``8 * cells`` every count is halved
        self.added = 0
        self.halvings = 0

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count each of ``ids`` (unique) once; return their counts after it."""
        ca = (salted(ids, _SALT_A) & self.mask).astype(np.intp)
        cb = (salted(ids, _SALT_B) & self.mask).astype(np.intp)
        np.add.at(self.a, ca, 1)
        np.add.at(self.b, cb, 1)
        self.added += ids.size
        if self.added >= 8 * self.a.size:       # old traffic fades (TinyLFU's reset)
            self.a >>= 1
            self.b >>= 1
            self.added //= 2
            self.halvings += 1
        return np.minimum(self.a[ca], self.b[cb])


class RowCache:
    """At most ``rows`` rows of one table key, with their age in push calls and seconds.

    Parameters
    ----------
    rows : int
        Rows held at most (at least 1).
    dim : int
    dtype : numpy dtype
        The table's.
    max_pushes : int or None
        ``K``: a row is served while at most this many push calls of the key were made
        since its lookup was sent (None: no push bound).
    max_seconds : float or None
        ``T``: a row is served while at most this many seconds old (None: no time bound).
    clock : callable
        Seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, rows: int, dim: int, dtype: Any, max_pushes: int | None,
                 max_seconds: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert rows >= 1
        self.capacity = rows
        self.max_pushes = max_pushes
        self.max_seconds = max_seconds
        self.clock = clock
        #: push calls of the key by this worker (``pushed``)
        self.pushes = 0
        self.index = IdIndex(rows)
        self.values = np.zeros((rows, dim), dtype)
        self.ids = np.zeros(rows, np.int64)
        self.used = np.zeros(rows, bool)
        self.born = np.zeros(rows, np.int64)        # push count when fetched
        self.born_at = np.zeros(rows, np.float64)   # clock when fetched
        self.freq = np.zeros(rows, np.int64)        # sketch count when last seen
        #: the owner's table step when fetched (C3's bound 0 across workers), or -1
        self.version = np.full(rows, -1, np.int64)
        self.sketch = _Sketch(rows)
        self.counters = {"hits": 0, "misses": 0, "expired": 0, "admitted": 0,
                         "evicted": 0, "invalidated": 0}

    def __len__(self) -> int:
        return int(np.count_nonzero(self.used))

    def pushed(self) -> None:
        """A push call of the key was sent by this worker: every row ages by one (C3)."""
        self.pushes += 1

    def bound(self, staleness: int | None) -> int | None:
        """``K`` in force: ``max_pushes``, or the per-worker staleness bound if smaller
        (C4)."""
        if staleness is None:
            return self.max_pushes
        if self.max_pushes is None:
            return staleness
        return min(self.max_pushes, staleness)

    def get(self, ids: np.ndarray, staleness: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        """``(hit, slots)`` of ``ids`` (1-d, duplicates allowed): ``hit`` where a held row
        may be served under the bound (C2), its slot in ``slots``. Counts every ID in the
        sketch once (a row's popularity, C6), and hits, misses and expired rows."""
        slots = self.index.find(ids)
        held = slots >= 0
        hit = held.copy()
        if hit.any():
            s = slots[hit]
            fresh = np.ones(s.size, bool)
            k = self.bound(staleness)
            if k is not None:
                fresh &= self.pushes - self.born[s] <= k
            if self.max_seconds is not None:
                fresh &= self.clock() - self.born_at[s] <= self.max_seconds
            hit[hit] = fresh
        n_hit = int(np.count_nonzero(hit))
        self.counters["hits"] += n_hit
        self.counters["misses"] += ids.size - n_hit
        self.counters["expired"] += int(np.count_nonzero(held)) - n_hit
        if ids.size:
            uniq, first = np.unique(ids, return_index=True)
            count = self.sketch.add(uniq)
            us = slots[first]
            there = us >= 0
            self.freq[us[there]] = count[there]
            if self.sketch.halvings:        # the held counts fade with the sketch's
                self.freq >>= self.sketch.halvings
                self.sketch.halvings = 0
                self.freq[us[there]] = count[there]
        return hit, slots

    def stamp(self) -> tuple[int, float]:
        """``(pushes, clock)`` now: taken before a lookup is sent, given to :meth:`offer`."""
        return self.pushes, self.clock()

    def versions_of(self, slots: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """The version of each hit's row (-1 elsewhere), read with the rows (:meth:`fill`)
        before the store lock is let go: another thread's lookup may reuse a slot."""
        out = np.full(slots.size, -1, np.int64)
        out[hit] = self.version[slots[hit]]
        return out

    def current(self, hit: np.ndarray, held: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Take out of ``hit`` the rows whose version ``held`` (:meth:`versions_of`) is
        not ``versions`` (their owners' steps now, one per ID): a push reached the owner
        since (C3); they count as expired. Returns their positions."""
        h = np.flatnonzero(hit)
        stale: np.ndarray = h[held[h] != versions[h]]
        hit[stale] = False
        self.counters["hits"] -= stale.size
        self.counters["misses"] += stale.size
        self.counters["expired"] += stale.size
        return stale

    def offer(self, ids: np.ndarray, values: np.ndarray, found: np.ndarray,
              stamp: tuple[int, float], versions: np.ndarray | None = None) -> None:
        """Rows a lookup sent at ``stamp`` read from the servers (with their owners' steps
        before it, ``versions``, where bound 0 holds across workers): held rows are
        refreshed, others taken in by popularity (C6); rows not found are never held
        (C5)."""
        keep = np.flatnonzero(found)
        if keep.size == 0:
            return
        ids, first = np.unique(ids[keep], return_index=True)
        values = values[keep[first]]
        version = np.full(ids.size, -1, np.int64) if versions is None else \
            versions[keep[first]]
        slots = self.index.find(ids)
        old = slots >= 0
        if old.any():
            s = slots[old]
            self.values[s] = values[old]
            self.version[s] = version[old]
            self.born[s], self.born_at[s] = stamp
        new = np.flatnonzero(~old)
        if new.size == 0:
            return
        count = self._counts(ids[new])
        order = np.argsort(-count, kind="stable")   # the most popular first
        new, count = new[order], count[order]
        free = np.flatnonzero(~self.used)[:new.size]
        take = free
        n_free = free.size
        rest, rest_count = new[n_free:], count[n_free:]
        victims = np.empty(0, np.int64)
        if rest.size:
            m = min(rest.size, self.capacity)
            held = np.flatnonzero(self.used)
            low = held[np.argpartition(self.freq[held], m - 1)[:m]] if m < held.size else held
            low = low[np.argsort(self.freq[low], kind="stable")]
            m = min(m, low.size)
            # the candidates (most popular first) against the held rows (least first)
            win = int(np.count_nonzero(rest_count[:m] > self.freq[low[:m]]))
            victims = low[:win]
            self.index.delete(self.ids[victims])
            self.counters["evicted"] += win
            take = np.concatenate([free, victims])
            new = new[:n_free + win]
            count = count[:n_free + win]
        s = take.astype(np.int64)
        if s.size == 0:
            return
        self.ids[s] = ids[new]
        self.values[s] = values[new]
        self.version[s] = version[new]
        self.born[s], self.born_at[s] = stamp
        self.freq[s] = count
        self.used[s] = True
        self.index.insert(ids[new], s)
        self.counters["admitted"] += s.size

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        """The sketch's count of each of ``ids`` (without counting them again)."""
        sk = self.sketch
        ca = (salted(ids, _SALT_A) & sk.mask).astype(np.intp)
        cb = (salted(ids, _SALT_B) & sk.mask).astype(np.intp)
        return np.minimum(sk.a[ca], sk.b[cb])

    def fill(self, out: np.ndarray, hit: np.ndarray, slots: np.ndarray) -> None:
        """Write the held rows of ``hit`` into ``out`` (rows in the lookup's order); right
        after :meth:`get`, under the same lock hold (a later offer may reuse a slot)."""
        out[hit] = self.values[slots[hit]]

    def clear(self) -> None:
        """Drop every held row (a checkpoint was loaded: C7)."""
        held = np.flatnonzero(self.used)
        self.counters["invalidated"] += held.size
        self.index = IdIndex(self.capacity)
        self.used[:] = False

    def stats(self) -> dict[str, int]:
        """capacity, rows held, hits, misses, expired, admitted, evicted, invalidated."""
        return {"capacity": self.capacity, "rows": len(self), **self.counters}
