"""bench_multihost's arithmetic (line-rate fractions, ratios, verdicts) and where bench_dist
writes a partial run: no bed, no processes; the benchmarks run in benchmarks/, never here."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bm() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_multihost
        yield bench_multihost
    finally:
        sys.path.remove(str(BENCH))


def _figs(small: float, mb4: float, mb64: float) -> dict[str, Any]:
    return {"small": {"value": small}, "dense_1048576": {"value": mb4},
            "dense_16777216": {"value": mb64}}


def test_line_rate_fraction_counts_both_workers_pushes_and_pulls(bm: Any) -> None:
    ref = {"one_stream_mb_s": 120.0, "two_into_one_mb_s": 120.0}
    # 27 MB/s per worker: 4 x 27 = 108 MB cross the server's 120 MB/s link per second
    rep = bm.rate_report("1gbit", {"pskv": _figs(150, 27.0, 30.0),
                                   "mxnet": _figs(600, 20.0, 30.0)}, ref)
    rows = {r["figure"]: r for r in rep["rows"]}
    assert rows["dense_1048576"]["line_pskv"] == pytest.approx(0.9)
    assert rows["dense_16777216"]["line_pskv"] == pytest.approx(1.0)
    assert rows["small"]["ratio"] == pytest.approx(0.25)
    verdicts = {t["target"]: t["verdict"] for t in rep["targets"]}
    assert verdicts == {"dense_1048576: >= 90% of the line rate": "PASS",
                        "dense_16777216: >= 90% of the line rate": "PASS",
                        "small key: <= 0.5 x ps-lite's time": "PASS"}


def test_ten_gigabit_targets_compare_with_ps_lite(bm: Any) -> None:
    ref = {"one_stream_mb_s": 900.0, "two_into_one_mb_s": 1000.0}
    rep = bm.rate_report("10gbit", {"pskv": _figs(300, 300.0, 150.0),
                                    "mxnet": _figs(500, 100.0, 100.0)}, ref)
    verdicts = {t["target"]: t["verdict"] for t in rep["targets"]}
    assert verdicts["dense_1048576: >= 2 x ps-lite's MB/s"] == "PASS"
    assert verdicts["dense_16777216: >= 2 x ps-lite's MB/s"] == "MISS"
    assert verdicts["small key: <= 0.5 x ps-lite's time"] == "MISS"


def test_missing_mxnet_reads_not_available(bm: Any) -> None:
    ref = {"one_stream_mb_s": 120.0, "two_into_one_mb_s": 120.0}
    rep = bm.rate_report("10gbit", {"pskv": _figs(150, 27.0, 30.0)}, ref)
    assert all(t["verdict"] == "n/a" for t in rep["targets"])
    text = bm.markdown({
        "command": "x", "commit": {"commit": "abc", "dirty": False}, "timestamp": "t",
        "machine": {"cpu_model": "c", "cpu_count": 2, "mem_total_gib": 1, "platform": "p",
                    "loadavg_at_start": [0, 0, 0]}, "servers": 1, "rounds": 1,
        "rates": {"10gbit": {"reference": ref, **rep}}})
    assert "| small key (2,3): us per push+pull | 150 | n/a | n/a |" in text


def test_bench_dist_partial_runs_never_replace_the_full_results() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_dist
        name = bench_dist.results_name
        parse = bench_dist.parse_args
        assert name(parse([])) == "bench_dist"
        for argv in (["--quick"], ["--only", "dense"], ["--servers", "2"], ["--rounds", "1"],
                     ["--sizes", "1024"], ["--transport", "auto"], ["--no-mxnet"]):
            assert name(parse(argv)) == "bench_dist-partial", argv
        assert name(parse(["--only", "dense", "--name", "mine"])) == "mine"
    finally:
        sys.path.remove(str(BENCH))
