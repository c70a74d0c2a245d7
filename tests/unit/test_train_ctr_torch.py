"""The CTR example in PyTorch on a local store (issue #29, item 2): its table trained by its
own row optimizer, its MLP by a torch optimizer through DistributedOptimizer, on a store
without an optimizer (dist stores: tests/dist/test_train_ctr_torch_dist.py)."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
from pskv.examples import train_ctr as tc  # noqa: E402
from pskv.examples import train_ctr_torch as tt  # noqa: E402

SMALL = ["--samples-per-day", "25000", "--epochs", "3", "--capacity", "1000"]


def test_auc_near_its_ceiling_and_near_the_numpy_example() -> None:
    args = tt.parse_args(SMALL)
    kv: Any = mx.kv.create("local")
    res = tt.train(args, kv)
    assert kv._engine.updater is None                 # the store has no optimizer
    hist = res["history"]
    assert len(hist) == 3
    assert hist[-1]["ceiling_auc"] - hist[-1]["test_auc"] < 0.03, hist
    for h in hist:
        assert h["ceiling_auc"] - h["test_auc"] < 0.06, h
        assert h["rows"] <= args.capacity, h
    numpy_last = tc.train(tc.parse_args(SMALL), mx.kv.create("local"))["history"][-1]
    assert abs(hist[-1]["test_auc"] - numpy_last["test_auc"]) < 0.01, (hist, numpy_last)
    last = hist[-1]
    assert last["evictions"] > 0 and last["refusals"] > last["inserts"] > args.capacity


def test_the_command_line_prints_the_lines_of_train_ctr(capsys: Any) -> None:
    assert tt.main(SMALL + ["--epochs", "1", "--max-steps", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CTR model in torch on a synthetic click log: local, 1 worker")
    assert out[1].startswith("epoch 1/1: loss ") and "table " in out[1], out
    assert out[-1].startswith("rank 0 of 1 done: test auc "), out


def test_plot_writes_the_curves(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the examples extra)")
    path = tmp_path / "ctr.png"
    assert tt.main(SMALL + ["--epochs", "1", "--max-steps", "10", "--quiet",
                            "--plot", str(path)]) == 0
    assert path.stat().st_size > 0


def test_bad_flags_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        tt.parse_args(["--capacity", "0"])
    assert info.value.code == 2
