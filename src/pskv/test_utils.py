"""``pskv.test_utils``: the helpers of ``mxnet.test_utils`` that KVStore tests import.

``assert_almost_equal`` (with MXNet's per-dtype default tolerances), ``almost_equal``,
``same``, ``assert_exception``, ``rand_ndarray`` (dense or row_sparse), ``random_arrays``,
``default_context`` and ``environment``, so that MXNet's own KVStore tests run unchanged
(see docs/mxnet-tests.md). Random draws use ``numpy.random``'s global state, as MXNet's do,
so ``np.random.seed`` makes them repeat.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import numpy as np

from .context import Context, current_context
from .errors import UnsupportedError, ValueTypeError
from .nd.ndarray import NDArray
from .nd.creation import array as nd_array
from .nd.creation import zeros as nd_zeros
from .nd.sparse import row_sparse_array

__all__ = ["almost_equal", "assert_almost_equal", "assert_exception", "default_context",
           "environment", "rand_ndarray", "random_arrays", "same"]

# MXNet 1.9.1 test_utils default_rtols / default_atols: float types only; exact otherwise
_RTOL: dict[str, float] = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-5}
_ATOL: dict[str, float] = {"float16": 1e-1, "float32": 1e-3, "float64": 1e-20}


def default_context() -> Context:
    """The context tests create arrays on: the current context (``cpu(0)`` by default)."""
    return current_context()


def _numpy(x: Any) -> np.ndarray:
    return x.asnumpy() if isinstance(x, NDArray) else np.asarray(x)


def _tol(x: np.ndarray, given: float | None, table: dict[str, float]) -> float:
    if given is not None:
        return float(given)
    return table.get(np.dtype(x.dtype).name, 0.0)


def almost_equal(a: Any, b: Any, rtol: float | None = None, atol: float | None = None,
                 equal_nan: bool = False) -> bool:
    """Whether ``a`` and ``b`` are element-wise equal within tolerances (``np.allclose``).

    With no tolerance given, MXNet's float64 defaults apply (rtol 1e-5, atol 1e-20).
    """
    return bool(np.allclose(_numpy(a), _numpy(b), rtol=1e-5 if rtol is None else rtol,
                            atol=1e-20 if atol is None else atol, equal_nan=equal_nan))


def assert_almost_equal(a: Any, b: Any, rtol: float | None = None, atol: float | None = None,
                        names: tuple[str, str] = ("a", "b"), equal_nan: bool = False,
                        **kwargs: Any) -> None:
    """Raise ``AssertionError`` unless ``a`` and ``b`` are equal within tolerances.

    Parameters
    ----------
    a, b : NDArray, numpy.ndarray or number
    rtol, atol : float, optional
        Default: the looser of the two dtypes' defaults (float16 1e-2 / 1e-1, float32
        1e-4 / 1e-3, float64 1e-5 / 1e-20; integer and bool types compare exactly).
    names : tuple of str
        Names for the two arrays in the message.
    equal_nan : bool, default False

    Examples
    --------
    >>> import numpy as np, pskv as mx
    >>> from pskv.test_utils import assert_almost_equal
    >>> assert_almost_equal(mx.nd.ones((2,)) * 1.00001, np.ones(2))
    """
    x, y = _numpy(a), _numpy(b)
    rt = max(_tol(x, rtol, _RTOL), _tol(y, rtol, _RTOL))
    at = max(_tol(x, atol, _ATOL), _tol(y, atol, _ATOL))
    if np.allclose(x, y, rtol=rt, atol=at, equal_nan=equal_nan):
        return
    # NumPy's message lists the mismatches; the raise below covers broadcast-only cases
    np.testing.assert_allclose(x, y, rtol=rt, atol=at, equal_nan=equal_nan,
                               err_msg=f"{names[0]} and {names[1]} differ")
    raise AssertionError(f"{names[0]} {x!r} and {names[1]} {y!r} differ beyond rtol={rt}, "
                         f"atol={at}")


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have the same shape and elements."""
    return bool(np.array_equal(_numpy(a), _numpy(b)))


def assert_exception(f: Callable[..., Any], exception_type: type[BaseException] |
                     tuple[type[BaseException], ...], *args: Any, **kwargs: Any) -> None:
    """Raise ``AssertionError`` unless ``f(*args, **kwargs)`` raises ``exception_type``."""
    try:
        f(*args, **kwargs)
    except exception_type:
        return
    raise AssertionError(f"{getattr(f, '__name__', f)!s} did not raise {exception_type!r}")


def random_arrays(*shapes: tuple[int, ...]) -> Any:
    """Standard-normal float32 NumPy arrays of the given shapes (one array for one shape)."""
    arrays = [np.asarray(np.random.randn(*s), dtype=np.float32) for s in shapes]
    return arrays[0] if len(arrays) == 1 else arrays


def rand_ndarray(shape: tuple[int, ...], stype: str = "default", density: float | None = None,
                 dtype: Any = None, ctx: Context | None = None, **kwargs: Any) -> NDArray:
    """A random array: standard normal values (dense), or uniform [0, 1) rows (row_sparse).

    Parameters
    ----------
    shape : tuple of int
    stype : {'default', 'row_sparse'}
    density : float, optional
        For row_sparse: the chance that a row is stored (default: a random number).
    dtype : str or numpy.dtype, default float32
    ctx : Context, optional
    """
    ctx = ctx if ctx is not None else default_context()
    if stype == "default":
        return nd_array(random_arrays(tuple(shape)), ctx=ctx, dtype=dtype)
    if stype != "row_sparse":
        raise UnsupportedError(f"rand_ndarray: storage type {stype!r} is not supported. "
                               "Use 'default' or 'row_sparse'.")
    dt = np.dtype(np.float32 if dtype is None else dtype)
    density = np.random.rand() if density is None else density
    rows = np.flatnonzero(np.random.rand(shape[0]) < density)
    if len(rows) == 0:
        return nd_zeros(shape, ctx=ctx, dtype=dt, stype="row_sparse")
    values = np.random.rand(len(rows), *shape[1:]).astype(dt)
    return row_sparse_array((values, rows), shape=shape, ctx=ctx, dtype=dt)


@contextlib.contextmanager
def environment(*args: Any) -> Iterator[None]:
    """Set environment variables inside a ``with`` block, restoring them after.

    Takes ``(name, value)`` or a dict ``{name: value}``; a value of None unsets the name.
    """
    if len(args) == 2:
        spec = {args[0]: args[1]}
    elif len(args) == 1 and isinstance(args[0], dict):
        spec = dict(args[0])
    else:
        raise ValueTypeError("environment() takes (name, value) or a dict {name: value}.")
    saved = {name: os.environ.get(name) for name in spec}
    try:
        for name, value in spec.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
