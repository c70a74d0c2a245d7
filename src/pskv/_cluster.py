"""InprocCluster: a whole parameter-server cluster as threads of this process.

The scheduler, the servers and one DistKVStore per worker run as threads and talk over
ZeroMQ ``inproc://`` endpoints of one shared context: no ports, no files, no processes.
This is possible because pskv keeps no process-wide state. Public as
``pskv.testing.InprocCluster``.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import zmq

from ._ps.config import ClusterConfig, Role
from ._ps.scheduler import Scheduler
from .errors import ClusterTimeoutError
from .kvstore.dist._store import DistKVStore
from .kvstore.server._core import KVServer

__all__ = ["InprocCluster"]

_names = itertools.count(1)     # a distinct inproc name per cluster of this process


class InprocCluster:
    """A scheduler, ``num_servers`` servers and ``num_workers`` workers in threads.

    Parameters
    ----------
    num_workers, num_servers : int
    **settings
        Any :class:`pskv._ps.config.ClusterConfig` field (``request_timeout``, ...).

    Examples
    --------
    >>> import numpy as np
    >>> from pskv.testing import InprocCluster
    >>> def step(kv):
    ...     kv.init(3, np.zeros(2, np.float32))
    ...     kv.push(3, np.ones(2, np.float32))
    ...     return kv.pull(3).tolist()
    >>> with InprocCluster(num_workers=2) as cluster:
    ...     cluster.run(step)
    {0: [2.0, 2.0], 1: [2.0, 2.0]}
    >>> sorted(cluster.codes.items())
    [('scheduler', 0), ('server 0', 0)]
    """

    def __init__(self, num_workers: int = 2, num_servers: int = 1, **settings: Any) -> None:
        base: dict[str, Any] = dict(
            role=Role.WORKER, root_port=next(_names), num_servers=num_servers,
            num_workers=num_workers, transport="inproc", heartbeat_interval=0.2,
            heartbeat_timeout=5.0, request_timeout=30.0, connect_timeout=30.0,
            shutdown_timeout=10.0)
        base.update(settings)
        self.cfg = ClusterConfig(**base)
        self.context: zmq.Context[Any] = zmq.Context()
        self.stop = threading.Event()
        #: exit status (or exception) of the scheduler and each server, once they ended
        self.codes: dict[str, int | BaseException] = {}
        self._nodes: list[threading.Thread] = []
        self._started = False

    def start(self) -> InprocCluster:
        """Start the scheduler and server threads."""
        def node(name: str, make: Callable[[], Any]) -> None:
            try:
                self.codes[name] = make().run()
            except BaseException as err:  # noqa: BLE001 - reported in codes
                self.codes[name] = err

        cfg = self.cfg
        makers: list[tuple[str, Callable[[], Any]]] = [(
            "scheduler", lambda: Scheduler(cfg.with_role(Role.SCHEDULER), self.stop,
                                           self.context))]
        makers += [(f"server {i}", lambda: KVServer(cfg.with_role(Role.SERVER), self.stop,
                                                    zmq_context=self.context))
                   for i in range(cfg.num_servers)]
        for name, make in makers:
            t = threading.Thread(target=node, args=(name, make), name=f"pskv-{name}",
                                 daemon=True)
            t.start()
            self._nodes.append(t)
        self._started = True
        return self

    def run(self, fn: Callable[[DistKVStore], Any], store_type: str = "dist_sync",
            timeout: float = 60.0) -> dict[int, Any]:
        """Create one store per worker, call ``fn(kv)`` on each in its own thread, close
        the stores; return ``{rank: result, or the exception fn raised}``.

        Raises ClusterTimeoutError if a worker is still running after ``timeout`` s.
        """
        if not self._started:
            self.start()
        results: dict[int, Any] = {}
        failures: list[BaseException] = []

        def worker() -> None:
            try:
                kv = DistKVStore(store_type, self.cfg, self.context)
            except BaseException as err:  # noqa: BLE001 - raised below
                failures.append(err)
                return
            try:
                results[kv.rank] = fn(kv)
            except BaseException as err:  # noqa: BLE001 - the caller inspects it
                results[kv.rank] = err
            finally:
                kv.close()

        threads = [threading.Thread(target=worker, name=f"pskv-worker-{i}", daemon=True)
                   for i in range(self.cfg.num_workers)]
        for t in threads:
            t.start()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in threads):
            self.stop.set()
            raise ClusterTimeoutError(f"workers did not finish within {timeout:g} s")
        if failures:
            raise failures[0]
        return dict(sorted(results.items()))

    def join(self, timeout: float = 15.0) -> dict[str, int | BaseException]:
        """Wait for the scheduler and servers to end (stopping them after ``timeout``)."""
        end = time.monotonic() + timeout
        for t in self._nodes:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._nodes):
            self.stop.set()
            for t in self._nodes:
                t.join(5.0)
        return dict(self.codes)

    def close(self) -> None:
        """Stop every node thread and release the ZeroMQ context."""
        self.join(timeout=0.0 if self.stop.is_set() else 15.0)
        self.stop.set()
        for t in self._nodes:
            t.join(5.0)
        if not any(t.is_alive() for t in self._nodes):
            self.context.term()

    def __enter__(self) -> InprocCluster:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def with_settings(self, **changes: Any) -> ClusterConfig:
        """The cluster's config with ``changes`` (e.g. a worker's own timeouts)."""
        return replace(self.cfg, **changes)
