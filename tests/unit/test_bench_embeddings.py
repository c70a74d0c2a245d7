"""bench_embeddings: its workload is the peers', its arithmetic, where results go, and a
``--quick`` run end to end (a child python; the benchmark itself runs in benchmarks/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SHARED = REPO.parent / "shared" / "bench" / "embeddings"


@pytest.fixture(scope="module")
def be() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_embeddings
        yield bench_embeddings
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def shared_workload() -> Iterator[Any]:
    if not (SHARED / "workload.py").is_file():
        pytest.skip("the peers' workload.py is not in ../shared/bench/embeddings next to "
                    "this checkout; nothing to compare the benchmark's IDs with")
    sys.path.insert(0, str(SHARED))
    try:
        import workload
        yield workload
    finally:
        sys.path.remove(str(SHARED))
        sys.modules.pop("workload", None)


@pytest.mark.parametrize("dist", ["zipf", "uniform"])
def test_ids_and_gradient_are_the_peers(be: Any, shared_workload: Any, dist: str) -> None:
    W = sys.modules["_emb_workload"]
    ours = W.make_batches(5000, 256, 4, dist, 1.05, seed=3)
    theirs = shared_workload.make_batches(5000, 256, 4, dist, 1.05, seed=3)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == np.int64
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(W.make_grad(256, 8), shared_workload.make_grad(256, 8))


def test_zipf_is_skewed_and_uniform_is_not(be: Any) -> None:
    W = sys.modules["_emb_workload"]
    z = np.concatenate(W.make_batches(10000, 4096, 2, "zipf"))
    u = np.concatenate(W.make_batches(10000, 4096, 2, "uniform"))
    assert z.min() >= 0 and z.max() < 10000 and u.min() >= 0 and u.max() < 10000
    assert np.unique(z).size < 0.6 * np.unique(u).size


def test_new_id_streams_never_repeat(be: Any) -> None:
    W = sys.modules["_emb_workload"]
    a = np.concatenate(W.insert_batches(0, 1000, 3, salt=1) + W.insert_batches(3000, 1000, 2,
                                                                               salt=1))
    b = np.concatenate(W.insert_batches(0, 1000, 5, salt=2))
    both = np.concatenate([a, b])
    assert both.dtype == np.int64 and np.unique(both).size == both.size


def test_numpy_ceiling_is_adagrad_with_summed_duplicates(be: Any) -> None:
    W = sys.modules["_emb_workload"]
    grad = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    c = W.NumpyCeiling(5, 4, grad, lr=0.1, eps=1e-10)
    before = c.table.copy()
    c.train(np.array([2, 4, 2]))
    g2 = grad[0] + grad[2]
    np.testing.assert_allclose(c.table[2], before[2] - 0.1 * g2 / np.sqrt(g2 * g2), rtol=1e-5)
    np.testing.assert_allclose(c.acc[4], grad[1] ** 2, rtol=1e-6)
    np.testing.assert_array_equal(c.table[[0, 1, 3]], before[[0, 1, 3]])
    assert c.insert(np.array([9, 7, 9])).tolist() == [0, 1, 0]


def _case(ms: dict[str, dict[str, float]], **extra: Any) -> dict[str, Any]:
    return {"ms_per_batch": {s: {p: {"median": v} for p, v in ph.items()}
                             for s, ph in ms.items()}, **extra}


def test_ratios_and_targets(be: Any) -> None:
    R = sys.modules["_emb_report"]
    data = {"workload": {"batch": 4096},
            "local": {"N=1/zipf": _case({"numpy": {"lookup": 1.0, "train": 2.0},
                                         "pskv": {"lookup": 2.0, "train": 2.8},
                                         "torchrec-tbe-rowwise": {"train": 5.6}},
                                        memory={"rss_over_reference": 1.4})},
            "dist": {"N=1/zipf": _case({"pskv-dist_sync/S1": {"train": 4.0},
                                        "torchrec-dmp-w2": {"train": 17.0}},
                                       jobs={"pskv-dist_sync/S1": {},
                                             "pskv-dist_async/S1": {"unsupported": "no"}})}}
    r = R.ratios(data)
    assert r["local"]["N=1/zipf"]["train: pskv/numpy time"] == pytest.approx(1.4)
    assert r["local"]["N=1/zipf"]["lookup: pskv/numpy time"] == pytest.approx(2.0)
    assert r["local"]["N=1/zipf"]["train: pskv/torchrec-tbe-rowwise steps/s"] == \
        pytest.approx(2.0)
    assert r["dist"]["N=1/zipf"]["pskv-dist_sync/S1 / torchrec-dmp-w2 train steps/s"] == \
        pytest.approx(4.25)
    verdicts = {(t["where"], t["target"][:12]): t["verdict"] for t in R.targets(data)}
    assert verdicts[("local", "one process:")] == "PASS"
    assert verdicts[("local", "memory per r")] == "MISS"
    sync = [t for t in R.targets(data) if t["where"] == "pskv-dist_sync/S1"]
    assert [t["verdict"] for t in sync] == ["PASS", "n/a"]        # no DGL in this run
    assert {t["verdict"] for t in R.targets(data)
            if t["where"] == "pskv-dist_async/S1"} == {"not supported yet"}


def test_peer_lines_are_parsed_by_phase(be: Any) -> None:
    J = sys.modules["_emb_jobs"]
    text = ("[rank1] warning\n{\"peer\": \"x\", \"phase\": \"lookup\", \"ms_per_batch\": 1.5}\n"
            "{broken\n{\"peer\": \"x\", \"phase\": \"train\", \"ms_per_batch\": 3}\n")
    recs = J.parse_peer_lines(text)
    assert sorted(recs) == ["lookup", "train"] and recs["train"]["ms_per_batch"] == 3


def test_partial_runs_never_replace_the_full_results(be: Any) -> None:
    def name(argv: list[str]) -> str:
        return str(be.results_name(be.resolve(be.parse_args(argv))))
    assert name([]) == "bench_embeddings"
    for argv in (["--big"], ["--dist"], ["--torchrec-python", "py"]):
        assert name(argv) == "bench_embeddings", argv
    for argv in (["--quick"], ["--rows", "1e5"], ["--id-dists", "zipf"], ["--steps", "5"],
                 ["--rounds", "1"], ["--servers", "1"], ["--modes", "dist_sync"], ["--cpu"]):
        assert name(argv) == "bench_embeddings-partial", argv
    assert name(["--quick", "--name", "mine"]) == "mine"


def test_quick_run_writes_the_partial_results(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_embeddings.py"), "--quick", "--id-dists", "zipf",
         "--dist", "--servers", "1", "--modes", "dist_async", "--out", str(tmp_path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench_embeddings-partial.json").read_text())
    md = (tmp_path / "bench_embeddings-partial.md").read_text()
    assert data["commit"]["commit"] and data["machine"]["cpu_count"]
    case = data["local"]["N=10000/zipf"]
    for system in ("numpy", "pskv"):
        for phase in ("lookup", "train", "insert"):
            assert case["ms_per_batch"][system][phase]["median"] > 0
    assert case["stats"]["rows"] >= 10000 and case["stats"]["inserts"] >= 10000
    assert case["memory"]["table_bytes_per_row"] > case["memory"]["reference_bytes_per_row"]
    assert data["ratios"]["local"]["N=10000/zipf"]["train: pskv/numpy time"] > 0
    job = data["dist"]["N=10000/zipf"]
    supported = not job["jobs"].get("pskv-dist_async/S1", {}).get("unsupported")
    if supported:
        assert job["ms_per_batch"]["pskv-dist_async/S1"]["train"]["median"] > 0
    else:
        assert "not supported yet" in md
    assert "| pskv |" in md and "Targets" in md


def test_cpu_per_step_by_role(be: Any) -> None:
    """CPU ms per step from the readings at a phase's markers, summed per role."""
    import _emb_jobs as J
    import _emb_workload as W
    user, system = W.cpu_seconds_of_pid("self")
    assert user > 0 and system >= 0
    assert W.cpu_seconds_of_pid(2**22 + 12345) is None         # no such process
    job = J.TableJob.__new__(J.TableJob)
    job.cpu = {"train.start": {"scheduler": (1.0, 0.0), "server 0": (2.0, 1.0),
                               "server 1": (3.0, 1.0), "worker 0": (1.0, 0.5),
                               "worker 1": (1.0, 0.5)},
               "train.end": {"scheduler": (1.0, 0.0), "server 0": (2.5, 1.1),
                             "server 1": (3.4, 1.2), "worker 0": (1.2, 0.5),
                             "worker 1": (1.1, 0.6)}}
    got = job.cpu_per_step("train", 100)
    want = {"scheduler": 0.0, "server": 12.0, "worker": 4.0, "total": 16.0, "system": 4.0}
    assert got is not None and got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    assert job.cpu_per_step("lookup", 100) is None               # no markers: no figure
    job.cpu["train.end"]["server 1"] = None                     # a process gone: none
    assert job.cpu_per_step("train", 100) is None


def test_cpu_run_reports_cpu_per_step_and_profiles(tmp_path: Path) -> None:
    """``--cpu --profile``: only the pskv dist jobs, their CPU per step by role, and a
    cProfile of worker 0 and of each server over the train phase."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = str(REPO / "src")
    prof = tmp_path / "prof"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_embeddings.py"), "--quick", "--cpu", "--steps", "20",
         "--id-dists", "zipf", "--servers", "2", "--modes", "dist_sync", "--out", str(tmp_path),
         "--profile", str(prof)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench_embeddings-partial.json").read_text())
    assert data["local"] == {}
    cpu = data["dist"]["N=10000/zipf"]["cpu_ms_per_batch"]["pskv-dist_sync/S2"]["train"]
    assert cpu["total"] > 0 and cpu["total"] == pytest.approx(
        cpu["worker"] + cpu["server"] + cpu["scheduler"])
    assert "CPU per step" in (tmp_path / "bench_embeddings-partial.md").read_text()
    names = sorted(p.name for p in prof.glob("*/*.prof"))
    assert names == ["server0.train.prof", "server1.train.prof", "worker0.train.prof",
                     "worker1.train.prof"], names


def test_recorded_command_names_no_path_of_this_machine(be: Any) -> None:
    cmd = be.masked_command([str(BENCH / "bench_embeddings.py"), "--torchrec-python",
                             "/opt/tr/bin/python", "--dgl-python=/opt/dgl/bin/python",
                             "--dist", "--out", "/tmp/x", "--rows", "1e6"])
    assert cmd == ("python benchmarks/bench_embeddings.py --torchrec-python TORCHREC_PYTHON "
                   "--dgl-python=DGL_PYTHON --dist --out OUT --rows 1e6")
