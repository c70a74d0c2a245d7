"""The transport seam: what a connection between a worker and a server must do.

Two implementations carry pskv messages (:mod:`.message` frames): :class:`.stream.StreamConn`
(a Unix socket within a host, TCP between hosts; the default) and :class:`.zeromq.ZmqConn`
(ZeroMQ, with ``PSKV_TRANSPORT=zmq``). Above this seam nothing knows which one it has:
``send`` returns when the arrays may be changed again, and ``receive`` never waits.
Admission is the same for both: a peer may send at most :data:`ADMISSION_BYTES` in one
message until its HELLO proves it holds the cluster secret.
"""
from __future__ import annotations

import ssl
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from .config import ClusterConfig
from .limits import ADMISSION_BYTES
from .message import Command, Meta
from .stream import Alloc, StreamConn
from .zeromq import ZmqConn, ZmqContext

__all__ = ["ADMISSION_BYTES", "Alloc", "Connection", "connect"]


class Connection(Protocol):
    """One worker's connection to one server (or a server's to one worker)."""

    #: a name for error messages ("server 1", "a worker (fd 7)")
    peer: str
    #: bytes one incoming message may carry (None: no limit beyond the header's)
    max_bytes: int | None

    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message; when it returns the caller may change ``arrays``."""

    def receive(self, alloc_for: Callable[[Meta], Alloc | None] | None = None,
                limit: int = 64) -> list[tuple[Meta, list[np.ndarray]]]:
        """The messages that have arrived (at most ``limit``), without waiting.

        Arrays land where ``alloc_for(meta)`` says when the transport can read into place.
        Raises ProtocolError for a malformed message, NodeFailedError for a broken link.
        """

    def pollable(self) -> Any:
        """What ``zmq.Poller`` polls for incoming messages (a socket or a descriptor)."""

    def stalled(self, now: float) -> bool:
        """Whether a message has been half-received for longer than the timeout."""

    def close(self) -> None:
        """Close the connection (idempotent)."""


def connect(cfg: ClusterConfig, endpoints: Mapping[str, str], same_host: bool, peer: str,
            zmq_context: ZmqContext, tls: ssl.SSLContext | None = None) -> Connection:
    """Connect to a server announcing ``endpoints``, over the transport ``cfg`` asks for.

    Endpoints: ``uds`` (a Unix socket path), ``tcp`` (``tcp:host:port``, stream framing),
    ``zmq`` (a ZeroMQ ``tcp://`` address). ``auto`` takes the Unix socket on the same
    host and TCP otherwise. ``tls``: the context TCP links are wrapped in (:mod:`.tls`).
    """
    transport = cfg.transport
    if "uds" in endpoints and (transport == "ipc" or (transport == "auto" and same_host)):
        return StreamConn.connect(endpoints["uds"], cfg.request_timeout, peer)
    if "tcp" in endpoints and transport != "zmq":
        return StreamConn.connect(endpoints["tcp"], cfg.request_timeout, peer, tls)
    return ZmqConn(zmq_context, endpoints["zmq"], cfg.request_timeout, peer)
