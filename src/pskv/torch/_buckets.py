"""Buckets: which parameters share a store key, and the check that every worker agrees.

Invariants: each parameter is in exactly one bucket; a bucket holds one dtype; buckets are
numbered in the order backward is expected to fill them (the reverse of the parameter
order, as DDP assumes), and every worker that passed :func:`check_same_layout` has the same
buckets with the same keys.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ShapeMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Bucket", "assign_buckets", "bucket_cap_bytes",
           "check_same_layout"]

#: DDP's default bucket size (``bucket_cap_mb=25``)
DEFAULT_BUCKET_CAP_MB = 25.0

#: digests are kept below 2**20 so that sums of W of them and of their squares are exact
#: in float64 for any realistic number of workers
_DIGEST_BITS = 20


@dataclass
class Bucket:
    """One store key's worth of parameters of one dtype, flattened one after another.

    ``members[j]`` is an index into the synchronizer's parameter list, whose values sit at
    ``flat[offsets[j]:offsets[j] + numels[j]]``.
    """

    index: int
    key: str
    members: list[int]
    offsets: list[int]
    numels: list[int]
    flat: torch.Tensor            # gradients pushed, the round's result pulled back
    weights: torch.Tensor | None  # update_on_kvstore: the store's new weights land here
    ready: set[int] = field(default_factory=set)
    future: Any = None            # the pushpull in flight (concurrent.futures.Future)

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


def _digest(name: str, p: torch.Tensor) -> int:
    """A small number for name, shape and dtype: 1 to 2**20 - 1."""
    text = f"{name}|{tuple(p.shape)}|{p.dtype}".encode()
    return 1 + zlib.crc32(text) % (2**_DIGEST_BITS - 1)


def check_same_layout(kv: Any, key: str, names: list[str], params: list[torch.Tensor],
                      what: str) -> None:
    """Raise ShapeMismatchError on every worker unless all have the same parameters.

    A collective call (before any bucket key is initialized, so that a mismatch never
    leaves keys of different shapes behind): ``key`` is initialized with one row per
    parameter, every worker pushes its digests and their squares, and the round's sums
    say whether all were equal (``W * sum(d*d) == sum(d)**2`` exactly when every ``d`` is
    the same). The store must have no optimizer yet.
    """
    import torch as th
    digests = th.tensor([_digest(n, p) for n, p in zip(names, params)], dtype=th.float64)
    mine = th.stack([digests, digests * digests, th.ones_like(digests)])
    try:
        kv.init(key, th.zeros_like(mine))
    except ShapeMismatchError as err:
        raise ShapeMismatchError(
            f"{what}: the workers have different numbers of parameters (this worker has "
            f"{len(params)}). Build the same model on every worker, and pass the same "
            "named_parameters() everywhere.", key=key) from err
    total = mine.clone()
    kv.pushpull(key, mine, out=total)
    workers = total[2, 0].item() if len(params) else 1.0
    for j, (name, p) in enumerate(zip(names, params)):
        if workers * total[1, j].item() != total[0, j].item() ** 2:
            raise ShapeMismatchError(
                f"{what}: parameter #{j} ({name!r}, shape {tuple(p.shape)}, {p.dtype} on "
                f"this worker) is not the same on every worker (name, shape or dtype). Build "
                "the same model on every worker, and pass the same named_parameters() in "
                "the same order everywhere.", key=name, shape=tuple(p.shape))
