"""Adam, with MXNet 1.9.1's dense, lazy row_sparse and standard row_sparse kernels."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..nd.ndarray import NDArray
from ._kernels import dense_grad, grad_parts, run, run_rows, target
from .base import Optimizer, register

__all__ = ["Adam"]


def _adam_kernel(f: Any, lr: float, wd: float, rg: float, clip: float | None, beta1: float,
                 beta2: float, epsilon: float, square_first: bool) -> Any:
    """AdamUpdateKernel and its row_sparse forms.

    ``g = clip(grad*rg + w*wd); m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
    w -= lr*m / (sqrt(v) + eps)``. The dense kernel rounds ``((1-b2)*g)*g``; the clipped
    lazy kernel and the standard row_sparse kernel round ``(1-b2)*(g*g)``
    (``square_first``).
    """
    omb1, omb2 = f(1) - f(beta1), f(1) - f(beta2)

    def kernel(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, t1: np.ndarray,
               t2: np.ndarray) -> None:
        np.multiply(g, f(rg), out=t1)
        if wd:
            np.multiply(w, f(wd), out=t2)
            t1 += t2
        if clip is not None:
            np.clip(t1, f(-clip), f(clip), out=t1)
        m *= f(beta1)
        np.multiply(t1, omb1, out=t2)
        m += t2
        if square_first:
            np.multiply(t1, t1, out=t2)
            t2 *= omb2
        else:
            np.multiply(t1, omb2, out=t2)
            t2 *= t1
        v *= f(beta2)
        v += t2
        np.sqrt(v, out=t1)
        t1 += f(epsilon)
        np.multiply(m, f(lr), out=t2)
        t2 /= t1
        w -= t2
    return kernel


@register
class Adam(Optimizer):
    """The Adam optimizer.

    Standard updates at step t::

        rescaled_grad = clip(grad * rescale_grad + wd * weight, clip_gradient)
        m = beta1 * m + (1 - beta1) * rescaled_grad
        v = beta2 * v + (1 - beta2) * (rescaled_grad**2)
        lr = learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t)
        w = w - lr * m / (sqrt(v) + epsilon)

    With a ``row_sparse`` gradient and ``lazy_update=True`` only the rows present in the
    gradient are updated.

    Parameters
    ----------
    beta1 : float, optional
        Exponential decay rate for the first moment estimates.
    beta2 : float, optional
        Exponential decay rate for the second moment estimates.
    epsilon : float, optional
        Small value to avoid division by 0.
    lazy_update : bool, optional
        Default True: lazy updates for row_sparse gradients.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"beta1": "beta1", "beta2": "beta2", "epsilon": "epsilon",
                  "lazy_update": "lazy_update"}

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = beta1
        self.beta2 = beta2
        self.epsilon = epsilon
        self.lazy_update = lazy_update

    def create_state(self, index: Any, weight: NDArray) -> Any:
        return (self._zeros_like(weight), self._zeros_like(weight))  # mean, variance

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        t = self._index_update_count[index]
        coef1 = 1. - self.beta1 ** t
        coef2 = 1. - self.beta2 ** t
        lr *= math.sqrt(coef2) / coef1
        w = target(weight)
        mean, var = target(state[0], "mean state"), target(state[1], "variance state")
        clip = self._clip()
        values, rows = grad_parts(grad)
        args = (w.dtype.type, lr, wd, self.rescale_grad, clip, self.beta1, self.beta2,
                self.epsilon)
        if rows is None:
            run(_adam_kernel(*args, square_first=False), [w, mean, var], [values], 2)
        elif self.lazy_update:
            run_rows(_adam_kernel(*args, square_first=clip is not None), [w, mean, var],
                     [values], rows, 2)
        else:  # AdamStdDnsRspDnsKernel: every row, gradient zero where none
            run(_adam_kernel(*args, square_first=True), [w, mean, var], [dense_grad(grad)], 2)
