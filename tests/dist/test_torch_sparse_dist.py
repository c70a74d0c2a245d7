"""DistributedOptimizer's sparse gradients on thread clusters of 2 workers (issue #15 item 6):
an ``nn.Embedding(sparse=True)`` named in ``sparse_params`` travels as row_sparse and gives
the weights one process gets on the combined batch."""
from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import UnsupportedError  # noqa: E402
from pskv.torch import _sparse  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

ROWS, STEPS = 300, 4

#: the workers are threads of one process, and torch's default generator is global
_TORCH_RNG = threading.Lock()


def model() -> Any:
    with _TORCH_RNG:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(ROWS, 4, sparse=True),
                                   torch.nn.Flatten(), torch.nn.Linear(12, 1))


def batches() -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, ROWS, (16, 3), generator=g), torch.randn(16, 1, generator=g))
            for _ in range(STEPS)]


def make_opt(name: str, params: Any) -> Any:
    return torch.optim.SGD(params, lr=0.2) if name == "sgd" else \
        torch.optim.Adagrad(params, lr=0.2)


def train(m: Any, opt: Any, rank: int | None) -> list[Any]:
    """Steps on the whole batch (rank None) or on the worker's half; at step 1 worker 1 has
    no gradient at all (it skips backward), so its half of that batch is left out."""
    for n, (x, y) in enumerate(batches()):
        opt.zero_grad()
        if rank is None:
            half = 8 if n == 1 else 16          # step 1: only worker 0's half
            loss = torch.nn.functional.mse_loss(m(x[:half]), y[:half])
            (loss / 2 if n == 1 else loss).backward()
        elif not (n == 1 and rank == 1):
            part = slice(8 * rank, 8 * rank + 8)
            torch.nn.functional.mse_loss(m(x[part]), y[part]).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


# torch's own Adagrad makes sparse tensors without saying whether to check them
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
@pytest.mark.parametrize("first_cap", [1024, 4])    # 4: the row exchange grows its key
def test_sparse_params_match_one_process(run_threads: Any, monkeypatch: Any, opt_name: str,
                                         first_cap: int) -> None:
    monkeypatch.setattr(_sparse, "_FIRST_CAP", first_cap)
    ref = model()
    want = train(ref, make_opt(opt_name, ref.parameters()), None)

    def fn(kv: Any) -> Any:
        m = model()
        opt = pt.DistributedOptimizer(make_opt(opt_name, m.parameters()),
                                      m.named_parameters(), kv, sparse_params=["0.weight"])
        assert sum(b.flat.numel() for b in opt._pskv_sync.buckets) == 13   # the Linear only
        got = train(m, opt, kv.rank)
        assert m[0].weight.grad.layout == torch.sparse_coo
        opt.close()
        return got

    results = run_threads(fn)
    for rank, got in results.items():
        assert not isinstance(got, BaseException), got
        for a, b in zip(want, got):
            assert torch.allclose(a, b, atol=1e-5), (rank, (a - b).abs().max())
    assert torch.equal(results[0][0], results[1][0])     # the workers' tables are equal


def test_sparse_params_with_update_on_kvstore_raise_on_every_worker(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        m = model()
        with pytest.raises(UnsupportedError, match="update_on_kvstore=False"):
            pt.DistributedOptimizer(None, m.named_parameters(), kv, update_on_kvstore=True,
                                    kv_optimizer=mx.optimizer.SGD(learning_rate=0.1),
                                    sparse_params=["0.weight"])
        return "raised"

    assert run_threads(fn) == {0: "raised", 1: "raised"}
