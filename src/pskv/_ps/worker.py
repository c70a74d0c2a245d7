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
docs/durability.md): the worker is then *resilient*. It keeps its recent pushes
(:class:`.replay.PushLog`) and its unanswered requests; a broken link marks the server
down instead of failing the call. Only the receiver reconnects (:meth:`_recover`): to the
backup of each shard the dead server served, or to the restarted server, and sends it
what it lacks, under the routing lock, so no request of another thread slips between the
switch and the re-sent pushes.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from typing import Any, Sequence

import numpy as np
import zmq

from ..errors import ClusterTimeoutError, KVStoreError, NodeFailedError, ProtocolError
from .auth import prove
from .config import ClusterConfig
from .message import Command, Meta, error_from_body
from .ops import Op, command, parse
from .postoffice import Postoffice
from .replay import PushLog, backup_of
from .tls import client_context
from .transport import Alloc, Connection, connect
from .zeromq import ZmqContext

__all__ = ["KVWorker"]

log = logging.getLogger(__name__)
#: seconds between reads of the links a request makes on its way out (a failed push's
#: ERROR waits that long at most; a broken link is noticed by the idle hook meanwhile)
READ_EVERY = 0.002


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
        #: servers may die and come back: keep what a restarted one or a backup needs
        self.resilient = cfg.max_restarts > 0 or cfg.replicas > 0
        self._log = PushLog(max(3 * cfg.checkpoint_every + 2 if cfg.max_restarts else 0,
                                64 if cfg.replicas else 0))
        #: ts -> (shard, ps_key -> pushes sent before it): with replicas, a reply to a pull
        #: or flush means those pushes are applied and backed up: no longer kept
        self._acks: dict[int, tuple[int, dict[int, int]]] = {}
        #: shard -> the server that serves it (its backup once its primary died)
        self._host = list(range(len(po.servers)))
        #: ts -> (shard, cmd, keys, body, arrays) of requests not answered yet
        self._sent: dict[int, tuple[int, Command, Sequence[int], Any,
                                    Sequence[np.ndarray]]] = {}
        self._setup: dict[Op, Any] = {}           # settings a restarted server gets again
        self._down: set[int] = set()               # servers whose link broke (resilient)
        self._route = threading.RLock()            # shard routing and re-sending
        self._recovering = False
        try:
            for rank, ep in enumerate(po.servers):
                self._conns.append(self._connect(rank, ep))
                self._send_locks.append(threading.Lock())
            # each server challenges; the proof binds this job and rank under this worker's
            # own key from the scheduler (auth.py)
            tss = [self.request(s, Command.HELLO, body=self._hello())
                   for s in range(len(self._conns))]
            replies = [self.wait(ts, timeout=cfg.connect_timeout) for ts in tss]
            for s, (meta, _) in enumerate(replies):
                if meta.cmd == Command.CHALLENGE:
                    tss[s] = self.request(s, Command.HELLO, body=self._proof(meta.body))
                else:
                    tss[s] = 0
            for s, ts in enumerate(tss):
                meta = self.wait(ts, timeout=cfg.connect_timeout)[0] if ts else replies[s][0]
                if po.rejoin:
                    # a restarted worker: the pushes its first run made are applied; the
                    # same pushes made again as it catches up are dropped (durability.md)
                    self._log.applied_before(s, _applied(meta.body))
        except BaseException:
            self.close()
            raise

    def _hello(self) -> dict[str, Any]:
        return {"role": "worker", "rank": self.po.rank}

    def _proof(self, challenge: Any) -> dict[str, Any]:
        return {**self._hello(), **prove(self.po.key, "server", challenge, "worker",
                                         self.po.rank)}

    def _connect(self, rank: int, ep: dict[str, str]) -> Connection:
        conn = connect(self.cfg, ep, ep.get("host") == socket.gethostname(), f"server {rank}",
                       self._zctx, self._tls)
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
                into: Sequence[np.ndarray | None] | None = None) -> int:
        """Send one request to ``server``; return its ts. The arrays are free on return.

        ``into``: where the reply's arrays should land, one per array (None: anywhere);
        honoured where the transport reads into place and shape and dtype match.
        """
        if cmd == Command.PUSHPULL and self._log.skipping:
            # a restarted worker catching up: push what is new, then pull
            self.push(server, Command.PUSH, keys, body, arrays)
            cmd, body, arrays = Command.PULL, None, ()
        ts = -next(self._ts) if negative else next(self._ts)
        if into is not None:
            with self._mutex:
                self._into[ts] = into
        if time.monotonic() - self._last_read > READ_EVERY:
            self.poll_links()     # keep the servers' replies from piling up
        if not self.resilient:
            self._send(server, cmd, ts, keys, body, arrays)
            return ts
        with self._route:
            with self._mutex:
                self._keep(server, cmd, ts, keys, body, arrays)
            host = self._host[server]
            if host in self._down:
                return ts         # sent again once a backup or a restart serves the shard
            try:
                self._send(host, cmd, ts, keys, self._tagged(server, body), arrays)
            except NodeFailedError as err:
                self._mark_down(host, err)
        return ts

    def push(self, server: int, cmd: Command, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray]) -> int:
        """Send a push. No reply comes unless it fails; ``flush`` waits until it is applied.

        Its ts is negative, so an ERROR for it is told apart from a reply someone awaits.
        """
        if self._log.skipping:
            with self._mutex:
                keys, body, arrays = self._log.drop_applied(server, keys, body, arrays)
            if not keys:
                return 0
        ts = self.request(server, cmd, keys, body, arrays, negative=True)
        with self._mutex:
            self._dirty.add(server)
        return ts

    def close(self) -> None:
        """Close the connections (the ZmqContext closes ZeroMQ sockets)."""
        for conn in self._conns:
            conn.close()
        self._conns.clear()

    # ---- what a server that died and came back needs (docs/durability.md) -----------------
    def _keep(self, shard: int, cmd: Command, ts: int, keys: Sequence[int], body: Any,
              arrays: Sequence[np.ndarray]) -> None:
        """Remember what the server of ``shard`` would need again (under the mutex)."""
        if cmd in (Command.PUSH, Command.PUSHPULL):
            kinds = body.get("kinds", "") if isinstance(body, dict) else ""
            self._log.record(shard, keys, kinds, arrays)
        if cmd == Command.COMMAND and parse(body) is Op.COMPRESSION:
            self._setup[Op.COMPRESSION] = body
        if self.cfg.replicas and cmd in (Command.PULL, Command.PUSHPULL, Command.FLUSH):
            self._acks[ts] = (shard, self._log.counts(shard, None if cmd == Command.FLUSH
                                                      else keys))
        if ts > 0 and cmd != Command.HELLO:
            # a PUSHPULL's push is in the log: sent again, it is a PULL
            self._sent[ts] = (shard, Command.PULL, keys, None, ()) \
                if cmd == Command.PUSHPULL else (shard, cmd, keys, body, arrays)

    def _tagged(self, shard: int, body: Any) -> Any:
        """``body`` naming ``shard`` when another server serves it."""
        if self._host[shard] == shard:
            return body
        return {**(body if isinstance(body, dict) else {}), "shard": shard}

    def _mark_down(self, server: int, err: KVStoreError, switch: bool = True) -> None:
        """The link to ``server`` broke: raise ``err`` unless resilient; else the receiver
        switches its shards to their backups (PSKV_REPLICAS=1) or waits for its restart."""
        if not self.resilient:
            raise err
        with self._mutex:
            first = server not in self._down
            self._down.add(server)
        if first and self.cfg.replicas and switch:
            self.po.lost.put(server)

    def _drop_conn(self, server: int) -> None:
        """Stop polling and close the link to ``server`` (only the receiver calls it)."""
        conn = self._conns[server]
        try:
            self._poller.unregister(conn.pollable())
        except KeyError:
            pass
        self._server_of.pop(conn.pollable(), None)
        # a sender holds the send lock while it writes; with ZeroMQ the receiver already
        # holds the one I/O lock every sender takes
        with contextlib.nullcontext() if self._zmq else self._send_locks[server]:
            conn.close()

    def _recover(self) -> None:
        """Switch to backups of dead servers and reconnect to restarted ones (the receiver
        calls it, with the receiver role held)."""
        if self._recovering:
            return
        self._recovering = True
        try:
            while not self.po.lost.empty() or not self.po.rejoined.empty():
                if not self.po.lost.empty():
                    self._failover(self.po.lost.get())
                else:
                    self._rejoin(self.po.rejoined.get())
        finally:
            self._recovering = False

    def _await(self, ts: int, what: str, timeout: float | None = None) -> Meta:
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

    def _failover(self, server: int) -> None:
        """``server`` died: each shard it served goes to its backup, which is told what
        of this worker's pushes it lacks, and gets the unanswered requests again."""
        with self._route:
            self._mark_down(server, NodeFailedError(f"server {server} died"), switch=False)
            if self._conns[server].pollable() in self._server_of:
                self._drop_conn(server)
            for shard, host in enumerate(self._host):
                if host != server:
                    continue
                backup = backup_of(shard, host, len(self._host))
                if backup in self._down:
                    raise NodeFailedError(
                        f"server {server} died and the backup of its shard {shard}, server "
                        f"{backup}, is down too: that shard is lost. Restart the job from a "
                        "checkpoint (kv.load_checkpoint).")
                self._host[shard] = backup
                ts = next(self._ts)
                self._send(backup, Command.COMMAND, ts, body=command(Op.APPLIED, shard=shard))
                meta = self._await(ts, f"server {backup} to take over shard {shard}")
                self._resend(shard, meta.body)
                log.warning("worker %d: server %d died; shard %d now on server %d",
                            self.po.rank, server, shard, backup)

    def _resend(self, shard: int, body: Any) -> None:
        """Send the server of ``shard`` this worker's pushes it has not applied (``body``:
        its ``applied`` counts), then the requests not answered yet (routing lock held)."""
        host = self._host[shard]
        tag = {} if host == shard else {"shard": shard}
        with self._mutex:
            pushes = self._log.since(shard, _applied(body))
            again = sorted(ts for ts, sent in self._sent.items() if sent[0] == shard)
            requests = [(ts, self._sent[ts]) for ts in again]
        for pk, kind, arrays in pushes:
            self._send(host, Command.PUSH, -next(self._ts), [pk], {"kinds": kind, **tag},
                       arrays)
        for ts, (_s, cmd, keys, body_, arrays_) in requests:
            if cmd == Command.INIT and isinstance(body_, dict):
                body_ = {**body_, "again": True}     # its keys may be there already
            self._send(host, cmd, ts, keys, self._tagged(shard, body_), arrays_)
        log.warning("worker %d: sent %d pushes and %d requests for shard %d again to server "
                    "%d", self.po.rank, len(pushes), len(requests), shard, host)

    def _rejoin(self, server: int) -> None:
        """``server`` was restarted (the scheduler said where it is now): reconnect, prove
        this worker's rank again, and send it what it lacks (without replicas: mode and
        compression, later pushes, unanswered requests; with replicas it is a backup now)."""
        with self._route:
            if self.cfg.replicas and self._host[server] == server:
                self._failover(server)          # it died unseen: its backup serves its shard
            self._mark_down(server, NodeFailedError(f"server {server} was restarted"),
                            switch=False)
            if self._conns[server].pollable() in self._server_of:
                self._drop_conn(server)
            self._conns[server] = self._connect(server, self.po.servers[server])
            with self._mutex:
                self._down.discard(server)
                self._lost.discard(server)
            what = f"server {server}'s answer to HELLO after its restart"
            ts = next(self._ts)
            self._send(server, Command.HELLO, ts, body=self._hello())
            meta = self._await(ts, what, self.cfg.connect_timeout)
            if meta.cmd == Command.CHALLENGE:
                ts = next(self._ts)
                self._send(server, Command.HELLO, ts, body=self._proof(meta.body))
                meta = self._await(ts, what, self.cfg.connect_timeout)
            if self.cfg.replicas:
                return                          # a backup now: its shard stays where it is
            for op, setup in list(self._setup.items()):
                ts = next(self._ts)
                self._send(server, Command.COMMAND, ts, body=setup)
                self._await(ts, f"server {server} to take {op.value}")
            self._resend(server, meta.body)

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
            if server in self._down:             # resilient: a link that broke
                self._drop_conn(server)
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
                        self.po.report_lost("server", server)
                    if not self.resilient:
                        self.po.check()  # a cluster already failed: that is the cause
                        raise NodeFailedError(f"server {server} is gone: {err}") from None
                    self._mark_down(server, err)
                    self._drop_conn(server)
                    break
                if not got:
                    break
                meta, arrays = got[0]
                result: tuple[Meta, list[np.ndarray]] | Exception = (meta, arrays)
                if meta.cmd == Command.ERROR:
                    result = error_from_body(meta.body, f"server {server}")
                with self._mutex:
                    self._into.pop(meta.ts, None)
                    if self.resilient:
                        self._sent.pop(meta.ts, None)
                        acked = self._acks.pop(meta.ts, None)
                        if acked is not None and meta.cmd != Command.ERROR:
                            self._log.forget(*acked)
                    if meta.ts < 0:              # only a failed push is answered
                        if isinstance(result, Exception) and self._deferred_error is None:
                            self._deferred_error = result
                        continue
                    self._done[meta.ts] = result
                    self._cond.notify_all()

    def poll_links(self) -> None:
        """Read whatever has arrived, without waiting, unless another thread is reading: a
        connection that broke is noticed (and reported) even while the store is idle.
        Raises NodeFailedError then (unless resilient: then it reconnects)."""
        with self._mutex:
            if self._receiving:
                return
            self._receiving = True
        try:
            if self.resilient:
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
                if self.resilient:
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
        with self._mutex:
            servers, self._dirty = sorted(self._dirty), set()
        if servers:
            tss = [self.request(s, Command.FLUSH) for s in servers]
            for ts in tss:
                self.wait(ts, timeout, "the servers to apply this worker's pushes (another "
                          "worker has not pushed the same keys?)")
        self.raise_deferred()


def _applied(body: Any) -> dict[int, int]:
    """A server's ``applied`` counts (ps_key -> pushes of this worker it applied)."""
    pairs = body.get("applied", []) if isinstance(body, dict) else []
    out: dict[int, int] = {}
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair):
            out[pair[0]] = pair[1]
    return out
