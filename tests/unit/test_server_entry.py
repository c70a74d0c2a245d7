"""``python -m pskv.server``: what it says when the environment is wrong."""
from __future__ import annotations

import pytest

from pskv import server
from pskv._ps.config import ENV_ROLE


def test_unset_role_says_unset(capsys: pytest.CaptureFixture[str]) -> None:
    assert server.main([]) == 1
    err = capsys.readouterr().err
    assert f"{ENV_ROLE} is not set" in err
    assert "''" not in err


def test_empty_role_says_unset(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_ROLE, "")
    assert server.main([]) == 1
    assert f"{ENV_ROLE} is not set" in capsys.readouterr().err


def test_bad_role_is_quoted(monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_ROLE, "boss")
    assert server.main([]) == 1
    assert f"{ENV_ROLE}='boss' is not a role" in capsys.readouterr().err
