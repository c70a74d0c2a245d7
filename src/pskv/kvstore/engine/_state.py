"""An engine's shard copied out and set back: the checkpoint side of :class:`._core.Engine`.

``copy_entry`` and ``shard_copy`` make the :class:`._snapshot.ShardCopy` a checkpoint
writer or a new backup gets; ``restore`` sets an engine from a checkpoint cut to its
placement (a table shard re-hashed, ``_tables``). Engine's methods of the same names
call these; nothing else does. No sockets, no threads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import CheckpointError, KVStoreError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from . import _tables as tables
from .._snapshot import Reader, ShardCopy
from .._table_rules import table_copy
from ._positions import mark_pairs, marks_of

__all__ = ["copy_entry", "restore", "shard_copy"]


def copy_entry(engine: Any, key: Any, entry: Any) -> tuple[dict[str, Any], Any, Any]:
    """The copy of ``key`` (its ``entry``): its metadata, its value (a table's arrays by
    name), its optimizer state."""
    counts: dict[str, Any] = {"round": entry.round,
                              "applied": [[w, n] for w, n in sorted(entry.applied.items())]}
    if entry.marks:
        counts["marks"] = mark_pairs(entry.marks)
    if entry.table is not None:
        fields, arrays = table_copy(entry.table)
        return {"key": entry.name, "id": key, **fields, **counts}, arrays, None
    data = entry.stored._data
    start, stop, full = entry.place or (0, units(data.shape, entry.sparse), data.shape)
    meta = {"key": entry.name, "id": key, "shape": list(full), "dtype": data.dtype.name,
            "stype": "row_sparse" if entry.sparse else "default", "start": start,
            "stop": stop, **counts}
    states = getattr(engine.updater, "states", None)
    state = _copy_state(states.get(entry.name)) if isinstance(states, dict) else None
    return meta, np.array(data, copy=True), state


def shard_copy(engine: Any, copies: list[tuple[dict[str, Any], Any, Any]]) -> ShardCopy:
    """A shard made of key copies, with the optimizer and the compression settings."""
    upd = engine.updater
    spec = None
    if upd is not None and hasattr(upd, "optimizer"):
        try:
            spec = upd.optimizer.to_spec()
        except KVStoreError:    # an unregistered optimizer: states only
            spec = None
    states = None if upd is None or not hasattr(upd, "get_states") else \
        {m["key"]: st for m, _a, st in copies if st is not None}
    return ShardCopy([m for m, _a, _s in copies], [a for _m, a, _s in copies], states,
                     spec, engine._gc_params, engine.sent_spec if spec is not None else None)


def restore(engine: Any, reader: Reader, counters: bool) -> None:
    """Set every key of ``engine`` from checkpoint ``reader``; all checked, then set."""
    plan = []
    made = {}      # table keys: their shard rebuilt from the saved ones (R13)
    for e in engine._entries.values():
        meta = reader.key_meta(e.name)
        if e.table is not None or meta["stype"] == "table":
            made[e.name] = tables.restore_from(e.table, e.name, meta, reader)
            continue
        data = e.stored._data
        start, stop, full = e.place or (0, units(data.shape, e.sparse), data.shape)
        if tuple(meta["shape"]) != tuple(full) or meta["dtype"] != data.dtype.name \
                or (meta["stype"] == "row_sparse") != e.sparse:
            raise CheckpointError(
                f"key {e.name!r} is {list(full)} {data.dtype.name} here but "
                f"{meta['shape']} {meta['dtype']} ({meta['stype']}) in checkpoint "
                f"{reader.directory!r}. Load a checkpoint of the same model.", key=e.name)
        plan.append((e, start, stop))
    spec = reader.optimizer()
    values = [reader.value(e.name, start, stop, e.stored.shape) for e, start, stop in plan]
    states = {e.name: reader.state(e.name, start, stop, e.stored.shape)
              for e, start, stop in plan}
    if spec is not None:
        from ... import optimizer
        engine.updater = optimizer.get_updater(optimizer.from_spec(spec))
        # a worker's repeat of the spec it sent keeps the restored states (R: restarts)
        engine._opt_spec = reader.optimizer_sent() or spec
    upd = engine.updater
    if spec is None:      # every key of the checkpoint (a local store's tables too)
        _forget(upd, list(reader.parts))
    for e in engine._entries.values():
        if e.table is not None:
            e.table = made[e.name]
            assert isinstance(e.table, tables.ServedTable)
            if counters:
                e.round = reader.round(e.name)
                e.applied = reader.applied(e.name, e.table.shard[0])
                e.marks = marks_of(reader.meta(e.name, e.table.shard[0]).get("marks"))
    for (e, _start, _stop), value in zip(plan, values, strict=True):
        np.copyto(e.stored._data, value)
        if counters:
            e.round = reader.round(e.name)
            e.applied = reader.applied(e.name)
            e.marks = marks_of(reader.meta(e.name).get("marks"))
        st = states[e.name]
        if st is not None and isinstance(getattr(upd, "states", None), dict):
            upd.states[e.name] = st
            upd.states_synced[e.name] = False


def _forget(upd: Any, names: list[Any]) -> None:
    """A checkpoint taken without an optimizer holds no optimizer state and no update
    count: the store's own optimizer (if it has one) keeps none for the keys ``names``
    either, since they were made on the values the load replaces. Its next update of a
    key starts afresh, as after ``set_optimizer`` and a load with no push between."""
    states = getattr(upd, "states", None)
    if isinstance(states, dict):
        for name in names:
            states.pop(name, None)
            upd.states_synced.pop(name, None)
    opt: Any = getattr(upd, "optimizer", None)
    counts = getattr(opt, "_all_index_update_counts", None)
    if isinstance(counts, dict):
        for per_device in counts.values():
            for name in names:
                per_device.pop(name, None)
        opt.num_update = max([opt.begin_num_update] +
                             [n for per_device in counts.values() for n in per_device.values()])


def units(shape: tuple[int, ...], sparse: bool) -> int:
    """Elements of a dense key, rows of a row_sparse one."""
    return (shape[0] if shape else 0) if sparse else int(np.prod(shape, dtype=np.int64))


def _copy_state(state: Any) -> Any:
    """A deep copy of an optimizer state (NDArrays, tuples or lists of them, scalars)."""
    if isinstance(state, RowSparseNDArray):
        return RowSparseNDArray(np.array(state._data), np.array(state._indices), state.shape)
    if isinstance(state, NDArray):
        return NDArray(np.array(state._data, copy=True), state.context)
    if isinstance(state, (tuple, list)):
        items = [_copy_state(s) for s in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state
