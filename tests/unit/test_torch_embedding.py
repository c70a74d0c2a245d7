"""pskv.torch.Embedding / EmbeddingBag over a table key of a local store, and
DistributedOptimizer's sparse gradients as row_sparse (issue #15, item 6).

The oracle is torch itself: a ``torch.nn.Embedding`` / ``EmbeddingBag`` holding the same
initial rows, trained with ``torch.optim.SGD``; the store's SGD must give the same rows.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import (ConfigError, KeyAlreadyInitializedError,  # noqa: E402
                         KeyNotInitializedError, KVStoreError, ShapeMismatchError,
                         TableIdError, UnsupportedError, ValueTypeError)
from pskv.table import TableSpec, Uniform  # noqa: E402

DIM, LR = 3, 0.5
#: IDs of every kind: negative, huge, repeated
IDS = torch.tensor([[5, -7, 2**62, 5], [-(2**63), 5, 11, -7]])


@pytest.fixture
def kv() -> Any:
    with mx.kv.create("local") as store:
        store.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
        yield store


def spec(**kw: Any) -> TableSpec:
    return TableSpec(dim=DIM, init=Uniform(-1.0, 1.0), seed=5, **kw)


def reference(kv: Any, key: Any, ids: Any, mode: str | None = None) -> tuple[Any, Any]:
    """A torch module holding the table's current rows of ``ids``, and its ID -> row map."""
    unique = torch.unique(ids.reshape(-1))
    rows = torch.from_numpy(kv.lookup(key, unique.numpy(), train=False)[0].copy())
    ref = torch.nn.Embedding(len(unique), DIM) if mode is None else \
        torch.nn.EmbeddingBag(len(unique), DIM, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(rows)
    return ref, unique


def local(ids: Any, unique: Any) -> Any:
    return torch.searchsorted(unique, ids)


def test_forward_backward_and_sgd_step_equal_torch_embedding(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec())
    ref, unique = reference(kv, "emb", IDS)
    target = torch.randn(IDS.shape + (DIM,), generator=torch.Generator().manual_seed(1))
    out = emb(IDS)
    want = ref(local(IDS, unique))
    assert out.shape == IDS.shape + (DIM,) and torch.equal(out, want)
    ((out - target) ** 2).sum().backward()
    ((want - target) ** 2).sum().backward()
    with torch.no_grad():
        ref.weight -= LR * ref.weight.grad
    emb.synchronize()
    got = torch.from_numpy(kv.lookup("emb", unique.numpy(), train=False)[0])
    assert torch.allclose(got, ref.weight, atol=1e-6)
    assert list(emb.parameters()) == [] and emb.state_dict() == {}
    emb.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_a_half_table_gives_its_compute_dtype_and_trains(kv: Any, dtype: str) -> None:
    """R17: the module's tensors are the table's compute dtype (float32 for a half table,
    float64 for a float64 one), and a step stores the torch step's rows rounded."""
    from pskv.table._halves import narrow, widen
    emb = pt.Embedding(kv, "emb", spec(dtype=dtype))
    if dtype == "float64":          # as before R17: the table's own dtype
        assert emb(IDS).dtype == torch.float64
        emb.close()
        return
    ref, unique = reference(kv, "emb", IDS)
    before = kv.lookup("emb", unique.numpy(), train=False)[0]
    out, want = emb(IDS), ref(local(IDS, unique))
    assert out.dtype == torch.float32 and torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    with torch.no_grad():
        ref.weight -= LR * ref.weight.grad
    emb.synchronize()
    got = kv.lookup("emb", unique.numpy(), train=False)[0]
    rounded = widen(narrow(ref.weight.detach().numpy(), dtype), dtype, np.float32)
    np.testing.assert_array_equal(got, rounded)
    assert (got != before).all()            # trained
    emb.close()


@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False),
                                                ("sum", True)])   # torch: weights for sum
def test_embedding_bag_equals_torch_embedding_bag(kv: Any, mode: str, weighted: bool) -> None:
    bag = pt.EmbeddingBag(kv, "bag", spec(), mode=mode)
    values = IDS.reshape(-1)
    offsets = torch.tensor([0, 3, 3, 6])               # an empty bag included
    weights = torch.linspace(0.5, 2.0, values.numel(), requires_grad=True) \
        if weighted else None
    ref, unique = reference(kv, "bag", values, mode)
    ref_weights = weights.detach().clone().requires_grad_(True) if weighted else None
    out = bag(values, offsets, per_sample_weights=weights)
    want = ref(local(values, unique), offsets, per_sample_weights=ref_weights)
    assert out.shape == (4, DIM) and torch.allclose(out, want, atol=1e-6)
    (out * torch.arange(4.0).unsqueeze(1)).sum().backward()
    (want * torch.arange(4.0).unsqueeze(1)).sum().backward()
    if weighted:
        assert torch.allclose(weights.grad, ref_weights.grad, atol=1e-6)
    with torch.no_grad():
        ref.weight -= LR * ref.weight.grad
    bag.synchronize()
    got = torch.from_numpy(kv.lookup("bag", unique.numpy(), train=False)[0])
    assert torch.allclose(got, ref.weight, atol=1e-6)
    bag.close()


def test_embedding_bag_2d_input_and_include_last_offset(kv: Any) -> None:
    bag = pt.EmbeddingBag(kv, "b", spec(), mode="sum")
    flat = bag(IDS.reshape(-1), torch.tensor([0, 4]))
    assert torch.equal(bag(IDS), flat)
    last = pt.EmbeddingBag(kv, "b", DIM, mode="sum", include_last_offset=True)
    assert torch.equal(last(IDS.reshape(-1), torch.tensor([0, 4, 8])), flat)
    bag.close()
    last.close()


def test_forward_deduplicates_ids(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec())
    ids = torch.tensor([9, 9, 9, 4, 9, 4])
    calls: list[np.ndarray] = []
    lookup = kv.lookup

    def spy(key: Any, wanted: Any, train: bool = True) -> Any:
        calls.append(np.asarray(wanted))
        return lookup(key, wanted, train=train)

    kv.lookup = spy
    emb(ids).sum().backward()
    emb.synchronize()
    assert [c.tolist() for c in calls] == [[4, 9]]
    stats = kv.table_stats("emb")
    assert stats["lookups"] == 2 and stats["pushed_rows"] == 2
    emb.close()


def test_eval_never_inserts_and_pushes_nothing(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec()).eval()
    out = emb(IDS)
    assert not out.requires_grad
    assert kv.table_stats("emb")["rows"] == 0 and kv.table_stats("emb")["inserts"] == 0
    emb.train()
    trained = emb(IDS)                          # a training lookup inserts the rows
    assert torch.equal(trained.detach(), out)   # R4: unknown IDs read their initial value
    assert kv.table_stats("emb")["rows"] == 5
    with torch.no_grad():
        emb(torch.tensor([100]))                # training lookup, no graph, no push
    emb.synchronize()
    assert kv.table_stats("emb")["rows"] == 6 and kv.table_stats("emb")["step"] == 0
    emb.close()


def test_backward_does_not_wait_for_the_push(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec())
    gate = threading.Event()
    push = kv.push

    def slow_push(*args: Any, **kw: Any) -> Any:
        assert gate.wait(30)
        return push(*args, **kw)

    kv.push = slow_push
    emb(IDS).sum().backward()                   # returns while the push waits on the gate
    assert kv.table_stats("emb")["step"] == 0
    gate.set()
    emb.synchronize()
    assert kv.table_stats("emb")["step"] == 1
    emb.close()


def test_a_failed_push_raises_at_the_next_forward(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec())

    def broken(*args: Any, **kw: Any) -> Any:
        raise ShapeMismatchError("push failed", key="emb")

    kv.push = broken
    emb(IDS).sum().backward()
    with pytest.raises(ShapeMismatchError, match="push failed"):
        emb(IDS)
    emb(IDS)                                    # reported once
    emb.close()


def train(kv: Any, emb: Any, batches: list[Any], prefetch: bool) -> list[Any]:
    outs = []
    for n, ids in enumerate(batches):
        out = emb(ids)
        if prefetch and n + 1 < len(batches):
            emb.prefetch(batches[n + 1])        # overlaps this step's backward and push
        (out * out).sum().backward()
        outs.append(out.detach())
    emb.synchronize()
    return outs


def test_prefetch_gives_identical_results(kv: Any) -> None:
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(-20, 20, (4, 6), generator=g) for _ in range(5)]
    batches[3] = torch.tensor([99, 98])        # shares no row with the batch before
    plain = train(kv, pt.Embedding(kv, "a", spec()), batches, prefetch=False)
    emb = pt.Embedding(kv, "b", spec())
    fetched = train(kv, emb, batches, prefetch=True)
    assert all(torch.equal(x, y) for x, y in zip(plain, fetched))
    ids = torch.arange(-20, 100)
    assert np.array_equal(kv.lookup("a", ids.numpy(), False)[0],
                          kv.lookup("b", ids.numpy(), False)[0])
    emb.prefetch(torch.tensor([1, 2]))          # discarded by a forward of other IDs
    assert torch.equal(emb(torch.tensor([3])).detach(),
                       torch.from_numpy(kv.lookup("b", np.array([3]), False)[0]))
    emb.close()


def test_modules_share_a_table_by_dim(kv: Any) -> None:
    first = pt.Embedding(kv, "emb", spec())
    second = pt.Embedding(kv, "emb", DIM)
    assert torch.equal(first(IDS), second(IDS)) and second.embedding_dim == DIM
    assert "key='emb'" in repr(second)


# ---- bad input -----------------------------------------------------------------------------
def test_bad_construction(kv: Any) -> None:
    kv.init("w", torch.zeros(4, DIM))
    with pytest.raises(KeyNotInitializedError, match="not one in this store.*TableSpec"):
        pt.Embedding(kv, "w", DIM)
    with pytest.raises(KeyNotInitializedError, match="needs a table key"):
        pt.EmbeddingBag(kv, "nothing", DIM)
    pt.Embedding(kv, "emb", spec())
    with pytest.raises(KeyAlreadyInitializedError, match="pass its dim"):
        pt.Embedding(kv, "emb", spec())
    with pytest.raises(ShapeMismatchError, match=f"table of dim {DIM}, not 8"):
        pt.Embedding(kv, "emb", 8)
    with pytest.raises(ConfigError, match="neither a TableSpec nor an int"):
        pt.Embedding(kv, "emb", 2.5)
    with pytest.raises(ConfigError, match="mode='max'"):
        pt.EmbeddingBag(kv, "emb", DIM, mode="max")


def test_bad_ids_and_bags_raise_and_change_nothing(kv: Any) -> None:
    emb = pt.Embedding(kv, "emb", spec())
    bag = pt.EmbeddingBag(kv, "emb", DIM, mode="sum")
    ids = torch.tensor([1, 2, 3])
    bad: list[tuple[Any, type[KVStoreError], str]] = [
        (lambda: emb(ids.float()), TableIdError, "dtype torch.float32"),
        (lambda: emb(ids.bool()), TableIdError, "IDs are integers"),
        (lambda: emb.prefetch(ids.double()), TableIdError, "float64"),
        (lambda: emb([1, 2]), ValueTypeError, "torch.as_tensor"),
        (lambda: bag(ids, torch.tensor([[0, 1]])), ShapeMismatchError, "offsets of shape"),
        (lambda: bag(ids, torch.tensor([1, 2])), ShapeMismatchError, "start at 0"),
        (lambda: bag(ids, torch.tensor([0, 2, 1])), ShapeMismatchError, "never decrease"),
        (lambda: bag(ids, torch.tensor([0, 4])), ShapeMismatchError, "stay <= 3"),
        (lambda: bag(ids, torch.tensor([0.0])), TableIdError, "offsets of dtype"),
        (lambda: bag(ids), ShapeMismatchError, "without offsets"),
        (lambda: bag(ids.reshape(1, 3), torch.tensor([0])), ShapeMismatchError, "2-D"),
        (lambda: bag(ids, torch.tensor([0]), torch.ones(2)), ShapeMismatchError,
         "per_sample_weights"),
        (lambda: bag(ids, torch.tensor([0]), torch.ones(3, dtype=torch.int64)),
         ShapeMismatchError, "one float weight per ID"),
        (lambda: pt.EmbeddingBag(kv, "emb", DIM)(ids, torch.tensor([0]), torch.ones(3)),
         UnsupportedError, "mode='sum' only"),
    ]
    for call, cls, match in bad:
        with pytest.raises(cls, match=match):
            call()
    assert kv.table_stats("emb")["lookups"] == 0 and kv.table_stats("emb")["rows"] == 0
    emb.close()
    bag.close()


def test_a_store_without_table_keys_is_refused() -> None:
    class NoTables:
        type = "custom"

    with pytest.raises(UnsupportedError, match="no table keys"):
        pt.Embedding(NoTables(), "emb", DIM)


# ---- DistributedOptimizer: sparse gradients as row_sparse -----------------------------------
def model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(40, 4, sparse=True), torch.nn.Flatten(),
                               torch.nn.Linear(12, 1))


def steps(m: Any, opt: Any) -> list[Any]:
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randint(0, 40, (8, 3), generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


# torch's own Adagrad makes sparse tensors without saying whether to check them
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("torch_opt", ["sgd", "adagrad"])
def test_sparse_params_update_as_plain_torch(torch_opt: str) -> None:
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}[torch_opt]
    ref = model()
    want = steps(ref, make(ref.parameters()))
    m = model()
    with mx.kv.create("local") as kv:
        opt = pt.DistributedOptimizer(make(m.parameters()), m.named_parameters(), kv,
                                      sparse_params=["0.weight"])
        got = steps(m, opt)
        assert m[0].weight.grad.layout == torch.sparse_coo
        assert kv.pull("opt/bucket.0").numel() == 13   # the Linear's; the table has its own
        opt.close()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))


def test_sparse_params_with_update_on_kvstore() -> None:
    ref = model()
    want = steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    m = model()
    with mx.kv.create("local") as kv:
        opt = pt.DistributedOptimizer(None, m.named_parameters(), kv, update_on_kvstore=True,
                                      kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                      sparse_params=["0.weight"])
        got = steps(m, opt)
        opt.close()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))


def test_a_sparse_gradient_outside_sparse_params_is_refused_or_sent_dense() -> None:
    with mx.kv.create("local") as kv:
        m = model()
        opt = pt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      m.named_parameters(), kv)
        with pytest.raises(ConfigError, match=r"sparse_params=\['0.weight'\]"):
            torch.nn.functional.mse_loss(m(torch.tensor([[1, 2, 3]])),
                                         torch.ones(1, 1)).backward()
        opt.close()
        ref, m = model(), model()
        want = steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
        opt = pt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      m.named_parameters(), kv, prefix="dense/",
                                      sparse_as_dense=True)
        got = steps(m, opt)
        opt.close()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))


def test_bad_sparse_params() -> None:
    with mx.kv.create("local") as kv:
        m = model()
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match="'nope', which is not among the parameters"):
            pt.DistributedOptimizer(sgd, m.named_parameters(), kv, sparse_params=["nope"])
        with pytest.raises(ShapeMismatchError, match="needs a parameter with rows"):
            p = torch.nn.Parameter(torch.tensor(1.0))
            pt.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), [("s", p)], kv,
                                    sparse_params=["s"])
        opt = pt.DistributedOptimizer(sgd, m.named_parameters(), kv,
                                      sparse_params=["0.weight", "2.weight"])
        torch.nn.functional.mse_loss(m(torch.tensor([[1, 2, 3]])), torch.ones(1, 1)).backward()
        with pytest.raises(ConfigError, match="'2.weight' is in sparse_params but got a"):
            opt.step()


def test_a_join_waits_for_the_tables_pushes_in_flight(monkeypatch: Any) -> None:
    """A CTR model's tables push on their own thread after backward; a worker that runs out
    of batches joins right after its last step: ``DistributedOptimizer.join`` must wait for
    those pushes first (a push after the join is refused: the rounds closed without it)."""
    kv = mx.kv.create("local")      # tables with their own optimizer, none on the store
    emb = pt.Embedding(kv, "emb", spec(optimizer=mx.optimizer.AdaGrad(learning_rate=0.1)))
    lin = torch.nn.Linear(spec().dim, 1)
    opt = pt.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                  lin.named_parameters(), kv)
    release, order = threading.Event(), []
    real_push, real_join = kv.push, kv.join

    def slow_push(key: Any, value: Any, priority: int = 0) -> None:
        if key == "emb":
            release.wait(5.0)           # still in flight when the step returns
            order.append("push")
        real_push(key, value, priority)

    def join(timeout: Any = None) -> int:
        order.append("join")
        return real_join(timeout)

    monkeypatch.setattr(kv, "push", slow_push)
    monkeypatch.setattr(kv, "join", join)
    opt.zero_grad()
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    opt.step()
    threading.Timer(0.2, release.set).start()
    opt.join()
    assert order == ["push", "join"], order
    emb.close()
    opt.close()
    kv.close()
