"""What the parts of a dist store share: :class:`WorkerCore`.

``DistKVStore`` is a small core (its keys, its cluster links, its locks and the call
checks every call makes) and parts, each given this core at construction: the collective
path (:class:`._collective.PeerSums`), the staleness bounds (:class:`._staleness.Bounds`),
uneven data (:class:`._join.Joining`) and checkpoints (:class:`._checkpoints.Checkpoints`).
A part reaches the store only through what is here, never through the store's attributes.

Invariant: a part calls ``begin``, ``collective``, ``wait_all`` and ``unlocked`` only with
``lock`` held (as the store's own calls do); ``collective_lock`` is taken before ``lock``.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..._ps.config import ClusterConfig
from ..._ps.message import Command
from ..._ps.postoffice import Postoffice
from ..._ps.worker import KVWorker

__all__ = ["WorkerCore"]


@dataclass(frozen=True)
class WorkerCore:
    """A dist store's shared core, as its parts see it."""

    #: the store type (``dist_sync``, ``dist_async``, ...), for error messages
    store_type: str
    cfg: ClusterConfig
    po: Postoffice
    kv: KVWorker
    #: held while a call checks its arguments and sends (never while it waits)
    lock: threading.Lock
    #: init, barrier, set_staleness, join: one collective call at a time
    collective_lock: threading.Lock
    sync: bool
    #: every call's checks first (the store open, the cluster healthy, the held push sent)
    begin: Callable[..., None]
    #: ``with unlocked():`` the lock released for a network wait
    unlocked: Callable[[], contextlib.AbstractContextManager[None]]
    #: a barrier of the workers that checks they all made the same call: payloads by rank
    collective: Callable[..., dict[str, dict[str, Any]]]
    #: wait (unlocked) for the answers of requests ``tss``
    wait_all: Callable[[list[int], str], list[Any]]

    def to_servers(self, body: dict[str, Any], wait: bool = False) -> list[Any]:
        """Send a COMMAND to every server: answered (``wait``, the answers) or one-way."""
        tss = [self.kv.request(s, Command.COMMAND, body=body, negative=not wait)
               for s in range(self.po.num_servers)]
        return self.wait_all(tss, f"the servers to take {body['op']}") if wait else []
