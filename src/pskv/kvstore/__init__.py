"""``pskv.kv``: key-value stores for data-parallel training (``mxnet.kv``)."""
from __future__ import annotations

from typing import Any

from ..errors import SparsePullIgnoredWarning
from . import _teststore  # noqa: F401  registers 'teststore', as MXNet 1.9.1's kvstore does
from ._create import create
from ._subscription import Subscription
from .base import KVStoreBase
from .local import LocalKVStore

#: MXNet's name for the store class
KVStore = LocalKVStore

__all__ = ["DistKVStore", "KVStore", "KVStoreBase", "LocalKVStore",
           "SparsePullIgnoredWarning", "Subscription", "create"]


def __getattr__(name: str) -> Any:
    # the dist store needs pyzmq: import it when asked for, not with pskv
    if name == "DistKVStore":
        from .dist._store import DistKVStore
        return DistKVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
