"""What a server holds, read for its metrics when ``/metrics`` is scraped.

Read on the metrics thread while the serve loop runs: only copies (``list(dict...)``) of
what the loop changes are iterated, and nothing is changed. Nothing here runs on the hot
path: per-key pushes come from the counts each key keeps anyway (``_Entry.applied``).
"""
from __future__ import annotations

import time
from typing import Any

from ..durable._shards import Shards

__all__ = ["server_state"]


def server_state(shards: Shards) -> dict[str, Any]:
    """``keys`` held (key parts), ``waiting`` requests held for rounds, ``per_key``
    ``str(key) -> (pushes applied, bytes of the part held)``, ``tables`` ``str(key) ->
    stats`` (``DynamicTable.stats`` and ``bytes``, the arrays in use), ``streams``
    ``(key, shard, version, readers, lag in versions)`` per table shard, and ``backups`` ``(shard, backup, up, changes not acknowledged)``, over every
    shard this server serves (not the shards it only backs up: their pushes are counted by
    their primary)."""
    keys = waiting = 0
    per_key: dict[str, tuple[int, int]] = {}
    tables: dict[str, dict[str, int]] = {}
    streams: list[tuple[str, int, int, int, int]] = []
    backups = []
    for shard in list(shards.served.values()):
        engine = shard.engine
        keys += len(engine)
        for name, pushes, nbytes, table, held in engine.observed():
            waiting += held
            label = str(name)
            if table is not None:
                # bytes of the arrays in use (rows, states, IDs, metadata, index)
                stats = {**table.stats(), "bytes": sum(table.nbytes().values())}
                prev = tables.get(label)
                tables[label] = stats if prev is None else {
                    c: prev.get(c, 0) + v for c, v in stats.items()}
                # the change stream: this shard's version, its readers of the last minute
                # and how many versions the slowest of them is behind (E1-E10)
                now, version = time.time(), table.version
                seen = [v for v, at in list(table.readers.values()) if now - at <= 60.0]
                streams.append((label, table.shard[0], version, len(seen),
                                version - min(seen) if seen else 0))
            was = per_key.get(label, (0, 0))
            # a big key's parts: pushes count once (each part gets every push), bytes add
            per_key[label] = (max(was[0], pushes), was[1] + nbytes)
        repl = shard.replicator
        if repl is not None:
            backups.append((shard.index, repl.backup, repl.up, repl.pending))
    return {"keys": keys, "waiting": waiting, "per_key": per_key, "tables": tables,
            "streams": streams, "backups": backups}
