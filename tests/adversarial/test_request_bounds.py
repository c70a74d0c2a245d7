"""Memory bombs from an admitted worker: every size a request implies is bounded first.

A few bytes of header can declare a huge key (a row_sparse INIT of shape (2**34, 0) costs
no bytes on the wire but a row id per row on the server), a huge placement (recorded in
checkpoints), a reply far larger than the request (row ids that repeat one wide row, a key
named many times) or many keys. Each is refused with a LimitError (or ShapeMismatchError
for a placement that lies) naming the setting, before the server allocates; the cluster
goes on. The limits are set small here so that the unfixed code's allocations stay small.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command
from pskv.errors import KeyNotInitializedError, LimitError, ShapeMismatchError

from .conftest import assert_unharmed, push_and_pull
from .test_limits import _peak_rss

LIMITS = dict(max_key_bytes=1 << 20, max_reply_bytes=1 << 20, max_keys_per_message=64)


def _ask(kv: Any, cmd: Command, keys: list[int], body: Any,
         arrays: list[np.ndarray]) -> BaseException | None:
    """Send a raw request as this (admitted) worker; the error it got, None if accepted."""
    ts = kv._kv.request(0, cmd, keys, body, arrays)
    try:
        kv._kv.wait(ts, timeout=10)
    except mx.KVStoreError as err:
        return err
    return None


def _init(key: int, shape: tuple[int, ...], part: np.ndarray, sparse: bool = False,
          place: Any = None) -> tuple[Command, list[int], Any, list[np.ndarray]]:
    spec: dict[str, Any] = {"key": key, "shape": list(part.shape),
                            "stype": "row_sparse" if sparse else "default"}
    if place is not None:
        spec["place"] = place
    return Command.INIT, [key], {"entries": [spec]}, [part]


@pytest.mark.timeout(90)
def test_declared_shapes_and_placements_are_bounded_before_allocation(
        thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, **LIMITS)
    got: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            attacks = {
                # 150 bytes on the wire; the unfixed server asks for 128 GiB of row ids
                "rsp 2**34 rows": _init(50, (1 << 34, 0), np.empty((1 << 34, 0), np.float32),
                                        sparse=True),
                # 32 MiB of row ids on the unfixed server (under 1 MiB allowed)
                "rsp 2**22 rows": _init(51, (1 << 22, 0), np.empty((1 << 22, 0), np.float32),
                                        sparse=True),
                "placement 10**12": _init(52, (3,), np.ones(3, np.float32),
                                          place=[0, 3, [10 ** 12]]),
                "placement past its key": _init(53, (3,), np.ones(3, np.float32),
                                                place=[5, 8, [6]]),
                "placement not a list": _init(54, (3,), np.ones(3, np.float32), place="x"),
                "placement negative": _init(55, (3,), np.ones(3, np.float32),
                                            place=[0, 3, [-3]]),
            }
            before = _peak_rss(reset=True)
            for name, (cmd, keys, body, arrays) in attacks.items():
                got[name] = _ask(kv, cmd, keys, body, arrays)
            got["grew"] = _peak_rss() - before
            for key in range(50, 56):    # nothing was initialized
                got[f"pull {key}"] = _ask(kv, Command.PULL, [key], None, [])
            go.set()
        else:
            go.wait(30)
        return push_and_pull(kv)

    res = cluster.run(fn, timeout=60)
    print(json.dumps({"process grew by MiB under the INIT bombs":
                      round(got.pop("grew") / 2 ** 20, 1)}))
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    for name in ("rsp 2**34 rows", "rsp 2**22 rows", "placement 10**12"):
        assert isinstance(got[name], LimitError), (name, got[name])
        assert "PSKV_MAX_KEY_BYTES" in str(got[name]), got[name]
        assert "(reported by server 0)" in str(got[name]), got[name]
    for name in ("placement past its key", "placement not a list", "placement negative"):
        assert isinstance(got[name], ShapeMismatchError), (name, got[name])
    for key in range(50, 56):
        assert isinstance(got[f"pull {key}"], KeyNotInitializedError), got[f"pull {key}"]


@pytest.mark.timeout(90)
def test_replies_and_key_counts_are_bounded(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, **LIMITS)
    got: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        # 4 rows of 64 KiB each (256 KiB, within the limits)
        kv.init(7, mx.nd.ones((4, 16384)).tostype("row_sparse"))
        if kv.rank == 0:
            pk = kv._store[7].pskey
            before = _peak_rss(reset=True)
            # 64 ids of one row: 4 MiB of reply from 512 bytes of request
            got["narrow ids"] = _ask(kv, Command.RSP_PULL, [pk], None,
                                     [np.zeros(64, np.int64)])
            # 1-byte ids: the unfixed server copies them to int64 first (8 bytes each)
            got["uint8 ids"] = _ask(kv, Command.RSP_PULL, [pk], None,
                                    [np.zeros(256, np.uint8)])
            # one key named 20 times: 5 MiB of reply
            got["key 20 times"] = _ask(kv, Command.PULL, [pk] * 20, None, [])
            got["65 keys"] = _ask(kv, Command.PULL, list(range(1000, 1065)), None, [])
            got["grew"] = _peak_rss() - before
            # what a worker may ask is still answered
            out = mx.nd.zeros((4, 16384)).tostype("row_sparse")
            kv.row_sparse_pull(7, out=out, row_ids=mx.nd.array([0, 3]))
            got["rows"] = out.asnumpy()[[0, 3]].sum()
            go.set()
        else:
            go.wait(30)
        return push_and_pull(kv)

    res = cluster.run(fn, timeout=60)
    print(json.dumps({"process grew by MiB under the reply bombs":
                      round(got.pop("grew") / 2 ** 20, 1)}))
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    for name in ("narrow ids", "uint8 ids"):       # repeated ids: refused whatever the limit
        assert isinstance(got[name], ShapeMismatchError), (name, got[name])
        assert "unique" in str(got[name]), got[name]
    assert isinstance(got["key 20 times"], LimitError), got["key 20 times"]
    assert "PSKV_MAX_REPLY_BYTES" in str(got["key 20 times"]), got["key 20 times"]
    assert isinstance(got["65 keys"], LimitError), got["65 keys"]
    assert "PSKV_MAX_KEYS_PER_MESSAGE" in str(got["65 keys"]), got["65 keys"]
    assert got["rows"] == 2 * 16384


@pytest.mark.timeout(60)
def test_a_worker_refuses_what_the_servers_would_on_every_worker(thread_cluster: Any) -> None:
    # a key over PSKV_MAX_KEY_BYTES: refused before anything is sent, on every worker (init
    # is collective), and nothing was initialized
    cluster = thread_cluster(2, 2, **LIMITS)

    def fn(kv: Any) -> Any:
        with pytest.raises(LimitError, match="PSKV_MAX_KEY_BYTES") as info:
            kv.init([3, 4], [mx.nd.zeros((4,)), mx.nd.zeros((1 << 19,))])
        with pytest.raises(LimitError, match="PSKV_MAX_KEYS_PER_MESSAGE"):
            kv.pull(list(range(65)), out=[mx.nd.zeros((1,))] * 65)
        kv.init(1, mx.nd.zeros((3,)))
        with pytest.raises(KeyNotInitializedError):
            kv.pull(3, out=mx.nd.zeros((4,)))
        return str(info.value), push_and_pull(kv)

    res = cluster.run(fn)
    for rank, (msg, _value) in res.items():
        assert "(reported by" not in msg, msg
    assert_unharmed(cluster, {r: v for r, (_m, v) in res.items()}, np.full(3, 2.0), 15)


@pytest.mark.timeout(90)
def test_a_row_sparse_reply_is_no_larger_than_the_rows_it_names_once(
        thread_cluster: Any) -> None:
    """Within the default 4 GiB reply limit, 4 KiB of uint8 row ids (one row, repeated)
    made the server build a reply 4,096 rows long (1 GiB for 256 KiB rows; 64 MiB here).
    Row ids are now sorted, unique and in range, as the worker sends them: the reply holds
    each of the key's rows at most once. Refused before any copy; what a worker asks is
    answered."""
    cluster = thread_cluster(1, 1)

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        kv.init(7, mx.nd.ones((4, 4096)).tostype("row_sparse"))
        pk = kv._store[7].pskey
        mine: dict[str, Any] = {}
        for name, rows in [("4 KiB of uint8 ids", np.zeros(4096, np.uint8)),
                           ("more ids than rows", np.arange(5, dtype=np.int64)),
                           ("unsorted", np.array([3, 1], np.int64)),
                           ("out of range", np.array([1, 4], np.uint8)),
                           ("negative", np.array([-1, 2], np.int8))]:
            mine[name] = _ask(kv, Command.RSP_PULL, [pk], None, [rows])
        mine["uint8 in order"] = _ask(kv, Command.RSP_PULL, [pk], None,
                                      [np.array([0, 2, 3], np.uint8)])
        out = mx.nd.zeros((4, 4096)).tostype("row_sparse")
        kv.row_sparse_pull(7, out=out, row_ids=mx.nd.array([3, 0, 3]))
        mine["rows"] = out.asnumpy().sum(axis=1)
        mine["closing"] = push_and_pull(kv)
        return mine

    mine = cluster.run(fn, timeout=60)[0]
    assert not isinstance(mine, BaseException), mine
    for name in ("4 KiB of uint8 ids", "more ids than rows", "unsorted", "out of range",
                 "negative"):
        assert isinstance(mine[name], ShapeMismatchError), (name, mine[name])
    assert "unique" in str(mine["4 KiB of uint8 ids"]), mine["4 KiB of uint8 ids"]
    assert mine["uint8 in order"] is None, mine["uint8 in order"]
    np.testing.assert_array_equal(mine["rows"], [4096, 0, 0, 4096])
    assert_unharmed(cluster, {0: mine["closing"]}, np.full(3, 1.0), 15)


@pytest.mark.timeout(90)
def test_tables_are_bounded_before_they_allocate(thread_cluster: Any) -> None:
    """A table shard counts against PSKV_MAX_KEY_BYTES like any key: a spec whose dim,
    reserved rows or admission counters cost more is refused at INIT, and a lookup or
    push whose new IDs would grow a shard past it is refused before any row is inserted
    (counted: ``budget_refusals``, the metric pskv_table_budget_refusals_total). Before,
    a 1 GiB dim was accepted, 2**40 reserved rows were a TableSpecError from the failed
    allocation, and 256 new IDs of 4 KiB grew the shard past its 1 MiB. A lookup's reply is
    bounded by PSKV_MAX_REPLY_BYTES like a pull's. IDs of every integer dtype are
    converted or refused with an error (uint64 closed the connection)."""
    from pskv.table import CountAdmission, TableSpec
    cluster = thread_cluster(1, 1, max_key_bytes=1 << 20, max_reply_bytes=2 << 20)

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        mine: dict[str, Any] = {}
        for name, spec in [("dim", TableSpec(dim=1 << 22)),
                           ("reserve_rows", TableSpec(dim=2, reserve_rows=1 << 40)),
                           ("counters", TableSpec(dim=2, admission=CountAdmission(
                               2, counters=1 << 31)))]:
            # as worker 0 sends it (the workers' own checker is not what is tested here)
            mine[f"init {name}"] = _ask(kv, Command.INIT, [1000], {"entries": [{
                "key": 10, "shape": [0, spec.dim], "stype": "table",
                "table": spec.to_json(), "shard": [0, 1]}]},
                [np.zeros((0, spec.dim), np.float32)])
        kv.init(20, TableSpec(dim=1024))                  # 4 KiB rows, 64 reserved
        kv.lookup(20, np.arange(16))
        try:
            kv.lookup(20, np.arange(100, 356))            # 1.1 MiB of new rows
        except mx.KVStoreError as err:
            mine["grow"] = err
        try:            # an eval lookup inserts nothing, but its reply was not bounded
            kv.lookup(20, np.arange(600), train=False)    # 2.4 MiB of rows
        except mx.KVStoreError as err:
            mine["reply"] = err
        pk = kv._tables.pskeys[20]
        body = {"op": "lookup", "key": pk, "train": True}
        mine["uint64 ids"] = _ask(kv, Command.COMMAND, [], body,
                                  [np.array([5000, 5001], np.uint64)])
        mine["uint64 over 2**63"] = _ask(kv, Command.COMMAND, [], body,
                                         [np.array([2**63 + 1], np.uint64)])
        mine["int16 ids"] = _ask(kv, Command.COMMAND, [], body,
                                 [np.array([6000, 6001], np.int16)])
        mine["uint64 key"] = _ask(kv, Command.INIT, [30],
                                  {"entries": [{"key": 30, "shape": [4]}]},
                                  [np.zeros(4, np.uint64)])
        mine["stats"] = kv.table_stats(20)
        mine["closing"] = push_and_pull(kv)
        return mine

    mine = cluster.run(fn, timeout=60)[0]
    assert not isinstance(mine, BaseException), mine
    for name in ("init dim", "init reserve_rows", "init counters", "grow"):
        assert isinstance(mine.get(name), LimitError), (name, mine.get(name))
        assert "PSKV_MAX_KEY_BYTES" in str(mine[name]), mine[name]
    assert isinstance(mine.get("reply"), LimitError), mine.get("reply")
    assert "PSKV_MAX_REPLY_BYTES" in str(mine["reply"]), mine["reply"]
    assert mine["uint64 ids"] is None and mine["int16 ids"] is None, mine
    assert isinstance(mine["uint64 over 2**63"], mx.KVStoreError), mine["uint64 over 2**63"]
    assert "2**63" in str(mine["uint64 over 2**63"])
    assert isinstance(mine["uint64 key"], mx.KVStoreError), mine["uint64 key"]
    stats = mine["stats"]
    assert stats["rows"] == 16 + 4 and stats["budget_refusals"] == 1, stats
    assert_unharmed(cluster, {0: mine["closing"]}, np.full(3, 1.0), 15)


def test_a_worker_refuses_an_oversized_table_with_a_limit_error(
        thread_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' own side of a table INIT: a dist worker holds the spec only (the
    rows live on the servers, which refuse the shard with a LimitError), and a local store
    checks the whole table against PSKV_MAX_KEY_BYTES before it allocates. Before, both
    raised a bare MemoryError from the worker's own reservation of 2**40 rows."""
    from pskv.table import TableSpec
    huge = TableSpec(dim=8, reserve_rows=1 << 40)
    with pytest.raises(LimitError, match="PSKV_MAX_KEY_BYTES") as info:
        mx.kv.create("local").init("emb", huge)
    assert info.value.key == "emb"
    monkeypatch.setenv("PSKV_MAX_KEY_BYTES", str(1 << 20))
    local = mx.kv.create("local")
    with pytest.raises(LimitError, match="PSKV_MAX_KEY_BYTES=1048576"):
        local.init("emb", TableSpec(dim=1024, reserve_rows=1024))   # 4 MiB of rows
    local.init("emb", TableSpec(dim=8))                               # nothing was kept
    monkeypatch.delenv("PSKV_MAX_KEY_BYTES")

    cluster = thread_cluster(2, 2)

    def fn(kv: Any) -> Any:
        out: dict[str, Any] = {}
        try:
            kv.init("emb", huge)
        except mx.KVStoreError as err:
            out["huge"] = err
        kv.init("ok", TableSpec(dim=8, reserve_rows=10_000_000))    # 1e7 rows: servers'
        checker = kv._tables.tables["ok"]
        out["checker rows"] = getattr(checker, "_values", np.empty(0)).shape[0]
        out["checker"] = type(checker).__name__
        out["spec"] = checker.spec.reserve_rows
        return out

    for rank, got in cluster.run(fn, "dist_sync", 60).items():
        assert not isinstance(got, BaseException), (rank, got)
        assert isinstance(got["huge"], LimitError), (rank, got)
        assert "PSKV_MAX_KEY_BYTES" in str(got["huge"]), (rank, got)
        assert got["checker"] == "TableKey" and got["checker rows"] == 0, (rank, got)
        assert got["spec"] == 10_000_000, (rank, got)
