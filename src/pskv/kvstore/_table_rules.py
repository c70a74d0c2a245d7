"""What every holder of a table key shares: a shard's checkpoint entry (:func:`table_copy`),
one state from saved shards (:func:`merge_states`), the checks before a restore
(:func:`check_restorable`, :func:`restore_local` for a local store's whole table) and
which optimizers can update a table's rows (:func:`check_optimizer`). Below the engine: a
local store, a dist worker and a server's engine all use it; no sockets, no threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..table import DynamicTable, TableSpec

__all__ = ["TableKey", "check_optimizer", "check_restorable", "merge_states", "restore_local", "table_copy"]


@dataclass(frozen=True, slots=True)
class TableKey:
    """What a dist worker holds of a table key: its spec and name, no row (the rows live
    on the servers); its calls are checked with ``pskv.table._checks``."""

    spec: TableSpec
    name: Any


def table_copy(table: DynamicTable) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The checkpoint entry fields and arrays of one table shard (rows stored by ID)."""
    arrays, meta = table.state()
    spec = getattr(table, "full_spec", None) or table.spec
    return {"stype": "table", "shape": [spec.dim], "dtype": spec.dtype, "start": 0,
            "stop": 0, "shard": list(getattr(table, "shard", (0, 1))), "spec": spec.to_json(),
            "table": meta}, arrays


def merge_states(parts: list[tuple[int, dict[str, np.ndarray], dict[str, Any]]],
                 shard: tuple[int, int]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One state from the saved shards ``(saved index, arrays, meta)`` of a table: their
    rows concatenated (``from_state(shard=)`` keeps this server's), the admission cells
    summed, the step the newest, and the counters of the saved shards ``j`` with
    ``j % n == i``, so the counters summed over the new servers equal the saved ones."""
    if not parts:
        raise CheckpointError("a table with no saved shard cannot be restored")
    arrays: dict[str, np.ndarray] = {}
    names = [k for k in parts[0][1] if k != "sightings"]
    for k in names:
        if not all(k in p[1] for p in parts):
            raise CheckpointError(f"the saved shards of table {parts[0][2].get('name')!r} "
                                  f"differ: array {k!r} is missing from some.")
        arrays[k] = np.concatenate([np.asarray(p[1][k]) for p in parts])
    cells = [np.asarray(p[1]["sightings"]) for p in parts if "sightings" in p[1]]
    if cells and all(c.shape == cells[0].shape for c in cells):
        arrays["sightings"] = np.minimum(np.sum(cells, axis=0, dtype=np.int64),
                                         2**31 - 2).astype(np.int32)
    i, n = shard
    meta = dict(parts[0][2])
    meta["step"] = max(int(p[2].get("step", 0)) for p in parts)
    meta["rowopt"] = next((p[2]["rowopt"] for p in parts if p[2].get("rowopt")), None)
    counters: dict[str, int] = {}
    for j, _a, m in parts:
        if j % n == i:
            for k, v in (m.get("counters") or {}).items():
                counters[k] = counters.get(k, 0) + int(v)
    meta["counters"] = counters
    return arrays, meta


def check_optimizer(spec: TableSpec, name: Any, opt: Any) -> None:
    """UnsupportedError (naming table ``name``) if the store's optimizer ``opt`` cannot
    update the rows of a table of ``spec`` (R12); a spec with its own optimizer
    (``TableSpec.optimizer``) never runs the store's. Reads the spec only: a dist worker,
    which holds no row, runs it as a server's engine does."""
    from ..table._rowopt import row_optimizer
    if spec.optimizer is not None:
        return
    row_optimizer(opt, spec.state_layout, spec.dim, name)  # wd too


def check_restorable(table: DynamicTable | None, name: Any, meta: dict[str, Any],
                     reader: Any) -> DynamicTable:
    """``table``, if checkpoint ``reader``'s entry ``meta`` for key ``name`` is a table of the
    same dim and dtype; CheckpointError if not (either side an array, or another shape)."""
    if table is None or meta.get("stype") != "table":
        here, there = ("a table", "an array") if table is not None else ("an array", "a table")
        raise CheckpointError(
            f"key {name!r} is {here} key here but {there} key in checkpoint "
            f"{reader.directory!r}. Load a checkpoint of the same model.", key=name)
    saved = TableSpec.from_json(meta.get("spec"))
    if (saved.dim, saved.dtype) != (table.spec.dim, table.spec.dtype):
        raise CheckpointError(
            f"table key {name!r} has dim {table.spec.dim} {table.spec.dtype} here but dim "
            f"{saved.dim} {saved.dtype} in checkpoint {reader.directory!r}. Load a checkpoint "
            "of the same model.", key=name)
    return table


def restore_local(table: DynamicTable | None, name: Any, meta: dict[str, Any],
                  reader: Any) -> DynamicTable:
    """A local store's table ``name`` from checkpoint ``reader`` (whose entry is ``meta``),
    re-hashed from however many servers saved it. Changes nothing."""
    table = check_restorable(table, name, meta, reader)
    arrays, state = merge_states(reader.table_parts(name), (0, 1))
    return DynamicTable.from_state(table.spec, arrays, state, name=name, clock=table._clock)
