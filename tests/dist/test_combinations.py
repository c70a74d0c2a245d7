"""Features tried together the way a user combines them, through the real ``pskv-launch``:
embedding tables with their own row optimizers beside an MLP trained through
``DistributedOptimizer``, on data that does not split evenly (``opt.join()``), in each
sync mode."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install 'pskv[torch]' "
                                    "(on these machines pip install torch==2.13.0 first)")

pytestmark = pytest.mark.timeout(240)

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _launch(*args: str, timeout: float = 200) -> str:
    proc = subprocess.Popen([sys.executable, "-m", "pskv.launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("mode", ["dist_sync", "dist_async"])
def test_tables_beside_distributed_optimizer_on_uneven_data(mode: str) -> None:
    """Worker 0 has 12 batches, worker 1 has 19: worker 0 joins, worker 1's remaining
    steps complete without it (no hang), both learn worker 1 joined last, and afterwards
    both hold the same MLP (join makes it the last joiner's) and read the same table rows."""
    out = _launch("-n", "2", "-s", "2", "--timeout", "180", sys.executable,
                  str(SCRIPTS / "ctr_uneven.py"), mode)
    results = dict(re.findall(r"RESULT rank=(\d) (last=.*)", out))
    assert sorted(results) == ["0", "1"], out[-4000:]
    assert results["0"] == results["1"], results
    assert "last=1 " in results["0"], results
