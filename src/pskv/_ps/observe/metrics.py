"""Prometheus metrics of a node: ``/metrics`` over HTTP when ``PSKV_METRICS_PORT`` is set.

Each node (scheduler, server, worker) that is asked to keeps its own registry (never the
client library's process-wide one: a thread cluster runs many nodes in one process) and
serves it on the first free port from ``PSKV_METRICS_PORT`` upward (at most
:data:`PORT_TRIES` ports), on the address the node's other listeners use. Every series
carries ``job`` (a short digest of the job's id, the same on every node of a job),
``role`` and ``rank``; each role's series are in :mod:`.series`. docs/observability.md lists
every metric.

Observability never stops a job: when ``prometheus_client`` is missing or no port is free,
the node logs one ERROR line that says what to do and runs without metrics. A node that
was not asked pays one ``is None`` test per hook. The library is imported only here and in
:mod:`.series`, and only when metrics are on (``pip install 'pskv[metrics]'``).
"""
from __future__ import annotations

import bisect
import errno
import hashlib
import logging
import threading
from typing import Any, Callable, Sequence

from ...errors import ConfigError
from ..config import (ENV_METRICS_PORT, ENV_METRICS_PUSHGATEWAY, ENV_METRICS_TOKEN,
                     ClusterConfig, advertised_host)
from .httpd import BoundedHTTPServer

__all__ = ["CLIENT_TIMEOUT_S", "LABELS", "LATENCY_BUCKETS", "NodeMetrics", "PORT_TRIES",
           "job_label", "start"]

log = logging.getLogger(__name__)

#: ports tried from PSKV_METRICS_PORT upward before a node gives up serving metrics
PORT_TRIES = 64
#: seconds a client of the endpoint has to send its request and read the reply
CLIENT_TIMEOUT_S = 5.0
#: seconds: request latency and round wait buckets (1 ms to 5 min, the round timeout)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: the labels of every series of a node
LABELS = ("job", "role", "rank")


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
            family = _Family(kind, name, doc, (*LABELS, *extra), kw.get("buckets", ()))
            self._families.families.append(family)
            return family
        import prometheus_client
        cls = getattr(prometheus_client, kind)
        return cls(name, doc, (*LABELS, *extra), registry=self.registry, **kw)

    def _bound(self, metric: Any, *extra: str) -> Any:
        return metric.labels(*self._values, *extra)

    # ---- the endpoint ----------------------------------------------------------------
    def serve(self, host: str, first: int, max_connections: int = 16,
              token: str | None = None) -> int | None:
        """Serve ``/metrics`` on the first free port from ``first`` (one thread, at most
        ``max_connections`` clients: :class:`.httpd.BoundedHTTPServer`; with ``token``,
        only to requests that carry it as ``Authorization: Bearer <token>``); the port, or
        None (logged) when none of :data:`PORT_TRIES` is free."""
        app = _scrape_app(self.registry, token)
        last = min(first + PORT_TRIES - 1, 65535)
        for port in range(first, last + 1):
            try:
                self._httpd = _http_server(host, port, app, max_connections)
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
        """Push every series to :attr:`gateway` (grouped by job, role and rank) within
        ``timeout`` seconds in all (:func:`.httpd.deadline_handler`: a gateway that
        answers a byte at a time is cut off too); whether it went (a gateway that does not
        answer in time is logged, never raised)."""
        if self.gateway is None:
            return False
        from prometheus_client import push_to_gateway

        from .httpd import deadline_handler
        job, role, rank = self._values
        try:
            push_to_gateway(self.gateway, job=job, registry=self.registry,
                            grouping_key={"role": role, "rank": rank}, timeout=timeout,
                            handler=deadline_handler(timeout))
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


def _http_server(host: str, port: int, app: Any, max_connections: int = 16) -> Any:
    """A bound, listening server for ``app`` (not yet serving): one thread, at most
    ``max_connections`` clients, each dropped after :data:`CLIENT_TIMEOUT_S` (issue #34).

    With SO_REUSEADDR, so a port whose last scrapes are still in TIME_WAIT (a job that
    ended a minute ago) is taken again at once: without it the next job's nodes moved up
    to the next free ports and static Prometheus targets and ``pskv-top HOST:9400``
    missed them. Linux then lets two sockets *bind* one port while neither listens, but
    the second ``listen()`` fails with EADDRINUSE (the server is closed and the caller
    tries the next port), so two nodes starting at once still never share a port.
    """
    return BoundedHTTPServer(host, port, app, max_connections=max_connections,
                             timeout=CLIENT_TIMEOUT_S, reuse_address=True)


def _scrape_app(registry: Any, token: str | None = None) -> Any:
    """The endpoint's requests: ``GET /metrics`` (or ``/``) in the format the client
    accepts (Prometheus text, or OpenMetrics when asked); with ``token``, only for a
    request whose ``Authorization`` is ``Bearer <token>`` (401 otherwise)."""
    import hmac

    from prometheus_client.exposition import choose_encoder
    want = f"Bearer {token}".encode() if token else None

    def app(method: str, target: str, headers: dict[str, str]) \
            -> tuple[int, list[tuple[str, str]], bytes]:
        if method != "GET":
            return 405, [("Allow", "GET")], b"only GET\n"
        if want is not None and not hmac.compare_digest(
                headers.get("authorization", "").encode("latin-1"), want):
            return 401, [("WWW-Authenticate", 'Bearer realm="pskv"')], \
                f"this endpoint needs Authorization: Bearer <{ENV_METRICS_TOKEN}>\n".encode()
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return 404, [], b"not found: try /metrics\n"
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        return 200, [("Content-Type", content_type)], encoder(registry)
    return app


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
        host = "127.0.0.1" if cfg.transport == "inproc" else \
            cfg.metrics_host or cfg.node_host
        if metrics.serve(host, cfg.metrics_port, cfg.metrics_connections,
                         cfg.metrics_token) is None and metrics.gateway is None:
            return None
        if host == "0.0.0.0":
            metrics.host = advertised_host(host, cfg.root_uri)
        if po is not None and metrics.port is not None:
            po.metrics_host, po.metrics_port = metrics.host, metrics.port
    return metrics
