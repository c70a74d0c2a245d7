"""The slurm launcher's pieces: the allocation's node list, placement, srun command lines.

Nothing here runs srun or scontrol: scontrol is replaced by a recorder. The real Slurm test
is tests/dist/test_launch_slurm.py.
"""
from __future__ import annotations

import logging
import subprocess
from typing import Any

import pytest

from pskv._ps.config import (ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_ROLE, ENV_ROOT_PORT,
                             ENV_ROOT_URI, ENV_SECRET, ENV_SERVER_ID, ENV_WORKER_ID, Role)
from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, build_processes, main, parse_args
from pskv.launch._slurm import (SRUN_OPTIONS, allocation_nodelist, expand_nodelist,
                               parse_nodelist, scheduler_port, slurm_processes, srun_argv)


def fake_scontrol(stdout: str = "", returncode: int = 0, calls: list[Any] | None = None,
                  exc: BaseException | None = None) -> Any:
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if calls is not None:
            calls.append((argv, kwargs))
        if exc is not None:
            raise exc
        return subprocess.CompletedProcess(argv, returncode, stdout, "scontrol: bad list\n")
    return run


def test_outside_an_allocation_is_a_usage_error(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="salloc or sbatch"):
        allocation_nodelist({})
    # the command line: exit status 2, saying to run inside salloc/sbatch
    with caplog.at_level(logging.ERROR):
        assert main(["--launcher", "slurm", "-n", "1", "true"]) == 2
    assert "salloc or sbatch" in caplog.text


def test_nodelist_prefers_the_job_variable() -> None:
    assert allocation_nodelist({"SLURM_NODELIST": "old", "SLURM_JOB_NODELIST": "new"}) == "new"
    assert allocation_nodelist({"SLURM_NODELIST": "old"}) == "old"


def test_expand_uses_scontrol() -> None:
    calls: list[Any] = []
    nodes = expand_nodelist("n[1-2]", run=fake_scontrol("n1\nn2\n", calls=calls))
    assert nodes == ["n1", "n2"]
    argv, kwargs = calls[0]
    assert argv == ["scontrol", "show", "hostnames", "n[1-2]"]
    assert kwargs["timeout"] > 0  # bounded


def test_expand_without_scontrol_parses_here() -> None:
    run = fake_scontrol(exc=FileNotFoundError("scontrol"))
    assert expand_nodelist("gpu[08-10],login", run=run) == ["gpu08", "gpu09", "gpu10", "login"]


@pytest.mark.parametrize("result, match", [
    (dict(returncode=1), "failed"),
    (dict(stdout=""), "names no node"),
    (dict(exc=subprocess.TimeoutExpired("scontrol", 30)), "did not answer"),
])
def test_expand_failures_are_config_errors(result: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        expand_nodelist("n1", run=fake_scontrol(**result))


@pytest.mark.parametrize("text, want", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("a[1,3],b", ["a1", "a3", "b"]),
    ("r[1-2]n[5-6]", ["r1n5", "r1n6", "r2n5", "r2n6"]),
])
def test_parse_nodelist(text: str, want: list[str]) -> None:
    assert parse_nodelist(text) == want


@pytest.mark.parametrize("text", ["n[1-", "n[a-b]"])
def test_parse_nodelist_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        parse_nodelist(text)


def test_processes_scheduler_on_first_node_ranks_and_env() -> None:
    spec = LaunchSpec(("python", "train.py"), 3, 2, launcher="slurm",
                      env=(("A", "1"),), server_command=("srv",))
    procs = slurm_processes(spec, ["n1", "n2", "n3"], port=9123, secret="sekrit")
    assert [p.label for p in procs] == ["scheduler", "server 0", "server 1", "worker 0",
                                        "worker 1", "worker 2"]
    assert [p.host for p in procs] == ["n1", "n1", "n2", "n3", "n1", "n2"]
    for p in procs:
        env = dict(p.env)
        assert env[ENV_ROOT_URI] == "n1" and env[ENV_ROOT_PORT] == "9123"
        assert (env[ENV_NUM_WORKER], env[ENV_NUM_SERVER]) == ("3", "2")
        assert env[ENV_ROLE] == p.role.value and env["A"] == "1"
        assert env[ENV_SECRET] == "sekrit"
        assert "sekrit" not in " ".join(p.argv)  # srun's environment, not its command line
        assert p.argv[:4] == ("srun", "--nodes=1", "--ntasks=1", f"--nodelist={p.host}")
        assert set(SRUN_OPTIONS) <= set(p.argv)
        want = ("srv",) if p.role is not Role.WORKER else ("python", "train.py")
        assert p.argv[-len(want):] == want
        if p.role is Role.WORKER:
            assert env[ENV_WORKER_ID] == str(p.rank)
        elif p.role is Role.SERVER:
            assert env[ENV_SERVER_ID] == str(p.rank)


def test_srun_options_share_cpus_and_export_all() -> None:
    argv = srun_argv("n1", ["x"], "server 1")
    assert "--overlap" in argv and "--export=ALL" in argv
    assert "--job-name=pskv-server-1" in argv


def test_build_processes_reads_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pskv.launch._slurm.subprocess.run", fake_scontrol("c1\nc2\n"))
    spec = LaunchSpec(("w",), 1, 1, launcher="slurm", port=7777, secret="s")
    procs = build_processes(spec, environ={"SLURM_JOB_ID": "5",
                                           "SLURM_JOB_NODELIST": "c[1-2]"})
    assert [(p.label, p.host) for p in procs] == [("scheduler", "c1"), ("server 0", "c1"),
                                                 ("worker 0", "c2")]


def test_port_without_flag() -> None:
    spec = LaunchSpec(("x",), 1, launcher="slurm")
    assert scheduler_port(spec, "elsewhere.invalid", {"SLURM_JOB_ID": "31337"}) == 9337
    assert scheduler_port(LaunchSpec(("x",), 1, launcher="slurm", port=1234), "a", {}) == 1234


def test_flags() -> None:
    spec = parse_args(["--launcher", "slurm", "-n", "2", "-s", "1", "python", "t.py"],
                      environ={})
    assert spec.launcher == "slurm" and spec.command == ("python", "t.py")
    with pytest.raises(ConfigError, match="from the cluster manager"):
        LaunchSpec(("x",), 1, launcher="slurm", hostfile="hosts")
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        LaunchSpec(("x",), 1, launcher="slurm", image="img")

