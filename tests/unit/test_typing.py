"""The public store API is typed: the README's first snippet passes ``mypy --strict``."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' installs it)")
    path = tmp_path / "snippet.py"
    path.write_text(source)
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), str(path)],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)


@pytest.mark.timeout(300)
def test_readme_snippet_and_pull_results_are_typed(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    probe = ("\nreveal_type(kv)\nreveal_type(kv.pull(3))\nreveal_type(kv.pull([3]))\n"
             "reveal_type(kv.pull(3, out=a))\n")
    done = _mypy(tmp_path, blocks[0] + probe)
    lines = done.stdout.splitlines()
    errors = [line for line in lines if ": error:" in line]
    assert not errors, done.stdout
    revealed = [line.split("Revealed type is ", 1)[1].replace("builtins.", "")
                for line in lines if "Revealed type is" in line]
    assert revealed == ['"pskv.kvstore.base.KVStoreBase"', '"pskv._types.Array"',
                        '"list[pskv._types.Array]"', '"None"'], done.stdout
