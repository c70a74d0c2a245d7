"""NDArray: a NumPy array tagged with a Context, with MXNet's ``mx.nd`` API.

Invariant: ``_data`` is a NumPy array the NDArray owns (or a view of one it owns, for
slices); ``_ctx`` is a Context. Operators return new arrays, in-place operators write
into ``_data``.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np

from ..context import Context, current_context
from ..errors import ShapeMismatchError, UnsupportedError, ValueTypeError

__all__ = ["NDArray"]

_DEFAULT_DTYPE = np.float32

#: storage types besides 'default': name -> (from_dense(dense, ctx), zeros(shape, ctx, dtype)).
#: nd/sparse.py registers 'row_sparse' when ``pskv.nd`` is imported, so this module never
#: imports that one (no import cycle between them).
STORAGE_TYPES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _dtype(dtype: Any) -> np.dtype[Any]:
    return np.dtype(_DEFAULT_DTYPE if dtype is None else dtype)


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    try:
        return tuple(int(s) for s in shape)
    except TypeError:
        raise ShapeMismatchError(
            f"shape {shape!r} is not an int or a tuple of ints. Pass e.g. (2, 3).",
            shape=shape) from None


def _dim(s: Any) -> int:
    """One reshape dimension: an int, or a float with a whole value."""
    if isinstance(s, (float, np.floating)):
        if not float(s).is_integer():
            raise ShapeMismatchError(f"reshape dimension {s!r} is not a whole number. "
                                     "Pass ints, e.g. n // 2.", shape=s)
        return int(s)
    return operator.index(s)


def _ctx(ctx: Context | str | None) -> Context:
    if ctx is None:
        return current_context()
    if isinstance(ctx, Context):
        return ctx
    if isinstance(ctx, str):
        return Context(ctx)
    raise ValueTypeError(f"ctx {ctx!r} is not a Context. Pass e.g. mx.cpu(0) or mx.gpu(1).")


def _operand(x: Any) -> Any:
    """Return the NumPy form of an operand: NDArray data, NumPy array or scalar."""
    if isinstance(x, NDArray):
        return x._dense()
    return x


class NDArray:
    """A dense n-dimensional array on a device context, backed by NumPy.

    Create arrays with :func:`array`, :func:`ones`, :func:`zeros`, :func:`full` or
    :func:`empty` rather than the constructor.

    Examples
    --------
    >>> import pskv as mx
    >>> a = mx.nd.ones((2, 3)) * 2
    >>> a.asnumpy()
    array([[2., 2., 2.],
           [2., 2., 2.]], dtype=float32)
    >>> a += 1
    >>> a[0, 0].shape, a[0, 0].item()  # one element is a (1,) array, as in MXNet 1.x
    ((1,), 3.0)
    """

    __slots__ = ("_data", "_ctx", "__weakref__")
    __array_priority__ = 1000.0  # numpy scalars/arrays defer to our operators
    # MXNet 1.x legacy rules: no 0-d results from indexing or reductions (they have shape
    # (1,)), a scalar operand takes the array's dtype, comparisons give the array's dtype.
    # ``pskv.np.ndarray`` turns this off and follows NumPy.
    _legacy = True

    def __init__(self, data: np.ndarray, ctx: Context | None = None) -> None:
        self._data = data
        self._ctx = ctx if ctx is not None else current_context()

    def _new(self, data: np.ndarray) -> NDArray:
        out = object.__new__(type(self))
        out._data = data
        out._ctx = self._ctx
        return out

    def _dense(self) -> np.ndarray:
        return self._data

    def _read(self) -> np.ndarray:
        """The dense values for a read that neither keeps nor hands out the array."""
        return self._data

    def _result(self, data: Any) -> NDArray:
        """Wrap an operation's result; legacy arrays turn a 0-d result into shape (1,)."""
        data = np.asarray(data)
        if data.ndim == 0 and self._legacy:
            data = data.reshape(1)
        return self._new(data)

    def _scalar(self, x: Any) -> Any:
        """A Python/NumPy scalar operand, cast to this array's dtype as MXNet does
        (``nd.ones(2, dtype='int32') * 2.5`` is ``[2, 2]``; float32 stays float32)."""
        if self._legacy and isinstance(x, (int, float, np.generic)) and \
                not isinstance(x, (bool, np.bool_)):
            with np.errstate(over="ignore", invalid="ignore"):  # 1e5 in float16 is inf
                return np.asarray(x).astype(self.dtype)
        return x

    # ---- properties -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Tuple of array dimensions."""
        return self._data.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """Data type of the elements (a NumPy dtype)."""
        return self._data.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(self._data.size)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._data.ndim

    @property
    def context(self) -> Context:
        """The device context of this array."""
        return self._ctx

    ctx = context

    @property
    def stype(self) -> str:
        """Storage type: ``'default'`` for dense arrays, ``'row_sparse'`` for row-sparse."""
        return "default"

    @property
    def T(self) -> NDArray:
        """The transposed array."""
        return self._new(self._data.T)

    # ---- conversion ---------------------------------------------------------------
    def asnumpy(self) -> np.ndarray:
        """Return a copy of the array as a ``numpy.ndarray``."""
        return np.array(self._read(), copy=True)

    def asscalar(self) -> Any:
        """Return the value of a size-1 array as a NumPy scalar of the array's dtype.

        As MXNet's ``asscalar`` (``asnumpy()[0]``): ``nd.ones(1).asscalar()`` is a
        ``numpy.float32``. Use :meth:`item` for a Python scalar.
        """
        if self.size != 1:
            raise ShapeMismatchError(
                f"asscalar() needs an array of size 1, but the shape is {self.shape}. "
                "Index the element you want first.", shape=self.shape)
        return self._read().reshape(-1)[0]

    def item(self) -> Any:
        """Return the value of a size-1 array as a Python scalar."""
        return self.asscalar().item()

    def tolist(self) -> Any:
        """Return the array as nested Python lists."""
        return self._read().tolist()

    def astype(self, dtype: Any, copy: bool = True) -> NDArray:
        """Return the array cast to ``dtype`` (a copy unless ``copy=False`` and no cast)."""
        dt = np.dtype(dtype)
        if not copy and dt == self.dtype:
            return self
        return self._new(self._dense().astype(dt))

    def copy(self) -> NDArray:
        """Return a deep copy on the same context."""
        return self._new(self._data.copy())

    def copyto(self, other: Context | NDArray) -> NDArray:
        """Copy to a context (a new array) or into an NDArray of the same shape.

        Parameters
        ----------
        other : Context or NDArray
            Where to copy.

        Returns
        -------
        NDArray
            The new array, or ``other``.
        """
        if isinstance(other, Context):
            out = self.copy()
            out._ctx = other
            return out
        if isinstance(other, NDArray):
            if other is self:
                return other
            if other.shape != self.shape:
                raise ShapeMismatchError(
                    f"copyto: source shape {self.shape} differs from target shape "
                    f"{other.shape}. Copy into an array of shape {self.shape}.",
                    shape=other.shape)
            other._assign(self._dense())
            return other
        raise ValueTypeError(f"copyto() takes a Context or an NDArray, got {type(other).__name__}.")

    def as_in_context(self, context: Context) -> NDArray:
        """Return this array if it is on ``context``, else a copy there."""
        if context == self._ctx:
            return self
        return self.copyto(context)

    as_in_ctx = as_in_context

    def tostype(self, stype: str) -> NDArray:
        """Return a copy with storage type ``'default'`` or ``'row_sparse'``."""
        if stype == "default":
            return self._new(self._dense().copy()) if type(self) is NDArray else \
                NDArray(self._dense().copy(), self._ctx)
        if stype in STORAGE_TYPES:
            from_dense, _ = STORAGE_TYPES[stype]
            result: NDArray = from_dense(self._dense(), self._ctx)
            return result
        raise UnsupportedError(
            f"storage type {stype!r} is not supported. Use 'default' or 'row_sparse'.")

    def reshape(self, *shape: Any, **kwargs: Any) -> NDArray:
        """Return a view with a new shape (``-1`` infers one dimension).

        A whole-number float dimension (``n / 2`` in Python 3) is taken as an int, which
        MXNet 1.9.1 refuses although its own dist_sync_kvstore.py passes one.
        """
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer, float)):
            shape = tuple(shape[0])
        if "shape" in kwargs:
            shape = tuple(kwargs.pop("shape"))
        shape = tuple(_dim(s) for s in shape)
        try:
            return self._new(self._data.reshape(shape))
        except ValueError as err:
            raise ShapeMismatchError(
                f"cannot reshape an array of shape {self.shape} into {shape}: the sizes "
                "differ. Keep the same number of elements.", shape=self.shape) from err

    def wait_to_read(self) -> None:
        """Block until the array can be read; pskv computes eagerly, so this returns."""

    def attach_grad(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - API shim
        """MXNet's autograd hook; pskv has no autograd, so this raises.

        Raises
        ------
        UnsupportedError
            Always: compute gradients with your framework and push them as arrays.
        """
        raise UnsupportedError("pskv arrays have no autograd. Compute gradients with your "
                               "framework and push them as arrays.")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self._dense()
        if dtype is not None and np.dtype(dtype) != data.dtype:
            return data.astype(dtype)
        return data.copy() if copy else data

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._dense().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._dense().__dlpack_device__()

    # ---- python protocols -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        return bool(self._dense())

    def __float__(self) -> float:
        return float(self.asscalar())

    def __int__(self) -> int:
        return int(self.asscalar())

    def __index__(self) -> int:
        return operator.index(self._dense().reshape(-1)[0]) if self.size == 1 else \
            int(self.asscalar())

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.shape) if self.shape else "scalar"
        return f"\n{self._read()}\n<{type(self).__name__} {shape} @{self._ctx}>"

    def __str__(self) -> str:
        return self.__repr__()

    def __copy__(self) -> NDArray:
        return self._new(self._data)

    def __deepcopy__(self, memo: dict[int, Any]) -> NDArray:
        out = self._new(self._data.copy())
        memo[id(self)] = out
        return out

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self._data, self._ctx))

    __hash__ = None  # type: ignore[assignment]  # mutable, compared elementwise

    # ---- indexing -------------------------------------------------------------------
    def __getitem__(self, idx: Any) -> NDArray:
        if isinstance(idx, NDArray):
            idx = idx._dense()
        got = self._data[idx]
        if self._legacy and isinstance(got, np.generic):
            # one element by integers: MXNet 1.x gives a (1,) view, not a 0-d copy
            # (``nd.zeros((2, 3))[1][2][:] = 7`` writes into the parent)
            full = idx if isinstance(idx, tuple) else (idx,)
            last = operator.index(full[-1]) % self._data.shape[len(full) - 1]
            got = self._data[full[:-1] + (slice(last, last + 1),)]
        return self._result(got)

    def __setitem__(self, idx: Any, value: Any) -> None:
        if isinstance(idx, NDArray):
            idx = idx._dense()
        try:
            self._data[idx] = _operand(value)
        except ValueError as err:
            raise ShapeMismatchError(
                f"cannot assign a value of shape {np.shape(_operand(value))} to index "
                f"{idx!r} of an array of shape {self.shape}: {err}.", shape=self.shape) from err

    def _assign(self, value: Any) -> None:
        np.copyto(self._data, value, casting="same_kind")

    # ---- arithmetic -----------------------------------------------------------------
    def _binary(self, other: Any, fn: Callable[[Any, Any], Any], reverse: bool = False) -> Any:
        if not isinstance(other, (NDArray, np.ndarray, int, float, bool, np.generic)):
            return NotImplemented
        a, b = self._dense(), self._scalar(_operand(other))
        if not self._legacy:
            return self._new(np.asarray(fn(b, a) if reverse else fn(a, b)))
        # MXNet 1.x computes in the operands' dtype: int32 / 2 is int32 (truncated),
        # comparisons give 1/0 in the input dtype, x / 0 is inf without a warning
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = np.asarray(fn(b, a) if reverse else fn(a, b))
            if out.dtype != self.dtype and np.asarray(b).dtype == self.dtype:
                out = out.astype(self.dtype)
        return self._new(out)

    def _inplace(self, other: Any, fn: Callable[..., Any]) -> Any:
        if not isinstance(other, (NDArray, np.ndarray, int, float, bool, np.generic)):
            return NotImplemented
        try:
            fn(self._data, self._scalar(_operand(other)), out=self._data,
               casting="same_kind")
        except ValueError as err:
            raise ShapeMismatchError(
                f"in-place operation between shapes {self.shape} and "
                f"{np.shape(_operand(other))} failed: {err}.", shape=self.shape) from err
        return self

    def __add__(self, o: Any) -> Any: return self._binary(o, np.add)
    def __radd__(self, o: Any) -> Any: return self._binary(o, np.add, True)
    def __sub__(self, o: Any) -> Any: return self._binary(o, np.subtract)
    def __rsub__(self, o: Any) -> Any: return self._binary(o, np.subtract, True)
    def __mul__(self, o: Any) -> Any: return self._binary(o, np.multiply)
    def __rmul__(self, o: Any) -> Any: return self._binary(o, np.multiply, True)
    def __truediv__(self, o: Any) -> Any: return self._binary(o, np.true_divide)
    def __rtruediv__(self, o: Any) -> Any: return self._binary(o, np.true_divide, True)
    def __floordiv__(self, o: Any) -> Any: return self._binary(o, np.floor_divide)
    def __mod__(self, o: Any) -> Any: return self._binary(o, np.mod)
    def __pow__(self, o: Any) -> Any: return self._binary(o, np.power)
    def __rpow__(self, o: Any) -> Any: return self._binary(o, np.power, True)
    def __matmul__(self, o: Any) -> Any: return self._binary(o, np.matmul)
    def __eq__(self, o: Any) -> Any: return self._binary(o, np.equal)
    def __ne__(self, o: Any) -> Any: return self._binary(o, np.not_equal)
    def __lt__(self, o: Any) -> Any: return self._binary(o, np.less)
    def __le__(self, o: Any) -> Any: return self._binary(o, np.less_equal)
    def __gt__(self, o: Any) -> Any: return self._binary(o, np.greater)
    def __ge__(self, o: Any) -> Any: return self._binary(o, np.greater_equal)

    def __iadd__(self, o: Any) -> Any: return self._inplace(o, np.add)
    def __isub__(self, o: Any) -> Any: return self._inplace(o, np.subtract)
    def __imul__(self, o: Any) -> Any: return self._inplace(o, np.multiply)
    def __itruediv__(self, o: Any) -> Any: return self._inplace(o, np.true_divide)

    def __neg__(self) -> NDArray: return self._new(-self._dense())
    def __pos__(self) -> NDArray: return self
    def __abs__(self) -> NDArray: return self._new(np.abs(self._dense()))

    # ---- a few reductions MXNet users reach for --------------------------------------
    # A full reduction has shape (1,) and keeps the dtype (int32 sums stay int32), as in
    # MXNet 1.x; pskv.np arrays give NumPy's 0-d results.
    def _reduction(self, fn: Callable[..., Any], axis: Any, keepdims: bool) -> NDArray:
        dt = self.dtype if self._legacy else None
        return self._result(fn(self._dense(), axis=axis, keepdims=keepdims, dtype=dt))

    def sum(self, axis: Any = None, keepdims: bool = False) -> NDArray:
        """Sum over ``axis`` (all elements by default).

        Examples
        --------
        >>> import pskv as mx
        >>> mx.nd.ones((2, 3)).sum().shape
        (1,)
        """
        return self._reduction(np.sum, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> NDArray:
        """Mean over ``axis`` (all elements by default)."""
        return self._reduction(np.mean, axis, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> NDArray:
        """Maximum over ``axis`` (all elements by default)."""
        return self._result(np.max(self._dense(), axis=axis, keepdims=keepdims))

    def min(self, axis: Any = None, keepdims: bool = False) -> NDArray:
        """Minimum over ``axis`` (all elements by default)."""
        return self._result(np.min(self._dense(), axis=axis, keepdims=keepdims))

    def clip(self, a_min: float, a_max: float) -> NDArray:
        """Values limited to ``[a_min, a_max]``, in this array's dtype (``nd.clip``)."""
        x = self._dense()
        lo, hi = np.asarray(a_min).astype(x.dtype), np.asarray(a_max).astype(x.dtype)
        return self._result(np.clip(x, lo, hi))

    def norm(self) -> NDArray:
        """The L2 norm of all elements, as a 1-element array."""
        return self._new(np.asarray([np.linalg.norm(self._dense().ravel())],
                                    dtype=self.dtype))


def _rebuild(cls: type[NDArray], data: np.ndarray, ctx: Context) -> NDArray:
    out = object.__new__(cls)
    out._data = data
    out._ctx = ctx
    return out
