"""``pskv.np``: NumPy-style array creation with ``ctx=``, as ``mxnet.np``.

Arrays print like NumPy's (``array([[1., 1.]])``) and are NDArrays underneath, so every
KVStore call takes them.
"""
from __future__ import annotations

from typing import Any

import numpy as _onp

from .context import Context
from .nd.creation import _creation_dtype
from .nd.ndarray import NDArray, _ctx, _dtype, _shape

__all__ = ["array", "empty", "full", "ndarray", "ones", "zeros"]


class ndarray(NDArray):  # noqa: N801 - the name mxnet.np uses
    """An NDArray that prints like a NumPy array (``mxnet.np.ndarray``).

    Examples
    --------
    >>> import pskv as mx
    >>> mx.np.ones((2, 3)) * (-2)
    array([[-2., -2., -2.],
           [-2., -2., -2.]])
    """

    __slots__ = ()
    _legacy = False  # NumPy's rules: 0-d results, NumPy dtype promotion

    def __repr__(self) -> str:
        text = repr(self._dense())
        dt = self.dtype
        if ", dtype=" in text and dt == _onp.float32:
            text = text[:text.rindex(", dtype=")] + ")"
        elif ", dtype=" not in text and dt not in (_onp.float32, _onp.bool_, _onp.float64,
                                                     _onp.int64):
            text = text[:-1] + f", dtype={dt})"
        if self._ctx.device_type != "cpu":
            text = text[:-1] + f", ctx={self._ctx})"
        return text

    def __str__(self) -> str:
        return str(self._dense())


def _wrap(data: _onp.ndarray, ctx: Context | None) -> ndarray:
    out = object.__new__(ndarray)
    out._data = data
    out._ctx = _ctx(ctx)
    return out


def array(object: Any, dtype: Any = None, ctx: Context | None = None) -> ndarray:
    """Create an array from array-like data, copying it (default dtype float32)."""
    src = object._dense() if isinstance(object, NDArray) else object
    return _wrap(_onp.array(src, dtype=_creation_dtype(object, dtype), copy=True), ctx)


def zeros(shape: Any, dtype: Any = None, order: str = "C", ctx: Context | None = None) -> ndarray:
    """Return a new array of ``shape`` filled with zeros (float32 by default)."""
    return _wrap(_onp.zeros(_shape(shape), dtype=_dtype(dtype)), ctx)


def ones(shape: Any, dtype: Any = None, order: str = "C", ctx: Context | None = None) -> ndarray:
    """Return a new array of ``shape`` filled with ones (float32 by default).

    Examples
    --------
    >>> import pskv as mx
    >>> mx.np.ones((1, 2), ctx=mx.cpu(1)).context
    cpu(1)
    """
    return _wrap(_onp.ones(_shape(shape), dtype=_dtype(dtype)), ctx)


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C",
         ctx: Context | None = None) -> ndarray:
    """Return a new array of ``shape`` filled with ``fill_value``."""
    return _wrap(_onp.full(_shape(shape), fill_value, dtype=_dtype(dtype)), ctx)


def empty(shape: Any, dtype: Any = None, order: str = "C", ctx: Context | None = None) -> ndarray:
    """Return a new array of ``shape`` with unspecified contents."""
    return _wrap(_onp.empty(_shape(shape), dtype=_dtype(dtype)), ctx)
