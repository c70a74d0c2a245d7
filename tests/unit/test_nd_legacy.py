"""``mx.nd`` follows MXNet 1.x's legacy NDArray rules; ``mx.np`` follows NumPy's.

Each expectation was checked on the MXNet 1.9.1 interpreter (``tests/mxnet`` compares the
two libraries directly when ``PSKV_MXNET_PYTHON`` is set).
"""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx


def test_one_element_by_index_has_shape_1() -> None:
    a = mx.nd.arange(6).reshape((2, 3))
    assert a[0][0].shape == (1,)
    assert a[1, 2].shape == (1,)
    assert a[-1][-1].asnumpy()[0] == 5  # MXNet's own dist tests do val[0][0].asnumpy()[0]
    assert a[1].shape == (3,)
    assert a[:, 1].shape == (2,)
    assert a[0][..., 0].shape == (1,)
    assert [x.shape for x in mx.nd.zeros(3)] == [(1,)] * 3


def test_one_element_is_a_view() -> None:
    a = mx.nd.zeros((2, 3))
    a[1][2][:] = 7
    b = a[0, 1]
    b += 1
    assert a.asnumpy().tolist() == [[0, 1, 0], [0, 0, 7]]


def test_out_of_range_index_still_raises() -> None:
    with pytest.raises(IndexError):
        mx.nd.zeros((2, 3))[0][3]


def test_full_reductions_have_shape_1_and_keep_dtype() -> None:
    a = mx.nd.ones((2, 3), dtype="int32")
    for r in (a.sum(), a.mean(), a.max(), a.min()):
        assert r.shape == (1,)
        assert r.dtype == np.int32
    assert a.sum().asnumpy()[0] == 6
    assert mx.nd.ones(3).sum(axis=0).shape == (1,)
    assert mx.nd.ones((2, 3)).sum(axis=0).shape == (3,)
    assert mx.nd.ones(2, dtype="float16").mean().dtype == np.float16


def test_np_arrays_keep_numpy_rules() -> None:
    a = mx.np.zeros((2, 3))
    assert a[0][0].shape == ()
    assert a.sum().shape == ()
    assert mx.np.array(np.zeros(2)).dtype == np.float64
    assert (mx.np.ones(2) == 1).dtype == np.bool_


def test_array_defaults_to_float32_unless_source_is_ndarray() -> None:
    assert mx.nd.array(np.zeros(3)).dtype == np.float32
    assert mx.nd.array(np.zeros(3, dtype=np.int32)).dtype == np.float32
    assert mx.nd.array(np.zeros(3, dtype=bool)).dtype == np.float32
    assert mx.nd.array([1, 2]).dtype == np.float32
    assert mx.nd.array(mx.nd.ones(2, dtype="float16")).dtype == np.float16
    assert mx.nd.array(np.zeros(3), dtype="float64").dtype == np.float64
    assert mx.nd.array([1.7, 2], dtype="int64").asnumpy().tolist() == [1, 2]
    assert mx.nd.array(3.0).shape == ()  # a scalar source stays 0-d in MXNet too


@pytest.mark.parametrize("make", [
    lambda **k: mx.nd.zeros(2, **k), lambda **k: mx.nd.ones(2, **k),
    lambda **k: mx.nd.empty(2, **k), lambda **k: mx.nd.full(2, 3, **k),
    lambda **k: mx.nd.arange(2, **k)])
def test_creation_dtype(make: object) -> None:
    assert make().dtype == np.float32  # type: ignore[operator]
    assert make(dtype="int8").dtype == np.int8  # type: ignore[operator]
    assert make(dtype=np.float16).dtype == np.float16  # type: ignore[operator]


def test_full_casts_the_value() -> None:
    assert mx.nd.full((2,), 3.5, dtype=np.int32).asnumpy().tolist() == [3, 3]


def test_arange() -> None:
    assert mx.nd.arange(2.5).asnumpy().tolist() == [0, 1, 2]
    assert mx.nd.arange(1, 7, 2).asnumpy().tolist() == [1, 3, 5]
    assert mx.nd.arange(3, repeat=2).asnumpy().tolist() == [0, 0, 1, 1, 2, 2]
    assert mx.nd.arange(0, 4, dtype="int64").dtype == np.int64
    assert mx.nd.arange(0, 4, ctx=mx.cpu(2)).context == mx.cpu(2)
    with pytest.raises(TypeError):
        mx.nd.arange(3, repeat=0)


def test_scalar_operands_take_the_array_dtype() -> None:
    assert (mx.nd.ones(2) * np.float64(2)).dtype == np.float32
    assert (np.float64(2) * mx.nd.ones(2)).dtype == np.float32
    assert (mx.nd.ones(2, dtype="float16") * 2.0).dtype == np.float16
    # the scalar is cast first: 3 * int(2.5) = 6, as MXNet computes
    assert (mx.nd.ones(2, dtype="int32") * 3 * 2.5).asnumpy().tolist() == [6, 6]
    x = mx.nd.ones(2, dtype="int32")
    x += 2.5
    assert x.asnumpy().tolist() == [3, 3]


def test_comparisons_give_the_input_dtype() -> None:
    assert (mx.nd.ones(2) == 1).dtype == np.float32
    assert (mx.nd.ones(2, dtype="int32") > 0).asnumpy().tolist() == [1, 1]


def test_asscalar_is_a_numpy_scalar_of_the_dtype() -> None:
    v = mx.nd.ones((2, 2))[0][0].asscalar()
    assert isinstance(v, np.float32)
    assert isinstance(mx.nd.ones(1).item(), float)
    assert float(mx.nd.ones(1) * 2) == 2.0 and int(mx.nd.ones(1) * 2) == 2  # MXNet: TypeError
    with pytest.raises(ValueError):
        mx.nd.ones(2).asscalar()


def test_random_seed_repeats_draws() -> None:
    mx.random.seed(3)
    a = mx.nd.random.uniform(-1, 1, shape=(3, 2))
    mx.random.seed(3)
    b = mx.nd.random_uniform(-1, 1, shape=(3, 2), ctx=mx.cpu(1))
    assert a.dtype == np.float32 and a.shape == (3, 2)
    assert (a.asnumpy() == b.asnumpy()).all()
    assert b.context == mx.cpu(1)
    assert ((a.asnumpy() >= -1) & (a.asnumpy() < 1)).all()
    assert mx.nd.random.normal(shape=4, dtype="float64").dtype == np.float64
    with pytest.raises(TypeError):
        mx.random.seed(-1)


def test_reshape_takes_whole_number_floats() -> None:
    # MXNet 1.9.1's dist_sync_kvstore.py reshapes to (num_rows / 2, 2); docs/differences.md
    a = mx.nd.arange(4)
    assert a.reshape((4 / 2, 2)).shape == (2, 2)
    assert a.reshape(2.0, 2).shape == (2, 2)
    with pytest.raises(ValueError, match="whole number"):
        a.reshape((1.5, 2))
    with pytest.raises(ValueError):
        a.reshape((3, 2))


def test_mixed_dtype_operands_promote() -> None:
    # MXNet raises for mixed-dtype NDArrays (docs/differences.md row 20); pskv promotes
    assert (mx.nd.ones(2, dtype="float16") + mx.nd.ones(2)).dtype == np.float32
    assert (mx.nd.ones(2) - np.ones(2, np.float64)).dtype == np.float64


def test_empty_shape_is_0d() -> None:
    assert mx.nd.zeros(()).shape == ()
    assert mx.nd.zeros(()).sum().shape == (1,)


def test_row_sparse_scaling_keeps_dtype() -> None:
    rsp = mx.nd.ones((3, 2), dtype="float16").tostype("row_sparse")
    scaled = rsp * np.float64(2)
    assert scaled.stype == "row_sparse" and scaled.dtype == np.float16
    assert scaled.asnumpy().tolist() == [[2, 2]] * 3
