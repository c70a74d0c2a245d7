"""Property tests of a table's index and eviction (R3-R11, R14, R16 of docs/embeddings.md).

``IdIndex`` against a dict under random inserts, deletes and finds; and a Hypothesis state
machine of :class:`DynamicTable` (lookups, pushes, assigns, sweeps, clock moves, restores,
bad calls) against a dict-of-NumPy model. The model predicts every row value, counter and
TTL expiry exactly; where eviction may choose among equals it checks the table's choice
(LRU/LFU: no victim scores above a survivor) and follows it. Gradients are small integers,
so every update is exact in float32.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pskv as mx
from pskv.errors import TableIdError
from pskv.table import (TTL, Always, Capacity, CountAdmission, DynamicTable, TableSpec, Uniform,
                        initial_values)
from pskv.table import dynamic
from pskv.table import _index as index_module
from pskv.table._index import IdIndex

POOL = [0, 1, 2, 3, 5, 8, -1, -7, 10**15, -2**63, 2**63 - 1, 2**40 + 1]
DIM = 2

any_ids = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-50, 50))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 200), st.integers(1, 60), st.integers(1, 8), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_sum_runs_is_reduceat_bit_for_bit(n: int, distinct: int, block: int, f64: bool,
                                         seed: int) -> None:
    """The sum of a push's duplicate rows (R7), runs of one row copied and longer runs
    summed in blocks, equals one np.add.reduceat of the rows cast to the table's dtype
    exactly, wherever the blocks cut (1 to 8 rows here; runs longer than a block too)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, distinct, n)
    g = rng.standard_normal((n, 3)).astype(np.float64 if f64 else np.float32)
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    old = dynamic._RUN_BLOCK_ROWS
    dynamic._RUN_BLOCK_ROWS = block
    try:
        got = dynamic._sum_runs(g, order, starts, np.float32)
    finally:
        dynamic._RUN_BLOCK_ROWS = old
    want = np.add.reduceat(g[order].astype(np.float32), starts, axis=0)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "delete", "find"]),
                          st.lists(any_ids, max_size=40)), max_size=25))
def test_the_index_is_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    _index_is_a_dict(ops)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "delete", "find"]),
                          st.lists(st.integers(-300, 300), max_size=60)), max_size=25),
       st.integers(1, 3))
def test_the_index_is_a_dict_with_short_probe_windows(ops: list[tuple[str, list[int]]],
                                                      window: int) -> None:
    """A find probes a window of cells per round after the home cell: with windows of 1
    to 3 cells, runs of occupied and deleted cells span many windows."""
    old = index_module._WINDOW
    index_module._WINDOW = window
    try:
        _index_is_a_dict(ops)
    finally:
        index_module._WINDOW = old


def _index_is_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    index, model = IdIndex(), {}
    next_slot = 0
    for op, values in ops:
        batch = np.unique(np.array(values, np.int64))
        if op == "insert":
            new = np.array([i for i in batch.tolist() if i not in model], np.int64)
            slots = np.arange(next_slot, next_slot + new.size, dtype=np.int64)
            next_slot += new.size
            index.insert(new, slots)
            model.update(zip(new.tolist(), slots.tolist()))
        elif op == "delete":                # some absent IDs, and as many present ones
            batch = np.unique(np.concatenate([batch, np.array(list(model)[:len(values)],
                                                              np.int64)]))
            found = index.delete(batch)
            assert found.tolist() == [model.pop(i, -1) for i in batch.tolist()]
        query = np.array(values + list(model)[:20], np.int64)
        assert index.find(query).tolist() == [model.get(i, -1) for i in query.tolist()]
        assert index.size == len(model)
        assert 2 * (index.size + index.deleted) <= index.cells
        keys, slots = index.items()
        assert dict(zip(keys.tolist(), slots.tolist())) == model


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ttl_or_none(steps: int | None, seconds: float | None) -> TTL | None:
    return None if steps is None and seconds is None else TTL(steps, seconds)


def _spec(cap: Capacity | None, ttl: TTL | None, admission: Any, birth: str,
          duplicates: str, unknown: str) -> TableSpec:
    return TableSpec(dim=DIM, init=Uniform(-4, 4), seed=3, admission=admission, birth=birth,
                     duplicates=duplicates, unknown=unknown,
                     eviction=tuple(e for e in (cap, ttl) if e is not None))


specs = st.builds(
    _spec, st.one_of(st.none(), st.builds(Capacity, st.integers(1, 6),
                                          st.sampled_from(["lru", "lfu"]))),
    st.builds(_ttl_or_none, st.one_of(st.none(), st.integers(1, 4)),
              st.sampled_from([None, 1.0, 2.5])),
    st.sampled_from([Always(), CountAdmission(2), CountAdmission(3)]),
    st.sampled_from(["pull", "push"]), st.sampled_from(["sum", "mean"]),
    st.sampled_from(["init", "zeros"]))
id_lists = st.lists(st.sampled_from(POOL), min_size=0, max_size=6)


class TableMachine(RuleBasedStateMachine):
    """DynamicTable against a model: ``rows[id] = [value, count, last_step, last_seconds]``."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.rows: dict[int, list[Any]] = {}
        self.sightings: dict[int, int] = {}
        self.step = 0
        self.counters = dict.fromkeys(("lookups", "misses", "inserts", "refusals",
                                       "evicted_ttl", "evicted_capacity", "dropped_pushes",
                                       "pushed_rows", "evicted_score", "unknown_reads"), 0)

    @initialize(spec=specs)
    def make(self, spec: TableSpec) -> None:
        self.spec = spec
        self.table = DynamicTable(spec, name="t", clock=self.clock)

    # ---- the model's pieces ------------------------------------------------------------
    def _init(self, i: int) -> np.ndarray:
        return initial_values(self.spec, np.array([i], np.int64))[0]

    def _unknown(self, i: int) -> np.ndarray:
        return self._init(i) if self.spec.unknown == "init" else np.zeros(DIM, np.float32)

    def _touch(self, i: int) -> None:
        row = self.rows[i]
        row[1] += 1
        row[2], row[3] = self.step, self.clock.now

    def _admitted(self, unknown: list[int]) -> set[int]:
        """Sightings of ``unknown`` (unique); the table's choice is checked afterwards."""
        adm = self.spec.admission
        if isinstance(adm, CountAdmission):
            for i in unknown:
                self.sightings[i] = self.sightings.get(i, 0) + 1
        return set(unknown)

    def _check_births(self, asked: list[int], born: set[int]) -> None:
        adm = self.spec.admission
        assert born <= set(asked)
        for i in asked:
            must = not isinstance(adm, CountAdmission) or \
                self.sightings[i] >= adm.min_count
            assert i in born or not must, f"{i} admitted late"
        self.counters["refusals"] += len(asked) - len(born)
        self.counters["inserts"] += len(born)
        for i in born:
            self.rows[i] = [self._init(i), 0, self.step, self.clock.now]

    def _combine(self, ids: list[int], grads: np.ndarray) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for i in sorted(set(ids)):
            picked = grads[[k for k, j in enumerate(ids) if j == i]]
            total = picked.sum(axis=0, dtype=np.float32)
            if self.spec.duplicates == "mean":
                total = total / np.float32(len(picked))
            out[i] = total.astype(np.float32)
        return out

    # ---- rules -------------------------------------------------------------------------
    @rule(ids=id_lists, train=st.booleans())
    def lookup(self, ids: list[int], train: bool) -> None:
        values, found = self.table.lookup(np.array(ids, np.int64), train=train)
        self.counters["lookups"] += len(ids)
        self.counters["misses"] += sum(i not in self.rows for i in ids)
        born = {i for i, f in zip(ids, found.tolist()) if f and i not in self.rows}
        if train and self.spec.birth == "pull":
            asked = sorted({i for i in ids if i not in self.rows})
            self._admitted(asked)
            self._check_births(asked, born)
        else:
            assert not born
        self.counters["unknown_reads"] += sum(not f for f in found.tolist())
        for i, v, f in zip(ids, values, found.tolist()):
            assert f == (i in self.rows)
            np.testing.assert_array_equal(v, self.rows[i][0] if f else self._unknown(i))
        if train:
            for i in set(ids) & set(self.rows):
                self._touch(i)

    @rule(ids=id_lists, data=st.data(), optimizer=st.booleans())
    def push(self, ids: list[int], data: Any, optimizer: bool) -> None:
        grads = np.array(data.draw(st.lists(st.lists(st.integers(-3, 3), min_size=DIM,
                                                     max_size=DIM),
                                            min_size=len(ids), max_size=len(ids))),
                         np.float32).reshape(len(ids), DIM)
        before = set(self.table.ids().tolist())
        opt = mx.optimizer.SGD(learning_rate=1.0) if optimizer else None
        self.table.push(np.array(ids, np.int64), grads, optimizer=opt)
        combined = self._combine(ids, grads)
        absent = [i for i in combined if i not in self.rows]
        if opt is None:                                   # assign: every ID gets its row
            for i in absent:
                self.rows[i] = [None, 0, self.step, self.clock.now]
            self.counters["inserts"] += len(absent)
        else:
            if self.spec.birth == "push":
                self._admitted(absent)
                born = set(self.table.ids().tolist()) - before
                self._check_births(absent, born)
            dropped = [i for i in absent if i not in self.rows]
            self.counters["dropped_pushes"] += len(dropped)
            for i in dropped:
                del combined[i]
        for i, g in combined.items():
            row = self.rows[i]
            row[0] = g.copy() if opt is None else (row[0] - g).astype(np.float32)
            self._touch(i)
        self.counters["pushed_rows"] += len(combined)
        self.step += 1

    @rule(ids=id_lists, data=st.data())
    def assign(self, ids: list[int], data: Any) -> None:
        values = np.array(data.draw(st.lists(st.integers(-9, 9), min_size=len(ids) * DIM,
                                             max_size=len(ids) * DIM)),
                          np.float32).reshape(len(ids), DIM)
        self.table.assign(np.array(ids, np.int64), values)
        for i, v in zip(ids, values):                     # the last value of an ID wins
            if i not in self.rows:
                self.rows[i] = [None, 0, self.step, self.clock.now]
                self.counters["inserts"] += 1
            self.rows[i][0] = v.copy()

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule(max_rows=st.one_of(st.none(), st.integers(1, 6)))
    def sweep(self, max_rows: int | None) -> None:
        ttl, cap = self.spec.ttl, self.spec.capacity
        expired = set()
        if ttl is not None:
            expired = {i for i, r in self.rows.items()
                       if (ttl.steps is not None and self.step - r[2] > ttl.steps) or
                       (ttl.seconds is not None and self.clock.now - r[3] > ttl.seconds)}
        before = dict(self.counters)
        n = self.table.sweep(max_rows)
        gone = set(self.rows) - set(self.table.ids().tolist())
        assert len(gone) == n and set(self.table.ids().tolist()) <= set(self.rows)
        by_ttl, by_cap = gone & expired, gone - expired
        assert self.table.counters["evicted_ttl"] - before["evicted_ttl"] == len(by_ttl)
        assert self.table.counters["evicted_capacity"] - before["evicted_capacity"] == \
            len(by_cap)
        if max_rows is not None:
            assert n <= max_rows
        else:
            assert by_ttl == expired                       # a full sweep is exact
        survivors = set(self.rows) - gone
        if by_cap:
            assert cap is not None
            assert len(by_cap) <= len(self.rows) - len(by_ttl) - cap.max_rows
            score = {i: (r[2], r[3]) if cap.policy == "lru" else (r[1],)
                     for i, r in self.rows.items()}
            pool = survivors - expired if max_rows is None else set()
            assert all(score[v] <= score[s] for v in by_cap for s in pool)
        if max_rows is None and cap is not None:
            assert len(survivors) == min(len(self.rows) - len(expired), cap.max_rows)
        for i in gone:
            del self.rows[i]
        self.counters["evicted_ttl"] += len(by_ttl)
        self.counters["evicted_capacity"] += len(by_cap)
        if cap is not None and cap.score is not None:
            self.counters["evicted_score"] += len(by_cap)

    @rule()
    def restore(self) -> None:
        arrays, meta = self.table.state()
        self.table = DynamicTable.from_state(self.spec, arrays, meta, name="t",
                                             clock=self.clock)

    @rule(ids=id_lists)
    def bad_push(self, ids: list[int]) -> None:
        try:
            self.table.push(np.array(ids, np.float64), np.zeros((len(ids), DIM)))
        except TableIdError:
            return
        raise AssertionError("float IDs were taken")

    # ---- the whole table equals the model -----------------------------------------------
    @invariant()
    def same_as_model(self) -> None:
        if not hasattr(self, "table"):
            return
        arrays, meta = self.table.state()
        ids = sorted(self.rows)
        assert arrays["ids"].tolist() == ids
        for k, i in enumerate(ids):
            value, count, last_step, last_seconds = self.rows[i]
            np.testing.assert_array_equal(arrays["values"][k], value, err_msg=str(i))
            assert arrays["count"][k] == count
            assert arrays["last_step"][k] == last_step
            assert arrays["age_seconds"][k] == self.clock.now - last_seconds
        assert meta["step"] == self.step
        assert meta["counters"] == self.counters
        stats = self.table.stats()
        assert stats["rows"] == len(ids)
        assert stats["evictions"] == stats["evicted_ttl"] + stats["evicted_capacity"]


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
