"""DistKVStore: the worker side of ``dist_sync``, ``dist_async`` and ``dist_device_sync``.

A sibling of LocalKVStore under KVStoreBase: it shares the argument normaliser
(:mod:`._args`) and the per-key records and checks (:class:`._keys.KeyTable`), and talks to
the servers through a :class:`.._ps.worker.KVWorker`. A push reduces the local devices'
values, compresses if asked, cuts each key into its segments and sends one message per
server; a pull sends one message per server and lands the replies in the outs. Invariants:
``init`` is collective (every worker calls it with the same keys; shapes are checked across
workers at a barrier, rank 0 sends the values, a second barrier publishes them); every
worker computes the same placement because init calls are collective and keys are placed in
ps_key order; a failed call on one worker fails on every worker instead of hanging.

The store is a small core (:class:`._core.WorkerCore`: its links, locks, call checks and
barriers) and parts given that core at construction, each in its own module: the data
path (``_datapath``), the collective path (``PeerSums``), the staleness bounds
(``Bounds``), uneven data (``Joining``), checkpoints (``Checkpoints``) and tables
(``DistTables``; the table calls shared with LocalKVStore are ``_tables.TableMethods``).

Over 500 lines because DistKVStore implements the whole typed API (docs/api.md), each
public method with its docstring, over those parts.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from typing import Any, Iterator, overload

import numpy as np
import zmq

from ... import compression
from ...errors import ClusterError, KVStoreError, UnsupportedError, ValueTypeError
from ...nd.ndarray import NDArray
from ...nd.sparse import RowSparseNDArray
from ..._ps.bounds import check_declared, check_key_count
from ..._ps.config import ClusterConfig
from ..._ps.message import ALLOWED_DTYPES, Command
from ..._ps.ops import Op, command
from ..._ps.partition import place, ps_key
from ..._ps.postoffice import Postoffice
from ..._ps.zeromq import ZmqContext
from ..._ps.worker import KVWorker
from ..._types import Array, Key, KeyArg, KeyList, OutArg, Updater, ValueArg
from ...table import TableSpec
from .._args import as_numpy, normalize, row_ids_by_key
from ._collective import PeerSums, key_list
from ._checkpoints import Checkpoints
from ._join import Joining
from ._tables import DistTables, init_table
from ._datapath import DataPath
from .._device_io import DeviceIO, Staged, has_device
from ._held import HeldPush
from .._keys import KeyRecord, KeyTable
from .._reduce import Reducer
from ._staleness import Bounds
from ._core import WorkerCore
from ..._ps.config import staleness_bounds
from ._agree import check_agreement, init_spec
from ._placement import assemble, parts
from .._states import read_states, write_states
from .._tables import TableMethods
from .._gradkeys import GradientKeys
from ..base import KVStoreBase, check_capability, check_optimizer

__all__ = ["DistKVStore"]

log = logging.getLogger(__name__)


class DistKVStore(TableMethods, KVStoreBase):
    """A worker's handle on a parameter-server cluster (``dist_*`` store types).

    Create it with ``pskv.kv.create('dist_sync')`` in a process started by ``pskv-launch``
    (or with the DMLC_* variables set by hand).
    """

    _tables: DistTables

    def __init__(self, name: str, cfg: ClusterConfig,
                 zmq_context: zmq.Context[Any] | None = None) -> None:
        self._type = name
        self._keys = KeyTable(name)
        #: key -> its record (shape, dtype, placement); the tests read the placement here
        self._store: dict[Key, KeyRecord] = self._keys.records
        self._reducer = Reducer()     # PSKV_REDUCE_THREADS, read by the config module
        # held while a call checks its arguments and sends, never while it waits for a
        # reply or a barrier (_unlocked): other threads may push and pull meanwhile
        self._lock = threading.Lock()
        self._collective_lock = threading.Lock()   # init, barrier: one at a time
        self._cfg = cfg
        self._sync = "async" not in name
        env_default = staleness_bounds(os.environ, name)      # refused before joining the job
        self._zctx = ZmqContext(zmq_context)
        po: Postoffice | None = None
        # held until the store is built: the control thread's idle hook (_send_overdue)
        # finds it taken and does nothing before then
        self._lock.acquire()
        try:
            # the scheduler refuses a job whose workers created different store types
            po = self._po = Postoffice(cfg, self._zctx, mode="sync" if self._sync else "async",
                                       idle_hook=self._send_overdue)
            self._po.start()
            self._kv = KVWorker(cfg, self._zctx, self._po)
        except BaseException:
            self._lock.release()
            if po is not None:
                po.close()          # its control thread first: then its sockets
            self._zctx.close()
            raise
        self._loads = [0] * self._po.num_servers
        #: CUDA values and outs: read into, and written from, pinned buffers (docs/gpu.md)
        self._device = DeviceIO(name)
        self._path = DataPath(self._store, self._kv, self._reducer, self._wait_all)
        #: table keys (docs/embeddings.md): rows on the servers, by a hash of the ID
        self._tables = DistTables(name, self._kv, self._po.num_servers, self._wait_all,
                                  lambda: self._reads.bounds[0], self._po.num_workers)
        metrics = self._kv.metrics
        if metrics is not None:     # PSKV_METRICS_PORT: the caches' series (C1)
            caches = self._tables.caches
            metrics.table_caches = lambda: {k: c.stats() for k, c in list(caches.items())}
        #: DistributedOptimizers' gradient keys, which no optimizer may touch
        self._gradient_keys = GradientKeys(name, lambda: None if self._tables.optimizer is None
                                           else "optimizer (kv.set_optimizer)")
        self._by_pskey: dict[int, Key] = {}
        self._held = HeldPush(cfg.coalesce_bytes if self._sync else 0)
        self._initial_sent = False
        #: which keys are summed among the workers (docs/collective.md), and the links
        #: what the parts share (docs/architecture.md, "the dist store")
        self._core = WorkerCore(name, cfg, self._po, self._kv, self._lock,
                                self._collective_lock, self._sync, self._begin, self._unlocked,
                                self._collective, self._wait_all)
        #: the collective path: its keys, the workers' links
        self._peers = PeerSums(name, cfg, self._po, self._store, self._tables.owns,
                               self._unlocked)
        #: the staleness bounds (kv.set_staleness) and what enforces them
        self._reads = Bounds(self._core)
        #: uneven data (kv.join)
        self._joining = Joining(self._core, self._peers)
        #: save_checkpoint, load_checkpoint (worker 0 carries them out)
        self._checkpoints = Checkpoints(self._core, self._store,
                                        lambda: list(self._tables.tables), self._peers)
        self._lock.release()
        # a strong reference: a store dropped without close() must still say goodbye at
        # exit, or the scheduler takes the silent worker for dead and exits 1
        self._atexit = self.close
        atexit.register(self._atexit)
        if env_default != (None, None):     # PSKV_STALENESS, PSKV_GLOBAL_STALENESS
            try:
                self.set_staleness(env_default[0], global_bound=env_default[1])
            except BaseException:
                self.close()
                raise

    @property
    def type(self) -> str:
        """The store type, as given to ``create`` and lower-cased."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank, 0 to ``num_workers - 1``."""
        return self._po.rank

    @property
    def num_workers(self) -> int:
        """The number of workers in the cluster."""
        return self._po.num_workers

    # ---- plumbing ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Release the store lock for a network wait (the caller holds it)."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _wait_all(self, tss: list[int], what: str) -> list[Any]:
        with self._unlocked():
            return self._kv.wait_all(tss, what)

    def _table_begin(self) -> None:
        """A table call's checks (``TableMethods``): as every call's."""
        self._begin()

    def _begin(self, pulling: bool = False) -> None:
        self._keys.check_open()
        self._po.check()
        self._kv.raise_deferred()
        if not pulling:
            self._send_held()

    def _send_held(self) -> None:
        """Send the push that waited for this call (it was not a pull of its keys)."""
        self._path.send(self._held.release())

    def _send_overdue(self) -> None:
        """On the control thread, when the store is idle: send a push held too long (rule 4
        of ``pskv.kvstore.dist._held``) and notice a server connection that broke; an error is
        raised by the store's next call."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._keys.closed:
                return
            if self._held.overdue():
                self._send_held()
            self._kv.poll_links()
        except KVStoreError as err:
            self._kv.defer(err)
        finally:
            self._lock.release()

    # ---- init ------------------------------------------------------------------------------
    def init(self, key: KeyArg, value: ValueArg) -> None:
        """Initialize keys on the servers: every worker calls it; rank 0's values are kept.

        Raises on every worker if any worker's keys, shapes or dtypes differ. A
        ``TableSpec`` (``pskv.table``) declares a table key on every server.
        """
        if isinstance(value, TableSpec):
            for k in (key if isinstance(key, (list, tuple)) else [key]):
                prefs = self._peers.choice.prefs
                if type(k) in (int, str) and prefs.get(k):  # type: ignore[arg-type]
                    raise UnsupportedError(
                        f"key {k!r} was set to take the collective path (set_collective), "
                        "but a table key stays on the servers. Call "
                        f"set_collective({k!r}, False) first.", key=k, store_type=self._type)
            return init_table(self, key, value)
        staged: list[Staged] = []
        try:
            self._init_keys(key, value, staged)
        finally:
            for st in staged:        # rank 0 has sent the values: the buffers are free
                st.release()

    def _init_keys(self, key: KeyArg, value: ValueArg, staged: list[Staged]) -> None:
        with self._collective_lock, self._lock:
            self._begin()
            self._tables.taken(key)
            keys: list[Key] = []
            groups: list[list[Any]] = []
            specs = None
            error: KVStoreError | None = None
            try:
                keys, given = normalize(key, value)
                groups, held = self._device.values(keys, given, self._store)
                if held is not None:
                    staged.append(held)
                self._keys.validate_init(keys, groups)
                self._check_bounds(keys, groups, "init")
                specs = [init_spec(k, vals[0], self._by_pskey) for k, vals in zip(keys, groups)]
                coll = self._peers.keys_of(keys, groups, specs)
            except KVStoreError as err:
                error = err
                coll = []
            if self._po.rejoin:
                # a worker restarted by --max-restarts: the keys are on the servers already,
                # and the other workers are past init; place them as the first run did
                if error is not None:
                    raise error
                assert specs is not None
                for i in sorted(range(len(keys)), key=lambda i: specs[i][0]):
                    self._by_pskey[self._keys.add(self._place(
                        keys[i], groups[i][0], given[i][0])).pskey] = keys[i]
                return
            extra: dict[str, Any] = {}
            if coll:
                extra = {"collective": coll}
                peer = self._peers.endpoint()
                if peer is not None:
                    extra["peer"] = peer
            payloads = self._collective("init", {
                "specs": specs, "error": None if error is None else
                f"{type(error).__name__}: {error}", **extra})
            if error is not None:
                raise error
            assert specs is not None
            check_agreement(payloads, specs, self.rank)
            self._peers.check_agreement(payloads, coll)
            order = sorted(range(len(keys)), key=lambda i: specs[i][0])
            recs = {keys[i]: self._place(keys[i], groups[i][0], given[i][0]) for i in order}
            if self.rank == 0:
                self._send_init(keys, groups, recs)
            if coll:
                # before the second barrier: no worker pushes a key another has not taken
                self._peers.link(payloads, recs, set(coll))
            self._collective("init (values sent)")
            for k in keys:
                self._by_pskey[self._keys.add(recs[k]).pskey] = k

    def join(self, timeout: float | None = None) -> int:
        """Leave the job's rounds: this worker has no more data (uneven data).

        Every worker calls it once it has made its last push. Until every worker has
        joined, the others' ``dist_sync`` rounds complete without this worker, which
        counts as having pushed zeros: a round's sum is the sum of the other workers'
        pushes, and the divisor (``rescale_grad``) is unchanged (DDP's default under
        ``Join``). This worker may pull meanwhile, not push. Once every worker has joined
        the rounds count every worker again (the next epoch of data may follow).

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for the other workers to join (default
            ``PSKV_JOIN_TIMEOUT``, 3600).

        Returns
        -------
        int
            The rank of the last worker to join (as ``hvd.join()``).

        Raises
        ------
        ClusterTimeoutError
            Some worker did not join within ``timeout`` (the message names it).
        WorkerClosedError
            A worker closed its store without joining: it never will.
        """
        # rounds close without this worker's pushes meanwhile: no cached row is served
        self._tables.joining = True
        try:
            return self._joining.join(timeout)
        finally:
            with self._lock:
                self._tables.joining = False
                self._tables.clear_caches()

    def save_checkpoint(self, path: str) -> None:
        """Every server writes its shard to the directory ``path``; rank 0 the manifest.

        Collective: every worker calls it at the same point. Each worker's pushes made
        before it are applied first, so the checkpoint holds whole rounds. Each server
        pauses for one in-memory copy of its shard and writes it on a thread, all servers in
        parallel; the call returns once every shard is on disk. ``path`` must be a
        directory every server can write (a shared file system across hosts).
        """
        self._checkpoints.save(path)

    def load_checkpoint(self, path: str) -> None:
        """Set every key from the checkpoint in ``path``, written by any number of servers
        (or by a local store): values, optimizer states (and optimizer), rounds.

        Collective. The workers must have initialized exactly the checkpoint's keys with
        the same shapes and dtypes; call ``set_optimizer`` before loading, not after (a
        saved optimizer replaces it). Raises CheckpointError on every worker otherwise.
        """
        self._checkpoints.load(path)
        with self._lock:
            self._tables.clear_caches()     # the rows changed under the caches (C7)

    def set_staleness(self, bound: int | None, *, global_bound: int | None = None) -> None:
        """Bound how stale the values this worker reads may be (collective: every worker
        calls it, as it calls ``init``).

        In ``dist_async``: a pull, row_sparse_pull or lookup starts only when at most
        ``bound`` of this worker's earlier push calls are unacknowledged (0: it reads its
        own writes), and, with ``global_bound``, a pull, row_sparse_pull or training lookup
        of a worker more than ``global_bound`` push calls ahead of the slowest live worker
        waits on the servers (SSP); a worker that closes its store leaves the bound, and a
        wait for a stuck or lost worker fails naming it. ``dist_sync`` already keeps every
        worker in one round, so any bound holds there: it is checked and recorded only.
        Setting it again (or to None: no bound) mid-job is safe: the clocks restart at 0.

        Parameters
        ----------
        bound : int or None
            Unacknowledged push calls a read may run ahead of; None: no per-worker bound.
        global_bound : int or None, keyword-only
            Push calls the fastest live worker may be ahead of the slowest; None: none.

        Raises
        ------
        StalenessError
            On every worker, when any worker's bound is not a whole number of at least 0
            or the workers' ``global_bound`` differ; nothing is changed.
        """
        self._reads.set(bound, global_bound)

    def _before_lookup(self) -> None:
        """A lookup is a bounded read (``TableMethods.lookup``)."""
        self._reads.before_read()

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
            self._peers.prefer(keys, enabled)

    def _prefer_collective(self, keys: list[Key]) -> None:
        """Let ``keys`` (not initialized yet) take the collective path where this store
        allows it, and stay on the servers quietly where it does not; a key given to
        ``set_collective`` keeps that choice. For keys whose value nobody reads from the
        servers (pskv.torch's gradient buckets); the same on every worker."""
        with self._lock:
            self._peers.prefer_softly(keys)

    def _check_bounds(self, keys: list[Key], groups: list[list[Any]], what: str) -> None:
        """Refuse here what the servers would refuse (sizes: ``_ps/bounds.py``; an init's
        dtype: the wire's), on every worker for an init, so that no server takes part of a
        call another refuses (docs/security.md, all-or-nothing calls)."""
        where = f"worker {self.rank}"
        check_key_count(len(keys), self._cfg.max_keys_per_message, what, where)
        if what == "init":
            for k, vals in zip(keys, groups):
                v = vals[0] if isinstance(vals[0], NDArray) else as_numpy(vals[0])
                dtype = np.dtype(v.dtype)
                if dtype.name not in ALLOWED_DTYPES:   # a server would drop the connection
                    raise ValueTypeError(
                        f"init of key {k!r}: dtype {dtype} cannot be sent to a server; a "
                        f"{self._type!r} store holds {', '.join(sorted(ALLOWED_DTYPES))}. "
                        "Cast the value first (e.g. value.astype('float32')).", key=k,
                        store_type=self._type)
                check_declared(k, tuple(v.shape), dtype.itemsize,
                               isinstance(v, RowSparseNDArray), self._cfg.max_key_bytes, where)

    def _collective(self, call: str, payload: dict[str, Any] | None = None) \
            -> dict[str, dict[str, Any]]:
        """A barrier of the workers that also checks they all made the same ``call``."""
        if self._kv.seals is not None:      # the others' rounds may wait for this seal
            self._send_held()
            with self._unlocked():
                self._kv.seals.seal()
        with self._unlocked():
            payloads: dict[str, dict[str, Any]] = self._po.barrier(
                "worker", {"call": call, **(payload or {})})
        calls = {r: (p or {}).get("call") for r, p in payloads.items()}
        if len(set(calls.values())) > 1:
            met = ", ".join(f"worker {r} called {c}" for r, c in
                            sorted(calls.items(), key=lambda rc: int(rc[0])))
            raise ClusterError(
                f"mismatched collective calls met at a barrier: {met}. Every worker must make "
                "the same sequence of init, barrier and broadcast calls.",
                store_type=self._type)
        return payloads

    def _place(self, key: Key, value: Any, given: Any = None) -> KeyRecord:
        """``key``'s record, with its ps_key and segments (not added yet); ``given``: the
        caller's value when ``value`` is its host copy."""
        rec = self._keys.make(key, value, given)
        size, dtype, shape = rec.size, rec.dtype, rec.shape
        if rec.sparse:
            row = size // shape[0] if shape[0] else 0
            rec.segments = place(shape[0], row * dtype.itemsize, self._po.num_servers,
                                 self._cfg.bigarray_bound, row, self._loads, split_always=True)
        else:
            rec.segments = place(size, dtype.itemsize, self._po.num_servers,
                                 self._cfg.bigarray_bound, 1, self._loads)
        rec.pskey = ps_key(key)
        return rec

    def _send_init(self, keys: list[Key], groups: list[list[Any]],
                   infos: dict[Key, KeyRecord]) -> None:
        per: dict[int, tuple[list[int], list[Any], list[np.ndarray]]] = {}
        for k, vals in zip(keys, groups):
            info = infos[k]
            v = vals[0]
            dense = np.ascontiguousarray(v._dense() if isinstance(v, NDArray) else as_numpy(v))
            for seg, part in zip(info.segments, parts(info, dense)):
                pk, specs, arrays = per.setdefault(seg.server, ([], [], []))
                pk.append(info.pskey)
                specs.append({"key": k, "shape": list(part.shape),
                              "stype": "row_sparse" if info.sparse else "default",
                              "place": [seg.start, seg.stop, list(info.shape)]})
                arrays.append(np.ascontiguousarray(part).reshape(part.shape))  # keeps 0-d
        tss = [self._kv.request(s, Command.INIT, pk, {"entries": sp}, arr)
               for s, (pk, sp, arr) in per.items()]
        self._wait_all(tss, "the servers to take init")

    # ---- push --------------------------------------------------------------------------------
    def push(self, key: KeyArg, value: ValueArg, priority: int = 0) -> None:
        """Push values to the servers (summed per key first, then per round there).

        In ``dist_sync`` a small push may wait for this store's next call
        (``pskv.kvstore.dist._held`` has the rule).
        """
        with self._lock:
            self._begin()
            if self._tables.owns(key):
                self._first_push()
                self._tables.push(key, value, None)
            else:
                keys, groups = normalize(key, value)
                if has_device(groups):
                    self._device.run(keys, groups, None, None, self._store,
                                     lambda g, _: self._push_checked(keys, g),
                                     self._path.compressor is not None)
                else:
                    self._push_checked(keys, groups)
            stale = self._reads.stale
            if stale is not None:
                stale.pushed()

    def _push_checked(self, keys: list[Key], groups: list[list[Any]]) -> None:
        self._check_bounds(keys, groups, "push")
        self._keys.validate_push(keys, groups, self._path.compressor is not None)
        self._push_validated(keys, groups)

    def _first_push(self) -> None:
        """Before worker 0's first push, with periodic checkpoints: the initial values as
        the checkpoint of round 0 (docs/durability.md); no round can close before it,
        since every round needs this worker's push."""
        self._joining.check_not_joined()
        if not self._initial_sent:
            self._initial_sent = True
            if self.rank == 0 and self._cfg.checkpoint_every:
                self._core.to_servers(command(Op.INITIAL), wait=True)

    def _push_validated(self, keys: list[Key], groups: list[list[Any]]) -> None:
        self._first_push()      # _begin() has sent a held push already
        if self._peers.path is not None:
            peers = [i for i, k in enumerate(keys) if self._store[k].collective]
            if peers:
                rest = [i for i in range(len(keys)) if i not in set(peers)]
                if rest:
                    self._push_validated([keys[i] for i in rest], [groups[i] for i in rest])
                for i in peers:
                    rec = self._store[keys[i]]
                    flat = self._path.merged(keys[i], groups[i]).reshape(-1)
                    with self._unlocked():
                        self._peers.path.push(rec.pskey, flat)
                return
        items = self._path.items(keys, groups)
        if not self._held.hold(keys, items):
            self._path.send(items, lend=True)

    # ---- pull --------------------------------------------------------------------------------
    def _pull_validated(self, keys: list[Key], groups: list[list[Any]],
                        ignore_sparse: bool, fetched: dict[Key, list[np.ndarray]]
                        | None = None) -> None:
        if fetched is None and self._peers.path is not None:
            peers = [i for i, k in enumerate(keys) if self._peers.pushed(k)]
            if peers:
                rest = [i for i in range(len(keys)) if i not in set(peers)]
                if rest:
                    self._pull_validated([keys[i] for i in rest], [groups[i] for i in rest],
                                         ignore_sparse)
                keys, groups = [keys[i] for i in peers], [groups[i] for i in peers]
                fetched = self._peers.fetch(keys, groups)
        wanted = [k for k, outs in zip(keys, groups)
                  if any(not (ignore_sparse and isinstance(o, RowSparseNDArray)) for o in outs)]
        if fetched is None and self._held:
            held = self._held.take_for_pull(keys) if wanted == keys else None
            if held is not None:         # the push this pull follows: together
                fetched = self._path.fetch(keys, Command.PUSHPULL, held, self._path.targets(keys, groups))
            else:
                self._send_held()
        if fetched is None:
            fetched = self._path.fetch(wanted, targets=self._path.targets(keys, groups, set(wanted))) \
                if wanted else {}
        parts = fetched
        for k, outs in zip(keys, groups):
            info = self._store[k]
            for o in outs:
                if isinstance(o, RowSparseNDArray):
                    if ignore_sparse:
                        self._keys.warn_sparse(k)
                        continue
                    table = np.empty(info.shape, o.dtype)
                    assemble(info, parts[k], table)
                    o._data, o._indices = table, np.arange(info.shape[0], dtype=np.int64)
                    continue
                assemble(info, parts[k], as_numpy(o))

    def _pull_new(self, key: Any) -> Any:
        self._send_held()
        many, records = self._keys.pull_new_keys(key)
        uniq = list(dict.fromkeys(r.key for r in records))
        peers = [k for k in uniq if self._peers.path is not None and self._peers.pushed(k)]
        parts = self._path.fetch([k for k in uniq if k not in peers]) \
            if len(peers) < len(uniq) else {}
        if peers:
            parts.update(self._peers.fetch(peers, [[] for _ in peers]))
        result = []
        for rec in records:
            data = np.empty(rec.shape, rec.dtype)
            assemble(rec, parts[rec.key], data)
            result.append(self._keys.new_out(rec, data))
        return result if many else result[0]

    @overload
    def pull(self, key: Key, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> Array: ...

    @overload
    def pull(self, key: KeyList, out: None = None, priority: int = 0,
             ignore_sparse: bool = True) -> list[Array]: ...

    @overload
    def pull(self, key: KeyArg, out: OutArg, priority: int = 0,
             ignore_sparse: bool = True) -> None: ...

    def pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> Any:
        """Pull values from the servers into ``out`` (new arrays with ``out=None``).

        A pull after this worker's push of a key returns the value of the round that
        includes the push (MXNet's pull-after-push ordering).
        """
        with self._lock:
            self._begin(pulling=True)
            if self._tables.owns(key):
                self._tables.refuse(key, "pull")
            self._reads.before_read()
            if out is None:
                return self._pull_new(key)
            keys, groups = normalize(key, out, "out")
            if has_device(groups):
                return self._device.run(None, None, keys, groups, self._store,
                                        lambda _, o: self._pull_checked(keys, o, ignore_sparse))
            self._pull_checked(keys, groups, ignore_sparse)
            return None

    def _pull_checked(self, keys: list[Key], groups: list[list[Any]],
                      ignore_sparse: bool) -> None:
        self._check_bounds(keys, groups, "pull")
        self._keys.validate_pull(keys, groups)
        self._pull_validated(keys, groups, ignore_sparse)

    def pushpull(self, key: KeyArg, value: ValueArg, out: OutArg | None = None,
                 priority: int = 0) -> None:
        """Push, then pull the round's result, in one message per server."""
        with self._lock:
            self._begin()
            if self._tables.owns(key):
                self._tables.refuse(key, "pushpull")
            keys, groups = normalize(key, value)
            okeys, ogroups = normalize(key, value if out is None else out, "out")
            if has_device(groups) or has_device(ogroups):
                # the outs are pinned buffers, never the values: the reply may land there
                return self._device.run(
                    keys, groups, okeys, ogroups, self._store,
                    lambda g, o: self._pushpull_checked(keys, g, okeys, o, True),
                    self._path.compressor is not None)
            self._pushpull_checked(keys, groups, okeys, ogroups, out is not None)

    def _pushpull_checked(self, keys: list[Key], groups: list[list[Any]], okeys: list[Key],
                          ogroups: list[list[Any]], apart: bool) -> None:
        """``apart``: the outs are not the values (the reply may be read into them)."""
        self._keys.validate_push(keys, groups, self._path.compressor is not None)
        self._keys.validate_pull(okeys, ogroups)
        self._check_bounds(keys, groups, "pushpull")
        self._first_push()
        if self._peers.path is not None and any(self._store[k].collective for k in keys):
            # the collective keys' pushes are written when this returns: then the pull
            # may land in the values (out=None)
            self._push_validated(keys, groups)
            self._pull_validated(okeys, ogroups, True)
            return
        stale = self._reads.stale
        if stale is not None:
            # a push call, then a bounded read: apart, so that the servers see the
            # clock before the read (the global bound) and the read may flush (K)
            self._path.send(self._path.items(keys, groups), lend=True)
            stale.pushed()
            stale.before_read()
            return self._pull_validated(okeys, ogroups, True)
        items = self._path.items(keys, groups)
        # with out=None the reply overwrites the values: after they were sent
        targets = self._path.targets(okeys, ogroups) if apart else {}
        fetched = self._path.fetch(keys, Command.PUSHPULL, items, targets)
        self._pull_validated(okeys, ogroups, True, fetched)

    def broadcast(self, key: KeyArg, value: ValueArg, out: OutArg, priority: int = 0) -> None:
        """Initialize with rank 0's ``value`` and pull it into ``out`` on every worker."""
        self.init(key, value)
        self.pull(key, out=out)

    def row_sparse_pull(self, key: KeyArg, out: OutArg | None = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Pull rows ``row_ids`` of row_sparse keys from the servers holding them."""
        with self._lock:
            self._begin()
            self._reads.before_read()
            if self._tables.owns(key):
                return self._tables.row_sparse_pull(key, out, row_ids)
            self._keys.need_rows(key, out, row_ids)
            keys, groups = normalize(key, out, "out")
            rows = row_ids_by_key(key, keys, groups, row_ids)
            self._keys.validate_row_sparse_pull(key, out, row_ids, keys, groups, rows)
            self._check_bounds(keys, groups, "row_sparse_pull")
            self._path.rows([(k, o, r) for k, outs in zip(keys, groups)
                             for o, r in zip(outs, rows[k])])

    # ---- optimizer, compression, states -----------------------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Install ``optimizer`` on every server (a JSON spec, never a pickle).

        Every worker may call it (MXNet scripts do); the servers install it once and treat
        identical repeats as no-ops. Refused (ConfigError, on every worker alike) for an
        optimizer whose spec cannot travel or that the servers could not rebuild and run,
        and while a ``pskv.torch.DistributedOptimizer`` with ``update_on_kvstore=False``
        holds gradient keys here. Table keys with their own ``TableSpec(optimizer=)``
        keep it.
        """
        spec = check_optimizer(optimizer, need_spec=True)   # refused here, alike on every worker
        with self._collective_lock, self._lock:
            self._begin()
            self._gradient_keys.refuse_optimizer("set_optimizer")
            coll = [rec for rec in self._store.values() if rec.collective]
            if any(self._peers.pushed(rec.key) for rec in coll):
                self._hand_back()
            self._core.to_servers(command(Op.OPTIMIZER, spec=spec), wait=True)
            self._tables.optimizer = optimizer
            # the keys that were summed among the workers go back to the servers, which
            # hold their initial values (MXNet's Module inits, then sets the optimizer)
            # or, after pushes, their last round's (_hand_back)
            self._peers.choice.optimizer = True
            for rec in coll:
                rec.collective = False
                assert self._peers.path is not None
                self._peers.path.drop_key(rec.pskey)

    def _hand_back(self) -> None:
        """``set_optimizer`` after pushes on the collective path: collective (every
        worker calls it, as MXNet scripts do). Worker 0 sends each server its parts of
        every such key's last round, which the servers store (``Op.ADOPT``); an error
        there is raised on every worker and no key moves."""
        self._collective("set_optimizer (keys summed among the workers)")
        error = None
        if self._po.rank == 0:
            try:
                tss = [self._kv.request(s, Command.COMMAND, arrays=parts,
                                        body=command(Op.ADOPT, values=keys))
                       for s, (keys, parts) in self._peers.held_parts().items()]
                self._wait_all(tss, "the servers to take the workers' values")
            except KVStoreError as err:
                error = f"{type(err).__name__}: {err}"
        payloads = self._collective("set_optimizer (values on the servers)", {"error": error})
        msg = (payloads.get("0") or {}).get("error")
        if msg:
            raise UnsupportedError(f"set_optimizer could not move the keys summed among "
                                   f"the workers to the servers: {msg} (worker 0 reported "
                                   "it)", store_type=self._type)

    def _store_optimizer(self) -> Any:
        return self._tables.optimizer

    def set_updater(self, updater: Updater) -> None:
        """Not available in dist stores: the update runs on the servers. Use set_optimizer."""
        raise UnsupportedError(
            f"a {self._type!r} store updates on the servers, which cannot run a Python "
            "function sent from a worker. Use kv.set_optimizer(mx.optimizer.create(...)).",
            store_type=self._type)

    _set_updater = set_updater

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes on the wire (2bit / 1bit); call on every worker before init."""
        with self._lock:
            self._begin()
            if self._store:
                raise UnsupportedError(
                    "set_gradient_compression must be called before the first init.",
                    store_type=self._type)
            compressor = compression.create(compression_params)
            params = None if compressor is None else compressor.params
            self._core.to_servers(command(Op.COMPRESSION, params=params), wait=True)
            self._path.compressor = compressor
            self._peers.choice.compression = compressor is not None

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Gather every server's optimizer states into ``fname`` (NumPy arrays + JSON)."""
        with self._lock:
            self._begin()
            replies = self._core.to_servers(command(Op.SAVE, dump=dump_optimizer), wait=True)
            write_states(fname, [arrays[0] for _, arrays in replies])

    def load_optimizer_states(self, fname: str) -> None:
        """Send each server its part of states saved by :meth:`save_optimizer_states`."""
        with self._lock:
            self._begin()
            blobs = read_states(fname, self._po.num_servers)
            tss = [self._kv.request(s, Command.COMMAND, body=command(Op.LOAD), arrays=[b])
                   for s, b in enumerate(blobs)]
            self._wait_all(tss, "the servers to load states")

    # ---- cluster ---------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every worker reaches this barrier.

        ``dist_async``: every worker's earlier pushes are applied before anyone leaves it.
        ``dist_sync``: earlier pushes are sent first but not waited for, since their rounds
        may need pushes other workers make after the barrier; a pull after the barrier
        still returns the round that includes this worker's push. A worker waiting here
        holds no one back under a global staleness bound (docs/embeddings.md S5).
        """
        with self._collective_lock, self._lock:
            self._begin()
            if not self._sync:
                stale = self._reads.stale
                if stale is not None:
                    stale.flush()
                else:
                    with self._unlocked():
                        self._kv.flush()
            bounded = self._reads.global_bound
            if bounded:
                self._reads.leave()   # workers with more steps before it may finish them
            try:
                self._collective("barrier")
            finally:
                if bounded:
                    assert self._reads.stale is not None
                    self._reads.tick(self._reads.stale.clock)    # counted again, at its clock

    _barrier = barrier

    def close(self) -> None:
        """Leave the cluster; when every worker has closed, the servers and scheduler exit."""
        with self._lock:
            if self._keys.closed:
                return
            self._keys.closed = True
            atexit.unregister(self._atexit)
            try:
                if self._po.failure is None:
                    if self._reads.global_bound:
                        self._reads.leave()
                    self._send_held()
                    with self._unlocked():
                        self._kv.flush(timeout=min(self._cfg.request_timeout, 10.0))
            except KVStoreError as err:
                log.warning("worker %d: closing with unacknowledged pushes: %s", self.rank, err)
            finally:
                self._peers.close()
                self._po.goodbye()
                self._po.close()
                self._kv.close()
                self._zctx.close()
                self._reducer.close()
                self._device.close()

    def _data_position(self) -> int:
        """A :class:`pskv.data.Sampler` trains through this store: tag pushes with its
        step from now on; the step to train first (a restarted worker's resumes where the
        servers' state says: docs/data.md)."""
        with self._lock:
            self._claim_data_position()      # one Sampler per store (docs/data.md D9)
            self._begin()
            return self._kv.attach_position()

    def _data_sealing(self) -> bool:
        """Whether a Sampler's seals are on (see :meth:`KVStoreBase._data_sealing`)."""
        return self._kv.seals is not None

    def _data_step(self, step: int) -> None:
        """The sampler's step ``step`` begins: the last one's pushes are sealed first."""
        with self._lock:
            self._begin()          # a held push goes out with the step it was made in
            seals = self._kv.seals
            if seals is not None:
                with self._unlocked():
                    seals.advance(step)

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability``; ``'optimizer'`` is supported."""
        return check_capability(capability)

    def __repr__(self) -> str:
        return (f"<DistKVStore type={self._type!r} rank={self.rank}/{self.num_workers} "
                f"keys={len(self._store)}>")
