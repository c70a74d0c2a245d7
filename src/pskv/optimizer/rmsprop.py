"""RMSProp (Tieleman & Hinton) and its centered form (Graves), as MXNet 1.9.1's kernels."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..nd.ndarray import NDArray
from ._kernels import dense_grad, run, target
from .base import Optimizer, register

__all__ = ["RMSProp"]


@register
class RMSProp(Optimizer):
    """The RMSProp optimizer.

    ``centered=False`` follows Tieleman & Hinton, 2012 (``rmsprop_update``);
    ``centered=True`` follows Graves, 2013, eq. (38)-(45) (``rmspropalex_update``).
    Row_sparse gradients are densified, as MXNet's storage fallback does.

    Parameters
    ----------
    gamma1 : float, optional
        A decay factor of moving average over past squared gradient.
    gamma2 : float, optional
        A "momentum" factor. Only used if ``centered=True``.
    epsilon : float, optional
        Small value to avoid division by 0.
    centered : bool, optional
        Use Graves's version of RMSProp.
    clip_weights : float, optional
        Clips weights into range ``[-clip_weights, clip_weights]``.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"gamma1": "gamma1", "gamma2": "gamma2", "epsilon": "epsilon",
                  "centered": "centered", "clip_weights": "clip_weights"}

    def __init__(self, learning_rate: float = 0.001, gamma1: float = 0.9, gamma2: float = 0.9,
                 epsilon: float = 1e-8, centered: bool = False,
                 clip_weights: float | None = None, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = gamma1
        self.gamma2 = gamma2
        self.centered = centered
        self.epsilon = epsilon
        self.clip_weights = clip_weights

    def create_state(self, index: Any, weight: NDArray) -> Any:
        if self.centered:
            return (self._zeros_like(weight, np.float32),   # n
                    self._zeros_like(weight, np.float32),   # g
                    self._zeros_like(weight, np.float32))   # delta
        return (self._zeros_like(weight, np.float32),)     # n

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        w = target(weight)
        f = w.dtype.type
        rg, clip, eps = self.rescale_grad, self._clip(), self.epsilon
        cw = self.clip_weights
        cw = float(cw) if cw and cw >= 0 else None
        g1 = f(self.gamma1)
        omg1 = f(1) - g1

        def rescaled(w: np.ndarray, g: np.ndarray, t1: np.ndarray, t2: np.ndarray) -> None:
            np.multiply(g, f(rg), out=t1)
            if wd:
                np.multiply(w, f(wd), out=t2)
                t1 += t2
            if clip is not None:
                np.clip(t1, f(-clip), f(clip), out=t1)

        if not self.centered:
            def kernel(w: np.ndarray, n: np.ndarray, g: np.ndarray, t1: np.ndarray,
                       t2: np.ndarray) -> None:
                # RMSPropUpdateKernel: n = (1-g1)*(g*g) + g1*n; w -= lr*(g/sqrt(n + eps))
                rescaled(w, g, t1, t2)
                np.multiply(t1, t1, out=t2)
                t2 *= omg1
                n *= g1
                n += t2
                np.add(n, f(eps), out=t2)
                np.sqrt(t2, out=t2)
                t1 /= t2
                t1 *= f(lr)
                w -= t1
                if cw is not None:
                    np.clip(w, f(-cw), f(cw), out=w)
            run(kernel, [w, target(state[0], "n state")], [dense_grad(grad)], 2)
            return

        def ckernel(w: np.ndarray, n: np.ndarray, gs: np.ndarray, d: np.ndarray,
                    g: np.ndarray, t1: np.ndarray, t2: np.ndarray, t3: np.ndarray) -> None:
            # RMSPropAlexUpdateKernel
            rescaled(w, g, t1, t2)
            np.multiply(t1, omg1, out=t2)
            np.multiply(t2, t1, out=t3)
            n *= g1
            n += t3
            gs *= g1
            gs += t2
            np.multiply(gs, gs, out=t3)
            np.subtract(n, t3, out=t3)
            t3 += f(eps)
            np.sqrt(t3, out=t3)
            t1 *= f(lr)
            t1 /= t3
            d *= f(self.gamma2)
            d -= t1
            w += d
            if cw is not None:
                np.clip(w, f(-cw), f(cw), out=w)
        n, gs, delta = (target(s, "state") for s in state)
        run(ckernel, [w, n, gs, delta], [dense_grad(grad)], 3)
