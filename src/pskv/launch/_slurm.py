"""The slurm launcher: inside an allocation, one ``srun`` job step per process.

``salloc -N 2 -n 8 pskv-launch --launcher slurm -n 4 -s 2 python train.py`` (or the same
line in an sbatch script) runs the scheduler on the allocation's first node and places the
servers, then the workers, round-robin over its nodes (dmlc_tracker's order, as the ssh
launcher). The nodes come from ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST`` on older Slurm),
expanded by ``scontrol show hostnames``.

Each process is a one-task step, ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap
--export=ALL CMD``: ``--overlap`` (Slurm 20.11 and later) lets the job's steps share the
allocation's CPUs, as a scheduler, servers and workers must; ``--export=ALL`` sends srun's
own environment, where the supervisor puts the cluster variables and the job secret, so that
neither shows on a command line (and an sbatch ``--export=NONE`` does not strip them).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from typing import Callable, Mapping, Sequence

from .._ps.config import Role
from ..errors import ConfigError
from ._net import free_port
from ._env import cluster_env, local_ranks, omp_default
from ._hosts import Host, place
from ._spec import LaunchSpec, ProcessSpec

__all__ = ["NODELIST_ENV", "SRUN_OPTIONS", "allocation_nodelist", "build_slurm",
           "expand_nodelist",
           "parse_nodelist", "scheduler_port", "slurm_processes", "srun_argv"]

logger = logging.getLogger(__name__)

#: where an allocation lists its nodes, newest name first
NODELIST_ENV: tuple[str, ...] = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: every step: share the allocation's CPUs with the other steps, kill the step when its task
#: fails, and pass srun's whole environment on
SRUN_OPTIONS: tuple[str, ...] = ("--overlap", "--kill-on-bad-exit=1", "--export=ALL")
#: the scheduler's port when the launcher does not run on the first node and so cannot ask
#: that node's OS for a free one: this plus the job id modulo 1000 (jobs sharing a node
#: differ)
PORT_BASE = 9000
SCONTROL_TIMEOUT_S = 30.0

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def allocation_nodelist(environ: Mapping[str, str]) -> str:
    """The allocation's compressed node list; ConfigError outside an allocation.

    Examples
    --------
    >>> allocation_nodelist({'SLURM_JOB_ID': '7', 'SLURM_JOB_NODELIST': 'n[1-2]'})
    'n[1-2]'
    """
    for name in NODELIST_ENV:
        if environ.get(name):
            return environ[name]
    raise ConfigError("--launcher slurm runs inside a Slurm allocation, and this is none "
                      f"({' and '.join(NODELIST_ENV)} are unset). Run it inside salloc or "
                      "sbatch, e.g. salloc -N 2 -n 8 pskv-launch --launcher slurm -n 4 -s 2 "
                      "python train.py.")


_RANGE = re.compile(r"(\d+)(?:-(\d+))?\Z")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-03,7],gpu1`` without scontrol.

    Ranges keep their zero padding, as Slurm's do. Used where ``scontrol`` is missing.

    Examples
    --------
    >>> parse_nodelist('node[01-03,7],gpu1')
    ['node01', 'node02', 'node03', 'node7', 'gpu1']
    >>> parse_nodelist('rack[1-2]-n[1-2]')
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    out: list[str] = []
    for item in _split_top(text.strip()):
        names = [""]
        rest = item
        while rest:
            open_ = rest.find("[")
            if open_ < 0:
                names = [n + rest for n in names]
                break
            close = rest.find("]", open_)
            if close < 0:
                raise ConfigError(f"cannot read the Slurm node list {text!r}: a '[' is not "
                                  "closed. Check SLURM_JOB_NODELIST.")
            prefix, body, rest = rest[:open_], rest[open_ + 1:close], rest[close + 1:]
            expanded: list[str] = []
            for part in body.split(","):
                m = _RANGE.match(part)
                if not m:
                    raise ConfigError(f"cannot read the Slurm node list {text!r}: {part!r} "
                                      "is not a number or a range. Check SLURM_JOB_NODELIST.")
                lo, hi = m.group(1), m.group(2) or m.group(1)
                width = len(lo)
                expanded += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
            names = [n + prefix + e for n in names for e in expanded]
        out += names
    return out


def expand_nodelist(text: str, *, run: Runner | None = None) -> list[str]:
    """The node names of a Slurm host list: ``scontrol show hostnames``, else parsed here.

    Raises
    ------
    ConfigError
        scontrol fails, or the list is empty.
    """
    run = subprocess.run if run is None else run
    try:
        done = run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                   timeout=SCONTROL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        logger.debug("scontrol not found; expanding %r here", text)
        nodes = parse_nodelist(text)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"scontrol show hostnames {text} did not answer within "
                          f"{SCONTROL_TIMEOUT_S:g} s. Check that slurmctld is reachable "
                          "(scontrol ping).") from None
    else:
        if done.returncode != 0:
            raise ConfigError(f"scontrol show hostnames {text} failed (status "
                              f"{done.returncode}): {done.stderr.strip()}. Check "
                              "SLURM_JOB_NODELIST and that slurmctld is reachable.")
        nodes = done.stdout.split()
    if not nodes:
        raise ConfigError(f"the Slurm node list {text!r} names no node. Check "
                          "SLURM_JOB_NODELIST.")
    return nodes


def srun_argv(node: str, command: Sequence[str], label: str) -> tuple[str, ...]:
    """One process as a one-task step on `node`.

    Examples
    --------
    >>> srun_argv('n1', ['python', 'x.py'], 'worker 0')  # doctest: +NORMALIZE_WHITESPACE
    ('srun', '--nodes=1', '--ntasks=1', '--nodelist=n1', '--job-name=pskv-worker-0',
     '--overlap', '--kill-on-bad-exit=1', '--export=ALL', 'python', 'x.py')
    """
    return ("srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            f"--job-name=pskv-{label.replace(' ', '-')}", *SRUN_OPTIONS, *command)


def _short(name: str) -> str:
    return name.split(".", 1)[0]


def scheduler_port(spec: LaunchSpec, first_node: str, environ: Mapping[str, str]) -> int:
    """``--port``; else a free port here when this is the first node; else PORT_BASE + job id.

    Examples
    --------
    >>> spec = LaunchSpec(('x',), 1, launcher='slurm')
    >>> scheduler_port(spec, 'not-this-host.invalid', {'SLURM_JOB_ID': '1234'})
    9234
    """
    if spec.port:
        return spec.port
    if _short(first_node) == _short(socket.gethostname()):
        return free_port("0.0.0.0")
    job = environ.get("SLURM_JOB_ID", "")
    return PORT_BASE + (int(job) % 1000 if job.isdigit() else 0)


def slurm_processes(spec: LaunchSpec, nodes: Sequence[str], *, port: int,
                    secret: str, environ: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """The scheduler on ``nodes[0]``, servers then workers round-robin over `nodes`.

    With `environ` (the launcher's), ``OMP_NUM_THREADS=1`` where torchrun would set it.

    Parameters
    ----------
    spec : LaunchSpec
    nodes : sequence of str
        The allocation's nodes, in Slurm's order.
    port : int
        The scheduler's port on ``nodes[0]``.
    secret : str
        The job secret; it reaches each step through srun's environment.

    Examples
    --------
    >>> spec = LaunchSpec(('python', 't.py'), 2, 1, launcher='slurm', server_command=('srv',))
    >>> for p in slurm_processes(spec, ['a', 'b'], port=9000, secret='s'):
    ...     print(p.where, dict(p.env)['DMLC_PS_ROOT_URI'], p.argv[-1])
    scheduler on a a srv
    server 0 on a a srv
    worker 0 on b a t.py
    worker 1 on a a t.py
    """
    if not nodes:
        raise ConfigError("the Slurm allocation has no nodes. Check SLURM_JOB_NODELIST.")
    root = nodes[0]
    # the scheduler binds all interfaces of the first node: its URI is a name, as Slurm
    # knows it, which every node of the allocation resolves
    sched_env = cluster_env(spec, Role.SCHEDULER, root_uri=root, port=port, secret=secret)
    procs = [ProcessSpec(Role.SCHEDULER, 0, srun_argv(root, spec.server_command, "scheduler"),
                         tuple(sched_env.items()), host=root)]
    placed = place(spec.num_servers or 0, spec.num_workers, [Host(n) for n in nodes])
    locals_ = local_ranks([h.name for role, _, h in placed if role is Role.WORKER])
    omp = environ is not None and omp_default(spec, environ, locals_)
    for role, rank, host in placed:
        env = cluster_env(spec, role, root_uri=root, port=port, secret=secret, rank=rank,
                          local=locals_[rank] if role is Role.WORKER else None, omp=omp)
        command = spec.server_command if role is Role.SERVER else spec.command
        label = f"{role.value} {rank}"
        procs.append(ProcessSpec(role, rank, srun_argv(host.name, command, label),
                                 tuple(env.items()), host=host.name))
    return procs


def build_slurm(spec: LaunchSpec, *, secret: str, environ: Mapping[str, str] | None = None,
                run: Runner | None = None) -> list[ProcessSpec]:
    """Read the allocation from `environ` and build its processes (see slurm_processes)."""
    env = os.environ if environ is None else environ
    nodes = expand_nodelist(allocation_nodelist(env), run=run)
    return slurm_processes(spec, nodes, port=scheduler_port(spec, nodes[0], env),
                           secret=secret, environ=env)
