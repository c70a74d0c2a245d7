"""ZeroMQ plumbing: a context that owns its sockets, message send/receive, and ZmqConn.

The scheduler link (Postoffice, Scheduler) runs on ZeroMQ; the data path to the servers
runs on ZeroMQ only with ``PSKV_TRANSPORT=zmq`` (:class:`ZmqConn`, the ZeroMQ
implementation of :class:`.transport.Connection`). Invariant: every socket made here has
``LINGER=0`` so closing never blocks, and every receive follows a poll (nothing blocks).
A ROUTER's sends never wait either: a peer whose pipe is full (it does not read) fails the
send (:class:`ZmqPeer`), and its owner drops it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import zmq

from ..errors import ClusterTimeoutError, NodeFailedError
from .message import Command, Meta, decode, encode

__all__ = ["ZmqConn", "ZmqContext", "ZmqPeer", "curve_client", "curve_server", "recv_capped",
           "recv_message", "send_message"]


class ZmqContext:
    """Owns one ZeroMQ context and the sockets made from it (one per node: no globals).

    ``shared``: a context the caller owns (an in-process cluster's nodes share one, which
    ``inproc://`` endpoints need); then :meth:`close` closes only this node's sockets.
    """

    def __init__(self, shared: zmq.Context[Any] | None = None) -> None:
        self._owned = shared is None
        self.ctx: zmq.Context[Any] = zmq.Context() if shared is None else shared
        self._sockets: list[zmq.Socket[Any]] = []

    def socket(self, kind: int, *, identity: bytes | None = None) -> zmq.Socket[Any]:
        """A new socket with linger 0 (and ``identity`` for DEALERs)."""
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        self._sockets.append(sock)
        return sock

    def close(self) -> None:
        """Close every socket and the context; never blocks."""
        for sock in self._sockets:
            try:
                sock.close(linger=0)
            except zmq.ZMQError:  # pragma: no cover - already closed
                pass
        self._sockets.clear()
        if self._owned:
            self.ctx.term()


def curve_client(sock: zmq.Socket[Any], server_public: bytes) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_public``
    (a fresh key pair of its own: the server is what must be known)."""
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def curve_server(sock: zmq.Socket[Any], server_secret: bytes) -> None:
    """Make ``sock`` a CURVE server with the secret key ``server_secret`` (before bind)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)


def send_message(sock: zmq.Socket[Any], cmd: Command, ts: int = 0, keys: Sequence[int] = (),
                 body: Any = None, arrays: Sequence[Any] = (), to: bytes | None = None,
                 copy: bool = True, track: bool = False, flags: int = 0) -> Any:
    """Send one message (to ``to`` on a ROUTER); with ``track``, return its tracker.
    ``flags``: ``zmq.NOBLOCK`` to fail (``zmq.Again``) instead of waiting for room."""
    frames = encode(cmd, ts, keys, body, arrays)
    if to is not None:
        frames.insert(0, to)
    return sock.send_multipart(frames, flags, copy=copy, track=track)


def recv_message(sock: zmq.Socket[Any], router: bool = False) -> tuple[bytes | None, list[Any]]:
    """Receive one message's frames (after a poll said one is there); (identity, frames)."""
    frames = sock.recv_multipart(copy=False)
    if router:
        return frames[0].bytes, frames[1:]
    return None, frames


def recv_capped(sock: zmq.Socket[Any], cap: Callable[[bytes], tuple[int | None, int]]) \
        -> tuple[bytes, list[Any], int, str | None]:
    """Receive one message of a ROUTER frame by frame: (identity, frames, bytes counted,
    why refused).

    ``cap(identity)`` says the most bytes (None: any) and frames that peer's message may
    have; once it is over either, the rest of its frames are received and let go at once
    (never kept nor listed), the frames are ``[]`` and ``why`` says what was over.
    libzmq hands a message over only once all of it has arrived (its frame cap,
    ``ZMQ_MAXMSGSIZE``, is the only bound before that): this bounds what pskv keeps of it.
    """
    ident = sock.recv(copy=False).bytes
    max_bytes, max_frames = cap(ident)
    frames: list[Any] = []
    size = count = 0
    why = None
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv(copy=False)
        count += 1
        if why is not None:
            continue
        size += len(part)
        if count > max_frames:
            why = f"a message of over {max_frames} parts"
        elif max_bytes is not None and size > max_bytes:
            why = f"a message of over the {max_bytes} bytes this peer may send"
        if why is not None:
            frames = []
        else:
            frames.append(part)
    return ident, frames, size, why


class ZmqConn:
    """A DEALER socket to one server: the ZeroMQ :class:`.transport.Connection`.

    ``send`` hands small arrays to ZeroMQ as copies and big ones without a copy (except
    over inproc), then waits (at most ``timeout``) until ZeroMQ is done with them: when it
    returns, the caller may change its arrays, as with a stream connection.
    """

    max_bytes: int | None = None

    def __init__(self, zctx: ZmqContext, endpoint: str, timeout: float, peer: str,
                 curve_server: bytes | None = None) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if curve_server is not None:
            curve_client(self.sock, curve_server)
        self.sock.connect(endpoint)
        self.timeout = timeout
        self.peer = peer
        # inproc hands the message itself to the receiving thread, which may keep its
        # frames as arrays (a dist_async push is applied without a copy): a send without a
        # copy would then wait for as long as the server keeps them, so inproc copies
        self._zero_copy = not endpoint.startswith("inproc://")

    def pollable(self) -> Any:
        """What a zmq.Poller polls for replies."""
        return self.sock

    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message; the arrays are free again when this returns."""
        big = self._zero_copy and any(a.nbytes >= zmq.COPY_THRESHOLD for a in arrays)
        try:
            tracker = send_message(self.sock, cmd, ts, keys, body, arrays, copy=not big,
                                   track=big)
            if big:
                tracker.wait(self.timeout)
        except zmq.NotDone:
            raise ClusterTimeoutError(
                f"sending to {self.peer} waited over {self.timeout:g} s: it is not reading. "
                "Raise PSKV_REQUEST_TIMEOUT if it is just slow.") from None
        except zmq.ZMQError as err:
            raise NodeFailedError(f"cannot send to {self.peer}: {err}") from err

    def receive(self, alloc_for: Any = None, limit: int = 64) -> list[tuple[Meta, list[Any]]]:
        """The messages that have arrived, without waiting (``alloc_for`` is ignored: the
        arrays are read-only views of ZeroMQ's frames). Raises ProtocolError."""
        done: list[tuple[Meta, list[Any]]] = []
        while len(done) < limit and self.sock.poll(0):
            _, frames = recv_message(self.sock)
            done.append(decode(frames))
        return done

    def stalled(self, now: float) -> bool:
        """Never: ZeroMQ delivers whole messages."""
        return False

    def close(self) -> None:
        """Nothing to do: the ZmqContext closes its sockets."""


class ZmqPeer:
    """One peer of a ROUTER socket, as a :class:`.transport.Connection` that sends."""

    max_bytes: int | None = None
    #: bytes received from it so far (a stranger's budget is counted in them)
    received = 0

    def __init__(self, router: zmq.Socket[Any], ident: bytes) -> None:
        self.router = router
        self.ident = ident
        self.peer = f"a ZeroMQ peer ({ident.hex()[:12]})"
        #: where it connected from, for refusal logs ("" when unknown)
        self.address = ""

    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message (copied: stored values may change before ZeroMQ sends it).

        Never waits: a peer whose pipe is full (it does not read) fails the send with
        NodeFailedError, as one that is gone does (ROUTER_MANDATORY says so)."""
        try:
            send_message(self.router, cmd, ts, keys, body, arrays, to=self.ident, copy=True,
                         flags=zmq.NOBLOCK)
        except zmq.Again:
            raise NodeFailedError(f"cannot send to {self.peer}: it does not read what it "
                                  "was sent (its queue is full)") from None
        except zmq.ZMQError as err:
            raise NodeFailedError(f"cannot send to {self.peer}: {err}") from err

    def receive(self, alloc_for: Any = None, limit: int = 64) -> list[tuple[Meta, list[Any]]]:
        """Nothing: the ServeLoop reads the ROUTER socket for all of its peers."""
        return []

    def pollable(self) -> Any:
        """The shared ROUTER socket."""
        return self.router

    def stalled(self, now: float) -> bool:
        """Never: ZeroMQ delivers whole messages."""
        return False

    def close(self) -> None:
        """Nothing to close: the peer shares the ROUTER socket."""
