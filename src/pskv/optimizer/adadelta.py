"""AdaDelta, as MXNet 1.9.1's NDArray formula (``python/mxnet/optimizer/optimizer.py``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..nd.ndarray import NDArray
from ._kernels import dense_grad, run, target
from .base import Optimizer, register

__all__ = ["AdaDelta"]


@register
class AdaDelta(Optimizer):
    """The AdaDelta optimizer.

    This optimizer updates each weight by::

        grad = clip(grad * rescale_grad, clip_gradient)
        acc_grad = rho * acc_grad + (1. - rho) * grad * grad
        delta = sqrt(acc_delta + epsilon) / sqrt(acc_grad + epsilon) * grad
        acc_delta = rho * acc_delta + (1. - rho) * delta * delta
        weight -= (delta + wd * weight)

    Unlike MXNet (whose ``grad *= rescale_grad`` rescales the caller's gradient in
    place), pskv leaves the gradient unchanged. The learning rate is not used.

    Parameters
    ----------
    rho : float
        Decay rate for both squared gradients and delta.
    epsilon : float
        Small value to avoid division by 0.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"rho": "rho", "epsilon": "epsilon"}

    def __init__(self, rho: float = 0.90, epsilon: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rho = rho
        self.epsilon = epsilon

    def create_state(self, index: Any, weight: NDArray) -> Any:
        return (self._zeros_like(weight, np.float32),   # accumulated g
                self._zeros_like(weight, np.float32))   # accumulated delta

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        wd = self._get_wd(index)
        self._update_count(index)
        w = target(weight)
        f = w.dtype.type
        rg, c, eps = self.rescale_grad, self.clip_gradient, self.epsilon
        rho, omr = f(self.rho), f(1. - self.rho)  # Python scalars, cast by each NDArray op

        def kernel(w: np.ndarray, ag: np.ndarray, ad: np.ndarray, g: np.ndarray,
                   t1: np.ndarray, t2: np.ndarray, t3: np.ndarray) -> None:
            np.multiply(g, f(rg), out=t1)
            if c is not None:
                np.clip(t1, f(-c), f(c), out=t1)
            ag *= rho
            np.multiply(t1, omr, out=t2)
            t2 *= t1
            ag += t2
            np.add(ad, f(eps), out=t2)
            np.sqrt(t2, out=t2)
            np.add(ag, f(eps), out=t3)
            np.sqrt(t3, out=t3)
            t2 /= t3
            t2 *= t1                      # current delta
            ad *= rho
            np.multiply(t2, omr, out=t3)
            t3 *= t2
            ad += t3
            if wd:
                np.multiply(w, f(wd), out=t3)
                t2 += t3
            w -= t2
        acc_g, acc_delta = target(state[0], "state"), target(state[1], "state")
        run(kernel, [w, acc_g, acc_delta], [dense_grad(grad)], 3)
