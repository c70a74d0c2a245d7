"""Loans: failover keeps the dist store's own send buffer (a multi-device sum) instead of a
copy, and copies it only when the store is about to write the buffer again while the push
is still kept (``kvstore/dist/_datapath.SendBuffer``, ``_ps/replay.py``); a caller's array
is never lent (the log copies it), so ``NDArray`` knows nothing of failover. Driven with
fake links (as ``test_failover.py``) and a DataPath over a fake worker: no socket, no
process.

The attack each test makes: a caller who changes, aliases or re-pushes an array after
``push`` returned, and a server that dies before the push was backed up; what is sent
again must be what was pushed."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest

import pskv as mx
from pskv._ps.failover import Failover
from pskv._ps.membership import ServerLost
from pskv._ps.message import Command
from pskv._ps.partition import Segment
from pskv.errors import NodeFailedError
from pskv.kvstore.dist._datapath import DataPath, SendBuffer
from pskv.kvstore._keys import KeyRecord
from pskv.kvstore._reduce import Reducer
from pskv.nd.ndarray import NDArray

from test_failover import FakeLinks


class _WrittenLinks(FakeLinks):
    """Fake links that keep what they sent as bytes written (copies), as a transport's
    socket does: they hold no reference to a sent array."""

    def send(self, server: int, cmd: Command, ts: int, keys: Sequence[int] = (),
             body: Any = None, arrays: Sequence[np.ndarray] = ()) -> None:
        super().send(server, cmd, ts, keys, body, [np.array(a) for a in arrays])


def _failover(keep: int = 8) -> tuple[Failover, FakeLinks]:
    links = _WrittenLinks()
    return Failover(links, rank=0, num_servers=2, keep=keep, replicas=True), links


def _lend_push(fo: Failover, g: SendBuffer, ts: int, pk: int = 7) -> None:
    fo.send(0, Command.PUSH, -ts, [pk], {"kinds": "d"}, [g.data], lenders=[g])


def _kept(fo: Failover, shard: int = 0) -> list[np.ndarray]:
    return [arrays[0] for _pk, _k, arrays, _ in fo.pushes.since(shard, {})]


def _resent(fo: Failover, links: FakeLinks) -> list[list[float]]:
    """Server 0 dies: the pushes failover sends its backup again, as lists."""
    links.take()
    fo.recover(lambda: None if fo.host[0] != 0 else ServerLost(0))
    return [a[0].tolist() for _s, c, _ts, _k, _b, a in links.take() if c == Command.PUSH]


class _CountingCopies:
    """Counts the copies a push log makes."""

    def __init__(self, fo: Failover, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = fo.pushes._copy

        def counted(a: np.ndarray) -> np.ndarray:
            self.n += 1
            return real(a)
        monkeypatch.setattr(fo.pushes, "_copy", counted)


def _buffer(value: float) -> SendBuffer:
    return SendBuffer(np.full(4, value, np.float32))


def _lent(monkeypatch: pytest.MonkeyPatch) -> tuple[Failover, FakeLinks, _CountingCopies,
                                                    SendBuffer]:
    """A failover that counts its copies, holding push 1 of a send buffer of 3s, lent."""
    fo, links = _failover()
    copies = _CountingCopies(fo, monkeypatch)
    g = _buffer(3.0)
    _lend_push(fo, g, 1)
    return fo, links, copies, g


# ---- the log keeps the buffer; a write copies first ----------------------------------------
def test_a_lent_push_is_the_buffer_until_the_store_writes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fo, links, copies, g = _lent(monkeypatch)
    assert _kept(fo)[0] is g.data and copies.n == 0
    g.writable()[:] = -1.0                  # the next sum, before the push was backed up
    kept = _kept(fo)[0]
    assert copies.n == 1 and kept is not g.data and kept.tolist() == [3.0] * 4
    assert _resent(fo, links) == [[3.0] * 4]


def test_a_push_backed_up_before_the_write_costs_no_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fo, links, copies, g = _lent(monkeypatch)
    fo.send(0, Command.PULL, 2, [7], None, ())
    fo.answered(2, ok=True)                 # the pull's reply: push 1 applied and backed up
    g.writable()[:] = 5.0
    assert copies.n == 0
    with pytest.raises(NodeFailedError):
        fo.pushes.since(0, {})              # nothing kept, nothing to send again
    _lend_push(fo, g, 3)                    # the next step lends the same buffer again
    g.writable()[:] = 6.0
    assert copies.n == 1
    assert [a[0].tolist() for _pk, _k, a, _ in fo.pushes.since(0, {7: 1})] == [[5.0] * 4]


def test_a_lent_buffer_never_becomes_a_buffer_of_later_copies() -> None:
    fo, links = _failover(keep=1)
    g = _buffer(1.0)
    _lend_push(fo, g, 1)
    fo.send(0, Command.PUSH, -2, [7], {"kinds": "d"}, [np.full(4, 9.0, np.float32)])  # pops 1
    fo.send(0, Command.PUSH, -3, [7], {"kinds": "d"}, [np.full(4, 8.0, np.float32)])
    assert g.data.tolist() == [1.0] * 4


def test_lending_the_same_buffer_twice_keeps_both_pushes_apart() -> None:
    fo, links = _failover()
    g = _buffer(1.0)
    _lend_push(fo, g, 1)
    g.writable()[:] += 1.0
    _lend_push(fo, g, 2)
    g.writable()[:] += 1.0
    assert _resent(fo, links) == [[1.0] * 4, [2.0] * 4]


@pytest.mark.parametrize("write", [
    lambda g: g.__iadd__(1.0),
    lambda g: g._assign(np.zeros(4, np.float32)),
    lambda g: mx.nd.zeros((4,)).copyto(g),
    lambda g: np.asarray(g).__setitem__(0, 9.0),    # an alias handed out after the push
    lambda g: g[1:3].__setitem__(slice(None), 9.0),
    lambda g: g.reshape(2, 2).__setitem__((0, 0), 9.0),
])
def test_a_callers_array_is_copied_so_no_way_of_writing_it_changes_what_is_sent_again(
        write: Any) -> None:
    rec = _record(1, (4,), [Segment(0, 0, 4)])
    path, kv, fo, links = _path([rec])
    g = mx.nd.full((4,), 2.0)
    path.send(path.items([1], [[g]]), lend=True)
    assert kv.lenders == [None]             # never lent: NDArray knows nothing of failover
    write(g)
    assert g.asnumpy().tolist() != [2.0] * 4
    assert _resent(fo, links) == [[2.0] * 4]


# ---- the data path: what it lends ----------------------------------------------------------
class _FakeKV:
    """A KVWorker that hands each push to a failover (as the real one does)."""

    def __init__(self, fo: Failover) -> None:
        self.fo = fo
        self.lenders: list[Sequence[Any] | None] = []
        self._ts = 0

    def push(self, server: int, cmd: Command, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray], lenders: Sequence[Any] | None = None) -> int:
        self._ts += 1
        self.lenders.append(lenders)
        self.fo.send(server, cmd, -self._ts, keys, body, arrays, lenders)
        return -self._ts


def _record(key: int, shape: tuple[int, ...], segments: list[Segment]) -> KeyRecord:
    return KeyRecord(key, key, shape, np.dtype(np.float32), False, None, NDArray,
                     pskey=key, segments=segments)


def _path(records: list[KeyRecord]) -> tuple[DataPath, _FakeKV, Failover, FakeLinks]:
    fo, links = _failover()
    kv = _FakeKV(fo)
    path = DataPath({r.key: r for r in records}, kv, Reducer(), lambda tss, what: [])  # type: ignore[arg-type]
    return path, kv, fo, links


def test_a_key_cut_across_both_servers_is_copied_per_server() -> None:
    rec = _record(1, (2, 4), [Segment(0, 0, 4), Segment(1, 4, 8)])
    path, kv, fo, links = _path([rec])
    g = mx.nd.array(np.arange(8, dtype=np.float32).reshape(2, 4))
    path.send(path.items([1], [[g]]), lend=True)
    assert kv.lenders == [None, None]
    g[:] = 0.0
    assert [a[0].tolist() for _pk, _k, a, _ in fo.pushes.since(1, {})] == [[4.0, 5.0, 6.0, 7.0]]
    assert _resent(fo, links) == [[0.0, 1.0, 2.0, 3.0]]


def test_an_aliased_array_or_a_held_push_is_copied_not_lent() -> None:
    rec = _record(1, (4,), [Segment(0, 0, 4)])
    path, kv, fo, links = _path([rec])
    g = mx.nd.full((4,), 2.0)
    alias = np.asarray(g)
    path.send(path.items([1], [[g]]), lend=True)
    assert kv.lenders == [None]
    alias[:] = 7.0                          # written through the alias: no loan to repay
    items = path.items([1], [[mx.nd.full((4,), 3.0)]])
    path.send(items)                        # not what items() just made for lending
    assert kv.lenders[1] is None
    assert _resent(fo, links) == [[2.0] * 4, [3.0] * 4]


def test_a_sum_of_devices_is_lent_from_its_send_buffer_and_repaid_by_the_next_sum() -> None:
    rec = _record(1, (4,), [Segment(0, 0, 4)])
    path, kv, fo, links = _path([rec])
    path.send(path.items([1], [[mx.nd.full((4,), 1.0), mx.nd.full((4,), 2.0)]]), lend=True)
    assert kv.lenders[0] is not None and kv.lenders[0][0] is path._sendbuf[1]
    assert np.shares_memory(_kept(fo)[0], path._sendbuf[1].data)   # kept, not copied
    path.send(path.items([1], [[mx.nd.full((4,), 5.0), mx.nd.full((4,), 5.0)]]), lend=True)
    assert _resent(fo, links) == [[3.0] * 4, [10.0] * 4]
