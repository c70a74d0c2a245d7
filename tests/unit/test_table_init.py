"""R2 of docs/embeddings.md: a row's initial value is a pure function of (seed, ID, column).

It is the same in any batch, in any table of the same spec, after an eviction and
re-creation, after ``from_state`` and on another server after a reshard; no random-number
generator is drawn from; and each initializer has the distribution it names.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pskv.table import (Capacity, Constant, DynamicTable, Normal, TableSpec, Uniform, Zeros,
                        initial_values, shard_of)
from pskv.table._hash import SALT_INIT

MASK = (1 << 64) - 1
IDS = np.array([0, 1, -1, 42, 10**15, -2**63, 2**63 - 1], np.int64)


def _mix(x: int) -> int:
    """splitmix64's finalizer of ``x + golden``, in Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _uniform(seed: int, id_: int, counter: int) -> float:
    """The counter-hash uniform of (seed, ID, counter), written out element by element."""
    base = _mix(id_ & MASK)
    for word in (seed, SALT_INIT):
        base = _mix(base ^ _mix(word & MASK))
    z = _mix((base ^ (counter * 0xD1B54A32D192ED03)) & MASK)
    return (z >> 11) / 2.0**53


@pytest.mark.parametrize("init", [Uniform(-0.5, 2.0), Normal(1.0, 3.0)])
@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
def test_initial_values_are_a_function_of_seed_id_and_column(init: object,
                                                             seed: int) -> None:
    spec = TableSpec(dim=3, init=init, seed=seed, dtype="float64")
    got = initial_values(spec, IDS)
    for r, id_ in enumerate(IDS.tolist()):
        for c in range(3):
            if isinstance(init, Uniform):
                want = init.low + (init.high - init.low) * _uniform(seed, id_, c + 1)
            else:
                assert isinstance(init, Normal)
                u1, u2 = _uniform(seed, id_, c + 1), _uniform(seed, id_, 3 + c + 1)
                want = init.mean + init.std * math.sqrt(-2.0 * math.log1p(-u1)) * \
                    math.cos(2.0 * math.pi * u2)
            assert got[r, c] == pytest.approx(want, rel=1e-12, abs=1e-12), (id_, c)


def test_the_batch_and_its_order_do_not_matter() -> None:
    spec = TableSpec(dim=4, init=Normal(0, 1), seed=3)
    alone = np.concatenate([initial_values(spec, IDS[i:i + 1]) for i in range(IDS.size)])
    np.testing.assert_array_equal(initial_values(spec, IDS), alone)
    perm = np.random.default_rng(0).permutation(IDS.size)
    np.testing.assert_array_equal(initial_values(spec, IDS[perm]), alone[perm])
    twice = initial_values(spec, np.concatenate([IDS, IDS]))
    np.testing.assert_array_equal(twice[:IDS.size], twice[IDS.size:])


def test_seed_id_and_column_each_change_the_value() -> None:
    a = initial_values(TableSpec(dim=8, init=Uniform(0, 1), seed=1), IDS)
    b = initial_values(TableSpec(dim=8, init=Uniform(0, 1), seed=2), IDS)
    assert not np.isclose(a, b).any()
    assert len({tuple(r) for r in a.tolist()}) == IDS.size
    assert all(len(set(r)) == 8 for r in a.tolist())
    # the same seed and ID in a table of another width: the same leading columns
    wide = initial_values(TableSpec(dim=16, init=Uniform(0, 1), seed=1), IDS)
    np.testing.assert_array_equal(wide[:, :8], a)


def test_float32_rows_are_the_float64_values_rounded() -> None:
    ids = np.arange(100, dtype=np.int64)
    lo = initial_values(TableSpec(dim=5, init=Normal(0, 2), seed=4), ids)
    hi = initial_values(TableSpec(dim=5, init=Normal(0, 2), seed=4, dtype="float64"), ids)
    assert lo.dtype == np.float32 and hi.dtype == np.float64
    np.testing.assert_array_equal(lo, hi.astype(np.float32))


def test_zeros_and_constant() -> None:
    np.testing.assert_array_equal(initial_values(TableSpec(dim=3, init=Zeros()), IDS), 0)
    np.testing.assert_array_equal(initial_values(TableSpec(dim=3, init=Constant(-2.5)), IDS),
                                  -2.5)


def test_no_random_number_generator_is_drawn_from() -> None:
    np.random.seed(123)
    want = np.random.random_sample(3)
    np.random.seed(123)
    t = DynamicTable(TableSpec(dim=4, init=Normal(0, 1), seed=9))
    t.lookup(np.arange(50))
    initial_values(TableSpec(dim=4, init=Uniform(-1, 1)), np.arange(50))
    np.testing.assert_array_equal(np.random.random_sample(3), want)


SPEC = TableSpec(dim=6, init=Normal(0.5, 0.1), seed=17, eviction=Capacity(4))


def test_a_row_recreated_after_an_eviction_starts_from_the_same_bits() -> None:
    t = DynamicTable(SPEC)
    first = t.lookup(IDS[:1])[0]
    t.push(IDS[:1], np.ones((1, 6), np.float32))                 # assign: it changed
    t.lookup(np.arange(100, 110))
    t.push(np.arange(100, 110), np.zeros((10, 6), np.float32))    # IDS[0] least recent
    t.sweep()
    assert IDS[0] not in t.ids()
    again, found = t.lookup(IDS[:1])
    assert found.all()
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(again, initial_values(SPEC, IDS[:1]))


def test_rows_born_after_from_state_and_after_a_reshard_start_from_the_same_bits() -> None:
    t = DynamicTable(SPEC)
    t.lookup(IDS[:3])
    t.push(IDS[:3], np.ones((3, 6), np.float32))
    arrays, meta = t.state()
    restored = DynamicTable.from_state(SPEC, arrays, meta)
    np.testing.assert_array_equal(restored.lookup(IDS[:3], train=False)[0],
                                  np.ones((3, 6), np.float32))            # trained rows kept
    np.testing.assert_array_equal(restored.lookup(IDS[3:])[0], initial_values(SPEC, IDS[3:]))
    servers = [DynamicTable.from_state(SPEC, arrays, meta, shard=(i, 3)) for i in range(3)]
    for id_, owner in zip(IDS[3:], shard_of(IDS[3:], 3)):
        values, found = servers[owner].lookup(np.array([id_]))
        assert found.all()
        np.testing.assert_array_equal(values, initial_values(SPEC, np.array([id_])))


@pytest.mark.parametrize("low,high", [(-0.1, 0.1), (2.0, 5.0)])
def test_uniform_rows_are_uniform(low: float, high: float) -> None:
    v = initial_values(TableSpec(dim=16, init=Uniform(low, high), seed=5,
                                 dtype="float64"), np.arange(-2000, 2000, dtype=np.int64))
    assert v.min() >= low and v.max() < high
    width = high - low
    assert abs(v.mean() - (low + high) / 2) < 0.01 * width
    assert abs(v.std() - width / math.sqrt(12)) < 0.01 * width
    hist = np.histogram(v, bins=10, range=(low, high))[0] / v.size
    assert np.abs(hist - 0.1).max() < 0.01


@pytest.mark.parametrize("mean,std", [(0.0, 0.01), (3.0, 2.0)])
def test_normal_rows_are_normal(mean: float, std: float) -> None:
    ids = np.arange(10**12, 10**12 + 4000, dtype=np.int64)         # consecutive IDs
    v = initial_values(TableSpec(dim=16, init=Normal(mean, std), seed=5, dtype="float64"),
                       ids)
    z = (v - mean) / std
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    assert abs(np.mean(np.abs(z) < 1) - 0.6827) < 0.01
    assert abs(np.mean(np.abs(z) < 2) - 0.9545) < 0.005
    # neither neighbouring IDs nor neighbouring columns are correlated
    assert abs(np.corrcoef(z[:-1].ravel(), z[1:].ravel())[0, 1]) < 0.03
    assert abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1]) < 0.05


def test_normal_with_std_zero_is_the_mean() -> None:
    v = initial_values(TableSpec(dim=4, init=Normal(1.5, 0.0)), IDS)
    np.testing.assert_array_equal(v, 1.5)
