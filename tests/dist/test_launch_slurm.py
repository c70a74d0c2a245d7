"""pskv-launch --launcher slurm against a real Slurm: a slurmctld and a slurmd on this machine.

The module fixture writes its own slurm.conf in a temp dir (one node: this host, CPUs=2,
select/cons_tres, proctrack/linuxproc, no cgroups, free ports), generates a munge key and
starts munged on its own socket, then slurmctld and slurmd in the foreground, each in its
own process group; at the end it stops them by pid. It skips, saying why, when that cannot
be done here (not root, slurm-wlm or munge missing, a daemon that does not come up).
The job runs as ``salloc -N1 -n5 --overcommit python -m pskv.launch --launcher slurm ...``.

The last test runs ``tests/durability/scripts/train_reshard.py`` (dist_sync) with
``--control``: server 2 removed at a quarter of the steps (the launcher sends SIGUSR1 to its
``srun``, which passes it on to the server in its step; the server retires and exits 0),
added back at half (a new ``srun`` step), its shard handed back; the result is the fixed-size
run's, bit for bit (docs/slurm.md, "Adding and removing servers").
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

import numpy as np
import pytest

from pskv._ps.config import Role
from pskv.launch import control
from pskv.launch._net import free_port
from pskv.launch._spec import ProcessSpec
from pskv.launch._supervise import run_processes
from pskv.testing import launch_reports

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "salloc", "srun", "scontrol")
UP_S = 30.0


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


class SlurmBed:
    """munged, slurmctld and slurmd of one test module, in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for name in list(self.env):
            if name.startswith("SLURM_") and name != "SLURM_CONF":
                del self.env[name]  # the test itself may run inside an allocation

    def _start(self, argv: list[str], log: str) -> None:
        with open(self.root / log, "wb") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=self.env,
                                               start_new_session=True))

    def _wait(self, what: str, check: list[str]) -> None:
        end = time.monotonic() + UP_S
        while time.monotonic() < end:
            if any(p.poll() is not None for p in self.procs):
                break
            done = subprocess.run(check, env=self.env, capture_output=True, text=True,
                                  timeout=10, check=False)
            if done.returncode == 0 and "idle" in done.stdout:
                return
            time.sleep(0.5)
        logs = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.root.glob("*.log")))
        self.stop()
        pytest.skip(f"Slurm did not come up here ({what} not ready within {UP_S:g} s):\n{logs}")

    def start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        subprocess.run([_which("mungekey") or "mungekey", "--create", f"--keyfile={key}",
                        "--force"], check=True, capture_output=True, timeout=30)
        sock = munge / "munge.sock"
        self._start([_which("munged") or "munged", "-F", "--force", f"--socket={sock}",
                     f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                     f"--seed-file={munge / 'munged.seed'}",
                     f"--log-file={munge / 'munged.log'}"], "munged.log")
        end = time.monotonic() + UP_S
        while not sock.exists() and time.monotonic() < end:
            time.sleep(0.1)
        host = socket.gethostname()
        for d in ("state", "spool"):
            (self.root / d).mkdir()
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=pskvtest", f"SlurmctldHost={host}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "MpiDefault=none", "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "ReturnToService=2",
            f"NodeName={host} CPUs=2 State=UNKNOWN",
            f"PartitionName=pskv Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._start([_which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf)],
                    "slurmctld.log")
        self._start([_which("slurmd") or "slurmd", "-D", "-f", str(self.conf)],
                    "slurmd.log")
        self._wait("node", ["sinfo", "-h", "-o", "%t"])

    def stop(self) -> None:
        """scancel what is left, then SIGTERM each daemon's group, SIGKILL after 10 s."""
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env,
                       capture_output=True, timeout=10, check=False)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs.clear()


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmBed]:
    if os.geteuid() != 0:
        pytest.skip("a private slurmctld/slurmd needs root (SlurmUser=root)")
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get "
                    "install slurm-wlm munge, as .ci/run does")
    with tempfile.TemporaryDirectory(prefix="pskv-slurm-") as tmp:
        bed = SlurmBed(Path(tmp))
        try:
            bed.start()
            yield bed
        finally:
            bed.stop()


def _salloc_start(bed: SlurmBed, launch_args: Sequence[str],
                  timeout: float) -> subprocess.Popen[str]:
    """``salloc ... python -m pskv.launch --launcher slurm ARGS``, in its own session."""
    env = dict(bed.env, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), bed.env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    argv = ["salloc", "-N1", "-n5", "--overcommit", "--time=5", sys.executable, "-m",
            "pskv.launch", "--launcher", "slurm", "--timeout", str(timeout - 30),
            *launch_args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=REPO)


def salloc(bed: SlurmBed, *launch_args: str, timeout: float = 240) -> tuple[int, str, str]:
    p = _salloc_start(bed, launch_args, timeout)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        pytest.fail(f"salloc did not finish in {timeout} s:\n{out}\n{err}")
    return p.returncode, out, err


def test_sync_job_under_salloc(slurm: SlurmBed) -> None:
    rc, out, err = salloc(slurm, "-n", "2", "-s", "2", "--env",
                          "MXNET_KVSTORE_BIGARRAY_BOUND:100", sys.executable,
                          str(SCRIPTS / "sync_sum.py"))
    assert rc == 0, out + err
    rows = {f"[{label}]": r for label, r in launch_reports(out) if label.startswith("worker ")}
    assert set(rows) == {"[worker 0]", "[worker 1]"}, out + err
    for label, row in rows.items():
        assert row["ok"] and row["num_workers"] == 2
        assert label == f"[worker {row['rank']}]"  # DMLC_WORKER_ID: the prefix is kv.rank


def test_a_failing_worker_stops_the_job_and_is_named(slurm: SlurmBed) -> None:
    rc, out, err = salloc(slurm, "-n", "2", "-s", "1", sys.executable, "-c",
                          "import os, sys; sys.exit(3 if os.environ['DMLC_WORKER_ID'] == '1' "
                          "else 0)")
    assert rc == 3, out + err
    host = socket.gethostname()
    assert f"worker 1 on {host} (pid" in err and "status 3" in err


def test_outside_an_allocation_exits_2(slurm: SlurmBed) -> None:
    env = dict(slurm.env, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "-m", "pskv.launch", "--launcher", "slurm", "-n",
                           "1", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "salloc or sbatch" in done.stderr


def test_supervisor_names_the_host_of_a_failed_process(
        caplog: pytest.LogCaptureFixture) -> None:
    # the report every launcher built on the supervisor gives (ssh, slurm)
    procs = [ProcessSpec(Role.WORKER, 1, (sys.executable, "-c", "raise SystemExit(3)"),
                         host="node7")]
    with caplog.at_level(logging.ERROR, logger="pskv.launch._supervise"):
        result = run_processes(procs, stdout=io.StringIO(), stderr=io.StringIO())
    assert result.returncode == 3
    assert result.failed is not None and result.failed.host == "node7"
    assert "worker 1 on node7" in caplog.text and "status 3" in caplog.text


# -- servers removed and added under slurm (--control; docs/durability.md) ----------------
RESHARD = REPO / "tests" / "durability" / "scripts" / "train_reshard.py"
RESHARD_STEPS = 160
RESHARD_TIMEOUT_S = 270.0


class _Job:
    """A salloc'ed pskv-launch job in the background; its output kept line by line."""

    def __init__(self, bed: SlurmBed, launch_args: Sequence[str], timeout: float) -> None:
        self.proc = _salloc_start(bed, launch_args, timeout)
        self.out: list[str] = []
        self.lines: list[str] = []          # stderr
        self.pumps = [threading.Thread(target=self._pump, args=(pipe, into), daemon=True)
                      for pipe, into in ((self.proc.stdout, self.out),
                                         (self.proc.stderr, self.lines))]
        for t in self.pumps:
            t.start()

    @staticmethod
    def _pump(pipe: IO[str] | None, into: list[str]) -> None:
        assert pipe is not None
        for line in pipe:
            into.append(line.rstrip("\n"))

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return "\n".join(self.out + self.lines)

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the salloc'ed job did not finish in {timeout:g} s:\n{self.text()}")
        for t in self.pumps:
            t.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            for t in self.pumps:
                t.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text())
    except (OSError, ValueError):
        return -1


def _await_step(out: Path, step: int, job: _Job) -> None:
    deadline = time.monotonic() + 180
    while _progress(out) < step:
        assert job.running, f"the job ended before step {step}:\n{job.text()}"
        assert time.monotonic() < deadline, f"the job did not reach step {step} in 180 s"
        time.sleep(0.05)


def _reshard_job(bed: SlurmBed, out: Path,
                 moves: Callable[[Path, str, _Job], None] | None = None) -> _Job:
    """train_reshard.py (dist_sync) on 2 workers and 3 server slots, replicas on, under
    salloc; ``moves(out, sock, job)`` acts on it through --control while it trains."""
    out.mkdir()
    sockets = tempfile.mkdtemp(prefix="pskv-reshard-")
    sock = os.path.join(sockets, "control")
    args = ["-n", "2", "-s", "3", "--env", "PSKV_REPLICAS:1",
            "--env", "PSKV_HEARTBEAT_TIMEOUT:20", "--env", "PSKV_CONNECT_TIMEOUT:60",
            *(["--control", sock] if moves is not None else []),
            sys.executable, str(RESHARD), str(out), str(RESHARD_STEPS), "dist_sync"]
    job = _Job(bed, args, RESHARD_TIMEOUT_S + 30)
    try:
        if moves is not None:
            moves(out, sock, job)
        rc = job.wait(RESHARD_TIMEOUT_S + 60)
    finally:
        job.kill()
        shutil.rmtree(sockets, ignore_errors=True)
    assert rc == 0, job.text()
    return job


def _result(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "result.npz") as data:
        return {k: data[k] for k in data.files}


def _remove_then_add_server_2(out: Path, sock: str, job: _Job) -> None:
    _await_step(out, RESHARD_STEPS // 4, job)
    got = control(sock, "remove-server", 2, wait=60)
    # retired: srun passed the launcher's SIGUSR1 on to the server, which exited 0
    assert got["ok"] and got["state"] == "retired", (got, job.text())
    _await_step(out, RESHARD_STEPS // 2, job)              # trains on 2 servers
    mark = len(job.lines)
    got = control(sock, "add-server", 2)
    assert got["ok"], got
    deadline = time.monotonic() + 120                      # then on 3 again
    while not any("shard 2 moved from server" in line and line.endswith("to server 2")
                  for line in job.lines[mark:]):
        assert job.running, f"the job ended before shard 2 was handed back:\n{job.text()}"
        assert time.monotonic() < deadline, "shard 2 was not handed back in 120 s"
        time.sleep(0.05)


@pytest.mark.timeout(2 * RESHARD_TIMEOUT_S + 120)
def test_a_server_removed_and_added_back_under_slurm_ends_as_the_fixed_size_run(
        slurm: SlurmBed, tmp_path: Path) -> None:
    start = time.monotonic()
    _reshard_job(slurm, tmp_path / "fixed")
    fixed_s = time.monotonic() - start
    moved = _reshard_job(slurm, tmp_path / "moved", _remove_then_add_server_2)
    logging.getLogger(__name__).info("fixed run %.1f s, moved run %.1f s", fixed_s,
                                     time.monotonic() - start - fixed_s)
    text = moved.text()
    assert "server 2 on" in text and "retired: its backup serves its shard" in text, text
    want, got = _result(tmp_path / "fixed"), _result(tmp_path / "moved")
    assert sorted(got) == sorted(want)
    assert bool(want["found"].all()) and len(want["ids"]) > 500
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
