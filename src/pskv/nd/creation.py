"""Creating NDArrays: ``array``, ``empty``, ``zeros``, ``ones``, ``full``, ``arange``.

MXNet's rules: float32 unless a dtype is given (an NDArray source keeps its own, a NumPy
source does not), the current context unless one is given, and ``stype`` for a sparse
array where a storage type was registered (nd/sparse.py registers ``row_sparse``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context
from ..errors import UnsupportedError, ValueTypeError
from .ndarray import _DEFAULT_DTYPE, STORAGE_TYPES, NDArray, _ctx, _dtype, _shape

__all__ = ["arange", "array", "empty", "full", "ones", "waitall", "zeros"]


def _creation_dtype(source: Any, dtype: Any) -> np.dtype[Any]:
    if dtype is not None:
        given: np.dtype[Any] = np.dtype(dtype)
        return given
    if isinstance(source, (NDArray, np.ndarray)):
        dt: np.dtype[Any] = np.dtype(source.dtype)
        return dt
    return np.dtype(_DEFAULT_DTYPE)


def array(source_array: Any, ctx: Context | None = None, dtype: Any = None) -> NDArray:
    """Create an NDArray from any array-like object, copying it.

    Parameters
    ----------
    source_array : array_like
        An NDArray, NumPy array, DLPack array or nested lists.
    ctx : Context, optional
        Device context (default: the current context).
    dtype : str or numpy.dtype, optional
        The source's dtype if it is an NDArray, else ``float32`` (a float64 or int
        NumPy array becomes float32, as in MXNet 1.x; pass ``dtype=`` to keep it).

    Examples
    --------
    >>> import numpy as np, pskv as mx
    >>> mx.nd.array([1, 2, 3]).dtype
    dtype('float32')
    >>> mx.nd.array(np.zeros(2)).dtype, mx.nd.array(np.zeros(2), dtype='float64').dtype
    (dtype('float32'), dtype('float64'))
    """
    if source_array is None:
        raise ValueTypeError("nd.array() got None. Pass a list, a NumPy array or an NDArray.")
    # MXNet 1.x: only an NDArray source keeps its dtype (ndarray/utils.py array)
    dt = _creation_dtype(source_array if isinstance(source_array, NDArray) else None, dtype)
    if isinstance(source_array, NDArray):
        data = np.array(source_array._dense(), dtype=dt, copy=True)
    else:
        data = np.array(np.asarray(source_array), dtype=dt, copy=True)
    return NDArray(data, _ctx(ctx))


def empty(shape: Any, ctx: Context | None = None, dtype: Any = None) -> NDArray:
    """Return a new array of ``shape`` with unspecified contents."""
    return NDArray(np.empty(_shape(shape), dtype=_dtype(dtype)), _ctx(ctx))


def _maybe_sparse(stype: str | None, shape: Any, ctx: Any, dtype: Any) -> NDArray | None:
    if stype is None or stype == "default":
        return None
    if stype in STORAGE_TYPES:
        _, sparse_zeros = STORAGE_TYPES[stype]
        result: NDArray = sparse_zeros(shape, ctx, dtype)
        return result
    raise UnsupportedError(f"storage type {stype!r} is not supported. Use 'default' or "
                           "'row_sparse'.")


def zeros(shape: Any, ctx: Context | None = None, dtype: Any = None,
          stype: str | None = None, **kwargs: Any) -> NDArray:
    """Return a new array of ``shape`` filled with zeros.

    Parameters
    ----------
    shape : int or tuple of int
    ctx : Context, optional
    dtype : str or numpy.dtype, default float32
    stype : str, optional
        ``'row_sparse'`` returns an empty RowSparseNDArray.

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.zeros((2, 3), mx.gpu(0)).context
    gpu(0)
    """
    sparse = _maybe_sparse(stype, shape, ctx, dtype)
    if sparse is not None:
        return sparse
    return NDArray(np.zeros(_shape(shape), dtype=_dtype(dtype)), _ctx(ctx))


def ones(shape: Any, ctx: Context | None = None, dtype: Any = None, **kwargs: Any) -> NDArray:
    """Return a new array of ``shape`` filled with ones.

    Examples
    --------
    >>> import pskv as mx
    >>> (mx.nd.ones((2, 3)) * 2).asnumpy().tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    return NDArray(np.ones(_shape(shape), dtype=_dtype(dtype)), _ctx(ctx))


def full(shape: Any, val: Any, ctx: Context | None = None, dtype: Any = None,
         **kwargs: Any) -> NDArray:
    """Return a new array of ``shape`` filled with ``val``."""
    return NDArray(np.full(_shape(shape), val, dtype=_dtype(dtype)), _ctx(ctx))


def arange(start: float, stop: float | None = None, step: float = 1.0, repeat: int = 1,
           infer_range: bool = False, ctx: Context | None = None,
           dtype: Any = None) -> NDArray:
    """Return evenly spaced values in ``[start, stop)``, each repeated ``repeat`` times.

    Parameters
    ----------
    start : number
        The start, or the stop (from 0) when ``stop`` is None.
    stop : number, optional
    step : number, default 1
    repeat : int, default 1
        How many times each value is repeated.
    infer_range : bool, default False
        Not supported (MXNet uses it in symbolic graphs only).
    ctx : Context, optional
    dtype : str or numpy.dtype, default float32

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.arange(3).asnumpy().tolist(), mx.nd.arange(1, 7, 2, repeat=2).asnumpy().tolist()
    ([0.0, 1.0, 2.0], [1.0, 1.0, 3.0, 3.0, 5.0, 5.0])
    """
    if infer_range:
        raise UnsupportedError("nd.arange(infer_range=True) is for symbols; pass stop instead.")
    if stop is None:
        start, stop = 0.0, start
    if isinstance(repeat, bool) or not isinstance(repeat, (int, np.integer)) or repeat < 1:
        raise ValueTypeError(f"arange: repeat={repeat!r} is not a positive int. Pass e.g. 2.")
    dt = _dtype(dtype)
    # computed in float64 then cast, so a float32 result has exactly MXNet's length
    values = np.arange(start, stop, step, dtype=np.float64).astype(dt)
    return NDArray(np.repeat(values, int(repeat)), _ctx(ctx))


def waitall() -> None:
    """Wait for all pending computation; pskv computes eagerly, so this returns at once."""
