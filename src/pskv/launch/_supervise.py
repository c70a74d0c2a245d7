"""The supervisor that every launcher's processes run under.

It starts each process in its own process group, prefixes its output (``_output.py``),
stops every process at the first failure (but a server whose shard a backup took over),
forwards signals, and reports how each process ended.

Invariant: every child runs in its own session (so its process group id is its pid), and
when `run_processes` returns, every child has been reaped and every child's process group
has been sent SIGKILL: nothing the job started is left behind.

Over 500 lines because supervising a job (start, watch, restart with back-off, stop every
process group) is one state machine over the same process table.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import IO, Callable, Sequence, TextIO

from .._ps.config import (ENV_JOIN_STATUS, ENV_MAX_RESTARTS, ENV_RESTART, Role,
                          replicas_setting)
from ..errors import CommandError, ConfigError  # CommandError: re-exported here too
from ._backoff import Backoff
from ._control import ControlSocket, Requests
from ._output import Console, Output
from ._slots import Slot
from ._spec import ProcessSpec

__all__ = ["CommandError", "EXIT_TIMEOUT", "LaunchResult", "ProcessResult", "exit_status", "run_processes"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_JOIN_S = 5.0
EXIT_TIMEOUT = 124  # as coreutils timeout(1)
#: the job's status when a worker exited 0 without ever joining the cluster
EXIT_NOT_JOINED = 1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: what a child gets when the launcher dies (SIGKILL of the launcher included): SIGTERM, so
#: that pskv's scheduler and servers can still remove their socket files
DEATH_SIGNAL = signal.SIGTERM


def _die_with_launcher() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get DEATH_SIGNAL when the launcher dies (Linux).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child dies, so children are
    forked by the thread that then supervises them until they are reaped (run()).
    None where prctl is not available: there the job outlives a SIGKILLed launcher.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    launcher = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os.kill(os.getpid(), DEATH_SIGNAL)

    return preexec


@dataclass(frozen=True, slots=True)
class ProcessResult:
    """How one process of the job ended.

    Attributes
    ----------
    role : Role
    rank : int or None
        Launch order within the role (None for an ``mpirun`` of a whole role).
    pid : int
    returncode : int
        As `subprocess.Popen.returncode`: negative for a signal.
    killed : bool
        True when the launcher had to signal it (a failure elsewhere, a timeout, a signal
        to the launcher, or it did not exit after the workers finished).
    label : str
        ``scheduler``, ``server 0``, ``worker 1``: its output prefix.
    host : str or None
        The host it ran on when that is not this machine and is known (ssh, slurm,
        kubernetes, ray). For kubernetes, `pid` is 0: a pod's process has no pid here.
    """

    role: Role
    rank: int | None
    pid: int
    returncode: int
    killed: bool
    label: str
    host: str | None = None


@dataclass(frozen=True, slots=True)
class LaunchResult:
    """How a job ended: the launcher's exit status and each process's.

    Attributes
    ----------
    returncode : int
        0 when every worker exited 0 (and the scheduler and servers did not fail); else
        the first failing process's status (128 + N for signal N), 124 after ``timeout``,
        130 or 143 after SIGINT or SIGTERM to the launcher.
    processes : tuple of ProcessResult
        In launch order: scheduler, servers, workers.
    failed : ProcessResult or None
        The first process that exited non-zero on its own, or the worker that exited 0
        without joining the cluster (``reason`` ``'not joined'``).
    reason : str
        ``'ok'``, ``'failed'``, ``'timeout'``, ``'signal'`` or ``'not joined'`` (a worker
        exited 0 without joining while the others waited for it, e.g. it made a
        ``'local'`` store: the job's status is 1).
    """

    returncode: int
    processes: tuple[ProcessResult, ...]
    failed: ProcessResult | None = None
    reason: str = "ok"

    @property
    def killed(self) -> tuple[ProcessResult, ...]:
        """The processes the launcher had to stop."""
        return tuple(p for p in self.processes if p.killed)

    @property
    def ok(self) -> bool:
        """Whether the job succeeded (``returncode == 0``)."""
        return self.returncode == 0


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status: signal N becomes 128 + N.

    Examples
    --------
    >>> exit_status(3), exit_status(-9)
    (3, 137)
    """
    return 128 - returncode if returncode < 0 else returncode


class _Child:
    """A started process, its output pumps, and whether the launcher signalled it."""

    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen[bytes],
                 pumps: list[threading.Thread]) -> None:
        self.spec = spec
        self.popen = popen
        self.pumps = pumps
        self.killed = False

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        # pgid == pid (start_new_session); a group whose members all exited is gone
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def result(self) -> ProcessResult:
        rc = self.popen.returncode
        assert rc is not None, "results are read after every child was reaped"
        return ProcessResult(self.spec.role, self.spec.rank, self.popen.pid, rc, self.killed,
                             self.spec.label, self.spec.host)


class _Supervisor:
    """Runs a list of processes to completion under the launcher's rules (see launch())."""

    def __init__(self, procs: Sequence[ProcessSpec], *, timeout: float | None,
                 grace_period: float, shutdown_timeout: float, stdout: TextIO,
                 stderr: TextIO, log_dir: str | None = None, max_restarts: int = 0,
                 backed_up: bool = False, check_joined: bool = False,
                 control: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.procs = list(procs)
        #: the control socket's path (--control; ``_control.py``), and its requests, which
        #: the watch loop answers: servers sent SIGUSR1 (by label) until they exit, those
        #: that exited 0 after it (not restarted, not a failure), and how often each
        #: retired server was started again (add-server)
        self.control = control
        self.wake = threading.Event()
        self.requests = Requests(self.wake)
        self.retiring: set[str] = set()
        self.retired: set[str] = set()
        self.rejoins: dict[str, int] = {}
        #: why the job takes no add or remove any more (its workers have finished)
        self.ending_why: str | None = None
        #: the file the scheduler writes how far the job joined to (PSKV_JOIN_STATUS), in
        #: a directory of this run's own; None: not checked (the scheduler runs elsewhere)
        self.check_joined = check_joined
        self.joined: str | None = None
        #: workers that exited 0 before the job joined (a 'local' store, or no store)
        self.unjoined: list[_Child] = []
        self.max_restarts = max_restarts
        self.backed_up = backed_up
        self.restarts: dict[str, int] = {}
        #: restarts wait out a back-off (by label); the watch loop starts them when due
        self.backoff = Backoff(clock)
        self.timeout = timeout
        self.grace_period = grace_period
        self.shutdown_timeout = shutdown_timeout
        self.stdout, self.stderr = stdout, stderr
        self.lock = threading.Lock()
        #: every child's output shares it: whose partial line is on the console
        self.console = Console(self.lock)
        self.children: list[_Child] = []
        self.signum: int | None = None
        self.signals = 0
        self.preexec = _die_with_launcher()
        self.interrupted = threading.Event()
        self.log_dir = log_dir
        self.logs: list[IO[str]] = []

    # -- signals --------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.signals += 1
        self.wake.set()

    def _install(self) -> dict[int, Callable[..., object] | int | None]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; the caller handles signals
        return {sig: signal.signal(sig, self._on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM)}

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, ps: ProcessSpec) -> _Child:
        env = dict(os.environ)
        # Python children print through a pipe: unbuffered, their lines come out as written
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(ps.env)
        if ps.role is Role.SCHEDULER and self.joined is not None:
            env[ENV_JOIN_STATUS] = self.joined
        # every start after the first counts, restarts and add-server's alike
        count = self.restarts.get(ps.label, 0) + self.rejoins.get(ps.label, 0)
        if self.max_restarts or count:  # the scheduler waits for a dead node's replacement
            env[ENV_MAX_RESTARTS] = str(max(self.max_restarts, 1))
            env[ENV_RESTART] = str(count)
        try:
            popen = subprocess.Popen(
                list(ps.argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL if ps.stdin is None else subprocess.PIPE,
                start_new_session=True, close_fds=True, preexec_fn=self.preexec)
        except OSError as err:
            raise CommandError(f"cannot start {ps.label}: {ps.argv[0]!r}: {err.strerror}. "
                              "Check the command and PATH.") from err
        if ps.stdin is not None:
            assert popen.stdin is not None
            try:
                popen.stdin.write(ps.stdin)
            except BrokenPipeError:
                pass  # it exited already; its status tells why
            finally:
                try:
                    popen.stdin.close()
                except BrokenPipeError:
                    pass
        log = None
        if self.log_dir is not None:
            log = open(os.path.join(self.log_dir, ps.label.replace(" ", "-") + ".log"), "w",
                       encoding="utf-8")
            self.logs.append(log)
        out = Output(f"[{ps.label}] ", self.console, self.interrupted, log)
        pumps = []
        for pipe, stream in ((popen.stdout, self.stdout), (popen.stderr, self.stderr)):
            assert pipe is not None
            t = threading.Thread(target=out.pump, args=(pipe, stream, stream is self.stderr),
                                 name=f"pskv-launch {ps.label}", daemon=True)
            t.start()
            pumps.append(t)
        logger.debug("started %s (pid %d): %s", ps.label, popen.pid, ps.argv)
        self.backoff.started(ps.label)
        return _Child(ps, popen, pumps)

    def _restart(self, child: _Child, rc: int) -> bool:
        """Schedule a dead worker or server to start again (same rank, same command) after
        its back-off (``_backoff.py``) if it has restarts left (--max-restarts); whether
        it did."""
        ps = child.spec
        used = self.restarts.get(ps.label, 0)
        if ps.role is Role.SCHEDULER or ps.rank is None or used >= self.max_restarts:
            return False
        if self._scheduler_gone():
            return False
        self.restarts[ps.label] = used + 1
        delay = self.backoff.schedule(ps.label)
        logger.warning("%s (pid %d) exited with status %d; restarting it in %.3g s (%d of %d)",
                       ps.label, child.popen.pid, exit_status(rc), delay, used + 1,
                       self.max_restarts)
        child.signal_group(signal.SIGKILL)    # whatever it left behind in its group
        return True

    def _scheduler_gone(self) -> bool:
        # the job is over once its scheduler exited (a failed job's ends cleanly): a
        # restart would only wait out its connect timeout for a scheduler that is gone
        return any(c.spec.role is Role.SCHEDULER and not c.running for c in self.children)

    def _workers_succeeded(self) -> bool:
        """Whether every worker has exited 0 (none running, none waiting for a restart)."""
        workers = [c for c in self.children if c.spec.role is Role.WORKER]
        return bool(workers) and all(c.popen.poll() == 0 and not self._waiting(c)
                                     for c in workers)

    def _waiting(self, child: _Child) -> bool:
        """Whether ``child`` is dead and waiting out its back-off before a restart."""
        return self.backoff.waiting(child.spec.label)

    def _taken_over(self, child: _Child, rc: int, survived: set[_Child]) -> bool:
        """Whether the job goes on without the dead `child`: a server, with backups on
        (PSKV_REPLICAS=1), while another server lives to serve its shard. The workers
        decide the rest: a round whose shard both holders lost fails there, with a
        NodeFailedError naming them, and that worker's exit ends the job."""
        if not self.backed_up or child.spec.role is not Role.SERVER:
            return False
        servers = [c for c in self.children if c.spec.role is Role.SERVER]
        if not any(c.running for c in servers if c is not child):
            return False
        logger.warning("%s (pid %d) exited with status %d; its backup serves its shard "
                       "(PSKV_REPLICAS=1), so the job goes on with %d of %d servers",
                       child.spec.where, child.popen.pid, exit_status(rc),
                       len(servers) - len(survived) - len(self.retired) - 1, len(servers))
        return True

    # -- the control channel (``_control.Slots``; called in the watch loop) ----------------
    def _servers(self) -> dict[int, _Child]:
        return {c.spec.rank: c for c in self.children
                if c.spec.role is Role.SERVER and c.spec.rank is not None}

    def _slot(self, child: _Child) -> Slot:
        label, rc = child.spec.label, child.popen.poll()
        if label in self.retired or (label in self.retiring and rc == 0):
            state = "retired"
        elif rc is None:
            state = "retiring" if label in self.retiring else "running"
        else:
            state = "restarting" if self._waiting(child) else "exited"
        assert child.spec.rank is not None, "only ranked servers are slots"
        return Slot(child.spec.rank, state, child.popen.pid, rc)

    def slots(self) -> list[Slot]:
        return [self._slot(c) for _, c in sorted(self._servers().items())]

    def replicated(self) -> bool:
        def on(ps: ProcessSpec) -> bool:
            try:    # the environment _spawn gives the server, read as the server reads it
                return replicas_setting({**os.environ, **dict(ps.env)}) == 1
            except ConfigError:
                return False
        servers = self._servers().values()
        return bool(servers) and all(on(c.spec) for c in servers)

    def ending(self) -> str | None:
        if self.ending_why is None and self._scheduler_gone():
            return "its scheduler has exited"
        return self.ending_why

    def retire(self, server: int) -> Slot:
        """SIGUSR1 to the server's process (not its group: the server retires itself).

        Under slurm the process is the server's ``srun``, which forwards the signal to the
        server, its step's task (docs/slurm.md, "Adding and removing servers")."""
        child = self._servers()[server]
        self.retiring.add(child.spec.label)
        logger.info("retiring %s (pid %d): sent SIGUSR1 (control channel)", child.spec.label,
                    child.popen.pid)
        try:
            os.kill(child.popen.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass     # it has just exited: the watch loop reports how
        return self._slot(child)

    def rejoin(self, server: int) -> Slot:
        """Start a retired server's command again, as its next restart."""
        child = self._servers()[server]
        label = child.spec.label
        self.rejoins[label] = self.rejoins.get(label, 0) + 1
        new = self._spawn(child.spec)
        self.retired.discard(label)
        self.retiring.discard(label)
        self.children[self.children.index(child)] = new
        logger.info("adding %s back (pid %d, %s=%d; control channel)", label, new.popen.pid,
                    ENV_RESTART, self.restarts.get(label, 0) + self.rejoins[label])
        return self._slot(new)

    def _retiring_ended(self, child: _Child, rc: int) -> None:
        """A server sent SIGUSR1 exited: retired with status 0, else a death like any."""
        label = child.spec.label
        self.retiring.discard(label)
        if rc == 0:
            self.retired.add(label)
            logger.info("%s (pid %d) retired: its backup serves its shard; add-server %d "
                        "starts it again", child.spec.where, child.popen.pid, child.spec.rank)
        else:
            logger.warning("%s (pid %d) exited with status %d while retiring", child.spec.where,
                           child.popen.pid, exit_status(rc))

    def _running(self) -> list[_Child]:
        return [c for c in self.children if c.running]

    def _stop(self, children: Sequence[_Child], sig: int = signal.SIGTERM) -> None:
        """Signal `children`, give them grace_period, then SIGKILL; all are reaped after."""
        running = [c for c in children if c.running]
        for c in running:
            c.killed = True
            c.signal_group(sig)
        end = time.monotonic() + self.grace_period
        seen = self.signals
        while any(c.running for c in running) and time.monotonic() < end:
            if self.signals > seen:
                break  # a second Ctrl-C: do not wait out the grace period
            self.wake.wait(_POLL_S)
            self.wake.clear()
        for c in running:
            if c.running:
                logger.warning("%s (pid %d) did not exit %.3g s after signal %d; killing it",
                               c.spec.label, c.popen.pid, self.grace_period, sig)
                c.signal_group(signal.SIGKILL)
        for c in running:
            c.popen.wait()  # SIGKILL cannot be refused

    def _finish(self) -> None:
        """Reap everything, kill whatever is left in each process group, drain output."""
        self._stop(self.children, signal.SIGKILL)
        for c in self.children:
            c.signal_group(signal.SIGKILL)  # grandchildren that outlived their parent
        end = time.monotonic() + _JOIN_S
        for c in self.children:
            for t in c.pumps:
                t.join(max(0.0, end - time.monotonic()))
        with self.lock:
            for log in self.logs:
                log.close()
        if self.joined is not None:
            shutil.rmtree(os.path.dirname(self.joined), ignore_errors=True)

    def _join_status(self) -> str:
        """What the scheduler last wrote (``waiting``, ``joined``), or ``''``."""
        try:
            with open(str(self.joined), encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    def _abandoned(self) -> _Child | None:
        """A worker that exited 0 before the job joined while the scheduler, still
        running, has other workers waiting for it (they would wait out their connect
        timeout); None if there is none. Workers that all exit without ever saying HELLO
        (``pskv-launch hostname``) are no such case."""
        if self.joined is None:
            return None
        status = self._join_status()    # read before the exits: "joined" precedes ADMIT
        for c in self.children:
            if c.spec.role is Role.WORKER and c not in self.unjoined \
                    and c.popen.poll() == 0 and status != "joined":
                self.unjoined.append(c)
        if self.unjoined and status == "waiting" and any(
                c.spec.role is Role.SCHEDULER and c.running for c in self.children):
            return self.unjoined[0]
        return None

    def run(self) -> LaunchResult:
        if self.log_dir is not None:
            try:
                os.makedirs(self.log_dir, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"cannot create --log-dir {self.log_dir!r}: {err.strerror}. "
                                  "Pass a directory you can write.") from err
        control = None
        if self.control is not None:    # before anything starts: ConfigError for a bad PATH
            control = ControlSocket(self.control, self.requests.submit)
            control.open()
        try:
            previous = self._install()
            try:
                try:
                    if self.check_joined:
                        self.joined = os.path.join(tempfile.mkdtemp(prefix="pskv-launch-"),
                                                   "joined")
                    for ps in self.procs:
                        if self.signum is not None:
                            break
                        self.children.append(self._spawn(ps))
                    reason, failed = self._watch()
                finally:
                    self.requests.close("the job has ended")
                    self._finish()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        finally:
            if control is not None:
                control.close()
        results = {id(c): c.result() for c in self.children}
        first = results[id(failed)] if failed is not None else None
        if reason == "signal":
            assert self.signum is not None
            code = 128 + self.signum
        elif reason == "timeout":
            code = EXIT_TIMEOUT
        elif reason == "not joined":
            code = EXIT_NOT_JOINED
        elif first is not None:
            code = exit_status(first.returncode)
        else:
            code = 0
        return LaunchResult(code, tuple(results[id(c)] for c in self.children), first, reason)

    def _watch(self) -> tuple[str, _Child | None]:
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        shutdown_deadline: float | None = None
        after_workers: set[_Child] = set()
        survived: set[_Child] = set()       # dead servers whose shards a backup took over
        while True:
            if self.signum is not None:
                if self.signum == signal.SIGINT:
                    self.interrupted.set()
                name = signal.Signals(self.signum).name
                logger.warning("got %s; stopping all %d processes", name, len(self._running()))
                self._stop(self.children, self.signum)
                return "signal", None
            restarted = False
            for c in self.children:
                rc = c.popen.poll()
                if rc is not None and c.spec.label in self.retiring:
                    self._retiring_ended(c, rc)
                if rc is None or rc == 0 or c in after_workers or c in survived:
                    continue
                if self._waiting(c):
                    if shutdown_deadline is None and not self._scheduler_gone():
                        if self.backoff.due(c.spec.label):
                            self.children[self.children.index(c)] = self._spawn(c.spec)
                            restarted = True
                        continue
                    self.backoff.cancel(c.spec.label)   # the job ends: it stays dead
                elif shutdown_deadline is None and self._restart(c, rc):
                    continue
                if self._taken_over(c, rc, survived):
                    survived.add(c)
                    continue
                if shutdown_deadline is not None or self._workers_succeeded():
                    # every worker exited 0, so the job succeeded: the workers' status is
                    # the job's, whatever a scheduler or server does while it winds down
                    # (also when this pass sees the dead one before the workers' exits)
                    after_workers.add(c)
                    logger.warning("%s (pid %d) exited with status %d after every worker "
                                   "had finished; the job's status stays 0", c.spec.label,
                                   c.popen.pid, exit_status(rc))
                    continue
                if c.spec.role is Role.SERVER and self._scheduler_gone() and any(
                        w.running for w in self.children if w.spec.role is Role.WORKER):
                    # the scheduler has ended the job (every worker said goodbye, or it
                    # failed): the workers, still exiting, say how it went
                    survived.add(c)
                    logger.warning("%s (pid %d) exited with status %d after the scheduler "
                                   "ended the job; the workers' statuses decide the job's",
                                   c.spec.label, c.popen.pid, exit_status(rc))
                    continue
                # role, rank and host: which process of the job failed, and where
                logger.error("%s (pid %d) exited with status %d; stopping the others",
                             c.spec.where, c.popen.pid, exit_status(rc))
                self._stop(self.children)
                return "failed", c
            self.requests.serve(self)   # the control channel's requests (--control)
            if restarted:
                continue            # look at the new child's status first
            gone = self._abandoned() if shutdown_deadline is None else None
            if gone is not None:
                logger.error(
                    "%s (pid %d) exited with status 0 without joining the cluster, while "
                    "the other workers wait for it at the scheduler; stopping the job. Did "
                    "it make a 'local' store? Every worker of a pskv-launch job must make "
                    "a dist one: kv.create('dist_sync') (or 'dist_async').", gone.spec.where,
                    gone.popen.pid)
                self._stop(self.children)
                return "not joined", gone
            running = self._running()
            if not running and not self.backoff.pending:
                if any(c.popen.poll() not in (None, 0) and c not in after_workers
                       and c not in survived for c in self.children):
                    continue        # one failed since the loop above looked: report it
                return "ok", None
            now = time.monotonic()
            # read each time: a restarted worker (--max-restarts) is a new child
            workers = [c for c in self.children if c.spec.role is Role.WORKER]
            if shutdown_deadline is None and not any(c.running or self._waiting(c)
                                                     for c in workers):
                # every worker exited 0: a scheduler and servers the workers used follow by
                # themselves within moments (ps-lite's Finalize); ones nobody joined would
                # wait out their connect timeout, so after shutdown_timeout they are stopped,
                # quietly: the job has succeeded, and --timeout only caps this wait
                shutdown_deadline = now + self.shutdown_timeout
                self.ending_why = "every worker has finished"
                if deadline is not None:
                    shutdown_deadline = min(shutdown_deadline, deadline)
                logger.debug("all %d workers finished; waiting up to %.3g s for %s to exit",
                             len(workers), shutdown_deadline - now,
                             ", ".join(c.spec.label for c in running))
            if shutdown_deadline is not None and now >= shutdown_deadline:
                logger.debug("stopping %s: every worker has finished",
                             ", ".join(c.spec.label for c in running))
                self._stop(running)
                return "ok", None
            if deadline is not None and now >= deadline:
                logger.error("timed out after %.3g s; still running: %s. Killing them.",
                             self.timeout, ", ".join(c.spec.label for c in running))
                self._stop(self.children)
                return "timeout", None
            self.wake.wait(_POLL_S)
            self.wake.clear()


def run_processes(procs: Sequence[ProcessSpec], *, timeout: float | None = None,
                  grace_period: float = 5.0, shutdown_timeout: float = 2.0,
                  stdout: TextIO | None = None,
                  stderr: TextIO | None = None, log_dir: str | None = None,
                  max_restarts: int = 0, backed_up: bool = False,
                  check_joined: bool = False, control: str | None = None) -> LaunchResult:
    """Start `procs` in order and supervise them until the job ends.

    The first process that exits non-zero stops all others (SIGTERM, then SIGKILL after
    `grace_period`) and its status becomes the job's. Once every worker has exited 0, the
    job has succeeded: the others get `shutdown_timeout` seconds to exit by themselves,
    then they are stopped without a warning, and their exit statuses no longer count.
    SIGINT or SIGTERM to the launcher (when called from the main thread) is forwarded to
    every process group. After `timeout` seconds everything is stopped and the job fails
    with status 124, unless every worker had already exited 0 (then `timeout` only caps
    the wait for the others).

    Parameters
    ----------
    procs : sequence of ProcessSpec
    timeout, grace_period, shutdown_timeout : float
        Seconds; see LaunchSpec.
    stdout, stderr : text streams, optional
        Where the prefixed output goes (``sys.stdout`` / ``sys.stderr`` by default).
    log_dir : str, optional
        Also write each process's output, unprefixed, to ``log_dir/<label>.log``
        (``worker-0.log``, ``server-1.log``, ``scheduler.log``); created if missing.
    max_restarts : int
        A worker or server that exits non-zero is started again (same rank and command,
        with ``PSKV_RESTART`` set to its restart count) up to this many times before its
        exit ends the job; every child gets ``PSKV_MAX_RESTARTS``.
    backed_up : bool
        The servers keep backups of each other's shards (``PSKV_REPLICAS=1``): a server
        that dies (and is not restarted) while another server runs is logged with one
        WARNING and the job goes on; the workers' exits decide its status.
    check_joined : bool
        The scheduler runs on this machine: it is told a file to write how far the job
        joined to (``PSKV_JOIN_STATUS``), and a worker that exits 0 without joining while
        other workers wait at the scheduler (it made a ``'local'`` store) is named in an
        ERROR and ends the job at once (status 1).
    control : str, optional
        Listen on a Unix socket at this path (mode 0600, removed at the end) for
        ``remove-server R``, ``add-server R`` and ``status`` (``pskv-launch --control``;
        ``launch/_control.py``). A server sent SIGUSR1 by ``remove-server`` that exits 0
        is retired: not restarted, not a failure; ``add-server`` starts it again with
        ``PSKV_RESTART`` one more than before and ``PSKV_MAX_RESTARTS`` at least 1.

    Returns
    -------
    LaunchResult

    Raises
    ------
    ConfigError
        A command could not be started (after the processes already started are stopped).
    """
    return _Supervisor(procs, timeout=timeout, grace_period=grace_period,
                       shutdown_timeout=shutdown_timeout,
                       stdout=sys.stdout if stdout is None else stdout,
                       stderr=sys.stderr if stderr is None else stderr, log_dir=log_dir,
                       max_restarts=max_restarts, backed_up=backed_up,
                       check_joined=check_joined, control=control).run()
