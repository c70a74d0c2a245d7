"""Servers removed and added while a job trains (issue #32, docs/durability.md "Adding and
removing servers while the job runs"): ``pskv-launch -n 2 -s 3 --control``, replicas on,
a job with dense keys (one cut across the servers) and a table
(``scripts/train_reshard.py``). While it trains, server 2 is removed (its backup serves its
shard), added back (its shard is handed back to it), and removed and added again; the job
ends with what the same job on 3 fixed servers ends with: dist_sync bit for bit (weights,
table rows, with AdaGrad's states behind them), dist_async with every push applied exactly
once (each value counts the pushes). A server added and then killed leaves the shard to
the server that handed it over, which kept the copy as its backup.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pskv.launch import LaunchResult, control, launch

HERE = Path(__file__).parent / "scripts"
STEPS = 240

pytestmark = pytest.mark.timeout(600)


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text())
    except (OSError, ValueError):
        return -1


def _await_step(out: Path, step: int, job: threading.Thread) -> None:
    deadline = time.monotonic() + 240
    while _progress(out) < step:
        assert job.is_alive(), "the job ended before the step the test waits for"
        assert time.monotonic() < deadline, f"the job did not reach step {step} in 240 s"
        time.sleep(0.05)


def _server_pid(sock: str, rank: int) -> int:
    (srv,) = [s for s in control(sock, "status")["servers"] if s["server"] == rank]
    assert srv["state"] == "running", srv
    return int(srv["pid"])


def _await_handback(log: "Lines", since: int, rank: int) -> None:
    """The scheduler's word that shard ``rank`` is back on server ``rank``."""
    want = f"shard {rank} moved from server"
    deadline = time.monotonic() + 120
    while not any(want in line and line.endswith(f"to server {rank}")
                  for line in log.lines[since:]):
        assert time.monotonic() < deadline, f"shard {rank} was not handed back in 120 s"
        time.sleep(0.05)


class Lines:
    """The job's stderr, kept line by line (and passed on)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._part = ""

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        parts = (self._part + text).split("\n")
        self._part = parts.pop()
        self.lines.extend(p.rstrip() for p in parts)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _job(out: Path, mode: str, moves: Any = None) -> LaunchResult:
    """Run the job (3 server slots, replicas on); ``moves(out, sock, log, job)`` acts on
    it while it trains."""
    out.mkdir()
    sockets = tempfile.mkdtemp(prefix="pskv-reshard")
    sock = os.path.join(sockets, "control")
    env = {"PSKV_REPLICAS": "1", "PSKV_HEARTBEAT_TIMEOUT": "20", "PSKV_CONNECT_TIMEOUT": "60",
           "TMPDIR": sockets}
    log = Lines()
    got: dict[str, LaunchResult] = {}
    job = threading.Thread(target=lambda: got.setdefault("r", launch(
        [sys.executable, str(HERE / "train_reshard.py"), str(out), str(STEPS), mode], 2, 3,
        env=env, timeout=400, control=sock if moves else None,
        server_command=[sys.executable, "-m", "pskv.server"],
        stderr=log)), daemon=True)    # type: ignore[arg-type]
    job.start()
    try:
        if moves is not None:
            moves(out, sock, log, job)
    finally:
        job.join(450)
        left = sorted(p.name for p in Path(sockets).iterdir())
        shutil.rmtree(sockets, ignore_errors=True)
    assert not job.is_alive(), "the job did not end"
    assert left == [], f"files left in the job's temp directory: {left}"
    return got["r"]


def _remove_and_add_twice(out: Path, sock: str, log: Lines, job: threading.Thread) -> None:
    for start in (STEPS // 6, STEPS // 2):
        _await_step(out, start, job)
        got = control(sock, "remove-server", 2, wait=60)
        assert got["ok"] and got["state"] == "retired", got
        _await_step(out, start + STEPS // 8, job)          # trains on 2 servers
        mark = len(log.lines)
        got = control(sock, "add-server", 2)
        assert got["ok"], got
        _await_handback(log, mark, 2)                       # then on 3 again


def _result(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "result.npz") as data:
        return {k: data[k] for k in data.files}


_CALM: dict[str, dict[str, np.ndarray]] = {}


def _calm(factory: pytest.TempPathFactory, mode: str) -> dict[str, np.ndarray]:
    """The same job on 3 fixed servers (run once per mode)."""
    if mode not in _CALM:
        out = factory.mktemp(f"calm-{mode}")
        result = _job(out / "job", mode)
        assert result.ok, result
        _CALM[mode] = _result(out / "job")
    return _CALM[mode]


@pytest.mark.parametrize("mode", ["dist_sync", "dist_async"])
def test_a_job_whose_server_is_removed_and_added_twice_ends_as_the_fixed_size_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, mode: str) -> None:
    want = _calm(tmp_path_factory, mode)
    moved = _job(tmp_path / "moved", mode, _remove_and_add_twice)
    assert moved.ok, moved
    got = _result(tmp_path / "moved")
    assert sorted(got) == sorted(want)
    assert bool(want["found"].all()) and len(want["ids"]) > 1000
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{mode}: {key}")
    if mode == "dist_async":        # every push applied exactly once: each value counts them
        assert float(got["n"][0]) == 2 * STEPS
    server2 = [p for p in moved.processes if p.label == "server 2"]
    assert all(p.returncode == 0 for p in server2), server2


def test_a_server_added_then_killed_leaves_its_shard_to_the_server_that_kept_its_copy(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    def moves(out: Path, sock: str, log: Lines, job: threading.Thread) -> None:
        _await_step(out, STEPS // 6, job)
        assert control(sock, "remove-server", 2, wait=60)["state"] == "retired"
        _await_step(out, STEPS // 3, job)
        mark = len(log.lines)
        assert control(sock, "add-server", 2)["ok"]
        _await_handback(log, mark, 2)
        # server 2 links to its backup (server 0) when it first serves shard 2, just after
        deadline = time.monotonic() + 60
        said = "server 2: server 0 is the backup of shard 2"
        while not any(said in line for line in log.lines[mark:]):
            assert time.monotonic() < deadline, "server 2 never linked to shard 2's backup"
            time.sleep(0.05)
        linked = [line for line in log.lines[mark:] if said in line]
        assert any("it kept its copy" in line for line in linked), \
            f"the server that handed shard 2 back got a whole copy back instead: {linked}"
        _await_step(out, _progress(out) + 20, job)
        os.kill(_server_pid(sock, 2), signal.SIGKILL)

    want = _calm(tmp_path_factory, "dist_sync")
    moved = _job(tmp_path / "moved", "dist_sync", moves)
    assert moved.ok, moved
    got = _result(tmp_path / "moved")
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
