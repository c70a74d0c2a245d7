"""Ranks chosen at launch: DMLC_WORKER_ID / DMLC_SERVER_ID, as BytePS's DMLC_WORKER_ID.

The launcher gives worker i (``[worker i]``) DMLC_WORKER_ID=i and the scheduler gives that
worker exactly rank i; two workers that claim one rank, or a rank out of range, are refused
with a clear error; nodes that claim nothing keep first-come ranks.
"""
from __future__ import annotations

import io
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from pskv._ps.config import ENV_SERVER_ID, ENV_WORKER_ID, ClusterConfig, Role
from pskv.errors import ClusterError, ConfigError
from pskv.launch import launch

from test_launch_local import assert_all_gone

pytestmark = pytest.mark.dist

PY = sys.executable

# Workers reach the scheduler in the reverse of their launch order: each takes a ticket
# from a shared file as it starts and waits the longer the earlier it came, so first-come
# ranks would be the launch order reversed. Then it prints kv.rank.
REVERSED = """
import fcntl, os, sys, time
import pskv as mx
with open(sys.argv[1], 'a+') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    ticket = len(f.read().split())
    f.write(f'{os.getpid()}\\n')
time.sleep(0.6 * (int(sys.argv[2]) - ticket))
kv = mx.kv.create('dist_sync')
print('rank', kv.rank, flush=True)
kv.close()
"""


@pytest.mark.timeout(120)
def test_worker_prefix_is_kv_rank(tmp_path: Path) -> None:
    n = 3
    out, err = io.StringIO(), io.StringIO()
    result = launch([PY, "-c", REVERSED, str(tmp_path / "tickets"), str(n)], n, 2,
                    stdout=out, stderr=err, timeout=90, shutdown_timeout=30)
    assert_all_gone([p.pid for p in result.processes])
    assert result.returncode == 0, err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[worker {i}] rank {i}" for i in range(n)], lines


@pytest.mark.timeout(120)
def test_server_prefix_is_server_rank(tmp_path: Path) -> None:
    # a server command that joins as a server and prints the rank the scheduler gave it;
    # servers reach the scheduler in reverse launch order, as the workers above
    server = [PY, "-c", (
        "import os, sys, time\n"
        "from pskv._ps.config import ClusterConfig, Role\n"
        "from pskv.kvstore.server._core import KVServer\n"
        "from pskv.server import run_node\n"
        "cfg = ClusterConfig.from_env()\n"
        "if cfg.role is Role.SCHEDULER:\n"
        "    sys.exit(run_node(cfg))\n"
        f"with open({str(tmp_path / 'tickets')!r}, 'a+') as f:\n"
        "    import fcntl; fcntl.flock(f, fcntl.LOCK_EX); f.seek(0)\n"
        "    ticket = len(f.read().split()); f.write('x\\n')\n"
        "time.sleep(0.6 * (3 - ticket))\n"
        "srv = KVServer(cfg)\n"
        "srv.po.start()\n"
        "print('rank', srv.po.rank, flush=True)\n"
        "srv.po.start = lambda: None\n"
        "sys.exit(srv.run())\n")]
    worker = [PY, "-c", "import pskv as mx; kv = mx.kv.create('dist_sync'); kv.close()"]
    out, err = io.StringIO(), io.StringIO()
    result = launch(worker, 1, 3, server_command=server, stdout=out, stderr=err, timeout=90,
                    shutdown_timeout=30)
    assert_all_gone([p.pid for p in result.processes])
    assert result.returncode == 0, err.getvalue()
    lines = sorted(line for line in out.getvalue().splitlines() if "rank" in line)
    assert lines == [f"[server {i}] rank {i}" for i in range(3)], lines


# -- the scheduler's side, with threads ------------------------------------------------------
def _claims(thread_cluster, ranks: list[int | None], **overrides) -> list[object]:
    """Workers that claim `ranks` (None: claim nothing): each one's kv.rank or error."""
    from pskv.kvstore.dist import DistKVStore
    cluster = thread_cluster(len(ranks), 1, **overrides)
    results: list[object] = [None] * len(ranks)

    def worker(i: int) -> None:
        try:
            kv = DistKVStore("dist_sync", replace(cluster.cfg, rank=ranks[i]))
        except ClusterError as err:
            results[i] = err
            return
        results[i] = kv.rank
        kv.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a worker did not finish in 30 s"
    return results


def test_claimed_ranks_are_given(thread_cluster) -> None:
    assert _claims(thread_cluster, [2, 0, 1]) == [2, 0, 1]


def test_unclaimed_nodes_take_the_free_ranks(thread_cluster) -> None:
    got = _claims(thread_cluster, [None, 0, None])
    assert got[1] == 0 and sorted([got[0], got[2]]) == [1, 2]  # type: ignore[type-var]


def test_two_workers_claiming_one_rank_are_refused(thread_cluster) -> None:
    got = _claims(thread_cluster, [0, 0], connect_timeout=3.0)
    assert all(isinstance(r, ClusterError) for r in got), got
    assert any(f"two workers claim rank 0 ({ENV_WORKER_ID}=0)" in str(r) for r in got), got


def test_rank_out_of_range_is_refused(thread_cluster) -> None:
    got = _claims(thread_cluster, [0, 2], connect_timeout=3.0)
    assert isinstance(got[1], ClusterError)
    assert f"{ENV_WORKER_ID}=2 is out of range" in str(got[1])
    assert "2 workers" in str(got[1])


def test_rank_variables_are_read_per_role() -> None:
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
           "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3", ENV_WORKER_ID: "1",
           ENV_SERVER_ID: "0"}
    assert ClusterConfig.from_env(env).rank == 1
    assert ClusterConfig.from_env(env, Role.SERVER).rank == 0
    assert ClusterConfig.from_env(env, Role.SCHEDULER).rank is None
    assert ClusterConfig.from_env({**env, ENV_WORKER_ID: ""}).rank is None
    with pytest.raises(ConfigError, match=f"{ENV_WORKER_ID}='x' is not an integer"):
        ClusterConfig.from_env({**env, ENV_WORKER_ID: "x"})
