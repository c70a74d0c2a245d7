"""Uneven data (docs/api.md, "Uneven data"): workers with different numbers of batches.

A worker that closes its store while another still needs its push is named at once (a
WorkerClosedError, not a wait for ever); ``kv.join()`` lets the others' rounds complete
with the joined workers counting as zeros (the divisor unchanged: DDP's ``Join`` default),
on the servers' path and the collective path, in ``dist_sync`` and ``dist_async``. The
results are checked against NumPy sums in worker-rank order. Thread clusters on 127.0.0.1.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ClusterTimeoutError, UnsupportedError, WorkerClosedError

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

SHAPE = (40,)


def grad(rank: int, step: int) -> np.ndarray:
    """A worker's push: magnitudes differing by rank (the order of a sum shows)."""
    rng = np.random.default_rng([rank, step])
    return (rng.standard_normal(SHAPE) * 10.0 ** rank).astype(np.float32)


def round_sum(batches: list[int], step: int) -> np.ndarray:
    """What round ``step`` sums: the pushes of the workers with a batch left, rank order;
    a joined worker adds nothing (zeros)."""
    acc = np.zeros(SHAPE, np.float32)
    first = True
    for rank, n in enumerate(batches):
        if step < n:
            acc = grad(rank, step).copy() if first else acc + grad(rank, step)
            first = False
    return acc


def results(res: dict[int, Any]) -> dict[int, Any]:
    for value in res.values():
        if isinstance(value, BaseException):
            raise value
    return res


# ---- a worker that closes without joining is named at once ------------------------------
@pytest.mark.parametrize("collective", [False, True], ids=["servers", "collective"])
def test_one_more_push_than_a_closed_worker_fails_naming_it(run_threads: Any,
                                                            collective: bool) -> None:
    """Worker 0 has one more batch than worker 1, which closes its store: worker 0's extra
    round fails within seconds (a WorkerClosedError naming worker 1, the key and the
    round), not after PSKV_ROUND_TIMEOUT (300 s here) or never."""
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        for step in range(3 if kv.rank == 0 else 2):
            kv.push("w", grad(kv.rank, step))
            kv.pull("w")
        return kv._store["w"].collective

    res = run_threads(fn, collective_bytes=8 if collective else 0, round_timeout=300.0,
                      request_timeout=60.0, timeout=30.0)
    assert res[1] is collective
    err = res[0]
    assert isinstance(err, WorkerClosedError), err
    assert "worker 1 closed its store" in str(err)
    assert "'w'" in str(err) and "kv.join()" in str(err)
    # round 2 (0-based) on the servers; the collective path counts rounds from 1
    assert ("round 2 of key 'w'" if not collective else "round 3 of key 'w'") in str(err)


def test_a_barrier_a_closed_worker_never_reaches_fails_naming_it(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        if kv.rank == 0:
            kv.barrier()
        return None

    res = run_threads(fn, request_timeout=60.0, timeout=30.0)
    assert isinstance(res[0], WorkerClosedError), res[0]
    assert "worker 1 closed its store without reaching a barrier" in str(res[0])


# ---- kv.join ----------------------------------------------------------------------------
@pytest.mark.parametrize("collective,shm", [(False, True), (True, True), (True, False)],
                         ids=["servers", "collective", "collective-sockets"])
def test_join_sums_the_workers_with_data_left(run_threads: Any, collective: bool,
                                              shm: bool) -> None:
    """Three workers with 5, 2 and 4 batches: each round's sum (what a pull returns
    without an optimizer) is the sum of the pushes of the workers that still have a
    batch; every worker then reads the same last value (the collective path through
    shared memory and through the sockets alike)."""
    batches = [5, 2, 4]

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        sums = []
        for step in range(batches[kv.rank]):
            kv.push("w", grad(kv.rank, step))
            sums.append(kv.pull("w"))
        last = kv.join()
        return sums, last, kv.pull("w"), kv._store["w"].collective

    res = results(run_threads(fn, num_workers=3, collective_bytes=8 if collective else 0,
                              collective_shm=shm, timeout=60.0))
    for rank, (sums, last, final, on_path) in res.items():
        assert on_path is collective
        assert last == 0                    # worker 0 had the most batches
        for step, got in enumerate(sums):
            np.testing.assert_array_equal(got, round_sum(batches, step), err_msg=f"{step}")
        np.testing.assert_array_equal(final, round_sum(batches, max(batches) - 1))


def test_join_with_an_optimizer_keeps_the_divisor(run_threads: Any) -> None:
    """SGD with rescale_grad = 1 / num_workers: a round's step is the sum of the workers
    with data left, divided by all the workers (a joined worker's gradient is zero)."""
    batches = [3, 1, 2]
    lr = 0.1

    def fn(kv: Any) -> Any:
        kv.init("w", np.ones(SHAPE, np.float32))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=lr, rescale_grad=1.0 / 3))
        for step in range(batches[kv.rank]):
            kv.push("w", grad(kv.rank, step))
            kv.pull("w")
        kv.join()
        return kv.pull("w")

    want = np.ones(SHAPE, np.float32)
    for step in range(max(batches)):
        want = want - np.float32(lr) * (round_sum(batches, step) * np.float32(1.0 / 3))
    for final in results(run_threads(fn, num_workers=3, timeout=60.0)).values():
        np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-5)


def test_join_in_async_waits_for_every_push(run_threads: Any) -> None:
    """dist_async never waits on rounds: join is a barrier after which every worker's
    pushes are applied (values chosen so that any order of the updates is exact)."""
    batches = [4, 1]

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=0.5))
        for _ in range(batches[kv.rank]):
            kv.push("w", np.full(SHAPE, kv.rank + 1.0, np.float32))
        kv.join()
        return kv.pull("w")

    want = -0.25 * sum(n * (r + 1.0) for r, n in enumerate(batches))
    for final in results(run_threads(fn, store_type="dist_async", timeout=60.0)).values():
        np.testing.assert_array_equal(final, np.full(SHAPE, want, np.float32))


def test_two_epochs_of_uneven_data(run_threads: Any) -> None:
    """A join is one epoch (DDP's ``Join`` context): once every worker joined, the next
    rounds count every worker again, with other numbers of batches."""
    epochs = [[3, 1], [1, 2]]

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        sums = []
        for batches in epochs:
            for step in range(batches[kv.rank]):
                kv.push("w", grad(kv.rank, step))
                sums.append(kv.pull("w"))
            assert kv.join() == int(np.argmax(batches))
        return sums

    res = results(run_threads(fn, timeout=60.0))
    for rank, sums in res.items():
        want = [round_sum(b, s) for b in epochs for s in range(b[rank])]
        assert len(sums) == len(want)
        for got, w in zip(sums, want):
            np.testing.assert_array_equal(got, w)


def test_a_worker_in_join_cannot_push_from_another_thread(run_threads: Any) -> None:
    tried = threading.Event()     # worker 1 joins only once worker 0 tried its push

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        kv.push("w", np.ones(SHAPE, np.float32))
        kv.pull("w")
        if kv.rank == 1:
            assert tried.wait(20)
            return kv.join()
        joined: list[int] = []
        joining = threading.Thread(target=lambda: joined.append(kv.join()))
        joining.start()
        for _ in range(2000):
            if kv._joining.sent:
                break
            joining.join(0.01)
        try:
            with pytest.raises(UnsupportedError, match=r"is in kv.join\(\)"):
                kv.push("w", np.ones(SHAPE, np.float32))
        finally:
            tried.set()
        joining.join(20)
        return joined

    assert results(run_threads(fn, timeout=30.0)) == {0: [1], 1: 1}


def test_join_while_another_closes_without_joining_fails_naming_it(
        run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        if kv.rank == 0:
            return kv.join()
        return None

    res = run_threads(fn, timeout=30.0)
    assert isinstance(res[0], WorkerClosedError), res[0]
    assert "worker 1 closed its store without reaching kv.join()" in str(res[0])


def test_join_times_out_naming_who_has_not_joined(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(SHAPE, np.float32))
        if kv.rank == 0:
            with pytest.raises(ClusterTimeoutError, match=r"in kv.join\(\) for worker 1 "):
                kv.join(timeout=0.5)
        kv.barrier()
        return True

    assert results(run_threads(fn, timeout=30.0)) == {0: True, 1: True}


# ---- the example of docs/api.md, as written and on a dist_sync cluster ---------------------
def api_example() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = text[text.index("### Uneven data: `kv.join()`"):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_the_docs_example_runs_as_written() -> None:
    scope: dict[str, Any] = {}
    exec(compile(api_example(), "docs/api.md", "exec"), scope)  # noqa: S102 - our docs
    assert scope["last"] == 0
    np.testing.assert_array_equal(scope["final"], np.ones(3, np.float32))


def test_the_docs_example_on_dist_sync(run_threads: Any) -> None:
    """Worker 1 pushes 3 times, worker 0 twice: the last round is worker 1's alone."""
    code = api_example().replace("mx.kv.create('local')", "given")
    assert "given" in code

    def fn(kv: Any) -> Any:
        scope: dict[str, Any] = {"given": kv}
        exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102 - our docs
        return scope["last"], scope["final"]

    for last, final in results(run_threads(fn, timeout=30.0)).values():
        assert last == 1
        np.testing.assert_array_equal(final, np.ones(3, np.float32))
