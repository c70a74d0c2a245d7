"""A server's takeover of a dead primary's shard, socket-free: ``durable._takeover.Takeovers``
over a real ``durable._shards.Shards`` whose backup links and backups are fakes, with a fake
clock and a fake queue of membership events (docs/durability.md, "Replicas")."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pskv._ps.membership import ServerLost, ServerRejoined, ShardMoved
from pskv._ps.ops import ReplOp
from pskv.errors import ClusterError
from pskv.kvstore.durable._shards import HandedBack, Shards, TakeoverPending
from pskv.kvstore.durable._takeover import Takeovers
from pskv.kvstore.engine._core import Engine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Link:
    """A shard's backup link that records what it would send; ``up`` once it sent."""

    def __init__(self, world: "World", cfg: Any, zctx: Any, po: Any, shard: int, backup: int,
                 engine: Engine) -> None:
        self.world, self.shard, self.backup = world, shard, backup
        self.endpoints: Any = None
        self.sent: list[Any] = []
        self.up, self.copying = False, False
        world.links.append(self)

    def aim(self, announced: Any) -> None:
        self.endpoints = announced

    def send(self, op: Any, body: Any, arrays: Any = (), wait: bool = True) -> None:
        if self.endpoints is None or self.backup in self.world.unreachable:
            return
        self.sent.append(op)
        self.up = True

    def close(self) -> None:
        self.closed = True

    def drain(self) -> None:
        self.sent.append("drained")


class World:
    """Server ``rank`` of three, its shards, the copies its backups hold (shard -> (the
    server it came from, when)), the membership events the scheduler will send, and the
    requests its takeovers ran again."""

    def __init__(self, rank: int, held: dict[int, tuple[int, float]] | None = None,
                 restart: int = 0) -> None:
        self.clock = Clock()
        self.links: list[Link] = []
        self.unreachable: set[int] = set()
        self.held = dict(held or {})
        self.events: list[Any] = []
        self.ran: list[tuple[Any, bool, Any]] = []
        po = SimpleNamespace(rank=rank, num_servers=3, num_workers=2,
                             servers={r: f"server-{r}" for r in range(3)})
        world = self

        class Held:
            def held_from(self, shard: int) -> tuple[int, float] | None:
                return world.held.get(shard)

            def take(self, shard: int) -> Engine | None:
                return Engine(num_workers=2) if world.held.pop(shard, None) else None

            def empty(self) -> Engine:
                return Engine(num_workers=2)

        self.shards = Shards(SimpleNamespace(restart=restart), None, po,  # type: ignore[arg-type]
                             SimpleNamespace(start=lambda engine, index, n: None),
                             Held(), Engine(),  # type: ignore[arg-type]
                             replicator=lambda *a: Link(self, *a), clock=self.clock)
        self.takeovers = Takeovers(self.shards, self._next_event, 5.0, self._rerun,
                                   clock=self.clock, sleep=self.clock.sleep)

    def _next_event(self) -> Any:
        return self.events.pop(0) if self.events else None

    def request(self, shard: int, name: str) -> None:
        """A worker's request for ``shard``, as the server's ``_serve`` runs it."""
        self.serve(self.takeovers.deadline(), (shard, name), last=False)

    def serve(self, deadline: float, request: Any, last: bool) -> None:
        shard, name = request
        try:
            got = self.shards.get(shard)
        except TakeoverPending as err:
            if last:
                self.ran.append((name, True, err))
                return
            self.takeovers.park(deadline, request)
            return
        self.ran.append((name, last, got))

    def _rerun(self, deadline: float, request: Any, last: bool) -> None:
        self.serve(deadline, request, last)


def test_a_request_waits_for_the_schedulers_word_then_the_backup_takes_the_shard_over() \
        -> None:
    w = World(rank=2, held={0: (0, 50.0)})      # server 2 backs shard 0, copied at t=50
    w.request(0, "pull")
    assert (w.ran, len(w.takeovers)) == ([], 1)  # server 0 not known dead: parked
    w.takeovers.events()                         # no news yet: still parked
    assert (w.ran, len(w.takeovers)) == ([], 1)
    w.clock.now += 1
    w.events.append(ServerLost(0))
    w.takeovers.events()
    ((name, last, shard),) = w.ran
    assert (name, last, shard.index, len(w.takeovers)) == ("pull", False, 0, 0)
    assert w.shards.lost[0] == w.clock.now
    (link,) = w.links                            # the taken-over shard's backup: server 0,
    assert (link.backup, link.endpoints, link.sent) == (0, None, [])   # dead, not aimed at


def test_a_request_past_its_deadline_is_refused_with_what_it_waited_for() -> None:
    w = World(rank=2, held={0: (0, 50.0)})
    w.request(0, "push")
    w.clock.now += 4.9
    w.takeovers.retry(expire=True)               # not yet past its 5 s
    assert (w.ran, len(w.takeovers)) == ([], 1)
    w.clock.now += 0.2
    w.takeovers.retry(expire=True)
    ((name, last, err),) = w.ran
    assert (name, last, len(w.takeovers)) == ("push", True, 0)
    assert isinstance(err, TakeoverPending) and (err.shard, err.source) == (0, 0)
    assert "not known dead" in str(err)


def test_expiry_leaves_the_requests_still_in_time_parked_in_order() -> None:
    w = World(rank=2, held={0: (0, 50.0)})
    w.request(0, "a")
    w.clock.now += 3
    w.request(0, "b")
    w.clock.now += 2.5                           # a is past its deadline, b is not
    w.takeovers.retry(expire=True)
    assert [r[0] for r in w.ran] == ["a"] and len(w.takeovers) == 1
    w.events.append(ServerLost(0))
    w.takeovers.events()
    assert [(r[0], r[1]) for r in w.ran] == [("a", True), ("b", False)]


def test_a_copy_sent_after_the_reported_death_is_not_taken_over() -> None:
    """Server 0 was reported dead at t=60 but its restart sent a new copy at t=70: a
    worker's broken link alone must not make the backup split a living server's shard."""
    w = World(rank=2, held={0: (0, 70.0)})
    w.shards.lost[0] = 60.0
    w.request(0, "pull")
    assert (w.ran, len(w.takeovers)) == ([], 1)


def test_a_restarted_server_becomes_the_backup_and_gets_the_whole_shard() -> None:
    w = World(rank=2, held={0: (0, 50.0)})
    w.events += [ServerLost(0)]
    w.takeovers.events()
    w.request(0, "pull")                         # taken over: its backup (0) is dead
    (link,) = w.links
    assert link.sent == []
    w.clock.now += 10
    w.events.append(ServerRejoined(0))
    w.takeovers.events()
    assert (link.endpoints, link.sent) == ("server-0", [ReplOp.NOOP])
    assert w.shards._alive(0)


def test_the_first_backup_serves_empty_the_shard_of_a_server_that_died_before_its_copy() \
        -> None:
    w = World(rank=1, held={})                   # server 1 is shard 0's first backup
    w.request(0, "pull")
    assert len(w.takeovers) == 1                 # no copy and not known dead: waits
    w.events.append(ServerLost(0))
    w.takeovers.events()
    ((name, last, shard),) = w.ran
    assert (name, last, shard.index, len(shard.engine)) == ("pull", False, 0, 0)


def test_the_first_copy_is_awaited_until_the_backup_has_it() -> None:
    w = World(rank=0)
    w.unreachable.add(1)                         # server 0's backup is server 1
    w.shards.serve(0, w.shards.own)
    (link,) = w.links
    start = w.clock.now

    def back_later(seconds: float) -> None:
        w.clock.sleep(seconds)
        if w.clock.now - start > 2.5:
            w.unreachable.discard(1)
    w.takeovers._sleep = back_later
    w.takeovers.await_first_copy(0, timeout=60)
    assert link.up and link.sent == [ReplOp.NOOP]
    assert 2.5 < w.clock.now - start < 5         # tried with growing pauses, not spun


def test_the_first_copy_wait_ends_when_the_backup_is_reported_dead() -> None:
    w = World(rank=0)
    w.unreachable.add(1)
    w.shards.serve(0, w.shards.own)
    w.events.append(ServerLost(1))
    w.takeovers.await_first_copy(0, timeout=60)  # it gets the copy once it is back
    assert w.shards.lost[1] <= w.clock.now and not w.links[0].up


def test_the_first_copy_wait_is_bounded_and_says_what_to_check() -> None:
    w = World(rank=0)
    w.unreachable.add(1)
    w.shards.serve(0, w.shards.own)
    start = w.clock.now
    with pytest.raises(ClusterError, match=r"server 0 could not send the first copy.*"
                       r"within 7 s.*PSKV_CONNECT_TIMEOUT"):
        w.takeovers.await_first_copy(0, timeout=7)
    assert w.clock.now - start == pytest.approx(7)


def test_a_shard_is_handed_back_to_the_server_added_into_its_slot_once_it_has_the_copy() \
        -> None:
    """Server 0 serves shard 2 (server 2 was removed); server 2 is added: server 0 sends
    it the whole shard, then (every change drained) serves shard 2 no more: a request
    naming it is never answered here (HandedBack), and the engine comes back to end the
    requests that waited in its rounds."""
    w = World(rank=0, held={2: (2, 50.0)})
    w.events.append(ServerLost(2))
    w.takeovers.events()
    w.request(2, "pull")                         # taken over as server 2's backup
    (link,) = w.links
    engine = w.shards.served[2].engine
    w.shards.hand_back()                         # nothing asked yet
    assert 2 in w.shards.served and link.sent == []
    w.unreachable.add(2)                         # added, but not reachable yet
    w.events.append(ServerRejoined(2, handback=True))
    w.takeovers.events()
    assert w.shards.handing == {2} and w.shards.hand_back() == [] and 2 in w.shards.served
    w.unreachable.discard(2)
    assert w.shards.hand_back() == []            # connects now: the whole shard goes
    assert link.up and link.sent == [ReplOp.NOOP]
    assert w.shards.hand_back() == [(2, engine)]
    assert link.sent == [ReplOp.NOOP, "drained"] and link.closed
    assert 2 not in w.shards.served and w.shards.moved == {2: 2} and not w.shards.handing
    assert engine.observer is None
    with pytest.raises(HandedBack, match="shard 2 was handed to server 2"):
        w.shards.get(2)
    # server 2 dies: server 0, its backup (it kept the copy it handed), takes it over again
    w.held[2] = (2, w.clock.now)
    w.clock.now += 1
    w.events.append(ServerLost(2))
    w.takeovers.events()
    assert w.shards.moved == {} and w.shards.get(2).index == 2


def test_a_restarted_server_is_not_asked_to_hand_back_and_a_plain_restart_hands_nothing() \
        -> None:
    w = World(rank=0, held={2: (2, 50.0)})
    w.events.append(ServerLost(2))
    w.takeovers.events()
    w.request(2, "pull")
    w.events.append(ServerRejoined(2))           # restarted after a death: stays a backup
    w.takeovers.events()
    assert not w.shards.handing and w.shards.hand_back() == [] and 2 in w.shards.served


def test_the_added_server_serves_its_own_shard_only_once_the_scheduler_says_it_moved() \
        -> None:
    """Server 2, added (a restarted process), holds the copy server 0 sent it; a worker's
    request for shard 2 waits until the scheduler's SHARD_MOVED, which comes only after
    server 0 sent every change, then takes the copy over."""
    w = World(rank=2, held={2: (0, 50.0)}, restart=1)
    w.request(None, "pull")                      # untagged: its own shard, not served yet
    assert (w.ran, len(w.takeovers)) == ([], 1)
    w.events.append(ShardMoved(1, 0))            # another shard's news: still waits
    w.takeovers.events()
    assert (w.ran, len(w.takeovers)) == ([], 1)
    w.clock.now += 1
    w.events.append(ShardMoved(2, 2))
    w.takeovers.events()
    ((name, last, shard),) = w.ran
    assert (name, last, shard.index, len(w.takeovers)) == ("pull", False, 2, 0)
    assert w.shards.served[2] is shard


def test_a_server_never_restarted_serves_its_own_shard_from_its_own_engine() -> None:
    w = World(rank=2, held={2: (0, 50.0)})
    assert w.shards.get(None).engine is w.shards.own


def test_an_added_servers_other_copies_wait_until_its_own_shard_is_back_there() -> None:
    """Server 1 serves shard 1, whose backup is slot 2; server 2 is added: shard 1's copy
    goes only once shard 2 was handed back to server 2 (one whole copy at a time), or
    DEFER_S later at the latest."""
    from pskv.kvstore.durable._shards import DEFER_S
    for news in ("moved", "late"):
        w = World(rank=1)
        w.shards.serve(1, w.shards.own)
        (link,) = w.links
        link.sent.clear()
        w.clock.now += 1
        w.events.append(ServerRejoined(2, added=True))
        w.takeovers.events()
        assert link.endpoints is None and link.sent == [] and 1 in w.shards.deferred
        w.events.append(ShardMoved(0, 0))        # another server's news: still waits
        w.takeovers.events()
        assert link.sent == []
        if news == "moved":
            w.events.append(ShardMoved(2, 2))
            w.takeovers.events()
        else:
            w.clock.now += DEFER_S - 1
            w.shards.copy_deferred()
            assert link.sent == []
            w.clock.now += 2
            w.shards.copy_deferred()
        assert (link.endpoints, link.sent, w.shards.deferred) == ("server-2", [ReplOp.NOOP],
                                                                  {}), news


def test_a_restarted_server_gets_its_copies_at_once() -> None:
    w = World(rank=1)
    w.shards.serve(1, w.shards.own)
    (link,) = w.links
    link.sent.clear()
    w.events.append(ServerRejoined(2))
    w.takeovers.events()
    assert (link.endpoints, link.sent, w.shards.deferred) == ("server-2", [ReplOp.NOOP], {})
