"""Sparse gradients in a DistributedOptimizer: ``nn.Embedding(sparse=True)`` as row_sparse.

A parameter named in ``sparse_params`` stays out of the buckets and gets a row_sparse key of
its own shape (``prefix + 'sparse/' + name``). At ``step()`` its coalesced gradient travels
as ``(rows, values)``: a push of the rows this worker touched and a ``row_sparse_pull`` of
the rows any worker touched, never ``V x d`` dense values.

Which rows any worker touched (the union) comes from an exchange of row numbers through
one int64 key of ``num_workers`` segments (worker ``r`` writes ``[n, row_1 .. row_n]`` into
segment ``r``, zeros elsewhere, so the round's sum is every worker's list). A segment holds
``cap`` rows; when a worker has more, every worker sees the counts, and all of them
initialize a bigger key (a collective call at the same point everywhere) and exchange again.

Invariants: every worker runs :meth:`SparseParams.synchronize` for the same parameters in
the same order, so their rounds pair up; the union is the same on every worker, so they
all skip (an empty union) or all push and pull together.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, ShapeMismatchError, UnsupportedError
from ._broadcast import import_torch, init_keys

if TYPE_CHECKING:
    import torch

__all__ = ["SparseParams", "check_sparse_names"]

#: rows a worker's segment of the exchange key holds at first (then grown as needed)
_FIRST_CAP = 1024


def check_sparse_names(sparse_params: Any, names: list[str],
                       params: list[torch.Tensor]) -> list[int]:
    """Indices (into ``names``) of the parameters ``sparse_params`` names; checked."""
    if sparse_params is None:
        return []
    if isinstance(sparse_params, str):
        sparse_params = [sparse_params]
    try:
        wanted = list(sparse_params)
    except TypeError as err:
        raise ConfigError(f"sparse_params={sparse_params!r} is not a list of parameter names. "
                          "Pass e.g. sparse_params=['emb.weight'].") from err
    where = {n: i for i, n in enumerate(names)}
    out = []
    for name in wanted:
        if name not in where:
            known = ", ".join(repr(n) for n in sorted(where)[:8])
            raise ConfigError(
                f"sparse_params names {name!r}, which is not among the parameters that "
                f"require grad ({known}{', ...' if len(where) > 8 else ''}). Pass the names "
                "model.named_parameters() gives, e.g. 'emb.weight'.", key=name)
        p = params[where[name]]
        if p.dim() < 1 or p.shape[0] < 1:
            raise ShapeMismatchError(
                f"sparse_params names {name!r} of shape {tuple(p.shape)}; a sparse gradient "
                "needs a parameter with rows (nn.Embedding's weight). Leave it out of "
                "sparse_params.", key=name, shape=tuple(p.shape))
        if where[name] not in out:
            out.append(where[name])
    return out


class SparseParams:
    """The sparse parameters of one DistributedOptimizer, their keys and the exchange."""

    def __init__(self, kv: Any, names: list[str], params: list[torch.Tensor], prefix: str,
                 update_on_kvstore: bool, divisor: int) -> None:
        self.kv = kv
        self.names = names
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.keys = [f"{prefix}sparse/{n}" for n in names]
        self.prefix = prefix
        self.update_on_kvstore = update_on_kvstore
        self.divisor = divisor
        self.workers = kv.num_workers
        self.cap = [min(_FIRST_CAP, s[0]) for s in self.shapes]
        self.generation = [0] * len(params)
        if update_on_kvstore and self.workers > 1 and params:
            raise UnsupportedError(
                f"sparse_params {names!r} with update_on_kvstore=True on {self.workers} "
                "workers: the store's optimizer would also update the keys that tell the "
                "workers which rows changed. Use update_on_kvstore=False (the torch optimizer "
                "steps on the combined sparse gradient), or pskv.torch.Embedding, whose rows "
                "the store updates.", key=names[0])

    def __len__(self) -> int:
        return len(self.params)

    def _ids_key(self, i: int) -> str:
        return f"{self.keys[i]}/rows.{self.generation[i]}"

    def init(self, what: str) -> None:
        """Initialize the keys (collective): rows (zeros, or the weights) and exchanges."""
        if not self.params:
            return
        from .. import nd
        values = []
        for p, shape in zip(self.params, self.shapes):
            rows = p.detach().reshape(shape[0], -1).numpy() if self.update_on_kvstore else \
                np.zeros((shape[0], int(np.prod(shape[1:], dtype=np.int64))),
                         p.detach().numpy().dtype)
            values.append(nd.array(rows, dtype=rows.dtype).tostype("row_sparse"))
        keys = list(self.keys)
        if self.workers > 1:
            keys += [self._ids_key(i) for i in range(len(self.params))]
            values += [np.zeros(self.workers * (c + 1), np.int64) for c in self.cap]
        init_keys(self.kv, keys, values, what, self.prefix)

    # ---- at step() ----------------------------------------------------------------------
    def _rows(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Parameter ``i``'s gradient as (sorted unique rows, values (n, row size))."""
        th = import_torch()
        p, shape = self.params[i], self.shapes[i]
        width = int(np.prod(shape[1:], dtype=np.int64))
        grad = p.grad
        if tuple(p.shape) != shape:
            raise ShapeMismatchError(
                f"parameter {self.names[i]!r} has shape {tuple(p.shape)} now, but had "
                f"{shape} when the DistributedOptimizer was built. Build a new one (with a "
                "new prefix=) after changing the model.", key=self.names[i],
                shape=tuple(p.shape))
        if grad is None:
            return np.zeros(0, np.int64), np.zeros((0, width), p.detach().numpy().dtype)
        if grad.layout != th.sparse_coo:
            raise ConfigError(
                f"parameter {self.names[i]!r} is in sparse_params but got a {grad.layout} "
                "gradient. Name only parameters whose gradient is sparse "
                "(nn.Embedding(sparse=True)) in sparse_params.", key=self.names[i])
        g = grad.coalesce()
        if g.sparse_dim() != 1:
            raise ShapeMismatchError(
                f"parameter {self.names[i]!r} got a sparse gradient with {g.sparse_dim()} "
                "sparse dimensions; row_sparse needs 1 (whole rows, as nn.Embedding's). "
                "Leave it out of sparse_params (and make it dense).", key=self.names[i])
        rows = g.indices()[0].numpy().astype(np.int64, copy=False)
        values = g.values().reshape(rows.size, width).numpy()
        return rows, values

    def _union(self, i: int, rows: np.ndarray) -> np.ndarray:
        """The sorted union of every worker's ``rows`` (the same on every worker)."""
        if self.workers == 1:
            return rows
        while True:
            seg = self.cap[i] + 1
            buf = np.zeros(self.workers * seg, np.int64)
            mine = buf[self.kv.rank * seg:(self.kv.rank + 1) * seg]
            mine[0] = rows.size
            if rows.size <= self.cap[i]:
                mine[1:1 + rows.size] = rows
            self.kv.pushpull(self._ids_key(i), buf)
            table = buf.reshape(self.workers, seg)
            counts = table[:, 0]
            most = int(counts.max())
            if most <= self.cap[i]:
                return np.unique(np.concatenate(
                    [table[w, 1:1 + int(c)] for w, c in enumerate(counts)]))
            # some worker has more rows than a segment holds: all grow, all exchange again
            self.cap[i] = min(self.shapes[i][0], 1 << (most - 1).bit_length())
            self.generation[i] += 1
            init_keys(self.kv, [self._ids_key(i)],
                      [np.zeros(self.workers * (self.cap[i] + 1), np.int64)],
                      "DistributedOptimizer", self.prefix)

    def synchronize(self) -> None:
        """Combine each sparse gradient over the workers: into ``.grad`` as a coalesced
        sparse tensor (divided for 'average'), or, with update_on_kvstore, the store's
        new rows into the parameter."""
        from .. import nd
        th = import_torch()
        for i, p in enumerate(self.params):
            rows, values = self._rows(i)
            union = self._union(i, rows)
            shape = self.shapes[i]
            if union.size == 0:
                if not self.update_on_kvstore:
                    p.grad = th.sparse_coo_tensor(th.zeros((1, 0), dtype=th.int64),
                                                  th.zeros((0,) + shape[1:], dtype=p.dtype),
                                                  shape, is_coalesced=True,
                                                  check_invariants=False)
                continue
            if self.divisor != 1:
                values = values / self.divisor     # DDP divides before it sums
            width = int(np.prod(shape[1:], dtype=np.int64))
            self.kv.push(self.keys[i], nd.sparse.row_sparse_array(
                (values, rows), shape=(shape[0], width)))
            out = nd.sparse.zeros("row_sparse", (shape[0], width), dtype=values.dtype)
            self.kv.row_sparse_pull(self.keys[i], out=out, row_ids=union)
            index = th.from_numpy(np.array(out.indices.asnumpy(), np.int64))  # sorted: union
            got = th.from_numpy(np.array(out.data.asnumpy(), copy=True)).reshape(
                (index.numel(),) + shape[1:])
            if self.update_on_kvstore:
                with th.no_grad():
                    p.index_copy_(0, index, got.to(p.dtype))
            else:
                # rows unique and sorted (row_sparse_pull's out), so no invariant check
                p.grad = th.sparse_coo_tensor(index.reshape(1, -1), got.to(p.dtype), shape,
                                              is_coalesced=True, check_invariants=False)
