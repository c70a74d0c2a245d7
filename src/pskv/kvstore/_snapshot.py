"""Checkpoints of an engine's shard: copied in memory, written as NumPy + JSON, read back.

A checkpoint is a directory::

    manifest.json       {"format": "pskv.checkpoint", "version": 1, "num_shards": S,
                         "round": R or null, "store_type": ...}
    shard-00000.npz     one per server (one for a local store): np.savez, no pickle:
                        w0, w1, ... the stored parts; __states__ (optimizer states, the
                        Updater's own archive, as bytes); __meta__ (UTF-8 JSON, below)

``__meta__`` lists one entry per stored part: ``{"key", "shape" (the whole key's), "dtype",
"stype", "start", "stop" (elements of the flat key, rows for row_sparse), "round", "applied"
(per worker: pushes included)}`` plus the
optimizer spec and the compression params. A table key's shard (docs/embeddings.md) is an
entry of ``"stype": "table"`` with its ``spec``, its ``shard`` ``[i, n]`` and its state's
metadata (``table``); its rows are stored by ID as arrays ``w<i>.ids``, ``w<i>.values``,
... (``DynamicTable.state``), so every server's part together is the table, whatever
number of servers reads it back (each keeps the IDs ``shard_of`` routes to it). Every file is written to a temporary name and
renamed, so a checkpoint is complete when its manifest and every shard it names exist.
Invariant: the parts of a key in a complete checkpoint cover it exactly once, so it loads
onto any number of servers (:class:`Reader` cuts and joins parts and optimizer states).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .._ps.config import ENV_CHECKPOINT_DIR
from ..nd._npz import BadArchive, SafeNpz, read_bounded
from ..nd.ndarray import NDArray
from ..optimizer.base import from_spec
from ..optimizer.updater import decode_states, encode_states
from ._ckcheck import FORMAT, MANIFEST_BYTES, VERSION, check_entry, check_manifest, guarded

__all__ = ["FORMAT", "checkpoint_path", "MANIFEST", "Reader", "ShardCopy", "check_keys", "latest", "prune", "read_manifest",
           "round_dir", "shard_name", "write_manifest", "write_shard"]

MANIFEST = "manifest.json"
_META = "__meta__"
_STATES = "__states__"
_ROUND_DIR = re.compile(r"^round-(\d{10})$")


@dataclass(slots=True)
class ShardCopy:
    """One shard copied out of an engine: what a writer thread may write while it serves.

    ``entries`` are JSON dicts (see the module docstring); ``arrays[i]`` is entry ``i``'s
    part (a table shard's: a dict of named arrays); ``states`` copies of the optimizer states by key, or None without an optimizer.
    """

    entries: list[dict[str, Any]]
    arrays: list[Any]
    states: dict[Any, Any] | None
    optimizer: Any
    compression: Any
    #: the optimizer spec as a worker sent it (``optimizer`` carries the counts as well)
    sent: Any = None


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:05d}.npz"


def round_dir(root: str, rnd: int) -> str:
    """The directory of the periodic checkpoint taken at round ``rnd`` under ``root``."""
    return os.path.join(root, f"round-{rnd:010d}")


def _replace_atomically(path: str, write: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_shard(copy: ShardCopy, directory: str, index: int) -> str:
    """Write ``copy`` as shard ``index`` of the checkpoint in ``directory``; its path."""
    os.makedirs(directory, exist_ok=True)
    meta = {"format": FORMAT, "version": VERSION, "entries": copy.entries,
            "optimizer": copy.optimizer, "compression": copy.compression}
    if copy.sent is not None:
        meta["optimizer_sent"] = copy.sent
    named: dict[str, np.ndarray] = {}
    for i, a in enumerate(copy.arrays):
        if isinstance(a, dict):         # a table shard: its rows by ID
            named.update({f"w{i}.{field}": v for field, v in a.items()})
        else:
            named[f"w{i}"] = a
    named[_META] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    if copy.states is not None:
        named[_STATES] = np.frombuffer(encode_states(copy.states), dtype=np.uint8)
    path = os.path.join(directory, shard_name(index))
    _replace_atomically(path, lambda f: np.savez(f, allow_pickle=False, **named))
    return path


def write_manifest(directory: str, num_shards: int, rnd: int | None,
                   store_type: str) -> None:
    """Write the manifest naming ``num_shards`` shards (after or while they are written)."""
    os.makedirs(directory, exist_ok=True)
    body = {"format": FORMAT, "version": VERSION, "num_shards": num_shards, "round": rnd,
            "store_type": store_type}
    _replace_atomically(os.path.join(directory, MANIFEST),
                        lambda f: f.write(json.dumps(body, indent=1).encode("utf-8")))


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory``; CheckpointError if it is not one
    (checked: ``_ckcheck.check_manifest``), or if a shard it names is missing."""
    path = os.path.join(directory, MANIFEST)
    try:
        body = json.loads(read_bounded(path, MANIFEST_BYTES).decode("utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{directory!r} is not a pskv checkpoint: it has no {MANIFEST}. "
                              "Pass a directory kv.save_checkpoint wrote.") from err
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, BadArchive) as err:
        raise CheckpointError(f"cannot read {path!r}: {err}. Pass a directory "
                              "kv.save_checkpoint wrote.") from err
    check_manifest(body, path)
    for i in range(body["num_shards"]):     # stops at the first missing one
        if not os.path.exists(os.path.join(directory, shard_name(i))):
            raise CheckpointError(f"checkpoint {directory!r} is incomplete: {shard_name(i)} "
                                  f"(of {body['num_shards']} shards) is missing. Load an "
                                  "earlier checkpoint, or wait until its servers have "
                                  "written it.")
    return body


def _complete(directory: str) -> bool:
    try:
        read_manifest(directory)
    except CheckpointError:
        return False
    return True


def _rounds(root: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names
             if (m := _ROUND_DIR.match(n)) is not None]
    return sorted(found, reverse=True)


def latest(root: str) -> str | None:
    """The newest complete periodic checkpoint under ``root`` (``round-*`` directories), or
    ``root`` itself if it is a complete checkpoint, or None."""
    for _rnd, path in _rounds(root):
        if _complete(path):
            return path
    return root if _complete(root) else None


def prune(root: str, keep: int) -> None:
    """Remove periodic checkpoints under ``root`` older than the ``keep`` newest complete
    ones (incomplete newer ones are kept: their servers may still be writing)."""
    complete = 0
    for _rnd, path in _rounds(root):
        if complete >= keep:
            shutil.rmtree(path, ignore_errors=True)
        elif _complete(path):
            complete += 1


# ---- reading back, onto any placement --------------------------------------------------
@dataclass(slots=True)
class _Part:
    shard: int
    index: int
    start: int
    stop: int
    meta: dict[str, Any]


class Reader:
    """The parts of every key of a complete checkpoint, cut to any placement.

    Parameters
    ----------
    directory : str
        A complete checkpoint.
    max_key_bytes : int
        The most bytes a key of it may declare (``PSKV_MAX_KEY_BYTES``).

    Everything in it is checked as it is opened (``_ckcheck``); any error is a
    CheckpointError.
    """

    def __init__(self, directory: str, max_key_bytes: int = 1 << 36) -> None:
        self.directory = directory
        self.max_key_bytes = max_key_bytes
        self.manifest = read_manifest(directory)
        self._files: dict[int, SafeNpz] = {}
        self._states: dict[int, dict[Any, Any]] = {}
        try:
            with guarded(directory):
                self._index()
        except BaseException:
            self.close()
            raise

    def _index(self) -> None:
        directory = self.directory
        self.metas: list[dict[str, Any]] = [self._meta(i)
                                            for i in range(self.manifest["num_shards"])]
        self.parts: dict[Any, list[_Part]] = {}
        for s, meta in enumerate(self.metas):
            for i, e in enumerate(meta["entries"]):
                check_entry(e, i, self._file(s), directory, self.max_key_bytes)
                self.parts.setdefault(e["key"], []).append(_Part(s, i, e["start"], e["stop"], e))
        for key, parts in self.parts.items():
            if parts[0].meta.get("stype") == "table":
                continue        # stored by ID: every part is rows of its own IDs
            parts.sort(key=lambda p: p.start)
            first = parts[0].meta
            if any((p.meta["shape"], p.meta["dtype"], p.meta.get("stype", "default")) !=
                   (first["shape"], first["dtype"], first.get("stype", "default"))
                   for p in parts):
                raise CheckpointError(f"checkpoint {directory!r}: the parts of key {key!r} "
                                      "disagree on its shape or dtype. The checkpoint is "
                                      "damaged.", key=key)
            units = _units(parts[0].meta)
            pos = 0
            for p in parts:
                if p.start != pos:
                    raise CheckpointError(f"checkpoint {directory!r}: the parts of key {key!r} "
                                          "do not cover it. The checkpoint is damaged.", key=key)
                pos = p.stop
            if pos != units:
                raise CheckpointError(f"checkpoint {directory!r}: the parts of key {key!r} "
                                      "do not cover it. The checkpoint is damaged.", key=key)

    def close(self) -> None:
        """Close the shard files."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, shard: int) -> SafeNpz:
        f = self._files.get(shard)
        if f is None:
            path = os.path.join(self.directory, shard_name(shard))
            try:
                f = self._files[shard] = SafeNpz(path, repr(path))
            except (OSError, BadArchive) as err:
                raise CheckpointError(f"cannot read {path!r}: {err}. The checkpoint is "
                                      "damaged; load an earlier one.") from err
        return f

    def _meta(self, shard: int) -> dict[str, Any]:
        f = self._file(shard)
        try:
            shape, dtype = f.shape_of(_META)
            if len(shape) != 1 or dtype != np.uint8:
                raise BadArchive(f"{_META} is not bytes")
            meta = json.loads(f[_META].tobytes().decode("utf-8"))
        except (BadArchive, UnicodeDecodeError, ValueError, RecursionError) as err:
            raise CheckpointError(f"shard {shard} of {self.directory!r} has no readable "
                                  f"{_META}: {err}. The checkpoint is damaged.") from err
        if not isinstance(meta, dict) or meta.get("format") != FORMAT \
                or not isinstance(meta.get("entries"), list):
            raise CheckpointError(f"shard {shard} of {self.directory!r} is not a pskv shard.")
        return meta

    def _array(self, part: _Part) -> np.ndarray:
        with guarded(self.directory):
            return self._file(part.shard)[f"w{part.index}"]

    def key_meta(self, key: Any) -> dict[str, Any]:
        """What ``key`` was saved as (shape, dtype, stype, round); CheckpointError if absent."""
        parts = self.parts.get(key)
        if parts is None:
            raise CheckpointError(f"key {key!r} is not in checkpoint {self.directory!r}. Load "
                                  "a checkpoint of the same model (same keys).", key=key)
        return parts[0].meta

    def _overlap(self, key: Any, start: int, stop: int) -> list[_Part]:
        return [p for p in self.parts[key] if p.start < stop and p.stop > start]

    def value(self, key: Any, start: int, stop: int, shape: tuple[int, ...]) -> np.ndarray:
        """Elements (rows for row_sparse) ``[start, stop)`` of ``key``, shaped ``shape``."""
        meta = self.key_meta(key)
        out = np.empty(shape, np.dtype(meta["dtype"]))
        dst = _flat(out, meta)
        for p in self._overlap(key, start, stop):
            src = _flat(self._array(p), meta)
            lo, hi = max(start, p.start), min(stop, p.stop)
            dst[lo - start:hi - start] = src[lo - p.start:hi - p.start]
        return out

    def round(self, key: Any) -> int:
        """The round ``key`` was saved at (the newest of its parts)."""
        return max(int(p.meta.get("round", 0)) for p in self.parts[key])

    def table_parts(self, key: Any) -> list[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
        """Each saved shard of table ``key``: (its index, its arrays by name, its state's
        metadata), the input of ``DynamicTable.from_state``."""
        out = []
        for p in self.parts[key]:
            f = self._file(p.shard)
            prefix = f"w{p.index}."
            try:
                arrays = {n[len(prefix):]: np.asarray(f[n]) for n in f.files
                          if n.startswith(prefix)}
            except (OSError, ValueError) as err:
                raise CheckpointError(f"cannot read table {key!r} from shard {p.shard} of "
                                      f"{self.directory!r}: {err}. The checkpoint is damaged; "
                                      "load an earlier one.", key=key) from err
            meta = p.meta.get("table")
            if not isinstance(meta, dict) or "ids" not in arrays:
                raise CheckpointError(f"shard {p.shard} of {self.directory!r} has no readable "
                                      f"rows of table {key!r}. The checkpoint is damaged.",
                                      key=key)
            out.append((p.shard, arrays, meta))
        return sorted(out, key=lambda t: t[0])

    def meta(self, key: Any, shard: int | None = None) -> dict[str, Any]:
        """The metadata of ``key``'s part saved by ``shard`` (if given and saved; else its
        first part)."""
        parts = self.parts[key]
        mine = [p for p in parts if p.shard == shard]
        return (mine or parts)[0].meta

    def applied(self, key: Any, shard: int | None = None) -> dict[int, int]:
        """Per worker, how many of its pushes of ``key`` the checkpoint includes (in the
        part saved by ``shard``, if given and saved)."""
        pairs = self.meta(key, shard).get("applied") or []
        return {int(w): int(n) for w, n in pairs}

    def _shard_states(self, shard: int) -> dict[Any, Any]:
        got = self._states.get(shard)
        if got is None:
            f = self._file(shard)
            with guarded(self.directory):
                got = decode_states(f[_STATES].tobytes())[0] if _STATES in f else {}
            self._states[shard] = got
        return got

    def state(self, key: Any, start: int, stop: int, shape: tuple[int, ...]) -> Any:
        """``key``'s optimizer state cut to ``[start, stop)`` (shaped like a part of
        ``shape``), or None if it has none."""
        meta = self.key_meta(key)
        parts = self._overlap(key, start, stop)
        trees = [self._shard_states(p.shard).get(key) for p in parts]
        if any(t is None for t in trees):
            return None
        if len(parts) == 1 and (parts[0].start, parts[0].stop) == (start, stop):
            _check_state(trees[0], shape, key, self.directory)
            return trees[0]

        def join(nodes: list[Any]) -> Any:
            first = nodes[0]
            if isinstance(first, (tuple, list)):
                joined = [join([n[i] for n in nodes]) for i in range(len(first))]
                return tuple(joined) if isinstance(first, tuple) else joined
            if type(first) is not NDArray:
                return first
            out = np.empty(shape, first.dtype)
            dst = _flat(out, meta)
            for p, node in zip(parts, nodes, strict=True):
                src = _flat(node._data, meta)
                if src.shape[0] != p.stop - p.start:
                    raise CheckpointError(
                        f"the optimizer state of key {key!r} does not have the shape of its "
                        "weight, so it cannot be cut onto another number of servers. Load it "
                        "onto as many servers as saved it.", key=key)
                lo, hi = max(start, p.start), min(stop, p.stop)
                dst[lo - start:hi - start] = src[lo - p.start:hi - p.start]
            return NDArray(out, first.context)
        return join(trees)

    def optimizer(self) -> Any:
        """The optimizer spec, with the update counts of every shard merged (or None)."""
        specs: list[dict[str, Any]] = [m["optimizer"] for m in self.metas
                                       if isinstance(m.get("optimizer"), dict)]
        if not specs:
            return None
        with guarded(self.directory):
            return self._merged_spec(specs)

    def optimizer_sent(self) -> Any:
        """The optimizer spec as the workers sent it, if every shard says the same (None:
        a checkpoint written before it was kept, or no optimizer)."""
        sent = [m.get("optimizer_sent") for m in self.metas
                if isinstance(m.get("optimizer"), dict)]
        if not sent or any(s is None or s != sent[0] for s in sent):
            return None
        return sent[0]

    def _merged_spec(self, specs: list[dict[str, Any]]) -> Any:
        spec = json.loads(json.dumps(specs[0]))
        state = spec.setdefault("state", {})
        state["num_update"] = max(int(s.get("state", {}).get("num_update", 0)) for s in specs)
        merged: dict[int, dict[str, Any]] = {}
        for s in specs:
            for dev, pairs in s.get("state", {}).get("update_counts", []):
                into = merged.setdefault(int(dev), {})
                for k, v in pairs:
                    into[json.dumps(k)] = [k, max(int(v), into.get(json.dumps(k), [k, 0])[1])]
        state["update_counts"] = [[dev, list(c.values())] for dev, c in merged.items()]
        from_spec(spec)                    # one that cannot be built is refused here
        return spec

    def compression(self) -> Any:
        """The gradient-compression params the checkpoint was taken with (or None)."""
        return self.metas[0].get("compression")


def check_keys(reader: Reader, keys: list[Any], path: str) -> None:
    """CheckpointError unless the checkpoint holds exactly ``keys`` (the user's keys)."""
    extra = sorted((k for k in reader.parts if k not in set(keys)), key=repr)
    missing = sorted((k for k in keys if k not in reader.parts), key=repr)
    if extra or missing:
        k = (missing or extra)[0]
        where = "is not in" if missing else "is in"
        raise CheckpointError(
            f"key {k!r} {where} checkpoint {path!r} but {'is' if missing else 'is not'} "
            f"initialized in this store ({len(missing)} such keys missing, {len(extra)} "
            "extra). Init exactly the checkpoint's keys before loading it.", key=k)


def _check_state(tree: Any, shape: tuple[int, ...], key: Any, directory: str) -> None:
    """CheckpointError unless every array of an optimizer state has the weight's shape."""
    if isinstance(tree, (tuple, list)):
        for node in tree:
            _check_state(node, shape, key, directory)
    elif isinstance(tree, NDArray) and tuple(tree.shape) != tuple(shape):
        raise CheckpointError(f"checkpoint {directory!r}: the optimizer state of key {key!r} "
                              f"has shape {tuple(tree.shape)}, its weight {tuple(shape)}. The "
                              "checkpoint is damaged.", key=key)


def _units(meta: dict[str, Any]) -> int:
    shape = meta["shape"]
    if meta.get("stype") == "row_sparse":
        return int(shape[0]) if shape else 0
    return int(np.prod(shape, dtype=np.int64))


def _flat(a: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    """``a`` as units: rows for row_sparse keys, elements otherwise (a view)."""
    return a if meta.get("stype") == "row_sparse" else a.reshape(-1)


def checkpoint_path(path: str, root: str | None = None) -> str:
    """``path`` as every server sees it (absolute: servers may run elsewhere).

    With ``root`` (``PSKV_CHECKPOINT_DIR``), a path a worker names must lie under it once
    symlinks are resolved: a server writes or reads a worker's checkpoint only there
    (CheckpointError otherwise; docs/durability.md)."""
    if "\x00" in path:
        raise CheckpointError(f"checkpoint path {path!r} holds a NUL byte. Pass a directory "
                              "path.")
    where = os.path.abspath(path)
    if root is not None:
        base = os.path.realpath(root)
        real = os.path.realpath(where)
        if os.path.commonpath([base, real]) != base:
            raise CheckpointError(
                f"checkpoint path {path!r} is outside {ENV_CHECKPOINT_DIR}={root!r}: this "
                "job's servers write and read checkpoints only under it. Pass a path under "
                f"{root!r}, or start the job with another {ENV_CHECKPOINT_DIR}.")
    return where
