"""``pskv-top``'s reading and view (``pskv/top.py``) without sockets: a node's text parsed,
rates between two reads, bad targets."""
from __future__ import annotations

import numpy as np
import pytest

from pskv._ps.message import Command
from pskv.errors import ConfigError
from pskv.top import Snapshot, _target, listing, main, parse, view


def _text(metrics: object) -> str:
    from prometheus_client import generate_latest
    return generate_latest(metrics.registry).decode()  # type: ignore[attr-defined]


def test_parse_a_server_and_refuse_what_is_not_pskv() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to read metrics")
    from pskv._ps.observe.metrics import job_label
    from pskv._ps.observe.series import ServerMetrics
    m = ServerMetrics(1, "job", lambda: {"keys": 3, "per_key": {"w": (2, 40)}, "tables": {},
                                         "backups": []})
    m.request(Command.PUSH, [np.zeros(40, np.uint8)])
    m.round_closed(0, 0.5)
    job, role, rank, samples = parse(_text(m))
    assert (job, role, rank) == (job_label("job"), "server", 1)
    assert samples["pskv_server_requests_total{command=push}"] == 1
    assert samples["pskv_round_last_pusher_total{worker=0}"] == 1
    assert samples["pskv_round_wait_seconds_sum"] == 0.5 and samples["pskv_server_keys"] == 3
    assert samples["pskv_key_pushed_bytes_total{key=w}"] == 80
    with pytest.raises(ConfigError, match="no pskv_ series"):
        parse("# HELP x y\n# TYPE x counter\nx_total 1\n")
    with pytest.raises(ConfigError, match="not Prometheus' text format"):
        parse("<html>hello</html>\n")


def _snap(at: float, last: dict[str, float], pushes: float, waited: float) -> Snapshot:
    server = {"pskv_server_requests_total{command=pushpull}": pushes,
              "pskv_server_received_bytes_total{command=pushpull}": pushes * 1e6,
              "pskv_server_sent_bytes_total{command=pushpull}": pushes * 1e6,
              "pskv_round_wait_seconds_count": sum(last.values()),
              "pskv_round_wait_seconds_sum": waited, "pskv_server_keys": 4}
    server.update({f"pskv_round_last_pusher_total{{worker={w}}}": n for w, n in last.items()})
    snap = Snapshot(at, "abc", {("scheduler", 0): {
        "pskv_scheduler_nodes_alive{node_role=server}": 1,
        "pskv_scheduler_nodes_alive{node_role=worker}": 2}, ("server", 0): server,
        ("worker", 1): {"pskv_worker_requests_total{command=pushpull}": pushes / 2}})
    snap.ports = {("scheduler", 0): 9400, ("server", 0): 9401, ("worker", 1): 9402}
    return snap


def test_view_shows_rates_waits_and_who_was_last() -> None:
    before = _snap(10.0, {"0": 5, "1": 5}, 100, 1.0)
    after = _snap(12.0, {"0": 6, "1": 9}, 120, 1.5)
    lines = view(before, after)
    text = "\n".join(lines)
    assert lines[0].startswith("pskv-top  job abc  3 nodes")
    assert "scheduler: 1 servers and 2 workers alive" in text
    server = next(line for line in lines if line.startswith("server 0"))
    assert server.split() == ["server", "0", "alive", "9401", "10.0", "10.00", "10.00", "4",
                              "100.00", "-"]
    worker = next(line for line in lines if line.startswith("worker 1"))
    assert worker.split()[4] == "5.0"
    assert "last to push (5 rounds): worker 1 80%, worker 0 20%" in text
    assert "no sync round closed" in "\n".join(view(after, after))


def test_bad_targets() -> None:
    for bad in ("9400", "host:port", "host:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            _target(bad)
    assert _target("[::1]:9400") == ("::1", 9400)
    assert main(["nowhere", "--once"]) == 2
    assert main(["--once"]) == 2                                   # neither target
    assert main(["127.0.0.1:9400", "--scheduler", "127.0.0.1:9091"]) == 2   # both


def test_the_scheduler_listing_is_parsed() -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to read metrics")
    from pskv._ps.observe.series import SchedulerMetrics
    m = SchedulerMetrics("job", lambda role: 1, lambda: [
        ("server", 0, "alive", "127.0.0.1", 9401), ("worker", 1, "dead", "", 0)])
    _job, role, _rank, samples = parse(_text(m))
    assert role == "scheduler"
    assert listing(samples) == [("server", 0, "alive", "127.0.0.1", 9401),
                                ("worker", 1, "dead", "", 0)]
    assert listing({"pskv_server_keys": 1.0}) == []


def test_view_shows_hot_keys_slow_workers_and_silent_nodes() -> None:
    def snap(at: float, k: float) -> Snapshot:
        out = Snapshot(at, "abc", {
            ("server", 0): {"pskv_key_pushed_bytes_total{key=emb}": 4e6 * k,
                            "pskv_key_pushed_bytes_total{key=w}": 1e6 * k,
                            "pskv_table_rows{key=emb}": 100 * k,
                            "pskv_table_bytes{key=emb}": 2**20 * k,
                            "pskv_table_inserts_total{key=emb}": 100 * k,
                            "pskv_table_evictions_total{key=emb}": 10 * k,
                            "pskv_table_refusals_total{key=emb}": 6 * k},
            ("worker", 0): {"pskv_worker_request_seconds_count{command=pull}": 10 * k,
                            "pskv_worker_request_seconds_sum{command=pull}": 0.01 * k,
                            "pskv_worker_table_cache_hits_total{key=emb}": 30 * k,
                            "pskv_worker_table_cache_misses_total{key=emb}": 10 * k},
            ("worker", 1): {"pskv_worker_request_seconds_count{command=pull}": 10 * k,
                            "pskv_worker_request_seconds_sum{command=pull}": 0.5 * k}})
        out.states = {("server", 0): "alive", ("worker", 0): "alive", ("worker", 1): "alive",
                      ("worker", 2): "dead"}
        return out
    text = "\n".join(view(snap(10.0, 1), snap(12.0, 2)))
    assert "hottest keys (MB/s pushed): emb 2.00, w 0.50" in text
    assert "mean request wait: worker 1 50.00 ms, worker 0 1.00 ms (the last" in text
    assert "tables (rows, MiB, inserts/s, evictions/s, refusals/s): emb 200 2.0 50.0 5.0 " \
        "3.0" in text
    assert "row caches (looked-up rows served on the workers): emb 75%" in text
    silent = next(line for line in text.splitlines() if line.startswith("worker 2"))
    assert "dead" in silent and "no metrics read" in silent
