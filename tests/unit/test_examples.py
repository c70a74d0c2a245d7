"""Every local example and the tour run once (the dist example: tests/dist)."""
from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from pskv import tour

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["quickstart_local", "custom_store"])
def test_local_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _load(name).main() == 0  # type: ignore[attr-defined]
    assert capsys.readouterr().out


def test_quickstart_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    _load("quickstart_local").main()  # type: ignore[attr-defined]
    # SGD momentum 0.9, lr 0.1, summed gradient 1: 1 - 0.1, - 0.19, - 0.271
    assert capsys.readouterr().out.split()[-1] == "0.4390"


def test_tour_prints_the_tutorial_results() -> None:
    out = io.StringIO()
    tour.run_tour(out)
    text = out.getvalue()
    assert "update on key: 3" in text
    assert "[[4. 4. 4.]\n [4. 4. 4.]]" in text          # pushed from 4 devices
    assert "[[11. 11. 11.]\n [11. 11. 11.]]" in text    # keys 5, 7, 9 after 4 devices
    assert "array([[-0.3, -0.3, -0.3]," in text         # the notebook's -0.1 x 3
    assert "[[3.05 3.05 3.05]" in text
    assert tour.main([]) == 0
