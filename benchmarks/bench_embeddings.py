"""Embedding tables: pskv's dynamic tables against a NumPy ceiling and the peers, one run.

Run from the repository root::

    python benchmarks/bench_embeddings.py --quick          # smoke run, a few seconds
    python benchmarks/bench_embeddings.py \\
        --torchrec-python /path/to/tr/bin/python --dgl-python /path/to/dgl/bin/python \\
        --dist                                             # full run; --big adds N = 1e7

The workload is the peers' (``_emb_workload.py``; ``../shared/bench/embeddings/``): N rows
x d = 64 float32, B = 4096 IDs per step from Zipf(1.05) (ranks scattered) or uniform,
AdaGrad lr 0.01. For each N and ID distribution, in this process: the NumPy ceiling
(``np.take``; sort + ``reduceat`` + element-wise AdaGrad) and a pskv ``local`` store with
one table key (eval lookups, training lookup + push, training lookups of never-seen IDs,
the table's bytes and the process's resident growth per row); then the peers' own scripts
under their interpreters with the same workload flags (TorchRec's FBGEMM kernel and
``DistributedModelParallel``, DGL's ``DistEmbedding``). ``--dist`` adds pskv jobs with 2
workers and 1 and 2 servers in ``dist_sync`` and ``dist_async`` (a store that refuses a
``TableSpec`` reads "not supported yet") and the peers' 2-process runs. Rounds alternate
the systems; figures are medians over rounds.

Results go to ``benchmarks/results/bench_embeddings.{json,md}`` with the machine, the commit
and the command line (a partial run: ``bench_embeddings-partial.*``, not committed); the
issue's targets are reported as PASS or MISS, never asserted.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import _common
import _emb_jobs as J
import _emb_report as R
import _emb_workload as W

log = logging.getLogger("bench_embeddings")

PEERS_DIR = _common.REPO_ROOT.parent / "shared" / "bench" / "embeddings"
EPS = 1e-10


# ---- plan ------------------------------------------------------------------------------------
def peer_runs(args: argparse.Namespace, dist: bool) -> list[tuple[str, str, str, list[str]]]:
    """``(label, python, script, flags)`` of every peer run this run makes."""
    runs: list[tuple[str, str, str, list[str]]] = []
    tr, dgl = args.torchrec_python, args.dgl_python
    if not dist:
        if tr:
            runs += [("torchrec-tbe-rowwise", tr, "bench_torchrec.py", ["--mode", "tbe"]),
                     ("torchrec-tbe-adagrad", tr, "bench_torchrec.py",
                      ["--mode", "tbe", "--optim", "exact_adagrad"]),
                     ("torchrec-dmp-w1", tr, "bench_torchrec.py",
                      ["--mode", "dmp", "--world", "1"])]
        if dgl:
            runs.append(("dgl-standalone", dgl, "bench_dgl.py", ["--mode", "standalone"]))
    else:
        if tr:
            runs.append(("torchrec-dmp-w2", tr, "bench_torchrec.py",
                         ["--mode", "dmp", "--world", "2"]))
        if dgl:
            runs.append(("dgl-dist-t2", dgl, "bench_dgl.py", ["--mode", "dist",
                                                             "--trainers", "2"]))
    return runs


def workload_flags(args: argparse.Namespace, n: int, id_dist: str) -> list[str]:
    return ["--rows", str(n), "--dim", str(args.dim), "--batch", str(args.batch),
            "--dist", id_dist, "--zipf-s", str(args.zipf_s), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed), "--lr", str(args.lr)]


# ---- pskv local ------------------------------------------------------------------------------
class PskvLocal:
    """A local store with one table key ``'emb'`` holding the N rows, every row trained once."""

    def __init__(self, n: int, dim: int, lr: float, fill_chunk: int) -> None:
        import pskv as mx
        from pskv.table import TableSpec, Uniform

        kv: Any = mx.kv.create("local")      # lookup/table_stats: LocalKVStore's
        self.kv = kv
        kv.init("emb", TableSpec(dim=dim, init=Uniform(-0.01, 0.01), seed=7))
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=lr, eps=EPS))
        zeros = np.zeros((fill_chunk, dim), np.float32)
        first = np.zeros(1, np.int64)          # row 0: code paths loaded, optimizer bound
        kv.lookup("emb", first, train=True)
        kv.push("emb", (first, zeros[:1]))
        gc.collect()
        rss0 = W.current_rss_bytes()           # growth from here on is the rows' own
        t0 = time.perf_counter()
        for lo in range(0, n, fill_chunk):
            ids = np.arange(lo, min(n, lo + fill_chunk), dtype=np.int64)
            kv.lookup("emb", ids, train=True)                # births (R3, birth='pull')
            kv.push("emb", (ids, zeros[:ids.size]))          # AdaGrad state for every row
        self.fill_s = time.perf_counter() - t0
        gc.collect()
        self.rss_growth = W.current_rss_bytes() - rss0
        self.table = kv._tables.tables["emb"]
        self.nbytes = self.table.nbytes()
        self.rows = len(self.table)
        self.dim = dim

    def lookup(self, ids: np.ndarray) -> None:
        self.kv.lookup("emb", ids, train=False)

    def train(self, grad: np.ndarray) -> Any:
        kv = self.kv

        def step(ids: np.ndarray) -> None:
            kv.lookup("emb", ids, train=True)
            kv.push("emb", (ids, grad))
        return step

    def insert(self, ids: np.ndarray) -> None:
        self.kv.lookup("emb", ids, train=True)

    def stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.kv.table_stats("emb").items()}

    def close(self) -> None:
        self.kv.close()


def memory_figures(p: PskvLocal) -> dict[str, Any]:
    """Bytes per row: the reference (row + AdaGrad state + 8-byte ID), the table's own
    arrays, and the process's resident growth while the table was built."""
    ref = p.dim * 4 + p.dim * 4 + 8
    own = sum(p.nbytes.values())
    return {"rows": p.rows, "reference_bytes_per_row": ref,
            "table_bytes": dict(p.nbytes), "table_bytes_per_row": own / p.rows,
            "rss_growth_bytes": p.rss_growth, "rss_bytes_per_row": p.rss_growth / p.rows,
            "table_over_reference": own / p.rows / ref,
            "rss_over_reference": p.rss_growth / p.rows / ref,
            "capacity_rows": p.table.capacity_rows}


def run_local_case(args: argparse.Namespace, n: int, id_dist: str,
                   errors: dict[str, str]) -> dict[str, Any]:
    """One (N, distribution): NumPy ceiling and pskv alternating, then the peers, per round."""
    total = args.warmup + args.steps
    t0 = time.perf_counter()
    batches = W.make_batches(n, args.batch, total, id_dist, args.zipf_s, args.seed)
    grad = W.make_grad(args.batch, args.dim)
    case: dict[str, Any] = {"rows": n, "id_dist": id_dist,
                            "unique_fraction": W.unique_fraction(batches),
                            "workload_setup_s": time.perf_counter() - t0}
    ceiling = W.NumpyCeiling(n, args.dim, grad, args.lr, EPS)
    pskv = PskvLocal(n, args.dim, args.lr, args.fill_chunk)
    case["fill"] = {"seconds": pskv.fill_s, "rows_per_s": n / pskv.fill_s}
    case["memory"] = memory_figures(pskv)
    case["numpy_bytes_per_row"] = ceiling.nbytes / n
    fns = {"numpy": {"lookup": ceiling.lookup, "train": ceiling.train,
                     "insert": ceiling.insert},
           "pskv": {"lookup": pskv.lookup, "train": pskv.train(grad), "insert": pskv.insert}}
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in fns}
    peers = peer_runs(args, dist=False)
    order = list(fns)
    for rnd in range(args.rounds):
        fresh = W.insert_batches(rnd * total * args.batch, args.batch, total)
        for phase in ("lookup", "train", "insert"):
            for system in order:
                data = fresh if phase == "insert" else batches
                gc.disable()
                try:
                    sec = W.time_batches(fns[system][phase], data, args.warmup)
                finally:
                    gc.enable()
                samples[system].setdefault(phase, []).append(1e3 * sec / args.steps)
            order = order[1:] + order[:1]
        for label, python, script, flags in peers:
            try:
                res = J.run_peer(python, args.peers_dir / script,
                                 flags + workload_flags(args, n, id_dist), args.peer_timeout)
            except (J.PeerError, OSError) as err:
                log.error("%s failed: %s", label, err)
                errors[f"{label}/N={n}/{id_dist}/r{rnd}"] = str(err)
                continue
            for phase, rec in res["records"].items():
                samples.setdefault(label, {}).setdefault(phase, []).append(
                    float(rec["ms_per_batch"]))
                case.setdefault("peer_info", {})[label] = {
                    k: rec.get(k) for k in ("versions", "optim", "mode", "torch_threads",
                                             "peak_rss_mib", "world", "trainers")
                    if k in rec}
        peers = peers[1:] + peers[:1]
    case["stats"] = pskv.stats()
    case["ms_per_batch"] = {s: {ph: {"median": statistics.median(v), "all": v}
                                for ph, v in phs.items()} for s, phs in samples.items()}
    pskv.close()
    del pskv, ceiling
    gc.collect()
    return case


# ---- pskv dist -------------------------------------------------------------------------------
def run_dist_case(args: argparse.Namespace, n: int, id_dist: str, tmp: Path,
                  errors: dict[str, str]) -> dict[str, Any]:
    """2 workers, S servers, each mode; then the peers' 2-process runs; per round."""
    from pskv.launch._net import free_port

    config = {"rows": n, "dim": args.dim, "batch": args.batch, "dist": id_dist,
              "zipf_s": args.zipf_s, "steps": args.steps, "warmup": args.warmup,
              "seed": args.seed, "lr": args.lr, "eps": EPS, "fill_chunk": args.fill_chunk}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    case: dict[str, Any] = {"rows": n, "id_dist": id_dist, "jobs": {}}
    samples: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, dict[str, list[float]]]] = {}
    jobs = [(m, s) for s in args.servers for m in args.modes]
    peers = peer_runs(args, dist=True)
    for rnd in range(args.rounds):
        for mode, s in jobs:
            label = f"pskv-{mode}/S{s}"
            tag = f"{mode}-S{s}-N{n}-{id_dist}-r{rnd}"
            job_config = config
            if args.profile:
                job_config = dict(config, profile_dir=str(args.profile / tag),
                                  profile_phase=args.profile_phase)
                (args.profile / tag).mkdir(parents=True, exist_ok=True)
            job = J.TableJob(mode, s, job_config, tmp, tag)
            log.info("job %s ...", tag)
            try:
                res = job.run(free_port(), args.job_timeout)
            except (J.PeerError, OSError, ValueError) as err:
                log.error("job %s failed: %s", tag, err)
                errors[tag] = str(err)
                continue
            info = case["jobs"].setdefault(label, {})
            if res[0].get("unsupported"):
                info["unsupported"] = res[0]["unsupported"]
                continue
            for phase in res[0]["phases"]:
                # the step time of the job is its slowest worker's
                ms = max(w["phases"][phase]["ms_per_batch"] for w in res)
                samples.setdefault(label, {}).setdefault(phase, []).append(ms)
                roles = job.cpu_per_step(phase, int(res[0]["phases"][phase]["all_steps"]))
                if roles is not None:
                    roles["worker0_self"] = res[0]["phases"][phase]["cpu_ms_per_batch"]
                    for role, v in roles.items():
                        cpu.setdefault(label, {}).setdefault(phase, {}).setdefault(
                            role, []).append(v)
            info["fill_seconds"] = res[0].get("fill_seconds")
            info["stats"] = res[0].get("stats")
            before, after = job.server_rss.get("before"), job.server_rss.get("prefilled")
            if before and after and None not in before and None not in after:
                grown = sum(x or 0 for x in after) - sum(x or 0 for x in before)
                info["server_rss_growth_bytes"] = grown
                info["server_rss_bytes_per_row"] = grown / n
        jobs = jobs[1:] + jobs[:1]
        for label, python, script, flags in peers:
            try:
                out = J.run_peer(python, args.peers_dir / script,
                                 flags + workload_flags(args, n, id_dist), args.peer_timeout)
            except (J.PeerError, OSError) as err:
                log.error("%s failed: %s", label, err)
                errors[f"{label}/N={n}/{id_dist}/r{rnd}"] = str(err)
                continue
            for phase, rec in out["records"].items():
                samples.setdefault(label, {}).setdefault(phase, []).append(
                    float(rec["ms_per_batch"]))
        peers = peers[1:] + peers[:1]
    case["ms_per_batch"] = {s: {ph: {"median": statistics.median(v), "all": v}
                                for ph, v in phs.items()} for s, phs in samples.items()}
    case["cpu_ms_per_batch"] = {s: {ph: {r: statistics.median(v) for r, v in roles.items()}
                                    for ph, roles in phs.items()} for s, phs in cpu.items()}
    return case


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: N = 10000, B = 512, 3 steps, 1 round (a few seconds)")
    p.add_argument("--big", action="store_true", help="add N = 1e7 (about 12 GiB here)")
    p.add_argument("--rows", type=float, nargs="+", default=None,
                   help="table sizes N (default 1e6, with --big 1e6 1e7)")
    p.add_argument("--id-dists", nargs="+", choices=["zipf", "uniform"],
                   default=["zipf", "uniform"], help="ID distributions (default both)")
    p.add_argument("--batch", type=int, default=None, help="IDs per step (default 4096)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps per phase (50)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (5)")
    p.add_argument("--zipf-s", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=None,
                   help="repeat every measurement this many times, alternating systems "
                        "(default 3, --quick 1); figures are medians")
    p.add_argument("--fill-chunk", type=int, default=65536,
                   help="IDs per call while pskv's table is filled")
    p.add_argument("--torchrec-python", default=None,
                   help="interpreter with torch + fbgemm-gpu-cpu + torchrec (peers' README)")
    p.add_argument("--dgl-python", default=None, help="interpreter with dgl 2.1")
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR,
                   help="the peers' scripts (default ../shared/bench/embeddings)")
    p.add_argument("--peer-timeout", type=float, default=900.0,
                   help="seconds per peer run before it is killed")
    p.add_argument("--dist", action="store_true",
                   help="also 2 workers with 1 and 2 servers (dist_sync, dist_async) and "
                        "the peers' 2-process runs")
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", choices=["dist_sync", "dist_async"],
                   default=["dist_sync", "dist_async"])
    p.add_argument("--job-timeout", type=float, default=None,
                   help="seconds per pskv dist job (default 600, --quick 120)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU run: only the pskv dist jobs (no local cases, no peers); their "
                        "CPU ms per step by role is what to read on a busy machine")
    p.add_argument("--profile", type=Path, default=None,
                   help="with --dist or --cpu: cProfile of each job's train phase, every worker "
                        "and every server, into this folder (one subfolder per job)")
    p.add_argument("--profile-phase", choices=["lookup", "train", "insert"], default="train",
                   help="the phase --profile profiles (default train)")
    p.add_argument("--out", type=Path, default=_common.RESULTS_DIR,
                   help="results folder (default benchmarks/results)")
    p.add_argument("--name", default=None,
                   help="results name (no suffix); default bench_embeddings for a full run, "
                        "bench_embeddings-partial for any other")
    p.add_argument("--no-write", action="store_true", help="print only; write no files")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick / --big."""
    if args.rows is None:
        args.rows = [1e4] if args.quick else ([1e6, 1e7] if args.big else [1e6])
    args.rows = [int(r) for r in args.rows]
    if args.cpu:
        args.torchrec_python = args.dgl_python = None
    for name, full, quick in (("batch", 4096, 512), ("steps", 50, 3), ("warmup", 5, 1),
                              ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.job_timeout is None:
        args.job_timeout = 120.0 if args.quick else 600.0
    return args


def results_name(args: argparse.Namespace) -> str:
    """``--name``; else ``bench_embeddings`` for a full run, ``-partial`` for any other.

    A run is full when every workload setting is the default and it has 3 or more rounds
    (``--big``, ``--dist`` and the peers' interpreters add figures; they do not make a
    run partial)."""
    if args.name:
        return str(args.name)
    full = resolve(parse_args([]))
    same = all(getattr(args, k) == getattr(full, k) for k in
               ("quick", "cpu", "id_dists", "batch", "dim", "steps", "warmup", "zipf_s", "seed",
                "lr", "servers", "modes"))
    rows_ok = set(full.rows) <= set(args.rows)
    return "bench_embeddings" if same and rows_ok and args.rounds >= 3 \
        else "bench_embeddings-partial"


#: flags whose values are paths of this machine: masked in the recorded command line
PATH_FLAGS = ("--torchrec-python", "--dgl-python", "--peers-dir", "--out")


def _placeholder(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()      # --dgl-python -> DGL_PYTHON


def masked_command(argv: list[str] | None = None) -> str:
    """The command line, the values of :data:`PATH_FLAGS` replaced by their flag's name."""
    argv = list(sys.argv if argv is None else argv)
    out: list[str] = []
    mask = False
    for a in argv:
        flag = a.split("=", 1)[0]
        if mask:
            out.append(_placeholder(out[-1]))
            mask = False
        elif flag in PATH_FLAGS and "=" in a:
            out.append(f"{flag}={_placeholder(flag)}")
        else:
            out.append(a)
            mask = a in PATH_FLAGS
    return _common.command_line(out)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = resolve(parse_args(argv))
    peers_ok = args.peers_dir.is_dir()
    if (args.torchrec_python or args.dgl_python) and not peers_ok:
        log.error("the peers' scripts are not in %s: peers skipped", args.peers_dir)
        args.torchrec_python = args.dgl_python = None
    import pskv
    data: dict[str, Any] = {
        "benchmark": "bench_embeddings", "command": masked_command(),
        "timestamp": _common.timestamp(), "commit": _common.commit_info(),
        "machine": _common.machine_info(), "pskv": getattr(pskv, "__version__", None),
        "workload": {"rows": args.rows, "dim": args.dim, "batch": args.batch,
                     "id_dists": args.id_dists, "zipf_s": args.zipf_s, "steps": args.steps,
                     "warmup": args.warmup, "seed": args.seed, "lr": args.lr, "eps": EPS,
                     "rounds": args.rounds},
        "peers": {"torchrec": bool(args.torchrec_python), "dgl": bool(args.dgl_python)},
        "threads": J.THREAD_VARS, "issue_ms_per_step": R.ISSUE, "local": {}, "dist": {},
        "errors": {}}
    t_all = time.monotonic()
    for n in [] if args.cpu else args.rows:
        for id_dist in args.id_dists:
            log.info("local N=%d %s ...", n, id_dist)
            data["local"][f"N={n}/{id_dist}"] = run_local_case(args, n, id_dist,
                                                               data["errors"])
    if args.dist or args.cpu:
        with tempfile.TemporaryDirectory(prefix="bench_emb-") as tmpd:
            for n in args.rows:
                for id_dist in args.id_dists:
                    data["dist"][f"N={n}/{id_dist}"] = run_dist_case(
                        args, n, id_dist, Path(tmpd), data["errors"])
    data["elapsed_s"] = time.monotonic() - t_all
    try:
        data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        data["machine"]["loadavg_at_end"] = None
    data["ratios"] = R.ratios(data)
    data["targets"] = R.targets(data)
    print()
    print(R.summary(data, markdown=False))
    if not args.no_write:
        j, m = _common.write_results(results_name(args), data, R.markdown(data), args.out)
        print(f"\nwrote {j} and {m}")
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
