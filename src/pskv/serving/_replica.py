"""A replica's tables: each shard's rows in an ID index, applied batch by batch (V1-V4)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, KeyNotInitializedError, KVStoreError, StaleReadError
from ..table._index import IdIndex
from ..table._stream import ChangeBatch
from ._wire import MAX_IDS, _Server

__all__ = ["Replica"]

log = logging.getLogger("pskv.serving")


class _Shard:
    """One shard's rows: an ID index, rows in slots, free slots (vectorized)."""

    def __init__(self, dim: int, dtype: np.dtype) -> None:
        self.index = IdIndex(0)
        self.rows = np.empty((64, dim), dtype)
        self.free: list[np.ndarray] = []
        self.top = 0
        self.size = 0

    def apply(self, b: ChangeBatch) -> None:
        if b.reset:
            self.index, self.free, self.top, self.size = IdIndex(0), [], 0, 0
        if b.removed.size:
            gone = self.index.delete(np.unique(b.removed))
            gone = gone[gone >= 0]
            if gone.size:
                self.free.append(gone)
                self.size -= gone.size
        if not b.ids.size:
            return
        slots = self.index.find(b.ids)
        new = slots < 0
        if new.any():
            n = int(np.count_nonzero(new))
            pool = np.concatenate(self.free) if self.free else np.empty(0, np.int64)
            take = pool[:n]
            self.free = [pool[n:]] if pool.size > n else []
            more = n - take.size
            if self.top + more > self.rows.shape[0]:
                grown = np.empty((max(self.top + more, self.rows.shape[0] * 3 // 2),
                                  self.rows.shape[1]), self.rows.dtype)
                grown[:self.top] = self.rows[:self.top]
                self.rows = grown
            fresh = np.arange(self.top, self.top + more, dtype=np.int64)
            self.top += more
            slots[new] = np.concatenate([take, fresh])
            self.index.insert(b.ids[new], slots[new])
            self.size += n
        self.rows[slots] = b.rows

    def get(self, ids: np.ndarray, out: np.ndarray, found: np.ndarray) -> None:
        slots = self.index.find(ids)
        hit = slots >= 0
        out[hit] = self.rows[slots[hit]]
        found |= hit

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids, slots = self.index.items()
        return ids, self.rows[slots]


class _Table:
    """A table's shards and the version each is at (complete reads only, V2)."""

    def __init__(self) -> None:
        self.shards: dict[int, _Shard] = {}
        self.versions: dict[int, int] = {}
        self.dim: int | None = None
        self.dtype: np.dtype | None = None

    def apply(self, batches: list[ChangeBatch]) -> None:
        for b in batches:
            if self.dim is None:
                self.dim, self.dtype = int(b.rows.shape[1]), b.rows.dtype
            shard = self.shards.get(b.shard)
            if shard is None:
                assert self.dtype is not None
                shard = self.shards[b.shard] = _Shard(self.dim, self.dtype)
            shard.apply(b)
            if b.complete:
                self.versions[b.shard] = b.version


class Replica:
    """A read-only copy of tables ``keys`` that follows their change streams.

    Parameters
    ----------
    source : store or pskv.stream.Reader
        Anything with ``subscribe(key, since=None, raw=False)``.
    keys : sequence of int or str
        The table keys to serve.
    interval : float
        Seconds between two polls of the streams.
    raw : bool
        Hold and answer rows in the tables' storage dtype (float16, bfloat16 bits).

    Examples
    --------
    >>> import numpy as np, pskv as mx
    >>> from pskv.table import TableSpec, Constant
    >>> from pskv.serving import Replica
    >>> kv = mx.kv.create('local')
    >>> kv.init('emb', TableSpec(dim=2, init=Constant(0.5)))
    >>> _ = kv.lookup('emb', np.array([1, 2]))
    >>> with Replica(kv, ['emb']) as rep:
    ...     rows, found, at = rep.lookup('emb', np.array([2, 9]), min_version=1)
    >>> rows.tolist(), found.tolist(), at
    ([[0.5, 0.5], [0.0, 0.0]], [True, False], {0: 1})
    """

    def __init__(self, source: Any, keys: Sequence[Any], *, interval: float = 0.05,
                 raw: bool = False) -> None:
        if isinstance(keys, (str, bytes, int)) or not keys:
            raise ConfigError(f"Replica(keys={keys!r}): give a non-empty list of table keys.")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or \
                not 0 <= interval <= 3600:
            raise ConfigError(f"Replica(interval={interval!r}): give seconds in [0, 3600].")
        self._subs = {k: source.subscribe(k, raw=raw) for k in keys}
        self._tables = {k: _Table() for k in keys}
        self._interval = float(interval)
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._error: KVStoreError | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._follow, name="pskv-replica",
                                        daemon=True)
        self._thread.start()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop following and serving (idempotent; the rows stay readable)."""
        self._stop.set()
        if self._server is not None:
            self._server.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30.0)

    def poll(self) -> None:
        """Read every stream once and apply what came (the thread does it every
        ``interval`` seconds)."""
        got = {k: sub.poll() for k, sub in self._subs.items()}   # outside the lock
        with self._lock:
            for k, batches in got.items():
                self._tables[k].apply(batches)
            self._lock.notify_all()

    def _follow(self) -> None:
        waiting = False
        while True:
            try:
                self.poll()
            except KeyNotInitializedError as err:    # the job has not made it yet
                if not waiting:
                    log.warning("replica: %s; waiting for it", err)
                waiting = True
            except KVStoreError as err:
                with self._lock:
                    self._error = err
                    self._lock.notify_all()
                log.error("replica: following the streams stopped: %s", err)
                return
            if self._stop.wait(self._interval):
                return

    def check(self) -> None:
        """Raise the error that stopped the following, if any (V4)."""
        if self._error is not None:
            raise self._error

    def _table(self, key: Any) -> _Table:
        table = self._tables.get(key)
        if table is None:
            raise KVStoreError(f"this replica serves tables {list(self._tables)}, not "
                               f"{key!r}. Start it with that key too.", key=key)
        return table

    def versions(self, key: Any) -> dict[int, int]:
        """The version each shard of table ``key`` is held at."""
        with self._lock:
            return dict(self._table(key).versions)

    def lookup(self, key: Any, ids: Any, min_version: int | Mapping[int, int] | None = None,
               timeout: float = 5.0) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """``(rows, found, versions)`` of ``ids`` (any shape) in table ``key`` (V1-V3)."""
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" or arr.size > MAX_IDS:
            raise KVStoreError(f"lookup of table {key!r} on a replica: IDs must be "
                               f"integers, at most {MAX_IDS:,}; got {arr.dtype} of "
                               f"{arr.size:,}.", key=key)
        flat = arr.astype(np.int64, copy=False).ravel()
        deadline = time.monotonic() + float(timeout)
        with self._lock:
            table = self._table(key)
            while True:
                behind = self._behind(table, min_version)
                if behind is None:
                    break
                left = deadline - time.monotonic()
                if self._error is not None or left <= 0:
                    s, want = behind
                    raise StaleReadError(
                        f"table {key!r}: shard {s} is at version "
                        f"{table.versions.get(s, -1)} on this replica, not yet {want}"
                        + (f" (following stopped: {self._error})" if self._error else
                           f", after {timeout:g} s") + ". Read at a lower version, or "
                        "wait longer.", key=key)
                self._lock.wait(min(left, 0.5))
            dim = table.dim or 0
            out = np.zeros((flat.size, dim), table.dtype or np.float32)
            found = np.zeros(flat.size, bool)
            for shard in table.shards.values():
                shard.get(flat, out, found)
            return (out.reshape(arr.shape + (dim,)), found.reshape(arr.shape),
                    dict(table.versions))

    @staticmethod
    def _behind(table: _Table, min_version: Any) -> tuple[int, int] | None:
        if min_version is None:
            return None
        if isinstance(min_version, Mapping):
            want = {int(s): int(v) for s, v in min_version.items()}
        else:
            want = {s: int(min_version) for s in (table.versions or {0: -1})}
        for s, v in want.items():
            if table.versions.get(s, -1) < v:
                return s, v
        return None

    def table(self, key: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of every row held of table ``key``, sorted by ID."""
        with self._lock:
            table = self._table(key)
            parts = [s.items() for s in table.shards.values()]
            if not parts:
                return np.empty(0, np.int64), np.empty((0, table.dim or 0), np.float32)
            ids = np.concatenate([p[0] for p in parts])
            rows = np.concatenate([p[1] for p in parts])
            order = np.argsort(ids, kind="stable")
            return ids[order], rows[order]

    def serve(self, host: str = "127.0.0.1", port: int = 0,
              secret: str | bytes | None = None) -> tuple[str, int]:
        """Answer :class:`ReplicaClient` s on ``host:port`` (V5, V6); the address bound."""
        if self._server is not None:
            raise ConfigError("this replica serves already, at "
                              f"{self._server.address}.")
        if isinstance(secret, str):
            secret = secret.encode()
        if not secret:
            log.warning("replica: no secret: any process that reaches %s:%s can read these "
                        "tables. Pass the job's PSKV_SECRET.", host, port)
        self._server = _Server(self, host, port, secret or None)
        return self._server.address


