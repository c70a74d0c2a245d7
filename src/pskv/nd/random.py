"""``pskv.nd.random``: random arrays and ``seed``, as ``mxnet.nd.random`` and ``mxnet.random``.

Invariant: one private NumPy ``Generator`` per process, made on first use and replaced by
:func:`seed`; MXNet's random state is process-wide too (``mx.random.seed``), so code that
seeds it to make every worker draw the same data (as MXNet's dist tests do) runs unchanged.
The streams are NumPy's, not MXNet's: the same seed gives different numbers than MXNet.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context
from ..errors import ValueTypeError
from .ndarray import NDArray, _ctx, _dtype, _shape

__all__ = ["normal", "seed", "uniform"]

_STATE: dict[str, np.random.Generator] = {}


def _rng() -> np.random.Generator:
    if "rng" not in _STATE:
        _STATE["rng"] = np.random.default_rng()
    return _STATE["rng"]


def seed(seed_state: int, ctx: Context | str = "all") -> None:
    """Seed the generator behind :func:`uniform` and :func:`normal`.

    Parameters
    ----------
    seed_state : int
        A non-negative integer.
    ctx : Context or 'all', default 'all'
        Accepted for MXNet compatibility; pskv has one generator for every context.

    Examples
    --------
    >>> import pskv as mx
    >>> mx.random.seed(7); a = mx.nd.random.uniform(shape=(2,))
    >>> mx.random.seed(7); b = mx.nd.random.uniform(shape=(2,))
    >>> bool((a == b).asnumpy().all())
    True
    """
    if isinstance(seed_state, bool) or not isinstance(seed_state, (int, np.integer)) \
            or seed_state < 0:
        raise ValueTypeError(f"random.seed({seed_state!r}): the seed must be a non-negative "
                             "int. Pass e.g. mx.random.seed(42).")
    _STATE["rng"] = np.random.default_rng(int(seed_state))


def uniform(low: float = 0.0, high: float = 1.0, shape: Any = (1,),
            ctx: Context | None = None, dtype: Any = None, **kwargs: Any) -> NDArray:
    """Draw from the uniform distribution on ``[low, high)``.

    Parameters
    ----------
    low, high : float
        The bounds (defaults 0 and 1).
    shape : int or tuple of int, default (1,)
    ctx : Context, optional
    dtype : str or numpy.dtype, default float32
    """
    data = _rng().uniform(low, high, size=_shape(shape)).astype(_dtype(dtype))
    return NDArray(data, _ctx(ctx))


def normal(loc: float = 0.0, scale: float = 1.0, shape: Any = (1,),
           ctx: Context | None = None, dtype: Any = None, **kwargs: Any) -> NDArray:
    """Draw from the normal distribution with mean ``loc`` and deviation ``scale``.

    Parameters
    ----------
    loc, scale : float
        Mean and standard deviation (defaults 0 and 1).
    shape : int or tuple of int, default (1,)
    ctx : Context, optional
    dtype : str or numpy.dtype, default float32
    """
    data = _rng().normal(loc, scale, size=_shape(shape)).astype(_dtype(dtype))
    return NDArray(data, _ctx(ctx))
