"""The scheduler: admits nodes, assigns ranks, runs barriers, watches heartbeats.

Invariants: a node is admitted only with a good proof of the cluster secret; every node
that stops heartbeating is reported to all others as failed; the scheduler exits once every
worker has said goodbye (or died) and every server has stopped, or the cluster never formed
within ``connect_timeout``.

Over 500 lines because the scheduler's node registry, barriers, heartbeats and failure
reports change one membership under one loop.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..errors import (ClusterError, ClusterTimeoutError, ConfigError, KVStoreError,
                      ProtocolError, WorkerClosedError)
from .auth import Verifier, new_key, warn_without_secret
from .crypt import curve_keys, derive, seal
from .config import (ENV_JOIN_STATUS, ENV_ROOT_PORT, ENV_SERVER_ID, ENV_WORKER_ID,
                     ClusterConfig)
from .hostid import host_id
from .limits import CONTROL_BYTES, CONTROL_FRAMES
from .message import Command, Meta, error_body
from .observe.metrics import job_label, start as start_metrics
from .observe.series import SchedulerMetrics
from .replay import backup_of
from .serve import ServeLoop
from .observe.stragglers import JobStragglers, parse_beat
from .transport import Connection
from .validate import OBSERVER, READER
from .zeromq import ZmqContext, curve_server

__all__ = ["LOST_GRACE", "Scheduler", "scheduler_curve"]

log = logging.getLogger(__name__)
#: seconds a node whose connection broke has to say GOODBYE before it is reported failed
LOST_GRACE = 0.8


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
    lost: float = 0.0           # when a peer reported its connection to it broke (0: never)
    lost_by: str = ""
    dead_since: float = 0.0     # with restarts: when it stopped heartbeating
    #: the key this node's key material is sealed under (empty: a cluster without a
    #: secret), and the number of the next sealed message (crypt.seal)
    seal: bytes = field(default=b"", repr=False)
    sealed: int = 0
    metrics_port: int = 0       # where it serves /metrics, as its heartbeats say (0: not)
    metrics_host: str = ""
    joined: bool = False        # a worker that called kv.join (uneven data)
    #: a server removed from the running job (pskv-launch --remove-server): its slot may
    #: take a new process (--add-server), which gets the slot's shard handed back
    retired: bool = False


@dataclass(slots=True)
class _Barrier:
    waiting: dict[int, tuple[Connection, int, Any]] = field(default_factory=dict)
    started: float = 0.0      # when its first member arrived


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
        # nothing but control messages: libzmq drops a peer that sends a bigger frame
        self._sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_BYTES)
        # a connection that never completes ZeroMQ's own handshake is closed by libzmq
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, int(cfg.handshake_timeout * 1000))
        if cfg.encrypt and cfg.transport != "inproc":
            # PSKV_ENCRYPT=1: CURVE, with a key pair only the secret's holders can derive
            try:
                curve_server(self._sock, scheduler_curve(cfg)[1])
            except BaseException:
                self._zctx.close()
                raise
        bind_host = cfg.root_uri if cfg.node_host == "127.0.0.1" and _is_ip(cfg.root_uri) \
            else cfg.node_host
        try:
            self._sock.bind(cfg.root_address if cfg.transport == "inproc" else
                            f"tcp://{_bracket(bind_host)}:{cfg.root_port}")
        except BaseException as err:
            self._zctx.close()
            if isinstance(err, zmq.ZMQError) and err.errno == errno.EADDRINUSE:
                # said here: else this job's workers meet whoever holds the port (another
                # job's scheduler) and blame PSKV_SECRET
                raise ConfigError(
                    f"port {cfg.root_port} on {bind_host} is in use: the scheduler cannot "
                    f"listen there (another program or pskv job holds it). Pick another with "
                    f"{ENV_ROOT_PORT} / pskv-launch --port, or leave --port out to take a "
                    "free one.") from err
            raise
        warn_without_secret("the scheduler", cfg.secret, cfg.transport, cfg.root_address,
                            bind_host)
        #: this job's id: every proof of admission binds it (auth.py)
        self.job = new_key()
        secret = cfg.secret
        self.loop = ServeLoop("the scheduler", self,
                              Verifier("scheduler", self.job, lambda role, rank: secret),
                              cfg.request_timeout, router=self._sock, refusal=ClusterError,
                              handshake_timeout=cfg.handshake_timeout,
                              max_unadmitted=cfg.max_unadmitted,
                              max_message_bytes=CONTROL_BYTES, max_frames=CONTROL_FRAMES)
        self._code: int | None = None
        self._start = time.monotonic()
        self._nodes: dict[Connection, _Node] = {}
        self._counts = {"server": 0, "worker": 0}
        self._admitted = False
        #: the job's store type, from admission
        self._mode = "sync"
        #: what each (worker, server) pair key is derived from: known here only. Worker w
        #: gets its row, server s its column; s's column changes with each restart of s
        #: (``_epochs``), so a stale incarnation of a server proves nothing to a worker
        self._master = new_key().encode()
        self._epochs = [0] * cfg.num_servers
        #: the key servers prove themselves to each other with (never sent to a worker)
        self._server_key = new_key()
        #: shard -> the server that serves it (its backup once it died, with replicas)
        self._hosts = list(range(cfg.num_servers))
        #: restarted nodes waiting to take a rank whose holder is not yet found dead:
        #: conn -> (the holder, HELLO ts, HELLO body, since)
        self._claims: dict[Connection, tuple[_Node, int, dict[str, Any], float]] = {}
        self._barriers: dict[str, _Barrier] = {}
        #: joins every worker completed (kv.join): the epoch of the joins under way
        self._join_epoch = 0
        self._failed = False
        #: Prometheus series when PSKV_METRICS_PORT asks for them (``run`` starts them)
        self.metrics: SchedulerMetrics | None = None
        #: workers often last across every server's sync rounds (servers' heartbeats)
        self.stragglers = JobStragglers(cfg.straggler_seconds, cfg.num_workers)
        self._shutdown_sent = 0.0
        self._ending = 0.0

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
    def _hello(self, ident: Connection, ts: int, body: dict[str, Any]) -> None:
        """A HELLO whose proof checked (``validate`` checked its fields)."""
        role = str(body["role"])
        if role == OBSERVER:          # proved the secret (if any); joins nothing
            self._observed(ident, ts)
            return
        if role == READER:            # proved the secret (if any); reads, joins nothing
            self._reader(ident, ts, body)
            return
        claimed = body.get("rank")
        if self._admitted and ident not in self._nodes:
            old = next((n for n in self._members(role) if n.rank == claimed), None)
            if old is not None and (self.cfg.max_restarts or old.retired):
                # a restart takes the rank once its holder is found dead (at once if it
                # is): a live rank is never handed over, with its key, to whoever asks
                self._claims[ident] = (old, ts, body, time.monotonic())
                self._settle_claims()
                return
        why = None
        if (self._admitted or self._counts[role] >= self._expected(role)):
            why = f"a {role} beyond the {self._expected(role)} this cluster expects"
        if why is None and claimed is not None and ident not in self._nodes:
            why = self._check_claim(role, claimed)
        if why is not None:
            self.loop.refusals.refused(getattr(ident, "address", "") or ident.peer, why)
            self._send(ident, Command.ERROR, ts, error_body(
                ClusterError(f"the scheduler refused this node: {why}")))
            return
        if ident in self._nodes:
            return
        # ranks are final at admission: claimed ranks first, then arrival order (_admit)
        self._counts[role] += 1
        kept = self._kept(body)
        self._nodes[ident] = _Node(ident, role, -1, kept, time.monotonic(), hello_ts=ts,
                                   claimed=claimed, seal=self._seal_key(body))
        if role == "worker" and self._counts[role] == 1:
            self._join_status("waiting")
        if all(self._counts[r] == self._expected(r) for r in ("server", "worker")):
            self._admit()

    def _observed(self, ident: Connection, ts: int) -> None:
        """Answer an observer (pskv-top --scheduler) with the job's label, each node's
        metrics address (the listing of ``pskv_scheduler_node_info``) and this scheduler's
        own, then forget the connection: it is never admitted."""
        own = None
        if self.metrics is not None and self.metrics.port is not None:
            own = [self.metrics.host, self.metrics.port]
        self._send(ident, Command.ACK, ts, {
            "job": job_label(self.job), "metrics": own,
            "nodes": [list(node) for node in self._listing()]})
        self.loop.drop(ident)

    def _reader(self, ident: Connection, ts: int, body: dict[str, Any]) -> None:
        """Answer a reader of the change stream (``pskv.stream``) with the servers, which
        serves each shard, and each server's reader key (sealed: only a holder of the
        secret opens them), then forget the connection: it is never admitted. Before
        the job is admitted there are no servers to read: refused, to be asked again."""
        if not self._admitted:
            self._send(ident, Command.ERROR, ts, error_body(ClusterError(
                "the job has not started yet: its servers are not all in. Ask again in a "
                "moment (pskv.stream.Reader retries until its timeout).")))
            self.loop.drop(ident)
            return
        servers = sorted(self._members("server"), key=lambda n: n.rank)
        keys = {"reader_keys": [self._reader_key(s) for s in range(self.cfg.num_servers)]}
        sealing = self._seal_key(body)
        self._send(ident, Command.ACK, ts, {
            "job": self.job, "num_servers": self.cfg.num_servers,
            "servers": [n.body.get("endpoints", {}) for n in servers],
            "hosts": list(self._hosts),
            **({"sealed": seal(sealing, 1, keys)} if sealing else keys)})
        self.loop.drop(ident)

    def _reader_key(self, server: int) -> str:
        """The key readers prove themselves to this incarnation of ``server`` with: it lets
        them read tables' change streams there, and nothing else."""
        return derive(self._master, "reader", self.job, server, self._epochs[server]).hex()

    def _join_status(self, word: str) -> None:
        """Tell pskv-launch how far the job joined (``waiting``: a worker said HELLO;
        ``joined``: every node did, written before any ADMIT), when it asked
        (PSKV_JOIN_STATUS): a worker that exits 0 without joining while others wait is
        then named at once, not after PSKV_CONNECT_TIMEOUT."""
        path = self.cfg.join_status
        if not path:
            return
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(word + "\n")
            os.replace(path + ".tmp", path)
        except OSError as err:
            log.warning("scheduler: cannot write %s=%r (%s); the launcher cannot tell "
                        "whether the workers joined", ENV_JOIN_STATUS, path, err)

    def _seal_key(self, body: dict[str, Any]) -> bytes:
        """The key a node's key material is sealed under: derived from the cluster secret,
        this job and the nonce of the node's own admission, so only that node (and the
        secret's holders) can open it and no two admissions share one (crypt.seal)."""
        nonce = body.get("nonce")
        if self.cfg.secret is None or not isinstance(nonce, str):
            return b""
        return derive(self.cfg.secret, "seal", self.job, nonce)

    def _pair(self, worker: int, server: int) -> str:
        """The key only ``worker`` and this incarnation of ``server`` hold: the worker proves
        its rank with it, the server its rank (auth.server_proof)."""
        return derive(self._master, "pair", self.job, worker, server,
                      self._epochs[server]).hex()

    def _keys_of(self, node: _Node) -> dict[str, Any]:
        if node.role == "worker":
            return {"keys": [self._pair(node.rank, s) for s in range(self.cfg.num_servers)]}
        return {"worker_keys": [self._pair(w, node.rank) for w in range(self.cfg.num_workers)],
                "server_key": self._server_key, "reader_key": self._reader_key(node.rank)}

    def _sealed(self, node: _Node, keys: dict[str, Any]) -> dict[str, Any]:
        """Key material for ``node`` as it may cross the link: sealed (never in clear) when
        the job has a secret."""
        if not node.seal:
            return keys
        node.sealed += 1
        return {"sealed": seal(node.seal, node.sealed, keys)}

    @staticmethod
    def _kept(body: dict[str, Any]) -> dict[str, Any]:
        return {k: body[k] for k in ("role", "host", "pid", "endpoints", "mode") if k in body}

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
        self._admitted = True
        servers = sorted(self._members("server"), key=lambda n: n.rank)
        workers = sorted(self._members("worker"), key=lambda n: n.rank)
        modes = {str(n.body.get("mode", "sync")) for n in workers}
        if len(modes) > 1:
            self._refuse_all(self._mixed_modes(workers))
            return
        self._mode = modes.pop()
        self._join_status("joined")   # before any ADMIT (PSKV_JOIN_STATUS)
        now = time.monotonic()
        for node in self._nodes.values():
            node.last_seen = now
            self._send(node.ident, Command.ADMIT, node.hello_ts, self._admission(node))
        ns, nw = len(servers), self.cfg.num_workers
        log.info("scheduler: %d server%s and %d worker%s admitted", ns, "s"[:ns != 1], nw,
                 "s"[:nw != 1])

    def _admission(self, node: _Node, rejoin: bool = False) -> dict[str, Any]:
        """The ADMIT body for ``node``: its rank, the server table, its key(s)."""
        servers = sorted(self._members("server"), key=lambda n: n.rank)
        body: dict[str, Any] = {
            "role": node.role, "rank": node.rank,
            "servers": [n.body.get("endpoints", {}) for n in servers],
            "num_workers": self.cfg.num_workers, "num_servers": self.cfg.num_servers,
            "job": self.job, "mode": self._mode}
        # the pair keys: a worker proves its rank to a server with them, and a server its
        # rank to a worker, so holding the cluster secret is not enough to speak as
        # another node
        body.update(self._sealed(node, self._keys_of(node)))
        if node.role == "worker":
            body["hosts"] = list(self._hosts)
        if rejoin:
            body["rejoin"] = True
        return body

    def _settle_claims(self) -> None:
        """Let each waiting restart take its rank once the holder is dead; refuse those
        whose holder stays alive (someone claiming a live rank) or was taken already.

        Dead means what it means everywhere else (``tick``): a peer's connection to it
        broke and no GOODBYE came within :data:`LOST_GRACE`, or it sent no heartbeat for
        ``PSKV_HEARTBEAT_TIMEOUT``. A node that is merely quiet for a while (a GC pause,
        swap) keeps its rank: a claim waits at most as long as that rule can take."""
        now = time.monotonic()
        wait = max(0.8 * self.cfg.handshake_timeout,
                   self.cfg.heartbeat_timeout + LOST_GRACE + 2 * self.cfg.heartbeat_interval)
        for ident, (old, ts, body, since) in list(self._claims.items()):
            why = None
            if self._nodes.get(old.ident) is not old:
                why = f"{old.role} {old.rank} rejoined already"
            elif old.state == "alive" and now - since > wait:
                why = (f"{old.role} {old.rank} is alive: a restarted node takes a rank only "
                       "once the node that held it is found dead")
            elif old.state == "alive":
                self.loop.hold(ident)       # still undecided: not a handshake that stalled
                continue
            del self._claims[ident]
            if why is None:
                self._rejoin(old, ident, ts, body)
                continue
            self.loop.refusals.refused(getattr(ident, "address", "") or ident.peer, why)
            self._send(ident, Command.ERROR, ts, error_body(
                ClusterError(f"the scheduler refused this node: {why}")))

    def _rejoin(self, old: _Node, ident: Connection, ts: int, body: dict[str, Any]) -> None:
        """A node restarted by pskv-launch --max-restarts takes the rank of ``old`` (dead,
        or about to be found dead: a restart can say HELLO before the death is noticed);
        every other node is told where it is now. Only a node that proved the cluster secret
        for that role and rank gets here (the Verifier checked its HELLO)."""
        del self._nodes[old.ident]
        for bar in self._barriers.values():
            for k, (who, _bts, _p) in list(bar.waiting.items()):
                if who is old.ident:
                    del bar.waiting[k]
        node = _Node(ident, old.role, old.rank, self._kept(body), time.monotonic(),
                     hello_ts=ts, claimed=old.rank, seal=self._seal_key(body))
        if node.role == "server":
            self._epochs[node.rank] += 1    # new pair keys: the old incarnation's are void
        self._nodes[ident] = node
        if old.retired:     # added into its removed slot: its shard is handed back to it
            log.warning("scheduler: server %d added (into its removed slot); server %d "
                        "hands its shard back once it has a copy", node.rank,
                        self._hosts[node.rank])
        else:
            log.warning("scheduler: %s %d rejoined (restarted)", node.role, node.rank)
        if self.metrics is not None and not old.retired:
            self.metrics.restarts.inc()
        self.loop.admit_now(ident, node)
        self._send(ident, Command.ADMIT, ts, self._admission(node, rejoin=True))
        for other in self._live():
            if other is not node:
                told: dict[str, Any] = {"role": node.role, "rank": node.rank,
                                        "endpoints": node.body.get("endpoints", {})}
                if node.role == "server" and other.role == "worker":
                    told.update(self._sealed(other, {"key": self._pair(other.rank,
                                                                        node.rank)}))
                if old.retired:
                    told["added"] = True
                    if other.role == "server" and other.rank == self._hosts[node.rank]:
                        told["handback"] = True
                self._send(other.ident, Command.NODE_REJOINED, 0, told)

    @staticmethod
    def _mixed_modes(workers: list[_Node]) -> str:
        said = ", ".join(f"worker {n.rank} dist_{n.body.get('mode', 'sync')}" for n in workers)
        return (f"the workers created different store types ({said}): a job is all "
                "dist_sync or all dist_async. Create the same store type on every worker.")

    def _refuse_all(self, msg: str) -> None:
        """The cluster cannot run: tell every node why, and exit 1."""
        log.error("scheduler: %s", msg)
        for node in self._nodes.values():
            node.state = "dead"
            self._send(node.ident, Command.ERROR, node.hello_ts,
                       error_body(ClusterError(f"the scheduler refused this job: {msg}")))
        self._ending = time.monotonic() + 1.0     # time for the replies to leave

    def _barrier(self, node: _Node, ts: int, body: dict[str, Any]) -> None:
        group = body["group"]
        if group == "join" and node.role != "worker":
            raise ProtocolError(f"{node.role} {node.rank} sent a join: only workers join")
        bar = self._barriers.setdefault(group, _Barrier())
        if not bar.waiting:
            bar.started = time.monotonic()
        key = node.rank if group != "all" else (node.rank if node.role == "worker"
                                                 else -1 - node.rank)
        payload = body.get("payload")
        if group == "join":
            # kv.join: from now on this worker counts as pushing zeros (the servers close
            # its rounds without it); each member learns who joined last
            pushed = payload.get("pushed") if isinstance(payload, dict) else None
            payload = {"order": len(bar.waiting),
                       "pushed": pushed if isinstance(pushed, dict) else {}}
            if not node.joined:
                node.joined = True
                self._tell_left(node, joined=True)
        bar.waiting[key] = (node.ident, ts, payload)
        if group != "server":
            for other in self._members("worker"):
                if other.state == "closed" and other.rank not in bar.waiting and not (
                        group == "join" and other.joined):
                    self._fail_barrier(group, bar, other)   # it can never come
                    return
        size = (self.cfg.num_workers if group in ("worker", "join") else self.cfg.num_servers
                if group == "server" else self.cfg.num_workers + self.cfg.num_servers)
        if len(bar.waiting) == size:
            payloads = {str(k): v[2] for k, v in bar.waiting.items()}
            if group == "join":
                # every worker joined: the next rounds count every worker again (the
                # workers tell the servers: Op.JOINED, then a barrier)
                self._join_epoch += 1
                for worker in self._members("worker"):
                    worker.joined = False
                payloads = {k: {**v, "epoch": self._join_epoch} for k, v in payloads.items()}
            for ident, bts, _ in bar.waiting.values():
                self._send(ident, Command.BARRIER_DONE, bts, {"payloads": payloads})
            del self._barriers[group]
            if self.metrics is not None:
                self.metrics.barriers.inc()

    def _expire_barriers(self, now: float) -> None:
        """A barrier that waited almost ``PSKV_REQUEST_TIMEOUT`` (so before its first member
        gives up by itself) fails for every member, naming who has not reached it."""
        limit = self.cfg.request_timeout - min(5.0, 0.25 * self.cfg.request_timeout)
        for group, bar in list(self._barriers.items()):
            # a join waits while the others train on (each kv.join has its own timeout)
            if not bar.waiting or now - bar.started <= limit or group == "join":
                continue
            expected = ([("worker", r) for r in range(self.cfg.num_workers)]
                        if group in ("worker", "all") else []) + \
                ([("server", r) for r in range(self.cfg.num_servers)]
                 if group in ("server", "all") else [])
            keys = {r if role == "worker" or group == "server" else -1 - r: (role, r)
                    for role, r in expected}
            missing = [f"{role} {r}" for k, (role, r) in keys.items() if k not in bar.waiting]
            there = [f"{role} {r}" for k, (role, r) in keys.items() if k in bar.waiting]
            err = ClusterTimeoutError(
                f"a barrier of the {group}s waited {now - bar.started:.1f} s for "
                f"{', '.join(missing)}, which {'has' if len(missing) == 1 else 'have'} not "
                f"reached it ({', '.join(there)} did): stuck, slow, or making other calls. "
                "Check that every worker makes the same calls, or raise "
                "PSKV_REQUEST_TIMEOUT.")
            log.error("scheduler: %s", err)
            for ident, bts, _ in bar.waiting.values():
                self._send(ident, Command.ERROR, bts, error_body(err))
            del self._barriers[group]

    def _goodbye(self, node: _Node) -> None:
        if node.state == "alive":
            node.state = "closed"
            if self._admitted:
                # joined in the epoch under way: it counts as zeros until every worker
                # joined, and is gone from the next epoch on (the servers keep both)
                self._tell_left(node, joined=False)
                if not node.joined:
                    self._fail_barriers_without(node)
        self._maybe_shutdown()

    def _tell_left(self, node: _Node, joined: bool) -> None:
        """Tell every other live node that worker ``node`` joined or closed (WORKER_LEFT):
        the servers close its rounds without it, or fail those that need it."""
        for other in self._live():
            if other is not node:
                self._send(other.ident, Command.WORKER_LEFT, 0,
                           {"rank": node.rank, "joined": joined, "epoch": self._join_epoch})

    def _fail_barriers_without(self, node: _Node) -> None:
        """Worker ``node`` closed its store: a barrier (or join) it has not reached can
        never complete; each member hears why now, not at the barrier's deadline."""
        for group, bar in list(self._barriers.items()):
            if group != "server" and node.rank not in bar.waiting:
                self._fail_barrier(group, bar, node)

    def _fail_barrier(self, group: str, bar: _Barrier, node: _Node) -> None:
        """Fail barrier ``group``: worker ``node`` closed its store before reaching it."""
        what = "kv.join()" if group == "join" else "a barrier"
        there = [k for k in sorted(bar.waiting) if k >= 0]
        err = WorkerClosedError(
            f"worker {node.rank} closed its store without reaching {what} that worker"
            f"{'s' if len(there) > 1 else ''} {', '.join(map(str, there))} "
            f"{'wait' if len(there) > 1 else 'waits'} at. With uneven data, call kv.join() "
            "on each worker that runs out of batches, and close only after it returns.")
        log.error("scheduler: %s", err)
        for ident, bts, _ in bar.waiting.values():
            self._send(ident, Command.ERROR, bts, error_body(err))
        del self._barriers[group]

    def _maybe_shutdown(self) -> None:
        workers = self._members("worker")
        if self._admitted and workers and all(n.state != "alive" for n in workers) \
                and not self._shutdown_sent:
            self._shutdown_sent = time.monotonic()
            for n in self._members("server"):
                if n.state == "alive":
                    self._send(n.ident, Command.SHUTDOWN)

    def _fail(self, node: _Node, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.failed.inc()
        if node.role == "server" and self.cfg.replicas and not node.dead_since and not any(
                n.role == "server" and n.state == "dead" and n is not node
                for n in self._members()):
            # its backup takes its shard over: the job goes on (docs/durability.md)
            # the one WARNING of a handled failover (the nodes log theirs at INFO)
            log.warning("scheduler: server %d %s; its backup takes over its shard, and the "
                        "shards it backed up have no backup until it is back", node.rank,
                        reason)
            for other in self._live():
                if other is not node:
                    self._send(other.ident, Command.NODE_FAILED, 0,
                               {"role": "server", "rank": node.rank, "failover": True,
                                "msg": f"server {node.rank} {reason}"})
            node.state = "dead"
            # the workers move its shards by the same rule (failover.py); a worker
            # restarted later learns the result at admission
            self._hosts = [backup_of(shard, host, len(self._hosts)) if host == node.rank
                           else host for shard, host in enumerate(self._hosts)]
            if self.cfg.max_restarts:
                node.dead_since = time.monotonic()
            return
        if self.cfg.max_restarts and not node.dead_since:
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
            body = meta.body if isinstance(meta.body, dict) else {}
            port, host = body.get("metrics"), body.get("metrics_host")
            if type(port) is int and 0 < port < 65536:     # anything else: ignored
                node.metrics_port = port
                node.metrics_host = host if isinstance(host, str) and len(host) < 256 else ""
            if node.role == "server" and "last" in body:
                flagged = self.stragglers.add(parse_beat(body["last"], self.cfg.num_workers))
                if flagged and self.metrics is not None:
                    self.metrics.stragglers.inc(len(flagged))
        elif meta.cmd == Command.BARRIER:
            self._barrier(node, meta.ts, meta.body)
        elif meta.cmd == Command.GOODBYE:
            if node.role == "server" and isinstance(meta.body, dict) and \
                    meta.body.get("retire") is True:
                self._retire(node)
            elif node.role == "server":
                node.state = "closed"
            else:
                self._goodbye(node)
        elif meta.cmd == Command.SHARD_MOVED and node.role == "server":
            copy = meta.body.get("copy")
            self._shard_moved(node, meta.body["shard"], meta.body["host"],
                              copy if isinstance(copy, str) and len(copy) <= 64 else "")
        elif meta.cmd == Command.PEER_LOST:
            self._peer_lost(node, meta.body)
        else:
            raise ProtocolError(f"the scheduler does not take {meta.cmd.name}")

    def _retire(self, node: _Node) -> None:
        """Server ``node`` was removed from the running job (pskv-launch --remove-server)
        after its backup had every change: its shard moves to the backup at once (no
        grace, no heartbeat timeout), and its slot waits, without a deadline, for a server
        added into it."""
        if node.state != "alive" or not self._admitted:
            return
        self._fail(node, "was removed from the job (pskv-launch --remove-server)")
        if node.state == "dead" and not self._failed:
            node.retired, node.dead_since = True, 0.0
            log.warning("scheduler: server %d removed; its slot is free for "
                        "pskv-launch --add-server %d", node.rank, node.rank)

    def _shard_moved(self, node: _Node, shard: int, host: int, copy: str) -> None:
        """Server ``node`` handed ``shard`` back to ``host``, the server added into that
        shard's slot (it has every change): every other node hears it. Anything else is
        refused: a server moves only a shard it serves, to the slot it belongs to."""
        target = next((n for n in self._live() if n.role == "server" and n.rank == host),
                      None)
        if not (shard < len(self._hosts) and self._hosts[shard] == node.rank
                and host == shard and target is not None):
            log.error("scheduler: server %d says it moved shard %d to server %d, which is "
                      "not a handback this scheduler asked for; ignored", node.rank, shard,
                      host)
            return
        self._hosts[shard] = host
        log.warning("scheduler: shard %d moved from server %d to server %d", shard,
                    node.rank, host)
        for other in self._live():
            if other is not node:
                self._send(other.ident, Command.SHARD_MOVED, 0, {
                    "shard": shard, "host": host, **({"copy": copy} if other is target
                                                     else {})})

    def _peer_lost(self, reporter: _Node, body: dict[str, Any]) -> None:
        """``reporter``'s connection to a peer broke: unless that peer says GOODBYE within
        the grace period (its goodbye may be on its way), it is reported failed. A report
        that names where the peer was, when that is not where the live node with its rank
        is, is about an earlier life of that rank (restarted since): ignored."""
        for node in self._live():
            if node.role == body["role"] and node.rank == body["rank"] and not node.lost:
                if "endpoints" in body and body["endpoints"] != node.body.get("endpoints"):
                    log.info("scheduler: %s %d was restarted since %s %d lost its "
                             "connection to it; the report is about its earlier process",
                             node.role, node.rank, reporter.role, reporter.rank)
                    continue
                node.lost = time.monotonic()
                node.lost_by = f"{reporter.role} {reporter.rank}"

    def dropped(self, conn: Connection) -> None:
        """Nothing to do: a node that is gone stops heartbeating."""

    def tick(self) -> None:
        """Admission deadline, heartbeats, the end of the job (sets the exit status)."""
        now = time.monotonic()
        if self._ending:
            if now > self._ending:
                self._code = 1
            return
        if not self._admitted:
            if now - self._start > self.cfg.connect_timeout:
                raise ClusterTimeoutError(
                    f"the scheduler waited {self.cfg.connect_timeout:g} s but only "
                    f"{self._counts['server']}/{self.cfg.num_servers} servers and "
                    f"{self._counts['worker']}/{self.cfg.num_workers} workers arrived. "
                    "Start every node, or raise PSKV_CONNECT_TIMEOUT.")
            return
        for node in self._live():
            if node.lost and now - node.lost > LOST_GRACE:
                # the subject is the node that went away; lost_by only noticed it
                self._fail(node, f"is gone: {node.lost_by}'s connection to it broke (its "
                                 "process died or its host went down)")
            elif now - node.last_seen > self.cfg.heartbeat_timeout:
                if self.metrics is not None:
                    self.metrics.missed.inc()
                self._fail(node, f"sent no heartbeat for {now - node.last_seen:.1f} s "
                                 "(it died or hangs)")
        if self._claims:
            self._settle_claims()
        self._expire_barriers(now)
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
        self.metrics = start_metrics(self.cfg, lambda: SchedulerMetrics(
            self.job, lambda role: sum(1 for n in list(self._nodes.values())
                                       if n.role == role and n.state == "alive"),
            self._listing))
        try:
            self.loop.run(lambda: self._stop.is_set() or self._code is not None,
                          int(tick * 1000), tick)
            return self._code if self._code is not None else 1 if self._failed else 0
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.loop.close()
            self._zctx.close()
            self._remove_dead_sockets()

    def _listing(self) -> list[tuple[str, int, str, str, int]]:
        """Each admitted node's role, rank, state, host and metrics port (for pskv-top;
        read by the metrics thread)."""
        return [(n.role, n.rank, n.state, n.metrics_host, n.metrics_port)
                for n in list(self._nodes.values()) if n.rank >= 0]

    def _remove_dead_sockets(self) -> None:
        """Remove the Unix socket files of this host's servers that died (a SIGKILLed
        process cannot remove its own); only files pskv names in the temp directory."""
        me = host_id()
        tmp = os.path.realpath(tempfile.gettempdir())
        for node in self._members("server"):
            path = node.body.get("endpoints", {}).get("uds")
            if node.state != "dead" or node.body.get("endpoints", {}).get("host") != me \
                    or not isinstance(path, str):
                continue
            real = os.path.realpath(path)
            if os.path.dirname(real) != tmp or not os.path.basename(real).startswith(
                    "pskv-server-") or not real.endswith(".sock"):
                continue
            try:
                if stat.S_ISSOCK(os.lstat(real).st_mode):
                    os.unlink(real)
            except OSError:
                pass


def scheduler_curve(cfg: ClusterConfig) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of the scheduler's port under PSKV_ENCRYPT=1."""
    assert cfg.secret is not None
    return curve_keys(cfg.secret, "scheduler")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
