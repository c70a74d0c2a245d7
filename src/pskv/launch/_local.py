"""The local launcher: scheduler, servers and workers all on this machine, at 127.0.0.1."""
from __future__ import annotations

from typing import Mapping

from .._ps.config import Role
from ._env import cluster_env, local_ranks, omp_default
from ._spec import LaunchSpec, ProcessSpec

__all__ = ["LOCAL_HOST", "local_processes"]

LOCAL_HOST = "127.0.0.1"


def local_processes(spec: LaunchSpec, *, port: int, secret: str,
                    environ: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """Scheduler, servers and workers of `spec`, all on this machine at 127.0.0.1.

    Workers get torchrun's variables (`pskv.launch._env.cluster_env`); with `environ` (the
    launcher's environment) also ``OMP_NUM_THREADS=1`` where torchrun would set it.

    Examples
    --------
    >>> spec = LaunchSpec(('python', 'train.py'), 2, 1, server_command=('srv',))
    >>> for p in local_processes(spec, port=9000, secret='s'):
    ...     print(p.label, p.argv, dict(p.env)['DMLC_ROLE'])
    scheduler ('srv',) scheduler
    server 0 ('srv',) server
    worker 0 ('python', 'train.py') worker
    worker 1 ('python', 'train.py') worker
    """
    locals_ = local_ranks([LOCAL_HOST] * spec.num_workers)
    omp = environ is not None and omp_default(spec, environ, locals_)

    def env(role: Role, rank: int | None = None) -> tuple[tuple[str, str], ...]:
        local = locals_[rank] if role is Role.WORKER and rank is not None else None
        return tuple(cluster_env(spec, role, root_uri=LOCAL_HOST, port=port, secret=secret,
                                 rank=rank, local=local, omp=omp).items())

    procs = [ProcessSpec(Role.SCHEDULER, 0, spec.server_command, env(Role.SCHEDULER))]
    procs += [ProcessSpec(Role.SERVER, i, spec.server_command, env(Role.SERVER, i))
              for i in range(spec.num_servers or 0)]
    procs += [ProcessSpec(Role.WORKER, i, spec.command, env(Role.WORKER, i))
              for i in range(spec.num_workers)]
    return procs
