"""A worker's side of bounded staleness (docs/embeddings.md, "Bounded staleness").

Two bounds, both counted in push calls:

* the **per-worker bound** ``K`` (PERSIA's pipeline depth): a bounded read (a pull, a
  row_sparse pull, a training lookup) starts only when at most ``K`` of this worker's
  earlier push calls are unacknowledged; ``K = 0`` reads its own writes. A push is
  acknowledged when a FLUSH answered after it (a server answers a FLUSH once every earlier
  push of this worker is applied), so a read that finds more than ``K`` unacknowledged
  pushes first flushes them all: one round trip every ``K + 1`` pushes at most.
* the **global bound** (SSP): after each push call this worker tells every server its
  clock (the number of its push calls since the bound was set); the servers hold back a
  read of a worker that is more than the bound ahead of the slowest live worker
  (``_ps/staleness.py``).

:class:`Staleness` keeps the counts and is given two callables by its store (``flush``,
``tick``), so its rules are tested with fakes; :func:`check_bounds` is the one check of
the arguments, alike on every store type and every worker.

Invariant: with no bound set a store holds no :class:`Staleness` (its hot path checks one
attribute for None).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

from ..errors import StalenessError

__all__ = ["Staleness", "check_bounds"]


def _one(value: Any, what: str, store_type: str) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)           # ints and NumPy integers; never a float
    except TypeError:
        raise StalenessError(
            f"set_staleness on this {store_type!r} store: {what} must be a whole number of "
            f"pushes (0, 1, 2, ...) or None, got {type(value).__name__} {value!r}. Pass an "
            "int, e.g. kv.set_staleness(2).", store_type=store_type) from None
    if n < 0:
        raise StalenessError(
            f"set_staleness on this {store_type!r} store: {what} must be at least 0 pushes, "
            f"got {n}. Pass 0 to read your own writes, or a larger bound.",
            store_type=store_type)
    return n


def check_bounds(bound: Any, global_bound: Any, store_type: str) -> tuple[int | None, int | None]:
    """``(bound, global_bound)`` as ints (or None), or StalenessError naming the bad one."""
    return (_one(bound, "the bound", store_type),
            _one(global_bound, "global_bound", store_type))


class Staleness:
    """The push counts of one worker's store under a bound.

    Parameters
    ----------
    bound : int or None
        The per-worker bound ``K``: unacknowledged push calls a read may run ahead of.
    global_bound : int or None
        The global bound; when set, ``tick(clock)`` is called after every push call.
    flush : callable
        ``flush()``: wait until every push sent so far is applied (raises what failed).
    tick : callable
        ``tick(clock)``: tell every server this worker's clock.
    """

    def __init__(self, bound: int | None, global_bound: int | None,
                 flush: Callable[[], None], tick: Callable[[int], None]) -> None:
        self.bound = bound
        self.global_bound = global_bound
        self._flush = flush
        self._tick = tick
        #: push calls since the bound was set (the global clock)
        self.clock = 0
        #: push calls not acknowledged yet
        self.unacked = 0
        #: flushes a read made (tests and metrics)
        self.flushes = 0

    def pushed(self) -> None:
        """A push call was sent: count it (and with a global bound, tell the servers)."""
        self.unacked += 1
        self.clock += 1
        if self.global_bound is not None:
            self._tick(self.clock)

    def before_read(self) -> None:
        """A bounded read is about to be sent: first flush if more than ``bound`` push
        calls are unacknowledged."""
        if self.bound is not None and self.unacked > self.bound:
            self.flush()

    def flush(self) -> None:
        """Wait for every push call made so far to be applied (pushes another thread makes
        meanwhile stay counted)."""
        n = self.unacked
        self._flush()
        self.flushes += 1
        self.unacked = max(0, self.unacked - n)
