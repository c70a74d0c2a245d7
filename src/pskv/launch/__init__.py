"""pskv-launch: start a scheduler, servers and workers, as MXNet's tools/launch.py.

``pskv-launch -n 2 -s 1 python train.py --lr 0.1`` (or ``python -m pskv.launch ...``) runs
one scheduler and one server (``python -m pskv.server``) and two workers (the command) on this
machine, each with ps-lite's ``DMLC_*`` variables and a per-job ``PSKV_SECRET``, prefixes
their output (``[worker 1] ...``), and exits with the first failure's status.
``-H hosts.txt`` runs servers and workers on those hosts over ssh (or ``--launcher mpi``);
``--launcher slurm`` inside an allocation, ``--launcher kubernetes --image IMAGE`` and
``--launcher ray`` run them on a cluster manager's nodes.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import shlex
import sys
from typing import Mapping, NoReturn, Sequence, TextIO

from ..errors import ConfigError
from ._beside import Sidecars, beside_env, sink
from ._control import ask_cli, cli_request, control
from ._env import get_secret, parse_env_pair
from ._hosts import is_host_list
from ._launchers import REGISTRY
from ._k8s_options import pod_options
from ._spec import (DEFAULT_SERVER_COMMAND, INHERITING, LAUNCHERS, LauncherName, LaunchSpec,
                   ProcessSpec, backed_up, check_replicas, check_restarts)
from ._supervise import CommandError, LaunchResult, ProcessResult, run_processes
from .._ps.config import LOG_LEVELS, Role, log_level, warn_unknown_env

__all__ = ["LaunchResult", "LaunchSpec", "ProcessResult", "build_processes", "control",
           "launch", "launch_spec", "main", "parse_args"]

logger = logging.getLogger(__name__)


def build_processes(spec: LaunchSpec, *, environ: Mapping[str, str] | None = None,
                    cwd: str | None = None) -> list[ProcessSpec]:
    """Every process `spec` starts on this machine, with its argv and environment.

    Picks what the spec leaves open: a free port, the job secret and, for ssh and mpi, this
    machine's address; for slurm, reads the allocation's nodes. Nothing is started. The
    kubernetes and ray launchers start no process here: see `pskv.launch._kubernetes` and
    `pskv.launch._ray`.

    Parameters
    ----------
    spec : LaunchSpec
    environ : mapping, optional
        The launcher's environment (``os.environ``): ``PSKV_SECRET`` and, for ssh and mpi,
        the variables passed on to remote processes.
    cwd : str, optional
        The remote working directory for ssh (``os.getcwd()``).

    Returns
    -------
    list of ProcessSpec
        Scheduler first, then servers, then workers.

    Raises
    ------
    ConfigError
        A bad hostfile; slurm outside an allocation; kubernetes or ray.

    Examples
    --------
    >>> spec = LaunchSpec(('python', 'train.py'), 1, 1, port=9000, secret='s')
    >>> [p.label for p in build_processes(spec, environ={})]
    ['scheduler', 'server 0', 'worker 0']
    """
    env = os.environ if environ is None else environ
    secret = get_secret(spec, env)
    launcher = REGISTRY[spec.launcher]
    if launcher.build is None:
        raise ConfigError(f"--launcher {spec.launcher} starts no process on this machine, "
                          "so there is no process list to build. Call launch_spec(spec).")
    return launcher.build(spec, secret, env, cwd)


def launch_spec(spec: LaunchSpec, *, stdout: TextIO | None = None,
                stderr: TextIO | None = None) -> LaunchResult:
    """Run the job `spec` describes until it ends; see `launch`."""
    # before anything starts: a typo in a PSKV_* name, and restarts with nothing to reload
    inherited = os.environ if spec.launcher in INHERITING else {}
    warn_unknown_env({**inherited, **dict(spec.env), **dict(spec.env_server),
                      **dict(spec.env_worker)}, "pskv-launch")
    check_restarts(spec, os.environ)
    check_replicas(spec, os.environ)
    launcher = REGISTRY[spec.launcher]
    if launcher.run is not None:
        result: LaunchResult = launcher.run(spec, stdout=stdout, stderr=stderr)
        return result
    beside = [sink(s) for s in spec.sinks]
    if beside and spec.launcher != "local":
        raise ConfigError(f"--sink runs beside a job of the local launcher only, not "
                          f"{spec.launcher}: start `python -m pskv.sinks --key KEY --to URL` "
                          "beside the job yourself, with its DMLC_PS_ROOT_URI, "
                          "DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER and PSKV_SECRET.")
    procs = build_processes(spec)
    w, s = spec.num_workers, spec.num_servers
    logger.info("launching %d worker%s and %d server%s (%s)", w, "s"[:w != 1], s,
                "s"[:s != 1], spec.launcher)
    sidecars = None
    if beside:
        from ..kvstore.server._core import STREAM_DRAIN
        worker = next(p for p in procs if p.role is Role.WORKER)
        sidecars = Sidecars(beside, beside_env(dict(worker.env)), spec.log_dir)
    try:
        result = run_processes(procs, timeout=spec.timeout, grace_period=spec.grace_period,
                               log_dir=spec.log_dir, max_restarts=spec.max_restarts,
                               backed_up=backed_up(spec, os.environ),
                               # the scheduler runs here (ssh and mpi: scheduler_here)
                               check_joined=launcher.scheduler_here,
                               # servers serve stream readers that are behind a while (E10)
                               shutdown_timeout=max(spec.shutdown_timeout, STREAM_DRAIN + 3)
                               if beside else spec.shutdown_timeout, stdout=stdout,
                               stderr=stderr, control=spec.control)
    finally:
        early = sidecars.exited() if sidecars is not None else []
        if sidecars is not None:
            sidecars.stop(spec.grace_period)
    if early:
        logger.error("%s while the job ran; the job fails", "; ".join(early))
        if result.returncode == 0:
            result = dataclasses.replace(result, returncode=1, reason="sidecar")
    if result.reason == "ok" and result.killed:
        logger.debug("the job succeeded; %s were stopped after the workers finished",
                     ", ".join(p.label for p in result.killed))
    return result


def launch(command: Sequence[str], num_workers: int, num_servers: int | None = None, *,
           launcher: LauncherName | None = None, hostfile: str | None = None,
           env: Mapping[str, str] | None = None, env_server: Mapping[str, str] | None = None,
           env_worker: Mapping[str, str] | None = None, timeout: float | None = None,
           port: int | None = None, host_ip: str | None = None,
           server_command: Sequence[str] | None = None, secret: str | None = None,
           grace_period: float = 5.0, shutdown_timeout: float = 2.0,
           hosts: str | None = None, log_level: str | None = None, log_dir: str | None = None,
           image: str | None = None, namespace: str | None = None,
           job_name: str | None = None, dry_run: bool = False,
           stdout: TextIO | None = None, stderr: TextIO | None = None,
           max_restarts: int = 0,
           kubernetes_values: Mapping[str, object] | None = None,
           sinks: Sequence[str] = (), control: str | None = None) -> LaunchResult:
    """Launch a distributed job and wait for it, as ``pskv-launch`` does.

    Runs one scheduler, `num_servers` servers (``python -m pskv.server``) and `num_workers`
    workers (`command`). Every process gets ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``,
    ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and ``PSKV_SECRET``.
    The first process that exits non-zero stops the others. Called from the main thread,
    SIGINT and SIGTERM are forwarded to every process.

    Parameters
    ----------
    command : sequence of str
        The worker command as an argv list; no shell is involved.
    num_workers : int
    num_servers : int, optional
        Defaults to `num_workers`.
    launcher : {'local', 'ssh', 'mpi', 'slurm', 'kubernetes', 'ray'}, optional
        ``'ssh'`` when a `hostfile` is given, else ``'local'``. ``'slurm'`` runs inside
        an allocation, ``'kubernetes'`` creates pods from `image`, ``'ray'`` runs on the
        Ray cluster at ``RAY_ADDRESS`` (else a local one it starts and stops).
    hostfile : str, optional
    env, env_server, env_worker : dict, optional
        Extra variables for all processes, for the scheduler and servers, for the workers.
    timeout : float, optional
        Seconds; then everything is killed and the result's returncode is 124.
    port : int, optional
        The scheduler's port; a free one by default.
    host_ip : str, optional
        This machine's address for ssh/mpi hosts.
    server_command : sequence of str, optional
        Run by the scheduler and servers instead of ``python -m pskv.server``.
    secret : str, optional
        ``PSKV_SECRET``; by default the environment's, else a new random one.
    grace_period : float
        Seconds between SIGTERM and SIGKILL.
    shutdown_timeout : float
        Seconds the scheduler and servers get to exit by themselves after every worker
        exited 0; then they are stopped quietly and the job still succeeds.
    hosts : str, optional
        Instead of a hostfile, horovodrun's ``'host1:slots,host2:slots'``.
    log_level : str, optional
        pskv's log level in every process (``PSKV_LOG_LEVEL``), e.g. ``'debug'``.
    log_dir : str, optional
        Also write each process's output to ``log_dir/worker-0.log`` and so on.
    image, namespace, job_name : str, optional
        kubernetes: the pods' image, the namespace and the objects' name prefix.
    dry_run : bool
        kubernetes: print the manifests as YAML to `stdout` instead of creating them.
    stdout, stderr : text streams, optional
        Where the prefixed output goes.
    max_restarts : int
        Start a worker or server that died again, with its rank, up to this many times
        each (``--max-restarts``; docs/durability.md). Needs periodic checkpoints or
        ``PSKV_REPLICAS=1`` in `env`.
    kubernetes_values : mapping, optional
        kubernetes: pod settings in the format of ``--values`` (docs/kubernetes.md).
    sinks : sequence of str
        ``KEY=URL`` each, as ``--sink``: sinks of tables' change streams started beside
        the job (local launcher; docs/embeddings.md, Sinks).
    control : str, optional
        As ``--control PATH``: take ``remove-server R``, ``add-server R`` and ``status``
        requests on a Unix socket at this path while the job runs (see `control`; local
        and slurm launchers; docs/durability.md).

    Returns
    -------
    LaunchResult

    Raises
    ------
    ConfigError
        Bad arguments, an unreadable hostfile, or a command that cannot be started.

    Examples
    --------
    >>> import sys
    >>> result = launch([sys.executable, '-c', 'pass'], 1, 1,
    ...                 server_command=[sys.executable, '-c', 'pass'])
    >>> result.returncode, [p.label for p in result.processes]
    (0, ['scheduler', 'server 0', 'worker 0'])
    """
    spec = LaunchSpec(
        tuple(command), num_workers, num_servers, launcher=launcher, hostfile=hostfile,
        env=tuple((env or {}).items()), env_server=tuple((env_server or {}).items()),
        env_worker=tuple((env_worker or {}).items()), timeout=timeout, port=port,
        host_ip=host_ip, secret=secret, grace_period=grace_period,
        shutdown_timeout=shutdown_timeout, hosts=hosts, log_level=log_level, log_dir=log_dir,
        max_restarts=max_restarts, image=image, namespace=namespace, job_name=job_name,
        dry_run=dry_run, pods=None if kubernetes_values is None
        else pod_options(values=kubernetes_values), sinks=tuple(sinks), control=control,
        server_command=DEFAULT_SERVER_COMMAND if server_command is None
        else tuple(server_command))
    return launch_spec(spec, stdout=stdout, stderr=stderr)


def version() -> str:
    """pskv's version: the installed distribution's, else ``pskv.__version__``."""
    try:
        return importlib.metadata.version("pskv")
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__
        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so main() owns the exit code."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}. See pskv-launch --help.")


def _parser() -> _Parser:
    p = _Parser(prog="pskv-launch", description="Launch a distributed pskv job: a scheduler, "
                "servers and workers (the command), as MXNet's tools/launch.py.")
    p.add_argument("--version", action="version", version=f"pskv-launch {version()}")
    # required to launch a job (parse_args checks it), not to ask a running one (--status)
    p.add_argument("-n", "-np", "--num-workers", type=int,
                   help="number of worker processes to launch (-np as horovodrun)")
    p.add_argument("-s", "--num-servers", type=int,
                   help="number of server processes to launch; defaults to NUM_WORKERS")
    p.add_argument("-H", "--hostfile", type=str,
                   help="hosts for the ssh and mpi launchers: a file of one host[:port] or "
                   "'host slots=N' a line, or horovodrun's list host1:slots,host2:slots")
    p.add_argument("--launcher", choices=LAUNCHERS,
                   help="how to start processes; ssh when -H is given, else local. slurm: "
                   "inside salloc/sbatch; kubernetes: pods (needs --image); ray: on the Ray "
                   "cluster at RAY_ADDRESS, else a local one")
    p.add_argument("--env", action="append", default=[], metavar="VAR[:VALUE]",
                   help="set VAR for every process (repeatable); VAR alone passes on this "
                   "machine's value")
    p.add_argument("--env-server", action="append", default=[], metavar="VAR:VALUE",
                   help="set VAR for the scheduler and servers (repeatable)")
    p.add_argument("--env-worker", action="append", default=[], metavar="VAR:VALUE",
                   help="set VAR for the workers (repeatable)")
    p.add_argument("--sync-dst-dir", type=str,
                   help="accepted for tools/launch.py compatibility and ignored: pskv does "
                   "not copy files to the hosts")
    p.add_argument("--host-ip", type=str,
                   help="this machine's address as the hosts reach it (ssh, mpi); the first "
                   "non-loopback address by default")
    p.add_argument("--port", type=int, help="the scheduler's port; a free one by default")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="kill everything and exit 124 after SECONDS; with --status, "
                   "--remove-server or --add-server: wait up to SECONDS for the reply (10)")
    p.add_argument("--server-command", type=str, metavar="CMD",
                   help="what the scheduler and servers run, split like a shell line but "
                   "never run by one (default: python -m pskv.server)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help="pskv's log level in every process: debug, info, warning, error or "
                   "critical (default: PSKV_LOG_LEVEL, else info for the launcher)")
    p.add_argument("--log-dir", type=str, metavar="DIR",
                   help="also write each process's output to DIR/worker-0.log, "
                   "DIR/server-0.log, DIR/scheduler.log")
    p.add_argument("--sink", action="append", default=[], metavar="KEY=URL",
                   help="start a sink of table KEY's change stream beside the job: "
                        "file:DIR or redis://HOST:PORT/DB (docs/embeddings.md, Sinks); "
                        "repeat for more")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="start a worker or server that died again, with its rank, up to N "
                   "times each; a server reloads its shard from the newest checkpoint "
                   "(PSKV_CHECKPOINT_DIR) or its backup (PSKV_REPLICAS=1); default 0")
    p.add_argument("--control", type=str, metavar="PATH",
                   help="listen on a Unix socket at PATH (mode 0600, removed at the end) "
                   "for remove-server R, add-server R and status while the job runs "
                   "(local and slurm launchers; docs/durability.md); with --remove-server, "
                   "--add-server or --status: send that request to the job at PATH")
    ctl = p.add_argument_group("a running job's control channel (with --control PATH, "
                               "without -n and command)")
    ctl.add_argument("--remove-server", type=int, metavar="R",
                     help="retire server R: SIGUSR1, its backup takes its shard "
                     "(PSKV_REPLICAS=1), it exits 0 and is not restarted")
    ctl.add_argument("--add-server", type=int, metavar="R",
                     help="start retired server R again; its shard is handed back to it")
    ctl.add_argument("--status", action="store_true",
                     help="print each server's state (running, retiring, retired, "
                     "restarting, exited) and pid as JSON")
    ctl.add_argument("--wait", type=float, metavar="SECONDS",
                     help="with --remove-server: wait up to SECONDS until the server has "
                     "retired")
    k8s = p.add_argument_group("kubernetes")
    k8s.add_argument("--image", type=str,
                     help="the container image of every pod (with pskv and the command)")
    k8s.add_argument("--namespace", type=str,
                     help="the namespace of the job's objects (default: default)")
    k8s.add_argument("--job-name", type=str,
                     help="prefix of the job's object names (default: pskv-<random>)")
    k8s.add_argument("--dry-run", action="store_true",
                     help="print the manifests as YAML instead of creating them")
    k8s.add_argument("--values", type=str, metavar="FILE",
                     help="a YAML or JSON file of pod settings (resources, nodeSelector, "
                     "tolerations, volumes, ...; docs/kubernetes.md); the flags below win")
    k8s.add_argument("--restart-policy", choices=("Never", "OnFailure"),
                     help="the servers' and workers' restartPolicy (default: OnFailure with "
                     "--max-restarts, else Never; the scheduler's is always Never)")
    k8s.add_argument("--service-account", type=str, metavar="NAME",
                     help="the pods' service account")
    k8s.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME",
                     help="a Secret with the registry's credentials (repeatable)")
    for flag, what in (("--label", "a label of every object, or of ROLE's pods"),
                       ("--annotation", "an annotation of every object, or of ROLE's pods"),
                       ("--node-selector", "a node label the pods (or ROLE's) must have")):
        k8s.add_argument(flag, action="append", default=[], metavar="[ROLE:]KEY=VALUE",
                         help=f"{what} (repeatable; ROLE: scheduler, server or worker)")
    for flag in ("--requests", "--limits"):
        k8s.add_argument(flag, action="append", default=[],
                         metavar="[ROLE:]NAME=QTY[,NAME=QTY]",
                         help=f"resource {flag[2:]} of every pod or ROLE's, e.g. "
                         "worker:cpu=4,memory=16Gi (repeatable)")
    k8s.add_argument("--toleration", action="append", default=[],
                     metavar="[ROLE:]KEY[=VALUE][:EFFECT]",
                     help="tolerate a taint: KEY=VALUE (Equal) or KEY alone (Exists), for "
                     "one EFFECT or all (repeatable)")
    k8s.add_argument("--claim", action="append", default=[],
                     metavar="[ROLE:]CLAIM:PATH[:ro]",
                     help="mount an existing PersistentVolumeClaim at PATH (repeatable)")
    k8s.add_argument("--checkpoint-claim", type=str, metavar="CLAIM",
                     help="mount this PersistentVolumeClaim on the servers at "
                     "PSKV_CHECKPOINT_DIR (default /var/lib/pskv/checkpoints)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the worker command and its arguments")
    return p


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> LaunchSpec:
    """Parse pskv-launch's command line into a LaunchSpec.

    Parameters
    ----------
    argv : sequence of str, optional
        Without the program name; ``sys.argv[1:]`` by default.
    environ : mapping, optional
        For ``--env VAR`` without a value (``os.environ`` by default).

    Raises
    ------
    ConfigError
        A bad flag, value or missing command; the message says what to do.

    Examples
    --------
    >>> spec = parse_args(['-n', '2', '--env', 'A:1', 'python', 'train.py', '--lr', '0.1'])
    >>> spec.num_workers, spec.num_servers, spec.env, spec.command
    (2, 2, (('A', '1'),), ('python', 'train.py', '--lr', '0.1'))
    """
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if cli_request(args) is not None:
        raise ConfigError("--remove-server, --add-server and --status ask a running job, "
                          "they launch none. Run them with pskv-launch (main), or call "
                          "pskv.launch.control(path, request, server).")
    return _spec(args, os.environ if environ is None else environ)


def _spec(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchSpec:
    if args.num_workers is None:
        raise ConfigError("the following arguments are required: -n/-np/--num-workers. "
                          "See pskv-launch --help.")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.sync_dst_dir is not None:
        logger.warning("--sync-dst-dir %s is ignored: pskv does not copy files to the hosts; "
                       "make the command available there yourself", args.sync_dst_dir)
    server_command = DEFAULT_SERVER_COMMAND
    if args.server_command is not None:
        try:
            server_command = tuple(shlex.split(args.server_command))
        except ValueError as err:
            raise ConfigError(f"--server-command {args.server_command!r}: {err}. Quote it "
                              "as one argument.") from None
    hostfile, hosts = args.hostfile, None
    if hostfile is not None and is_host_list(hostfile):
        hostfile, hosts = None, args.hostfile
    return LaunchSpec(
        tuple(command), args.num_workers, args.num_servers, launcher=args.launcher,
        hostfile=hostfile, hosts=hosts, log_dir=args.log_dir,
        log_level=args.log_level or log_level(env),
        env=tuple(parse_env_pair(e, "--env", env) for e in args.env),
        env_server=tuple(parse_env_pair(e, "--env-server", env) for e in args.env_server),
        env_worker=tuple(parse_env_pair(e, "--env-worker", env) for e in args.env_worker),
        timeout=args.timeout, port=args.port, host_ip=args.host_ip,
        server_command=server_command, image=args.image, namespace=args.namespace,
        job_name=args.job_name, dry_run=args.dry_run, max_restarts=args.max_restarts,
        control=args.control,
        sinks=tuple(args.sink), pods=pod_options(args.values, restart_policy=args.restart_policy,
                         service_account=args.service_account,
                         image_pull_secrets=args.image_pull_secret, labels=args.label,
                         annotations=args.annotation, requests=args.requests,
                         limits=args.limits, node_selectors=args.node_selector,
                         tolerations=args.toleration, claims=args.claim,
                         checkpoint_claim=args.checkpoint_claim))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``pskv-launch`` command; returns the exit status (see LaunchResult.returncode).

    A bad command line returns 2; a command that cannot be found returns 127, one that
    cannot be executed 126, as a shell would. With ``--control PATH`` and one of
    ``--remove-server R``, ``--add-server R`` or ``--status`` it asks the running job at
    PATH instead, prints its JSON reply and returns 0 when the reply is ok, else 1.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="pskv-launch %(levelname)s: %(message)s")
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        request = cli_request(args)
        if request is not None:
            return ask_cli(args, *request)
        spec = _spec(args, os.environ)
        logging.getLogger("pskv").setLevel(spec.log_level or logging.INFO)
        return launch_spec(spec).returncode
    except CommandError as err:
        logger.error("%s", err)
        if isinstance(err.__cause__, FileNotFoundError):
            return 127
        return 126
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
