"""R17 of docs/embeddings.md: a table's storage dtype apart from its compute dtype.

A float16 or bfloat16 table stores its rows in 2 bytes, computes (and keeps its optimizer
state) in ``state_dtype``: it must equal, bit for bit, a float32 table whose rows are
rounded to the half dtype after every change; lookups return float32; checkpoints, states
and changes records keep the stored bits; memory is honest; bad specs raise.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import CheckpointError, TableSpecError
from pskv.kvstore._table_budget import row_bytes
from pskv.table import (Capacity, Constant, DynamicTable, Normal, TableSpec, Uniform,
                        initial_values)
from pskv.table._halves import narrow, widen

from _table_helpers import KEY, Clock

HALF = ["float16", "bfloat16"]


def _round_rows(t: DynamicTable, dtype: str) -> None:
    """Round every row of float32 table ``t`` to ``dtype`` (the oracle's step)."""
    top = t._top
    t._values[:top] = widen(narrow(t._values[:top], dtype), dtype, np.float32)


def _opts() -> dict[str, Any]:
    return {"sgd": lambda: mx.optimizer.SGD(learning_rate=0.1),
            "sgd_momentum": lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9),
            "adagrad": lambda: mx.optimizer.AdaGrad(learning_rate=0.1),
            "adam": lambda: mx.optimizer.Adam(learning_rate=0.01),
            "rowwise": lambda: mx.optimizer.AdaGrad(learning_rate=0.1)}


@pytest.mark.parametrize("opt", sorted(_opts()))
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("duplicates", ["sum", "mean"])
def test_r17_a_half_table_is_a_float32_table_rounded_after_every_step(
        dtype: str, opt: str, duplicates: str) -> None:
    layout = "rowwise" if opt == "rowwise" else "elementwise"
    kw = dict(dim=5, init=Normal(0, 0.5), seed=11, duplicates=duplicates, state_layout=layout,
              eviction=Capacity(40))
    half = DynamicTable(TableSpec(dtype=dtype, **kw), name=KEY, clock=Clock())
    ref = DynamicTable(TableSpec(dtype="float32", **kw), name=KEY, clock=Clock())
    o_half, o_ref = _opts()[opt](), _opts()[opt]()
    rng = np.random.default_rng(5)
    for step in range(30):
        ids = rng.integers(-30, 30, 24)
        a, fa = half.lookup(ids)
        b, fb = ref.lookup(ids)
        _round_rows(ref, dtype)             # rows born by the lookup: rounded too
        assert a.dtype == np.float32
        np.testing.assert_array_equal(fa, fb)
        np.testing.assert_array_equal(a, widen(narrow(b, dtype), dtype, np.float32))
        g = (rng.standard_normal((24, 5)) * 10.0 ** rng.integers(-3, 2)).astype(np.float32)
        half.push(ids, g, optimizer=o_half)
        ref.push(ids, g, optimizer=o_ref)
        _round_rows(ref, dtype)
        half.sweep(16)
        ref.sweep(16)
    every = np.arange(-30, 30)
    (a, fa), (b, fb) = half.lookup(every, train=False), ref.lookup(every, train=False)
    np.testing.assert_array_equal(fa, fb)
    b[~fb] = widen(narrow(b[~fb], dtype), dtype, np.float32)     # unknown IDs' R4 value
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))      # exact bits
    sa, sb = half.state()[0], ref.state()[0]
    for name in sa:
        if name.startswith("state"):        # the optimizer state: float32 in both
            assert sa[name].dtype == np.float32
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    hs, rs = half.stats(), ref.stats()
    assert hs.pop("bytes") < rs.pop("bytes") and hs == rs    # the same counters, fewer bytes


@pytest.mark.parametrize("dtype", HALF)
def test_r17_what_is_stored_and_what_lookup_returns(dtype: str) -> None:
    t = DynamicTable(TableSpec(dim=3, dtype=dtype, init=Uniform(-1, 1), seed=2), name=KEY)
    assert t._values.dtype == {"float16": np.float16, "bfloat16": np.uint16}[dtype]
    ids = np.array([3, 4, 2**62])
    rows, _ = t.lookup(ids)
    assert rows.dtype == np.float32
    # R2 then R17: the initial value computed in float32, rounded to the storage dtype
    f32 = initial_values(TableSpec(dim=3, init=Uniform(-1, 1), seed=2), ids)
    np.testing.assert_array_equal(rows, widen(narrow(f32, dtype), dtype, np.float32))
    np.testing.assert_array_equal(initial_values(t.spec, ids), rows)
    # R4: an unknown ID reads the value it would be born with, rounded alike
    unknown, found = t.lookup(np.array([99]), train=False)
    assert not found[0]
    t.lookup(np.array([99]))
    np.testing.assert_array_equal(unknown, t.lookup(np.array([99]), train=False)[0])
    t.push(np.array([3]), np.full((1, 3), 1.0 / 3, np.float32))     # assign: rounded
    np.testing.assert_array_equal(
        t.lookup(np.array([3]), train=False)[0],
        widen(narrow(np.full((1, 3), 1.0 / 3, np.float32), dtype), dtype, np.float32))
    t.assign(np.array([4]), np.array([[1e6, -1e6, 7.0]]))
    assert t.lookup(np.array([4]), train=False)[0].tolist() == (
        [[np.inf, -np.inf, 7.0]] if dtype == "float16" else [[999424.0, -999424.0, 7.0]])


def test_r17_state_dtype_float64_computes_in_float64() -> None:
    t = DynamicTable(TableSpec(dim=2, dtype="bfloat16", state_dtype="float64",
                               init=Constant(0.1)), name=KEY)
    rows, _ = t.lookup(np.array([1]))
    assert rows.dtype == np.float64
    t.push(np.array([1]), np.ones((1, 2)), optimizer=mx.optimizer.AdaGrad(learning_rate=0.1))
    assert t._states[0].dtype == np.float64 and t._values.dtype == np.uint16


def test_r17_a_float16_table_holds_its_rows_in_half_the_bytes() -> None:
    opt = mx.optimizer.AdaGrad(learning_rate=0.1)
    got = {}
    for dtype in ("float32", "float16", "bfloat16"):
        t = DynamicTable(TableSpec(dim=16, dtype=dtype), name=KEY)
        ids = np.arange(1000)
        t.lookup(ids)
        t.push(ids, np.ones((1000, 16), np.float32), optimizer=opt)
        got[dtype] = t.nbytes()
    for half in HALF:
        assert got[half]["values"] * 2 == got["float32"]["values"] == 1000 * 16 * 4
        assert got[half]["states"] == got["float32"]["states"]        # float32 state
    assert row_bytes(TableSpec(dim=16, dtype="float16"), 16) == \
        row_bytes(TableSpec(dim=16), 16) - 16 * 2


@pytest.mark.parametrize("dtype", HALF)
def test_r17_states_and_changes_keep_the_stored_bits(dtype: str) -> None:
    spec = TableSpec(dim=4, dtype=dtype, init=Normal(0, 1), seed=9)
    t = DynamicTable(spec, name=KEY, clock=Clock())
    opt = mx.optimizer.Adam(learning_rate=0.01)
    ids = np.arange(-50, 50)
    t.lookup(ids)
    t.push(ids, np.random.default_rng(1).standard_normal((100, 4)), optimizer=opt)
    arrays, meta = t.state()
    assert arrays["values"].dtype == spec.storage
    again = DynamicTable.from_state(spec, arrays, meta, name=KEY, clock=Clock())
    np.testing.assert_array_equal(again.state()[0]["values"], arrays["values"])
    parts = [DynamicTable.from_state(spec, arrays, meta, name=KEY, shard=(i, 2))
             for i in range(2)]
    back = np.concatenate([p.state()[0]["values"] for p in parts])
    order = np.argsort(np.concatenate([p.state()[0]["ids"] for p in parts]))
    np.testing.assert_array_equal(back[order], arrays["values"])
    copy = DynamicTable(spec, name=KEY, clock=Clock())
    copy.apply_changes(*t.changes(ids, np.empty(0, np.int64)))
    np.testing.assert_array_equal(copy.state()[0]["values"], arrays["values"])
    with pytest.raises(CheckpointError, match="int32"):
        DynamicTable.from_state(spec, {**arrays, "values": arrays["values"].astype(np.int32)},
                                meta, name=KEY)


@pytest.mark.parametrize("dtype", HALF)
def test_r17_a_local_store_checkpoint_reloads_bit_for_bit(dtype: str, tmp_path: Any) -> None:
    def make() -> Any:
        kv = mx.kv.create("local")
        kv.init(KEY, TableSpec(dim=4, dtype=dtype, init=Normal(0, 1), seed=4))
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
        return kv
    kv = make()
    ids = np.arange(200) * 7919 - 10**12
    for i in range(3):
        kv.lookup(KEY, ids)
        kv.push(KEY, (ids, np.full((200, 4), 0.1 * (i + 1), np.float32)))
    kv.save_checkpoint(str(tmp_path / "ck"))
    again = make()
    again.load_checkpoint(str(tmp_path / "ck"))
    a, b = kv._tables.tables[KEY].state()[0], again._tables.tables[KEY].state()[0]
    for name in ("ids", "values", "state0"):
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    other = mx.kv.create("local")
    other.init(KEY, TableSpec(dim=4, dtype="float32"))
    with pytest.raises(CheckpointError, match=dtype):
        other.load_checkpoint(str(tmp_path / "ck"))


def test_r17_the_spec_carries_both_dtypes_and_old_json_loads() -> None:
    s = TableSpec(dim=4, dtype="bfloat16")
    assert (s.dtype, s.state_dtype) == ("bfloat16", "float32")
    assert TableSpec(dim=4, dtype=np.float16).state_dtype == "float32"
    assert TableSpec(dim=4, dtype="float64").state_dtype == "float64"
    assert s == TableSpec(dim=4, dtype="bfloat16", state_dtype="float32")
    assert s.to_json()["dtype"] == "bfloat16" and s.to_json()["state_dtype"] == "float32"
    assert TableSpec.from_json(s.to_json()) == s
    old = TableSpec(dim=4, dtype="float64").to_json()
    del old["state_dtype"]
    assert TableSpec.from_json(old).state_dtype == "float64"


@pytest.mark.parametrize("kw, field", [
    ({"dtype": "int8"}, "TableSpec.dtype"),
    ({"dtype": "nonsense"}, "TableSpec.dtype"),
    ({"dtype": "float16", "state_dtype": "float16"}, "TableSpec.state_dtype"),
    ({"dtype": "bfloat16", "state_dtype": "bfloat16"}, "TableSpec.state_dtype"),
    ({"dtype": "float32", "state_dtype": "float64"}, "TableSpec.state_dtype"),
    ({"dtype": "float64", "state_dtype": "float32"}, "TableSpec.state_dtype"),
    ({"dtype": "float16", "state_dtype": "int32"}, "TableSpec.state_dtype"),
])
def test_r17_bad_dtypes_raise_table_spec_error(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(TableSpecError, match=field) as err:
        TableSpec(dim=2, **kw)
    assert "float32" in str(err.value)
