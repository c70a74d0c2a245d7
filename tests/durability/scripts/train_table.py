"""A small table training job for the durability tests (docs/embeddings.md on the servers).

Usage: train_table.py OUT STEPS [dist_sync|dist_async]. Every step each worker looks up a
deterministic batch of IDs (new ones every step, repeats, huge and negative ones) and pushes
a gradient row for each through AdaGrad. Rank 0 writes an eval lookup of every ID the job
used, and the table's counters, to OUT/table.npz. With SAVE_TO set, the job ends with
``kv.save_checkpoint(SAVE_TO)``; with LOAD_FROM set, it loads that checkpoint right after
init and trains STEPS more steps (numbered after the saved ones: START_STEP). With COUNT=1
the table starts at zeros and every push adds ones (SGD with learning rate -1), so each row
ends as the number of times its ID was pushed: a count of the pushes the servers applied.
DTYPE sets the table's storage dtype (default float32; float16 or bfloat16: R17). With
STREAM=1 (or STREAM=reader: a ``pskv.stream.Reader``) rank 0 follows the table's change stream every 10 steps into a RowMirror (E1-E10)
and writes the mirror's rows (OUT/mirror.npz) and how many of its batches after the first
read were resets (``stream_resets`` in stats.json: a failover must continue the stream).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import pskv as mx
from pskv.table import Normal, RowMirror, TableSpec, Zeros

DIM = 8


def batch(step: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([step, rank])
    fresh = np.arange(4) + 1000 * step + 100 * rank            # new IDs every step
    return np.concatenate([rng.integers(-200, 200, 24), fresh,
                           [2**62 + step % 5, -(2**63)]]).astype(np.int64)


def looked_at(step: int, rank: int) -> np.ndarray:
    """IDs only looked up (once each, never pushed): their rows are born by the lookup."""
    return np.arange(3, dtype=np.int64) + 10**7 + 100 * step + 10 * rank


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
    start = int(os.environ.get("START_STEP", "0"))
    kv = mx.kv.create(store_type)
    count = os.environ.get("COUNT") == "1"
    kv.init("emb", TableSpec(dim=DIM, init=Zeros() if count else Normal(0.0, 0.1), seed=5,
                             dtype=os.environ.get("DTYPE", "float32")))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=-1.0) if count else
                     mx.optimizer.AdaGrad(learning_rate=0.05))
    if os.environ.get("LOAD_FROM"):
        kv.load_checkpoint(os.environ["LOAD_FROM"])
    sub = None
    if os.environ.get("STREAM") == "1" and kv.rank == 0:
        sub = kv.subscribe("emb")
    elif os.environ.get("STREAM") == "reader" and kv.rank == 0:   # no worker slot
        from pskv.stream import Reader
        sub = Reader.from_env(timeout=60).subscribe("emb")
    mirror, resets, polls = RowMirror(DIM), 0, 0

    def follow() -> None:
        nonlocal resets, polls
        for b in sub.poll():
            resets += int(b.reset and polls > 0)
            mirror.apply(b)
        polls += 1
    for step in range(start, start + steps):
        if sub is not None and step % 10 == 0:
            follow()
        ids = batch(step, kv.rank)
        rows, _found = kv.lookup("emb", ids)
        grad = np.ones(rows.shape, np.float32) if count else \
            (rows * 0.5 + np.random.default_rng([step, kv.rank, 7]).standard_normal(
                rows.shape)).astype(np.float32)
        kv.push("emb", (ids, grad))
        kv.lookup("emb", looked_at(step, kv.rank))
        time.sleep(0.01)
    every = np.unique(np.concatenate([f(s, r) for s in range(start + steps)
                                      for r in range(kv.num_workers)
                                      for f in (batch, looked_at)]))
    kv.lookup("emb", every[:1], train=False)      # after this worker's last round
    kv.barrier()
    values, found = kv.lookup("emb", every, train=False)
    kv.barrier()
    stats = kv.table_stats("emb")
    if sub is not None:
        follow()
        stats["stream_resets"] = resets
        ids, rows = mirror.table()
        np.savez(os.path.join(out, "mirror.npz"), ids=ids, rows=rows)
    if kv.rank == 0:
        np.savez(os.path.join(out, "table.npz"), ids=every, values=values, found=found)
        with open(os.path.join(out, "stats.json"), "w") as f:
            json.dump(stats, f)
    if os.environ.get("SAVE_TO"):
        kv.save_checkpoint(os.environ["SAVE_TO"])
    kv.close()


if __name__ == "__main__":
    main()
