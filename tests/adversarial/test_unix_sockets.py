"""Unix sockets: abstract on Linux (nothing in the file system for a SIGKILLed server to
leave behind, issue #20), and still only for this user (SO_PEERCRED, the check a 0600
file made)."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from pskv._ps.stream import ABSTRACT, StreamConn, StreamListener, ipc_path

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not ABSTRACT, reason="abstract Unix sockets are Linux's")]


def _accepted(listener: StreamListener, within: float = 5.0) -> list[StreamConn]:
    end = time.monotonic() + within
    got: list[StreamConn] = []
    while time.monotonic() < end and not got:
        got = listener.accept(5.0)
        time.sleep(0.02)
    return got


def test_a_listener_makes_no_file_and_this_user_connects() -> None:
    before = set(os.listdir(tempfile.gettempdir()))
    path = ipc_path("server")
    assert path.startswith("@pskv-server-")
    listener = StreamListener(path=path)
    try:
        assert set(os.listdir(tempfile.gettempdir())) == before
        client = StreamConn.connect(path, 5.0, "the test server")
        conns = _accepted(listener)
        assert len(conns) == 1
        for c in conns + [client]:
            c.close()
    finally:
        listener.close()


def test_another_user_is_refused() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user on this machine")
    path = ipc_path("server")
    listener = StreamListener(path=path)
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); "
            f"s.connect({chr(0) + path[1:]!r}); s.settimeout(10); "
            "sys.exit(0 if s.recv(1) == b'' else 1)")     # closed by the listener: EOF
    # a system python: the test's own may sit where that user cannot read
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    child = subprocess.Popen([python, "-c", code], user=nobody.pw_uid, cwd="/",
                             group=nobody.pw_gid, env={"PATH": os.environ.get("PATH", "")})
    try:
        end = time.monotonic() + 10
        while child.poll() is None and time.monotonic() < end:
            assert listener.accept(5.0) == []      # refused, never handed to the server
            time.sleep(0.02)
        assert child.wait(10) == 0, "the other user's connection was not closed"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        listener.close()
