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
a ticket is answered exactly once (``on_done`` or ``on_fail``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import numpy as np

from .. import compression, optimizer
from ..errors import (CheckpointError, ClusterError, ClusterTimeoutError,
                      KeyAlreadyInitializedError, KeyNotInitializedError, KVStoreError,
                      ShapeMismatchError, UnsupportedError)
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._types import Key, Updater
from ._agree import check_optimizer_spec
from ._reduce import sum_rows
from ._snapshot import Reader, ShardCopy

__all__ = ["Engine", "EntryCopy", "PushKind", "RoundObserver", "Ticket"]

#: how a pushed value travels: dense, compressed (packed words), row_sparse (rows, data)
PushKind = Literal["d", "c", "r"]


#: one key's copy: its metadata (name, id, shape, placement, round, counts), value, state
EntryCopy = tuple[dict[str, Any], np.ndarray, Any]


class RoundObserver(Protocol):
    """What an engine tells of each applied round (sync) or applied push (async) of a key,
    before anyone waiting for it is answered: a server's shard hangs its backup link and
    its periodic checkpoints here (``kvstore/_shards.py``)."""

    @property
    def wants_merged(self) -> bool:
        """Whether :meth:`round_applied` needs the round's merged value (else None)."""

    def round_applied(self, key: Key, merged: NDArray | None, rnd: int,
                      applied: dict[int, int]) -> None:
        """Round ``rnd`` of ``key`` is applied; ``applied``: worker -> pushes applied."""


class Ticket:
    """One request waiting for the rounds of some of its keys to close.

    ``peer``, ``ts`` and ``cmd`` belong to whoever made it (the engine never reads them);
    ``rows`` are per-key row ids for a row_sparse pull.
    """

    __slots__ = ("peer", "ts", "cmd", "keys", "remaining", "rows")

    def __init__(self, peer: Any, ts: int, cmd: Any, keys: tuple[Key, ...],
                 rows: list[np.ndarray] | None = None) -> None:
        self.peer, self.ts, self.cmd, self.keys = peer, ts, cmd, keys
        self.remaining = 0
        self.rows = rows


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
    deferred: list[tuple[int, list[np.ndarray], str, Ticket | None]] = \
        field(default_factory=list)
    sparse_parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    last: NDArray | None = None        # the round's merged value, kept for ``replicate``


def _ignore(ticket: Ticket) -> None:
    """The default ``on_done``."""


def _ignore_fail(ticket: Ticket, err: KVStoreError) -> None:
    """The default ``on_fail``."""


class Engine:
    """Stored values and the rules that change them.

    Parameters
    ----------
    num_workers : int
        Distinct workers that close a sync round.
    sync : bool
        Sync rounds (``dist_sync``) or apply every push at once (``dist_async``).
    on_done : callable, optional
        ``on_done(ticket)``: every round ``ticket`` waited for has closed.
    on_fail : callable, optional
        ``on_fail(ticket, error)``: a round ``ticket`` waited for failed with ``error``.
    clock : callable, optional
        Seconds, for round timeouts (``time.monotonic``).
    """

    def __init__(self, num_workers: int = 1, sync: bool = True,
                 on_done: Callable[[Ticket], None] = _ignore,
                 on_fail: Callable[[Ticket, KVStoreError], None] = _ignore_fail,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.sync = sync
        self.on_done = on_done
        self.on_fail = on_fail
        self._clock = clock
        #: key -> stored value (the local store's fast paths read it directly)
        self.stored: dict[Key, NDArray] = {}
        self._entries: dict[Key, _Entry] = {}
        self.updater: Updater | None = None
        self._opt_spec: Any = None
        self.compressor: Any = None
        self._gc_params: Any = None
        #: told of each applied round or async push, before any request waiting for it
        #: is answered (a server's shard: its backup and its periodic checkpoints)
        self.observer: RoundObserver | None = None

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

    def set_optimizer_spec(self, spec: Any) -> None:
        """Install the optimizer ``spec`` (JSON); identical repeats are no-ops."""
        if spec != self._opt_spec:
            opt = optimizer.from_spec(spec)
            check_optimizer_spec(opt, spec)     # a spec that cannot update is refused now
            self.updater = optimizer.get_updater(opt)
            self._opt_spec = spec

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
        if kind == "c":
            if self.compressor is None:
                raise UnsupportedError("a compressed push reached a server without gradient "
                                       "compression: call set_gradient_compression on every "
                                       "worker before init.", key=name)
            if arrays[0].size != self.compressor.packed_size(stored.size):
                raise ShapeMismatchError(f"push to key {name!r}: {arrays[0].size} packed "
                                         f"words for {stored.size} values", key=name)
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
             ticket: Ticket | None = None) -> None:
        """One worker's (checked) value for ``key``: add it to the round, or apply it.

        ``arrays`` may be reused by the caller after this returns (what is kept is copied).
        """
        entry = self._entries[key]
        if not self.sync:
            self.accumulate(key, arrays, kind, first=True)
            self.finish(key)
            entry.round += 1              # in dist_async a round is one applied push
            entry.applied[worker] = entry.applied.get(worker, 0) + 1
            self._applied(key, entry)
            return
        if worker in entry.pushers:       # its next round: wait (distinct workers per round)
            entry.deferred.append((worker, [np.array(a) for a in arrays], kind, ticket))
            if ticket is not None:
                ticket.remaining += 1
            return
        if not entry.pushers:
            entry.started = self._clock()
        self.accumulate(key, arrays, kind, first=not entry.pushers)
        entry.pushers.add(worker)
        if ticket is not None:
            ticket.remaining += 1
            entry.waiting.append(ticket)
        if len(entry.pushers) == self.num_workers:
            self._close_round(key, entry)

    # ---- the two steps of a round (override both for a server that does no arithmetic,
    # ---- as the benchmarks' EmptyHandler does) -----------------------------------------
    def accumulate(self, key: Key, arrays: list[np.ndarray], kind: str, first: bool) -> None:
        """Add one worker's value to ``key``'s round (``first``: the round's first)."""
        entry = self._entries[key]
        if kind == "r":
            entry.sparse_parts.append((arrays[0].astype(np.int64), np.array(arrays[1])))
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
        merged = self._merged(entry)
        self.apply(key, merged)
        if self.observer is not None and self.observer.wants_merged:
            entry.last = merged

    def _applied(self, key: Key, entry: _Entry) -> None:
        """Tell the observer that a round of ``key`` was applied."""
        if self.observer is not None:
            merged, entry.last = entry.last, None
            self.observer.round_applied(key, merged, entry.round, entry.applied)

    def set_counters(self, key: Key, rnd: int, applied: dict[int, int]) -> None:
        """Set ``key``'s round and per-worker push counts (a backup's copy of a shard)."""
        entry = self._entries[key]
        entry.round, entry.applied = rnd, dict(applied)

    def replay(self, key: Key, merged: NDArray, rnd: int, applied: dict[int, int]) -> None:
        """A backup's copy of a primary's applied round: the same update, the same counts."""
        entry = self._entries[key]
        self.apply(key, merged)
        entry.round, entry.applied = rnd, dict(applied)

    def _merged(self, entry: _Entry) -> NDArray:
        if entry.sparse:
            rows, data = sum_rows(entry.sparse_parts, entry.stored.shape, entry.stored.dtype,
                                  unique_rows=False)
            entry.sparse_parts.clear()
            return RowSparseNDArray(data, rows, entry.stored.shape)
        assert entry.merge is not None
        return entry.stored._new(entry.merge)      # the stored value's context

    def _close_round(self, key: Key, entry: _Entry) -> None:
        try:
            self.finish(key)
        except Exception as err:  # the update failed: its pushers hear why; the key goes on
            entry.round += 1
            self._fail_entry(entry, err if isinstance(err, KVStoreError) else ClusterError(
                f"the update of key {entry.name!r} failed: {type(err).__name__}: {err}",
                key=entry.name))
            return
        entry.round += 1
        for worker in entry.pushers:
            entry.applied[worker] = entry.applied.get(worker, 0) + 1
        self._applied(key, entry)         # the backup has it before anyone is answered
        entry.pushers.clear()
        # taken before anything is released or pushed again (no new list when empty)
        waiting, entry.waiting = entry.waiting, []
        deferred: list[tuple[int, list[np.ndarray], str, Ticket | None]] = []
        if entry.deferred:
            deferred, entry.deferred = entry.deferred, []
        pulls: list[tuple[int, Ticket]] = []
        if entry.pulls:
            pulls, entry.pulls = entry.pulls, []
        for ticket in waiting:
            self.release(ticket)
        for worker, arrays, kind, dticket in deferred:  # they open the next round
            if dticket is not None:
                dticket.remaining -= 1
            self.push(key, worker, arrays, kind, dticket)
        for worker, ticket in pulls:
            if self._pushed(entry, worker):
                entry.pulls.append((worker, ticket))    # its later push is not applied yet
            else:
                self.release(ticket)

    # ---- snapshots (kvstore._snapshot writes and reads them) ---------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def copy_entry(self, key: Key) -> EntryCopy:
        """A copy of one key: its metadata, its value, its optimizer state."""
        entry = self._entries[key]
        data = entry.stored._data
        start, stop, full = entry.place or (0, _units(data.shape, entry.sparse), data.shape)
        meta = {"key": entry.name, "id": key, "shape": list(full), "dtype": data.dtype.name,
                "stype": "row_sparse" if entry.sparse else "default", "start": start,
                "stop": stop, "round": entry.round,
                "applied": [[w, n] for w, n in sorted(entry.applied.items())]}
        states = getattr(self.updater, "states", None)
        state = _copy_state(states.get(entry.name)) if isinstance(states, dict) else None
        return meta, np.array(data, copy=True), state

    def shard_copy(self, copies: list[EntryCopy]) -> ShardCopy:
        """A shard made of key copies (:meth:`copy_entry`), with the optimizer and the
        compression settings."""
        upd = self.updater
        spec = None
        if upd is not None and hasattr(upd, "optimizer"):
            try:
                spec = upd.optimizer.to_spec()
            except KVStoreError:    # an unregistered optimizer: states only
                spec = None
        states = None if upd is None or not hasattr(upd, "get_states") else \
            {m["key"]: st for m, _a, st in copies if st is not None}
        return ShardCopy([m for m, _a, _s in copies], [a for _m, a, _s in copies], states,
                         spec, self._gc_params)

    def snapshot(self) -> ShardCopy:
        """A copy of the whole shard (values, optimizer states, rounds, placement): the
        only pause a checkpoint causes; write it with ``_snapshot.write_shard``."""
        return self.shard_copy([self.copy_entry(k) for k in self._entries])

    @property
    def untouched(self) -> bool:
        """Whether no round of any key has closed yet (the values are the inits)."""
        return all(e.round == 0 for e in self._entries.values())

    def applied_by(self, worker: int) -> list[list[Any]]:
        """``[key, pushes of worker applied]`` for every key: what a worker that sends its
        pushes again (to a restarted server) may skip."""
        return [[k, e.applied.get(worker, 0)] for k, e in self._entries.items()]

    def restore(self, reader: Reader, counters: bool = False) -> None:
        """Set every key this engine holds from a checkpoint (its part of each key, on
        whatever placement saved it), with optimizer states; all or nothing.

        ``counters``: also the rounds and per-worker push counts (a restarted server of the
        same job); else they keep counting this job's pushes (``kv.load_checkpoint``).
        """
        plan = []
        for e in self._entries.values():
            meta = reader.key_meta(e.name)
            data = e.stored._data
            start, stop, full = e.place or (0, _units(data.shape, e.sparse), data.shape)
            if tuple(meta["shape"]) != tuple(full) or meta["dtype"] != data.dtype.name \
                    or (meta["stype"] == "row_sparse") != e.sparse:
                raise CheckpointError(
                    f"key {e.name!r} is {list(full)} {data.dtype.name} here but "
                    f"{meta['shape']} {meta['dtype']} ({meta['stype']}) in checkpoint "
                    f"{reader.directory!r}. Load a checkpoint of the same model.", key=e.name)
            plan.append((e, start, stop))
        spec = reader.optimizer()
        values = [reader.value(e.name, start, stop, e.stored.shape) for e, start, stop in plan]
        states = {e.name: reader.state(e.name, start, stop, e.stored.shape)
                  for e, start, stop in plan}
        if spec is not None:
            self.updater = optimizer.get_updater(optimizer.from_spec(spec))
            self._opt_spec = spec
        upd = self.updater
        for (e, _start, _stop), value in zip(plan, values, strict=True):
            np.copyto(e.stored._data, value)
            if counters:
                e.round = reader.round(e.name)
                e.applied = reader.applied(e.name)
            st = states[e.name]
            if st is not None and isinstance(getattr(upd, "states", None), dict):
                upd.states[e.name] = st         # type: ignore[union-attr]
                upd.states_synced[e.name] = False  # type: ignore[union-attr]

    # ---- tickets ---------------------------------------------------------------------
    def hold(self, ticket: Ticket) -> None:
        """Keep ``ticket`` open while its keys are queued (pair with :meth:`release`)."""
        ticket.remaining += 1

    def release(self, ticket: Ticket) -> None:
        """One wait of ``ticket`` is over; answer it when none is left."""
        ticket.remaining -= 1
        if ticket.remaining == 0:
            self.on_done(ticket)

    def pull(self, key: Key, worker: int, ticket: Ticket) -> None:
        """``ticket`` reads ``key``: after this worker's pending push of it, if any."""
        entry = self._entries[key]
        if self.sync and self._pushed(entry, worker):
            ticket.remaining += 1
            entry.pulls.append((worker, ticket))

    def values(self, ticket: Ticket) -> list[np.ndarray]:
        """The stored values (or the rows asked for) a closed ``ticket`` returns."""
        out = []
        for i, k in enumerate(ticket.keys):
            stored = self._entries[k].stored
            out.append(stored._data if ticket.rows is None else stored._data[ticket.rows[i]])
        return out

    @staticmethod
    def _pushed(entry: _Entry, worker: int) -> bool:
        return worker in entry.pushers or any(d[0] == worker for d in entry.deferred)

    # ---- failures --------------------------------------------------------------------
    def check_rounds(self, timeout: float) -> None:
        """Fail every round that has waited longer than ``timeout`` for its last worker."""
        now = self._clock()
        for entry in self._entries.values():
            if entry.pushers and now - entry.started > timeout:
                missing = sorted(set(range(self.num_workers)) - entry.pushers)
                msg = (f"sync round {entry.round} of key {entry.name!r} waited "
                       f"{now - entry.started:.1f} s: workers {missing} have not pushed it "
                       f"(workers {sorted(entry.pushers)} did). Make every worker push every "
                       "key each step, or raise PSKV_ROUND_TIMEOUT.")
                self._fail_entry(entry, ClusterTimeoutError(msg, key=entry.name))

    def fail_all(self, err: KVStoreError) -> None:
        """Fail every open round with ``err`` (a node died)."""
        for entry in self._entries.values():
            self._fail_entry(entry, err)

    def _fail_entry(self, entry: _Entry, err: KVStoreError) -> None:
        tickets = entry.waiting + [t for _, t in entry.pulls] + \
            [d[3] for d in entry.deferred if d[3] is not None]
        for ticket in {id(t): t for t in tickets}.values():
            self.on_fail(ticket, err)
            for other in ticket.keys:   # answered: stop counting it anywhere else
                o = self._entries.get(other)
                if o is not None and o is not entry:
                    o.waiting = [t for t in o.waiting if t is not ticket]
                    o.pulls = [p for p in o.pulls if p[1] is not ticket]
            ticket.remaining = -1               # never answered again
        entry.waiting, entry.deferred, entry.pulls = [], [], []
        entry.pushers.clear()
        entry.sparse_parts.clear()


def _units(shape: tuple[int, ...], sparse: bool) -> int:
    """Elements of a dense key, rows of a row_sparse one."""
    return (shape[0] if shape else 0) if sparse else int(np.prod(shape, dtype=np.int64))


def _copy_state(state: Any) -> Any:
    """A deep copy of an optimizer state (NDArrays, tuples or lists of them, scalars)."""
    if isinstance(state, RowSparseNDArray):
        return RowSparseNDArray(np.array(state._data), np.array(state._indices), state.shape)
    if isinstance(state, NDArray):
        return NDArray(np.array(state._data, copy=True), state.context)
    if isinstance(state, (tuple, list)):
        items = [_copy_state(s) for s in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state
