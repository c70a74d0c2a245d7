"""bench_multihost: pskv and MXNet 1.9.1 (ps-lite) across hosts, on shaped links.

Run from the repository root, as root (it makes network namespaces)::

    PSKV_MXNET_PYTHON=/path/to/mxnet-venv/bin/python python benchmarks/bench_multihost.py
    python benchmarks/bench_multihost.py --quick          # a smoke run, writes no results

Every process gets a host of its own in the test bed of ``benchmarks/testbed.py`` (a network
namespace with its own hostname, on one bridge): the scheduler on h0, the servers on the
next hosts, the two workers on the last ones; every link is shaped with ``tc tbf`` to each
rate of ``--rates`` (default 1gbit and 10gbit) in both directions. For each rate, in the same
run:

* the line rate: a plain TCP stream (Python ``sendall`` / ``recv_into`` of 4 MiB buffers)
  from one host to another, and two streams from two hosts into one (what two workers'
  pushes into one server need);
* pskv ``dist_sync`` over its TCP path (``PSKV_TRANSPORT=tcp``: the path processes on
  different hosts use) and MXNet 1.9.1's ps-lite (``DMLC_INTERFACE=eth0``, each node
  announcing its host's address), alternating, ``--rounds`` times; the workloads and the
  worker are bench_dist's (``_dist_worker.py``): a small key's push+pull latency, 4 KB,
  4 MB and 64 MB keys.

**Line-rate fraction** (4 MB and 64 MB keys, one server): in a push+pull iteration each of
the two workers pushes N bytes into the server and pulls N bytes back, so the server's link
carries 2N in, then 2N out (a sync round's pull waits for every push). At the measured
two-into-one rate R (per direction) the link needs at least 2N/R + 2N/R seconds; the fraction
is that over the iteration's time (1.0: the link never idles).

Results: ``benchmarks/results/bench_multihost.{json,md}`` with the machine, the commit, the
load average and the rates the links really gave. Targets (the engines issue's; a report,
never an assert): at 1 Gbit/s, 4 MB and 64 MB keys at 90% of the line rate or more; at 10
Gbit/s at least 2x ps-lite's MB/s; the small key at most 0.5x ps-lite's time.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import bench_dist as bd
import testbed

log = logging.getLogger("bench_multihost")

NUM_WORKERS = bd.NUM_WORKERS
#: bytes of one sendall / recv_into of the TCP reference
CHUNK = 4 << 20

_RECEIVER = r"""
import socket, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(n)
print("ready", flush=True)
srv.settimeout(30)
conns = [srv.accept()[0] for _ in range(n)]
total, marks = [0] * n, []
def read(i, c):
    buf = memoryview(bytearray(%d))
    first = None
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        now = time.perf_counter()
        first = first or now
        total[i] += k
    marks.append((first, time.perf_counter()))
threads = [threading.Thread(target=read, args=(i, c)) for i, c in enumerate(conns)]
for t in threads: t.start()
for t in threads: t.join()
print(sum(total), max(m[1] for m in marks) - min(m[0] for m in marks if m[0]), flush=True)
""" % CHUNK

_SENDER = r"""
import socket, sys, time
host, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=30)
buf, end = bytes(%d), time.perf_counter() + secs
while time.perf_counter() < end:
    s.sendall(buf)
s.close()
""" % CHUNK


def tcp_stream(bed: testbed.HostBed, senders: list[testbed.BedHost],
               receiver: testbed.BedHost, seconds: float) -> float:
    """MB/s of plain TCP streams from ``senders`` into ``receiver``, all at once."""
    port = 5201
    rx = subprocess.Popen(bed.exec_argv(receiver, [sys.executable, "-c", _RECEIVER,
                                                   receiver.address, str(port),
                                                   str(len(senders))]),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    txs: list[subprocess.Popen[str]] = []
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            why = rx.stderr.read() if rx.stderr else ""
            raise RuntimeError(f"the TCP receiver did not start: {why}")
        txs = [subprocess.Popen(bed.exec_argv(h, [sys.executable, "-c", _SENDER,
                                                  receiver.address, str(port), str(seconds)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True) for h in senders]
        for tx in txs:
            tx.wait(timeout=seconds + 30)
        out, err = rx.communicate(timeout=30)
        nbytes, elapsed = out.split()
        return int(nbytes) / float(elapsed) / 1e6
    finally:
        for p in [rx, *txs]:
            if p.poll() is None:
                _killpg(p)


def cpu_times() -> list[int]:
    """This machine's CPU time so far, in ticks: user, nice, system, idle, iowait, irq,
    softirq (the first line of /proc/stat; network namespaces share the kernel)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:8]]


def cpu_shares(before: list[int], after: list[int]) -> dict[str, float]:
    """How the machine's CPU time between two `cpu_times` went (fractions of all cores)."""
    d = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(d) or 1
    return {"busy": 1 - (d[3] + d[4]) / total, "user": (d[0] + d[1]) / total,
            "system": d[2] / total, "softirq": (d[5] + d[6]) / total}


def _killpg(p: subprocess.Popen[Any]) -> None:
    import signal
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class BedJob(bd.Job):
    """bench_dist's Job with every process on its own host of the bed."""

    def __init__(self, bed: testbed.HostBed, places: dict[str, testbed.BedHost],
                 *args: Any) -> None:
        super().__init__(*args)
        self.bed, self.places = bed, places

    def _start(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        host = self.places[label]
        env = dict(env)
        env["DMLC_PS_ROOT_URI"] = self.places["scheduler"].address
        env["DMLC_NODE_HOST"] = host.address
        if self.lib == "mxnet":
            env["DMLC_INTERFACE"] = "eth0"
        super()._start(label, self.bed.exec_argv(host, argv), env)


def workloads(quick: bool) -> dict[str, Any]:
    """bench_dist's small, 4 KB, 4 MB and 64 MB workloads, fewer iterations (slow links)."""
    if quick:
        return {"small": {"shape": [2, 3], "warmup": 10, "reps": 2, "iters": 50},
                "dense": {"1048576": {"warmup": 1, "reps": 2, "iters": 2},
                          "16777216": {"warmup": 1, "reps": 1, "iters": 1}}}
    return {"small": {"shape": [2, 3], "warmup": 50, "reps": 3, "iters": 200},
            "dense": {"1024": {"warmup": 20, "reps": 3, "iters": 100},
                      "1048576": {"warmup": 2, "reps": 3, "iters": 6},
                      "16777216": {"warmup": 1, "reps": 3, "iters": 1}}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def rate_report(rate: str, figs: dict[str, Any], ref: dict[str, float]) -> dict[str, Any]:
    """Figures, ratios, line-rate fractions and targets for one rate."""
    ps, mx = figs.get("pskv") or {}, figs.get("mxnet") or {}
    rows, fractions = [], {}
    r2 = ref["two_into_one_mb_s"]
    for name in ("small", "dense_1024", "dense_1048576", "dense_16777216"):
        p = (ps.get(name) or {}).get("value")
        m = (mx.get(name) or {}).get("value")
        frac = {}
        for lib, val in (("pskv", p), ("mxnet", m)):
            if name in ("dense_1048576", "dense_16777216") and val:
                # val = N / t / 1e6 per worker; the server link needs 4N / R seconds
                frac[lib] = 4 * val / r2
        fractions[name] = frac
        rows.append({"figure": name, "pskv": p, "mxnet": m, "ratio": _ratio(p, m), **{
            f"line_{k}": v for k, v in frac.items()}})
    targets = []
    if rate.startswith("1gbit"):
        for name in ("dense_1048576", "dense_16777216"):
            f = fractions[name].get("pskv")
            targets.append({"target": f"{name}: >= 90% of the line rate", "value": f,
                            "verdict": "n/a" if f is None else "PASS" if f >= 0.9 else "MISS"})
    if rate.startswith("10gbit"):
        for name in ("dense_1048576", "dense_16777216"):
            r = next(x["ratio"] for x in rows if x["figure"] == name)
            targets.append({"target": f"{name}: >= 2 x ps-lite's MB/s", "value": r,
                            "verdict": "n/a" if r is None else "PASS" if r >= 2 else "MISS"})
    r = next(x["ratio"] for x in rows if x["figure"] == "small")
    targets.append({"target": "small key: <= 0.5 x ps-lite's time", "value": r,
                    "verdict": "n/a" if r is None else "PASS" if r <= 0.5 else "MISS"})
    return {"rows": rows, "targets": targets}


LABELS = {"small": "small key (2,3): us per push+pull", "dense_1024": "4 KB key: MB/s per worker",
          "dense_1048576": "4 MB key: MB/s per worker",
          "dense_16777216": "64 MB key: MB/s per worker"}


def _f(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def markdown(data: dict[str, Any]) -> str:
    m, c = data["machine"], data["commit"]
    out = ["# bench_multihost: pskv and MXNet 1.9.1 (ps-lite) across hosts of the bed", "",
           f"- command: `{data['command']}`",
           f"- commit: {c['commit']}{' (dirty)' if c.get('dirty') else ''}; run at "
           f"{data['timestamp']}",
           f"- machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['mem_total_gib']} GiB, "
           f"{m['platform']}; load average {m['loadavg_at_start']} at start, "
           f"{m.get('loadavg_at_end')} at end",
           f"- bed: one network namespace per process (scheduler, {data['servers']} server, "
           f"{NUM_WORKERS} workers) on one bridge, `tc tbf` on both ends of every veth; pskv "
           "over its TCP path (`PSKV_TRANSPORT=tcp`), ps-lite over ZeroMQ/TCP on eth0; "
           f"{data['rounds']} rounds, libraries alternating; figures are worker 0's medians",
           "- line-rate fraction: (4 x MB/s per worker) / (two streams into one host, MB/s): 1.0 "
           "when the server's link carries the pushes in, then the pulls out, at line rate; "
           "up to 2.0 where one worker's pull overlaps the other's push (the link is full "
           "duplex)", ""]
    for rate, rep in data["rates"].items():
        ref = rep["reference"]
        out += [f"## {rate}", "",
                f"Plain TCP on these links: one stream {ref['one_stream_mb_s']:,.0f} MB/s, two "
                f"streams into one host {ref['two_into_one_mb_s']:,.0f} MB/s in all.", "",
                "| figure | pskv | MXNet | pskv/MXNet | pskv line-rate fraction | "
                "MXNet line-rate fraction |", "|---|---|---|---|---|---|"]
        for r in rep["rows"]:
            digits = 0 if r["figure"] == "small" else 1
            out.append(f"| {LABELS[r['figure']]} | {_f(r['pskv'], digits)} | "
                       f"{_f(r['mxnet'], digits)} | {_f(r['ratio'], 2)} | "
                       f"{_f(r.get('line_pskv'), 2)} | {_f(r.get('line_mxnet'), 2)} |")
        for lib, sh in sorted(rep.get("cpu", {}).items()):
            out.append("")
            out.append(f"CPU during the {lib} jobs (both cores, every workload): "
                       f"{sh['busy']:.0%} busy ({sh['user']:.0%} user, {sh['system']:.0%} "
                       f"system, {sh['softirq']:.0%} interrupts)")
        out += ["", "| target | value | verdict |", "|---|---|---|"]
        out += [f"| {t['target']} | {_f(t['value'], 2)} | {t['verdict']} |"
                for t in rep["targets"]]
        out.append("")
    if data.get("errors"):
        out += ["## Errors", ""] + [f"- {k}: {v[:300]}" for k, v in data["errors"].items()]
    if data.get("notes"):
        out += ["## Notes", "", data["notes"]]
    return "\n".join(out) + "\n"


def run_rate(rate: str, args: argparse.Namespace, config: dict[str, Any],
             libs: dict[str, tuple[str, str, str]], tmp: Path,
             data: dict[str, Any]) -> dict[str, Any]:
    """One bed with links of ``rate``: the TCP reference, then every job."""
    nhosts = 1 + args.servers + NUM_WORKERS
    bed = testbed.HostBed(nhosts, rate=None if rate == "none" else rate)
    bed.up()
    try:
        h = bed.hosts
        places = {"scheduler": h[0]}
        places.update({f"server {i}": h[1 + i] for i in range(args.servers)})
        places.update({f"worker {i}": h[1 + args.servers + i] for i in range(NUM_WORKERS)})
        server, workers = h[1], h[1 + args.servers:]
        secs = 1.5 if args.quick else 4.0
        ref = {"one_stream_mb_s": statistics.median(
                   tcp_stream(bed, [workers[0]], server, secs) for _ in range(2)),
               "two_into_one_mb_s": statistics.median(
                   tcp_stream(bed, list(workers), server, secs) for _ in range(2))}
        log.info("%s: TCP %.0f MB/s one stream, %.0f MB/s two into one", rate,
                 ref["one_stream_mb_s"], ref["two_into_one_mb_s"])
        runs: dict[str, list[list[dict[str, Any]]]] = {}
        cpu: dict[str, list[dict[str, float]]] = {}
        order = list(libs)
        for rnd in range(args.rounds):
            for lib in order:
                name, python, transport = libs[lib]
                tag = f"{rate}-{lib}-r{rnd}"
                job = BedJob(bed, places, name, python, args.servers, config, tmp, tag,
                             "normal", transport)
                log.info("job %s ...", tag)
                t0, c0 = time.monotonic(), cpu_times()
                try:
                    runs.setdefault(lib, []).append(job.run(args.timeout))
                    cpu.setdefault(lib, []).append(cpu_shares(c0, cpu_times()))
                except (_common.WorkerError, OSError, ValueError) as err:
                    log.error("job %s failed: %s", tag, err)
                    data["errors"][tag] = str(err)
                    continue
                log.info("job %s done in %.1f s", tag, time.monotonic() - t0)
            order = order[1:] + order[:1]
        figs = {lib: bd.figures(r) for lib, r in runs.items()}
        shares = {lib: {k: statistics.median(c[k] for c in v) for k in v[0]}
                  for lib, v in cpu.items()}
        return {"reference": ref, "figures": figs, "cpu": shares,
                **rate_report(rate, figs, ref)}
    finally:
        left = bed.down()
        if left:
            log.error("could not remove %s", left)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (writes no results)")
    p.add_argument("--rates", default="1gbit,10gbit",
                   help="comma-separated tc rates of the links (none: unshaped)")
    p.add_argument("--servers", type=int, default=1, help="servers (each on its own host)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per library (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--no-mxnet", action="store_true", help=f"ignore {bd.ENV_MXNET_PYTHON}")
    args = p.parse_args(argv)
    why = testbed.missing()
    if why is not None:
        print(f"bench_multihost: cannot make the bed here: {why}", file=sys.stderr)
        return 2
    args.rounds = args.rounds or (1 if args.quick else 2)
    testbed.sweep()
    libs = {"pskv": ("pskv", sys.executable, "tcp")}
    mxpy = os.environ.get(bd.ENV_MXNET_PYTHON)
    if mxpy and not args.no_mxnet:
        libs = {"mxnet": ("mxnet", mxpy, "tcp"), **libs}
    config = {"workloads": workloads(args.quick), "empty": False}
    data: dict[str, Any] = {
        "benchmark": "bench_multihost", "command": _common.command_line(),
        "timestamp": _common.timestamp(), "commit": _common.commit_info(),
        "machine": _common.machine_info(), "servers": args.servers, "rounds": args.rounds,
        "config": config, "errors": {}, "rates": {}}
    with tempfile.TemporaryDirectory(prefix="bench_multihost-") as tmpd:
        for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
            data["rates"][rate] = run_rate(rate, args, config, libs, Path(tmpd), data)
    try:
        data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        data["machine"]["loadavg_at_end"] = None
    text = markdown(data)
    print(text)
    if not args.quick:
        _common.write_results("bench_multihost", data, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
