"""ServeLoop: the one loop of every node that answers requests (servers and the scheduler).

Listeners (a ZeroMQ ROUTER socket, stream listeners), admission, framing limits and
dispatch to a handler live here, once; what a node does with an admitted peer's request is
its handler's business (:class:`Handler`). Invariants, on every transport and port:

* a peer is admitted only by a HELLO that answers this node's own challenge
  (:mod:`.auth`); until then it may send at most :data:`.limits.ADMISSION_BYTES` per
  message, at most ``max_unadmitted`` unadmitted connections are kept (more are closed at
  once), and one that is not admitted within ``handshake_timeout`` is closed;
* every message is checked by :func:`.validate.request` before a handler sees it; a
  malformed message or an exception while handling one is answered with an ERROR (or
  logged) and never stops the loop;
* running out of file descriptors refuses new connections for a moment (the oldest
  unadmitted one is closed to make room) and the node goes on;
* refusals are logged once per peer per interval (:class:`.limits.RefusalLog`), never
  with what the peer sent; a stream peer that stalls half-way through a message is dropped
  after its timeout;
* the loop waits on one peer only a bounded moment: stream connections are in queued mode
  (a reply to an admitted peer with nothing queued waits for room at most
  :data:`.stream.SEND_PATIENCE` at a time; what the kernel does not take then, or at once
  for a stranger, waits in that connection's output queue, written when the socket is
  writable, and nothing more is read from that peer until it is), ZeroMQ sends never
  wait (a peer whose pipe is full is dropped), and a peer whose output has not moved for
  its timeout is dropped; so deadlines run even while a peer floods;
* an unadmitted peer gets at most :data:`MAX_CHALLENGES` CHALLENGEs, each replacing the
  last (one is outstanding at a time; one more HELLO without a proof drops it), and may
  send at most :data:`.limits.UNADMITTED_BUDGET` bytes in all; a ZeroMQ
  message is capped in bytes and in frames as its frames are received, and the rest of
  an over-cap message is let go unkept (:func:`.zeromq.recv_capped`); a ZeroMQ peer that
  was dropped for any of these is ignored for ``handshake_timeout``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import numpy as np
import zmq

from ..errors import ClusterError, KVStoreError, NodeFailedError, ProtocolError
from . import validate
from .auth import CHALLENGE, Verifier
from .limits import ADMISSION_BYTES, ADMISSION_FRAMES, UNADMITTED_BUDGET, RefusalLog
from .message import Command, Meta, decode, error_body
from .stream import SEND_PATIENCE, StreamConn, StreamListener
from .transport import Connection
from .zeromq import ZmqPeer, recv_capped

__all__ = ["Handler", "ServeLoop"]

log = logging.getLogger(__name__)
#: seconds a listener rests after accept() ran out of file descriptors
ACCEPT_PAUSE = 0.25
#: ZeroMQ identities ignored at once (dropped strangers); the oldest go first
MUTED_MAX = 4096
#: CHALLENGEs one connection gets (each replaces the last); one more HELLO drops it
MAX_CHALLENGES = 4


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
    """Poll the listeners and connections; admit, check and dispatch messages.

    Parameters
    ----------
    name : str
        For log and error messages ("server 1", "the scheduler").
    handler : Handler
    verifier : Verifier
        Challenges each HELLO and checks its proof.
    timeout : float
        Seconds a stream write may wait, and a half-read message may wait for the rest.
    router : zmq.Socket, optional
        A bound ROUTER socket whose peers talk ZeroMQ.
    listeners : list of StreamListener
        Bound stream listeners (Unix socket, TCP).
    refusal : callable
        ``refusal(why)``: the error a refused HELLO is answered with.
    handshake_timeout : float
        Seconds a connection may stay unadmitted.
    max_unadmitted : int
        Unadmitted connections kept at once (per node, all transports together).
    max_message_bytes : int
        The most an admitted peer may send in one message.
    max_frames : int
        The most frames an admitted peer's ZeroMQ message may have.
    """

    def __init__(self, name: str, handler: Handler, verifier: Verifier, timeout: float,
                 router: zmq.Socket[Any] | None = None,
                 listeners: list[StreamListener] | None = None,
                 refusal: Callable[[str], KVStoreError] = ProtocolError,
                 handshake_timeout: float = 10.0, max_unadmitted: int = 64,
                 max_message_bytes: int = 4 << 30, max_frames: int = 1 << 18,
                 keep_fds: bool = False) -> None:
        self.name = name
        #: accepted Unix-socket links keep the descriptors passed to them (a backup's
        #: ring: :meth:`.stream.StreamConn.keep_fds`); at most ``shm.MAX_PENDING`` each
        self._keep_fds = keep_fds
        self.handler = handler
        #: where a message's arrays land (a handler's ``alloc_for(meta)``; else reused buffers)
        self._alloc_for = getattr(handler, "alloc_for", None)
        self._verifier = verifier
        self._timeout = timeout
        self._router = router
        self._listeners = {lis.pollable(): lis for lis in listeners or []}
        self._refusal = refusal
        self._handshake = handshake_timeout
        self._max_unadmitted = max_unadmitted
        self._max_message = max_message_bytes
        self._max_frames = max_frames
        self._muted: dict[bytes, float] = {}             # ZeroMQ identity -> until when
        self._challenged: dict[Connection, int] = {}     # unadmitted: CHALLENGEs sent
        self._writing: set[int] = set()                  # stream fds with output queued
        self._conns: dict[int, StreamConn] = {}
        self._peers: dict[bytes, ZmqPeer] = {}
        self._unadmitted: dict[Connection, float] = {}   # conn -> when it was first seen
        self._paused: dict[int, float] = {}              # listener fd -> resume time
        self._again: set[int] = set()                    # TLS conns with bytes buffered
        self.admitted: dict[Any, Any] = {}
        self.refusals = RefusalLog(log, name)
        self._poller = zmq.Poller()

    # ---- replies ---------------------------------------------------------------------
    def send(self, conn: Connection, cmd: Command, ts: int, body: Any = None,
             arrays: list[np.ndarray] | tuple[()] = ()) -> None:
        """Send to ``conn``; a peer that cannot be reached is dropped, never raised."""
        if isinstance(conn, StreamConn) and conn.fileno() < 0:
            # dropped already (its link broke): a reply that was waiting for a round, such
            # as a dead worker's pull, has nobody to go to
            return
        try:
            conn.send(cmd, ts, body=body, arrays=arrays)
        except KVStoreError as err:
            log.warning("%s: dropping %s: %s", self.name, conn.peer, err)
            self.drop(conn)

    def error(self, conn: Connection, ts: int, err: BaseException) -> None:
        """Answer ``ts`` with an ERROR carrying ``err``'s kind and message."""
        self.send(conn, Command.ERROR, ts, error_body(err))

    def drop(self, conn: Connection, mute: bool = False) -> None:
        """Forget ``conn`` (and close it, for a stream connection). ``mute``: a ZeroMQ
        peer's messages are let go unread for ``handshake_timeout`` (it cannot be closed)."""
        if isinstance(conn, StreamConn):
            fd = conn.fileno()
            self._writing.discard(fd)
            if self._conns.pop(fd, None) is not None:
                self._poller.unregister(fd)
        elif isinstance(conn, ZmqPeer):
            self._peers.pop(conn.ident, None)
            if mute and conn not in self.admitted:
                if len(self._muted) >= MUTED_MAX:
                    now = time.monotonic()
                    self._muted = {i: t for i, t in self._muted.items() if t > now}
                    while len(self._muted) >= MUTED_MAX:
                        del self._muted[next(iter(self._muted))]
                self._muted[conn.ident] = time.monotonic() + self._handshake
        self._unadmitted.pop(conn, None)
        self._challenged.pop(conn, None)
        self._verifier.forget(conn)
        if self.admitted.pop(conn, None) is not None:
            self.handler.dropped(conn)
        conn.close()

    def _queued(self, conn: StreamConn) -> None:
        """``conn``'s output waits in its queue: write it when the socket is writable, and
        read nothing more from that peer meanwhile (it costs at most its replies)."""
        fd = conn.fileno()
        if self._conns.get(fd) is conn and fd not in self._writing:
            self._writing.add(fd)
            self._poller.register(fd, zmq.POLLOUT)    # replaces POLLIN

    def _write_conn(self, conn: StreamConn) -> None:
        try:
            done = conn.flush()
        except KVStoreError:                          # the peer went away
            self.drop(conn)
            return
        if done:
            fd = conn.fileno()
            self._writing.discard(fd)
            self._poller.register(fd, zmq.POLLIN)
            if conn.buffered():                       # messages read before it stalled
                self._again.add(fd)

    def _over_budget(self, conn: Connection) -> bool:
        """An unadmitted peer that sent over its byte budget is refused and dropped."""
        if conn in self.admitted or getattr(conn, "received", 0) <= UNADMITTED_BUDGET:
            return False
        self.refusals.refused(_who(conn), f"over {UNADMITTED_BUDGET} bytes before admission")
        self.drop(conn, mute=True)
        return True

    def _refuse(self, conn: Connection, ts: int, why: str, err: KVStoreError) -> None:
        """Refuse a message of an unadmitted peer: one quiet log line, an ERROR reply."""
        self.refusals.refused(_who(conn), why)
        self.error(conn, ts, err)

    # ---- dispatch ----------------------------------------------------------------------
    def dispatch(self, conn: Connection, meta: Meta, arrays: list[np.ndarray]) -> None:
        """Check a message, then admit a HELLO or hand an admitted peer's message on.

        Nothing a peer sends escapes: every error becomes an ERROR reply or a log line.
        """
        try:
            self._dispatch(conn, meta, arrays)
        except Exception as err:  # a node never dies of a message; the peer hears why
            log.exception("%s: %s from %s failed", self.name, meta.cmd.name, conn.peer)
            self.error(conn, meta.ts, ClusterError(f"{type(err).__name__}: {err}"))

    def _dispatch(self, conn: Connection, meta: Meta, arrays: list[np.ndarray]) -> None:
        peer = self.admitted.get(conn)
        try:
            validate.request(meta, arrays)
        except ProtocolError as err:
            if peer is None:
                self._refuse(conn, meta.ts, f"malformed message: {err}", err)
            else:
                log.debug("%s: malformed %s: %s", self.name, meta.cmd.name, err)
                self.error(conn, meta.ts, err)
            return
        if meta.cmd == Command.HELLO:
            self._hello(conn, meta)
            return
        if peer is None:
            self._refuse(conn, meta.ts, f"{meta.cmd.name} before HELLO", self._refusal(
                "this node was never admitted: send HELLO first"))
            return
        try:
            self.handler.handle(conn, peer, meta, arrays)
        except KVStoreError as err:
            self.error(conn, meta.ts, err)

    def _hello(self, conn: Connection, meta: Meta) -> None:
        if conn in self.admitted:
            self.error(conn, meta.ts, ProtocolError("this connection was admitted already"))
            return
        why = self._verifier.check(conn, meta.body)
        if why == CHALLENGE:
            # a new challenge replaces the last (one is outstanding at a time), and a
            # connection gets a few at most: a stranger's HELLOs cost one reply each
            asked = self._challenged.get(conn, 0)
            if asked >= MAX_CHALLENGES:
                self.refusals.refused(_who(conn), f"over {MAX_CHALLENGES} HELLOs without "
                                      "a proof")
                self.drop(conn, mute=True)
                return
            self._challenged[conn] = asked + 1
            self.send(conn, Command.CHALLENGE, meta.ts, self._verifier.challenge(conn))
            return
        if why is not None:
            self._refuse(conn, meta.ts, why,
                         self._refusal(f"{self.name} refused this node: {why}"))
            return
        try:
            who = self.handler.admit(conn, meta)
        except KVStoreError as err:
            self._refuse(conn, meta.ts, str(err), err)
            return
        if who is not None:
            self.admit_now(conn, who)

    def admit_now(self, conn: Connection, who: Any) -> None:
        """Admit ``conn`` as ``who``: at once from ``Handler.admit``, or later when the
        handler deferred its decision (it returned None and kept the HELLO)."""
        self.admitted[conn] = who
        self._unadmitted.pop(conn, None)
        self._challenged.pop(conn, None)
        conn.max_bytes = self._max_message
        if isinstance(conn, StreamConn):     # a reply may wait a moment for it to read
            conn.patience = SEND_PATIENCE

    def hold(self, conn: Connection) -> None:
        """``conn`` proved itself and waits for its handler's decision (a restart's claim on
        a rank): its admission deadline starts again."""
        if conn in self._unadmitted:
            self._unadmitted[conn] = time.monotonic()

    def _room(self, who: str) -> bool:
        """Whether one more unadmitted connection may be kept (else log the refusal)."""
        if len(self._unadmitted) < self._max_unadmitted:
            return True
        self.refusals.refused(who, f"{self._max_unadmitted} connections already wait for "
                                   "admission (PSKV_MAX_UNADMITTED)")
        return False

    def _cap(self, ident: bytes) -> tuple[int | None, int]:
        """The most bytes and frames the message of the ZeroMQ peer ``ident`` may have."""
        if ident in self._muted:
            if self._muted[ident] > time.monotonic():
                return 0, 0
            del self._muted[ident]
        peer = self._peers.get(ident)
        if peer is not None and peer in self.admitted:
            return peer.max_bytes, self._max_frames
        return ADMISSION_BYTES, ADMISSION_FRAMES

    def _read_router(self) -> None:
        assert self._router is not None
        for _ in range(1000):            # whatever has arrived, a bounded batch
            if not int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            ident, frames, size, over = recv_capped(self._router, self._cap)
            if ident in self._muted:
                continue                 # dropped a moment ago: nothing is answered
            peer = self._peers.get(ident)
            if peer is None:
                if not self._room(_zmq_address(frames)):
                    continue             # no reply: it costs nothing more than the read
                peer = self._peers[ident] = ZmqPeer(self._router, ident)
                peer.address = _zmq_address(frames)
                peer.max_bytes = ADMISSION_BYTES     # until it proves it holds the secret
                self._unadmitted[peer] = time.monotonic()
            peer.received += size
            if self._over_budget(peer):
                continue
            try:
                if over is not None:
                    raise ProtocolError(f"{over} (the rest was let go unread)")
                meta, arrays = decode(frames)
            except ProtocolError as err:
                if peer not in self.admitted:
                    self._refuse(peer, 0, f"malformed message: {err}",
                                 ProtocolError(f"malformed message: {err}"))
                else:
                    log.warning("%s: malformed message: %s", self.name, err)
                    self.error(peer, 0, ProtocolError(f"malformed message: {err}"))
                continue
            self.dispatch(peer, meta, arrays)

    def _accept(self, fd: int, listener: StreamListener) -> None:
        conns = listener.accept(self._timeout)
        for conn in conns:
            if not self._room(conn.peer):
                conn.close()
                continue
            conn.max_bytes = ADMISSION_BYTES     # until it proves it holds the secret
            conn.queued = True                   # its sends never wait (see _queued)
            conn.on_queued = lambda conn=conn: self._queued(conn)
            if self._keep_fds:
                conn.keep_fds()
            self._conns[conn.fileno()] = conn
            self._unadmitted[conn] = time.monotonic()
            self._poller.register(conn.fileno(), zmq.POLLIN)
        if listener.exhausted:
            # out of file descriptors: make room (the oldest stranger goes), rest a moment
            listener.exhausted = False
            self.refusals.refused("accept", "out of file descriptors; new connections wait")
            oldest = [c for c in self._unadmitted if isinstance(c, StreamConn)]
            if oldest:
                self.drop(oldest[0])
            self._poller.unregister(fd)
            self._paused[fd] = time.monotonic() + ACCEPT_PAUSE

    def _read_conn(self, conn: StreamConn) -> None:
        for _ in range(64):             # whatever has arrived, a bounded batch
            try:
                # one message at a time: the next one may reuse this one's buffers
                got = conn.receive(self._alloc_for, 1)
            except ProtocolError as err:
                if conn in self.admitted:
                    log.warning("%s: %s; closing it", self.name, err)
                else:
                    self.refusals.refused(conn.peer, f"malformed message: {err}")
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
            if self._over_budget(conn):
                return
            self.dispatch(conn, *got[0])
            if conn.fileno() not in self._conns or conn.fileno() in self._writing:
                return                   # gone, or not reading what it is sent: wait
        if conn.buffered():              # TLS holds more: poll would not say so
            self._again.add(conn.fileno())

    def _expire(self, now: float) -> None:
        """Close what waited too long: unadmitted peers, half-sent messages; resume
        listeners that rested."""
        for conn in [c for c, t in self._unadmitted.items() if now - t > self._handshake]:
            self.refusals.refused(_who(conn), f"not admitted within {self._handshake:g} s "
                                  "(PSKV_HANDSHAKE_TIMEOUT)")
            self.drop(conn)
        for conn in [c for c in self._conns.values() if c.stalled(now)]:
            log.warning("%s: %s sent part of a message, then nothing for %g s; "
                        "dropping it", self.name, conn.peer, conn.timeout)
            self.drop(conn)
        for conn in [c for c in self._conns.values() if c.write_stalled(now)]:
            log.warning("%s: %s has read nothing of its replies (%d bytes wait) for %g s; "
                        "dropping it", self.name, conn.peer, conn.queued_bytes(),
                        conn.timeout)
            self.drop(conn)
        for fd in [fd for fd, t in self._paused.items() if now >= t]:
            del self._paused[fd]
            self._poller.register(fd, zmq.POLLIN)

    # ---- loop --------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool], poll_ms: int = 100, tick: float = 0.5) -> None:
        """Serve until ``stop()``; call the handler's ``tick`` about every ``tick`` s."""
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        for fd in self._listeners:
            self._poller.register(fd, zmq.POLLIN)
        last = time.monotonic()
        while not stop():
            events = self._poller.poll(0 if self._again else poll_ms)
            again, self._again = self._again, set()
            events += [(fd, zmq.POLLIN) for fd in again
                       if fd in self._conns and fd not in self._writing]
            for what, flags in events:
                if what is self._router:
                    self._read_router()
                elif isinstance(what, int) and what in self._listeners:
                    self._accept(what, self._listeners[what])
                elif isinstance(what, int) and what in self._conns:
                    if what in self._writing:
                        if flags & (zmq.POLLOUT | zmq.POLLERR):
                            self._write_conn(self._conns[what])
                    else:
                        self._read_conn(self._conns[what])
            now = time.monotonic()
            if now - last >= tick:
                last = now
                self._expire(now)
                self.handler.tick()

    def close(self) -> None:
        """Close every stream connection and listener (the ROUTER's owner closes it)."""
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        for lis in self._listeners.values():
            lis.close()


def _who(conn: Connection) -> str:
    """The peer a refusal is logged under (its address where known)."""
    return getattr(conn, "address", None) or conn.peer


def _zmq_address(frames: list[Any]) -> str:
    """The IP address a ZeroMQ message came from, when libzmq knows it."""
    try:
        return f"a ZeroMQ peer at {frames[0].get('Peer-Address')}"
    except (zmq.ZMQError, AttributeError, IndexError):
        return "a ZeroMQ peer"
