"""The worker's failover component (``_ps/failover.py``) driven with fake links: no socket,
no process, no clock. What the durability tests show with killed processes in minutes,
rule by rule in milliseconds."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest

from pskv._ps.failover import Failover, applied_counts
from pskv._ps.membership import ServerLost, ServerRejoined, ShardMoved
from pskv._ps.message import Command, Meta
from pskv._ps.ops import Op, command, parse
from pskv.errors import NodeFailedError


class FakeLinks:
    """Links that record what is sent and answer as the scripted servers would."""

    def __init__(self, broken: Sequence[int] = ()) -> None:
        self.sent: list[tuple[int, Command, int, tuple[int, ...], Any, list[np.ndarray]]] = []
        self.applied: dict[int, dict[int, int]] = {}   # server -> ps_key -> pushes it holds
        self.broken = set(broken)
        self.dropped: list[int] = []
        self.connected: list[int] = []
        self._ts = 100

    def next_ts(self) -> int:
        self._ts += 1
        return self._ts

    def send(self, server: int, cmd: Command, ts: int, keys: Sequence[int] = (),
             body: Any = None, arrays: Sequence[np.ndarray] = ()) -> None:
        if server in self.broken:
            raise NodeFailedError(f"server {server}: broken pipe")
        self.sent.append((server, cmd, ts, tuple(keys), body, list(arrays)))

    def await_reply(self, ts: int, what: str, timeout: float | None = None) -> Meta:
        server, cmd, _ts, _k, body, _a = next(s for s in self.sent if s[2] == ts)
        if cmd == Command.COMMAND and parse(body) is Op.APPLIED:
            counts = self.applied.get(server, {})
            return Meta(Command.ACK, ts, (), {"applied": [[k, n] for k, n in counts.items()]})
        return Meta(Command.ACK, ts)

    def drop(self, server: int) -> None:
        self.dropped.append(server)

    def connect(self, server: int) -> None:
        self.connected.append(server)
        self.broken.discard(server)

    def hello(self, server: int) -> Meta:
        counts = self.applied.get(server, {})
        return Meta(Command.ACK, 0, (), {"applied": [[k, n] for k, n in counts.items()]})

    def take(self) -> list[tuple[int, Command, int, tuple[int, ...], Any, list[np.ndarray]]]:
        out, self.sent = self.sent, []
        return out


def _push(fo: Failover, shard: int, pk: int, value: float, ts: int) -> None:
    fo.send(shard, Command.PUSH, -ts, [pk], {"kinds": "d"}, [np.full(2, value, np.float32)])


def _no_events() -> None:
    return None


def _failover(replicas: bool = True, servers: int = 2, keep: int = 8) -> tuple[Failover,
                                                                                FakeLinks]:
    links = FakeLinks()
    return Failover(links, rank=0, num_servers=servers, keep=keep, replicas=replicas), links


def test_requests_go_to_their_own_server_unchanged_while_it_lives() -> None:
    fo, links = _failover()
    _push(fo, 1, 7, 1.0, 1)
    fo.send(1, Command.PULL, 2, [7], None, [])
    sent = links.take()
    assert [(s, c, ts, k, b) for s, c, ts, k, b, _ in sent] == \
        [(1, Command.PUSH, -1, (7,), {"kinds": "d"}), (1, Command.PULL, 2, (7,), None)]


def test_a_broken_link_holds_requests_and_a_lost_server_moves_its_shard_to_the_backup() -> None:
    fo, links = _failover(servers=3)
    _push(fo, 1, 7, 1.0, 1)
    _push(fo, 1, 7, 2.0, 2)
    links.take()
    links.broken.add(1)
    _push(fo, 1, 7, 3.0, 3)                 # the send fails: server 1 is down, push kept
    assert fo.is_down(1) and links.sent == []
    fo.send(1, Command.PULL, 4, [7], None, [])
    assert links.sent == []                 # held: nobody serves shard 1 now
    links.applied[2] = {7: 1}               # the backup has the first push only
    fo.recover(_no_events)
    sent = links.take()
    assert sent[0][:2] == (2, Command.COMMAND) and parse(sent[0][4]) is Op.APPLIED
    assert sent[0][4]["shard"] == 1
    again = [(s, c, k, b) for s, c, _ts, k, b, _ in sent[1:]]
    assert again == [(2, Command.PUSH, (7,), {"kinds": "d", "shard": 1}),
                     (2, Command.PUSH, (7,), {"kinds": "d", "shard": 1}),
                     (2, Command.PULL, (7,), {"shard": 1})]
    assert [float(a[0][0]) for *_, a in sent[1:3]] == [2.0, 3.0]   # in order, from push 2
    assert sent[3][2] == 4                  # the pull keeps its ts: its waiter gets the reply
    assert fo.resent == (2, 1)              # pskv_worker_resent_total: 2 pushes, 1 request
    assert fo.host == [0, 2, 2] and links.dropped == [1]
    fo.send(1, Command.PULL, 5, [7], None, [])                     # routed from now on
    assert links.take()[0][:4] == (2, Command.PULL, 5, (7,))


def test_a_shard_whose_backup_is_down_too_is_lost_with_a_clear_error() -> None:
    fo, links = _failover(servers=3)
    fo.link_broke(2)
    links.broken.add(2)
    fo.link_broke(1)
    with pytest.raises(NodeFailedError, match="shard 1, server 2, is down too: that shard is lost"):
        fo.recover(_no_events)


def test_pushes_answered_by_a_pull_reply_are_no_longer_sent_again() -> None:
    fo, links = _failover()
    _push(fo, 0, 7, 1.0, 1)
    fo.send(0, Command.PULL, 2, [7], None, [])     # with replicas: its reply is an ack
    _push(fo, 0, 7, 2.0, 3)
    fo.answered(2, ok=True)
    with pytest.raises(NodeFailedError, match="no longer keeps push 1"):
        fo.pushes.since(0, {})              # push 1 was let go: applied and backed up
    links.take()
    links.applied[1] = {7: 1}
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    again = [a for s, c, _ts, _k, _b, a in links.take() if c == Command.PUSH]
    assert [float(a[0][0]) for a in again] == [2.0]


def test_an_error_reply_does_not_acknowledge_the_pushes_before_it() -> None:
    fo, links = _failover()
    _push(fo, 0, 7, 1.0, 1)
    fo.send(0, Command.PULL, 2, [7], None, [])
    fo.answered(2, ok=False)
    links.take()
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    pushes = [c for _s, c, *_ in links.take() if c == Command.PUSH]
    assert pushes == [Command.PUSH]
    assert not any(c == Command.PULL for _s, c, *_ in links.sent)   # answered: not again


def test_a_restarted_server_gets_its_settings_and_what_it_lacks_again() -> None:
    fo, links = _failover(replicas=False)
    fo.send(0, Command.COMMAND, 1, [], command(Op.COMPRESSION, params={"type": "2bit"}), [])
    fo.answered(1, ok=True)
    fo.send(0, Command.INIT, 2, [7], {"entries": [{"key": 7, "shape": [2]}]},
            [np.zeros(2, np.float32)])
    for i in range(3):
        _push(fo, 0, 7, float(i), 10 + i)
    links.take()
    links.applied[0] = {7: 2}               # reloaded from a checkpoint with 2 pushes
    fo.recover(lambda: ServerRejoined(0) if not links.connected else None)
    sent = links.take()
    assert links.dropped == [0] and links.connected == [0]
    assert parse(sent[0][4]) is Op.COMPRESSION            # the setting first
    assert sent[1][1] == Command.PUSH and float(sent[1][5][0][0]) == 2.0   # then push 3
    assert sent[2][1] == Command.INIT and sent[2][4]["again"] is True      # unanswered init
    assert not fo.is_down(0)


def test_a_server_restarted_unseen_with_replicas_is_failed_over_first() -> None:
    fo, links = _failover(servers=2)
    _push(fo, 0, 7, 1.0, 1)
    links.take()
    fo.recover(lambda: ServerRejoined(0) if not links.connected else None)
    sent = links.take()
    assert fo.host == [1, 1]                        # its backup serves shard 0
    assert sent[0][0] == 1 and parse(sent[0][4]) is Op.APPLIED
    assert links.connected == [0]                   # and it is the backup now
    assert not any(s == 0 for s, *_ in sent)


def test_a_push_no_longer_kept_makes_recovery_fail_loudly() -> None:
    fo, links = _failover(keep=1)
    for i in range(3):
        _push(fo, 0, 7, float(i), i + 1)
    links.applied[1] = {7: 0}
    with pytest.raises(NodeFailedError, match="no longer keeps push 1"):
        fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))


def test_a_restarted_worker_skips_the_pushes_the_server_applied() -> None:
    fo, _links = _failover(replicas=False)
    fo.pushes.applied_before(0, {7: 2, 8: 1})
    bodies = [fo.skip_applied(0, [7, 8], {"kinds": "dd"},
                              [np.zeros(1), np.ones(1)])[:2] for _ in range(3)]
    assert bodies == [([], {"kinds": ""}),          # both made again: dropped
                      ([8], {"kinds": "d"}),        # key 7's second made again; 8 is new
                      ([7, 8], {"kinds": "dd"})]    # caught up
    assert not fo.pushes.skipping


def test_recover_is_not_reentrant_and_takes_its_own_events_first() -> None:
    fo, links = _failover(servers=3)
    order: list[str] = []
    fo.link_broke(1)

    def events() -> ServerLost | None:
        order.append("membership")
        fo.recover(_no_events)              # a nested call returns at once
        return None
    fo.recover(events)
    assert fo.host[1] == 2 and order == ["membership"]


def test_applied_counts_ignores_malformed_pairs() -> None:
    assert applied_counts({"applied": [[1, 2], [3], "x", [4, True], [5, 6]]}) == {1: 2, 5: 6}
    assert applied_counts({"applied": "all"}) == {}


# ---- a PUSHPULL's push is borrowed, not copied (replicas) ----------------------------------
def _pushpull(fo: Failover, shard: int, pk: int, value: np.ndarray, ts: int) -> None:
    fo.send(shard, Command.PUSHPULL, ts, [pk], {"kinds": "d"}, [value])


def _kept(fo: Failover, shard: int) -> list[np.ndarray]:
    return [arrays[0] for _pk, _k, arrays, _ in fo.pushes.since(shard, {})]


def test_a_pushpull_keeps_the_callers_array_until_its_reply_lets_it_go() -> None:
    fo, links = _failover()
    grad = np.full(4, 3.0, np.float32)
    _pushpull(fo, 0, 7, grad, 1)
    assert _kept(fo, 0)[0] is grad          # no copy while the call waits for its reply
    fo.answered(1, ok=True)                 # applied and backed up
    fo.settle()
    with pytest.raises(NodeFailedError, match="no longer keeps push 1"):
        fo.pushes.since(0, {})


def test_a_pushpull_push_still_kept_when_the_call_returns_is_copied_then() -> None:
    fo, links = _failover()
    grad = np.full(4, 3.0, np.float32)
    _pushpull(fo, 0, 7, grad, 1)
    fo.answered(1, ok=False)                # an ERROR: the push may not be applied
    fo.settle()                             # the call returns: the caller may change grad
    grad[:] = -1.0
    kept = _kept(fo, 0)
    assert kept[0] is not grad and kept[0].tolist() == [3.0] * 4
    links.take()
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    again = [a for s, c, _ts, _k, _b, a in links.take() if c == Command.PUSH]
    assert [a[0].tolist() for a in again] == [[3.0] * 4]


def test_a_server_lost_during_a_pushpull_gets_the_borrowed_push_again() -> None:
    fo, links = _failover()
    grad = np.full(4, 5.0, np.float32)
    _pushpull(fo, 0, 7, grad, 1)
    links.take()
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))   # before any reply
    sent = links.take()
    assert [(s, c) for s, c, *_ in sent[1:]] == [(1, Command.PUSH), (1, Command.PULL)]
    assert sent[1][5][0].tolist() == [5.0] * 4
    fo.answered(1, ok=True)                 # the backup's reply
    fo.settle()
    grad[:] = 0.0
    with pytest.raises(NodeFailedError):
        fo.pushes.since(0, {})


def test_a_borrowed_array_never_becomes_a_buffer_of_later_copies() -> None:
    fo, links = _failover()
    grad = np.full(4, 1.0, np.float32)
    _pushpull(fo, 0, 7, grad, 1)
    fo.answered(1, ok=True)
    fo.settle()
    fo.send(0, Command.PUSH, -2, [7], {"kinds": "d"}, [np.full(4, 9.0, np.float32)])
    assert grad.tolist() == [1.0] * 4       # the copy of push 2 went elsewhere


def test_without_replicas_a_pushpull_push_is_copied_at_once() -> None:
    fo, links = _failover(replicas=False)
    grad = np.full(4, 3.0, np.float32)
    _pushpull(fo, 0, 7, grad, 1)
    kept = _kept(fo, 0)
    assert kept[0] is not grad and kept[0].tolist() == [3.0] * 4


def _made_again(fo: Failover, value: float) -> list[int]:
    """A restarted worker makes a push of ps_key 7 to shard 0 again: the keys still sent."""
    return fo.skip_applied(0, [7], {"kinds": "d"}, [np.full(2, value, np.float32)])[0]


def test_a_catch_up_target_from_a_server_that_died_is_lowered_to_what_its_backup_holds() -> None:
    # a restarted worker heard that server 0 holds 3 of its pushes of ps_key 7, the third
    # only in a round still open (held, not applied); server 0 dies before that round
    # closes and its backup holds 2: the third push made again must reach the backup, not
    # be dropped (the long chaos soak: a round then waited for ever for that worker, and
    # every later push of it landed one round late)
    fo, links = _failover(servers=2)
    fo.pushes.applied_before(0, {7: 3})
    assert _made_again(fo, 0.0) == [] and _made_again(fo, 1.0) == []
    links.applied[1] = {7: 2}
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    assert [c for _s, c, *_ in links.take()] == [Command.COMMAND]     # nothing to send again
    assert _made_again(fo, 2.0) == [7] and not fo.pushes.skipping


def test_a_push_dropped_while_catching_up_goes_to_the_backup_that_lacks_it() -> None:
    # as above, but the worker had made its third push again (and dropped it: server 0
    # held it) before server 0 died: the backup gets it from the log, in order
    fo, links = _failover(servers=2)
    fo.pushes.applied_before(0, {7: 3})
    assert [_made_again(fo, float(i)) for i in range(3)] == [[], [], []]
    assert not fo.pushes.skipping
    links.applied[1] = {7: 2}
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    again = [(s, k, float(a[0][0])) for s, c, _ts, k, _b, a in links.take()
             if c == Command.PUSH]
    assert again == [(1, (7,), 2.0)]
    assert _made_again(fo, 3.0) == [7]


def test_a_shard_handed_back_gets_what_it_lacks_and_the_unanswered_requests_once() -> None:
    """Shard 2 served by server 0 (its server was removed) is handed back to server 2,
    added into its slot (docs/durability.md, "Adding and removing servers"): the pushes
    server 0 ended unanswered in its open round go to server 2 again, then the requests
    not answered, and every later request goes to server 2 untagged."""
    fo, links = _failover(servers=3)
    fo.host = [0, 1, 0]
    _push(fo, 2, 7, 1.0, 1)
    _push(fo, 2, 7, 2.0, 2)
    fo.send(2, Command.PULL, 3, [7], None, [])
    sent = links.take()
    assert [(s, b) for s, *_x, b, _a in sent] == [(0, {"kinds": "d", "shard": 2}),
                                                  (0, {"kinds": "d", "shard": 2}),
                                                  (0, {"shard": 2})]
    links.applied[2] = {7: 1}                # server 0 handed over one applied push
    fo.recover(iter([ShardMoved(2, 2), None]).__next__)
    sent = links.take()
    assert sent[0][:2] == (2, Command.COMMAND) and parse(sent[0][4]) is Op.APPLIED
    again = [(s, c, ts, b) for s, c, ts, _k, b, _ in sent[1:]]
    assert [a[:2] for a in again] == [(2, Command.PUSH), (2, Command.PULL)]
    assert float(sent[1][5][0][0]) == 2.0 and again[0][3] == {"kinds": "d"}
    assert again[1][2:] == (3, None)        # same ts, no tag: server 2 serves its own shard
    assert fo.host == [0, 1, 2] and links.dropped == []
    fo.answered(3, True)
    fo.recover(iter([ShardMoved(2, 2), None]).__next__)      # said twice: nothing again
    assert links.take() == []
