"""A checkpoint of S servers restored onto S' servers, for every S, S' in {1, 2, 3}
(issue #32; docs/durability.md "Checkpoints", docs/embeddings.md D7).

One model of every kind of key a checkpoint holds: dense keys of several sizes (one kept
whole on one server, one exactly at ``bigarray_bound`` and two above it, split across the
servers unevenly), a row_sparse key (split by rows) and two dynamic table keys (one run
by the store's SGD with momentum, one by its own row-wise AdaGrad), whose rows grow by
training lookups (rows that are never pushed too) and pushes. A job of S servers trains
it, saves a checkpoint and goes on training: the reference. A second job of S' servers,
whose keys start from other values and whose optimizer is set with other
hyperparameters (the saved one must replace it), takes a junk step, loads the checkpoint
and must hold, bit for bit:

* every value the workers read (dense pulls, the row_sparse key, every table ID's row and
  whether it exists);
* what it saves at once: every dense value and optimizer state, every table row by ID
  (value, optimizer state, count, step of last use and of birth), each table's step and
  summed counters, and the optimizer with its update counts, as the checkpoint it loaded;
* after the same further steps, what the reference reads and saves: the optimizer state
  came back, not only the weights.

``dist_async`` (pushes ordered by barriers, so that both jobs apply them in one order)
and a local store on either side are checked the same way.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.kvstore._snapshot import Reader
from pskv.table import Normal, TableSpec, Uniform
from pskv.testing import InprocCluster

pytestmark = pytest.mark.timeout(60)

BOUND = 16           # bigarray_bound: keys of 16 elements or more are split across servers
DENSE = {"tiny": (3,), "edge": (BOUND,), "mid": (4, 5), "big": (7, 9), "wide": (5, 5)}
DTYPES = {"wide": np.float64}
FROZEN = ("frozen", (6, 3))    # never pushed before the checkpoint: it holds no state for it
SPARSE = {"rsp": (7, 3), "pair": (2, 4)}   # rows split: 7 over 1-3 servers, 2 over 1-2
TABLES = ("emb", "own", "half")
DIM = 3
SAVE_AT, STEPS = 3, 6          # save after 3 steps, then 3 more on both jobs
WAIT = 30.0                    # the most seconds a job's workers may run


# ---- the model and its training steps ------------------------------------------------------
def _optimizer(junk: bool = False) -> Any:
    """The store's optimizer, Adam: two moments per element and, for a dense key, its
    update count (the bias correction), so a count that did not come back shows. The
    restored job sets it ``junk``: the checkpoint's must replace it."""
    if junk:
        return mx.optimizer.Adam(learning_rate=0.5, beta1=0.5)
    return mx.optimizer.Adam(learning_rate=0.01)


def _table_spec(name: str) -> TableSpec:
    if name == "emb":                # the store's Adam: moments and a step per row
        return TableSpec(dim=DIM, init=Normal(0.0, 0.1), seed=5)
    if name == "own":                # its own AdaGrad, one accumulator per row
        return TableSpec(dim=DIM, init=Uniform(-0.1, 0.1), seed=6, state_layout="rowwise",
                         optimizer=mx.optimizer.AdaGrad(learning_rate=0.2))
    return TableSpec(dim=DIM, init=Normal(0.0, 0.5), seed=7, dtype="bfloat16",
                     optimizer=mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([11, *seed])


def _init(kv: Any, junk: bool = False) -> None:
    """Every key; ``junk``: other initial values (the checkpoint's must replace them)."""
    for i, (k, shape) in enumerate(DENSE.items()):
        dtype = DTYPES.get(k, np.float32)
        value = _rng(99 if junk else 0, i).standard_normal(shape).astype(dtype)
        kv.init(k, mx.nd.array(value, dtype=dtype))
    kv.init(FROZEN[0], mx.nd.array(_rng(99 if junk else 5).standard_normal(FROZEN[1])
                                   .astype(np.float32)))
    for i, (k, shape) in enumerate(SPARSE.items()):
        value = _rng(99 if junk else 1, i).standard_normal(shape).astype(np.float32)
        kv.init(k, mx.nd.array(value).tostype("row_sparse"))
    for t in TABLES:
        kv.init(t, _table_spec(t))


def _dense_grad(i: int, step: int, rank: int, shape: tuple[int, ...],
                dtype: Any = np.float32) -> np.ndarray:
    return _rng(2, i, step, rank).standard_normal(shape).astype(dtype)


def _sparse_grad(i: int, step: int, rank: int, shape: tuple[int, ...]) -> tuple[Any, Any]:
    rng = _rng(3, i, step, rank)
    n = min(3, shape[0] - 1)
    rows = np.sort(rng.choice(shape[0], n, replace=False)).astype(np.int64)
    return rows, rng.standard_normal((n,) + shape[1:]).astype(np.float32)


def _table_batch(t: int, step: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(IDs looked up, IDs pushed, their gradients): repeats, IDs shared by both workers,
    huge and negative ones, new ones every step (the table grows), and IDs only looked up
    (rows born by a lookup, never pushed: an optimizer state of zeros)."""
    rng = _rng(4, t, step, rank)
    pushed = np.concatenate([rng.integers(-30, 30, 6), [1000 * step + rank, 2**62 - step,
                                                        -(2**63) + rank, 3, 3]])
    looked = np.concatenate([pushed, [5000 + 10 * step + rank, -7000 - step]])
    grads = rng.standard_normal((pushed.size, DIM)).astype(np.float32)
    return looked.astype(np.int64), pushed.astype(np.int64), grads


#: every ID the jobs may hold, and some they never do
UNIVERSE = np.unique(np.concatenate(
    [_table_batch(t, s, r)[0] for t in range(len(TABLES)) for s in range(STEPS + 1)
     for r in (0, 1)] + [np.arange(-40, 40), np.array([123456789, -(2**62)])]).astype(np.int64))


def _push_all(kv: Any, step: int, ranks: tuple[int, ...]) -> None:
    """One step's lookups and pushes of the workers ``ranks`` (a local store pushes what
    a dist_sync round of both workers applies: their gradients summed, table pushes
    concatenated in worker order, docs/embeddings.md D3)."""
    for i, (k, shape) in enumerate(DENSE.items()):
        dtype = DTYPES.get(k, np.float32)
        grads = [_dense_grad(i, step, r, shape, dtype) for r in ranks]
        kv.push(k, mx.nd.array(grads[0] if len(grads) == 1 else np.add(*grads), dtype=dtype))
    for i, (k, shape) in enumerate(SPARSE.items()):
        total = np.zeros(shape, np.float32)
        touched = np.zeros(shape[0], bool)
        for r in ranks:
            rows, data = _sparse_grad(i, step, r, shape)
            total[rows] += data
            touched[rows] = True
        rows = np.flatnonzero(touched)
        kv.push(k, mx.nd.sparse.row_sparse_array((total[rows], rows), shape=shape))
    for t, name in enumerate(TABLES):
        batches = [_table_batch(t, step, r) for r in ranks]
        for looked, _ids, _grads in batches:
            kv.lookup(name, looked)
        kv.push(name, (np.concatenate([b[1] for b in batches]),
                       np.concatenate([b[2] for b in batches])))


def _train(kv: Any, first: int, last: int, frozen: bool = False) -> None:
    """Steps ``first`` to ``last - 1`` on any store (``frozen``: the key FROZEN too).
    dist_async: worker 0 pushes, then worker 1, with a barrier after each (every push
    applied before anyone leaves it), so that every job applies them in the same order."""
    def push(ranks: tuple[int, ...]) -> None:
        _push_all(kv, step, ranks)
        if frozen:
            kv.push(FROZEN[0], mx.nd.ones(FROZEN[1]) * len(ranks))

    for step in range(first, last):
        if kv.type == "local":
            push((0, 1))
        elif kv.type == "dist_sync":
            push((kv.rank,))
        else:
            for turn in range(kv.num_workers):
                if kv.rank == turn:
                    push((kv.rank,))
                kv.barrier()
        for k in DENSE:
            kv.pull(k)


def _observe(kv: Any) -> dict[str, np.ndarray]:
    """What a worker reads of every key: dense values, the row_sparse key's rows, every
    table ID's row and whether the table holds it (an eval lookup: it inserts nothing)."""
    got = {k: kv.pull(k).asnumpy() for k in (*DENSE, FROZEN[0])}
    for k, shape in SPARSE.items():
        out = mx.nd.zeros(shape)
        kv.pull(k, out=out)
        got[k] = out.asnumpy()
    for t in TABLES:     # a local store reads as often as the two workers do (counters)
        for _reader in range(2 if kv.type == "local" else 1):
            got[t], got[f"{t} found"] = kv.lookup(t, UNIVERSE, train=False)
    if kv.type != "local":
        kv.barrier()          # no worker reads after another's next push
    return got


# ---- what a checkpoint holds, whatever number of shards --------------------------------------
def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, (tuple, list)):
        return [x for node in tree for x in _leaves(node)]
    if isinstance(tree, mx.nd.NDArray):
        return [tree.asnumpy()]
    return [tree]


def contents(path: str) -> dict[str, Any]:
    """Every key of the checkpoint in ``path`` joined whole: dense values and optimizer
    states, each table's rows sorted by ID (every array but the ages, which move with
    the clock), its step and its counters summed over the shards, and the optimizer spec
    with its update counts."""
    reader = Reader(path)
    try:
        out: dict[str, Any] = {}
        for key in reader.parts:
            meta = reader.key_meta(key)
            if meta["stype"] == "table":
                parts = reader.table_parts(key)
                steps = {int(m["step"]) for _i, _a, m in parts}
                assert len(steps) == 1, f"{key}: its shards are at steps {steps}"
                arrays = {n: np.concatenate([a[n] for _i, a, _m in parts])
                          for n in parts[0][1] if n not in ("age_seconds", "sightings")}
                order = np.argsort(arrays["ids"], kind="stable")
                out[key] = {n: a[order] for n, a in arrays.items()}
                counters: dict[str, int] = {}
                for _i, _a, m in parts:
                    for c, v in m["counters"].items():
                        counters[c] = counters.get(c, 0) + int(v)
                out[key]["step"], out[key]["counters"] = steps.pop(), counters
                continue
            shape = tuple(meta["shape"])
            units = shape[0] if meta["stype"] == "row_sparse" else int(np.prod(shape))
            out[key] = reader.value(key, 0, units, shape)
            out[f"{key} state"] = _leaves(reader.state(key, 0, units, shape))
        out["optimizer"] = reader.optimizer()
        return out
    finally:
        reader.close()


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """``got`` equals ``want`` bit for bit: arrays of the same dtype, shape and bytes."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), \
            f"{where}: keys {sorted(got, key=str)} != {sorted(want, key=str)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        got = np.asarray(got)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), \
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        if got.tobytes() != want.tobytes():
            bad = np.argwhere(got.reshape(want.shape) != want)
            raise AssertionError(f"{where}: differs at {bad[:5].tolist()} "
                                 f"({bad.shape[0]} places): {got.ravel()[:8]} != "
                                 f"{want.ravel()[:8]}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ---- the two jobs ---------------------------------------------------------------------------
def _source(ck: str, end: str) -> Any:
    """Train, save ``ck``, train on: the reference job's steps."""
    def job(kv: Any) -> Any:
        _init(kv)
        kv.set_optimizer(_optimizer())
        _train(kv, 0, SAVE_AT)
        kv.save_checkpoint(ck)
        saved = _observe(kv)
        _train(kv, SAVE_AT, STEPS)
        after = _observe(kv)
        kv.save_checkpoint(end)
        return saved, after
    return job


def _target(ck: str, again: str, end: str) -> Any:
    """Start elsewhere, load ``ck``, save it again at once, train the same steps on."""
    def job(kv: Any) -> Any:
        _init(kv, junk=True)
        kv.set_optimizer(_optimizer(junk=True))
        _train(kv, STEPS, STEPS + 1, frozen=True)   # rows, states, counts it lacks
        kv.load_checkpoint(ck)
        kv.save_checkpoint(again)
        loaded = _observe(kv)
        _train(kv, SAVE_AT, STEPS)
        after = _observe(kv)
        kv.save_checkpoint(end)
        return loaded, after
    return job


def _run(job: Any, servers: int | None, store_type: str, bound: int = BOUND) -> list[Any]:
    """``job`` on a local store (``servers`` None) or on every worker of a cluster of
    ``servers`` servers and 2 workers; its result per worker."""
    if servers is None:
        return [job(mx.kv.create("local"))]
    with InprocCluster(num_workers=2, num_servers=servers, bigarray_bound=bound) as cluster:
        results = cluster.run(job, store_type, timeout=WAIT)
    for got in results.values():
        if isinstance(got, BaseException):
            raise got
    assert sorted(results) == [0, 1]
    return [results[0], results[1]]


def _check(tmp_path: Any, source: tuple[str, int | None], target: tuple[str, int | None],
           bound2: int = BOUND) -> None:
    """``source`` (store type, servers) trains and saves; ``target`` (its
    ``bigarray_bound`` ``bound2``) loads, and both train on."""
    ck, ref_end = str(tmp_path / "ck"), str(tmp_path / "ref-end")
    again, end = str(tmp_path / "again"), str(tmp_path / "end")
    ref = _run(_source(ck, ref_end), source[1], source[0])
    got = _run(_target(ck, again, end), target[1], target[0], bound2)
    saved, after = ref[0]
    for rank, (r_saved, r_after) in enumerate(ref):    # every worker read the same
        assert_same(r_saved, saved, f"reference worker {rank} at the checkpoint")
        assert_same(r_after, after, f"reference worker {rank} at the end")
    assert saved["emb found"].sum() > 40 and not saved["emb found"].all()   # it grew
    want = contents(ck)
    assert want["emb"]["ids"].size == saved["emb found"].sum()
    assert want["own"]["state0"].shape == (want["own"]["ids"].size, 1)     # row-wise
    assert "adam_t" in want["emb"] and want["half"]["values"].dtype == np.uint16
    assert want["frozen state"] == [None] and len(want["big state"]) == 2   # Adam's moments
    if source[1] is not None:
        reader = Reader(ck)
        assert len(reader.parts["big"]) == source[1]      # split across the servers
        reader.close()
    for rank, (loaded, resumed) in enumerate(got):
        assert_same(loaded, saved, f"worker {rank} after load_checkpoint")
        assert_same(resumed, after, f"worker {rank} after {STEPS - SAVE_AT} more steps")
    assert_same(contents(again), want, "the restored job's checkpoint")
    assert_same(contents(end), contents(ref_end), "the last checkpoints")


SERVER_COUNTS = [(s, s2) for s in (1, 2, 3) for s2 in (1, 2, 3)]


@pytest.mark.parametrize(("servers", "servers2"), SERVER_COUNTS,
                         ids=[f"{s}to{s2}" for s, s2 in SERVER_COUNTS])
def test_sync_checkpoint_restores_onto_any_server_count(tmp_path: Any, servers: int,
                                                        servers2: int) -> None:
    _check(tmp_path, ("dist_sync", servers), ("dist_sync", servers2))


@pytest.mark.parametrize(("servers", "servers2"), [(2, 3), (3, 1)])
def test_async_checkpoint_restores_onto_another_server_count(tmp_path: Any, servers: int,
                                                             servers2: int) -> None:
    _check(tmp_path, ("dist_async", servers), ("dist_async", servers2))


@pytest.mark.parametrize(("servers2", "bound2"), [(2, 10**6), (3, 2)],
                         ids=["2to2-nothing-split", "2to3-everything-split"])
def test_sync_checkpoint_restores_onto_another_placement(tmp_path: Any, servers2: int,
                                                         bound2: int) -> None:
    """Another bigarray_bound on the second job: no dense key split over its servers, or
    every one of them, a key of 3 elements in 3 parts of 1."""
    _check(tmp_path, ("dist_sync", 2), ("dist_sync", servers2), bound2=bound2)


def test_local_store_checkpoint_restores_onto_three_servers(tmp_path: Any) -> None:
    _check(tmp_path, ("local", None), ("dist_sync", 3))


def test_three_servers_checkpoint_restores_onto_a_local_store(tmp_path: Any) -> None:
    _check(tmp_path, ("dist_sync", 3), ("local", None))


def test_a_checkpoint_without_an_optimizer_leaves_no_state_of_the_loading_job(
        tmp_path: Any) -> None:
    """A checkpoint of a job without an optimizer (its pushes assign the sums) loaded by a
    job that has one: whether that job trained before the load or not, it holds and does
    the same afterwards, its optimizer starting afresh (2 servers onto 3 and onto 1;
    tests/unit/test_optimizer_states.py has the cause)."""
    ck = str(tmp_path / "ck")

    def source(kv: Any) -> None:
        _init(kv)
        _train(kv, 0, SAVE_AT)
        kv.save_checkpoint(ck)

    def target(name: str, train_first: bool) -> Any:
        def job(kv: Any) -> Any:
            _init(kv, junk=True)
            kv.set_optimizer(_optimizer())
            if train_first:
                _train(kv, STEPS, STEPS + 1, frozen=True)
            kv.load_checkpoint(ck)
            kv.save_checkpoint(str(tmp_path / f"{name}-again"))
            loaded = _observe(kv)
            _train(kv, SAVE_AT, STEPS)
            after = _observe(kv)
            kv.save_checkpoint(str(tmp_path / f"{name}-end"))
            return loaded, after
        return job

    _run(source, 2, "dist_sync")
    want = _run(target("fresh", False), 1, "dist_sync")[0]
    got = _run(target("trained", True), 3, "dist_sync")
    for rank, (loaded, after) in enumerate(got):
        assert_same(loaded, want[0], f"worker {rank} after load_checkpoint")
        assert_same(after, want[1], f"worker {rank} after {STEPS - SAVE_AT} more steps")
    for when in ("again", "end"):
        assert_same(contents(str(tmp_path / f"trained-{when}")),
                    contents(str(tmp_path / f"fresh-{when}")), when)
    assert contents(str(tmp_path / "fresh-again"))["big state"] == [None]
