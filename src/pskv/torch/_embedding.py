"""``pskv.torch.Embedding`` and ``EmbeddingBag``: torch modules over a table key.

The rows live in the store (a table key, docs/embeddings.md), not in the module: a forward
de-duplicates the IDs, looks the unique rows up, and gathers them back; the backward sums
the gradient per unique ID and pushes ``(unique_ids, summed)`` to the key, where the
table's own optimizer (``TableSpec(..., optimizer=)``) or the store's (``kv.set_optimizer``)
updates the rows; with neither, backward raises instead of assigning gradients as rows.

Invariants: each module has at most one communication thread, which runs its pushes and
prefetched lookups in the order they were made; a forward first waits for every push made
before it, so a worker reads its own writes; a prefetched lookup is used only for the very
IDs it was made for, and rows pushed after it began are read again.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import (ConfigError, KeyAlreadyInitializedError, KeyNotInitializedError,
                      ShapeMismatchError, TableIdError, UnsupportedError, ValueTypeError)
from ..table import TableSpec

__all__ = ["Embedding", "EmbeddingBag"]

_MODES = ("sum", "mean")


class _Gather(torch.autograd.Function):
    """``rows[inverse]`` forward; backward pushes the gradient summed per unique row."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inverse: torch.Tensor, client: _Client,
                unique: np.ndarray) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.client, ctx.unique = client, unique
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (inverse,) = ctx.saved_tensors
        summed = torch.zeros((ctx.unique.size, grad.shape[-1]), dtype=grad.dtype)
        summed.index_add_(0, inverse, grad.reshape(-1, grad.shape[-1]))
        ctx.client.push(ctx.unique, summed.numpy())
        return None, None, None, None       # the rows are the store's: no .grad anywhere


class _Prefetch:
    """A lookup started for the next batch: its IDs, their dedup, and the future rows."""

    def __init__(self, ids: torch.Tensor, train: bool, unique: torch.Tensor,
                 inverse: torch.Tensor, future: Future[Any]) -> None:
        self.ids, self.train = ids, train
        self.unique, self.inverse, self.future = unique, inverse, future
        self.pushed: list[np.ndarray] = []      # unique IDs pushed since it began


#: every table module's client alive (weakly): a join waits for their pushes
_CLIENTS: "weakref.WeakSet[_Client]" = weakref.WeakSet()


def synchronize_tables(kv: Any) -> None:
    """Wait for every push the table modules on ``kv`` have made so far (their threads);
    raise the first error one of them met. ``DistributedOptimizer.join`` calls it: a push
    still in flight when the worker joins would be refused (docs/torch.md, "Uneven data")."""
    for client in list(_CLIENTS):
        if client.kv is kv:
            client.synchronize()


class _Client:
    """One module's view of its table key: lookups, pushes and the communication thread."""

    def __init__(self, kv: Any, key: Any, spec_or_dim: Any, what: str) -> None:
        self.kv, self.key, self.what = kv, key, what
        if not hasattr(kv, "lookup"):
            raise UnsupportedError(
                f"{what}: this {getattr(kv, 'type', type(kv).__name__)!r} store has no table "
                "keys (no kv.lookup). Use a store that has them, e.g. mx.kv.create('local').",
                key=key)
        if isinstance(spec_or_dim, TableSpec):
            try:
                kv.init(key, spec_or_dim)
            except KeyAlreadyInitializedError as err:
                raise KeyAlreadyInitializedError(
                    f"{what}: key {key!r} exists already, so it cannot be declared with this "
                    f"TableSpec. To share an existing table, pass its dim: {what}(kv, {key!r}, "
                    f"{spec_or_dim.dim}); else use another key.", key=key,
                    store_type=err.store_type) from err
        elif isinstance(spec_or_dim, bool) or not isinstance(spec_or_dim, (int, np.integer)):
            raise ConfigError(
                f"{what}: spec_or_dim={spec_or_dim!r} is neither a TableSpec nor an int. Pass "
                f"TableSpec(dim=16, ...) to declare key {key!r}, or the dim of the table it "
                "holds already.", key=key)
        try:   # an empty eval lookup: changes nothing, and says whether key is a table
            probe, _ = kv.lookup(key, np.zeros(0, np.int64), train=False)
        except KeyNotInitializedError as err:
            raise KeyNotInitializedError(
                f"{what} needs a table key, but key {key!r} is not one in this store "
                f"({err}). Pass a TableSpec: {what}(kv, {key!r}, TableSpec(dim=...)), or "
                f"call kv.init({key!r}, TableSpec(dim=...)) first.", key=key,
                store_type=err.store_type) from err
        self.dim = int(probe.shape[-1])
        self.dtype = torch.from_numpy(probe).dtype
        if not isinstance(spec_or_dim, TableSpec) and int(spec_or_dim) != self.dim:
            raise ShapeMismatchError(
                f"{what}: key {key!r} is a table of dim {self.dim}, not {spec_or_dim}. Pass "
                f"dim {self.dim}, or declare a new table under another key.", key=key,
                shape=(self.dim,))
        self.lock = threading.Lock()
        #: an optimizer was found for the rows (checked at the first push)
        self.trained = False
        self.executor: ThreadPoolExecutor | None = None
        self.pending: list[Future[Any]] = []
        self.prefetched: _Prefetch | None = None
        _CLIENTS.add(self)

    # ---- the thread ----------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="pskv-embedding")
        return self.executor.submit(fn, *args)

    def push(self, unique: np.ndarray, grads: np.ndarray) -> None:
        """Push ``(unique, grads)`` on the thread (called by backward: never waits);
        ConfigError if no optimizer would train the rows (the push would assign them)."""
        if not self.trained:
            find = getattr(self.kv, "_row_optimizer", None)
            if find is not None and find(self.key) is None:
                raise ConfigError(
                    f"{self.what} of table {self.key!r}: backward would push gradients to a "
                    "table that has no optimizer, and a push without one assigns: the rows "
                    "would become the summed gradients. Give the table its own optimizer, "
                    "TableSpec(..., optimizer=mx.optimizer.AdaGrad(learning_rate=0.1)), or "
                    "call kv.set_optimizer(...) (not with a DistributedOptimizer's "
                    "update_on_kvstore=False) before training.", key=self.key)
            self.trained = True
        with self.lock:
            if self.prefetched is not None:
                self.prefetched.pushed.append(unique)
            self.pending.append(self._submit(self.kv.push, self.key, (unique, grads)))

    def synchronize(self) -> None:
        """Wait for every push made so far; raise the first one's error."""
        with self.lock:
            pending, self.pending = self.pending, []
        errors = [f.exception() for f in pending]
        for err in errors:
            if err is not None:
                raise err

    def close(self) -> None:
        """Wait for what is in flight, then stop the thread."""
        try:
            self.synchronize()
            if self.prefetched is not None:
                self.prefetched.future.exception()
                self.prefetched = None
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
                self.executor = None

    # ---- lookups ---------------------------------------------------------------------------
    def check_ids(self, ids: Any, name: str = "ids") -> torch.Tensor:
        """``ids`` as an int64 CPU tensor, or TableIdError / ValueTypeError."""
        if not isinstance(ids, torch.Tensor):
            raise ValueTypeError(
                f"{self.what} of table {self.key!r}: {name} must be a torch.Tensor of int64 "
                f"IDs, got {type(ids).__name__}. Wrap them: torch.as_tensor(ids, "
                "dtype=torch.int64).", key=self.key)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TableIdError(
                f"{self.what} of table {self.key!r} got {name} of dtype {ids.dtype}; IDs are "
                f"integers. Pass {name}.long() if they hold whole numbers (float IDs lose "
                "precision above 2**53), or build them as int64.", key=self.key)
        if ids.device.type != "cpu":
            raise ValueTypeError(
                f"{self.what} of table {self.key!r}: {name} are on {ids.device}; the store "
                f"reads CPU tensors. Pass {name}.cpu().", key=self.key)
        return ids.to(torch.int64)

    def prefetch(self, ids: torch.Tensor, train: bool) -> None:
        """Start the lookup of ``ids`` (checked) on the thread, after the pushes before it."""
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        with self.lock:
            old = self.prefetched
            future = self._submit(self.kv.lookup, self.key, unique.numpy(), train)
            self.prefetched = _Prefetch(flat.clone(), train, unique, inverse, future)
        if old is not None:
            old.future.exception()      # replaced: let it finish, it is not read

    def rows(self, ids: torch.Tensor, train: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                            np.ndarray]:
        """``(rows of the unique IDs, inverse, unique IDs)`` for the flat int64 ``ids``."""
        self.synchronize()
        with self.lock:
            pre, self.prefetched = self.prefetched, None
        if pre is not None and pre.train == train and pre.ids.shape == ids.shape \
                and torch.equal(pre.ids, ids):
            unique, inverse = pre.unique.numpy(), pre.inverse
            values = pre.future.result()[0]
            if pre.pushed:      # rows this module pushed after the lookup began: read again
                again = np.flatnonzero(np.isin(unique, np.concatenate(pre.pushed)))
                if again.size:
                    values = np.array(values, copy=True)
                    values[again] = self.kv.lookup(self.key, unique[again], train=train)[0]
        else:
            if pre is not None:
                pre.future.exception()  # for other IDs: finished, not read
            u, inverse = torch.unique(ids, return_inverse=True)
            unique = u.numpy()
            values = self.kv.lookup(self.key, unique, train=train)[0]
        if not values.flags.writeable:
            values = np.array(values, copy=True)
        return torch.from_numpy(values), inverse, unique

    def gather(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        """The rows of the flat int64 ``ids``, ``(n, dim)``, connected to autograd when a
        training forward records a graph."""
        rows, inverse, unique = self.rows(ids, train)
        if train and torch.is_grad_enabled():
            rows.requires_grad_(True)
            out: torch.Tensor = _Gather.apply(rows, inverse, self, unique)
            return out
        return rows.index_select(0, inverse)


class _TableModule(torch.nn.Module):
    """What Embedding and EmbeddingBag share: the client, prefetch, synchronize, close."""

    _client: _Client

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start looking up the next batch's IDs while this step computes.

        The next forward with exactly these IDs (``torch.equal``; for EmbeddingBag the
        ``input`` tensor) uses the result; rows this module pushed in between are read
        again, so on one worker the result is what a forward without prefetch would read
        (rows only other workers pushed in between may be one step stale). Another
        forward discards it. A training prefetch is a training lookup (it may insert
        rows) made now, in the mode the module is in now.

        Parameters
        ----------
        ids : torch.Tensor of int
            Any shape.
        """
        self._client.prefetch(self._client.check_ids(ids), self.training)

    def synchronize(self) -> None:
        """Wait for the pushes the backward passes made so far (a forward does this
        first); raise the first error one of them met."""
        self._client.synchronize()

    def flush(self) -> None:
        """The same as ``synchronize()``."""
        self._client.synchronize()

    def close(self) -> None:
        """Wait for what is in flight and stop the communication thread (a later call
        starts a new one)."""
        self._client.close()

    @property
    def kv(self) -> Any:
        """The store that holds the rows."""
        return self._client.kv

    @property
    def key(self) -> Any:
        """The table key."""
        return self._client.key

    @property
    def embedding_dim(self) -> int:
        """The dimension of a row (the table's ``dim``)."""
        return self._client.dim

    def extra_repr(self) -> str:
        return f"key={self._client.key!r}, embedding_dim={self._client.dim}"


class Embedding(_TableModule):
    """A ``torch.nn.Embedding`` whose rows live in a pskv table key, addressed by raw IDs.

    ``forward(ids)`` returns ``ids.shape + (dim,)`` rows: the IDs are de-duplicated
    (``torch.unique``), the unique rows looked up in the store, and gathered back. In
    training mode the lookup is a training lookup (it may insert rows, per the table's
    admission) and the backward pushes the gradient summed per unique ID,
    ``kv.push(key, (unique_ids, grads))``, on a communication thread: backward does not
    wait for it; the next forward, ``synchronize()`` or ``close()`` does. In
    ``eval()`` mode the lookup is read-only (it never inserts), and so is any forward under
    ``torch.no_grad()`` in eval mode; a training forward under ``no_grad`` looks up for
    training but pushes nothing.

    The table's own optimizer (``TableSpec(..., optimizer=...)``), else the store's
    (``kv.set_optimizer``), updates the rows on each push; a torch optimizer does not (the
    module has no parameters, and ``state_dict()`` holds no rows). With neither, the first
    backward raises ConfigError (a push would set the rows to the gradients).

    Besides ``forward``, both table modules have ``prefetch(ids)`` (start the next batch's
    lookup now; a forward of exactly those IDs uses it, re-reading the rows it pushed
    since), ``synchronize()`` (alias ``flush()``: wait for
    the pushes so far), ``close()`` (also stop the thread), and ``kv``, ``key`` and
    ``embedding_dim``.

    Parameters
    ----------
    kv : KVStore
        A store with table keys (``local``; ``dist_*`` where they hold tables).
    key : int or str
        The table key.
    spec_or_dim : pskv.table.TableSpec or int
        A TableSpec declares the key (``kv.init(key, spec)``, collective in a dist store);
        an int is the dim of a table the key holds already (modules may share a table).

    Raises
    ------
    KeyNotInitializedError
        If ``key`` is not a table key (an array key, or none, with an int dim).
    KeyAlreadyInitializedError
        For a TableSpec and a key that exists already.
    ShapeMismatchError
        For an int dim that differs from the table's.
    ConfigError
        For a ``spec_or_dim`` that is neither; from ``backward``, for a table with no
        optimizer (neither its own nor the store's).
    TableIdError
        From ``forward`` or ``prefetch``, for IDs of a float, complex or bool dtype.

    Examples
    --------
    >>> import torch, pskv as mx, pskv.torch as pt
    >>> from pskv.table import TableSpec, Constant
    >>> kv = mx.kv.create('local')
    >>> kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    >>> emb = pt.Embedding(kv, 'emb', TableSpec(dim=2, init=Constant(1.0)))
    >>> ids = torch.tensor([[7, -2**40], [7, 3]])
    >>> out = emb(ids); out.shape
    torch.Size([2, 2, 2])
    >>> out.sum().backward()          # pushes a gradient of 2 for ID 7, 1 for the others
    >>> emb.synchronize()
    >>> emb(torch.tensor([7, 3])).tolist()
    [[0.0, 0.0], [0.5, 0.5]]
    >>> emb.close()
    """

    def __init__(self, kv: Any, key: Any, spec_or_dim: TableSpec | int) -> None:
        super().__init__()
        self._client = _Client(kv, key, spec_or_dim, "Embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (int64, any shape): shape ``ids.shape + (dim,)``."""
        ids = self._client.check_ids(ids)
        out = self._client.gather(ids.reshape(-1), self.training)
        return out.view(tuple(ids.shape) + (self._client.dim,))


class EmbeddingBag(_TableModule):
    """A ``torch.nn.EmbeddingBag`` (sum or mean of bags of rows) over a pskv table key.

    ``forward(input, offsets=None, per_sample_weights=None)`` takes torch's input forms: a
    1-D ``input`` of IDs with ``offsets`` (where each bag starts; ``offsets[0] == 0``), or
    a 2-D ``input`` of ``B`` bags of equal length and no offsets. It returns ``(B, dim)``:
    each bag's rows summed (weighted by ``per_sample_weights``, for ``mode='sum'``) or
    averaged; an empty bag gives zeros. Lookups, pushes, eval and prefetch behave as
    :class:`Embedding`'s (prefetch takes the ``input`` tensor).

    Parameters
    ----------
    kv : KVStore
        A store with table keys.
    key : int or str
        The table key.
    spec_or_dim : pskv.table.TableSpec or int
        As for :class:`Embedding`.
    mode : {'sum', 'mean'}, default 'mean'
        How a bag's rows are pooled (torch's default is 'mean').
    include_last_offset : bool, default False
        As torch's: ``offsets`` has ``B + 1`` entries, the last one ``len(input)``.

    Raises
    ------
    ConfigError
        For another ``mode``; plus :class:`Embedding`'s.
    ShapeMismatchError
        From ``forward``: offsets that are not 1-D, do not start at 0, decrease or pass
        the end of ``input``; offsets with a 2-D input, or none with a 1-D one;
        ``per_sample_weights`` not of ``input``'s shape.
    UnsupportedError
        From ``forward``: ``per_sample_weights`` with ``mode='mean'`` (as torch).

    Examples
    --------
    >>> import torch, pskv as mx, pskv.torch as pt
    >>> from pskv.table import TableSpec, Constant
    >>> kv = mx.kv.create('local')
    >>> bag = pt.EmbeddingBag(kv, 0, TableSpec(dim=2, init=Constant(1.0)), mode='sum')
    >>> bag(torch.tensor([4, 5, 6]), torch.tensor([0, 2])).tolist()
    [[2.0, 2.0], [1.0, 1.0]]
    >>> bag.close()
    """

    def __init__(self, kv: Any, key: Any, spec_or_dim: TableSpec | int, mode: str = "mean",
                 include_last_offset: bool = False) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ConfigError(f"EmbeddingBag: mode={mode!r} is not one of {_MODES}. Pass "
                              "mode='sum' or mode='mean'.", key=key)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        self._client = _Client(kv, key, spec_or_dim, "EmbeddingBag")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"

    def _bags(self, ids: torch.Tensor, offsets: Any) -> torch.Tensor:
        """The length of every bag, checked against ``ids`` (flat or 2-D)."""
        key = self._client.key
        if ids.dim() == 2:
            if offsets is not None:
                raise ShapeMismatchError(
                    f"EmbeddingBag of table {key!r}: a 2-D input {tuple(ids.shape)} is "
                    "already bags of equal length; pass offsets=None, or a 1-D input with "
                    "offsets.", key=key, shape=tuple(ids.shape))
            return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)
        if ids.dim() != 1 or offsets is None:
            raise ShapeMismatchError(
                f"EmbeddingBag of table {key!r} got input of shape {tuple(ids.shape)} "
                f"{'without' if offsets is None else 'with'} offsets. Pass a 1-D input with "
                "offsets, or a 2-D input (B, L) without.", key=key, shape=tuple(ids.shape))
        off = self._client.check_ids(offsets, "offsets")
        n = ids.shape[0]
        if off.dim() != 1 or (off.numel() and (int(off[0]) != 0 or bool(
                (off[1:] < off[:-1]).any()) or int(off[-1]) > n)) or \
                (self.include_last_offset and (off.numel() == 0 or int(off[-1]) != n)):
            raise ShapeMismatchError(
                f"EmbeddingBag of table {key!r} got offsets of shape {tuple(off.shape)} "
                f"({off.tolist()[:8]}...) for an input of {n} IDs. Offsets are 1-D, start at "
                f"0, never decrease and stay <= {n}"
                + (f", and end at {n} (include_last_offset)" if self.include_last_offset
                   else "") + ".", key=key, shape=tuple(off.shape))
        ends = off[1:] if self.include_last_offset else torch.cat(
            [off[1:], torch.tensor([n], dtype=torch.int64)])
        starts = off[:-1] if self.include_last_offset else off
        return ends - starts

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled rows of each bag: shape ``(B, dim)``."""
        client = self._client
        ids = client.check_ids(input, "input")
        lengths = self._bags(ids, offsets)
        weights = None
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise UnsupportedError(
                    f"EmbeddingBag of table {client.key!r}: per_sample_weights work with "
                    "mode='sum' only (as torch's). Build the module with mode='sum'.",
                    key=client.key)
            if not isinstance(per_sample_weights, torch.Tensor) or \
                    tuple(per_sample_weights.shape) != tuple(ids.shape) or \
                    not per_sample_weights.dtype.is_floating_point:
                got = (tuple(per_sample_weights.shape), per_sample_weights.dtype) \
                    if isinstance(per_sample_weights, torch.Tensor) \
                    else type(per_sample_weights).__name__
                raise ShapeMismatchError(
                    f"EmbeddingBag of table {client.key!r}: per_sample_weights {got} do not "
                    f"match input {tuple(ids.shape)}. Pass one float weight per ID, of "
                    "input's shape.", key=client.key, shape=tuple(ids.shape))
            weights = per_sample_weights.reshape(-1, 1)
        rows = client.gather(ids.reshape(-1), self.training)
        if weights is not None:
            rows = rows * weights.to(rows.dtype)
        num_bags = lengths.numel()
        bag_of = torch.repeat_interleave(torch.arange(num_bags), lengths)
        out = torch.zeros((num_bags, client.dim), dtype=rows.dtype).index_add(0, bag_of, rows)
        if self.mode == "mean":
            out = out / lengths.clamp(min=1).to(out.dtype).unsqueeze(1)
        return out
