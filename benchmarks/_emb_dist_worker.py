"""A worker of ``bench_embeddings.py --dist``: one table key on a dist store, timed phases.

Run by the benchmark (never by hand) with the ``DMLC_*`` variables of a job::

    python _emb_dist_worker.py CONFIG.json OUT_PREFIX

Every worker: creates the store, declares the table (a store that refuses a
``TableSpec`` with ``UnsupportedError`` is recorded as not supported, and the worker
leaves cleanly), installs AdaGrad, fills its share of the N rows (training lookups, then
a zero gradient pushed to every row so the optimizer state of every row exists), then
times the phases on its own batches (the workload's seed + rank, as the peers do):
``lookup`` (eval lookups), ``train`` (training lookup + push of the fixed gradient) and
``insert`` (training lookups of never-seen IDs). Each phase starts after a barrier and
ends with an eval lookup of one ID, so that pushes still in flight are inside the time;
worker 0 drops a marker before its opening barrier and after a closing one, at which the
benchmark reads every process's CPU seconds (and, with ``--profile``, switches the
servers' profilers); each worker profiles its own ``train`` phase (or
``profile_phase``) into ``profile_dir``.
Worker 0 drops a marker file at two points (the table holding one row per worker, then
all N rows) and waits for the benchmark to acknowledge it, so the benchmark reads the
servers' resident memory at those points. Writes ``OUT_PREFIX.<rank>.json``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import _emb_workload as W


def _mark(config: dict[str, Any], rank: int, name: str) -> None:
    """Worker 0: drop marker ``name`` and wait (bounded) for the benchmark's ack."""
    if rank != 0 or not config.get("marker_dir"):
        return
    folder = Path(config["marker_dir"])
    (folder / name).write_text(str(time.time()))
    deadline = time.monotonic() + 20.0
    while not (folder / f"{name}.ack").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _phase(kv: Any, config: dict[str, Any], name: str, fn: Any, batches: list[np.ndarray],
           warmup: int, fence: np.ndarray) -> dict[str, float]:
    rank = kv.rank
    prof = None
    if config.get("profile_dir") and config.get("profile_phase", "train") == name:
        import cProfile
        prof = cProfile.Profile(time.thread_time)     # CPU, not wall
        prof.enable()
    _mark(config, rank, f"{name}.start")    # the benchmark reads every process's CPU
    kv._barrier()
    for b in batches[:warmup]:
        fn(b)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    for b in batches[warmup:]:
        fn(b)
    kv.lookup("emb", fence, train=False)        # pushes still in flight land inside the time
    sec = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    kv._barrier()
    _mark(config, rank, f"{name}.end")
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(Path(config["profile_dir"]) / f"worker{rank}.{name}.prof"))
    steps = len(batches) - warmup
    return {"seconds": sec, "steps": steps, "ms_per_batch": 1e3 * sec / steps,
            "cpu_ms_per_batch": 1e3 * cpu / steps, "all_steps": len(batches)}


def run(config: dict[str, Any], out_prefix: str) -> None:
    import pskv as mx
    from pskv.errors import UnsupportedError
    from pskv.table import TableSpec, Uniform

    kv: Any = mx.kv.create(config["mode"])     # lookup/table_stats: the dist store's
    rank, nw = kv.rank, kv.num_workers
    res: dict[str, Any] = {"rank": rank, "num_workers": nw, "mode": config["mode"],
                           "version": getattr(mx, "__version__", None), "phases": {},
                           "unsupported": None}
    out = Path(f"{out_prefix}.{rank}.json")
    n, d, b = int(config["rows"]), int(config["dim"]), int(config["batch"])
    try:
        kv.init("emb", TableSpec(dim=d, init=Uniform(-0.01, 0.01), seed=7))
    except UnsupportedError as err:
        res["unsupported"] = str(err)
        out.write_text(json.dumps(res))
        kv.close()
        return
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=config["lr"], eps=config["eps"]))
    # one row each (its own first ID): the servers' code paths loaded, optimizer bound
    first = np.array([rank], np.int64)
    kv.lookup("emb", first, train=True)
    kv.push("emb", (first, np.zeros((1, d), np.float32)))
    kv._barrier()
    _mark(config, rank, "before")

    # fill: this worker's share of [0, N), the same number of pushes on every worker
    t0 = time.perf_counter()
    share = np.arange(rank, n, nw, dtype=np.int64)
    per_worker = -(-n // nw)                    # the largest share, on every worker alike
    chunks = max(1, -(-per_worker // int(config["fill_chunk"])))
    for part in np.array_split(share, chunks):
        kv.lookup("emb", part, train=True)
        kv.push("emb", (part, np.zeros((part.size, d), np.float32)))
    kv._barrier()
    res["fill_seconds"] = time.perf_counter() - t0
    _mark(config, rank, "prefilled")

    total = int(config["warmup"]) + int(config["steps"])
    batches = W.make_batches(n, b, total, config["dist"], config["zipf_s"],
                             int(config["seed"]) + rank)
    grad = W.make_grad(b, d)
    fence = batches[0][:1]

    def train(ids: np.ndarray) -> None:
        kv.lookup("emb", ids, train=True)
        kv.push("emb", (ids, grad))

    warm = int(config["warmup"])
    res["phases"]["lookup"] = _phase(kv, config, "lookup",
                                     lambda ids: kv.lookup("emb", ids, train=False),
                                     batches, warm, fence)
    res["phases"]["train"] = _phase(kv, config, "train", train, batches, warm, fence)
    fresh = W.insert_batches(0, b, total, salt=rank + 1)
    res["phases"]["insert"] = _phase(kv, config, "insert",
                                     lambda ids: kv.lookup("emb", ids, train=True),
                                     fresh, warm, fence)
    kv._barrier()
    if rank == 0:
        res["stats"] = {k: int(v) for k, v in kv.table_stats("emb").items()}
    res["peak_rss_bytes"] = W.peak_rss_bytes()
    out.write_text(json.dumps(res))
    kv.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _emb_dist_worker.py CONFIG.json OUT_PREFIX", file=sys.stderr)
        return 2
    run(json.loads(Path(argv[0]).read_text()), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
