"""The worker-side hot-row cache on real servers (docs/embeddings.md, "The hot-row cache").

Thread clusters (``ThreadCluster``): with ``max_pushes=0`` a cached run reads the same
bits as an uncached one (``dist_sync`` with 2 workers, ``dist_async`` with one); with
``K = 1`` a ``dist_sync`` row is at most one round old; the ``set_staleness`` bound caps
``K``; Zipf(1.05) lookups with a cache of 1 % of the rows are served at least 40 % from
it (a count, not a timing); a loaded checkpoint empties the cache; misuse raises on the
worker that made it (the call is not collective) and changes nothing.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, KeyNotInitializedError, UnsupportedError
from pskv.table import Normal, TableSpec

pytestmark = pytest.mark.timeout(120)

DIM = 4


def ok(results: dict[int, Any]) -> dict[int, Any]:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


def spec(dtype: str = "float32") -> TableSpec:
    return TableSpec(dim=DIM, init=Normal(0.0, 0.1), seed=5, dtype=dtype)


def steps(rank: int, n: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(40 + rank)
    out = []
    for _ in range(n):
        ids = np.minimum(rng.zipf(1.3, 24), 40).astype(np.int64) - 20
        out.append((ids, rng.standard_normal((ids.size, DIM)).astype(np.float32)))
    return out


def train(kv: Any, cache: int, max_pushes: int = 0,
          dtype: str = "float32") -> tuple[list[np.ndarray], dict[str, int]]:
    """Per step: a training lookup, an eval lookup of the same IDs (the one a K = 0 cache
    can serve), a push; every value read, and the cache's counters."""
    kv.init("emb", spec(dtype))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.2))
    if cache:
        kv.set_table_cache("emb", cache, max_pushes=max_pushes)
    seen = []
    for ids, grads in steps(kv.rank):
        seen.append(kv.lookup("emb", ids)[0])
        seen.append(kv.lookup("emb", ids[::-1], train=False)[0])
        kv.push("emb", (ids, grads))
    kv.barrier()
    seen.append(kv.lookup("emb", np.arange(-20, 21), train=False)[0])
    return seen, kv.table_cache_stats("emb")


@pytest.mark.parametrize("store_type, workers, dtype", [
    ("dist_sync", 2, "float32"), ("dist_async", 1, "float32"), ("dist_sync", 2, "bfloat16")])
def test_c2_k0_reads_the_same_bits_as_no_cache(store_type: str, workers: int, dtype: str,
                                               run_threads: Any) -> None:
    """(A half table's rows are cached as lookups return them: widened, R17.)"""
    plain = ok(run_threads(lambda kv: train(kv, 0, dtype=dtype), num_workers=workers,
                           num_servers=2, store_type=store_type))
    cached = ok(run_threads(lambda kv: train(kv, 64, dtype=dtype), num_workers=workers,
                            num_servers=2, store_type=store_type))
    for rank in plain:
        for a, b in zip(plain[rank][0], cached[rank][0]):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, b)
        st = cached[rank][1]
        assert st["hits"] > 0 and st["rows"] > 0, st
        assert plain[rank][1]["hits"] == 0


def test_c3_k0_in_dist_async_sees_another_workers_push(run_threads: Any) -> None:
    """Bound 0 across workers: a held row is served while its owner's step is the one it
    was fetched at; worker 1's push moves the step, so worker 0 asks again."""
    ids = np.array([1, 2, 3], np.int64)

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_table_cache("emb", 8, max_pushes=0)
        first = kv.lookup("emb", ids)[0]
        kv.barrier()
        second = kv.lookup("emb", ids)[0]           # nobody pushed: served
        kv.barrier()
        if kv.rank == 1:
            kv.push("emb", (ids, np.full((3, DIM), 3.0, np.float32)))
            kv.lookup("emb", ids)                   # behind its push: applied
        kv.barrier()
        third = kv.lookup("emb", ids)[0]
        kv.barrier()
        return first, second, third, kv.table_cache_stats("emb")

    res = ok(run_threads(fn, num_servers=2, store_type="dist_async"))
    for rank, (first, second, third, st) in res.items():
        np.testing.assert_array_equal(second, first)
        assert (third == 3.0).all(), rank           # no optimizer: the push assigns
        assert st["hits"] >= 3 and st["expired"] >= 3, st


def test_c3_in_dist_sync_k1_serves_rows_one_round_old(run_threads: Any) -> None:
    ids = np.array([1, 2, 3], np.int64)

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_table_cache("emb", 8, max_pushes=1)
        first = kv.lookup("emb", ids)[0]
        kv.push("emb", (ids, np.ones((3, DIM), np.float32)))
        after_one = kv.lookup("emb", ids)[0]              # served: one round old
        kv.push("emb", (ids, np.ones((3, DIM), np.float32)))
        after_two = kv.lookup("emb", ids)[0]              # too old: asked again
        kv.set_table_cache("emb", 0)
        fresh = kv.lookup("emb", ids)[0]
        return first, after_one, after_two, fresh, kv.table_cache_stats("emb")

    for first, after_one, after_two, fresh, st in ok(run_threads(fn)).values():
        np.testing.assert_array_equal(after_one, first)
        np.testing.assert_array_equal(after_two, fresh)
        assert (fresh == 2.0).all()     # no optimizer: a round assigns the sum (R12)
        assert st["capacity"] == 0


def test_c4_the_staleness_bound_caps_max_pushes(run_threads: Any) -> None:
    ids = np.array([7, 8], np.int64)

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_staleness(0)
        kv.set_table_cache("emb", 8, max_pushes=5)
        kv.lookup("emb", ids)
        kv.push("emb", (ids, np.ones((2, DIM), np.float32)))
        got = kv.lookup("emb", ids, train=False)[0]
        kv.set_staleness(None)
        return got, kv.lookup("emb", ids, train=False)[0], kv.table_cache_stats("emb")

    for got, again, st in ok(run_threads(fn, num_workers=1,
                                         store_type="dist_async")).values():
        assert st["expired"] == 2 and st["hits"] == 2           # the last lookup: held
        np.testing.assert_array_equal(got, again)


def test_c6_zipf_traffic_is_served_from_a_cache_of_one_percent_of_the_rows(
        run_threads: Any) -> None:
    """dist_async, 2 workers, 2 servers: lookups of 2048 Zipf(1.05) IDs over 20 000 rows
    (repeats kept), a push after each, a cache of 200 rows with K = 4: at least 40 % of
    the looked-up IDs are served by the cache."""
    n = 20_000

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
        kv.set_table_cache("emb", n // 100, max_pushes=4)
        rng = np.random.default_rng(kv.rank)
        for _ in range(30):
            r = rng.zipf(1.05, 3 * 2048)
            ids = (r[r <= n][:2048] * 7919 - 10**9).astype(np.int64)
            rows, found = kv.lookup("emb", ids)
            assert rows.shape == (ids.size, DIM) and found.all()
            kv.push("emb", (ids, np.full((ids.size, DIM), 0.01, np.float32)))
        return kv.table_cache_stats("emb")

    for st in ok(run_threads(fn, num_servers=2, store_type="dist_async",
                             timeout=90)).values():
        assert st["hits"] / (st["hits"] + st["misses"]) >= 0.40, st
        assert st["rows"] == n // 100


def test_c7_a_loaded_checkpoint_empties_the_cache(run_threads: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    ids = np.array([1, 2], np.int64)

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.lookup("emb", ids)
        kv.save_checkpoint(path)
        saved = kv.lookup("emb", ids, train=False)[0]
        kv.set_table_cache("emb", 8, max_pushes=10)
        kv.push("emb", (ids, np.ones((2, DIM), np.float32)))
        kv.lookup("emb", ids)
        kv.load_checkpoint(path)
        return saved, kv.lookup("emb", ids)[0], kv.table_cache_stats("emb")

    for saved, got, st in ok(run_threads(fn)).values():
        np.testing.assert_array_equal(got, saved)
        assert st["invalidated"] == 2


def test_c1_misuse_raises_on_its_worker_and_changes_nothing(run_threads: Any) -> None:
    """Not collective: worker 1 alone calls it, wrongly and rightly; no one waits."""
    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.init("w", np.zeros((2, 2), np.float32))
        errors = []
        if kv.rank == 1:
            kv.set_table_cache("emb", 4, max_pushes=1)
            for call, cls in ((lambda: kv.set_table_cache("emb", -1), ConfigError),
                              (lambda: kv.set_table_cache("emb", 4, max_pushes=None),
                               ConfigError),
                              (lambda: kv.set_table_cache("w", 4), UnsupportedError),
                              (lambda: kv.set_table_cache("other", 4),
                               KeyNotInitializedError)):
                with pytest.raises(cls) as err:
                    call()
                errors.append(str(err.value))
        kv.lookup("emb", np.array([3, 4]))
        kv.lookup("emb", np.array([3, 4]))
        kv.barrier()
        return errors, kv.table_cache_stats("emb")

    res = ok(run_threads(fn))
    assert res[0][1]["capacity"] == 0 and res[0][1]["hits"] == 0
    errors, st = res[1]
    assert st["capacity"] == 4 and st["hits"] == 2
    assert all("'emb'" in e or "'w'" in e or "'other'" in e for e in errors)


def test_c1_a_workers_cache_is_in_its_metrics(run_threads: Any) -> None:
    """With PSKV_METRICS_PORT, each worker exports its caches' hits, misses and rows."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from prometheus_client import generate_latest
    from pskv.launch._net import free_port

    def fn(kv: Any) -> Any:
        kv.init("emb", spec())
        kv.set_table_cache("emb", 8, max_pushes=1)
        kv.lookup("emb", np.array([1, 2, 3]))
        kv.lookup("emb", np.array([1, 2]))
        text = generate_latest(kv._kv.metrics.registry).decode()
        kv.barrier()
        return text

    for text in ok(run_threads(fn, metrics_port=free_port())).values():
        assert re.search(r'^pskv_worker_table_cache_hits_total\{.*key="emb".*\} 2\.0$', text,
                         re.M), text
        assert re.search(r'^pskv_worker_table_cache_misses_total\{.*\} 3\.0$', text, re.M)
        assert re.search(r'^pskv_worker_table_cache_rows\{.*\} 3\.0$', text, re.M)
