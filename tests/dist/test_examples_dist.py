"""The dist example runs under the real launcher, as ``python -m pskv.examples.NAME``."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_dist_example_under_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "1", "--timeout", "100",
         sys.executable, "-m", "pskv.examples.dist_sync_sgd"],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("w = 3.0000") + proc.stdout.count("w = 2.9999") == 2, proc.stdout
    assert "worker 1 of 2:" in proc.stdout, proc.stdout
    out = proc.stdout + proc.stderr                  # counts with their grammatical number
    assert "launching 2 workers and 1 server (local)" in out, out
    assert "1 server and 2 workers admitted" in out, out
