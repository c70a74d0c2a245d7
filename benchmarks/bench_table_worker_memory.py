"""What a dist worker's resident memory grows by when it inits a table key (issue #30).

A table's rows live on the servers (docs/embeddings.md, R13); a worker should hold its
spec only. One ``dist_sync`` job of 2 workers and 2 servers (``python -m pskv.launch -n 2
-s 2``) inits ``TableSpec(dim=DIM, reserve_rows=ROWS)``; each worker reads its own
``VmRSS`` (``/proc/self/status``) after the store is created and again after the init
(and after a lookup of 1000 IDs, so that the table is known to work), and writes them to
a JSON file the driver reads. For scale, the driver also reports what one process's
``DynamicTable`` of that spec takes (``--local``).

Run::

    python benchmarks/bench_table_worker_memory.py                    # this checkout
    python benchmarks/bench_table_worker_memory.py --src /other/src   # another tree's pskv

The job's processes import pskv from ``--src`` (default: this checkout's ``src``); the
driver itself imports nothing of pskv. Results: ``benchmarks/results/table_worker_memory.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"


def rss_mib() -> float:
    """This process's resident memory in MiB (``VmRSS`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


# ---- the worker side (run by pskv.launch) --------------------------------------------------
def worker(out: str, dim: int, rows: int) -> None:
    import numpy as np

    import pskv as mx
    from pskv.table import TableSpec
    kv = mx.kv.create("dist_sync")
    before = rss_mib()
    kv.init("emb", TableSpec(dim=dim, reserve_rows=rows))
    after_init = rss_mib()
    values, _found = kv.lookup("emb", np.arange(1000, dtype=np.int64))
    assert values.shape == (1000, dim)
    after_lookup = rss_mib()
    held = type(kv._tables.tables["emb"]).__name__     # what the worker keeps of the key
    Path(out, f"rank{kv.rank}.json").write_text(json.dumps({
        "rank": kv.rank, "before_mib": before, "after_init_mib": after_init,
        "after_lookup_mib": after_lookup, "holds": held}))
    kv.close()


def local(dim: int, rows: int) -> float:
    """MiB one process's resident memory grows by when it makes a DynamicTable of the spec
    and looks up 1000 IDs (what a worker held before #30, for scale)."""
    import numpy as np

    from pskv.table import DynamicTable, TableSpec
    before = rss_mib()
    t = DynamicTable(TableSpec(dim=dim, reserve_rows=rows))
    t.lookup(np.arange(1000, dtype=np.int64))
    return rss_mib() - before


# ---- the driver ----------------------------------------------------------------------------
def run(src: str, dim: int, rows: int, timeout: float) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env.update(PYTHONPATH=src, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory(prefix="bench-table-mem-") as tmp:
        argv = [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", sys.executable,
                str(HERE), "--worker", tmp, "--dim", str(dim), "--rows", str(rows)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the job exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--src", default=str(SRC), help="the pskv source tree the job imports")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=10_000_000, help="the spec's reserve_rows")
    ap.add_argument("--local", action="store_true",
                    help="also measure one process's DynamicTable of the spec")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dim, args.rows)
        return 0
    print(f"src={args.src} TableSpec(dim={args.dim}, reserve_rows={args.rows:_}), "
          "2 workers, 2 servers, dist_sync")
    for r in run(args.src, args.dim, args.rows, args.timeout):
        print(f"worker {r['rank']}: VmRSS {r['before_mib']:.1f} -> {r['after_init_mib']:.1f} "
              f"MiB after init (+{r['after_init_mib'] - r['before_mib']:.1f}), "
              f"{r['after_lookup_mib']:.1f} after a lookup of 1000 IDs; holds {r['holds']}")
    if args.local:
        sys.path.insert(0, args.src)
        print(f"one process's DynamicTable of the spec: +{local(args.dim, args.rows):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
