"""RowSparseNDArray: an array whose non-zero rows are stored with their indices.

Invariant: ``_indices`` is a 1-D int64 array, sorted and unique, each in
``[0, shape[0])``; ``_data`` has shape ``(len(_indices),) + shape[1:]``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context
from ..errors import ShapeMismatchError, UnsupportedError, ValueTypeError
from .ndarray import STORAGE_TYPES, NDArray, _ctx, _dtype, _operand, _shape
from .creation import zeros as dense_zeros

__all__ = ["RowSparseNDArray", "row_sparse_array", "zeros"]


class RowSparseNDArray(NDArray):
    """A row-sparse array: ``data[i]`` is row ``indices[i]``; every other row is zero.

    Examples
    --------
    >>> import numpy as np, pskv as mx
    >>> a = mx.nd.sparse.row_sparse_array((np.ones((2, 3)), [1, 4]), shape=(6, 3))
    >>> a.indices.asnumpy().tolist(), a.shape, a.stype
    ([1, 4], (6, 3), 'row_sparse')
    """

    __slots__ = ("_indices", "_full_shape")

    def __init__(self, data: np.ndarray, indices: np.ndarray, shape: tuple[int, ...],
                 ctx: Context | None = None) -> None:
        super().__init__(data, ctx)
        self._indices = indices
        self._full_shape = shape

    @classmethod
    def from_dense(cls, dense: np.ndarray, ctx: Context | None = None) -> RowSparseNDArray:
        """Row-sparse copy of a dense array, keeping the rows that have a non-zero."""
        flat = dense.reshape(dense.shape[0], -1) if dense.ndim > 1 else dense.reshape(-1, 1)
        idx = np.flatnonzero(flat.any(axis=1)).astype(np.int64)
        return cls(dense[idx].copy(), idx, dense.shape, ctx)

    @classmethod
    def _all_rows(cls, dense: np.ndarray, ctx: Context | None = None) -> RowSparseNDArray:
        """A row-sparse array holding every row of ``dense`` (no copy)."""
        return cls(dense, np.arange(dense.shape[0], dtype=np.int64), dense.shape, ctx)

    def _new(self, data: np.ndarray) -> NDArray:
        return NDArray(data, self._ctx)

    def _dense(self) -> np.ndarray:
        if len(self._indices) == self._full_shape[0]:
            return self._data
        out = np.zeros(self._full_shape, dtype=self._data.dtype)
        out[self._indices] = self._data
        return out

    _read = _dense

    @property
    def shape(self) -> tuple[int, ...]:
        return self._full_shape

    @property
    def size(self) -> int:
        return int(np.prod(self._full_shape))

    @property
    def ndim(self) -> int:
        return len(self._full_shape)

    @property
    def stype(self) -> str:
        return "row_sparse"

    @property
    def data(self) -> NDArray:
        """The stored rows, shape ``(nnz,) + shape[1:]``."""
        return NDArray(self._data, self._ctx)

    @property
    def indices(self) -> NDArray:
        """The row indices of the stored rows, sorted, as an int64 NDArray."""
        return NDArray(self._indices, self._ctx)

    def __len__(self) -> int:
        return self._full_shape[0]

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.shape)
        return f"\n<{type(self).__name__} {shape} @{self._ctx}>"

    def copy(self) -> RowSparseNDArray:
        return RowSparseNDArray(self._data.copy(), self._indices.copy(), self._full_shape,
                                self._ctx)

    def __copy__(self) -> RowSparseNDArray:
        return RowSparseNDArray(self._data, self._indices, self._full_shape, self._ctx)

    def __deepcopy__(self, memo: dict[int, Any]) -> RowSparseNDArray:
        out = self.copy()
        memo[id(self)] = out
        return out

    def __reduce__(self) -> Any:
        return (RowSparseNDArray, (self._data, self._indices, self._full_shape, self._ctx))

    def copyto(self, other: Context | NDArray) -> NDArray:
        if isinstance(other, Context):
            out = self.copy()
            out._ctx = other
            return out
        if isinstance(other, RowSparseNDArray):
            if other.shape != self.shape:
                raise ShapeMismatchError(
                    f"copyto: source shape {self.shape} differs from target shape "
                    f"{other.shape}.", shape=other.shape)
            other._data = self._data.copy()
            other._indices = self._indices.copy()
            return other
        return super().copyto(other)

    def astype(self, dtype: Any, copy: bool = True) -> RowSparseNDArray:
        return RowSparseNDArray(self._data.astype(dtype), self._indices.copy(),
                                self._full_shape, self._ctx)

    def tostype(self, stype: str) -> NDArray:
        if stype == "row_sparse":
            return self.copy()
        if stype == "default":
            return NDArray(self._dense().copy(), self._ctx)
        raise UnsupportedError(
            f"storage type {stype!r} is not supported. Use 'default' or 'row_sparse'.")

    def retain(self, row_ids: Any) -> RowSparseNDArray:
        """Rows ``row_ids`` (sorted, unique) of this array, zeros where none is stored."""
        rows = np.unique(np.asarray(_operand(row_ids)).astype(np.int64).ravel())
        pos = np.searchsorted(self._indices, rows)
        pos_c = np.minimum(pos, max(len(self._indices) - 1, 0))
        present = (pos < len(self._indices)) & (self._indices[pos_c] == rows) \
            if len(self._indices) else np.zeros(len(rows), bool)
        data = np.zeros((len(rows),) + self._full_shape[1:], dtype=self._data.dtype)
        data[present] = self._data[pos_c[present]]
        return RowSparseNDArray(data, rows, self._full_shape, self._ctx)

    def __getitem__(self, idx: Any) -> NDArray:
        return NDArray(self._dense(), self._ctx)[idx]

    def __setitem__(self, idx: Any, value: Any) -> None:
        if isinstance(idx, slice) and idx == slice(None):
            if isinstance(value, RowSparseNDArray):
                value.copyto(self)
                return
            dense = np.broadcast_to(np.asarray(_operand(value), dtype=self.dtype),
                                    self._full_shape)
            self._data = np.array(dense)
            self._indices = np.arange(self._full_shape[0], dtype=np.int64)
            return
        raise UnsupportedError("a row_sparse array supports only `a[:] = value`. "
                               "Convert with tostype('default') to index it.")

    def _binary(self, other: Any, fn: Any, reverse: bool = False) -> Any:
        # scaling keeps sparsity, as MXNet's elemwise ops on row_sparse do
        if fn is np.multiply and isinstance(other, (int, float, np.generic)):
            return RowSparseNDArray(self._data * self._scalar(other), self._indices.copy(),
                                    self._full_shape, self._ctx)
        if fn in (np.add, np.subtract) and isinstance(other, RowSparseNDArray):
            return _rsp_add(self, other, -1.0 if fn is np.subtract and not reverse else 1.0,
                            reverse and fn is np.subtract)
        return NDArray._binary(self, other, fn, reverse)

    def _inplace(self, other: Any, fn: Any) -> Any:
        result = self._binary(other, fn)
        if result is NotImplemented:
            return NotImplemented
        if isinstance(result, RowSparseNDArray):
            self._data = result._data.astype(self.dtype, copy=False)
            self._indices = result._indices
        else:
            self._data = np.asarray(result._data, dtype=self.dtype)
            self._indices = np.arange(self._full_shape[0], dtype=np.int64)
        return self


def _rsp_add(a: RowSparseNDArray, b: RowSparseNDArray, sign_b: float,
             negate_a: bool) -> RowSparseNDArray:
    if a.shape != b.shape:
        raise ShapeMismatchError(f"cannot add row_sparse arrays of shapes {a.shape} and "
                                 f"{b.shape}.", shape=a.shape)
    rows = np.union1d(a._indices, b._indices).astype(np.int64)
    data = np.zeros((len(rows),) + a.shape[1:], dtype=np.result_type(a.dtype, b.dtype))
    data[np.searchsorted(rows, a._indices)] += -a._data if negate_a else a._data
    data[np.searchsorted(rows, b._indices)] += sign_b * b._data if sign_b != 1.0 else b._data
    return RowSparseNDArray(data, rows, a.shape, a._ctx)


def row_sparse_array(arg1: Any, shape: Any = None, ctx: Context | None = None,
                     dtype: Any = None) -> RowSparseNDArray:
    """Create a RowSparseNDArray from ``(data, indices)`` or from a dense array.

    Parameters
    ----------
    arg1 : tuple of (data, indices), or array_like
        ``data`` has shape ``(nnz,) + shape[1:]``; ``indices`` are the row numbers.
        A dense array keeps its non-zero rows.
    shape : tuple of int, optional
        The full shape; inferred from a dense ``arg1`` or from the largest index.
    ctx : Context, optional
    dtype : str or numpy.dtype, optional
        Default: the data's dtype if it is an array, else float32.
    """
    if isinstance(arg1, tuple) and len(arg1) == 2:
        raw, idx = _operand(arg1[0]), _operand(arg1[1])
        dt = np.dtype(dtype) if dtype is not None else (
            raw.dtype if isinstance(raw, np.ndarray) else np.dtype(np.float32))
        data = np.array(raw, dtype=dt, copy=True)
        indices = np.asarray(idx).astype(np.int64).ravel()
        if data.ndim == 0 or data.shape[0] != len(indices):
            raise ShapeMismatchError(
                f"row_sparse_array: data has shape {data.shape} but there are "
                f"{len(indices)} indices. Give one data row per index.", shape=data.shape)
        if shape is None:
            shape = (int(indices.max()) + 1 if len(indices) else 0,) + data.shape[1:]
        full = _shape(shape)
        if full[1:] != data.shape[1:]:
            raise ShapeMismatchError(
                f"row_sparse_array: data rows have shape {data.shape[1:]} but the array "
                f"shape is {full}.", shape=full)
        if len(indices) and (indices.min() < 0 or indices.max() >= full[0]):
            raise ShapeMismatchError(
                f"row_sparse_array: indices must lie in [0, {full[0]}).", shape=full)
        order = np.argsort(indices, kind="stable")
        if len(np.unique(indices)) != len(indices):
            raise ShapeMismatchError("row_sparse_array: indices must be unique.", shape=full)
        return RowSparseNDArray(data[order], indices[order], full, _ctx(ctx))
    if isinstance(arg1, (NDArray, np.ndarray, list)):
        dense = np.array(_operand(arg1), dtype=_dtype(dtype) if dtype is not None or
                         not isinstance(_operand(arg1), np.ndarray) else None)
        return RowSparseNDArray.from_dense(dense, _ctx(ctx))
    raise ValueTypeError(
        f"row_sparse_array() takes (data, indices) or a dense array, got {type(arg1).__name__}.")


def zeros(stype: str, shape: Any, ctx: Context | None = None, dtype: Any = None,
          **kwargs: Any) -> NDArray:
    """Return an all-zero array of storage type ``stype`` (``'row_sparse'`` or ``'default'``).

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.sparse.zeros('row_sparse', (4, 2)).indices.shape
    (0,)
    """
    if stype == "default":
        return dense_zeros(shape, ctx=ctx, dtype=dtype)
    if stype != "row_sparse":
        raise UnsupportedError(f"storage type {stype!r} is not supported. Use 'row_sparse'.")
    full = _shape(shape)
    dt = _dtype(dtype)
    return RowSparseNDArray(np.zeros((0,) + full[1:], dtype=dt), np.zeros(0, np.int64), full,
                            _ctx(ctx))


def _zeros_row_sparse(shape: Any, ctx: Any, dtype: Any) -> NDArray:
    return zeros("row_sparse", shape, ctx=ctx, dtype=dtype)


STORAGE_TYPES["row_sparse"] = (RowSparseNDArray.from_dense, _zeros_row_sparse)
