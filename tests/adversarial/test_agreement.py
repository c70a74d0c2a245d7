"""Cluster-wide agreement: mixed store types, bad optimizer specs, failing multi-key calls.

Each of these used to give wrong sums or a long hang: now every worker is refused at once
with the same error, and a failing multi-key request changes nothing and leaves nothing open.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command


@pytest.mark.timeout(60)
def test_mixed_sync_and_async_workers_are_refused_on_every_worker(thread_cluster: Any) -> None:
    from pskv.kvstore.dist import DistKVStore
    cluster = thread_cluster(2, 1)
    errors: dict[str, BaseException | None] = {}

    def worker(store_type: str) -> None:
        try:
            DistKVStore(store_type, cluster.cfg).close()
            errors[store_type] = None
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            errors[store_type] = err

    threads = [threading.Thread(target=worker, args=(t,), daemon=True)
               for t in ("dist_sync", "dist_async")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    msgs = set()
    for store_type, err in errors.items():
        assert isinstance(err, mx.errors.ClusterError), (store_type, err)
        assert "different store types" in str(err), err
        msgs.add(str(err).split("refused this job: ")[-1])
    assert len(msgs) == 1, msgs        # the same error on every worker
    codes = cluster.join(15)
    assert codes["scheduler"] == 1, codes
    assert isinstance(codes["server 0"], mx.errors.ClusterError), codes


@pytest.mark.timeout(60)
def test_bad_optimizer_is_refused_at_once_alike_on_every_worker(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        msgs = []
        for opt in (mx.optimizer.SGD(learning_rate="abc"),
                    mx.optimizer.SGD(momentum=float("nan")),
                    mx.optimizer.create("adam", beta1="x")):
            with pytest.raises(mx.errors.ConfigError) as info:
                kv.set_optimizer(opt)
            msgs.append(str(info.value))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=-1.0))   # a good one still works
        kv.push(1, mx.nd.ones((3,)))
        return msgs, kv.pull(1).asnumpy()

    res = run_threads(fn, store_type="dist_sync")
    assert res[0][0] == res[1][0], res
    assert "learning_rate='abc'" in res[0][0][0], res[0][0]
    for rank in (0, 1):
        np.testing.assert_array_equal(res[rank][1], np.full(3, 2.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_failing_multi_key_requests_change_nothing_and_leave_nothing_open(
        store_type: str, thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1)
    got: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init([1, 2], [mx.nd.zeros((3,)), mx.nd.zeros((3,))])
        if kv.rank == 0:
            pk1, pk2 = (kv._store[k].pskey for k in (1, 2))
            # a push whose last key is wrong (shape; then never initialized): nothing moves
            for keys, arrays in (([pk1, pk2], [np.ones(3, np.float32), np.ones(4, np.float32)]),
                                 ([pk1, 999], [np.ones(3, np.float32)] * 2)):
                kv._kv.push(0, Command.PUSH, keys, {"kinds": "dd"}, arrays)
                with pytest.raises(mx.KVStoreError):
                    kv._kv.flush(timeout=5)      # answered: no flush counter left open
            # an INIT whose last entry clashes: its first key is not created either
            ts = kv._kv.request(0, Command.INIT, [40, pk1], {"entries": [
                {"key": 20, "shape": [3]}, {"key": 1, "shape": [3]}]},
                [np.ones(3, np.float32)] * 2)
            with pytest.raises(mx.KVStoreError) as info:
                kv._kv.wait(ts, timeout=5)
            got["init"] = str(info.value)
            ts = kv._kv.request(0, Command.PULL, [40])
            with pytest.raises(mx.KVStoreError):
                kv._kv.wait(ts, timeout=5)
            # a worker-side bad multi-key push is refused before anything is sent
            with pytest.raises(mx.KVStoreError):
                kv.push([1, 2], [mx.nd.ones((3,)), mx.nd.ones((5,))])
        kv.barrier()
        before = [kv.pull(k).asnumpy() for k in (1, 2)]
        kv.barrier()                               # everyone read before anyone pushes
        kv.push([1, 2], [mx.nd.ones((3,)), mx.nd.ones((3,))])
        kv.barrier()
        return before, [kv.pull(k).asnumpy() for k in (1, 2)]

    res = cluster.run(fn, store_type)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        before, after = res[rank]
        for value in before:
            np.testing.assert_array_equal(value, np.zeros(3))     # nothing changed
        for value in after:
            assert value[0] in (1.0, 2.0), after                  # assign: the round's sum
    assert "initialized twice" in got["init"], got
    codes = cluster.join(15)
    assert all(c == 0 for c in codes.values()), codes
