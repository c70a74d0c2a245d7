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
        ``'local'`` (gradients reduced and weights updated in host memory) or ``'device'``
        (the same in pskv, plus gradient compression), MXNet's legacy aliases
        ``'local_allreduce_cpu'``, ``'local_update_cpu'``, ``'local_allreduce_device'``,
        a ``'dist_*'`` type (in a process started by ``pskv-launch``), or the name of a
        class registered with :meth:`KVStoreBase.register`. Case-insensitive.

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
        from ..server import serve_unless_worker
        from .._ps.config import ClusterConfig
        from .dist import DistKVStore
        cfg = ClusterConfig.from_env()
        serve_unless_worker(cfg)
        return DistKVStore(lname, cfg)
    known = sorted(set(LOCAL_TYPES) | set(DIST_TYPES) | set(STORES))
    raise ConfigError(f"unknown store type {name!r}. Known types: {', '.join(known)}.",
                      store_type=lname)
