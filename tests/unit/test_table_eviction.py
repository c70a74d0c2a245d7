"""Rules R9-R11 of docs/embeddings.md: admission, eviction and steps, on a
:class:`DynamicTable` and on a ``local`` store. Tables read a fake clock that moves only
when a test moves it (``_table_helpers``).
"""
from __future__ import annotations

import numpy as np
import pytest

from pskv.errors import ShapeMismatchError
from pskv.table import (TTL, Always, Capacity, Constant, CountAdmission, DynamicTable,
                        ProbabilityAdmission, ReadOnly, RowMeta)

from _table_helpers import KEY, Clock, assert_same_state, ids, ones, read, sgd, store, table


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
