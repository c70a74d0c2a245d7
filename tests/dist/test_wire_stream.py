"""Stream framing carries both header forms (binary for the hot path, JSON for control)."""
from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from pskv._ps.auth import Verifier
from pskv._ps.message import Command, Meta
from pskv._ps.serve import ServeLoop
from pskv._ps.stream import SEND_PATIENCE, StreamConn, StreamListener


#: two connected StreamConns: ``a`` (sends, mostly) and ``b``
Pair = tuple[StreamConn, StreamConn]


@pytest.fixture
def conns() -> Iterator[Pair]:
    """The two ends of a socket pair as StreamConns, ``a`` and ``b``; closed after the test."""
    s1, s2 = socket.socketpair()
    a, b = StreamConn(s1, 5.0, "a"), StreamConn(s2, 5.0, "b")
    yield a, b
    a.close()
    b.close()


def test_stream_carries_binary_and_json_headers(conns: Pair) -> None:
    a, b = conns
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a.send(Command.PUSHPULL, 3, [6], {"kinds": "d"}, [x])
    a.send(Command.BARRIER, 4, body={"group": "all"})
    a.send(Command.ACK, 5)
    got: list = []
    for _ in range(100):
        got += b.receive()
        if len(got) == 3:
            break
    assert [m for m, _ in got] == [Meta(Command.PUSHPULL, 3, (6,), {"kinds": "d"}),
                                   Meta(Command.BARRIER, 4, (), {"group": "all"}),
                                   Meta(Command.ACK, 5)]
    np.testing.assert_array_equal(got[0][1][0], x)


def drain(conn: StreamConn, want: int, limit: int = 64) -> list:
    got: list = []
    for _ in range(10_000):
        got += [(m, [a.copy() for a in arrays]) for m, arrays in conn.receive(None, limit)]
        if len(got) >= want:
            break
    return got


def test_a_blocking_send_waits_for_room_on_any_descriptor_number() -> None:
    """A send that fills the socket waits for the reader with poll: select() refuses
    descriptors from 1024 up, which a process with many connections reaches."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the open-files limit ({hard}) allows no descriptor above 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100) if hard ==
                                                resource.RLIM_INFINITY else hard, hard))
    s1, s2 = socket.socketpair()
    high = [os.dup2(s1.fileno(), 1050), os.dup2(s2.fileno(), 1051)]
    s1.close()
    s2.close()
    a = StreamConn(socket.socket(fileno=high[0]), 5.0, "a")
    b = StreamConn(socket.socket(fileno=high[1]), 5.0, "b")
    big = np.arange(4 << 20, dtype=np.float32)       # far more than the socket holds
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(drain(b, 1)), daemon=True)
    try:
        reader.start()
        a.send(Command.DATA, 1, [0], None, [big])
        reader.join(20)
        assert len(got) == 1
        np.testing.assert_array_equal(got[0][1][0], big)
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_many_small_messages_in_one_read_come_out_one_by_one(conns: Pair) -> None:
    a, b = conns
    for i in range(300):
        a.send(Command.PUSH, -i - 1, [2 * i], {"kinds": "d"}, [np.full(3, i, np.float32)])
    got = []
    end = time.monotonic() + 20       # a bound in time: polls run fast on a quiet machine
    while time.monotonic() < end:     # and slowly on a loaded one
        one = b.receive(None, 1)
        assert len(one) <= 1
        got += [(m, arrays[0].copy()) for m, arrays in one]
        if len(got) == 300:
            break
    assert [m.ts for m, _ in got] == [-i - 1 for i in range(300)]
    assert all((arr == i).all() for i, (_, arr) in enumerate(got))
    assert b.buffered() == 0


def test_bytes_trickling_in_any_split_make_the_same_messages() -> None:
    rng = np.random.default_rng(5)
    big = rng.standard_normal(100_000).astype(np.float32)      # 400 KB: read into place
    small = np.arange(6, dtype=np.int64).reshape(2, 3)
    # capture the exact bytes of three messages, then feed them in uneven pieces
    r1, r2 = socket.socketpair()
    tap = StreamConn(r1, 5.0, "tap")
    tap.send(Command.DATA, 1, arrays=[small])
    tap.send(Command.DATA, 2, arrays=[big, small])
    tap.send(Command.COMMAND, 3, body={"op": "save"})
    r2.setblocking(False)
    wire = b""
    while True:
        try:
            chunk = r2.recv(1 << 20)
        except BlockingIOError:
            break
        wire += chunk
    tap.close()
    r2.close()
    s3, s4 = socket.socketpair()
    b = StreamConn(s4, 5.0, "b")
    got: list = []
    pos = 0
    try:
        while pos < len(wire):
            n = int(rng.integers(1, 70_000))
            s3.sendall(wire[pos:pos + n])
            pos += n
            got += [(m, [x.copy() for x in arrays]) for m, arrays in b.receive(None, 1)]
        got += drain(b, 3 - len(got))
        assert [m for m, _ in got] == [Meta(Command.DATA, 1), Meta(Command.DATA, 2),
                                       Meta(Command.COMMAND, 3, (), {"op": "save"})]
        np.testing.assert_array_equal(got[0][1][0], small)
        np.testing.assert_array_equal(got[1][1][0], big)
        np.testing.assert_array_equal(got[1][1][1], small)
    finally:
        s3.close()
        b.close()


def test_a_big_reply_lands_in_the_callers_array(conns: Pair) -> None:
    a, b = conns
    big = np.arange(50_000, dtype=np.float32)
    out = np.zeros_like(big)
    a.send(Command.DATA, 7, arrays=[big])
    got: list = []
    for _ in range(10_000):
        got += b.receive(lambda meta: (lambda i, dt, shape: out), 1)
        if got:
            break
    assert got[0][1][0] is out
    np.testing.assert_array_equal(out, big)


def test_a_message_of_many_arrays_crossing_read_buffers(conns: Pair) -> None:
    a, b = conns
    arrays = [np.full(1000 + i % 7, i, np.float32) for i in range(300)]   # ~1.2 MB
    sender = threading.Thread(target=a.send, args=(
        Command.PUSH, -1, list(range(0, 600, 2)), {"kinds": "d" * 300}, arrays))
    sender.start()                   # more than a socket buffer may hold: read meanwhile
    got = drain(b, 1)
    sender.join(10)
    meta, back = got[0]
    assert meta.keys == tuple(range(0, 600, 2)) and len(back) == 300
    for want, arr in zip(arrays, back, strict=True):
        np.testing.assert_array_equal(arr, want)


def test_a_message_arriving_after_a_drained_read_is_read_by_the_next_poll(
        conns: Pair) -> None:
    a, b = conns
    for ts in range(1, 50):
        a.send(Command.ACK, ts)
        assert select.select([b.fileno()], [], [], 5.0)[0]    # as every caller does
        got: list = []
        while not got:                    # poll is level-triggered: it says so again
            got = b.receive(None, 1)
            if not got:
                assert select.select([b.fileno()], [], [], 5.0)[0]
        assert [m.ts for m, _ in got] == [ts]


def test_a_queued_connection_never_waits_and_keeps_a_copy_of_what_it_queued(
        conns: Pair) -> None:
    # a node's loop: the reader does not read, yet send returns at once; the rest of the
    # message waits in the output queue (a copy: the caller may change its array), is
    # written in order when flushed, and the reader gets each message whole
    a, b = conns
    a.queued = True
    calls: list[int] = []
    a.on_queued = lambda: calls.append(a.queued_bytes())
    x = np.arange(4 << 20, dtype=np.float32)        # 16 MiB: more than the buffers
    start = time.monotonic()
    a.send(Command.DATA, 1, arrays=[x])
    a.send(Command.ACK, 2)
    assert time.monotonic() - start < 2.0
    assert len(calls) == 1 and a.queued_bytes() > 0
    want = x.copy()
    x[:] = -1                                       # queued bytes are a copy
    assert not a.write_stalled(time.monotonic())
    assert a.write_stalled(time.monotonic() + 10.0)
    got: list = []
    end = time.monotonic() + 20
    while len(got) < 2 and time.monotonic() < end:
        a.flush()
        select.select([b.sock], [], [], 0.01)
        got += [(m, [arr.copy() for arr in arrays]) for m, arrays in b.receive()]
    assert [m.ts for m, _ in got] == [1, 2]
    np.testing.assert_array_equal(got[0][1][0], want)
    assert a.flush() and a.queued_bytes() == 0


def _count_waits(conn: StreamConn) -> list[float]:
    """Record the timeout of every wait for room ``conn`` makes (and still wait)."""
    waits: list[float] = []
    wait = conn._wait_writable

    def counted(timeout: float) -> bool:
        waits.append(timeout)
        return wait(timeout)
    conn._wait_writable = counted  # type: ignore[method-assign]
    return waits


def _read_all(conn: StreamConn, want: int, writer: StreamConn | None = None,
              seconds: float = 20.0) -> list:
    """Read ``want`` messages (copies of their arrays), flushing ``writer`` meanwhile."""
    got: list = []
    end = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < end:
        if writer is not None:
            writer.flush()
        poller = select.poll()          # not select(): any descriptor number
        poller.register(conn.sock.fileno(), select.POLLIN)
        poller.poll(10)
        # one at a time: the next message may reuse this one's buffers
        got += [(m, [arr.copy() for arr in arrays]) for m, arrays in conn.receive(None, 1)]
    return got


def test_a_queued_send_to_a_reader_waits_for_room_and_copies_nothing(conns: Pair) -> None:
    # an admitted peer that reads: the send writes straight from the caller's array while
    # the peer takes it (no copy queued), and what the peer gets is the array at send time
    a, b = conns
    a.queued, a.patience = True, 10.0      # generous: a loaded machine schedules late
    calls: list[int] = []
    a.on_queued = lambda: calls.append(a.queued_bytes())
    waits = _count_waits(a)
    got: list = []
    def read() -> None:
        time.sleep(0.2)            # late: the send finds the socket full and must wait
        got.extend(_read_all(b, 1))
    reader = threading.Thread(target=read, daemon=True)
    x = np.arange(8 << 20, dtype=np.float32)        # 32 MiB: several times the buffers
    want = x.copy()
    reader.start()
    a.send(Command.DATA, 1, arrays=[x])
    assert calls == [] and a.queued_bytes() == 0     # nothing was copied
    assert waits and all(t <= 10.0 for t in waits)   # it waited for the reader
    x[:] = -1                                        # the kernel has its own copy
    reader.join(20)
    assert [m.ts for m, _ in got] == [1]
    np.testing.assert_array_equal(got[0][1][0], want)


def test_a_queued_send_to_a_peer_that_stops_reading_waits_once_per_drain(conns: Pair) -> None:
    # a peer that reads nothing: the first reply waits for room, each wait within the
    # patience, then the rest is copied; replies while output
    # waits are copied at once (no wait at all); the peer gets every reply as it was at
    # send time, and once its queue drained the next reply may wait again
    a, b = conns
    a.queued, a.patience = True, 0.05
    waits = _count_waits(a)
    x = np.arange(4 << 20, dtype=np.float32)        # 16 MiB: more than the buffers
    y = np.arange(4 << 20, 0, -1, dtype=np.float32)
    want = [x.copy(), y.copy()]
    a.send(Command.DATA, 1, arrays=[x])
    # a wait or a few (the kernel may say "room" for a little more), each within the
    # patience, all before anything was queued
    first = len(waits)
    assert first and all(t <= 0.05 for t in waits), waits
    assert a.queued_bytes() > 0
    x[:] = -1
    a.send(Command.DATA, 2, arrays=[y])
    a.send(Command.ACK, 3)
    assert len(waits) == first, waits                # output waits: copies at once
    y[:] = -1
    got = _read_all(b, 3, writer=a)
    assert [m.ts for m, _ in got] == [1, 2, 3]
    np.testing.assert_array_equal(got[0][1][0], want[0])
    np.testing.assert_array_equal(got[1][1][0], want[1])
    assert a.flush() and a.queued_bytes() == 0
    a.send(Command.DATA, 4, arrays=[np.ones(4 << 20, np.float32)])
    assert len(waits) > first and all(t <= 0.05 for t in waits), waits  # may again


def test_a_queued_send_to_a_stranger_never_waits(conns: Pair) -> None:
    # patience 0 (a connection not admitted): what the kernel does not take is copied
    a, b = conns
    a.queued = True
    waits = _count_waits(a)
    a.send(Command.DATA, 1, arrays=[np.ones(4 << 20, np.float32)])
    assert waits == [] and a.queued_bytes() > 0


class _Quiet:
    """A handler that admits nobody and ignores everything."""

    def admit(self, conn: object, meta: Meta) -> None:
        return None

    def handle(self, conn: object, peer: object, meta: Meta, arrays: list) -> None:
        pass

    def tick(self) -> None:
        pass

    def dropped(self, conn: object) -> None:
        pass


@contextlib.contextmanager
def _dialled_loop() -> Iterator[tuple[ServeLoop, StreamConn]]:
    """A server's ServeLoop on a TCP listener, and the one connection it accepted from a
    client that dialled it (not admitted yet); all closed after."""
    lis = StreamListener(host="127.0.0.1")
    loop = ServeLoop("server", _Quiet(), Verifier("server", "job", lambda r, k: b"k"), 5.0,
                     listeners=[lis])
    client = socket.create_connection(lis.sock.getsockname()[:2], 5)
    try:
        end = time.monotonic() + 10
        while not loop._conns and time.monotonic() < end:
            select.select([lis.sock], [], [], 0.1)
            loop._accept(lis.pollable(), lis)
        (conn,) = loop._conns.values()
        assert isinstance(conn, StreamConn)
        yield loop, conn
    finally:
        client.close()
        loop.close()


def test_a_loop_lets_a_reply_wait_for_room_only_for_an_admitted_peer() -> None:
    with _dialled_loop() as (loop, conn):
        assert conn.queued and conn.patience == 0        # a stranger's replies never wait
        loop.admit_now(conn, "worker 0")
        assert conn.patience == SEND_PATIENCE > 0


def test_a_reply_to_a_peer_already_dropped_is_let_go_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    # a round closes after one of its workers died: the reply to that worker's pull goes
    # to a connection the loop dropped (closed) when the worker's link broke; it is let go
    # without a WARNING ("dropping a worker: ... Bad file descriptor" after every death)
    with _dialled_loop() as (loop, conn):
        loop.admit_now(conn, "worker 0")
        loop.drop(conn)
        with caplog.at_level("INFO", logger="pskv._ps.serve"):
            loop.send(conn, Command.ACK, 7)
        assert [r for r in caplog.records if r.levelname == "WARNING"] == []
        assert not loop._conns and conn not in loop.admitted
