"""ZeroMQ plumbing: contexts, sockets with linger 0, bounded receives.

Invariant: every socket made here has ``LINGER=0`` so closing never blocks, and every
receive has a timeout.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

import zmq

from .message import Command, Meta, decode, encode

__all__ = ["ZmqVan", "ipc_path"]


def ipc_path(tag: str) -> str:
    """A fresh ipc:// endpoint path in the temp directory."""
    fd, path = tempfile.mkstemp(prefix=f"pskv-{tag}-", suffix=".sock")
    os.close(fd)
    os.unlink(path)
    return path


class ZmqVan:
    """Owns one ZeroMQ context and the sockets made from it."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self._sockets: list[zmq.Socket[Any]] = []

    def socket(self, kind: int, *, identity: bytes | None = None) -> zmq.Socket[Any]:
        """A new socket with linger 0 (and ``identity`` for DEALERs)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        self._sockets.append(sock)
        return sock

    @staticmethod
    def send(sock: zmq.Socket[Any], cmd: Command, ts: int = 0, keys: Sequence[int] = (),
             body: Any = None, arrays: Sequence[Any] = (), to: bytes | None = None,
             copy: bool = False, track: bool = False) -> Any:
        """Send one message (to ``to`` on a ROUTER); with ``track``, return its tracker."""
        frames = encode(cmd, ts, keys, body, arrays)
        if to is not None:
            frames.insert(0, to)
        return sock.send_multipart(frames, copy=copy, track=track)

    @staticmethod
    def recv(sock: zmq.Socket[Any], router: bool = False) -> tuple[bytes | None, list[Any]]:
        """Receive one message without blocking the caller past what poll said."""
        frames = sock.recv_multipart(copy=False)
        if router:
            return frames[0].bytes, frames[1:]
        return None, frames

    @staticmethod
    def parse(frames: Sequence[Any]) -> tuple[Meta, list[Any]]:
        """Decode frames (raises ProtocolError)."""
        return decode(frames)

    def close(self) -> None:
        """Close every socket and the context; never blocks."""
        for sock in self._sockets:
            try:
                sock.close(linger=0)
            except zmq.ZMQError:  # pragma: no cover - already closed
                pass
        self._sockets.clear()
        self.ctx.term()
