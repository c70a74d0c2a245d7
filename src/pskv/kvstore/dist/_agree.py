"""What every worker must agree on before a dist store changes anything: the keys they
init (:func:`init_spec`, :func:`check_agreement`, a dist store's collective init). The
optimizer checks are ``kvstore._specs``.

"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ClusterError, ConfigError, ShapeMismatchError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._ps.partition import ps_key
from ..._types import Key
from .._args import as_numpy

__all__ = ["check_agreement", "init_spec"]


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
