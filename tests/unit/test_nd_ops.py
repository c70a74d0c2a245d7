"""pskv.nd operator functions: MXNet 1.x shapes and dtypes (checked against MXNet 1.9.1 in
tests/mxnet/test_nd_mxnet.py)."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx


def test_like_functions_keep_dtype_and_context() -> None:
    x = mx.nd.ones((2, 3), mx.cpu(2), dtype="int32")
    for f, want in ((mx.nd.zeros_like, 0), (mx.nd.ones_like, 1)):
        y = f(x)
        assert y.shape == (2, 3) and y.dtype == np.int32 and y.context == mx.cpu(2)
        assert (y.asnumpy() == want).all()


def test_add_n_concat_stack() -> None:
    a, b = mx.nd.ones((2, 2)), mx.nd.arange(4).reshape((2, 2))
    assert mx.nd.add_n(a, b, a).asnumpy().tolist() == [[2, 3], [4, 5]]
    assert mx.nd.concat(a, b).shape == (2, 4)  # dim=1 by default, as MXNet
    assert mx.nd.concat(a, b, dim=0).shape == (4, 2)
    assert mx.nd.stack(a, b).shape == (2, 2, 2)
    with pytest.raises(ValueError):
        mx.nd.add_n(a, mx.nd.ones(3))
    with pytest.raises(ValueError):
        mx.nd.concat(a, mx.nd.ones(3), dim=0)
    with pytest.raises(TypeError):
        mx.nd.add_n(np.ones(2))  # type: ignore[arg-type]


def test_reductions_and_norm_have_shape_1() -> None:
    x = mx.nd.arange(4).reshape((2, 2))
    for r in (mx.nd.sum(x), mx.nd.mean(x), mx.nd.max(x), mx.nd.min(x), mx.nd.norm(x)):
        assert r.shape == (1,) and r.dtype == np.float32
    assert mx.nd.norm(mx.nd.ones(4)).asnumpy().tolist() == [2.0]
    assert mx.nd.norm(mx.nd.ones((2, 2)), ord=1, axis=1).asnumpy().tolist() == [2.0, 2.0]
    assert mx.nd.sum(x, axis=0).asnumpy().tolist() == [2.0, 4.0]


def test_elementwise() -> None:
    x = mx.nd.array([-4.0, 9.0])
    assert mx.nd.abs(x).asnumpy().tolist() == [4, 9]
    assert mx.nd.square(x).asnumpy().tolist() == [16, 81]
    assert np.isnan(mx.nd.sqrt(x).asnumpy()[0]) and mx.nd.sqrt(x).asnumpy()[1] == 3
    assert mx.nd.clip(x, 0, 5).asnumpy().tolist() == [0, 5]
    assert x.clip(0, 5).asnumpy().tolist() == [0, 5]
    assert mx.nd.maximum(x, 0).asnumpy().tolist() == [0, 9]
    assert mx.nd.minimum(0, x).asnumpy().tolist() == [-4, 0]
    assert mx.nd.maximum(mx.nd.ones(2, dtype="int32"), 1.5).dtype == np.int32


def test_dot() -> None:
    a, b = mx.nd.ones((2, 3)), mx.nd.ones((2, 1))
    assert mx.nd.dot(a, b, transpose_a=True).shape == (3, 1)
    with pytest.raises(ValueError):
        mx.nd.dot(a, b)


def test_integer_division_stays_integer() -> None:
    x = mx.nd.ones(2, dtype="int32") * -3
    assert (x / 2).dtype == np.int32
    assert (x / 2).asnumpy().tolist() == [-1, -1]  # truncated, as MXNet (C++ division)
    assert (mx.nd.ones(2) / 0).asnumpy().tolist() == [np.inf, np.inf]
