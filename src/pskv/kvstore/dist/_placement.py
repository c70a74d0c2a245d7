"""Where a key's values travel: its segments on the servers (KeyRecord.segments).

Pure functions of a key's :class:`._keys.KeyRecord` and NumPy arrays: no sockets, no store.
Invariant: :func:`parts` and :func:`assemble` are inverses over a record's segments.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...nd.sparse import RowSparseNDArray
from .._args import as_numpy
from .._keys import KeyRecord

__all__ = ["assemble", "parts", "rows_by_server", "target"]


def parts(info: KeyRecord, data: np.ndarray) -> list[np.ndarray]:
    """``data`` (the key's full dense value) cut into its segments (views)."""
    if info.sparse:
        return [data[s.start:s.stop] for s in info.segments]
    if len(info.segments) == 1:
        return [data.reshape(info.shape)]
    flat = data.reshape(-1)
    return [flat[s.start:s.stop] for s in info.segments]


def assemble(info: KeyRecord, got: list[np.ndarray], out: np.ndarray) -> None:
    """Copy each segment's reply into ``out`` (unless it was read there in place)."""
    if len(got) == 1:
        if got[0] is not out and not np.may_share_memory(got[0], out):
            np.copyto(out, got[0].reshape(info.shape), casting="same_kind")
        return
    dst = out if info.sparse else out.reshape(-1)
    for seg, part in zip(info.segments, got):
        view = dst[seg.start:seg.stop]
        if not np.may_share_memory(part, view):
            np.copyto(view, part, casting="same_kind")


def target(info: KeyRecord, outs: list[Any]) -> np.ndarray | None:
    """An out the reply can be read straight into: dense, contiguous, same dtype."""
    for o in outs:
        if isinstance(o, RowSparseNDArray):
            continue
        arr = as_numpy(o)
        if arr.dtype == info.dtype and arr.flags.c_contiguous and arr.flags.writeable:
            return arr
    return None


def rows_by_server(reqs: list[tuple[KeyRecord, np.ndarray]]) \
        -> dict[int, tuple[list[int], list[np.ndarray], list[tuple[int, int]]]]:
    """A row_sparse_pull's requests (a record and sorted row ids each) per server: the
    ps_keys, the row ids relative to each segment, and (request, first row) to put the
    reply's rows back."""
    per: dict[int, tuple[list[int], list[np.ndarray], list[tuple[int, int]]]] = {}
    for i, (info, r) in enumerate(reqs):
        for seg in info.segments:
            lo, hi = np.searchsorted(r, [seg.start, seg.stop])
            pk, arrays, where = per.setdefault(seg.server, ([], [], []))
            pk.append(info.pskey)
            arrays.append(r[lo:hi] - seg.start)
            where.append((i, int(lo)))
    return per
