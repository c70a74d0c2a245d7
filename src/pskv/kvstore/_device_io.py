"""Values and outs in CUDA memory: read into pinned host buffers before a store call, and
written back after it (docs/gpu.md).

A store calls two things, after :func:`._args.normalize` and before its checks:

* ``values(keys, groups)``: the groups with every CUDA value replaced by a host array (a
  pinned buffer read on the caller's current stream). In a store whose type names
  ``device`` (``device``, ``dist_device_sync``, ...), the CUDA values of one key (one per
  GPU, MXNet's ``CommDevice``) are summed on the first one's GPU, in list order as the host
  sums them (``_reduce._sum_chunk``: ``(v0 + v1) + v2 ...``), and only the sum crosses to
  the host.
* ``outs(keys, groups)``: the groups with the CUDA outs of a key (of one shape and dtype)
  replaced by one pinned buffer; the store writes its result there as into any host out,
  then ``Landing.land()`` copies it to the first out (host to device) and from there to
  the others (device to device), on the callers' current streams.

Both return their groups unchanged, and None, when no value is in device memory: for
NumPy and CPU values the whole cost is one type check per value. Every check (torch
installed, a device this process reaches, a dtype NumPy holds, a writable out) runs before
any copy, so a call refused here changed nothing. Invariant: the pinned buffers of a call
go back to the pool when the call ends (``Staged.release``, ``Landing.land`` or
``Landing.release``), never during it.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import DeviceError, ValueTypeError
from ..nd.ndarray import NDArray
from .._types import Key
from ._pinned import Pinned, PinnedPool, read, write

__all__ = ["DeviceIO", "Landing", "Staged", "device_of", "has_device", "read_ids", "to_device"]

_CPU, _CUDA, _CUDA_HOST = 1, 2, 3
#: DLPack device types, for messages
_KINDS = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
          13: "cuda_managed", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}


def device_of(obj: Any) -> tuple[int, int] | None:
    """``(DLPack device type, index)`` of an array outside host memory; None for a host
    array (NumPy, NDArray, a CPU tensor) or anything that is not an array."""
    t = type(obj)
    if t is np.ndarray or t is NDArray or isinstance(obj, (np.ndarray, NDArray)):
        return None
    if t.__module__.startswith("torch"):          # torch.Tensor, nn.Parameter: no call
        return (_CUDA, obj.get_device()) if getattr(obj, "is_cuda", False) else None
    get = getattr(t, "__dlpack_device__", None)
    if get is None:
        return None
    try:
        kind, index = get(obj)
    except (TypeError, ValueError, RuntimeError, BufferError, AttributeError):
        return None       # not readable as DLPack: the host path says what is wrong
    kind = int(kind)
    return None if kind in (_CPU, _CUDA_HOST) else (kind, int(index))


def has_device(groups: list[list[Any]]) -> bool:
    """Whether any array of ``groups`` is in device memory (one type check per host one)."""
    for vals in groups:
        for v in vals:
            t = type(v)
            if t is np.ndarray or t is NDArray:
                continue
            if device_of(v) is not None:
                return True
    return False


def _name(dev: tuple[int, int]) -> str:
    return f"{_KINDS.get(dev[0], f'device type {dev[0]}')}:{dev[1]}"


def _torch(key: Any, obj: Any, dev: tuple[int, int], what: str) -> Any:
    """The torch module, or DeviceError: CUDA memory is read through torch."""
    try:
        import torch
    except ImportError as err:
        raise DeviceError(
            f"the {what} for key {key!r} is a {type(obj).__name__} in {_name(dev)} memory, "
            "and pskv reads CUDA arrays through PyTorch, which is not installed. Install it "
            "(pip install 'pskv[torch]'), or copy the array to the host first (e.g. "
            "cupy.asnumpy(a)).", key=key, device=_name(dev)) from err
    return torch


def _as_tensor(key: Any, obj: Any, dev: tuple[int, int], what: str) -> Any:
    """``obj`` as a CUDA torch tensor sharing its memory, checked; else DeviceError."""
    name = _name(dev)
    if what == "out" and type(obj).__module__.partition(".")[0] in ("jax", "jaxlib"):
        raise DeviceError(
            f"the out for key {key!r} is a JAX array ({name}), and JAX arrays cannot be "
            "written in place. Pull into a torch tensor or CuPy array, then "
            "jax.numpy.asarray(...) it (or pull with out=None).", key=key, device=name)
    if dev[0] != _CUDA:
        raise DeviceError(
            f"the {what} for key {key!r} is in {name} memory; pskv stores read host and CUDA "
            "memory only. Copy it to the host (or to a CUDA device) first.", key=key,
            device=name)
    th = _torch(key, obj, dev, what)
    count = th.cuda.device_count() if th.cuda.is_available() else 0
    if not 0 <= dev[1] < count:
        raise DeviceError(
            f"the {what} for key {key!r} is on {name}, which this process cannot reach: it "
            f"sees {count} CUDA device(s) (torch.cuda.device_count(); CUDA_VISIBLE_DEVICES "
            "chooses them). Move the array to a device this process uses, or start the "
            "process with that GPU visible.", key=key, device=name)
    if isinstance(obj, th.Tensor):
        tensor = obj.detach()
    else:
        try:
            tensor = th.from_dlpack(obj)      # the producer's stream joins ours (DLPack)
        except (TypeError, ValueError, RuntimeError, BufferError) as err:
            raise DeviceError(
                f"the {what} for key {key!r} ({type(obj).__name__} on {name}) cannot be "
                f"read through DLPack ({err}). Pass a torch tensor, or a CuPy or JAX "
                "array.", key=key, device=name) from err
    if _numpy_dtype(th, tensor.dtype) is None:
        raise ValueTypeError(
            f"the {what} for key {key!r} on {name} has dtype {tensor.dtype}, which a store "
            "cannot hold (no NumPy dtype). Convert it first, e.g. tensor.float().", key=key)
    return tensor


@functools.lru_cache(maxsize=None)
def _numpy_dtype(th: Any, dtype: Any) -> np.dtype[Any] | None:
    """The NumPy dtype of torch ``dtype``; None where NumPy has none (bfloat16, ...)."""
    try:
        return th.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def to_device(device: Any) -> Callable[[np.ndarray], Any]:
    """What ``pull(key)`` (``out=None``) makes for a key initialized with a tensor on
    ``device``: a new tensor there holding the pulled array."""
    return functools.partial(_new_on, device)


def _new_on(device: Any, data: np.ndarray) -> Any:
    import torch  # a CUDA tensor initialized the key: torch is imported
    return torch.from_numpy(data).to(device)


def read_ids(key: Any, obj: Any) -> np.ndarray:
    """Row ids in device memory, copied to the host (small: no pinned buffer)."""
    dev = device_of(obj)
    assert dev is not None
    return _as_tensor(key, obj, dev, "row_ids").cpu().numpy()


class Staged:
    """The pinned buffers of a call's values; ``release`` when the call ends."""

    __slots__ = ("_bufs", "_pool")

    def __init__(self, pool: PinnedPool, bufs: list[Pinned]) -> None:
        self._pool = pool
        self._bufs = bufs

    def release(self) -> None:
        """Give the buffers back (the store has copied or sent their bytes)."""
        self._pool.give(self._bufs)
        self._bufs = []


class Landing:
    """The CUDA outs of a call and the pinned buffers the store writes their values into."""

    __slots__ = ("_io", "_pairs", "_th")

    def __init__(self, io: DeviceIO, th: Any, pairs: list[tuple[Pinned, list[Any]]]) -> None:
        self._io = io
        self._th = th
        self._pairs = pairs

    def land(self) -> None:
        """Copy each buffer into its outs (on their current streams), then release."""
        start = time.perf_counter()
        try:
            write(self._th, self._pairs)
        finally:
            self.release()
            self._io.landing_seconds += time.perf_counter() - start

    def release(self) -> None:
        """Give the buffers back (with their copies' events, if any)."""
        self._io.pool().give(buf for buf, _ in self._pairs)
        self._pairs = []


class DeviceIO:
    """The device side of one store's calls (see the module docstring).

    Parameters
    ----------
    store_type : str
        A type naming ``device`` sums a key's CUDA values on a GPU.
    """

    def __init__(self, store_type: str) -> None:
        self.gpu_sum = "device" in store_type
        self._pool: PinnedPool | None = None
        self._lock = threading.Lock()
        #: seconds spent reading values to the host and landing outs (benchmarks read them)
        self.staging_seconds = 0.0
        self.landing_seconds = 0.0

    def pool(self) -> PinnedPool:
        """The store's pinned buffers (made on first use)."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    import torch  # a CUDA value reached this store: torch is there
                    self._pool = PinnedPool(torch)
        return self._pool

    def values(self, keys: list[Key], groups: list[list[Any]], records: dict[Key, Any],
               compressing: bool = False) -> tuple[list[list[Any]], Staged | None]:
        """``groups`` with host arrays for CUDA values, and their buffers (None: unchanged).

        ``records``: the store's key records, to sum on a GPU only values of the key's
        shape and dtype (a mismatch then goes to the host checks, which name it).
        """
        if not has_device(groups):
            return groups, None
        start = time.perf_counter()
        # every check first: a refused call has copied nothing
        found = [[None if (d := device_of(v)) is None else _as_tensor(k, v, d, "value")
                  for v in vals] for k, vals in zip(keys, groups)]
        import torch as th     # _as_tensor found it
        pool = self.pool()
        pairs: list[tuple[Pinned, Any]] = []
        out: list[list[Any]] = []
        for k, vals, tensors in zip(keys, groups, found):
            rec = records.get(k)
            if self.gpu_sum and not compressing and len(vals) > 1 and rec is not None \
                    and not rec.sparse and all(
                        t is not None and tuple(t.shape) == rec.shape
                        and _numpy_dtype(th, t.dtype) == rec.dtype for t in tensors):
                total = _gpu_sum(th, tensors)
                buf = pool.take(tuple(total.shape), total.dtype)
                pairs.append((buf, total))
                out.append([buf.array])
                continue
            host = []
            for v, t in zip(vals, tensors):
                if t is None:
                    host.append(v)
                    continue
                buf = pool.take(tuple(t.shape), t.dtype)
                pairs.append((buf, t))
                host.append(buf.array)
            out.append(host)
        try:
            read(th, pairs)
        except BaseException:
            pool.give(b for b, _ in pairs)
            raise
        self.staging_seconds += time.perf_counter() - start
        return out, Staged(pool, [b for b, _ in pairs])

    def outs(self, keys: list[Key], groups: list[list[Any]]) \
            -> tuple[list[list[Any]], Landing | None]:
        """``groups`` with one pinned buffer per key (and shape and dtype) for its CUDA
        outs, and the Landing that copies them there (None: unchanged)."""
        if not has_device(groups):
            return groups, None
        found = [[None if (d := device_of(o)) is None else _as_tensor(k, o, d, "out")
                  for o in outs] for k, outs in zip(keys, groups)]
        import torch as th     # _as_tensor found it
        pool = self.pool()
        pairs: list[tuple[Pinned, list[Any]]] = []
        out: list[list[Any]] = []
        for outs, tensors in zip(groups, found):
            host: list[Any] = []
            mine: dict[tuple[tuple[int, ...], Any], list[Any]] = {}
            for o, t in zip(outs, tensors):
                if t is None:
                    host.append(o)
                    continue
                like = mine.get((tuple(t.shape), t.dtype))
                if like is not None:       # one buffer, then device to device
                    like.append(t)
                    continue
                buf = pool.take(tuple(t.shape), t.dtype)
                mine[(tuple(t.shape), t.dtype)] = like = [t]
                pairs.append((buf, like))
                host.append(buf.array)
            out.append(host)
        return out, Landing(self, th, pairs)

    def run(self, keys: list[Key] | None, groups: list[list[Any]] | None,
            okeys: list[Key] | None, ogroups: list[list[Any]] | None,
            records: dict[Key, Any], body: Callable[[Any, Any], Any],
            compressing: bool = False) -> Any:
        """``body(groups, ogroups)`` with host arrays in place of the CUDA values (of
        ``keys``) and outs (of ``okeys``), then the outs landed; a call that raises lands
        nothing and gives every buffer back."""
        staged = landing = None
        if keys is not None:
            assert groups is not None
            groups, staged = self.values(keys, groups, records, compressing)
        try:
            if okeys is not None:
                assert ogroups is not None
                ogroups, landing = self.outs(okeys, ogroups)
            result = body(groups, ogroups)
        except BaseException:
            if landing is not None:
                landing.release()
            raise
        finally:
            if staged is not None:
                staged.release()
        if landing is not None:
            landing.land()
        return result

    def close(self) -> None:
        """Free the pinned buffers (a later CUDA call makes new ones)."""
        if self._pool is not None:
            self._pool.clear()


def _gpu_sum(th: Any, tensors: list[Any]) -> Any:
    """``(t0 + t1) + t2 ...`` on ``t0``'s device, on its current stream (a tensor on
    another GPU is copied there first, ordered after its own stream's work)."""
    device = tensors[0].device
    with th.cuda.device(device):
        moved = [t if t.device == device else t.to(device) for t in tensors]
        total = th.add(moved[0], moved[1])
        for t in moved[2:]:
            total.add_(t)
    return total
