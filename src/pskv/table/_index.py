"""IdIndex: int64 ID -> slot, an open-addressing hash table probed in vectorised rounds.

Two arrays of ``cap`` cells (a power of two): ``keys`` (int64 IDs) and ``slots`` (int64:
a row number, or ``EMPTY`` / ``DELETED``). Linear probing from a cell given by a salted
splitmix64 hash. A batch of IDs is probed together, so there is no Python loop per ID: a
find's first round looks at each ID's home cell, later ones at a window of ``_WINDOW``
cells per ID still searching; inserts look at one cell per ID per round. Invariants: every stored ID is unique;
``size + deleted <= cap / 2`` after every insert (the table is rebuilt, or doubled, before);
an ID sits at or after its home cell with no EMPTY cell between (deletes leave DELETED).
"""
from __future__ import annotations

import numpy as np

from ._hash import SALT_INDEX, salted

__all__ = ["DELETED", "EMPTY", "IdIndex"]

EMPTY = -1
DELETED = -2
#: cells a find probes per ID in one vectorised round after the home cell
_WINDOW = 8


class IdIndex:
    """A vectorised ``dict[int64, int]`` of IDs to row slots."""

    __slots__ = ("_keys", "_slots", "_mask", "size", "deleted")

    def __init__(self, rows: int = 0) -> None:
        self.size = 0
        self.deleted = 0
        self._alloc(_cells_for(rows))

    def _alloc(self, cap: int) -> None:
        self._keys = np.zeros(cap, np.int64)
        self._slots = np.full(cap, EMPTY, np.int64)
        self._mask = np.int64(cap - 1)

    @property
    def cells(self) -> int:
        """Cells allocated (twice the IDs it holds, or more)."""
        return int(self._keys.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return int(self._keys.nbytes + self._slots.nbytes)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (salted(ids, SALT_INDEX) & np.uint64(self._mask)).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each ID (int64 array), ``EMPTY`` where absent; duplicates allowed."""
        return self._find(ids)[0]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = ids.shape[0]
        out = np.full(n, EMPTY, np.int64)
        cell = np.full(n, EMPTY, np.int64)
        if n == 0 or self.size == 0:
            return out, cell
        keys, slots, mask = self._keys, self._slots, self._mask
        pos = self._home(ids)
        s = slots[pos]                      # the first round: each ID's home cell
        hit = (s >= 0) & (keys[pos] == ids)
        out[hit] = s[hit]
        cell[hit] = pos[hit]
        go = (s != EMPTY) & ~hit
        act = np.flatnonzero(go)
        pos = (pos[go] + 1) & mask
        # then a window of cells per ID still searching: its probe stops at the first cell
        # that holds it or is EMPTY (DELETED cells are passed); a few rounds, not one per
        # probe distance (at half load, the longest runs of a batch are 10 to 20 cells)
        width = np.arange(_WINDOW, dtype=np.int64)
        while act.size:
            q = ids[act]
            cells = (pos[:, None] + width) & mask
            s = slots[cells]
            hit = (s >= 0) & (keys[cells] == q[:, None])
            stop = hit | (s == EMPTY)
            first = np.argmax(stop, axis=1)
            rows = np.arange(act.size)
            stopped = stop[rows, first]
            found = stopped & hit[rows, first]
            out[act[found]] = s[rows, first][found]
            cell[act[found]] = cells[rows, first][found]
            act = act[~stopped]
            pos = (pos[~stopped] + _WINDOW) & mask
        return out, cell

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add ``ids`` (unique, none present) with their ``slots``."""
        n = ids.shape[0]
        if n == 0:
            return
        if 2 * (self.size + self.deleted + n) > self.cells:
            self._rebuild(self.size + n)
        self._place(ids, slots)
        self.size += n

    def _place(self, ids: np.ndarray, vals: np.ndarray) -> None:
        keys, slots, mask = self._keys, self._slots, self._mask
        pos = self._home(ids)
        while ids.shape[0]:
            s = slots[pos]
            free = np.flatnonzero(s < 0)
            done = np.zeros(ids.shape[0], bool)
            if free.size:
                # one winner per free cell this round; the others retry it (now taken)
                _, first = np.unique(pos[free], return_index=True)
                win = free[first]
                wp = pos[win]
                self.deleted -= int(np.count_nonzero(slots[wp] == DELETED))
                keys[wp] = ids[win]
                slots[wp] = vals[win]
                done[win] = True
            taken = s >= 0                   # occupied before this round: move on
            pos = np.where(taken, (pos + 1) & mask, pos)
            keep = ~done
            ids, vals, pos = ids[keep], vals[keep], pos[keep]

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove the present ``ids`` (unique); return their slots (``EMPTY`` if absent)."""
        found, cell = self._find(ids)
        hit = cell >= 0
        self._slots[cell[hit]] = DELETED
        k = int(np.count_nonzero(hit))
        self.size -= k
        self.deleted += k
        return found

    def _rebuild(self, rows: int) -> None:
        live = np.flatnonzero(self._slots >= 0)
        keys, slots = self._keys[live], self._slots[live]
        self._alloc(max(_cells_for(rows), self.cells if self.deleted else 0))
        self.deleted = 0
        self._place(keys, slots)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(ids, slots)`` held, in cell order."""
        live = np.flatnonzero(self._slots >= 0)
        return self._keys[live], self._slots[live]


def _cells_for(rows: int) -> int:
    """A power of two at least twice ``rows`` (16 or more)."""
    cap = 16
    while cap < 2 * rows:
        cap *= 2
    return cap
