"""Data-parallel training of a NumPy MLP on scikit-learn's digits, through a KVStore.

Run it in one process, or on a parameter server with the launcher::

    python -m pskv.examples.train --kv-store local
    pskv-launch -n 2 -s 1 python -m pskv.examples.train --kv-store dist_sync

Every worker sees the same shuffled order each epoch and takes its contiguous shard of each
global batch of ``num_workers * batch_size`` samples. Each device pushes the sum of its
samples' gradients divided by the global batch size, so the store's sum is the gradient of
the mean loss over the global batch (the optimizer's ``rescale_grad`` stays 1). With the
same seed, ``dist_sync`` over W workers with batch b thus trains the same weights as one
process with batch W*b. In ``dist_async`` each push is applied on its own, so there each
worker divides by its own shard's size. See ``docs/training.md``.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

import pskv as mx

from . import _cli, _mlp
from ._data import global_batches, load_digits, shard
from ._report import Progress, epoch_line, plot_curves as _plot, plural, run_title, \
    summary_line

__all__ = ["EpochStats", "TrainResult", "build_parser", "main", "make_optimizer",
           "parse_args", "plot_curves", "train"]

STORE_TYPES = _cli.STORE_TYPES
#: the modules of the ``examples`` extra
_EXTRAS = ("sklearn", "tqdm", "matplotlib")
#: optimizers whose default learning rate is 0.05; the others default to 0.01
_SGD_LIKE = ("sgd", "nag")


@dataclass
class EpochStats:
    """What one epoch did, as measured on this worker.

    ``loss`` is the mean cross-entropy over the whole training set and ``accuracy`` the
    test accuracy, both with the weights at the end of the epoch. ``samples_per_sec``
    counts the samples of every worker (global batches per second of training time), and
    ``comm_share`` is the share of the training time spent in push/pull.
    """

    epoch: int
    steps: int
    loss: float
    accuracy: float
    seconds: float
    samples_per_sec: float
    comm_share: float


@dataclass
class TrainResult:
    """The final weights (NumPy, by parameter name) and the per-epoch history."""

    weights: dict[str, np.ndarray]
    history: list[EpochStats] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    comm_seconds: float = 0.0
    train_seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        """The test accuracy after the last epoch (0.0 before any)."""
        return self.history[-1].accuracy if self.history else 0.0


# ---- command line --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pskv.examples.train`` (the shared flags, then its own)."""
    p = _cli.build_parser(
        "python -m pskv.examples.train",
        "Train a NumPy MLP on scikit-learn's digits, data-parallel through a pskv KVStore. "
        "Under pskv-launch each worker trains on its shard of every batch.",
        epochs=10, batch_size=32, lr=None, update_on_kvstore=1,
        lr_help="learning rate (default: 0.05 for sgd and nag, 0.01 otherwise)")
    p.add_argument("--momentum", type=_cli.nonnegative_float, default=0.9,
                   help="momentum, for optimizers that take one (default: 0.9)")
    p.add_argument("--wd", type=_cli.nonnegative_float, default=0.0,
                   help="weight decay (default: 0)")
    p.add_argument("--optimizer", default="sgd",
                   help="any registered pskv optimizer: sgd, nag, adam, rmsprop, adagrad, ... "
                        "(default: sgd)")
    p.add_argument("--hidden", type=_cli.positive_int, default=128,
                   help="hidden units (default: 128)")
    p.add_argument("--num-devices", type=_cli.positive_int, default=1,
                   help="devices per worker (mx.cpu(i)); each computes the gradient of its "
                        "part of the shard and the store sums them (default: 1)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad ones exit with status 2 and a message (argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.optimizer = args.optimizer.lower()
    if args.optimizer not in mx.optimizer.Optimizer.opt_registry:
        parser.error(f"argument --optimizer: unknown optimizer {args.optimizer!r}; choose "
                     f"from {', '.join(sorted(mx.optimizer.Optimizer.opt_registry))}")
    _cli.check_args(parser, args)
    if args.lr is None:
        args.lr = 0.05 if args.optimizer in _SGD_LIKE else 0.01
    return args


def make_optimizer(args: argparse.Namespace) -> mx.optimizer.Optimizer:
    """The optimizer the flags describe (``rescale_grad`` 1: gradients come pre-scaled)."""
    klass = mx.optimizer.Optimizer.opt_registry[args.optimizer]
    kwargs: dict[str, Any] = {"learning_rate": args.lr, "wd": args.wd}
    if "momentum" in inspect.signature(klass.__init__).parameters:
        kwargs["momentum"] = args.momentum
    return mx.optimizer.create(args.optimizer, **kwargs)


# ---- training ----------------------------------------------------------------------------------
def train(args: argparse.Namespace, kv: mx.kv.LocalKVStore,
          on_epoch: Callable[[EpochStats], None] | None = None) -> TrainResult:
    """Train with the flags ``args`` (from :func:`parse_args`) through the store ``kv``.

    Every worker of a cluster calls it with the same flags. The caller creates and closes
    the store. Shows a progress bar on rank 0 unless ``args.quiet``; calls ``on_epoch``
    after each epoch.

    Parameters
    ----------
    args : argparse.Namespace
        The flags, as :func:`parse_args` returns them.
    kv : pskv.kv.LocalKVStore
        A local store or a worker's ``DistKVStore`` (a subclass); its keys are the
        parameter names.
    on_epoch : callable, optional
        Called with each epoch's :class:`EpochStats`.

    Returns
    -------
    TrainResult
        The final weights (pulled from the store) and the per-epoch history.
    """
    start = time.perf_counter()
    rank, num_workers = kv.rank, kv.num_workers
    sync = "async" not in kv.type
    data = load_digits(args.seed)
    ctxs = [mx.cpu(i) for i in range(args.num_devices)]
    names = list(_mlp.PARAM_NAMES)

    # every worker initializes differently; init keeps rank 0's values and everyone pulls
    init = _mlp.init_params(data.num_features, args.hidden, data.num_classes, args.seed + rank)
    weights = {n: [mx.nd.array(init[n], ctx=c) for c in ctxs] for n in names}
    kv.init(names, [weights[n][0] for n in names])
    updater = None
    summed: dict[str, Any] = {}
    if args.update_on_kvstore:
        kv.set_optimizer(make_optimizer(args))
    else:
        # MXNet's Module / gluon.Trainer with update_on_kvstore=False: the store sums the
        # gradients, every worker runs the same optimizer on the same sums
        updater = mx.optimizer.get_updater(make_optimizer(args))
        summed = {n: mx.nd.zeros(init[n].shape, ctxs[0]) for n in names}
    kv.pull(names, out=[weights[n] for n in names])

    result = TrainResult(weights={})
    global_batch = args.batch_size * num_workers
    show = rank == 0 and not args.quiet
    for epoch in range(args.epochs):
        if args.max_steps is not None and result.steps >= args.max_steps:
            break
        batches = list(global_batches(len(data.x_train), global_batch, args.seed, epoch))
        if args.max_steps is not None:
            batches = batches[:args.max_steps - result.steps]
        bar = Progress(len(batches), f"epoch {epoch + 1}/{args.epochs}", show)
        t_epoch = time.perf_counter()
        comm = 0.0
        samples = 0
        for batch in batches:
            mine = shard(batch, rank, num_workers)
            divisor = len(batch) if sync else len(mine)
            samples += len(batch)
            if divisor == 0:        # async only: this worker has no samples in a short batch
                continue
            params = {n: weights[n][0].asnumpy() for n in names}
            grads: dict[str, list[Any]] = {n: [] for n in names}
            for ctx, part in zip(ctxs, np.array_split(mine, len(ctxs)), strict=True):
                g, _ = _mlp.gradients(params, data.x_train[part], data.y_train[part], divisor)
                for n in names:
                    grads[n].append(mx.nd.array(g[n], ctx=ctx))
            t_comm = time.perf_counter()
            if updater is None:
                kv.pushpull(names, [grads[n] for n in names], out=[weights[n] for n in names])
            else:
                kv.pushpull(names, [grads[n] for n in names], out=[summed[n] for n in names])
            comm += time.perf_counter() - t_comm
            if updater is not None:
                for n in names:
                    updater(n, summed[n], weights[n][0])
                    for w in weights[n][1:]:
                        w[:] = weights[n][0]
            result.steps += 1
            bar.update()
        seconds = time.perf_counter() - t_epoch
        bar.close()
        params = {n: weights[n][0].asnumpy() for n in names}
        stats = EpochStats(
            epoch=epoch + 1, steps=len(batches),
            loss=_mlp.loss(params, data.x_train, data.y_train),
            accuracy=_mlp.accuracy(params, data.x_test, data.y_test), seconds=seconds,
            samples_per_sec=samples / seconds if seconds > 0 else 0.0,
            comm_share=comm / seconds if seconds > 0 else 0.0)
        result.history.append(stats)
        result.comm_seconds += comm
        result.train_seconds += seconds
        if on_epoch is not None:
            on_epoch(stats)
    # the store's weights: the last round's in dist_sync, the latest in dist_async
    if updater is None:
        kv.pull(names, out=[weights[n] for n in names])
    result.weights = {n: weights[n][0].asnumpy() for n in names}
    result.seconds = time.perf_counter() - start
    return result


# ---- output ---------------------------------------------------------------------------------
def plot_curves(history: Sequence[EpochStats], path: str, title: str = "digits MLP") -> None:
    """Save the per-epoch training loss and test accuracy (axis 0 to 1) as two panels in
    the image ``path``, under the title ``title`` (the run's settings, from :func:`main`).

    Uses matplotlib's Agg canvas directly, so no GUI backend or global state is touched.
    """
    _plot(path, [s.epoch for s in history], [s.loss for s in history], "accuracy",
          [s.accuracy for s in history], title)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; 0 on success, 2 for bad flags or a store that cannot start."""
    args = parse_args(argv)
    try:
        # every type STORE_TYPES names is a LocalKVStore or its DistKVStore subclass
        kv = cast(mx.kv.LocalKVStore, mx.kv.create(args.kv_store))
    except mx.KVStoreError as err:
        print(f"train: cannot create a {args.kv_store!r} store: {err}", file=sys.stderr)
        return 2
    try:
        rank, num_workers = kv.rank, kv.num_workers
        report = None
        if rank == 0 and not args.quiet:
            print(f"training a 64-{args.hidden}-10 MLP on digits: {kv.type}, "
                  f"{plural(num_workers, 'worker')} x {plural(args.num_devices, 'device')}, "
                  f"batch {args.batch_size} per worker, {args.optimizer} lr {args.lr:g}, "
                  f"update_on_kvstore={args.update_on_kvstore}", flush=True)

            def report(s: EpochStats) -> None:
                print(epoch_line(s.epoch, args.epochs, s.loss, "accuracy", s.accuracy,
                                 s.samples_per_sec, s.comm_share), flush=True)
        result = train(args, kv, on_epoch=report)
        if rank == 0 and args.plot and result.history:
            plot_curves(result.history, args.plot, run_title(
                "digits MLP", kv.type, num_workers, args.batch_size, args.lr, args.epochs))
    except ModuleNotFoundError as err:
        if err.name not in _EXTRAS:
            raise
        print(f"train: this example needs {err.name!r}, which is not installed. Install the "
              "examples extra: pip install 'pskv[examples]'.", file=sys.stderr)
        return 2
    finally:
        kv.close()
    total_samples = sum(s.samples_per_sec * s.seconds for s in result.history)
    rate = total_samples / result.train_seconds if result.train_seconds > 0 else 0.0
    share = result.comm_seconds / result.train_seconds if result.train_seconds > 0 else 0.0
    last_loss = result.history[-1].loss if result.history else float("nan")
    extra = [f"curves in {args.plot}"] if rank == 0 and args.plot else []
    print(summary_line(rank, num_workers, "accuracy", result.accuracy, last_loss,
                       len(result.history), result.steps, result.seconds, rate, share,
                       extra), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
