"""A CTR model on a stream of new IDs: a dynamic embedding table and a small MLP.

The model is the usual recommender shape. Each sample has a user, an item and a context
ID (raw 64-bit IDs, new ones appearing all the time: see ``_clicklog``); each ID has a
row in one dynamic table ``'emb'`` (:class:`pskv.table.TableSpec`) that grows as IDs are
admitted (``CountAdmission(--min-count)``: an ID gets a row at its n-th sighting, so the
one-off tail never takes memory) and is bounded by eviction (``Capacity(--capacity,
--eviction)``). A row is the ID's first-order weight, added to the logit, and a ``--dim``
vector; the three vectors and their three pairwise dot products feed a NumPy MLP
(``fc1 -> ReLU -> fc2``) whose weights are dense keys.
Each step, every worker

1. takes its shard of the global batch (``num_workers * --batch-size`` samples, in time
   order: one epoch is one day of the log) and the unique IDs of that shard;
2. ``kv.lookup('emb', ids)``: a training lookup, which may give birth to rows; ``found``
   says which IDs have one (the others read their initial value and are not trained);
3. pulls the MLP's weights and computes the logistic loss's gradients;
4. pushes ``(ids[found], grads[found])`` to the table and the MLP's gradients to their
   keys; the servers run the optimizer (AdaGrad by default) on both, and sweep the table.

In ``dist_async`` the workers never wait for each other's pushes; ``--staleness K``
(``kv.set_staleness(K)``, default 2: one step's two push calls) bounds how far a worker's
lookups and pulls may run ahead of its own acknowledged pushes, and ``--global-staleness``
how far ahead of the slowest worker (SSP).

After each day every worker evaluates the day's held-out samples with read-only lookups
(``train=False``: nothing is inserted) and rank 0 prints the test AUC next to the
*ceiling*, the AUC of the generating model's own probabilities on the same samples, and
the table's size and counters. The flags and the lines are those of
``python -m pskv.examples.train``. Run it in one process, or on a parameter server::

    python -m pskv.examples.train_ctr --kv-store local --plot ctr.png
    pskv-launch -n 2 -s 2 python -m pskv.examples.train_ctr --kv-store dist_async
    pskv-launch -n 2 -s 2 python -m pskv.examples.train_ctr --kv-store dist_async \
        --staleness 0 --global-staleness 4

See ``docs/embeddings.md`` ("The example").
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import pskv as mx
from pskv.table import Capacity, CountAdmission, Normal, TableSpec

from . import _cli
from ._clicklog import FIELDS, ClickLog, make_log
from ._data import shard
from ._report import Progress, epoch_line, plural, run_title, summary_line
from .sparse_logreg import auc, logistic_loss, sigmoid

__all__ = ["DENSE_NAMES", "TABLE", "build_parser", "dense_gradients", "forward",
           "init_dense", "main", "parse_args", "plot_curves", "table_spec", "train"]

#: the MLP's parameters (dense keys), in the order they are pushed and pulled
DENSE_NAMES = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
#: the pairs of fields whose rows' dot products feed the MLP (DLRM's interaction)
_PAIRS = tuple((i, j) for i in range(len(FIELDS)) for j in range(i + 1, len(FIELDS)))
#: the table key
TABLE = "emb"


# ---- the model ----------------------------------------------------------------------------------
def init_dense(dim: int, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """The MLP's initial weights: Xavier-uniform (MXNet's default) and zero biases."""
    rng = np.random.default_rng([seed, 3])
    width = len(FIELDS) * dim + len(_PAIRS)

    def xavier(fan_out: int, fan_in: int) -> np.ndarray:
        scale = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-scale, scale, size=(fan_out, fan_in)).astype(np.float32)

    return {"fc1_weight": xavier(hidden, width), "fc1_bias": np.zeros(hidden, np.float32),
            "fc2_weight": xavier(1, hidden), "fc2_bias": np.zeros(1, np.float32)}


def _features(vec: np.ndarray) -> np.ndarray:
    """``(n, F, d)`` vectors -> ``(n, F*d + pairs)``: the vectors, then their pairwise dots."""
    dots = [np.einsum("nd,nd->n", vec[:, i], vec[:, j]) for i, j in _PAIRS]
    return np.concatenate([vec.reshape(len(vec), -1), np.stack(dots, axis=1)], axis=1)


def _mlp(dense: dict[str, np.ndarray], emb: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The features, the hidden layer and the logits of rows ``emb``."""
    x = _features(emb[:, :, 1:])
    h = np.maximum(x @ dense["fc1_weight"].T + dense["fc1_bias"], 0.0)
    logit = (h @ dense["fc2_weight"].T)[:, 0] + dense["fc2_bias"][0] + emb[:, :, 0].sum(1)
    return x, h, logit


def forward(dense: dict[str, np.ndarray], emb: np.ndarray) -> np.ndarray:
    """The click logits of samples whose rows are ``emb``, shape ``(n, fields, 1 + dim)``.

    A row is the ID's first-order weight (column 0, added to the logit as in a logistic
    regression: the "wide" part) and its ``dim``-vector (the "deep" part: the vectors and
    their pairwise dot products go through the MLP).
    """
    return _mlp(dense, emb)[2]


def dense_gradients(dense: dict[str, np.ndarray], emb: np.ndarray, y: np.ndarray,
                    divisor: float) -> tuple[dict[str, np.ndarray], np.ndarray, float]:
    """The gradients of the summed logistic loss, divided by ``divisor``.

    Returns the MLP's gradients by name, the rows' gradient (the shape of ``emb``) and
    the summed loss (before the update).
    """
    x, h, logit = _mlp(dense, emb)
    dz = ((sigmoid(logit) - y) / divisor).astype(np.float32)        # d loss / d logit
    dh = dz[:, None] * dense["fc2_weight"]
    dh[h <= 0] = 0.0
    dx = dh @ dense["fc1_weight"]
    n, f, width = emb.shape
    d = width - 1
    vec = emb[:, :, 1:]
    demb = np.empty_like(emb, dtype=np.float32)
    demb[:, :, 0] = dz[:, None]
    demb[:, :, 1:] = dx[:, :f * d].reshape(n, f, d)
    for p, (i, j) in enumerate(_PAIRS):
        g = dx[:, f * d + p, None]
        demb[:, i, 1:] += g * vec[:, j]
        demb[:, j, 1:] += g * vec[:, i]
    grads = {"fc1_weight": dh.T @ x, "fc1_bias": dh.sum(axis=0),
             "fc2_weight": (dz @ h)[None, :], "fc2_bias": np.array([dz.sum()])}
    return ({k: v.astype(np.float32) for k, v in grads.items()}, demb,
            float(logistic_loss(logit, y).sum()))


def table_spec(args: argparse.Namespace) -> TableSpec:
    """The embedding table the flags describe: one row per admitted ID."""
    return TableSpec(dim=1 + args.dim, init=Normal(0.0, 0.1), seed=args.seed,
                     admission=CountAdmission(args.min_count),
                     eviction=Capacity(args.capacity, args.eviction), dtype=args.table_dtype)


# ---- training -----------------------------------------------------------------------------------
def _make_log(args: argparse.Namespace) -> ClickLog:
    return make_log(args.epochs, args.samples_per_day, seed=args.seed)


def _evaluate(kv: Any, dense: dict[str, np.ndarray], ids: np.ndarray, y: np.ndarray
              ) -> tuple[float, float]:
    """Test loss and AUC of ``ids`` with read-only lookups (R5: nothing is inserted)."""
    uniq, inv = np.unique(ids, return_inverse=True)
    rows, _found = kv.lookup(TABLE, uniq, train=False)
    logit = forward(dense, rows[inv.reshape(ids.shape)])
    return float(logistic_loss(logit, y).mean()), auc(logit, y)


def train(args: argparse.Namespace, kv: Any, log: ClickLog | None = None,
          verbose: bool = False) -> dict[str, Any]:
    """Train on ``kv`` (local or dist): every worker calls it with the same ``args``.

    Parameters
    ----------
    args : argparse.Namespace
        As :func:`parse_args` returns.
    kv : KVStore
        A ``local`` store, or a ``dist_*`` store (one per worker).
    log : ClickLog, optional
        Default: the log ``args`` describe (the same on every worker).
    verbose : bool
        On rank 0 (unless ``args.quiet``): show progress and print one line per epoch.

    Returns
    -------
    dict
        ``history`` (per epoch: ``train_loss`` over this worker's shards, ``test_loss``,
        ``test_auc``, ``ceiling_auc``, ``seconds``, ``samples_per_s`` of every worker,
        ``comm_share``, and the table's counters after the epoch: ``rows``, ``inserts``,
        ``refusals``, ``evictions``, ``dropped_pushes``), ``steps``, ``samples`` (this
        worker's), ``train_seconds``, ``comm_seconds``, ``global_samples_per_s``.
    """
    if log is None:
        log = _make_log(args)
    rank, nw = kv.rank, kv.num_workers
    sync = "async" not in kv.type
    names = list(DENSE_NAMES)
    init = init_dense(args.dim, args.hidden, args.seed)
    kv.init(TABLE, table_spec(args))
    kv.init(names, [mx.nd.array(init[n]) for n in names])
    kv.set_optimizer(mx.optimizer.create(args.optimizer, learning_rate=args.lr))
    # dist_async: a lookup or pull runs at most --staleness push calls ahead of this worker's
    # acknowledged pushes, and (SSP) at most --global-staleness ahead of the slowest worker;
    # collective, like init. A local or dist_sync store holds any bound already.
    kv.set_staleness(args.staleness, global_bound=args.global_staleness)
    # a dist store serves the hottest rows from this worker's cache while at most
    # --cache-pushes of its pushes of the table old (a local store records the call)
    if args.cache_rows:
        kv.set_table_cache(TABLE, args.cache_rows, max_pushes=args.cache_pushes)
    outs = [mx.nd.zeros(init[n].shape) for n in names]
    history: list[dict[str, float]] = []
    steps = samples = global_samples = 0
    train_s = comm_s = 0.0
    global_batch = args.batch_size * nw          # --batch-size is per worker
    show = verbose and rank == 0 and not getattr(args, "quiet", False)
    for epoch in range(args.epochs):
        if args.max_steps is not None and steps >= args.max_steps:
            break
        ids_day, y_day, _p = log.day(epoch)
        starts = list(range(0, len(y_day), global_batch))    # time order: no shuffle
        if args.max_steps is not None:
            starts = starts[:args.max_steps - steps]
        bar = Progress(len(starts), f"epoch {epoch + 1}/{args.epochs}", show)
        loss_sum, n_seen, n_global, comm, t0 = 0.0, 0, 0, 0.0, time.perf_counter()
        for start in starts:
            batch = np.arange(start, min(start + global_batch, len(y_day)))
            mine = shard(batch, rank, nw)
            n_global += len(batch)
            steps += 1
            bar.update()
            if len(mine) == 0:                   # a short last batch: nothing for this worker
                continue
            ids, y = ids_day[mine], y_day[mine]
            uniq, inv = np.unique(ids, return_inverse=True)
            t_comm = time.perf_counter()
            rows, found = kv.lookup(TABLE, uniq)             # may give birth to rows
            kv.pull(names, out=outs)
            comm += time.perf_counter() - t_comm
            dense = {n: o.asnumpy() for n, o in zip(names, outs)}
            grads, demb, loss = dense_gradients(dense, rows[inv.reshape(ids.shape)], y,
                                                len(batch) if sync else len(mine))
            # the rows' gradient, summed per unique ID; IDs without a row are not pushed
            g_uniq = np.zeros((len(uniq), 1 + args.dim), np.float32)
            np.add.at(g_uniq, inv.ravel(), demb.reshape(-1, 1 + args.dim))
            t_comm = time.perf_counter()
            kv.push(TABLE, (uniq[found], g_uniq[found]))
            kv.push(names, [mx.nd.array(grads[n]) for n in names])
            comm += time.perf_counter() - t_comm
            samples += len(mine)
            loss_sum += loss
            n_seen += len(mine)
        seconds = time.perf_counter() - t0
        bar.close()
        train_s += seconds
        comm_s += comm
        global_samples += n_global
        kv.barrier()                              # every worker's pushes are in
        kv.pull(names, out=outs)
        dense = {n: o.asnumpy() for n, o in zip(names, outs)}
        ev_ids, ev_y, ev_p = log.day(epoch, "eval")
        test_loss, test_auc = _evaluate(kv, dense, ev_ids, ev_y)
        stats = kv.table_stats(TABLE)
        cached = kv.table_cache_stats(TABLE)
        kv.barrier()                              # nobody pushes before everyone evaluated
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / max(n_seen, 1),
                        "test_loss": test_loss, "test_auc": test_auc,
                        "ceiling_auc": auc(ev_p, ev_y), "seconds": seconds,
                        "samples_per_s": n_global / max(seconds, 1e-9),
                        "comm_share": comm / max(seconds, 1e-9),
                        **{k: stats[k] for k in ("rows", "inserts", "refusals", "evictions",
                                                 "dropped_pushes")},
                        "cache_hits": cached["hits"], "cache_misses": cached["misses"]})
        if show:
            print(_epoch_text(history[-1], args), flush=True)
    rate = 1.0 / max(train_s, 1e-9)
    return {"history": history, "steps": steps, "samples": samples, "rank": rank,
            "num_workers": nw, "train_seconds": train_s, "comm_seconds": comm_s,
            "global_samples_per_s": global_samples * rate}


def _bounds_text(args: argparse.Namespace) -> str:
    """The staleness bounds in words."""
    one = "no staleness bound" if args.staleness is None else \
        f"staleness bound {args.staleness}"
    return one if args.global_staleness is None else \
        f"{one}, global bound {args.global_staleness}"


def _epoch_text(h: dict[str, float], args: argparse.Namespace) -> str:
    """The shared epoch line, then the ceiling and the table's size and counters."""
    return (epoch_line(int(h["epoch"]), args.epochs, h["train_loss"], "auc", h["test_auc"],
                       h["samples_per_s"], h["comm_share"])
            + f"  ceiling {h['ceiling_auc']:.4f}  table {int(h['rows']):,}/"
            f"{args.capacity:,} rows ({int(h['inserts']):,} inserted, "
            f"{int(h['refusals']):,} refused, {int(h['evictions']):,} evicted)")


# ---- command line -------------------------------------------------------------------------------
def _dtype_text(args: argparse.Namespace) -> str:
    """`` float16`` after the table's dim where the rows are not float32."""
    return "" if args.table_dtype == "float32" else f" {args.table_dtype}"


def _bound(text: str) -> int | None:
    """An argparse type: a staleness bound, a whole number of at least 0, or ``none``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or 'none'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0 (0 reads your own "
                                         "writes), or 'none'")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pskv.examples.train_ctr`` (the shared flags, then
    its own; no ``--update-on-kvstore``: the servers always run the optimizer)."""
    p = _cli.build_parser("python -m pskv.examples.train_ctr",
                          __doc__.splitlines()[0] if __doc__ else "",
                          epochs=5, batch_size=256, lr=0.1, update_on_kvstore=None)
    p.add_argument("--samples-per-day", type=_cli.positive_int, default=50_000,
                   help="samples a day of the log, 20%% held out for the test AUC; one "
                        "epoch trains one day, and the log has --epochs days "
                        "(default: 50000)")
    p.add_argument("--dim", type=_cli.positive_int, default=8,
                   help="width of an embedding row (default: 8)")
    p.add_argument("--hidden", type=_cli.positive_int, default=32,
                   help="hidden units of the MLP (default: 32)")
    p.add_argument("--capacity", type=_cli.positive_int, default=2000,
                   help="most rows the table keeps after a sweep: Capacity(N) "
                        "(default: 2000)")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu"],
                   help="which rows go first when the table is full (default: lru)")
    p.add_argument("--min-count", type=_cli.positive_int, default=2,
                   help="an ID gets a row at its N-th sighting: CountAdmission(N) "
                        "(default: 2)")
    p.add_argument("--staleness", type=_bound, default=2, metavar="K",
                   help="per-worker staleness bound, kv.set_staleness(K): a lookup or pull "
                        "runs at most K of this worker's push calls (two a step: the "
                        "table's and the MLP's) ahead of the acknowledged ones; 0 reads its "
                        "own writes, 'none' sets no bound (default: 2)")
    p.add_argument("--global-staleness", type=_bound, default=None, metavar="K",
                   help="global (SSP) bound, kv.set_staleness(..., global_bound=K): a worker "
                        "reads only while at most K push calls ahead of the slowest one "
                        "(default: none)")
    p.add_argument("--cache-rows", type=_cli.nonnegative_int, default=0, metavar="N",
                   help="keep the N most looked-up rows on each worker, "
                        "kv.set_table_cache(N): a dist store serves them without asking "
                        "the servers; 0: no cache (default: 0)")
    p.add_argument("--cache-pushes", type=_cli.nonnegative_int, default=1, metavar="K",
                   help="a cached row is served while at most K of this worker's pushes "
                        "of the table old; 0: until its next push (default: 1)")
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "adam", "sgd"],
                   help="the servers' optimizer, for the table and the MLP "
                        "(default: adagrad)")
    p.add_argument("--table-dtype", default="float32",
                   choices=["float32", "float16", "bfloat16"],
                   help="the dtype the table stores its rows in; a half one halves their "
                        "memory, computed in float32 and rounded to nearest even "
                        "(default: float32)")
    p.add_argument("--export", metavar="DIR", default=None,
                   help="after training, write the table as the servers hold it to DIR "
                        "(a pskv.sinks.FileSink full snapshot; pskv.sinks.replay(DIR) "
                        "reads it back)")
    return p


def export_table(kv: Any, directory: str) -> None:
    """Write the table as the servers hold it to ``directory``: rank 0 reads its change
    stream whole (docs/embeddings.md E5) into a :class:`pskv.sinks.FileSink` (a full
    snapshot and a manifest with each shard's version); every worker waits for it."""
    from pskv.sinks import FileSink
    if kv.rank == 0:
        with FileSink(directory, TABLE) as sink:
            sink.write(kv.subscribe(TABLE).poll())
    kv.barrier()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; bad ones exit with status 2 and a message (argparse)."""
    return _cli.parse_checked(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; print as ``pskv.examples.train`` does (the metric is the test
    AUC), with the ceiling and the table's size on each epoch line.

    Returns 0 when every epoch's test loss is finite, 1 otherwise, 2 for bad flags or a
    store that cannot start.
    """
    args = parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:   # before training
        print("train_ctr: --plot needs matplotlib, which is not installed. Install the "
              "examples extra (pip install 'pskv[examples]'), or leave --plot out.",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    log = _make_log(args)
    kv: Any = _cli.create_store("train_ctr", args.kv_store)
    if kv is None:
        return 2
    try:
        rank, nw = kv.rank, kv.num_workers
        if rank == 0 and not args.quiet:
            seen = sum(len(np.unique(log.train_ids[:, f])) for f in range(len(FIELDS)))
            print(f"CTR model on a synthetic click log: {kv.type}, {plural(nw, 'worker')}, "
                  f"{plural(args.epochs, 'day')} of {args.samples_per_day:,} samples "
                  f"({seen:,} distinct IDs), batch {args.batch_size} per worker, "
                  f"{args.optimizer} lr {args.lr:g}, {_bounds_text(args)}; table: dim "
                  f"{args.dim}{_dtype_text(args)}, CountAdmission({args.min_count}), "
                  f"Capacity({args.capacity:,}, {args.eviction!r}) (log made in "
                  f"{time.perf_counter() - t0:.2f} s)",
                  flush=True)
        result = train(args, kv, log, verbose=True)
        if args.export:
            export_table(kv, args.export)
        hist = result["history"]
        if rank == 0 and args.plot and hist:
            plot_curves(args.plot, hist, run_title("CTR model", kv.type, nw, args.batch_size,
                                                   args.lr, args.epochs), args.capacity)
    finally:
        kv.close()
    train_s = result["train_seconds"]
    last = hist[-1] if hist else {}
    extra = [f"ceiling {last.get('ceiling_auc', float('nan')):.4f}",
             f"table {int(last.get('rows', 0)):,} rows"]
    asked = last.get("cache_hits", 0) + last.get("cache_misses", 0)
    if args.cache_rows and asked:
        extra.append(f"{last['cache_hits'] / asked:.0%} of looked-up rows from the cache")
    if rank == 0 and args.plot:
        extra.append(f"curves in {args.plot}")
    print(summary_line(rank, nw, "auc", last.get("test_auc", float("nan")),
                       last.get("train_loss", float("nan")), len(hist), result["steps"],
                       time.perf_counter() - t0, result["global_samples_per_s"],
                       result["comm_seconds"] / train_s if train_s > 0 else 0.0, extra),
          flush=True)
    return 0 if hist and all(np.isfinite(h["test_loss"]) for h in hist) else 1


def plot_curves(path: str, history: Sequence[dict[str, float]], title: str,
                capacity: int | None = None) -> None:
    """Save three panels to the image ``path``: the training loss, the test AUC with its
    ceiling, and the table's rows (with ``capacity``, if given) and inserts, per epoch.

    ``history`` is :func:`train`'s. Uses matplotlib's Agg canvas directly: no GUI backend
    or global pyplot state is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [int(h["epoch"]) for h in history]
    fig = Figure(figsize=(12, 3.8))
    FigureCanvasAgg(fig)
    ax_loss, ax_auc, ax_rows = fig.subplots(1, 3)
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o")
    ax_loss.set(title="training loss", xlabel="epoch (day)", ylabel="loss")
    ax_auc.plot(epochs, [h["test_auc"] for h in history], marker="o", color="tab:green",
                label="model")
    ax_auc.plot(epochs, [h["ceiling_auc"] for h in history], ls="--", color="tab:gray",
                label="ceiling (generating model)")
    ax_auc.set(title="test AUC", xlabel="epoch (day)", ylabel="auc", ylim=(0.5, 1.0))
    ax_auc.legend(loc="lower right")
    ax_rows.plot(epochs, [h["rows"] for h in history], marker="o", color="tab:purple",
                 label="rows")
    ax_rows.plot(epochs, [h["inserts"] for h in history], marker=".", color="tab:orange",
                 label="inserted so far")
    if capacity is not None:
        ax_rows.axhline(capacity, ls="--", color="tab:gray", label="capacity")
    ax_rows.set(title="embedding table", xlabel="epoch (day)", ylabel="rows")
    ax_rows.set_ylim(bottom=0)
    ax_rows.legend(loc="upper left")
    for ax in (ax_loss, ax_auc, ax_rows):
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
