""":class:`FileSink` and :func:`replay`: a table's change stream as a full snapshot plus
deltas in a directory (rules F1-F8 in :mod:`pskv.sinks`)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..errors import CheckpointError, ConfigError, ShapeMismatchError
from ..table import ChangeBatch, RowMirror
from ._segments import (FORMAT, MANIFEST, encode, load_segment, manifest_text, read_manifest,
                        row_dtype_name, write_durably)

__all__ = ["FileSink", "replay"]

log = logging.getLogger(__name__)

#: deltas after a full snapshot before the next one (F5)
MAX_DELTAS = 64
#: the least byte budget of the deltas after a full snapshot (F5)
MIN_DELTA_BYTES = 1 << 20
#: tries of a read that finds a named segment gone (a rotation ran meanwhile, F7)
_READ_TRIES = 5
_LOCK = ".lock"


def _read(directory: Path, key: Any = None) -> tuple[dict[str, Any] | None,
                                                     list[list[ChangeBatch]]]:
    """The manifest of ``directory`` and the batches of each segment it names, checked
    (F6); a segment removed by a rotation meanwhile: read again (F7)."""
    for attempt in range(_READ_TRIES):
        man = read_manifest(directory)
        if man is None:
            return None, []
        if key is not None and man["key"] != key:
            raise ConfigError(f"{directory} holds table {man['key']!r}, not {key!r}. Give "
                              "each table a directory of its own.", key=key)
        dtype = np.dtype(man["row_dtype"])
        try:
            segs = [load_segment(directory, e, man["key"], man["dim"], dtype)[1]
                    for e in man["segments"]]
        except FileNotFoundError:
            if attempt + 1 == _READ_TRIES:
                raise CheckpointError(
                    f"{directory / MANIFEST} names segments that are gone, {_READ_TRIES} "
                    "times in a row. Is another process deleting them? Delete the "
                    "directory to start a new snapshot.", key=man["key"]) from None
            time.sleep(0.05 * (attempt + 1))
            continue
        return man, segs
    raise AssertionError("unreachable")        # pragma: no cover


def _check_positions(man: dict[str, Any], entry: dict[str, Any],
                     have: dict[int, tuple[str, int]], directory: Path) -> None:
    want = {int(s): (p[0], p[1]) for s, p in entry["position"].items()}
    if want != have:
        raise CheckpointError(
            f"segment {directory / entry['file']} brings the table to {have}, the manifest "
            f"says {want}: the directory is damaged. Delete it to start a new snapshot.",
            key=man["key"])


def replay(directory: str | os.PathLike[str]) -> RowMirror:
    """The table a :class:`FileSink` wrote to ``directory``: its full snapshot and every
    delta after it applied in order (F3), as a :class:`~pskv.table.RowMirror`.

    Parameters
    ----------
    directory : str or path
        A FileSink's directory (it holds ``manifest.json``).

    Returns
    -------
    RowMirror
        ``mirror.table()`` is ``(ids, rows)``, the rows bit for bit those of the table at
        ``mirror.since()`` (float32, or the storage dtype of a ``raw`` sink: bfloat16 as
        its uint16 bits).

    Raises
    ------
    CheckpointError
        No manifest, or a manifest or segment that is damaged (F6).

    Examples
    --------
    >>> import tempfile, numpy as np, pskv as mx
    >>> from pskv.table import TableSpec, Constant
    >>> from pskv.sinks import FileSink, replay
    >>> kv = mx.kv.create('local')
    >>> kv.init('emb', TableSpec(dim=2, init=Constant(0.5)))
    >>> _ = kv.lookup('emb', np.array([3, 4]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with FileSink(d, 'emb') as sink:
    ...         _ = sink.write(kv.subscribe('emb').poll())
    ...     replay(d).table()[0].tolist()
    [3, 4]
    """
    path = Path(directory)
    man, segs = _read(path)
    if man is None:
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a FileSink directory, "
                              "or its sink has not written yet.")
    mirror = RowMirror(man["dim"], np.dtype(man["row_dtype"]), key=man["key"])
    for entry, batches in zip(man["segments"], segs):
        for b in batches:
            mirror.apply(b)
        _check_positions(man, entry, mirror.since(), path)
    return mirror


class FileSink:
    """Writes table ``key``'s change batches to ``directory`` as a full snapshot plus
    deltas and a ``manifest.json`` a serving process loads (:mod:`pskv.sinks`, F1-F8).

    Parameters
    ----------
    directory : str or path
        Where the segments and the manifest go (created if missing). One sink at a time
        per directory (a lock file keeps a second one out).
    key : int or str
        The table key; a directory that holds another table is refused.
    raw : bool
        Whether the batches carry rows in the table's storage dtype (``subscribe(...,
        raw=True)``); kept in the manifest, and a directory written otherwise is refused.
    max_deltas : int
        Deltas after a full snapshot before the next one (F5).
    max_bytes : int, optional
        Bytes of deltas after a full snapshot before the next one; None: as many as the
        full snapshot has (at least 1 MiB), so replaying reads at most twice a snapshot.
    fsync : bool
        fsync each file (and the directory) before the manifest names it (F2); turn off
        only for tests.

    Notes
    -----
    The sink holds a copy of the table (every shard's rows) to write full snapshots from:
    the memory of the table's rows, once. A new sink on a directory reads it back (F8).
    """

    def __init__(self, directory: str | os.PathLike[str], key: Any, *, raw: bool = False,
                 max_deltas: int = MAX_DELTAS, max_bytes: int | None = None,
                 fsync: bool = True) -> None:
        if not isinstance(raw, bool):
            raise ConfigError(f"FileSink(raw={raw!r}): raw is True or False.", key=key)
        if isinstance(max_deltas, bool) or not isinstance(max_deltas, int) or max_deltas < 0:
            raise ConfigError(f"FileSink(max_deltas={max_deltas!r}): give a whole number "
                              ">= 0 (0: a full snapshot each write).", key=key)
        if max_bytes is not None and (isinstance(max_bytes, bool)
                                      or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ConfigError(f"FileSink(max_bytes={max_bytes!r}): give bytes >= 0, or None "
                              "(as many as the full snapshot).", key=key)
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise ConfigError(f"FileSink(key={key!r}): a table key is an int or a str.",
                              key=key)
        self.directory = Path(directory)
        self.key, self.raw = key, raw
        self.max_deltas, self.max_bytes, self._fsync = max_deltas, max_bytes, fsync
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"FileSink cannot create {self.directory}: {err}. Give a "
                              "directory it may write.", key=key) from err
        self._lock_fd = self._lock()
        try:
            self._load()
        except BaseException:
            self._unlock()
            raise

    # ---- state --------------------------------------------------------------------------
    def _lock(self) -> int | None:
        fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl                           # POSIX only: elsewhere, no lock
        except ImportError:                        # pragma: no cover
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            raise ConfigError(f"another FileSink writes to {self.directory} already. Run one "
                              "sink per directory.", key=self.key) from err
        return fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)            # closing the file releases the flock
            self._lock_fd = None

    def _load(self) -> None:
        """Read the directory back (F8): the manifest, a copy per shard; orphans removed."""
        man, segs = _read(self.directory, self.key)
        self._man = man
        self._mirrors: dict[int, RowMirror] = {}
        self._partial: set[int] = set()
        if man is not None:
            if man["raw"] != self.raw:
                raise ConfigError(f"{self.directory} holds {'raw' if man['raw'] else 'float32'}"
                                  f" rows of table {self.key!r}; this sink was given raw="
                                  f"{self.raw}. Use another directory, or the same raw.",
                                  key=self.key)
            dtype = np.dtype(man["row_dtype"])
            for entry, batches in zip(man["segments"], segs):
                for b in batches:
                    self._apply(b, man["dim"], dtype)
                _check_positions(man, entry, self._since(), self.directory)
        named = {e["file"] for e in man["segments"]} if man else set()
        for f in self.directory.iterdir():   # a crash's leftovers: never named, never read
            if (f.name.startswith("seg-") and f.name.endswith(".npz") and f.name not in named) \
                    or f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)

    def _apply(self, b: ChangeBatch, dim: int, dtype: np.dtype) -> None:
        mirror = self._mirrors.get(b.shard)
        if mirror is None:
            mirror = self._mirrors[b.shard] = RowMirror(dim, dtype, key=self.key)
        mirror.apply(b)
        (self._partial.discard if b.complete else self._partial.add)(b.shard)

    def _since(self) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        for m in self._mirrors.values():
            out.update(m.since())
        return out

    def position(self) -> dict[str, list[Any]] | None:
        """Where the files are: ``{"shard": [lineage, version]}`` (``subscribe(key,
        since=...)`` resumes there), or None before the first full snapshot."""
        if self._man is None:
            return None
        return {s: list(p) for s, p in self._man["position"].items()}

    @property
    def segments(self) -> list[str]:
        """The segment files the manifest names, in order (a full snapshot first)."""
        return [] if self._man is None else [e["file"] for e in self._man["segments"]]

    # ---- writing ------------------------------------------------------------------------
    def _check(self, batches: list[ChangeBatch]) -> tuple[int, np.dtype, int]:
        first = batches[0]
        dim, dtype = (first.rows.shape[1] if first.rows.ndim == 2 else -1), first.rows.dtype
        n = first.num_shards
        if self._man is not None:
            dim, dtype, n = self._man["dim"], np.dtype(self._man["row_dtype"]), \
                self._man["num_shards"]
        held = set(self._mirrors)
        for b in batches:
            if b.key != self.key:
                raise ConfigError(f"a FileSink of table {self.key!r} was given a batch of "
                                  f"table {b.key!r}. Run one sink per table.", key=self.key)
            if b.num_shards != n:
                raise ConfigError(f"table {self.key!r} has {b.num_shards} shards now; "
                                  f"{self.directory} holds {n}. Write to a new directory.",
                                  key=self.key)
            if b.rows.ndim != 2 or b.rows.shape[1] != dim or b.rows.dtype != dtype:
                raise ShapeMismatchError(
                    f"a batch of table {self.key!r} carries {b.rows.dtype} rows of shape "
                    f"{b.rows.shape}; {self.directory} holds {dtype} rows of dim {dim}. "
                    "Subscribe with the same raw, or write to a new directory.",
                    key=self.key, shape=b.rows.shape)
            if b.shard not in held and not b.reset:
                raise ConfigError(
                    f"{self.directory} holds no rows of shard {b.shard} of table "
                    f"{self.key!r} yet, and this batch is a delta: subscribe with since="
                    "sink.position() (None for a new directory).", key=self.key)
            held.add(b.shard)
        last = {b.shard: b for b in batches}
        if self._man is None and (held != set(range(n))
                                  or not all(b.complete for b in last.values())):
            raise ConfigError(f"the first write to {self.directory} needs every shard of "
                              f"table {self.key!r} (0..{n - 1}), each read to its end; got "
                              f"{sorted(held)}. Write a whole poll of a subscription.",
                              key=self.key)
        return dim, np.dtype(dtype), n

    def write(self, batches: Iterable[ChangeBatch]) -> str | None:
        """Apply ``batches`` (one ``Subscription.poll()``) and write them as one segment:
        a delta, or a full snapshot of the table after them (F4, F5).

        Returns
        -------
        str or None
            The segment file written; None when the batches change nothing.
        """
        if self._closed:
            raise ConfigError(f"this FileSink of {self.directory} is closed (or a write of it "
                              "failed). Open a new one: it resumes from the manifest.",
                              key=self.key)
        got = list(batches)
        if not got:
            return None
        dim, dtype, n = self._check(got)
        before = self._since()
        for b in got:
            self._apply(b, dim, dtype)
        if self._man is not None and self._since() == before and not any(
                b.ids.size or b.removed.size or b.reset for b in got):
            return None
        try:
            return self._write_segment(got, dim, dtype, n)
        except BaseException:
            self._closed = True              # the copy is ahead of the files: reopen
            self._unlock()
            raise

    def _full_due(self, got: list[ChangeBatch], dtype: np.dtype) -> bool:
        if self._man is None or any(b.reset for b in got):
            return True
        deltas = self._man["segments"][1:]
        budget = self.max_bytes if self.max_bytes is not None else \
            max(self._man["segments"][0]["bytes"], MIN_DELTA_BYTES)
        size = sum(b.ids.size * 8 + b.rows.size * dtype.itemsize + b.removed.size * 9
                   for b in got)
        return len(deltas) + 1 > self.max_deltas or \
            sum(e["bytes"] for e in deltas) + size > budget

    def _write_segment(self, got: list[ChangeBatch], dim: int, dtype: np.dtype,
                       n: int) -> str:
        full = self._full_due(got, dtype) and not self._partial
        if full:
            batches = []
            for s in range(n):
                ids, rows = self._mirrors[s].table()
                lineage, version, _n = self._mirrors[s].positions[s]
                batches.append(ChangeBatch(
                    key=self.key, shard=s, num_shards=n, lineage=lineage, version=version,
                    reset=True, removed=np.empty(0, np.int64), ids=ids, rows=rows,
                    reasons=np.empty(0, np.uint8)))
        else:
            batches = got
        kind = "full" if full else "delta"
        seq = 0 if self._man is None else self._man["next"]
        name = f"seg-{seq:08d}-{kind}.npz"
        arrays = encode(batches, kind, dim, dtype)
        size, sha = write_durably(self.directory / name,
                                  lambda f: np.savez(f, allow_pickle=False, **arrays), self._fsync)
        position = {str(s): [p[0], p[1]] for s, p in sorted(self._since().items())}
        entry = {"file": name, "kind": kind, "bytes": size, "sha256": sha,
                 "position": position}
        old = [] if self._man is None else self._man["segments"]
        man = {"format": FORMAT, "key": self.key, "dim": dim,
               "dtype": row_dtype_name(dtype, self.raw), "row_dtype": dtype.str,
               "raw": self.raw, "num_shards": n,
               "segments": [entry] if full else [*old, entry],
               "position": position, "next": seq + 1}
        text = manifest_text(man)
        write_durably(self.directory / MANIFEST, lambda f: f.write(text), self._fsync)
        self._man = man
        if full:                      # superseded: the manifest no longer names them (F5)
            for e in old:
                (self.directory / e["file"]).unlink(missing_ok=True)
            log.info("table %r: full snapshot %s in %s", self.key, name, self.directory)
        return name

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the directory (the files stay: a new sink resumes from them)."""
        self._closed = True
        self._unlock()

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FileSink({str(self.directory)!r}, {self.key!r}, raw={self.raw}, "
                f"segments={len(self.segments)})")
