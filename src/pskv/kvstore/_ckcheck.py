"""Checks of a checkpoint read back: it is untrusted input, like a message.

A checkpoint directory may come from anywhere (a worker names it; a damaged disk; someone
with write access to the shared file system), so :class:`._snapshot.Reader` trusts nothing
in it: the manifest is read bounded and names a bounded number of shards; each shard is a
regular ``.npz`` whose members are checked before they are read (``nd._npz``); every entry
of a shard's ``__meta__`` is checked here (types, ranges, a dtype pskv sends, a whole key
within ``PSKV_MAX_KEY_BYTES``, its array's declared shape and dtype matching its part)
before anything is allocated from it. Every failure is a CheckpointError naming the
checkpoint and what is wrong.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import numpy as np

from ..errors import CheckpointError, KVStoreError
from ..nd._npz import BadArchive, SafeNpz
from .._ps.bounds import key_bytes
from .._ps.config import ENV_MAX_KEY_BYTES
from .._ps.message import ALLOWED_DTYPES

__all__ = ["FORMAT", "MANIFEST_BYTES", "MAX_SHARDS", "VERSION", "check_entry", "check_manifest",
           "guarded"]

#: the format tag and version of a checkpoint (manifest and shards)
FORMAT = "pskv.checkpoint"
VERSION = 1

#: the most bytes a manifest may hold (pskv writes about 150)
MANIFEST_BYTES = 1 << 16
#: the most shards a manifest may name (one per server)
MAX_SHARDS = 1 << 16
_MAX_KEY_STR = 4096
_MAX_NDIM = 32


def _damaged(directory: str, why: str, key: Any = None) -> CheckpointError:
    return CheckpointError(f"checkpoint {directory!r} is damaged or not pskv's: {why}. Load "
                           "another checkpoint.", key=key)


@contextlib.contextmanager
def guarded(directory: str) -> Iterator[None]:
    """Turn any error reading ``directory`` into a CheckpointError (never a bare ValueError)."""
    try:
        yield
    except CheckpointError:
        raise
    except BadArchive as err:
        raise _damaged(directory, str(err)) from err
    except (KVStoreError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, EOFError, OSError) as err:
        raise _damaged(directory, f"{type(err).__name__}: {err}") from err


def check_manifest(body: Any, path: str) -> dict[str, Any]:
    """The manifest ``body`` of ``path``, checked: a format this pskv reads, 1 to
    MAX_SHARDS shards, a round that is an integer or null."""
    if not isinstance(body, dict) or body.get("format") != FORMAT \
            or body.get("version") != VERSION or type(body.get("num_shards")) is not int \
            or not 1 <= body["num_shards"] <= MAX_SHARDS:
        raise CheckpointError(f"{path!r} is not a manifest of pskv checkpoint version "
                              f"{VERSION} (1 to {MAX_SHARDS} shards). Pass a directory "
                              "kv.save_checkpoint wrote.")
    rnd = body.get("round")
    if rnd is not None and (type(rnd) is not int or rnd < 0):
        raise CheckpointError(f"{path!r}: round {str(rnd)[:50]} is not a round number. The "
                              "checkpoint is damaged.")
    return body


def _is_key(value: Any) -> bool:
    return type(value) is int or (isinstance(value, str) and len(value) <= _MAX_KEY_STR)


def _units(shape: tuple[int, ...], sparse: bool) -> int:
    return (shape[0] if shape else 0) if sparse else math.prod(shape)


def check_entry(entry: Any, index: int, npz: SafeNpz, directory: str,
                max_key_bytes: int) -> None:
    """CheckpointError unless ``entry`` (item ``index`` of a shard's ``__meta__``) is a
    well-formed part whose array ``w<index>`` in ``npz`` declares the part's shape."""
    if not isinstance(entry, dict):
        raise _damaged(directory, f"entry {index} is not an object")
    key = entry.get("key")
    if not _is_key(key) or not _is_key(entry.get("id", key)):
        raise _damaged(directory, f"entry {index} has no int or short str key")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(
            type(d) is int and d >= 0 for d in shape):
        raise _damaged(directory, f"key {key!r} has no shape", key)
    shape_t = tuple(shape)
    dtype, stype = entry.get("dtype"), entry.get("stype", "default")
    if stype == "table":
        _check_table_entry(entry, index, npz, directory, max_key_bytes)
        return
    if dtype not in ALLOWED_DTYPES or stype not in ("default", "row_sparse"):
        raise _damaged(directory, f"key {key!r}: dtype {str(dtype)[:40]} / stype "
                       f"{str(stype)[:40]} is not one pskv stores", key)
    sparse = stype == "row_sparse"
    if sparse and not shape_t:
        raise _damaged(directory, f"row_sparse key {key!r} has no rows", key)
    need = key_bytes(shape_t, np.dtype(dtype).itemsize, sparse)
    if need > max_key_bytes:
        raise CheckpointError(
            f"checkpoint {directory!r}: key {key!r} of shape {shape_t} {dtype} is {need} "
            f"bytes, over {ENV_MAX_KEY_BYTES}={max_key_bytes}. Raise {ENV_MAX_KEY_BYTES} if "
            "the checkpoint is yours and the key is meant to be this large.", key=key)
    start, stop = entry.get("start"), entry.get("stop")
    if type(start) is not int or type(stop) is not int or \
            not 0 <= start <= stop <= _units(shape_t, sparse):
        raise _damaged(directory, f"key {key!r}: part [{str(start)[:30]}, {str(stop)[:30]}) "
                       f"is not within its shape {shape_t}", key)
    rnd, applied = entry.get("round", 0), entry.get("applied") or []
    if type(rnd) is not int or rnd < 0 or not isinstance(applied, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
            for p in applied):
        raise _damaged(directory, f"key {key!r}: its round or push counts are not integers",
                       key)
    name = f"w{index}"
    if name not in npz:
        raise _damaged(directory, f"key {key!r}: array {name} is missing", key)
    got, got_dtype = npz.shape_of(name)
    n = stop - start
    wants = [(n,) + shape_t[1:]] if sparse else [(n,)] + (
        [shape_t] if (start, stop) == (0, _units(shape_t, sparse)) else [])
    if got not in wants or got_dtype != np.dtype(dtype):
        raise _damaged(directory, f"key {key!r}: its part is {got} {got_dtype}, not "
                       f"{wants[-1]} {dtype}", key)


def _check_table_entry(entry: dict[str, Any], index: int, npz: SafeNpz, directory: str,
                       max_key_bytes: int) -> None:
    """A table shard's entry (docs/embeddings.md, D7): a spec, a shard ``[i, n]`` and its
    rows by ID as arrays ``w<index>.<field>``, whose declared sizes stay under
    ``max_key_bytes`` in all. Their contents are checked by ``DynamicTable.from_state``."""
    key = entry.get("key")
    shard = entry.get("shard")
    if not isinstance(entry.get("spec"), (dict, str)) or not isinstance(shard, list) or \
            len(shard) != 2 or not all(type(x) is int for x in shard) or \
            not 0 <= shard[0] < shard[1]:
        raise _damaged(directory, f"table {key!r} has no spec or shard", key)
    prefix = f"w{index}."
    fields = [name for name in npz.files if name.startswith(prefix)]
    if prefix + "ids" not in fields:
        raise _damaged(directory, f"table {key!r}: its IDs (array {prefix}ids) are missing",
                       key)
    total = 0
    for name in fields:
        shape, dtype = npz.shape_of(name)
        total += math.prod(shape) * dtype.itemsize
    if total > max_key_bytes:
        raise CheckpointError(
            f"checkpoint {directory!r}: table {key!r} declares {total} bytes of rows, over "
            f"{ENV_MAX_KEY_BYTES}={max_key_bytes}. Raise {ENV_MAX_KEY_BYTES} if the "
            "checkpoint is yours and the table is meant to be this large.", key=key)
