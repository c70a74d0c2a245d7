"""What the table-rule tests share (``test_table_rows.py``, ``test_table_eviction.py``,
``test_table_state.py``; ``test_table_optim.py`` its state check): a fake clock, a table
or a ``local`` store holding table key ``KEY`` that reads it, small builders of IDs and
gradient rows, and the check that two table states are the same."""
from __future__ import annotations

from typing import Any

import numpy as np

import pskv as mx
from pskv.table import DynamicTable, TableSpec

KEY = "emb"
EXTREME = np.array([-2**63, 2**63 - 1, 0, -1, 10**15, -10**15], np.int64)


class Clock:
    """Seconds that move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def table(clock: Clock | None = None, **spec: Any) -> DynamicTable:
    spec.setdefault("dim", 2)
    return DynamicTable(TableSpec(**spec), name=KEY, clock=clock or Clock())


def store(clock: Clock | None = None, **spec: Any) -> Any:
    """A local store with table key KEY; its table reads ``clock``."""
    spec.setdefault("dim", 2)
    kv = mx.kv.create("local")
    kv.init(KEY, TableSpec(**spec))
    kv._tables.tables[KEY] = DynamicTable(TableSpec(**spec), name=KEY, clock=clock or Clock())
    return kv


def sgd() -> Any:
    return mx.optimizer.SGD(learning_rate=1.0)      # w -= g, exactly


def ones(n: int, dim: int = 2, v: float = 1.0) -> np.ndarray:
    return np.full((n, dim), v, np.float32)


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def read(t: DynamicTable, *values: int) -> np.ndarray:
    return t.lookup(ids(*values), train=False)[0]


def assert_same_state(a: tuple[dict[str, np.ndarray], dict[str, Any]],
                      b: tuple[dict[str, np.ndarray], dict[str, Any]]) -> None:
    """Rows, optimizer states, metadata, admission cells, step and counters all equal."""
    assert a[1] == b[1]
    assert sorted(a[0]) == sorted(b[0])
    for name in a[0]:
        np.testing.assert_array_equal(a[0][name], b[0][name], err_msg=name)
