"""A server's checkpoints: writer threads, replies when written, periodic ones, restarts.

The engine copies its shard (``Engine.snapshot``, or key by key as rounds close for the
periodic checkpoints of ``PSKV_CHECKPOINT_EVERY``); a thread of this module writes the copy
while the server goes on serving. Invariants: the server's loop thread is the only one that
touches the engine or sends replies (:meth:`Snapshots.reap`, called by the loop, answers a
finished write); a writer thread touches only its copy and the files.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import CheckpointError, KVStoreError
from ...table import TableSpec
from ..._ps.config import ClusterConfig
from ..._ps.message import Command
from .._ckcheck import guarded
from ..engine._core import Engine, EntryCopy
from ..engine._tables import served_table
from .._snapshot import Reader, checkpoint_path, ShardCopy, latest, prune, round_dir, write_manifest, write_shard

__all__ = ["PeriodicCopies", "Snapshots", "load_shard"]

log = logging.getLogger(__name__)


class _Job:
    __slots__ = ("thread", "reply", "error")

    def __init__(self, reply: tuple[Any, int] | None) -> None:
        self.thread: threading.Thread | None = None
        self.reply = reply
        self.error: KVStoreError | None = None


class Snapshots:
    """The checkpoints of one server.

    Parameters
    ----------
    cfg : ClusterConfig
        ``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_keep``.
    send, error : callable
        The server's ``send(conn, cmd, ts)`` and ``error(conn, ts, err)``.
    written : callable, optional
        ``written(seconds)`` after each shard written, on a writer thread (metrics).
    """

    def __init__(self, cfg: ClusterConfig, send: Callable[..., None],
                 error: Callable[[Any, int, BaseException], None],
                 written: Callable[[float], object] | None = None) -> None:
        self.cfg = cfg
        self._send, self._error = send, error
        self._jobs: list[_Job] = []
        #: ``written(seconds)`` after each shard written (a writer thread calls it: metrics)
        self.written = written
        self.index, self.num_shards = 0, 1

    def start(self, engine: Engine, index: int, num_shards: int) -> PeriodicCopies | None:
        """``engine`` serves shard ``index`` of ``num_shards``: the observer of its rounds
        that takes the periodic checkpoints, if configured."""
        self.index, self.num_shards = index, num_shards
        if not (self.cfg.checkpoint_every and self.cfg.checkpoint_dir):
            return None
        return PeriodicCopies(engine, self.cfg.checkpoint_every,
                              lambda rnd, copy: self._periodic(rnd, copy, index))

    def initial(self, engine: Engine, index: int) -> None:
        """With periodic checkpoints, before any round: the initial values as the
        checkpoint of round 0, so that a server restarted before the first periodic one
        has something to reload (the workers re-send everything after it)."""
        if self.cfg.checkpoint_every and self.cfg.checkpoint_dir and engine.untouched:
            self.write(engine.snapshot(), round_dir(self.cfg.checkpoint_dir, 0), rnd=0,
                       index=index)

    def _periodic(self, rnd: int, copy: ShardCopy, index: int) -> None:
        assert self.cfg.checkpoint_dir is not None
        self.write(copy, round_dir(self.cfg.checkpoint_dir, rnd), rnd=rnd, index=index)

    def write(self, copy: ShardCopy, path: str, reply: tuple[Any, int] | None = None,
              rnd: int | None = None, index: int | None = None) -> None:
        """Write ``copy`` as shard ``index`` (this server's) of the checkpoint in ``path``
        on a thread; answer ``reply`` (conn, ts) once written."""
        job = _Job(reply)
        shard = self.index if index is None else index
        job.thread = threading.Thread(target=self._run, args=(job, copy, path, rnd, shard),
                                      name=f"pskv-checkpoint-{shard}", daemon=True)
        self._jobs.append(job)
        job.thread.start()

    def _run(self, job: _Job, copy: ShardCopy, path: str, rnd: int | None,
             index: int) -> None:
        try:
            if rnd is not None and self._obsolete(rnd):
                return      # a newer checkpoint is complete: this one was pruned already
            began = time.monotonic()
            write_shard(copy, path, index)
            took = time.monotonic() - began
            log.info("server %d: wrote shard %d of checkpoint %r (%d keys) in %.2f s",
                     self.index, index, path, len(copy.entries), took)
            if self.written is not None:
                self.written(took)
            if rnd is not None:
                # periodic: server 0 names the shards (every server, for the initial one:
                # server 0 may hold no key); the checkpoint is complete once every
                # server's shard is there (readers check), and whichever server completes
                # it removes the old ones
                if index == 0 or rnd == 0:
                    write_manifest(path, self.num_shards, rnd, "dist")
                assert self.cfg.checkpoint_dir is not None
                prune(self.cfg.checkpoint_dir, self.cfg.checkpoint_keep)
        except (OSError, ValueError) as err:
            job.error = CheckpointError(f"server {self.index} cannot write shard {index} of "
                                        f"checkpoint {path!r}: {err}. Check that the directory "
                                        "is writable by every server and has room.")
        except KVStoreError as err:
            job.error = err

    def _obsolete(self, rnd: int) -> bool:
        root = self.cfg.checkpoint_dir
        newest = None if root is None else latest(root)
        if newest is None:
            return False
        name = os.path.basename(newest)
        return name.startswith("round-") and int(name[6:]) > rnd

    def reap(self) -> None:
        """On the loop thread: answer the finished writes (or log a periodic one's error)."""
        if not self._jobs:
            return
        left = []
        for job in self._jobs:
            assert job.thread is not None
            if job.thread.is_alive():
                left.append(job)
            elif job.reply is not None:
                conn, ts = job.reply
                if job.error is None:
                    self._send(conn, Command.ACK, ts)
                else:
                    self._error(conn, ts, job.error)
            elif job.error is not None:
                log.error("server %d: periodic checkpoint failed: %s", self.index, job.error)
        self._jobs = left

    def restore(self, engine: Engine, path: str) -> None:
        """Set every key ``engine`` holds from the checkpoint in ``path`` (a worker named it:
        it must lie where :func:`checkpoint_path` allows)."""
        path = checkpoint_path(path, self.cfg.checkpoint_dir)
        reader = Reader(path, self.cfg.max_key_bytes)
        try:
            with guarded(path):
                engine.restore(reader)
        finally:
            reader.close()

    def close(self, timeout: float = 30.0) -> None:
        """Let the writes under way finish (bounded)."""
        for job in self._jobs:
            assert job.thread is not None
            job.thread.join(timeout)
        self._jobs.clear()


class PeriodicCopies:
    """A :class:`pskv.kvstore.engine._core.RoundObserver` that copies a shard every ``every`` rounds: each
    key as its round closes, so all keys are at the same round in one copy, handed to
    ``write(round, copy)`` once the last key got there. A key that skipped a round (a
    restarted worker's catching up) gives that round's copy up."""

    wants_merged = False

    def __init__(self, engine: Engine, every: int,
                 write: Callable[[int, ShardCopy], None]) -> None:
        self.engine, self.every, self._write = engine, every, write
        self._pending: dict[int, dict[Any, EntryCopy]] = {}

    def round_applied(self, key: Any, merged: Any, rnd: int, applied: dict[int, int]) -> None:
        """Copy ``key`` if ``rnd`` is a checkpoint round; write once every key is in."""
        if rnd % self.every:
            return
        pending = self._pending.setdefault(rnd, {})
        pending[key] = self.engine.copy_entry(key)
        if len(pending) == len(self.engine):
            del self._pending[rnd]
            for older in [r for r in self._pending if r < rnd]:
                del self._pending[older]
            self._write(rnd, self.engine.shard_copy(list(pending.values())))


def load_shard(engine: Engine, root: str, index: int, num_shards: int,
               max_key_bytes: int = 1 << 36) -> int | None:
    """A restarted server's shard: every key of shard ``index`` of the newest complete
    checkpoint under ``root``, into an empty ``engine``; the checkpoint's round (None if
    there is no checkpoint yet). CheckpointError for anything wrong in it."""
    path = latest(root)
    if path is None:
        return None
    reader = Reader(path, max_key_bytes)
    try:
        with guarded(path):
            return _load_shard(engine, reader, path, index, num_shards)
    finally:
        reader.close()


def _load_shard(engine: Engine, reader: Reader, path: str, index: int,
                num_shards: int) -> int:
    """Shard ``index`` of ``reader`` into an empty ``engine``; its round."""
    if reader.manifest["num_shards"] != num_shards:
        raise CheckpointError(
            f"the newest checkpoint {path!r} has {reader.manifest['num_shards']} shards, "
            f"but this cluster has {num_shards} servers: a restarted server reloads its "
            "own shard. Restart the job with as many servers, then load_checkpoint.")
    for e in reader.metas[index]["entries"]:
        if e.get("stype") == "table":       # its rows: engine.restore below
            engine.init_table(e["id"], served_table(TableSpec.from_json(e["spec"]),
                                                    e["key"], (index, num_shards)))
            continue
        start, stop, shape = int(e["start"]), int(e["stop"]), tuple(e["shape"])
        sparse = e.get("stype") == "row_sparse"
        part = _part_shape(shape, start, stop, sparse)
        value = reader.value(e["key"], start, stop, part)
        engine.init(e["id"], value, sparse, e["key"], place=(start, stop, shape))
    engine.restore(reader, counters=True)
    rnd = reader.manifest.get("round")
    return int(rnd) if isinstance(rnd, int) else 0


def _part_shape(shape: tuple[int, ...], start: int, stop: int, sparse: bool) -> tuple[int, ...]:
    """The shape a server holds for units ``[start, stop)`` of a key of ``shape``."""
    if sparse:
        return (stop - start,) + shape[1:]
    if start == 0 and stop == int(np.prod(shape, dtype=np.int64)):
        return shape
    return (stop - start,)


