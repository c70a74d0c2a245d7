"""The PyTorch CTR example on a parameter server (issue #29, item 2): 2 workers x 2 servers
in dist_sync and dist_async (thread clusters), and once under the real launcher."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any, Callable

import pytest

pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

from pskv.examples import train_ctr_torch as tt  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SMALL = ["--samples-per-day", "25000", "--epochs", "2", "--capacity", "1000"]


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_two_workers_reach_the_ceiling(run_threads: Callable[..., dict[int, Any]],
                                       store_type: str) -> None:
    args = tt.parse_args(SMALL + ["--kv-store", store_type])
    results = run_threads(lambda kv: tt.train(args, kv), num_workers=2, num_servers=2,
                          store_type=store_type, timeout=150)
    for rank, r in sorted(results.items()):
        assert not isinstance(r, BaseException), (rank, r)
        hist = r["history"]
        assert len(hist) == 2, hist
        assert hist[-1]["ceiling_auc"] - hist[-1]["test_auc"] < 0.04, (rank, hist)
        for h in hist:
            assert h["rows"] <= args.capacity, (rank, h)
    # both workers evaluated after the same barrier: the same table; in dist_sync the
    # same MLP too (in dist_async each steps with the gradients the store held at its pull)
    same = ("rows", "inserts", "refusals", "evictions") + (
        ("test_auc",) if store_type == "dist_sync" else ())
    for k in same:
        assert results[0]["history"][-1][k] == results[1]["history"][-1][k], k


def test_cli_under_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", "--timeout", "150",
         sys.executable, "-m", "pskv.examples.train_ctr_torch", "--kv-store", "dist_sync",
         *SMALL, "--quiet"], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = re.findall(r"rank (\d) of 2 done: test auc ([\d.]+)", proc.stdout)
    assert sorted(r for r, _ in done) == ["0", "1"], proc.stdout
    assert all(float(a) > 0.7 for _, a in done), proc.stdout
