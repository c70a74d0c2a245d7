"""Clusters for the distributed tests: whole clusters as threads, or as real processes.

* :class:`ThreadCluster` runs the scheduler and the servers (``run_node``) and each worker
  (``DistKVStore``) as threads of the test process, built from one ``ClusterConfig``: fast
  and deterministic, and possible because pskv has no process-wide state.
* the ``local_cluster`` fixture starts real processes (``python -m pskv.server`` for the
  scheduler and servers, a script from ``tests/dist/scripts`` for the workers), each in its
  own process group, with a port from the OS. At teardown it fails the test if any process
  is still running, then kills every process group.

Everything listens on 127.0.0.1 only, and every wait is bounded.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import pytest

from pskv.launch._net import free_port
from pskv._ps.config import (ENV_HEARTBEAT_INTERVAL, ENV_HEARTBEAT_TIMEOUT, ENV_NUM_SERVER,
                             ENV_NUM_WORKER, ENV_REQUEST_TIMEOUT, ENV_ROLE, ENV_ROOT_PORT,
                             ENV_ROOT_URI, ENV_SECRET, ENV_SHUTDOWN_TIMEOUT, ClusterConfig,
                             Role)

PY = sys.executable
SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


# ---- thread clusters ----------------------------------------------------------------------
@dataclass
class ThreadCluster:
    """A scheduler, servers and workers as threads of this process.

    ``run(fn)`` creates one store per worker, calls ``fn(kv)`` on each (in its own thread),
    closes the stores and returns ``{rank: result or exception}``; then ``join()`` waits for
    the scheduler and servers to exit by themselves and returns their exit codes.
    """

    num_workers: int = 2
    num_servers: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        settings: dict[str, Any] = dict(
            role=Role.WORKER, root_port=free_port(), num_servers=self.num_servers,
            num_workers=self.num_workers, secret=b"thread-cluster-secret",
            heartbeat_interval=0.2, heartbeat_timeout=3.0, request_timeout=10.0,
            connect_timeout=10.0, shutdown_timeout=10.0)
        settings.update(self.overrides)
        self.cfg = ClusterConfig(**settings)
        self.codes: dict[str, int | BaseException] = {}
        self._nodes: list[threading.Thread] = []
        self.stop = threading.Event()

    def start(self) -> ThreadCluster:
        """Start the scheduler and the servers."""
        from pskv.server import run_node

        def node(role: Role, name: str) -> None:
            try:
                self.codes[name] = run_node(self.cfg.with_role(role), self.stop)
            except BaseException as err:  # noqa: BLE001 - reported by join()
                self.codes[name] = err

        names = [(Role.SCHEDULER, "scheduler")] + [
            (Role.SERVER, f"server {i}") for i in range(self.num_servers)]
        for role, name in names:
            t = threading.Thread(target=node, args=(role, name), name=f"test-{name}",
                                 daemon=True)
            t.start()
            self._nodes.append(t)
        return self

    def worker_config(self, **changes: Any) -> ClusterConfig:
        return replace(self.cfg, **changes)

    def run(self, fn: Callable[..., Any], store_type: str = "dist_sync", timeout: float = 30.0,
            configs: Sequence[ClusterConfig] | None = None) -> dict[int, Any]:
        """Run ``fn(kv)`` on every worker; results (or exceptions) by rank."""
        from pskv.kvstore.dist import DistKVStore
        results: dict[int, Any] = {}
        failures: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                cfg = configs[i] if configs is not None else self.cfg
                kv = DistKVStore(store_type, cfg)
            except BaseException as err:  # noqa: BLE001
                failures.append(err)
                return
            try:
                results[kv.rank] = fn(kv)
            except BaseException as err:  # noqa: BLE001 - the test inspects it
                results[kv.rank] = err
            finally:
                kv.close()

        threads = [threading.Thread(target=worker, args=(i,), name=f"test-worker-{i}",
                                    daemon=True) for i in range(self.num_workers)]
        for t in threads:
            t.start()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.stop.set()
            pytest.fail(f"workers {stuck} did not finish within {timeout} s")
        if failures:
            raise failures[0]
        return results

    def join(self, timeout: float = 15.0) -> dict[str, int | BaseException]:
        """Wait for the scheduler and servers to exit by themselves; their exit codes."""
        end = time.monotonic() + timeout
        for t in self._nodes:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in self._nodes if t.is_alive()]
        if stuck:
            self.stop.set()
            for t in self._nodes:
                t.join(5)
            pytest.fail(f"{stuck} did not exit within {timeout} s after the workers closed")
        return dict(self.codes)

    def shutdown(self) -> None:
        """Stop whatever is still running (teardown)."""
        self.stop.set()
        for t in self._nodes:
            t.join(5)


def run_threads(fn: Callable[..., Any], num_workers: int = 2, num_servers: int = 1,
                store_type: str = "dist_sync", expect_codes: int | None = 0,
                timeout: float = 30.0, **overrides: Any) -> dict[int, Any]:
    """One whole thread cluster running ``fn`` on every worker; results by rank.

    Worker exceptions are returned, not raised; with ``expect_codes`` the scheduler's and
    every server's exit status is checked. ``timeout``: how long the workers may run.
    """
    cluster = ThreadCluster(num_workers, num_servers, overrides).start()
    try:
        results = cluster.run(fn, store_type, timeout)
        codes = cluster.join()
    finally:
        cluster.shutdown()
    if expect_codes is not None:
        assert codes == {name: expect_codes for name in codes}, codes
    return results


@pytest.fixture(name="run_threads")
def run_threads_fixture() -> Callable[..., dict[int, Any]]:
    """:func:`run_threads`, for tests (conftest modules are not imported by tests)."""
    return run_threads


@pytest.fixture
def thread_cluster() -> Iterator[Callable[..., ThreadCluster]]:
    """Make started ThreadClusters; each is stopped at teardown."""
    made: list[ThreadCluster] = []

    def make(num_workers: int = 2, num_servers: int = 1, **overrides: Any) -> ThreadCluster:
        cluster = ThreadCluster(num_workers, num_servers, overrides).start()
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.shutdown()


# ---- process clusters ---------------------------------------------------------------------
#: small heartbeat settings so failures are noticed within seconds
FAST_ENV = {
    ENV_HEARTBEAT_INTERVAL: "0.2", ENV_HEARTBEAT_TIMEOUT: "2", ENV_REQUEST_TIMEOUT: "15",
    ENV_SHUTDOWN_TIMEOUT: "10", "PSKV_CONNECT_TIMEOUT": "20",
}


@dataclass
class Proc:
    """One process of a local cluster; its output goes to ``log`` (stdout and stderr)."""

    label: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def reports(self) -> list[dict[str, Any]]:
        """The JSON objects the process printed, one per line starting with ``{``."""
        out = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_for(self, text: str, timeout: float) -> None:
        """Wait until ``text`` appears in the output (fail if it exits or time runs out)."""
        end = time.monotonic() + timeout
        while text not in self.output():
            if self.popen.poll() is not None and text not in self.output():
                pytest.fail(f"{self.label} exited ({self.popen.returncode}) before printing "
                            f"{text!r}:\n{self.output()}")
            if time.monotonic() > end:
                pytest.fail(f"{self.label} did not print {text!r} within {timeout} s:\n"
                            f"{self.output()}")
            time.sleep(0.02)

    def kill(self) -> None:
        _killpg(self.popen)
        self.popen.wait(5)


def _killpg(popen: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalCluster:
    """A scheduler, servers and workers as real processes on 127.0.0.1."""

    def __init__(self, tmp: Path, num_workers: int, num_servers: int,
                 env: Mapping[str, str] | None = None) -> None:
        self.tmp = tmp
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.port = free_port()
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("DMLC_", "PSKV_", "MXNET_"))}
        base.update({ENV_ROOT_URI: "127.0.0.1", ENV_ROOT_PORT: str(self.port),
                     ENV_NUM_SERVER: str(num_servers), ENV_NUM_WORKER: str(num_workers),
                     ENV_SECRET: "local-cluster-secret", "PYTHONUNBUFFERED": "1",
                     "OMP_NUM_THREADS": "1", **FAST_ENV})
        base.update(env or {})
        self.env = base
        self.procs: list[Proc] = []

    def spawn(self, label: str, argv: Sequence[str], role: str,
              env: Mapping[str, str] | None = None) -> Proc:
        """Start one process in its own process group."""
        log = self.tmp / f"{label.replace(' ', '-')}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(list(argv), env={**self.env, ENV_ROLE: role, **(env or {})},
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=REPO)
        proc = Proc(label, popen, log)
        self.procs.append(proc)
        return proc

    def start(self, script: str, *args: str, worker_env: Mapping[str, str] | None = None
              ) -> LocalCluster:
        """Scheduler and servers (``python -m pskv.server``), then workers running ``script``."""
        server = [PY, "-m", "pskv.server"]
        self.spawn("scheduler", server, "scheduler")
        for i in range(self.num_servers):
            self.spawn(f"server {i}", server, "server")
        for i in range(self.num_workers):
            self.spawn(f"worker {i}", [PY, str(SCRIPTS / script), *args], "worker", worker_env)
        return self

    def get(self, label: str) -> Proc:
        return next(p for p in self.procs if p.label == label)

    @property
    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.label.startswith("worker")]

    def worker_by_rank(self, rank: int) -> Proc:
        """The worker process that reported ``{"rank": rank, ...}`` (ranks follow arrival)."""
        for p in self.workers:
            if any(r.get("rank") == rank for r in p.reports()):
                return p
        pytest.fail(f"no worker reported rank {rank}:\n{self.dump()}")

    def server_by_rank(self, rank: int, endpoints: Sequence[Mapping[str, str]]) -> Proc:
        """The server process of ``rank``, found by who listens on its tcp endpoint.

        Ranks follow arrival at the scheduler, so the process started as "server 0" need not
        be rank 0; ``endpoints`` is the server table a worker got (``kv._po.servers``).
        """
        port = int(endpoints[rank]["tcp"].rsplit(":", 1)[1])
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
        for p in self.procs:
            if not p.label.startswith("server"):
                continue
            try:
                fds = list(Path(f"/proc/{p.pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(fd) in inodes:
                        return p
                except OSError:
                    continue
        pytest.fail(f"no server process listens on port {port} (rank {rank})")

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait for every process to exit by itself; exit codes by label."""
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.popen.wait(max(0.01, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{p.label} did not exit within {timeout} s:\n{self.dump()}")
        return {p.label: p.popen.returncode for p in self.procs}

    def dump(self) -> str:
        return "\n".join(f"--- {p.label} (rc={p.popen.poll()})\n{p.output()}"
                         for p in self.procs)

    def teardown(self) -> list[str]:
        """Kill every process group; the labels of processes that were still running."""
        left = [p.label for p in self.procs if p.popen.poll() is None]
        for p in self.procs:
            _killpg(p.popen)
        for p in self.procs:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                left.append(f"{p.label} (unkillable)")
        return left


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Make process clusters: ``local_cluster(num_workers, num_servers, env=...)``.

    Use ``.start(script, *args)`` then ``.wait(timeout)``. At teardown every process group
    is killed, and the test fails if any process was still running.
    """
    made: list[LocalCluster] = []

    def make(num_workers: int = 2, num_servers: int = 1,
             env: Mapping[str, str] | None = None) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster{len(made)}", num_workers, num_servers, env)
        cluster.tmp.mkdir()
        made.append(cluster)
        return cluster

    yield make
    leftovers: list[str] = []
    dumps = []
    for cluster in made:
        left = cluster.teardown()
        if left:
            leftovers += left
            dumps.append(cluster.dump())
    if leftovers:
        pytest.fail(f"processes left behind: {leftovers}\n" + "\n".join(dumps))
