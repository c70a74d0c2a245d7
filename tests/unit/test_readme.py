"""The README: its Python example runs and does what its comments say, its commands name real
modules, and every link or path it names is a file of this repository."""
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


REPO = README.parent
#: top-level folders of the repository a README path may start with
REPO_DIRS = ("docs/", "tests/", "src/", "examples/", "benchmarks/", ".ci/")


def _inside_repo(target: str) -> Path | None:
    """The path ``target`` names, if it is inside the repository; else None."""
    path = (REPO / target.split("#", 1)[0]).resolve()
    try:
        path.relative_to(REPO.resolve())
    except ValueError:
        return None
    return path


def test_readme_links_point_inside_the_repository() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text,
                                                              flags=re.M)
    links += re.findall(r"""href=["']([^"']+)""", text)
    for target in links:
        assert not re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I), (
            f"README links to {target}: point at a file in the repository instead")
        path = _inside_repo(target)
        assert path is not None, f"README links to {target}, outside the repository"
        assert path.exists(), f"README links to {target}, which does not exist"


def test_readme_paths_exist_in_the_repository() -> None:
    """Paths written as code (`docs/env.md`, `../x`) name files of this repository."""
    for token in set(re.findall(r"`([^`\s]+)`", README.read_text())):
        if token.startswith(("../", "/", "~")):
            raise AssertionError(f"README names {token}, outside the repository")
        if token.startswith(REPO_DIRS):
            path = _inside_repo(token)
            assert path is not None and path.exists(), f"README names {token}: no such file"


#: a child python that hides torch (``import torch`` raises ImportError, find_spec answers
#: None) and then runs pytest with the arguments it is given
_WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; import pytest; "
                  "sys.exit(pytest.main(sys.argv[1:]))")


def test_the_readme_test_command_collects_without_torch() -> None:
    """The README's test command installs only the test extras (no torch): collecting the
    whole tree, docstring examples of pskv.torch included, must not fail, and the run's
    header says how to install torch."""
    import subprocess
    import sys
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, "--collect-only", "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "error" not in out.splitlines()[-1], out[-3000:]
    assert "torch is not installed: pip install -e '.[torch]'" in out
    assert re.search(r"\d+ tests collected", out.splitlines()[-1]), out[-500:]


def test_pskv_torch_doctests_skip_without_torch() -> None:
    """Without torch, the pskv.torch docstring examples are skipped with the advice (not
    failed on ``import torch``); the rest of pskv's run."""
    import subprocess
    import sys
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, "-q", "-rs", "-p", "no:cacheprovider",
         "src/pskv/torch", "src/pskv/table"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"SKIPPED \[\d+\] .*torch is not installed", out), out[-3000:]
    assert re.search(r"\d+ passed, \d+ skipped", out.splitlines()[-1]), out[-500:]


def test_readme_says_how_long_the_suite_takes_and_names_a_quick_subset() -> None:
    """A newcomer learns what the full run costs and which subset answers in about a
    minute; the subset is a marker expression over markers the suite declares."""
    text = README.read_text()
    tests = text[text.index("## Tests"):text.index("## Benchmarks")]
    assert re.search(r"whole suite takes about \d+ minutes on 2 cores", tests), tests[:600]
    quick = re.search(r'python -m pytest -m "([^"]+)"\s+# quick', tests)
    assert quick, "the README names no quick subset"
    declared = {m.split(":")[0] for m in re.findall(r'^\s*"(\w+):', (REPO / "pyproject.toml")
                                                    .read_text(), flags=re.M)}
    used = set(re.findall(r"[a-z]+", quick.group(1))) - {"not", "and", "or"}
    assert used and used <= declared, (used, declared)
