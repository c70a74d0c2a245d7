"""An INIT's entries into an engine: arrays and table shards, all checked first.

A worker's INIT and its copy replicated to a backup both arrive here (the server's and the
backup's engines hold the same keys the same way); no sockets, no threads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import KeyAlreadyInitializedError, TableSpecError
from ...table import TableSpec
from ..._ps.bounds import check_init
from ._core import Engine
from ._tables import served_table
from .._table_budget import check_table_init
from .._table_rules import check_optimizer

__all__ = ["init_entries"]


def init_entries(engine: Engine, keys: tuple[int, ...], specs: list[dict[str, Any]],
                 arrays: list[np.ndarray], max_key_bytes: int, where: str) -> None:
    """Init every entry of an INIT (a worker's, or its copy replicated to a backup): arrays
    and table shards; all checked first (each placement and whole key by
    ``bounds.check_init``, the one parser of placements; a TableSpec that does not parse,
    a key held already, rows that cannot be reserved), then held: a refused INIT holds
    nothing."""
    places = check_init(specs, arrays, max_key_bytes, where)
    tables: dict[int, Any] = {}
    for k, spec in zip(keys, specs):
        if k in engine:
            raise KeyAlreadyInitializedError(
                f"key {spec.get('key')!r} is initialized twice. Each key takes one init.",
                key=spec.get("key"))
        if spec.get("stype") == "table":
            declared = TableSpec.from_json(spec.get("table"))
            i, n = spec["shard"]
            shard = (int(i), int(n))
            check_table_init(declared, shard[1], spec["key"], max_key_bytes, where)
            try:
                tables[k] = served_table(declared, spec["key"], shard)
                if spec.get("lineage"):    # worker 0's: the backup's INIT has the same (E8)
                    tables[k].lineage = str(spec["lineage"])
            except (MemoryError, ValueError) as err:
                raise TableSpecError(
                    f"table {spec['key']!r}: dim {declared.dim} with reserve_rows "
                    f"{declared.reserve_rows} cannot be allocated here ({err}). Reserve "
                    "fewer rows.", key=spec["key"]) from err
            tables[k].budget = max_key_bytes
    opt = getattr(engine.updater, "optimizer", None)
    for made in tables.values():
        if opt is not None:
            check_optimizer(made.spec, made.name, opt)  # the row optimizer it runs (R12)
    for k, spec, arr, place in zip(keys, specs, arrays, places):
        if k in tables:
            engine.init_table(k, tables[k])
        else:
            engine.init(k, arr, spec.get("stype") == "row_sparse", spec.get("key"),
                        place=place)
