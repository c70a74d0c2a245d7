"""torchrun starts pskv jobs (issue #29, item 6): the real torchrun, single node and two
nodes on one machine (static and c10d rendezvous). Every worker's sums and optimizer step
are checked, and no scheduler or server the workers started is left afterwards."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

pytest.importorskip("torch", reason="torchrun needs torch")

SCRIPT = str(Path(__file__).parent / "scripts" / "torchrun_job.py")
SRC = str(Path(__import__("pskv").__file__).resolve().parents[1])
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
JOB_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_all(argvs: Sequence[Sequence[str]]) -> list[str]:
    if not os.path.exists(TORCHRUN) and shutil.which("torchrun") is None:
        pytest.skip("no torchrun next to this python")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))},
           "PYTHONPATH": SRC, "PSKV_CONNECT_TIMEOUT": "60", "PSKV_SHUTDOWN_TIMEOUT": "10"}
    procs = [subprocess.Popen([TORCHRUN, *a, SCRIPT], env=env, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for a in argvs]
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=JOB_S)[0])
            except subprocess.TimeoutExpired:
                outs.append("(killed after the job's bound)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    output = "\n----\n".join(outs)
    assert [p.returncode for p in procs] == [0] * len(procs), output
    return outs


def _check(outs: list[str], workers: int, nodes: int) -> None:
    output = "\n----\n".join(outs)
    # the workers share torchrun's stdout: their lines may run together
    reps = [json.loads(m) for o in outs for m in re.findall(r'\{"rank"[^{}]*\}', o)]
    assert sorted(r["rank"] for r in reps) == list(range(workers)), output
    mean = sum(range(1, workers + 1)) / workers
    for r in reps:
        assert r["n"] == workers and r["sum"] == sum(range(1, workers + 1)), output
        assert r["weight"] == [-mean, -mean], output
    started = [pid for r in reps for pid in r["nodes"]]
    assert len(started) == 1 + nodes, output          # the scheduler, a server per node
    left = [pid for pid in started if _alive(pid)]
    assert left == [], f"pskv nodes left after the job: {left}\n{output}"


def test_torchrun_standalone_two_workers():
    _check(_run_all([["--nproc-per-node", "2", "--standalone"]]), 2, 1)


def test_torchrun_two_static_nodes():
    port = str(_free_port())
    outs = _run_all([["--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
                      "--master-addr", "127.0.0.1", "--master-port", port] for i in (0, 1)])
    _check(outs, 2, 2)


def test_torchrun_two_nodes_c10d_rendezvous():
    port = _free_port()
    outs = _run_all([["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}"]
                     for _ in (0, 1)])
    _check(outs, 2, 2)


ORPHAN = """
import os, sys
from pskv.kvstore.dist._torchrun import _children, adopt_torchrun
assert adopt_torchrun()
print(" ".join(str(p.pid) for p in _children), flush=True)
sys.stdin.readline()
os._exit(1)      # no atexit, no close: as a worker killed mid-job
"""


def test_the_nodes_a_dying_worker_started_end_with_it():
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC,
           "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PSKV_CONNECT_TIMEOUT": "300"}
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2                          # the scheduler and this node's server
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(30)
        end = time.monotonic() + 30                    # bound: they wait 300 s for workers
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
