"""KVStoreBase, the store-type registry and ``create``."""
from __future__ import annotations

import builtins
import warnings
from types import TracebackType
from typing import Any, TypeVar

from ..errors import ConfigError, UnsupportedError

__all__ = ["KVStoreBase", "create"]

T = TypeVar("T", bound=type)

#: store types served by the in-process LocalKVStore
LOCAL_TYPES = ("local", "device", "local_allreduce_cpu", "local_update_cpu",
               "local_allreduce_device")
#: store types served by the parameter server (a separate issue)
DIST_TYPES = ("dist", "dist_sync", "dist_async", "dist_sync_device", "dist_device_sync",
              "dist_async_device")


class KVStoreBase:
    """An abstract key-value store for data-parallel training.

    Subclass it and decorate the class with :meth:`KVStoreBase.register` to add a store
    type that :func:`pskv.kv.create` finds by the class name, lower-cased.

    Examples
    --------
    >>> import pskv as mx
    >>> @mx.KVStoreBase.register
    ... class EchoStore(mx.KVStoreBase):
    ...     pass
    >>> type(mx.kv.create('echostore')).__name__
    'EchoStore'
    """

    #: the capability name :meth:`is_capable` answers for optimizers
    OPTIMIZER = "optimizer"

    kv_registry: dict[str, type] = {}

    @staticmethod
    def register(klass: T) -> T:
        """Register a store class under its lower-cased name (a class decorator)."""
        if not isinstance(klass, type) or not issubclass(klass, KVStoreBase):
            raise ConfigError(f"register() takes a KVStoreBase subclass, got {klass!r}.")
        name = klass.__name__.lower()
        if name in KVStoreBase.kv_registry:
            warnings.warn(f"store type {name!r} is already registered; "
                          f"{klass.__module__}.{klass.__name__} replaces it.", stacklevel=2)
        KVStoreBase.kv_registry[name] = klass
        return klass

    # The interface every store implements (MXNet 1.9.1's KVStoreBase).
    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialize ``key`` with ``value`` (rank 0's in a cluster) and pull it into ``out``."""
        raise UnsupportedError(f"{type(self).__name__} does not implement broadcast().")

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Push ``value`` then pull the result into ``out`` (into ``value`` if ``out`` is None)."""
        raise UnsupportedError(f"{type(self).__name__} does not implement pushpull().")

    def set_optimizer(self, optimizer: Any) -> None:
        """Register an optimizer that updates the stored values on push."""
        raise UnsupportedError(f"{type(self).__name__} does not implement set_optimizer().")

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability`` (e.g. ``KVStoreBase.OPTIMIZER``)."""
        raise UnsupportedError(f"{type(self).__name__} does not implement is_capable().")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer states to ``fname``."""
        raise UnsupportedError(
            f"{type(self).__name__} does not implement save_optimizer_states().")

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states saved by :meth:`save_optimizer_states`."""
        raise UnsupportedError(
            f"{type(self).__name__} does not implement load_optimizer_states().")

    def close(self) -> None:
        """Release the store's resources (a store without any has nothing to do)."""

    def __enter__(self) -> KVStoreBase:
        return self

    def __exit__(self, exc_type: builtins.type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def type(self) -> str:
        """The store type name."""
        return type(self).__name__.lower()

    @property
    def rank(self) -> int:
        """This worker's rank (0 for a single process)."""
        return 0

    @property
    def num_workers(self) -> int:
        """The number of workers (1 for a single process)."""
        return 1


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
        precedence over the built-in ones.

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
    if lname in KVStoreBase.kv_registry:
        store: KVStoreBase = KVStoreBase.kv_registry[lname]()
        return store
    if lname in LOCAL_TYPES:
        from .local import LocalKVStore
        return LocalKVStore(lname)
    if lname in DIST_TYPES:
        from .dist import create_dist
        return create_dist(lname)
    known = sorted(set(LOCAL_TYPES) | set(DIST_TYPES) | set(KVStoreBase.kv_registry))
    raise ConfigError(f"unknown store type {name!r}. Known types: {', '.join(known)}.",
                      store_type=lname)

