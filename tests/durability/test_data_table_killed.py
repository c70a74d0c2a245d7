"""pskv.data with a table key, replicas, a server and a worker SIGKILLed (docs/data.md D7,
docs/embeddings.md D8): a counting job (tests/durability/scripts/train_data_table.py)
under ``pskv-launch`` with ``PSKV_REPLICAS=1`` and restarts. The job must finish with
"seen" as in the run where nothing died, and in ``dist_sync`` with every value (the table's
rows, the dense key) the calm run's bits."""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pskv.launch import launch

pytestmark = [pytest.mark.timeout(300)]

SCRIPTS = Path(__file__).parent / "scripts"
N = 60


def _job(out: Path, store_type: str, epochs: int, env: dict[str, str] | None = None) -> int:
    out.mkdir()
    sockets = tempfile.mkdtemp(prefix="pskv-dt")       # Unix sockets a SIGKILL leaves behind
    try:
        result = launch([sys.executable, str(SCRIPTS / "train_data_table.py"), str(out),
                         str(epochs), store_type], 2, 2, max_restarts=5, timeout=150,
                        env={"PSKV_REPLICAS": "1", "PSKV_HEARTBEAT_TIMEOUT": "20",
                             "PSKV_CONNECT_TIMEOUT": "60", "TMPDIR": sockets,
                             "DIE_MARK": str(out / "died"), **(env or {})},
                        server_command=[sys.executable, str(SCRIPTS / "server.py")])
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return result.returncode


def _final(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as data:
        return {k: data[k] for k in data.files}


def _steps(out: Path, rank: int) -> list[list[int]]:
    runs = sorted(out.glob(f"steps-{rank}-*.txt"), key=lambda p: int(p.stem.split("-")[2]))
    return [[int(x) for x in p.read_text().split()] for p in runs]


@pytest.mark.parametrize("store_type, die_at", [("dist_sync", "pushes"),
                                                ("dist_sync", "lookup"),
                                                ("dist_async", "pushes")])
def test_a_table_job_with_a_server_and_a_worker_killed(tmp_path: Path, store_type: str,
                                                       die_at: str) -> None:
    """Server 1 dies after 25 rounds (its backup, server 0, takes its shards over and it
    comes back as a backup); worker 0 dies in step 24 after its table push went (its
    small dense push was held: it never left) or before it pushed anything of the step.
    The restarted worker resumes at step 24 (or 23, made again with every push dropped),
    and, in the step it resumes at, reads the rows and weights its first run read."""
    epochs = 4                        # 10 steps an epoch (60 samples, 2 workers x 3)
    die = {"DIE_SERVER": "1", "DIE_AFTER": "rounds:25", "DIE_WORKER": "0", "DIE_STEP": "24",
           "DIE_AT": die_at}
    assert _job(tmp_path / "killed", store_type, epochs, die) == 0
    assert (tmp_path / "killed" / "died-1").exists(), "server 1 was not killed"
    runs = _steps(tmp_path / "killed", 0)
    assert len(runs) == 2 and runs[0][-1] == 24 and runs[1][0] in (23, 24), runs
    assert runs[0][:runs[1][0]] + runs[1] == list(range(10 * epochs))
    got = _final(tmp_path / "killed")
    np.testing.assert_array_equal(got["seen"], np.full(N, float(epochs)))
    assert got["found"].all()
    if store_type == "dist_sync":
        assert _job(tmp_path / "calm", store_type, epochs) == 0
        want = _final(tmp_path / "calm")
        for k in ("seen", "w", "emb"):
            np.testing.assert_array_equal(got[k].view(np.uint32), want[k].view(np.uint32),
                                          err_msg=k)
