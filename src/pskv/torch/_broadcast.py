"""Broadcasts: every worker's parameters, buffers or optimizer state := the root's.

Invariant: each call is collective and gives each tensor a key of its own (``prefix + name``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError, DeviceError, KeyAlreadyInitializedError, ValueTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "check_one_device",
           "import_torch", "init_keys", "named_tensors"]


def import_torch() -> Any:
    """The torch module, or an ImportError that says how to install it."""
    try:
        import torch
    except ImportError as err:
        raise ImportError("pskv.torch needs PyTorch. Install it with "
                          "pip install 'pskv[torch]' (or pip install torch).") from err
    return torch


def named_tensors(params: Any, what: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a state_dict, named_parameters() or a list of pairs;
    names unique, tensors on the CPU or a CUDA device."""
    th = import_torch()
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
        if tensor.device.type not in ("cpu", "cuda"):
            raise DeviceError(
                f"{what}: tensor {name!r} is on device {tensor.device}; pskv stores read host "
                "and CUDA memory only. Move the model to the CPU or a CUDA device.",
                key=name, device=str(tensor.device))
        if name in seen:
            raise ValueTypeError(f"{what}: the name {name!r} appears twice. Names must be "
                                 "unique.", key=name)
        seen.add(name)
        out.append((name, tensor))
    return out


def check_one_device(named: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Every tensor of ``named`` is on the first one's device, or DeviceError naming the
    first that is not (a bucket is one flat tensor on one device)."""
    if not named:
        return
    first, device = named[0][0], named[0][1].device
    for name, tensor in named:
        if tensor.device != device:
            raise DeviceError(
                f"{what}: parameter {name!r} is on {tensor.device}, but {first!r} is on "
                f"{device}; a bucket holds its parameters in one flat tensor on one device. "
                f"Move the whole model to one device (model.to({str(device)!r})), or wrap "
                "the parameters of each device in a DistributedOptimizer of its own (with "
                "its own prefix=).", key=name, device=str(tensor.device))


def _check_root(kv: Any, root_rank: int) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < kv.num_workers:
        raise ConfigError(f"root_rank={root_rank!r} is not a worker rank; this store has "
                          f"{kv.num_workers} workers (ranks 0 to {kv.num_workers - 1}).")


def init_keys(kv: Any, keys: list[str], tensors: list[Any], what: str,
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
    init_keys(kv, keys, tensors, what, prefix)
    if root_rank != 0 and "async" in kv.type:
        # no rounds: each push replaces the value (no optimizer), so only the root pushes,
        # and the barrier (every earlier push applied) comes before anyone reads
        if kv.rank == root_rank:
            kv.push(keys, tensors)
        kv.barrier()
    elif root_rank != 0:
        # the root pushes its values, every other worker zeros: the round's sum is the root's
        th = import_torch()
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
        For an entry that is not a torch tensor, or a repeated name.
    DeviceError
        For a tensor neither on the CPU nor on a CUDA device this process reaches.
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
    named = named_tensors(params, "broadcast_parameters")
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
    th = import_torch()
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
