"""``pskv.kv.create``: a store by type name."""
from __future__ import annotations

from ..errors import ConfigError
from ._registry import DIST_TYPES, LOCAL_TYPES, STORES
from .base import KVStoreBase

__all__ = ["create"]


def create(name: str = "local") -> KVStoreBase:
    """Create a new KVStore.

    Parameters
    ----------
    name : str, default 'local'
        The store type, case-insensitive. The types:

        In one process (a :class:`LocalKVStore`):

        * ``'local'``: the values pushed for a key (one per device) are summed, and the
          updater or optimizer runs, in host memory.
        * ``'device'``: the same as ``'local'`` in pskv (arrays live in host memory), and
          the one local type that takes :meth:`~LocalKVStore.set_gradient_compression`.
        * ``'local_allreduce_cpu'``: MXNet's legacy name for ``'local'``.
        * ``'local_update_cpu'``: MXNet's legacy name for ``'local'``.
        * ``'local_allreduce_device'``: MXNet's legacy name for ``'device'`` (it takes
          gradient compression too).

        On a parameter server (a :class:`DistKVStore` on each worker; start the script
        with ``pskv-launch``, which starts the scheduler and the servers):

        * ``'dist_sync'``: synchronous training: a key's round closes when every worker has
          pushed it once; then the servers apply the optimizer (or assign) to the sum.
        * ``'dist'``: the same as ``'dist_sync'``.
        * ``'dist_async'``: asynchronous training: the servers apply each push as it
          arrives.
        * ``'dist_sync_device'``: ``'dist_sync'``; each worker sums its devices' values
          in host memory before pushing (as ``'dist_sync'`` does in pskv).
        * ``'dist_device_sync'``: the same as ``'dist_sync_device'``.
        * ``'dist_async_device'``: ``'dist_async'``, with the devices' values summed the same
          way.

        Any other name must be that of a class registered with
        :meth:`KVStoreBase.register` (the class name, lower-cased); a registered name takes
        precedence over the built-in ones. ``'teststore'`` is registered when pskv is
        imported, as in MXNet 1.9.1: a store that keeps nothing, for testing custom-store
        code (``broadcast`` copies, ``pushpull`` sums the values given).

    Returns
    -------
    KVStoreBase
        The new store; ``kv.type`` is ``name`` lower-cased.

    Raises
    ------
    ConfigError
        For an unknown name (MXNet silently gives a local store); the message lists the
        known names.

    Examples
    --------
    >>> import pskv as mx
    >>> kv = mx.kv.create('Device')
    >>> kv.type
    'device'
    """
    if not isinstance(name, str):
        raise ConfigError(f"store type must be a str such as 'local', got {name!r}.")
    lname = name.lower()
    if lname in STORES:
        store: KVStoreBase = STORES[lname]()
        return store
    if lname in LOCAL_TYPES:
        from .local import LocalKVStore
        return LocalKVStore(lname)
    if lname in DIST_TYPES:
        # the dist store needs pyzmq and the cluster variables: imported when asked for
        from .._ps.config import ClusterConfig
        from .server._roles import serve_unless_worker
        from .dist._torchrun import adopt_torchrun
        from .dist._store import DistKVStore
        adopt_torchrun()     # a script torchrun started: a worker, the nodes started for it
        cfg = ClusterConfig.from_env()
        serve_unless_worker(cfg)
        return DistKVStore(lname, cfg)
    known = sorted(set(LOCAL_TYPES) | set(DIST_TYPES) | set(STORES))
    raise ConfigError(f"unknown store type {name!r}. Known types: {', '.join(known)}.",
                      store_type=lname)
