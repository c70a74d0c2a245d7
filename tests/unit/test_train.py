"""The training example (``python -m pskv.examples.train``) on local stores."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pskv as mx
from pskv.examples import _data, _mlp, _report
from pskv.examples import train as tr

QUICK = ["--quiet", "--seed", "3"]


def run(*flags: str, store: str = "local") -> tr.TrainResult:
    args = tr.parse_args(["--kv-store", store, *QUICK, *flags])
    kv = mx.kv.create(store)
    assert isinstance(kv, mx.kv.LocalKVStore)
    with kv:
        return tr.train(args, kv)


def test_loss_falls_and_accuracy_rises() -> None:
    result = run("--epochs", "2")
    first, last = result.history
    assert result.steps == 2 * 43                   # 1348 training samples, batch 32
    assert last.loss < first.loss < 0.5
    assert last.accuracy > 0.9
    assert 0.0 <= last.comm_share <= 1.0 and last.samples_per_sec > 0
    assert set(result.weights) == set(_mlp.PARAM_NAMES)


def test_max_steps_stops_mid_epoch() -> None:
    result = run("--epochs", "5", "--max-steps", "50")
    assert result.steps == 50
    assert [s.steps for s in result.history] == [43, 7]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "nag"])
def test_update_on_kvstore_0_and_1_give_the_same_weights(optimizer: str) -> None:
    flags = ("--optimizer", optimizer, "--max-steps", "30", "--batch-size", "16")
    on_store = run(*flags, "--update-on-kvstore", "1")
    on_worker = run(*flags, "--update-on-kvstore", "0")
    for name in _mlp.PARAM_NAMES:
        np.testing.assert_allclose(on_worker.weights[name], on_store.weights[name],
                                   rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("store", ["local", "device"])
def test_devices_split_the_shard_and_the_store_sums(store: str) -> None:
    one = run("--max-steps", "20")
    three = run("--max-steps", "20", "--num-devices", "3", store=store)
    for name in _mlp.PARAM_NAMES:
        np.testing.assert_allclose(three.weights[name], one.weights[name], rtol=0,
                                   atol=1e-5, err_msg=name)


def test_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(0)
    params = {k: v.astype(np.float64) for k, v in _mlp.init_params(5, 4, 3, 0).items()}
    params["fc1_bias"] += 0.1                       # keep the ReLUs away from their kink
    x, y = rng.normal(size=(6, 5)), np.array([0, 1, 2, 0, 1, 2])
    grads, total = _mlp.gradients(params, x, y, divisor=6)
    assert total == pytest.approx(6 * _mlp.loss(params, x, y))
    eps = 1e-6
    for name, value in params.items():
        flat = value.reshape(-1)
        for i in range(0, flat.size, 3):
            old = flat[i]
            flat[i] = old + eps
            up = _mlp.loss(params, x, y)
            flat[i] = old - eps
            down = _mlp.loss(params, x, y)
            flat[i] = old
            assert grads[name].reshape(-1)[i] == pytest.approx((up - down) / (2 * eps),
                                                               abs=1e-4), name


def test_shards_cover_each_global_batch_once() -> None:
    batches = list(_data.global_batches(100, 24, seed=1, epoch=2))
    assert sorted(np.concatenate(batches).tolist()) == list(range(100))
    assert batches[0].tolist() == next(_data.global_batches(100, 24, 1, 2)).tolist()
    for batch in batches:
        parts = [_data.shard(batch, r, 3) for r in range(3)]
        assert np.concatenate(parts).tolist() == batch.tolist()


def _fast_clock(monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    """Each reading of the progress clock is ``step`` seconds after the last."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(_report, "_clock", lambda: step * next(ticks))


def test_main_prints_epochs_and_summary(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _fast_clock(monkeypatch, 0.3)                   # a progress line every 4th batch
    assert tr.main(["--epochs", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "1 worker x 1 device," in lines[0]       # no "1 worker(s)"
    assert [ln.split(":")[0] for ln in lines if ": loss" in ln] == ["epoch 1/2", "epoch 2/2"]
    assert "epoch 1/2: 4/43 batches (9%)" in lines  # progress, a plain line (not a TTY)
    assert "\r" not in out
    assert "samples/s" in out and "push/pull" in out
    assert lines[-1].startswith("rank 0 of 1 done: test accuracy 0.9")
    assert ", 2 epochs (86 steps) in " in lines[-1]


def test_progress_on_a_pipe_prints_a_line_every_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fast_clock(monkeypatch, 0.4)
    out = io.StringIO()                             # not a TTY, as under pskv-launch
    bar = _report.Progress(10, "epoch 1/3", stream=out, interval=1.0)
    for _ in range(10):
        bar.update()
    bar.close()
    # readings at 0.4 s apart: a line when 1.2, 2.4, 3.6 s have passed (the last batch: none)
    assert out.getvalue().splitlines() == ["epoch 1/3: 3/10 batches (30%)",
                                           "epoch 1/3: 6/10 batches (60%)",
                                           "epoch 1/3: 9/10 batches (90%)"]
    silent = io.StringIO()
    quiet = _report.Progress(10, "x", enabled=False, stream=silent)
    quiet.update(10)
    assert silent.getvalue() == "" and quiet.done == 10


def test_one_epoch_one_step_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    assert tr.main(["--epochs", "1", "--max-steps", "1", "--quiet"]) == 0
    line = capsys.readouterr().out.strip()
    assert ", 1 epoch (1 step) in " in line, line


@pytest.mark.timeout(60)
def test_output_through_a_pipe_is_whole_lines() -> None:
    # pskv-launch reads its workers' output through a pipe, a line at a time: a bar that
    # redraws one line with carriage returns would show only at the end of the epoch
    proc = subprocess.run([sys.executable, "-m", "pskv.examples.train", "--epochs", "1"],
                          capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr
    assert "epoch 1/1: loss" in proc.stdout


def test_quiet_prints_only_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert tr.main(["--max-steps", "3", "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 0 of 1 done:")


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "curves.png"
    assert tr.main(["--epochs", "2", "--max-steps", "60", "--quiet", "--plot",
                    str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


def test_plot_has_the_runs_settings_and_a_whole_accuracy_axis() -> None:
    history = [tr.EpochStats(e, 43, 0.3 / e, 0.966 + 0.003 * e, 1.0, 1000.0, 0.2)
               for e in (1, 2, 3)]
    title = _report.run_title("digits MLP", "dist_sync", 2, 32, 0.05, 3)
    fig = _report.make_figure([s.epoch for s in history], [s.loss for s in history],
                              "accuracy", [s.accuracy for s in history], title)
    assert fig.get_suptitle() == ("digits MLP: dist_sync, 2 workers, batch 32 per worker, "
                                  "lr 0.05, 3 epochs")
    _, ax_acc = fig.axes
    assert ax_acc.get_ylim() == (0.0, 1.0)          # not zoomed to 0.966..0.975
    assert ax_acc.get_title() == "test accuracy"


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "must be at least 1"),
    (["--batch-size", "x"], "is not an integer"),
    (["--lr", "-1"], "must be a positive number"),
    (["--momentum", "nan"], "must be zero or a positive number"),
    (["--optimizer", "nope"], "unknown optimizer 'nope'"),
    (["--kv-store", "bogus"], "invalid choice"),
    (["--update-on-kvstore", "2"], "invalid choice"),
    (["--kv-store", "dist_async", "--update-on-kvstore", "0"], "needs a synchronous store"),
])
def test_bad_flags_exit_2_with_a_message(flags: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tr.main(flags)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_dist_store_without_launcher_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert tr.main(["--kv-store", "dist_sync"]) == 2
    assert "pskv-launch" in capsys.readouterr().err


def test_lr_defaults_by_optimizer() -> None:
    assert tr.parse_args([]).lr == 0.05
    assert tr.parse_args(["--optimizer", "Adam"]).lr == 0.01
    assert tr.make_optimizer(tr.parse_args(["--optimizer", "adam"])).learning_rate == 0.01
    sgd = tr.make_optimizer(tr.parse_args(["--momentum", "0.5"]))
    assert isinstance(sgd, mx.optimizer.SGD) and sgd.momentum == 0.5


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)      # import sklearn now fails
    assert tr.main(["--quiet"]) == 2
    assert "pip install 'pskv[examples]'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_runs_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "pskv.examples.train", "--max-steps", "5",
                           "--quiet"], capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("rank 0 of 1 done:")
