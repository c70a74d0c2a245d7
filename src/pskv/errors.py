"""The KVStoreError tree: every exception and warning class pskv defines.

Each subclass also derives from the builtin exception a Python (or MXNet) user would
catch, so ``except ValueError`` keeps working for code written against MXNet.

Each class has a ``kind`` (for the classes here, their name) kept in a registry when the
class is defined. A server sends the kind (and the message) of an error back to the worker, and
the worker raises the class registered for it (:func:`pskv.errors.error_from_kind`), so the same misuse
raises the same class from a local and a dist store.
"""
from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ClusterTimeoutError",
    "CommandError",
    "ConfigError",
    "DeviceError",
    "KVStoreError",
    "KeyAlreadyInitializedError",
    "KeyNotInitializedError",
    "KeyTypeError",
    "LearningRateError",
    "LimitError",
    "MXNetError",
    "NodeFailedError",
    "OptimizerStateError",
    "ProtocolError",
    "ShapeMismatchError",
    "SparsePullIgnoredWarning",
    "StalenessError",
    "StaleReadError",
    "StalenessTimeoutError",
    "StoreClosedError",
    "TableIdError",
    "TableSpecError",
    "UnknownArgumentError",
    "UnsupportedError",
    "ValueTypeError",
    "WorkerClosedError",
    "error_from_kind",
    "error_kind",
]

#: kind -> class, filled as each class is defined (module-level state, like the store and
#: optimizer name registries)
_KINDS: dict[str, type[KVStoreError]] = {}


class KVStoreError(Exception):
    """Base of every error pskv raises for bad input or a failed cluster.

    Context travels on attributes (``key``, ``shape``, ``store_type``), each ``None``
    when it does not apply.

    .. versionadded:: 0.1
    """

    #: the stable code this class travels under (see :func:`pskv.errors.error_from_kind`)
    kind: ClassVar[str] = "KVStoreError"

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the classes of this module travel under their own names; another subclass only
        # under a kind it declares (``class MyError(KVStoreError, kind="my_error")``)
        if kind is None and cls.__module__ == __name__:
            kind = cls.__name__
        if kind is not None:
            if kind in _KINDS:
                raise TypeError(f"error kind {kind!r} is taken by {_KINDS[kind].__name__}")
            cls.kind = kind
            _KINDS[kind] = cls

    def __init__(self, message: str, *, key: object = None, shape: object = None,
                 store_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.shape = shape
        self.store_type = store_type

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


_KINDS[KVStoreError.kind] = KVStoreError

#: MXNet's name (``mxnet.base.MXNetError``, also ``mx.MXNetError``): the same class as
#: :class:`KVStoreError`, so ``except mx.MXNetError`` written for MXNet catches every error
#: pskv raises where MXNet raises its MXNetError (a duplicate init, a wrong-shape push, ...).
#: An alias, not a class of its own: pskv raises one tree, and a second base would let
#: ``except MXNetError`` miss the errors raised under their KVStoreError names.
#: docs/differences.md says why.
MXNetError = KVStoreError


class KeyNotInitializedError(KVStoreError, KeyError):
    """A key was pulled or pushed before ``init``.

    .. versionadded:: 0.1
    """


class KeyAlreadyInitializedError(KeyNotInitializedError):
    """A key was initialized (or broadcast) a second time.

    It derives from :class:`KeyNotInitializedError` only because pskv 0.1 raised that class
    for a second init; catch this class (or KeyError) in new code. MXNet 1.9.1 raises its
    MXNetError ("duplicate init of key").

    .. versionadded:: 0.2
    """


class KeyTypeError(KVStoreError, TypeError):
    """A key is neither int nor str, or int and str keys were mixed in one store.

    .. versionadded:: 0.1
    """


class ValueTypeError(KVStoreError, TypeError):
    """A value or out is not an array (None, a list where an array belongs, a scalar).

    .. versionadded:: 0.1
    """


class DeviceError(ValueTypeError):
    """An array lives on a device this process cannot read or write for the store: a CUDA
    device it cannot reach, a device other than CUDA, CUDA memory without PyTorch installed,
    or an out that cannot be written (a JAX array). ``device`` names the device
    (``'cuda:1'``); docs/gpu.md lists each case and its fix.

    .. versionadded:: 0.5
    """

    def __init__(self, message: str, *, key: object = None, shape: object = None,
                 store_type: str | None = None, device: str | None = None) -> None:
        super().__init__(message, key=key, shape=shape, store_type=store_type)
        #: the device the array is on, e.g. ``'cuda:1'``
        self.device = device


class TableIdError(ValueTypeError):
    """IDs given to a dynamic table are not integers (a float, bool or object array).

    .. versionadded:: 0.4
    """


class ShapeMismatchError(KVStoreError, ValueError):
    """A shape, dtype, storage type or list length does not match.

    .. versionadded:: 0.1
    """


class LimitError(KVStoreError, ValueError):
    """A request would make a server hold or send more than a limit of the job allows
    (``PSKV_MAX_KEY_BYTES``, ``PSKV_MAX_KEYS_PER_MESSAGE``, ``PSKV_MAX_REPLY_BYTES``); the
    message names the limit and the setting to raise. Nothing was changed.

    .. versionadded:: 0.4
    """


class UnsupportedError(KVStoreError, NotImplementedError):
    """The operation is not available for this store type or argument.

    .. versionadded:: 0.1
    """


class StoreClosedError(UnsupportedError):
    """A store was used after ``close()``.

    It derives from :class:`UnsupportedError` only because pskv 0.1 raised that class here.

    .. versionadded:: 0.2
    """


class ConfigError(KVStoreError, ValueError):
    """A bad argument value, environment variable or launcher flag.

    .. versionadded:: 0.1
    """


class OptimizerStateError(ConfigError):
    """Saved optimizer states are corrupt, foreign (e.g. an MXNet pickle) or unsupported.

    .. versionadded:: 0.1
    """


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or read: not a checkpoint, incomplete, damaged, or of
    another model (other keys or shapes).

    .. versionadded:: 0.3
    """


class CommandError(ConfigError):
    """A process of a launched job could not be started (``pskv-launch``; its
    ``__cause__`` says why, and the launcher exits with 127 or 126 as a shell would).

    .. versionadded:: 0.3
    """


class TableSpecError(ConfigError):
    """A dynamic table's spec (:class:`pskv.table.TableSpec`) or one of its policies has a
    nonsense parameter: a dimension below 1, a capacity of 0, a probability outside [0, 1].

    .. versionadded:: 0.4
    """


class StalenessError(ConfigError):
    """A staleness bound (``kv.set_staleness``, ``PSKV_STALENESS``,
    ``PSKV_GLOBAL_STALENESS``) that is not a whole number of at least 0, or workers that
    set different global bounds (docs/embeddings.md, "Bounded staleness").

    .. versionadded:: 0.4
    """


class UnknownArgumentError(ConfigError, TypeError):
    """An optimizer got a keyword argument it does not take (MXNet raises TypeError).

    .. versionadded:: 0.1
    """


class LearningRateError(ConfigError, UserWarning):
    """``set_learning_rate`` was called on an optimizer that has an ``lr_scheduler``.

    MXNet 1.9.1 raises ``UserWarning`` here; this class is one too.

    .. versionadded:: 0.1
    """


class ClusterError(KVStoreError, RuntimeError):
    """A distributed store failed: a node died, a peer misbehaved, a round broke.

    .. versionadded:: 0.1
    """


class ProtocolError(ClusterError):
    """A malformed, truncated or unauthenticated message.

    .. versionadded:: 0.1
    """


class NodeFailedError(ClusterError):
    """A peer node died or stopped answering.

    .. versionadded:: 0.1
    """


class ClusterTimeoutError(ClusterError, TimeoutError):
    """A distributed wait ran past its deadline.

    .. versionadded:: 0.1
    """


class StalenessTimeoutError(ClusterTimeoutError):
    """A read held back by the global staleness bound waited longer than
    ``PSKV_ROUND_TIMEOUT`` for a slower worker; the message names that worker, its clock
    and the key (docs/embeddings.md, "Bounded staleness").

    .. versionadded:: 0.4
    """


class StaleReadError(ClusterTimeoutError):
    """A read asked for a table's rows at a version its copy (a serving replica, a
    stream's mirror) has not reached within the wait given; the message names the table,
    the shard, the version held and the one asked for (docs/embeddings.md, "The change
    stream").

    .. versionadded:: 0.6
    """


class WorkerClosedError(ClusterError):
    """A ``dist_sync`` round (or a collective round) needs the push of a worker that has
    closed its store without :meth:`~pskv.kv.KVStoreBase.join`: it can never complete.
    The message names that worker's rank, the key and the round; with uneven data, call
    ``kv.join()`` on each worker that runs out of batches (docs/api.md, "Uneven data").

    .. versionadded:: 0.5
    """


class SparsePullIgnoredWarning(UserWarning):
    """A plain ``pull`` skipped a row_sparse ``out``, as MXNet does; use row_sparse_pull.

    .. versionadded:: 0.1
    """


def error_kind(err: BaseException) -> str:
    """The kind ``err`` travels under: its class's, or ClusterError's for a foreign error."""
    return err.kind if isinstance(err, KVStoreError) else ClusterError.kind


def error_from_kind(kind: str, message: str, key: object = None) -> KVStoreError:
    """A new error of the class registered for ``kind`` (ClusterError if none is)."""
    cls = _KINDS.get(kind, ClusterError)
    return cls(message, key=key)
