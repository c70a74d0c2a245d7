"""pskv: the MXNet KVStore as a standalone Python library.

``import pskv as mx`` runs typical MXNet KVStore code unchanged::

    kv = mx.kv.create('local')
    kv.init(3, mx.nd.ones((2, 3)) * 2)
    kv.push(3, [mx.nd.ones((2, 3), mx.gpu(i)) for i in range(4)])
    kv.pull(3, out=a)
"""
from __future__ import annotations

from . import base, ndarray
from . import kvstore as kv
from . import data, lr_scheduler, nd, np, optimizer, test_utils
from .context import Context, cpu, cpu_pinned, current_context, gpu, num_gpus
from .errors import (CheckpointError, ClusterError, ClusterTimeoutError, ConfigError, KeyAlreadyInitializedError,
                     KeyNotInitializedError, KeyTypeError, KVStoreError, MXNetError,
                     NodeFailedError,
                     ProtocolError, ShapeMismatchError, StoreClosedError, UnsupportedError,
                     ValueTypeError)
from .kvstore import KVStore, KVStoreBase, create
from .nd import random  # mx.random.seed, as in MXNet

kvstore = kv

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ClusterTimeoutError",
    "ConfigError",
    "Context",
    "KVStore",
    "KVStoreBase",
    "KVStoreError",
    "KeyAlreadyInitializedError",
    "KeyNotInitializedError",
    "KeyTypeError",
    "MXNetError",
    "NodeFailedError",
    "ProtocolError",
    "ShapeMismatchError",
    "StoreClosedError",
    "UnsupportedError",
    "ValueTypeError",
    "base",
    "cpu",
    "cpu_pinned",
    "create",
    "current_context",
    "data",
    "gpu",
    "kv",
    "kvstore",
    "lr_scheduler",
    "nd",
    "ndarray",
    "np",
    "num_gpus",
    "optimizer",
    "random",
    "test_utils",
]
