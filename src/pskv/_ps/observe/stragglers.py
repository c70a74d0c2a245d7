"""Stragglers named while they straggle: slow sync rounds and workers that are often last.

A server's engines report each open ``dist_sync`` round (:class:`OpenRound`) and each
closed one (which worker closed it, after how long); :class:`StragglerWatch` turns them
into log lines, with no sockets, no threads and an injectable clock:

* a round that has waited ``threshold`` seconds for its last workers is logged at WARNING,
  then again every ``threshold`` seconds while it still waits, one line per set of missing
  workers (``round 12 of key 'b' has waited 10.0 s for worker 1 (of 2)``), so a hang says
  whom it waits for long before the round timeout fails it;
* the worker whose push closed a round was its last; over the last :data:`WINDOW` closed
  rounds, a worker that was last in more than :data:`SHARE` of them (at least
  :data:`MIN_ROUNDS` rounds seen, two workers or more, and the rounds it closed waited
  :data:`MIN_WAIT` of ``threshold`` on average: a worker last by microseconds is no
  straggler) is flagged at WARNING, at most once per ``threshold`` seconds;
* every ``summary_every`` seconds (:data:`SUMMARY_EVERY`) in which rounds closed, one INFO
  line sums them up: how many, their mean and longest wait, and who was last most often.

Invariant: only the server's loop thread calls in (``check`` from its tick,
``round_closed`` from a push); what is logged is bounded per interval, whatever the
number of keys.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["JobStragglers", "MAX_KEYS_SHOWN", "MIN_ROUNDS", "MIN_WAIT", "OpenRound", "SHARE",
           "SUMMARY_EVERY", "StragglerWatch", "WINDOW", "describe_workers", "parse_beat"]

log = logging.getLogger(__name__)

#: closed rounds the last-worker share is computed over
WINDOW = 100
#: a worker last in more than this share of the window is flagged
SHARE = 0.75
#: closed rounds seen before any worker is flagged
MIN_ROUNDS = 20
#: the share of ``threshold`` a flagged worker's rounds waited on average (10 s: 0.1 s)
MIN_WAIT = 0.01
#: keys named in one straggler line; the rest are counted
MAX_KEYS_SHOWN = 5
#: seconds between two INFO summaries of the rounds that closed
SUMMARY_EVERY = 60.0


@dataclass(frozen=True, slots=True)
class OpenRound:
    """A sync round that some workers pushed and others not yet.

    ``key`` is the user's key, ``round`` its number, ``started`` when its first push came
    (the engine's clock), ``pushed`` the workers that pushed it, ``num_workers`` how many
    close it.
    """

    key: Any
    round: int
    started: float
    pushed: frozenset[int]
    num_workers: int

    @property
    def missing(self) -> tuple[int, ...]:
        """The workers the round still waits for (sorted)."""
        return tuple(w for w in range(self.num_workers) if w not in self.pushed)


def describe_workers(workers: tuple[int, ...], num_workers: int) -> str:
    """``worker 1 (of 2)`` or ``workers 1, 3 (of 4)``.

    Examples
    --------
    >>> describe_workers((1,), 2), describe_workers((1, 3), 4)
    ('worker 1 (of 2)', 'workers 1, 3 (of 4)')
    """
    names = ", ".join(str(w) for w in workers)
    return f"worker{'s' if len(workers) != 1 else ''} {names} (of {num_workers})"


class StragglerWatch:
    """Log rounds that wait too long, and workers that are often the last of a round.

    Parameters
    ----------
    threshold : float
        Seconds a round may wait before it is named (``PSKV_STRAGGLER_SECONDS``); also the
        interval between two lines about the same wait or the same worker.
    name : str
        The node, for the log lines ("server 0").
    clock : callable
        Seconds (``time.monotonic``); the engines' clock, as rounds' ``started`` use it.
    logger : logging.Logger, optional
    summary_every : float
        Seconds between two INFO summaries of closed rounds.
    """

    def __init__(self, threshold: float, name: str = "server",
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None,
                 summary_every: float = SUMMARY_EVERY) -> None:
        self.threshold = threshold
        self.name = name
        self._clock = clock
        self._log = logger or log
        #: (key, round, missing) -> when it was last named
        self._named: dict[tuple[Any, int, tuple[int, ...]], float] = {}
        #: the worker that closed each of the last WINDOW rounds that waited, and the wait
        self.last: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._flagged: dict[int, float] = {}      # worker -> when it was last flagged
        #: worker -> rounds it closed (all time): what a metric exports
        self.last_counts: Counter[int] = Counter()
        self.summary_every = summary_every
        self._since = clock()
        self._period: Counter[int] = Counter()      # this summary's rounds, by last worker
        self._waited = 0.0
        self._longest = 0.0
        #: worker -> [rounds it closed, seconds they waited] since the last heartbeat; the
        #: postoffice's thread takes it (take_beat) for the scheduler's job-wide view
        self._beat: dict[int, list[float]] = {}
        self._beat_lock = threading.Lock()

    # ---- rounds that wait ------------------------------------------------------------
    def check(self, rounds: Iterable[OpenRound]) -> list[str]:
        """Name the rounds of ``rounds`` that waited ``threshold`` or longer and were not
        named within the last ``threshold`` seconds; the lines logged."""
        now = self._clock()
        late: dict[tuple[int, ...], list[tuple[float, OpenRound]]] = {}
        seen = set()
        for rnd in rounds:
            waited = now - rnd.started
            if waited < self.threshold:
                continue
            ident = (rnd.key, rnd.round, rnd.missing)
            seen.add(ident)
            named = self._named.get(ident)
            if named is not None and now - named < self.threshold:
                continue
            self._named[ident] = now
            late.setdefault(rnd.missing, []).append((waited, rnd))
        for ident in [i for i in self._named if i not in seen]:   # closed (or failed)
            del self._named[ident]
        lines = []
        for missing, items in late.items():
            items.sort(key=lambda item: (-item[0], repr(item[1].key)))
            waited, first = items[0]
            who = describe_workers(missing, first.num_workers)
            if len(items) == 1:
                line = (f"{self.name}: round {first.round} of key {first.key!r} has waited "
                        f"{waited:.1f} s for {who}")
            else:
                shown = ", ".join(f"{r.key!r} (round {r.round})"
                                  for _w, r in items[:MAX_KEYS_SHOWN])
                more = len(items) - MAX_KEYS_SHOWN
                line = (f"{self.name}: rounds of {len(items)} keys have waited up to "
                        f"{waited:.1f} s for {who}: {shown}"
                        + (f" and {more} more" if more > 0 else ""))
            lines.append(line)
            self._log.warning("%s", line)
        return lines

    def summary(self) -> str | None:
        """Every ``summary_every`` seconds in which rounds closed: one INFO line about them
        (the line, else None)."""
        now = self._clock()
        if now - self._since < self.summary_every:
            return None
        closed = sum(self._period.values())
        line = None
        if closed:
            worker, times = max(self._period.items(), key=lambda item: (item[1], -item[0]))
            line = (f"{self.name}: {closed} sync rounds closed in the last "
                    f"{now - self._since:.0f} s; a round waited {self._waited / closed:.3f} s "
                    f"on average for its last push (longest {self._longest:.3f} s); worker "
                    f"{worker} was last in {times} of them")
            self._log.info("%s", line)
        self._since, self._period = now, Counter()
        self._waited = self._longest = 0.0
        return line

    # ---- workers that are last -------------------------------------------------------
    def round_closed(self, key: Any, worker: int, waited: float, num_workers: int) -> str | None:
        """``worker``'s push closed a round of ``key`` that waited ``waited`` seconds since
        its first push; the line logged when this flags ``worker``, else None."""
        self.last_counts[worker] += 1
        self._period[worker] += 1
        self._waited += max(waited, 0.0)
        self._longest = max(self._longest, waited)
        if num_workers < 2 or waited <= 0:
            return None
        with self._beat_lock:
            entry = self._beat.setdefault(worker, [0, 0.0])
            entry[0] += 1
            entry[1] += waited
        self.last.append((worker, waited))
        if len(self.last) < MIN_ROUNDS:
            return None
        waits = [w for who, w in self.last if who == worker]
        times = len(waits)
        if times <= SHARE * len(self.last) or sum(waits) / times < MIN_WAIT * self.threshold:
            return None
        now = self._clock()
        flagged = self._flagged.get(worker)
        if flagged is not None and now - flagged < self.threshold:
            return None
        self._flagged[worker] = now
        line = (f"{self.name}: worker {worker} (of {num_workers}) pushed last in {times} of "
                f"the last {len(self.last)} sync rounds, {sum(waits) / times:.3f} s after "
                f"their first push on average (key {key!r} just now): it is this job's "
                "straggler. Check its host's load, data loading or input pipeline.")
        self._log.warning("%s", line)
        return line

    def take_beat(self) -> list[list[float]] | None:
        """``[[worker, rounds it closed, seconds they waited], ...]`` since the last call,
        for a heartbeat to the scheduler (None: no round closed). Any thread."""
        with self._beat_lock:
            beat, self._beat = self._beat, {}
        if not beat:
            return None
        return [[w, int(n), round(waited, 6)] for w, (n, waited) in sorted(beat.items())]


def parse_beat(value: Any, num_workers: int) -> list[tuple[int, int, float]]:
    """A server heartbeat's ``last`` field (:meth:`StragglerWatch.take_beat`) as
    ``(worker, rounds, waited)`` triples; anything malformed or out of range is dropped
    (a heartbeat is never a reason to fail).

    Examples
    --------
    >>> parse_beat([[1, 3, 0.5], [7, 1, 0.1], ["x"], [0, -1, 0.0]], 2)
    [(1, 3, 0.5)]
    """
    if not isinstance(value, list):
        return []
    out = []
    for item in value[:num_workers]:
        if not (isinstance(item, list) and len(item) == 3):
            continue
        w, n, waited = item
        if type(w) is not int or type(n) is not int or not isinstance(waited, (int, float)):
            continue
        if 0 <= w < num_workers and 0 < n <= 1_000_000 and math.isfinite(waited) \
                and waited >= 0:
            out.append((w, n, float(waited)))
    return out


class JobStragglers:
    """The scheduler's view of stragglers across every server: each server's heartbeat
    says which workers closed its sync rounds (:meth:`StragglerWatch.take_beat`); over the
    last :data:`WINDOW` rounds of the whole job, a worker that closed more than
    :data:`SHARE` of them (at least :data:`MIN_ROUNDS`, two workers or more) after an
    average wait of :data:`MIN_WAIT` of ``threshold`` or more is flagged at WARNING, at most
    once per ``threshold`` seconds. A server sees only the keys it holds; this sees them
    all. No sockets, no threads, an injectable clock.
    """

    def __init__(self, threshold: float, num_workers: int,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self.threshold, self.num_workers = threshold, num_workers
        self._clock = clock
        self._log = logger or log
        #: (worker, rounds, waited) batches, newest last, trimmed to about WINDOW rounds
        self._window: deque[tuple[int, int, float]] = deque()
        self._rounds = 0
        self._flagged: dict[int, float] = {}

    def add(self, batches: Iterable[tuple[int, int, float]]) -> list[str]:
        """Take one server's heartbeat batches; the lines logged (flagged workers)."""
        for batch in batches:
            self._window.append(batch)
            self._rounds += batch[1]
        while self._window and self._rounds - self._window[0][1] >= WINDOW:
            self._rounds -= self._window.popleft()[1]
        if self.num_workers < 2 or self._rounds < MIN_ROUNDS:
            return []
        closed: Counter[int] = Counter()
        waited: dict[int, float] = {}
        for w, n, wait in self._window:
            closed[w] += n
            waited[w] = waited.get(w, 0.0) + wait
        now, lines = self._clock(), []
        for w, n in sorted(closed.items()):
            mean = waited[w] / n
            if n <= SHARE * self._rounds or mean < MIN_WAIT * self.threshold:
                continue
            flagged = self._flagged.get(w)
            if flagged is not None and now - flagged < self.threshold:
                continue
            self._flagged[w] = now
            line = (f"scheduler: worker {w} (of {self.num_workers}) pushed last in {n} of the "
                    f"job's last {self._rounds} sync rounds on all servers, {mean:.3f} s after "
                    "their first push on average: it is this job's straggler. Check its "
                    "host's load, data loading or input pipeline.")
            self._log.warning("%s", line)
            lines.append(line)
        return lines
