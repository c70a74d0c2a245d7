"""The KVStoreError tree: every error pskv raises for bad input or a failed cluster.

Each subclass also derives from the builtin exception a Python (or MXNet) user would
catch, so ``except ValueError`` keeps working for code written against MXNet.
"""
from __future__ import annotations

__all__ = [
    "ClusterError",
    "ClusterTimeoutError",
    "ConfigError",
    "KVStoreError",
    "KeyNotInitializedError",
    "KeyTypeError",
    "NodeFailedError",
    "ProtocolError",
    "ShapeMismatchError",
    "UnsupportedError",
    "ValueTypeError",
]


class KVStoreError(Exception):
    """Base of every error pskv raises for bad input or a failed cluster.

    Context travels on attributes (``key``, ``shape``, ``store_type``), each ``None``
    when it does not apply.

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, key: object = None, shape: object = None,
                 store_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.shape = shape
        self.store_type = store_type

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class KeyNotInitializedError(KVStoreError, KeyError):
    """A key was pulled or pushed before ``init``, or initialized twice.

    .. versionadded:: 0.1
    """


class KeyTypeError(KVStoreError, TypeError):
    """A key is neither int nor str, or int and str keys were mixed in one store.

    .. versionadded:: 0.1
    """


class ValueTypeError(KVStoreError, TypeError):
    """A value or out is not an array (None, a list where an array belongs, a scalar).

    .. versionadded:: 0.1
    """


class ShapeMismatchError(KVStoreError, ValueError):
    """A shape, dtype, storage type or list length does not match.

    .. versionadded:: 0.1
    """


class UnsupportedError(KVStoreError, NotImplementedError):
    """The operation is not available for this store type or argument.

    .. versionadded:: 0.1
    """


class ConfigError(KVStoreError, ValueError):
    """A bad argument value, environment variable or launcher flag.

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
