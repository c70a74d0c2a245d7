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

import time
from typing import Any

import numpy as np

from ..._ps.bounds import check_lookup_reply
from ..._ps.message import Command
from ..._ps.ops import Op
from ..engine._core import Engine, Ticket
from ..engine._tables import check_lookup
from ...table._stream import read_changes

__all__ = ["cmd_changes", "cmd_explain", "cmd_hot_ids", "cmd_lookup", "cmd_table_stats",
           "stats_reply"]

#: the stream readers a table shard remembers (the most recent)
MAX_READERS = 64


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
    # a restarted worker that has not made its pushes of the step it resumed at again
    # reads the rows as they are (docs/data.md D4)
    now = body.get("now") is True
    engine.request(ticket, lambda: engine.pull(key, worker, ticket, now))
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


def cmd_changes(server: Any, shard: Any, conn: Any, worker: int, ts: int,
                body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """A page of this shard's change stream of table ``key`` (E1-E10), answered at once
    (a read waits for no push): DATA with ``[removed, reasons, ids, rows]`` and the
    page's lineage, version, reset and cursor. Its rows fit a reply
    (``PSKV_MAX_REPLY_BYTES``): a page carries fewer than ``max_rows`` if they would not.
    Sent after the backup holds every change it shows (``_send`` drains first, E8)."""
    key = body["key"]
    engine: Engine = shard.engine
    table = engine.table(key, "read the changes of", server._where())
    raw = bool(body["raw"])
    width = int(table.spec.dim) * (np.dtype(table.spec.storage).itemsize if raw else 4)
    fits = max(1, (server.cfg.max_reply_bytes // 2) // max(width + 8, 1))
    page = read_changes(table, int(body["since"]), body.get("lineage"),
                        cursor=int(body["cursor"]), upto=body.get("upto"),
                        max_rows=min(int(body["max_rows"]), fits), raw=raw, key=table.name,
                        shard=table.shard)
    if page.complete:       # who reads the stream, and how far (a metric's lag); bounded
        readers = table.readers
        readers[str(getattr(conn, "peer", id(conn)))] = (page.version, time.time())
        while len(readers) > MAX_READERS:
            del readers[min(readers, key=lambda r: readers[r][1])]
    server._send(conn, Command.DATA, ts, {
        "lineage": page.lineage, "version": page.version, "reset": page.reset,
        "cursor": page.cursor, "shard": list(table.shard), "dim": int(table.spec.dim),
        "dtype": page.rows.dtype.name},
        arrays=[page.removed, page.reasons, page.ids, page.rows])
    return None


def cmd_explain(server: Any, shard: Any, conn: Any, worker: int, ts: int,
                body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """What this shard of table ``key`` knows of one ID (``DynamicTable.explain``), as an
    ACK's body, answered at once."""
    table = shard.engine.table(body["key"], "explain an ID of", server._where())
    server._send(conn, Command.ACK, ts, {"explain": {**table.explain(body["id"]),
                                                     "shard": table.shard[0]}})
    return None


def cmd_hot_ids(server: Any, shard: Any, conn: Any, worker: int, ts: int,
                body: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """This shard's ``k`` most looked-up IDs of table ``key`` (H1-H3), answered at once."""
    table = shard.engine.table(body["key"], "read the hot IDs of", server._where())
    server._send(conn, Command.ACK, ts, {"hot": [list(p) for p in table.hot.top(body["k"])]})
    return None


def stats_reply(engine: Engine, ticket: Ticket) -> dict[str, Any]:
    """The body answering a ``table_stats`` ticket."""
    return {"stats": engine.table(ticket.keys[0], "read the stats of").stats()}
