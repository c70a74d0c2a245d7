"""The training example on a parameter server.

The proof that data-parallel training is right: with the same seed and data order, W
workers in ``dist_sync`` with batch b each train the same weights as one process with batch
W*b, whether the servers run the optimizer or the workers do.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.examples import _mlp
from pskv.examples import train as tr

REPO = Path(__file__).resolve().parents[2]

STEPS = 12          # several steps: a whole epoch of 1348 samples in global batches of 120


def _flags(batch: int, update_on_kvstore: int, optimizer: str, store: str) -> list[str]:
    return ["--kv-store", store, "--quiet", "--seed", "7", "--batch-size", str(batch),
            "--max-steps", str(STEPS), "--update-on-kvstore", str(update_on_kvstore),
            "--optimizer", optimizer]


@pytest.mark.parametrize("workers, servers, optimizer, update_on_kvstore", [
    (2, 1, "sgd", 1),
    (2, 1, "sgd", 0),
    (2, 2, "adam", 1),
    (2, 2, "adam", 0),
    (3, 2, "nag", 1),
])
def test_dist_sync_equals_one_process_with_the_global_batch(
        run_threads: Callable[..., dict[int, Any]], workers: int, servers: int,
        optimizer: str, update_on_kvstore: int) -> None:
    per_worker = 40 if workers == 3 else 60
    local_args = tr.parse_args(_flags(workers * per_worker, update_on_kvstore, optimizer,
                                      "local"))
    kv = mx.kv.create("local")
    assert isinstance(kv, mx.kv.LocalKVStore)
    with kv:
        expected = tr.train(local_args, kv)
    assert expected.steps == STEPS

    dist_args = tr.parse_args(_flags(per_worker, update_on_kvstore, optimizer, "dist_sync"))
    results = run_threads(lambda kv: tr.train(dist_args, kv), workers, servers)
    assert sorted(results) == list(range(workers))
    for rank, got in results.items():
        assert isinstance(got, tr.TrainResult), got
        assert got.steps == STEPS
        for name in _mlp.PARAM_NAMES:
            np.testing.assert_allclose(got.weights[name], expected.weights[name], rtol=0,
                                       atol=1e-5, err_msg=f"rank {rank}: {name}")
        # the weights moved: the comparison is not of two initializations
        assert not np.allclose(got.weights["fc1_weight"],
                               _mlp.init_params(64, 128, 10, 7)["fc1_weight"], atol=1e-3)
        assert got.history[-1].accuracy == pytest.approx(expected.history[-1].accuracy)


def test_rank_0_initialization_wins(run_threads: Callable[..., dict[int, Any]]) -> None:
    # each worker draws its own initial weights (seed + rank); one step of lr ~0 later all
    # hold rank 0's, which are one process's
    flags = ["--quiet", "--max-steps", "1", "--lr", "1e-30", "--seed", "5"]
    results = run_threads(lambda kv: tr.train(tr.parse_args(flags), kv), 2, 1)
    init = _mlp.init_params(64, 128, 10, 5)
    for got in results.values():
        assert isinstance(got, tr.TrainResult), got
        np.testing.assert_array_equal(got.weights["fc1_weight"], init["fc1_weight"])


def _launch(store: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "1", "--timeout", "100",
         sys.executable, "-m", "pskv.examples.train", "--kv-store", store, *flags],
        capture_output=True, text=True, timeout=110, cwd=REPO, check=False)


def _accuracies(stdout: str) -> list[float]:
    return [float(a) for a in re.findall(r"rank \d of 2 done: test accuracy ([0-9.]+)",
                                         stdout)]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_cli_dist_sync_under_the_launcher() -> None:
    proc = _launch("dist_sync", "--epochs", "1", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 2, proc.stdout
    assert accuracies[0] == accuracies[1] > 0.85, proc.stdout   # sync: the same weights


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_cli_dist_async_learns() -> None:
    proc = _launch("dist_async", "--epochs", "2", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 2, proc.stdout
    assert min(accuracies) > 0.85, proc.stdout
