"""A training job with dense keys and a table, for servers added and removed while it runs.

Usage: train_reshard.py OUT STEPS [dist_sync|dist_async]. Every step each worker pushes a
deterministic gradient to dense keys (one big enough to be cut across the servers, small
ones placed whole) and looks up, then pushes, a deterministic batch of table IDs (new ones
every step, and repeats). dist_sync trains with AdaGrad (optimizer states matter);
dist_async with SGD at learning rate -1 on ones (each value counts the pushes the servers
applied, in any order). Rank 0 writes OUT/progress (the last step begun) as it goes, and at
the end OUT/result.npz: every dense key and every table row the job used, with the
optimizer's states; each worker writes OUT/steps-<rank>.json (each step's seconds).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import pskv as mx
from pskv.table import TableSpec, Zeros

SHAPES = {"big": (6000,), "mid": (30, 20), "n": (3,)}
DIM = 8


def ids_of(step: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([step, rank])
    fresh = np.arange(3, dtype=np.int64) + 1000 * step + 100 * rank
    return np.concatenate([rng.integers(0, 300, 20), fresh]).astype(np.int64)


def grad(step: int, rank: int, shape: tuple[int, ...], count: bool, salt: int) -> np.ndarray:
    if count:
        return np.ones(shape, np.float32)
    return np.random.default_rng([step, rank, salt]).standard_normal(shape).astype(np.float32)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
    pause = float(os.environ.get("STEP_SLEEP", "0.02"))
    count = store_type == "dist_async"
    kv = mx.kv.create(store_type)
    keys = sorted(SHAPES)
    kv.init(keys, [mx.nd.zeros(SHAPES[k]) for k in keys])
    kv.init("emb", TableSpec(dim=DIM, init=Zeros(), seed=3))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=-1.0) if count
                     else mx.optimizer.AdaGrad(learning_rate=0.05))
    outs = {k: mx.nd.zeros(SHAPES[k]) for k in keys}
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if kv.rank == 0:
            with open(os.path.join(out, "progress.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(out, "progress.tmp"), os.path.join(out, "progress"))
        kv.push(keys, [mx.nd.array(grad(step, kv.rank, SHAPES[k], count, i))
                       for i, k in enumerate(keys)])
        ids = ids_of(step, kv.rank)
        kv.lookup("emb", ids)
        kv.push("emb", (ids, grad(step, kv.rank, (len(ids), DIM), count, 9)))
        kv.pull(keys, out=[outs[k] for k in keys])
        times.append(time.perf_counter() - t0)
        time.sleep(pause)
    every = np.unique(np.concatenate([ids_of(s, r) for s in range(steps)
                                      for r in range(kv.num_workers)]))
    kv.pull(keys, out=[outs[k] for k in keys])     # after this worker's last pushes
    kv.barrier()
    kv.pull(keys, out=[outs[k] for k in keys])     # after every worker's
    rows, found = kv.lookup("emb", every, train=False)
    kv.barrier()
    if kv.rank == 0:
        np.savez(os.path.join(out, "result.npz"), ids=every, rows=rows, found=found,
                 **{k: outs[k].asnumpy() for k in keys})
    with open(os.path.join(out, f"steps-{kv.rank}.json"), "w") as f:
        json.dump(times, f)
    kv.close()


if __name__ == "__main__":
    main()
