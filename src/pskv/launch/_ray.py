"""The ray launcher: one Ray actor per process, each running its command as a subprocess.

``pskv-launch --launcher ray -n 2 -s 1 python train.py`` connects to the Ray cluster at
``RAY_ADDRESS`` or, when it is unset, starts a local one for the job and stops it after
(``pip install 'pskv[ray]'``). Every process of the job gets an actor that asks for no CPU
and is placed with Ray's SPREAD strategy, so the processes spread over the nodes. The
scheduler's actor reports its node's IP and a free port there, which become
``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT`` of every process (127.0.0.1 on a local Ray
started for the job, as under the local launcher). Each actor then runs its
command (``python -m pskv.server`` or the worker command) with ``subprocess``, and the
launcher polls them: output comes back prefixed (``[worker 1 on 10.0.0.5]``-style reports
on failure), the first process that exits non-zero stops the others, and the exit status
follows the other launchers. Arrays never travel through Ray: the processes talk over
pskv's own sockets, as under any launcher.

The nodes must have pskv and the command at the same paths (as for ssh); a local cluster
inherits this machine's environment.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence, TextIO

from .._ps.config import ENV_MAX_RESTARTS, ENV_RESTART, Role
from ..errors import ConfigError
from ._env import cluster_env, get_secret
from ._backoff import Backoff
from ._local import LOCAL_HOST
from ._spec import LaunchSpec, backed_up
from ._supervise import EXIT_TIMEOUT, LaunchResult, ProcessResult, exit_status

__all__ = ["LOCAL_OBJECT_STORE_BYTES", "ProcessActor", "RayJob", "run_ray"]

logger = logging.getLogger(__name__)

#: the object store of a local cluster: the job moves no arrays through Ray, so Ray's
#: minimum (75 MiB) and a little more
LOCAL_OBJECT_STORE_BYTES = 80 * 1024 * 1024
_POLL_S = 0.1
_INSTALL = "Install it with pip install 'pskv[ray]'."


class ProcessActor:
    """Runs one process of the job on a Ray node (wrapped with ``ray.remote`` at launch).

    Invariant: `stop` leaves no process of its group running; output lines wait in
    `_lines` until the launcher reads them.
    """

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._lines: list[tuple[bool, str]] = []
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []

    def where(self) -> tuple[str, str]:
        """This node's IP (as Ray knows it) and host name."""
        import ray
        util: Any = ray.util  # untyped
        return str(util.get_node_ip_address()), socket.gethostname()

    def free_port(self, loopback: bool = False) -> int:
        """A TCP port free on this node now (on 127.0.0.1 with `loopback`)."""
        from ._net import free_port
        return free_port(LOCAL_HOST if loopback else "0.0.0.0")

    def _pump(self, pipe: Any, is_stderr: bool) -> None:
        with pipe:
            for line in iter(lambda: pipe.readline(1 << 16), b""):
                text = line.decode("utf-8", "replace")
                with self._lock:
                    self._lines.append((is_stderr, text if text.endswith("\n")
                                        else text + "\n"))

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Start `argv` with `env` on top of the actor's environment; returns its pid."""
        full = dict(os.environ)
        full.setdefault("PYTHONUNBUFFERED", "1")
        full.update(env)
        try:
            self._popen = subprocess.Popen(list(argv), env=full, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           start_new_session=True, close_fds=True)
        except OSError as err:
            raise ConfigError(f"cannot start {argv[0]!r} on this Ray node: "
                              f"{err.strerror}. Check the command and PATH there.") from err
        for pipe, is_err in ((self._popen.stdout, False), (self._popen.stderr, True)):
            t = threading.Thread(target=self._pump, args=(pipe, is_err), daemon=True)
            t.start()
            self._pumps.append(t)
        return self._popen.pid

    def poll(self) -> tuple[int | None, list[tuple[bool, str]]]:
        """The return code (None while running) and the output lines since the last poll."""
        rc = None if self._popen is None else self._popen.poll()
        if rc is not None:
            for t in self._pumps:
                t.join(2.0)  # the last lines, written just before it exited
        with self._lock:
            lines, self._lines = self._lines, []
        return rc, lines

    def stop(self, sig: int, grace: float) -> int | None:
        """Signal the process group; SIGKILL after `grace` seconds; the return code."""
        p = self._popen
        if p is None:
            return None
        for s in (sig, signal.SIGKILL):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, s)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(p.pid, signal.SIGKILL)  # what outlived its leader
        except (ProcessLookupError, PermissionError):
            pass
        return p.wait()


class _Proc:
    """The launcher's view of one actor."""

    def __init__(self, role: Role, rank: int, actor: Any) -> None:
        self.role, self.rank, self.actor = role, rank, actor
        self.host: str | None = None
        self.pid = 0
        self.rc: int | None = None
        self.killed = False

    @property
    def label(self) -> str:
        return "scheduler" if self.role is Role.SCHEDULER else f"{self.role.value} {self.rank}"

    @property
    def where(self) -> str:
        return self.label if self.host is None else f"{self.label} on {self.host}"

    def result(self) -> ProcessResult:
        return ProcessResult(self.role, self.rank, self.pid, -9 if self.rc is None else self.rc,
                             self.killed, self.label, self.host)


class RayJob:
    """One job on a connected Ray: place the actors, start, watch, stop (see module doc)."""

    def __init__(self, ray: Any, spec: LaunchSpec, secret: str, stdout: TextIO,
                 stderr: TextIO, local: bool = False) -> None:
        self.ray, self.spec, self.secret, self.local = ray, spec, secret, local
        self.backed_up = backed_up(spec, {})
        self.restarts: dict[str, int] = {}
        #: restarts wait out a back-off (by label; ``_backoff.py``), as under supervise.py
        self.backoff = Backoff()
        self.root = ("", 0)
        self.stdout, self.stderr = stdout, stderr
        remote = ray.remote(num_cpus=0, scheduling_strategy="SPREAD", max_restarts=0)
        self.actor_class = remote(ProcessActor)
        self.procs: list[_Proc] = []

    def _new(self, role: Role, rank: int) -> _Proc:
        proc = _Proc(role, rank, self.actor_class.remote())
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        """Place every actor, learn the scheduler's address, start every process.

        All actors are created in one wave and all processes started together (the nodes
        wait for the scheduler themselves, as under the local launcher): each round trip
        through Ray costs an actor start or a call, so they overlap. On a local Ray
        started for this job (`local`) every process is on this machine and the job
        lives on 127.0.0.1, as under the local launcher; Ray's node address is the
        machine's external one, which would expose the job's ports to the network.
        """
        ray, spec = self.ray, self.spec
        sched = self._new(Role.SCHEDULER, 0)
        for i in range(spec.num_servers or 0):
            self._new(Role.SERVER, i)
        for i in range(spec.num_workers):
            self._new(Role.WORKER, i)
        port_ref = None if spec.port else sched.actor.free_port.remote(self.local)
        wheres = ray.get([p.actor.where.remote() for p in self.procs])
        for p, (node_ip, _host) in zip(self.procs, wheres, strict=True):
            p.host = LOCAL_HOST if self.local else str(node_ip)
        ip = sched.host
        port = spec.port or ray.get(port_ref)
        logger.info("scheduler at %s:%d; %d processes on %d Ray node(s)", ip, port,
                    len(self.procs), len({w[0] for w in wheres}))
        self.root = (str(ip), int(port))
        refs = [p.actor.start.remote(*self._argv_env(p)) for p in self.procs]
        for p, ref in zip(self.procs, refs, strict=True):
            try:
                p.pid = int(ray.get(ref))
                self.backoff.started(p.label)
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None) or err
                raise ConfigError(f"cannot start {p.where}: {cause}") from err

    def _argv_env(self, p: _Proc) -> tuple[list[str], dict[str, str]]:
        """The command and the variables of `p`'s process (its restart count included)."""
        spec = self.spec
        env = cluster_env(spec, p.role, root_uri=self.root[0], port=self.root[1],
                          secret=self.secret, rank=None if p.role is Role.SCHEDULER else p.rank)
        if spec.max_restarts:     # the scheduler waits for a dead node's replacement
            env[ENV_MAX_RESTARTS] = str(spec.max_restarts)
            env[ENV_RESTART] = str(self.restarts.get(p.label, 0))
        return list(spec.command if p.role is Role.WORKER else spec.server_command), env

    def _restart(self, p: _Proc, rc: int) -> bool:
        """Schedule a dead worker or server to start again in its actor (same rank, same
        command) after its back-off if it has restarts left (--max-restarts); whether it
        did."""
        used = self.restarts.get(p.label, 0)
        if p.role is Role.SCHEDULER or used >= self.spec.max_restarts:
            return False
        self.restarts[p.label] = used + 1
        delay = self.backoff.schedule(p.label)
        logger.warning("%s (pid %d) exited with status %d; restarting it in %.3g s (%d of %d)",
                       p.where, p.pid, exit_status(rc), delay, used + 1,
                       self.spec.max_restarts)
        return True

    def _respawn(self, p: _Proc) -> bool:
        """Start ``p`` again in its actor, its back-off over; whether it started."""
        self.backoff.started(p.label)
        try:
            self.ray.get(p.actor.stop.remote(int(signal.SIGKILL), 0.0), timeout=30)
            p.pid = int(self.ray.get(p.actor.start.remote(*self._argv_env(p)), timeout=60))
        except Exception as err:  # the actor or its node is gone: the death stands
            logger.error("cannot restart %s: %s", p.where, err)
            return False
        p.rc = None
        return True

    def _taken_over(self, p: _Proc, rc: int, survived: set[int]) -> bool:
        """Whether the job goes on without the dead `p`: a server, with backups on
        (PSKV_REPLICAS=1), while another server lives to serve its shard (as supervise.py)."""
        if not self.backed_up or p.role is not Role.SERVER:
            return False
        servers = [q for q in self.procs if q.role is Role.SERVER]
        if not any(q.rc is None for q in servers if q is not p):
            return False
        logger.warning("%s (pid %d) exited with status %d; its backup serves its shard "
                       "(PSKV_REPLICAS=1), so the job goes on with %d of %d servers",
                       p.where, p.pid, exit_status(rc), len(servers) - len(survived) - 1,
                       len(servers))
        return True

    def _print(self, p: _Proc, lines: list[tuple[bool, str]]) -> None:
        for is_err, text in lines:
            stream = self.stderr if is_err else self.stdout
            stream.write(f"[{p.label}] {text}")
        if lines:
            self.stdout.flush()
            self.stderr.flush()

    def _poll_all(self) -> None:
        running = [p for p in self.procs if p.rc is None]
        try:
            answers = self.ray.get([p.actor.poll.remote() for p in running])
        except self.ray.exceptions.RayActorError as err:
            # an actor died (its node was lost): find which, fail it
            for p in running:
                try:
                    self.ray.get(p.actor.poll.remote())
                except self.ray.exceptions.RayActorError:
                    logger.error("the Ray actor of %s died: %s", p.where, err)
                    p.rc = 1
            return
        for p, (rc, lines) in zip(running, answers, strict=True):
            self._print(p, lines)
            p.rc = rc

    def stop(self, procs: Sequence[_Proc], sig: int = signal.SIGTERM) -> None:
        """Stop `procs` (grace_period, then SIGKILL) and record their return codes."""
        running = [p for p in procs if p.rc is None]
        refs = [p.actor.stop.remote(int(sig), self.spec.grace_period) for p in running]
        for p, ref in zip(running, refs, strict=True):
            p.killed = True
            try:
                p.rc = self.ray.get(ref, timeout=self.spec.grace_period + 30)
            except Exception as err:  # a dead actor or node: its process went with it
                logger.warning("cannot stop %s: %s", p.where, err)
                p.rc = -int(signal.SIGKILL)
            try:
                _, lines = self.ray.get(p.actor.poll.remote(), timeout=10)
                self._print(p, lines)
            except Exception:  # the actor is gone; so is its output
                logger.debug("no last output from %s", p.where)

    def watch(self) -> LaunchResult:
        """Poll until the job ends; the same rules as the other launchers (supervise.py)."""
        spec = self.spec
        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        shutdown_deadline: float | None = None
        workers = [p for p in self.procs if p.role is Role.WORKER]
        survived: set[int] = set()     # dead servers whose shards a backup took over
        while True:
            self._poll_all()
            for p in self.procs:
                if p.rc is None or p.rc == 0 or shutdown_deadline is not None \
                        or id(p) in survived:
                    continue
                if self.backoff.waiting(p.label):
                    if not self.backoff.due(p.label) or self._respawn(p):
                        continue
                elif self._restart(p, p.rc):
                    continue
                if self._taken_over(p, p.rc, survived):
                    survived.add(id(p))
                    continue
                logger.error("%s (pid %d) exited with status %d; stopping the others",
                             p.where, p.pid, exit_status(p.rc))
                self.stop(self.procs)
                return self._result(exit_status(p.rc), p, "failed")
            now = time.monotonic()
            if shutdown_deadline is None and all(p.rc == 0 for p in workers):
                shutdown_deadline = now + spec.shutdown_timeout
                if deadline is not None:
                    shutdown_deadline = min(shutdown_deadline, deadline)
            if all(p.rc is not None for p in self.procs) and not self.backoff.pending:
                return self._result(0, None, "ok")
            if shutdown_deadline is not None and now >= shutdown_deadline:
                self.stop(self.procs)
                return self._result(0, None, "ok")
            if deadline is not None and now >= deadline:
                logger.error("timed out after %.3g s; still running: %s. Stopping them.",
                             spec.timeout, ", ".join(p.where for p in self.procs
                                                     if p.rc is None))
                self.stop(self.procs)
                return self._result(EXIT_TIMEOUT, None, "timeout")
            time.sleep(_POLL_S)

    def _result(self, code: int, failed: _Proc | None, reason: str) -> LaunchResult:
        results = {id(p): p.result() for p in self.procs}
        return LaunchResult(code, tuple(results[id(p)] for p in self.procs),
                            None if failed is None else results[id(failed)], reason)

    def kill_actors(self) -> None:
        for p in self.procs:
            try:
                self.ray.kill(p.actor)
            except Exception:  # already gone
                logger.debug("actor of %s already gone", p.where)


def _connect(ray: Any, environ: Mapping[str, str]) -> bool:
    """Connect to RAY_ADDRESS, else start a local cluster; True when it was started here."""
    address = environ.get("RAY_ADDRESS")
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    try:
        if address:
            ray.init(address=address, **quiet)
            return False
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "a local Ray"
        raise ConfigError(f"cannot connect to {where}: {err}. Check that ray status works "
                          "there, or unset RAY_ADDRESS to start a local one.") from err
    return True


def run_ray(spec: LaunchSpec, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
            environ: Mapping[str, str] | None = None, ray_module: Any = None) -> LaunchResult:
    """Run the job on Ray until it ends (see the module doc); `ray_module` is for tests."""
    env = os.environ if environ is None else environ
    if ray_module is None:
        try:
            import ray as ray_module
        except ImportError:
            raise ConfigError(f"--launcher ray needs Ray. {_INSTALL}") from None
    ray = ray_module
    started_here = _connect(ray, env)
    job = RayJob(ray, spec, get_secret(spec, env), sys.stdout if stdout is None else stdout,
                 sys.stderr if stderr is None else stderr, local=started_here)
    try:
        try:
            job.start()
        except ConfigError:
            job.stop(job.procs)
            raise
        return job.watch()
    except KeyboardInterrupt:
        logger.warning("got SIGINT; stopping all %d processes", len(job.procs))
        job.stop(job.procs, signal.SIGINT)
        return job._result(130, None, "signal")
    finally:
        job.kill_actors()
        ray.shutdown()
        if started_here:
            logger.debug("stopped the local Ray cluster")
