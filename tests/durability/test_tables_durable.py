"""Table keys through checkpoints and server deaths, with real processes (pskv-launch).

* a checkpoint written by 2 servers loads onto 3 (rows saved by ID, re-hashed: R13) and the
  job then trains on exactly as one that never stopped;
* with ``PSKV_REPLICAS=1`` a server SIGKILLed mid-job hands its table shard to its backup
  (which got every round's changed rows and every row a lookup gave birth to) and the job
  ends with the rows of a run where nothing died, bit for bit (``dist_sync``), or with every
  push counted exactly once (``dist_async``);
* without replicas a server restarted from a periodic checkpoint gets the later pushes
  again, which re-create the rows born since (docs/embeddings.md D7-D9).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pskv.launch import launch

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent / "scripts"


def _job(out: Path, steps: int, servers: int, env: dict[str, str] | None = None,
         die: tuple[int, float] | None = None, store_type: str = "dist_sync") -> int:
    out.mkdir()
    full = {"PSKV_HEARTBEAT_TIMEOUT": "20", "PSKV_CONNECT_TIMEOUT": "30",
            "DIE_MARK": str(out / "died"), **(env or {})}
    if die is not None:
        full.update(DIE_SERVER=str(die[0]), DIE_AFTER=str(die[1]))
    sockets = tempfile.mkdtemp(prefix="pskv-t")      # Unix sockets a SIGKILL leaves behind
    full["TMPDIR"] = sockets
    try:
        result = launch([sys.executable, str(HERE / "train_table.py"), str(out), str(steps),
                         store_type], 2, servers, env=full, max_restarts=1 if die else 0,
                        timeout=200,
                        server_command=[sys.executable, str(HERE / "server.py")])
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    if die is not None:
        assert (out / f"died-{die[0]}").exists(), "the server was not killed while the job ran"
    return result.returncode


def _table(out: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    with np.load(out / "table.npz") as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads((out / "stats.json").read_text())


def test_checkpoint_of_two_servers_continues_on_three(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert _job(tmp_path / "whole", 20, 2) == 0
    assert _job(tmp_path / "first", 10, 2, {"SAVE_TO": str(ck)}) == 0
    assert _job(tmp_path / "second", 10, 3, {"LOAD_FROM": str(ck), "START_STEP": "10"}) == 0
    whole, whole_stats = _table(tmp_path / "whole")
    second, second_stats = _table(tmp_path / "second")
    np.testing.assert_array_equal(second["ids"], whole["ids"])
    np.testing.assert_array_equal(second["found"], whole["found"])
    np.testing.assert_allclose(second["values"], whole["values"], rtol=1e-6, atol=1e-7)
    for k in ("rows", "step", "inserts", "pushed_rows"):
        assert second_stats[k] == whole_stats[k], k


@pytest.mark.parametrize(("die", "dtype", "stream"), [
    ((1, 1.2), "float32", "1"), ((0, 0.9), "float32", "reader"), ((1, 1.2), "float16", "1")])
def test_server_killed_with_replicas_loses_no_row(tmp_path: Path, die: tuple[int, float],
                                                  dtype: str, stream: str) -> None:
    """The backup holds the same bits as its primary: a float16 table (R17) too; a
    subscriber of the change stream goes on from the backup with no reset, and its mirror
    holds the table's rows bit for bit (E8)."""
    env = {"PSKV_REPLICAS": "1", "DTYPE": dtype, "STREAM": stream}
    assert _job(tmp_path / "calm", 200, 2, env) == 0
    assert _job(tmp_path / "killed", 200, 2, env, die=die) == 0
    calm, calm_stats = _table(tmp_path / "calm")
    killed, killed_stats = _table(tmp_path / "killed")
    np.testing.assert_array_equal(killed["found"], calm["found"])
    np.testing.assert_array_equal(killed["values"].view(np.uint32),
                                  calm["values"].view(np.uint32))
    if dtype == "float16":              # the rows read were float16 rows, widened
        np.testing.assert_array_equal(calm["values"].astype(np.float16).astype(np.float32),
                                      calm["values"])
    assert killed_stats["rows"] == calm_stats["rows"]
    assert killed_stats["step"] == calm_stats["step"] == 200
    assert killed_stats["stream_resets"] == 0
    with np.load(tmp_path / "killed" / "mirror.npz") as m:
        np.testing.assert_array_equal(m["ids"], killed["ids"][killed["found"]])
        np.testing.assert_array_equal(m["rows"].view(np.uint32),
                                      killed["values"][killed["found"]].view(np.uint32))


def test_server_killed_restarts_from_periodic_checkpoint(tmp_path: Path) -> None:
    """No replicas: the restarted server reloads its shard from the newest periodic
    checkpoint and the workers send their later pushes again; rows born by lookups after
    that checkpoint are re-created by those pushes (D9), so every pushed row ends as in a
    calm run. Rows only looked up since the checkpoint are lost: they read their initial
    value, as they did (R4), but are not found."""
    calm_env = {"PSKV_CHECKPOINT_DIR": str(tmp_path / "ck-calm"), "PSKV_CHECKPOINT_EVERY": "20"}
    env = {"PSKV_CHECKPOINT_DIR": str(tmp_path / "ck"), "PSKV_CHECKPOINT_EVERY": "20"}
    assert _job(tmp_path / "calm", 200, 2, calm_env) == 0
    assert _job(tmp_path / "killed", 200, 2, env, die=(0, 1.3)) == 0
    calm, calm_stats = _table(tmp_path / "calm")
    killed, killed_stats = _table(tmp_path / "killed")
    pushed = (calm["ids"] < 10**7) | (calm["ids"] >= 2**62)
    np.testing.assert_array_equal(killed["found"][pushed], calm["found"][pushed])
    np.testing.assert_array_equal(killed["values"], calm["values"])
    assert killed_stats["step"] == calm_stats["step"] == 200


def test_async_server_killed_with_replicas_applies_every_push_once(tmp_path: Path) -> None:
    """dist_async: each row counts the pushes of its ID the servers applied; after a
    server's death and its backup's takeover every push is counted exactly once."""
    out = tmp_path / "killed"
    assert _job(out, 200, 2, {"PSKV_REPLICAS": "1", "COUNT": "1"}, die=(0, 1.0),
                store_type="dist_async") == 0
    got, _stats = _table(out)
    want = {}
    for step in range(200):
        for rank in (0, 1):
            for i in _batch(step, rank).tolist():
                want[i] = want.get(i, 0) + 1
            for i in (np.arange(3) + 10**7 + 100 * step + 10 * rank).tolist():
                want[i] = 0                         # only looked up: born, never pushed
    np.testing.assert_array_equal(got["ids"], np.array(sorted(want), np.int64))
    np.testing.assert_array_equal(got["values"][:, 0],
                                  np.array([want[i] for i in sorted(want)], np.float32))
    assert got["found"].all()          # rows born by lookups reached the backup too (D8)


def _batch(step: int, rank: int) -> np.ndarray:
    """The IDs worker ``rank`` pushes at ``step`` (as scripts/train_table.py makes them)."""
    rng = np.random.default_rng([step, rank])
    fresh = np.arange(4) + 1000 * step + 100 * rank
    return np.concatenate([rng.integers(-200, 200, 24), fresh,
                           [2**62 + step % 5, -(2**63)]]).astype(np.int64)


def test_async_staleness_bounds_survive_a_server_killed_with_replicas(tmp_path: Path) -> None:
    """docs/embeddings.md S7: with both bounds set (PSKV_STALENESS=0,
    PSKV_GLOBAL_STALENESS=1) a server SIGKILLed mid-job hands its shard to its backup,
    which knows every worker's clock already (each clock goes to every shard), and the
    reads it held are sent again and held there: the job ends without a hang or an error
    and every push is applied exactly once."""
    out = tmp_path / "killed"
    env = {"PSKV_REPLICAS": "1", "COUNT": "1", "PSKV_STALENESS": "0",
           "PSKV_GLOBAL_STALENESS": "1", "PSKV_ROUND_TIMEOUT": "60"}
    assert _job(out, 120, 2, env, die=(0, 1.0), store_type="dist_async") == 0
    got, _stats = _table(out)
    want: dict[int, int] = {}
    for step in range(120):
        for rank in (0, 1):
            for i in _batch(step, rank).tolist():
                want[i] = want.get(i, 0) + 1
    pushed = np.isin(got["ids"], np.array(sorted(want), np.int64))
    np.testing.assert_array_equal(got["values"][pushed, 0],
                                  np.array([want[i] for i in got["ids"][pushed].tolist()],
                                           np.float32))
