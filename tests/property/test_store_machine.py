"""A Hypothesis state machine of the local store checked against a dict-of-NumPy model.

Rules: init, push (one value, one value per device, key lists with duplicates), pull,
pushpull, set_updater, and deliberately bad calls; after every step every key's value must
equal the model's (``pskv.testing.NumpyKVModel``), so a failing call must change nothing.
Values are small integers in float32, so every sum and update is exact.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pskv as mx
from pskv.errors import KVStoreError
from pskv.testing import UPDATERS, NumpyKVModel, numpy_updater
from strategies import (SHAPES, UPDATER_NAMES, bad_shape_for, int_keys, key_lists, str_keys,
                        values_for)

SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class StoreMachine(RuleBasedStateMachine):
    """The local store against NumpyKVModel; subclasses pick the key kind."""

    keys_strategy: st.SearchStrategy[Any] = int_keys
    other_kind: Any = "k"  # a key of the other kind: mixing must fail

    def __init__(self) -> None:
        super().__init__()
        self.kv: Any = None
        self.model = NumpyKVModel()
        self.seen: list[Any] = []

    @initialize(store_type=st.sampled_from(["local", "device"]))
    def create(self, store_type: str) -> None:
        self.kv = mx.kv.create(store_type)

    # ---- helpers -------------------------------------------------------------------
    def keys(self) -> list[Any]:
        return list(self.model.store)

    def draw_values(self, data: st.DataObject, key: Any, max_devices: int = 3
                    ) -> list[np.ndarray]:
        n = data.draw(st.integers(1, max_devices), label="devices")
        shape = self.model.store[key].shape
        return [data.draw(values_for(shape), label=f"value {key!r}") for _ in range(n)]

    def as_call(self, vals: list[np.ndarray], data: st.DataObject) -> Any:
        """One value as itself, several as a list; NDArrays on cpu(i) or NumPy arrays."""
        nd = data.draw(st.booleans(), label="as NDArray")
        arrs = [mx.nd.array(v, mx.cpu(i)) if nd else v.copy() for i, v in enumerate(vals)]
        return arrs[0] if len(arrs) == 1 and data.draw(st.booleans(), label="bare") else arrs

    def expect_failure(self, fn: Any) -> None:
        with pytest.raises(KVStoreError):
            fn()

    # ---- rules -----------------------------------------------------------------------
    @rule(data=st.data(), shape=st.sampled_from(SHAPES))
    def init(self, data: st.DataObject, shape: tuple[int, ...]) -> None:
        key = data.draw(self.keys_strategy, label="key")
        assume(key not in self.model.store)
        value = data.draw(values_for(shape), label="value")
        self.kv.init(key, mx.nd.array(value))
        self.model.init(key, value)
        value[...] = 99  # the store keeps its own copy

    @rule(data=st.data(), n=st.integers(2, 3), shape=st.sampled_from(SHAPES))
    def init_list(self, data: st.DataObject, n: int, shape: tuple[int, ...]) -> None:
        keys = data.draw(st.lists(self.keys_strategy, min_size=n, max_size=n, unique=True))
        assume(not any(k in self.model.store for k in keys))
        vals = [data.draw(values_for(shape)) for _ in keys]
        self.kv.init(keys, vals)
        self.model.init(keys, vals)

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys()), label="key")
        vals = self.draw_values(data, key)
        self.kv.push(key, self.as_call(vals, data))
        self.model.push(key, vals)

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def push_key_list(self, data: st.DataObject) -> None:
        keys = data.draw(key_lists(self.keys()), label="keys")
        groups = [self.draw_values(data, k, max_devices=2) for k in keys]
        self.kv.push(keys, [self.as_call(g, data) for g in groups])
        self.model.push(keys, groups)

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def pull(self, data: st.DataObject) -> None:
        keys = data.draw(key_lists(self.keys()), label="keys")
        outs = [mx.nd.zeros(self.model.store[k].shape, mx.cpu(i)) for i, k in enumerate(keys)]
        self.kv.pull(keys, out=outs)
        for k, o in zip(keys, outs):
            np.testing.assert_array_equal(o.asnumpy(), self.model.pull(k))

    @precondition(lambda self: self.model.store)
    @rule(data=st.data(), with_out=st.booleans())
    def pushpull(self, data: st.DataObject, with_out: bool) -> None:
        key = data.draw(st.sampled_from(self.keys()), label="key")
        vals = self.draw_values(data, key)
        arrs = [mx.nd.array(v) for v in vals]
        outs = [mx.nd.zeros(vals[0].shape) for _ in range(2)] if with_out else None
        self.kv.pushpull(key, arrs, out=outs)
        want = self.model.pushpull(key, vals)
        for o in outs if with_out else arrs:
            np.testing.assert_array_equal(o.asnumpy(), want)

    @rule(name=st.sampled_from(UPDATER_NAMES))
    def set_updater(self, name: str) -> None:
        fn = UPDATERS[name]
        kind = type(self.other_kind)

        def updater(key: Any, inp: Any, stored: Any) -> None:
            assert type(key) is not kind, f"key {key!r} reached the updater as {kind}"
            self.seen.append(key)
            fn(key, inp, stored)

        self.kv.set_updater(updater)
        self.model.updater = numpy_updater(name)

    # ---- bad calls: each must raise and change nothing ----------------------------------
    @rule(data=st.data())
    def push_uninitialized(self, data: st.DataObject) -> None:
        key = data.draw(self.keys_strategy, label="key")
        assume(key not in self.model.store)
        self.expect_failure(lambda: self.kv.push(key, mx.nd.ones((3,))))
        self.expect_failure(lambda: self.kv.pull(key, out=mx.nd.ones((3,))))

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def init_again(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys()), label="key")
        self.expect_failure(lambda: self.kv.init(key, self.model.store[key] + 1))

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def push_list_last_bad(self, data: st.DataObject) -> None:
        keys = data.draw(key_lists(self.keys()), label="keys")
        vals = [self.model.store[k] + 1 for k in keys]
        how = data.draw(st.sampled_from(["shape", "dtype", "none", "kind", "uninit"]))
        last = keys[-1]
        if how == "shape":
            vals[-1] = np.ones(data.draw(bad_shape_for(self.model.store[last].shape)),
                               np.float32)
        elif how == "dtype":
            vals[-1] = vals[-1].astype(np.complex64)
        elif how == "none":
            vals[-1] = None
        elif how == "kind":
            keys = keys + [self.other_kind]
            vals.append(np.ones(1, np.float32))
        else:
            new = data.draw(self.keys_strategy, label="uninitialized key")
            assume(new not in self.model.store)
            keys = keys + [new]
            vals.append(np.ones(1, np.float32))
        self.expect_failure(lambda: self.kv.push(keys, vals))
        self.expect_failure(lambda: self.kv.pushpull(keys, vals))

    @precondition(lambda self: self.model.store)
    @rule(data=st.data())
    def pull_list_last_bad(self, data: st.DataObject) -> None:
        keys = data.draw(key_lists(self.keys()), label="keys")
        outs = [np.zeros(self.model.store[k].shape, np.float32) for k in keys]
        outs[-1] = np.zeros(data.draw(bad_shape_for(outs[-1].shape)), np.float32)
        self.expect_failure(lambda: self.kv.pull(keys, out=outs))
        for o in outs:
            assert not o.any(), "a failing pull filled an out"

    @rule()
    def mixed_kind(self) -> None:
        if self.model.store:
            self.expect_failure(lambda: self.kv.init(self.other_kind, np.ones(1, np.float32)))
        self.expect_failure(lambda: self.kv.init([self.other_kind, *self.keys()[:1]] or
                                                 [self.other_kind],
                                                 [np.ones(1, np.float32)] * 2))

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        if self.kv is None or not self.model.store:
            return
        keys = self.keys()
        got = self.kv.pull(keys)
        assert len(got) == len(keys)
        for k, g in zip(keys, got):
            np.testing.assert_array_equal(g.asnumpy() if hasattr(g, 'asnumpy') else g,
                                          self.model.store[k],
                                          err_msg=f"key {k!r}")

    @invariant()
    def updater_keys_known(self) -> None:
        assert all(k in self.model.store for k in self.seen)

    def teardown(self) -> None:
        if self.kv is not None:
            self.kv.close()


class IntKeyMachine(StoreMachine):
    keys_strategy = int_keys
    other_kind = "k"


class StrKeyMachine(StoreMachine):
    keys_strategy = str_keys
    other_kind = 0


TestIntKeys = IntKeyMachine.TestCase
TestIntKeys.settings = SETTINGS
TestStrKeys = StrKeyMachine.TestCase
TestStrKeys.settings = SETTINGS
