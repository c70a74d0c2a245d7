"""The staleness calls of a dist store (docs/embeddings.md, "Bounded staleness").

``kv.set_staleness(bound, global_bound=...)`` is collective, as ``init`` is: every worker
calls it, a barrier compares the workers' global bounds (and whether any refused its
arguments), so that every worker raises alike or none does; then, in ``dist_async``, each
worker flushes its pushes and tells every server the global bound and its clock 0 (an
``Op.CLOCK`` command), and a second barrier lets no worker go on before every server knows
every worker. The counting itself is :class:`._staleness.Staleness`; the servers' side is
``_ps/staleness.py``. Mixed into :class:`.dist.DistKVStore`, whose lock it takes.
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import KVStoreError, StalenessError
from ..._ps.message import Command
from ..._ps.ops import Op, command
from .._staleness import Staleness, check_bounds

__all__ = ["StalenessMethods"]


class StalenessMethods:
    """``set_staleness`` and the clock messages of a DistKVStore."""

    _lock: Any
    _collective_lock: Any
    _po: Any
    _kv: Any
    _sync: bool
    _type: str
    _bounds: tuple[int | None, int | None]
    _stale: Staleness | None
    _begin: Callable[..., None]
    _collective: Callable[..., dict[str, dict[str, Any]]]
    _unlocked: Callable[[], Any]
    _wait_all: Callable[[list[int], str], list[Any]]

    def set_staleness(self, bound: int | None, *, global_bound: int | None = None) -> None:
        """Bound how stale the values this worker reads may be (collective: every worker
        calls it, as it calls ``init``).

        In ``dist_async``: a pull, row_sparse_pull or lookup starts only when at most
        ``bound`` of this worker's earlier push calls are unacknowledged (0: it reads its
        own writes), and, with ``global_bound``, a pull, row_sparse_pull or training lookup
        of a worker more than ``global_bound`` push calls ahead of the slowest live worker
        waits on the servers (SSP); a worker that closes its store leaves the bound, and a
        wait for a stuck or lost worker fails naming it. ``dist_sync`` already keeps every
        worker in one round, so any bound holds there: it is checked and recorded only.
        Setting it again (or to None: no bound) mid-job is safe: the clocks restart at 0.

        Parameters
        ----------
        bound : int or None
            Unacknowledged push calls a read may run ahead of; None: no per-worker bound.
        global_bound : int or None, keyword-only
            Push calls the fastest live worker may be ahead of the slowest; None: none.

        Raises
        ------
        StalenessError
            On every worker, when any worker's bound is not a whole number of at least 0
            or the workers' ``global_bound`` differ; nothing is changed.
        """
        with self._collective_lock, self._lock:
            self._begin()
            error: KVStoreError | None = None
            checked: tuple[int | None, int | None] = (None, None)
            try:
                checked = check_bounds(bound, global_bound, self._type)
            except KVStoreError as err:
                error = err
            if self._po.rejoin:
                # a restarted worker: the others are past this call; it says its clock
                if error is not None:
                    raise error
                return self._use_bounds(checked)
            payloads = self._collective("set_staleness", {
                "global": checked[1],
                "error": None if error is None else f"{type(error).__name__}: {error}"})
            if error is not None:
                raise error
            _check_same_global(payloads, self._type)
            self._use_bounds(checked)
            if not self._sync:
                self._collective("set_staleness (servers told)")

    def _use_bounds(self, checked: tuple[int | None, int | None]) -> None:
        """Enforce ``checked`` from now on (dist_async: every earlier push is applied
        first, and every server is told the global bound and this worker's clock 0)."""
        self._bounds = checked
        if self._sync:
            return
        with self._unlocked():
            self._kv.flush()
        self._to_servers(command(Op.CLOCK, clock=0, bound=checked[1]), wait=True)
        self._stale = None if checked == (None, None) else Staleness(
            checked[0], checked[1], self._stale_flush, self._tick)

    def _stale_flush(self) -> None:
        """Wait (without the store lock) until every push sent so far is applied."""
        with self._unlocked():
            self._kv.flush()

    def _tick(self, clock: int) -> None:
        """Tell every server this worker's clock (behind its pushes, on the same links), and
        the bound again (a server restarted without replicas learns it back)."""
        self._to_servers(command(Op.CLOCK, clock=clock, bound=self._bounds[1]))

    def _to_servers(self, body: dict[str, Any], wait: bool = False) -> None:
        """Send a COMMAND to every server: answered (``wait``) or one-way."""
        tss = [self._kv.request(s, Command.COMMAND, body=body, negative=not wait)
               for s in range(self._po.num_servers)]
        if wait:
            self._wait_all(tss, f"the servers to take {body['op']}")

    def _before_lookup(self) -> None:
        """A lookup is a bounded read (the per-worker bound; the servers apply the global
        one to training lookups)."""
        if self._stale is not None:
            self._stale.before_read()

    def _leave_bound(self) -> None:
        """Closing: this worker's clock no longer holds the others back."""
        self._to_servers(command(Op.CLOCK, leave=True))


def _check_same_global(payloads: dict[str, dict[str, Any]], store_type: str) -> None:
    """Raise StalenessError (on every worker alike) if a worker's bounds were refused or
    the workers' global bounds differ."""
    for rank, p in sorted(payloads.items(), key=lambda rp: int(rp[0])):
        if (p or {}).get("error"):
            raise StalenessError(
                f"set_staleness was refused on worker {rank}: {p['error']}. Every worker "
                "must pass valid bounds; nothing was changed.", store_type=store_type)
    seen = {r: (p or {}).get("global") for r, p in payloads.items()}
    if len(set(seen.values())) > 1:
        each = ", ".join(f"worker {r}: {g}" for r, g in
                         sorted(seen.items(), key=lambda rg: int(rg[0])))
        raise StalenessError(
            f"the workers called set_staleness with different global bounds ({each}). Pass "
            "the same global_bound on every worker; nothing was changed.",
            store_type=store_type)
