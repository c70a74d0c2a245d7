"""Multi-key calls change all or nothing; optimizer specs and barrier stragglers are named.

The hard case is a call whose keys live on different servers: one server could accept its
part while another refuses. The worker therefore refuses everything it can before sending
(values, dtypes, sizes: on every worker for a collective init), and each server validates
its whole message before any change. Run on a 2-server thread cluster.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command
from pskv.errors import (ClusterTimeoutError, ConfigError, KeyNotInitializedError,
                         KVStoreError, LimitError, ShapeMismatchError)

from .conftest import assert_unharmed, push_and_pull


def _ask(kv: Any, cmd: Command, keys: list[int], body: Any,
         arrays: list[np.ndarray]) -> BaseException | None:
    ts = kv._kv.request(0, cmd, keys, body, arrays)
    try:
        kv._kv.wait(ts, timeout=10)
    except KVStoreError as err:
        return err
    return None


@pytest.mark.timeout(90)
def test_two_key_calls_over_two_servers_change_nothing_when_one_key_is_bad(
        thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2, max_key_bytes=1 << 20)
    got: dict[str, Any] = {}
    go = threading.Event()
    ok = mx.nd.ones((3,))

    def fn(kv: Any) -> Any:
        kv.init([10, 11, 12, 13], [mx.nd.zeros((3,))] * 4)
        servers = {k: kv._store[k].segments[0].server for k in (10, 11, 12, 13)}
        mine: dict[str, Any] = {"servers": servers}
        # init: the second key's value is bad; the keys would go to both servers
        for name, keys, values in [
                ("complex dtype", [20, 21], [ok, np.ones(3, np.complex64)]),
                ("str dtype", [22, 23], [ok, np.array(["a", "b"])]),
                ("object dtype", [24, 25], [ok, np.array([None, 1], dtype=object)]),
                ("initialized before", [26, 11], [ok, ok]),
                ("over PSKV_MAX_KEY_BYTES", [27, 28], [ok, mx.nd.zeros((1 << 19,))])]:
            try:
                kv.init(keys, values)
            except KVStoreError as err:
                mine[f"init {name}"] = err
        for k in (20, 22, 24, 26, 27):
            try:
                kv.pull(k, out=mx.nd.zeros((3,)))
            except KeyNotInitializedError as err:
                mine[f"pull {k}"] = err
        # push: the second part is bad
        for name, values in [("complex", [ok, np.ones(3, np.complex64)]),
                             ("wrong shape", [ok, mx.nd.ones((4,))])]:
            try:
                kv.push([10, 11], values)
            except KVStoreError as err:
                mine[f"push {name}"] = err
        try:
            kv.push([10, 99], [ok, ok])
        except KVStoreError as err:
            mine["push uninitialized"] = err
        kv.barrier()
        mine["10 after"] = kv.pull(10).asnumpy()
        kv.barrier()
        if kv.rank == 0:
            # one server's whole message: a raw two-key INIT and PUSH to server 0 whose
            # second part is bad change nothing there either
            on0 = [k for k, s in servers.items() if s == 0]
            got["init"] = _ask(kv, Command.INIT, [40, 41], {"entries": [
                {"key": 40, "shape": [3]}, {"key": 41, "shape": [3], "place": [2, 1, [3]]}]},
                [np.ones(3, np.float32), np.ones(3, np.float32)])
            got["pull 40"] = _ask(kv, Command.PULL, [40], None, [])
            if len(on0) >= 2:
                pks = [kv._store[k].pskey for k in on0[:2]]
                got["push"] = _ask(kv, Command.PUSH, pks, {"kinds": "dd"},
                                   [np.full(3, 100, np.float32), np.ones(5, np.float32)])
                kv._kv.flush()
            go.set()
        else:
            go.wait(30)
        kv.barrier()
        kv.push(list(servers), [mx.nd.ones((3,))] * 4)
        mine["after push"] = {k: kv.pull(k).asnumpy() for k in servers}
        kv.init(20, mx.nd.full((3,), 5))        # refused before: it can be initialized now
        mine["20"] = kv.pull(20).asnumpy()
        mine["closing"] = push_and_pull(kv, 10)
        return mine

    res = cluster.run(fn, timeout=60)
    for rank, mine in res.items():
        assert not isinstance(mine, BaseException), (rank, mine)
        assert set(mine["servers"].values()) == {0, 1}, mine["servers"]
        for name in ("complex dtype", "str dtype", "object dtype", "initialized before",
                     "over PSKV_MAX_KEY_BYTES"):
            assert isinstance(mine.get(f"init {name}"), KVStoreError), (rank, name, mine)
        assert isinstance(mine["init over PSKV_MAX_KEY_BYTES"], LimitError)
        for k in (20, 22, 24, 26, 27):
            assert isinstance(mine.get(f"pull {k}"), KeyNotInitializedError), (rank, k, mine)
        for name in ("complex", "wrong shape", "uninitialized"):
            assert isinstance(mine.get(f"push {name}"), KVStoreError), (rank, name, mine)
        np.testing.assert_array_equal(mine["10 after"], np.zeros(3))
        for k, value in mine["after push"].items():
            np.testing.assert_array_equal(value, np.full(3, 2.0), err_msg=f"key {k}")
        np.testing.assert_array_equal(mine["20"], np.full(3, 5.0))
    assert isinstance(got["init"], KVStoreError), got
    assert isinstance(got["pull 40"], KeyNotInitializedError), got
    if "push" in got:     # refused at once (an accepted push is not answered: a timeout)
        assert isinstance(got["push"], ShapeMismatchError), got
    assert_unharmed(cluster, {r: m["closing"] for r, m in res.items()}, np.full(3, 2.0), 15)


class _ListSpec(mx.optimizer.SGD):
    """A custom optimizer whose spec is not a dict."""

    def to_spec(self) -> Any:
        return ["sgd", {"learning_rate": 0.1}]


def test_a_custom_optimizer_whose_spec_is_not_a_dict_is_a_config_error(
        run_threads: Any) -> None:
    """A dist store sends the spec, so it refuses one that is not a dict; a local store
    never sends it and runs the object, as MXNet 1.9.1 does (issue #29, item 4)."""
    local = mx.kv.create("local")
    local.init(3, mx.nd.ones((2,)))
    local.set_optimizer(_ListSpec(learning_rate=0.5))
    local.push(3, mx.nd.ones((2,)))
    np.testing.assert_allclose(local.pull(3).asnumpy(), [0.5, 0.5])

    def fn(kv: Any) -> Any:
        try:
            kv.set_optimizer(_ListSpec())
        except KVStoreError as err:
            return err
        return None

    res = run_threads(fn, 2, 1)
    for rank, err in res.items():
        assert isinstance(err, ConfigError) and "not a spec" in str(err), (rank, err)


@pytest.mark.timeout(60)
def test_a_worker_stuck_before_a_barrier_is_named(thread_cluster: Any) -> None:
    cluster = thread_cluster(3, 1, request_timeout=4.0)

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 2:
            time.sleep(6.0)           # stuck: never reaches the barrier the others wait at
            return None
        try:
            kv.barrier()
        except ClusterTimeoutError as err:
            return err
        return None

    res = cluster.run(fn, timeout=40)
    for rank in (0, 1):
        err = res[rank]
        assert isinstance(err, ClusterTimeoutError), (rank, err)
        assert "worker 2" in str(err) and "worker 0" in str(err), err
    cluster.join(15)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_every_request_kind_is_checked_whole_before_its_first_key_changes(
        thread_cluster: Any, store_type: str) -> None:
    """One server's two-key request whose second part is bad, for each request kind
    (push, pushpull, compressed push and pushpull, row_sparse push, table push): an error
    reply, and the first key unchanged. Before the fix a compressed part of the right
    word count but the wrong bytes was refused only when decompressed, after the first
    key's round was applied."""
    from pskv.table import TableSpec
    cluster = thread_cluster(1, 1)

    def fn(kv: Any) -> Any:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init([1, 2], [mx.nd.zeros((64,))] * 2)
        kv.init(3, mx.nd.zeros((4, 2), dtype="int32").tostype("row_sparse"))
        kv.init(4, TableSpec(dim=2))
        pk = {k: kv._store[k].pskey for k in (1, 2, 3)}
        pk["emb"] = kv._tables.pskeys[4]
        words = kv._store[2].segments[0].stop - kv._store[2].segments[0].start
        words = -(-words // 16)
        dense = np.ones(64, np.float32)
        bad_c = np.zeros(words, np.uint8)       # the word count, a quarter of the bytes
        cases = {
            "push, compressed second": (Command.PUSH, [pk[1], pk[2]], "dc", [dense, bad_c]),
            "pushpull, compressed second": (Command.PUSHPULL, [pk[1], pk[2]], "dc",
                                            [dense, bad_c]),
            "push, dense second": (Command.PUSH, [pk[1], pk[2]], "dd",
                                   [dense, np.ones(65, np.float32)]),
            "push, row_sparse second": (Command.PUSH, [pk[1], pk[3]], "dr",
                                        [dense, np.array([0], np.int64),
                                         np.ones((1, 2), np.float32)]),
            "push, table second": (Command.PUSH, [pk[1], pk["emb"]], "dt",
                                   [dense, np.array([5], np.int64),
                                    np.ones((1, 3), np.float32)]),
        }
        mine: dict[str, Any] = {}
        for name, (cmd, keys, kinds, arrays) in cases.items():
            mine[name] = _ask(kv, cmd, keys, {"kinds": kinds}, arrays)
            mine[f"{name}: key 1"] = kv.pull(1).asnumpy()
        mine["rows of 3"] = kv.pull(3).asnumpy()
        kv.push(1, mx.nd.ones((64,)))          # 2-bit: +0.5 where a value reaches 0.5
        mine["closing"] = kv.pull(1).asnumpy()
        return mine

    res = cluster.run(fn, store_type, timeout=60)
    mine = res[0]
    assert not isinstance(mine, BaseException), mine
    for name in ("push, compressed second", "pushpull, compressed second",
                 "push, dense second", "push, row_sparse second", "push, table second"):
        assert isinstance(mine[name], KVStoreError), (name, mine[name])
        np.testing.assert_array_equal(mine[f"{name}: key 1"], np.zeros(64), err_msg=name)
    assert isinstance(mine["push, compressed second"], ShapeMismatchError)
    assert "compress()" in str(mine["push, compressed second"])
    np.testing.assert_array_equal(mine["rows of 3"], np.zeros((4, 2)))
    assert_unharmed(cluster, {0: mine["closing"]}, np.full(64, 0.5), 15)
