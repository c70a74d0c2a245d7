"""pskv.compression against real MXNet 1.9.1's 2bit gradient compression.

MXNet 1.9.1 exposes no quantize/dequantize operator (the ``_contrib_quantize_2bit``
operators of 1.0 are gone), so the codec is observed through a ``device`` store:
each push quantizes every device's value with that device's residual, dequantizes and
sums, and a pull returns that sum. The direct tests run only the MXNet side and
compute pskv's expectation with :mod:`pskv.compression` itself (no pskv store
involved); the last test runs the same scenario on both stores. Packed words never
leave MXNet's ``device`` store, so their layout is pinned by the unit tests, written
from ``gradient_compression-inl.h``. Tolerance: none, every value must be bit-equal.
"""
from __future__ import annotations

import numpy as np
import pytest

from pskv.compression import create, normalize_params
from pskv.errors import ConfigError

from .harness import assert_results_close, run_both, run_scenario

pytestmark = pytest.mark.mxnet

F32 = np.float32

_DEVICE_SCENARIO = """
rng = np.random.default_rng({seed})
shape = {shape}
kv = mx.kv.create('device')
kv.set_gradient_compression({{'type': '2bit', 'threshold': {threshold!r}}})
kv.init(0, mx.nd.zeros(shape))
grads, pulls = [], []
for step in range({steps}):
    gs = [(rng.standard_normal(shape) * {scale}).astype(np.float32) for _ in range({devices})]
    grads.append(gs)
    kv.push(0, [mx.nd.array(g, ctx=mx.cpu(i)) for i, g in enumerate(gs)])
    out = mx.nd.zeros(shape)
    kv.pull(0, out=out)
    pulls.append(out.asnumpy())
result['grads'] = np.array(grads)
result['pulls'] = np.array(pulls)
"""


def expected_pulls(threshold: object, grads: np.ndarray) -> np.ndarray:
    """What MXNet's device store pulls after each push, computed with pskv.compression."""
    gc = create({"type": "2bit", "threshold": threshold})
    assert gc is not None
    steps, devices = grads.shape[:2]
    residuals = [np.zeros(grads[0, 0].size, F32) for _ in range(devices)]
    pulls = []
    for step in range(steps):
        merged = np.zeros(grads[0, 0].shape, F32)
        for dev in range(devices):
            merged += gc.roundtrip(grads[step, dev], residuals[dev])
        pulls.append(merged)
    return np.array(pulls)


@pytest.mark.parametrize("shape, threshold, devices, scale", [
    ((3, 7), 0.5, 3, 0.6),         # 21 values: a padded last word
    ((1,), 0.5, 2, 0.4),
    ((16,), 0.25, 1, 0.3),         # one device: MXNet still compresses (comm.h Reduce)
    ((33,), "0.1", 4, 0.1),
    ((5, 5), 1.8326419, 2, 2.0),   # a threshold dmlc::stof rounds differently
    ((70001,), 0.3, 2, 0.5),       # more than one pskv chunk
])
def test_device_store_matches_codec(shape: tuple[int, ...], threshold: object, devices: int,
                                    scale: float) -> None:
    src = _DEVICE_SCENARIO.format(seed=sum(shape) + devices, shape=shape, threshold=threshold,
                                  steps=6, scale=scale, devices=devices)
    ref = run_scenario(src, use_mxnet=True)
    assert ref["__error__"] is None, ref["__error__"]
    want = ref["pulls"]
    got = expected_pulls(threshold, ref["grads"])
    assert got.dtype == want.dtype == F32
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(want) > 0


def test_threshold_boundaries_and_residual_arithmetic() -> None:
    # values that land exactly on +-t, just inside, and accumulate across pushes
    t = 0.3
    eps = float(np.nextafter(F32(t), F32(1)) - F32(t))
    row = [t, -t, t - eps, -(t - eps), t + eps, 0.1, 0.1, -0.1, 0.2, 1e30, -1e30, 0.0,
           0.15, 0.15, 2 * t, -2 * t, 7.0]
    grads = np.array([[row, row[::-1]]] * 4, F32)
    src = f"""
grads = np.array({grads.tolist()!r}, dtype=np.float32)
kv = mx.kv.create('device')
kv.set_gradient_compression({{'type': '2bit', 'threshold': {t!r}}})
kv.init('w', mx.nd.zeros((len(grads[0][0]),)))
pulls = []
for gs in grads:
    kv.push('w', [mx.nd.array(g, ctx=mx.cpu(i)) for i, g in enumerate(gs)])
    out = mx.nd.zeros((len(grads[0][0]),))
    kv.pull('w', out=out)
    pulls.append(out.asnumpy())
result['pulls'] = np.array(pulls)
"""
    ref = run_scenario(src, use_mxnet=True)
    assert ref["__error__"] is None, ref["__error__"]
    np.testing.assert_array_equal(expected_pulls(t, grads), ref["pulls"])


@pytest.mark.parametrize("threshold", [
    "0.5", "1", "2.5", "1e-05", "3.3e+2", "0.1f", " 2.5", "1.8326419", "7.2e-1", "3.987116",
    "6.85e-12", "8.72371909e-7", "11.929698452491", "0.1234567890123456789012",
    0.1, 1.1, 0.7, 3e-7, 12345.678,
])
def test_threshold_parsing(threshold: object) -> None:
    # one push of a huge value is dequantized to +threshold: MXNet's parsed float32
    src = f"""
kv = mx.kv.create('device')
kv.set_gradient_compression({{'type': '2bit', 'threshold': {threshold!r}}})
kv.init(0, mx.nd.zeros((1,)))
kv.push(0, mx.nd.array([1e30]))
out = mx.nd.zeros((1,))
kv.pull(0, out=out)
result['t'] = float(out.asnumpy()[0])
"""
    ref = run_scenario(src, use_mxnet=True)
    assert ref["__error__"] is None, ref["__error__"]
    assert normalize_params({"type": "2bit", "threshold": threshold})["threshold"] == ref["t"]


@pytest.mark.parametrize("params", [
    {"type": "3bit"},
    {"type": "2bit", "threshold": 0},
    {"type": "2bit", "threshold": -0.5},
    {"type": "2bit", "threshold": "abc"},
    {"type": "2bit", "threshold": "0.5x"},
    {"type": "2bit", "threshold": "1e-50"},
    {"threshold": 0.5},
])
def test_bad_params_rejected_by_both(params: dict[str, object]) -> None:
    src = f"""
kv = mx.kv.create('device')
kv.set_gradient_compression({params!r})
"""
    ref = run_scenario(src, use_mxnet=True)
    assert ref["__error__"] is not None, "MXNet accepted the parameters"
    # MXNet raises MXNetError (a RuntimeError); pskv raises ConfigError (a ValueError)
    assert "RuntimeError" in ref["__error__"][1]
    with pytest.raises(ConfigError):
        create(params)


def test_kvstore_device_scenario_run_both() -> None:
    """The whole path through pskv's ``device`` store, against MXNet's."""
    src = """
rng = np.random.default_rng(5)
kv = mx.kv.create('device')
kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
shapes = {3: (4, 5), 9: (17,), 11: (2, 40)}
for k, s in shapes.items():
    kv.init(k, mx.nd.zeros(s))
for step in range(5):
    for k, s in shapes.items():
        kv.push(k, [mx.nd.array((rng.standard_normal(s) * 0.7).astype(np.float32),
                                ctx=mx.cpu(i)) for i in range(3)])
    for k, s in shapes.items():
        outs = [mx.nd.zeros(s, ctx=mx.cpu(i)) for i in range(2)]
        kv.pull(k, out=outs)
        result['k%d_step%d' % (k, step)] = outs[0]
        result['k%d_step%d_dev1' % (k, step)] = outs[1]
"""
    ref, got = run_both(src)
    assert_results_close(ref, got, rtol=0, atol=0)
