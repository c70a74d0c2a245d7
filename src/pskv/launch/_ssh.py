"""The ssh launcher: the scheduler here, servers and workers on the hostfile's hosts.

Placement follows dmlc_tracker's ssh.py: process i of the ``num_servers + num_workers``
(servers first) runs on ``hosts[i % len(hosts)]``, with ``DMLC_NODE_HOST`` set to that host.
Each remote process is one local ``ssh`` client whose remote command is a single string
built with `shlex.quote`; the job secret goes to it on stdin, never on a command line (a
command line shows in ``ps`` on both machines). The remote login shell must be POSIX sh
compatible, as dmlc_tracker assumes.

Stopping the ``ssh`` client does not stop the remote process (no tty is allocated, so it
gets no SIGHUP); a pskv scheduler, server or worker exits by itself once it loses the
scheduler (heartbeats, ``PSKV_HEARTBEAT_TIMEOUT``).
"""
from __future__ import annotations

import shlex
from typing import Mapping, Sequence

from .._ps.config import ENV_NODE_HOST, ENV_SECRET, Role
from ._env import cluster_env, forwarded_env, local_ranks, omp_default, scheduler_here
from ._hosts import Host, place
from ._spec import LaunchSpec, ProcessSpec

__all__ = ["SSH_OPTIONS", "remote_command", "ssh_processes"]

#: StrictHostKeyChecking=no as dmlc_tracker; BatchMode=yes so that a host that wants a
#: password fails at once instead of hanging the job on a prompt nobody sees
SSH_OPTIONS: tuple[str, ...] = ("-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes")


def remote_command(cwd: str, env: Mapping[str, str], argv: Sequence[str], *,
                   secret_on_stdin: bool = True) -> str:
    """The string the remote shell runs: cd, read the secret, export, exec.

    Examples
    --------
    >>> print(remote_command('/my dir', {'A': "it's"}, ['python', 'x.py'],
    ...                      secret_on_stdin=False))
    cd '/my dir' && export A='it'"'"'s' && exec python x.py
    """
    parts = [f"cd {shlex.quote(cwd)}"]
    if secret_on_stdin:
        parts.append(f"IFS= read -r {ENV_SECRET} && export {ENV_SECRET}")
    if env:
        parts.append("export " + " ".join(f"{name}={shlex.quote(value)}"
                                          for name, value in env.items()))
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)


def ssh_processes(spec: LaunchSpec, hosts: Sequence[Host], *, port: int, secret: str,
                  root_uri: str, cwd: str,
                  environ: Mapping[str, str]) -> list[ProcessSpec]:
    """The local scheduler and one ``ssh`` client per remote server and worker.

    Parameters
    ----------
    spec : LaunchSpec
    hosts : sequence of Host
        From the hostfile, in order.
    port : int
        The scheduler's port on `root_uri`.
    secret : str
        The job secret; remote processes read it from stdin.
    root_uri : str
        This machine's address as the hosts reach it.
    cwd : str
        The remote working directory (the launcher's, as dmlc_tracker).
    environ : mapping
        The launcher's environment; see `forwarded_env`.

    Returns
    -------
    list of ProcessSpec
    """
    procs = [scheduler_here(spec, port=port, secret=secret, root_uri=root_uri)]
    forwarded = forwarded_env(environ)
    stdin = (secret + "\n").encode()
    placed = place(spec.num_servers or 0, spec.num_workers, hosts)
    locals_ = local_ranks([h.name for role, _, h in placed if role is Role.WORKER])
    omp = omp_default(spec, environ, locals_)
    for role, rank, host in placed:
        env = dict(forwarded)
        env.update(cluster_env(spec, role, root_uri=root_uri, port=port, secret=None,
                               rank=rank, local=locals_[rank] if role is Role.WORKER else None,
                               omp=omp))
        env[ENV_NODE_HOST] = host.name
        command = spec.server_command if role is Role.SERVER else spec.command
        argv = ("ssh", *SSH_OPTIONS, "-p", str(host.port), host.name,
                remote_command(cwd, env, command))
        procs.append(ProcessSpec(role, rank, argv, (), stdin, host.name))
    return procs
