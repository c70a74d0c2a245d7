"""Every local example and the tour run once (the dist examples: tests/dist)."""
from __future__ import annotations

import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from pskv import tour

ROOT = Path(__file__).resolve().parents[2]


def _main(name: str) -> object:
    return importlib.import_module(f"pskv.examples.{name}").main


@pytest.mark.parametrize("name", ["quickstart_local", "custom_store"])
def test_local_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(name)() == 0  # type: ignore[operator]
    assert capsys.readouterr().out


def test_quickstart_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    _main("quickstart_local")()  # type: ignore[operator]
    # SGD momentum 0.9, lr 0.1, summed gradient 1: 1 - 0.1, - 0.19, - 0.271
    assert capsys.readouterr().out.split()[-1] == "0.4390"


def test_custom_store_runs_twice_without_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    main = _main("custom_store")
    assert main() == 0 and main() == 0  # type: ignore[operator]
    assert capsys.readouterr().out.count("averagingstore: [2. 2.] [2. 2.]") == 2


def test_dist_example_without_the_launcher_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main("dist_sync_sgd")() == 2  # type: ignore[operator]
    assert "pskv-launch" in capsys.readouterr().err


def test_examples_live_in_the_package_alone() -> None:
    # one location: python -m pskv.examples.NAME works after pip install
    assert not (ROOT / "examples").exists()
    for name in ("quickstart_local", "dist_sync_sgd", "custom_store", "train", "train_torch",
                 "sparse_logreg", "train_ctr", "train_ctr_torch"):
        assert (ROOT / "src" / "pskv" / "examples" / f"{name}.py").is_file(), name


@pytest.mark.timeout(60)
def test_quickstart_runs_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "pskv.examples.quickstart_local"],
                          capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "step 3: weight[0, 0] = 0.4390"


def test_tour_prints_the_tutorial_results() -> None:
    out = io.StringIO()
    tour.run_tour(out)
    text = out.getvalue()
    assert "update on key: 3" in text
    assert "[[4. 4. 4.]\n [4. 4. 4.]]" in text          # pushed from 4 devices
    assert "[[11. 11. 11.]\n [11. 11. 11.]]" in text    # keys 5, 7, 9 after 4 devices
    assert "array([[-0.3, -0.3, -0.3]," in text         # the notebook's -0.1 x 3
    assert "[[3.05 3.05 3.05]" in text
    # float32 values as NumPy prints them, the way the tutorial shows them
    assert "0000" not in text and "9999" not in text, text
    assert "step 1: weight\n[[-0.1 -0.1]\n [-0.1 -0.1]]" in text
    assert "step 3: weight\n[[-0.561 -0.561]" in text
    assert "ones from 3 cpus; a\n[[3. 3. 3.]\n [3. 3. 3.]]" in text
    assert tour.main([]) == 0
