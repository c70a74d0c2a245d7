"""Loans: failover keeps a pushed NDArray's buffer instead of a copy, and copies it only
when the array is about to be written or handed out while the push is still kept
(``pskv.nd.ndarray``'s docstring, ``_ps/replay.py``). Driven with fake links (as
``test_failover.py``) and a DataPath over a fake worker: no socket, no process.

The attack each test makes: a caller who changes, aliases or re-pushes an array after
``push`` returned, and a server that dies before the push was backed up; what is sent
again must be what was pushed."""
from __future__ import annotations

import copy
import threading
from typing import Any, Sequence

import numpy as np
import pytest

import pskv as mx
from pskv._ps.failover import Failover
from pskv._ps.membership import ServerLost
from pskv._ps.message import Command
from pskv._ps.partition import Segment
from pskv.errors import NodeFailedError
from pskv.kvstore.dist._datapath import DataPath
from pskv.kvstore._keys import KeyRecord
from pskv.kvstore._reduce import Reducer
from pskv.nd.ndarray import NDArray, sole_buffer

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


def _lend_push(fo: Failover, g: NDArray, ts: int, pk: int = 7) -> None:
    buf = sole_buffer(g)
    assert buf is not None
    fo.send(0, Command.PUSH, -ts, [pk], {"kinds": "d"}, [buf], lenders=[g])


def _kept(fo: Failover, shard: int = 0) -> list[np.ndarray]:
    return [arrays[0] for _pk, _k, arrays in fo.pushes.since(shard, {})]


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


def _lent(monkeypatch: pytest.MonkeyPatch) -> tuple[Failover, FakeLinks, _CountingCopies,
                                                    NDArray]:
    """A failover that counts its copies, holding push 1 of an array of 3s, lent."""
    fo, links = _failover()
    copies = _CountingCopies(fo, monkeypatch)
    g = mx.nd.full((4,), 3.0)
    _lend_push(fo, g, 1)
    return fo, links, copies, g


# ---- sole_buffer: who may lend ------------------------------------------------------------
def test_only_an_array_whose_buffer_nothing_else_holds_may_lend_it() -> None:
    g = mx.nd.ones((3, 4))
    assert sole_buffer(g) is g._buf
    aliases = [lambda: g[0], lambda: g.reshape(12), lambda: g.T, lambda: np.asarray(g),
               lambda: copy.copy(g), lambda: memoryview(g._buf), lambda: g.__dlpack__(),
               lambda: NDArray(g._buf)]
    for make in aliases:
        alias = make()
        assert sole_buffer(g) is None, make
        del alias
        assert sole_buffer(g) is g._buf
    held = np.ones(3, np.float32)
    wrapped = NDArray(held)                 # the caller still holds the NumPy array
    assert sole_buffer(wrapped) is None
    del held
    assert sole_buffer(wrapped) is not None
    view_of_other = NDArray(np.ones(6, np.float32)[2:])
    assert sole_buffer(view_of_other) is None      # a view: its base may be anywhere


# ---- the log keeps the buffer; a write copies first ----------------------------------------
def test_a_lent_push_is_the_callers_buffer_until_the_array_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fo, links, copies, g = _lent(monkeypatch)
    assert _kept(fo)[0] is g._buf and copies.n == 0
    assert g.shape == (4,) and g.asnumpy().tolist() == [3.0] * 4 and copies.n == 0   # reads
    g[:] = -1.0                             # the next gradient, before the push was backed up
    kept = _kept(fo)[0]
    assert copies.n == 1 and kept is not g._buf and kept.tolist() == [3.0] * 4
    assert _resent(fo, links) == [[3.0] * 4]


@pytest.mark.parametrize("write", [
    lambda g: g.__iadd__(1.0),
    lambda g: g._assign(np.zeros(4, np.float32)),
    lambda g: mx.nd.zeros((4,)).copyto(g),
    lambda g: np.asarray(g).__setitem__(0, 9.0),    # an alias handed out after the push
    lambda g: g[1:3].__setitem__(slice(None), 9.0),
    lambda g: g.reshape(2, 2).__setitem__((0, 0), 9.0),
])
def test_every_way_of_writing_a_lent_array_repays_first(write: Any) -> None:
    fo, links = _failover()
    g = mx.nd.full((4,), 2.0)
    _lend_push(fo, g, 1)
    write(g)
    assert g.asnumpy().tolist() != [2.0] * 4
    assert _resent(fo, links) == [[2.0] * 4]


def test_a_push_backed_up_before_the_write_costs_no_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fo, links, copies, g = _lent(monkeypatch)
    fo.send(0, Command.PULL, 2, [7], None, ())
    fo.answered(2, ok=True)                 # the pull's reply: push 1 applied and backed up
    g[:] = 5.0
    assert copies.n == 0
    with pytest.raises(NodeFailedError):
        fo.pushes.since(0, {})              # nothing kept, nothing to send again
    _lend_push(fo, g, 3)                    # the next step lends the same buffer again
    g[:] = 6.0
    assert copies.n == 1
    assert [a[0].tolist() for _pk, _k, a in fo.pushes.since(0, {7: 1})] == [[5.0] * 4]


def test_a_lent_buffer_never_becomes_a_buffer_of_later_copies() -> None:
    fo, links = _failover(keep=1)
    g = mx.nd.full((4,), 1.0)
    _lend_push(fo, g, 1)
    fo.send(0, Command.PUSH, -2, [7], {"kinds": "d"}, [np.full(4, 9.0, np.float32)])  # pops 1
    fo.send(0, Command.PUSH, -3, [7], {"kinds": "d"}, [np.full(4, 8.0, np.float32)])
    assert g.asnumpy().tolist() == [1.0] * 4


def test_pushing_the_same_array_twice_keeps_both_pushes_apart() -> None:
    fo, links = _failover()
    g = mx.nd.full((4,), 1.0)
    _lend_push(fo, g, 1)
    g += 1.0
    _lend_push(fo, g, 2)
    g += 1.0
    assert _resent(fo, links) == [[1.0] * 4, [2.0] * 4]


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


def test_a_key_cut_across_both_servers_is_lent_whole_and_copied_once_written() -> None:
    rec = _record(1, (2, 4), [Segment(0, 0, 4), Segment(1, 4, 8)])
    path, kv, fo, links = _path([rec])
    g = mx.nd.array(np.arange(8, dtype=np.float32).reshape(2, 4))
    path.send(path.items([1], [[g]]), lend=True)
    assert all(lenders == [g] for lenders in kv.lenders)
    g[:] = 0.0
    assert [a[0].tolist() for _pk, _k, a in fo.pushes.since(1, {})] == [[4.0, 5.0, 6.0, 7.0]]
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
    path.send(path.items([1], [[mx.nd.full((4,), 5.0), mx.nd.full((4,), 5.0)]]), lend=True)
    assert _resent(fo, links) == [[3.0] * 4, [10.0] * 4]


# ---- threads ---------------------------------------------------------------------------------
def test_a_second_thread_touching_the_array_mid_repay_repays_too_so_waits_for_the_copy() -> None:
    # thread A reads the array and is copying it for the log; thread B, about to write it,
    # must not find the loans already let go: it repays too (and so waits, in the real
    # log, on the lock A holds) instead of writing under A's copy
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    class SlowLoan:
        def repay(self) -> None:
            calls.append(threading.current_thread().name)
            if len(calls) == 1:
                started.set()
                release.wait(10)

    g = mx.nd.ones(4)
    g._lend(SlowLoan())
    a = threading.Thread(target=lambda: g._data, name="A")
    b = threading.Thread(target=lambda: g._data, name="B")
    a.start()
    assert started.wait(10)
    b.start()
    b.join(10)
    release.set()
    a.join(10)
    assert calls == ["A", "B"]
    assert g._loans is None
