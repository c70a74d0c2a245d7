"""The transport seam: what a connection between a worker and a server must do.

Two implementations carry pskv messages (:mod:`.message` frames): :class:`.stream.StreamConn`
(a Unix socket within a host, TCP between hosts; the default) and :class:`.zeromq.ZmqConn`
(ZeroMQ, with ``PSKV_TRANSPORT=zmq``). Above this seam nothing knows which one it has:
``send`` returns when the arrays may be changed again, and ``receive`` never waits.
Admission is the same for both: a peer may send at most :data:`ADMISSION_BYTES` in one
message until its HELLO proves it holds the cluster secret.
"""
from __future__ import annotations

import logging
import ssl
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..errors import ConfigError, NodeFailedError
from .config import ClusterConfig
from .crypt import curve_keys
from .limits import ADMISSION_BYTES
from .message import Command, Meta
from .sealed import SealedConn
from .stream import Alloc, StreamConn
from .zeromq import ZmqConn, ZmqContext

log = logging.getLogger(__name__)

__all__ = ["ADMISSION_BYTES", "Alloc", "Connection", "connect", "data_curve"]


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
            zmq_context: ZmqContext, tls: ssl.SSLContext | None = None,
            seal: tuple[bytes, str, int] | None = None) -> Connection:
    """Connect to a server announcing ``endpoints``, over the transport ``cfg`` asks for.

    Endpoints: ``uds`` (a Unix socket path), ``tcp`` (``tcp:host:port``, stream framing),
    ``zmq`` (a ZeroMQ ``tcp://`` address). ``auto`` takes the Unix socket on the same
    host (``same_host``: :func:`.hostid.same_host`) and TCP otherwise, and TCP too when
    that Unix socket refuses (a namespace the host identity could not tell apart).
    ``tls``: the context TCP links are wrapped in (:mod:`.tls`).
    With ``cfg.encrypt``, ``seal`` = (the key this node shares with that server, this
    node's role, its rank): stream links are sealed with it (:mod:`.sealed`), ZeroMQ
    links run CURVE with the data port's key derived from the secret (:mod:`.crypt`).
    """
    transport = cfg.transport
    path, use_tls = None, None
    if "uds" in endpoints and (transport == "ipc" or (transport == "auto" and same_host)):
        path = endpoints["uds"]
    elif "tcp" in endpoints and transport != "zmq":
        path, use_tls = endpoints["tcp"], tls
    if path is not None:
        if cfg.encrypt and seal is None:
            raise ConfigError(f"PSKV_ENCRYPT=1, and no key for the link to {peer}")
        kind = SealedConn if cfg.encrypt else StreamConn
        try:
            conn = kind.connect(path, cfg.request_timeout, peer, use_tls)
        except NodeFailedError as err:
            if transport != "auto" or use_tls is not None or path.startswith("tcp:") \
                    or "tcp" not in endpoints:
                raise
            log.debug("%s; trying its TCP endpoint", err)
            conn = kind.connect(endpoints["tcp"], cfg.request_timeout, peer, tls)
        if isinstance(conn, SealedConn):
            assert seal is not None
            conn.initiate(*seal)
        return conn
    return ZmqConn(zmq_context, endpoints["zmq"], cfg.request_timeout, peer,
                   data_curve(cfg)[0] if cfg.encrypt and cfg.transport == "zmq" else None)


def data_curve(cfg: ClusterConfig) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of every server's ZeroMQ data port, from the secret."""
    assert cfg.secret is not None
    return curve_keys(cfg.secret, "data")
