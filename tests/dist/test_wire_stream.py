"""Stream framing carries both header forms (binary for the hot path, JSON for control)."""
from __future__ import annotations

import socket

import numpy as np

from pskv._ps.message import Command, Meta
from pskv._ps.stream import StreamConn


def test_stream_carries_binary_and_json_headers() -> None:
    s1, s2 = socket.socketpair()
    a, b = StreamConn(s1, 5.0, "a"), StreamConn(s2, 5.0, "b")
    try:
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
    finally:
        a.close()
        b.close()
