"""CUDA input refused on a machine without CUDA, with fakes that report a device through
``__dlpack_device__`` (docs/gpu.md, "Bad input"); tests/gpu checks the real copies.

Each refusal is a DeviceError (a ValueTypeError, so a TypeError) naming the key and the
device, and a refused call changes nothing.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import DeviceError, ValueTypeError
from pskv.kvstore._device_io import DeviceIO, device_of, has_device


class FakeDevice:
    """An array that says it lives on DLPack device ``(kind, index)`` (2: CUDA)."""

    def __init__(self, shape: tuple[int, ...] = (2, 3), kind: int = 2, index: int = 0) -> None:
        self.shape = shape
        self.dtype = np.dtype("float32")
        self._dev = (kind, index)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._dev

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("a fake: no memory behind it")


class FakeJax(FakeDevice):
    """A fake whose class says it is a JAX array."""


FakeJax.__module__ = "jaxlib.xla_extension"


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_device_of_tells_host_from_device() -> None:
    assert device_of(np.zeros(2)) is None
    assert device_of(mx.nd.zeros((2,))) is None
    assert device_of([1, 2]) is None
    assert device_of(FakeDevice()) == (2, 0)
    assert device_of(FakeDevice(kind=1)) is None          # kDLCPU
    assert device_of(FakeDevice(kind=3)) is None          # kDLCUDAHost: host-readable
    assert not has_device([[np.zeros(2), mx.nd.zeros((2,))]])
    assert has_device([[np.zeros(2)], [np.zeros(2), FakeDevice()]])


def test_host_groups_come_back_unchanged() -> None:
    io = DeviceIO("device")
    groups = [[np.zeros(3)], [mx.nd.zeros((3,))]]
    got, staged = io.values([1, 2], groups, {})
    assert got is groups and staged is None
    got, landing = io.outs([1, 2], groups)
    assert got is groups and landing is None


@pytest.mark.skipif(_cuda_count() > 5, reason="cuda:5 must be out of reach")
@pytest.mark.parametrize("store_type", ["local", "device"])
def test_unreachable_device_is_refused_and_changes_nothing(store_type: str) -> None:
    kv = mx.kv.create(store_type)
    kv.init("w", mx.nd.ones((2, 3)))
    # with torch the device is out of its reach; without it, torch is what is missing
    reason = (r"key 'w' is on cuda:5, which this process cannot reach" if _has_torch() else
              r"key 'w' is a FakeDevice in cuda:5 memory, .* PyTorch, which is not installed")
    with pytest.raises(DeviceError, match=reason) as info:
        kv.push("w", [mx.nd.ones((2, 3)) * 7, FakeDevice(index=5)])   # host + CUDA mixed
    assert info.value.key == "w" and info.value.device == "cuda:5"
    assert isinstance(info.value, ValueTypeError) and isinstance(info.value, TypeError)
    np.testing.assert_array_equal(kv.pull("w").asnumpy(), np.ones((2, 3)))
    with pytest.raises(DeviceError, match="cuda:5"):
        kv.init("v", FakeDevice(index=5))
    with pytest.raises(DeviceError, match="cuda:5"):
        kv.pull("w", out=FakeDevice(index=5))
    with pytest.raises(DeviceError, match="cuda:5"):
        kv.pushpull("w", mx.nd.zeros((2, 3)), out=[mx.nd.zeros((2, 3)), FakeDevice(index=5)])
    with pytest.raises(DeviceError, match="cuda:5"):
        kv.broadcast("b", FakeDevice(index=5), out=mx.nd.zeros((2, 3)))
    np.testing.assert_array_equal(kv.pull("w").asnumpy(), np.ones((2, 3)))
    with pytest.raises(mx.KeyNotInitializedError):
        kv.pull("v")
    with pytest.raises(mx.KeyNotInitializedError):
        kv.pull("b")


@pytest.mark.skipif(_cuda_count() > 0, reason="needs a machine without CUDA")
def test_no_cuda_at_all_names_the_device_count() -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((2, 3)))
    reason = (r"key 3 is on cuda:0, which this process cannot reach: it sees 0 CUDA device\(s\)"
              if _has_torch() else r"key 3 is a FakeDevice in cuda:0 memory, .* not installed")
    with pytest.raises(DeviceError, match=reason):
        kv.push(3, FakeDevice())


def test_other_device_kinds_are_refused() -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((2, 3)))
    with pytest.raises(DeviceError, match="rocm:1 memory; pskv stores read host and CUDA "
                                          "memory only") as info:
        kv.push(3, FakeDevice(kind=10, index=1))
    assert info.value.device == "rocm:1" and info.value.key == 3


def test_jax_out_is_refused_before_anything() -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2, 3)))
    out = mx.nd.zeros((2, 3))
    with pytest.raises(DeviceError, match="JAX arrays cannot be written in place"):
        kv.pull(3, out=[out, FakeJax()])
    np.testing.assert_array_equal(out.asnumpy(), np.zeros((2, 3)))   # nothing landed


def test_cuda_without_torch_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch raises ImportError
    kv = mx.kv.create("device")
    kv.init("w", mx.nd.ones((2, 3)))
    with pytest.raises(DeviceError, match=r"key 'w' is a FakeDevice in cuda:0 memory, and "
                                          r"pskv reads CUDA arrays through PyTorch, which is "
                                          r"not installed") as info:
        kv.push("w", FakeDevice())
    assert info.value.device == "cuda:0"
    np.testing.assert_array_equal(kv.pull("w").asnumpy(), np.ones((2, 3)))


def test_cuda_row_ids_are_checked_too() -> None:
    kv = mx.kv.create("local")
    kv.init("emb", mx.nd.ones((6, 2)).tostype("row_sparse"))
    out = mx.nd.sparse.zeros("row_sparse", (6, 2))
    with pytest.raises(DeviceError, match="row_ids for key 'emb'"):
        kv.row_sparse_pull("emb", out=out, row_ids=FakeDevice((3,), index=7))


def test_dist_store_refuses_on_every_call() -> None:
    pytest.importorskip("zmq", reason="the dist stores need pyzmq (pip install pyzmq)")
    from pskv.testing import InprocCluster

    def fn(kv: Any) -> Any:
        kv.init("w", mx.nd.ones((4,)))
        errors = []
        for call in (lambda: kv.push("w", FakeDevice((4,), index=9)),
                     lambda: kv.pull("w", out=FakeDevice((4,), index=9)),
                     lambda: kv.pushpull("w", FakeDevice((4,), index=9)),
                     lambda: kv.init("x", FakeDevice((4,), index=9))):
            try:
                call()
            except DeviceError as err:
                errors.append((err.key, err.device))
        return errors, kv.pull("w").asnumpy()

    with InprocCluster(num_workers=1) as cluster:
        results = cluster.run(fn, store_type="dist_device_sync")
    errors, value = results[0]
    assert errors == [("w", "cuda:9")] * 3 + [("x", "cuda:9")]
    np.testing.assert_array_equal(value, np.ones(4))


def test_torch_model_on_two_devices_names_the_parameter() -> None:
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    from pskv.torch._broadcast import check_one_device
    named: Any = [("fc1.weight", SimpleNamespace(device="cuda:0")),
                  ("fc1.bias", SimpleNamespace(device="cuda:0")),
                  ("fc2.weight", SimpleNamespace(device="cpu"))]
    with pytest.raises(DeviceError, match=r"parameter 'fc2.weight' is on cpu, but "
                                          r"'fc1.weight' is on cuda:0") as info:
        check_one_device(named, "DistributedOptimizer")
    assert info.value.key == "fc2.weight"
    check_one_device(named[:2], "DistributedOptimizer")


def test_torch_meta_tensors_are_refused() -> None:
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import pskv.torch as pt
    kv = mx.kv.create("local")
    with pytest.raises(DeviceError, match="tensor 'w' is on device meta"):
        pt.broadcast_parameters({"w": torch.zeros(2, device="meta")}, kv)
