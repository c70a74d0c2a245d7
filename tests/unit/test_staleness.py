"""Bounded staleness without sockets (docs/embeddings.md, "Bounded staleness", S1-S7).

The servers' rule (``_ps/staleness.ClockGate``) with fake workers and a fake clock; the
worker's counting (``kvstore/_staleness.Staleness``) with a fake flush and tick; the checks
of the arguments and of the environment variables; what the local store and a store that
cannot bound staleness do; the server's check of a CLOCK message; and that every S rule of
the spec cites tests that exist.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command, Meta
from pskv._ps.ops import Op, command
from pskv._ps.staleness import ClockGate
from pskv._ps.validate import request
from pskv.errors import (ConfigError, NodeFailedError, ProtocolError, StalenessError,
                         StalenessTimeoutError, UnsupportedError)
from pskv._ps.config import staleness_bounds as env_bounds
from pskv.kvstore._staleness import Staleness, check_bounds

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate(workers: int = 3, bound: int | None = 1) -> tuple[ClockGate, FakeClock]:
    clock = FakeClock()
    g = ClockGate(workers, "server 0", clock)
    g.update(0, 0, bound)
    return g, clock


# ---- S3: the servers' rule ------------------------------------------------------------------
def test_s3_a_read_runs_while_within_the_bound_of_the_slowest_live_worker() -> None:
    g, _ = gate(3, bound=1)
    g.update(0, 1)
    assert g.allows(0)                      # 1 - min(1, 0, 0) <= 1
    g.update(0, 2)
    assert not g.allows(0) and g.behind(0) == [1, 2]
    assert g.allows(1) and g.allows(2)      # the slow ones never wait
    g.update(1, 1)
    assert g.behind(0) == [2]
    g.update(2, 5)
    assert g.allows(0) and not g.allows(2) and g.behind(2) == [0, 1]


def test_s3_parked_reads_run_in_order_once_the_slowest_catches_up() -> None:
    g, _ = gate(2, bound=0)
    g.update(0, 2)
    for i in range(3):
        g.park(0, "a pull of key 'w'", f"read {i}")
    assert g.update(1, 1) == []             # still 1 behind
    assert g.update(1, 2) == ["read 0", "read 1", "read 2"]
    assert g.parked == []


def test_s3_no_bound_parks_nothing_and_setting_none_releases_everything() -> None:
    g, _ = gate(2, bound=None)
    g.update(0, 100)
    assert g.allows(0) and g.behind(0) == []
    g.update(0, bound=0)
    assert not g.allows(0)
    g.park(0, "x", "held")
    assert g.update(1, bound=None) == ["held"]


def test_s3_clocks_are_absolute_so_a_restarted_worker_counts_from_zero_again() -> None:
    g, _ = gate(2, bound=1)
    g.update(0, 3)
    g.update(1, 3)
    assert g.allows(0)
    g.update(1, 0)                          # worker 1 restarted (its clock restarts)
    assert g.behind(0) == [1]


def test_s3_a_worker_never_heard_of_is_at_clock_zero() -> None:
    g = ClockGate(2, clock=FakeClock())
    g.update(0, 2, 1)
    assert g.behind(0) == [1] and g.slowest() == (1, 0)


# ---- S5: what ends a bounded wait -----------------------------------------------------------
def test_s5_a_worker_that_leaves_no_longer_holds_anyone_back() -> None:
    g, _ = gate(3, bound=0)
    g.update(0, 4)
    g.update(1, 4)
    g.park(0, "a lookup of table 'emb'", "r0")
    g.park(1, "a lookup of table 'emb'", "r1")
    assert g.leave(2) == ["r0", "r1"]
    assert g.live() == [0, 1] and g.slowest() == (0, 4)
    assert g.lost(2, "gone") == []           # its connection closing after it left
    g.leave(0)
    g.leave(1)
    assert g.slowest() is None and g.allows(0)
    assert g.update(2, 0) == [] and g.live() == [2]      # said its clock again: live


def test_s5_a_stuck_worker_times_the_read_out_naming_it_and_the_key() -> None:
    g, clock = gate(3, bound=1)
    g.update(0, 3)
    g.update(1, 3)
    g.park(0, "a lookup of table 'emb'", "r")
    clock.now = 5.0
    assert g.expired(10.0) == []
    clock.now = 11.0
    [(item, err)] = g.expired(10.0)
    assert item == "r" and isinstance(err, StalenessTimeoutError)
    text = str(err)
    assert "a lookup of table 'emb' by worker 0 (clock 3)" in text
    assert "for worker 2 (clock 0)" in text and "worker 1" not in text
    assert "server 0" in text and "PSKV_ROUND_TIMEOUT" in text
    assert g.parked == []


def test_s5_a_lost_worker_fails_the_reads_that_wait_for_it_now_and_later() -> None:
    g, _ = gate(3, bound=0)
    g.update(0, 2)
    g.update(1, 2)
    g.update(2, 1)
    g.park(0, "a pull of key 'w'", "waits for 2")
    g.update(2, 2)                           # released
    g.update(0, 3)
    g.park(0, "a pull of key 'w'", "waits for 1 and 2")
    g.update(1, 3)
    failed = g.lost(2, "its connection to server 0 closed without leaving")
    assert [item for item, _ in failed] == ["waits for 1 and 2"]
    err = failed[0][1]
    assert isinstance(err, NodeFailedError)
    assert "worker 2 (clock 2" in str(err) and "closed without leaving" in str(err)
    g.update(1, 4)
    new = g.check_new(1, "a pull of key 'w'")
    assert isinstance(new, NodeFailedError) and "worker 2" in str(new)
    assert g.check_new(2, "x") is None       # a read that waits for nobody lost
    g.update(2, 4)                           # a restarted worker said its clock: live
    assert g.check_new(1, "x") is None
    g.update(0, 4)
    assert g.allows(1)


def test_s5_a_failed_job_fails_every_parked_read() -> None:
    g, _ = gate(2, bound=0)
    g.update(0, 1)
    g.park(0, "a", 1)
    g.park(0, "b", 2)
    err = NodeFailedError("scheduler gone")
    assert g.fail_all(err) == [(1, err), (2, err)] and g.parked == []


# ---- S2: the worker's counting --------------------------------------------------------------
class Fakes:
    def __init__(self) -> None:
        self.flushes = 0
        self.ticks: list[int] = []

    def flush(self) -> None:
        self.flushes += 1

    def tick(self, clock: int) -> None:
        self.ticks.append(clock)


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_s2_a_read_flushes_when_more_than_k_pushes_are_unacknowledged(bound: int) -> None:
    f = Fakes()
    s = Staleness(bound, None, f.flush, f.tick)
    for _ in range(12):
        s.pushed()
        s.before_read()
        assert s.unacked <= bound
    assert f.flushes == 12 // (bound + 1) == s.flushes
    assert f.ticks == [] and s.clock == 12           # no global bound: no clock messages


def test_s2_no_per_worker_bound_never_flushes_and_the_global_one_ticks_each_push() -> None:
    f = Fakes()
    s = Staleness(None, 2, f.flush, f.tick)
    for _ in range(4):
        s.pushed()
        s.before_read()
    assert f.flushes == 0 and f.ticks == [1, 2, 3, 4]


def test_s2_a_push_during_a_flush_stays_unacknowledged() -> None:
    s: Staleness

    def flush() -> None:
        s.pushed()                           # another thread pushes meanwhile

    s = Staleness(0, None, flush, lambda c: None)
    s.pushed()
    s.pushed()
    s.before_read()
    assert s.unacked == 1


# ---- S6: arguments and the environment --------------------------------------------------------
@pytest.mark.parametrize("bound,global_bound,want", [
    (0, None, (0, None)), (None, None, (None, None)), (np.int64(3), 2, (3, 2)),
    (None, 0, (None, 0))])
def test_s6_bounds_that_check(bound: Any, global_bound: Any, want: Any) -> None:
    assert check_bounds(bound, global_bound, "dist_async") == want


@pytest.mark.parametrize("bound,global_bound,says", [
    (-1, None, "at least 0"), (1.0, None, "whole number"), (True, None, "whole number"),
    ("2", None, "whole number"), (0, -3, "global_bound must be at least 0"),
    (0, 0.5, "global_bound must be a whole number")])
def test_s6_bad_bounds_raise_staleness_error(bound: Any, global_bound: Any, says: str) -> None:
    with pytest.raises(StalenessError, match=says) as info:
        check_bounds(bound, global_bound, "dist_async")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    assert "'dist_async'" in str(info.value)


def test_s6_environment_defaults() -> None:
    assert env_bounds({}, "local") == (None, None)
    assert env_bounds({"PSKV_STALENESS": "0", "PSKV_GLOBAL_STALENESS": " 4 "}, "x") == (0, 4)
    assert env_bounds({"PSKV_STALENESS": ""}, "x") == (None, None)
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(StalenessError, match="PSKV_GLOBAL_STALENESS"):
            env_bounds({"PSKV_GLOBAL_STALENESS": bad}, "x")


def test_s6_the_local_store_records_any_bound_and_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kv = mx.kv.create("local")
    assert kv._bounds == (None, None)
    kv.set_staleness(0, global_bound=2)
    assert kv._bounds == (0, 2)
    with pytest.raises(StalenessError):
        kv.set_staleness(-2)
    assert kv._bounds == (0, 2)                    # a failing call changes nothing
    monkeypatch.setenv("PSKV_STALENESS", "3")
    assert mx.kv.create("local")._bounds == (3, None)
    monkeypatch.setenv("PSKV_STALENESS", "-3")
    with pytest.raises(StalenessError, match="PSKV_STALENESS"):
        mx.kv.create("local")
    kv.close()
    with pytest.raises(mx.StoreClosedError):
        kv.set_staleness(1)


def test_s6_a_store_that_cannot_bound_staleness_says_so() -> None:
    kv = mx.kv.create("teststore")
    with pytest.raises(UnsupportedError, match="cannot bound staleness"):
        kv.set_staleness(0)


def test_s6_the_server_checks_every_clock_message() -> None:
    def meta(**fields: Any) -> Meta:
        return Meta(Command.COMMAND, ts=-1, body=command(Op.CLOCK, **fields))

    for good in ({"clock": 0, "bound": 2}, {"clock": 7}, {"bound": None}, {"leave": True}):
        request(meta(**good), [])
    for bad in ({"clock": -1}, {"clock": 1.5}, {"bound": "2"}, {"bound": -1},
                {"leave": "yes"}):
        with pytest.raises(ProtocolError):
            request(meta(**bad), [])
    with pytest.raises(ProtocolError, match="no arrays"):
        request(meta(clock=1), [np.zeros(1)])


# ---- the spec cites these tests ---------------------------------------------------------------
def test_every_staleness_rule_of_the_spec_cites_tests_that_exist() -> None:
    spec = (REPO / "docs" / "embeddings.md").read_text()
    rules = re.findall(r"\*\*S(\d+)\.(.*?)(?=\n\*\*S\d+\.|\n## )", spec, flags=re.S)
    assert [int(n) for n, _ in rules] == list(range(1, len(rules) + 1)) and len(rules) >= 6
    for number, text in rules:
        cited = re.findall(r"\[`([^\]]+)`\]", " ".join(text.split()))
        assert cited, f"S{number} cites no test"
        for ref in re.findall(r"[\w/:.*]+", " ".join(cited)):
            path, _, name = ref.partition("::")
            if not path.endswith(".py"):
                path, name = "tests/unit/test_staleness.py", path
            file = REPO / path if "/" in path else REPO / "tests" / "unit" / path
            assert file.exists(), f"S{number} cites {path}: no such file"
            if name:
                defined = set(re.findall(r"^def (test_\w+)", file.read_text(), flags=re.M))
                prefix = name.rstrip("*")
                assert any(n == name or (name.endswith("*") and n.startswith(prefix))
                           for n in defined), f"S{number} cites {ref}: no such test"
