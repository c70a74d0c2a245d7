"""CPU torch tensors in every KVStore call, and pskv.torch on a local store (issue #4).

A push reads the tensor's memory through DLPack, a pull writes straight into it; these tests
check values, that the tensor's memory is the one written (``data_ptr`` unchanged, views
shared) and that the store keeps its own copy.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ConfigError, ShapeMismatchError, ValueTypeError  # noqa: E402
from pskv.kvstore._args import as_numpy  # noqa: E402
from pskv.kvstore.local import SparsePullIgnoredWarning  # noqa: E402

SHAPE = (2, 3)


def ones(*shape: int, value: float = 1.0, dtype: Any = None) -> Any:
    return torch.full(shape or SHAPE, value, dtype=dtype or torch.float32)


@pytest.fixture
def kv() -> Any:
    with mx.kv.create("local") as store:
        yield store


# ---- import ------------------------------------------------------------------------------
def test_import_pskv_and_pskv_torch_do_not_import_torch() -> None:
    code = ("import sys, pskv, pskv.torch; assert 'torch' not in sys.modules, 'torch imported'; "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---- every KVStore call -------------------------------------------------------------------
def test_init_keeps_a_copy_and_pull_new_returns_a_tensor(kv: Any) -> None:
    value = ones(value=2.0)
    kv.init(3, value)
    value += 1                                  # the store kept its own copy
    got = kv.pull(3)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert torch.equal(got, ones(value=2.0))
    again = kv.pull(3)
    assert got.data_ptr() != again.data_ptr()   # each pull(out=None) is a new tensor
    kv.init(4, mx.nd.ones(SHAPE))
    assert isinstance(kv.pull(4), mx.nd.NDArray)  # other keys keep their kind


def test_pull_new_list_of_keys_and_parameter_prototype(kv: Any) -> None:
    kv.init(["w", "b"], [torch.nn.Parameter(ones()), torch.zeros(3, dtype=torch.float64)])
    w, b = kv.pull(["w", "b"])
    assert type(w) is torch.Tensor and not w.requires_grad and torch.equal(w, ones())
    assert b.dtype == torch.float64 and torch.equal(b, torch.zeros(3, dtype=torch.float64))


def test_push_single_list_and_key_lists(kv: Any) -> None:
    kv.init([1, 2], [torch.zeros(SHAPE), torch.zeros(4)])
    kv.push(1, ones(value=3.0))
    assert torch.equal(kv.pull(1), ones(value=3.0))
    kv.push(1, [ones(value=float(i)) for i in range(4)])       # one per device: summed
    assert torch.equal(kv.pull(1), ones(value=6.0))
    kv.push([1, 2], [ones(value=5.0), torch.arange(4.0)])
    assert torch.equal(kv.pull(1), ones(value=5.0))
    assert torch.equal(kv.pull(2), torch.arange(4.0))
    kv.push([1, 2, 1], [[ones(), ones()], torch.ones(4), ones()])   # lists, repeated key
    assert torch.equal(kv.pull(1), ones(value=3.0))


def test_pull_writes_into_the_tensors_memory(kv: Any) -> None:
    kv.init("w", ones(value=7.0))
    out = torch.zeros(SHAPE)
    ptr = out.data_ptr()
    kv.pull("w", out=out)
    assert out.data_ptr() == ptr and torch.equal(out, ones(value=7.0))
    outs = [torch.zeros(SHAPE) for _ in range(3)]
    ptrs = [o.data_ptr() for o in outs]
    kv.pull("w", out=outs)
    assert [o.data_ptr() for o in outs] == ptrs
    assert all(torch.equal(o, ones(value=7.0)) for o in outs)
    kv.init("v", torch.arange(6.0).reshape(SHAPE))
    a, b = torch.zeros(SHAPE), torch.zeros(SHAPE)
    kv.pull(["w", "v"], out=[a, [b]])
    assert torch.equal(a, ones(value=7.0)) and torch.equal(b, torch.arange(6.0).reshape(SHAPE))


def test_pull_into_a_big_tensor_in_place(kv: Any) -> None:
    n = 1 << 18                                  # past the threaded-copy bound
    kv.init(0, torch.arange(n, dtype=torch.float32))
    out = torch.zeros(n)
    ptr = out.data_ptr()
    kv.pull(0, out=[out, torch.zeros(n)])
    assert out.data_ptr() == ptr and torch.equal(out, torch.arange(n, dtype=torch.float32))


def test_pull_into_non_contiguous_tensors(kv: Any) -> None:
    kv.init(0, torch.arange(6.0).reshape(SHAPE))
    base = torch.zeros(3, 2)
    view = base.t()                              # (2, 3), strides (1, 2)
    assert not view.is_contiguous()
    kv.pull(0, out=view)
    assert torch.equal(base, torch.arange(6.0).reshape(SHAPE).t())
    kv.push(0, view * 2)                         # a non-contiguous push reads its strides
    kv.push(0, torch.arange(12.0).reshape(2, 6)[:, ::2])
    assert torch.equal(kv.pull(0), torch.arange(12.0).reshape(2, 6)[:, ::2])


def test_pushpull_and_broadcast(kv: Any) -> None:
    kv.init("g", torch.zeros(SHAPE))
    a = ones()
    ptr = a.data_ptr()
    kv.pushpull("g", [a, a * 2])                 # out=None: into the values
    assert a.data_ptr() == ptr and torch.equal(a, ones(value=3.0))
    out = torch.zeros(SHAPE)
    kv.pushpull("g", ones(value=4.0), out=out)
    assert torch.equal(out, ones(value=4.0))
    outs = [torch.zeros(SHAPE), torch.zeros(SHAPE)]
    kv.broadcast("b", ones(value=9.0), out=outs)
    assert all(torch.equal(o, ones(value=9.0)) for o in outs)
    assert isinstance(kv.pull("b"), torch.Tensor)


def test_row_sparse_keys_are_unaffected(kv: Any) -> None:
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    kv.init(["emb", "w"], [mx.nd.array(table).tostype("row_sparse"), torch.zeros(SHAPE)])
    out = mx.nd.sparse.zeros("row_sparse", (6, 2))
    kv.row_sparse_pull("emb", out=out, row_ids=torch.tensor([4, 1, 4]))  # torch row ids
    assert out.indices.asnumpy().tolist() == [1, 4]
    assert out.data.asnumpy().tolist() == [[2.0, 3.0], [8.0, 9.0]]
    w = torch.zeros(SHAPE)
    sparse_out = mx.nd.sparse.zeros("row_sparse", (6, 2))
    with pytest.warns(SparsePullIgnoredWarning):
        kv.pull(["emb", "w"], out=[sparse_out, w])
    assert sparse_out.indices.asnumpy().size == 0 and torch.equal(w, torch.zeros(SHAPE))


# ---- no copies --------------------------------------------------------------------------------
def test_the_dlpack_view_shares_the_tensors_memory() -> None:
    t = torch.arange(6.0).reshape(SHAPE)
    view = as_numpy(t)
    assert np.shares_memory(view, t.numpy()) and view.flags.writeable
    p = torch.nn.Parameter(torch.ones(3))
    assert np.shares_memory(as_numpy(p), p.detach().numpy())
    nc = t.t()
    assert np.shares_memory(as_numpy(nc), t.numpy()) and as_numpy(nc).shape == (3, 2)


def test_push_reads_the_tensor_without_a_copy(kv: Any) -> None:
    kv.init(3, torch.zeros(SHAPE))
    seen: list[Any] = []
    kv.set_updater(lambda key, inp, stored: seen.append(inp._data))
    g = torch.arange(6.0).reshape(SHAPE)
    kv.push(3, g)                 # one value of the key's dtype: the updater reads it in place
    assert np.shares_memory(seen[0], g.numpy()) and not seen[0].flags.writeable


def test_the_stored_value_is_not_the_callers(kv: Any) -> None:
    t = torch.ones(SHAPE)
    kv.init(3, t)
    kv.push(3, torch.full(SHAPE, 5.0))
    assert torch.equal(t, torch.ones(SHAPE))     # init copied; push did not write back


# ---- requires_grad, dtypes, devices, shapes -------------------------------------------------
def test_requires_grad_parameters(kv: Any) -> None:
    lin = torch.nn.Linear(3, 2)
    kv.init("w", lin.weight)
    kv.push("w", torch.nn.Parameter(torch.full((2, 3), 0.5)))
    ptr = lin.weight.data_ptr()
    kv.pull("w", out=lin.weight)                  # a leaf that requires grad, in place
    assert lin.weight.data_ptr() == ptr and lin.weight.requires_grad
    assert torch.equal(lin.weight.detach(), torch.full((2, 3), 0.5))
    lin(torch.ones(1, 3)).sum().backward()        # autograd still works
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, torch.ones(2, 3))
    kv.pushpull("w", lin.weight.grad)             # grads in place too
    assert torch.equal(lin.weight.grad, torch.ones(2, 3))


def test_dtype_casting(kv: Any) -> None:
    kv.init("f", torch.zeros(SHAPE))
    kv.push("f", ones(value=1.5, dtype=torch.float64))     # float64 -> float32: same_kind
    assert kv.pull("f").dtype == torch.float32
    out64 = torch.zeros(SHAPE, dtype=torch.float64)
    kv.pull("f", out=out64)
    assert torch.equal(out64, ones(value=1.5, dtype=torch.float64))
    out16 = torch.zeros(SHAPE, dtype=torch.float16)
    kv.pull("f", out=out16)
    assert torch.equal(out16, ones(value=1.5, dtype=torch.float16))
    kv.push("f", torch.full(SHAPE, 2, dtype=torch.int32))   # int -> float: same_kind
    assert torch.equal(kv.pull("f"), ones(value=2.0))
    with pytest.raises(ShapeMismatchError):
        kv.pull("f", out=torch.zeros(SHAPE, dtype=torch.int32))   # float -> int: refused
    kv.init("i", torch.zeros(SHAPE, dtype=torch.int64))
    with pytest.raises(ShapeMismatchError):
        kv.push("i", ones())
    assert kv.pull("i").dtype == torch.int64


def test_wrong_shape_raises(kv: Any) -> None:
    kv.init(3, torch.zeros(SHAPE))
    with pytest.raises(ShapeMismatchError, match=r"\(3, 3\)"):
        kv.push(3, torch.zeros(3, 3))
    with pytest.raises(ShapeMismatchError):
        kv.pull(3, out=torch.zeros(6))
    with pytest.raises(ShapeMismatchError):
        kv.pushpull(3, torch.zeros(SHAPE), out=torch.zeros(3, 2))
    assert torch.equal(kv.pull(3), torch.zeros(SHAPE))       # nothing changed


def test_tensors_off_the_cpu_raise(kv: Any) -> None:
    kv.init(3, torch.zeros(SHAPE))
    with pytest.raises(ValueTypeError, match="meta"):
        kv.push(3, torch.zeros(SHAPE, device="meta"))
    with pytest.raises(ValueTypeError, match="meta"):
        kv.pull(3, out=torch.zeros(SHAPE, device="meta"))


def test_a_dtype_numpy_cannot_read_raises(kv: Any) -> None:
    kv.init(3, torch.zeros(SHAPE))
    with pytest.raises(ValueTypeError, match="bfloat16"):
        kv.push(3, torch.zeros(SHAPE, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch; run it on a GPU machine")
def test_cuda_tensors_are_read_and_bfloat16_refused(kv: Any) -> None:  # pragma: no cover
    # docs/gpu.md: CUDA values are read through pinned buffers; tests/gpu has the rest
    kv.init(3, torch.zeros(SHAPE))
    kv.push(3, torch.ones(SHAPE, device="cuda"))
    assert kv.pull(3).tolist() == torch.ones(SHAPE).tolist()
    with pytest.raises(ValueTypeError, match="bfloat16"):
        kv.push(3, torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16))


# ---- pskv.torch on a local store ------------------------------------------------------------
def make_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(seed: int = 1, n: int = 16) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model: Any, opt: Any, steps: int = 5) -> list[float]:
    x, y = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("op", ["average", "sum"])
def test_distributed_optimizer_local_equals_plain_torch(kv: Any, op: str) -> None:
    ref = make_model()
    ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    model = make_model()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), kv, op=op)
    assert isinstance(opt, torch.optim.SGD)
    assert train(model, opt) == ref_losses               # one worker: the same numbers
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    flat = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    assert torch.equal(kv.pull("opt/bucket.0"), flat)     # one bucket of grads, last layer first


def test_distributed_optimizer_manual_averaging() -> None:
    # what step() does, by hand: grads of two "devices" pushed, summed, divided, stepped
    model, ref = make_model(), make_model()
    with mx.kv.create("local") as kv:
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                      model.named_parameters(), kv)
        x, y = batch(n=8)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    grads = []
    for half in (slice(0, 4), slice(4, 8)):
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[half]), y[half]).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    with torch.no_grad():
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p -= 0.5 * (g0 + g1) / 2
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_torch_optimizer", [False, True])
def test_update_on_kvstore_local_equals_torch_sgd(kv: Any, with_torch_optimizer: bool) -> None:
    ref = make_model()
    ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    model = make_model()
    torch_opt = torch.optim.SGD(model.parameters(), lr=123.0) if with_torch_optimizer else None
    opt = pt.DistributedOptimizer(torch_opt, model.named_parameters(), kv,
                                  update_on_kvstore=True,
                                  kv_optimizer=mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    ptrs = [p.data_ptr() for p in model.parameters()]
    np.testing.assert_allclose(train(model, opt), ref_losses, rtol=1e-5)
    assert [p.data_ptr() for p in model.parameters()] == ptrs    # weights pulled in place
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    flat = torch.cat([p.detach().reshape(-1) for p in reversed(list(model.parameters()))])
    assert torch.equal(kv.pull("opt/bucket.0"), flat)     # the store holds the weights


def test_synchronize_then_clip(kv: Any) -> None:
    model = make_model()
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv)
    x, y = batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    moved = sum(float((p.detach() - b).norm() ** 2) for p, b in zip(model.parameters(), before))
    assert moved ** 0.5 == pytest.approx(1e-4, rel=1e-3)   # lr * clipped norm


def test_closure_missing_grads_state_dict_and_lr_scheduler(kv: Any) -> None:
    model = make_model()
    extra = torch.nn.Parameter(torch.ones(2))                # never used: no grad
    params = list(model.named_parameters()) + [("extra", extra)]
    base = torch.optim.SGD([p for _, p in params], lr=0.1, momentum=0.5)
    opt = pt.DistributedOptimizer(base, params, kv)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch()

    def closure() -> Any:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    sched.step()
    assert isinstance(loss, torch.Tensor)
    assert extra.grad is not None and torch.equal(extra.grad, torch.zeros(2))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    state = opt.state_dict()
    assert len(state["state"]) == len(params)
    fresh = make_model()
    other = torch.optim.SGD(list(fresh.parameters()) + [torch.nn.Parameter(torch.ones(2))],
                            lr=1.0, momentum=0.5)
    other.load_state_dict(state)
    assert other.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.load_state_dict(state)                              # and back into the wrapper
    opt.zero_grad()
    assert all(p.grad is None for _, p in params)


def test_distributed_optimizer_errors(kv: Any) -> None:
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="op="):
        pt.DistributedOptimizer(sgd, model.named_parameters(), kv, op="max")
    with pytest.raises(ConfigError, match="kv_optimizer"):
        pt.DistributedOptimizer(sgd, model.named_parameters(), kv, update_on_kvstore=True)
    with pytest.raises(ConfigError):
        pt.DistributedOptimizer(None, model.named_parameters(), kv)
    with pytest.raises(ConfigError, match="no parameters"):
        pt.DistributedOptimizer(sgd, [], kv)
    with pytest.raises(ValueTypeError):
        pt.DistributedOptimizer(object(), model.named_parameters(), kv)   # type: ignore[arg-type]
    with pytest.raises(ValueTypeError, match="twice"):
        pt.DistributedOptimizer(sgd, [("a", model[0].weight), ("a", model[0].bias)], kv)


def test_broadcast_parameters_local(kv: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(5, 4))                  # BatchNorm buffers move; num_batches is 0-d int64
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    pt.broadcast_parameters(model.state_dict(), kv)
    pt.broadcast_parameters(model.named_parameters(), kv, prefix="p/")
    after = model.state_dict()
    assert {k: v.data_ptr() for k, v in after.items()} == ptrs
    for k, v in before.items():
        assert torch.equal(after[k], v)
        assert torch.equal(kv.pull(k), v)
    assert torch.equal(kv.pull("p/0.weight"), before["0.weight"])
    with pytest.raises(ConfigError, match="root_rank"):
        pt.broadcast_parameters(model.state_dict(), kv, root_rank=1, prefix="x/")
    with pytest.raises(ValueTypeError, match="not a torch tensor"):
        pt.broadcast_parameters({"a": np.zeros(3)}, kv, prefix="y/")
    with pytest.raises(ValueTypeError, match="meta"):
        pt.broadcast_parameters({"a": torch.zeros(3, device="meta")}, kv, prefix="z/")


def test_broadcast_optimizer_state_local(kv: Any) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, steps=2)
    before = opt.state_dict()
    pt.broadcast_optimizer_state(opt, kv)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, st in before["state"].items():
        for name, value in st.items():
            assert torch.equal(after["state"][i][name], value)


# ---- the example: python -m pskv.examples.train_torch ---------------------------------------
def test_train_torch_example_prints_like_train(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn", reason="the torch example needs scikit-learn "
                                          "(pip install 'pskv[examples]')")
    from pskv.examples import train_torch as tt
    assert tt.main(["--epochs", "2", "--max-steps", "50", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("training a 64-64-10 torch MLP on digits: local, 1 worker,")
    epochs = [ln for ln in lines if ": loss" in ln]
    assert [ln.split(":")[0] for ln in epochs] == ["epoch 1/2", "epoch 2/2"]  # from 1
    assert all("samples/s  push/pull" in ln for ln in epochs)
    assert lines[-1].startswith("rank 0 of 1 done: test accuracy ")
    assert ", 2 epochs (50 steps) in " in lines[-1] and "crc" not in lines[-1]


def test_train_torch_example_quiet_and_same_weights_both_modes(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn", reason="the torch example needs scikit-learn "
                                          "(pip install 'pskv[examples]')")
    from pskv.examples import train_torch as tt
    assert tt.main(["--max-steps", "3", "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 0 of 1 done:")
    weights = []
    for mode in ("0", "1"):     # torch's SGD on the averaged gradients, or the store's SGD
        args = tt.parse_args(["--max-steps", "10", "--quiet", "--update-on-kvstore", mode])
        with mx.kv.create("local") as kv:
            weights.append(tt.train(args, kv).weights)
    for name, value in weights[0].items():
        np.testing.assert_allclose(weights[1][name], value, rtol=0, atol=1e-5, err_msg=name)


# ---- error hints for torch users ----------------------------------------------------------
def test_dtype_mismatch_hints_are_torch_methods(kv: Any) -> None:
    kv.init("w", torch.zeros(3))
    with pytest.raises(ShapeMismatchError) as info:
        kv.pull("w", out=torch.zeros(3, dtype=torch.int64))
    msg = str(info.value)
    assert ".astype" not in msg                     # torch tensors have no .astype
    assert "torch.float32 tensor" in msg and "out.copy_(buf)" in msg and "torch.int64" in msg
    kv.init("i", torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ShapeMismatchError, match=r"Convert it with \.to\(torch\.int32\)\."):
        kv.push("i", torch.ones(3))
    with pytest.raises(ShapeMismatchError, match=r"\.astype\('float32'\)"):   # NumPy push
        kv.push("w", np.zeros(3, np.complex64))


def test_pull_into_an_int32_tensor_says_dtype_not_shape(kv: Any) -> None:
    """A torch out of another dtype than the key's: the words say dtype (which key, stored
    and given dtype, the shape that fits), with a torch fix; the class stays
    ShapeMismatchError (shape, dtype or size: STYLE.md)."""
    kv.init("w", torch.zeros(SHAPE))
    out = torch.zeros(SHAPE, dtype=torch.int32)
    with pytest.raises(ShapeMismatchError) as info:
        kv.pull("w", out=out)
    msg = str(info.value)
    assert msg.startswith(f"pull key 'w' into an out of dtype torch.int32, but key 'w' holds "
                          f"float32: a dtype mismatch (the shape {SHAPE} fits)"), msg
    assert "torch.float32 tensor" in msg and "out.copy_(buf)" in msg


def test_second_broadcast_names_prefix_as_the_fix(kv: Any) -> None:
    model = torch.nn.Linear(2, 2)
    pt.broadcast_parameters(model.state_dict(), kv)
    with pytest.raises(KeyError) as info:           # KeyAlreadyInitializedError (a KeyError)
        pt.broadcast_parameters(model.state_dict(), kv)
    msg = str(info.value)
    assert "push to change" not in msg
    assert "exists already" in msg and "earlier broadcast_parameters" in msg
    assert "prefix=" in msg and info.value.key == "weight"  # type: ignore[attr-defined]
    pt.broadcast_parameters(model.state_dict(), kv, prefix="round2/")   # the fix works
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pt.DistributedOptimizer(sgd, model.named_parameters(), kv).close()   # unhooks
    with pytest.raises(KeyError, match="earlier DistributedOptimizer .* prefix='opt/'"):
        pt.DistributedOptimizer(sgd, model.named_parameters(), kv)
