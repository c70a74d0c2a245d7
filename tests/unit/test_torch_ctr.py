"""An embedding table next to a dense model (issue #29, item 2), on a local store.

The canonical CTR model: a table trained by its own row optimizer (``TableSpec(...,
optimizer=...)``) and an MLP trained by a torch optimizer through
``DistributedOptimizer``. The oracle is torch alone: a dense ``nn.Embedding`` holding the
same initial rows, trained by ``torch.optim.SGD`` (the row SGD's numbers are torch's; its
AdaGrad puts eps inside the square root, torch's outside), next to the same MLP and
``torch.optim.Adam``. What cannot work is refused, whichever order the calls come in.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ConfigError, KeyTypeError  # noqa: E402
from pskv.table import TableSpec, Uniform  # noqa: E402

DIM, LR_ROWS, LR_MLP, STEPS = 4, 0.5, 0.05, 6


def _mlp() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2 * DIM, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 1))


def _batches() -> list[tuple[Any, Any]]:
    """(ids (B, 2): a user and an item, raw IDs; clicks (B,))."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 12, (16, 2), generator=g) * 7919 - 40_000
        out.append((ids, torch.randint(0, 2, (16,), generator=g).float()))
    return out


def _loss(mlp: Any, rows: Any, y: Any) -> Any:
    logit = mlp(rows.reshape(len(y), -1)).squeeze(1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logit, y)


def _spec(**kw: Any) -> TableSpec:
    return TableSpec(dim=DIM, init=Uniform(-0.5, 0.5), seed=3, **kw)


def test_ctr_model_on_a_local_store_equals_torch_alone() -> None:
    batches = _batches()
    kv = mx.kv.create("local")
    emb = pt.Embedding(kv, "emb", _spec(optimizer=mx.optimizer.SGD(learning_rate=LR_ROWS)))
    mlp = _mlp()
    opt = pt.DistributedOptimizer(torch.optim.Adam(mlp.parameters(), lr=LR_MLP),
                                  mlp.named_parameters(), kv)
    known = torch.unique(torch.cat([b[0].reshape(-1) for b in batches]))
    initial = kv.lookup("emb", known.numpy(), train=False)[0]
    losses = []
    for ids, y in batches:
        opt.zero_grad()
        loss = _loss(mlp, emb(ids), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    emb.synchronize()
    rows = kv.lookup("emb", known.numpy(), train=False)[0]
    emb.close()
    opt.close()

    # torch alone: the rows in a dense nn.Embedding, trained by torch's SGD
    ref_emb = torch.nn.Embedding(len(known), DIM)
    with torch.no_grad():
        ref_emb.weight.copy_(torch.from_numpy(initial))
    ref_mlp = _mlp()
    ref_opts = [torch.optim.SGD(ref_emb.parameters(), lr=LR_ROWS),
                torch.optim.Adam(ref_mlp.parameters(), lr=LR_MLP)]
    ref_losses = []
    for ids, y in batches:
        for o in ref_opts:
            o.zero_grad()
        loss = _loss(ref_mlp, ref_emb(torch.searchsorted(known, ids)), y)
        loss.backward()
        for o in ref_opts:
            o.step()
        ref_losses.append(loss.item())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(rows, ref_emb.weight.detach().numpy(), atol=1e-5)
    for p, q in zip(mlp.parameters(), ref_mlp.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), atol=1e-5)


def test_distributed_optimizer_refuses_a_store_with_an_optimizer() -> None:
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.AdaGrad())
    mlp = _mlp()
    with pytest.raises(ConfigError, match="update_on_kvstore=False") as info:
        pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.1),
                                mlp.named_parameters(), kv)
    assert "TableSpec(..., optimizer=" in str(info.value)
    assert "update_on_kvstore=True" in str(info.value)
    # refused before anything changed: no key made, nothing hooked; the store's own
    # optimizer path still works
    assert not any(str(k).startswith("opt/") for k in kv._store)
    opt = pt.DistributedOptimizer(None, mlp.named_parameters(), kv, update_on_kvstore=True,
                                  kv_optimizer=mx.optimizer.SGD(learning_rate=0.1))
    opt.close()


@pytest.mark.parametrize("call", ["set_optimizer", "set_updater"])
def test_a_store_refuses_an_optimizer_over_distributed_optimizer_gradients(call: str) -> None:
    kv = mx.kv.create("local")
    mlp = _mlp()
    opt = pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.1),
                                  mlp.named_parameters(), kv, prefix="dense/")
    give = (lambda: kv.set_optimizer(mx.optimizer.AdaGrad())) if call == "set_optimizer" \
        else (lambda: kv.set_updater(lambda key, inp, stored: None))
    with pytest.raises(ConfigError, match=f"{call} on this 'local' store") as info:
        give()
    assert "prefix='dense/'" in str(info.value)
    assert kv._engine.updater is None                  # nothing changed
    # a step still returns the gradients: torch's SGD moves the weights by lr * grad
    before = [p.detach().clone() for p in mlp.parameters()]
    opt.zero_grad()
    mlp(torch.ones(1, 2 * DIM)).sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    opt.step()
    for b, g, p in zip(before, grads, mlp.parameters()):
        torch.testing.assert_close(p.detach(), b - 0.1 * g)
    opt.close()                                        # its keys are no longer trained
    give()


def test_an_embedding_with_no_optimizer_refuses_to_train() -> None:
    kv = mx.kv.create("local")
    emb = pt.Embedding(kv, "emb", _spec())
    ids = torch.tensor([3, 5, 3])
    before = kv.lookup("emb", ids.numpy(), train=False)[0]
    with pytest.raises(ConfigError, match="no optimizer") as info:
        emb(ids).sum().backward()
    assert "TableSpec(..., optimizer=" in str(info.value)
    emb.synchronize()
    np.testing.assert_array_equal(kv.lookup("emb", ids.numpy(), train=False)[0], before)
    with torch.no_grad():                              # a forward alone is fine
        emb(ids)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))   # the store's: trains now
    emb(ids).sum().backward()
    emb.synchronize()
    np.testing.assert_allclose(kv.lookup("emb", np.array([5]), train=False)[0],
                               before[1:2] - 1.0, atol=1e-6)
    emb.close()


def test_distributed_optimizer_on_an_int_keyed_store_says_why() -> None:
    kv = mx.kv.create("local")
    kv.init(0, mx.nd.ones((2,)))
    mlp = _mlp()
    with pytest.raises(KeyTypeError) as info:
        pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.1),
                                mlp.named_parameters(), kv)
    text = str(info.value)
    assert "holds int keys" in text and "str keys" in text, text
    assert "kv.init('w0'" in text, text


def test_the_embedding_example_of_docs_torch_md_runs_as_written() -> None:
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "torch.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if "pt.EmbeddingBag(kv, 'users'" in b]
    assert len(blocks) == 1, "docs/torch.md has no EmbeddingBag example"
    scope: dict[str, Any] = {}
    exec(compile(blocks[0], "docs/torch.md", "exec"), scope)  # noqa: S102 - our own docs
    stats = scope["kv"].table_stats("users")
    ids = torch.cat([b[0] for b in scope["batches"]])
    assert stats["step"] == 4                      # one push a batch, by the table's AdaGrad
    assert stats["rows"] == len(torch.unique(ids))
