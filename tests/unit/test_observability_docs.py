"""docs/observability.md lists every metric pskv exports, and the Grafana dashboard plots
only series that exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "observability.md").read_text()
EXPORTED = set(re.findall(r'"(pskv_[a-z_]+)"', (ROOT / "src" / "pskv" / "_ps" / "metrics.py")
                          .read_text()))


def test_every_metric_is_documented_and_follows_the_conventions() -> None:
    assert len(EXPORTED) >= 14
    documented = set(re.findall(r"^\| `(pskv_[a-z_]+)` \|", DOC, re.M))
    assert documented == EXPORTED
    for name in EXPORTED:
        kind = re.search(rf"^\| `{name}` \| (\w+) \|", DOC, re.M)
        assert kind is not None
        if kind.group(1) == "counter":
            assert name.endswith("_total"), name
        if kind.group(1) == "histogram":
            assert name.endswith("_seconds"), name


def test_the_dashboard_plots_exported_series() -> None:
    dash = json.loads((ROOT / "docs" / "grafana" / "pskv-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs
            for n in re.findall(r"pskv_[a-z_]+", e)}
    assert used and used <= EXPORTED, used - EXPORTED
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
