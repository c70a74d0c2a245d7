"""pskv.torch.Embedding / EmbeddingBag over a table key of a dist store, on thread clusters
of 2 workers: the rows equal those of one process that pushes both workers' gradients.

With prefetch the workers use disjoint IDs: a prefetched lookup re-reads the rows its own
module pushed since, not those another worker pushed in the same step (docs/torch.md)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import TableIdError  # noqa: E402
from pskv.kvstore.dist import DistKVStore  # noqa: E402
from pskv.table import TableSpec, Uniform  # noqa: E402

pytestmark = [
    pytest.mark.dist, pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(DistKVStore, "lookup"),
                       reason="this build's dist stores hold no table keys (no "
                              "DistKVStore.lookup); they need the servers' table support "
                              "(docs/embeddings.md)")]

DIM, LR, STEPS = 4, 0.3, 3
SPEC = TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=9)


def batches(rank: int, disjoint: bool) -> list[Any]:
    """IDs in [-8, 9]; with ``disjoint`` worker 0's even, worker 1's odd."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = [torch.randint(-2**40, 2**40, (6,), generator=g) for _ in range(STEPS)]
    return [(i % 9 - 4) * 2 + rank if disjoint else i % 18 - 8 for i in ids]


def loss(out: Any) -> Any:
    return (out * out).sum() + out.sum()


@pytest.mark.parametrize("prefetch", [False, True])
def test_embedding_on_dist_sync_equals_one_process(run_threads: Any, prefetch: bool) -> None:
    probe = torch.arange(-8, 10)
    with mx.kv.create("local") as kv:                 # one process: both workers' batches
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
        emb = pt.Embedding(kv, "emb", SPEC)
        for a, b in zip(batches(0, prefetch), batches(1, prefetch)):
            loss(emb(torch.cat([a, b]))).backward()   # one push of both gradients summed
        emb.synchronize()
        want = kv.lookup("emb", probe.numpy(), train=False)[0]
        emb.close()

    def fn(kv: Any) -> Any:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
        emb = pt.Embedding(kv, "emb", SPEC)
        bag = pt.EmbeddingBag(kv, "emb", DIM, mode="sum")
        with pytest.raises(TableIdError):
            emb(torch.tensor([1.0]))
        mine = batches(kv.rank, prefetch)
        for n, ids in enumerate(mine):
            out = emb(ids)
            if prefetch and n + 1 < STEPS:
                emb.prefetch(mine[n + 1])
            loss(out).backward()
        emb.synchronize()
        rows = kv.lookup("emb", probe.numpy(), train=False)[0]
        pooled = bag.eval()(probe, torch.tensor([0, 5]))     # read-only: inserts nothing
        emb.close()
        bag.close()
        return rows, pooled

    results = run_threads(fn)
    for rank, got in results.items():
        assert not isinstance(got, BaseException), got
        np.testing.assert_allclose(got[0], want, atol=1e-5, err_msg=f"worker {rank}")
        sums = torch.stack([torch.from_numpy(want[:5]).sum(0),
                            torch.from_numpy(want[5:]).sum(0)])
        assert torch.allclose(got[1], sums, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_with_a_row_cache_and_half_rows_equals_without(run_threads: Any,
                                                                 dtype: str) -> None:
    """pskv.torch.Embedding reads through a worker's hot-row cache (kv.lookup): with
    max_pushes=0 in dist_sync the rows and the module's outputs are the same bits as
    without a cache, for float32 and bfloat16 tables (float32 tensors either way)."""
    spec = TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=9, dtype=dtype)

    def fn(kv: Any, cache: bool) -> Any:
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=LR))
        emb = pt.Embedding(kv, "emb", spec)
        if cache:
            kv.set_table_cache("emb", 16, max_pushes=0)
        outs = []
        for ids in batches(kv.rank, False) * 2:
            out = emb(ids)
            outs.append(out.detach().numpy().copy())
            loss(out).backward()
            emb.synchronize()
            outs.append(emb.eval()(ids).detach().numpy().copy())   # a read the cache serves
            emb.train()
        stats = kv.table_cache_stats("emb") if cache else None
        emb.close()
        return outs, stats

    plain = run_threads(lambda kv: fn(kv, False))
    cached = run_threads(lambda kv: fn(kv, True))
    for rank in plain:
        for got in (plain[rank], cached[rank]):
            assert not isinstance(got, BaseException), got
        for a, b in zip(plain[rank][0], cached[rank][0]):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, b)
        assert cached[rank][1]["hits"] > 0, cached[rank][1]
