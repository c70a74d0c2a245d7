"""Restart back-off (issue #34 item 6): a node in a crash loop is restarted after
exponentially growing, capped delays, by every launcher that restarts (the local
supervisor and the ray launcher share ``launch/_backoff.py``; Kubernetes has the
kubelet's own CrashLoopBackOff)."""
from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from pskv._ps.config import Role
from pskv.launch import _backoff, _supervise
from pskv.launch._spec import ProcessSpec


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_delays_double_up_to_the_cap_and_start_over_after_a_long_run() -> None:
    clock = FakeClock()
    backoff = _backoff.Backoff(clock)
    backoff.started("worker 0")
    delays = []
    for _ in range(9):
        delays.append(backoff.schedule("worker 0"))
        assert backoff.waiting("worker 0") and not backoff.due("worker 0")
        clock.now += delays[-1]
        assert backoff.due("worker 0")
        backoff.started("worker 0")
        assert not backoff.waiting("worker 0")
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    clock.now += _backoff.RESTART_RESET_S          # it ran long: not a crash loop any more
    assert backoff.schedule("worker 0") == 0.5
    assert backoff.schedule("server 0") == 0.5     # each node its own


def test_the_supervisor_waits_out_each_delay_before_a_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that fails at once, --max-restarts 4: each start comes no earlier than the
    back-off after the death before it (0.25, 0.5, 1, 1 s here), read on the supervisor's
    own clock; before the back-off it was restarted within a poll (0.05 s)."""
    monkeypatch.setattr(_backoff, "RESTART_DELAY_S", 0.25)
    monkeypatch.setattr(_backoff, "RESTART_DELAY_MAX_S", 1.0)
    starts: list[float] = []
    spawn = _supervise._Supervisor._spawn

    def recording(self: Any, ps: ProcessSpec) -> Any:
        starts.append(_supervise.time.monotonic())
        return spawn(self, ps)

    monkeypatch.setattr(_supervise._Supervisor, "_spawn", recording)
    crash = ProcessSpec(Role.WORKER, 0, (sys.executable, "-c", "raise SystemExit(3)"))
    result = _supervise.run_processes([crash], max_restarts=4, timeout=60,
                                      stdout=io.StringIO(), stderr=io.StringIO())
    assert result.returncode == 3 and result.reason == "failed"
    assert len(starts) == 5                          # the first start and 4 restarts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # a gap also holds the run before the death, so it is at least the delay
    assert all(gap >= delay for gap, delay in zip(gaps, [0.25, 0.5, 1.0, 1.0])), gaps


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)        # the fake ray's refs are the values themselves


class _Actor:
    """A fake ProcessActor whose process (worker 0) dies at once; each poll is 0.25 s of
    the launcher's clock."""

    def __init__(self, clock: FakeClock, crashes: bool, starts: list[float]) -> None:
        self.clock, self.crashes, self.starts = clock, crashes, starts
        self.rc: int | None = None
        self.start = _Call(self._start)
        self.poll = _Call(self._poll)
        self.stop = _Call(self._stop)

    def _start(self, argv: Any, env: Any) -> int:
        self.starts.append(self.clock.now)
        self.rc = 1 if self.crashes else None
        return 4242

    def _poll(self) -> tuple[int | None, list[Any]]:
        self.clock.now += 0.25
        return self.rc, []

    def _stop(self, sig: int, grace: float) -> int:
        self.rc = -sig if self.rc is None else self.rc
        return self.rc


class _FakeRay:
    class exceptions:
        class RayActorError(Exception):
            pass

        class RayTaskError(Exception):
            pass

    def remote(self, **options: Any) -> Any:
        return lambda cls: cls

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        return refs


def test_the_ray_launcher_waits_out_each_delay_before_a_restart() -> None:
    from pskv.launch import LaunchSpec
    from pskv.launch._ray import RayJob, _Proc
    clock = FakeClock()
    spec = LaunchSpec(("x",), 1, launcher="ray", max_restarts=3)
    job = RayJob(_FakeRay(), spec, "secret", io.StringIO(), io.StringIO())
    job.backoff = _backoff.Backoff(clock)
    starts: list[float] = []
    for role, crashes in ((Role.SCHEDULER, False), (Role.SERVER, False), (Role.WORKER, True)):
        p = _Proc(role, 0, _Actor(clock, crashes, starts if crashes else []))
        job.procs.append(p)
        p.actor.start.remote((), {})
        job.backoff.started(p.label)
    result = job.watch()
    assert result.reason == "failed" and result.failed is not None
    assert result.failed.label == "worker 0" and job.restarts == {"worker 0": 3}
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 3 and all(gap >= delay for gap, delay in zip(gaps, [0.5, 1.0, 2.0])), \
        gaps
