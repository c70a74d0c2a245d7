"""The scheduler: admits nodes, assigns ranks, runs barriers, watches heartbeats.

Invariants: a node is admitted only with a good proof of the cluster secret; every node
that stops heartbeating is reported to all others as failed; the scheduler exits once every
worker has said goodbye (or died) and every server has stopped, or the cluster never formed
within ``connect_timeout``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..errors import ClusterError, ClusterTimeoutError, KVStoreError, ProtocolError
from .auth import Verifier
from .config import ENV_SERVER_ID, ENV_WORKER_ID, ClusterConfig
from .message import Command, Meta, error_body
from .serve import ServeLoop
from .transport import Connection
from .zeromq import ZmqContext

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Node:
    ident: Connection           # the node's ZeroMQ peer
    role: str
    rank: int
    body: dict[str, Any]
    last_seen: float
    state: str = "alive"        # alive | closed | dead
    hello_ts: int = 0
    claimed: int | None = None  # the rank it asked for (DMLC_WORKER_ID / DMLC_SERVER_ID)
    dead_since: float = 0.0     # with restarts: when it stopped heartbeating


@dataclass(slots=True)
class _Barrier:
    waiting: dict[int, tuple[Connection, int, Any]] = field(default_factory=dict)


class Scheduler:
    """The scheduler: a ServeLoop on one ROUTER socket; ``run()`` returns the exit status.

    It checks HELLOs itself (``_hello``: the proof, the role, the expected count), so its
    ServeLoop admits whoever ``_hello`` registered.
    """

    def __init__(self, cfg: ClusterConfig, stop: threading.Event | None = None,
                 zmq_context: zmq.Context[Any] | None = None) -> None:
        self.cfg = cfg
        self._stop = stop or threading.Event()
        self._zctx = ZmqContext(zmq_context)
        self._sock = self._zctx.socket(zmq.ROUTER)
        bind_host = cfg.node_host if cfg.node_host != "127.0.0.1" else cfg.root_uri
        self._sock.bind(cfg.root_address if cfg.transport == "inproc" else
                        f"tcp://{bind_host}:{cfg.root_port}")
        self._verifier = Verifier(cfg.secret, "scheduler")
        self.loop = ServeLoop("the scheduler", self, Verifier(None, "scheduler"),
                              cfg.request_timeout, router=self._sock, refusal=ClusterError)
        self._code: int | None = None
        self._start = time.monotonic()
        self._nodes: dict[Connection, _Node] = {}
        self._counts = {"server": 0, "worker": 0}
        self._admitted = False
        self._barriers: dict[str, _Barrier] = {}
        self._failed = False
        self._shutdown_sent = 0.0

    # ---- helpers -----------------------------------------------------------------------
    def _send(self, ident: Connection, cmd: Command, ts: int = 0, body: Any = None) -> None:
        try:
            ident.send(cmd, ts, body=body)
        except KVStoreError as err:  # peer gone: ROUTER_MANDATORY says so
            log.debug("scheduler: cannot send %s to %s: %s", cmd.name, ident.peer, err)

    def _members(self, role: str | None = None) -> list[_Node]:
        return [n for n in self._nodes.values() if role is None or n.role == role]

    def _live(self) -> list[_Node]:
        return [n for n in self._nodes.values() if n.state == "alive"]

    # ---- message handlers ------------------------------------------------------------------
    def _hello(self, ident: Connection, ts: int, body: Any) -> None:
        why = self._verifier.check(body)
        role = str(body.get("role")) if isinstance(body, dict) else ""
        if why is None and role not in ("server", "worker"):
            why = f"an unknown role {role!r}"
        claimed = body.get("rank") if isinstance(body, dict) else None
        if why is None and self._admitted and self.cfg.max_restarts and ident not in self._nodes:
            old = next((n for n in self._members(role) if n.rank == claimed), None)
            if old is not None:
                self._rejoin(old, ident, ts, body)
                return
        if why is None and (self._admitted or self._counts[role] >= self._expected(role)):
            why = f"a {role} beyond the {self._expected(role)} this cluster expects"
        if why is None and claimed is not None and ident not in self._nodes:
            why = self._check_claim(role, claimed)
        if why is not None:
            log.warning("scheduler: refused a node (%s)", why)
            self._send(ident, Command.ERROR, ts, error_body(
                ClusterError(f"the scheduler refused this node: {why}")))
            return
        if ident in self._nodes:
            return
        # ranks are final at admission: claimed ranks first, then arrival order (_admit)
        self._counts[role] += 1
        self._nodes[ident] = _Node(ident, role, -1, dict(body), time.monotonic(), hello_ts=ts,
                                   claimed=claimed)
        if all(self._counts[r] == self._expected(r) for r in ("server", "worker")):
            self._admit()

    def _check_claim(self, role: str, claimed: Any) -> str | None:
        """Why a node may not have the rank it claims, or None (BytePS's DMLC_WORKER_ID)."""
        var = ENV_WORKER_ID if role == "worker" else ENV_SERVER_ID
        n = self._expected(role)
        if isinstance(claimed, bool) or not isinstance(claimed, int) or not 0 <= claimed < n:
            return (f"{var}={claimed!r} is out of range: this cluster has {n} {role}s, ranks "
                    f"0 to {n - 1}. Give each {role} a distinct {var} in that range, or leave "
                    "it unset")
        if any(node.role == role and node.claimed == claimed for node in self._nodes.values()):
            return (f"two {role}s claim rank {claimed} ({var}={claimed}). Give each {role} "
                    f"its own {var}, or leave it unset for first-come ranks")
        return None

    def _assign_ranks(self) -> None:
        """Claimed ranks as claimed; the others the free ranks, in arrival order."""
        for role in ("server", "worker"):
            members = self._members(role)
            taken = {n.claimed for n in members if n.claimed is not None}
            free = iter(r for r in range(self._expected(role)) if r not in taken)
            for node in members:  # dicts keep arrival order
                node.rank = node.claimed if node.claimed is not None else next(free)

    def _expected(self, role: str) -> int:
        return self.cfg.num_servers if role == "server" else self.cfg.num_workers

    def _admit(self) -> None:
        self._assign_ranks()
        servers = sorted(self._members("server"), key=lambda n: n.rank)
        table = self._table()
        now = time.monotonic()
        for node in self._nodes.values():
            node.last_seen = now
            self._send(node.ident, Command.ADMIT, node.hello_ts, {
                "role": node.role, "rank": node.rank, "servers": table,
                "num_workers": self.cfg.num_workers, "num_servers": self.cfg.num_servers})
        self._admitted = True
        ns, nw = len(servers), self.cfg.num_workers
        log.info("scheduler: %d server%s and %d worker%s admitted", ns, "s"[:ns != 1], nw,
                 "s"[:nw != 1])

    def _table(self) -> list[Any]:
        servers = sorted(self._members("server"), key=lambda n: n.rank)
        return [n.body.get("endpoints", {}) for n in servers]

    def _rejoin(self, old: _Node, ident: Connection, ts: int, body: dict[str, Any]) -> None:
        """A node restarted by pskv-launch --max-restarts takes the rank of ``old`` (dead,
        or about to be found dead); every other node is told where it is now."""
        del self._nodes[old.ident]
        for bar in self._barriers.values():
            for k, (who, _bts, _p) in list(bar.waiting.items()):
                if who is old.ident:
                    del bar.waiting[k]
        node = _Node(ident, old.role, old.rank, dict(body), time.monotonic(), hello_ts=ts,
                     claimed=old.rank)
        self._nodes[ident] = node
        log.warning("scheduler: %s %d rejoined (restarted)", node.role, node.rank)
        self._send(ident, Command.ADMIT, ts, {
            "role": node.role, "rank": node.rank, "servers": self._table(),
            "num_workers": self.cfg.num_workers, "num_servers": self.cfg.num_servers,
            "rejoin": True})
        for other in self._live():
            if other is not node:
                self._send(other.ident, Command.NODE_REJOINED, 0, {
                    "role": node.role, "rank": node.rank,
                    "endpoints": body.get("endpoints", {})})

    def _barrier(self, node: _Node, ts: int, body: Any) -> None:
        group = body.get("group", "worker") if isinstance(body, dict) else "worker"
        if group not in ("worker", "server", "all"):
            self._send(node.ident, Command.ERROR, ts, error_body(
                ProtocolError(f"unknown barrier group {group!r}")))
            return
        bar = self._barriers.setdefault(group, _Barrier())
        key = node.rank if group != "all" else (node.rank if node.role == "worker"
                                                 else -1 - node.rank)
        bar.waiting[key] = (node.ident, ts, body.get("payload"))
        size = (self.cfg.num_workers if group == "worker" else self.cfg.num_servers
                if group == "server" else self.cfg.num_workers + self.cfg.num_servers)
        if len(bar.waiting) == size:
            payloads = {str(k): v[2] for k, v in bar.waiting.items()}
            for ident, bts, _ in bar.waiting.values():
                self._send(ident, Command.BARRIER_DONE, bts, {"payloads": payloads})
            del self._barriers[group]

    def _goodbye(self, node: _Node) -> None:
        if node.state == "alive":
            node.state = "closed"
        self._maybe_shutdown()

    def _maybe_shutdown(self) -> None:
        workers = self._members("worker")
        if self._admitted and workers and all(n.state != "alive" for n in workers) \
                and not self._shutdown_sent:
            self._shutdown_sent = time.monotonic()
            for n in self._members("server"):
                if n.state == "alive":
                    self._send(n.ident, Command.SHUTDOWN)

    def _fail(self, node: _Node, reason: str) -> None:
        if node.role == "server" and self.cfg.replicas and not node.dead_since and not any(
                n.role == "server" and n.state == "dead" and n is not node
                for n in self._members()):
            # its backup takes its shard over: the job goes on (docs/durability.md)
            log.warning("scheduler: server %d %s; its backup takes over", node.rank, reason)
            for other in self._live():
                if other is not node:
                    self._send(other.ident, Command.NODE_FAILED, 0,
                               {"role": "server", "rank": node.rank, "failover": True,
                                "msg": f"server {node.rank} {reason}"})
            node.state = "dead"
            if self.cfg.max_restarts:
                node.dead_since = time.monotonic()
            return
        if self.cfg.max_restarts and not node.dead_since and node.role != "scheduler":
            # pskv-launch restarts it: its replacement has connect_timeout to say HELLO
            node.state, node.dead_since = "dead", time.monotonic()
            log.warning("scheduler: %s %d %s; waiting for its restart", node.role, node.rank,
                        reason)
            return
        node.state = "dead"
        self._failed = True
        # name the machine too (the hostname it said HELLO with): that is what an operator
        # looks for when a link or a host went down
        host = node.body.get("host")
        where = f" on {host}" if isinstance(host, str) and host else ""
        msg = f"{node.role} {node.rank}{where} {reason}"
        log.error("scheduler: %s", msg)
        for other in self._live():
            self._send(other.ident, Command.NODE_FAILED, 0,
                       {"role": node.role, "rank": node.rank, "msg": msg})
        for bar_group in list(self._barriers):
            del self._barriers[bar_group]   # members were told; nothing will complete it
        self._maybe_shutdown()

    # ---- the Handler of the ServeLoop ----------------------------------------------------
    def admit(self, conn: Connection, meta: Meta) -> _Node | None:
        """A HELLO: ``_hello`` registers the node (or refuses it)."""
        self._hello(conn, meta.ts, meta.body)
        return self._nodes.get(conn)

    def handle(self, conn: Connection, node: _Node, meta: Meta,
               arrays: list[np.ndarray]) -> None:
        """A registered node's message: heartbeat, barrier or goodbye."""
        node.last_seen = time.monotonic()
        if meta.cmd == Command.HEARTBEAT:
            self._send(conn, Command.HEARTBEAT_ACK, meta.ts)
        elif meta.cmd == Command.BARRIER:
            self._barrier(node, meta.ts, meta.body)
        elif meta.cmd == Command.GOODBYE:
            if node.role == "server":
                node.state = "closed"
            else:
                self._goodbye(node)
        else:
            raise ProtocolError(f"the scheduler does not take {meta.cmd.name}")

    def dropped(self, conn: Connection) -> None:
        """Nothing to do: a node that is gone stops heartbeating."""

    def tick(self) -> None:
        """Admission deadline, heartbeats, the end of the job (sets the exit status)."""
        now = time.monotonic()
        if not self._admitted:
            if now - self._start > self.cfg.connect_timeout:
                raise ClusterTimeoutError(
                    f"the scheduler waited {self.cfg.connect_timeout:g} s but only "
                    f"{self._counts['server']}/{self.cfg.num_servers} servers and "
                    f"{self._counts['worker']}/{self.cfg.num_workers} workers arrived. "
                    "Start every node, or raise PSKV_CONNECT_TIMEOUT.")
            return
        for node in self._live():
            if now - node.last_seen > self.cfg.heartbeat_timeout:
                self._fail(node, f"sent no heartbeat for {now - node.last_seen:.1f} s "
                                 "(it died or hangs)")
        for node in self._members():
            if node.dead_since and now - node.dead_since > self.cfg.connect_timeout \
                    and not self._failed:
                self._fail(node, f"died and was not restarted within "
                                 f"{self.cfg.connect_timeout:g} s")
        servers = self._members("server")
        if self._shutdown_sent and all(n.state != "alive" for n in servers):
            self._code = 1 if self._failed else 0
        elif self._shutdown_sent and now - self._shutdown_sent > self.cfg.shutdown_timeout:
            log.error("scheduler: servers did not stop within %g s", self.cfg.shutdown_timeout)
            self._code = 1

    # ---- loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the cluster is done; 0 if every worker closed cleanly, else 1."""
        self._start = time.monotonic()
        tick = min(0.1, self.cfg.heartbeat_interval / 2)
        try:
            self.loop.run(lambda: self._stop.is_set() or self._code is not None,
                          int(tick * 1000), tick)
            return self._code if self._code is not None else 1 if self._failed else 0
        finally:
            self.loop.close()
            self._zctx.close()
