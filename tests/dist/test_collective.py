"""The collective path (docs/collective.md) on thread clusters of 2 to 4 workers: big dense
``dist_sync`` keys summed among the workers give the same bits as the servers' rounds, for
mixed calls, several sizes and dtypes; the choice is the same on every worker or it raises;
misuse raises a KVStoreError subclass; a worker whose links break is named at once."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from _compare import same as compare

import pskv as mx
from pskv._ps.collective.core import chunks
from pskv._ps.config import ClusterConfig
from pskv.errors import (ClusterError, ConfigError, KeyTypeError, KVStoreError,
                         NodeFailedError, UnsupportedError, ValueTypeError)
from pskv.table import TableSpec

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

#: key -> shape, dtype: sizes below, at and above the worker count, odd sizes, 2 dtypes
KEYS = {"a": ((3,), np.float32), "b": ((1000, 7), np.float32), "d": ((4097,), np.float64),
        "c": ((2, 2), np.float32), "small": ((6,), np.float32)}


def ok(results: dict[int, Any]) -> dict[int, Any]:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


def grad(rank: int, step: int, key: Any) -> np.ndarray:
    """A worker's push: magnitudes differing by rank, so that the order of the sum shows
    in the last bits."""
    shape, dtype = KEYS[key]
    rng = np.random.default_rng([rank, step, len(str(key))])
    return (rng.standard_normal(shape) * 10.0 ** (rank - 1)).astype(dtype)


def training(kv: Any, override: bool) -> dict[str, Any]:
    """Every call shape: init, push (single and lists, several devices), pull (out and
    out=None), pushpull (out and in place); with ``override`` some keys are chosen by
    set_collective, the rest by the threshold."""
    if override:
        kv.set_collective("a", True)          # 12 bytes: below any threshold
        kv.set_collective("c", False)         # 16 bytes: stays on the servers
    keys = list(KEYS)
    kv.init(keys, [np.full(KEYS[k][0], kv.rank + 1, KEYS[k][1]) for k in keys])
    got: dict[str, Any] = {"init": kv.pull(keys)}
    for step in range(3):
        kv.push(keys, [grad(kv.rank, step, k) for k in keys])
        outs = [np.empty(*KEYS[k]) for k in keys]
        kv.pull(keys, out=outs)
        got[f"pull{step}"] = outs
        # two devices: summed locally first (as the server path does)
        two = [grad(kv.rank, step + 10, "b"), grad(kv.rank, step + 20, "b")]
        out = np.empty(*KEYS["b"])
        kv.pushpull("b", two, out=out)
        got[f"pushpull{step}"] = out
        inplace = grad(kv.rank, step + 30, "d")
        kv.pushpull("d", inplace)
        got[f"inplace{step}"] = inplace
        got[f"new{step}"] = kv.pull(["b", "small"])
    got["on_path"] = sorted(str(k) for k, rec in kv._store.items() if rec.collective)
    return got


def same(x: Any, y: Any) -> None:
    compare(x, y, skip=("on_path",))


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_collective_keys_give_the_servers_bits(run_threads: Any, workers: int) -> None:
    servers = ok(run_threads(lambda kv: training(kv, False), num_workers=workers))
    both = ok(run_threads(lambda kv: training(kv, True), num_workers=workers,
                          num_servers=2, collective_bytes=100))
    for r in range(workers):
        assert servers[r]["on_path"] == []
        assert both[r]["on_path"] == ["a", "b", "d"]     # "c" and "small" on the servers
        same(both[r], servers[r])
        same(both[r], both[0])                           # every worker the same round
    # and the round is the rank-order sum (the engine's rule)
    want = grad(0, 0, "b").copy()
    for r in range(1, workers):
        want += grad(r, 0, "b")
    same(both[0]["pull0"][1], want)


def test_chunks_cover_every_element_once() -> None:
    for size in (0, 1, 3, 4, 5, 1001):
        for w in (1, 2, 3, 4, 7):
            c = chunks(size, w)
            assert [lo for lo, _ in c][0] == 0 and c[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(c, c[1:]))
            assert max(hi - lo for lo, hi in c) - min(hi - lo for lo, hi in c) <= 1


def test_a_worker_that_closes_right_after_its_push_still_serves_its_chunk(
        run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(64, np.float32))
        if kv.rank == 0:            # pushes and closes at once: its chunk's sum, which
            kv.push("w", np.full(64, 1.0, np.float32))   # needs the others' later
            return None                                   # pushes, must still go out
        time.sleep(0.3)
        kv.push("w", np.full(64, kv.rank + 1.0, np.float32))
        return kv.pull("w")

    res = ok(run_threads(fn, num_workers=3, collective_bytes=8))
    for r in (1, 2):
        np.testing.assert_array_equal(res[r], np.full(64, 6.0, np.float32))


def test_a_pull_before_any_push_returns_rank_0s_init(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.full(50, kv.rank + 7.0, np.float32))
        return kv.pull("w"), kv._store["w"].collective

    for value, on_path in ok(run_threads(fn, collective_bytes=8)).values():
        assert on_path and np.array_equal(value, np.full(50, 7.0, np.float32))


def test_set_optimizer_moves_the_keys_back_to_the_servers(run_threads: Any) -> None:
    # MXNet's Module inits, then sets the optimizer: the keys go back to the servers
    def fn(kv: Any, late: bool) -> Any:
        kv.init("w", np.ones(64, np.float32))
        if late:
            kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
        for step in range(2):
            kv.push("w", np.full(64, kv.rank + step, np.float32))
        return kv.pull("w"), kv._store["w"].collective

    a = ok(run_threads(lambda kv: fn(kv, True), collective_bytes=8))
    for value, on_path in a.values():
        assert not on_path
        # 1 - 0.5 * (0 + 1) - 0.5 * (1 + 2)
        np.testing.assert_array_equal(value, np.full(64, -1.0, np.float32))

    def after_push(kv: Any) -> Any:
        kv.init("w", np.ones(64, np.float32))
        kv.push("w", np.full(64, kv.rank + 0.5, np.float32))
        kv.pull("w")           # the round is over on either path (docs/collective.md)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))    # the last round moves
        moved = kv._store["w"].collective
        first = kv.pull("w")
        kv.push("w", np.full(64, kv.rank + 1.0, np.float32))
        return first, kv.pull("w"), moved

    on = ok(run_threads(after_push, collective_bytes=8))
    off = ok(run_threads(after_push, collective_bytes=0))
    for rank in (0, 1):
        assert on[rank][2] is False
        same(list(on[rank][:2]), list(off[rank][:2]))
        np.testing.assert_array_equal(on[rank][0], np.full(64, 2.0, np.float32))
        # 2 - 0.5 * (1 + 2)
        np.testing.assert_array_equal(on[rank][1], np.full(64, 0.5, np.float32))


def test_a_server_refuses_values_for_a_key_it_was_pushed(thread_cluster: Any) -> None:
    """Op.ADOPT replaces only a key no push reached on the server, with a value that fits;
    else ProtocolError, the value unchanged, the server going on."""
    from pskv._ps.message import Command
    from pskv._ps.ops import Op, command
    from pskv._ps.partition import ps_key
    cluster = thread_cluster(1)

    def fn(kv: Any) -> list[str]:
        kv.init("w", np.zeros(10, np.float32))
        kv.push("w", np.ones(10, np.float32))
        kv.pull("w")
        errors = []
        for arrays in ([np.full(10, 5.0, np.float32)], [np.full(9, 5.0, np.float32)]):
            ts = kv._kv.request(0, Command.COMMAND, arrays=arrays,
                                body=command(Op.ADOPT, values=[ps_key("w")]))
            with pytest.raises(KVStoreError) as info:
                kv._kv.wait_all([ts], "adopt")
            errors.append(str(info.value))
        errors.append(str(kv.pull("w")[0]))
        return errors

    got = ok(cluster.run(fn, "dist_sync", 30.0))[0]
    assert "was pushed to this server" in got[0] and "does not fit" in got[1], got
    assert got[2] == "1.0"


def test_keys_chosen_after_set_optimizer_or_compression_stay_on_the_servers(
        run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("w", np.zeros(64, np.float32))
        with pytest.raises(UnsupportedError):
            kv.set_collective("x", True)
            kv.init("x", np.zeros(64, np.float32))
        return kv._store["w"].collective

    assert all(v is False for v in ok(run_threads(fn, collective_bytes=8)).values())


def test_bad_input_raises_kvstore_errors(run_threads: Any) -> None:
    with pytest.raises(ConfigError, match="PSKV_COLLECTIVE_BYTES"):
        ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "1",
                                "DMLC_NUM_WORKER": "2", "PSKV_COLLECTIVE_BYTES": "-1"})

    def fn(kv: Any) -> list[str]:
        kv.init("dense", np.zeros(64, np.float32))
        kv.init("rsp", mx.nd.sparse.zeros("row_sparse", (8, 4)))
        kv.init("table", TableSpec(dim=4))
        caught = []
        for call in (lambda: kv.set_collective("rsp", True),
                     lambda: kv.set_collective("table", True),
                     lambda: kv.set_collective("dense", False),
                     lambda: kv.set_collective(["x", 1.5]),
                     lambda: kv.set_collective("x", "yes")):
            with pytest.raises(KVStoreError) as info:
                call()
            caught.append(type(info.value).__name__ + ": " + str(info.value))
        kv.set_collective("later", True)
        with pytest.raises(KVStoreError):
            kv.init("later", mx.nd.sparse.zeros("row_sparse", (8, 4)))
        kv.set_collective("t2", True)
        with pytest.raises(UnsupportedError, match="table key stays on the servers"):
            kv.init("t2", TableSpec(dim=4))
        return caught

    for caught in ok(run_threads(fn, collective_bytes=8)).values():
        assert caught[0].startswith("UnsupportedError") and "row_sparse" in caught[0]
        assert caught[1].startswith("UnsupportedError") and "table key" in caught[1]
        assert caught[2].startswith("UnsupportedError") and "initialized already" in caught[2]
        assert caught[3].startswith(KeyTypeError.__name__)
        assert caught[4].startswith(ValueTypeError.__name__)

    def on_async(kv: Any) -> None:
        with pytest.raises(UnsupportedError, match="dist_async"):
            kv.set_collective("w", True)
        kv.set_collective("w", False)      # keeping a key on the servers is always fine

    ok(run_threads(on_async, store_type="dist_async"))
    mx.kv.create("local").set_collective("w", True)      # a local store keeps its keys


def _checkpointed(kv: Any, where: str) -> dict[str, Any]:
    """Two rounds of a big key ("w", 3 segments with 2 servers) and a small one, a
    checkpoint, a third round; then the checkpoint loaded back: what each read gives."""
    kv.init(["w", "s"], [np.zeros((40, 5), np.float32), np.zeros(3, np.float32)])
    for step in range(2):
        kv.push(["w", "s"], [np.full((40, 5), kv.rank + step + 0.25, np.float32),
                             np.full(3, kv.rank + 1.0, np.float32)])
    got: dict[str, Any] = {"pulled": kv.pull("w")}
    kv.save_checkpoint(where)
    kv.push("w", np.full((40, 5), 100.0, np.float32))
    got["after"] = kv.pull("w")
    kv.load_checkpoint(where)
    got["loaded"] = kv.pull(["w", "s"])      # the checkpoint's, not the last round's
    kv.push("w", np.full((40, 5), 7.0, np.float32))
    got["next"] = kv.pull("w")                 # a round after the load: the sum again
    got["on_path"] = bool(kv._store["w"].collective)
    return got


@pytest.mark.parametrize("servers", [1, 2])
def test_a_checkpoint_holds_the_collective_keys_values(run_threads: Any, tmp_path: Any,
                                                      servers: int) -> None:
    """save_checkpoint writes a collective key's last round (worker 0's, sent to each
    server with its part), and load_checkpoint reads it back until the next push: the
    same as a run on the servers, loaded by any server count."""
    on = ok(run_threads(lambda kv: _checkpointed(kv, str(tmp_path / "on")),
                        num_servers=servers, collective_bytes=64))
    off = ok(run_threads(lambda kv: _checkpointed(kv, str(tmp_path / "off")),
                         num_servers=servers, collective_bytes=0))
    assert on[0]["on_path"] and not off[0]["on_path"]
    for rank in (0, 1):
        same(on[rank], off[rank])
    want = np.full((40, 5), 1.25 + 2.25, np.float32)    # round 2: ranks 0 and 1
    assert np.array_equal(on[0]["pulled"], want)
    assert np.array_equal(on[0]["loaded"][0], want)
    assert float(on[0]["after"][0, 0]) == 200.0 and float(on[0]["next"][0, 0]) == 14.0

    def fresh(kv: Any) -> Any:           # another job, another server count
        kv.init(["w", "s"], [np.zeros((40, 5), np.float32), np.zeros(3, np.float32)])
        kv.load_checkpoint(str(tmp_path / "on"))
        return kv.pull("w")

    for got in ok(run_threads(fresh, num_servers=3 - servers, collective_bytes=64)).values():
        assert np.array_equal(got, want)


def test_a_server_refuses_a_checkpoint_value_that_does_not_fit(thread_cluster: Any,
                                                               tmp_path: Any) -> None:
    """A worker's CHECKPOINT with a value of the wrong size, an unknown key or keys that
    do not match the arrays is refused with a ProtocolError; the server goes on."""
    from pskv._ps.message import Command
    from pskv._ps.ops import Op, command
    from pskv._ps.partition import ps_key
    cluster = thread_cluster(1)

    def fn(kv: Any) -> list[str]:
        kv.init("w", np.zeros(10, np.float32))
        errors = []
        for keys, arrays in (([ps_key("w")], [np.zeros(9, np.float32)]),
                             ([ps_key("nope")], [np.zeros(10, np.float32)]),
                             ([ps_key("w")], []), (["w"], [np.zeros(10, np.float32)])):
            ts = kv._kv.request(0, Command.COMMAND, arrays=arrays, body=command(
                Op.CHECKPOINT, path=str(tmp_path / "bad"), values=keys))
            with pytest.raises(KVStoreError) as info:
                kv._kv.wait_all([ts], "checkpoint")
            errors.append(type(info.value).__name__ + ": " + str(info.value))
        kv.push("w", np.ones(10, np.float32))
        errors.append(str(kv.pull("w")[0]))
        return errors

    got = ok(cluster.run(fn, "dist_sync", 30.0))[0]
    assert all("ProtocolError" in e or "values" in e for e in got[:4]), got
    assert "does not fit" in got[0] and "does not fit" in got[1]
    assert got[4] == "1.0"


@pytest.mark.parametrize("feature", [{"replicas": 1}, {"max_restarts": 2}])
def test_by_default_a_job_with_failover_keeps_big_keys_on_the_servers(
        run_threads: Any, feature: dict[str, int]) -> None:
    """The default route (no PSKV_COLLECTIVE_BYTES, no set_collective) never puts a key
    where replicas or restarts cannot see it: a 1 MiB key stays on the servers, and its
    rounds are the servers' (the same sum)."""
    from pskv._ps.config import DEFAULT_COLLECTIVE_BYTES

    def fn(kv: Any) -> Any:
        kv.init("big", np.zeros(DEFAULT_COLLECTIVE_BYTES, np.float32))
        kv.push("big", np.full(DEFAULT_COLLECTIVE_BYTES, kv.rank + 1.0, np.float32))
        return kv._store["big"].collective, float(kv.pull("big")[-1])

    for on_path, last in ok(run_threads(fn, num_servers=2, **feature)).values():
        assert on_path is False and last == 3.0
    for on_path, last in ok(run_threads(fn, num_servers=2)).values():
        assert on_path is True and last == 3.0


def test_sealed_links_keep_every_key_on_the_servers(run_threads: Any) -> None:
    def fn(kv: Any) -> bool:
        with pytest.raises(UnsupportedError, match="PSKV_ENCRYPT"):
            kv.set_collective("x", True)
        kv.init("w", np.zeros(64, np.float32))
        return bool(kv._store["w"].collective)

    assert ok(run_threads(fn, encrypt=True, collective_bytes=8)) == {0: False, 1: False}


def test_workers_that_choose_differently_raise_on_every_worker(thread_cluster: Any) -> None:
    cluster = thread_cluster(2)
    configs = [cluster.worker_config(collective_bytes=8), cluster.worker_config()]

    def fn(kv: Any) -> None:
        kv.init("w", np.zeros(64, np.float32))

    results = cluster.run(fn, configs=configs)
    for r in (0, 1):
        assert isinstance(results[r], ClusterError), results[r]
        assert "disagree on the collective path: key 'w'" in str(results[r])


def test_a_message_out_of_order_fails_both_sides_not_the_thread(run_threads: Any) -> None:
    from pskv._ps.message import Command

    def fn(kv: Any) -> str:
        kv.init("w", np.zeros(64, np.float32))
        pskey = kv._store["w"].pskey
        if kv.rank == 1:            # a push of round 5 before round 1: against the rules
            with kv._peers.path._cond:
                kv._peers.path._queue(0, Command.PUSH, 5, pskey, np.ones(32, np.float32))
            kv._peers.path._wake()
        with pytest.raises(ClusterError) as info:
            for _ in range(100):    # the refusal reaches worker 1 within a round or two
                kv.push("w", np.ones(64, np.float32))
                kv.pull("w")
        return str(info.value)

    res = ok(run_threads(fn, collective_bytes=8))
    assert "worker 1 sent key 'w': round 5 after round 0" in res[0], res[0]
    assert "round 5 after round 0" in res[1] and "reported by worker 0" in res[1], res[1]


def test_a_worker_whose_links_break_is_named_at_once(thread_cluster: Any) -> None:
    cluster = thread_cluster(3, request_timeout=60.0, collective_bytes=8)
    both_heard = threading.Barrier(2)

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(300, np.float32))
        if kv.rank == 2:        # one good round, then it dies: its links close, no goodbye
            kv.push("w", np.ones(300, np.float32))
            kv.pull("w")
            for conn in kv._peers.path._conns.values():
                conn.sock.shutdown(socket.SHUT_RDWR)
            return "dead"
        with pytest.raises(NodeFailedError, match="worker 2 is gone") as info:
            for _ in range(2):      # the first round may finish or not: the second cannot
                kv.push("w", np.ones(300, np.float32))
                kv.pull("w")
        # neither closes its store before both heard: a store closed first would be what
        # the other's round fails on (WorkerClosedError naming it, not worker 2)
        both_heard.wait(timeout=30)
        return str(info.value)

    # the run's bound is below the request timeout: a wait for it would fail the test
    results = cluster.run(fn, timeout=40)
    assert results[2] == "dead"
    for r in (0, 1):
        assert isinstance(results[r], str), results[r]


# ---- real processes ---------------------------------------------------------------------
@pytest.mark.parametrize("workers", [3])
def test_processes_print_the_same_digest_with_and_without_the_path(local_cluster: Any,
                                                                   workers: int) -> None:
    digests = {}
    # 0: every key on the servers; the default (256 KiB): the big key; 4096: the mid one too
    for setting, want in (("0", ()), (None, ("big",)), ("4096", ("big", "mid"))):
        env = {} if setting is None else {"PSKV_COLLECTIVE_BYTES": setting}
        cluster = local_cluster(workers, 1, env=env).start("collective_sum.py")
        codes = cluster.wait(60)
        assert set(codes.values()) == {0}, cluster.dump()
        reports = [r for p in cluster.workers for r in p.reports()]
        assert sorted(r["rank"] for r in reports) == list(range(workers)), cluster.dump()
        assert {tuple(r["collective"]) for r in reports} == {want}, reports
        digests[setting] = {r["digest"] for r in reports}
    assert len(digests["0"]) == 1 and digests["0"] == digests[None] == digests["4096"]


def test_a_worker_killed_mid_collective_is_named_on_the_others(local_cluster: Any) -> None:
    # a request timeout far beyond the test's bound: the error must come from the broken link
    cluster = local_cluster(2, 1, env={"PSKV_COLLECTIVE_BYTES": "64",
                                       "PSKV_REQUEST_TIMEOUT": "300"})
    cluster.start("fail_node.py", "worker-dies")
    end = time.monotonic() + 30
    while time.monotonic() < end and not all(
            any(r.get("event") == "ready" for r in p.reports()) for p in cluster.workers):
        time.sleep(0.05)
    victim = cluster.worker_by_rank(1)
    time.sleep(0.3)                        # rank 0 is now waiting for rank 1's push
    victim.kill()
    codes = cluster.wait(40)
    errors = [r for p in cluster.workers for r in p.reports() if "error" in r]
    assert len(errors) == 1, cluster.dump()
    err = errors[0]
    assert err["rank"] == 0 and err["error"] == "NodeFailedError", err
    assert "worker 1" in err["msg"], err
    assert codes[cluster.worker_by_rank(0).label] == 3


# ---- pskv.torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [2, 3])
def test_distributed_optimizer_weights_are_the_same_bits_on_the_collective_path(
        run_threads: Any, workers: int) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    import threading

    import pskv.torch as pt
    lock = threading.Lock()      # torch's default generator is global to the threads

    def fn(kv: Any) -> Any:
        with lock:
            torch.manual_seed(3)
            model = torch.nn.Sequential(torch.nn.Linear(5, 40), torch.nn.Tanh(),
                                        torch.nn.Linear(40, 40), torch.nn.Tanh(),
                                        torch.nn.Linear(40, 3))
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                      momentum=0.9),
                                      model.named_parameters(), kv, bucket_cap_mb=0.004)
        g = torch.Generator().manual_seed(11)
        for _ in range(3):
            x, y = torch.randn(8 * workers, 5, generator=g), torch.randint(0, 3, (8 * workers,),
                                                                           generator=g)
            rows = slice(8 * kv.rank, 8 * kv.rank + 8)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]) * 10.0 ** kv.rank,
                                              y[rows]).backward()
            opt.step()
        on_path = sum(rec.collective for rec in kv._store.values())
        return [p.detach().clone() for p in model.parameters()], on_path

    servers = ok(run_threads(fn, num_workers=workers))
    path = ok(run_threads(fn, num_workers=workers, collective_bytes=2000))
    for r in range(workers):
        assert servers[r][1] == 0 and 0 < path[r][1], (servers[r][1], path[r][1])
        for a, b in zip(path[r][0], servers[r][0]):
            assert torch.equal(a, b)
        for a, b in zip(path[r][0], path[0][0]):
            assert torch.equal(a, b)


_TORCH_SEED = threading.Lock()


def _torch_training(kv: Any, workers: int, **kw: Any) -> Any:
    """Three steps of a 3-layer MLP (buckets of about 4 KiB); the weights and which keys
    took the collective path."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    import pskv.torch as pt
    with _TORCH_SEED:            # torch's default generator is global to the threads
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(5, 40), torch.nn.Tanh(),
                                    torch.nn.Linear(40, 40), torch.nn.Tanh(),
                                    torch.nn.Linear(40, 3))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), kv, bucket_cap_mb=0.004, **kw)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, y = torch.randn(8 * workers, 5, generator=g), torch.randint(0, 3, (8 * workers,),
                                                                       generator=g)
        rows = slice(8 * kv.rank, 8 * kv.rank + 8)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]) * 10.0 ** kv.rank,
                                          y[rows]).backward()
        opt.step()
    on_path = sorted(str(k) for k, rec in kv._store.items() if rec.collective)
    return [p.detach().clone() for p in model.parameters()], on_path


def test_distributed_optimizer_collective_bytes_picks_its_buckets(run_threads: Any) -> None:
    """collective_bytes= (PSKV_COLLECTIVE_BYTES=0): buckets at least that big take the path,
    the same bits; set_collective(key, False) before the constructor wins; None and 0 leave
    every bucket on the servers; where the store cannot (one worker) nothing raises."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    servers = ok(run_threads(lambda kv: _torch_training(kv, 2, collective_bytes=None)))
    assert servers[0][1] == []

    def kept(kv: Any) -> Any:
        kv.set_collective("opt/bucket.0", False)
        return _torch_training(kv, 2, collective_bytes=512)

    both = ["opt/bucket.0", "opt/bucket.1"]           # 7052 and 960 bytes
    for fn, want in ((lambda kv: _torch_training(kv, 2, collective_bytes=512), both),
                     (kept, both[1:]),                 # bucket.0 kept on the servers
                     (lambda kv: _torch_training(kv, 2, collective_bytes=1024), both[:1])):
        path = ok(run_threads(fn))
        for r in range(2):
            assert path[r][1] == want
            for a, b in zip(path[r][0], servers[r][0]):
                assert torch.equal(a, b)
    assert ok(run_threads(lambda kv: _torch_training(kv, 2, collective_bytes=0)))[0][1] == []
    one = ok(run_threads(lambda kv: _torch_training(kv, 1, collective_bytes=1),
                         num_workers=1))
    assert one[0][1] == []


def test_distributed_optimizer_keeps_buckets_on_the_servers_with_a_server_feature(
        run_threads: Any) -> None:
    pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    sealed = ok(run_threads(lambda kv: _torch_training(kv, 2, collective_bytes=1),
                            encrypt=True))
    assert sealed[0][1] == [] and sealed[1][1] == []


def test_buffers_follow_the_last_bucket_onto_the_collective_path(run_threads: Any) -> None:
    """BatchNorm's buffers ride in the last bucket's message, so they take its path: the
    same weights and buffers (rank 0's) as on the servers, on every worker."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    import pskv.torch as pt

    def fn(kv: Any, collective_bytes: Any) -> Any:
        with _TORCH_SEED:
            torch.manual_seed(5)
            model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32),
                                        torch.nn.Tanh(), torch.nn.Linear(32, 3))
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters(), kv,
                                      named_buffers=model.named_buffers(),
                                      collective_bytes=collective_bytes)
        g = torch.Generator().manual_seed(kv.rank)       # each worker its own data
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        on_path = sorted(str(k) for k, rec in kv._store.items() if rec.collective)
        return [t.detach().clone() for t in model.state_dict().values()], on_path

    servers = ok(run_threads(lambda kv: fn(kv, None)))
    path = ok(run_threads(lambda kv: fn(kv, 64)))
    assert servers[0][1] == []
    for r in range(2):
        assert path[r][1] == ["opt/bucket.0", "opt/buffers.0", "opt/buffers.1"]
        for a, b in zip(path[r][0], servers[r][0]):
            assert torch.equal(a, b)
        for a, b in zip(path[r][0], path[0][0]):          # buffers: rank 0's everywhere
            assert torch.equal(a, b)
