"""kv.save_checkpoint / kv.load_checkpoint: exact round trips, onto other server counts."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import CheckpointError
from pskv.kvstore._snapshot import MANIFEST, Reader, latest, shard_name
from pskv.testing import InprocCluster

pytestmark = pytest.mark.timeout(120)

KEYS = ["small", "big", "emb"]
SHAPES = {"small": (3,), "big": (5, 8), "emb": (4, 2)}


def _grad(key: Any, step: int, rank: int) -> Any:
    rng = np.random.default_rng([step, rank, len(str(key))])
    return mx.nd.array(rng.standard_normal(SHAPES[key]).astype(np.float32))


def _init(kv: Any) -> None:
    for k in KEYS:
        kv.init(k, mx.nd.array(np.arange(np.prod(SHAPES[k]), dtype=np.float32)
                               .reshape(SHAPES[k]) / 10))


def _steps(kv: Any, first: int, last: int) -> None:
    for step in range(first, last):
        for k in KEYS:
            kv.push(k, _grad(k, step, kv.rank))
        for k in KEYS:
            kv.pull(k)


def _values(kv: Any) -> dict[Any, np.ndarray]:
    return {k: kv.pull(k).asnumpy() for k in KEYS}


def _run(cluster: InprocCluster, fn: Any, store_type: str = "dist_sync") -> dict[int, Any]:
    results = cluster.run(fn, store_type)
    for rank, got in results.items():
        if isinstance(got, BaseException):
            raise got
    return results


def _opt() -> Any:
    return mx.optimizer.Adam(learning_rate=0.05)


def test_local_round_trip_with_optimizer_states(tmp_path: Any) -> None:
    kv = mx.kv.create("local")
    _init(kv)
    kv.set_optimizer(_opt())
    _steps(kv, 0, 3)
    kv.save_checkpoint(str(tmp_path / "ck"))
    saved = _values(kv)
    _steps(kv, 3, 6)
    undisturbed = _values(kv)

    fresh = mx.kv.create("local")
    _init(fresh)
    fresh.set_optimizer(_opt())
    fresh.load_checkpoint(str(tmp_path / "ck"))
    for k in KEYS:
        np.testing.assert_array_equal(fresh.pull(k).asnumpy(), saved[k])
    _steps(fresh, 3, 6)      # Adam's moments and update counts came back too
    for k in KEYS:
        np.testing.assert_array_equal(fresh.pull(k).asnumpy(), undisturbed[k])


def test_files_are_numpy_and_json_with_a_manifest(tmp_path: Any) -> None:
    kv = mx.kv.create("local")
    _init(kv)
    kv.set_optimizer(_opt())
    _steps(kv, 0, 1)
    kv.save_checkpoint(str(tmp_path))
    with open(tmp_path / MANIFEST) as f:
        manifest = json.load(f)
    assert manifest["num_shards"] == 1 and manifest["format"] == "pskv.checkpoint"
    with np.load(tmp_path / shard_name(0), allow_pickle=False) as data:  # no pickle inside
        meta = json.loads(data["__meta__"].tobytes())
        assert sorted((e["key"] for e in meta["entries"]), key=str) == sorted(KEYS, key=str)
        assert all(data[name].dtype != object for name in data.files)


def test_dist_save_then_load_onto_other_server_counts(tmp_path: Any) -> None:
    ck = str(tmp_path / "ck")
    out: dict[str, Any] = {}

    def first(kv: Any) -> Any:
        _init(kv)
        kv.set_optimizer(_opt())
        _steps(kv, 0, 3)
        kv.save_checkpoint(ck)
        saved = _values(kv)
        _steps(kv, 3, 5)
        return saved, _values(kv)

    with InprocCluster(num_workers=2, num_servers=2, bigarray_bound=16) as cluster:
        results = _run(cluster, first)
    out["saved"], out["after"] = results[0]
    reader = Reader(ck)
    assert len(reader.parts["big"]) == 2        # split across the two servers that saved it
    reader.close()

    def resume(kv: Any) -> Any:
        _init(kv)
        kv.set_optimizer(_opt())
        kv.load_checkpoint(ck)
        loaded = _values(kv)
        _steps(kv, 3, 5)
        return loaded, _values(kv)

    for servers in (1, 3):
        with InprocCluster(num_workers=2, num_servers=servers, bigarray_bound=16) as cluster:
            results = _run(cluster, resume)
        for rank in (0, 1):
            loaded, after = results[rank]
            for k in KEYS:
                np.testing.assert_array_equal(loaded[k], out["saved"][k])
                np.testing.assert_array_equal(after[k], out["after"][k])

    local = mx.kv.create("local")         # and onto a local store
    _init(local)
    local.load_checkpoint(ck)
    for k in KEYS:
        np.testing.assert_array_equal(local.pull(k).asnumpy(), out["saved"][k])


def test_local_checkpoint_loads_into_a_cluster(tmp_path: Any) -> None:
    kv = mx.kv.create("local")
    _init(kv)
    kv.push("big", mx.nd.ones((5, 8)) * 3)
    kv.save_checkpoint(str(tmp_path))

    def fn(kv: Any) -> Any:
        _init(kv)
        kv.load_checkpoint(str(tmp_path))
        return kv.pull("big").asnumpy()

    with InprocCluster(num_workers=2, num_servers=2, bigarray_bound=16) as cluster:
        results = _run(cluster, fn)
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], np.full((5, 8), 3.0))


def test_mismatched_checkpoint_raises_on_every_worker(tmp_path: Any) -> None:
    kv = mx.kv.create("local")
    kv.init("other", mx.nd.ones((2,)))
    kv.save_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="is not a pskv checkpoint"):
        kv.load_checkpoint(str(tmp_path / "nothing"))
    wrong = mx.kv.create("local")
    wrong.init("other", mx.nd.ones((3,)))
    with pytest.raises(CheckpointError, match=r"key 'other' is \[3\] float32 here"):
        wrong.load_checkpoint(str(tmp_path / "ck"))
    np.testing.assert_array_equal(wrong.pull("other").asnumpy(), np.ones(3))   # unchanged

    def fn(kv: Any) -> Any:
        _init(kv)
        try:
            kv.load_checkpoint(str(tmp_path / "ck"))
        except CheckpointError as err:
            return str(err)
        return None

    with InprocCluster(num_workers=2) as cluster:
        results = cluster.run(fn)
    for rank in (0, 1):
        assert isinstance(results[rank], str) and "is not in checkpoint" in results[rank], \
            results[rank]


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_periodic_checkpoints_keep_the_last_few(tmp_path: Any, store_type: str) -> None:
    root = str(tmp_path)

    def fn(kv: Any) -> Any:
        _init(kv)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        seen = {}
        for step in range(8):
            for k in KEYS:
                kv.push(k, _grad(k, step, 0))      # same gradient on every worker
            kv.barrier()
            seen[step + 1] = _values(kv)
            kv.barrier()
        return seen

    # a round is one sync round (dist_sync) or one applied push (dist_async)
    every = 2 if store_type == "dist_sync" else 4
    with InprocCluster(num_workers=2, num_servers=2, bigarray_bound=16,
                       checkpoint_dir=root, checkpoint_every=every,
                       checkpoint_keep=2) as cluster:
        results = _run(cluster, fn, store_type)
    rounds = sorted(os.listdir(root))
    assert rounds == ["round-0000000012", "round-0000000016"] if every == 4 else \
        rounds == ["round-0000000006", "round-0000000008"], rounds
    newest = latest(root)
    assert newest is not None and newest.endswith(rounds[-1])
    fresh = mx.kv.create("local")
    _init(fresh)
    fresh.load_checkpoint(newest)
    for k in KEYS:
        np.testing.assert_array_equal(fresh.pull(k).asnumpy(), results[0][8][k])


def test_initial_values_are_the_checkpoint_of_round_zero(tmp_path: Any) -> None:
    # so that a server restarted before the first periodic checkpoint can reload its shard
    def fn(kv: Any) -> Any:
        _init(kv)
        kv.push("small", mx.nd.ones((3,)))      # the first push writes it: after the inits
        kv.barrier()
        return None

    with InprocCluster(num_workers=2, num_servers=3, bigarray_bound=16,
                       checkpoint_dir=str(tmp_path), checkpoint_every=100) as cluster:
        _run(cluster, fn)
    assert latest(str(tmp_path)) == os.path.join(str(tmp_path), "round-0000000000")
    fresh = mx.kv.create("local")
    _init(fresh)
    fresh.push("big", mx.nd.zeros((5, 8)))
    fresh.load_checkpoint(latest(str(tmp_path)) or "")
    np.testing.assert_array_equal(fresh.pull("big").asnumpy(),
                                  np.arange(40, dtype=np.float32).reshape(5, 8) / 10)
