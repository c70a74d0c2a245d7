"""Learning rate schedulers: MXNet 1.9.1's formulas, warmup, errors and specs."""
from __future__ import annotations

import math

import pytest

import pskv
from pskv import lr_scheduler as lrs


def test_factor_scheduler_steps_and_floor() -> None:
    s = lrs.FactorScheduler(step=3, factor=0.5, stop_factor_lr=0.1, base_lr=1.0)
    assert [s(n) for n in range(1, 12)] == [1.0] * 3 + [0.5] * 3 + [0.25] * 3 + [0.125, 0.125]
    assert s(100) == 0.1


def test_factor_scheduler_warmup() -> None:
    s = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0, warmup_steps=4,
                            warmup_begin_lr=0.2)
    assert [s(n) for n in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    c = lrs.FactorScheduler(step=2, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2,
                            warmup_mode="constant")
    assert c(3) == 0.2 and c(4) == 1.0


def test_multifactor_scheduler() -> None:
    s = lrs.MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=1.0)
    assert [s(n) for n in (1, 2, 3, 4, 5, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_poly_and_cosine_schedulers() -> None:
    p = lrs.PolyScheduler(max_update=10, base_lr=1.0, pwr=2, final_lr=0.0)
    assert p(5) == pytest.approx(0.25) and p(10) == 0.0 and p(20) == 0.0
    c = lrs.CosineScheduler(max_update=10, base_lr=1.0, final_lr=0.0, warmup_steps=2)
    assert c(2) == pytest.approx(1.0)
    assert c(6) == pytest.approx((1 + math.cos(math.pi * 4 / 8)) / 2)
    assert c(10) == pytest.approx(0.0, abs=1e-12) and c(50) == c(10)  # last value kept


@pytest.mark.parametrize("make", [
    lambda: lrs.FactorScheduler(step=0),
    lambda: lrs.FactorScheduler(step=2, factor=1.5),
    lambda: lrs.MultiFactorScheduler(step=[3, 2]),
    lambda: lrs.MultiFactorScheduler(step=[]),
    lambda: lrs.PolyScheduler(max_update=0),
    lambda: lrs.CosineScheduler(max_update=5, warmup_mode="cubic"),
    lambda: lrs.CosineScheduler(max_update=5, base_lr=0.1, warmup_begin_lr=0.5),
    lambda: lrs.FactorScheduler(step=2, warmup_steps=-1),
])
def test_bad_arguments_raise_value_errors(make: object) -> None:
    with pytest.raises(pskv.ConfigError) as err:
        make()  # type: ignore[operator]
    assert isinstance(err.value, ValueError)


def test_optimizer_learning_rate_follows_scheduler() -> None:
    opt = pskv.optimizer.create("sgd", lr_scheduler=lrs.FactorScheduler(step=1, factor=0.5,
                                                                        base_lr=1.0))
    upd = pskv.optimizer.get_updater(opt)
    w = pskv.nd.zeros((2,))
    for _ in range(3):
        upd(0, pskv.nd.ones((2,)), w)
    # lrs used at num_update 1, 2, 3: 1.0, 0.5, 0.25
    assert w.asnumpy().tolist() == pytest.approx([-1.75, -1.75])


def test_scheduler_spec_keeps_progress() -> None:
    s = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    s(7)
    clone = lrs.scheduler_from_spec(lrs.scheduler_to_spec(s))
    assert (clone.base_lr, clone.count) == (s.base_lr, s.count)
    assert clone(9) == s(9)
    with pytest.raises(pskv.ConfigError):
        lrs.scheduler_from_spec({"name": "FactorScheduler", "kwargs": {"step": 1},
                                 "state": {"_secret": 1}})
