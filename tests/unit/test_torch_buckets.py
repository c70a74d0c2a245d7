"""pskv.torch's buckets, hooks, accumulation and bad input on a local store (issue #16)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ConfigError, KVStoreError, ShapeMismatchError, UnsupportedError  # noqa: E402,E501
from pskv.torch._buckets import assign_buckets, bucket_cap_bytes  # noqa: E402


@pytest.fixture
def kv() -> Iterator[Any]:
    with mx.kv.create("local") as store:
        yield store


def mlp(seed: int = 0, depth: int = 6, dtype: Any = None) -> Any:
    """Many small tensors (2 per layer), the last layer in float64 when asked."""
    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(8, 3))
    if dtype is not None:
        layers[-1] = layers[-1].to(dtype)
        layers.insert(len(layers) - 1, _Cast(dtype))
    return torch.nn.Sequential(*layers)


class _Cast(torch.nn.Module):
    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Any) -> Any:
        return x.to(self.dtype)


def data(steps: int = 4, n: int = 16) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
            for _ in range(steps)]


def loss_of(model: Any, x: Any, y: Any) -> Any:
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def train(model: Any, opt: Any, passes: int = 1) -> list[Any]:
    for x, y in data():
        opt.zero_grad()
        for part in range(passes):          # accumulate over `passes` backward passes
            rows = slice(part * len(x) // passes, (part + 1) * len(x) // passes)
            (loss_of(model, x[rows], y[rows]) / passes).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ---- the layout ---------------------------------------------------------------------------
def test_buckets_follow_backward_order_and_never_mix_dtypes() -> None:
    f32, f64 = torch.zeros(100), torch.zeros(100, dtype=torch.float64)
    params = [f32, f64, f32, f32, f64]
    assert assign_buckets(params, 10**9) == [[4, 1], [3, 2, 0]]
    assert assign_buckets(params, 800) == [[4], [3, 2], [1], [0]]     # full at 800 bytes
    assert assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]
    # a big tensor closes the bucket it joins (as DDP's compute_bucket_assignment_by_size)
    assert assign_buckets([f32, torch.zeros(10**4), f32], 800) == [[2, 1], [0]]
    assert sorted(i for b in assign_buckets(params, 500) for i in b) == list(range(5))


@pytest.mark.parametrize("bad", [0, -1, -0.5, "25", True, float("nan")])
def test_bucket_cap_must_be_positive(kv: Any, bad: Any) -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb=.* is not a positive number"):
        bucket_cap_bytes(bad)
    model = mlp()
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), kv, bucket_cap_mb=bad)
    with pytest.raises(KeyError):      # nothing was initialized
        kv.pull("opt/bucket.0")


# ---- the same weights, every way --------------------------------------------------------
@pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["torch-step", "kv-step"])
@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["f32", "mixed"])
def test_bucketed_overlapped_equals_unbucketed_and_plain_torch(update_on_kvstore: bool,
                                                               dtype: Any) -> None:
    ref = mlp(dtype=dtype)
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    results = []
    for cap, overlap in ((None, False), (None, True), (0.0002, True), (25, True), (25, False)):
        model = mlp(dtype=dtype)
        with mx.kv.create("local") as kv:
            if update_on_kvstore:
                opt = pt.DistributedOptimizer(
                    None, model.named_parameters(), kv, update_on_kvstore=True,
                    kv_optimizer=mx.optimizer.SGD(learning_rate=0.1, momentum=0.9),
                    bucket_cap_mb=cap, overlap=overlap)
            else:
                opt = pt.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    model.named_parameters(), kv, bucket_cap_mb=cap, overlap=overlap)
            if cap == 0.0002:
                assert len(opt._pskv_sync.buckets) > 3      # several buckets, really
            results.append(train(model, opt))
            opt.close()
    for got in results:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)                      # every layout: the same numbers
        for a, b in zip(got, want):
            if update_on_kvstore:                         # MXNet's SGD in NumPy
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(a, b)


def test_buckets_are_sent_during_backward(kv: Any) -> None:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv, bucket_cap_mb=0.0005)
    sync = opt._pskv_sync
    sent_when_first_layer_done: list[int] = []
    model[0].bias.register_post_accumulate_grad_hook(
        lambda p: sent_when_first_layer_done.append(sync.next_send))
    x, y = data()[0]
    loss_of(model, x, y).backward()
    assert 0 < sent_when_first_layer_done[0] <= len(sync.buckets)   # the later layers' went
    assert sync.next_send == len(sync.buckets)          # all sent before step() is called
    opt.step()
    assert sync.next_send == 0


# ---- accumulation ---------------------------------------------------------------------------
@pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["torch-step", "kv-step"])
def test_backward_passes_per_step_and_no_sync_accumulate(update_on_kvstore: bool) -> None:
    ref = mlp()
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), passes=2)

    def make(model: Any, kv: Any, **kw: Any) -> Any:
        if update_on_kvstore:
            return pt.DistributedOptimizer(None, model.named_parameters(), kv,
                                           update_on_kvstore=True, bucket_cap_mb=0.001,
                                           kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                           **kw)
        return pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), kv, bucket_cap_mb=0.001, **kw)

    model = mlp()
    with mx.kv.create("local") as kv:
        got = train(model, make(model, kv, backward_passes_per_step=2), passes=2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    model = mlp()
    with mx.kv.create("local") as kv:
        opt = make(model, kv)
        for x, y in data():
            opt.zero_grad()
            with opt.no_sync():
                (loss_of(model, x[:8], y[:8]) / 2).backward()
            assert opt._pskv_sync.next_send == 0           # nothing sent inside no_sync
            (loss_of(model, x[8:], y[8:]) / 2).backward()
            opt.step()
    for a, b in zip(model.parameters(), want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


def test_more_backward_passes_than_declared_raise(kv: Any) -> None:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv)
    x, y = data()[0]
    loss_of(model, x, y).backward()
    with pytest.raises(ConfigError, match="more than backward_passes_per_step=1 times"):
        loss_of(model, x, y).backward()
    opt.zero_grad()
    opt._pskv_sync.reset()
    loss_of(model, x, y).backward()      # after a reset, training goes on
    opt.step()
    with pytest.raises(ConfigError, match="backward_passes_per_step=0"):
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), kv, prefix="b/",
                                backward_passes_per_step=0)


# ---- bad input ------------------------------------------------------------------------------
def test_wrapping_twice_raises_and_close_unhooks(kv: Any) -> None:
    model = mlp()
    first = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), kv)
    with pytest.raises(ConfigError, match=r"parameter '0.weight' is synchronized already .*"
                                          r"prefix='opt/'.*call close\(\)") as info:
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), kv, prefix="second/")
    assert isinstance(info.value, KVStoreError) and info.value.key == "0.weight"
    with pytest.raises(KeyError):
        kv.pull("second/bucket.0")          # the failed call initialized nothing
    first.close()
    again = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), kv, prefix="second/")
    train(model, again)


def test_a_parameter_that_changes_shape_raises(kv: Any) -> None:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv)
    with torch.no_grad():
        model[0].weight.data = torch.zeros(8, 9)       # the model was changed in place
    model[0].in_features = 9
    x, y = data()[0]
    with pytest.raises(ShapeMismatchError, match=r"'0.weight' has shape \(8, 9\) now, but "
                                                 r"had \(8, 8\).*new DistributedOptimizer"):
        loss_of(model, torch.cat([x, x[:, :1]], 1), y).backward()
        opt.step()


def test_buffers_with_update_on_kvstore_raise(kv: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(UnsupportedError, match="broadcast_buffers=False"):
        pt.DistributedOptimizer(None, model.named_parameters(), kv, update_on_kvstore=True,
                                kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                named_buffers=model.named_buffers())
    opt = pt.DistributedOptimizer(None, model.named_parameters(), kv, update_on_kvstore=True,
                                  kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                  named_buffers=model.named_buffers(), broadcast_buffers=False)
    assert opt._pskv_buffers is None


def test_buffers_one_key_per_dtype(kv: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv,
                                  named_buffers=model.named_buffers())
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    bn = model[1]
    # each key ends with rank 0's flag (1: rank 0 pushed this round; 0: it joined)
    assert torch.equal(kv.pull("opt/buffers.0"),
                       torch.cat([bn.running_mean, bn.running_var, torch.ones(1)]))
    assert kv.pull("opt/buffers.1").tolist() == [1, 1]     # num_batches_tracked, int64


# ---- per-step cost: messages and copies -------------------------------------------------------
class _Counting:
    """A store whose pushpulls are recorded (the keys of each call)."""

    def __init__(self, kv: Any) -> None:
        self.kv, self.calls = kv, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        self.calls.append(list(key) if isinstance(key, list) else [key])
        self.kv.pushpull(key, value, out=out, priority=priority)


@pytest.mark.parametrize("overlap", [True, False])
def test_buffers_ride_in_the_last_buckets_message(kv: Any, overlap: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    counting = _Counting(kv)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), counting, overlap=overlap,
                                  named_buffers=model.named_buffers(), bucket_cap_mb=5e-5)
    nbuckets = len(opt._pskv_sync.buckets)
    assert nbuckets > 1
    for _ in range(2):
        counting.calls.clear()
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        # one message per bucket a step, the buffers' keys in the last one: no extra round
        assert len(counting.calls) == nbuckets
        assert counting.calls[-1] == [f"opt/bucket.{nbuckets - 1}", "opt/buffers.0",
                                      "opt/buffers.1"]
        bn = model[1]
        assert torch.equal(kv.pull("opt/buffers.0"),
                           torch.cat([bn.running_mean, bn.running_var, torch.ones(1)]))
    assert model[1].num_batches_tracked.item() == 2


def test_buffers_without_dense_parameters_get_a_round_of_their_own(kv: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True),
                                torch.nn.BatchNorm1d(4, affine=False))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv, sparse_params=["0.weight"],
                                  named_buffers=model.named_buffers())
    assert not opt._pskv_sync.buckets
    model(torch.tensor([1, 2, 3, 3])).sum().backward()
    opt.step()
    bn = model[1]
    assert torch.equal(kv.pull("opt/buffers.0"),
                       torch.cat([bn.running_mean, bn.running_var, torch.ones(1)]))
    assert kv.pull("opt/buffers.1").tolist() == [1, 1]     # + rank 0's flag


def test_grads_are_written_in_place_and_never_alias_the_bucket(kv: Any) -> None:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv)
    x, y = data()[0]
    loss_of(model, x, y).backward()
    before = [p.grad for p in model.parameters()]
    opt.step()
    flats = [b.flat for b in opt._pskv_sync.buckets]
    for p, g in zip(model.parameters(), before):
        assert p.grad is g                             # the same tensor, written in place
        assert not any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                       for f in flats)
    opt.zero_grad(set_to_none=False)                   # zeros, then accumulate: the same
    loss_of(model, x, y).backward()
    opt.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), before))


def test_a_parameter_without_gradient_pushes_zeros_in_a_shared_bucket(kv: Any) -> None:
    model = mlp()
    counting = _Counting(kv)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), counting, overlap=False)
    assert len(opt._pskv_sync.buckets) == 1
    frozen = model[0].weight
    x, y = data()[0]
    loss_of(model, x, y).backward()
    frozen.grad = None                                 # as if it got no gradient this step
    opt.step()
    assert len(counting.calls) == 1
    assert torch.equal(frozen.grad, torch.zeros_like(frozen))


@pytest.mark.parametrize("bad", [-1, 1.5, "64k", True])
def test_collective_bytes_must_be_a_number_of_bytes(kv: Any, bad: Any) -> None:
    model = mlp()
    with pytest.raises(ConfigError, match=r"collective_bytes=.* is not a number of bytes"):
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), kv, collective_bytes=bad)
    with pytest.raises(KeyError):
        kv.pull("opt/bucket.0")             # the failed call initialized nothing
    pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                            model.named_parameters(), kv, collective_bytes=None).close()


def test_the_last_bucket_goes_from_backwards_thread_and_its_error_from_step(kv: Any) -> None:
    import threading

    from pskv.errors import ClusterError
    model = mlp()
    threads: list[str] = []
    fail = [False]

    class Store(_Counting):
        def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
            threads.append(threading.current_thread().name)
            if fail[0]:
                raise ClusterError("the round failed")
            super().pushpull(key, value, out=out, priority=priority)

    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), Store(kv), bucket_cap_mb=0.0005)
    n = len(opt._pskv_sync.buckets)
    x, y = data()[0]
    loss_of(model, x, y).backward()
    opt.step()
    assert len(threads) == n
    assert all(t.startswith("pskv-torch") for t in threads[:-1]) or n == 1
    # the last one: from backward's own thread when nothing else was in flight, or the
    # communication thread
    assert threads[-1] in (threading.current_thread().name,) or \
        threads[-1].startswith("pskv-torch")
    threads.clear()
    fail[0] = True
    opt.zero_grad()
    loss_of(model, x, y).backward()           # the failure is not raised in backward
    with pytest.raises(ClusterError, match="the round failed"):
        opt.step()
    fail[0] = False
    opt.zero_grad()
    loss_of(model, x, y).backward()           # and training goes on after it
    opt.step()


def test_one_bucket_is_sent_by_backwards_thread(kv: Any) -> None:
    import threading
    model = mlp()
    threads: list[str] = []

    class Store(_Counting):
        def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
            threads.append(threading.current_thread().name)
            super().pushpull(key, value, out=out, priority=priority)

    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), Store(kv))
    assert len(opt._pskv_sync.buckets) == 1
    x, y = data()[0]
    loss_of(model, x, y).backward()
    assert threads == [threading.current_thread().name]     # no hand-off to the thread
    opt.step()


# ---- gradient_as_bucket_view ------------------------------------------------------------------
def _in_a_bucket(opt: Any, t: Any) -> bool:
    return any(t.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
               for b in opt._pskv_sync.buckets)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to-none", "zeros"])
@pytest.mark.parametrize("passes", [1, 2])
def test_gradient_as_bucket_view_gives_the_same_weights_without_copies(set_to_none: bool,
                                                                       passes: int) -> None:
    ref = mlp(dtype=torch.float64)
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), passes)
    for cap, overlap in ((25, True), (0.0002, True), (None, False)):
        model = mlp(dtype=torch.float64)
        with mx.kv.create("local") as kv:
            opt = pt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                model.named_parameters(), kv, bucket_cap_mb=cap, overlap=overlap,
                backward_passes_per_step=passes, gradient_as_bucket_view=True)
            views = {id(p): v for b in opt._pskv_sync.buckets
                     for p, v in zip(b.member_params, b.grads)}
            for n, (x, y) in enumerate(data()):
                opt.zero_grad(set_to_none=set_to_none)
                for part in range(passes):
                    rows = slice(part * len(x) // passes, (part + 1) * len(x) // passes)
                    (loss_of(model, x[rows], y[rows]) / passes).backward()
                if n and not set_to_none:   # accumulated straight into the bucket: no copy in
                    assert all(p.grad is views[id(p)] for p in model.parameters())
                opt.step()
                assert all(p.grad is views[id(p)] for p in model.parameters())
                assert all(_in_a_bucket(opt, p.grad) for p in model.parameters())
            opt.close()
        for a, b in zip(model.parameters(), want):
            assert torch.equal(a.detach(), b), (cap, overlap)   # bit for bit, as the copies


def test_gradient_as_bucket_view_with_no_sync_and_a_parameter_without_gradient(kv: Any) -> None:
    ref = mlp()
    frozen_ref = ref[0].weight
    want = []
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv, gradient_as_bucket_view=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for net, o, views in ((ref, ref_opt, False), (model, opt, True)):
        for x, y in data():
            o.zero_grad(set_to_none=False)
            net[0].weight.requires_grad_(False)          # no gradient in this step
            with (o.no_sync() if views else contextlib.nullcontext()):
                (loss_of(net, x[:8], y[:8]) / 2).backward()
            (loss_of(net, x[8:], y[8:]) / 2).backward()
            net[0].weight.requires_grad_(True)
            o.step()
        want.append([p.detach().clone() for p in net.parameters()])
    assert frozen_ref is ref[0].weight
    for a, b in zip(*want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_gradient_as_bucket_view_must_be_a_bool(kv: Any, bad: Any) -> None:
    model = mlp()
    with pytest.raises(ConfigError, match="gradient_as_bucket_view=.* is not a bool"):
        pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), kv, gradient_as_bucket_view=bad)
    with pytest.raises(ConfigError, match="with update_on_kvstore=True"):
        pt.DistributedOptimizer(None, model.named_parameters(), kv, update_on_kvstore=True,
                                kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                gradient_as_bucket_view=True)
    assert not any(hasattr(p, "_pskv_synchronized_by") for p in model.parameters())


def test_gradient_as_bucket_view_still_sees_a_parameter_that_changed_shape(kv: Any) -> None:
    model = mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv, gradient_as_bucket_view=True)
    x, y = data()[0]
    loss_of(model, x, y).backward()
    opt.step()
    sync = opt._pskv_sync
    assert all(p.grad is v for p, v in zip(sync.buckets[0].member_params, sync.buckets[0].grads))
    with torch.no_grad():
        model[0].weight.data = torch.zeros(8, 9)  # its .grad (a view) keeps the old shape
    # every .grad is still its view, so only the parameter's own shape tells
    with pytest.raises(ShapeMismatchError, match=r"'0.weight' has shape \(8, 9\) now"):
        sync.fill(sync.buckets[0])
    opt.close()
