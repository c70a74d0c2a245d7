"""Buckets: which parameters share a store key, and the check that every worker agrees.

Invariants: each parameter is in exactly one bucket; a bucket holds one dtype; buckets are
numbered in the order backward is expected to fill them (the reverse of the parameter
order, as DDP assumes), and every worker that passed :func:`check_same_layout` has the same
buckets with the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ShapeMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Bucket", "assign_buckets", "bucket_cap_bytes",
           "check_same_layout"]

#: DDP's default bucket size (``bucket_cap_mb=25``)
DEFAULT_BUCKET_CAP_MB = 25.0

@dataclass
class Bucket:
    """One store key's worth of parameters of one dtype, flattened one after another.

    ``members[j]`` is an index into the synchronizer's parameter list, whose values sit at
    ``flat[offsets[j]:offsets[j] + numels[j]]``; ``grads[j]`` (and ``weight_views[j]``)
    is that slice of ``flat`` (of ``weights``) in the parameter's shape, made once, so that
    a step fills and empties the bucket with one ``torch._foreach_copy_`` each.
    """

    index: int
    key: str
    members: list[int]
    offsets: list[int]
    numels: list[int]
    flat: torch.Tensor            # gradients pushed, the round's result pulled back
    weights: torch.Tensor | None  # update_on_kvstore: the store's new weights land here
    grads: list[torch.Tensor] = field(default_factory=list)
    weight_views: list[torch.Tensor] = field(default_factory=list)
    member_params: list[torch.Tensor] = field(default_factory=list)   # params[members[j]]
    shapes: list[Any] = field(default_factory=list)       # their shapes at construction
    waiting: int = 0              # members whose gradient is not final yet in this step
    future: Any = None            # the pushpull in flight (concurrent.futures.Future)
    ready: Any = None             # CUDA: event after the fill, on the filling thread's stream
    landed: Any = None            # CUDA: event after the pushpull's copies into the bucket

    def view(self, j: int, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Member ``j``'s slice of ``flat`` (or of ``buf``), flat."""
        src = self.flat if buf is None else buf
        return src[self.offsets[j]:self.offsets[j] + self.numels[j]]


def bucket_cap_bytes(bucket_cap_mb: Any) -> int | None:
    """``bucket_cap_mb`` (MB of 2**20 bytes, DDP's unit) as bytes; None: one key a tensor."""
    if bucket_cap_mb is None:
        return None
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb > 0:
        raise ConfigError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not a positive number of megabytes. Pass "
            f"e.g. bucket_cap_mb={DEFAULT_BUCKET_CAP_MB} (DDP's default), or None for one "
            "store key per parameter.")
    return max(1, int(bucket_cap_mb * 2**20))


def assign_buckets(params: list[torch.Tensor], cap_bytes: int | None) -> list[list[int]]:
    """Parameter indices per bucket, buckets in the order backward is expected to fill them.

    Walks the parameters in reverse (backward meets the last layer first) and fills one
    open bucket per dtype until it holds ``cap_bytes`` or more, as DDP's
    ``compute_bucket_assignment_by_size`` does; a bucket is numbered by its first member.

    Examples
    --------
    >>> import torch
    >>> ps = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4),
    ...       torch.zeros(4)]
    >>> assign_buckets(ps, cap_bytes=32)
    [[3, 2], [1], [0]]
    >>> assign_buckets(ps, cap_bytes=None)
    [[3], [2], [1], [0]]
    """
    closed: list[list[int]] = []
    open_: dict[Any, list[int]] = {}
    sizes: dict[Any, int] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        if cap_bytes is None:
            closed.append([i])
            continue
        members = open_.setdefault(p.dtype, [])
        members.append(i)
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        if sizes[p.dtype] >= cap_bytes:
            closed.append(open_.pop(p.dtype))
            sizes.pop(p.dtype)
    closed.extend(open_.values())
    order = {i: n for n, i in enumerate(reversed(range(len(params))))}
    closed.sort(key=lambda members: order[members[0]])
    return closed


def check_same_layout(kv: Any, prefix: str, names: list[str], params: list[torch.Tensor],
                      what: str) -> None:
    """Raise ShapeMismatchError on every worker unless all have the same parameters.

    A collective call, before any bucket key is initialized: one init of a one-element key
    per parameter, named ``prefix + 'layout/' + name + str(shape)``, of the parameter's
    dtype. The dist store's init compares every worker's keys, shapes and dtypes and
    raises on every worker at the first difference; this says which parameter it is. No
    push is made, so a store's optimizer does not matter.
    """
    import torch as th
    keys = {f"{prefix}layout/{n}{tuple(p.shape)}": (n, p) for n, p in zip(names, params)}
    try:
        kv.init(list(keys), [th.zeros(1, dtype=p.dtype) for _, p in keys.values()])
    except ShapeMismatchError as err:
        mine = keys.get(err.key)     # type: ignore[call-overload]
        which = (f"parameter {mine[0]!r} (shape {tuple(mine[1].shape)}, {mine[1].dtype} on "
                 f"this worker)" if mine is not None else
                 f"a parameter that this worker does not have ({err.key!r})")
        raise ShapeMismatchError(
            f"{what}: {which} is not the same on every worker (name, shape or dtype; "
            f"the store says: {err}). Build the same model on every worker, and pass the "
            "same named_parameters() everywhere.",
            key=mine[0] if mine is not None else err.key,
            shape=tuple(mine[1].shape) if mine is not None else None) from err
