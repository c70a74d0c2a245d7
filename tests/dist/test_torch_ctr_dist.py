"""The canonical CTR model on dist stores (issue #29, item 2): dynamic tables trained by
their own row optimizer (``TableSpec(..., optimizer=AdaGrad)``), a dense MLP by a torch
optimizer through ``DistributedOptimizer``. Thread clusters of 2 workers; the docs example
runs under the real launcher.

A 2-worker ``dist_sync`` step on two halves of a batch equals one process's step on the
whole batch: the MLP's gradients are averaged (``op='average'``), the table's pushes summed
by the servers' round, so its optimizer takes ``rescale_grad=1/num_workers``.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: pip install 'pskv[torch]' (or torch alone)")

import pskv as mx  # noqa: E402
import pskv.torch as pt  # noqa: E402
from pskv.errors import ConfigError  # noqa: E402
from pskv.table import TableSpec, Uniform  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DIM, LR_ROWS, LR_MLP, STEPS, BATCH = 4, 0.1, 0.05, 5, 32
DOCS = Path(__file__).resolve().parents[2] / "docs" / "embeddings.md"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)                # once, in the main thread: every worker copies it
    return _model().state_dict()


def _model() -> Any:
    return torch.nn.Sequential(torch.nn.Linear(2 * DIM, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 1))


def _batches() -> list[tuple[Any, Any]]:
    """Global batches: (ids (B, 2): a user and an item, raw IDs; clicks (B,))."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 20, (BATCH, 2), generator=g) * 104_729 - 2**40,
             torch.randint(0, 2, (BATCH,), generator=g).float()) for _ in range(STEPS)]


def _spec(num_workers: int) -> TableSpec:
    return TableSpec(dim=DIM, init=Uniform(-0.5, 0.5), seed=4, optimizer=mx.optimizer.AdaGrad(
        learning_rate=LR_ROWS, rescale_grad=1.0 / num_workers))


def _train(kv: Any, state: dict[str, Any], batches: list[tuple[Any, Any]],
           probe: Any) -> tuple[list[float], np.ndarray, list[np.ndarray]]:
    """Train on this worker's half of each batch (all of it in one process); the losses
    of the global batches (this worker's half's), the probed rows, the MLP's weights."""
    nw, rank = kv.num_workers, kv.rank
    emb = pt.Embedding(kv, "emb", _spec(nw))
    mlp = _model()
    mlp.load_state_dict(state)
    opt = pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=LR_MLP),
                                  mlp.named_parameters(), kv)
    losses = []
    for ids, y in batches:
        half = slice(rank * len(y) // nw, (rank + 1) * len(y) // nw)
        ids, y = ids[half], y[half]
        opt.zero_grad()
        logit = mlp(emb(ids).reshape(len(y), -1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    emb.synchronize()
    kv.barrier()
    rows = kv.lookup("emb", probe, train=False)[0]
    weights = [p.detach().numpy().copy() for p in mlp.parameters()]
    emb.close()
    opt.close()
    return losses, rows, weights


def test_two_dist_sync_workers_equal_one_process_on_the_combined_batch(
        run_threads: Any) -> None:
    state, batches = _state(), _batches()
    probe = torch.unique(torch.cat([b[0].reshape(-1) for b in batches])).numpy()
    with mx.kv.create("local") as kv:
        want_losses, want_rows, want_weights = _train(kv, state, batches, probe)

    results = run_threads(lambda kv: _train(kv, state, batches, probe))
    halves = []
    for rank, got in sorted(results.items()):
        assert not isinstance(got, BaseException), (rank, got)
        losses, rows, weights = got
        np.testing.assert_allclose(rows, want_rows, atol=1e-5, err_msg=f"worker {rank}")
        for w, v in zip(weights, want_weights):
            np.testing.assert_allclose(w, v, atol=1e-5, err_msg=f"worker {rank}")
        halves.append(losses)
    # each worker's loss is the mean over its half: their mean is the whole batch's
    np.testing.assert_allclose(np.mean(halves, axis=0), want_losses, rtol=1e-5)


def test_dist_async_trains_the_table_and_the_mlp(run_threads: Any) -> None:
    state, batches = _state(), _batches()
    probe = torch.unique(torch.cat([b[0].reshape(-1) for b in batches])).numpy()

    def fn(kv: Any) -> Any:
        before = _model()
        before.load_state_dict(state)
        losses, rows, weights = _train(kv, state, batches, probe)
        return rows, weights, [p.detach().numpy() for p in before.parameters()]

    results = run_threads(fn, store_type="dist_async")
    initial = TableSpec(dim=DIM, init=Uniform(-0.5, 0.5), seed=4)
    from pskv.table.dynamic import initial_values
    start = initial_values(initial, probe)
    for rank, got in sorted(results.items()):
        assert not isinstance(got, BaseException), (rank, got)
        rows, weights, before = got
        assert np.isfinite(rows).all() and np.isfinite(np.concatenate(
            [w.ravel() for w in weights])).all()
        assert not np.allclose(rows, start)                     # the rows were trained
        assert any(not np.allclose(w, b) for w, b in zip(weights, before))  # and the MLP


def test_dist_stores_refuse_a_store_optimizer_under_gradient_keys(run_threads: Any) -> None:
    state = _state()

    def fn(kv: Any) -> list[str]:
        mlp = _model()
        mlp.load_state_dict(state)
        opt = pt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.1),
                                      mlp.named_parameters(), kv)
        seen = []
        with pytest.raises(ConfigError) as info:
            kv.set_optimizer(mx.optimizer.AdaGrad())
        seen.append(str(info.value))
        opt.close()
        kv.set_optimizer(mx.optimizer.AdaGrad())               # nothing holds keys now
        other = _model()
        with pytest.raises(ConfigError) as info:
            pt.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                    other.named_parameters(), kv, prefix="two/")
        seen.append(str(info.value))
        return seen

    results = run_threads(fn)
    for rank, got in sorted(results.items()):
        assert not isinstance(got, BaseException), (rank, got)
        assert "set_optimizer on this 'dist_sync' store" in got[0], got
        assert "store that has an optimizer" in got[1], got


def _docs_example() -> str:
    blocks = re.findall(r"```python\n(# ctr_torch\.py.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/embeddings.md has no '# ctr_torch.py' example"
    return blocks[0]


@pytest.mark.timeout(180)
def test_the_docs_pytorch_ctr_example_runs_under_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "ctr_torch.py"
    script.write_text(_docs_example())
    proc = subprocess.run(
        [sys.executable, "-m", "pskv.launch", "-n", "2", "-s", "1", "--timeout", "150",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = re.findall(r"worker (\d) of 2: loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert sorted(r for r, _, _ in done) == ["0", "1"], proc.stdout
    for _rank, first, last in done:
        assert float(last) < float(first), proc.stdout       # it learns
