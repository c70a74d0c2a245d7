"""The worker side of the dist store's messages: specs, segments, replies, states files.

Pure functions of a key's :class:`._keys.KeyRecord` and NumPy arrays: no sockets, no store.
Invariant: :func:`parts` and :func:`assemble` are inverses over a record's segments.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ClusterError, ConfigError, OptimizerStateError, ShapeMismatchError
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._ps.partition import ps_key
from .._types import Key
from ._args import as_numpy
from ._keys import KeyRecord

__all__ = ["assemble", "check_agreement", "init_spec", "parts", "read_states",
           "rows_by_server", "target", "write_states"]


def init_spec(key: Key, value: Any, by_pskey: dict[int, Key]) -> list[Any]:
    """What a worker tells the others about a key it inits: [ps_key, key, shape, dtype,
    stype]; ConfigError if it shares its ps_key with another key (``by_pskey``)."""
    pk = ps_key(key)
    other = by_pskey.get(pk)
    if other is not None and other != key:
        raise ConfigError(f"keys {key!r} and {other!r} hash to the same server key. "
                          "Rename one of them.", key=key)
    arr = value if isinstance(value, NDArray) else as_numpy(value)
    stype = "row_sparse" if isinstance(value, RowSparseNDArray) else "default"
    return [pk, key, list(arr.shape), np.dtype(arr.dtype).name, stype]


def check_agreement(payloads: dict[str, Any], specs: list[Any], rank: int) -> None:
    """Raise (the same on every worker) unless every worker inits the same keys alike."""
    bad = {r: p["error"] for r, p in payloads.items() if p and p.get("error")}
    if bad:
        first = min(bad, key=int)
        raise ClusterError(f"init failed on worker {first}: {bad[first]}. Every worker must "
                           "init the same keys with the same shapes.")

    def by_pskey(ss: Any) -> list[Any]:   # the order keys are listed in does not matter
        return sorted(ss or [], key=lambda s: s[0])

    for r, p in sorted(payloads.items(), key=lambda kv: int(kv[0])):
        if by_pskey(p.get("specs")) != by_pskey(specs):
            theirs = {s[1]: s[2:] for s in p.get("specs") or []}
            mine = {s[1]: s[2:] for s in specs}
            diff = sorted({k for k in set(mine) | set(theirs)
                           if mine.get(k) != theirs.get(k)}, key=repr)
            k = diff[0] if diff else None
            raise ShapeMismatchError(
                f"workers disagree on init: key {k!r} is {mine.get(k)} on worker "
                f"{rank} but {theirs.get(k)} on worker {r} ([shape, dtype, stype]). "
                "Every worker must init the same keys with the same shapes and dtypes.",
                key=k)


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


def write_states(fname: str, blobs: list[np.ndarray]) -> None:
    """Save each server's optimizer-states bytes (``np.savez``: no pickle)."""
    named: dict[str, Any] = {f"server_{i}": b for i, b in enumerate(blobs)}
    with open(fname, "wb") as f:
        np.savez(f, **named)


def read_states(fname: str, num_servers: int) -> list[np.ndarray]:
    """Each server's part of a file :func:`write_states` wrote.

    Raises ConfigError if the file cannot be read, and OptimizerStateError (the class a
    local store raises) if it is not a states file of a cluster with ``num_servers``.
    """
    from ..nd._npz import BadArchive, SafeNpz
    try:   # a regular file, its members checked before read (nd._npz)
        with SafeNpz(fname, repr(fname)) as data:
            return [data[f"server_{i}"] for i in range(num_servers)]
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
        raise ConfigError(f"cannot read optimizer states from {fname!r}: {err}. "
                          "Check the path.") from err
    except (OSError, BadArchive) as err:
        raise OptimizerStateError(
            f"cannot load optimizer states from {fname!r}: {err}. Load a file saved "
            "by save_optimizer_states of a cluster with as many servers.") from err


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
