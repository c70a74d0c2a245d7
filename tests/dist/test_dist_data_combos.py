"""pskv.data's Sampler with the features a training loop combines it with (docs/data.md):
a dynamic table key trained by lookups and row pushes beside dense keys, pskv.torch's
DistributedOptimizer (buckets on the servers' or the collective path) and its Embedding
module, uneven data over 3 workers, and ``kv.join`` / ``opt.join`` at the end. Thread
clusters: every loop ends, each sample is trained once an epoch, and in ``dist_sync`` the
values are those of the same loop without a Sampler, bit for bit."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.table import Normal, TableSpec
from test_dist_data import _Split

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _ok(results: dict[int, Any]) -> dict[int, Any]:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return results


def _both(run_threads: Any, fn: Callable[[Any, bool], Any], store_type: str,
          workers: int = 2, servers: int = 2, **kw: Any) -> tuple[dict[int, Any], Any]:
    """``fn(kv, sampled)`` with a Sampler; and without one in ``dist_sync`` (else None)."""
    got = _ok(run_threads(lambda kv: fn(kv, True), num_workers=workers,
                          num_servers=servers, store_type=store_type, **kw))
    want = None
    if store_type == "dist_sync":
        want = _ok(run_threads(lambda kv: fn(kv, False), num_workers=workers,
                               num_servers=servers, store_type=store_type, **kw))
    return got, want


def _sampler(kv: Any, sampled: bool, n: int, batch: int, epochs: int) -> Any:
    """This worker's batches: a Sampler of ``kv``, or the same split as a list."""
    if sampled:
        s = mx.data.Sampler(kv, n, batch, epochs=epochs, seed=3)
        assert s.start == 0 and kv._data_sealing()
        return s
    return list(mx.data.Sampler(_Split(kv.rank, kv.num_workers), n, batch, epochs=epochs,
                                seed=3))


# ---- 1. a dynamic table key beside dense keys -----------------------------------------
N1, DIM = 40, 4


def _ids(idx: np.ndarray) -> np.ndarray:
    """Raw 64-bit IDs of the samples (shared between samples: a round sums rows)."""
    return (idx % 13).astype(np.int64) * 1_000_003 - 2**40


def _table_loop(kv: Any, sampled: bool, opt: Callable[[], Any],
                readback: bool = False) -> dict[str, np.ndarray]:
    """A step: pull "w", a training lookup of the samples' IDs, a row push of gradients
    that depend on the rows and "w", pushes of "seen" and "w"; ``readback``: then an eval
    lookup of the rows just pushed (it waits for this worker's round, D5)."""
    kv.init("emb", TableSpec(dim=DIM, init=Normal(0.0, 0.1), seed=11,
                             optimizer=mx.optimizer.AdaGrad(learning_rate=0.1)))
    kv.init(["seen", "w"], [mx.nd.zeros(N1), mx.nd.ones(DIM)])
    kv.set_optimizer(opt())
    batches = _sampler(kv, sampled, N1, 3, 2)
    w = mx.nd.zeros(DIM)
    for idx in batches:
        kv.pull("w", out=w)
        ids = _ids(idx)
        rows, found = kv.lookup("emb", ids)
        assert found.all()
        wv = w.asnumpy()
        grads = (rows * wv * 0.1 + idx[:, None] / 100.0).astype(np.float32)
        seen = np.zeros(N1, np.float32)
        np.add.at(seen, idx, -1.0)
        kv.push("emb", (ids, grads))
        kv.push(["seen", "w"], [mx.nd.array(seen),
                                mx.nd.array((rows.sum(0) * 0.01 + wv * 0.05).astype(np.float32))])
        if readback:
            after, _ = kv.lookup("emb", ids, train=False)
            assert not np.array_equal(after, rows)
    kv.barrier()
    every = _ids(np.arange(13))
    rows, found = kv.lookup("emb", every, train=False)
    out = {k: kv.pull(k).asnumpy() for k in ("seen", "w")}
    out["emb"], out["found"] = rows, found
    kv.barrier()
    return out


@pytest.mark.parametrize("readback", [False, True])
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_a_table_key_beside_dense_keys(run_threads: Any, store_type: str,
                                       readback: bool) -> None:
    def opt() -> Any:
        return mx.optimizer.SGD(learning_rate=1.0)   # "seen" counts each sample's pushes

    got, want = _both(run_threads, lambda kv, s: _table_loop(kv, s, opt, readback),
                      store_type)
    for r in got.values():
        np.testing.assert_array_equal(r["seen"], np.full(N1, 2.0))
        assert r["found"].all()
    if want is not None:
        for k in ("seen", "w", "emb"):
            np.testing.assert_array_equal(got[0][k], want[0][k], err_msg=k)
            np.testing.assert_array_equal(got[1][k], want[0][k], err_msg=k)


# ---- 2. pskv.torch: DistributedOptimizer (servers or collective path), Embedding -------
N2, F2 = 36, 5


def _torch_loop(kv: Any, sampled: bool, collective: bool, embedding: bool,
                overlap: bool = True, n: int = N2, join: bool = False,
                on_kvstore: bool = False, prefetch: bool = False) -> dict[str, np.ndarray]:
    """A torch MLP trained by torch's SGD on the averaged gradients
    (``update_on_kvstore=False``, buckets of a few parameters each: several keys a step),
    beside a table of the samples' IDs through ``pt.Embedding``; every step also pushes
    its samples to "seen" (no store optimizer: a round's value is the sum of the pushes,
    added up here). ``join``: ``opt.join()`` after the last step; ``on_kvstore``: the
    store's SGD updates the weights instead (and counts "seen" itself); ``prefetch``: the
    Embedding looks up the next batch's IDs on its thread during the step."""
    import torch

    import pskv.torch as pt
    width = F2 + (DIM if embedding else 0)
    mlp = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1))
    init = np.random.default_rng(1)    # not torch's global generator: the workers are threads
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.from_numpy(init.uniform(-0.5, 0.5, tuple(p.shape)).astype(np.float32)))
    emb = pt.Embedding(kv, "emb", TableSpec(
        dim=DIM, init=Normal(0.0, 0.1), seed=5,
        optimizer=mx.optimizer.SGD(learning_rate=0.2))) if embedding else None
    if on_kvstore:
        opt = pt.DistributedOptimizer(None, mlp.named_parameters(), kv, bucket_cap_mb=0.00003,
                                      update_on_kvstore=True, overlap=overlap,
                                      kv_optimizer=mx.optimizer.SGD(learning_rate=1.0))
    else:
        opt = pt.DistributedOptimizer(
            torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9), mlp.named_parameters(),
            kv, bucket_cap_mb=0.00003, collective_bytes=1 if collective else None,
            overlap=overlap)
    kv.set_collective("seen", False) if collective else None
    kv.init("seen", mx.nd.zeros(n))
    on_path = sorted(str(k) for k, rec in kv._store.items() if getattr(rec, "collective", 0))
    if collective:
        assert len(on_path) >= 2, on_path       # every bucket sums among the workers
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.standard_normal((n, F2)), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((n, 1)), dtype=torch.float32)
    seen = np.zeros(n, np.float32)
    got = mx.nd.zeros(n)
    batches = _sampler(kv, sampled, n, 4, 2)
    ahead = list(mx.data.Sampler(_Split(kv.rank, kv.num_workers), n, 4, epochs=2, seed=3))
    for t, idx in enumerate(batches):
        ib = torch.from_numpy(idx)
        xb = x[ib]
        if emb is not None:
            xb = torch.cat([xb, emb(torch.from_numpy(_ids(idx)))], dim=1)
            if prefetch and t + 1 < len(ahead):
                emb.prefetch(torch.from_numpy(_ids(ahead[t + 1])))
        loss = torch.nn.functional.mse_loss(mlp(xb), y[ib])
        opt.zero_grad()
        loss.backward()
        one = np.zeros(n, np.float32)
        np.add.at(one, idx, -1.0 if on_kvstore else 1.0)
        kv.push("seen", mx.nd.array(one))
        opt.step()
        if not on_kvstore:
            kv.pull("seen", out=got)
            seen += got.asnumpy()
    if emb is not None:
        emb.synchronize()
    if join:
        opt.join(timeout=20)
    kv.barrier()
    if on_kvstore:
        seen = kv.pull("seen").asnumpy()
    out = {f"p{i}": p.detach().numpy().copy() for i, p in enumerate(mlp.parameters())}
    out["seen"] = seen
    if emb is not None:
        out["emb"] = kv.lookup("emb", _ids(np.arange(13)), train=False)[0]
        emb.close()
    kv.barrier()
    opt.close()
    return out


@pytest.mark.parametrize("collective, embedding, overlap, prefetch", [
    (False, False, True, False), (True, False, True, False), (True, True, True, False),
    (False, True, False, False), (True, True, True, True)])
def test_torch_distributed_optimizer_and_embedding(run_threads: Any, collective: bool,
                                                   embedding: bool, overlap: bool,
                                                   prefetch: bool) -> None:
    pytest.importorskip("torch", reason="pskv.torch needs torch: pip install 'pskv[torch]'")
    got, want = _both(run_threads, lambda kv, s: _torch_loop(
        kv, s, collective, embedding, overlap, prefetch=prefetch), "dist_sync")
    for r in got.values():
        np.testing.assert_array_equal(r["seen"], np.full(N2, 2.0))
    for k in want[0]:
        for r in (0, 1):
            np.testing.assert_array_equal(got[r][k], want[0][k], err_msg=k)


def test_torch_with_embedding_in_dist_async_runs_to_the_end(run_threads: Any) -> None:
    pytest.importorskip("torch", reason="pskv.torch needs torch: pip install 'pskv[torch]'")
    got, _ = _both(run_threads, lambda kv, s: _torch_loop(kv, s, False, True), "dist_async")
    for r in got.values():
        assert np.isfinite(r["emb"]).all() and np.isfinite(r["p0"]).all()


# ---- 3. uneven data over 3 workers; kv.join() / opt.join() ----------------------------
N3, BATCH3, EPOCHS3 = 50, 4, 2          # 50 = 4 steps of 3 x 4, and 2 left over per epoch


def _uneven_loop(kv: Any, sampled: bool, join: str) -> dict[str, np.ndarray]:
    """The counting loop of test_dist_data.py; ``join``: "" none, "end" kv.join() after the
    last step, "epoch" after each epoch's last step, "early" worker 2 stops after step 2
    and joins (the others train on, then join)."""
    kv.init(["seen", "w"], [mx.nd.zeros(N3), mx.nd.ones(8)])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    batches = _sampler(kv, sampled, N3, BATCH3, EPOCHS3)
    per = (N3 // (kv.num_workers * BATCH3))
    w = mx.nd.zeros(8)
    sizes = []
    for t, idx in enumerate(batches):
        if join == "early" and kv.rank == 2 and t == 3:
            break
        sizes.append(len(idx))
        kv.pull("w", out=w)
        seen = np.zeros(N3, np.float32)
        np.add.at(seen, idx, -1.0)
        grad = (w.asnumpy() * 0.05 + idx.sum() / 1000.0).astype(np.float32)
        kv.push(["seen", "w"], [mx.nd.array(seen), mx.nd.array(grad)])
        if join == "epoch" and t % per == per - 1:
            kv.join(timeout=20)
    if join in ("end", "early"):
        kv.join(timeout=20)
    kv.barrier()
    out = {k: kv.pull(k).asnumpy() for k in ("seen", "w")}
    out["sizes"] = np.array(sizes)
    return out


@pytest.mark.parametrize("join", ["", "end", "epoch", "early"])
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_uneven_data_over_three_workers(run_threads: Any, store_type: str, join: str) -> None:
    got, want = _both(run_threads, lambda kv, s: _uneven_loop(kv, s, join), store_type,
                      workers=3)
    if join != "early":
        for r in got.values():
            np.testing.assert_array_equal(r["seen"], np.full(N3, float(EPOCHS3)))
        # every worker takes the same steps; the last of an epoch takes the rest (D2)
        assert [list(got[r]["sizes"]) for r in range(3)] == [
            [4, 4, 4, 5] * 2, [4, 4, 4, 5] * 2, [4, 4, 4, 4] * 2]
    if want is not None:
        for k in ("seen", "w"):
            for r in range(3):
                np.testing.assert_array_equal(got[r][k], want[0][k], err_msg=k)


@pytest.mark.parametrize("store_type, on_kvstore, collective", [
    ("dist_sync", False, False), ("dist_sync", False, True), ("dist_sync", True, False),
    ("dist_async", True, False)])
def test_torch_uneven_data_and_opt_join(run_threads: Any, store_type: str,
                                        on_kvstore: bool, collective: bool) -> None:
    """3 workers, 46 samples (3 steps of 3 x 4 and 10 left over), opt.join() at the end.
    (dist_async without a store optimizer: a push replaces the value, nothing to count.)"""
    pytest.importorskip("torch", reason="pskv.torch needs torch: pip install 'pskv[torch]'")
    got, want = _both(run_threads, lambda kv, s: _torch_loop(
        kv, s, collective, True, n=46, join=True, on_kvstore=on_kvstore), store_type,
        workers=3)
    for r in got.values():
        np.testing.assert_array_equal(r["seen"], np.full(46, 2.0))
    if want is not None:
        for k in want[0]:
            for r in range(3):
                np.testing.assert_array_equal(got[r][k], want[0][k], err_msg=k)


# ---- what cannot work: a second Sampler of a store, a second pass (D9) ------------------
def test_a_sampler_per_epoch_or_a_second_pass_is_refused(run_threads: Any) -> None:
    """A Sampler made per epoch would start at the step the first one reached (and train
    one batch of the epoch); a second pass would train every sample again."""
    from pskv.errors import ConfigError

    def fn(kv: Any) -> list[int]:
        first = mx.data.Sampler(kv, 20, 2, epochs=1, seed=0)
        steps = [len(list(first))]
        with pytest.raises(ConfigError, match="has a Sampler already"):
            mx.data.Sampler(kv, 20, 2, epochs=1, seed=1)
        with pytest.raises(ConfigError, match="iterated a second time"):
            steps.append(len(list(first)))
        return steps

    for steps in _ok(run_threads(fn)).values():
        assert steps == [5]
