"""The checkpoint calls of a dist store (docs/durability.md): collective calls that
worker 0 carries out on a directory every server can reach.

A part of :class:`.dist.DistKVStore` (:class:`Checkpoints`), given its
:class:`._core.WorkerCore`, its keys' records, its tables and its collective path; the
servers write and read their own shards (``Op.CHECKPOINT`` / ``Op.RESTORE``), table keys
included (rows stored by ID), and keys summed among the workers with the value worker 0
sends them with the command.
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointError, KVStoreError
from ..._ps.message import Command
from ..._ps.ops import Op, command
from .._keys import KeyRecord
from .._snapshot import Reader, checkpoint_path, check_keys, write_manifest
from ._collective import PeerSums
from ._core import WorkerCore

__all__ = ["Checkpoints"]


class Checkpoints:
    """``save_checkpoint`` and ``load_checkpoint`` of a DistKVStore (the store's
    docstrings)."""

    def __init__(self, core: WorkerCore, records: dict[Any, KeyRecord],
                 table_keys: Callable[[], list[Any]], peers: PeerSums) -> None:
        self._core, self._store, self._table_keys = core, records, table_keys
        self._peers = peers

    def save(self, path: str) -> None:
        """Every server writes its shard to ``path``; rank 0 the manifest. A key summed
        among the workers (docs/collective.md) is written with worker 0's value of its
        last round, sent with each server's command (the servers hold its initial value)."""
        core = self._core

        def write(where: str) -> None:
            held = self._peers.held_parts()
            tss = [core.kv.request(s, Command.COMMAND, arrays=held.get(s, ([], []))[1],
                                   body=command(Op.CHECKPOINT, path=where,
                                                values=held.get(s, ([], []))[0]))
                   for s in range(core.po.num_servers)]
            core.wait_all(tss, "the servers to take checkpoint")
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
        self._peers.loaded()

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
