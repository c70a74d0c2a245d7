"""Row optimizers: the store's optimizer applied to the gathered rows of a table.

The element-wise SGD, AdaGrad and Ftrl run pskv's own optimizer on the gathered rows as a
row_sparse gradient holding every one of them: the same kernels, the same rounding and the
same per-key update count as a lazy update of a pre-sized row_sparse key. Adam needs a step
per row for its bias correction, and row-wise AdaGrad one accumulator per row: both are
written here, in the operation order of their element-wise kernels. Invariant: ``update``
changes only the arrays it is given (the caller gathers and scatters).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ..optimizer import SGD, AdaGrad, Adam, Ftrl, Optimizer

__all__ = ["RowOptimizer", "row_optimizer"]


class RowOptimizer:
    """How one optimizer updates table rows: its state arrays and its update.

    ``signature`` names the state layout; a table resets its states when it changes.
    """

    def __init__(self, kind: str, widths: tuple[int, ...], per_row_step: bool) -> None:
        self.kind = kind
        #: one entry per state array: its width (the row's dim, or 1 for a row-wise one)
        self.widths = widths
        self.per_row_step = per_row_step
        self.signature = (kind, widths, per_row_step)

    def update(self, opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray],
               g: np.ndarray, t: np.ndarray | None) -> None:
        """Update gathered rows ``w`` and ``states`` in place from summed gradients ``g``;
        ``t`` holds the rows' steps (already counting this update) for Adam."""
        n = w.shape[0]
        rows = np.arange(n, dtype=np.int64)
        grad = RowSparseNDArray(g, rows, w.shape)
        if self.kind == "sgd":
            opt.update(key, NDArray(w), grad, NDArray(states[0]) if states else None)
        elif self.kind == "adagrad":
            opt.update(key, NDArray(w), grad, NDArray(states[0]))
        elif self.kind == "ftrl":   # a row_sparse weight: Ftrl's row_sparse kernel
            opt.update(key, RowSparseNDArray(w, rows, w.shape), grad,
                       (NDArray(states[0]), NDArray(states[1])))
        elif self.kind == "adam":
            assert t is not None
            _adam_rows(opt, key, w, states[0], states[1], g, t)
        else:
            _adagrad_rowwise(opt, key, w, states[0], g)


def row_optimizer(opt: Optimizer, layout: str, dim: int, table: Any) -> RowOptimizer:
    """The row optimizer for ``opt`` with state ``layout``, or UnsupportedError."""
    if layout == "rowwise":
        if type(opt) is AdaGrad:
            return RowOptimizer("adagrad_rowwise", (1,), False)
        raise UnsupportedError(
            f"table {table!r} has state_layout='rowwise', which only AdaGrad supports; the "
            f"store's optimizer is {type(opt).__name__}. Use AdaGrad, or "
            "state_layout='elementwise'.", key=table)
    if opt.multi_precision:
        raise UnsupportedError(f"table {table!r}: multi_precision optimizers are not "
                               "supported for tables (their rows are float32 or float64). "
                               "Create the optimizer without multi_precision.", key=table)
    if type(opt) is SGD:
        return RowOptimizer("sgd", (dim,) if opt.momentum > 0 else (), False)
    if type(opt) is AdaGrad:
        return RowOptimizer("adagrad", (dim,), False)
    if type(opt) is Ftrl:
        return RowOptimizer("ftrl", (dim, dim), False)
    if type(opt) is Adam:
        return RowOptimizer("adam", (dim, dim), True)
    raise UnsupportedError(
        f"table {table!r} cannot be updated by {type(opt).__name__}: tables support SGD, "
        "AdaGrad, Ftrl and Adam. Set one of those with kv.set_optimizer.", key=table)


def _adam_rows(opt: Any, key: Any, w: np.ndarray, m: np.ndarray, v: np.ndarray,
               g: np.ndarray, t: np.ndarray) -> None:
    """Adam's lazy row_sparse kernel (pskv.optimizer.adam) with a bias correction per row."""
    opt._update_count(key)
    lr, wd = opt._get_lr(key), opt._get_wd(key)
    clip = opt._clip()
    f = w.dtype.type
    tt = t.astype(np.float64)
    coef1 = 1.0 - np.power(opt.beta1, tt)
    coef2 = 1.0 - np.power(opt.beta2, tt)
    lr_t = (lr * (np.sqrt(coef2) / coef1)).astype(w.dtype)[:, None]
    omb1, omb2 = f(1) - f(opt.beta1), f(1) - f(opt.beta2)
    t1 = g * f(opt.rescale_grad)
    if wd:
        t1 += w * f(wd)
    if clip is not None:
        np.clip(t1, f(-clip), f(clip), out=t1)
    m *= f(opt.beta1)
    m += t1 * omb1
    if clip is not None:        # the clipped lazy kernel rounds (1-b2)*(g*g)
        t2 = t1 * t1
        t2 *= omb2
    else:
        t2 = t1 * omb2
        t2 *= t1
    v *= f(opt.beta2)
    v += t2
    np.sqrt(v, out=t1)
    t1 += f(opt.epsilon)
    np.multiply(m, lr_t, out=t2)
    t2 /= t1
    w -= t2


def _adagrad_rowwise(opt: Any, key: Any, w: np.ndarray, h: np.ndarray,
                     g: np.ndarray) -> None:
    """Row-wise AdaGrad: ``h += mean(g*g)`` per row, ``w -= lr * g / sqrt(h + eps)``."""
    opt._update_count(key)
    lr, wd = opt._get_lr(key), opt._get_wd(key)
    if wd != 0.0:
        raise UnsupportedError("sparse adagrad_update does not support wd (as in MXNet). Use "
                               "wd=0 for table keys.", key=key)
    f = w.dtype.type
    clip = opt._clip()
    t1 = g * f(opt.rescale_grad)
    if clip is not None:
        np.clip(t1, f(-clip), f(clip), out=t1)
    h += np.mean(t1 * t1, axis=1, keepdims=True, dtype=w.dtype)
    div = np.sqrt(h + f(opt.float_stable_eps))
    t1 /= div
    t1 *= f(lr)
    w -= t1
