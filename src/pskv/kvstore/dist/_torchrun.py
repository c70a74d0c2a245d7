"""A script started by ``torchrun`` becomes a pskv worker (issue #29, item 6).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` and no ``DMLC_*``. When a ``dist_*`` store is created in
such a process, :func:`adopt_torchrun` turns those into the cluster variables: this process
is worker ``RANK`` of ``WORLD_SIZE``; the scheduler listens at ``MASTER_ADDR``, port
``PSKV_SCHEDULER_PORT`` (default: ``MASTER_PORT + 1`` when free, else a free port, told to
the others through torchrun's store), started by global rank 0; each node's
local rank 0 starts ``PSKV_SERVERS_PER_NODE`` servers (default 1), so the job has
``WORLD_SIZE / LOCAL_WORLD_SIZE`` times that many. They are ``python -m pskv.server``
children (no torch imported), in their own process group, sent SIGTERM if their parent dies
(``PR_SET_PDEATHSIG``); at exit the parent waits for them (``PSKV_SHUTDOWN_TIMEOUT`` plus
slack; they end with the job) and kills what is left.

Invariant: nothing is changed when ``DMLC_ROLE`` is set (pskv-launch) or a torchrun variable
is missing; a child never outlives the process that started it.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import MutableMapping

from ..._ps.config import (ENV_CONNECT_TIMEOUT, ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_ROLE,
                          ENV_ROOT_PORT, ENV_ROOT_URI, ENV_SCHEDULER_PORT,
                          ENV_SERVERS_PER_NODE, ENV_SHUTDOWN_TIMEOUT, ENV_WORKER_ID)
from ...errors import ConfigError

__all__ = ["TORCHRUN_NAMES", "adopt_torchrun"]

log = logging.getLogger(__name__)

#: what torchrun sets in every process it starts (and pskv reads)
TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")
_PR_SET_PDEATHSIG = 1
_children: list[subprocess.Popen[bytes]] = []


def _number(env: MutableMapping[str, str], name: str, lo: int) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if value < lo:
        raise ConfigError(f"{name}={raw!r} under torchrun: pskv needs an integer >= {lo}. "
                          "Start the script with torchrun, which sets it, or unset it.")
    return value


def adopt_torchrun(env: MutableMapping[str, str] | None = None) -> bool:
    """Under torchrun without ``DMLC_ROLE``: set the worker's cluster variables in ``env``
    (``os.environ``), start the scheduler (global rank 0) and this node's servers (local
    rank 0); True when it did. Raises ConfigError for a torchrun variable pskv cannot use
    (or a world that does not split into whole nodes)."""
    env = os.environ if env is None else env
    if env.get(ENV_ROLE) or not all(env.get(n) for n in TORCHRUN_NAMES):
        return False
    rank, world = _number(env, "RANK", 0), _number(env, "WORLD_SIZE", 1)
    local_rank, local_world = _number(env, "LOCAL_RANK", 0), _number(env, "LOCAL_WORLD_SIZE", 1)
    if world % local_world:
        raise ConfigError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE="
                          f"{local_world}: pskv starts the same servers on every node; start "
                          "each node with the same --nproc-per-node.")
    per_node = _number(env, ENV_SERVERS_PER_NODE, 1) if env.get(ENV_SERVERS_PER_NODE) else 1
    port = _number(env, ENV_SCHEDULER_PORT, 1) if env.get(ENV_SCHEDULER_PORT) \
        else _agreed_port(env, rank)
    cluster = {ENV_ROOT_URI: env["MASTER_ADDR"], ENV_ROOT_PORT: str(port),
               ENV_NUM_WORKER: str(world), ENV_NUM_SERVER: str(world // local_world * per_node)}
    for name in (ENV_ROLE, ENV_WORKER_ID):
        env.pop(name, None)
    child_env = {k: v for k, v in env.items() if k not in TORCHRUN_NAMES}
    child_env.update(cluster)
    if rank == 0:
        _start("scheduler", child_env)
    if local_rank == 0:
        for _ in range(per_node):
            _start("server", child_env)
    env.update(cluster)
    env[ENV_ROLE], env[ENV_WORKER_ID] = "worker", str(rank)
    log.info("torchrun: worker %d of %d; scheduler at %s:%d, %s servers", rank, world,
             env["MASTER_ADDR"], port, cluster[ENV_NUM_SERVER])
    return True


def _bindable(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))
    except OSError:
        return False
    return True


def _agreed_port(env: MutableMapping[str, str], rank: int) -> int:
    """The scheduler's port when ``PSKV_SCHEDULER_PORT`` is unset. Without torchrun's agent
    store (``TORCHELASTIC_USE_AGENT_STORE``), ``MASTER_PORT + 1``. With it, rank 0 takes
    ``MASTER_PORT + 1`` if it is free here, else any free port, and tells the others through
    torchrun's own store at MASTER_ADDR:MASTER_PORT. (A fixed ``MASTER_PORT + 1`` was taken
    now and then: ``--standalone`` picks MASTER_PORT from the OS's ephemeral range, whose
    next port another connection may already hold.)"""
    master = _number(env, "MASTER_PORT", 1)
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return master + 1       # no agent's store to ask (variables set by hand)
    from datetime import timedelta

    import torch.distributed as dist
    wait = float(env.get(ENV_CONNECT_TIMEOUT) or 60)
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], master,  # type: ignore[attr-defined]
                              is_master=False, timeout=timedelta(seconds=wait))
    except (RuntimeError, OSError) as err:
        raise ConfigError(f"torchrun's store at {env['MASTER_ADDR']}:{master} did not answer "
                          f"({err}): pskv asks it for the scheduler's port. Set "
                          f"{ENV_SCHEDULER_PORT} to one free port, the same on every node.") \
            from err
    key = f"pskv/scheduler_port/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        port = master + 1
        if port > 65535 or not _bindable(port):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = int(sock.getsockname()[1])
        store.set(key, str(port))
        return port
    return int(store.get(key).decode())


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux), own process group."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass


def _start(role: str, env: dict[str, str]) -> None:
    if not _children:
        atexit.register(_end_children)
    proc = subprocess.Popen([sys.executable, "-m", "pskv.server"], env={**env, ENV_ROLE: role},
                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    _children.append(proc)


def _end_children() -> None:
    """Wait for the scheduler and servers this process started (they end with the job),
    bounded; SIGTERM then SIGKILL what is left."""
    try:
        bound = float(os.environ.get(ENV_SHUTDOWN_TIMEOUT, "") or 30.0) + 10.0
    except ValueError:
        bound = 40.0
    for sig, wait in ((None, bound), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        for proc in _children:
            if sig is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in _children:
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in _children):
            break
    if any(p.returncode for p in _children):
        log.warning("torchrun: pskv nodes ended with status %s",
                    [p.returncode for p in _children])
