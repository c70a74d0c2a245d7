"""DataPath: the messages of a dist store's pushes and pulls.

A push is reduced over the caller's devices (the caller's own array when it is one), cut
into each key's segments and grouped into one message per server: dense parts, row_sparse
rows (re-based to the segment) or, with gradient compression, quantized parts with their
error-feedback residuals. A pull asks each server for its segments and, where an out has
the key's shape and dtype, reads the reply straight into it. The store keeps the API, the
checks and the locks; this keeps the buffers. Invariant: the arrays of a message sent are
free again when ``send`` returns (every transport has written or copied them), except a
send buffer of this path's own lent to failover's push log (:class:`SendBuffer`), which
is repaid before the next sum is written into it. A caller's array is never lent: the log
copies it (a ``pushpull`` borrows it for the call instead, ``_ps/replay.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from ...errors import ClusterError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._ps.message import Command
from ..._ps.worker import KVWorker
from ..._types import Key
from .._args import as_numpy
from ._held import Items
from .._keys import KeyRecord
from .._reduce import Reducer, sum_row_sparse
from ._placement import parts, rows_by_server, target

__all__ = ["DataPath"]


class SendBuffer:
    """A multi-value key's sum, in a buffer this path owns. Failover's push log may keep
    the buffer itself instead of a copy (it *lends* it, ``_ps/replay.Loan``):
    :meth:`writable` repays the loans (the log copies what of it it still keeps) before
    the next sum is written, so a push the servers backed up before then costs no copy.
    Only the store's thread, under the store's lock, lends and writes it."""

    __slots__ = ("data", "_loans")

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self._loans: list[Any] = []

    def _lend(self, loan: Any) -> None:
        self._loans.append(loan)

    def writable(self) -> np.ndarray:
        """The buffer, once nothing the log keeps reads it."""
        loans, self._loans = self._loans, []
        for loan in loans:
            loan.repay()
        return self.data


class DataPath:
    """Push and pull messages of one DistKVStore.

    Parameters
    ----------
    records : dict
        The store's key records (shape, dtype, placement), by key.
    kv : KVWorker
        The worker's links to the servers.
    reducer : Reducer
        Sums the values of several devices.
    wait_all : callable
        ``wait_all(tss, what)``: the replies, waited for without the store's lock.
    """

    def __init__(self, records: dict[Key, KeyRecord], kv: KVWorker, reducer: Reducer,
                 wait_all: Callable[[list[int], str], list[Any]]) -> None:
        self._records = records
        self._kv = kv
        self._reducer = reducer
        self._wait_all = wait_all
        #: the gradient compression of pushes (``set_gradient_compression``), or None
        self.compressor: Any = None
        self._residual: dict[Key, np.ndarray] = {}
        #: each multi-value key's sum, in a buffer of this path's own
        self._sendbuf: dict[Key, SendBuffer] = {}
        #: id(buffer) -> (SendBuffer, buffer) of the buffers the last :meth:`items` may
        #: lend to failover's push log instead of a copy
        self._lendable: dict[int, tuple[SendBuffer, np.ndarray]] = {}

    # ---- push ------------------------------------------------------------------------------
    def _merged_dense(self, key: Key, info: KeyRecord, vals: list[Any]) -> np.ndarray:
        """The sum of ``vals``: the caller's own array when it is one array (every transport
        is done with it when push returns), else this key's send buffer, which may be
        lent."""
        if len(vals) == 1 and self.compressor is None:
            v = vals[0]
            data = v._data if type(v) is NDArray else as_numpy(v)
            if data.dtype == info.dtype and data.flags.c_contiguous:
                return data
        held = self._sendbuf.get(key)
        if held is None:
            held = self._sendbuf[key] = SendBuffer(np.empty(info.shape, info.dtype))
        buf = held.writable()   # repays what the log still keeps of its last push
        arrays = [v._dense() if isinstance(v, NDArray) else as_numpy(v) for v in vals]
        self._reducer.sum_into(buf, arrays)
        if self.compressor is None:
            self._lendable[id(buf)] = (held, buf)
        return buf

    def merged(self, key: Key, vals: list[Any]) -> np.ndarray:
        """The sum of a dense key's ``vals`` as one contiguous array of its dtype (the
        caller's own array when it is one; do not keep it)."""
        return self._merged_dense(key, self._records[key], vals)

    def items(self, keys: list[Key], groups: list[list[Any]]) -> Items:
        """Per server: ps_keys, kind letters and arrays of one push message."""
        self._lendable = {}
        per: dict[int, tuple[list[int], list[str], list[np.ndarray]]] = {}
        for k, vals in zip(keys, groups):
            info = self._records[k]
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
            pieces = parts(info, data)
            if self.compressor is not None:
                res = self._residual.get(k)
                if res is None:
                    res = self._residual[k] = np.zeros(info.size, np.float32)
                flat = data.reshape(-1)
                pieces = []
                for seg in info.segments:
                    s, e = (seg.start, seg.stop) if len(info.segments) > 1 else (0, info.size)
                    pieces.append(self.compressor.compress(flat[s:e], res[s:e]))
            for seg, part in zip(info.segments, pieces):
                pk, kinds, arrays = per.setdefault(seg.server, ([], [], []))
                pk.append(info.pskey)
                kinds.append("c" if self.compressor is not None else "d")
                arrays.append(part)
        return {s: (pk, "".join(kinds), arrays) for s, (pk, kinds, arrays) in per.items()}

    def send(self, items: Items | None, lend: bool = False) -> None:
        """Send the push messages ``items`` (no reply is awaited). ``lend``: they are what
        :meth:`items` just made, and its lendable buffers may be kept without a copy."""
        lendable, self._lendable = self._lendable if lend else {}, {}
        for server, (pk, kinds, arrays) in (items or {}).items():
            lenders = [self._lender(lendable, a) for a in arrays] if lendable else None
            self._kv.push(server, Command.PUSH, pk, {"kinds": kinds}, arrays, lenders)

    @staticmethod
    def _lender(lendable: dict[int, tuple[SendBuffer, np.ndarray]], a: np.ndarray) \
            -> SendBuffer | None:
        """The send buffer that lends ``a`` (itself, or a view of it), or None."""
        base = a if a.base is None else a.base
        hit = lendable.get(id(base))
        return hit[0] if hit is not None and hit[1] is base else None

    # ---- pull ------------------------------------------------------------------------------
    def fetch(self, keys: list[Key], cmd: Command = Command.PULL, push: Items | None = None,
              targets: dict[Key, np.ndarray] | None = None) -> dict[Key, list[np.ndarray]]:
        """Each key's segments as the servers hold them now (after this worker's pushes);
        with ``push``, that push goes in the same messages (``cmd`` PUSHPULL).

        ``targets``: an array per key that the reply may be read straight into (then the
        returned parts are views of it).
        """
        per: dict[int, list[int]] = {}
        into: dict[int, list[np.ndarray | None]] = {}
        for k in keys:
            info = self._records[k]
            t = targets.get(k) if targets else None
            flat = t.reshape(-1) if t is not None and len(info.segments) > 1 else None
            for seg in info.segments:
                per.setdefault(seg.server, []).append(info.pskey)
                into.setdefault(seg.server, []).append(
                    None if t is None else t if flat is None else flat[seg.start:seg.stop])
        try:
            if push is not None:
                tss = {s: self._kv.request(s, cmd, pk, {"kinds": kinds}, arrays,
                                           into=into.get(s))
                       for s, (pk, kinds, arrays) in push.items()}
            else:
                tss = {s: self._kv.request(s, cmd, pk, into=into[s]) for s, pk in per.items()}
            replies = dict(zip(tss, self._wait_all(list(tss.values()), "a pull reply")))
        finally:
            if push is not None:     # failover may have kept the pushes' arrays, not copies
                self._kv.settle()
        got: dict[int, Iterator[np.ndarray]] = {}
        for s, (_meta, arrays) in replies.items():
            if len(arrays) != len(per[s]):
                raise ClusterError(f"server {s} answered {len(arrays)} arrays for "
                                   f"{len(per[s])} keys (reported by server {s})")
            got[s] = iter(arrays)    # in the order of per[s]: each key's segments in turn
        out: dict[Key, list[np.ndarray]] = {}
        for k in keys:
            info = self._records[k]
            out[k] = [next(got[seg.server]) for seg in info.segments]
        return out

    def targets(self, keys: list[Key], groups: list[list[Any]],
                only: set[Key] | None = None) -> dict[Key, np.ndarray]:
        """Per key (of ``only``, if given), an out the reply can be read straight into."""
        targets = {}
        for k, outs in zip(keys, groups):
            if only is None or k in only:
                t = target(self._records[k], outs)
                if t is not None:
                    targets[k] = t
        return targets

    def rows(self, reqs: list[tuple[Key, RowSparseNDArray, np.ndarray]]) -> None:
        """Fill each ``(key, out, row ids)`` of ``reqs`` with those rows from the servers."""
        per = rows_by_server([(self._records[k], r) for k, _o, r in reqs])
        tss = {s: self._kv.request(s, Command.RSP_PULL, pk, None, arrays)
               for s, (pk, arrays, _) in per.items()}
        replies = dict(zip(tss, self._wait_all(list(tss.values()), "row_sparse_pull")))
        datas = [np.empty((len(r),) + self._records[k].shape[1:], o.dtype)
                 for k, o, r in reqs]
        for s, (_, _, where) in per.items():
            for (i, lo), part in zip(where, replies[s][1]):
                datas[i][lo:lo + len(part)] = part
        for (_k, o, r), data in zip(reqs, datas):
            o._data, o._indices = data, r
