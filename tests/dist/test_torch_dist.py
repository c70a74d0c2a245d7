"""torch tensors and pskv.torch on dist stores (issue #4): thread clusters of 2 workers, and
the torch example once under the real launcher."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ShapeMismatchError  # noqa: E402

pytestmark = pytest.mark.timeout(90)

SHAPE = (2, 3)


def ok(results: dict[int, Any]) -> dict[int, Any]:
    """Results by rank, raising the first worker exception."""
    assert sorted(results) == [0, 1], results
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


@pytest.mark.parametrize("servers", [1, 2])
def test_every_call_with_torch_tensors(run_threads: Any, servers: int) -> None:
    n = 1000                                     # split over both servers when servers=2

    def fn(kv: Any) -> dict[str, Any]:
        r = kv.rank
        got: dict[str, Any] = {}
        kv.init(["w", "big"], [torch.full(SHAPE, float(r + 1)), torch.zeros(n)])
        out = torch.zeros(SHAPE)
        ptr = out.data_ptr()
        kv.pull("w", out=out)
        got["init"] = out.clone()                # rank 0's value
        kv.push("w", [torch.ones(SHAPE), torch.full(SHAPE, float(r))])   # two "devices"
        kv.pull("w", out=[out, torch.zeros(SHAPE)])
        got["push"], got["in_place"] = out.clone(), out.data_ptr() == ptr
        big = torch.arange(n, dtype=torch.float32) * (r + 1)
        ptr = big.data_ptr()
        kv.pushpull("big", big)                  # out=None: into the value, in place
        got["pushpull"], got["big_in_place"] = big.clone(), big.data_ptr() == ptr
        nc = torch.zeros(3, 2).t()
        kv.pull("w", out=nc)
        got["non_contiguous"] = nc.clone()
        param = torch.nn.Parameter(torch.zeros(SHAPE))
        kv.pull("w", out=param)
        got["param"] = param.detach().clone()
        got["new"] = kv.pull("big")
        outs = [torch.zeros(4), torch.zeros(4)]
        kv.broadcast("b", torch.full((4,), 10.0 + r), out=outs)
        got["broadcast"] = [o.clone() for o in outs]
        try:
            kv.push("w", torch.zeros(3, 3))
        except ShapeMismatchError as err:
            got["shape_error"] = str(err)
        return got

    res = ok(run_threads(fn, 2, servers, bigarray_bound=100))
    for got in res.values():
        assert torch.equal(got["init"], torch.ones(SHAPE))
        assert torch.equal(got["push"], torch.full(SHAPE, 3.0))   # (1 + 0) + (1 + 1)
        assert got["in_place"] and got["big_in_place"]
        assert torch.equal(got["pushpull"], torch.arange(n, dtype=torch.float32) * 3)
        assert torch.equal(got["non_contiguous"], torch.full(SHAPE, 3.0))
        assert torch.equal(got["param"], torch.full(SHAPE, 3.0))
        assert isinstance(got["new"], torch.Tensor)
        assert torch.equal(got["new"], torch.arange(n, dtype=torch.float32) * 3)
        assert all(torch.equal(o, torch.full((4,), 10.0)) for o in got["broadcast"])
        assert "(3, 3)" in got["shape_error"]


# ---- DistributedOptimizer equals one process on the combined batch ---------------------------
STEPS, LR, MOMENTUM = 5, 0.1, 0.9


def make_model(seed: int) -> Any:
    """The same weights for the same seed; its own generator: the workers are threads and
    torch's global generator is shared between them."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def batches() -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(STEPS)]


@pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["torch-step", "kv-step"])
@pytest.mark.parametrize("servers", [1, 2])
def test_distributed_optimizer_equals_single_process(run_threads: Any, update_on_kvstore: bool,
                                                     servers: int) -> None:
    data = batches()

    def fn(kv: Any) -> list[Any]:
        model = make_model(kv.rank + 10)              # different until the broadcast
        pt.broadcast_parameters(model.state_dict(), kv)
        if update_on_kvstore:
            opt = pt.DistributedOptimizer(
                None, model.named_parameters(), kv, update_on_kvstore=True,
                kv_optimizer=mx.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM))
        else:
            opt = pt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                model.named_parameters(), kv)
        half = slice(8 * kv.rank, 8 * kv.rank + 8)   # each worker: its half of the batch
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[half]), y[half]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    res = ok(run_threads(fn, 2, servers, bigarray_bound=40))
    expected = reference(make_model(10))        # from rank 0's weights, the whole batch
    for params in res.values():
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(res[0], res[1]):
        assert torch.equal(a, b)


def reference(model: Any) -> list[Any]:
    """One process, the whole batch of both workers, torch SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_sum_op_is_the_sum_over_workers(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        w = torch.nn.Parameter(torch.zeros(3))
        opt = pt.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), [("w", w)], kv, op="sum")
        w.grad = torch.full((3,), float(kv.rank + 1))
        opt.step()
        return w.grad.clone(), w.detach().clone()

    for grad, w in ok(run_threads(fn)).values():
        assert torch.equal(grad, torch.full((3,), 3.0)) and torch.equal(w, torch.full((3,), -3.0))


# ---- broadcasts -------------------------------------------------------------------------
@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
@pytest.mark.parametrize("root_rank", [0, 1])
def test_broadcast_parameters_makes_every_model_the_roots(run_threads: Any, root_rank: int,
                                                          store_type: str) -> None:
    """In dist_async too: there a push replaces the value, so the others' zeros (the
    dist_sync round's way) would have wiped the root's values."""
    def fn(kv: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        g = torch.Generator().manual_seed(kv.rank)
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g))
                else:
                    t.fill_(kv.rank + 5)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
        pt.broadcast_parameters(model.state_dict(), kv, root_rank=root_rank)
        after = model.state_dict()
        assert {k: v.data_ptr() for k, v in after.items()} == ptrs     # in place
        return before, {k: v.clone() for k, v in after.items()}

    res = ok(run_threads(fn, store_type=store_type))
    root_before = res[root_rank][0]
    assert not torch.equal(res[0][0]["0.weight"], res[1][0]["0.weight"])
    for _, after in res.values():
        assert after.keys() == root_before.keys()
        for k, v in root_before.items():
            assert torch.equal(after[k], v), k


def test_broadcast_optimizer_state(run_threads: Any) -> None:
    def fn(kv: Any) -> dict[str, Any]:
        model = make_model(kv.rank)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (kv.rank + 1))
        x, y = batches()[kv.rank]
        for _ in range(kv.rank + 1):               # different step counts and moments
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        before = opt.state_dict()
        pt.broadcast_optimizer_state(opt, kv)
        return {"before": _flat(before), "after": _flat(opt.state_dict())}

    res = ok(run_threads(fn))
    want = res[0]["before"]
    assert want != res[1]["before"]
    assert res[0]["after"] == want and res[1]["after"] == want


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {f"group.{k}": v for k, v in state["param_groups"][0].items()
                           if k != "params"}
    for i, st in state["state"].items():
        for name, value in st.items():
            out[f"{i}.{name}"] = np.asarray(value).tolist()
    return out


# ---- the example under the launcher ---------------------------------------------------------
@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("update_on_kvstore", ["0", "1"])
def test_train_torch_example_under_the_launcher(update_on_kvstore: str) -> None:
    pytest.importorskip("sklearn", reason="the torch example needs scikit-learn, which is not "
                                          "installed: pip install 'pskv[examples]'")
    proc = subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "1", "--timeout", "120",
         sys.executable, "-m", "pskv.examples.train_torch", "--kv-store", "dist_sync",
         "--update-on-kvstore", update_on_kvstore, "--epochs", "2", "--max-steps", "40"],
        capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "epoch 1/2: loss" in out and "epoch 0" not in out
    finals = re.findall(r"rank (\d) of 2 done: test accuracy ([\d.]+), loss ([\d.]+), "
                        r"2 epochs \(40 steps\)", out)
    assert sorted(r for r, _, _ in finals) == ["0", "1"], out
    # the loss over the whole training set and the test accuracy: equal when the models are
    assert len({(acc, loss) for _, acc, loss in finals}) == 1, out
    assert all(float(acc) > 0.8 for _, acc, _ in finals), out
