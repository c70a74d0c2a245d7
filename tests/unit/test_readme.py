"""The README's Python example runs and does what its comments say."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    scope: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 - our own README
    a = scope["a"]
    np.testing.assert_array_equal(a.asnumpy(), np.full((2, 3), 4.0))  # type: ignore[attr-defined]
    kv = scope["kv"]
    # SGD lr 0.1 momentum 0.9 on a gradient of ones, from a stored 4
    np.testing.assert_allclose(kv.pull(3).asnumpy(), np.full((2, 3), 3.9))  # type: ignore[attr-defined]


def test_readme_commands_name_real_modules() -> None:
    text = README.read_text()
    for module in set(re.findall(r"python3? -m (pskv[\w.]*)", text)):
        path = Path(__file__).resolve().parents[2] / "src" / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module
