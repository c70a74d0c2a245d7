"""The sparse logistic-regression example on a local store (the dist runs: tests/dist)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.examples import sparse_logreg as sl

SMALL = ["--vocab", "4096", "--features-per-sample", "8", "--samples", "5000",
         "--batch-size", "100", "--epochs", "3"]


def _args(*extra: str) -> Any:
    return sl.parse_args(SMALL + list(extra))


def _table(kv: Any, vocab: int) -> np.ndarray:
    out: Any = mx.nd.sparse.zeros("row_sparse", (vocab, 1))
    kv.row_sparse_pull("w", out=out, row_ids=mx.nd.array(np.arange(vocab)))
    return np.asarray(out.data.asnumpy())


def test_loss_falls_across_epochs() -> None:
    args = _args()
    res = sl.train(args, mx.kv.create("local"))
    hist = res["history"]
    train = [h["train_loss"] for h in hist]
    test = [h["test_loss"] for h in hist]
    assert len(hist) == 3
    assert train[0] > train[1] > train[2], train
    assert test[-1] < test[0] < np.log(2.0), test        # below the all-zero model's loss
    assert hist[-1]["test_auc"] > 0.7, hist
    assert res["steps"] == 3 * 40 and res["samples"] == 3 * 4000
    assert res["rows_pulled"] == res["rows_pushed"] > 0
    assert res["samples_per_s"] > 0 and res["rows_pulled_per_s"] > 0


def test_only_the_rows_of_a_batch_travel() -> None:
    args = _args("--epochs", "1")
    data = sl.make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    kv: Any = mx.kv.create("local")
    pulls: list[tuple[np.ndarray, np.ndarray]] = []
    pushes: list[np.ndarray] = []
    rsp_pull, push = kv.row_sparse_pull, kv.push

    def spy_pull(key: Any, out: Any = None, priority: int = 0, row_ids: Any = None) -> None:
        rsp_pull(key, out=out, priority=priority, row_ids=row_ids)
        pulls.append((np.asarray(row_ids.asnumpy()), out.indices.asnumpy().copy()))

    def spy_push(key: Any, value: Any, priority: int = 0) -> None:
        if key == "w":
            assert value.stype == "row_sparse"
            pushes.append(value.indices.asnumpy().copy())
        push(key, value, priority)

    kv.row_sparse_pull, kv.push = spy_pull, spy_push
    res = sl.train(args, kv)
    batches = list(sl.batch_order(len(data.train_y), args.batch_size, args.seed, 0))
    train_pulls = pulls[:len(batches)]               # then the test-set evaluation
    assert len(pushes) == len(batches) == res["steps"]
    for batch, (asked, got), pushed in zip(batches, train_pulls, pushes, strict=True):
        want = np.unique(data.train_ids[batch])
        assert len(want) < args.vocab // 4              # a small part of the table
        np.testing.assert_array_equal(asked, want)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(pushed, want)
    assert res["rows_pulled"] == sum(len(g) for _, g in train_pulls)
    np.testing.assert_array_equal(pulls[len(batches)][1], np.unique(data.test_ids))


def test_rows_never_seen_keep_their_initial_value() -> None:
    args = _args("--init-scale", "0.01", "--epochs", "2")
    data = sl.make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    kv: Any = mx.kv.create("local")
    sl.train(args, kv)
    init = sl.init_table(args.vocab, args.init_scale, args.seed)
    table = _table(kv, args.vocab)
    seen = np.zeros(args.vocab, bool)
    seen[np.unique(data.train_ids)] = True
    assert 0 < seen.sum() < args.vocab
    np.testing.assert_array_equal(table[~seen], init[~seen])   # lazy: untouched, bit for bit
    assert np.all(table[seen] != init[seen])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "ftrl"])
def test_one_step_matches_numpy(optimizer: str) -> None:
    args = _args("--optimizer", optimizer, "--lr", "0.5", "--init-scale", "0.01",
                 "--max-steps", "1")
    data = sl.make_data(args.vocab, args.features_per_sample, args.samples, args.seed)
    kv: Any = mx.kv.create("local")
    res = sl.train(args, kv)
    assert res["steps"] == 1
    # a NumPy oracle for the first batch, written out independently of shard_grad
    batch = next(sl.batch_order(len(data.train_y), args.batch_size, args.seed, 0))
    ids, y = data.train_ids[batch], data.train_y[batch].astype(np.float64)
    w0 = sl.init_table(args.vocab, args.init_scale, args.seed)[:, 0].astype(np.float64)
    logit = w0[ids].sum(axis=1)                                  # bias starts at 0
    resid = 1.0 / (1.0 + np.exp(-logit)) - y
    g = np.zeros(args.vocab)
    np.add.at(g, ids, np.repeat(resid[:, None], ids.shape[1], axis=1))
    g /= len(batch)
    rows = np.unique(ids)
    lr = 0.5
    want = w0.copy()
    if optimizer == "sgd":
        want[rows] -= lr * g[rows]
    elif optimizer == "adagrad":
        want[rows] -= lr * g[rows] / np.sqrt(g[rows] ** 2 + 1e-7)
    else:   # ftrl from z = n = 0, lamda1 = 0, beta = 1: w = -z / ((beta + sqrt(n)) / lr)
        z = g[rows] - (np.abs(g[rows]) - 0.0) * w0[rows] / lr
        want[rows] = -z / ((1.0 + np.abs(g[rows])) / lr) * (np.abs(z) > 0)
    table = _table(kv, args.vocab)[:, 0]
    np.testing.assert_allclose(table, want, rtol=1e-5, atol=1e-7)
    b = kv.pull("b").asnumpy()[0]
    gb = resid.sum() / len(batch)
    want_b = {"sgd": -lr * gb, "adagrad": -lr * gb / np.sqrt(gb * gb + 1e-7),
              "ftrl": -gb / ((1.0 + abs(gb)) / lr)}[optimizer]
    assert b == pytest.approx(want_b, rel=1e-5)


def test_shard_grad_is_the_loss_gradient() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, size=(12, 4))
    y = rng.integers(0, 2, size=12).astype(np.float32)
    rows = np.unique(ids)
    w = rng.normal(size=(len(rows), 1)).astype(np.float64)

    def loss(w: np.ndarray, b: float) -> float:
        logit = w[np.searchsorted(rows, ids), 0].sum(1) + b
        return float(sl.logistic_loss(logit, y).sum())

    g, gb, total = sl.shard_grad(ids, y, rows, w, 0.3, 1.0)
    assert total == pytest.approx(loss(w, 0.3))
    eps = 1e-6
    for i in range(len(rows)):
        d = np.zeros_like(w)
        d[i] = eps
        assert g[i, 0] == pytest.approx((loss(w + d, 0.3) - loss(w - d, 0.3)) / (2 * eps),
                                        rel=1e-4, abs=1e-6)
    assert gb == pytest.approx((loss(w, 0.3 + eps) - loss(w, 0.3 - eps)) / (2 * eps), rel=1e-4)


def test_auc_matches_pair_counting() -> None:
    rng = np.random.default_rng(0)
    score = rng.integers(0, 5, size=200).astype(np.float64)      # many ties
    y = rng.integers(0, 2, size=200).astype(np.float64)
    pos, neg = score[y == 1], score[y == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert sl.auc(score, y) == pytest.approx(pairs / (len(pos) * len(neg)))
    assert np.isnan(sl.auc(score, np.ones(200)))


def test_data_follows_the_seed() -> None:
    a = sl.make_data(1000, 5, 300, seed=7)
    b = sl.make_data(1000, 5, 300, seed=7)
    c = sl.make_data(1000, 5, 300, seed=8)
    np.testing.assert_array_equal(a.train_ids, b.train_ids)
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert not np.array_equal(a.train_ids, c.train_ids)
    assert a.train_ids.min() >= 0 and a.train_ids.max() < 1000
    assert 0.1 < a.train_y.mean() < 0.9


def test_main_prints_loss_and_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    assert sl.main(SMALL + ["--epochs", "2", "--optimizer", "ftrl"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "local, 1 worker, " in lines[0] and "batch 100 per worker" in lines[0]
    epochs = [ln for ln in lines if ": loss" in ln]
    assert [ln.split(":")[0] for ln in epochs] == ["epoch 1/2", "epoch 2/2"]
    assert all("test auc" in ln and "samples/s  push/pull" in ln for ln in epochs)
    assert lines[-1].startswith("rank 0 of 1 done: test auc ")
    assert ", 2 epochs (80 steps) in " in lines[-1] and "rows pulled/s" in lines[-1]


def test_quiet_and_plot(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auc.png"
    assert sl.main(SMALL + ["--max-steps", "1", "--quiet", "--plot", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and ", 1 epoch (1 step) in " in lines[0]
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_flags_are_the_shared_ones() -> None:
    from pskv.examples import train as tr
    from pskv.examples import train_torch as tt
    shared = {"--kv-store", "--epochs", "--batch-size", "--lr", "--seed", "--max-steps",
              "--plot", "--quiet"}

    def flags(parser: Any) -> dict[str, Any]:
        return {o: a for a in parser._actions for o in a.option_strings}

    parsers = [flags(m.build_parser()) for m in (tr, tt, sl)]
    for opts in parsers:
        assert shared <= set(opts)
        assert opts["--kv-store"].choices == parsers[0]["--kv-store"].choices
        assert "per worker" in opts["--batch-size"].help
    assert "--update-on-kvstore" in parsers[0] and "--update-on-kvstore" in parsers[1]


def test_max_steps_stops_early() -> None:
    res = sl.train(_args("--max-steps", "7"), mx.kv.create("local"))
    assert res["steps"] == 7 and len(res["history"]) == 1


def test_bad_flags_exit() -> None:
    with pytest.raises(SystemExit):
        sl.parse_args(["--vocab", "0"])
