"""A ring of shared memory beside a primary's link to a backup on the same host.

Through a Unix socket every byte a primary streams to its backup is copied twice by the
kernel (into the socket, out of it), with a socket buffer's bookkeeping for every few
pages: about 23 ms of CPU for 64 MB on the machine of ``benchmarks/results``, against
5.5 ms for one memory copy. With a ring, the primary copies a batch's arrays into shared
memory and sends only the header, naming where each array lies; the backup copies them
out into its own buffers and says how far it has read. Two memory copies instead of two
socket copies.

A :class:`RingWriter` is an anonymous ``memfd`` (nothing in the file system: a killed
process leaves nothing behind), sealed at its size, mapped by the primary. Its descriptor
travels with the authenticated link's ``r_ring`` message (SCM_RIGHTS, the one way shared
memory reaches another process: :meth:`.stream.StreamConn.keep_fds`, as the collective's
segments), and :meth:`RingReader.open` maps it only if it is a memfd of exactly the
announced size sealed against any change of size (a peer could otherwise shrink it under
the mapping, and a read past its end would kill the process). Where any of that fails
(another host, TLS or sealed links, ZeroMQ), the link carries the arrays as before.

Layout: :data:`HEADER` bytes, of which the first 8 are ``consumed`` (a little-endian
uint64 the backup writes), then ``size`` bytes of data. Positions are byte counters that
only grow; a position ``p`` lies at ``p % size`` of the data. Rules:

R1. The writer places an array at the next :data:`ALIGN`-aligned position, or at the
    start of the next lap if it would cross the end; it writes only if every byte from
    ``consumed`` to the end of its last array fits in ``size``; else it places nothing
    and the caller sends the arrays on the socket.
R2. The reader takes entries in order: each starts at or after the end of the last one it
    took, lies inside the data and ends within one lap of ``consumed``; it copies the array out, then publishes the end as
    ``consumed``. Anything else is a :class:`ProtocolError` (never a crash).
R3. A writer that reads a ``consumed`` it never allowed (beyond what it wrote, or behind
    the last one it saw) places nothing more (the socket carries the rest).
"""
from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ProtocolError
from .shm import SEALS, map_sealed, supported

__all__ = ["ALIGN", "HEADER", "RingReader", "RingWriter", "supported"]

#: bytes before the data (``consumed`` in the first 8)
HEADER = 64
#: where arrays start (bytes)
ALIGN = 64
#: the array kinds a ring carries: bool, ints, floats (no objects, no structured dtypes)
_KINDS = "biuf"

#: ``land(index, dtype, shape)``: the buffer an array should be copied into, or None
Land = Callable[[int, np.dtype[Any], tuple[int, ...]], "np.ndarray | None"]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RingWriter:
    """The primary's side: ``fd`` to announce, :meth:`place` to write a batch."""

    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"a ring of {size} bytes: give a positive multiple of {ALIGN}")
        fd = os.memfd_create("pskv-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER + size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._mm = mmap.mmap(fd, HEADER + size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self._consumed = np.frombuffer(self._mm, "<u8", 1, 0)
        self._data = np.frombuffer(self._mm, np.uint8, size, HEADER)
        #: the end of what was written (a position); the last ``consumed`` seen
        self.head = self._seen = 0
        self.broken = False

    def place(self, arrays: Sequence[np.ndarray]) -> list[list[Any]] | None:
        """Copy ``arrays`` (contiguous) into the ring and return their entries
        ``[position, nbytes, dtype, shape]``, or None when they do not all fit (R1, R3):
        nothing is written then."""
        if self.broken:
            return None
        consumed = int(self._consumed[0])
        if not self._seen <= consumed <= self.head:
            self.broken = True          # R3: a reader that says what it cannot have read
            return None
        self._seen = consumed
        head, spots = self.head, []
        for a in arrays:
            n = a.nbytes
            if head % self.size + n > self.size:
                head += self.size - head % self.size        # the next lap
            spots.append(head)
            head += _aligned(n)
            if head - consumed > self.size:
                return None
        for at, a in zip(spots, arrays):
            off = at % self.size
            self._data[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        self.head = head
        return [[at, a.nbytes, a.dtype.str, list(a.shape)] for at, a in zip(spots, arrays)]

    def close(self) -> None:
        """Unmap and close the descriptor; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._consumed = np.zeros(1, "<u8")
        self._data = np.zeros(0, np.uint8)
        self.broken = True
        try:
            self._mm.close()
        except BufferError:     # pragma: no cover - a view still alive: unmapped with it
            pass


class RingReader:
    """The backup's side of one primary's ring (:meth:`open`), read by :meth:`read`."""

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self._mm, self.size = mm, size
        self._consumed = np.frombuffer(mm, "<u8", 1, 0)
        self._data = np.frombuffer(mm, np.uint8, size, HEADER)
        #: the end of the last array read (a position)
        self.consumed = int(self._consumed[0])

    @classmethod
    def open(cls, fd: int | None, size: int, who: str) -> RingReader:
        """Map the ring descriptor ``fd`` that ``who`` passed (closed here either way)
        after checking it is a memfd of ``HEADER + size`` bytes sealed against any change
        of size; ProtocolError (naming ``who``) otherwise, and for no descriptor."""
        try:
            if fd is None:
                raise ProtocolError(f"{who} announced a ring but passed no descriptor "
                                    "(only a plain Unix-socket link carries one)")
            if not supported():
                raise ProtocolError("this platform has no sealed memfds: send the arrays")
            if size <= 0 or size % ALIGN:
                raise ProtocolError(f"{who} announced a ring of {size} bytes, not a "
                                    f"positive multiple of {ALIGN}")
            mm = map_sealed(fd, HEADER + size, f"{who}'s ring", writable=True)
        finally:
            if fd is not None:
                os.close(fd)
        return cls(mm, size)

    def read(self, entries: Sequence[Any], land: Land, limit: int) -> list[np.ndarray]:
        """The arrays ``entries`` name, copied out (into ``land``'s buffers where it gives
        one), in order; then ``consumed`` moves past them. ``limit``: the most bytes they
        may have in all. ProtocolError for an entry that breaks R2 (nothing is published
        then)."""
        out: list[np.ndarray] = []
        pos, total = self.consumed, 0
        for i, entry in enumerate(entries):
            at, n, dtype, shape = _entry(entry)
            dt = _dtype(dtype)
            count = 1
            for s in shape:
                count *= s
            total += n
            off = at % self.size
            what = f"ring entry {i} ({n} bytes of {dt.str} {shape} at position {at})"
            if at < pos or off + n > self.size or at + n > self.consumed + self.size:
                raise ProtocolError(f"{what} does not lie after position {pos}, inside "
                                    f"the ring's {self.size} bytes and within one lap of "
                                    "what was read")
            if count * dt.itemsize != n:
                raise ProtocolError(f"{what}: its shape holds {count * dt.itemsize} bytes")
            if total > limit:
                raise ProtocolError(f"{what}: the message's arrays pass {limit} bytes "
                                    "(PSKV_MAX_MESSAGE_BYTES)")
            dst = land(i, dt, tuple(shape))
            if dst is None or dst.dtype != dt or dst.shape != tuple(shape) or \
                    not dst.flags.c_contiguous:
                dst = np.empty(tuple(shape), dt)
            dst.reshape(-1).view(np.uint8)[:] = self._data[off:off + n]
            out.append(dst)
            pos = at + _aligned(n)
        self.consumed = pos
        self._consumed[0] = pos
        return out

    def close(self) -> None:
        """Unmap; idempotent."""
        self._consumed = np.zeros(1, "<u8")
        self._data = np.zeros(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:     # pragma: no cover - a view still alive: unmapped with it
            pass


def _entry(entry: Any) -> tuple[int, int, str, list[int]]:
    if not isinstance(entry, list) or len(entry) != 4:
        raise ProtocolError("a ring entry is [position, bytes, dtype, shape]")
    at, n, dtype, shape = entry
    if type(at) is not int or type(n) is not int or not 0 <= at < 1 << 62 or \
            not 0 <= n < 1 << 40 or not isinstance(dtype, str) or len(dtype) > 8 or \
            not isinstance(shape, list) or len(shape) > 32 or \
            not all(type(s) is int and 0 <= s < 1 << 40 for s in shape):
        raise ProtocolError("a ring entry is [position, bytes, dtype, shape] of ints, a "
                            "dtype string and at most 32 dimensions")
    return at, n, dtype, shape


def _dtype(text: str) -> np.dtype[Any]:
    try:
        dt = np.dtype(text)
    except TypeError:
        raise ProtocolError(f"ring entry dtype {text!r} is not a NumPy dtype") from None
    if dt.kind not in _KINDS or dt.fields is not None or dt.itemsize > 16:
        raise ProtocolError(f"ring entry dtype {text!r}: only bool, int and float arrays")
    return dt
