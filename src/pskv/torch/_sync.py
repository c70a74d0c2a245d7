"""The gradient synchronizer: bucketed pushpulls, started by autograd hooks during backward.

Invariants: bucket ``i`` is sent only after buckets ``0 .. i-1`` (so every worker sends its
buckets in the same order, and one worker never waits in a round the others have not
begun); at most one pushpull is in flight at a time, on one communication thread, or, for
the last bucket when nothing else is in flight, on the thread that completed it; a
bucket's ``flat`` and ``weights`` are touched by the backward thread only before the bucket
is sent and by ``finish`` only after its pushpull returned.

Why one thread and ``pushpull``: the dist store releases its lock while a call waits for
replies, so a second thread may push while backward goes on in the first; ``pushpull``
sends push and pull as one message per server, and is never held back by the store's
small-push coalescing (``kvstore/dist/_held.py`` holds only plain pushes).
"""
from __future__ import annotations

import contextlib
import operator
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import ConfigError, ShapeMismatchError
from ._broadcast import import_torch
from ._buckets import Bucket, assign_buckets

if TYPE_CHECKING:
    import torch

__all__ = ["HOOK_ATTR", "Synchronizer", "copy_all"]

#: the attribute a synchronized parameter carries: the prefix of the optimizer that hooks it
HOOK_ATTR = "_pskv_synchronized_by"


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one call where torch has ``_foreach_copy_``."""
    if not dsts:
        return
    foreach = getattr(import_torch(), "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs)
        return
    for d, src in zip(dsts, srcs):      # pragma: no cover - torch without _foreach_copy_
        d.copy_(src)


def _recorded(device: Any) -> Any:
    """A CUDA event recorded now on ``device``'s current stream (of this thread)."""
    th = import_torch()
    event = th.cuda.Event()
    event.record(th.cuda.current_stream(device))
    return event


class Synchronizer:
    """What a DistributedOptimizer adds to its torch optimizer: buckets, hooks and a thread.

    Parameters mirror :func:`pskv.torch.DistributedOptimizer`'s; ``cap_bytes`` None gives
    every parameter a bucket of its own.

    Per step and parameter the work in Python is one hook call that counts; a bucket is
    filled (one ``_foreach_copy_`` and one division of the whole bucket, the same numbers
    as dividing each gradient) when its last gradient is final, and emptied back into
    ``.grad`` the same way, so a model of many small tensors costs few Python calls.
    With ``grad_views`` the emptying is no copy: ``.grad`` becomes the bucket's view (DDP's
    ``gradient_as_bucket_view``), and a gradient that is that view already (accumulated in
    place after ``zero_grad(set_to_none=False)``) is not copied in either.
    """

    def __init__(self, kv: Any, names: list[str], params: list[torch.Tensor], prefix: str,
                 update_on_kvstore: bool, op: str, cap_bytes: int | None, overlap: bool,
                 backward_passes_per_step: int, sparse_as_dense: bool = False,
                 grad_views: bool = False) -> None:
        th = import_torch()
        self.kv = kv
        self.names = names
        self.params = params
        self.prefix = prefix
        self.update_on_kvstore = update_on_kvstore
        self.divisor = kv.num_workers if op == "average" else 1
        self.passes = backward_passes_per_step
        self.overlap = overlap
        self.sparse_as_dense = sparse_as_dense
        self.sparse: Any = None             # the SparseParams, set by DistributedOptimizer
        self.buffers: Any = None            # the _Buffers, sent with the last bucket
        self.joins = 0                      # DistributedOptimizer.join calls so far
        self.grad_views = grad_views        # .grad := the bucket's views at step()
        self.skip = False
        self.no_sync_depth = 0
        self.buckets: list[Bucket] = []
        self.bucket_of: list[Bucket] = []   # param -> its bucket
        for b, members in enumerate(assign_buckets(params, cap_bytes)):
            numels = [params[i].numel() for i in members]
            offsets = [sum(numels[:j]) for j in range(len(numels))]
            flat = th.zeros(sum(numels), dtype=params[members[0]].dtype,
                            device=params[members[0]].device)
            bucket = Bucket(b, f"{prefix}bucket.{b}", members, offsets, numels, flat,
                            flat.clone() if update_on_kvstore else None)
            bucket.grads = [bucket.view(j).view(params[i].shape) for j, i in enumerate(members)]
            if bucket.weights is not None:
                bucket.weight_views = [bucket.view(j, bucket.weights).view(params[i].shape)
                                       for j, i in enumerate(members)]
            bucket.member_params = [params[i] for i in members]
            bucket.shapes = [params[i].shape for i in members]
            bucket.waiting = len(members)
            self.buckets.append(bucket)
        self.bucket_of = [self.buckets[0]] * len(params) if self.buckets else []
        for bucket in self.buckets:
            for i in bucket.members:
                self.bucket_of[i] = bucket
        self.countdown = [self.passes] * len(params)
        self.next_send = 0                  # the first bucket not yet sent
        #: a data position's seals are on (pskv.data): push every bucket, pull at the end
        self.sealed = False
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
            copy_all(bucket.weight_views, [self.params[i].detach() for i in bucket.members])
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
        bucket = self.bucket_of[i]

        def hook(param: torch.Tensor) -> None:
            if self.no_sync_depth or self.skip:
                return
            left = self.countdown[i] - 1
            self.countdown[i] = left
            if left > 0:
                return
            if left < 0:
                raise ConfigError(
                    f"parameter {self.names[i]!r} got a gradient more than "
                    f"backward_passes_per_step={self.passes} times before step(). Call "
                    "step() after each group of backward passes, raise "
                    "backward_passes_per_step, or accumulate inside opt.no_sync().",
                    key=self.names[i])
            with self.lock:
                bucket.waiting -= 1
                if bucket.waiting == 0 and bucket.index == self.next_send:
                    self._send_ready()
        return hook

    def _shape_error(self, bucket: Bucket, j: int) -> ShapeMismatchError:
        i = bucket.members[j]
        p = self.params[i]
        return ShapeMismatchError(
            f"parameter {self.names[i]!r} has shape {tuple(p.shape)} now, but had "
            f"{tuple(bucket.shapes[j])} when the DistributedOptimizer was built (its store "
            "buckets have that size). Build a new DistributedOptimizer (with a new "
            "prefix=) after changing the model.", key=self.names[i], shape=tuple(p.shape))

    def _sparse_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """A sparse gradient as a dense one (``sparse_as_dense``), or ConfigError."""
        if not self.sparse_as_dense:
            raise ConfigError(
                f"parameter {self.names[i]!r} got a sparse gradient "
                "(nn.Embedding(sparse=True)), which would travel dense: every row, "
                "every step. Pass sparse_params=[" + repr(self.names[i]) + "] to "
                "DistributedOptimizer (rows as row_sparse), or sparse_as_dense=True.",
                key=self.names[i])
        return grad.to_dense()    # sparse_as_dense: Horovod's option of the same name

    def fill(self, bucket: Bucket) -> None:
        """Copy the members' gradients into the bucket (zeros for a member without one:
        every worker pushes every key in every sync round), divided by the divisor.

        Checks every member's shape against the one at construction first (and the
        shape of each gradient it copies).
        """
        params = bucket.member_params
        shapes = [p.shape for p in params]
        if shapes != bucket.shapes:
            raise self._shape_error(bucket, next(
                j for j, (now, had) in enumerate(zip(shapes, bucket.shapes)) if now != had))
        if self.grad_views and all(map(operator.is_, [p.grad for p in params], bucket.grads)):
            # gradient_as_bucket_view, accumulated in place: every gradient is in the bucket
            self._divide(bucket)
            return
        strided = import_torch().strided
        dsts, srcs = [], []
        for j, i in enumerate(bucket.members):
            grad = params[j].grad
            if grad is not None and grad.shape != bucket.shapes[j]:
                raise self._shape_error(bucket, j)
            if grad is None:
                bucket.grads[j].zero_()
                continue
            if grad is bucket.grads[j]:
                continue            # gradient_as_bucket_view: accumulated in place already
            if grad.layout != strided:
                grad = self._sparse_grad(i, grad)
            dsts.append(bucket.grads[j])
            srcs.append(grad)
        copy_all(dsts, srcs)
        self._divide(bucket)

    def _divide(self, bucket: Bucket) -> None:
        if self.divisor != 1:
            # DDP divides before it sums (Reducer's div_factor); per element the same as
            # dividing each gradient
            bucket.flat.div_(self.divisor)

    def _send_ready(self) -> None:
        """Fill and send complete buckets in order (lock held)."""
        last = len(self.buckets) - 1
        if self.next_send == 0:           # a step begins: a Sampler may have begun since
            self.sealed = self.kv._data_sealing()
        while self.next_send <= last:
            bucket = self.buckets[self.next_send]
            if bucket.waiting > 0:
                return
            self.fill(bucket)
            with_buffers = self.buffers is not None and bucket.index == last
            if with_buffers:
                self.buffers.fill()       # after forward: this step's running statistics
            if bucket.flat.is_cuda:
                # the pushpull may run on the communication thread, whose current stream
                # is not this one: it waits for this event before reading the bucket
                bucket.ready = _recorded(bucket.flat.device)
            if self.executor is None:
                self._pushpull(bucket, with_buffers)
            elif bucket.index == last and self._idle():
                # the last bucket, nothing in flight: backward has nothing left to overlap
                # with, so this thread sends it (no hand-off to the thread and back); an
                # error is raised by step(), as the thread's would be
                bucket.future = Future()
                try:
                    self._pushpull(bucket, with_buffers)
                except Exception as err:    # noqa: BLE001 - re-raised by step()
                    bucket.future.set_exception(err)
                else:
                    bucket.future.set_result(None)
            else:
                bucket.future = self.executor.submit(self._pushpull, bucket, with_buffers)
            self.next_send += 1

    def _idle(self) -> bool:
        """Whether no bucket's pushpull is in flight (lock held)."""
        return all(b.future is None or b.future.done() for b in self.buckets[:self.next_send])

    def _pushpull(self, bucket: Bucket, with_buffers: bool = False) -> None:
        if bucket.ready is not None:
            import_torch().cuda.current_stream(bucket.flat.device).wait_event(bucket.ready)
        self._pushpull_ordered(bucket, with_buffers)
        if bucket.ready is not None:     # step() waits for the copies into the bucket
            bucket.landed = _recorded(bucket.flat.device)

    def _pushpull_ordered(self, bucket: Bucket, with_buffers: bool) -> None:
        keys: list[str] = [bucket.key]
        values = [bucket.flat]
        if with_buffers:       # one message: the buffers ride with the last bucket
            keys += self.buffers.keys
            values += self.buffers.flats
        if self.sealed:
            # a data position (pskv.data): every bucket is pushed before the step's one
            # wait, so that no round of the step closes before all of it is on the servers
            # (docs/data.md D5); synchronize() pulls them all
            self.kv.push(keys, values)
        elif bucket.weights is None:
            # the sum, in place; out= names the same tensors so that the reply is read
            # straight into them (the push has left them by then: the round's result comes
            # after every push of it), not into a buffer and copied
            self.kv.pushpull(keys, values, out=values)
        else:
            self.kv.pushpull(bucket.key, bucket.flat, out=bucket.weights)

    def _pull_all(self) -> None:
        """Every bucket's round result (and the buffers'), in one pull: the pushes were
        all sent first (``sealed``)."""
        keys: list[str] = []
        outs: list[torch.Tensor] = []
        for bucket in self.buckets:
            keys.append(bucket.key)
            outs.append(bucket.flat if bucket.weights is None else bucket.weights)
        if self.buffers is not None:
            keys += self.buffers.keys
            outs += self.buffers.flats
        self.kv.pull(keys, out=outs)

    # ---- in step() --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Send what backward did not, wait for every bucket, then write the results into
        ``.grad`` (or, with update_on_kvstore, into the parameters), and the buffers."""
        th = import_torch()
        try:
            with self.lock:
                for bucket in self.buckets[self.next_send:]:
                    bucket.waiting = 0
                self._send_ready()
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.result()
                if bucket.landed is not None:
                    th.cuda.current_stream(bucket.flat.device).wait_event(bucket.landed)
            if self.sealed and self.buckets:
                self._pull_all()
            if not self.buckets and self.buffers is not None:
                self.buffers.fill()
                self.kv.pushpull(self.buffers.keys, self.buffers.flats)
        finally:
            self.reset()
        strided = th.strided
        with th.no_grad():
            for bucket in self.buckets:
                if bucket.weights is not None:
                    copy_all([self.params[i] for i in bucket.members], bucket.weight_views)
                    continue
                if self.grad_views:         # no copy: .grad is the bucket's view
                    for p, view in zip(bucket.member_params, bucket.grads):
                        if p.grad is not view:
                            p.grad = view
                    continue
                dsts, srcs = [], []
                for j, i in enumerate(bucket.members):
                    p = self.params[i]
                    grad = p.grad
                    if grad is None or grad.layout != strided:
                        p.grad = bucket.grads[j].clone()
                    else:
                        dsts.append(grad)
                        srcs.append(bucket.grads[j])
                copy_all(dsts, srcs)
            if self.buffers is not None:
                self.buffers.unpack()
        if self.sparse is not None:
            self.sparse.synchronize()

    def reset(self) -> None:
        """Forget this step's progress (after a synchronize, or one that failed)."""
        with self.lock:
            for bucket in self.buckets:
                if bucket.future is not None and not bucket.future.done():
                    bucket.future.cancel()
                bucket.waiting = len(bucket.members)
                bucket.future = None
                bucket.ready = bucket.landed = None
            self.next_send = 0
            self.countdown = [self.passes] * len(self.params)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1
