"""torchrun's manners in pskv-launch (issue #16 item 5): RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE for workers, and OMP_NUM_THREADS=1 with torchrun's notice."""
from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest

from pskv._ps.config import Role
from pskv.launch import LaunchSpec
from pskv.launch._env import OMP_NOTICE, TORCH_NAMES, local_ranks
from pskv.launch._hosts import Host
from pskv.launch._local import local_processes
from pskv.launch._ssh import ssh_processes
from pskv.launch._slurm import slurm_processes
from pskv.launch._mpi import mpi_processes

NOTICE_START = "Setting OMP_NUM_THREADS environment variable for each process to be 1"


def envs(procs: Any) -> dict[tuple[Role, int | None], dict[str, str]]:
    return {(p.role, p.rank): dict(p.env) for p in procs}


def test_local_workers_get_torchruns_variables(caplog: pytest.LogCaptureFixture) -> None:
    spec = LaunchSpec(("python", "t.py"), 3, 1, server_command=("srv",))
    with caplog.at_level(logging.INFO, logger="pskv.launch._env"):
        by = envs(local_processes(spec, port=9000, secret="s", environ={}))
    for rank in range(3):
        env = by[(Role.WORKER, rank)]
        assert [env[n] for n in TORCH_NAMES] == [str(rank), "3", str(rank), "3"]
        assert env["OMP_NUM_THREADS"] == "1"
    for key in ((Role.SCHEDULER, 0), (Role.SERVER, 0)):
        assert not set(TORCH_NAMES + ("OMP_NUM_THREADS",)) & set(by[key])
    notices = [r for r in caplog.records if NOTICE_START in r.getMessage()]
    assert len(notices) == 1            # once per launch, not once per process


@pytest.mark.parametrize("where", ["environ", "env", "env_worker"])
def test_a_users_omp_num_threads_wins_and_no_notice(where: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    environ = {"OMP_NUM_THREADS": "4"} if where == "environ" else {}
    pairs = (("OMP_NUM_THREADS", "4"),)
    spec = LaunchSpec(("t",), 2, 1, env=pairs if where == "env" else (),
                      env_worker=pairs if where == "env_worker" else ())
    with caplog.at_level(logging.INFO, logger="pskv.launch._env"):
        by = envs(local_processes(spec, port=9000, secret="s", environ=environ))
    assert by[(Role.WORKER, 0)].get("OMP_NUM_THREADS") == (None if where == "environ" else "4")
    assert not any(NOTICE_START in r.getMessage() for r in caplog.records)


def test_one_worker_a_host_gets_no_omp_default() -> None:
    by = envs(local_processes(LaunchSpec(("t",), 1, 1), port=9000, secret="s", environ={}))
    env = by[(Role.WORKER, 0)]
    assert "OMP_NUM_THREADS" not in env and env["LOCAL_WORLD_SIZE"] == "1"


def test_ssh_and_slurm_count_local_ranks_per_host() -> None:
    spec = LaunchSpec(("t",), 3, 1, server_command=("srv",))
    procs = ssh_processes(spec, [Host("a"), Host("b")], port=9000, secret="s", root_uri="r",
                          cwd="/", environ={})
    # place(): server 0 on a, workers 0, 1, 2 on b, a, b
    w = {p.rank: p.argv[-1] for p in procs if p.role is Role.WORKER}
    assert "RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2" in w[0]
    assert "RANK=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1" in w[1]
    assert "RANK=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2" in w[2]
    assert all("WORLD_SIZE=3" in cmd and "OMP_NUM_THREADS=1" in cmd for cmd in w.values())
    by = envs(slurm_processes(spec, ["a", "b"], port=9000, secret="s", environ={}))
    assert [by[(Role.WORKER, r)]["LOCAL_RANK"] for r in range(3)] == ["0", "0", "1"]
    assert by[(Role.WORKER, 1)]["LOCAL_WORLD_SIZE"] == "1"


def test_mpi_workers_get_world_size_only() -> None:
    # mpirun starts the workers: their rank is the scheduler's to give, not known here
    spec = LaunchSpec(("t",), 4, 1, launcher="mpi")
    procs = mpi_processes(spec, port=9000, secret="s", root_uri="r", environ={})
    env = dict(procs[-1].env)
    assert env["WORLD_SIZE"] == "4" and "RANK" not in env and "LOCAL_RANK" not in env


def test_local_ranks() -> None:
    assert local_ranks([]) == []
    assert local_ranks(["x", "x", "y", "x"]) == [(0, 3), (1, 3), (0, 1), (2, 3)]


def test_the_notice_is_torchruns_word_for_word() -> None:
    run = pytest.importorskip(
        "torch.distributed.run",
        reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")
    source = inspect.getsource(run).replace('"\n            "', "")   # joined literals
    parts = [part for line in OMP_NOTICE.splitlines() for part in line.split("%s")]
    assert len(parts) == 2 and all(part in source for part in parts if part.strip("* "))
