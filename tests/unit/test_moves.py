"""A server's removal from its running job, socket-free: ``server._moves.Moves`` over fake
shards (docs/durability.md, "Adding and removing servers while the job runs")."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from pskv.kvstore.durable._shards import HandedBack
from pskv.kvstore.engine._core import Engine
from pskv.kvstore.server._moves import Moves


class Repl:
    def __init__(self, up: bool = True) -> None:
        self.up, self.backup, self.drained, self.copying = up, 0, 0, False


class FakeShards:
    def __init__(self, served: dict[int, Any], handed: list[Any] | None = None) -> None:
        self.served = served
        self.deferred: dict[int, Any] = {}
        self._handed = handed or []
        self.drained = 0

    def drain(self) -> None:
        self.drained += 1

    def hand_back(self) -> list[Any]:
        out, self._handed = self._handed, []
        return out


def _server(rank: int = 2, backups: bool = True, served: Any = None,
            handed: list[Any] | None = None) -> Any:
    served = {rank: SimpleNamespace(replicator=Repl())} if served is None else served
    said: list[tuple[int, int]] = []
    kept: dict[int, Any] = {}

    def adopt(shard: int, engine: Engine) -> str:
        kept[shard] = engine
        return f"token-{shard}"
    return SimpleNamespace(backups=SimpleNamespace(adopt=adopt, kept=kept) if backups else None,
                           shards=FakeShards(served, handed), _flushes={},
                           po=SimpleNamespace(rank=rank, num_servers=3, said=said,
                                              shard_moved=lambda *a: said.append(a)))


def test_asked_to_leave_it_drains_its_backup_first_then_leaves() -> None:
    server = _server()
    moves = Moves(server)
    assert not moves.retiring()                  # not asked
    moves.asked.set()
    assert moves.retiring() and moves.retired
    assert server.shards.drained == 1


@pytest.mark.parametrize("why,server", [
    ("without PSKV_REPLICAS=1", _server(backups=False)),
    ("not its own alone", _server(served={2: SimpleNamespace(replicator=Repl()),
                                          1: SimpleNamespace(replicator=Repl())})),
    ("its backup is not connected", _server(served={2: SimpleNamespace(
        replicator=Repl(up=False))})),
])
def test_a_server_that_cannot_leave_says_why_once_and_serves_on(
        why: str, server: Any, caplog: pytest.LogCaptureFixture) -> None:
    moves = Moves(server)
    moves.asked.set()
    with caplog.at_level(logging.ERROR):
        assert not moves.retiring()
    assert not moves.retired and not moves.asked.is_set() and server.shards.drained == 0
    assert why in caplog.text and "serves on" in caplog.text


def test_a_handed_back_shard_ends_its_waiting_requests_unanswered_and_is_announced() -> None:
    engine = Engine(num_workers=2)
    ended: list[Any] = []
    engine.fail_all = lambda err: ended.append(err)    # type: ignore[method-assign]
    server = _server(rank=0, handed=[(2, engine)])
    server._flushes = {"conn": [(5, 2), (6, 0)]}
    Moves(server).hand_back()
    (err,) = ended
    assert isinstance(err, HandedBack) and (err.shard, err.host) == (2, 2)
    assert server._flushes == {"conn": [(6, 0)]}       # the flush naming shard 2 waits no more
    # server 0 is the backup of shard 2 once server 2 serves it: it keeps the engine as
    # that copy, and the scheduler passes the token on (no whole copy comes back)
    assert server.backups.kept == {2: engine} and server.po.said == [(2, 2, "token-2")]


def test_a_server_that_will_not_back_the_shard_up_keeps_no_copy() -> None:
    engine = Engine(num_workers=2)
    engine.fail_all = lambda err: None                 # type: ignore[method-assign]
    server = _server(rank=1, handed=[(2, engine)])     # shard 2's backup is server 0
    Moves(server).hand_back()
    assert server.backups.kept == {} and server.po.said == [(2, 2, "")]
