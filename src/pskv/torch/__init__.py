"""Data-parallel PyTorch training on a pskv KVStore, in the style Horovod users know.

Every KVStore call accepts CPU torch tensors: a push reads the tensor's memory through
DLPack, a pull writes straight into it (``requires_grad`` parameters included), and the
store copies only what it keeps. On top of that this module offers:

* :func:`broadcast_parameters`: make every worker's parameters (or whole ``state_dict``)
  equal to the root worker's, in place.
* :func:`broadcast_optimizer_state`: the same for a torch optimizer's state.
* :func:`DistributedOptimizer`: wrap a ``torch.optim`` optimizer so that ``step()`` first
  sums (by default: averages) the gradients over all workers through the store, or, with
  ``update_on_kvstore=True``, lets the store's own optimizer update the weights. Gradients
  travel in buckets of ``bucket_cap_mb`` (25 MB, as DDP's), each sent during backward as
  soon as its last gradient is ready; buffers (BatchNorm statistics) are kept rank 0's.
  Parameters named in ``sparse_params`` (``nn.Embedding(sparse=True)``) travel as
  row_sparse: only the rows a step touched.
* :class:`Embedding` and :class:`EmbeddingBag`: torch modules whose rows live in a table
  key of the store (``pskv.table``, raw int64 IDs), updated by the store's optimizer.

The package, by concern: ``_broadcast`` (the broadcasts and tensor checks), ``_buckets``
(which parameters share a key; the check that every worker has the same ones), ``_sync``
(the hooks and the communication thread), ``_sparse`` (sparse gradients as row_sparse),
``_optimizer`` (the wrapper), ``_embedding`` (the table modules).

torch is an optional dependency (``pip install 'pskv[torch]'``): ``import pskv`` never
imports this module, and this module imports torch only when one of its functions runs
(or when :class:`Embedding` or :class:`EmbeddingBag` is first touched: they are
``torch.nn.Module`` classes).
See ``docs/torch.md``.

Examples
--------
A training script (run it under ``pskv-launch -n 2 -s 1 python train.py``)::

    import pskv as mx
    import pskv.torch as pt
    import torch

    kv = mx.kv.create('dist_sync')
    model = torch.nn.Linear(10, 1)
    pt.broadcast_parameters(model.state_dict(), kv)          # every worker starts equal
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv,
                                  named_buffers=model.named_buffers())
    for x, y in shard_of_the_data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()                                           # averaged gradients
"""
from __future__ import annotations

from typing import Any

from ._broadcast import broadcast_optimizer_state, broadcast_parameters
from ._optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "Embedding", "EmbeddingBag", "broadcast_optimizer_state",
           "broadcast_parameters"]

#: names defined in ``_embedding``, which imports torch: loaded on first use (PEP 562)
_LAZY = ("Embedding", "EmbeddingBag")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _embedding
        return getattr(_embedding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
