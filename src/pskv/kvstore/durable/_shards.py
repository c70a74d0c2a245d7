"""The shards one server serves: which engine serves which shard, backups, takeover, rejoin.

A server serves its own shard (what it was placed) and, with ``PSKV_REPLICAS=1``, once a
primary died, the shard it kept the backup of (docs/durability.md). :class:`Shards` is that
table, the server's durability wing: it takes a shard over from the backups
(:meth:`Shards.get`), starts serving a shard with its backup link and periodic checkpoints
(:meth:`Shards.serve`), makes a restarted server the new backup of the shards it backs
(:meth:`Shards.rejoined`), and hands a shard back to the server added into its slot
(:meth:`Shards.hand_back`: docs/durability.md, "Adding and removing servers"). Each served :class:`Shard` is its engine's one
:class:`pskv.kvstore.engine._core.RoundObserver`: an applied round goes to the backup first, then to the
periodic checkpoint. The request handlers of ``KVServer`` receive the :class:`Shard` a
request is for, never a swapped attribute.

Invariant: only the server's loop thread calls into this module (the backups' thread
touches only ``Backups``' own copies, under its lock).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ...errors import ProtocolError
from ..._ps.config import ClusterConfig
from ..._ps.ops import ReplOp
from ..._ps.postoffice import Postoffice
from ..._ps.replay import backup_of
from ..._ps.zeromq import ZmqContext
from ..._types import Key
from ...nd.ndarray import NDArray
from ._snapshots import PeriodicCopies, Snapshots
from ..engine._core import Engine
from ._backups import Backups
from ._replica import Replicator

__all__ = ["DEFER_S", "HandedBack", "TakeoverPending", "Shard", "Shards"]

log = logging.getLogger(__name__)
#: seconds a copy to an added server waits, at most, for that server's own shard to be
#: handed back to it (``Shards.rejoined``)
DEFER_S = 30.0


class TakeoverPending(ProtocolError):
    """A worker asks for a shard whose copy is held here while the server it comes from is
    not known dead yet (its link to the worker broke first; the scheduler's word follows
    within moments): the request waits for that word (`Shards.lost`)."""

    def __init__(self, shard: int, source: int) -> None:
        super().__init__(f"a worker asked for shard {shard}, whose copy this server holds, "
                         f"while server {source}, which serves it, is not known dead: a "
                         "backup takes a shard over only once the scheduler reports its "
                         "server dead")
        self.shard, self.source = shard, source


class HandedBack(ProtocolError):
    """A request for a shard this server handed back to the server added into its slot:
    never answered here (its worker sends it there once the scheduler's word reaches it,
    ``failover.py``); the requests that waited in the shard's rounds end so too."""

    def __init__(self, shard: int, host: int) -> None:
        super().__init__(f"shard {shard} was handed to server {host}")
        self.shard, self.host = shard, host


class Shard:
    """One shard served here: its index, its engine, its backup link and periodic copies."""

    def __init__(self, index: int, engine: Engine, replicator: Replicator | None = None,
                 periodic: PeriodicCopies | None = None) -> None:
        self.index, self.engine = index, engine
        self.replicator, self.periodic = replicator, periodic

    @property
    def wants_merged(self) -> bool:
        """The backup needs each round's merged value."""
        return self.replicator is not None

    def round_applied(self, key: Key, merged: NDArray | None, rnd: int,
                      applied: dict[int, int]) -> None:
        """The engine applied round ``rnd`` of ``key``: to the backup, then the checkpoint."""
        if self.replicator is not None and merged is not None:
            self.replicator.round(key, merged, rnd, applied)
        if self.periodic is not None:
            self.periodic.round_applied(key, merged, rnd, applied)

    def settle(self) -> None:
        """The engine is about to change arrays of rounds it handed over (a deferred push
        opens the key's next round): the backup gets those rounds now."""
        if self.replicator is not None:
            self.replicator.flush()

    def rows_born(self, key: Key, born: Any, rnd: int, applied: dict[int, int]) -> None:
        """A training lookup inserted rows of table ``key``: to the backup (not a round,
        so not to the periodic copies)."""
        if self.replicator is not None:
            self.replicator.round(key, born, rnd, applied)

    def forward(self, op: ReplOp, body: dict[str, Any],
                arrays: list[np.ndarray] | tuple[()] = ()) -> None:
        """Replicate a change of this shard to its backup (before anyone is answered)."""
        if self.replicator is not None:
            self.replicator.send(op, body, list(arrays))


class Shards:
    """The shards a server serves (see the module docstring).

    Parameters
    ----------
    cfg : ClusterConfig
    zctx : ZmqContext
    po : Postoffice
        The server's membership (its rank, the servers' endpoints).
    snapshots : Snapshots
        The server's checkpoint writers.
    backups : Backups or None
        The copies this server keeps of other shards (``PSKV_REPLICAS=1``).
    own : Engine
        The engine of this server's own shard.
    replicator : callable, optional (default: Replicator)
        Makes a shard's backup link: ``replicator(cfg, zctx, po, index, backup, engine)``
        (the socket-free tests pass a fake).
    clock : callable, default ``time.monotonic``
    """

    def __init__(self, cfg: ClusterConfig, zctx: ZmqContext, po: Postoffice,
                 snapshots: Snapshots, backups: Backups | None, own: Engine,
                 replicator: Callable[..., Replicator] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self._zctx, self.po = cfg, zctx, po
        self.snapshots, self.backups = snapshots, backups
        self.own = own
        self._replicator = replicator if replicator is not None else Replicator
        self._clock = clock
        #: shard index -> the shard served here
        self.served: dict[int, Shard] = {}
        #: server -> when it was last reported restarted (a new backup)
        self._rejoined: dict[int, float] = {}
        #: server -> when the scheduler last reported it dead: a copy that came from it
        #: before then may be taken over; a worker alone cannot make a backup split the
        #: shard of a server that lives (or of its restarted self, which sent a new copy)
        self.lost: dict[int, float] = {}
        #: shards to hand back to the server added into their slot, once it has the copy
        self.handing: set[int] = set()
        #: shard -> the server it was handed to: requests naming it are not answered here
        self.moved: dict[int, int] = {}
        #: shard -> when the scheduler said it was handed here (``ShardMoved``): the copy
        #: held of it, complete since, may be served
        self.handed: dict[int, float] = {}
        #: shard -> the token of the copy the server that handed it here kept as its
        #: backup: the backup link names it instead of sending the whole shard
        self.kept: dict[int, str] = {}
        #: shard -> (the added server that backs it, when its copy goes at the latest):
        #: the copy waits until that server's own shard was handed back to it
        self.deferred: dict[int, tuple[int, float]] = {}

    def get(self, index: int | None) -> Shard:
        """The shard a request names (None: this server's own), taken over from the
        backups if its primary died or handed it here; HandedBack for a shard this
        server handed to another."""
        if index is None:
            rank = self.po.rank
            shard = self.served.get(rank)
            if shard is not None or self.backups is None or not self.cfg.restart:
                return shard or Shard(rank, self.own)
            index = rank        # restarted or added: its own shard only once handed back
        if index in self.moved and index not in self.served:
            raise HandedBack(index, self.moved[index])
        shard = self.served.get(index)
        if shard is None and self.backups is not None:
            held = self.backups.held_from(index)
            if held is not None and max(self.lost.get(held[0], float("-inf")),
                                        self.handed.get(index, float("-inf"))) < held[1]:
                raise TakeoverPending(index, held[0])
            engine = self.backups.take(index)
            if engine is None and held is None and self._first_backup_of(index):
                # no copy ever came from its server: it died before its first copy was in
                # place, and a server answers no worker before that (server._core.KVServer.run), so the
                # shard is empty: served empty, once the scheduler says its server died
                if index not in self.lost:
                    raise TakeoverPending(index, index)
                engine = self.backups.empty()
                log.info("server %d: serves shard %d now, empty: its server died before "
                         "its first copy reached this backup", self.po.rank, index)
            elif engine is not None:
                log.info("server %d: serves shard %d now, as its backup (%s)", self.po.rank,
                         index, "handed back" if index in self.handed else
                         "its server died or was removed")
                self.moved.pop(index, None)
            if engine is not None:
                engine.num_workers = self.po.num_workers
                shard = self.serve(index, engine)
        if shard is None:
            if self.backups is not None and self.cfg.restart:
                raise ProtocolError(
                    f"server {self.po.rank} holds no copy of shard {index}: it was restarted, "
                    f"and the server that served shard {index} died before sending it one "
                    "(two deaths closer together than a whole copy takes), so that shard is "
                    "lost. Restart the job from a checkpoint (kv.load_checkpoint), or leave "
                    "more time between faults")
            raise ProtocolError(f"server {self.po.rank} holds no shard {index} (with "
                                "PSKV_REPLICAS=1 a server serves its own shard and, once its "
                                "primary died, the one it backs up)")
        return shard

    def _first_backup_of(self, index: int) -> bool:
        """Whether this server, never restarted, is the backup that shard ``index`` had
        when its own server served it (the only server its first copy goes to)."""
        return not self.cfg.restart and index != self.po.rank and \
            0 <= index < self.po.num_servers and \
            backup_of(index, index, self.po.num_servers) == self.po.rank

    def copied(self, index: int) -> bool:
        """Whether shard ``index``, served here, has its whole copy on its backup, or the
        backup is reported dead (it gets the copy once it is back); else the copy is tried
        again. A server answers no worker before this holds for its own shard: a backup
        that got no copy from it may then take its shard over empty."""
        repl = self.served[index].replicator
        if repl is None or repl.up or not self._alive(repl.backup):
            return True
        if repl.copying:
            return False
        repl.aim(self.po.servers[repl.backup])
        repl.send(ReplOp.NOOP, {})          # connects, then sends the whole shard
        return repl.up

    def serve(self, index: int, engine: Engine) -> Shard:
        """Serve shard ``index`` with ``engine``, replicating it to its backup if any."""
        shard = Shard(index, engine,
                      periodic=self.snapshots.start(engine, index, self.po.num_servers))
        self.served[index] = shard
        if self.backups is not None:
            backup = backup_of(index, self.po.rank, self.po.num_servers)
            shard.replicator = self._replicator(self.cfg, self._zctx, self.po, index, backup,
                                                engine)
            if self._alive(backup):     # else it is aimed at once it is back (rejoined)
                shard.replicator.aim(self.po.servers[backup])
            shard.replicator.have = self.kept.pop(index, None) or None
        engine.observer = shard
        if shard.replicator is not None:
            # the backup gets the whole shard now, before anyone is answered: a takeover
            # whose backup is already back (restarted before a worker asked for the shard)
            # must not wait for the shard's next change to copy it, or a death meanwhile
            # loses the shard (found by the long chaos soak)
            shard.replicator.send(ReplOp.NOOP, {})
        return shard

    def _alive(self, server: int) -> bool:
        """Whether ``server`` lives as far as this server has heard: never reported dead,
        or restarted since (a takeover's backup is the dead server it took over from)."""
        if server not in self.lost:
            return True
        return self.lost[server] < self._rejoined.get(server, float("-inf"))

    def applied_by(self, worker: int) -> dict[int, int]:
        """What of ``worker``'s pushes this server's own shard holds (its HELLO answer):
        nothing while a restarted server serves no shard of its own."""
        shard = self.served.get(self.po.rank)
        engine = shard.engine if shard is not None else self.own
        return engine.applied_by(worker)

    def hand_back(self) -> list[tuple[int, Engine]]:
        """Each shard to hand back whose new server now has every change of it: served
        here no more (its backup link closed, its engine returned so that its waiting
        requests can be ended unanswered); the caller tells the scheduler. A shard whose
        new server is not connected yet waits (it connects at the shard's next change)."""
        done: list[tuple[int, Engine]] = []
        for index in sorted(self.handing):
            shard = self.served.get(index)
            repl = shard.replicator if shard is not None else None
            if shard is None or repl is None or repl.backup != index:
                self.handing.discard(index)         # not served here, or another backup
                continue
            if repl.copying:
                continue                            # its whole copy is on its way
            if not repl.up:
                if repl.endpoints is None:          # its new server was lost meanwhile
                    self.handing.discard(index)
                else:
                    repl.send(ReplOp.NOOP, {})      # connect: the whole shard
                continue
            repl.drain()
            if not repl.up:
                continue
            self.handing.discard(index)
            del self.served[index]
            repl.close()
            shard.engine.observer = None
            self.moved[index] = index
            done.append((index, shard.engine))
            log.info("server %d: handed shard %d back to server %d", self.po.rank, index,
                     index)
        return done

    def rejoined(self, rank: int, handback: bool = False, added: bool = False) -> None:
        """Server ``rank`` was restarted: the new backup of the shards served here that it
        backs (it gets the whole shard at once, then every change). ``handback``: it was
        added into its removed slot, and its slot's shard, served here, goes back to it
        once it has the copy (:meth:`hand_back`). ``added`` (the same, told to every
        server): the other shards it backs get their copies once its own shard is back
        there (:meth:`copy_deferred`; at most :data:`DEFER_S` later), so that the whole
        copy the handback waits for is the only one taken meanwhile."""
        self._rejoined[rank] = self._clock()
        if handback and rank in self.served and rank != self.po.rank:
            self.handing.add(rank)
        for shard in self.served.values():
            repl = shard.replicator
            if repl is not None and repl.backup == rank:
                repl.close()
                if added and shard.index != rank:
                    repl.endpoints = None       # no backup until then, as while it was out
                    self.deferred[shard.index] = (rank, self._clock() + DEFER_S)
                    continue
                repl.aim(self.po.servers[rank])
                repl.send(ReplOp.NOOP, {})       # connect now: the whole shard, then this

    def copy_deferred(self, rank: int | None = None) -> None:
        """Send the copies deferred for server ``rank`` (its own shard is back there), and
        any deferred for longer than :data:`DEFER_S` (None: only those)."""
        now = self._clock()
        for index, (backup, latest) in sorted(self.deferred.items()):
            if backup != rank and now < latest:
                continue
            del self.deferred[index]
            shard = self.served.get(index)
            repl = shard.replicator if shard is not None else None
            if repl is None or repl.backup != backup or not self._alive(backup):
                continue
            repl.aim(self.po.servers[backup])
            repl.send(ReplOp.NOOP, {})

    def flush(self) -> None:
        """Send every backup the rounds queued for it (at the end of each request: the
        arrays of its rounds may change with the next one)."""
        for shard in self.served.values():
            if shard.replicator is not None:
                shard.replicator.flush()

    def drain(self) -> None:
        """Wait until every backup has every change sent (before answering anyone)."""
        for shard in self.served.values():
            if shard.replicator is not None:
                shard.replicator.drain()

    def each_engine(self, action: Callable[[Engine], None]) -> None:
        """Run ``action`` on the engine of every shard served here."""
        for shard in self.served.values():
            action(shard.engine)

    def close(self) -> None:
        """Close the backup links."""
        for shard in self.served.values():
            if shard.replicator is not None:
                shard.replicator.close()
