"""Normalize the (key, value|out) arguments of every KVStore call.

``normalize(key, value)`` returns ``(keys, groups)``: unique keys in order of first
appearance and, for each, the list of arrays given for it (duplicate keys in one list are
merged into one group, as MXNet's GroupKVPairs does). Nothing here touches a store.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import DeviceError, KeyTypeError, ShapeMismatchError, UnsupportedError, ValueTypeError
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from ..table import TableSpec
from ._device_io import device_of, read_ids, to_device

__all__ = ["as_numpy", "check_key", "dtype_hint", "is_array", "normalize", "tensor_maker"]


def is_array(obj: Any) -> bool:
    """True for a pskv NDArray, a NumPy array, or any DLPack / array-interface array."""
    return isinstance(obj, (NDArray, np.ndarray)) or (
        not isinstance(obj, (list, tuple, str, bytes, dict)) and obj is not None
        and (hasattr(obj, "__dlpack__") or hasattr(obj, "__array_interface__")))


def as_numpy(obj: Any) -> np.ndarray:
    """The NumPy array behind ``obj``, without a copy where the producer allows.

    A dense NDArray gives its buffer; a torch tensor or other DLPack array gives a view of
    its memory (the caller's memory: never keep it, copy what must be kept).
    """
    if isinstance(obj, NDArray):
        return obj._dense()
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        if getattr(obj, "requires_grad", False):  # torch leaf parameters
            obj = obj.detach()
        try:
            return np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError) as err:
            _check_host(obj)
            try:
                return np.asarray(obj)
            except (TypeError, ValueError, RuntimeError):
                raise ValueTypeError(
                    f"cannot read a {type(obj).__name__} of dtype {getattr(obj, 'dtype', '?')} "
                    f"as a NumPy array ({err}). Convert it first, e.g. tensor.float().") from err
    return np.asarray(obj)


def _check_host(obj: Any) -> None:
    """Raise DeviceError for an array in device memory that reached a host-only argument
    (a table key's IDs or rows; a meta tensor anywhere)."""
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", device)
    dev = device_of(obj)
    if dev is not None:
        device, kind = f"{'cuda' if dev[0] == 2 else f'device type {dev[0]}'}:{dev[1]}", ""
    if isinstance(kind, str) and kind != "cpu":
        raise DeviceError(
            f"got a {type(obj).__name__} on device {device!s} where pskv reads host memory "
            "only (docs/gpu.md lists the arguments that take CUDA arrays). Pass a CPU array "
            "here (tensor.cpu()).", device=str(device))


def tensor_maker(value: Any) -> Callable[[np.ndarray], Any] | None:
    """``torch.from_numpy`` if ``value`` is a torch tensor, else None.

    A key initialized with a torch tensor keeps it as the prototype of what
    ``pull(key)`` (``out=None``) returns: a tensor sharing the new NumPy array's memory
    (for a CUDA tensor, a new tensor on its device).
    """
    if type(value).__module__.partition(".")[0] != "torch":
        return None
    import torch  # already imported: value is one of its tensors
    if value.is_cuda:        # a new tensor on the init value's device
        return to_device(value.device)
    return torch.from_numpy


def check_key(key: Any) -> int | str:
    """Return ``key`` as int or str, or raise KeyTypeError."""
    if type(key) is int or type(key) is str:
        return key
    if isinstance(key, bool) or not isinstance(key, (int, str, np.integer)):
        raise KeyTypeError(
            f"key {key!r} has type {type(key).__name__}; keys must be int or str (or a list "
            "of them). Use e.g. kv.init(3, value) or kv.init('w0', value).", key=key)
    return int(key) if isinstance(key, (int, np.integer)) else str(key)


def _check_value(key: Any, value: Any, what: str) -> None:
    if isinstance(value, TableSpec):
        raise UnsupportedError(
            f"key {key!r}: a TableSpec declares a table key, one per init call. Call "
            f"kv.init({key!r}, spec) for each table key.", key=key)
    if not is_array(value):
        got = "None" if value is None else f"a {type(value).__name__}"
        raise ValueTypeError(
            f"the {what} for key {key!r} is {got}, not an array. Pass an NDArray or NumPy "
            "array, or a list of them (one per device).", key=key)


def _values_for_key(key: Any, value: Any, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueTypeError(f"{what} for key {key!r} got an empty list. Pass at least "
                                 "one array.", key=key)
        for v in value:
            _check_value(key, v, what)
        return list(value)
    _check_value(key, value, what)
    return [value]


def normalize(key: Any, value: Any, what: str = "value") -> tuple[list[int | str], list[list[Any]]]:
    """Split ``(key, value)`` into unique keys and the arrays given for each.

    Parameters
    ----------
    key : int, str, or list of them
    value : array, list of arrays, or (for a key list) a list of arrays / lists of arrays
    what : str
        The argument's name, for error messages (``'value'`` or ``'out'``).

    Returns
    -------
    keys : list of int or str
        Unique, in order of first appearance.
    groups : list of list
        The arrays for each key, in the order given.
    """
    if not isinstance(key, (list, tuple)):
        k = check_key(key)
        return [k], [_values_for_key(k, value, what)]
    if not isinstance(value, (list, tuple)):
        if len(key) == 1:  # kv.pull(["3"], a) as the Clojure docs write
            value = [value]
        else:
            raise ValueTypeError(
                f"{len(key)} keys {list(key)!r} need a list of {len(key)} {what}s, got "
                f"{type(value).__name__}. Pass one array (or list of arrays) per key.")
    if len(key) != len(value):
        raise ShapeMismatchError(
            f"{len(key)} keys but {len(value)} {what}s: keys {list(key)!r}. Pass one array "
            "(or one list of arrays) per key.", key=list(key))
    keys: list[int | str] = []
    groups: list[list[Any]] = []
    where: dict[int | str, int] = {}
    kind: type | None = None
    for raw, val in zip(key, value):
        k = raw if type(raw) is int or type(raw) is str else check_key(raw)
        if kind is None:
            kind = type(k)
        elif type(k) is not kind:
            raise KeyTypeError(
                f"keys {list(key)!r} mix int and str. Use one kind of key per store.", key=k)
        tv = type(val)
        vals = [val] if tv is NDArray or tv is np.ndarray else _values_for_key(k, val, what)
        i = where.get(k)
        if i is None:
            where[k] = len(keys)
            keys.append(k)
            groups.append(vals)
        else:
            groups[i].extend(vals)
    return keys, groups


def dense_data(value: Any) -> np.ndarray | None:
    """The buffer of a dense NDArray or NumPy array; None for anything else."""
    if type(value) is np.ndarray:
        return value
    if isinstance(value, NDArray) and type(value) is not RowSparseNDArray:
        return value._data
    return None


def row_ids_by_key(key: Any, keys: list[int | str], groups: list[list[Any]],
                   row_ids: Any) -> dict[int | str, list[np.ndarray]]:
    """The row ids of a row_sparse_pull, per key and out: unique, sorted, int64.

    ``row_ids`` is one array for every out, or one per out (as the outs are given).
    """
    def clean(r: Any) -> np.ndarray:
        arr = as_numpy(r) if device_of(r) is None else read_ids(key, r)
        if arr.dtype.kind not in "iuf" and arr.size:
            raise ValueTypeError(f"row_sparse_pull of key {key!r}: row_ids of dtype "
                                 f"{arr.dtype} are not numbers. Pass integer row numbers.",
                                 key=key)
        return np.unique(arr.astype(np.int64).ravel())

    total = sum(len(g) for g in groups)
    if not isinstance(row_ids, (list, tuple)):
        row_ids = [row_ids]
    if len(row_ids) == 1:
        one = clean(row_ids[0])
        return {k: [one] * len(g) for k, g in zip(keys, groups)}
    rkeys, rgroups = normalize(key, list(row_ids) if not isinstance(key, (list, tuple))
                               else row_ids, "row_ids")
    if sum(len(g) for g in rgroups) != total or rkeys != keys:
        raise ShapeMismatchError(
            f"row_sparse_pull of key {key!r} got {len(row_ids)} row_ids for {total} "
            "outs. Pass one row_ids per out, or one for all.", key=key)
    return {k: [clean(r) for r in g] for k, g in zip(rkeys, rgroups)}


def dtype_hint(value: Any, stored: Any, into: bool) -> str:
    """The fix for a dtype mismatch between ``value`` and a key holding dtype ``stored``
    (a NumPy dtype); ``into``: ``value`` is a pull's out. Worded for torch tensors, which
    have ``.to(dtype)`` and no ``.astype``, and for NumPy-like arrays.

    >>> import numpy as np
    >>> dtype_hint(np.zeros(2, np.int64), np.dtype("float32"), into=False)
    "Convert with .astype('float32')."
    >>> dtype_hint(np.zeros(2, np.int32), np.dtype("float32"), into=True)
    "Pull into a float32 array of the same shape (e.g. buf = np.empty(out.shape, dtype='float32')), then copy it over with out[:] = buf, which converts to int32."
    """
    name = str(stored)
    if type(value).__module__.partition(".")[0] != "torch":   # no torch import
        if into:    # .astype would copy: the out the user holds would stay unfilled
            return (f"Pull into a {name} array of the same shape (e.g. buf = "
                    f"np.empty(out.shape, dtype={name!r})), then copy it over with "
                    f"out[:] = buf, which converts to {value.dtype}.")
        return f"Convert with .astype({name!r})."
    if into:
        return (f"Pull into a torch.{name} tensor (e.g. buf = torch.empty_like(out, "
                f"dtype=torch.{name})), then copy it over with out.copy_(buf), which "
                f"converts to {value.dtype}.")
    return f"Convert it with .to(torch.{name})."
