"""Every store call with CUDA values and outs gives the host path's result, bit for bit
(docs/gpu.md): local, device (one value, two and three per key), dist_sync (two workers,
two servers), dist_device_sync and dist_async, in-process clusters."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.kvstore import _device_io
from pskv.testing import InprocCluster

from _gpu import HAVE_TWO, MARKS, FakeDevice, Make, cuda, host, read, same_bits, torch

pytestmark = MARKS

BIG = 1 << 17          # the reducer's parallel chunks (PARALLEL_MIN)


def scenario(kv: Any, make: Make, rank: int = 0, big: int = BIG) -> list[np.ndarray]:
    """init, push (1, 2, 3 values), pull (1 and 2 outs), key lists, pushpull in place and
    into outs, broadcast, pull(out=None), row_sparse_pull by CUDA row ids, an optimizer."""
    BIG = big  # noqa: N806
    rng = np.random.default_rng(7 + rank)

    def a(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def zeros(*shape: int) -> Any:
        return make(np.zeros(shape, np.float32))

    got: list[np.ndarray] = []
    kv.init("w", make(a(4, 5)))
    kv.init(["k1", "k2"], [make(a(BIG)), make(a(7, 3))])
    got.append(read(kv.pull("w")))
    for n in (1, 2, 3):
        kv.push("w", make(a(4, 5)) if n == 1 else [make(a(4, 5)) for _ in range(n)])
        out = zeros(4, 5)
        kv.pull("w", out=out)
        got.append(read(out))
    kv.push(["k1", "k2"], [[make(a(BIG)), make(a(BIG))], [make(a(7, 3)), make(a(7, 3))]])
    outs = [[zeros(BIG), zeros(BIG)], [zeros(7, 3), zeros(7, 3)]]
    kv.pull(["k1", "k2"], out=outs)
    got += [read(o) for g in outs for o in g]
    v = make(a(4, 5))
    kv.pushpull("w", v)                        # out=None: the result lands in the value
    got.append(read(v))
    vs, os_ = [make(a(4, 5)), make(a(4, 5))], [zeros(4, 5), zeros(4, 5)]
    kv.pushpull("w", vs, out=os_)
    got += [read(o) for o in os_]
    bo = [zeros(3), zeros(3)]
    kv.broadcast("b", make(a(3)), out=bo)
    got += [read(o) for o in bo]
    many = kv.pull(["k2", "b"])
    got += [read(m) for m in many]
    kv.init("emb", mx.nd.array(a(6, 2)).tostype("row_sparse"))
    rsp = mx.nd.sparse.zeros("row_sparse", (6, 2))
    ids = np.array([4, 1, 4, 0], np.int64)
    kv.row_sparse_pull("emb", out=rsp, row_ids=make(ids) if make is not host else ids)
    got += [rsp.indices.asnumpy(), rsp.data.asnumpy()]
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.25, momentum=0.5))
    for _ in range(2):
        kv.push(["w", "k1"], [[make(a(4, 5)), make(a(4, 5))], make(a(BIG))])
        got += [read(x) for x in kv.pull(["w", "k1"])]
    return got


@pytest.mark.parametrize("store_type", ["local", "device"])
def test_local_and_device_stores_match_the_host_path(store_type: str) -> None:
    want = scenario(mx.kv.create(store_type), host)
    kv = mx.kv.create(store_type)
    got = scenario(kv, cuda)
    same_bits(got, want)
    assert isinstance(kv.pull("w"), torch.Tensor) and kv.pull("w").is_cuda  # init's kind


def test_device_store_sums_on_the_gpu_local_on_the_host(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    calls = []
    real = _device_io._gpu_sum
    monkeypatch.setattr(_device_io, "_gpu_sum", lambda th, ts: calls.append(len(ts)) or
                        real(th, ts))
    for store_type, want in (("device", [2, 3]), ("local", [])):
        calls.clear()
        kv = mx.kv.create(store_type)
        kv.init(0, cuda(np.zeros(5, np.float32)))
        kv.push(0, [cuda(np.ones(5, np.float32))] * 2)
        kv.push(0, [cuda(np.ones(5, np.float32))] * 3)
        assert calls == want, store_type
        np.testing.assert_array_equal(read(kv.pull(0)), np.full(5, 3.0, np.float32))


def test_sum_order_is_the_hosts_to_the_bit() -> None:
    # values whose sum depends on the association: (a + b) + c != a + (b + c) in float32
    vals = [np.full(4, 1e8, np.float32), np.full(4, -1e8, np.float32),
            np.full(4, 1.5, np.float32), np.full(4, 3.0e-8, np.float32)]
    results = []
    for make in (host, cuda):
        kv = mx.kv.create("device")
        kv.init(0, make(np.zeros(4, np.float32)))
        kv.push(0, [make(v) for v in vals])
        results.append(read(kv.pull(0)))
    same_bits([results[1]], [results[0]])


@pytest.mark.parametrize("store_type", ["local", "device"])
def test_mixed_host_and_cuda_values_and_outs(store_type: str) -> None:
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    got, want = [], []
    for make_mixed, sink in ((lambda i, x: host(x), want), (lambda i, x: cuda(x) if i % 2
                                                           else host(x), got)):
        kv = mx.kv.create(store_type)
        kv.init(0, host(np.zeros(64, np.float32)))
        kv.push(0, [make_mixed(i, v) for i, v in enumerate(vals)])
        outs = [make_mixed(i, np.zeros(64, np.float32)) for i in range(3)]
        kv.pull(0, out=outs)
        sink.extend(read(o) for o in outs)
    same_bits(got, want)


def test_non_contiguous_tensors_are_read_and_written_through_their_strides() -> None:
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    kv = mx.kv.create("device")
    kv.init(0, np.zeros((5, 4), np.float32))
    kv.push(0, [cuda(x).t(), cuda(x).t()])         # transposed views on the GPU
    out = torch.zeros(4, 5, device="cuda").t()
    kv.pull(0, out=out)
    assert not out.is_contiguous()
    np.testing.assert_array_equal(read(out), 2 * x.T)


def test_compression_on_cuda_values_matches_the_host() -> None:
    rng = np.random.default_rng(5)
    pushes = [[rng.standard_normal(300).astype(np.float32) for _ in range(2)]
              for _ in range(3)]
    results = []
    for make in (host, cuda):
        kv = mx.kv.create("device")
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init(0, make(np.zeros(300, np.float32)))
        for vals in pushes:
            kv.push(0, [make(v) for v in vals])
        results.append(read(kv.pull(0)))
    same_bits([results[1]], [results[0]])


def test_a_steady_loop_allocates_no_pinned_memory() -> None:
    kv = mx.kv.create("device")
    kv.init(["a", "b"], [cuda(np.zeros(1000, np.float32)), cuda(np.zeros(10, np.float32))])
    outs = [cuda(np.zeros(1000, np.float32)), cuda(np.zeros(10, np.float32))]
    for step in range(6):
        kv.pushpull(["a", "b"], [[o, o] for o in outs], out=outs)
        if step == 1:
            pool = kv._device.pool()
            allocated, nbytes = pool.allocated, pool.nbytes
    assert (pool.allocated, pool.nbytes) == (allocated, nbytes)


def _dist(store_type: str, workers: int, servers: int, make: Make) -> dict[int, Any]:
    with InprocCluster(num_workers=workers, num_servers=servers, bigarray_bound=1000) as c:
        results = c.run(lambda kv: scenario(kv, make, kv.rank, BIG), store_type=store_type,
                        timeout=120)
    for rank, got in results.items():
        assert not isinstance(got, BaseException), (rank, got)
    return results


@pytest.mark.parametrize("store_type,workers", [("dist_sync", 2), ("dist_device_sync", 2),
                                                ("dist_async", 1)])
def test_dist_stores_match_the_host_path(store_type: str, workers: int) -> None:
    pytest.importorskip("zmq", reason="the dist stores need pyzmq (pip install pyzmq)")
    want = _dist(store_type, workers, 2, host)
    got = _dist(store_type, workers, 2, cuda)
    for rank in want:
        same_bits(got[rank], want[rank])


@pytest.mark.skipif(not HAVE_TWO, reason="needs two CUDA devices (torch.cuda.device_count())")
def test_values_and_outs_on_two_gpus() -> None:
    rng = np.random.default_rng(9)
    vals = [rng.standard_normal(100).astype(np.float32) for _ in range(2)]
    kv = mx.kv.create("device")
    kv.init(0, cuda(np.zeros(100, np.float32), "cuda:1"))
    kv.push(0, [cuda(vals[0], "cuda:0"), cuda(vals[1], "cuda:1")])
    outs = [cuda(np.zeros(100, np.float32), "cuda:0"), cuda(np.zeros(100, np.float32), "cuda:1")]
    kv.pull(0, out=outs)
    want = vals[0] + vals[1]
    same_bits([read(o) for o in outs], [want, want])
    assert kv.pull(0).device == torch.device("cuda:1")


@pytest.mark.filterwarnings("ignore::UserWarning")  # CuPy/JAX import notes
def test_cupy_arrays_in_and_out() -> None:
    cp = pytest.importorskip(
        "cupy", reason="CuPy is not installed (pip install the cupy build for this CUDA)")
    x = np.arange(12, dtype=np.float32)
    kv = mx.kv.create("device")
    kv.init(0, cp.asarray(x))
    kv.push(0, [cp.asarray(x), cp.asarray(2 * x)])
    out = cp.zeros(12, dtype=cp.float32)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), 3 * x)


@pytest.mark.filterwarnings("ignore::UserWarning")  # CuPy/JAX import notes
def test_jax_arrays_in_and_refused_as_outs() -> None:
    jnp = pytest.importorskip("jax.numpy",
                              reason="JAX is not installed (pip install jax with CUDA)")
    import jax
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU device here")
    x = np.arange(6, dtype=np.float32)
    kv = mx.kv.create("local")
    kv.init(0, np.zeros(6, np.float32))
    kv.push(0, [jax.device_put(jnp.asarray(x), gpus[0])] * 2)
    np.testing.assert_array_equal(kv.pull(0), 2 * x)
    with pytest.raises(mx.errors.DeviceError, match="JAX arrays cannot be written"):
        kv.pull(0, out=jax.device_put(jnp.zeros(6, jnp.float32), gpus[0]))


def test_unreachable_index_is_refused_on_a_gpu_machine() -> None:
    n = torch.cuda.device_count()
    kv = mx.kv.create("local")
    kv.init(0, cuda(np.ones(3, np.float32)))
    with pytest.raises(mx.errors.DeviceError, match=f"cuda:{n}, which this process cannot "
                                                    f"reach: it sees {n} CUDA device"):
        kv.push(0, [cuda(np.ones(3, np.float32)), FakeDevice((3,), index=n)])
    np.testing.assert_array_equal(read(kv.pull(0)), np.ones(3, np.float32))
