"""The metrics of a node (``_ps/observe/metrics.py``) without HTTP: each node's series, its labels,
the setting, and what happens without prometheus_client."""
from __future__ import annotations

import logging
import sys
import threading

import numpy as np
import pytest

from pskv._ps.config import (ENV_METRICS_PORT, ENV_METRICS_PUSHGATEWAY, KNOWN_ENV,
                             ClusterConfig, Role)
from pskv._ps.message import Command
from pskv._ps.observe.metrics import job_label, start
from pskv.errors import ConfigError

ENV = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "1",
       "DMLC_NUM_WORKER": "1"}


def test_the_port_setting() -> None:
    assert ENV_METRICS_PORT in KNOWN_ENV
    assert ClusterConfig.from_env(ENV, Role.SERVER).metrics_port == 0
    assert ClusterConfig.from_env({**ENV, ENV_METRICS_PORT: "9400"}, Role.SERVER).metrics_port \
        == 9400
    assert ENV_METRICS_PUSHGATEWAY in KNOWN_ENV
    assert ClusterConfig.from_env({**ENV, ENV_METRICS_PUSHGATEWAY: "gw:9091"},
                                  Role.WORKER).metrics_pushgateway == "gw:9091"
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ConfigError, match="PSKV_METRICS_PORT"):
            ClusterConfig.from_env({**ENV, ENV_METRICS_PORT: bad}, Role.SERVER)


def test_off_unless_asked() -> None:
    def never() -> None:
        raise AssertionError("metrics built while off")
    assert start(ClusterConfig(Role.SERVER), never) is None  # type: ignore[arg-type]


def test_without_prometheus_client_the_node_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # import fails
    from pskv._ps.observe.series import WorkerMetrics
    caplog.set_level(logging.ERROR, logger="pskv._ps.observe.metrics")
    assert start(ClusterConfig(Role.WORKER, metrics_port=9400),
                 lambda: WorkerMetrics(0, "job")) is None
    [rec] = caplog.records
    assert "prometheus_client is not installed" in rec.getMessage()
    assert "pip install 'pskv[metrics]'" in rec.getMessage()


def test_job_label_hides_the_job_id() -> None:
    assert job_label("secret-job-id") != "secret-job-id" and len(job_label("x")) == 12


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client import generate_latest
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _nbytes(n: int) -> np.ndarray:
    return np.zeros(n, np.uint8)


def _state(keys: int = 0, per_key: dict[str, tuple[int, int]] | None = None,
           tables: dict[str, dict[str, int]] | None = None,
           backups: list[tuple[int, int, bool, int]] | None = None) -> dict[str, object]:
    return {"keys": keys, "per_key": per_key or {}, "tables": tables or {},
            "backups": backups or []}


def test_server_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import ServerMetrics
    m = ServerMetrics(1, "job", lambda: {**_state(keys=7), "waiting": 2})
    m.request(Command.PUSH, [_nbytes(400)])
    m.request(Command.PUSH, [_nbytes(100), _nbytes(300)])
    m.request(Command.PULL, [])
    m.replied(Command.PULL, [_nbytes(800)])
    m.round_closed(1, 0.2)
    m.applied_in(0.003)
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "1"), ("role", "server"))
    assert got[("pskv_server_requests_total", tuple(sorted(base + (("command", "push"),))))] \
        == 2
    assert got[("pskv_server_received_bytes_total",
                tuple(sorted(base + (("command", "push"),))))] == 800
    assert got[("pskv_server_sent_bytes_total",
                tuple(sorted(base + (("command", "pull"),))))] == 800
    assert got[("pskv_round_wait_seconds_count", base)] == 1
    assert got[("pskv_round_apply_seconds_count", base)] == 1
    assert got[("pskv_round_apply_seconds_sum", base)] == 0.003
    assert got[("pskv_server_waiting_requests", base)] == 2
    assert got[("pskv_round_last_pusher_total", tuple(sorted(base + (("worker", "1"),))))] == 1
    assert got[("pskv_server_keys", base)] == 7


def test_worker_times_answered_requests_only() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import WorkerMetrics
    m = WorkerMetrics(0, "job")
    m.sent(-1, Command.PUSH, [_nbytes(100)])     # a push: counted, not timed
    m.sent(2, Command.PULL, [])
    m.received(2, [_nbytes(400)])
    m.received(99, [_nbytes(4)])                 # not a request it timed: ignored
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "0"), ("role", "worker"))
    key = lambda name, cmd: (name, tuple(sorted(base + (("command", cmd),))))  # noqa: E731
    assert got[key("pskv_worker_requests_total", "push")] == 1
    assert got[key("pskv_worker_sent_bytes_total", "push")] == 100
    assert got[key("pskv_worker_request_seconds_count", "pull")] == 1
    assert got[key("pskv_worker_received_bytes_total", "pull")] == 400
    assert key("pskv_worker_request_seconds_count", "push") not in got


def test_worker_records_from_many_threads_add_up_exactly() -> None:
    """Requests and replies recorded by several threads at once, across automatic folds
    and scrapes in between: no count is lost, every reply finds its request, and what is
    kept between folds stays bounded."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe import series
    m = series.WorkerMetrics(0, "job")
    per, threads = 3 * series._FOLD, 4
    start = threading.Barrier(threads + 1)

    def run(first: int) -> None:
        start.wait()
        for i in range(per):
            ts = first + i
            m.sent(ts, Command.PULL, [_nbytes(8)])
            m.received(ts, [_nbytes(16)])

    pool = [threading.Thread(target=run, args=(1 + t * per,)) for t in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    scrapes = 0
    while any(t.is_alive() for t in pool):       # scrapes in between fold too
        _samples(m.registry)
        scrapes += 1
    for t in pool:
        t.join()
    assert len(m._requests) < series._FOLD
    got = _samples(m.registry)
    key = (("command", "pull"),) + (("job", job_label("job")), ("rank", "0"),
                                    ("role", "worker"))
    key = tuple(sorted(key))
    n = per * threads
    assert got[("pskv_worker_requests_total", key)] == n
    assert got[("pskv_worker_sent_bytes_total", key)] == 8 * n
    assert got[("pskv_worker_received_bytes_total", key)] == 16 * n
    assert got[("pskv_worker_request_seconds_count", key)] == n
    assert not m._started and not m._replies, scrapes


def test_scheduler_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import SchedulerMetrics
    m = SchedulerMetrics("job", lambda role: 2 if role == "worker" else 1)
    m.missed.inc()
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "0"), ("role", "scheduler"))
    assert got[("pskv_scheduler_nodes_alive",
                tuple(sorted(base + (("node_role", "worker"),))))] == 2
    assert got[("pskv_scheduler_missed_heartbeats_total", base)] == 1


def _base(role: str, rank: int) -> tuple[tuple[str, str], ...]:
    return (("job", job_label("job")), ("rank", str(rank)), ("role", role))


def _with(base: tuple[tuple[str, str], ...], **labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(base + tuple(labels.items())))


def test_per_key_series_are_bounded_to_the_top_keys_and_those_named() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import ServerMetrics
    # 50 keys; key i was pushed i times, 4 bytes each: the busiest are k49, k48, k47
    per_key = {f"k{i}": (i, 4) for i in range(50)}
    m = ServerMetrics(0, "job", lambda: _state(per_key=per_key), top_keys=3, keys=["k1"])
    got = _samples(m.registry)
    keys = {dict(labels)["key"] for name, labels in got if name == "pskv_key_pushes_total"}
    assert keys == {"k49", "k48", "k47", "k1"}
    base = _base("server", 0)
    assert got[("pskv_key_pushes_total", _with(base, key="k48"))] == 48
    assert got[("pskv_key_pushed_bytes_total", _with(base, key="k48"))] == 48 * 4
    none = ServerMetrics(0, "job", lambda: _state(per_key=per_key), top_keys=0)
    assert not [k for k in _samples(none.registry) if k[0] == "pskv_key_pushes_total"]


def test_the_per_key_settings() -> None:
    from pskv._ps.config import ENV_METRICS_KEYS, ENV_METRICS_TOP_KEYS
    cfg = ClusterConfig.from_env(ENV, Role.SERVER)
    assert (cfg.metrics_top_keys, cfg.metrics_keys) == (10, ())
    cfg = ClusterConfig.from_env({**ENV, ENV_METRICS_TOP_KEYS: "0",
                                  ENV_METRICS_KEYS: "w1, emb ,3"}, Role.SERVER)
    assert (cfg.metrics_top_keys, cfg.metrics_keys) == (0, ("w1", "emb", "3"))
    for bad in ("x", "-1", "1001"):
        with pytest.raises(ConfigError, match=ENV_METRICS_TOP_KEYS):
            ClusterConfig.from_env({**ENV, ENV_METRICS_TOP_KEYS: bad}, Role.SERVER)
    with pytest.raises(ConfigError, match=ENV_METRICS_KEYS):
        ClusterConfig.from_env({**ENV, ENV_METRICS_KEYS: ",".join(map(str, range(101)))},
                               Role.SERVER)


def test_table_and_replication_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import ServerMetrics
    stats = {"rows": 5, "lookups": 9, "misses": 6, "inserts": 5, "refusals": 1,
             "evictions": 2, "evicted_ttl": 1, "evicted_capacity": 1, "bytes": 1234}
    m = ServerMetrics(0, "job", lambda: _state(tables={"emb": stats},
                                               backups=[(0, 1, True, 3)]))
    got = _samples(m.registry)
    base = _base("server", 0)
    assert got[("pskv_table_rows", _with(base, key="emb"))] == 5
    assert got[("pskv_table_bytes", _with(base, key="emb"))] == 1234
    for reason in ("ttl", "capacity"):
        assert got[("pskv_table_evicted_total", _with(base, key="emb", reason=reason))] == 1
    for counter in ("lookups", "misses", "inserts", "refusals", "evictions"):
        assert got[(f"pskv_table_{counter}_total", _with(base, key="emb"))] == stats[counter]
    assert got[("pskv_replication_backup_up", _with(base, shard="0", backup="1"))] == 1
    assert got[("pskv_replication_pending_changes", _with(base, shard="0", backup="1"))] == 3


def test_worker_resent_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import WorkerMetrics
    got = _samples(WorkerMetrics(2, "job", lambda: (4, 1)).registry)
    base = _base("worker", 2)
    assert got[("pskv_worker_resent_total", _with(base, what="push"))] == 4
    assert got[("pskv_worker_resent_total", _with(base, what="request"))] == 1


def test_scheduler_lists_every_node_and_counts_restarts() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.observe.series import SchedulerMetrics
    nodes = [("server", 0, "alive", "127.0.0.1", 9401), ("worker", 0, "dead", "", 0)]
    m = SchedulerMetrics("job", lambda role: 1, lambda: nodes)
    m.restarts.inc()
    got = _samples(m.registry)
    base = _base("scheduler", 0)
    assert got[("pskv_scheduler_restarts_total", base)] == 1
    assert got[("pskv_scheduler_node_info", _with(
        base, node_role="server", node_rank="0", state="alive", host="127.0.0.1",
        metrics_port="9401"))] == 1
    assert got[("pskv_scheduler_node_info", _with(
        base, node_role="worker", node_rank="0", state="dead", host="",
        metrics_port="0"))] == 1


def test_the_hooks_take_few_calls() -> None:
    """The hot path's cost (issue 18's aim: 3 %) is in the number of calls its hooks make:
    a push+pull of a small key runs ~400 Python-level calls, and the hooks of an earlier
    version added ~70 (16 %); these make 15 (6 of them Python functions). Counted with a
    profiler, not timed."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    import cProfile
    import pstats
    from pskv._ps.observe.series import ServerMetrics, WorkerMetrics
    server = ServerMetrics(0, "job", _state)
    worker = WorkerMetrics(0, "job")
    value = [_nbytes(64)]
    for ts in (1, 2):     # the first call of a command makes its record
        worker.sent(ts, Command.PUSHPULL, value)
        server.request(Command.PUSHPULL, value)
        server.round_closed(0, 0.001)
        server.applied_in(0.0001)
        server.replied(Command.PUSHPULL, value)
        worker.received(ts, value)
    prof = cProfile.Profile()
    prof.enable()
    for ts in range(3, 103):
        worker.sent(ts, Command.PUSHPULL, value)
        server.request(Command.PUSHPULL, value)
        server.round_closed(0, 0.001)
        server.applied_in(0.0001)
        server.replied(Command.PUSHPULL, value)
        worker.received(ts, value)
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values()) / 100   # type: ignore
    assert calls <= 16, f"{calls:.0f} calls per push+pull"
