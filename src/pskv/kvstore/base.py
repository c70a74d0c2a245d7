"""KVStoreBase: the interface every store type implements, and ``register``.

The registry itself lives in :mod:`._registry` and ``create`` in :mod:`._create`, so that
this module imports no store: local and dist stores are siblings that both import it.
"""
from __future__ import annotations

import builtins
import warnings
from types import TracebackType
from typing import Any, TypeVar, overload

from ..errors import ConfigError, KeyTypeError, UnsupportedError, ValueTypeError
from ..optimizer import Optimizer
from .._types import Array, Key, KeyArg, KeyList, OutArg, Updater, ValueArg
from ._specs import check_optimizer_spec, check_optimizer_values
from ._registry import STORES

__all__ = ["KVStoreBase", "check_capability", "check_optimizer"]

T = TypeVar("T", bound=type)
S = TypeVar("S", bound="KVStoreBase")


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

    #: lower-cased class name -> registered class (the registry of ``create``)
    kv_registry: dict[str, type] = STORES

    @staticmethod
    def register(klass: T) -> T:
        """Register a store class under its lower-cased name (a class decorator)."""
        if not isinstance(klass, type) or not issubclass(klass, KVStoreBase):
            raise ConfigError(f"register() takes a KVStoreBase subclass, got {klass!r}.")
        name = klass.__name__.lower()
        if name in STORES:
            warnings.warn(f"store type {name!r} is already registered; "
                          f"{klass.__module__}.{klass.__name__} replaces it.", stacklevel=2)
        STORES[name] = klass
        return klass

    def _unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"{type(self).__name__} does not implement {what}().",
                                store_type=self.type)

    # The interface every store implements (MXNet 1.9.1's KVStore, typed).
    def init(self, key: KeyArg, value: ValueArg) -> None:
        """Initialize a key (or a list of keys) with a value (one per key)."""
        raise self._unsupported("init")

    def push(self, key: KeyArg, value: ValueArg, priority: int = 0) -> None:
        """Push values; those given for the same key are summed, then the updater runs."""
        raise self._unsupported("push")

    @overload
    def pull(self, key: Key, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> Array: ...

    @overload
    def pull(self, key: KeyList, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> list[Array]: ...

    @overload
    def pull(self, key: KeyArg, out: OutArg, priority: int = 0,
             ignore_sparse: bool = True) -> None: ...

    def pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> Array | list[Array] | None:
        """Copy stored values into ``out``; with ``out=None`` return new arrays."""
        raise self._unsupported("pull")

    def pushpull(self, key: KeyArg, value: ValueArg, out: OutArg | None = None,
                 priority: int = 0) -> None:
        """Push ``value`` then pull the result into ``out`` (into ``value`` if ``out`` is None)."""
        raise self._unsupported("pushpull")

    def broadcast(self, key: KeyArg, value: ValueArg, out: OutArg, priority: int = 0) -> None:
        """Initialize ``key`` with ``value`` (rank 0's in a cluster) and pull it into ``out``."""
        raise self._unsupported("broadcast")

    def row_sparse_pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Pull the rows ``row_ids`` of row_sparse keys into row_sparse ``out``."""
        raise self._unsupported("row_sparse_pull")

    def set_updater(self, updater: Updater) -> None:
        """Set the push updater ``updater(key, input, stored)``."""
        raise self._unsupported("set_updater")

    def set_optimizer(self, optimizer: Any) -> None:
        """Register an optimizer that updates the stored values on push."""
        raise self._unsupported("set_optimizer")

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushed gradients (``{'type': '2bit', 'threshold': 0.5}``)."""
        raise self._unsupported("set_gradient_compression")

    def set_collective(self, key: KeyArg, enabled: bool = True) -> None:
        """Sum ``key`` among the workers (True) or on the servers (False), whatever its
        size; before the key's ``init``, on every worker (docs/collective.md).

        Only a ``dist_sync`` store has a collective path; this default checks the
        arguments and keeps every key where it is, so the same script runs on a ``local``
        store.

        Parameters
        ----------
        key : int, str, or list of them
        enabled : bool, default True
        """
        for k in (list(key) if isinstance(key, (list, tuple)) else [key]):
            if type(k) is not int and type(k) is not str:
                raise KeyTypeError(f"set_collective takes int or str keys (or a list of "
                                   f"them), got {k!r} of type {type(k).__name__}.")
        if type(enabled) is not bool:
            raise ValueTypeError(f"set_collective(key, enabled): enabled must be True or "
                                 f"False, got {enabled!r}.")

    def set_staleness(self, bound: int | None, *, global_bound: int | None = None) -> None:
        """Bound how stale the values a worker reads may be (docs/embeddings.md, "Bounded
        staleness"): ``bound`` push calls of this worker a read may run ahead of (0: read
        your own writes), and ``global_bound`` pushes the fastest live worker may be ahead
        of the slowest. A store type that cannot honour a bound raises
        :class:`~pskv.errors.UnsupportedError`."""
        raise UnsupportedError(
            f"a {self.type!r} store ({type(self).__name__}) cannot bound staleness: it does "
            "not implement set_staleness(). Use a 'local', 'dist_sync' or 'dist_async' "
            "store.", store_type=self.type)

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability`` (e.g. ``KVStoreBase.OPTIMIZER``)."""
        raise self._unsupported("is_capable")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer states to ``fname``."""
        raise self._unsupported("save_optimizer_states")

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states saved by :meth:`save_optimizer_states`."""
        raise self._unsupported("load_optimizer_states")

    def save_checkpoint(self, path: str) -> None:
        """Write every stored value, optimizer state and round to the directory ``path``
        (NumPy arrays + JSON, a manifest, one shard per server; never a pickle)."""
        raise self._unsupported("save_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        """Set every key from the checkpoint in ``path`` (any number of servers wrote it)."""
        raise self._unsupported("load_checkpoint")

    def barrier(self) -> None:
        """Wait for every worker (nothing to wait for in a single process)."""

    def _barrier(self) -> None:
        """MXNet's name for :meth:`barrier`."""
        self.barrier()

    def join(self, timeout: float | None = None) -> int:
        """Leave the rounds of a job whose workers have different amounts of data.

        A worker that has made its last push calls ``join``; until every worker has
        joined, the other workers' ``dist_sync`` rounds complete without it (it counts
        as pushing zeros, the divisor stays the same: DDP's ``Join`` default). Returns
        once every worker has joined, with the rank of the last one to join (as
        ``hvd.join()``). A single-process store has no one to wait for.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for the other workers (default ``PSKV_JOIN_TIMEOUT``).

        Returns
        -------
        int
            The rank of the last worker to join.

        Examples
        --------
        >>> import pskv as mx
        >>> kv = mx.kv.create('local')
        >>> kv.join()
        0
        """
        return 0

    def close(self) -> None:
        """Release the store's resources (a store without any has nothing to do)."""

    def _data_position(self) -> int:
        """A :class:`pskv.data.Sampler` trains through this store: the step to train first
        (docs/data.md). A store in one process has nothing to resume: 0. A second Sampler
        of the store is refused, as a dist store refuses it (D9)."""
        self._claim_data_position()
        return 0

    def _claim_data_position(self) -> None:
        """D9: a store keeps one data position per worker, so one Sampler trains through
        it; a second raises ConfigError (it would start at the first one's step)."""
        if getattr(self, "_data_sampler", False):
            raise ConfigError(
                "Sampler: this store has a Sampler already, and a store keeps one data "
                "position per worker (a second Sampler would start where the first one is, "
                "and a restarted worker could not tell them apart). Make one Sampler for "
                "the whole job, with epochs=E (sampler.epoch says which epoch a batch is "
                "of), and iterate it once; split data that nothing is pushed for "
                "(evaluation) without the store, e.g. "
                "numpy.array_split(indices, kv.num_workers)[kv.rank] or torch's "
                "DistributedSampler. See docs/data.md D9.")
        self._data_sampler = True

    def _data_step(self, step: int) -> None:
        """The sampler's next step begins (a store in one process has nothing to seal)."""

    def _data_sealing(self) -> bool:
        """Whether pushes are sealed before each wait (a Sampler trains through a dist
        store): a step's pushes should then all go before its first wait."""
        return False

    def __enter__(self: S) -> S:
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


def check_optimizer(optimizer: Any, *, need_spec: bool = False) -> dict[str, Any] | None:
    """The one check every store's ``set_optimizer`` runs before it changes anything: what
    that store needs, no more.

    ``optimizer`` must be a pskv Optimizer (else ValueTypeError) whose hyperparameters are
    of their declared types (else ConfigError): every store refuses
    ``SGD(learning_rate='abc')`` here, not at the first push. A local store runs the object
    it was given, as MXNet's does, so that is all it checks (a subclass whose ``__init__``
    takes arguments of its own is fine); a dist store sends it to the servers as a spec, so
    ``need_spec`` also refuses one that cannot travel or that the servers could not rebuild
    and run (a trial update of a copy made from the spec).

    Parameters
    ----------
    optimizer : Optimizer
    need_spec : bool, default False
        True where the optimizer must travel as a spec (a dist store): one that cannot be
        written as a spec, or whose spec does not rebuild a working copy, raises
        ConfigError. False: only the values it holds are checked, and ``None`` returned.

    Returns
    -------
    dict or None
        ``optimizer.to_spec()`` with ``need_spec``, else None.
    """
    if not isinstance(optimizer, Optimizer):
        raise ValueTypeError(
            f"set_optimizer() takes a pskv.optimizer.Optimizer, got "
            f"{type(optimizer).__name__}. Create one with mx.optimizer.create('sgd', ...).")
    check_optimizer_values(optimizer)
    if not need_spec:
        return None
    spec = optimizer.to_spec()
    check_optimizer_spec(optimizer, spec)
    return spec


def check_capability(capability: str) -> bool:
    """``is_capable`` of the built-in stores: True for 'optimizer', ConfigError otherwise."""
    if isinstance(capability, str) and capability.lower() == KVStoreBase.OPTIMIZER:
        return True
    raise ConfigError(f"unknown capability {capability!r}. Known: "
                      f"{KVStoreBase.OPTIMIZER!r}.")
