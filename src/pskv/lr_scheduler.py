"""Learning rate schedulers, as ``mxnet.lr_scheduler`` in MXNet 1.9.1.

A scheduler maps ``num_update`` (the largest number of updates applied to any weight) to a
learning rate. Like MXNet's, the schedulers are stateful: ``FactorScheduler`` and
``MultiFactorScheduler`` lower ``base_lr`` as updates pass their steps, and
``PolyScheduler`` / ``CosineScheduler`` store the last rate in ``base_lr``.

Examples
--------
>>> import pskv
>>> sched = pskv.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
>>> [sched(n) for n in (1, 2, 3, 5)]
[1.0, 1.0, 0.5, 0.25]
"""
from __future__ import annotations

import logging
from math import cos, pi
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["CosineScheduler", "FactorScheduler", "LRScheduler", "MultiFactorScheduler",
           "PolyScheduler", "scheduler_from_spec", "scheduler_to_spec"]

_log = logging.getLogger(__name__)


class LRScheduler:
    """Base class of a learning rate scheduler.

    Parameters
    ----------
    base_lr : float, optional
        The initial learning rate.
    warmup_steps : int
        Number of warmup steps used before this scheduler starts decay.
    warmup_begin_lr : float
        If using warmup, the learning rate from which it starts warming up.
    warmup_mode : str
        ``'linear'`` increases the rate in equal steps; ``'constant'`` keeps it at
        ``warmup_begin_lr`` for ``warmup_steps``.
    """

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0, warmup_mode: str = 'linear') -> None:
        self.base_lr = base_lr
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool):
            raise ConfigError(f"warmup_steps must be an int, got {warmup_steps!r}.")
        self.warmup_steps = warmup_steps
        self.warmup_final_lr = base_lr
        self.warmup_begin_lr = warmup_begin_lr
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise ConfigError("Base lr has to be higher than warmup_begin_lr")
        if self.warmup_steps < 0:
            raise ConfigError("Warmup steps has to be positive or 0")
        if warmup_mode not in ['linear', 'constant']:
            raise ConfigError("Supports only linear and constant modes of warmup")
        self.warmup_mode = warmup_mode
        self._init_kwargs: dict[str, Any] = {
            "base_lr": base_lr, "warmup_steps": warmup_steps,
            "warmup_begin_lr": warmup_begin_lr, "warmup_mode": warmup_mode}

    def get_warmup_lr(self, num_update: int) -> float:
        """The learning rate during warmup, for ``num_update < warmup_steps``."""
        if self.warmup_mode == 'linear':
            increase = (self.warmup_final_lr - self.warmup_begin_lr) \
                * float(num_update) / float(self.warmup_steps)
            return self.warmup_begin_lr + increase
        return self.warmup_begin_lr

    def __call__(self, num_update: int) -> float:
        """Return the learning rate after ``num_update`` updates."""
        raise NotImplementedError("must override this")


class FactorScheduler(LRScheduler):
    """Reduce the learning rate by a factor every ``step`` updates.

    Returns ``base_lr * pow(factor, floor(num_update/step))``, never below
    ``stop_factor_lr``.

    Parameters
    ----------
    step : int
        Changes the learning rate every ``step`` updates.
    factor : float, optional
        The factor to change the learning rate (at most 1).
    stop_factor_lr : float, optional
        Stop lowering the learning rate once it is below this value.
    base_lr, warmup_steps, warmup_begin_lr, warmup_mode
        As for :class:`LRScheduler`.
    """

    def __init__(self, step: int, factor: float = 1, stop_factor_lr: float = 1e-8,
                 base_lr: float = 0.01, warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = 'linear') -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if step < 1:
            raise ConfigError("Schedule step must be greater or equal than 1 round")
        if factor > 1.0:
            raise ConfigError("Factor must be no more than 1 to make lr reduce")
        self.step = step
        self.factor = factor
        self.stop_factor_lr = stop_factor_lr
        self.count = 0
        self._init_kwargs.update(step=step, factor=factor, stop_factor_lr=stop_factor_lr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        # a while, not an if: training may resume at a later num_update (as MXNet)
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
                _log.info("Update[%d]: now learning rate arrived at %0.5e, will not "
                          "change in the future", num_update, self.base_lr)
            else:
                _log.info("Update[%d]: Change learning rate to %0.5e", num_update,
                          self.base_lr)
        return self.base_lr


class MultiFactorScheduler(LRScheduler):
    """Reduce the learning rate by ``factor`` at each of the given steps.

    If ``step[k] <= num_update < step[k+1]``, the rate is ``base_lr * pow(factor, k+1)``.

    Parameters
    ----------
    step : list of int
        The increasing list of steps at which the rate changes.
    factor : float
        The factor to change the learning rate (at most 1).
    base_lr, warmup_steps, warmup_begin_lr, warmup_mode
        As for :class:`LRScheduler`.
    """

    def __init__(self, step: list[int], factor: float = 1, base_lr: float = 0.01,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = 'linear') -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, list) or len(step) < 1:
            raise ConfigError(f"step must be a non-empty list of ints, got {step!r}.")
        for i, _step in enumerate(step):
            if i != 0 and step[i] <= step[i - 1]:
                raise ConfigError("Schedule step must be an increasing integer list")
            if _step < 1:
                raise ConfigError("Schedule step must be greater or equal than 1 round")
        if factor > 1.0:
            raise ConfigError("Factor must be no more than 1 to make lr reduce")
        self.step = step
        self.cur_step_ind = 0
        self.factor = factor
        self.count = 0
        self._init_kwargs.update(step=list(step), factor=factor)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind <= len(self.step) - 1:
            if num_update > self.step[self.cur_step_ind]:
                self.count = self.step[self.cur_step_ind]
                self.cur_step_ind += 1
                self.base_lr *= self.factor
                _log.info("Update[%d]: Change learning rate to %0.5e", num_update,
                          self.base_lr)
            else:
                return self.base_lr
        return self.base_lr


class PolyScheduler(LRScheduler):
    """Reduce the learning rate along a polynomial of power ``pwr``.

    After warmup: ``final_lr + (start_lr - final_lr) * (1-nup/max_nup)^pwr`` while
    ``nup <= max_update``, then the last value.

    Parameters
    ----------
    max_update : int
        Number of updates after which the rate reaches ``final_lr``.
    base_lr : float
        Base learning rate to start from.
    pwr : int
        Power of the decay term.
    final_lr : float
        Final learning rate after all steps.
    warmup_steps, warmup_begin_lr, warmup_mode
        As for :class:`LRScheduler`.
    """

    def __init__(self, max_update: int, base_lr: float = 0.01, pwr: float = 2,
                 final_lr: float = 0, warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = 'linear') -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(max_update, int) or isinstance(max_update, bool):
            raise ConfigError(f"max_update must be an int, got {max_update!r}.")
        if max_update < 1:
            raise ConfigError("maximum number of updates must be strictly positive")
        self.power = pwr
        self.base_lr_orig = self.base_lr
        self.max_update = max_update
        self.final_lr = final_lr
        self.max_steps = self.max_update - self.warmup_steps
        self._init_kwargs.update(max_update=max_update, pwr=pwr, final_lr=final_lr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * \
                pow(1 - float(num_update - self.warmup_steps) / float(self.max_steps),
                    self.power)
        return self.base_lr


class CosineScheduler(LRScheduler):
    """Reduce the learning rate along a cosine.

    After warmup: ``final_lr + (start_lr - final_lr) * (1+cos(pi * nup/max_nup))/2`` while
    ``nup <= max_update``, then the last value.

    Parameters
    ----------
    max_update : int
        Number of updates after which the rate reaches ``final_lr``.
    base_lr : float
        Base learning rate.
    final_lr : float
        Final learning rate after all steps.
    warmup_steps, warmup_begin_lr, warmup_mode
        As for :class:`LRScheduler`.
    """

    def __init__(self, max_update: int, base_lr: float = 0.01, final_lr: float = 0,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0,
                 warmup_mode: str = 'linear') -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(max_update, int) or isinstance(max_update, bool):
            raise ConfigError(f"max_update must be an int, got {max_update!r}.")
        if max_update < 1:
            raise ConfigError("maximum number of updates must be strictly positive")
        self.base_lr_orig = base_lr
        self.max_update = max_update
        self.final_lr = final_lr
        self.max_steps = self.max_update - self.warmup_steps
        self._init_kwargs.update(max_update=max_update, final_lr=final_lr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * \
                (1 + cos(pi * (num_update - self.warmup_steps) / self.max_steps)) / 2
        return self.base_lr


def _all_schedulers() -> dict[str, type[LRScheduler]]:
    found: dict[str, type[LRScheduler]] = {}
    todo: list[type[LRScheduler]] = [LRScheduler]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    return False


def scheduler_to_spec(sched: LRScheduler) -> dict[str, Any]:
    """A scheduler as JSON data: ``{"name": class name, "kwargs": init args, "state": attrs}``.

    ``state`` holds the public attributes that change as it runs (``base_lr``, ``count``...).
    """
    kwargs = getattr(sched, "_init_kwargs", None)
    if not isinstance(sched, LRScheduler) or kwargs is None:
        raise ConfigError(f"cannot describe scheduler {sched!r} as a spec: it must be an "
                          "LRScheduler subclass whose __init__ calls LRScheduler.__init__.")
    state = {k: v for k, v in vars(sched).items() if not k.startswith("_") and _is_json(v)}
    out_kwargs = {k: v for k, v in kwargs.items() if _is_json(v)}
    return {"name": type(sched).__name__, "kwargs": out_kwargs, "state": state}


def scheduler_from_spec(spec: Mapping[str, Any]) -> LRScheduler:
    """Rebuild a scheduler from :func:`scheduler_to_spec` output.

    Examples
    --------
    >>> import pskv
    >>> s = pskv.lr_scheduler.MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=1.0)
    >>> s(3)
    0.1
    >>> scheduler_from_spec(scheduler_to_spec(s))(3)
    0.1
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) \
            or not isinstance(spec.get("kwargs", {}), Mapping):
        raise ConfigError(f"an lr_scheduler spec is {{'name': str, 'kwargs': dict}}, got "
                          f"{spec!r}.")
    known = _all_schedulers()
    cls = known.get(spec["name"])
    if cls is None or cls is LRScheduler:
        raise ConfigError(f"unknown lr_scheduler {spec['name']!r}. Known: "
                          f"{', '.join(sorted(k for k in known if k != 'LRScheduler'))}.")
    try:
        sched = cls(**dict(spec.get("kwargs", {})))
    except TypeError as err:
        raise ConfigError(f"bad arguments for {spec['name']}: {err}.") from err
    state = spec.get("state", {}) or {}
    if not isinstance(state, Mapping):
        raise ConfigError(f"lr_scheduler spec 'state' must be a dict, got {state!r}.")
    for key, value in state.items():
        if not isinstance(key, str) or key.startswith("_") or not hasattr(sched, key) \
                or not _is_json(value):
            raise ConfigError(f"lr_scheduler spec state has a bad entry {key!r}: {value!r}.")
        setattr(sched, key, value)
    return sched
