"""The test suite's own rules: markers follow folders, and skip reasons say what is missing
and how to get it (not an issue number)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SKIP_CALLS = {"skip", "skipif", "importorskip", "xfail"}


def test_collected_tests_carry_their_folder_marker(request: pytest.FixtureRequest) -> None:
    """Whatever this session collected: tests/dist is marked dist, tests/mxnet mxnet."""
    checked = 0
    for item in request.session.items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if folder in ("dist", "mxnet"):
            assert item.get_closest_marker(folder) is not None, item.nodeid
            checked += 1
    # this test itself is in tests/unit: nothing else to see when run alone
    assert checked or all("tests/dist" not in i.nodeid and "tests/mxnet" not in i.nodeid
                          for i in request.session.items)


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _strings(node: ast.AST, constants: dict[str, str]) -> str:
    """The text of every string literal under ``node`` (module-level str constants too)."""
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.append(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in constants:
            out.append(constants[sub.id])
    return " ".join(out)


def _skip_reasons() -> list[tuple[str, str]]:
    reasons = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        constants = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                constants[node.targets[0].id] = _strings(node.value, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in SKIP_CALLS:
                where = f"{path.relative_to(TESTS)}:{node.lineno}"
                parts = [kw.value for kw in node.keywords if kw.arg in ("reason", "msg")]
                if _call_name(node) == "skip":
                    parts += node.args[:1]
                reasons.append((where, " ".join(_strings(p, constants) for p in parts)))
    return reasons


def test_skip_reasons_are_given_and_cite_no_issue() -> None:
    reasons = _skip_reasons()
    assert reasons, "no skip calls found: the scan is broken"
    for where, text in reasons:
        assert text.strip(), f"{where}: a skip without a reason"
        assert not re.search(r"#\d|\bissues?\b", text, flags=re.I), (
            f"{where}: the reason cites an issue ({text!r}); say what is missing and how to "
            "get it instead")
