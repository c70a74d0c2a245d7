"""What one admitted request may make a server hold or send, checked before it allocates.

A message's own bytes are capped by the transport (``PSKV_MAX_MESSAGE_BYTES``); what a few
bytes of header may *imply* is capped here: the whole key an INIT declares (its placement's
shape, with a row id per row of a row_sparse key, which the server materializes), the keys
one request names, and the reply a pull asks for (row ids that repeat one wide row). Every
size is computed with Python integers from the header, never by allocating, and compared
with the job's limits (:class:`.config.ClusterConfig`: ``max_key_bytes``,
``max_keys_per_message``, ``max_reply_bytes``). A refusal is a :class:`LimitError` naming the
limit and the setting to raise; a placement that does not describe the part it came with is
a :class:`ShapeMismatchError`. Invariant: the checks change nothing.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import LimitError, ShapeMismatchError, ValueTypeError
from .config import ENV_MAX_KEY_BYTES, ENV_MAX_KEYS_PER_MESSAGE, ENV_MAX_REPLY_BYTES
from .message import ALLOWED_DTYPES

__all__ = ["ROW_ID_BYTES", "Place", "check_declared", "check_init", "check_key_count",
           "check_lookup_reply", "check_reply", "check_rows",
           "key_bytes", "placement"]

#: bytes a server keeps per row of a row_sparse key (its int64 row id)
ROW_ID_BYTES = 8
_MAX_NDIM = 32

#: ``(start, stop, shape)``: units ``[start, stop)`` of a key of ``shape`` (elements of a
#: dense key, rows of a row_sparse one)
Place = tuple[int, int, tuple[int, ...]]


def _size(n: int) -> str:
    """``n`` bytes for people."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def key_bytes(shape: Sequence[int], itemsize: int, sparse: bool) -> int:
    """Bytes a key of ``shape`` costs a server that holds all of it (exact, no overflow)."""
    total = math.prod(shape) * itemsize
    if sparse and shape:
        total += shape[0] * ROW_ID_BYTES
    return total


def _units(shape: Sequence[int], sparse: bool) -> int:
    return (shape[0] if shape else 0) if sparse else math.prod(shape)


def _shape(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or len(value) > _MAX_NDIM or not all(
            type(d) is int and d >= 0 for d in value):
        return None
    return tuple(value)


def placement(key: Any, part: np.ndarray, sparse: bool, place: Any) -> Place | None:
    """The checked placement of ``part`` (an INIT's array for ``key``); None if it names
    none. ShapeMismatchError unless ``place`` is ``[start, stop, shape]`` with the part's
    units exactly ``[start, stop)`` of a key of that shape."""
    if place is None:
        return None
    full = _shape(place[2]) if isinstance(place, list) and len(place) == 3 else None
    start, stop = (place[0], place[1]) if full is not None else (None, None)
    if full is None or type(start) is not int or type(stop) is not int:
        raise ShapeMismatchError(f"INIT of key {key!r}: placement {str(place)[:200]} is not "
                                 "[start, stop, shape]", key=key)
    units = _units(full, sparse)
    have = _units(part.shape, sparse)
    fits = 0 <= start <= stop <= units and stop - start == have
    if sparse:
        fits = fits and part.shape[1:] == full[1:]
    elif fits and (start, stop) == (0, units):
        fits = part.shape == full or part.ndim == 1
    elif fits:
        fits = part.ndim == 1
    if not fits:
        raise ShapeMismatchError(
            f"INIT of key {key!r}: a part of shape {part.shape} is not units [{start}, "
            f"{stop}) of a key of shape {full}", key=key, shape=part.shape)
    return start, stop, full


def _over(what: str, got: int, limit: int, env: str, where: str, key: Any = None) -> LimitError:
    return LimitError(f"{what} is {_size(got)}, over the limit of {_size(limit)} on {where} "
                      f"({env}={limit}). Raise {env} on every node if this is meant.", key=key)


def check_declared(key: Any, shape: tuple[int, ...], itemsize: int, sparse: bool,
                   max_key_bytes: int, where: str) -> None:
    """LimitError if a key of ``shape`` costs more than ``max_key_bytes`` bytes."""
    got = key_bytes(shape, itemsize, sparse)
    if got > max_key_bytes:
        raise _over(f"key {key!r} of shape {shape}"
                    f"{' (row_sparse, with its row ids)' if sparse else ''}",
                    got, max_key_bytes, ENV_MAX_KEY_BYTES, where, key)


def check_init(entries: Sequence[dict[str, Any]], arrays: Sequence[np.ndarray],
               max_key_bytes: int, where: str) -> list[Place | None]:
    """Every INIT entry's placement, checked, and the whole key each declares against
    ``max_key_bytes``; LimitError or ShapeMismatchError on the first that is wrong."""
    places = []
    for spec, part in zip(entries, arrays, strict=True):
        key, sparse = spec.get("key"), spec.get("stype") == "row_sparse"
        if part.dtype.name not in ALLOWED_DTYPES:     # an ID dtype the wire carries
            raise ValueTypeError(f"INIT of key {key!r}: dtype {part.dtype} is not a key's "
                                 f"dtype; keys hold {', '.join(sorted(ALLOWED_DTYPES))}.",
                                 key=key)
        if sparse and part.ndim == 0:
            raise ShapeMismatchError(f"INIT of row_sparse key {key!r}: a 0-d value has no "
                                     "rows", key=key)
        place = placement(key, part, sparse, spec.get("place"))
        full = part.shape if place is None else place[2]
        for shape in (part.shape, full):
            check_declared(key, shape, part.dtype.itemsize, sparse, max_key_bytes, where)
        places.append(place)
    return places


def check_key_count(count: int, limit: int, what: str, where: str) -> None:
    """LimitError if one request of ``what`` names more than ``limit`` keys."""
    if count > limit:
        raise LimitError(f"a {what} names {count} keys, over the limit of {limit} keys per "
                         f"message on {where} ({ENV_MAX_KEYS_PER_MESSAGE}={limit}). Split the "
                         f"call, or raise {ENV_MAX_KEYS_PER_MESSAGE} on every node.")


def check_rows(key: Any, rows: np.ndarray, n: int) -> None:
    """ShapeMismatchError unless ``rows`` (a row_sparse pull's row ids of ``key``, which has
    ``n`` rows) are integers, sorted, unique and in ``[0, n)``, as ``kv.row_sparse_pull``
    sends them: the reply then holds each row at most once, no more than the key itself,
    whatever the request's size or dtype (4 KiB of repeated uint8 ids asked for 1 GiB).
    One vectorized pass, no copy of the ids."""
    if rows.dtype.kind not in "iu":
        raise ShapeMismatchError(f"row_sparse_pull of key {key!r}: row ids of dtype "
                                 f"{rows.dtype}; send integers.", key=key)
    if rows.size > n:
        raise ShapeMismatchError(
            f"row_sparse_pull of key {key!r} asks for {rows.size} rows of a key of {n} rows: "
            "row ids are unique. Send np.unique(row_ids).", key=key, shape=rows.shape)
    if not rows.size:
        return
    if int(rows[0]) < 0 or int(rows[-1]) >= n or (
            rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1]))):
        raise ShapeMismatchError(
            f"row_sparse_pull of key {key!r}: row ids must be sorted, unique and in [0, {n}) "
            "(each row is answered once). Send np.unique(row_ids) of rows the key has.",
            key=key, shape=rows.shape)


def check_lookup_reply(key: Any, ids: int, row: int, limit: int, where: str) -> None:
    """LimitError if a table lookup of ``ids`` IDs (rows of ``row`` bytes, and a found
    flag each) would answer with more than ``limit`` bytes; checked before any row is
    read or made."""
    got = ids * (row + 1)
    if got > limit:
        raise _over(f"the reply to this lookup of table {key!r} ({ids} IDs of {row} bytes)",
                    got, limit, ENV_MAX_REPLY_BYTES, where, key)


def check_reply(stored: Sequence[np.ndarray], rows: Sequence[np.ndarray] | None,
                limit: int, where: str) -> None:
    """LimitError if a pull of ``stored`` (only ``rows[i]`` of each, if given) would
    answer with more than ``limit`` bytes (row ids count too: the server copies them)."""
    total = 0
    for i, value in enumerate(stored):
        if rows is None:
            total += value.nbytes
        else:
            row = value.nbytes // value.shape[0] if value.ndim and value.shape[0] else 0
            total += int(rows[i].size) * (row + ROW_ID_BYTES)
    if total > limit:
        what = "the rows asked for" if rows is not None else "the values asked for"
        raise _over(f"the reply to this pull ({what})", total, limit, ENV_MAX_REPLY_BYTES,
                    where)
