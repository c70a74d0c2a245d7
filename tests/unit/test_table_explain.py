"""Seeing into a table: kv.explain through a row's life, the hot IDs of a Zipf stream."""
from __future__ import annotations

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, KeyNotInitializedError
from pskv.table import TTL, Capacity, CountAdmission, DynamicTable, TableSpec
from pskv.table._hot import HotIds


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_explain_follows_a_row_from_sightings_to_birth_to_eviction_and_rebirth():
    clock = Clock()
    t = DynamicTable(TableSpec(dim=2, admission=CountAdmission(2),
                               eviction=(TTL(steps=2), Capacity(3, "lru"))), "emb", clock)
    e = t.explain(7)
    assert (e["present"], e["sightings"], e["needs"], e["evicted"]) == (False, 0, 2, None)
    t.lookup(np.array([7]))
    assert t.explain(7)["needs"] == 1
    t.lookup(np.array([7]))                            # the second sighting: born
    e = t.explain(7)
    assert (e["present"], e["born_by"], e["born_step"], e["admission"]) == \
        (True, "pull", 0, "CountAdmission")
    t.push(np.array([7]), np.ones((1, 2), np.float32), optimizer=mx.optimizer.SGD())
    clock.now = 5.0
    e = t.explain(7)
    assert e["last_used_step"] == 0 and e["uses"] == 2 and e["seconds_since_use"] == 5.0
    assert e["last_change_version"] == t.version
    for _ in range(4):                                 # no use for 3 steps: TTL
        t.push(np.array([1]), np.ones((1, 2), np.float32))
        t.sweep()
    e = t.explain(7)
    assert not e["present"] and e["evicted"]["reason"] == "ttl"
    t.assign(np.array([7]), np.ones((1, 2), np.float32))
    e = t.explain(7)
    assert e["present"] and e["born_by"] == "assign" and e["evicted"]["reason"] == "ttl"


def test_a_custom_score_is_its_own_reason_and_counter():
    t = DynamicTable(TableSpec(dim=2, eviction=Capacity(2, score=lambda m: -m.ids)), "emb")
    t.lookup(np.array([1, 2, 3]))
    t.sweep()
    assert t.explain(3)["evicted"]["reason"] == "score"
    s = t.stats()
    assert (s["evicted_score"], s["evicted_capacity"], s["evictions"]) == (1, 1, 1)


def test_birth_records_survive_a_state_and_a_replicated_change():
    t = DynamicTable(TableSpec(dim=2), "emb")
    t.push(np.array([3]), np.ones((1, 2), np.float32))           # assign: born by push
    t.lookup(np.array([4]))
    again = DynamicTable.from_state(t.spec, *t.state(), name="emb")
    assert [again.explain(i)["born_by"] for i in (3, 4)] == ["push", "pull"]
    copy = DynamicTable(t.spec, "emb")
    copy.apply_changes(*t.changes(np.array([3, 4]), np.empty(0, np.int64)))
    assert [copy.explain(i)["born_by"] for i in (3, 4)] == ["push", "pull"]


@pytest.mark.parametrize("chunks", [2000, 50])     # 100 IDs a lookup (exact), 4000 (sampled)
def test_the_sketch_finds_the_heavy_hitters_of_a_zipf_stream(chunks):
    rng = np.random.default_rng(3)
    hot = HotIds()
    ranks = rng.zipf(1.3, 200_000) % 1_000_000
    ids = (ranks * 2654435761) % (1 << 40)                     # scattered IDs
    for chunk in np.array_split(ids.astype(np.int64), chunks):
        hot.add(chunk)
    uniq, counts = np.unique(ids, return_counts=True)
    truth = set(uniq[np.argsort(-counts)[:10]].tolist())
    got = hot.top(10)
    assert len(truth & {i for i, _c in got}) >= 8
    if chunks == 2000:                # every ID counted: never below the truth (H1)
        true = dict(zip(uniq.tolist(), counts.tolist()))
        assert all(c >= true[i] for i, c in got)


def test_store_calls_and_their_misuse():
    kv = mx.kv.create("local")
    kv.init("emb", TableSpec(dim=2))
    kv.lookup("emb", np.array([5, 5, 6]))
    assert kv.explain("emb", 5)["present"] and kv.hot_ids("emb", 1) == [(5, 2)]
    for call, err in ((lambda: kv.explain("emb", 1.5), ConfigError),
                      (lambda: kv.explain("emb", [1]), ConfigError),
                      (lambda: kv.explain("nope", 1), KeyNotInitializedError),
                      (lambda: kv.hot_ids("emb", 0), ConfigError),
                      (lambda: kv.hot_ids("emb", 300), ConfigError)):
        with pytest.raises(err):
            call()
