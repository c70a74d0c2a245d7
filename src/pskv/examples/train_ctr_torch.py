"""The CTR model of ``train_ctr`` in PyTorch: the table trained by its own row optimizer on
the store, the MLP by a torch optimizer through ``pskv.torch.DistributedOptimizer``.

The same click log, table, model and flags as ``python -m pskv.examples.train_ctr`` (see
its docstring), with the model written in torch: ``pskv.torch.Embedding`` over the table
key ``'emb'`` (``TableSpec(..., optimizer=...)``: the ``--optimizer`` of the store's rows),
and an ``nn.Module`` MLP whose gradients ``DistributedOptimizer`` sums over the workers
before the torch optimizer of the same name (``torch.optim.Adagrad``, ``Adam`` or ``SGD``,
at ``--lr``) steps it. The store has no optimizer of its own: it would run on the
DistributedOptimizer's gradient keys too (refused, docs/embeddings.md "PyTorch").
"push/pull" on the lines is the time in the Embedding's forward (it waits for the last
push, then looks up) and in ``step()`` (it waits for the MLP's gradients).
Each worker's loss is its part of the global batch's mean (sum over its samples divided
by the global batch), so the table's pushes, summed by the servers, and the MLP's
gradients, summed by ``op='sum'``, are the global batch's. Needs ``pip install
'pskv[torch]'``::

    python -m pskv.examples.train_ctr_torch
    pskv-launch -n 2 -s 2 python -m pskv.examples.train_ctr_torch --kv-store dist_sync
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import pskv as mx

from . import _cli
from ._clicklog import FIELDS, ClickLog
from ._report import Progress, plural, run_title, summary_line
from .sparse_logreg import auc
from .train_ctr import (TABLE, _PAIRS, _bounds_text, _dtype_text, _epoch_text, _make_log,
                        plot_curves, table_spec)
from .train_ctr import build_parser as _ctr_parser

__all__ = ["build_parser", "main", "parse_args", "train"]

_TORCH_OPTIMIZERS = {"adagrad": "Adagrad", "adam": "Adam", "sgd": "SGD"}


def build_parser() -> argparse.ArgumentParser:
    """``train_ctr``'s command line, under this example's name."""
    p = _ctr_parser()
    p.prog = "python -m pskv.examples.train_ctr_torch"
    p.description = __doc__.splitlines()[0] if __doc__ else ""
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad ones exit with status 2 and a message (argparse)."""
    return _cli.parse_checked(build_parser(), argv)


def _model(args: argparse.Namespace) -> Any:
    """The MLP (``fc1 -> ReLU -> fc2``, Xavier-uniform weights from ``--seed``) and the
    logit of rows ``(n, fields, 1 + dim)``: the first-order weights plus the MLP of the
    vectors and their pairwise dot products."""
    import torch

    class CTR(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width = len(FIELDS) * args.dim + len(_PAIRS)
            self.fc1 = torch.nn.Linear(width, args.hidden)
            self.fc2 = torch.nn.Linear(args.hidden, 1)
            gen = torch.Generator().manual_seed(args.seed)
            with torch.no_grad():       # the same on every worker, from --seed alone
                for layer in (self.fc1, self.fc2):
                    bound = (6.0 / (layer.in_features + layer.out_features)) ** 0.5
                    layer.weight.uniform_(-bound, bound, generator=gen)
                    layer.bias.zero_()

        def forward(self, rows: Any) -> Any:
            vec = rows[:, :, 1:]
            dots = [(vec[:, i] * vec[:, j]).sum(1) for i, j in _PAIRS]
            x = torch.cat([vec.reshape(len(rows), -1), torch.stack(dots, 1)], 1)
            return self.fc2(torch.relu(self.fc1(x))).squeeze(1) + rows[:, :, 0].sum(1)

    return CTR()


def train(args: argparse.Namespace, kv: Any, log: ClickLog | None = None,
          verbose: bool = False) -> dict[str, Any]:
    """Train on ``kv`` (every worker calls it with the same ``args``); returns what
    ``train_ctr.train`` does (``history``, ``steps``, ``samples``, times)."""
    import torch
    import pskv.torch as pt

    log = _make_log(args) if log is None else log
    rank, nw = kv.rank, kv.num_workers
    sync = "async" not in kv.type
    row_opt = mx.optimizer.create(args.optimizer, learning_rate=args.lr)
    emb = pt.Embedding(kv, TABLE, dataclasses.replace(table_spec(args), optimizer=row_opt))
    model = _model(args)
    torch_opt = getattr(torch.optim, _TORCH_OPTIMIZERS[args.optimizer])(
        model.parameters(), lr=args.lr)
    opt: Any = pt.DistributedOptimizer(torch_opt, model.named_parameters(), kv, op="sum",
                                  prefix="mlp/")
    kv.set_staleness(args.staleness, global_bound=args.global_staleness)
    history: list[dict[str, float]] = []
    steps = samples = global_samples = 0
    train_s = comm_s = 0.0
    global_batch = args.batch_size * nw
    show = verbose and rank == 0 and not args.quiet
    try:
        for epoch in range(args.epochs):
            if args.max_steps is not None and steps >= args.max_steps:
                break
            ids_day, y_day, _p = log.day(epoch)
            # every worker takes part in every step (DistributedOptimizer's rounds): a
            # last global batch too short for that is left out
            starts = [s for s in range(0, len(y_day), global_batch)
                      if min(global_batch, len(y_day) - s) >= nw]
            if args.max_steps is not None:
                starts = starts[:args.max_steps - steps]
            bar = Progress(len(starts), f"epoch {epoch + 1}/{args.epochs}", show)
            loss_sum, n_seen, n_global, comm, t0 = 0.0, 0, 0, 0.0, time.perf_counter()
            emb.train()
            for start in starts:
                batch = np.arange(start, min(start + global_batch, len(y_day)))
                mine = np.array_split(batch, nw)[rank]
                ids = torch.from_numpy(ids_day[mine])
                y = torch.from_numpy(y_day[mine].astype(np.float32))
                opt.zero_grad()
                t_comm = time.perf_counter()
                rows = emb(ids)                   # waits for the last push, then looks up
                comm += time.perf_counter() - t_comm
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model(rows), y, reduction="sum")
                scaled = loss / (len(batch) if sync else len(mine))
                scaled.backward()  # type: ignore[no-untyped-call]
                t_comm = time.perf_counter()
                opt.step()                        # waits for the MLP's summed gradients
                comm += time.perf_counter() - t_comm
                steps += 1
                bar.update()
                samples += len(mine)
                n_global += len(batch)
                loss_sum += loss.item()
                n_seen += len(mine)
            emb.synchronize()
            seconds = time.perf_counter() - t0
            bar.close()
            train_s += seconds
            comm_s += comm
            global_samples += n_global
            kv.barrier()                          # every worker's pushes are in
            ev_ids, ev_y, ev_p = log.day(epoch, "eval")
            emb.eval()                            # read-only lookups (R5)
            with torch.no_grad():
                ev_logit = model(emb(torch.from_numpy(ev_ids))).numpy()
            ev_loss = torch.nn.functional.binary_cross_entropy_with_logits(
                torch.from_numpy(ev_logit), torch.from_numpy(ev_y.astype(np.float32)))
            stats = kv.table_stats(TABLE)
            kv.barrier()                          # nobody pushes before everyone evaluated
            history.append({"epoch": epoch + 1, "train_loss": loss_sum / max(n_seen, 1),
                            "test_loss": float(ev_loss), "test_auc": auc(ev_logit, ev_y),
                            "ceiling_auc": auc(ev_p, ev_y), "seconds": seconds,
                            "samples_per_s": n_global / max(seconds, 1e-9),
                            "comm_share": comm / max(seconds, 1e-9),
                            **{k: stats[k] for k in ("rows", "inserts", "refusals",
                                                     "evictions", "dropped_pushes")}})
            if show:
                print(_epoch_text(history[-1], args), flush=True)
    finally:
        emb.close()
        opt.close()
    return {"history": history, "steps": steps, "samples": samples, "rank": rank,
            "num_workers": nw, "train_seconds": train_s, "comm_seconds": comm_s,
            "global_samples_per_s": global_samples / max(train_s, 1e-9)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; print as ``train_ctr`` does. Returns 0 when every epoch's
    test loss is finite, 1 otherwise, 2 for bad flags, a store that cannot start or no
    torch."""
    args = parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:   # before training
        print("train_ctr_torch: --plot needs matplotlib, which is not installed. Install "
              "the examples extra (pip install 'pskv[examples]'), or leave --plot out.",
              file=sys.stderr)
        return 2
    try:
        import torch
    except ModuleNotFoundError:
        print("train_ctr_torch: this example needs torch, which is not installed. Install "
              "it: pip install 'pskv[torch]'.", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    log = _make_log(args)
    kv: Any = _cli.create_store("train_ctr_torch", args.kv_store)
    if kv is None:
        return 2
    try:
        rank, nw = kv.rank, kv.num_workers
        if rank == 0 and not args.quiet:
            print(f"CTR model in torch on a synthetic click log: {kv.type}, "
                  f"{plural(nw, 'worker')}, {plural(args.epochs, 'day')} of "
                  f"{args.samples_per_day:,} samples, batch {args.batch_size} per worker, "
                  f"{args.optimizer} lr {args.lr:g} (the table's on the store, torch's on "
                  f"the MLP), {_bounds_text(args)}; table: dim {args.dim}"
                  f"{_dtype_text(args)}, CountAdmission({args.min_count}), "
                  f"Capacity({args.capacity:,}, {args.eviction!r})", flush=True)
        result = train(args, kv, log, verbose=True)
        if rank == 0 and args.plot and result["history"]:
            plot_curves(args.plot, result["history"], run_title(
                "CTR model (torch)", kv.type, nw, args.batch_size, args.lr, args.epochs),
                args.capacity)
    finally:
        kv.close()
    hist = result["history"]
    last = hist[-1] if hist else {}
    print(summary_line(rank, nw, "auc", last.get("test_auc", float("nan")),
                       last.get("train_loss", float("nan")), len(hist), result["steps"],
                       time.perf_counter() - t0, result["global_samples_per_s"],
                       result["comm_seconds"] / max(result["train_seconds"], 1e-9),
                       [f"ceiling {last.get('ceiling_auc', float('nan')):.4f}",
                        f"table {int(last.get('rows', 0)):,} rows"]
                       + ([f"curves in {args.plot}"] if rank == 0 and args.plot else [])),
          flush=True)
    return 0 if hist and all(np.isfinite(h["test_loss"]) for h in hist) else 1


if __name__ == "__main__":
    raise SystemExit(main())
