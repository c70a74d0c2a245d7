"""FTRL-Proximal, as MXNet 1.9.1's ``ftrl_update`` (dense and all-row_sparse kernels)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ._kernels import dense_grad, grad_parts, run, run_rows, target
from .base import Optimizer, register

__all__ = ["FTRL", "Ftrl"]


@register
class Ftrl(Optimizer):
    """The Ftrl optimizer (*Ad Click Prediction: a View from the Trenches*).

    The optimizer updates the weight by::

        rescaled_grad = clip(grad * rescale_grad, clip_gradient)
        z += rescaled_grad - (sqrt(n + rescaled_grad**2) - sqrt(n)) * weight / learning_rate
        n += rescaled_grad**2
        w = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / learning_rate + wd) * (abs(z) > lamda1)

    When weight and gradient are both ``row_sparse`` only the gradient's rows are updated;
    a dense weight with a row_sparse gradient is updated densely (MXNet's fallback), which
    recomputes every row from ``z`` and ``n``.

    Parameters
    ----------
    lamda1 : float, optional
        L1 regularization coefficient.
    learning_rate : float, optional
        The initial learning rate (default 0.1).
    beta : float, optional
        Per-coordinate learning rate correlation parameter.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"lamda1": "lamda1", "beta": "beta"}

    def __init__(self, lamda1: float = 0.01, learning_rate: float = 0.1, beta: float = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lamda1 = lamda1
        self.beta = beta
        self.lr = learning_rate

    def create_state(self, index: Any, weight: NDArray) -> Any:
        return (self._zeros_like(weight, np.float32),   # z
                self._zeros_like(weight, np.float32))   # n

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        wd = self._get_wd(index)
        lr = self._get_lr(index)
        w = target(weight)
        f = w.dtype.type
        rg, clip = self.rescale_grad, self._clip()
        l1, beta = f(self.lamda1), f(self.beta)

        def kernel(w: np.ndarray, z: np.ndarray, n: np.ndarray, g: np.ndarray,
                   t1: np.ndarray, t2: np.ndarray, t3: np.ndarray) -> None:
            # FtrlUpdateKernel / FtrlDnsRspDnsKernel (same rounding)
            np.multiply(g, f(rg), out=t1)
            if clip is not None:
                np.clip(t1, f(-clip), f(clip), out=t1)
            np.multiply(t1, t1, out=t2)
            np.sqrt(n, out=t3)
            n += t2                          # n + g*g, the value sqrt(n + g*g) reads
            np.sqrt(n, out=t2)
            t2 -= t3
            t2 *= w
            t2 /= f(lr)
            np.subtract(t1, t2, out=t1)
            z += t1
            np.sqrt(n, out=t2)
            t2 += beta
            t2 /= f(lr)
            if wd:
                t2 += f(wd)
            np.sign(z, out=t1)
            t1 *= l1
            t1 -= z
            t1 /= t2
            np.abs(z, out=t3)
            np.greater(t3, l1, out=t3, casting="unsafe")
            np.multiply(t1, t3, out=w)
        zs, ns = target(state[0], "z state"), target(state[1], "n state")
        values, rows = grad_parts(grad)
        if rows is not None and isinstance(weight, RowSparseNDArray):
            run_rows(kernel, [w, zs, ns], [values], rows, 3)
        else:
            run(kernel, [w, zs, ns], [dense_grad(grad)], 3)


FTRL = Ftrl
