"""Distributed benchmark: pskv's dist_sync store against MXNet 1.9.1's (ps-lite), on one host.

Run from the repository root::

    PSKV_MXNET_PYTHON=/path/to/mxnet-venv/bin/python \\
        python benchmarks/bench_dist.py          # full run, about 10 minutes on 2 cores
    python benchmarks/bench_dist.py --quick      # smoke run, under 2 minutes
    python benchmarks/bench_dist.py --server-handler=empty --no-mxnet   # pskv transport alone

One job per (library, number of servers): a scheduler, S servers and 2 workers on this
machine, talking over loopback (pskv: its default transport, ``auto``, which takes a Unix
socket between processes of one host; ``--transport tcp`` forces its cross-host TCP path,
``--transport zmq`` ZeroMQ). MXNet's scheduler
and servers are ``python -c 'import mxnet'`` under ``PSKV_MXNET_PYTHON``; pskv's are
``python -m pskv.server``. Both libraries' workers run ``_dist_worker.py``, the same
workload code and timing loop (``import mxnet as mx`` or ``import pskv as mx``). Jobs go
MXNet and pskv back to back, alternating, so machine load falls on both alike; every job has
a hard timeout and every process group is killed at the end, on errors too.

Results go to ``benchmarks/results/bench_dist.json`` and ``bench_dist.md`` with the machine,
the commit and the command line; the targets are reported as PASS or MISS, never asserted.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import _dist_worker

from pskv.launch._net import free_port

log = logging.getLogger("bench_dist")

ENV_MXNET_PYTHON = "PSKV_MXNET_PYTHON"
WORKER = Path(_dist_worker.__file__).resolve()
NUM_WORKERS = 2
F32 = 4

#: dense key sizes in float32 elements: 4 KB, 256 KB, 4 MB, 64 MB (binary)
DENSE = {1024: "4 KB", 65536: "256 KB", 1048576: "4 MB", 16777216: "64 MB"}

#: ps-lite (MXNet 1.9.1 dist_sync) as the issue measured it, for reference
ISSUE_PSLITE = {"small": 850.0, "dense_1024": 5.0, "dense_65536": 230.0,
                "dense_1048576": 510.0, "dense_16777216": 225.0, "list": 6900.0}

#: the targets: figure -> (goal as a factor of MXNet's, description); the small-message
#: ones (small key, 4 KB, 1000 keys) are the engine/seam issue's, the rest the first speed
#: issue's
TARGETS: dict[str, tuple[float, str]] = {
    "small": (0.4, "small-key push+pull latency <= 0.4 x MXNet's"),
    "dense_1024": (2.0, "4 KB keys: MB/s per worker >= 2 x MXNet's"),
    "dense_65536": (1.5, "256 KB keys: MB/s per worker >= 1.5 x MXNet's"),
    "dense_1048576": (2.0, "4 MB keys: MB/s per worker >= 2 x MXNet's"),
    "dense_16777216": (2.0, "64 MB keys: MB/s per worker >= 2 x MXNet's"),
    "list": (4.0, "1000 keys x 1000 floats, one list call: keys/s >= 4 x MXNet's"),
}


# ---- plan --------------------------------------------------------------------------------
def workloads(quick: bool, only: list[str] | None) -> dict[str, Any]:
    """Warm-up iterations, timed repeats and iterations per repeat of every workload."""
    if quick:
        w: dict[str, Any] = {
            "small": {"shape": [2, 3], "warmup": 20, "reps": 2, "iters": 100},
            "dense": {str(n): {"warmup": 2, "reps": 2, "iters": it}
                      for n, it in ((1024, 40), (65536, 20), (1048576, 4), (16777216, 1))},
            "list": {"keys": 1000, "size": 1000, "warmup": 1, "reps": 2, "iters": 1},
            "resnet": {"warmup": 1, "reps": 2, "iters": 1},
            "resnet_sgd": {"warmup": 1, "reps": 2, "iters": 1},
        }
    else:
        w = {
            "small": {"shape": [2, 3], "warmup": 200, "reps": 5, "iters": 400},
            "dense": {"1024": {"warmup": 50, "reps": 5, "iters": 200},
                      "65536": {"warmup": 20, "reps": 5, "iters": 60},
                      "1048576": {"warmup": 5, "reps": 5, "iters": 15},
                      "16777216": {"warmup": 2, "reps": 5, "iters": 3}},
            "list": {"keys": 1000, "size": 1000, "warmup": 2, "reps": 5, "iters": 4},
            "resnet": {"warmup": 2, "reps": 5, "iters": 3},
            "resnet_sgd": {"warmup": 2, "reps": 5, "iters": 3},
        }
    if only:
        w = {k: v for k, v in w.items() if k in only}
    return w


# ---- processes -----------------------------------------------------------------------------
def base_env() -> dict[str, str]:
    """Our environment without cluster variables; MXNET_*/PSKV_* settings pass through."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DMLC_") and k not in ("PSKV_SECRET", ENV_MXNET_PYTHON)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Job:
    """One cluster: scheduler, servers, workers, each in its own session (process group)."""

    def __init__(self, lib: str, python: str, num_servers: int, config: dict[str, Any],
                 tmp: Path, tag: str, handler: str, transport: str) -> None:
        self.lib, self.python, self.num_servers = lib, python, num_servers
        self.tmp, self.tag = tmp, tag
        self.handler, self.transport = handler, transport
        self.config_path = tmp / f"{tag}.config.json"
        self.config = config
        self.config_path.write_text(json.dumps(config))
        self.out_prefix = tmp / f"{tag}.out"
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def _env(self, role: str, port: int) -> dict[str, str]:
        env = base_env()
        env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": str(self.num_servers),
                    "DMLC_NUM_WORKER": str(NUM_WORKERS), "DMLC_NODE_HOST": "127.0.0.1"})
        if self.lib == "mxnet":
            env["DMLC_INTERFACE"] = "lo"
            env = {k: v for k, v in env.items() if not k.startswith("PSKV_")}
        else:
            env = {k: v for k, v in env.items() if not k.startswith("MXNET_")}
            if self.transport != "auto":
                env["PSKV_TRANSPORT"] = self.transport
        return env

    def _node_argv(self, label: str) -> list[str]:
        if self.lib == "mxnet":
            return [self.python, "-c", "import mxnet"]
        prof = self.config.get("profile_dir")
        pre = [self.python] if not prof or label == "scheduler" else \
            [self.python, "-m", "cProfile", "-o",
             str(Path(prof) / f"{label.replace(' ', '')}.prof")]
        if self.handler == "empty":
            return pre + [str(WORKER), "serve-empty"]
        return pre + ["-m", "pskv.server"]

    def _start(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        logf = self.tmp / f"{self.tag}.{label.replace(' ', '')}.log"
        with open(logf, "wb") as f:
            p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=_common.BENCH_DIR,
                                 start_new_session=True)
        self.procs.append((label, p, logf))

    def run(self, timeout: float) -> list[dict[str, Any]]:
        """Run the job to its end; the workers' JSON (by rank). Raises on any failure."""
        port = free_port()
        try:
            self._start("scheduler", self._node_argv("scheduler"),
                        self._env("scheduler", port))
            for i in range(self.num_servers):
                label = f"server {i}"
                self._start(label, self._node_argv(label), self._env("server", port))
            wargv = [self.python, str(WORKER), "worker", self.lib, str(self.config_path),
                     str(self.out_prefix)]
            for i in range(NUM_WORKERS):
                self._start(f"worker {i}", wargv, self._env("worker", port))
            deadline = time.monotonic() + timeout
            workers = [(lbl, p, f) for lbl, p, f in self.procs if lbl.startswith("worker")]
            while any(p.poll() is None for _, p, _ in workers):
                bad = [(lbl, p, f) for lbl, p, f in self.procs
                       if p.poll() not in (None, 0)]
                if bad:
                    raise _common.WorkerError(self._why(bad, "exited with an error"))
                if time.monotonic() > deadline:
                    raise _common.WorkerError(self._why(
                        [w for w in workers if w[1].poll() is None],
                        f"still running after the {timeout:g} s timeout"))
                time.sleep(0.1)
            bad = [w for w in workers if w[1].returncode != 0]
            if bad:
                raise _common.WorkerError(self._why(bad, "exited with an error"))
            # servers and scheduler leave once every worker has; give them a moment
            end = time.monotonic() + 20
            while time.monotonic() < end and any(p.poll() is None for _, p, _ in self.procs):
                time.sleep(0.05)
            left = [lbl for lbl, p, _ in self.procs if p.poll() is None]
            if left:
                log.warning("%s: %s still running after the workers exited; killed",
                            self.tag, ", ".join(left))
            out = []
            for rank in range(NUM_WORKERS):
                path = Path(f"{self.out_prefix}.{rank}.json")
                out.append(json.loads(path.read_text()))
            return out
        finally:
            self.kill()

    def partial(self) -> list[dict[str, Any] | None]:
        """Whatever the workers wrote before a failure."""
        res: list[dict[str, Any] | None] = []
        for rank in range(NUM_WORKERS):
            try:
                res.append(json.loads(Path(f"{self.out_prefix}.{rank}.json").read_text()))
            except (OSError, ValueError):
                res.append(None)
        return res

    def _why(self, procs: list[tuple[str, Any, Path]], what: str) -> str:
        parts = []
        for label, p, logf in procs:
            try:
                tail = logf.read_bytes()[-1500:].decode(errors="replace")
            except OSError:
                tail = ""
            parts.append(f"{label} (pid {p.pid}, exit {p.poll()}) {what}; log tail:\n{tail}")
        return f"{self.tag}: " + "\n".join(parts)

    def kill(self) -> None:
        """SIGKILL every process group this job started (they are gone or must go)."""
        for _, p, _ in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("%s: pid %d did not exit after SIGKILL", self.tag, p.pid)


# ---- figures -------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def figures(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per workload: the figure of each worker and of the job (worker 0's), over all runs.

    small: median microseconds over every timed iteration (and p10 / p90);
    dense: MB/s per worker = bytes one worker pushes in a step / seconds per step / 1e6;
    list: keys/s = keys / seconds per step; resnet(_sgd): steps/s and GB/s (bytes pushed).
    The time of a repeat is its median over repeats (of every run).
    """
    out: dict[str, Any] = {}
    names: list[str] = []
    for run in runs:
        for w in run:
            for n in w["results"]:
                if n not in names:
                    names.append(n)
    for name in names:
        per_rank = []
        for rank in range(NUM_WORKERS):
            res = [run[rank]["results"][name] for run in runs
                   if run[rank] is not None and name in run[rank]["results"]]
            if not res:
                per_rank.append(None)
                continue
            reps = [s for r in res for s in r["seconds_per_step"]]
            sec = _median(reps)
            best = min(reps)
            nbytes, keys = res[0]["bytes"], res[0]["keys"]
            fig: dict[str, Any] = {"seconds_per_step": sec, "best_seconds_per_step": best,
                                   "check": sorted({r["check"] for r in res}),
                                   "repeats": len(reps), "iters": res[0]["iters"]}
            if name == "small":
                each = sorted(s for r in res for s in r.get("iteration_s", []))
                fig["us"] = 1e6 * statistics.median(each)
                fig["p10_us"] = 1e6 * each[len(each) // 10]
                fig["p90_us"] = 1e6 * each[(9 * len(each)) // 10]
                fig["iterations"] = len(each)
                fig["value"] = fig["us"]
            elif name.startswith("dense_"):
                fig["mb_s"] = nbytes / sec / 1e6
                fig["best_mb_s"] = nbytes / best / 1e6
                fig["value"] = fig["mb_s"]
            elif name == "list":
                fig["keys_s"] = keys / sec
                fig["best_keys_s"] = keys / best
                fig["value"] = fig["keys_s"]
            else:
                fig["steps_s"] = 1.0 / sec
                fig["gb_s"] = nbytes / sec / 1e9
                fig["value"] = fig["steps_s"]
            fig["bytes_per_step"], fig["keys_per_step"] = nbytes, keys
            per_rank.append(fig)
        out[name] = {"workers": per_rank,
                     "value": per_rank[0]["value"] if per_rank[0] else None}
    return out


def target_rows(figs: dict[str, dict[str, Any]], servers: list[int],
                variants: list[str]) -> list[dict[str, Any]]:
    rows = []
    for variant, s in ((v, s) for v in variants for s in servers):
        mx_f, ps_f = figs.get(f"mxnet/S{s}", {}), figs.get(f"{variant}/S{s}", {})
        for name, (goal, desc) in TARGETS.items():
            m = (mx_f.get(name) or {}).get("value")
            p = (ps_f.get(name) or {}).get("value")
            if m is None or p is None:
                rows.append({"pskv": variant, "servers": s, "figure": name, "goal": goal,
                             "target": desc, "ratio": None, "verdict": "n/a"})
                continue
            ratio = p / m
            ok = ratio <= goal if name == "small" else ratio >= goal
            rows.append({"pskv": variant, "servers": s, "figure": name, "goal": goal,
                         "target": desc, "ratio": ratio, "verdict": "PASS" if ok else "MISS"})
    return rows


# ---- reporting -----------------------------------------------------------------------------
LABELS = {"small": "small key (2,3): us per push+pull", "list": "1000 keys x 1000: keys/s",
          "resnet": "ResNet-50 (161 keys, 25.6M): steps/s",
          "resnet_sgd": "ResNet-50 + SGD on servers: steps/s"}
for _n, _l in DENSE.items():
    LABELS[f"dense_{_n}"] = f"{_l} key: MB/s per worker"


def _fmt(v: float | None, name: str) -> str:
    if v is None:
        return "error"
    if name == "small":
        return f"{v:.0f}"
    if name.startswith("resnet"):
        return f"{v:.2f}"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _extra(fig: dict[str, Any] | None, name: str) -> str:
    if not fig:
        return ""
    if name.startswith("resnet"):
        return f" ({fig['gb_s']:.2f} GB/s)"
    if name == "small":
        return f" [{fig['p10_us']:.0f}-{fig['p90_us']:.0f}]"
    return ""


def result_table(data: dict[str, Any], markdown: bool) -> str:
    jobs = [j for j in data["job_order_keys"]]
    pairs = [(v, s) for s in data["servers"] for v in data["variants"]
             if f"mxnet/S{s}" in jobs and f"{v}/S{s}" in jobs]
    header = ["figure"] + jobs + [f"{v}/MXNet S={s}" for v, s in pairs]
    rows = []
    for name in data["workload_names"]:
        row = [LABELS.get(name, name)]
        for j in jobs:
            f = data["figures"].get(j, {}).get(name)
            w0 = f["workers"][0] if f else None
            bad = w0 and any(c.startswith("wrong") for c in w0["check"])
            row.append((_fmt(f["value"] if f else None, name) + _extra(w0, name)
                        + (" (wrong)" if bad else "")) if f else "error")
        for v, s in pairs:
            m = data["figures"].get(f"mxnet/S{s}", {}).get(name)
            p = data["figures"].get(f"{v}/S{s}", {}).get(name)
            row.append(f"{p['value'] / m['value']:.2f}x" if m and p and m["value"] and
                       p["value"] else "n/a")
        rows.append(row)
    return _common.md_table(header, rows) if markdown else _common.text_table(header, rows)


def targets_table(data: dict[str, Any], markdown: bool) -> str:
    header = ["pskv", "S", "target", "pskv/MXNet", "verdict"]
    rows = [[r["pskv"], r["servers"], r["target"], "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}",
             r["verdict"]] for r in data["targets"]]
    return _common.md_table(header, rows) if markdown else _common.text_table(header, rows)


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# bench_dist: pskv dist_sync against MXNet 1.9.1 (ps-lite)", "",
        f"- command: `{data['command']}`",
        f"- commit: {data['commit']['commit']}"
        f"{' (dirty)' if data['commit']['dirty'] else ''}; run at {data['timestamp']}",
        f"- machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['mem_total_gib']} GiB, "
        f"{m['platform']}, Python {m['python']}",
        f"- load average (1, 5, 15 min): {m['loadavg_at_start']} at start, "
        f"{m.get('loadavg_at_end')} at end",
        f"- cluster: {NUM_WORKERS} workers, S servers, one scheduler, all on this host; "
        "dist_sync; `pskv` is pskv's default transport (`PSKV_TRANSPORT=auto`: Unix "
        "sockets between processes of one host), `pskv-tcp` forces its TCP path (what "
        "workers on other hosts use), `pskv-zmq` sends over ZeroMQ; MXNet (ps-lite) uses "
        f"ZeroMQ over loopback TCP; server handler "
        f"`{data['server_handler']}`",
        f"- versions: {data.get('versions')}",
        f"- rounds: {data['rounds']} (jobs in order: {', '.join(data['job_order'])})",
        "",
        "Figures are worker 0's (worker 1's are in the JSON, and within a few percent): the "
        "median over timed repeats; small-key latency is the median over every timed "
        "iteration, [p10-p90] in brackets. **MB/s per worker** = bytes one worker pushes in "
        "one push+pull iteration (the key's size) / seconds per iteration / 1e6; a "
        "push+pull moves twice that per worker. ResNet GB/s counts pushed bytes the same way.",
        "",
        result_table(data, markdown=True), "",
        "## Targets (the issue's; a report, not an assert)", "",
        targets_table(data, markdown=True), "",
        "The issue's own ps-lite figures, for reference: "
        "850 us per small push+pull; 5 / 230 / 510 / 225 MB/s per worker at "
        "4 KB / 256 KB / 4 MB / 64 MB; 6,900 keys/s.",
    ]
    if data["errors"]:
        lines += ["", "## Errors", ""]
        lines += [f"- `{k}`: {v.splitlines()[0] if v else v}" for k, v in data["errors"].items()]
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------
def results_name(args: argparse.Namespace) -> str:
    """``--name``, else ``bench_dist`` for a full run and ``bench_dist-partial`` otherwise."""
    if args.name:
        return str(args.name)
    full = parse_args([])
    same = all(getattr(args, k) == getattr(full, k) for k in
               ("quick", "servers", "only", "sizes", "server_handler", "transport", "no_mxnet",
                "profile"))
    return "bench_dist" if same and (args.rounds or 3) >= 3 else "bench_dist-partial"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few iterations (<2 min)")
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2],
                   help="numbers of servers to run (default: 1 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run every job this many times, alternating libraries; the repeats "
                        "of all rounds are pooled (default 3, --quick 1)")
    p.add_argument("--only", nargs="+",
                   choices=["small", "dense", "list", "resnet", "resnet_sgd"],
                   help="run only these workloads")
    p.add_argument("--sizes", type=int, nargs="+", choices=sorted(DENSE),
                   help="dense key sizes (float32 elements)")
    p.add_argument("--server-handler", choices=["normal", "empty"], default="normal",
                   help="empty: pskv servers that do no arithmetic (transport alone; "
                        "pskv only, MXNet's servers have no such mode)")
    p.add_argument("--transport", choices=["auto", "tcp", "ipc", "zmq"], nargs="+",
                   default=["auto", "tcp", "zmq"],
                   help="pskv's PSKV_TRANSPORT, one pskv job per value (default: auto tcp; "
                        "auto takes Unix sockets between processes of one host)")
    p.add_argument("--no-mxnet", action="store_true", help=f"ignore {ENV_MXNET_PYTHON}")
    p.add_argument("--timeout", type=float, default=None,
                   help="hard limit per job in seconds (default 300, --quick 120)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write cProfile stats into this folder: worker 0's timed loops, "
                        "and each pskv server's whole run")
    p.add_argument("--out", type=Path, default=_common.RESULTS_DIR,
                   help="results folder (default benchmarks/results)")
    p.add_argument("--name", default=None,
                   help="results file name (no suffix); default bench_dist for a full run, "
                        "bench_dist-partial for any other (--quick, --only, --sizes, "
                        "--servers, ...), so a partial run never replaces the full results")
    p.add_argument("--no-write", action="store_true", help="print only; write no files")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    config: dict[str, Any] = {"workloads": workloads(args.quick, args.only),
                              "empty": args.server_handler == "empty"}
    if args.sizes and "dense" in config["workloads"]:
        config["workloads"]["dense"] = {k: v for k, v in config["workloads"]["dense"].items()
                                        if int(k) in args.sizes}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    libs: dict[str, tuple[str, str, str]] = {}     # label -> (library, python, transport)
    mxpy = os.environ.get(ENV_MXNET_PYTHON)
    if mxpy and not args.no_mxnet and args.server_handler == "normal":
        libs["mxnet"] = ("mxnet", mxpy, "tcp")
    elif args.server_handler == "empty":
        log.info("--server-handler=empty: pskv only (MXNet's servers have no empty handler)")
    elif not args.no_mxnet:
        log.info("%s is not set: pskv only; the MXNet targets read n/a", ENV_MXNET_PYTHON)
    for t in dict.fromkeys(args.transport):
        libs["pskv" if t == "auto" else f"pskv-{t}"] = ("pskv", sys.executable, t)
    variants = [v for v in libs if v != "mxnet"]
    timeout = args.timeout or (120.0 if args.quick else 300.0)

    data: dict[str, Any] = {
        "benchmark": "bench_dist", "command": _common.command_line(),
        "timestamp": _common.timestamp(), "commit": _common.commit_info(),
        "machine": _common.machine_info(), "servers": args.servers, "rounds": args.rounds,
        "num_workers": NUM_WORKERS, "transport": args.transport, "variants": variants,
        "server_handler": args.server_handler, "config": config, "job_order": [],
        "errors": {}, "jobs": {}, "issue_pslite": ISSUE_PSLITE,
    }
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    order = list(libs)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_dist-") as tmpd:
        tmp = Path(tmpd)
        n = 0
        for rnd in range(args.rounds):
            for s in args.servers:
                for lib in order:
                    key = f"{lib}/S{s}"
                    tag = f"{lib}-S{s}-r{rnd}"
                    cfg = dict(config)
                    if args.profile:
                        cfg["profile_dir"] = str(args.profile / tag)
                        Path(cfg["profile_dir"]).mkdir(parents=True, exist_ok=True)
                    name, python, transport = libs[lib]
                    job = Job(name, python, s, cfg, tmp, tag, args.server_handler, transport)
                    t0 = time.monotonic()
                    log.info("job %s ...", tag)
                    try:
                        res = job.run(timeout)
                    except (_common.WorkerError, OSError, ValueError) as err:
                        log.error("job %s failed: %s", tag, err)
                        data["errors"][tag] = str(err)
                        part = job.partial()
                        if all(p is not None for p in part):
                            runs.setdefault(key, []).append(part)  # type: ignore[arg-type]
                        continue
                    finally:
                        data["job_order"].append(tag)
                    log.info("job %s done in %.1f s", tag, time.monotonic() - t0)
                    runs.setdefault(key, []).append(res)
                    data["jobs"][tag] = [{k: v for k, v in w.items() if k != "results"}
                                         for w in res]
                    n += 1
                order = order[1:] + order[:1]    # rotate which library goes first
    data["elapsed_s"] = time.monotonic() - t_all
    try:
        data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        data["machine"]["loadavg_at_end"] = None
    data["job_order_keys"] = [f"{lib}/S{s}" for s in args.servers for lib in libs
                              if f"{lib}/S{s}" in runs]
    data["figures"] = {k: figures(v) for k, v in runs.items()}
    names: list[str] = []
    for f in data["figures"].values():
        names += [n for n in f if n not in names]
    data["workload_names"] = names
    data["targets"] = target_rows(data["figures"], args.servers, variants)
    data["versions"] = {lib: next((w[0]["version"] for w in v if w and w[0]), None)
                        for lib, v in {k.split("/")[0]: runs[k] for k in runs}.items()}
    # per-run results without the per-iteration samples (the figures summarize them)
    data["raw"] = {k: [[{kk: (vv if kk != "results" else
                            {n: {f: x for f, x in r.items() if f != "iteration_s"}
                             for n, r in vv.items()} if isinstance(vv, dict) else vv)
                         for kk, vv in w.items()} if isinstance(w, dict) else w
                        for w in job] for job in v] for k, v in runs.items()}

    print()
    print(result_table(data, markdown=False))
    print()
    print(targets_table(data, markdown=False))
    if data["errors"]:
        print("\nerrors:", ", ".join(data["errors"]))
    if not args.no_write:
        j, m = _common.write_results(results_name(args), data, markdown(data), args.out)
        print(f"\nwrote {j} and {m}")
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
