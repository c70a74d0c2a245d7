"""Optimizer registry, lr/wd multipliers, update counts, specs and the states file format."""
from __future__ import annotations

import io
import json
import logging
import pickle
import zipfile
from typing import Any

import numpy as np
import pytest

import pskv
from pskv.optimizer import OptimizerStateError, from_spec


def _train(upd: Any, keys: list[Any], steps: int, seed: int = 0) -> dict[Any, Any]:
    rs = np.random.RandomState(seed)
    weights = {k: pskv.nd.array(rs.randn(4, 3)) for k in keys}
    for _ in range(steps):
        for k in keys:
            upd(k, pskv.nd.array(rs.randn(4, 3)), weights[k])
    return weights


def test_create_is_case_insensitive_and_lists_names_on_error() -> None:
    assert type(pskv.optimizer.create("SGD")).__name__ == "SGD"
    assert type(pskv.optimizer.Optimizer.create_optimizer("RmsProp")).__name__ == "RMSProp"
    with pytest.raises(pskv.ConfigError, match="adam.*sgd") as err:
        pskv.optimizer.create("nope")
    assert isinstance(err.value, ValueError)


def test_registered_names() -> None:
    names = set(pskv.optimizer.Optimizer.opt_registry)
    assert {"sgd", "nag", "adam", "adagrad", "rmsprop", "adadelta", "signum", "signsgd",
            "ftrl", "test"} <= names


def test_unknown_argument_is_config_and_type_error() -> None:
    with pytest.raises(pskv.ConfigError, match="momentum") as err:
        pskv.optimizer.create("sgd", momentun=0.9)
    assert isinstance(err.value, TypeError)


def test_set_learning_rate_with_scheduler_raises_user_warning() -> None:
    opt = pskv.optimizer.create("sgd", lr_scheduler=pskv.lr_scheduler.FactorScheduler(2))
    with pytest.raises(UserWarning):
        opt.set_learning_rate(0.5)
    plain = pskv.optimizer.create("sgd")
    plain.set_learning_rate(0.5)
    assert plain.learning_rate == 0.5


def test_learning_rate_overrides_scheduler_base_lr(caplog: pytest.LogCaptureFixture) -> None:
    sched = pskv.lr_scheduler.FactorScheduler(step=2, base_lr=0.3)
    with caplog.at_level(logging.WARNING):
        opt = pskv.optimizer.create("sgd", learning_rate=0.1, lr_scheduler=sched)
    assert sched.base_lr == 0.1 and opt.learning_rate == 0.1
    assert "overwritten" in caplog.text


def test_lr_and_wd_mult_lookup_order() -> None:
    opt = pskv.optimizer.create("sgd", learning_rate=1.0, wd=1.0,
                                param_idx2name={0: "fc_weight", 1: "fc_bias", 2: "bn_gamma"})
    assert opt._get_wd(0) == 1.0 and opt._get_wd(1) == 0.0 and opt._get_wd(2) == 1.0
    opt.set_lr_mult({"fc_weight": 0.5, 2: 3.0})
    opt.set_wd_mult({1: 2.0})
    assert opt._get_lr(0) == 0.5 and opt._get_lr(2) == 3.0 and opt._get_lr(1) == 1.0
    assert opt._get_wd(1) == 2.0


def test_update_counts_per_key_and_device() -> None:
    opt = pskv.optimizer.create("adam", begin_num_update=2)
    upd = pskv.optimizer.get_updater(opt)
    _train(upd, [0, 1], 3)
    assert opt._index_update_count == {0: 5, 1: 5} and opt.num_update == 5
    w = pskv.nd.ones((4, 3), pskv.gpu(1))
    upd(0, pskv.nd.ones((4, 3), pskv.gpu(1)), w)
    assert opt._all_index_update_counts[1] == {0: 3}
    assert opt.num_update == 5


def test_test_optimizer_does_not_count() -> None:
    opt = pskv.optimizer.create("test")
    _train(pskv.optimizer.get_updater(opt), [0], 3)
    assert opt.num_update == 0


@pytest.mark.parametrize("name,kwargs", [
    ("sgd", {"momentum": 0.9, "lazy_update": False}),
    ("adam", {"beta1": 0.8, "lr_scheduler": pskv.lr_scheduler.MultiFactorScheduler([2, 4])}),
    ("adagrad", {"eps": 1e-6}),
    ("rmsprop", {"centered": True, "clip_weights": 2.0}),
    ("ftrl", {"lamda1": 0.1, "learning_rate": 0.2}),
    ("signum", {"wd_lh": 0.1}),
    ("nag", {"momentum": 0.5, "param_idx2name": {0: "a_weight", 1: "a_bias"}}),
    ("adadelta", {"rho": 0.8}),
    ("test", {"rescale_grad": 2.0}),
])
def test_spec_round_trip_gives_the_same_updates(name: str, kwargs: dict[str, Any]) -> None:
    opt = pskv.optimizer.create(name, wd=0.01, clip_gradient=1.0, **kwargs)
    opt.set_lr_mult({1: 0.5})
    u1 = pskv.optimizer.get_updater(opt)
    _train(u1, [0, 1], 2)
    spec = json.loads(json.dumps(opt.to_spec()))  # pure JSON
    clone = from_spec(spec)
    assert clone.to_spec() == spec
    u2 = pskv.optimizer.get_updater(clone)
    u2.set_states(u1.get_states())
    w1, w2 = _train(u1, [0, 1], 3, seed=5), _train(u2, [0, 1], 3, seed=5)
    for k in w1:
        np.testing.assert_array_equal(w1[k].asnumpy(), w2[k].asnumpy())


@pytest.mark.parametrize("spec", [None, {"kwargs": {}}, {"name": "nope"},
                                  {"name": "sgd", "kwargs": {"bogus": 1}},
                                  {"name": "sgd", "kwargs": {"lr_scheduler": {"name": "X"}}},
                                  {"name": "sgd", "kwargs": {}, "state": {"lr_mult": 3}}])
def test_bad_specs_raise_config_error(spec: Any) -> None:
    with pytest.raises(pskv.ConfigError):
        from_spec(spec)


def test_states_round_trip_and_no_pickle() -> None:
    opt = pskv.optimizer.create("sgd", momentum=0.9, multi_precision=True)
    upd = pskv.optimizer.get_updater(opt)
    w16 = pskv.nd.ones((3, 2), dtype="float16")
    upd("w16", pskv.nd.ones((3, 2), dtype="float16"), w16)
    _train(upd, [0, 7], 2)
    blob = upd.get_states(dump_optimizer=True)
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        assert "__meta__" in data.files
        meta = json.loads(data["__meta__"].tobytes())
    assert [e["key"] for e in meta["states"]] == ["w16", 0, 7]
    assert meta["optimizer"]["name"] == "sgd"
    new = pskv.optimizer.get_updater(pskv.optimizer.create("adam"))
    new.set_states(blob)
    assert type(new.optimizer).__name__ == "SGD" and new.optimizer.num_update == 2
    assert set(new.states) == {"w16", 0, 7}
    mom, master = new.states["w16"]
    assert master.dtype == np.float32 and mom.dtype == np.float32
    np.testing.assert_array_equal(new.states[0].asnumpy(), upd.states[0].asnumpy())


def test_states_without_optimizer_keep_the_current_one() -> None:
    upd = pskv.optimizer.get_updater(pskv.optimizer.create("adam"))
    _train(upd, [0], 1)
    other = pskv.optimizer.create("adam", learning_rate=0.5)
    new = pskv.optimizer.get_updater(other)
    new.set_states(upd.get_states())
    assert new.optimizer is other and isinstance(new.states[0], tuple)


def _npz(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("blob", [
    b"", b"garbage", pickle.dumps({0: None}),
    _npz(x=np.zeros(2)),
    _npz(__meta__=np.frombuffer(b"not json", np.uint8)),
    _npz(__meta__=np.frombuffer(json.dumps({"format": "other"}).encode(), np.uint8)),
    _npz(__meta__=np.frombuffer(json.dumps({"format": "pskv.optimizer.states", "version": 1,
                                            "states": [{"key": 0, "state": {"array": "a9"}}],
                                            "optimizer": None}).encode(), np.uint8)),
    _npz(__meta__=np.frombuffer(json.dumps({"format": "pskv.optimizer.states", "version": 1,
                                            "states": [], "optimizer": {"name": "zz"}})
                                .encode(), np.uint8)),
], ids=["empty", "garbage", "pickle", "no-meta", "bad-json", "foreign", "missing-array",
        "bad-optimizer"])
def test_corrupt_states_raise_a_clear_error(blob: bytes) -> None:
    upd = pskv.optimizer.get_updater(pskv.optimizer.create("sgd"))
    with pytest.raises(OptimizerStateError, match="pskv optimizer-states|rebuilt"):
        upd.set_states(blob)
    assert isinstance(OptimizerStateError("x"), pskv.KVStoreError)


def test_truncated_states_raise() -> None:
    upd = pskv.optimizer.get_updater(pskv.optimizer.create("adam"))
    _train(upd, [0], 1)
    blob = upd.get_states()
    with pytest.raises(OptimizerStateError):
        upd.set_states(blob[: len(blob) // 2])
    assert zipfile.is_zipfile(io.BytesIO(blob))


def test_get_updater_rejects_non_optimizers() -> None:
    with pytest.raises(pskv.ConfigError):
        pskv.optimizer.get_updater("sgd")  # type: ignore[arg-type]


def test_a_checkpoint_without_an_optimizer_leaves_no_state_or_count_behind(
        tmp_path: Any) -> None:
    """A store that trained with an optimizer, then loads a checkpoint taken without one,
    keeps its optimizer but none of its states or update counts (they were made on the
    values the load replaced): its next steps are those of a store that set the optimizer
    and loaded the checkpoint without training first (dense and table keys alike)."""
    from pskv.table import Normal, TableSpec
    ids = np.array([3, -8, 2**40], np.int64)

    def init(kv: Any) -> None:
        kv.init("w", pskv.nd.zeros((2, 3)))
        kv.init("emb", TableSpec(dim=3, init=Normal(0.0, 0.1), seed=1))

    saved = pskv.kv.create("local")            # no optimizer: a push assigns
    init(saved)
    saved.push("w", pskv.nd.ones((2, 3)) * 2)
    saved.push("emb", (ids, np.full((3, 3), 0.5, np.float32)))
    saved.save_checkpoint(str(tmp_path))

    def resumed(train_first: bool) -> tuple[Any, ...]:
        kv = pskv.kv.create("local")
        init(kv)
        kv.set_optimizer(pskv.optimizer.Adam(learning_rate=0.1))
        if train_first:       # Adam's moments and counts for both keys
            for _ in range(3):
                kv.push("w", pskv.nd.ones((2, 3)) * 5)
                kv.lookup("emb", ids)
                kv.push("emb", (ids, np.full((3, 3), 5.0, np.float32)))
            assert sorted(kv._engine.updater.optimizer._index_update_count) == ["emb", "w"]
        kv.load_checkpoint(str(tmp_path))
        upd = kv._engine.updater
        left = (sorted(upd.states), upd.optimizer.num_update,
                [sorted(c) for c in upd.optimizer._all_index_update_counts.values()])
        kv.push("w", pskv.nd.ones((2, 3)))
        kv.push("emb", (ids, np.ones((3, 3), np.float32)))
        return left, kv.pull("w").asnumpy(), kv.lookup("emb", ids, train=False)[0]

    fresh, trained = resumed(False), resumed(True)
    assert trained[0] == fresh[0] == ([], 0, [[]])
    for got, want in zip(trained[1:], fresh[1:]):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(fresh[1], np.full((2, 3), 3.0, np.float32))   # Adam ran
