"""The local launcher: scheduler, servers and workers all on this machine, at 127.0.0.1."""
from __future__ import annotations

from .._ps.config import Role
from .env import cluster_env
from .spec import LaunchSpec, ProcessSpec

__all__ = ["LOCAL_HOST", "local_processes"]

LOCAL_HOST = "127.0.0.1"


def local_processes(spec: LaunchSpec, *, port: int, secret: str) -> list[ProcessSpec]:
    """Scheduler, servers and workers of `spec`, all on this machine at 127.0.0.1.

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
    def env(role: Role, rank: int | None = None) -> tuple[tuple[str, str], ...]:
        return tuple(cluster_env(spec, role, root_uri=LOCAL_HOST, port=port, secret=secret,
                                 rank=rank).items())

    procs = [ProcessSpec(Role.SCHEDULER, 0, spec.server_command, env(Role.SCHEDULER))]
    procs += [ProcessSpec(Role.SERVER, i, spec.server_command, env(Role.SERVER, i))
              for i in range(spec.num_servers or 0)]
    procs += [ProcessSpec(Role.WORKER, i, spec.command, env(Role.WORKER, i))
              for i in range(spec.num_workers)]
    return procs
