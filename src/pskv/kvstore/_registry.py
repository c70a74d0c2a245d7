"""The store-type names: built-in ones and the registry of user classes.

Invariant: ``STORES`` maps a lower-cased class name to a class that ``KVStoreBase.register``
checked (this module imports no store, so every store module may import it).
"""
from __future__ import annotations

__all__ = ["DIST_TYPES", "LOCAL_TYPES", "STORES"]

#: store types served by the in-process LocalKVStore
LOCAL_TYPES = ("local", "device", "local_allreduce_cpu", "local_update_cpu",
               "local_allreduce_device")
#: store types served by the parameter server (DistKVStore)
DIST_TYPES = ("dist", "dist_sync", "dist_async", "dist_sync_device", "dist_device_sync",
              "dist_async_device")
#: lower-cased class name -> a class registered with ``KVStoreBase.register``
STORES: dict[str, type] = {}
