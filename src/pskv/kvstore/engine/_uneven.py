"""An engine's rules for uneven data (``kv.join``; docs/api.md, "Uneven data").

A mixin of :class:`._core.Engine`, with no sockets and no threads: a worker that joined
counts as pushing zeros (a round closes when every worker has pushed or joined; the sum is
the pushers', the divisor the user's: DDP's ``Join`` default), a worker that closed its
store without joining fails every round that needs it with a WorkerClosedError naming it,
the key and the round. Joins come in epochs: when every worker has joined, the workers
tell the servers (:meth:`UnevenRounds.end_join`) and the rounds count every worker again;
a join of an ended epoch is ignored, and a worker that closed after joining is one that
closed from the next epoch on. The engine keeps the state (``joined``, ``departed``,
``join_epoch``) and adds the rounds in rank order past the joined ranks (``_skip_joined``).
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import KVStoreError, WorkerClosedError
from ..._types import Key

__all__ = ["UnevenRounds"]


class UnevenRounds:
    """``worker_left`` and ``end_join`` of an :class:`._core.Engine`."""

    num_workers: int
    sync: bool
    joined: frozenset[int]
    departed: frozenset[int]
    join_epoch: int
    _lowest: int
    _closed_joined: frozenset[int]
    _entries: dict[Key, Any]
    _clock: Callable[[], float]
    applied_in: Callable[[float], object] | None
    _add_early: Callable[[Key, Any], None]
    _close_round: Callable[..., None]
    _fail_entry: Callable[[Any, KVStoreError], None]
    _sealed_for: Callable[[Key, Any], bool]

    def worker_left(self, worker: int, joined: bool, epoch: int = 0) -> None:
        """``worker`` joined in join epoch ``epoch`` (``kv.join``: it counts as pushing
        zeros until the epoch ends; a join of an ended epoch is ignored) or closed its store
        (every round needing its push fails, once it does not count as joined).
        Idempotent."""
        if joined:
            if epoch < self.join_epoch or worker in self.joined or worker in self.departed:
                return
            self.end_join(epoch)
            self.joined = self.joined | {worker}
            self.departed = self.departed - {worker}
            self._lowest = min(set(range(self.num_workers)) - self.joined, default=0)
            if not self.sync:
                return
            for key, entry in list(self._entries.items()):
                if not entry.pushers:
                    continue
                if entry.table is None and not entry.sparse:
                    self._add_early(key, entry)
                if len(entry.pushers | self.joined) == self.num_workers and \
                        self._sealed_for(key, entry):
                    self._close_round(key, entry,
                                      self._clock() if self.events.times_updates else 0.0)
            return
        if worker in self.joined:
            self._closed_joined = self._closed_joined | {worker}
            return
        if worker in self.departed:
            return
        self.departed = self.departed | {worker}
        if self.sync:
            for entry in self._entries.values():
                if entry.pushers and worker not in entry.pushers:
                    self._fail_departed(entry)

    def end_join(self, epoch: int) -> None:
        """Join epoch ``epoch`` begins (every worker joined the one before): the rounds
        count every worker again, but those that closed. Idempotent."""
        if epoch <= self.join_epoch:
            return
        self.join_epoch = epoch
        gone, self._closed_joined = self._closed_joined, frozenset()
        self.joined = frozenset()
        self._lowest = 0
        for worker in gone:
            self.worker_left(worker, joined=False)

    def _fail_departed(self, entry: Any) -> None:
        """Fail ``entry``'s open round: a worker it needs has closed its store."""
        gone = sorted(self.departed - entry.pushers - self.joined)
        who = f"worker{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}"
        err = WorkerClosedError(
            f"sync round {entry.round} of key {entry.name!r} can never complete: {who} "
            f"closed {'their stores' if len(gone) > 1 else 'its store'} without pushing it "
            f"(workers {sorted(entry.pushers)} did). With uneven data, call kv.join() on "
            "each worker that runs out of batches (pskv.torch: opt.join()), and close only "
            "after it returns.", key=entry.name)
        if entry.pushers and entry.refused is None:
            entry.refused = {}
        for worker in entry.pushers:
            entry.refused[worker] = err
        self._fail_entry(entry, err)

