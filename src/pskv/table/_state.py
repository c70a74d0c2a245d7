"""A table's whole state as plain NumPy arrays plus JSON-able metadata, and back (R16).

Arrays: ``ids``, ``values``, ``state0``, ``state1``... (the optimizer's), ``adam_t``,
``count``, ``last_step``, ``age_seconds`` (seconds since last use, so a restore on another
clock keeps the ages), ``sightings`` (CountAdmission's cells). Metadata: the format tag,
the spec as JSON, the step, the counters and the row optimizer's layout. Nothing is pickled.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from ..errors import CheckpointError
from ._hash import shard_of
from .spec import TableSpec, now

__all__ = ["FORMAT", "restore", "snapshot"]

FORMAT = "pskv.table"
VERSION = 1


def snapshot(table: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Copies of every live row of ``table`` (sorted by ID) and its metadata."""
    live = np.flatnonzero(table._live[:table._top])
    live = live[np.argsort(table._ids[live], kind="stable")]
    arrays = {"ids": table._ids[live], "values": table._values[live],
              "count": table._count[live], "last_step": table._last_step[live],
              "age_seconds": table._clock() - table._last_seconds[live],
              "born_step": table._born_step[live], "born_how": table._born_how[live]}
    for i, s in enumerate(table._states):
        arrays[f"state{i}"] = s[live]
    if table._t is not None:
        arrays["adam_t"] = table._t[live]
    if table._sightings is not None:
        arrays["sightings"] = table._sightings.copy()
    rowopt = table._rowopt
    meta = {"format": FORMAT, "version": VERSION, "name": table.name,
            "spec": _spec_json(table.spec), "step": table.step, "counters": dict(table.counters),
            "rowopt": None if rowopt is None else
            {"kind": rowopt.kind, "widths": list(rowopt.widths),
             "per_row_step": rowopt.per_row_step}}
    return arrays, meta


def _spec_json(spec: TableSpec) -> dict[str, Any]:
    """The spec as JSON; a custom eviction score cannot travel, so it is written as
    ``policy: 'custom'`` (``from_state`` takes the spec from its caller)."""
    cap = spec.capacity
    if cap is None or cap.score is None:
        return spec.to_json()
    out = replace(spec, eviction=tuple(e for e in spec.eviction if e is not cap)).to_json()
    out["eviction"].append({"type": "capacity", "max_rows": int(cap.max_rows),
                            "policy": "custom"})
    return out


def _bad(name: Any, why: str) -> CheckpointError:
    return CheckpointError(f"cannot restore table {name!r}: {why}. Restore what "
                           "DynamicTable.state() wrote, with the same spec.", key=name)


def restore(cls: Any, spec: TableSpec, arrays: dict[str, np.ndarray],
            meta: dict[str, Any], name: Any, clock: Callable[[], float] = now,
            shard: tuple[int, int] | None = None) -> Any:
    """A new table (of ``cls``, a DynamicTable) holding the rows of a :func:`snapshot` (those of ``shard`` only)."""
    from ._rowopt import RowOptimizer
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or meta.get("version") != VERSION:
        raise _bad(name, "the metadata is not a pskv.table state")
    saved = meta.get("spec")
    dim = saved.get("dim") if isinstance(saved, dict) else None
    if dim != spec.dim:
        raise _bad(name, f"it was saved with dim {dim!r}, not {spec.dim}")
    ids = np.asarray(arrays.get("ids"))
    n = ids.shape[0] if ids.ndim == 1 else -1
    need = {"ids": (n,), "values": (n, spec.dim), "count": (n,), "last_step": (n,),
            "age_seconds": (n,)}
    for key, shape in need.items():
        a = arrays.get(key)
        if n < 0 or a is None or np.asarray(a).shape != shape:
            raise _bad(name, f"array {key!r} is missing or not of shape {shape}")
    if ids.dtype.kind not in "iu" or np.unique(ids).size != n:
        raise _bad(name, "its IDs are not unique integers")
    vdt = np.asarray(arrays["values"]).dtype
    if vdt != spec.storage and vdt.kind != "f":     # R17: the storage dtype's bits, or floats
        raise _bad(name, f"its values are {vdt}, not {spec.dtype} rows")
    keep = np.arange(n) if shard is None else np.flatnonzero(shard_of(ids, shard[1]) == shard[0])
    table = cls(spec, name=name, clock=clock)
    table.step = int(meta.get("step", 0))
    for k in table.counters:
        table.counters[k] = int(meta.get("counters", {}).get(k, 0))
    ro = meta.get("rowopt")
    if ro is not None:
        rowopt = RowOptimizer(str(ro["kind"]), tuple(int(w) for w in ro["widths"]),
                              bool(ro["per_row_step"]))
        table._rowopt = rowopt
        cap = table.capacity_rows
        table._states = [np.zeros((cap, w), spec.state_dtype) for w in rowopt.widths]
        table._t = np.zeros(cap, np.int64) if rowopt.per_row_step else None
        for i, w in enumerate(rowopt.widths):
            if np.asarray(arrays.get(f"state{i}", np.empty(0))).shape != (n, w):
                raise _bad(name, f"optimizer state {i} is missing or not of shape {(n, w)}")
    k = keep.size
    if k:
        table._how = 5          # BIRTHS: "checkpoint" unless the state says how
        slots = table._insert(ids[keep].astype(np.int64),
                              stored=table._from_saved(np.asarray(arrays["values"])[keep]))
        table.counters["inserts"] = int(meta.get("counters", {}).get("inserts", 0))
        table._count[slots] = np.asarray(arrays["count"])[keep]
        table._last_step[slots] = np.asarray(arrays["last_step"])[keep]
        table._last_seconds[slots] = clock() - np.asarray(arrays["age_seconds"])[keep]
        for i, s in enumerate(table._states):
            s[slots] = np.asarray(arrays[f"state{i}"])[keep]
        born_step, born_how = arrays.get("born_step"), arrays.get("born_how")
        if born_step is not None and np.shape(born_step) == (n,) and \
                np.shape(born_how) == (n,):
            table._born_step[slots] = np.asarray(born_step)[keep]
            table._born_how[slots] = np.minimum(np.asarray(born_how)[keep], 5)
        if table._t is not None and "adam_t" in arrays:
            table._t[slots] = np.asarray(arrays["adam_t"])[keep]
    table._dirty, table._how = False, 0   # a restore starts a lineage (E1): version 0
    table._forget_marks()
    sightings = arrays.get("sightings")
    if table._sightings is not None and sightings is not None \
            and np.asarray(sightings).shape == table._sightings.shape:
        table._sightings[:] = sightings
    return table
