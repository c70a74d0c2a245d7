"""A backup's round log (``kvstore/durable/_backup_log.py``), rule by rule: a primary engine runs
rounds, what its replicator would send goes into a backup's log, and the backup's copy,
once flushed, must be bit for bit the primary's (values, optimizer states, update counts)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ProtocolError
from pskv.kvstore.durable._backup_log import LOG_ROUNDS, MAX_LOGGED, BufferPool, RoundLog
from pskv.kvstore.engine._core import Engine
from pskv.kvstore.durable._replica import Replicator

SHAPES = {0: (6,), 1: (3, 4), 2: (5,)}


def _engine(opt: Any) -> Engine:
    engine = Engine(num_workers=1)
    engine.set_optimizer_spec(opt.to_spec())
    for k, shape in SHAPES.items():
        start = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7
        engine.init(k, start, name=f"w{k}")
    return engine


class _Tap:
    """The primary's observer: what its replicator would send, copied as it goes."""

    wants_merged = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sent: list[tuple[dict[str, Any], list[np.ndarray]]] = []

    def round_applied(self, key: Any, merged: Any, rnd: int, applied: dict[int, int]) -> None:
        counters = {"key": key, "round": rnd, "applied": [[w, n] for w, n in applied.items()]}
        replicator: Any = SimpleNamespace(engine=self.engine)
        body, arrays = Replicator._dense(replicator, key, merged, rnd, counters)
        self.sent.append((body, [np.array(a) for a in arrays]))

    def rows_born(self, *args: Any) -> None:
        raise AssertionError("no table keys here")


def _run(opt_factory: Any, steps: int, keys: Any = None) -> tuple[Engine, _Tap, Engine]:
    primary, backup = _engine(opt_factory()), _engine(opt_factory())
    tap = _Tap(primary)
    primary.observer = tap
    rng = np.random.default_rng(0)
    for _ in range(steps):
        for k in keys or SHAPES:
            primary.push(k, 0, [rng.standard_normal(SHAPES[k]).astype(np.float32)], "d")
    return primary, tap, backup


def _same(primary: Engine, backup: Engine) -> None:
    for k in SHAPES:
        np.testing.assert_array_equal(backup.value_of(k, "t")._data,
                                      primary.value_of(k, "t")._data)
    pu: Any = primary.updater
    bu: Any = backup.updater
    assert set(bu.states) == set(pu.states)
    for name, st in pu.states.items():
        flat_p = [s for s in (st if isinstance(st, tuple) else (st,)) if s is not None]
        flat_b = [s for s in (bu.states[name] if isinstance(bu.states[name], tuple)
                              else (bu.states[name],)) if s is not None]
        for a, b in zip(flat_p, flat_b, strict=True):
            np.testing.assert_array_equal(b._data, a._data)
    assert bu.optimizer._index_update_count == pu.optimizer._index_update_count
    assert bu.optimizer.num_update == pu.optimizer.num_update
    assert backup.applied_by(0) == primary.applied_by(0)


def _sgd_scheduled() -> Any:
    return mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01,
                            lr_scheduler=mx.lr_scheduler.FactorScheduler(step=5, factor=0.5,
                                                                         base_lr=0.1))


@pytest.mark.parametrize("opt", [_sgd_scheduled,
                                 lambda: mx.optimizer.Adam(learning_rate=0.01),
                                 lambda: mx.optimizer.SGD(learning_rate=0.1)])
@pytest.mark.parametrize("steps", [1, LOG_ROUNDS - 1, 3 * LOG_ROUNDS + 2])
def test_a_flushed_log_is_bit_for_bit_the_primary(opt: Any, steps: int) -> None:
    primary, tap, backup = _run(opt, steps)
    log = RoundLog(backup, BufferPool())
    for body, arrays in tap.sent:
        log.round(body, arrays)
    kinds = {body["kind"] for body, _ in tap.sent}
    assert kinds <= {"l", "f"} and ("l" in kinds)
    log.flush()
    _same(primary, backup)


def test_a_logged_round_is_kept_not_applied_and_its_arrays_not_reused() -> None:
    primary, tap, backup = _run(_sgd_scheduled, 1, keys=[0])
    before = backup.value_of(0, "t")._data.copy()
    log = RoundLog(backup, BufferPool())
    body, arrays = tap.sent[0]
    assert body["kind"] == "l"
    log.round(body, arrays)
    np.testing.assert_array_equal(backup.value_of(0, "t")._data, before)     # L1: not applied
    arrays[0][...] = 1e9                     # the connection's buffer, reused for the next
    log.flush()
    np.testing.assert_array_equal(backup.value_of(0, "t")._data, primary.value_of(0, "t")._data)


def test_a_whole_state_drops_the_rounds_of_its_key_logged_before_it() -> None:
    primary, tap, backup = _run(_sgd_scheduled, 2 * LOG_ROUNDS, keys=[1])
    log = RoundLog(backup, BufferPool())
    sizes = []
    for body, arrays in tap.sent:
        log.round(body, arrays)
        sizes.append((body["kind"], len(log)))
    assert ("f", 0) in sizes                 # L2: nothing of the key left to apply
    assert max(n for _k, n in sizes) <= LOG_ROUNDS - 1


def test_the_log_holds_at_most_max_logged_rounds_of_a_key() -> None:
    primary, tap, backup = _run(_sgd_scheduled, 3 * MAX_LOGGED, keys=[2])
    log = RoundLog(backup, BufferPool())
    most = 0
    for body, arrays in tap.sent:
        if body["kind"] == "f":              # a primary that never sends whole states
            continue
        log.round(body, arrays)
        most = max(most, len(log))
    assert most < MAX_LOGGED                 # L4: flushed on reaching it
    log.flush()


def test_rounds_applied_at_once_interleave_exactly_with_logged_ones() -> None:
    primary, tap, backup = _run(_sgd_scheduled, 2 * LOG_ROUNDS + 1)
    log = RoundLog(backup, BufferPool())
    for i, (body, arrays) in enumerate(tap.sent):
        if body["key"] == 2 and body["kind"] == "l":
            body = {**body, "kind": "d"}     # as for a key whose state the log cannot carry
        log.round(body, arrays)
    log.flush()
    _same(primary, backup)


@pytest.mark.parametrize("bad", [{"count": "7"}, {"nu": None}, {"count": 1.5, "nu": 2}])
def test_bad_counts_are_refused_and_change_nothing(bad: dict[str, Any]) -> None:
    primary, tap, backup = _run(_sgd_scheduled, 1, keys=[0])
    log = RoundLog(backup, BufferPool())
    body, arrays = tap.sent[0]
    with pytest.raises(ProtocolError):
        log.round({**body, **bad}, arrays)
    assert len(log) == 0


def test_a_logged_round_of_the_wrong_size_is_refused() -> None:
    primary, tap, backup = _run(_sgd_scheduled, 1, keys=[0])
    log = RoundLog(backup, BufferPool())
    body, arrays = tap.sent[0]
    with pytest.raises(ProtocolError, match="size"):
        log.round(body, [np.zeros(3, np.float32)])
    assert len(log) == 0


def test_keys_updated_at_different_rates_keep_the_primarys_learning_rates() -> None:
    """Key 0 is pushed three times a step, key 1 once: the scheduler's step count comes
    from key 0, whose rounds whole states replace; key 1's logged rounds must still run
    with the primary's learning rate (L3)."""
    primary, tap, backup = _run(_sgd_scheduled, 4 * LOG_ROUNDS, keys=[0, 0, 0, 1])
    log = RoundLog(backup, BufferPool())
    for body, arrays in tap.sent:
        log.round(body, arrays)
    log.flush()
    for k in (0, 1):
        np.testing.assert_array_equal(backup.value_of(k, "t")._data,
                                      primary.value_of(k, "t")._data)
    bu: Any = backup.updater
    pu: Any = primary.updater
    assert bu.optimizer.num_update == pu.optimizer.num_update
