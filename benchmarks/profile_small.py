"""Micro-profile of the small-message path: one (2, 3) float32 key, push + pull, dist_sync.

A scheduler, ``S`` servers (``python -m pskv.server``) and one worker run as processes of
this host over the default transport; the worker times ``rounds`` rounds of ``iters``
push+pull iterations and prints the median microseconds per iteration (and each round's).
With ``--profile`` the worker's loop and every server run under cProfile, and the top
functions by own time (tottime) of each side are printed: call counts and tottime are far
less sensitive to a noisy machine than wall time.

    python benchmarks/profile_small.py                       # S=1 and S=2, timings only
    python benchmarks/profile_small.py --servers 1 --profile # plus cProfile top-20 per side

Not a benchmark of record (nothing is written to results/); compare builds by running them
alternately (A/B/A/B) and comparing medians.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = (2, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(role: str, port: int, servers: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": str(servers),
                "DMLC_NUM_WORKER": "1", "DMLC_NODE_HOST": "127.0.0.1",
                "PYTHONDONTWRITEBYTECODE": "1"})
    return env


def worker(iters: int, rounds: int, prof: str | None) -> None:
    """The worker process: time the loop, print one JSON line of results."""
    import numpy as np

    import pskv as mx

    kv = mx.kv.create("dist_sync")
    val = mx.nd.ones(SHAPE)
    out = mx.nd.zeros(SHAPE)
    kv.init(3, mx.nd.zeros(SHAPE))
    for _ in range(max(200, iters // 5)):          # warm up: caches, buffers, branch paths
        kv.push(3, val)
        kv.pull(3, out=out)
    profiler = cProfile.Profile() if prof else None
    per_round: list[float] = []
    for _ in range(rounds):
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        for _ in range(iters):
            kv.push(3, val)
            kv.pull(3, out=out)
        dt = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        per_round.append(dt / iters * 1e6)
    if not np.array_equal(out.asnumpy(), np.ones(SHAPE, np.float32)):
        raise SystemExit(f"wrong value pulled: {out.asnumpy()!r}")
    kv.close()
    if profiler is not None and prof:
        profiler.dump_stats(prof)
    print(json.dumps({"us": per_round}), flush=True)


def run(servers: int, iters: int, rounds: int, profile_dir: Path | None,
        timeout: float) -> list[float]:
    """One cluster: return each round's us/iteration."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    py = sys.executable
    try:
        procs.append(subprocess.Popen([py, "-m", "pskv.server"],
                                      env=_env("scheduler", port, servers),
                                      start_new_session=True))
        for i in range(servers):
            pre = [py] if profile_dir is None else \
                [py, "-m", "cProfile", "-o", str(profile_dir / f"server{i}.prof")]
            procs.append(subprocess.Popen(pre + ["-m", "pskv.server"],
                                          env=_env("server", port, servers),
                                          start_new_session=True))
        argv = [py, __file__, "worker", str(iters), str(rounds)]
        if profile_dir is not None:
            argv.append(str(profile_dir / "worker.prof"))
        got = subprocess.run(argv, env=_env("worker", port, servers), timeout=timeout,
                             capture_output=True, check=False)
        if got.returncode != 0:
            raise SystemExit(f"worker failed:\n{got.stderr.decode()[-3000:]}")
        for p in procs:                             # they leave once the worker has
            p.wait(timeout=20)
        return list(json.loads(got.stdout.decode().strip().splitlines()[-1])["us"])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def top(path: Path, n: int) -> None:
    """Print the ``n`` functions with the most own time in a cProfile dump."""
    st = pstats.Stats(str(path))
    st.sort_stats("tottime").print_stats(n)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "worker":
        worker(int(args[1]), int(args[2]), args[3] if len(args) > 3 else None)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile worker and servers")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=300.0)
    opts = ap.parse_args(args)
    summary: dict[str, Any] = {}
    for s in opts.servers:
        with tempfile.TemporaryDirectory(prefix="pskv-prof-") as tmp:
            pdir = Path(tmp) if opts.profile else None
            us = run(s, opts.iters, opts.rounds, pdir, opts.timeout)
            med = statistics.median(us)
            summary[f"S={s}"] = med
            print(f"S={s}: median {med:.1f} us/iteration (push+pull of {SHAPE}); rounds: "
                  + " ".join(f"{u:.1f}" for u in us), flush=True)
            if pdir is not None:
                print(f"---- worker, S={s} (top {opts.top} by tottime)")
                top(pdir / "worker.prof", opts.top)
                for i in range(s):
                    print(f"---- server {i}, S={s} (top {opts.top} by tottime)")
                    top(pdir / f"server{i}.prof", opts.top)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
