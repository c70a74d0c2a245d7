"""The collective path: big dense ``dist_sync`` keys summed among the workers themselves.

Every worker owns one contiguous chunk of every collective key (worker ``r`` chunk ``r``,
:func:`chunks`). A push sends chunk ``p`` of the value to worker ``p`` and keeps its own;
worker ``p`` sums its chunk of a round in worker-rank order, ``((v0 + v1) + v2) + ...``,
as a server sums a round (``kvstore/engine/_core.py``: the same NumPy calls, so the same bits),
and sends the sum to every worker; a pull waits for every owner's sum of the round of its
own last push. It is the parameter server moved into the workers: per round a worker sends
and receives ``2 (W-1)/W`` of a key's bytes, as a ring all-reduce does (reduce-scatter then
all-gather; BytePS's analysis and Horovod's ring), but every chunk has one owner that adds
the workers' parts in rank order, so the result does not depend on which worker started the
ring. docs/collective.md has the rules.

Links: one authenticated stream connection per pair of workers (:mod:`.peerlinks`: a Unix
socket within a host, TCP (TLS with ``PSKV_TLS_*``) between hosts). One progress thread
does all socket I/O without blocking: it reads parts straight into place, writes what the
sockets take, and sums a chunk as soon as its round is complete, so a worker busy outside
the store (a backward pass) does not hold the others up. Callers hand it sends and wait on
a condition.

Within a host (a Unix-socket link, both workers with ``PSKV_COLLECTIVE_SHM`` on) a round's
data moves through shared memory (:mod:`.shm`): each worker has one segment per key, its
*push slot* (the whole value) and *sum slot* (the sum of its chunk), whose descriptor it
passes to such a peer (a SEGMENT message) before its first push of the key. A push copies
the value into the push slot once and sends each such peer a PUSH without data; the owner
sums its chunk reading every push slot in place, writes the sum into its sum slot and
sends a DATA without data; a pull copies every owner's sum slot into ``out``. Peers on
other hosts (TCP, TLS) get the bytes over the link as before; a key mixes both.

Invariants:

* a key's chunk of round ``n + 1`` is summed only after round ``n``'s sum has been written
  to every socket peer (it is sent from the sum buffer);
* shared memory: a segment reaches a peer (SEGMENT, its descriptor alongside) before the
  first PUSH of its key on that link, and is mapped only once checked (a memfd of exactly
  its layout's size, sealed against any change of size), else refused;
* a push slot is rewritten (round ``n + 1``) only once every owner said that it summed
  round ``n`` from it (its DATA of round ``n`` is the acknowledgement) and this worker's
  own chunk of round ``n`` is summed;
* a worker pushes round ``n + 1`` only once its pulls of earlier rounds are over (a pull
  counts itself in ``readers`` when it picks its round); an owner sums round ``n + 1`` only
  with every push of it in, so it never overwrites a sum slot that a peer still reads;
* every wait is bounded by ``PSKV_REQUEST_TIMEOUT`` and names the workers it waits for; a
  peer whose link breaks fails every call, naming it, at once; a message (or descriptor)
  that breaks the rules fails the job on both sides (an ERROR goes back) and never kills
  the thread.

Over 500 lines because the collective's round rules (docs/collective.md) bind its progress
thread, its chunk owners and its shared-memory slots together.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import select
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ...errors import (ClusterError, ClusterTimeoutError, KVStoreError, NodeFailedError,
                      ProtocolError, WorkerClosedError)
from ..config import ClusterConfig
from ..message import Command, Meta, encode, error_body, error_from_body
from .peerlinks import PeerLinks
from ..shm import FdInbox, Segment, fd_message, layout
from ..stream import _MAGIC, _PREFIX, Alloc, StreamConn, drop_sent

__all__ = ["Collective", "chunks"]

log = logging.getLogger(__name__)

_IOV_MAX = 512


def chunks(size: int, num_workers: int) -> list[tuple[int, int]]:
    """Each worker's ``(start, stop)`` of a key of ``size`` elements: contiguous, in rank
    order, sizes differing by at most one (the first ``size % W`` are one longer).

    >>> chunks(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(size, num_workers)
    out, start = [], 0
    for r in range(num_workers):
        stop = start + base + (r < extra)
        out.append((start, stop))
        start = stop
    return out


@dataclass
class _Key:
    """One collective key's rounds on this worker (all fields under the Collective's lock)."""

    name: Any
    pskey: int
    dtype: np.dtype[Any]
    bounds: list[tuple[int, int]]
    result: np.ndarray                    # flat: the last round's sum, chunk by chunk
    pushed: int = 0                       # this worker's pushes (= the round it waits for)
    own: collections.deque[np.ndarray] = field(default_factory=collections.deque)
    parts: dict[int, collections.deque[np.ndarray]] = field(default_factory=dict)
    came: dict[int, int] = field(default_factory=dict)   # per peer: its last part's round
    got: dict[int, int] = field(default_factory=dict)    # per owner: rounds of sums here
    free: list[np.ndarray] = field(default_factory=list)  # spare chunk buffers
    summed: int = 0                       # rounds of this worker's chunk summed
    sending: int = 0                      # this chunk's sum: peers it is not written to yet
    seg: Segment | None = None            # this worker's shared memory (a same-host peer)
    mapped: dict[int, Segment] = field(default_factory=dict)  # same-host peers' segments
    readers: int = 0                      # pulls copying this key's sums now


@dataclass
class _Out:
    """One message on its way to a peer: its buffers, and what to do once written."""

    bufs: list[memoryview]
    done: Callable[[], None] | None = None
    first: int = 0
    fds: list[int] = field(default_factory=list)    # passed with its first bytes


@dataclass
class _Sent:
    left: set[int]        # the peers that have not taken this push yet


class Collective:
    """The collective path of one worker (``DistKVStore`` makes one when a key needs it).

    Parameters
    ----------
    cfg : ClusterConfig
    rank, num_workers : int
    job : str
        The job's id (bound into every proof).
    check : callable
        Raises when the cluster failed (the Postoffice's ``check``): waits call it.
    on_lost : callable
        ``on_lost(rank)``: the link to that worker broke (the store tells the scheduler).
    """

    def __init__(self, cfg: ClusterConfig, rank: int, num_workers: int, job: str,
                 check: Callable[[], None], on_lost: Callable[[int], None]) -> None:
        self.cfg = cfg
        self.rank = rank
        self.num_workers = num_workers
        self.peers = [p for p in range(num_workers) if p != rank]
        self._check = check
        self._on_lost = on_lost
        self._links = PeerLinks(cfg, rank, num_workers, job)
        self._conns: dict[int, StreamConn] = {}
        self._by_fd: dict[int, int] = {}
        self._keys: dict[int, _Key] = {}
        self._out: dict[int, collections.deque[_Out]] = {p: collections.deque()
                                                          for p in self.peers}
        self._cond = threading.Condition()
        self._dirty: set[int] = set()         # keys whose chunk may be ready to sum
        self._failure: tuple[type[KVStoreError], str] | None = None
        self._gone: set[int] = set()          # peers whose link is closed
        self._shm: set[int] = set()           # peers linked through shared memory
        self._inbox: dict[int, FdInbox] = {}  # descriptors each Unix-socket peer passed
        self._said_goodbye: set[int] = set()  # peers that closed their store
        self._deaf: set[int] = set()          # peers no longer read (a broken stream)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()

    # ---- setting up ---------------------------------------------------------------------
    def listen(self) -> dict[str, str]:
        """Open this worker's listeners; what the peers need to connect, sent through the
        scheduler in an init barrier (:meth:`.peerlinks.PeerLinks.listen`)."""
        return self._links.listen()

    @property
    def connected(self) -> bool:
        """Whether the links to every peer are up (:meth:`connect` ran)."""
        return self._thread is not None

    def connect(self, peers: Mapping[int, Mapping[str, str]]) -> None:
        """Link to every peer (their :meth:`listen` answers, by rank) and start the
        progress thread. Collective: every worker calls it after the same barrier."""
        links = self._links.connect(peers)
        self._conns, self._inbox, self._shm = links.conns, links.inboxes, links.shm
        for p, conn in self._conns.items():
            conn.max_bytes = self.cfg.max_message_bytes
            self._by_fd[conn.fileno()] = p
            self._poll.register(conn.fileno(), select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pskv-collective-{self.rank}")
        self._thread.start()

    # ---- keys ---------------------------------------------------------------------------
    def add_key(self, name: Any, pskey: int, size: int, dtype: np.dtype[Any],
                initial: np.ndarray | None = None) -> None:
        """Take ``name`` (ps_key ``pskey``, ``size`` elements) on this path."""
        result = np.zeros(size, dtype) if initial is None else \
            np.array(initial, dtype).reshape(-1)
        k = _Key(name, pskey, np.dtype(dtype), chunks(size, self.num_workers), result)
        for p in self.peers:
            k.parts[p] = collections.deque()
            k.came[p] = k.got[p] = 0
        with self._cond:
            self._keys[pskey] = k

    def drop_key(self, pskey: int) -> None:
        """Take a key off this path (before any push of it: ``set_optimizer``)."""
        with self._cond:
            self._keys.pop(pskey, None)

    def pushed(self, pskey: int) -> int:
        """This worker's pushes of ``pskey`` so far."""
        with self._cond:
            return self._keys[pskey].pushed

    # ---- push and pull (any thread) --------------------------------------------------------
    def push(self, pskey: int, flat: np.ndarray) -> None:
        """Send ``flat`` (this worker's value, 1-D, the key's dtype) to the chunks' owners;
        return once every byte is written (then ``flat`` may change)."""
        sent = _Sent(set(self.peers) - self._shm)
        with self._cond:
            self._raise_failure()
            k = self._keys[pskey]
            self._raise_gone(f"them to take its push of round {k.pushed + 1} of key "
                             f"{k.name!r} on the collective path", set(self.peers))
        lo, hi = k.bounds[self.rank]
        if self._shm:
            seg = self._claim_slot(k)
            np.copyto(seg.push, flat)     # the one copy; the owners read it in place
            own = seg.push[lo:hi]
        with self._cond:
            if not self._shm:
                k.pushed += 1
                own = self._buffer(k)
                np.copyto(own, flat[lo:hi])
            k.own.append(own)
            self._dirty.add(pskey)
            for p in self.peers:
                if p in self._shm:
                    if k.pushed == 1:      # its segment first, then the rounds
                        assert k.seg is not None
                        self._queue(p, Command.SEGMENT, 0, pskey, None, fds=[k.seg.fd])
                    self._queue(p, Command.PUSH, k.pushed, pskey, None)
                    continue
                s, e = k.bounds[p]
                self._queue(p, Command.PUSH, k.pushed, pskey, flat[s:e],
                            functools.partial(sent.left.discard, p))
        self._wake()
        # a peer that closed its store after taking this push is no failure
        self._wait(lambda: not sent.left, lambda: self._what_send(k, sent),
                   lambda: set(sent.left))

    def _claim_slot(self, k: _Key) -> Segment:
        """Wait until this worker's push slot of ``k`` may be rewritten (see the module's
        invariants), then count the push (the slot is this caller's until it queues the
        round); the segment, made at the first push."""
        def free() -> bool:
            n = k.pushed
            if k.readers or k.summed < n or any(k.got[p] < n for p in self._shm):
                return False
            k.pushed += 1
            return True

        def late() -> set[int]:
            return {p for p in self._shm if k.got[p] < k.pushed}
        self._wait(free, lambda: (f"the owners of key {k.name!r} to sum round {k.pushed} "
                                  "(its push slot is read until then)"), late)
        with self._cond:
            if k.seg is None:
                try:
                    k.seg = Segment.create(layout(k.result.size, k.dtype, k.bounds[self.rank]),
                                           f"pskv-{self.rank}-{k.pskey}")
                except OSError as err:
                    msg = (f"worker {self.rank} could not make shared memory for key "
                           f"{k.name!r}: {err}. Set PSKV_COLLECTIVE_SHM=0 to use the sockets.")
                    self._fail(ClusterError, msg)
                    raise ClusterError(msg) from err
            return k.seg

    def pull(self, pskey: int, out: np.ndarray) -> None:
        """Wait for the sum of the round of this worker's last push; copy it into ``out``
        (1-D, the key's size)."""
        k = self._keys[pskey]
        with self._cond:
            n = k.pushed
            k.readers += 1       # no push of this key till the copy is over: see above
        try:
            self._wait(lambda: self._complete(k, n), lambda: self._what_round(k, n),
                       lambda: {p for p in self.peers if k.came[p] < n or k.got[p] < n})
            if k.seg is None or n == 0:
                np.copyto(out, k.result, casting="same_kind")
                return
            for p, (lo, hi) in enumerate(k.bounds):
                src = k.seg.total if p == self.rank else \
                    k.mapped[p].total if p in self._shm else k.result[lo:hi]
                np.copyto(out[lo:hi], src, casting="same_kind")
        finally:
            with self._cond:
                k.readers -= 1
                self._cond.notify_all()

    # ---- uneven data: a joined worker adds zeros (DDP's join hook) -----------------------
    def pushed_all(self) -> dict[int, int]:
        """This worker's pushes of each key so far (ps_key -> rounds)."""
        with self._cond:
            return {pk: k.pushed for pk, k in self._keys.items()}

    def add_zeros(self, upto: Mapping[int, int] | None = None) -> int:
        """A joined worker's turn in the others' rounds: push zeros for every round of a
        key that a peer has pushed (or, with ``upto``, up to that round) and this worker
        has not, and wait for each round's sum (so those peers' pulls complete); return
        how many rounds it added to. Each wait is bounded as a pull's is."""
        with self._cond:
            behind = []
            for pk, k in self._keys.items():
                target = max(k.came.values(), default=0) if upto is None else \
                    upto.get(pk, 0)
                if target > k.pushed:
                    behind.append((pk, target - k.pushed, k.result.size, k.dtype))
        for pk, rounds, size, dtype in behind:
            zeros = np.zeros(size, dtype)
            scratch = np.empty(size, dtype)
            for _ in range(rounds):
                self.push(pk, zeros)
                self.pull(pk, scratch)
        return sum(b[1] for b in behind)

    def _complete(self, k: _Key, n: int) -> bool:
        return k.summed >= n and all(k.got[p] >= n for p in self.peers)

    def _buffer(self, k: _Key) -> np.ndarray:
        lo, hi = k.bounds[self.rank]
        return k.free.pop() if k.free else np.empty(hi - lo, k.dtype)

    def _what_send(self, k: _Key, sent: _Sent) -> str:
        late = sorted(sent.left)
        return (f"its push of key {k.name!r} to be taken by worker"
                f"{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} (a worker that "
                "does not read)")

    def _what_round(self, k: _Key, n: int) -> str:
        late = [p for p in self.peers if k.came[p] < n]
        owners = [p for p in self.peers if k.got[p] < n]
        said = []
        if late:
            said.append(f"no push of round {n} from worker{'s' if len(late) > 1 else ''} "
                        f"{', '.join(map(str, late))}")
        if owners:
            said.append(f"no sum from worker{'s' if len(owners) > 1 else ''} "
                        f"{', '.join(map(str, owners))}")
        missing = "; ".join(said) or "its own sum"
        return (f"round {n} of key {k.name!r} on the collective path ({missing}). Check "
                "that every worker pushes the same keys")

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str],
              needs: Callable[[], set[int]]) -> None:
        """Wait (lock released) until ``ready()``; raise the path's failure, or when a
        worker of ``needs()`` (whose messages are still missing) closed its store."""
        limit = self.cfg.request_timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while True:
                self._raise_failure()     # once failed, every call raises, done or not
                if ready():
                    return
                if self._said_goodbye & needs():
                    self._raise_gone(what(), needs())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterTimeoutError(
                        f"worker {self.rank} waited {limit:g} s for {what()}, or raise "
                        "PSKV_REQUEST_TIMEOUT if a worker is just slow.")
                self._cond.release()
                try:
                    self._check()
                finally:
                    self._cond.acquire()
                self._cond.wait(min(left, 0.2))

    def _raise_gone(self, what: str, needs: set[int]) -> None:
        if self._said_goodbye & needs:
            gone = sorted(self._said_goodbye & needs)
            raise WorkerClosedError(
                f"worker{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} closed "
                f"{'their stores' if len(gone) > 1 else 'its store'} while worker "
                f"{self.rank} needs {what}. Every worker must make the same pushes and "
                "pulls before kv.close(); with uneven data, call kv.join() on each worker "
                "that runs out of batches (pskv.torch: opt.join()), and close only after "
                "it returns.")

    def _raise_failure(self) -> None:
        if self._failure is not None:
            cls, msg = self._failure
            raise cls(msg)

    def _fail(self, cls: type[KVStoreError], msg: str) -> None:
        """The path cannot go on: every call raises ``cls(msg)`` (the first one wins)."""
        with self._cond:
            if self._failure is None:
                self._failure = (cls, msg)
                log.error("worker %d: %s", self.rank, msg)
            self._cond.notify_all()

    # ---- the progress thread ------------------------------------------------------------------
    def _queue(self, p: int, cmd: Command, ts: int, pskey: int, array: np.ndarray | None,
               done: Callable[[], None] | None = None, body: Any = None,
               fds: list[int] | None = None) -> None:
        """Queue a message to peer ``p`` (lock held)."""
        frames = encode(cmd, ts, [pskey] if pskey >= 0 else [], body,
                        [array] if array is not None else [])
        head = frames[0]
        bufs = [memoryview(_PREFIX.pack(_MAGIC, len(head))), memoryview(head)]
        bufs += [memoryview(a).cast("B") for a in frames[1:] if a.nbytes]
        self._out[p].append(_Out(bufs, done, fds=fds or []))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # a bug here must fail the calls, not leave them waiting
            log.exception("worker %d: the collective thread failed", self.rank)
            self._fail(ClusterError, f"worker {self.rank}: the collective path's thread "
                       f"failed: {type(err).__name__}: {err}")

    def _loop(self) -> None:
        writing: set[int] = set()
        while True:
            with self._cond:
                if self._stop and not any(self._out.values()):
                    return
                want = {p for p in self._conns if self._out[p] and p not in self._gone}
            for p in want ^ writing | (self._deaf - want):
                mask = (0 if p in self._deaf else select.POLLIN) | \
                    (select.POLLOUT if p in want else 0)
                try:
                    if mask:
                        self._poll.modify(self._conns[p].fileno(), mask)
                    else:       # nothing to read or write: not polled (no busy loop)
                        self._poll.unregister(self._conns[p].fileno())
                except (OSError, ValueError, KeyError):
                    pass
            writing = want
            busy = any(c.buffered() for p, c in self._conns.items()
                       if p not in self._gone and p not in self._deaf)
            try:
                events = self._poll.poll(0 if busy else 200)
            except InterruptedError:
                continue
            try:
                os.read(self._wake_r, 4096)
            except (BlockingIOError, OSError):
                pass
            readable = {self._by_fd[fd] for fd, ev in events if fd in self._by_fd and
                        ev & (select.POLLIN | select.POLLHUP | select.POLLERR)}
            readable |= {p for p, c in self._conns.items() if p not in self._gone and
                         p not in self._deaf and c.buffered()}
            for p in sorted(readable):
                self._read(p)
            for p in sorted(writing):
                self._write(p)
            self._sum_ready()
            now = time.monotonic()
            for p, conn in self._conns.items():
                if p not in self._gone and conn.stalled(now):
                    self._lost(p, "it stopped half-way through a message")

    def _lost(self, p: int, why: str) -> None:
        with self._cond:
            if p in self._gone:
                return
            self._gone.add(p)
            self._drop_out(p)
        try:
            self._poll.unregister(self._conns[p].fileno())
        except (KeyError, ValueError, OSError):
            pass
        self._on_lost(p)
        self._fail(NodeFailedError, f"worker {p} is gone: its collective link to worker "
                   f"{self.rank} broke ({why}). The job cannot go on without it.")

    def _read(self, p: int) -> bool:
        """Read up to 16 messages from ``p``; whether there may be more."""
        conn = self._conns[p]
        if p in self._gone or p in self._deaf:
            return False
        alloc_for = self._alloc_for(p)
        for _ in range(16):
            # one message a call: a read that meets the end of the stream raises, and would
            # lose the messages parsed before it in the same call (the last sums, a goodbye)
            try:
                got = conn.receive(alloc_for, 1)
            except NodeFailedError as err:
                with self._cond:
                    closed = self._failure is None and p in self._said_goodbye
                if closed:
                    self._goodbye_eof(p)
                else:
                    self._lost(p, str(err))
                return False
            except ProtocolError as err:
                self._deaf.add(p)         # its stream cannot be followed any more
                try:
                    self._poll.modify(conn.fileno(), select.POLLOUT)
                except (OSError, ValueError):
                    pass
                self._refuse(p, ProtocolError, f"worker {p} sent a bad message on the "
                             f"collective path: {err}")
                return False
            if not got:
                return False
            meta, arrays = got[0]
            self._on_message(p, meta, arrays)
        return True

    def _drop_out(self, p: int) -> None:
        """Forget what was queued for ``p`` (its link is closed), running each message's
        callback so that no counter waits for it (lock held)."""
        for item in self._out[p]:
            if item.done is not None:
                item.done()
        self._out[p].clear()
        self._dirty.update(self._keys)

    def _goodbye_eof(self, p: int) -> None:
        with self._cond:
            self._gone.add(p)
            self._drop_out(p)
            self._cond.notify_all()
        try:
            self._poll.unregister(self._conns[p].fileno())
        except (KeyError, ValueError, OSError):
            pass

    def _alloc_for(self, p: int) -> Callable[[Meta], Alloc | None]:
        def alloc_for(meta: Meta) -> Alloc | None:
            with self._cond:
                k = self._keys.get(meta.keys[0]) if len(meta.keys) == 1 else None
                if k is None or p in self._shm:     # no data comes: it is in the segment
                    return None
                if meta.cmd == Command.PUSH:
                    lo, hi = k.bounds[self.rank]
                    into = self._buffer(k)
                elif meta.cmd == Command.DATA:
                    lo, hi = k.bounds[p]
                    into = k.result[lo:hi]
                else:
                    return None

            def alloc(i: int, dtype: np.dtype[Any], shape: tuple[int, ...]) \
                    -> np.ndarray | None:
                return into if i == 0 and dtype == into.dtype and shape == into.shape \
                    else None
            return alloc
        return alloc_for

    def _on_message(self, p: int, meta: Meta, arrays: list[np.ndarray]) -> None:
        if meta.cmd == Command.GOODBYE:
            with self._cond:
                self._said_goodbye.add(p)
            return
        if meta.cmd == Command.ERROR:
            err = error_from_body(meta.body, f"worker {p}")
            self._fail(type(err), str(err))
            return
        if meta.cmd == Command.SEGMENT:
            self._on_segment(p, meta)
            return
        shm = p in self._shm
        with self._cond:
            k = self._keys.get(meta.keys[0]) if len(meta.keys) == 1 else None
            why = None
            if meta.cmd not in (Command.PUSH, Command.DATA):
                why = f"a {meta.cmd.name} message"
            elif k is None:
                why = (f"a {'push' if meta.cmd == Command.PUSH else 'sum'} of ps_key "
                       f"{meta.keys[:1]} that worker {self.rank} does not take on the "
                       "collective path (was set_optimizer or set_collective called on "
                       "some workers only?)")
            else:
                lo, hi = k.bounds[self.rank if meta.cmd == Command.PUSH else p]
                last = k.came[p] if meta.cmd == Command.PUSH else k.got[p]
                if meta.ts != last + 1:
                    why = f"key {k.name!r}: round {meta.ts} after round {last}"
                elif shm and (arrays or p not in k.mapped):
                    why = (f"key {k.name!r}: {len(arrays)} arrays on a shared-memory link"
                           if arrays else f"key {k.name!r}: round {meta.ts} before its "
                           "shared-memory segment")
                elif not shm and (len(arrays) != 1 or arrays[0].dtype != k.dtype or
                                  arrays[0].shape != (hi - lo,)):
                    why = (f"key {k.name!r}: {len(arrays)} arrays, not one {k.dtype} "
                           f"chunk of {hi - lo} elements")
            if why is None and k is not None:
                if meta.cmd == Command.PUSH:
                    # a same-host peer's part is read in place, from its push slot
                    k.parts[p].append(k.mapped[p].push[lo:hi] if shm else arrays[0])
                    k.came[p] = meta.ts
                    self._dirty.add(k.pskey)
                else:
                    k.got[p] = meta.ts
                    self._cond.notify_all()
                return
        self._refuse(p, ClusterError, f"worker {p} sent {why}")

    def _on_segment(self, p: int, meta: Meta) -> None:
        """A same-host peer's segment of a key: check it, map it (or refuse it)."""
        inbox = self._inbox.get(p)
        try:
            fd = inbox.take() if inbox is not None else None
        except ProtocolError as err:
            self._refuse(p, ProtocolError, f"worker {p} sent {err}")
            return
        with self._cond:
            k = self._keys.get(meta.keys[0]) if len(meta.keys) == 1 else None
        why = None
        if p not in self._shm:
            why = "a shared-memory segment on a link that does not take one"
        elif k is None:
            why = (f"a shared-memory segment of ps_key {meta.keys[:1]} that worker "
                   f"{self.rank} does not take on the collective path")
        elif p in k.mapped:
            why = f"a second shared-memory segment of key {k.name!r}"
        elif fd is None:
            why = f"a shared-memory segment of key {k.name!r} without its descriptor"
        if why is None and k is not None and fd is not None:
            try:
                seg = Segment.open(fd, layout(k.result.size, k.dtype, k.bounds[p]),
                                   f"worker {p}", f"a shared-memory segment of key {k.name!r}")
            except ProtocolError as err:
                self._refuse(p, ProtocolError, str(err))
                return
            with self._cond:
                k.mapped[p] = seg
            return
        if fd is not None:
            os.close(fd)
        self._refuse(p, ProtocolError, f"worker {p} sent {why}")

    def _refuse(self, p: int, cls: type[KVStoreError], msg: str) -> None:
        """A peer broke the rules: tell it, fail this path (never the thread)."""
        with self._cond:
            if p not in self._gone:
                self._queue(p, Command.ERROR, 0, -1, None, body=error_body(cls(msg)))
        self._fail(cls, msg)

    def _sum_ready(self) -> None:
        """Sum every chunk whose round is complete, and send the sums."""
        while True:
            with self._cond:
                k = None
                for pk in sorted(self._dirty):
                    cand = self._keys.get(pk)
                    if cand is None or not cand.own:
                        self._dirty.discard(pk)
                        continue
                    if cand.sending == 0 and all(cand.parts[q] for q in self.peers):
                        k = cand
                        break
                if k is None:
                    return
                own = k.own.popleft()
                parts = {q: k.parts[q].popleft() for q in self.peers}
                parts[self.rank] = own
            lo, hi = k.bounds[self.rank]
            acc = k.result[lo:hi] if k.seg is None else k.seg.total
            # the server's arithmetic (Engine.accumulate): copy rank 0's, add the rest in order
            np.copyto(acc, parts[0], casting="same_kind")
            for q in range(1, self.num_workers):
                np.add(acc, parts[q], out=acc, casting="same_kind")
            with self._cond:
                # spare buffers again: what came over a socket (and this worker's own part,
                # without a segment); the segments' views are not buffers
                k.free.extend(a for q, a in parts.items() if q not in self._shm and
                              (q != self.rank or k.seg is None))
                k.summed += 1
                live = [p for p in self.peers if p not in self._gone]
                k.sending = len(live)

                def one_sent(k: _Key = k) -> None:
                    k.sending -= 1
                    self._dirty.add(k.pskey)
                for p in live:    # a same-host peer reads the sum from the sum slot
                    self._queue(p, Command.DATA, k.summed, k.pskey,
                                None if p in self._shm else acc, one_sent)
                self._cond.notify_all()
            for p in live:
                self._write(p)

    def _write(self, p: int) -> None:
        conn = self._conns[p]
        while True:
            with self._cond:
                if p in self._gone or not self._out[p]:
                    return
                item = self._out[p][0]
            try:
                bufs = item.bufs
                if conn.tls:     # TLS sockets have no sendmsg (as StreamConn.send)
                    sent = conn.sock.send(bufs[item.first][:1 << 20])
                elif item.fds:   # the descriptors go with the message's first bytes
                    sent = conn.sock.sendmsg(bufs[item.first:item.first + _IOV_MAX],
                                             fd_message(item.fds))
                    item.fds = []
                else:
                    sent = conn.sock.sendmsg(bufs[item.first:item.first + _IOV_MAX])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except OSError as err:
                # what it sent before it closed is still to be read here: its GOODBYE may
                # be among it (a peer that closed its store is no failure)
                while self._read(p):
                    pass
                with self._cond:
                    if p in self._gone:
                        return
                    closed = p in self._said_goodbye
                if closed:      # it closed its store: what it did not read it did not need
                    self._goodbye_eof(p)
                else:
                    self._lost(p, str(err))
                return
            with self._cond:
                item.first = drop_sent(bufs, item.first, sent)
                if item.first == len(bufs):
                    self._out[p].popleft()
                    if item.done is not None:
                        item.done()
                    self._cond.notify_all()

    # ---- closing ---------------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Say goodbye to every peer, stop the thread, close links and listeners."""
        if self._thread is not None:
            # first the sums this worker owes for its own last pushes (the others may pull
            # them after this worker is gone), as a server serves a round it has begun
            end = time.monotonic() + timeout
            with self._cond:
                while self._failure is None and time.monotonic() < end and any(
                        k.summed < k.pushed for k in self._keys.values()) and \
                        not self._said_goodbye:
                    self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
                for p in self.peers:
                    if p not in self._gone:
                        self._queue(p, Command.GOODBYE, 0, -1, None)
                self._stop = True
            self._wake()
            self._thread.join(timeout)
            self._thread = None
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        for inbox in self._inbox.values():
            inbox.close()
        self._inbox.clear()
        with self._cond:
            for q in self._out.values():
                q.clear()
            for k in self._keys.values():
                k.own.clear()
                for parts in k.parts.values():
                    parts.clear()
                for seg in [*k.mapped.values(), *([k.seg] if k.seg is not None else [])]:
                    seg.close()
                k.mapped.clear()
                k.seg = None
        self._links.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
