"""The same misuse raises the same error class from a local and a dist store.

A server's error crosses the wire as its registered kind and is raised again as that class
on the worker; mismatched collective calls fail on every worker, naming the calls that met.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command
from pskv.errors import (ClusterError, KeyAlreadyInitializedError, KVStoreError,
                         OptimizerStateError, StoreClosedError)

pytestmark = pytest.mark.timeout(60)


def _local_outcome(misuse: Callable[[Any], Any]) -> type[BaseException] | None:
    kv = mx.kv.create("local")
    try:
        misuse(kv)
    except KVStoreError as err:
        return type(err)
    finally:
        kv.close()
    return None


def _bad_states_file(tmp: Path) -> Callable[[Any], Any]:
    path = tmp / "states.bin"
    path.write_bytes(b"this is not a pskv optimizer-states file")

    def misuse(kv: Any) -> None:
        kv.init(1, mx.nd.zeros((2,)))
        kv.set_optimizer(mx.optimizer.SGD())
        kv.load_optimizer_states(str(path))
    return misuse


def _bad_states_inside(tmp: Path) -> Callable[[Any], Any]:
    # a file of the dist layout whose server part is garbage: the server's check fails
    path = tmp / "states.npz"
    with open(path, "wb") as f:
        np.savez(f, server_0=np.frombuffer(b"garbage states", np.uint8))

    def misuse(kv: Any) -> None:
        kv.init(2, mx.nd.zeros((2,)))
        kv.set_optimizer(mx.optimizer.SGD())
        kv.load_optimizer_states(str(path))
    return misuse


def _second_init(kv: Any) -> None:
    kv.init(0, mx.nd.zeros((2,)))
    kv.init(0, mx.nd.zeros((2,)))


def test_same_class_from_local_and_dist(run_threads: Any, tmp_path: Path) -> None:
    cases = {"second init": _second_init, "bad states file": _bad_states_file(tmp_path),
             "bad states inside": _bad_states_inside(tmp_path)}
    want = {name: _local_outcome(fn) for name, fn in cases.items()}
    assert want == {"second init": KeyAlreadyInitializedError,
                    "bad states file": OptimizerStateError,
                    "bad states inside": OptimizerStateError}

    def fn(kv: Any) -> dict[str, Any]:
        got: dict[str, Any] = {}
        for name, misuse in cases.items():
            try:
                misuse(kv)
            except KVStoreError as err:
                got[name] = type(err)
            kv.barrier()
        return got

    results = run_threads(fn, 2, 1)
    for rank, got in results.items():
        assert got == want, (rank, got)


def test_server_error_keeps_its_class(run_threads: Any) -> None:
    # a server-side check (a stored part of another shape) comes back as its own class
    def fn(kv: Any) -> Any:
        kv.init(0, mx.nd.zeros((2,)))
        ts = kv._kv.request(0, Command.INIT, [0], {"entries": [{"key": 0, "shape": [2]}]},
                            [np.zeros(2, np.float32)])
        try:
            kv._kv.wait(ts, timeout=5)
        except KVStoreError as err:
            return err
        return None

    results = run_threads(fn, 1, 1)
    err = results[0]
    assert isinstance(err, KeyAlreadyInitializedError), err
    assert "(reported by server 0)" in str(err) and err.key == 0


def test_use_after_close_says_closed(run_threads: Any) -> None:
    kv = mx.kv.create("local")
    kv.close()
    with pytest.raises(StoreClosedError, match="closed"):
        kv.push(0, mx.nd.zeros((2,)))

    def fn(kv: Any) -> Any:
        kv.init(0, mx.nd.zeros((2,)))
        kv.close()
        try:
            kv.pull(0, out=mx.nd.zeros((2,)))
        except KVStoreError as err:
            return err
        return None

    err = run_threads(fn, 1, 1)[0]
    assert isinstance(err, StoreClosedError) and "closed" in str(err)


def test_mismatched_collectives_fail_on_every_worker(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        try:
            if kv.rank == 0:
                kv.init(0, mx.nd.zeros((2,)))
            else:
                kv.barrier()
        except KVStoreError as err:
            return err
        return None

    results = run_threads(fn, 2, 1)
    for rank, err in results.items():
        assert isinstance(err, ClusterError), (rank, err)
        msg = str(err)
        assert "worker 0 called init" in msg and "worker 1 called barrier" in msg, msg



def test_a_worker_of_another_job_on_the_port_is_told_so(thread_cluster: Any) -> None:
    """Two jobs on one port: a worker with another secret meets the first job's scheduler;
    its error names both causes (another secret, another job) and the fix (another port),
    not the secret alone."""
    from pskv.kvstore.dist import DistKVStore
    cluster = thread_cluster(1, 1)
    other = cluster.worker_config(secret=b"another job's secret", connect_timeout=10.0)
    with pytest.raises(ClusterError) as info:
        DistKVStore("dist_sync", other)
    msg = str(info.value)
    assert "refused this node's proof of the cluster secret" in msg
    assert "another pskv job's scheduler" in msg and "DMLC_PS_ROOT_PORT" in msg


def _no_listener_port() -> int:
    import socket
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


def test_a_node_says_while_it_waits_that_no_scheduler_answers(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No scheduler at the address: progress lines while the node waits, then an error that
    says the scheduler did not answer (not a generic 'waited for it to admit')."""
    import logging
    from pskv._ps import postoffice
    from pskv._ps.config import ClusterConfig, Role
    from pskv.errors import ClusterTimeoutError
    from pskv.kvstore.dist import DistKVStore
    monkeypatch.setattr(postoffice, "WAIT_PROGRESS", 0.3, raising=False)
    caplog.set_level(logging.WARNING, logger="pskv._ps.postoffice")
    port = _no_listener_port()
    cfg = ClusterConfig(Role.WORKER, root_port=port, num_workers=1, num_servers=1,
                        secret=b"s", connect_timeout=1.5, rank=1)
    with pytest.raises(ClusterTimeoutError) as info:
        DistKVStore("dist_sync", cfg)
    msg = str(info.value)
    assert f"the scheduler at tcp://127.0.0.1:{port} did not answer" in msg, msg
    assert "DMLC_PS_ROOT_URI/PORT" in msg and "PSKV_CONNECT_TIMEOUT" in msg
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.postoffice"]
    assert any(line.startswith(f"worker 1 still waiting for the scheduler at "
                               f"tcp://127.0.0.1:{port} (") and "of 1.5)" in line
               and "nothing answers there yet" in line for line in lines), lines


def test_a_node_the_scheduler_answered_is_told_the_others_did_not_join(
        thread_cluster: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A scheduler that runs but waits for a worker that never joins: the progress lines
    and the error say so (connected; every node must join), not that nothing answers."""
    import logging
    from pskv._ps import postoffice
    from pskv.errors import ClusterTimeoutError
    from pskv.kvstore.dist import DistKVStore
    monkeypatch.setattr(postoffice, "WAIT_PROGRESS", 0.3, raising=False)
    caplog.set_level(logging.WARNING, logger="pskv._ps.postoffice")
    cluster = thread_cluster(2, 1, secret=None)
    with pytest.raises(ClusterTimeoutError) as info:
        DistKVStore("dist_sync", cluster.worker_config(connect_timeout=1.5))
    msg = str(info.value)
    assert "the scheduler answered, but not every node of the job joined" in msg, msg
    assert "kv.create('dist_sync')" in msg and "did not answer" not in msg
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.postoffice"]
    assert any("connected, the scheduler waits for the job's other nodes" in line
               for line in lines), lines


def test_a_cluster_without_a_secret_says_so_once_per_node(
        run_threads: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A hand-started cluster without PSKV_SECRET admits anyone: each node says so, once,
    at WARNING; with a secret, and in a thread cluster's inproc transport, none does."""
    import logging
    from pskv.testing import InprocCluster
    caplog.set_level(logging.WARNING, logger="pskv._ps.auth")

    def train(kv: Any) -> int:
        kv.init("w", np.zeros(2, np.float32))
        kv.push("w", np.ones(2, np.float32))
        return int(kv.rank)

    assert run_threads(train, 2, 1, secret=None) == {0: 0, 1: 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "pskv._ps.auth"]
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.name == "pskv._ps.auth")
    who = sorted(line.split(":", 1)[0] for line in lines)
    assert who == ["server", "the scheduler", "worker", "worker"], lines
    for line in lines:
        assert "PSKV_SECRET is not set, so this cluster admits any process that reaches " \
            "tcp://127.0.0.1:" in line, line
        assert "any program of any user of this machine" in line and "pskv-launch" in line
    caplog.clear()
    assert run_threads(train, 2, 1) == {0: 0, 1: 1}             # with a secret: no word
    with InprocCluster(num_workers=1) as cluster:                 # inproc: no word either
        cluster.run(train)
    assert [r for r in caplog.records if r.name == "pskv._ps.auth"] == []
