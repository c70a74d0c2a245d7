"""The straggler bookkeeping (``_ps/observe/stragglers.py``) with a fake clock, and the engine's
hooks that feed it (``Engine.open_rounds``, ``Engine.closed``)."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from pskv._ps.config import ENV_STRAGGLER_SECONDS, KNOWN_ENV, ClusterConfig, Role
from pskv._ps.observe.stragglers import (MIN_ROUNDS, WINDOW, JobStragglers, OpenRound, StragglerWatch,
                                 parse_beat)
from pskv.errors import ConfigError
from pskv.kvstore.engine._core import Engine, EngineEvents


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(threshold: float = 10.0) -> tuple[StragglerWatch, Clock]:
    clock = Clock()
    return StragglerWatch(threshold, "server 0", clock), clock


def test_a_round_is_named_after_the_threshold_then_once_per_interval() -> None:
    w, clock = watch()
    rnd = OpenRound("b", 12, 100.0, frozenset({0}), 2)
    clock.now = 109.9
    assert w.check([rnd]) == []
    clock.now = 110.0
    assert w.check([rnd]) == ["server 0: round 12 of key 'b' has waited 10.0 s for worker 1 (of 2)"]
    clock.now = 115.0
    assert w.check([rnd]) == []                      # named 5 s ago: quiet
    clock.now = 120.0
    assert w.check([rnd]) == ["server 0: round 12 of key 'b' has waited 20.0 s for worker 1 (of 2)"]


def test_a_round_named_again_after_it_closed_and_reopened() -> None:
    w, clock = watch()
    clock.now = 111.0
    assert len(w.check([OpenRound("b", 3, 100.0, frozenset({1}), 2)])) == 1
    assert w.check([]) == []                         # closed: forgotten
    clock.now = 112.0
    assert w.check([OpenRound("b", 3, 100.0, frozenset({1}), 2)]) == [
        "server 0: round 3 of key 'b' has waited 12.0 s for worker 0 (of 2)"]


def test_keys_waiting_for_the_same_workers_share_one_bounded_line() -> None:
    w, clock = watch()
    clock.now = 130.0
    rounds = [OpenRound(f"k{i}", 1, 100.0 + i, frozenset({0, 2}), 4) for i in range(8)]
    rounds.append(OpenRound("solo", 5, 100.0, frozenset({0, 1, 3}), 4))
    lines = w.check(rounds)
    assert len(lines) == 2
    many = next(line for line in lines if "8 keys" in line)
    assert "waited up to 30.0 s for workers 1, 3 (of 4)" in many
    assert "'k0' (round 1)" in many and "'k5'" not in many and many.endswith("and 3 more")
    assert "server 0: round 5 of key 'solo' has waited 30.0 s for worker 2 (of 4)" in lines


def test_lines_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pskv._ps.observe.stragglers")
    w, clock = watch(1.0)
    clock.now = 102.0
    w.check([OpenRound(7, 0, 100.0, frozenset(), 1)])
    [rec] = caplog.records
    assert rec.levelno == logging.WARNING and "key 7" in rec.getMessage()


def test_a_worker_last_in_most_rounds_is_flagged_once_per_interval() -> None:
    w, clock = watch()
    lines = []
    for i in range(MIN_ROUNDS):
        lines.append(w.round_closed("w", 1 if i % 10 else 0, 0.5, 2))   # worker 1: 90 %
    flagged = [line for line in lines if line]
    assert len(flagged) == 1
    assert flagged[0].startswith("server 0: worker 1 (of 2) pushed last in 18 of the last 20 "
                                 "sync rounds, 0.500 s after their first push on average")
    assert w.round_closed("w", 1, 0.5, 2) is None    # within the interval
    clock.now += 10.0
    assert w.round_closed("w", 1, 0.5, 2) is not None
    assert w.last_counts == {0: 2, 1: 20}


def test_balanced_workers_and_single_workers_are_not_flagged() -> None:
    w, _clock = watch()
    assert not any(w.round_closed("w", i % 2, 0.5, 2) for i in range(WINDOW * 2))
    assert len(w.last) == WINDOW
    w1, _ = watch()
    assert not any(w1.round_closed("w", 0, 0.5, 1) for _ in range(MIN_ROUNDS * 2))
    assert not any(w1.round_closed("w", 1, 0.0, 2) for _ in range(MIN_ROUNDS * 2))
    w2, _ = watch(10.0)           # always last, by less than MIN_WAIT of the threshold
    assert not any(w2.round_closed("w", 1, 0.05, 2) for _ in range(MIN_ROUNDS * 2))
    assert w2.round_closed("w", 1, 3.0, 2) is not None     # one long wait: mean above


def test_engine_reports_open_rounds_and_the_worker_that_closed_each() -> None:
    clock = Clock()
    closed: list[tuple[Any, int, float]] = []

    class Watch(EngineEvents):
        watches_rounds = True

        def round_closed(self, engine: Engine, key: Any, worker: int, waited: float) -> None:
            closed.append((key, worker, waited))
    engine = Engine(2, events=Watch(), clock=clock)
    engine.init(3, np.zeros(2), name="b")
    engine.push(3, 0, [np.ones(2)], "d")
    assert engine.open_rounds() == [("b", 0, 100.0, frozenset({0}))]
    clock.now = 104.5
    engine.push(3, 1, [np.ones(2)], "d")
    assert engine.open_rounds() == [] and closed == [("b", 1, 4.5)]


def test_the_threshold_setting() -> None:
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    assert ENV_STRAGGLER_SECONDS in KNOWN_ENV
    assert ClusterConfig.from_env(env, Role.SERVER).straggler_seconds == 10.0
    cfg = ClusterConfig.from_env({**env, ENV_STRAGGLER_SECONDS: "2.5"}, Role.SERVER)
    assert cfg.straggler_seconds == 2.5
    with pytest.raises(ConfigError, match="PSKV_STRAGGLER_SECONDS='soon'"):
        ClusterConfig.from_env({**env, ENV_STRAGGLER_SECONDS: "soon"}, Role.SERVER)


def test_an_info_summary_of_closed_rounds_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pskv._ps.observe.stragglers")
    clock = Clock()
    w = StragglerWatch(10.0, "server 1", clock, summary_every=60.0)
    for worker, waited in ((1, 0.2), (1, 0.4), (0, 0.0)):
        w.round_closed("k", worker, waited, 2)
    clock.now = 159.0
    assert w.summary() is None                        # not yet
    clock.now = 160.0
    assert w.summary() == ("server 1: 3 sync rounds closed in the last 60 s; a round waited "
                           "0.200 s on average for its last push (longest 0.400 s); worker 1 "
                           "was last in 2 of them")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    clock.now = 220.0
    assert w.summary() is None                        # no round closed: no line


# ---- the scheduler's job-wide view (servers' heartbeats) ---------------------------------
def test_a_servers_heartbeat_carries_who_closed_its_rounds_since_the_last() -> None:
    w, _clock = watch()
    assert w.take_beat() is None
    for i in range(5):
        w.round_closed("w", 1 if i else 0, 0.25, 2)
    w.round_closed("w", 0, 0.0, 2)         # no wait: no straggler evidence
    assert w.take_beat() == [[0, 1, 0.25], [1, 4, 1.0]]
    assert w.take_beat() is None           # taken: the next heartbeat starts afresh


def test_the_scheduler_flags_a_worker_last_across_servers_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    job = JobStragglers(10.0, 2, clock)
    half = MIN_ROUNDS // 2
    # each server alone saw too few rounds to flag anyone; together they are enough
    assert job.add([(1, half - 1, 0.5 * (half - 1))]) == []
    with caplog.at_level(logging.WARNING, logger="pskv._ps.observe.stragglers"):
        lines = job.add([(1, half, 0.5 * half), (0, 1, 0.5)])
    assert len(lines) == 1 and lines[0] == caplog.records[-1].getMessage()
    assert lines[0].startswith(f"scheduler: worker 1 (of 2) pushed last in {2 * half - 1} of "
                               f"the job's last {2 * half} sync rounds on all servers, 0.500 s")
    assert job.add([(1, 1, 0.5)]) == []    # within the interval
    clock.now += 10.0
    assert job.add([(1, 1, 0.5)]) != []


def test_the_scheduler_flags_nobody_when_workers_share_the_last_place() -> None:
    job = JobStragglers(10.0, 2, Clock())
    for _ in range(WINDOW):
        assert job.add([(0, 1, 0.5), (1, 1, 0.5)]) == []
    assert JobStragglers(10.0, 2, Clock()).add([(1, MIN_ROUNDS, 0.01)]) == []  # 1 ms: no
    assert JobStragglers(10.0, 1, Clock()).add([(0, MIN_ROUNDS, 10.0)]) == []  # alone


def test_the_job_window_keeps_about_window_rounds() -> None:
    job = JobStragglers(10.0, 2, Clock())
    for _ in range(3 * WINDOW):
        job.add([(0, 1, 0.5)])
    assert WINDOW - 1 <= job._rounds <= WINDOW
    # the old rounds of worker 0 leave the window: worker 1, last from now on, is flagged
    lines = []
    for _ in range(WINDOW):
        lines += job.add([(1, 1, 0.5)])
    assert any(line.startswith("scheduler: worker 1 ") for line in lines)


@pytest.mark.parametrize("value", [None, "x", {"0": 1}, [[0, 1]], [[0, 1, "s"]],
                                   [[2, 1, 0.5]], [[-1, 1, 0.5]], [[0, 0, 0.5]],
                                   [[0, 1, -0.5]], [[0, 1, float("nan")]], [[True, 1, 0.5]],
                                   [[0, 10**7, 0.5]], [[0, 1.5, 0.5]]])
def test_a_heartbeats_straggler_field_that_is_wrong_is_dropped(value: Any) -> None:
    assert parse_beat(value, 2) == []
