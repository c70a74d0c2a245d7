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
from typing import Any, Callable

import numpy as np
import zmq

from ..errors import (ClusterError, KeyAlreadyInitializedError, KVStoreError, NodeFailedError,
                      ProtocolError, ShapeMismatchError)
from .._ps.auth import Verifier
from .._ps.config import ClusterConfig
from .._ps.message import Command, error_body
from .._ps.postoffice import Postoffice
from .._ps.uds import UdsConn
from .._ps.van import ZmqVan, ipc_path
from ._engine import Engine, Ticket

__all__ = ["ADMISSION_BYTES", "KVServer"]

log = logging.getLogger(__name__)

#: the most a stream connection may send in one message before its HELLO is accepted
ADMISSION_BYTES = 1 << 16


class KVServer:
    """A parameter server's loop. ``run()`` returns 0 after the scheduler's SHUTDOWN."""

    def __init__(self, cfg: ClusterConfig, stop: threading.Event | None = None,
                 engine_class: type[Engine] = Engine) -> None:
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
        self.engine = engine_class(self.po.num_workers, True, self._answer, self._answer_error)

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

    def _error(self, ident: Any, ts: int, err: BaseException) -> None:
        self._send(ident, Command.ERROR, ts, error_body(err))

    def _answer(self, ticket: Ticket) -> None:
        if ticket.cmd == Command.PUSH:      # pushes are not acknowledged one by one
            self._push_done(ticket.peer)
        else:
            self._send(ticket.peer, Command.DATA, ticket.ts, arrays=self.engine.values(ticket))

    def _answer_error(self, ticket: Ticket, err: KVStoreError) -> None:
        self._error(ticket.peer, ticket.ts, err)
        if ticket.cmd == Command.PUSH:
            self._push_done(ticket.peer)

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

    # ---- request handlers --------------------------------------------------------------------
    def _handle(self, ident: bytes, frames: list[Any]) -> None:
        try:
            meta, arrays = ZmqVan.parse(frames)
        except ProtocolError as err:
            log.warning("server %d: malformed message: %s", self.po.rank, err)
            self._error(ident, 0, ProtocolError(f"malformed message: {err}"))
            return
        self._dispatch(ident, meta, arrays)

    def _dispatch(self, ident: Any, meta: Any, arrays: list[np.ndarray]) -> None:
        if meta.cmd == Command.HELLO:
            why = self._verifier.check(meta.body)
            if why is not None:
                log.warning("server %d: refused a connection (%s)", self.po.rank, why)
                self._error(ident, meta.ts,
                            ProtocolError(f"server {self.po.rank} refused this node: {why}"))
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
            self._error(ident, meta.ts, ProtocolError("this node was never admitted"))
            return
        try:
            handler = self._handlers[meta.cmd]
        except KeyError:
            self._error(ident, meta.ts, ProtocolError(f"server does not take {meta.cmd.name}"))
            return
        try:
            handler(self, ident, worker, meta.ts, meta.keys, meta.body, arrays)
        except KVStoreError as err:
            self._error(ident, meta.ts, err)
        except Exception as err:  # a server never dies of a request; the worker hears why
            log.exception("server %d: %s failed", self.po.rank, meta.cmd.name)
            self._error(ident, meta.ts, ClusterError(f"{type(err).__name__}: {err}"))

    def _where(self) -> str:
        return f"server {self.po.rank}"

    def _on_init(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray]) -> None:
        specs = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(specs, list) or len(specs) != len(keys) or len(arrays) != len(keys) \
                or not all(isinstance(spec, dict) for spec in specs):
            raise ProtocolError("INIT needs one entry spec and one array per key")
        for k, spec, arr in zip(keys, specs, arrays):
            if k in self.engine:
                raise KeyAlreadyInitializedError(
                    f"key {spec.get('key')!r} is initialized twice. Each key takes one init.",
                    key=spec.get("key"))
            if tuple(spec.get("shape", ())) != arr.shape:
                raise ShapeMismatchError(f"INIT of key {spec.get('key')!r}: shape "
                                         f"{arr.shape} != declared {spec.get('shape')}")
        for k, spec, arr in zip(keys, specs, arrays):
            self.engine.init(k, arr, spec.get("stype") == "row_sparse", spec.get("key"))
        self._send(ident, Command.ACK, ts)

    def _split_push(self, keys: tuple[int, ...], body: Any,
                    arrays: list[np.ndarray]) -> list[tuple[int, str, list[np.ndarray]]]:
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
            self.engine.entry(k, "push", self._where())
            part = arrays[pos:pos + n]
            self.engine.check_push(k, kind, part, self._where())
            items.append((k, kind, part))
            pos += n
        if pos != len(arrays):
            raise ProtocolError("push carries more arrays than keys")
        return items

    def _on_push(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray], cmd: Command = Command.PUSH) -> None:
        items = self._split_push(keys, body, arrays)     # validate all before any change
        ticket = Ticket(ident, ts, cmd, keys)
        if cmd == Command.PUSH:
            self._open[ident] = self._open.get(ident, 0) + 1
        self.engine.hold(ticket)                         # until every key is queued
        sync = self.engine.sync
        for k, kind, part in items:
            self.engine.push(k, worker, part, kind, ticket if sync else None)
        self.engine.release(ticket)

    def _on_pushpull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                     body: Any, arrays: list[np.ndarray]) -> None:
        self._on_push(ident, worker, ts, keys, body, arrays, Command.PUSHPULL)

    def _on_pull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...], body: Any,
                 arrays: list[np.ndarray], rows: list[np.ndarray] | None = None) -> None:
        for k in keys:
            self.engine.entry(k, "pull", self._where())
        ticket = Ticket(ident, ts, Command.PULL, keys, rows)
        self.engine.hold(ticket)
        for k in keys:
            self.engine.pull(k, worker, ticket)   # after this worker's push of it
        self.engine.release(ticket)

    def _on_rsp_pull(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                     body: Any, arrays: list[np.ndarray]) -> None:
        if len(arrays) != len(keys):
            raise ProtocolError("row_sparse pull needs one row-id array per key")
        for k, rows in zip(keys, arrays):
            n = self.engine.entry(k, "row_sparse_pull", self._where()).shape[0]
            if rows.dtype.kind not in "iu" or (rows.size and (rows.min() < 0 or rows.max() >= n)):
                raise ShapeMismatchError(f"row_sparse_pull: row ids out of [0, {n})", key=k)
        self._on_pull(ident, worker, ts, keys, body, arrays,
                      rows=[r.astype(np.int64) for r in arrays])

    def _on_command(self, ident: bytes, worker: int, ts: int, keys: tuple[int, ...],
                    body: Any, arrays: list[np.ndarray]) -> None:
        op = body.get("op") if isinstance(body, dict) else None
        reply: list[np.ndarray] = []
        if op == "mode":
            self.engine.sync = bool(body.get("sync", True))
        elif op == "optimizer":
            self.engine.set_optimizer_spec(body.get("spec"))
        elif op == "compression":
            self.engine.set_compression(body.get("params"))
        elif op == "save":
            states = self.engine.states_updater("save", self._where()).get_states(
                bool(body.get("dump", False)))
            reply = [np.frombuffer(states, dtype=np.uint8)]
        elif op == "load":
            if len(arrays) != 1:
                raise ProtocolError("load needs one array of state bytes")
            self.engine.states_updater("load", self._where()).set_states(arrays[0].tobytes())
        else:
            raise ProtocolError(f"unknown command {op!r}")
        self._send(ident, Command.DATA if reply else Command.ACK, ts, arrays=reply)

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
                    conn.send(Command.ERROR, 0,
                              body=error_body(ProtocolError(f"malformed message: {err}")))
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
            self.engine.num_workers = self.po.num_workers    # as admitted
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
                    self.engine.check_rounds(self.cfg.round_timeout)
                    for conn in [c for c in self._conns.values() if c.stalled(now)]:
                        log.warning("server %d: %s sent part of a message, then nothing for "
                                    "%g s; dropping it", self.po.rank, conn.peer, conn.timeout)
                        self._drop(conn)
                if self.po.failure is not None and not failed_seen:
                    failed_seen = True
                    self.engine.fail_all(NodeFailedError(self.po.failure))
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
