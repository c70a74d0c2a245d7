"""Threads: several threads of one worker push and pull different keys at once.

Before the fix, one store lock was held across every network wait, so a thread of worker 0
waiting for worker 1's push of key 1 blocked worker 0's other threads, whose keys worker 1
was waiting for: both workers hung until the request timeout.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx

THREADS = 4
STEPS = 15


def _threads(kv: Any) -> Any:
    keys = list(range(THREADS))
    kv.init(keys, [mx.nd.zeros((5,)) for _ in keys])
    # weight -= lr * grad with lr = -1: each round adds the workers' summed pushes
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=-1.0))
    kv.barrier()
    seen: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    # the workers' threads run their keys in opposite orders, so each waits on a key the
    # other worker's thread reaches late
    order = keys if kv.rank == 0 else keys[::-1]

    def run(key: int) -> None:
        try:
            out = mx.nd.zeros((5,))
            for _ in range(STEPS):
                kv.push(key, mx.nd.ones((5,)) * (kv.rank + 1))
                kv.pull(key, out=out)
                seen.setdefault(key, []).append(float(out.asnumpy()[0]))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    kv.barrier()
    final = [float(kv.pull(k).asnumpy()[0]) for k in keys]
    return seen, final


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
@pytest.mark.parametrize("transport", ["auto", "zmq"])
def test_threads_of_one_worker_push_and_pull_different_keys(
        store_type: str, transport: str, thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2, transport=transport, bigarray_bound=4)
    res = cluster.run(_threads, store_type, timeout=90)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        seen, final = res[rank]
        # no lost update: every push of both workers was applied exactly once
        assert final == [3.0 * STEPS] * THREADS, final
        if store_type == "dist_sync":
            # a pull after this worker's push sees that round: both workers' pushes
            for key, values in seen.items():
                assert values == [3.0 * (i + 1) for i in range(STEPS)], (key, values)
        else:
            for values in seen.values():
                assert values == sorted(values) and values[-1] <= 3.0 * STEPS, values
    codes = cluster.join(15)
    assert all(c == 0 for c in codes.values()), codes
    np.testing.assert_equal(len(res), 2)
