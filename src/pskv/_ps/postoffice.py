"""Postoffice: a node's link to the scheduler (admission, barriers, heartbeats, failures).

One control thread owns the DEALER socket to the scheduler; other threads talk to it through
a queue and an inproc wake-up socket. What it learns it publishes, and nobody else writes:
an immutable :class:`.membership.Membership` (replaced when a server moves), one queue of
typed events (:meth:`Postoffice.next_event`), ``failure`` and the ``shutdown`` /
``scheduler_lost`` flags. Everything it needs is given at construction. Invariants: after
``start()`` returns the node is admitted and ``membership`` holds its rank and the server
table; ``failure`` is set (and stays set) as soon as the scheduler reports a dead peer or
stops answering; every wait is bounded.

Over 500 lines because it is one protocol's one side (admission, barriers, heartbeats and
the membership they change, on one control thread), whose steps share the link's state.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import socket
import threading
import time
import types
from typing import Any, Callable, Mapping

import zmq

from ..errors import ClusterError, ClusterTimeoutError, NodeFailedError, ProtocolError
from . import validate
from .auth import prove, warn_without_secret
from .crypt import curve_keys, derive, unseal
from .config import ClusterConfig
from .hostid import host_id
from .membership import (Event, Membership, ServerLost, ServerRejoined, ShardMoved,
                         frozen_servers)
from .message import Command, decode, error_from_body, short
from .zeromq import ZmqContext, curve_client, recv_message, send_message

__all__ = ["Postoffice"]

log = logging.getLogger(__name__)
#: seconds between two progress lines of a node waiting to be admitted
WAIT_PROGRESS = 5.0


class Postoffice:
    """The scheduler link of one server or worker.

    Parameters
    ----------
    cfg : ClusterConfig
    zctx : ZmqContext
        Where sockets come from (one per node: no process-wide state).
    endpoints : dict, optional
        A server's data endpoints, announced to the workers through the scheduler (with
        this host's name added as ``host``).
    mode : {'sync', 'async'}, optional
        A worker's store mode: the scheduler refuses a job whose workers disagree.
    idle_hook : callable, optional
        Called by the control thread about every half heartbeat interval (a worker's
        store sends a push it held too long); it must not block, and may run before
        ``start`` returns.
    beat_extra : callable, optional
        What else each heartbeat carries (a dict; a server: which workers closed its sync
        rounds, for the scheduler's straggler view); called on the heartbeat thread.
    """

    def __init__(self, cfg: ClusterConfig, zctx: ZmqContext,
                 endpoints: dict[str, str] | None = None, mode: str | None = None,
                 idle_hook: Callable[[], None] | None = None,
                 beat_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.cfg = cfg
        self.role = cfg.role.value
        self._zctx = zctx
        self.host = socket.gethostname()
        # the endpoints' host says which peers may take the Unix socket (:mod:`.hostid`)
        self._endpoints = {**endpoints, "host": host_id()} if endpoints else {}
        self._ident = f"{self.role}-{os.getpid()}-{id(self):x}".encode()
        self._sock = zctx.socket(zmq.DEALER, identity=self._ident)
        if cfg.encrypt and cfg.transport != "inproc":
            assert cfg.secret is not None        # ClusterConfig checks it
            curve_client(self._sock, curve_keys(cfg.secret, "scheduler")[0])
        self._wake_addr = f"inproc://pskv-po-{id(self):x}"
        self._wake_rx = zctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = zctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[Command, int, Any]] = queue.SimpleQueue()
        self._ts = itertools.count(1)
        self._replies: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.shutdown = threading.Event()
        self.failure: str | None = None
        #: set once the scheduler stopped answering heartbeats: no SHUTDOWN can come any more
        self.scheduler_lost = threading.Event()
        #: what this node knows of its cluster: replaced (never changed) by the control
        #: thread; the properties below read it
        self.membership = Membership(num_workers=cfg.num_workers,
                                     num_servers=cfg.num_servers, mode=mode)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._idle_hook = idle_hook
        #: what the scheduler seals this node's key material under (crypt.seal), and the
        #: number of the last sealed message opened (each is opened once)
        self._seal = b""
        self._sealed = 0
        #: the port this node serves /metrics on, told to the scheduler with each heartbeat
        #: (which lists it for pskv-top), and on which address; None: no metrics
        self.metrics_port: int | None = None
        self.metrics_host = ""
        #: what else a heartbeat carries (a server: which workers closed its sync rounds,
        #: for the scheduler's job-wide straggler view); called on the heartbeat thread
        self.beat_extra = beat_extra

    # ---- the membership, read-only ---------------------------------------------------------
    @property
    def rank(self) -> int:
        """This node's rank in its role (-1 before admission)."""
        return self.membership.rank

    @property
    def num_workers(self) -> int:
        """Workers of the job (as admitted)."""
        return self.membership.num_workers

    @property
    def num_servers(self) -> int:
        """Servers of the job (as admitted)."""
        return self.membership.num_servers

    @property
    def servers(self) -> tuple[Mapping[str, str], ...]:
        """Each server's endpoints, by rank."""
        return self.membership.servers

    @property
    def mode(self) -> str | None:
        """The store mode every worker agreed on."""
        return self.membership.mode

    @property
    def job(self) -> str:
        """This job's id."""
        return self.membership.job

    @property
    def key(self) -> bytes:
        """A worker's pair key with server 0 (:meth:`key_for`)."""
        return self.key_for(0)

    def key_for(self, server: int) -> bytes:
        """A worker's pair key with ``server`` (b"" before admission)."""
        keys = self.membership.keys
        return keys[server] if 0 <= server < len(keys) else b""

    @property
    def worker_keys(self) -> tuple[bytes, ...]:
        """A server's table of every worker's key."""
        return self.membership.worker_keys

    @property
    def server_key(self) -> bytes:
        """A server's key for replication links between servers."""
        return self.membership.server_key

    @property
    def reader_key(self) -> bytes:
        """A server's key for readers of the change stream (b"": none)."""
        return self.membership.reader_key

    @property
    def rejoin(self) -> bool:
        """Whether this node is a restarted one that took a dead node's rank."""
        return self.membership.rejoin

    @property
    def hosts(self) -> tuple[int, ...]:
        """Which server serves each shard, as of admission (:class:`Membership`)."""
        return self.membership.hosts

    def next_event(self) -> Event | None:
        """The next change other components act on (a lost or restarted server), or None."""
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    # ---- admission ------------------------------------------------------------------------
    def start(self) -> None:
        """Say HELLO, answer the scheduler's challenge, and wait (at most
        ``connect_timeout``) to be admitted."""
        # whether a TCP connection to the scheduler's port is up: says, while this node
        # waits and when it gives up, whether nothing answers there or the scheduler is
        # only waiting for the job's other nodes
        who = self.role if self.cfg.rank is None else f"{self.role} {self.cfg.rank}"
        warn_without_secret(who, self.cfg.secret, self.cfg.transport, self.cfg.root_address,
                            self.cfg.node_host)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            self._sock.connect(self.cfg.root_address)
            meta = self._admitted(monitor)
        finally:
            self._sock.disable_monitor()
            monitor.close(linger=0)
        got = validate.admit_reply(self._unsealed(meta.body))
        self.membership = Membership(
            rank=got["rank"], num_workers=got["num_workers"], num_servers=got["num_servers"],
            servers=frozen_servers(got["servers"]), job=got["job"],
            mode=got.get("mode", self.membership.mode),
            keys=tuple(k.encode() for k in got.get("keys", [])),
            worker_keys=tuple(k.encode() for k in got.get("worker_keys", [])),
            server_key=str(got.get("server_key", "")).encode(),
            reader_key=str(got.get("reader_key", "")).encode(),
            rejoin=bool(got.get("rejoin", False)),
            hosts=tuple(got.get("hosts", ())))
        self._thread = threading.Thread(target=self._loop, name=f"pskv-{self.role}-control",
                                        daemon=True)
        self._thread.start()

    def _waiting(self, connected: bool, waited: float) -> str:
        """What this node waiting ``waited`` s for admission is waiting for, in words."""
        who = self.role if self.cfg.rank is None else f"{self.role} {self.cfg.rank}"
        where = self.cfg.root_address
        if not connected:
            return (f"{who} still waiting for the scheduler at {where} ({waited:.0f} s of "
                    f"{self.cfg.connect_timeout:g}): nothing answers there yet. Check "
                    "DMLC_PS_ROOT_URI/PORT and that the scheduler started.")
        return (f"{who} still waiting for the scheduler at {where} to admit it ({waited:.0f} "
                f"s of {self.cfg.connect_timeout:g}): connected, the scheduler waits for the "
                f"job's other nodes ({self.cfg.num_servers} servers and {self.cfg.num_workers}"
                " workers must start and join).")

    def _admitted(self, monitor: zmq.Socket[Any]) -> Any:
        """Say HELLO, answer the scheduler's challenge, and wait for ADMIT (its Meta), with a
        progress line every :data:`WAIT_PROGRESS` seconds; raises ClusterTimeoutError after
        ``connect_timeout`` saying whether the scheduler answered at all."""
        from zmq.utils.monitor import recv_monitor_message
        # inproc:// (a thread cluster) reports no connection events; a CHALLENGE proves it
        connected = self.cfg.root_address.startswith("inproc://")
        body: dict[str, Any] = {"role": self.role, "host": self.host, "pid": os.getpid(),
                                "endpoints": self._endpoints}
        if self.mode is not None:
            body["mode"] = self.mode
        if self.cfg.rank is not None:
            body["rank"] = self.cfg.rank  # DMLC_WORKER_ID / DMLC_SERVER_ID: the scheduler obeys
        send_message(self._sock, Command.HELLO, 1, body=body, copy=True)
        started = time.monotonic()
        deadline = started + self.cfg.connect_timeout
        progress = started + WAIT_PROGRESS
        while True:
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                connected = event == zmq.EVENT_CONNECTED
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                who = self.role if self.cfg.rank is None else f"{self.role} {self.cfg.rank}"
                waited = f"{who} waited {self.cfg.connect_timeout:g} s"
                if not connected:
                    raise ClusterTimeoutError(
                        f"{waited}, and the scheduler at {self.cfg.root_address} did not "
                        "answer: nothing accepted a connection there. Check that the "
                        "scheduler runs and DMLC_PS_ROOT_URI/PORT name it (pskv-launch "
                        "starts it), or raise PSKV_CONNECT_TIMEOUT.")
                raise ClusterTimeoutError(
                    f"{waited} for the scheduler at {self.cfg.root_address} to admit it: "
                    "the scheduler answered, but not every node of the job joined "
                    f"({self.cfg.num_servers} servers and {self.cfg.num_workers} workers "
                    "expected). Check that every node started and made a dist store "
                    "(kv.create('dist_sync'), not 'local'), or raise PSKV_CONNECT_TIMEOUT.")
            if now >= progress:
                log.warning("%s", self._waiting(connected, now - started))
                progress = now + WAIT_PROGRESS
            if not self._sock.poll(int(min(left, progress - now, 0.5) * 1000) + 1):
                continue
            _, frames = recv_message(self._sock)
            try:
                meta, _ = decode(frames)
            except ProtocolError as err:
                raise ProtocolError(f"{self.role}: the scheduler at {self.cfg.root_address} "
                                    f"sent a bad reply: {err}") from None
            if meta.cmd == Command.ERROR:
                msg = meta.body.get("msg") if isinstance(meta.body, dict) else None
                if "proof of the cluster secret" in str(msg):
                    # a scheduler that took the challenge but not the proof: another secret,
                    # or another pskv job's scheduler on the same port
                    raise ClusterError(
                        f"{self.role}: the scheduler at {self.cfg.root_address} refused this "
                        f"node's proof of the cluster secret ({short(msg, 500)}). Either "
                        "PSKV_SECRET is not this job's, or that address is another pskv "
                        "job's scheduler (two jobs on one port): give each job its own "
                        "DMLC_PS_ROOT_PORT (pskv-launch --port).")
                raise ClusterError(f"{self.role}: {short(msg, 2000)}. Check PSKV_SECRET "
                                   "and the cluster size (DMLC_NUM_SERVER/WORKER).")
            if meta.cmd == Command.CHALLENGE:
                connected = True
                if self.cfg.secret is None:
                    raise ClusterError(
                        f"{self.role}: the scheduler at {self.cfg.root_address} asks for "
                        "proof of a cluster secret, and PSKV_SECRET is not set. Set it to "
                        "the job's secret (pskv-launch sets it for every node).")
                proof = prove(self.cfg.secret, "scheduler", meta.body, self.role,
                              self.cfg.rank)
                self._seal = derive(self.cfg.secret, "seal", meta.body["job"],
                                    proof["nonce"])
                send_message(self._sock, Command.HELLO, 2, copy=True,
                             body={**body, **proof})
                continue
            if meta.cmd == Command.ADMIT:
                return meta

    def _unsealed(self, body: Any) -> Any:
        """``body`` with its sealed key material opened (crypt.seal); raises ProtocolError
        for material that does not verify (another secret, or changed on the way)."""
        if not isinstance(body, dict) or "sealed" not in body:
            return body
        if not self._seal:
            raise ProtocolError(f"{self.role}: the scheduler sealed key material, and this "
                                "node proved no secret to it")
        self._sealed, opened = unseal(self._seal, body["sealed"], self._sealed)
        if not isinstance(opened, dict):
            raise ProtocolError(f"{self.role}: sealed key material that is not an object")
        rest = {k: v for k, v in body.items() if k != "sealed"}
        return {**rest, **opened}

    # ---- public calls (any thread) ------------------------------------------------------------
    def check(self) -> None:
        """Raise NodeFailedError if the cluster has failed."""
        if self.failure is not None:
            raise NodeFailedError(self.failure)

    def _post(self, cmd: Command, body: Any) -> int:
        ts = next(self._ts) + 1
        self._outbox.put((cmd, ts, body))
        with self._wake_lock:
            self._wake_tx.send(b"", copy=True)
        return ts

    def barrier(self, group: str = "worker", payload: Any = None,
                timeout: float | None = None,
                poll: Callable[[], None] | None = None) -> dict[str, Any]:
        """Wait until every member of ``group`` arrives; return each member's payload by
        rank. ``poll``: called (no lock held) about every 0.2 s while it waits (a joined
        worker adds its zeros to the collective rounds the others run meanwhile)."""
        self.check()
        ts = self._post(Command.BARRIER, {"group": group, "payload": payload})
        limit = self.cfg.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while ts not in self._replies:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterTimeoutError(
                        f"{self.role} {self.rank} waited {limit:g} s at a barrier of the "
                        f"{group}s. Another {group} has not reached it: check that every "
                        "worker makes the same calls, or raise PSKV_REQUEST_TIMEOUT.")
                self._cond.wait(min(left, 0.2))
                if poll is not None and ts not in self._replies:
                    self._cond.release()
                    try:
                        poll()
                    finally:
                        self._cond.acquire()
            reply = self._replies.pop(ts)
        if isinstance(reply, Exception):
            raise reply
        payloads: dict[str, Any] = reply["payloads"]
        return payloads

    def report_lost(self, role: str, rank: int,
                    endpoints: Mapping[str, str] | None = None) -> None:
        """Tell the scheduler this node's connection to ``role`` ``rank`` broke;
        ``endpoints``: where that node was when the connection was made (a report about a
        node that has been restarted since, elsewhere, is then ignored)."""
        if self._thread is not None and self._thread.is_alive():
            body: dict[str, Any] = {"role": role, "rank": rank}
            if endpoints is not None:
                body["endpoints"] = dict(endpoints)
            self._post(Command.PEER_LOST, body)

    def goodbye(self, retire: bool = False) -> None:
        """Tell the scheduler this node is done (no reply is awaited); ``retire``: a server
        removed from a running job (its backup serves its shard at once)."""
        if self._thread is not None and self._thread.is_alive():
            self._post(Command.GOODBYE, {"retire": True} if retire else None)

    def shard_moved(self, shard: int, host: int, copy: str = "") -> None:
        """Tell the scheduler this server handed ``shard`` to server ``host`` (it has every
        change of it) and kept the copy ``copy`` names; the scheduler tells every node
        (``ShardMoved``)."""
        if self._thread is not None and self._thread.is_alive():
            self._post(Command.SHARD_MOVED, {"shard": shard, "host": host, "copy": copy})

    def close(self, timeout: float = 2.0) -> None:
        """Stop the control thread (after sending anything queued)."""
        self._stop.set()
        if self._thread is not None:
            with self._wake_lock:
                try:
                    self._wake_tx.send(b"", copy=True)
                except zmq.ZMQError:  # pragma: no cover
                    pass
            self._thread.join(timeout)

    # ---- control thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        interval = self.cfg.heartbeat_interval
        last_beat = 0.0
        last_ack = time.monotonic()
        while True:
            events = dict(poller.poll(int(interval * 500) + 1))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            self._flush_outbox()
            if self._stop.is_set():
                return
            if self._idle_hook is not None:
                try:
                    self._idle_hook()
                except Exception:  # pragma: no cover - the hook reports its own errors
                    log.exception("%s: the idle hook failed", self.role)
            if self._sock in events:
                while self._sock.poll(0):
                    _, frames = recv_message(self._sock)
                    try:
                        meta, _ = decode(frames)
                    except ProtocolError as err:  # pragma: no cover - scheduler bug
                        log.error("%s: bad message from the scheduler: %s", self.role, err)
                        continue
                    last_ack = time.monotonic()
                    self._on_message(meta.cmd, meta.ts, meta.body)
            now = time.monotonic()
            if now - last_beat >= interval:
                send_message(self._sock, Command.HEARTBEAT, 0, copy=True,
                             body=self._beat_body())
                last_beat = now
            if now - last_ack > self.cfg.heartbeat_timeout and self.failure is None:
                self._set_failure(f"the scheduler at {self.cfg.root_address} stopped answering "
                                  f"for {now - last_ack:.1f} s")
                self.scheduler_lost.set()

    def _beat_body(self) -> dict[str, Any] | None:
        """A heartbeat's body: the metrics port, and what `beat_extra` adds (None: none)."""
        body: dict[str, Any] = {}
        if self.metrics_port is not None:
            body.update(metrics=self.metrics_port, metrics_host=self.metrics_host)
        if self.beat_extra is not None:
            try:
                body.update(self.beat_extra())
            except Exception:  # pragma: no cover - a heartbeat is never a reason to fail
                log.exception("%s: the heartbeat's extra failed", self.role)
        return body or None

    def _flush_outbox(self) -> None:
        while True:
            try:
                cmd, ts, body = self._outbox.get_nowait()
            except queue.Empty:
                return
            send_message(self._sock, cmd, ts, body=body, copy=True)

    def _on_message(self, cmd: Command, ts: int, body: Any) -> None:
        if cmd == Command.BARRIER_DONE:
            with self._cond:
                self._replies[ts] = body
                self._cond.notify_all()
        elif cmd == Command.NODE_FAILED and isinstance(body, dict) and body.get("failover") \
                and isinstance(body.get("rank"), int):
            log.info("%s %d: %s; its backup takes over", self.role, self.rank,
                        body.get("msg"))
            self._events.put(ServerLost(body["rank"]))
        elif cmd == Command.NODE_FAILED:
            msg = body.get("msg") if isinstance(body, dict) else "a node failed"
            self._set_failure(f"{msg}; this {self.role} cannot go on")
        elif cmd == Command.SHUTDOWN:
            self.shutdown.set()
        elif cmd == Command.NODE_REJOINED:
            try:
                body = self._unsealed(body)
            except ProtocolError as err:
                log.error("%s %d: a NODE_REJOINED that does not verify: %s", self.role,
                          self.rank, err)
                return
            endpoints = body.get("endpoints") if isinstance(body, dict) else None
            if isinstance(body, dict) and body.get("role") == "server" \
                    and isinstance(body.get("rank"), int) \
                    and 0 <= body["rank"] < len(self.servers) \
                    and isinstance(endpoints, dict) \
                    and all(isinstance(v, str) for v in endpoints.values()):
                log.info("%s %d: server %d was %s", self.role, self.rank, body["rank"],
                         "added" if body.get("added") is True else "restarted")
                servers = list(self.membership.servers)
                servers[body["rank"]] = {str(k): v for k, v in endpoints.items()}
                keys = list(self.membership.keys)
                if isinstance(body.get("key"), str) and body["rank"] < len(keys):
                    keys[body["rank"]] = body["key"].encode()   # its new pair key
                self.membership = dataclasses.replace(self.membership,
                                                      servers=frozen_servers(servers),
                                                      keys=tuple(keys))
                self._events.put(ServerRejoined(body["rank"], body.get("handback") is True,
                                                body.get("added") is True))
        elif cmd == Command.SHARD_MOVED:
            got = body if isinstance(body, dict) else {}
            shard, host = got.get("shard"), got.get("host")
            if type(shard) is not int or type(host) is not int or \
                    not 0 <= shard < len(self.servers) or not 0 <= host < len(self.servers):
                log.error("%s %d: a SHARD_MOVED without a shard and a server: %s",
                          self.role, self.rank, short(body, 200))
                return
            log.info("%s %d: shard %d moved to server %d", self.role, self.rank, shard, host)
            copy = got.get("copy")
            self._events.put(ShardMoved(shard, host, copy if isinstance(copy, str) and
                                        len(copy) <= 64 else ""))
        elif cmd == Command.WORKER_LEFT:
            got = body if isinstance(body, dict) else {}
            rank, joined, epoch = got.get("rank"), got.get("joined"), got.get("epoch")
            if type(rank) is not int or not 0 <= rank < self.num_workers \
                    or not isinstance(joined, bool) or type(epoch) is not int or epoch < 0:
                log.error("%s %d: a WORKER_LEFT without a worker's rank, how it left and "
                          "the join epoch: %s", self.role, self.rank, short(body, 200))
                return
            m = self.membership
            if joined:
                self.membership = dataclasses.replace(m, joined=types.MappingProxyType(
                    {**m.joined, rank: max(epoch, m.joined.get(rank, 0))}))
            else:
                self.membership = dataclasses.replace(m, closed=m.closed | {rank})
        elif cmd == Command.ERROR:
            with self._cond:
                self._replies[ts] = error_from_body(body, "the scheduler")
                self._cond.notify_all()

    def _set_failure(self, msg: str) -> None:
        if self.failure is None:
            self.failure = msg
            log.error("%s %d: %s", self.role, self.rank, msg)
        with self._cond:
            self._cond.notify_all()
