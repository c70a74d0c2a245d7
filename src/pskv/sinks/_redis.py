""":class:`RedisSink` and :func:`load_redis`: a table's rows under Redis keys any Redis
client reads (rules K1-K6 in :mod:`pskv.sinks`)."""
from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import ClusterError, ConfigError, ShapeMismatchError
from ..table import ChangeBatch, RowMirror
from ._resp import Arg, ErrorReply, RedisURL, Reply, RespClient
from ._segments import FORMAT, row_dtype_name

__all__ = ["RedisSink", "load_redis"]

log = logging.getLogger(__name__)

#: keys per DEL / SREM / SADD and rows per MSET in one command
_PER_COMMAND = 1000


def _base(key: Any, prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(f"a Redis prefix is a non-empty str, got {prefix!r}.", key=key)
    if not isinstance(key, (int, str)) or isinstance(key, bool):
        raise ConfigError(f"a table key is an int or a str, got {key!r}.", key=key)
    return f"{prefix}:{key}"


def _text(v: Reply) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _meta(client: RespClient, base: str) -> dict[str, str]:
    got = client.call("HGETALL", f"{base}:meta")
    if not isinstance(got, list) or len(got) % 2:
        raise ClusterError(f"{client.url} answered HGETALL {base}:meta with {got!r}.")
    return {_text(got[i]): _text(got[i + 1]) for i in range(0, len(got), 2)}


def _check_meta(meta: dict[str, str], where: str) -> tuple[int, np.dtype, bool, int]:
    """``(dim, row_dtype, raw, num_shards)`` of a meta hash; ConfigError if it is not
    one a sink wrote."""
    try:
        if meta["format"] != FORMAT:
            raise ValueError(f"format {meta['format']!r}")
        return (int(meta["dim"]), np.dtype(meta["row_dtype"]), meta["raw"] == "1",
                int(meta["num_shards"]))
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"{where} is not the meta hash of a pskv sink ({err!r}). Use "
                          "another prefix, or delete the key.") from err


def _cut(items: Sequence[Any], n: int = _PER_COMMAND) -> Iterable[Sequence[Any]]:
    return (items[i:i + n] for i in range(0, len(items), n))


class RedisSink:
    """Writes table ``key``'s change batches to Redis at ``url``: one string key per row,
    a set of IDs per shard and a meta hash (:mod:`pskv.sinks`, K1-K6).

    Parameters
    ----------
    url : str
        ``redis://[[user]:password@]host[:port][/db]``; AUTH is sent when it has a
        password, SELECT when it names a database.
    key : int or str
        The table key (``T`` in the key names).
    prefix : str
        The first part of every key name (``P``).
    raw : bool
        Whether the batches carry rows in the storage dtype (``subscribe(..., raw=True)``).
    timeout : float
        Seconds any connect, send or reply may take.

    Raises
    ------
    ConfigError
        A bad URL, or a meta hash of another layout or ``raw``.
    ClusterError
        Redis cannot be reached, refuses the password, or answers an error.
    """

    def __init__(self, url: str, key: Any, prefix: str = "pskv", *, raw: bool = False,
                 timeout: float = 10.0) -> None:
        if not isinstance(raw, bool):
            raise ConfigError(f"RedisSink(raw={raw!r}): raw is True or False.", key=key)
        self.key, self.prefix, self.raw = key, prefix, raw
        self._base = _base(key, prefix)
        self._client = RespClient(url, timeout)
        self.url: RedisURL = self._client.url
        try:
            meta = _meta(self._client, self._base)
            self._layout: tuple[int, np.dtype, int] | None = None
            self._pos: dict[str, list[Any]] | None = None
            if meta:
                dim, dtype, was_raw, n = _check_meta(meta, f"{self.url} {self._base}:meta")
                if was_raw != raw:
                    raise ConfigError(f"{self.url} holds {'raw' if was_raw else 'float32'} "
                                      f"rows of table {key!r} under {prefix!r}; this sink was "
                                      f"given raw={raw}. Use another prefix, or the same raw.",
                                      key=key)
                self._layout = (dim, dtype, n)
                self._pos = json.loads(meta.get("position", "{}")) or None
        except BaseException:
            self._client.close()
            raise
        self._pending: dict[int, list[ChangeBatch]] = {}

    def position(self) -> dict[str, list[Any]] | None:
        """Where Redis is: ``{"shard": [lineage, version]}`` (resume with ``since=``), or
        None before the first write."""
        return None if self._pos is None else {s: list(p) for s, p in self._pos.items()}

    def write(self, batches: Iterable[ChangeBatch]) -> int:
        """Apply ``batches`` (a poll): one transaction per shard read (K4); pages of a read
        not yet complete wait for the rest; a shard with nothing new is left alone. Returns
        the transactions run."""
        done = 0
        for b in batches:
            self._check(b)
            self._pending.setdefault(b.shard, []).append(b)
            if b.complete:
                done += self._transact(self._pending.pop(b.shard))
        return done

    def _check(self, b: ChangeBatch) -> None:
        if b.key != self.key:
            raise ConfigError(f"a RedisSink of table {self.key!r} was given a batch of table "
                              f"{b.key!r}. Run one sink per table.", key=self.key)
        dim = b.rows.shape[1] if b.rows.ndim == 2 else -1
        if self._layout is None:
            self._layout = (dim, b.rows.dtype, b.num_shards)
        want_dim, dtype, n = self._layout
        if b.num_shards != n:
            raise ConfigError(f"table {self.key!r} has {b.num_shards} shards now; {self.url} "
                              f"holds {n} under {self.prefix!r}. Use a new prefix.",
                              key=self.key)
        if dim != want_dim or b.rows.dtype != dtype:
            raise ShapeMismatchError(
                f"a batch of table {self.key!r} carries {b.rows.dtype} rows of shape "
                f"{b.rows.shape}; {self.url} holds {dtype} rows of dim {want_dim}. Subscribe "
                "with the same raw, or use a new prefix.", key=self.key, shape=b.rows.shape)
        if (self._pos is None or str(b.shard) not in self._pos) and not b.reset \
                and b.shard not in self._pending:
            raise ConfigError(f"{self.url} holds no rows of shard {b.shard} of table "
                              f"{self.key!r} yet, and this batch is a delta: subscribe with "
                              "since=sink.position().", key=self.key)

    def _transact(self, pages: list[ChangeBatch]) -> bool:
        resets = [i for i, p in enumerate(pages) if p.reset]
        if resets:                  # what came before the last reset is dropped by it
            pages = pages[resets[-1]:]
        s, last, base = pages[0].shard, pages[-1], self._base
        assert self._layout is not None
        dim, dtype, n = self._layout
        if not resets and self._pos is not None and \
                self._pos.get(str(s)) == [last.lineage, last.version] and \
                not any(p.ids.size or p.removed.size for p in pages):
            return False                      # nothing new: no transaction
        members = f"{base}:ids:{s}"
        old: list[Any] = []
        if resets:                  # the sink is the only writer: read before MULTI (K5)
            got = self._client.call("SMEMBERS", members)
            old = got if isinstance(got, list) else []
        cmds: list[list[Arg]] = [["MULTI"]]
        for part in _cut(old):
            cmds.append(["DEL", *(f"{base}:row:{_text(i)}" for i in part)])
        if resets:
            cmds.append(["DEL", members])
        little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
        width = dim * dtype.itemsize
        for p in pages:
            gone = p.removed.tolist()
            for part in _cut(gone):
                cmds.append(["DEL", *(f"{base}:row:{i}" for i in part)])
                cmds.append(["SREM", members, *part])
            ids = p.ids.tolist()
            data = np.ascontiguousarray(p.rows, little).tobytes()
            for at in range(0, len(ids), _PER_COMMAND):
                part = ids[at:at + _PER_COMMAND]
                pairs: list[Arg] = []
                for k, i in enumerate(part, at):
                    pairs += [f"{base}:row:{i}", data[k * width:(k + 1) * width]]
                cmds.append(["MSET", *pairs])
                cmds.append(["SADD", members, *part])
        pos = dict(self._pos or {})
        pos[str(s)] = [last.lineage, last.version]
        pos = dict(sorted(pos.items(), key=lambda kv: int(kv[0])))
        cmds.append(["HSET", f"{base}:meta", "format", FORMAT, "dim", dim,
                     "dtype", row_dtype_name(dtype, self.raw), "row_dtype", dtype.str,
                     "raw", int(self.raw), "num_shards", n, f"lineage:{s}", last.lineage,
                     f"version:{s}", last.version, "position", json.dumps(pos)])
        cmds.append(["EXEC"])
        replies = self._client.pipeline(cmds)
        errors = [r for r in replies[:-1] if isinstance(r, ErrorReply)]
        done = replies[-1]
        if isinstance(done, list):
            errors += [r for r in done if isinstance(r, ErrorReply)]
        if errors or not isinstance(done, list):
            raise ClusterError(f"{self.url} did not apply shard {s} of table {self.key!r} at "
                               f"version {last.version}: {errors[0] if errors else done!r}. "
                               "Check the server's log (maxmemory, a read-only replica?).",
                               key=self.key)
        self._pos = pos
        return True

    def close(self) -> None:
        """Close the connection (the keys stay: a new sink resumes from them)."""
        self._client.close()

    def __enter__(self) -> RedisSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisSink({str(self.url)!r}, {self.key!r}, prefix={self.prefix!r})"


def load_redis(url: str, key: Any, prefix: str = "pskv", *,
               timeout: float = 10.0) -> RowMirror:
    """The table a :class:`RedisSink` wrote, read back: every shard's rows and its
    (lineage, version), as a :class:`~pskv.table.RowMirror` (float32 rows, or the storage
    dtype's of a ``raw`` sink).

    The meta hash and the ID sets are read in one transaction, the rows after it: read
    while the sink is idle for a copy at exactly ``mirror.since()``, else rows may be newer.

    Raises
    ------
    ConfigError
        The prefix holds no table ``key`` a sink wrote.
    ClusterError
        Redis cannot be reached or answers an error.
    """
    base = _base(key, prefix)
    client = RespClient(url, timeout)
    try:
        meta = _meta(client, base)
        if not meta:
            raise ConfigError(f"{client.url} has no {base}:meta: no sink wrote table {key!r} "
                              f"under prefix {prefix!r} there.", key=key)
        dim, dtype, _raw, n = _check_meta(meta, f"{client.url} {base}:meta")
        got = client.pipeline([["MULTI"], ["HGETALL", f"{base}:meta"],
                               *(["SMEMBERS", f"{base}:ids:{s}"] for s in range(n)), ["EXEC"]])
        done = got[-1]
        if not isinstance(done, list) or any(isinstance(r, ErrorReply) for r in done):
            raise ClusterError(f"{client.url} did not read table {key!r}: {done!r}.", key=key)
        flat = done[0] if isinstance(done[0], list) else []
        meta = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        mirror = RowMirror(dim, dtype, key=key)
        little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
        for s in range(n):
            if f"version:{s}" not in meta:
                continue
            members = done[1 + s] if isinstance(done[1 + s], list) else []
            ids = np.array(sorted(int(_text(i)) for i in members), np.int64)
            rows = np.zeros((ids.size, dim), dtype)
            keep = np.ones(ids.size, bool)
            for at in range(0, ids.size, _PER_COMMAND):
                vals = client.call("MGET", *(f"{base}:row:{i}"
                                             for i in ids[at:at + _PER_COMMAND].tolist()))
                for k, v in enumerate(vals if isinstance(vals, list) else [], at):
                    if isinstance(v, bytes) and len(v) == dim * dtype.itemsize:
                        rows[k] = np.frombuffer(v, little)
                    else:
                        keep[k] = False
            mirror.apply(ChangeBatch(
                key=key, shard=s, num_shards=n, lineage=meta[f"lineage:{s}"],
                version=int(meta[f"version:{s}"]), reset=True,
                removed=np.empty(0, np.int64), ids=ids[keep], rows=rows[keep],
                reasons=np.empty(0, np.uint8)))
        return mirror
    finally:
        client.close()
