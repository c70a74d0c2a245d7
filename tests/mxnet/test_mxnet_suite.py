"""MXNet 1.9.1's own KVStore tests, run unchanged against pskv (``run_mxnet_suite.py``).

Needs an MXNet source checkout of tag 1.9.1 named by ``PSKV_MXNET_SRC``; without one,
every case skips. The cases that need ``mx.gluon`` are expected to fail: pskv is the
KVStore alone and has no Gluon. docs/mxnet-tests.md lists what each case covers.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from .run_mxnet_suite import CASES, ENV_MXNET_SRC, Case, missing_files, run_case

pytestmark = pytest.mark.mxnet

_NO_GLUON = ("the case builds a mx.gluon Trainer; pskv is the KVStore alone and has no "
             "Gluon, so import mxnet (pskv) has no attribute 'gluon'")
EXPECTED_FAILURES = {
    "dist_sync_invalid": _NO_GLUON,
    "dist_sync_gluon_type": _NO_GLUON,
    "dist_sync_gluon_step": _NO_GLUON,
    "dist_sync_gluon_sparse_step": _NO_GLUON,
    # its two KVStore tests (init, push/pull on 'gpu' contexts) run first and pass
    "dist_device_sync": _NO_GLUON,
    "dist_async": _NO_GLUON,
}


def _params() -> list[object]:
    out = []
    for case in CASES:
        marks: list[pytest.MarkDecorator] = []
        if case.workers:
            marks.append(pytest.mark.dist)
        if case.name in EXPECTED_FAILURES:
            marks.append(pytest.mark.xfail(reason=EXPECTED_FAILURES[case.name], strict=True))
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


def test_every_expected_failure_names_a_case() -> None:
    assert set(EXPECTED_FAILURES) <= {c.name for c in CASES}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", _params())
def test_mxnet_kvstore_suite(case: Case) -> None:
    src = os.environ.get(ENV_MXNET_SRC, "")
    if not src:
        pytest.skip(f"no MXNet source checkout: set {ENV_MXNET_SRC} to a checkout of "
                    "apache/mxnet tag 1.9.1 (see docs/mxnet-tests.md)")
    missing = missing_files(Path(src), case)
    if missing:
        pytest.skip(f"{ENV_MXNET_SRC}={src} has no {', '.join(missing)}: check out tag 1.9.1")
    result = run_case(case, Path(src))
    assert result.passed, f"{case.path} {' '.join(case.args)} failed (rc={result.rc}):\n" \
                          f"{result.output[-4000:]}"
