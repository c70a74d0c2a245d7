"""DistributedOptimizer: a torch optimizer whose ``step()`` first combines every worker's
gradients through the store (bucketed, overlapped with backward), and keeps buffers equal.

Invariant: the keys (layout check, buckets, buffers) are initialized in the same order on
every worker, and only after every argument was checked, so bad input raises on every
worker before any collective call.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .._ps import config
from ..errors import ConfigError, KeyTypeError, UnsupportedError, ValueTypeError
from ._broadcast import (broadcast_parameters, check_one_device, import_torch, init_keys,
                         named_tensors)
from ._buckets import DEFAULT_BUCKET_CAP_MB, bucket_cap_bytes, check_same_layout
from ._sparse import SparseParams, check_sparse_names
from ._sync import HOOK_ATTR, Synchronizer, copy_all

if TYPE_CHECKING:
    import torch

__all__ = ["DistributedOptimizer"]

#: what ``op`` may be: how the pushed gradients of the workers are combined
_OPS = ("average", "sum")

#: buckets of at least this many bytes take the collective path where the store allows it:
#: the store's own default (benchmarks/results/bench_route.md)
DEFAULT_COLLECTIVE_BYTES = config.DEFAULT_COLLECTIVE_BYTES


class _Buffers:
    """Buffers (BatchNorm's running statistics) := rank 0's, one key per dtype.

    Each round rank 0 pushes its values and every other worker zeros, so the round's sum
    is rank 0's (exactly: x + 0 == x), which every worker pulls into its buffers. Each
    key ends with one element more, 1 from rank 0 and 0 from the others: a round whose
    sum has 0 there had no push of rank 0 (it joined: uneven data), and every worker
    keeps its own buffers rather than taking zeros (the same on every worker). The
    synchronizer sends these keys in the message of its last bucket (``fill`` before,
    ``unpack`` after it), so buffers cost no round of their own.
    """

    def __init__(self, kv: Any, named: list[tuple[str, torch.Tensor]], prefix: str) -> None:
        th = import_torch()
        self.kv = kv
        self.keys: list[str] = []
        self.flats: list[torch.Tensor] = []
        self.tensors: list[list[torch.Tensor]] = []
        self.views: list[list[torch.Tensor]] = []
        by_dtype: dict[Any, list[torch.Tensor]] = {}
        for _, t in named:
            by_dtype.setdefault(t.dtype, []).append(t)
        for n, (dtype, tensors) in enumerate(by_dtype.items()):
            flat = th.zeros(sum(t.numel() for t in tensors) + 1, dtype=dtype,
                            device=tensors[0].device)       # + rank 0's flag
            views, offset = [], 0
            for t in tensors:
                views.append(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            self.keys.append(f"{prefix}buffers.{n}")
            self.flats.append(flat)
            self.tensors.append(tensors)
            self.views.append(views)

    @staticmethod
    def key_names(named: list[tuple[str, torch.Tensor]], prefix: str) -> list[str]:
        """The keys ``_Buffers(kv, named, prefix)`` uses: one per dtype."""
        return [f"{prefix}buffers.{n}" for n in range(len({t.dtype for _, t in named}))]

    def init(self, what: str, prefix: str) -> None:
        if self.keys:
            init_keys(self.kv, self.keys, self.flats, what, prefix)

    def fill(self) -> None:
        """This worker's part of the round: its buffers on rank 0, zeros elsewhere."""
        for flat, tensors, views in zip(self.flats, self.tensors, self.views):
            if self.kv.rank == 0:
                copy_all(views, [t.detach() for t in tensors])
                flat[-1] = 1
            else:
                flat.zero_()

    def unpack(self) -> None:
        """The round's result (rank 0's values) into the buffers."""
        th = import_torch()
        with th.no_grad():
            for flat, tensors, views in zip(self.flats, self.tensors, self.views):
                if flat[-1].item() != 0:     # else rank 0 joined: each keeps its own
                    copy_all(tensors, views)


class _DistributedMixin:
    """The methods a DistributedOptimizer puts in front of the wrapped optimizer's class."""

    _pskv_sync: Synchronizer
    _pskv_buffers: _Buffers | None
    _pskv_release: Callable[[], None] | None

    def synchronize(self) -> None:
        """Combine the gradients of every worker now (``update_on_kvstore=True``: also
        update the weights); a later ``step()`` inside :meth:`skip_synchronize` does not
        again. For example, to clip the averaged gradients."""
        self._pskv_sync.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A context in which ``step()`` does not synchronize (after :meth:`synchronize`)."""
        self._pskv_sync.skip = True
        try:
            yield
        finally:
            self._pskv_sync.skip = False

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context whose backward passes only accumulate into ``.grad`` (as DDP's
        ``no_sync``): the next backward outside it sends the accumulated gradients."""
        return self._pskv_sync.no_sync()

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread. The parameters
        may then be wrapped again (with a new ``prefix``)."""
        self._pskv_sync.close()
        release, self._pskv_release = getattr(self, "_pskv_release", None), None
        if release is not None:     # the store may take an optimizer again
            release()

    def join(self, timeout: float | None = None) -> int:
        """This worker has run out of batches (uneven data): ``kv.join()`` after its last
        ``step()``, in the spirit of DDP's ``Join`` and ``hvd.join()``.

        Until every worker has joined, the others' steps complete without this worker,
        which counts as a zero gradient; with ``op='average'`` the sum is still divided by
        ``kv.num_workers`` (DDP's default, ``divide_by_initial_world_size=True``). With
        ``named_buffers``, once rank 0 has joined the others keep their own buffers.
        Once every worker has joined, every worker's parameters become those of the last
        worker to join (it took every step; DDP's join hook does the same): with
        ``update_on_kvstore=True`` pulled from the store, else broadcast from it (under new
        keys ``prefix + 'join/<n>/' + name``); the torch optimizer's state stays each
        worker's own. Returns the rank of the last worker to join. Then every worker may
        train on (the next epoch) or close. See docs/torch.md, "Uneven data".

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for the other workers (default ``PSKV_JOIN_TIMEOUT``).
        """
        sync = self._pskv_sync
        try:
            # a bucket a backward sent without its step(): its round completes first
            for bucket in sync.buckets:
                if bucket.future is not None:
                    bucket.future.result()
        finally:
            sync.reset()
        # the table modules' pushes of the last backward, still on their threads: a push
        # after the join would be refused (torch is here: this wraps a torch optimizer)
        from ._embedding import synchronize_tables
        synchronize_tables(sync.kv)
        last: int = sync.kv.join(timeout)
        th = import_torch()
        if sync.update_on_kvstore:     # the store holds every worker's weights
            for bucket in sync.buckets:
                sync.kv.pull(bucket.key, out=bucket.weights)
            with th.no_grad():
                for bucket in sync.buckets:
                    copy_all([sync.params[i] for i in bucket.members], bucket.weight_views)
        else:
            sync.joins += 1
            named = list(zip(sync.names, sync.params))
            if sync.sparse is not None:
                named += list(zip(sync.sparse.names, sync.sparse.params))
            with th.no_grad():
                broadcast_parameters(named, sync.kv, root_rank=last,
                                     prefix=f"{sync.prefix}join/{sync.joins}/")
        return last

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the gradients of all workers (sending what backward has not; the
        buffers become rank 0's with them), then step the wrapped optimizer
        (``update_on_kvstore=True``: the store's optimizer has updated the weights, and the
        torch optimizer does not step).

        ``closure``, if given, is called once first (under ``torch.enable_grad()``) to
        compute the loss and gradients; its result is returned.
        """
        sync = self._pskv_sync
        loss = None
        if closure is not None:
            with import_torch().enable_grad():
                loss = closure()
        if not sync.skip:
            sync.synchronize()
        if not sync.update_on_kvstore:
            super().step()  # type: ignore[misc]
        return loss


def _check_args(optimizer: Any, update_on_kvstore: bool, kv_optimizer: Any, op: str,
                backward_passes_per_step: Any) -> None:
    th = import_torch()
    if op not in _OPS:
        raise ConfigError(f"op={op!r} is not one of {_OPS}.")
    if update_on_kvstore and kv_optimizer is None:
        raise ConfigError("update_on_kvstore=True needs kv_optimizer=, the pskv optimizer the "
                          "store applies, e.g. mx.optimizer.SGD(learning_rate=0.1).")
    if not update_on_kvstore and (kv_optimizer is not None or optimizer is None):
        raise ConfigError("update_on_kvstore=False steps the torch optimizer: pass one, and "
                          "no kv_optimizer (or set update_on_kvstore=True).")
    if optimizer is not None and not isinstance(optimizer, th.optim.Optimizer):
        raise ValueTypeError(f"optimizer must be a torch.optim.Optimizer or None, got "
                             f"{type(optimizer).__name__}.")
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step={backward_passes_per_step!r} is not a "
                          "positive int. Pass the number of backward passes per step() "
                          "(1 unless you accumulate gradients).")


def _check_store(kv: Any, prefix: str, update_on_kvstore: bool) -> Any:
    """Refuse a store whose keys are ints, or (``update_on_kvstore=False``) one with an
    optimizer; return the store's guard of gradient keys (None where it has none)."""
    if getattr(getattr(kv, "_keys", None), "kind", None) is int:
        raise KeyTypeError(
            f"DistributedOptimizer keeps the gradients under str keys ({prefix!r} + "
            f"'bucket.0', ...), but this {getattr(kv, 'type', '?')!r} store holds int keys "
            "already, and a store takes one kind of key. Use str keys for your own values "
            "(kv.init('w0', ...)), or give the DistributedOptimizer a store without int "
            "keys.", key=prefix)
    guard = None if update_on_kvstore else getattr(kv, "_gradient_keys", None)
    if guard is not None:
        guard.check(prefix)
    return guard


def DistributedOptimizer(  # noqa: N802 - Horovod's name for the same thing
        optimizer: torch.optim.Optimizer | None, named_parameters: Any, kv: Any,
        update_on_kvstore: bool = False, kv_optimizer: Any = None, op: str = "average",
        prefix: str = "opt/", bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        overlap: bool = True, backward_passes_per_step: int = 1,
        named_buffers: Any = None, broadcast_buffers: bool = True, sparse_params: Any = None,
        sparse_as_dense: bool = False,
        collective_bytes: int | None = DEFAULT_COLLECTIVE_BYTES,
        gradient_as_bucket_view: bool = False) -> torch.optim.Optimizer:
    """Wrap a torch optimizer so that ``step()`` first combines the gradients of all workers.

    A collective call: every worker constructs it the same way (it checks that every
    worker has the same parameters and initializes the bucket keys together). Use the
    returned optimizer from then on; it is an instance of a subclass of ``optimizer``'s
    class that shares its parameter groups and state, so ``zero_grad``, ``state_dict``,
    ``load_state_dict`` and torch's LR schedulers work as before.

    Gradients travel in buckets of about ``bucket_cap_mb`` megabytes (one store key each,
    one dtype each, filled in the reverse of the parameter order as backward produces
    them); with ``overlap`` a bucket is sent by a background thread as soon as backward has
    produced its last gradient, and ``step()`` waits only for what is still in flight.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer or None
        The optimizer that steps with the combined gradients. With
        ``update_on_kvstore=True`` it is not stepped and may be None.
    named_parameters : iterable of (str, torch.Tensor) or Mapping
        ``model.named_parameters()``: the parameters to synchronize (those without
        ``requires_grad`` are left out); the same names, shapes and dtypes on every worker.
    kv : KVStore
        A store with str keys (``local`` or ``dist_*``), without an optimizer when
        ``update_on_kvstore=False`` (it then refuses ``set_optimizer`` until ``close()``;
        table keys train with their own ``TableSpec(..., optimizer=...)``,
        docs/embeddings.md).
    update_on_kvstore : bool, default False
        False: push the gradients (divided by ``kv.num_workers`` for ``op='average'``),
        pull their sum back into ``.grad``, then step ``optimizer``. True:
        ``kv.set_optimizer(kv_optimizer)``; each bucket pushes the (divided) gradients and
        the store's new weights are written into the parameters at ``step()``. The keys
        start from rank 0's parameters, which every worker pulls at construction.
    kv_optimizer : pskv.optimizer.Optimizer, optional
        Required with ``update_on_kvstore=True``, e.g. ``mx.optimizer.SGD(learning_rate=0.1)``.
    op : {'average', 'sum'}, default 'average'
        How the workers' gradients are combined.
    prefix : str, default 'opt/'
        Put before each key's name (``bucket.0``, ``buffers.0``, ``layout/...``).
    bucket_cap_mb : float or None, default 25
        The size of a bucket in MB (2**20 bytes; DDP's ``bucket_cap_mb``). None: one key per
        parameter.
    overlap : bool, default True
        Send each bucket during backward (autograd hooks). False: send every bucket in
        ``step()``, one after another.
    backward_passes_per_step : int, default 1
        How many backward passes accumulate into ``.grad`` before the gradients are sent
        (Horovod's argument); see also the returned optimizer's ``no_sync()``.
    named_buffers : iterable of (str, torch.Tensor), optional
        ``model.named_buffers()``: with ``broadcast_buffers``, made rank 0's in every
        ``step()`` (rank 0's values when its last bucket was sent, after backward; they
        travel in that bucket's message). DDP broadcasts them before each forward; the
        next forward sees the same values. Only with ``update_on_kvstore=False``.
    broadcast_buffers : bool, default True
        Whether to broadcast ``named_buffers``.
    sparse_params : iterable of str, optional
        Names of parameters whose gradient is sparse (``nn.Embedding(sparse=True)``'s
        ``weight``): each stays out of the buckets and gets a row_sparse key of its own
        (``prefix + 'sparse/' + name``); at ``step()`` only the rows some worker touched
        travel, and ``.grad`` becomes their combined gradient as a coalesced sparse tensor
        (the same rows and values the dense path would give, without the zero rows).
        With ``update_on_kvstore=True`` only on one worker.
    sparse_as_dense : bool, default False
        What a sparse gradient of a parameter not in ``sparse_params`` does: False raises
        ConfigError (it would travel as every row of the table); True sends it dense
        (Horovod's option of the same name).
    collective_bytes : int or None, default 262144
        With ``update_on_kvstore=False``, buckets of at least this many bytes are summed
        among the workers (the collective path, docs/collective.md; the same bits as on the
        servers) where the store allows it (``dist_sync``, two workers or more, no
        encryption, replicas or periodic checkpoints), and stay on the servers elsewhere.
        None or 0: only ``PSKV_COLLECTIVE_BYTES`` (the same 262144 by default) and
        ``kv.set_collective`` choose.
    gradient_as_bucket_view : bool, default False
        DDP's option of the same name, with ``update_on_kvstore=False``: at ``step()`` each
        ``.grad`` becomes a view of its bucket instead of receiving a copy (the same
        numbers, one copy of the gradients less per step; docs/torch.md says what it
        saves). The bucket is written again at the next ``backward``, so a
        ``.grad`` kept from an earlier step changes then; after
        ``zero_grad(set_to_none=False)`` backward accumulates straight into the bucket and
        no gradient is copied at all. Do not write ``.grad`` between ``backward`` and
        ``step()`` (call the returned optimizer's ``synchronize()`` first, as for clipping).

    Returns
    -------
    torch.optim.Optimizer
        With ``step(closure=None)``, ``synchronize()``, ``skip_synchronize()``,
        ``no_sync()``, ``join()`` and ``close()``.

    Raises
    ------
    ConfigError
        For an unknown ``op``, a ``collective_bytes`` that is not None or an int >= 0,
        ``gradient_as_bucket_view=True`` with ``update_on_kvstore=True``, no
        parameters, a ``sparse_params`` name that is not a
        parameter (or, at ``backward``, a sparse gradient outside ``sparse_params``), a
        ``bucket_cap_mb`` that is not positive, a
        ``backward_passes_per_step`` below 1, ``update_on_kvstore`` and ``kv_optimizer``
        that do not fit together, parameters that another DistributedOptimizer hooks, or
        ``update_on_kvstore=False`` on a store that has an optimizer (it would update the
        gradient keys).
    KeyTypeError
        For a store that holds int keys (the gradient keys are str).
    UnsupportedError
        For buffers to broadcast with ``update_on_kvstore=True``, ``sparse_params`` with
        ``update_on_kvstore=True`` on more than one worker, or ``sparse_params`` of a
        model on a CUDA device.
    ValueTypeError
        For parameters that are not torch tensors, or repeated names.
    DeviceError
        For parameters (or buffers) on different devices, naming the first that differs,
        or on a device other than the CPU and CUDA.
    ShapeMismatchError
        If the workers' parameters differ (raised on every worker, naming the parameter);
        from ``backward`` or ``step()``, if a parameter changed shape since.

    Examples
    --------
    ::

        opt = pskv.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kv,
            named_buffers=model.named_buffers())
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    th = import_torch()
    _check_args(optimizer, update_on_kvstore, kv_optimizer, op, backward_passes_per_step)
    guard = _check_store(kv, prefix, update_on_kvstore)
    cap_bytes = bucket_cap_bytes(bucket_cap_mb)
    if collective_bytes is not None and (isinstance(collective_bytes, bool) or not isinstance(
            collective_bytes, int) or collective_bytes < 0):
        raise ConfigError(f"collective_bytes={collective_bytes!r} is not a number of bytes. "
                          f"Pass an int >= 0 (default {DEFAULT_COLLECTIVE_BYTES}), or None "
                          "to leave the choice to PSKV_COLLECTIVE_BYTES.")
    if not isinstance(gradient_as_bucket_view, bool):
        raise ConfigError(f"gradient_as_bucket_view={gradient_as_bucket_view!r} is not a "
                          "bool. Pass True or False.")
    if gradient_as_bucket_view and update_on_kvstore:
        raise ConfigError("gradient_as_bucket_view=True with update_on_kvstore=True: the "
                          "store updates the weights and no gradient is written back into "
                          ".grad. Leave gradient_as_bucket_view False, or use "
                          "update_on_kvstore=False.")
    named = [(n, p) for n, p in named_tensors(named_parameters, "DistributedOptimizer") if p.requires_grad]
    if not named:
        raise ConfigError("DistributedOptimizer got no parameters that require grad. Pass "
                          "model.named_parameters().")
    for name, p in named:
        owner = getattr(p, HOOK_ATTR, None)
        if owner is not None:
            raise ConfigError(
                f"parameter {name!r} is synchronized already by a DistributedOptimizer "
                f"(prefix={owner!r}); wrapping it again would send its gradient twice. "
                "Wrap each optimizer once, or call close() on the first one.", key=name)
    buffers = [] if named_buffers is None or not broadcast_buffers else \
        named_tensors(named_buffers, "DistributedOptimizer named_buffers")
    if buffers and update_on_kvstore:
        raise UnsupportedError(
            "broadcast_buffers with update_on_kvstore=True: the store's optimizer would "
            "update the buffer keys too. Pass broadcast_buffers=False (each worker keeps its "
            "own buffers, as MXNet does), or use update_on_kvstore=False.")
    check_one_device(named + buffers, "DistributedOptimizer")
    all_names, all_params = [n for n, _ in named], [p for _, p in named]
    sparse_at = check_sparse_names(sparse_params, all_names, all_params)
    if sparse_at and all_params[0].is_cuda:
        raise UnsupportedError(
            f"sparse_params with a model on {all_params[0].device}: parameter "
            f"{all_names[sorted(sparse_at)[0]]!r} would travel as row_sparse rows, which "
            "pskv reads from host memory only. Pass sparse_as_dense=True (and no "
            "sparse_params), or keep the model on the CPU.",
            key=all_names[sorted(sparse_at)[0]])
    names = [n for i, n in enumerate(all_names) if i not in sparse_at]
    params = [p for i, p in enumerate(all_params) if i not in sparse_at]
    sparse = SparseParams(kv, [all_names[i] for i in sparse_at],
                          [all_params[i] for i in sparse_at], prefix, update_on_kvstore,
                          kv.num_workers if op == "average" else 1)
    sync = Synchronizer(kv, names, params, prefix, update_on_kvstore, op, cap_bytes, overlap,
                        backward_passes_per_step, bool(sparse_as_dense),
                        gradient_as_bucket_view)
    sync.sparse = sparse if len(sparse) else None
    if kv.num_workers > 1:
        check_same_layout(kv, prefix, all_names, all_params, "DistributedOptimizer")
    if update_on_kvstore:
        kv.set_optimizer(kv_optimizer)
    prefer = getattr(kv, "_prefer_collective", None)
    if collective_bytes and not update_on_kvstore and prefer is not None:
        chosen = [b.key for b in sync.buckets
                  if b.flat.numel() * b.flat.element_size() >= collective_bytes]
        if buffers and sync.buckets and sync.buckets[-1].key in chosen:
            # the buffers ride in the last bucket's message: on its path, one exchange
            chosen += _Buffers.key_names(buffers, prefix)
        prefer(chosen)
    if sync.buckets:
        init_keys(kv, [b.key for b in sync.buckets], sync.initial_values(),
                  "DistributedOptimizer", prefix)
    sparse.init("DistributedOptimizer")
    bufs = _Buffers(kv, buffers, prefix) if buffers else None
    if bufs is not None:
        bufs.init("DistributedOptimizer", prefix)
        sync.buffers = bufs
    if update_on_kvstore:           # every worker starts from rank 0's weights
        for bucket in sync.buckets:
            kv.pull(bucket.key, out=bucket.weights)
        with th.no_grad():
            for bucket in sync.buckets:
                copy_all([params[i] for i in bucket.members], bucket.weight_views)
    sync.install_hooks()
    base = type(optimizer) if optimizer is not None else th.optim.Optimizer
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    if optimizer is None:
        wrapped = cls(all_params, {})
    else:
        wrapped = object.__new__(cls)
        # share param_groups, state and hooks; not a step an LR scheduler put on the instance
        wrapped.__dict__.update((k, v) for k, v in optimizer.__dict__.items() if k != "step")
    wrapped._pskv_sync = sync
    wrapped._pskv_buffers = bufs
    wrapped._pskv_release = None
    if guard is not None:           # no store optimizer may run on these keys from now on
        guard.hold(prefix)
        wrapped._pskv_release = lambda: guard.release(prefix)
    return wrapped  # type: ignore[no-any-return]

