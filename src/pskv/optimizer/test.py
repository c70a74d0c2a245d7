"""The ``'test'`` optimizer: ``weight += rescale_grad * grad``; MXNet's dist tests use it."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..nd.ndarray import NDArray
from ._kernels import grad_parts, run, run_rows, target
from .base import Optimizer, register

__all__ = ["Test"]


@register
class Test(Optimizer):
    """The Test optimizer: ``weight += grad * rescale_grad``, then ``state = weight``.

    As in MXNet 1.9.1 it does not count updates, so ``num_update`` stays put.

    Examples
    --------
    >>> import pskv
    >>> opt = pskv.optimizer.create('test', rescale_grad=2.0)
    >>> w = pskv.nd.ones((2,))
    >>> opt.update(0, w, pskv.nd.ones((2,)), opt.create_state(0, w))
    >>> w.asnumpy().tolist()
    [3.0, 3.0]
    """

    __test__ = False  # not a pytest test class

    def create_state(self, index: Any, weight: NDArray) -> Any:
        """Create a state to duplicate weight."""
        return self._zeros_like(weight, np.float32)

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        """Perform ``w += rescale_grad * grad``."""
        w = target(weight)
        f = w.dtype.type
        rg = f(self.rescale_grad)

        def kernel(w: np.ndarray, g: np.ndarray, t1: np.ndarray) -> None:
            np.multiply(g, rg, out=t1)
            w += t1
        values, rows = grad_parts(grad)
        if rows is None:
            run(kernel, [w], [values], 1)
        else:
            run_rows(kernel, [w], [values], rows, 1)
        target(state, "state")[...] = w
