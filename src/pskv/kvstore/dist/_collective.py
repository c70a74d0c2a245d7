"""Which keys of a dist store take the collective path (docs/collective.md).

One rule, decided at a key's ``init`` and the same on every worker (the init barrier
compares the choices): a key is summed among the workers (``_ps/collective/core.py``) when the
store is ``dist_sync`` with at least two workers, the key is dense, no optimizer runs on the
servers, no gradient compression is set, no server feature needs every round on the
servers (``PSKV_REPLICAS``, periodic checkpoints, ``--max-restarts``), the links are not
sealed (``PSKV_ENCRYPT``), and either its bytes
reach ``PSKV_COLLECTIVE_BYTES`` (0: none does) or ``kv.set_collective(key, True)`` asked for
it before its init; ``set_collective(key, False)`` keeps it on the servers whatever its
size. Everything else stays on the servers: small keys, row_sparse keys, tables,
``dist_async``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import numpy as np

from ...errors import ClusterError, KeyTypeError, UnsupportedError, ValueTypeError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._ps.collective.core import Collective
from ..._ps.config import ClusterConfig
from ..._ps.postoffice import Postoffice
from ..._types import Key, KeyArg
from .._args import as_numpy
from .._keys import KeyRecord
from ._placement import target

__all__ = ["Choice", "CollectiveMethods", "key_list"]


def key_list(key: Any) -> list[Key]:
    """``key`` (one key or a list of them) as a list, each checked to be an int or a str."""
    keys = list(key) if isinstance(key, (list, tuple)) else [key]
    for k in keys:
        if type(k) is not int and type(k) is not str:
            raise KeyTypeError(f"set_collective takes int or str keys (or a list of them), "
                               f"got {k!r} of type {type(k).__name__}.", key=None)
    return keys


class Choice:
    """A dist store's collective choices: the store-wide conditions and the per-key ones."""

    def __init__(self, store_type: str, cfg: ClusterConfig, num_workers: int) -> None:
        self.store_type = store_type
        self.threshold = cfg.collective_bytes
        self.prefs: dict[Key, bool] = {}
        #: keys that take the path where the store allows it, else stay on the servers
        #: quietly (pskv.torch's gradient buckets); an explicit set_collective wins
        self.soft: set[Key] = set()
        #: set by set_optimizer: keys initialized from then on stay on the servers
        self.optimizer = False
        self.compression = False
        self._fixed = None
        if "async" in store_type:
            self._fixed = (f"a {store_type!r} store applies each push on the servers as it "
                           "comes; the collective path sums dist_sync rounds")
        elif num_workers < 2:
            self._fixed = "one worker has nothing to exchange"
        elif cfg.encrypt:
            self._fixed = ("PSKV_ENCRYPT=1 seals the links to the servers, and the workers' "
                           "own links are not sealed per message")
        elif cfg.replicas or cfg.checkpoint_every or cfg.max_restarts:
            self._fixed = ("PSKV_REPLICAS, periodic checkpoints and --max-restarts need every "
                           "round on the servers")

    def off(self) -> str | None:
        """Why no key of this store can take the path now, or None."""
        if self._fixed is not None:
            return self._fixed
        if self.optimizer:
            return ("the store has an optimizer (set_optimizer): the servers update the "
                    "weights, so the pushes must reach them")
        if self.compression:
            return "gradient compression is set: the servers decompress the pushes"
        return None

    def prefer(self, keys: list[Key], enabled: Any) -> None:
        """Record ``set_collective(keys, enabled)`` (keys checked by the store)."""
        if type(enabled) is not bool:
            raise ValueTypeError(f"set_collective(key, enabled): enabled must be True or "
                                 f"False, got {enabled!r}.")
        if enabled and self._fixed is not None:
            raise UnsupportedError(f"set_collective({keys[0]!r}, True): {self._fixed}. Leave "
                                   "the key on the servers.", key=keys[0],
                                   store_type=self.store_type)
        for k in keys:
            self.prefs[k] = enabled

    def decide(self, key: Key, sparse: bool, nbytes: int) -> bool:
        """Whether ``key`` (being initialized) takes the collective path; raises
        UnsupportedError where ``set_collective(key, True)`` cannot be honoured."""
        pref = self.prefs.get(key)
        if pref is False:
            return False
        why = self.off()
        if why is None and sparse:
            why = "it is row_sparse: the collective path sums dense keys"
        if pref:
            if why is not None:
                raise UnsupportedError(
                    f"key {key!r} was set to take the collective path "
                    f"(set_collective), but {why}. Call set_collective({key!r}, False), "
                    "or init the key before set_optimizer / set_gradient_compression.",
                    key=key, store_type=self.store_type)
            return True
        if key in self.soft:
            return why is None
        return why is None and self.threshold > 0 and nbytes >= self.threshold


class CollectiveMethods:
    """A dist store's collective path: choosing keys at init, linking the workers, and the
    pushes and pulls of those keys (``DistKVStore`` mixes it in; it owns the attributes
    declared here)."""

    _type: str
    _cfg: ClusterConfig
    _po: Postoffice
    _lock: threading.Lock
    _store: dict[Key, KeyRecord]
    _choice: Choice
    _coll: Collective | None
    _tables: Any
    _unlocked: Callable[[], contextlib.AbstractContextManager[None]]
    _begin: Callable[..., None]

    def _collective_keys(self, keys: list[Key], groups: list[list[Any]],
                         specs: list[Any]) -> list[int]:
        """The ps_keys of this init that take the collective path (sorted)."""
        out = []
        for k, vals, spec in zip(keys, groups, specs):
            v = vals[0] if isinstance(vals[0], NDArray) else as_numpy(vals[0])
            sparse = isinstance(v, RowSparseNDArray)
            nbytes = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
            if self._choice.decide(k, sparse, nbytes):
                out.append(int(spec[0]))
        return sorted(out)

    def _collective_path(self) -> Collective:
        if self._coll is None:
            po = self._po
            self._coll = Collective(self._cfg, po.rank, po.num_workers, po.job, po.check,
                                    lambda rank: po.report_lost("worker", rank))
        return self._coll

    def _check_collective_agreement(self, payloads: dict[str, dict[str, Any]],
                                    mine: list[int]) -> None:
        """Raise on every worker unless all put the same keys of this init on the path."""
        for r, p in sorted(payloads.items(), key=lambda rp: int(rp[0])):
            theirs = sorted((p or {}).get("collective") or [])
            if theirs != mine:
                diff = sorted(set(theirs) ^ set(mine))
                name = self._key_of_pskey(diff[0], payloads)
                raise ClusterError(
                    f"workers disagree on the collective path: key {name!r} takes it on "
                    f"worker {self._po.rank if diff[0] in mine else r} and not on worker "
                    f"{r if diff[0] in mine else self._po.rank}. Give every worker the same "
                    "PSKV_COLLECTIVE_BYTES and the same set_collective, set_optimizer and "
                    "set_gradient_compression calls before init.", key=name,
                    store_type=self._type)

    @staticmethod
    def _key_of_pskey(pskey: int, payloads: dict[str, dict[str, Any]]) -> Any:
        for p in payloads.values():
            for spec in (p or {}).get("specs") or []:
                if spec[0] == pskey:
                    return spec[1]
        return pskey

    def _link_collective(self, payloads: dict[str, dict[str, Any]],
                         recs: dict[Key, KeyRecord], coll: set[int]) -> None:
        """Link to the other workers (the first time) and take this init's keys."""
        path = self._collective_path()
        for k, rec in recs.items():
            if rec.pskey in coll:
                path.add_key(k, rec.pskey, rec.size, rec.dtype)
        try:
            if not path.connected:
                peers = {int(r): p.get("peer") for r, p in payloads.items()
                         if int(r) != self._po.rank and p}
                path.connect(peers)   # type: ignore[arg-type]
        except BaseException:
            for pk in coll:
                path.drop_key(pk)
            raise
        for rec in recs.values():
            rec.collective = rec.pskey in coll

    def _from_peers(self, key: Key) -> bool:
        """Whether a pull of ``key`` reads the collective path (it was pushed there; until
        then the servers hold its initial value)."""
        rec = self._store[key]
        return rec.collective and self._coll is not None and \
            self._coll.pushed(rec.pskey) > 0

    def _fetch_collective(self, keys: list[Key], groups: list[list[Any]]) \
            -> dict[Key, list[np.ndarray]]:
        """Each key's last round from the collective path, as ``DataPath.fetch`` gives
        the servers' (read straight into an out where one fits)."""
        assert self._coll is not None
        out: dict[Key, list[np.ndarray]] = {}
        for k, outs in zip(keys, groups):
            rec = self._store[k]
            t = target(rec, outs)
            if t is None:
                t = np.empty(rec.shape, rec.dtype)
            flat = t.reshape(-1)
            with self._unlocked():
                self._coll.pull(rec.pskey, flat)
            out[k] = [t] if len(rec.segments) == 1 else \
                [flat[seg.start:seg.stop] for seg in rec.segments]
        return out

    def set_collective(self, key: KeyArg, enabled: bool = True) -> None:
        """Choose the collective path for ``key`` (True) or the servers (False), whatever
        its size; call it on every worker, before ``init`` of the key.

        On the collective path a ``dist_sync`` key's pushes are summed among the workers
        themselves, chunk by chunk, each chunk by one worker in worker-rank order, so the
        round's value is the same bits as the servers' (docs/collective.md). Without a call,
        dense keys of at least ``PSKV_COLLECTIVE_BYTES`` bytes take it (0, the default: none).

        Parameters
        ----------
        key : int, str, or list of them
        enabled : bool

        Raises
        ------
        UnsupportedError
            ``enabled`` for a ``dist_async`` store or a single worker, or for a key already
            initialized (a row_sparse or table key stays on the servers; a dense one must be
            chosen before its init).
        """
        keys = key_list(key)
        with self._lock:
            self._begin()
            for k in keys:
                rec = self._store.get(k)
                if self._tables.owns(k):
                    raise UnsupportedError(
                        f"set_collective({k!r}): {k!r} is a table key, which stays on the "
                        "servers (the collective path sums dense keys).", key=k,
                        store_type=self._type)
                if rec is not None:
                    where = "on the collective path" if rec.collective else "on the servers"
                    raise UnsupportedError(
                        f"set_collective({k!r}): key {k!r} is initialized already"
                        + (" and row_sparse, which stays on the servers (the collective "
                           "path sums dense keys)." if rec.sparse else
                           f" ({where}). Call set_collective before kv.init of the key, on "
                           "every worker."),
                        key=k, store_type=self._type)
            self._choice.prefer(keys, enabled)

    def _prefer_collective(self, keys: list[Key]) -> None:
        """Let ``keys`` (not initialized yet) take the collective path where this store
        allows it, and stay on the servers quietly where it does not; a key given to
        ``set_collective`` keeps that choice. For keys whose value nobody reads from the
        servers (pskv.torch's gradient buckets); the same on every worker."""
        with self._lock:
            self._choice.soft.update(k for k in keys if k not in self._choice.prefs)

