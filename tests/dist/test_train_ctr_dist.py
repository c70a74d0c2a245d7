"""The CTR example on a parameter server: 2 workers x 2 servers, in dist_async with
staleness bounds."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any, Callable

import pytest

from pskv.examples import train_ctr as tc

SMALL = ["--samples-per-day", "25000", "--epochs", "3", "--capacity", "1000"]


def test_async_reaches_the_ceiling_with_a_bounded_table(
        run_threads: Callable[..., dict[int, Any]]) -> None:
    # both staleness bounds on: each worker reads its own writes (K = 0), and no worker
    # runs more than 2 push calls (one step) ahead of the other
    args = tc.parse_args(SMALL + ["--kv-store", "dist_async", "--staleness", "0",
                                  "--global-staleness", "2"])

    def run(kv: Any) -> dict[str, Any]:
        res = tc.train(args, kv)
        res["bounds"] = kv._reads.bounds                  # what set_staleness recorded
        return res

    results = run_threads(run, num_workers=2, num_servers=2, store_type="dist_async")
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
        assert r["bounds"] == (0, 2)
    for rank, r in results.items():
        hist = r["history"]
        assert len(hist) == 3, hist
        # within a few points of what the generating model's own probabilities reach:
        # 3 after the first day (the first day's model starts from nothing)
        assert hist[-1]["ceiling_auc"] - hist[-1]["test_auc"] < 0.03, (rank, hist)
        for h in hist:
            assert h["ceiling_auc"] - h["test_auc"] < 0.06, (rank, h)
            # Capacity(1000) over 2 servers: at most ceil(1000 / 2) rows each after a sweep
            assert h["rows"] <= args.capacity, (rank, h)
        last = hist[-1]
        assert last["evictions"] > 0 and last["refusals"] > last["inserts"], last
        assert last["rows"] == last["inserts"] - last["evictions"]
    # both workers evaluated after the same barrier: the same table, the same counters
    for k in ("rows", "inserts", "refusals", "evictions", "test_auc"):
        assert results[0]["history"][-1][k] == results[1]["history"][-1][k], k
    assert results[0]["samples"] + results[1]["samples"] == 3 * 25000 * 4 // 5


def test_async_with_a_hot_row_cache_reaches_the_ceiling(
        run_threads: Callable[..., dict[int, Any]]) -> None:
    """--cache-rows: each worker serves its hottest rows from its cache (docs/embeddings.md
    C1-C7), and the AUC stays as near the ceiling as without."""
    args = tc.parse_args(SMALL + ["--kv-store", "dist_async", "--cache-rows", "300"])
    results = run_threads(lambda kv: tc.train(args, kv), num_workers=2, num_servers=2,
                          store_type="dist_async")
    for rank, r in results.items():
        if isinstance(r, BaseException):
            raise r
        last = r["history"][-1]
        assert last["ceiling_auc"] - last["test_auc"] < 0.03, (rank, last)
        assert last["cache_hits"] > 0.05 * (last["cache_hits"] + last["cache_misses"]), last


def _launch(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", "--timeout", "100",
         sys.executable, "-m", "pskv.examples.train_ctr", "--kv-store", "dist_async",
         *SMALL, *flags],
        capture_output=True, text=True, timeout=110)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_cli_under_the_launcher() -> None:
    proc = _launch("--staleness", "1", "--global-staleness", "4")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "dist_async, 2 workers, 3 days of 25,000 samples" in out, out
    assert "staleness bound 1, global bound 4; table:" in out, out
    lines = re.findall(r"\[worker 0\] (epoch \d/3: loss .*)", out)
    assert len(lines) == 3, out                      # rank 0: one line per epoch
    for i, ln in enumerate(lines):
        m = re.search(r"test auc (0\.\d+) .* ceiling (0\.\d+)  table ([\d,]+)/1,000 rows", ln)
        assert m, ln
        assert float(m[2]) - float(m[1]) < (0.03 if i == 2 else 0.06), ln
        assert int(m[3].replace(",", "")) <= 1000, ln
    assert re.search(r"\(\d[\d,]* inserted, \d[\d,]* refused, [1-9][\d,]* evicted\)",
                     lines[-1]), lines[-1]
    assert out.count(" of 2 done: test auc ") == 2, out   # every worker: its final line
