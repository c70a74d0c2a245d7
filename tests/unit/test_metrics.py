"""The metrics of a node (``_ps/metrics.py``) without HTTP: each node's series, its labels,
the setting, and what happens without prometheus_client."""
from __future__ import annotations

import logging
import sys

import pytest

from pskv._ps.config import (ENV_METRICS_PORT, ENV_METRICS_PUSHGATEWAY, KNOWN_ENV,
                             ClusterConfig, Role)
from pskv._ps.metrics import job_label, start
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
    from pskv._ps.metrics import WorkerMetrics
    caplog.set_level(logging.ERROR, logger="pskv._ps.metrics")
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


def test_server_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.metrics import ServerMetrics
    m = ServerMetrics(1, "job", lambda: 7)
    m.request("push", 400)
    m.request("push", 400)
    m.request("pull", 0)
    m.replied("pull", 800)
    m.round_closed(1, 0.2)
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "1"), ("role", "server"))
    assert got[("pskv_server_requests_total", tuple(sorted(base + (("command", "push"),))))] \
        == 2
    assert got[("pskv_server_received_bytes_total",
                tuple(sorted(base + (("command", "push"),))))] == 800
    assert got[("pskv_server_sent_bytes_total",
                tuple(sorted(base + (("command", "pull"),))))] == 800
    assert got[("pskv_round_wait_seconds_count", base)] == 1
    assert got[("pskv_round_last_pusher_total", tuple(sorted(base + (("worker", "1"),))))] == 1
    assert got[("pskv_server_keys", base)] == 7


def test_worker_times_answered_requests_only() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.metrics import WorkerMetrics
    m = WorkerMetrics(0, "job")
    m.sent(-1, "push", 100)           # a push: counted, not timed
    m.sent(2, "pull", 0)
    m.received(2, 400)
    m.received(99, 4)                  # not a request it timed: ignored
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "0"), ("role", "worker"))
    key = lambda name, cmd: (name, tuple(sorted(base + (("command", cmd),))))  # noqa: E731
    assert got[key("pskv_worker_requests_total", "push")] == 1
    assert got[key("pskv_worker_sent_bytes_total", "push")] == 100
    assert got[key("pskv_worker_request_seconds_count", "pull")] == 1
    assert got[key("pskv_worker_received_bytes_total", "pull")] == 400
    assert key("pskv_worker_request_seconds_count", "push") not in got


def test_scheduler_series() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    from pskv._ps.metrics import SchedulerMetrics
    m = SchedulerMetrics("job", lambda role: 2 if role == "worker" else 1)
    m.missed.inc()
    got = _samples(m.registry)
    base = (("job", job_label("job")), ("rank", "0"), ("role", "scheduler"))
    assert got[("pskv_scheduler_nodes_alive",
                tuple(sorted(base + (("node_role", "worker"),))))] == 2
    assert got[("pskv_scheduler_missed_heartbeats_total", base)] == 1
