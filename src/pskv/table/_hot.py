"""The hot IDs of a table: a count-min sketch of the IDs looked up and a bounded set of
candidates (docs/embeddings.md, "Seeing into a table", H1-H3). No sockets, no threads.

* H1. Every lookup (training or eval) adds the IDs it reads to a count-min sketch of
  :data:`DEPTH` rows of :data:`WIDTH` int32 cells (the cells of an ID: 12-bit slices of
  one seeded 64-bit hash); an ID's estimate is the smallest of its cells. A lookup of
  more than :data:`SAMPLE` IDs adds an evenly spaced sample of about SAMPLE of them, each
  weighted by the spacing, so the sketch costs the same at any batch size: estimates are
  then counts of the sample, scaled (exact for lookups of up to SAMPLE IDs, where an
  estimate is never below the true count).
* H2. Decay: once :data:`HALF_LIFE` IDs were counted, every cell (and every
  candidate's estimate) is halved, so the estimates follow the traffic of about the last
  2 x HALF_LIFE lookups, not all time.
* H3. Candidates: every :data:`REFRESH` lookups (and before any read) their counted IDs
  go into the sketch, and the :data:`CANDIDATES` IDs of highest estimate among the
  candidates and those IDs are kept; ``top(k)`` reads the k highest. A dist store merges the servers' tops (each ID lives on one server).
"""
from __future__ import annotations

import numpy as np

from ._hash import salted

__all__ = ["HotIds"]

#: count-min rows and cells per row
DEPTH, WIDTH = 4, 4096
#: the most IDs of one lookup the sketch counts (an evenly spaced sample of the rest)
SAMPLE = 128
#: IDs counted before every count is halved (H2)
HALF_LIFE = 1 << 22
#: candidate IDs kept for the top-k (H3)
CANDIDATES = 256
#: lookups whose sampled IDs are folded into the candidates at a time (H3)
REFRESH = 16
#: the salt of the sketch's hash
_SALT = 0x68A3


class HotIds:
    """A count-min sketch of looked-up IDs with a bounded candidate set (H1-H3)."""

    def __init__(self) -> None:
        self.cells = np.zeros((DEPTH, WIDTH), np.int32)
        self.ids = np.empty(0, np.int64)
        self.counted = 0
        self._seen: list[tuple[np.ndarray, int]] = []

    def nbytes(self) -> int:
        """Bytes of the sketch and the candidates."""
        return int(self.cells.nbytes + self.ids.nbytes + sum(s.nbytes for s, _w in self._seen))

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        h = salted(ids, _SALT)
        return np.stack([((h >> np.uint64(12 * r)) & np.uint64(WIDTH - 1)).astype(np.intp)
                         for r in range(DEPTH)])

    def add(self, ids: np.ndarray) -> None:
        """Count one lookup's IDs (1-d int64, repeats counted each; a sample of a big
        lookup, H1): kept aside, folded into the sketch every :data:`REFRESH` lookups
        and before any read."""
        n = ids.size
        if not n:
            return
        step = -(-n // SAMPLE)
        self._seen.append((ids[(self.counted % step)::step].copy() if step > 1
                           else ids.copy(), step))
        self.counted += n
        if len(self._seen) >= REFRESH:
            self._fold()

    def _fold(self) -> None:
        """Count the IDs kept aside, then keep the best candidates (H1-H3)."""
        if not self._seen:
            return
        some = np.concatenate([s for s, _w in self._seen])
        weights = np.repeat(np.array([w for _s, w in self._seen], np.int32),
                            [s.size for s, _w in self._seen])
        self._seen = []
        cells = self._cells(some) + (np.arange(DEPTH, dtype=np.intp) * WIDTH)[:, None]
        np.add.at(self.cells.reshape(-1), cells.ravel(), np.tile(weights, DEPTH))
        if self.counted >= HALF_LIFE:           # H2
            self.cells >>= 1
            self.counted //= 2
        pool = np.union1d(self.ids, some)
        if pool.size > CANDIDATES:
            est = self.estimate(pool)
            pool = pool[np.argpartition(-est, CANDIDATES - 1)[:CANDIDATES]]
        self.ids = pool

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Each ID's count-min estimate (H1)."""
        self._fold()
        cells = self._cells(np.asarray(ids, np.int64))
        return self.cells[np.arange(DEPTH)[:, None], cells].min(axis=0).astype(np.int64)

    def top(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` candidates of highest estimate: ``[(id, estimate)]``, highest first
        (ties by ID)."""
        self._fold()
        if not self.ids.size:
            return []
        est = self.estimate(self.ids)
        order = np.lexsort((self.ids, -est))[:k]
        return [(int(self.ids[i]), int(est[i])) for i in order]
