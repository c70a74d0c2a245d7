"""Shared memory for the collective path between workers on one host.

On one host every byte a Unix socket carries is copied twice by the kernel (into the
socket, out of it). Two workers linked by a Unix socket (same host, same user: the
listener's SO_PEERCRED check, then the HMAC proof of :mod:`.collective`) move a round's
data through shared memory instead, and only small control messages through the socket.

A :class:`Segment` holds one key of one worker: its *push slot* (the whole value it
pushed, ``size`` elements) and its *sum slot* (the sum of the chunk it owns). It is an
anonymous ``memfd`` (no name in ``/dev/shm`` or anywhere in the file system: a killed
process leaves nothing behind, its mappings go with it), sealed at its size
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) and, once its owner has mapped it
writable, against every other write (``F_SEAL_FUTURE_WRITE``: only the owner's mapping
writes; another process of the same user that opens it through ``/proc/<pid>/fd`` gets
EPERM for ``write`` and for a writable mapping, where it could once rewrite a round's
data unnoticed, issue #34), and its descriptor travels to each peer
over the already authenticated link with ``SCM_RIGHTS`` (:func:`fd_message`, read by
:class:`FdInbox`). A receiver maps a peer's segment read-only, and only after checking
that the descriptor is a memfd of exactly the expected size, sealed so (both seals): a
peer could otherwise shrink the file under the mapping, and a read past its end would kill
the process (SIGBUS). Anything else is refused (:class:`ProtocolError`), never a crash.

Sizes are fixed when the segment is made (:func:`layout`): ``size`` elements plus the
owner's chunk, i.e. about ``(1 + 1/W)`` of the key's bytes per worker; a peer's segment
is mapped, not copied. The round rules (who may write a slot when) are
:mod:`.collective`'s, in its docstring.
"""
from __future__ import annotations

import array
import fcntl
import functools
import mmap
import os
import socket
import stat
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import ProtocolError

__all__ = ["F_SEAL_FUTURE_WRITE", "FdInbox", "Layout", "SEGMENT_SEALS", "Segment",
           "fd_message", "layout", "map_sealed", "seals_writes", "supported"]

#: the seals a peer's segment must carry: its size can never change under a mapping
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL \
    if hasattr(fcntl, "F_SEAL_SHRINK") else 0
#: linux/fcntl.h (Linux 5.1; not in the fcntl module): no write, and no writable mapping,
#: from now on; mappings made before it keep writing
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: the seals of a collective segment: fixed size, written only through its owner's mapping
SEGMENT_SEALS = SEALS | F_SEAL_FUTURE_WRITE if SEALS else 0
#: descriptors one link may hold received and not taken yet; more is a broken rule
MAX_PENDING = 8
_ALIGN = 64
_FD_SIZE = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(MAX_PENDING * _FD_SIZE) if hasattr(socket, "CMSG_SPACE") else 0


@functools.cache
def seals_writes() -> bool:
    """Whether this kernel seals a memfd against other writers (``F_SEAL_FUTURE_WRITE``,
    Linux 5.1): without it the collective path keeps its data on the sockets."""
    if not supported():
        return False
    fd = os.memfd_create("pskv-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEGMENT_SEALS)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def supported() -> bool:
    """Whether this platform has sealed memfds and descriptor passing (Linux)."""
    return hasattr(os, "memfd_create") and bool(SEALS) and hasattr(socket, "SCM_RIGHTS") \
        and hasattr(socket.socket, "recvmsg_into")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one worker's slots of one key lie in its segment (bytes)."""

    dtype: np.dtype[Any]
    size: int             # elements of the push slot (the key's)
    chunk: int            # elements of the sum slot (the owner's chunk)

    @property
    def sum_offset(self) -> int:
        return -(-self.size * self.dtype.itemsize // _ALIGN) * _ALIGN

    @property
    def nbytes(self) -> int:
        # never 0: an empty mapping cannot be made
        return max(self.sum_offset + self.chunk * self.dtype.itemsize, _ALIGN)


def layout(size: int, dtype: np.dtype[Any], bounds: tuple[int, int]) -> Layout:
    """The segment of the worker that owns chunk ``bounds`` of a key of ``size`` elements."""
    return Layout(np.dtype(dtype), size, bounds[1] - bounds[0])


class Segment:
    """One worker's shared memory for one key: ``push`` (the value it pushed) and ``total``
    (the sum of its chunk). Made by :meth:`create` (this worker's, writable, with ``fd`` to
    send) or :meth:`open` (a peer's, read-only, no descriptor kept)."""

    def __init__(self, mm: mmap.mmap, lay: Layout, fd: int) -> None:
        self._mm = mm
        self.layout = lay
        #: the memfd, kept to send to peers (-1 for a peer's segment)
        self.fd = fd
        self.push = np.frombuffer(mm, lay.dtype, lay.size, 0)
        self.total = np.frombuffer(mm, lay.dtype, lay.chunk, lay.sum_offset)

    @classmethod
    def create(cls, lay: Layout, name: str) -> Segment:
        """A fresh memfd of ``lay.nbytes``, mapped read-write, then sealed
        (:data:`SEGMENT_SEALS`): from then on only this mapping writes it."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, lay.nbytes)
            mm = mmap.mmap(fd, lay.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEGMENT_SEALS)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, lay, fd)

    @classmethod
    def open(cls, fd: int, lay: Layout, who: str, what: str) -> Segment:
        """Map a peer's segment read-only after checking it; ``fd`` is closed either way.

        Raises ProtocolError (naming ``who`` and ``what``) for anything but a memfd of
        ``lay.nbytes`` bytes sealed against any change of size and any write but its
        owner's (:data:`SEGMENT_SEALS`).
        """
        try:
            mm = map_sealed(fd, lay.nbytes, f"{who} sent {what} that", writable=False,
                            seals=SEGMENT_SEALS)
        finally:
            os.close(fd)
        return cls(mm, lay, -1)

    def close(self) -> None:
        """Unmap (once nothing views it any more) and close the descriptor; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        del self.push, self.total
        self.push = self.total = np.empty(0, self.layout.dtype)
        try:
            self._mm.close()
        except BufferError:     # a view is still alive: unmapped when the last one goes
            pass


def map_sealed(fd: int, nbytes: int, subject: str, writable: bool,
               seals: int = SEALS) -> mmap.mmap:
    """Map memory file ``fd`` (left open) after checking that it is a memfd of exactly
    ``nbytes`` bytes sealed against any change of size (and with any other of ``seals``);
    ProtocolError saying what else it is, after ``subject`` (e.g. "worker 1 sent a
    segment that")."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(f"{subject} is not a memory file")
    try:
        has = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError(f"{subject} is not a memfd") from None
    if has & SEALS != SEALS:
        raise ProtocolError(f"{subject} is a memfd whose size is not sealed (F_SEAL_SHRINK, "
                            "F_SEAL_GROW and F_SEAL_SEAL)")
    if st.st_size != nbytes:
        raise ProtocolError(f"{subject} is of {st.st_size} bytes, not {nbytes}")
    if has & seals != seals:
        raise ProtocolError(f"{subject} is a memfd that other processes may still write "
                            "(no F_SEAL_FUTURE_WRITE)")
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                         mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except (OSError, ValueError) as err:
        raise ProtocolError(f"{subject} cannot be mapped: {err}") from None


def fd_message(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    """The ancillary data of a ``sendmsg`` that passes ``fds`` (SCM_RIGHTS)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


class FdInbox:
    """What a link's socket reads, with the descriptors passed along (a StreamConn's
    ``reader``): they queue here, oldest first, until a SEGMENT message takes one.

    Invariant: at most :data:`MAX_PENDING` are held; a peer that passes more (or more in
    one message than fit) is a broken rule, said by :meth:`take`. Descriptors never taken
    are closed by :meth:`close`.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fds: deque[int] = deque()
        self.overflow = False

    def recv_into(self, view: memoryview, nbytes: int) -> int:
        got, ancillary, flags, _ = self._sock.recvmsg_into(
            [view[:nbytes]], _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[:len(data) - len(data) % _FD_SIZE])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            self.overflow = True
        while len(self._fds) > MAX_PENDING:
            os.close(self._fds.pop())
            self.overflow = True
        return got

    def take(self) -> int | None:
        """The oldest descriptor received (the caller owns it), or None.

        Raises ProtocolError when the peer passed more than a link holds."""
        if self.overflow:
            raise ProtocolError(f"more than {MAX_PENDING} descriptors at once")
        return self._fds.popleft() if self._fds else None

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())
