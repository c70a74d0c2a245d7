"""The launchers, by name: how each starts a job (docs/launch.md).

One table (:data:`REGISTRY`), read by ``build_processes`` and ``launch_spec`` and checked
against ``_spec.LAUNCHERS`` (the names ``--launcher`` takes) by the tests: a new launcher
is a row here, not a branch in each caller. A launcher either builds the processes this
machine starts and supervises (``build``), or runs the whole job itself (``run``:
Kubernetes, Ray); ``scheduler_here`` says whether the scheduler is one of the processes
started here (then the supervisor checks that every node joined).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TextIO

from ._hosts import parse_host_list, read_hostfile
from ._local import local_processes
from ._mpi import mpi_processes
from ._net import free_port, guess_host_ip
from ._slurm import build_slurm
from ._spec import LaunchSpec, ProcessSpec
from ._ssh import ssh_processes

__all__ = ["REGISTRY", "Launcher"]

#: ``build(spec, secret, environ, cwd)``: the processes to start here
Build = Callable[[LaunchSpec, str, Mapping[str, str], "str | None"], list[ProcessSpec]]
#: ``run(spec, stdout=, stderr=)``: run the job, return its LaunchResult
Run = Callable[..., Any]


@dataclass(frozen=True)
class Launcher:
    """One launcher: ``build`` (processes started here) or ``run`` (the job run by the
    launcher itself), and whether the scheduler is started here."""

    name: str
    build: Build | None = None
    run: Run | None = None
    scheduler_here: bool = False


def _local(spec: LaunchSpec, secret: str, env: Mapping[str, str],
           cwd: str | None) -> list[ProcessSpec]:
    return local_processes(spec, port=spec.port or free_port(), secret=secret, environ=env)


def _slurm(spec: LaunchSpec, secret: str, env: Mapping[str, str],
           cwd: str | None) -> list[ProcessSpec]:
    return build_slurm(spec, secret=secret, environ=env)


def _root(spec: LaunchSpec) -> tuple[str, int]:
    root_uri = spec.host_ip or guess_host_ip()
    return root_uri, spec.port or free_port("::" if ":" in root_uri else "0.0.0.0")


def _ssh(spec: LaunchSpec, secret: str, env: Mapping[str, str],
         cwd: str | None) -> list[ProcessSpec]:
    root_uri, port = _root(spec)
    hosts = parse_host_list(spec.hosts) if spec.hosts else read_hostfile(spec.hostfile or "")
    return ssh_processes(spec, hosts, port=port, secret=secret, root_uri=root_uri,
                         cwd=os.getcwd() if cwd is None else cwd, environ=env)


def _mpi(spec: LaunchSpec, secret: str, env: Mapping[str, str],
         cwd: str | None) -> list[ProcessSpec]:
    root_uri, port = _root(spec)
    if spec.hostfile:
        read_hostfile(spec.hostfile)  # mpirun reads it; a missing one is a usage error here
    return mpi_processes(spec, port=port, secret=secret, root_uri=root_uri, environ=env)


def _kubernetes(spec: LaunchSpec, *, stdout: TextIO | None = None,
                stderr: TextIO | None = None) -> Any:
    from ._kubernetes import run_kubernetes      # the optional client, only when asked
    return run_kubernetes(spec, stdout=stdout, stderr=stderr)


def _ray(spec: LaunchSpec, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> Any:
    from ._ray import run_ray                    # ray, only when asked
    return run_ray(spec, stdout=stdout, stderr=stderr)


REGISTRY: dict[str, Launcher] = {launcher.name: launcher for launcher in (
    Launcher("local", build=_local, scheduler_here=True),
    Launcher("ssh", build=_ssh, scheduler_here=True),
    Launcher("mpi", build=_mpi, scheduler_here=True),
    Launcher("slurm", build=_slurm),
    Launcher("kubernetes", run=_kubernetes),
    Launcher("ray", run=_ray),
)}
