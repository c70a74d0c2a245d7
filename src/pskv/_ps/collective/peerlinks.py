"""The collective path's links: one authenticated stream connection per pair of workers.

The lower rank of each pair connects, over a Unix socket within a host (the listener lets
only this user's processes in: SO_PEERCRED), TCP (TLS with ``PSKV_TLS_*``) between hosts.
Each worker draws a random key; the keys and listeners travel through the scheduler in the
init barrier that puts the first key on the path (:meth:`PeerLinks.listen`), and each side
proves its rank with an HMAC over the other's nonce (:mod:`.auth`), so a process that knows
the addresses cannot join or speak as a worker. A Unix-socket link keeps the descriptors a
peer passes with its messages from the first byte on (:meth:`.stream.StreamConn.keep_fds`)
when this worker shares memory (``PSKV_COLLECTIVE_SHM``); a pair shares
memory when both ends said so in the barrier (:attr:`Links.shm`).

Invariants: every wait is bounded by ``PSKV_CONNECT_TIMEOUT`` (a handshake by
``PSKV_HANDSHAKE_TIMEOUT``); a connection that fails its handshake is closed, with its
inbox, and never returned.
"""
from __future__ import annotations

import hmac
import logging
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Mapping

from ...errors import (ClusterError, ClusterTimeoutError, KVStoreError, NodeFailedError,
                      ProtocolError)
from ..auth import new_key, prove
from ..config import ClusterConfig, advertised_host
from ..hostid import host_id, same_host
from ..limits import ADMISSION_BYTES
from ..message import Command, Meta, error_body, error_from_body
from ..shm import FdInbox, seals_writes, supported
from ..stream import StreamConn, StreamListener, ipc_path
from ..tls import client_context, server_context

__all__ = ["Links", "PeerLinks"]

log = logging.getLogger(__name__)

_ACCEPTOR = "collective-acceptor"     # what the accepting side proves (auth purposes)
_CONNECTOR = "collective"


@dataclass
class Links:
    """What :meth:`PeerLinks.connect` made: a connection per peer, the inbox of each
    Unix-socket one, and the peers this worker shares memory with."""

    conns: dict[int, StreamConn] = field(default_factory=dict)
    inboxes: dict[int, FdInbox] = field(default_factory=dict)
    shm: set[int] = field(default_factory=set)


class PeerLinks:
    """Listening for and making the links of one worker to the others.

    Parameters
    ----------
    cfg : ClusterConfig
    rank, num_workers : int
    job : str
        The job's id (bound into every proof).
    """

    def __init__(self, cfg: ClusterConfig, rank: int, num_workers: int, job: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.peers = [p for p in range(num_workers) if p != rank]
        self._job = job
        self._key = new_key().encode()
        self._listeners: list[StreamListener] = []

    def listen(self) -> dict[str, str]:
        """Open this worker's listeners; what the peers need to connect (sent through the
        scheduler in an init barrier): the endpoints, the host, this worker's key, and
        whether it shares memory."""
        if not self._listeners:
            tls = server_context(*self.cfg.tls) if self.cfg.tls is not None else None
            host = advertised_host(self.cfg.node_host, self.cfg.root_uri)
            self._listeners.append(StreamListener(host=self.cfg.node_host, advertise=host,
                                                  tls=tls))
            self._listeners.append(StreamListener(path=ipc_path("worker")))
        return {"tcp": self._listeners[0].endpoint, "uds": self._listeners[1].endpoint,
                "host": host_id(), "key": self._key.decode(),
                "shm": "1" if self._shm_on() else "0"}

    def _shm_on(self) -> bool:
        return self.cfg.collective_shm and supported() and seals_writes()

    def connect(self, peers: Mapping[int, Mapping[str, str]]) -> Links:
        """Link to every peer (their :meth:`listen` answers, by rank). Collective: every
        worker calls it after the same barrier; each connects to the higher ranks, then
        accepts the lower ones (no cycle can wait)."""
        keys: dict[int, bytes] = {}
        for p in self.peers:
            info = peers.get(p)
            if not isinstance(info, Mapping) or not isinstance(info.get("key"), str):
                raise ClusterError(f"worker {self.rank}: worker {p} sent no collective "
                                   "endpoint at the init barrier (a mismatched "
                                   "PSKV_COLLECTIVE_BYTES?)")
            keys[p] = str(info["key"]).encode()
        deadline = time.monotonic() + self.cfg.connect_timeout
        links = Links()
        try:
            for p in self.peers:
                if p > self.rank:
                    links.conns[p] = self._dial(p, peers[p], keys[p], deadline)
            self._accept_lower(links.conns, keys, deadline)
        except BaseException:
            for conn in links.conns.values():
                self._close_link(conn)
            raise
        for p, conn in links.conns.items():
            if conn.fds is not None:
                links.inboxes[p] = conn.fds
                if peers[p].get("shm") == "1":    # both ends on one host, both willing
                    links.shm.add(p)
        return links

    def _unix(self, conn: StreamConn) -> StreamConn:
        """Keep the descriptors a Unix-socket link passes, when this worker shares memory."""
        if self._shm_on():
            conn.keep_fds()
        return conn

    def _close_link(self, conn: StreamConn) -> None:
        conn.close()        # with the descriptors it kept

    def _open(self, where: str, p: int) -> StreamConn:
        """A connection to worker ``p`` at ``where`` (TLS on TCP with ``PSKV_TLS_*``)."""
        tls = client_context(*self.cfg.tls) \
            if self.cfg.tls is not None and where.startswith("tcp:") else None
        return StreamConn.connect(where, self.cfg.request_timeout, f"worker {p}", tls)

    def _dial(self, p: int, info: Mapping[str, str], key: bytes, deadline: float) \
            -> StreamConn:
        where = info.get("uds") if same_host(info) and self.cfg.transport != "tcp" \
            else info.get("tcp")
        if not isinstance(where, str):
            raise ClusterError(f"worker {self.rank}: worker {p} announced no endpoint")
        try:
            conn = self._unix(self._open(where, p))
        except NodeFailedError as err:
            # a Unix socket in a network namespace the host identity could not tell apart
            if where.startswith("tcp:") or not isinstance(info.get("tcp"), str):
                raise
            log.debug("worker %d: %s; trying its TCP endpoint", self.rank, err)
            conn = self._open(info["tcp"], p)
        try:
            nonce = new_key()
            conn.send(Command.HELLO, 1, body={"role": "worker", "rank": self.rank,
                                              "nonce": nonce})
            meta = _read_one(conn, deadline, f"worker {p}'s challenge")
            body = meta.body if isinstance(meta.body, dict) else {}
            want = prove(key, _ACCEPTOR, {"nonce": nonce, "job": self._job}, "worker", p)
            if meta.cmd != Command.CHALLENGE or body.get("job") != self._job or \
                    not hmac.compare_digest(str(body.get("proof", "")).encode(),
                                            want["proof"].encode()):
                raise ClusterError(f"worker {self.rank}: the collective endpoint of worker "
                                   f"{p} ({where}) did not prove it is worker {p} of this "
                                   "job. Check that nothing else listens there.")
            conn.send(Command.HELLO, 2, body={
                "role": "worker", "rank": self.rank,
                **prove(self._key, _CONNECTOR, body, "worker", self.rank)})
            meta = _read_one(conn, deadline, f"worker {p}'s admission")
            if meta.cmd != Command.ADMIT:
                raise error_from_body(meta.body, f"worker {p}") \
                    if meta.cmd == Command.ERROR else \
                    ProtocolError(f"worker {p} answered {meta.cmd.name} to a HELLO")
        except BaseException:
            self._close_link(conn)
            raise
        return conn

    def _accept_lower(self, conns: dict[int, StreamConn], keys: dict[int, bytes],
                      deadline: float) -> None:
        """Admit one connection from each lower rank; a stranger's is closed."""
        want = {p for p in self.peers if p < self.rank}
        while want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterTimeoutError(
                    f"worker {self.rank} waited {self.cfg.connect_timeout:g} s for worker"
                    f"{'s' if len(want) > 1 else ''} {', '.join(map(str, sorted(want)))} to "
                    "open its collective link. Check that every worker reached the same "
                    "kv.init, or raise PSKV_CONNECT_TIMEOUT.")
            ready = _readable([ls.sock for ls in self._listeners], min(left, 0.2))
            for ls in self._listeners:
                if ls.sock.fileno() not in ready:
                    continue
                for conn in ls.accept(self.cfg.handshake_timeout, 8):
                    conn.max_bytes = ADMISSION_BYTES
                    self._unix(conn)
                    try:
                        p = self._admit(conn, keys, want, deadline)
                    except KVStoreError as err:
                        log.warning("worker %d: refused a collective link: %s", self.rank, err)
                        self._close_link(conn)
                        continue
                    conns[p] = conn
                    want.discard(p)

    def _admit(self, conn: StreamConn, keys: dict[int, bytes], want: set[int],
               deadline: float) -> int:
        limit = min(deadline, time.monotonic() + self.cfg.handshake_timeout)
        meta = _read_one(conn, limit, "a collective HELLO")
        body = meta.body if isinstance(meta.body, dict) else {}
        p, cnonce = body.get("rank"), body.get("nonce")
        if meta.cmd != Command.HELLO or type(p) is not int or p not in want or \
                not isinstance(cnonce, str) or len(cnonce) > 256:
            raise ProtocolError(f"a HELLO that names no lower worker still to link ({p!r})")
        nonce = new_key()
        conn.send(Command.CHALLENGE, meta.ts, body={
            "nonce": nonce, "job": self._job,
            "proof": prove(self._key, _ACCEPTOR, {"nonce": cnonce, "job": self._job},
                           "worker", self.rank)["proof"]})
        meta = _read_one(conn, limit, f"worker {p}'s proof")
        body = meta.body if isinstance(meta.body, dict) else {}
        good = prove(keys[p], _CONNECTOR, {"nonce": nonce, "job": self._job}, "worker", p)
        if meta.cmd != Command.HELLO or body.get("rank") != p or not hmac.compare_digest(
                str(body.get("proof", "")).encode(), good["proof"].encode()):
            conn.send(Command.ERROR, meta.ts, body=error_body(ClusterError(
                f"worker {self.rank} refused a collective link: a wrong proof of worker {p}")))
            raise ProtocolError(f"a wrong proof of worker {p}")
        conn.send(Command.ADMIT, meta.ts, body={"rank": self.rank})
        conn.peer = f"worker {p}"
        return p

    def close(self) -> None:
        """Stop listening."""
        for ls in self._listeners:
            ls.close()
        self._listeners.clear()


def _read_one(conn: StreamConn, deadline: float, what: str) -> Meta:
    """One message from ``conn`` (a handshake's), waiting at most until ``deadline``."""
    while True:
        got = conn.receive(None, 1)
        if got:
            return got[0][0]
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterTimeoutError(f"waited too long for {what} ({conn.peer})")
        _readable([conn.sock], min(left, 0.2))


def _readable(socks: list[socket.socket], timeout: float) -> set[int]:
    """The descriptors of ``socks`` with something to read within ``timeout`` seconds
    (poll, not select: any descriptor number)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock.fileno(), select.POLLIN)
    return {fd for fd, _ in poller.poll(max(1, int(timeout * 1000)))}
