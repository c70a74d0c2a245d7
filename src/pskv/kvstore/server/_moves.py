"""A server's part in adding and removing servers while the job runs (``PSKV_REPLICAS=1``).

Servers are slots fixed at launch (``pskv-launch -s S``: at most S servers), each slot a
shard (docs/durability.md, "Adding and removing servers while the job runs"):

* **Removed** (``pskv-launch --remove-server R``, which sends this process ``SIGUSR1``):
  once its backup has every change of its shard, the server says GOODBYE with
  ``retire`` and exits 0; the scheduler reports it gone at once, and its backup serves
  its shard from the workers' next request, as after a death but without waiting for one
  to be noticed. Nothing acknowledged is lost: a request is answered only after the
  backup has its change, and those not answered yet go to the backup again (failover).
* **Added** (``--add-server R``: a new process in the removed slot): it is admitted as a
  restarted server, becomes the backup of its slot's shard (the whole copy, then every
  change), and the server that serves that shard hands it back (:meth:`Moves.hand_back`):
  it sends every change, stops serving the shard, ends the requests that waited in its
  rounds unanswered, and tells the scheduler, which tells every node (``SHARD_MOVED``);
  each worker then sends the new server what of its pushes it lacks and every request
  for that shard not answered yet (``failover.py``), so each is answered once, by the
  server that holds the shard.

Only the server's loop thread calls into this module; the signal handler only sets a flag.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

from ..._ps.replay import backup_of
from ..durable._shards import HandedBack

__all__ = ["RETIRE_SIGNAL", "Moves"]

log = logging.getLogger(__name__)

#: the signal that removes a server from its running job (pskv-launch sends it)
RETIRE_SIGNAL = signal.SIGUSR1


class Moves:
    """Shards handed back and this server's removal (see the module docstring)."""

    def __init__(self, server: Any) -> None:
        #: the ``KVServer`` (``_core`` imports this module)
        self.server = server
        #: asked to leave the job (the signal's flag)
        self.asked = threading.Event()
        #: left: the server's GOODBYE says so
        self.retired = False

    @contextlib.contextmanager
    def signal(self) -> Iterator[None]:
        """Take :data:`RETIRE_SIGNAL` while serving (main thread only: an in-process
        server of the tests takes none, and sets :attr:`asked` itself)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old: Any = signal.signal(RETIRE_SIGNAL, lambda _sig, _frame: self.asked.set())
        try:
            yield
        finally:
            signal.signal(RETIRE_SIGNAL, old)

    def hand_back(self) -> None:
        """Hand each shard whose new server has its copy now back to it: the requests
        that waited in its rounds end unanswered (their workers send them there), and the
        scheduler hears that it moved."""
        server = self.server
        if server.shards.deferred:
            server.shards.copy_deferred()       # those that waited too long
        for index, engine in server.shards.hand_back():
            moved = HandedBack(index, index)
            engine.fail_all(moved)
            for conn, waiting in list(server._flushes.items()):
                server._flushes[conn] = [(ts, i) for ts, i in waiting if i != index]
            # the shard as handed is the new server's copy: kept as its backup, so that
            # the new server's link to this one (its backup) sends no whole copy back
            copy = ""
            if server.backups is not None and \
                    backup_of(index, index, server.po.num_servers) == server.po.rank:
                copy = server.backups.adopt(index, engine)
            server.po.shard_moved(index, index, copy)

    def retiring(self) -> bool:
        """Whether to leave the job now: asked to, and every shard served here is its
        own, with its backup connected and holding every change (then drained)."""
        if not self.asked.is_set() or self.retired:
            return self.retired
        server = self.server
        shards = server.shards
        why = None
        if server.backups is None:
            why = "the job runs without PSKV_REPLICAS=1, so no backup could serve its shard"
        elif set(shards.served) != {server.po.rank}:
            why = (f"it serves shards {sorted(shards.served)}, not its own alone (a backup "
                   "took another over): remove a server only while every slot is served "
                   "by its own")
        else:
            repl = shards.served[server.po.rank].replicator
            if repl is not None and repl.copying:
                return False        # its backup is getting its whole copy: leaves after
            if repl is None or not repl.up:
                why = "its backup is not connected (it is down or still getting its copy)"
        if why is not None:         # said once for each time it is asked
            log.error("server %d: asked to leave the job, but cannot: %s; it serves on",
                      server.po.rank, why)
            self.asked.clear()
            return False
        shards.drain()
        repl = shards.served[server.po.rank].replicator
        if repl is None or not repl.up:
            return False        # lost while draining: stay (asked again, it retries)
        log.warning("server %d: leaving the job (removed); its backup, server %d, serves "
                    "shard %d from now on", server.po.rank, repl.backup, server.po.rank)
        self.retired = True
        return True
