"""pskv-launch with real local processes: dummy servers, workers that report their env.

Every test checks that no process the job started is left once the launcher returns.
"""
from __future__ import annotations

import io
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pskv._ps.config import (ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_ROLE, ENV_ROOT_PORT,
                             ENV_ROOT_URI, ENV_SECRET, Role)
from pskv.errors import ConfigError
from pskv.launch import LaunchResult, launch
from pskv.testing import launch_reports

pytestmark = pytest.mark.dist

PY = sys.executable

# prints its role, pid and cluster variables as one JSON line, then runs BODY
REPORT = ("import json, os, sys, time\n"
          "print(json.dumps({'pid': os.getpid(), 'env': {k: v for k, v in os.environ.items()"
          " if k.startswith(('DMLC_', 'PSKV_'))}}), flush=True)\n")


def py(body: str = "") -> list[str]:
    return [PY, "-c", REPORT + body]


SERVER_OK = py("time.sleep(0.3)")
HANG = "time.sleep(60)"


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def assert_all_gone(pids: list[int], within: float = 5.0) -> None:
    # an orphaned grandchild is reaped by init, which may take a moment
    end = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


def reports(text: str) -> dict[str, dict]:
    """`[label] {json}` lines -> {label: report}."""
    return dict(launch_reports(text))


def run(command: list[str], workers: int = 2, servers: int = 1, **kw) -> tuple[
        LaunchResult, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("server_command", SERVER_OK)
    kw.setdefault("timeout", 30)
    result = launch(command, workers, servers, stdout=out, stderr=err, **kw)
    assert_all_gone([p.pid for p in result.processes])
    return result, out.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
def test_env_and_prefixes() -> None:
    result, out, err = run(py("print('to stderr', file=sys.stderr)"), workers=2, servers=2,
                           env={"A": "1"}, env_worker={"W": "w"})
    assert result.returncode == 0 and result.reason == "ok" and result.failed is None
    got = reports(out)
    assert set(got) == {"scheduler", "server 0", "server 1", "worker 0", "worker 1"}
    assert [(p.role, p.rank, p.returncode, p.killed) for p in result.processes] == [
        (Role.SCHEDULER, 0, 0, False), (Role.SERVER, 0, 0, False), (Role.SERVER, 1, 0, False),
        (Role.WORKER, 0, 0, False), (Role.WORKER, 1, 0, False)]
    assert {label: r["pid"] for label, r in got.items()} == {
        p.label: p.pid for p in result.processes}
    envs = {label: r["env"] for label, r in got.items()}
    assert {label: e[ENV_ROLE] for label, e in envs.items()} == {
        "scheduler": "scheduler", "server 0": "server", "server 1": "server",
        "worker 0": "worker", "worker 1": "worker"}
    for e in envs.values():
        assert e[ENV_ROOT_URI] == "127.0.0.1"
        assert (e[ENV_NUM_WORKER], e[ENV_NUM_SERVER]) == ("2", "2")
    assert len({e[ENV_ROOT_PORT] for e in envs.values()}) == 1
    assert len({e[ENV_SECRET] for e in envs.values()}) == 1
    assert len(envs["worker 0"][ENV_SECRET]) == 64
    assert sorted(err.splitlines()) == ["[worker 0] to stderr", "[worker 1] to stderr"]


@pytest.mark.timeout(60)
def test_output_is_live() -> None:
    # a worker that prints without flushing, then hangs: its line must come out before the
    # timeout kills it (PYTHONUNBUFFERED)
    result, out, _ = run([PY, "-c", "import time; print('early'); time.sleep(60)"], workers=1,
                         server_command=py(HANG), timeout=1.5)
    assert result.returncode == 124
    assert "[worker 0] early" in out.splitlines()


@pytest.mark.timeout(90)
def test_real_cluster_smoke() -> None:
    # the default server command, python -m pskv.server, with a dist_sync worker
    worker = [PY, "-c", (
        "import pskv as mx\n"
        "kv = mx.kv.create('dist_sync')\n"
        "kv.init(3, mx.nd.zeros((2, 3)))\n"
        "kv.push(3, mx.nd.ones((2, 3)) * (kv.rank + 1))\n"
        "out = mx.nd.zeros((2, 3))\n"
        "kv.pull(3, out=out)\n"
        "print('sum', kv.rank, out.asnumpy().sum())\n"
        "kv.close()\n")]
    out, err = io.StringIO(), io.StringIO()
    result = launch(worker, 2, 2, timeout=60, stdout=out, stderr=err, shutdown_timeout=30)
    assert_all_gone([p.pid for p in result.processes])
    assert result.returncode == 0, err.getvalue()
    assert result.killed == ()  # scheduler and servers exit by themselves
    # the scheduler, not the launch order, assigns kv.rank (as ps-lite)
    lines = out.getvalue().splitlines()
    assert sorted(line.split("] ")[0] for line in lines) == ["[worker 0", "[worker 1"]
    assert sorted(line.split("] ")[1] for line in lines) == ["sum 0 18.0", "sum 1 18.0"]


@pytest.mark.timeout(60)
def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SECRET, "my-secret")
    _, out, _ = run(py(), workers=1)
    assert {r["env"][ENV_SECRET] for r in reports(out).values()} == {"my-secret"}


@pytest.mark.timeout(60)
def test_failing_worker_stops_everything() -> None:
    start = time.monotonic()
    result, out, _ = run(py("time.sleep(0.5); sys.exit(3)"), workers=1, servers=2,
                         server_command=py(HANG), grace_period=10)
    assert time.monotonic() - start < 10  # servers die on SIGTERM, no grace period wait
    assert (result.returncode, result.reason) == (3, "failed")
    assert result.failed is not None and result.failed.label == "worker 0"
    assert not result.failed.killed
    assert {p.label for p in result.killed} == {"scheduler", "server 0", "server 1"}
    assert all(p.returncode == -signal.SIGTERM for p in result.killed)


@pytest.mark.timeout(60)
def test_failing_server_stops_the_workers() -> None:
    result, _, _ = run(py(HANG), workers=2, servers=1,
                       server_command=py(f"sys.exit(5) if os.environ['{ENV_ROLE}'] == 'server'"
                                         f" else time.sleep(60)"))
    assert (result.returncode, result.failed and result.failed.label) == (5, "server 0")
    assert {p.label for p in result.killed} == {"scheduler", "worker 0", "worker 1"}


@pytest.mark.timeout(60)
def test_worker_killed_by_a_signal() -> None:
    result, _, _ = run(py("os.kill(os.getpid(), 9)"), workers=1, server_command=py(HANG))
    assert result.returncode == 128 + 9
    assert result.failed is not None and result.failed.returncode == -9


@pytest.mark.timeout(60)
def test_sigterm_ignored_means_sigkill() -> None:
    stubborn = py("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + HANG)
    start = time.monotonic()
    result, _, _ = run(py("time.sleep(0.5); sys.exit(2)"), workers=1,
                       server_command=stubborn, grace_period=0.5)
    assert result.returncode == 2
    assert all(p.returncode == -signal.SIGKILL for p in result.killed)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_timeout(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="pskv.launch"):
        result, _, _ = run(py(HANG), workers=2, server_command=py(HANG), timeout=1.0)
    assert (result.returncode, result.reason, result.failed) == (124, "timeout", None)
    assert len(result.killed) == 4
    assert "still running: scheduler, server 0, worker 0, worker 1" in caplog.text


@pytest.mark.timeout(60)
def test_servers_that_do_not_exit_are_stopped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pskv.launch"):
        result, _, _ = run(py(), workers=2, server_command=py(HANG), shutdown_timeout=0.5)
    assert (result.returncode, result.reason) == (0, "ok")
    assert {p.label for p in result.killed} == {"scheduler", "server 0"}
    assert caplog.records == []


@pytest.mark.timeout(60)
def test_timeout_after_the_workers_finished_is_success() -> None:
    start = time.monotonic()
    result, _, _ = run(py(), workers=1, server_command=py(HANG), timeout=1.5,
                       shutdown_timeout=30)
    assert (result.returncode, result.reason) == (0, "ok")
    assert {p.label for p in result.killed} == {"scheduler", "server 0"}
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_grandchildren_are_killed(tmp_path: Path) -> None:
    # a worker that leaves a background process behind when it exits 0
    pidfile = tmp_path / "grandchild"
    body = (f"import subprocess; p = subprocess.Popen([{PY!r}, '-c', 'import time; "
            f"time.sleep(60)']); open({str(pidfile)!r}, 'w').write(str(p.pid))")
    result, _, _ = run(py(body), workers=1)
    assert result.returncode == 0
    assert_all_gone([int(pidfile.read_text())])


@pytest.mark.timeout(60)
def test_command_not_found(tmp_path: Path) -> None:
    pidfile = tmp_path / "servers"
    server = py(f"open({str(pidfile)!r}, 'a').write(str(os.getpid()) + '\\n'); " + HANG)
    with pytest.raises(ConfigError, match="cannot start worker 0") as info:
        launch(["/nonexistent/pskv-test"], 1, 1, server_command=server, timeout=30)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    pids = [int(p) for p in pidfile.read_text().split()] if pidfile.exists() else []
    assert_all_gone(pids)


# -- the CLI in a subprocess --------------------------------------------------------------
class Cli:
    """``python -m pskv.launch ...`` in its own session, its stdout read line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([PY, "-m", "pskv.launch", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                             daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append),
                             daemon=True)]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(pipe, sink) -> None:
        with pipe:
            for line in pipe:
                sink(line)

    def reports(self, n: int, within: float = 20.0) -> dict[str, dict]:
        got: dict[str, dict] = {}
        end = time.monotonic() + within
        while len(got) < n:
            got.update(reports(self.lines.get(timeout=max(0.01, end - time.monotonic()))))
        return got

    def wait(self, within: float = 30.0) -> int:
        try:
            return self.proc.wait(within)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for t in self.threads:
                t.join(5)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def cli_args(worker_body: str, server_body: str = HANG, *flags: str) -> list[str]:
    return ["-n", "2", "-s", "1", "--server-command", shlex.join(py(server_body)), *flags,
            *py(worker_body)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_forwards_signals(sig: int, status: int) -> None:
    cli = Cli(*cli_args(HANG))
    try:
        pids = [r["pid"] for r in cli.reports(4).values()]
        cli.proc.send_signal(sig)
        assert cli.wait() == status
    finally:
        cli.wait()
    assert_all_gone(pids)
    assert f"got {signal.Signals(sig).name}" in cli.stderr


@pytest.mark.timeout(60)
def test_cli_exit_status_propagates() -> None:
    cli = Cli(*cli_args("sys.exit(7)"))
    assert cli.wait() == 7
    assert "exited with status 7" in cli.stderr


@pytest.mark.timeout(60)
def test_cli_timeout() -> None:
    cli = Cli(*cli_args(HANG, HANG, "--timeout", "1"))
    assert cli.wait() == 124
    assert "still running: scheduler, server 0, worker 0, worker 1" in cli.stderr


@pytest.mark.timeout(60)
def test_cli_success_with_env() -> None:
    cli = Cli("-n", "1", "--server-command", f"{PY} -c pass", "--env", "X:1:2",
              *py("print(os.environ['X'])"))
    assert cli.wait() == 0
    lines = []
    while not cli.lines.empty():
        lines.append(cli.lines.get())
    assert "[worker 0] 1:2\n" in lines


@pytest.mark.timeout(60)
def test_cli_command_not_found() -> None:
    cli = Cli("-n", "1", "--server-command", f"{PY} -c 'import time; time.sleep(60)'",
              "/nonexistent/pskv-test")
    assert cli.wait() == 127
    assert "cannot start worker 0" in cli.stderr


@pytest.mark.timeout(60)
def test_cli_bad_flags() -> None:
    cli = Cli("-n", "0", "x")
    assert cli.wait() == 2
    assert "at least one worker" in cli.stderr
