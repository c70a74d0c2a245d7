"""A real Prometheus server scrapes a running job's nodes and answers queries for pskv's
series (Debian's ``prometheus`` package, or its release binary on PATH; skipped without)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

PROMETHEUS = shutil.which("prometheus")


def _query(api: str, expr: str) -> list[dict[str, Any]]:
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return []
    return list(body.get("data", {}).get("result", []))


@pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus server on PATH: "
                    "apt-get install prometheus (Debian/Ubuntu), or its release binary")
def test_prometheus_scrapes_every_node(run_threads: Any, tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to serve metrics")
    from pskv.launch._net import free_port
    first, web = free_port(), free_port()
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

    def train(kv: Any) -> Any:
        kv.init("w", np.zeros(100, np.float32))
        for _ in range(3):
            kv.push("w", np.ones(100, np.float32))
            kv.pull("w", out=np.zeros(100, np.float32))
        kv._barrier()
        got: dict[str, float] = {}
        if kv.rank == 0:
            assert PROMETHEUS is not None
            with (tmp_path / "prometheus.log").open("w") as log:
                proc = subprocess.Popen(
                    [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp_path / 'data'}",
                     f"--web.listen-address=127.0.0.1:{web}"],
                    stdout=subprocess.DEVNULL, stderr=log)
                try:
                    end = time.monotonic() + 60
                    while time.monotonic() < end and got != wanted:
                        for expr in wanted:
                            result = _query(api, expr)
                            if result:
                                got[expr] = float(result[0]["value"][1])
                        time.sleep(0.5)
                finally:
                    proc.terminate()
                    proc.wait(20)
        kv._barrier()              # the nodes stay up until Prometheus has what it needs
        return got

    results = run_threads(train, num_workers=2, num_servers=1, metrics_port=first,
                          heartbeat_interval=0.2)
    log = (tmp_path / "prometheus.log").read_text()[-2000:]
    assert results[0] == wanted, log
