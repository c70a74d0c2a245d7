"""The local store's semantics and every error a user can provoke.

Each error test asserts the KVStoreError subclass, the builtin it derives from (so code
written against MXNet keeps catching it), that the message names the key (repr) and shape
where relevant and says what to do, and that the failing call changed nothing.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import (ConfigError, KeyNotInitializedError, KeyTypeError, KVStoreError,
                         ShapeMismatchError, UnsupportedError, ValueTypeError)
from pskv.kvstore import KVStoreBase, LocalKVStore, SparsePullIgnoredWarning
from pskv.testing import NumpyKVModel, check_kvstore_semantics

SHAPE = (2, 3)
RSP_SHAPE = (6, 2)
TABLE = np.arange(12, dtype=np.float32).reshape(RSP_SHAPE)


def full(v: float, shape: tuple[int, ...] = SHAPE, dtype: Any = np.float32) -> np.ndarray:
    return np.full(shape, v, dtype=dtype)


def pulled(kv: Any, key: Any, shape: tuple[int, ...] = SHAPE, dtype: str = "float32"
           ) -> np.ndarray:
    out = mx.nd.zeros(shape, dtype=dtype)
    kv.pull(key, out=out)
    return out.asnumpy()


# ---- "a failing call changes nothing" ---------------------------------------------------
def snapshot(kv: LocalKVStore) -> dict[str, Any]:
    """Everything a call could change: each key's value, dtype and rows, the updater."""
    values = {}
    for k, stored in kv._store.items():
        rows = getattr(stored, "_indices", None)
        values[k] = (stored._dense().copy(), stored.dtype,
                     None if rows is None else rows.copy())
    return {"values": values, "updater": kv._engine.updater, "kind": kv._keys.kind,
            "ikey": {k: r.ikey for k, r in kv._keys.records.items()},
            "compressor": kv._devices.compressor, "residual": {
                k: v.copy() for k, v in kv._devices._residual.items()}}


def assert_unchanged(kv: LocalKVStore, before: dict[str, Any]) -> None:
    after = snapshot(kv)
    assert after["values"].keys() == before["values"].keys(), "keys were added or removed"
    for k, (data, dtype, rows) in before["values"].items():
        got, gdtype, grows = after["values"][k]
        assert gdtype == dtype, f"key {k!r} changed dtype"
        np.testing.assert_array_equal(got, data, err_msg=f"key {k!r} changed")
        if rows is not None:
            np.testing.assert_array_equal(grows, rows, err_msg=f"key {k!r} rows changed")
    assert after["updater"] is before["updater"]
    assert after["kind"] is before["kind"]
    assert after["ikey"] == before["ikey"]
    assert after["compressor"] is before["compressor"]
    assert after["residual"].keys() == before["residual"].keys()
    for k, v in before["residual"].items():
        np.testing.assert_array_equal(after["residual"][k], v)


def expect_error(kv: LocalKVStore | None, fn: Callable[[], Any], cls: type[KVStoreError],
                 builtin: type[BaseException], *fragments: str) -> KVStoreError:
    """``fn()`` raises ``cls`` (also a ``builtin``) whose message holds every fragment,
    and ``kv`` is unchanged."""
    before = snapshot(kv) if kv is not None else None
    with pytest.raises(cls) as info:
        fn()
    err = info.value
    assert isinstance(err, KVStoreError)
    assert isinstance(err, builtin), f"{type(err).__name__} is not a {builtin.__name__}"
    for frag in fragments:
        assert frag in str(err), f"{frag!r} not in message: {err}"
    if kv is not None and before is not None:
        assert_unchanged(kv, before)
    return err


@pytest.fixture
def kv() -> LocalKVStore:
    """A local store with int keys 3 (ones) and 4 (twos), both float32 (2, 3)."""
    store = mx.kv.create("local")
    assert isinstance(store, LocalKVStore)
    store.init([3, 4], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2])
    return store


@pytest.fixture
def skv() -> LocalKVStore:
    """A local store with str keys 'w' (ones) and 'b' (twos)."""
    store = mx.kv.create("local")
    assert isinstance(store, LocalKVStore)
    store.init(["w", "b"], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2])
    return store


@pytest.fixture
def rkv() -> LocalKVStore:
    """A local store with row_sparse key 7 holding TABLE and dense key 1."""
    store = mx.kv.create("local")
    assert isinstance(store, LocalKVStore)
    store.init([1, 7], [mx.nd.ones(SHAPE), mx.nd.array(TABLE).tostype("row_sparse")])
    return store


# ======================================================================================
# Errors
# ======================================================================================
class TestNeverInitialized:
    def test_pull(self, kv: LocalKVStore) -> None:
        out = mx.nd.zeros(SHAPE)
        expect_error(kv, lambda: kv.pull(9, out=out), KeyNotInitializedError, KeyError,
                     "key 9", "never initialized", "kv.init(9, value)")
        np.testing.assert_array_equal(out.asnumpy(), 0)

    def test_pull_str_key_repr(self, skv: LocalKVStore) -> None:
        err = expect_error(skv, lambda: skv.pull("w3", out=mx.nd.zeros(SHAPE)),
                           KeyNotInitializedError, KeyError, "key 'w3'",
                           "kv.init('w3', value)")
        assert err.key == "w3" and err.store_type == "local"

    def test_pull_out_none(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.pull(9), KeyNotInitializedError, KeyError, "key 9",
                     "kv.init(9")

    def test_push(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push(9, mx.nd.ones(SHAPE)), KeyNotInitializedError,
                     KeyError, "key 9", "kv.init(9")

    def test_pushpull(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.pushpull(9, mx.nd.ones(SHAPE)), KeyNotInitializedError,
                     KeyError, "key 9")

    def test_row_sparse_pull(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(8, out=out, row_ids=mx.nd.array([1])),
                     KeyNotInitializedError, KeyError, "key 8", "kv.init(8")

    def test_list_push_last_key_unknown_changes_nothing(self, kv: LocalKVStore) -> None:
        calls: list[Any] = []
        kv.set_updater(lambda k, i, s: calls.append(k))
        expect_error(kv, lambda: kv.push([3, 4, 9], [mx.nd.ones(SHAPE) * 5] * 3),
                     KeyNotInitializedError, KeyError, "key 9")
        assert calls == []

    def test_list_pull_last_key_unknown_fills_nothing(self, kv: LocalKVStore) -> None:
        outs = [mx.nd.zeros(SHAPE) for _ in range(3)]
        expect_error(kv, lambda: kv.pull([3, 4, 9], out=outs), KeyNotInitializedError,
                     KeyError, "key 9")
        for o in outs:
            np.testing.assert_array_equal(o.asnumpy(), 0)


def test_failed_push_leaves_optimizer_state_alone() -> None:
    def run(with_failure: bool) -> np.ndarray:
        kv = mx.kv.create()
        kv.init([0, 1], [np.ones(SHAPE, np.float32), np.ones(SHAPE, np.float32)])
        kv.set_optimizer(mx.optimizer.create("adam", learning_rate=0.1))
        if with_failure:
            before = snapshot(kv)
            with pytest.raises(ShapeMismatchError):
                kv.push([0, 1], [np.ones(SHAPE, np.float32), np.ones((5,), np.float32)])
            assert_unchanged(kv, before)
        for _ in range(3):
            kv.push([0, 1], [np.full(SHAPE, 0.5, np.float32)] * 2)
        return np.stack(kv.pull([0, 1]))

    np.testing.assert_array_equal(run(True), run(False))


class TestDoubleInit:
    def test_second_init(self, kv: LocalKVStore) -> None:
        err = expect_error(kv, lambda: kv.init(3, mx.nd.ones(SHAPE) * 7),
                           KeyNotInitializedError, KeyError, "key 3",
                           "initialized twice", "push to change")
        assert err.key == 3

    def test_second_init_in_list_changes_nothing(self, kv: LocalKVStore) -> None:
        # the new key 5 comes first: it must not be initialized either
        expect_error(kv, lambda: kv.init([5, 3], [mx.nd.ones(SHAPE)] * 2),
                     KeyNotInitializedError, KeyError, "key 3")
        assert 5 not in kv._store

    def test_duplicate_key_in_one_init(self) -> None:
        kv = mx.kv.create()
        expect_error(kv, lambda: kv.init([5, 5], [mx.nd.ones(SHAPE)] * 2),
                     KeyNotInitializedError, KeyError, "key 5")
        assert kv._store == {}

    def test_init_with_several_values(self) -> None:
        kv = mx.kv.create()
        expect_error(kv, lambda: kv.init(5, [mx.nd.ones(SHAPE)] * 2),
                     KeyNotInitializedError, KeyError, "key 5")

    def test_second_broadcast(self) -> None:
        kv = mx.kv.create()
        out = mx.nd.zeros(SHAPE)
        kv.broadcast("w", mx.nd.ones(SHAPE), out=out)
        out2 = mx.nd.zeros(SHAPE)
        expect_error(kv, lambda: kv.broadcast("w", mx.nd.ones(SHAPE) * 9, out=out2),
                     KeyNotInitializedError, KeyError, "key 'w'", "initialized twice")
        np.testing.assert_array_equal(out2.asnumpy(), 0)

    def test_broadcast_after_init(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.broadcast(3, mx.nd.ones(SHAPE), out=mx.nd.zeros(SHAPE)),
                     KeyNotInitializedError, KeyError, "key 3")


class TestShape:
    def test_push_wrong_shape(self, kv: LocalKVStore) -> None:
        err = expect_error(kv, lambda: kv.push(3, mx.nd.ones((3, 3))), ShapeMismatchError,
                           ValueError, "key 3", "(3, 3)", "(2, 3)", "init a new key")
        assert err.shape == (3, 3)

    def test_push_one_device_wrong_shape(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push(3, [mx.nd.ones(SHAPE), mx.nd.ones((3,))]),
                     ShapeMismatchError, ValueError, "key 3", "(3,)", "(2, 3)")

    def test_pull_wrong_shape(self, kv: LocalKVStore) -> None:
        out = mx.nd.zeros((3, 2))
        expect_error(kv, lambda: kv.pull(3, out=out), ShapeMismatchError, ValueError,
                     "key 3", "(3, 2)", "(2, 3)")
        np.testing.assert_array_equal(out.asnumpy(), 0)

    def test_list_push_last_value_wrong_shape_changes_nothing(self, kv: LocalKVStore
                                                              ) -> None:
        calls: list[Any] = []

        def upd(key: Any, inp: Any, stored: Any) -> None:
            calls.append(key)
            stored += inp

        kv.set_updater(upd)
        expect_error(kv, lambda: kv.push([3, 4], [mx.nd.ones(SHAPE), mx.nd.ones((2, 2))]),
                     ShapeMismatchError, ValueError, "key 4", "(2, 2)")
        assert calls == []
        np.testing.assert_array_equal(pulled(kv, 3), full(1))

    def test_list_pull_last_out_wrong_shape_fills_nothing(self, kv: LocalKVStore) -> None:
        first = mx.nd.zeros(SHAPE)
        expect_error(kv, lambda: kv.pull([3, 4], out=[first, mx.nd.zeros((1,))]),
                     ShapeMismatchError, ValueError, "key 4", "(1,)")
        np.testing.assert_array_equal(first.asnumpy(), 0)

    def test_pushpull_bad_out_pushes_nothing(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.pushpull(3, mx.nd.ones(SHAPE) * 5, out=mx.nd.zeros((4,))),
                     ShapeMismatchError, ValueError, "key 3", "(4,)")

    def test_broadcast_bad_out_inits_nothing(self) -> None:
        kv = mx.kv.create()
        good = mx.nd.zeros(SHAPE)
        expect_error(kv, lambda: kv.broadcast(5, mx.nd.ones(SHAPE), out=[good,
                                                                         mx.nd.zeros((9,))]),
                     ShapeMismatchError, ValueError, "key 5", "(9,)")
        assert kv._store == {}
        np.testing.assert_array_equal(good.asnumpy(), 0)

    def test_key_and_value_lists_differ(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push([3, 4], [mx.nd.ones(SHAPE)]), ShapeMismatchError,
                     ValueError, "2 keys but 1 values", "[3, 4]", "one array")

    def test_key_and_out_lists_differ(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.pull([3], out=[mx.nd.zeros(SHAPE)] * 2),
                     ShapeMismatchError, ValueError, "1 keys but 2 outs")

    def test_init_lists_differ(self) -> None:
        kv = mx.kv.create()
        expect_error(kv, lambda: kv.init([1, 2, 3], [mx.nd.ones(SHAPE)] * 2),
                     ShapeMismatchError, ValueError, "3 keys but 2 values")
        assert kv._store == {}

    def test_key_list_with_one_array(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push([3, 4], mx.nd.ones(SHAPE)), ValueTypeError,
                     TypeError, "[3, 4]", "list of 2 values")

    def test_scalar_numpy_value(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push(3, np.float32(1.0)), ShapeMismatchError, ValueError,
                     "key 3", "()", "(2, 3)")


class TestDtype:
    def test_push_float_into_int_key(self) -> None:
        kv = mx.kv.create()
        kv.init(0, mx.nd.zeros(SHAPE, dtype="int32"))
        expect_error(kv, lambda: kv.push(0, mx.nd.ones(SHAPE) * 1.5), ShapeMismatchError,
                     ValueError, "key 0", "float32", "int32", ".astype('int32')")

    def test_pull_float_key_into_int_out(self, kv: LocalKVStore) -> None:
        out = np.zeros(SHAPE, np.int64)
        expect_error(kv, lambda: kv.pull(3, out=out), ShapeMismatchError, ValueError,
                     "key 3", "int64", "float32")
        np.testing.assert_array_equal(out, 0)

    @pytest.mark.parametrize("make", [lambda: np.zeros(SHAPE, np.int32),
                                      lambda: mx.nd.zeros(SHAPE, dtype="int32")],
                             ids=["numpy", "NDArray"])
    def test_pull_into_an_int32_out_says_dtype_not_shape(self, kv: LocalKVStore,
                                                         make: Callable[[], Any]) -> None:
        """The class covers shapes and dtypes (ShapeMismatchError): the words say it is the
        dtype (which key, stored and given dtype, the shape that fits) and a fix that
        fills the out the user holds (``.astype`` would fill a copy)."""
        out = make()
        with pytest.raises(ShapeMismatchError) as info:
            kv.pull(3, out=out)
        msg = str(info.value)
        assert msg.startswith("pull key 3 into an out of dtype int32, but key 3 holds "
                              "float32: a dtype mismatch (the shape (2, 3) fits)"), msg
        assert "buf = np.empty(out.shape, dtype='float32')" in msg and "out[:] = buf" in msg
        assert ".astype" not in msg, msg
        assert info.value.key == 3
        buf = np.empty(out.shape, dtype="float32")     # the fix, as the message words it
        kv.pull(3, out=buf)
        out[:] = buf
        np.testing.assert_array_equal(np.asarray(out if isinstance(out, np.ndarray)
                                                 else out.asnumpy()), buf.astype(np.int32))

    def test_list_push_last_value_bad_dtype_changes_nothing(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push([3, 4], [mx.nd.ones(SHAPE) * 5,
                                                  np.ones(SHAPE, dtype=np.complex64)]),
                     ShapeMismatchError, ValueError, "key 4", "complex64")

    def test_int_into_float_is_cast(self, kv: LocalKVStore) -> None:
        kv.push(3, np.full(SHAPE, 7, np.int32))
        np.testing.assert_array_equal(pulled(kv, 3), full(7))


class TestValueKinds:
    @pytest.mark.parametrize("value, what", [
        (None, "None"), (1.0, "a float"), (3, "a int"), ("abc", "a str"),
        ({"a": 1}, "a dict"), ([1.0, 2.0], "a float"), ([mx.nd.ones(SHAPE), None], "None"),
    ])
    def test_push_non_array(self, kv: LocalKVStore, value: Any, what: str) -> None:
        expect_error(kv, lambda: kv.push(3, value), ValueTypeError, TypeError, "key 3",
                     what, "not an array", "Pass an NDArray")

    def test_pull_out_not_array(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.pull(3, out=[mx.nd.zeros(SHAPE), "x"]), ValueTypeError,
                     TypeError, "out for key 3", "a str")

    def test_init_none(self) -> None:
        kv = mx.kv.create()
        expect_error(kv, lambda: kv.init([1, 2], [mx.nd.ones(SHAPE), None]), ValueTypeError,
                     TypeError, "key 2", "None")
        assert kv._store == {} and kv._keys.kind is None

    def test_empty_value_list(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push(3, []), ValueTypeError, TypeError, "key 3",
                     "empty list", "at least one array")

    def test_read_only_out(self, kv: LocalKVStore) -> None:
        out = np.zeros(SHAPE, np.float32)
        out.flags.writeable = False
        expect_error(kv, lambda: kv.pull(3, out=out), ValueTypeError, TypeError, "key 3",
                     "read-only", "writable")

    def test_updater_not_callable(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.set_updater(3), ValueTypeError, TypeError, "callable",
                     "int")
        expect_error(kv, lambda: kv._set_updater(None), ValueTypeError, TypeError,
                     "callable")


class TestKeyKinds:
    def test_mixed_keys_in_one_list(self) -> None:
        kv = mx.kv.create()
        expect_error(kv, lambda: kv.init([3, "a"], [mx.nd.ones(SHAPE)] * 2), KeyTypeError,
                     TypeError, "mix int and str", "one kind of key")
        assert kv._store == {} and kv._keys.kind is None

    def test_str_key_in_int_store(self, kv: LocalKVStore) -> None:
        err = expect_error(kv, lambda: kv.init("a", mx.nd.ones(SHAPE)), KeyTypeError,
                           TypeError, "key 'a'", "int keys", "one kind of key")
        assert err.key == "a"
        expect_error(kv, lambda: kv.pull("3", out=mx.nd.zeros(SHAPE)), KeyTypeError,
                     TypeError, "key '3'")
        expect_error(kv, lambda: kv.pull("3"), KeyTypeError, TypeError, "key '3'")

    def test_int_key_in_str_store(self, skv: LocalKVStore) -> None:
        expect_error(skv, lambda: skv.push(0, mx.nd.ones(SHAPE)), KeyTypeError, TypeError,
                     "key 0", "str keys")

    @pytest.mark.parametrize("key, name", [
        (True, "bool"), (False, "bool"), (1.0, "float"), (2.5, "float"), (None, "NoneType"),
        (b"w", "bytes"), ((1, 2), "tuple"), (np.float64(1), "float64"), (np.bool_(True), "bool"),
    ])
    def test_bad_key_types(self, kv: LocalKVStore, key: Any, name: str) -> None:
        if isinstance(key, tuple):  # a tuple is a key list: the element kinds are checked
            expect_error(kv, lambda: kv.push(key, mx.nd.ones(SHAPE)), ValueTypeError,
                         TypeError)
            return
        expect_error(kv, lambda: kv.push(key, mx.nd.ones(SHAPE)), KeyTypeError, TypeError,
                     repr(key), name, "keys must be int or str")
        expect_error(kv, lambda: kv.init(key, mx.nd.ones(SHAPE)), KeyTypeError, TypeError,
                     repr(key))

    def test_bad_key_in_list_last(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.push([3, 1.5], [mx.nd.ones(SHAPE)] * 2), KeyTypeError,
                     TypeError, "1.5")

    def test_nested_key_list(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.init([5, [6]], [mx.nd.ones(SHAPE)] * 2), KeyTypeError,
                     TypeError, "[6]", "list")


class TestCreateAndConfig:
    def test_unknown_store_type(self) -> None:
        err = expect_error(None, lambda: mx.kv.create("no_such_store"), ConfigError,
                           ValueError, "'no_such_store'", "local", "device", "dist_sync")
        assert err.store_type == "no_such_store"

    def test_store_type_not_str(self) -> None:
        expect_error(None, lambda: mx.kv.create(3), ConfigError, ValueError, "3", "'local'")

    def test_unknown_optimizer(self) -> None:
        with pytest.raises(ValueError) as info:
            mx.optimizer.create("no_such_optimizer")
        assert "no_such_optimizer" in str(info.value)
        assert isinstance(info.value, KVStoreError)

    def test_set_optimizer_not_an_optimizer(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.set_optimizer("sgd"), ValueTypeError, TypeError,
                     "str", "mx.optimizer.create")

    def test_gradient_compression_on_local(self) -> None:
        kv = mx.kv.create("local")
        err = expect_error(kv, lambda: kv.set_gradient_compression(
            {"type": "2bit", "threshold": 0.5}), UnsupportedError, NotImplementedError,
            "'local'", "mx.kv.create('device')")
        assert err.store_type == "local"

    def test_gradient_compression_after_init(self) -> None:
        kv = mx.kv.create("device")
        kv.init(3, mx.nd.ones(SHAPE))
        expect_error(kv, lambda: kv.set_gradient_compression(
            {"type": "2bit", "threshold": 0.5}), UnsupportedError, NotImplementedError,
            "before the first init", "new store")

    def test_gradient_compression_unknown_type(self) -> None:
        kv = mx.kv.create("device")
        expect_error(kv, lambda: kv.set_gradient_compression({"type": "3bit"}),
                     KVStoreError, ValueError, "3bit", "2bit")

    def test_compressed_row_sparse_push(self) -> None:
        kv = mx.kv.create("device")
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init(7, mx.nd.array(TABLE).tostype("row_sparse"))
        grad = mx.nd.sparse.row_sparse_array((np.ones((1, 2)), [2]), shape=RSP_SHAPE)
        expect_error(kv, lambda: kv.push(7, grad), UnsupportedError, NotImplementedError,
                     "key 7", "dense")

    def test_unknown_capability(self, kv: LocalKVStore) -> None:
        expect_error(kv, lambda: kv.is_capable("teleport"), ConfigError, ValueError,
                     "'teleport'", "'optimizer'")

    def test_optimizer_states_without_optimizer(self, kv: LocalKVStore, tmp_path: Any
                                                ) -> None:
        f = str(tmp_path / "states")
        expect_error(kv, lambda: kv.save_optimizer_states(f), UnsupportedError,
                     NotImplementedError, "no optimizer", "set_optimizer")
        expect_error(kv, lambda: kv.load_optimizer_states(f), UnsupportedError,
                     NotImplementedError, "set_optimizer")

    def test_use_after_close(self, kv: LocalKVStore) -> None:
        kv.close()
        for call in (lambda: kv.pull(3, out=mx.nd.zeros(SHAPE)),
                     lambda: kv.push(3, mx.nd.ones(SHAPE)),
                     lambda: kv.init(8, mx.nd.ones(SHAPE)),
                     lambda: kv.pushpull(3, mx.nd.ones(SHAPE)),
                     lambda: kv.barrier()):
            expect_error(kv, call, UnsupportedError, NotImplementedError, "closed",
                         "pskv.kv.create()")
        kv.close()  # closing twice is fine

    def test_register_not_a_store(self) -> None:
        expect_error(None, lambda: KVStoreBase.register(int), ConfigError, ValueError,
                     "KVStoreBase subclass")


class TestRowSparseErrors:
    def test_without_row_ids(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=out), ValueTypeError,
                     TypeError, "row_ids=", "Pass")
        assert out.indices.shape == (0,)

    def test_without_out(self, rkv: LocalKVStore) -> None:
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, row_ids=mx.nd.array([1])),
                     ValueTypeError, TypeError, "out=")

    def test_dense_out(self, rkv: LocalKVStore) -> None:
        out = mx.nd.zeros(RSP_SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=out, row_ids=mx.nd.array([1])),
                     ValueTypeError, TypeError, "key 7", "row_sparse outs",
                     "mx.nd.sparse.zeros('row_sparse', (6, 2))")
        np.testing.assert_array_equal(out.asnumpy(), 0)

    def test_dense_key(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(1, out=out, row_ids=mx.nd.array([1])),
                     UnsupportedError, NotImplementedError, "key 1", "(2, 3)", "pull()")

    @pytest.mark.parametrize("rows", [[6], [-1], [0, 100]])
    def test_row_out_of_range(self, rkv: LocalKVStore, rows: list[int]) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=out,
                                                      row_ids=np.array(rows, np.int64)),
                     ShapeMismatchError, ValueError, "key 7", "[0, 6)")
        assert out.indices.shape == (0,)

    def test_second_out_bad_fills_nothing(self, rkv: LocalKVStore) -> None:
        good = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        bad = mx.nd.sparse.zeros("row_sparse", (5, 2))
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=[good, bad],
                                                      row_ids=mx.nd.array([1])),
                     ShapeMismatchError, ValueError, "key 7", "(5, 2)")
        assert good.indices.shape == (0,)

    def test_row_ids_count(self, rkv: LocalKVStore) -> None:
        outs = [mx.nd.sparse.zeros("row_sparse", RSP_SHAPE) for _ in range(2)]
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=outs, row_ids=[
            mx.nd.array([1])] * 3), ShapeMismatchError, ValueError, "3 row_ids for 2 outs",
            "key 7")

    def test_row_ids_not_numbers(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        expect_error(rkv, lambda: rkv.row_sparse_pull(7, out=out, row_ids=np.array(["a"])),
                     ValueTypeError, TypeError, "key 7", "not numbers", "integer")


# ======================================================================================
# Semantics
# ======================================================================================
class TestKeys:
    def test_numpy_integer_keys(self) -> None:
        kv = mx.kv.create()
        kv.init(np.int64(3), mx.nd.ones(SHAPE))
        kv.push([np.int32(3)], [mx.nd.ones(SHAPE) * 4])
        np.testing.assert_array_equal(pulled(kv, 3), full(4))
        np.testing.assert_array_equal(pulled(kv, np.uint8(3)), full(4))
        assert list(kv._store) == [3] and type(list(kv._store)[0]) is int

    def test_str_keys_reach_updater_as_str(self, skv: LocalKVStore) -> None:
        seen: list[Any] = []

        def upd(key: Any, inp: Any, stored: Any) -> None:
            seen.append(key)
            stored += inp

        skv.set_updater(upd)
        skv.push(["w", "b"], [mx.nd.ones(SHAPE)] * 2)
        assert seen == ["w", "b"] and all(type(k) is str for k in seen)

    def test_int_keys_reach_updater_as_int(self, kv: LocalKVStore) -> None:
        seen: list[Any] = []
        kv._set_updater(lambda k, i, s: seen.append(k))
        kv.push(np.int64(4), mx.nd.ones(SHAPE))
        assert seen == [4] and type(seen[0]) is int

    def test_duplicate_keys_summed_on_push_each_filled_on_pull(self, kv: LocalKVStore
                                                               ) -> None:
        kv.push([3, 4, 3], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2,
                            [mx.nd.ones(SHAPE) * 3, mx.nd.ones(SHAPE) * 4]])
        outs = [mx.nd.zeros(SHAPE) for _ in range(3)]
        kv.pull([3, 4, 3], out=outs)
        for o, want in zip(outs, (8, 2, 8)):
            np.testing.assert_array_equal(o.asnumpy(), full(want))

    def test_duplicate_keys_one_updater_call(self, kv: LocalKVStore) -> None:
        seen: list[Any] = []

        def upd(key: Any, inp: Any, stored: Any) -> None:
            seen.append((key, inp.asnumpy()[0, 0]))
            stored += inp

        kv.set_updater(upd)
        kv.push([3, 3, 3], [mx.nd.ones(SHAPE)] * 3)
        assert seen == [(3, 3.0)]
        np.testing.assert_array_equal(pulled(kv, 3), full(4))

    def test_list_of_lists(self, kv: LocalKVStore) -> None:
        devs = [mx.cpu(i) for i in range(3)]
        kv.push([3, 4], [[mx.nd.ones(SHAPE, d) for d in devs],
                         [mx.nd.ones(SHAPE, d) * 2 for d in devs]])
        outs = [[mx.nd.zeros(SHAPE, d) for d in devs] for _ in range(2)]
        kv.pull([3, 4], out=outs)
        for group, want in zip(outs, (3, 6)):
            for o, d in zip(group, devs):
                np.testing.assert_array_equal(o.asnumpy(), full(want))
                assert o.context == d

    def test_tuple_keys_and_values(self, kv: LocalKVStore) -> None:
        kv.push((3, 4), (mx.nd.ones(SHAPE) * 5, mx.nd.ones(SHAPE) * 6))
        a, b = kv.pull((3, 4))
        np.testing.assert_array_equal(a.asnumpy(), full(5))
        np.testing.assert_array_equal(b.asnumpy(), full(6))

    def test_one_key_list_with_one_array(self, kv: LocalKVStore) -> None:
        kv.push([3], mx.nd.ones(SHAPE) * 9)
        np.testing.assert_array_equal(pulled(kv, [3]), full(9))

    def test_push_order_is_init_order(self) -> None:
        kv = mx.kv.create()
        kv.init(["b", "a", "c"], [mx.nd.zeros(SHAPE)] * 3)
        seen: list[Any] = []
        kv.set_updater(lambda k, i, s: seen.append(k))
        kv.push(["c", "a", "b"], [mx.nd.ones(SHAPE)] * 3)
        assert seen == ["b", "a", "c"]


class TestValues:
    def test_float64_value_into_float32_key(self, kv: LocalKVStore) -> None:
        kv.push(3, np.full(SHAPE, 1 / 3))
        got = pulled(kv, 3)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, full(1 / 3))
        kv.push(3, mx.nd.array(np.full(SHAPE, 2.5), dtype="float64"))
        np.testing.assert_array_equal(pulled(kv, 3), full(2.5))

    def test_float64_keys_stay_float64(self) -> None:
        kv = mx.kv.create()
        kv.init(0, np.zeros(SHAPE))
        kv.push(0, [np.full(SHAPE, 0.1), np.full(SHAPE, 0.2)])
        got = kv.pull(0)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, np.full(SHAPE, 0.1) + np.full(SHAPE, 0.2))

    def test_pull_float32_into_float64_out(self, kv: LocalKVStore) -> None:
        out = np.zeros(SHAPE)
        kv.pull(3, out=out)
        np.testing.assert_array_equal(out, 1.0)

    def test_numpy_values_and_outs(self) -> None:
        kv = mx.kv.create()
        kv.init("w", np.ones(SHAPE, np.float32))
        kv.push("w", [np.ones(SHAPE, np.float32), mx.nd.ones(SHAPE)])
        out = np.zeros(SHAPE, np.float32)
        kv.pull("w", out=out)
        np.testing.assert_array_equal(out, full(2))

    def test_pull_out_none_returns_new_array(self, kv: LocalKVStore) -> None:
        a = kv.pull(3)
        b = kv.pull(3)
        assert isinstance(a, mx.nd.NDArray) and a is not b
        np.testing.assert_array_equal(a.asnumpy(), full(1))
        a += 100
        np.testing.assert_array_equal(pulled(kv, 3), full(1))
        both = kv.pull([3, 4])
        assert isinstance(both, list) and len(both) == 2
        np.testing.assert_array_equal(both[1].asnumpy(), full(2))

    def test_pull_out_none_numpy_key_gives_numpy(self) -> None:
        kv = mx.kv.create()
        kv.init(0, np.arange(3.0))
        got = kv.pull(0)
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, [0, 1, 2])

    def test_pushpull_with_out(self, kv: LocalKVStore) -> None:
        vals = [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2]
        outs = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE, mx.cpu(1))]
        assert kv.pushpull(3, vals, out=outs) is None
        for o in outs:
            np.testing.assert_array_equal(o.asnumpy(), full(3))
        np.testing.assert_array_equal(vals[1].asnumpy(), full(2))

    def test_pushpull_without_out(self, kv: LocalKVStore) -> None:
        kv.set_updater(lambda k, i, s: s.__iadd__(i))
        vals = [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 2]
        kv.pushpull(3, vals)
        for v in vals:
            np.testing.assert_array_equal(v.asnumpy(), full(4))

    def test_pushpull_key_list(self, kv: LocalKVStore) -> None:
        outs = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE)]
        kv.pushpull([4, 3], [mx.nd.ones(SHAPE) * 5, mx.nd.ones(SHAPE) * 6], out=outs)
        np.testing.assert_array_equal(outs[0].asnumpy(), full(5))
        np.testing.assert_array_equal(outs[1].asnumpy(), full(6))

    def test_broadcast(self) -> None:
        kv = mx.kv.create()
        outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(3)]
        kv.broadcast(["a"], [mx.nd.ones(SHAPE) * 4], out=[outs])
        for o in outs:
            np.testing.assert_array_equal(o.asnumpy(), full(4))
        kv.push("a", mx.nd.ones(SHAPE))
        np.testing.assert_array_equal(pulled(kv, "a"), full(1))

    def test_broadcast_key_list(self) -> None:
        kv = mx.kv.create()
        o1, o2 = mx.nd.zeros(SHAPE), mx.nd.zeros((4,))
        kv.broadcast([1, 2], [mx.nd.ones(SHAPE), mx.nd.ones((4,)) * 3], out=[o1, o2])
        np.testing.assert_array_equal(o2.asnumpy(), full(3, (4,)))


class TestNoAliasing:
    def test_init_copies(self) -> None:
        kv = mx.kv.create()
        v = mx.nd.ones(SHAPE)
        n = np.ones(SHAPE, np.float32)
        kv.init([1, 2], [v, n])
        v += 5
        n += 5
        np.testing.assert_array_equal(pulled(kv, 1), full(1))
        np.testing.assert_array_equal(pulled(kv, 2), full(1))

    def test_single_push_copies(self, kv: LocalKVStore) -> None:
        v = mx.nd.ones(SHAPE) * 7
        kv.push(3, v)
        v[:] = 0
        np.testing.assert_array_equal(pulled(kv, 3), full(7))

    def test_pushpull_and_pull_copy(self, kv: LocalKVStore) -> None:
        v = mx.nd.ones(SHAPE) * 7
        kv.pushpull(3, v)
        v[:] = 0
        out = mx.nd.zeros(SHAPE)
        kv.pull(3, out=out)
        out[:] = -1
        np.testing.assert_array_equal(pulled(kv, 3), full(7))

    def test_broadcast_copies(self) -> None:
        kv = mx.kv.create()
        v = mx.nd.ones(SHAPE)
        kv.broadcast(0, v, out=mx.nd.zeros(SHAPE))
        v += 1
        np.testing.assert_array_equal(pulled(kv, 0), full(1))

    def test_row_sparse_init_copies(self) -> None:
        kv = mx.kv.create()
        v = mx.nd.array(TABLE).tostype("row_sparse")
        kv.init(0, v)
        v._data[:] = -1
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        kv.row_sparse_pull(0, out=out, row_ids=mx.nd.array(np.arange(6)))
        np.testing.assert_array_equal(out.tostype("default").asnumpy(), TABLE)

    def test_updater_input_is_not_the_stored_value(self, kv: LocalKVStore) -> None:
        # MXNet's ASSIGN of a multi-device push makes the stored value alias the merge
        # buffer (kvstore_local.h `local = merged`), so a later updater sees stored == input
        kv.push(3, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE) * 3])
        kv.set_updater(lambda k, i, s: s.__iadd__(i * 2))
        kv.push(3, [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
        np.testing.assert_array_equal(pulled(kv, 3), full(8))  # MXNet 1.9.1: 6


class TestRowSparse:
    @pytest.mark.parametrize("rows, dtype", [
        ([4, 1, 4], "int64"), ([5.0, 0.0], "float32"), ([[4, 1], [0, 4]], "int64"),
        ([3], "int32"), ([], "int64"), (list(range(6)), "float64"),
    ])
    def test_rows(self, rkv: LocalKVStore, rows: Any, dtype: str) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        kv_rows = mx.nd.array(rows, dtype=dtype)
        rkv.row_sparse_pull(7, out=out, row_ids=kv_rows)
        want = np.unique(np.asarray(rows, dtype=np.int64).ravel())
        np.testing.assert_array_equal(out.indices.asnumpy(), want)
        np.testing.assert_array_equal(out.data.asnumpy(), TABLE[want])
        assert out.data.shape == (len(want), 2)

    def test_numpy_row_ids(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        rkv.row_sparse_pull(7, out=out, row_ids=np.array([2, 2, 0]))
        np.testing.assert_array_equal(out.indices.asnumpy(), [0, 2])

    def test_one_row_ids_several_outs(self, rkv: LocalKVStore) -> None:
        outs = [mx.nd.sparse.zeros("row_sparse", RSP_SHAPE, mx.cpu(i)) for i in range(3)]
        rkv.row_sparse_pull(7, out=outs, row_ids=mx.nd.array([5, 1]))
        for i, o in enumerate(outs):
            np.testing.assert_array_equal(o.indices.asnumpy(), [1, 5])
            np.testing.assert_array_equal(o.data.asnumpy(), TABLE[[1, 5]])
            assert o.context == mx.cpu(i)

    def test_row_ids_per_out(self, rkv: LocalKVStore) -> None:
        outs = [mx.nd.sparse.zeros("row_sparse", RSP_SHAPE) for _ in range(2)]
        rkv.row_sparse_pull(7, out=outs, row_ids=[mx.nd.array([5]), mx.nd.array([0, 1])])
        np.testing.assert_array_equal(outs[0].indices.asnumpy(), [5])
        np.testing.assert_array_equal(outs[1].indices.asnumpy(), [0, 1])

    def test_out_replaced_not_merged(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.row_sparse_array((np.full((2, 2), 9.0), [0, 3]), shape=RSP_SHAPE)
        rkv.row_sparse_pull(7, out=out, row_ids=mx.nd.array([1]))
        np.testing.assert_array_equal(out.indices.asnumpy(), [1])
        np.testing.assert_array_equal(out.data.asnumpy(), TABLE[[1]])

    def test_pulled_rows_do_not_alias_store(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        rkv.row_sparse_pull(7, out=out, row_ids=mx.nd.array(np.arange(6)))
        out._data[:] = -5
        again = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        rkv.row_sparse_pull(7, out=again, row_ids=mx.nd.array(np.arange(6)))
        np.testing.assert_array_equal(again.data.asnumpy(), TABLE)

    def test_push_assign_and_updater(self) -> None:
        grad = mx.nd.sparse.row_sparse_array((np.ones((2, 2), np.float32), [1, 3]),
                                             shape=RSP_SHAPE)
        every = mx.nd.array(np.arange(6))
        want = np.zeros(RSP_SHAPE, np.float32)
        want[[1, 3]] = 2
        for upd, expect in ((None, want), (lambda k, i, s: s.__iadd__(i), TABLE + want)):
            kv = mx.kv.create()
            kv.init(7, mx.nd.array(TABLE).tostype("row_sparse"))
            if upd is not None:
                kv.set_updater(upd)
            kv.push(7, [grad, grad])
            out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
            kv.row_sparse_pull(7, out=out, row_ids=every)
            np.testing.assert_array_equal(out.tostype("default").asnumpy(), expect)

    def test_plain_pull_into_row_sparse_warns_once(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.row_sparse_array((np.full((1, 2), 9.0, np.float32), [2]),
                                            shape=RSP_SHAPE)
        with pytest.warns(SparsePullIgnoredWarning, match="key 7.*row_sparse_pull"):
            rkv.pull(7, out=out)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rkv.pull(7, out=out)  # no second warning for this key
        np.testing.assert_array_equal(out.indices.asnumpy(), [2])
        np.testing.assert_array_equal(out.data.asnumpy(), np.full((1, 2), 9.0))

    def test_plain_pull_into_row_sparse_not_ignored(self, rkv: LocalKVStore) -> None:
        out = mx.nd.sparse.zeros("row_sparse", RSP_SHAPE)
        rkv.pull(7, out=out, ignore_sparse=False)
        np.testing.assert_array_equal(out.tostype("default").asnumpy(), TABLE)

    def test_plain_pull_of_row_sparse_key_into_dense(self, rkv: LocalKVStore) -> None:
        out = mx.nd.zeros(RSP_SHAPE)
        rkv.pull(7, out=out)
        np.testing.assert_array_equal(out.asnumpy(), TABLE)


class TestStore:
    @pytest.mark.parametrize("name", ["local", "device", "Local", "DEVICE",
                                      "local_allreduce_cpu", "local_update_cpu",
                                      "Local_AllReduce_Device"])
    def test_type_lower_cased(self, name: str) -> None:
        kv = mx.kv.create(name)
        assert kv.type == name.lower()
        assert isinstance(kv, mx.KVStore)

    def test_create_aliases(self) -> None:
        assert mx.create is mx.kv.create is mx.kvstore.create
        assert mx.kv.create().type == "local"

    def test_rank_workers_barrier(self, kv: LocalKVStore) -> None:
        assert (kv.rank, kv.num_workers) == (0, 1)
        assert kv.barrier() is None and kv._barrier() is None

    def test_is_capable(self, kv: LocalKVStore) -> None:
        assert kv.is_capable("optimizer") is True
        assert kv.is_capable(KVStoreBase.OPTIMIZER) is True
        assert kv.is_capable("OPTIMIZER") is True

    def test_context_manager(self) -> None:
        with mx.kv.create() as kv:
            kv.init(0, mx.nd.ones(SHAPE))
            np.testing.assert_array_equal(pulled(kv, 0), full(1))
        with pytest.raises(UnsupportedError):
            kv.pull(0)

    def test_register_custom_store(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(KVStoreBase, "kv_registry", dict(KVStoreBase.kv_registry))

        @KVStoreBase.register
        class MyTestStore(KVStoreBase):
            pass

        kv = mx.kv.create("MyTestStore")
        assert type(kv) is MyTestStore and kv.type == "myteststore"
        assert (kv.rank, kv.num_workers) == (0, 1)
        with pytest.raises(UnsupportedError) as info:
            kv.pushpull(0, mx.nd.ones(SHAPE))
        assert isinstance(info.value, NotImplementedError)
        with pytest.warns(UserWarning, match="already registered"):
            KVStoreBase.register(type("MyTestStore", (KVStoreBase,), {}))

    def test_repr(self, kv: LocalKVStore) -> None:
        assert repr(kv) == "<LocalKVStore type='local' keys=2>"

    def test_thread_safety(self) -> None:
        kv = mx.kv.create()
        kv.init(0, np.zeros(1000, np.float64))
        kv.set_updater(lambda k, i, s: s.__iadd__(i))
        threads, pushes = 8, 200

        def worker(t: int) -> None:
            for j in range(pushes):
                kv.push(0, np.full(1000, t * pushes + j, np.float64))

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        n = threads * pushes
        np.testing.assert_array_equal(kv.pull(0), np.full(1000, n * (n - 1) / 2))

    def test_thread_safety_assign_many_devices(self) -> None:
        kv = mx.kv.create()
        kv.init("w", np.zeros(300_000, np.float32))  # big enough for the reduce pool
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for _ in range(5):
                    kv.push("w", [np.full(300_000, t, np.float32)] * 3)
                    got = kv.pull("w")
                    assert np.all(got == got[0]), "torn value"
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert errors == []
        kv.close()


class TestModelAndChecks:
    def test_numpy_model_agrees(self) -> None:
        rng = np.random.default_rng(0)
        kv = mx.kv.create()
        model = NumpyKVModel()
        init = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
        kv.init([0, 1, 2], init)
        model.init([0, 1, 2], init)
        for _ in range(5):
            vals = [[rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)]
                    for _ in range(3)]
            kv.push([0, 2, 0], vals)
            model.push([0, 2, 0], vals)
            for k in range(3):
                np.testing.assert_allclose(kv.pull(k), model.pull(k), rtol=1e-6)

    @pytest.mark.parametrize("store_type", ["local", "device"])
    def test_check_kvstore_semantics(self, store_type: str) -> None:
        from pskv.testing import CHECKS
        assert check_kvstore_semantics(mx, store_type) == list(CHECKS)

    def test_unknown_check(self) -> None:
        with pytest.raises(KeyError, match="no_such_check"):
            check_kvstore_semantics(mx, "local", ["no_such_check"])
