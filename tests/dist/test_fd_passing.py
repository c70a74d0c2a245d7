"""Shared memory reaches another process one way: its descriptor passed along a message
on a plain Unix-socket link (SCM_RIGHTS; ``StreamConn.keep_fds``), never through
``/proc/<pid>/fd``. A backup's ring (``_ps/ring.py``) as the example; the collective's
segments take the same path (tests/dist/test_collective_shm.py)."""
from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

from pskv._ps import ring as ringmod
from pskv._ps.message import Command
from pskv._ps.ring import ALIGN, RingReader, RingWriter
from pskv._ps.shm import MAX_PENDING
from pskv._ps.stream import StreamConn
from pskv.errors import ProtocolError

pytestmark = pytest.mark.skipif(not ringmod.supported(), reason="no sealed memfds here")


def _none(i: int, dtype: Any, shape: Any) -> None:
    return None


def _linked() -> tuple[StreamConn, StreamConn]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return StreamConn(a, 5.0, "primary"), StreamConn(b, 5.0, "backup")


def _receive(conn: StreamConn) -> Any:
    for _ in range(100):
        got = conn.receive(None, 1)
        if got:
            return got[0]
    raise AssertionError("nothing arrived")


def test_the_ring_reaches_the_backup_with_its_message_over_the_unix_socket() -> None:
    """No /proc: the descriptor is passed with ``r_ring`` (SCM_RIGHTS) and the backup
    maps the very memory the primary writes."""
    w = RingWriter(1024)
    primary, backup = _linked()
    try:
        assert backup.keep_fds() is not None
        primary.send(Command.COMMAND, 1, (), {"op": "r_ring", "bytes": 1024}, fds=[w.fd])
        meta, _ = _receive(backup)
        assert meta.body["bytes"] == 1024
        assert backup.fds is not None
        r = RingReader.open(backup.fds.take(), meta.body["bytes"], "server 0")
        a = np.arange(7, dtype=np.float32)
        np.testing.assert_array_equal(r.read(w.place([a]), _none, 1 << 20)[0], a)
        assert int(w._consumed[0]) == ALIGN     # what the reader published, the writer sees
        r.close()
    finally:
        primary.close()
        backup.close()
        w.close()


def test_a_link_that_keeps_no_descriptors_gets_none_and_a_peer_may_not_flood_it() -> None:
    """Descriptors a peer passes to a link that does not keep them are dropped by the
    kernel; a link that keeps them holds at most shm.MAX_PENDING, and says so."""
    w = RingWriter(1024)
    primary, backup = _linked()
    try:
        primary.send(Command.COMMAND, 1, (), {"op": "r_ring", "bytes": 1024}, fds=[w.fd])
        _receive(backup)
        assert backup.fds is None
        tcp = StreamConn(socket.socket(socket.AF_INET, socket.SOCK_STREAM), 1.0, "x")
        with pytest.raises(ValueError, match="plain Unix-socket"):
            tcp.send(Command.COMMAND, 1, fds=[w.fd])
        tcp.close()
        backup.keep_fds()
        for i in range(MAX_PENDING + 1):
            primary.send(Command.COMMAND, 2 + i, (), {}, fds=[w.fd])
            _receive(backup)
        with pytest.raises(ProtocolError, match="descriptors at once"):
            assert backup.fds is not None
            backup.fds.take()
    finally:
        primary.close()
        backup.close()          # closes what it held
        w.close()
