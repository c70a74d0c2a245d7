"""pskv.torch's buckets on thread clusters of 2 workers (issue #16): every layout gives the
same weights as the un-bucketed path and as one process; models that differ between the
workers raise on every worker. The comparison with DDP is test_torch_ddp.py."""
from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ShapeMismatchError  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

LR, MOMENTUM, STEPS = 0.1, 0.9, 3


#: the workers are threads of one process, and torch's default generator is global: one
#: thread's manual_seed between another's seed and draws would give the workers different
#: models
_TORCH_RNG = threading.Lock()


def mlp(widths: tuple[int, ...] = (6,) * 8) -> Any:
    layers: list[Any] = []
    with _TORCH_RNG:
        torch.manual_seed(3)
        for a, b in zip((5,) + widths, widths + (3,)):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batches() -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(STEPS)]


def train(model: Any, opt: Any, rows: slice, passes: int) -> list[Any]:
    for x, y in batches():
        x, y = x[rows], y[rows]
        opt.zero_grad()
        n = len(x) // passes
        for k in range(passes):
            part = slice(k * n, (k + 1) * n)
            (torch.nn.functional.cross_entropy(model(x[part]), y[part]) / passes).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


LAYOUTS = [(None, False), (None, True), (0.0003, True), (25, True)]


@pytest.mark.parametrize("passes", [1, 2])
def test_every_layout_gives_the_same_weights_in_both_modes(run_threads: Any,
                                                           passes: int) -> None:
    def fn(kv: Any) -> dict[str, list[Any]]:
        half = slice(8 * kv.rank, 8 * kv.rank + 8)
        out = {}
        for mode in ("torch", "kv"):         # torch-step first: the store gets no optimizer
            for n, (cap, overlap) in enumerate(LAYOUTS):
                model = mlp()
                kw = dict(bucket_cap_mb=cap, overlap=overlap, prefix=f"{mode}{n}/",
                          backward_passes_per_step=passes)
                if mode == "kv":
                    opt = pt.DistributedOptimizer(
                        None, model.named_parameters(), kv, update_on_kvstore=True,
                        kv_optimizer=mx.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM),
                        **kw)
                else:
                    opt = pt.DistributedOptimizer(
                        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                        model.named_parameters(), kv, **kw)
                out[f"{mode}{n}"] = train(model, opt, half, passes)
                opt.close()
            if mode == "torch":    # .grad as the buckets' views (gradient_as_bucket_view)
                model = mlp()
                opt = pt.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                    model.named_parameters(), kv, bucket_cap_mb=0.0003, prefix="views/",
                    backward_passes_per_step=passes, gradient_as_bucket_view=True)
                out["views"] = train(model, opt, half, passes)
                opt.close()
        return out

    results = run_threads(fn, 2, 2, bigarray_bound=40)
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    ref = mlp()
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM),
                 slice(0, 16), passes)
    for mode in ("torch", "kv"):
        base = results[0][f"{mode}0"]
        for rank in (0, 1):
            for n in range(len(LAYOUTS)):
                for a, b in zip(results[rank][f"{mode}{n}"], base):
                    assert torch.equal(a, b), (mode, n, rank)   # bit for bit, every layout
        if mode == "torch":
            for rank in (0, 1):
                for a, b in zip(results[rank]["views"], base):
                    assert torch.equal(a, b), ("views", rank)
        for a, b in zip(base, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["shape", "name", "count", "dtype"])
def test_models_that_differ_raise_on_every_worker(run_threads: Any, change: str) -> None:
    def fn(kv: Any) -> Any:
        model = mlp()
        named = list(model.named_parameters())
        if kv.rank == 1:
            if change == "shape":
                named[2] = (named[2][0], torch.nn.Parameter(torch.zeros(6, 7)))
            elif change == "name":
                named[2] = ("renamed", named[2][1])
            elif change == "count":
                named = named[:-1]
            else:
                named[2] = (named[2][0], torch.nn.Parameter(named[2][1].double()))
        opt = pt.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=LR), named,
                                      kv)
        return opt

    results = run_threads(fn, 2, 1)
    for rank, err in results.items():
        assert isinstance(err, ShapeMismatchError), (rank, err)
        assert "is not the same on every worker" in str(err), err
        assert "Build the same model on every worker" in str(err)
