"""Rules R1-R16 of docs/embeddings.md, one or more tests each (R2 is in test_table_init.py,
R12 in test_table_optim.py), on a :class:`DynamicTable` and, where a rule concerns the store,
on a ``local`` store. Tables read a fake clock that moves only when a test moves it.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import (CheckpointError, ConfigError, KeyAlreadyInitializedError,
                         KeyNotInitializedError, KVStoreError, ShapeMismatchError,
                         TableIdError, TableSpecError, UnsupportedError, ValueTypeError)
from pskv.table import (TTL, Always, Capacity, Constant, CountAdmission, DynamicTable, Normal,
                        ProbabilityAdmission, ReadOnly, RowMeta, TableSpec, Uniform,
                        initial_values, shard_of)

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


def counters_changed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


# ---- R1 ids ----------------------------------------------------------------------------
def test_r1_any_int64_value_is_an_id() -> None:
    t = table(init=Uniform(-1, 1), seed=3)
    values, found = t.lookup(EXTREME)
    assert found.all() and len(t) == EXTREME.size
    np.testing.assert_array_equal(t.ids(), np.sort(EXTREME))
    np.testing.assert_array_equal(values, initial_values(t.spec, EXTREME))
    assert len({tuple(r) for r in values.tolist()}) == EXTREME.size
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    t.push(EXTREME, grads, optimizer=sgd())
    np.testing.assert_array_equal(read(t, *EXTREME), values - grads)


def test_r1_any_int64_value_is_an_id_of_a_store() -> None:
    kv = store(init=Constant(0.5))
    kv.set_optimizer(sgd())
    assert kv.lookup(KEY, EXTREME)[1].all()
    kv.push(KEY, (EXTREME[::-1], ones(6)))
    values, found = kv.lookup(KEY, EXTREME, train=False)
    assert found.all()
    np.testing.assert_array_equal(values, np.full((6, 2), -0.5, np.float32))


def test_r1_a_store_takes_ids_and_gradients_as_ndarrays() -> None:
    kv = store(init=Constant(0.0))
    kv.push(KEY, (mx.nd.array([7, -7], dtype="int64"), mx.nd.ones((2, 2))))
    values, found = kv.lookup(KEY, mx.nd.array([-7], dtype="int64").asnumpy(), train=False)
    assert found.all() and values.tolist() == [[1, 1]]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint32, np.uint64])
def test_r1_every_integer_dtype_names_the_same_rows(dtype: Any) -> None:
    t = table(init=Normal(0, 1))
    want = t.lookup(ids(0, 1, 100))[0]
    got, found = t.lookup(np.array([0, 1, 100], dtype))
    assert found.all() and len(t) == 3
    np.testing.assert_array_equal(got, want)
    assert t.lookup(np.array([2**63 - 1], np.uint64))[1].all()


NOT_IDS = [np.array([1.0, 2.0]), np.array([3.0]), np.array([True, False]),
           np.array([1, 2], object), np.array(["1", "2"]), [[1, 2], [3]],
           np.array([2**63], np.uint64), None]


@pytest.mark.parametrize("bad", NOT_IDS, ids=lambda b: repr(b)[:30])
def test_r1_ids_that_are_not_integers_raise_table_id_error(bad: Any) -> None:
    t = table(init=Normal(0, 1), admission=CountAdmission(2))
    t.lookup(ids(1, 2))
    before = t.state()
    calls: list[Callable[[], Any]] = [
        lambda: t.lookup(bad), lambda: t.lookup(bad, train=False),
        lambda: t.push(bad, ones(2), optimizer=sgd()), lambda: t.push(bad, ones(2)),
        lambda: t.assign(bad, ones(2))]
    for call in calls:
        with pytest.raises(TableIdError, match=repr(KEY)) as err:
            call()
        assert isinstance(err.value, ValueTypeError) and isinstance(err.value, TypeError)
        assert_same_state(before, t.state())


@pytest.mark.parametrize("bad", NOT_IDS, ids=lambda b: repr(b)[:30])
def test_r1_a_store_refuses_ids_that_are_not_integers(bad: Any) -> None:
    kv = store()
    kv.set_optimizer(sgd())
    kv.lookup(KEY, ids(1, 2))
    before = kv._tables.tables[KEY].state()
    out = mx.nd.sparse.zeros("row_sparse", (1, 2))
    calls = [lambda: kv.lookup(KEY, bad), lambda: kv.push(KEY, (bad, ones(2)))]
    if not isinstance(bad, list):           # a list of row_ids is one per out
        calls.append(lambda: kv.row_sparse_pull(KEY, out, row_ids=bad))
    for call in calls:
        with pytest.raises(TableIdError, match=repr(KEY)):
            call()
    assert_same_state(before, kv._tables.tables[KEY].state())


# ---- R3 birth --------------------------------------------------------------------------
def test_r3_pull_birth_a_training_lookup_inserts_the_initial_row() -> None:
    t = table(init=Normal(0, 1), seed=4)
    values, found = t.lookup(ids(5, 6, 5))
    assert found.all() and len(t) == 2 and t.stats()["inserts"] == 2
    np.testing.assert_array_equal(values, initial_values(t.spec, ids(5, 6, 5)))
    t.push(ids(5), ones(1), optimizer=sgd())
    np.testing.assert_array_equal(read(t, 5), values[:1] - 1)


def test_r3_push_birth_lookups_never_insert_the_first_push_does() -> None:
    t = table(init=Uniform(-1, 1), seed=2, birth="push")
    init = initial_values(t.spec, ids(5))
    values, found = t.lookup(ids(5, 5))
    assert not found.any() and len(t) == 0 and t.stats()["inserts"] == 0
    np.testing.assert_array_equal(values, np.repeat(init, 2, axis=0))
    t.push(ids(5, 5), np.array([[1, 2], [3, 4]], np.float32), optimizer=sgd())
    assert len(t) == 1
    np.testing.assert_array_equal(read(t, 5), init - np.float32([[4, 6]]))
    s = t.stats()
    assert (s["inserts"], s["pushed_rows"], s["dropped_pushes"]) == (1, 1, 0)


def test_r3_push_birth_in_a_store() -> None:
    kv = store(init=Constant(1.0), birth="push")
    kv.set_optimizer(sgd())
    assert not kv.lookup(KEY, ids(9))[1].any()
    assert kv.table_stats(KEY)["rows"] == 0
    kv.push(KEY, (ids(9), ones(1, v=0.25)))
    values, found = kv.lookup(KEY, ids(9), train=False)
    assert found.all() and values.tolist() == [[0.75, 0.75]]


def test_r3_push_birth_asks_admission() -> None:
    t = table(birth="push", admission=CountAdmission(2), init=Constant(1.0))
    t.push(ids(5), ones(1), optimizer=sgd())
    s = t.stats()
    assert (len(t), s["refusals"], s["dropped_pushes"], s["pushed_rows"]) == (0, 1, 1, 0)
    t.push(ids(5), ones(1), optimizer=sgd())
    assert len(t) == 1 and read(t, 5).tolist() == [[0.0, 0.0]]


def test_r3_row_sparse_pull_is_a_training_lookup() -> None:
    kv = store(init=Uniform(-1, 1), seed=6)
    outs = [mx.nd.sparse.zeros("row_sparse", (1, 2)) for _ in range(2)]
    kv.row_sparse_pull(KEY, outs, row_ids=[ids(9, -4, 9), ids(2**63 - 1)])
    assert outs[0].indices.asnumpy().tolist() == [-4, 9]           # unique, sorted IDs
    np.testing.assert_array_equal(outs[0].data.asnumpy(),
                                  initial_values(kv._tables.tables[KEY].spec, ids(-4, 9)))
    assert outs[1].indices.asnumpy().tolist() == [2**63 - 1]
    s = kv.table_stats(KEY)
    assert (s["rows"], s["inserts"]) == (3, 3)


# ---- R4 unknown ------------------------------------------------------------------------
def test_r4_an_id_without_a_row_reads_its_initial_value() -> None:
    t = table(init=Normal(0, 1), seed=8, admission=CountAdmission(3),
              eviction=TTL(steps=1))
    init = initial_values(t.spec, ids(1, 2, 3))
    v, f = t.lookup(ids(1, 2, 3), train=False)              # never seen, eval
    assert not f.any()
    np.testing.assert_array_equal(v, init)
    v, f = t.lookup(ids(1, 2, 3))                           # refused by admission
    assert not f.any() and len(t) == 0
    np.testing.assert_array_equal(v, init)
    t.lookup(ids(1))
    v, f = t.lookup(ids(1))                                 # admitted at the 3rd sighting
    assert f.all()
    t.push(ids(1), ones(1, v=5.0), optimizer=sgd())
    assert not np.array_equal(read(t, 1), init[:1])
    for _ in range(2):
        t.push(ids(2), ones(1), optimizer=sgd())            # 2 has no row: dropped
    assert t.sweep() == 1 and len(t) == 0                   # 1 expired
    v, f = t.lookup(ids(1), train=False)                    # evicted: the initial value
    assert not f.any()
    np.testing.assert_array_equal(v, init[:1])


def test_r4_unknown_zeros_reads_zeros() -> None:
    t = table(init=Constant(0.5), unknown="zeros", birth="push")
    v, f = t.lookup(ids(3, 4))
    assert not f.any() and v.tolist() == [[0, 0], [0, 0]]
    t.push(ids(3), ones(1, v=0.25), optimizer=sgd())        # born from init, not zeros
    v, f = t.lookup(ids(3, 4), train=False)
    assert f.tolist() == [True, False] and v.tolist() == [[0.25, 0.25], [0, 0]]


# ---- R5 eval lookups -------------------------------------------------------------------
def test_r5_an_eval_lookup_changes_nothing_but_lookups_and_misses() -> None:
    clock = Clock()
    t = table(clock, admission=CountAdmission(2), eviction=(Capacity(5), TTL(seconds=3)))
    for _ in range(2):
        t.lookup(ids(1, 2, 3))
    t.push(ids(1, 2), ones(2), optimizer=sgd())
    t.lookup(ids(7))                                        # one sighting of 7
    clock.now += 2
    before = t.state()
    v, f = t.lookup(ids(1, 2, 7, 7, 8), train=False)
    assert f.tolist() == [True, True, False, False, False]
    after = t.state()
    assert_same_state((before[0], {}), (after[0], {}))      # rows, ages, counts, sightings
    assert after[1]["step"] == before[1]["step"]
    assert counters_changed(before[1]["counters"], after[1]["counters"]) == \
        {"lookups": 5, "misses": 3}
    t.lookup(ids(7), train=False)
    assert 7 not in t.ids()                                 # eval sightings do not count
    assert t.lookup(ids(7))[1].all()                        # the second training one does


def test_r5_eval_lookups_keep_no_row_alive() -> None:
    clock = Clock()
    lru = table(clock, eviction=Capacity(2, "lru"))
    lfu = table(clock, eviction=Capacity(2, "lfu"))
    ttl = table(clock, eviction=TTL(seconds=5))
    for t in (lru, lfu, ttl):
        t.lookup(ids(1))
        t.push(ids(1), ones(1))
        t.lookup(ids(2))
        t.lookup(ids(2))
        t.push(ids(2), ones(1))
        clock.now += 3
        for _ in range(5):
            t.lookup(ids(1), train=False)
        t.lookup(ids(3))
        t.lookup(ids(3))
        t.lookup(ids(3))
        clock.now += 3
        t.sweep()
        assert 1 not in t.ids()


def test_r5_an_eval_lookup_of_a_store_changes_nothing() -> None:
    kv = store(admission=CountAdmission(2))
    kv.lookup(KEY, ids(1, 2))
    kv.lookup(KEY, ids(1))
    before = kv._tables.tables[KEY].state()
    kv.lookup(KEY, ids(1, 2, 3), train=False)
    after = kv._tables.tables[KEY].state()
    assert_same_state((before[0], {}), (after[0], {}))
    assert counters_changed(before[1]["counters"], after[1]["counters"]) == \
        {"lookups": 3, "misses": 2}


# ---- R6 found --------------------------------------------------------------------------
def test_r6_found_marks_values_read_from_stored_rows() -> None:
    t = table(init=Normal(0, 1), admission=CountAdmission(2))
    t.lookup(ids(1))
    lookup = np.array([[1, 2], [1, 3]], np.int64)
    values, found = t.lookup(lookup)                # 1 is born by this very lookup
    assert values.shape == (2, 2, 2) and found.shape == (2, 2)
    assert found.tolist() == [[True, False], [True, False]]
    np.testing.assert_array_equal(values.reshape(4, 2), initial_values(t.spec, lookup.ravel()))
    t.push(ids(1), ones(1), optimizer=sgd())
    values, found = t.lookup(ids(1, 1, 1))
    assert found.all() and (values == values[0]).all()
    values, found = t.lookup(np.int64(1))           # a 0-d ID
    assert values.shape == (2,) and found.shape == () and bool(found)


def test_r6_returned_rows_are_copies_and_pushed_arrays_are_not_written() -> None:
    t = table(init=Constant(1.0))
    t.lookup(ids(1, 2))
    for train in (True, False):
        for query in (ids(1, 2), ids(1, 3)):                # all found, and not
            values, _ = t.lookup(query, train=train)
            values += 100
    assert read(t, 1, 2).tolist() == [[1, 1], [1, 1]]
    grads = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    kept = grads.copy()
    t.push(ids(2, 1, 2), grads, optimizer=mx.optimizer.SGD(learning_rate=0.5,
                                                             rescale_grad=2.0,
                                                             clip_gradient=1.5))
    t.push(ids(1, 2, 1), grads)
    t.assign(ids(1, 5, 1), grads)
    np.testing.assert_array_equal(grads, kept)
    grads += 1
    assert read(t, 1, 5).tolist() == [[5, 6], [3, 4]]


# ---- R7 duplicates ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_r7_duplicate_ids_of_one_push_combine_then_update_once(mode: str) -> None:
    def adagrad() -> Any:
        return mx.optimizer.AdaGrad(learning_rate=0.1)
    dup, single, twice = (table(init=Constant(1.0), duplicates=mode) for _ in range(3))
    g = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    combined = (g[0] + g[2]) / (2 if mode == "mean" else 1)
    for t in (dup, single, twice):
        t.lookup(ids(1, 2))
    dup.push(ids(1, 2, 1), g, optimizer=adagrad())
    single.push(ids(1, 2), np.stack([combined, g[1]]), optimizer=adagrad())
    opt = adagrad()
    twice.push(ids(1, 2), g[:2], optimizer=opt)
    twice.push(ids(1), g[2:] / (2 if mode == "mean" else 1), optimizer=opt)
    assert_same_state(dup.state(), single.state())
    assert not np.array_equal(read(dup, 1), read(twice, 1))   # once, not twice
    assert dup.stats()["pushed_rows"] == 2


def test_r7_the_device_values_of_one_store_push_sum() -> None:
    kv = store(init=Constant(1.0))
    kv.set_optimizer(sgd())
    kv.lookup(KEY, ids(1, 2))
    kv.push(KEY, [(ids(1, 2), ones(2, v=0.25)),
                  (ids(2), ones(1, v=0.5)),
                  mx.nd.sparse.row_sparse_array((ones(1, v=0.125), ids(1)), shape=(2, 2))])
    values = kv.lookup(KEY, ids(1, 2), train=False)[0]
    assert values.tolist() == [[0.625, 0.625], [0.25, 0.25]]
    assert kv.table_stats(KEY)["step"] == 1


# ---- R8 pushes without a row -----------------------------------------------------------
def test_r8_a_push_to_an_id_without_a_row_is_dropped_under_pull_birth() -> None:
    t = table(init=Constant(1.0))
    t.lookup(ids(1))
    t.push(ids(1, 2, 2, 3), ones(4), optimizer=sgd())
    assert t.ids().tolist() == [1]
    assert read(t, 1).tolist() == [[0, 0]]
    s = t.stats()
    assert (s["dropped_pushes"], s["pushed_rows"], s["step"]) == (2, 1, 1)


def test_r8_an_evicted_row_is_not_resurrected_and_its_state_is_gone() -> None:
    def adagrad() -> Any:
        return mx.optimizer.AdaGrad(learning_rate=0.5)
    opt = adagrad()
    t = table(init=Constant(1.0), eviction=TTL(steps=1))
    fresh = table(init=Constant(1.0))
    t.lookup(ids(5))
    for _ in range(3):
        t.push(ids(5), ones(1, v=2.0), optimizer=opt)       # its history grows
    t.push(ids(6), ones(1), optimizer=opt)
    t.push(ids(6), ones(1), optimizer=opt)
    assert t.sweep() == 1 and len(t) == 0
    t.push(ids(5), ones(1), optimizer=opt)                  # dropped, not resurrected
    assert len(t) == 0 and t.stats()["dropped_pushes"] == 3   # 6, 6 and 5
    t.lookup(ids(5))                                        # born again: no history
    fresh.lookup(ids(5))
    t.push(ids(5), ones(1, v=3.0), optimizer=opt)
    fresh.push(ids(5), ones(1, v=3.0), optimizer=adagrad())
    np.testing.assert_array_equal(read(t, 5), read(fresh, 5))
    np.testing.assert_array_equal(t.state()[0]["state0"], fresh.state()[0]["state0"])


def test_r8_a_push_after_its_lookup_never_updates_the_row_that_took_an_evicted_slot() -> None:
    """A push reuses the slots its lookup found (no second probe of the index); between
    the two, a sweep evicts the row and a new ID takes its freed slot: the push is dropped
    (R8) and the new row keeps its value."""
    t = table(init=Constant(1.0), eviction=TTL(steps=1))
    t.lookup(ids(5))                                        # slot 0
    for _ in range(2):
        t.push(ids(6), ones(1), optimizer=sgd())            # steps: 5 is now too old
    assert t.sweep() == 1 and 5 not in t.ids()
    t.lookup(ids(7))                                        # 7 takes slot 0
    before = t.stats()["dropped_pushes"]
    t.push(ids(5), ones(1, v=4.0), optimizer=sgd())
    assert t.stats()["dropped_pushes"] == before + 1
    assert read(t, 7).tolist() == [[1.0, 1.0]] and 5 not in t.ids()


def test_r7_a_push_of_the_ids_of_recent_lookups_equals_one_that_probes_again() -> None:
    """Pushes of IDs looked up just before (whole, and as the concatenation of several
    lookups, as a server's sync round pushes them), with IDs a lookup did not find and
    rows born in between, give the same rows, states and counters as pushes to a table
    that looked nothing up (it probes its index for every ID)."""
    opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.5)  # noqa: E731
    a, b = ids(3, 1, 3, 9), ids(9, 2, 8, 2)
    g = np.arange(16, dtype=np.float32).reshape(8, 2)
    t = table(init=Constant(1.0), birth="push")
    ref = table(init=Constant(1.0), birth="push")
    o1, o2 = opt(), opt()
    for tb, o in ((t, o1), (ref, o2)):
        tb.push(ids(1, 3), ones(2), optimizer=o)            # rows 1 and 3 exist
    t.lookup(a, train=False)                                 # 9 not found
    t.lookup(b, train=False)                                 # 9, 2, 8 not found
    t.push(ids(9), ones(1), optimizer=o1)                    # born after the lookups
    ref.push(ids(9), ones(1), optimizer=o2)
    both = np.concatenate([a, b])
    assert t._known_slots(both) is not None and t._known_slots(a) is not None
    t.push(both, g, optimizer=o1)
    ref.push(both, g, optimizer=o2)
    t.push(a, g[:4], optimizer=o1)
    ref.push(a, g[:4], optimizer=o2)
    ta, ra = t.state(), ref.state()
    for name in ("ids", "values", "state0", "count"):
        np.testing.assert_array_equal(ta[0][name], ra[0][name], err_msg=name)
    for k in ("rows", "inserts", "pushed_rows", "dropped_pushes", "step"):
        assert t.stats()[k] == ref.stats()[k], k


def test_r8_under_push_birth_a_push_to_an_evicted_row_is_a_birth_with_fresh_state() -> None:
    opt = mx.optimizer.SGD(learning_rate=1.0, momentum=0.5)
    t = table(init=Constant(1.0), birth="push", eviction=TTL(steps=1))
    for _ in range(3):
        t.push(ids(5), ones(1), optimizer=opt)
    for _ in range(2):
        t.push(ids(6), ones(1), optimizer=opt)
    t.sweep()
    assert 5 not in t.ids()
    t.push(ids(5), ones(1), optimizer=opt)                  # momentum 0 again: w = 1 - 1
    assert read(t, 5).tolist() == [[0, 0]]
    assert t.stats()["inserts"] == 3


# ---- R9 admission ----------------------------------------------------------------------
def test_r9_always_admits_at_the_first_sighting() -> None:
    t = table(admission=Always())
    assert t.lookup(ids(1, 2))[1].all() and t.stats()["refusals"] == 0


def test_r9_count_admission_admits_at_the_nth_sighting() -> None:
    kv = store(admission=CountAdmission(3))
    for _ in range(2):
        assert not kv.lookup(KEY, ids(7, 7, 7))[1].any()    # one sighting per call
        kv.lookup(KEY, ids(7), train=False)                 # eval: not a sighting
    assert kv.lookup(KEY, ids(7, 7))[1].all()
    s = kv.table_stats(KEY)
    assert (s["rows"], s["refusals"], s["inserts"]) == (1, 2, 1)


def test_r9_ids_sharing_a_counter_cell_are_admitted_early_never_late() -> None:
    t = table(admission=CountAdmission(2, counters=1))
    assert not t.lookup(ids(1))[1].any()
    assert t.lookup(ids(2))[1].all()                        # early: 1's sighting counted
    rng = np.random.default_rng(0)
    t = table(admission=CountAdmission(3, counters=16))
    sightings: dict[int, int] = {}
    early = 0
    for i in rng.integers(0, 200, 1500).tolist():
        if i in t.ids():
            continue
        sightings[i] = sightings.get(i, 0) + 1
        born = bool(t.lookup(ids(i))[1][0])
        assert born or sightings[i] < 3                     # never late
        early += born and sightings[i] < 3
    assert early > 0


def test_r9_probability_admission_of_the_id_alone_is_a_fixed_fraction() -> None:
    many = np.arange(-2000, 2000, dtype=np.int64)
    t = table(admission=ProbabilityAdmission(0.3, per_step=False), seed=1)
    _, found = t.lookup(many)
    assert 0.25 < found.mean() < 0.35
    assert t.stats()["refusals"] == many.size - found.sum()
    t.push(many[:1], ones(1))
    t.push(many[:1], ones(1))
    assert not t.lookup(many[~found])[1].any()              # refused at every step
    same = table(admission=ProbabilityAdmission(0.3, per_step=False), seed=1)
    other = table(admission=ProbabilityAdmission(0.3, per_step=False), seed=2)
    assert same.lookup(many)[1].tolist() == found.tolist()
    assert other.lookup(many)[1].tolist() != found.tolist()


def test_r9_probability_admission_per_step_draws_again_at_each_step() -> None:
    many = np.arange(1000, dtype=np.int64)
    t = table(admission=ProbabilityAdmission(0.2), seed=1)
    refused = many[~t.lookup(many)[1]]
    assert not t.lookup(refused)[1].any()                   # the same step: the same draw
    t.push(ids(0), ones(1))
    again = t.lookup(refused)[1]
    assert 0.1 < again.mean() < 0.3


@pytest.mark.parametrize("p,admitted", [(0.0, 0), (1.0, 100)])
def test_r9_probability_admission_edges(p: float, admitted: int) -> None:
    t = table(admission=ProbabilityAdmission(p))
    assert t.lookup(np.arange(100))[1].sum() == admitted


def test_r9_read_only_never_inserts_but_assign_does() -> None:
    t = table(admission=ReadOnly(), init=Constant(1.0))
    assert not t.lookup(ids(1, 2))[1].any()
    t.push(ids(1), ones(1), optimizer=sgd())
    pushy = table(admission=ReadOnly(), birth="push")
    pushy.push(ids(1), ones(1), optimizer=sgd())
    assert len(t) == len(pushy) == 0
    assert (t.stats()["refusals"], pushy.stats()["refusals"]) == (2, 1)
    t.assign(ids(1, 2, 1), np.array([[1, 1], [2, 2], [3, 3]], np.float32))  # last wins
    assert read(t, 1, 2).tolist() == [[3, 3], [2, 2]] and t.step == 1
    t.push(ids(1), ones(1), optimizer=sgd())
    assert read(t, 1).tolist() == [[2, 2]]


# ---- R10 eviction ----------------------------------------------------------------------
def _use(t: DynamicTable, *values: int) -> None:
    """A training lookup of ``values`` and a push of them (one step)."""
    t.lookup(ids(*values))
    t.push(ids(*values), ones(len(values)))


def test_r10_a_full_sweep_keeps_the_most_recently_used_rows() -> None:
    t = table(eviction=Capacity(3, "lru"))
    for i in range(6):
        _use(t, i)
    t.lookup(ids(0))
    assert len(t) == 6                       # only sweeps evict
    assert t.sweep() == 3
    assert t.ids().tolist() == [0, 4, 5]
    assert t.stats()["evicted_capacity"] == 3


def test_r10_lfu_keeps_the_most_used_rows() -> None:
    t = table(eviction=Capacity(2, "lfu"))
    for i, uses in enumerate([5, 1, 3, 2]):
        for _ in range(uses):
            t.lookup(ids(i))
    _use(t, 1)
    t.sweep()
    assert t.ids().tolist() == [0, 2]


def test_r10_a_custom_score_sees_row_meta() -> None:
    clock = Clock()
    seen: list[RowMeta] = []

    def score(meta: RowMeta) -> np.ndarray:
        seen.append(meta)
        return -meta.ids.astype(np.float64)           # the highest ID goes first
    t = table(clock, eviction=Capacity(2, score=score))
    assert t.spec.capacity is not None and t.spec.capacity.policy == "custom"
    for i in (30, 10, 20):
        _use(t, i)
        clock.now += 1
    t.sweep()
    assert t.ids().tolist() == [10, 20]
    meta = seen[0]
    order = np.argsort(meta.ids)
    assert meta.ids[order].tolist() == [10, 20, 30]
    assert meta.count[order].tolist() == [2, 2, 2]
    assert meta.last_step[order].tolist() == [1, 2, 0]
    assert meta.last_seconds[order].tolist() == [1001.0, 1002.0, 1000.0]


def test_r10_a_custom_score_of_the_wrong_shape_raises_and_changes_nothing() -> None:
    t = table(eviction=(Capacity(1, score=lambda meta: np.zeros(1)), TTL(steps=1)))
    t.lookup(ids(1, 2, 3))
    t.push(ids(1, 2), ones(2), optimizer=sgd())
    t.push(ids(1, 2), ones(2), optimizer=sgd())     # 3 expired, then 1 row too many
    before = t.state()
    with pytest.raises(ShapeMismatchError, match="one number per row"):
        t.sweep()
    assert_same_state(before, t.state())


def test_r10_ttl_steps_expires_rows_unused_for_more_than_steps() -> None:
    t = table(eviction=TTL(steps=2))
    _use(t, 1)                      # used at step 0
    t.lookup(ids(2))                # used at step 1
    _use(t, 9)                      # step 2
    assert t.sweep() == 0           # 2 - 0 is not more than 2
    _use(t, 9)                      # step 3
    assert t.sweep() == 1 and t.ids().tolist() == [2, 9]
    _use(t, 9)                      # step 4
    assert t.sweep() == 1 and t.ids().tolist() == [9]
    assert t.stats()["evicted_ttl"] == 2


def test_r10_lru_ranks_exactly_at_large_step_counts() -> None:
    clock = Clock()
    t = table(clock, eviction=Capacity(1, "lru"))
    t.step = 10**12
    t.lookup(ids(1, 2))             # 1 takes the first slot
    clock.now += 1e-6
    t.lookup(ids(1))                # the same step, a later second
    t.sweep()
    assert t.ids().tolist() == [1]


def test_r10_ttl_steps_boundary() -> None:
    t = table(eviction=TTL(steps=1))
    t.lookup(ids(1))                # step 0
    t.push(ids(7), ones(1))         # step -> 1
    t.sweep()
    assert 1 in t.ids()             # 1 - 0 = 1, not more than 1
    t.push(ids(7), ones(1))         # step -> 2
    t.sweep()
    assert 1 not in t.ids()


def test_r10_ttl_seconds_follows_the_tables_clock() -> None:
    clock = Clock(0.0)
    t = table(clock, eviction=TTL(seconds=10))
    t.lookup(ids(1))
    clock.now = 5.0
    t.lookup(ids(2))
    clock.now = 10.0
    assert t.sweep() == 0
    clock.now = 10.5
    assert t.sweep() == 1 and t.ids().tolist() == [2]
    clock.now = 14.0
    t.push(ids(2), ones(1))                         # a push is a use
    clock.now = 20.0
    assert t.sweep() == 0
    clock.now = 24.5
    assert t.sweep() == 1 and len(t) == 0


def test_r10_ttl_and_capacity_together() -> None:
    clock = Clock(0.0)
    t = table(clock, eviction=(TTL(seconds=5), Capacity(2)))
    for i in range(4):
        _use(t, i)
        clock.now += 2
    # ages 8, 6, 4, 2: 0 and 1 expire, then 2 rows remain: nothing over capacity
    assert t.sweep() == 2 and t.ids().tolist() == [2, 3]
    s = t.stats()
    assert (s["evicted_ttl"], s["evicted_capacity"], s["evictions"]) == (2, 0, 2)


def test_r10_a_sweep_examines_at_most_max_rows_slots_from_a_rotating_cursor() -> None:
    t = table(eviction=TTL(steps=1))
    t.lookup(np.arange(20))
    t.push(ids(99), ones(1), optimizer=sgd())
    t.push(ids(99), ones(1), optimizer=sgd())
    for _ in range(4):
        assert t.sweep(5) == 5
    assert len(t) == 0
    t = table(eviction=Capacity(10))
    t.lookup(np.arange(20))
    assert t.sweep(4) == 4 and len(t) == 16           # more than capacity between sweeps
    assert t.sweep(4) == 4 and len(t) == 12
    assert t.sweep() == 2 and len(t) == 10            # a full sweep is exact


def test_r10_evicted_rows_leave_and_their_slots_are_reused() -> None:
    clock = Clock()
    t = table(clock, eviction=Capacity(50))
    sizes = []
    for rnd in range(20):
        clock.now += 1
        t.lookup(np.arange(rnd * 50, rnd * 50 + 50))
        t.sweep()
        assert len(t) == 50
        sizes.append((t.capacity_rows, t._index.cells))
    assert len(set(sizes[5:])) == 1                   # no growth with churn
    assert t.ids().tolist() == list(range(950, 1000))


def test_r10_the_local_store_sweeps_after_every_push() -> None:
    kv = store(eviction=Capacity(4), sweep_rows=4096)
    kv.set_optimizer(sgd())
    kv.lookup(KEY, np.arange(10))
    assert kv.table_stats(KEY)["rows"] == 10            # lookups never sweep
    kv.push(KEY, (ids(9), ones(1)))
    assert kv.table_stats(KEY)["rows"] == 4
    assert 9 in kv._tables.tables[KEY].ids()
    bounded = store(eviction=Capacity(4), sweep_rows=2)
    bounded.lookup(KEY, np.arange(10))
    bounded.push(KEY, (ids(9), ones(1)))
    assert bounded.table_stats(KEY)["rows"] == 8        # at most sweep_rows examined


def test_r10_reserve_rows_allocates_up_front() -> None:
    t = table(reserve_rows=1000)
    cells = t._index.cells
    assert t.capacity_rows == 1000 and cells >= 2000
    t.lookup(np.arange(1000))
    assert (t.capacity_rows, t._index.cells) == (1000, cells)      # no growth
    t.lookup(ids(5000))
    assert t.capacity_rows > 1000


# ---- R11 steps -------------------------------------------------------------------------
def test_r11_a_step_is_one_applied_push() -> None:
    clock = Clock(50.0)
    t = table(clock)
    t.lookup(ids(1, 2))
    t.lookup(ids(3), train=False)
    t.assign(ids(4), ones(1))
    assert t.step == 0
    t.push(ids(1), ones(1), optimizer=sgd())
    t.push(ids(8), ones(1), optimizer=sgd())            # every ID dropped: still a step
    t.push(ids(2), ones(1))
    assert t.step == t.stats()["step"] == 3
    clock.now = 60.0
    t.lookup(ids(2))
    arrays, meta = t.state()
    assert meta["step"] == 3
    assert arrays["ids"].tolist() == [1, 2, 4]
    # last_step: the step count when the row's last training lookup or push began
    assert arrays["last_step"].tolist() == [0, 3, 0]
    assert arrays["age_seconds"].tolist() == [10.0, 0.0, 10.0]


def test_r11_each_store_push_is_one_step() -> None:
    kv = store()
    kv.set_optimizer(sgd())
    kv.lookup(KEY, ids(1, 2))
    kv.push(KEY, [(ids(1), ones(1)), (ids(2), ones(1))])
    kv.push(KEY, (ids(1, 1), ones(2)))
    assert kv.table_stats(KEY)["step"] == 2


# ---- R13 routing -----------------------------------------------------------------------
def test_r13_shard_of_is_a_hash_of_the_id() -> None:
    assert shard_of([0, 1, 2, 3, -1, 2**62], 4).tolist() == [0, 3, 0, 2, 2, 1]
    consecutive = np.arange(10**12, 10**12 + 8000)
    counts = np.bincount(shard_of(consecutive, 4), minlength=4)
    assert counts.min() > 1800                      # each about 2000
    assert not np.array_equal(shard_of(consecutive, 2), consecutive % 2)
    assert shard_of(np.array([[5, 6], [7, 8]]), 3).shape == (2, 2)
    assert (shard_of(EXTREME, 1) == 0).all()
    np.testing.assert_array_equal(shard_of(EXTREME.astype(np.int64), 7),
                                  shard_of(EXTREME.tolist(), 7))
    with pytest.raises(ConfigError):
        shard_of([1], 0)
    with pytest.raises(TableIdError):
        shard_of([1.0], 2)


def _trained(n: int = 300) -> DynamicTable:
    t = table(init=Uniform(-1, 1), seed=5, admission=CountAdmission(1, counters=64))
    opt = mx.optimizer.AdaGrad(learning_rate=0.1)
    rng = np.random.default_rng(1)
    every = rng.integers(-2**62, 2**62, n)
    t.lookup(every)
    for _ in range(3):
        some = rng.choice(every, min(n, 50), replace=False)
        t.push(some, rng.normal(size=(some.size, 2)).astype(np.float32), optimizer=opt)
    return t


def test_r13_a_table_reshards_into_any_number_of_servers() -> None:
    t = _trained()
    arrays, meta = t.state()
    for n in (1, 3, 5):
        parts = [DynamicTable.from_state(t.spec, arrays, meta, name=KEY, clock=Clock(),
                                         shard=(i, n)) for i in range(n)]
        got = np.concatenate([p.ids() for p in parts])
        np.testing.assert_array_equal(np.sort(got), arrays["ids"])     # each ID once
        for i, p in enumerate(parts):
            part, _ = p.state()
            assert (shard_of(part["ids"], n) == i).all()
            pick = np.searchsorted(arrays["ids"], part["ids"])
            for name in ("values", "state0", "count", "last_step", "age_seconds"):
                np.testing.assert_array_equal(part[name], arrays[name][pick], err_msg=name)
    # saved by 2 servers, restored into 3
    two = [DynamicTable.from_state(t.spec, arrays, meta, shard=(i, 2)).state()
           for i in range(2)]
    three = [DynamicTable.from_state(t.spec, a, m, shard=(j, 3)).ids()
             for a, m in two for j in range(3)]
    np.testing.assert_array_equal(np.sort(np.concatenate(three)), arrays["ids"])


# ---- R14 counters ----------------------------------------------------------------------
def test_r14_counters_count_what_they_say() -> None:
    kv = store(admission=CountAdmission(2), eviction=Capacity(2, "lru"), sweep_rows=4096)
    kv.set_optimizer(sgd())
    kv.lookup(KEY, ids(1, 1, 2))              # 3 lookups, 3 misses, 2 refusals
    kv.lookup(KEY, ids(1, 2, 3))              # 3 misses, 1 and 2 born, 3 refused
    kv.lookup(KEY, ids(1, 3), train=False)    # 2 lookups, 1 miss
    kv.push(KEY, (ids(1, 2, 3, 3), ones(4)))  # 2 rows pushed, 3 dropped once
    kv.lookup(KEY, ids(3, 4))                 # 3 born, 4 refused; 3 rows
    kv.push(KEY, (ids(3), ones(1)))           # the sweep evicts one row (capacity 2)
    want = {"rows": 2, "step": 2, "lookups": 10, "misses": 9, "inserts": 3, "refusals": 4,
            "evicted_ttl": 0, "evicted_capacity": 1, "evictions": 1, "dropped_pushes": 1,
            "pushed_rows": 3}
    assert kv.table_stats(KEY) == want
    assert kv._tables.tables[KEY].stats() == want


# ---- R15 bad input ---------------------------------------------------------------------
BAD_CALLS: list[tuple[str, Callable[[DynamicTable], Any], type[KVStoreError]]] = [
    ("float ids", lambda t: t.push(np.array([1.0]), ones(1), sgd()), TableIdError),
    ("object ids", lambda t: t.lookup(np.array([1], object)), TableIdError),
    ("grads of another dim", lambda t: t.push(ids(1), ones(1, 3), sgd()), ShapeMismatchError),
    ("grads of another count", lambda t: t.push(ids(1, 2), ones(3), sgd()),
     ShapeMismatchError),
    ("1-d grads", lambda t: t.push(ids(1, 2), np.ones(4, np.float32), sgd()),
     ShapeMismatchError),
    ("ragged grads", lambda t: t.push(ids(1, 2), [[1.0, 2.0], [3.0]], sgd()),
     ShapeMismatchError),
    ("str grads", lambda t: t.push(ids(1), np.array([["a", "b"]]), sgd()), ShapeMismatchError),
    ("bool grads", lambda t: t.push(ids(1), np.ones((1, 2), bool), sgd()), ShapeMismatchError),
    ("complex grads", lambda t: t.push(ids(1), np.ones((1, 2), complex), sgd()),
     ShapeMismatchError),
    ("None grads", lambda t: t.push(ids(1), None, sgd()), ShapeMismatchError),
    ("assign of another dim", lambda t: t.assign(ids(5), ones(1, 3)), ShapeMismatchError),
    ("bad grads, no optimizer", lambda t: t.push(ids(9), ones(2)), ShapeMismatchError),
    ("adagrad with wd", lambda t: t.push(ids(1), ones(1), mx.optimizer.AdaGrad(wd=0.1)),
     UnsupportedError),
]


@pytest.mark.parametrize("name,call,error", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
@pytest.mark.parametrize("birth", ["pull", "push"])
def test_r15_bad_input_raises_and_changes_nothing(name: str, call: Callable[..., Any],
                                                  error: type[KVStoreError], birth: str) -> None:
    t = table(init=Normal(0, 1), admission=CountAdmission(2), birth=birth,
              eviction=(Capacity(10), TTL(steps=5)))
    t.lookup(ids(1, 2, 3))
    t.lookup(ids(1, 2))
    t.push(ids(1, 2), ones(2), optimizer=mx.optimizer.SGD(momentum=0.9))
    before = t.state()
    with pytest.raises(error, match=repr(KEY)):
        call(t)
    assert_same_state(before, t.state())


STORE_BAD: list[tuple[str, Any, type[KVStoreError]]] = [
    ("not a pair", (ids(1),), ValueTypeError),
    ("an int", 3, ValueTypeError),
    ("ragged ids", ([[1, 2], [3]], ones(2)), TableIdError),
    ("ragged grads", (ids(1, 2), [[1.0, 2.0], [3.0]]), ShapeMismatchError),
    ("float ids", (np.array([1.0]), ones(1)), TableIdError),
    ("grads of another dim", (ids(1), ones(1, 3)), ShapeMismatchError),
    ("devices of other dims", [(ids(1), ones(1)), (ids(2), ones(1, 3))], ShapeMismatchError),
    ("a float device", [(ids(1), ones(1)), (np.array([2.0]), ones(1))], TableIdError),
]


@pytest.mark.parametrize("name,value,error", STORE_BAD, ids=[b[0] for b in STORE_BAD])
def test_r15_a_bad_store_push_changes_nothing(name: str, value: Any,
                                              error: type[KVStoreError]) -> None:
    kv = store(init=Normal(0, 1), eviction=Capacity(1))
    kv.set_optimizer(mx.optimizer.Adam())
    kv.lookup(KEY, ids(1, 2))
    opt = kv._engine.updater.optimizer
    before = kv._tables.tables[KEY].state()
    with pytest.raises(error, match=repr(KEY)):
        kv.push(KEY, value)
    assert_same_state(before, kv._tables.tables[KEY].state())   # no push, no sweep
    assert opt.num_update == 0


def test_r15_array_calls_on_a_table_key_are_refused_and_change_nothing() -> None:
    kv = store()
    kv.init("w", mx.nd.zeros((2, 2)))
    kv.lookup(KEY, ids(1, 2))
    before = kv._tables.tables[KEY].state()
    out = mx.nd.zeros((2, 2))
    calls: list[tuple[Callable[[], Any], type[KVStoreError]]] = [
        (lambda: kv.pull(KEY, out=out), UnsupportedError),
        (lambda: kv.pushpull(KEY, mx.nd.ones((2, 2)), out=out), UnsupportedError),
        (lambda: kv.init(KEY, TableSpec(dim=2)), KeyAlreadyInitializedError),
        (lambda: kv.init(KEY, mx.nd.ones((2, 2))), KeyAlreadyInitializedError),
        (lambda: kv.init("w", TableSpec(dim=2)), KeyAlreadyInitializedError),
        (lambda: kv.init(["x", KEY], [mx.nd.ones((2,))] * 2), KeyAlreadyInitializedError),
        (lambda: kv.push([KEY, KEY], [(ids(1), ones(1))] * 2), UnsupportedError),
        (lambda: kv.lookup("nope", ids(1)), KeyNotInitializedError),
        (lambda: kv.table_stats("w"), KeyNotInitializedError),
        (lambda: kv.row_sparse_pull(KEY, out, row_ids=ids(1)), ValueTypeError),
        (lambda: kv.row_sparse_pull(KEY, [mx.nd.sparse.zeros("row_sparse", (1, 3))],
                                    row_ids=[ids(1)]), ValueTypeError),
        (lambda: kv.row_sparse_pull(KEY, [mx.nd.sparse.zeros("row_sparse", (1, 2))],
                                    row_ids=[ids(1), ids(2)]), ShapeMismatchError),
    ]
    for call, error in calls:
        with pytest.raises(error):
            call()
        assert_same_state(before, kv._tables.tables[KEY].state())
    assert kv.pull("w").asnumpy().tolist() == [[0, 0], [0, 0]]


BAD_SPECS: list[Callable[[], Any]] = [
    lambda: TableSpec(dim=0), lambda: TableSpec(dim=2.5), lambda: TableSpec(dim=True),
    lambda: TableSpec(dim=2, dtype="int32"), lambda: TableSpec(dim=2, dtype="nonsense"),
    lambda: TableSpec(dim=2, seed=-1), lambda: TableSpec(dim=2, init="normal"),
    lambda: TableSpec(dim=2, admission="always"), lambda: TableSpec(dim=2, eviction="lru"),
    lambda: TableSpec(dim=2, eviction=(Capacity(1), Capacity(2))),
    lambda: TableSpec(dim=2, eviction=(TTL(steps=1), TTL(seconds=1))),
    lambda: TableSpec(dim=2, state_layout="columnwise"),
    lambda: TableSpec(dim=2, duplicates="max"), lambda: TableSpec(dim=2, birth="lookup"),
    lambda: TableSpec(dim=2, unknown="nan"), lambda: TableSpec(dim=2, sweep_rows=0),
    lambda: TableSpec(dim=2, reserve_rows=-1),
    lambda: Capacity(0), lambda: Capacity(10, "fifo"), lambda: Capacity(10, score=3),
    lambda: TTL(), lambda: TTL(steps=0), lambda: TTL(seconds=-1.0),
    lambda: TTL(seconds=float("inf")), lambda: CountAdmission(0),
    lambda: CountAdmission(2, counters=0), lambda: ProbabilityAdmission(1.5),
    lambda: ProbabilityAdmission(-0.1), lambda: ProbabilityAdmission(float("nan")),
    lambda: ProbabilityAdmission(0.5, per_step=1), lambda: Uniform(1.0, 0.0),
    lambda: Normal(0.0, -1.0), lambda: Constant(float("nan")), lambda: Constant("1"),
    lambda: TableSpec.from_json({"dim": 2, "init": {"type": "gamma"}}),
    lambda: TableSpec.from_json({"dim": 2, "surprise": 1}),
    lambda: TableSpec.from_json([2]),
    lambda: TableSpec(dim=2, eviction=Capacity(5, score=np.argsort)).to_json(),
]


@pytest.mark.parametrize("make", BAD_SPECS)
def test_r15_nonsense_policy_parameters_raise_table_spec_error(make: Callable[[], Any]) -> None:
    with pytest.raises(TableSpecError) as err:
        make()
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)
    assert "=" in str(err.value) or "spec" in str(err.value)


# ---- R16 state -------------------------------------------------------------------------
def _same_ops(t: DynamicTable, opt: Any) -> None:
    t.lookup(np.arange(-5, 5))
    t.push(np.arange(-3, 3), ones(6, v=0.5), optimizer=opt)
    t.sweep()


def test_r16_state_is_plain_arrays_and_json_and_restores_the_same_table(
        tmp_path: Any) -> None:
    t = _trained()
    arrays, meta = t.state()
    assert {"ids", "values", "count", "last_step", "age_seconds", "state0",
            "sightings"} <= set(arrays)
    assert all(isinstance(a, np.ndarray) and a.dtype != object for a in arrays.values())
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        loaded = {k: z[k] for k in z.files}
    meta2 = json.loads(json.dumps(meta))
    back = DynamicTable.from_state(t.spec, loaded, meta2, name=KEY, clock=Clock())
    assert_same_state(t.state(), back.state())
    # the restored table goes on exactly as the original
    opt_a, opt_b = (mx.optimizer.AdaGrad(learning_rate=0.1) for _ in range(2))
    for _ in range(2):
        _same_ops(t, opt_a)
        _same_ops(back, opt_b)
    assert_same_state(t.state(), back.state())


def test_r16_adam_steps_and_ages_survive_a_restore_on_another_clock() -> None:
    clock = Clock(1000.0)
    t = table(clock, eviction=TTL(seconds=15))
    opt = mx.optimizer.Adam()
    t.lookup(ids(1, 2))
    t.push(ids(1, 2), ones(2), optimizer=opt)
    t.push(ids(1), ones(1), optimizer=opt)
    clock.now = 1010.0
    arrays, meta = t.state()
    assert arrays["adam_t"].tolist() == [2, 1]
    other = Clock(5.0)
    back = DynamicTable.from_state(t.spec, arrays, meta, clock=other)
    assert back.state()[0]["age_seconds"].tolist() == [10.0, 10.0]
    other.now = 10.0
    assert back.sweep() == 0
    other.now = 10.5
    assert back.sweep() == 2
    back = DynamicTable.from_state(t.spec, arrays, meta, clock=other)
    t.push(ids(1), ones(1), optimizer=opt)
    back.push(ids(1), ones(1), optimizer=mx.optimizer.Adam())  # t=3 for row 1
    np.testing.assert_allclose(read(back, 1), read(t, 1), rtol=1e-6)


def test_r16_a_table_with_a_custom_score_has_a_state() -> None:
    spec = TableSpec(dim=2, eviction=Capacity(3, score=lambda m: m.count.astype(float)))
    t = DynamicTable(spec, name=KEY, clock=Clock())
    t.lookup(ids(1, 2))
    arrays, meta = t.state()
    assert meta["spec"]["eviction"] == [{"type": "capacity", "max_rows": 3,
                                         "policy": "custom"}]
    with pytest.raises(TableSpecError, match="custom"):
        TableSpec.from_json(json.loads(json.dumps(meta["spec"])))   # it cannot travel
    back = DynamicTable.from_state(spec, arrays, meta, name=KEY, clock=Clock())
    assert_same_state(t.state(), back.state())


def test_r16_from_state_refuses_what_state_did_not_write() -> None:
    t = _trained(20)
    arrays, meta = t.state()
    dup = dict(arrays, ids=np.concatenate([arrays["ids"][:1], arrays["ids"][:-1]]))
    bad = [(arrays, {}), (arrays, dict(meta, format="other")),
           ({k: v for k, v in arrays.items() if k != "values"}, meta),
           (dict(arrays, values=arrays["values"][:, :1]), meta), (dup, meta),
           ({k: v for k, v in arrays.items() if k != "state0"}, meta)]
    for a, m in bad:
        with pytest.raises(CheckpointError, match=repr(KEY)):
            DynamicTable.from_state(t.spec, a, m, name=KEY)
    with pytest.raises(CheckpointError, match="dim"):
        DynamicTable.from_state(TableSpec(dim=3), arrays, meta, name=KEY)


def test_r16_a_local_store_checkpoints_its_tables_but_no_states_file(tmp_path: Any) -> None:
    """A checkpoint holds every table with its rows' optimizer states; the optimizer-states
    file has no place for them, so save_optimizer_states refuses instead of dropping them."""
    kv = store()
    kv.set_optimizer(sgd())
    kv.lookup(KEY, ids(1, 5))
    kv.push(KEY, (ids(1, 5), ones(2)))
    with pytest.raises(UnsupportedError, match="table"):
        kv.save_optimizer_states(str(tmp_path / "states"))
    assert not (tmp_path / "states").exists()
    kv.save_checkpoint(str(tmp_path / "ckpt"))
    again = store()
    again.set_optimizer(sgd())
    again.load_checkpoint(str(tmp_path / "ckpt"))
    for a, b in zip(kv.lookup(KEY, ids(1, 5, 9), train=False),
                    again.lookup(KEY, ids(1, 5, 9), train=False)):
        np.testing.assert_array_equal(a, b)
    assert again.table_stats(KEY)["rows"] == 2


# ---- the spec cites these tests --------------------------------------------------------
def test_every_rule_of_the_spec_cites_tests_that_exist() -> None:
    """Each R1-R16 of docs/embeddings.md names a test file or ``test_rN_*`` tests that exist."""
    here = Path(__file__).resolve()
    spec = (here.parents[2] / "docs" / "embeddings.md").read_text()
    rules = re.findall(r"\*\*R(\d+)\.(.*?)(?=\n\*\*R\d+\.|\n## )", spec, flags=re.S)
    assert [int(n) for n, _ in rules] == list(range(1, 17))
    names = set(re.findall(r"^def (test_\w+)", here.read_text(), flags=re.M))
    for number, text in rules:
        cited = re.findall(r"\[`([^\]]+)`\]", " ".join(text.split()))
        assert cited, f"R{number} cites no test"
        for ref in re.findall(r"[\w:.*]+", " ".join(cited)):
            if ref.endswith(".py"):
                assert (here.parent / ref).exists(), f"R{number} cites {ref}: no such file"
            elif "test_r" in ref:
                prefix = ref.split("::")[-1].rstrip("*")
                assert prefix == f"test_r{number}_", f"R{number} cites {ref}"
                assert any(n.startswith(prefix) for n in names), f"no test {ref}"
