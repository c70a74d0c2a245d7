"""What durability costs: throughput with PSKV_REPLICAS=1 against 0, and a snapshot's pause.

Run from the repository root::

    python benchmarks/bench_durability.py            # full run, several minutes on 2 cores
    python benchmarks/bench_durability.py --quick    # smoke run, well under a minute
    python benchmarks/bench_durability.py --cpu --steps 10      # CPU seconds per step
    python benchmarks/bench_durability.py --cpu --profile prof  # and cProfile dumps
    python benchmarks/bench_durability.py --cpu --rounds 3 --against ../main/src  # A/B

CPU (``--cpu``): the same jobs, but what is reported is the CPU time (user + system, from
``/proc``) that every process of the job (scheduler, servers with their backup threads,
workers) spent over the timed steps, per step, and the replication cost it predicts,
``1 - cpu(replicas 0) / cpu(replicas 1)``: on a CPU-bound machine (these jobs on 2 cores)
that is the share of throughput replication takes, and unlike steps/s it barely moves
when other programs load the machine. With ``--profile DIR`` every thread of every server
and worker runs under cProfile (``_profiled.py``), one dump per thread in
``DIR/<workload>-r<replicas>/``; merge them with ``pstats``.

Throughput: one ``dist_sync`` job per (workload, replicas) through ``pskv.launch.launch``
(a scheduler, 2 servers, 2 workers on this machine, the default transport); each worker
times push-then-pull steps of the workload and rank 0 reports steps/s. Workloads: the
161 parameter tensors of ResNet-50 v1 (``_dist_worker.resnet50_shapes``, with SGD on the
servers), and 64 MB keys (split across both servers). Jobs with and without replicas
alternate, so machine load falls on both alike.

Snapshot pause: the time ``Engine.snapshot()`` takes, in this process, on an engine holding
the same shard (with SGD momentum states): that copy is the only time a server stops
serving for a checkpoint (the write happens on a thread). Reported per 100 MB of shard.

Results go to ``benchmarks/results/bench_durability.json`` and ``.md`` with the machine,
the commit and the command line. The issue's aims (replication costs at most 25% of
throughput; a pause under 50 ms per 100 MB) are reported as PASS or MISS, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import _common
import _dist_worker

MB = 1 << 20
BIG = 16 * MB          # float32 elements of a 64 MB key


def shapes_of(workload: str, quick: bool) -> list[tuple[int, ...]]:
    """The key shapes of a workload."""
    if workload == "resnet50":
        return [tuple(s) for s in _dist_worker.resnet50_shapes()]
    return [(BIG // 4,)] * 2 if quick else [(BIG,)] * 4


# ---- the worker side (run by pskv-launch) ------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def job_cpu_seconds() -> float:
    """CPU seconds used so far by every process of this job: the launcher's children (the
    scheduler, the servers and the workers are all started by one ``launch``) that have
    this job's scheduler port (a driver may run several jobs at once)."""
    launcher, total = os.getppid(), 0.0
    mark = f"DMLC_PS_ROOT_PORT={os.environ.get('DMLC_PS_ROOT_PORT', '')}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and \
                    mark in (entry / "environ").read_bytes().split(b"\0"):
                total += _cpu_seconds(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue        # it exited meanwhile
    return total


def worker(out: str, workload: str, steps: int, quick: bool, loop: str = "push-pull",
           warmup: int = 1) -> None:
    """Time ``steps`` push+pull steps; rank 0 writes seconds per step to ``out``, and the
    job's CPU seconds per step over them (every process of the job)."""
    import pskv as mx
    kv = mx.kv.create("dist_sync")
    shapes = shapes_of(workload, quick)
    keys = list(range(len(shapes)))
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9))
    grads = [mx.nd.ones(s) for s in shapes]
    outs = [mx.nd.zeros(s) for s in shapes]
    times = []
    cpu0 = 0.0
    for step in range(steps + warmup):      # the first steps warm up (buffers, pools, logs)
        if step == warmup:
            kv.barrier()                     # every process is past its warm-up
            time.sleep(0.2)                  # a backup applies the last round after its ack
            cpu0 = job_cpu_seconds() if kv.rank == 0 else 0.0
        t0 = time.perf_counter()
        if loop == "pushpull":
            kv.pushpull(keys, grads, out=outs)
        else:
            kv.push(keys, grads)
            kv.pull(keys, out=outs)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    kv.barrier()
    time.sleep(0.2)
    if kv.rank == 0:
        cpu = (job_cpu_seconds() - cpu0) / steps
        Path(out).write_text(json.dumps({"seconds_per_step": statistics.median(times),
                                         "cpu_seconds_per_step": cpu}))
    kv.close()


# ---- the driver ----------------------------------------------------------------------------
def run_job(workload: str, replicas: int, steps: int, quick: bool,
            profile: str | None = None, loop: str = "push-pull",
            warmup: int = 1, src: str | None = None) -> dict[str, float]:
    """One job: its rank 0's seconds per step (median) and the job's CPU seconds per step.
    ``profile``: a directory for cProfile dumps of every thread of its servers and workers."""
    from pskv.launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        argv = [sys.executable, __file__, "--worker", out, workload, str(steps),
                "--loop", loop, "--warmup", str(warmup)]
        if quick:
            argv.append("--quick")
        extra: dict[str, Any] = {}
        if profile is not None:
            where = str(Path(profile) / f"{workload}-r{replicas}")
            wrap = [sys.executable, str(Path(__file__).with_name("_profiled.py")), where]
            argv = wrap + argv[1:]
            extra["server_command"] = wrap + ["-m", "pskv.server"]
        env = {"PSKV_REPLICAS": str(replicas)}
        if src is not None:             # another source tree's pskv (--against)
            env["PYTHONPATH"] = src
            extra["stdout"] = extra["stderr"] = open(os.devnull, "w")
        result = launch(argv, 2, 2, env=env, timeout=900, **extra)
        if result.returncode != 0:
            raise RuntimeError(f"the {workload} job with PSKV_REPLICAS={replicas} failed "
                               f"with status {result.returncode}")
        got: dict[str, float] = json.loads(Path(out).read_text())
        return got


def throughput(workload: str, replicas: int, steps: int, quick: bool,
               loop: str = "push-pull") -> float:
    """Steps per second of one job."""
    return 1.0 / run_job(workload, replicas, steps, quick, loop=loop)["seconds_per_step"]


def cpu_per_step(workload: str, replicas: int, steps: int, quick: bool,
                 profile: str | None, loop: str) -> float:
    """CPU seconds per step of one job, summed over all its processes."""
    # warmed up past the first whole states a backup gets (kvstore/durable/_backup_log.py), so
    # that its buffers are reused as they are in a long job
    return run_job(workload, replicas, steps, quick, profile, loop,
                   warmup=6)["cpu_seconds_per_step"]


def snapshot_pause(workload: str, quick: bool, repeats: int) -> dict[str, float]:
    """Seconds ``Engine.snapshot()`` pauses for half the workload's keys (one server's
    shard of two), and that per 100 MB."""
    import pskv as mx
    from pskv.kvstore.engine._core import Engine
    engine = Engine(num_workers=1)
    engine.set_optimizer_spec(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9).to_spec())
    shard_bytes = 0
    for i, shape in enumerate(shapes_of(workload, quick)[::2]):
        engine.init(i, np.zeros(shape, np.float32))
        engine.apply(i, mx.nd.ones(shape))       # creates the momentum state
        shard_bytes += 2 * int(np.prod(shape)) * 4
    pauses = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.snapshot()
        pauses.append(time.perf_counter() - t0)
    pause = statistics.median(pauses)
    return {"shard_mb": shard_bytes / MB, "pause_ms": pause * 1e3,
            "pause_ms_per_100mb": pause * 1e3 * 100 * MB / shard_bytes}


def render(data: dict[str, Any], header: list[str], rows: list[list[str]]) -> str:
    """The results as markdown: how they were taken, the table, what the cost is made of."""
    c, m = data["commit"], data["machine"]
    commit = f"{c['commit']}{' (result files modified)' if c.get('dirty') else ''}"
    return (f"# bench_durability\n\n- command: `{data['command']}`\n- commit: {commit}; run at "
            f"{data['time']}\n- machine: {m['cpu_model']}, {m['cpu_count']} CPUs, "
            f"{m['mem_total_gib']} GiB, {m['platform']}, Python {m['python']}, NumPy "
            f"{m['numpy']}; load average at start {m['loadavg_at_start']}\n- jobs: a scheduler, "
            "2 servers and 2 workers on this host, dist_sync, SGD with momentum on the servers; "
            f"replicas 0 and 1 alternate, {data.get('rounds', 3)} rounds, the median of each; "
            "each step is "
            "`kv.push` of every key then `kv.pull` (rows marked `pushpull`: one "
            "`kv.pushpull`, as gluon's Trainer and pskv.torch do)\n\n"
            + _common.md_table(header, rows) + "\n\n" + COST_NOTE)


#: what replication's cost is made of on this machine (py-spy of workers and servers)
COST_NOTE = """\
Where the replication cost goes (`--cpu --profile DIR`: cProfile of every thread, CPU
time): the job is CPU-bound on 2 cores shared by 4 processes, so extra work is lost
throughput. Replication adds, per step, the worker's copy of every push it may have to
send again (none for a `pushpull`, nor for these pushes of NDArrays that the loop writes
only after pulling: their buffers are lent, docs/durability.md), each server's send of every applied round to its
backup (every 4th round of a key: its value and optimizer state instead), and the
backup's receive of it into a reused buffer; the rounds one request closes go to the
backup as one message with one acknowledgment. The backup no longer runs the optimizer
on each round: it logs them and applies them on a takeover (docs/durability.md). The
pause of a checkpoint is the in-memory copy of the shard (values and momentum); the write
happens on a thread.
"""


def cpu_pairs(args: argparse.Namespace, steps: int, rounds: int) -> int:
    """``--cpu --against SRC``: each job runs at the same time as the same job on the pskv
    of ``SRC`` (a ``src`` directory of another checkout), so both meet the same load; the
    CPU seconds per step and the predicted cost of both."""
    import threading
    trees = {"this": str(Path(__file__).resolve().parent.parent / "src"),
             "against": str(Path(args.against).resolve())}
    rows = []
    for workload in args.workload or ("resnet50", "64mb"):
        got: dict[tuple[str, int], list[float]] = {(t, r): [] for t in trees for r in (0, 1)}
        for _ in range(rounds):
            for replicas in (0, 1):
                def one(tree: str, replicas: int = replicas) -> None:
                    got[(tree, replicas)].append(run_job(
                        workload, replicas, steps, args.quick, loop=args.loop, warmup=6,
                        src=trees[tree])["cpu_seconds_per_step"])
                threads = [threading.Thread(target=one, args=(t,)) for t in trees]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        for tree in trees:
            base = statistics.median(got[(tree, 0)])
            repl = statistics.median(got[(tree, 1)])
            rows.append([f"{workload} ({args.loop})", tree, f"{base:.3f}", f"{repl:.3f}",
                         f"{1 - base / repl:.0%}"])
    print(_common.text_table(["workload (loop)", "tree", "CPU s/step, replicas 0",
                              "CPU s/step, replicas 1", "predicted cost"], rows))
    return 0


def cpu_main(args: argparse.Namespace) -> int:
    """``--cpu``: CPU seconds per step, replicas 0 and 1, and the cost they predict."""
    steps = args.steps or (2 if args.quick else 10)
    rounds = args.rounds or 1
    if args.against:
        return cpu_pairs(args, steps, rounds)
    rows, data = [], {"machine": _common.machine_info(), "commit": _common.commit_info(),
                      "command": _common.command_line(), "time": _common.timestamp(),
                      "steps": steps, "rounds": rounds, "loop": args.loop, "results": {}}
    for workload in args.workload or ("resnet50", "64mb"):
        got: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(rounds):
            for replicas in (0, 1):
                got[replicas].append(cpu_per_step(workload, replicas, steps, args.quick,
                                                  args.profile, args.loop))
        base, repl = statistics.median(got[0]), statistics.median(got[1])
        cost = 1 - base / repl
        data["results"][workload] = {"cpu_seconds_per_step": {"replicas_0": got[0],
                                                              "replicas_1": got[1]},
                                     "predicted_cost": cost}
        rows.append([f"{workload} ({args.loop})", f"{base:.3f}", f"{repl:.3f}",
                     f"{cost:.0%}", "PASS" if cost <= 0.25 else "MISS"])
    header = ["workload (loop)", "CPU s/step, replicas 0", "CPU s/step, replicas 1",
              "predicted cost", "<= 25%"]
    print(_common.text_table(header, rows))
    if args.write:
        c = data["commit"]
        commit = f"{c['commit']}{' (result files modified)' if c.get('dirty') else ''}"
        _common.write_results("bench_durability_cpu", data, (
            f"# bench_durability --cpu\n\n- command: `{data['command']}`\n- commit: {commit}; "
            f"run at {data['time']}\n- jobs: as bench_durability.md; {steps} timed steps, "
            f"{rounds} job(s) per replicas setting, the median\n- CPU: user + system seconds "
            "of every process of the job over the timed steps, per step; predicted cost = "
            "1 - cpu(replicas 0) / cpu(replicas 1)\n\n" + _common.md_table(header, rows)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--cpu", action="store_true",
                   help="report CPU seconds per step of the whole job instead of steps/s")
    p.add_argument("--steps", type=int, default=0, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=0, help="jobs per replicas setting")
    p.add_argument("--workload", action="append", choices=("resnet50", "64mb"),
                   help="only this workload (repeatable)")
    p.add_argument("--profile", metavar="DIR",
                   help="with --cpu: cProfile every thread of the servers and workers")
    p.add_argument("--loop", choices=("push-pull", "pushpull"), default=None,
                   help="each step is kv.push then kv.pull, or one kv.pushpull (what "
                        "gluon's Trainer and pskv.torch call); default: both for the "
                        "throughput table, push-pull with --cpu")
    p.add_argument("--against", metavar="SRC",
                   help="with --cpu: run each job at the same time as the same job on the "
                        "pskv of SRC (another checkout's src directory): same load for both")
    p.add_argument("--write", action="store_true",
                   help="with --cpu: write results/bench_durability_cpu.{json,md}")
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=3, metavar=("OUT", "WORKLOAD", "STEPS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.cpu:
        args.loop = args.loop or "push-pull"
    if args.worker:
        out, workload, steps = args.worker
        worker(out, workload, int(steps), args.quick, args.loop, args.warmup)
        return 0
    if args.cpu:
        return cpu_main(args)
    steps, rounds, repeats = (2, 1, 3) if args.quick else (30, 3, 10)
    steps, rounds = args.steps or steps, args.rounds or rounds
    rows, data = [], {"machine": _common.machine_info(), "commit": _common.commit_info(),
                      "command": _common.command_line(), "time": _common.timestamp(),
                      "results": {}}
    loops = [args.loop] if args.loop else ["push-pull", "pushpull"]
    for workload, loop in ((w, lp) for w in args.workload or ("resnet50", "64mb")
                           for lp in loops):
        got: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(rounds):
            for replicas in (0, 1):
                got[replicas].append(throughput(workload, replicas, steps, args.quick, loop))
        base, repl = statistics.median(got[0]), statistics.median(got[1])
        pause = snapshot_pause(workload, args.quick, repeats)
        cost = 1 - repl / base
        name = workload if loop == "push-pull" else f"{workload} ({loop})"
        data["results"][name] = {"steps_per_s": {"replicas_0": base, "replicas_1": repl},
                                 "replication_cost": cost, "snapshot": pause, "loop": loop}
        rows.append([name, f"{base:.2f}", f"{repl:.2f}", f"{cost:.0%}",
                     "PASS" if cost <= 0.25 else "MISS", f"{pause['shard_mb']:.0f}",
                     f"{pause['pause_ms']:.1f}", f"{pause['pause_ms_per_100mb']:.1f}",
                     "PASS" if pause["pause_ms_per_100mb"] < 50 else "MISS"])
    header = ["workload", "steps/s, replicas 0", "steps/s, replicas 1", "cost",
              "<= 25%", "shard MB", "snapshot pause ms", "ms per 100 MB", "< 50 ms"]
    print(_common.text_table(header, rows))
    data["rounds"] = rounds
    markdown = render(data, header, rows)
    if not args.quick:
        _common.write_results("bench_durability", data, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
