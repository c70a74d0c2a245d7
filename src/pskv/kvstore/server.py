"""KVServer: one parameter server; merges pushes, runs sync rounds, applies the updater.

Invariants: a server never dies of a worker's bad input (every request is validated, and a
bad one gets an ERROR reply naming the key and what was wrong); in sync mode a key's round
closes when every worker has pushed it once, then the updater (or assign) runs once and
every waiting pusher and puller is answered (MXNet kvstore_dist_server.h ApplyUpdates); a
worker's second push in an open round waits for the next round; nothing waits forever.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zmq

from ..errors import (ConfigError, KeyNotInitializedError, KVStoreError, ProtocolError,
                      ShapeMismatchError, UnsupportedError)
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._ps.auth import Verifier
from .._ps.config import ClusterConfig, Role
from .._ps.message import Command
from .._ps.postoffice import Postoffice
from .._ps.uds import UdsConn
from .._ps.van import ZmqVan, ipc_path

__all__ = ["ADMISSION_BYTES", "KVServer", "run_node"]

log = logging.getLogger(__name__)

#: the most a stream connection may send in one message before its HELLO is accepted
ADMISSION_BYTES = 1 << 16


class _Reply:
    """A request waiting for the rounds of some of its keys to close."""

    __slots__ = ("ident", "ts", "cmd", "keys", "remaining", "rows")

    def __init__(self, ident: bytes, ts: int, cmd: Command, keys: tuple[int, ...]) -> None:
        self.ident, self.ts, self.cmd, self.keys = ident, ts, cmd, keys
        self.remaining = 0
        self.rows: list[np.ndarray] | None = None


@dataclass(slots=True)
class _Entry:
    pskey: int
    key: Any                          # the user's key: the optimizer's index
    stored: NDArray
    sparse: bool
    merge: np.ndarray | None = None
    pushers: set[int] = field(default_factory=set)
    round: int = 0
    started: float = 0.0
    waiting: list[_Reply] = field(default_factory=list)       # pushers of this round
    pulls: list[tuple[int, _Reply]] = field(default_factory=list)  # pulls after a push
    deferred: list[tuple[int, list[np.ndarray], str, _Reply | None]] = field(default_factory=list)
    sparse_parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


class KVServer:
    """A parameter server's loop. ``run()`` returns 0 after the scheduler's SHUTDOWN."""

    def __init__(self, cfg: ClusterConfig, stop: threading.Event | None = None) -> None:
        self.cfg = cfg
        self._stop = stop or threading.Event()
        self._van = ZmqVan()
        self._sock = self._van.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        port = self._sock.bind_to_random_port(f"tcp://{cfg.node_host}")
        host = cfg.node_host if cfg.node_host != "0.0.0.0" else _my_address(cfg.root_uri)
        endpoints = {"tcp": f"tcp://{host}:{port}"}
        self._listeners: list[socket.socket] = []
        self._conns: dict[int, UdsConn] = {}
        self._ipc_path: str | None = None
        # workers on other hosts connect here: pskv's framing straight over TCP
        family = socket.AF_INET6 if ":" in cfg.node_host else socket.AF_INET
        lis = socket.socket(family, socket.SOCK_STREAM)
        lis.bind((cfg.node_host, 0))
        endpoints["raw"] = f"tcp:{host}:{lis.getsockname()[1]}"
        self._listeners.append(lis)
        if cfg.transport in ("auto", "ipc"):
            # same-host workers connect here: a Unix socket only this user can open
            self._ipc_path = ipc_path("server")
            lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lis.bind(self._ipc_path)
            os.chmod(self._ipc_path, 0o600)
            self._listeners.append(lis)
            endpoints["uds"] = self._ipc_path
        for lis in self._listeners:
            lis.listen(64)
            lis.setblocking(False)
        self.po = Postoffice(cfg, self._van, endpoints={**endpoints, "host": ""})
        self.po._endpoints["host"] = self.po.host
        self._verifier = Verifier(cfg.secret, "server")
        self._admitted: dict[Any, int] = {}
        self._poller: zmq.Poller | None = None
        self._open: dict[Any, int] = {}           # per worker: pushes not yet applied
        self._flushes: dict[Any, list[int]] = {}  # per worker: FLUSH requests waiting
        self._entries: dict[int, _Entry] = {}
        self._sync = True
        self._updater: Callable[[Any, Any, Any], None] | None = None
        self._opt_spec: Any = None
        self._gc: Any = None
        self._gc_params: Any = None

    # ---- replies -------------------------------------------------------------------------
    def _send(self, ident: bytes | UdsConn, cmd: Command, ts: int, body: Any = None,
              arrays: list[np.ndarray] | tuple[()] = ()) -> None:
        if isinstance(ident, UdsConn):
            try:
                ident.send(cmd, ts, body=body, arrays=arrays)
            except KVStoreError as err:
                log.warning("server %d: dropping %s: %s", self.po.rank, ident.peer, err)
                self._drop(ident)
            return
        try:
            # copied: a reply of stored values must not change if a round closes before
            # ZeroMQ's I/O thread has sent it
            ZmqVan.send(self._sock, cmd, ts, body=body, arrays=arrays, to=ident, copy=True)
        except zmq.ZMQError as err:
            log.warning("server %d: cannot reply to %r: %s", self.po.rank, ident, err)

    def _error(self, ident: bytes, ts: int, err: Exception | str, kind: str = "") -> None:
        msg = str(err)
        kind = kind or (type(err).__name__ if isinstance(err, KVStoreError) else "ClusterError")
        self._send(ident, Command.ERROR, ts, {"kind": kind, "msg": msg})

    def _answer(self, rep: _Reply) -> None:
        if rep.cmd == Command.PUSH:      # pushes are not acknowledged one by one
            self._push_done(rep.ident)
        else:
            self._send(rep.ident, Command.DATA, rep.ts, arrays=self._values(rep))

    def _push_done(self, ident: Any) -> None:
        left = self._open.get(ident, 1) - 1
        self._open[ident] = left
        if left <= 0:
            for ts in self._flushes.pop(ident, ()):
                self._send(ident, Command.ACK, ts)

    def _on_flush(self, ident: Any, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                  arrays: list[np.ndarray]) -> None:
        if self._open.get(ident, 0) <= 0:
            self._send(ident, Command.ACK, ts)
        else:
            self._flushes.setdefault(ident, []).append(ts)

    def _values(self, rep: _Reply) -> list[np.ndarray]:
        out = []
        for i, k in enumerate(rep.keys):
            stored = self._entries[k].stored
            if rep.rows is not None:
                out.append(stored._data[rep.rows[i]])
            else:
                out.append(stored._data)
        return out

    # ---- rounds --------------------------------------------------------------------------
    def _apply(self, entry: _Entry, merged: Any) -> None:
        if self._updater is not None:
            self._updater(entry.key, merged, entry.stored)
        elif isinstance(merged, RowSparseNDArray):
            table = entry.stored._data
            table[...] = 0
            table[merged._indices] = merged._data
        else:
            np.copyto(entry.stored._data, merged._data, casting="same_kind")

    def _merged(self, entry: _Entry) -> NDArray:
        if entry.sparse:
            rows = np.concatenate([r for r, _ in entry.sparse_parts]) if entry.sparse_parts \
                else np.zeros(0, np.int64)
            uniq = np.unique(rows)
            data = np.zeros((len(uniq),) + entry.stored.shape[1:], entry.stored.dtype)
            for r, d in entry.sparse_parts:
                np.add.at(data, np.searchsorted(uniq, r), d)
            entry.sparse_parts.clear()
            merged: NDArray = RowSparseNDArray(data, uniq, entry.stored.shape)
        else:
            assert entry.merge is not None
            merged = NDArray(entry.merge)
        return merged

    def _add(self, entry: _Entry, worker: int, arrays: list[np.ndarray], kind: str) -> None:
        if kind == "r":
            entry.sparse_parts.append((arrays[0].astype(np.int64), np.array(arrays[1])))
            return
        value = self._gc.decompress(arrays[0], entry.stored.size).reshape(entry.stored.shape) \
            if kind == "c" else arrays[0].reshape(entry.stored.shape)
        if not self._sync:
            entry.merge = value
            return
        if not entry.pushers or entry.merge is None:
            if entry.merge is None:
                entry.merge = np.empty(entry.stored.shape, entry.stored.dtype)
            np.copyto(entry.merge, value, casting="same_kind")
        else:
            np.add(entry.merge, value, out=entry.merge, casting="same_kind")

    def _push_one(self, k: int, worker: int, arrays: list[np.ndarray], kind: str,
                  rep: _Reply | None) -> None:
        entry = self._entries[k]
        if not self._sync:
            self._add(entry, worker, arrays, kind)
            self._apply(entry, self._merged(entry))
            return
        if worker in entry.pushers:       # its next round: wait (distinct workers per round)
            # receive buffers are reused: keep a copy
            entry.deferred.append((worker, [np.array(a) for a in arrays], kind, rep))
            if rep is not None:
                rep.remaining += 1
            return
        if not entry.pushers:
            entry.started = time.monotonic()
        self._add(entry, worker, arrays, kind)
        entry.pushers.add(worker)
        if rep is not None:
            rep.remaining += 1
            entry.waiting.append(rep)
        if len(entry.pushers) == self.po.num_workers:
            self._close_round(entry)

    def _close_round(self, entry: _Entry) -> None:
        self._apply(entry, self._merged(entry))
        entry.round += 1
        entry.pushers.clear()
        waiting, entry.waiting = entry.waiting, []
        deferred, entry.deferred = entry.deferred, []
        pulls, entry.pulls = entry.pulls, []
        for rep in waiting:
            self._release(rep)
        for worker, arrays, kind, drep in deferred:  # they open the next round
            if drep is not None:
                drep.remaining -= 1
            self._push_one(entry.pskey, worker, arrays, kind, drep)
        for worker, rep in pulls:
            if self._pushed(entry, worker):
                entry.pulls.append((worker, rep))    # its later push is not applied yet
            else:
                self._release(rep)

    def _release(self, rep: _Reply) -> None:
        rep.remaining -= 1
        if rep.remaining == 0:
            self._answer(rep)

    @staticmethod
    def _pushed(entry: _Entry, worker: int) -> bool:
        return worker in entry.pushers or any(d[0] == worker for d in entry.deferred)

    def _check_rounds(self) -> None:
        now = time.monotonic()
        for entry in self._entries.values():
            if entry.pushers and now - entry.started > self.cfg.round_timeout:
                missing = sorted(set(range(self.po.num_workers)) - entry.pushers)
                msg = (f"sync round {entry.round} of key {entry.key!r} waited "
                       f"{now - entry.started:.1f} s: workers {missing} have not pushed it "
                       f"(workers {sorted(entry.pushers)} did). Make every worker push every "
                       "key each step, or raise PSKV_ROUND_TIMEOUT.")
                self._fail_entry(entry, msg, "ClusterTimeoutError")

    def _fail_entry(self, entry: _Entry, msg: str, kind: str) -> None:
        reps = entry.waiting + [r for _, r in entry.pulls] + \
            [d[3] for d in entry.deferred if d[3] is not None]
        for rep in {id(r): r for r in reps}.values():
            self._error(rep.ident, rep.ts, msg, kind)
            if rep.cmd == Command.PUSH:
                self._push_done(rep.ident)
            for other in rep.keys:   # answered: stop counting it anywhere else
                o = self._entries.get(other)
                if o is not None and o is not entry:
                    o.waiting = [r for r in o.waiting if r is not rep]
                    o.pulls = [p for p in o.pulls if p[1] is not rep]
            rep.remaining = -1               # never answered again
        entry.waiting, entry.deferred, entry.pulls = [], [], []
        entry.pushers.clear()
        entry.sparse_parts.clear()

    # ---- request handlers --------------------------------------------------------------------
    def _handle(self, ident: bytes, frames: list[Any]) -> None:
        try:
            meta, arrays = ZmqVan.parse(frames)
        except ProtocolError as err:
            log.warning("server %d: malformed message: %s", self.po.rank, err)
            self._error(ident, 0, f"malformed message: {err}", "ProtocolError")
            return
        self._dispatch(ident, meta, arrays)

    def _dispatch(self, ident: Any, meta: Any, arrays: list[np.ndarray]) -> None:
        if meta.cmd == Command.HELLO:
            why = self._verifier.check(meta.body)
            if why is not None:
                log.warning("server %d: refused a connection (%s)", self.po.rank, why)
                self._error(ident, meta.ts, f"server {self.po.rank} refused this node: {why}",
                            "ProtocolError")
                return
            self._admitted[ident] = int(meta.body.get("rank", -1))
            if isinstance(ident, UdsConn):
                ident.max_bytes = None
            self._send(ident, Command.ACK, meta.ts)
            return
        worker = self._admitted.get(ident)
        if worker is None:
            log.warning("server %d: refused %s from a node that did not say HELLO",
                        self.po.rank, meta.cmd.name)
            self._error(ident, meta.ts, "this node was never admitted", "ProtocolError")
            return
        try:
            handler = self._handlers[meta.cmd]
        except KeyError:
            self._error(ident, meta.ts, f"server does not take {meta.cmd.name}", "ProtocolError")
            return
        try:
            handler(self, ident, worker, meta.ts, meta.keys, meta.body, arrays)
        except KVStoreError as err:
            self._error(ident, meta.ts, err)
        except Exception as err:  # a server never dies of a request; the worker hears why
            log.exception("server %d: %s failed", self.po.rank, meta.cmd.name)
            self._error(ident, meta.ts, f"{type(err).__name__}: {err}", "ClusterError")

    def _entry(self, k: int, what: str) -> _Entry:
        entry = self._entries.get(k)
        if entry is None:
            raise KeyNotInitializedError(
                f"{what}: ps_key {k} is not on server {self.po.rank}: it was never initialized "
                "(or the workers disagree on where keys live). Call kv.init on every worker "
                "first.", key=k)
        return entry

    def _on_init(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray]) -> None:
        specs = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(specs, list) or len(specs) != len(keys) or len(arrays) != len(keys):
            raise ProtocolError("INIT needs one entry spec and one array per key")
        for k, spec, arr in zip(keys, specs, arrays):
            if k in self._entries:
                raise KeyNotInitializedError(
                    f"key {spec.get('key')!r} is initialized twice. Each key takes one init.",
                    key=spec.get("key"))
            if tuple(spec.get("shape", ())) != arr.shape:
                raise ShapeMismatchError(f"INIT of key {spec.get('key')!r}: shape "
                                         f"{arr.shape} != declared {spec.get('shape')}")
        for k, spec, arr in zip(keys, specs, arrays):
            data = np.array(arr, copy=True)
            sparse = spec.get("stype") == "row_sparse"
            stored = RowSparseNDArray._all_rows(data) if sparse else NDArray(data)
            self._entries[k] = _Entry(k, spec.get("key"), stored, sparse)
        self._send(ident, Command.ACK, ts)

    def _check_push(self, k: int, entry: _Entry, kind: str, arrays: list[np.ndarray]) -> None:
        stored = entry.stored
        if kind == "c":
            if self._gc is None:
                raise UnsupportedError("a compressed push reached a server without gradient "
                                       "compression: call set_gradient_compression on every "
                                       "worker before init.", key=entry.key)
            if arrays[0].size != self._gc.packed_size(stored.size):
                raise ShapeMismatchError(f"push to key {entry.key!r}: {arrays[0].size} packed "
                                         f"words for {stored.size} values", key=entry.key)
            return
        if kind == "r":
            rows, data = arrays
            if not entry.sparse:
                raise ShapeMismatchError(f"row_sparse push to dense key {entry.key!r}",
                                         key=entry.key)
            if data.shape != (len(rows),) + stored.shape[1:] or rows.dtype.kind not in "iu" \
                    or (rows.size and (rows.min() < 0 or rows.max() >= stored.shape[0])):
                raise ShapeMismatchError(
                    f"row_sparse push to key {entry.key!r}: rows/data do not fit shape "
                    f"{stored.shape}", key=entry.key, shape=data.shape)
            return
        value = arrays[0]
        if value.size != stored.size:
            raise ShapeMismatchError(
                f"push to key {entry.key!r} got {value.size} values, but its part on server "
                f"{self.po.rank} has shape {stored.shape}. Push arrays of the shape the key "
                "was initialized with.", key=entry.key, shape=value.shape)
        if not np.can_cast(value.dtype, stored.dtype, "same_kind"):
            raise ShapeMismatchError(f"push to key {entry.key!r}: dtype {value.dtype} cannot "
                                     f"be cast to {stored.dtype}", key=entry.key)

    def _split_push(self, keys: tuple[int, ...], body: Any,
                    arrays: list[np.ndarray]) -> list[tuple[int, _Entry, str, list[np.ndarray]]]:
        kinds = body.get("kinds") if isinstance(body, dict) else None
        if not isinstance(kinds, str) or len(kinds) != len(keys):
            raise ProtocolError("a push needs one kind letter per key")
        if len(set(keys)) != len(keys):
            raise ProtocolError("a push names a key twice")
        items, pos = [], 0
        for k, kind in zip(keys, kinds):
            n = 2 if kind == "r" else 1
            if kind not in "dcr" or pos + n > len(arrays):
                raise ProtocolError("push arrays do not match their kinds")
            entry = self._entry(k, "push")
            part = arrays[pos:pos + n]
            self._check_push(k, entry, kind, part)
            items.append((k, entry, kind, part))
            pos += n
        if pos != len(arrays):
            raise ProtocolError("push carries more arrays than keys")
        return items

    def _on_push(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray], cmd: Command = Command.PUSH) -> None:
        items = self._split_push(keys, body, arrays)     # validate all before any change
        rep = _Reply(ident, ts, cmd, keys)
        if cmd == Command.PUSH:
            self._open[ident] = self._open.get(ident, 0) + 1
        rep.remaining = 1                                 # held until every key is queued
        for k, _, kind, part in items:
            self._push_one(k, worker, part, kind, rep if self._sync else None)
        rep.remaining -= 1
        if rep.remaining == 0:
            self._answer(rep)

    def _on_pushpull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                     body: Any, arrays: list[np.ndarray]) -> None:
        self._on_push(ident, worker, ts, keys, body, arrays, Command.PUSHPULL)

    def _on_pull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray], rows: list[np.ndarray] | None = None) -> None:
        entries = [self._entry(k, "pull") for k in keys]
        rep = _Reply(ident, ts, Command.PULL, keys)
        rep.rows = rows
        for entry in entries:
            # a pull after this worker's push waits for that push's round
            if self._sync and self._pushed(entry, worker):
                rep.remaining += 1
                entry.pulls.append((worker, rep))
        if rep.remaining == 0:
            self._answer(rep)

    def _on_rsp_pull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                     body: Any, arrays: list[np.ndarray]) -> None:
        if len(arrays) != len(keys):
            raise ProtocolError("row_sparse pull needs one row-id array per key")
        for k, rows in zip(keys, arrays):
            n = self._entry(k, "row_sparse_pull").stored.shape[0]
            if rows.dtype.kind not in "iu" or (rows.size and (rows.min() < 0 or rows.max() >= n)):
                raise ShapeMismatchError(f"row_sparse_pull: row ids out of [0, {n})", key=k)
        self._on_pull(ident, worker, ts, keys, body, arrays,
                      rows=[r.astype(np.int64) for r in arrays])

    def _on_command(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                    body: Any, arrays: list[np.ndarray]) -> None:
        from .. import compression, optimizer
        op = body.get("op") if isinstance(body, dict) else None
        reply: list[np.ndarray] = []
        if op == "mode":
            self._sync = bool(body.get("sync", True))
        elif op == "optimizer":
            spec = body.get("spec")
            if spec != self._opt_spec:       # installed once; identical repeats are no-ops
                opt = optimizer.from_spec(spec)
                self._updater = optimizer.get_updater(opt)
                self._opt_spec = spec
        elif op == "compression":
            params = body.get("params")
            if params != self._gc_params:
                self._gc = compression.create(params)
                self._gc_params = params
        elif op == "save":
            states = self._states_updater().get_states(bool(body.get("dump", False)))
            reply = [np.frombuffer(states, dtype=np.uint8)]
        elif op == "load":
            if len(arrays) != 1:
                raise ProtocolError("load needs one array of state bytes")
            self._states_updater().set_states(arrays[0].tobytes())
        else:
            raise ProtocolError(f"unknown command {op!r}")
        self._send(ident, Command.DATA if reply else Command.ACK, ts, arrays=reply)

    def _states_updater(self) -> Any:
        if self._updater is None or not hasattr(self._updater, "get_states"):
            raise UnsupportedError("this server has no optimizer: call kv.set_optimizer first")
        return self._updater

    _handlers: dict[Command, Callable[..., None]] = {
        Command.INIT: _on_init, Command.PUSH: _on_push, Command.PULL: _on_pull,
        Command.PUSHPULL: _on_pushpull, Command.RSP_PULL: _on_rsp_pull,
        Command.COMMAND: _on_command, Command.FLUSH: _on_flush,
    }

    # ---- loop ---------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket, poller: zmq.Poller) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn = UdsConn(sock, self.cfg.request_timeout, f"a worker (fd {sock.fileno()})")
            conn.max_bytes = ADMISSION_BYTES     # until it proves it holds the secret
            self._conns[conn.fileno()] = conn
            poller.register(conn.fileno(), zmq.POLLIN)

    def _drop(self, conn: UdsConn) -> None:
        fd = conn.fileno()
        if self._conns.pop(fd, None) is not None and self._poller is not None:
            self._poller.unregister(fd)
        self._admitted.pop(conn, None)
        conn.close()

    def _read_conn(self, conn: UdsConn) -> None:
        for _ in range(64):             # whatever has arrived, a bounded batch
            try:
                # one message at a time: the next one may reuse this one's buffers
                got = conn.read_available(None, 1)
            except ProtocolError as err:
                log.warning("server %d: %s; closing it", self.po.rank, err)
                try:
                    conn.send(Command.ERROR, 0, body={"kind": "ProtocolError",
                                                      "msg": f"malformed message: {err}"})
                except KVStoreError:
                    pass
                self._drop(conn)
                return
            except KVStoreError:         # the worker went away
                self._drop(conn)
                return
            except Exception:            # a server never dies of what a peer sent
                log.exception("server %d: reading from %s failed; dropping it",
                              self.po.rank, conn.peer)
                self._drop(conn)
                return
            if not got:
                return
            self._dispatch(conn, *got[0])
            if conn.fileno() not in self._conns:
                return

    def run(self) -> int:
        """Join the cluster and serve until the scheduler says SHUTDOWN; return 0."""
        try:
            self.po.start()
            poller = self._poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            listening = {lis.fileno(): lis for lis in self._listeners}
            for fd in listening:
                poller.register(fd, zmq.POLLIN)
            last_check = time.monotonic()
            failed_seen = False
            while not self._stop.is_set() and not self.po.shutdown.is_set():
                for what, _ in poller.poll(100):
                    if what is self._sock:
                        for _ in range(1000):
                            if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                                break
                            ident, frames = ZmqVan.recv(self._sock, router=True)
                            assert ident is not None
                            self._handle(ident, frames)
                    elif what in listening:
                        self._accept(listening[what], poller)
                    elif what in self._conns:
                        self._read_conn(self._conns[what])
                now = time.monotonic()
                if now - last_check > 0.5:
                    last_check = now
                    self._check_rounds()
                    for conn in [c for c in self._conns.values() if c.stalled(now)]:
                        log.warning("server %d: %s sent part of a message, then nothing for "
                                    "%g s; dropping it", self.po.rank, conn.peer, conn.timeout)
                        self._drop(conn)
                if self.po.failure is not None and not failed_seen:
                    failed_seen = True
                    for entry in self._entries.values():
                        self._fail_entry(entry, self.po.failure, "NodeFailedError")
                if self.po.scheduler_lost.is_set():
                    # a server on another host (ssh launcher) has no launcher to stop it:
                    # without the scheduler no SHUTDOWN can come, so it exits by itself
                    log.error("server %d: %s; exiting", self.po.rank, self.po.failure)
                    return 1
            self.po.goodbye()
            return 0
        finally:
            for conn in list(self._conns.values()):
                conn.close()
            for lis in self._listeners:
                lis.close()
            self.po.close()
            self._van.close()
            if self._ipc_path is not None:
                try:
                    os.unlink(self._ipc_path)
                except OSError:
                    pass


def _my_address(root_uri: str) -> str:
    """The local address that reaches ``root_uri`` (no packet is sent)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((root_uri, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def run_node(cfg: ClusterConfig, stop: threading.Event | None = None) -> int:
    """Run a scheduler or a server per ``cfg.role`` until the job ends; return its status."""
    if cfg.role == Role.SCHEDULER:
        from .._ps.scheduler import Scheduler
        return Scheduler(cfg, stop).run()
    if cfg.role == Role.SERVER:
        return KVServer(cfg, stop).run()
    raise ConfigError(f"run_node() runs a scheduler or a server, not a {cfg.role.value}. "
                      "Workers create a store with pskv.kv.create('dist_sync').")
