"""KeyTable: what a store knows of its keys, and the checks every store runs on arguments.

Both stores (local and dist) own one KeyTable; a call normalizes its arguments with
:func:`._args.normalize`, then validates them here, whole, before it changes anything.
Invariants: one kind of key (int or str) per table; ``records`` holds exactly the
initialized keys, each with the shape, dtype, kind (dense or row_sparse) and context it was
initialized with, its init order (``ikey``) and, in a dist store, its placement.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import (KeyAlreadyInitializedError, KeyNotInitializedError, KeyTypeError,
                      ShapeMismatchError, SparsePullIgnoredWarning, StoreClosedError,
                      UnsupportedError, ValueTypeError)
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._ps.partition import Segment
from .._types import Key
from ._args import as_numpy, check_key, dtype_hint, tensor_maker

__all__ = ["KeyRecord", "KeyTable"]


def _same_kind(src: np.dtype[Any], dst: np.dtype[Any]) -> bool:
    return src == dst or bool(np.can_cast(src, dst, casting="same_kind"))


@dataclass(slots=True)
class KeyRecord:
    """One initialized key: what it holds and (dist) where it lives."""

    key: Key
    ikey: int                       # init order: MXNet's int id for str keys
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sparse: bool
    ctx: Any                        # the Context of the init value (None for NumPy)
    proto: Any                      # what pull(out=None) returns: a type, a maker or an rsp
    pskey: int = 0                  # dist: the key on the wire
    segments: list[Segment] = field(default_factory=list)   # dist: placement
    collective: bool = False        # dist_sync: summed among the workers (_collective.py)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


class KeyTable:
    """The keys of one store, and the argument checks of every call."""

    def __init__(self, store_type: str) -> None:
        self.store_type = store_type
        self.records: dict[Key, KeyRecord] = {}
        self.kind: type | None = None
        self.closed = False
        self._warned: set[Key] = set()

    # ---- records -----------------------------------------------------------------------
    def make(self, key: Key, value: Any, given: Any = None) -> KeyRecord:
        """A record of ``key`` initialized with ``value`` (validated), not yet added.

        ``given``: what the caller passed, when ``value`` is its host copy (a CUDA
        tensor's): ``pull(key)`` then makes tensors on that device.
        """
        sparse = isinstance(value, RowSparseNDArray)
        arr = value if isinstance(value, NDArray) else as_numpy(value)
        if sparse:
            proto: Any = value
        elif isinstance(value, NDArray):
            proto = type(value)
        else:
            proto = tensor_maker(value if given is None else given) or np.ndarray
        ctx = value.context if isinstance(value, NDArray) else None
        return KeyRecord(key, -1, tuple(arr.shape), np.dtype(arr.dtype), sparse, ctx, proto)

    def add(self, rec: KeyRecord) -> KeyRecord:
        """Add ``rec``: its key is initialized from now on (``ikey``: the next number)."""
        if self.kind is None:
            self.kind = type(rec.key)
        rec.ikey = len(self.records)
        self.records[rec.key] = rec
        return rec

    def get(self, key: Key, action: str) -> KeyRecord:
        """The record of ``key``, or KeyNotInitializedError naming ``action``."""
        rec = self.records.get(key)
        if rec is None:
            raise KeyNotInitializedError(
                f"cannot {action} key {key!r} in this {self.store_type!r} store: it was never "
                f"initialized. Call kv.init({key!r}, value) first.", key=key,
                store_type=self.store_type)
        return rec

    def new_out(self, rec: KeyRecord, data: np.ndarray) -> Any:
        """What ``pull(key)`` with ``out=None`` returns: ``data`` (owned) in the init kind."""
        proto = rec.proto
        if proto is np.ndarray:
            return data
        if isinstance(proto, RowSparseNDArray):
            return RowSparseNDArray._all_rows(data, rec.ctx)
        if not isinstance(proto, type):   # torch.from_numpy: _args.tensor_maker
            return proto(data)
        out: Any = object.__new__(proto)
        out._data = data
        out._ctx = rec.ctx
        return out

    # ---- checks ------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise StoreClosedError after ``close()``."""
        if self.closed:
            raise StoreClosedError(
                f"this {self.store_type!r} store is closed: it cannot be used after close(). "
                "Create a new one with pskv.kv.create().", store_type=self.store_type)

    def check_kind(self, keys: Sequence[Key]) -> None:
        """Every key is of the store's one kind (int or str)."""
        kind = self.kind or type(keys[0])
        for k in keys:
            if type(k) is not kind:
                raise KeyTypeError(
                    f"key {k!r} is a {type(k).__name__} but this store uses {kind.__name__} "
                    "keys. Use one kind of key per store.", key=k, store_type=self.store_type)

    def check_array(self, key: Key, arr: Any, ref: Any, action: str,
                    into: bool = False) -> None:
        """``arr`` fits ``ref`` (anything with shape and dtype): same shape, and a
        same_kind cast into it (``into``: out of it)."""
        data = getattr(arr, "_data", None)
        if type(data) is np.ndarray and type(arr) is not RowSparseNDArray and \
                data.shape == ref.shape and data.dtype == ref.dtype:
            return                        # the common case, decided without NumPy calls
        shape = tuple(arr.shape)
        want = tuple(ref.shape)
        if shape != want:
            raise ShapeMismatchError(
                f"{action} key {key!r} got shape {shape}, but key {key!r} was initialized "
                f"with shape {want}. {action.capitalize()} {want} arrays, or "
                "init a new key.", key=key, shape=shape, store_type=self.store_type)
        dtype = arr.dtype if isinstance(arr, (NDArray, np.ndarray)) else as_numpy(arr).dtype
        src, dst = (ref.dtype, np.dtype(dtype)) if into else (np.dtype(dtype), ref.dtype)
        if not _same_kind(src, dst):
            # ShapeMismatchError covers dtypes too (STYLE.md), so the words say which
            shown = arr.dtype if type(arr).__module__.startswith("torch") else dtype
            got = f"into an out of dtype {shown}" if into else f"got dtype {shown}"
            raise ShapeMismatchError(
                f"{action} key {key!r} {got}, but key {key!r} holds {ref.dtype}: a dtype "
                f"mismatch (the shape {shape} fits), and {src} cannot be cast to {dst} "
                f"safely (NumPy 'same_kind'). {dtype_hint(arr, ref.dtype, into)}", key=key,
                shape=shape, store_type=self.store_type)

    def validate_init(self, keys: list[Key], groups: list[list[Any]]) -> None:
        """New keys of the store's kind, one value each."""
        self.check_kind(keys)
        for k, vals in zip(keys, groups):
            if k in self.records or len(vals) != 1:
                raise KeyAlreadyInitializedError(
                    f"key {k!r} is initialized twice. Each key takes one init (or broadcast); "
                    "push to change its value.", key=k, store_type=self.store_type)

    def validate_push(self, keys: list[Key], groups: list[list[Any]],
                      compressing: bool) -> None:
        """Initialized keys, values of their shape; dense values when ``compressing``."""
        self.check_kind(keys)
        for k, vals in zip(keys, groups):
            rec = self.get(k, "push to")
            for v in vals:
                self.check_array(k, v, rec, "push to")
                if compressing and isinstance(v, RowSparseNDArray):
                    raise UnsupportedError(
                        f"push to key {k!r}: gradient compression works on dense arrays only, "
                        "got a row_sparse array. Push it dense, or create a store without "
                        "compression.", key=k, store_type=self.store_type)

    def validate_pull(self, keys: list[Key], groups: list[list[Any]]) -> None:
        """Initialized keys, writable outs of their shape."""
        self.check_kind(keys)
        for k, outs in zip(keys, groups):
            rec = self.get(k, "pull")
            for o in outs:
                self.check_array(k, o, rec, "pull", into=True)
                if isinstance(o, np.ndarray) and not o.flags.writeable:
                    raise ValueTypeError(f"pull key {k!r}: the out array is read-only. Pass "
                                         "a writable array.", key=k,
                                         store_type=self.store_type)

    def validate_broadcast(self, key: Any, keys: list[Key], groups: list[list[Any]],
                           okeys: list[Key], ogroups: list[list[Any]]) -> None:
        """An init of ``keys`` whose values fit the outs."""
        self.validate_init(keys, groups)
        if okeys != keys:
            raise ShapeMismatchError(f"broadcast got keys {okeys!r} for out but "
                                     f"{keys!r} for value. Pass the same keys.", key=key)
        for k, vals, outs in zip(keys, groups, ogroups):
            ref = vals[0] if isinstance(vals[0], NDArray) else as_numpy(vals[0])
            for o in outs:
                self.check_array(k, o, ref, "broadcast", into=True)

    def pull_new_keys(self, key: Any) -> tuple[bool, list[KeyRecord]]:
        """For ``pull(key)`` with ``out=None``: whether ``key`` is a list, and the records."""
        many = isinstance(key, (list, tuple))
        ks = [check_key(k) for k in (key if many else [key])]
        self.check_kind(ks)
        return many, [self.get(k, "pull") for k in ks]

    def validate_row_sparse_pull(self, key: Any, out: Any, row_ids: Any, keys: list[Key],
                                 groups: list[list[Any]],
                                 rows: dict[Key, list[np.ndarray]]) -> None:
        """row_sparse keys, row_sparse outs of their shape, row ids in range."""
        self.check_kind(keys)
        for k, outs in zip(keys, groups):
            rec = self.get(k, "row_sparse_pull")
            if not rec.sparse:
                raise UnsupportedError(
                    f"row_sparse_pull of key {k!r}: the key holds a dense array of shape "
                    f"{rec.shape}. Init it with a row_sparse value, or use pull().",
                    key=k, shape=rec.shape, store_type=self.store_type)
            for o, r in zip(outs, rows[k]):
                if not isinstance(o, RowSparseNDArray):
                    raise ValueTypeError(
                        f"row_sparse_pull of key {k!r} needs row_sparse outs, got a "
                        f"{type(o).__name__}. Create them with mx.nd.sparse.zeros("
                        f"'row_sparse', {rec.shape}).", key=k, store_type=self.store_type)
                self.check_array(k, o, rec, "row_sparse_pull", into=True)
                if r.size and (r[0] < 0 or r[-1] >= rec.shape[0]):
                    raise ShapeMismatchError(
                        f"row_sparse_pull of key {k!r}: row ids must lie in [0, "
                        f"{rec.shape[0]}), got {r[0] if r[0] < 0 else r[-1]}.",
                        key=k, shape=rec.shape, store_type=self.store_type)

    @staticmethod
    def need_rows(key: Any, out: Any, row_ids: Any) -> None:
        """row_sparse_pull was given both ``out`` and ``row_ids``."""
        if out is None or row_ids is None:
            raise ValueTypeError("row_sparse_pull needs both out= and row_ids=. Pass a "
                                 "row_sparse out and the rows to pull.", key=key)

    def warn_sparse(self, key: Key) -> None:
        """Warn once per key that a plain pull skipped a row_sparse out (as MXNet does)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"pull of key {key!r} into a row_sparse out was ignored, as MXNet does. "
                "Use kv.row_sparse_pull(key, out, row_ids=...) for row_sparse arrays.",
                SparsePullIgnoredWarning, stacklevel=4)
