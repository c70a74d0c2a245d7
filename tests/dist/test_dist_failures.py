"""Failures: a node killed mid-round (real processes: ``local_cluster``, SIGKILL,
heartbeats every 0.2 s with a 2 s deadline). Strangers and garbage on the wire are in
tests/adversarial/test_strangers.py.
"""
from __future__ import annotations

import time
from typing import Any

import pytest


HEARTBEAT_TIMEOUT = 2.0
#: the deadline for every other node to hear of a death: heartbeat timeout plus slack for
#: this small, busy machine
DEADLINE = HEARTBEAT_TIMEOUT + 10.0


# ---- a node killed mid-round (processes) --------------------------------------------------
def _wait_ready(cluster: Any, ranks: list[int], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready = {r["rank"] for p in cluster.workers for r in p.reports()
                 if r.get("event") == "ready"}
        if set(ranks) <= ready:
            return
        time.sleep(0.05)
    pytest.fail(f"workers {ranks} were not ready in {timeout} s:\n{cluster.dump()}")


def _errors(cluster: Any) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for p in cluster.workers for r in p.reports() if "error" in r}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_worker_killed_mid_round(local_cluster: Any) -> None:
    cluster = local_cluster(2, 2, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "16"})
    cluster.start("fail_node.py", "worker-dies")
    _wait_ready(cluster, [0, 1])
    victim = cluster.worker_by_rank(1)
    time.sleep(0.3)                        # rank 0 is now waiting for rank 1's push
    killed_at = time.time()
    victim.kill()
    codes = cluster.wait(30)
    err = _errors(cluster)[0]
    assert "ClusterError" in err["mro"] and err["error"] == "NodeFailedError", err
    assert "worker 1" in err["msg"], err
    assert err["time"] - killed_at < DEADLINE, (err["time"] - killed_at, err)
    survivor = cluster.worker_by_rank(0)
    assert codes[survivor.label] == 3
    # the servers heard too, and every node left by itself
    for label in ("server 0", "server 1"):
        assert "worker 1" in cluster.get(label).output(), cluster.dump()
        assert codes[label] == 0
    assert codes["scheduler"] == 1            # the job failed
    assert "worker 1" in cluster.get("scheduler").output()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_server_killed_mid_round(local_cluster: Any) -> None:
    cluster = local_cluster(2, 2, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "16"})
    cluster.start("fail_node.py", "server-dies")
    _wait_ready(cluster, [0, 1])
    table = next(r["servers"] for p in cluster.workers for r in p.reports() if "servers" in r)
    victim = cluster.server_by_rank(1, table)
    survivor = cluster.server_by_rank(0, table)
    killed_at = time.time()
    victim.kill()
    codes = cluster.wait(30)
    errors = _errors(cluster)
    assert sorted(errors) == [0, 1], cluster.dump()
    for rank, err in errors.items():
        assert "ClusterError" in err["mro"], err
        assert "server 1" in err["msg"], err
        assert err["time"] - killed_at < DEADLINE, (rank, err["time"] - killed_at, err)
    # the scheduler reports the dead server; the surviving server may have been shut down
    # (every worker gone) before the heartbeat deadline, which is a clean exit
    assert "server 1" in cluster.get("scheduler").output(), cluster.dump()
    assert codes[survivor.label] == 0 and codes["scheduler"] == 1, codes
    assert all(codes[p.label] == 3 for p in cluster.workers), codes
