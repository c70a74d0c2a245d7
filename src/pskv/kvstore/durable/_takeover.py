"""A server's side of failover over time: requests that wait for a takeover, the
scheduler's news of deaths and restarts, and the first copy of a server's own shard.

With ``PSKV_REPLICAS=1`` (docs/durability.md) a worker whose server died asks that
server's backup for its shard. The backup takes the shard over (``Shards.get``) only once
the scheduler reported the server dead: a worker's broken link alone must not make a
backup split the shard of a server that lives. Until that word comes, the request is
*parked* here with a deadline (a broken link is reported within moments: the scheduler's
grace, then its word); the news of a death runs every parked request again, and a parked
request past its deadline is refused with the ``TakeoverPending`` that parked it.

:class:`Takeovers` is all of that, and the wait for the first copy of this server's own
shard on its backup (:meth:`Takeovers.await_first_copy`); no sockets, no threads: the
server's loop thread calls it, the events come from a callable (the Postoffice's
``next_event``), time from a clock and a sleep it is given, and a parked request is run
again through the ``rerun`` callable; ``tests/unit/test_takeover.py`` drives every rule
with fake events and a fake clock.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ...errors import ClusterError
from ..._ps.membership import ServerRejoined, ShardMoved
from ._shards import Shards

__all__ = ["Takeovers"]

#: ``rerun(deadline, request, last)``: serve a parked request again; ``last``: refuse it
#: (raise its TakeoverPending) if its shard still cannot be taken over
Rerun = Callable[[float, Any, bool], None]


class Takeovers:
    """Parked requests and the membership news of one server (see the module docstring).

    Parameters
    ----------
    shards : Shards
        What this server serves: the news lands in ``shards.lost`` and ``shards.rejoined``.
    next_event : callable
        The next membership event (``ServerLost`` / ``ServerRejoined``) or None.
    wait : float
        Seconds a request may wait for the scheduler's word before it is refused.
    rerun : callable
        ``rerun(deadline, request, last)`` serves a parked request again.
    clock, sleep : callables, default ``time.monotonic``, ``time.sleep``
    """

    def __init__(self, shards: Shards, next_event: Callable[[], Any], wait: float,
                 rerun: Rerun, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.shards, self.wait = shards, wait
        self._next_event, self._rerun = next_event, rerun
        self._clock, self._sleep = clock, sleep
        #: (deadline, request) of each parked request, in the order they came
        self._parked: list[tuple[float, Any]] = []

    def __len__(self) -> int:
        return len(self._parked)

    def deadline(self) -> float:
        """The deadline of a request that comes now."""
        return self._clock() + self.wait

    def park(self, deadline: float, request: Any) -> None:
        """Keep ``request`` until its shard's server is reported dead, or ``deadline``."""
        self._parked.append((deadline, request))

    def retry(self, expire: bool = False) -> None:
        """Run the parked requests again (now their shard may be taken over); with
        ``expire``, only those past their deadline, each for the last time."""
        waiting, self._parked = self._parked, []
        now = self._clock()
        for deadline, request in waiting:
            if expire and now < deadline:
                self._parked.append((deadline, request))
            else:
                self._rerun(deadline, request, expire)

    def events(self) -> None:
        """Act on the servers' deaths, restarts and moves the scheduler reported: a
        restarted server becomes the backup of the shards here it backs (an added one
        gets its shard handed back); a dead one's shards, or a shard handed here, may now
        be taken over, so the parked requests run again."""
        while (event := self._next_event()) is not None:
            if isinstance(event, ServerRejoined):
                self.shards.rejoined(event.rank, event.handback, event.added)
            elif isinstance(event, ShardMoved):
                # handed here: its copy is complete (its server sent every change before
                # it told the scheduler), so the requests parked for it run now
                self.shards.copy_deferred(event.host)    # its own shard is back there
                if event.host == self.shards.po.rank:
                    self.shards.handed[event.shard] = self._clock()
                    self.shards.kept[event.shard] = event.copy
                    self.retry()
            else:   # its shard is taken over when a worker asks for it
                self.shards.lost[event.rank] = self._clock()
                # a shard handed to it is this server's again to take over, if it kept
                # the copy (its backup): requests naming it are no longer left unanswered
                for shard in [s for s, h in self.shards.moved.items() if h == event.rank]:
                    del self.shards.moved[shard]
                self.retry()

    def await_first_copy(self, rank: int, timeout: float) -> None:
        """Return once shard ``rank`` (this server's own) has its whole copy on its
        backup, or the backup is reported dead (it gets the copy once it is back); a
        backup that never got a copy then knows the shard is empty and may serve it so
        (``Shards.get``). ClusterError after ``timeout`` seconds (PSKV_CONNECT_TIMEOUT);
        the news is read meanwhile."""
        deadline = self._clock() + timeout
        pause = 0.1         # doubled up to 1 s: a backup still starting is tried less often
        while not self.shards.copied(rank):
            if self._clock() >= deadline:
                raise ClusterError(
                    f"server {rank} could not send the first copy of its shard to its "
                    f"backup within {timeout:g} s, and the scheduler does not report that "
                    "backup dead: check the network between the servers "
                    "(PSKV_REPLICAS=1), or raise PSKV_CONNECT_TIMEOUT")
            self._sleep(min(pause, max(0.0, deadline - self._clock())))
            pause = min(2 * pause, 1.0)
            self.events()
