"""A counting job with a table key read through pskv.data (docs/data.md, docs/embeddings.md).

Usage: train_data_table.py OUT EPOCHS [dist_sync|dist_async]. Each step a worker pulls the
dense key "w", looks up its samples' IDs in the table "emb" (a training lookup: rows are
born there), pushes gradient rows that depend on the rows and "w" (the table's own AdaGrad),
then pushes "w"'s gradient and ``-1`` for each of its samples to "seen" (the store's SGD of
rate 1: "seen" counts each sample's pushes). Every worker appends the steps it begins to
OUT/steps-<rank>-<restart>.txt; rank 0 writes "w", "seen" and an eval lookup of every ID to
OUT/final.npz. DIE_WORKER and DIE_STEP: that worker SIGKILLs itself on its first run in the
middle of that step, after its pushes and before the step's seal (DIE_AT=lookup: after
its lookup, before it pushed anything of the step). Servers die through
tests/durability/scripts/server.py (DIE_SERVER, DIE_AFTER).
"""
from __future__ import annotations

import os
import signal
import sys

import numpy as np

import pskv as mx
from pskv.table import Normal, TableSpec

N, BATCH, DIM, IDS = 60, 3, 4, 17


def ids_of(idx: np.ndarray) -> np.ndarray:
    """The samples' raw IDs: shared between samples, huge and negative."""
    return (idx % IDS).astype(np.int64) * 1_000_003 - 2**40


def main() -> None:
    out, epochs = sys.argv[1], int(sys.argv[2])
    store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
    restart = os.environ.get("PSKV_RESTART", "0")
    kv = mx.kv.create(store_type)
    kv.init("emb", TableSpec(dim=DIM, init=Normal(0.0, 0.1), seed=11,
                             optimizer=mx.optimizer.AdaGrad(learning_rate=0.1)))
    kv.init(["seen", "w"], [mx.nd.zeros(N), mx.nd.ones(DIM)])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    sampler = mx.data.Sampler(kv, N, BATCH, epochs=epochs, seed=5)
    die = restart == "0" and os.environ.get("DIE_WORKER") == str(kv.rank)
    w = mx.nd.zeros(DIM)
    with open(os.path.join(out, f"steps-{kv.rank}-{restart}.txt"), "w", buffering=1) as log:
        for idx in sampler:
            log.write(f"{sampler.step}\n")
            kv.pull("w", out=w)
            ids = ids_of(idx)
            rows, _found = kv.lookup("emb", ids)
            if die and sampler.step == int(os.environ["DIE_STEP"]) and \
                    os.environ.get("DIE_AT") == "lookup":
                os.kill(os.getpid(), signal.SIGKILL)       # nothing of the step left it
            wv = w.asnumpy()
            grads = (rows * wv * 0.1 + idx[:, None] / 100.0).astype(np.float32)
            seen = np.zeros(N, np.float32)
            np.add.at(seen, idx, -1.0)
            kv.push("emb", (ids, grads))
            kv.push(["seen", "w"], [mx.nd.array(seen), mx.nd.array(
                (rows.sum(0) * 0.01 + wv * 0.05).astype(np.float32))])
            if die and sampler.step == int(os.environ["DIE_STEP"]):
                os.kill(os.getpid(), signal.SIGKILL)
    kv.barrier()
    every = ids_of(np.arange(IDS))
    values, found = kv.lookup("emb", every, train=False)
    if kv.rank == 0:
        np.savez(os.path.join(out, "final.npz"), w=kv.pull("w").asnumpy(),
                 seen=kv.pull("seen").asnumpy(), emb=values, found=found)
    kv.barrier()
    kv.close()


if __name__ == "__main__":
    main()
