"""``pskv.stream``: read tables' change streams from outside the job, taking no worker slot.

A :class:`Reader` proves the job's secret to the scheduler (like ``pskv-top --scheduler``),
which answers with the servers, which server serves each shard, and a *reader key* per
server; with it the reader connects to the servers, proves that key, checks each
server's proof, and may then read change streams (``Op.CHANGES``) and nothing else: a
reader cannot push, pull, look up or change anything (docs/security.md). When a server
dies, the reader asks the scheduler again and reads the shard from its backup, where the
stream goes on (E8). ``reader.subscribe(key)`` returns the same
:class:`~pskv.kv.Subscription` as ``kv.subscribe`` (docs/embeddings.md, "The change
stream").
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Mapping

import zmq

from .errors import (ClusterError, ConfigError, NodeFailedError,
                     ProtocolError)
from ._ps.auth import check_server, prove
from ._ps.config import ClusterConfig
from ._ps.crypt import curve_keys, derive, unseal
from ._ps.hostid import same_host
from ._ps.message import Command, decode, error_from_body, short
from ._ps.partition import ps_key
from ._ps.tls import client_context
from ._ps.transport import Connection, connect
from ._ps.validate import READER, reader_reply
from ._ps.zeromq import ZmqContext, curve_client, recv_message, send_message
from .kvstore._args import check_key
from .kvstore._subscription import Subscription, check_subscribe
from .kvstore.dist._tables import ask_changes
from .table._stream import PAGE_ROWS

__all__ = ["Reader"]

log = logging.getLogger(__name__)


class Reader:
    """A reader of the job's table change streams (no worker slot, read-only).

    Parameters
    ----------
    cfg : ClusterConfig, optional
        Where the scheduler is and the job's secret, transport and timeouts (default:
        from the environment, as a worker reads it: ``DMLC_PS_ROOT_URI``,
        ``DMLC_PS_ROOT_PORT``, ``PSKV_SECRET``...; :meth:`from_env`).
    timeout : float
        Seconds to wait for the scheduler (the job may still be starting) and for a
        shard's server after a failover.

    Examples
    --------
    A process started beside a job (``pskv-launch`` gives it the job's variables)::

        reader = pskv.stream.Reader.from_env()
        sub = reader.subscribe('emb')
        for batch in sub.poll(): ...
    """

    def __init__(self, cfg: ClusterConfig | None = None, timeout: float = 60.0) -> None:
        self.cfg = cfg if cfg is not None else ClusterConfig.from_env(role="worker")
        self.timeout = float(timeout)
        self._zctx = ZmqContext()
        self._conns: dict[int, Connection] = {}
        self._ts = 0
        self._closed = False
        self._job = ""
        self._servers: list[Mapping[str, str]] = []
        self._hosts: list[int] = []
        self._keys: list[bytes] = []
        self._ask_scheduler()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 timeout: float = 60.0) -> Reader:
        """A reader of the job whose variables ``environ`` (default ``os.environ``) holds."""
        return cls(ClusterConfig.from_env(environ, role="worker"), timeout)

    @property
    def num_servers(self) -> int:
        """How many servers (and shards) the job has."""
        return len(self._servers)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close every link (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._zctx.close()

    # ---- the scheduler ------------------------------------------------------------------
    def _ask_scheduler(self) -> None:
        """Learn the servers, which serves each shard, and the reader keys: retried
        (the job may be starting) until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                got = self._ask_once(min(5.0, max(0.1, deadline - time.monotonic())))
                break
            except ClusterError as err:
                if time.monotonic() >= deadline:
                    raise ClusterError(f"a reader of {self.cfg.root_address} got no answer "
                                       f"it could use in {self.timeout:g} s: {err}") from err
                time.sleep(0.2)
        self._job = got["job"]
        self._servers, self._hosts = got["servers"], got["hosts"]
        self._keys = [k.encode() for k in got["reader_keys"]]
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def _ask_once(self, timeout: float) -> dict[str, Any]:
        cfg, secret = self.cfg, self.cfg.secret
        sock = self._zctx.socket(zmq.DEALER)
        try:
            if cfg.encrypt and secret and cfg.transport != "inproc":
                curve_client(sock, curve_keys(secret, "scheduler")[0])
            sock.connect(cfg.root_address)
            hello: dict[str, Any] = {"role": READER}
            send_message(sock, Command.HELLO, 1, body=hello, copy=True)
            sealing = b""
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise ClusterError(f"the scheduler at {cfg.root_address} did not answer "
                                       f"within {timeout:g} s")
                _, frames = recv_message(sock)
                meta, _ = decode(frames)
                if meta.cmd == Command.CHALLENGE:
                    if not secret:
                        raise ConfigError(f"the scheduler at {cfg.root_address} asks for proof "
                                          "of the job's secret and PSKV_SECRET is not set. "
                                          "Set it to the job's secret.")
                    proof = prove(secret, "scheduler", meta.body, READER, None)
                    sealing = derive(secret, "seal", str(meta.body["job"]), proof["nonce"])
                    send_message(sock, Command.HELLO, 2, body={**hello, **proof}, copy=True)
                    continue
                if meta.cmd == Command.ACK:
                    body = meta.body
                    if isinstance(body, dict) and "sealed" in body:
                        if not sealing:
                            raise ProtocolError("the scheduler sealed the reader keys, and "
                                                "this reader proved no secret")
                        _n, opened = unseal(sealing, body["sealed"])
                        body = {**{k: v for k, v in body.items() if k != "sealed"},
                                **(opened if isinstance(opened, dict) else {})}
                    return reader_reply(body)
                if meta.cmd == Command.ERROR:
                    err = error_from_body(meta.body, "the scheduler")
                    if isinstance(err, ClusterError) and "not started" in str(err):
                        raise err
                    raise ConfigError(f"the scheduler at {cfg.root_address} refused this "
                                      f"reader: {err}. Set PSKV_SECRET to the job's secret.")
                raise ProtocolError(f"the scheduler answered a reader with {meta.cmd.name}")
        finally:
            sock.close(linger=0)

    # ---- the servers --------------------------------------------------------------------
    def _link(self, shard: int) -> tuple[Connection, int]:
        """The link to the server serving ``shard`` now (connected and proved once)."""
        host = self._hosts[shard]
        conn = self._conns.get(host)
        if conn is not None:
            return conn, host
        endpoints = self._servers[host]
        key = self._keys[host]
        tls = client_context(*self.cfg.tls) if self.cfg.tls is not None else None
        conn = connect(self.cfg, endpoints, same_host(endpoints), f"server {host}",
                       self._zctx, tls, (key, READER, -1))
        try:
            wnonce = secrets.token_hex(16)
            hello: dict[str, Any] = {"role": READER, "wnonce": wnonce}
            meta, _ = self._call(conn, host, Command.HELLO, hello)
            nonce = None
            if meta.cmd == Command.CHALLENGE:
                nonce = meta.body.get("nonce") if isinstance(meta.body, dict) else None
                meta, _ = self._call(conn, host, Command.HELLO,
                                     {**hello, **prove(key, "server", meta.body, READER, None)})
            if meta.cmd != Command.ACK:
                raise ProtocolError(f"server {host} answered a reader's HELLO with "
                                    f"{meta.cmd.name}")
            if self.cfg.secret:     # it proves it is this job's server (auth.server_proof)
                check_server(key, self._job, host, -1, nonce, wnonce, meta.body)
        except BaseException:
            conn.close()
            raise
        self._conns[host] = conn
        return conn, host

    def _call(self, conn: Connection, host: int, cmd: Command, body: Any) -> tuple[Any, list]:
        self._ts += 1
        ts = self._ts
        conn.send(cmd, ts, (), body, ())
        deadline = time.monotonic() + self.cfg.request_timeout
        poller = zmq.Poller()
        poller.register(conn.pollable(), zmq.POLLIN)
        while True:
            for meta, arrays in conn.receive(None, 16):
                if meta.ts != ts:
                    continue
                if meta.cmd == Command.ERROR:
                    raise error_from_body(meta.body, f"server {host}")
                return meta, arrays
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeFailedError(f"server {host} did not answer a reader in "
                                      f"{self.cfg.request_timeout:g} s")
            poller.poll(int(min(left, 0.5) * 1000) + 1)

    def _request(self, shard: int, body: dict[str, Any]) -> tuple[Any, list]:
        """One read of ``shard`` (from whichever server serves it; after a failure the
        scheduler is asked again, until ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self._closed:
                raise ClusterError("this reader is closed. Make a new pskv.stream.Reader.")
            try:
                conn, host = self._link(shard)
                full = {**body, "shard": shard} if host != shard else body
                return self._call(conn, host, Command.COMMAND, full)
            except (NodeFailedError, ProtocolError, OSError) as err:
                bad = self._conns.pop(self._hosts[shard], None)
                if bad is not None:
                    bad.close()
                if time.monotonic() >= deadline:
                    raise ClusterError(f"shard {shard}'s server could not be read in "
                                       f"{self.timeout:g} s: {err}") from err
                log.info("reader: shard %d: %s; asking the scheduler again", shard,
                         short(str(err), 200))
                time.sleep(0.2)
                self._ask_scheduler()

    # ---- subscriptions ------------------------------------------------------------------
    def subscribe(self, key: Any, since: Any = None, *, raw: bool = False,
                  max_rows: int = PAGE_ROWS, dim: int | None = None,
                  dtype: Any = None) -> Subscription:
        """A :class:`~pskv.kv.Subscription` of table ``key``'s change stream, as
        ``kv.subscribe`` gives it (same ``since``, ``raw``, ``max_rows``). ``dim`` and
        ``dtype`` (the table's storage dtype, with ``raw``) check the replies when given;
        else each reply's own shape is taken."""
        k = check_key(key)
        check_subscribe(key, raw, max_rows)
        pskey = ps_key(k)
        reader = self

        class _Link:
            """The ``kv`` ``ask_changes`` talks to: one request, then its reply."""

            def __init__(self) -> None:
                self.replies: dict[int, tuple[Any, list]] = {}

            def request(self, shard: int, cmd: Command, body: dict[str, Any]) -> int:
                self.replies[shard] = reader._request(shard, body)
                return shard

            def wait_all(self, tss: list[int], what: str) -> list[tuple[Any, list]]:
                return [self.replies.pop(t) for t in tss]

        link = _Link()

        def fetch(shard: int, s: int, lineage: str | None, cursor: int,
                  upto: int | None) -> Any:
            return ask_changes(link, link.wait_all, k, pskey, None, shard, self.num_servers,
                               s, lineage, cursor, upto, max_rows, raw, dim=dim, dtype=dtype)
        return Subscription(k, fetch, self.num_servers, since)

    def versions(self, key: Any) -> list[int]:
        """Each shard's version of table ``key`` now (one empty read each)."""
        sub = self.subscribe(key, max_rows=1)
        out = []
        for s in range(self.num_servers):
            page = sub._fetch(s, 1 << 61, "", 0, None)     # a reset, read one row
            out.append(page.version)
        return out
