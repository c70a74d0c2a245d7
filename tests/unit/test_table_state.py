"""Rules R13-R16 of docs/embeddings.md: routing IDs to shards, counters, bad input that
changes nothing, and a table's state (checkpoints, resharding), on a :class:`DynamicTable`
and on a ``local`` store. Tables read a fake clock that moves only when a test moves it
(``_table_helpers``).
"""
from __future__ import annotations

import io
import json
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import (CheckpointError, ConfigError, KeyAlreadyInitializedError,
                         KeyNotInitializedError, KVStoreError, ShapeMismatchError,
                         TableIdError, TableSpecError, UnsupportedError, ValueTypeError)
from pskv.table import (TTL, Capacity, Constant, CountAdmission, DynamicTable, Normal,
                        ProbabilityAdmission, TableSpec, Uniform, shard_of)

from _table_helpers import (EXTREME, KEY, Clock, assert_same_state, ids, ones, read, sgd,
                            store, table)


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
            "pushed_rows": 3, "evicted_score": 0, "unknown_reads": 6}
    table = kv._tables.tables[KEY]
    got = kv.table_stats(KEY)
    # bytes: the arrays in use, 3 slots used (one freed by the eviction): 2 values of
    # float32 and an SGD with no state, an int64 ID, 3 metadata words and a flag per slot
    assert got.pop("bytes") == sum(table.nbytes().values()) >= 3 * (2 * 4 + 8 + 3 * 8 + 1)
    assert got == want
    got = table.stats()
    got.pop("bytes")
    assert got == want


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


def test_apply_changes_is_the_inverse_of_changes() -> None:
    """Issue #30: what a step changed (``changes``: rows whole, evicted IDs, step,
    counters, the row optimizer) applied to a copy (``apply_changes``) makes the copy hold
    the same rows, states included; a record of the wrong width changes nothing."""
    import pskv as mx
    from pskv.errors import ShapeMismatchError
    from pskv.table import DynamicTable, TableSpec

    spec = TableSpec(dim=4, seed=3)
    a, b = DynamicTable(spec, name="t"), DynamicTable(spec, name="t")
    opt = mx.optimizer.AdaGrad(learning_rate=0.1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(0, 50, 20)
        a.lookup(ids)
        a.push(ids, rng.standard_normal((20, 4)).astype(np.float32), optimizer=opt)
        b.apply_changes(*a.changes(ids, np.empty(0, np.int64)))
    every = np.arange(50)
    va, fa = a.lookup(every, train=False)
    vb, fb = b.lookup(every, train=False)
    np.testing.assert_array_equal(fa, fb)
    np.testing.assert_array_equal(va, vb)
    assert a.step == b.step and a.meta()["rowopt"] == b.meta()["rowopt"]
    arrays, meta = a.state()
    brr, bmeta = b.state()
    oa, ob = np.argsort(arrays["ids"]), np.argsort(brr["ids"])
    np.testing.assert_array_equal(arrays["ids"][oa], brr["ids"][ob])
    np.testing.assert_array_equal(arrays["state0"][oa], brr["state0"][ob])   # AdaGrad's
    before = b.state()[0]["values"].copy()
    bad, m = a.changes(np.arange(5), np.empty(0, np.int64))
    bad["values"] = bad["values"][:, :3]
    with pytest.raises(ShapeMismatchError, match="does not fit dim 4"):
        b.apply_changes(bad, m)
    np.testing.assert_array_equal(b.state()[0]["values"], before)
