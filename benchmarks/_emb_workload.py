"""The embedding workload of ``bench_embeddings.py``, and its NumPy ceiling (NumPy only).

The workload is the one the peers' scripts in ``../shared/bench/embeddings/`` share
(``workload.py`` there), generated here without importing it so the benchmark stands
alone; ``tests/unit/test_bench_embeddings.py`` checks that both draw the same IDs and the
same gradient when that folder is present:

- a table of N rows x D float32 columns (D = 64);
- batches of B int64 IDs in ``[0, N)``: uniform, or a bounded Zipf(s) whose ranks are
  scattered over the IDs by a fixed permutation (so hot rows are not neighbours);
  the generator's draws, in order: the B x batches uniforms, then the permutation;
- one fixed ``(B, D)`` gradient, standard normal x 0.01 from seed 1;
- AdaGrad with learning rate 0.01, accumulator starting at 0, ``eps`` 1e-10.

The NumPy ceiling is what plain NumPy does at best per batch in one process on a
pre-sized table: ``np.take`` for a lookup; for a train step the lookup, then the batch's
gradients summed per unique ID by a sort and ``np.add.reduceat``, then element-wise AdaGrad
on those rows. Its ``insert`` maps never-seen raw IDs to fresh slots through a Python
dict and writes their initial rows: the cheapest dynamic table written in Python.

Nothing here imports pskv.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["NumpyCeiling", "cpu_seconds_of_pid", "current_rss_bytes", "insert_batches",
           "make_batches", "make_grad", "peak_rss_bytes", "rss_of_pid", "time_batches",
           "unique_fraction"]

#: multiplier of the never-seen ID stream (odd, so the map is a bijection of uint64)
_NEW_ID_MULT = np.uint64(0x9E3779B97F4A7C15)


def make_batches(n_rows: int, batch: int, n_batches: int, dist: str = "zipf",
                 s: float = 1.05, seed: int = 0) -> list[np.ndarray]:
    """``n_batches`` int64 arrays of ``batch`` IDs in ``[0, n_rows)``, as the peers draw them."""
    if dist not in ("zipf", "uniform"):
        raise ValueError(f"dist must be 'zipf' or 'uniform', got {dist!r}")
    rng = np.random.default_rng(seed)
    total = batch * n_batches
    if dist == "uniform":
        ids = rng.integers(0, n_rows, size=total, dtype=np.int64)
    else:
        # P(rank k) ~ k**-s for k = 1..n_rows: invert the CDF at uniform draws
        weights = np.arange(1, n_rows + 1, dtype=np.float64) ** (-s)
        cdf = np.cumsum(weights)
        del weights
        cdf /= cdf[-1]
        rank0 = np.searchsorted(cdf, rng.random(total), side="right")
        del cdf
        scatter = rng.permutation(n_rows).astype(np.int64)
        ids = scatter[np.minimum(rank0, n_rows - 1)]
        del scatter
    return [ids[i * batch:(i + 1) * batch].copy() for i in range(n_batches)]


def make_grad(batch: int, dim: int, seed: int = 1) -> np.ndarray:
    """The fixed ``(batch, dim)`` float32 gradient of every step."""
    g = np.random.default_rng(seed).standard_normal((batch, dim)) * 0.01
    return g.astype(np.float32)


def insert_batches(start: int, batch: int, n_batches: int, salt: int = 0) -> list[np.ndarray]:
    """Batches of never-seen raw IDs: a counter from ``start`` scattered over int64.

    Distinct counters give distinct IDs (an odd multiplier is a bijection of uint64);
    ``salt`` shifts the counter so that workers draw disjoint streams. A scattered ID can
    land in ``[0, N)`` with probability about N / 2**64, which the caller may ignore.
    """
    out = []
    for i in range(n_batches):
        ctr = np.arange(start + i * batch, start + (i + 1) * batch, dtype=np.uint64)
        ctr += np.uint64(salt) << np.uint64(40)
        with np.errstate(over="ignore"):
            out.append((ctr * _NEW_ID_MULT).view(np.int64))
    return out


def unique_fraction(batches: Sequence[np.ndarray]) -> float:
    """The mean share of distinct IDs in a batch."""
    return float(np.mean([np.unique(b).size / b.size for b in batches]))


def time_batches(fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray],
                 warmup: int) -> float:
    """Seconds for ``fn`` over ``batches[warmup:]``, after the first ``warmup`` untimed."""
    for b in batches[:warmup]:
        fn(b)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        fn(b)
    return time.perf_counter() - t0


# ---- memory --------------------------------------------------------------------------------
def rss_of_pid(pid: int | str = "self") -> dict[str, int] | None:
    """Resident (``VmRSS``) and peak resident (``VmHWM``) bytes of a process, or None."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(rest.split()[0]) * 1024
    return out if len(out) == 2 else None


def cpu_seconds_of_pid(pid: int | str = "self") -> tuple[float, float] | None:
    """``(user, system)`` CPU seconds a process has used (``/proc/<pid>/stat``), or None.

    Summed over all its threads; the fields after the command name (which may hold
    spaces) are counted from the closing parenthesis."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    try:
        utime, stime = int(fields[11]), int(fields[12])     # fields 14 and 15 of stat(5)
    except (IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return utime / tick, stime / tick


def current_rss_bytes() -> int:
    """This process's resident bytes now (not the peak)."""
    info = rss_of_pid()
    if info is None:
        import resource    # not Linux: the peak is all there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return info["VmRSS"]


def peak_rss_bytes() -> int:
    """This process's peak resident bytes."""
    info = rss_of_pid()
    if info is None:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return info["VmHWM"]


# ---- the NumPy ceiling -----------------------------------------------------------------------
class NumpyCeiling:
    """A pre-sized ``(n_rows, dim)`` table and its element-wise AdaGrad in plain NumPy.

    Invariant: ``acc`` has the table's shape and starts at zero.
    """

    def __init__(self, n_rows: int, dim: int, grad: np.ndarray, lr: float = 0.01,
                 eps: float = 1e-10, seed: int = 2) -> None:
        rng = np.random.default_rng(seed)
        self.table = (rng.random((n_rows, dim), dtype=np.float32) - 0.5) * np.float32(0.02)
        self.acc = np.zeros((n_rows, dim), np.float32)
        self.grad, self.dim = grad, dim
        self.lr, self.eps = np.float32(lr), np.float32(eps)
        self._slot_of: dict[int, int] = {}
        self._new_rows = np.empty((0, dim), np.float32)
        self._rng = rng

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes + self.acc.nbytes)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return np.take(self.table, ids, axis=0)

    def _dedup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(ids, kind="stable")
        s = ids[order]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        return s[starts], np.add.reduceat(self.grad[order], starts, axis=0)

    def train(self, ids: np.ndarray) -> None:
        np.take(self.table, ids, axis=0)
        uniq, g = self._dedup(ids)
        a = self.acc[uniq] + g * g
        self.acc[uniq] = a
        self.table[uniq] -= self.lr * g / (np.sqrt(a) + self.eps)

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Slots of raw ``ids``, new ones taken in order, their rows written once."""
        slot_of = self._slot_of
        before = len(slot_of)
        get = slot_of.setdefault
        slots = np.fromiter((get(k, len(slot_of)) for k in ids.tolist()), np.int64, ids.size)
        after = len(slot_of)
        if after > self._new_rows.shape[0]:
            grown = np.empty((max(after, int(self._new_rows.shape[0] * 1.5) + 1), self.dim),
                             np.float32)
            grown[:before] = self._new_rows[:before]
            self._new_rows = grown
        fresh = after - before
        if fresh:
            self._new_rows[before:after] = (
                self._rng.random((fresh, self.dim), dtype=np.float32) - 0.5) * 0.02
        return slots
