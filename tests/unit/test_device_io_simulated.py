"""The staging logic of ``kvstore/_device_io`` on a machine without CUDA: CPU torch tensors
play CUDA tensors (``device_of`` says so, and torch.cuda's streams and events are stubs),
and tests/gpu's scenario must give the host path's bits on every store type.

What this cannot check (the copies' streams, pinned memory, a real GPU sum) tests/gpu does.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import pskv as mx
from pskv.kvstore import _args, _device_io

torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def _load(name: str) -> Any:
    sys.path.insert(0, str(GPU_TESTS))
    try:
        spec = importlib.util.spec_from_file_location(f"_sim_{name}", GPU_TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(GPU_TESTS))


class _Event:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """CPU torch tensors taken for tensors on cuda:0; yields the GPU sums' value counts."""
    def device_of(obj: Any) -> tuple[int, int] | None:
        if isinstance(obj, torch.Tensor):
            return (2, 0)
        return real_device_of(obj)

    real_device_of = _device_io.device_of
    monkeypatch.setattr(_device_io, "device_of", device_of)
    monkeypatch.setattr(_args, "device_of", device_of)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    sums: list[int] = []
    real_sum = _device_io._gpu_sum
    monkeypatch.setattr(_device_io, "_gpu_sum",
                        lambda th, ts: sums.append(len(ts)) or real_sum(th, ts))
    yield sums


def fake_cuda(x: np.ndarray) -> Any:
    return torch.from_numpy(np.array(x, copy=True))


@pytest.mark.parametrize("store_type", ["local", "device"])
def test_scenario_matches_the_host_path(simulated: list[int], store_type: str) -> None:
    gpu = _load("_gpu")
    stores = _load("test_cuda_stores")
    want = stores.scenario(mx.kv.create(store_type), gpu.host)
    kv = mx.kv.create(store_type)
    got = stores.scenario(kv, fake_cuda)
    gpu.same_bits(got, want)
    assert bool(simulated) == (store_type == "device")
    pool = kv._device.pool()
    before = pool.allocated
    for _ in range(3):
        stores.scenario(mx.kv.create(store_type), fake_cuda)
        kv.pushpull("w", [fake_cuda(np.ones((4, 5), np.float32))] * 2)
    assert pool.allocated == before       # this store's buffers are reused


def test_mixed_values_and_outs_match(simulated: list[int]) -> None:
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    results = []
    for mixed in (False, True):
        def make(i: int, x: np.ndarray) -> Any:
            return fake_cuda(x) if mixed and i % 2 else np.array(x, copy=True)
        kv = mx.kv.create("device")
        kv.init(0, np.zeros(64, np.float32))
        kv.push(0, [make(i, v) for i, v in enumerate(vals)])
        outs = [make(i, np.zeros(64, np.float32)) for i in range(3)]
        kv.pull(0, out=outs)
        results.append([np.asarray(o).copy() for o in outs])
    for g, w in zip(*results):
        assert g.tobytes() == w.tobytes()
    assert simulated == []          # a mix is summed on the host, in list order


def test_a_refused_push_lands_and_keeps_nothing(simulated: list[int]) -> None:
    kv = mx.kv.create("device")
    kv.init(0, np.ones(4, np.float32))
    with pytest.raises(mx.ShapeMismatchError):
        kv.push(0, [fake_cuda(np.zeros(4, np.float32)), fake_cuda(np.zeros(5, np.float32))])
    out = fake_cuda(np.zeros(4, np.float32))
    with pytest.raises(mx.KeyNotInitializedError):
        kv.pull([0, 9], out=[out, fake_cuda(np.zeros(4, np.float32))])
    assert out.tolist() == [0.0] * 4
    np.testing.assert_array_equal(kv.pull(0), np.ones(4, np.float32))


@pytest.mark.parametrize("store_type,workers", [("dist_sync", 2), ("dist_device_sync", 2),
                                                ("dist_async", 1)])
def test_dist_scenario_matches_the_host_path(simulated: list[int], store_type: str,
                                             workers: int) -> None:
    pytest.importorskip("zmq", reason="the dist stores need pyzmq (pip install pyzmq)")
    gpu = _load("_gpu")
    stores = _load("test_cuda_stores")
    want = stores._dist(store_type, workers, 2, gpu.host)
    got = stores._dist(store_type, workers, 2, fake_cuda)
    for rank in want:
        gpu.same_bits(got[rank], want[rank])
    assert bool(simulated) == ("device" in store_type)
