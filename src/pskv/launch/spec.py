"""What a launch is made of: the job (`LaunchSpec`), its processes (`ProcessSpec`) and hosts.

Invariant: a LaunchSpec is frozen and validated; the launchers (local, ssh, mpi) turn it into
a list of ProcessSpec, the argv and environment of each process this machine starts, without
starting anything, so the unit tests can check every command line.
"""
from __future__ import annotations

import ipaddress
import re
import secrets
import socket
import sys
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping

from .._ps.config import (ENV_BIGARRAY_BOUND, ENV_NODE_HOST, ENV_NUM_SERVER, ENV_NUM_WORKER,
                          ENV_ROLE, ENV_ROOT_PORT, ENV_ROOT_URI, ENV_SECRET, Role)
from ..errors import ConfigError

__all__ = [
    "DEFAULT_SERVER_COMMAND", "Host", "LaunchSpec", "LauncherName", "ProcessSpec",
    "RESERVED_ENV", "cluster_env", "forwarded_env", "free_port", "get_secret", "guess_host_ip",
    "parse_env_pair", "parse_hostfile", "read_hostfile", "scheduler_here",
]

LauncherName = Literal["local", "ssh", "mpi"]
LAUNCHERS: tuple[str, ...] = ("local", "ssh", "mpi")

#: scheduler and servers run this, not the user's script (STYLE.md "Launcher entry points")
DEFAULT_SERVER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pskv.server")

#: the launcher owns these; ``--env`` may not set them (use -n, -s, --port instead)
RESERVED_ENV: frozenset[str] = frozenset(
    {ENV_ROLE, ENV_ROOT_URI, ENV_ROOT_PORT, ENV_NUM_SERVER, ENV_NUM_WORKER})

#: remote processes (ssh, mpi) get these from the launcher's environment when set: pskv's own
#: settings, and what dmlc_tracker's ssh.py passes by default (minus the AWS credentials)
FORWARD_PREFIX = "PSKV_"
FORWARD_NAMES: tuple[str, ...] = (ENV_BIGARRAY_BOUND, "OMP_NUM_THREADS", "LD_LIBRARY_PATH",
                                  "DMLC_INTERFACE")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

EnvPairs = tuple[tuple[str, str], ...]


def _check_env_name(name: str, flag: str) -> None:
    if not _ENV_NAME.match(name):
        raise ConfigError(f"{flag} {name!r}: {name!r} is not an environment variable name. "
                          "Use letters, digits and underscores, e.g. OMP_NUM_THREADS:4.")
    if name in RESERVED_ENV:
        raise ConfigError(f"{flag} {name}: the launcher sets {name} itself. Use -n, -s and "
                          "--port to change the cluster, not --env.")


def _pairs(env: Mapping[str, str] | Iterable[tuple[str, str]], flag: str) -> EnvPairs:
    items = env.items() if isinstance(env, Mapping) else env
    out: list[tuple[str, str]] = []
    for name, value in items:
        _check_env_name(name, flag)
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
    launcher : {'local', 'ssh', 'mpi'}, optional
        Defaults to ``'ssh'`` when a `hostfile` is given, else ``'local'``.
    hostfile : str, optional
        Hosts for ssh and mpi, one ``host[:port]`` or ``host slots=N`` a line.
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
    shutdown_timeout : float
        Seconds the scheduler and servers get to exit by themselves once every worker
        has exited 0; then they are killed and the job still succeeds.

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
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__, as attrs converters do
        setattr_ = object.__setattr__
        setattr_(self, "command", tuple(str(c) for c in self.command))
        setattr_(self, "server_command", tuple(str(c) for c in self.server_command))
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
            setattr_(self, "launcher", "ssh" if self.hostfile else "local")
        elif self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} is not supported. Use one of "
                              f"{', '.join(LAUNCHERS)}.")
        if self.launcher == "ssh" and not self.hostfile:
            raise ConfigError("--launcher ssh needs a hostfile. Pass -H hosts.txt with one "
                              "host[:port] a line, or use --launcher local.")
        if self.launcher == "local" and self.hostfile:
            raise ConfigError("--launcher local runs every process on this machine and takes "
                              "no hostfile. Drop -H, or use --launcher ssh or mpi.")
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
        if self.secret is not None and not self.secret:
            raise ConfigError("secret is empty. Leave it out to generate one per job.")
        if self.host_ip is not None:
            try:
                ipaddress.ip_address(self.host_ip)
            except ValueError:
                if not re.fullmatch(r"[A-Za-z0-9.-]+", self.host_ip):
                    raise ConfigError(f"--host-ip {self.host_ip!r} is neither an IP address "
                                      "nor a host name.") from None


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process this machine starts.

    Attributes
    ----------
    role : Role
        The DMLC_ROLE of the process (for an ``mpirun`` process, of all it starts).
    rank : int or None
        Launch order within the role; None for an ``mpirun`` that starts the whole role.
    argv : tuple of str
        The command line, run without a shell.
    env : tuple of (name, value)
        Set on top of the launcher's own environment.
    stdin : bytes or None
        Written to the process's stdin, which is then closed (None: /dev/null).
    """

    role: Role
    rank: int | None
    argv: tuple[str, ...]
    env: EnvPairs = ()
    stdin: bytes | None = None

    @property
    def label(self) -> str:
        """The output prefix without brackets: ``scheduler``, ``server 0``, ``worker 1``."""
        if self.role is Role.SCHEDULER:
            return "scheduler"
        if self.rank is None:
            return f"{self.role.value}s"
        return f"{self.role.value} {self.rank}"


@dataclass(frozen=True, slots=True)
class Host:
    """A hostfile entry: ``name`` reached by ssh on ``port``; ``slots`` is for mpirun."""

    name: str
    port: int = 22
    slots: int = 1


def parse_env_pair(text: str, flag: str = "--env",
                   environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Parse ``VAR:VALUE`` (split at the first colon), or ``VAR`` to pass its current value.

    The bare ``VAR`` form is tools/launch.py's ``--env``: it forwards the launcher's value.

    Examples
    --------
    >>> parse_env_pair('OMP_NUM_THREADS:4')
    ('OMP_NUM_THREADS', '4')
    >>> parse_env_pair('URL:http://a:1')
    ('URL', 'http://a:1')
    >>> parse_env_pair('HOME', environ={'HOME': '/root'})
    ('HOME', '/root')
    """
    name, sep, value = text.partition(":")
    name = name.strip()
    _check_env_name(name, flag)
    if sep:
        return name, value
    env = {} if environ is None else environ
    if name not in env:
        raise ConfigError(f"{flag} {name}: {name} is not set here, so there is no value to "
                          f"pass on. Set it, or give the value as {flag} {name}:VALUE.")
    return name, env[name]


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile lines: ``host``, ``host:port``, ``[v6addr]:port`` or ``host slots=N``.

    Blank lines and ``#`` comments are skipped.

    Examples
    --------
    >>> for host in parse_hostfile('a\\nb:2222  # comment\\n\\nc slots=4\\n'):
    ...     print(host)
    Host(name='a', port=22, slots=1)
    Host(name='b', port=2222, slots=1)
    Host(name='c', port=22, slots=4)
    """
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno} ({raw.strip()!r})"
        fields = line.split()
        addr, port, slots = fields[0], 22, 1
        for extra in fields[1:]:
            key, eq, value = extra.partition("=")
            if key in ("slots", "max_slots", "max-slots") and eq and value.isdigit() \
                    and int(value) > 0:
                if key == "slots":
                    slots = int(value)
            else:
                raise ConfigError(f"{where}: cannot read {extra!r}. Write host, host:port "
                                  "or host slots=N, one a line.")
        if addr.startswith("["):
            inner, close, rest = addr[1:].partition("]")
            if not close or (rest and not rest.startswith(":")):
                raise ConfigError(f"{where}: write an IPv6 host as [addr] or [addr]:port.")
            addr, port_text = inner, rest[1:]
        elif addr.count(":") == 1:
            addr, port_text = addr.split(":")
        else:
            port_text = ""  # a bare IPv6 address has no port
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ConfigError(f"{where}: {port_text!r} is not an ssh port (1-65535).")
            port = int(port_text)
        if not addr:
            raise ConfigError(f"{where}: the host name is empty.")
        hosts.append(Host(addr, port, slots))
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read and parse a hostfile; an unreadable or empty one is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read hostfile {path!r}: {err.strerror}. Pass -H with a "
                          "readable file of one host a line.") from err
    hosts = parse_hostfile(text, path)
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts. Write one host[:port] a line.")
    return hosts


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free on `host` now (as torch.distributed picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def guess_host_ip() -> str:
    """This machine's first non-loopback IPv4 address, for hosts to reach the scheduler.

    A UDP ``connect`` sends nothing; it only asks the kernel which source address it would
    use (dmlc_tracker's get_host_ip does the same).
    """
    candidates: list[str] = []
    for target in ("10.255.255.255", "192.0.2.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 1))
                candidates.append(sock.getsockname()[0])
        except OSError:
            continue
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for ip in candidates:
        if not ipaddress.ip_address(ip).is_loopback and ip != "0.0.0.0":
            return ip
    raise ConfigError("cannot find a non-loopback address of this machine for the hosts to "
                      "reach the scheduler. Pass --host-ip ADDRESS.")


def get_secret(spec: LaunchSpec, environ: Mapping[str, str]) -> str:
    """The job secret: the spec's, else ``--env PSKV_SECRET:...``, else ``PSKV_SECRET`` from
    `environ`, else a new ``secrets.token_hex(32)``."""
    return (spec.secret or dict(spec.env).get(ENV_SECRET) or environ.get(ENV_SECRET)
            or secrets.token_hex(32))


def cluster_env(spec: LaunchSpec, role: Role, *, root_uri: str, port: int,
                secret: str | None) -> dict[str, str]:
    """The variables one process of `role` gets, in precedence order (later wins).

    ``--env``, then ``--env-server`` (scheduler and servers) or ``--env-worker``, then the
    cluster variables the launcher owns. `secret` None leaves ``PSKV_SECRET`` out (the ssh
    launcher sends it on stdin so that it never shows in a command line).

    Examples
    --------
    >>> spec = LaunchSpec(('true',), 2, 1, env=(('A', '1'),))
    >>> env = cluster_env(spec, Role.WORKER, root_uri='127.0.0.1', port=9000, secret='s')
    >>> env['DMLC_ROLE'], env['DMLC_NUM_WORKER'], env['A'], env['PSKV_SECRET']
    ('worker', '2', '1', 's')
    """
    env: dict[str, str] = dict(spec.env)
    env.update(spec.env_worker if role is Role.WORKER else spec.env_server)
    env.update({
        ENV_ROLE: role.value,
        ENV_ROOT_URI: root_uri,
        ENV_ROOT_PORT: str(port),
        ENV_NUM_SERVER: str(spec.num_servers),
        ENV_NUM_WORKER: str(spec.num_workers),
    })
    if secret is not None:
        env[ENV_SECRET] = secret
    return env


def scheduler_here(spec: LaunchSpec, *, port: int, secret: str, root_uri: str) -> ProcessSpec:
    """The scheduler of an ssh or mpi job: on this machine, at ``root_uri``."""
    env = cluster_env(spec, Role.SCHEDULER, root_uri=root_uri, port=port, secret=secret)
    env[ENV_NODE_HOST] = root_uri
    return ProcessSpec(Role.SCHEDULER, 0, spec.server_command, tuple(env.items()))


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that remote processes inherit (never ``PSKV_SECRET``).

    Examples
    --------
    >>> forwarded_env({'PSKV_CONNECT_TIMEOUT': '9', 'PSKV_SECRET': 'x', 'HOME': '/root'})
    {'PSKV_CONNECT_TIMEOUT': '9'}
    """
    return {name: value for name, value in sorted(environ.items())
            if (name.startswith(FORWARD_PREFIX) or name in FORWARD_NAMES)
            and name != ENV_SECRET and _ENV_NAME.match(name)}
