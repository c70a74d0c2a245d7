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
from typing import Any, Callable

import numpy as np

from ...errors import ClusterError, KeyTypeError, UnsupportedError, ValueTypeError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._ps.collective.core import Collective
from ..._ps.config import ClusterConfig
from ..._ps.postoffice import Postoffice
from ..._types import Key
from .._args import as_numpy
from .._keys import KeyRecord
from ._placement import target

__all__ = ["Choice", "PeerSums", "key_list"]


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


class PeerSums:
    """A dist store's collective path, as one of its parts: the keys chosen at init (by
    :class:`Choice`, here as :attr:`choice`), the worker links (:attr:`path`, made at the
    first init that puts a key on it), and the pulls that read it. The store calls in with
    its lock held; what this part needs of the store is given at construction."""

    def __init__(self, store_type: str, cfg: ClusterConfig, po: Postoffice,
                 records: dict[Key, KeyRecord], owns_table: Callable[[Key], bool],
                 unlocked: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._type, self._cfg, self._po = store_type, cfg, po
        self._store, self._owns_table, self._unlocked = records, owns_table, unlocked
        #: which keys take the path (the same rule on every worker)
        self.choice = Choice(store_type, cfg, po.num_workers)
        #: the workers' links and sums; None until a key takes the path
        self.path: Collective | None = None
        #: rounds of a key pushed on the path when a checkpoint was loaded: until it is
        #: pushed again its value is the servers' (the loaded one)
        self._loaded_at: dict[int, int] = {}

    def keys_of(self, keys: list[Key], groups: list[list[Any]],
                specs: list[Any]) -> list[int]:
        """The ps_keys of this init that take the collective path (sorted)."""
        out = []
        for k, vals, spec in zip(keys, groups, specs):
            v = vals[0] if isinstance(vals[0], NDArray) else as_numpy(vals[0])
            sparse = isinstance(v, RowSparseNDArray)
            nbytes = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
            if self.choice.decide(k, sparse, nbytes):
                out.append(int(spec[0]))
        return sorted(out)

    def endpoint(self) -> dict[str, str] | None:
        """What the other workers need to link to this one (the init barrier carries it),
        or None when the links are made already."""
        if self.path is not None and self.path.connected:
            return None
        if self.path is None:
            po = self._po
            self.path = Collective(self._cfg, po.rank, po.num_workers, po.job, po.check,
                                   lambda rank: po.report_lost("worker", rank))
        return self.path.listen()

    def check_agreement(self, payloads: dict[str, dict[str, Any]], mine: list[int]) -> None:
        """Raise on every worker unless all put the same keys of this init on the path."""
        for r, p in sorted(payloads.items(), key=lambda rp: int(rp[0])):
            theirs = sorted((p or {}).get("collective") or [])
            if theirs != mine:
                diff = sorted(set(theirs) ^ set(mine))
                name = _key_of_pskey(diff[0], payloads)
                raise ClusterError(
                    f"workers disagree on the collective path: key {name!r} takes it on "
                    f"worker {self._po.rank if diff[0] in mine else r} and not on worker "
                    f"{r if diff[0] in mine else self._po.rank}. Give every worker the same "
                    "PSKV_COLLECTIVE_BYTES and the same set_collective, set_optimizer and "
                    "set_gradient_compression calls before init.", key=name,
                    store_type=self._type)

    def link(self, payloads: dict[str, dict[str, Any]], recs: dict[Key, KeyRecord],
             coll: set[int]) -> None:
        """Link to the other workers (the first time) and take this init's keys."""
        path = self.path
        assert path is not None         # endpoint() made it for this init's barrier
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

    def pushed(self, key: Key) -> bool:
        """Whether a pull of ``key`` reads the collective path (it was pushed there; until
        then the servers hold its initial value)."""
        rec = self._store[key]
        return rec.collective and self.path is not None and \
            self.path.pushed(rec.pskey) > self._loaded_at.get(rec.pskey, 0)

    def loaded(self) -> None:
        """A checkpoint was loaded onto the servers: every key reads it there until its
        next push (``load_checkpoint``)."""
        if self.path is not None:
            for rec in self._store.values():
                if rec.collective:
                    self._loaded_at[rec.pskey] = self.path.pushed(rec.pskey)

    def held_parts(self) -> dict[int, tuple[list[int], list[np.ndarray]]]:
        """The value of every key pushed on the path, cut as the servers hold its parts:
        ``{server: (ps_keys, parts)}`` (what ``save_checkpoint`` writes in their place)."""
        keys = [k for k in self._store if self.pushed(k)]
        out: dict[int, tuple[list[int], list[np.ndarray]]] = {}
        if not keys:
            return out
        for k, parts in self.fetch(keys, [[] for _ in keys]).items():
            rec = self._store[k]
            for seg, part in zip(rec.segments, parts):
                mine = out.setdefault(seg.server, ([], []))
                mine[0].append(rec.pskey)
                mine[1].append(np.ascontiguousarray(part).reshape(-1))
        return out

    def fetch(self, keys: list[Key], groups: list[list[Any]]) -> dict[Key, list[np.ndarray]]:
        """Each key's last round from the collective path, as ``DataPath.fetch`` gives
        the servers' (read straight into an out where one fits)."""
        assert self.path is not None
        out: dict[Key, list[np.ndarray]] = {}
        for k, outs in zip(keys, groups):
            rec = self._store[k]
            t = target(rec, outs)
            if t is None:
                t = np.empty(rec.shape, rec.dtype)
            flat = t.reshape(-1)
            with self._unlocked():
                self.path.pull(rec.pskey, flat)
            out[k] = [t] if len(rec.segments) == 1 else \
                [flat[seg.start:seg.stop] for seg in rec.segments]
        return out

    def prefer(self, keys: list[Key], enabled: bool) -> None:
        """``kv.set_collective``: refused for a table key or one initialized already."""
        for k in keys:
            rec = self._store.get(k)
            if self._owns_table(k):
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
        self.choice.prefer(keys, enabled)

    def prefer_softly(self, keys: list[Key]) -> None:
        """Let ``keys`` (not initialized yet) take the path where this store allows it,
        and stay on the servers quietly where it does not; a key given to
        ``set_collective`` keeps that choice."""
        self.choice.soft.update(k for k in keys if k not in self.choice.prefs)

    def close(self) -> None:
        """Close the links (bounded by the request timeout, at most 10 s)."""
        if self.path is not None:
            self.path.close(min(self._cfg.request_timeout, 10.0))


def _key_of_pskey(pskey: int, payloads: dict[str, dict[str, Any]]) -> Any:
    for p in payloads.values():
        for spec in (p or {}).get("specs") or []:
            if spec[0] == pskey:
                return spec[1]
    return pskey
