"""The Optimizer base class, the optimizer registry, ``create`` and the declarative spec.

Learning rates, weight decays and update counts follow MXNet 1.9.1's
``python/mxnet/optimizer/optimizer.py`` exactly: ``num_update`` is the largest per-index
update count of the current device, ``lr_mult`` / ``wd_mult`` are looked up by index, then by
the index's name in ``param_idx2name``.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, ClassVar, Mapping

import numpy as np

from .. import lr_scheduler as _lrs
from ..errors import ConfigError, LearningRateError, UnknownArgumentError, UnsupportedError
from ..nd.creation import zeros
from ..nd.ndarray import NDArray

__all__ = ["LearningRateError", "Optimizer", "UnknownArgumentError", "create", "from_spec",
           "register"]

_log = logging.getLogger(__name__)

Key = Any  # int or str, as the store passes it


def _json_value(value: Any, what: str) -> Any:
    """``value`` as a JSON scalar or list, or ConfigError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v, what) for v in value]
    raise ConfigError(f"{what}={value!r} cannot go into an optimizer spec: use a number, a "
                      "string, a bool, None or a list of them.")


def _check_key(key: Any, what: str) -> Any:
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer, str)):
        raise ConfigError(f"{what} key {key!r} is neither int nor str; only int and str keys "
                          "can be saved.")
    return int(key) if isinstance(key, np.integer) else key


def _pairs(mapping: Mapping[Any, Any], what: str) -> list[list[Any]]:
    return [[_check_key(k, what), _json_value(v, what)] for k, v in mapping.items()]


def _unpairs(pairs: Any, what: str) -> dict[Any, Any]:
    if isinstance(pairs, dict):  # a plain JSON object: str keys
        return dict(pairs)
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2
                                              for p in pairs):
        raise ConfigError(f"{what} must be a list of [key, value] pairs, got {pairs!r}.")
    return {_check_key(k, what): v for k, v in pairs}


class Optimizer:
    """The base class inherited by all optimizers.

    Parameters
    ----------
    rescale_grad : float, optional, default 1.0
        Multiply the gradient with `rescale_grad` before updating. Often
        choose to be ``1.0/batch_size``.
    param_idx2name : dict from int to string, optional, default None
        A dictionary that maps int index to string name.
    clip_gradient : float, optional, default None
        Clip the gradient by projecting onto the box ``[-clip_gradient, clip_gradient]``.
    learning_rate : float, optional, default None
        The initial learning rate. If None, the optimization will use the
        learning rate from ``lr_scheduler``. If not None, it will overwrite
        the learning rate in ``lr_scheduler``. If None and ``lr_scheduler``
        is also None, then it will be set to 0.01 by default.
    lr_scheduler : LRScheduler, optional, default None
        The learning rate scheduler.
    wd : float, optional, default 0.0
        The weight decay (or L2 regularization) coefficient.
    sym : Symbol, optional, default None
        Anything with MXNet's ``attr_dict()`` and ``list_arguments()``; its
        ``__lr_mult__`` / ``__wd_mult__`` attributes seed the multipliers.
    begin_num_update : int, optional, default 0
        The initial number of updates.
    multi_precision : bool, optional, default False
        Keep a float32 master copy of float16 weights and update that.
    param_dict : dict of int -> gluon.Parameter, default None
        Objects with ``lr_mult`` and ``wd_mult`` attributes, looked up first.

    Examples
    --------
    >>> import pskv
    >>> opt = pskv.optimizer.create('sgd', learning_rate=0.1, momentum=0.9)
    >>> opt.learning_rate
    0.1
    >>> w, g = pskv.nd.ones((2,)), pskv.nd.ones((2,))
    >>> opt.update(0, w, g, opt.create_state(0, w))
    >>> w.asnumpy().tolist(), opt.num_update
    ([0.8999999761581421, 0.8999999761581421], 1)
    """

    opt_registry: ClassVar[dict[str, type[Optimizer]]] = {}
    #: constructor argument -> attribute, for :meth:`to_spec` (subclasses extend it)
    _spec_args: ClassVar[dict[str, str]] = {}
    #: MXNet's multi-tensor aggregation size (SGD: 4); pskv updates one key at a time
    aggregate_num = 0

    def __init__(self, rescale_grad: float = 1., param_idx2name: dict[Any, str] | None = None,
                 wd: float = 0., clip_gradient: float | None = None,
                 learning_rate: float | None = None, lr_scheduler: Any = None,
                 sym: Any = None, begin_num_update: int = 0, multi_precision: bool = False,
                 param_dict: dict[Any, Any] | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise UnknownArgumentError(
                f"{type(self).__name__} got unexpected argument(s) {sorted(kwargs)}. It takes "
                f"{sorted(set(self._spec_args) | set(_BASE_ARGS))}.")
        self.rescale_grad = rescale_grad
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and learning_rate is None:
            learning_rate = 0.01
        self.lr = learning_rate
        if lr_scheduler is not None and learning_rate is not None:
            if lr_scheduler.base_lr != learning_rate:
                # MXNet prints this and overwrites the scheduler's base_lr
                _log.warning("learning rate from ``lr_scheduler`` has been overwritten by "
                             "``learning_rate`` in optimizer.")
                lr_scheduler.base_lr = learning_rate
        self.wd = wd
        self.lr_mult: dict[Any, float] = {}
        self.wd_mult: dict[Any, float] = {}
        self.begin_num_update = begin_num_update
        self.num_update = begin_num_update
        self._all_index_update_counts: dict[int, dict[Any, int]] = {0: {}}
        self._index_update_count = self._all_index_update_counts[0]
        self.clip_gradient = clip_gradient
        self.multi_precision = multi_precision
        if param_idx2name is None:
            param_idx2name = {}
        if not isinstance(param_idx2name, dict):
            raise ConfigError("param_idx2name should be a dict of param indexes to names, got "
                              f"{type(param_idx2name).__name__}.")
        self.idx2name = dict(param_idx2name)
        self.sym_info: Any = (sym.attr_dict(), sym.list_arguments()) if sym is not None else ()
        self.param_dict = param_dict if param_dict else {}
        self.set_lr_mult({})
        self.set_wd_mult({})

    # ---- registry -----------------------------------------------------------------------
    @staticmethod
    def register(klass: type[Optimizer]) -> type[Optimizer]:
        """Register an optimizer class under its lower-cased class name.

        Examples
        --------
        >>> import pskv
        >>> @pskv.optimizer.Optimizer.register
        ... class MyOptimizer(pskv.optimizer.Optimizer):
        ...     pass
        >>> type(pskv.optimizer.Optimizer.create_optimizer('MyOptimizer')).__name__
        'MyOptimizer'
        """
        if not isinstance(klass, type) or not issubclass(klass, Optimizer):
            raise ConfigError(f"register() takes an Optimizer subclass, got {klass!r}.")
        name = klass.__name__.lower()
        old = Optimizer.opt_registry.get(name)
        if old is not None and old is not klass:
            warnings.warn(f"WARNING: New optimizer {klass.__module__}.{klass.__name__} is "
                          f"overriding existing optimizer {old.__module__}.{old.__name__}",
                          stacklevel=2)
        Optimizer.opt_registry[name] = klass
        return klass

    @staticmethod
    def create_optimizer(name: str, **kwargs: Any) -> Optimizer:
        """Instantiate the optimizer registered as ``name`` (case-insensitive) with ``kwargs``.

        Raises
        ------
        ConfigError
            If no optimizer is registered under ``name`` (a ValueError, as in MXNet).
        """
        klass = Optimizer.opt_registry.get(str(name).lower()) if isinstance(name, str) else None
        if klass is None:
            raise ConfigError(f"Cannot find optimizer {name!r}. Registered optimizers: "
                              f"{', '.join(sorted(Optimizer.opt_registry))}.")
        return klass(**kwargs)

    # ---- learning rate ------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The current learning rate (from the scheduler at ``num_update`` if there is one)."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)  # type: ignore[no-any-return]
        return self.lr  # type: ignore[return-value]

    def set_learning_rate(self, lr: float) -> None:
        """Set a new learning rate; not allowed when an ``lr_scheduler`` is set."""
        if self.lr_scheduler is not None:
            raise LearningRateError(
                "LRScheduler of the optimizer has already been defined. Note that "
                "set_learning_rate can mutate the value of the learning rate of the optimizer "
                "only when the LRScheduler of the optimizer is undefined.")
        self.lr = lr

    def set_lr_scale(self, args_lrscale: Any) -> None:
        """[DEPRECATED] Use :meth:`set_lr_mult`."""
        raise UnsupportedError("set_lr_scale is deprecated (as in MXNet): use set_lr_mult.")

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        """Set a learning rate multiplier per parameter index or name (replacing the old ones)."""
        self.lr_mult = {}
        if self.sym_info:
            attr, arg_names = self.sym_info
            for name in arg_names:
                if name in attr and '__lr_mult__' in attr[name]:
                    self.lr_mult[name] = float(attr[name]['__lr_mult__'])
        self.lr_mult.update(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        """Set a weight decay multiplier per parameter index or name (replacing the old ones).

        Names in ``param_idx2name`` that end neither in ``_weight`` nor ``_gamma`` get 0.
        """
        self.wd_mult = {}
        for n in self.idx2name.values():
            if not (n.endswith('_weight') or n.endswith('_gamma')):
                self.wd_mult[n] = 0.0
        if self.sym_info:
            attr, arg_names = self.sym_info
            for name in arg_names:
                if name in attr and '__wd_mult__' in attr[name]:
                    self.wd_mult[name] = float(attr[name]['__wd_mult__'])
        self.wd_mult.update(args_wd_mult)

    def _set_current_context(self, device_id: int) -> None:
        """Switch the per-index update counts to those of device ``device_id``."""
        if device_id not in self._all_index_update_counts:
            self._all_index_update_counts[device_id] = {}
        self._index_update_count = self._all_index_update_counts[device_id]

    def _update_count(self, index: Any) -> None:
        """Count one update of ``index`` (or of each index in a list); bump ``num_update``."""
        if not isinstance(index, (list, tuple)):
            index = [index]
        for idx in index:
            if idx not in self._index_update_count:
                self._index_update_count[idx] = self.begin_num_update
            self._index_update_count[idx] += 1
            self.num_update = max(self._index_update_count[idx], self.num_update)

    def _get_lrs(self, indices: list[Any]) -> list[float]:
        lr = self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr
        lrs: list[float] = [float(lr) for _ in indices]  # type: ignore[arg-type]
        for i, index in enumerate(indices):
            if index in self.param_dict:
                lrs[i] *= self.param_dict[index].lr_mult
            elif index in self.lr_mult:
                lrs[i] *= self.lr_mult[index]
            elif index in self.idx2name:
                lrs[i] *= self.lr_mult.get(self.idx2name[index], 1.0)
        return lrs

    def _get_lr(self, index: Any) -> float:
        """The learning rate of ``index``: scheduler or ``lr``, times its ``lr_mult``."""
        return self._get_lrs([index])[0]

    def _get_wds(self, indices: list[Any]) -> list[float]:
        wds = [self.wd for _ in indices]
        for i, index in enumerate(indices):
            if index in self.param_dict:
                wds[i] *= self.param_dict[index].wd_mult
            elif index in self.wd_mult:
                wds[i] *= self.wd_mult[index]
            elif index in self.idx2name:
                wds[i] *= self.wd_mult.get(self.idx2name[index], 1.0)
        return wds

    def _get_wd(self, index: Any) -> float:
        """The weight decay of ``index``: ``wd`` times its ``wd_mult``."""
        return self._get_wds([index])[0]

    # ---- states and updates ----------------------------------------------------------------
    def create_state(self, index: Key, weight: NDArray) -> Any:
        """Create the auxiliary state (None, an NDArray or a tuple of them) of a weight."""
        return None

    def create_state_multi_precision(self, index: Key, weight: NDArray) -> Any:
        """Create the state, plus a float32 master copy first when the weight is float16."""
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (master,) + (self.create_state(index, master),)
        if weight.dtype == np.float16 and not self.multi_precision:
            warnings.warn("Accumulating with float16 in optimizer can lead to poor accuracy "
                          "or slow convergence. Consider using multi_precision=True option "
                          "of the optimizer", stacklevel=2)
        return self.create_state(index, weight)

    def update(self, index: Key, weight: NDArray, grad: NDArray, state: Any) -> None:
        """Update ``weight`` in place from ``grad`` and ``state`` (also updated in place)."""
        raise UnsupportedError(f"{type(self).__name__} does not implement update().")

    def update_multi_precision(self, index: Key, weight: NDArray, grad: NDArray,
                               state: Any) -> None:
        """:meth:`Optimizer.update`, through the float32 master copy for float16 weights."""
        if self.multi_precision and weight.dtype == np.float16:
            master, original_state = state[0], state[1]
            self.update(index, master, grad.astype(np.float32), original_state)
            weight._data[...] = master._data.astype(weight.dtype)
        else:
            self.update(index, weight, grad, state)

    @staticmethod
    def _zeros_like(weight: NDArray, dtype: Any = None) -> NDArray:
        """A dense zero state shaped like ``weight`` (also for row_sparse weights)."""
        return zeros(weight.shape, weight.context, dtype=weight.dtype if dtype is None
                     else dtype)

    def _clip(self) -> float | None:
        """The clip bound the C++ kernels apply: set only when ``clip_gradient`` is truthy
        and non-negative (MXNet passes it only ``if self.clip_gradient``; kernels test >= 0)."""
        c = self.clip_gradient
        return float(c) if c and c >= 0 else None

    # ---- declarative spec --------------------------------------------------------------
    def to_spec(self) -> dict[str, Any]:
        """This optimizer as JSON data: ``{"name", "kwargs", "state"}``.

        ``kwargs`` rebuild it through :func:`create` (an ``lr_scheduler`` as its own spec,
        ``param_idx2name`` as ``[index, name]`` pairs); ``state`` holds what changed since:
        multipliers, ``num_update`` and per-device update counts. ``sym`` and ``param_dict``
        are not kept (MXNet's pickle drops ``param_dict`` too).

        Examples
        --------
        >>> import pskv
        >>> spec = pskv.optimizer.create('adam', learning_rate=0.1).to_spec()
        >>> spec['name'], spec['kwargs']['beta1']
        ('adam', 0.9)
        >>> pskv.optimizer.from_spec(spec).lr
        0.1
        """
        name = type(self).__name__.lower()
        if Optimizer.opt_registry.get(name) is not type(self):
            raise ConfigError(f"{type(self).__name__} is not registered, so it cannot be "
                              "rebuilt from a spec. Decorate it with @register.")
        kwargs: dict[str, Any] = {
            "rescale_grad": _json_value(self.rescale_grad, "rescale_grad"),
            "param_idx2name": _pairs(self.idx2name, "param_idx2name"),
            "wd": _json_value(self.wd, "wd"),
            "clip_gradient": _json_value(self.clip_gradient, "clip_gradient"),
            "learning_rate": _json_value(self.lr, "learning_rate"),
            "lr_scheduler": (None if self.lr_scheduler is None
                             else _lrs.scheduler_to_spec(self.lr_scheduler)),
            "begin_num_update": _json_value(self.begin_num_update, "begin_num_update"),
            "multi_precision": bool(self.multi_precision),
        }
        for arg, attr in self._spec_args.items():
            kwargs[arg] = _json_value(getattr(self, attr), arg)
        state = {
            "lr_mult": _pairs(self.lr_mult, "lr_mult"),
            "wd_mult": _pairs(self.wd_mult, "wd_mult"),
            "num_update": int(self.num_update),
            "update_counts": [[int(dev), _pairs(counts, "update count")]
                              for dev, counts in self._all_index_update_counts.items()],
        }
        return {"name": name, "kwargs": kwargs, "state": state}

    def _load_spec_state(self, state: Mapping[str, Any]) -> None:
        try:
            if "lr_mult" in state:
                self.lr_mult = {k: float(v) for k, v in
                                _unpairs(state["lr_mult"], "lr_mult").items()}
            if "wd_mult" in state:
                self.wd_mult = {k: float(v) for k, v in
                                _unpairs(state["wd_mult"], "wd_mult").items()}
            if "num_update" in state:
                self.num_update = int(state["num_update"])
            if "update_counts" in state:
                counts = {int(dev): {k: int(v) for k, v in _unpairs(c, "update count").items()}
                          for dev, c in state["update_counts"]}
                self._all_index_update_counts = counts or {0: {}}
                self._index_update_count = self._all_index_update_counts.setdefault(0, {})
        except (TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"bad optimizer spec state {state!r}: {err}. Pass the output "
                              "of Optimizer.to_spec().") from err


_BASE_ARGS = ("rescale_grad", "param_idx2name", "wd", "clip_gradient", "learning_rate",
              "lr_scheduler", "sym", "begin_num_update", "multi_precision", "param_dict")

register = Optimizer.register
create = Optimizer.create_optimizer


def from_spec(spec: Mapping[str, Any]) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.to_spec` output (no pickle involved).

    Raises
    ------
    ConfigError
        If the spec is malformed or names an unregistered optimizer or scheduler.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) \
            or not isinstance(spec.get("kwargs", {}), Mapping):
        raise ConfigError(f"an optimizer spec is {{'name': str, 'kwargs': dict}}, got "
                          f"{spec!r}. Pass the output of Optimizer.to_spec().")
    kwargs = dict(spec.get("kwargs", {}))
    if "param_idx2name" in kwargs and kwargs["param_idx2name"] is not None:
        kwargs["param_idx2name"] = _unpairs(kwargs["param_idx2name"], "param_idx2name")
    if kwargs.get("lr_scheduler") is not None:
        kwargs["lr_scheduler"] = _lrs.scheduler_from_spec(kwargs["lr_scheduler"])
    for key, value in kwargs.items():
        if isinstance(value, float) and not math.isfinite(value) and key != "clip_gradient":
            raise ConfigError(f"optimizer spec argument {key}={value!r} is not finite.")
    opt = create(spec["name"], **kwargs)
    state = spec.get("state")
    if state is not None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"optimizer spec 'state' must be a dict, got {state!r}.")
        opt._load_spec_state(state)
    return opt
