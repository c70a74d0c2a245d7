"""pskv-launch --max-restarts: a server SIGKILLed at a seeded random moment is restarted,
reloads its shard from the newest checkpoint, the workers send it their later pushes again,
and the job ends as a run where nothing died: the same weights in dist_sync, every push
applied once in dist_async."""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pskv.launch import launch

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent / "scripts"
STEPS = 200


def _job(out: Path, store_type: str,
         die: tuple[int, float | str] | list[tuple[int, float | str]] | None,
         every: int = 5, extra: dict[str, str] | None = None, servers: int = 2,
         max_restarts: int | None = None, stderr: io.StringIO | None = None) -> int:
    out.mkdir()
    if max_restarts is None:     # pskv-launch refuses restarts with nothing to restart from
        max_restarts = 1 if every or (extra or {}).get("PSKV_REPLICAS") == "1" else 0
    env = {"PSKV_HEARTBEAT_TIMEOUT": "20", "PSKV_CONNECT_TIMEOUT": "30",
           "DIE_MARK": str(out / "died"), **(extra or {})}
    if every:
        env.update(PSKV_CHECKPOINT_DIR=str(out / "ck"), PSKV_CHECKPOINT_EVERY=str(every))
    kills = [] if die is None else die if isinstance(die, list) else [die]
    env.update(DIE_SERVER=",".join(str(r) for r, _ in kills),
               DIE_AFTER=",".join(str(t) for _, t in kills))
    # the Unix socket files of SIGKILLed servers stay behind: in a directory removed after
    sockets = tempfile.mkdtemp(prefix="pskv-t")
    env["TMPDIR"] = sockets
    try:
        result = launch([sys.executable, str(HERE / "train.py"), str(out), str(STEPS),
                         store_type], 2, servers, env=env, max_restarts=max_restarts, timeout=200,
                        stderr=stderr,
                        server_command=[sys.executable, str(HERE / "server.py")])
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    for rank, _ in kills:
        assert (out / f"died-{rank}").exists(), f"server {rank} was not killed while the job ran"
    return result.returncode


def _weights(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "weights.npz") as data:
        return {k: data[k] for k in data.files}


def _same_weights(calm_out: Path, killed_out: Path) -> None:
    """The job that had deaths ended with the undisturbed job's weights, bit for bit."""
    calm, killed = _weights(calm_out), _weights(killed_out)
    assert sorted(killed) == sorted(calm)
    for k in calm:
        np.testing.assert_array_equal(killed[k], calm[k], err_msg=f"key {k!r}")


def _die(seed: int) -> tuple[int, str]:
    """Which server dies, and when: after it applied some rounds (tied to the job's
    progress: a kill by the clock could come before a slow-starting job's workers connect,
    a different fault from the one these tests mean)."""
    rng = random.Random(seed)
    return rng.randrange(2), f"rounds:{rng.randrange(20, 120)}"


@pytest.mark.parametrize("seed", [1, 2])
def test_sync_server_killed_restarts_from_checkpoint_bit_identical(tmp_path: Path,
                                                                   seed: int) -> None:
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    assert _job(tmp_path / "killed", "dist_sync", _die(seed)) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


@pytest.mark.parametrize("seed", [3])
def test_async_server_killed_restarts_and_loses_no_push(tmp_path: Path, seed: int) -> None:
    assert _job(tmp_path / "killed", "dist_async", _die(seed)) == 0
    pushed = [json.loads((tmp_path / "killed" / f"pushes-{r}.json").read_text())["pushes"]
              for r in (0, 1)]
    counted = _weights(tmp_path / "killed")["n"]
    # "n" starts at one and gains one per applied push of it (4 keys: a quarter of them)
    np.testing.assert_array_equal(counted, np.full(2, 1.0 + sum(pushed) // 4))


@pytest.mark.parametrize("seed", [4, 5])
def test_sync_replicas_failover_bit_identical(tmp_path: Path, seed: int) -> None:
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    # no checkpoints: the backup holds everything acknowledged
    assert _job(tmp_path / "killed", "dist_sync", _die(seed), every=0,
                extra={"PSKV_REPLICAS": "1"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


# server 1 serves more than one of the 4 keys: its rounds of a step go as one batch
@pytest.mark.parametrize("rank, batch", [(1, 2), (1, 40)])
def test_a_primary_killed_between_a_batch_and_its_acknowledgment_loses_nothing(
        tmp_path: Path, rank: int, batch: int) -> None:
    """A step's rounds reach the backup as one message (``r_rounds``) and no reply goes
    out before its acknowledgment: a primary SIGKILLed right after sending a batch, before
    reading the acknowledgment, leaves the job the undisturbed run's weights."""
    one_call = {"TRAIN_ONE_CALL": "1"}
    assert _job(tmp_path / "calm", "dist_sync", None, every=0, extra=one_call) == 0
    assert _job(tmp_path / "killed", "dist_sync", (rank, f"batch:{batch}"), every=0,
                extra={**one_call, "PSKV_REPLICAS": "1"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_sync_replicas_failover_with_pushpull_bit_identical(tmp_path: Path) -> None:
    """A pushpull's push is kept by reference until its reply (no copy): a server killed
    while the workers overwrite their gradient buffers every step still ends the job
    with the undisturbed run's weights."""
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    assert _job(tmp_path / "killed", "dist_sync", _die(6), every=0,
                extra={"PSKV_REPLICAS": "1", "TRAIN_PUSHPULL": "1"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_sync_replicas_failover_with_arrays_written_right_after_push_bit_identical(
        tmp_path: Path) -> None:
    """A pushed NDArray's buffer is lent to the worker's push log, not copied: a worker
    that overwrites it right after ``push`` makes the log copy it first, so a server killed
    mid-job gets the pushes as they were made (docs/durability.md, "Pushes kept")."""
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    # killed as a push arrives: its worker has overwritten that array since, and sends
    # the push again from its log (not held back: a held push is a copy)
    assert _job(tmp_path / "killed", "dist_sync", (1, "pushes:150"), every=0,
                extra={"PSKV_REPLICAS": "1", "TRAIN_CLOBBER": "1",
                       "PSKV_COALESCE_BYTES": "0"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_replicas_over_zeromq_the_scheduler_reports_the_death(tmp_path: Path) -> None:
    # ZeroMQ does not show a broken link: the workers learn of it from the scheduler
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    assert _job(tmp_path / "killed", "dist_sync", (1, "rounds:60"), every=0,
                extra={"PSKV_REPLICAS": "1", "PSKV_TRANSPORT": "zmq"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_replicas_restarted_server_is_the_new_backup(tmp_path: Path) -> None:
    # server 0 dies (server 1 takes its shard), restarts as a backup of both shards, then
    # server 1 dies: server 0 serves everything, and nothing acknowledged is lost
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    assert _job(tmp_path / "killed", "dist_sync", [(0, "rounds:30"), (1, "copies:2+0.3")],
                every=0,
                extra={"PSKV_REPLICAS": "1"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_a_worker_restarted_after_a_takeover_of_a_whole_copy_keeps_the_momentum(
        tmp_path: Path) -> None:
    """Server 0 dies and comes back as the backup of both shards (whole copies, made
    mid-job: their optimizer specs carry its counts); server 1 dies, server 0 serves both
    from those copies; then a worker dies and is restarted, and sends its optimizer again.
    That repeat must be a no-op: it reset the momentum of every key (found by the long
    chaos soak, whose dist_sync job ended 32.13 off on its counting key)."""
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    out = tmp_path / "killed"
    assert _job(out, "dist_sync", [(0, "rounds:30"), (1, "copies:2+0.3")], every=0,
                extra={"PSKV_REPLICAS": "1", "DIE_WORKER": "1",
                       "DIE_STEP": str(STEPS - 5)}, max_restarts=2) == 0
    assert (out / "died-worker-1").stat().st_mtime_ns > (out / "died-1").stat().st_mtime_ns, \
        "the worker died before server 1: not the fault this test means (raise DIE_STEP)"
    _same_weights(tmp_path / "calm", out)


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_encrypted_links_survive_failover_and_restart(tmp_path: Path, transport: str) -> None:
    # PSKV_ENCRYPT=1: sealed stream links (or CURVE) through a death, the backup's
    # takeover, the restart (new pair keys: the workers check the new server's proof)
    # and a second death; nothing acknowledged is lost
    assert _job(tmp_path / "calm", "dist_sync", None) == 0
    assert _job(tmp_path / "killed", "dist_sync", [(0, "rounds:30"), (1, "copies:2+0.3")],
                every=0,
                extra={"PSKV_REPLICAS": "1", "PSKV_ENCRYPT": "1",
                       "PSKV_TRANSPORT": transport}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def _server_0_dies_unrestarted(tmp_path: Path, when: str, transport: str) -> None:
    """Server 0 dies at ``when`` (server.py's DIE_AFTER) and is not restarted; with
    replicas the job ends with the undisturbed run's weights."""
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    assert _job(tmp_path / "killed", "dist_sync", (0, when), every=0, max_restarts=0,
                extra={"PSKV_REPLICAS": "1", "PSKV_TRANSPORT": transport}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_a_server_dying_while_workers_connect_leaves_its_shard_to_its_backup(
        tmp_path: Path, transport: str) -> None:
    # server 0 dies when the last worker's HELLO reaches it, before answering: the workers
    # are still connecting; they finish with server 1, then move shard 0 to it (a server
    # refuses any command before a worker's HELLO handshake is done)
    _server_0_dies_unrestarted(tmp_path, "hellos", transport)


@pytest.mark.parametrize("transport", ["auto", "zmq"])
def test_a_server_dying_before_its_first_copy_leaves_its_shard_empty_to_its_backup(
        tmp_path: Path, transport: str) -> None:
    # server 0 dies once admitted, before its backup holds the first copy of its shard:
    # it answered nobody (a server waits for that copy), so server 1 serves shard 0 empty;
    # the workers' dial to server 0 is refused (or, over ZeroMQ, never answered) and they
    # go to server 1 (a kill 0.8 s after start did this on a loaded machine: the job ended)
    _server_0_dies_unrestarted(tmp_path, "first-copy", transport)


def test_replicas_without_restarts_the_launcher_keeps_the_job(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """PSKV_REPLICAS=1 alone: the dead server is not restarted, its backup serves its shard,
    and pskv-launch goes on (one WARNING) instead of ending the job with the server's
    status; the weights are those of a run where nothing died."""
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    err = io.StringIO()
    with caplog.at_level("WARNING", logger="pskv.launch"):
        assert _job(tmp_path / "killed", "dist_sync", (1, "rounds:60"), every=0, max_restarts=0,
                    extra={"PSKV_REPLICAS": "1"}, stderr=err) == 0
    said = [r.getMessage() for r in caplog.records if "its backup serves its shard" in
            r.getMessage()]
    assert len(said) == 1 and said[0].startswith("server 1"), said
    # the processes of the job: one WARNING for the handled failover (the scheduler's), its
    # subject the server that died; the others log theirs at INFO
    loud = [line for line in err.getvalue().splitlines()
            if line.startswith("[") and (" WARNING " in line or " ERROR " in line)]
    assert len(loud) == 1 and "server 1 is gone" in loud[0], err.getvalue()
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_without_replicas_a_dead_server_still_ends_the_job(tmp_path: Path) -> None:
    assert _job(tmp_path / "killed", "dist_sync", (1, "rounds:60"), every=0, max_restarts=0) != 0


@pytest.mark.parametrize("seed", [6])
def test_async_replicas_failover_loses_no_push(tmp_path: Path, seed: int) -> None:
    assert _job(tmp_path / "killed", "dist_async", _die(seed), every=0,
                extra={"PSKV_REPLICAS": "1"}) == 0
    pushed = [json.loads((tmp_path / "killed" / f"pushes-{r}.json").read_text())["pushes"]
              for r in (0, 1)]
    counted = _weights(tmp_path / "killed")["n"]
    np.testing.assert_array_equal(counted, np.full(2, 1.0 + sum(pushed) // 4))


@pytest.mark.parametrize("seed", [7])
def test_worker_killed_restarts_with_its_rank_bit_identical(tmp_path: Path, seed: int) -> None:
    # the restarted worker runs its script from the start; the pushes its first run made
    # are dropped as it makes them again, then it goes on where it died
    rng = random.Random(seed)
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    # periodic checkpoints on: pskv-launch refuses --max-restarts without a way for a
    # server to come back, though here only a worker dies
    assert _job(tmp_path / "killed", "dist_sync", None, every=5,
                extra={"DIE_WORKER": str(rng.randrange(2)),
                       "DIE_STEP": str(rng.randrange(20, STEPS - 20))}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


@pytest.mark.parametrize("servers", [2, 3])
def test_worker_killed_with_replicas_restarts_bit_identical(tmp_path: Path,
                                                            servers: int) -> None:
    """With backups on (no checkpoints), a restarted worker catches up as without them."""
    assert _job(tmp_path / "calm", "dist_sync", None, every=0, servers=servers) == 0
    assert _job(tmp_path / "killed", "dist_sync", None, every=0, servers=servers,
                extra={"PSKV_REPLICAS": "1", "DIE_WORKER": "1", "DIE_STEP": "120"}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_worker_restarted_after_a_failover_finds_the_shards_on_their_backups(
        tmp_path: Path) -> None:
    """Server 1 dies (its backup, server 0, takes shard 1 over), then a worker dies and is
    restarted: it must send shard 1 to server 0, where it is now, not to the restarted
    server 1 (a backup now); the scheduler tells it at admission (found by the chaos soak,
    test_chaos.py)."""
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    assert _job(tmp_path / "killed", "dist_sync", (1, "rounds:20"), every=0,
                extra={"PSKV_REPLICAS": "1", "DIE_WORKER": "1",
                       "DIE_STEP": str(STEPS - 30)}) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


@pytest.mark.parametrize("replicas", ["0", "1"])
def test_three_servers_split_keys(tmp_path: Path, replicas: str) -> None:
    # keys split across three servers (bound 500 elements); any one of them killed
    rng = random.Random(8 + int(replicas))
    extra = {"MXNET_KVSTORE_BIGARRAY_BOUND": "500", "PSKV_REPLICAS": replicas}
    assert _job(tmp_path / "calm", "dist_sync", None, extra=extra, servers=3) == 0
    die = (rng.randrange(3), f"rounds:{rng.randrange(20, 80)}")
    assert _job(tmp_path / "killed", "dist_sync", die,
                extra=extra, servers=3) == 0
    _same_weights(tmp_path / "calm", tmp_path / "killed")


def test_server_killed_before_the_first_periodic_checkpoint(tmp_path: Path) -> None:
    # only the round-0 checkpoint (the initial values) exists: every push is sent again
    assert _job(tmp_path / "calm", "dist_sync", None, every=0) == 0
    assert _job(tmp_path / "killed", "dist_sync", (1, "rounds:60"), every=1000) == 0
    assert os.listdir(tmp_path / "killed" / "ck") == ["round-0000000000"]
    _same_weights(tmp_path / "calm", tmp_path / "killed")
