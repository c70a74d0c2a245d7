"""What a dynamic table is: :class:`TableSpec`, its initializers and its policies.

All of them are frozen dataclasses checked when made (:class:`~pskv.errors.TableSpecError`)
and turned into JSON by ``to_json`` (``{"type": ..., ...}``), so a server can rebuild a
spec a worker declared (docs/embeddings.md).
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Union

import numpy as np

from .. import optimizer as opt_mod
from ..errors import ConfigError, KVStoreError, TableSpecError
from ._halves import HALVES, STORAGE
from ._rowopt import ELEMENTWISE, ROWWISE, row_optimizer

__all__ = ["Always", "Capacity", "Constant", "CountAdmission", "Normal",
           "ProbabilityAdmission", "ReadOnly", "RowMeta", "TTL", "TableSpec", "Uniform",
           "Zeros"]


def _bad(what: str, got: Any, want: str) -> TableSpecError:
    return TableSpecError(f"{what}={got!r} is not valid: {want}.")


def _num(what: str, value: Any, low: float | None = None, high: float | None = None,
         integer: bool = False, open_low: bool = False) -> Any:
    ok = isinstance(value, (int, np.integer)) if integer else \
        isinstance(value, (int, float, np.integer, np.floating))
    if isinstance(value, (bool, np.bool_)) or not ok or \
            (not integer and not math.isfinite(float(value))):
        raise _bad(what, value, "give a finite " + ("integer" if integer else "number"))
    if low is not None and (value <= low if open_low else value < low):
        raise _bad(what, value, f"it must be {'>' if open_low else '>='} {low}")
    if high is not None and value > high:
        raise _bad(what, value, f"it must be <= {high}")
    return int(value) if integer else float(value)


# ---- initializers ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Zeros:
    """Rows start as zeros."""

    def to_json(self) -> dict[str, Any]:
        """This initializer as JSON."""
        return {"type": "zeros"}


@dataclass(frozen=True, slots=True)
class Constant:
    """Rows start with every element equal to ``value``."""

    value: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _num("Constant.value", self.value))

    def to_json(self) -> dict[str, Any]:
        """This initializer as JSON."""
        return {"type": "constant", "value": self.value}


@dataclass(frozen=True, slots=True)
class Uniform:
    """Rows start uniform in ``[low, high)``, a function of (seed, ID, column)."""

    low: float = -0.01
    high: float = 0.01

    def __post_init__(self) -> None:
        low, high = _num("Uniform.low", self.low), _num("Uniform.high", self.high)
        if not low < high:
            raise _bad("Uniform(low, high)", (low, high), "low must be below high")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    def to_json(self) -> dict[str, Any]:
        """This initializer as JSON."""
        return {"type": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True, slots=True)
class Normal:
    """Rows start normal(``mean``, ``std``), a function of (seed, ID, column)."""

    mean: float = 0.0
    std: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", _num("Normal.mean", self.mean))
        object.__setattr__(self, "std", _num("Normal.std", self.std, low=0.0))

    def to_json(self) -> dict[str, Any]:
        """This initializer as JSON."""
        return {"type": "normal", "mean": self.mean, "std": self.std}


Initializer = Union[Zeros, Constant, Uniform, Normal]


# ---- admission -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Always:
    """Admit every unknown ID at its first sighting."""

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON."""
        return {"type": "always"}


@dataclass(frozen=True, slots=True)
class CountAdmission:
    """Admit an ID at its ``min_count``-th sighting (a call that sees it unknown).

    Sightings live in ``counters`` int32 cells indexed by a hash of the ID: bounded
    memory; IDs that share a cell may be admitted early, never late.
    """

    min_count: int
    counters: int = 1 << 20

    def __post_init__(self) -> None:
        _num("CountAdmission.min_count", self.min_count, low=1, integer=True)
        _num("CountAdmission.counters", self.counters, low=1, high=1 << 32, integer=True)

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON."""
        return {"type": "count", "min_count": int(self.min_count),
                "counters": int(self.counters)}


@dataclass(frozen=True, slots=True)
class ProbabilityAdmission:
    """Admit an unknown ID when a deterministic draw of (seed, ID, step) is below ``p``.

    ``per_step=False`` draws from (seed, ID) only: a fixed fraction ``p`` of all IDs.
    """

    p: float
    per_step: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _num("ProbabilityAdmission.p", self.p, 0.0, 1.0))
        if not isinstance(self.per_step, bool):
            raise _bad("ProbabilityAdmission.per_step", self.per_step, "give True or False")

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON."""
        return {"type": "probability", "p": self.p, "per_step": self.per_step}


@dataclass(frozen=True, slots=True)
class ReadOnly:
    """Admit nothing: training never inserts (rows come from ``assign`` and restores)."""

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON."""
        return {"type": "read_only"}


Admission = Union[Always, CountAdmission, ProbabilityAdmission, ReadOnly]


# ---- eviction --------------------------------------------------------------------------
class RowMeta(NamedTuple):
    """What a custom eviction score sees: one array entry per row examined."""

    ids: np.ndarray
    count: np.ndarray
    last_step: np.ndarray
    last_seconds: np.ndarray


@dataclass(frozen=True, slots=True)
class Capacity:
    """Keep at most ``max_rows`` rows after a sweep; lowest score goes first.

    ``policy``: ``'lru'`` (score: the last step a row was used), ``'lfu'`` (its use count),
    or ``score``: a callable of a :class:`RowMeta` returning one float per row.
    """

    max_rows: int
    policy: Literal["lru", "lfu", "custom"] = "lru"
    score: Callable[[RowMeta], np.ndarray] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _num("Capacity.max_rows", self.max_rows, low=1, integer=True)
        if self.score is not None:
            if not callable(self.score):
                raise _bad("Capacity.score", self.score, "give a callable of a RowMeta")
            object.__setattr__(self, "policy", "custom")
        elif self.policy not in ("lru", "lfu"):
            raise _bad("Capacity.policy", self.policy, "use 'lru' or 'lfu', or pass score=")

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON (a custom score cannot be written)."""
        if self.score is not None:
            raise TableSpecError("a Capacity policy with a custom score cannot be written as "
                                 "JSON. Use policy='lru' or 'lfu' where the spec must travel.")
        return {"type": "capacity", "max_rows": int(self.max_rows), "policy": self.policy}


@dataclass(frozen=True, slots=True)
class TTL:
    """Expire a row unused (trained on or pushed) for more than ``steps`` or ``seconds``."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise _bad("TTL", (self.steps, self.seconds), "give steps=, seconds= or both")
        if self.steps is not None:
            _num("TTL.steps", self.steps, low=0, integer=True, open_low=True)
        if self.seconds is not None:
            object.__setattr__(self, "seconds",
                               _num("TTL.seconds", self.seconds, low=0.0, open_low=True))

    def to_json(self) -> dict[str, Any]:
        """This policy as JSON."""
        return {"type": "ttl", "steps": self.steps, "seconds": self.seconds}


Eviction = Union[Capacity, TTL]

_INITS: dict[str, Any] = {"zeros": Zeros, "constant": Constant, "uniform": Uniform,
                          "normal": Normal}
_ADMISSIONS: dict[str, Any] = {"always": Always, "count": CountAdmission,
                               "probability": ProbabilityAdmission, "read_only": ReadOnly}
_EVICTIONS: dict[str, Any] = {"capacity": Capacity, "ttl": TTL}


def _from_json(kinds: dict[str, Any], data: Any, what: str) -> Any:
    if not isinstance(data, dict) or data.get("type") not in kinds:
        raise TableSpecError(f"bad {what} in a table spec: {data!r}. Expected one of "
                             f"{sorted(kinds)} as {{'type': ...}}.")
    args = {k: v for k, v in data.items() if k != "type"}
    try:
        return kinds[data["type"]](**args)
    except TypeError as err:
        raise TableSpecError(f"bad {what} in a table spec: {data!r} ({err}).") from err


# ---- the spec --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TableSpec:
    """A dynamic embedding table: rows of ``dim`` values keyed by raw int64 IDs.

    Pass it to ``kv.init(key, spec)``. The rules each field selects are in
    docs/embeddings.md.

    Parameters
    ----------
    dim : int
        Values per row.
    dtype : {'float32', 'float64', 'float16', 'bfloat16'}
        The dtype the rows are stored in (R17). A half dtype (float16, or bfloat16 kept
        as uint16 bit patterns) halves a row's memory: a push widens the rows to
        ``state_dtype``, runs the row optimizer there and rounds them back to nearest even;
        lookups return them widened.
    init : Zeros, Constant, Uniform or Normal
        A row's initial value, a function of (``seed``, ID, column) (R2).
    seed : int
        The table seed (initial values and probability draws).
    admission : Always, CountAdmission, ProbabilityAdmission or ReadOnly
        Which unknown IDs may get a row (R9).
    eviction : Capacity, TTL, or a tuple of them
        Which rows a sweep removes (R10); ``()``: none.
    state_layout : {'elementwise', 'rowwise'}
        Optimizer state per element, or one accumulator per row (AdaGrad) (R12).
    duplicates : {'sum', 'mean'}
        How the gradients of an ID repeated in one push combine (R7).
    birth : {'pull', 'push'}
        Whether a training lookup or the first push creates a row (R3).
    unknown : {'init', 'zeros'}
        What an ID without a row reads (R4).
    sweep_rows : int
        Slots a store's sweep examines after each push.
    reserve_rows : int
        Rows to allocate up front (pages are committed as rows are used).
    optimizer : pskv.optimizer.Optimizer or None
        The table's own row optimizer (``SGD``, ``AdaGrad``, ``Ftrl`` or ``Adam``; R12): it
        updates this table's rows on every push, whatever ``kv.set_optimizer`` holds, so a
        store without an optimizer (the dense part trained by a torch optimizer through
        ``pskv.torch.DistributedOptimizer``) trains the table. None: the store's optimizer.
        It travels as its spec (``to_json``), and is left out of ``==``.
    state_dtype : {'float32', 'float64'} or None
        The dtype of the row optimizer's state and of the arithmetic (R17), which lookups
        return. None: float32 for a half ``dtype``, else ``dtype`` (a float32 or float64
        table computes in its own dtype).

    Examples
    --------
    >>> from pskv.table import TableSpec, Normal, Capacity
    >>> spec = TableSpec(dim=8, init=Normal(0, 0.1), eviction=Capacity(1000, 'lfu'))
    >>> TableSpec.from_json(spec.to_json()) == spec
    True
    """

    dim: int
    dtype: str = "float32"
    init: Initializer = field(default_factory=Zeros)
    seed: int = 0
    admission: Admission = field(default_factory=Always)
    eviction: Any = ()
    state_layout: Literal["elementwise", "rowwise"] = "elementwise"
    duplicates: Literal["sum", "mean"] = "sum"
    birth: Literal["pull", "push"] = "pull"
    unknown: Literal["init", "zeros"] = "init"
    sweep_rows: int = 4096
    reserve_rows: int = 0
    optimizer: Any = field(default=None, compare=False)
    state_dtype: str | None = None

    def __post_init__(self) -> None:
        _num("TableSpec.dim", self.dim, low=1, integer=True)
        dt = _dtype_name(self.dtype)
        if dt not in STORAGE:
            raise _bad("TableSpec.dtype", self.dtype, "tables store 'float32', 'float64', "
                       "'float16' or 'bfloat16'")
        object.__setattr__(self, "dtype", dt)
        st = ("float32" if dt in HALVES else dt) if self.state_dtype is None \
            else _dtype_name(self.state_dtype)
        if st not in ("float32", "float64") or (dt not in HALVES and st != dt):
            raise _bad("TableSpec.state_dtype", self.state_dtype,
                       "a float16 or bfloat16 table computes in 'float32' or 'float64'; a "
                       "float32 or float64 table in its own dtype. Give one of those, or None")
        object.__setattr__(self, "state_dtype", st)
        if not isinstance(self.init, tuple(_INITS.values())):
            raise _bad("TableSpec.init", self.init, "use Zeros(), Constant(v), Uniform(low, "
                       "high) or Normal(mean, std) from pskv.table")
        _num("TableSpec.seed", self.seed, low=0, high=2**64 - 1, integer=True)
        if not isinstance(self.admission, tuple(_ADMISSIONS.values())):
            raise _bad("TableSpec.admission", self.admission, "use Always(), "
                       "CountAdmission(n), ProbabilityAdmission(p) or ReadOnly()")
        ev = self.eviction if isinstance(self.eviction, (tuple, list)) else (self.eviction,)
        ev = tuple(ev)
        if not all(isinstance(e, (Capacity, TTL)) for e in ev) or \
                sum(isinstance(e, Capacity) for e in ev) > 1 or \
                sum(isinstance(e, TTL) for e in ev) > 1:
            raise _bad("TableSpec.eviction", self.eviction, "give at most one Capacity(...) "
                       "and one TTL(...), alone or in a tuple")
        object.__setattr__(self, "eviction", ev)
        for name, allowed in (("state_layout", ("elementwise", "rowwise")),
                              ("duplicates", ("sum", "mean")), ("birth", ("pull", "push")),
                              ("unknown", ("init", "zeros"))):
            if getattr(self, name) not in allowed:
                raise _bad(f"TableSpec.{name}", getattr(self, name),
                           f"use one of {list(allowed)}")
        _num("TableSpec.sweep_rows", self.sweep_rows, low=1, integer=True)
        _num("TableSpec.reserve_rows", self.reserve_rows, low=0, integer=True)
        if self.optimizer is not None:
            object.__setattr__(self, "optimizer", _row_optimizer(self))

    @property
    def storage(self) -> np.dtype[Any]:
        """The NumPy dtype of the array holding the rows (uint16 for bfloat16, R17)."""
        return STORAGE[self.dtype]

    @property
    def capacity(self) -> Capacity | None:
        """The Capacity policy, if any."""
        return next((e for e in self.eviction if isinstance(e, Capacity)), None)

    @property
    def ttl(self) -> TTL | None:
        """The TTL policy, if any."""
        return next((e for e in self.eviction if isinstance(e, TTL)), None)

    def to_json(self) -> dict[str, Any]:
        """This spec as JSON data (rebuild it with :meth:`from_json`)."""
        return {"dim": int(self.dim), "dtype": self.dtype, "init": self.init.to_json(),
                "seed": int(self.seed), "admission": self.admission.to_json(),
                "eviction": [e.to_json() for e in self.eviction],
                "state_layout": self.state_layout, "duplicates": self.duplicates,
                "birth": self.birth, "unknown": self.unknown,
                "sweep_rows": int(self.sweep_rows), "reserve_rows": int(self.reserve_rows),
                "optimizer": None if self.optimizer is None else _optimizer_json(self.optimizer),
                "state_dtype": self.state_dtype}

    @classmethod
    def from_json(cls, data: Any) -> TableSpec:
        """The spec :meth:`to_json` wrote."""
        if not isinstance(data, dict):
            raise TableSpecError(f"a table spec is a dict, got {data!r}.")
        args = dict(data)
        try:
            args["init"] = _from_json(_INITS, args.get("init", {"type": "zeros"}), "init")
            args["admission"] = _from_json(_ADMISSIONS, args.get("admission",
                                                                 {"type": "always"}), "admission")
            args["eviction"] = tuple(_from_json(_EVICTIONS, e, "eviction")
                                     for e in args.get("eviction", []))
            return cls(**args)
        except TypeError as err:
            raise TableSpecError(f"bad table spec {data!r} ({err}).") from err


def _dtype_name(dtype: Any) -> str:
    """The name of ``dtype`` ('bfloat16' as given: NumPy has no such dtype), or its repr."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return dtype
    try:
        return np.dtype(dtype).name
    except (TypeError, ValueError):
        return repr(dtype)


def _row_optimizer(spec: TableSpec) -> Any:
    """``spec.optimizer`` (an Optimizer, or its spec from JSON) checked: an optimizer a
    table's rows can run (R12) with this spec's layout; else TableSpecError."""
    opt = spec.optimizer
    if isinstance(opt, dict):
        try:
            opt = opt_mod.from_spec(opt)
        except KVStoreError as err:
            raise TableSpecError(f"TableSpec.optimizer: the spec {str(spec.optimizer)[:200]} "
                                 f"does not rebuild an optimizer ({err}).") from err
    if not isinstance(opt, opt_mod.Optimizer):
        raise _bad("TableSpec.optimizer", opt, "give a pskv.optimizer.Optimizer (SGD, AdaGrad, "
                   "Ftrl or Adam), e.g. mx.optimizer.AdaGrad(learning_rate=0.1), or None to "
                   "use the store's")
    name = type(opt).__name__
    why: str | None
    rows = (ROWWISE if spec.state_layout == "rowwise" else ELEMENTWISE).get(type(opt))
    if type(opt) not in ELEMENTWISE:         # the row optimizers' registry decides
        names = [c.__name__ for c in ELEMENTWISE]
        why = f"tables run {', '.join(names[:-1])} or {names[-1]}"
    elif rows is None:
        why = f"state_layout='rowwise' takes {' or '.join(c.__name__ for c in ROWWISE)} only"
    elif opt.multi_precision:
        why = ("a table computes in float32 or float64 (a half table in its state_dtype, "
               "R17): no multi_precision")
    elif rows.refuses_wd and opt.wd != 0.0:
        why = "sparse AdaGrad does not support wd (as in MXNet): use wd=0"
    else:
        why = _trial(opt, spec)
        if why is None:
            return opt
    raise TableSpecError(f"TableSpec.optimizer={name}(...) cannot update table rows: {why}. "
                         "Pass one that can (R12, docs/embeddings.md).")


def _trial(opt: Any, spec: TableSpec) -> str | None:
    """Why one row update by a copy of ``opt`` fails (a hyperparameter of the wrong type
    or not finite), or None: the spec is refused when made, not at a server's first push."""
    trial = copy.deepcopy(opt)
    w = np.ones((1, spec.dim), spec.state_dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rowopt = row_optimizer(trial, spec.state_layout, spec.dim, "trial")
            states = [np.zeros((1, width), spec.state_dtype) for width in rowopt.widths]
            t = np.ones(1, np.int64) if rowopt.per_row_step else None
            rowopt.update(trial, "trial", w, states, np.ones_like(w), t)
    except Exception as err:  # whatever its first push would meet
        return f"a trial update fails ({type(err).__name__}: {err})"
    if not np.isfinite(w).all():
        return "a trial update gives non-finite rows (check its hyperparameters)"
    return None
    return opt


def _optimizer_json(opt: Any) -> dict[str, Any]:
    """A table optimizer's spec without its counts (what every worker declares alike)."""
    try:
        spec = opt.to_spec()
    except ConfigError as err:
        raise TableSpecError(f"TableSpec.optimizer cannot be written as JSON ({err}). Give "
                             "it no custom lr_scheduler where the spec must travel.") from err
    return {"name": spec["name"], "kwargs": spec["kwargs"]}


def now() -> float:
    """The default clock of a table (seconds, monotonic)."""
    return time.monotonic()
