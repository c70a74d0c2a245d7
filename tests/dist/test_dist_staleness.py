"""Bounded staleness on whole clusters run as threads (docs/embeddings.md, S1-S7).

The per-worker bound (a read after more than K unacknowledged pushes flushes first), the
global bound enforced by the servers (a worker more than K pushes ahead of the slowest
waits), and what ends a bounded wait: a worker that closes leaves the bound, a stuck one
gives a named StalenessTimeoutError, a lost one a named NodeFailedError. The tests assert
orders and counts, never timings; a sleep only makes a slow worker.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ClusterError, NodeFailedError, StalenessError, StalenessTimeoutError
from pskv.table import TableSpec

pytestmark = pytest.mark.timeout(90)


def ok(results: dict[int, Any]) -> dict[int, Any]:
    """Results by rank, raising the first worker exception."""
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


# ---- S2: the per-worker bound ---------------------------------------------------------------
@pytest.mark.parametrize("servers", [1, 2])
def test_k0_reads_its_own_writes_in_async(servers: int, run_threads: Any) -> None:
    steps = 8

    def fn(kv: Any) -> tuple[list[float], list[float], int]:
        kv.set_staleness(0)
        kv.init("emb", TableSpec(dim=3))
        kv.init(["w0", "w1"], [mx.nd.zeros((5,)), mx.nd.zeros((5,))])
        mine = f"w{kv.rank}"
        ids = np.arange(20, dtype=np.int64) * 7919 + kv.rank   # this worker's own rows
        rows, dense = [], []
        for step in range(1, steps + 1):
            # no optimizer: a push assigns (R12), so a read shows exactly the last push
            kv.push("emb", (ids, np.full((ids.size, 3), step, np.float32)))
            kv.push(mine, mx.nd.ones((5,)) * step)
            rows.append(float(kv.lookup("emb", ids, train=False)[0].min()))
            dense.append(float(kv.pull(mine).asnumpy().min()))
        return rows, dense, kv._reads.stale.flushes

    for rows, dense, flushes in ok(run_threads(fn, num_servers=servers,
                                               store_type="dist_async")).values():
        assert rows == dense == [float(s) for s in range(1, steps + 1)]
        # each step's lookup found its two pushes unacknowledged (K = 0) and flushed them;
        # the pull after it found none
        assert flushes == steps


def test_a_larger_k_flushes_once_every_k_plus_one_pushes(run_threads: Any) -> None:
    def fn(kv: Any) -> tuple[int, int]:
        kv.init("emb", TableSpec(dim=2))
        kv.set_staleness(2)
        ids = np.array([kv.rank], np.int64)
        for _ in range(9):
            kv.push("emb", (ids, np.ones((1, 2), np.float32)))
            kv.lookup("emb", ids)
            assert kv._reads.stale.unacked <= 2    # no read ran with more behind it
        return kv._reads.stale.flushes, kv._reads.stale.unacked

    for flushes, unacked in ok(run_threads(fn, store_type="dist_async")).values():
        assert (flushes, unacked) == (3, 0)


# ---- S3: the global bound -------------------------------------------------------------------
@pytest.mark.parametrize("what", ["table", "dense"])
@pytest.mark.parametrize("bound", [0, 2])
def test_global_bound_holds_the_fast_worker_back(what: str, bound: int,
                                                 run_threads: Any) -> None:
    steps = 10
    started = {0: 0, 1: 0}
    gaps: dict[int, list[int]] = {0: [], 1: []}
    mutex = threading.Lock()

    def fn(kv: Any) -> None:
        kv.set_staleness(None, global_bound=bound)
        kv.init("emb", TableSpec(dim=2))
        kv.init("w", mx.nd.zeros((4,)))
        me, other = kv.rank, 1 - kv.rank
        ids = np.array([3, 4, 5], np.int64)
        if me == 1:
            time.sleep(0.5)       # a slow worker (the assertions are on counts only)
        for _ in range(steps):
            with mutex:
                started[me] += 1          # counted before the push call: its clock
            if what == "table":
                kv.push("emb", (ids, np.ones((3, 2), np.float32)))
                kv.lookup("emb", ids)
            else:
                kv.push("w", mx.nd.ones((4,)))
                kv.pull("w")
            with mutex:
                gaps[me].append(started[me] - started[other])

    ok(run_threads(fn, store_type="dist_async", num_servers=2))
    # a read of a worker c pushes in returned only once the other had begun c - bound
    assert max(gaps[0] + gaps[1]) <= bound, gaps


def test_dist_sync_records_any_bound_and_changes_nothing(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.set_staleness(0, global_bound=3)
        kv.init("w", mx.nd.zeros((2,)))
        kv.push("w", mx.nd.ones((2,)))
        return kv._reads.bounds, kv._reads.stale, kv.pull("w").asnumpy().tolist()

    for bounds, stale, got in ok(run_threads(fn)).values():
        assert (bounds, stale, got) == ((0, 3), None, [2.0, 2.0])


# ---- S5: what ends a bounded wait -----------------------------------------------------------
def test_a_worker_that_closes_leaves_the_bound(run_threads: Any) -> None:
    def fn(kv: Any) -> int:
        kv.set_staleness(None, global_bound=0)
        kv.init("emb", TableSpec(dim=2))
        ids = np.array([1, 2], np.int64)
        if kv.rank == 1:
            kv.push("emb", (ids, np.ones((2, 2), np.float32)))
            return 1                      # closes: worker 0 may run ahead from now on
        for _ in range(6):
            kv.push("emb", (ids, np.ones((2, 2), np.float32)))
            kv.lookup("emb", ids)
        return kv._reads.stale.clock

    # with round_timeout 2 s, a worker 1 still counted would fail worker 0's lookups
    assert ok(run_threads(fn, store_type="dist_async", round_timeout=2.0)) == {0: 6, 1: 1}


def test_a_stuck_worker_gives_a_named_timeout(run_threads: Any) -> None:
    done = threading.Event()

    def fn(kv: Any) -> Any:
        kv.set_staleness(None, global_bound=1)
        kv.init("emb", TableSpec(dim=2))
        if kv.rank == 1:
            done.wait(30)                 # stuck: pushes nothing
            return None
        ids = np.array([9], np.int64)
        try:
            for _ in range(3):
                kv.push("emb", (ids, np.ones((1, 2), np.float32)))
                kv.lookup("emb", ids)
        except StalenessTimeoutError as err:
            return err
        finally:
            done.set()
        return None

    err = run_threads(fn, store_type="dist_async", round_timeout=1.0)[0]
    assert isinstance(err, StalenessTimeoutError), err
    text = str(err)
    assert "worker 1 (clock 0)" in text and "'emb'" in text and "worker 0 (clock 2)" in text


def test_a_lost_worker_fails_the_wait_naming_it(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.set_staleness(None, global_bound=0)
        kv.init("w", mx.nd.zeros((3,)))
        if kv.rank == 1:
            # dies: its links close without leaving the bound or saying goodbye
            import atexit
            atexit.unregister(kv._atexit)
            kv._keys.closed = True
            kv._po.close()
            kv._kv.close()
            kv._zctx.close()
            kv._reducer.close()
            return None
        try:
            for _ in range(50):
                kv.push("w", mx.nd.ones((3,)))
                kv.pull("w")
        except ClusterError as err:
            return err
        return None

    err = run_threads(fn, store_type="dist_async", round_timeout=30.0,
                      expect_codes=None)[0]
    assert isinstance(err, NodeFailedError), err
    assert "worker 1" in str(err)


# ---- S6: bad input ----------------------------------------------------------------------------
def test_bad_bounds_raise_on_every_worker_and_change_nothing(run_threads: Any) -> None:
    def fn(kv: Any) -> list[Any]:
        kv.init("w", mx.nd.zeros((2,)))
        kv.set_staleness(1)
        got = []
        for args in ((-1 if kv.rank == 0 else 1, {}),          # refused on worker 0 only
                     (1, {"global_bound": kv.rank}),           # the workers differ
                     (1.5, {})):                               # refused on both
            try:
                kv.set_staleness(args[0], **args[1])
                got.append(None)
            except StalenessError as err:
                got.append(str(err))
        kv.push("w", mx.nd.ones((2,)))
        got.append((kv._reads.bounds, kv._reads.stale.bound, kv._reads.stale.global_bound,
                    kv.pull("w").asnumpy().tolist()))
        return got

    res = ok(run_threads(fn, store_type="dist_async"))
    for rank, (neg, differ, flt, after) in res.items():
        assert "at least 0" in neg if rank == 0 else "refused on worker 0" in neg
        assert "worker 0: 0, worker 1: 1" in differ
        assert "whole number" in flt
        assert after == ((1, None), 1, None, [1.0, 1.0])     # no optimizer: assigned


def test_a_worker_in_a_barrier_holds_no_one_back(run_threads: Any) -> None:
    """Workers with unequal numbers of steps before a barrier (data shards of unequal
    size): the one waiting in the barrier does not hold the other's reads, and both
    count again after it."""
    def fn(kv: Any) -> list[int]:
        kv.set_staleness(None, global_bound=1)
        kv.init("emb", TableSpec(dim=2))
        ids = np.array([kv.rank], np.int64)
        clocks = []
        for epoch in range(2):
            for _ in range(3 if kv.rank == 0 else 8):
                kv.push("emb", (ids, np.ones((1, 2), np.float32)))
                kv.lookup("emb", ids)
            kv.barrier()
            clocks.append(kv._reads.stale.clock)
        return clocks

    # a worker 0 still counted in its barrier would stop worker 1 at clock 5 until the
    # 2 s timeout, and fail its lookup
    assert ok(run_threads(fn, store_type="dist_async", round_timeout=2.0)) == {
        0: [3, 6], 1: [8, 16]}


def test_a_dist_sync_server_refuses_a_global_bound_and_goes_on(run_threads: Any) -> None:
    from pskv._ps.message import Command
    from pskv._ps.ops import Op, command
    from pskv.errors import ProtocolError

    def fn(kv: Any) -> Any:
        kv.init("w", mx.nd.zeros((2,)))
        ts = kv._kv.request(0, Command.COMMAND, body=command(Op.CLOCK, clock=0, bound=1))
        try:
            kv._kv.wait(ts)
            got: Any = None
        except ProtocolError as err:
            got = str(err)
        kv.push("w", mx.nd.ones((2,)))
        return got, kv.pull("w").asnumpy().tolist()

    for got, value in ok(run_threads(fn)).values():
        assert "dist_async only" in got and value == [2.0, 2.0]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_worker_killed_under_a_global_bound_is_named_at_once(local_cluster: Any) -> None:
    """Real processes, SIGKILL: rank 0's pull waits on the server for rank 1 (global bound
    0, PSKV_GLOBAL_STALENESS); the server sees rank 1's link break and fails the wait
    naming it, well before any timeout (PSKV_ROUND_TIMEOUT is 60 s here)."""
    cluster = local_cluster(2, 1, env={"PSKV_GLOBAL_STALENESS": "0",
                                       "PSKV_ROUND_TIMEOUT": "60"})
    cluster.start("fail_node.py", "async-worker-dies")
    end = time.monotonic() + 30
    while time.monotonic() < end and {r["rank"] for p in cluster.workers
                                      for r in p.reports() if r.get("event") == "ready"} \
            != {0, 1}:
        time.sleep(0.05)
    time.sleep(0.3)                        # rank 0's pull now waits for rank 1
    killed_at = time.time()
    cluster.worker_by_rank(1).kill()
    cluster.wait(30)
    [err] = [r for p in cluster.workers for r in p.reports() if "error" in r]
    assert err["rank"] == 0 and err["error"] == "NodeFailedError", err
    assert "worker 1" in err["msg"], err
    assert err["time"] - killed_at < 20, err     # not the 60 s timeout
