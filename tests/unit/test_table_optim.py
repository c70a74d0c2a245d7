"""R12 of docs/embeddings.md: the row optimizers of a table key.

Each element-wise optimizer on a table gives the rows that pskv's lazy row_sparse update of
a pre-sized key gives (a second local store holding a row_sparse key whose row ``r`` is the
table's ID ``IDS[r]``, started from the same initial values); row-wise AdaGrad follows a
NumPy formula written here; without an optimizer a push assigns; a custom updater is
refused.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import UnsupportedError
from pskv.table import DynamicTable, ReadOnly, TableSpec, Uniform, initial_values

from _table_helpers import assert_same_state

DIM = 3
IDS = np.array([10**15, -5, 7, 2**63 - 1, -2**63, 0], np.int64)
SPEC = TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=11)
KEY = "emb"

Make = Callable[[], Any]

#: (name, optimizer factory, every row at every step): Adam's per-row step equals the
#: key's update count only while every row is updated at every step (R12)
ELEMENTWISE: list[tuple[str, Make, bool]] = [
    ("sgd", lambda: mx.optimizer.SGD(learning_rate=0.1, wd=0.01), False),
    ("sgd_clip_rescale", lambda: mx.optimizer.SGD(learning_rate=0.1, wd=0.02, rescale_grad=0.5,
                                                  clip_gradient=0.3), False),
    ("sgd_momentum", lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
     False),
    ("sgd_momentum_scheduler", lambda: mx.optimizer.SGD(
        learning_rate=0.2, momentum=0.5, lr_scheduler=mx.lr_scheduler.FactorScheduler(2, 0.5)),
     False),
    ("adagrad", lambda: mx.optimizer.AdaGrad(learning_rate=0.1, eps=1e-6), False),
    ("adagrad_clip", lambda: mx.optimizer.AdaGrad(learning_rate=0.1, clip_gradient=0.5,
                                                  rescale_grad=2.0), False),
    ("ftrl", lambda: mx.optimizer.Ftrl(learning_rate=0.1, lamda1=0.01, beta=1.0, wd=0.01),
     False),
    ("adam", lambda: mx.optimizer.Adam(learning_rate=0.05, wd=0.01), True),
    ("adam_clip", lambda: mx.optimizer.Adam(learning_rate=0.05, beta1=0.8, beta2=0.99,
                                            clip_gradient=0.4), True),
]


def _stores(make: Make) -> tuple[Any, Any]:
    """A store with table key KEY and one with a pre-sized row_sparse key KEY, same rows."""
    table = mx.kv.create("local")
    table.init(KEY, SPEC)
    table.set_optimizer(make())
    ref = mx.kv.create("local")
    ref.init(KEY, mx.nd.array(initial_values(SPEC, IDS)).tostype("row_sparse"))
    ref.set_optimizer(make())
    table.lookup(KEY, IDS)                      # birth='pull': every row born
    return table, ref


def _ref_rows(ref: Any) -> np.ndarray:
    out = mx.nd.sparse.zeros("row_sparse", (IDS.size, DIM))
    ref.row_sparse_pull(KEY, out, row_ids=mx.nd.array(np.arange(IDS.size), dtype="int64"))
    return np.asarray(out.data.asnumpy())


@pytest.mark.parametrize("name,make,every_row", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
def test_elementwise_optimizers_equal_the_lazy_row_sparse_update(name: str, make: Make,
                                                                 every_row: bool) -> None:
    table, ref = _stores(make)
    rng = np.random.default_rng(3)
    for _ in range(6):
        rows = np.arange(IDS.size) if every_row else \
            np.sort(rng.choice(IDS.size, size=3, replace=False))
        grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
        order = rng.permutation(rows.size)            # a table push may come in any order
        table.push(KEY, (IDS[rows][order], grads[order]))
        ref.push(KEY, mx.nd.sparse.row_sparse_array((grads, rows), shape=(IDS.size, DIM)))
    got, found = table.lookup(KEY, IDS, train=False)
    assert found.all()
    np.testing.assert_allclose(got, _ref_rows(ref), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(got, initial_values(SPEC, IDS))      # the pushes did something


def test_hyperparameters_are_read_at_every_push() -> None:
    """lr set on the store's optimizer between pushes, and lr_mult of the key, apply."""
    table, ref = _stores(lambda: mx.optimizer.SGD(learning_rate=0.1))
    grads = np.ones((IDS.size, DIM), np.float32)
    for lr in (0.1, 0.5):
        for kv in (table, ref):
            opt = kv._engine.updater.optimizer
            opt.set_learning_rate(lr)
            opt.set_lr_mult({KEY: 0.25})
        table.push(KEY, (IDS, grads))
        ref.push(KEY, mx.nd.sparse.row_sparse_array((grads, np.arange(IDS.size)),
                                                    shape=(IDS.size, DIM)))
    got = table.lookup(KEY, IDS, train=False)[0]
    np.testing.assert_allclose(got, _ref_rows(ref), rtol=1e-6)
    np.testing.assert_allclose(got, initial_values(SPEC, IDS) - 0.25 * (0.1 + 0.5),
                               rtol=1e-5, atol=1e-6)


def test_each_push_counts_one_update_of_the_key() -> None:
    table, _ = _stores(lambda: mx.optimizer.SGD(learning_rate=0.1))
    opt = table._engine.updater.optimizer
    for n in range(1, 4):
        table.push(KEY, (IDS[:2], np.ones((2, DIM), np.float32)))
        assert opt._index_update_count[KEY] == n
        assert opt.num_update == n


def test_tables_update_lazily_whatever_lazy_update_says() -> None:
    table = DynamicTable(SPEC, name=KEY)
    table.lookup(IDS)
    before = table.lookup(IDS, train=False)[0]
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.1, lazy_update=False)
    table.push(IDS[:1], np.ones((1, DIM), np.float32), optimizer=opt, key=KEY)
    after = table.lookup(IDS, train=False)[0]
    np.testing.assert_array_equal(after[1:], before[1:])          # untouched rows: no wd
    np.testing.assert_allclose(after[0], before[0] - 0.1 * (1.0 + 0.1 * before[0]), rtol=1e-6)


def test_adam_keeps_a_step_per_row() -> None:
    """A row's first Adam update uses t=1 even when the key has been updated before."""
    opt = mx.optimizer.Adam(learning_rate=0.1)
    table = DynamicTable(SPEC, name=KEY)
    table.lookup(IDS)
    g = np.full((1, DIM), 0.5, np.float32)
    for _ in range(3):
        table.push(IDS[:1], g, optimizer=opt, key=KEY)
    w0 = table.lookup(IDS[1:2], train=False)[0]
    table.push(IDS[1:2], g, optimizer=opt, key=KEY)
    w1 = table.lookup(IDS[1:2], train=False)[0]
    # t=1: m = (1-b1) g, v = (1-b2) g^2, lr_t = lr sqrt(1-b2)/(1-b1): a step of about lr
    m, v = 0.1 * 0.5, 0.001 * 0.25
    want = w0 - 0.1 * np.sqrt(0.001) / 0.1 * m / (np.sqrt(v) + 1e-8)
    np.testing.assert_allclose(w1, want, rtol=1e-5)
    arrays, _ = table.state()
    np.testing.assert_array_equal(arrays["adam_t"][np.searchsorted(arrays["ids"], IDS[:2])],
                                  [3, 1])


def _rowwise_adagrad(w: np.ndarray, h: np.ndarray, g: np.ndarray, lr: float, eps: float,
                     rescale: float, clip: float | None) -> tuple[np.ndarray, np.ndarray]:
    """FBGEMM's exact row-wise AdaGrad with pskv's ``sqrt(h + eps)`` (float64)."""
    g = g.astype(np.float64) * rescale
    if clip is not None:
        g = np.clip(g, -clip, clip)
    h = h + np.mean(g * g, axis=1, keepdims=True)
    return w - lr * g / np.sqrt(h + eps), h


@pytest.mark.parametrize("clip", [None, 0.5])
def test_rowwise_adagrad_follows_its_formula(clip: float | None) -> None:
    spec = TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=11, state_layout="rowwise")
    kv = _store(spec)
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.2, eps=1e-5, rescale_grad=0.5,
                                          clip_gradient=clip))
    kv.lookup(KEY, IDS)
    w = initial_values(spec, IDS).astype(np.float64)
    h = np.zeros((IDS.size, 1))
    rng = np.random.default_rng(5)
    for _ in range(5):
        rows = np.sort(rng.choice(IDS.size, size=4, replace=False))
        g = rng.normal(size=(rows.size, DIM)).astype(np.float32)
        kv.push(KEY, (IDS[rows], g))
        w[rows], h[rows] = _rowwise_adagrad(w[rows], h[rows], g, 0.2, 1e-5, 0.5, clip)
    np.testing.assert_allclose(kv.lookup(KEY, IDS, train=False)[0], w, rtol=1e-5, atol=1e-6)
    arrays, _ = kv._tables.tables[KEY].state()
    assert arrays["state0"].shape == (IDS.size, 1)            # one accumulator per row
    np.testing.assert_allclose(arrays["state0"], h[np.argsort(IDS)], rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: mx.optimizer.SGD(), lambda: mx.optimizer.Adam(),
                                  lambda: mx.optimizer.Ftrl()])
def test_rowwise_layout_refuses_other_optimizers(make: Make) -> None:
    table = DynamicTable(TableSpec(dim=DIM, state_layout="rowwise"), name=KEY,
                         clock=lambda: 100.0)
    table.lookup(IDS)
    before = table.state()
    with pytest.raises(UnsupportedError, match="rowwise"):
        table.push(IDS, np.ones((IDS.size, DIM), np.float32), optimizer=make(), key=KEY)
    assert_same_state(before, table.state())


def test_other_optimizers_and_adagrad_wd_are_refused() -> None:
    table = DynamicTable(SPEC, name=KEY, clock=lambda: 100.0)
    table.lookup(IDS)
    before = table.state()
    g = np.ones((IDS.size, DIM), np.float32)
    for opt in (mx.optimizer.RMSProp(), mx.optimizer.AdaGrad(wd=0.1),
                mx.optimizer.SGD(multi_precision=True)):
        with pytest.raises(UnsupportedError, match=repr(KEY)):
            table.push(IDS, g, optimizer=opt, key=KEY)
        assert_same_state(before, table.state())


def test_without_an_optimizer_a_push_assigns() -> None:
    """The summed pushed value; born whatever birth and admission say; others kept."""
    spec = TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=11, birth="push",
                     admission=ReadOnly())
    kv = _store(spec)
    kv._tables.tables[KEY].assign(IDS[:1], np.full((1, DIM), 9.0, np.float32))
    kv.push(KEY, (IDS[[1, 2, 1]], np.array([[1, 2, 3], [4, 5, 6], [10, 20, 30]], np.float32)))
    values, found = kv.lookup(KEY, IDS[:4], train=False)
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(values[:3], [[9, 9, 9], [11, 22, 33], [4, 5, 6]])
    np.testing.assert_array_equal(values[3], initial_values(spec, IDS[3:4])[0])
    stats = kv.table_stats(KEY)
    assert (stats["step"], stats["inserts"], stats["pushed_rows"], stats["refusals"]) == \
        (1, 3, 2, 0)


def test_a_custom_updater_is_refused_and_changes_nothing() -> None:
    kv = _store(SPEC)
    kv.lookup(KEY, IDS)
    kv.set_updater(lambda key, value, stored: None)
    table = kv._tables.tables[KEY]
    before = table.state()
    with pytest.raises(UnsupportedError, match="set_updater"):
        kv.push(KEY, (IDS, np.ones((IDS.size, DIM), np.float32)))
    assert_same_state(before, table.state())


def test_changing_the_optimizer_starts_fresh_states() -> None:
    """A new state layout (SGD to AdaGrad) starts from zero states, as a new key would."""
    kv = _store(SPEC)
    kv.lookup(KEY, IDS)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(KEY, (IDS, np.ones((IDS.size, DIM), np.float32)))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    w0 = kv.lookup(KEY, IDS, train=False)[0]
    kv.push(KEY, (IDS, np.ones((IDS.size, DIM), np.float32)))
    # AdaGrad from h=0: h = 1, w -= 0.1 * 1 / sqrt(1 + eps)
    np.testing.assert_allclose(kv.lookup(KEY, IDS, train=False)[0], w0 - 0.1, rtol=1e-5,
                               atol=1e-6)


def _store(spec: TableSpec) -> Any:
    """A local store with table key KEY whose table reads a clock that stands still."""
    kv = mx.kv.create("local")
    kv.init(KEY, spec)
    kv._tables.tables[KEY] = DynamicTable(spec, name=KEY, clock=lambda: 100.0)
    return kv
