"""pskv-launch end to end: how a job ends, ranks in prefixes, launcher death, Ctrl-C, logs.

Real processes throughout (the default ``python -m pskv.server`` unless a test says not);
every process a test starts is bounded by a timeout and killed by pid/process group.
"""
from __future__ import annotations

import io
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pskv._ps.stream import ABSTRACT

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


LOCAL_ON_ONE = ("import os\nimport pskv as mx\n"
                "kind = 'local' if os.environ['DMLC_WORKER_ID'] == '1' else 'dist_sync'\n"
                "kv = mx.kv.create(kind)\nkv.close()\n")


@pytest.mark.timeout(90)
def test_a_worker_that_exits_without_joining_is_named() -> None:
    """Worker 1 makes a 'local' store and exits 0; worker 0 waits at the scheduler for it.
    The launcher names worker 1 and ends the job (status 1), well before worker 0's 60 s
    connect timeout would blame the address."""
    cli = Cli("-n", "2", "-s", "1", PY, "-c", LOCAL_ON_ONE)
    assert cli.wait(within=45) == 1, cli.stderr
    [line] = [line for line in cli.stderr.splitlines() if "without joining" in line]
    assert "worker 1 (pid" in line and "exited with status 0 without joining the cluster" \
        in line, line
    assert "'local' store" in line and "kv.create('dist_sync')" in line, line
    assert "DMLC_PS_ROOT_URI" not in cli.stderr, cli.stderr


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


# -- 3: the job dies with the launcher ------------------------------------------------------
def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


STORE_THEN_HANG = ("import time, pskv as mx\n"
                   "kv = mx.kv.create('dist_sync')\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(120)\n")


@pytest.mark.timeout(120)
def test_sigkill_of_the_launcher_takes_the_job_with_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the servers put their socket files
    cli = Cli("-n", "2", "-s", "2", PY, "-c", STORE_THEN_HANG)
    pids: list[int] = []
    try:
        for _ in range(2):
            assert cli.lines.get(timeout=60).split("] ")[1] == "ready\n"
        pids = children_of(cli.proc.pid)
        assert len(pids) == 5  # scheduler, 2 servers, 2 workers
        # the servers' Unix sockets: files, or (Linux) abstract names that leave none
        assert bool(list(tmp_path.glob("pskv-*.sock"))) is not ABSTRACT
        cli.proc.send_signal(signal.SIGKILL)
        assert cli.wait() == -signal.SIGKILL
        assert_all_gone(pids, within=20)
    finally:
        for pid in pids:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)  # each child leads its own process group
    assert list(tmp_path.glob("pskv-*.sock")) == []


# -- 4: Ctrl-C ends quietly; 5: --log-dir ----------------------------------------------------
@pytest.mark.timeout(120)
def test_ctrl_c_prints_one_line_per_process_at_most(tmp_path: Path) -> None:
    cli = Cli("-n", "2", "-s", "2", "--log-dir", str(tmp_path), PY, "-c", STORE_THEN_HANG)
    try:
        for _ in range(2):
            assert cli.lines.get(timeout=60).split("] ")[1] == "ready\n"
        cli.proc.send_signal(signal.SIGINT)
        assert cli.wait() == 130
    finally:
        cli.wait()
    # after Ctrl-C (the nodes' INFO lines of the job's start come before it)
    after = cli.stderr.split("got SIGINT", 1)[1]
    lines = [line for line in after.splitlines() if line.startswith("[")]
    labels = [line.split("]")[0] for line in lines]
    assert len(labels) == len(set(labels)), cli.stderr  # at most one line per process
    # 'launching ...' and 'got SIGINT' (the OMP_NUM_THREADS line comes before any Ctrl-C)
    assert sum(line.startswith("pskv-launch") and "OMP_NUM_THREADS" not in line
               for line in cli.stderr.splitlines()) <= 2, cli.stderr
    # the full tracebacks stay in the log files
    assert "Traceback" in (tmp_path / "worker-0.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "scheduler.log", "server-0.log", "server-1.log", "worker-0.log", "worker-1.log"]
