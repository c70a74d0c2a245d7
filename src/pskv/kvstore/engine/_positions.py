"""An engine's rules for data positions (``pskv.data``; docs/data.md, "How it works").

A mixin of :class:`._core.Engine`, with no sockets and no threads. A worker that trains
through a :class:`pskv.data.Sampler` tags each push with its *step* (the number of the
batch it trains, counted from 0 over the whole job), and *seals* its steps: a seal of step
``t`` says that every push of this worker tagged up to ``t`` has reached this shard (the
worker sends it only once every server has answered that its pushes arrived). The engine
keeps, per worker:

P1. ``sealed[w]``: the highest step ``w`` sealed here.
P2. per key, the *mark* of ``w``'s last push: ``(t, base)``, its step and how many of
    ``w``'s pushes of the key were held before the first one tagged ``t``. Marks travel
    with the key's counts (backups, checkpoints), so a worker restarted after a takeover
    reads them from whichever server holds the shard.
P3. in ``dist_sync``, a round with a push tagged ``t`` by ``w`` closes only once
    ``sealed[w] >= t``: no round of a step closes before its worker has every push of
    that step on every server. A worker killed in the middle of a step therefore finds the
    weights of the step before it everywhere, computes the same gradients again, and the
    job ends with the uninterrupted run's bits. ``dist_async`` applies pushes at once.
"""
from __future__ import annotations

from typing import Any, Callable

from ..._types import Key

__all__ = ["DataPositions", "marks_of", "mark_pairs"]


def mark_pairs(marks: dict[int, tuple[int, int]] | None) -> list[list[int]]:
    """``marks`` as JSON: ``[[worker, step, base], ...]`` by worker.

    Examples
    --------
    >>> mark_pairs({1: (4, 7), 0: (4, 6)}), mark_pairs(None)
    ([[0, 4, 6], [1, 4, 7]], [])
    """
    return [[w, t, b] for w, (t, b) in sorted((marks or {}).items())]


def marks_of(pairs: Any) -> dict[int, tuple[int, int]] | None:
    """The marks ``mark_pairs`` wrote (None when there are none); entries that are not
    three integers are ignored (a checkpoint or message checked before it got here).

    Examples
    --------
    >>> marks_of([[0, 4, 6], [1, "x", 2]]), marks_of(None)
    ({0: (4, 6)}, None)
    """
    out: dict[int, tuple[int, int]] = {}
    for p in pairs if isinstance(pairs, list) else []:
        if isinstance(p, list) and len(p) == 3 and all(type(x) is int for x in p):
            out[p[0]] = (p[1], p[2])
    return out or None


class DataPositions:
    """``seal``, ``position_of`` and the round gate of an :class:`._core.Engine`."""

    sync: bool
    _entries: dict[Key, Any]
    _clock: Callable[[], float]
    _close_round: Callable[..., None]
    _complete: Callable[[Any], bool]
    applied_by: Callable[[int], list[list[Any]]]
    events: Any

    def _init_positions(self) -> None:
        #: worker -> the highest step it sealed on this shard (P1)
        self.sealed: dict[int, int] = {}
        #: keys whose round has every push but waits for a seal (P3)
        self._unsealed: set[Key] = set()

    def _mark(self, entry: Any, worker: int, tag: int, held_before: int) -> None:
        """P2: ``worker``'s push tagged ``tag``, with ``held_before`` of its pushes held."""
        if entry.marks is None:
            entry.marks = {}
        last = entry.marks.get(worker)
        if last is None or tag > last[0]:      # a deferred push opening its round: older
            entry.marks[worker] = (tag, held_before)

    def _sealed_for(self, key: Key, entry: Any) -> bool:
        """P3: whether every tagged push of ``entry``'s open round is sealed; if not, the
        key waits for :meth:`seal`."""
        if not entry.tags:
            return True
        if all(self.sealed.get(w, -1) >= t for w, t in entry.tags.items()):
            return True
        self._unsealed.add(key)
        return False

    def seal(self, worker: int, step: int) -> None:
        """``worker`` sealed ``step`` here (P1): close the rounds that waited for it.
        Idempotent; a lower step than one sealed already changes nothing."""
        if step <= self.sealed.get(worker, -1):
            return
        self.sealed[worker] = step
        for key in sorted(self._unsealed, key=repr):
            entry = self._entries.get(key)
            if entry is None or not entry.pushers:
                self._unsealed.discard(key)
                continue
            if entry.tags and worker in entry.tags and self._sealed_for(key, entry) \
                    and self._complete(entry):
                self._unsealed.discard(key)
                self._close_round(key, entry,
                                  self._clock() if self.events.times_updates else 0.0)

    def position_of(self, worker: int) -> dict[str, Any]:
        """What a restarted ``worker`` needs to resume: the step it sealed here and, per
        key with a mark, ``[key, held, step, base]`` (``held``: its pushes held, as
        :meth:`applied_by` counts them)."""
        held = dict(self.applied_by(worker))
        marks = [[k, held.get(k, 0), *e.marks[worker]]
                 for k, e in self._entries.items() if e.marks and worker in e.marks]
        return {"sealed": self.sealed.get(worker, -1), "marks": marks}
