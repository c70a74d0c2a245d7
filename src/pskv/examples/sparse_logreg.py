"""Sparse logistic regression on a parameter server: the classic hashed-feature workload.

Every sample has ``k`` categorical fields; each field's value is drawn from a Zipf law and
hashed with its field number into one of ``V`` rows of a ``(V, 1)`` row_sparse weight
table that lives on the servers (split by rows across them), plus a dense bias key. Labels
come from a hidden true weight table, so the problem is learnable. Each step, every worker

1. takes its shard of the global batch of ``num_workers * --batch-size`` samples
   (``batch[rank::num_workers]``) and the unique feature ids ``ids`` of that shard;
2. ``kv.row_sparse_pull('w', out=rsp, row_ids=ids)``: each server sends only its rows;
3. computes the logistic-loss gradient of those rows (divided by the global batch size);
4. pushes it as ``row_sparse_array((grad, ids), shape=(V, 1))`` and the dense bias
   gradient; the servers sum the workers' pushes and apply the optimizer lazily, to the
   pushed rows only.

The flags and the output are those of ``python -m pskv.examples.train`` (the metric is
the test AUC). Run it locally or under the launcher::

    python -m pskv.examples.sparse_logreg --epochs 3
    pskv-launch -n 2 -s 2 python -m pskv.examples.sparse_logreg --kv-store dist_sync
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, cast

import numpy as np

import pskv as mx

from . import _cli
from ._report import Progress, epoch_line, plot_curves, plural, run_title, summary_line

__all__ = ["SparseData", "auc", "batch_order", "build_parser", "init_table", "logistic_loss",
           "main", "make_data", "parse_args", "shard_grad", "sigmoid", "train"]

#: 64-bit Fibonacci hashing multiplier (2**64 / golden ratio)
_HASH = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class SparseData:
    """A synthetic hashed-feature data set.

    ``train_ids`` / ``test_ids`` are ``(n, k)`` int64 row ids in ``[0, vocab)`` (a row may
    repeat within a sample: hash collisions); ``*_y`` are 0/1 float32 labels.
    """

    train_ids: np.ndarray
    train_y: np.ndarray
    test_ids: np.ndarray
    test_y: np.ndarray
    true_w: np.ndarray
    true_b: float


def make_data(vocab: int, features: int, samples: int, seed: int = 0,
              test_fraction: float = 0.2, zipf: float = 1.5) -> SparseData:
    """Generate ``samples`` samples (a ``test_fraction`` of them held out) with a seed.

    Parameters
    ----------
    vocab : int
        Rows of the weight table (hash buckets).
    features : int
        Active features (fields) per sample.
    samples : int
        Train plus test samples.
    seed : int
        Everything, the hidden weights included, follows from it.
    test_fraction : float
    zipf : float
        Exponent of the Zipf law of each field's values (> 1; smaller: a longer tail).

    Returns
    -------
    SparseData

    Examples
    --------
    >>> d = make_data(vocab=1024, features=4, samples=100, seed=0)
    >>> d.train_ids.shape, d.test_ids.shape, int(d.train_ids.max()) < 1024
    ((80, 4), (20, 4), True)
    """
    rng = np.random.default_rng(seed)
    raw = rng.zipf(zipf, size=(samples, features)).astype(np.uint64)
    field = np.arange(features, dtype=np.uint64)
    # hash (field, value) into a bucket: uint64 arithmetic wraps, as a hash should
    key = raw * np.uint64(features) + field
    ids = (((key * _HASH) >> np.uint64(17)) % np.uint64(vocab)).astype(np.int64)
    true_w = rng.normal(0.0, 2.0 / np.sqrt(features), size=vocab).astype(np.float32)
    true_b = -0.5
    logit = true_w[ids].sum(axis=1) + true_b
    y = (rng.random(samples) < sigmoid(logit)).astype(np.float32)
    n_test = int(round(samples * test_fraction))
    n_train = samples - n_test
    return SparseData(ids[:n_train], y[:n_train], ids[n_train:], y[n_train:], true_w, true_b)


def init_table(vocab: int, scale: float, seed: int) -> np.ndarray:
    """The initial ``(vocab, 1)`` float32 weight table: zeros, or N(0, scale) with a seed."""
    if scale == 0.0:
        return np.zeros((vocab, 1), np.float32)
    rng = np.random.default_rng([seed, 1])
    return rng.normal(0.0, scale, size=(vocab, 1)).astype(np.float32)


def batch_order(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """The global batches of one epoch (a seeded shuffle, the same on every worker)."""
    perm = np.random.default_rng([seed, 2, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        yield perm[start:start + batch_size]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function, without overflow for any ``x``."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def logistic_loss(logit: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-sample ``-log p(y | logit)``, computed without overflow."""
    loss: np.ndarray = np.maximum(logit, 0.0) - logit * y + np.log1p(np.exp(-np.abs(logit)))
    return loss


def shard_grad(ids: np.ndarray, y: np.ndarray, rows: np.ndarray, w_rows: np.ndarray,
               bias: float, scale: float) -> tuple[np.ndarray, float, float]:
    """Gradient of the summed logistic loss of a shard, times ``scale``.

    Parameters
    ----------
    ids : (n, k) int array
        The shard's feature ids.
    y : (n,) array
        Its 0/1 labels.
    rows : (m,) int array
        ``np.unique(ids)``: the rows pulled, sorted.
    w_rows : (m, 1) array
        Their weights, in the order of ``rows``.
    bias : float
    scale : float
        1 / global batch size, so the workers' pushes sum to the batch mean.

    Returns
    -------
    grad_rows : (m, 1) float32 array
    grad_bias : float
    loss_sum : float
        The shard's summed loss before the update.
    """
    pos = np.searchsorted(rows, ids)                      # (n, k) positions in rows
    logit = w_rows[pos, 0].astype(np.float64).sum(axis=1) + bias
    resid = sigmoid(logit) - y                            # d loss / d logit
    grad = np.bincount(pos.ravel(), weights=np.repeat(resid, ids.shape[1]),
                       minlength=len(rows))
    return ((grad * scale).astype(np.float32).reshape(-1, 1), float(resid.sum() * scale),
            float(logistic_loss(logit, y).sum()))


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half).

    Examples
    --------
    >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
    """
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s), np.float64)
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0                      # average 1-based rank per tie group
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y > 0.5].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def _rsp_zeros(vocab: int) -> mx.nd.sparse.RowSparseNDArray:
    """An empty ``(vocab, 1)`` row_sparse out for row_sparse_pull."""
    return cast(mx.nd.sparse.RowSparseNDArray, mx.nd.sparse.zeros("row_sparse", (vocab, 1)))


def _evaluate(kv: Any, ids: np.ndarray, y: np.ndarray, vocab: int) -> dict[str, float]:
    rows = np.unique(ids)
    out = _rsp_zeros(vocab)
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array(rows, dtype="int64"))
    bias = kv.pull("b").asnumpy()[0]
    logit = out.data.asnumpy()[np.searchsorted(rows, ids), 0].astype(np.float64).sum(1) + bias
    return {"loss": float(logistic_loss(logit, y).mean()), "auc": auc(logit, y),
            "accuracy": float(((logit > 0) == (y > 0.5)).mean())}


def _optimizer(args: argparse.Namespace) -> Any:
    kwargs: dict[str, Any] = {"learning_rate": args.lr}
    if args.optimizer == "ftrl":
        kwargs["lamda1"] = args.l1
    return mx.optimizer.create(args.optimizer, **kwargs)


def train(args: argparse.Namespace, kv: Any, data: SparseData | None = None,
          verbose: bool = False) -> dict[str, Any]:
    """Train on ``kv`` (local or dist): every worker calls it with the same ``args``.

    Parameters
    ----------
    args : argparse.Namespace
        As :func:`parse_args` returns.
    kv : KVStore
        A ``local`` store, or a ``dist_*`` store (one per worker).
    data : SparseData, optional
        Default: ``make_data`` from ``args`` (the same on every worker).
    verbose : bool
        On rank 0 (unless ``args.quiet``): show progress and print one line per epoch.

    Returns
    -------
    dict
        ``history`` (per epoch: ``train_loss`` over this worker's shards, ``test_loss``,
        ``test_auc``, ``test_accuracy``, ``seconds``, ``samples_per_s`` of every worker,
        ``comm_share`` of the time in push/pull), ``steps``, ``samples`` (this worker's),
        ``rows_pulled``, ``rows_pushed``, ``train_seconds``, ``comm_seconds`` and the rates
        ``samples_per_s`` (this worker's), ``global_samples_per_s`` (every worker's),
        ``rows_pulled_per_s``, ``rows_pushed_per_s``.
    """
    if data is None:
        data = make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    vocab, rank, nw = args.vocab, kv.rank, kv.num_workers
    kv.init("w", mx.nd.array(init_table(vocab, args.init_scale, args.seed))
            .tostype("row_sparse"))
    kv.init("b", mx.nd.zeros((1,)))
    kv.set_optimizer(_optimizer(args))           # every worker may call it (MXNet scripts do)
    rsp = _rsp_zeros(vocab)
    bias = mx.nd.zeros((1,))
    history: list[dict[str, float]] = []
    steps = samples = pulled = pushed = global_samples = 0
    train_s = comm_s = 0.0
    global_batch = args.batch_size * nw          # --batch-size is per worker
    show = verbose and rank == 0 and not getattr(args, "quiet", False)
    for epoch in range(args.epochs):
        if args.max_steps is not None and steps >= args.max_steps:
            break
        batches = list(batch_order(len(data.train_y), global_batch, args.seed, epoch))
        if args.max_steps is not None:
            batches = batches[:args.max_steps - steps]
        bar = Progress(len(batches), f"epoch {epoch + 1}/{args.epochs}", show)
        loss_sum, n_seen, n_global, comm, t0 = 0.0, 0, 0, 0.0, time.perf_counter()
        for batch in batches:
            shard = batch[rank::nw]
            ids, y = data.train_ids[shard], data.train_y[shard]
            rows = np.unique(ids)
            t_comm = time.perf_counter()
            # only this shard's rows travel: each server answers for the rows it holds
            kv.row_sparse_pull("w", out=rsp, row_ids=mx.nd.array(rows, dtype="int64"))
            kv.pull("b", out=bias)
            comm += time.perf_counter() - t_comm
            g_rows, g_bias, loss = shard_grad(ids, y, rows, rsp.data.asnumpy(),
                                              float(bias.asnumpy()[0]), 1.0 / len(batch))
            t_comm = time.perf_counter()
            kv.push("w", mx.nd.sparse.row_sparse_array((g_rows, rows), shape=(vocab, 1)))
            kv.push("b", mx.nd.array([g_bias]))
            comm += time.perf_counter() - t_comm
            steps += 1
            samples += len(shard)
            pulled += len(rows)
            pushed += len(rows)
            loss_sum += loss
            n_seen += len(shard)
            n_global += len(batch)
            bar.update()
        seconds = time.perf_counter() - t0
        bar.close()
        train_s += seconds
        comm_s += comm
        global_samples += n_global
        kv.barrier()                              # every worker's pushes are in
        ev = _evaluate(kv, data.test_ids, data.test_y, vocab)
        kv.barrier()                              # nobody pushes before everyone evaluated
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / max(n_seen, 1),
                        "test_loss": ev["loss"], "test_auc": ev["auc"],
                        "test_accuracy": ev["accuracy"], "seconds": seconds,
                        "samples_per_s": n_global / max(seconds, 1e-9),
                        "comm_share": comm / max(seconds, 1e-9)})
        if show:
            h = history[-1]
            print(epoch_line(epoch + 1, args.epochs, h["train_loss"], "auc", h["test_auc"],
                             h["samples_per_s"], h["comm_share"]), flush=True)
    rate = 1.0 / max(train_s, 1e-9)
    return {"history": history, "steps": steps, "samples": samples, "rows_pulled": pulled,
            "rows_pushed": pushed, "train_seconds": train_s, "comm_seconds": comm_s,
            "rank": rank, "num_workers": nw, "samples_per_s": samples * rate,
            "global_samples_per_s": global_samples * rate,
            "rows_pulled_per_s": pulled * rate, "rows_pushed_per_s": pushed * rate}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pskv.examples.sparse_logreg`` (the shared flags,
    then its own; no ``--update-on-kvstore``: the servers always run the optimizer)."""
    p = _cli.build_parser("python -m pskv.examples.sparse_logreg",
                          __doc__.splitlines()[0] if __doc__ else "",
                          epochs=3, batch_size=512, lr=0.1, update_on_kvstore=None)
    p.add_argument("--vocab", type=_cli.positive_int, default=1 << 20,
                   help="rows of the weight table (default: 2**20)")
    p.add_argument("--features-per-sample", type=_cli.positive_int, default=16,
                   help="active features per sample (default: 16)")
    p.add_argument("--samples", type=_cli.positive_int, default=200_000,
                   help="train + test (20%%) samples (default: 200000)")
    p.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "ftrl", "adam"],
                   help="the servers' optimizer (default: adagrad)")
    p.add_argument("--l1", type=_cli.nonnegative_float, default=0.0,
                   help="FTRL's lamda1 (default: 0)")
    p.add_argument("--init-scale", type=_cli.nonnegative_float, default=0.0,
                   help="std of the initial weights (default: 0, zeros)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad ones exit with status 2 and a message (argparse)."""
    return _cli.parse_checked(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the workload as the flags say; print as ``pskv.examples.train`` does (the metric
    is the test AUC), plus the rows pulled and pushed per second in the final line.

    Returns 0 when every epoch's test loss is finite, 1 otherwise, 2 for bad flags or a
    store that cannot start.
    """
    args = parse_args(argv)
    t0 = time.perf_counter()
    data = make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    kv: Any = _cli.create_store("sparse_logreg", args.kv_store)
    if kv is None:
        return 2
    try:
        rank, nw = kv.rank, kv.num_workers
        if rank == 0 and not args.quiet:
            best = logistic_loss(data.true_w[data.test_ids].sum(1) + data.true_b, data.test_y)
            print(f"sparse logistic regression: {kv.type}, {plural(nw, 'worker')}, vocab "
                  f"{args.vocab}, {args.features_per_sample} features per sample, "
                  f"{len(data.train_y)} train + {len(data.test_y)} test samples, batch "
                  f"{args.batch_size} per worker, {args.optimizer} lr {args.lr:g} (data made "
                  f"in {time.perf_counter() - t0:.2f} s); the true model's test loss is "
                  f"{best.mean():.4f}", flush=True)
        result = train(args, kv, data, verbose=True)
        hist = result["history"]
        if rank == 0 and args.plot and hist:
            plot_curves(args.plot, [h["epoch"] for h in hist], [h["train_loss"] for h in hist],
                        "auc", [h["test_auc"] for h in hist],
                        run_title("sparse logistic regression", kv.type, nw, args.batch_size,
                                  args.lr, args.epochs))
    finally:
        kv.close()
    train_s = result["train_seconds"]
    extra = [f"{result['rows_pulled_per_s']:,.0f} rows pulled/s",
             f"{result['rows_pushed_per_s']:,.0f} rows pushed/s"]
    if rank == 0 and args.plot:
        extra.append(f"curves in {args.plot}")
    print(summary_line(rank, nw, "auc", hist[-1]["test_auc"] if hist else float("nan"),
                       hist[-1]["train_loss"] if hist else float("nan"), len(hist),
                       result["steps"], time.perf_counter() - t0,
                       result["global_samples_per_s"],
                       result["comm_seconds"] / train_s if train_s > 0 else 0.0, extra),
          flush=True)
    return 0 if hist and all(np.isfinite(h["test_loss"]) for h in hist) else 1


if __name__ == "__main__":
    raise SystemExit(main())
