"""Dynamic tables on the servers (docs/embeddings.md, "On the servers"): thread clusters.

Each test runs 2 workers and 1-2 servers as threads (``ThreadCluster``) and checks a table
key against one local store fed the same pushes: ``dist_sync`` rounds sum both workers'
``(ids, grads)`` in one step (the duplicate rule R7 sums them); ``dist_async`` applies each
push on arrival. Lookups, eval lookups, counters, the row optimizer, eviction sweeps and
bad input (an error on the worker, nothing changed) are checked here; checkpoints and
replicas with real processes are in ``test_dist_tables_durable.py``.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command
from pskv._ps.ops import Op, command
from pskv.errors import (KeyAlreadyInitializedError, KVStoreError, LimitError,
                         ShapeMismatchError, TableIdError, UnsupportedError)
from pskv.table import Capacity, CountAdmission, Normal, TableSpec, shard_of

pytestmark = pytest.mark.timeout(90)

DIM = 4


def ok(results: dict[int, Any]) -> dict[int, Any]:
    """Results by rank, raising the first worker exception."""
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


def spec(**kw: Any) -> TableSpec:
    return TableSpec(dim=DIM, init=Normal(0.0, 0.1), seed=11, **kw)


def batches(rank: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each worker's pushes: IDs with repeats, huge and negative ones, shared ones."""
    rng = np.random.default_rng(100 + rank)
    out = []
    for _ in range(steps):
        ids = np.concatenate([rng.integers(-50, 50, 12), [2**62 + rank, -(2**63), 7, 7]])
        out.append((ids.astype(np.int64), rng.standard_normal((ids.size, DIM)).astype(np.float32)))
    return out


ALL_IDS = np.concatenate([b[0] for r in (0, 1) for b in batches(r, 4)] + [np.arange(-60, 60)])


def local_reference(sync: bool, opt: Any, steps: int = 4, **kw: Any) -> Any:
    """One local store fed the same pushes: per step both workers' pushes together (sync)
    or one after the other (async: the order does not matter for SGD without state)."""
    kv = mx.kv.create("local")
    kv.init("emb", spec(**kw))
    if opt is not None:
        kv.set_optimizer(opt)
    b0, b1 = batches(0, steps), batches(1, steps)
    for (i0, g0), (i1, g1) in zip(b0, b1):
        kv.lookup("emb", i0)
        kv.lookup("emb", i1)
        if sync:
            kv.push("emb", (np.concatenate([i0, i1]), np.concatenate([g0, g1])))
        else:
            kv.push("emb", (i0, g0))
            kv.push("emb", (i1, g1))
    return kv


def drive(kv: Any, opt: Any, steps: int = 4, **kw: Any) -> tuple[np.ndarray, dict[str, int]]:
    kv.init("emb", spec(**kw))
    if opt is not None:
        kv.set_optimizer(opt)
    for ids, grads in batches(kv.rank, steps):
        kv.lookup("emb", ids)
        kv.push("emb", (ids, grads))
    kv.barrier()
    values, _found = kv.lookup("emb", ALL_IDS, train=False)
    kv.barrier()
    return values, kv.table_stats("emb")


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_local_store(servers: int, run_threads: Any) -> None:
    """dist_sync: a round sums both workers' (ids, grads), one AdaGrad step per round."""
    opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.1)  # noqa: E731
    res = ok(run_threads(lambda kv: drive(kv, opt()), num_servers=servers))
    ref = local_reference(True, opt())
    want, _ = ref.lookup("emb", ALL_IDS, train=False)
    for values, stats in res.values():
        np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-7)
        ref_stats = ref.table_stats("emb")
        for k in ("rows", "inserts", "pushed_rows", "dropped_pushes"):
            assert stats[k] == ref_stats[k], k
        assert stats["step"] == 4


@pytest.mark.parametrize("servers", [1, 2])
def test_async_equals_local_store(servers: int, run_threads: Any) -> None:
    """dist_async: each push applied on arrival (plain SGD: the order does not matter)."""
    opt = lambda: mx.optimizer.SGD(learning_rate=0.1)  # noqa: E731
    res = ok(run_threads(lambda kv: drive(kv, opt()), num_servers=servers,
                         store_type="dist_async"))
    ref = local_reference(False, opt())
    want, _ = ref.lookup("emb", ALL_IDS, train=False)
    for values, stats in res.values():
        np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-6)
        assert stats["rows"] == ref.table_stats("emb")["rows"]
        assert stats["step"] == 8


def test_rows_live_on_the_server_shard_of_routes_them_to(run_threads: Any) -> None:
    """R13 on the servers: each server holds exactly the IDs shard_of gives it."""
    ids = np.arange(-40, 40, dtype=np.int64)

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.lookup("emb", ids)
        kv.barrier()
        body = command(Op.TABLE_STATS, key=kv._tables.pskeys["emb"])
        with kv._lock:
            tss = [kv._kv.request(s, Command.COMMAND, body=body) for s in (0, 1)]
            per = [m.body["stats"]["rows"] for m, _a in kv._wait_all(tss, "stats")]
        return per, kv.table_stats("emb")

    owners = shard_of(ids, 2)
    for per, total in ok(run_threads(fn, num_servers=2)).values():
        assert per == [int(np.sum(owners == 0)), int(np.sum(owners == 1))]
        assert 0 < per[0] < 80
        assert total["rows"] == 80 and total["inserts"] == 80 and total["lookups"] == 160


def test_eval_lookups_never_insert_and_found_mask(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        ids = np.array([[5, -9], [2**40, 5]], np.int64)
        v0, f0 = kv.lookup("emb", ids, train=False)
        kv.barrier()
        s0 = kv.table_stats("emb")
        kv.barrier()
        if kv.rank == 0:
            kv.lookup("emb", np.array([5]))
        kv.barrier()
        v1, f1 = kv.lookup("emb", ids, train=False)
        kv.barrier()
        return v0, f0, s0, v1, f1, kv.table_stats("emb")

    ref = mx.kv.create("local")
    ref.init("emb", spec())
    want, _ = ref.lookup("emb", np.array([[5, -9], [2**40, 5]]), train=False)
    for v0, f0, s0, v1, f1, s1 in ok(run_threads(fn, num_servers=2)).values():
        assert v0.shape == (2, 2, DIM) and not f0.any()
        np.testing.assert_array_equal(v0, want)      # R4: the initial value, R2: same bits
        assert s0["rows"] == 0 and s0["misses"] == 8 and s0["inserts"] == 0
        assert f1.tolist() == [[True, False], [False, True]]
        np.testing.assert_array_equal(v1, want)
        assert s1["rows"] == 1


def test_eviction_sweeps_run_on_the_servers(run_threads: Any) -> None:
    """Capacity with LRU: each server sweeps after an applied push (full sweeps here)."""
    def fn(kv: Any) -> Any:
        kv.init("emb", spec(eviction=Capacity(10, "lru"), sweep_rows=10**6))
        for step in range(5):
            ids = np.arange(step * 20, step * 20 + 20, dtype=np.int64)
            kv.lookup("emb", ids)
            kv.push("emb", (ids, np.ones((20, DIM), np.float32)))
        kv.lookup("emb", ids[:1], train=False)     # after the last round (dist_sync)
        kv.barrier()
        return kv.table_stats("emb")

    for stats in ok(run_threads(fn, num_servers=2)).values():
        assert stats["rows"] <= 10            # the whole table: 5 per server after a sweep
        assert stats["evictions"] == stats["inserts"] - stats["rows"] > 0


def test_admission_counts_sightings_on_the_server(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("emb", spec(admission=CountAdmission(2)))
        kv.lookup("emb", np.array([1, 2, 3]))
        kv.barrier()
        return kv.table_stats("emb")

    for stats in ok(run_threads(fn, num_servers=2)).values():
        assert stats["rows"] == 3 and stats["refusals"] >= 3    # the second worker admits


def test_bad_input_raises_on_the_worker_and_changes_nothing(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.init("w", np.zeros((2, 2), np.float32))
        kv.lookup("emb", np.array([1, 2, 3]))
        kv.barrier()
        before = kv.table_stats("emb")
        errors = []
        for call in (lambda: kv.push("emb", (np.array([1.0, 2.0]), np.ones((2, DIM)))),
                     lambda: kv.push("emb", (np.array([1, 2]), np.ones((2, DIM + 1)))),
                     lambda: kv.push("emb", (np.array([1, 2]), np.ones((3, DIM)))),
                     lambda: kv.push("emb", (np.array([1, 2]), [[1, 2, 3, 4], [1]])),
                     lambda: kv.push("emb", np.ones((2, DIM))),
                     lambda: kv.lookup("emb", np.array([0.5])),
                     lambda: kv.lookup("emb", np.array(["a"])),
                     lambda: kv.pull("emb", out=np.zeros((1, DIM))),
                     lambda: kv.lookup("w", np.array([1])),
                     lambda: kv.init("emb", spec()),
                     lambda: kv.init("emb", np.zeros(3))):
            with pytest.raises(KVStoreError) as info:
                call()
            errors.append(type(info.value))
        kv.barrier()
        return errors, before, kv.table_stats("emb")

    for errors, before, after in ok(run_threads(fn, num_servers=2)).values():
        assert errors[:2] == [TableIdError, ShapeMismatchError]
        assert errors[5] is TableIdError and errors[7] is UnsupportedError
        assert KeyAlreadyInitializedError in errors[9:]
        assert before == after


def raw(kv: Any, server: int, body: dict[str, Any], arrays: list[np.ndarray],
        cmd: Command = Command.COMMAND, keys: tuple[int, ...] = ()) -> BaseException | None:
    """Send one hand-made request (no worker-side checks); the error it got, if any."""
    with kv._lock:
        ts = kv._kv.request(server, cmd, keys, body, arrays)
        try:
            kv._wait_all([ts], "a hand-made request")
        except KVStoreError as err:
            return err
    return None


def test_a_push_of_ids_a_lookup_found_skips_no_foreign_id() -> None:
    """The server hashes only the pushed IDs its lookups did not find a row of (rows held
    are its own): a push of looked-up IDs with one foreign ID appended, or in place of an
    unknown one, is still refused whole."""
    from pskv.kvstore.engine._tables import check_table_push, served_table
    table = served_table(TableSpec(dim=2), "emb", (0, 2))
    pool = np.arange(-50, 50, dtype=np.int64)
    mine, theirs = pool[shard_of(pool, 2) == 0], pool[shard_of(pool, 2) == 1]
    table.lookup(mine[:6])
    table.lookup(mine[6:9], train=False)                 # not found: no row
    grads = lambda n: np.zeros((n, 2), np.float32)  # noqa: E731
    check_table_push(table, "t", [mine[:6], grads(6)])
    check_table_push(table, "t", [mine[:9], grads(9)])
    table.lookup(theirs[:3], train=False)               # a lookup of foreign IDs: no row
    for bad in (np.append(mine[:6], theirs[0]), np.append(mine[:6], theirs[:3]),
                np.concatenate([mine[:6], theirs[:3]])):
        with pytest.raises(ShapeMismatchError, match="routes elsewhere"):
            check_table_push(table, "t", [bad, grads(bad.size)])
    with pytest.raises(ShapeMismatchError, match="routes elsewhere"):
        check_table_push(table, "t", [theirs[:3], grads(3)])


def test_server_validates_every_table_message(run_threads: Any) -> None:
    """Messages a buggy or hostile worker could send: error replies, nothing changed, and
    the server keeps serving."""
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.lookup("emb", np.array([1, 2, 3]))
        kv.barrier()
        before = kv.table_stats("emb")
        pk = kv._tables.pskeys["emb"]
        wrong = np.array([i for i in range(100) if shard_of(np.array([i]), 2)[0] == 1][:2])
        got = []
        if kv.rank == 0:
            bad_lookups = [
                ({"key": pk, "train": True}, [np.array([1.5])]),       # float IDs
                ({"key": pk, "train": "yes"}, [np.array([1])]),        # train not a bool
                ({"key": pk, "train": True}, [np.ones((2, 2), np.int64)]),   # 2-d
                ({"key": pk + 1, "train": True}, [np.array([1])]),     # no such key
                ({"key": pk, "train": True}, [wrong]),                 # IDs of server 1
                ({"key": pk, "train": True}, []),                       # no IDs
            ]
            for body, arrays in bad_lookups:
                got.append(raw(kv, 0, command(Op.LOOKUP, **body), arrays))
            got.append(raw(kv, 0, command(Op.TABLE_STATS, key="x"), []))
            for arrays in ([wrong, np.ones((2, DIM), np.float32)],            # misrouted
                           [np.array([1, 2]), np.ones((3, DIM), np.float32)],  # count
                           [np.array([1, 2]), np.ones((2, DIM + 2), np.float32)],  # dim
                           [np.array([0.5, 1]), np.ones((2, DIM), np.float32)],   # dtype
                           [np.array([1, 2])]):                                 # no grads
                kv._kv.push(0, Command.PUSH, [pk], {"kinds": "t"}, arrays)
                with kv._lock:
                    try:
                        kv._kv.flush()
                        got.append(None)
                    except KVStoreError as err:
                        got.append(err)
            got.append(raw(kv, 0, {"entries": [{"key": "t2", "shape": [0, 3], "stype": "table",
                                                "table": {"dim": -1}, "shard": [0, 2]}]},
                           [np.zeros((0, 3), np.float32)], Command.INIT, (12345,)))
            got.append(raw(kv, 0, {"entries": [{
                "key": "t3", "shape": [0, 2**20], "stype": "table", "shard": [0, 2],
                "table": {"dim": 2**20, "reserve_rows": 2**40}}]},
                [np.zeros((0, 2**20), np.float32)], Command.INIT, (12346,)))
        kv.barrier()
        return got, before, kv.table_stats("emb")

    res = ok(run_threads(fn, num_servers=2))
    got, before, after = res[0]
    assert len(got) == 14 and all(isinstance(e, KVStoreError) for e in got), got
    # refused before it allocates: the shard's bytes over the per-key budget (docs/security.md)
    assert isinstance(got[-1], LimitError) and "PSKV_MAX_KEY_BYTES" in str(got[-1]), got[-1]
    assert before == after == res[1][2]


def test_set_optimizer_a_table_cannot_run_is_refused(run_threads: Any) -> None:
    """set_optimizer checks the row optimizer of every table key on the servers: an
    optimizer a table cannot run (SGD on a row-wise layout) raises on every worker."""
    def fn(kv: Any) -> Any:
        kv.init("emb", spec(state_layout="rowwise"))
        with pytest.raises(UnsupportedError, match="rowwise"):
            kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
        with pytest.raises(UnsupportedError, match="wd"):
            kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1, wd=0.1))
        kv.lookup("emb", np.array([1]))
        kv.push("emb", (np.array([1]), np.ones((1, DIM), np.float32)))
        return kv.lookup("emb", np.array([1]))[0]

    ref = mx.kv.create("local")
    ref.init("emb", spec(state_layout="rowwise"))
    ref.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    ref.lookup("emb", np.array([1]))
    ref.push("emb", (np.array([1]), np.full((1, DIM), 2.0, np.float32)))
    want = ref.lookup("emb", np.array([1]))[0]
    for got in ok(run_threads(fn, num_servers=1)).values():
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_row_sparse_pull_of_a_table_key(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        out = mx.nd.sparse.zeros("row_sparse", (1, DIM))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([9, -4, 9], dtype="int64"))
        return out.indices.asnumpy().tolist(), out.data.asnumpy()

    ref = mx.kv.create("local")
    ref.init("emb", spec())
    want, _ = ref.lookup("emb", np.array([-4, 9]))
    for idx, data in ok(run_threads(fn, num_servers=2)).values():
        assert idx == [-4, 9]
        np.testing.assert_array_equal(data, want)


def test_lookup_after_push_reads_its_round(run_threads: Any) -> None:
    """dist_sync: a lookup after this worker's push waits for that push's round."""
    barrier = threading.Barrier(2)

    def fn(kv: Any) -> Any:
        kv.init("emb", TableSpec(dim=1))
        kv.lookup("emb", np.array([3]))
        barrier.wait()
        kv.push("emb", (np.array([3]), np.full((1, 1), 1.0 + kv.rank, np.float32)))
        return kv.lookup("emb", np.array([3]))[0].tolist()

    for got in ok(run_threads(fn, num_servers=2)).values():
        assert got == [[3.0]]             # no optimizer: assign the round's sum


def test_checkpoint_restores_onto_another_server_count(run_threads: Any, tmp_path: Any) -> None:
    """Rows are saved by ID: a checkpoint of 2 servers loads onto 3 and onto 1 (each keeps
    the IDs shard_of gives it), with the row optimizer's state and the counters."""
    path = str(tmp_path / "ckpt")
    opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.1)  # noqa: E731

    def save(kv: Any) -> Any:
        values, stats = drive(kv, opt())
        kv.save_checkpoint(path)
        return values, stats

    saved = ok(run_threads(save, num_servers=2))[0]

    def load(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_optimizer(opt())
        kv.load_checkpoint(path)
        values, found = kv.lookup("emb", ALL_IDS, train=False)
        kv.barrier()
        stats = kv.table_stats("emb")
        kv.barrier()
        # the optimizer state came too: one more step equals one more step of the original
        ids, grads = batches(kv.rank, 5)[4]
        kv.push("emb", (ids, grads))
        after, _ = kv.lookup("emb", ALL_IDS, train=False)
        return values, stats, after

    ref = local_reference(True, opt())
    b0, b1 = batches(0, 5)[4], batches(1, 5)[4]
    ref.push("emb", (np.concatenate([b0[0], b1[0]]), np.concatenate([b0[1], b1[1]])))
    want_after, _ = ref.lookup("emb", ALL_IDS, train=False)
    for servers in (3, 1):
        for values, stats, after in ok(run_threads(load, num_servers=servers)).values():
            np.testing.assert_array_equal(values, saved[0])
            assert {k: stats[k] for k in ("rows", "step", "inserts", "pushed_rows")} == \
                {k: saved[1][k] for k in ("rows", "step", "inserts", "pushed_rows")}
            np.testing.assert_allclose(after, want_after, rtol=1e-5, atol=1e-6)


def test_checkpoint_of_a_table_into_an_array_key_is_refused(run_threads: Any,
                                                            tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")

    def save(kv: Any) -> None:
        kv.init("emb", spec())
        kv.lookup("emb", np.array([1, 2]))
        kv.save_checkpoint(path)

    ok(run_threads(save, num_servers=2))

    def load(kv: Any) -> Any:
        kv.init("emb", np.zeros((2, DIM), np.float32))
        with pytest.raises(KVStoreError, match="table"):
            kv.load_checkpoint(path)
        kv.init("other", TableSpec(dim=DIM + 1))
        return True

    ok(run_threads(load, num_servers=1))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_checkpoints_between_local_and_dist_stores(dtype: str, run_threads: Any,
                                                   tmp_path: Any) -> None:
    """A local store's checkpoint of a table loads onto 2 servers and back: rows by ID,
    in the storage dtype (R17): every stored bit (IDs, values, AdaGrad state) the same,
    the counters kept, and the next step the same."""
    opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.1)  # noqa: E731
    ref = local_reference(True, opt(), dtype=dtype)
    ref.save_checkpoint(str(tmp_path / "local"))
    want, _ = ref.lookup("emb", ALL_IDS, train=False)

    def load(kv: Any) -> Any:
        kv.init("emb", spec(dtype=dtype))
        kv.set_optimizer(opt())
        kv.load_checkpoint(str(tmp_path / "local"))
        got = kv.lookup("emb", ALL_IDS, train=False)[0]
        kv.save_checkpoint(str(tmp_path / "dist"))
        return got

    for got in ok(run_threads(load, num_servers=2)).values():
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    back = mx.kv.create("local")
    back.init("emb", spec(dtype=dtype))
    back.set_optimizer(opt())
    back.load_checkpoint(str(tmp_path / "dist"))
    np.testing.assert_array_equal(back.lookup("emb", ALL_IDS, train=False)[0], want)
    kept = ("rows", "step", "inserts", "pushed_rows", "dropped_pushes", "evictions")
    assert {k: back.table_stats("emb")[k] for k in kept} == \
        {k: ref.table_stats("emb")[k] for k in kept}      # lookups counted the reads since
    a, b = ref._tables.tables["emb"].state()[0], back._tables.tables["emb"].state()[0]
    assert a["values"].dtype == np.dtype("uint16" if dtype == "bfloat16" else dtype)
    for name in ("ids", "values", "state0"):
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for kv in (ref, back):       # the optimizer state came along: the same next step
        kv.push("emb", (np.array([7, -3]), np.ones((2, DIM), np.float32)))
    np.testing.assert_array_equal(back.lookup("emb", ALL_IDS, train=False)[0],
                                  ref.lookup("emb", ALL_IDS, train=False)[0])


@pytest.mark.parametrize(("dtype", "servers"), [("float16", 1), ("bfloat16", 2)])
def test_half_tables_equal_the_local_store_bit_for_bit(dtype: str, servers: int,
                                                       run_threads: Any) -> None:
    """R17 on the servers: a float16 or bfloat16 table trained by dist_sync rounds (AdaGrad)
    holds the same bits as the local store, rows travel to the workers as float32, and
    the rows stay 2 bytes a value on the servers."""
    opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.1)  # noqa: E731
    res = ok(run_threads(lambda kv: drive(kv, opt(), dtype=dtype), num_servers=servers))
    ref = local_reference(True, opt(), dtype=dtype)
    want, _ = ref.lookup("emb", ALL_IDS, train=False)
    assert want.dtype == np.float32
    for values, stats in res.values():
        assert values.dtype == np.float32
        np.testing.assert_array_equal(values.view(np.uint32), want.view(np.uint32))
        assert stats["rows"] == ref.table_stats("emb")["rows"] and stats["step"] == 4


def test_a_float16_table_shows_half_the_value_bytes_on_the_server(run_threads: Any) -> None:
    """R17: ``pskv_table_bytes`` counts what a server stores: a float16 table holding the
    same rows as a float32 one uses 2 bytes less per value (everything else alike)."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    import time

    from pskv.launch._net import free_port
    from pskv.top import read_job
    first = free_port()
    ids = np.arange(500, dtype=np.int64) * 7919

    def fn(kv: Any) -> Any:
        for key, dtype in (("e32", "float32"), ("e16", "float16")):
            kv.init(key, spec(dtype=dtype))
            kv.lookup(key, ids)
        kv._barrier()
        got = None
        if kv.rank == 0:
            end = time.monotonic() + 20          # until each node's heartbeat told its port
            while time.monotonic() < end and got is None:
                snap = read_job("127.0.0.1", first)
                server = snap.nodes.get(("server", 0)) or {}
                if "pskv_table_bytes{key=e16}" in server:
                    got = (server["pskv_table_bytes{key=e32}"],
                           server["pskv_table_bytes{key=e16}"])
                time.sleep(0.2)
        kv._barrier()
        return got

    res = ok(run_threads(fn, num_servers=1, metrics_port=first, heartbeat_interval=0.2))
    assert res[0] is not None, "the server's metrics were never read"
    b32, b16 = res[0]
    assert b32 - b16 == 500 * DIM * 2


def test_table_stats_after_push_include_its_round(run_threads: Any) -> None:
    """dist_sync: table_stats after this worker's push waits for that push's round."""
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.lookup("emb", np.array([1, 2]))
        kv.push("emb", (np.array([1, 2]), np.ones((2, DIM), np.float32)))
        return kv.table_stats("emb")

    for stats in ok(run_threads(fn, num_servers=2)).values():
        assert stats["step"] == 1 and stats["pushed_rows"] == 2


def test_table_init_checks_the_optimizer_set_before(run_threads: Any) -> None:
    """A table key initialized after set_optimizer is refused on every worker if it
    cannot run that optimizer, and no server holds it."""
    def fn(kv: Any) -> Any:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        with pytest.raises(UnsupportedError, match="rowwise"):
            kv.init("emb", spec(state_layout="rowwise"))
        kv.init("emb", spec())               # the same key, now as a table SGD can run
        kv.lookup("emb", np.array([4]))
        kv.push("emb", (np.array([4]), np.ones((1, DIM), np.float32)))
        return kv.table_stats("emb")

    for stats in ok(run_threads(fn, num_servers=2)).values():
        assert stats["rows"] == 1 and stats["step"] == 1


def test_a_worker_holds_the_spec_of_a_table_not_its_rows(run_threads: Any) -> None:
    """Issue #30: a worker keeps a TableKey (spec and name) per table key, never a table:
    a table reserving a million rows of dim 64 reserves them on the servers only, and the
    worker's checks still raise what the local store's do."""
    from pskv.errors import ShapeMismatchError, TableIdError
    from pskv.kvstore._table_rules import TableKey
    from pskv.table import TableSpec

    def fn(kv: Any) -> Any:
        kv.init("emb", TableSpec(dim=64, reserve_rows=1_000_000))
        held = kv._tables.tables["emb"]
        errors = []
        for bad in ((np.array([1.5]), np.zeros((1, 64), np.float32)),
                    (np.array([1, 2]), np.zeros((2, 3), np.float32))):
            try:
                kv.push("emb", bad)
            except (TableIdError, ShapeMismatchError) as err:
                errors.append(type(err).__name__)
        return type(held).__name__, isinstance(held, TableKey), held.spec.reserve_rows, errors

    for name, is_key, reserved, errors in ok(run_threads(fn, num_servers=2)).values():
        assert (name, is_key, reserved) == ("TableKey", True, 1_000_000)
        assert errors == ["TableIdError", "ShapeMismatchError"]
