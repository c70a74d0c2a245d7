"""Whole clusters as real processes on 127.0.0.1: the CLI smoke test and clean exits.

Every process runs in its own process group; the ``local_cluster`` fixture (conftest.py)
fails the test if any is left running, and kills every group at teardown.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pskv._ps.config import ENV_BIGARRAY_BOUND
from pskv.testing import launch_reports

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
SYNC_SUM = str(Path("tests", "dist", "scripts", "sync_sum.py"))
FAST = {"PSKV_HEARTBEAT_INTERVAL": "0.2", "PSKV_HEARTBEAT_TIMEOUT": "2",
        "PSKV_REQUEST_TIMEOUT": "15", "PSKV_SHUTDOWN_TIMEOUT": "10"}


def worker_reports(text: str) -> dict[int, dict[str, Any]]:
    """``[worker i] {json}`` lines of the launcher's output, by the rank they report."""
    return {r["rank"]: r for label, r in launch_reports(text) if label.startswith("worker")}


def launcher() -> list[str]:
    """The installed ``pskv-launch`` next to this interpreter, else ``python -m pskv.launch``."""
    script = Path(sys.executable).parent / "pskv-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pskv.launch"]


@pytest.mark.timeout(90)
def test_cli_smoke_pskv_launch() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_", "MXNET_"))}
    env.update(FAST, **{ENV_BIGARRAY_BOUND: "100"})
    argv = launcher() + ["-n", "2", "-s", "2", "--launcher", "local", "--timeout", "60",
                         sys.executable, SYNC_SUM]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=75)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"pskv-launch did not finish in 75 s:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # nothing of the job may survive it
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{out}\n{err}"
    reports = worker_reports(out)
    assert sorted(reports) == [0, 1], out
    for report in reports.values():
        assert report["ok"] and report["num_workers"] == 2, report
        assert report["sums"] == [[3.0] * 4, [23.0] * 4, [43.0] * 4]
        assert report["big"] == 3.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers,close", [(1, True), (2, False)],
                         ids=["1server-close", "2servers-exit-without-close"])
def test_nodes_exit_zero_after_workers(local_cluster: Any, servers: int, close: bool) -> None:
    # servers and scheduler leave by themselves once every worker closed its store (or,
    # without close(), exited: the store closes at interpreter exit)
    cluster = local_cluster(2, servers, env={ENV_BIGARRAY_BOUND: "100"})
    cluster.start("sync_sum.py", *([] if close else ["--no-close"]))
    codes = cluster.wait(45)
    assert codes == {label: 0 for label in codes}, cluster.dump()
    ranks = sorted(r["rank"] for p in cluster.workers for r in p.reports())
    assert ranks == [0, 1]
    assert all(r["ok"] for p in cluster.workers for r in p.reports())


@pytest.mark.timeout(60)
def test_server_refuses_worker_role(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_", "MXNET_"))}
    env.update({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"})
    proc = subprocess.run([sys.executable, "-m", "pskv.server"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "DMLC_ROLE=worker" in proc.stderr
    env["DMLC_ROLE"] = "server"
    env["DMLC_NUM_SERVER"] = "two"
    proc = subprocess.run([sys.executable, "-m", "pskv.server"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "DMLC_NUM_SERVER='two'" in proc.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("servers", [1, 2])
def test_big_pushes_from_both_workers_sum_exactly(local_cluster: Any, servers: int) -> None:
    # the two workers' multi-MiB pushes are read by the server interleaved; every round's
    # sum must be exact (a receive buffer shared between them once mixed them up)
    cluster = local_cluster(2, servers)
    cluster.start("big_rounds.py")
    codes = cluster.wait(80)
    reports = [r for p in cluster.workers for r in p.reports()]
    assert codes == {label: 0 for label in codes}, (reports, cluster.dump())
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["ok"] for r in reports), reports
