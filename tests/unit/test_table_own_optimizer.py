"""A table's own row optimizer, ``TableSpec(..., optimizer=...)`` (docs/embeddings.md R12):
it trains the rows on a store without an optimizer, wins over the store's, travels as
JSON, and what a table cannot run is refused when the spec is made (issue #29, item 2)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import TableSpecError
from pskv.kvstore.engine._tables import served_table
from pskv.kvstore._table_rules import check_optimizer
from pskv.table import Constant, TableSpec

IDS = np.array([9, -2**40, 9, 3])
GRADS = np.arange(8, dtype=np.float32).reshape(4, 2) - 3.0


def _rows_after(kv: Any, key: Any, pushes: int = 2) -> np.ndarray:
    for _ in range(pushes):
        kv.lookup(key, IDS)
        kv.push(key, (IDS, GRADS))
    return kv.lookup(key, np.unique(IDS), train=False)[0]


def test_a_table_with_its_own_optimizer_trains_on_a_store_without_one() -> None:
    own = TableSpec(dim=2, init=Constant(1.0), optimizer=mx.optimizer.AdaGrad(learning_rate=0.5))
    with mx.kv.create("local") as kv:
        kv.init("emb", own)
        got = _rows_after(kv, "emb")
    with mx.kv.create("local") as kv:       # the same optimizer set on the store
        kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.5))
        kv.init("emb", TableSpec(dim=2, init=Constant(1.0)))
        want = _rows_after(kv, "emb")
    np.testing.assert_array_equal(got, want)
    with mx.kv.create("local") as kv:       # and not what a push without one does: assign
        kv.init("emb", TableSpec(dim=2, init=Constant(1.0)))
        assigned = _rows_after(kv, "emb")
    assert not np.allclose(got, assigned)


def test_the_tables_optimizer_wins_over_the_stores() -> None:
    with mx.kv.create("local") as kv:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
        kv.init("own", TableSpec(dim=2, init=Constant(1.0),
                                 optimizer=mx.optimizer.SGD(learning_rate=0.1)))
        kv.init("shared", TableSpec(dim=2, init=Constant(1.0)))
        ids, g = np.array([4]), np.ones((1, 2), np.float32)
        for key in ("own", "shared"):
            kv.lookup(key, ids)
            kv.push(key, (ids, g))
        np.testing.assert_allclose(kv.lookup("own", ids, train=False)[0], [[0.9, 0.9]])
        np.testing.assert_allclose(kv.lookup("shared", ids, train=False)[0], [[0.0, 0.0]])


def test_a_custom_updater_leaves_a_table_with_its_own_optimizer_trainable() -> None:
    with mx.kv.create("local") as kv:
        kv.set_updater(lambda key, inp, stored: None)
        kv.init("emb", TableSpec(dim=2, init=Constant(1.0),
                                 optimizer=mx.optimizer.SGD(learning_rate=0.5)))
        ids = np.array([1])
        kv.lookup("emb", ids)
        kv.push("emb", (ids, np.ones((1, 2), np.float32)))
        np.testing.assert_allclose(kv.lookup("emb", ids, train=False)[0], [[0.5, 0.5]])


def test_the_table_optimizer_travels_as_json() -> None:
    spec = TableSpec(dim=3, optimizer=mx.optimizer.Adam(learning_rate=0.02, beta1=0.8))
    data = spec.to_json()
    assert data["optimizer"]["name"] == "adam"
    assert "state" not in data["optimizer"]         # counts are not declared: workers agree
    back = TableSpec.from_json(data)
    assert type(back.optimizer) is mx.optimizer.Adam
    assert (back.optimizer.lr, back.optimizer.beta1) == (0.02, 0.8)
    assert back.to_json() == data
    assert TableSpec.from_json(TableSpec(dim=3).to_json()).optimizer is None


@pytest.mark.parametrize("kwargs,fragment", [
    ({"optimizer": "adagrad"}, "give a pskv.optimizer.Optimizer"),
    ({"optimizer": mx.optimizer.RMSProp()}, "tables run SGD, AdaGrad, Ftrl or Adam"),
    ({"optimizer": mx.optimizer.SGD(), "state_layout": "rowwise"}, "AdaGrad only"),
    ({"optimizer": mx.optimizer.AdaGrad(wd=0.1)}, "use wd=0"),
    ({"optimizer": mx.optimizer.SGD(multi_precision=True)}, "no multi_precision"),
    ({"optimizer": {"name": "nosuch", "kwargs": {}}}, "does not rebuild an optimizer"),
    ({"optimizer": mx.optimizer.SGD(momentum="x")}, "a trial update fails"),
    ({"optimizer": mx.optimizer.SGD(learning_rate=float("nan"))}, "non-finite rows"),
], ids=["a-name", "rmsprop", "rowwise-sgd", "adagrad-wd", "multi-precision", "bad-spec",
        "momentum-str", "lr-nan"])
def test_what_a_table_cannot_run_is_refused_when_the_spec_is_made(
        kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(TableSpecError, match="TableSpec.optimizer") as info:
        TableSpec(dim=2, **kwargs)
    assert fragment in str(info.value)


def test_a_server_skips_the_store_optimizer_check_for_a_table_with_its_own() -> None:
    """set_optimizer(RMSProp) is refused by a table that would run it, not by one that has
    an optimizer of its own (the servers' check, R12)."""
    own = served_table(TableSpec(dim=2, optimizer=mx.optimizer.SGD()), "own", (0, 1))
    check_optimizer(own.spec, own.name, mx.optimizer.RMSProp())
    shared = served_table(TableSpec(dim=2), "shared", (0, 1))
    with pytest.raises(mx.base.MXNetError, match="RMSProp"):
        check_optimizer(shared.spec, shared.name, mx.optimizer.RMSProp())
