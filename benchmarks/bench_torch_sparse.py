"""Steps/s of an ``nn.Embedding(rows, dim, sparse=True)`` trained through
``pskv.torch.DistributedOptimizer``: its gradient as rows (``sparse_params``) against dense
(``sparse_as_dense=True``). An indication, not a benchmark run: it prints, writes nothing.

Usage (from the repository root)::

    python benchmarks/bench_torch_sparse.py                        # a local store
    pskv-launch -n 2 -s 1 python benchmarks/bench_torch_sparse.py --kv-store dist_sync
"""
from __future__ import annotations

import argparse
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Train each way for ``--steps`` steps (after 2 warm-up steps); print steps/s on rank 0."""
    import torch

    import pskv as mx
    import pskv.torch as pt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-store", default="local")
    ap.add_argument("--rows", type=int, default=2**20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024, help="IDs per worker per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dense-steps", type=int, default=8)
    args = ap.parse_args(argv)
    with mx.kv.create(args.kv_store) as kv:
        for mode, steps in (("sparse_params", args.steps), ("sparse_as_dense", args.dense_steps)):
            torch.manual_seed(0)
            emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
            kw = {"sparse_params": ["weight"]} if mode == "sparse_params" else \
                {"sparse_as_dense": True}
            opt = pt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                          emb.named_parameters(), kv, prefix=mode + "/", **kw)
            g = torch.Generator().manual_seed(kv.rank)
            start = 0.0
            for n in range(steps + 2):
                if n == 2:
                    start = time.perf_counter()
                ids = torch.randint(0, args.rows, (args.batch,), generator=g)
                opt.zero_grad()
                emb(ids).sum().backward()
                opt.step()
            rate = steps / (time.perf_counter() - start)
            opt.close()
            if kv.rank == 0:
                print(f"{args.kv_store}, {kv.num_workers} worker(s), nn.Embedding({args.rows}, "
                      f"{args.dim}), {args.batch} IDs/step, {mode}: {rate:.1f} steps/s",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
