"""The change stream of a table on the servers (docs/embeddings.md E1-E10), thread clusters:
a subscriber's mirror equals the servers' table bit for bit, across pages and resumes."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, KeyNotInitializedError, UnsupportedError
from pskv.table import TTL, Capacity, RowMirror, TableSpec, Uniform

pytestmark = pytest.mark.dist


def _spec():
    return TableSpec(dim=4, init=Uniform(-0.1, 0.1), seed=7,
                     eviction=(Capacity(max_rows=80, policy="lfu"), TTL(steps=5)))


@pytest.mark.parametrize("store_type,max_rows", [("dist_sync", 65536), ("dist_async", 5)])
def test_a_subscribers_mirror_equals_the_servers_table(run_threads, store_type, max_rows):
    def fn(kv):
        kv.init("emb", _spec())
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
        rng = np.random.default_rng(kv.rank)
        sub = kv.subscribe("emb", max_rows=max_rows) if kv.rank == 0 else None
        mirror = RowMirror(4, key="emb")
        positions = []
        for step in range(30):
            ids = rng.integers(0, 300, 40)
            kv.lookup("emb", ids)
            kv.push("emb", (ids, rng.standard_normal((40, 4)).astype(np.float32)))
            if sub is not None and step % 7 == 3:
                for b in sub.poll():
                    mirror.apply(b)
                positions.append(sub.position)
        kv.barrier()
        if sub is None:
            kv.barrier()
            return None
        for b in sub.poll():
            mirror.apply(b)
        ids = kv.lookup("emb", mirror.ids(), train=False)
        want_ids = np.sort(np.concatenate([mirror.ids()]))
        got = mirror.get(want_ids)[0]
        versions = kv.table_versions("emb")
        stats = kv.table_stats("emb")
        # a second subscriber resumes from an old position and reaches the same rows
        late = kv.subscribe("emb", since=positions[0])
        first = late.poll()
        kv.barrier()
        return (want_ids, got, ids[0], versions, [b.version for b in first if b.complete],
                sub.position, stats["rows"], len(mirror), mirror.since())

    res = run_threads(fn, num_workers=2, num_servers=2, store_type=store_type, timeout=90)
    assert not isinstance(res[0], BaseException), res[0]
    want_ids, got, values, versions, late, pos, rows, held, since = res[0]
    assert rows == held == want_ids.size
    assert got.tobytes() == values.astype(np.float32).tobytes()
    assert late == versions                     # both shards, at the servers' versions
    assert [pos[str(s)][1] for s in range(2)] == versions


def test_subscribe_misuse_is_refused(run_threads):
    def fn(kv):
        kv.init("emb", _spec())
        kv.init("dense", mx.nd.zeros((2,)))
        errs = []
        for call in (lambda: kv.subscribe("nope"), lambda: kv.subscribe("dense"),
                     lambda: kv.subscribe("emb", since={"5": ["x", 1]}),
                     lambda: kv.subscribe("emb", since="[1"),
                     lambda: kv.subscribe("emb", max_rows=0),
                     lambda: kv.subscribe("emb", raw="yes")):
            try:
                call()
            except (KeyNotInitializedError, UnsupportedError, ConfigError) as err:
                errs.append(type(err).__name__)
        sub = kv.subscribe("emb")
        return errs, [b.reset for b in sub.poll()]

    res = run_threads(fn, num_workers=1, num_servers=2, timeout=60)
    errs, resets = res[0]
    assert errs == ["KeyNotInitializedError", "KeyNotInitializedError", "ConfigError",
                    "ConfigError", "ConfigError", "ConfigError"]
    assert resets == [True, True]


def test_explain_and_hot_ids_ask_the_servers(run_threads):
    def fn(kv):
        kv.init("emb", TableSpec(dim=4, admission=mx.table.CountAdmission(2)))
        kv.lookup("emb", np.array([11, 11, 12, 13] * (kv.rank + 1)))
        kv.lookup("emb", np.array([11]))
        kv.barrier()
        out = (kv.explain("emb", 11), kv.explain("emb", 99), kv.hot_ids("emb", 2))
        kv.barrier()
        return out

    res = run_threads(fn, num_workers=2, num_servers=2, timeout=60)
    for r in res.values():
        assert not isinstance(r, BaseException), r
    e11, e99, hot = res[0]
    assert e11["present"] and e11["born_by"] == "pull"
    assert e11["shard"] == int(mx.table.shard_of(np.array([11]), 2)[0])
    assert not e99["present"] and e99["needs"] == 2 and e99["evicted"] is None
    assert hot[0] == (11, 8)                 # 2 + 4 + the two single lookups
