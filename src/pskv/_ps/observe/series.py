"""The series of each kind of node: a server's, a worker's and the scheduler's.

Each is a :class:`.metrics.NodeMetrics` (its registry and endpoint). The hooks that the hot
path calls add to plain numbers (one record per wire command, made in advance or on first
use, found by subscript: docs/observability.md, "What metrics cost"); everything else is
read from the node when ``/metrics`` is scraped. docs/observability.md lists every metric.
"""
from __future__ import annotations

import bisect
import collections
import heapq
import threading
import time
from typing import Any, Callable, Sequence

from .metrics import LABELS, LATENCY_BUCKETS, NodeMetrics

__all__ = ["SchedulerMetrics", "ServerMetrics", "WorkerMetrics"]

#: requests timed at most at once by a worker (a lost reply's entry is dropped beyond it)
_MAX_TIMED = 1 << 16
#: a worker's records added up every this many requests (and at each scrape)
_FOLD = 4096


class _Calls:
    """One wire command's requests, array bytes each way and latency histogram (a worker's
    request to reply; a server's round waits and apply times use one each), as plain
    numbers read when ``/metrics`` is scraped. The hot path only adds to them
    (docs/observability.md, "What metrics cost")."""

    __slots__ = ("counts", "received", "requests", "sent", "sum")

    def __init__(self) -> None:
        self.requests = self.sent = self.received = 0
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0


def _label(cmd: Any) -> str:
    """The ``command`` label of a wire command (an enum member) or a name."""
    return str(getattr(cmd, "name", cmd)).lower()


def _histogram(counts: list[int], bounds: Sequence[float]) -> list[tuple[str, int]]:
    """Per-bucket counts as Prometheus' cumulative ``(le, count)`` pairs."""
    out, running = [], 0
    for bound, n in zip((*bounds, float("inf")), counts):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


class ServerMetrics(NodeMetrics):
    """A server's series: requests and bytes by command, round waits, keys, tables and
    replication.

    The hooks (:meth:`request`, :meth:`replied`, :meth:`round_closed`, :meth:`applied_in`)
    are called by the serve loop's thread only, so they add to plain numbers without a lock; what the server
    holds (keys, per-key pushes, tables, backups) is read from ``state()`` when scraped.
    """

    def __init__(self, rank: int, job: str, state: Callable[[], dict[str, Any]],
                 top_keys: int = 10, keys: Sequence[str] = ()) -> None:
        super().__init__("server", rank, job)
        self._state, self._top, self._named = state, top_keys, frozenset(keys)
        # subscripts, not method calls, in the hooks: a missing command or worker is made
        # on first use (by the one thread that writes)
        self._calls: collections.defaultdict[Any, _Calls] = collections.defaultdict(_Calls)
        self._wait, self._apply = _Calls(), _Calls()
        self._last: collections.defaultdict[int, int] = collections.defaultdict(int)
        self.stragglers = self._bound(self._series(
            "Counter", "pskv_straggler_warnings_total",
            "Straggler lines logged (rounds that waited, workers often last)"))
        self.checkpoint = self._bound(self._series(
            "Histogram", "pskv_checkpoint_write_seconds",
            "Seconds to write this server's shard of a checkpoint (on a writer thread)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)))
        self._collectors.append(self._collect)

    def request(self, cmd: Any, arrays: Sequence[Any]) -> None:
        """One request of wire command ``cmd`` carrying ``arrays``."""
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        calls = self._calls[cmd]
        calls.requests += 1
        calls.received += nbytes

    def replied(self, cmd: Any, arrays: Sequence[Any]) -> None:
        """A reply to ``cmd`` carrying ``arrays``."""
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        self._calls[cmd].sent += nbytes

    def round_closed(self, worker: int, waited: float) -> None:
        """``worker``'s push closed a sync round that waited ``waited`` seconds."""
        wait = self._wait
        wait.counts[bisect.bisect_left(LATENCY_BUCKETS, waited)] += 1
        wait.sum += waited
        self._last[worker] += 1

    def applied_in(self, seconds: float) -> None:
        """A sync round's update (the sum applied, the optimizer run) took ``seconds``."""
        apply = self._apply
        apply.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        apply.sum += seconds

    def _collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        me = list(self._values)
        by = [*LABELS, "command"]
        requests = CounterMetricFamily("pskv_server_requests", "Requests received, by "
                                       "command", labels=by)
        received = CounterMetricFamily("pskv_server_received_bytes", "Array bytes received "
                                       "in requests, by command", labels=by)
        sent = CounterMetricFamily("pskv_server_sent_bytes", "Array bytes sent in replies, "
                                   "by command", labels=by)
        for cmd, calls in list(self._calls.items()):
            if not (calls.requests or calls.sent):
                continue
            requests.add_metric([*me, _label(cmd)], calls.requests)
            received.add_metric([*me, _label(cmd)], calls.received)
            sent.add_metric([*me, _label(cmd)], calls.sent)
        yield from (requests, received, sent)
        wait = HistogramMetricFamily("pskv_round_wait_seconds", "Seconds from a dist_sync "
                                     "round's first push to its last", labels=LABELS)
        wait.add_metric(me, _histogram(list(self._wait.counts), LATENCY_BUCKETS),
                        sum_value=self._wait.sum)
        yield wait
        apply = HistogramMetricFamily("pskv_round_apply_seconds", "Seconds a dist_sync "
                                      "round's update took (the sum applied, the optimizer "
                                      "run)", labels=LABELS)
        apply.add_metric(me, _histogram(list(self._apply.counts), LATENCY_BUCKETS),
                         sum_value=self._apply.sum)
        yield apply
        last = CounterMetricFamily("pskv_round_last_pusher", "Sync rounds closed by this "
                                   "worker's push (it was last)", labels=[*LABELS, "worker"])
        for worker, n in sorted(list(self._last.items())):
            last.add_metric([*me, str(worker)], n)
        yield last
        yield from self._collect_state(me)

    def _collect_state(self, me: list[str]) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        state = self._state()
        yield _gauge("pskv_server_keys", "Keys (key parts) held, every shard served", me,
                     state["keys"])
        yield _gauge("pskv_server_waiting_requests", "Requests held for rounds to close "
                     "(pushes and pulls of open rounds, deferred pushes)", me,
                     state.get("waiting", 0))
        # per key: a bounded set (the top ones by bytes pushed, and those named)
        per_key: dict[str, tuple[int, int]] = state["per_key"]
        # O(keys) per scrape, on the metrics thread; never on the hot path
        chosen = dict(heapq.nlargest(self._top, per_key.items(),
                                     key=lambda kv: kv[1][0] * kv[1][1]))
        chosen.update((k, per_key[k]) for k in self._named if k in per_key)
        by_key = [*LABELS, "key"]
        pushes = CounterMetricFamily("pskv_key_pushes", "Pushes of this key applied here "
                                     "(its top keys and PSKV_METRICS_KEYS)", labels=by_key)
        pushed = CounterMetricFamily("pskv_key_pushed_bytes", "Bytes of this key's pushes "
                                     "applied here (pushes x its size here)", labels=by_key)
        for key, (n, size) in sorted(chosen.items()):
            pushes.add_metric([*me, key], n)
            pushed.add_metric([*me, key], n * size)
        yield from (pushes, pushed)
        by_table = [*LABELS, "key"]
        rows = GaugeMetricFamily("pskv_table_rows", "Rows a table key holds here",
                                 labels=by_table)
        nbytes = GaugeMetricFamily("pskv_table_bytes", "Bytes of the arrays a table key "
                                   "uses here: rows, optimizer states, IDs, metadata, its "
                                   "ID index", labels=by_table)
        counters = {c: CounterMetricFamily(f"pskv_table_{c}", doc, labels=by_table)
                    for c, doc in _TABLE_COUNTERS.items()}
        by_reason = CounterMetricFamily("pskv_table_evicted", "Rows evicted, by reason: "
                                        "ttl (unused longer than TTL allows), capacity "
                                        "(lowest LRU or LFU rank past Capacity.max_rows), "
                                        "score (lowest custom score past it)",
                                        labels=[*by_table, "reason"])
        for key, stats in sorted(state["tables"].items()):
            rows.add_metric([*me, key], stats.get("rows", 0))
            nbytes.add_metric([*me, key], stats.get("bytes", 0))
            score = stats.get("evicted_score", 0)
            by_reason.add_metric([*me, key, "ttl"], stats.get("evicted_ttl", 0))
            by_reason.add_metric([*me, key, "capacity"],
                                 stats.get("evicted_capacity", 0) - score)
            by_reason.add_metric([*me, key, "score"], score)
            for c, family in counters.items():
                family.add_metric([*me, key], stats.get(c, 0))
        yield from (rows, nbytes)
        yield from counters.values()
        yield by_reason
        by_shard_t = [*LABELS, "key", "shard"]
        version = GaugeMetricFamily("pskv_table_stream_version", "The version of a table "
                                    "shard served here (its change stream, E1)",
                                    labels=by_shard_t)
        readers = GaugeMetricFamily("pskv_table_stream_readers", "Readers of a table "
                                    "shard's change stream in the last minute",
                                    labels=by_shard_t)
        behind = GaugeMetricFamily("pskv_table_stream_lag_versions", "Versions the slowest "
                                   "reader of the last minute is behind a table shard",
                                   labels=by_shard_t)
        for key, shard, v, n, lag_v in state.get("streams", []):
            version.add_metric([*me, key, str(shard)], v)
            readers.add_metric([*me, key, str(shard)], n)
            behind.add_metric([*me, key, str(shard)], lag_v)
        yield from (version, readers, behind)
        by_shard = [*LABELS, "shard", "backup"]
        up = GaugeMetricFamily("pskv_replication_backup_up", "1 while the backup of a shard "
                               "served here is connected, else 0", labels=by_shard)
        lag = GaugeMetricFamily("pskv_replication_pending_changes", "Changes of a shard sent "
                                "to its backup and not acknowledged yet", labels=by_shard)
        for shard, backup, is_up, pending in state["backups"]:
            up.add_metric([*me, str(shard), str(backup)], 1 if is_up else 0)
            lag.add_metric([*me, str(shard), str(backup)], pending)
        yield from (up, lag)


#: a table's counters (DynamicTable.stats), exported as pskv_table_<name>_total
_TABLE_COUNTERS = {
    "lookups": "IDs looked up in a table key (training and eval lookups)",
    "misses": "IDs looked up that the table did not hold",
    "inserts": "Rows inserted (admitted IDs)",
    "refusals": "Unknown IDs the admission policy refused",
    "unknown_reads": "IDs a lookup answered with the unknown value (no row, R4)",
    "evictions": "Rows evicted (TTL and capacity)",
    "budget_refusals": "Lookups and pushes refused: their new rows would grow the table "
                       "past PSKV_MAX_KEY_BYTES",
}


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily
    family = GaugeMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, value)
    return family


class WorkerMetrics(NodeMetrics):
    """A worker's series: requests, bytes, and request latency by command; re-sends.

    :meth:`sent` and :meth:`received` run on whichever threads send and read: each appends
    one record to a deque (an atomic append, no lock), and the records are added up under
    a lock, in order, when ``/metrics`` is scraped or every :data:`_FOLD` requests.
    """

    def __init__(self, rank: int, job: str,
                 resent: Callable[[], tuple[int, int]] | None = None) -> None:
        super().__init__("worker", rank, job)
        self._calls: collections.defaultdict[Any, _Calls] = collections.defaultdict(_Calls)
        self._started: dict[int, tuple[_Calls, float]] = {}
        # (cmd, bytes, ts, time) of each request; (ts, bytes, time) of each reply
        self._requests: collections.deque[tuple[Any, int, int, float]] = collections.deque()
        self._replies: collections.deque[tuple[int, int, float]] = collections.deque()
        self._lock = threading.Lock()
        self._resent = resent
        #: set by a dist store: ``{key: RowCache.stats()}`` of its hot-row caches
        self.table_caches: Callable[[], dict[Any, dict[str, int]]] | None = None
        self._collectors.append(self._collect)

    def sent(self, ts: int, cmd: Any, arrays: Sequence[Any]) -> None:
        """Request ``ts`` of wire command ``cmd`` left with ``arrays`` (a push's negative ts
        is answered only when it fails: it is not timed)."""
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        requests = self._requests
        requests.append((cmd, nbytes, ts, time.monotonic() if ts > 0 else 0.0))
        if len(requests) >= _FOLD:
            self._fold()

    def received(self, ts: int, arrays: Sequence[Any]) -> None:
        """The reply to ``ts`` came with ``arrays``."""
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        self._replies.append((ts, nbytes, time.monotonic()))

    def _fold(self) -> None:
        """Add the records up. A reply is recorded after its request: the replies counted
        before the requests are drained all find theirs (later ones wait for the next
        fold)."""
        with self._lock:
            requests, replies, started = self._requests, self._replies, self._started
            calls_of = self._calls
            waiting = len(replies)
            while requests:
                cmd, nbytes, ts, t0 = requests.popleft()
                calls = calls_of[cmd]
                calls.requests += 1
                calls.sent += nbytes
                if ts > 0:
                    if len(started) >= _MAX_TIMED:     # replies that never came
                        started.clear()
                    started[ts] = (calls, t0)
            for _ in range(waiting):
                ts, nbytes, now = replies.popleft()
                got = started.pop(ts, None)
                if got is None:
                    continue
                calls, t0 = got
                calls.counts[bisect.bisect_left(LATENCY_BUCKETS, now - t0)] += 1
                calls.sum += now - t0
                calls.received += nbytes

    def _collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        me, by = list(self._values), [*LABELS, "command"]
        requests = CounterMetricFamily("pskv_worker_requests", "Requests sent to servers, "
                                       "by command", labels=by)
        sent = CounterMetricFamily("pskv_worker_sent_bytes", "Array bytes sent to servers, "
                                   "by command", labels=by)
        received = CounterMetricFamily("pskv_worker_received_bytes", "Array bytes received "
                                       "from servers, by command", labels=by)
        latency = HistogramMetricFamily(
            "pskv_worker_request_seconds", "Seconds from a request to its server's reply, "
            "by command (a pull waits for its round; a flush for every push before it to "
            "be applied)", labels=by)
        self._fold()
        with self._lock:
            rows = [(_label(cmd), c.requests, c.sent, c.received, list(c.counts), c.sum)
                    for cmd, c in self._calls.items() if c.requests]
        for label, n, out, into, counts, total in rows:
            requests.add_metric([*me, label], n)
            sent.add_metric([*me, label], out)
            received.add_metric([*me, label], into)
            if n and any(counts):
                latency.add_metric([*me, label], _histogram(counts, LATENCY_BUCKETS),
                                   sum_value=total)
        yield from (requests, sent, received, latency)
        pushes, requests_again = self._resent() if self._resent is not None else (0, 0)
        resent = CounterMetricFamily("pskv_worker_resent", "Pushes and requests sent again "
                                     "to a server that was restarted or took a dead one's "
                                     "shard", labels=[*LABELS, "what"])
        resent.add_metric([*me, "push"], pushes)
        resent.add_metric([*me, "request"], requests_again)
        yield resent
        if self.table_caches is not None:
            yield from _cache_series(me, self.table_caches())


def _cache_series(me: list[str], caches: dict[Any, dict[str, int]]) -> Any:
    """A worker's hot-row caches (docs/embeddings.md C1-C7), by table key."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    by = [*LABELS, "key"]
    hits = CounterMetricFamily("pskv_worker_table_cache_hits", "IDs a lookup took from "
                               "this worker's hot-row cache of a table key", labels=by)
    misses = CounterMetricFamily("pskv_worker_table_cache_misses", "IDs a lookup through "
                                 "the hot-row cache asked of the servers", labels=by)
    rows = GaugeMetricFamily("pskv_worker_table_cache_rows", "Rows this worker's hot-row "
                             "cache of a table key holds", labels=by)
    for key, stats in sorted(caches.items(), key=lambda ks: str(ks[0])):
        hits.add_metric([*me, str(key)], stats.get("hits", 0))
        misses.add_metric([*me, str(key)], stats.get("misses", 0))
        rows.add_metric([*me, str(key)], stats.get("rows", 0))
    yield from (hits, misses, rows)


class SchedulerMetrics(NodeMetrics):
    """The scheduler's series: nodes alive, missed heartbeats, barriers, restarts, and
    every node's state and metrics port (``nodes()``: ``(role, rank, state, host, port)``
    of each node; port 0: it serves no metrics), which ``pskv-top`` reads."""

    def __init__(self, job: str, alive: Callable[[str], float],
                 nodes: Callable[[], list[tuple[str, int, str, str, int]]] | None = None
                 ) -> None:
        super().__init__("scheduler", 0, job)
        gauge = self._series("Gauge", "pskv_scheduler_nodes_alive",
                             "Nodes admitted and alive, by the node's role", ("node_role",))
        for role in ("server", "worker"):
            self._bound(gauge, role).set_function(lambda role=role: alive(role))
        self.missed = self._bound(self._series(
            "Counter", "pskv_scheduler_missed_heartbeats_total",
            "Nodes found dead because their heartbeats stopped"))
        self.failed = self._bound(self._series(
            "Counter", "pskv_scheduler_node_failures_total",
            "Nodes found dead (heartbeats stopped, connection lost, not restarted)"))
        self.barriers = self._bound(self._series(
            "Counter", "pskv_scheduler_barriers_total", "Barriers completed"))
        self.restarts = self._bound(self._series(
            "Counter", "pskv_scheduler_restarts_total",
            "Nodes that rejoined under their rank after a restart"))
        self.stragglers = self._bound(self._series(
            "Counter", "pskv_scheduler_straggler_warnings_total",
            "Workers flagged as often last across every server's sync rounds"))
        self._nodes = nodes
        self._collectors.append(self._collect)

    def _collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily
        family = GaugeMetricFamily(
            "pskv_scheduler_node_info", "1 for each node the scheduler admitted: its state "
            "and where it serves /metrics (metrics_port 0: nowhere)",
            labels=[*LABELS, "node_role", "node_rank", "state", "host", "metrics_port"])
        for role, rank, state, host, port in (self._nodes() if self._nodes else []):
            family.add_metric([*self._values, role, str(rank), state, host, str(port)], 1)
        yield family
