"""The long chaos soak (issue 20): faults survived and time lost per fault, to results.

Run from the repository root (a quiet machine; about four times ``--seconds`` in all)::

    python benchmarks/bench_chaos.py                  # 300 s of faults per store type
    python benchmarks/bench_chaos.py --seconds 60     # shorter
    python benchmarks/bench_chaos.py --seed 21        # another schedule of kills
    python benchmarks/bench_chaos.py --quick          # the CI variant's size; writes nothing
    python benchmarks/bench_chaos.py --data --seconds 1800 --interval 15
                                     # the exactly-once soak of a pskv.data job (issue #32)

It runs ``tests/durability/test_chaos.py`` with ``CHAOS_SECONDS`` set: 3 servers and 3
workers under ``pskv-launch`` with replicas and restarts, a random server or worker
SIGKILLed every few seconds. ``dist_sync`` must end with the weights of an undisturbed run
of the same steps (run first: the time lost per fault is the difference of the two run
times over the faults); ``dist_async`` must apply every push exactly once. The tests assert
those; this script reports what they print, and fails if they fail. Results go to
``benchmarks/results/bench_chaos.{json,md}`` with the machine and the commit.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parent.parent
#: what the data soak prints (tests/durability/test_data_exactly_once.py)
DATA_LINE = re.compile(r"chaos data dist_sync: (\d+) faults survived in (\d+) s "
                       r"\((\d+) steps, the calm run (\d+) s unpaced\): (.*)")
#: what each test prints once its job ended
LINE = re.compile(r"chaos (dist_sync|dist_async): (\d+) faults survived in (\d+) s"
                  r"(?:, ([\d.]+) s lost per fault)?: (.*)")


def soak(seconds: float, timeout: float, seed: int | None = None) \
        -> tuple[int, str, list[dict[str, Any]]]:
    """Run the chaos tests for ``seconds`` of faults each (``seed``: another schedule of
    kills than the tests' own); (exit code, output, reports)."""
    env = {**os.environ, "CHAOS_SECONDS": str(seconds)}
    if seed is not None:
        env["CHAOS_SEED"] = str(seed)
    cmd = [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
           "--timeout", str(int(timeout)), str(ROOT / "tests" / "durability" / "test_chaos.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=2 * timeout + 60, check=False)
    out = proc.stdout + proc.stderr
    reports = []
    for m in LINE.finditer(out):
        mode, faults, took, lost, kills = m.groups()
        reports.append({"mode": mode, "faults": int(faults), "seconds": int(took),
                        "lost_per_fault_s": None if lost is None else float(lost),
                        "kills": kills.strip()})
    return proc.returncode, out, reports


def data_soak(seconds: float, interval: float, seed: int | None) \
        -> tuple[int, str, dict[str, Any] | None]:
    """The exactly-once soak (issue #32): a pskv.torch job reading a counting data set
    through pskv.data, 3 servers and 3 workers, a random one SIGKILLed every ``interval``
    seconds for ``seconds``; it must end with the calm run's values, optimizer states and
    samples trained, bit for bit. (exit code, output, report)."""
    env = {**os.environ, "CHAOS_SECONDS": str(seconds), "CHAOS_INTERVAL": str(interval)}
    if seed is not None:
        env["CHAOS_SEED"] = str(seed)
    timeout = 900 + 4 * seconds
    cmd = [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
           "--timeout", str(int(timeout)),
           str(ROOT / "tests" / "durability" / "test_data_exactly_once.py") + "::"
           "test_sync_job_under_chaos_trains_each_sample_once_with_the_calm_bits"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout + 120, check=False)
    out = proc.stdout + proc.stderr
    m = DATA_LINE.search(out)
    report = None if m is None else {
        "faults": int(m[1]), "seconds": int(m[2]), "steps": int(m[3]),
        "calm_unpaced_s": int(m[4]), "kills": m[5].strip()}
    return proc.returncode, out, report


def _data_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    code, out, report = data_soak(args.seconds, args.interval, args.seed)
    if code != 0 or report is None:
        fd, path = tempfile.mkstemp(prefix="bench-chaos-data-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(out)
        print(out[-4000:])
        print(f"the data soak failed (exit {code}): nothing written; the output is in {path}")
        return 1
    roles = [w.split(" at ")[0].split()[0] for w in report["kills"].split(", ")]
    last = max(int(w.split(" at ")[1].split()[0]) for w in report["kills"].split(", "))
    data = {"benchmark": "bench_chaos --data", "time": _common.timestamp(),
            "machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(argv), "seconds": args.seconds,
            "interval": args.interval, "seed": args.seed, "result": report}
    md = (f"# bench_chaos --data\n\n{data['command']}\n\nCommit {data['commit']}"
          f"{' (dirty)' if data['dirty'] else ''}, {data['time']}, "
          f"{data['machine']['cpu_model']} x{data['machine']['cpu_count']}. A pskv.torch "
          "job (DistributedOptimizer(update_on_kvstore=True), SGD with momentum on the "
          "servers) reading a counting data set through pskv.data.Sampler, 3 servers and 3 "
          "workers under pskv-launch with PSKV_REPLICAS=1 and --max-restarts, a random "
          f"server or worker SIGKILLed about every {args.interval:g} s for {args.seconds:g} s "
          f"(the last kill {last} s into the job; none near its last step). "
          "Asserted by tests/durability/test_data_exactly_once.py: the values (the model "
          "and the per-sample counter \"seen\"), the optimizer states and the steps every "
          "worker trained equal the calm run's, bit for bit.\n\n"
          + _common.md_table(["faults survived", "workers killed", "servers killed",
                              "job s", "steps", "calm run s (unpaced)"],
                             [[report["faults"], roles.count("worker"),
                               roles.count("server"), report["seconds"], report["steps"],
                               report["calm_unpaced_s"]]])
          + f"\n\nKilled (s into the job): {report['kills']}\n")
    print(md)
    paths = _common.write_results("bench_chaos_data", data, md)
    print("wrote", *(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0,
                    help="seconds of faults per store type (default 300)")
    ap.add_argument("--seed", type=int, default=None,
                    help="another schedule of kills (CHAOS_SEED; default: the tests' own)")
    ap.add_argument("--quick", action="store_true",
                    help="the CI variant's size (about six faults); writes nothing")
    ap.add_argument("--data", action="store_true",
                    help="the exactly-once soak of a pskv.data job instead (issue #32): "
                         "--seconds of kills (e.g. 1800), one every --interval s")
    ap.add_argument("--interval", type=float, default=15.0,
                    help="with --data: seconds between two kills (default 15)")
    args = ap.parse_args(argv)
    if args.data:
        return _data_main(args, argv)
    seconds = 0.0 if args.quick else args.seconds
    code, out, reports = soak(seconds, timeout=max(600.0, 8 * seconds), seed=args.seed)
    header = ["store", "faults survived", "job s", "s lost per fault", "killed (s into the job)"]
    rows = [[r["mode"], r["faults"], r["seconds"],
             "" if r["lost_per_fault_s"] is None else f"{r['lost_per_fault_s']:.1f}",
             r["kills"]] for r in reports]
    print(_common.text_table(header, rows))
    if code != 0 or len(reports) != 2:
        fd, path = tempfile.mkstemp(prefix="bench-chaos-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(out)
        print(out[-4000:])
        print(f"the chaos tests failed (exit {code}): nothing written; the whole output "
              f"is in {path}")
        return 1
    data = {"benchmark": "bench_chaos", "time": _common.timestamp(),
            "machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(argv), "seconds": seconds, "seed": args.seed,
            "results": reports}
    md = (f"# bench_chaos\n\n{data['command']}\n\nCommit {data['commit']}"
          f"{' (dirty)' if data['dirty'] else ''}, {data['time']}, "
          f"{data['machine']['cpu_model']} x{data['machine']['cpu_count']}. 3 servers and 3 "
          "workers under pskv-launch, PSKV_REPLICAS=1 and --max-restarts, a random server "
          f"or worker SIGKILLed every few seconds for {seconds:g} s of steps per store "
          "type. dist_sync ended with the undisturbed run's weights and dist_async applied "
          "every push once (asserted by tests/durability/test_chaos.py); the time lost per "
          "fault is (chaos run - undisturbed run) / faults, dist_sync only.\n\n"
          + _common.md_table(header, rows) + "\n")
    if not args.quick:
        paths = _common.write_results("bench_chaos", data, md)
        print("wrote", *(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
