"""A Unix-socket connect that is refused on "the same host" falls back to TCP (issue #29,
item 5: a namespace the host identity could not tell apart)."""
from __future__ import annotations

import os
import socket
import sys

import pytest

from pskv._ps.config import ClusterConfig, Role
from pskv._ps.hostid import host_id
from pskv._ps.stream import StreamConn
from pskv._ps.transport import connect
from pskv._ps.zeromq import ZmqContext


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")
def test_a_refused_unix_socket_on_the_same_host_falls_back_to_tcp():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        ends = {"uds": f"@pskv-server-nobody-{os.getpid()}", "tcp": f"tcp:127.0.0.1:{port}",
                "host": host_id()}
        zctx = ZmqContext()
        try:
            conn = connect(ClusterConfig(role=Role.WORKER), ends, True, "server 0", zctx)
            try:
                assert isinstance(conn, StreamConn)
                assert conn.sock.family == socket.AF_INET
            finally:
                conn.close()
        finally:
            zctx.close()
