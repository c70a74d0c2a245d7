"""The node roles other than worker, in the store layer: :func:`run_node` and the hook
``create('dist_*')`` calls, :func:`serve_unless_worker`.

They live here, not in :mod:`pskv.server` (an entry point, a layer above the stores), so
that ``create`` imports nothing from above its layer; :mod:`pskv.server` re-exports both
and is the command line.
"""
from __future__ import annotations

import threading

from ...errors import ConfigError
from ..._ps.config import ClusterConfig, Role

__all__ = ["run_node", "serve_unless_worker"]


def run_node(cfg: ClusterConfig, stop: threading.Event | None = None) -> int:
    """Run a scheduler or a server per ``cfg.role`` until the job ends; return its status."""
    if cfg.role == Role.SCHEDULER:
        from ..._ps.scheduler import Scheduler
        return Scheduler(cfg, stop).run()
    if cfg.role == Role.SERVER:
        from ._core import KVServer
        return KVServer(cfg, stop).run()
    raise ConfigError(f"run_node() runs a scheduler or a server, not a {cfg.role.value}. "
                      "Workers create a store with pskv.kv.create('dist_sync').")


def serve_unless_worker(cfg: ClusterConfig) -> None:
    """In a process started as a scheduler or server, run that role, then exit the process.

    Called by ``create('dist_*')``: as in MXNet, a script started with
    ``DMLC_ROLE=server`` serves inside ``create`` and exits (SystemExit with the node's
    status) when the job ends. A worker returns at once.
    """
    if cfg.role != Role.WORKER:
        raise SystemExit(run_node(cfg))
