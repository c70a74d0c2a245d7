"""The argument checks of a table's calls, as functions of its spec and name: a
:class:`DynamicTable` runs them on its own calls, and a dist worker, which holds only the
:class:`TableSpec` of each table key (its rows live on the servers), runs the same ones,
so both raise the same errors. No rows, no state.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ShapeMismatchError, TableIdError
from .spec import TableSpec

__all__ = ["check_grads", "check_ids"]


def check_ids(name: Any, ids: Any, what: str) -> np.ndarray:
    """``ids`` as int64 (any shape); TableIdError naming table ``name`` and the call
    ``what`` if they are not integers that fit int64."""
    try:
        arr = np.asarray(ids)
    except ValueError as err:     # ragged nested lists
        raise TableIdError(f"{what} of table {name!r}: the IDs are ragged ({err}). "
                           "Pass a flat int64 array.", key=name) from err
    if arr.dtype.kind not in "iu":
        raise TableIdError(
            f"{what} of table {name!r} got IDs of dtype {arr.dtype}; IDs are "
            "integers. Pass an int64 array (float IDs lose precision above 2**53).",
            key=name)
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise TableIdError(f"{what} of table {name!r} got an unsigned ID above "
                           "2**63-1. Pass int64 IDs.", key=name)
    return arr.astype(np.int64, copy=False)


def check_grads(spec: TableSpec, name: Any, ids: np.ndarray, grads: Any,
                what: str) -> np.ndarray:
    """``grads`` as an array of one row of ``spec.dim`` real numbers per ID of ``ids``;
    ShapeMismatchError naming table ``name`` otherwise."""
    try:
        g = np.asarray(grads)
    except ValueError as err:     # ragged nested lists
        raise ShapeMismatchError(f"{what} of table {name!r}: the values are ragged "
                                 f"({err}). Pass a ({ids.size}, {spec.dim}) array.",
                                 key=name) from err
    want = (ids.size, spec.dim)
    if g.dtype.kind not in "iuf" or g.shape != want:
        raise ShapeMismatchError(
            f"{what} of table {name!r} got values of shape {g.shape} and dtype "
            f"{g.dtype}, but {ids.size} IDs of a table of dim {spec.dim} need "
            f"shape {want} of a real dtype. Pass one row of {spec.dim} numbers per "
            "ID.", key=name, shape=g.shape)
    return g
