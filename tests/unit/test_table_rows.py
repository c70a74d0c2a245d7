"""Rules R1 and R3-R8 of docs/embeddings.md: IDs, and what reads and writes do to rows
(birth, unknown IDs, eval lookups, found marks, duplicates, pushes without a row), on a
:class:`DynamicTable` and, where a rule concerns the store, on a ``local`` store. R2 is in
test_table_init.py, R9-R11 in test_table_eviction.py, R12 in test_table_optim.py, R13-R16
in test_table_state.py; the last test here checks that the spec cites tests that exist.
Tables read a fake clock that moves only when a test moves it (``_table_helpers``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import TableIdError, ValueTypeError
from pskv.table import TTL, Capacity, Constant, CountAdmission, Normal, Uniform, initial_values

from _table_helpers import (EXTREME, KEY, Clock, assert_same_state, ids, ones, read, sgd,
                            store, table)


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
def test_r5_an_eval_lookup_changes_nothing_but_its_counters() -> None:
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
        {"lookups": 5, "misses": 3, "unknown_reads": 3}
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
        {"lookups": 3, "misses": 2, "unknown_reads": 2}


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


# ---- the spec cites these tests --------------------------------------------------------
def test_every_rule_of_the_spec_cites_tests_that_exist() -> None:
    """Each R1-R17 of docs/embeddings.md names a test file, or ``file.py::test_rN_*`` tests
    that exist in that file (the rules' tests are in several files)."""
    here = Path(__file__).resolve()
    spec = (here.parents[2] / "docs" / "embeddings.md").read_text()
    rules = re.findall(r"\*\*R(\d+)\.(.*?)(?=\n\*\*R\d+\.|\n## )", spec, flags=re.S)
    assert [int(n) for n, _ in rules] == list(range(1, 18))
    for number, text in rules:
        cited = re.findall(r"\[`([^\]]+)`\]", " ".join(text.split()))
        assert cited, f"R{number} cites no test"
        for ref in re.findall(r"[\w:.*]+", " ".join(cited)):
            file, _, name = ref.rpartition("::")
            if ref.endswith(".py"):
                assert (here.parent / ref).exists(), f"R{number} cites {ref}: no such file"
            elif re.match(r"test_r\d", name):
                assert name == f"test_r{number}_*", f"R{number} cites {ref}"
                assert file, f"R{number} cites {ref}: name its file (test_table_*.py::{name})"
                assert (here.parent / file).exists(), f"R{number} cites {ref}: no such file"
                names = re.findall(r"^def (test_\w+)", (here.parent / file).read_text(),
                                   flags=re.M)
                assert any(n.startswith(name[:-1]) for n in names), f"no test {ref}"
