"""The gradient synchronizer: bucketed pushpulls, started by autograd hooks during backward.

Invariants: bucket ``i`` is sent only after buckets ``0 .. i-1`` (so every worker sends its
buckets in the same order, and one worker never waits in a round the others have not
begun); at most one pushpull is in flight at a time, on one communication thread; a
bucket's ``flat`` and ``weights`` are touched by the backward thread only before the bucket
is sent and by ``finish`` only after its pushpull returned.

Why one thread and ``pushpull``: the dist store releases its lock while a call waits for
replies, so a second thread may push while backward goes on in the first; ``pushpull``
sends push and pull as one message per server, and is never held back by the store's
small-push coalescing (``kvstore/_held.py`` holds only plain pushes).
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import ConfigError, ShapeMismatchError
from ._broadcast import import_torch
from ._buckets import Bucket, assign_buckets

if TYPE_CHECKING:
    import torch

__all__ = ["HOOK_ATTR", "Synchronizer"]

#: the attribute a synchronized parameter carries: the prefix of the optimizer that hooks it
HOOK_ATTR = "_pskv_synchronized_by"


class Synchronizer:
    """What a DistributedOptimizer adds to its torch optimizer: buckets, hooks and a thread.

    Parameters mirror :func:`pskv.torch.DistributedOptimizer`'s; ``cap_bytes`` None gives
    every parameter a bucket of its own.
    """

    def __init__(self, kv: Any, names: list[str], params: list[torch.Tensor], prefix: str,
                 update_on_kvstore: bool, op: str, cap_bytes: int | None, overlap: bool,
                 backward_passes_per_step: int, sparse_as_dense: bool = False) -> None:
        th = import_torch()
        self.kv = kv
        self.names = names
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.prefix = prefix
        self.update_on_kvstore = update_on_kvstore
        self.divisor = kv.num_workers if op == "average" else 1
        self.passes = backward_passes_per_step
        self.overlap = overlap
        self.sparse_as_dense = sparse_as_dense
        self.sparse: Any = None             # the SparseParams, set by DistributedOptimizer
        self.skip = False
        self.no_sync_depth = 0
        self.buckets: list[Bucket] = []
        self.where: list[tuple[int, int]] = [(0, 0)] * len(params)   # param -> (bucket, j)
        for b, members in enumerate(assign_buckets(params, cap_bytes)):
            numels = [params[i].numel() for i in members]
            offsets = [sum(numels[:j]) for j in range(len(numels))]
            flat = th.zeros(sum(numels), dtype=params[members[0]].dtype)
            self.buckets.append(Bucket(b, f"{prefix}bucket.{b}", members, offsets, numels,
                                       flat, flat.clone() if update_on_kvstore else None))
            for j, i in enumerate(members):
                self.where[i] = (b, j)
        self.countdown = [self.passes] * len(params)
        self.next_send = 0                  # the first bucket not yet sent
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None
        self.handles: list[Any] = []

    # ---- setup ------------------------------------------------------------------------
    def initial_values(self) -> list[torch.Tensor]:
        """Each bucket's first value: zeros (gradients), or the flattened weights."""
        out = []
        for bucket in self.buckets:
            if bucket.weights is None:
                out.append(bucket.flat)
                continue
            for j, i in enumerate(bucket.members):
                bucket.view(j, bucket.weights).copy_(self.params[i].detach().reshape(-1))
            out.append(bucket.weights)
        return out

    def install_hooks(self) -> None:
        """Mark every parameter as ours and, with ``overlap``, hook its gradient."""
        for p in self.params + self._sparse_params():
            setattr(p, HOOK_ATTR, self.prefix)
        if self.overlap:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="pskv-torch")
            self.handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                            for i, p in enumerate(self.params)]

    def _sparse_params(self) -> list[torch.Tensor]:
        return [] if self.sparse is None else list(self.sparse.params)

    def close(self) -> None:
        """Remove the hooks and the marks, and stop the thread (after what is in flight)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for p in self.params + self._sparse_params():
            if getattr(p, HOOK_ATTR, None) == self.prefix:
                delattr(p, HOOK_ATTR)
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None

    # ---- during backward ----------------------------------------------------------------
    def _hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self.no_sync_depth or self.skip:
                return
            self.countdown[i] -= 1
            if self.countdown[i] > 0:
                return
            if self.countdown[i] < 0:
                raise ConfigError(
                    f"parameter {self.names[i]!r} got a gradient more than "
                    f"backward_passes_per_step={self.passes} times before step(). Call "
                    "step() after each group of backward passes, raise "
                    "backward_passes_per_step, or accumulate inside opt.no_sync().",
                    key=self.names[i])
            self.ready(i)
        return hook

    def _grad(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s gradient, dense, checked against its shape at construction."""
        p = self.params[i]
        grad = p.grad
        if tuple(p.shape) != self.shapes[i] or (grad is not None
                                                and tuple(grad.shape) != self.shapes[i]):
            raise ShapeMismatchError(
                f"parameter {self.names[i]!r} has shape {tuple(p.shape)} now, but had "
                f"{self.shapes[i]} when the DistributedOptimizer was built (its store "
                "buckets have that size). Build a new DistributedOptimizer (with a new "
                "prefix=) after changing the model.", key=self.names[i],
                shape=tuple(p.shape))
        if grad is not None and grad.layout != import_torch().strided:
            if not self.sparse_as_dense:
                raise ConfigError(
                    f"parameter {self.names[i]!r} got a sparse gradient "
                    "(nn.Embedding(sparse=True)), which would travel dense: every row, "
                    "every step. Pass sparse_params=[" + repr(self.names[i]) + "] to "
                    "DistributedOptimizer (rows as row_sparse), or sparse_as_dense=True.",
                    key=self.names[i])
            grad = grad.to_dense()    # sparse_as_dense: Horovod's option of the same name
        return grad

    def ready(self, i: int) -> None:
        """Copy parameter ``i``'s gradient into its bucket; send what became sendable."""
        b, j = self.where[i]
        bucket = self.buckets[b]
        grad = self._grad(i)
        view = bucket.view(j)
        if grad is None:
            view.zero_()        # every worker pushes every key in every sync round
        else:
            view.copy_(grad.reshape(-1))
            if self.divisor != 1:
                view.div_(self.divisor)   # DDP divides before it sums (Reducer's div_factor)
        with self.lock:
            bucket.ready.add(j)
            self._send_ready()

    def _send_ready(self) -> None:
        """Send complete buckets in order (lock held)."""
        while self.next_send < len(self.buckets):
            bucket = self.buckets[self.next_send]
            if len(bucket.ready) < len(bucket.members):
                return
            if self.executor is None:
                self._pushpull(bucket)
            else:
                bucket.future = self.executor.submit(self._pushpull, bucket)
            self.next_send += 1

    def _pushpull(self, bucket: Bucket) -> None:
        if bucket.weights is None:
            self.kv.pushpull(bucket.key, bucket.flat)       # the sum, back into flat
        else:
            self.kv.pushpull(bucket.key, bucket.flat, out=bucket.weights)

    # ---- in step() --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Send what backward did not, wait for every bucket, then write the results into
        ``.grad`` (or, with update_on_kvstore, into the parameters)."""
        th = import_torch()
        try:
            for bucket in self.buckets:
                for j, i in enumerate(bucket.members):
                    if j not in bucket.ready:
                        self.ready(i)
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.result()
        finally:
            self.reset()
        with th.no_grad():
            for bucket in self.buckets:
                for j, i in enumerate(bucket.members):
                    p = self.params[i]
                    if bucket.weights is not None:
                        p.copy_(bucket.view(j, bucket.weights).view_as(p))
                    elif p.grad is None or p.grad.layout != th.strided:
                        p.grad = bucket.view(j).view_as(p).clone()
                    else:
                        p.grad.copy_(bucket.view(j).view_as(p))
        if self.sparse is not None:
            self.sparse.synchronize()

    def reset(self) -> None:
        """Forget this step's progress (after a synchronize, or one that failed)."""
        with self.lock:
            for bucket in self.buckets:
                if bucket.future is not None and not bucket.future.done():
                    bucket.future.cancel()
                bucket.ready.clear()
                bucket.future = None
            self.next_send = 0
            self.countdown = [self.passes] * len(self.params)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1
