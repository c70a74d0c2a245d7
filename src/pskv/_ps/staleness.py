"""ClockGate: a server's side of the global staleness bound (SSP) of ``dist_async``.

Each worker's *clock* is the number of push calls it has made since the workers last
agreed on a bound (``kv.set_staleness``); the worker tells every server its clock after
each push call (an ``Op.CLOCK`` command, sent behind the push on the same link, so a server
that knows clock ``c`` of a worker has applied that worker's first ``c`` pushes to it). A
bounded read (a pull, a row_sparse pull, a training lookup) of worker ``w`` may run only
while ``clock[w] - min(clock of the live workers) <= bound``; otherwise it is parked here and
runs once the slowest worker catches up (Petuum's SSP read rule with the staleness counted
in pushes; docs/embeddings.md, "Bounded staleness").

A worker that closes its store *leaves* (its clock no longer counts); a worker that is lost
(its connection dropped without leaving) fails the reads that wait for it at once, naming
it; a parked read that waits longer than the timeout fails naming the slowest worker. No
sockets and no threads here: the server calls :meth:`update`, :meth:`leave`, :meth:`lost`
and :meth:`expired` from its loop and runs or fails what they return, so the rules are
tested with fake workers and a fake clock (``tests/unit/test_staleness.py``).

Invariants: a parked item is returned exactly once (released, or failed); with no bound
(``bound is None``) nothing is ever parked; clocks are absolute (a worker's clock message
sets its clock, so one lost or reordered message is corrected by the next).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import KVStoreError, NodeFailedError, StalenessTimeoutError

__all__ = ["ClockGate", "Parked"]


@dataclass(slots=True)
class Parked:
    """A read held back: whose (``worker``), what it is (``what``, for messages), since
    when, and the owner's ``item`` to run later."""

    worker: int
    what: str
    since: float
    item: Any = field(repr=False)


class ClockGate:
    """The clocks of a job's workers as one server knows them, and the reads they hold back.

    Parameters
    ----------
    num_workers : int
        The job's workers (ranks ``0 .. num_workers - 1``); one never heard of is at clock 0.
    where : str
        This server, for messages (``"server 0"``).
    clock : callable, optional
        Seconds, for the timeout of a parked read (``time.monotonic``).
    """

    def __init__(self, num_workers: int, where: str = "this server",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.where = where
        self._now = clock
        #: the global bound in pushes; None: no bound (nothing is parked)
        self.bound: int | None = None
        self.clocks: dict[int, int] = {}
        self.left: set[int] = set()
        self.gone: dict[int, str] = {}          # rank -> why (lost without leaving)
        self.parked: list[Parked] = []

    # ---- the rule ---------------------------------------------------------------------
    def live(self) -> list[int]:
        """The ranks whose clocks count (not left)."""
        return [w for w in range(self.num_workers) if w not in self.left]

    def slowest(self) -> tuple[int, int] | None:
        """``(rank, clock)`` of the live worker with the smallest clock (lowest rank on
        ties), or None when every worker left."""
        live = self.live()
        if not live:
            return None
        rank = min(live, key=lambda w: (self.clocks.get(w, 0), w))
        return rank, self.clocks.get(rank, 0)

    def behind(self, worker: int) -> list[int]:
        """The live workers more than ``bound`` pushes behind ``worker`` (none without a
        bound): those a read of ``worker`` waits for."""
        if self.bound is None:
            return []
        need = self.clocks.get(worker, 0) - self.bound
        return [w for w in self.live() if self.clocks.get(w, 0) < need]

    def allows(self, worker: int) -> bool:
        """Whether a read of ``worker`` may run now."""
        return self.bound is None or not self.behind(worker)

    # ---- changes ----------------------------------------------------------------------
    def park(self, worker: int, what: str, item: Any) -> None:
        """Hold ``item`` (a read of ``worker`` that :meth:`allows` refused)."""
        self.parked.append(Parked(worker, what, self._now(), item))

    def update(self, worker: int, clock: int | None = None, bound: Any = ...) -> list[Any]:
        """``worker`` says its clock (and, when given, the job's bound: None is none); it
        is live again if it had left or was lost. Returns the items that may run now, in
        the order they were parked."""
        if clock is not None:
            self.clocks[worker] = clock
        if bound is not ...:
            self.bound = bound
        self.left.discard(worker)
        self.gone.pop(worker, None)
        return self._release()

    def leave(self, worker: int) -> list[Any]:
        """``worker`` closed its store: its clock no longer holds anyone back."""
        self.left.add(worker)
        self.clocks.pop(worker, None)
        return self._release()

    def lost(self, worker: int, why: str) -> list[tuple[Any, KVStoreError]]:
        """``worker`` went away without leaving: every read that waits for it fails, and so
        does every later one (until it says its clock again, as a restarted worker does)."""
        if worker in self.left:
            return []
        self.gone[worker] = why
        return self._fail_gone()

    def expired(self, timeout: float) -> list[tuple[Any, KVStoreError]]:
        """The parked reads that waited more than ``timeout`` seconds, with their errors."""
        now = self._now()
        out: list[tuple[Any, KVStoreError]] = []
        keep: list[Parked] = []
        for p in self.parked:
            if now - p.since <= timeout:
                keep.append(p)
                continue
            late = self.behind(p.worker) or [w for w in self.live() if w != p.worker]
            names = ", ".join(f"worker {w} (clock {self.clocks.get(w, 0)})" for w in late)
            out.append((p.item, StalenessTimeoutError(
                f"{p.what} by worker {p.worker} (clock {self.clocks.get(p.worker, 0)}) waited "
                f"{now - p.since:.1f} s on {self.where} for {names}: the global staleness "
                f"bound is {self.bound} pushes. A worker is stuck or much slower: check it, "
                "or raise the bound (kv.set_staleness(..., global_bound=K), "
                "PSKV_GLOBAL_STALENESS) or PSKV_ROUND_TIMEOUT.")))
        self.parked = keep
        return out

    def fail_all(self, err: KVStoreError) -> list[tuple[Any, KVStoreError]]:
        """Every parked read, to be failed with ``err`` (the job failed)."""
        out = [(p.item, err) for p in self.parked]
        self.parked = []
        return out

    def check_new(self, worker: int, what: str) -> KVStoreError | None:
        """The error a new read of ``worker`` gets at once because a worker it would wait
        for is lost; None if it may wait (or run)."""
        for w in self.behind(worker):
            if w in self.gone:
                return self._gone_error(worker, what, w)
        return None

    # ---- internals --------------------------------------------------------------------
    def _release(self) -> list[Any]:
        ready: list[Parked] = []
        keep: list[Parked] = []
        for p in self.parked:
            (ready if self.allows(p.worker) else keep).append(p)
        self.parked = keep
        return [p.item for p in ready]

    def _fail_gone(self) -> list[tuple[Any, KVStoreError]]:
        out: list[tuple[Any, KVStoreError]] = []
        keep: list[Parked] = []
        for p in self.parked:
            err = self.check_new(p.worker, p.what)
            if err is None:
                keep.append(p)
            else:
                out.append((p.item, err))
        self.parked = keep
        return out

    def _gone_error(self, worker: int, what: str, w: int) -> KVStoreError:
        return NodeFailedError(
            f"{what} by worker {worker} (clock {self.clocks.get(worker, 0)}) waits on "
            f"{self.where} for worker {w} (clock {self.clocks.get(w, 0)}, more than the "
            f"global staleness bound of {self.bound} pushes behind), which is gone: "
            f"{self.gone[w]}. A worker that finishes must close its store (kv.close()) so "
            "that it leaves the bound; restart the job from a checkpoint if it died.")
