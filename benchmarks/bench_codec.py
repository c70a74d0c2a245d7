"""Throughput of pskv's gradient compression codecs (2bit and 1bit), in GB/s of float32 input.

Times ``compress``, ``decompress`` and ``roundtrip`` on 1M and 16M float32 values, and
NumPy's plain copy of the same array in the same run as the reference bandwidth of this
machine. Writes ``benchmarks/results/codec.json`` and ``codec.md`` with the machine,
the git commit and the command.

Usage::

    python benchmarks/bench_codec.py [--repeat 7] [--sizes 1048576 16777216]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pskv.compression import create

__all__ = ["main"]

HERE = Path(__file__).resolve().parent


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def git_commit() -> str:
    """The commit of the checkout (with ``-dirty`` if it has changes), or ``unknown``."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, capture_output=True, text=True, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")


def run(sizes: list[int], repeat: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    rows: list[dict[str, object]] = []
    for n in sizes:
        grad = rng.standard_normal(n).astype(np.float32)
        nbytes = grad.nbytes
        copy_out = np.empty_like(grad)
        copy_s = best_seconds(lambda: np.copyto(copy_out, grad), repeat)
        for params in ({"type": "2bit", "threshold": 0.5}, {"type": "1bit", "threshold": 0.0}):
            gc = create(params)
            assert gc is not None
            residual = np.zeros(n, np.float32)
            packed = np.empty(gc.packed_size(n), np.float32)
            out = np.empty(n, np.float32)
            timings = {
                "compress": best_seconds(lambda: gc.compress(grad, residual, out=packed),
                                         repeat),
                "decompress": best_seconds(lambda: gc.decompress(packed, n, out=out), repeat),
                "roundtrip": best_seconds(lambda: gc.roundtrip(grad, residual, out=out),
                                          repeat),
            }
            row: dict[str, object] = {"type": gc.type, "size": n, "bytes": nbytes,
                                      "copy_gbps": nbytes / copy_s / 1e9}
            for name, seconds in timings.items():
                row[f"{name}_gbps"] = nbytes / seconds / 1e9
                row[f"{name}_ms"] = seconds * 1e3
            rows.append(row)
    return {
        "benchmark": "codec",
        "command": " ".join(["python", "benchmarks/bench_codec.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "numpy": np.__version__},
        "unit": "GB/s of float32 input (1 GB = 1e9 bytes); best of repeats",
        "repeat": repeat,
        "results": rows,
    }


def to_markdown(report: dict[str, object]) -> str:
    machine = report["machine"]
    assert isinstance(machine, dict)
    lines = [
        "# Gradient compression codec throughput",
        "",
        f"- command: `{report['command']}`",
        f"- commit: `{report['commit']}`",
        f"- machine: {machine['platform']}, {machine['cpu_count']} CPUs, "
        f"Python {machine['python']}, NumPy {machine['numpy']}",
        f"- unit: {report['unit']}",
        "",
        "| type | values | compress | decompress | roundtrip | NumPy copy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    results = report["results"]
    assert isinstance(results, list)
    for row in results:
        lines.append(f"| {row['type']} | {row['size']:,} | {row['compress_gbps']:.2f} | "
                     f"{row['decompress_gbps']:.2f} | {row['roundtrip_gbps']:.2f} | "
                     f"{row['copy_gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    report = run(args.sizes, args.repeat)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "codec.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(report)
    (args.out_dir / "codec.md").write_text(markdown)
    sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
