"""A CTR model as docs/embeddings.md writes it (two tables with their own AdaGrad, an MLP
through DistributedOptimizer) on uneven data: worker r takes 12 + 7 r batches, then joins.
Prints, per worker, the last joiner and checksums of the MLP and of both tables' rows for a
fixed set of IDs (read without inserting), so the test can compare the workers."""
from __future__ import annotations

import sys

import numpy as np
import torch

import pskv as mx
import pskv.torch as pt
from pskv.table import Normal, TableSpec


def main() -> int:
    kv = mx.kv.create(sys.argv[1])
    row_opt = lambda: mx.optimizer.AdaGrad(learning_rate=0.1,  # noqa: E731
                                           rescale_grad=1.0 / kv.num_workers)
    users = pt.Embedding(kv, "users", TableSpec(dim=8, init=Normal(0, 0.1), seed=1,
                                                optimizer=row_opt()))
    items = pt.Embedding(kv, "items", TableSpec(dim=8, init=Normal(0, 0.1), seed=2,
                                                optimizer=row_opt()))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.05),
                                  mlp.named_parameters(), kv)
    g = torch.Generator().manual_seed(100 + kv.rank)
    for _ in range(12 + 7 * kv.rank):
        user = torch.randint(0, 50, (32,), generator=g)
        item = torch.randint(0, 20, (32,), generator=g)
        click = ((user + item) % 3 == 0).float()
        opt.zero_grad()
        x = torch.cat([users(user - 2**40), items(item + 2**50)], dim=1)
        torch.nn.functional.binary_cross_entropy_with_logits(mlp(x).squeeze(1), click).backward()
        opt.step()
    last = opt.join()
    kv._barrier()                     # every worker's last pushes are in before the reads
    mlp_sum = float(sum(p.detach().double().sum() for p in mlp.parameters()))
    u, _ = kv.lookup("users", np.arange(50, dtype=np.int64) - 2**40, train=False)
    i, _ = kv.lookup("items", np.arange(20, dtype=np.int64) + 2**50, train=False)
    print(f"RESULT rank={kv.rank} last={last} mlp={mlp_sum!r} "
          f"users={float(np.asarray(u, np.float64).sum())!r} "
          f"items={float(np.asarray(i, np.float64).sum())!r}", flush=True)
    for module in (users, items, opt):
        module.close()
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
