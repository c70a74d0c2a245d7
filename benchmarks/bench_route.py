"""Which route a dense ``dist_sync`` key should take, by size: the servers or the collective path.

Run from the repository root (a quiet machine; about 5 minutes on 2 cores)::

    python benchmarks/bench_route.py
    python benchmarks/bench_route.py --sizes 4096,65536 --repeats 1 --steps 50   # a smoke run

For each size, one float32 key averaged over ``-n 2`` workers and ``-s 1`` server
(``kv.pushpull`` then a division, ``bench_torch.py``'s average case at that size), once
with every key on the servers (``PSKV_COLLECTIVE_BYTES=0``) and once with every key on the
collective path (``PSKV_COLLECTIVE_BYTES=1``), alternated ``--repeats`` times so machine
load falls on both alike. Reported per size and route: the median wall time of one
average, and the CPU milliseconds per average of every process of the job together (user +
system from ``/proc``: on a busy 2-core machine it moves far less than wall time), and
which route is cheaper in both. The *threshold* printed is the smallest size from which
the collective path is at most the servers' cost in wall time and in CPU at that size and
every larger one: the store's default ``PSKV_COLLECTIVE_BYTES``
(``pskv._ps.config.DEFAULT_COLLECTIVE_BYTES``) is set from it and compared with it here.
Results go to ``benchmarks/results/bench_route.json`` and ``.md`` with the machine and the
commit.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

SIZES = "4096,16384,65536,262144,1048576,4194304"
ROUTES = {"servers": 0, "collective": 1}


def _one(size: int, route: str, args: argparse.Namespace) -> dict[str, Any]:
    import bench_torch
    job = argparse.Namespace(workers=2, servers=1, steps=args.steps, warmup=args.warmup,
                             batch=32, scale=1, mb=size / 2**20, timeout=args.timeout,
                             gradient_as_bucket_view=False, zero_grads=False)
    result, _ = bench_torch._job("pskv", "avg100mb", job, ROUTES[route])
    if result.get("collective_keys") != int(route == "collective"):
        raise RuntimeError(f"{size} B on {route}: the key took the other route ({result})")
    return {"ms": result["ms"], "cpu_ms": result["cpu_ms_per_step"]["total"]}


def threshold(table: dict[int, dict[str, dict[str, float]]]) -> int | None:
    """The smallest size from which the collective path costs at most the servers' in
    wall time and CPU, at that size and every larger one (None: at no size)."""
    best = None
    for size in sorted(table, reverse=True):
        s, c = table[size]["servers"], table[size]["collective"]
        if c["ms"] <= s["ms"] and c["cpu_ms"] <= s["cpu_ms"]:
            best = size
        else:
            break
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES, help="bytes per key, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import _common
    from pskv._ps.config import DEFAULT_COLLECTIVE_BYTES
    sizes = [int(s) for s in args.sizes.split(",") if s]
    runs: dict[int, dict[str, list[dict[str, float]]]] = {}
    for rep in range(args.repeats):
        for size in sizes:
            order = list(ROUTES) if rep % 2 == 0 else list(ROUTES)[::-1]
            for route in order:
                got = _one(size, route, args)
                print(f"[{rep + 1}/{args.repeats}] {size} B {route}: {got['ms']:.3f} ms, "
                      f"{got['cpu_ms']:.2f} CPU ms", flush=True)
                runs.setdefault(size, {}).setdefault(route, []).append(got)
    table = {size: {route: {m: statistics.median(r[m] for r in rs) for m in ("ms", "cpu_ms")}
                    for route, rs in by.items()} for size, by in runs.items()}
    found = threshold(table)
    rows = []
    for size in sizes:
        s, c = table[size]["servers"], table[size]["collective"]
        cheaper = "collective" if c["ms"] <= s["ms"] and c["cpu_ms"] <= s["cpu_ms"] else \
            "servers" if s["ms"] <= c["ms"] and s["cpu_ms"] <= c["cpu_ms"] else "split"
        rows.append([f"{size:,}", f"{s['ms']:.3f}", f"{c['ms']:.3f}",
                     f"{c['ms'] / s['ms']:.2f}x", f"{s['cpu_ms']:.2f}", f"{c['cpu_ms']:.2f}",
                     f"{c['cpu_ms'] / s['cpu_ms']:.2f}x", cheaper])
    data = {"machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "time": _common.timestamp(),
            "table": {str(k): v for k, v in table.items()}, "runs": {str(k): v for k, v in
                                                                    runs.items()},
            "threshold": found, "default": DEFAULT_COLLECTIVE_BYTES}
    m = data["machine"]
    md = (f"# bench_route\n\n{data['command']}\n\nCommit {data.get('commit')}, {data['time']}, "
          f"{m['cpu_model']} x{m['cpu_count']}, load {m.get('loadavg_at_start')}. 2 workers, 1 server, "
          f"one float32 key averaged (pushpull); medians of {args.repeats} alternated "
          f"repeats of {args.steps} timed averages. CPU: every process of the job.\n\n"
          + _common.md_table(["bytes", "servers ms", "collective ms", "coll/servers",
                              "servers CPU ms", "collective CPU ms", "coll/servers CPU",
                              "cheaper"], rows)
          + f"\n\nThreshold measured: {found if found is not None else 'none'} bytes "
          f"(the smallest size from which the collective path is cheaper or equal in both "
          f"at every larger size). The store's default PSKV_COLLECTIVE_BYTES: "
          f"{DEFAULT_COLLECTIVE_BYTES}.\n")
    print(md)
    if not args.no_write:
        for p in _common.write_results("bench_route", data, md):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
