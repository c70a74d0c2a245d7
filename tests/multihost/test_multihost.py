"""pskv-launch across hosts for real: the ssh and mpi launchers on the namespace bed.

``h0`` runs ``pskv-launch`` (and so the scheduler); the servers and workers run on ``h1`` ..
``h3`` through each host's own sshd (or OpenMPI's ``orted``, started over the same ssh).
Each job is bounded by the launcher's ``--timeout`` and by the test's own wait; the
``start_job`` fixture checks that no process of a job is left on any host afterwards.
"""
from __future__ import annotations

import re
import subprocess
import time

import pytest

from pskv.testing import launch_reports

from .conftest import PY, SCRIPTS, SRC

pytestmark = pytest.mark.multihost

ROUNDS = str(SCRIPTS / "rounds.py")
HB_INTERVAL, HB_TIMEOUT = 0.5, 3.0
#: every job: quick heartbeats (a lost host shows within seconds), bounded joins, and a
#: bound small enough that a split key spans the servers
FAST = ["--env", f"PSKV_HEARTBEAT_INTERVAL:{HB_INTERVAL}",
        "--env", f"PSKV_HEARTBEAT_TIMEOUT:{HB_TIMEOUT}",
        "--env", "PSKV_CONNECT_TIMEOUT:20", "--env", "PSKV_SHUTDOWN_TIMEOUT:10",
        "--env", "MXNET_KVSTORE_BIGARRAY_BOUND:1000"]
#: bound on each successful job; they take seconds
JOB_S = 120


def reports(output: str) -> list[dict]:
    """The JSON lines the workers printed (``[worker 1] {...}`` or ``[workers] {...}``)."""
    return [r for _label, r in launch_reports(output)]


def check_rounds(output: str, workers: int, rounds: int) -> dict[int, str]:
    """Every worker's sums are right; returns {kv.rank: the address it ran at}."""
    reps = reports(output)
    where = {r["rank"]: r["address"] for r in reps if "address" in r}
    assert sorted(where) == list(range(workers)), output
    for rank in range(workers):
        sums = [r["sum"] for r in reps if r.get("rank") == rank and "round" in r]
        assert sums == [float(sum(w + 1 + 10 * k for w in range(workers)))
                        for k in range(rounds)], output
        assert {"rank": rank, "ok": True} in reps, output
    return where


def test_ssh_launcher_runs_servers_and_workers_on_three_hosts(bed, start_job, tmp_path):
    hosts = bed.hosts[1:4]
    hostfile = bed.hostfile(hosts, str(tmp_path / "hosts"))
    job = start_job(["-H", hostfile, "-n", "3", "-s", "2", "--timeout", str(JOB_S), *FAST],
                    [PY, ROUNDS, "--rounds", "4"])
    rc, output = job.finish(JOB_S + 30)
    assert rc == 0, output
    where = check_rounds(output, 3, 4)
    # servers then workers, round-robin: server 0 h1, server 1 h2, workers on h3, h1, h2
    assert sorted(where.values()) == sorted(h.address for h in hosts), output


def test_ssh_launcher_trains_the_example_across_hosts(bed, start_job, tmp_path):
    """-n 2 -s 2 of the training example equals one process with the global batch."""
    flags = ["--quiet", "--seed", "7", "--max-steps", "12"]
    hostfile = bed.hostfile(bed.hosts[1:4], str(tmp_path / "hosts"))
    job = start_job(["-H", hostfile, "-n", "2", "-s", "2", "--timeout", str(JOB_S), *FAST],
                    [PY, "-m", "pskv.examples.train", "--kv-store", "dist_sync",
                     "--batch-size", "60", *flags])
    rc, output = job.finish(JOB_S + 30)
    assert rc == 0, output
    local = subprocess.run([PY, "-m", "pskv.examples.train", "--kv-store", "local",
                            "--batch-size", "120", *flags], capture_output=True, text=True,
                           timeout=JOB_S, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert local.returncode == 0, local.stderr
    done = re.compile(r"rank (\d) of (\d) done: test accuracy ([\d.]+), loss ([\d.]+)")
    (want,) = [m.groups() for m in done.finditer(local.stdout)]
    got = sorted(m.groups() for m in done.finditer(output))
    assert [(g[0], g[1]) for g in got] == [("0", "2"), ("1", "2")], output
    for _, _, accuracy, loss in got:
        # the same weights up to float summation order: one test sample is 1/360 accuracy
        assert abs(float(accuracy) - float(want[2])) < 2.5e-3, (output, local.stdout)
        assert abs(float(loss) - float(want[3])) < 1e-3, (output, local.stdout)


def test_mpi_launcher_runs_across_hosts(bed, start_job, tmp_path, need_mpirun):
    hosts = bed.hosts[1:4]
    hostfile = bed.hostfile(hosts, str(tmp_path / "mpi-hosts"), slots=2)
    # one process a host before a second one anywhere (OpenMPI's --map-by node)
    job = start_job(["--launcher", "mpi", "-H", hostfile, "-n", "3", "-s", "2",
                     "--timeout", str(JOB_S), *FAST], [PY, ROUNDS, "--rounds", "3"],
                    env={"OMPI_MCA_rmaps_base_mapping_policy": "node"})
    rc, output = job.finish(JOB_S + 30)
    assert rc == 0, output
    where = check_rounds(output, 3, 3)
    assert sorted(where.values()) == sorted(h.address for h in hosts), output


def test_partitioned_host_is_named_by_every_survivor(bed, start_job, tmp_path):
    """h2's link goes down mid-round: everyone else raises NodeFailedError naming h2."""
    h1, h2, h3 = bed.hosts[1:4]
    hostfile = bed.hostfile([h1, h2, h3], str(tmp_path / "hosts"))
    # in launch order: server 0 on h1, server 1 on h2 (alone there), worker 0 on h3,
    # worker 1 on h1
    job = start_job(["-H", hostfile, "-n", "2", "-s", "2", "--timeout", str(JOB_S), *FAST],
                    [PY, ROUNDS, "--rounds", "100000", "--pause", "0.02"])
    try:
        job.wait_for('"round": 3', count=2, timeout=60)
        down_at = time.time()
        bed.set_link(h2, False)
        rc, output = job.finish(60)
    finally:
        bed.set_link(h2, True)
    assert rc != 0, output
    errors = [r for r in reports(output) if "error" in r]
    assert sorted(r["rank"] for r in errors) == [0, 1], output
    for err in errors:
        assert err["error"] == "NodeFailedError", output
        # kv ranks are the scheduler's (arrival order), so the role and the host are checked
        assert re.match(r"server \d on h2 ", err["msg"]), output
        # detected after HB_TIMEOUT of silence; the slack is for a loaded 2-core machine
        assert err["at"] - down_at < HB_TIMEOUT + 7, output
    # the surviving server says so too, and the launcher's output names the host
    assert any(line.startswith("[server 0]") and re.search(r"server \d on h2 ", line)
               for line in output.splitlines()), output
    # whichever survivor stops first (a worker: 3, the scheduler: 1) ends the job
    # (the launcher names that process with its host)
    assert re.search(r"pskv-launch ERROR: \w+ (\d )?(on \S+ )?\(pid \d+\) exited with status "
                     r"[13];", output), output
    assert rc in (1, 3), output


def test_refusing_host_is_reported_by_name(bed, start_job, tmp_path):
    """A host without sshd refuses the connection: the job fails at once, naming it."""
    spare = bed.hosts[4]
    bed.stop_sshd(spare)
    hostfile = bed.hostfile([bed.hosts[1], spare], str(tmp_path / "hosts"))
    start = time.monotonic()
    job = start_job(["-H", hostfile, "-n", "1", "-s", "1", "--timeout", str(JOB_S), *FAST],
                    [PY, ROUNDS])
    rc, output = job.finish(60)
    took = time.monotonic() - start
    assert rc == 255, output                     # ssh's status for a failed connection
    assert f"{spare.address} port 22: Connection refused" in output, output
    assert took < 30, output


def test_unreachable_host_is_reported_by_name(bed, start_job, tmp_path):
    """An address nobody holds: ssh gives up within its ConnectTimeout, naming it."""
    nobody = f"{bed.subnet}.250"
    hostfile = str(tmp_path / "hosts")
    with open(hostfile, "w", encoding="utf-8") as f:
        f.write(f"{bed.hosts[1].address}\n{nobody}\n")
    start = time.monotonic()
    job = start_job(["-H", hostfile, "-n", "1", "-s", "1", "--timeout", str(JOB_S), *FAST],
                    [PY, ROUNDS])
    rc, output = job.finish(60)
    took = time.monotonic() - start
    assert rc == 255, output
    assert f"connect to host {nobody} port 22" in output, output
    assert took < 30, output
