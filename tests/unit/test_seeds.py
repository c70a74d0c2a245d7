"""The seed documents' examples, transcribed: the MXNet KVStore tutorial in Python, Scala
and Clojure, and the NumPy-style notebook. CPU contexts stand in for GPUs; every printed
result of the documents is asserted."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx

SHAPE = (2, 3)


def full(v: float) -> np.ndarray:
    return np.full(SHAPE, v, dtype=np.float32)


def test_python_tutorial(capsys: pytest.CaptureFixture[str]) -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones(SHAPE) * 2)
    a = mx.nd.zeros(SHAPE)
    kv.pull(3, out=a)
    np.testing.assert_array_equal(a.asnumpy(), full(2))

    kv.push(3, mx.nd.ones(SHAPE) * 8)
    kv.pull(3, out=a)
    np.testing.assert_array_equal(a.asnumpy(), full(8))

    gpus = [mx.gpu(i) for i in range(4)]
    b = [mx.nd.ones(SHAPE, gpu) for gpu in gpus]
    kv.push(3, b)
    kv.pull(3, out=a)
    np.testing.assert_array_equal(a.asnumpy(), full(4))

    def update(key: int, input: mx.nd.NDArray, stored: mx.nd.NDArray) -> None:
        print("update on key: %d" % key)
        stored += input * 2

    kv._set_updater(update)
    kv.pull(3, out=a)
    np.testing.assert_array_equal(a.asnumpy(), full(4))
    kv.push(3, mx.nd.ones(SHAPE))
    assert capsys.readouterr().out == "update on key: 3\n"
    kv.pull(3, out=a)
    np.testing.assert_array_equal(a.asnumpy(), full(6))

    b = [mx.nd.ones(SHAPE, gpu) for gpu in gpus]
    kv.pull(3, out=b)
    np.testing.assert_array_equal(b[1].asnumpy(), full(6))
    assert b[1].context == mx.gpu(1)

    keys = [5, 7, 9]
    kv.init(keys, [mx.nd.ones(SHAPE)] * len(keys))
    kv.push(keys, [mx.nd.ones(SHAPE)] * len(keys))
    assert capsys.readouterr().out == "update on key: 5\nupdate on key: 7\nupdate on key: 9\n"
    b = [mx.nd.zeros(SHAPE)] * len(keys)
    kv.pull(keys, out=b)
    np.testing.assert_array_equal(b[1].asnumpy(), full(3))

    b = [[mx.nd.ones(SHAPE, gpu) for gpu in gpus]] * len(keys)
    kv.push(keys, b)
    assert capsys.readouterr().out == "update on key: 5\nupdate on key: 7\nupdate on key: 9\n"
    kv.pull(keys, out=b)
    np.testing.assert_array_equal(b[1][1].asnumpy(), full(11))


def test_scala_tutorial(capsys: pytest.CaptureFixture[str]) -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones(SHAPE) * 2)
    a = mx.nd.zeros(SHAPE)
    kv.pull(3, out=a)
    assert a.asnumpy().ravel().tolist() == [2.0] * 6
    kv.push(3, mx.nd.ones(SHAPE) * 8)
    kv.pull(3, out=a)
    assert a.asnumpy().ravel().tolist() == [8.0] * 6
    gpus = [mx.gpu(i) for i in range(4)]
    kv.push(3, [mx.nd.ones(SHAPE, g) for g in gpus])
    kv.pull(3, out=a)
    assert a.asnumpy().ravel().tolist() == [4.0] * 6

    class Updater:
        def __call__(self, key: int, input: mx.nd.NDArray, stored: mx.nd.NDArray) -> None:
            print(f"update on key {key}")
            stored += input * 2

    kv.set_updater(Updater())
    kv.pull(3, a)
    assert a.asnumpy().ravel().tolist() == [4.0] * 6
    kv.push(3, mx.nd.ones(SHAPE))
    assert capsys.readouterr().out == "update on key 3\n"
    kv.pull(3, a)
    assert a.asnumpy().ravel().tolist() == [6.0] * 6
    b = [mx.nd.ones(SHAPE, g) for g in gpus]
    kv.pull(3, b)
    assert b[1].asnumpy().ravel().tolist() == [6.0] * 6

    keys = [5, 7, 9]
    kv.init(keys, [mx.nd.ones(SHAPE) for _ in keys])
    kv.push(keys, [mx.nd.ones(SHAPE) for _ in keys])
    assert capsys.readouterr().out == "update on key 5\nupdate on key 7\nupdate on key 9\n"
    b = [mx.nd.zeros(SHAPE) for _ in keys]
    kv.pull(keys, b)
    assert b[1].asnumpy().ravel().tolist() == [3.0] * 6


def test_clojure_tutorial() -> None:
    kv = mx.kv.create("local")
    kv.init(["3"], [mx.nd.ones(SHAPE) * 2])
    a = mx.nd.zeros(SHAPE)
    kv.pull(["3"], [a])
    assert a.asnumpy().ravel().tolist() == [2.0] * 6
    kv.push(["3"], [mx.nd.ones(SHAPE) * 8])
    kv.pull(["3"], [a])
    assert a.asnumpy().ravel().tolist() == [8.0] * 6

    cpus = [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
    b = [mx.nd.ones(SHAPE, cpus[0]), mx.nd.ones(SHAPE, cpus[1]), mx.nd.ones(SHAPE, cpus[2])]
    kv.push(["3", "3", "3"], b)
    kv.pull("3", a)
    assert a.asnumpy().ravel().tolist() == [3.0] * 6

    b = [mx.nd.ones(SHAPE, mx.cpu(0)), mx.nd.ones(SHAPE, mx.cpu(1))]
    kv.pull(["3", "3"], b)
    assert [x.asnumpy().ravel().tolist() for x in b] == [[3.0] * 6, [3.0] * 6]

    ks = ["5", "7", "9"]
    kv.init(ks, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
    kv.push(ks, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
    b = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE)]
    kv.pull(ks, b)
    assert [x.asnumpy().ravel().tolist() for x in b] == [[1.0] * 6] * 3


def test_numpy_notebook(capsys: pytest.CaptureFixture[str]) -> None:
    from pskv import cpu, kv, np as mnp

    store = kv.create("device")
    shape = (2, 3)
    store.init(3, mnp.ones(shape) * (-2))
    A = mnp.zeros(shape)
    store.pull(3, out=A)
    assert repr(A) == "array([[-2., -2., -2.],\n       [-2., -2., -2.]])"

    store.push(3, mnp.ones(shape) * (-7))
    store.pull(3, out=A)
    assert repr(A) == "array([[-7., -7., -7.],\n       [-7., -7., -7.]])"

    contexts = [cpu(i) for i in range(3)]
    B = [mnp.ones(shape, ctx=ctx) for ctx in contexts]
    store.push(3, B)
    store.pull(3, out=A)
    assert repr(A) == "array([[3., 3., 3.],\n       [3., 3., 3.]])"

    keys = [7, 11, 13, 17]
    values = [mnp.ones(shape) * (-3)] * len(keys)
    store.init(keys, values)
    C = [mnp.zeros(shape)] * len(keys)
    store.pull(keys, out=C)
    np.testing.assert_array_equal(C[0].asnumpy(), full(-3))

    D = [[mnp.ones(shape, ctx=ctx) * (-0.1) for ctx in contexts]] * len(keys)
    print("D[0] : ", D[0])
    assert capsys.readouterr().out.startswith("D[0] :  [array([[-0.1, -0.1, -0.1],")
    store.push(keys, D)
    store.pull(keys, out=C)
    np.testing.assert_allclose(C[0].asnumpy(), full(-0.3), rtol=1e-6)
    assert repr(C[0]) == "array([[-0.3, -0.3, -0.3],\n       [-0.3, -0.3, -0.3]])"

    def update(key: int, input: mx.nd.NDArray, stored: mx.nd.NDArray) -> None:
        print("update on key: %d" % key)
        stored += input * 0.01

    store._set_updater(update)
    store.pull(3, out=A)
    assert repr(A) == "array([[3., 3., 3.],\n       [3., 3., 3.]])"
    store.push(3, mx.nd.ones(shape) * 5)
    assert capsys.readouterr().out == "update on key: 3\n"
    store.pull(3, out=A)
    np.testing.assert_allclose(A.asnumpy(), full(3.05), rtol=1e-6)
    assert str(A.asnumpy()) == "[[3.05 3.05 3.05]\n [3.05 3.05 3.05]]"
