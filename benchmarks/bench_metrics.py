"""Metrics benchmark: what PSKV_METRICS_PORT (Prometheus /metrics on every node) costs.

Run from the repository root::

    python benchmarks/bench_metrics.py            # full run, a few minutes on 2 cores
    python benchmarks/bench_metrics.py --quick    # smoke run, seconds; writes no results
    python benchmarks/bench_metrics.py --profile  # calls per push+pull, off and on (cProfile)

One small job per setting (a scheduler, one server, one ``dist_sync`` worker on this host's
default transport), with metrics off and on (each node then counts every request and serves
``/metrics``; a scraper thread reads every node's endpoint once a second, as Prometheus
would), run two ways: as ``pskv-launch`` runs a job (``processes``: each node its own
process, as users run pskv) and as threads of this process (``threads``: every node's hooks
share one interpreter lock, so each hook's cost lands on the round trip: the worst case).
Figures: microseconds per push+pull of a small key, and MB/s per push+pull of a 64 MB
float32 key. Off and on alternate, several rounds each, in the same run, so machine load
falls on both alike; the aim (issue 18) is within 3 %. Results go to
``benchmarks/results/bench_metrics.{json,md}``.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

import _common

import pskv as mx
from pskv._ps.config import ClusterConfig, Role
from pskv.kvstore.dist import DistKVStore
from pskv.launch._net import free_port
from pskv.server import run_node

#: float32 elements: a small key, and 64 MB
SIZES = {16: "64 B", 16777216: "64 MB"}


def _scrape(first: int, stop: threading.Event) -> None:
    """Read every node's /metrics once a second, as a Prometheus server would."""
    while not stop.wait(1.0):
        for port in range(first, first + 4):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    r.read()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass


def job(metrics: bool, size: int, iters: int) -> list[float]:
    """Seconds per push+pull of a ``size``-element key, one sample per iteration."""
    port = free_port() if metrics else 0
    cfg = ClusterConfig(role=Role.WORKER, root_port=free_port(), secret=b"bench",
                        connect_timeout=30, request_timeout=120, metrics_port=port)
    stop, scraping = threading.Event(), threading.Event()
    nodes = [threading.Thread(target=run_node, args=(cfg.with_role(role), stop), daemon=True)
             for role in (Role.SCHEDULER, Role.SERVER)]
    for t in nodes:
        t.start()
    scraper = threading.Thread(target=_scrape, args=(port, scraping), daemon=True)
    kv = DistKVStore("dist_sync", cfg)
    try:
        if metrics:
            scraper.start()
        return _common.push_pull_samples(kv, mx.nd, size, iters)
    finally:
        scraping.set()
        kv.close()
        for t in nodes:
            t.join(30)
        stop.set()
        if scraper.is_alive():
            scraper.join(10)


def child(size: int, iters: int) -> int:
    """The worker of a ``processes`` job (under ``pskv-launch``): prints its samples."""
    kv = mx.kv.create("dist_sync")
    try:
        samples = _common.push_pull_samples(kv, mx.nd, size, iters)
        print("SAMPLES " + json.dumps(samples), flush=True)
    finally:
        kv.close()
    return 0


def job_processes(metrics: bool, size: int, iters: int, timeout: float = 300.0) \
        -> list[float]:
    """As :func:`job`, each node a process of ``pskv-launch -n 1 -s 1``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSKV_METRICS")}
    port = free_port() if metrics else 0
    if metrics:
        env["PSKV_METRICS_PORT"] = str(port)
    argv = [sys.executable, "-m", "pskv.launch", "-n", "1", "-s", "1", sys.executable,
            __file__, "--child", str(size), str(iters)]
    scraping = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(port, scraping), daemon=True)
    if metrics:
        scraper.start()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        scraping.set()
        if scraper.is_alive():
            scraper.join(10)
    for line in out.splitlines():
        if "SAMPLES " in line:
            return [float(x) for x in json.loads(line.split("SAMPLES ", 1)[1])]
    raise RuntimeError(f"the job printed no samples (exit {proc.returncode}): "
                       f"{(out + err)[-2000:]}")


def profile(iters: int = 2000) -> dict[str, dict[str, float]]:
    """Python-level calls per push+pull of a small key, per thread, metrics off and on:
    every thread runs under its own cProfile (counts, not times: a busy machine's timings
    say little, the calls a hook adds do not change with load)."""
    out: dict[str, dict[str, float]] = {}
    run = threading.Thread.run
    for metrics in (False, True):
        profs: list[tuple[str, cProfile.Profile]] = []

        def profiled(self: threading.Thread) -> None:
            prof = cProfile.Profile()
            target = getattr(self, "_target", None)
            args: tuple[Any, ...] = getattr(self, "_args", ())
            name = (f"{args[0].role.value}" if target is run_node else
                    "scrapes" if "_scrape" in self.name or "process_request" in self.name
                    else "metrics endpoints" if self.name.startswith("pskv-metrics")
                    else self.name)
            profs.append((name, prof))
            prof.enable()
            try:
                run(self)
            finally:
                prof.disable()

        threading.Thread.run = profiled  # type: ignore[method-assign]
        main_prof = cProfile.Profile()
        profs.append(("worker (main thread)", main_prof))
        try:
            main_prof.enable()
            job(metrics, 16, iters)
            main_prof.disable()
        finally:
            threading.Thread.run = run  # type: ignore[method-assign]
        calls: dict[str, float] = {}
        for name, prof in profs:
            prof.create_stats()
            calls[name] = calls.get(name, 0.0) + sum(
                v[1] for v in prof.stats.values()) / iters  # type: ignore[attr-defined]
        out["on" if metrics else "off"] = calls
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (no results)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="off/on pairs per size and way (default 5)")
    parser.add_argument("--ways", default="processes,threads",
                        help="how nodes run: processes, threads or both (default both)")
    parser.add_argument("--profile", action="store_true",
                        help="count calls per push+pull per thread, off and on (no timing)")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child)
    if args.profile:
        got = profile(200 if args.quick else 2000)
        names = sorted(set(got["off"]) | set(got["on"]))
        print(_common.text_table(["thread", "calls off", "calls on", "added"], [
            [n, f"{got['off'].get(n, 0):.1f}", f"{got['on'].get(n, 0):.1f}",
             f"{got['on'].get(n, 0) - got['off'].get(n, 0):+.1f}"] for n in names]))
        return 0
    sizes = {16: "64 B", 65536: "256 KB"} if args.quick else SIZES
    rounds = 1 if args.quick else args.rounds
    ways = {"processes": job_processes, "threads": job}
    chosen = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(chosen) - set(ways))
    if unknown:
        parser.error(f"--ways: unknown {unknown}; choose from {sorted(ways)}")
    header = ["nodes", "key", "metrics off", "metrics on", "time cost (on / off - 1)", "aim"]
    rows: list[list[str]] = []
    data: dict[str, Any] = {
        "machine": _common.machine_info(), "commit": _common.commit_info(),
        "command": _common.command_line(argv), "when": _common.timestamp(), "results": {}}
    for way in chosen:
        for size, label in sizes.items():
            iters = 20 if args.quick else (2000 if size <= 1024 else 20)
            off: list[float] = []
            on: list[float] = []
            for r in range(rounds):        # alternate, and swap who goes first each round
                order = (False, True) if r % 2 == 0 else (True, False)
                for metrics in order:
                    (on if metrics else off).append(
                        statistics.median(ways[way](metrics, size, iters)))
            t_off, t_on = statistics.median(off), statistics.median(on)
            mb = size * 4 / 1e6
            cost = t_on / t_off - 1
            data["results"][f"{way} {label}"] = {
                "nodes": way, "key": label, "off_s": t_off, "on_s": t_on, "cost": cost,
                "off_runs": off, "on_runs": on, "iters": iters}
            cells = [f"{s * 1e6:.0f} us" if size <= 1024 else f"{mb / s:.0f} MB/s"
                     for s in (t_off, t_on)]
            rows.append([way, label, *cells, f"{100 * cost:+.1f} %",
                         "PASS" if cost <= 0.03 else "MISS"])
            print(_common.text_table(header, rows[-1:]), flush=True)
    md = ("# What metrics cost (PSKV_METRICS_PORT)\n\n" + _common.md_table(header, rows) +
          "\n\nOne worker and one server, dist_sync, default transport; `processes`: each "
          "node its own process under `pskv-launch` (as users run pskv), `threads`: every "
          "node a thread of one process (every hook on one interpreter lock: the worst "
          "case). /metrics of every node read once a second while metrics are on. Medians "
          f"of {rounds} alternating off/on jobs per size and way (each job: the median of "
          f"its push+pull times). Aim: within 3 %. Machine: "
          f"{data['machine'].get('cpu_model')}, {data['machine'].get('cpu_count')} cores, "
          f"Python {data['machine'].get('python')}; commit {data['commit']['commit']}, "
          f"{data['when']}. `{data['command']}`\n")
    if not args.quick:
        _common.write_results("bench_metrics", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
