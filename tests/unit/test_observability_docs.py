"""docs/observability.md lists every metric pskv exports, with its type, and the Grafana
dashboard plots only series that exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "observability.md").read_text()


def _exported() -> dict[str, str]:
    """Every pskv_ series the three kinds of node register, as scraped (counters with
    ``_total``), with its type: each node built with state that fills every series."""
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to test metrics")
    import numpy as np
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pskv._ps.message import Command
    from pskv._ps.observe.series import SchedulerMetrics, ServerMetrics, WorkerMetrics
    state = {"keys": 1, "per_key": {"w": (1, 4)}, "backups": [(0, 1, True, 0)],
             "tables": {"emb": {"rows": 1, "lookups": 1, "misses": 1, "inserts": 1,
                                "refusals": 0, "evictions": 0}}}
    server = ServerMetrics(0, "job", lambda: state)
    server.request(Command.PUSH, [np.zeros(4)])
    server.round_closed(0, 0.1)
    worker = WorkerMetrics(0, "job", lambda: (0, 0))
    worker.sent(1, Command.PULL, [])
    worker.received(1, [np.zeros(4)])
    worker.table_caches = lambda: {"emb": {"hits": 3, "misses": 1, "rows": 1}}
    sched = SchedulerMetrics("job", lambda role: 1, lambda: [("worker", 0, "alive", "", 0)])
    out = {}
    for node in (server, worker, sched):
        text = generate_latest(node.registry).decode()
        for family in text_string_to_metric_families(text):
            if family.name.startswith("pskv_"):
                name = family.name + ("_total" if family.type == "counter" else "")
                out[name] = family.type
    return out


def test_every_metric_is_documented_and_follows_the_conventions() -> None:
    exported = _exported()
    assert len(exported) >= 29
    documented = dict(re.findall(r"^\| `(pskv_[a-z_]+)` \| (\w+) \|", DOC, re.M))
    assert set(documented) == set(exported), (set(exported) ^ set(documented))
    for name, kind in exported.items():
        assert documented[name] == kind, name
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name


def test_the_dashboard_plots_exported_series() -> None:
    exported = _exported()
    dash = json.loads((ROOT / "docs" / "grafana" / "pskv-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs
            for n in re.findall(r"pskv_[a-z_]+", e)}
    assert used and used <= set(exported), used - set(exported)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    # the new series have panels: hot keys, tables, replication, re-sends, restarts
    for name in ("pskv_key_pushed_bytes_total", "pskv_table_rows",
                 "pskv_replication_pending_changes", "pskv_worker_resent_total",
                 "pskv_scheduler_restarts_total"):
        assert name in used, name
