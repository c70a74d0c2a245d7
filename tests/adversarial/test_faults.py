"""Faults: a killed peer is reported everywhere at once, a lost scheduler ends every node,
and a root URI naming this machine's loopback in any spelling binds loopback only.

The kills use real processes (``local_cluster``: own process groups, killed at teardown).
The heartbeat timeout is left long (15 s) in the kill test, so only the broken connection
can report the death in time.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from pskv._ps.config import ClusterConfig, Role

VICTIM = str(Path(__file__).resolve().parent / "scripts" / "victim.py")
#: the issue's bound for a broken connection, plus slack for this small, busy machine
BROKEN_DEADLINE = 2.0 + 2.0


def _reports(cluster: Any) -> list[dict[str, Any]]:
    return [r for p in cluster.workers for r in p.reports()]


def _wait_ready(cluster: Any, n: int, timeout: float = 40.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len({r["rank"] for r in _reports(cluster) if r.get("event") == "ready"}) >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"workers not ready within {timeout} s:\n{cluster.dump()}")


@pytest.mark.timeout(90)
def test_killed_worker_is_reported_within_two_seconds(local_cluster: Any) -> None:
    cluster = local_cluster(2, 1, env={"PSKV_HEARTBEAT_INTERVAL": "0.5",
                                       "PSKV_HEARTBEAT_TIMEOUT": "15"})
    cluster.start(VICTIM, "worker-dies")
    _wait_ready(cluster, 2)
    victim = cluster.worker_by_rank(1)
    time.sleep(0.3)
    killed_at = time.time()
    victim.kill()
    codes = cluster.wait(40)
    err = next(r for r in _reports(cluster) if "error" in r)
    took = err["time"] - killed_at
    print(json.dumps({"worker killed, survivor told after s": round(took, 3)}))
    assert err["rank"] == 0 and err["error"] == "NodeFailedError", err
    assert "worker 1" in err["msg"] and "connection" in err["msg"], err
    assert took < BROKEN_DEADLINE, (took, cluster.dump())
    assert codes["scheduler"] == 1 and codes["server 0"] == 0, codes
    assert "worker 1" in cluster.get("server 0").output()


@pytest.mark.timeout(90)
def test_nodes_exit_when_the_scheduler_dies(local_cluster: Any) -> None:
    cluster = local_cluster(2, 1, env={"PSKV_HEARTBEAT_INTERVAL": "0.2",
                                       "PSKV_HEARTBEAT_TIMEOUT": "3"})
    cluster.start(VICTIM, "scheduler-dies")
    _wait_ready(cluster, 2)
    killed_at = time.time()
    cluster.get("scheduler").kill()
    codes = cluster.wait(40)
    errors = [r for r in _reports(cluster) if "error" in r]
    assert sorted(r["rank"] for r in errors) == [0, 1], cluster.dump()
    for err in errors:
        assert "scheduler" in err["msg"], err
        assert err["time"] - killed_at < 3.0 + 4.0, (err, cluster.dump())
    print(json.dumps({"scheduler killed, workers told after s":
                      [round(r["time"] - killed_at, 3) for r in errors]}))
    server = cluster.get("server 0")
    assert codes["server 0"] == 1 and "scheduler" in server.output(), server.output()
    assert all(codes[p.label] == 3 for p in cluster.workers), codes


@pytest.mark.parametrize("spelling", ["LOCALHOST", "localhost.", "hostname"])
def test_loopback_in_any_spelling_binds_loopback_only(spelling: str) -> None:
    from pskv._ps.scheduler import Scheduler
    from pskv.launch._net import free_port
    uri = socket.gethostname() if spelling == "hostname" else spelling
    try:
        if not all(ip.startswith("127.") or ip == "::1" for ip in
                   {i[4][0] for i in socket.getaddrinfo(uri, None)}):
            pytest.skip(f"{uri!r} does not resolve to loopback only on this machine: the "
                        "case needs a hostname mapped to 127.0.x.1 (as in /etc/hosts)")
    except OSError:
        pytest.skip(f"{uri!r} does not resolve on this machine")
    env = {"DMLC_PS_ROOT_URI": uri, "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    cfg = ClusterConfig.from_env(env, Role.SCHEDULER)
    assert cfg.node_host.startswith("127."), cfg.node_host
    sched = Scheduler(cfg)
    try:
        bound = sched._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert bound.startswith("tcp://127."), bound
    finally:
        sched.loop.close()
        sched._zctx.close()


@pytest.mark.timeout(90)
def test_killed_server_is_reported_and_leaves_no_socket_file(local_cluster: Any) -> None:
    cluster = local_cluster(2, 1, env={"PSKV_HEARTBEAT_INTERVAL": "0.5",
                                       "PSKV_HEARTBEAT_TIMEOUT": "15"})
    cluster.start(VICTIM, "scheduler-dies")       # both workers loop push/pull
    _wait_ready(cluster, 2)
    table = next(r["servers"] for r in _reports(cluster) if "servers" in r)
    uds = table[0].get("uds")
    if uds is None:
        pytest.skip("the server opened no Unix socket: this needs AF_UNIX and "
                    "PSKV_TRANSPORT unset, auto or ipc")
    abstract = uds.startswith("@")      # Linux: a name, no file (nothing to leave behind)
    assert abstract or Path(uds).exists()
    killed_at = time.time()
    cluster.get("server 0").kill()
    codes = cluster.wait(40)
    errors = [r for r in _reports(cluster) if "error" in r]
    assert sorted(r["rank"] for r in errors) == [0, 1], cluster.dump()
    took = [round(r["time"] - killed_at, 3) for r in errors]
    print(json.dumps({"server killed, workers told after s": took}))
    assert all(t < BROKEN_DEADLINE for t in took), (took, cluster.dump())
    assert all("server 0" in r["msg"] for r in errors), errors
    assert codes["scheduler"] == 1, codes
    assert abstract or not Path(uds).exists(), "the killed server's socket file was left behind"


def test_a_loss_report_about_a_ranks_earlier_process_is_ignored() -> None:
    """A server that could not reach where server 0 *was* (its earlier process, dead and
    restarted since) reports that loss late: the scheduler must not fail the live restart
    for it (the long chaos soak lost a shard so). A report naming the live process's
    endpoints, or none (as before), still counts."""
    from pskv._ps.scheduler import Scheduler, _Node
    from pskv.launch._net import free_port
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "1"}
    sched = Scheduler(ClusterConfig.from_env(env, Role.SCHEDULER))
    try:
        now = time.monotonic()
        live = {"uds": "@pskv-server-new", "r_uds": "@pskv-backup-new"}
        server0 = _Node(b"s0", "server", 0, {"role": "server", "endpoints": live}, now)
        server1 = _Node(b"s1", "server", 1, {"role": "server", "endpoints": {}}, now)
        sched._nodes = {b"s0": server0, b"s1": server1}
        earlier = {"uds": "@pskv-server-old", "r_uds": "@pskv-backup-old"}
        sched._peer_lost(server1, {"role": "server", "rank": 0, "endpoints": earlier})
        assert server0.lost == 0.0
        sched._peer_lost(server1, {"role": "server", "rank": 0, "endpoints": dict(live)})
        assert server0.lost > 0.0 and server0.lost_by == "server 1"
        server0.lost = 0.0
        sched._peer_lost(server1, {"role": "server", "rank": 0})
        assert server0.lost > 0.0
    finally:
        sched.loop.close()
        sched._zctx.close()
