"""What every worker of a dist store checks locally, so that all of them refuse alike.

An optimizer is checked completely on the worker before its spec is sent: each keyword
argument against the type its class declares, then one trial update on a small array, so a
spec the servers could not run is refused at once, on every worker, with the same
ConfigError (instead of a server failing at the first push and the workers waiting).
"""
from __future__ import annotations

import inspect
import json
import math
import warnings
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["check_optimizer_spec"]


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


def check_optimizer_spec(optimizer: Any, spec: dict[str, Any]) -> None:
    """Raise ConfigError if the servers could not run ``spec`` (``optimizer.to_spec()``)."""
    from .. import optimizer as opt_mod
    from ..nd import array
    name = type(optimizer).__name__
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"set_optimizer: {name} cannot be sent to the servers: {err}. Give "
                          "it plain numbers, strings and lists.") from None
    declared = _declared(type(optimizer))
    for arg, value in sorted(spec.get("kwargs", {}).items()):
        why = _bad(value, declared.get(arg, ""))
        if why is not None:
            want = declared[arg]
            raise ConfigError(f"set_optimizer: {name}({arg}={value!r}): {why} ({want} "
                              f"expected). Pass a {want.replace(' | None', '')}.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = opt_mod.get_updater(opt_mod.from_spec(spec))
            trial(0, array(np.ones(2, np.float32)), array(np.ones(2, np.float32)))
    except Exception as err:  # whatever the servers would hit at the first push
        raise ConfigError(f"set_optimizer: {name} fails on a trial update "
                          f"({type(err).__name__}: {err}); the servers could not run it. "
                          "Check its arguments.") from None
