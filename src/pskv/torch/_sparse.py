"""Sparse gradients in a DistributedOptimizer: ``nn.Embedding(sparse=True)`` as row_sparse.

A parameter named in ``sparse_params`` stays out of the buckets; at ``step()`` its coalesced
gradient travels as ``(rows, values)``, only the rows this worker's batch touched, never
``V x d`` dense values:

* ``update_on_kvstore=False`` on several workers: an all-gather through two small keys
  (``prefix + 'sparse/' + name + '/rows.<n>'``, int64, and ``.../values.<n>``) of
  ``num_workers`` segments each: worker ``r`` writes ``[count, row_1 .. row_n]`` and its
  values into segment ``r``, zeros elsewhere, so one pushpull of both keys (one round
  trip) gives every worker every worker's pairs, which it sums per row in worker order
  (the same sum on every worker). A segment holds ``cap`` rows; when a worker has more,
  every worker sees the counts, and all of them initialize bigger keys (a collective call
  at the same point everywhere) and exchange again. A row_sparse key is not used here: a
  push to one without an optimizer replaces the whole table (MXNet's rule), zeroing ``V``
  rows on the server every step.
* ``update_on_kvstore=False`` on one worker: nothing to combine; ``.grad`` is coalesced.
* ``update_on_kvstore=True`` (one worker): a row_sparse key of the parameter's shape
  (``prefix + 'sparse/' + name``) starting from its weights; the store's optimizer updates
  the pushed rows (lazily), which are pulled back into the parameter.

Invariants: every worker runs :meth:`SparseParams.synchronize` for the same parameters in
the same order, so their rounds pair up; every worker sees the same counts, so all grow
together.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, ShapeMismatchError, UnsupportedError
from ._broadcast import import_torch, init_keys

if TYPE_CHECKING:
    import torch

__all__ = ["SparseParams", "check_sparse_names"]

#: rows a worker's segment of the exchange keys holds at first (then grown as needed)
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
        self.widths = [int(np.prod(s[1:], dtype=np.int64)) for s in self.shapes]
        self.dtypes = [import_torch().empty(0, dtype=p.dtype).numpy().dtype for p in params]
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
                "workers: each worker would see only the rows it pushed, not those the "
                "others' updates changed. Use update_on_kvstore=False (the torch optimizer "
                "steps on the combined sparse gradient), or pskv.torch.Embedding, whose rows "
                "the store updates and every lookup reads.", key=names[0])

    def __len__(self) -> int:
        return len(self.params)

    def _gather_keys(self, i: int) -> tuple[list[str], list[np.ndarray]]:
        """Parameter ``i``'s exchange keys now, and zero buffers of their sizes."""
        gen, cap = self.generation[i], self.cap[i]
        return ([f"{self.keys[i]}/rows.{gen}", f"{self.keys[i]}/values.{gen}"],
                [np.zeros(self.workers * (cap + 1), np.int64),
                 np.zeros(self.workers * cap * self.widths[i], self.dtypes[i])])

    def init(self, what: str) -> None:
        """Initialize the keys (collective): the exchanges, or the row_sparse weights."""
        if not self.params:
            return
        from .. import nd
        keys: list[str] = []
        values: list[Any] = []
        for i, p in enumerate(self.params):
            if self.update_on_kvstore:
                rows = p.detach().reshape(self.shapes[i][0], -1).numpy()
                keys.append(self.keys[i])
                values.append(nd.array(rows, dtype=rows.dtype).tostype("row_sparse"))
            elif self.workers > 1:
                k, v = self._gather_keys(i)
                keys += k
                values += v
        if keys:
            init_keys(self.kv, keys, values, what, self.prefix)

    # ---- at step() ----------------------------------------------------------------------
    def _rows(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Parameter ``i``'s gradient as (sorted unique rows, values (n, row size))."""
        th = import_torch()
        p, shape = self.params[i], self.shapes[i]
        grad = p.grad
        if tuple(p.shape) != shape:
            raise ShapeMismatchError(
                f"parameter {self.names[i]!r} has shape {tuple(p.shape)} now, but had "
                f"{shape} when the DistributedOptimizer was built. Build a new one (with a "
                "new prefix=) after changing the model.", key=self.names[i],
                shape=tuple(p.shape))
        if grad is None:
            return np.zeros(0, np.int64), np.zeros((0, self.widths[i]), self.dtypes[i])
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
        values = g.values().reshape(rows.size, self.widths[i]).numpy()
        if self.divisor != 1:
            values = values / self.divisor     # DDP divides before it sums
        return rows, np.asarray(values, self.dtypes[i])

    def _all_gather(self, i: int, rows: np.ndarray,
                    values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every worker's ``(rows, values)``, summed per row: sorted unique rows, sums."""
        width = self.widths[i]
        while True:
            cap = self.cap[i]
            keys, (ids, vals) = self._gather_keys(i)
            r = self.kv.rank
            ids[r * (cap + 1)] = rows.size
            if rows.size <= cap:
                ids[r * (cap + 1) + 1:r * (cap + 1) + 1 + rows.size] = rows
                vals[r * cap * width:(r * cap + rows.size) * width] = values.reshape(-1)
            self.kv.pushpull(keys, [ids, vals])    # one round trip for both
            table = ids.reshape(self.workers, cap + 1)
            counts = table[:, 0]
            most = int(counts.max())
            if most <= cap:
                break
            # a worker has more rows than a segment holds: all grow, all exchange again
            self.cap[i] = min(self.shapes[i][0], 1 << (most - 1).bit_length())
            self.generation[i] += 1
            init_keys(self.kv, *self._gather_keys(i), "DistributedOptimizer", self.prefix)
        vals2 = vals.reshape(self.workers, cap, width)
        all_rows = np.concatenate([table[w, 1:1 + int(c)] for w, c in enumerate(counts)])
        all_vals = np.concatenate([vals2[w, :int(c)] for w, c in enumerate(counts)])
        if all_rows.size == 0:
            return all_rows, all_vals
        order = np.argsort(all_rows, kind="stable")      # worker order within a row
        sorted_rows = all_rows[order]
        starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
        return sorted_rows[starts], np.add.reduceat(all_vals[order], starts, axis=0)

    def synchronize(self) -> None:
        """Combine each sparse gradient over the workers: into ``.grad`` as a coalesced
        sparse tensor (divided for 'average'), or, with update_on_kvstore, the store's
        new rows into the parameter."""
        th = import_torch()
        for i, p in enumerate(self.params):
            rows, values = self._rows(i)
            if self.update_on_kvstore:
                self._update(i, rows, values)
                continue
            if self.workers > 1:
                rows, values = self._all_gather(i, rows, values)
            shape = self.shapes[i]
            # rows unique and sorted, so the tensor is coalesced: no invariant check (some
            # torch releases, 2.11 among them, warn that the check is off even when asked)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse invariant checks are "
                                        "implicitly disabled", category=UserWarning)
                p.grad = th.sparse_coo_tensor(
                    th.from_numpy(np.array(rows, np.int64)).reshape(1, -1),
                    th.from_numpy(np.array(values, copy=True)).reshape(
                        (rows.size,) + shape[1:]),
                    shape, is_coalesced=True, check_invariants=False)

    def _update(self, i: int, rows: np.ndarray, values: np.ndarray) -> None:
        """Push the rows to the store's optimizer and pull the new ones (one worker)."""
        from .. import nd
        th = import_torch()
        if rows.size == 0:
            return
        shape, width = self.shapes[i], self.widths[i]
        self.kv.push(self.keys[i], nd.sparse.row_sparse_array((values, rows),
                                                              shape=(shape[0], width)))
        out: Any = nd.sparse.zeros("row_sparse", (shape[0], width), dtype=self.dtypes[i])
        self.kv.row_sparse_pull(self.keys[i], out=out, row_ids=rows)
        index = th.from_numpy(np.array(out.indices.asnumpy(), np.int64))
        got = th.from_numpy(np.array(out.data.asnumpy(), copy=True))
        with th.no_grad():
            p = self.params[i]
            p.index_copy_(0, index, got.reshape((index.numel(),) + shape[1:]).to(p.dtype))
