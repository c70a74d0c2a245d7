"""The checkpoint calls of a dist store (docs/durability.md): collective calls that
worker 0 carries out on a directory every server can reach.

A part of :class:`.dist.DistKVStore` (:class:`Checkpoints`), given its
:class:`._core.WorkerCore`, its keys' records and its tables; the servers write and read
their own shards (``Op.CHECKPOINT`` / ``Op.RESTORE``), table keys included (rows stored by
ID).
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointError, KVStoreError, UnsupportedError
from ..._ps.ops import Op, command
from .._keys import KeyRecord
from .._snapshot import Reader, checkpoint_path, check_keys, write_manifest
from ._core import WorkerCore

__all__ = ["Checkpoints"]


class Checkpoints:
    """``save_checkpoint`` and ``load_checkpoint`` of a DistKVStore (the store's
    docstrings)."""

    def __init__(self, core: WorkerCore, records: dict[Any, KeyRecord],
                 table_keys: Callable[[], list[Any]]) -> None:
        self._core, self._store, self._table_keys = core, records, table_keys

    def save(self, path: str) -> None:
        """Every server writes its shard to ``path``; rank 0 the manifest."""
        core = self._core
        summed = [k for k, rec in self._store.items() if rec.collective]
        if summed:       # alike on every worker: the choice is the same on all (init)
            raise UnsupportedError(
                f"save_checkpoint: key {summed[0]!r} is summed among the workers (the "
                "collective path, docs/collective.md), so the servers do not hold its value. "
                f"Keep it on the servers to checkpoint it: set_collective({summed[0]!r}, "
                "False) before its init, or PSKV_COLLECTIVE_BYTES=0.", key=summed[0],
                store_type=core.store_type)

        def write(where: str) -> None:
            core.to_servers(command(Op.CHECKPOINT, path=where), wait=True)
            write_manifest(where, core.po.num_servers, None, core.store_type)
        self._by_rank0("save_checkpoint", "written", path, write)

    def load(self, path: str) -> None:
        """Every key from the checkpoint in ``path``."""
        core = self._core

        def restore(where: str) -> None:
            reader = Reader(where, core.cfg.max_key_bytes)
            try:
                check_keys(reader, list(self._store) + self._table_keys(), where)
            finally:
                reader.close()
            core.to_servers(command(Op.RESTORE, path=where), wait=True)
        self._by_rank0("load_checkpoint", "loaded", path, restore)

    def _by_rank0(self, call: str, done: str, path: str, action: Callable[[str], None]) -> None:
        """A collective call that worker 0 carries out on the checkpoint directory ``path``
        (after every worker's pushes are applied); its error is raised on every worker."""
        core = self._core
        with core.lock:
            core.begin()
            core.kv.flush()
            core.collective(call)
            error = None
            if core.po.rank == 0:
                try:     # a path outside PSKV_CHECKPOINT_DIR is refused on every worker
                    action(checkpoint_path(path, core.cfg.checkpoint_dir))
                except (KVStoreError, OSError) as err:
                    error = f"{type(err).__name__}: {err}"
            payloads = core.collective(f"{call} ({done})", {"error": error})
            msg = (payloads.get("0") or {}).get("error")
            if msg:
                raise CheckpointError(f"{msg} (worker 0 reported it)")
