"""The checkpoint calls of a dist store (docs/durability.md): collective calls that
worker 0 carries out on a directory every server can reach.

Mixed into :class:`.dist.DistKVStore`; the servers write and read their own shards
(``Op.CHECKPOINT`` / ``Op.RESTORE``), table keys included (rows stored by ID).
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointError, KVStoreError, UnsupportedError
from ..._ps.message import Command
from ..._ps.ops import Op, command
from .._snapshot import Reader, checkpoint_path, check_keys, write_manifest

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """``save_checkpoint`` and ``load_checkpoint`` of a DistKVStore."""

    _lock: Any
    _kv: Any
    _po: Any
    _type: str
    _store: dict[Any, Any]
    _tables: Any
    _begin: Callable[..., None]
    _collective: Callable[..., dict[str, dict[str, Any]]]
    _to_all: Callable[..., list[Any]]

    def save_checkpoint(self, path: str) -> None:
        """Every server writes its shard to the directory ``path``; rank 0 the manifest.

        Collective: every worker calls it at the same point. Each worker's pushes made
        before it are applied first, so the checkpoint holds whole rounds. Each server
        pauses for one in-memory copy of its shard and writes it on a thread, all servers in
        parallel; the call returns once every shard is on disk. ``path`` must be a
        directory every server can write (a shared file system across hosts).
        """
        summed = [k for k, rec in self._store.items() if rec.collective]
        if summed:       # alike on every worker: the choice is the same on all (init)
            raise UnsupportedError(
                f"save_checkpoint: key {summed[0]!r} is summed among the workers (the "
                "collective path, docs/collective.md), so the servers do not hold its value. "
                f"Keep it on the servers to checkpoint it: set_collective({summed[0]!r}, "
                "False) before its init, or PSKV_COLLECTIVE_BYTES=0.", key=summed[0],
                store_type=self._type)

        def write(where: str) -> None:
            self._to_all(Command.COMMAND, command(Op.CHECKPOINT, path=where))
            write_manifest(where, self._po.num_servers, None, self._type)
        self._by_rank0("save_checkpoint", "written", path, write)

    def load_checkpoint(self, path: str) -> None:
        """Set every key from the checkpoint in ``path``, written by any number of servers
        (or by a local store): values, optimizer states (and optimizer), rounds.

        Collective. The workers must have initialized exactly the checkpoint's keys with
        the same shapes and dtypes; call ``set_optimizer`` before loading, not after (a
        saved optimizer replaces it). Raises CheckpointError on every worker otherwise.
        """
        def restore(where: str) -> None:
            reader = Reader(where, self._cfg.max_key_bytes)
            try:
                check_keys(reader, list(self._store) + list(self._tables.tables), where)
            finally:
                reader.close()
            self._to_all(Command.COMMAND, command(Op.RESTORE, path=where))
        self._by_rank0("load_checkpoint", "loaded", path, restore)

    def _by_rank0(self, call: str, done: str, path: str, action: Callable[[str], None]) -> None:
        """A collective call that worker 0 carries out on the checkpoint directory ``path``
        (after every worker's pushes are applied); its error is raised on every worker."""
        with self._lock:
            self._begin()
            self._kv.flush()
            self._collective(call)
            error = None
            if self._po.rank == 0:
                try:     # a path outside PSKV_CHECKPOINT_DIR is refused on every worker
                    action(checkpoint_path(path, self._cfg.checkpoint_dir))
                except (KVStoreError, OSError) as err:
                    error = f"{type(err).__name__}: {err}"
            self._finish_collective(f"{call} ({done})", error)

    def _finish_collective(self, call: str, error: str | None) -> None:
        """The closing barrier of a call rank 0 carried out; raise its error everywhere."""
        payloads = self._collective(call, {"error": error})
        msg = (payloads.get("0") or {}).get("error")
        if msg:
            raise CheckpointError(f"{msg} (worker 0 reported it)")
