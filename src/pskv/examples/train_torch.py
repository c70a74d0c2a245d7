"""Train a small torch MLP on scikit-learn's digits, data-parallel over a pskv store.

    pskv-launch -n 2 -s 1 python -m pskv.examples.train_torch --kv-store dist_sync
    python -m pskv.examples.train_torch                      # one process, a local store
    python -m pskv.examples.train_torch --device cuda        # the model on the GPU

Each worker trains on its own shard of the training set, ``--batch-size`` samples per
step. ``broadcast_parameters`` makes every worker start from rank 0's weights;
``DistributedOptimizer`` averages the gradients of all workers before each step
(``--update-on-kvstore 1``: the servers run SGD and every worker pulls the new weights).
The flags and the output are those of ``python -m pskv.examples.train``. Needs
``pip install 'pskv[torch,examples]'``.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import pskv as mx

from . import _cli
from ._report import Progress, epoch_line, plot_curves, plural, run_title, summary_line
from .train import EpochStats, TrainResult

__all__ = ["build_parser", "main", "parse_args", "train"]

#: the modules this example needs beyond pskv
_EXTRAS = ("torch", "sklearn", "tqdm", "matplotlib")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pskv.examples.train_torch`` (the shared flags)."""
    p = _cli.build_parser(
        "python -m pskv.examples.train_torch",
        "Train a torch MLP on scikit-learn's digits, data-parallel through a pskv KVStore "
        "with pskv.torch.DistributedOptimizer.",
        epochs=10, batch_size=32, lr=0.1, update_on_kvstore=0)
    p.add_argument("--momentum", type=_cli.nonnegative_float, default=0.9,
                   help="SGD momentum (default: 0.9)")
    p.add_argument("--device", type=_device, default="cpu",
                   help="where the model and the data live: cpu, cuda or cuda:N; the store "
                        "copies gradients through pinned host buffers (docs/gpu.md) "
                        "(default: cpu)")
    return p


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad ones exit with status 2 and a message (argparse)."""
    return _cli.parse_checked(build_parser(), argv)


def _data(rank: int, num_workers: int, seed: int) -> dict[str, Any]:
    """This worker's shard of the training set (the same size on every worker: dist_sync
    needs every worker in every round), the whole training set and the test set, as torch
    tensors."""
    import torch
    from sklearn.datasets import load_digits  # type: ignore[import-untyped, unused-ignore]
    from sklearn.model_selection import (  # type: ignore[import-untyped, unused-ignore]
        train_test_split)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.25,
        random_state=seed, stratify=y)
    per = len(x_train) // num_workers
    mine = slice(rank * per, (rank + 1) * per)
    t = torch.from_numpy
    return {"x": t(x_train[mine]), "y": t(y_train[mine]), "x_train": t(x_train),
            "y_train": t(y_train), "x_test": t(x_test), "y_test": t(y_test)}


def train(args: argparse.Namespace, kv: Any,
          on_epoch: Callable[[EpochStats], None] | None = None) -> TrainResult:
    """Train with the flags ``args`` (from :func:`parse_args`) through the store ``kv``.

    Every worker of a cluster calls it with the same flags; the caller creates and closes
    the store. Shows progress on rank 0 unless ``args.quiet``; calls ``on_epoch`` after
    each epoch with the training loss over the whole training set and the test accuracy
    (both the same on every worker of a ``dist_sync`` run: the weights are).

    Returns
    -------
    TrainResult
        The final weights (NumPy, by ``state_dict`` name) and the per-epoch history.
    """
    import torch

    import pskv.torch as pt
    start = time.perf_counter()
    rank, num_workers = kv.rank, kv.num_workers
    d = _data(rank, num_workers, args.seed)
    if args.device != "cpu":
        d = {k: v.to(args.device) for k, v in d.items()}
    torch.manual_seed(args.seed + rank + 1)    # different on each worker: broadcast fixes it
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(args.device)
    pt.broadcast_parameters(model.state_dict(), kv)
    opt: Any        # the torch optimizer's class plus DistributedOptimizer's methods
    if args.update_on_kvstore:
        opt = pt.DistributedOptimizer(
            None, model.named_parameters(), kv, update_on_kvstore=True,
            kv_optimizer=mx.optimizer.SGD(learning_rate=args.lr, momentum=args.momentum))
    else:
        opt = pt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
            model.named_parameters(), kv)
    loss_fn = torch.nn.functional.cross_entropy
    result = TrainResult(weights={})
    gen = torch.Generator().manual_seed(1000 * (args.seed + 1) + rank)
    show = rank == 0 and not args.quiet
    x, y, bs = d["x"], d["y"], args.batch_size
    for epoch in range(args.epochs):
        if args.max_steps is not None and result.steps >= args.max_steps:
            break
        order = torch.randperm(len(x), generator=gen).to(args.device)
        starts = list(range(0, len(x) - bs + 1, bs))   # whole batches: every worker steps
        if args.max_steps is not None:
            starts = starts[:args.max_steps - result.steps]
        bar = Progress(len(starts), f"epoch {epoch + 1}/{args.epochs}", show)
        t_epoch = time.perf_counter()
        comm = 0.0
        for first in starts:
            idx = order[first:first + bs]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            t_comm = time.perf_counter()
            opt.synchronize()                     # push/pull: the workers' average gradient
            comm += time.perf_counter() - t_comm
            with opt.skip_synchronize():
                opt.step()
            result.steps += 1
            bar.update()
        seconds = time.perf_counter() - t_epoch
        bar.close()
        with torch.no_grad():
            loss = loss_fn(model(d["x_train"]), d["y_train"]).item()
            acc = (model(d["x_test"]).argmax(1) == d["y_test"]).float().mean().item()
        samples = len(starts) * bs * num_workers
        stats = EpochStats(epoch=epoch + 1, steps=len(starts), loss=loss, accuracy=acc,
                           seconds=seconds,
                           samples_per_sec=samples / seconds if seconds > 0 else 0.0,
                           comm_share=comm / seconds if seconds > 0 else 0.0)
        result.history.append(stats)
        result.comm_seconds += comm
        result.train_seconds += seconds
        if on_epoch is not None:
            on_epoch(stats)
    result.weights = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    result.seconds = time.perf_counter() - start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Train and print as ``pskv.examples.train`` does; 0 if the test accuracy ends above
    0.5 (always 0 with ``--max-steps``, which may stop before it does), 2 for bad flags, a
    store that cannot start or a missing extra."""
    args = parse_args(argv)
    try:
        kv: Any = mx.kv.create(args.kv_store)   # a LocalKVStore or DistKVStore
    except mx.KVStoreError as err:
        print(f"train_torch: cannot create a {args.kv_store!r} store: {err}", file=sys.stderr)
        return 2
    try:
        import torch
        torch.set_num_threads(1)
        if args.device != "cpu" and not (torch.cuda.is_available() and int(
                args.device.partition(":")[2] or 0) < torch.cuda.device_count()):
            print(f"train_torch: --device {args.device}: this process sees "
                  f"{torch.cuda.device_count()} CUDA device(s). Use --device cpu, or run "
                  "where the GPU is visible.", file=sys.stderr)
            return 2
        rank, num_workers = kv.rank, kv.num_workers
        report = None
        if rank == 0 and not args.quiet:
            print(f"training a 64-64-10 torch MLP on digits: {kv.type}, "
                  f"{plural(num_workers, 'worker')}, batch {args.batch_size} per worker, "
                  f"sgd lr {args.lr:g}, update_on_kvstore={args.update_on_kvstore}, "
                  f"model on {args.device}",
                  flush=True)

            def report(s: EpochStats) -> None:
                print(epoch_line(s.epoch, args.epochs, s.loss, "accuracy", s.accuracy,
                                 s.samples_per_sec, s.comm_share), flush=True)
        result = train(args, kv, on_epoch=report)
        if rank == 0 and args.plot and result.history:
            h = result.history
            plot_curves(args.plot, [s.epoch for s in h], [s.loss for s in h], "accuracy",
                        [s.accuracy for s in h],
                        run_title("digits torch MLP", kv.type, num_workers, args.batch_size,
                                  args.lr, args.epochs))
    except ModuleNotFoundError as err:
        if err.name not in _EXTRAS:
            raise
        print(f"train_torch: this example needs {err.name!r}, which is not installed. "
              "Install the extras: pip install 'pskv[torch,examples]'.", file=sys.stderr)
        return 2
    finally:
        kv.close()
    h = result.history
    samples = sum(s.samples_per_sec * s.seconds for s in h)
    rate = samples / result.train_seconds if result.train_seconds > 0 else 0.0
    share = result.comm_seconds / result.train_seconds if result.train_seconds > 0 else 0.0
    extra = [f"curves in {args.plot}"] if rank == 0 and args.plot else []
    print(summary_line(rank, num_workers, "accuracy", result.accuracy,
                       h[-1].loss if h else float("nan"), len(h), result.steps,
                       result.seconds, rate, share, extra), flush=True)
    return 0 if result.accuracy > 0.5 or args.max_steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
