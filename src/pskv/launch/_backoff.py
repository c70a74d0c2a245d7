"""Restart back-off: how long a launcher waits before it starts a dead node again.

A node that keeps crashing is restarted after ``RESTART_DELAY_S``, then twice as long each
time, at most ``RESTART_DELAY_MAX_S`` (systemd's and the kubelet's crash-loop rule:
exponential, capped). A node that ran ``RESTART_RESET_S`` or longer before it died is
not in a crash loop: its next restart waits ``RESTART_DELAY_S`` again. Without it,
``--max-restarts 1000000`` restarted a node that fails at once about 17 times a second
(issue #34). Kubernetes pods get the kubelet's own back-off (CrashLoopBackOff).

Invariant: a node is started again no earlier than :meth:`Backoff.due` says, by the
launcher's watch loop, which keeps watching the other nodes (and signals) meanwhile.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable

__all__ = ["Backoff", "RESTART_DELAY_MAX_S", "RESTART_DELAY_S", "RESTART_RESET_S",
           "restart_delay"]

#: seconds before the first restart of a node (each later one in a row waits twice as long)
RESTART_DELAY_S = 0.5
#: seconds: the longest wait before a restart
RESTART_DELAY_MAX_S = 30.0
#: seconds: a node that ran this long before it died starts its back-off over
RESTART_RESET_S = 30.0


def restart_delay(streak: int) -> float:
    """Seconds before a restart after ``streak`` restarts in a row (0: the first).

    Examples
    --------
    >>> [restart_delay(n) for n in range(8)]
    [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    """
    return min(RESTART_DELAY_MAX_S, RESTART_DELAY_S * 2.0 ** min(streak, 64))


class Backoff:
    """The restarts a launcher has scheduled, one per node (any hashable id).

    :meth:`started` when a node starts, :meth:`schedule` when it died and has restarts
    left, then :meth:`due` until its time comes. ``clock`` (seconds, monotonic) is
    injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._streak: dict[Hashable, int] = {}
        self._started: dict[Hashable, float] = {}
        self._due: dict[Hashable, float] = {}

    def started(self, node: Hashable) -> None:
        """``node`` (re)started now."""
        self._started[node] = self.clock()
        self._due.pop(node, None)

    def schedule(self, node: Hashable) -> float:
        """``node`` died and will be restarted: the seconds it waits first."""
        now = self.clock()
        if now - self._started.get(node, now) >= RESTART_RESET_S:
            self._streak[node] = 0            # it ran long enough: not a crash loop
        streak = self._streak.get(node, 0)
        delay = restart_delay(streak)
        self._streak[node] = streak + 1
        self._due[node] = now + delay
        return delay

    def waiting(self, node: Hashable) -> bool:
        """Whether ``node`` has a restart scheduled that has not happened yet."""
        return node in self._due

    def due(self, node: Hashable) -> bool:
        """Whether ``node``'s scheduled restart may happen now."""
        return self.clock() >= self._due[node]

    def cancel(self, node: Hashable) -> None:
        """Drop ``node``'s scheduled restart (the job is ending)."""
        self._due.pop(node, None)

    @property
    def pending(self) -> bool:
        """Whether any restart is scheduled."""
        return bool(self._due)
