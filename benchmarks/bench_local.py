"""Local-store benchmark: pskv against MXNet 1.9.1 and NumPy's own reduce-and-broadcast.

Run from the repository root::

    python benchmarks/bench_local.py            # full run, about 5-10 minutes on 2 cores
    python benchmarks/bench_local.py --quick    # smoke run, well under a minute
    PSKV_MXNET_PYTHON=/path/to/mxnet-venv/bin/python python benchmarks/bench_local.py

Each library runs in its own worker process (``_local_worker.py``): pskv and the NumPy
reference under this interpreter, MXNet 1.9.1 under ``PSKV_MXNET_PYTHON`` when it is set
(MXNet needs ``numpy<1.24``, so it lives in another venv). Every workload is set up in all
workers, then the timed repeats go round-robin (pskv, MXNet, NumPy, with the order rotated
each round), so a change in machine load hits every library alike. Figures are medians of
the repeats (and the best repeat). Results go to ``benchmarks/results/bench_local.json``
and ``bench_local.md`` with the machine, the commit and the command line; the targets are
reported as PASS or MISS, never asserted.

The pskv half also runs under pytest-benchmark::

    python -m pytest benchmarks/bench_local.py --benchmark-only
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common
import _local_worker

log = logging.getLogger("bench_local")

ENV_MXNET_PYTHON = "PSKV_MXNET_PYTHON"
WORKER = Path(_local_worker.__file__).name
F32 = 4  # bytes per float32

#: the issue's targets: (id, description, goal)
TARGETS = {
    "tiny": "tiny-key push+pull time <= 0.2 x MXNet's",
    "list": "1000-key list calls: keys/s >= 2 x MXNet's",
    "aggregate": "aggregation from 2+ devices: GB/s >= 0.8 x NumPy on 2 threads",
    "updater": "updaters (stored += input * 2, SGD momentum): GB/s >= 1.5 x MXNet's",
}


def big_bytes(size: int, devices: int) -> int:
    """Bytes one push+pull of ``devices`` arrays of ``size`` float32 moves, by definition.

    Push reduces: reads ``devices`` arrays, writes 1; pull broadcasts: reads 1, writes
    ``devices``. So ``2 * (devices + 1) * size * 4`` bytes, for every library and mode (an
    updater's own extra traffic is not counted: its figures are effective rates).
    """
    return 2 * (devices + 1) * size * F32


# ---- settings ---------------------------------------------------------------------------
def worker_env(lib: str) -> dict[str, str]:
    """The environment of a worker: ours, minus cluster variables, plus thread settings.

    ``OMP_NUM_THREADS`` defaults to the CPU count for every worker (MXNet's OpenMP kernels
    use it; pskv and NumPy's element-wise loops ignore it). ``MXNET_*`` and
    ``PSKV_REDUCE_THREADS`` set by the caller pass through; otherwise pskv runs with its
    default (a reduce pool of min(CPU count, 8) threads) and MXNet with its threaded engine
    and ``MXNET_KVSTORE_REDUCTION_NTHREADS`` = min(4, CPU count) (MXNet's default is 4; on 2
    cores, 2 threads aggregate faster) for arrays over 1e6 elements.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "PSKV_")) or k == "PSKV_REDUCE_THREADS"}
    ncpu = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(ncpu))
    if lib == "mxnet":  # MXNet's default is 4, which oversubscribes machines with fewer cores
        env.setdefault("MXNET_KVSTORE_REDUCTION_NTHREADS", str(min(4, ncpu)))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if lib != "mxnet":
        env = {k: v for k, v in env.items() if not k.startswith("MXNET_")}
    return env


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cases to run, each with the participants that run it."""
    cases: list[dict[str, Any]] = []
    if "tiny" in args.only:
        cases.append({"id": "tiny", "case": {"kind": "tiny", "shape": [2, 3]},
                      "reps": args.reps_small, "budget": args.budget_small})
    if "list" in args.only:
        cases.append({"id": "list", "case": {"kind": "list", "keys": 1000, "size": 1000},
                      "reps": args.reps_small, "budget": args.budget_small})
    if "big" in args.only:
        for mode in args.modes:
            for size in args.sizes:
                for d in args.devices:
                    cases.append({"id": f"big/{mode}/{size}/{d}", "reps": args.reps_big,
                                  "budget": args.budget_big,
                                  "case": {"kind": "big", "size": size, "devices": d,
                                           "mode": mode}})
    return cases


def participants(case: dict[str, Any], workers: dict[str, _common.Worker]) -> dict[str, Any]:
    """``{label: (worker, case)}`` for one case: pskv, MXNet and (for plain aggregation)
    the NumPy reference on 1 and 2 threads."""
    out: dict[str, Any] = {}
    for lib in ("pskv", "mxnet"):
        if lib in workers:
            out[lib] = (workers[lib], case)
    if case["kind"] == "big" and case["mode"] == "assign" and "numpy" in workers:
        for t in (1, 2):
            out[f"numpy-{t}t"] = (workers["numpy"], {"kind": "np_big", "size": case["size"],
                                                   "devices": case["devices"], "threads": t})
    return out


# ---- running ------------------------------------------------------------------------------
def start_workers(args: argparse.Namespace) -> tuple[dict[str, _common.Worker], dict[str, Any]]:
    workers: dict[str, _common.Worker] = {}
    notes: dict[str, Any] = {}
    here = sys.executable
    pythons = {"pskv": here, "numpy": here}
    mx_python = os.environ.get(ENV_MXNET_PYTHON, "")
    if args.no_mxnet:
        notes["mxnet"] = "skipped (--no-mxnet)"
    elif not mx_python:
        notes["mxnet"] = (f"not measured: {ENV_MXNET_PYTHON} is not set (name the python of "
                          "a venv with mxnet==1.9.1 and numpy<1.24)")
    elif not Path(mx_python).exists():
        notes["mxnet"] = f"not measured: {ENV_MXNET_PYTHON} names no file"
    else:
        pythons["mxnet"] = mx_python
    for lib, python in pythons.items():
        argv = [python, WORKER, "--lib", lib, "--budget", str(args.budget_big)]
        try:
            w = _common.Worker(argv, worker_env(lib), _local_worker.REPLY_PREFIX,
                               timeout=args.timeout)
        except _common.WorkerError as err:
            notes[lib] = f"worker failed to start: {err}"
            log.warning("%s worker failed to start: %s", lib, err)
            continue
        workers[lib] = w
        notes.setdefault(lib, "measured")
    if "mxnet" not in workers:
        log.warning("MXNet: %s", notes["mxnet"])
    return workers, notes


def run_case(entry: dict[str, Any], workers: dict[str, _common.Worker],
             timeout: float) -> dict[str, Any]:
    """Set the case up in every participant, run the repeats round-robin, tear down."""
    parts = participants(entry["case"], workers)
    result: dict[str, Any] = {"id": entry["id"], "case": entry["case"], "by": {}}
    ready = []
    for label, (w, case) in parts.items():
        rec: dict[str, Any] = {"times": []}
        result["by"][label] = rec
        try:
            rep = w.call({"op": "setup", "name": label, "case": case,
                          "budget": entry["budget"]}, timeout)
        except _common.WorkerError as err:
            rec["error"] = str(err)
            continue
        if not rep["ok"]:
            rec["error"] = rep["error"]
            log.warning("%s %s: %s", entry["id"], label, rep["error"])
            continue
        rec["iters"] = rep["result"]["iters"]
        ready.append(label)
    for r in range(entry["reps"]):
        k = r % max(1, len(ready))
        for label in ready[k:] + ready[:k]:  # rotate who goes first
            rec = result["by"][label]
            if "error" in rec:
                continue
            w = parts[label][0]
            try:
                rep = w.call({"op": "run", "name": label, "reps": 1}, timeout)
            except _common.WorkerError as err:
                rec["error"] = str(err)
                continue
            if rep["ok"]:
                rec["times"] += rep["result"]["times"]
            else:
                rec["error"] = rep["error"]
    for label in ready:
        w, rec = parts[label][0], result["by"][label]
        if not w.alive:
            continue
        try:
            rep = w.call({"op": "teardown", "name": label}, timeout)
        except _common.WorkerError as err:
            rec.setdefault("error", str(err))
            continue
        if rep["ok"]:
            rec["check"] = rep["result"]["check"]
            rec["peak_rss_mib"] = rep["result"]["peak_rss_mib"]
            if not rec["check"]:
                log.warning("%s %s: WRONG RESULT", entry["id"], label)
        else:
            rec.setdefault("error", rep["error"])
    summarize(result)
    return result


def warm_up(workers: dict[str, _common.Worker], timeout: float) -> None:
    """One unrecorded case in every worker first: the first case a process runs is slow
    (page faults, thread pools, CPU frequency), and would otherwise skew whichever case
    comes first."""
    for lib, w in workers.items():
        case = ({"kind": "np_big", "threads": 2} if lib == "numpy" else
                {"kind": "big", "mode": "assign"})
        case.update(size=1 << 20, devices=2)
        try:
            w.call({"op": "setup", "name": "warm-up", "case": case, "budget": 0.3}, timeout)
            w.call({"op": "run", "name": "warm-up", "reps": 1}, timeout)
            w.call({"op": "teardown", "name": "warm-up"}, timeout)
        except _common.WorkerError as err:
            log.warning("%s worker: warm-up failed: %s", lib, err)


def summarize(result: dict[str, Any]) -> None:
    """Add median/best seconds and the case's unit (us, keys/s or GB/s) to each record."""
    case = result["case"]
    for rec in result["by"].values():
        if not rec["times"]:
            continue
        med, best = statistics.median(rec["times"]), min(rec["times"])
        rec["median_s"], rec["best_s"] = med, best
        if case["kind"] == "tiny":
            rec["us"], rec["us_best"] = med * 1e6, best * 1e6
        elif case["kind"] == "list":
            rec["keys_per_s"], rec["keys_per_s_best"] = case["keys"] / med, case["keys"] / best
        else:
            nbytes = big_bytes(case["size"], case["devices"])
            rec["gb_per_s"], rec["gb_per_s_best"] = nbytes / med / 1e9, nbytes / best / 1e9


# ---- targets -------------------------------------------------------------------------------
def _fig(rec: dict[str, Any] | None, key: str) -> float | None:
    return None if rec is None else rec.get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def evaluate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per target instance: the figures, their ratio, the goal and PASS/MISS."""
    rows: list[dict[str, Any]] = []

    def add(target: str, what: str, ratio: float | None, goal: float, higher: bool,
            detail: str, missing: str) -> None:
        if ratio is None:
            verdict = f"n/a ({missing})"
        else:
            verdict = "PASS" if (ratio >= goal if higher else ratio <= goal) else "MISS"
        rows.append({"target": target, "what": what, "ratio": ratio,
                     "goal": (">= " if higher else "<= ") + f"{goal:g}", "verdict": verdict,
                     "detail": detail})

    for res in results:
        by, case = res["by"], res["case"]
        p, m = by.get("pskv"), by.get("mxnet")
        if case["kind"] == "tiny":
            add("tiny", "tiny push+pull, pskv/MXNet time", _ratio(_fig(p, "us"), _fig(m, "us")),
                0.2, False, f"pskv {_fmt(_fig(p, 'us'))} us, MXNet {_fmt(_fig(m, 'us'))} us",
                "no MXNet figure" if p else "no pskv figure")
        elif case["kind"] == "list":
            add("list", "1000 keys x 1000 floats, pskv/MXNet keys/s",
                _ratio(_fig(p, "keys_per_s"), _fig(m, "keys_per_s")), 2.0, True,
                f"pskv {_fmt(_fig(p, 'keys_per_s'), 0)} keys/s, "
                f"MXNet {_fmt(_fig(m, 'keys_per_s'), 0)} keys/s",
                "no MXNet figure" if p else "no pskv figure")
        elif case["mode"] == "assign" and case["devices"] >= 2:
            n2 = by.get("numpy-2t")
            add("aggregate", f"{_size(case['size'])} x {case['devices']} dev, pskv/NumPy-2t",
                _ratio(_fig(p, "gb_per_s"), _fig(n2, "gb_per_s")), 0.8, True,
                f"pskv {_fmt(_fig(p, 'gb_per_s'))} GB/s, NumPy 2 threads "
                f"{_fmt(_fig(n2, 'gb_per_s'))} GB/s", "no figure")
        elif case["mode"] in ("updater", "sgd"):
            add("updater", f"{case['mode']} {_size(case['size'])} x {case['devices']} dev, "
                "pskv/MXNet", _ratio(_fig(p, "gb_per_s"), _fig(m, "gb_per_s")), 1.5, True,
                f"pskv {_fmt(_fig(p, 'gb_per_s'))} GB/s, MXNet {_fmt(_fig(m, 'gb_per_s'))} GB/s",
                "no MXNet figure" if p and "error" not in p else
                f"pskv: {(p or {}).get('error', 'no figure')}")
    return rows


# ---- reporting ------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if digits else f"{x:,.0f}"


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else str(n)


def _cell(rec: dict[str, Any] | None, key: str, digits: int = 2) -> str:
    if rec is None:
        return "-"
    if rec.get("error") and key not in rec:
        return "error"
    s = _fmt(rec.get(key), digits)
    return s + (" (wrong)" if rec.get("check") is False else "")


def tables(results: list[dict[str, Any]]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, header, rows) for the tiny, list and big-array figures."""
    out = []
    small = [r for r in results if r["case"]["kind"] in ("tiny", "list")]
    if small:
        rows = []
        for r in small:
            p, m = r["by"].get("pskv"), r["by"].get("mxnet")
            if r["case"]["kind"] == "tiny":
                rows.append(["tiny (2,3) push+pull, us (best)",
                             f"{_cell(p, 'us')} ({_cell(p, 'us_best')})",
                             f"{_cell(m, 'us')} ({_cell(m, 'us_best')})",
                             _fmt(_ratio(_fig(p, "us"), _fig(m, "us")), 3)])
            else:
                rows.append(["1000 keys x 1000 floats, keys/s (best)",
                             f"{_cell(p, 'keys_per_s', 0)} ({_cell(p, 'keys_per_s_best', 0)})",
                             f"{_cell(m, 'keys_per_s', 0)} ({_cell(m, 'keys_per_s_best', 0)})",
                             _fmt(_ratio(_fig(p, "keys_per_s"), _fig(m, "keys_per_s")), 2)])
        out.append(("Small calls (median of repeats; best in brackets)",
                    ["workload", "pskv", "MXNet", "pskv/MXNet"], rows))
    for mode, title in (("assign", "Push+pull, no updater"),
                        ("updater", "Push+pull with updater `stored += input * 2`"),
                        ("sgd", "Push+pull with SGD(learning_rate=0.1, momentum=0.9)")):
        big = [r for r in results if r["case"]["kind"] == "big" and r["case"]["mode"] == mode]
        if not big:
            continue
        header = ["size x devices", "pskv GB/s", "MXNet GB/s", "pskv/MXNet"]
        if mode == "assign":
            header += ["NumPy 1t GB/s", "NumPy 2t GB/s", "pskv/NumPy-2t"]
        rows = []
        for r in big:
            by, c = r["by"], r["case"]
            p, m = by.get("pskv"), by.get("mxnet")
            row = [f"{_size(c['size'])} x {c['devices']}", _cell(p, "gb_per_s"),
                   _cell(m, "gb_per_s"), _fmt(_ratio(_fig(p, "gb_per_s"), _fig(m, "gb_per_s")))]
            if mode == "assign":
                n1, n2 = by.get("numpy-1t"), by.get("numpy-2t")
                row += [_cell(n1, "gb_per_s"), _cell(n2, "gb_per_s"),
                        _fmt(_ratio(_fig(p, "gb_per_s"), _fig(n2, "gb_per_s")))]
            rows.append(row)
        out.append((f"{title} (GB/s = 2 x (devices + 1) x size x 4 bytes / time, median)",
                    header, rows))
    return out


def target_rows(verdicts: list[dict[str, Any]]) -> list[list[Any]]:
    return [[v["target"], v["what"], v["detail"], _fmt(v["ratio"], 3), v["goal"], v["verdict"]]
            for v in verdicts]


TARGET_HEADER = ["target", "workload", "figures", "ratio", "goal", "verdict"]


def markdown(data: dict[str, Any]) -> str:
    m, c = data["machine"], data["commit"]
    lines = ["# bench_local: pskv local store vs MXNet 1.9.1 and NumPy", "",
             f"- command: `{data['command']}`",
             f"- time: {data['timestamp']} ({data['wall_s']:.0f} s)",
             f"- commit: `{c['commit']}`" + (" (tree dirty)" if c["dirty"] else ""),
             f"- machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['mem_total_gib']} GiB; "
             f"{m['platform']}",
             f"- load average (1, 5, 15 min): {m['loadavg_at_start']} at start, "
             f"{m.get('loadavg_at_end')} at end",
             f"- pskv: {_ver(data, 'pskv')}; MXNet: {_ver(data, 'mxnet')}",
             f"- settings: {data['settings']['threads']}",
             f"- method: {data['settings']['method']}", ""]
    lines += ["## Targets", "", _common.md_table(TARGET_HEADER, target_rows(data["targets"])), ""]
    for title, header, rows in tables(data["results"]):
        lines += [f"## {title}", "", _common.md_table(header, rows), ""]
    errors = [(r["id"], lab, rec["error"]) for r in data["results"]
              for lab, rec in r["by"].items() if rec.get("error")]
    if errors:
        lines += ["## Errors", ""] + [f"- {i} {lab}: `{e}`" for i, lab, e in errors] + [""]
    return "\n".join(lines)


def _ver(data: dict[str, Any], lib: str) -> str:
    info = data["workers"].get(lib)
    if not info:
        return data["libraries"].get(lib, "not measured")
    return f"{info.get('version')} (Python {info['python']}, NumPy {info['numpy']})"


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1M arrays only, few short repeats (well under a minute)")
    p.add_argument("--no-mxnet", action="store_true", help=f"ignore {ENV_MXNET_PYTHON}")
    p.add_argument("--only", nargs="+", choices=["tiny", "list", "big"],
                   default=["tiny", "list", "big"])
    p.add_argument("--sizes", type=int, nargs="+", help="float32 values per big array")
    p.add_argument("--devices", type=int, nargs="+", help="device counts for big arrays")
    p.add_argument("--modes", nargs="+", choices=["assign", "updater", "sgd"],
                   default=["assign", "updater", "sgd"])
    p.add_argument("--reps", type=int, help="timed repeats per case and library")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds any one worker call may take (default 180)")
    p.add_argument("--out", type=Path, default=_common.RESULTS_DIR,
                   help="directory for bench_local.json/.md (default benchmarks/results)")
    p.add_argument("--no-write", action="store_true", help="print only; write no files")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or [1 << 20]
        args.reps_small = args.reps_big = args.reps or 3
        args.budget_small, args.budget_big = 0.05, 0.05
    else:
        args.sizes = args.sizes or [1 << 20, 1 << 24]
        args.reps_small = args.reps or 15
        args.reps_big = args.reps or 7
        args.budget_small, args.budget_big = 0.2, 0.3
    args.devices = args.devices or [1, 2, 4, 8]
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    t0 = time.perf_counter()
    data: dict[str, Any] = {
        "benchmark": "bench_local", "command": _common.command_line(
            [sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
        "timestamp": _common.timestamp(), "machine": _common.machine_info(),
        "commit": _common.commit_info(), "quick": args.quick,
        "settings": {
            "threads": "OMP_NUM_THREADS=" + worker_env("pskv")["OMP_NUM_THREADS"]
                       + " in every worker; other thread settings at library defaults "
                       "unless set by the caller (see workers.*.env)",
            "method": "each iteration is push then pull then wait (MXNet: waitall / "
                      "wait_to_read); a repeat runs a fixed number of iterations sized to "
                      f"{args.budget_small} s (small) / {args.budget_big} s (big) after "
                      "warm-up; repeats alternate between libraries round-robin; figures "
                      f"are medians of {args.reps_small} (small) / {args.reps_big} (big) "
                      "repeats",
            "sizes": args.sizes, "devices": args.devices, "modes": args.modes,
            "bytes_definition": "big arrays: 2 x (devices + 1) x size x 4 bytes per "
                                "push+pull (reduce reads D writes 1, broadcast reads 1 "
                                "writes D), same for every library and mode"},
    }
    workers, notes = start_workers(args)
    data["libraries"] = notes
    data["workers"] = {lib: w.hello.get("info", {}) for lib, w in workers.items()}
    results = []
    try:
        warm_up(workers, args.timeout)
        for entry in plan(args):
            live = {lib: w for lib, w in workers.items() if w.alive}
            t = time.perf_counter()
            res = run_case(entry, live, args.timeout)
            results.append(res)
            log.info("%-22s %5.1f s  %s", entry["id"], time.perf_counter() - t,
                     "  ".join(f"{lab}={_brief(rec)}" for lab, rec in res["by"].items()))
    finally:
        for lib, w in workers.items():
            w.close()
    data["results"] = results
    data["targets"] = evaluate(results)
    data["wall_s"] = time.perf_counter() - t0
    try:
        data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        data["machine"]["loadavg_at_end"] = None
    print()
    for title, header, rows in tables(results):
        print(title)
        print(_common.text_table(header, rows))
        print()
    print("Targets")
    print(_common.text_table(TARGET_HEADER, target_rows(data["targets"])))
    if "mxnet" not in workers:
        print(f"\nMXNet: {notes.get('mxnet')}")
    if not args.no_write:
        jpath, mpath = _common.write_results("bench_local", data, markdown(data), args.out)
        print(f"\nwrote {jpath} and {mpath}")
    return 0


def _brief(rec: dict[str, Any]) -> str:
    if "error" in rec and not rec.get("times"):
        return "error"
    for key, unit, d in (("us", "us", 2), ("keys_per_s", "keys/s", 0), ("gb_per_s", "GB/s", 2)):
        if key in rec:
            return f"{_fmt(rec[key], d)}{unit}"
    return "-"


# ---- pytest-benchmark (pskv only) -------------------------------------------------------------
try:
    import pytest
except ImportError:  # the script needs no pytest
    pytest = None

if pytest is not None:
    _BIG = [(1 << 20, d, mode) for mode in ("assign", "updater", "sgd") for d in (1, 2, 8)]

    def _bench(benchmark: Any, case: dict[str, Any]) -> None:
        import pskv
        state = _local_worker.KINDS[case["kind"]](pskv, case)
        try:
            state.step()
            benchmark(state.step)
            assert state.check()
        finally:
            state.close()

    def test_tiny_push_pull(benchmark: Any) -> None:
        _bench(benchmark, {"kind": "tiny", "shape": [2, 3]})

    def test_list_1000_keys(benchmark: Any) -> None:
        _bench(benchmark, {"kind": "list", "keys": 1000, "size": 1000})

    @pytest.mark.parametrize("size,devices,mode", _BIG)
    def test_big(benchmark: Any, size: int, devices: int, mode: str) -> None:
        _bench(benchmark, {"kind": "big", "size": size, "devices": devices, "mode": mode})


if __name__ == "__main__":
    sys.exit(main())
