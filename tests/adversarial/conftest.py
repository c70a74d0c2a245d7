"""Attacks on a node: every test here is marked ``adversarial`` and ``dist``.

The clusters are those of tests/dist (``thread_cluster``, ``local_cluster``: the same
fixtures, loaded from tests/dist/conftest.py), on 127.0.0.1 only, every process in its own
process group and killed at teardown. The helpers speak the wire format, or mangle it, the
way an attacker would: a raw ZeroMQ DEALER (:class:`Stranger`) and raw stream sockets
(:func:`stream_exchange`).
"""
from __future__ import annotations

import importlib.util
import json
import select
import time
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import zmq

from pskv._ps.auth import prove
from pskv._ps.message import Command, encode

_spec = importlib.util.spec_from_file_location(
    "pskv_tests_dist_conftest", Path(__file__).resolve().parents[1] / "dist" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_dist = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _dist          # dataclasses look their module up there
_spec.loader.exec_module(_dist)

thread_cluster = _dist.thread_cluster
local_cluster = _dist.local_cluster
run_threads_fixture = _dist.run_threads_fixture
ThreadCluster = _dist.ThreadCluster
FAST_ENV = _dist.FAST_ENV
PY = _dist.PY


class Stranger:
    """A raw DEALER socket that speaks (or mangles) the wire format."""

    def __init__(self, address: str, **options: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.connect(address)

    def ask(self, frames: list[Any], timeout: float = 5.0) -> dict[str, Any] | None:
        """Send frames; the reply's JSON header (``b`` the body), None if none came."""
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout * 1000)):
            return None
        header: dict[str, Any] = json.loads(self.sock.recv_multipart()[0])
        return header

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def hello_body(role: str = "worker", **extra: Any) -> dict[str, Any]:
    return {"role": role, "host": "x", "pid": 1, **extra}


def admitted_body(stranger: Stranger, key: bytes, purpose: str = "scheduler",
                  role: str = "worker",
                  rank: int | None = None) -> dict[str, Any]:
    """Get a challenge from ``stranger``'s acceptor; the HELLO body proving it with ``key``."""
    claim = {} if rank is None else {"rank": rank}
    challenge = stranger.ask(encode(Command.HELLO, 1, body=hello_body(role, **claim)))
    assert challenge is not None and challenge["c"] == Command.CHALLENGE, challenge
    return hello_body(role, **claim, **prove(key, purpose, challenge["b"], role, rank))


def frame(header: bytes, payload: bytes = b"") -> bytes:
    """One message in the stream framing: magic, header length, header, array bytes."""
    return b"PSKV" + struct.pack("<I", len(header)) + header + payload


def connect_stream(endpoint: str, timeout: float = 5.0) -> socket.socket:
    """A raw socket to a server's stream endpoint (``tcp:host:port``, a Unix path, or an
    abstract Unix name ``@name``)."""
    if endpoint.startswith("tcp:"):
        host, _, port = endpoint[4:].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect("\0" + endpoint[1:] if endpoint.startswith("@") else endpoint)
    return sock


def stream_exchange(endpoint: str, data: bytes, timeout: float = 3.0) -> bytes:
    """Send ``data`` on a fresh connection; what came back until it closed (``<open>``:
    still open at the timeout, ``<reset>``: reset)."""
    with connect_stream(endpoint, timeout) as sock:
        got = b""
        try:
            sock.sendall(data)
            while True:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    return got + b"<open>"
                if not chunk:
                    return got
                got += chunk
        except (ConnectionResetError, BrokenPipeError):
            return got + b"<reset>"


def next_reply(conn: Any, timeout: float = 5.0) -> Any:
    """The next message's header on a pskv stream connection (``StreamConn``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        select.select([conn.sock], [], [], 0.1)
        got = conn.receive(None, 1)
        if got:
            return got[0][0]
    raise AssertionError(f"no reply within {timeout} s")


def assert_unharmed(cluster: Any, res: dict[int, Any], value: Any,
                    timeout: float = 15.0) -> None:
    """After an attack: every worker pulled ``value`` (nothing the attacker sent was
    counted), and the scheduler and every server exited 0."""
    import numpy as np
    for rank, got in sorted(res.items()):
        assert not isinstance(got, BaseException), (rank, got)
        np.testing.assert_array_equal(got, value)
    codes = cluster.join(timeout)
    assert all(c == 0 for c in codes.values()), codes


def push_and_pull(kv: Any, key: int = 1, shape: tuple[int, ...] = (3,)) -> Any:
    """A worker's closing round after an attack: push ones to ``key``, pull the sum."""
    import pskv as mx
    kv.push(key, mx.nd.ones(shape))
    return kv.pull(key).asnumpy()
