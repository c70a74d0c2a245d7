"""What a launch is made of: the job (`LaunchSpec`) and its processes (`ProcessSpec`).

Invariant: a LaunchSpec is frozen and validated; the launchers (local, ssh, mpi, slurm) turn
it into a list of ProcessSpec, the argv and environment of each process this machine starts,
without starting anything, so the unit tests can check every command line. The kubernetes
and ray launchers start nothing here: they turn it into manifests and Ray actors.
"""
from __future__ import annotations

import ipaddress
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping

from .._ps.config import (ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_EVERY, ENV_NUM_SERVER,
                          ENV_NUM_WORKER, ENV_REPLICAS, ENV_ROLE, ENV_ROOT_PORT, ENV_ROOT_URI,
                          ENV_SERVER_ID, ENV_WORKER_ID, LOG_LEVELS, Role,
                          replicas_setting)
from ..errors import ConfigError
from ._k8s_options import PodOptions

__all__ = ["DEFAULT_SERVER_COMMAND", "ENV_NAME", "EnvPairs", "K8S_NAME_MAX", "LAUNCHERS",
           "CONTROLLED", "LaunchSpec", "LauncherName", "MANAGED", "ProcessSpec", "RESERVED_ENV",
           "RESTARTING", "backed_up", "check_env_name", "check_restarts", "servers_env"]

LauncherName = Literal["local", "ssh", "mpi", "slurm", "kubernetes", "ray"]
LAUNCHERS: tuple[str, ...] = ("local", "ssh", "mpi", "slurm", "kubernetes", "ray")
#: launchers that restart a dead process (--max-restarts): themselves, or (kubernetes)
#: through the pods' restartPolicy OnFailure
RESTARTING: tuple[str, ...] = ("local", "ssh", "slurm", "kubernetes", "ray")
#: launchers whose servers take --control's remove-server: pskv-launch starts each server
#: process itself, and SIGUSR1 to what it started reaches the server (srun forwards it)
CONTROLLED: tuple[str, ...] = ("local", "slurm")
#: launchers whose processes inherit the launcher's environment (local, slurm's
#: --export=ALL) or its PSKV_* variables (ssh)
INHERITING: tuple[str, ...] = ("local", "ssh", "mpi", "slurm")
#: launchers that take the hosts from a cluster manager, not from -H
MANAGED: tuple[str, ...] = ("slurm", "kubernetes", "ray")

#: why --control cannot reach the servers of the other launchers
_UNCONTROLLED: dict[str, str] = {
    "ssh": "a signal to the local ssh client does not reach the remote server",
    "mpi": "mpirun starts the servers and knows nothing of pskv's ranks",
    "kubernetes": "the servers run in pods, not under pskv-launch",
    "ray": "the servers run in Ray actors, not under pskv-launch",
}
#: a Kubernetes object name part (RFC 1123 label); job names get role suffixes appended
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
K8S_NAME_MAX = 40

#: scheduler and servers run this, not the user's script (STYLE.md "Launcher entry points")
DEFAULT_SERVER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pskv.server")

#: the launcher owns these; ``--env`` may not set them (use -n, -s, --port instead)
RESERVED_ENV: frozenset[str] = frozenset(
    {ENV_ROLE, ENV_ROOT_URI, ENV_ROOT_PORT, ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_WORKER_ID,
     ENV_SERVER_ID})

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

EnvPairs = tuple[tuple[str, str], ...]


def check_env_name(name: str, flag: str) -> None:
    """Raise ConfigError unless `name` is a variable name that ``--env`` may set."""
    if not ENV_NAME.match(name):
        raise ConfigError(f"{flag} {name!r}: {name!r} is not an environment variable name. "
                          "Use letters, digits and underscores, e.g. OMP_NUM_THREADS:4.")
    if name in RESERVED_ENV:
        raise ConfigError(f"{flag} {name}: the launcher sets {name} itself. Use -n, -s and "
                          "--port to change the cluster, not --env.")


def _is_on(value: str | None) -> bool:
    return value is not None and value.strip() not in ("", "0")


def servers_env(spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings the servers of `spec` get: ``--env``/``--env-server`` over `environ`,
    which only the launchers whose processes inherit it pass (not kubernetes or ray)."""
    env = dict(environ) if spec.launcher in INHERITING else {}
    env.update(spec.env)
    env.update(spec.env_server)
    return env


def backed_up(spec: LaunchSpec, environ: Mapping[str, str]) -> bool:
    """Whether the servers of `spec` keep backups of each other's shards: ``PSKV_REPLICAS``
    on, with two servers or more (docs/durability.md).

    Examples
    --------
    >>> backed_up(LaunchSpec(('t',), 1, 2, env=(('PSKV_REPLICAS', '1'),)), {})
    True
    >>> backed_up(LaunchSpec(('t',), 1, 1, env=(('PSKV_REPLICAS', '1'),)), {})
    False
    """
    # the servers' own reading (ConfigError for what they would refuse, e.g. "yes"), so
    # the launcher never announces backups the servers will not keep
    return (spec.num_servers or 0) >= 2 and replicas_setting(servers_env(spec, environ)) == 1


def check_replicas(spec: LaunchSpec, environ: Mapping[str, str]) -> None:
    """Refuse at launch a ``PSKV_REPLICAS`` the servers would refuse when they start: not 0
    or 1 (``yes``), or 1 with fewer than 2 servers. Read with the servers' own function
    (``_ps.config.replicas_setting``): one rule on both sides.

    Examples
    --------
    >>> check_replicas(LaunchSpec(('t',), 1, 2, env=(('PSKV_REPLICAS', 'yes'),)), {})
    Traceback (most recent call last):
    ...
    pskv.errors.ConfigError: PSKV_REPLICAS='yes' is not an integer. Set it to 1 (a backup of every shard) or 0 (none).
    """
    servers = spec.num_servers or 0
    if replicas_setting(servers_env(spec, environ)) and servers < 2:
        raise ConfigError(f"{ENV_REPLICAS}=1 needs at least 2 servers (a shard's backup lives "
                          f"on another one), and this job has {servers}. Start it with -s 2 "
                          f"or more, or unset {ENV_REPLICAS}.")


def check_restarts(spec: LaunchSpec, environ: Mapping[str, str]) -> None:
    """Refuse ``--max-restarts`` when a restarted server could not get its shard back.

    A restarted server reloads its shard from the newest periodic checkpoint
    (``PSKV_CHECKPOINT_DIR`` and ``PSKV_CHECKPOINT_EVERY``) or rejoins as the backup of a
    server that took its shard over (``PSKV_REPLICAS=1``). Without either the job would be
    accepted and fail only when a server dies, maybe hours later; this says so at launch.
    The servers' settings are `spec`'s ``--env``/``--env-server`` over `environ`, which
    only the launchers whose processes inherit it pass (not kubernetes or ray).

    Examples
    --------
    >>> check_restarts(LaunchSpec(('t',), 1, max_restarts=1,
    ...                           env=(('PSKV_REPLICAS', '1'),)), {})
    """
    if not spec.max_restarts:
        return
    env = servers_env(spec, environ)
    claim = spec.pods is not None and spec.pods.checkpoint_claim
    if (_is_on(env.get(ENV_CHECKPOINT_DIR)) or claim) and _is_on(env.get(ENV_CHECKPOINT_EVERY)):
        return
    if replicas_setting(env):
        return
    where = ("--checkpoint-claim CLAIM --env PSKV_CHECKPOINT_EVERY:10 (a claim every server "
             "can write)" if spec.launcher == "kubernetes" else
             "--env PSKV_CHECKPOINT_DIR:DIR --env PSKV_CHECKPOINT_EVERY:10 (a directory "
             "every server can write)")
    raise ConfigError(
        f"--max-restarts {spec.max_restarts} would restart a dead server with nothing to "
        f"reload its shard from: neither periodic checkpoints ({ENV_CHECKPOINT_DIR} and "
        f"{ENV_CHECKPOINT_EVERY}) nor backups ({ENV_REPLICAS}=1) are set, so the job would "
        f"fail only when a server dies. Add {where}, or --env {ENV_REPLICAS}:1 with -s 2 or "
        "more; or drop --max-restarts (docs/durability.md).")


def _pairs(env: Mapping[str, str] | Iterable[tuple[str, str]], flag: str) -> EnvPairs:
    items = env.items() if isinstance(env, Mapping) else env
    out: list[tuple[str, str]] = []
    for name, value in items:
        check_env_name(name, flag)
        out.append((str(name), str(value)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One distributed job: what to run, how many of each role, and where.

    Parameters
    ----------
    command : tuple of str
        The worker command, an argv list (``('python', 'train.py', '--lr', '0.1')``).
    num_workers : int
        Number of worker processes (``-n``).
    num_servers : int, optional
        Number of server processes (``-s``); defaults to `num_workers`, as tools/launch.py.
    launcher : {'local', 'ssh', 'mpi', 'slurm', 'kubernetes', 'ray'}, optional
        Defaults to ``'ssh'`` when a `hostfile` is given, else ``'local'``.
    hostfile : str, optional
        Hosts for ssh and mpi, one ``host[:port]`` or ``host slots=N`` a line.
    hosts : str, optional
        Or the hosts as horovodrun's ``-H host1:slots,host2:slots``.
    env, env_server, env_worker : tuple of (name, value)
        Extra variables for every process, for the scheduler and servers, and for the
        workers; later pairs win, role-specific pairs win over `env`.
    timeout : float, optional
        Seconds after which everything is killed and the job fails (exit status 124);
        once every worker has exited 0 it only caps the wait for the others.
    port : int, optional
        The scheduler's port (``DMLC_PS_ROOT_PORT``); a free port from the OS when None.
    host_ip : str, optional
        This machine's address as the ssh/mpi hosts reach it (``DMLC_PS_ROOT_URI``).
    server_command : tuple of str
        What the scheduler and servers run (``python -m pskv.server``).
    secret : str, optional
        The job's ``PSKV_SECRET``; see `get_secret`.
    grace_period : float
        Seconds between SIGTERM and SIGKILL when processes are stopped.
    log_level : str, optional
        ``DEBUG`` ... ``CRITICAL``: pskv's log level in every process (``PSKV_LOG_LEVEL``).
    log_dir : str, optional
        Also write each process's output to ``log_dir/worker-0.log``, ``server-1.log``,
        ``scheduler.log``.
    shutdown_timeout : float
        Seconds the scheduler and servers get to exit by themselves once every worker
        has exited 0; then they are stopped (quietly: the job still succeeds).
    image : str, optional
        kubernetes: the container image every pod runs (required there).
    namespace : str, optional
        kubernetes: the namespace of the job's objects (``default``).
    job_name : str, optional
        kubernetes: the prefix of the job's object names (``pskv-`` and 8 random hex
        digits by default); lowercase letters, digits and ``-``, at most 40 characters.
    dry_run : bool
        kubernetes: print the manifests as YAML instead of creating them.
    max_restarts : int
        How many times each worker or server that dies is started again, with its rank
        (``--max-restarts``; docs/durability.md); 0: the first failure ends the job.
        kubernetes: the kubelet restarts the container (restartPolicy OnFailure).
    pods : PodOptions, optional
        kubernetes: resources, node selectors, tolerations, volumes, the service account,
        image pull secrets, labels and annotations of the job's objects, and the pods'
        restart policy (``--values`` and its flags; docs/kubernetes.md).
    sinks : tuple of str
        ``KEY=URL`` each (``--sink``): a sink of table ``KEY``'s change stream started
        beside the job (``python -m pskv.sinks``; local launcher; ``launch._beside``).
    control : str, optional
        ``--control PATH``: the Unix socket at which the running job takes
        ``remove-server R``, ``add-server R`` and ``status`` (local and slurm launchers;
        docs/durability.md, "Adding and removing servers while the job runs").

    Examples
    --------
    >>> spec = LaunchSpec(('python', 'train.py'), num_workers=2)
    >>> spec.num_servers, spec.launcher
    (2, 'local')
    """

    command: tuple[str, ...]
    num_workers: int
    num_servers: int | None = None
    launcher: LauncherName | None = None
    hostfile: str | None = None
    env: EnvPairs = ()
    env_server: EnvPairs = ()
    env_worker: EnvPairs = ()
    timeout: float | None = None
    port: int | None = None
    host_ip: str | None = None
    server_command: tuple[str, ...] = field(default=DEFAULT_SERVER_COMMAND)
    secret: str | None = None
    grace_period: float = 5.0
    shutdown_timeout: float = 2.0
    hosts: str | None = None
    log_level: str | None = None
    log_dir: str | None = None
    image: str | None = None
    namespace: str | None = None
    job_name: str | None = None
    dry_run: bool = False
    max_restarts: int = 0
    pods: PodOptions | None = None
    sinks: tuple[str, ...] = ()
    control: str | None = None

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__, as attrs converters do
        setattr_ = object.__setattr__
        setattr_(self, "command", tuple(str(c) for c in self.command))
        setattr_(self, "server_command", tuple(str(c) for c in self.server_command))
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} is negative. Pass how "
                              "many times a dead worker or server may be restarted, or 0.")
        if not self.command:
            raise ConfigError("no command to launch. Put the worker command last, e.g. "
                              "pskv-launch -n 2 python train.py.")
        if not self.server_command:
            raise ConfigError("server_command is empty. Leave it out to run python -m "
                              "pskv.server.")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) \
                or self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers!r}: a job needs at least one "
                              "worker. Pass -n 1 or more.")
        if self.num_servers is None:
            setattr_(self, "num_servers", self.num_workers)  # as tools/launch.py
        elif isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) \
                or self.num_servers < 1:
            raise ConfigError(f"num_servers={self.num_servers!r}: pskv needs at least one "
                              "server. Pass -s 1 or more, or leave -s out to use -n.")
        if self.launcher is None:
            # tools/launch.py defaults to ssh; pskv runs locally unless hosts are given
            setattr_(self, "launcher", "ssh" if self.hostfile or self.hosts else "local")
        elif self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} is not supported. Use one of "
                              f"{', '.join(LAUNCHERS)}.")
        if self.hostfile and self.hosts:
            raise ConfigError("give the hosts once: a hostfile or a host list, not both.")
        if self.launcher == "ssh" and not (self.hostfile or self.hosts):
            raise ConfigError("--launcher ssh needs a hostfile. Pass -H hosts.txt with one "
                              "host[:port] a line, or use --launcher local.")
        if self.launcher == "local" and (self.hostfile or self.hosts):
            raise ConfigError("--launcher local runs every process on this machine and takes "
                              "no hostfile. Drop -H, or use --launcher ssh or mpi.")
        if self.launcher in MANAGED and (self.hostfile or self.hosts):
            raise ConfigError(f"--launcher {self.launcher} takes the hosts from the cluster "
                              "manager, not from -H. Drop -H.")
        if self.max_restarts and self.launcher not in RESTARTING:
            raise ConfigError(
                f"--max-restarts works with the launchers that restart a process with its "
                f"rank ({', '.join(RESTARTING)}), not --launcher {self.launcher} (mpirun "
                "starts the processes, knows nothing of pskv's ranks and ends the job when "
                "one dies). Drop --max-restarts, or use one of those launchers.")
        if self.control is not None and self.launcher not in CONTROLLED:
            raise ConfigError(
                f"--control works with the launchers whose server processes pskv-launch "
                f"starts and signals itself ({', '.join(CONTROLLED)}), not --launcher "
                f"{self.launcher} ({_UNCONTROLLED[str(self.launcher)]}). Drop --control, or "
                "use one of those launchers.")
        if self.control is not None and not self.control:
            raise ConfigError("--control PATH is empty. Pass the path of the job's control "
                              "socket, e.g. --control /tmp/job.sock.")
        self._check_managed()
        setattr_(self, "env", _pairs(self.env, "--env"))
        setattr_(self, "env_server", _pairs(self.env_server, "--env-server"))
        setattr_(self, "env_worker", _pairs(self.env_worker, "--env-worker"))
        if self.timeout is not None and not 0 < self.timeout < float("inf"):
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of "
                              "seconds. Leave --timeout out to wait for the job however long.")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"port={self.port!r} is not a TCP port. Pass --port 1-65535, or "
                              "leave it out to take a free one.")
        for name in ("grace_period", "shutdown_timeout"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ConfigError(f"{name}={value!r} must be a finite number of seconds >= 0.")
        if self.log_level is not None:
            if str(self.log_level).upper() not in LOG_LEVELS:
                raise ConfigError(f"log level {self.log_level!r} is not one of "
                                  f"{', '.join(n.lower() for n in LOG_LEVELS)}.")
            setattr_(self, "log_level", str(self.log_level).upper())
        if self.secret is not None and not self.secret:
            raise ConfigError("secret is empty. Leave it out to generate one per job.")
        if self.host_ip is not None:
            try:
                ipaddress.ip_address(self.host_ip)
            except ValueError:
                if not re.fullmatch(r"[A-Za-z0-9.-]+", self.host_ip):
                    raise ConfigError(f"--host-ip {self.host_ip!r} is neither an IP address "
                                      "nor a host name.") from None


    def _check_managed(self) -> None:
        """The kubernetes-only options go with --launcher kubernetes, and are well formed."""
        k8s = {"--image": self.image, "--namespace": self.namespace,
               "--job-name": self.job_name, "--dry-run": self.dry_run or None,
               "--values and the pod flags (--requests, --restart-policy, ...)": self.pods}
        if self.launcher != "kubernetes":
            given = [flag for flag, value in k8s.items() if value is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} only apply to --launcher kubernetes. "
                                  "Drop them, or pass --launcher kubernetes.")
            return
        if not self.image:
            raise ConfigError("--launcher kubernetes needs the container image every pod "
                              "runs. Pass --image IMAGE (one with pskv and your script).")
        policy = self.pods.restart_policy if self.pods is not None else None
        if policy == "Never" and self.max_restarts:
            raise ConfigError(f"--restart-policy Never and --max-restarts {self.max_restarts} "
                              "contradict each other: the kubelet restarts a pod's container "
                              "only with OnFailure. Drop --restart-policy (--max-restarts "
                              "sets OnFailure), or drop --max-restarts.")
        if policy == "OnFailure" and not self.max_restarts:
            raise ConfigError("--restart-policy OnFailure without --max-restarts: a "
                              "restarted server or worker rejoins only when the scheduler "
                              "waits for it, and it waits only with --max-restarts N. Pass "
                              "--max-restarts N (it sets OnFailure), or drop "
                              "--restart-policy.")
        for flag, value in (("--namespace", self.namespace), ("--job-name", self.job_name)):
            if value is not None and (len(value) > K8S_NAME_MAX
                                      or not _K8S_NAME.match(value)):
                raise ConfigError(f"{flag} {value!r} is not a Kubernetes name part. Use at "
                                  f"most {K8S_NAME_MAX} lowercase letters, digits and '-', "
                                  "starting and ending with a letter or digit.")


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process this machine starts.

    Attributes
    ----------
    role : Role
        The DMLC_ROLE of the process (for an ``mpirun`` process, of all it starts).
    rank : int or None
        The rank within the role, which the process also gets as ``DMLC_WORKER_ID`` /
        ``DMLC_SERVER_ID`` (so ``[worker 1]`` is ``kv.rank == 1``); None for an
        ``mpirun`` that starts the whole role.
    argv : tuple of str
        The command line, run without a shell.
    env : tuple of (name, value)
        Set on top of the launcher's own environment.
    stdin : bytes or None
        Written to the process's stdin, which is then closed (None: /dev/null).
    host : str or None
        Where the process runs, when that is not this machine (ssh, slurm); named in
        the launcher's report when it fails.
    """

    role: Role
    rank: int | None
    argv: tuple[str, ...]
    env: EnvPairs = ()
    stdin: bytes | None = None
    host: str | None = None

    @property
    def label(self) -> str:
        """The output prefix without brackets: ``scheduler``, ``server 0``, ``worker 1``."""
        if self.role is Role.SCHEDULER:
            return "scheduler"
        if self.rank is None:
            return f"{self.role.value}s"
        return f"{self.role.value} {self.rank}"

    @property
    def where(self) -> str:
        """The label and, when known, the host: ``worker 1 on node3``."""
        return self.label if self.host is None else f"{self.label} on {self.host}"
