"""Primary-backup replication of shards between servers (``PSKV_REPLICAS=1``).

Shard ``x`` (what server ``x`` was placed) has one backup: server ``x + 1`` (mod S) while
server ``x`` serves it, and server ``x`` itself once the backup has taken it over and
``x`` was restarted (:func:`backup_of`). The server that serves a shard sends its backup,
on the loop thread and before it answers anyone, every init, every setting (optimizer,
compression, states) and each applied round's merged value with the round
counters and the optimizer's counts (:class:`Replicator`; the rounds one request closed go
as one ``r_rounds`` message, queued without copies); the backup logs the rounds of
dense keys and applies them when its copy is needed, the others at once
(:mod:`._backup_log`), so both stay bit-identical. A new backup first gets the whole
shard (:func:`encode_copy`): copied in memory on the loop thread (the only pause), then
sent on a thread of its own while the server serves on; the changes made meanwhile are
kept (copied) and follow it, in order, once the backup acknowledged it. Until then the
shard has no backup, as it had none before the copy began, so answers do not wait for it. To a backup on the same host (a plain Unix-socket link) the
batches' arrays go through a ring of shared memory the primary offers (``r_ring``,
:mod:`.._ps.ring`), and the link carries their headers.
Invariant: a request is answered only after the backup acknowledged every change it saw,
or after the backup was found dead (then the shard runs without one until it is back).

The link between servers is admitted like any other (:mod:`.._ps.auth`): the backups'
listener challenges, and a primary proves the servers' key that only servers get from the
scheduler (purpose ``"backup"``, bound to the job and the primary's rank), so a worker,
which holds the cluster secret but not that key, cannot write into a backup.

This module is the primary's side; the backup's (the copies kept, a whole copy
installed, each change applied) is ``_backups``.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import zlib
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import zmq

from ...errors import KVStoreError, NodeFailedError
from ...nd.ndarray import NDArray
from ...optimizer.updater import encode_states
from ...nd.sparse import RowSparseNDArray
from ..._ps.auth import prove
from ..._ps.config import ClusterConfig
from ..._ps.hostid import same_host
from ..._ps.message import Command, Meta, error_from_body
from ..._ps.ops import BACKUP_ENDPOINT, ReplOp, change
from ..._ps.postoffice import Postoffice
from ..._ps.replay import backup_of
from ..._ps.ring import RingWriter, supported as ring_supported
from ..._ps.stream import StreamConn
from ..._ps.tls import client_context
from ..._ps.transport import Connection, connect
from ..._ps.zeromq import ZmqContext
from ..._types import Key
from ._backup_log import (LOG_ROUNDS, counts_of, describe_state, state_arrays)
from ..engine._core import Engine
from ..engine._tables import TableRound
from .._snapshot import ShardCopy

__all__ = ["PURPOSE", "Replicator", "backup_endpoints", "backup_of", "encode_copy"]

log = logging.getLogger(__name__)
#: what a proof on the replication link is made for (auth.py): worthless anywhere else
PURPOSE = "backup"
#: acknowledgments read from the backup at a time (the rest stay buffered for the next read)
ACKS_PER_READ = 64
#: the most bytes of rounds one batch carries (and never over PSKV_MAX_MESSAGE_BYTES, which
#: the backup enforces): a round that would pass it goes in the next message
BATCH_BYTES = 64 << 20


class Replicator:
    """The link from the server that serves ``shard`` to that shard's backup."""

    def __init__(self, cfg: ClusterConfig, zctx: ZmqContext, po: Postoffice, shard: int,
                 backup: int, engine: Engine) -> None:
        # stream sockets always: the backups' listeners are Unix and TCP sockets
        self.cfg = replace(cfg, transport="auto" if cfg.transport != "tcp" else "tcp")
        self._zctx = zctx
        self._po = po
        self.me, self.shard, self.backup, self.engine = po.rank, shard, backup, engine
        self._conn: Connection | None = None
        self._ts = 0
        self._outstanding: set[int] = set()
        #: rounds applied and not sent yet (body, arrays): sent as one message by
        #: :meth:`flush`, before anyone is answered and before their arrays change
        self._batch: list[tuple[dict[str, Any], list[np.ndarray]]] = []
        self._batch_bytes = 0
        #: where the backup's replication listeners are; None while it is dead
        self.endpoints: dict[str, str] | None = None
        #: the backup's endpoints as the scheduler announced them (:meth:`aim`)
        self.announced: Mapping[str, str] | None = None
        #: shared memory the batches' arrays go through to a backup on this host (None:
        #: the link carries them; ``_ps/ring.py``)
        self._ring: RingWriter | None = None
        #: the token of the copy the backup kept when it handed this shard here (its
        #: engine, identical to this one): the first connection names it instead of
        #: sending the whole shard (``Backups.adopt``); used once
        self.have: str | None = None
        #: bytes of the last whole copy sent (the log line says it; bench_reshard reads it)
        self.copied_bytes = 0
        #: the thread sending the whole copy (None: none in flight), what it raised, and
        #: the changes made meanwhile (their arrays copied), sent once it is done
        self._copy: threading.Thread | None = None
        self._copy_error: KVStoreError | None = None
        self._copy_keys = 0
        self._held: list[tuple[ReplOp, dict[str, Any], list[np.ndarray]]] = []
        #: guards ``_held`` and ``_copy_over`` between the loop thread and the copy thread
        self._copy_lock = threading.Lock()
        #: the copy thread has sent the whole copy and every change kept meanwhile: the
        #: loop thread sends from now on
        self._copy_over = True

    def aim(self, announced: Mapping[str, str]) -> None:
        """The backup is the server the scheduler announced at ``announced`` (the next
        change connects to it): a broken link is reported as that process's loss."""
        self.announced = announced
        self.endpoints = backup_endpoints(announced)

    @property
    def up(self) -> bool:
        """Whether the backup is connected and has its whole copy (else changes are not
        replicated, or are kept until the copy is in place)."""
        if self._copy is not None and self._copy_over:
            self._poll_copy(wait=None)      # over: the thread is ending
        return self._conn is not None and self._copy is None

    @property
    def copying(self) -> bool:
        """Whether the whole copy is still on its way to the backup."""
        return self._copy is not None and not self.up

    @property
    def pending(self) -> int:
        """Changes sent to the backup and not acknowledged yet (replication lag)."""
        return len(self._outstanding)

    def _connect(self, endpoints: dict[str, str]) -> None:
        """Connect to the backup, say HELLO (as a server), send it the whole shard."""
        tls = client_context(*self.cfg.tls) if self.cfg.tls is not None else None
        conn = connect(self.cfg, endpoints, same_host(endpoints),
                       f"server {self.backup} (backup of shard {self.shard})", self._zctx, tls,
                       (self._po.server_key, "server", self.me))
        self._conn = conn
        hello: dict[str, Any] = {"role": "server", "rank": self.me}
        challenge = self._call(Command.HELLO, hello, ())
        if challenge.cmd == Command.CHALLENGE:
            self._call(Command.HELLO, {**hello, **prove(self._po.server_key, PURPOSE,
                                                        challenge.body, "server", self.me)}, ())
        have, self.have = self.have, None
        if have is not None:
            got = self._call(Command.COMMAND, change(ReplOp.NOOP, self.shard, {"have": have}),
                             ())
            if isinstance(got.body, dict) and got.body.get("have") is True:
                self.copied_bytes = 0
                log.info("server %d: server %d is the backup of shard %d (it kept its copy "
                         "when it handed the shard here: 0 bytes)", self.me, self.backup,
                         self.shard)
                self._open_ring(conn)
                return
        body, arrays = encode_copy(self.engine.snapshot(), self.engine.sync,
                                   self.engine.stream_states())
        self.copied_bytes = sum(int(a.nbytes) for a in arrays)
        self._copy_keys = len(body["entries"])
        self._copy_error, self._copy_over = None, False
        self._copy = threading.Thread(target=self._send_copy, args=(body, arrays),
                                      name=f"pskv-copy-shard-{self.shard}", daemon=True)
        self._copy.start()

    def _send_copy(self, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """The copy thread: the whole shard to the backup, then the changes kept meanwhile,
        in order, until none is left, each batch acknowledged (the loop thread touches the
        link only once this is over, and only keeps changes until then)."""
        try:
            self._call(Command.COMMAND, change(ReplOp.STATE, self.shard, body), arrays)
            while True:
                with self._copy_lock:
                    held, self._held = self._held, []
                    if not held:
                        self._copy_over = True
                        return
                assert self._conn is not None
                for op, one, arrs in held:
                    self._ts += 1
                    self._outstanding.add(self._ts)
                    self._conn.send(Command.COMMAND, self._ts, (),
                                    change(op, self.shard, one), arrs)
                self._wait()
        except Exception as err:    # its link closed under it (close()), or broke
            lost = err if isinstance(err, KVStoreError) else NodeFailedError(
                f"the copy to server {self.backup} stopped: {type(err).__name__}: {err}")
            with self._copy_lock:
                self._copy_error, self._copy_over, self._held = lost, True, []

    def _poll_copy(self, wait: float | None = 0.0) -> None:
        """If the whole copy is over (or once it is, within ``wait`` seconds; None: for as
        long as it takes): the changes kept meanwhile follow it, in order, then the ring."""
        thread = self._copy
        assert thread is not None
        thread.join(wait)
        if thread.is_alive():
            return
        self._copy = None
        if self._copy_error is not None:
            err, self._copy_error = self._copy_error, None
            self._lost(err)
            return
        log.info("server %d: server %d is the backup of shard %d (%d keys copied, %d bytes)",
                 self.me, self.backup, self.shard, self._copy_keys, self.copied_bytes)
        try:
            assert self._conn is not None
            self._open_ring(self._conn)
        except KVStoreError as err:
            self._lost(err)

    def _open_ring(self, conn: Connection) -> None:
        """Offer the backup a ring (``_ps/ring.py``) where the link is a plain Unix socket
        on this host; a backup that cannot map it says so, and the link carries on."""
        if self.cfg.backup_ring_bytes <= 0 or self.cfg.encrypt or not ring_supported() or \
                _unix_socket(conn) is None:
            return
        try:
            ring = RingWriter(self.cfg.backup_ring_bytes)
        except OSError as err:      # no memory for it: the socket it is
            log.info("server %d: no ring for the backup of shard %d (%s)", self.me,
                     self.shard, err)
            return
        try:
            self._call(Command.COMMAND, change(ReplOp.RING, self.shard,
                                               {"bytes": ring.size}), (), fds=[ring.fd])
        except NodeFailedError:
            ring.close()
            raise
        except KVStoreError as err:     # it answered: the link is fine, the ring is not
            ring.close()
            log.info("server %d: the backup of shard %d (server %d) does not map a ring "
                     "(%s); the link carries the rounds", self.me, self.shard, self.backup,
                     err)
            return
        self._ring = ring

    def close(self) -> None:
        """Forget the backup (it died, or another takes its place)."""
        if self._copy is not None:          # the copy thread ends once its link is closed
            if self._conn is not None:
                self._conn.close()
            self._copy.join(self.cfg.request_timeout)
            self._copy, self._copy_error, self._held = None, None, []
            self._copy_over = True
        self._outstanding.clear()
        self._batch.clear()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._batch_bytes = 0
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, op: ReplOp, body: dict[str, Any], arrays: list[np.ndarray] | tuple[()] = (),
             wait: bool = True) -> None:
        """One change of the shard. ``wait``: return once the backup has applied it and
        every change before it (or is found dead); else :meth:`drain` waits for it."""
        if op is not ReplOp.ROUNDS:
            self.flush()            # the rounds before this change go first
        if self._copy is not None:
            with self._copy_lock:
                if not self._copy_over:     # kept, copied, for the copy thread to send
                    self._held.append((op, body, [np.array(a, copy=True) for a in arrays]))
                    return
            self._poll_copy(wait=None)      # over: the loop thread sends from now on
        if (self._conn is None and self.endpoints is None) or \
                (op is ReplOp.NOOP and self._conn is not None):
            return
        try:
            if self._conn is None:
                assert self.endpoints is not None
                self._connect(self.endpoints)
                if op.applied_first:
                    return      # the whole copy just taken has it already
                if self._copy is not None:      # it follows the copy
                    with self._copy_lock:
                        if not self._copy_over:
                            self._held.append((op, body,
                                               [np.array(a, copy=True) for a in arrays]))
                            return
                    self._poll_copy(wait=None)
            self._ts += 1
            self._outstanding.add(self._ts)
            assert self._conn is not None
            self._conn.send(Command.COMMAND, self._ts, (), change(op, self.shard, body),
                            arrays)
            if wait:
                self._wait()
        except KVStoreError as err:
            self._lost(err)

    def flush(self) -> None:
        """Send the rounds queued by :meth:`round` as one ``r_rounds`` message (one
        header, one acknowledgment; the arrays in the ring or in the message), without
        waiting."""
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        flat = [a for _, arrays in batch for a in arrays]
        entries = self._ring.place(flat) if self._ring is not None else None
        if entries is not None:     # in shared memory: the message names where
            self.send(ReplOp.ROUNDS, {"rounds": [body for body, _ in batch],
                                      "arrays": [len(arrays) for _, arrays in batch],
                                      "ring": entries}, (), wait=False)
            return
        self.send(ReplOp.ROUNDS, {"rounds": [body for body, _ in batch],
                                  "arrays": [len(arrays) for _, arrays in batch]},
                  [a for _, arrays in batch for a in arrays], wait=False)

    def drain(self, copy: bool = False) -> None:
        """Send the queued rounds, and wait until the backup has applied every change sent
        (before answering anyone); not for a backup still getting its whole copy, unless
        ``copy`` (then for the copy too: a handback)."""
        self.flush()
        if self._copy is not None:
            if not copy:
                return
            self._poll_copy(wait=None)
        if self._outstanding:
            try:
                self._wait()
            except KVStoreError as err:
                self._lost(err)

    def _lost(self, err: KVStoreError) -> None:
        broke = isinstance(err, NodeFailedError)
        if broke:      # its link broke: the scheduler hears it, and warns of the death once
            self._po.report_lost("server", self.backup, self.announced)
        # a backup that is alive but dropped (it stopped answering) has no other warning
        log.log(logging.INFO if broke else logging.WARNING,
                "server %d: the backup of shard %d (server %d) is lost (%s); the shard "
                "runs without a backup until it is back", self.me, self.shard, self.backup,
                err)
        self.close()
        self.endpoints = None

    def _call(self, cmd: Command, body: Any, arrays: Any, fds: list[int] | None = None) \
            -> Meta:
        """Send one message (``fds`` passed along it: a StreamConn's) and wait for its
        answer (and every earlier one's)."""
        conn = self._conn
        assert conn is not None
        self._ts += 1
        self._outstanding.add(self._ts)
        if fds:
            assert isinstance(conn, StreamConn)
            conn.send(cmd, self._ts, (), body, arrays, fds=fds)
        else:
            conn.send(cmd, self._ts, (), body, arrays)
        last = self._wait()
        assert last is not None
        return last

    def _wait(self) -> Meta | None:
        """Read the backup's acknowledgments until none is outstanding; the last one."""
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + self.cfg.request_timeout
        poller = zmq.Poller()
        poller.register(conn.pollable(), zmq.POLLIN)
        last: Meta | None = None
        while self._outstanding:
            got = conn.receive(None, ACKS_PER_READ)
            for meta, _arrays in got:
                self._outstanding.discard(meta.ts)
                last = meta
                if meta.cmd == Command.ERROR:
                    raise error_from_body(meta.body, f"server {self.backup}")
            if not self._outstanding:
                return last
            if len(got) == ACKS_PER_READ:
                # more may wait in the connection's read buffer, where poll does not see
                # them: read on (polling here slept 0.5 s whenever a step had over 64
                # rounds to acknowledge)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVStoreError(f"no answer from server {self.backup} in "
                                   f"{self.cfg.request_timeout:g} s")
            poller.poll(int(min(left, 0.5) * 1000) + 1)
        return last

    # ---- what the engine and the server replicate ------------------------------------------
    def round(self, key: Key, merged: NDArray | TableRound, rnd: int,
              applied: dict[int, int]) -> None:
        """The engine's ``replicate`` hook: one applied round (or async push) of ``key``,
        queued until :meth:`flush` (the arrays are not copied: the caller flushes before
        they change, and before anyone is answered)."""
        if self._conn is None and self.endpoints is None:
            return                  # no backup: nothing to keep
        counters = {"key": key, "round": rnd, "applied": [[w, n] for w, n in applied.items()]}
        marks = self.engine.marks_of(key)
        if marks:
            counters["marks"] = marks
        if isinstance(merged, TableRound):      # a table shard's changed rows
            fields = list(merged.arrays)
            self._queue({**counters, "kind": "t", "fields": fields, "table": merged.meta},
                        [np.ascontiguousarray(merged.arrays[f]) for f in fields])
        elif isinstance(merged, RowSparseNDArray):
            self._queue({**counters, "kind": "r"},
                        [np.ascontiguousarray(merged._indices),
                         np.ascontiguousarray(merged._data)])
        else:       # acknowledged before any answer: KVServer._send drains first
            self._queue(*self._dense(key, merged, rnd, counters))

    def _queue(self, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Queue one round for :meth:`flush`, after the queued ones if they fit together."""
        size = sum(a.nbytes for a in arrays)
        if self._batch and self._batch_bytes + size > min(BATCH_BYTES,
                                                          self.cfg.max_message_bytes):
            self.flush()
        self._batch.append((body, arrays))
        self._batch_bytes += size

    def _dense(self, key: Key, merged: NDArray, rnd: int,
               counters: dict[str, Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
        """A dense round for the backup: to be logged (``"l"``), or every LOG_ROUNDS-th
        round of the key its whole value and state instead (``"f"``), with the
        optimizer's counts (``_backup_log``); applied at once (``"d"``) where the log
        cannot carry the key's state."""
        body: dict[str, Any] = {**counters, "kind": "d"}
        arrays = [np.ascontiguousarray(merged._data)]
        counts = counts_of(self.engine, key)
        if counts is None:
            return body, arrays
        body["count"], body["nu"] = counts
        upd: Any = self.engine.updater
        state = upd.states.get(self.engine.entry_name(key))
        try:
            desc = describe_state(state)
        except ValueError:
            return body, arrays
        if (rnd + zlib.crc32(repr(key).encode())) % LOG_ROUNDS:
            body["kind"] = "l"
            return body, arrays
        body.update(kind="f", state=desc)
        stored = self.engine.value_of(key, "replicate")
        return body, [np.ascontiguousarray(stored._data), *state_arrays(state)]


def encode_copy(copy: ShardCopy, sync: bool,
                streams: Mapping[Key, tuple[dict[str, np.ndarray], dict[str, Any]]] | None = None
                ) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A whole shard as one replication message (JSON body, arrays; no pickle); with
    ``streams`` (:meth:`Engine.stream_states`), each table's change stream too, so the
    backup goes on with it (E8)."""
    arrays: list[np.ndarray] = []
    entries: list[dict[str, Any]] = []
    tables: list[tuple[int, dict[str, np.ndarray]]] = []
    for e, a in zip(copy.entries, copy.arrays, strict=True):
        if isinstance(a, dict):         # a table shard: its state's arrays after the rest
            tables.append((len(entries), a))
            a = np.zeros(0)
        entries.append(e)
        arrays.append(a)
    states = None
    if copy.states is not None:
        arrays.append(np.frombuffer(encode_states(copy.states), dtype=np.uint8))
        states = len(arrays) - 1
    entries = [dict(e) for e in entries]
    for i, named in tables:
        entries[i]["fields"] = {f: len(arrays) + j for j, f in enumerate(named)}
        arrays.extend(np.ascontiguousarray(v) for v in named.values())
        got = (streams or {}).get(entries[i]["id"])
        if got is not None:
            entries[i]["stream"] = {**got[1], "fields": {
                f: len(arrays) + j for j, f in enumerate(got[0])}}
            arrays.extend(np.ascontiguousarray(v) for v in got[0].values())
    return ({"entries": entries, "optimizer": copy.optimizer, "sent": copy.sent,
             "states": states, "compression": copy.compression, "sync": sync}, arrays)


def _unix_socket(conn: Connection) -> socket.socket | None:
    """The socket of a plain (not sealed, not TLS) Unix-socket stream link, else None:
    the only links a ring goes beside (``_ps/ring.py``)."""
    sock = getattr(conn, "sock", None)
    if type(conn) is not StreamConn or conn.tls or sock is None or \
            sock.family != socket.AF_UNIX:
        return None
    return sock


def backup_endpoints(endpoints: Mapping[str, str]) -> dict[str, str]:
    """A server's announced endpoints -> those of its backups' listeners."""
    got = {k[len(BACKUP_ENDPOINT):]: v for k, v in endpoints.items()
           if k.startswith(BACKUP_ENDPOINT)}
    got["host"] = endpoints.get("host", "")
    return got
