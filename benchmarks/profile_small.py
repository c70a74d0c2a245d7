"""Micro-profile of the small-message path: one (2, 3) float32 key, push + pull, dist_sync.

A scheduler, ``S`` servers (``python -m pskv.server``) and one worker run as processes of
this host over the default transport; the worker times ``rounds`` rounds of ``iters``
push+pull iterations and prints the median microseconds per iteration (and each round's),
and the CPU time per iteration that the worker and the servers spent in those rounds
(user + system, from ``/proc`` where there is one): on a busy machine the CPU figures move
far less than the wall time.
With ``--profile`` the worker's loop and every server run under cProfile, and the top
functions by own time (tottime) of each side are printed: call counts and tottime are far
less sensitive to a noisy machine than wall time.

    python benchmarks/profile_small.py                       # S=1 and S=2, timings only
    python benchmarks/profile_small.py --servers 1 --profile # plus cProfile top-20 per side
    python benchmarks/profile_small.py --shape 1024 --iters 500         # a 4 KB key
    python benchmarks/profile_small.py --shape 1000 --keys 1000 --iters 10 --rounds 3

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


def worker(iters: int, rounds: int, prof: str | None, shape: tuple[int, ...] = SHAPE,
           nkeys: int = 1) -> None:
    """The worker process: time the loop, print one JSON line of results."""
    import numpy as np

    import pskv as mx

    kv = mx.kv.create("dist_sync")
    key: Any = 3 if nkeys == 1 else list(range(3, 3 + nkeys))
    val: Any = mx.nd.ones(shape) if nkeys == 1 else [mx.nd.ones(shape)] * nkeys
    out: Any = mx.nd.zeros(shape) if nkeys == 1 else [mx.nd.zeros(shape) for _ in range(nkeys)]
    kv.init(key, mx.nd.zeros(shape) if nkeys == 1 else [mx.nd.zeros(shape)] * nkeys)
    for _ in range(max(20, iters // 5)):           # warm up: caches, buffers, branch paths
        kv.push(key, val)
        kv.pull(key, out=out)
    profiler = cProfile.Profile() if prof else None
    per_round: list[float] = []
    print("mark", flush=True)                    # the parent reads the servers' CPU time
    sys.stdin.readline()
    cpu0 = time.process_time()
    for _ in range(rounds):
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        for _ in range(iters):
            kv.push(key, val)
            kv.pull(key, out=out)
        dt = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        per_round.append(dt / iters * 1e6)
    cpu = (time.process_time() - cpu0) / (iters * rounds) * 1e6
    print("mark", flush=True)
    sys.stdin.readline()
    last = out if nkeys == 1 else out[-1]
    if not np.array_equal(last.asnumpy(), np.ones(shape, np.float32)):
        raise SystemExit(f"wrong value pulled: {last.asnumpy()!r}")
    kv.close()
    if profiler is not None and prof:
        profiler.dump_stats(prof)
    print(json.dumps({"us": per_round, "cpu": cpu}), flush=True)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0.0 without /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(servers: int, iters: int, rounds: int, profile_dir: Path | None,
        timeout: float, shape: tuple[int, ...] = SHAPE,
        nkeys: int = 1) -> tuple[list[float], float, float]:
    """One cluster: each round's us/iteration, and the CPU us/iteration of the worker and
    of the servers together."""
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
        argv = [py, __file__, "worker", str(iters), str(rounds),
                str(profile_dir / "worker.prof") if profile_dir is not None else "",
                ",".join(map(str, shape)), str(nkeys)]
        w = subprocess.Popen(argv, env=_env("worker", port, servers), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)
        procs.append(w)
        assert w.stdin is not None and w.stdout is not None
        cpu = []
        for _ in range(2):                           # before and after the timed rounds
            if w.stdout.readline().strip() != b"mark":
                raise SystemExit(f"the worker failed (exit {w.wait(timeout)})")
            cpu.append(sum(_cpu_s(p.pid) for p in procs[1:1 + servers]))
            w.stdin.write(b"go\n")
            w.stdin.flush()
        out = w.stdout.read().decode()
        if w.wait(timeout) != 0:
            raise SystemExit(f"the worker failed (exit {w.returncode})")
        for p in procs:                             # they leave once the worker has
            p.wait(timeout=20)
        got = json.loads(out.strip().splitlines()[-1])
        return list(got["us"]), float(got["cpu"]), (cpu[1] - cpu[0]) / (iters * rounds) * 1e6
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def top(path: Path, n: int, sort: str = "tottime") -> None:
    """Print the ``n`` functions first by ``sort`` (own time) in a cProfile dump."""
    st = pstats.Stats(str(path))
    st.sort_stats(sort).print_stats(n)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "worker":
        worker(int(args[1]), int(args[2]), args[3] or None,
               tuple(int(d) for d in args[4].split(",")), int(args[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", type=int, nargs="+", default=list(SHAPE),
                    help="each key's shape (float32)")
    ap.add_argument("--keys", type=int, default=1, help="keys per push and pull (one list call)")
    ap.add_argument("--profile", action="store_true", help="cProfile worker and servers")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    ap.add_argument("--keep", type=Path, help="keep the .prof files under this folder")
    ap.add_argument("--timeout", type=float, default=300.0)
    opts = ap.parse_args(args)
    summary: dict[str, Any] = {}
    for s in opts.servers:
        with tempfile.TemporaryDirectory(prefix="pskv-prof-") as tmp:
            pdir = (opts.keep / f"S{s}" if opts.keep else Path(tmp)) if opts.profile else None
            if pdir is not None:
                pdir.mkdir(parents=True, exist_ok=True)
            us, wcpu, scpu = run(s, opts.iters, opts.rounds, pdir, opts.timeout,
                                 tuple(opts.shape), opts.keys)
            med = statistics.median(us)
            summary[f"S={s}"] = {"us": round(med, 1), "worker_cpu": round(wcpu, 1),
                                 "server_cpu": round(scpu, 1)}
            print(f"S={s}: median {med:.1f} us/iteration (push+pull of {opts.keys} x {tuple(opts.shape)}); CPU "
                  f"us/iteration: worker {wcpu:.1f}, servers {scpu:.1f}; rounds: "
                  + " ".join(f"{u:.1f}" for u in us), flush=True)
            if pdir is not None:
                print(f"---- worker, S={s} (top {opts.top} by {opts.sort})")
                top(pdir / "worker.prof", opts.top, opts.sort)
                for i in range(s):
                    print(f"---- server {i}, S={s} (top {opts.top} by {opts.sort})")
                    top(pdir / f"server{i}.prof", opts.top, opts.sort)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
