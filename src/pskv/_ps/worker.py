"""KVWorker: a worker's requests to the servers and the waits for their replies.

One :class:`.transport.Connection` per server (a Unix socket on the same host, TCP or
ZeroMQ otherwise: :func:`.transport.connect` picks). Requests carry a ``ts``; ``wait(ts)``
polls every connection until that reply arrives, keeping other replies for their own waits.
Invariants: every wait is bounded by ``request_timeout`` and ends early with NodeFailedError
when the scheduler reports a dead node; an ERROR reply is re-raised as the error class
registered for its kind (:func:`..errors.error_from_kind`), marked "(reported by server N)".
"""
from __future__ import annotations

import itertools
import logging
import socket
import time
from typing import Any, Sequence

import numpy as np
import zmq

from ..errors import ClusterTimeoutError, KVStoreError, NodeFailedError, ProtocolError
from .auth import prove
from .config import ClusterConfig
from .message import Command, Meta, error_from_body
from .postoffice import Postoffice
from .replay import PushLog, backup_of
from .transport import Alloc, Connection, connect
from .zeromq import ZmqContext

__all__ = ["KVWorker"]

log = logging.getLogger(__name__)


class KVWorker:
    """Request/reply with every server of a cluster the Postoffice joined."""

    def __init__(self, cfg: ClusterConfig, zctx: ZmqContext, po: Postoffice) -> None:
        self.cfg = cfg
        self.po = po
        self._ts = itertools.count(1)
        self._conns: list[Connection] = []
        self._server_of: dict[Any, int] = {}        # pollable -> server rank
        self._poller = zmq.Poller()
        self._done: dict[int, tuple[Meta, list[np.ndarray]] | Exception] = {}
        self._dirty: set[int] = set()              # servers pushed to since the last flush
        self._deferred_error: Exception | None = None
        self._into: dict[int, Sequence[np.ndarray | None]] = {}
        self._zctx = zctx
        self._hello = {"role": "worker", "rank": po.rank,
                       **prove(cfg.secret, "worker", "server")}
        #: servers may be restarted (pskv-launch --max-restarts): keep what a restarted
        #: one needs again (pushes, requests not answered yet, mode and compression)
        self.resilient = cfg.max_restarts > 0 or cfg.replicas > 0
        self._log = PushLog(max(3 * cfg.checkpoint_every + 2 if cfg.max_restarts else 0,
                                64 if cfg.replicas else 0))
        #: ts -> (server, ps_key -> pushes sent before it): with replicas, a reply to a
        #: pull or flush means those pushes are applied and backed up: no longer kept
        self._acks: dict[int, tuple[int, dict[int, int]]] = {}
        #: shard -> the server that serves it (its backup once its primary died)
        self._host = list(range(len(po.servers)))
        self._sent: dict[int, tuple[int, Command, Sequence[int], Any,
                                    Sequence[np.ndarray]]] = {}
        self._setup: dict[str, Any] = {}
        self._down: set[int] = set()
        self._reconnecting = False
        try:
            for rank, ep in enumerate(po.servers):
                self._conns.append(self._connect(rank, ep))
            tss = [self.request(s, Command.HELLO, body=self._hello)
                   for s in range(len(self._conns))]
            for server, ts in enumerate(tss):
                meta, _ = self.wait(ts, timeout=cfg.connect_timeout)
                if po.rejoin and isinstance(meta.body, dict):
                    # a restarted worker: the pushes its first run made are applied; the
                    # same pushes made again as it catches up are dropped (docs/durability.md)
                    self._log.applied_before(server, {int(k): int(n)
                                            for k, n in meta.body.get("applied", [])})
        except BaseException:
            self.close()
            raise

    def _connect(self, rank: int, ep: dict[str, str]) -> Connection:
        conn = connect(self.cfg, ep, ep.get("host") == socket.gethostname(), f"server {rank}",
                       self._zctx)
        self._server_of[conn.pollable()] = rank
        self._poller.register(conn.pollable(), zmq.POLLIN)
        return conn

    # ---- restarted servers (docs/durability.md) ---------------------------------------------
    def _lost(self, server: int, err: KVStoreError, switch: bool = True) -> None:
        """The link to ``server`` broke: switch to the backups of what it served
        (PSKV_REPLICAS=1; soon, on this thread), or wait for its restart, or raise ``err``."""
        if not self.resilient:
            raise err
        if server not in self._down:
            if self.cfg.replicas and switch:
                self.po.lost.put(server)
            self._down.add(server)
            try:
                self._poller.unregister(self._conns[server].pollable())
            except KeyError:   # pragma: no cover - not registered
                pass
            self._conns[server].close()

    def _check_rejoined(self) -> None:
        """Reconnect to every server the scheduler says was restarted, then send it what
        it lacks: mode and compression, this worker's later pushes, unanswered requests."""
        if self._reconnecting:
            return
        while not self.po.lost.empty() or not self.po.rejoined.empty():
            self._reconnecting = True
            try:
                if not self.po.lost.empty():
                    self._failover(self.po.lost.get())
                else:
                    self._rejoin(self.po.rejoined.get())
            finally:
                self._reconnecting = False

    def _failover(self, server: int) -> None:
        """``server`` died: each shard it served goes to its backup, which is told what
        of this worker's pushes it lacks, and gets the unanswered requests again."""
        self._lost(server, NodeFailedError(f"server {server} died"), switch=False)
        for shard, host in enumerate(self._host):
            if host != server:
                continue
            backup = backup_of(shard, host, len(self._host))
            if backup in self._down:
                raise NodeFailedError(f"server {server} died and the backup of its shard "
                                      f"{shard}, server {backup}, is down too: that shard is "
                                      "lost. Restart from a checkpoint.")
            self._host[shard] = backup
            ts = next(self._ts)
            self._conns[backup].send(Command.COMMAND, ts, body={
                "op": "applied", "shard": shard, "rank": self.po.rank})
            meta, _ = self.wait(ts, what=f"server {backup} to take over shard {shard}")
            self._resend(shard, meta.body)
            log.warning("worker %d: server %d died; shard %d now on server %d", self.po.rank,
                        server, shard, backup)

    def _resend(self, shard: int, body: Any) -> None:
        """Send the server of ``shard`` this worker's pushes it has not applied (``body``:
        its ``applied`` counts), then the requests not answered yet."""
        body = body if isinstance(body, dict) else {}
        applied = {int(k): int(n) for k, n in body.get("applied", [])}
        host = self._host[shard]
        conn = self._conns[host]
        tag = {} if host == shard else {"shard": shard}
        pushes = self._log.since(shard, applied)
        for pk, kind, arrays in pushes:
            conn.send(Command.PUSH, -next(self._ts), [pk], {"kinds": kind, **tag}, arrays)
        again = sorted(ts for ts, sent in self._sent.items() if sent[0] == shard)
        for ts in again:
            _s, cmd, keys, body_, arrays_ = self._sent[ts]
            if cmd == Command.INIT and isinstance(body_, dict):
                body_ = {**body_, "again": True}     # its keys may be there already
            conn.send(cmd, ts, keys, self._tagged(shard, body_), arrays_)
        log.warning("worker %d: sent %d pushes and %d requests for shard %d again to server "
                    "%d", self.po.rank, len(pushes), len(again), shard, host)

    def _tagged(self, shard: int, body: Any) -> Any:
        """``body`` naming ``shard`` when another server serves it."""
        if self._host[shard] == shard:
            return body
        return {**(body if isinstance(body, dict) else {}), "shard": shard}

    def _rejoin(self, server: int) -> None:
        if self.cfg.replicas and self._host[server] == server:
            self._failover(server)          # it died unseen: its backup serves its shard
        self._lost(server, NodeFailedError(f"server {server} was restarted"), switch=False)
        self._server_of = {p: s for p, s in self._server_of.items() if s != server}
        conn = self._connect(server, self.po.servers[server])
        self._conns[server] = conn
        self._down.discard(server)
        ts = next(self._ts)
        conn.send(Command.HELLO, ts, body=self._hello)
        meta, _ = self.wait(ts, timeout=self.cfg.connect_timeout, what=f"server {server}'s "
                            "HELLO after its restart")
        body = meta.body if isinstance(meta.body, dict) else {}
        if self.cfg.replicas:
            return                          # a backup now: its shard stays where it is
        for setup in list(self._setup.values()):
            ts = next(self._ts)
            conn.send(Command.COMMAND, ts, body=setup)
            self.wait(ts, what=f"server {server} to take {setup.get('op')}")
        self._resend(server, body)

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
            self._into[ts] = into
        if self.resilient:
            self._check_rejoined()
            self._keep(server, cmd, ts, keys, body, arrays)
        if self._poller.poll(0):
            self._receive(0)      # keep the servers' replies from piling up
        host = self._host[server] if self.resilient else server
        if host in self._down:
            return ts             # sent again once it has been restarted
        try:
            self._conns[host].send(cmd, ts, keys, self._tagged(server, body)
                                   if host != server else body, arrays)
        except NodeFailedError as err:
            self._lost(host, err)
        return ts

    def _keep(self, server: int, cmd: Command, ts: int, keys: Sequence[int], body: Any,
              arrays: Sequence[np.ndarray]) -> None:
        """Remember what a restarted ``server`` would need again."""
        if cmd in (Command.PUSH, Command.PUSHPULL):
            kinds = body.get("kinds", "") if isinstance(body, dict) else ""
            self._log.record(server, keys, kinds, arrays)
        if cmd == Command.COMMAND and isinstance(body, dict) \
                and body.get("op") in ("mode", "compression"):
            self._setup[str(body["op"])] = body
        if self.cfg.replicas and cmd in (Command.PULL, Command.PUSHPULL, Command.FLUSH):
            self._acks[ts] = (server, self._log.counts(server, None if cmd == Command.FLUSH
                                                       else keys))
        if ts > 0 and cmd != Command.HELLO:
            # a PUSHPULL's push is in the log: sent again, it is a PULL
            self._sent[ts] = (server, Command.PULL, keys, None, ()) \
                if cmd == Command.PUSHPULL else (server, cmd, keys, body, arrays)

    def push(self, server: int, cmd: Command, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray]) -> int:
        """Send a push. No reply comes unless it fails; ``flush`` waits until it is applied.

        Its ts is negative, so an ERROR for it is told apart from a reply someone awaits.
        """
        if self._log.skipping:
            keys, body, arrays = self._log.drop_applied(server, keys, body, arrays)
            if not keys:
                return 0
        ts = self.request(server, cmd, keys, body, arrays, negative=True)
        self._dirty.add(server)
        return ts

    def close(self) -> None:
        """Close the connections (the ZmqContext closes ZeroMQ sockets)."""
        for conn in self._conns:
            conn.close()
        self._conns.clear()

    def _alloc_for(self, meta: Meta) -> Alloc | None:
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
        for what, _ in self._poller.poll(timeout_ms):
            server = self._server_of.get(what)
            if server is None or server in self._down:
                continue
            conn = self._conns[server]
            while True:         # one message at a time: its buffers may be reused
                try:
                    got = conn.receive(self._alloc_for, 1)
                except ProtocolError as err:
                    raise ProtocolError(f"server {server} sent a bad reply: {err}") from None
                except NodeFailedError as err:
                    self._lost(server, err)
                    break
                if not got:
                    break
                meta, arrays = got[0]
                self._into.pop(meta.ts, None)
                self._sent.pop(meta.ts, None)
                acked = self._acks.pop(meta.ts, None)
                if acked is not None and meta.cmd != Command.ERROR:
                    self._log.forget(*acked)
                result: tuple[Meta, list[np.ndarray]] | Exception = (meta, arrays)
                if meta.cmd == Command.ERROR:
                    result = error_from_body(meta.body, f"server {server}")
                if meta.ts < 0:              # only a failed push is answered
                    if isinstance(result, Exception) and self._deferred_error is None:
                        self._deferred_error = result
                    continue
                self._done[meta.ts] = result

    def defer(self, err: Exception) -> None:
        """Keep ``err`` for :meth:`raise_deferred` (the first one wins)."""
        if self._deferred_error is None:
            self._deferred_error = err

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
            if self.resilient:
                self._check_rejoined()
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
