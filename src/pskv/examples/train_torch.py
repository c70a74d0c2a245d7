"""Train a small torch MLP on scikit-learn's digits, data-parallel over a pskv store.

    pskv-launch -n 2 -s 1 python -m pskv.examples.train_torch --kv-store dist_sync
    python -m pskv.examples.train_torch                      # one process, a local store

Each worker trains on its own shard of the training set. ``broadcast_parameters`` makes
every worker start from rank 0's weights; ``DistributedOptimizer`` averages the gradients
of all workers before each step (``--update-on-kvstore 1``: the servers run SGD and every
worker pulls the new weights). Needs ``pip install 'pskv[torch,examples]'``.
"""
from __future__ import annotations

import argparse
import zlib
from typing import Any, Sequence

import numpy as np

import pskv as mx

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pskv.examples.train_torch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-store", default="local", help="store type (default: local)")
    p.add_argument("--update-on-kvstore", type=int, choices=(0, 1), default=0,
                   help="1: the store's SGD updates the weights; 0: torch's SGD steps with "
                        "the averaged gradients (default)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps (0: no limit), for CI")
    return p


def _data(rank: int, num_workers: int) -> tuple[Any, Any, Any, Any]:
    """This worker's shard of the training set (the same size on every worker) and the
    whole test set, as torch tensors."""
    import torch
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.25, random_state=0,
        stratify=y)
    per = len(x_train) // num_workers          # equal shards: dist_sync needs every worker
    shard = slice(rank * per, (rank + 1) * per)  # in every round
    return (torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard]),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def _checksum(model: Any) -> int:
    """A CRC of every weight's bytes: equal on every worker when they are in sync."""
    crc = 0
    for t in model.state_dict().values():
        crc = zlib.crc32(t.detach().numpy().tobytes(), crc)
    return crc


def main(argv: Sequence[str] | None = None) -> int:
    """Train, print each epoch's loss and test accuracy; 0 if the accuracy is sensible
    (always 0 with --max-steps, which may stop before it is)."""
    import torch

    import pskv.torch as pt
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    kv: Any = mx.kv.create(args.kv_store)   # a LocalKVStore or DistKVStore
    try:
        x, y, x_test, y_test = _data(kv.rank, kv.num_workers)
        torch.manual_seed(kv.rank + 1)          # different on each worker: broadcast fixes it
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10))
        pt.broadcast_parameters(model.state_dict(), kv)
        if args.update_on_kvstore:
            opt = pt.DistributedOptimizer(
                None, model.named_parameters(), kv, update_on_kvstore=True,
                kv_optimizer=mx.optimizer.SGD(learning_rate=args.lr, momentum=args.momentum))
        else:
            opt = pt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
                model.named_parameters(), kv)
        steps, acc = 0, 0.0
        gen = torch.Generator().manual_seed(1000 + kv.rank)
        for epoch in range(args.epochs):
            order = torch.randperm(len(x), generator=gen)
            total, batches = 0.0, 0
            for start in range(0, len(x) - args.batch_size + 1, args.batch_size):
                idx = order[start:start + args.batch_size]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                total, batches, steps = total + loss.item(), batches + 1, steps + 1
                if steps == args.max_steps:
                    break
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            if kv.rank == 0:
                print(f"epoch {epoch}: loss {total / max(batches, 1):.4f}, "
                      f"test accuracy {acc:.4f}", flush=True)
            if steps == args.max_steps:
                break
        print(f"worker {kv.rank}/{kv.num_workers}: steps {steps}, test accuracy {acc:.4f}, "
              f"weights crc {_checksum(model):08x}", flush=True)
    finally:
        kv.close()
    return 0 if acc > 0.5 or args.max_steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
