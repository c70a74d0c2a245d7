"""pskv.test_utils: the mxnet.test_utils helpers MXNet's KVStore tests import."""
from __future__ import annotations

import os

import numpy as np
import pytest

import pskv as mx
from pskv.test_utils import (almost_equal, assert_almost_equal, assert_exception, environment,
                             rand_ndarray, same)


def test_assert_almost_equal_uses_per_dtype_tolerances() -> None:
    assert_almost_equal(mx.nd.ones(3) * 1.0005, np.ones(3, np.float32))  # float32: atol 1e-3
    with pytest.raises(AssertionError):
        assert_almost_equal(np.ones(3) * 1.0005, np.ones(3))  # float64: rtol 1e-5
    with pytest.raises(AssertionError):
        assert_almost_equal(np.array([1, 2]), np.array([1, 3]))  # ints: exact
    assert_almost_equal(np.ones(3) * 1.5, np.ones(3), atol=0.6)


def test_almost_equal_and_same() -> None:
    assert almost_equal(mx.nd.ones(2), np.ones(2))
    assert not almost_equal(np.ones(2), np.zeros(2))
    assert same(mx.nd.ones(2), np.ones(2, np.float32))
    assert not same(np.ones(2), np.ones(3))


def test_assert_exception() -> None:
    assert_exception(mx.kv.create("local").pull, KeyError, "missing")
    with pytest.raises(AssertionError, match="did not raise"):
        assert_exception(len, ValueError, [1])


def test_rand_ndarray() -> None:
    np.random.seed(0)
    dense = rand_ndarray((3, 2))
    assert dense.dtype == np.float32 and dense.shape == (3, 2)
    rsp = rand_ndarray((50, 2), "row_sparse", density=0.5, ctx=mx.cpu(1))
    assert rsp.stype == "row_sparse" and rsp.shape == (50, 2) and rsp.context == mx.cpu(1)
    assert 0 < len(rsp.indices.asnumpy()) < 50  # type: ignore[attr-defined]
    empty = rand_ndarray((4, 2), "row_sparse", density=0.0)
    assert empty.asnumpy().sum() == 0
    with pytest.raises(NotImplementedError):
        rand_ndarray((2, 2), "csr")


def test_environment_restores() -> None:
    os.environ.pop("PSKV_TEST_UTILS_X", None)
    with environment("PSKV_TEST_UTILS_X", "1"):
        assert os.environ["PSKV_TEST_UTILS_X"] == "1"
        with environment({"PSKV_TEST_UTILS_X": None}):
            assert "PSKV_TEST_UTILS_X" not in os.environ
        assert os.environ["PSKV_TEST_UTILS_X"] == "1"
    assert "PSKV_TEST_UTILS_X" not in os.environ
