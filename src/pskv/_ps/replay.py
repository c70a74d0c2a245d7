"""A worker's recent pushes, kept to send again to a server that was restarted.

A server counts, per key and worker, the pushes it has applied (and a checkpoint keeps the
counts); a worker numbers its pushes of each key to each server the same way. After a
restart the server says how many it holds and the worker sends the later ones again, in
order (docs/durability.md: why re-send rather than roll back). Invariant: for each server
and ps_key, the log holds the last ``keep`` pushes made, numbered 1, 2, ... in the order
they were made: sent, or dropped by a restarted worker catching up (the server said it
held them, and may die before applying them).
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Sequence

import numpy as np

from ..errors import NodeFailedError, ProtocolError
from .message import kind_arrays

__all__ = ["Loan", "PushLog", "backup_of"]


def rest_step(body: Any) -> int | None:
    """A push message's data-position step (``seals.py``), or None."""
    step = body.get("step") if isinstance(body, dict) else None
    return step if type(step) is int else None


def backup_of(shard: int, host: int, num_servers: int) -> int:
    """The server that keeps the backup of ``shard`` while server ``host`` serves it: the
    next server while its own serves it, its own (restarted) once the next took it over.

    Examples
    --------
    >>> backup_of(1, 1, 3), backup_of(1, 2, 3), backup_of(2, 2, 3)
    (2, 1, 0)
    """
    return (shard + 1) % num_servers if host == shard else shard


#: buffers of each shape and dtype kept for reuse once their push is forgotten (a model
#: repeats shapes: ResNet-50 pushes dozens of keys of the same shape each step); the pool
#: never holds more than the log held at its fullest
POOL_DEPTH = 64


#: how the log holds a push's arrays: its own copies; the caller's arrays during a call
#: that waits for the reply (``pushpull``, until :meth:`PushLog.settle`); a lent buffer
#: (until the lender repays, :class:`Loan`); let go
OWN, CALLER, LENT, GONE = range(4)


class _Kept:
    """One push the log keeps."""

    __slots__ = ("j", "kind", "arrays", "how", "step")

    def __init__(self, j: int, kind: str, arrays: list[np.ndarray], how: int,
                 step: int | None = None) -> None:
        self.j, self.kind, self.arrays, self.how = j, kind, arrays, how
        self.step = step            # its data position's step (seals.py), or None


class Loan:
    """The pushes a log keeps of one lent buffer (``kvstore.dist._datapath.SendBuffer``).

    :meth:`repay` (the lender is about to write or hand out its buffer) gives the log its
    own copies of whatever of them it still keeps; ``lock``: the one that guards the log.
    """

    __slots__ = ("_log", "_lock", "kept")

    def __init__(self, log: PushLog, lock: Any) -> None:
        self._log, self._lock = log, lock
        self.kept: list[_Kept] = []

    def repay(self) -> None:
        with self._lock:
            for entry in self.kept:
                if entry.how == LENT:
                    entry.arrays = [self._log._copy(a) for a in entry.arrays]
                    entry.how = OWN
            self.kept = []


class PushLog:
    """The last ``keep`` pushes of each key to each server (copies, or borrowed arrays).

    The copies go into buffers that forgotten pushes gave back (a pool per shape and
    dtype): a fresh buffer would cost the kernel zero-filling every page before the copy,
    as much again as the copy itself for big keys.

    A push made inside a call that waits for its reply (``pushpull``) is *borrowed*: the
    log keeps the caller's own arrays, which cannot change before the call returns, and
    the call :meth:`settle` s before it returns: whatever borrowed push is still kept
    then (its reply did not let it go) is copied. Invariant: outside such a call, the log
    holds no borrowed array.

    A push of a buffer its caller *lends* (``lenders``, objects with ``_lend(loan)``: the
    dist store's own send buffers, never a user's array) is kept without a copy until
    the lender repays its :class:`Loan` (before its next write) or the push is let go;
    no copy at all when the servers backed the push up before the caller wrote the array.
    """

    def __init__(self, keep: int, lock: Any = None) -> None:
        self.keep = keep
        #: what guards the log (a Loan repays under it; None: the caller's only thread)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._pool: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._count: dict[tuple[int, int], int] = {}
        #: (server, ps_key) -> the pushes kept, oldest first
        self._log: dict[tuple[int, int], deque[_Kept]] = {}
        #: (server, ps_key) of the logs that may hold borrowed pushes (until :meth:`settle`)
        self._borrowed: set[tuple[int, int]] = set()
        self._skip: dict[tuple[int, int], int] = {}
        #: whether pushes are still being dropped (a restarted worker catching up)
        self.skipping = False

    def applied_before(self, server: int, applied: dict[int, int]) -> None:
        """A restarted worker: ``server`` applied this many pushes of each ps_key from this
        worker's rank already; the first that many pushes made again are dropped."""
        for pk, n in applied.items():
            if n > 0:
                self._skip[(server, pk)] = n
        self.skipping = bool(self._skip)

    def resume(self, server: int, counts: dict[int, tuple[int, int]]) -> None:
        """A restarted worker resuming at a data position (``seals.py`` W3): per ps_key,
        ``(start, held)``: its pushes of the key to ``server`` are counted from ``start``
        on, and those made again up to ``held`` are dropped."""
        for pk, (start, held) in counts.items():
            self._count[(server, pk)] = start
            if held > start:
                self._skip[(server, pk)] = held
            else:
                self._skip.pop((server, pk), None)
        self.skipping = bool(self._skip)

    def rebase(self, server: int, applied: dict[int, int]) -> None:
        """``server``'s shard is now served by a host that holds ``applied[pk]`` of this
        worker's pushes: a catch-up target above that came from a server that died
        holding more (pushes of a round still open, never applied nor backed up), so it is
        lowered. What this worker made again and dropped beyond ``applied`` is in the log,
        and :meth:`since` sends it; later pushes are sent, not dropped."""
        for (srv, pk), target in list(self._skip.items()):
            have = applied.get(pk, 0)
            if srv != server or target <= have:
                continue
            if self._count.get((srv, pk), 0) >= have:
                del self._skip[(srv, pk)]
            else:
                self._skip[(srv, pk)] = have
        self.skipping = bool(self._skip)

    def catching_up(self, server: int, pks: Sequence[int]) -> list[int]:
        """The ps_keys of ``pks`` of which ``server`` holds pushes this restarted worker
        has not made again yet (they will be dropped when it does)."""
        return [pk for pk in pks if (server, pk) in self._skip]

    def drop_applied(self, server: int, keys: Sequence[int], body: Any,
                     arrays: Sequence[np.ndarray]) \
            -> tuple[list[int], Any, list[np.ndarray]]:
        """A push message without the keys whose push is already applied (counted)."""
        kinds = body.get("kinds", "") if isinstance(body, dict) else ""
        out_keys: list[int] = []
        out_kinds: list[str] = []
        out_arrays: list[np.ndarray] = []
        pos = 0
        for pk, kind in zip(keys, kinds, strict=True):
            n = kind_arrays(kind)
            have = self._skip.get((server, pk), 0)
            done = self._count.get((server, pk), 0)
            if done < have:
                # made again: not sent, but kept like a sent push: the server that said
                # it holds it may die before applying it (a push of an open round), and
                # the backup that takes its shard over then lacks it (:meth:`rebase`)
                self.record(server, [pk], kind, arrays[pos:pos + n],
                            step=rest_step(body))
                if done + 1 == have:
                    del self._skip[(server, pk)]
                    self.skipping = bool(self._skip)
            else:
                out_keys.append(pk)
                out_kinds.append(kind)
                out_arrays.extend(arrays[pos:pos + n])
            pos += n
        rest = body if isinstance(body, dict) else {}
        return out_keys, {**rest, "kinds": "".join(out_kinds)}, out_arrays

    def record(self, server: int, keys: Sequence[int], kinds: str,
               arrays: Sequence[np.ndarray], borrow: bool = False,
               lenders: Sequence[Any] | None = None, step: int | None = None) -> None:
        """One push message (``kinds``: one letter per key; ``r`` carries two arrays).

        ``borrow``: keep ``arrays`` themselves, not copies; the caller must not change
        them until it has called :meth:`settle` (a call that waits for the reply).
        ``lenders``: one per array, the object that lends it (None: copied): a key whose
        arrays all have lenders is kept as they are, and each lender gets a :class:`Loan`.
        """
        pos = 0
        loans: dict[int, tuple[Any, Loan]] = {}
        for pk, kind in zip(keys, kinds, strict=True):
            n = kind_arrays(kind)
            if pos + n > len(arrays):
                raise ProtocolError("push arrays do not match their kinds")
            j = self._count.get((server, pk), 0) + 1
            self._count[(server, pk)] = j
            if self.keep:
                log = self._log.get((server, pk))
                if log is None:
                    log = self._log[(server, pk)] = deque()
                if len(log) == self.keep:
                    self._give_back(log.popleft())
                part = list(arrays[pos:pos + n])
                by = lenders[pos:pos + n] if lenders is not None else ()
                if borrow:
                    self._borrowed.add((server, pk))
                    log.append(_Kept(j, kind, part, CALLER, step))
                elif by and all(x is not None for x in by):
                    entry = _Kept(j, kind, part, LENT, step)
                    for x in by:
                        if id(x) not in loans:
                            loans[id(x)] = (x, Loan(self, self.lock))
                        loans[id(x)][1].kept.append(entry)
                    log.append(entry)
                else:
                    log.append(_Kept(j, kind, [self._copy(a) for a in part], OWN, step))
            pos += n
        for lender, loan in loans.values():
            lender._lend(loan)

    def settle(self) -> None:
        """Copy every borrowed push still kept (its caller is about to return)."""
        for where in self._borrowed:
            for entry in self._log.get(where, ()):
                if entry.how == CALLER:
                    entry.arrays = [self._copy(a) for a in entry.arrays]
                    entry.how = OWN
        self._borrowed.clear()

    def _copy(self, a: np.ndarray) -> np.ndarray:
        free = self._pool.get((a.shape, a.dtype.str))
        buf = free.pop() if free else np.empty(a.shape, a.dtype)
        np.copyto(buf, a)
        return buf

    def _give_back(self, entry: _Kept) -> None:
        """A push let go: its copies go back to the pool (borrowed or lent arrays are the
        caller's)."""
        if entry.how == OWN:
            for a in entry.arrays:
                free = self._pool.setdefault((a.shape, a.dtype.str), [])
                if len(free) < POOL_DEPTH:
                    free.append(a)
        entry.how, entry.arrays = GONE, []

    def counts(self, server: int, keys: Sequence[int] | None) -> dict[int, int]:
        """Pushes sent so far to ``server`` of each of ``keys`` (None: every key)."""
        if keys is None:
            return {pk: n for (srv, pk), n in self._count.items() if srv == server}
        return {pk: self._count[(server, pk)] for pk in keys if (server, pk) in self._count}

    def forget(self, server: int, counts: dict[int, int]) -> None:
        """The first ``counts[pk]`` pushes of each ps_key to ``server`` are safe (applied
        and backed up): stop keeping them."""
        for pk, n in counts.items():
            log = self._log.get((server, pk))
            while log and log[0].j <= n:
                self._give_back(log.popleft())

    def since(self, server: int, applied: dict[int, int]) \
            -> list[tuple[int, str, list[np.ndarray], int | None]]:
        """The pushes to ``server`` it has not applied (``applied``: ps_key -> count), as
        (ps_key, kind, arrays, step), oldest first; NodeFailedError if some are no longer
        kept."""
        out: list[tuple[int, int, str, list[np.ndarray], int | None]] = []
        for (srv, pk), sent in self._count.items():
            have = applied.get(pk, 0)
            if srv != server or sent <= have:
                continue
            log = self._log.get((srv, pk), deque())
            first = log[0].j if log else sent + 1     # the oldest push still kept
            if first > have + 1:
                raise NodeFailedError(
                    f"server {server}'s shard was rebuilt holding {have} of this worker's "
                    f"{sent} pushes of ps_key {pk}, and this worker no longer keeps push "
                    f"{have + 1} (it keeps the last {self.keep}, and with PSKV_REPLICAS=1 "
                    "none acknowledged). Lower PSKV_CHECKPOINT_EVERY, or pull each key "
                    "after pushing it.")
            out.extend((e.j, pk, e.kind, e.arrays, e.step) for e in log if e.j > have)
        out.sort(key=lambda item: item[0])
        return [(pk, kind, arrays, step) for _j, pk, kind, arrays, step in out]
