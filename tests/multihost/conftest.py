"""The multi-host test bed as a fixture: hosts from network namespaces, each with an sshd.

The bed itself is ``benchmarks/testbed.py`` (one copy of the code for the tests and the
benchmarks); this conftest loads it by path. ``bed`` is one bed per module: ``h0`` runs the
launcher and the scheduler, ``h1`` .. ``h3`` run servers and workers, ``h4`` is a spare a
test may break (stop its sshd). Every test that cuts a link puts it back. At teardown
everything the bed made is removed, and the test run fails if anything is left.

Tests skip, with the reason, where no bed can be made (not root, no ``ip netns``, no
``sshd``); the mpi tests also skip without ``mpirun``. ``.ci/run`` installs what is missing.
"""
from __future__ import annotations

import importlib.util
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: the python every host runs: this interpreter, by absolute path (the hosts share the disk)
PY = sys.executable
#: where this pskv is imported from, passed to every host with --env PYTHONPATH
SRC = str(Path(__import__("pskv").__file__).resolve().parents[1])
NUM_HOSTS = 5


def load_testbed() -> ModuleType:
    """benchmarks/testbed.py as a module (benchmarks/ is not a package)."""
    path = REPO / "benchmarks" / "testbed.py"
    spec = importlib.util.spec_from_file_location("pskv_testbed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def testbed_module() -> ModuleType:
    return load_testbed()


@pytest.fixture(scope="module")
def bed(testbed_module: ModuleType) -> Iterator[object]:
    """A bed of NUM_HOSTS hosts, removed (and checked gone) after the module's tests."""
    tb = testbed_module
    reason = tb.missing()
    if reason is not None:
        pytest.skip(f"no multi-host bed here: {reason}")
    tb.sweep()  # beds of earlier runs that were killed before their teardown
    hb = tb.HostBed(NUM_HOSTS)
    try:
        hb.up()
    except tb.BedError as err:
        pytest.fail(f"the bed could not be made: {err}")
    try:
        yield hb
    finally:
        left = hb.down()
        assert left == [], f"the bed left behind {left}"
        names = [h.netns for h in hb.hosts] + [hb.switch]
        assert not set(names) & set(tb._netns_list())


@pytest.fixture
def need_mpirun() -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun here: apt-get install openmpi-bin")


@dataclass
class Job:
    """A pskv-launch running on h0; its output lines are collected as they come."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    readers: list[threading.Thread] = field(default_factory=list)

    def _read(self, pipe: io.TextIOBase) -> None:
        with pipe:
            for line in pipe:
                with self.cond:
                    self.lines.append(line.rstrip("\n"))
                    self.cond.notify_all()

    def wait_for(self, needle: str, count: int = 1, timeout: float = 60.0) -> list[str]:
        """Wait until `count` output lines contain `needle`; fail the test after `timeout`."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                hits = [line for line in self.lines if needle in line]
                if len(hits) >= count:
                    return hits
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reading()):
                    pytest.fail(f"waited {timeout:g} s for {count} lines with {needle!r}; "
                                "output:\n" + "\n".join(self.lines))
                self.cond.wait(min(left, 0.2))

    def _reading(self) -> bool:
        return any(t.is_alive() for t in self.readers)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the launcher to exit (kill its group after `timeout`): (status, output)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"pskv-launch did not exit within {timeout:g} s; output:\n"
                        + "\n".join(self.lines))
        for t in self.readers:
            t.join(10)
        return rc, "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture
def start_job(bed: object) -> Iterator[object]:
    """start_job(launch_args, command) -> Job: pskv-launch on h0, killed at teardown."""
    jobs: list[Job] = []

    def start(args: Sequence[str], command: Sequence[str],
              env: dict[str, str] | None = None) -> Job:
        argv = [PY, "-m", "pskv.launch", "--host-ip", bed.head.address,  # type: ignore
                "--env", f"PYTHONPATH:{SRC}", *args, *command]
        full_env = bed.env()  # type: ignore[attr-defined]
        full_env["PYTHONPATH"] = SRC
        full_env.update(env or {})
        proc = subprocess.Popen(bed.exec_argv(bed.head, argv),  # type: ignore[attr-defined]
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env=full_env,
                                cwd=str(REPO), start_new_session=True)
        job = Job(proc)
        assert proc.stdout is not None
        reader = threading.Thread(target=job._read, args=(proc.stdout,), daemon=True)
        reader.start()
        job.readers.append(reader)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()
    # every process a job started on a remote host has exited once its launcher is gone
    # (remote ones by heartbeat); only sshd itself may still run in the bed's namespaces
    tb = sys.modules["pskv_testbed"]
    sshd_pids = {h.sshd_pid for h in bed.hosts}  # type: ignore[attr-defined]
    end = time.monotonic() + 30
    while True:
        stray = {h.name: [p for p in _netns_pids(tb, h.netns) if p not in sshd_pids]
                 for h in bed.hosts}  # type: ignore[attr-defined]
        stray = {k: v for k, v in stray.items() if v}
        if not stray or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert stray == {}, "processes left on the bed's hosts: " + repr(
        {host: [_cmdline(p) for p in pids] for host, pids in stray.items()})


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: (gone)"


def _netns_pids(tb: ModuleType, ns: str) -> list[int]:
    done = tb._run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]
