"""Online training that feeds serving, end to end (issue #31's test): ``train_ctr`` (count
admission, capacity eviction) under ``pskv-launch`` with ``PSKV_REPLICAS=1``, a file sink
and a Redis sink beside the job (``--sink``), a serving replica following the stream from
outside the job, and a server SIGKILLed mid-run. At the end the replica, the Redis keys
and the replayed files all hold the servers' table bit for bit (the rows rank 0 exports
after training, read through the stream: ``train_ctr --export``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pskv.launch import launch
from pskv.launch._net import free_port
from pskv.sinks import load_redis, replay
from test_redis_sink import needs_redis, redis_server

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

SERVER = Path(__file__).parents[1] / "durability" / "scripts" / "server.py"


@needs_redis
def test_train_ctr_feeds_sinks_and_a_replica_through_a_server_kill(tmp_path: Path) -> None:
    port, secret = free_port(), "stream-test-secret"
    files, export = tmp_path / "files", tmp_path / "export"
    job_env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
               "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2", "PSKV_SECRET": secret}
    with redis_server(tmp_path) as url:
        replica = _start_replica(tmp_path, job_env)
        try:
            result = launch(
                [sys.executable, "-m", "pskv.examples.train_ctr", "--kv-store", "dist_sync",
                 "--epochs", "2", "--samples-per-day", "12000", "--capacity", "400",
                 "--min-count", "2", "--quiet", "--export", str(export)],
                2, 2, port=port, secret=secret, max_restarts=1, timeout=300,
                server_command=[sys.executable, str(SERVER)],
                sinks=[f"emb=file:{files}", f"emb={url}"],
                env={"PSKV_REPLICAS": "1", "PSKV_HEARTBEAT_TIMEOUT": "20",
                     "PSKV_CONNECT_TIMEOUT": "60", "DIE_SERVER": "1",
                     "DIE_AFTER": "rounds:60", "DIE_MARK": str(tmp_path / "died")})
            assert result.returncode == 0, result
            assert (tmp_path / "died-1").exists(), "the server was not killed while the job ran"
            servers = replay(export)
            ids, rows = servers.table()
            assert ids.size > 0
            versions = {s: p[1] for s, p in servers.positions.items()}
            # the file sink: its snapshot plus deltas replayed
            got = replay(files)
            assert {s: p[1] for s, p in got.positions.items()} == versions
            _same(got.table(), (ids, rows))
            # the Redis sink: the rows under its keys
            _same(load_redis(url, "emb").table(), (ids, rows))
            _check_replica(replica, secret, ids, rows, versions)
        finally:
            _stop(replica[0])


def _same(got, want) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1].tobytes() == want[1].tobytes()


def _start_replica(tmp_path: Path, job_env: dict[str, str]):
    """``python -m pskv.serving`` following table emb, as a serving host would run it."""
    rport = free_port()
    env = {**os.environ, **job_env}
    with open(tmp_path / "replica.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pskv.serving", "--keys", "emb",
                                 "--port", str(rport)], env=env, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, rport


def _check_replica(replica, secret: str, ids, rows, versions) -> None:
    from pskv.serving import ReplicaClient
    with ReplicaClient(("127.0.0.1", replica[1]), secret=secret) as client:
        got, found, at = client.lookup("emb", ids, min_version=versions)
    assert found.all()
    assert got.tobytes() == rows.tobytes()
    assert {int(s): v for s, v in dict(at).items()} == versions


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
