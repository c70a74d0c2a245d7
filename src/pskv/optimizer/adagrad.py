"""AdaGrad: MXNet 1.9.1's NDArray formula for dense gradients, its sparse kernel otherwise."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from ..nd.ndarray import NDArray
from ._kernels import grad_parts, run, run_rows, target
from .base import Optimizer, register

__all__ = ["AdaGrad"]


@register
class AdaGrad(Optimizer):
    """AdaGrad optimizer.

    This optimizer updates each weight by::

        grad = clip(grad * rescale_grad, clip_gradient)
        history += square(grad)
        div = grad / sqrt(history + float_stable_eps)
        weight += (div + weight * wd) * -lr

    A ``row_sparse`` gradient updates only its rows (MXNet's ``sparse.adagrad_update``),
    which does not support ``wd``.

    Parameters
    ----------
    eps : float, optional
        Initial value of the history accumulator. Avoids division by 0.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"eps": "float_stable_eps"}

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = eps

    def create_state(self, index: Any, weight: NDArray) -> Any:
        return self._zeros_like(weight, np.float32)  # history (float32, as MXNet's zeros)

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        w, hist = target(weight), target(state, "history state")
        f = w.dtype.type
        values, rows = grad_parts(grad)
        rg, eps = self.rescale_grad, self.float_stable_eps
        if rows is not None:
            if wd != 0.0:
                raise UnsupportedError(
                    "sparse adagrad_update does not support wd (as in MXNet). Use wd=0 with "
                    "row_sparse gradients, or push dense gradients.")
            clip = self._clip()

            def skernel(w: np.ndarray, h: np.ndarray, g: np.ndarray, t1: np.ndarray,
                        t2: np.ndarray) -> None:
                # AdagradDnsRspDnsKernel: h += g*g; w = w - g / sqrt(h + eps) * lr
                np.multiply(g, f(rg), out=t1)
                if clip is not None:
                    np.clip(t1, f(-clip), f(clip), out=t1)
                np.multiply(t1, t1, out=t2)
                h += t2
                np.add(h, f(eps), out=t2)
                np.sqrt(t2, out=t2)
                t1 /= t2
                t1 *= f(lr)
                w -= t1
            run_rows(skernel, [w, hist], [values], rows, 2)
            return
        c = self.clip_gradient  # the NDArray path clips whenever it is not None

        def kernel(w: np.ndarray, h: np.ndarray, g: np.ndarray, t1: np.ndarray,
                   t2: np.ndarray) -> None:
            np.multiply(g, f(rg), out=t1)
            if c is not None:
                np.clip(t1, f(-c), f(c), out=t1)
            np.multiply(t1, t1, out=t2)
            h += t2
            np.add(h, f(eps), out=t2)
            np.sqrt(t2, out=t2)
            t1 /= t2
            if wd:
                np.multiply(w, f(wd), out=t2)
                t1 += t2
            t1 *= f(-lr)
            w += t1
        run(kernel, [w, hist], [values], 2)
