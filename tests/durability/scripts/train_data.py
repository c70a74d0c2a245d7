"""A pskv.torch job reading a counting data set through pskv.data (docs/data.md).

Usage: train_data.py OUT EPOCHS [dist_sync|dist_async]. A small MLP trains with
``DistributedOptimizer(update_on_kvstore=True)`` (SGD with momentum on the servers) on
``N`` samples; each step also pushes ``-1`` for each of its samples to the key "seen".
Every worker appends the steps it begins to OUT/steps-<rank>-<restart>.txt; rank 0 writes
the weights, "seen" and the optimizer states to OUT/final.npz. With DIE_WORKER and
DIE_STEP set, that worker SIGKILLs itself on its first run in the middle of that step,
after backward has pushed its buckets and before the step's seal. PACE: seconds to sleep
each step (room for outside kills).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch

import pskv as mx
import pskv.torch as pt

N, BATCH, FEATURES = 96, 4, 6
LOSS_SCALE = {"dist_sync": 1.0, "dist_async": 0.01}


def main() -> None:
    out, epochs = sys.argv[1], int(sys.argv[2])
    store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
    restart = os.environ.get("PSKV_RESTART", "0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1))
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.standard_normal((N, FEATURES)), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((N, 1)), dtype=torch.float32)
    ds = torch.utils.data.TensorDataset(x, y, torch.arange(N))
    kv = mx.kv.create(store_type)
    opt = pt.DistributedOptimizer(
        None, model.named_parameters(), kv, update_on_kvstore=True,
        # dist_async: plain SGD of rate 1, so "seen" counts each sample's pushes exactly
        kv_optimizer=mx.optimizer.SGD(learning_rate=0.05, momentum=0.9)
        if store_type == "dist_sync" else mx.optimizer.SGD(learning_rate=1.0),
        bucket_cap_mb=0.00005)                # several buckets: a step is several pushes
    kv.init("seen", mx.nd.zeros(N))
    sampler = mx.data.Sampler(kv, N, BATCH, epochs=epochs, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    die = restart == "0" and os.environ.get("DIE_WORKER") == str(kv.rank)
    pace = float(os.environ.get("PACE", "0"))
    with open(os.path.join(out, f"steps-{kv.rank}-{restart}.txt"), "w", buffering=1) as log:
        for xb, yb, ib in sampler.follow(loader):
            log.write(f"{sampler.step}\n")
            loss = torch.nn.functional.mse_loss(model(xb), yb) * LOSS_SCALE[store_type]
            opt.zero_grad()
            loss.backward()
            seen = np.zeros(N, np.float32)
            seen[ib.numpy()] = -1.0
            kv.push("seen", mx.nd.array(seen))
            if die and sampler.step == int(os.environ["DIE_STEP"]):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            if pace:
                time.sleep(pace)
    kv.barrier()
    if kv.rank == 0:
        keys = sorted(k for k in kv._store if k != "seen") + ["seen"]
        values = {}
        for k in keys:
            v = kv.pull(k)
            values[f"value:{k}"] = v.numpy() if isinstance(v, torch.Tensor) else v.asnumpy()
        kv.save_optimizer_states(os.path.join(out, "states.bin"))
        np.savez(os.path.join(out, "final.npz"), **values)
    kv.close()


if __name__ == "__main__":
    main()
