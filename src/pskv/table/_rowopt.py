"""Row optimizers: the store's optimizer applied to the gathered rows of a table.

The element-wise SGD, AdaGrad and Ftrl run pskv's own optimizer on the gathered rows as a
row_sparse gradient holding every one of them: the same kernels, the same rounding and the
same per-key update count as a lazy update of a pre-sized row_sparse key. Adam needs a step
per row for its bias correction, and row-wise AdaGrad one accumulator per row: both are
written here, in the operation order of their element-wise kernels. Invariant: ``update``
changes only the arrays it is given (the caller gathers and scatters).

Which optimizer updates rows how is one registry, keyed by optimizer class
(:data:`ELEMENTWISE`, :data:`ROWWISE`): a small class per way, with its state widths, its
update and whether it refuses ``wd`` (:func:`refuse_wd`, the one refusal); the store, a
table, a TableSpec's own optimizer and a server all choose through it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ..optimizer import SGD, AdaGrad, Adam, Ftrl, Optimizer

__all__ = ["ELEMENTWISE", "ROWWISE", "RowOptimizer", "refuse_wd", "row_optimizer"]


class RowOptimizer:
    """How one optimizer updates table rows: its state arrays and its update.

    ``signature`` names the state layout; a table resets its states when it changes.
    """

    def __init__(self, kind: str, widths: tuple[int, ...], per_row_step: bool) -> None:
        if kind not in _KINDS:       # e.g. a replicated round's meta naming no row optimizer
            raise UnsupportedError(f"no row optimizer {kind!r}; tables know "
                                   f"{', '.join(sorted(_KINDS))}.")
        self.kind = kind
        #: one entry per state array: its width (the row's dim, or 1 for a row-wise one)
        self.widths = widths
        self.per_row_step = per_row_step
        self.signature = (kind, widths, per_row_step)

    def update(self, opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray],
               g: np.ndarray, t: np.ndarray | None) -> None:
        """Update gathered rows ``w`` and ``states`` in place from summed gradients ``g``;
        ``t`` holds the rows' steps (already counting this update) for Adam."""
        _KINDS[self.kind].update(opt, key, w, states, g, t)


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
        raise refuse_wd(key)
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


class _Rows:
    """One way of updating table rows, keyed by the optimizer class it serves (in
    :data:`ELEMENTWISE` or :data:`ROWWISE`): its kind, state widths for a row of ``dim``,
    whether it counts a step per row, whether it refuses ``wd``, and its update."""

    kind = ""
    per_row_step = False
    refuses_wd = False

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return ()

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:
        raise NotImplementedError


def _sparse(w: np.ndarray, g: np.ndarray) -> RowSparseNDArray:
    """The gathered rows' gradient as a row_sparse array holding every one of them."""
    return RowSparseNDArray(g, np.arange(w.shape[0], dtype=np.int64), w.shape)


class _SgdRows(_Rows):
    kind = "sgd"

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return (dim,) if opt.momentum > 0 else ()

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:
        opt.update(key, NDArray(w), _sparse(w, g), NDArray(states[0]) if states else None)


class _AdaGradRows(_Rows):
    kind, refuses_wd = "adagrad", True

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return (dim,)

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:
        opt.update(key, NDArray(w), _sparse(w, g), NDArray(states[0]))


class _FtrlRows(_Rows):
    kind = "ftrl"

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return (dim, dim)

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:  # a row_sparse weight: Ftrl's row_sparse kernel
        rows = np.arange(w.shape[0], dtype=np.int64)
        opt.update(key, RowSparseNDArray(w, rows, w.shape), _sparse(w, g),
                   (NDArray(states[0]), NDArray(states[1])))


class _AdamRows(_Rows):
    kind, per_row_step = "adam", True

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return (dim, dim)

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:
        assert t is not None
        _adam_rows(opt, key, w, states[0], states[1], g, t)


class _AdaGradRowwise(_Rows):
    kind, refuses_wd = "adagrad_rowwise", True

    @staticmethod
    def widths(opt: Any, dim: int) -> tuple[int, ...]:
        return (1,)

    @staticmethod
    def update(opt: Any, key: Any, w: np.ndarray, states: list[np.ndarray], g: np.ndarray,
               t: np.ndarray | None) -> None:
        _adagrad_rowwise(opt, key, w, states[0], g)


#: state_layout='elementwise': optimizer class -> how it updates rows
ELEMENTWISE: dict[type[Optimizer], type[_Rows]] = {
    SGD: _SgdRows, AdaGrad: _AdaGradRows, Ftrl: _FtrlRows, Adam: _AdamRows}
#: state_layout='rowwise': one accumulator per row
ROWWISE: dict[type[Optimizer], type[_Rows]] = {AdaGrad: _AdaGradRowwise}
_KINDS: dict[str, type[_Rows]] = {r.kind: r for r in (*ELEMENTWISE.values(),
                                                      *ROWWISE.values())}


def refuse_wd(table: Any, key: Any = None) -> UnsupportedError:
    """The one refusal of ``wd`` by sparse AdaGrad (as in MXNet's ``adagrad_update``)."""
    return UnsupportedError(f"table {table!r}: sparse adagrad_update does not support wd (as "
                            "in MXNet). Use wd=0 for table keys.",
                            key=table if key is None else key)


def row_optimizer(opt: Optimizer, layout: str, dim: int, table: Any,
                  key: Any = None) -> RowOptimizer:
    """The row optimizer for ``opt`` with state ``layout``, or UnsupportedError (also
    for ``wd`` where the optimizer refuses it; ``key``: the name its wd is read under)."""
    rows = (ROWWISE if layout == "rowwise" else ELEMENTWISE).get(type(opt))
    if rows is None and layout == "rowwise":
        raise UnsupportedError(
            f"table {table!r} has state_layout='rowwise', which only AdaGrad supports; the "
            f"store's optimizer is {type(opt).__name__}. Use AdaGrad, or "
            "state_layout='elementwise'.", key=table)
    if layout != "rowwise" and opt.multi_precision:
        raise UnsupportedError(f"table {table!r}: multi_precision optimizers are not "
                               "supported for tables (they compute in float32 or float64; a "
                               "float16 or bfloat16 table widens its rows to its state_dtype). "
                               "Create the optimizer without multi_precision.", key=table)
    if rows is None:
        raise UnsupportedError(
            f"table {table!r} cannot be updated by {type(opt).__name__}: tables support "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)}. Set one of those with "
            "kv.set_optimizer.", key=table)
    if rows.refuses_wd and opt._get_wd(table if key is None else key) != 0.0:
        raise refuse_wd(table)
    return RowOptimizer(rows.kind, rows.widths(opt, dim), rows.per_row_step)
