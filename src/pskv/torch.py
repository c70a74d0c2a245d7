"""Data-parallel PyTorch training on a pskv KVStore, in the style Horovod users know.

Every KVStore call accepts CPU torch tensors: a push reads the tensor's memory through
DLPack, a pull writes straight into it (``requires_grad`` parameters included), and the
store copies only what it keeps. On top of that this module offers:

* :func:`broadcast_parameters`: make every worker's parameters (or whole ``state_dict``)
  equal to the root worker's, in place.
* :func:`broadcast_optimizer_state`: the same for a torch optimizer's state.
* :func:`DistributedOptimizer`: wrap a ``torch.optim`` optimizer so that ``step()`` first
  sums (by default: averages) the gradients over all workers through the store, or, with
  ``update_on_kvstore=True``, lets the store's own optimizer update the weights.

torch is an optional dependency (``pip install 'pskv[torch]'``): ``import pskv`` never
imports this module, and this module imports torch only when one of its functions runs.
See ``docs/torch.md``.

Examples
--------
A training script (run it under ``pskv-launch -n 2 -s 1 python train.py``)::

    import pskv as mx
    import pskv.torch as pt
    import torch

    kv = mx.kv.create('dist_sync')
    model = torch.nn.Linear(10, 1)
    pt.broadcast_parameters(model.state_dict(), kv)          # every worker starts equal
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), kv)
    for x, y in shard_of_the_data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()                                           # averaged gradients
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from .errors import ConfigError, KeyAlreadyInitializedError, ValueTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters"]

#: what ``op`` may be: how the pushed gradients of the workers are combined
_OPS = ("average", "sum")


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise ImportError("pskv.torch needs PyTorch. Install it with "
                          "pip install 'pskv[torch]' (or pip install torch).") from err
    return torch


def _named_tensors(params: Any, what: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a state_dict, named_parameters() or a list of pairs;
    names unique, tensors on the CPU."""
    th = _import_torch()
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueTypeError(
                f"{what} takes a state_dict, named_parameters() or a list of (name, tensor) "
                f"pairs; got an item {type(item).__name__}. Pass model.state_dict() or "
                "model.named_parameters().")
        name, tensor = item
        if not isinstance(tensor, th.Tensor):
            raise ValueTypeError(f"{what}: entry {name!r} is a {type(tensor).__name__}, not "
                                 "a torch tensor. Leave it out.", key=name)
        if tensor.device.type != "cpu":
            raise ValueTypeError(
                f"{what}: tensor {name!r} is on device {tensor.device}; pskv stores hold host "
                "memory. Keep the model on the CPU.", key=name)
        if name in seen:
            raise ValueTypeError(f"{what}: the name {name!r} appears twice. Names must be "
                                 "unique.", key=name)
        seen.add(name)
        out.append((name, tensor))
    return out


def _check_root(kv: Any, root_rank: int) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < kv.num_workers:
        raise ConfigError(f"root_rank={root_rank!r} is not a worker rank; this store has "
                          f"{kv.num_workers} workers (ranks 0 to {kv.num_workers - 1}).")


def _init_keys(kv: Any, keys: list[str], tensors: list[torch.Tensor], what: str,
               prefix: str) -> None:
    """``kv.init(keys, tensors)``; a key that exists already raises with the real fix.

    Each key gets one value here, so init's only KeyAlreadyInitializedError is a key that an
    earlier call initialized: the fix is a new ``prefix=``, not a push.
    """
    try:
        kv.init(keys, tensors)      # collective: rank 0's values are kept
    except KeyAlreadyInitializedError as err:
        raise KeyAlreadyInitializedError(
            f"{what}: key {err.key!r} exists already in this store: an earlier {what} (or "
            f"kv.init) with prefix={prefix!r} initialized it, and a key takes one init. Pass "
            f"a prefix not used before, e.g. prefix={prefix + 'round2/'!r}, so this call gets "
            "new keys.", key=err.key, store_type=err.store_type) from err


def _broadcast(kv: Any, keys: list[str], tensors: list[torch.Tensor], root_rank: int,
               what: str, prefix: str) -> None:
    """Every worker's ``tensors`` := the root's, in place (collective)."""
    if not keys:
        return
    _init_keys(kv, keys, tensors, what, prefix)
    if root_rank != 0:
        # the root pushes its values, every other worker zeros: the round's sum is the root's
        th = _import_torch()
        kv.push(keys, [t if kv.rank == root_rank else th.zeros_like(t) for t in tensors])
    kv.pull(keys, out=tensors)


def broadcast_parameters(params: Any, kv: Any, root_rank: int = 0, prefix: str = "") -> None:
    """Overwrite every worker's tensors with the root worker's values, in place.

    A collective call: every worker calls it with the same names, shapes and dtypes. Each
    tensor gets a new store key ``prefix + name``, initialized from the root's value; then
    every worker pulls it straight into its own tensor's memory.

    Parameters
    ----------
    params : Mapping[str, torch.Tensor] or iterable of (str, torch.Tensor)
        ``model.state_dict()`` (parameters and buffers) or ``model.named_parameters()``.
    kv : KVStore
        A store with str keys (``local`` or ``dist_*``).
    root_rank : int, default 0
        The worker whose values win. A root other than 0 broadcasts by a push round, so
        the store must have no optimizer set at that point.
    prefix : str, default ''
        Put before each name to form its key. Each broadcast needs keys of its own: give
        a second broadcast on the same store a new prefix (``prefix='epoch5/'``).

    Raises
    ------
    ValueTypeError
        For an entry that is not a CPU tensor, or a repeated name.
    ConfigError
        For a ``root_rank`` that is not a worker's rank.
    KeyAlreadyInitializedError
        If a key ``prefix + name`` exists already (an earlier broadcast with the same
        ``prefix``): pass a new ``prefix``.
    KVStoreError
        If the workers disagree on names, shapes or dtypes (raised on every worker).

    Examples
    --------
    ::

        model = torch.nn.Linear(4, 2)
        pskv.torch.broadcast_parameters(model.state_dict(), kv)
    """
    _check_root(kv, root_rank)
    named = _named_tensors(params, "broadcast_parameters")
    _broadcast(kv, [prefix + n for n, _ in named], [t for _, t in named], root_rank,
               "broadcast_parameters", prefix)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, kv: Any, root_rank: int = 0,
                              prefix: str = "optimizer/") -> None:
    """Overwrite every worker's torch optimizer state and hyperparameters with the root's.

    State tensors (momentum buffers, Adam moments, step counts) are pulled into the
    optimizer's own tensors in place; numeric hyperparameters of every param group
    (``lr``, ``momentum``, ...) and Python-number state entries are set from the root's.
    A collective call; every worker's optimizer must hold the same kinds of state (for
    example, every worker has stepped, or none has).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
    kv : KVStore
    root_rank : int, default 0
    prefix : str, default 'optimizer/'
        Put before each state entry's name to form its key.
    """
    th = _import_torch()
    _check_root(kv, root_rank)
    numbers: list[tuple[dict[Any, Any], Any]] = []    # (container, key) of Python numbers
    named: list[tuple[str, torch.Tensor]] = []
    for group in optimizer.param_groups:
        for name in sorted(k for k in group if k != "params"):
            if _is_number(group[name]):
                numbers.append((group, name))
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                            for p in g["params"])}
    for param, state in optimizer.state.items():
        i = index.get(id(param))
        if i is None:
            continue
        for name in sorted(state):
            value = state[name]
            if isinstance(value, th.Tensor):
                named.append((f"state.{i}.{name}", value))
            elif _is_number(value):
                numbers.append((state, name))
    named.sort(key=lambda nt: nt[0])
    scalars = th.tensor([float(c[k]) for c, k in numbers], dtype=th.float64)
    keys = [prefix + n for n, _ in named] + [prefix + "numbers"]
    _broadcast(kv, keys, [t for _, t in named] + [scalars], root_rank,
               "broadcast_optimizer_state", prefix)
    for (container, key), value in zip(numbers, scalars.tolist()):
        container[key] = type(container[key])(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Sync:
    """What a DistributedOptimizer adds to the torch optimizer: the store, the keys and the
    mode. Invariant: ``keys[i]`` holds ``params[i]``'s gradient (or weight), initialized."""

    def __init__(self, kv: Any, names: list[str], params: list[torch.Tensor], prefix: str,
                 update_on_kvstore: bool, op: str) -> None:
        self.kv = kv
        self.names = names
        self.params = params
        self.keys = [prefix + n for n in names]
        self.update_on_kvstore = update_on_kvstore
        self.op = op
        self.skip = False

    def grads(self) -> list[torch.Tensor]:
        """Every parameter's ``.grad``; zeros where there is none, dense where sparse (each
        worker must push every key in every sync round)."""
        th = _import_torch()
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = th.zeros_like(p)
            elif p.grad.layout != th.strided:
                p.grad = p.grad.to_dense()
            out.append(p.grad)
        return out

    def synchronize(self) -> None:
        grads = self.grads()
        scale = 1.0 / self.kv.num_workers if self.op == "average" else 1.0
        if self.update_on_kvstore:
            if scale != 1.0:       # the store's optimizer gets the average: push g / W
                for g in grads:
                    g.mul_(scale)
            self.kv.pushpull(self.keys, grads, out=self.params)   # new weights, in place
            return
        self.kv.pushpull(self.keys, grads)    # the sum of every worker's, into .grad in place
        if scale != 1.0:
            for g in grads:
                g.mul_(scale)


class _DistributedMixin:
    """The methods a DistributedOptimizer puts in front of the wrapped optimizer's class."""

    _pskv_sync: _Sync

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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients over all workers, then step the wrapped optimizer
        (``update_on_kvstore=True``: the store's optimizer has updated the weights and the
        torch optimizer does not step).

        ``closure``, if given, is called once first (under ``torch.enable_grad()``) to
        compute the loss and gradients; its result is returned.
        """
        sync = self._pskv_sync
        loss = None
        if closure is not None:
            with _import_torch().enable_grad():
                loss = closure()
        if not sync.skip:
            sync.synchronize()
        if not sync.update_on_kvstore:
            super().step()  # type: ignore[misc]
        return loss


def DistributedOptimizer(  # noqa: N802 - Horovod's name for the same thing
        optimizer: torch.optim.Optimizer | None, named_parameters: Any, kv: Any,
        update_on_kvstore: bool = False, kv_optimizer: Any = None, op: str = "average",
        prefix: str = "opt/") -> torch.optim.Optimizer:
    """Wrap a torch optimizer so that ``step()`` first combines the gradients of all workers.

    A collective call: every worker constructs it the same way (it initializes one store
    key per parameter, and in a dist store keys are initialized together). Use the returned
    optimizer from then on; it is an instance of a subclass of ``optimizer``'s class that
    shares its parameter groups and state, so ``zero_grad``, ``state_dict``,
    ``load_state_dict`` and torch's LR schedulers work as before.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer or None
        The optimizer that steps with the combined gradients. With
        ``update_on_kvstore=True`` it is not stepped and may be None.
    named_parameters : iterable of (str, torch.Tensor) or Mapping
        ``model.named_parameters()``: the parameters to synchronize (those without
        ``requires_grad`` are left out); names must be the same on every worker.
    kv : KVStore
        A store with str keys (``local`` or ``dist_*``), without an optimizer when
        ``update_on_kvstore=False``.
    update_on_kvstore : bool, default False
        False: push each ``.grad`` (key ``prefix + name``), pull the sum over the workers
        back into ``.grad`` (divided by ``kv.num_workers`` for ``op='average'``), then step
        ``optimizer``. True: ``kv.set_optimizer(kv_optimizer)``; each step pushes the
        gradients (pre-divided by ``kv.num_workers`` for ``op='average'``) and pulls the
        store's new weights into the parameters in place. The keys start from rank 0's
        parameters, which every worker pulls at construction.
    kv_optimizer : pskv.optimizer.Optimizer, optional
        Required with ``update_on_kvstore=True``, e.g. ``mx.optimizer.SGD(learning_rate=0.1)``.
    op : {'average', 'sum'}, default 'average'
        How the workers' gradients are combined.
    prefix : str, default 'opt/'
        Put before each parameter name to form its key; keeps them apart from the keys of
        :func:`broadcast_parameters`.

    Returns
    -------
    torch.optim.Optimizer
        With ``step(closure=None)``, ``synchronize()`` and ``skip_synchronize()``.

    Raises
    ------
    ConfigError
        For an unknown ``op``, no parameters, or ``update_on_kvstore`` and
        ``kv_optimizer`` that do not fit together.
    ValueTypeError
        For parameters that are not CPU tensors, or repeated names.

    Examples
    --------
    ::

        opt = pskv.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kv)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    th = _import_torch()
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
    named = [(n, p) for n, p in _named_tensors(named_parameters, "DistributedOptimizer")
             if p.requires_grad]
    if not named:
        raise ConfigError("DistributedOptimizer got no parameters that require grad. Pass "
                          "model.named_parameters().")
    names, params = [n for n, _ in named], [p for _, p in named]
    sync = _Sync(kv, names, params, prefix, update_on_kvstore, op)
    if update_on_kvstore:
        kv.set_optimizer(kv_optimizer)
    _init_keys(kv, sync.keys, params, "DistributedOptimizer", prefix)
    if update_on_kvstore:
        kv.pull(sync.keys, out=params)   # every worker starts from rank 0's weights
    base = type(optimizer) if optimizer is not None else th.optim.Optimizer
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    if optimizer is None:
        wrapped = cls(params, {})
    else:
        wrapped = object.__new__(cls)
        # share param_groups, state and hooks; not a step an LR scheduler put on the instance
        wrapped.__dict__.update((k, v) for k, v in optimizer.__dict__.items() if k != "step")
    wrapped._pskv_sync = sync
    return wrapped  # type: ignore[no-any-return]
