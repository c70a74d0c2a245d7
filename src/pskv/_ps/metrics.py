"""Prometheus metrics of a node: ``/metrics`` over HTTP when ``PSKV_METRICS_PORT`` is set.

Each node (scheduler, server, worker) that is asked to keeps its own registry (never the
client library's process-wide one: a thread cluster runs many nodes in one process) and
serves it on the first free port from ``PSKV_METRICS_PORT`` upward (at most
:data:`PORT_TRIES` ports), on the address the node's other listeners use. Every series
carries ``job`` (a short digest of the job's id, the same on every node of a job),
``role`` and ``rank``. docs/observability.md lists every metric.

Observability never stops a job: when ``prometheus_client`` is missing or no port is free,
the node logs one ERROR line that says what to do and runs without metrics. A node that
was not asked pays one ``is None`` test per hook. The library is imported only here, and
only when metrics are on (``pip install 'pskv[metrics]'``).
"""
from __future__ import annotations

import bisect
import collections
import errno
import hashlib
import logging
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from .config import (ENV_METRICS_PORT, ENV_METRICS_PUSHGATEWAY, ClusterConfig,
                     advertised_host)
from .message import Command

__all__ = ["NodeMetrics", "PORT_TRIES", "SchedulerMetrics", "ServerMetrics",
           "WorkerMetrics", "job_label", "start"]

log = logging.getLogger(__name__)

#: ports tried from PSKV_METRICS_PORT upward before a node gives up serving metrics
PORT_TRIES = 64
#: seconds: request latency and round wait buckets (1 ms to 5 min, the round timeout)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_LABELS = ("job", "role", "rank")
#: requests timed at most at once by a worker (a lost reply's entry is dropped beyond it)
_MAX_TIMED = 1 << 16


class _Child:
    """One labelled counter or histogram: plain numbers behind a plain lock. The library's
    own children cost microseconds a call in the hot path (issue #18's cost aim is 3 %);
    these are read only when ``/metrics`` is scraped (:class:`_Family`)."""

    __slots__ = ("bounds", "counts", "lock", "sum", "value")

    def __init__(self, bounds: tuple[float, ...] | None) -> None:
        self.lock = threading.Lock()
        self.value = 0.0
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1) if bounds is not None else []
        self.sum = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self.lock:
            self.value += amount

    def observe(self, value: float) -> None:
        assert self.bounds is not None
        i = bisect.bisect_left(self.bounds, value)
        with self.lock:
            self.counts[i] += 1
            self.sum += value


class _Family:
    """A counter or histogram family of :class:`_Child` values, turned into the library's
    metric families at scrape time (``collect``, a custom collector's method)."""

    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float] | None = None) -> None:
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, tuple(labels)
        self.bounds = tuple(buckets or ()) if kind == "Histogram" else None
        if self.bounds is not None and not self.bounds:
            self.bounds = LATENCY_BUCKETS
        self.children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> _Child:
        child = self.children.get(values)
        if child is None:
            with self._lock:
                child = self.children.setdefault(values, _Child(self.bounds))
        return child

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        if self.bounds is None:
            family: Any = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in list(self.children.items()):
                family.add_metric(list(values), child.value)
            return family
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in list(self.children.items()):
            with child.lock:
                counts, total = list(child.counts), child.sum
            cumulative, running = [], 0
            for bound, n in zip((*self.bounds, float("inf")), counts):
                running += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                   running))
            family.add_metric(list(values), cumulative, sum_value=total)
        return family


class _Families:
    """The custom collector of a node's :class:`_Family` series and of the ``collectors``
    that read its state when scraped (each a callable yielding metric families)."""

    def __init__(self) -> None:
        self.families: list[_Family] = []
        self.collectors: list[Callable[[], Any]] = []

    def collect(self) -> Any:
        for family in list(self.families):
            yield family.collect()
        for collector in list(self.collectors):
            try:
                families = list(collector())
            except Exception:  # noqa: BLE001 - a scrape never fails the node, nor the scrape
                log.warning("metrics: a collector failed; its series are left out of this "
                            "scrape", exc_info=True)
                continue
            yield from families


def job_label(job: str) -> str:
    """The ``job`` label: 12 hex digits of SHA-256 of the job's id (the id itself binds
    proofs of admission, so it is not shown).

    Examples
    --------
    >>> len(job_label("abc")), job_label("abc") == job_label("abc")
    (12, True)
    """
    return hashlib.sha256(job.encode()).hexdigest()[:12]


class NodeMetrics:
    """A node's registry and its HTTP endpoint; subclasses declare the series.

    Parameters
    ----------
    role : str
    rank : int
    job : str
        The job's id (shown as :func:`job_label`).
    """

    def __init__(self, role: str, rank: int, job: str) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector
        self.registry = CollectorRegistry(auto_describe=True)
        self._families = _Families()
        self._collectors = self._families.collectors
        self.registry.register(self._families)
        # process_* (CPU, resident memory, open fds): the process this node runs in
        ProcessCollector(registry=self.registry)
        self.name = f"{role} {rank}" if role != "scheduler" else "the scheduler"
        self._values = (job_label(job), role, str(rank))
        self.port: int | None = None
        #: the address it serves on, as other hosts reach it (the listing pskv-top reads)
        self.host = ""
        #: where :meth:`close` pushes the series (PSKV_METRICS_PUSHGATEWAY), if anywhere
        self.gateway: str | None = None
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    # ---- series ----------------------------------------------------------------------
    def _series(self, kind: str, name: str, doc: str, extra: Sequence[str] = (),
                **kw: Any) -> Any:
        if kind in ("Counter", "Histogram"):      # the hot path's: plain numbers
            family = _Family(kind, name, doc, (*_LABELS, *extra), kw.get("buckets", ()))
            self._families.families.append(family)
            return family
        import prometheus_client
        cls = getattr(prometheus_client, kind)
        return cls(name, doc, (*_LABELS, *extra), registry=self.registry, **kw)

    def _bound(self, metric: Any, *extra: str) -> Any:
        return metric.labels(*self._values, *extra)

    # ---- the endpoint ----------------------------------------------------------------
    def serve(self, host: str, first: int) -> int | None:
        """Serve ``/metrics`` on the first free port from ``first``; the port, or None
        (logged) when none of :data:`PORT_TRIES` is free."""
        from prometheus_client import make_wsgi_app
        app = make_wsgi_app(self.registry)
        last = min(first + PORT_TRIES - 1, 65535)
        for port in range(first, last + 1):
            try:
                self._httpd = _http_server(host, port, app)
            except OSError as err:
                if err.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                log.error("%s", ConfigError(
                    f"{self.name}: cannot serve metrics on {host}:{port}: {err}. Set "
                    f"{ENV_METRICS_PORT} to a port this host can bind; the job goes on "
                    "without this node's metrics."))
                return None
            self._thread = threading.Thread(target=self._httpd.serve_forever,
                                            kwargs={"poll_interval": 0.1},
                                            name=f"pskv-metrics {self.name}", daemon=True)
            self._thread.start()
            self.port = port
            self.host = host
            log.info("%s: metrics at http://%s:%d/metrics", self.name, host, port)
            return port
        log.error("%s", ConfigError(
            f"{self.name}: ports {first} to {last} on {host} are all in use, so this node "
            f"serves no metrics. Set {ENV_METRICS_PORT} to a free range; the job goes on "
            "without them."))
        return None

    def push(self, timeout: float = 5.0) -> bool:
        """Push every series to :attr:`gateway` (grouped by job, role and rank); whether it
        went (a gateway that does not answer is logged, never raised)."""
        if self.gateway is None:
            return False
        from prometheus_client import push_to_gateway
        job, role, rank = self._values
        try:
            push_to_gateway(self.gateway, job=job, registry=self.registry,
                            grouping_key={"role": role, "rank": rank}, timeout=timeout)
        except Exception as err:  # noqa: BLE001 - whatever fails, the job goes on
            log.error("%s", ConfigError(
                f"{self.name}: cannot push metrics to the Pushgateway at {self.gateway!r}: "
                f"{type(err).__name__}: {err}. Check {ENV_METRICS_PUSHGATEWAY} (host:port of "
                "a running Pushgateway); the job is not affected."))
            return False
        return True

    def close(self) -> None:
        """Push to the Pushgateway if one is set, then stop serving (idempotent)."""
        if self.gateway is not None:
            self.push()
            self.gateway = None
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _Calls:
    """One wire command's requests, array bytes each way and latency histogram (a worker's
    request to reply; unused on a server), as plain numbers read when ``/metrics`` is
    scraped. The hot path only adds to them (docs/observability.md, "What metrics cost")."""

    __slots__ = ("counts", "received", "requests", "sent", "sum")

    def __init__(self) -> None:
        self.requests = self.sent = self.received = 0
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0


def _label(cmd: Any) -> str:
    """The ``command`` label of a wire command (an enum member) or a name."""
    return str(getattr(cmd, "name", cmd)).lower()


def _histogram(cumulative_of: list[int], bounds: Sequence[float]) -> list[tuple[str, int]]:
    """Per-bucket counts as Prometheus' cumulative ``(le, count)`` pairs."""
    out, running = [], 0
    for bound, n in zip((*bounds, float("inf")), cumulative_of):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


class ServerMetrics(NodeMetrics):
    """A server's series: requests and bytes by command, round waits, keys, tables and
    replication.

    The hooks (:meth:`request`, :meth:`replied`, :meth:`round_closed`) are called by the
    serve loop's thread only, so they add to plain numbers without a lock; what the server
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
        by = [*_LABELS, "command"]
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
                                     "round's first push to its last", labels=_LABELS)
        wait.add_metric(me, _histogram(list(self._wait.counts), LATENCY_BUCKETS),
                        sum_value=self._wait.sum)
        yield wait
        apply = HistogramMetricFamily("pskv_round_apply_seconds", "Seconds a dist_sync "
                                      "round's update took (the sum applied, the optimizer "
                                      "run)", labels=_LABELS)
        apply.add_metric(me, _histogram(list(self._apply.counts), LATENCY_BUCKETS),
                         sum_value=self._apply.sum)
        yield apply
        last = CounterMetricFamily("pskv_round_last_pusher", "Sync rounds closed by this "
                                   "worker's push (it was last)", labels=[*_LABELS, "worker"])
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
        ranked = sorted(per_key.items(), key=lambda kv: -kv[1][0] * kv[1][1])
        chosen = dict(ranked[:self._top])
        chosen.update((k, v) for k, v in per_key.items() if k in self._named)
        by_key = [*_LABELS, "key"]
        pushes = CounterMetricFamily("pskv_key_pushes", "Pushes of this key applied here "
                                     "(its top keys and PSKV_METRICS_KEYS)", labels=by_key)
        pushed = CounterMetricFamily("pskv_key_pushed_bytes", "Bytes of this key's pushes "
                                     "applied here (pushes x its size here)", labels=by_key)
        for key, (n, size) in sorted(chosen.items()):
            pushes.add_metric([*me, key], n)
            pushed.add_metric([*me, key], n * size)
        yield from (pushes, pushed)
        by_table = [*_LABELS, "key"]
        rows = GaugeMetricFamily("pskv_table_rows", "Rows a table key holds here",
                                 labels=by_table)
        counters = {c: CounterMetricFamily(f"pskv_table_{c}", doc, labels=by_table)
                    for c, doc in _TABLE_COUNTERS.items()}
        for key, stats in sorted(state["tables"].items()):
            rows.add_metric([*me, key], stats.get("rows", 0))
            for c, family in counters.items():
                family.add_metric([*me, key], stats.get(c, 0))
        yield rows
        yield from counters.values()
        by_shard = [*_LABELS, "shard", "backup"]
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
    "evictions": "Rows evicted (TTL and capacity)",
}


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily
    family = GaugeMetricFamily(name, doc, labels=_LABELS)
    family.add_metric(labels, value)
    return family


class WorkerMetrics(NodeMetrics):
    """A worker's series: requests, bytes, and request latency by command; re-sends.

    :meth:`sent` and :meth:`received` run on whichever threads send and read, so they add
    to plain numbers under one lock (one acquisition per call).
    """

    def __init__(self, rank: int, job: str,
                 resent: Callable[[], tuple[int, int]] | None = None) -> None:
        super().__init__("worker", rank, job)
        # one record per wire command made now, so that the hooks only read the dict (a
        # command of another kind is made on first use, under the lock)
        self._calls: collections.defaultdict[Any, _Calls] = collections.defaultdict(
            _Calls, {cmd: _Calls() for cmd in Command})
        self._started: dict[int, tuple[_Calls, float]] = {}
        self._lock = threading.Lock()
        self._resent = resent
        self._collectors.append(self._collect)

    def sent(self, ts: int, cmd: Any, arrays: Sequence[Any]) -> None:
        """Request ``ts`` of wire command ``cmd`` left with ``arrays`` (a push's negative ts
        is answered only when it fails: it is not timed)."""
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        started = self._started
        now = time.monotonic() if ts > 0 else 0.0
        with self._lock:
            calls = self._calls[cmd]
            calls.requests += 1
            calls.sent += nbytes
            if ts > 0:
                if len(started) >= _MAX_TIMED:     # replies that never came (a lost server)
                    started.clear()
                started[ts] = (calls, now)

    def received(self, ts: int, arrays: Sequence[Any]) -> None:
        """The reply to ``ts`` came with ``arrays``."""
        now = time.monotonic()
        nbytes = 0
        for a in arrays:
            nbytes += a.nbytes
        with self._lock:
            started = self._started.pop(ts, None)
            if started is None:
                return
            calls, t0 = started
            calls.counts[bisect.bisect_left(LATENCY_BUCKETS, now - t0)] += 1
            calls.sum += now - t0
            calls.received += nbytes

    def _collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        me, by = list(self._values), [*_LABELS, "command"]
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
                                     "shard", labels=[*_LABELS, "what"])
        resent.add_metric([*me, "push"], pushes)
        resent.add_metric([*me, "request"], requests_again)
        yield resent


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
        self._nodes = nodes
        self._collectors.append(self._collect)

    def _collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily
        family = GaugeMetricFamily(
            "pskv_scheduler_node_info", "1 for each node the scheduler admitted: its state "
            "and where it serves /metrics (metrics_port 0: nowhere)",
            labels=[*_LABELS, "node_role", "node_rank", "state", "host", "metrics_port"])
        for role, rank, state, host, port in (self._nodes() if self._nodes else []):
            family.add_metric([*self._values, role, str(rank), state, host, str(port)], 1)
        yield family


def _http_server(host: str, port: int, app: Any) -> Any:
    """A bound, listening WSGI server for ``app`` (not yet serving).

    Without SO_REUSEADDR: with it, Linux lets two sockets bind one port as long as neither
    listens yet, and two nodes starting at once took the same port.
    """
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        allow_reuse_address = False
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            """Scrapes are not logged."""

    return make_server(host, port, app, Server, handler_class=Quiet)


def start(cfg: ClusterConfig, make: Callable[[], NodeMetrics], po: Any = None) -> Any:
    """The node's metrics when ``cfg.metrics_port`` or ``cfg.metrics_pushgateway`` asks for
    them (serving on the port, pushed at close); else None. ``po``: the node's Postoffice,
    whose heartbeats then tell the scheduler where (``metrics_port``, ``metrics_host``).

    A missing ``prometheus_client`` or no free port is logged (one ERROR line) and the
    node goes on without metrics.
    """
    if not cfg.metrics_port and not cfg.metrics_pushgateway:
        return None
    try:
        metrics = make()
    except ImportError:
        asked = (f"{ENV_METRICS_PORT}={cfg.metrics_port}" if cfg.metrics_port else
                 f"{ENV_METRICS_PUSHGATEWAY}={cfg.metrics_pushgateway}")
        log.error("%s", ConfigError(
            f"{asked} is set but prometheus_client is not installed, so this node serves "
            "no metrics. pip install 'pskv[metrics]'; the job goes on without them."))
        return None
    metrics.gateway = cfg.metrics_pushgateway
    if cfg.metrics_port:
        host = "127.0.0.1" if cfg.transport == "inproc" else cfg.node_host
        if metrics.serve(host, cfg.metrics_port) is None and metrics.gateway is None:
            return None
        if host == "0.0.0.0":
            metrics.host = advertised_host(host, cfg.root_uri)
        if po is not None and metrics.port is not None:
            po.metrics_host, po.metrics_port = metrics.host, metrics.port
    return metrics
