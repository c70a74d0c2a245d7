"""Differential tests: ``mx.nd`` shapes, dtypes and values against real MXNet 1.9.1.

The legacy NDArray rules pskv follows (no 0-d results, float32 ``nd.array``, scalar
operands that keep the dtype) are checked here against MXNet itself; the unit tests in
``tests/unit/test_nd_legacy.py`` pin them without MXNet.
"""
from __future__ import annotations

import numpy as np
import pytest

from .harness import run_both

pytestmark = pytest.mark.mxnet

_SHAPES_AND_DTYPES = """
a = mx.nd.array(np.arange(6).reshape(2, 3))
b = mx.nd.array([1, 2, 3])
result["shape_a00"] = list(a[0][0].shape)
result["shape_a_1_2"] = list(a[1, 2].shape)
result["shape_a1"] = list(a[1].shape)
result["shape_col"] = list(a[:, 1].shape)
result["shape_b_last"] = list(b[-1].shape)
result["shape_iter"] = [list(x.shape) for x in b]
result["shape_sum"] = list(a.sum().shape)
result["shape_sum0"] = list(b.sum(axis=0).shape)
result["shape_mean"] = list(a.mean().shape)
result["shape_max"] = list(a.max().shape)
result["value_a12"] = float(a[1][2].asnumpy()[0])
result["value_sum"] = float(a.sum().asnumpy()[0])
result["dtype_f64"] = str(np.dtype(mx.nd.array(np.zeros(3)).dtype))
result["dtype_i32"] = str(np.dtype(mx.nd.array(np.zeros(3, dtype=np.int32)).dtype))
result["dtype_list"] = str(np.dtype(mx.nd.array([1, 2]).dtype))
result["dtype_nd16"] = str(np.dtype(mx.nd.array(mx.nd.ones(2, dtype="float16")).dtype))
result["dtype_given"] = str(np.dtype(mx.nd.array(np.zeros(3), dtype="float64").dtype))
result["dtype_creators"] = [str(np.dtype(f.dtype)) for f in (
    mx.nd.zeros(2), mx.nd.ones(2), mx.nd.empty(2), mx.nd.full(2, 3), mx.nd.arange(2))]
result["dtype_creators_i8"] = [str(np.dtype(f.dtype)) for f in (
    mx.nd.zeros(2, dtype="int8"), mx.nd.ones(2, dtype="int8"), mx.nd.empty(2, dtype="int8"),
    mx.nd.full(2, 3, dtype="int8"), mx.nd.arange(2, dtype="int8"))]
result["dtype_f32_times_f64_scalar"] = str(np.dtype((mx.nd.ones(2) * np.float64(2)).dtype))
result["dtype_f16_times_float"] = str(np.dtype((mx.nd.ones(2, dtype="float16") * 2.0).dtype))
result["dtype_int_sum"] = str(np.dtype(mx.nd.ones(2, dtype="int32").sum().dtype))
result["dtype_eq"] = str(np.dtype((mx.nd.ones(2) == 1).dtype))
result["asscalar_type"] = type(mx.nd.ones(1).asscalar()).__name__
result["int_times_float"] = (mx.nd.ones(2, dtype="int32") * 3 * 2.5).asnumpy()
result["full_int"] = mx.nd.full((2,), 3.5, dtype=np.int32).asnumpy()
result["arange"] = mx.nd.arange(1, 7, 2, repeat=2).asnumpy()
result["arange_frac"] = mx.nd.arange(2.5).asnumpy()
result["int_div"] = (mx.nd.ones(2, dtype="int32") * -3 / 2).asnumpy()
x = mx.nd.array([-4.0, 9.0])
m = mx.nd.arange(4).reshape((2, 2))
result["zeros_like"] = mx.nd.zeros_like(mx.nd.ones(2, dtype="int32")).asnumpy()
result["add_n"] = mx.nd.add_n(m, m, mx.nd.ones((2, 2))).asnumpy()
result["concat"] = mx.nd.concat(m, m).asnumpy()
result["concat0"] = mx.nd.concat(m, m, dim=0).asnumpy()
result["stack"] = mx.nd.stack(m, m).asnumpy()
result["nd_sum"] = mx.nd.sum(m).asnumpy()
result["nd_norm"] = mx.nd.norm(m).asnumpy()
result["nd_norm_l1_axis"] = mx.nd.norm(m, ord=1, axis=1).asnumpy()
result["abs"] = mx.nd.abs(x).asnumpy()
result["square"] = mx.nd.square(x).asnumpy()
result["sqrt"] = mx.nd.sqrt(mx.nd.abs(x)).asnumpy()
result["clip"] = mx.nd.clip(x, 0, 5).asnumpy()
result["clip_method"] = x.clip(0, 5).asnumpy()
result["maximum"] = mx.nd.maximum(x, 0).asnumpy()
result["minimum"] = mx.nd.minimum(x, mx.nd.zeros(2)).asnumpy()
result["dot"] = mx.nd.dot(m, m, transpose_b=True).asnumpy()
v = mx.nd.zeros((2, 3))
v[1][2][:] = 7
c = v[0, 1]
c += 1
result["views"] = v.asnumpy()
"""


def test_legacy_nd_rules_match_mxnet() -> None:
    ref, got = run_both(_SHAPES_AND_DTYPES)
    assert ref["__error__"] is None, ref["__error__"]
    assert got["__error__"] is None, got["__error__"]
    for key, want in ref.items():
        if key == "__error__":
            continue
        if hasattr(want, "dtype"):
            assert want.dtype == got[key].dtype, key
            # float results may differ in the last bit (summation order, float32 sqrt)
            np.testing.assert_allclose(got[key], want, rtol=1e-6, err_msg=key)
        else:
            assert got[key] == want, f"{key}: pskv {got[key]!r} != mxnet {want!r}"


def test_mixed_dtype_operands_raise_in_mxnet() -> None:
    # docs/differences.md row 20: MXNet refuses, pskv promotes as NumPy does
    src = 'result["dtype"] = str((mx.nd.ones(2, dtype="float16") + mx.nd.ones(2)).dtype)'
    ref, got = run_both(src)
    assert ref["__error__"] is not None and ref["__error__"][0] == "MXNetError"
    assert got["__error__"] is None and got["dtype"] == "float32"
