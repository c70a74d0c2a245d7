"""``pskv.kv``: key-value stores for data-parallel training (``mxnet.kv``)."""
from __future__ import annotations

from .base import KVStoreBase, create
from .local import LocalKVStore, SparsePullIgnoredWarning

#: MXNet's name for the store class
KVStore = LocalKVStore

__all__ = ["KVStore", "KVStoreBase", "LocalKVStore", "SparsePullIgnoredWarning", "create"]
