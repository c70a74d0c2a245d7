"""Pinned host buffers between CUDA memory and a store, reused across calls, and the copies
through them.

The one module of pskv that touches CUDA streams and events (through torch, which the
caller hands in: it is imported only once a store meets a CUDA value). Invariants:

* a buffer is held by one call at a time (``take`` ... ``give``), and pinned memory is
  allocated only when no free buffer of that shape and dtype is left, so a training loop
  allocates none after its first step;
* a device-to-host copy (``read``) is issued on the current stream of the source's device,
  so it reads the tensor after the work the caller queued there, and ``read`` returns only
  once the bytes are in the buffer (an event recorded after the copies, waited for);
* a host-to-device copy (``write``) is issued on the current stream of the destination's
  device and not waited for: work the caller queues on that stream afterwards sees the
  values. The buffer is given back with an event recorded after the copy, and ``take``
  waits for that event before the buffer is handed out again.
"""
from __future__ import annotations

import threading
from typing import Any, Iterable

import numpy as np

__all__ = ["Pinned", "PinnedPool", "read", "write"]


class Pinned:
    """One pinned host buffer: a CPU torch tensor in page-locked memory, its NumPy view,
    and the event of the last host-to-device copy from it (None when none is in flight)."""

    __slots__ = ("array", "event", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.array: np.ndarray = tensor.numpy()
        self.event: Any = None

    def ready(self) -> None:
        """Wait until no copy from this buffer is in flight (then it may be written)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class PinnedPool:
    """Free pinned buffers by ``(shape, dtype)``; thread-safe.

    Parameters
    ----------
    torch : module
        The torch module (imported by the caller).
    """

    def __init__(self, torch: Any) -> None:
        self._th = torch
        self._free: dict[tuple[tuple[int, ...], Any], list[Pinned]] = {}
        self._lock = threading.Lock()
        #: pinned buffers allocated so far, and their bytes (a steady loop stops adding)
        self.allocated = 0
        self.nbytes = 0

    def take(self, shape: tuple[int, ...], dtype: Any) -> Pinned:
        """A buffer of ``shape`` and torch ``dtype`` no copy reads any more."""
        with self._lock:
            free = self._free.get((shape, dtype))
            buf = free.pop() if free else None
        if buf is None:
            buf = Pinned(self._th.empty(shape, dtype=dtype, pin_memory=True))
            with self._lock:
                self.allocated += 1
                self.nbytes += buf.array.nbytes
        else:
            buf.ready()
        return buf

    def give(self, bufs: Iterable[Pinned]) -> None:
        """Return ``bufs`` (each with its in-flight event, if any) for later calls."""
        with self._lock:
            for buf in bufs:
                self._free.setdefault((tuple(buf.tensor.shape), buf.tensor.dtype),
                                      []).append(buf)

    def clear(self) -> None:
        """Forget the free buffers (after their copies finished): their memory is freed."""
        with self._lock:
            bufs = [b for free in self._free.values() for b in free]
            self._free.clear()
        for buf in bufs:
            buf.ready()


def read(torch: Any, pairs: list[tuple[Pinned, Any]]) -> None:
    """``buf := tensor`` for each pair (a CUDA tensor into a pinned buffer), each copy on
    the current stream of its tensor's device; returns when every byte has arrived."""
    devices: dict[Any, None] = {}
    for buf, tensor in pairs:
        buf.tensor.copy_(tensor, non_blocking=True)
        devices[tensor.device] = None
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def write(torch: Any, pairs: list[tuple[Pinned, list[Any]]]) -> None:
    """``outs[0] := buf`` (host to device) for each pair, then ``o := outs[0]`` (device to
    device) for the other outs, on the outs' current streams; nothing is waited for.

    Each buffer gets the event recorded on its first out's stream after these copies.
    """
    last: dict[Any, list[Pinned]] = {}
    for buf, outs in pairs:
        first = outs[0]
        first.copy_(buf.tensor, non_blocking=True)
        for other in outs[1:]:
            other.copy_(first, non_blocking=True)
        last.setdefault(first.device, []).append(buf)
    for device, bufs in last.items():
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        for buf in bufs:
            buf.event = done
