"""Launcher start-up benchmark: how long ``pskv-launch`` takes to run a trivial job, local
launcher against the ray launcher on a local Ray it starts for the job.

Run from the repository root::

    python benchmarks/bench_launch.py            # 5 runs of each, alternated
    python benchmarks/bench_launch.py --quick    # 1 run of each

The job: 2 workers and 1 server in ``dist_sync``, each worker one init, push and pull of a
3-element key, then exit. The figure is the wall time of the whole ``pskv-launch`` command,
from its start to its exit (Ray's own start and stop included, since a user waits for
them), with the local launcher's time in the same run as the reference. Ray's parts are
timed alone as well (``ray.init`` of a local cluster, four actors answering, ``ray.shutdown``)
so the launcher's own share shows. Results go to ``benchmarks/results/bench_launch.{json,md}``.
Needs Ray (``pip install 'pskv[ray]'``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import _common

JOB = ("import pskv as mx, numpy as np\n"
       "kv = mx.kv.create('dist_sync'); kv.init(0, np.ones(3))\n"
       "kv.push(0, np.ones(3)); kv.pull(0, out=np.zeros(3))")

RAY_PARTS = ("import logging, os, time, json\n"
             "t0 = time.perf_counter(); import ray\n"
             "ray.init(num_cpus=os.cpu_count(), include_dashboard=False,\n"
             "         object_store_memory=80 * 2**20, logging_level=logging.WARNING,\n"
             "         log_to_driver=False)\n"
             "t1 = time.perf_counter()\n"
             "A = ray.remote(num_cpus=0)(type('A', (), {'f': lambda self: os.getpid()}))\n"
             "acts = [A.remote() for _ in range(4)]; ray.get([a.f.remote() for a in acts])\n"
             "t2 = time.perf_counter(); ray.shutdown(); t3 = time.perf_counter()\n"
             "print(json.dumps({'import_init': t1 - t0, 'actors': t2 - t1, "
             "'shutdown': t3 - t2}))")


def launch(launcher: str, timeout: float = 240) -> float:
    """Seconds one ``pskv-launch`` of the trivial job takes; raises on failure."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-m", "pskv.launch", "--launcher", launcher, "--timeout",
            str(int(timeout - 30)), "-n", "2", "-s", "1", sys.executable, "-c", JOB]
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                       start_new_session=True)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{launcher} launch failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return took


def ray_parts(timeout: float = 120) -> dict[str, float]:
    import json
    p = subprocess.run([sys.executable, "-c", RAY_PARTS], capture_output=True, text=True,
                       timeout=timeout, start_new_session=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    result: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each")
    args = parser.parse_args(argv)
    runs = 1 if args.quick else 5
    times: dict[str, list[float]] = {"local": [], "ray": []}
    parts: list[dict[str, float]] = []
    for _ in range(runs):
        for launcher in ("local", "ray"):
            times[launcher].append(launch(launcher))
        parts.append(ray_parts())
    med = {k: statistics.median(v) for k, v in times.items()}
    part_med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    data = {"machine": _common.machine_info(), "commit": _common.commit_info(),
            "command": _common.command_line(argv), "when": _common.timestamp(),
            "runs": times, "ray_parts": parts, "median_s": med, "ray_parts_median_s": part_med}
    rows = [["local launcher", f"{med['local']:.2f}", "1.00"],
            ["ray launcher (local Ray)", f"{med['ray']:.2f}", f"{med['ray'] / med['local']:.2f}"]]
    prow = [[k, f"{v:.2f}"] for k, v in part_med.items()]
    md = "\n".join([
        "# Launcher start-up (benchmarks/bench_launch.py)", "",
        f"Commit {data['commit'].get('commit')}, {data['when']}, {data['machine']['cpu_model']}"
        f" x{data['machine']['cpu_count']}, load at start {data['machine']['loadavg_at_start']}.",
        f"Command: `{data['command']}`; {runs} runs of each, alternated.", "",
        "Wall time of `pskv-launch -n 2 -s 1` running a trivial dist_sync job (medians):", "",
        _common.md_table(["launcher", "seconds", "x local"], rows), "",
        "Ray's own parts, timed alone (medians, seconds): a local `ray.init`, four actors "
        "answering once, `ray.shutdown`:", "",
        _common.md_table(["part", "seconds"], prow), ""])
    if not args.quick:
        _common.write_results("bench_launch", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
