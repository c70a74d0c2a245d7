"""KVServer: one parameter server: an Engine as the request handler of a ServeLoop.

The server listens (ZeroMQ ROUTER, a TCP and a Unix stream listener) through
:class:`.._ps.serve.ServeLoop`, which admits workers and frames messages; this module turns
each admitted worker's request into calls of its :class:`pskv.kvstore.engine._core.Engine` and the engine's
answers into replies. Invariants: a server never dies of a worker's bad input (every request
is validated whole before any change, and a bad one gets an ERROR reply naming the key and
what was wrong); pushes are not acknowledged one by one, a FLUSH is answered once every
earlier push of that worker is applied; nothing waits forever.

Over 500 lines because KVServer is the request dispatcher of every command
(docs/architecture.md, one handler table); takeovers, tables and staleness already live in
their own modules.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq

from ...errors import (CheckpointError, ClusterError, KVStoreError, NodeFailedError,
                       ProtocolError, ShapeMismatchError, UnsupportedError)
from ..._ps.auth import Verifier, server_proof
from ..._ps.bounds import check_key_count, check_reply, check_rows
from ..._ps.config import ClusterConfig, advertised_host
from ..._ps.observe.metrics import start as start_metrics
from ..._ps.observe.series import ServerMetrics
from ..._ps.message import Command, Meta, kind_arrays, short
from ..._ps.ops import Op, ReplOp, parse
from ..._ps.postoffice import Postoffice
from ..._ps.serve import ServeLoop
from ..._ps.staleness import ClockGate
from ..._ps.observe.stragglers import OpenRound, StragglerWatch
from ..._ps.stream import StreamListener, ipc_path
from ..._ps.sealed import SealedConn
from ..._ps.tls import server_context
from ..._ps.validate import READER
from ..._ps.transport import Connection, data_curve
from ..._ps.zeromq import ZmqContext, curve_server
from ..engine._core import Engine, EngineEvents, Ticket
from ..durable._snapshots import Snapshots, load_shard
from .._snapshot import checkpoint_path
from ._observed import server_state
from ..durable._backups import Backups
from ._staleness import cmd_clock, park_read
from ._moves import Moves
from ..engine._entries import init_entries
from ._tables import (cmd_changes, cmd_explain, cmd_hot_ids, cmd_lookup, cmd_table_stats,
                      stats_reply)
from ..durable._shards import HandedBack, TakeoverPending, Shard, Shards
from ..durable._takeover import Takeovers

__all__ = ["KVServer"]

#: the commands a reader of the change stream (``pskv.stream``) may send a server
READER_OPS = frozenset({Op.CHANGES})
#: seconds a server told to shut down goes on answering stream readers that read within
#: that long and have not read every table to its last version (E10)
STREAM_DRAIN = 5.0
log = logging.getLogger(__name__)


class _ServerEvents(EngineEvents):
    """A server's engines' one listener: answers go to the workers, closed rounds to the
    straggler watch and metrics, update times to metrics while they are on."""

    watches_rounds = True

    def __init__(self, server: "KVServer") -> None:
        self.server = server

    @property
    def times_updates(self) -> bool:  # type: ignore[override]
        return self.server.metrics is not None

    def done(self, engine: Engine, ticket: Ticket) -> None:
        self.server._answer(ticket, engine)

    def failed(self, engine: Engine, ticket: Ticket, err: KVStoreError) -> None:
        self.server._answer_error(ticket, err)

    def round_closed(self, engine: Engine, key: Any, worker: int, waited: float) -> None:
        self.server._round_closed(key, worker, waited, engine.num_workers)

    def applied_in(self, seconds: float) -> None:
        metrics = self.server.metrics
        if metrics is not None:
            metrics.applied_in(seconds)


class KVServer:
    """A parameter server. ``run()`` returns 0 after the scheduler's SHUTDOWN.

    Parameters
    ----------
    cfg : ClusterConfig
    stop : threading.Event, optional
        Set it to stop the server early (tests).
    engine_class : type, default Engine
        The request handler's engine (the benchmarks pass one that does no arithmetic).
    zmq_context : zmq.Context, optional
        The ZeroMQ context of an in-process cluster (``cfg.transport == 'inproc'``).
    """

    def __init__(self, cfg: ClusterConfig, stop: threading.Event | None = None,
                 engine_class: type[Engine] = Engine,
                 zmq_context: zmq.Context[Any] | None = None) -> None:
        self.cfg = cfg
        self._stop = stop or threading.Event()
        #: when a server told to shut down stops waiting for stream readers (``_draining``)
        self._drain_until: float | None = None
        #: what every engine of this server tells it (answers, rounds closed, update times)
        self._events = _ServerEvents(self)
        #: Prometheus series when PSKV_METRICS_PORT asks for them (``run`` starts them)
        self.metrics: ServerMetrics | None = None
        self._zctx = ZmqContext(zmq_context)
        #: what closing takes, last made first closed (each registered as it is made)
        self._closing = contextlib.ExitStack()
        self._closing.callback(self._zctx.close)
        self._listeners: list[StreamListener] = []
        #: the listeners' owner: the serving loop once it is made
        self._io: Any = None
        self._closing.callback(self._close_io)
        router: zmq.Socket[Any] | None = None
        try:
            if cfg.transport in ("zmq", "inproc"):
                # a ZeroMQ data port only where workers use it: the stream listeners check
                # a stranger's sizes before reading, libzmq only per frame
                router = self._zctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.RCVHWM, 0)
                router.setsockopt(zmq.SNDHWM, 0)
                router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
                router.setsockopt(zmq.HANDSHAKE_IVL, int(cfg.handshake_timeout * 1000))
                if cfg.encrypt and cfg.transport == "zmq":
                    curve_server(router, data_curve(cfg)[1])
            if cfg.transport == "inproc":     # a thread of an in-process cluster
                assert router is not None
                endpoints = {"zmq": f"inproc://pskv-server-{id(self):x}"}
                router.bind(endpoints["zmq"])
            else:
                endpoints = self._bind(cfg, router)
            self._engine_class = engine_class
            #: copies of other servers' shards (PSKV_REPLICAS=1), updated on their own thread
            self.backups = Backups(cfg, self._new_engine, self._zctx) if cfg.replicas else None
            if self.backups is not None:
                endpoints.update(self.backups.endpoints)
            try:
                self.po = Postoffice(cfg, self._zctx, endpoints=endpoints,
                                     beat_extra=self._beat_extra)
            except BaseException:
                if self.backups is not None:
                    self.backups.close()
                raise
            self._closing.callback(self.po.close)
            if self.backups is not None:    # (again before the loop, once there is one)
                self._closing.callback(self.backups.close)
            self._endpoints = endpoints
        except BaseException:
            self._closing.close()
            raise
        if cfg.encrypt:        # every worker link sealed under its pair key (sealed.py)
            for lis in self._listeners:
                lis.make_conn = functools.partial(SealedConn, key_for=self._key_for)
        self._rank_of: dict[Connection, int] = {}
        self._connected = 0                       # worker admissions so far (log lines)
        self._open: dict[Any, int] = {}           # per worker: pushes not yet applied
        #: the membership's ``left`` last told to the engines (_workers_left)
        self._left: Any = None
        #: the join epoch the workers said began (Op.JOINED): every worker joined before
        self._join_epoch = 0
        #: per worker: FLUSH requests waiting, with the shard each names
        self._flushes: dict[Any, list[tuple[int, int]]] = {}
        self._router = router
        #: shards handed back, and this server's removal (pskv-launch --remove-server)
        self.moves = Moves(self)
        # the serving objects (the loop, the shards, the staleness gate, the stragglers'
        # watch, the checkpoints, the takeovers) are made by _build_serving, from the
        # admission

    def _build_serving(self) -> None:
        """Admitted: make what serves the workers, from what the admission said (rank,
        job, workers, mode), each registered for closing as it is made."""
        po, cfg = self.po, self.cfg
        name = f"server {po.rank}"
        #: names rounds that wait and workers that are often last (PSKV_STRAGGLER_SECONDS)
        self.stragglers = StragglerWatch(cfg.straggler_seconds, name)
        #: the global staleness bound: workers' clocks and the reads they hold back
        self.gate = ClockGate(po.num_workers, name)
        self.metrics = start_metrics(cfg, lambda: ServerMetrics(
            po.rank, po.job, lambda: server_state(self.shards), cfg.metrics_top_keys,
            cfg.metrics_keys), po)
        self._verifier = Verifier("server", po.job, self._key_for)
        self.loop = ServeLoop(name, self, self._verifier, cfg.request_timeout, self._router,
                              self._listeners, handshake_timeout=cfg.handshake_timeout,
                              max_unadmitted=cfg.max_unadmitted,
                              max_message_bytes=cfg.max_message_bytes)
        self._io = self.loop
        # closed before the scheduler link: the backups, then the serving loop
        self._closing.callback(self.loop.close)
        if self.backups is not None:
            self._closing.callback(self.backups.close)
        self.snapshots = Snapshots(cfg, self._send, self._error, written=None
                                   if self.metrics is None else self.metrics.checkpoint.observe)
        #: the shards this server serves (its own; one whose primary died, as its backup)
        self.shards = Shards(cfg, self._zctx, po, self.snapshots, self.backups,
                             self._new_engine())
        self._closing.callback(self.shards.close)
        self._closing.callback(self.snapshots.close)      # closed first: its writers end
        #: requests waiting for the scheduler to report their shard's server dead, and the
        #: membership news; a broken link is reported within moments (the scheduler's
        #: grace, then its word), so a request waits that long at most
        self.takeovers = Takeovers(self.shards, po.next_event,
                                   min(2.0 + 3 * cfg.heartbeat_interval,
                                       cfg.request_timeout / 2), self._rerun)
        if self.metrics is not None:
            self._closing.callback(self.metrics.close)        # closed first

    def _new_engine(self) -> Engine:
        """An engine whose answers go to this server's peers, for the workers and the mode
        admitted (a backup's copy, made once this server is admitted, too)."""
        return self._engine_class(self.po.num_workers, self.po.mode != "async",
                                  self._events)

    def _beat_extra(self) -> dict[str, Any]:
        """For the scheduler's straggler view: who closed this server's sync rounds since
        the last heartbeat (the heartbeat thread calls this; nothing before admission)."""
        watch = getattr(self, "stragglers", None)
        last = None if watch is None else watch.take_beat()
        return {} if last is None else {"last": last}

    def _round_closed(self, key: Any, worker: int, waited: float, num_workers: int) -> None:
        """A sync round closed by ``worker``'s push: stragglers and metrics."""
        flagged = self.stragglers.round_closed(key, worker, waited, num_workers)
        if self.metrics is not None:
            self.metrics.round_closed(worker, waited)
            if flagged is not None:
                self.metrics.stragglers.inc()

    def _bind(self, cfg: ClusterConfig, router: zmq.Socket[Any] | None) -> dict[str, str]:
        """Listen on TCP, (``auto``, ``ipc``) a Unix socket and (``zmq``) ZeroMQ; their
        endpoints.

        Workers on other hosts connect over TCP (pskv's framing), same-host workers over a
        Unix socket only this user can open, and with ``zmq`` over ZeroMQ.
        """
        host = advertised_host(cfg.node_host, cfg.root_uri)
        tls = server_context(*cfg.tls) if cfg.tls is not None else None
        tcp = StreamListener(host=cfg.node_host, advertise=host, tls=tls)
        self._listeners.append(tcp)
        endpoints = {"tcp": tcp.endpoint}
        if router is not None:
            port = router.bind_to_random_port(f"tcp://{cfg.node_host}")
            endpoints["zmq"] = f"tcp://{host}:{port}"
        if cfg.transport in ("auto", "ipc"):
            uds = StreamListener(path=ipc_path("server"))
            self._listeners.append(uds)
            endpoints["uds"] = uds.endpoint
        return endpoints

    # ---- the Handler of the ServeLoop ----------------------------------------------------
    def _key_for(self, role: str, rank: int | None) -> bytes:
        """The key the worker of ``rank`` proves itself with (the scheduler's assignment);
        a reader of the change stream (no rank) proves this server's reader key."""
        if role == READER and rank in (None, -1) and self.po.reader_key:
            return self.po.reader_key
        if role != "worker" or rank is None:
            raise ProtocolError("only a worker that names its rank may connect to a server")
        if not 0 <= rank < len(self.po.worker_keys):
            raise ProtocolError(f"rank {rank} is not a worker rank of this job (0 to "
                                f"{len(self.po.worker_keys) - 1})")
        return self.po.worker_keys[rank]

    def admit(self, conn: Connection, meta: Meta) -> int | str:
        """A worker's HELLO whose proof checked: admitted under the rank it proved; a
        reader's: admitted as :data:`READER`, which may read the change stream only."""
        nonce, wnonce = meta.body.get("nonce"), meta.body.get("wnonce")
        if meta.body.get("role") == READER:
            reply = {}
            if isinstance(nonce, str) and isinstance(wnonce, str):
                reply["proof"] = server_proof(self.po.reader_key, self.po.job, self.po.rank,
                                              -1, nonce, wnonce)
            self._send(conn, Command.ACK, meta.ts, reply)
            return READER
        rank = int(meta.body["rank"])
        self._rank_of[conn] = rank
        self._connected += 1
        # one line when every worker is in (then one per reconnection), not one per worker
        if self._connected == self.po.num_workers:
            log.info("%s: all %d workers connected", self.loop.name, self.po.num_workers)
        elif self._connected > self.po.num_workers:
            log.info("%s: worker %d connected again", self.loop.name, rank)
        else:
            log.debug("%s: worker %d connected", self.loop.name, rank)
        # what of this worker's pushes is applied here: a restarted worker skips those; and
        # this server's proof of its own rank, under the key only it and that worker hold
        reply: dict[str, Any] = {"applied": self.shards.applied_by(rank)}
        if isinstance(nonce, str) and isinstance(wnonce, str):
            reply["proof"] = server_proof(self._key_for("worker", rank), self.po.job,
                                          self.po.rank, rank, nonce, wnonce)
        self._send(conn, Command.ACK, meta.ts, reply)
        return rank

    def handle(self, conn: Connection, worker: Any, meta: Meta,
               arrays: list[np.ndarray]) -> None:
        """One admitted worker's request."""
        handler = self._handlers.get(meta.cmd)
        if handler is None:
            raise ProtocolError(f"server does not take {meta.cmd.name}")
        if worker == READER and (meta.cmd != Command.COMMAND or parse(meta.body) not in
                                 READER_OPS):
            raise ProtocolError(f"a reader of the change stream may send "
                                f"{sorted(op.value for op in READER_OPS)} commands only, not "
                                f"{meta.cmd.name} "
                                f"{short(meta.body.get('op') if isinstance(meta.body, dict) else None)}")
        if self.metrics is not None:
            self.metrics.request(meta.cmd, arrays)
        check_key_count(len(meta.keys), self.cfg.max_keys_per_message, meta.cmd.name,
                        self._where())
        try:
            self._serve(conn, worker, meta, arrays, self.takeovers.deadline())
        finally:    # its rounds to the backups as one message, before their arrays change
            self.shards.flush()

    def _serve(self, conn: Connection, worker: Any, meta: Meta, arrays: list[np.ndarray],
               deadline: float, last: bool = False) -> None:
        """Hand a checked request to its shard's handler; one for a shard whose copy is
        held here, while its server is not known dead, waits until ``deadline`` (not when
        ``last``: then it is refused)."""
        index = meta.body.get("shard") if isinstance(meta.body, dict) else None
        try:
            shard = self.shards.get(index)
        except HandedBack as moved:     # its worker sends it to the new server (moves)
            if not last and meta.cmd == Command.COMMAND and parse(meta.body) is Op.APPLIED:
                # a worker failing over to this server, the backup of the server the shard
                # was handed to: that server died, and the scheduler's word follows
                self.takeovers.park(deadline, (conn, worker, meta, arrays))
                return
            log.debug("%s: %s from worker %s for shard %d, handed to server %d: not "
                      "answered here", self._where(), meta.cmd.name, worker, moved.shard,
                      moved.host)
            return
        except TakeoverPending:
            if last:
                raise
            # its server's death is not known here yet: wait for the scheduler's word
            self.takeovers.park(deadline, (conn, worker, meta, arrays))
            return
        if self.gate.bound is not None and park_read(self.gate, shard, conn, worker, meta,
                                                     arrays, index):
            return
        self._handlers[meta.cmd](self, shard, conn, worker, meta.ts, meta.keys, meta.body,
                                 arrays)

    def _rerun(self, deadline: float, request: Any, last: bool) -> None:
        """Serve a request ``takeovers`` parked, again (``last``: refuse it if its shard
        still cannot be taken over)."""
        conn, worker, meta, arrays = request
        self._guarded(conn, worker, meta, functools.partial(
            self._serve, conn, worker, meta, arrays, deadline, last=last))

    def _guarded(self, conn: Any, worker: Any, meta: Meta, run: Callable[[], None]) -> None:
        """Run a request held back earlier; what it raises goes to its worker (a node never
        dies of a request)."""
        try:
            try:
                run()
            finally:
                self.shards.flush()
        except KVStoreError as err:
            self._error(conn, meta.ts, err)
        except Exception as err:  # the peer hears why
            log.exception("%s: %s from worker %d failed", self._where(), meta.cmd.name,
                          worker)
            self._error(conn, meta.ts, ClusterError(f"{type(err).__name__}: {err}"))

    # ---- the global staleness bound (_ps/staleness.py, _server_staleness.py) ------------
    def _resume(self, items: list[Any]) -> None:
        """Run reads the staleness bound held back, now that it lets them."""
        for conn, worker, meta, arrays, index in items:
            self._guarded(conn, worker, meta, functools.partial(
                self._resume_one, conn, worker, meta, arrays, index))

    def _resume_one(self, conn: Any, worker: Any, meta: Meta, arrays: list[np.ndarray],
                    index: Any) -> None:
        self._handlers[meta.cmd](self, self.shards.get(index), conn, worker, meta.ts,
                                 meta.keys, meta.body, arrays)

    def _fail_parked(self, failed: list[tuple[Any, KVStoreError]]) -> None:
        for (conn, _worker, meta, _arrays, _index), err in failed:
            self._error(conn, meta.ts, err)

    def tick(self) -> None:
        """Name sync rounds that wait (stragglers); fail those that waited too long."""
        if self.takeovers:
            self.takeovers.retry(expire=True)
        rounds: list[OpenRound] = []
        self.shards.each_engine(lambda engine: rounds.extend(
            OpenRound(*r, engine.num_workers) for r in engine.open_rounds()))
        named = self.stragglers.check(rounds)
        self.stragglers.summary()
        if named and self.metrics is not None:
            self.metrics.stragglers.inc(len(named))
        self.shards.each_engine(lambda engine: engine.check_rounds(self.cfg.round_timeout))
        self._workers_left(force=True)      # a shard taken over since: told too
        if self.gate.parked:
            # below the workers' own deadline, so that the named error reaches them first
            self._fail_parked(self.gate.expired(min(self.cfg.round_timeout,
                                                    self.cfg.request_timeout / 2)))

    def _workers_left(self, force: bool = False) -> None:
        """Tell every engine which workers joined or closed (the scheduler's WORKER_LEFT,
        in the membership) and which join epoch is under way: joined ones count as pushing
        zeros, closed ones fail the rounds that need them (``Engine.worker_left``,
        ``Engine.end_join``; idempotent)."""
        m = self.po.membership
        if m is self._left and not force:
            return
        self._left = m
        self.shards.each_engine(functools.partial(Engine.end_join, epoch=self._join_epoch))
        for rank, epoch in m.joined.items():
            self.shards.each_engine(functools.partial(Engine.worker_left, worker=rank,
                                                      joined=True, epoch=epoch))
        for rank in sorted(m.closed):
            self.shards.each_engine(functools.partial(Engine.worker_left, worker=rank,
                                                      joined=False))

    def dropped(self, conn: Connection) -> None:
        """A worker's connection is gone: tell the scheduler (a worker that closed said
        GOODBYE first; one that did not is reported failed to every node)."""
        rank = self._rank_of.pop(conn, None)
        if rank is not None:
            self.po.report_lost("worker", rank)
            if not self.cfg.max_restarts:    # else its restart says its clock again
                self._fail_parked(self.gate.lost(
                    rank, f"its connection to {self._where()} closed without leaving"))

    # ---- replies -------------------------------------------------------------------------
    def _send(self, conn: Any, cmd: Command, ts: int, body: Any = None,
              arrays: list[np.ndarray] | tuple[()] = ()) -> None:
        self.shards.drain()                 # the backups have every change answered
        self.loop.send(conn, cmd, ts, body, arrays)

    def _error(self, conn: Any, ts: int, err: BaseException) -> None:
        self.shards.drain()
        self.loop.error(conn, ts, err)

    def _answer(self, ticket: Ticket, engine: Engine) -> None:
        if ticket.cmd == Command.PUSH:      # pushes are not acknowledged one by one
            self._push_done(ticket.peer)
        elif ticket.cmd is Op.TABLE_STATS:
            self._send(ticket.peer, Command.ACK, ticket.ts, stats_reply(engine, ticket))
        else:
            values = engine.values(ticket)
            if self.metrics is not None:
                self.metrics.replied(ticket.cmd, values)
            self._send(ticket.peer, Command.DATA, ticket.ts, arrays=values)

    def _answer_error(self, ticket: Ticket, err: KVStoreError) -> None:
        if not isinstance(err, HandedBack):     # else its worker sends it again (moves)
            self._error(ticket.peer, ticket.ts, err)
        if ticket.cmd == Command.PUSH:
            self._push_done(ticket.peer)

    def _push_done(self, conn: Connection) -> None:
        left = self._open.get(conn, 1) - 1
        self._open[conn] = left
        if left <= 0:
            for ts, _index in self._flushes.pop(conn, ()):
                self._send(conn, Command.ACK, ts)

    def _on_flush(self, shard: Shard, conn: Connection,
                  worker: int, ts: int, keys: tuple[int, ...], body: Any,
                  arrays: list[np.ndarray]) -> None:
        if self._open.get(conn, 0) <= 0:
            self._send(conn, Command.ACK, ts)
        else:
            self._flushes.setdefault(conn, []).append((ts, shard.index))

    # ---- request handlers --------------------------------------------------------------------
    def _where(self) -> str:
        return f"server {self.po.rank}"

    def _on_init(self, shard: Shard, conn: Connection,
                 worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray]) -> None:
        specs = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(specs, list) or len(specs) != len(keys) or len(arrays) != len(keys) \
                or not all(isinstance(spec, dict) for spec in specs):
            raise ProtocolError("INIT needs one entry spec and one array per key")
        if body.get("again"):
            # sent again after a failover: the backup may have it already (docs/durability.md)
            kept = [i for i, k in enumerate(keys) if k not in shard.engine]
            keys = tuple(keys[i] for i in kept)
            specs, arrays = [specs[i] for i in kept], [arrays[i] for i in kept]
        for k, spec, arr in zip(keys, specs, arrays):
            if tuple(spec.get("shape", ())) != arr.shape:
                raise ShapeMismatchError(f"INIT of key {spec.get('key')!r}: shape "
                                         f"{arr.shape} != declared {spec.get('shape')}")
        init_entries(shard.engine, keys, specs, arrays,      # table keys too
                     self.cfg.max_key_bytes, self._where())
        shard.forward(ReplOp.INIT, {"keys": list(keys), "entries": specs}, arrays)
        self._send(conn, Command.ACK, ts)

    def _split_push(self, shard: Shard, keys: tuple[int, ...], body: dict[str, Any],
                    arrays: list[np.ndarray]) -> list[tuple[int, str, list[np.ndarray]]]:
        """Each key's kind and arrays, every key checked against what it holds. The
        message's form (one kind letter per distinct key, arrays to match) was checked by
        ``validate.request`` before any handler ran."""
        items, pos = [], 0
        again = bool(body.get("again"))
        for k, kind in zip(keys, body["kinds"], strict=True):
            n = kind_arrays(kind)
            if again and kind == "t":
                kind = "T"          # a table push sent again (docs/embeddings.md D9)
            shard.engine.value_of(k, "push", self._where())
            part = arrays[pos:pos + n]
            shard.engine.check_push(k, kind, part, self._where())
            items.append((k, kind, part))
            pos += n
        return items

    def _on_push(self, shard: Shard, conn: Connection,
                 worker: int, ts: int, keys: tuple[int, ...], body: Any, arrays: list[np.ndarray],
                 cmd: Command = Command.PUSH) -> None:
        items = self._split_push(shard, keys, body, arrays)     # validate all before any change
        ticket = Ticket(conn, ts, cmd, keys)
        if cmd == Command.PUSH:
            self._open[conn] = self._open.get(conn, 0) + 1
        engine = shard.engine
        held = ticket if engine.sync else None        # dist_async: applied at once

        tag = body.get("step")        # a data position's step (validate: an int or none)

        def pushes() -> None:
            for k, kind, part in items:
                engine.push(k, worker, part, kind, held, tag)
        try:
            engine.request(ticket, pushes)
        except Exception as err:  # an update failed (dist_async): answered, flush not held
            self._answer_error(ticket, err if isinstance(err, KVStoreError) else
                               ClusterError(f"{type(err).__name__}: {err}"))

    def _on_pushpull(self, shard: Shard, conn: Connection,
                     worker: int, ts: int, keys: tuple[int, ...], body: Any,
                     arrays: list[np.ndarray]) -> None:
        self._on_push(shard, conn, worker, ts, keys, body, arrays, Command.PUSHPULL)

    def _on_pull(self, shard: Shard, conn: Connection,
                 worker: int, ts: int, keys: tuple[int, ...], body: Any, arrays: list[np.ndarray],
                 rows: list[np.ndarray] | None = None) -> None:
        stored = [shard.engine.value_of(k, "pull", self._where())._data for k in keys]
        check_reply(stored, rows, self.cfg.max_reply_bytes, self._where())
        ticket = Ticket(conn, ts, Command.PULL, keys, rows)
        engine = shard.engine
        # a restarted worker before its Sampler resumed, or in the step it resumed at
        # before it made its pushes of a key again: as they are (docs/data.md D4)
        now = body.get("now") if isinstance(body, dict) else None
        as_is = set(keys) if now is True else set(now) if isinstance(now, list) else set()

        def pulls() -> None:
            for k in keys:
                engine.pull(k, worker, ticket, k in as_is)   # after this worker's push of it
        engine.request(ticket, pulls)

    def _on_rsp_pull(self, shard: Shard, conn: Connection,
                     worker: int, ts: int, keys: tuple[int, ...], body: Any,
                     arrays: list[np.ndarray]) -> None:
        if len(arrays) != len(keys):
            raise ProtocolError("row_sparse pull needs one row-id array per key")
        stored = []
        for k, rows in zip(keys, arrays):
            stored.append(shard.engine.value_of(k, "row_sparse_pull", self._where())._data)
            check_rows(k, rows, stored[-1].shape[0] if stored[-1].ndim else 0)
        check_reply(stored, arrays, self.cfg.max_reply_bytes, self._where())  # before copies
        self._on_pull(shard, conn, worker, ts, keys, body, arrays,
                      rows=[r.astype(np.int64) for r in arrays])

    def _on_command(self, shard: Shard, conn: Connection,
                    worker: int, ts: int, keys: tuple[int, ...], body: Any,
                    arrays: list[np.ndarray]) -> None:
        op = parse(body)
        if not isinstance(op, Op):   # replication ops go to the backups' listener, never here
            raise ProtocolError(f"unknown command {body.get('op')!r} on a server's worker "
                                "port (replication ops go to the backups' listener)")
        if op in (Op.CHECKPOINT, Op.RESTORE):   # a worker's path: only where the job allows
            body = {**body, "path": checkpoint_path(body["path"], self.cfg.checkpoint_dir)}
        if op.replicated is not None:
            shard.forward(op.replicated, body, arrays)     # the backup first: then here
        reply = self._commands[op](self, shard, conn, worker, ts, body, arrays)
        if reply is not None:
            self._send(conn, Command.DATA if reply else Command.ACK, ts, arrays=reply)

    # each COMMAND op: its reply's arrays ([]: an ACK), or None when it answers by itself
    def _cmd_applied(self, shard: Shard, conn: Connection,
                     worker: int, ts: int, body: dict[str, Any],
                     arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """A worker that switched to this backup: what of its pushes this server holds."""
        self._send(conn, Command.ACK, ts, {"applied": shard.engine.applied_by(worker)})
        return None

    def _cmd_seal(self, shard: Shard, conn: Connection,
                  worker: int, ts: int, body: dict[str, Any],
                  arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """A worker's seal of its steps (docs/data.md): ``commit`` false only answers (its
        pushes before it are here: a link is in order), true closes the rounds waiting."""
        if body["commit"]:
            shard.engine.seal(worker, body["step"])
        return []

    def _cmd_position(self, shard: Shard, conn: Connection,
                      worker: int, ts: int, body: dict[str, Any],
                      arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """A restarted worker's data position as this shard knows it (docs/data.md)."""
        self._send(conn, Command.ACK, ts, shard.engine.position_of(worker))
        return None

    def _cmd_initial(self, shard: Shard, conn: Connection,
                     worker: int, ts: int, body: dict[str, Any],
                     arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """Worker 0's first push: the inits are done (the round-0 checkpoint)."""
        self.snapshots.initial(shard.engine, shard.index)
        return []

    def _cmd_joined(self, shard: Shard, conn: Connection,
                    worker: int, ts: int, body: dict[str, Any],
                    arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """Every worker joined (kv.join): the next rounds count every worker again."""
        self._join_epoch = max(self._join_epoch, body["epoch"])
        self._workers_left(force=True)
        return []

    def _cmd_optimizer(self, shard: Shard, conn: Connection,
                       worker: int, ts: int, body: dict[str, Any],
                       arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        shard.engine.set_optimizer_spec(body.get("spec"))
        return []

    def _cmd_compression(self, shard: Shard, conn: Connection,
                         worker: int, ts: int, body: dict[str, Any],
                         arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        shard.engine.set_compression(body.get("params"))
        return []

    def _cmd_save(self, shard: Shard, conn: Connection,
                  worker: int, ts: int, body: dict[str, Any],
                  arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        states = shard.engine.states_updater("save", self._where()).get_states(
            bool(body.get("dump", False)))
        return [np.frombuffer(states, dtype=np.uint8)]

    def _cmd_load(self, shard: Shard, conn: Connection,
                  worker: int, ts: int, body: dict[str, Any],
                  arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        shard.engine.states_updater("load", self._where()).set_states(arrays[0].tobytes())
        return []

    def _cmd_checkpoint(self, shard: Shard, conn: Connection,
                        worker: int, ts: int, body: dict[str, Any],
                        arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        # the pause: one copy of the shard; a thread writes it, then answers. "values":
        # the keys whose value the workers hold (the collective path), one array each
        values = dict(zip(body.get("values") or [], arrays))   # checked (validate.py)
        self.snapshots.write(shard.engine.snapshot(values), str(body.get("path")),
                             reply=(conn, ts), index=shard.index)
        return None

    def _cmd_adopt(self, shard: Shard, conn: Connection,
                   worker: int, ts: int, body: dict[str, Any],
                   arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        if self.backups is not None:     # a backup would not get the values
            raise UnsupportedError("set_optimizer: keys summed among the workers cannot "
                                   "move to servers with replicas (PSKV_REPLICAS)")
        shard.engine.adopt(dict(zip(body.get("values") or [], arrays)))   # checked there
        return []

    def _cmd_restore(self, shard: Shard, conn: Connection,
                     worker: int, ts: int, body: dict[str, Any],
                     arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        self.snapshots.restore(shard.engine, str(body.get("path")))
        return []

    _commands: dict[Op, Callable[..., list[np.ndarray] | None]] = {
        Op.APPLIED: _cmd_applied, Op.INITIAL: _cmd_initial, Op.OPTIMIZER: _cmd_optimizer,
        Op.COMPRESSION: _cmd_compression, Op.SAVE: _cmd_save, Op.LOAD: _cmd_load,
        Op.CHECKPOINT: _cmd_checkpoint, Op.RESTORE: _cmd_restore,
        Op.LOOKUP: cmd_lookup, Op.TABLE_STATS: cmd_table_stats, Op.CLOCK: cmd_clock,
        Op.JOINED: _cmd_joined, Op.ADOPT: _cmd_adopt, Op.CHANGES: cmd_changes,
        Op.EXPLAIN: cmd_explain, Op.HOT_IDS: cmd_hot_ids, Op.SEAL: _cmd_seal,
        Op.POSITION: _cmd_position,
    }

    _handlers: dict[Command, Callable[..., None]] = {
        Command.INIT: _on_init, Command.PUSH: _on_push, Command.PULL: _on_pull,
        Command.PUSHPULL: _on_pushpull, Command.RSP_PULL: _on_rsp_pull,
        Command.COMMAND: _on_command, Command.FLUSH: _on_flush,
    }

    # ---- loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Join the cluster and serve until the scheduler says SHUTDOWN; return 0."""
        with self.moves.signal():       # a removal asked before it serves waits for it
            return self._run()

    def _run(self) -> int:
        try:
            self.po.start()
            self._build_serving()
            own = self.shards.own
            if self.cfg.restart and self.cfg.rank is not None and not self.cfg.replicas:
                # before any worker is read: they send what the checkpoint lacks
                self._reload(self.po.rank)
            if self.backups is not None:
                self.backups.start(self.po)
            log.info("server %d: serving dist_%s for %d workers at %s", self.po.rank,
                     self.po.mode or "sync", self.po.num_workers,
                     ", ".join(sorted(self._endpoints.values())))
            if not (self.cfg.restart and self.cfg.replicas):
                # its backup gets the whole (empty) shard before any worker is admitted
                # here: a death while the workers connect leaves it a copy to serve
                self.shards.serve(self.po.rank, own)
                if self.backups is not None:
                    self.takeovers.await_first_copy(self.po.rank, self.cfg.connect_timeout)
            # else: its backup took its shard over; it rejoins as a backup
            failed_seen = False
            lost_at: float | None = None

            def stop() -> bool:
                nonlocal failed_seen, lost_at
                self.snapshots.reap()
                if self.backups is not None:
                    self.takeovers.events()
                    self.moves.hand_back()
                    if self.moves.retiring():
                        return True
                self._workers_left()
                if self.po.failure is not None and not failed_seen:
                    failed_seen = True
                    err = NodeFailedError(self.po.failure)
                    self.shards.each_engine(lambda engine: engine.fail_all(err))
                    self._fail_parked(self.gate.fail_all(err))
                if self.po.scheduler_lost.is_set():
                    # a server on another host (ssh launcher) has no launcher to stop it:
                    # without the scheduler no SHUTDOWN can come, so it exits by itself,
                    # two heartbeats later: its workers notice the scheduler's loss first
                    # (not this server's), which is what their error should name
                    if lost_at is None:
                        lost_at = time.monotonic()
                    if time.monotonic() - lost_at >= 2 * self.cfg.heartbeat_interval:
                        log.error("server %d: %s; exiting", self.po.rank, self.po.failure)
                        return True
                if self._stop.is_set():
                    return True
                return self.po.shutdown.is_set() and not self._draining()

            self.loop.run(stop)
            if self.po.scheduler_lost.is_set():
                return 1
            self.po.goodbye(retire=self.moves.retired)
            return 0
        finally:
            self._closing.close()

    def _draining(self) -> bool:
        """Told to shut down: whether to serve on a while for stream readers that are
        behind (E10): up to :data:`STREAM_DRAIN` seconds, for readers that read within
        that long, so a sink beside the job gets every change before the servers go."""
        now = time.monotonic()
        if self._drain_until is None:
            self._drain_until = now + STREAM_DRAIN
        if now >= self._drain_until:
            return False
        behind = [0]
        self.shards.each_engine(lambda e: behind.__setitem__(
            0, behind[0] + e.readers_behind(STREAM_DRAIN)))
        return behind[0] > 0

    def _reload(self, rank: int) -> None:
        """Restarted by pskv-launch --max-restarts: this rank's shard from the newest
        checkpoint, before rejoining (the workers then send what it does not include)."""
        root = self.cfg.checkpoint_dir
        rnd = None if root is None else load_shard(self.shards.own, root, rank,
                                                   self.cfg.num_servers,
                                                   self.cfg.max_key_bytes)
        if rnd is None:
            raise CheckpointError(
                f"server {rank} was restarted but has nothing to reload: no complete "
                f"checkpoint in PSKV_CHECKPOINT_DIR={root!r}. Set PSKV_CHECKPOINT_DIR and "
                "PSKV_CHECKPOINT_EVERY so that a restarted server can rejoin.")
        log.warning("server %d: restarted; reloaded %d keys from the checkpoint of round %d",
                    rank, len(self.shards.own), rnd)

    def _close_io(self) -> None:
        """Close the listeners bound so far if the serving loop was never made (the loop
        closes them, and its connections, itself)."""
        if self._io is None:
            for lis in self._listeners:
                lis.close()
