"""What a table shard may cost its server: checked before a table INIT allocates and before
a lookup or push inserts rows (docs/security.md, docs/embeddings.md).

A table key is one key of its server: its shard's arrays (the rows' values and optimizer
states, each row's ID and metadata, the ID index, the admission counters) count against
``max_key_bytes`` (``PSKV_MAX_KEY_BYTES``), the per-key budget of every other key. A spec
whose ``dim``, ``reserve_rows`` or ``CountAdmission.counters`` would cost more is refused
at INIT; a request whose new IDs would grow the shard past it is refused before any row is
inserted. Sizes are Python integers from the spec and the request's length (one
``np.unique`` of the unknown IDs when the cheap bound does not settle it), never an
allocation. Refusals are :class:`LimitError` naming the variable, and counted in the
shard's ``stats()`` (``budget_refusals``). Invariant: the checks change nothing else.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import LimitError
from ..table import CountAdmission, TableSpec
from .._ps.config import ENV_MAX_KEY_BYTES

__all__ = ["ROW_OVERHEAD", "check_growth", "check_table_init", "row_bytes"]

#: bytes a row costs besides its values and states: its ID, count, last step and last
#: seconds (8 each), its live flag, and up to four 16-byte cells of the ID index
ROW_OVERHEAD = 4 * 8 + 1 + 4 * 16
#: rows a table allocates however few it reserves (DynamicTable)
_MIN_ROWS = 64


def row_bytes(spec: TableSpec, state_width: int = 0) -> int:
    """Bytes one row of ``spec`` costs with ``state_width`` optimizer state values: its
    values in the storage dtype, its states in ``state_dtype`` (R17)."""
    return int(spec.dim) * spec.storage.itemsize + \
        state_width * np.dtype(spec.state_dtype).itemsize + ROW_OVERHEAD


def _counters_bytes(spec: TableSpec) -> int:
    adm = spec.admission
    return int(adm.counters) * 4 if isinstance(adm, CountAdmission) else 0


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _over(what: str, got: int, budget: int, where: str, key: Any) -> LimitError:
    return LimitError(f"{what} would cost {_size(got)}, over the per-key budget of "
                      f"{_size(budget)} on {where} ({ENV_MAX_KEY_BYTES}={budget}). Declare a "
                      f"smaller table (dim, reserve_rows, eviction=Capacity(...), admission "
                      f"counters), or raise {ENV_MAX_KEY_BYTES} on every node if this is "
                      "meant.", key=key)


def check_table_init(spec: TableSpec, servers: int, key: Any, budget: int,
                     where: str) -> None:
    """LimitError if an empty shard of ``spec`` (one of ``servers``) costs more than
    ``budget`` bytes: its reserved rows (its share of ``reserve_rows``, 64 at least) and
    its admission counters."""
    rows = max(-(-int(spec.reserve_rows) // max(servers, 1)), _MIN_ROWS)
    got = rows * row_bytes(spec) + _counters_bytes(spec)
    if got > budget:
        raise _over(f"table {key!r} (dim {spec.dim}, {rows} reserved rows of "
                    f"{_size(row_bytes(spec))}, {_counters_bytes(spec) // 4} admission "
                    "counters)", got, budget, where, key)


def check_growth(table: Any, ids: np.ndarray, what: str, where: str) -> None:
    """LimitError if inserting the unknown ``ids`` (int64, checked) could grow ``table``
    (a ServedTable with a ``budget``) past it, counting the capacity step its next growth
    takes (x1.5). A cheap bound first (every ID new); the exact count of unknown unique
    IDs only when that bound is over."""
    budget = table.budget
    if budget is None or not ids.size:
        return
    width = sum(int(s.shape[1]) for s in table._states)
    per = row_bytes(table.spec, width) + (8 if table._t is not None else 0)
    fixed = _counters_bytes(table.spec)
    top, cap = int(table._top), int(table.capacity_rows)

    def cost(new: int) -> int:
        need = top + max(0, new - int(table._free.size))
        return (max(need, cap * 3 // 2) if need > cap else cap) * per + fixed

    if cost(int(ids.size)) <= budget:
        return
    new = int(np.unique(ids[table._index.find(ids) < 0]).size)
    got = cost(new)
    if got > budget:
        table.budget_refusals += 1
        raise _over(f"{what} of table {table.name!r} with {new} new IDs ({len(table)} rows "
                    f"held, {cap} allocated, {_size(per)} a row)", got, budget, where,
                    table.name)
