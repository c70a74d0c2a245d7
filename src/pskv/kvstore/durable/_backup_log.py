"""A backup's log of its shard's rounds: the optimizer runs on a takeover, not per round.

With ``PSKV_REPLICAS=1`` the primary sends its backup every applied round of a dense key
(``kvstore/durable/_replica.py``). Running the optimizer on each again, as the primary did, is
the biggest part of what a backup costs; instead the backup keeps the rounds here and the
primary, every :data:`LOG_ROUNDS` rounds of a key, sends the key's whole value and
optimizer state instead of the round (kind ``"f"``), which replaces the key and lets its
logged rounds go. When the copy is needed (a takeover, any other change of the shard, or
a key with :data:`MAX_LOGGED` rounds logged) the rounds still logged are applied, in the
order they came, with the primary's own update counts, so the copy is bit for bit what the
primary held.

The rules (docs/durability.md, "Backups"), each held by a test of
``tests/unit/test_backup_log.py``:

L1. A round of kind ``"l"`` is kept, not applied; its arrays land in buffers of this
    log's pool (no copy) or are copied into one.
L2. A key's whole state (kind ``"f"``) replaces its value and optimizer state, and the
    rounds of that key logged before it are dropped.
L3. :meth:`RoundLog.flush` applies the rounds still logged in arrival order; before each,
    the optimizer's count of the key is set to the primary's count before that round
    and its ``num_update`` to the primary's after the message before it, so each update
    runs with the primary's learning rate (a scheduler's included) and step counts.
    Rounds applied at once (kind ``"d"``, for keys the log does not take) follow the
    same rule, so they interleave exactly with logged ones.
L4. The log is flushed before any other change of the shard is applied (init, optimizer,
    compression, states, restore), and before the copy is served; a key with
    :data:`MAX_LOGGED` live rounds flushes it, which bounds the memory to that many
    rounds of each key.

Invariant: only the backups' thread calls in, under ``Backups.lock``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ProtocolError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._types import Key
from ..engine._core import Engine
from ..engine._positions import marks_of

__all__ = ["LOG_ROUNDS", "MAX_LOGGED", "BufferPool", "RoundLog", "counts_of",
           "describe_state", "state_arrays"]

#: a primary sends a key's whole state instead of every LOG_ROUNDS-th round of it
LOG_ROUNDS = 4
#: rounds of one key a backup keeps at most before it applies its log
MAX_LOGGED = 2 * LOG_ROUNDS
#: pooled buffers kept per shape and dtype
POOL_DEPTH = 64


def counts_of(engine: Engine, key: Key) -> tuple[int, int] | None:
    """The optimizer's update count of ``key`` and its ``num_update``, right after an
    update (None: no optimizer that counts)."""
    upd = engine.updater
    opt = getattr(upd, "optimizer", None)
    counts = getattr(opt, "_index_update_count", None)
    if opt is None or not isinstance(counts, dict):
        return None
    n = counts.get(engine.entry_name(key))
    return None if n is None else (int(n), int(opt.num_update))


def describe_state(state: Any) -> Any:
    """The shape of an optimizer state as JSON (``None``, ``"a"`` for a dense array, a
    list for a tuple), or raise ValueError if the log cannot carry it."""
    if state is None:
        return None
    if type(state) is NDArray:
        return "a"
    if isinstance(state, tuple):
        return [describe_state(s) for s in state]
    raise ValueError(f"a state of type {type(state).__name__}")


def state_arrays(state: Any) -> list[np.ndarray]:
    """The arrays of a state :func:`describe_state` accepts, in order."""
    if state is None:
        return []
    if isinstance(state, NDArray):
        return [np.ascontiguousarray(state._data)]
    return [a for s in state for a in state_arrays(s)]


def _build_state(desc: Any, arrays: list[np.ndarray], pos: int) -> tuple[Any, int]:
    if desc is None:
        return None, pos
    if desc == "a":
        if pos >= len(arrays):
            raise ProtocolError("a whole key's state names more arrays than it carries")
        return NDArray(arrays[pos]), pos + 1
    if not isinstance(desc, list):
        raise ProtocolError(f"a whole key's state described as {desc!r}")
    parts = []
    for d in desc:
        part, pos = _build_state(d, arrays, pos)
        parts.append(part)
    return tuple(parts), pos


class BufferPool:
    """Buffers of each shape and dtype, handed out to land arrays in and given back; a
    buffer handed out is owned by whoever took it (:meth:`owns` tells ours apart). The
    backups' thread takes and gives, a server's loop gives too (a takeover): locked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._lent: dict[int, np.ndarray] = {}

    def take(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """A buffer of ``shape`` and ``dtype`` (reused if one was given back)."""
        with self._lock:
            free = self._free.get((tuple(shape), np.dtype(dtype).str))
            buf = free.pop() if free else None
        if buf is None:
            buf = np.empty(shape, dtype)
        with self._lock:
            self._lent[id(buf)] = buf
        return buf

    def owns(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` is a buffer this pool handed out (then it is the taker's now)."""
        with self._lock:
            return self._lent.pop(id(arr), None) is arr

    def give(self, arr: np.ndarray) -> None:
        """``arr`` is no longer used: keep it for reuse."""
        if not (arr.flags.c_contiguous and arr.flags.owndata):
            return
        with self._lock:
            free = self._free.setdefault((arr.shape, arr.dtype.str), [])
            if len(free) < POOL_DEPTH:
                free.append(arr)

    def keep(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` as a buffer of our own: itself if we lent it, else a copy."""
        if self.owns(arr):
            return arr
        own = self.take(arr.dtype, arr.shape)
        self.owns(own)
        np.copyto(own, arr)
        return own

    def forget(self) -> None:
        """Drop what was lent for a message that never came whole."""
        with self._lock:
            self._lent.clear()


@dataclass(slots=True)
class _Logged:
    key: Key
    rnd: int
    applied: dict[int, int]
    marks: dict[int, tuple[int, int]] | None     # data-position marks (engine._positions)
    merged: np.ndarray | None     # None: dropped (a whole state of its key came after it)
    count: int                    # the key's update count after this round, on the primary
    nu_before: int | None         # the primary's num_update after the message before it


class RoundLog:
    """The rounds of one backed-up shard kept since its keys' last whole states."""

    def __init__(self, engine: Engine, pool: BufferPool) -> None:
        self.engine, self.pool = engine, pool
        self._entries: list[_Logged] = []
        self._live: dict[Key, int] = {}
        #: the primary's num_update after the last message with counts
        self._nu: int | None = None

    def __len__(self) -> int:
        return sum(self._live.values())

    # ---- what comes in ------------------------------------------------------------------
    def round(self, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """One replicated round of a dense key (kinds ``"d"``, ``"l"``, ``"f"``)."""
        key, kind = body["key"], body.get("kind")
        rnd = int(body["round"])
        applied = {int(w): int(n) for w, n in body.get("applied", [])}
        marks = marks_of(body.get("marks"))
        count = body.get("count")
        nu = body.get("nu")
        if (count is None) != (nu is None) or \
                not all(v is None or type(v) is int for v in (count, nu)):
            raise ProtocolError("a replicated round's update counts are not integers")
        stored = self.engine.value_of(key, "replicate")
        if kind == "f":
            self._whole(key, stored, body, arrays, rnd, applied, marks, count, nu)
        elif kind == "l" and count is not None:
            if len(arrays) != 1 or arrays[0].size != stored.size:
                raise ProtocolError("a logged round needs its merged value, of its key's size")
            self._entries.append(_Logged(key, rnd, applied, marks, self.pool.keep(arrays[0]),
                                         count, self._nu))
            self._live[key] = self._live.get(key, 0) + 1
            self._nu = nu
            if self._live[key] >= MAX_LOGGED:
                self.flush()
        else:       # applied at once, in turn with the logged ones (L3)
            if len(arrays) != 1:
                raise ProtocolError("a replicated round needs its merged value's arrays")
            self._counts(key, count, self._nu)
            self.engine.replay(key, NDArray(arrays[0]), rnd, applied, marks)
            if nu is not None:
                self._nu = nu

    def _whole(self, key: Key, stored: NDArray, body: dict[str, Any],
               arrays: list[np.ndarray], rnd: int, applied: dict[int, int],
               marks: dict[int, tuple[int, int]] | None, count: int | None,
               nu: int | None) -> None:
        """L2: the key's value and state replaced; its logged rounds dropped."""
        if count is None or nu is None or not arrays or \
                arrays[0].size != stored.size or arrays[0].dtype != stored.dtype:
            raise ProtocolError("a whole key's state needs its counts and its value, of "
                                "its key's size and dtype")
        upd: Any = self.engine.updater
        if upd is None or not hasattr(upd, "states"):
            raise ProtocolError("a whole key's state reached a backup copy without an "
                                "optimizer")
        state, used = _build_state(body.get("state"), arrays, 1)
        if used != len(arrays):
            raise ProtocolError("a whole key's state carries arrays its description lacks")
        kept = [self.pool.keep(a) for a in arrays]
        state, _ = _build_state(body.get("state"), kept, 1)
        old = stored._data
        stored._data = kept[0] if kept[0].shape == old.shape else kept[0].reshape(old.shape)
        self.pool.give(old)
        name = self.engine.entry_name(key)
        for a in state_arrays(upd.states.get(name)) if _plain(upd.states.get(name)) else []:
            self.pool.give(a)
        upd.states[name] = state
        upd.states_synced[name] = True
        for e in self._entries:
            if e.key == key and e.merged is not None:
                self.pool.give(e.merged)
                e.merged = None
        self._live.pop(key, None)
        self._set_count(key, count)
        self.engine.set_counters(key, rnd, applied, marks)
        self._nu = nu
        if not self._live:          # nothing logged: the optimizer's count is current
            self._entries.clear()
            self._set_nu(nu)

    def synced(self) -> None:
        """A round was applied to the copy outside the log (after :meth:`flush`): the
        copy's ``num_update`` is the primary's now."""
        opt = getattr(self.engine.updater, "optimizer", None)
        if opt is not None and hasattr(opt, "num_update"):
            self._nu = int(opt.num_update)

    # ---- applying -----------------------------------------------------------------------
    def flush(self) -> None:
        """L3: apply every round still logged, in the order they came."""
        entries, self._entries = self._entries, []
        self._live.clear()
        for e in entries:
            if e.merged is None:
                continue
            self._counts(e.key, e.count, e.nu_before)
            self.engine.replay(e.key, NDArray(e.merged), e.rnd, e.applied, e.marks)
            self.pool.give(e.merged)
        if self._nu is not None:
            self._set_nu(self._nu)

    def _counts(self, key: Key, count: int | None, nu_before: int | None) -> None:
        """Before applying a round: the primary's counts before it (L3)."""
        if count is None:
            return
        self._set_count(key, count - 1)
        if nu_before is not None:
            self._set_nu(nu_before)

    def _set_count(self, key: Key, count: int) -> None:
        opt = getattr(self.engine.updater, "optimizer", None)
        if opt is not None and isinstance(getattr(opt, "_index_update_count", None), dict):
            opt._set_current_context(self.engine.value_of(key, "replicate").context.device_id)
            opt._index_update_count[self.engine.entry_name(key)] = count

    def _set_nu(self, nu: int) -> None:
        opt = getattr(self.engine.updater, "optimizer", None)
        if opt is not None and hasattr(opt, "num_update"):
            opt.num_update = nu


def _plain(state: Any) -> bool:
    try:
        describe_state(state)
    except ValueError:
        return False
    return not isinstance(state, RowSparseNDArray)
