"""KVWorker: a worker's requests to the servers and the waits for their replies.

One :class:`.transport.Connection` per server (a Unix socket on the same host, TCP or
ZeroMQ otherwise: :func:`.transport.connect` picks). Requests carry a ``ts``; ``wait(ts)``
polls every connection until that reply arrives, keeping other replies for their own waits.
Invariants: every wait is bounded by ``request_timeout`` and ends early with NodeFailedError
when the scheduler reports a dead node; an ERROR reply is re-raised as the error class
registered for its kind (:func:`..errors.error_from_kind`), marked "(reported by server N)".

Threads: any number may send and wait at once. A message is written whole under its
connection's send lock; one waiting thread at a time reads the connections (the receiver)
and files every reply under its ts, and the others wait on a condition for theirs; no lock
is held while a thread waits for the network except the receiver role itself.

Servers that die and come back (``pskv-launch --max-restarts``, ``PSKV_REPLICAS=1``; see
docs/durability.md): the worker is then *resilient*, and every request goes out through
its :class:`.failover.Failover` (which keeps it, routes it to the server serving its shard,
and sends it again after a failover), every reply comes back through it, and a broken link
marks the server down there instead of failing the call. Only the receiver recovers
(``Failover.recover``), with the receiver role held; this class is the failover's
:class:`.failover.Links`.

Over 500 lines because KVWorker's request table, its one reading thread and the reply
filing are one invariant (one waiting thread reads for all) that a split would spread over
modules.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import zmq

from ..errors import ClusterTimeoutError, KVStoreError, NodeFailedError, ProtocolError
from .auth import check_server, new_key, prove
from .config import ClusterConfig
from .failover import Failover, applied_counts
from .hostid import same_host
from .message import Command, Meta, error_from_body
from .ops import Op, command
from .observe.metrics import start as start_metrics
from .observe.series import WorkerMetrics
from .postoffice import Postoffice
from .seals import Seals, resume
from .tls import client_context
from .transport import Alloc, Connection, connect
from .zeromq import ZmqContext

__all__ = ["KVWorker"]

log = logging.getLogger(__name__)
#: a HELLO's reply has not come yet (KVWorker._hello_reply)
_PENDING = object()
#: seconds between reads of the links a request makes on its way out (a failed push's
#: ERROR waits that long at most; a broken link is noticed by the idle hook meanwhile)
READ_EVERY = 0.002


class _Unreachable:
    """The link to a server whose dial was refused while this worker connected, with
    backups on: every send fails as a broken link's does (the failover then moves its
    shard to the backup), nothing ever arrives, and it is never polled."""

    max_bytes: int | None = None

    def __init__(self, peer: str, why: NodeFailedError) -> None:
        self.peer, self._why = peer, why

    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        raise NodeFailedError(f"{self.peer} cannot be reached: {self._why}")

    def receive(self, alloc_for: Callable[[Meta], Alloc | None] | None = None,
                limit: int = 64) -> list[tuple[Meta, list[np.ndarray]]]:
        return []

    def pollable(self) -> Any:
        return self             # never registered with the poller

    def stalled(self, now: float) -> bool:
        return False

    def close(self) -> None:
        pass


class KVWorker:
    """Request/reply with every server of a cluster the Postoffice joined."""

    def __init__(self, cfg: ClusterConfig, zctx: ZmqContext, po: Postoffice) -> None:
        self.cfg = cfg
        self.po = po
        self._zctx = zctx
        self._tls = client_context(*cfg.tls) if cfg.tls is not None else None
        self._ts = itertools.count(1)
        self._conns: list[Connection] = []
        self._server_of: dict[Any, int] = {}        # pollable -> server rank
        #: server rank -> the endpoints its current link was made to (a loss report names
        #: them: the scheduler ignores one about a server restarted since)
        self._conn_at: dict[int, Mapping[str, str]] = {}
        self._poller = zmq.Poller()
        self._done: dict[int, tuple[Meta, list[np.ndarray]] | Exception] = {}
        self._dirty: set[int] = set()              # servers pushed to since the last flush
        self._deferred_error: Exception | None = None
        self._into: dict[int, Sequence[np.ndarray | None]] = {}
        self._mutex = threading.Lock()       # _done, _into, _dirty, _deferred_error, _lost,
        self._cond = threading.Condition(self._mutex)   # and the resilient state below
        self._receiving = False              # a thread holds the receiver role
        self._last_read = 0.0                # when the links were last read
        self._send_locks: list[threading.Lock] = []
        # ZeroMQ sockets are not thread-safe: with ZeroMQ links, sends and the receiver's
        # poll-and-read take turns under one lock (the receiver polls in short slices)
        self._io = threading.Lock()
        self._zmq = False
        self._lost: set[int] = set()               # servers whose connection broke
        #: Prometheus series when PSKV_METRICS_PORT asks for them (after the handshakes)
        self.metrics: WorkerMetrics | None = None
        #: servers may die and come back: failover keeps what a restarted one or a backup
        #: needs, and routes each request to the server serving its shard
        self.failover: Failover | None = None
        #: the data position's step tags and seals (``seals.py``), once a Sampler attaches
        self.seals: Seals | None = None
        #: a restarted worker: each shard's answer to POSITION when its first run trained
        #: through a data position (None: it did not); until a Sampler attaches, its pulls
        #: read the values as they are, not after its first run's unsealed pushes
        self.resume_from: dict[int, Any] | None = None
        #: every live server admitted this worker: only then may failover send them
        #: commands (a server refuses anything before the HELLO handshake)
        self._connected = False
        if cfg.max_restarts > 0 or cfg.replicas > 0:
            keep = max(3 * cfg.checkpoint_every + 2 if cfg.max_restarts else 0,
                       64 if cfg.replicas else 0)
            self.failover = Failover(self, po.rank, len(po.servers), keep, cfg.replicas > 0)
        try:
            for rank, ep in enumerate(po.servers):
                self._conns.append(self._connect(rank, ep))
                self._send_locks.append(threading.Lock())
            # each server challenges; the proof binds this job and rank under this worker's
            # own key from the scheduler (auth.py)
            # own, and each server proves its rank back under the same pair key, over both
            # nonces: a process that is not the server the scheduler admitted is refused
            wnonces = [new_key() for _ in self._conns]
            replies, nonces = self._handshakes(wnonces)
            hosts = list(po.hosts) or list(range(len(self._conns)))
            for s, reply in enumerate(replies):
                if reply is None:    # died while this worker connected: its backup serves
                    continue
                meta = reply[0]
                check_server(po.key_for(s), po.job, s, po.rank, nonces[s], wnonces[s],
                             meta.body)
                if po.rejoin and self.failover is not None and hosts[s] == s:
                    # a restarted worker: the pushes its first run made are applied; the
                    # same pushes made again as it catches up are dropped (durability.md)
                    self.failover.pushes.applied_before(s, applied_counts(meta.body))
            if po.rejoin and self.failover is not None:
                for shard, host in enumerate(hosts):
                    if host != shard:   # its backup serves it now: ask that one
                        ts = self.request(host, Command.COMMAND,
                                          body=command(Op.APPLIED, shard=shard))
                        meta = self.wait(ts, timeout=cfg.connect_timeout)[0]
                        self.failover.pushes.applied_before(shard, applied_counts(meta.body))
                # set after the handshakes, which go to each server itself
                self.failover.host = hosts
                self.resume_from = self._positions(len(hosts))
            # a server that died while this worker connected: its shards move to their
            # backups now that every live server has admitted this worker
            self._connected = True
            self._recover()
            fo = self.failover
            self.metrics = start_metrics(cfg, lambda: WorkerMetrics(
                po.rank, po.job, (lambda: fo.resent) if fo is not None else None), po)
        except BaseException:
            self.close()
            raise

    def _hello(self, wnonce: str) -> dict[str, Any]:
        return {"role": "worker", "rank": self.po.rank, "wnonce": wnonce}

    def _proof(self, server: int, challenge: Any, wnonce: str) -> dict[str, Any]:
        return {**self._hello(wnonce), **prove(self.po.key_for(server), "server", challenge,
                                               "worker", self.po.rank)}

    def _connect(self, rank: int, ep: Mapping[str, str]) -> Connection:
        try:
            conn = connect(self.cfg, ep, same_host(ep),
                           f"server {rank}", self._zctx, self._tls,
                           (self.po.key_for(rank), "worker", self.po.rank))
        except NodeFailedError as err:
            if self._connected or self.failover is None or not self.failover.replicas:
                raise
            # its dial refused while this worker connects: it died first (a server answers
            # no worker before its backup holds the first copy of its shard, so that
            # backup serves it): as a link that breaks during the handshakes
            self._conn_at[rank] = ep
            self.po.report_lost("server", rank, ep)
            log.info("worker %d: server %d cannot be reached (%s); its backup will serve "
                     "its shard", self.po.rank, rank, err)
            return _Unreachable(f"server {rank}", err)
        self._conn_at[rank] = ep
        self._zmq = self._zmq or not isinstance(conn.pollable(), int)
        self._server_of[conn.pollable()] = rank
        self._poller.register(conn.pollable(), zmq.POLLIN)
        return conn

    def _send(self, server: int, cmd: Command, ts: int, keys: Sequence[int] = (),
              body: Any = None, arrays: Sequence[np.ndarray] = ()) -> None:
        with self._send_locks[server], self._io if self._zmq else contextlib.nullcontext():
            self._conns[server].send(cmd, ts, keys, body, arrays)

    def request(self, server: int, cmd: Command, keys: Sequence[int] = (), body: Any = None,
                arrays: Sequence[np.ndarray] = (), negative: bool = False,
                into: Sequence[np.ndarray | None] | None = None,
                lenders: Sequence[Any] | None = None) -> int:
        """Send one request to ``server``; return its ts. The arrays are free on return,
        but for those ``lenders`` lends to failover's push log (see :meth:`push`).

        ``into``: where the reply's arrays should land, one per array (None: anywhere);
        honoured where the transport reads into place and shape and dtype match.
        """
        fo = self.failover
        if cmd == Command.PUSHPULL and fo is not None and fo.pushes.skipping:
            # a restarted worker catching up: push what is new, then pull
            self.push(server, Command.PUSH, keys, body, arrays)
            cmd, body, arrays = Command.PULL, None, ()
        if self.seals is not None and cmd in (Command.PUSH, Command.PUSHPULL):
            body = self.seals.tagged(server, body)
        elif self.resume_from is not None and cmd == Command.PULL:
            body = {"now": True}
        elif self.seals is not None and fo is not None and fo.pushes.skipping:
            body = self._read_now(fo, server, cmd, keys, body)
        ts = -next(self._ts) if negative else next(self._ts)
        if into is not None:
            with self._mutex:
                self._into[ts] = into
        if time.monotonic() - self._last_read > READ_EVERY:
            self.poll_links()     # keep the servers' replies from piling up
        if self.metrics is not None:
            self.metrics.sent(ts, cmd, arrays)
        if fo is None:
            self._send(server, cmd, ts, keys, body, arrays)
        else:
            fo.send(server, cmd, ts, keys, body, arrays, lenders)
        return ts

    @staticmethod
    def _read_now(fo: Any, server: int, cmd: Command, keys: Sequence[int], body: Any) -> Any:
        """A restarted worker in the step it resumed at (``seals.py`` W3): a read of a key
        whose pushes of that step ``server`` holds, before this worker has made them
        again, reads the value as it is (as its first run did at this point), not after
        the round of those pushes; that round waits for a commit this worker sends only
        after them (W1)."""
        if cmd in (Command.PULL, Command.RSP_PULL):
            now = list(dict.fromkeys(fo.catching_up(server, keys)))
            if now:
                return {**(body if isinstance(body, dict) else {}),
                        "now": True if len(now) == len(set(keys)) else now}
        elif cmd == Command.COMMAND and isinstance(body, dict) and \
                body.get("op") == Op.LOOKUP.value and type(body.get("key")) is int and \
                fo.catching_up(server, [body["key"]]):
            return {**body, "now": True}
        return body

    def settle(self) -> None:
        """Before a call that sent PUSHPULLs returns: copy the arrays failover borrowed
        from it and still keeps (``Failover.settle``); nothing without failover."""
        if self.failover is not None:
            self.failover.settle()

    def push(self, server: int, cmd: Command, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray], lenders: Sequence[Any] | None = None) -> int:
        """Send a push. No reply comes unless it fails; ``flush`` waits until it is applied.

        Its ts is negative, so an ERROR for it is told apart from a reply someone awaits.
        ``lenders``: per array, the NDArray whose unshared buffer it is (or a view of), or
        None: failover keeps those buffers lent, not copied (``_ps/replay.py``).
        """
        fo = self.failover
        if fo is not None and fo.pushes.skipping:
            made = len(keys)
            keys, body, arrays = fo.skip_applied(server, keys, body, arrays)
            lenders = None
            if len(keys) < made and self.seals is not None:
                # pushes made again that the shard holds: their step's commit goes at
                # the next wait, as the first run's would have (seals.py W3)
                self.seals.tagged(server, None)
            if not keys:
                return 0
        ts = self.request(server, cmd, keys, body, arrays, negative=True, lenders=lenders)
        with self._mutex:
            self._dirty.add(server)
        return ts

    def _positions(self, shards: int) -> dict[int, Any] | None:
        """Each shard's answer to POSITION, or None when none has a mark or a seal of this
        worker's (its first run trained without a data position)."""
        tss = {s: self.request(s, Command.COMMAND, body=command(Op.POSITION))
               for s in range(shards)}
        got = {s: self.wait(ts, what="the servers' data positions")[0].body
               for s, ts in tss.items()}
        if all(isinstance(p, dict) and not p.get("marks") and p.get("sealed", -1) < 0
               for p in got.values()):
            return None
        return got

    def attach_position(self) -> int:
        """Tag this worker's pushes with a data position's step from now on (``seals.py``);
        return the step to train first: 0, or for a restarted worker where it resumes (W3).
        Idempotent: a second call returns the step it is at."""
        if self.seals is not None:
            return self.seals.step
        step, sealed, counts = 0, None, {}
        fo = self.failover
        if self.resume_from is not None and fo is not None:
            step, sealed, counts = resume(self.resume_from)
            self.resume_from = None
            with fo.route:
                for s, held in counts.items():
                    fo.pushes.resume(s, held)
        seals = self.seals = Seals(self, step)
        if fo is not None:
            fo.seals = seals
        if sealed is not None:
            # a commit that reached some shards only (the first run died sending it)
            seals.sealed = sealed
            for s in counts:
                self.request(s, Command.COMMAND, negative=True,
                             body=command(Op.SEAL, step=sealed, commit=True))
        # shards holding pushes of the step resumed at: sealed once those pushes are made
        # again (dropped: see push), or when the next step begins if they are not
        seals.resumed({s for s, held in counts.items() if any(h > c for c, h in held.values())})
        return step

    def close(self) -> None:
        """Close the connections (the ZmqContext closes ZeroMQ sockets)."""
        if self.metrics is not None:
            self.metrics.close()
        for conn in self._conns:
            conn.close()
        self._conns.clear()

    # ---- the failover's Links (docs/durability.md) ---------------------------------------
    def next_ts(self) -> int:
        """A fresh positive request id."""
        return next(self._ts)

    def send(self, server: int, cmd: Command, ts: int, keys: Sequence[int] = (),
             body: Any = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Write one message to ``server`` as it is (no routing)."""
        self._send(server, cmd, ts, keys, body, arrays)

    def drop(self, server: int) -> None:
        """Stop polling and close the link to ``server`` (only the receiver calls it)."""
        conn = self._conns[server]
        if conn.pollable() not in self._server_of:
            return
        try:
            self._poller.unregister(conn.pollable())
        except KeyError:
            pass
        self._server_of.pop(conn.pollable(), None)
        # a sender holds the send lock while it writes; with ZeroMQ the receiver already
        # holds the one I/O lock every sender takes
        with contextlib.nullcontext() if self._zmq else self._send_locks[server]:
            conn.close()

    def connect(self, server: int) -> None:
        """A new link to the restarted ``server``."""
        self._conns[server] = self._connect(server, self.po.servers[server])
        with self._mutex:
            self._lost.discard(server)

    def hello(self, server: int) -> Meta:
        """Prove this worker's rank again on the new link to ``server``."""
        what = f"server {server}'s answer to HELLO after its restart"
        ts, wnonce, nonce = next(self._ts), new_key(), None
        self._send(server, Command.HELLO, ts, body=self._hello(wnonce))
        meta = self.await_reply(ts, what, self.cfg.connect_timeout)
        if meta.cmd == Command.CHALLENGE:
            ts = next(self._ts)
            proof = self._proof(server, meta.body, wnonce)
            nonce = proof["nonce"]
            self._send(server, Command.HELLO, ts, body=proof)
            meta = self.await_reply(ts, what, self.cfg.connect_timeout)
        # the node there must be the server the scheduler admitted for this rank now
        check_server(self.po.key_for(server), self.po.job, server, self.po.rank, nonce,
                     wnonce, meta.body)
        return meta

    def await_reply(self, ts: int, what: str, timeout: float | None = None) -> Meta:
        """Wait for the reply to ``ts`` while holding the receiver role."""
        limit = self.cfg.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._mutex:
                result = self._done.pop(ts, None)
            if isinstance(result, Exception):
                raise result
            if result is not None:
                return result[0]
            self.po.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterTimeoutError(f"worker {self.po.rank} waited {limit:g} s for "
                                          f"{what}. Raise PSKV_REQUEST_TIMEOUT if it is slow.")
            self._receive(int(min(left, 0.2) * 1000) + 1)

    def _recover(self) -> None:
        """Act on servers lost and rejoined (the receiver calls it, role held); not before
        the handshakes are done (the constructor calls it then)."""
        if self.failover is not None and self._connected:
            self.failover.recover(self.po.next_event)

    def _handshakes(self, wnonces: list[str]) -> tuple[list[Any], list[str | None]]:
        """HELLO every server, answer each one's challenge as soon as it comes (a server
        drops a peer that takes PSKV_HANDSHAKE_TIMEOUT), and return each server's last
        reply (None: it died meanwhile and its backup serves its shard) and nonce."""
        n = len(self._conns)
        tss = [self.request(s, Command.HELLO, body=self._hello(wnonces[s])) for s in range(n)]
        replies: list[Any] = [None] * n
        nonces: list[str | None] = [None] * n
        proved = [False] * n
        pending = set(range(n))
        deadline = time.monotonic() + self.cfg.connect_timeout
        while pending:
            for s in sorted(pending):
                reply = self._hello_reply(s, tss[s], deadline)
                if reply is _PENDING:
                    continue
                if reply is not None and reply[0].cmd == Command.CHALLENGE and not proved[s]:
                    proof = self._proof(s, reply[0].body, wnonces[s])
                    nonces[s], proved[s] = proof["nonce"], True
                    tss[s] = self.request(s, Command.HELLO, body=proof)
                    continue
                replies[s] = reply
                pending.discard(s)
        return replies, nonces

    def _hello_reply(self, server: int, ts: int, deadline: float) -> Any:
        """The reply to a HELLO to ``server`` if it came (else ``_PENDING``), or None when
        ``server`` died meanwhile and its backup will serve its shards
        (``PSKV_REPLICAS=1``); past ``deadline``, ClusterTimeoutError."""
        fo = self.failover
        if fo is not None and fo.replicas:
            # the scheduler's news too (over ZeroMQ no link breaks), kept for recover()
            event = self.po.next_event()
            while event is not None:
                fo.hold(event)
                event = self.po.next_event()
            if fo.is_down(server):
                with self._mutex:
                    self._done.pop(ts, None)
                log.warning("worker %d: server %d died while this worker connected; its "
                            "backup serves its shard", self.po.rank, server)
                return None
        try:
            return self.wait(ts, timeout=0.02, what=f"server {server} to answer its HELLO")
        except ClusterTimeoutError:
            if time.monotonic() < deadline:
                return _PENDING
            raise ClusterTimeoutError(
                f"worker {self.po.rank} waited {self.cfg.connect_timeout:g} s for server "
                f"{server} to answer its HELLO. Check that the server runs, or raise "
                "PSKV_CONNECT_TIMEOUT.") from None

    # ---- replies ---------------------------------------------------------------------------
    def _alloc_for(self, meta: Meta) -> Alloc | None:
        with self._mutex:
            into = self._into.pop(meta.ts, None)
        if into is None:
            return None

        def alloc(i: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray | None:
            t = into[i] if i < len(into) else None
            if t is not None and t.dtype == dtype and t.shape == shape:
                return t
            return None                  # the transport's own buffer
        return alloc

    def _receive(self, timeout_ms: int) -> None:
        """Read and file what arrives within ``timeout_ms`` (only the receiver calls it)."""
        self._last_read = time.monotonic()
        if self._zmq:
            with self._io:
                self._read(min(timeout_ms, 10))
        else:
            self._read(timeout_ms)

    def _read(self, timeout_ms: int) -> None:
        for what, _ in self._poller.poll(timeout_ms):
            server = self._server_of.get(what)
            if server is None:
                continue
            if self.failover is not None and self.failover.is_down(server):
                self.drop(server)                # resilient: a link that broke
                continue
            conn = self._conns[server]
            while True:         # one message at a time: its buffers may be reused
                try:
                    got = conn.receive(self._alloc_for, 1)
                except ProtocolError as err:
                    raise ProtocolError(f"server {server} sent a bad reply: {err}") from None
                except NodeFailedError as err:
                    with self._mutex:
                        first = server not in self._lost
                        self._lost.add(server)
                    if first:                        # the others hear it from the scheduler
                        self.po.report_lost("server", server, self._conn_at.get(server))
                    if self.failover is None:
                        self.po.check()  # a cluster already failed: that is the cause
                        raise NodeFailedError(f"server {server} is gone: {err}") from None
                    self.failover.link_broke(server)
                    self.drop(server)
                    break
                if not got:
                    break
                meta, arrays = got[0]
                result: tuple[Meta, list[np.ndarray]] | Exception = (meta, arrays)
                if meta.cmd == Command.ERROR:
                    result = error_from_body(meta.body, f"server {server}")
                with self._mutex:
                    self._into.pop(meta.ts, None)
                    if self.failover is not None:
                        self.failover.answered(meta.ts, meta.cmd != Command.ERROR)
                    if meta.ts < 0:              # only a failed push is answered
                        if isinstance(result, Exception) and self._deferred_error is None:
                            self._deferred_error = result
                        continue
                    self._done[meta.ts] = result
                    self._cond.notify_all()
                if self.metrics is not None:
                    self.metrics.received(meta.ts, arrays)

    def poll_links(self) -> None:
        """Read whatever has arrived, without waiting, unless another thread is reading: a
        connection that broke is noticed (and reported) even while the store is idle.
        Raises NodeFailedError then (unless resilient: then it reconnects)."""
        with self._mutex:
            if self._receiving:
                return
            self._receiving = True
        try:
            self._recover()
            self._receive(0)
        finally:
            with self._mutex:
                self._receiving = False
                self._cond.notify_all()

    def defer(self, err: Exception) -> None:
        """Keep ``err`` for :meth:`raise_deferred` (the first one wins)."""
        with self._mutex:
            if self._deferred_error is None:
                self._deferred_error = err

    def raise_deferred(self) -> None:
        """Raise the error an earlier push got, once."""
        with self._mutex:
            err, self._deferred_error = self._deferred_error, None
        if err is not None:
            raise err

    def wait(self, ts: int, timeout: float | None = None, what: str = "a reply") \
            -> tuple[Meta, list[np.ndarray]]:
        """Wait for the reply to ``ts``."""
        limit = self.cfg.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self.po.check()
            left = deadline - time.monotonic()
            with self._mutex:
                if ts in self._done:
                    result = self._done.pop(ts)
                    break
                if left <= 0:
                    raise ClusterTimeoutError(
                        f"worker {self.po.rank} waited {limit:g} s for {what}. A server or "
                        "another worker is stuck or slow: check that every worker makes the "
                        "same calls, or raise PSKV_REQUEST_TIMEOUT.")
                if self._receiving:          # another thread reads; it files our reply
                    self._cond.wait(min(left, 0.05))
                    continue
                self._receiving = True
            try:
                self._recover()
                self._receive(int(min(left, 0.2) * 1000) + 1)
            finally:
                with self._mutex:
                    self._receiving = False
                    self._cond.notify_all()
        if isinstance(result, Exception):
            raise result
        return result

    def wait_all(self, tss: Sequence[int], what: str) -> list[tuple[Meta, list[np.ndarray]]]:
        """Wait for several replies (all of them, even if one failed), in order; the data
        position's pushes are sealed first (``seals.py`` W1)."""
        if self.seals is not None:
            self.seals.seal()
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
        if self.seals is not None:
            self.seals.seal(final=True)
        with self._mutex:
            servers, self._dirty = sorted(self._dirty), set()
        if servers:
            tss = [self.request(s, Command.FLUSH) for s in servers]
            for ts in tss:
                self.wait(ts, timeout, "the servers to apply this worker's pushes (another "
                          "worker has not pushed the same keys?)")
        self.raise_deferred()

