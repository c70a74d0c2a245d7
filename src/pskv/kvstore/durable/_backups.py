"""The backup side of replication (``PSKV_REPLICAS=1``): the copies one server keeps of
other servers' shards (:class:`Backups`, on a thread with its own ServeLoop and
listeners), a whole copy installed (:func:`install_copy`) and each replicated change
applied (:func:`apply_change`; a backup logs dense rounds, ``_backup_log``). The primary's
side, and the protocol, are ``_replica``'s docstring.
"""
from __future__ import annotations

import functools
import secrets
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import KVStoreError, ProtocolError
from ...nd.ndarray import NDArray
from ...optimizer.updater import decode_states
from ...nd.sparse import RowSparseNDArray
from ..._ps.auth import Verifier
from ..._ps.config import ClusterConfig, advertised_host
from ..._ps.message import Command, Meta, short
from ..._ps.ops import BACKUP_ENDPOINT, ReplOp, parse
from ..._ps.postoffice import Postoffice
from ..._ps.ring import RingReader
from ..._ps.sealed import SealedConn
from ..._ps.serve import ServeLoop
from ..._ps.stream import StreamConn, StreamListener, ipc_path
from ..._ps.tls import server_context
from ..._ps.transport import Connection
from ..._ps.zeromq import ZmqContext
from ._backup_log import BufferPool, RoundLog
from ..engine._core import Engine
from ..engine._tables import TableRound, restore_table, served_table
from ..engine._entries import init_entries
from ..engine._positions import marks_of
from .._snapshot import Reader
from ._replica import PURPOSE


__all__ = ["Backups", "apply_change", "install_copy"]

log = logging.getLogger(__name__)


def install_copy(engine: Engine, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """Fill an empty ``engine`` from :func:`encode_copy` output."""
    engine.sync = bool(body.get("sync", True))
    if body.get("compression") is not None:
        engine.set_compression(body["compression"])
    if body.get("optimizer") is not None:
        # a restarted worker's repeat of what it sent must not reset the copy's states
        engine.set_optimizer_spec(body["optimizer"], body.get("sent"))
    for e, arr in zip(body["entries"], arrays, strict=False):
        if e.get("stype") == "table":
            _install_table(engine, e, arrays)
        else:
            engine.init(e["id"], arr, e.get("stype") == "row_sparse", e["key"],
                        place=(int(e["start"]), int(e["stop"]), tuple(e["shape"])))
        engine.set_counters(e["id"], int(e.get("round", 0)),
                            {int(w): int(n) for w, n in e.get("applied", [])})
    if body.get("states") is not None and engine.updater is not None:
        states = decode_states(arrays[int(body["states"])].tobytes())[0]
        upd: Any = engine.updater
        for name, st in states.items():
            upd.states[name] = st
            upd.states_synced[name] = False


def _install_table(engine: Engine, e: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A table shard of a whole copy: made from its state (``DynamicTable.from_state``)."""
    from ...table import TableSpec
    shard = (int(e["shard"][0]), int(e["shard"][1]))
    empty = served_table(TableSpec.from_json(e["spec"]), e["key"], shard)
    named = {f: arrays[int(i)] for f, i in e["fields"].items()}
    table = restore_table(empty, [(shard[0], named, e["table"])])
    stream = e.get("stream")
    if isinstance(stream, dict):        # the primary's change stream goes on here (E8)
        table.go_on_from({f: arrays[int(i)] for f, i in stream["fields"].items()}, stream)
    engine.init_table(e["id"], table)


class Backups:
    """The backup side: copies of other servers' shards, kept up to date on a thread of
    their own (its own ServeLoop and listeners), so that two servers that back each other
    up never wait for each other. ``lock`` guards the copies against the server's loop,
    which reads counters and takes a copy over (:meth:`take`)."""

    def __init__(self, cfg: ClusterConfig, make_engine: Any, zctx: ZmqContext) -> None:
        self.cfg = cfg
        self._make = make_engine
        self.lock = threading.Lock()
        self.engines: dict[int, Engine] = {}
        #: each copy's rounds not applied yet (``_backup_log``), and the buffers they land in
        self.logs: dict[int, RoundLog] = {}
        self._pool = BufferPool()
        #: each primary's ring (``_ps/ring.py``), by its link
        self._rings: dict[Connection, RingReader] = {}
        #: shard -> the server whose whole copy this is (the one that serves it), and when
        #: the copy came (a death reported after that is its death, not a past one's)
        self.source: dict[int, tuple[int, float]] = {}
        #: shard -> the token of a copy this server kept when it handed the shard back
        #: (its engine, as it was): the new server's link names it instead of sending
        #: the whole shard again (``Replicator.have``)
        self.adopted: dict[int, str] = {}
        #: shard -> set once the whole copy being installed now is in place: it is built
        #: outside ``lock`` (a copy of hundreds of MB takes a second), so that taking
        #: another shard over does not wait for it; taking this one waits (:meth:`_settled`)
        self._installing: dict[int, threading.Event] = {}
        self._po: Postoffice | None = None
        tls = server_context(*cfg.tls) if cfg.tls is not None else None
        self._listeners = [StreamListener(host=cfg.node_host,
                                          advertise=advertised_host(cfg.node_host, cfg.root_uri),
                                          tls=tls)]
        try:
            if cfg.transport != "tcp":
                self._listeners.append(StreamListener(path=ipc_path("backup")))
        except BaseException:
            self._listeners[0].close()
            raise
        #: where primaries reach this server's backups (announced with its endpoints)
        self.endpoints = {BACKUP_ENDPOINT + ("tcp" if lis.endpoint.startswith("tcp:") else "uds"):
                          lis.endpoint for lis in self._listeners}
        if cfg.encrypt:        # every link sealed under the servers' key (sealed.py)
            for lis in self._listeners:
                lis.make_conn = functools.partial(SealedConn, key_for=self._key_for)
        #: the primaries' serving loop, made by :meth:`start` from the admission
        self.loop: ServeLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pskv-backups", daemon=True)

    def _key_for(self, role: str, rank: int | None) -> bytes:
        """Only servers of this job write into backups, proving the servers' key."""
        po = self._po
        if po is None or not po.server_key:
            raise ProtocolError("this server has not joined its cluster yet")
        if role != "server" or rank is None or not 0 <= rank < po.num_servers:
            raise ProtocolError("only a server of this job may send a backup its changes")
        return po.server_key

    def start(self, po: Postoffice) -> None:
        """Serve the primaries of the cluster ``po`` joined (its job, its servers'
        key), on a thread."""
        cfg = self.cfg
        self._po = po
        self.loop = ServeLoop(f"backups of server {po.rank}", self,
                              Verifier(PURPOSE, po.job, self._key_for), cfg.request_timeout,
                              None, self._listeners, handshake_timeout=cfg.handshake_timeout,
                              max_unadmitted=cfg.max_unadmitted,
                              max_message_bytes=cfg.max_message_bytes, keep_fds=True)
        self._thread.start()

    def _loop(self) -> ServeLoop:
        """The serving loop (messages come only once :meth:`start` made it)."""
        assert self.loop is not None, "Backups.start makes the loop"
        return self.loop

    def _run(self) -> None:
        try:
            self._loop().run(self._stop.is_set, 50, 1.0)
        except Exception:  # pragma: no cover - logged: the shard is then without a backup
            log.exception("backups: the replication thread failed")

    def close(self) -> None:
        """Stop the thread and close the listeners."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self.loop is not None:
            self.loop.close()           # with its listeners
        else:
            for lis in self._listeners:
                lis.close()
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()

    def _settled(self, shard: int) -> None:
        """Wait until a whole copy of ``shard`` being installed is in place."""
        installing = self._installing.get(shard)
        if installing is not None:
            installing.wait(self.cfg.request_timeout)

    def take(self, shard: int) -> Engine | None:
        """The copy of ``shard``, to serve it (its primary died), with every round it
        logged applied; it is no longer updated."""
        self._settled(shard)
        with self.lock:
            log_ = self.logs.pop(shard, None)
            if log_ is not None:
                log_.flush()
            self.source.pop(shard, None)
            return self.engines.pop(shard, None)

    def adopt(self, shard: int, engine: Engine) -> str:
        """Keep ``engine``, the shard this server just handed back to its slot's server
        (which holds the same copy), as this server's backup copy of it; the token the
        new server's link names to skip the whole copy (``Replicator.have``)."""
        token = secrets.token_hex(8)
        with self.lock:
            engine.observer = None
            self.engines[shard] = engine
            self.logs[shard] = RoundLog(engine, self._pool)
            self.source[shard] = (shard, time.monotonic())
            self.adopted[shard] = token
        return token

    def alloc_for(self, meta: Meta) -> Any:
        """Where the arrays of a round to be logged land: buffers of the pool, which the
        log then keeps without a copy (ServeLoop calls this for each message)."""
        body = meta.body
        if meta.cmd != Command.COMMAND or not isinstance(body, dict):
            return None
        op = parse(body)
        if op is ReplOp.ROUNDS:
            # the arrays of logged rounds and whole states; the others' are applied at once
            rounds, counts = body.get("rounds"), body.get("arrays")
            if not isinstance(rounds, list) or not isinstance(counts, list):
                return None         # refused by validate.request once read
            land: set[int] = set()
            pos = 0
            for one, n in zip(rounds, counts):
                if type(n) is not int or not 0 <= n <= 1 << 20:
                    return None
                if isinstance(one, dict) and one.get("kind") in ("l", "f"):
                    land.update(range(pos, pos + n))
                pos += n
            return lambda i, dtype, shape: self._land(i, dtype, shape) if i in land else None
        return None

    def _land(self, index: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        return self._pool.take(dtype, shape)

    def empty(self) -> Engine:
        """A fresh engine for a shard taken over empty (``Shards.get``: its server died
        before its first copy came here, so it never answered a worker)."""
        engine: Engine = self._make()
        return engine

    def held_from(self, shard: int) -> tuple[int, float] | None:
        """The server whose copy of ``shard`` this server holds and when the copy came
        (None: it holds none)."""
        self._settled(shard)
        with self.lock:
            return self.source.get(shard) if shard in self.engines else None

    # ---- the Handler of the ServeLoop ----------------------------------------------------
    def admit(self, conn: Connection, meta: Meta) -> int:
        """A primary's HELLO whose proof checked."""
        self._loop().send(conn, Command.ACK, meta.ts)
        return int(meta.body["rank"])

    def handle(self, conn: Connection, peer: Any, meta: Meta, arrays: list[np.ndarray]) -> None:
        """One change of a shard this server backs up."""
        body = meta.body if isinstance(meta.body, dict) else {}
        op, shard = parse(body), body.get("shard")
        if meta.cmd != Command.COMMAND or not isinstance(op, ReplOp) or \
                not isinstance(shard, int) or isinstance(shard, bool):
            raise ProtocolError(f"backups take replication commands, not {meta.cmd.name} "
                                f"{short(body.get('op'))}")
        if op is ReplOp.NOOP:
            have = body.get("have")
            reply = None
            if isinstance(have, str):   # a primary asks whether its copy is here already
                with self.lock:
                    ok = self.adopted.get(shard) == have and shard in self.engines
                    self.adopted.pop(shard, None)
                    if ok:
                        self.source[shard] = (int(peer), time.monotonic())
                reply = {"have": ok}
            self._loop().send(conn, Command.ACK, meta.ts, reply)
            return
        if op is ReplOp.RING:
            self._map_ring(conn, peer, body)
            self._loop().send(conn, Command.ACK, meta.ts)
            return
        if op is ReplOp.ROUNDS and "ring" in body:
            ring = self._rings.get(conn)
            if ring is None:
                raise ProtocolError("r_rounds names ring entries, but this link has no ring")
            land = self.alloc_for(meta)
            arrays = ring.read(body["ring"], land or (lambda i, dtype, shape: None),
                               self.cfg.max_message_bytes)
        if op is ReplOp.STATE:      # built outside the lock, put in place under it
            installing = self._installing[shard] = threading.Event()
            try:
                engine = self._make()
                install_copy(engine, body, arrays)
                with self.lock:
                    self.engines[shard] = engine
                    self.logs[shard] = RoundLog(engine, self._pool)
                    self.source[shard] = (int(peer), time.monotonic())
                    self.adopted.pop(shard, None)
            finally:
                del self._installing[shard]
                installing.set()
            self._loop().send(conn, Command.ACK, meta.ts)
            return
        with self.lock:
            if op is ReplOp.ROUNDS and shard in self.engines:
                # the rounds are safe once they are here: acknowledge, then log or apply
                # them (still under the lock, so a takeover sees them) while the primary
                # answers
                self._loop().send(conn, Command.ACK, meta.ts)
                pos = 0
                for one, n in zip(body["rounds"], body["arrays"]):
                    self._round(shard, one, arrays[pos:pos + n])
                    pos += n
                return
            engine = self.engines.get(shard)
            if engine is None:
                raise ProtocolError(f"{op} for shard {shard}, which this server does not "
                                    "back up (its whole copy, r_state, comes first)")
            self.logs[shard].flush()            # every logged round before the change
            apply_change(engine, op, body, arrays, self.cfg.max_key_bytes,
                         f"server {self._po.rank if self._po else '?'}")
        self._loop().send(conn, Command.ACK, meta.ts)

    def _round(self, shard: int, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """One round of a shard held here: logged, or applied at once (under the lock)."""
        if body.get("kind") in ("t", "r"):
            self.logs[shard].flush()        # in turn with the logged rounds
            _round(self.engines[shard], body, arrays)
            self.logs[shard].synced()
        else:
            self.logs[shard].round(body, arrays)

    def _map_ring(self, conn: Connection, peer: Any, body: dict[str, Any]) -> None:
        """Map the ring primary ``peer`` passed with ``r_ring`` on its Unix-socket link
        (``_ps/ring.py``)."""
        fds = conn.fds if isinstance(conn, StreamConn) else None
        ring = RingReader.open(fds.take() if fds is not None else None, body["bytes"],
                               f"server {peer}")
        old = self._rings.pop(conn, None)
        if old is not None:
            old.close()
        self._rings[conn] = ring

    def tick(self) -> None:
        """Nothing on a timer."""

    def dropped(self, conn: Connection) -> None:
        """A primary went away (it died, or it closed): buffers lent for a message it
        never finished are not kept (one still lent to another primary's message is
        copied from instead)."""
        self._pool.forget()
        ring = self._rings.pop(conn, None)
        if ring is not None:
            ring.close()


def _round(engine: Engine, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    key = body["key"]
    applied = {int(w): int(n) for w, n in body.get("applied", [])}
    marks = marks_of(body.get("marks"))
    if body.get("kind") == "t":         # a table shard's changed rows (validate: fields)
        engine.replay(key, TableRound(dict(zip(body["fields"], arrays)), body["table"]),
                      int(body["round"]), applied, marks)
        return
    if body.get("kind") == "r" and len(arrays) != 2 or body.get("kind") != "r" and \
            len(arrays) != 1:
        raise ProtocolError("a replicated round needs its merged value's arrays")
    entry_shape = engine.value_of(key, "replicate").shape
    merged: NDArray = RowSparseNDArray(arrays[1], arrays[0].astype(np.int64), entry_shape) \
        if body.get("kind") == "r" else NDArray(arrays[0])
    engine.replay(key, merged, int(body["round"]), applied, marks)


def _restore(engine: Engine, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    reader = Reader(str(body.get("path")))
    try:
        engine.restore(reader)
    finally:
        reader.close()


#: how a backup applies each change to its copy (``ReplOp.STATE`` makes the copy,
#: ``ReplOp.INIT`` is checked as a worker's INIT: :func:`apply_change`)
_CHANGES: dict[ReplOp, Callable[[Engine, dict[str, Any], list[np.ndarray]], None]] = {
    ReplOp.RESTORE: _restore,
    ReplOp.OPTIMIZER: lambda engine, body, arrays: engine.set_optimizer_spec(body.get("spec")),
    ReplOp.COMPRESSION: lambda engine, body, arrays: engine.set_compression(body.get("params")),
    ReplOp.LOAD: lambda engine, body, arrays: engine.states_updater("load").set_states(
        arrays[0].tobytes()),
}


def apply_change(engine: Engine, op: ReplOp, body: dict[str, Any],
                 arrays: list[np.ndarray], max_key_bytes: int, where: str) -> None:
    """Apply one replicated change (not ``ReplOp.STATE``) to a backup copy. An INIT goes
    through the checks of a worker's (``init_entries``, refusals naming ``where``)."""
    if op is ReplOp.INIT:
        init_entries(engine, tuple(body["keys"]), body["entries"], arrays, max_key_bytes,
                     where)
        return
    apply = _CHANGES.get(op)
    if apply is None:
        raise KVStoreError(f"{op.value} is not a change of a backup copy")
    apply(engine, body, arrays)
