"""dist_* semantics on whole clusters run as threads of the test process (fast, no processes).

Each test starts a scheduler, 1-2 servers and 2 workers on 127.0.0.1 (``ThreadCluster`` in
conftest.py), runs the same function on every worker and checks what each one got; unless
stated, it also checks that the scheduler and every server exit 0 by themselves once the
workers have closed their stores.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv import compression
from pskv._ps.config import ENV_BIGARRAY_BOUND, ClusterConfig
from pskv.errors import (ClusterError, ClusterTimeoutError, KeyNotInitializedError,
                         KVStoreError, ShapeMismatchError)

pytestmark = pytest.mark.timeout(60)


def ok(results: dict[int, Any]) -> dict[int, Any]:
    """Results by rank, raising the first worker exception."""
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)

SHAPE = (2, 3)


def both_equal(results: dict[int, Any]) -> Any:
    """The result every worker got (they must agree)."""
    res = ok(results)
    assert sorted(res) == [0, 1]
    a, b = res[0], res[1]
    np.testing.assert_equal(a, b)
    return a


# ---- sums and rounds ----------------------------------------------------------------------
@pytest.mark.parametrize("servers,transport", [(1, "auto"), (2, "auto"), (2, "tcp"),
                                               (2, "ipc"), (2, "zmq")])
def test_sync_sum(servers: int, transport: str, run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        assert (kv.type, kv.num_workers) == ("dist_sync", 2)
        kv.init(3, mx.nd.ones(SHAPE))
        kv.init([5, 7], [mx.nd.zeros((40,)), mx.nd.zeros((4,))])
        first = kv.pull(3).asnumpy()
        kv.push(3, mx.nd.ones(SHAPE) * (kv.rank + 1))
        out = mx.nd.zeros(SHAPE)
        kv.pull(3, out=out)
        # two local devices: summed on the worker, then across workers
        kv.push([5, 7], [[mx.nd.ones((40,))] * 2, [mx.nd.ones((4,))] * 3])
        outs = [mx.nd.zeros((40,)), mx.nd.zeros((4,))]
        kv.pull([5, 7], out=outs)
        return first, out.asnumpy(), outs[0].asnumpy(), outs[1].asnumpy()

    first, summed, big, small = both_equal(run_threads(fn, num_servers=servers,
                                                       transport=transport))
    np.testing.assert_array_equal(first, np.ones(SHAPE))
    np.testing.assert_array_equal(summed, np.full(SHAPE, 3.0))
    np.testing.assert_array_equal(big, np.full(40, 4.0))
    np.testing.assert_array_equal(small, np.full(4, 6.0))


def test_sync_rounds_pull_after_push_sees_its_round(run_threads: Any) -> None:
    rounds = 6

    def fn(kv: Any) -> list[float]:
        kv.init("w", mx.nd.zeros((5,)))
        seen = []
        for r in range(rounds):
            kv.push("w", mx.nd.ones((5,)) * (10 * r + kv.rank))
            seen.append(float(kv.pull("w").asnumpy()[0]))
        return seen

    seen = both_equal(run_threads(fn, num_servers=2))
    # round r's value is 10r + 0 + 10r + 1, whichever worker pulls first
    assert seen == [20.0 * r + 1 for r in range(rounds)]


@pytest.mark.parametrize("size", [2, 20000], ids=["small", "big"])
def test_second_push_before_others_goes_to_next_round(size: int, run_threads: Any) -> None:
    # rounds count distinct workers (MXNet counts requests and would sum 1 + 10 here); big
    # pushes check that a deferred push's data survives the same worker's next message
    def fn(kv: Any) -> Any:
        kv.init([3, 4], [mx.nd.zeros((size,)), mx.nd.zeros((size,))])
        if kv.rank == 0:
            kv.push(3, mx.nd.ones((size,)))
            kv.push(3, mx.nd.ones((size,)) * 10)
            kv.push(4, mx.nd.ones((size,)) * 7)
            return kv.pull(3).asnumpy(), kv.pull(4).asnumpy()   # its second push's round
        kv.push(3, mx.nd.ones((size,)) * 100)
        first = kv.pull(3).asnumpy()             # the round of its first push
        kv.push(3, mx.nd.ones((size,)) * 1000)
        kv.push(4, mx.nd.ones((size,)))
        return first, kv.pull(3).asnumpy(), kv.pull(4).asnumpy()

    res = ok(run_threads(fn, num_servers=2))
    np.testing.assert_array_equal(res[0][0], np.full(size, 1010.0))
    np.testing.assert_array_equal(res[0][1], np.full(size, 8.0))
    np.testing.assert_array_equal(res[1][0], np.full(size, 101.0))
    np.testing.assert_array_equal(res[1][1], np.full(size, 1010.0))
    np.testing.assert_array_equal(res[1][2], np.full(size, 8.0))


def test_pushpull_and_broadcast(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("p", mx.nd.zeros(SHAPE))
        out = mx.nd.zeros(SHAPE)
        kv.pushpull("p", mx.nd.ones(SHAPE) * (kv.rank + 1), out=out)
        inplace = [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2]
        kv.pushpull("p", inplace)                # out=None: the values are overwritten
        bout = mx.nd.zeros((4,))
        kv.broadcast("b", mx.nd.ones((4,)) * (7 + kv.rank), out=bout)
        return out.asnumpy(), inplace[0].asnumpy(), inplace[1].asnumpy(), bout.asnumpy()

    out, in0, in1, bout = both_equal(run_threads(fn, num_servers=2))
    np.testing.assert_array_equal(out, np.full(SHAPE, 3.0))
    np.testing.assert_array_equal(in0, np.full(SHAPE, 6.0))
    np.testing.assert_array_equal(in1, np.full(SHAPE, 6.0))
    np.testing.assert_array_equal(bout, np.full(4, 7.0))     # rank 0's value


def test_str_keys_agree_whatever_the_init_order(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        names = ["a", "b"] if kv.rank == 0 else ["b", "a"]
        kv.init(names, [mx.nd.ones((3,)) * (1 if n == "a" else 2) for n in names])
        kv.init("c", mx.nd.ones((1,)))
        names = ["c", "a", "b"] if kv.rank == 0 else ["b", "c", "a"]
        kv.push(names, [mx.nd.ones((3,) if n != "c" else (1,)) for n in names])
        return [kv.pull(n).asnumpy() for n in "abc"]

    a, b, c = both_equal(run_threads(fn, num_servers=2))
    np.testing.assert_array_equal(a, np.full(3, 2.0))
    np.testing.assert_array_equal(b, np.full(3, 2.0))
    np.testing.assert_array_equal(c, [2.0])


def test_any_int_key(run_threads: Any) -> None:
    keys = [-5, 0, 2**62, -(2**62), 10**30]

    def fn(kv: Any) -> Any:
        kv.init(keys, [mx.nd.ones((2,)) * i for i in range(len(keys))])
        kv.push(keys, [mx.nd.ones((2,)) * (kv.rank + 1)] * len(keys))
        return [kv.pull(k).asnumpy() for k in keys]

    for got in both_equal(run_threads(fn, num_servers=2)):
        np.testing.assert_array_equal(got, [3.0, 3.0])


def test_init_shape_mismatch_raises_on_every_worker(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        try:
            kv.init(3, mx.nd.ones((2,) if kv.rank == 0 else (3,)))
        except ShapeMismatchError as err:
            caught = err
        else:
            return "no error"
        # nothing was created: the workers can go on with a correct init
        kv.init(3, mx.nd.ones((2,)))
        kv.push(3, mx.nd.ones((2,)))
        return caught, kv.pull(3).asnumpy()

    res = ok(run_threads(fn))
    for rank, (err, value) in res.items():
        assert isinstance(err, ValueError), (rank, err)
        assert "key 3" in str(err) and "worker" in str(err)
        np.testing.assert_array_equal(value, [2.0, 2.0])


def test_init_error_on_one_worker_raises_on_every_worker(run_threads: Any) -> None:
    # worker 1 mixes key kinds: it raises KeyTypeError, worker 0 hears about it
    def fn(kv: Any) -> Any:
        try:
            kv.init([1, "x"] if kv.rank == 1 else [1, 2], [mx.nd.ones((2,))] * 2)
        except KVStoreError as err:
            return err
        return "no error"

    res = run_threads(fn)
    assert isinstance(res[1], TypeError)
    assert isinstance(res[0], ClusterError) and "worker 1" in str(res[0])


def test_pull_uninitialized_key_raises(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        with pytest.raises(KeyNotInitializedError):
            kv.pull(99)
        return True

    assert ok(run_threads(fn)) == {0: True, 1: True}


# ---- optimizers on the servers ------------------------------------------------------------
OPTIMIZERS = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
    ("adam", {"learning_rate": 0.01}),
    ("test", {"rescale_grad": 0.5}),
    ("rmsprop", {"learning_rate": 0.01, "centered": True}),
]


def grads(rank: int, step: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal(size).astype(np.float32)


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_server_optimizer_equals_local(name: str, kwargs: dict[str, Any],
                                      run_threads: Any) -> None:
    steps, size = 4, 30          # 30 >= bound 16: split across both servers

    def fn(kv: Any) -> list[np.ndarray]:
        kv.set_optimizer(mx.optimizer.create(name, **kwargs))   # by every worker
        kv.init([0, 1], [mx.nd.ones((size,)), mx.nd.ones((3,))])
        seen = []
        for step in range(steps):
            kv.push([0, 1], [mx.nd.array(grads(kv.rank, step, size)),
                             mx.nd.array(grads(kv.rank, step, 3))])
            seen.append(np.concatenate([kv.pull(0).asnumpy(), kv.pull(1).asnumpy()]))
        return seen

    got = both_equal(run_threads(fn, num_servers=2, bigarray_bound=16))
    local = mx.kv.create("local")
    local.set_optimizer(mx.optimizer.create(name, **kwargs))
    local.init([0, 1], [mx.nd.ones((size,)), mx.nd.ones((3,))])
    for step in range(steps):
        local.push([0, 1], [[mx.nd.array(grads(r, step, size)) for r in (0, 1)],
                            [mx.nd.array(grads(r, step, 3)) for r in (0, 1)]])
        want = np.concatenate([local.pull(0).asnumpy(), local.pull(1).asnumpy()])
        np.testing.assert_allclose(got[step], want, rtol=1e-6, atol=1e-7)


def test_optimizer_states_save_and_load(tmp_path: Path, run_threads: Any) -> None:
    fname = str(tmp_path / "states.npz")

    def fn(kv: Any) -> Any:
        kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
        kv.init(0, mx.nd.ones((20,)))
        kv.push(0, mx.nd.ones((20,)))
        kv.pull(0)
        if kv.rank == 0:
            kv.save_optimizer_states(fname)
        kv.barrier()
        kv.push(0, mx.nd.ones((20,)))
        second = kv.pull(0).asnumpy()
        kv.barrier()
        if kv.rank == 0:
            kv.load_optimizer_states(fname)      # momentum back to after step 1
        kv.barrier()
        kv.push(0, mx.nd.ones((20,)))
        return second, kv.pull(0).asnumpy()

    second, third = both_equal(run_threads(fn, num_servers=2, bigarray_bound=8))
    # g = 2 per step; mom = 0.9 mom - 0.1 g; w += mom
    np.testing.assert_allclose(second, np.full(20, 1 - 0.2 - 0.38), rtol=1e-6)
    np.testing.assert_allclose(third, second - 0.38, rtol=1e-5)


def test_save_states_without_optimizer_raises(tmp_path: Path, run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        with pytest.raises(KVStoreError, match="optimizer"):
            kv.save_optimizer_states(str(tmp_path / f"s{kv.rank}.npz"))
        return True

    assert ok(run_threads(fn)) == {0: True, 1: True}


# ---- async -------------------------------------------------------------------------------------
def test_async_without_optimizer_assigns(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        assert kv.type == "dist_async"
        kv.init(1, mx.nd.zeros((3,)))
        kv.push(1, mx.nd.ones((3,)) * (kv.rank + 1))
        kv.barrier()                              # both pushes acknowledged
        return kv.pull(1).asnumpy()

    got = both_equal(run_threads(fn, store_type="dist_async"))
    assert got.tolist() in ([1.0] * 3, [2.0] * 3)   # the last push wins: no sum, no crash


def test_async_applies_every_push(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.set_optimizer(mx.optimizer.create("test", rescale_grad=1.0))
        kv.init(1, mx.nd.zeros((30,)))
        for step in range(5):
            kv.push(1, mx.nd.ones((30,)) * (kv.rank + 1))
        kv.barrier()
        return kv.pull(1).asnumpy()

    got = both_equal(run_threads(fn, store_type="dist_async", num_servers=2,
                                 bigarray_bound=10))
    np.testing.assert_array_equal(got, np.full(30, 15.0))


# ---- big arrays, row_sparse, compression ---------------------------------------------------
def test_bigarray_bound_from_the_environment_splits_keys(run_threads: Any) -> None:
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
           "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2", ENV_BIGARRAY_BOUND: "10"}
    bound = ClusterConfig.from_env(env).bigarray_bound
    assert bound == 10
    value = np.arange(33, dtype=np.float32).reshape(3, 11)

    def fn(kv: Any) -> Any:
        kv.init(["big", "small"], [mx.nd.array(value), mx.nd.ones((9,))])
        kv.push(["big", "small"], [mx.nd.array(value), mx.nd.ones((9,))])
        return ([(s.server, s.start, s.stop) for s in kv._store["big"].segments],
                len(kv._store["small"].segments), kv.pull("big").asnumpy(),
                kv.pull("small").asnumpy())

    segs, nsmall, big, small = both_equal(run_threads(fn, num_servers=2, bigarray_bound=bound))
    assert segs == [(0, 0, 16), (1, 16, 33)] and nsmall == 1
    np.testing.assert_array_equal(big, 2 * value)
    np.testing.assert_array_equal(small, np.full(9, 2.0))


def test_row_sparse_split_by_rows(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("e", mx.nd.sparse.zeros("row_sparse", (6, 2)))
        rows = [s.start for s in kv._store["e"].segments]
        g = mx.nd.sparse.row_sparse_array(
            (np.ones((2, 2), np.float32) * (kv.rank + 1), np.array([kv.rank, 5])), shape=(6, 2))
        kv.push("e", g)
        out = mx.nd.sparse.zeros("row_sparse", (6, 2))
        kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([5, 0, 1, 4, 5]))
        dense = mx.nd.zeros((6, 2))
        kv.pull("e", out=dense)
        return rows, out.indices.asnumpy(), out.data.asnumpy(), dense.asnumpy()

    rows, idx, data, dense = both_equal(run_threads(fn, num_servers=2))
    assert rows == [0, 3]                               # rows spread over both servers
    np.testing.assert_array_equal(idx, [0, 1, 4, 5])
    np.testing.assert_array_equal(data, [[1, 1], [2, 2], [0, 0], [3, 3]])
    want = np.zeros((6, 2), np.float32)
    want[0], want[1], want[5] = 1, 2, 3
    np.testing.assert_array_equal(dense, want)


def test_row_sparse_with_optimizer(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.set_optimizer(mx.optimizer.create("test", rescale_grad=1.0))
        kv.init(4, mx.nd.sparse.row_sparse_array(
            (np.ones((5, 3), np.float32), np.arange(5)), shape=(5, 3)))
        for _ in range(2):
            g = mx.nd.sparse.row_sparse_array(
                (np.ones((1, 3), np.float32), np.array([kv.rank * 4])), shape=(5, 3))
            kv.push(4, g)
        out = mx.nd.sparse.zeros("row_sparse", (5, 3))
        kv.row_sparse_pull(4, out=out, row_ids=mx.nd.array(np.arange(5)))
        return out.data.asnumpy()

    data = both_equal(run_threads(fn, num_servers=2))
    np.testing.assert_array_equal(data[:, 0], [3, 1, 1, 1, 3])


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_gradient_compression_matches_numpy(kind: str, run_threads: Any) -> None:
    size, steps, threshold = 37, 4, 0.5
    params = {"type": kind, "threshold": threshold}

    def g(rank: int, step: int) -> np.ndarray:
        return grads(rank, step, size) * 0.6

    def fn(kv: Any) -> Any:
        kv.set_gradient_compression(params)
        kv.init("c", mx.nd.zeros((size,)))
        seen = []
        for step in range(steps):
            if step % 2:
                out = mx.nd.zeros((size,))
                kv.pushpull("c", mx.nd.array(g(kv.rank, step)), out=out)
                seen.append(out.asnumpy())
            else:
                kv.push("c", mx.nd.array(g(kv.rank, step)))
                seen.append(kv.pull("c").asnumpy())
        return seen

    got = both_equal(run_threads(fn, num_servers=2, bigarray_bound=10))
    # each worker compresses its merged gradient with its own residual; the servers sum the
    # dequantized values and assign (no optimizer)
    gc = compression.create(params)
    assert gc is not None
    residual = {r: np.zeros(size, np.float32) for r in (0, 1)}
    for step in range(steps):
        want = sum(gc.decompress(gc.compress(g(r, step), residual[r]), size) for r in (0, 1))
        np.testing.assert_allclose(got[step], want, rtol=0, atol=1e-6)


def test_compression_with_optimizer_matches_device_store(run_threads: Any) -> None:
    # one worker per "device": a device store with 2 devices runs the same sequence
    size, steps = 16, 3
    params = {"type": "2bit", "threshold": 0.25}

    def fn(kv: Any) -> Any:
        kv.set_gradient_compression(params)
        kv.set_optimizer(mx.optimizer.create("test", rescale_grad=1.0))
        kv.init(0, mx.nd.zeros((size,)))
        for step in range(steps):
            kv.push(0, mx.nd.array(grads(kv.rank, step, size) * 0.3))
        return kv.pull(0).asnumpy()

    got = both_equal(run_threads(fn))
    dev = mx.kv.create("device")
    dev.set_gradient_compression(params)
    dev.set_optimizer(mx.optimizer.create("test", rescale_grad=1.0))
    dev.init(0, mx.nd.zeros((size,)))
    for step in range(steps):
        dev.push(0, [mx.nd.array(grads(r, step, size) * 0.3, ctx=mx.cpu(r)) for r in (0, 1)])
    np.testing.assert_allclose(got, dev.pull(0).asnumpy(), rtol=0, atol=1e-6)


# ---- collective calls, timeouts -------------------------------------------------------------
def test_set_optimizer_by_every_worker_is_installed_once(run_threads: Any) -> None:
    # MXNet scripts call set_optimizer on every worker; a second install would reset the
    # momentum. Worker 1 calls it again after a step: identical specs are no-ops.
    def fn(kv: Any) -> Any:
        opt = {"learning_rate": 0.1, "momentum": 0.9}
        kv.set_optimizer(mx.optimizer.create("sgd", **opt))
        kv.init(0, mx.nd.ones((4,)))
        kv.push(0, mx.nd.ones((4,)))
        kv.pull(0)
        kv.barrier()
        kv.set_optimizer(mx.optimizer.create("sgd", **opt))
        kv.push(0, mx.nd.ones((4,)))
        return kv.pull(0).asnumpy()

    got = both_equal(run_threads(fn))
    np.testing.assert_allclose(got, np.full(4, 1 - 0.2 - 0.38), rtol=1e-6)


def test_round_timeout_names_missing_workers_and_key(run_threads: Any) -> None:
    gate = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init("slow", mx.nd.zeros((2,)))
        if kv.rank == 0:
            kv.push("slow", mx.nd.ones((2,)))
            try:
                kv.pull("slow")
            except ClusterTimeoutError as err:
                return err
            finally:
                gate.set()
            return "no error"
        gate.wait(20)
        return "waited"

    res = run_threads(fn, round_timeout=0.6)
    err = res[0]
    assert isinstance(err, ClusterTimeoutError), err
    msg = str(err)
    assert "'slow'" in msg and "workers [1] have not pushed" in msg, msg
    assert res[1] == "waited"


def test_wrong_shape_push_is_an_error_reply_and_the_store_goes_on(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init(2, mx.nd.zeros((3,)))
        with pytest.raises(ShapeMismatchError):
            kv.push(2, mx.nd.ones((4,)))         # checked on the worker, nothing sent
        kv.push(2, mx.nd.ones((3,)))
        return kv.pull(2).asnumpy()

    np.testing.assert_array_equal(both_equal(run_threads(fn)), np.full(3, 2.0))


def test_nodes_exit_zero_when_every_worker_closes(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2)

    def fn(kv: Any) -> int:
        kv.init(1, mx.nd.zeros((2,)))
        return int(kv.rank)

    assert ok(cluster.run(fn)) == {0: 0, 1: 1}
    assert cluster.join(10) == {"scheduler": 0, "server 0": 0, "server 1": 0}




# ---- pushes that wait for the next call, barriers ----------------------------------------
def test_barrier_does_not_wait_for_rounds_that_need_later_pushes(run_threads: Any) -> None:
    # MXNet's barrier does not wait for pushes; a round that needs another worker's push
    # after the barrier must not deadlock it
    def fn(kv: Any) -> Any:
        kv.init(0, mx.nd.zeros((2,)))
        if kv.rank == 0:
            kv.push(0, mx.nd.ones((2,)))
            kv.barrier()
        else:
            kv.barrier()
            kv.push(0, mx.nd.ones((2,)) * 2)
        return kv.pull(0).asnumpy()

    np.testing.assert_array_equal(both_equal(run_threads(fn, request_timeout=10.0)), [3, 3])


@pytest.mark.parametrize("coalesce", ["65536", "0"])
def test_small_push_is_sent_by_any_next_call(coalesce: str, run_threads: Any) -> None:
    # a small dist_sync push waits for the store's next call; a pull of other keys (or any
    # other call) must send it, and a pull of the same keys must see its round
    def fn(kv: Any) -> Any:
        kv.init([0, 1], [mx.nd.zeros((3,)), mx.nd.ones((3,))])
        kv.push(0, mx.nd.ones((3,)) * (kv.rank + 1))
        other = kv.pull(1).asnumpy()            # not key 0: the held push goes first
        kv.push(0, mx.nd.ones((3,)) * 10)
        same = mx.nd.zeros((3,))
        kv.pull(0, out=same)                    # key 0: push and pull travel together
        kv.push([0, 1], [mx.nd.ones((3,)), mx.nd.ones((3,)) * 4])
        both = kv.pull([0, 1])
        return other, same.asnumpy(), both[0].asnumpy(), both[1].asnumpy()

    other, same, k0, k1 = both_equal(run_threads(fn, coalesce_bytes=int(coalesce)))
    np.testing.assert_array_equal(other, np.ones(3))
    np.testing.assert_array_equal(same, np.full(3, 20.0))
    np.testing.assert_array_equal(k0, np.full(3, 2.0))
    np.testing.assert_array_equal(k1, np.full(3, 8.0))


def test_held_push_is_sent_while_its_worker_blocks_outside_the_store(run_threads: Any) -> None:
    # worker 0 pushes a small value (held back for a PUSHPULL), then blocks outside the
    # store until worker 1 has pulled the round: the control thread must send the held push
    pulled = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(0, mx.nd.zeros((2,)))
        kv.push(0, mx.nd.ones((2,)) * (kv.rank + 1))
        if kv.rank == 0:
            return pulled.wait(20)       # not a store call
        value = kv.pull(0).asnumpy()
        pulled.set()
        return value

    results = run_threads(fn, 2, 1, request_timeout=15.0)
    assert results[0] is True, results
    np.testing.assert_array_equal(results[1], np.full(2, 3.0))


@pytest.mark.parametrize("store_type", ["dist_async", "dist_sync"])
def test_inproc_big_pushes_are_copied_not_held_by_the_server(store_type: str) -> None:
    # ZeroMQ inproc hands the message itself to the server's thread, which keeps a
    # dist_async push's frames as arrays: a push sent without a copy waited for them to be
    # let go (30 s, then "it is not reading") once a server's part reached 64 KiB; and
    # the array the worker changes after its push must not change what the server holds
    from pskv._cluster import InprocCluster
    n = 131072                                      # 512 KiB, split over both servers

    def job(kv: Any) -> Any:
        kv.init("a", np.zeros(n, np.float32))
        value = np.ones(n, np.float32)
        for _ in range(3):
            kv.push("a", value)
            value[:] = 7.0                          # after the push returned
            out = np.zeros(n, np.float32)
            kv.pull("a", out=out)
            value[:] = 1.0
        return out

    with InprocCluster(num_workers=1, num_servers=2, bigarray_bound=1000) as cluster:
        got = cluster.run(job, store_type=store_type, timeout=60)[0]
    assert not isinstance(got, BaseException), got
    np.testing.assert_array_equal(got, np.ones(n, np.float32))
