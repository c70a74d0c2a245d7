"""``TestStore``: the ``'teststore'`` store type MXNet 1.9.1 registers for its custom-store tests.

MXNet 1.9.1 ships it in ``python/mxnet/kvstore/base.py`` (``@KVStoreBase.register class
TestStore``), so ``mx.kv.create('teststore')`` works in every MXNet program; pskv registers
it the same way when :mod:`pskv.kvstore` is imported. It keeps nothing: ``broadcast``
copies ``value`` into each out and ``pushpull`` sums the values given and copies the sum
into each out (into the values when ``out`` is None); it cannot take an optimizer
(``is_capable('optimizer')`` is False) and implements nothing else.

Invariant: a call checks every argument before it writes any out, so a call that raises
changes nothing.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, ShapeMismatchError, UnsupportedError, ValueTypeError
from ..nd.sparse import RowSparseNDArray
from .._types import KeyArg, OutArg, ValueArg
from ._args import as_numpy, normalize
from .base import KVStoreBase

__all__ = ["TestStore"]


@KVStoreBase.register
class TestStore(KVStoreBase):
    """A key-value store for testing custom-store code, as MXNet 1.9.1's ``teststore``.

    It stores nothing: :meth:`broadcast` and :meth:`pushpull` work on the arrays they are
    given. ``type`` is ``'teststore'``, ``rank`` 0 and ``num_workers`` 1;
    ``set_optimizer`` and the optimizer-state calls raise ``UnsupportedError`` (a
    ``NotImplementedError``, as in MXNet), and so do ``init``, ``push`` and ``pull``.

    Examples
    --------
    >>> import pskv as mx
    >>> kv = mx.kv.create('teststore')
    >>> a, b = mx.nd.ones((2,)), mx.nd.ones((2,)) * 2
    >>> kv.pushpull(3, [a, b])
    >>> a.asnumpy(), b.asnumpy()
    (array([3., 3.], dtype=float32), array([3., 3.], dtype=float32))
    >>> kv.is_capable('optimizer')
    False
    """

    __test__ = False  # not a pytest test class, whatever its name

    def broadcast(self, key: KeyArg, value: ValueArg, out: OutArg, priority: int = 0) -> None:
        """Copy ``value`` into ``out`` (each of them, for a list).

        Parameters
        ----------
        key : str or int
            The key (one key; nothing is stored under it).
        value : NDArray or numpy.ndarray
            The value to copy.
        out : NDArray, numpy.ndarray, or list of them
            Where the value is copied to.
        priority : int, default 0
            Accepted for compatibility.
        """
        _, values = self._one_key(key, value, "value")
        if len(values) != 1:
            raise ValueTypeError(f"broadcast of key {key!r} takes one value, got a list of "
                                 f"{len(values)}. Pass one array.", key=key)
        data = as_numpy(values[0])
        targets = self._targets(key, out, data.shape)
        for t in targets:
            np.copyto(t, data, casting="same_kind")

    def pushpull(self, key: KeyArg, value: ValueArg, out: OutArg | None = None,
                 priority: int = 0) -> None:
        """Sum the values given and copy the sum into ``out`` (into ``value`` if None).

        One array with ``out=None`` is left as it is, as in MXNet.

        Parameters
        ----------
        key : str or int
            The key (one key; nothing is stored under it).
        value : NDArray, numpy.ndarray, or list of them
            The values to sum (one per device).
        out : NDArray, numpy.ndarray, or list of them, optional
            Where the sum is copied to.
        priority : int, default 0
            Accepted for compatibility.
        """
        _, values = self._one_key(key, value, "value")
        datas = [as_numpy(v) for v in values]
        for d in datas[1:]:
            if d.shape != datas[0].shape:
                raise ShapeMismatchError(
                    f"pushpull to key {key!r} got values of shapes {datas[0].shape} and "
                    f"{d.shape}. Push arrays of one shape.", key=key, shape=d.shape)
        if out is None and not isinstance(value, (list, tuple)):
            return      # MXNet: nothing to sum and nowhere to write
        targets = self._targets(key, value if out is None else out, datas[0].shape)
        total = datas[0].copy()
        for d in datas[1:]:     # left to right, as MXNet's sum(values)
            total = total + d
        for t in targets:
            np.copyto(t, total, casting="same_kind")

    @staticmethod
    def is_capable(capability: str) -> bool:
        """False for ``'optimizer'`` (a test store cannot update); ConfigError otherwise.

        Raises
        ------
        ConfigError
            For an unknown capability (a ``ValueError``, as MXNet raises).
        """
        if isinstance(capability, str) and capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ConfigError(f"unknown capability {capability!r}. Known: "
                          f"{KVStoreBase.OPTIMIZER!r}.")

    # ---- argument checks -------------------------------------------------------------------
    def _one_key(self, key: Any, value: Any, what: str) -> tuple[Any, list[Any]]:
        if isinstance(key, (list, tuple)):
            raise UnsupportedError(f"a teststore call takes one key, got the list {key!r}. "
                                   "Call it once per key.", key=key, store_type=self.type)
        keys, groups = normalize(key, value, what)
        return keys[0], groups[0]

    def _targets(self, key: Any, out: Any, shape: tuple[int, ...]) -> list[np.ndarray]:
        """The writable NumPy buffers of ``out``, each of ``shape``, checked before any write."""
        _, outs = self._one_key(key, out, "out")
        targets = []
        for o in outs:
            if isinstance(o, RowSparseNDArray):
                raise UnsupportedError(f"teststore writes dense outs only; the out for key "
                                       f"{key!r} is row_sparse. Pass a dense array.",
                                       key=key, store_type=self.type)
            t = as_numpy(o)
            if t.shape != shape:
                raise ShapeMismatchError(
                    f"out for key {key!r} has shape {t.shape}, but the value has shape "
                    f"{shape}. Pass outs of shape {shape}.", key=key, shape=t.shape)
            if not t.flags.writeable:
                raise ValueTypeError(f"out for key {key!r} is read-only. Pass a writable "
                                     "array.", key=key)
            targets.append(t)
        return targets
