"""Sums and copies of big arrays, split across threads (NumPy releases the GIL), and the
merge of the values a local store is given for one key (one per device).

Invariant: a call returns only after every chunk is written; chunks never overlap.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._ps.config import reduce_threads
from .._types import Key
from ._args import as_numpy

__all__ = ["DeviceMerge", "Reducer", "sum_row_sparse", "sum_rows"]

#: below this many elements one thread is faster than handing work to the pool
PARALLEL_MIN = 1 << 17


def _sum_chunk(out: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    # same left-to-right order as MXNet's ElementwiseSum on CPU
    if len(arrays) == 1:
        np.copyto(out, arrays[0], casting="same_kind")
        return
    np.add(arrays[0], arrays[1], out=out, casting="same_kind")
    for a in arrays[2:]:
        np.add(out, a, out=out, casting="same_kind")


class Reducer:
    """Sums and copies dense arrays, with a thread pool for big ones.

    Parameters
    ----------
    threads : int, optional
        Pool size; default ``PSKV_REDUCE_THREADS`` (read here, through the config module),
        else ``min(os.cpu_count(), 8)``. 1 disables the pool.
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is None:
            threads = reduce_threads()
        self.threads = max(1, threads if threads is not None else min(os.cpu_count() or 1, 8))
        self._pool: ThreadPoolExecutor | None = None

    def _chunks(self, size: int) -> list[tuple[int, int]]:
        n = min(self.threads, max(1, size // (PARALLEL_MIN // 2)))
        step = -(-size // n)
        step += (-step) % 64  # cache-line-friendly chunk starts
        return [(a, min(a + step, size)) for a in range(0, size, step)]

    def _run(self, out: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        if out.size < PARALLEL_MIN or self.threads == 1 or not (
                out.flags.c_contiguous and all(a.flags.c_contiguous and a.shape == out.shape
                                               for a in arrays)):
            _sum_chunk(out, arrays)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pskv-reduce")
        o = out.reshape(-1)
        flats = [a.reshape(-1) for a in arrays]
        chunks = self._chunks(o.size)
        futures = [self._pool.submit(_sum_chunk, o[a:b], [f[a:b] for f in flats])
                   for a, b in chunks[1:]]
        a, b = chunks[0]
        _sum_chunk(o[a:b], [f[a:b] for f in flats])
        for fut in futures:
            fut.result()

    def sum_into(self, out: np.ndarray, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """``out[:] = arrays[0] + arrays[1] + ...`` (left to right), cast same_kind."""
        self._run(out, arrays)
        return out

    def copy_into(self, out: np.ndarray, src: np.ndarray) -> np.ndarray:
        """``out[:] = src``, cast same_kind."""
        if out.size < PARALLEL_MIN:
            np.copyto(out, src, casting="same_kind")
        else:
            self._run(out, (src,))
        return out

    def broadcast_into(self, outs: Sequence[np.ndarray], src: np.ndarray) -> None:
        """``o[:] = src`` for every ``o``, one hand-off to the pool for all of them."""
        if len(outs) == 1 or src.size < PARALLEL_MIN or self.threads == 1 or not (
                src.flags.c_contiguous and all(o.flags.c_contiguous and o.shape == src.shape
                                               for o in outs)):
            for o in outs:
                self.copy_into(o, src)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pskv-reduce")
        flat = src.reshape(-1)
        flats = [o.reshape(-1) for o in outs]

        def chunk(a: int, b: int) -> None:
            for f in flats:
                np.copyto(f[a:b], flat[a:b], casting="same_kind")

        chunks = self._chunks(flat.size)
        futures = [self._pool.submit(chunk, a, b) for a, b in chunks[1:]]
        chunk(*chunks[0])
        for fut in futures:
            fut.result()

    def close(self) -> None:
        """Stop the pool's threads (a later call starts a new pool)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def sum_rows(parts: Sequence[tuple[np.ndarray, np.ndarray]], shape: tuple[int, ...],
             dtype: Any, unique_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sum row_sparse parts ``(rows, data)``: the union of their rows (sorted), and data.

    The one row_sparse sum of pskv (local store, worker and server). ``unique_rows``: each
    part's rows are known to be unique (a RowSparseNDArray's are); else repeated rows of
    one part are summed too.
    """
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0,) + tuple(shape[1:]), dtype)
    rows = np.unique(np.concatenate([r for r, _ in parts]))
    data = np.zeros((len(rows),) + tuple(shape[1:]), dtype=dtype)
    for r, d in parts:
        if unique_rows:
            data[np.searchsorted(rows, r)] += d
        else:
            np.add.at(data, np.searchsorted(rows, r), d)
    return rows, data


def sum_row_sparse(vals: list[Any]) -> RowSparseNDArray:
    """Sum RowSparseNDArrays: the union of their rows, sorted."""
    first: RowSparseNDArray = vals[0]
    if len(vals) == 1:
        return RowSparseNDArray(first._data.copy(), first._indices.copy(), first.shape,
                                first.context)
    rows, data = sum_rows([(v._indices, v._data) for v in vals], first.shape, first.dtype)
    return RowSparseNDArray(data, rows, first.shape, first.context)


class DeviceMerge:
    """The sum of the values pushed for one key, one per device, as MXNet's ``Comm``
    reduces them: row_sparse rows summed as rows, dense values summed in device order,
    and with gradient compression (``compressor``) each device's value quantized with its own
    error-feedback residual, then dequantized, before the sum
    (``CommDevice::ReduceCompressed``)."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        #: the store's gradient compression, or None
        self.compressor: Any = None
        self._residual: dict[tuple[Key, int], np.ndarray] = {}
        self._merge: dict[Key, np.ndarray] = {}

    def dense_values(self, key: Key, vals: list[Any]) -> list[np.ndarray]:
        """``vals`` as dense arrays (compressed and decompressed with ``compressor``)."""
        arrays = [v._dense() if isinstance(v, NDArray) else as_numpy(v) for v in vals]
        if self.compressor is None:
            return arrays
        out = []
        for i, a in enumerate(arrays):
            res = self._residual.get((key, i))
            if res is None:
                res = self._residual[(key, i)] = np.zeros(a.shape, np.float32)
            out.append(self.compressor.roundtrip(np.asarray(a, np.float32), res))
        return out

    def assign(self, key: Key, vals: list[Any], stored: NDArray) -> None:
        """Set ``stored`` to the sum of ``vals`` (no updater)."""
        if all(isinstance(v, RowSparseNDArray) for v in vals) and self.compressor is None:
            merged = sum_row_sparse(vals)
            table = stored._data
            table[...] = 0
            table[merged._indices] = merged._data
            return
        self.reducer.sum_into(stored._data, self.dense_values(key, vals))

    def merged(self, key: Key, vals: list[Any], stored: NDArray) -> NDArray:
        """The sum of ``vals`` as an NDArray the updater may read but not keep."""
        if all(isinstance(v, RowSparseNDArray) for v in vals) and self.compressor is None:
            merged = sum_row_sparse(vals)
            merged._data.flags.writeable = False
            return merged
        arrays = self.dense_values(key, vals)
        if len(arrays) == 1 and arrays[0].dtype == stored.dtype:
            view = arrays[0].view()  # no copy: MXNet hands a single value through too
            view.flags.writeable = False
            return NDArray(view, stored.context)
        buf = self._merge.get(key)
        if buf is None:
            buf = self._merge[key] = np.empty(stored.shape, stored.dtype)
        buf.flags.writeable = True
        self.reducer.sum_into(buf, arrays)
        buf.flags.writeable = False
        return NDArray(buf, stored.context)
