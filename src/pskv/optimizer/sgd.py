"""SGD, NAG, Signum and SignSGD, with MXNet 1.9.1's kernels and row_sparse dispatch.

Dense SGD goes through MXNet's aggregated ``multi_sgd_update`` kernel (what 1.9.1's
``SGD._update_impl`` uses for dense arrays), row_sparse gradients through ``sgd_update`` /
``sgd_mom_update`` (lazy or standard), multi-precision row_sparse through the dense
``mp_sgd_*`` fallback: each with its own rounding, reproduced here.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..nd.ndarray import NDArray
from ._kernels import dense_grad, grad_parts, run, run_rows, target
from .base import Optimizer, register

__all__ = ["NAG", "SGD", "SignSGD", "Signum", "ccSGD"]


def _term(g: np.ndarray, t: np.ndarray, f: Callable[[float], Any], lr: float, rg: float,
          clip: float | None) -> None:
    """``t = lr * clip(rg * g)`` or, unclipped, ``t = (lr * rg) * g`` (MXNet's order)."""
    if clip is not None:
        np.multiply(g, f(rg), out=t)
        np.clip(t, f(-clip), f(clip), out=t)
        np.multiply(t, f(lr), out=t)
    else:
        np.multiply(g, f(lr) * f(rg), out=t)


def _multi_sgd(w: np.ndarray, g: np.ndarray, lr: float, wd: float, rg: float,
               clip: float | None, mom: np.ndarray | None, momentum: float) -> None:
    """MultiSGDKernel: ``m = momentum*m - lr*wd*w - lr*clip(rg*g); w = w + m``."""
    f = w.dtype.type
    rate = f(lr) * f(wd)
    if mom is None:
        def kernel(w: np.ndarray, g: np.ndarray, t1: np.ndarray, t2: np.ndarray) -> None:
            _term(g, t2, f, lr, rg, clip)
            if rate:  # 0 - a - b == -(a + b) exactly, so w + m == w - (a + b)
                np.multiply(w, rate, out=t1)
                t1 += t2
                w -= t1
            else:
                w -= t2
        run(kernel, [w], [g], 2)
        return

    run(_mom_kernel(f, lr, wd, rg, clip, momentum), [w, mom], [g], 2)


def _sgd_kernel(f: Callable[[float], Any], lr: float, wd: float, rg: float,
                clip: float | None) -> Callable[..., None]:
    """SGDKernel / SGDDnsRspKernel / MP_SGDKernel: ``w = (1 - lr*wd)*w - lr*clip(rg*g)``."""
    scale = f(1) - f(lr) * f(wd)

    def kernel(w: np.ndarray, g: np.ndarray, t1: np.ndarray) -> None:
        _term(g, t1, f, lr, rg, clip)
        if scale != 1:
            w *= scale
        w -= t1
    return kernel


def _sgd_rsp(w: np.ndarray, values: np.ndarray, rows: np.ndarray, lr: float, wd: float,
             rg: float, clip: float | None, lazy: bool) -> None:
    """sgd_update on a row_sparse gradient (SGDUpdateDnsRspImpl)."""
    f = w.dtype.type
    if not lazy:  # standard update: decay every row first, then the rows with wd = 0
        scale = f(1) - f(lr) * f(wd)
        if scale != 1:
            w *= scale
        wd = 0.0
    run_rows(_sgd_kernel(f, lr, wd, rg, clip), [w], [values], rows, 1)


def _mom_kernel(f: Callable[[float], Any], lr: float, wd: float, rg: float,
                clip: float | None, momentum: float) -> Callable[..., None]:
    """SGDMomKernel (and its row_sparse forms): as :func:`_multi_sgd` with momentum."""
    rate = f(lr) * f(wd)

    def kernel(w: np.ndarray, m: np.ndarray, g: np.ndarray, t1: np.ndarray,
               t2: np.ndarray) -> None:
        m *= f(momentum)
        if rate:
            np.multiply(w, rate, out=t1)
            m -= t1
        _term(g, t2, f, lr, rg, clip)
        m -= t2
        w += m
    return kernel


class _Momentum(Optimizer):
    """What SGD and NAG share: a momentum state, and a float32 master copy of float16
    weights with ``multi_precision`` (MXNet's ``*_mom_update`` / ``mp_*`` kernels)."""

    momentum: float

    def create_state_multi_precision(self, index: Any, weight: NDArray) -> Any:
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (self.create_state(index, master), master)
        return super().create_state_multi_precision(index, weight)

    def create_state(self, index: Any, weight: NDArray) -> Any:
        if self.momentum != 0.0:
            return self._zeros_like(weight)
        return None

    def _buffers(self, weight: NDArray, state: Any, multi_precision: bool) -> tuple[Any, Any]:
        """The array to update (the master copy under multi_precision) and the momentum."""
        if multi_precision:
            mom_state, master = state
            return target(master), mom_state
        return target(weight), state

    def _update_impl(self, index: Any, weight: NDArray, grad: NDArray, state: Any,
                     multi_precision: bool) -> None:
        raise NotImplementedError

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_impl(index, weight, grad, state, multi_precision=False)


@register
class SGD(_Momentum):
    """The SGD optimizer with momentum and weight decay.

    Standard updates::

        rescaled_grad = lr * (rescale_grad * clip(grad, clip_gradient) + wd * weight)
        state = momentum * state + rescaled_grad
        weight = weight - state

    With a ``row_sparse`` gradient and ``lazy_update=True`` only the rows present in the
    gradient are updated (weight and momentum).

    Parameters
    ----------
    momentum : float, optional
        The momentum value.
    lazy_update : bool, optional
        Default True: lazy updates for row_sparse gradients.
    multi_precision : bool, optional
        Keep a float32 master copy of float16 weights.
    **kwargs
        The arguments of :class:`Optimizer`.

    Examples
    --------
    >>> import pskv
    >>> opt = pskv.optimizer.SGD(learning_rate=0.5, wd=0.1)
    >>> w = pskv.nd.ones((3,))
    >>> opt.update(0, w, pskv.nd.ones((3,)), None)
    >>> w.asnumpy().tolist()
    [0.44999998807907104, 0.44999998807907104, 0.44999998807907104]
    """

    _spec_args = {"momentum": "momentum", "lazy_update": "lazy_update"}
    aggregate_num = 4

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = momentum
        self.lazy_update = lazy_update

    def _update_impl(self, index: Any, weight: NDArray, grad: NDArray, state: Any,
                     multi_precision: bool) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        rg, clip = self.rescale_grad, self._clip()
        momentum = self.momentum if self.momentum > 0 else 0.0
        w, mom_state = self._buffers(weight, state, multi_precision)
        mom = None if mom_state is None else target(mom_state, "momentum state")
        values, rows = grad_parts(grad)
        if rows is None:  # MXNet aggregates dense updates: multi_(mp_)sgd_(mom_)update
            _multi_sgd(w, values, lr, wd, rg, clip, mom if momentum > 0 else None, momentum)
        elif multi_precision:  # mp_sgd_(mom_)update have no sparse kernel: dense fallback
            dense = dense_grad(grad)
            if mom is not None:
                run(_mom_kernel(w.dtype.type, lr, wd, rg, clip, momentum), [w, mom], [dense], 2)
            else:
                run(_sgd_kernel(w.dtype.type, lr, wd, rg, clip), [w], [dense], 1)
        elif mom is not None:
            kernel = _mom_kernel(w.dtype.type, lr, wd, rg, clip, momentum)
            if self.lazy_update:
                run_rows(kernel, [w, mom], [values], rows, 2)
            else:  # SGDMomStdDnsRspDnsKernel: every row, zero gradient where none
                run(kernel, [w, mom], [dense_grad(grad)], 2)
        else:
            _sgd_rsp(w, values, rows, lr, wd, rg, clip, self.lazy_update)
        if multi_precision:
            target(weight)[...] = w

    def update_multi_precision(self, index: Any, weight: NDArray, grad: NDArray,
                               state: Any) -> None:
        use_mp = self.multi_precision and weight.dtype == np.float16
        self._update_impl(index, weight, grad, state, multi_precision=use_mp)


@register
class ccSGD(SGD):  # noqa: N801 - MXNet's name
    """[DEPRECATED] Same as :class:`SGD`. Left here for backward compatibility."""


@register
class NAG(_Momentum):
    """Nesterov accelerated gradient.

    This optimizer updates each weight by::

        state = momentum * state + grad + wd * weight
        weight = weight - (lr * (grad + momentum * state))

    Parameters
    ----------
    momentum : float, optional
        The momentum value.
    multi_precision : bool, optional
        Keep a float32 master copy of float16 weights.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"momentum": "momentum"}

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = momentum

    def _update_impl(self, index: Any, weight: NDArray, grad: NDArray, state: Any,
                     multi_precision: bool) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        rg, clip = self.rescale_grad, self._clip()
        momentum = self.momentum if self.momentum > 0 else 0.0
        w, mom_state = self._buffers(weight, state, multi_precision)
        f = w.dtype.type
        if mom_state is None:
            values, rows = grad_parts(grad)
            if rows is not None and not multi_precision:  # sgd_update: lazy by default
                _sgd_rsp(w, values, rows, lr, wd, rg, clip, lazy=True)
            else:
                run(_sgd_kernel(f, lr, wd, rg, clip), [w], [dense_grad(grad)], 1)
        else:
            mom = target(mom_state, "momentum state")
            mom1 = f(momentum) + f(1)

            def kernel(w: np.ndarray, m: np.ndarray, g: np.ndarray, t1: np.ndarray,
                       t2: np.ndarray) -> None:
                # NAGMomKernel: m = mom*m; w = w - m + (mom+1)*(m - lr*(G + wd*w));
                # then m -= lr*(G + wd*w), where MXNet's in-place kernel reads the NEW weight
                m *= f(momentum)
                np.multiply(g, f(rg), out=t1)
                if clip is not None:
                    np.clip(t1, f(-clip), f(clip), out=t1)
                if wd:
                    np.multiply(w, f(wd), out=t2)
                    t2 += t1
                    t2 *= f(lr)
                else:
                    np.multiply(t1, f(lr), out=t2)
                np.subtract(m, t2, out=t2)
                t2 *= mom1
                w -= m
                w += t2
                if wd:
                    np.multiply(w, f(wd), out=t2)
                    t1 += t2
                t1 *= f(lr)
                m -= t1
            run(kernel, [w, mom], [dense_grad(grad)], 2)
        if multi_precision:
            target(weight)[...] = w

    def update_multi_precision(self, index: Any, weight: NDArray, grad: NDArray,
                               state: Any) -> None:
        use_mp = (self.multi_precision and weight.dtype == np.float16
                  and isinstance(state, (tuple, list)))
        self._update_impl(index, weight, grad, state, multi_precision=use_mp)


def _signsgd(w: np.ndarray, g: np.ndarray, lr: float, wd: float) -> None:
    """SignSGDKernel: ``w = (1 - lr*wd)*w - lr*sign(grad)`` (rescale and clip unused)."""
    f = w.dtype.type
    scale = f(1) - f(lr) * f(wd)

    def kernel(w: np.ndarray, g: np.ndarray, t1: np.ndarray) -> None:
        if scale != 1:
            w *= scale
        np.sign(g, out=t1)
        t1 *= f(lr)
        w -= t1
    run(kernel, [w], [g], 1)


@register
class Signum(Optimizer):
    r"""The Signum optimizer that takes the sign of gradient or momentum.

    The optimizer updates the weight by::

        rescaled_grad = rescale_grad * clip(grad, clip_gradient) + wd * weight
        state = momentum * state + (1-momentum)*rescaled_grad
        weight = (1 - lr * wd_lh) * weight - lr * sign(state)

    Parameters
    ----------
    momentum : float, optional
        The momentum value (default 0.9).
    wd_lh : float, optional
        The amount of decoupled weight decay regularization.
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    _spec_args = {"momentum": "momentum", "wd_lh": "wd_lh"}

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.9,
                 wd_lh: float = 0.0, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum
        self.wd_lh = wd_lh

    def create_state(self, index: Any, weight: NDArray) -> Any:
        if self.momentum != 0.0:
            return self._zeros_like(weight)
        return None

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        w = target(weight)
        g = dense_grad(grad)  # signum_update / signsgd_update: dense kernels only
        if state is None:
            _signsgd(w, g, lr, wd)
            return
        rg, clip = self.rescale_grad, self._clip()
        momentum = self.momentum if self.momentum > 0 else 0.0
        wd_lh = self.wd_lh or 0.0
        f = w.dtype.type
        omm = f(1) - f(momentum)
        scale = f(1) - f(lr) * f(wd_lh)

        def kernel(w: np.ndarray, m: np.ndarray, g: np.ndarray, t1: np.ndarray) -> None:
            # SignumKernel: m = mom*m - (1-mom)*wd*w - (1-mom)*clip(rg*g)
            m *= f(momentum)
            if wd:
                np.multiply(w, omm * f(wd), out=t1)
                m -= t1
            if clip is not None:
                np.multiply(g, f(rg), out=t1)
                np.clip(t1, f(-clip), f(clip), out=t1)
                t1 *= omm
            else:
                np.multiply(g, omm * f(rg), out=t1)
            m -= t1
            if scale != 1:
                w *= scale
            np.sign(m, out=t1)
            t1 *= f(lr)
            w += t1
        run(kernel, [w, target(state, "momentum state")], [g], 1)


@register
class SignSGD(Optimizer):
    """signSGD: ``weight = (1 - lr * wd) * weight - lr * sign(grad)``.

    MXNet 1.9.1 runs this kernel (``signsgd_update``) for ``Signum(momentum=0)`` but registers
    no ``'signsgd'`` name; pskv registers one. ``rescale_grad`` and ``clip_gradient`` have no
    effect, as in the kernel.

    Parameters
    ----------
    **kwargs
        The arguments of :class:`Optimizer`.
    """

    def update(self, index: Any, weight: NDArray, grad: NDArray, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        _signsgd(target(weight), dense_grad(grad), lr, wd)
