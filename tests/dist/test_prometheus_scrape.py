"""A real Prometheus server scrapes a running job's nodes and answers queries for pskv's
series (Debian's ``prometheus`` package, or its release binary on PATH; skipped without)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(150)

PROMETHEUS = shutil.which("prometheus")
#: the longest worker 0 waits for Prometheus to have every series (a bound, not a timing)
PROM_WAIT = 60.0


def _query(api: str, expr: str) -> list[dict[str, Any]]:
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return []
    return list(body.get("data", {}).get("result", []))


def _ports() -> tuple[int, int]:
    """The first of four metrics ports (scheduler, server, two workers: each node takes the
    first free one from it upward) free now, and Prometheus's web port outside them."""
    from pskv.launch._net import free_port
    for _ in range(20):
        first, web = free_port(), free_port()
        if web not in range(first, first + 4) and all(
                _bindable(port) for port in range(first + 1, first + 4)):
            return first, web
    pytest.fail("found no four free ports in a row for the nodes' /metrics")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus server on PATH: "
                    "apt-get install prometheus (Debian/Ubuntu), or its release binary")
def test_prometheus_scrapes_every_node(run_threads: Any, tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to serve metrics")
    assert PROMETHEUS is not None
    first, web = _ports()
    targets = [f"127.0.0.1:{p}" for p in range(first, first + 4)]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: pskv\n    honor_labels: true\n"
        "    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n")
    api = f"http://127.0.0.1:{web}"
    wanted = {   # query -> the value it has once every node was scraped
        'count(pskv_server_requests_total{command="pushpull"} > 0)': 1,
        'count(pskv_worker_request_seconds_count{command="pushpull"} > 0)': 2,
        'pskv_scheduler_nodes_alive{node_role="worker"}': 2,
        'count(up == 1)': 4,
        # honor_labels keeps pskv's own job label: one job, every node
        'count(count by (job) (pskv_worker_requests_total))': 1,
        'count(pskv_scheduler_nodes_alive{job=~"[0-9a-f]{12}"})': 2,
        # the per-key series of the key pushed (2 workers x 3 rounds), and the scheduler's
        # listing of where each node serves (its heartbeats told it)
        'pskv_key_pushes_total{key="w"}': 6,
        'count(pskv_scheduler_node_info{metrics_port!="0"})': 3,
    }
    # Worker 0 polls Prometheus for up to PROM_WAIT while the other worker keeps its node
    # up: it waits on an event, not in a barrier (a barrier gives up after the request
    # timeout, 10 s here, and a loaded machine's Prometheus may need more than that to
    # start and scrape: the other worker left, and its series with it).
    scraped = threading.Event()

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(100, np.float32))
        for _ in range(3):
            kv.push("w", np.ones(100, np.float32))
            kv.pull("w", out=np.zeros(100, np.float32))
        kv._barrier()
        got: dict[str, float] = {}
        if kv.rank == 0:
            try:
                end = time.monotonic() + PROM_WAIT
                while time.monotonic() < end and got != wanted:
                    for expr in wanted:
                        result = _query(api, expr)
                        if result:
                            got[expr] = float(result[0]["value"][1])
                    time.sleep(0.5)
            finally:
                scraped.set()
        else:
            scraped.wait(PROM_WAIT + 10)
        kv._barrier()              # the nodes stay up until Prometheus has what it needs
        return got

    # Prometheus belongs to this thread (started while the nodes start, always stopped
    # here), not to a worker thread a failed run would abandon with it still running
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            results = run_threads(train, num_workers=2, num_servers=1, metrics_port=first,
                                  heartbeat_interval=0.2, timeout=PROM_WAIT + 30)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    log_tail = (tmp_path / "prometheus.log").read_text()[-2000:]
    assert results[0] == wanted, log_tail
