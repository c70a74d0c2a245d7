"""The CTR example on a local store (the launcher runs: tests/dist/test_train_ctr_dist.py)."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.examples import _clicklog
from pskv.examples import train_ctr as tc

# a small log: 3 days of 25,000 samples (about 19,000 distinct IDs), a 1,000-row table
SMALL = ["--samples-per-day", "25000", "--epochs", "3", "--capacity", "1000"]


def _args(*extra: str) -> Any:
    return tc.parse_args(SMALL + list(extra))


def test_auc_near_its_ceiling_with_the_table_bounded() -> None:
    args = _args()
    res = tc.train(args, mx.kv.create("local"))
    hist = res["history"]
    log = _clicklog.make_log(3, 25000, seed=0)
    days = np.diff(log.train_day_bounds)
    assert len(hist) == 3 and res["steps"] == sum(-(-days // args.batch_size))
    assert res["samples"] == days.sum()
    # within a few points of what the generating model's own probabilities reach: 3 after
    # the first day (whose model starts from nothing)
    assert hist[-1]["ceiling_auc"] - hist[-1]["test_auc"] < 0.03, hist
    for h in hist:
        assert 0.7 < h["ceiling_auc"] < 0.9, h
        assert h["ceiling_auc"] - h["test_auc"] < 0.06, h
        assert h["rows"] <= args.capacity, h                # after every push's sweep
    last = hist[-1]
    assert last["rows"] == args.capacity                    # full, and held there
    assert last["evictions"] > 0 and last["refusals"] > last["inserts"] > args.capacity
    # counters only grow, and rows = inserts - evictions
    for a, b in zip(hist, hist[1:]):
        assert all(b[k] >= a[k] for k in ("inserts", "refusals", "evictions"))
    assert last["rows"] == last["inserts"] - last["evictions"]


def test_without_admission_the_one_offs_crowd_out_the_rows_that_matter() -> None:
    # the same log with every ID admitted: one-off visitors take rows and evict the
    # regular IDs' rows, so the AUC falls well below the run with CountAdmission(2)
    base = tc.train(_args(), mx.kv.create("local"))["history"][-1]
    every = tc.train(_args("--min-count", "1"), mx.kv.create("local"))["history"][-1]
    assert every["refusals"] == 0 and every["evictions"] > 10 * base["evictions"]
    assert every["test_auc"] < base["test_auc"] - 0.01, (every, base)


def test_eval_lookups_insert_nothing_and_pushes_only_found_rows() -> None:
    args = _args("--epochs", "1", "--max-steps", "5")
    kv: Any = mx.kv.create("local")
    lookups: list[tuple[bool, int]] = []
    pushes: list[tuple[np.ndarray, np.ndarray]] = []
    found_ids: list[np.ndarray] = []
    lookup, push = kv.lookup, kv.push

    def spy_lookup(key: Any, ids: Any, train: bool = True) -> Any:
        before = kv.table_stats(key)["inserts"]
        rows, found = lookup(key, ids, train)
        lookups.append((train, kv.table_stats(key)["inserts"] - before))
        if train:
            found_ids.append(np.asarray(ids)[found])
        return rows, found

    def spy_push(key: Any, value: Any, priority: int = 0) -> None:
        if key == tc.TABLE:
            pushes.append(value)
        push(key, value, priority)

    kv.lookup, kv.push = spy_lookup, spy_push
    tc.train(args, kv)
    assert [t for t, _ in lookups] == [True] * 5 + [False]
    assert lookups[-1][1] == 0                              # the eval lookup: no insert
    assert len(pushes) == 5
    for (ids, grads), found in zip(pushes, found_ids, strict=True):
        np.testing.assert_array_equal(ids, found)
        assert grads.shape == (len(ids), 1 + args.dim) and np.isfinite(grads).all()


def test_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(0)
    dense = {k: v.astype(np.float64) for k, v in tc.init_dense(3, 5, seed=1).items()}
    emb = rng.normal(0.0, 0.5, (6, 3, 4))
    y = rng.integers(0, 2, 6).astype(np.float64)

    def loss(d: dict[str, np.ndarray], e: np.ndarray) -> float:
        from pskv.examples.sparse_logreg import logistic_loss
        return float(logistic_loss(tc.forward(d, e), y).sum())

    grads, demb, total = tc.dense_gradients(dense, emb, y, 1.0)
    assert total == pytest.approx(loss(dense, emb), rel=1e-6)
    eps = 1e-6
    for idx in [(0, 0, 0), (2, 1, 2), (5, 2, 3), (3, 0, 1)]:
        d = np.zeros_like(emb)
        d[idx] = eps
        num = (loss(dense, emb + d) - loss(dense, emb - d)) / (2 * eps)
        assert demb[idx] == pytest.approx(num, rel=1e-3, abs=1e-5), idx
    for name in tc.DENSE_NAMES:
        flat = dense[name].reshape(-1)
        for i in (0, flat.size - 1):
            up = {k: v.copy() for k, v in dense.items()}
            dn = {k: v.copy() for k, v in dense.items()}
            up[name].reshape(-1)[i] += eps
            dn[name].reshape(-1)[i] -= eps
            num = (loss(up, emb) - loss(dn, emb)) / (2 * eps)
            assert grads[name].reshape(-1)[i] == pytest.approx(num, rel=1e-3, abs=1e-5)


def test_the_log_keeps_producing_new_ids() -> None:
    log = _clicklog.make_log(4, 5000, seed=3)
    again = _clicklog.make_log(4, 5000, seed=3)
    np.testing.assert_array_equal(log.train_ids, again.train_ids)   # the seed decides
    assert log.train_ids.dtype == np.int64 and (log.train_ids < 0).any()
    seen: set[int] = set()
    for d in range(log.days):
        ids = log.day(d)[0]
        for f in (0, 1):                                   # users and items churn
            new = set(np.unique(ids[:, f]).tolist()) - seen
            assert len(new) > 0.2 * len(np.unique(ids[:, f])), (d, f)
        seen |= set(ids[:, :2].ravel().tolist())
    # contexts do not churn; the eval samples come from the same days
    assert len(np.unique(log.train_ids[:, 2])) <= 50
    assert np.diff(log.eval_day_bounds).min() > 0
    assert 0.1 < log.train_y.mean() < 0.5


def test_main_prints_auc_ceiling_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert tc.main(SMALL + ["--epochs", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "local, 1 worker, 2 days of 25,000 samples" in lines[0], lines[0]
    assert "CountAdmission(2), Capacity(1,000, 'lru')" in lines[0], lines[0]
    epochs = [ln for ln in lines if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in epochs] == ["epoch 1/2", "epoch 2/2"]
    for ln in epochs:
        assert "test auc " in ln and "  ceiling 0." in ln and "/1,000 rows (" in ln, ln
        assert " refused, " in ln and " evicted)" in ln, ln
    assert lines[-1].startswith("rank 0 of 1 done: test auc "), lines[-1]
    assert ", ceiling 0." in lines[-1] and " rows" in lines[-1]


def test_plot_writes_an_image(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: "
                                             "pip install 'pskv[examples]'")
    path = tmp_path / "ctr.png"
    assert tc.main(SMALL + ["--epochs", "2", "--quiet", "--plot", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"curves in {path}" in out[0]
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags, words", [
    (["--capacity", "0"], "--capacity: '0' must be at least 1"),
    (["--capacity", "-5"], "--capacity: '-5' must be at least 1"),
    (["--min-count", "0"], "--min-count: '0' must be at least 1"),
    (["--samples-per-day", "x"], "--samples-per-day: 'x' is not an integer"),
    (["--eviction", "fifo"], "--eviction: invalid choice: 'fifo'"),
    (["--dim", "0"], "--dim: '0' must be at least 1"),
    (["--staleness", "-1"], "--staleness: '-1' must be at least 0"),
    (["--staleness", "1.5"], "--staleness: '1.5' is not a whole number or 'none'"),
    (["--global-staleness", "-2"], "--global-staleness: '-2' must be at least 0"),
    (["--table-dtype", "int8"], "--table-dtype: invalid choice: 'int8'"),
    (["--cache-rows", "-1"], "--cache-rows: '-1' must be at least 0"),
    (["--cache-pushes", "x"], "--cache-pushes: 'x' is not a whole number"),
])
def test_bad_flags_exit_2_with_a_message(flags: list[str], words: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tc.parse_args(flags)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flags, want, words", [
    ([], (2, None), "staleness bound 2;"),
    (["--staleness", "0", "--global-staleness", "3"], (0, 3),
     "staleness bound 0, global bound 3;"),
    (["--staleness", "none"], (None, None), "no staleness bound;"),
])
def test_staleness_flags_set_the_bounds(flags: list[str], want: tuple[Any, Any],
                                         words: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[Any, Any]] = []
    real = mx.kv.create

    def create(name: str) -> Any:
        kv: Any = real(name)
        set_staleness = kv.set_staleness

        def spy(bound: Any, *, global_bound: Any = None) -> None:
            calls.append((bound, global_bound))
            set_staleness(bound, global_bound=global_bound)
        kv.set_staleness = spy
        return kv

    monkeypatch.setattr(mx.kv, "create", create)
    assert tc.main(["--samples-per-day", "2000", "--epochs", "1", "--capacity", "100",
                    *flags]) == 0
    assert calls == [want]                                  # once, before any push
    assert words in capsys.readouterr().out.splitlines()[0]


def test_cache_flags_set_the_table_cache(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--cache-rows N calls kv.set_table_cache once (a local store records it: the AUC
    is the uncached one); --cache-rows 0 (the default) does not call it."""
    calls: list[tuple[Any, ...]] = []
    real = mx.kv.create

    def create(name: str) -> Any:
        kv: Any = real(name)
        set_cache = kv.set_table_cache

        def spy(key: Any, rows: Any, *, max_pushes: Any = 1) -> None:
            calls.append((key, rows, max_pushes))
            set_cache(key, rows, max_pushes=max_pushes)
        kv.set_table_cache = spy
        return kv

    monkeypatch.setattr(mx.kv, "create", create)
    small = ["--samples-per-day", "2000", "--epochs", "1", "--capacity", "100", "--quiet"]
    assert tc.main(small + ["--cache-rows", "20", "--cache-pushes", "0"]) == 0
    assert calls == [(tc.TABLE, 20, 0)]
    with_cache = capsys.readouterr().out
    assert tc.main(small) == 0
    assert len(calls) == 1
    without = capsys.readouterr().out
    auc = re.compile(r"test auc (0\.\d+)")
    assert auc.findall(with_cache) == auc.findall(without)


def test_numpy_alone_is_enough(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # without the examples extra: a terminal gets plain progress lines, not a tqdm bar,
    # and --plot is refused before any training, naming what to install
    import io

    from pskv.examples import _report
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    ticks = iter(range(100))
    monkeypatch.setattr(_report, "_clock", lambda: float(next(ticks)))
    stream = Tty()
    bar = _report.Progress(3, "epoch 1/1", stream=stream)
    bar.update()
    bar.close()
    assert stream.getvalue() == "epoch 1/1: 1/3 batches (33%)\n"
    assert tc.main(SMALL + ["--plot", "x.png"]) == 2
    out = capsys.readouterr()
    assert "pip install 'pskv[examples]'" in out.err and out.out == ""
    assert tc.main(["--samples-per-day", "2000", "--epochs", "1", "--capacity", "100",
                    "--quiet"]) == 0


def test_flags_are_the_shared_ones() -> None:
    from pskv.examples import train as tr

    def flags(parser: Any) -> dict[str, Any]:
        return {o: a for a in parser._actions for o in a.option_strings}

    mine, theirs = flags(tc.build_parser()), flags(tr.build_parser())
    for f in ("--kv-store", "--epochs", "--batch-size", "--lr", "--seed", "--max-steps",
              "--plot", "--quiet"):
        assert mine[f].help.split("(")[0] == theirs[f].help.split("(")[0], f
    assert mine["--kv-store"].choices == theirs["--kv-store"].choices
    assert "--update-on-kvstore" not in mine            # the servers run the optimizer


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_table_stores_half_the_bytes_and_keeps_the_auc(
        dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--table-dtype (R17): the rows stored in 2 bytes, the AUC within 0.002 of float32."""
    assert tc.table_spec(_args()).dtype == "float32"
    assert tc.table_spec(_args("--table-dtype", dtype)).dtype == dtype
    base = tc.train(_args(), mx.kv.create("local"))["history"][-1]
    kv: Any = mx.kv.create("local")
    half = tc.train(_args("--table-dtype", dtype), kv)["history"][-1]
    assert abs(half["test_auc"] - base["test_auc"]) < 0.002, (half, base)
    assert kv._tables.tables[tc.TABLE]._values.itemsize == 2
    assert tc.main(SMALL + ["--epochs", "1", "--max-steps", "3", "--table-dtype", dtype]) == 0
    assert f"table: dim 8 {dtype}, CountAdmission" in capsys.readouterr().out


def test_max_steps_stops_early() -> None:
    res = tc.train(_args("--max-steps", "7"), mx.kv.create("local"))
    assert res["steps"] == 7 and len(res["history"]) == 1


def test_dist_store_without_the_launcher_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert tc.main(["--kv-store", "dist_async", "--samples-per-day", "1000"]) == 2
    assert "pskv-launch" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_runs_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "pskv.examples.train_ctr", "--quiet",
                           "--samples-per-day", "5000", "--epochs", "2", "--capacity", "200"],
                          capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("rank 0 of 1 done: test auc "), proc.stdout
