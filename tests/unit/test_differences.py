"""One test per deliberate difference from MXNet 1.9.1 (docs/differences.md)."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx
from pskv.errors import (ConfigError, KeyNotInitializedError, KeyTypeError, KVStoreError,
                         ShapeMismatchError)

SHAPE = (2, 3)


@pytest.fixture(params=["local", "device"])
def kv(request: pytest.FixtureRequest) -> mx.kv.KVStoreBase:
    return mx.kv.create(request.param)


def test_no_aliasing_of_caller_arrays(kv: mx.kv.LocalKVStore) -> None:
    value = np.ones(SHAPE, np.float32)
    kv.init(1, value)
    value[:] = 7                     # MXNet's init may keep the caller's buffer
    np.testing.assert_array_equal(kv.pull(1), np.ones(SHAPE))
    grad = mx.nd.ones(SHAPE) * 3
    kv.push(1, grad)
    grad += 100
    np.testing.assert_array_equal(kv.pull(1), np.full(SHAPE, 3))
    val = mx.nd.ones(SHAPE)
    kv.pushpull(1, val)
    val += 5
    np.testing.assert_array_equal(kv.pull(1), np.ones(SHAPE))


def test_uninitialized_key_raises(kv: mx.kv.LocalKVStore) -> None:
    with pytest.raises(KeyNotInitializedError, match=r"key 4 .*never initialized.*kv.init\(4"):
        kv.pull(4, out=mx.nd.zeros(SHAPE))
    with pytest.raises(KeyError):
        kv.push(4, mx.nd.zeros(SHAPE))


def test_second_init_and_broadcast_raise(kv: mx.kv.LocalKVStore) -> None:
    kv.init("w", mx.nd.ones(SHAPE))
    with pytest.raises(KeyNotInitializedError, match="initialized twice"):
        kv.init("w", mx.nd.zeros(SHAPE))
    with pytest.raises(KVStoreError):
        kv.broadcast("w", mx.nd.zeros(SHAPE), out=mx.nd.zeros(SHAPE))
    np.testing.assert_array_equal(kv.pull("w").asnumpy(), np.ones(SHAPE))


def test_wrong_shape_push_raises(kv: mx.kv.LocalKVStore) -> None:
    kv.init(7, mx.nd.ones((4, 4)))
    with pytest.raises(ShapeMismatchError, match=r"shape \(3, 4\).*\(4, 4\)"):
        kv.push(7, mx.nd.ones((3, 4)))


def test_mixed_key_kinds_raise(kv: mx.kv.LocalKVStore) -> None:
    kv.init(1, mx.nd.ones(SHAPE))
    with pytest.raises(KeyTypeError, match="int keys"):
        kv.init("a", mx.nd.ones(SHAPE))


def test_failed_list_call_changes_nothing(kv: mx.kv.LocalKVStore) -> None:
    kv.init([1, 2], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
    with pytest.raises(ShapeMismatchError):
        kv.push([1, 2], [mx.nd.ones(SHAPE) * 5, mx.nd.ones((9,))])
    np.testing.assert_array_equal(kv.pull(1).asnumpy(), np.ones(SHAPE))
    with pytest.raises(KeyNotInitializedError):
        kv.init([3, 1], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
    with pytest.raises(KeyNotInitializedError):
        kv.pull(3)                   # key 3 was not half-initialized


def test_pull_without_out_returns_new_array(kv: mx.kv.LocalKVStore) -> None:
    kv.init(0, mx.nd.ones(SHAPE) * 2)
    got = kv.pull(0)
    assert isinstance(got, mx.nd.NDArray)
    np.testing.assert_array_equal(got.asnumpy(), np.full(SHAPE, 2))
    got += 1                          # a copy: the store is unchanged
    np.testing.assert_array_equal(kv.pull(0).asnumpy(), np.full(SHAPE, 2))


def test_unknown_store_type_raises() -> None:
    with pytest.raises(ConfigError, match="unknown store type 'loacl'.*local"):
        mx.kv.create("loacl")


def test_compression_works_with_pushpull() -> None:
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, mx.nd.zeros((4,)))
    out = mx.nd.zeros((4,))
    kv.pushpull(0, mx.nd.array([0.7, -0.9, 0.2, 0.0]), out=out)
    # quantized to +-threshold or 0 (residuals 0.2, -0.4, 0.2, 0 kept for the next push)
    np.testing.assert_allclose(out.asnumpy(), [0.5, -0.5, 0.0, 0.0])


def test_updater_input_is_read_only(kv: mx.kv.LocalKVStore) -> None:
    kv.init(0, mx.nd.zeros(SHAPE))

    def bad_updater(key: int, input: mx.nd.NDArray, stored: mx.nd.NDArray) -> None:
        input *= 2                    # would corrupt the caller's gradient in MXNet

    kv.set_updater(bad_updater)
    grad = mx.nd.ones(SHAPE)
    with pytest.raises(ValueError, match="read-only"):
        kv.push(0, grad)
    np.testing.assert_array_equal(grad.asnumpy(), np.ones(SHAPE))


def test_compression_after_init_raises() -> None:
    kv = mx.kv.create("device")
    kv.init(0, mx.nd.zeros(SHAPE))
    with pytest.raises(mx.UnsupportedError, match="before the first init"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})


def test_optimizer_states_are_not_pickled(tmp_path: "pytest.TempPathFactory") -> None:
    kv = mx.kv.create("local")
    kv.init(0, mx.nd.zeros(SHAPE))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(0, mx.nd.ones(SHAPE))
    fname = str(tmp_path / "states")  # type: ignore[operator]
    kv.save_optimizer_states(fname)
    with open(fname, "rb") as f:
        raw = f.read()
    assert b"\x80\x04\x95" not in raw and b"cnumpy" not in raw  # no pickle opcodes/globals
    kv.push(0, mx.nd.ones(SHAPE))
    after_two = kv.pull(0).asnumpy()
    kv.load_optimizer_states(fname)    # momentum back to its value after one push
    kv.push(0, mx.nd.ones(SHAPE))
    # same momentum state, so the same step size as the second push had
    np.testing.assert_allclose(kv.pull(0).asnumpy() - after_two,
                               after_two - (-0.1 * np.ones(SHAPE)), rtol=1e-6)


def test_stored_value_is_not_the_merge_buffer(kv: mx.kv.LocalKVStore) -> None:
    kv.init(0, mx.nd.zeros(SHAPE))
    kv.push(0, [mx.nd.ones(SHAPE) * 2, mx.nd.ones(SHAPE) * 2])     # ASSIGN: stored = 4

    def update(key: int, input: mx.nd.NDArray, stored: mx.nd.NDArray) -> None:
        stored += input * 2

    kv.set_updater(update)
    kv.push(0, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])             # 4 + 2 * 2
    np.testing.assert_array_equal(kv.pull(0).asnumpy(), np.full(SHAPE, 8))  # MXNet: 6


def test_str_keys_reach_the_updater_as_str(kv: mx.kv.LocalKVStore) -> None:
    seen: list[object] = []
    kv.init("w", mx.nd.zeros(SHAPE))
    kv.set_updater(lambda key, input, stored: seen.append(key))
    kv.push("w", mx.nd.ones(SHAPE))
    assert seen == ["w"]                                            # MXNet: b"w"


def test_key_list_with_one_array_raises(kv: mx.kv.LocalKVStore) -> None:
    kv.init([3, 4], [mx.nd.zeros(SHAPE)] * 2)
    with pytest.raises(mx.ValueTypeError, match="2 keys"):         # MXNet: crashes
        kv.push([3, 4], mx.nd.ones(SHAPE))
    assert issubclass(mx.ValueTypeError, TypeError)


def test_inputs_mxnet_accepts_are_refused(kv: mx.kv.LocalKVStore) -> None:
    with pytest.raises(KeyTypeError, match="bool"):
        kv.init(True, mx.nd.zeros(SHAPE))
    with pytest.raises(TypeError, match="callable"):
        kv.set_updater(42)  # type: ignore[arg-type]
    kv.init(0, mx.nd.zeros(SHAPE))
    with pytest.raises(TypeError, match="empty list"):
        kv.push(0, [])


def test_bad_lists_and_keys_are_not_assertion_errors(kv: mx.kv.LocalKVStore) -> None:
    with pytest.raises(ShapeMismatchError, match="2 keys but 1 values"):   # MXNet: assert
        kv.init([1, 2], [mx.nd.zeros(SHAPE)])
    with pytest.raises(KeyTypeError, match="float"):
        kv.init(1.5, mx.nd.zeros(SHAPE))
    with pytest.raises(KeyTypeError, match="mix int and str"):
        kv.init([1, "a"], [mx.nd.zeros(SHAPE)] * 2)
