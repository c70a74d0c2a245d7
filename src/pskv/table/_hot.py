"""The hot IDs of a table: a count-min sketch of the IDs looked up and a bounded set of
candidates (docs/embeddings.md, "Seeing into a table", H1-H3). No sockets, no threads.

* H1. Every lookup (training or eval) adds each ID it reads, once per occurrence, to a
  count-min sketch of :data:`DEPTH` rows of :data:`WIDTH` int32 cells (seeded hashes of
  the ID); an ID's estimate is the smallest of its cells: never below its true count,
  above it by at most ``e * N / WIDTH`` with probability ``1 - exp(-DEPTH)`` (N: the
  lookups counted).
* H2. Decay: once :data:`HALF_LIFE` IDs were counted, every cell (and every
  candidate's estimate) is halved, so the estimates follow the traffic of about the last
  2 x HALF_LIFE lookups, not all time.
* H3. Candidates: after each lookup the :data:`CANDIDATES` IDs with the highest
  estimates among the candidates and that lookup's IDs are kept; ``top(k)`` reads the k
  highest. A dist store merges the servers' tops (each ID lives on one server).
"""
from __future__ import annotations

import numpy as np

from ._hash import salted

__all__ = ["HotIds"]

#: count-min rows and cells per row
DEPTH, WIDTH = 4, 4096
#: IDs counted before every count is halved (H2)
HALF_LIFE = 1 << 22
#: candidate IDs kept for the top-k (H3)
CANDIDATES = 256
#: the salt of each count-min row's hash
_SALTS = (0x68A3, 0x7B21, 0x3C55, 0x51E7)


class HotIds:
    """A count-min sketch of looked-up IDs with a bounded candidate set (H1-H3)."""

    def __init__(self) -> None:
        self.cells = np.zeros((DEPTH, WIDTH), np.int32)
        self.ids = np.empty(0, np.int64)
        self.counted = 0

    def nbytes(self) -> int:
        """Bytes of the sketch and the candidates."""
        return int(self.cells.nbytes + self.ids.nbytes)

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([(salted(ids, s) % np.uint64(WIDTH)).astype(np.int64)
                         for s in _SALTS[:DEPTH]])

    def add(self, ids: np.ndarray) -> None:
        """Count one lookup's IDs (1-d int64, repeats counted each)."""
        if not ids.size:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        cells = self._cells(uniq)
        for r in range(DEPTH):
            self.cells[r] += np.bincount(cells[r], weights=counts,
                                         minlength=WIDTH).astype(np.int32)
        self.counted += ids.size
        if self.counted >= HALF_LIFE:           # H2
            self.cells >>= 1
            self.counted //= 2
        pool = np.union1d(self.ids, uniq)
        if pool.size > CANDIDATES:
            est = self.estimate(pool)
            pool = pool[np.argsort(-est, kind="stable")[:CANDIDATES]]
        self.ids = pool

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Each ID's count-min estimate (H1)."""
        cells = self._cells(np.asarray(ids, np.int64))
        return self.cells[np.arange(DEPTH)[:, None], cells].min(axis=0).astype(np.int64)

    def top(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` candidates of highest estimate: ``[(id, estimate)]``, highest first
        (ties by ID)."""
        if not self.ids.size:
            return []
        est = self.estimate(self.ids)
        order = np.lexsort((self.ids, -est))[:k]
        return [(int(self.ids[i]), int(est[i])) for i in order]
