"""ResNet-50's parameter set pushed and pulled from CUDA tensors against host tensors, and
torch DDP over gloo with CUDA tensors (docs/gpu.md).

    python benchmarks/bench_gpu.py [--steps 8] [--out DIR]

Cases, each a job of 2 workers on this machine (pskv-launch, or torchrun for DDP):

``pskv cuda S``  dist_sync with S servers (1 and 2): every step pushes the 161 tensors
                 (25.6M floats) from CUDA tensors as one list call, then pulls into CUDA
                 tensors (``torch.cuda.synchronize()`` ends the step)
``pskv host S``  the same from host (CPU) tensors: the host path
``ddp gloo``     torch DDP (gloo) on a module holding the same tensors on CUDA: a step is a
                 backward whose gradients DDP averages (both processes on one GPU)

Reported: steps/s (rank 0's timed steps), the ratio CUDA/host per server count (the aim:
0.85 or more), and the share of a CUDA step spent in device copies: the store's own
staging time (D2H copies and their wait; the H2D copies are queued on the stream and run
behind the call) and, measured alone, one D2H plus one H2D of the whole set through pinned
buffers. Writes ``bench_gpu.json`` and ``bench_gpu.md`` to ``--out`` (default
benchmarks/results) with the machine (GPU name included) and the commit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from _dist_worker import resnet50_shapes


def _steps(fn: Any, warmup: int, steps: int, sync: Any) -> float:
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return time.perf_counter() - start


def run_pskv(args: argparse.Namespace) -> int:
    import torch

    import pskv as mx
    kv: Any = mx.kv.create("dist_sync")
    rank = kv.rank
    device = "cuda" if args.where == "cuda" else "cpu"
    shapes = resnet50_shapes()
    keys = list(range(len(shapes)))
    vals = [torch.full(s, float(rank + 1), device=device) for s in shapes]
    outs = [torch.empty(s, device=device) for s in shapes]
    kv.init(keys, vals)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        kv.push(keys, vals)
        kv.pull(keys, out=outs)

    staged0 = kv._device.staging_seconds
    seconds = _steps(step, args.warmup, args.steps, sync)
    staged = (kv._device.staging_seconds - staged0) * args.steps / (args.steps + args.warmup)
    want = float(sum(range(1, kv.num_workers + 1)))
    ok = all(bool((o == want).all()) for o in (outs[0], outs[-1]))
    copies = None
    if device == "cuda":                 # one D2H and one H2D of the set, pinned, alone
        pinned = [torch.empty(s, pin_memory=True) for s in shapes]

        def copy() -> None:
            for p, v in zip(pinned, vals):
                p.copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            for p, o in zip(pinned, outs):
                o.copy_(p, non_blocking=True)
        copies = _steps(copy, 1, args.steps, sync) / args.steps
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps({
            "steps_per_s": args.steps / seconds, "step_s": seconds / args.steps,
            "staging_s": staged / args.steps, "copies_alone_s": copies, "correct": ok}))
    kv.close()
    return 0 if ok else 1


class _Set:
    """A module holding the parameter set; its forward is the sum of every tensor, so each
    gradient is ones (built lazily: torch is imported in the workers only)."""

    @staticmethod
    def build(torch: Any) -> Any:
        class Params(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.params = torch.nn.ParameterList(
                    torch.nn.Parameter(torch.zeros(s, device="cuda"))
                    for s in resnet50_shapes())

            def forward(self, x: Any) -> Any:   # DDP with device_ids needs an input
                return sum(p.sum() for p in self.params) + x
        return Params()


def run_ddp(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(0)                   # both processes share the one GPU
    ddp = torch.nn.parallel.DistributedDataParallel(_Set.build(torch), device_ids=[0])
    params = list(ddp.module.parameters())
    zero = torch.zeros((), device="cuda")

    def step() -> None:
        for p in params:
            p.grad = None
        ddp(zero).backward()                   # DDP averages the gradients in backward
    seconds = _steps(step, args.warmup, args.steps, torch.cuda.synchronize)
    ok = bool((params[0].grad == 1).all())
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps({
            "steps_per_s": args.steps / seconds, "step_s": seconds / args.steps,
            "staging_s": None, "copies_alone_s": None, "correct": ok}))
    dist.destroy_process_group()
    return 0 if ok else 1


def _job(kind: str, where: str, servers: int, args: argparse.Namespace) -> dict[str, Any]:
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        worker = [str(here), "--worker", kind, "--where", where, "--out", tmp,
                  "--steps", str(args.steps), "--warmup", str(args.warmup)]
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        if kind == "pskv":
            argv = [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", str(servers),
                    sys.executable, *worker]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", *worker]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} {where} {servers} exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads((Path(tmp) / "result.json").read_text())


def _gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        return "none (no torch)"


def run_driver(args: argparse.Namespace) -> int:
    if _gpu_name().startswith("none"):
        print(f"bench_gpu: no CUDA device here ({_gpu_name()}): nothing to measure")
        return 0
    rows, cases = [], {}
    for servers in (1, 2):
        for where in ("host", "cuda"):
            r = cases[f"pskv {where} {servers}"] = _job("pskv", where, servers, args)
            print(f"pskv {where:4} s={servers}: {r['steps_per_s']:.2f} steps/s", flush=True)
    if not args.no_ddp:
        r = cases["ddp gloo"] = _job("ddp", "cuda", 0, args)
        print(f"ddp gloo cuda: {r['steps_per_s']:.2f} steps/s", flush=True)
    ratios = {s: cases[f"pskv cuda {s}"]["steps_per_s"] / cases[f"pskv host {s}"]["steps_per_s"]
              for s in (1, 2)}
    for name, r in cases.items():
        servers = name.rsplit(" ", 1)[1] if name.startswith("pskv") else ""
        share = (f"{r['staging_s'] / r['step_s']:.1%} / {r['copies_alone_s'] / r['step_s']:.1%}"
                 if r["copies_alone_s"] is not None else "")
        ratio = f"{ratios[int(servers)]:.2f}" if name.startswith("pskv cuda") else ""
        rows.append([name, f"{r['steps_per_s']:.2f}", f"{r['step_s'] * 1e3:.1f}", ratio, share,
                     "yes" if r["correct"] else "NO"])
    header = ["case", "steps/s", "ms/step", "cuda/host", "device copies (store staging / "
              "D2H+H2D alone)", "correct"]
    machine = {**_common.machine_info(), "gpu": _gpu_name()}
    data = {"benchmark": "bench_gpu", "when": _common.timestamp(),
            "command": _common.command_line(), **_common.commit_info(), "machine": machine,
            "steps": args.steps, "warmup": args.warmup, "cases": cases,
            "ratio_cuda_over_host": {str(k): v for k, v in ratios.items()},
            "aim": "cuda/host >= 0.85"}
    md = (f"# bench_gpu: ResNet-50 parameter set (161 keys, 25.6M floats), 2 workers\n\n"
          f"GPU {machine['gpu']}, {machine['cpu_count']} CPUs ({machine['cpu_model']}), "
          f"commit {data['commit']}{' (dirty)' if data['dirty'] else ''}, {data['when']}; "
          f"{args.steps} timed steps after {args.warmup}.\n\n"
          + _common.md_table(header, rows) + "\n\n"
          "A pskv step: push the set, pull it back (dist_sync, `S` servers). cuda/host is "
          "steps/s from CUDA tensors over steps/s from host tensors (aim: 0.85 or more).\n")
    jpath, mpath = _common.write_results("bench_gpu", data, md, Path(args.out))
    print(_common.text_table(header, rows))
    print(f"wrote {jpath} and {mpath}")
    return 0 if all(r["correct"] for r in cases.values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["pskv", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--where", choices=["cuda", "host"], default="cuda",
                    help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per job")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP case")
    ap.add_argument("--out", default=str(_common.RESULTS_DIR),
                    help="folder for bench_gpu.json and .md (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.worker == "pskv":
        return run_pskv(args)
    if args.worker == "ddp":
        return run_ddp(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
