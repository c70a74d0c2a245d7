"""``pskv.table``: dynamic embedding tables keyed by raw int64 IDs (docs/embeddings.md).

Declare one with ``kv.init(key, TableSpec(...))``; :class:`DynamicTable` is the table
itself, which a store (or a server) holds and drives.

Examples
--------
>>> import numpy as np, pskv as mx
>>> from pskv.table import TableSpec, Uniform
>>> kv = mx.kv.create('local')
>>> kv.init('emb', TableSpec(dim=4, init=Uniform(-0.1, 0.1), seed=3))
>>> kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
>>> rows, found = kv.lookup('emb', np.array([2**40, -7]))
>>> rows.shape, found.tolist()
((2, 4), [True, True])
>>> kv.push('emb', (np.array([-7]), np.ones((1, 4), np.float32)))
>>> kv.table_stats('emb')['inserts']
2
"""
from __future__ import annotations

from ._hash import shard_of
from ._stream import ChangeBatch, RowMirror
from .dynamic import DynamicTable, initial_values
from .spec import (TTL, Always, Capacity, Constant, CountAdmission, Normal,
                   ProbabilityAdmission, ReadOnly, RowMeta, TableSpec, Uniform, Zeros)

__all__ = ["Always", "Capacity", "ChangeBatch", "Constant", "CountAdmission", "DynamicTable", "Normal",
           "ProbabilityAdmission", "ReadOnly", "RowMeta", "RowMirror", "TTL", "TableSpec", "Uniform",
           "Zeros", "initial_values", "shard_of"]
