"""A server's part of the global staleness bound (docs/embeddings.md, "Bounded staleness").

The rules live in :class:`.._ps.staleness.ClockGate` (no sockets, no threads); this module
is the glue: which requests are bounded reads (a pull, a row_sparse pull, a training
lookup: :func:`park_read` holds one back while its worker is too far ahead) and the
``clock`` command each worker sends after every push call (:func:`cmd_clock`). The server
runs what the gate releases (``KVServer._resume``) and fails what it gives up on.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ProtocolError
from ..._ps.message import Command, Meta
from ..._ps.ops import Op, parse
from ..._ps.staleness import ClockGate

__all__ = ["bounded_read", "cmd_clock", "park_read"]


def bounded_read(shard: Any, meta: Meta) -> str | None:
    """What ``meta`` reads, when it is a read the global bound holds back (a pull, a
    row_sparse pull, a training lookup), for messages; else None. Eval lookups and
    ``table_stats`` are not held back: they change nothing."""
    if meta.cmd in (Command.PULL, Command.RSP_PULL) and meta.keys:
        pk, what = meta.keys[0], "a pull of key"
    elif meta.cmd == Command.COMMAND and parse(meta.body) is Op.LOOKUP \
            and meta.body.get("train"):
        pk, what = meta.body["key"], "a lookup of table"
    else:
        return None
    name = shard.engine.entry_name(pk) if pk in shard.engine else pk
    return f"{what} {name!r}"


def park_read(gate: ClockGate, shard: Any, conn: Any, worker: int, meta: Meta,
              arrays: list[np.ndarray], index: int | None) -> bool:
    """Hold ``meta`` back if it is a bounded read of a worker too far ahead (True); raise
    at once if a worker it would wait for is gone; False: run it now."""
    what = bounded_read(shard, meta)
    if what is None or gate.allows(worker):
        return False
    err = gate.check_new(worker, what)
    if err is not None:
        raise err
    # the loop may reuse the message's buffers: the parked read keeps copies
    gate.park(worker, what, (conn, worker, meta, [np.array(a) for a in arrays], index))
    return True


def cmd_clock(server: Any, shard: Any, conn: Any, worker: int, ts: int,
              body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """A worker's clock (after each push call: one-way, ``ts`` negative), the job's global
    bound (``kv.set_staleness``: answered), or its leaving (``kv.close``)."""
    gate: ClockGate = server.gate
    if body.get("leave"):
        server._resume(gate.leave(worker))
    else:
        if body.get("bound") is not None and shard.engine.sync:
            raise ProtocolError("a global staleness bound applies to dist_async only: "
                                "dist_sync keeps every worker in the same round")
        bound = body["bound"] if "bound" in body else ...
        server._resume(gate.update(worker, body.get("clock"), bound))
    return [] if ts > 0 else None
