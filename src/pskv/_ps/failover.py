"""Failover and re-send: what a worker does when a server dies and comes back.

With ``pskv-launch --max-restarts`` or ``PSKV_REPLICAS=1`` a worker is *resilient*
(docs/durability.md). :class:`Failover` is its durability wing, hung off the worker's links
at two points as ps-lite's ``Resender`` hangs off the Van: every request on its way out
(:meth:`Failover.send`: kept, routed to the server serving its shard, or held while that
shard has none) and every reply on its way in (:meth:`Failover.answered`: no longer kept).
Between the two it owns all the state failover needs: the recent pushes
(:class:`.replay.PushLog`), the unanswered requests, the settings a restarted server gets
again, which server serves each shard, and which are down.

:meth:`Failover.recover` acts on the membership's events (:mod:`.membership`): a
lost server's shards go to their backups (``PSKV_REPLICAS=1``), each told this worker's
pushes it lacks; a restarted server is reconnected to and sent what it lacks. It talks to
the network only through :class:`Links`, which the worker implements (and the unit tests
fake): the component has no socket, no thread and no clock of its own; every wait is the
links' and is bounded there.

Locks: ``route`` (re-entrant) is held from a request's routing to its send, and over a
whole recovery, so no request slips between a switch and the pushes sent again; the
component's own ``_lock`` guards its tables and is never held while calling the links.
A worker that holds its own mutex may call :meth:`answered` (that lock comes second).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..errors import NodeFailedError
from .membership import Event, ServerLost, ShardMoved
from .message import Command, Meta
from .ops import Op, command, parse
from .replay import PushLog, backup_of, rest_step

__all__ = ["Failover", "Links", "applied_counts"]

log = logging.getLogger(__name__)


class Links(Protocol):
    """What :class:`Failover` needs of a worker's connections to the servers."""

    def next_ts(self) -> int:
        """A fresh positive request id."""

    def send(self, server: int, cmd: Command, ts: int, keys: Sequence[int] = (),
             body: Any = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Write one message to ``server``; NodeFailedError if its link is broken."""

    def await_reply(self, ts: int, what: str, timeout: float | None = None) -> Meta:
        """The reply to ``ts`` (bounded; raises what the server answered or a timeout)."""

    def drop(self, server: int) -> None:
        """Stop reading the link to ``server`` and close it (nothing if already closed)."""

    def connect(self, server: int) -> None:
        """A new link to the restarted ``server``, where the membership says it is now."""

    def hello(self, server: int) -> Meta:
        """Prove this worker's rank on the new link to ``server``: the server's final
        answer to HELLO (its ``applied`` counts)."""


def applied_counts(body: Any) -> dict[int, int]:
    """A server's ``applied`` counts (ps_key -> pushes of this worker it applied).

    Examples
    --------
    >>> applied_counts({"applied": [[7, 2], [9, "x"]]}), applied_counts(None)
    ({7: 2}, {})
    """
    pairs = body.get("applied", []) if isinstance(body, dict) else []
    out: dict[int, int] = {}
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair):
            out[pair[0]] = pair[1]
    return out


class _Locks:
    """Two locks taken in order (a context manager)."""

    def __init__(self, *locks: Any) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        for lock in reversed(self._locks):
            lock.release()


class Failover:
    """A resilient worker's failover and re-send state (see the module docstring).

    Parameters
    ----------
    links : Links
    rank : int
        This worker's rank (for log lines).
    num_servers : int
    keep : int
        Pushes kept per server and key (:class:`.replay.PushLog`).
    replicas : bool
        Whether shards have backups (``PSKV_REPLICAS=1``): a lost server's shards move to
        them, and replies to pulls and flushes let kept pushes go.
    """

    def __init__(self, links: Links, rank: int, num_servers: int, keep: int,
                 replicas: bool) -> None:
        self.links = links
        self.rank = rank
        self.replicas = replicas
        self.route = threading.RLock()
        self._lock = threading.Lock()
        # a lent buffer is repaid (copied) under both: never while a resend reads it
        self.pushes = PushLog(keep, lock=_Locks(self.route, self._lock))
        #: shard -> the server that serves it (its backup once its primary died)
        self.host = list(range(num_servers))
        self._down: set[int] = set()
        #: ts -> (shard, cmd, keys, body, arrays) of requests not answered yet
        self._sent: dict[int, tuple[int, Command, Sequence[int], Any,
                                    Sequence[np.ndarray]]] = {}
        #: ts -> (shard, ps_key -> pushes sent before it): with replicas, a reply to a pull
        #: or flush means those pushes are applied and backed up: no longer kept
        self._acks: dict[int, tuple[int, dict[int, int]]] = {}
        self._setup: dict[Op, Any] = {}       # settings a restarted server gets again
        self._pending: collections.deque[Event] = collections.deque()
        #: pushes and requests sent again so far (metrics: pskv_worker_resent_total)
        self.resent = (0, 0)
        self._recovering = False
        #: the data position's seals (``seals.py``): the last commit goes again (W2)
        self.seals: Any = None

    # ---- message out -----------------------------------------------------------------------
    def send(self, shard: int, cmd: Command, ts: int, keys: Sequence[int], body: Any,
             arrays: Sequence[np.ndarray], lenders: Sequence[Any] | None = None) -> None:
        """Keep what the server of ``shard`` would need again, and send it there unless
        that server is down (then it goes once a backup or a restart serves the shard).
        ``lenders``: per array, who lends it to the log instead of a copy (``PushLog``)."""
        with self.route:
            with self._lock:
                self._keep(shard, cmd, ts, keys, body, arrays, lenders)
                host = self.host[shard]
                if host in self._down:
                    return
            try:
                self.links.send(host, cmd, ts, keys, self._tagged(shard, body), arrays)
            except NodeFailedError:
                self.link_broke(host)

    def _keep(self, shard: int, cmd: Command, ts: int, keys: Sequence[int], body: Any,
              arrays: Sequence[np.ndarray], lenders: Sequence[Any] | None = None) -> None:
        if cmd in (Command.PUSH, Command.PUSHPULL):
            kinds = body.get("kinds", "") if isinstance(body, dict) else ""
            # a PUSHPULL's caller waits for its reply, which (with replicas) lets the push
            # go: borrowed, not copied, until the caller settles (PushLog)
            self.pushes.record(shard, keys, kinds, arrays,
                               borrow=self.replicas and cmd == Command.PUSHPULL,
                               lenders=lenders,
                               step=rest_step(body))
        if cmd == Command.COMMAND and parse(body) is Op.COMPRESSION:
            self._setup[Op.COMPRESSION] = body
        if self.replicas and cmd in (Command.PULL, Command.PUSHPULL, Command.FLUSH):
            self._acks[ts] = (shard, self.pushes.counts(shard, None if cmd == Command.FLUSH
                                                         else keys))
        if ts > 0 and cmd != Command.HELLO:
            # a PUSHPULL's push is in the log: sent again, it is a PULL
            self._sent[ts] = (shard, Command.PULL, keys, None, ()) \
                if cmd == Command.PUSHPULL else (shard, cmd, keys, body, arrays)

    def _tagged(self, shard: int, body: Any) -> Any:
        """``body`` naming ``shard`` when another server serves it."""
        if self.host[shard] == shard:
            return body
        return {**(body if isinstance(body, dict) else {}), "shard": shard}

    def settle(self) -> None:
        """A call that sent PUSHPULLs returns: copy the pushes it lent that are still kept
        (no reply let them go: an error, a timeout), since its caller may change them."""
        with self._lock:
            self.pushes.settle()

    def skip_applied(self, server: int, keys: Sequence[int], body: Any,
                     arrays: Sequence[np.ndarray]) -> tuple[list[int], Any, list[np.ndarray]]:
        """A restarted worker catching up: the push without what ``server`` applied."""
        with self._lock:
            return self.pushes.drop_applied(server, keys, body, arrays)

    def catching_up(self, server: int, pks: Sequence[int]) -> list[int]:
        """The ps_keys of ``pks`` whose pushes ``server`` holds are not all made again yet
        (``PushLog.catching_up``)."""
        with self._lock:
            return self.pushes.catching_up(server, pks)

    # ---- message in ------------------------------------------------------------------------
    def answered(self, ts: int, ok: bool) -> None:
        """The reply to ``ts`` came (``ok``: not an ERROR): no longer sent again."""
        with self._lock:
            self._sent.pop(ts, None)
            acked = self._acks.pop(ts, None)
            if acked is not None and ok:
                self.pushes.forget(*acked)

    def is_down(self, server: int) -> bool:
        """Whether the link to ``server`` broke and it serves nothing until recovered."""
        return server in self._down

    def link_broke(self, server: int) -> None:
        """The link to ``server`` broke: it is down; with replicas its shards move to
        their backups at the next :meth:`recover`."""
        with self._lock:
            first = server not in self._down
            self._down.add(server)
            if first and self.replicas:
                self._pending.append(ServerLost(server))

    def hold(self, event: Event) -> None:
        """Keep a membership ``event`` for the next :meth:`recover` (one read before the
        handshakes were done); a lost server is down from now on."""
        with self._lock:
            if isinstance(event, ServerLost):
                if event.rank in self._down:
                    return
                self._down.add(event.rank)
            self._pending.append(event)

    # ---- recovery --------------------------------------------------------------------------
    def recover(self, next_event: Callable[[], Event | None]) -> None:
        """Act on this component's own events, then on those ``next_event`` gives (the
        membership's), until none is left. Re-entrant calls return at once."""
        if self._recovering:
            return
        self._recovering = True
        try:
            while True:
                with self._lock:
                    event = self._pending.popleft() if self._pending else None
                event = event or next_event()
                if event is None:
                    return
                if isinstance(event, ServerLost):
                    self._failover(event.rank)
                elif isinstance(event, ShardMoved):
                    self._moved(event.shard, event.host)
                else:
                    self._rejoin(event.rank)
        finally:
            self._recovering = False

    def _failover(self, server: int) -> None:
        """``server`` died: each shard it served goes to its backup, which is told what
        of this worker's pushes it lacks, and gets the unanswered requests again."""
        with self.route:
            with self._lock:
                self._down.add(server)
            self.links.drop(server)
            for shard, host in enumerate(self.host):
                if host != server:
                    continue
                backup = backup_of(shard, host, len(self.host))
                if backup in self._down:
                    raise NodeFailedError(
                        f"server {server} died and the backup of its shard {shard}, server "
                        f"{backup}, is down too: that shard is lost. Restart the job from a "
                        "checkpoint (kv.load_checkpoint).")
                self.host[shard] = backup
                ts = self.links.next_ts()
                self.links.send(backup, Command.COMMAND, ts, body=command(Op.APPLIED,
                                                                          shard=shard))
                meta = self.links.await_reply(ts, f"server {backup} to take over shard "
                                                  f"{shard}")
                self._resend(shard, meta.body)
                log.info("worker %d: server %d died; shard %d now on server %d",
                            self.rank, server, shard, backup)

    def _moved(self, shard: int, host: int) -> None:
        """``shard`` was handed to server ``host`` (a server added into its slot), which
        has every change of it: its requests go there from now on; it is told what of
        this worker's pushes it lacks (those that waited in the old server's open rounds,
        which ended them unanswered) and gets the unanswered requests again."""
        with self.route:
            if self.host[shard] == host:
                return
            old, self.host[shard] = self.host[shard], host
            ts = self.links.next_ts()
            self.links.send(host, Command.COMMAND, ts, body=command(Op.APPLIED, shard=shard))
            meta = self.links.await_reply(ts, f"server {host} to take shard {shard} back")
            self._resend(shard, meta.body)
            log.info("worker %d: shard %d moved from server %d to server %d", self.rank,
                     shard, old, host)

    def _resend(self, shard: int, body: Any) -> None:
        """Send the server of ``shard`` this worker's pushes it has not applied (``body``:
        its ``applied`` counts), then the requests not answered yet (route lock held)."""
        host = self.host[shard]
        tag = {} if host == shard else {"shard": shard}
        with self._lock:
            applied = applied_counts(body)
            self.pushes.rebase(shard, applied)
            pushes = self.pushes.since(shard, applied)
            again = sorted(ts for ts, sent in self._sent.items() if sent[0] == shard)
            requests = [(ts, self._sent[ts]) for ts in again]
        for pk, kind, arrays, step in pushes:
            # a table push sent again may name rows born after the shard's checkpoint
            # (docs/embeddings.md D9): "again" lets the server re-create them
            redo = {"again": True} if kind == "t" else {}
            at = {} if step is None else {"step": step}
            self.links.send(host, Command.PUSH, -self.links.next_ts(), [pk],
                            {"kinds": kind, **tag, **redo, **at}, arrays)
        for ts, (_s, cmd, keys, body_, arrays_) in requests:
            if cmd == Command.INIT and isinstance(body_, dict):
                body_ = {**body_, "again": True}     # its keys may be there already
            self.links.send(host, cmd, ts, keys, self._tagged(shard, body_), arrays_)
        sealed = self.seals.sealed if self.seals is not None else None
        if sealed is not None:      # after the pushes it covers (seals.py W2)
            self.links.send(host, Command.COMMAND, -self.links.next_ts(),
                            body={**command(Op.SEAL, step=sealed, commit=True), **tag})
        self.resent = (self.resent[0] + len(pushes), self.resent[1] + len(requests))
        log.info("worker %d: sent %d pushes and %d requests for shard %d again to server %d",
                 self.rank, len(pushes), len(requests), shard, host)

    def _rejoin(self, server: int) -> None:
        """``server`` was restarted: reconnect, prove this worker's rank again, and send it
        what it lacks (without replicas: compression, later pushes, unanswered requests;
        with replicas it is a backup now and its shard stays where it is)."""
        with self.route:
            if self.replicas and self.host[server] == server:
                self._failover(server)          # it died unseen: its backup serves its shard
            with self._lock:
                self._down.add(server)
            self.links.drop(server)
            self.links.connect(server)
            with self._lock:
                self._down.discard(server)
            meta = self.links.hello(server)
            if self.replicas:
                return
            for op, setup in list(self._setup.items()):
                ts = self.links.next_ts()
                self.links.send(server, Command.COMMAND, ts, body=setup)
                self.links.await_reply(ts, f"server {server} to take {op.value}")
            self._resend(server, meta.body)

