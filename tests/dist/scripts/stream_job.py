"""A table job whose rank 0 also reads the change stream as a standalone reader.

Usage: stream_job.py OUT STEPS. Every worker trains table 'emb' (Capacity and TTL
eviction, AdaGrad); rank 0 opens ``pskv.stream.Reader.from_env()`` (no worker slot: the
scheduler admits it as a reader) and mirrors the stream every few steps. At the end rank 0
writes OUT/result.json: whether the mirror equals the servers' rows bit for bit, and what a
reader that tries to push or pull is told.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import pskv as mx
from pskv._ps.message import Command
from pskv.errors import KVStoreError
from pskv.stream import Reader
from pskv.table import TTL, Capacity, RowMirror, TableSpec, Uniform


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    kv = mx.kv.create("dist_sync")
    kv.init("emb", TableSpec(dim=8, init=Uniform(-0.1, 0.1), seed=3,
                             eviction=(Capacity(max_rows=300, policy="lru"), TTL(steps=8))))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.05))
    reader = Reader.from_env(timeout=30) if kv.rank == 0 else None
    sub = reader.subscribe("emb") if reader is not None else None
    mirror = RowMirror(8)
    rng = np.random.default_rng(kv.rank)
    for step in range(steps):
        ids = rng.integers(0, 1000, 64)
        kv.lookup("emb", ids)
        kv.push("emb", (ids, rng.standard_normal((64, 8)).astype(np.float32)))
        if sub is not None and step % 5 == 0:
            for b in sub.poll():
                mirror.apply(b)
    kv.barrier()
    if reader is not None:
        for b in sub.poll():
            mirror.apply(b)
        ids, rows = mirror.table()
        values, found = kv.lookup("emb", ids, train=False)
        refused = []
        from pskv._ps.partition import ps_key
        for cmd, body in ((Command.PULL, None),
                          (Command.COMMAND, {"op": "table_stats", "key": ps_key("emb")})):
            try:
                reader._call(reader._link(0)[0], reader._hosts[0], cmd, body)
                refused.append("answered")
            except KVStoreError as err:
                refused.append(type(err).__name__ + ": " + str(err)[:200])
        result = {"same": bool(found.all()) and rows.tobytes() == values.tobytes(),
                  "rows": int(ids.size), "stats_rows": kv.table_stats("emb")["rows"],
                  "versions": kv.table_versions("emb"), "reader_versions": reader.versions("emb"),
                  "mirror_versions": [mirror.version(s) for s in range(reader.num_servers)],
                  "refused": refused}
        reader.close()
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    kv.barrier()
    kv.close()


if __name__ == "__main__":
    main()
