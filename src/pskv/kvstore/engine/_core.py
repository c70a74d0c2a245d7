"""Engine: the store's semantics with no sockets and no threads.

Stored values, merges, sync rounds that count distinct workers, async apply, the updater or
optimizer, optimizer states and row_sparse sums. A local store runs it with one worker in
process (a one-worker round closes on every push, so it calls :meth:`Engine.apply`
directly); a server runs it as its request handler (ps-lite's request-handle idea): each
request is a :class:`Ticket`, and the engine calls ``on_done(ticket)`` once every round the
ticket waits for has closed.

Invariants: in sync mode a key's round closes when ``num_workers`` distinct workers have
pushed it once, then the updater (or assign) runs once and every waiting pusher and puller
is answered (MXNet kvstore_dist_server.h ApplyUpdates); a worker's second push in an open
round waits for the next round; a pull after this worker's push waits for that push's round;
a ticket is answered exactly once (``EngineEvents.done`` or ``failed``).

Uneven data (``_uneven``, :meth:`Engine.worker_left`): a worker that *joined*
(``kv.join``) counts as having pushed zeros, so a round closes with the others' pushes
and the sum is theirs (the divisor, the optimizer's ``rescale_grad``, is the user's and
stays the same: DDP's ``Join`` default); a worker that *closed* without joining can never push again, so every
round that still needs its push fails with a WorkerClosedError naming it, the key and the
round, at once. Joins come in epochs: once every worker has joined, the workers tell the
servers (:meth:`Engine.end_join`) and the next rounds count every worker again (a worker
that closed meanwhile is then one that closed).

Over 500 lines because the engine's sync rounds (open, accumulate in rank order, close,
defer, fail) are one state machine over the same entries; snapshots, tables and uneven
data are already apart.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import numpy as np

from ... import compression, optimizer
from ...errors import (ClusterError, ClusterTimeoutError,
                      KeyAlreadyInitializedError, KeyNotInitializedError, KVStoreError,
                      ProtocolError, ShapeMismatchError, UnsupportedError)
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._types import Key, Updater
from .._specs import check_optimizer_spec
from .._table_rules import check_optimizer as check_table_optimizer
from .._reduce import sum_rows
from .._snapshot import Reader, ShardCopy
from . import _state as _engine_state, _tables as tables
from ._positions import DataPositions, mark_pairs
from ._uneven import UnevenRounds

__all__ = ["Engine", "EntryCopy", "PushKind", "RoundObserver", "Ticket"]

#: how a pushed value travels: dense, compressed (packed words), row_sparse (rows, data),
#: table (ids, grads) to a table key's shard (``_tables``; ``T``: sent again, D9)
PushKind = Literal["d", "c", "r", "t", "T"]


#: one key's copy: its metadata (name, id, shape, placement, round, counts), value, state
EntryCopy = tuple[dict[str, Any], np.ndarray, Any]


class RoundObserver(Protocol):
    """What an engine tells of each applied round (sync) or applied push (async) of a key,
    before anyone waiting for it is answered: a server's shard hangs its backup link and
    its periodic checkpoints here (``kvstore/durable/_shards.py``)."""

    @property
    def wants_merged(self) -> bool:
        """Whether :meth:`round_applied` needs the round's merged value (else None)."""

    def round_applied(self, key: Key, merged: NDArray | None, rnd: int,
                      applied: dict[int, int]) -> None:
        """Round ``rnd`` of ``key`` is applied; ``applied``: worker -> pushes applied."""

    def rows_born(self, key: Key, born: Any, rnd: int, applied: dict[int, int]) -> None:
        """A training lookup of table ``key`` inserted rows (``born``: a TableRound)."""

    def settle(self) -> None:
        """The arrays handed to :meth:`round_applied` are about to change (a deferred push
        opens the key's next round in its merge buffer): done with them now."""


class Ticket:
    """One request waiting for the rounds of some of its keys to close.

    ``peer``, ``ts`` and ``cmd`` belong to whoever made it (the engine never reads them);
    ``rows`` are per-key row ids for a row_sparse pull. A ticket is answered once
    (``EngineEvents.done`` or ``failed``), or never once abandoned (:meth:`abandon`).
    """

    __slots__ = ("peer", "ts", "cmd", "keys", "remaining", "rows", "train", "abandoned")

    def __init__(self, peer: Any, ts: int, cmd: Any, keys: tuple[Key, ...],
                 rows: list[np.ndarray] | None = None, train: bool | None = None) -> None:
        self.peer, self.ts, self.cmd, self.keys = peer, ts, cmd, keys
        self.remaining = 0
        self.rows = rows
        #: a table lookup of the IDs in ``rows`` (True: training, False: eval), else None
        self.train = train
        self.abandoned = False

    def abandon(self) -> None:
        """The engine never answers this ticket (it failed, or its maker answers it)."""
        self.abandoned = True


@dataclass(slots=True)
class _Entry:
    """A key the engine holds, with its sync round state."""

    name: Key                          # the user's key: what the updater sees
    stored: NDArray
    sparse: bool
    place: tuple[int, int, tuple[int, ...]] | None = None  # start, stop, the whole key's shape
    merge: np.ndarray | None = None
    pushers: set[int] = field(default_factory=set)
    round: int = 0
    applied: dict[int, int] = field(default_factory=dict)     # per worker: pushes applied
    started: float = 0.0
    waiting: list[Ticket] = field(default_factory=list)            # pushers of this round
    pulls: list[tuple[int, Ticket]] = field(default_factory=list)  # pulls after a push
    deferred: list[tuple[int, list[np.ndarray], str, Ticket | None, int | None]] = \
        field(default_factory=list)
    # the containers only some keys or rounds use are made on first use (None: empty), so
    # that a dense key costs no empty list or dict for them (one million one-float keys)
    sparse_parts: list[tuple[np.ndarray, np.ndarray]] | None = None
    last: Any = None                   # the round's merged value, kept for ``replicate``
    table: tables.ServedTable | None = None   # a table key's shard (then ``stored`` is empty)
    part_workers: list[int] | None = None          # the worker of each table part
    again: list[np.ndarray] | None = None          # IDs of table pushes sent again
    # a dense sync round is summed in worker-rank order: the next rank to add (-1: rank 1
    # opened the round, rank 0 is next), and copies of pushes that came before a lower
    # rank's (Engine._add_in_order)
    next_rank: int = 0
    early: dict[int, tuple[list[np.ndarray], str]] | None = None
    # per worker: why its last push failed because a worker closed (its next pull of the
    # key fails alike, not reading the last round as if its push had been applied); made
    # on first use, as ``early`` (a key's bookkeeping stays small: test_engine)
    refused: dict[int, KVStoreError] | None = None
    # data positions (``_positions``): the step of each tagged push of the open round, and
    # per worker the step and base count of its last tagged push (made on first use)
    tags: dict[int, int] | None = None
    marks: dict[int, tuple[int, int]] | None = None


class EngineEvents:
    """What an engine tells whoever runs it: its one listener, given at construction.

    This base tells nobody (a local store's engine); a server's answers its workers and
    feeds its straggler watch and metrics. ``watches_rounds`` and ``times_updates`` are
    read as each sync round closes: off, the engine does not even read its clock.
    """

    #: whether :meth:`round_closed` hears of each sync round's close
    watches_rounds = False
    #: whether :meth:`applied_in` hears how long each sync round's update took
    times_updates = False

    def done(self, engine: "Engine", ticket: Ticket) -> None:
        """Every round ``ticket`` waited for has closed: answer it."""

    def failed(self, engine: "Engine", ticket: Ticket, err: KVStoreError) -> None:
        """A round ``ticket`` waited for failed with ``err``: answer that."""

    def round_closed(self, engine: "Engine", key: Key, worker: int, waited: float) -> None:
        """``worker``'s push closed a sync round of the user's ``key``, ``waited`` seconds
        after the round's first push (stragglers, metrics)."""

    def applied_in(self, seconds: float) -> None:
        """A sync round's update (``finish``: the sum applied, the optimizer run) took
        ``seconds``, timed from its close (metrics)."""


class Engine(UnevenRounds, DataPositions):
    """Stored values and the rules that change them.

    Parameters
    ----------
    num_workers : int
        Distinct workers that close a sync round.
    sync : bool
        Sync rounds (``dist_sync``) or apply every push at once (``dist_async``).
    events : EngineEvents, optional
        Who hears of answered and failed tickets, closed rounds and update times (the
        default: nobody).
    clock : callable, optional
        Seconds, for round timeouts (``time.monotonic``).
    """

    def __init__(self, num_workers: int = 1, sync: bool = True,
                 events: EngineEvents | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.sync = sync
        self.events = events if events is not None else EngineEvents()
        self._clock = clock
        #: key -> stored value (the local store's fast paths read it directly)
        self.stored: dict[Key, NDArray] = {}
        self._entries: dict[Key, _Entry] = {}
        self.updater: Updater | None = None
        #: the optimizer spec as a worker sent it (no counts): a worker's identical repeat
        #: (every worker sends it, a restarted one again) is a no-op, even once the
        #: optimizer was rebuilt from a copy or a checkpoint whose spec carries its counts
        self._opt_spec: Any = None
        self.compressor: Any = None
        self._gc_params: Any = None
        #: told of each applied round or async push, before any request waiting for it
        #: is answered (a server's shard: its backup and its periodic checkpoints)
        self.observer: RoundObserver | None = None
        #: workers that joined (they count as pushing zeros) and workers that closed
        #: without joining (a round needing their push fails): :meth:`worker_left`
        self.joined: frozenset[int] = frozenset()
        self.departed: frozenset[int] = frozenset()
        self._lowest = 0        # the lowest rank not joined: a round's sum starts there
        #: the join epoch under way (joins every worker completed), and the joined
        #: workers that closed in it (departed once it ends)
        self.join_epoch = 0
        self._closed_joined: frozenset[int] = frozenset()
        self._init_positions()

    # ---- keys ------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entry_name(self, key: Key) -> Key:
        """The user's key ``key`` was initialized for."""
        return self._entries[key].name

    def init(self, key: Key, value: np.ndarray, sparse: bool = False, name: Key | None = None,
             ctx: Any = None, place: tuple[int, int, tuple[int, ...]] | None = None) -> NDArray:
        """Keep a copy of ``value`` under ``key`` (all rows of it for row_sparse keys).

        ``place``: the part of the user's key ``value`` is (elements, or rows for row_sparse,
        ``[start, stop)`` of a key of the given shape); None: all of it. Checkpoints record it.
        """
        if key in self._entries:
            shown = key if name is None else name
            raise KeyAlreadyInitializedError(
                f"key {shown!r} is initialized twice. Each key takes one init (or broadcast); "
                "push to change its value.", key=shown)
        data = np.array(value, copy=True)
        stored: NDArray = RowSparseNDArray._all_rows(data, ctx) if sparse else NDArray(data, ctx)
        self._entries[key] = _Entry(key if name is None else name, stored, sparse, place)
        self.stored[key] = stored
        return stored

    def init_table(self, key: Key, table: tables.ServedTable) -> None:
        """Hold ``table`` (a shard of table key ``table.name``, ``served_table``) under
        ``key``."""
        if key in self._entries:
            raise KeyAlreadyInitializedError(
                f"key {table.name!r} is initialized twice. Each key takes one init.",
                key=table.name)
        stored = NDArray(np.zeros((0, table.spec.dim), table.spec.state_dtype))
        self._entries[key] = _Entry(table.name, stored, False, table=table)
        self.stored[key] = stored

    def readers_behind(self, seen_within: float) -> int:
        """How many stream readers that read within ``seen_within`` seconds have not read a
        table shard of this engine up to its version (E10)."""
        now, behind = time.time(), 0
        for e in self._entries.values():
            if e.table is not None:
                behind += sum(1 for v, at in e.table.readers.values()
                              if v < e.table.version and now - at <= seen_within)
        return behind

    def stream_states(self) -> dict[Key, tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """Each table shard's change stream (``DynamicTable.stream_state``), by key."""
        return {k: e.table.stream_state() for k, e in self._entries.items()
                if e.table is not None}

    def table(self, key: Key, what: str, where: str = "this engine") -> tables.ServedTable:
        """The table shard of table key ``key``, or KeyNotInitializedError/UnsupportedError."""
        self.value_of(key, what, where)
        table = self._entries[key].table
        if table is None:
            raise UnsupportedError(f"{what}: key {self._entries[key].name!r} is not a table "
                                   "key. Use pull or row_sparse_pull.",
                                   key=self._entries[key].name)
        return table

    def value_of(self, key: Key, what: str, where: str = "this engine") -> NDArray:
        """The stored value of ``key``, or KeyNotInitializedError."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyNotInitializedError(
                f"{what}: key {key!r} is not on {where}: it was never initialized (or the "
                "workers disagree on where keys live). Call kv.init on every worker first.",
                key=key)
        return entry.stored

    # ---- update rules ----------------------------------------------------------------
    def apply(self, key: Key, merged: NDArray) -> None:
        """Run the updater on ``merged`` (assign without one): the end of a round."""
        entry = self._entries[key]
        stored = entry.stored
        if self.updater is not None:
            self.updater(entry.name, merged, stored)
        elif isinstance(merged, RowSparseNDArray):
            table = stored._data
            table[...] = 0
            table[merged._indices] = merged._data
        else:
            np.copyto(stored._data, merged._data, casting="same_kind")

    def set_optimizer_spec(self, spec: Any, sent: Any = None) -> None:
        """Install the optimizer ``spec`` (JSON); identical repeats are no-ops.

        ``sent``: the spec a worker sent for the optimizer ``spec`` continues (a copy's or
        a checkpoint's spec carries the optimizer's counts, which a worker's never does):
        repeats are compared with it from now on."""
        if spec != self._opt_spec:
            opt = optimizer.from_spec(spec)
            check_optimizer_spec(opt, spec)     # a spec that cannot update is refused now
            for e in self._entries.values():    # and one a table key cannot run
                if e.table is not None:
                    check_table_optimizer(e.table.spec, e.table.name, opt)
            self.updater = optimizer.get_updater(opt)
            self._opt_spec = spec
        if sent is not None:
            self._opt_spec = sent

    @property
    def sent_spec(self) -> Any:
        """The optimizer spec as a worker sent it (None: none yet), for copies."""
        return self._opt_spec

    def set_compression(self, params: Any) -> None:
        """Decompress pushes of kind ``'c'`` with these gradient-compression params."""
        if params != self._gc_params:
            self.compressor = compression.create(params)
            self._gc_params = params

    def states_updater(self, action: str, where: str = "this store") -> Any:
        """The updater that holds optimizer states, or UnsupportedError."""
        upd = self.updater
        if upd is None or not hasattr(upd, "get_states"):
            raise UnsupportedError(
                f"cannot {action} optimizer states: {where} has no optimizer. Call "
                "kv.set_optimizer(...) first.")
        return upd

    # ---- pushes ----------------------------------------------------------------------
    def check_push(self, key: Key, kind: str, arrays: list[np.ndarray],
                   where: str = "this engine") -> None:
        """Raise if ``arrays`` (of push ``kind``) do not fit ``key``; change nothing."""
        entry = self._entries[key]
        stored, name = entry.stored, entry.name
        if entry.table is not None:
            tables.check_table_push(entry.table, kind, arrays)
            return
        if kind in ("t", "T"):
            raise UnsupportedError(f"a table push (ids, grads) to key {name!r}, which is not "
                                   "a table key. Push arrays of its shape.", key=name)
        if kind == "c":
            if self.compressor is None:
                raise UnsupportedError("a compressed push reached a server without gradient "
                                       "compression: call set_gradient_compression on every "
                                       "worker before init.", key=name)
            words = self.compressor.packed_size(stored.size)
            if arrays[0].nbytes != 4 * words:   # what decompress needs: checked before any key
                raise ShapeMismatchError(
                    f"compressed push to key {name!r}: {arrays[0].nbytes} bytes of packed "
                    f"words for {stored.size} values, which take {4 * words} bytes. Push "
                    "what compress() returns for the key's size.", key=name,
                    shape=arrays[0].shape)
            return
        if kind == "r":
            rows, data = arrays
            if not entry.sparse:
                raise ShapeMismatchError(f"row_sparse push to dense key {name!r}", key=name)
            if data.shape != (len(rows),) + stored.shape[1:] or rows.dtype.kind not in "iu" \
                    or (rows.size and (rows.min() < 0 or rows.max() >= stored.shape[0])):
                raise ShapeMismatchError(
                    f"row_sparse push to key {name!r}: rows/data do not fit shape "
                    f"{stored.shape}", key=name, shape=data.shape)
            if not np.can_cast(data.dtype, stored.dtype, "same_kind"):
                raise ShapeMismatchError(f"row_sparse push to key {name!r}: dtype "
                                         f"{data.dtype} cannot be cast to {stored.dtype}. "
                                         "Push rows of the key's dtype.", key=name)
            return
        value = arrays[0]
        if value.size != stored.size:
            raise ShapeMismatchError(
                f"push to key {name!r} got {value.size} values, but its part on {where} has "
                f"shape {stored.shape}. Push arrays of the shape the key was initialized "
                "with.", key=name, shape=value.shape)
        if value.dtype != stored.dtype and \
                not np.can_cast(value.dtype, stored.dtype, "same_kind"):
            raise ShapeMismatchError(f"push to key {name!r}: dtype {value.dtype} cannot "
                                     f"be cast to {stored.dtype}", key=name)

    def push(self, key: Key, worker: int, arrays: list[np.ndarray], kind: str,
             ticket: Ticket | None = None, tag: int | None = None) -> None:
        """One worker's (checked) value for ``key``: add it to the round, or apply it.

        ``arrays`` may be reused by the caller after this returns (what is kept is copied).
        ``tag``: the step of a worker that trains through a data position (``_positions``).
        """
        entry = self._entries[key]
        if not self.sync:
            if tag is not None:
                self._mark(entry, worker, tag, entry.applied.get(worker, 0))
            self.accumulate(key, arrays, kind, first=True)
            self.finish(key)
            entry.round += 1              # in dist_async a round is one applied push
            entry.applied[worker] = entry.applied.get(worker, 0) + 1
            self._applied(key, entry)
            return
        if worker in entry.pushers:       # its next round: wait (distinct workers per round)
            if tag is not None:
                self._mark(entry, worker, tag, self._held(entry, worker))
            entry.deferred.append((worker, [np.array(a) for a in arrays], kind, ticket, tag))
            if ticket is not None:
                ticket.remaining += 1
            return
        if tag is not None:
            self._mark(entry, worker, tag, self._held(entry, worker))
            if entry.tags is None:
                entry.tags = {}
            entry.tags[worker] = tag
        if not entry.pushers:
            entry.started = self._clock()
        if kind in "rtT":
            self.accumulate(key, arrays, kind, first=not entry.pushers)
        else:
            self._add_in_order(key, entry, worker, arrays, kind)
        if entry.table is not None:
            if entry.part_workers is None:
                entry.part_workers = []
            entry.part_workers.append(worker)
        entry.pushers.add(worker)
        if ticket is not None:
            ticket.remaining += 1
            entry.waiting.append(ticket)
        if self.departed and self.departed - entry.pushers - self.joined:
            self._fail_departed(entry)
        elif self._complete(entry) and self._sealed_for(key, entry):
            now = 0.0
            events = self.events
            if events.watches_rounds or events.times_updates:
                now = self._clock()
                if events.watches_rounds:
                    events.round_closed(self, entry.name, worker, now - entry.started)
            self._close_round(key, entry, now)

    def _complete(self, entry: _Entry) -> bool:
        """Whether every worker has pushed ``entry``'s open round (or joined)."""
        return len(entry.pushers) == self.num_workers or bool(
            self.joined and len(entry.pushers | self.joined) == self.num_workers)

    @staticmethod
    def _held(entry: _Entry, worker: int) -> int:
        """``worker``'s pushes of ``entry`` held: applied, in the open round, deferred."""
        return entry.applied.get(worker, 0) + (worker in entry.pushers) + \
            sum(1 for d in entry.deferred if d[0] == worker)

    def _add_in_order(self, key: Key, entry: _Entry, worker: int, arrays: list[np.ndarray],
                      kind: str) -> None:
        """Add a dense push to its round in worker-rank order: ``((v0 + v1) + v2) + ...``
        whatever order the pushes arrive in, so a round's sum is the same bits every run
        (and the same as the collective path's, docs/collective.md); a push that comes
        before a lower rank's is copied until its turn."""
        if self.joined:
            self._skip_joined(entry)
        if worker == 1 and entry.next_rank == 0 and kind != "c" \
                and arrays[0].dtype == entry.stored.dtype:
            # v1 + v0 is v0 + v1 to the bit (IEEE addition commutes): rank 1 may start the
            # round, no copy; -1 says rank 0 is added next, then rank 2 on
            self.accumulate(key, arrays, kind, first=True)
            entry.next_rank = -1
            return
        if entry.next_rank == -1 and worker == 0:
            self.accumulate(key, arrays, kind, first=False)
            entry.next_rank = 2
        elif worker != entry.next_rank:
            if entry.early is None:
                entry.early = {}
            entry.early[worker] = ([np.array(a) for a in arrays], kind)
            return
        else:
            self.accumulate(key, arrays, kind, first=entry.next_rank == self._lowest)
            entry.next_rank += 1
        self._add_early(key, entry)

    def _add_early(self, key: Key, entry: _Entry) -> None:
        """Add the copied pushes whose turn has come (a joined rank's turn is skipped)."""
        while True:
            if self.joined:
                self._skip_joined(entry)
            if not entry.early or entry.next_rank not in entry.early:
                return
            held, held_kind = entry.early.pop(entry.next_rank)
            self.accumulate(key, held, held_kind, first=entry.next_rank == self._lowest)
            entry.next_rank += 1

    def _skip_joined(self, entry: _Entry) -> None:
        """Move a round's next rank past the joined workers (they add zeros: nothing)."""
        if entry.next_rank == -1 and 0 in self.joined:
            entry.next_rank = 2
        while entry.next_rank in self.joined and not (entry.early and
                                                       entry.next_rank in entry.early):
            entry.next_rank += 1

    # ---- the two steps of a round (override both for a server that does no arithmetic,
    # ---- as the benchmarks' EmptyHandler does) -----------------------------------------
    def accumulate(self, key: Key, arrays: list[np.ndarray], kind: str, first: bool) -> None:
        """Add one worker's value to ``key``'s round (``first``: the round's first)."""
        entry = self._entries[key]
        if kind in "rtT":
            # a table push in dist_async is applied before push() returns: no copy to keep
            keep = self.sync or kind == "r"
            if entry.sparse_parts is None:
                entry.sparse_parts = []
            entry.sparse_parts.append((arrays[0].astype(np.int64, copy=keep),
                                       np.array(arrays[1], copy=True) if keep
                                       else np.asarray(arrays[1])))
            if kind == "T":          # a table push sent again (docs/embeddings.md D9)
                if entry.again is None:
                    entry.again = []
                entry.again.append(entry.sparse_parts[-1][0])
            return
        stored = entry.stored
        value = self.compressor.decompress(arrays[0], stored.size).reshape(stored.shape) \
            if kind == "c" else arrays[0].reshape(stored.shape)
        if not self.sync:
            entry.merge = value
            return
        if first or entry.merge is None:
            if entry.merge is None:
                entry.merge = np.empty(stored.shape, stored.dtype)
            np.copyto(entry.merge, value, casting="same_kind")
        else:
            np.add(entry.merge, value, out=entry.merge, casting="same_kind")

    def finish(self, key: Key) -> None:
        """The round of ``key`` is complete: apply its merged value."""
        entry = self._entries[key]
        want = self.observer is not None and self.observer.wants_merged
        if entry.table is not None:
            parts, entry.sparse_parts = entry.sparse_parts or [], None
            workers, entry.part_workers = entry.part_workers or [], None
            if len(workers) == len(parts) > 1:
                # in worker order, not arrival order: the sums of duplicate IDs (R7) are
                # then the same bits whichever worker's push came first
                parts = [p for _w, p in sorted(zip(workers, parts),
                                               key=lambda wp: wp[0])]
            opt = getattr(self.updater, "optimizer", None)
            again, entry.again = entry.again or [], None
            entry.last = tables.apply_round(entry.table, parts, opt, entry.name, want, again)
            return
        merged = self._merged(entry)
        self.apply(key, merged)
        if want:
            entry.last = merged

    def _applied(self, key: Key, entry: _Entry) -> None:
        """Tell the observer that a round of ``key`` was applied."""
        if self.observer is not None:
            merged, entry.last = entry.last, None
            self.observer.round_applied(key, merged, entry.round, entry.applied)

    def set_counters(self, key: Key, rnd: int, applied: dict[int, int],
                     marks: dict[int, tuple[int, int]] | None = None) -> None:
        """Set ``key``'s round, per-worker push counts and data-position marks (a backup's
        copy of a shard)."""
        entry = self._entries[key]
        entry.round, entry.applied = rnd, dict(applied)
        if marks:
            entry.marks = dict(marks)

    def replay(self, key: Key, merged: Any, rnd: int, applied: dict[int, int],
               marks: dict[int, tuple[int, int]] | None = None) -> None:
        """A backup's copy of a primary's applied round: the same update, the same counts."""
        entry = self._entries[key]
        if entry.table is not None:
            assert isinstance(merged, tables.TableRound)
            tables.put_rows(entry.table, merged.arrays, merged.meta)
        else:
            self.apply(key, merged)
        self.set_counters(key, rnd, applied, marks)

    def marks_of(self, key: Key) -> list[list[int]]:
        """``key``'s data-position marks as JSON (``_positions.mark_pairs``)."""
        return mark_pairs(self._entries[key].marks)

    def _merged(self, entry: _Entry) -> NDArray:
        if entry.sparse:
            rows, data = sum_rows(entry.sparse_parts or [], entry.stored.shape,
                                  entry.stored.dtype, unique_rows=False)
            entry.sparse_parts = None
            return RowSparseNDArray(data, rows, entry.stored.shape)
        assert entry.merge is not None
        return entry.stored._new(entry.merge)      # the stored value's context

    def _close_round(self, key: Key, entry: _Entry, now: float = 0.0) -> None:
        try:
            self.finish(key)
        except Exception as err:  # the update failed: its pushers hear why; the key goes on
            entry.round += 1
            self._fail_entry(entry, err if isinstance(err, KVStoreError) else ClusterError(
                f"the update of key {entry.name!r} failed: {type(err).__name__}: {err}",
                key=entry.name))
            return
        if now and self.events.times_updates:     # outside the try: not the update's
            self.events.applied_in(self._clock() - now)
        entry.round += 1
        for worker in entry.pushers:
            entry.applied[worker] = entry.applied.get(worker, 0) + 1
        self._applied(key, entry)         # the backup has it before anyone is answered
        entry.pushers.clear()
        entry.next_rank = 0
        entry.tags = None
        # taken before anything is released or pushed again (no new list when empty)
        waiting, entry.waiting = entry.waiting, []
        deferred: list[tuple[int, list[np.ndarray], str, Ticket | None, int | None]] = []
        if entry.deferred:
            deferred, entry.deferred = entry.deferred, []
            if self.observer is not None:
                self.observer.settle()    # the round's arrays change from here on
        pulls: list[tuple[int, Ticket]] = []
        if entry.pulls:
            pulls, entry.pulls = entry.pulls, []
        for ticket in waiting:
            self.release(ticket)
        for worker, arrays, kind, dticket, dtag in deferred:  # they open the next round
            if dticket is not None:
                dticket.remaining -= 1
            self.push(key, worker, arrays, kind, dticket, dtag)
        for worker, ticket in pulls:
            if self._pushed(entry, worker):
                entry.pulls.append((worker, ticket))    # its later push is not applied yet
            else:
                self.release(ticket)

    # ---- snapshots (kvstore._snapshot writes and reads them) ---------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def observed(self) -> list[tuple[Key, int, int, tables.ServedTable | None, int]]:
        """Per key held: the user's key, pushes applied, bytes of the value held, its
        table (or None), requests waiting for its rounds (pushes and pulls of the open
        round, deferred pushes). For metrics, read from another thread: a copy of the
        entries."""
        return [(e.name, sum(list(e.applied.values())), e.stored.size * e.stored.dtype.itemsize,
                 e.table, len(e.waiting) + len(e.pulls) + len(e.deferred))
                for e in list(self._entries.values())]

    def copy_entry(self, key: Key) -> EntryCopy:
        """A copy of one key: its metadata, its value (a table shard's: its arrays by
        name), its optimizer state."""
        return _engine_state.copy_entry(self, key, self._entries[key])

    def shard_copy(self, copies: list[EntryCopy]) -> ShardCopy:
        """A shard made of key copies (:meth:`copy_entry`), with the optimizer and the
        compression settings."""
        return _engine_state.shard_copy(self, copies)

    def snapshot(self, values: dict[Key, np.ndarray] | None = None) -> ShardCopy:
        """A copy of the whole shard (values, optimizer states, rounds, placement): the
        only pause a checkpoint causes; write it with ``_snapshot.write_shard``.

        ``values``: the parts of dense keys whose value the workers hold (the collective
        path, docs/collective.md), written in place of the stored ones (which stay as they
        are); checked as :meth:`adopt` checks them, and nothing is copied if one fails."""
        values = values or {}
        self._check_held(values, "checkpoint")
        copies = []
        for k in self._entries:
            meta, arr, state = self.copy_entry(k)
            if k in values:
                arr = np.array(values[k], copy=True).reshape(arr.shape)
            copies.append((meta, arr, state))
        return self.shard_copy(copies)

    def adopt(self, values: dict[Key, np.ndarray]) -> None:
        """Take the workers' values of keys that were summed among them (the collective
        path) as the stored ones: ``set_optimizer`` after such pushes moves the keys back
        here. Each must be a dense key of this shard that no push reached here (round 0),
        with the stored part's number of elements and dtype; else ProtocolError and nothing
        changes."""
        self._check_held(values, "set_optimizer", fresh=True)
        for k, v in values.items():
            data = self._entries[k].stored._data
            data[...] = v.reshape(data.shape)

    def _check_held(self, values: dict[Key, np.ndarray], what: str,
                    fresh: bool = False) -> None:
        for k, v in values.items():
            e = self._entries.get(k)
            data = None if e is None or e.table is not None or e.sparse else e.stored._data
            if data is None or v.dtype != data.dtype or v.size != data.size:
                raise ProtocolError(
                    f"{what}: the workers' value of key {k} does not fit this shard "
                    f"(got {v.dtype} x {v.size}, holding "
                    f"{'no dense part' if data is None else f'{data.dtype} x {data.size}'})")
            if fresh and (e.round or e.pushers or e.deferred):
                raise ProtocolError(f"{what}: key {e.name!r} was pushed to this server, so "
                                    "its value is not the workers' to replace")

    @property
    def untouched(self) -> bool:
        """Whether no round of any key has closed yet (the values are the inits)."""
        return all(e.round == 0 for e in self._entries.values())

    def applied_by(self, worker: int) -> list[list[Any]]:
        """``[key, pushes of worker held]`` for every key: what a worker that sends its
        pushes again (a restarted worker, or one whose server died) may skip.

        A push held is one applied, or (``dist_sync``) one waiting in the key's open round
        or deferred to the next: a worker killed after such a push and restarted must not
        push it again, or the round would get it twice (the chaos soak found this)."""
        return [[k, self._held(e, worker) if self.sync else e.applied.get(worker, 0)]
                for k, e in self._entries.items()]

    def restore(self, reader: Reader, counters: bool = False) -> None:
        """Set every key this engine holds from a checkpoint (its part of each key, on
        whatever placement saved it; a table shard re-hashed from however many servers
        saved it), with optimizer states; all or nothing.

        ``counters``: also the rounds and per-worker push counts (a restarted server of the
        same job); else they keep counting this job's pushes (``kv.load_checkpoint``).
        """
        _engine_state.restore(self, reader, counters)

    # ---- tickets ---------------------------------------------------------------------
    def request(self, ticket: Ticket, ops: Callable[[], object]) -> None:
        """Run ``ops``, the push, pull or lookup calls of one request (each given
        ``ticket``), and answer ``ticket`` once all of them are over, never before every
        key is queued. If ``ops`` raises, ``ticket`` is abandoned (the caller answers the
        error; the rounds that hold it never do) and the error goes on."""
        self.hold(ticket)
        try:
            ops()
        except BaseException:
            ticket.abandon()
            raise
        self.release(ticket)

    def hold(self, ticket: Ticket) -> None:
        """Keep ``ticket`` open while its keys are queued (pair with :meth:`release`)."""
        ticket.remaining += 1

    def release(self, ticket: Ticket) -> None:
        """One wait of ``ticket`` is over; answer it when none is left."""
        ticket.remaining -= 1
        if ticket.remaining == 0 and not ticket.abandoned:
            self.events.done(self, ticket)

    def pull(self, key: Key, worker: int, ticket: Ticket, now: bool = False) -> None:
        """``ticket`` reads ``key``: after this worker's pending push of it, if any (not
        with ``now``: a restarted worker reads what its first run's pushes left)."""
        entry = self._entries[key]
        if self.sync and not now and self._pushed(entry, worker):
            ticket.remaining += 1
            entry.pulls.append((worker, ticket))
        elif entry.refused and worker in entry.refused:
            self._fail_ticket(ticket, entry.refused.pop(worker), entry)

    def values(self, ticket: Ticket) -> list[np.ndarray]:
        """The stored values (or the rows asked for) a closed ``ticket`` returns."""
        out = []
        for i, k in enumerate(ticket.keys):
            entry = self._entries[k]
            if entry.table is not None and ticket.train is not None and ticket.rows:
                want = self.observer is not None and self.observer.wants_merged
                got, born = tables.lookup_arrays(entry.table, ticket.rows[i], ticket.train,
                                                 want)
                out.extend(got)
                if born is not None and self.observer is not None:
                    # rows born by this lookup reach the backup before it is answered
                    self.observer.rows_born(k, born, entry.round, entry.applied)
                continue
            stored = entry.stored
            out.append(stored._data if ticket.rows is None else stored._data[ticket.rows[i]])
        return out

    @staticmethod
    def _pushed(entry: _Entry, worker: int) -> bool:
        return worker in entry.pushers or any(d[0] == worker for d in entry.deferred)

    def open_rounds(self) -> list[tuple[Key, int, float, frozenset[int]]]:
        """``(key, round, started, pushers)`` of every open sync round (the user's key)."""
        return [(e.name, e.round, e.started, frozenset(e.pushers))
                for e in self._entries.values() if e.pushers]

    # ---- failures --------------------------------------------------------------------
    def check_rounds(self, timeout: float) -> None:
        """Fail every round that has waited longer than ``timeout`` for its last worker."""
        now = self._clock()
        for entry in self._entries.values():
            if entry.pushers and now - entry.started > timeout:
                missing = sorted(set(range(self.num_workers)) - entry.pushers - self.joined)
                msg = (f"sync round {entry.round} of key {entry.name!r} waited "
                       f"{now - entry.started:.1f} s: workers {missing} have not pushed it "
                       f"(workers {sorted(entry.pushers)} did). Make every worker push every "
                       "key each step, or raise PSKV_ROUND_TIMEOUT.")
                self._fail_entry(entry, ClusterTimeoutError(msg, key=entry.name))

    def fail_all(self, err: KVStoreError) -> None:
        """Fail every open round with ``err`` (a node died)."""
        for entry in self._entries.values():
            self._fail_entry(entry, err)

    def _fail_ticket(self, ticket: Ticket, err: KVStoreError, entry: _Entry) -> None:
        """Answer ``ticket`` with ``err``; it is counted by no other key's round."""
        self.events.failed(self, ticket, err)
        for other in ticket.keys:   # answered: stop counting it anywhere else
            o = self._entries.get(other)
            if o is not None and o is not entry:
                o.waiting = [t for t in o.waiting if t is not ticket]
                o.pulls = [p for p in o.pulls if p[1] is not ticket]
        ticket.abandon()                    # never answered again

    def _fail_entry(self, entry: _Entry, err: KVStoreError) -> None:
        tickets = entry.waiting + [t for _, t in entry.pulls] + \
            [d[3] for d in entry.deferred if d[3] is not None]
        for ticket in {id(t): t for t in tickets}.values():
            self._fail_ticket(ticket, err, entry)
        entry.waiting, entry.deferred, entry.pulls = [], [], []
        entry.pushers.clear()
        entry.next_rank = 0
        entry.tags = None
        entry.early = entry.sparse_parts = entry.part_workers = entry.again = None
