"""The change stream: how far a subscriber lags the servers, and what one costs training.

Run from the repository root (a quiet machine; about 3 minutes on 2 cores)::

    python benchmarks/bench_stream.py
    python benchmarks/bench_stream.py --seconds 5 --repeats 1 --no-write     # smoke

``pskv-launch -n 2 -s 2`` trains a table of 64 float32 columns (AdaGrad on the servers,
``dist_sync``); each step each worker looks up and pushes gradients of ``B`` IDs drawn from 1e6, none
repeated within the step. Worker 0 starts a standalone reader (``pskv.stream.Reader``,
another process, no worker slot) that polls every shard's stream in a loop and notes when
it first holds each version; worker 0 notes when each version is reached
(``kv.table_versions`` right after its push, in the paced runs: the version that step
made). Lag = the reader's time minus the time that step began (its lookup and push
included: an upper bound), per shard and version.

1. Lag, paced at 10 steps/s: ``B`` so that the workers change 1e4 and 1e5 rows/s
   (aim, issue #31: p99 under 1 s at 1e4 rows/s).
2. Cost: steps/s unpaced (B = each of ``--cost-batches`` a worker), with the reader
   against without it, alternated ``--repeats`` times (aim: within 5 %).

Results go to ``benchmarks/results/bench_stream.json`` and ``.md``.
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

import numpy as np

__all__ = ["main"]

DIM = 64


def reader(args: argparse.Namespace) -> int:
    """The subscriber: poll until OUT/stop exists; write when each version was held."""
    from pskv.stream import Reader
    seen: list[tuple[float, int, int]] = []
    rows = 0
    with Reader.from_env(timeout=60) as r:
        sub = r.subscribe("emb")
        stop = Path(args.out, "stop")
        while not stop.exists():
            for b in sub.poll():
                rows += b.ids.size
                if b.complete:
                    seen.append((time.time(), b.shard, b.version))
            time.sleep(args.interval)
    Path(args.out, "reader.json").write_text(json.dumps({"seen": seen, "rows": rows}))
    return 0


def worker(args: argparse.Namespace) -> int:
    """One worker of the job (under pskv-launch)."""
    import pskv as mx
    from pskv.table import TableSpec
    kv = mx.kv.create("dist_sync")
    kv.init("emb", TableSpec(dim=DIM))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.01))
    rng = np.random.default_rng(kv.rank)
    grad = rng.standard_normal((args.batch, DIM)).astype(np.float32)
    proc = None
    if kv.rank == 0 and args.subscribe:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DMLC_WORKER_ID", "RANK", "LOCAL_RANK")}
        proc = subprocess.Popen([sys.executable, __file__, "--reader", "--out", args.out,
                                 "--interval", str(args.interval)], env=env)
        time.sleep(1.0)                   # let it connect before the clock starts
    kv.barrier()
    marks: list[tuple[float, list[int]]] = []
    period = 1.0 / args.pace if args.pace else 0.0
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < args.seconds:
        t0 = time.perf_counter()
        ids = rng.choice(1_000_000, args.batch, replace=False)
        pushed = time.time()
        kv.lookup("emb", ids)
        kv.push("emb", (ids, grad))
        if kv.rank == 0 and args.subscribe and args.pace:
            marks.append((pushed, kv.table_versions("emb")))
        steps += 1
        if period:
            time.sleep(max(0.0, period - (time.perf_counter() - t0)))
    elapsed = time.perf_counter() - start
    kv.barrier()
    if proc is not None:
        time.sleep(2.0)                   # the reader catches up with the last versions
        Path(args.out, "stop").write_text("")
        proc.wait(60)
    Path(args.out, f"w{kv.rank}.json").write_text(json.dumps(
        {"steps_per_s": steps / elapsed, "marks": marks}))
    kv.close()
    return 0


def _job(args: argparse.Namespace, batch: int, pace: float, subscribe: bool) \
        -> dict[str, Any]:
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        argv = [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", sys.executable,
                str(here), "--worker", "--out", tmp, "--batch", str(batch), "--pace",
                str(pace), "--seconds", str(args.seconds), "--interval", str(args.interval)]
        if subscribe:
            argv.append("--subscribe")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"job exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        rs = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("w*.json"))]
        got: dict[str, Any] = {"steps_per_s": min(r["steps_per_s"] for r in rs)}
        if subscribe:
            seen = json.loads(Path(tmp, "reader.json").read_text())
            got["lags"] = _lags(rs[0]["marks"], seen["seen"])
            got["reader_rows"] = seen["rows"]
    return got


def _lags(marks: list[Any], seen: list[Any]) -> list[float]:
    """Per (shard, version) reached on the servers: seconds until the reader held it."""
    lags = []
    by_shard: dict[int, list[tuple[int, float]]] = {}
    for t, shard, v in seen:
        by_shard.setdefault(shard, []).append((v, t))
    for shard, got in by_shard.items():
        got.sort(key=lambda p: p[1])
        versions = np.array([v for v, _t in got])
        times = np.array([t for _v, t in got])
        best = np.maximum.accumulate(versions)
        for t, vs in marks:
            i = int(np.searchsorted(best, vs[shard]))     # first read holding it
            if i < best.size:
                lags.append(float(times[i] - t))
    return lags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--subscribe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--pace", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--interval", type=float, default=0.02,
                    help="seconds the reader sleeps between two polls")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-batches", default="512,4096",
                    help="IDs a worker a step of the unpaced cost runs, comma-separated")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--tag", default="", help="results go to bench_stream<TAG>.json/.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.reader:
        return reader(args)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common
    lag_rows, raw = [], {"lag": {}, "cost": {}}
    for rate in (10_000, 100_000):
        batch = rate // (2 * 10)          # 2 workers at 10 steps/s
        got = _job(args, batch, 10.0, True)
        lags = np.array(got["lags"])
        raw["lag"][str(rate)] = got
        p50, p99 = float(np.percentile(lags, 50)), float(np.percentile(lags, 99))
        print(f"{rate} rows/s: lag p50 {p50 * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms "
              f"({lags.size} versions)", flush=True)
        lag_rows.append([f"{rate:,}", f"{batch:,}", f"{got['steps_per_s']:.1f}",
                         f"{p50 * 1e3:.0f} ms", f"{p99 * 1e3:.0f} ms", str(lags.size),
                         ("PASS" if p99 < 1.0 else "MISS") if rate == 10_000 else ""])
    cost_rows = []
    for batch in [int(b) for b in args.cost_batches.split(",") if b]:
        runs = raw["cost"].setdefault(str(batch), {"with": [], "without": []})
        for rep in range(args.repeats):
            for sub in ((False, True) if rep % 2 == 0 else (True, False)):
                got = _job(args, batch, 0.0, sub)
                got.pop("lags", None)
                runs["with" if sub else "without"].append(got)
                print(f"[{rep + 1}/{args.repeats}] {batch} IDs, subscriber={sub}: "
                      f"{got['steps_per_s']:.2f} steps/s", flush=True)
        w = statistics.median(r["steps_per_s"] for r in runs["with"])
        wo = statistics.median(r["steps_per_s"] for r in runs["without"])
        cost_rows.append([f"{batch:,}", f"~{2 * batch * wo:,.0f}", f"{wo:.2f}", f"{w:.2f}",
                          f"{w / wo:.2f}x", "PASS" if w >= 0.95 * wo else "MISS"])
    data = {"machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "time": _common.timestamp(), "runs": raw}
    m = data["machine"]
    md = (f"# bench_stream\n\n{data['command']}\n\nCommit {data.get('commit')}, "
          f"{data['time']}, {m['cpu_model']} x{m['cpu_count']}. pskv-launch -n 2 -s 2, "
          f"dist_sync, a table of 64 float32 columns, AdaGrad; a standalone reader "
          f"(pskv.stream.Reader, its own process) polling every {args.interval:g} s; "
          f"{args.seconds:g} s a run.\n\n## Lag (paced at 10 steps/s)\n\n"
          + _common.md_table(["changed rows/s", "IDs a worker a step", "steps/s",
                              "lag p50", "lag p99", "versions", "aim p99 < 1 s"], lag_rows)
          + "\n\n## What a subscriber costs training (unpaced; medians of the slowest "
          "worker)\n\n"
          + _common.md_table(["IDs a worker a step", "changed rows/s (about)",
                              "steps/s, no subscriber", "steps/s, one subscriber",
                              "ratio", "aim: within 5 %"], cost_rows) + "\n")
    print(md)
    if not args.no_write:
        for p in _common.write_results("bench_stream" + args.tag, data, md):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
