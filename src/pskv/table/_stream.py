"""A table's change stream: versions, tombstones, change batches and a mirror that applies
them (docs/embeddings.md, rules E1-E10). No sockets, no threads.

Every change a table applies to its rows (a push, a birth, an assign, an eviction, a
replicated round) stamps the rows it changed with the table's next *version*; one public
operation is one version (E1). Removed IDs go to a bounded :class:`TombLog`. A reader
holding a copy at version ``v`` asks :func:`read_changes` for what changed since ``v`` and
gets a :class:`ChangeBatch`: the IDs and current rows of every row stamped after ``v``,
and the IDs removed after ``v``; applying it (removed first, then rows) makes the copy
equal to the table at the batch's version (E3). A reader whose ``v`` is older than what
the tombstones still cover, or of another *lineage* (the table was reloaded from a
checkpoint: its history forked), gets the whole table instead, marked ``reset`` (E5).

:class:`RowMirror` is such a copy of a whole table (every shard): what a sink's replay, a
serving replica and the tests hold.
"""
from __future__ import annotations

import dataclasses
import secrets
from collections import deque
from typing import Any

import numpy as np

from ..errors import ShapeMismatchError, StaleReadError, UnsupportedError

__all__ = ["ChangeBatch", "RowMirror", "TombLog", "new_lineage", "read_all", "read_changes",
           "REASONS", "TOMB_IDS"]

#: the most removed IDs a table shard remembers for its readers (E5): a reader further
#: behind gets the whole shard
TOMB_IDS = 1 << 20
#: why a row was removed, as a tombstone's code (``ChangeBatch.reasons``, ``kv.explain``)
REASONS = ("ttl", "capacity", "score", "replicated")
#: rows one batch carries at most unless the reader asks for fewer (a page, E6)
PAGE_ROWS = 65536


def new_lineage() -> str:
    """A fresh lineage token: a table's history starts (created, or reloaded)."""
    return secrets.token_hex(8)


@dataclasses.dataclass(frozen=True)
class ChangeBatch:
    """What one read of a table shard's stream returns (E3-E6).

    Attributes
    ----------
    key : str or int
        The store's key of the table.
    shard, num_shards : int
        Which shard of how many (server ``shard`` of ``num_shards``; 0 of 1 locally).
    lineage : str
        The shard's history; a reader keeps it with ``version`` to resume.
    version : int
        The shard's version this batch brings a copy to, once ``complete``.
    reset : bool
        Drop every row of this shard held before applying (a first read, a reader
        behind the tombstones, or a new lineage).
    removed : numpy.ndarray
        int64 IDs removed since the reader's version: delete them first.
    ids, rows : numpy.ndarray
        The IDs changed since the reader's version and their rows now (float32, or
        the table's storage dtype when read ``raw``): upsert them after ``removed``.
    reasons : numpy.ndarray
        uint8, one per ``removed`` ID: its index in ``pskv.table._stream.REASONS``.
    cursor : int or None
        Where the next page of this read starts; None: the read is ``complete``.
    """

    key: Any
    shard: int
    num_shards: int
    lineage: str
    version: int
    reset: bool
    removed: np.ndarray
    ids: np.ndarray
    rows: np.ndarray
    reasons: np.ndarray
    cursor: int | None = None

    @property
    def complete(self) -> bool:
        """Whether this is the read's last page (the copy is then at ``version``)."""
        return self.cursor is None

    @property
    def position(self) -> tuple[str, int]:
        """``(lineage, version)``: what a reader resumes from once the batch is applied."""
        return self.lineage, self.version


class TombLog:
    """The IDs a table removed, with the version and the reason of each, bounded to
    ``limit`` IDs: ``floor`` is the oldest version a reader may be at and still get
    every removal since (older: the whole shard, E5)."""

    def __init__(self, limit: int = TOMB_IDS, floor: int = 0) -> None:
        self.limit = int(limit)
        self.floor = int(floor)
        self._log: deque[tuple[int, np.ndarray, np.ndarray]] = deque()
        self._held = 0

    def add(self, version: int, ids: np.ndarray, reason: np.ndarray | int) -> None:
        """Remember that ``ids`` were removed at ``version`` for ``reason``."""
        if not ids.size:
            return
        why = np.broadcast_to(np.asarray(reason, np.uint8), ids.shape).copy()
        self._log.append((int(version), ids.astype(np.int64, copy=True), why))
        self._held += ids.size
        while self._held > self.limit and self._log:
            v, old, _w = self._log.popleft()
            self._held -= old.size
            self.floor = max(self.floor, v)

    def since(self, version: int) -> tuple[np.ndarray, np.ndarray]:
        """The IDs removed after ``version`` (oldest first) and their reasons."""
        got = [(i, w) for v, i, w in self._log if v > version]
        if not got:
            return np.empty(0, np.int64), np.empty(0, np.uint8)
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def last(self, ident: int) -> tuple[int, str] | None:
        """``(version, reason)`` of the latest removal of ``ident`` still held, or None."""
        for v, ids, why in reversed(self._log):
            hit = np.flatnonzero(ids == ident)
            if hit.size:
                return v, REASONS[int(why[hit[-1]])]
        return None

    def arrays(self) -> dict[str, np.ndarray]:
        """The log as arrays (a backup's copy keeps it: ``tomb_ids``, ``tomb_versions``,
        ``tomb_reasons``)."""
        if not self._log:
            return {"tomb_ids": np.empty(0, np.int64), "tomb_versions": np.empty(0, np.int64),
                    "tomb_reasons": np.empty(0, np.uint8)}
        return {"tomb_ids": np.concatenate([i for _v, i, _w in self._log]),
                "tomb_versions": np.concatenate([np.full(i.size, v, np.int64)
                                                 for v, i, _w in self._log]),
                "tomb_reasons": np.concatenate([w for _v, _i, w in self._log])}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], floor: int) -> TombLog:
        """The log :meth:`arrays` wrote (missing arrays: an empty log at ``floor``)."""
        log = cls(floor=floor)
        ids = np.asarray(arrays.get("tomb_ids", np.empty(0, np.int64)), np.int64)
        vers = np.asarray(arrays.get("tomb_versions", np.empty(0, np.int64)), np.int64)
        why = np.asarray(arrays.get("tomb_reasons", np.zeros(ids.size, np.uint8)), np.uint8)
        if ids.shape == vers.shape == why.shape and ids.ndim == 1:
            cuts = np.flatnonzero(np.diff(vers)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, ids.size]):
                if b > a:
                    log.add(int(vers[a]), ids[a:b], why[a:b])
        return log


def read_changes(table: Any, since: int, lineage: str | None, *, cursor: int = 0,
                 upto: int | None = None, max_rows: int = PAGE_ROWS, raw: bool = False,
                 key: Any = None, shard: tuple[int, int] = (0, 1)) -> ChangeBatch:
    """One page of what changed in ``table`` (a DynamicTable) since ``(lineage, since)``.

    ``cursor`` and ``upto`` continue a read (the ``cursor`` and ``version`` of the page
    before); a read that starts is at ``cursor=0``. ``since=-1`` or ``lineage=None``:
    the whole table. ``raw``: rows in the storage dtype (their bits), else widened.
    """
    if isinstance(since, bool) or not isinstance(since, (int, np.integer)) or since < -1:
        raise UnsupportedError(f"a read of table {table.name!r}'s changes needs a version "
                               f">= -1 (-1: from the start), got {since!r}.", key=key)
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) \
            or max_rows < 1:
        raise UnsupportedError(f"a read of table {table.name!r}'s changes needs max_rows "
                               f">= 1, got {max_rows!r}.", key=key)
    since, cursor = int(since), int(cursor)
    if cursor and (lineage != table.lineage or upto is None or upto > table.version):
        cursor = 0        # reloaded between two pages (or a malformed continuation): restart
    if cursor == 0:
        reset = lineage != table.lineage or since < 0 or since < table.tombs.floor \
            or since > table.version
        upto = table.version
        low = -1 if reset else since
        removed, reasons = (np.empty(0, np.int64), np.empty(0, np.uint8)) if reset else \
            table.tombs.since(since)
    else:               # a continuation: its first page said reset, and what was removed
        reset, low = False, since
        removed, reasons = np.empty(0, np.int64), np.empty(0, np.uint8)
    top = table._top
    cursor = min(cursor, top)
    some = table.changed_slots(low, cursor) if low >= 0 else None
    if some is None:            # a whole read, or one from before the log: scan
        window = np.arange(cursor, top, dtype=np.int64)
        hit = window[table._live[cursor:top] & (table._changed[cursor:top] > low)]
    else:                       # the slots the versions since changed, still live
        hit = some[table._live[some] & (table._changed[some] > low)]
    more = hit.size > max_rows
    if more:
        hit = hit[:max_rows]
    nxt = int(hit[-1]) + 1 if more else None
    stored = table._values[hit]
    rows = stored.copy() if raw else np.ascontiguousarray(table._read(stored),
                                                          dtype=np.float32)
    assert upto is not None
    return ChangeBatch(key=table.name if key is None else key, shard=shard[0],
                       num_shards=shard[1], lineage=table.lineage, version=int(upto),
                       reset=bool(reset), removed=removed,
                       ids=table._ids[hit].copy(), rows=rows, reasons=reasons, cursor=nxt)


def read_all(fetch: Any, since: int, lineage: str | None) -> list[ChangeBatch]:
    """Every page of one read: ``fetch(since, lineage, cursor, upto)`` returns a page
    (:func:`read_changes`, or its answer over the wire); a page after a reset page asks
    from the start (``since=-1``) of the lineage that page named."""
    pages = [fetch(since, lineage, 0, None)]
    if pages[0].reset:
        since, lineage = -1, pages[0].lineage
    while not pages[-1].complete:
        nxt = fetch(since, lineage, pages[-1].cursor, pages[-1].version)
        if nxt.cursor is not None and nxt.cursor <= (pages[-1].cursor or 0) and not nxt.reset:
            raise UnsupportedError(f"the change stream of table {nxt.key!r} did not move "
                                   "forward between two pages.", key=nxt.key)
        if nxt.reset or nxt.lineage != lineage:      # reloaded meanwhile: start again
            return read_all(fetch, -1, None)
        pages.append(nxt)
    return pages


class RowMirror:
    """A copy of a whole table (all its shards) built from :class:`ChangeBatch` es, in
    any shard order: what a sink's replay and a serving replica hold.

    Parameters
    ----------
    dim : int
        The table's row width.
    dtype : str or numpy.dtype
        The rows' dtype as the batches carry them (float32, or the storage dtype).
    """

    def __init__(self, dim: int, dtype: Any = np.float32, key: Any = None) -> None:
        self.dim, self.dtype, self.key = int(dim), np.dtype(dtype), key
        self._rows: dict[int, dict[int, np.ndarray]] = {}
        #: shard -> (lineage, version, num_shards) of the last complete batch applied
        self.positions: dict[int, tuple[str, int, int]] = {}
        self._partial: dict[int, tuple[str, int]] = {}

    def apply(self, batch: ChangeBatch) -> None:
        """Apply one page (removed IDs first, then rows); a reset empties that shard."""
        if batch.rows.shape != (batch.ids.size, self.dim):
            raise ShapeMismatchError(
                f"a change batch of table {batch.key!r} carries rows of shape "
                f"{batch.rows.shape} for {batch.ids.size} IDs of dim {self.dim}.",
                key=batch.key, shape=batch.rows.shape)
        rows = self._rows.setdefault(batch.shard, {})
        if batch.reset:
            rows.clear()
        for i in batch.removed.tolist():
            rows.pop(i, None)
        data = np.asarray(batch.rows, self.dtype)
        for n, i in enumerate(batch.ids.tolist()):
            rows[i] = data[n]
        if batch.complete:
            self.positions[batch.shard] = (batch.lineage, batch.version, batch.num_shards)
            self._partial.pop(batch.shard, None)
        else:
            self._partial[batch.shard] = (batch.lineage, batch.version)

    def since(self) -> dict[int, tuple[str, int]]:
        """What to resume each shard's stream from: ``{shard: (lineage, version)}``."""
        return {s: (p[0], p[1]) for s, p in self.positions.items()}

    def version(self, shard: int | None = None) -> int:
        """The version of ``shard`` (None: the lowest over the shards held; -1: none)."""
        if shard is not None:
            p = self.positions.get(shard)
            return -1 if p is None else p[1]
        return min((p[1] for p in self.positions.values()), default=-1)

    def __len__(self) -> int:
        return sum(len(r) for r in self._rows.values())

    def ids(self) -> np.ndarray:
        """Every ID held, sorted."""
        got = [np.fromiter(r.keys(), np.int64, len(r)) for r in self._rows.values()]
        return np.sort(np.concatenate(got)) if got else np.empty(0, np.int64)

    def get(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, found)`` of 1-d ``ids``: zeros where an ID has no row."""
        flat = np.asarray(ids, np.int64).ravel()
        out = np.zeros((flat.size, self.dim), self.dtype)
        found = np.zeros(flat.size, bool)
        for n, i in enumerate(flat.tolist()):
            for rows in self._rows.values():
                r = rows.get(i)
                if r is not None:
                    out[n], found[n] = r, True
                    break
        return out, found

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)``: every row held, sorted by ID."""
        ids = self.ids()
        return ids, self.get(ids)[0]

    def require(self, version: int, shard: int) -> None:
        """Raise :class:`~pskv.errors.StaleReadError` unless ``shard`` is at ``version``."""
        have = self.version(shard)
        if have < version:
            raise StaleReadError(f"table {self.key!r}: shard {shard} is at version {have}, "
                                 f"not yet {version}. Wait for the stream to catch up, or "
                                 "read at a lower version.", key=self.key)
