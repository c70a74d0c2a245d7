"""``pskv-top``: a live view of a running job, read from its nodes' Prometheus endpoints.

Pointed at the first metrics port of a job (``PSKV_METRICS_PORT``: the scheduler's, which
lists where every node serves its ``/metrics``; pointed at another node's port, it scans
the ports from there upward), it reads every node's ``/metrics`` each interval and shows,
in the terminal (``curses``), each node and its state, request and byte rates, memory, the
rounds' waits, the workers that were last in the rounds of the interval and the slowest,
the hottest keys, and how unevenly the servers are loaded. ``--once`` prints one view
(two reads, one interval apart) and exits.

``--scheduler HOST:PORT`` (the job's ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``) instead asks
the scheduler itself where the nodes serve (``_ps/observe/observer.py``: one HELLO as an observer,
which proves ``PSKV_SECRET`` like any node's and joins nothing), so the metrics ports need
not be known. Everything else reads HTTP only: the view needs no secret and cannot disturb
the job; what it shows is what Prometheus would see.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Sequence

from ._ps.config import ENV_METRICS_TOKEN
from .errors import ConfigError

__all__ = ["Snapshot", "from_scheduler", "listing", "main", "parse", "read_job", "view"]

#: ports read from the first one upward (as many as a node tries: ``_ps.observe.metrics``)
PORTS = 64


@dataclass
class Snapshot:
    """What every node of one job exported at one time.

    ``nodes`` maps ``(role, rank)`` to that node's samples: ``name{labels}`` -> value,
    summed over the labels not kept (``command``, ``worker`` and ``node_role`` are kept).
    """

    at: float
    job: str
    nodes: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    #: each node's state as the scheduler lists it (alive, closed, dead), when it does
    states: dict[tuple[str, int], str] = field(default_factory=dict)

    def total(self, role: str, name: str) -> float:
        """``name`` summed over every node of ``role``."""
        return sum(v.get(name, 0.0) for (r, _), v in self.nodes.items() if r == role)


_KEPT = ("command", "worker", "node_role", "key", "what")
#: the scheduler's listing of every node (``pskv_scheduler_node_info``): labels kept
_LISTING = ("node_role", "node_rank", "state", "host", "metrics_port")
#: the one series without the ``pskv_`` prefix the view reads (the client library's)
_RSS = "process_resident_memory_bytes"


def parse(text: str) -> tuple[str, str, int, dict[str, float]]:
    """One node's ``/metrics`` text: its job, role, rank and samples (ConfigError when it
    is not a pskv node's)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as err:
        raise ConfigError("pskv-top reads Prometheus' text format with prometheus_client: "
                          "pip install 'pskv[metrics]'.") from err
    samples: dict[str, float] = {}
    who: tuple[str, str, int] | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == _RSS:
                    samples[_RSS] = float(s.value)
                if not s.name.startswith("pskv_") or s.name.endswith("_created"):
                    continue
                labels = s.labels
                if s.name == "pskv_scheduler_node_info":
                    listed = ",".join(f"{k}={labels.get(k, '')}" for k in _LISTING)
                    samples[f"{s.name}{{{listed}}}"] = float(s.value)
                    continue
                who = who or (labels.get("job", ""), labels.get("role", ""),
                              int(labels.get("rank", "0")))
                kept = ",".join(f"{k}={labels[k]}" for k in _KEPT if k in labels)
                if "le" in labels:
                    continue                  # buckets: the sum and count suffice here
                name = f"{s.name}{{{kept}}}" if kept else s.name
                samples[name] = samples.get(name, 0.0) + float(s.value)
    except ValueError as err:
        raise ConfigError(f"not Prometheus' text format: {err}") from None
    if who is None:
        raise ConfigError("it serves no pskv_ series")
    return who[0], who[1], who[2], samples


def _fetch(url: str, timeout: float) -> str | None:
    # the nodes' endpoints may need a bearer token (PSKV_METRICS_TOKEN, docs/security.md)
    token = os.environ.get(ENV_METRICS_TOKEN)
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return str(r.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def listing(samples: dict[str, float]) -> list[tuple[str, int, str, str, int]]:
    """The nodes a scheduler's samples list: ``(role, rank, state, host, port)`` each
    (port 0: that node serves no metrics); empty for any other node."""
    out = []
    for name in samples:
        if name.startswith("pskv_scheduler_node_info{"):
            labels = dict(kv.split("=", 1) for kv in name[len("pskv_scheduler_node_info{"):-1]
                          .split(",") if "=" in kv)
            try:
                out.append((labels["node_role"], int(labels["node_rank"]), labels["state"],
                            labels["host"], int(labels["metrics_port"])))
            except (KeyError, ValueError):
                continue
    return sorted(out)


def read_job(host: str, first: int, count: int = PORTS, timeout: float = 1.0) -> Snapshot:
    """Read the node at ``first`` and the others of its job: those the scheduler lists
    when ``first`` is the scheduler's port, else every port from ``first`` (``count``).

    Raises ConfigError when ``first`` does not answer as a pskv node's ``/metrics``.
    """
    where = f"http://{_bracket(host)}:{first}/metrics"
    text = _fetch(where, timeout)
    if text is None:
        raise ConfigError(f"nothing answers at {where}. Point pskv-top at the first port of "
                          "a running job's PSKV_METRICS_PORT (pskv-top HOST:PORT).")
    try:
        job, role, rank, samples = parse(text)
    except ConfigError as err:
        raise ConfigError(f"{where} is not a pskv node's metrics endpoint: {err}. Point "
                          "pskv-top at a job's PSKV_METRICS_PORT.") from None
    snap = Snapshot(time.monotonic(), job)
    snap.nodes[(role, rank)], snap.ports[(role, rank)] = samples, first
    listed = listing(samples)
    if listed:
        snap.states = {(r, k): state for r, k, state, _h, _p in listed}
        targets = [(h if h not in ("", "0.0.0.0") else host, p) for *_n, h, p in listed if p]
    else:
        targets = [(host, p) for p in range(first + 1, min(first + count, 65536))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda t: _fetch(f"http://{_bracket(t[0])}:{t[1]}/metrics",
                                               timeout), targets))
    for (_h, port), text in zip(targets, texts):
        if text is None:
            continue
        try:
            their_job, role, rank, samples = parse(text)
        except ConfigError:
            continue                  # another program on a port of the range
        if their_job == job:
            snap.nodes[(role, rank)] = samples
            snap.ports[(role, rank)] = port
    return snap


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---- the view (plain lines: curses draws them, --once prints them) -------------------------
def _rate(prev: Snapshot | None, cur: Snapshot, node: tuple[str, int], name: str) -> float:
    if prev is None or node not in prev.nodes:
        return 0.0
    dt = cur.at - prev.at
    return max(cur.nodes[node].get(name, 0.0) - prev.nodes[node].get(name, 0.0), 0.0) / dt \
        if dt > 0 else 0.0


def _by_label(samples: dict[str, float], metric: str) -> dict[str, float]:
    """``{label value: value}`` of ``metric{label=...}`` samples."""
    out = {}
    for name, value in samples.items():
        if name.startswith(metric + "{"):
            out[name[len(metric) + 1:-1].split("=", 1)[1]] = value
    return out


def _delta_by(prev: Snapshot | None, cur: Snapshot, metric: str) -> dict[str, float]:
    """Per label value: how much ``metric`` grew over every node since ``prev``."""
    out: dict[str, float] = {}
    for node, samples in cur.nodes.items():
        before = _by_label(prev.nodes.get(node, {}), metric) if prev is not None else {}
        for label, value in _by_label(samples, metric).items():
            out[label] = out.get(label, 0.0) + value - before.get(label, 0.0)
    return out


def _sum_by(samples: dict[str, float], metric: str) -> float:
    return sum(_by_label(samples, metric).values()) + samples.get(metric, 0.0)


def _mb(x: float) -> str:
    return f"{x / 1e6:8.2f}"


def view(prev: Snapshot | None, cur: Snapshot, width: int = 100) -> list[str]:
    """The lines of one view of ``cur`` (rates since ``prev``)."""
    lines = [f"pskv-top  job {cur.job}  {len(cur.nodes)} nodes  "
             f"(q quits; rates over the last interval)"]
    sched = cur.nodes.get(("scheduler", 0))
    if sched is not None:
        alive = _by_label(sched, "pskv_scheduler_nodes_alive")
        lines.append(f"scheduler: {int(alive.get('server', 0))} servers and "
                     f"{int(alive.get('worker', 0))} workers alive; "
                     f"{int(sched.get('pskv_scheduler_node_failures_total', 0))} failed, "
                     f"{int(sched.get('pskv_scheduler_missed_heartbeats_total', 0))} missed "
                     "heartbeats")
    lines.append("")
    # wait: a server's mean round wait, a worker's mean request latency
    lines.append(f"{'node':<12}{'state':<8}{'port':>7}{'req/s':>10}{'MB/s in':>10}"
                 f"{'MB/s out':>10}{'keys':>8}{'wait ms':>10}{'RSS MB':>9}")
    loads, slow = [], []
    shown = set(cur.nodes) | {n for n in cur.states if n[0] != "scheduler"}
    for node in sorted(shown, key=lambda n: (n[0] != "scheduler", n[0], n[1])):
        role, rank = node
        state = cur.states.get(node, "alive")
        s = cur.nodes.get(node)
        if role == "scheduler":
            continue
        if s is None:                 # listed by the scheduler, but its /metrics is silent
            lines.append(f"{role + ' ' + str(rank):<12}{state:<8}{'-':>7}"
                         "   (no metrics read)")
            continue
        pre = "pskv_server" if role == "server" else "pskv_worker"
        inb, outb = f"{pre}_received_bytes_total", f"{pre}_sent_bytes_total"
        req = sum(_rate(prev, cur, node, n) for n in s if n.startswith(f"{pre}_requests_total"))
        rin = sum(_rate(prev, cur, node, n) for n in s if n.startswith(inb))
        rout = sum(_rate(prev, cur, node, n) for n in s if n.startswith(outb))
        hist = "pskv_round_wait_seconds" if role == "server" else "pskv_worker_request_seconds"
        count = sum(_rate(prev, cur, node, n) for n in s if n.startswith(hist + "_count"))
        total = sum(_rate(prev, cur, node, n) for n in s if n.startswith(hist + "_sum"))
        wait = f"{1000 * total / count:10.2f}" if count else f"{'-':>10}"
        keys = f"{int(s.get('pskv_server_keys', 0)):8d}" if role == "server" else f"{'':>8}"
        rss = f"{s[_RSS] / 2**20:9.0f}" if _RSS in s else f"{'-':>9}"
        if role == "server":
            loads.append(rin + rout)
        elif count:
            slow.append((total / count, rank))
        lines.append(f"{role + ' ' + str(rank):<12}{state:<8}{cur.ports.get(node, 0):>7}"
                     f"{req:10.1f}{_mb(rin):>10}{_mb(rout):>10}{keys}{wait}{rss}")
    if len(loads) > 1 and max(loads) > 0:
        lines.append("")
        lines.append(f"server imbalance: the busiest moves {max(loads) / max(min(loads), 1e-9):.2f}"
                     " x the bytes of the least busy" if min(loads) > 0 else
                     "server imbalance: some servers moved no bytes this interval")
    last = _delta_by(prev, cur, "pskv_round_last_pusher_total")
    closed = sum(last.values())
    lines.append("")
    if closed > 0:
        ranked = sorted(last.items(), key=lambda kv: (-kv[1], int(kv[0])))
        who = ", ".join(f"worker {w} {100 * n / closed:.0f}%" for w, n in ranked[:5] if n)
        lines.append(f"last to push ({int(closed)} rounds): {who}")
    else:
        lines.append("last to push: no sync round closed this interval")
    if len(slow) > 1:
        who = ", ".join(f"worker {r} {1000 * t:.2f} ms" for t, r in sorted(slow)[::-1][:5])
        lines.append(f"mean request wait: {who} (the last to push waits least)")
    dt = cur.at - prev.at if prev is not None else 0.0
    hot = _delta_by(prev, cur, "pskv_key_pushed_bytes_total") if dt > 0 else {}
    hot = {k: v for k, v in hot.items() if v > 0}
    if hot:
        ranked_keys = sorted(hot.items(), key=lambda kv: -kv[1])[:5]
        lines.append("hottest keys (MB/s pushed): " + ", ".join(
            f"{k} {v / dt / 1e6:.2f}" for k, v in ranked_keys))
    rows = _delta_by(None, cur, "pskv_table_rows")
    if rows:
        mib = _delta_by(None, cur, "pskv_table_bytes")
        per_s = {c: _delta_by(prev, cur, f"pskv_table_{c}_total") if dt > 0 else {}
                 for c in ("inserts", "evictions", "refusals")}

        def rates(k: str) -> str:
            return " ".join(f"{per_s[c].get(k, 0.0) / dt if dt > 0 else 0.0:.1f}"
                            for c in ("inserts", "evictions", "refusals"))
        lines.append("tables (rows, MiB, inserts/s, evictions/s, refusals/s): " + ", ".join(
            f"{k} {int(n)} {mib.get(k, 0.0) / 2**20:.1f} {rates(k)}"
            for k, n in sorted(rows.items())[:5]))
    hits = _delta_by(prev, cur, "pskv_worker_table_cache_hits_total")
    misses = _delta_by(prev, cur, "pskv_worker_table_cache_misses_total")
    asked = {k: hits.get(k, 0.0) + misses.get(k, 0.0) for k in set(hits) | set(misses)}
    if any(asked.values()):
        lines.append("row caches (looked-up rows served on the workers): " + ", ".join(
            f"{k} {100 * hits.get(k, 0.0) / n:.0f}%" for k, n in sorted(asked.items())[:5]
            if n > 0))
    return [line[:width] for line in lines]


# ---- the command -------------------------------------------------------------------------
def _target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{text!r} is not HOST:PORT. Give the first metrics port of the "
                          "job, e.g. pskv-top 127.0.0.1:9400 (its PSKV_METRICS_PORT).")
    return host.strip("[]"), int(port)


def from_scheduler(host: str, port: int, environ: Any = None,
                   timeout: float = 5.0) -> tuple[str, int]:
    """Where the scheduler at ``host:port`` (its own port, ``DMLC_PS_ROOT_PORT``) serves
    ``/metrics``, which lists every node: asked over pskv's protocol with ``environ``'s
    ``PSKV_SECRET`` (and ``PSKV_ENCRYPT``). ConfigError when it cannot be asked or
    serves no metrics."""
    from ._ps.config import ENV_ENCRYPT, ENV_SECRET
    from ._ps.observe.observer import ask_scheduler
    env = os.environ if environ is None else environ
    secret = env.get(ENV_SECRET) or None
    address = f"tcp://{_bracket(host)}:{port}"
    got = ask_scheduler(address, secret.encode() if secret else None,
                        env.get(ENV_ENCRYPT, "").strip() == "1", timeout)
    if got.metrics is None:
        raise ConfigError(f"the scheduler at {address} serves no metrics (job {got.job}, "
                          f"{len(got.nodes)} nodes). Start the job with PSKV_METRICS_PORT "
                          "set (e.g. PSKV_METRICS_PORT=9400 pskv-launch ...).")
    there, metrics_port = got.metrics
    return (host if there in ("", "0.0.0.0") else there), metrics_port


def _curses(host: str, port: int, count: int, interval: float) -> None:
    import curses

    def loop(screen: Any) -> None:
        curses.curs_set(0)
        screen.timeout(int(interval * 1000))
        prev: Snapshot | None = None
        while True:
            try:
                cur = read_job(host, port, count)
                lines = view(prev, cur, screen.getmaxyx()[1] - 1)
                prev = cur
            except ConfigError as err:
                lines = [f"pskv-top: {err}", "(retrying; q quits)"]
            screen.erase()
            for y, line in enumerate(lines[:screen.getmaxyx()[0] - 1]):
                screen.addnstr(y, 0, line, screen.getmaxyx()[1] - 1)
            screen.refresh()
            if screen.getch() in (ord("q"), ord("Q"), 27):
                return

    curses.wrapper(loop)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``pskv-top`` command; returns the exit status (2: bad input or no job there)."""
    p = argparse.ArgumentParser(prog="pskv-top", description="A live view of a running pskv "
                                "job, read from its nodes' Prometheus metrics "
                                "(PSKV_METRICS_PORT).")
    p.add_argument("target", metavar="HOST:PORT", nargs="?",
                   help="the first metrics port of the job (its PSKV_METRICS_PORT)")
    p.add_argument("--scheduler", metavar="HOST:PORT",
                   help="ask the job's scheduler (DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT) where "
                        "its nodes serve metrics, instead of giving a metrics port; with "
                        "the job's PSKV_SECRET in the environment")
    p.add_argument("--ports", type=int, default=PORTS, metavar="N",
                   help=f"ports read from PORT upward (default {PORTS})")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between two reads (default 2)")
    p.add_argument("--once", action="store_true",
                   help="print one view (two reads, one interval apart) and exit")
    args = p.parse_args(argv)
    try:
        if (args.target is None) == (args.scheduler is None):
            raise ConfigError("give either HOST:PORT (the job's first metrics port) or "
                              "--scheduler HOST:PORT (its scheduler), e.g. pskv-top "
                              "127.0.0.1:9400 or pskv-top --scheduler 127.0.0.1:9091.")
        if args.scheduler is not None:
            host, port = from_scheduler(*_target(args.scheduler))
        else:
            host, port = _target(args.target)
        if args.ports < 1 or not args.interval > 0:
            raise ConfigError("--ports must be at least 1 and --interval positive.")
        if args.once:
            first = read_job(host, port, args.ports)
            time.sleep(args.interval)
            print("\n".join(view(first, read_job(host, port, args.ports))))
        else:
            _curses(host, port, args.ports, args.interval)
    except ConfigError as err:
        print(f"pskv-top: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
