"""A server's table requests: table inits, lookups and counters (docs/embeddings.md).

A worker inits a table key on every server (one INIT entry per server, ``"stype":
"table"``, the TableSpec as JSON and the server's shard ``[i, n]``); each server then holds
the rows whose IDs ``shard_of`` routes to it (R13) in its engine (``engine._tables``).
Pushes travel as ordinary PUSH messages of kind ``t`` and join the engine's rounds; the two
COMMAND ops here answer a lookup (after this worker's pending push of the key, as a pull
does) and a shard's counters. Every field was checked by ``_ps.validate`` before a handler
runs; what it means (a table key, IDs this server owns) is checked here, before any change.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..._ps.bounds import check_lookup_reply
from ..._ps.message import Command
from ..._ps.ops import Op
from ..engine._core import Engine, Ticket
from ..engine._tables import check_lookup

__all__ = ["cmd_lookup", "cmd_table_stats", "stats_reply"]


def cmd_lookup(server: Any, shard: Any, conn: Any, worker: int, ts: int,
               body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """Rows and found mask of the IDs in ``arrays[0]``, answered as DATA once this worker's
    pending push of the key (``dist_sync``) is applied; a training lookup may insert."""
    key = body["key"]
    engine: Engine = shard.engine
    table = engine.table(key, "lookup", server._where())
    check_lookup_reply(table.name, int(arrays[0].size),
                       int(table.spec.dim) * np.dtype(table.spec.state_dtype).itemsize,
                       server.cfg.max_reply_bytes, server._where())
    ids = check_lookup(table, arrays[0], bool(body["train"]))
    ticket = Ticket(conn, ts, Command.COMMAND, (key,), rows=[ids], train=bool(body["train"]))
    engine.request(ticket, lambda: engine.pull(key, worker, ticket))
    return None


def cmd_table_stats(server: Any, shard: Any, conn: Any, worker: int, ts: int,
                    body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """This shard's counters of table ``key`` (R14), as an ACK's body (:func:`stats_reply`)
    once this worker's pending push of the key is applied, as a lookup's answer."""
    key = body["key"]
    engine: Engine = shard.engine
    engine.table(key, "read the stats of", server._where())
    ticket = Ticket(conn, ts, Op.TABLE_STATS, (key,))
    engine.request(ticket, lambda: engine.pull(key, worker, ticket))
    return None


def stats_reply(engine: Engine, ticket: Ticket) -> dict[str, Any]:
    """The body answering a ``table_stats`` ticket."""
    return {"stats": engine.table(ticket.keys[0], "read the stats of").stats()}
