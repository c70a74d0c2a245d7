"""pskv-launch end to end: how a job ends, ranks in prefixes, launcher death, Ctrl-C, logs.

Real processes throughout (the default ``python -m pskv.server`` unless a test says not);
every process a test starts is bounded by a timeout and killed by pid/process group.
"""
from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pskv.launch import launch

from test_launch_local import Cli, alive, assert_all_gone, py

pytestmark = pytest.mark.dist

PY = sys.executable


# -- 2: the job ends when the workers end ---------------------------------------------------
@pytest.mark.timeout(90)
def test_workers_that_never_open_a_store_end_the_job(caplog: pytest.LogCaptureFixture) -> None:
    # pskv-launch -n 2 -s 1 hostname: nothing ever joins the scheduler
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="pskv.launch"):
        result = launch([PY, "-c", "print('host')"], 2, 1, stdout=out, stderr=err,
                        timeout=60)
    elapsed = time.monotonic() - start
    assert_all_gone([p.pid for p in result.processes])
    assert (result.returncode, result.reason) == (0, "ok")
    assert sorted(out.getvalue().splitlines()) == ["[worker 0] host", "[worker 1] host"]
    assert err.getvalue() == ""
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    # bounded well below the scheduler's 60 s connect timeout and the old 30 s wait
    assert elapsed < 20, elapsed


@pytest.mark.timeout(90)
def test_cli_ends_with_the_workers_status() -> None:
    cli = Cli("-n", "2", "-s", "1", PY, "-c", "pass")
    assert cli.wait(within=30) == 0
    assert "WARNING" not in cli.stderr and "ERROR" not in cli.stderr, cli.stderr


@pytest.mark.timeout(60)
def test_server_failing_after_the_workers_does_not_fail_the_job() -> None:
    # the workers' status is the job's once every worker has exited 0
    server = py("import time; time.sleep(1.0); sys.exit(4)")
    out, err = io.StringIO(), io.StringIO()
    result = launch(py(), 1, 1, server_command=server, shutdown_timeout=20, stdout=out,
                    stderr=err, timeout=30)
    assert_all_gone([p.pid for p in result.processes])
    assert result.returncode == 0
