"""DistKVStore: the worker side of ``dist_sync``, ``dist_async`` and ``dist_device_sync``.

A push reduces the local devices' values with the local store's code, compresses if asked,
cuts each key into its segments and sends one message per server; a pull sends one message
per server and copies the replies into every out. Invariants: ``init`` is collective (every
worker calls it with the same keys; shapes are checked across workers at a barrier, rank 0
sends the values, a second barrier publishes them); every worker computes the same
placement because init calls are collective and keys are placed in ps_key order; a failed
call on one worker fails on every worker instead of hanging.
"""
from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (ClusterError, ConfigError, KVStoreError, ShapeMismatchError,
                      UnsupportedError, ValueTypeError)
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .._ps.config import ClusterConfig, Role
from .._ps.message import Command
from .._ps.partition import Segment, place, ps_key
from .._ps.postoffice import Postoffice
from .._ps.van import ZmqVan
from .._ps.worker import KVWorker
from ._args import as_numpy, normalize, row_ids_by_key, tensor_maker
from ._reduce import sum_row_sparse
from .local import LocalKVStore

__all__ = ["DistKVStore", "create_dist"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _KeyInfo:
    """What a worker knows of a key: its shape, dtype, kind and where its segments live."""

    pskey: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sparse: bool
    segments: list[Segment]
    ctx: Any
    proto: Any

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class DistKVStore(LocalKVStore):
    """A worker's handle on a parameter-server cluster (``dist_*`` store types).

    Create it with ``pskv.kv.create('dist_sync')`` in a process started by ``pskv-launch``
    (or with the DMLC_* variables set by hand).
    """

    def __init__(self, name: str, cfg: ClusterConfig) -> None:
        super().__init__(name)
        self._cfg = cfg
        self._sync = "async" not in name
        self._van = ZmqVan()
        try:
            self._po = Postoffice(cfg, self._van)
            self._po.start()
            self._kv = KVWorker(cfg, self._van, self._po)
            self._to_all(Command.COMMAND, {"op": "mode", "sync": self._sync})
        except BaseException:
            self._van.close()
            raise
        self._loads = [0] * self._po.num_servers
        self._wire_gc: Any = None
        self._wire_residual: dict[int | str, np.ndarray] = {}
        self._sendbuf: dict[int | str, np.ndarray] = {}
        self._by_pskey: dict[int, int | str] = {}
        self._held: tuple[list[int | str], dict[int, tuple[list[int], str, list[np.ndarray]]]] \
            | None = None
        # a strong reference: a store dropped without close() must still say goodbye at
        # exit, or the scheduler takes the silent worker for dead and exits 1
        self._atexit = self.close
        atexit.register(self._atexit)

    @property
    def rank(self) -> int:
        """This worker's rank, 0 to ``num_workers - 1``."""
        return self._po.rank

    @property
    def num_workers(self) -> int:
        """The number of workers in the cluster."""
        return self._po.num_workers

    # ---- plumbing ------------------------------------------------------------------------
    def _to_all(self, cmd: Command, body: Any) -> list[Any]:
        tss = [self._kv.request(s, cmd, body=body) for s in range(self._po.num_servers)]
        return self._kv.wait_all(tss, f"the servers to take {body.get('op', cmd.name)}")

    def _begin(self, pulling: bool = False) -> None:
        self._check_open()
        self._po.check()
        self._kv.raise_deferred()
        if not pulling:
            self._send_held()

    def _send_held(self) -> None:
        """Send the push that waited for this call (it was not a pull of its keys)."""
        held, self._held = self._held, None
        if held is not None:
            for server, (pk, kinds, arrays) in held[1].items():
                self._kv.push(server, Command.PUSH, pk, {"kinds": kinds}, arrays)

    # ---- init ------------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Initialize keys on the servers: every worker calls it; rank 0's values are kept.

        Raises on every worker if any worker's keys, shapes or dtypes differ.
        """
        with self._lock:
            self._begin()
            keys: list[int | str] = []
            groups: list[list[Any]] = []
            specs = None
            error: KVStoreError | None = None
            try:
                keys, groups = normalize(key, value)
                self._validate_init(keys, groups)
                specs = [self._spec(k, vals[0]) for k, vals in zip(keys, groups)]
            except KVStoreError as err:
                error = err
            payloads = self._po.barrier("worker", {
                "specs": specs, "error": None if error is None else
                f"{type(error).__name__}: {error}"})
            if error is not None:
                raise error
            self._check_agreement(payloads, specs)
            assert specs is not None
            order = sorted(range(len(keys)), key=lambda i: specs[i][0])
            infos = {keys[i]: self._place(keys[i], groups[i][0]) for i in order}
            if self.rank == 0:
                self._send_init(keys, groups, infos)
            self._po.barrier("worker", None)
            for k in keys:
                self._store[k] = infos[k]   # type: ignore[assignment]
                self._ikey[k] = len(self._ikey)
                self._by_pskey[infos[k].pskey] = k
                if self._kind is None:
                    self._kind = type(k)

    def _spec(self, key: int | str, value: Any) -> list[Any]:
        pk = ps_key(key)
        other = self._by_pskey.get(pk)
        if other is not None and other != key:
            raise ConfigError(f"keys {key!r} and {other!r} hash to the same server key. "
                              "Rename one of them.", key=key)
        arr = value if isinstance(value, NDArray) else as_numpy(value)
        stype = "row_sparse" if isinstance(value, RowSparseNDArray) else "default"
        return [pk, key, list(arr.shape), np.dtype(arr.dtype).name, stype]

    def _check_agreement(self, payloads: dict[str, Any], specs: Any) -> None:
        bad = {r: p["error"] for r, p in payloads.items() if p and p.get("error")}
        if bad:
            rank = min(bad, key=int)
            raise ClusterError(f"init failed on worker {rank}: {bad[rank]}. Every worker must "
                               "init the same keys with the same shapes.")
        def by_pskey(ss: Any) -> list[Any]:   # the order keys are listed in does not matter
            return sorted(ss or [], key=lambda s: s[0])

        for r, p in sorted(payloads.items(), key=lambda kv: int(kv[0])):
            if by_pskey(p["specs"]) != by_pskey(specs):
                theirs = {s[1]: s[2:] for s in p["specs"] or []}
                mine = {s[1]: s[2:] for s in specs}
                diff = sorted({k for k in set(mine) | set(theirs)
                               if mine.get(k) != theirs.get(k)}, key=repr)
                k = diff[0] if diff else None
                raise ShapeMismatchError(
                    f"workers disagree on init: key {k!r} is {mine.get(k)} on worker "
                    f"{self.rank} but {theirs.get(k)} on worker {r} ([shape, dtype, stype]). "
                    "Every worker must init the same keys with the same shapes and dtypes.",
                    key=k)

    def _place(self, key: int | str, value: Any) -> _KeyInfo:
        sparse = isinstance(value, RowSparseNDArray)
        arr = value if isinstance(value, NDArray) else as_numpy(value)
        shape, dtype = tuple(arr.shape), np.dtype(arr.dtype)
        size = int(np.prod(shape, dtype=np.int64))
        if sparse:
            row = size // shape[0] if shape[0] else 0
            segs = place(shape[0], row * dtype.itemsize, self._po.num_servers,
                         self._cfg.bigarray_bound, row, self._loads, split_always=True)
        else:
            segs = place(size, dtype.itemsize, self._po.num_servers, self._cfg.bigarray_bound,
                         1, self._loads)
        proto = value if sparse else (type(value) if isinstance(value, NDArray) else
                                      tensor_maker(value) or np.ndarray)
        ctx = value.context if isinstance(value, NDArray) else None
        return _KeyInfo(ps_key(key), shape, dtype, sparse, segs, ctx, proto)

    def _parts(self, info: _KeyInfo, data: np.ndarray) -> list[np.ndarray]:
        """``data`` (the key's full dense value) cut into its segments."""
        if info.sparse:
            return [data[s.start:s.stop] for s in info.segments]
        if len(info.segments) == 1:
            return [data.reshape(info.shape)]
        flat = data.reshape(-1)
        return [flat[s.start:s.stop] for s in info.segments]

    def _send_init(self, keys: list[int | str], groups: list[list[Any]],
                   infos: dict[int | str, _KeyInfo]) -> None:
        per: dict[int, tuple[list[int], list[Any], list[np.ndarray]]] = {}
        for k, vals in zip(keys, groups):
            info = infos[k]
            v = vals[0]
            dense = np.ascontiguousarray(v._dense() if isinstance(v, NDArray) else as_numpy(v))
            for seg, part in zip(info.segments, self._parts(info, dense)):
                pk, specs, arrays = per.setdefault(seg.server, ([], [], []))
                pk.append(info.pskey)
                specs.append({"key": k, "shape": list(part.shape),
                              "stype": "row_sparse" if info.sparse else "default"})
                arrays.append(np.ascontiguousarray(part).reshape(part.shape))  # keeps 0-d
        tss = [self._kv.request(s, Command.INIT, pk, {"entries": sp}, arr)
               for s, (pk, sp, arr) in per.items()]
        self._kv.wait_all(tss, "the servers to take init")

    # ---- push --------------------------------------------------------------------------------
    def _validate_push(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        super()._validate_push(keys, groups)
        if self._wire_gc is not None:
            for k, vals in zip(keys, groups):
                if any(isinstance(v, RowSparseNDArray) for v in vals):
                    raise UnsupportedError(
                        f"push to key {k!r}: gradient compression works on dense arrays only.",
                        key=k, store_type=self._type)

    def _merged_dense(self, key: int | str, info: _KeyInfo, vals: list[Any]) -> np.ndarray:
        """The sum of ``vals``: the caller's own array when it is one array that is written
        out before push returns (the same-host path), else this key's send buffer."""
        if len(vals) == 1 and self._wire_gc is None:
            data = vals[0]._data if type(vals[0]) is NDArray else as_numpy(vals[0])
            if data.dtype == info.dtype and data.flags.c_contiguous and all(
                    self._kv.sends_now(seg.server) for seg in info.segments):
                return data
        buf = self._sendbuf.get(key)
        if buf is None:
            buf = self._sendbuf[key] = np.empty(info.shape, info.dtype)
        arrays = [v._dense() if isinstance(v, NDArray) else as_numpy(v) for v in vals]
        self._reducer.sum_into(buf, arrays)
        return buf

    def _push_items(self, keys: list[int | str], groups: list[list[Any]]) \
            -> dict[int, tuple[list[int], str, list[np.ndarray]]]:
        """Per server: ps_keys, kind letters and arrays of one push message."""
        per: dict[int, tuple[list[int], list[str], list[np.ndarray]]] = {}
        for k, vals in zip(keys, groups):
            info: _KeyInfo = self._store[k]  # type: ignore[assignment]
            if info.sparse:
                rsp = [v if isinstance(v, RowSparseNDArray) else
                       RowSparseNDArray.from_dense(as_numpy(v)) for v in vals]
                merged = sum_row_sparse(rsp)
                for seg in info.segments:
                    lo, hi = np.searchsorted(merged._indices, [seg.start, seg.stop])
                    pk, kinds, arrays = per.setdefault(seg.server, ([], [], []))
                    pk.append(info.pskey)
                    kinds.append("r")
                    arrays.append(merged._indices[lo:hi] - seg.start)
                    arrays.append(np.ascontiguousarray(merged._data[lo:hi], dtype=info.dtype))
                continue
            data = self._merged_dense(k, info, vals)
            parts = self._parts(info, data)
            if self._wire_gc is not None:
                res = self._wire_residual.get(k)
                if res is None:
                    res = self._wire_residual[k] = np.zeros(info.size, np.float32)
                flat = data.reshape(-1)
                parts = []
                for seg in info.segments:
                    s, e = (seg.start, seg.stop) if len(info.segments) > 1 else (0, info.size)
                    parts.append(self._wire_gc.compress(flat[s:e], res[s:e]))
            for seg, part in zip(info.segments, parts):
                pk, kinds, arrays = per.setdefault(seg.server, ([], [], []))
                pk.append(info.pskey)
                kinds.append("c" if self._wire_gc is not None else "d")
                arrays.append(part)
        return {s: (pk, "".join(kinds), arrays) for s, (pk, kinds, arrays) in per.items()}

    def _push_validated(self, keys: list[int | str], groups: list[list[Any]]) -> None:
        self._send_held()
        # the send buffers are reused: earlier pushes must have left before overwriting
        self._kv.flush_sent()
        items = self._push_items(keys, groups)
        if self._sync and all(set(kinds) <= {"d", "c"} for _, kinds, _ in items.values()) \
                and sum(a.nbytes for _, _, arr in items.values() for a in arr) \
                <= self._cfg.coalesce_bytes:
            # a small push waits for this store's next call: when that is a pull of the
            # same keys (a training loop's push-then-pull), both travel as one PUSHPULL and
            # the round's value comes back at once; any other call sends it first
            self._held = (list(keys), {s: (pk, kinds, [np.array(a) for a in arrays])
                                       for s, (pk, kinds, arrays) in items.items()})
            return
        for server, (pk, kinds, arrays) in items.items():
            self._kv.push(server, Command.PUSH, pk, {"kinds": kinds}, arrays)

    # ---- pull --------------------------------------------------------------------------------
    def _fetch(self, keys: list[int | str], cmd: Command = Command.PULL,
               push: dict[int, tuple[list[int], str, list[np.ndarray]]] | None = None,
               targets: dict[int | str, np.ndarray] | None = None) \
            -> dict[int | str, list[np.ndarray]]:
        """Each key's segments as the servers hold them now (after this worker's pushes).

        ``targets``: an array per key that the reply may be read straight into (then the
        returned parts are views of it).
        """
        per: dict[int, list[int]] = {}
        into: dict[int, list[np.ndarray | None]] = {}
        for k in keys:
            info: _KeyInfo = self._store[k]  # type: ignore[assignment]
            t = targets.get(k) if targets else None
            flat = t.reshape(-1) if t is not None and len(info.segments) > 1 else None
            for seg in info.segments:
                per.setdefault(seg.server, []).append(info.pskey)
                into.setdefault(seg.server, []).append(
                    None if t is None else t if flat is None else flat[seg.start:seg.stop])
        if push is not None:
            tss = {s: self._kv.request(s, cmd, pk, {"kinds": kinds}, arrays,
                                       into=into.get(s))
                   for s, (pk, kinds, arrays) in push.items()}
        else:
            tss = {s: self._kv.request(s, cmd, pk, into=into[s]) for s, pk in per.items()}
        replies = dict(zip(tss, self._kv.wait_all(list(tss.values()), "a pull reply")))
        got: dict[int, list[np.ndarray]] = {}
        for s, (_meta, arrays) in replies.items():
            if len(arrays) != len(per[s]):
                raise ClusterError(f"server {s} answered {len(arrays)} arrays for "
                                   f"{len(per[s])} keys (reported by server {s})")
            got[s] = list(arrays)
        out: dict[int | str, list[np.ndarray]] = {}
        for k in keys:
            info = self._store[k]  # type: ignore[assignment]
            out[k] = [got[seg.server].pop(0) for seg in info.segments]
        return out

    def _assemble(self, info: _KeyInfo, parts: list[np.ndarray], out: np.ndarray) -> None:
        if len(parts) == 1:
            if not np.may_share_memory(parts[0], out):   # not read in place
                np.copyto(out, parts[0].reshape(info.shape), casting="same_kind")
            return
        dst = out if info.sparse else out.reshape(-1)
        for seg, part in zip(info.segments, parts):
            view = dst[seg.start:seg.stop]
            if not np.may_share_memory(part, view):
                np.copyto(view, part, casting="same_kind")

    def _targets(self, keys: list[int | str], groups: list[list[Any]],
                 only: set[int | str] | None = None) -> dict[int | str, np.ndarray]:
        """Per key (of ``only``, if given), an out the reply can be read straight into."""
        targets = {}
        for k, outs in zip(keys, groups):
            if only is None or k in only:
                t = self._target(self._store[k], outs)  # type: ignore[arg-type]
                if t is not None:
                    targets[k] = t
        return targets

    @staticmethod
    def _target(info: _KeyInfo, outs: list[Any]) -> np.ndarray | None:
        """An out the reply can be read straight into: dense, contiguous, same dtype."""
        for o in outs:
            if isinstance(o, RowSparseNDArray):
                continue
            arr = as_numpy(o)
            if arr.dtype == info.dtype and arr.flags.c_contiguous and arr.flags.writeable:
                return arr
        return None

    def _pull_validated(self, keys: list[int | str], groups: list[list[Any]],
                        ignore_sparse: bool, fetched: dict[int | str, list[np.ndarray]]
                        | None = None) -> None:
        wanted = [k for k, outs in zip(keys, groups)
                  if any(not (ignore_sparse and isinstance(o, RowSparseNDArray)) for o in outs)]
        held = self._held
        if fetched is None and held is not None:
            self._held = None
            if held[0] == keys and wanted == keys:     # the push this pull follows: together
                fetched = self._fetch(keys, Command.PUSHPULL, held[1],
                                      self._targets(keys, groups))
            else:
                self._held = held
                self._send_held()
        if fetched is None:
            fetched = self._fetch(wanted, targets=self._targets(keys, groups, set(wanted))) \
                if wanted else {}
        parts = fetched
        for k, outs in zip(keys, groups):
            info: _KeyInfo = self._store[k]  # type: ignore[assignment]
            for o in outs:
                if isinstance(o, RowSparseNDArray):
                    if ignore_sparse:
                        self._warn_sparse(k)
                        continue
                    table = np.empty(info.shape, o.dtype)
                    self._assemble(info, parts[k], table)
                    o._data, o._indices = table, np.arange(info.shape[0], dtype=np.int64)
                    continue
                self._assemble(info, parts[k], as_numpy(o))

    def _pull_new(self, key: Any) -> Any:
        from ._args import check_key
        self._send_held()
        many = isinstance(key, (list, tuple))
        ks = [check_key(k) for k in (key if many else [key])]
        self._check_kind(ks)
        infos = [self._stored(k, "pull") for k in ks]
        parts = self._fetch(list(dict.fromkeys(ks)))
        result = []
        for k, info in zip(ks, infos):
            data = np.empty(info.shape, info.dtype)
            self._assemble(info, parts[k], data)  # type: ignore[arg-type]
            proto = info.proto  # type: ignore[attr-defined]
            item: Any = data
            if isinstance(proto, RowSparseNDArray):
                item = RowSparseNDArray._all_rows(data, info.ctx)
            elif not isinstance(proto, type):   # torch.from_numpy: _args.tensor_maker
                item = proto(data)
            elif proto is not np.ndarray:
                item = object.__new__(proto)
                item._data, item._ctx = data, info.ctx
            result.append(item)
        return result if many else result[0]

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Push, then pull the round's result, in one message per server."""
        with self._lock:
            self._begin()
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, value if out is None else out, "out")
            self._validate_push(keys, groups)
            self._validate_pull(okeys, ogroups)
            self._kv.flush_sent()
            items = self._push_items(keys, groups)
            # with out=None the reply overwrites the values: after they were sent
            targets = self._targets(okeys, ogroups) if out is not None else {}
            fetched = self._fetch(keys, Command.PUSHPULL, items, targets)
            self._pull_validated(okeys, ogroups, True, fetched)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialize with rank 0's ``value`` and pull it into ``out`` on every worker."""
        with self._lock:
            self.init(key, value)
            self.pull(key, out=out)

    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Pull rows ``row_ids`` of row_sparse keys from the servers holding them."""
        with self._lock:
            self._begin()
            if out is None or row_ids is None:
                raise ValueTypeError("row_sparse_pull needs both out= and row_ids=.", key=key)
            keys, groups = normalize(key, out, "out")
            rows = row_ids_by_key(key, keys, groups, row_ids)
            self._check_kind(keys)
            reqs: list[tuple[int | str, Any, np.ndarray]] = []
            for k, outs in zip(keys, groups):
                info: _KeyInfo = self._stored(k, "row_sparse_pull")  # type: ignore[assignment]
                if not info.sparse:
                    raise UnsupportedError(
                        f"row_sparse_pull of key {k!r}: the key holds a dense array of shape "
                        f"{info.shape}. Init it with a row_sparse value, or use pull().",
                        key=k, shape=info.shape, store_type=self._type)
                for o, r in zip(outs, rows[k]):
                    if not isinstance(o, RowSparseNDArray):
                        raise ValueTypeError(f"row_sparse_pull of key {k!r} needs row_sparse "
                                             f"outs, got a {type(o).__name__}.", key=k)
                    self._check_array(k, o, info, "row_sparse_pull", into=True)
                    if r.size and (r[0] < 0 or r[-1] >= info.shape[0]):
                        raise ShapeMismatchError(
                            f"row_sparse_pull of key {k!r}: row ids must lie in [0, "
                            f"{info.shape[0]}).", key=k, shape=info.shape)
                    reqs.append((k, o, r))
            per: dict[int, tuple[list[int], list[np.ndarray], list[tuple[int, int]]]] = {}
            for i, (k, _o, r) in enumerate(reqs):
                info = self._store[k]  # type: ignore[assignment]
                for seg in info.segments:
                    lo, hi = np.searchsorted(r, [seg.start, seg.stop])
                    pk, arrays, where = per.setdefault(seg.server, ([], [], []))
                    pk.append(info.pskey)
                    arrays.append(r[lo:hi] - seg.start)
                    where.append((i, int(lo)))
            tss = {s: self._kv.request(s, Command.RSP_PULL, pk, None, arrays)
                   for s, (pk, arrays, _) in per.items()}
            replies = dict(zip(tss, self._kv.wait_all(list(tss.values()), "row_sparse_pull")))
            datas = [np.empty((len(r),) + self._store[k].shape[1:], o.dtype)
                     for k, o, r in reqs]
            for s, (_, _, where) in per.items():
                for (i, lo), part in zip(where, replies[s][1]):
                    datas[i][lo:lo + len(part)] = part
            for (_k, o, r), data in zip(reqs, datas):
                o._data, o._indices = data, r

    # ---- optimizer, compression, states -----------------------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Install ``optimizer`` on every server (a JSON spec, never a pickle).

        Every worker may call it (MXNet scripts do); the servers install it once and treat
        identical repeats as no-ops.
        """
        from .. import optimizer as opt
        if not isinstance(optimizer, opt.Optimizer):
            raise ValueTypeError(
                f"set_optimizer() takes a pskv.optimizer.Optimizer, got "
                f"{type(optimizer).__name__}. Create one with mx.optimizer.create('sgd', ...).")
        with self._lock:
            self._begin()
            spec = optimizer.to_spec()
            self._kv.flush_sent()
            self._to_all(Command.COMMAND, {"op": "optimizer", "spec": spec})

    def set_updater(self, updater: Any) -> None:
        """Not available in dist stores: the update runs on the servers. Use set_optimizer."""
        raise UnsupportedError(
            f"a {self._type!r} store updates on the servers, which cannot run a Python "
            "function sent from a worker. Use kv.set_optimizer(mx.optimizer.create(...)).",
            store_type=self._type)

    _set_updater = set_updater

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes on the wire (2bit / 1bit); call on every worker before init."""
        from .. import compression
        with self._lock:
            self._begin()
            if self._store:
                raise UnsupportedError(
                    "set_gradient_compression must be called before the first init.",
                    store_type=self._type)
            gc = compression.create(compression_params)
            self._to_all(Command.COMMAND, {"op": "compression",
                                           "params": None if gc is None else gc.params})
            self._wire_gc = gc

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Gather every server's optimizer states into ``fname`` (NumPy arrays + JSON)."""
        with self._lock:
            self._begin()
            self._kv.flush_sent()
            replies = self._to_all(Command.COMMAND, {"op": "save", "dump": dump_optimizer})
            blobs = {f"server_{i}": arrays[0] for i, (_, arrays) in enumerate(replies)}
            with open(fname, "wb") as f:
                np.savez(f, **blobs)

    def load_optimizer_states(self, fname: str) -> None:
        """Send each server its part of states saved by :meth:`save_optimizer_states`."""
        with self._lock:
            self._begin()
            try:
                with np.load(fname, allow_pickle=False) as data:
                    blobs = [np.array(data[f"server_{i}"]) for i in range(self._po.num_servers)]
            except (OSError, KeyError, ValueError) as err:
                raise ConfigError(f"cannot load optimizer states from {fname!r}: {err}. Load "
                                  "a file saved by a cluster with as many servers.") from err
            self._kv.flush_sent()
            tss = [self._kv.request(s, Command.COMMAND, body={"op": "load"}, arrays=[b])
                   for s, b in enumerate(blobs)]
            self._kv.wait_all(tss, "the servers to load states")

    # ---- cluster ---------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every worker reaches this barrier.

        ``dist_async``: every worker's earlier pushes are applied before anyone leaves it.
        ``dist_sync``: earlier pushes are sent first but not waited for, since their rounds
        may need pushes other workers make after the barrier; a pull after the barrier
        still returns the round that includes this worker's push.
        """
        with self._lock:
            self._begin()
            if self._sync:
                self._kv.flush_sent()
            else:
                self._kv.flush()
            self._po.barrier("worker")

    _barrier = barrier

    def close(self) -> None:
        """Leave the cluster; when every worker has closed, the servers and scheduler exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._atexit)
            try:
                if self._po.failure is None:
                    self._send_held()
                    self._kv.flush(timeout=min(self._cfg.request_timeout, 10.0))
            except KVStoreError as err:
                log.warning("worker %d: closing with unacknowledged pushes: %s", self.rank, err)
            finally:
                self._po.goodbye()
                self._po.close()
                self._kv.close()
                self._van.close()
                self._reducer.close()

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability``; ``'optimizer'`` is supported."""
        return super().is_capable(capability)

    def __repr__(self) -> str:
        return (f"<DistKVStore type={self._type!r} rank={self.rank}/{self.num_workers} "
                f"keys={len(self._store)}>")


def create_dist(name: str) -> LocalKVStore:
    """Create a dist store; in a process started as a server or scheduler, serve instead.

    MXNet's launchers start the user's script in the server and scheduler roles too; as in
    MXNet, such a process runs its role inside ``create`` and exits when the job ends.
    """
    cfg = ClusterConfig.from_env()
    if cfg.role != Role.WORKER:
        from .server import run_node
        raise SystemExit(run_node(cfg))
    return DistKVStore(name, cfg)
