"""The worker-side hot-row cache on Zipf traffic: rows served locally, and steps/s with it.

Run from the repository root (a quiet machine; about 3 minutes on 2 cores)::

    python benchmarks/bench_table_cache.py
    python benchmarks/bench_table_cache.py --rows 100000 --steps 20 --no-write   # smoke

``pskv-launch -n 2 -s 2`` runs ``bench_embeddings.py``'s workload (a table of ``--rows``
rows x 64 float32, AdaGrad lr 0.01 on the servers, batches of 4096 IDs from a bounded
Zipf(1.05) with scattered ranks, each worker its own batches), a training lookup and a
push per step, in ``dist_async`` (where a cache may serve a row between pushes), once
without a cache and once with ``kv.set_table_cache(key, rows // 100, max_pushes=K)`` for
each ``--pushes`` K, alternated ``--repeats`` times. Reported: the share of the looked-up
rows served from the cache (``table_cache_stats``: hits / (hits + misses), after
``--warmup`` steps), and the median steps/s of the slowest worker against no cache. Aim
(issue #33): at least 40 % of the pulled rows served locally with a cache of 1 % of the
rows. Results go to ``benchmarks/results/bench_table_cache.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def worker(args: argparse.Namespace) -> int:
    """One worker of the job (under pskv-launch)."""
    import pskv as mx
    from pskv.table import TableSpec
    from _emb_workload import make_batches, make_grad

    kv = mx.kv.create("dist_async")
    kv.init("emb", TableSpec(dim=64))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.01))
    if args.cache_pushes >= 0:
        kv.set_table_cache("emb", args.rows // 100, max_pushes=args.cache_pushes)
    # one draw for the job (the same hot IDs for both workers), every other batch each
    batches = make_batches(args.rows, 4096, 2 * (args.warmup + args.steps), "zipf", 1.05,
                           seed=7)[kv.rank::2]
    grad = make_grad(4096, 64)
    kv.barrier()
    start = time.perf_counter()
    base = {"hits": 0, "misses": 0}
    for i, ids in enumerate(batches):
        if i == args.warmup:
            kv.barrier()
            if args.cache_pushes >= 0:
                base = dict(kv.table_cache_stats("emb"))
            start = time.perf_counter()
        kv.lookup("emb", ids)
        kv.push("emb", (ids, grad))
    elapsed = time.perf_counter() - start
    st = kv.table_cache_stats("emb") if args.cache_pushes >= 0 else base
    hits, misses = st["hits"] - base["hits"], st["misses"] - base["misses"]
    out = {"rank": kv.rank, "steps_per_s": args.steps / elapsed,
           "served": hits / max(hits + misses, 1), "hits": hits, "misses": misses}
    Path(args.out, f"r{kv.rank}.json").write_text(json.dumps(out))
    kv.close()
    return 0


def _job(args: argparse.Namespace, pushes: int) -> dict[str, Any]:
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        argv = [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", sys.executable,
                str(here), "--worker", "--out", tmp, "--rows", str(args.rows), "--steps",
                str(args.steps), "--warmup", str(args.warmup), "--cache-pushes", str(pushes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(here.parent),
                                              os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"job (cache K={pushes}) exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        rs = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("r*.json"))]
    return {"steps_per_s": min(r["steps_per_s"] for r in rs),
            "served": sum(r["hits"] for r in rs) / max(sum(r["hits"] + r["misses"]
                                                          for r in rs), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cache-pushes", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pushes", default="1,4,16", help="max_pushes values, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common
    runs: dict[int, list[dict[str, Any]]] = {}
    ks = [-1] + [int(k) for k in args.pushes.split(",") if k]
    for rep in range(args.repeats):
        for k in (ks if rep % 2 == 0 else ks[::-1]):
            got = _job(args, k)
            print(f"[{rep + 1}/{args.repeats}] K={k if k >= 0 else 'no cache'}: {got}",
                  flush=True)
            runs.setdefault(k, []).append(got)
    base = statistics.median(r["steps_per_s"] for r in runs[-1])
    rows = []
    for k in ks:
        sps = statistics.median(r["steps_per_s"] for r in runs[k])
        served = statistics.median(r["served"] for r in runs[k])
        rows.append(["none" if k < 0 else f"{args.rows // 100:,} rows, K={k}",
                     f"{100 * served:.1f} %", f"{sps:.1f}", f"{sps / base:.2f}x",
                     "" if k < 0 else ("PASS" if served >= 0.40 else "MISS")])
    data = {"machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "time": _common.timestamp(),
            "runs": {str(k): v for k, v in runs.items()}}
    m = data["machine"]
    md = (f"# bench_table_cache\n\n{data['command']}\n\nCommit {data.get('commit')}, "
          f"{data['time']}, {m['cpu_model']} x{m['cpu_count']}. pskv-launch -n 2 -s 2, "
          f"dist_async, a table of {args.rows:,} x 64, Zipf(1.05) batches of 4096 IDs, a "
          f"training lookup and a push per step; {args.steps} timed steps after "
          f"{args.warmup}; medians of {args.repeats} alternated repeats. Aim: at least 40 % "
          f"of the looked-up rows served from a cache of 1 % of the rows.\n\n"
          + _common.md_table(["cache", "rows served locally", "steps/s (slowest worker)",
                              "vs no cache", "aim"], rows) + "\n")
    print(md)
    if not args.no_write:
        for p in _common.write_results("bench_table_cache", data, md):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
