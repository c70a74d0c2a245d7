"""The mpi launcher: the scheduler here, one ``mpirun`` for the servers, one for the workers.

As dmlc_tracker's mpi.py, each role is one ``mpirun -n N [--hostfile F] ... CMD`` with the
cluster variables exported OpenMPI style. pskv exports them by name (``-x VAR``), with the
values in mpirun's own environment, so that the job secret never shows on a command line.
Ranks inside a role are assigned by the scheduler, as in ps-lite.
"""
from __future__ import annotations

from typing import Mapping

from .._ps.config import Role
from ._env import cluster_env, forwarded_env, scheduler_here
from ._spec import LaunchSpec, ProcessSpec

__all__ = ["mpirun_argv", "mpi_processes"]


def mpirun_argv(num: int, hostfile: str | None, names: list[str],
                command: tuple[str, ...], hosts: str | None = None) -> tuple[str, ...]:
    """``mpirun -n NUM [--hostfile F] -x NAME ... COMMAND``.

    Examples
    --------
    >>> mpirun_argv(2, 'hosts', ['A', 'B'], ('python', 'x.py'))
    ('mpirun', '-n', '2', '--hostfile', 'hosts', '-x', 'A', '-x', 'B', 'python', 'x.py')
    """
    argv = ["mpirun", "-n", str(num)]
    if hostfile:
        argv += ["--hostfile", hostfile]
    if hosts:
        argv += ["--host", hosts]  # OpenMPI takes host:slots lists as horovodrun does
    for name in names:
        argv += ["-x", name]
    return (*argv, *command)


def mpi_processes(spec: LaunchSpec, *, port: int, secret: str, root_uri: str,
                  environ: Mapping[str, str]) -> list[ProcessSpec]:
    """The local scheduler, an ``mpirun`` of the servers and an ``mpirun`` of the workers.

    Parameters
    ----------
    spec : LaunchSpec
        Its hostfile (optional for mpi) is passed to mpirun as it is.
    port : int
    secret : str
    root_uri : str
        This machine's address as the hosts reach it.
    environ : mapping
        The launcher's environment; see `forwarded_env`.

    Returns
    -------
    list of ProcessSpec
    """
    procs = [scheduler_here(spec, port=port, secret=secret, root_uri=root_uri)]
    forwarded = forwarded_env(environ)
    for role, num, command in ((Role.SERVER, spec.num_servers or 0, spec.server_command),
                               (Role.WORKER, spec.num_workers, spec.command)):
        env = dict(forwarded)
        env.update(cluster_env(spec, role, root_uri=root_uri, port=port, secret=secret))
        argv = mpirun_argv(num, spec.hostfile, list(env), command, spec.hosts)
        procs.append(ProcessSpec(role, None, argv, tuple(env.items())))
    return procs
