"""The KV sub-protocol of a COMMAND message: one typed home for its ops and their bodies.

A COMMAND's JSON body names an ``op`` and carries that op's fields. Two families:

* :class:`Op`: what a worker asks a server (settings, states, checkpoints, failover
  questions); built with :func:`command` by the dist store and the worker.
* :class:`ReplOp`: what the server serving a shard sends that shard's backup
  (``PSKV_REPLICAS=1``, ``kvstore/durable/_replica.py``); built with :func:`change`.

Invariant: an op travels as its ``.value`` string and is read back only through
:func:`parse`, which returns the enum member (or None for anything else); validation
(``validate.py``) and dispatch (``kvstore/server/_core.py``, ``kvstore/durable/_replica.py``) are tables
keyed by these enums, so no op name is spelt anywhere else.
"""
from __future__ import annotations

import enum
from typing import Any

__all__ = ["BACKUP_ENDPOINT", "Op", "ReplOp", "change", "command", "parse"]


class Op(str, enum.Enum):
    """A worker's COMMAND to a server."""

    OPTIMIZER = "optimizer"      # spec: the optimizer every key's update runs
    COMPRESSION = "compression"  # params: gradient compression (or null: off)
    SAVE = "save"                # dump: reply the optimizer states as bytes
    LOAD = "load"                # one uint8 array: optimizer states to set
    CHECKPOINT = "checkpoint"    # path: write this server's shard there
    RESTORE = "restore"          # path: read this server's part of a checkpoint
    APPLIED = "applied"          # reply which of this worker's pushes are applied here
    INITIAL = "initial"          # worker 0's first push: the inits are complete
    LOOKUP = "lookup"            # key, train; one array of IDs: reply a table's rows, found
    TABLE_STATS = "table_stats"  # key: reply a table shard's counters
    CLOCK = "clock"              # clock, bound, leave: this worker's clock (staleness.py)
    JOINED = "joined"            # epoch: every worker joined (kv.join); rounds count all again
    ADOPT = "adopt"              # values: keys summed among the workers, one array each: store
    CHANGES = "changes"          # key, since, lineage, cursor, upto, max_rows, raw: a page of
    #                              a table shard's change stream (docs/embeddings.md E1-E10)
    EXPLAIN = "explain"          # key, id: reply what a table shard knows of that ID
    HOT_IDS = "hot_ids"          # key, k: reply a table shard's k most looked-up IDs
    SEAL = "seal"                # step, commit: this worker's pushes tagged <= step are here
    #                              (commit false: just answer; docs/data.md, "How it works")
    POSITION = "position"        # reply this worker's sealed step and per-key marks here

    @property
    def replicated(self) -> ReplOp | None:
        """The change a server sends its backup before it applies this op itself."""
        return _REPLICATED.get(self)


class ReplOp(str, enum.Enum):
    """A change of a shard, sent by the server serving it to its backup."""

    STATE = "r_state"              # the whole shard: entries, optimizer, states, compression
    ROUNDS = "r_rounds"            # applied rounds, one message: rounds, arrays (counts)
    INIT = "r_init"                # keys initialized
    OPTIMIZER = "r_optimizer"      # as Op.OPTIMIZER
    COMPRESSION = "r_compression"  # as Op.COMPRESSION
    LOAD = "r_load"                # as Op.LOAD
    RESTORE = "r_restore"          # as Op.RESTORE
    NOOP = "r_noop"                # nothing: makes a primary connect (and copy the shard)
    RING = "r_ring"                # a shared-memory ring beside the link (_ps/ring.py)

    @property
    def applied_first(self) -> bool:
        """Whether the primary applies this change before replicating it (a whole copy
        taken at that moment has it, so it is not sent again after that copy)."""
        return self in (ReplOp.NOOP, ReplOp.INIT, ReplOp.ROUNDS)


_REPLICATED = {Op.OPTIMIZER: ReplOp.OPTIMIZER, Op.COMPRESSION: ReplOp.COMPRESSION,
               Op.LOAD: ReplOp.LOAD, Op.RESTORE: ReplOp.RESTORE}
_BY_VALUE: dict[str, Op | ReplOp] = {**{o.value: o for o in Op}, **{o.value: o for o in ReplOp}}

#: prefix of the endpoints under which a server announces its backups' listeners
BACKUP_ENDPOINT = "r_"


def command(op: Op, **fields: Any) -> dict[str, Any]:
    """The body of a worker's COMMAND ``op`` with ``fields``."""
    return {"op": op.value, **fields}


def change(op: ReplOp, shard: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The body of a replication change ``op`` of ``shard`` carrying ``fields`` (a
    forwarded worker command's body: its own ``op`` is replaced)."""
    return {**fields, "op": op.value, "shard": shard}


def parse(body: Any) -> Op | ReplOp | None:
    """The op a COMMAND body names, or None if it names none that exists."""
    name = body.get("op") if isinstance(body, dict) else None
    return _BY_VALUE.get(name) if isinstance(name, str) else None
