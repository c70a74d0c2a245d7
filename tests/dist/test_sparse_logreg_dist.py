"""The sparse logistic-regression example on a parameter server: 2 workers x 2 servers."""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.examples import sparse_logreg as sl

# 8001 train samples in global batches of 100 (2 workers x 50): the last global batch has
# one sample, so one worker's shard is empty there and it pushes a row_sparse gradient
# with no rows
SMALL = ["--vocab", "8192", "--features-per-sample", "8", "--samples", "10001",
         "--batch-size", "50", "--epochs", "3"]


def _table(kv: Any, vocab: int) -> tuple[np.ndarray, float]:
    out: Any = mx.nd.sparse.zeros("row_sparse", (vocab, 1))
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array(np.arange(vocab)))
    return np.array(out.data.asnumpy()), float(kv.pull("b").asnumpy()[0])


def _run(kv: Any, args: Any) -> dict[str, Any]:
    res = sl.train(args, kv)
    res["segments"] = list(getattr(kv._store["w"], "segments", []))   # dist stores only
    res["table"], res["bias"] = _table(kv, args.vocab)
    return res


def test_sync_sgd_matches_one_local_run(run_threads: Callable[..., dict[int, Any]]) -> None:
    args = sl.parse_args(SMALL + ["--optimizer", "sgd", "--lr", "0.5", "--init-scale", "0.01"])
    results = run_threads(lambda kv: _run(kv, args), num_workers=2, num_servers=2)
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
    # --batch-size is per worker: one process with batch 2 x 50 takes the same steps
    local = _run(mx.kv.create("local"), sl.parse_args(
        SMALL + ["--optimizer", "sgd", "--lr", "0.5", "--init-scale", "0.01",
                 "--batch-size", "100"]))
    # the table's rows are split across both servers
    segs = results[0]["segments"]
    assert [s.server for s in segs] == [0, 1]
    assert segs[0].start == 0 and segs[0].stop == segs[1].start and segs[1].stop == args.vocab
    data = sl.make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    rows = np.unique(data.train_ids)
    assert (rows < segs[0].stop).any() and (rows >= segs[1].start).any()
    for rank in (0, 1):
        r = results[rank]
        np.testing.assert_allclose(r["table"], local["table"], rtol=1e-5, atol=1e-6)
        assert r["bias"] == pytest.approx(local["bias"], rel=1e-5)
        assert r["steps"] == local["steps"] == 3 * 81
        assert r["samples"] + results[1 - rank]["samples"] == local["samples"]
        assert r["samples"] == 3 * (4001 if rank == 0 else 4000)   # rank 1: an empty shard
        # every worker evaluates the whole test set on the same weights
        for hd, hl in zip(r["history"], local["history"], strict=True):
            assert hd["test_loss"] == pytest.approx(hl["test_loss"], rel=1e-5)
        train = [h["train_loss"] for h in r["history"]]
        assert train[0] > train[1] > train[2], train
    test = [h["test_loss"] for h in results[0]["history"]]
    assert test[-1] < test[0] < np.log(2.0), test
    # each worker pulled only its shards' rows: together about what the local run pulled
    pulled = results[0]["rows_pulled"] + results[1]["rows_pulled"]
    assert local["rows_pulled"] <= pulled < 2 * local["rows_pulled"]


def test_async_adagrad_learns(run_threads: Callable[..., dict[int, Any]]) -> None:
    args = sl.parse_args(SMALL + ["--optimizer", "adagrad"])
    results = run_threads(lambda kv: sl.train(args, kv), num_workers=2, num_servers=2,
                          store_type="dist_async")
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
        test = [h["test_loss"] for h in r["history"]]
        assert test[-1] < test[0] < np.log(2.0), test
        assert r["history"][-1]["test_auc"] > 0.7


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_cli_under_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "2", "--timeout", "150",
         sys.executable, "-m", "pskv.examples.sparse_logreg", "--kv-store", "dist_sync",
         "--vocab", "65536", "--samples", "20000", "--epochs", "2", "--max-steps", "40"],
        capture_output=True, text=True, timeout=170)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(": loss") == 2, out             # rank 0: one line per epoch
    assert "epoch 2/2: loss" in out, out
    assert out.count("rows pulled/s") == 2, out      # every worker: its final line
    assert out.count(" of 2 done: test auc ") == 2, out
    assert "dist_sync, 2 workers, " in out, out
