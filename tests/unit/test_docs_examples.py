"""Every Python example in the README and docs/*.md runs as written.

Each ```` ```python ```` block is a whole program (a reader copies it into a file). How it runs
is said by an HTML comment on the line above its fence, invisible in the rendered page:

* no comment: it runs in this process (``exec``, in a fresh namespace and an empty current
  folder); blocks that ``import torch`` skip without torch, saying how to install it.
* ``<!-- example: launch -n 2 -s 1 -->``: it is a worker program, written to a file and run
  by the real ``pskv-launch`` with those flags (marked ``dist``: DIST_IN_UNIT).
* ``<!-- example: cuda -->``: it needs a CUDA device (skips without one, saying so).
* ``<!-- example: fragment -->``: one call shown in the context of the example above it; it
  must still compile, and there may be few of them (``MAX_FRAGMENTS``).

A block that fails here is a broken example in the docs: mend the example, not the test.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: the most fragments the docs may hold; a new example should be a whole program
MAX_FRAGMENTS = 4

_BLOCK = re.compile(r"(?:^<!-- example: (?P<how>[^>]*?) -->\n)?^```python\n(?P<code>.*?)^```",
                    flags=re.M | re.S)


@dataclass(frozen=True)
class Example:
    """One ```python block: where it is, how it runs, its code."""

    page: str
    line: int
    how: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    """Every ```python block of the README and docs/*.md, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            found.append(Example(str(page.relative_to(REPO)), line, (m["how"] or "run").strip(),
                                 m["code"]))
    return found


def _of(kind: str) -> list[Example]:
    return [e for e in examples() if e.how.split()[0] == kind]


def _needs_torch(example: Example) -> None:
    if re.search(r"^\s*import .*\btorch\b|^\s*from torch\b", example.code, flags=re.M) and \
            importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: pip install -e '.[torch]' (on these machines pip "
                    "install torch==2.13.0 first) to run this example")


def test_every_example_says_how_it_runs() -> None:
    kinds = {e.id: e.how.split()[0] for e in examples()}
    assert kinds, "no ```python block found in the README or docs"
    unknown = {i: k for i, k in kinds.items() if k not in ("run", "launch", "cuda", "fragment")}
    assert not unknown, f"unknown example kinds (run, launch, cuda, fragment): {unknown}"
    fragments = [e.id for e in _of("fragment")]
    assert len(fragments) <= MAX_FRAGMENTS, (
        f"{len(fragments)} fragments {fragments}: write whole programs instead")
    for e in examples():
        compile(e.code, e.id, "exec")      # a fragment or a CUDA-only block still compiles


@pytest.mark.parametrize("example", _of("run"), ids=lambda e: e.id)
def test_example_runs_as_written(example: Example, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_torch(example)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__main__"}
    exec(compile(example.code, example.id, "exec"), scope)  # noqa: S102 - our own docs


@pytest.mark.parametrize("example", _of("launch"), ids=lambda e: e.id)
def test_launched_example_runs_as_written(example: Example, tmp_path: Path) -> None:
    _needs_torch(example)
    script = tmp_path / "example.py"
    script.write_text(example.code)
    flags = example.how.split()[1:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "pskv.launch", *flags, "--timeout", "240", sys.executable,
         str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:                  # the launcher's own --timeout failed us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, (
        f"{example.id} under pskv-launch {' '.join(flags)}:\n{out[-4000:]}")


@pytest.mark.parametrize("example", _of("cuda"), ids=lambda e: e.id)
def test_cuda_example_runs_as_written(example: Example, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e "
                                                "'.[torch]' to run the CUDA examples")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA examples run on a machine with one (tests/gpu)")
    monkeypatch.chdir(tmp_path)
    exec(compile(example.code, example.id, "exec"), {"__name__": "__main__"})  # noqa: S102
