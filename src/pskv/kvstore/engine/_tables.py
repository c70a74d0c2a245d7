"""Table keys in an engine: one server's hash shard of a dynamic table (docs/embeddings.md).

A server's :class:`._core.Engine` holds a table key as an entry whose value is a
:class:`ServedTable` (the rows whose IDs ``shard_of`` routes to this server, R13) instead of
an array. The engine's round machinery is unchanged: a table push (kind ``t``: IDs and
gradient rows) joins a sync round like any key, the round's parts are concatenated and the
table's duplicate rule (R7) sums them in one push of the row optimizer (one step, R11),
then a bounded sweep (R10) runs. This module is those steps, what a lookup reads, a
shard's copy for checkpoints, and the changed rows a backup gets; no sockets, no threads.

Invariant: every check runs before any change (a bad push or lookup changes nothing).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ...errors import ShapeMismatchError, UnsupportedError
from ...table._checks import check_grads, check_ids
from ...table import DynamicTable, TableSpec, shard_of
from ...table.spec import now
from .._table_budget import check_growth
from .._table_rules import check_restorable, merge_states, restore_local

__all__ = ["ServedTable", "TableRound", "apply_round", "check_table_push", "lookup_arrays",
           "put_rows", "restore_from", "restore_table", "served_table"]

class ServedTable(DynamicTable):
    """A DynamicTable serving shard ``shard = (i, n)`` of a table key; it can note the IDs
    its sweeps evict and the rows it inserts (``recording``), for the shard's backup."""

    shard: tuple[int, int] = (0, 1)
    recording = False
    #: the spec the workers declared (``spec`` is this shard's: its Capacity divided)
    full_spec: TableSpec | None = None
    #: the most bytes this shard may hold (``_table_budget``); None: unchecked
    budget: int | None = None
    #: requests refused for the budget (stats ``budget_refusals``, a metric)
    budget_refusals = 0

    def __init__(self, spec: TableSpec, name: Any = "table",
                 clock: Callable[[], float] = now) -> None:
        super().__init__(spec, name=name, clock=clock)
        self.evicted: list[np.ndarray] = []
        self.evicted_why: list[np.ndarray] = []
        self.born: list[np.ndarray] = []

    def stats(self) -> dict[str, int]:
        """DynamicTable's counters, ``budget_refusals`` and the stream's ``version``."""
        return {**super().stats(), "budget_refusals": self.budget_refusals,
                "version": self.version}

    def _evict(self, slots: np.ndarray) -> None:
        if self.recording:
            self.evicted.append(self._ids[slots].copy())
            self.evicted_why.append(np.full(slots.size, self._why, np.uint8))
        super()._evict(slots)

    def _insert(self, ids: np.ndarray, values: np.ndarray | None = None,
                stored: np.ndarray | None = None) -> np.ndarray:
        if self.recording:
            self.born.append(ids.copy())
        return super()._insert(ids, values, stored)


def served_table(spec: TableSpec, name: Any, shard: tuple[int, int],
                 clock: Callable[[], float] = now) -> ServedTable:
    """An empty shard ``(i, n)`` of table ``spec``: a ``Capacity(max_rows)`` bounds the whole
    table, so each of the ``n`` servers keeps at most ``ceil(max_rows / n)`` rows (IDs
    spread evenly over servers, R13), and reserves ``ceil(reserve_rows / n)``; everything
    else as declared."""
    cap, n = spec.capacity, shard[1]
    mine = spec
    if n > 1:
        mine = dataclasses.replace(spec, reserve_rows=-(-spec.reserve_rows // n))
    if cap is not None and n > 1:
        mine = dataclasses.replace(mine, eviction=tuple(
            dataclasses.replace(e, max_rows=-(-cap.max_rows // n)) if e is cap else e
            for e in spec.eviction))
    table = ServedTable(mine, name=name, clock=clock)
    table.shard, table.full_spec = shard, spec
    return table


class TableRound:
    """One applied round of a table shard as its backup applies it: the rows it changed
    (whole: value, optimizer state, metadata) and the IDs its sweep evicted.

    Why rows and not the round's (ids, grads): a training lookup inserts rows too
    (``birth='pull'``) and is not a round; replaying the gradients on a backup that never
    saw those lookups would drop them (R8). The changed rows make the backup's rows equal
    to the primary's after every round, at the cost of sending values instead of
    gradients (the same size, plus the optimizer state).
    """

    __slots__ = ("arrays", "meta")

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.arrays, self.meta = arrays, meta


def check_table_push(table: ServedTable, kind: str, arrays: list[np.ndarray]) -> None:
    """Raise unless ``arrays`` are one table push (kind ``t``: 1-d integer IDs this shard
    owns, one gradient row of the table's dim per ID); change nothing."""
    name = table.name
    if kind not in ("t", "T") or len(arrays) != 2:
        raise UnsupportedError(
            f"push to table key {name!r} must carry (ids, grads), got a push of kind "
            f"{kind!r}. Push kv.push(key, (ids, grads)).", key=name)
    ids, grads = arrays
    if ids.ndim != 1:
        raise ShapeMismatchError(f"push to table key {name!r}: IDs of shape {ids.shape}; a "
                                 "push carries a 1-d array of IDs.", key=name, shape=ids.shape)
    ids = check_ids(table.name, ids, "push")
    check_grads(table.spec, table.name, ids, grads, "push")
    _check_owned(table, ids, "push")
    if table.spec.birth == "push":
        check_growth(table, ids, "a push", f"server {table.shard[0]}")


def _check_owned(table: ServedTable, ids: np.ndarray, what: str) -> None:
    i, n = table.shard
    if n == 1 or not ids.size:
        return
    known = table._known_slots(ids)
    if known is not None:       # IDs a lookup found a row of are this shard's: not hashed
        ids = ids[known < 0]
    if ids.size and bool(np.any(shard_of(ids, n) != i)):
        raise ShapeMismatchError(
            f"{what} of table key {table.name!r} sent server {i} of {n} IDs that "
            "shard_of routes elsewhere (R13). Route each ID to server "
            "pskv.table.shard_of(ids, num_servers).", key=table.name)


def check_lookup(table: ServedTable, ids: np.ndarray, train: bool = False) -> np.ndarray:
    """The IDs of a lookup message as int64 (1-d, owned here), or raise (a training
    lookup of a ``birth='pull'`` table: also if its new rows would pass the budget)."""
    if ids.ndim != 1:
        raise ShapeMismatchError(f"lookup of table key {table.name!r}: IDs of shape "
                                 f"{ids.shape}; a lookup message carries a 1-d array.",
                                 key=table.name, shape=ids.shape)
    got = check_ids(table.name, ids, "lookup")
    _check_owned(table, got, "lookup")
    if train and table.spec.birth == "pull":
        check_growth(table, got, "a training lookup", f"server {table.shard[0]}")
    return got


def lookup_arrays(table: ServedTable, ids: np.ndarray, train: bool,
                  record: bool) -> tuple[list[np.ndarray], TableRound | None]:
    """``[values, found]`` of a (checked) lookup and, with ``record``, the rows it gave
    birth to (``birth='pull'``) for the backup: their IDs only, since a born row's value
    is its initial value, a function of (seed, ID) (R2)."""
    table.recording, table.born = record and train, []
    try:
        values, found = table.lookup(ids, train=train)
    finally:
        table.recording = False
    born = None
    if table.born:
        born = TableRound({"born": np.concatenate(table.born)}, table.meta())
        table.born = []
    return [values, found], born


def apply_round(table: ServedTable, parts: list[tuple[np.ndarray, np.ndarray]],
                optimizer: Any, key: Any, record: bool,
                again: list[np.ndarray] | None = None) -> TableRound | None:
    """Apply a round's pushes (its parts concatenated: duplicates combine by R7) as one
    step of the row optimizer, then a bounded sweep; with ``record`` the changed rows.

    ``again``: the IDs of pushes a worker sent again after this shard was reloaded; the
    rows among them it lacks are re-created first, from their initial values (D9)."""
    table.recording, table.evicted, table.born, table.evicted_why = record, [], [], []
    if again:
        table.restore_rows(np.concatenate(again))
    table.recording = False
    if len(parts) == 1:
        ids, grads = parts[0]
    else:
        ids = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
        grads = np.concatenate([p[1] for p in parts]) if parts else \
            np.empty((0, table.spec.dim), table.spec.state_dtype)
    table.recording = record
    try:
        table.push(ids, grads, optimizer=optimizer, key=key)
        table.sweep(table.spec.sweep_rows)
    finally:
        table.recording = False
    table.born = []
    if not record:
        return None
    evicted = np.concatenate(table.evicted) if table.evicted else np.empty(0, np.int64)
    why = np.concatenate(table.evicted_why) if table.evicted_why else np.empty(0, np.uint8)
    table.evicted, table.evicted_why = [], []
    return TableRound(*table.changes(ids, evicted, why))


def put_rows(table: ServedTable, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """A backup's copy: apply a :class:`TableRound` (``DynamicTable.apply_changes``)."""
    table.apply_changes(arrays, meta)


def restore_table(like: ServedTable,
                  parts: list[tuple[int, dict[str, np.ndarray], dict[str, Any]]]) -> ServedTable:
    """A new shard like ``like`` (its spec, name, shard, clock) holding the rows of the
    saved shards ``parts`` (any number of them) that R13 routes to it."""
    arrays, meta = merge_states(parts, like.shard)
    table = ServedTable.from_state(like.spec, arrays, meta, name=like.name, clock=like._clock,
                                   shard=like.shard)
    assert isinstance(table, ServedTable)
    table.shard, table.full_spec = like.shard, like.full_spec
    return table


def restore_from(table: DynamicTable | None, name: Any, meta: dict[str, Any],
                 reader: Any) -> DynamicTable:
    """This shard of table ``name`` from checkpoint ``reader`` (whose entry is ``meta``),
    re-hashed from however many servers saved it; CheckpointError if the key is not a
    table of the same dim and dtype on both sides. Changes nothing."""
    table = check_restorable(table, name, meta, reader)
    if isinstance(table, ServedTable):
        return restore_table(table, reader.table_parts(name))
    return restore_local(table, name, meta, reader)



