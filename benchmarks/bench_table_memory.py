"""A table's reported bytes against the resident memory it adds, per storage dtype.

Run from the repository root (about a minute; needs ``/proc``)::

    python benchmarks/bench_table_memory.py
    python benchmarks/bench_table_memory.py --rows 100000 --no-write     # a smoke run

For each storage dtype (float32, float16, bfloat16) a fresh process makes a ``local``
store, inits a ``TableSpec(dim, dtype=...)`` table with AdaGrad (element-wise state, in
float32), gives ``--rows`` distinct IDs a row (training lookups of ``--batch`` IDs) and
pushes a gradient for every row once (so the optimizer state exists), then reads its
resident set size (``VmRSS``, after glibc's ``malloc_trim(0)``, so that the freed
temporaries of the last steps are not counted; before it too) and
``kv.table_stats(key)['bytes']``. The growth is the
resident size after the rows minus the resident size after the same store and table with
no rows (the interpreter, NumPy and pskv loaded, the same code run once on 1 row). Aim
(issue #33): the reported bytes within 5 % of the growth. Results go to
``benchmarks/results/bench_table_memory.json`` and ``.md`` with the machine and commit.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

DTYPES = ("float32", "float16", "bfloat16")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(dtype: str, rows: int, dim: int, batch: int) -> dict[str, Any]:
    """One process: the resident growth of a table of ``rows`` rows, and its bytes."""
    import numpy as np
    import pskv as mx
    from pskv.table import TableSpec

    def fill(kv: Any, key: str, n: int) -> None:
        grad = np.full((batch, dim), 0.01, np.float32)
        for lo in range(0, n, batch):
            ids = np.arange(lo, min(lo + batch, n), dtype=np.int64)
            kv.lookup(key, ids)
            kv.push(key, (ids, grad[:ids.size]))

    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    kv.init("warm", TableSpec(dim=dim, dtype=dtype))
    fill(kv, "warm", 1)                     # every code path run once, on one row
    kv.init("t", TableSpec(dim=dim, dtype=dtype))
    fill(kv, "t", 1)
    gc.collect()
    _trim()
    before = _rss()
    fill(kv, "t", rows)
    gc.collect()
    raw = _rss()
    _trim()
    after = _rss()
    st = kv.table_stats("t")
    parts = kv._tables.tables["t"].nbytes()
    return {"dtype": dtype, "rows": st["rows"], "bytes": st["bytes"], "parts": parts,
            "rss_growth": after - before, "rss_growth_untrimmed": raw - before,
            "ratio": st["bytes"] / (after - before)}


def _trim() -> None:
    """Give the heap's free memory back to the kernel (glibc's ``malloc_trim(0)``): the
    temporaries of the last steps, which glibc keeps once its mmap threshold has risen."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--child", choices=DTYPES, help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.dim, args.batch)))
        return 0
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import _common
    results = []
    for dtype in DTYPES:
        out = subprocess.run([sys.executable, __file__, "--child", dtype, "--rows",
                              str(args.rows), "--dim", str(args.dim), "--batch",
                              str(args.batch)], capture_output=True, text=True, timeout=900,
                             check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    rows = [[r["dtype"], f"{r['rows']:,}", f"{r['bytes'] / 2**20:.1f}",
             f"{r['parts']['values'] / 2**20:.1f}", f"{r['parts']['states'] / 2**20:.1f}",
             f"{r['rss_growth'] / 2**20:.1f}", f"{r['rss_growth_untrimmed'] / 2**20:.1f}",
             f"{r['ratio']:.3f}",
             "PASS" if abs(r["ratio"] - 1) <= 0.05 else "MISS"] for r in results]
    data = {"machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "time": _common.timestamp(),
            "results": results}
    m = data["machine"]
    md = (f"# bench_table_memory\n\n{data['command']}\n\nCommit {data.get('commit')}, "
          f"{data['time']}, {m['cpu_model']} x{m['cpu_count']}. A local store, one table "
          f"of dim {args.dim} with element-wise AdaGrad (float32 state), {args.rows:,} rows "
          f"made by training lookups and pushed once; a fresh process per dtype. Aim: "
          f"table_stats bytes within 5 % of the resident growth.\n\n"
          + _common.md_table(["dtype", "rows", "table_stats MiB", "values MiB",
                              "states MiB", "RSS growth MiB", "before malloc_trim MiB",
                              "bytes / growth", "aim"], rows)
          + "\n\nThe growth is read after `malloc_trim(0)` (glibc): without it the heap "
          "keeps the freed temporaries of the last steps (lookup results, gradients, "
          "widened rows: tens of MiB at batches of 65,536 IDs, whatever the table's size), "
          "the column before it.\n")
    print(md)
    if not args.no_write:
        for p in _common.write_results("bench_table_memory", data, md):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
