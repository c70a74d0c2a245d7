"""The staleness calls of a dist store (docs/embeddings.md, "Bounded staleness").

``kv.set_staleness(bound, global_bound=...)`` is collective, as ``init`` is: every worker
calls it, a barrier compares the workers' global bounds (and whether any refused its
arguments), so that every worker raises alike or none does; then, in ``dist_async``, each
worker flushes its pushes and tells every server the global bound and its clock 0 (an
``Op.CLOCK`` command), and a second barrier lets no worker go on before every server knows
every worker. The counting itself is :class:`._staleness.Staleness`; the servers' side is
``_ps/staleness.py``. A part of :class:`.dist.DistKVStore` (:class:`Bounds`), given its
:class:`._core.WorkerCore`.
"""
from __future__ import annotations

from typing import Any

from ...errors import KVStoreError, StalenessError
from ..._ps.ops import Op, command
from .._staleness import Staleness, check_bounds
from ._core import WorkerCore

__all__ = ["Bounds"]


class Bounds:
    """The staleness bounds of a DistKVStore: the bounds set (:attr:`bounds`) and what
    enforces them (:attr:`stale`: None in dist_sync and without a bound, the one attribute
    the hot path checks), and the clock messages to the servers."""

    def __init__(self, core: WorkerCore) -> None:
        self._core = core
        self.bounds: tuple[int | None, int | None] = (None, None)
        self.stale: Staleness | None = None

    def set(self, bound: int | None, global_bound: int | None) -> None:
        """``kv.set_staleness`` (the store's docstring), the locks taken here."""
        core = self._core
        with core.collective_lock, core.lock:
            core.begin()
            error: KVStoreError | None = None
            checked: tuple[int | None, int | None] = (None, None)
            try:
                checked = check_bounds(bound, global_bound, core.store_type)
            except KVStoreError as err:
                error = err
            if core.po.rejoin:
                # a restarted worker: the others are past this call; it says its clock
                if error is not None:
                    raise error
                return self._use(checked)
            payloads = core.collective("set_staleness", {
                "global": checked[1],
                "error": None if error is None else f"{type(error).__name__}: {error}"})
            if error is not None:
                raise error
            _check_same_global(payloads, core.store_type)
            self._use(checked)
            if not core.sync:
                core.collective("set_staleness (servers told)")

    def _use(self, checked: tuple[int | None, int | None]) -> None:
        """Enforce ``checked`` from now on (dist_async: every earlier push is applied
        first, and every server is told the global bound and this worker's clock 0)."""
        core = self._core
        self.bounds = checked
        if core.sync:
            return
        with core.unlocked():
            core.kv.flush()
        core.to_servers(command(Op.CLOCK, clock=0, bound=checked[1]), wait=True)
        self.stale = None if checked == (None, None) else Staleness(
            checked[0], checked[1], self._flush, self.tick)

    def _flush(self) -> None:
        """Wait (without the store lock) until every push sent so far is applied."""
        with self._core.unlocked():
            self._core.kv.flush()

    def tick(self, clock: int) -> None:
        """Tell every server this worker's clock (behind its pushes, on the same links), and
        the bound again (a server restarted without replicas learns it back)."""
        self._core.to_servers(command(Op.CLOCK, clock=clock, bound=self.bounds[1]))

    def before_read(self) -> None:
        """A pull or lookup is a bounded read (the per-worker bound; the servers apply the
        global one to training lookups)."""
        if self.stale is not None:
            self.stale.before_read()

    @property
    def global_bound(self) -> bool:
        """Whether a global bound holds this worker's clock against the others'."""
        return self.stale is not None and self.stale.global_bound is not None

    def leave(self) -> None:
        """Closing: this worker's clock no longer holds the others back."""
        self._core.to_servers(command(Op.CLOCK, leave=True))


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
