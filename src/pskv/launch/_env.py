"""The environment each process of a job gets: cluster variables, ``--env``, the secret.

Invariant: the launcher alone sets the variables in `RESERVED_ENV`; later settings win
(``--env``, then ``--env-server``/``--env-worker``, then the cluster variables), and the job
secret never reaches a command line. Workers also get torchrun's variables (`TORCH_NAMES`):
``RANK`` is the worker's rank, ``WORLD_SIZE`` the number of workers, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` count the workers on the same host; and, as torchrun does,
``OMP_NUM_THREADS=1`` where a host runs several workers and the user did not set it.
"""
from __future__ import annotations

import logging
import secrets
from typing import Mapping, Sequence

from .._ps.config import (ENV_BIGARRAY_BOUND, ENV_NODE_HOST, ENV_NUM_SERVER, ENV_NUM_WORKER,
                          ENV_ROLE, ENV_ROOT_PORT, ENV_ROOT_URI, ENV_SECRET, ENV_SERVER_ID,
                          ENV_WORKER_ID, ENV_LOG_LEVEL, Role)
from ..errors import ConfigError
from ._spec import ENV_NAME, LaunchSpec, ProcessSpec, check_env_name

__all__ = ["ENV_LOCAL_RANK", "ENV_LOCAL_WORLD_SIZE", "ENV_OMP_NUM_THREADS", "ENV_RANK",
           "ENV_WORLD_SIZE", "FORWARD_NAMES", "FORWARD_PREFIX", "OMP_NOTICE", "TORCH_NAMES",
           "cluster_env", "forwarded_env", "get_secret", "local_ranks", "omp_default",
           "parse_env_pair", "scheduler_here"]

logger = logging.getLogger(__name__)

# torchrun's variables (torch.distributed.run), which torch.distributed's env:// reads
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: the variables every worker gets as torchrun's workers do (the local two where known)
TORCH_NAMES = (ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE)
#: torchrun's notice, word for word, on one line: logged (INFO, which pskv-launch shows)
#: once when the launcher sets OMP_NUM_THREADS=1
OMP_NOTICE = ("Setting OMP_NUM_THREADS environment variable for each process to be "
              "%s in default, to avoid your system being overloaded, "
              "please further tune the variable for optimal performance in "
              "your application as needed.")

#: remote processes (ssh, mpi) get these from the launcher's environment when set: pskv's own
#: settings, and what dmlc_tracker's ssh.py passes by default (minus the AWS credentials)
FORWARD_PREFIX = "PSKV_"
FORWARD_NAMES: tuple[str, ...] = (ENV_BIGARRAY_BOUND, "OMP_NUM_THREADS", "LD_LIBRARY_PATH",
                                  "DMLC_INTERFACE")


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
    check_env_name(name, flag)
    if sep:
        return name, value
    env = {} if environ is None else environ
    if name not in env:
        raise ConfigError(f"{flag} {name}: {name} is not set here, so there is no value to "
                          f"pass on. Set it, or give the value as {flag} {name}:VALUE.")
    return name, env[name]


def get_secret(spec: LaunchSpec, environ: Mapping[str, str]) -> str:
    """The job secret: the spec's, else ``--env PSKV_SECRET:...``, else ``PSKV_SECRET`` from
    `environ`, else a new ``secrets.token_hex(32)``."""
    return (spec.secret or dict(spec.env).get(ENV_SECRET) or environ.get(ENV_SECRET)
            or secrets.token_hex(32))


def local_ranks(hosts: Sequence[str]) -> list[tuple[int, int]]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` of each worker, given the host of each in rank order.

    Examples
    --------
    >>> local_ranks(['a', 'b', 'a'])
    [(0, 2), (0, 1), (1, 2)]
    """
    counts: dict[str, int] = {}
    out = []
    for host in hosts:
        out.append(counts.get(host, 0))
        counts[host] = out[-1] + 1
    return [(lr, counts[h]) for lr, h in zip(out, hosts)]


def omp_default(spec: LaunchSpec, environ: Mapping[str, str],
                locals_: Sequence[tuple[int, int]]) -> bool:
    """Whether workers get ``OMP_NUM_THREADS=1`` (and the launcher logs `OMP_NOTICE`).

    As torchrun: when a host runs more than one worker and ``OMP_NUM_THREADS`` is set
    neither in the launcher's environment nor by ``--env``/``--env-worker``; logs the
    notice once when it says yes.

    Examples
    --------
    >>> spec = LaunchSpec(('true',), 2, 1)
    >>> omp_default(spec, {'OMP_NUM_THREADS': '4'}, [(0, 2), (1, 2)])
    False
    >>> omp_default(spec, {}, [(0, 1), (0, 1)])
    False
    """
    user_set = (ENV_OMP_NUM_THREADS in environ or ENV_OMP_NUM_THREADS in dict(spec.env)
                or ENV_OMP_NUM_THREADS in dict(spec.env_worker))
    if user_set or max((world for _, world in locals_), default=0) <= 1:
        return False
    logger.info(OMP_NOTICE, 1)
    return True


def cluster_env(spec: LaunchSpec, role: Role, *, root_uri: str, port: int,
                secret: str | None, rank: int | None = None,
                local: tuple[int, int] | None = None, omp: bool = False) -> dict[str, str]:
    """The variables one process of `role` gets, in precedence order (later wins).

    ``--env``, then ``--env-server`` (scheduler and servers) or ``--env-worker``, then the
    cluster variables the launcher owns. `secret` None leaves ``PSKV_SECRET`` out (the ssh
    launcher sends it on stdin so that it never shows in a command line). A `rank` becomes
    ``DMLC_WORKER_ID`` or ``DMLC_SERVER_ID``: the scheduler gives the process that rank.
    A worker also gets ``WORLD_SIZE``, ``RANK`` (with a `rank`), ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (from `local`), and ``OMP_NUM_THREADS=1`` with `omp`
    (see `omp_default`).

    Examples
    --------
    >>> spec = LaunchSpec(('true',), 2, 1, env=(('A', '1'),))
    >>> env = cluster_env(spec, Role.WORKER, root_uri='127.0.0.1', port=9000, secret='s')
    >>> env['DMLC_ROLE'], env['DMLC_NUM_WORKER'], env['A'], env['PSKV_SECRET']
    ('worker', '2', '1', 's')
    >>> env = cluster_env(spec, Role.WORKER, root_uri='h', port=1, secret=None, rank=1,
    ...                   local=(1, 2), omp=True)
    >>> [env[n] for n in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',
    ...                   'OMP_NUM_THREADS')]
    ['1', '2', '1', '2', '1']
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
    if spec.log_level is not None:
        env[ENV_LOG_LEVEL] = spec.log_level
    if rank is not None and role is not Role.SCHEDULER:
        env[ENV_WORKER_ID if role is Role.WORKER else ENV_SERVER_ID] = str(rank)
    if secret is not None:
        env[ENV_SECRET] = secret
    if role is Role.WORKER:
        if omp:
            env[ENV_OMP_NUM_THREADS] = "1"
        env[ENV_WORLD_SIZE] = str(spec.num_workers)
        if rank is not None:
            env[ENV_RANK] = str(rank)
        if local is not None:
            env[ENV_LOCAL_RANK], env[ENV_LOCAL_WORLD_SIZE] = str(local[0]), str(local[1])
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
            and name != ENV_SECRET and ENV_NAME.match(name)}
