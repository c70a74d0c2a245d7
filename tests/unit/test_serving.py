"""A serving replica (pskv.serving, V1-V4) following a local store's tables: no sockets."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, KeyNotInitializedError, KVStoreError, StaleReadError
from pskv.serving import Replica
from pskv.table import TTL, Capacity, TableSpec, Uniform


def _store(dtype="float32"):
    kv = mx.kv.create("local")
    kv.init("emb", TableSpec(dim=4, init=Uniform(-0.1, 0.1), seed=2, dtype=dtype,
                             eviction=(Capacity(max_rows=70, policy="lfu"), TTL(steps=5))))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    return kv


@pytest.mark.parametrize("dtype,raw", [("float32", False), ("bfloat16", True)])
def test_a_replica_holds_the_table_at_the_version_it_reports(dtype, raw):
    kv = _store(dtype)
    rng = np.random.default_rng(0)
    with Replica(kv, ["emb"], interval=3600, raw=raw) as rep:
        for step in range(60):
            ids = rng.integers(0, 200, 30)
            kv.lookup("emb", ids)
            kv.push("emb", (ids, rng.standard_normal((30, 4)).astype(np.float32)))
            if step % 9 == 0:
                rep.poll()
                v = kv.table_versions("emb")[0]
                table = kv._tables.get("emb", "read")
                want_ids = table.ids()
                got_ids, got_rows = rep.table("emb")
                assert np.array_equal(got_ids, want_ids)
                want = table._values[table._index.find(want_ids)] if raw else \
                    kv.lookup("emb", want_ids, train=False)[0]
                assert got_rows.tobytes() == np.ascontiguousarray(want).tobytes()
                rows, found, at = rep.lookup("emb", np.append(want_ids, -5), min_version=v)
                assert at == {0: v} and found[:-1].all() and not found[-1]
                assert not rows[-1].any()       # V3: an ID without a row reads zeros
        assert kv.table_stats("emb")["evictions"] > 0


def test_min_version_waits_then_says_how_stale():
    kv = _store()
    with Replica(kv, ["emb"], interval=3600) as rep:
        with pytest.raises(StaleReadError, match="shard 0 is at version 0 on this "
                                                 "replica, not yet 3, after 0.05 s"):
            rep.lookup("emb", np.array([1]), min_version=3, timeout=0.05)
        kv.lookup("emb", np.arange(3))
        rep.poll()
        assert rep.lookup("emb", np.array([1]), min_version={0: 1})[2] == {0: 1}


def test_misuse_is_refused():
    kv = _store()
    with pytest.raises(ConfigError, match="non-empty list"):
        Replica(kv, [])
    with pytest.raises(ConfigError, match="interval"):
        Replica(kv, ["emb"], interval=-1)
    with pytest.raises(KeyNotInitializedError):
        Replica(kv, ["nope"])
    with Replica(kv, ["emb"], interval=3600) as rep:
        with pytest.raises(KVStoreError, match="serves tables \\['emb'\\], not 'x'"):
            rep.lookup("x", np.array([1]))
        with pytest.raises(KVStoreError, match="IDs must be integers"):
            rep.lookup("emb", np.array([1.5]))
