"""Array plumbing shared by the optimizers: in-place views, row gathering, blockwise runs.

Every update rule is written as a *kernel*: a function of flat, equal-length NumPy arrays
(targets first, then inputs, then scratch buffers) that updates the targets in place with
``out=`` ufunc calls, in the operation order of MXNet 1.9.1's C++ kernels
(``src/operator/optimizer_op-inl.h``). :func:`run` feeds a kernel cache-sized blocks so the
several NumPy passes of one kernel stay in cache, and the scratch buffers stay small.

Invariant: a kernel never reads an element of one block while writing another; every
kernel is elementwise.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ShapeMismatchError, ValueTypeError
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray

__all__ = ["BLOCK", "dense_grad", "grad_parts", "run", "run_rows", "target"]

#: elements per block: 32 Ki float32 = 128 KiB per array, so a kernel's arrays fit in L2
BLOCK = 1 << 15

Kernel = Callable[..., None]


def target(arr: Any, what: str = "weight") -> np.ndarray:
    """The full NumPy array behind a weight or state, to be updated in place.

    A row_sparse weight must hold every row (MXNet's CheckAllRowsPresent).
    """
    if isinstance(arr, RowSparseNDArray):
        if arr._indices.shape[0] != arr.shape[0]:
            raise ShapeMismatchError(
                f"the row_sparse {what} of shape {arr.shape} stores {arr._indices.shape[0]} "
                f"rows; an optimizer needs every row present, as MXNet does. Store it with "
                f"all rows (e.g. mx.nd.zeros(shape).tostype('row_sparse') filled in).",
                shape=arr.shape)
        return arr._data
    if isinstance(arr, NDArray):
        return arr._data
    if isinstance(arr, np.ndarray):
        return arr
    raise ValueTypeError(f"the {what} is a {type(arr).__name__}, not an NDArray. Pass "
                         "mx.nd arrays to the optimizer.")


def grad_parts(grad: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``(values, rows)``: rows is ``None`` for a dense gradient, else sorted unique int64."""
    if isinstance(grad, RowSparseNDArray):
        return grad._data, grad._indices
    if isinstance(grad, NDArray):
        return grad._data, None
    if isinstance(grad, np.ndarray):
        return grad, None
    raise ValueTypeError(f"the gradient is a {type(grad).__name__}, not an NDArray. Pass "
                         "mx.nd arrays to the optimizer.")


def dense_grad(grad: Any) -> np.ndarray:
    """The gradient as a dense NumPy array (MXNet's storage fallback for dense kernels)."""
    values, rows = grad_parts(grad)
    if rows is None:
        return values
    if isinstance(grad, RowSparseNDArray):
        return grad._dense()
    raise ValueTypeError("internal: row indices without a row_sparse array")  # pragma: no cover


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


def run(kernel: Kernel, targets: Sequence[np.ndarray], inputs: Sequence[np.ndarray],
        nscratch: int, dtype: Any = None) -> None:
    """Run ``kernel(*targets, *inputs, *scratch)`` over flat blocks of equal-size arrays.

    Targets are updated in place (a non-contiguous target is copied and written back).
    ``dtype`` is the scratch dtype, by default the first target's.
    """
    flats = [_flat(a) for a in targets]
    ins = [_flat(a) for a in inputs]
    n = flats[0].size
    dt = np.dtype(dtype) if dtype is not None else flats[0].dtype
    if n <= BLOCK:
        kernel(*flats, *ins, *[np.empty(n, dt) for _ in range(nscratch)])
    else:
        scratch = [np.empty(BLOCK, dt) for _ in range(nscratch)]
        for start in range(0, n, BLOCK):
            stop = min(start + BLOCK, n)
            k = stop - start
            kernel(*(f[start:stop] for f in flats), *(a[start:stop] for a in ins),
                   *(b[:k] for b in scratch))
    for orig, flat in zip(targets, flats):
        if not orig.flags.c_contiguous:
            orig[...] = flat.reshape(orig.shape)


def run_rows(kernel: Kernel, targets: Sequence[np.ndarray], inputs: Sequence[np.ndarray],
             rows: np.ndarray, nscratch: int, dtype: Any = None) -> None:
    """Run ``kernel`` on rows ``rows`` of the targets only (a lazy row_sparse update).

    ``inputs`` hold one row per entry of ``rows`` (the row_sparse gradient's data).
    """
    if rows.shape[0] == 0:
        return
    n = targets[0].shape[0]
    if rows.shape[0] == n:  # sorted, unique and all present: rows == arange(n)
        run(kernel, targets, inputs, nscratch, dtype)
        return
    gathered = [t[rows] for t in targets]
    run(kernel, gathered, inputs, nscratch, dtype)
    for t, g in zip(targets, gathered):
        t[rows] = g
