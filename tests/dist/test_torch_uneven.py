"""pskv.torch with uneven data: ``DistributedOptimizer.join()`` (docs/torch.md, "Uneven
data") on thread clusters, workers with different numbers of batches, on the servers'
path and the collective path, in dist_sync and dist_async; the final weights against a
NumPy computation of the rule (a joined worker's gradient is zero, the divisor stays
``num_workers``: DDP's ``Join`` default)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

SIZE = 20000            # 80 kB of float32: one bucket, on the collective path by default
LR = 0.1


def grad(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step, 7])
    return rng.standard_normal(SIZE).astype(np.float32)


def ok(results: dict[int, Any]) -> dict[int, Any]:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return results


@pytest.mark.parametrize("collective", [False, True], ids=["servers", "collective"])
def test_join_averages_over_every_worker(run_threads: Any, collective: bool) -> None:
    """Three workers with 3, 1 and 2 batches: each step moves the weights by the sum of
    the gradients of the workers with a batch left, divided by 3."""
    batches = [3, 1, 2]

    def fn(kv: Any) -> Any:
        w = torch.nn.Parameter(torch.ones(SIZE))
        opt = pt.DistributedOptimizer(torch.optim.SGD([w], lr=LR), [("w", w)], kv,
                                      collective_bytes=65536 if collective else None)
        for step in range(batches[kv.rank]):
            opt.zero_grad()
            w.grad = torch.from_numpy(grad(kv.rank, step))
            opt.step()
        last = opt.join()
        on_path = [str(k) for k, rec in kv._store.items() if rec.collective]
        return last, w.detach().numpy().copy(), on_path

    want = np.ones(SIZE, np.float32)
    for step in range(max(batches)):
        total = sum(grad(r, step) / np.float32(3) for r, n in enumerate(batches) if step < n)
        want = want - np.float32(LR) * total
    res = ok(run_threads(fn, num_workers=3, timeout=60.0,
                         **({} if collective else {"collective_bytes": 0})))
    for last, w, on_path in res.values():
        assert last == 0
        assert bool(on_path) is collective, on_path
        np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res[1][1], res[0][1])     # every worker the same


def test_join_in_async_with_update_on_kvstore(run_threads: Any) -> None:
    """dist_async: the store's optimizer applies each push; join waits for them all."""
    batches = [3, 1]

    def fn(kv: Any) -> Any:
        w = torch.nn.Parameter(torch.zeros(8))
        opt = pt.DistributedOptimizer(None, [("w", w)], kv, update_on_kvstore=True,
                                      kv_optimizer=mx.optimizer.SGD(learning_rate=0.5))
        for _ in range(batches[kv.rank]):
            w.grad = torch.full((8,), float(kv.rank + 1))
            opt.step()
        opt.join()
        return w.detach().numpy().copy()       # join pulled the store's weights

    # each push moves w by 0.5 * grad / 2 (op='average' divides by num_workers)
    want = -0.25 * sum(n * (r + 1.0) for r, n in enumerate(batches))
    for w in ok(run_threads(fn, store_type="dist_async", timeout=60.0)).values():
        np.testing.assert_array_equal(w, np.full(8, want, np.float32))


def test_buffers_stay_each_workers_own_once_rank_0_joined(run_threads: Any) -> None:
    """broadcast_buffers makes buffers rank 0's; once rank 0 joined, a round has no push
    of its buffers, and the others keep their own (not zeros)."""
    def fn(kv: Any) -> Any:
        w = torch.nn.Parameter(torch.zeros(4))
        buf = torch.full((3,), 5.0 + kv.rank)
        opt = pt.DistributedOptimizer(torch.optim.SGD([w], lr=LR), [("w", w)], kv,
                                      named_buffers=[("b", buf)])
        seen = []
        for step in range(1 if kv.rank == 0 else 3):
            w.grad = torch.ones(4)
            opt.step()
            seen.append(buf.clone())
            buf.fill_(7.0 + step)          # rank 1's own statistics from here on
        opt.join()
        return seen

    res = ok(run_threads(fn, timeout=60.0))
    assert torch.equal(res[0][0], torch.full((3,), 5.0))
    assert torch.equal(res[1][0], torch.full((3,), 5.0))         # rank 0's
    assert torch.equal(res[1][1], torch.full((3,), 7.0))         # its own, not zeros
    assert torch.equal(res[1][2], torch.full((3,), 8.0))
