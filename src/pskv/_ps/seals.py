"""A worker's data position on the wire: step tags, seals, and where a restart resumes.

A worker that trains through a :class:`pskv.data.Sampler` has a *step* (the number of the
batch it trains, counted from 0 over the whole job): :class:`Seals` tags each of its pushes
with it, and *seals* what it pushed before any call waits for the servers and before the
next step begins (docs/data.md, "How it works"):

W1. A seal asks every server this worker pushed to since the last seal to answer (``SEAL``,
    ``commit`` false): an answer says every push before it on that link has arrived (a
    link is in order). Only once every server has answered does it send them all the
    commit (``commit`` true), which lets their rounds of the step close
    (:mod:`pskv.kvstore.engine._positions` P3). So no round of a step closes anywhere
    before every push of the step is on its server. A seal that finds another thread's
    in flight waits for it, then seals what was pushed since.
W2. The last step committed is kept, and sent again to a server that takes a shard over or
    comes back (``Failover``), after the pushes it lacks.
W3. A restarted worker resumes (:func:`resume`) at the step ``r``: the highest step any
    shard says it committed, or a later one some key holds a push of. Per key, a push of
    step ``r`` or later that a shard holds is not sent again: the worker's count of its
    pushes of the key starts at the count the shard held before step ``r``, and the
    pushes made again up to the count it holds now are dropped (``PushLog.resume``).
    Until it has made them again, its reads of such a key (pulls, table lookups) read
    the value as it is, not after the round of those pushes; and the commit of step
    ``r`` goes to such a shard at the first wait after they are made again (or when the
    next step begins, or at a flush), not at the step's first wait: a step that reads
    its weights before it pushes (pull, compute, push) reads the values of the step
    before again, as its first run did.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import numpy as np

from .message import Command, Meta
from .ops import Op, command

__all__ = ["Seals", "resume"]


class _Links(Protocol):
    def request(self, server: int, cmd: Command, keys: Sequence[int] = (), body: Any = None,
                arrays: Sequence[np.ndarray] = (), negative: bool = False) -> int: ...

    def wait(self, ts: int, timeout: float | None = None,
             what: str = "a reply") -> tuple[Meta, list[np.ndarray]]: ...


class Seals:
    """One worker's step and seals (W1, W2). ``links``: its KVWorker."""

    def __init__(self, links: _Links, step: int = 0) -> None:
        self._links = links
        self._lock = threading.Condition()
        #: the step this worker's pushes are tagged with now
        self.step = step
        #: the last step committed (W2), or None
        self.sealed: int | None = None
        self._dirty: set[int] = set()     # shards pushed to since the last seal
        self._sealing = False
        #: a restarted worker's shards holding its pushes of ``step`` (W3), not made again
        self._resumed: set[int] = set()
        self._resumed_step = step

    def tagged(self, shard: int, body: Any) -> dict[str, Any]:
        """A push message's ``body`` with this worker's step; ``shard`` is unsealed now."""
        with self._lock:
            self._dirty.add(shard)
            self._resumed.discard(shard)
            step = self.step
        return {**(body if isinstance(body, dict) else {}), "step": step}

    def resumed(self, shards: set[int]) -> None:
        """W3: ``shards`` hold pushes of the step this restarted worker resumes at. Each
        is sealed at the first wait after this worker made those pushes again (they are
        dropped, and :meth:`tagged` is told), as the first run's were, and at the latest
        when the next step begins or the worker flushes: not at the step's first wait,
        which may come before its pushes (a pull of the weights), where the first run had
        not committed the step and read the values of the step before."""
        with self._lock:
            self._resumed = set(shards)
            self._resumed_step = self.step

    def seal(self, final: bool = False) -> None:
        """W1: seal the pushes made since the last seal (nothing if none). ``final``: a
        flush (close, join): the resumed step's shards too (W3)."""
        with self._lock:
            if final:
                self._dirty |= self._resumed
                self._resumed = set()
            while self._sealing:
                # another thread's seal is in flight: it may not cover what this thread
                # pushed since it began, and this thread's next wait may need that
                self._lock.wait()
            if not self._dirty:
                return
            self._sealing = True
            shards, self._dirty = sorted(self._dirty), set()
            step = self.step
        try:
            asks = [self._links.request(s, Command.COMMAND,
                                        body=command(Op.SEAL, step=step, commit=False))
                    for s in shards]
            for ts in asks:
                self._links.wait(ts, what="the servers to confirm this worker's pushes")
            for s in shards:
                self._links.request(s, Command.COMMAND, negative=True,
                                    body=command(Op.SEAL, step=step, commit=True))
            self.sealed = step
        finally:
            with self._lock:
                self._sealing = False
                self._lock.notify_all()

    def advance(self, step: int) -> None:
        """The next step begins: seal the last one's pushes first."""
        with self._lock:
            if self._resumed and step > self._resumed_step:
                self._dirty |= self._resumed       # the resumed step ends (W3)
                self._resumed = set()
        self.seal()
        with self._lock:
            self.step = step


def resume(positions: dict[int, Any]) -> tuple[int, int | None,
                                                dict[int, dict[int, tuple[int, int]]]]:
    """W3: from each shard's answer to ``POSITION`` (``{"sealed": t, "marks": [[pk, held,
    step, base], ...]}``), the step to resume at, the highest step committed (None: none),
    and per shard ``{pk: (count to start from, count held)}``.

    Examples
    --------
    >>> resume({0: {"sealed": 4, "marks": [[7, 5, 4, 4], [8, 9, 5, 8]]},
    ...         1: {"sealed": 3, "marks": [[9, 4, 4, 3]]}})
    (5, 4, {0: {7: (5, 5), 8: (8, 9)}, 1: {9: (4, 4)}})
    """
    sealed = max((int(p.get("sealed", -1)) for p in positions.values()), default=-1)
    marks = {s: [m for m in p.get("marks", []) if isinstance(m, list) and len(m) == 4]
             for s, p in positions.items()}
    last = max((m[2] for ms in marks.values() for m in ms), default=-1)
    step = max(sealed, last, 0)
    counts = {s: {pk: (base if t == step else held, held) for pk, held, t, base in ms}
              for s, ms in marks.items()}
    return step, (sealed if sealed >= 0 else None), counts
