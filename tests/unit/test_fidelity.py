"""MXNet programs run unchanged: the default random stream, MXNet's import forms and
MXNetError, the ``teststore`` store type, and one ``set_optimizer`` check for every store.

MXNet's side of each is in ``tests/mxnet/test_fidelity_mxnet.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import (ConfigError, KVStoreError, ShapeMismatchError, UnsupportedError,
                         ValueTypeError)
from pskv.nd import random as nd_random


# ---- the default random stream -------------------------------------------------------------
@pytest.fixture
def fresh_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random state of a process that has not drawn yet."""
    monkeypatch.setattr(nd_random, "_STATE", {})


def _draws() -> np.ndarray:
    return np.concatenate([mx.nd.random.uniform(shape=(3,)).asnumpy(),
                           mx.random.uniform(-1, 1, shape=(2,)).asnumpy(),
                           mx.nd.random.normal(shape=(2,)).asnumpy(),
                           mx.nd.random_uniform(shape=(1,)).asnumpy()])


def test_unseeded_draws_are_the_default_seeds_stream(fresh_stream: None) -> None:
    """Every process starts from DEFAULT_SEED, as MXNet's from seed(0): workers draw alike."""
    first = _draws()
    mx.random.seed(mx.random.DEFAULT_SEED)
    np.testing.assert_array_equal(_draws(), first)
    assert mx.random.DEFAULT_SEED == 0
    mx.random.seed(1)
    assert not np.array_equal(_draws(), first)


def test_every_entry_point_shares_one_stream(fresh_stream: None) -> None:
    a = mx.nd.random.uniform(shape=(2,)).asnumpy()
    b = mx.random.uniform(shape=(2,)).asnumpy()        # goes on, does not restart
    mx.random.seed(0)
    both = mx.nd.random_uniform(shape=(4,)).asnumpy()
    np.testing.assert_array_equal(np.concatenate([a, b]), both)
    assert mx.random is mx.nd.random and mx.ndarray.random is mx.nd.random


def test_seed_still_repeats_and_checks(fresh_stream: None) -> None:
    mx.random.seed(5)
    a = mx.nd.random.normal(shape=(3,)).asnumpy()
    mx.nd.random.seed(5)
    np.testing.assert_array_equal(mx.nd.random.normal(shape=(3,)).asnumpy(), a)
    with pytest.raises(ValueTypeError):
        mx.random.seed(-1)


# ---- import forms --------------------------------------------------------------------------
def test_mxnet_import_forms() -> None:
    from pskv import ndarray
    from pskv.base import MXNetError
    import pskv.kvstore as kvs
    import pskv.ndarray as nd
    assert MXNetError is mx.MXNetError is KVStoreError
    assert nd is ndarray and nd.zeros is mx.nd.zeros and nd.NDArray is mx.nd.NDArray
    assert nd.sparse is mx.nd.sparse and nd.random is mx.nd.random
    assert sorted(nd.__all__) == sorted(mx.nd.__all__)
    assert kvs is mx.kv is mx.kvstore and kvs.create is mx.kvstore.create is mx.create
    assert float(nd.ones((2,)).asnumpy().sum()) == 2.0


@pytest.mark.parametrize("misuse,builtin", [
    ("duplicate init", KeyError),
    ("wrong shape", ValueError),
    ("uninitialized pull", KeyError),
])
def test_mxnet_error_catches_what_mxnet_raises_as_mxnet_error(misuse: str,
                                                               builtin: type) -> None:
    """MXNet raises MXNetError for these; ``except mx.MXNetError`` catches pskv's error,
    and so does the builtin pskv's class derives from."""
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2,)))
    call = {"duplicate init": lambda: kv.init(3, mx.nd.ones((2,))),
            "wrong shape": lambda: kv.push(3, mx.nd.ones((3,))),
            "uninitialized pull": lambda: kv.pull(9, out=mx.nd.zeros((2,)))}[misuse]
    with pytest.raises(mx.MXNetError) as info:
        call()
    assert isinstance(info.value, builtin)
    np.testing.assert_array_equal(kv.pull(3).asnumpy(), np.ones(2))


# ---- teststore -----------------------------------------------------------------------------
def test_teststore_is_registered_on_import() -> None:
    kv = mx.kv.create("teststore")
    assert type(kv).__name__ == "TestStore" and isinstance(kv, mx.KVStoreBase)
    assert mx.KVStoreBase.kv_registry["teststore"] is type(kv)
    assert mx.kv.create("TestStore").type == "teststore"
    assert (kv.type, kv.rank, kv.num_workers) == ("teststore", 0, 1)


def test_teststore_is_capable() -> None:
    kv = mx.kv.create("teststore")
    assert kv.is_capable("optimizer") is False and kv.is_capable("OPTIMIZER") is False
    assert type(kv).is_capable(mx.KVStoreBase.OPTIMIZER) is False   # a staticmethod
    with pytest.raises(ConfigError, match="unknown capability 'compression'") as info:
        kv.is_capable("compression")
    assert isinstance(info.value, ValueError)      # MXNet: ValueError


def test_teststore_broadcast_copies_into_each_out() -> None:
    kv = mx.kv.create("teststore")
    outs = [mx.nd.zeros((2, 3), mx.cpu(i)) for i in range(3)]
    kv.broadcast(3, mx.nd.ones((2, 3)) * 2, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.full((2, 3), 2.0))
    single = np.zeros((2, 3), np.float32)
    kv.broadcast("w", mx.nd.ones((2, 3)), out=single)
    np.testing.assert_array_equal(single, np.ones((2, 3)))


def test_teststore_pushpull_sums() -> None:
    kv = mx.kv.create("teststore")
    vals = [mx.nd.ones((2,), mx.cpu(i)) * (i + 1) for i in range(3)]
    kv.pushpull(3, vals)                                   # out=None: into the values
    for v in vals:
        np.testing.assert_array_equal(v.asnumpy(), np.full(2, 6.0))
    out = mx.nd.zeros((2,))
    kv.pushpull(3, [mx.nd.ones((2,)), mx.nd.ones((2,)) * 4], out=out)
    np.testing.assert_array_equal(out.asnumpy(), np.full(2, 5.0))
    kv.pushpull(3, mx.nd.ones((2,)) * 7, out=[out])        # one value: copied
    np.testing.assert_array_equal(out.asnumpy(), np.full(2, 7.0))
    a = mx.nd.ones((2,))
    kv.pushpull(3, a)                                      # one value, no out: nothing
    np.testing.assert_array_equal(a.asnumpy(), np.ones(2))


def test_teststore_keeps_nothing_and_takes_no_optimizer(tmp_path: Any) -> None:
    kv = mx.kv.create("teststore")
    for call in (lambda: kv.set_optimizer(mx.optimizer.SGD()),
                 lambda: kv.save_optimizer_states(str(tmp_path / "s")),
                 lambda: kv.load_optimizer_states(str(tmp_path / "s")),
                 lambda: kv.init(3, mx.nd.ones((2,))),
                 lambda: kv.pull(3, out=mx.nd.zeros((2,)))):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert isinstance(info.value, NotImplementedError)   # MXNet: NotImplementedError


def test_teststore_bad_calls_change_nothing() -> None:
    kv = mx.kv.create("teststore")
    good, bad = mx.nd.zeros((2,)), mx.nd.zeros((3,))
    with pytest.raises(ShapeMismatchError, match=r"shape \(3,\)"):
        kv.broadcast(3, mx.nd.ones((2,)), out=[good, bad])
    with pytest.raises(ShapeMismatchError):
        kv.pushpull(3, [mx.nd.ones((2,)), mx.nd.ones((3,))], out=good)
    with pytest.raises(ValueTypeError):
        kv.pushpull(3, [mx.nd.ones((2,)), None], out=good)
    with pytest.raises(UnsupportedError, match="one key"):
        kv.pushpull([3, 4], [mx.nd.ones((2,)), mx.nd.ones((2,))])
    np.testing.assert_array_equal(good.asnumpy(), np.zeros(2))


# ---- set_optimizer: one check for every store ------------------------------------------------
BAD_OPTIMIZERS = [
    ("SGD(learning_rate='abc')", lambda: mx.optimizer.SGD(learning_rate="abc"),
     "learning_rate='abc'"),
    ("SGD(momentum=nan)", lambda: mx.optimizer.SGD(momentum=float("nan")), "momentum=nan"),
    ("Adam(beta1='x')", lambda: mx.optimizer.create("adam", beta1="x"), "beta1='x'"),
    ("SGD(wd=None)", lambda: mx.optimizer.SGD(wd=None), "wd=None"),
]


@pytest.mark.parametrize("store_type", ["local", "device"])
@pytest.mark.parametrize("what,make,fragment", BAD_OPTIMIZERS, ids=[b[0] for b in BAD_OPTIMIZERS])
def test_local_stores_refuse_bad_hyperparameters_in_set_optimizer(
        store_type: str, what: str, make: Any, fragment: str) -> None:
    kv = mx.kv.create(store_type)
    kv.init(3, mx.nd.ones((2,)))
    with pytest.raises(ConfigError, match="set_optimizer") as info:
        kv.set_optimizer(make())
    assert fragment in str(info.value)
    assert kv._engine.updater is None                  # nothing changed: push assigns
    kv.push(3, mx.nd.ones((2,)) * 5)
    np.testing.assert_array_equal(kv.pull(3).asnumpy(), np.full(2, 5.0))


def test_a_bad_optimizer_leaves_the_previous_one() -> None:
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((2,)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    before = kv._engine.updater
    with pytest.raises(ConfigError):
        kv.set_optimizer(mx.optimizer.SGD(learning_rate="abc"))
    assert kv._engine.updater is before
    kv.push(3, mx.nd.ones((2,)))
    np.testing.assert_allclose(kv.pull(3).asnumpy(), np.full(2, -0.5))


def test_unregistered_optimizers_are_checked_by_their_values() -> None:
    """A local store takes optimizers no spec can describe; their values are still checked."""
    class Halving(mx.optimizer.SGD):   # not registered: no spec
        pass

    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((2,)))
    with pytest.raises(ConfigError, match="Halving\\(learning_rate='x'\\)"):
        kv.set_optimizer(Halving(learning_rate="x"))
    assert kv._engine.updater is None
    kv.set_optimizer(Halving(learning_rate=1.0))
    kv.push(3, mx.nd.ones((2,)))
    np.testing.assert_allclose(kv.pull(3).asnumpy(), np.full(2, -1.0))


@mx.optimizer.Optimizer.register
class FidelityScaled(mx.optimizer.Optimizer):
    """A custom optimizer with a required argument of its own (issue #29, item 4)."""

    def __init__(self, factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        weight[:] = weight - self.factor * grad


def test_a_local_store_runs_a_custom_optimizer_with_arguments_of_its_own() -> None:
    """MXNet 1.9.1 runs it; the local store never sends it anywhere, so no copy is made
    from its spec (which cannot carry ``factor``)."""
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2,)))
    kv.set_optimizer(FidelityScaled(0.25))
    kv.push(3, mx.nd.ones((2,)))
    np.testing.assert_allclose(kv.pull(3).asnumpy(), np.full(2, 0.75))
    with pytest.raises(ConfigError, match="learning_rate='x'"):   # its values still checked
        kv.set_optimizer(FidelityScaled(0.25, learning_rate="x"))
    # a dist store's check still refuses what its servers could not rebuild
    from pskv.kvstore.base import check_optimizer
    with pytest.raises(ConfigError, match="fails on a trial update"):
        check_optimizer(FidelityScaled(0.25), need_spec=True)


def test_set_optimizer_refuses_what_is_not_an_optimizer() -> None:
    kv = mx.kv.create("local")
    with pytest.raises(ValueTypeError, match="takes a pskv.optimizer.Optimizer"):
        kv.set_optimizer("sgd")
