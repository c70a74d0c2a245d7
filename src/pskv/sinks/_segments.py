"""The files of a :class:`~pskv.sinks.FileSink` directory: segments (``.npz``) and the
manifest (``manifest.json``), written durably, read back with every check (F1-F8 in
:mod:`pskv.sinks`). No sockets, no threads.

A segment holds a list of change batches: per batch ``shard``, ``num_shards``,
``version``, ``reset``, ``complete``, ``lineage``, ``n_ids``, ``n_removed``; the batches'
``ids``, ``rows``, ``removed`` and ``reasons`` concatenated in batch order.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import CheckpointError
from ..table import ChangeBatch

__all__ = ["FORMAT", "MANIFEST", "decode", "encode", "fsync_dir", "load_segment",
           "manifest_text", "read_manifest", "row_dtype_name", "write_durably"]

#: the ``format`` of a manifest and of each segment this module writes
FORMAT = "pskv-sink/1"
MANIFEST = "manifest.json"
#: what every manifest holds
_FIELDS = ("format", "key", "dim", "dtype", "row_dtype", "raw", "num_shards", "segments",
           "position", "next")
_ARRAYS = ("format", "kind", "shard", "num_shards", "version", "reset", "complete",
           "lineage", "n_ids", "n_removed", "ids", "rows", "removed", "reasons")


def row_dtype_name(dtype: np.dtype, raw: bool) -> str:
    """What a reader calls the rows' dtype: float32 (widened), or the storage dtype when
    ``raw`` (bfloat16 rows are its bits as uint16: R17)."""
    if raw and dtype == np.uint16:
        return "bfloat16"
    return str(dtype)


def encode(batches: Sequence[ChangeBatch], kind: str, dim: int,
           dtype: np.dtype) -> dict[str, np.ndarray]:
    """The arrays of one segment holding ``batches`` (``kind``: "full" or "delta")."""
    little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    n = len(batches)
    lineages = [b.lineage for b in batches]
    return {
        "format": np.array(FORMAT), "kind": np.array(kind),
        "shard": np.array([b.shard for b in batches], np.int64).reshape(n),
        "num_shards": np.array([b.num_shards for b in batches], np.int64).reshape(n),
        "version": np.array([b.version for b in batches], np.int64).reshape(n),
        "reset": np.array([b.reset for b in batches], bool).reshape(n),
        "complete": np.array([b.complete for b in batches], bool).reshape(n),
        "lineage": np.array(lineages, dtype=f"<U{max(map(len, lineages), default=1)}"),
        "n_ids": np.array([b.ids.size for b in batches], np.int64).reshape(n),
        "n_removed": np.array([b.removed.size for b in batches], np.int64).reshape(n),
        "ids": np.concatenate([np.asarray(b.ids, "<i8") for b in batches]) if n
        else np.empty(0, "<i8"),
        "rows": np.concatenate([np.asarray(b.rows, little) for b in batches]) if n
        else np.empty((0, dim), little),
        "removed": np.concatenate([np.asarray(b.removed, "<i8") for b in batches]) if n
        else np.empty(0, "<i8"),
        "reasons": np.concatenate([np.asarray(b.reasons, np.uint8) for b in batches]) if n
        else np.empty(0, np.uint8),
    }


def decode(arrays: Any, key: Any, dim: int, dtype: np.dtype,
           where: str) -> tuple[str, list[ChangeBatch]]:
    """``(kind, batches)`` of a segment's arrays; CheckpointError if they do not add up."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"segment {where} is damaged: {why}. Replay cannot go on; "
                               "delete the sink's directory and let the sink write a new "
                               "full snapshot.", key=key)
    missing = [a for a in _ARRAYS if a not in arrays]
    if missing:
        raise bad(f"it has no {', '.join(missing)}")
    if str(arrays["format"]) != FORMAT:
        raise bad(f"its format is {str(arrays['format'])!r}, not {FORMAT!r}")
    kind = str(arrays["kind"])
    per = [np.asarray(arrays[a]) for a in ("shard", "num_shards", "version", "reset",
                                           "complete", "lineage", "n_ids", "n_removed")]
    n = per[0].size
    if kind not in ("full", "delta") or any(a.shape != (n,) for a in per):
        raise bad(f"kind {kind!r}, or per-batch arrays of different lengths")
    ids, rows = np.asarray(arrays["ids"]), np.asarray(arrays["rows"])
    removed, reasons = np.asarray(arrays["removed"]), np.asarray(arrays["reasons"])
    n_ids, n_removed = per[6].astype(np.int64), per[7].astype(np.int64)
    if (ids.shape != (int(n_ids.sum()),) or rows.shape != (ids.size, dim)
            or removed.shape != (int(n_removed.sum()),) or reasons.shape != removed.shape
            or (n_ids < 0).any() or (n_removed < 0).any()):
        raise bad(f"{ids.size} ids, rows of shape {rows.shape} and {removed.size} removed "
                  f"IDs do not match its {n} batches of dim {dim}")
    if rows.dtype != dtype.newbyteorder("<") and rows.dtype != dtype:
        raise bad(f"its rows are {rows.dtype}, the manifest says {dtype}")
    ids, removed = ids.astype(np.int64), removed.astype(np.int64)
    rows = rows.astype(dtype, copy=False)
    out, i, r = [], 0, 0
    for b in range(n):
        ni, nr = int(n_ids[b]), int(n_removed[b])
        out.append(ChangeBatch(
            key=key, shard=int(per[0][b]), num_shards=int(per[1][b]), lineage=str(per[5][b]),
            version=int(per[2][b]), reset=bool(per[3][b]), removed=removed[r:r + nr],
            ids=ids[i:i + ni], rows=rows[i:i + ni], reasons=reasons[r:r + nr],
            cursor=None if per[4][b] else -1))
        i, r = i + ni, r + nr
    return kind, out


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where a folder cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, write: Any, fsync: bool = True) -> tuple[int, str]:
    """Write ``path`` through ``write(file)`` into a temporary file, fsync it and rename it
    into place (a reader sees the old file or the whole new one). Returns its size and
    sha256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
    return path.stat().st_size, _sha256(path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory`` (None when it has none); CheckpointError if damaged."""
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is damaged: {why}. Delete the directory to let the "
                               "sink start again with a full snapshot, or restore it.")
    try:
        man = json.loads(text)
    except ValueError as err:
        raise bad(f"not JSON ({err})") from err
    if not isinstance(man, dict) or any(f not in man for f in _FIELDS):
        raise bad(f"it lacks one of {', '.join(_FIELDS)}")
    if man["format"] != FORMAT:
        raise bad(f"its format is {man['format']!r}, not {FORMAT!r}")
    segs = man["segments"]
    try:
        ok = (isinstance(segs, list) and bool(segs) and segs[0]["kind"] == "full"
              and all(s["kind"] == "delta" for s in segs[1:])
              and all(isinstance(s["file"], str) and "/" not in s["file"]
                      and "\\" not in s["file"] and isinstance(s["bytes"], int)
                      and isinstance(s["sha256"], str) and isinstance(s["position"], dict)
                      for s in segs)
              and isinstance(man["dim"], int) and man["dim"] >= 1
              and isinstance(man["num_shards"], int) and man["num_shards"] >= 1)
        np.dtype(man["row_dtype"])
    except (KeyError, TypeError, IndexError) as err:
        raise bad(f"a segment entry is malformed ({err!r})") from err
    if not ok:
        raise bad("its segments are not one full snapshot followed by deltas, each with "
                  "file, bytes, sha256 and position")
    return man


def load_segment(directory: Path, entry: dict[str, Any], key: Any, dim: int,
                 dtype: np.dtype) -> tuple[str, list[ChangeBatch]]:
    """The batches of the segment ``entry`` names, checked against its size and sha256
    (FileNotFoundError passes through: a rotation removed it meanwhile)."""
    path = directory / entry["file"]
    size = path.stat().st_size
    where = str(path)
    if size != entry["bytes"] or _sha256(path) != entry["sha256"]:
        raise CheckpointError(
            f"segment {where} is damaged: its size or sha256 is not the one the manifest "
            f"recorded ({size} bytes, manifest: {entry['bytes']}). Delete the directory and "
            "let the sink write a new full snapshot.", key=key)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            got = {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"segment {where} is damaged: {err}. Delete the directory and "
                              "let the sink write a new full snapshot.", key=key) from err
    return decode(got, key, dim, dtype, where)


def manifest_text(man: dict[str, Any]) -> bytes:
    """The manifest as written (JSON, keys in a fixed order)."""
    return (json.dumps(man, indent=1) + "\n").encode()
