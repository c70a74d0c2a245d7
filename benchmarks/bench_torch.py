"""pskv.torch against torchrun + DDP (gloo): samples/s, final weights, overlap, a 100 MB average.

Run from the repository root (a quiet machine; about 15 minutes on 2 cores)::

    python benchmarks/bench_torch.py                       # the full run
    python benchmarks/bench_torch.py --quick               # a smoke run, tiny sizes, ~2 min
    python benchmarks/bench_torch.py --load 2              # with 2 busy processes alongside

Every case runs both ways in the same invocation, alternated ``--repeats`` times so machine
load falls on both alike: ``pskv-launch -n W -s S python benchmarks/bench_torch.py --worker
pskv ...`` (``pskv.torch.DistributedOptimizer``, ``update_on_kvstore=False``, buckets and
overlap at their defaults, ``op='average'``) and ``torchrun --standalone --nproc-per-node W
benchmarks/bench_torch.py --worker ddp ...`` (``DistributedDataParallel`` over gloo). Both
train the same seeded model on the same batches (each worker its slice of every global
batch), one torch thread per process, with ``torch.optim.SGD(lr, momentum)``.
``--gradient-as-bucket-view`` gives both DDP and pskv ``gradient_as_bucket_view=True``,
``--zero-grads`` makes every run zero its gradients in place (``set_to_none=False``).

Cases: ``mlp202`` (101 Linear layers: 202 tensors, 443k parameters), ``cnn`` (two
convolutions with BatchNorm, buffers broadcast as DDP does), ``transformer`` (one
``nn.TransformerEncoderLayer``, dropout 0), and ``avg100mb`` (one 100 MB float32 tensor
averaged: ``kv.pushpull`` against ``dist.all_reduce``). pskv runs once per
``--collective-bytes`` value (``PSKV_COLLECTIVE_BYTES`` and ``DistributedOptimizer``'s
``collective_bytes``: 0 keeps every key on the servers, 65536 is the optimizer's default;
docs/collective.md).

Reported: median samples/s (models) or ms per average, pskv / DDP, whether rank 0's final
weights (or the average) are bit-identical to DDP's, and the overlap: the share of the
communication time hidden behind backward, ``1 - (backward + step, overlap=True) -
backward(overlap=False)) / step(overlap=False)``, medians of the wall times per step, where
``step`` is what ``opt.step()`` takes (pskv only: DDP has no switch). Each model also
runs once more per repeat with no exchange at all (``--worker solo``: each worker steps
on its own slice, launched as DDP's are; ``--no-ceiling`` skips it): its speed against DDP
is the most that any way of synchronising could reach on this machine, which says whether
the 1.3x aim is reachable here at all.
The CPU time per step of every process of a job (user + system, from ``/proc``, over rank
0's timed steps) is reported per role (workers, servers, scheduler, launcher): on a busy
machine it moves far less than samples/s. ``--load N`` keeps N busy processes running
during every job (the figure "with other work on the machine"). Results go to
``benchmarks/results/bench_torch.json`` (``bench_torch_load<N>.json`` with ``--load``) and
``.md`` with the machine, the commit and the command; the aims (1.3x DDP's samples/s, at most gloo's time for 100 MB) are
reported as PASS or MISS, never asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = ["main"]

MODELS = ("mlp202", "cnn", "transformer")


# ---- CPU accounting: every process of the job, by role ---------------------------------------
def _job_pids() -> list[int]:
    """The launcher (this worker's parent: pskv-launch or torchrun's agent) and everything
    it started, read from ``/proc`` (Linux; empty elsewhere)."""
    pids, todo = [], [os.getppid()]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                todo.extend(int(c) for c in children)
        except OSError:
            continue
    return pids


def _role(pid: int) -> str:
    """``launcher``, ``worker``, ``server`` or ``scheduler`` (``DMLC_ROLE``, or torchrun's
    ``LOCAL_RANK`` for a DDP worker)."""
    if pid == os.getppid():
        return "launcher"
    try:
        env = dict(item.split("=", 1) for item in
                   Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0")
                   if "=" in item)
    except OSError:
        return "other"
    if "DMLC_ROLE" in env:
        return env["DMLC_ROLE"]
    return "worker" if "LOCAL_RANK" in env else "other"


def job_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, threads included) of every process of the job, by pid."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for pid in _job_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (_role(pid), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_per_step(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 steps: int) -> dict[str, float]:
    """CPU milliseconds per step, summed per role and in all (``total``), between two
    :func:`job_cpu` readings."""
    per: dict[str, float] = {}
    for pid, (role, sec) in after.items():
        used = sec - before.get(pid, (role, 0.0))[1]
        per[role] = per.get(role, 0.0) + 1000 * used / steps
    per["total"] = sum(per.values())
    return {k: round(v, 2) for k, v in sorted(per.items())}


# ---- the workers (run under pskv-launch or torchrun) ----------------------------------------
def build(name: str, scale: int) -> tuple[Any, Any]:
    """The model and a function ``batch(step, rows) -> (x, y)`` of the global batch."""
    import torch
    nn = torch.nn
    torch.manual_seed(0)
    if name == "mlp202":
        w = 66
        layers: list[Any] = [nn.Linear(64, w), nn.Tanh()]
        for _ in range(99):
            layers += [nn.Linear(w, w), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(w, 10))
        shape: tuple[int, ...] = (64,)
    elif name == "cnn":
        c = 16 * scale
        model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                              nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
                              nn.BatchNorm2d(2 * c), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(2 * c, 10))
        shape = (3, 32, 32)
    elif name == "transformer":
        d = 128 * scale
        enc = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        model = nn.Sequential(enc, nn.Flatten(), nn.Linear(16 * d, 10))
        shape = (16, d)
    else:
        raise SystemExit(f"unknown model {name!r}")

    def batch(step: int, rows: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn((rows, *shape), generator=g), torch.randint(0, 10, (rows,),
                                                                        generator=g)
    return model, batch


def run_worker(args: argparse.Namespace) -> int:
    """One worker of one case; rank 0 writes ``result.json`` and ``weights.npz`` to --out."""
    import torch
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out)
    result: dict[str, Any] = {}
    if args.worker == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        kv = None
    elif args.worker == "solo":      # the ceiling: the same steps with no exchange at all
        kv = None
    else:
        import pskv as mx
        kv = mx.kv.create("dist_sync")
        rank, world = kv.rank, kv.num_workers
    try:
        if args.model == "avg100mb":
            result, arrays = _average(args, kv, rank, world)
        else:
            result, arrays = _train(args, kv, rank, world)
    finally:
        if kv is not None:
            kv.close()
        elif args.worker == "ddp":
            import torch.distributed as dist
            dist.barrier()            # no rank tears gloo down while another still sends
            dist.destroy_process_group()
    if rank == 0:
        np.savez(out / "weights.npz", *arrays)
        (out / "result.json").write_text(json.dumps(result))
    return 0


def _average(args: argparse.Namespace, kv: Any, rank: int, world: int) \
        -> tuple[dict[str, Any], list[np.ndarray]]:
    import torch
    n = int(args.mb * 2**20) // 4
    src = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
    t = src.clone()
    if kv is not None:
        kv.init("avg", torch.zeros(n))
    times = []
    cpu = {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup and rank == 0:
            cpu = job_cpu()
        t.copy_(src)
        start = time.perf_counter()
        if kv is not None:
            kv.pushpull("avg", t)
        else:
            import torch.distributed as dist
            dist.all_reduce(t)
        t.div_(world)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    result: dict[str, Any] = {"ms": 1000 * statistics.median(times)}
    if rank == 0:
        result["cpu_ms_per_step"] = cpu_per_step(cpu, job_cpu(), args.steps)
    if kv is not None:
        result["collective_keys"] = int(kv._store["avg"].collective)
    return result, [t.numpy()]


def _train(args: argparse.Namespace, kv: Any, rank: int, world: int) \
        -> tuple[dict[str, Any], list[np.ndarray]]:
    import torch
    model, batch = build(args.model, args.scale)
    per = args.batch
    rows = slice(rank * per, (rank + 1) * per)

    def sgd(m: Any) -> Any:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    if args.worker == "solo":
        net, opt = model, sgd(model)
    elif kv is None:
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model,
                                      gradient_as_bucket_view=args.gradient_as_bucket_view)
        opt = sgd(model)
    else:
        import pskv.torch as pt
        net = model
        # the run's PSKV_COLLECTIVE_BYTES is also the optimizer's collective_bytes (0: every
        # bucket on the servers)
        threshold = int(os.environ.get("PSKV_COLLECTIVE_BYTES", "0"))
        opt = pt.DistributedOptimizer(sgd(model), model.named_parameters(), kv,
                                      named_buffers=model.named_buffers(), prefix="main/",
                                      collective_bytes=threshold,
                                      gradient_as_bucket_view=args.gradient_as_bucket_view)

    def steps(net: Any, opt: Any, first: int, count: int) \
            -> tuple[float, list[float], list[float]]:
        """Seconds of the timed steps; per step, backward's and ``opt.step()``'s times."""
        backs, waits = [], []
        start = 0.0
        for i in range(first, first + count):
            if i == first + args.warmup:
                start = time.perf_counter()
                if first == 0 and rank == 0:
                    cpu[0] = job_cpu()
            x, y = batch(i, per * world)
            opt.zero_grad(set_to_none=not args.zero_grads)
            loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            if i >= first + args.warmup:
                backs.append(t1 - t0)
                waits.append(time.perf_counter() - t1)
        return time.perf_counter() - start, backs, waits

    total = args.warmup + args.steps
    cpu: list[dict[int, tuple[str, float]]] = [{}]
    elapsed, backs, waits = steps(net, opt, 0, total)
    result: dict[str, Any] = {
        "samples_per_s": args.steps * per * world / elapsed,
        "step_wait_ms": 1000 * statistics.median(waits),
        "backward_and_step_ms": 1000 * statistics.median(b + w for b, w in zip(backs, waits))}
    if rank == 0:
        # the other workers' timed steps end within a step of these (one sync round)
        result["cpu_ms_per_step"] = cpu_per_step(cpu[0], job_cpu(), args.steps)
    arrays = [p.detach().numpy().copy() for p in model.parameters()]
    if kv is not None:
        result["collective_keys"] = sum(r.collective for r in kv._store.values())
        opt.close()  # type: ignore[attr-defined]
        # the same steps again without overlap: backward then sends nothing, and what
        # step() waits is all the exchange
        plain = pt.DistributedOptimizer(sgd(model), model.named_parameters(), kv,
                                        named_buffers=model.named_buffers(), prefix="plain/",
                                        overlap=False, collective_bytes=threshold,
                                        gradient_as_bucket_view=args.gradient_as_bucket_view)
        _, plain_backs, plain_waits = steps(net, plain, total, total)
        plain.close()  # type: ignore[attr-defined]
        result["backward_no_overlap_ms"] = 1000 * statistics.median(plain_backs)
        result["step_wait_no_overlap_ms"] = 1000 * statistics.median(plain_waits)
    return result, arrays


# ---- the driver ------------------------------------------------------------------------------
#: the run of a model with no exchange at all (each worker steps on its own slice, launched
#: as DDP's are): the samples/s that no way of synchronising can beat on this machine
CEILING = "no exchange (ceiling)"

#: one busy process of ``--load``: spins until its time is up (it ends by itself if the
#: driver is killed before it can end it)
_SPIN = ("import sys, time\n"
         "end = time.monotonic() + float(sys.argv[1])\n"
         "x = 0\n"
         "while time.monotonic() < end:\n"
         "    for i in range(10000):\n"
         "        x = (x * 31 + i) % 1000003\n")


@contextlib.contextmanager
def busy(n: int, seconds: float) -> Iterator[None]:
    """``n`` processes that each keep a core busy while the block runs (other work on the
    machine, for ``--load``); each is ended by its pid afterwards, and ends by itself after
    ``seconds`` in any case."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)],
                              stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _job(kind: str, case: str, args: argparse.Namespace, threshold: int, shm: str = "1") \
        -> tuple[dict[str, Any], list[np.ndarray]]:
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as tmp:
        worker = [str(here), "--worker", kind, "--model", case, "--out", tmp,
                  "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--batch", str(args.batch), "--mb", str(args.mb), "--scale", str(args.scale)]
        worker += ["--gradient-as-bucket-view"] * args.gradient_as_bucket_view
        worker += ["--zero-grads"] * args.zero_grads
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kind == "pskv":
            argv = [sys.executable, "-m", "pskv.launch", "-n", str(args.workers), "-s",
                    str(args.servers), sys.executable, *worker]
            env["PSKV_COLLECTIVE_BYTES"] = str(threshold)
            env["PSKV_COLLECTIVE_SHM"] = shm
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(args.workers), *worker]
        for attempt in range(2):      # a job that fails is run once more, and said so
            proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=args.timeout, check=False)
            if proc.returncode == 0 or attempt:
                break
            print(f"  {kind} {case} exited {proc.returncode}; once more: "
                  f"{(proc.stdout + proc.stderr).strip().splitlines()[-1:]}", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} {case} exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        result = json.loads((Path(tmp) / "result.json").read_text())
        with np.load(Path(tmp) / "weights.npz") as z:
            arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    return result, arrays


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[bool, float]:
    identical = len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    diff = max((float(np.abs(x - y).max()) for x, y in zip(a, b) if x.size), default=0.0)
    return identical, diff


def run_driver(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common
    cases = [c for c in args.cases.split(",") if c]
    thresholds = [int(t) for t in args.collective_bytes.split(",")]
    shms = [v for v in args.collective_shm.split(",") if v]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    weights: dict[str, dict[str, list[np.ndarray]]] = {}
    for rep in range(args.repeats):
        for case in cases:
            jobs = [("ddp", 0, "1")] + [("pskv", t, v) for t in thresholds
                                        for v in (shms if t else shms[:1])]
            if case != "avg100mb" and args.ceiling:
                jobs.append(("solo", 0, "1"))
            if rep % 2:
                jobs.reverse()                 # alternate who runs first
            for kind, t, v in jobs:
                label = {"ddp": "ddp", "solo": CEILING}.get(
                    kind, f"pskv (collective {t}{', no shm' if t and v == '0' else ''})")
                print(f"[{rep + 1}/{args.repeats}] {case}: {label}", flush=True)
                with busy(args.load, args.timeout + 60):
                    result, arrays = _job(kind, case, args, t, v)
                runs.setdefault(case, {}).setdefault(label, []).append(result)
                weights.setdefault(case, {})[label] = arrays
    rows: list[list[Any]] = []
    table: dict[str, dict[str, Any]] = {}
    for case in cases:
        ddp = runs[case]["ddp"]
        metric = "ms" if case == "avg100mb" else "samples_per_s"
        base = statistics.median(r[metric] for r in ddp)
        for label, rs in runs[case].items():
            value = statistics.median(r[metric] for r in rs)
            same, diff = _same(weights[case][label], weights[case]["ddp"])
            ratio = value / base if metric == "samples_per_s" else base / value
            entry = {"metric": metric, "median": value, "runs": rs, "speed_vs_ddp": ratio,
                     "identical_to_ddp": same, "max_abs_diff": diff}
            cpus = [r["cpu_ms_per_step"] for r in rs if r.get("cpu_ms_per_step")]
            roles = sorted({role for c in cpus for role in c})
            entry["cpu_ms_per_step"] = {role: statistics.median(c.get(role, 0.0) for c in cpus)
                                        for role in roles}
            if "step_wait_no_overlap_ms" in rs[0]:
                # exposed: what backward + step() took beyond backward alone (no overlap),
                # against the whole exchange (step() without overlap)
                plain = statistics.median(r["step_wait_no_overlap_ms"] for r in rs)
                both = statistics.median(r["backward_and_step_ms"] for r in rs)
                back = statistics.median(r["backward_no_overlap_ms"] for r in rs)
                entry["overlap_hidden"] = min(1.0, max(0.0, 1 - (both - back) / plain)) \
                    if plain > 0 else None
            table.setdefault(case, {})[label] = entry
            aim = "" if label in ("ddp", CEILING) else (
                "PASS" if (ratio >= 1.3 if metric == "samples_per_s" else ratio >= 1.0)
                else "MISS")
            hidden = entry.get("overlap_hidden")
            keys = rs[0].get("collective_keys")
            rows.append([case, label, "" if keys is None else keys,
                         f"{value:.1f} {'ms' if metric == 'ms' else 'samples/s'}",
                         f"{ratio:.2f}x", "n/a" if label == CEILING else
                         "yes" if same else f"no ({diff:.2g})",
                         "" if hidden is None else f"{100 * hidden:.0f}%",
                         " ".join(f"{role} {ms:.1f}" for role, ms in
                                  entry["cpu_ms_per_step"].items() if ms >= 0.05), aim])
    header = ["case", "run", "collective keys", "median", "speed vs DDP", "identical to DDP",
              "overlap hidden", "CPU ms/step", "aim"]
    print(_common.text_table(header, rows))
    data = {"benchmark": "bench_torch", "time": _common.timestamp(),
            "machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "settings": vars(args), "results": table}
    md = (f"# bench_torch\n\n{_common.command_line()}\n\nCommit {data['commit']}"
          f"{' (dirty)' if data['dirty'] else ''}, {data['time']}, "
          f"{data['machine']['cpu_model']} x{data['machine']['cpu_count']}, load "
          f"{data['machine']['loadavg_at_start']}. {args.workers} workers, {args.servers} "
          f"server(s), batch {args.batch} per worker, {args.steps} timed steps after "
          f"{args.warmup}, {args.repeats} alternated repeats"
          f"{f', {args.load} busy processes alongside' if args.load else ''}; aims: 1.3x "
          "DDP's samples/s, at most gloo's time for the average. CPU ms/step: user + "
          "system time of every process of the job over the timed steps (rank 0's "
          "window), per role.\n\n" + _common.md_table(header, rows) + "\n")
    if not args.no_write:
        name = "bench_torch" if not args.load else f"bench_torch_load{args.load}"
        paths = _common.write_results(name, data, md)
        print("wrote", *(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The driver (default), or one worker (``--worker``, started by the driver)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["pskv", "ddp", "solo"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(MODELS + ("avg100mb",)))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mb", type=float, default=100.0, help="the average's size in MiB")
    ap.add_argument("--scale", type=int, default=1, help="width factor of cnn/transformer")
    ap.add_argument("--collective-bytes", default="0,65536",
                    help="PSKV_COLLECTIVE_BYTES values pskv runs with (comma-separated), "
                         "also DistributedOptimizer's collective_bytes: 0 keeps every key "
                         "on the servers, 65536 is the optimizer's default")
    ap.add_argument("--collective-shm", default="1",
                    help="PSKV_COLLECTIVE_SHM values the runs with collective bytes run with "
                         "(comma-separated): 1 shares memory between the workers, 0 keeps "
                         "their sockets ('1,0' compares both)")
    ap.add_argument("--gradient-as-bucket-view", action="store_true",
                    help="gradient_as_bucket_view=True for DDP and pskv alike (.grad is a "
                         "view of the bucket: one copy less per step)")
    ap.add_argument("--zero-grads", action="store_true",
                    help="zero_grad(set_to_none=False) in every run: gradients accumulate "
                         "in place (into the buckets, with --gradient-as-bucket-view)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help=f"skip the {CEILING!r} run of each model")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N busy processes during every job: the figure 'with other "
                         "work on the machine' (results go to bench_torch_load<N>.*)")
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.mb, args.batch = 3, 1, 1, 1.0, 8
        args.timeout = min(args.timeout, 180.0)
    return run_driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
