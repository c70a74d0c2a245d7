"""``pskv.nd.random``: random arrays and ``seed``, as ``mxnet.nd.random`` and ``mxnet.random``.

Invariant: one private NumPy ``Generator`` per process, made on first use from
:data:`DEFAULT_SEED` and replaced by :func:`seed`. MXNet's random state is process-wide too,
and it starts from a fixed seed (``mx.random.seed(0)``'s stream) in every process, so
unseeded draws are the same on every worker: programs rely on it to start workers equal
(MXNet 1.9.1's ``dist_sync_kvstore.py`` checks sums against ``num_workers`` times a local
draw). pskv does the same: every process, and every process started afresh (a
``multiprocessing`` spawn), draws the stream of ``seed(DEFAULT_SEED)`` until it seeds. A
forked child goes on from its parent's state, as MXNet's does. The streams are NumPy's, not
MXNet's: the same seed gives other numbers than MXNet (docs/differences.md).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context
from ..errors import ValueTypeError
from .ndarray import NDArray, _ctx, _dtype, _shape

__all__ = ["DEFAULT_SEED", "normal", "seed", "uniform"]

#: the seed every process starts from (MXNet 1.9.1's default stream is ``seed(0)``'s too)
DEFAULT_SEED = 0

_STATE: dict[str, np.random.Generator] = {}


def _rng() -> np.random.Generator:
    if "rng" not in _STATE:
        # fixed, not from the OS: every worker draws the same until it seeds (as MXNet)
        _STATE["rng"] = np.random.default_rng(DEFAULT_SEED)
    return _STATE["rng"]


def seed(seed_state: int, ctx: Context | str = "all") -> None:
    """Seed the generator behind :func:`uniform` and :func:`normal`.

    Until it is called, a process draws the stream of ``seed(DEFAULT_SEED)``, the same in
    every process (as MXNet, whose default stream is ``seed(0)``'s).

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
    >>> mx.random.seed(mx.random.DEFAULT_SEED)   # back to where every process starts
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
