"""Observability on whole clusters run as threads: stragglers named while they straggle.

A worker that delays its push past ``straggler_seconds`` is named, with the key and round
it holds up, in a WARNING of the server's log while the others wait for it.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_late_worker_is_named_with_its_key(run_threads: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pskv._ps.observe.stragglers")

    def train(kv: Any) -> float:
        kv.init("b", np.zeros(3, np.float32))
        if kv.rank == 1:
            time.sleep(1.5)            # past the threshold, and past a server tick or two
        kv.push("b", np.ones(3, np.float32))
        out = np.zeros(3, np.float32)
        kv.pull("b", out=out)
        return float(out[0])

    results = run_threads(train, straggler_seconds=0.2)
    assert results == {0: 2.0, 1: 2.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.observe.stragglers"]
    assert lines, "no straggler warning was logged"
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.name == "pskv._ps.observe.stragglers")
    assert any("round 0 of key 'b' has waited" in line and "for worker 1 (of 2)" in line
               and line.startswith("server 0: ") for line in lines), lines


def test_no_straggler_line_when_rounds_close_in_time(run_threads: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pskv._ps.observe.stragglers")

    def train(kv: Any) -> None:
        kv.init("b", np.zeros(3, np.float32))
        for _ in range(3):
            kv.push("b", np.ones(3, np.float32))
            kv.pull("b", out=np.zeros(3, np.float32))

    run_threads(train, straggler_seconds=30.0)
    assert not [r for r in caplog.records if r.name == "pskv._ps.observe.stragglers"]


def test_the_scheduler_names_a_worker_last_across_servers(
        run_threads: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Keys spread over two servers, worker 1 always a little late: no server sees enough
    rounds to flag it alone (fewer than MIN_ROUNDS each), the scheduler, adding up what
    every server's heartbeats say, names it."""
    from pskv._ps.observe.stragglers import MIN_ROUNDS
    caplog.set_level(logging.WARNING, logger="pskv._ps.observe.stragglers")
    keys = list(range(4))
    steps = (MIN_ROUNDS + len(keys) - 1) // len(keys) + 1    # a few rounds past MIN_ROUNDS

    def train(kv: Any) -> None:
        kv.init(keys, [np.zeros(3, np.float32)] * len(keys))
        for _ in range(steps):
            if kv.rank == 1:
                time.sleep(0.03)        # last in every round, by more than MIN_WAIT
            kv.push(keys, [np.ones(3, np.float32)] * len(keys))
            kv.pull(keys, out=[np.zeros(3, np.float32) for _ in keys])
        time.sleep(0.6)                 # a few heartbeats after the last round

    run_threads(train, num_servers=2, straggler_seconds=2.0, heartbeat_interval=0.1,
                heartbeat_timeout=5.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.observe.stragglers"]
    assert not [line for line in lines if line.startswith("server ")], lines
    flagged = [line for line in lines if line.startswith("scheduler: worker 1 (of 2)")]
    assert flagged and "on all servers" in flagged[0], lines


# ---- /metrics -----------------------------------------------------------------------------
def _scrape(first: int, tries: int = 16) -> dict[int, str]:
    """port -> /metrics text, for every port from ``first`` that answers."""
    import urllib.error
    import urllib.request
    found = {}
    for port in range(first, first + tries):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                found[port] = r.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            continue
    return found


def _series(texts: dict[int, str]) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families
    return [(s.name, s.labels, s.value) for text in texts.values()
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(series: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    got = [v for n, lab, v in series if n == name and labels.items() <= lab.items()]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def test_every_node_serves_metrics_while_the_job_runs(run_threads: Any, tmp_path: Any) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    from pskv.launch._net import free_port
    first = free_port()

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(1000, np.float32))
        for _ in range(3):
            kv.push("w", np.ones(1000, np.float32))
            kv.pull("w", out=np.zeros(1000, np.float32))
        kv._barrier()
        texts = None
        if kv.rank == 0:
            end = time.monotonic() + 20   # checkpoints are written on a thread: wait for one
            while time.monotonic() < end:
                texts = _scrape(first)
                if re.search(r"^pskv_checkpoint_write_seconds_count\{.*\} [1-9]",
                             "".join(texts.values()), re.M):
                    break
                time.sleep(0.1)
        kv._barrier()                  # every node stays up until worker 0 has scraped
        return texts

    results = run_threads(train, num_workers=2, num_servers=1, metrics_port=first,
                          checkpoint_dir=str(tmp_path), checkpoint_every=1)
    texts = results[0]
    assert isinstance(texts, dict), texts
    series = _series(texts)
    roles = sorted({(lab["role"], lab["rank"]) for _n, lab, _v in series if "role" in lab})
    assert roles == [("scheduler", "0"), ("server", "0"), ("worker", "0"), ("worker", "1")]
    assert len(texts) == 4                    # one port per node, from ``first`` upward
    assert len({lab["job"] for _n, lab, _v in series if "job" in lab}) == 1
    assert _value(series, "pskv_scheduler_nodes_alive", node_role="worker") == 2
    assert _value(series, "pskv_scheduler_nodes_alive", node_role="server") == 1
    assert _value(series, "pskv_server_keys", role="server") == 1
    # a push and the pull right after it travel as one PUSHPULL (PSKV_COALESCE_BYTES)
    assert _value(series, "pskv_server_requests_total", command="pushpull") == 6
    assert _value(series, "pskv_server_received_bytes_total", command="pushpull") == 6 * 4000
    assert _value(series, "pskv_server_sent_bytes_total", command="pushpull") == 6 * 4000
    assert _value(series, "pskv_round_wait_seconds_count", role="server") == 3
    assert _value(series, "pskv_round_apply_seconds_count", role="server") == 3
    assert _value(series, "pskv_server_waiting_requests", role="server") == 0
    assert _value(series, "pskv_checkpoint_write_seconds_count", role="server") >= 1
    assert all("\nprocess_resident_memory_bytes " in text for text in texts.values())
    for rank in ("0", "1"):
        assert _value(series, "pskv_worker_request_seconds_count", role="worker", rank=rank,
                      command="pushpull") == 3
        assert _value(series, "pskv_worker_sent_bytes_total", role="worker", rank=rank,
                      command="pushpull") == 3 * 4000
        assert _value(series, "pskv_worker_received_bytes_total", role="worker", rank=rank,
                      command="pushpull") == 3 * 4000
    # worker 0 initializes the keys on the servers (MXNet's rule), the others wait for it
    assert _value(series, "pskv_worker_sent_bytes_total", rank="0", command="init") == 4000


def test_a_port_in_use_is_skipped_and_a_full_range_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    import socket
    from pskv._ps.observe import metrics
    from pskv._ps.observe import series
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    m = series.WorkerMetrics(0, "job")
    try:
        got = m.serve("127.0.0.1", port)
        assert got is not None and got != port and port < got < port + metrics.PORT_TRIES
        assert got in _scrape(got, 1)
    finally:
        m.close()
    monkeypatch.setattr(metrics, "PORT_TRIES", 1)
    caplog.set_level(logging.ERROR, logger="pskv._ps.observe.metrics")
    other = series.WorkerMetrics(1, "job")
    try:
        assert other.serve("127.0.0.1", port) is None
    finally:
        other.close()
        held.close()
    # this node's line (nodes of earlier tests may still be logging as they wind down)
    [rec] = [r for r in caplog.records if "worker 1:" in r.getMessage()]
    assert f"ports {port} to {port} on 127.0.0.1 are all in use" in rec.getMessage()
    assert "PSKV_METRICS_PORT" in rec.getMessage() and "\n" not in rec.getMessage()


def test_a_scraped_port_is_served_again_at_once() -> None:
    """A node's port that was scraped (its closed connections in TIME_WAIT) is taken again
    by the next node at once, not skipped: the next job keeps the same ports."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    import socket
    from pskv._ps.observe import series
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    first = series.WorkerMetrics(0, "job")
    try:
        if first.serve("127.0.0.1", port) != port:
            pytest.skip(f"port {port} was taken by another program meanwhile; run again")
        assert port in _scrape(port, 1)            # the server closes: TIME_WAIT on port
    finally:
        first.close()
    again = series.WorkerMetrics(0, "job")
    try:
        assert again.serve("127.0.0.1", port) == port
        assert port in _scrape(port, 1)
    finally:
        again.close()


def test_top_asks_the_scheduler_where_the_nodes_serve(
        thread_cluster: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """pskv-top --scheduler HOST:PORT (the scheduler's own port): the scheduler, asked with
    the job's secret, lists where every node serves /metrics, and the view reads them all;
    without the secret, or with another, it is refused like any stranger."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to serve and read metrics")
    from pskv._ps.observe.observer import ask_scheduler
    from pskv.errors import ConfigError
    from pskv.launch._net import free_port
    from pskv.top import from_scheduler, main, read_job
    cluster = thread_cluster(2, 1, metrics_port=free_port())
    address = f"tcp://127.0.0.1:{cluster.cfg.root_port}"
    secret = cluster.cfg.secret
    assert secret is not None
    monkeypatch.setenv("PSKV_SECRET", secret.decode())

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(100, np.float32))
        kv.push("w", np.ones(100, np.float32))
        kv.pull("w", out=np.zeros(100, np.float32))
        kv._barrier()
        got: Any = None
        if kv.rank == 0:
            end = time.monotonic() + 20   # each node tells its port with its heartbeats
            listing = ask_scheduler(address, secret)
            while not (len(listing.nodes) == 3 and all(n[4] for n in listing.nodes)) \
                    and time.monotonic() < end:
                time.sleep(0.1)
                listing = ask_scheduler(address, secret)
            host, port = from_scheduler("127.0.0.1", cluster.cfg.root_port)
            snap = read_job(host, port)
            refused = []
            for other in (None, b"another job's secret"):
                try:
                    ask_scheduler(address, other, timeout=5)
                except ConfigError as err:
                    refused.append(str(err))
            code = main(["--scheduler", f"127.0.0.1:{cluster.cfg.root_port}", "--once",
                         "--interval", "0.2"])
            got = (listing, (host, port), sorted(snap.nodes), refused, code)
        kv._barrier()                  # every node stays up until worker 0 has read
        return got

    results = cluster.run(train)
    assert not isinstance(results[0], BaseException), results[0]
    listing, (host, port), nodes, refused, code = results[0]
    assert [(n[0], n[1], n[2]) for n in listing.nodes] == [
        ("server", 0, "alive"), ("worker", 0, "alive"), ("worker", 1, "alive")]
    assert all(n[4] > 0 for n in listing.nodes), listing
    assert listing.metrics == (host, port) and listing.job
    assert nodes == [("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)]
    assert len(refused) == 2, refused
    assert "asks for proof of the job's secret and PSKV_SECRET is not set" in refused[0]
    assert "refused pskv-top" in refused[1] and "proof of the cluster secret" in refused[1]
    assert code == 0
    out = capsys.readouterr().out
    assert "scheduler: 1 servers and 2 workers alive" in out, out
    for node in ("server 0", "worker 0", "worker 1"):
        assert node in out, out


def test_metrics_are_pushed_to_a_pushgateway_when_nodes_end(run_threads: Any) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to push metrics")
    import http.server
    import threading
    pushed: dict[str, str] = {}

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:  # noqa: N802 - the Pushgateway's API
            pushed[self.path] = self.rfile.read(int(self.headers["Content-Length"])).decode()
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        def train(kv: Any) -> None:
            kv.init("w", np.zeros(10, np.float32))
            kv.push("w", np.ones(10, np.float32))
            kv.pull("w", out=np.zeros(10, np.float32))

        run_threads(train, metrics_pushgateway=f"127.0.0.1:{gateway.server_port}")
    finally:
        gateway.shutdown()
        gateway.server_close()
        thread.join(5)
    groups = sorted(p.split("/", 4)[4] for p in pushed)      # /metrics/job/<job>/...
    assert groups == ["rank/0/role/scheduler", "rank/0/role/server", "rank/0/role/worker",
                      "rank/1/role/worker"], sorted(pushed)
    assert len({p.split("/")[3] for p in pushed}) == 1         # one job
    server = next(body for p, body in pushed.items() if p.endswith("/role/server"))
    assert 'pskv_server_requests_total{command="pushpull"' in server


def test_a_pushgateway_that_does_not_answer_does_not_fail_the_job(
        run_threads: Any, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to push metrics")
    from pskv.launch._net import free_port
    caplog.set_level(logging.ERROR, logger="pskv._ps.observe.metrics")

    def train(kv: Any) -> float:
        kv.init("w", np.zeros(2, np.float32))
        kv.push("w", np.ones(2, np.float32))
        out = np.zeros(2, np.float32)
        kv.pull("w", out=out)
        return float(out[0])

    results = run_threads(train, metrics_pushgateway=f"127.0.0.1:{free_port()}")
    assert results == {0: 2.0, 1: 2.0}          # and every node exited 0 (run_threads)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("cannot push metrics to the Pushgateway" in line
                                   and "PSKV_METRICS_PUSHGATEWAY" in line for line in lines)


def test_the_scheduler_lists_every_node_and_pskv_top_reads_the_listing(
        run_threads: Any) -> None:
    """The scheduler exports where each node serves (told by heartbeats); pskv-top's
    read_job reads the nodes it lists, and shows hot keys and tables from the per-key
    and table series."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    from pskv.launch._net import free_port
    from pskv.table import TableSpec, Zeros
    from pskv.top import Snapshot, listing, read_job, view
    first = free_port()

    def rounds(kv: Any, n: int) -> None:
        for _ in range(n):
            kv.push("w", np.ones(1000, np.float32))
            kv.pull("w", out=np.zeros(1000, np.float32))

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(1000, np.float32))
        kv.init("emb", TableSpec(dim=4, init=Zeros()))
        rounds(kv, 3)
        kv.lookup("emb", np.array([1, 2, 3 + kv.rank]))
        kv._barrier()
        snaps: list[Snapshot] = []
        if kv.rank == 0:
            end = time.monotonic() + 20       # until each node's heartbeat told its port
            while time.monotonic() < end:
                snap = read_job("127.0.0.1", first)
                if len(snap.nodes) == 4:
                    snaps.append(snap)
                    break
                time.sleep(0.2)
        kv._barrier()
        rounds(kv, 3)
        kv._barrier()
        if kv.rank == 0 and snaps:
            snaps.append(read_job("127.0.0.1", first))
        kv._barrier()
        return snaps

    results = run_threads(train, num_workers=2, num_servers=1, metrics_port=first,
                          heartbeat_interval=0.2, metrics_keys=("emb",))
    snaps = results[0]
    assert isinstance(snaps, list) and len(snaps) == 2, "pskv-top never read all 4 nodes"
    before, after = snaps
    listed = listing(after.nodes[("scheduler", 0)])
    assert [(r, k, state) for r, k, state, _h, _p in listed] == [
        ("server", 0, "alive"), ("worker", 0, "alive"), ("worker", 1, "alive")]
    assert {(r, k): p for r, k, _s, _h, p in listed} == {
        n: p for n, p in after.ports.items() if n[0] != "scheduler"}
    assert after.ports[("scheduler", 0)] == first
    server = after.nodes[("server", 0)]
    assert server["pskv_key_pushes_total{key=w}"] == 12          # 2 workers x 6 rounds
    assert server["pskv_key_pushed_bytes_total{key=w}"] == 12 * 4000
    assert "pskv_key_pushes_total{key=emb}" in server               # named in metrics_keys
    assert server["pskv_table_rows{key=emb}"] == 4                  # IDs 1, 2, 3, 4
    assert server["pskv_table_bytes{key=emb}"] >= 4 * 4 * 4         # at least the 4 rows of dim 4
    assert server["pskv_table_inserts_total{key=emb}"] == 4
    text = "\n".join(view(before, after))
    assert "hottest keys (MB/s pushed): w " in text
    assert "tables (rows, MiB, inserts/s, evictions/s, refusals/s): emb 4 " in text
    for node in ("server 0", "worker 0", "worker 1"):
        line = next(x for x in text.splitlines() if x.startswith(node))
        assert line.split()[2] == "alive" and line.split()[-1] != "-"   # state, RSS


def test_a_metrics_range_all_in_use_leaves_the_job_alone(
        run_threads: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Every node finds its metrics port taken: one ERROR line each, and the job trains on
    to the same result."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    import socket
    from pskv._ps.observe import metrics
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    monkeypatch.setattr(metrics, "PORT_TRIES", 1)
    caplog.set_level(logging.ERROR, logger="pskv._ps.observe.metrics")

    def train(kv: Any) -> float:
        kv.init("w", np.zeros(2, np.float32))
        kv.push("w", np.ones(2, np.float32))
        out = np.zeros(2, np.float32)
        kv.pull("w", out=out)
        return float(out[0])

    try:
        results = run_threads(train, metrics_port=held.getsockname()[1])
    finally:
        held.close()
    assert results == {0: 2.0, 1: 2.0}          # and every node exited 0 (run_threads)
    lines = [r.getMessage() for r in caplog.records if "are all in use" in r.getMessage()]
    assert len(lines) == 4 and all("\n" not in line and "the job goes on" in line
                                   for line in lines), lines


def test_pskv_top_at_the_schedulers_own_port_is_one_line_and_harms_nothing(
        run_threads: Any) -> None:
    """pskv-top pointed at the scheduler's pskv port (not its /metrics): one line, status
    2; the scheduler drops the stranger and the job ends as usual."""
    import subprocess
    import sys

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(2, np.float32))
        got = None
        if kv.rank == 0:
            got = subprocess.run([sys.executable, "-m", "pskv.top",
                                  f"127.0.0.1:{kv._cfg.root_port}", "--once", "--ports", "1",
                                  "--interval", "0.1"], capture_output=True, text=True,
                                 env={"PYTHONPATH": ":".join(sys.path)}, timeout=30)
        kv._barrier()
        kv.push("w", np.ones(2, np.float32))
        out = np.zeros(2, np.float32)
        kv.pull("w", out=out)
        return got, float(out[0])

    results = run_threads(train)
    got, value = results[0]
    assert value == 2.0 and results[1][1] == 2.0
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
    assert got.stderr.startswith("pskv-top: ") and "PSKV_METRICS_PORT" in got.stderr


def test_a_heartbeat_tells_the_metrics_port_and_garbage_is_ignored() -> None:
    """What a node's heartbeat says of its metrics port is listed; anything else in a
    heartbeat's body is ignored: the heartbeat is still answered, nothing is raised."""
    import time

    from pskv._ps.config import ClusterConfig, Role
    from pskv._ps.message import Command, Meta
    from pskv._ps.scheduler import Scheduler, _Node
    from pskv.launch._net import free_port
    sched = Scheduler(ClusterConfig(Role.SCHEDULER, root_port=free_port()))
    sent: list[Command] = []
    sched._send = lambda ident, cmd, ts=0, body=None: sent.append(cmd)  # type: ignore
    node = _Node("conn", "worker", 0, {}, time.monotonic())  # type: ignore[arg-type]
    sched._nodes["conn"] = node  # type: ignore[index]
    try:
        for body in (None, [1], "x", {"metrics": "9400"}, {"metrics": 70000},
                     {"metrics": True}, {"metrics": -1}, {"metrics": 9400.0}):
            sched.handle("conn", node, Meta(Command.HEARTBEAT, body=body), [])  # type: ignore
            assert node.metrics_port == 0, body
        sched.handle("conn", node, Meta(Command.HEARTBEAT, body={  # type: ignore[arg-type]
            "metrics": 9401, "metrics_host": 7}), [])
        assert (node.metrics_port, node.metrics_host) == (9401, "")
        sched.handle("conn", node, Meta(Command.HEARTBEAT, body={  # type: ignore[arg-type]
            "metrics": 9402, "metrics_host": "10.0.0.7"}), [])
        assert sched._listing() == [("worker", 0, "alive", "10.0.0.7", 9402)]
        assert sent == [Command.HEARTBEAT_ACK] * 10
    finally:
        sched.loop.close()
        sched._zctx.close()


def test_replication_series_of_a_job_with_backups(run_threads: Any) -> None:
    """With PSKV_REPLICAS=1 each server's shard has a backup on the other: both are up,
    and every change is acknowledged by the time the workers' pulls are answered."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test the metrics endpoints")
    from pskv.launch._net import free_port
    first = free_port()

    def train(kv: Any) -> Any:
        for key in ("a", "b", "c", "d"):
            kv.init(key, np.zeros(10, np.float32))
        for key in ("a", "b", "c", "d"):
            kv.push(key, np.ones(10, np.float32))
            kv.pull(key, out=np.zeros(10, np.float32))
        kv._barrier()
        texts = _scrape(first, 8) if kv.rank == 0 else None
        kv._barrier()
        return texts

    results = run_threads(train, num_workers=2, num_servers=2, metrics_port=first,
                          replicas=1)
    series = _series(results[0])
    for shard, backup in (("0", "1"), ("1", "0")):
        assert _value(series, "pskv_replication_backup_up", shard=shard, backup=backup) == 1
        assert _value(series, "pskv_replication_pending_changes", shard=shard,
                      backup=backup) == 0
    # four keys over two servers: every push is counted once, by the shard's primary
    pushes = sum(v for n, _lab, v in series if n == "pskv_key_pushes_total")
    assert pushes == 4 * 2
