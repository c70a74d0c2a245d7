"""The optimizer checks every store's ``set_optimizer`` runs before it changes anything.

An optimizer's hyperparameters are checked against the types its class declares on every
store (:func:`check_optimizer_values`); a dist store, which sends it to the servers as a
spec, also runs one trial update on a small array of a copy rebuilt from the spec
(:func:`check_optimizer_spec`). So a dist store refuses a spec the servers could not run
at once, on every worker, with the same ConfigError (instead of a server failing at the
first push and the workers waiting), while a local store runs the object it was given,
as MXNet's does (:func:`pskv.kvstore.base.check_optimizer` is the one entry point). A
server's engine runs :func:`check_optimizer_spec` on the spec it is sent.
"""
from __future__ import annotations

import inspect
import json
import math
import warnings
from typing import Any

import numpy as np

from .. import optimizer as opt_mod
from ..errors import ConfigError
from ..nd import array

__all__ = ["check_optimizer_spec", "check_optimizer_values"]


#: constructor argument -> attribute, for the arguments every Optimizer takes
_BASE_ATTRS = {"rescale_grad": "rescale_grad", "wd": "wd", "clip_gradient": "clip_gradient",
               "learning_rate": "lr", "begin_num_update": "begin_num_update",
               "multi_precision": "multi_precision"}


def _declared(cls: type) -> dict[str, str]:
    """Keyword argument -> its annotation (as written), over the class and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, param in inspect.signature(init).parameters.items():
            if param.annotation is not inspect.Parameter.empty:
                out[name] = str(param.annotation)
    return out


def _bad(value: Any, annotation: str) -> str | None:
    """Why ``value`` does not fit ``annotation`` (None if it does or cannot be told)."""
    if value is None:
        return None if "None" in annotation or "Any" in annotation else "None"
    words = annotation.replace("|", " ").split()
    if words == ["bool"]:
        return None if isinstance(value, bool) else "not a bool"
    if words and set(words) <= {"float", "int", "None"}:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "not a number"
        if not math.isfinite(value):
            return "not finite"
    return None


def _refuse(name: str, arg: str, value: Any, why: str, want: str) -> ConfigError:
    return ConfigError(f"set_optimizer: {name}({arg}={value!r}): {why} ({want} "
                       f"expected). Pass a {want.replace(' | None', '')}.")


def check_optimizer_values(optimizer: Any) -> None:
    """Raise ConfigError if a hyperparameter ``optimizer`` holds is not of its declared type.

    For optimizers that cannot be written as a spec (an unregistered class, a custom
    ``lr_scheduler``): their values are read from the attributes, no trial update is run.
    """
    declared = _declared(type(optimizer))
    attrs = {**_BASE_ATTRS, **getattr(type(optimizer), "_spec_args", {})}
    for arg, attr in sorted(attrs.items()):
        if arg in declared and hasattr(optimizer, attr):
            value = getattr(optimizer, attr)
            why = _bad(value, declared[arg])
            if why is not None:
                raise _refuse(type(optimizer).__name__, arg, value, why, declared[arg])


def check_optimizer_spec(optimizer: Any, spec: dict[str, Any]) -> None:
    """Raise ConfigError if the servers could not run ``spec`` (``optimizer.to_spec()``)."""
    name = type(optimizer).__name__
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
            or not isinstance(spec.get("kwargs", {}), dict):
        raise ConfigError(f"set_optimizer: {name}.to_spec() returned {str(spec)[:200]}, not a "
                          "spec {'name': str, 'kwargs': dict}. Return one from to_spec (or "
                          "raise ConfigError there, for an optimizer that cannot travel).")
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"set_optimizer: {name} cannot be written as a JSON spec (what a "
                          f"dist store sends to its servers): {err}. Give it plain finite "
                          "numbers, strings and lists.") from None
    declared = _declared(type(optimizer))
    for arg, value in sorted(spec.get("kwargs", {}).items()):
        why = _bad(value, declared.get(arg, ""))
        if why is not None:
            raise _refuse(name, arg, value, why, declared[arg])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = opt_mod.get_updater(opt_mod.from_spec(spec))
            trial(0, array(np.ones(2, np.float32)), array(np.ones(2, np.float32)))
    except Exception as err:  # whatever the servers would hit at the first push
        raise ConfigError(f"set_optimizer: {name} fails on a trial update "
                          f"({type(err).__name__}: {err}); no store could run it. "
                          "Check its arguments.") from None
