"""The change stream of a table (docs/embeddings.md E1-E10): a mirror that reads it at any
moment, in pages or whole, resumed or reset, equals the table bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from pskv.errors import StaleReadError, UnsupportedError
from pskv.optimizer import AdaGrad
from pskv.table import TTL, Capacity, DynamicTable, TableSpec, Uniform
from pskv.table._stream import RowMirror, TombLog, read_all, read_changes


def _spec(**kw):
    base = dict(dim=4, init=Uniform(-0.1, 0.1), seed=5,
                eviction=(Capacity(max_rows=60, policy="lfu"), TTL(steps=6)))
    base.update(kw)
    return TableSpec(**base)


def _catch_up(table, mirror, max_rows=1 << 20, raw=False):
    """Read pages until a read is complete; apply each; the batches read."""
    lineage, v = mirror.since().get(0, (None, -1))
    pages = read_all(lambda s, lin, c, u: read_changes(table, s, lin, cursor=c, upto=u,
                                                        max_rows=max_rows, raw=raw), v, lineage)
    for b in pages:
        mirror.apply(b)
    return pages


def _same(table, mirror, raw=False):
    ids, rows = mirror.table()
    assert np.array_equal(ids, table.ids())
    want = table._values[table._index.find(ids)] if raw else \
        table.lookup(ids, train=False)[0].astype(np.float32)
    assert rows.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("page", [1 << 20, 7])
def test_a_mirror_read_at_random_moments_equals_the_table(page):
    rng = np.random.default_rng(0)
    table = DynamicTable(_spec(), name="emb")
    mirror = RowMirror(4, key="emb")
    opt = AdaGrad(learning_rate=0.1)
    for step in range(120):
        ids = rng.integers(0, 200, 30)
        table.lookup(ids)
        table.push(ids, rng.standard_normal((30, 4)).astype(np.float32), optimizer=opt)
        table.sweep(40)
        if rng.random() < 0.3:
            _catch_up(table, mirror, max_rows=page)
            _same(table, mirror)
    _catch_up(table, mirror, max_rows=page)
    _same(table, mirror)
    assert table.stats()["evictions"] > 0        # removals did travel


def test_versions_rise_once_per_change_and_not_for_reads():
    table = DynamicTable(_spec(eviction=()), name="emb")
    assert table.version == 0
    table.lookup(np.array([1, 2]))            # births: one version
    assert table.version == 1
    table.lookup(np.array([1, 2]), train=False)
    table.lookup(np.array([1]))               # no birth, no row changed
    assert table.version == 1
    table.push(np.array([1]), np.ones((1, 4), np.float32))
    assert table.version == 2
    b = table.changes_since(1, table.lineage)
    assert b.ids.tolist() == [1] and not b.reset and b.version == 2


def test_a_reader_behind_the_tombstones_or_of_another_lineage_gets_the_whole_table():
    table = DynamicTable(_spec(eviction=(Capacity(max_rows=4, policy="lru"),)), name="emb")
    table.tombs = TombLog(limit=3)
    table.lookup(np.arange(4))
    v0 = table.version
    for i in range(10):
        table.lookup(np.array([100 + i]))
        table.sweep()
    b = table.changes_since(v0, table.lineage)
    assert b.reset and b.removed.size == 0 and np.array_equal(np.sort(b.ids), table.ids())
    arrays, meta = table.state()
    again = DynamicTable.from_state(table.spec, arrays, meta, name="emb")
    assert again.lineage != table.lineage
    b = again.changes_since(table.version, table.lineage)
    assert b.reset and np.array_equal(np.sort(b.ids), table.ids())
    # a version from the future (a reader ahead of a table reloaded) is reset too
    assert table.changes_since(table.version + 5, table.lineage).reset


def test_tombstones_say_why_and_removals_apply_before_rows():
    table = DynamicTable(_spec(eviction=(Capacity(max_rows=2, policy="lru"),)), name="emb")
    mirror = RowMirror(4)
    table.lookup(np.array([1, 2]))
    _catch_up(table, mirror)
    table.lookup(np.array([3]))
    table.sweep()
    b = _catch_up(table, mirror)[0]
    assert b.removed.tolist() == [1] and b.reasons.tolist() == [1]     # capacity
    assert 3 in b.ids.tolist()
    _same(table, mirror)
    assert table.tombs.last(1)[1] == "capacity"


def test_raw_rows_are_the_storage_bits_of_a_half_table():
    table = DynamicTable(_spec(dtype="bfloat16", eviction=()), name="emb")
    table.lookup(np.arange(10))
    mirror = RowMirror(4, dtype=np.uint16)
    _catch_up(table, mirror, raw=True)
    _same(table, mirror, raw=True)


def test_bad_reads_are_refused_and_stale_reads_say_so():
    table = DynamicTable(_spec(), name="emb")
    with pytest.raises(UnsupportedError, match="version >= -1"):
        table.changes_since(-2)
    with pytest.raises(UnsupportedError, match="max_rows"):
        table.changes_since(0, max_rows=0)
    mirror = RowMirror(4, key="emb")
    with pytest.raises(StaleReadError, match="shard 0 is at version -1, not yet 3"):
        mirror.require(3, 0)


def test_a_backup_fed_changes_records_continues_the_stream():
    from pskv.kvstore.engine._tables import apply_round, served_table
    rng = np.random.default_rng(1)
    spec = _spec()
    primary = served_table(spec, "emb", (0, 1))
    opt = AdaGrad(learning_rate=0.1)
    primary.lookup(np.arange(5))
    arrays, meta = primary.state()
    backup = DynamicTable.from_state(spec, arrays, meta, name="emb")
    backup.go_on_from(*primary.stream_state())
    mirror = RowMirror(4)
    for step in range(40):
        ids = rng.integers(0, 150, 20)
        rnd = apply_round(primary, [(ids, rng.standard_normal((20, 4)).astype(np.float32))],
                          opt, "emb", record=True)
        backup.apply_changes(rnd.arrays, rnd.meta)
        assert backup.version == primary.version
        if step == 20:
            _catch_up(primary, mirror)       # read from the primary, then it dies
    _catch_up(backup, mirror)               # the backup goes on: no reset
    _same(primary, mirror)
    assert np.array_equal(backup.ids(), primary.ids())


def test_a_restored_table_starts_at_version_0_and_a_read_keeps_it():
    table = DynamicTable(_spec(eviction=()), name="emb")
    table.lookup(np.arange(5))
    arrays, meta = table.state()
    again = DynamicTable.from_state(table.spec, arrays, meta, name="emb")
    again.lookup(np.arange(5), train=False)
    assert again.version == 0


def test_reads_through_the_log_of_changed_slots_equal_a_scan(monkeypatch):
    """A read since a recent version looks at the slots the versions since changed; one
    from before that log (kept to MARKED_SLOTS) scans: both give the same batch."""
    import pskv.table.dynamic as dynamic
    monkeypatch.setattr(dynamic, "MARKED_SLOTS", 200)
    rng = np.random.default_rng(4)
    table = DynamicTable(_spec(), name="emb")
    opt = AdaGrad(learning_rate=0.1)
    versions = []
    for _ in range(60):
        ids = rng.integers(0, 300, 25)
        table.lookup(ids)
        table.push(ids, rng.standard_normal((25, 4)).astype(np.float32), optimizer=opt)
        table.sweep(30)
        versions.append(table.version)
    assert table._marks_floor > 0                  # the log was cut
    for since in versions[::5]:
        fast = read_changes(table, since, table.lineage, max_rows=7)
        monkeypatch.setattr(table, "changed_slots", lambda *a: None)
        slow = read_changes(table, since, table.lineage, max_rows=7)
        monkeypatch.undo()
        monkeypatch.setattr(dynamic, "MARKED_SLOTS", 200)
        assert fast.ids.tolist() == slow.ids.tolist() and fast.cursor == slow.cursor
        assert fast.rows.tobytes() == slow.rows.tobytes()
