"""Observability on whole clusters run as threads: stragglers named while they straggle.

A worker that delays its push past ``straggler_seconds`` is named, with the key and round
it holds up, in a WARNING of the server's log while the others wait for it.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_late_worker_is_named_with_its_key(run_threads: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pskv._ps.stragglers")

    def train(kv: Any) -> float:
        kv.init("b", np.zeros(3, np.float32))
        if kv.rank == 1:
            time.sleep(1.5)            # past the threshold, and past a server tick or two
        kv.push("b", np.ones(3, np.float32))
        out = np.zeros(3, np.float32)
        kv.pull("b", out=out)
        return float(out[0])

    results = run_threads(train, straggler_seconds=0.2)
    assert results == {0: 2.0, 1: 2.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.stragglers"]
    assert lines, "no straggler warning was logged"
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.name == "pskv._ps.stragglers")
    assert any("round 0 of key 'b' has waited" in line and "for worker 1 (of 2)" in line
               and line.startswith("server 0: ") for line in lines), lines


def test_no_straggler_line_when_rounds_close_in_time(run_threads: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pskv._ps.stragglers")

    def train(kv: Any) -> None:
        kv.init("b", np.zeros(3, np.float32))
        for _ in range(3):
            kv.push("b", np.ones(3, np.float32))
            kv.pull("b", out=np.zeros(3, np.float32))

    run_threads(train, straggler_seconds=30.0)
    assert not [r for r in caplog.records if r.name == "pskv._ps.stragglers"]
