"""The ``mx.nd`` operator functions gradient code reaches for, with MXNet 1.x's rules.

Each takes NDArrays (a Python number where MXNet takes a scalar), returns a new NDArray on
the first input's context, keeps the input dtype, and never returns a 0-d array (a full
reduction has shape ``(1,)``), as ``mxnet.nd`` does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ShapeMismatchError, ValueTypeError
from .ndarray import NDArray

__all__ = ["abs", "add_n", "clip", "concat", "dot", "max", "maximum", "mean", "min",
           "minimum", "norm", "ones_like", "sqrt", "square", "stack", "sum", "zeros_like"]

def _nd(x: Any, what: str) -> NDArray:
    if not isinstance(x, NDArray):
        raise ValueTypeError(f"nd.{what} takes NDArrays, got {type(x).__name__}. "
                             "Wrap it with mx.nd.array(x).")
    return x


def _like(ref: NDArray, data: Any) -> NDArray:
    """``data`` as an array of ``ref``'s kind and context (legacy: no 0-d result)."""
    return ref._result(data)


def zeros_like(data: NDArray) -> NDArray:
    """Zeros with the shape, dtype and context of ``data``.

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.zeros_like(mx.nd.ones((2,), dtype='int32')).asnumpy()
    array([0, 0], dtype=int32)
    """
    return _like(_nd(data, "zeros_like"), np.zeros_like(data._dense()))


def ones_like(data: NDArray) -> NDArray:
    """Ones with the shape, dtype and context of ``data``."""
    return _like(_nd(data, "ones_like"), np.ones_like(data._dense()))


def add_n(*args: NDArray) -> NDArray:
    """The element-wise sum of arrays of one shape (MXNet's ``ElementWiseSum``).

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.add_n(mx.nd.ones(2), mx.nd.ones(2), mx.nd.ones(2)).asnumpy().tolist()
    [3.0, 3.0]
    """
    if not args:
        raise ValueTypeError("nd.add_n needs at least one array.")
    first = _nd(args[0], "add_n")
    for a in args[1:]:
        if _nd(a, "add_n").shape != first.shape:
            raise ShapeMismatchError(f"nd.add_n got shapes {first.shape} and {a.shape}. "
                                     "Pass arrays of one shape.", shape=a.shape)
    out = first._dense().copy()
    for a in args[1:]:
        out += a._dense().astype(out.dtype, copy=False)
    return _like(first, out)


def concat(*data: NDArray, dim: int = 1) -> NDArray:
    """Join arrays along axis ``dim`` (default 1, as MXNet)."""
    if not data:
        raise ValueTypeError("nd.concat needs at least one array.")
    try:
        out = np.concatenate([_nd(d, "concat")._dense() for d in data], axis=dim)
    except ValueError as err:
        raise ShapeMismatchError(f"nd.concat along dim {dim} got shapes "
                                 f"{[d.shape for d in data]}: {err}.") from err
    return _like(data[0], out)


def stack(*data: NDArray, axis: int = 0) -> NDArray:
    """Stack arrays of one shape along a new axis ``axis``."""
    if not data:
        raise ValueTypeError("nd.stack needs at least one array.")
    try:
        out = np.stack([_nd(d, "stack")._dense() for d in data], axis=axis)
    except ValueError as err:
        raise ShapeMismatchError(f"nd.stack got shapes {[d.shape for d in data]}: {err}.") \
            from err
    return _like(data[0], out)


def sum(data: NDArray, axis: Any = None, keepdims: bool = False) -> NDArray:  # noqa: A001
    """Sum over ``axis`` (all elements by default; shape ``(1,)`` then)."""
    return _nd(data, "sum").sum(axis=axis, keepdims=keepdims)


def mean(data: NDArray, axis: Any = None, keepdims: bool = False) -> NDArray:
    """Mean over ``axis`` (all elements by default; shape ``(1,)`` then)."""
    return _nd(data, "mean").mean(axis=axis, keepdims=keepdims)


def max(data: NDArray, axis: Any = None, keepdims: bool = False) -> NDArray:  # noqa: A001
    """Maximum over ``axis`` (all elements by default; shape ``(1,)`` then)."""
    return _nd(data, "max").max(axis=axis, keepdims=keepdims)


def min(data: NDArray, axis: Any = None, keepdims: bool = False) -> NDArray:  # noqa: A001
    """Minimum over ``axis`` (all elements by default; shape ``(1,)`` then)."""
    return _nd(data, "min").min(axis=axis, keepdims=keepdims)


def norm(data: NDArray, ord: int = 2, axis: Any = None,  # noqa: A002
         keepdims: bool = False) -> NDArray:
    """The L2 (``ord=2``) or L1 (``ord=1``) norm over ``axis`` (all elements by default).

    Examples
    --------
    >>> import pskv as mx
    >>> mx.nd.norm(mx.nd.ones(4)).asnumpy().tolist()
    [2.0]
    """
    if ord not in (1, 2):
        raise ValueTypeError(f"nd.norm(ord={ord!r}): only ord=1 and ord=2 are supported.")
    x = _nd(data, "norm")._dense()
    out: Any
    if axis is None:
        out = np.linalg.norm(x.ravel(), ord=ord)
        if keepdims:
            out = np.reshape(out, (1,) * x.ndim)
    else:
        out = np.linalg.norm(x, ord=ord, axis=axis, keepdims=keepdims)
    return _like(data, np.asarray(out).astype(x.dtype))


def abs(data: NDArray) -> NDArray:  # noqa: A001
    """Element-wise absolute value."""
    return _like(_nd(data, "abs"), np.abs(data._dense()))


def sqrt(data: NDArray) -> NDArray:
    """Element-wise square root (NaN for negative values, as MXNet)."""
    with np.errstate(invalid="ignore"):
        return _like(_nd(data, "sqrt"), np.sqrt(data._dense()).astype(data.dtype))


def square(data: NDArray) -> NDArray:
    """Element-wise square."""
    return _like(_nd(data, "square"), np.square(data._dense()))


def clip(data: NDArray, a_min: float, a_max: float) -> NDArray:
    """Values limited to ``[a_min, a_max]``, in the input dtype."""
    return _nd(data, "clip").clip(a_min, a_max)


def _pairwise(fn: Any, lhs: Any, rhs: Any, what: str) -> NDArray:
    ref = lhs if isinstance(lhs, NDArray) else _nd(rhs, what)
    a = lhs._dense() if isinstance(lhs, NDArray) else np.asarray(lhs).astype(ref.dtype)
    b = rhs._dense() if isinstance(rhs, NDArray) else np.asarray(rhs).astype(ref.dtype)
    try:
        return _like(ref, fn(a, b))
    except ValueError as err:
        raise ShapeMismatchError(f"nd.{what} got shapes {np.shape(a)} and {np.shape(b)}: "
                                 f"{err}.") from err


def maximum(lhs: NDArray | float, rhs: NDArray | float) -> NDArray:
    """Element-wise maximum of two arrays, or of an array and a number."""
    return _pairwise(np.maximum, lhs, rhs, "maximum")


def minimum(lhs: NDArray | float, rhs: NDArray | float) -> NDArray:
    """Element-wise minimum of two arrays, or of an array and a number."""
    return _pairwise(np.minimum, lhs, rhs, "minimum")


def dot(lhs: NDArray, rhs: NDArray, transpose_a: bool = False,
        transpose_b: bool = False) -> NDArray:
    """The matrix product of two arrays (each optionally transposed first)."""
    a = _nd(lhs, "dot")._dense()
    b = _nd(rhs, "dot")._dense()
    a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
    try:
        return _like(lhs, np.dot(a, b))
    except ValueError as err:
        raise ShapeMismatchError(f"nd.dot got shapes {a.shape} and {b.shape}: {err}.") from err
