"""Servers added and removed while a job trains: the longest pause, and the bytes moved.

Run from the repository root (a quiet machine; about 3 minutes on 2 cores)::

    python benchmarks/bench_reshard.py
    python benchmarks/bench_reshard.py --rows 100000 --no-write      # smoke

``pskv-launch -n 2 -s 3 --control SOCKET``, ``dist_sync``, ``PSKV_REPLICAS=1``. The workers
fill a table of ``--rows`` x 64 float32 rows trained with AdaGrad (1e6 rows: 256 MB of
weights and 256 MB of AdaGrad state), then train: each step looks up ``--batch`` random IDs,
pushes a gradient for each and pushes and pulls a dense key. Server 2 is removed (the job
runs on 2 servers), then the measured moves: server 2 added (2 -> 3: its slot's shard is
handed back to it) and removed again (3 -> 2: its backup serves its shard).

Each worker records every step's start and end; a move's **pause** is the longest step that
overlaps it (from the command to the moved shard served by its new server, plus 1 s),
against the median step of the calm windows between moves (the reference, in the same
run). **Bytes moved** are the whole copies the servers sent from the command on (each logs
its bytes): for an add, the shard's copy to the added server, and the copies that restore
the backups of the shards next to it; against the table's bytes (weights and AdaGrad
state), the aim being about 1/S of it. Results go to ``benchmarks/results/bench_reshard.{json,md}``.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]

DIM = 64
SERVERS = 3
#: the servers' log line of a whole copy sent to a backup (durable/_replica.py)
COPIED = re.compile(r"server (\d+): server (\d+) is the backup of shard (\d+) "
                    r"\((\d+) keys copied, (\d+) bytes\)")
SERVES = re.compile(r"server (\d+): serves shard (\d+) now")


# ---- the worker ------------------------------------------------------------------------
def worker(out: Path, rows: int, batch: int) -> None:
    import pskv as mx
    from pskv.table import Normal, TableSpec
    kv = mx.kv.create("dist_sync")
    kv.init("emb", TableSpec(dim=DIM, init=Normal(0.0, 0.01), seed=1))
    kv.init("w", mx.nd.zeros(65536))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.01))
    chunk = 65536
    for lo in range(kv.rank * chunk, rows, chunk * kv.num_workers):     # fill the table
        ids = np.arange(lo, min(lo + chunk, rows), dtype=np.int64)
        got, _ = kv.lookup("emb", ids)
        kv.push("emb", (ids, np.zeros_like(got)))       # AdaGrad's state for every row
    kv.barrier()
    if kv.rank == 0:
        (out / "ready").write_text("1")
    rng = np.random.default_rng(kv.rank)
    grad_w = mx.nd.array(np.full(65536, 0.01, np.float32))
    w = mx.nd.zeros(65536)
    times: list[tuple[float, float]] = []
    while not (out / "stop").exists() and len(times) < 200_000:
        t0 = time.time()
        ids = rng.integers(0, rows, batch).astype(np.int64)
        got, _ = kv.lookup("emb", ids)
        kv.push("emb", (ids, (got * 0.01).astype(np.float32)))
        kv.push("w", grad_w)
        kv.pull("w", out=w)
        times.append((t0, time.time()))
    # every worker takes as many steps: the others' rounds wait for this one's pushes
    (out / f"steps-{kv.rank}.json").write_text(json.dumps(times))
    kv.barrier()
    kv.close()


# ---- the driver ------------------------------------------------------------------------
class Log(io.TextIOBase):
    """The job's stderr: kept (with when each line came) and searched."""

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.lines: list[tuple[float, str]] = []
        self._part = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        if self.echo:
            sys.stderr.write(text)
        with self.lock:
            parts = (self._part + text).split("\n")
            self._part = parts.pop()
            now = time.time()
            self.lines.extend((now, p) for p in parts)
        return len(text)

    def since(self, t: float, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        with self.lock:
            return [(at, m) for at, line in self.lines if at >= t
                    for m in [pattern.search(line)] if m is not None]


def _wait(what: str, cond: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pskv.launch import control, launch
    tmp = Path(tempfile.mkdtemp(prefix="pskv-reshard-"))
    out, sock = tmp / "out", str(tmp / "control.sock")
    out.mkdir()
    log = Log(echo=args.timeline)
    env = {"PSKV_REPLICAS": "1", "PSKV_HEARTBEAT_TIMEOUT": "30", "PSKV_CONNECT_TIMEOUT": "120",
           "PSKV_REQUEST_TIMEOUT": "300", "PSKV_LOG_LEVEL": "INFO"}
    result: dict[str, Any] = {}
    job = threading.Thread(target=lambda: result.setdefault("launch", launch(
        [sys.executable, __file__, "--worker", str(out), "--rows", str(args.rows),
         "--batch", str(args.batch)], 2, SERVERS, env=env, timeout=1800, control=sock,
        server_command=[sys.executable, "-m", "pskv.server"], stderr=log)), daemon=True)
    job.start()
    marks: dict[str, Any] = {}
    try:
        _wait("the table to fill", lambda: (out / "ready").exists() or not job.is_alive(), 900)
        if not job.is_alive():
            raise RuntimeError(f"the job ended early: {result.get('launch')}")
        time.sleep(args.calm)
        control(sock, "remove-server", 2, wait=120)          # to 2 servers (not measured)
        time.sleep(args.calm)
        marks["calm_a"] = (time.time() - args.calm, time.time())

        def move(name: str, request: str, host: str) -> None:
            """Send ``request`` for server 2; the move is over once ``host`` serves
            shard 2 (its log line); then a calm window."""
            t = time.time()
            control(sock, request, 2, **({"wait": 120} if request == "remove-server" else {}))
            _wait(f"shard 2 served by server {host}", lambda: any(
                m[1] == host and m[2] == "2" for _, m in log.since(t, SERVES)))
            marks[name] = (t, max(at for at, m in log.since(t, SERVES) if m[1] == host))
            time.sleep(args.calm)
        move("add", "add-server", "2")                       # 2 -> 3
        marks["calm_b"] = (time.time() - args.calm + 1.0, time.time())
        move("remove", "remove-server", "0")                 # 3 -> 2
        marks["calm_c"] = (time.time() - args.calm + 1.0, time.time())
    finally:
        (out / "stop").write_text("1")
        job.join(600)
    steps = [json.loads((out / f"steps-{r}.json").read_text()) for r in range(2)]
    if args.timeline:       # the long steps beside what the servers said meanwhile
        t0 = marks["add"][0] - 1.0
        print(f"timeline from {t0:.3f}")
        long = sorted((a, b, r) for r, ws in enumerate(steps) for a, b in ws
                      if b - a > 0.05 and a >= t0)
        said = [(at, line) for at, line in log.lines if at >= t0 and "] " in line and
                ("shard" in line or "server 2" in line)]
        for at, what in sorted([(a, f"worker {r}: step of {(b - a) * 1000:.0f} ms")
                                for a, b, r in long] + said)[:80]:
            print(f"{at - t0:8.3f}  {what[:150]}")
    table = args.rows * DIM * 4 * 2
    calm = [b - a for ws in steps for a, b in ws
            for lo, hi in (marks["calm_a"], marks["calm_b"], marks["calm_c"])
            if lo <= a and b <= hi]
    ref = statistics.median(calm)
    report: dict[str, Any] = {"rows": args.rows, "dim": DIM, "batch": args.batch,
                              "table_bytes": table, "median_step_s": ref,
                              "calm_steps": len(calm)}
    for name, until in (("add", "calm_b"), ("remove", "calm_c")):
        lo, hi = marks[name]
        during = [b - a for ws in steps for a, b in ws if b >= lo and a <= hi + 1.0]
        # the copies go on after the shard moved (a backup's): all until the next move
        copies = [(int(m[1]), int(m[2]), int(m[3]), int(m[5]))
                  for at, m in log.since(lo, COPIED) if at <= marks[until][1]]
        moved = sum(c[3] for c in copies)
        report[name] = {"longest_step_s": max(during), "pause_s": max(during) - ref,
                        "steps": len(during), "seconds": hi - lo,
                        "copies": copies, "bytes_moved": moved,
                        "of_table": moved / table,
                        "shard_copy_bytes": sum(c[3] for c in copies if c[2] == 2
                                                and c[1] == 2)}
    return report


def _markdown(rep: dict[str, Any], data: dict[str, Any]) -> str:
    mb = 1 << 20
    m = data["machine"]
    lines = [
        "# Servers added and removed while training (`bench_reshard.py`)", "",
        f"{data['command']}", "",
        f"Commit {data.get('commit')}, {data['time']}, {m['cpu_model']} x{m['cpu_count']}.",
        "",
        f"`pskv-launch -n 2 -s 3 --control`, dist_sync, PSKV_REPLICAS=1; a table of "
        f"{rep['rows']:,} x {rep['dim']} float32 rows with AdaGrad "
        f"({rep['table_bytes'] / mb:,.0f} MB with its state), steps of {rep['batch']} "
        f"IDs looked up and pushed and a 64 K dense key pushed and pulled. Calm step "
        f"(median of {rep['calm_steps']}, the reference): "
        f"{rep['median_step_s'] * 1000:.1f} ms.", "",
        "| move | longest step | pause (longest - calm) | move took | whole copies sent | "
        "bytes moved | of the table |",
        "|---|---|---|---|---|---|---|"]
    for name, what in (("add", "2 -> 3 (server 2 added)"), ("remove", "3 -> 2 (server 2 "
                                                                         "removed)")):
        r = rep[name]
        copies = "; ".join(f"shard {s}: server {a} -> {b}, {n / mb:.0f} MB"
                           for a, b, s, n in r["copies"]) or "none"
        lines.append(f"| {what} | {r['longest_step_s'] * 1000:.0f} ms | "
                     f"{r['pause_s'] * 1000:.0f} ms | {r['seconds']:.2f} s | {copies} | "
                     f"{r['bytes_moved'] / mb:,.0f} MB | {r['of_table']:.2f} |")
    if len(rep.get("runs", [])) > 1:
        lines += ["", f"Pauses of each of the {len(rep['runs'])} runs (the table shows the one "
                  "whose add paused longest): add " + ", ".join(
                      f"{r['add']['pause_s'] * 1000:.0f} ms" for r in rep["runs"]) +
                  "; remove " + ", ".join(f"{r['remove']['pause_s'] * 1000:.0f} ms"
                                          for r in rep["runs"]) + "."]
    lines += ["", "The add's longest step comes as the new server starts and is admitted "
              "and the server handing its shard back takes its in-memory copy (2 cores "
              "shared by 2 workers, 3 servers and the scheduler; `--timeline` shows it); "
              "the copy then travels on a thread while training goes on, the neighbour "
              "shard's backup copy waits until the handback is done (one whole copy at a "
              "time), and the handback itself waits for the last changes only. The remove "
              "copies nothing: the backup has the shard. Bytes moved are every whole copy "
              "sent until the next move: the shard handed back (1/3 of the table) and the "
              "neighbour shard's backup, which the removal had left without one; none goes "
              "back to the server that handed the shard over (it keeps its copy as the "
              "backup)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--calm", type=float, default=8.0, help="seconds between moves")
    p.add_argument("--repeats", type=int, default=3, help="whole runs (the worst is shown)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--timeline", action="store_true",
                   help="print the long steps beside the servers' lines about shards")
    p.add_argument("--worker", type=str, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.rows, args.batch)
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import _common      # type: ignore[import-not-found]
    runs = [run(args) for _ in range(args.repeats)]
    # the run whose add paused longest is reported in full; every run's pauses beside it
    rep = max(runs, key=lambda r: r["add"]["pause_s"])
    rep["runs"] = [{m: {"pause_s": r[m]["pause_s"], "bytes_moved": r[m]["bytes_moved"]}
                    for m in ("add", "remove")} for r in runs]
    data = {"machine": _common.machine_info(), **_common.commit_info(),
            "command": _common.command_line(), "time": _common.timestamp(), **rep}
    md = _markdown(rep, data)
    print(md)
    if not args.no_write:
        for path in _common.write_results("bench_reshard", data, md):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
