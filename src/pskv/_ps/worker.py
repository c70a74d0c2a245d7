"""KVWorker: a worker's requests to the servers and the waits for their replies.

One DEALER socket per server (ipc when the server is on this host, else tcp). Requests
carry a ``ts``; ``wait(ts)`` polls every socket until that reply arrives, keeping other
replies for their own waits. Invariants: every wait is bounded by ``request_timeout`` and
ends early with NodeFailedError when the scheduler reports a dead node; an ERROR reply is
re-raised as the error class registered for its kind (``errors.error_from_kind``), marked
"(reported by server N)".
"""
from __future__ import annotations

import functools
import itertools
import socket
import time
from typing import Any, Sequence

import numpy as np
import zmq

from ..errors import ClusterTimeoutError, KVStoreError, ProtocolError
from .auth import prove
from .config import ClusterConfig
from .message import Command, Meta, error_from_body
from .postoffice import Postoffice
from .uds import UdsConn
from .van import ZmqVan

__all__ = ["KVWorker"]


class KVWorker:
    """Request/reply with every server of a cluster the Postoffice joined."""

    def __init__(self, cfg: ClusterConfig, van: ZmqVan, po: Postoffice) -> None:
        self.cfg = cfg
        self.po = po
        self._ts = itertools.count(1)
        self._socks: list[Any] = []
        self._server_of: dict[zmq.Socket[Any], int] = {}
        self._poller = zmq.Poller()
        self._done: dict[int, tuple[Meta, list[np.ndarray]] | Exception] = {}
        self._dirty: set[int] = set()              # servers pushed to since the last flush
        self._deferred_error: Exception | None = None
        self._trackers: list[Any] = []
        self._into: dict[int, Sequence[np.ndarray | None]] = {}
        self._conns: dict[int, tuple[UdsConn, int]] = {}
        hello = {"role": "worker", "rank": po.rank, **prove(cfg.secret, "worker", "server")}
        try:
            self._connect(van, po.servers)
            tss = [self.request(s, Command.HELLO, body=hello) for s in range(len(self._socks))]
            for ts in tss:
                self.wait(ts, timeout=cfg.connect_timeout)
        except BaseException:
            self.close()
            raise

    def request(self, server: int, cmd: Command, keys: Sequence[int] = (), body: Any = None,
                arrays: Sequence[np.ndarray] = (), negative: bool = False,
                into: Sequence[np.ndarray | None] | None = None) -> int:
        """Send one request to ``server``; return its ts.

        ``into``: where the reply's arrays should land, one per array (None: anywhere);
        honoured on the same-host path when shape and dtype match.
        """
        ts = -next(self._ts) if negative else next(self._ts)
        target = self._socks[server]
        if isinstance(target, UdsConn):
            if into is not None:
                self._into[ts] = into
            if self._conns and self._poller.poll(0):
                self._receive(0)      # keep the server's replies from piling up
            target.send(cmd, ts, keys, body, arrays)   # written now: buffers are free again
            return ts
        big = any(a.nbytes >= zmq.COPY_THRESHOLD for a in arrays)
        tracker = ZmqVan.send(target, cmd, ts, keys, body, arrays, copy=False,
                              track=big)
        if big:
            self._trackers = [t for t in self._trackers if not t.done]
            self._trackers.append(tracker)
        return ts

    def flush_sent(self, timeout: float | None = None) -> None:
        """Wait until ZeroMQ has sent every array handed to it without a copy."""
        limit = self.cfg.request_timeout if timeout is None else timeout
        for tracker in self._trackers:
            try:
                tracker.wait(limit)
            except zmq.NotDone:
                raise ClusterTimeoutError(
                    f"worker {self.po.rank} could not send a message within {limit:g} s: a "
                    "server is not reading. Check the servers, or raise PSKV_REQUEST_TIMEOUT."
                ) from None
        self._trackers.clear()

    def push(self, server: int, cmd: Command, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray]) -> int:
        """Send a push. No reply comes unless it fails; ``flush`` waits until it is applied.

        Its ts is negative, so an ERROR for it is told apart from a reply someone awaits.
        """
        ts = self.request(server, cmd, keys, body, arrays, negative=True)
        self._dirty.add(server)
        return ts

    def _connect(self, van: ZmqVan, servers: list[dict[str, str]]) -> None:
        me = socket.gethostname()
        cfg = self.cfg
        for rank, ep in enumerate(servers):
            path = None
            if "uds" in ep and (cfg.transport == "ipc" or (cfg.transport == "auto"
                                                            and ep.get("host") == me)):
                path = ep["uds"]                 # same host: a Unix socket
            elif "raw" in ep and cfg.transport != "zmq":
                path = ep["raw"]                 # another host: TCP, pskv's framing
            if path is not None:
                conn = UdsConn.connect(path, cfg.request_timeout, f"server {rank}")
                self._socks.append(conn)
                self._conns[conn.fileno()] = (conn, rank)
                self._poller.register(conn.fileno(), zmq.POLLIN)
                continue
            sock = van.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(ep["tcp"])
            self._socks.append(sock)
            self._server_of[sock] = rank
            self._poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        """Close the same-host connections (the van closes the ZeroMQ sockets)."""
        for conn, _ in self._conns.values():
            conn.close()
        self._conns.clear()

    def sends_now(self, server: int) -> bool:
        """Whether a request to ``server`` is written before ``request`` returns (so the
        arrays it carries may be changed right after)."""
        return isinstance(self._socks[server], UdsConn)

    def _alloc_for(self, meta: Meta, conn: UdsConn) -> Any:
        into = self._into.pop(meta.ts, None)
        if into is None:
            return None

        def alloc(i: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
            t = into[i] if i < len(into) else None
            if t is not None and t.dtype == dtype and t.shape == shape:
                return t
            return conn.reuse(i, dtype, shape)
        return alloc

    def _messages(self, timeout_ms: int) -> Any:
        """Yield (server, meta, arrays) for every message that arrives within the timeout."""
        for sock, _ in self._poller.poll(timeout_ms):
            if isinstance(sock, int):
                conn, server = self._conns[sock]
                while True:         # one message at a time: its buffers may be reused
                    try:
                        got = conn.read_available(functools.partial(self._alloc_for, conn=conn),
                                                  1)
                    except ProtocolError as err:
                        raise ProtocolError(f"server {server} sent a bad reply: {err}") \
                            from None
                    if not got:
                        break
                    yield server, got[0][0], got[0][1]
                continue
            server = self._server_of[sock]
            while sock.poll(0):
                _, frames = ZmqVan.recv(sock)
                try:
                    meta, arrays = ZmqVan.parse(frames)
                except ProtocolError as err:
                    self._deferred_error = ProtocolError(f"server {server} sent a bad reply: "
                                                         f"{err}")
                    continue
                yield server, meta, arrays

    def _receive(self, timeout_ms: int) -> None:
        for server, meta, arrays in self._messages(timeout_ms):
            result: tuple[Meta, list[np.ndarray]] | Exception = (meta, arrays)
            if meta.cmd == Command.ERROR:
                result = error_from_body(meta.body, f"server {server}")
            if meta.ts < 0:              # only a failed push is answered
                if isinstance(result, Exception) and self._deferred_error is None:
                    self._deferred_error = result
                continue
            self._done[meta.ts] = result

    def raise_deferred(self) -> None:
        """Raise the error an earlier push got, once."""
        err, self._deferred_error = self._deferred_error, None
        if err is not None:
            raise err

    def wait(self, ts: int, timeout: float | None = None, what: str = "a reply") \
            -> tuple[Meta, list[np.ndarray]]:
        """Wait for the reply to ``ts``."""
        limit = self.cfg.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while ts not in self._done:
            self.po.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterTimeoutError(
                    f"worker {self.po.rank} waited {limit:g} s for {what}. A server or another "
                    "worker is stuck or slow: check that every worker makes the same calls, "
                    "or raise PSKV_REQUEST_TIMEOUT.")
            self._receive(int(min(left, 0.2) * 1000) + 1)
        result = self._done.pop(ts)
        if isinstance(result, Exception):
            raise result
        return result

    def wait_all(self, tss: Sequence[int], what: str) -> list[tuple[Meta, list[np.ndarray]]]:
        """Wait for several replies (all of them, even if one failed), in order."""
        results: list[Any] = []
        first: Exception | None = None
        for ts in tss:
            try:
                results.append(self.wait(ts, what=what))
            except ClusterTimeoutError:
                raise
            except KVStoreError as err:
                first = first or err
                results.append(None)
        if first is not None:
            raise first
        return results

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every push sent so far has been applied; raise what any of them got."""
        if self._dirty:
            servers, self._dirty = sorted(self._dirty), set()
            tss = [self.request(s, Command.FLUSH) for s in servers]
            for ts in tss:
                self.wait(ts, timeout, "the servers to apply this worker's pushes (another "
                          "worker has not pushed the same keys?)")
        self.raise_deferred()
