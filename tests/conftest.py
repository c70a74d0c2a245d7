"""Shared fixtures: every test starts with no DMLC_*, PSKV_* or MXNET_* variables set."""
from __future__ import annotations

import os

import pytest

_PREFIXES = ("DMLC_", "PSKV_", "MXNET_")
# the differential tests read these; they name an interpreter and a source checkout,
# not pskv behaviour
_KEEP = {"PSKV_MXNET_PYTHON", "PSKV_MXNET_SRC"}


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear the cluster and MXNet variables so no test sees another's settings."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) and name not in _KEEP:
            monkeypatch.delenv(name, raising=False)
