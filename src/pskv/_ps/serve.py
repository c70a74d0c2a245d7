"""ServeLoop: the one loop of every node that answers requests (servers and the scheduler).

Listeners (a ZeroMQ ROUTER socket, stream listeners), admission, framing limits and
dispatch to a handler live here, once; what a node does with an admitted peer's request is
its handler's business (:class:`Handler`). Invariants: a peer is admitted only by a HELLO
whose proof of the cluster secret checks; until then it may send at most
:data:`.transport.ADMISSION_BYTES` per message, on every transport; a malformed message or
a handler's exception is answered with an ERROR and never stops the loop; a stream peer
that stalls half-way through a message is dropped after its timeout.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import numpy as np
import zmq

from ..errors import ClusterError, KVStoreError, NodeFailedError, ProtocolError
from .auth import Verifier
from .message import Command, Meta, decode, error_body
from .stream import StreamConn, StreamListener
from .transport import ADMISSION_BYTES, Connection
from .zeromq import ZmqPeer, recv_message

__all__ = ["Handler", "ServeLoop"]

log = logging.getLogger(__name__)


class Handler(Protocol):
    """What a node plugs into a ServeLoop."""

    def admit(self, conn: Connection, meta: Meta) -> Any:
        """A peer's HELLO checked out: return what identifies it (e.g. its rank), reply if
        the node replies to a HELLO, or raise a KVStoreError to refuse it."""

    def handle(self, conn: Connection, peer: Any, meta: Meta,
               arrays: list[np.ndarray]) -> None:
        """One request of an admitted peer; raise a KVStoreError to answer with an ERROR."""

    def tick(self) -> None:
        """Called about every ``tick`` seconds: timers, timeouts."""

    def dropped(self, conn: Connection) -> None:
        """``conn`` is gone (it closed, broke or stalled)."""


class ServeLoop:
    """Poll the listeners and connections; admit, frame-check and dispatch messages.

    Parameters
    ----------
    name : str
        For log and error messages ("server 1", "the scheduler").
    handler : Handler
    verifier : Verifier
        Checks the proof in each HELLO.
    timeout : float
        Seconds a stream write may wait, and a half-read message may wait for the rest.
    router : zmq.Socket, optional
        A bound ROUTER socket whose peers talk ZeroMQ.
    listeners : list of StreamListener
        Bound stream listeners (Unix socket, TCP).
    refusal : callable
        ``refusal(why)``: the error a refused HELLO is answered with.
    """

    def __init__(self, name: str, handler: Handler, verifier: Verifier, timeout: float,
                 router: zmq.Socket[Any] | None = None,
                 listeners: list[StreamListener] | None = None,
                 refusal: Callable[[str], KVStoreError] = ProtocolError) -> None:
        self.name = name
        self.handler = handler
        self._verifier = verifier
        self._timeout = timeout
        self._router = router
        self._listeners = {lis.pollable(): lis for lis in listeners or []}
        self._refusal = refusal
        self._conns: dict[int, StreamConn] = {}
        self._peers: dict[bytes, ZmqPeer] = {}
        self.admitted: dict[Any, Any] = {}
        self._poller = zmq.Poller()

    # ---- replies ---------------------------------------------------------------------
    def send(self, conn: Connection, cmd: Command, ts: int, body: Any = None,
             arrays: list[np.ndarray] | tuple[()] = ()) -> None:
        """Send to ``conn``; a peer that cannot be reached is dropped, never raised."""
        try:
            conn.send(cmd, ts, body=body, arrays=arrays)
        except KVStoreError as err:
            log.warning("%s: dropping %s: %s", self.name, conn.peer, err)
            self.drop(conn)

    def error(self, conn: Connection, ts: int, err: BaseException) -> None:
        """Answer ``ts`` with an ERROR carrying ``err``'s kind and message."""
        self.send(conn, Command.ERROR, ts, error_body(err))

    def drop(self, conn: Connection) -> None:
        """Forget ``conn`` (and close it, for a stream connection)."""
        if isinstance(conn, StreamConn):
            fd = conn.fileno()
            if self._conns.pop(fd, None) is not None:
                self._poller.unregister(fd)
        elif isinstance(conn, ZmqPeer):
            self._peers.pop(conn.ident, None)
        if self.admitted.pop(conn, None) is not None:
            self.handler.dropped(conn)
        conn.close()

    # ---- dispatch ----------------------------------------------------------------------
    def dispatch(self, conn: Connection, meta: Meta, arrays: list[np.ndarray]) -> None:
        """Admit a HELLO, or hand an admitted peer's message to the handler."""
        if meta.cmd == Command.HELLO:
            why = self._verifier.check(meta.body)
            if why is not None:
                log.warning("%s: refused a connection (%s)", self.name, why)
                self.error(conn, meta.ts, self._refusal(f"{self.name} refused this node: {why}"))
                return
            try:
                who = self.handler.admit(conn, meta)
            except KVStoreError as err:
                log.warning("%s: refused a node (%s)", self.name, err)
                self.error(conn, meta.ts, err)
                return
            if who is not None:
                self.admitted[conn] = who
                conn.max_bytes = None
            return
        peer = self.admitted.get(conn)
        if peer is None:
            log.warning("%s: refused %s from a node that did not say HELLO", self.name,
                        meta.cmd.name)
            self.error(conn, meta.ts, self._refusal(
                "this node was never admitted: send HELLO first"))
            return
        try:
            self.handler.handle(conn, peer, meta, arrays)
        except KVStoreError as err:
            self.error(conn, meta.ts, err)
        except Exception as err:  # a node never dies of a request; the peer hears why
            log.exception("%s: %s failed", self.name, meta.cmd.name)
            self.error(conn, meta.ts, ClusterError(f"{type(err).__name__}: {err}"))

    def _read_router(self) -> None:
        assert self._router is not None
        for _ in range(1000):            # whatever has arrived, a bounded batch
            if not int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            ident, frames = recv_message(self._router, router=True)
            assert ident is not None
            peer = self._peers.get(ident)
            if peer is None:
                peer = self._peers[ident] = ZmqPeer(self._router, ident)
                peer.max_bytes = ADMISSION_BYTES     # until it proves it holds the secret
            try:
                if peer.max_bytes is not None and \
                        sum(f.buffer.nbytes for f in frames) > peer.max_bytes:
                    raise ProtocolError(f"{peer.peer} sent a message of over "
                                        f"{peer.max_bytes} bytes before it was admitted")
                meta, arrays = decode(frames)
            except ProtocolError as err:
                log.warning("%s: malformed message: %s", self.name, err)
                self.error(peer, 0, ProtocolError(f"malformed message: {err}"))
                continue
            self.dispatch(peer, meta, arrays)

    def _accept(self, listener: StreamListener) -> None:
        for conn in listener.accept(self._timeout):
            conn.max_bytes = ADMISSION_BYTES     # until it proves it holds the secret
            self._conns[conn.fileno()] = conn
            self._poller.register(conn.fileno(), zmq.POLLIN)

    def _read_conn(self, conn: StreamConn) -> None:
        for _ in range(64):             # whatever has arrived, a bounded batch
            try:
                # one message at a time: the next one may reuse this one's buffers
                got = conn.receive(None, 1)
            except ProtocolError as err:
                log.warning("%s: %s; closing it", self.name, err)
                self.error(conn, 0, ProtocolError(f"malformed message: {err}"))
                self.drop(conn)
                return
            except (NodeFailedError, KVStoreError):         # the peer went away
                self.drop(conn)
                return
            except Exception:            # a node never dies of what a peer sent
                log.exception("%s: reading from %s failed; dropping it", self.name, conn.peer)
                self.drop(conn)
                return
            if not got:
                return
            self.dispatch(conn, *got[0])
            if conn.fileno() not in self._conns:
                return

    # ---- loop --------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool], poll_ms: int = 100, tick: float = 0.5) -> None:
        """Serve until ``stop()``; call the handler's ``tick`` about every ``tick`` s."""
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        for fd in self._listeners:
            self._poller.register(fd, zmq.POLLIN)
        last = time.monotonic()
        while not stop():
            for what, _ in self._poller.poll(poll_ms):
                if what is self._router:
                    self._read_router()
                elif isinstance(what, int) and what in self._listeners:
                    self._accept(self._listeners[what])
                elif isinstance(what, int) and what in self._conns:
                    self._read_conn(self._conns[what])
            now = time.monotonic()
            if now - last >= tick:
                last = now
                for conn in [c for c in self._conns.values() if c.stalled(now)]:
                    log.warning("%s: %s sent part of a message, then nothing for %g s; "
                                "dropping it", self.name, conn.peer, conn.timeout)
                    self.drop(conn)
                self.handler.tick()

    def close(self) -> None:
        """Close every stream connection and listener (the ROUTER's owner closes it)."""
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        for lis in self._listeners.values():
            lis.close()
